//! Fuzzes the transform walk, `visor::transform::rewrite`, over
//! conversations built from the input: the API shape, the rules (as
//! `Rules::new` makes them: ageing, caps, the model's hard limit,
//! copies, prompt cache, line dedup), and messages of every role whose
//! texts repeat lines from a small vocabulary and whose user and tool parts
//! carry images in the shapes visor reads (content parts, data URLs in
//! text, MCP output stringified into tool text, Anthropic tool results),
//! with valid, random and broken base64.
//!
//! Each conversation goes through four plans (`common/transform_checks.rs`):
//! a model that cannot see with no rule (`Plan::images_only`), the rules
//! for a model that can see, line dedup alone for one that can see, and
//! the rules for one that cannot. Invariants (those `src/transform/tests.rs`,
//! `tests_context.rs` and the README state):
//! - the rewrite is valid JSON, and the same twice (deterministic);
//! - run on its own output it changes nothing (idempotent), except for the
//!   image rules of a model that can see (not claimed: an image a later
//!   copy pinned, or one not worth replacing, may go once the copy is
//!   text);
//! - messages are neither added nor removed, roles and ids stay, system,
//!   developer and assistant messages and unknown top-level fields are
//!   untouched, no message is left empty;
//! - a model that cannot see is sent no image (no image part, no base64
//!   data URL, also inside JSON in text);
//! - a model that can see keeps at most its `max_images` (the hard limit);
//! - the report adds up (replaced <= found, bytes_saved).
#![no_main]

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use serde_json::{Value, json};
use visor::transform::dedup::Blocks;
use visor::transform::{Rules, Shape};

#[path = "../common/transform_checks.rs"]
mod transform_checks;
use transform_checks::{check, checks, items_key};

const CHART: &[u8] = include_bytes!("../../tests/fixtures/chart.png");

/// Lines that repeat, so dedup has runs to find.
const LINES: &[&str] = &[
    "[10:00] alice: the retention policy needs a tax branch first",
    "[10:01] bob: section 4 keeps personal data three years",
    "fn step_1(input: &str) -> Result<usize, Error> {",
    "    let parsed = input.trim().parse::<usize>()?; // line 2",
    "}",
    "",
    "ok",
    "```",
    "{\"a\": 1}",
    "[\"0123456789abcdefgh\", \"0123456789abcdefgh\"]",
    "[omitted: message 1 lines 2-11]",
    "[3 omitted]",
    "ünïcödé line, long enough to matter here",
    "  indented repeated line of text",
];

fn pick<'a>(u: &mut Unstructured, from: &[&'a str]) -> Result<&'a str> {
    Ok(from[u.choose_index(from.len())?])
}

/// Free text, short of what would make it an image (`assert_no_images`
/// would count it, the transform rightly not).
fn free(u: &mut Unstructured) -> Result<String> {
    let s: &str = u.arbitrary()?;
    Ok(match s.contains("base64") || s.contains("image") {
        true => String::new(),
        false => s.to_owned(),
    })
}

/// A text of vocabulary lines (blocks sometimes repeated) and free text.
fn text(u: &mut Unstructured) -> Result<String> {
    let mut lines: Vec<String> = Vec::new();
    for _ in 0..u.int_in_range(0..=6)? {
        match u.int_in_range(0..=5)? {
            0 => lines.push(free(u)?),
            1 if !lines.is_empty() => {
                let from = u.choose_index(lines.len())?;
                let block: Vec<String> = lines[from..].to_vec();
                lines.extend(block);
            }
            _ => lines.push(pick(u, LINES)?.to_owned()),
        }
    }
    Ok(lines.join("\n"))
}

/// Base64 that is an image, random bytes, not base64, or empty.
fn b64(u: &mut Unstructured) -> Result<String> {
    Ok(match u.int_in_range(0..=4)? {
        0 => base64_simd::STANDARD.encode_to_string(CHART),
        1 | 2 => {
            let n = u.int_in_range(0..=48)?;
            base64_simd::STANDARD.encode_to_string(u.bytes(n)?)
        }
        3 => free(u)?,
        _ => String::new(),
    })
}

