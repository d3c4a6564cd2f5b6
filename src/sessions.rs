//! Server-side sessions (`x-visor-session`): the pure parts — which ids and
//! depths are accepted, how a request's messages merge with the stored
//! history, and how an assistant reply is read from a response (a JSON body,
//! or a stream assembled event by event). The store keeps the messages
//! ([`crate::store::Store::append_session`]); the proxy wires them up.
//!
//! Chat Completions shape.

use serde_json::{Map, Value};

/// The longest session id accepted.
pub const MAX_ID_LEN: usize = 128;

/// Why a session header was refused (a 400).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadHeader(pub &'static str);

/// A session id: 1–128 characters of `A–Z a–z 0–9 . _ : -`.
pub fn valid_id(id: &str) -> Result<&str, BadHeader> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'));
    ok.then_some(id).ok_or(BadHeader(
        "x-visor-session must be 1 to 128 characters of A-Z a-z 0-9 . _ : -",
    ))
}

/// The history depth for a request: `x-visor-history` (a whole number,
/// capped by `max_depth`), else `default_depth`.
pub fn depth(
    header: Option<&str>,
    default_depth: usize,
    max_depth: usize,
) -> Result<usize, BadHeader> {
    match header {
        None => Ok(default_depth.min(max_depth)),
        Some(h) => h
            .trim()
            .parse::<u64>()
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX).min(max_depth))
            .map_err(|_| BadHeader("x-visor-history must be a whole number of messages")),
    }
}

/// The store key of a session: the id, in the namespace of the proxy key
/// that asked (its id, see `KeySet::key_id`; `-` when visor has no proxy
/// keys), so one key cannot read another's sessions.
pub fn store_key(namespace: Option<&str>, id: &str) -> String {
    format!("{}/{id}", namespace.unwrap_or("-"))
}

/// A request's messages merged with its session's history.
#[derive(Debug, Default, PartialEq)]
pub struct Merged {
    /// What is sent upstream: the client's leading system messages, the
    /// history, then the client's new messages.
    pub messages: Vec<Value>,
    /// The client's messages that are not stored yet (to store with the
    /// reply).
    pub new: Vec<Value>,
    /// Stored messages prepended.
    pub history_used: usize,
}

/// Merges the client's `messages` with `stored` (oldest first): the
/// client's leading system and developer messages come first; client
/// messages that repeat the stored tail (compared by content, see
/// [`fingerprint`]) are not sent twice or stored again; then the newest
/// `depth` stored messages, never starting on a tool result whose call was
/// cut off; then the new messages.
pub fn merge(messages: Vec<Value>, stored: &[Value], depth: usize) -> Merged {
    let system = messages
        .iter()
        .take_while(|m| matches!(role(m), "system" | "developer"))
        .count();
    let mut messages = messages;
    let rest = messages.split_off(system);
    let stored_fp: Vec<String> = stored.iter().map(fingerprint).collect();
    let rest_fp: Vec<String> = rest.iter().map(fingerprint).collect();
    let most = rest.len().min(stored.len());
    let overlap = (1..=most)
        .rev()
        .find(|&k| stored_fp[stored.len() - k..] == rest_fp[..k])
        .unwrap_or(0);
    let new: Vec<Value> = rest.into_iter().skip(overlap).collect();
    let mut from = stored.len().saturating_sub(depth);
    while from < stored.len() && role(&stored[from]) == "tool" {
        from += 1;
    }
    let history = &stored[from..];
    let mut out = messages;
    out.extend(history.iter().cloned());
    out.extend(new.iter().cloned());
    Merged {
        messages: out,
        history_used: history.len(),
        new,
    }
}

