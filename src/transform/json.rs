//! A borrowed, single-pass walk over a request body that is already known to
//! be valid JSON (the proxy validates every transformed body as it arrives).
//!
//! The transforms only need a few places of a request (message roles, content
//! parts, image fields); everything else, megabytes of base64 included, is
//! skipped with `memchr` and never copied or parsed into values. Each place
//! is found as a byte range of the original body, so a rewrite can splice
//! the few changed ranges and copy every other byte as it was.
//!
//! Skipping is iterative: a body nested a million levels deep costs a
//! counter, not the stack. Only the transforms' own descent recurses, and
//! that is bounded by the shapes they look for.

use std::borrow::Cow;
use std::ops::Range;

/// The body was not the JSON the walk expected (it should have been
/// validated first); the caller leaves the request unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

pub type Result<T> = std::result::Result<T, Malformed>;

/// A string literal: its range in the source (quotes included) and whether
/// it holds escapes (then it must be decoded before use).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Str {
    pub range: Range<usize>,
    pub escaped: bool,
}

impl Str {
    /// The literal's contents between the quotes, undecoded.
    pub fn raw<'a>(&self, src: &'a [u8]) -> &'a [u8] {
        src.get(self.range.start + 1..self.range.end - 1)
            .unwrap_or_default()
    }

    /// The decoded string, borrowed when it has no escapes.
    pub fn decode<'a>(&self, src: &'a [u8]) -> Option<Cow<'a, str>> {
        if self.escaped {
            unescape(self.raw(src)).map(Cow::Owned)
        } else {
            std::str::from_utf8(self.raw(src)).ok().map(Cow::Borrowed)
        }
    }

    /// True when the literal is exactly `"name"` (no escapes).
    pub fn is(&self, src: &[u8], name: &str) -> bool {
        !self.escaped && self.raw(src) == name.as_bytes()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Object,
    Array,
    String,
    Other,
}

