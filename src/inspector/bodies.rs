//! The bodies the inspector keeps: the client's and the upstream's JSON of
//! the newest requests, without the bytes of any image, document or audio
//! (each long base64 run becomes `[base64: N bytes, sha256:…]`, the 12 hex
//! digits the artifacts answer to), bounded in all by `[inspector]
//! body_bytes`, the oldest dropped first.

use std::collections::VecDeque;
use std::fmt::Write as _;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// A base64 run shorter than this is kept as it is (ids, hashes, small
/// icons are text a reader wants to see).
pub const MIN_RUN: usize = 512;

/// `body` as the inspector keeps it: parsed, every base64 run of at least
/// [`MIN_RUN`] characters in its strings replaced by a reference; `None`
/// when it is not JSON.
pub fn without_media(body: &[u8]) -> Option<Value> {
    let mut v: Value = serde_json::from_slice(body).ok()?;
    strip(&mut v, 0);
    Some(v)
}

fn strip(v: &mut Value, depth: usize) {
    // As deep as serde_json parses (128); deeper is left as it is.
    if depth > 160 {
        return;
    }
    match v {
        Value::String(s) if s.len() >= MIN_RUN => {
            if let Some(r) = replace_runs(s) {
                *s = r;
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| strip(x, depth + 1)),
        Value::Object(o) => o.values_mut().for_each(|x| strip(x, depth + 1)),
        _ => {}
    }
}

fn is_b64(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'+' | b'/' | b'-' | b'_' | b'=')
}

/// `s` with each base64 run of [`MIN_RUN`] or more characters replaced;
/// `None` when it has none.
fn replace_runs(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out: Option<String> = None;
    let (mut i, mut copied) = (0, 0);
    while i < b.len() {
        if !is_b64(b[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && (is_b64(b[i]) || matches!(b[i], b'\n' | b'\r')) {
            i += 1;
        }
        let run = &s[start..i];
        // A run of letters alone is prose, not base64.
        let looks = run.len() >= MIN_RUN && run.bytes().any(|c| c.is_ascii_digit() || c == b'/');
        if looks {
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

/// `[base64: 12345 bytes, sha256:7ae32ec79dcb]` (the bytes it decodes to),
/// or `[base64: 4000 characters]` when it does not decode.
fn reference(run: &str) -> String {
    let clean: Vec<u8> = run
        .bytes()
        .filter(|c| !c.is_ascii_whitespace())
        .map(|c| match c {
            b'-' => b'+',
            b'_' => b'/',
            c => c,
        })
        .collect();
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

/// The kept bodies of the newest requests, by request id, at most
/// `budget` bytes in all.
pub struct Bodies {
    budget: usize,
    used: usize,
    newest_last: VecDeque<(String, std::sync::Arc<Kept>)>,
}

/// One request's bodies as kept.
#[derive(Debug, Clone, PartialEq)]
pub struct Kept {
    /// What the client sent.
    pub client: Option<Value>,
    /// What went upstream (the same as the client's when visor changed
    /// nothing: then `None`).
    pub upstream: Option<Value>,
    /// What the transforms did to each image, document and audio.
    pub notes: Vec<crate::transform::ImageNote>,
    /// Stored session messages put before the client's.
    pub history_used: usize,
    /// The bytes this takes of the budget.
    pub size: usize,
}

impl Kept {
    pub fn new(client: Option<Value>, upstream: Option<Value>) -> Kept {
        let len = |v: &Option<Value>| {
            v.as_ref()
                .and_then(|v| serde_json::to_vec(v).ok())
                .map_or(0, |b| b.len())
        };
        let size = len(&client) + len(&upstream);
        Kept {
            client,
            upstream,
            notes: Vec::new(),
            history_used: 0,
            size,
        }
    }
}

impl Bodies {
    pub fn new(budget: usize) -> Bodies {
        Bodies {
            budget,
            used: 0,
            newest_last: VecDeque::new(),
        }
    }

    /// Keeps `kept` for request `id`, dropping the oldest past the budget;
    /// a body larger than the whole budget is not kept (`false`).
    pub fn keep(&mut self, id: String, kept: Kept) -> bool {
        if kept.size > self.budget {
            return false;
        }
        self.used += kept.size;
        self.newest_last.push_back((id, std::sync::Arc::new(kept)));
        while self.used > self.budget {
            let Some((_, old)) = self.newest_last.pop_front() else {
                break;
            };
            self.used -= old.size;
        }
        true
    }

    pub fn get(&self, id: &str) -> Option<std::sync::Arc<Kept>> {
        self.newest_last
            .iter()
            .rev()
            .find(|(i, _)| i == id)
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

    #[test]
    fn image_bytes_become_a_reference_the_artifacts_answer_to() {
        let png: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
        let digest = Sha256::digest(&png);
        let hex12: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
        let body = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&png))}},
            {"type": "text", "text": format!("tool said: {{\"png\": \"{}\"}} end", b64(&png))}]}]});
        let kept = without_media(body.to_string().as_bytes()).unwrap();
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
    fn prose_and_short_strings_stay() {
        let prose = "word ".repeat(400);
        let long_letters = "a".repeat(2000);
        let body = json!({"a": prose, "b": long_letters, "c": "abc123"});
        let kept = without_media(body.to_string().as_bytes()).unwrap();
        assert_eq!(kept, body);
        assert!(without_media(b"not json").is_none());
    }

    #[test]
    fn the_budget_drops_the_oldest() {
        let mut b = Bodies::new(100);
        let k = |n: usize| Kept {
            size: n,
            ..Kept::new(None, None)
        };
        b.keep("a".into(), k(40));
        b.keep("b".into(), k(40));
        b.keep("c".into(), k(40));
        assert!(b.get("a").is_none() && b.get("b").is_some() && b.get("c").is_some());
        assert_eq!(b.used(), 80);
        assert!(!b.keep("huge".into(), k(101)));
        assert!(b.get("huge").is_none() && b.used() == 80);
        let mut none = Bodies::new(0);
        none.keep("x".into(), k(1));
        assert!(none.get("x").is_none());
    }
}
