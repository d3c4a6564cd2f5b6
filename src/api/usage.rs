//! Reads token `usage` from a response as it passes, without delaying it.
//!
//! - A JSON body (non-stream): the chunks are kept by reference (`Bytes` are
//!   reference-counted, nothing is copied) up to [`MAX_JSON`], and parsed once
//!   at the end.
//! - An SSE stream: each complete `data:` line that carries a `"usage":{…}`
//!   object is parsed; only the unfinished last line of a chunk is copied.
//!
//! Shapes understood: OpenAI Chat (`prompt_tokens`/`completion_tokens`),
//! Responses (`response.usage.input_tokens`/`output_tokens`) and Anthropic
//! (`message.usage.input_tokens` in `message_start`, cumulative
//! `usage.output_tokens` in `message_delta`). The provider's prompt-cache
//! figures too: OpenAI `prompt_tokens_details.cached_tokens` (Responses
//! `input_tokens_details.cached_tokens`), Anthropic
//! `cache_read_input_tokens` and `cache_creation_input_tokens`, DeepSeek
//! `prompt_cache_hit_tokens`.

use bytes::Bytes;

use super::sse::{self, Lines};
use serde::Deserialize;

const MAX_JSON: usize = 4 * 1024 * 1024;
const MAX_LINE: usize = 1024 * 1024;

/// Tokens seen so far.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt: u64,
    pub completion: u64,
    /// Prompt tokens the provider read from its cache.
    pub cached_read: u64,
    /// Prompt tokens the provider wrote to its cache (Anthropic).
    pub cache_write: u64,
    /// The provider said what its cache read or wrote (a server that
    /// reports no cache figure may have no cache).
    pub cache_said: bool,
    /// Bytes of generated text a stream carried (its deltas' strings): what
    /// the answer cost when it ends before its `usage` does.
    pub text_bytes: u64,
}

impl Usage {
    /// Completion tokens to charge: as the provider said, for a response
    /// that ended whole and said them; otherwise (a stream left before its
    /// usage, one whose only figure is an early one such as Anthropic's
    /// `message_start`, or one that never says) at least the text it
    /// streamed, at 4 bytes a token.
    pub fn completion_charged(&self, whole: bool) -> u64 {
        let streamed = self.text_bytes / crate::limits::BYTES_PER_TOKEN;
        match whole && self.completion > 0 {
            true => self.completion,
            false => self.completion.max(streamed),
        }
    }
}

/// The parts of a response or event that may carry `usage`; everything else
/// is skipped by serde without being built.
#[derive(Deserialize, Default)]
struct Carrier {
    #[serde(default)]
    usage: Option<Counts>,
    #[serde(default)]
    response: Option<Nested>,
    #[serde(default)]
    message: Option<Nested>,
}

#[derive(Deserialize, Default)]
struct Nested {
    #[serde(default)]
    usage: Option<Counts>,
}

/// Both spellings are fields of their own (an alias would make a usage
/// object carrying both a duplicate-field error, and lose it all).
#[derive(Deserialize, Default)]
struct Counts {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
    #[serde(default)]
    input_tokens_details: Option<Details>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    /// DeepSeek's.
    #[serde(default)]
    prompt_cache_hit_tokens: Option<u64>,
}

#[derive(Deserialize, Default)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl Usage {
    /// The usage carried by one JSON event (a WebSocket server event such
    /// as `response.completed`), if any.
    pub fn of_event(json: &[u8]) -> Option<Usage> {
        memchr::memmem::find(json, b"\"usage\"")?;
        let c = serde_json::from_slice::<Carrier>(json).ok()?;
        let mut u = Usage::default();
        u.merge(c);
        (u != Usage::default()).then_some(u)
    }

    fn merge(&mut self, c: Carrier) {
        let counts = c
            .usage
            .or_else(|| c.response.and_then(|r| r.usage))
            .or_else(|| c.message.and_then(|m| m.usage));
        let Some(u) = counts else { return };
        if let Some(p) = u.prompt_tokens.or(u.input_tokens) {
            self.prompt = self.prompt.max(p);
        }
        if let Some(c) = u.completion_tokens.or(u.output_tokens) {
            self.completion = self.completion.max(c);
        }
        let cached = u
            .prompt_tokens_details
            .and_then(|d| d.cached_tokens)
            .or_else(|| u.input_tokens_details.and_then(|d| d.cached_tokens))
            .or(u.cache_read_input_tokens)
            .or(u.prompt_cache_hit_tokens);
        if let Some(c) = cached {
            self.cached_read = self.cached_read.max(c);
            self.cache_said = true;
        }
        if let Some(c) = u.cache_creation_input_tokens {
            self.cache_write = self.cache_write.max(c);
            self.cache_said = true;
        }
    }
}

