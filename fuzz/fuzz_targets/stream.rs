//! Fuzzes what visor reads from a response as it passes: token usage
//! (`visor::api::usage::UsageObserver`, SSE and JSON) and a session's
//! assistant reply (`visor::api::StreamedReply`, the pure part of
//! `proxy::session_turn::Recorder`, and `reply_from_json` for a JSON answer),
//! over any response bytes cut into chunks anywhere.
//!
//! Input: byte 0 picks the shape (bits 0-1), SSE or JSON (bit 2) and a
//! `content-encoding` (bit 3); bytes 1-2 seed the chunk sizes (1 to
//! byte 1 + 1 bytes each); the rest is the response body.
//!
//! Invariants (the inputs are far below the observers' 1 MB line and 4 MB
//! body limits):
//! - the usage and the reply do not depend on where the chunks are cut (one
//!   chunk, or the split the input chose);
//! - SSE usage only grows: a prefix of the stream that ends at a line end
//!   never gives a larger figure than the whole, and a stream reply that is
//!   complete after a prefix stays complete;
//! - a reply is empty until the stream completed; a Chat or Messages reply
//!   is one assistant message, Chat with content or tool calls, Messages
//!   with a non-empty content array; a Responses reply is its output items.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use visor::api::usage::{Usage, UsageObserver};
use visor::api::{StreamedReply, reply_from_json};
use visor::api::Shape;

/// The chunk sizes: a small xorshift from the seed, each 1..=max.
fn chunks(body: &[u8], seed: u16, max: usize) -> Vec<&[u8]> {
    let mut state = u32::from(seed) | 0x9E37_0000;
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        let n = (state as usize % max + 1).min(rest.len());
        out.push(&rest[..n]);
        rest = &rest[n..];
    }
    out
}

fn usage(headers: &http::HeaderMap, parts: &[&[u8]]) -> Usage {
    let mut o = UsageObserver::for_response(headers);
    for p in parts {
        o.observe(&Bytes::copy_from_slice(p));
    }
    o.finish()
}

fn streamed(shape: Shape, parts: &[&[u8]]) -> StreamedReply {
    let mut r = StreamedReply::new(shape);
    for p in parts {
        r.observe(p);
    }
    r
}

fn le(a: &Usage, b: &Usage) -> bool {
    a.prompt <= b.prompt
        && a.completion <= b.completion
        && a.cached_read <= b.cached_read
        && a.cache_write <= b.cache_write
}

fn check_reply(shape: Shape, reply: &[Value]) {
    match shape {
        Shape::Chat | Shape::Messages => {
            assert!(reply.len() <= 1, "{reply:?}");
            if let Some(m) = reply.first() {
                assert_eq!(m["role"], "assistant", "{m}");
                if shape == Shape::Chat {
                    assert!(m.get("content").is_some() || m.get("tool_calls").is_some());
                } else {
                    assert!(m["content"].as_array().is_some_and(|c| !c.is_empty()));
                }
            }
        }
        Shape::Responses => {}
    }
    // What the store keeps: each item serialises.
    for r in reply {
        assert!(serde_json::to_vec(r).is_ok());
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let (flags, max, seed) = (data[0], usize::from(data[1]) + 1, u16::from(data[2]));
    let body = &data[3..];
    let shape = match flags & 3 {
        1 => Shape::Responses,
        2 => Shape::Messages,
        _ => Shape::Chat,
    };
    let sse = flags & 4 == 0;
    let mut headers = http::HeaderMap::new();
    let ct = if sse {
        "text/event-stream; charset=utf-8"
    } else {
        "application/json"
    };
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(ct),
    );
    if flags & 8 != 0 {
        headers.insert(
            http::header::CONTENT_ENCODING,
            http::HeaderValue::from_static("gzip"),
        );
    }
    let split = chunks(body, seed, max);
    let whole: Vec<&[u8]> = if body.is_empty() { vec![] } else { vec![body] };

    // Usage: the same however the body is cut.
    let u_split = usage(&headers, &split);
    let u_whole = usage(&headers, &whole);
    assert_eq!(u_split, u_whole, "usage depends on the chunk split");
    if flags & 8 != 0 {
        assert_eq!(u_whole, Usage::default(), "an encoded body is not read");
    }

    if sse {
        // Usage only grows: a prefix ending at a line end.
        if let Some(nl) = body
            .iter()
            .take(body.len() / 2 + 1)
            .rposition(|&b| b == b'\n')
        {
            let prefix = &body[..=nl];
            let u_prefix = usage(&headers, &[prefix]);
            assert!(le(&u_prefix, &u_whole), "{u_prefix:?} > {u_whole:?}");
            let r_prefix = streamed(shape, &[prefix]);
            let r_whole = streamed(shape, &[body]);
            assert!(!r_prefix.complete || r_whole.complete);
        }
        // The session reply: the same however the stream is cut.
        let a = streamed(shape, &split);
        let b = streamed(shape, &whole);
        assert_eq!(a.complete, b.complete);
        let (ra, rb) = (a.reply(), b.reply());
        assert_eq!(ra, rb, "reply depends on the chunk split");
        if !a.complete {
            assert!(ra.is_empty(), "a reply before the stream completed");
        }
        check_reply(shape, &ra);
    } else {
        let reply = reply_from_json(shape, body);
        check_reply(shape, &reply);
        // The recorder joins the chunks before reading them.
        assert_eq!(reply, reply_from_json(shape, &split.concat()));
    }
});
