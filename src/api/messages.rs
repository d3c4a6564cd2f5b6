//! Anthropic Messages (`POST /v1/messages`): what its answers and stream
//! events are.

use serde_json::Value;

/// An answer's assistant message: role and content blocks; `None` when it
/// has none.
pub fn reply(v: &Value) -> Option<Value> {
    let content = v.get("content").and_then(Value::as_array)?;
    if content.is_empty() {
        return None;
    }
    Some(serde_json::json!({"role": "assistant", "content": content}))
}

/// A streamed reply as its events pass: each content block by index, and
/// the JSON text of a `tool_use` block's input.
#[derive(Debug, Default)]
pub struct Stream {
    blocks: Vec<(Value, String)>,
}

impl Stream {
    /// Takes one event; true when it ends the reply (`message_stop`).
    pub fn event(&mut self, event: &Value) -> bool {
        let index = event.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
        match event["type"].as_str() {
            Some("content_block_start") if index < 128 => {
                while self.blocks.len() <= index {
                    self.blocks.push((Value::Null, String::new()));
                }
                // Only an object is a block (anything else is skipped).
                let block = &event["content_block"];
                self.blocks[index].0 = match block.is_object() {
                    true => block.clone(),
                    false => Value::Null,
                };
            }
            Some("content_block_delta") => self.delta(index, &event["delta"]),
            Some("message_stop") => return true,
            _ => {}
        }
        false
    }

    fn delta(&mut self, index: usize, delta: &Value) {
        let Some((block, json)) = self.blocks.get_mut(index) else {
            return;
        };
        match delta["type"].as_str() {
            Some("text_delta") => {
                let Some(block) = block.as_object_mut() else {
                    return;
                };
                let text = delta["text"].as_str().unwrap_or("");
                match block.get_mut("text") {
                    Some(Value::String(old)) => old.push_str(text),
                    _ => {
                        block.insert("text".to_owned(), Value::String(text.to_owned()));
                    }
                }
            }
            Some("input_json_delta") => {
                json.push_str(delta["partial_json"].as_str().unwrap_or(""));
            }
            _ => {}
        }
    }

    /// The assembled assistant message, as [`reply`] makes it of a JSON
    /// answer.
    pub fn message(&self) -> Option<Value> {
        let content: Vec<Value> = self
            .blocks
            .iter()
            .filter(|(b, _)| !b.is_null())
            .map(|(b, json)| {
                let mut b = b.clone();
                if b["type"] == "tool_use" && !json.is_empty() {
                    b["input"] = serde_json::from_str(json).unwrap_or(Value::Null);
                }
                b
            })
            .collect();
        reply(&serde_json::json!({ "content": content }))
    }
}
