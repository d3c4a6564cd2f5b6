//! The bodies the inspector keeps: the client's and the upstream's JSON of
//! the newest requests, without the bytes of any image, document or audio
//! (each long base64 run becomes `[base64: N bytes, sha256:…]`, the 12 hex
//! digits the artifacts answer to), bounded in all by `[inspector]
//! body_bytes`, the oldest dropped first.

use std::collections::VecDeque;
use std::fmt::Write as _;

use bytes::Bytes;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// A base64 run shorter than this is kept as it is (ids, hashes, small
/// icons are text a reader wants to see).
pub const MIN_RUN: usize = 512;

/// An array of this many byte values or more (Node's `Buffer.toJSON`) is
/// kept as its count.
pub const MIN_BYTE_ARRAY: usize = 256;

/// `body` as the inspector keeps it, compact JSON: every base64 payload
/// (a `data:…;base64,` URL's, or a run of [`MIN_RUN`] base64 characters,
/// escaped slashes and line breaks included) replaced by a reference, byte
/// arrays by their count, credentials (`authorization`, `api_key`,
/// `token`, `password`, a tool's `headers`, a signed URL's query) by
/// `[redacted]`. `None` when it is not JSON.
pub fn without_media(body: &Bytes) -> Option<Bytes> {
    kept(body, false)
}

/// [`without_media`] of a body already checked to be JSON (the proxy's
/// reading of a request, visor's own rewrite): not checked again.
pub fn without_media_of_json(body: &Bytes) -> Option<Bytes> {
    kept(body, true)
}

/// [`without_media_of_json`] of a body whose first `clean` bytes are known
/// to hold nothing it replaces: they are, up to just after its last
/// message (outside any string), a body that was found so. Only what
/// follows is looked at; also whether the whole body holds nothing (then
/// it is kept as it came).
pub fn without_media_of_json_after(body: &Bytes, clean: usize) -> (Option<Bytes>, bool) {
    let clean = clean.min(body.len());
    if !may_hold_media_or_secrets_after(body, clean) {
        return (Some(body.clone()), true);
    }
    (stripped(body), false)
}

fn stripped(body: &Bytes) -> Option<Bytes> {
    // A megabyte image's string is cut to its reference before the body
    // is parsed: the document is built of what remains.
    let cut = cut_long_strings(body);
    let mut v: Value = serde_json::from_slice(cut.as_deref().unwrap_or(body)).ok()?;
    strip(&mut v, 0);
    serde_json::to_vec(&v).ok().map(Bytes::from)
}

/// `body` with each string value of [`REMEMBERED_RUN`] bytes or more that
/// reads the same parsed as written (no escape, no control character,
/// UTF-8) and is not a URL replaced by what [`strip`] would make of it
/// ([`replace_runs`]); `None` when there is none. What `strip` then does
/// with the cut body is what it does with the whole: such a string's
/// runs are what the parsed string's are, its references hold no run,
/// and keys (which `strip` leaves) are not cut.
fn cut_long_strings(body: &[u8]) -> Option<Vec<u8>> {
    if body.len() < REMEMBERED_RUN {
        return None;
    }
    let mut out: Option<Vec<u8>> = None;
    let (mut i, mut copied) = (0, 0);
    while let Some(q) = memchr::memchr(b'"', &body[i..]) {
        let start = i + q + 1;
        // The string's end, and whether it holds an escape.
        let (mut end, mut escaped) = (start, false);
        loop {
            let Some(k) = memchr::memchr2(b'"', b'\\', &body[end..]) else {
                return out.map(|mut o| {
                    o.extend_from_slice(&body[copied..]);
                    o
                });
            };
            end += k;
            if body[end] == b'"' {
                break;
            }
            escaped = true;
            end += 2;
            if end >= body.len() {
                return None;
            }
        }
        i = end + 1;
        let content = &body[start..end];
        let key = body[i..]
            .iter()
            .find(|c| !c.is_ascii_whitespace())
            .is_some_and(|&c| c == b':');
        if escaped || key || content.len() < REMEMBERED_RUN {
            continue;
        }
        if content.starts_with(b"http://") || content.starts_with(b"https://") {
            continue;
        }
        if content.iter().fold(false, |any, &c| any | (c < 0x20)) {
            continue;
        }
        let Ok(text) = std::str::from_utf8(content) else {
            continue;
        };
        if let Some(r) = replace_runs(text) {
            // Each later cut only shortens what this one leaves.
            let o =
                out.get_or_insert_with(|| Vec::with_capacity(body.len() - content.len() + r.len()));
            o.extend_from_slice(&body[copied..start]);
            o.extend_from_slice(r.as_bytes());
            copied = end;
        }
    }
    out.map(|mut o| {
        o.extend_from_slice(&body[copied..]);
        o
    })
}

fn kept(body: &Bytes, checked: bool) -> Option<Bytes> {
    // Most requests hold nothing to strip: kept as they came, once one
    // pass says so (the caller's own copy: see `Inspector::hold`).
    if !may_hold_media_or_secrets(body) {
        // Still JSON (read without building anything): what is not, is not
        // kept.
        if !checked {
            serde_json::from_slice::<serde::de::IgnoredAny>(body).ok()?;
        }
        return Some(body.clone());
    }
    stripped(body)
}