fn role(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

/// What makes two messages the same for the overlap: role, content (text
/// parts joined; null, empty and absent alike), tool calls (id, name,
/// arguments), tool_call_id and name. Fields an SDK adds when it sends a
/// reply back (`refusal: null`, `annotations: []`, a call's `index`) do
/// not count.
pub fn fingerprint(m: &Value) -> String {
    let mut f = Map::new();
    for key in ["role", "tool_call_id", "name"] {
        if let Some(v) = m.get(key).filter(|v| !v.is_null()) {
            f.insert(key.to_owned(), v.clone());
        }
    }
    let content = match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts))
            if parts.iter().all(|p| p.get("type") == Some(&"text".into())) =>
        {
            parts.iter().filter_map(|p| p["text"].as_str()).collect()
        }
        Some(other) if !other.is_null() => other.to_string(),
        _ => String::new(),
    };
    if !content.is_empty() {
        f.insert("content".to_owned(), Value::String(content));
    }
    if let Some(Value::Array(calls)) = m.get("tool_calls")
        && !calls.is_empty()
    {
        let calls: Vec<Value> = calls
            .iter()
            .map(|c| {
                serde_json::json!([c["id"], c["function"]["name"], c["function"]["arguments"]])
            })
            .collect();
        f.insert("tool_calls".to_owned(), Value::Array(calls));
    }
    Value::Object(f).to_string()
}

/// The assistant message of a Chat Completions JSON answer, as stored:
/// role, content and tool calls (nulls left out).
pub fn reply_from_json(body: &[u8]) -> Option<Value> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let m = v.get("choices")?.get(0)?.get("message")?;
    let mut out = Map::new();
    out.insert("role".to_owned(), "assistant".into());
    if let Some(c) = m.get("content").filter(|c| !c.is_null()) {
        out.insert("content".to_owned(), c.clone());
    }
    if let Some(Value::Array(calls)) = m.get("tool_calls")
        && !calls.is_empty()
    {
        out.insert("tool_calls".to_owned(), Value::Array(calls.clone()));
    }
    if !out.contains_key("content") && !out.contains_key("tool_calls") {
        return None;
    }
    Some(Value::Object(out))
}

/// A Chat Completions stream's reply, assembled from its `data:` events as
/// they pass: text and tool calls (by index: id, name, arguments joined).
#[derive(Debug, Default)]
pub struct StreamedReply {
    partial: Vec<u8>,
    content: String,
    calls: Vec<(String, String, String)>,
    /// A `finish_reason` or `[DONE]` was seen: the reply is whole.
    pub complete: bool,
}

impl StreamedReply {
    /// Reads the complete lines of `chunk` (the unfinished last one waits
    /// for the next chunk).
    pub fn observe(&mut self, chunk: &[u8]) {
        self.partial.extend_from_slice(chunk);
        let Some(end) = self.partial.iter().rposition(|&b| b == b'\n') else {
            return;
        };
        let lines: Vec<u8> = self.partial.drain(..=end).collect();
        for line in lines.split(|&b| b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let Some(data) = line.strip_prefix(b"data:") else {
                continue;
            };
            let data = data.trim_ascii();
            if data == b"[DONE]" {
                self.complete = true;
                continue;
            }
            if let Ok(event) = serde_json::from_slice::<Value>(data) {
                self.event(&event);
            }
        }
    }