pub struct Cursor<'a> {
    src: &'a [u8],
    pos: usize,
    /// Runs of whitespace between tokens passed so far (a compact body
    /// has none).
    spaces: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(src: &'a [u8]) -> Self {
        Self {
            src,
            pos: 0,
            spaces: 0,
        }
    }

    /// A cursor on the value that starts at `pos` of `src`.
    pub fn at(src: &'a [u8], pos: usize) -> Self {
        Self {
            src,
            pos,
            spaces: 0,
        }
    }

    /// Runs of whitespace between tokens this cursor has passed: when it
    /// did not change over a value, the value is written compact.
    pub fn spaces(&self) -> usize {
        self.spaces
    }

    pub fn src(&self) -> &'a [u8] {
        self.src
    }

    fn ws(&mut self) {
        let start = self.pos;
        while let Some(b) = self.src.get(self.pos) {
            if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
                self.pos += 1;
            } else {
                break;
            }
        }
        self.spaces += usize::from(self.pos != start);
    }

    fn byte(&self) -> Result<u8> {
        self.src.get(self.pos).copied().ok_or(Malformed)
    }

    fn expect(&mut self, b: u8) -> Result<()> {
        self.ws();
        if self.byte()? == b {
            self.pos += 1;
            Ok(())
        } else {
            Err(Malformed)
        }
    }

    /// The kind of the next value.
    pub fn kind(&mut self) -> Result<Kind> {
        self.ws();
        Ok(match self.byte()? {
            b'{' => Kind::Object,
            b'[' => Kind::Array,
            b'"' => Kind::String,
            _ => Kind::Other,
        })
    }

    /// Reads a string literal.
    pub fn string(&mut self) -> Result<Str> {
        self.ws();
        let start = self.pos;
        if self.byte()? != b'"' {
            return Err(Malformed);
        }
        // Quote to quote (a text of many lines holds an escape every few
        // dozen bytes, a quote seldom): a quote after an odd number of
        // backslashes is part of the string.
        let mut i = start + 1;
        loop {
            let rest = self.src.get(i..).ok_or(Malformed)?;
            let q = i + memchr::memchr(b'"', rest).ok_or(Malformed)?;
            let inner = self.src.get(start + 1..q).ok_or(Malformed)?;
            let backslashes = inner.iter().rev().take_while(|&&b| b == b'\\').count();
            if backslashes % 2 == 1 {
                i = q + 1;
                continue;
            }
            self.pos = q + 1;
            return Ok(Str {
                range: start..self.pos,
                escaped: memchr::memchr(b'\\', inner).is_some(),
            });
        }
    }

    /// Skips the next value, however deep, without recursion.
    pub fn skip(&mut self) -> Result<Range<usize>> {
        self.ws();
        let start = self.pos;
        match self.byte()? {
            b'"' => {
                self.string()?;
            }
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match self.byte()? {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b' ' | b'\t' | b'\n' | b'\r' => self.spaces += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.pos += 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                    self.pos += 1;
                }
            }
            _ => {
                while let Some(b) = self.src.get(self.pos) {
                    if matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                        break;
                    }
                    self.pos += 1;
                }
                if self.pos == start {
                    return Err(Malformed);
                }
            }
        }
        Ok(start..self.pos)
    }

    /// Walks an object: `f` is called with each key, the cursor before the
    /// value, and must consume the value (read it, walk it or skip it).
    pub fn object(
        &mut self,
        mut f: impl FnMut(&mut Self, Str) -> Result<()>,
    ) -> Result<Range<usize>> {
        self.ws();
        let start = self.pos;
        self.expect(b'{')?;
        self.ws();
        if self.byte()? == b'}' {
            self.pos += 1;
            return Ok(start..self.pos);
        }
        loop {
            let key = self.string()?;
            self.expect(b':')?;
            f(self, key)?;
            self.ws();
            match self.byte()? {
                b',' => self.pos += 1,
                b'}' => {
                    self.pos += 1;
                    return Ok(start..self.pos);
                }
                _ => return Err(Malformed),
            }
        }
    }

    /// Goes on with an object after one of its members' values (the cursor
    /// just after it): `f` as for [`Cursor::object`], for the members left.
    pub fn object_rest(&mut self, mut f: impl FnMut(&mut Self, Str) -> Result<()>) -> Result<()> {
        loop {
            self.ws();
            match self.byte()? {
                b',' => self.pos += 1,
                b'}' => {
                    self.pos += 1;
                    return Ok(());
                }
                _ => return Err(Malformed),
            }
            let key = self.string()?;
            self.expect(b':')?;
            f(self, key)?;
        }
    }

    /// Goes on with an array after its element `next - 1` (the cursor just
    /// after it): `f` as for [`Cursor::array`], from index `next`.
    pub fn array_rest(
        &mut self,
        next: usize,
        mut f: impl FnMut(&mut Self, usize) -> Result<()>,
    ) -> Result<()> {
        let mut i = next;
        loop {
            self.ws();
            match self.byte()? {
                b',' => self.pos += 1,
                b']' => {
                    self.pos += 1;
                    return Ok(());
                }
                _ => return Err(Malformed),
            }
            f(self, i)?;
            i += 1;
        }
    }

    /// Walks an array: `f` is called with each index, the cursor before the
    /// element, and must consume it.
    pub fn array(
        &mut self,
        mut f: impl FnMut(&mut Self, usize) -> Result<()>,
    ) -> Result<Range<usize>> {
        self.ws();
        let start = self.pos;
        self.expect(b'[')?;
        self.ws();
        if self.byte()? == b']' {
            self.pos += 1;
            return Ok(start..self.pos);
        }
        let mut i = 0;
        loop {
            f(self, i)?;
            i += 1;
            self.ws();
            match self.byte()? {
                b',' => self.pos += 1,
                b']' => {
                    self.pos += 1;
                    return Ok(start..self.pos);
                }
                _ => return Err(Malformed),
            }
        }
    }
}

/// Copies `src` with each `(range, replacement)` edit applied. Edits must be
/// sorted by start and must not overlap.
pub fn splice(src: &[u8], edits: &[(Range<usize>, Vec<u8>)]) -> Vec<u8> {
    let removed: usize = edits.iter().map(|(r, _)| r.len()).sum();
    let added: usize = edits.iter().map(|(_, b)| b.len()).sum();
    let mut out = Vec::with_capacity((src.len() + added).saturating_sub(removed));
    let mut at = 0;
    for (r, b) in edits {
        out.extend_from_slice(src.get(at..r.start).unwrap_or_default());
        out.extend_from_slice(b);
        at = r.end;
    }
    out.extend_from_slice(src.get(at..).unwrap_or_default());
    out
}