/// Whether `body` may hold something [`without_media`] replaces: a long
/// run of base64 (or of digits and commas: a byte array), a `data:` URL, a
/// key that names a credential or headers, or a string that is a URL with
/// a signed query (a key or URL written with an escape is taken to). A
/// false positive only costs the full read; a body of any size that holds
/// none of them (an agent's text history) is kept as it came.
fn may_hold_media_or_secrets(body: &[u8]) -> bool {
    may_hold_media_or_secrets_after(body, 0)
}

/// [`may_hold_media_or_secrets`] of what follows `from`, a point outside
/// any string after an ASCII byte: no word, string or run that holds
/// `from - 1` can be one of them, and the runs are counted in the same
/// 64-byte blocks as from the start.
fn may_hold_media_or_secrets_after(body: &[u8], from: usize) -> bool {
    let rest = &body[from..];
    if finder(Word::Base64Url).find(rest).is_some() || std::str::from_utf8(rest).is_err() {
        return true;
    }
    long_runs(&body[from - from % 64..]) || may_hold_secrets(rest)
}

/// Whether `body` may hold a run of [`MIN_RUN`] base64 characters
/// (backslashes taken as escaped slashes or line breaks) or of
/// `MIN_BYTE_ARRAY * 2 - 1` digits, commas and spaces (a byte array,
/// pretty-printed ones break lines between values). Read a 64-byte block
/// at a time: a block of text leaves either class at its first space or
/// letter, and such a run fills at least `run / 64 - 1` whole blocks in a
/// row.
fn long_runs(body: &[u8]) -> bool {
    const BLOCK: usize = 64;
    let b64_blocks = MIN_RUN / BLOCK - 1;
    let digit_blocks = (MIN_BYTE_ARRAY * 2 - 1) / BLOCK - 1;
    let (mut b64, mut digits) = (0usize, 0usize);
    for block in body.chunks_exact(BLOCK) {
        b64 = match block.iter().all(|&c| is_b64(c) || c == b'\\') {
            true => b64 + 1,
            false => 0,
        };
        digits = match block
            .iter()
            .all(|&c| c.is_ascii_digit() || matches!(c, b',' | b' ' | b'\n' | b'\r' | b'\t'))
        {
            true => digits + 1,
            false => 0,
        };
        if b64 >= b64_blocks || digits >= digit_blocks {
            return true;
        }
    }
    false
}

/// The words the precheck looks for, each searcher built once.
#[derive(Clone, Copy)]
enum Word {
    Base64Url,
    Escape,
}

fn finder(w: Word) -> &'static memchr::memmem::Finder<'static> {
    use memchr::memmem::Finder;
    use std::sync::LazyLock;
    static FINDERS: LazyLock<[Finder<'static>; 2]> =
        LazyLock::new(|| [Finder::new(b";base64,"), Finder::new(b"\\u")]);
    &FINDERS[w as usize]
}

/// Whether a key of `body` names a credential or headers, or a string is
/// an `http(s)` URL with a signed query: its strings read at memchr speed,
/// without parsing. Unterminated JSON says yes (the full read refuses it).
fn may_hold_secrets(body: &[u8]) -> bool {
    let mut i = 0;
    while let Some(q) = memchr::memchr(b'"', &body[i..]) {
        let start = i + q + 1;
        // Quote to quote: a quote after an odd number of backslashes is
        // inside the string.
        let mut end = start;
        loop {
            let Some(k) = body.get(end..).and_then(|rest| memchr::memchr(b'"', rest)) else {
                return true;
            };
            end += k;
            let before = body[start..end].iter().rev().take_while(|&&c| c == b'\\');
            if before.count() % 2 == 0 {
                break;
            }
            end += 1;
        }
        let text = &body[start..end];
        let escaped = memchr::memchr(b'\\', text).is_some();
        let is_key = body[end + 1..]
            .iter()
            .find(|c| !c.is_ascii_whitespace())
            .is_some_and(|&c| c == b':');
        let has = |w: Word| finder(w).find(text).is_some();
        // (The body is UTF-8: checked before.)
        let worth = match is_key {
            true => escaped || is_secret_key_bytes(text) || text.eq_ignore_ascii_case(b"headers"),
            // Escaped: read as JSON reads it (`\u0068ttps:`, `\u003bbase64,`)
            // when it may be a URL (it starts so, or a `\u` escape may spell
            // it) or hide a data URL (`;base64,` as written was looked for
            // in the whole body).
            false if escaped => {
                (text.starts_with(b"http") || has(Word::Escape)) && {
                    let decoded: Option<String> =
                        serde_json::from_slice(&body[start - 1..=end]).ok();
                    decoded.is_none_or(|d| redact_url(&d).is_some() || d.contains(";base64,"))
                }
            }
            false => {
                text.starts_with(b"http")
                    && std::str::from_utf8(text).map_or(true, |v| redact_url(v).is_some())
            }
        };
        if worth {
            return true;
        }
        i = end + 1;
    }
    false
}

fn strip(v: &mut Value, depth: usize) {
    // As deep as serde_json parses (128); deeper is left as it is.
    if depth > 160 {
        return;
    }
    match v {
        Value::String(s) => {
            if let Some(r) = redact_url(s).or_else(|| replace_runs(s)) {
                *s = r;
            }
        }
        Value::Array(a) if a.len() >= MIN_BYTE_ARRAY && a.iter().all(is_byte) => {
            *v = Value::String(format!("[{} byte values]", a.len()));
        }
        Value::Array(a) => a.iter_mut().for_each(|x| strip(x, depth + 1)),
        Value::Object(o) => {
            for (k, x) in o.iter_mut() {
                if is_secret_key(k) && !x.is_null() {
                    *x = Value::String("[redacted]".to_owned());
                } else if k.eq_ignore_ascii_case("headers") && x.is_object() {
                    if let Value::Object(h) = x {
                        h.values_mut()
                            .for_each(|h| *h = Value::String("[redacted]".to_owned()));
                    }
                } else {
                    strip(x, depth + 1);
                }
            }
        }
        _ => {}
    }
}

fn is_byte(v: &Value) -> bool {
    v.as_u64().is_some_and(|n| n <= 255)
}

/// A key that names a credential (case and `-`/`_` aside), read without
/// allocating: the names are under 20 bytes.
fn is_secret_key_bytes(k: &[u8]) -> bool {
    let mut folded = [0u8; 20];
    let Some(to) = folded.get_mut(..k.len()) else {
        return false;
    };
    for (t, &c) in to.iter_mut().zip(k) {
        *t = if c == b'-' {
            b'_'
        } else {
            c.to_ascii_lowercase()
        };
    }
    matches!(
        &folded[..k.len()],
        b"authorization"
            | b"authorization_token"
            | b"proxy_authorization"
            | b"api_key"
            | b"apikey"
            | b"x_api_key"
            | b"token"
            | b"access_token"
            | b"refresh_token"
            | b"id_token"
            | b"bearer"
            | b"secret"
            | b"client_secret"
            | b"password"
            | b"passwd"
            | b"cookie"
            | b"set_cookie"
    )
}

/// A field that holds a credential.
fn is_secret_key(k: &str) -> bool {
    is_secret_key_bytes(k.as_bytes())
}

/// An `http(s)` URL whose query carries a signature, token or key
/// (a presigned link): its query replaced, whatever the URL's length (a
/// presigned link can run past 8 KiB). A parameter's name is matched
/// without case by one searcher made once, so a long query costs one pass.
fn redact_url(s: &str) -> Option<String> {
    use std::sync::LazyLock;
    static SIGNED: LazyLock<Option<aho_corasick::AhoCorasick>> = LazyLock::new(|| {
        let words = [
            "sig",
            "signature",
            "token",
            "key",
            "credential",
            "auth",
            "secret",
            "password",
        ];
        aho_corasick::AhoCorasick::builder()
            .ascii_case_insensitive(true)
            .build(words)
            .ok()
    });
    if !(s.starts_with("https://") || s.starts_with("http://")) {
        return None;
    }
    let (base, query) = s.split_once('?')?;
    let named = |name: &str| match SIGNED.as_ref() {
        Some(words) => words.is_match(name),
        // (Literal words always build a searcher.) Any name then counts.
        None => true,
    };
    let signed = query
        .split('&')
        .any(|p| named(p.split('=').next().unwrap_or("")));
    signed.then(|| format!("{base}?[redacted]"))
}

fn is_b64(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'+' | b'/' | b'-' | b'_' | b'=')
}