fn media(u: &mut Unstructured) -> Result<&'static str> {
    pick(
        u,
        &[
            "image/png",
            "image/jpeg",
            "image/gif",
            "image/webp",
            "",
            "text/plain",
        ],
    )
}

fn data_url(u: &mut Unstructured) -> Result<String> {
    Ok(format!("data:{};base64,{}", media(u)?, b64(u)?))
}

/// A data URL as text carries one: of an image type.
fn image_data_url(u: &mut Unstructured) -> Result<String> {
    let media = pick(u, &["image/png", "image/jpeg", "image/gif", "image/webp"])?;
    Ok(format!("data:{media};base64,{}", b64(u)?))
}

fn url(u: &mut Unstructured) -> Result<String> {
    Ok(match u.int_in_range(0..=2)? {
        0 => data_url(u)?,
        1 => "https://example.com/i.png".to_owned(),
        _ => format!("https://example.com/{}.png", u.int_in_range(0..=3u8)?),
    })
}

/// One image part in `shape`'s own form, or an MCP-native one.
fn image(u: &mut Unstructured, shape: Shape) -> Result<Value> {
    let mut part = match (shape, u.int_in_range(0..=3)?) {
        (_, 0) => json!({"type": "image", "data": b64(u)?, "mimeType": media(u)?}),
        (Shape::Chat, 1) => json!({"type": "image_url", "image_url": url(u)?}),
        (Shape::Chat, _) => {
            json!({"type": "image_url", "image_url": {"url": url(u)?, "detail": "auto"}})
        }
        (Shape::Responses, 1) => json!({"type": "input_image", "file_id": "file-abc"}),
        (Shape::Responses, _) => json!({"type": "input_image", "image_url": url(u)?}),
        (Shape::Messages, 1) => {
            json!({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}})
        }
        (Shape::Messages, _) => {
            json!({"type": "image", "source": {"type": "base64", "media_type": media(u)?, "data": b64(u)?}})
        }
    };
    if u.ratio(1, 6)? {
        part["cache_control"] = json!({"type": "ephemeral"});
    }
    Ok(part)
}

fn text_part(shape: Shape, t: String) -> Value {
    match shape {
        Shape::Responses => json!({"type": "input_text", "text": t}),
        _ => json!({"type": "text", "text": t}),
    }
}

/// A user or tool text: lines, with a data URL or stringified MCP output
/// (once or twice) in it now and then.
fn rich_text(u: &mut Unstructured) -> Result<String> {
    let t = text(u)?;
    Ok(match u.int_in_range(0..=5)? {
        0 => format!("{t}\n![shot]({}) end", image_data_url(u)?),
        1 => {
            let image = json!({"type": "image", "data": b64(u)?, "mimeType": "image/png"});
            let mcp = json!({"content": [{"type": "text", "text": t}, image], "isError": false});
            if u.arbitrary()? {
                json!({"result": mcp.to_string(), "n": 1}).to_string()
            } else {
                mcp.to_string()
            }
        }
        _ => t,
    })
}

/// User or tool content: a string, or parts with images.
fn content(u: &mut Unstructured, shape: Shape) -> Result<Value> {
    if u.ratio(1, 3)? {
        return Ok(Value::String(rich_text(u)?));
    }
    let mut parts = Vec::new();
    for _ in 0..u.int_in_range(0..=4)? {
        parts.push(match u.int_in_range(0..=2)? {
            0 => image(u, shape)?,
            _ => text_part(shape, rich_text(u)?),
        });
    }
    Ok(Value::Array(parts))
}

/// Only text: system, developer and assistant messages.
fn plain(u: &mut Unstructured, shape: Shape) -> Result<Value> {
    Ok(match u.arbitrary()? {
        true => Value::String(text(u)?),
        false => json!([match shape {
            Shape::Responses => json!({"type": "output_text", "text": text(u)?}),
            _ => json!({"type": "text", "text": text(u)?}),
        }]),
    })
}

