//! Reading the `model` of a request body without building a document.
//!
//! [`JsonScanner`] is fed a body chunk by chunk, as it arrives, and keeps no
//! copy of it. It checks the JSON grammar (strict: what `serde_json`
//! accepts) and picks out the top-level `"model"` string. String contents —
//! a 4 MB base64 image is one string — are skipped sixteen bytes at a time,
//! so validating a 4 MB image request costs a fraction of a millisecond and
//! no allocation, and its chunks go upstream as they came.
//!
//! Two uses:
//! - the transformed endpoints scan the whole body: invalid JSON is a 400
//!   there ([`JsonScanner::finish`]);
//! - bodies visor streams through stop at the model ([`JsonScanner::found`]);
//!   when the route depends on the model, a body that is not a JSON object
//!   (before its model) is refused ([`JsonScanner::error`]). A
//!   `multipart/form-data` body's `model` field is found by [`FormScanner`].

use super::checked_prefixes::{Digests, Kept, Mark, Resumable, Shared};

/// What a scan of a whole body found.
#[derive(Debug, PartialEq, Eq)]
pub struct Probed {
    pub model: Option<String>,
}

/// A request body read whole: each chunk is validated as it arrives (and
/// its top-level `model` found), and the chunks are gathered into one
/// contiguous buffer — sized once from `Content-Length` — that the
/// transforms walk and that goes upstream as is when nothing changes. A body
/// that came in one chunk is kept as it came, without a copy. A body whose
/// first bytes match one its client sent before is hashed as it comes,
/// waits until it has all come, and is validated only after the bytes it
/// shares with that one (see [`super::checked_prefixes`]).
pub struct WholeBody {
    scanner: JsonScanner,
    first: Option<bytes::Bytes>,
    buf: bytes::BytesMut,
    hint: usize,
    /// The client's checked prefixes this body may continue.
    resumable: Option<Resumable>,
    /// The check waits for the whole body (it may continue one of them).
    waiting: bool,
}

impl WholeBody {
    /// `hint`: the expected size (`Content-Length`, capped by the limit).
    pub fn new(hint: u64) -> Self {
        Self::resuming(hint, None)
    }

    /// [`WholeBody::new`] for a body that may continue one its client sent
    /// before (checked only after the bytes they share).
    pub fn resuming(hint: u64, resumable: Option<Resumable>) -> Self {
        Self {
            scanner: JsonScanner::new(),
            first: None,
            buf: bytes::BytesMut::new(),
            hint: usize::try_from(hint).unwrap_or(0),
            resumable,
            waiting: false,
        }
    }

    pub fn push(&mut self, data: bytes::Bytes) {
        let at_start = self.first.is_none() && self.buf.is_empty();
        if let Some(r) = self.resumable.as_mut().filter(|_| at_start)
            && data.len() >= crate::transform::START
        {
            self.waiting = r.look_up(&data);
        }
        if !self.waiting {
            self.scanner.feed(&data);
        }
        match self.first.take() {
            None if self.buf.is_empty() => self.first = Some(data),
            None => self.buf.extend_from_slice(&data),
            Some(f) => {
                self.buf.reserve(self.hint.max(f.len() + data.len()));
                self.buf.extend_from_slice(&f);
                self.buf.extend_from_slice(&data);
            }
        }
        // A body that may continue one its client sent: hashed as it comes.
        if let Some(r) = self.resumable.as_mut().filter(|_| self.waiting) {
            match &self.first {
                Some(f) => r.on(f),
                None => r.on(&self.buf),
            }
        }
    }

    /// The model and the body, or why it is not a JSON object.
    pub fn finish(self) -> Result<(Option<String>, bytes::Bytes), String> {
        self.finish_shared().map(|(m, b, _)| (m, b))
    }

    /// [`WholeBody::finish`], and what the body shares with the one its
    /// client sent before.
    pub fn finish_shared(self) -> Result<(Option<String>, bytes::Bytes, Shared), String> {
        let bytes = match self.first {
            Some(f) => f,
            None => self.buf.freeze(),
        };
        let mut scanner = self.scanner;
        // Checked from where a body it begins with was, or whole.
        let (hashed, words, from, clean) = match self.resumable.as_ref().filter(|_| self.waiting) {
            Some(r) => match r.resume(&bytes) {
                Some((s, hashed, words, clean)) => {
                    let end = hashed.end();
                    scanner = s;
                    scanner.feed(&bytes[end..]);
                    (Some(hashed), words, end, clean)
                }
                None => {
                    scanner.feed(&bytes);
                    (None, None, 0, false)
                }
            },
            None => (None, None, 0, false),
        };
        let mark = Mark::of(&scanner);
        let probed = scanner.finish()?;
        // JSON is UTF-8 (RFC 8259): a body that is not would reach the
        // upstream as bytes no JSON parser there accepts the same way. (The
        // bytes a checked body shared end after an ASCII `}`.)
        if let Err(e) = std::str::from_utf8(&bytes[from..]) {
            return Err(format!("invalid UTF-8 at byte {}", from + e.valid_up_to()));
        }
        let before = hashed.as_ref().map(|h| (h.end(), h.digest()));
        let kept = self
            .resumable
            .as_ref()
            .and_then(|r| r.keep(&bytes, mark, probed.model.as_deref(), (hashed, words)));
        let mut digests = Digests::new(&bytes, before, kept.as_ref().map(|k| k.digest));
        if let Some(Kept {
            digest: (end, _),
            words: Some(words),
            ..
        }) = &kept
        {
            digests = digests.seeing(*end, *words);
        }
        let shared = Shared {
            waited: self.waiting,
            clean: if clean { from } else { 0 },
            digests,
            mark: kept.map(|k| k.clean),
        };
        Ok((probed.model, bytes, shared))
    }
}