/// `s` with each base64 payload replaced; `None` when it has none.
fn replace_runs(s: &str) -> Option<String> {
    if s.len() < MIN_RUN {
        return None;
    }
    let b = s.as_bytes();
    let mut out: Option<String> = None;
    let (mut i, mut copied) = (0, 0);
    while i < b.len() {
        // Whatever follows `;base64,` is the payload, to the string's end
        // or the first character base64 never holds.
        let data_url = b[..i].ends_with(b";base64,");
        if !is_b64(b[i]) {
            i += 1;
            continue;
        }
        let start = i;
        loop {
            // A megabyte payload: once a run is long, 32 bytes at a time
            // while they are all base64 (a test the compiler makes in a few
            // instructions; words of prose never get that far).
            while i - start >= 32
                && let Some(block) = b.get(i..i + 32)
                && block.iter().fold(true, |all, &c| all & is_b64(c))
            {
                i += 32;
            }
            match i < b.len() && (is_b64(b[i]) || continues_run(b, i)) {
                true => i += 1,
                false => break,
            }
        }
        let run = &s[start..i];
        // A run of letters alone is prose, not base64.
        let long = run.len() >= MIN_RUN || (data_url && run.len() >= 64);
        if long && run.bytes().any(|c| c.is_ascii_digit() || c == b'/') {
            let o = out.get_or_insert_with(|| String::with_capacity(s.len().min(4096)));
            o.push_str(&s[copied..start]);
            o.push_str(&reference(run));
            copied = i;
        }
    }
    let mut o = out?;
    o.push_str(&s[copied..]);
    Some(o)
}

/// Inside a run: a line break (real, or written `\n` / `\r\n` by a JSON
/// encoded twice) or an escaped slash (`\/`).
fn continues_run(b: &[u8], i: usize) -> bool {
    match b[i] {
        b'\n' | b'\r' => true,
        b'\\' => matches!(b.get(i + 1), Some(b'/' | b'n' | b'r')),
        _ => false,
    }
}

/// Runs at least this long are remembered by [`reference`].
const REMEMBERED_RUN: usize = 16 * 1024;