/// Like [`splice`], but the copied ranges lose the whitespace between their
/// JSON tokens (string literals are copied whole): a body visor rewrites
/// goes out compact. Each copied range must begin and end outside a string
/// (edits replace whole values), and the replacements must be compact.
pub fn splice_compact(src: &[u8], edits: &[(Range<usize>, Vec<u8>)]) -> Vec<u8> {
    let removed: usize = edits.iter().map(|(r, _)| r.len()).sum();
    let added: usize = edits.iter().map(|(_, b)| b.len()).sum();
    let mut out = Vec::with_capacity((src.len() + added).saturating_sub(removed));
    let mut at = 0;
    for (r, b) in edits {
        copy_compact(&mut out, src.get(at..r.start).unwrap_or_default());
        out.extend_from_slice(b);
        at = r.end;
    }
    copy_compact(&mut out, src.get(at..).unwrap_or_default());
    out
}

fn copy_compact(out: &mut Vec<u8>, s: &[u8]) {
    let ws = |b: u8| matches!(b, b' ' | b'\n' | b'\r' | b'\t');
    let mut i = 0;
    while i < s.len() {
        if ws(s[i]) {
            i += 1;
        } else if s[i] == b'"' {
            let end = literal_end(s, i);
            out.extend_from_slice(&s[i..end]);
            i = end;
        } else {
            let start = i;
            while i < s.len() && !ws(s[i]) && s[i] != b'"' {
                i += 1;
            }
            out.extend_from_slice(&s[start..i]);
        }
    }
}

/// The end of the string literal that opens at `start` (or the end of
/// `s` when it is not closed).
fn literal_end(s: &[u8], start: usize) -> usize {
    let mut i = start + 1;
    while let Some(k) = s
        .get(i..)
        .and_then(|rest| memchr::memchr2(b'"', b'\\', rest))
    {
        if s[i + k] == b'"' {
            return i + k + 1;
        }
        i += k + 2;
    }
    s.len()
}

/// The text of a string literal's contents (between the quotes) that holds
/// escapes. Runs without escapes are copied whole (found with `memchr`);
/// `None` for an invalid escape or invalid UTF-8.
pub fn unescape(raw: &[u8]) -> Option<String> {
    let mut out: Vec<u8> = Vec::with_capacity(raw.len());
    let mut at = 0;
    while let Some(k) = memchr::memchr(b'\\', &raw[at..]) {
        out.extend_from_slice(&raw[at..at + k]);
        let i = at + k + 1;
        let (byte, next) = match *raw.get(i)? {
            b'n' => (b'\n', i + 1),
            b't' => (b'\t', i + 1),
            b'r' => (b'\r', i + 1),
            b'"' => (b'"', i + 1),
            b'\\' => (b'\\', i + 1),
            b'/' => (b'/', i + 1),
            b'b' => (0x08, i + 1),
            b'f' => (0x0c, i + 1),
            b'u' => {
                let (c, next) = code_point(raw, i + 1)?;
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                at = next;
                continue;
            }
            _ => return None,
        };
        out.push(byte);
        at = next;
    }
    out.extend_from_slice(&raw[at..]);
    String::from_utf8(out).ok()
}

/// The character of a `\uXXXX` escape whose hex digits start at `i` (a
/// surrogate pair takes the `\uXXXX` after it), and where it ends.
fn code_point(raw: &[u8], i: usize) -> Option<(char, usize)> {
    let hex4 = |i: usize| -> Option<u32> {
        let digits = std::str::from_utf8(raw.get(i..i + 4)?).ok()?;
        u32::from_str_radix(digits, 16).ok()
    };
    let hi = hex4(i)?;
    if (0xD800..0xDC00).contains(&hi) {
        if raw.get(i + 4..i + 6)? != b"\\u" {
            return None;
        }
        let lo = hex4(i + 6)?;
        if !(0xDC00..0xE000).contains(&lo) {
            return None;
        }
        let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
        return Some((char::from_u32(c)?, i + 10));
    }
    Some((char::from_u32(hi)?, i + 4))
}

/// True when `text` is one JSON value (any kind; the proxy's own
/// validator takes objects only).
pub fn is_json(text: &[u8]) -> bool {
    serde_json::from_slice::<serde::de::IgnoredAny>(text).is_ok()
}