/// Validates a whole `body` as a JSON object and returns its `model`.
pub fn probe(body: &[u8]) -> Result<Probed, String> {
    let mut s = JsonScanner::new();
    s.feed(body);
    s.finish()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the top-level `{`.
    Start,
    /// After `{`: a key or `}`.
    KeyOrClose,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// A value is expected (after `:`, `[` or `,` in an array).
    Value,
    /// After `[`: a value or `]`.
    ValueOrClose,
    /// After a value: `,` or the container's close.
    AfterValue,
    /// Inside a string; `key` tells a member name from a value.
    Str { key: bool },
    /// Inside a string, after `\`.
    Escape { key: bool },
    /// Inside `\uXXXX`: hex digits still expected.
    Unicode { key: bool, left: u8 },
    /// Inside a number.
    Num(Num),
    /// Inside `true`, `false` or `null`: the rest still expected.
    Lit { rest: &'static [u8] },
    /// The top-level object closed: only whitespace may follow.
    End,
    /// Invalid JSON; `error` says why.
    Failed,
}

/// Number grammar: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

impl Num {
    /// May the number end here?
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::Exp)
    }

    fn next(self, b: u8) -> Option<Num> {
        match (self, b) {
            (Num::Minus, b'0') => Some(Num::Zero),
            (Num::Minus, b'1'..=b'9') => Some(Num::Int),
            (Num::Int, b'0'..=b'9') => Some(Num::Int),
            (Num::Zero | Num::Int, b'.') => Some(Num::Dot),
            (Num::Dot | Num::Frac, b'0'..=b'9') => Some(Num::Frac),
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Some(Num::E),
            (Num::E, b'+' | b'-') => Some(Num::ESign),
            (Num::E | Num::ESign | Num::Exp, b'0'..=b'9') => Some(Num::Exp),
            _ => None,
        }
    }
}

/// A top-level member name is kept only this long (enough to know `model`).
const MAX_KEY: usize = 16;
/// A model name longer than this is refused.
const MAX_MODEL: usize = 1024;

/// Incremental JSON validator and finder of the top-level `"model"` string.
pub struct JsonScanner {
    state: State,
    /// Open containers: `{` or `[`.
    stack: Vec<u8>,
    /// Bytes fed so far (for error positions).
    offset: u64,
    /// Raw bytes of the current top-level key, while it is short.
    key: Vec<u8>,
    key_overflow: bool,
    /// The value being read belongs to the top-level `model` key.
    model_next: bool,
    /// Raw bytes (escapes included) of the model string being read.
    model_raw: Option<Vec<u8>>,
    seen_model: bool,
    model: Option<String>,
    error: Option<String>,
    /// Where the top-level `model` key (any case) was read.
    model_key_at: Option<u64>,
    /// The top-level member being read is `messages` or `input`.
    in_items: bool,
    /// Just after the last container that ended as an element of the
    /// top-level `messages` (or `input`) array: where the body may be
    /// taken up again ([`JsonScanner::resumed`]).
    items_end: Option<u64>,
}

impl Default for JsonScanner {
    fn default() -> Self {
        Self::new()
    }
}

impl JsonScanner {
    pub fn new() -> Self {
        Self {
            state: State::Start,
            stack: Vec::new(),
            offset: 0,
            key: Vec::new(),
            key_overflow: false,
            model_next: false,
            model_raw: None,
            seen_model: false,
            model: None,
            error: None,
            model_key_at: None,
            in_items: false,
            items_end: None,
        }
    }

    /// A scanner that goes on from `end` of a body whose bytes up to there
    /// are known to be a JSON object's, with `end` just after an element of
    /// its top-level `messages` (or `input`) array ([`JsonScanner::items_end`]
    /// of a scan of them): what it read before, the `model` key (`seen`, in
    /// any case) and value.
    pub fn resumed(end: u64, seen_model: bool, model: Option<String>) -> Self {
        Self {
            state: State::AfterValue,
            stack: vec![b'{', b'['],
            offset: end,
            seen_model,
            model,
            model_key_at: seen_model.then_some(0),
            in_items: true,
            items_end: Some(end),
            ..Self::new()
        }
    }