/// `[base64: 12345 bytes, sha256:7ae32ec79dcb]` (the bytes it decodes to),
/// or `[base64: 4000 characters]` when it does not decode. A long run's is
/// remembered (the newest 4,096, by a keyed hash of its text): an agent
/// sends its screenshots again with every turn, and hashing the text costs
/// a tenth of decoding it and hashing its bytes.
fn reference(run: &str) -> String {
    use std::sync::LazyLock;
    static MADE: LazyLock<(u64, moka::sync::Cache<u128, std::sync::Arc<str>>)> =
        LazyLock::new(|| {
            let seed = crate::transform::tenant(b"inspector references");
            (seed, moka::sync::Cache::new(4096))
        });
    if run.len() < REMEMBERED_RUN {
        return made(run);
    }
    let (seed, made_before) = &*MADE;
    let key = xxhash_rust::xxh3::xxh3_128_with_seed(run.as_bytes(), *seed);
    if let Some(r) = made_before.get(&key) {
        return r.to_string();
    }
    let r = made(run);
    made_before.insert(key, std::sync::Arc::from(r.as_str()));
    r
}

/// [`reference`], made.
fn made(run: &str) -> String {
    let b = run.as_bytes();
    // Most runs are plain base64: decoded as they are, not copied.
    let plain = b.chunks(32).all(|c| {
        c.iter().fold(true, |all, &x| {
            all & !matches!(x, b'\\' | b'\n' | b'\r' | b'-' | b'_')
        })
    });
    let clean: std::borrow::Cow<'_, [u8]> = match plain {
        true => std::borrow::Cow::Borrowed(b),
        false => std::borrow::Cow::Owned(unescaped(b)),
    };
    let trimmed = clean
        .iter()
        .rposition(|&c| c != b'=')
        .map_or(&clean[..0], |e| &clean[..=e]);
    match base64_simd::STANDARD_NO_PAD.decode_to_vec(trimmed) {
        Ok(bytes) => {
            let digest = Sha256::digest(&bytes);
            let mut hex = String::with_capacity(12);
            for b in &digest[..6] {
                let _ = write!(hex, "{b:02x}");
            }
            format!("[base64: {} bytes, sha256:{hex}]", bytes.len())
        }
        Err(_) => format!("[base64: {} characters]", run.len()),
    }
}

/// A run's base64 without its line breaks and escapes, URL-safe letters
/// made standard.
fn unescaped(b: &[u8]) -> Vec<u8> {
    let mut clean: Vec<u8> = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' if matches!(b.get(i + 1), Some(b'n' | b'r')) => i += 2,
            b'\\' => i += 1,
            b'\n' | b'\r' => i += 1,
            b'-' => {
                clean.push(b'+');
                i += 1;
            }
            b'_' => {
                clean.push(b'/');
                i += 1;
            }
            c => {
                clean.push(c);
                i += 1;
            }
        }
    }
    clean
}

/// The kept bodies of the newest requests, by the inspector's own number
/// for each request (ids are the client's, and may repeat), at most
/// `budget` bytes in all.
pub struct Bodies {
    budget: usize,
    /// At most this many (the summaries kept: older bodies are never
    /// looked at).
    most: usize,
    used: usize,
    newest_last: VecDeque<(u64, std::sync::Arc<Kept>)>,
}

/// One request's bodies as kept (compact JSON, as [`without_media`] made
/// them).
#[derive(Debug, Clone, PartialEq)]
pub struct Kept {
    /// What the client sent.
    pub client: Bytes,
    /// What went upstream, when visor changed it.
    pub upstream: Option<Bytes>,
    /// What the transforms did to each image, document and audio.
    pub notes: Vec<crate::transform::ImageNote>,
    /// Stored session messages put among the client's: how many, and
    /// before which of the client's messages.
    pub history_used: usize,
    pub history_at: usize,
}

impl Kept {
    pub fn new(client: Bytes, upstream: Option<Bytes>) -> Kept {
        Kept {
            client,
            upstream,
            notes: Vec::new(),
            history_used: 0,
            history_at: 0,
        }
    }

    /// The bytes this takes of the budget.
    pub fn size(&self) -> usize {
        let notes: usize = self
            .notes
            .iter()
            .map(|n| 128 + n.path.len() + n.sha256.len() + n.url.as_ref().map_or(0, String::len))
            .sum();
        self.client.len() + self.upstream.as_ref().map_or(0, Bytes::len) + notes
    }
}

impl Bodies {
    pub fn new(budget: usize, most: usize) -> Bodies {
        Bodies {
            budget,
            most,
            used: 0,
            newest_last: VecDeque::new(),
        }
    }

    /// Keeps `kept` for request number `seq`, dropping the oldest past the
    /// budget; a body larger than the whole budget is not kept (`false`).
    pub fn keep(&mut self, seq: u64, kept: Kept) -> bool {
        let size = kept.size();
        if size > self.budget {
            return false;
        }
        self.used += size;
        self.newest_last.push_back((seq, std::sync::Arc::new(kept)));
        while self.used > self.budget || self.newest_last.len() > self.most {
            let Some((_, old)) = self.newest_last.pop_front() else {
                break;
            };
            self.used -= old.size();
        }
        true
    }

    pub fn get(&self, seq: u64) -> Option<std::sync::Arc<Kept>> {
        self.newest_last
            .iter()
            .rev()
            .find(|(i, _)| *i == seq)
            .map(|(_, k)| k.clone())
    }

