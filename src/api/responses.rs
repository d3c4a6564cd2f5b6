//! Responses (`POST /v1/responses`, and its WebSocket mode): what its
//! answers and stream events are.

use serde_json::Value;

/// A response's output items, as stored: without the ids and statuses the
/// provider keeps (an item sent back with an `id` must exist there), and
/// without reasoning items.
pub fn items(response: &Value) -> Vec<Value> {
    let Some(items) = response.get("output").and_then(Value::as_array) else {
        return Vec::new();
    };
    items
        .iter()
        .filter(|i| i["type"] != "reasoning")
        .map(|i| {
            let mut i = i.clone();
            if let Some(o) = i.as_object_mut() {
                o.remove("id");
                o.remove("status");
            }
            i
        })
        .collect()
}

/// A streamed reply: the items of its `response.completed` event.
#[derive(Debug, Default)]
pub struct Stream {
    items: Vec<Value>,
}

impl Stream {
    /// Takes one event; true when it ends the reply (`response.completed`).
    pub fn event(&mut self, event: &Value) -> bool {
        if event["type"] != "response.completed" {
            return false;
        }
        self.items = items(&event["response"]);
        true
    }

    /// The finished response's output items.
    pub fn items(&self) -> Vec<Value> {
        self.items.clone()
    }
}