    /// Where the last element of the top-level `messages` (or `input`)
    /// array that is an object or array ends, once read.
    pub fn items_end(&self) -> Option<u64> {
        self.items_end
    }

    /// Whether the top-level `model` key (any case) came before `end`.
    pub fn model_key_before(&self, end: u64) -> bool {
        self.model_key_at.is_some_and(|at| at < end)
    }

    /// True once the model's value has been read (or the body is invalid):
    /// a caller that only routes can stop feeding.
    pub fn found(&self) -> bool {
        self.seen_model && self.model_raw.is_none() && !self.model_next
            || self.state == State::Failed
    }

    /// The top-level model, once read.
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// Why the body is not a JSON object (or its `model` not a string), once
    /// that is known.
    pub fn error(&self) -> Option<&str> {
        (self.state == State::Failed).then(|| self.error.as_deref().unwrap_or("invalid JSON"))
    }

    /// Ends the scan of a whole body: the model, or why the body is not a
    /// valid JSON object.
    pub fn finish(mut self) -> Result<Probed, String> {
        if self.state == State::Failed {
            return Err(self.error.take().unwrap_or_default());
        }
        if self.state != State::End {
            return Err(if self.state == State::Start {
                "the body is empty".to_owned()
            } else {
                format!(
                    "the body ends inside the JSON (after {} bytes)",
                    self.offset
                )
            });
        }
        Ok(Probed { model: self.model })
    }

    fn fail(&mut self, at: usize, why: &str) {
        self.state = State::Failed;
        self.error = Some(format!("{why} at byte {}", self.offset + at as u64));
    }