    /// Bytes kept now.
    pub fn used(&self) -> usize {
        self.used
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn b64(bytes: &[u8]) -> String {
        base64_simd::STANDARD.encode_to_string(bytes)
    }

    /// A large agent history (words such as key, token and auth in its
    /// texts, no credential field, no media) is kept as it came, without a
    /// parse; a credential field, headers, a signed URL (escaped slashes
    /// too) anywhere in a large one still are redacted.
    #[test]
    fn a_large_text_history_is_kept_as_it_came_and_secrets_still_found() {
        let line = "let key = token.auth(secret); // the api_key is read from the env\n";
        let text = line.repeat(6000);
        let body = json!({"model": "m", "messages": [
            {"role": "user", "content": "fix it"},
            {"role": "tool", "tool_call_id": "c1", "content": text},
        ]});
        let raw = Bytes::from(body.to_string());
        assert!(raw.len() > crate::inspector::RAW_MAX);
        let out = without_media(&raw).unwrap();
        assert_eq!(
            out.as_ptr(),
            raw.as_ptr(),
            "kept as it came: not read again"
        );
        for (secret, path) in [
            (json!({"api_key": "sk-x"}), "/extra/api_key"),
            (
                json!({"headers": {"X-Key": "sk-x"}}),
                "/extra/headers/X-Key",
            ),
            (
                json!({"url": "https://b.example/o?X-Amz-Signature=abc"}),
                "/extra/url",
            ),
        ] {
            let mut b = body.clone();
            b["extra"] = secret;
            let v = kept(&b);
            let got = v.pointer(path).unwrap().as_str().unwrap();
            assert!(got.contains("[redacted]"), "{path}: {got}");
        }
        // A pretty-printed byte array, a URL and a data URL hidden in
        // escapes: each found, each stripped.
        let bytes: Vec<u8> = (0..=255).collect();
        let pretty = serde_json::to_string_pretty(
            &json!({"messages": [{"role": "user", "content": text.clone()}], "buffer": bytes}),
        )
        .unwrap();
        let v: Value =
            serde_json::from_slice(&without_media(&Bytes::from(pretty)).unwrap()).unwrap();
        assert_eq!(v["buffer"], "[256 byte values]");
        for hidden in [
            r#""\u0068ttps://b.example/o?sig=abc""#,
            &format!(
                r#""data:image/png\u003bbase64,{}""#,
                "iVBORw0KGgo".repeat(60)
            ),
        ] {
            let b = body.to_string().replacen("\"fix it\"", hidden, 1);
            let v: Value =
                serde_json::from_slice(&without_media(&Bytes::from(b)).unwrap()).unwrap();
            let got = v["messages"][0]["content"].as_str().unwrap();
            assert!(
                !got.contains("sig=abc") && !got.contains("iVBORw0KGgoiVBORw0KGgo"),
                "{got}"
            );
        }
        // A presigned URL past 8 KiB (a long path and a long query) is
        // redacted as a short one is.
        let long = format!(
            "https://bucket.example/{}?X-Amz-Credential={}&X-Amz-Signature=abc",
            "p/".repeat(3000),
            "c".repeat(6000)
        );
        assert!(long.len() > 8192);
        let v = kept(&json!({"model": "m", "messages": [{"role": "user", "content": long}]}));
        let got = v["messages"][0]["content"].as_str().unwrap();
        assert!(
            got.ends_with("?[redacted]") && !got.contains("abc"),
            "{got}"
        );
        // A URL written with escaped slashes is read in full too.
        let escaped =
            body.to_string()
                .replacen("\"fix it\"", "\"https:\\/\\/b.example\\/o?sig=abc\"", 1);
        let out = without_media(&Bytes::from(escaped)).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v["messages"][0]["content"],
            "https://b.example/o?[redacted]"
        );
    }

    fn kept(body: &Value) -> Value {
        serde_json::from_slice(&without_media(&Bytes::from(body.to_string())).unwrap()).unwrap()
    }

