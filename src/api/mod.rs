//! The three APIs visor transforms, one place per shape: which endpoint
//! each is, where a request's messages are, what an answer's reply and a
//! stream's events are ([`chat`], [`messages`], [`responses`]), and the
//! one SSE line framer ([`sse`]). The parts that read a request or a reply
//! ask here rather than matching on the API themselves.

pub mod chat;
pub mod messages;
pub mod responses;
pub mod sse;
pub mod usage;

use serde::Serialize;
use serde_json::Value;

/// The API shape of a transformed endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Shape {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/responses`
    Responses,
    /// `POST /v1/messages` (Anthropic)
    Messages,
}

impl Shape {
    /// The shape of a path after `/v1`, for `POST`.
    pub fn of_path(rest: &str) -> Option<Shape> {
        match rest {
            "/chat/completions" => Some(Shape::Chat),
            "/responses" => Some(Shape::Responses),
            "/messages" => Some(Shape::Messages),
            _ => None,
        }
    }

    /// Where a request's messages are: `messages`, or Responses `input` (a
    /// string there is one user message).
    pub fn items_key(self) -> &'static str {
        match self {
            Shape::Chat | Shape::Messages => "messages",
            Shape::Responses => "input",
        }
    }

    /// The `type` of a text part in a request's content.
    pub fn text_part_type(self) -> &'static str {
        match self {
            Shape::Chat | Shape::Messages => "text",
            Shape::Responses => "input_text",
        }
    }
}

/// The reply of a JSON answer in `shape`, as stored (one message; several
/// output items for Responses).
pub fn reply_from_json(shape: Shape, body: &[u8]) -> Vec<Value> {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return Vec::new();
    };
    match shape {
        Shape::Chat => chat::reply(&v).into_iter().collect(),
        Shape::Responses => responses::items(&v),
        Shape::Messages => messages::reply(&v).into_iter().collect(),
    }
}

/// A stream's reply, assembled from its `data:` events as they pass.
#[derive(Debug)]
pub struct StreamedReply {
    lines: sse::Lines,
    stream: Stream,
    /// The stream's end was seen (`finish_reason`/`[DONE]`, `message_stop`,
    /// `response.completed`): the reply is whole.
    pub complete: bool,
}

/// The reply so far, in its API's terms.
#[derive(Debug)]
enum Stream {
    Chat(chat::Stream),
    Messages(messages::Stream),
    Responses(responses::Stream),
}

impl StreamedReply {
    pub fn new(shape: Shape) -> Self {
        let stream = match shape {
            Shape::Chat => Stream::Chat(chat::Stream::default()),
            Shape::Messages => Stream::Messages(messages::Stream::default()),
            Shape::Responses => Stream::Responses(responses::Stream::default()),
        };
        StreamedReply {
            lines: sse::Lines::new(),
            stream,
            complete: false,
        }
    }

    /// Reads the complete lines of `chunk` (the unfinished last one waits
    /// for the next chunk).
    pub fn observe(&mut self, chunk: &[u8]) {
        let (stream, complete) = (&mut self.stream, &mut self.complete);
        self.lines.feed(chunk, |line| {
            let Some(data) = sse::data(line) else {
                return;
            };
            let data = data.trim_ascii();
            if data == b"[DONE]" {
                *complete = true;
                return;
            }
            if let Ok(event) = serde_json::from_slice::<Value>(data) {
                *complete |= stream.event(&event);
            }
        });
    }

    /// The assembled reply (several items for Responses), when the stream
    /// completed.
    pub fn reply(&self) -> Vec<Value> {
        if !self.complete {
            return Vec::new();
        }
        match &self.stream {
            Stream::Chat(s) => s.message().into_iter().collect(),
            Stream::Responses(s) => s.items(),
            Stream::Messages(s) => s.message().into_iter().collect(),
        }
    }
}

impl Stream {
    fn event(&mut self, event: &Value) -> bool {
        match self {
            Stream::Chat(s) => s.event(event),
            Stream::Messages(s) => s.event(event),
            Stream::Responses(s) => s.event(event),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    fn assistant(t: &str) -> Value {
        json!({"role": "assistant", "content": t})
    }

    #[test]
    fn transformed_endpoints() {
        assert_eq!(Shape::of_path("/chat/completions"), Some(Shape::Chat));
        assert_eq!(Shape::of_path("/responses"), Some(Shape::Responses));
        assert_eq!(Shape::of_path("/messages"), Some(Shape::Messages));
        assert_eq!(Shape::of_path("/embeddings"), None);
        assert_eq!(Shape::of_path("/responses/abc/cancel"), None);
    }

    #[test]
    fn replies_from_json_and_from_a_stream() {
        let body = br#"{"choices":[{"index":0,"message":{"role":"assistant","content":"hi","refusal":null},"finish_reason":"stop"}]}"#;
        assert_eq!(reply_from_json(Shape::Chat, body), vec![assistant("hi")]);
        let mut s = StreamedReply::new(Shape::Chat);
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
                assert!(s.reply().is_empty());
            }
            s.observe(piece);
        }
        assert_eq!(
            s.reply(),
            vec![
                json!({"role": "assistant", "content": "Hello", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]})
            ]
        );
        let mut cut = StreamedReply::new(Shape::Chat);
        cut.observe(b"data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n");
        assert!(cut.reply().is_empty(), "a stream cut short is not a reply");
    }

    #[test]
    fn anthropic_and_responses_replies() {
        let body = br#"{"type":"message","role":"assistant","content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn"}"#;
        assert_eq!(
            reply_from_json(Shape::Messages, body),
            vec![json!({"role": "assistant", "content": [{"type": "text", "text": "hi"}]})]
        );
        let mut s = StreamedReply::new(Shape::Messages);
        for e in [
            json!({"type": "message_start", "message": {"role": "assistant"}}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Let me "}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "look."}}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "t1", "name": "f", "input": {}}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"q\":"}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "1}"}}),
            json!({"type": "message_stop"}),
        ] {
            s.observe(format!("event: x\ndata: {e}\n\n").as_bytes());
        }
        assert_eq!(
            s.reply(),
            vec![json!({"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"q": 1}}
            ]})]
        );
        // A block that is not an object (found by the stream fuzz target:
        // the text delta used to panic on a string block) is skipped.
        let mut odd = StreamedReply::new(Shape::Messages);
        for e in [
            json!({"type": "content_block_start", "index": 0, "content_block": "text"}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text"}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "ok"}}),
            json!({"type": "message_stop"}),
        ] {
            odd.observe(format!("data: {e}\n").as_bytes());
        }
        assert_eq!(
            odd.reply(),
            vec![json!({"role": "assistant", "content": [{"type": "text", "text": "ok"}]})]
        );
        let done = json!({"type": "response.completed", "response": {"output": [
            {"id": "rs_1", "type": "reasoning", "summary": []},
            {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}
        ]}});
        let mut r = StreamedReply::new(Shape::Responses);
        r.observe(format!("data: {done}\n\n").as_bytes());
        let want = vec![
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}),
        ];
        assert_eq!(r.reply(), want);
        assert_eq!(
            reply_from_json(Shape::Responses, done["response"].to_string().as_bytes()),
            want
        );
    }
}
