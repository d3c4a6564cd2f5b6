//! Chat Completions (`POST /v1/chat/completions`): what its answers and
//! stream events are.

use serde_json::{Map, Value};

/// The assistant message of a JSON answer, as stored: role, content and
/// tool calls (nulls left out); `None` when it says nothing.
pub fn reply(v: &Value) -> Option<Value> {
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

/// A streamed reply as its chunks pass: the text, and each tool call by
/// index (id, name, arguments joined).
#[derive(Debug, Default)]
pub struct Stream {
    content: String,
    calls: Vec<(String, String, String)>,
}

impl Stream {
    /// Takes one chunk; true when it ends the reply (a `finish_reason`).
    pub fn event(&mut self, event: &Value) -> bool {
        let Some(choice) = event.get("choices").and_then(|c| c.get(0)) else {
            return false;
        };
        let finished = choice.get("finish_reason").is_some_and(|f| !f.is_null());
        if let Some(delta) = choice.get("delta") {
            self.delta(delta);
        }
        finished
    }

    fn delta(&mut self, delta: &Value) {
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

    /// The assembled assistant message, as [`reply`] makes it of a JSON
    /// answer.
    pub fn message(&self) -> Option<Value> {
        if self.content.is_empty() && self.calls.is_empty() {
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