    fn hex12(bytes: &[u8]) -> String {
        Sha256::digest(bytes)[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    #[test]
    fn image_bytes_become_a_reference_the_artifacts_answer_to() {
        let png: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
        let hex12 = hex12(&png);
        let body = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&png))}},
            {"type": "text", "text": format!("tool said: {{\"png\": \"{}\"}} end", b64(&png))}]}]});
        let kept = kept(&body);
        let url = kept["messages"][0]["content"][1]["image_url"]["url"]
            .as_str()
            .unwrap();
        assert_eq!(
            url,
            format!("data:image/png;base64,[base64: 3000 bytes, sha256:{hex12}]")
        );
        let text = kept["messages"][0]["content"][2]["text"].as_str().unwrap();
        assert_eq!(
            text,
            format!("tool said: {{\"png\": \"[base64: 3000 bytes, sha256:{hex12}]\"}} end")
        );
        assert_eq!(kept["messages"][0]["content"][0]["text"], "what is this?");
        assert!(!kept.to_string().contains(&b64(&png)[..100]));
    }

    #[test]
    fn base64_broken_by_escapes_and_lines_and_byte_arrays_are_caught() {
        let png: Vec<u8> = (0..6000u32).map(|i| (i * 13 % 251) as u8).collect();
        let enc = b64(&png);
        // JSON encoded twice, with escaped slashes; MIME lines written `\r\n`.
        let escaped = enc.replace('/', "\\/");
        let mime: Vec<String> = enc
            .as_bytes()
            .chunks(76)
            .map(|c| String::from_utf8(c.to_vec()).unwrap())
            .collect();
        let body = json!({
            "a": format!("{{\"image\":\"{escaped}\"}}"),
            "b": mime.join("\\r\\n"),
            "c": mime.join("\n"),
            "d": {"type": "Buffer", "data": png.iter().take(400).copied().collect::<Vec<u8>>()},
        });
        let k = kept(&body).to_string();
        assert!(!k.contains(&enc[..40]) && !k.contains(&mime[3]), "{k}");
        assert_eq!(k.matches("[base64: 6000 bytes").count(), 3, "{k}");
        assert!(k.contains("[400 byte values]"), "{k}");
    }

    #[test]
    fn a_run_just_long_enough_is_caught_wherever_it_starts() {
        // 384 bytes make 512 base64 characters: the shortest run replaced,
        // at every offset against the 64-byte blocks the precheck reads.
        let bytes: Vec<u8> = (0..384u32).map(|i| (i * 29 % 251) as u8).collect();
        let run = base64_simd::STANDARD.encode_to_string(&bytes);
        assert_eq!(run.len(), MIN_RUN);
        for pad in 0..64 {
            // (Keys are written sorted: the padding's comes first.)
            let body = json!({"a_pad": "x".repeat(pad), "data": run}).to_string();
            assert_eq!(body.find(&run[..8]), Some(pad + 20));
            let kept = without_media(&Bytes::from(body)).unwrap();
            let kept = String::from_utf8_lossy(&kept);
            assert!(!kept.contains(&run[..100]), "offset {pad}");
            assert!(kept.contains("[base64: 384 bytes, sha256:"), "offset {pad}");
        }
        let digits: Vec<u8> = (0..MIN_BYTE_ARRAY as u32).map(|i| (i % 10) as u8).collect();
        for pad in 0..64 {
            let body = json!({"a_pad": "x".repeat(pad), "buf": {"type": "Buffer", "data": digits}});
            let kept = without_media(&Bytes::from(body.to_string())).unwrap();
            assert!(
                String::from_utf8_lossy(&kept).contains("[256 byte values]"),
                "offset {pad}"
            );
        }
    }

    #[test]
    fn a_body_checked_before_is_not_parsed_again() {
        // (What the proxy read as JSON is; this one is not, to tell.)
        let body = Bytes::from_static(b"{\"model\": \"m\", \"messages\": [");
        assert!(without_media(&body).is_none());
        assert_eq!(without_media_of_json(&body), Some(body.clone()));
        // What may hold a credential is still read in full (and refused).
        let secret = Bytes::from_static(b"{\"api_key\": \"sk\"");
        assert!(without_media_of_json(&secret).is_none());
    }

    #[test]
    fn credentials_are_never_kept() {
        let body = json!({"model": "m",
            "tools": [{"type": "mcp", "server_url": "https://mcp.example/x", "headers": {"Authorization": "Bearer sk-live-1"}, "authorization": "tok-2"}],
            "mcp_servers": [{"url": "https://h", "authorization_token": "tok-3"}],
            "api_key": "sk-4", "metadata": {"x-api-key": "sk-5", "note": "kept"},
            "image": "https://bucket.s3.example/a.png?X-Amz-Signature=abc&X-Amz-Credential=def",
            "plain": "https://example.com/a.png?size=2"});
        let k = kept(&body);
        let text = k.to_string();
        for secret in [
            "sk-live-1",
            "tok-2",
            "tok-3",
            "sk-4",
            "sk-5",
            "X-Amz-Signature=abc",
        ] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
        assert_eq!(k["metadata"]["note"], "kept");
        assert_eq!(k["image"], "https://bucket.s3.example/a.png?[redacted]");
        assert_eq!(k["plain"], "https://example.com/a.png?size=2");
        assert_eq!(k["tools"][0]["server_url"], "https://mcp.example/x");
    }

    #[test]
    fn prose_and_short_strings_stay() {
        let prose = "word ".repeat(400);
        let long_letters = "a".repeat(2000);
        let body = json!({"a": prose, "b": long_letters, "c": "abc123", "n": [1, 2, 300]});
        assert_eq!(kept(&body), body);
        assert!(without_media(&Bytes::from_static(b"{\"auth\": not json")).is_none());
        // Nothing to strip: kept as it came.
        let plain = Bytes::from_static(b"{\"model\": \"m\",  \"messages\": []}");
        assert_eq!(without_media(&plain).unwrap(), plain);
    }

    #[test]
    fn the_budget_drops_the_oldest() {
        let mut b = Bodies::new(100, 10);
        let k = |n: usize| Kept::new(Bytes::from(vec![b'x'; n]), None);
        b.keep(1, k(40));
        b.keep(2, k(40));
        b.keep(3, k(40));
        assert!(b.get(1).is_none() && b.get(2).is_some() && b.get(3).is_some());
        assert_eq!(b.used(), 80);
        assert!(!b.keep(4, k(101)));
        assert!(b.get(4).is_none() && b.used() == 80);
        let mut none = Bodies::new(0, 10);
        none.keep(5, k(1));
        assert!(none.get(5).is_none());
        let mut two = Bodies::new(100, 2);
        for i in 0..4 {
            two.keep(i, k(1));
        }
        assert!(two.get(1).is_none() && two.get(2).is_some() && two.used() == 2);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// A body whose first bytes, up to just after its last clean
        /// message, are a body found to hold nothing, is kept as a read of
        /// it all keeps it — whatever follows (a data URL, a base64 run of
        /// any alignment, a credential key, a signed URL, a byte array,
        /// escapes) — and said clean exactly when it is.
        #[test]
        fn what_follows_a_clean_prefix_is_stripped_as_in_a_whole_read(
            clean in proptest::collection::vec(0usize..60, 1..20),
            added in proptest::collection::vec(0u8..9, 0..4),
            pad in 0usize..64,
        ) {
            let png: Vec<u8> = (0..900u32).map(|i| (i * 7 % 251) as u8).collect();
            let text = |n: usize| format!(r#"{{"role":"tool","content":"line {n}: key token auth \"x\"\n{}"}}"#, "y".repeat(n));
            let mut messages: Vec<String> = clean.iter().map(|&n| text(n)).collect();
            let prefix = format!(r#"{{"model":"m","messages":[{}"#, messages.join(","));
            let first = format!("{prefix}]}}");
            let (_, first_clean) = without_media_of_json_after(&Bytes::from(first.clone()), 0);
            proptest::prop_assert!(first_clean);
            for a in &added {
                messages.push(match a {
                    0 => format!(r#"{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{}"}}}}]}}"#, b64(&png)),
                    1 => format!(r#"{{"role":"tool","content":"{}{}"}}"#, "z".repeat(pad), b64(&png)),
                    2 => r#"{"role":"user","api_key":"sk-SECRET"}"#.to_owned(),
                    3 => r#"{"role":"user","content":"https://x.example/f?X-Amz-Signature=abc"}"#.to_owned(),
                    4 => format!(r#"{{"role":"user","data":[{}]}}"#, vec!["7"; 300].join(",")),
                    5 => r#"{"role":"user","content":"\u0068ttps://x.example/?sig=1&token=2"}"#.to_owned(),
                    _ => text(pad),
                });
            }
            let next = Bytes::from(format!(r#"{{"model":"m","messages":[{}]}}"#, messages.join(",")));
            let after = without_media_of_json_after(&next, prefix.len());
            let whole = without_media_of_json_after(&next, 0);
            proptest::prop_assert_eq!(&after, &whole);
            proptest::prop_assert_eq!(after.0, without_media_of_json(&next));
        }
    }

    #[test]
    fn a_megabyte_image_is_cut_to_its_reference_before_the_body_is_parsed() {
        let png: Vec<u8> = (0..800_000u32).map(|i| (i % 253) as u8).collect();
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{}"}}}}]}}]}}"#,
            b64(&png)
        );
        let cut = cut_long_strings(body.as_bytes()).unwrap();
        assert!(cut.len() < 300, "{}", String::from_utf8_lossy(&cut));
        let kept = stripped(&Bytes::from(body)).unwrap();
        assert!(
            std::str::from_utf8(&kept)
                .unwrap()
                .contains("[base64: 800000 bytes, sha256:")
        );
        // Nothing long: nothing cut.
        assert!(cut_long_strings(&vec![b' '; 20_000]).is_none());
        // A long key, spaced from its colon as a pretty printer writes it,
        // is a key: never cut.
        let key = Bytes::from(format!("{{\n  \"{}\" \t: 1\n}}", b64(&png[..20_000])));
        assert!(cut_long_strings(&key).is_none());
        assert_eq!(stripped(&key), stripped_whole(&key));
    }

    /// [`stripped`] as it was: the whole body parsed, then stripped.
    fn stripped_whole(body: &Bytes) -> Option<Bytes> {
        let mut v: Value = serde_json::from_slice(body).ok()?;
        strip(&mut v, 0);
        serde_json::to_vec(&v).ok().map(Bytes::from)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
        /// A body whose long strings are cut before it is parsed is
        /// stripped as the whole body parsed is: a megabyte image, a data
        /// URL, a run written with escapes or line breaks, a long key, a
        /// long signed URL, a credential, headers, a byte array, prose, a
        /// run after text or between texts, and bodies that are not JSON.
        #[test]
        fn long_strings_cut_first_are_stripped_as_in_a_whole_parse(
            parts in proptest::collection::vec((0u8..17, 0usize..40), 1..6),
            broken in 0u8..6,
        ) {
            let data: Vec<u8> = (0..13_000u32).map(|i| (i * 7 % 251) as u8).collect();
            let run = b64(&data);
            let fields: Vec<String> = parts.iter().enumerate().map(|(i, &(kind, n))| {
                let pad = "word ".repeat(n);
                match kind {
                    0 => format!(r#""f{i}":"{run}""#),
                    1 => format!(r#""f{i}":"data:image/png;base64,{run}""#),
                    2 => format!(r#""f{i}":"{pad}{run} and {run}{pad}""#),
                    3 => format!(r#""f{i}":"{}""#, run.replace('/', "\\/")),
                    4 => format!(r#""f{i}":"{}""#, run.as_bytes().chunks(76).map(|c| std::str::from_utf8(c).unwrap()).collect::<Vec<_>>().join("\\n")),
                    5 => format!(r#""{run}":"{pad}""#),
                    6 => format!(r#""f{i}":"https://x.example/f?X-Amz-Signature={run}""#),
                    7 => format!(r#""api_key":"{run}""#),
                    8 => format!(r#""headers":{{"authorization":"{run}","n":{n}}}"#),
                    9 => format!(r#""f{i}":[{}]"#, vec!["7"; 300 + n].join(",")),
                    10 => format!(r#""f{i}":{{"deep":["{pad}", "{run}", {n}]}}"#),
                    11 => format!(r#""f{i}":"{}""#, "prose without digits ".repeat(900 + n)),
                    // A raw line break in a string: not JSON.
                    12 => format!("\"f{i}\":\"{}\n{}\"", &run[..9000], &run[9000..]),
                    // Escapes a raw read would take otherwise: a run after
                    // `\/`, a `\u0041` inside one, a backslash then `n`.
                    13 => format!(r#""f{i}":"\/{run}""#),
                    14 => format!(r#""f{i}":"{}\u0041{}""#, &run[..9000], &run[9000..]),
                    15 => format!(r#""f{i}":"{}\\n{}""#, &run[..9000], &run[9000..]),
                    _ => format!(r#""f{i}":"{pad}""#),
                }
            }).collect();
            let mut body = format!("{{{}}}", fields.join(","));
            // A string the cut takes: one is cut before the parse.
            let cuts = parts.iter().any(|&(k, _)| matches!(k, 0 | 1 | 2 | 7 | 8 | 10));
            match broken {
                // Not JSON: cut or not, nothing is kept.
                0 => body.push(','),
                1 => body.insert(body.len() / 2, '"'),
                2 => body.truncate(body.len() - 2),
                // Space before a key's colon.
                3 => body = body.replace("\":", "\" :"),
                _ => {}
            }
            let body = Bytes::from(body);
            if cuts && broken > 2 {
                proptest::prop_assert!(cut_long_strings(&body).is_some());
            }
            proptest::prop_assert_eq!(stripped(&body), stripped_whole(&body));
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// A payload read 32 bytes at a time and decoded in place names
        /// the same bytes as one written with line breaks, escapes or the
        /// URL-safe letters, whatever its length and padding.
        #[test]
        fn a_payload_is_named_by_its_bytes_however_written(
            data in proptest::collection::vec(proptest::prelude::any::<u8>(), 400..1400),
            every in 20usize..90,
        ) {
            let plain = b64(&data);
            let lines: Vec<String> = plain
                .as_bytes()
                .chunks(every)
                .map(|c| String::from_utf8(c.to_vec()).unwrap())
                .collect();
            let url_safe = plain.replace('+', "-").replace('/', "_");
            let want = reference(&plain);
            proptest::prop_assert!(want.starts_with(&format!("[base64: {} bytes, sha256:", data.len())), "{}", want);
            proptest::prop_assert_eq!(&reference(&lines.join("\n")), &want);
            proptest::prop_assert_eq!(&reference(&lines.join("\\n")), &want);
            proptest::prop_assert_eq!(&reference(&url_safe), &want);
            let text = format!("see {plain} here");
            let replaced = replace_runs(&text).unwrap();
            proptest::prop_assert_eq!(replaced, format!("see {want} here"));
        }
    }

    /// `replace_runs` as it was, a byte at a time: the oracle.
    fn runs_bytewise(s: &str) -> Option<String> {
        if s.len() < MIN_RUN {
            return None;
        }
        let b = s.as_bytes();
        let mut out: Option<String> = None;
        let (mut i, mut copied) = (0, 0);
        while i < b.len() {
            let data_url = b[..i].ends_with(b";base64,");
            if !is_b64(b[i]) {
                i += 1;
                continue;
            }
            let start = i;
            while i < b.len() && (is_b64(b[i]) || continues_run(b, i)) {
                i += 1;
            }
            let run = &s[start..i];
            let long = run.len() >= MIN_RUN || (data_url && run.len() >= 64);
            if long && run.bytes().any(|c| c.is_ascii_digit() || c == b'/') {
                let o = out.get_or_insert_with(String::new);
                o.push_str(&s[copied..start]);
                o.push_str(&reference(run));
                copied = i;
            }
        }
        let mut o = out?;
        o.push_str(&s[copied..]);
        Some(o)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]
        /// Runs read 32 bytes at a time end where a byte-by-byte read ends
        /// them: inside a block, at an escape, a line break, an escaped
        /// slash, a letter that is not ASCII, a data URL's comma.
        #[test]
        fn runs_end_where_a_bytewise_read_ends_them(
            parts in proptest::collection::vec(
                proptest::sample::select(vec!["A", "9", "/", "+", "\\", "n", "\n", "\r\n", "\\/", "\\n", "é", " ", ";base64,", "QUJD", "=", "-", "_"]),
                200..1200,
            ),
            long in 0usize..4,
        ) {
            let mut s: String = parts.concat();
            // Some long runs too, at any offset.
            for k in 0..long {
                let mut at = s.len() * k / 4;
                while !s.is_char_boundary(at) {
                    at -= 1;
                }
                s.insert_str(at, &"Zm9vYmFy0123/+".repeat(50));
            }
            proptest::prop_assert_eq!(replace_runs(&s), runs_bytewise(&s));
        }
    }

    /// A long payload's reference, remembered, is the one made from it,
    /// the first time and after; a payload one byte apart is named by its
    /// own bytes.
    #[test]
    fn a_remembered_reference_is_the_payloads_own() {
        let data: Vec<u8> = (0..20_000u32).map(|i| (i * 31 % 253) as u8).collect();
        let run = b64(&data);
        assert!(run.len() >= REMEMBERED_RUN);
        let want = made(&run);
        assert!(want.starts_with("[base64: 20000 bytes, sha256:"), "{want}");
        assert_eq!(reference(&run), want);
        assert_eq!(reference(&run), want);
        let mut other = data.clone();
        other[10_000] ^= 1;
        let other_run = b64(&other);
        assert_eq!(reference(&other_run), made(&other_run));
        assert_ne!(reference(&other_run), want);
    }
}