fn message(u: &mut Unstructured, shape: Shape, i: usize) -> Result<Value> {
    let id = format!("call_{}", u.int_in_range(0..=3u8)?);
    Ok(match (shape, u.int_in_range(0..=5)?) {
        (Shape::Chat, 0) => json!({"role": "system", "content": plain(u, shape)?}),
        (Shape::Chat, 1) => json!({"role": "assistant", "content": plain(u, shape)?}),
        (Shape::Chat, 2) => json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": id, "type": "function", "function": {"name": "shot", "arguments": "{}"}}]}),
        (Shape::Chat, 3) => {
            let c = match u.int_in_range(0..=3)? {
                0 => image(u, shape)?,
                _ => content(u, shape)?,
            };
            json!({"role": "tool", "tool_call_id": id, "content": c, "x-extra": i})
        }
        (Shape::Chat, _) => json!({"role": "user", "content": content(u, shape)?}),
        (Shape::Responses, 0) => json!({"role": "developer", "content": plain(u, shape)?}),
        (Shape::Responses, 1) => {
            json!({"type": "message", "role": "assistant", "content": plain(u, shape)?})
        }
        (Shape::Responses, 2) => {
            json!({"type": "function_call", "call_id": id, "name": "shot", "arguments": "{}"})
        }
        (Shape::Responses, 3) => {
            json!({"type": "function_call_output", "call_id": id, "output": content(u, shape)?})
        }
        (Shape::Responses, _) => json!({"role": "user", "content": content(u, shape)?}),
        (Shape::Messages, 0 | 1) => json!({"role": "assistant", "content": plain(u, shape)?}),
        (Shape::Messages, 2) => json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": format!("toolu_{i}"), "name": "shot", "input": {}}]}),
        (Shape::Messages, 3) => {
            let mut result = json!({"type": "tool_result", "tool_use_id": format!("toolu_{i}"), "content": content(u, shape)?});
            if u.ratio(1, 4)? {
                result["is_error"] = json!(false);
            }
            json!({"role": "user", "content": [result]})
        }
        (Shape::Messages, _) => json!({"role": "user", "content": content(u, shape)?}),
    })
}

fn run(u: &mut Unstructured) -> Result<()> {
    let shape = match u.int_in_range(0..=2)? {
        0 => Shape::Chat,
        1 => Shape::Responses,
        _ => Shape::Messages,
    };
    let hard = match u.arbitrary()? {
        true => Some(u.int_in_range(1..=6usize)?),
        false => None,
    };
    let max_images = u.int_in_range(1..=6usize)?;
    // As `Rules::new` makes them: the cap is never over the limit.
    let rules = Rules {
        keep_turns: u.int_in_range(0..=3)?,
        max_images: hard.map_or(max_images, |h| max_images.min(h)),
        hard_max_images: hard,
        dedupe: u.arbitrary()?,
        prompt_cache: u.arbitrary()?,
        dedup: match u.ratio(5, 6)? {
            true => Some(Blocks {
                min_lines: u.int_in_range(2..=3)?,
                min_bytes: *u.choose(&[0, 16, 64])?,
            }),
            false => None,
        },
    };
    let mut items = Vec::new();
    for i in 0..u.int_in_range(1..=12)? {
        items.push(message(u, shape, i)?);
    }
    let mut request = json!({"model": "m", "unknown": {"k": [1, "v"]}});
    request[items_key(shape)] = Value::Array(items);
    match shape {
        Shape::Messages => {
            request["max_tokens"] = json!(10);
            if u.arbitrary()? {
                request["system"] = Value::String(text(u)?);
            }
        }
        Shape::Responses if u.ratio(1, 8)? => {
            request["input"] = Value::String(text(u)?);
        }
        _ => {}
    }
    let body = serde_json::to_vec(&request).unwrap_or_default();
    for c in checks(shape, rules) {
        check(&body, &request, shape, &c);
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