    /// Feeds the next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        let mut i = 0;
        while i < chunk.len() {
            let b = chunk[i];
            match self.state {
                State::Failed => return,
                State::Str { .. } | State::Escape { .. } | State::Unicode { .. } => {
                    match self.in_string(chunk, i) {
                        Some(next) => i = next,
                        None => return,
                    }
                    continue;
                }
                State::Num(n) => match n.next(b) {
                    Some(next) => self.state = State::Num(next),
                    None if n.complete() => {
                        self.state = State::AfterValue;
                        continue; // the delimiter is read in AfterValue
                    }
                    None => return self.fail(i, "invalid number"),
                },
                State::Lit { rest } => {
                    if rest.first() != Some(&b) {
                        return self.fail(i, "invalid literal");
                    }
                    let rest = &rest[1..];
                    self.state = if rest.is_empty() {
                        State::AfterValue
                    } else {
                        State::Lit { rest }
                    };
                }
                _ if is_ws(b) => {}
                _ => {
                    if let Err(why) = self.structure(b) {
                        return self.fail(i, why);
                    }
                    // An element of the top-level array closed (not a
                    // member of an object-valued `messages`).
                    if matches!(b, b'}' | b']')
                        && self.in_items
                        && self.stack.len() == 2
                        && self.stack[1] == b'['
                    {
                        self.items_end = Some(self.offset + i as u64 + 1);
                    }
                }
            }
            i += 1;
        }
        self.offset += chunk.len() as u64;
    }

    /// In a string (or one of its escapes) at `chunk[i]`: where the scan
    /// goes on, or `None` when the body failed there.
    #[inline]
    fn in_string(&mut self, chunk: &[u8], i: usize) -> Option<usize> {
        let b = chunk[i];
        match self.state {
            State::Str { key } => {
                // The fast path: jump to the next `"`, `\` or control byte;
                // a two-byte escape (`\n`, `\"`…) whole in this chunk is
                // passed over without leaving it (a text of many lines has
                // one every few dozen bytes).
                let mut j = i;
                let off = loop {
                    let Some(off) = find_special(&chunk[j..]) else {
                        self.capture(&chunk[i..]);
                        return Some(chunk.len());
                    };
                    let at = j + off;
                    match (chunk[at], chunk.get(at + 1)) {
                        (b'\\', Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't')) => {
                            j = at + 2;
                        }
                        _ => break at - i,
                    }
                };
                self.capture(&chunk[i..i + off]);
                if self.state == State::Failed {
                    return None; // the model is too long
                }
                let i = i + off;
                match chunk[i] {
                    b'"' => self.end_string(key, self.offset + i as u64),
                    b'\\' => {
                        self.capture(b"\\");
                        self.state = State::Escape { key };
                    }
                    _ => {
                        self.fail(i, "control character in a string");
                        return None;
                    }
                }
                Some(i + 1)
            }
            State::Escape { key } => {
                self.capture(&[b]);
                if self.state == State::Failed {
                    return None;
                }
                self.state = match b {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => State::Str { key },
                    b'u' => State::Unicode { key, left: 4 },
                    _ => {
                        self.fail(i, "invalid escape in a string");
                        return None;
                    }
                };
                Some(i + 1)
            }
            State::Unicode { key, left } => {
                if !b.is_ascii_hexdigit() {
                    self.fail(i, "invalid \\u escape in a string");
                    return None;
                }
                self.capture(&[b]);
                if self.state == State::Failed {
                    return None;
                }
                self.state = if left == 1 {
                    State::Str { key }
                } else {
                    State::Unicode {
                        key,
                        left: left - 1,
                    }
                };
                Some(i + 1)
            }
            _ => Some(i),
        }
    }

    /// A byte of the object's structure (not blank, not in a string,
    /// number or literal): the state it leads to, or why it cannot be.
    #[inline]
    fn structure(&mut self, b: u8) -> Result<(), &'static str> {
        match self.state {
            State::Start => {
                if b != b'{' {
                    return Err("the body must be a JSON object");
                }
                self.stack.push(b'{');
                self.state = State::KeyOrClose;
            }
            State::KeyOrClose | State::Key => match b {
                b'"' => self.begin_string(true),
                b'}' if self.state == State::KeyOrClose => self.close(b'{'),
                _ => return Err("expected a member name"),
            },
            State::Colon => {
                if b != b':' {
                    return Err("expected `:`");
                }
                self.state = State::Value;
            }
            State::Value | State::ValueOrClose => {
                if b == b']' && self.state == State::ValueOrClose {
                    self.close(b'[');
                } else if !self.begin_value(b) {
                    return Err("expected a value");
                }
            }
            State::AfterValue => match (b, self.stack.last()) {
                (b',', Some(b'{')) => self.state = State::Key,
                (b',', Some(_)) => self.state = State::Value,
                (b'}', Some(b'{')) => self.close(b'{'),
                (b']', Some(b'[')) => self.close(b'['),
                _ => return Err("expected `,` or a closing bracket"),
            },
            State::End => return Err("trailing characters after the JSON object"),
            // Read by feed and in_string.
            State::Failed
            | State::Str { .. }
            | State::Escape { .. }
            | State::Unicode { .. }
            | State::Num(_)
            | State::Lit { .. } => {}
        }
        Ok(())
    }

    fn begin_value(&mut self, b: u8) -> bool {
        let top_model = self.model_next;
        self.model_next = false;
        if top_model && b != b'"' {
            self.state = State::Failed;
            self.error = Some("`model` must be a string".to_owned());
            return true;
        }
        self.state = match b {
            b'"' => {
                if top_model {
                    self.model_raw = Some(Vec::new());
                }
                State::Str { key: false }
            }
            b'{' | b'[' => {
                self.stack.push(b);
                if b == b'{' {
                    State::KeyOrClose
                } else {
                    State::ValueOrClose
                }
            }
            b'-' => State::Num(Num::Minus),
            b'0' => State::Num(Num::Zero),
            b'1'..=b'9' => State::Num(Num::Int),
            b't' => State::Lit { rest: b"rue" },
            b'f' => State::Lit { rest: b"alse" },
            b'n' => State::Lit { rest: b"ull" },
            _ => return false,
        };
        true
    }

    fn begin_string(&mut self, key: bool) {
        if key && self.stack.len() == 1 {
            self.key.clear();
            self.key_overflow = false;
        }
        self.state = State::Str { key };
    }

    /// Keeps string bytes only where they matter: a top-level key, or the
    /// model's value.
    fn capture(&mut self, bytes: &[u8]) {
        if let State::Str { key: true }
        | State::Escape { key: true }
        | State::Unicode { key: true, .. } = self.state
        {
            if self.stack.len() == 1 && !self.key_overflow {
                if self.key.len() + bytes.len() > MAX_KEY {
                    self.key_overflow = true;
                } else {
                    self.key.extend_from_slice(bytes);
                }
            }
        } else if let Some(raw) = self.model_raw.as_mut() {
            if raw.len() + bytes.len() > MAX_MODEL {
                self.state = State::Failed;
                self.error = Some(format!("`model` is longer than {MAX_MODEL} bytes"));
            } else {
                raw.extend_from_slice(bytes);
            }
        }
    }

    /// The string that ends at `at` read.
    fn end_string(&mut self, key: bool, at: u64) {
        if key {
            self.state = State::Colon;
            // `model` in any case (Go's encoding/json matches keys so):
            // `Model` after `model` is a duplicate, never a second opinion.
            // Only `model` itself is the model (as serde and Python read
            // it): a body with `Model` alone has none, which a key limited
            // to some models refuses.
            let (any_case, exact) = match self.stack.len() == 1 && !self.key_overflow {
                false => (false, false),
                true => match self.key.contains(&b'\\') {
                    true => unescape(&self.key).map_or((false, false), |k| {
                        (k.eq_ignore_ascii_case("model"), k == "model")
                    }),
                    false => (
                        self.key.eq_ignore_ascii_case(b"model"),
                        self.key == b"model",
                    ),
                },
            };
            if self.stack.len() == 1 {
                self.in_items =
                    !self.key_overflow && (self.key == b"messages" || self.key == b"input");
            }
            if any_case {
                if self.seen_model {
                    self.state = State::Failed;
                    self.error = Some("duplicate field `model`".to_owned());
                    return;
                }
                self.seen_model = true;
                self.model_key_at = Some(at);
                self.model_next = exact;
            }
            return;
        }
        self.state = State::AfterValue;
        if let Some(raw) = self.model_raw.take() {
            match unescape(&raw) {
                Some(m) => self.model = Some(m),
                None => {
                    self.state = State::Failed;
                    self.error = Some("`model` is not a valid string".to_owned());
                }
            }
        }
    }

    fn close(&mut self, open: u8) {
        debug_assert_eq!(self.stack.last(), Some(&open));
        self.stack.pop();
        self.state = if self.stack.is_empty() {
            State::End
        } else {
            State::AfterValue
        };
    }
}

