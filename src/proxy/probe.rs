//! Reading the `model` of a request body without building a document.
//!
//! Two readers:
//! - [`probe`]: for a body visor holds whole (the transformed endpoints). It
//!   validates the JSON (invalid JSON is a 400 there) and borrows `model`;
//!   everything else is skipped by serde's `IgnoredAny`, which scans strings
//!   without copying them, so a 4 MB base64 image costs one pass over bytes.
//! - [`ModelScanner`]: for bodies visor streams through. It is fed chunks as
//!   they arrive and reports the top-level `"model"` string as soon as it has
//!   passed, so the rest of the body never has to be held.

use std::borrow::Cow;

use serde::Deserialize;

#[derive(Deserialize)]
struct Probe<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
}

/// What [`probe`] found.
#[derive(Debug, PartialEq, Eq)]
pub struct Probed {
    pub model: Option<String>,
}

/// Validates `body` as a JSON object and returns its top-level `model`.
pub fn probe(body: &[u8]) -> Result<Probed, String> {
    match serde_json::from_slice::<Probe<'_>>(body) {
        Ok(p) => Ok(Probed {
            model: p.model.map(Cow::into_owned),
        }),
        Err(e) if e.classify() == serde_json::error::Category::Data => {
            if body.trim_ascii_start().first() == Some(&b'{') {
                Err(format!("`model` must be a string ({e})"))
            } else {
                Err("the body must be a JSON object".to_owned())
            }
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Where the scanner is in the top-level object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Top {
    /// Before the opening `{`.
    Start,
    /// Expecting a key (after `{` or `,`).
    Key,
    /// Inside a top-level key string.
    InKey,
    /// After a key, expecting `:`.
    Colon,
    /// Expecting a value.
    Value,
    /// Inside the string value of `"model"`.
    InModel,
    /// Skipping a nested or scalar value; `depth` counts brackets.
    Skip,
    /// Done: found, or the body is not an object we can read.
    Done,
}

/// Incremental finder of the top-level `"model"` string of a JSON object.
pub struct ModelScanner {
    state: Top,
    /// Bracket depth while skipping a value.
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// The current top-level key (raw bytes, bounded).
    key: Vec<u8>,
    key_is_model: bool,
    /// The raw bytes of the model value, escapes included.
    value: Vec<u8>,
    found: Option<String>,
}

const MAX_KEY: usize = 64;
const MAX_MODEL: usize = 1024;

impl Default for ModelScanner {
    fn default() -> Self {
        Self::new()
    }
}

impl ModelScanner {
    pub fn new() -> Self {
        Self {
            state: Top::Start,
            depth: 0,
            in_string: false,
            escaped: false,
            key: Vec::new(),
            key_is_model: false,
            value: Vec::new(),
            found: None,
        }
    }

    /// True once the model was found or the scanner gave up.
    pub fn is_done(&self) -> bool {
        self.state == Top::Done
    }

    pub fn model(&self) -> Option<&str> {
        self.found.as_deref()
    }

    /// Feeds the next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        let mut i = 0;
        while i < chunk.len() && self.state != Top::Done {
            let b = chunk[i];
            match self.state {
                Top::Start => {
                    if b == b'{' {
                        self.state = Top::Key;
                    } else if !b.is_ascii_whitespace() {
                        self.state = Top::Done;
                    }
                }
                Top::Key => {
                    if b == b'"' {
                        self.key.clear();
                        self.escaped = false;
                        self.state = Top::InKey;
                    } else if b == b'}' || !(b.is_ascii_whitespace() || b == b',') {
                        self.state = Top::Done;
                    }
                }
                Top::InKey => {
                    if self.escaped {
                        self.escaped = false;
                        self.push_key(b);
                    } else if b == b'\\' {
                        self.escaped = true;
                        self.push_key(b);
                    } else if b == b'"' {
                        self.key_is_model = self.key == b"model";
                        self.state = Top::Colon;
                    } else {
                        self.push_key(b);
                    }
                }
                Top::Colon => {
                    if b == b':' {
                        self.state = Top::Value;
                    } else if !b.is_ascii_whitespace() {
                        self.state = Top::Done;
                    }
                }
                Top::Value => {
                    if b.is_ascii_whitespace() {
                    } else if self.key_is_model && b == b'"' {
                        self.value.clear();
                        self.escaped = false;
                        self.state = Top::InModel;
                    } else if self.key_is_model {
                        // `"model": null` or another type: no model to route by.
                        self.state = Top::Done;
                    } else {
                        self.depth = 0;
                        self.in_string = false;
                        self.escaped = false;
                        self.state = Top::Skip;
                        continue; // the value's first byte is handled by Skip
                    }
                }
                Top::InModel => {
                    if self.escaped {
                        self.escaped = false;
                    } else if b == b'\\' {
                        self.escaped = true;
                    } else if b == b'"' {
                        let mut raw = Vec::with_capacity(self.value.len() + 2);
                        raw.push(b'"');
                        raw.extend_from_slice(&self.value);
                        raw.push(b'"');
                        self.found = serde_json::from_slice::<String>(&raw).ok();
                        self.state = Top::Done;
                        continue;
                    }
                    if self.value.len() >= MAX_MODEL {
                        self.state = Top::Done;
                    } else {
                        self.value.push(b);
                    }
                }
                Top::Skip => {
                    if self.in_string {
                        // Jump over string content: long strings (images) go fast.
                        if self.escaped {
                            self.escaped = false;
                        } else if let Some(off) = memchr::memchr2(b'"', b'\\', &chunk[i..]) {
                            i += off;
                            if chunk[i] == b'\\' {
                                self.escaped = true;
                            } else {
                                self.in_string = false;
                                if self.depth == 0 {
                                    self.state = Top::Key;
                                }
                            }
                        } else {
                            i = chunk.len();
                            continue;
                        }
                    } else {
                        match b {
                            b'"' => self.in_string = true,
                            b'{' | b'[' => self.depth += 1,
                            b'}' | b']' if self.depth > 0 => {
                                self.depth -= 1;
                                if self.depth == 0 {
                                    self.state = Top::Key;
                                }
                            }
                            b'}' if self.depth == 0 => self.state = Top::Done,
                            b',' if self.depth == 0 => self.state = Top::Key,
                            _ => {}
                        }
                    }
                }
                Top::Done => {}
            }
            i += 1;
        }
    }

    fn push_key(&mut self, b: u8) {
        if self.key.len() < MAX_KEY {
            self.key.push(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_in_pieces(body: &[u8], piece: usize) -> Option<String> {
        let mut s = ModelScanner::new();
        for c in body.chunks(piece.max(1)) {
            s.feed(c);
            if s.is_done() {
                break;
            }
        }
        s.model().map(str::to_owned)
    }

    #[test]
    fn probe_reads_model_and_rejects_bad_json() {
        assert_eq!(
            probe(br#"{"messages":[],"model":"gpt-4o"}"#)
                .unwrap()
                .model
                .as_deref(),
            Some("gpt-4o")
        );
        assert_eq!(probe(br#"{"messages":[]}"#).unwrap().model, None);
        assert_eq!(probe(br#"{"model":null}"#).unwrap().model, None);
        assert!(probe(br#"{"model":"x","#).is_err());
        assert!(probe(b"not json").is_err());
        assert!(probe(b"[1,2]").unwrap_err().contains("JSON object"));
        assert!(probe(br#"{"model":5}"#).unwrap_err().contains("string"));
        assert!(probe(br#"{"model":"a"} trailing"#).is_err());
    }

    #[test]
    fn scanner_finds_model_wherever_it_is_and_however_split() {
        let bodies: &[(&[u8], Option<&str>)] = &[
            (br#"{"model":"gpt-4o","input":"hi"}"#, Some("gpt-4o")),
            (
                br#"{ "input" : ["a\"b", {"model":"nested"}], "n": 3, "model" : "text-embedding-3-small" }"#,
                Some("text-embedding-3-small"),
            ),
            (br#"{"input":"x\\","model":"esc\u0041"}"#, Some("escA")),
            (br#"{"input":"x"}"#, None),
            (br#"{"model":null,"x":1}"#, None),
            (br#"[{"model":"no"}]"#, None),
            (br#"{"a":true,"b":null,"c":-1.5e3,"model":"m"}"#, Some("m")),
        ];
        for (body, want) in bodies {
            for piece in [1, 2, 3, 7, 1000] {
                assert_eq!(
                    scan_in_pieces(body, piece).as_deref(),
                    *want,
                    "{} in pieces of {piece}",
                    String::from_utf8_lossy(body)
                );
            }
        }
    }

    #[test]
    fn scanner_agrees_with_serde_on_generated_bodies() {
        // A tiny deterministic generator: objects with the model at each position.
        for pos in 0..5 {
            let mut fields = vec![
                r#""input":"a \"quoted\" \\ string with } and ]""#.to_owned(),
                r#""opts":{"model":"inner","list":[1,[2,{"x":"}"}]]}"#.to_owned(),
                r#""n":12"#.to_owned(),
                r#""flag":false"#.to_owned(),
            ];
            fields.insert(pos.min(fields.len()), r#""model":"m-\u00e9""#.to_owned());
            let body = format!("{{{}}}", fields.join(","));
            let want = probe(body.as_bytes()).unwrap().model;
            for piece in [1, 5, 64] {
                assert_eq!(scan_in_pieces(body.as_bytes(), piece), want, "{body}");
            }
        }
    }
}