    fn event(&mut self, event: &Value) {
        let Some(choice) = event.get("choices").and_then(|c| c.get(0)) else {
            return;
        };
        if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
            self.complete = true;
        }
        let Some(delta) = choice.get("delta") else {
            return;
        };
        if let Some(text) = delta.get("content").and_then(Value::as_str) {
            self.content.push_str(text);
        }
        for call in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let i = call.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
            if i >= 128 {
                continue;
            }
            while self.calls.len() <= i {
                self.calls.push(Default::default());
            }
            let slot = &mut self.calls[i];
            if let Some(id) = call.get("id").and_then(Value::as_str) {
                slot.0.push_str(id);
            }
            let f = call.get("function");
            if let Some(name) = f.and_then(|f| f.get("name")).and_then(Value::as_str) {
                slot.1.push_str(name);
            }
            if let Some(args) = f.and_then(|f| f.get("arguments")).and_then(Value::as_str) {
                slot.2.push_str(args);
            }
        }
    }

    /// The assembled assistant message, when the stream completed.
    pub fn message(&self) -> Option<Value> {
        if !self.complete || (self.content.is_empty() && self.calls.is_empty()) {
            return None;
        }
        let mut out = Map::new();
        out.insert("role".to_owned(), "assistant".into());
        if !self.content.is_empty() {
            out.insert("content".to_owned(), self.content.clone().into());
        }
        if !self.calls.is_empty() {
            let calls = self
                .calls
                .iter()
                .map(|(id, name, args)| {
                    serde_json::json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
                })
                .collect();
            out.insert("tool_calls".to_owned(), Value::Array(calls));
        }
        Some(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    #[test]
    fn ids_and_depths() {
        assert!(valid_id("chat-42_a.b:c").is_ok());
        for bad in ["", "a b", "a/b", "é", &"x".repeat(129)] {
            assert!(valid_id(bad).is_err(), "{bad:?}");
        }
        assert_eq!(depth(None, 25, 200), Ok(25));
        assert_eq!(depth(Some("7"), 25, 200), Ok(7));
        assert_eq!(depth(Some("5000"), 25, 200), Ok(200));
        assert!(depth(Some("-1"), 25, 200).is_err());
        assert!(depth(Some("ten"), 25, 200).is_err());
        assert_ne!(store_key(Some("0a1b"), "s"), store_key(Some("2c3d"), "s"));
        assert_eq!(store_key(None, "s"), "-/s");
    }

    fn user(t: &str) -> Value {
        json!({"role": "user", "content": t})
    }
    fn assistant(t: &str) -> Value {
        json!({"role": "assistant", "content": t})
    }

    #[test]
    fn history_goes_between_the_system_prompt_and_the_new_messages() {
        let stored = vec![user("a"), assistant("A"), user("b"), assistant("B")];
        let sys = json!({"role": "system", "content": "be brief"});
        let m = merge(vec![sys.clone(), user("c")], &stored, 25);
        assert_eq!(
            m.messages,
            vec![
                sys.clone(),
                user("a"),
                assistant("A"),
                user("b"),
                assistant("B"),
                user("c")
            ]
        );
        assert_eq!(m.new, vec![user("c")]);
        assert_eq!(m.history_used, 4);
        let m = merge(vec![user("c")], &stored, 2);
        assert_eq!(
            m.messages,
            vec![user("b"), assistant("B"), user("c")],
            "depth"
        );
    }

    #[test]
    fn re_sent_messages_are_not_doubled() {
        let stored = vec![user("a"), assistant("A")];
        // The SDK sends the reply back with fields of its own.
        let echoed =
            json!({"role": "assistant", "content": "A", "refusal": null, "annotations": []});
        let m = merge(vec![user("a"), echoed, user("b")], &stored, 25);
        assert_eq!(m.messages, vec![user("a"), assistant("A"), user("b")]);
        assert_eq!(m.new, vec![user("b")]);
    }

    #[test]
    fn history_never_starts_on_an_orphaned_tool_result() {
        let call = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
        let result = json!({"role": "tool", "tool_call_id": "c1", "content": "42"});
        let stored = vec![
            user("a"),
            call.clone(),
            result.clone(),
            assistant("it is 42"),
        ];
        let m = merge(vec![user("b")], &stored, 2);
        assert_eq!(m.messages, vec![assistant("it is 42"), user("b")]);
        let m = merge(vec![user("b")], &stored, 3);
        assert_eq!(
            m.messages,
            vec![call, result, assistant("it is 42"), user("b")]
        );
    }

    #[test]
    fn replies_from_json_and_from_a_stream() {
        let body = br#"{"choices":[{"index":0,"message":{"role":"assistant","content":"hi","refusal":null},"finish_reason":"stop"}]}"#;
        assert_eq!(reply_from_json(body), Some(assistant("hi")));
        let mut s = StreamedReply::default();
        let events = concat!(
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"Hel\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c1\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\"\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\":1}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: [DONE]\n\n"
        );
        // Split anywhere; whole once the finish_reason has passed.
        let finish = events.find("finish_reason").unwrap();
        for (i, piece) in events.as_bytes().chunks(7).enumerate() {
            if i * 7 < finish {
                assert_eq!(s.message(), None);
            }
            s.observe(piece);
        }
        assert_eq!(
            s.message(),
            Some(
                json!({"role": "assistant", "content": "Hello", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]})
            )
        );
        let mut cut = StreamedReply::default();
        cut.observe(b"data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n");
        assert_eq!(cut.message(), None, "a stream cut short is not a reply");
    }
}