/// Finds the `model` field of a `multipart/form-data` body as it streams
/// (audio transcriptions send it so). Fed chunk by chunk, it keeps a copy of
/// what it has seen until the field has passed, and looks at each part's
/// headers once.
pub struct FormScanner {
    /// `\r\n--` and the boundary: what ends a part.
    delimiter: Vec<u8>,
    buf: Vec<u8>,
    /// Where the next part's headers start (just after a delimiter line).
    part: Option<usize>,
    /// Bytes before this offset have been searched for the delimiter.
    searched: usize,
    model: Option<String>,
    too_long: bool,
    /// A `model` field was read (a second one is a duplicate).
    seen: bool,
    /// Read to the form's end, so a second `model` field is found.
    whole: bool,
    duplicate: bool,
    done: bool,
}

impl FormScanner {
    /// For a `Content-Type` of `multipart/form-data; boundary=…`; `None`
    /// for any other.
    pub fn for_content_type(content_type: &[u8]) -> Option<Self> {
        let ct = std::str::from_utf8(content_type).ok()?;
        let mut params = ct.split(';');
        let kind = params.next()?.trim();
        if !kind.eq_ignore_ascii_case("multipart/form-data") {
            return None;
        }
        let mut boundaries = params.filter_map(|p| {
            let (k, v) = p.split_once('=')?;
            k.trim()
                .eq_ignore_ascii_case("boundary")
                .then(|| v.trim().trim_matches('"').to_owned())
        });
        let boundary = boundaries.next()?;
        // Two boundaries: readers differ on which one counts.
        if boundaries.next().is_some() {
            return None;
        }
        if boundary.is_empty() || boundary.len() > 200 {
            return None;
        }
        // The body starts with `--boundary` (no CRLF before it): a virtual
        // CRLF in front lets one delimiter find the first part too.
        let mut buf = Vec::with_capacity(4096);
        buf.extend_from_slice(b"\r\n");
        Some(Self {
            delimiter: [b"\r\n--".as_slice(), boundary.as_bytes()].concat(),
            buf,
            part: None,
            searched: 0,
            model: None,
            too_long: false,
            seen: false,
            whole: false,
            duplicate: false,
            done: false,
        })
    }

    /// Reads the form to its end (not only to its `model`), so a form that
    /// names its model twice is found out ([`FormScanner::duplicate`]).
    pub fn whole(mut self) -> Self {
        self.whole = true;
        self
    }

    /// True when the form has more than one `model` field.
    pub fn duplicate(&self) -> bool {
        self.duplicate
    }

    /// True once the model was read, or the form ended without one.
    pub fn found(&self) -> bool {
        self.done
    }

    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        if self.done {
            return;
        }
        self.buf.extend_from_slice(chunk);
        loop {
            let from = self.searched;
            let Some(at) = memchr::memmem::find(&self.buf[from..], &self.delimiter) else {
                let tail = self.buf.len().saturating_sub(self.delimiter.len());
                self.searched = from.max(tail);
                self.forget_skipped();
                return;
            };
            let at = from + at;
            // The part that ends here: is it the model field?
            if let Some(start) = self.part
                && let Some(value) = form_value(&self.buf[start..at], b"model")
            {
                if self.seen {
                    self.duplicate = true;
                    self.done = true;
                    self.buf = Vec::new();
                    return;
                }
                self.seen = true;
                self.too_long = value.len() > MAX_MODEL;
                self.model = std::str::from_utf8(value)
                    .ok()
                    .filter(|_| !self.too_long)
                    .map(str::to_owned);
                if !self.whole {
                    self.done = true;
                    self.buf = Vec::new();
                    return;
                }
            }
            let after = at + self.delimiter.len();
            if self.buf.len() < after + 2 {
                // Not yet known whether `--` (the end) or a new part follows:
                // look at this delimiter again when more bytes came.
                self.searched = at;
                return;
            }
            if &self.buf[after..after + 2] == b"--" {
                self.done = true;
                self.buf = Vec::new();
                return;
            }
            self.part = Some(after + 2);
            self.searched = after + 2;
        }
    }

    /// True when the form's `model` field is longer than a model name may
    /// be (1024 bytes): the body cannot be routed.
    pub fn too_long(&self) -> bool {
        self.too_long
    }

    /// Drops what is no longer needed: a part whose headers show it is not
    /// the model field (a file, say) is skipped to its end, so an upload is
    /// not held twice while the form is scanned.
    fn forget_skipped(&mut self) {
        let Some(start) = self.part else {
            // Before the first delimiter (a preamble): nothing to keep.
            let keep = self.buf.len().saturating_sub(self.delimiter.len());
            self.buf.drain(..keep);
            self.searched = 0;
            return;
        };
        let part = &self.buf[start..];
        let ends = [
            memchr::memmem::find(part, b"\r\n\r\n").map(|i| i + 4),
            memchr::memmem::find(part, b"\n\n").map(|i| i + 2),
        ];
        let Some(head_end) = ends.into_iter().flatten().min() else {
            return;
        };
        let head = &self.buf[start..start + head_end];
        if form_value(head, b"model").is_some() {
            return; // the model's value is still coming
        }
        // Keep only what may begin the next delimiter.
        let keep = self.buf.len().saturating_sub(self.delimiter.len());
        self.buf.drain(..keep);
        self.part = None;
        self.searched = 0;
    }

    /// Ends the scan: the body is over.
    pub fn finish(&mut self) {
        self.done = true;
        self.buf = Vec::new();
    }
}