/// `s` as a JSON string literal.
pub fn quote(s: &str) -> Vec<u8> {
    serde_json::to_vec(s).unwrap_or_else(|_| b"\"\"".to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_objects_and_arrays_and_skips_the_rest() {
        let src = br#" {"a": [1, {"b": "x\"y"}, true], "c" : {"d": null}, "e": "\u00e9"} "#;
        let mut c = Cursor::new(src);
        let mut keys = Vec::new();
        let mut e = None;
        c.object(|c, k| {
            keys.push(String::from_utf8(k.raw(src).to_vec()).unwrap());
            if k.is(src, "e") {
                e = Some(c.string()?);
                Ok(())
            } else if k.is(src, "a") {
                let mut kinds = Vec::new();
                c.array(|c, _| {
                    kinds.push(c.kind()?);
                    c.skip().map(drop)
                })?;
                assert_eq!(kinds, vec![Kind::Other, Kind::Object, Kind::Other]);
                Ok(())
            } else {
                c.skip().map(drop)
            }
        })
        .unwrap();
        assert_eq!(keys, ["a", "c", "e"]);
        let e = e.unwrap();
        assert!(e.escaped);
        assert_eq!(e.decode(src).unwrap(), "é");
    }

    #[test]
    fn a_string_ends_at_a_quote_after_an_even_run_of_backslashes() {
        for (lit, decoded) in [
            (r#""a\\""#, r"a\"),
            (r#""a\"b""#, r#"a"b"#),
            (r#""\\\"x""#, r#"\"x"#),
            (r#""\\\\""#, r"\\"),
            (r#""line\nline""#, "line\nline"),
            (r#""plain""#, "plain"),
        ] {
            let src = format!("{lit},1");
            let mut c = Cursor::new(src.as_bytes());
            let s = c.string().unwrap();
            assert_eq!(s.range, 0..lit.len(), "{lit}");
            assert_eq!(s.escaped, lit.contains('\\'), "{lit}");
            assert_eq!(s.decode(src.as_bytes()).unwrap(), decoded, "{lit}");
        }
        // Its only quote after it is escaped: the string never ends.
        let mut c = Cursor::new(br#""open\""#);
        assert_eq!(c.string(), Err(Malformed));
    }

    #[test]
    fn deep_nesting_is_skipped_without_recursion() {
        let deep = format!("{}{}", "[".repeat(1_000_000), "]".repeat(1_000_000));
        let mut c = Cursor::new(deep.as_bytes());
        assert_eq!(c.skip().unwrap(), 0..deep.len());
    }

    #[test]
    fn truncated_input_is_malformed_not_a_panic() {
        for src in [
            &b"{\"a\":"[..],
            b"[1,",
            b"\"abc",
            b"{\"a\" 1}",
            b"",
            b"[\"\\",
        ] {
            let mut c = Cursor::new(src);
            let r = c.object(|c, _| c.skip().map(drop));
            assert_eq!(r, Err(Malformed), "{:?}", String::from_utf8_lossy(src));
        }
    }

    #[test]
    fn unescape_agrees_with_serde_json() {
        for lit in [
            r#""a\nb\t\"c\"\\ \/ \b\f\r""#,
            r#""\u00e9t\u00E9 \ud83d\ude00 end""#,
            r#""no escapes at all""#,
            r#""\\""#,
        ] {
            let want: String = serde_json::from_str(lit).unwrap();
            let raw = &lit.as_bytes()[1..lit.len() - 1];
            assert_eq!(unescape(raw).as_deref(), Some(want.as_str()), "{lit}");
        }
        for bad in [&br"\x"[..], br"\u12", br"\ud83d", br"\ud83d\u0041", b"\\"] {
            assert_eq!(unescape(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn splice_compact_drops_whitespace_between_tokens_only() {
        let src = br#"{ "a" : [1, 2.50,  "x  \" y" ],
  "b": "gone", "c":	true }"#;
        let b = memchr::memmem::find(src, br#""gone""#).unwrap();
        let out = splice_compact(src, &[(b..b + 6, br#""new""#.to_vec())]);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"a":[1,2.50,"x  \" y"],"b":"new","c":true}"#
        );
    }

    #[test]
    fn splice_replaces_ranges_and_copies_the_rest() {
        let out = splice(b"0123456789", &[(1..3, b"ab".to_vec()), (5..9, Vec::new())]);
        assert_eq!(out, b"0ab349");
    }
}