pub enum UsageObserver {
    /// Not a body we read (compressed, binary, or too large).
    Off,
    Json {
        chunks: Vec<Bytes>,
        len: usize,
    },
    Sse {
        lines: Lines,
        usage: Usage,
    },
}

impl UsageObserver {
    /// Chooses by the response's `content-type` and `content-encoding`.
    pub fn for_response(headers: &http::HeaderMap) -> Self {
        let encoded = headers
            .get(http::header::CONTENT_ENCODING)
            .is_some_and(|v| v.as_bytes() != b"identity");
        if encoded {
            return UsageObserver::Off;
        }
        let ct = headers
            .get(http::header::CONTENT_TYPE)
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        if contains(ct, b"text/event-stream") {
            UsageObserver::Sse {
                lines: Lines::bounded(MAX_LINE),
                usage: Usage::default(),
            }
        } else if contains(ct, b"json") {
            UsageObserver::Json {
                chunks: Vec::new(),
                len: 0,
            }
        } else {
            UsageObserver::Off
        }
    }

    pub fn observe(&mut self, data: &Bytes) {
        match self {
            UsageObserver::Off => {}
            UsageObserver::Json { chunks, len } => {
                *len += data.len();
                if *len > MAX_JSON {
                    *self = UsageObserver::Off;
                } else {
                    chunks.push(data.clone());
                }
            }
            UsageObserver::Sse { lines, usage } => {
                lines.feed(data, |line| sse_line(line, usage));
            }
        }
    }

