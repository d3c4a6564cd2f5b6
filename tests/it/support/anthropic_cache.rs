//! An Anthropic-kind upstream's prompt cache, simulated for the mock: it
//! caches a prefix at each `cache_control` breakpoint of a request (when it
//! reaches 1024 tokens), and a later request reads the longest cached prefix
//! that ends at one of its breakpoints or up to 20 blocks before one. Its
//! `usage` says what it read and wrote, as the provider's does. Tokens are
//! the blocks' JSON bytes (markers removed, keys sorted) over 4.

use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::{Value, json};

const MIN_TOKENS: u64 = 1024;
const LOOKBACK: usize = 20;

#[derive(Default)]
pub struct CacheSim {
    written: Mutex<HashSet<u64>>,
    /// Reads nothing (a provider that lost its cache).
    pub forget: AtomicBool,
}

/// What the simulated provider's `usage` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub input: u64,
    pub read: u64,
    pub written: u64,
}

impl Usage {
    pub fn json(&self) -> Value {
        json!({
            "input_tokens": self.input,
            "output_tokens": 5,
            "cache_read_input_tokens": self.read,
            "cache_creation_input_tokens": self.written,
        })
    }
}

fn strip(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.remove("cache_control");
            m.values_mut().for_each(strip);
        }
        Value::Array(a) => a.iter_mut().for_each(strip),
        _ => {}
    }
}

/// The request's blocks in cache order (tools, system, messages' content),
/// each with whether it carries a marker.
pub fn blocks(body: &Value) -> Vec<(Value, bool)> {
    let mut out = Vec::new();
    let mut push = |b: &Value| {
        let marked = b.get("cache_control").is_some();
        let mut b = b.clone();
        strip(&mut b);
        out.push((b, marked));
    };
    for t in body["tools"].as_array().into_iter().flatten() {
        push(t);
    }
    match &body["system"] {
        Value::String(s) => push(&json!({"type": "text", "text": s})),
        Value::Array(a) => a.iter().for_each(&mut push),
        _ => {}
    }
    for m in body["messages"].as_array().into_iter().flatten() {
        match &m["content"] {
            Value::String(s) => push(&json!({"type": "text", "text": s, "role": m["role"]})),
            Value::Array(a) => {
                for (i, b) in a.iter().enumerate() {
                    // The role is part of what is cached.
                    let mut b = b.clone();
                    if i == 0
                        && let Some(o) = b.as_object_mut()
                    {
                        o.insert("role".into(), m["role"].clone());
                    }
                    push(&b);
                }
            }
            _ => {}
        }
    }
    out
}

impl CacheSim {
    /// Reads and writes the cache for one request; what its usage says.
    pub fn request(&self, body: &[u8]) -> Usage {
        let Ok(body) = serde_json::from_slice::<Value>(body) else {
            return Usage::default();
        };
        let blocks = blocks(&body);
        let mut prefix = Vec::with_capacity(blocks.len());
        let (mut h, mut t) = (std::collections::hash_map::DefaultHasher::new(), 0u64);
        for (b, _) in &blocks {
            let text = b.to_string();
            text.hash(&mut h);
            t += text.len() as u64 / 4;
            prefix.push((h.finish(), t));
        }
        let total = t;
        let marks: Vec<usize> = (0..blocks.len()).filter(|&i| blocks[i].1).collect();
        let mut written = self.written.lock().unwrap();
        if self.forget.load(Ordering::SeqCst) {
            written.clear();
        }
        let read = marks
            .iter()
            .flat_map(|&m| (m.saturating_sub(LOOKBACK)..=m).rev())
            .filter(|&j| written.contains(&prefix[j].0))
            .map(|j| prefix[j].1)
            .max()
            .unwrap_or(0);
        let last = marks.last().map_or(0, |&m| prefix[m].1);
        let mut wrote = 0;
        for &m in &marks {
            if prefix[m].1 >= MIN_TOKENS && written.insert(prefix[m].0) {
                wrote = last.saturating_sub(read);
            }
        }
        Usage {
            input: total - read - wrote,
            read,
            written: wrote,
        }
    }
}