/// The value of a form part when its `Content-Disposition` names `name`.
fn form_value<'a>(part: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    // The headers end at a blank line: CRLF CRLF, or bare LF LF (which
    // lenient readers take too).
    let crlf = memchr::memmem::find(part, b"\r\n\r\n").map(|i| (i, i + 4));
    let lf = memchr::memmem::find(part, b"\n\n").map(|i| (i, i + 2));
    let (head_end, value_at) = match (crlf, lf) {
        (Some(a), Some(b)) => a.min(b),
        (a, b) => a.or(b)?,
    };
    let head = &part[..head_end];
    let named = head.split(|&b| b == b'\n').any(|line| {
        let line = line.to_ascii_lowercase();
        line.starts_with(b"content-disposition:")
            && memchr::memmem::find(&line, b"filename=").is_none()
            && disposition_name(&line).is_some_and(|n| n == name)
    });
    named.then(|| &part[value_at..])
}

/// The `name` parameter of a (lower-cased) `Content-Disposition` line,
/// quoted or not.
fn disposition_name(line: &[u8]) -> Option<&[u8]> {
    let mut from = 0;
    while let Some(i) = memchr::memmem::find(&line[from..], b"name=") {
        let at = from + i;
        from = at + 5;
        if at == 0 || !matches!(line[at - 1], b' ' | b';' | b'\t') {
            continue; // `filename=`, `xname=`
        }
        let rest = &line[at + 5..];
        return Some(match rest.strip_prefix(b"\"") {
            Some(q) => &q[..memchr::memchr(b'"', q).unwrap_or(q.len())],
            None => {
                let end = rest
                    .iter()
                    .position(|b| matches!(b, b';' | b' ' | b'\t' | b'\r'))
                    .unwrap_or(rest.len());
                &rest[..end]
            }
        });
    }
    None
}