    /// The usage found, at the end of the body.
    pub fn finish(&mut self) -> Usage {
        match std::mem::replace(self, UsageObserver::Off) {
            UsageObserver::Off => Usage::default(),
            UsageObserver::Json { chunks, len } => {
                let mut usage = Usage::default();
                let parsed = if chunks.len() == 1 {
                    serde_json::from_slice::<Carrier>(&chunks[0])
                } else {
                    let mut all = Vec::with_capacity(len);
                    for c in &chunks {
                        all.extend_from_slice(c);
                    }
                    serde_json::from_slice::<Carrier>(&all)
                };
                if let Ok(c) = parsed {
                    usage.merge(c);
                }
                usage
            }
            UsageObserver::Sse {
                mut lines,
                mut usage,
            } => {
                sse_line(&lines.finish(), &mut usage);
                usage
            }
        }
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    memchr::memmem::find(hay, needle).is_some()
}

/// A searcher made once: every streamed event is searched for these, and
/// `memmem::find` would build its searcher again on each call.
macro_rules! finder {
    ($needle:expr) => {{
        static FINDER: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
            std::sync::LazyLock::new(|| memchr::memmem::Finder::new($needle));
        &*FINDER
    }};
}

/// Parses one SSE line if it is `data: {…"usage": {…}…}`; otherwise
/// counts the generated text it carries.
fn sse_line(line: &[u8], usage: &mut Usage) {
    let Some(payload) = sse::data(line) else {
        return;
    };
    let Some(at) = finder!(b"\"usage\"").find(payload) else {
        usage.text_bytes += text_bytes(payload);
        return;
    };
    // Skip `"usage"`, whitespace and `:`; only an object is worth parsing
    // (OpenAI sends `"usage":null` on every chunk but the last).
    let after = payload[at + 7..]
        .iter()
        .position(|b| !(b.is_ascii_whitespace() || *b == b':'))
        .map(|p| payload[at + 7 + p]);
    if after != Some(b'{') {
        usage.text_bytes += text_bytes(payload);
        return;
    }
    if let Ok(c) = serde_json::from_slice::<Carrier>(payload.trim_ascii()) {
        usage.merge(c);
    }
}

/// A Responses event that repeats text its deltas carried
/// (`response.output_text.done`, `.content_part.done`,
/// `.output_item.done`, `.function_call_arguments.done`…, and the
/// response's end): not counted again.
fn repeats_text(payload: &[u8]) -> bool {
    let Some(at) = finder!(b"\"type\":\"response.").find(payload) else {
        return false;
    };
    let value = &payload[at + 8..];
    let Some(end) = memchr::memchr(b'"', value) else {
        return false;
    };
    let ty = &value[..end];
    ty.ends_with(b".done")
        || matches!(
            ty,
            b"response.completed" | b"response.incomplete" | b"response.failed"
        )
}

/// The keys a stream carries its generated text in (see [`text_bytes`]).
const TEXT_KEYS: [&[u8]; 8] = [
    b"content",
    b"arguments",
    b"delta",
    b"text",
    b"partial_json",
    b"thinking",
    b"reasoning",
    b"reasoning_content",
];

/// Bytes of generated text in one streamed event: the string values of the
/// keys streams carry text in (Chat `content` and tool `arguments`,
/// Responses `delta`, Anthropic `text`, `partial_json` and `thinking`,
/// reasoning), escapes counted as written.
pub fn text_bytes(payload: &[u8]) -> u64 {
    if repeats_text(payload) {
        return 0;
    }
    const LONGEST_KEY: usize = b"reasoning_content".len();
    let mut n = 0;
    // Each `":` (a key's end): found by its colon and the quote before it
    // (a two-byte `memmem` search cost more than the event's reading), the
    // key's opening quote within the longest key's length (or the key is
    // none of them).
    for colon in memchr::memchr_iter(b':', payload) {
        let Some(at) = colon.checked_sub(1).filter(|&q| payload[q] == b'"') else {
            continue;
        };
        let from = at.saturating_sub(LONGEST_KEY + 1);
        let Some(open) = payload[from..at].iter().rposition(|&b| b == b'"') else {
            continue;
        };
        if !TEXT_KEYS.contains(&&payload[from + open + 1..at]) {
            continue;
        }
        n += string_value_len(payload, at + 2);
    }
    n
}

/// The length, as written, of the string value after a key's `":` (`from`
/// is just past it); 0 when the value is not a string.
fn string_value_len(payload: &[u8], from: usize) -> u64 {
    let mut i = from;
    while payload.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    if payload.get(i) != Some(&b'"') {
        return 0;
    }
    let start = i + 1;
    let mut end = start;
    while end < payload.len() {
        match payload[end] {
            b'\\' => end += 2,
            b'"' => break,
            _ => end += 1,
        }
    }
    (end.min(payload.len()) - start) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(ct: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert(http::header::CONTENT_TYPE, ct.parse().unwrap());
        h
    }

    /// The count as it was first written (every `":` found by `memmem`,
    /// the key's quote by `memrchr`): the oracle of the colon-first
    /// reading of keys (the value is read the same way by both).
    fn text_bytes_by_memmem(payload: &[u8]) -> u64 {
        if repeats_text(payload) {
            return 0;
        }
        let mut n = 0;
        for at in memchr::memmem::find_iter(payload, b"\":") {
            let Some(open) = memchr::memrchr(b'"', &payload[..at]) else {
                continue;
            };
            if !TEXT_KEYS.contains(&&payload[open + 1..at]) {
                continue;
            }
            n += string_value_len(payload, at + 2);
        }
        n
    }

    #[test]
    fn the_longest_key_is_read_at_the_start_and_a_longer_one_never() {
        for (payload, n) in [
            (r#""reasoning_content":"ab""#, 2),
            (r#"x"reasoning_content":"ab""#, 2),
            (r#"{"reasoning_contentx":"ab"}"#, 0),
            (r#"{"xreasoning_content":"ab"}"#, 0),
            (r#"{"text": "a\"b"}"#, 4),
        ] {
            assert_eq!(text_bytes(payload.as_bytes()), n, "{payload}");
            assert_eq!(text_bytes_by_memmem(payload.as_bytes()), n, "{payload}");
        }
    }

    proptest::proptest! {
        #[test]
        fn text_bytes_found_by_colon_as_by_memmem(
            parts in proptest::collection::vec(
                proptest::sample::select(vec![
                    "\"", ":", "\\", " ", "content", "delta", "text", "x", "{", "}",
                    ",", "\":", "\"content\":\"", "\"type\":\"response.", "done",
                    "reasoning_content", "_", "xxxxxxxxxxxxxxxx",
                    "\"reasoning_content\":\"ab", "\"reasoning_contentx\":\"ab",
                ]),
                0..40,
            )
        ) {
            let payload = parts.concat();
            proptest::prop_assert_eq!(
                text_bytes(payload.as_bytes()),
                text_bytes_by_memmem(payload.as_bytes())
            );
        }
    }

    #[test]
    fn text_streamed_without_usage_is_an_estimate_of_the_completion() {
        let mut o = UsageObserver::for_response(&headers("text/event-stream"));
        let chat = |t: &str| {
            format!(
                "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{t}\"}},\"finish_reason\":null}}]}}\n\n"
            )
        };
        for _ in 0..10 {
            o.observe(&Bytes::from(chat("four")));
        }
        o.observe(&Bytes::from(
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"function\":{\"arguments\": \"{\\\"q\\\":1}\"}}]}}]}\n\n",
        ));
        let u = o.finish();
        assert_eq!(u.completion, 0);
        // 40 bytes of content, 9 of arguments (escapes as written); the
        // ids and the model's name are not text.
        assert_eq!(u.text_bytes, 49);
        assert_eq!(u.completion_charged(false), 12);
        assert_eq!(
            u.completion_charged(true),
            12,
            "a whole stream that never said"
        );
        // Anthropic and Responses deltas.
        let mut o = UsageObserver::for_response(&headers("text/event-stream"));
        o.observe(&Bytes::from_static(
            b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"12345678\"}}\n\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"abcd\"}\n\n",
        ));
        assert_eq!(o.finish().text_bytes, 12);
        // A usage said wins for a response that ended whole; one cut short
        // pays at least its text (Anthropic's `message_start` says 1).
        let said = Usage {
            completion: 7,
            text_bytes: 4000,
            ..Usage::default()
        };
        assert_eq!(said.completion_charged(true), 7);
        assert_eq!(said.completion_charged(false), 1000);
        // Chat with include_usage: `"usage":null` on every chunk but the
        // last; their text is counted.
        let mut o = UsageObserver::for_response(&headers("text/event-stream"));
        o.observe(&Bytes::from_static(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"abcdefgh\"}}],\"usage\":null}\n\n",
        ));
        assert_eq!(o.finish().text_bytes, 8);
        // Responses `.done` events repeat the deltas' text: not counted.
        let mut o = UsageObserver::for_response(&headers("text/event-stream"));
        o.observe(&Bytes::from_static(
            b"data: {\"type\":\"response.output_text.delta\",\"delta\":\"abcd\"}\n\ndata: {\"type\":\"response.output_text.done\",\"text\":\"abcd\"}\n\ndata: {\"type\":\"response.output_item.done\",\"item\":{\"type\":\"message\",\"content\":[{\"type\":\"output_text\",\"text\":\"abcd\"}]}}\n\n",
        ));
        assert_eq!(o.finish().text_bytes, 4);
    }

    #[test]
    fn json_usage_across_chunks() {
        let mut o = UsageObserver::for_response(&headers("application/json"));
        let body =
            br#"{"id":"x","usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17}}"#;
        for c in body.chunks(7) {
            o.observe(&Bytes::copy_from_slice(c));
        }
        assert_eq!(
            o.finish(),
            Usage {
                prompt: 12,
                completion: 5,
                ..Usage::default()
            }
        );
    }

    #[test]
    fn sse_usage_in_final_chunk_split_anywhere() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
                      data: {\"choices\":[],\"usage\": {\"prompt_tokens\":9,\"completion_tokens\":3}}\n\n\
                      data: [DONE]\n\n";
        for piece in [1, 5, 13, 4096] {
            let mut o = UsageObserver::for_response(&headers("text/event-stream; charset=utf-8"));
            for c in stream.as_bytes().chunks(piece) {
                o.observe(&Bytes::copy_from_slice(c));
            }
            assert_eq!(
                o.finish(),
                Usage {
                    prompt: 9,
                    completion: 3,
                    // "hi", in the chunk with `"usage":null`.
                    text_bytes: 2,
                    ..Usage::default()
                },
                "piece {piece}"
            );
        }
    }

    #[test]
    fn anthropic_and_responses_streams() {
        let anthropic = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
                         event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n";
        let mut o = UsageObserver::for_response(&headers("text/event-stream"));
        o.observe(&Bytes::from(anthropic));
        assert_eq!(
            o.finish(),
            Usage {
                prompt: 25,
                completion: 15,
                ..Usage::default()
            }
        );

        let responses = "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":7,\"output_tokens\":2}}}\n\n";
        let mut o = UsageObserver::for_response(&headers("text/event-stream"));
        o.observe(&Bytes::from(responses));
        assert_eq!(
            o.finish(),
            Usage {
                prompt: 7,
                completion: 2,
                ..Usage::default()
            }
        );
    }

    #[test]
    fn prompt_cache_figures_in_every_shape() {
        let chat = br#"{"usage":{"prompt_tokens":2006,"completion_tokens":300,"prompt_tokens_details":{"cached_tokens":1920,"audio_tokens":0}}}"#;
        let mut o = UsageObserver::for_response(&headers("application/json"));
        o.observe(&Bytes::from_static(chat));
        let u = o.finish();
        assert_eq!((u.prompt, u.cached_read, u.cache_write), (2006, 1920, 0));

        let responses = "data: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":900,\"input_tokens_details\":{\"cached_tokens\":768},\"output_tokens\":4}}}\n\n";
        let mut o = UsageObserver::for_response(&headers("text/event-stream"));
        o.observe(&Bytes::from(responses));
        assert_eq!(o.finish().cached_read, 768);

        let anthropic = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":12,\"cache_creation_input_tokens\":2048,\"cache_read_input_tokens\":4096,\"output_tokens\":1}}}\n\n\
                         event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":40}}\n\n";
        for piece in [3, 4096] {
            let mut o = UsageObserver::for_response(&headers("text/event-stream"));
            for c in anthropic.as_bytes().chunks(piece) {
                o.observe(&Bytes::copy_from_slice(c));
            }
            let u = o.finish();
            assert_eq!(
                (u.prompt, u.completion, u.cached_read, u.cache_write),
                (12, 40, 4096, 2048),
                "piece {piece}"
            );
        }
        let json = br#"{"type":"message","usage":{"input_tokens":3,"cache_read_input_tokens":100,"cache_creation_input_tokens":0,"output_tokens":9}}"#;
        let mut o = UsageObserver::for_response(&headers("application/json"));
        o.observe(&Bytes::from_static(json));
        let u = o.finish();
        assert_eq!((u.cached_read, u.cache_write), (100, 0));
        // Both spellings in one object (some gateways send both).
        let both = br#"{"usage":{"prompt_tokens":50,"input_tokens":50,"completion_tokens":2,"output_tokens":2,"prompt_tokens_details":{"cached_tokens":32},"input_tokens_details":{"cached_tokens":32}}}"#;
        let mut o = UsageObserver::for_response(&headers("application/json"));
        o.observe(&Bytes::from_static(both));
        let u = o.finish();
        assert_eq!((u.prompt, u.completion, u.cached_read), (50, 2, 32));
        assert!(u.cache_said);
        // DeepSeek's spelling; and a server that says nothing of a cache.
        let deepseek = br#"{"usage":{"prompt_tokens":500,"completion_tokens":2,"prompt_cache_hit_tokens":448,"prompt_cache_miss_tokens":52}}"#;
        let mut o = UsageObserver::for_response(&headers("application/json"));
        o.observe(&Bytes::from_static(deepseek));
        assert_eq!(o.finish().cached_read, 448);
        let plain = br#"{"usage":{"prompt_tokens":500,"completion_tokens":2}}"#;
        let mut o = UsageObserver::for_response(&headers("application/json"));
        o.observe(&Bytes::from_static(plain));
        assert!(!o.finish().cache_said);
    }

    #[test]
    fn compressed_or_binary_bodies_are_not_read() {
        let mut h = headers("application/json");
        h.insert(http::header::CONTENT_ENCODING, "gzip".parse().unwrap());
        assert!(matches!(
            UsageObserver::for_response(&h),
            UsageObserver::Off
        ));
        assert!(matches!(
            UsageObserver::for_response(&headers("audio/mpeg")),
            UsageObserver::Off
        ));
    }
}

/// Finish reasons kept at most.
const MAX_REASONS: usize = 16;

/// What a response says of itself besides its usage — the model that
/// answered and why it stopped — read for its trace (only when traced).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Said {
    pub model: Option<String>,
    /// Chat `finish_reason`s, Anthropic `stop_reason`, a Responses
    /// response's final `status`.
    pub finish_reasons: Vec<String>,
    /// The response's bytes up to the bound asked for (message contents
    /// exported only with `[telemetry] capture_content`).
    pub content: Option<Vec<u8>>,
}

#[derive(Deserialize, Default)]
struct SaidCarrier {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    choices: Option<Vec<Choice>>,
    #[serde(default)]
    stop_reason: Option<String>,
    #[serde(default)]
    status: Option<String>,
    /// Anthropic's `message_delta` carries `stop_reason` in it (elsewhere
    /// a delta is text: any value is taken).
    #[serde(default)]
    delta: Option<serde_json::Value>,
    #[serde(default)]
    response: Option<Box<SaidCarrier>>,
    #[serde(default)]
    message: Option<Box<SaidCarrier>>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    finish_reason: Option<String>,
}

impl Said {
    fn merge(&mut self, c: SaidCarrier) {
        if self.model.is_none() {
            self.model = c.model.filter(|m| !m.is_empty());
        }
        let mut reasons: Vec<String> = c
            .choices
            .into_iter()
            .flatten()
            .filter_map(|ch| ch.finish_reason)
            .collect();
        reasons.extend(c.stop_reason);
        reasons.extend(
            c.delta
                .as_ref()
                .and_then(|d| d.get("stop_reason")?.as_str())
                .map(str::to_owned),
        );
        // Only a finished response's status is a reason it stopped.
        reasons.extend(c.status.filter(|s| {
            matches!(
                s.as_str(),
                "completed" | "incomplete" | "failed" | "cancelled"
            )
        }));
        // One per choice; a stream that says more than a response could is
        // cut short.
        for r in reasons {
            if self.finish_reasons.len() < MAX_REASONS {
                self.finish_reasons.push(r);
            }
        }
        for nested in [c.response, c.message].into_iter().flatten() {
            self.merge(*nested);
        }
    }
}

/// Reads a response's [`Said`] as its body passes (a JSON body whole at
/// its end, an event stream line by line), bounded like the usage.
pub struct SaidObserver {
    form: SaidForm,
    said: Said,
    /// Bytes of the response kept as its content (0: none).
    content_max: usize,
}

enum SaidForm {
    Off,
    /// The body's chunks (shared, not copied) and their length.
    Json(Vec<Bytes>, usize),
    Sse(Lines),
}

impl SaidObserver {
    /// By the response's headers, as [`UsageObserver::for_response`];
    /// `content_max`: how much of the body to keep as its content.
    pub fn for_response(headers: &http::HeaderMap, content_max: usize) -> Self {
        let form = match UsageObserver::for_response(headers) {
            UsageObserver::Off => SaidForm::Off,
            UsageObserver::Json { .. } => SaidForm::Json(Vec::new(), 0),
            UsageObserver::Sse { .. } => SaidForm::Sse(Lines::bounded(MAX_LINE)),
        };
        SaidObserver {
            form,
            said: Said::default(),
            content_max,
        }
    }

    pub fn observe(&mut self, data: &Bytes) {
        if self.content_max > 0 {
            let kept = self.said.content.get_or_insert_with(Vec::new);
            let room = self.content_max.saturating_sub(kept.len());
            kept.extend_from_slice(&data[..data.len().min(room)]);
        }
        match &mut self.form {
            SaidForm::Off => {}
            SaidForm::Json(chunks, len) => {
                *len += data.len();
                if *len > MAX_JSON {
                    self.form = SaidForm::Off;
                } else {
                    chunks.push(data.clone());
                }
            }
            SaidForm::Sse(lines) => {
                let said = &mut self.said;
                lines.feed(data, |line| said_line(line, said));
            }
        }
    }

    pub fn finish(mut self) -> Said {
        match std::mem::replace(&mut self.form, SaidForm::Off) {
            SaidForm::Off => {}
            SaidForm::Json(chunks, len) => {
                let parsed = match chunks.as_slice() {
                    [one] => serde_json::from_slice::<SaidCarrier>(one),
                    _ => {
                        serde_json::from_slice::<SaidCarrier>(&chunks.concat()[..len.min(MAX_JSON)])
                    }
                };
                if let Ok(c) = parsed {
                    self.said.merge(c);
                }
            }
            SaidForm::Sse(mut lines) => said_line(&lines.finish(), &mut self.said),
        }
        self.said
    }
}

/// One event's model and stop reasons: read only from the events that can
/// hold them (the first naming a model, one with a non-null `…_reason`, a
/// Responses response's end).
fn said_line(line: &[u8], said: &mut Said) {
    let Some(payload) = sse::data(line) else {
        return;
    };
    let worth = (said.model.is_none() && contains(payload, b"\"model\""))
        || contains(payload, b"_reason\":\"")
        || contains(payload, b"_reason\": \"")
        || contains(payload, b"\"response.completed\"")
        || contains(payload, b"\"response.incomplete\"")
        || contains(payload, b"\"response.failed\"");
    if worth && let Ok(c) = serde_json::from_slice::<SaidCarrier>(payload.trim_ascii()) {
        said.merge(c);
    }
}

#[cfg(test)]
mod said_tests {
    use super::*;

    fn headers(ct: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert(http::header::CONTENT_TYPE, ct.parse().unwrap());
        h
    }

    fn read(ct: &str, chunks: &[&str], content_max: usize) -> Said {
        let mut o = SaidObserver::for_response(&headers(ct), content_max);
        for c in chunks {
            o.observe(&Bytes::copy_from_slice(c.as_bytes()));
        }
        o.finish()
    }

    #[test]
    fn chat_stream_model_and_finish_reason() {
        let said = read(
            "text/event-stream",
            &[
                "data: {\"id\":\"1\",\"model\":\"gpt-4o-2024-08-06\",\"choices\":[{\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n",
                "data: {\"id\":\"1\",\"model\":\"gpt-4o-2024-08-06\",\"choices\":[{\"delta\":{},\"finish_rea",
                "son\":\"stop\"}]}\n\ndata: [DONE]\n\n",
            ],
            0,
        );
        assert_eq!(said.model.as_deref(), Some("gpt-4o-2024-08-06"));
        assert_eq!(said.finish_reasons, ["stop"]);
        assert_eq!(said.content, None);
    }

    #[test]
    fn anthropic_stream_and_responses_stream() {
        let said = read(
            "text/event-stream",
            &[
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"claude-sonnet-4-5\",\"stop_reason\":null}}\n\n",
                "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\"}}\n\n",
            ],
            0,
        );
        assert_eq!(said.model.as_deref(), Some("claude-sonnet-4-5"));
        assert_eq!(said.finish_reasons, ["tool_use"]);
        let said = read(
            "text/event-stream",
            &[
                "data: {\"type\":\"response.created\",\"response\":{\"model\":\"gpt-5\",\"status\":\"in_progress\"}}\n\n",
                "data: {\"type\":\"response.output_text.delta\",\"delta\":\"stop_reason\\\":\\\"x\"}\n\n",
                "data: {\"type\":\"response.completed\",\"response\":{\"model\":\"gpt-5\",\"status\":\"completed\"}}\n\n",
            ],
            0,
        );
        assert_eq!(said.model.as_deref(), Some("gpt-5"));
        assert_eq!(said.finish_reasons, ["completed"]);
    }

    #[test]
    fn whole_json_and_content_bound() {
        let body = "{\"model\":\"m\",\"choices\":[{\"finish_reason\":\"length\"},{\"finish_reason\":\"stop\"}]}";
        let said = read("application/json", &[&body[..20], &body[20..]], 10);
        assert_eq!(said.model.as_deref(), Some("m"));
        assert_eq!(said.finish_reasons, ["length", "stop"]);
        assert_eq!(said.content.as_deref(), Some(&body.as_bytes()[..10]));
        assert_eq!(
            read("application/octet-stream", &[body], 0),
            Said::default()
        );
    }
}