/// The text of a JSON string's raw content (escapes resolved, UTF-8 checked).
fn unescape(raw: &[u8]) -> Option<String> {
    if !raw.contains(&b'\\') {
        return std::str::from_utf8(raw).ok().map(str::to_owned);
    }
    let mut quoted = Vec::with_capacity(raw.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(raw);
    quoted.push(b'"');
    serde_json::from_slice::<String>(&quoted).ok()
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// Position of the first `"`, `\` or control byte (< 0x20). Looks at sixteen
/// bytes per step with a branch-free test the compiler vectorises, so long
/// strings (base64 images) pass at memory speed.
fn find_special(s: &[u8]) -> Option<usize> {
    const W: usize = 16;
    let special = |b: u8| (b < 0x20) | (b == b'"') | (b == b'\\');
    let mut base = 0;
    let mut blocks = s.chunks_exact(W);
    for block in blocks.by_ref() {
        if block.iter().fold(false, |acc, &b| acc | special(b)) {
            return block.iter().position(|&b| special(b)).map(|p| base + p);
        }
        base += W;
    }
    blocks
        .remainder()
        .iter()
        .position(|&b| special(b))
        .map(|p| base + p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn scan_in_pieces(body: &[u8], piece: usize) -> Result<Probed, String> {
        let mut s = JsonScanner::new();
        for c in body.chunks(piece.max(1)) {
            s.feed(c);
        }
        s.finish()
    }

    fn serde_verdict(body: &[u8]) -> Result<Option<String>, ()> {
        #[derive(serde::Deserialize)]
        struct P {
            // A present `model` must be a string (null is refused too).
            #[serde(default, deserialize_with = "string_only")]
            model: Option<String>,
        }
        fn string_only<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
            <String as serde::Deserialize>::deserialize(d).map(Some)
        }
        serde_json::from_slice::<P>(body)
            .map(|p| p.model)
            .map_err(|_| ())
    }

    #[test]
    fn reads_model_and_rejects_bad_json() {
        assert_eq!(
            probe(br#"{"messages":[],"model":"gpt-4o"}"#)
                .unwrap()
                .model
                .as_deref(),
            Some("gpt-4o")
        );
        assert_eq!(probe(br#"{"messages":[]}"#).unwrap().model, None);
        // `model: null` is not a model: refused like any non-string.
        assert!(probe(br#"{"model":null}"#).unwrap_err().contains("string"));
        assert_eq!(
            probe(br#"{"model":"caf\u00e9"}"#).unwrap().model.as_deref(),
            Some("café")
        );
        for bad in [
            &br#"{"model":"x","#[..],
            b"not json",
            b"",
            b"   ",
            br#"{"model":"a"} trailing"#,
            br#"{"a":01}"#,
            br#"{"a":1.}"#,
            br#"{"a":-}"#,
            br#"{"a":tru}"#,
            br#"{"a":"\x"}"#,
            br#"{"a":"\u12G4"}"#,
            b"{\"a\":\"tab\tinside\"}",
            br#"{"a":[1,]}"#,
            br#"{"a":1,}"#,
            br#"{,}"#,
            br#"{"a" 1}"#,
            br#"{"a":[}"#,
            br#"{"model":"a","model":"b"}"#,
        ] {
            assert!(
                probe(bad).is_err(),
                "accepted {:?}",
                String::from_utf8_lossy(bad)
            );
            assert!(
                serde_verdict(bad).is_err(),
                "serde accepts {:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(probe(b"[1,2]").unwrap_err().contains("JSON object"));
        assert!(probe(br#"{"model":5}"#).unwrap_err().contains("string"));
        // Too long: refused, in one piece or split anywhere (it once
        // came out as an empty model).
        let long = format!(r#"{{"model":"{}\u0041","messages":[]}}"#, "m".repeat(2000));
        for piece in [1, 7, 100, 5000] {
            let err = scan_in_pieces(long.as_bytes(), piece).unwrap_err();
            assert!(err.contains("longer than"), "{piece}: {err}");
        }
        let mut w = WholeBody::new(0);
        w.push(bytes::Bytes::from_static(
            b"{\"model\":\"m\",\"x\":\"\xc0\xae\"}",
        ));
        assert!(w.finish().unwrap_err().contains("UTF-8"));
    }

    fn form_model(body: &[u8], piece: usize) -> Option<String> {
        let mut f =
            FormScanner::for_content_type(b"multipart/form-data; boundary=\"XyZ\"").unwrap();
        for c in body.chunks(piece.max(1)) {
            f.feed(c);
            if f.found() {
                break;
            }
        }
        f.finish();
        f.model().map(str::to_owned)
    }

    #[test]
    fn form_model_field_found_however_split() {
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.mp3\"\r\nContent-Type: audio/mpeg\r\n\r\nID3\r\n--X\r\n--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--XyZ--\r\n";
        for piece in [1, 2, 5, 13, 1000] {
            assert_eq!(
                form_model(body, piece).as_deref(),
                Some("whisper-1"),
                "{piece}"
            );
        }
        // A form without a model field, and a file *named* model, have none.
        let none = b"--XyZ\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--XyZ\r\nContent-Disposition: form-data; name=\"model\"; filename=\"x\"\r\n\r\nzz\r\n--XyZ--\r\n";
        for piece in [1, 3, 1000] {
            assert_eq!(form_model(none, piece), None);
        }
        // A big file before the model is not kept while it passes.
        let mut f = FormScanner::for_content_type(b"multipart/form-data; boundary=XyZ").unwrap();
        f.feed(
            b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\n",
        );
        for _ in 0..100 {
            f.feed(&[b'x'; 10_000]);
            assert!(f.buf.len() < 20_000, "{}", f.buf.len());
        }
        f.feed(b"\r\n--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--XyZ--\r\n");
        assert_eq!(f.model(), Some("whisper-1"));
        // A model longer than a model name may be: refused.
        let long = format!(
            "--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{}\r\n--XyZ--\r\n",
            "m".repeat(2000)
        );
        let mut f = FormScanner::for_content_type(b"multipart/form-data; boundary=XyZ").unwrap();
        f.feed(long.as_bytes());
        assert!(f.too_long() && f.model().is_none());
        assert!(FormScanner::for_content_type(b"application/json").is_none());
        assert!(FormScanner::for_content_type(b"multipart/form-data").is_none());
    }

    #[test]
    fn finds_model_wherever_it_is_and_however_split() {
        let bodies: &[(&[u8], Option<&str>)] = &[
            (br#"{"model":"gpt-4o","input":"hi"}"#, Some("gpt-4o")),
            (
                br#"{ "input" : ["a\"b", {"model":"nested"}], "n": 3, "model" : "text-embedding-3-small" }"#,
                Some("text-embedding-3-small"),
            ),
            (br#"{"input":"x\\","model":"esc\u0041"}"#, Some("escA")),
            (br#"{"input":"x"}"#, None),
            (br#"{"a":true,"b":null,"c":-1.5e3,"d":0,"e":1E+2,"model":"m"}"#, Some("m")),
            (br#"{"modelx":"no","mode":"no","model":"yes"}"#, Some("yes")),
            (br#"{"mod\u0065l":"escaped-key"}"#, Some("escaped-key")),
        ];
        for (body, want) in bodies {
            for piece in [1, 2, 3, 7, 16, 17, 1000] {
                let got = scan_in_pieces(body, piece).unwrap().model;
                assert_eq!(
                    got.as_deref(),
                    *want,
                    "{} in pieces of {piece}",
                    String::from_utf8_lossy(body)
                );
            }
        }
    }

    #[test]
    fn found_stops_early_for_routing() {
        let mut s = JsonScanner::new();
        s.feed(br#"{"model":"gpt-4o","messages":[{"role":"user","content":"#);
        assert!(s.found());
        assert_eq!(s.model(), Some("gpt-4o"));
        let mut s = JsonScanner::new();
        s.feed(br#"{"messages":[],"mod"#);
        assert!(!s.found());
        s.feed(br#"el":"m"#);
        assert!(!s.found(), "the value is not complete yet");
        s.feed(br#"x","#);
        assert_eq!((s.found(), s.model()), (true, Some("mx")));
    }

    #[test]
    fn a_long_string_crosses_chunks_at_speed_and_stays_exact() {
        let image = "A".repeat(100_000);
        let body = format!(
            r#"{{"messages":[{{"content":[{{"image_url":{{"url":"data:image/png;base64,{image}"}}}}]}}],"model":"gpt-4o"}}"#
        );
        for piece in [1, 15, 16, 4096, 65536] {
            assert_eq!(
                scan_in_pieces(body.as_bytes(), piece)
                    .unwrap()
                    .model
                    .as_deref(),
                Some("gpt-4o")
            );
        }
        let broken = body.replacen("AAAA", "AA\u{1}A", 1);
        assert!(probe(broken.as_bytes()).is_err());
    }

    #[test]
    fn deep_nesting_needs_no_recursion() {
        let body = format!(
            "{{\"a\":{}1{},\"model\":\"m\"}}",
            "[".repeat(200_000),
            "]".repeat(200_000)
        );
        assert_eq!(probe(body.as_bytes()).unwrap().model.as_deref(), Some("m"));
    }

    /// JSON-ish text: valid documents, and the same with one byte changed.
    fn jsonish() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_owned()),
            Just("true".to_owned()),
            Just("false".to_owned()),
            any::<i64>().prop_map(|n| n.to_string()),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| format!("{f:e}")),
            "[a-z \\\\\"é😀\\t]{0,12}".prop_map(|s| serde_json::to_string(&s).unwrap_or_default()),
        ];
        let value = leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5)
                    .prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec(("[a-z]{0,6}", inner), 0..5).prop_map(|kv| {
                    let members: Vec<String> = kv
                        .into_iter()
                        .map(|(k, v)| {
                            format!("{}: {v}", serde_json::to_string(&k).unwrap_or_default())
                        })
                        .collect();
                    format!("{{{}}}", members.join(" ,"))
                }),
            ]
        });
        (
            prop::collection::vec(("[a-z]{1,6}|model", value), 0..6),
            any::<bool>(),
        )
            .prop_map(|(members, with_model)| {
                let mut m: Vec<String> = members
                    .into_iter()
                    .filter(|(k, _)| k != "model")
                    .map(|(k, v)| format!("\"{k}\":{v}"))
                    .collect();
                if with_model {
                    m.insert(m.len() / 2, "\"model\":\"gpt-x\"".to_owned());
                }
                format!("{{{}}}", m.join(","))
            })
    }

    proptest! {
        #[test]
        fn agrees_with_serde_json(doc in jsonish(), cut in any::<prop::sample::Index>(), byte in prop::sample::select(b"{}[],:\"\\ 0-1.eE\tnx".to_vec()), piece in 1usize..40) {
            // The document as generated, and with one byte replaced.
            let mut mutated = doc.clone().into_bytes();
            let at = cut.index(mutated.len().max(1)).min(mutated.len().saturating_sub(1));
            if !mutated.is_empty() {
                mutated[at] = byte;
            }
            for body in [doc.as_bytes(), &mutated[..]] {
                if std::str::from_utf8(body).is_err() {
                    continue; // serde checks UTF-8 in some strings and not others
                }
                let ours = scan_in_pieces(body, piece).map(|p| p.model);
                let theirs = serde_verdict(body);
                prop_assert_eq!(ours.is_ok(), theirs.is_ok(), "{:?}: ours {:?}", String::from_utf8_lossy(body), ours);
                if let (Ok(a), Ok(b)) = (ours, theirs) {
                    prop_assert_eq!(a, b);
                }
            }
        }
    }
}
