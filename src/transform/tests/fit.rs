//! Kept images fitted to a model that sees them: scaled and re-encoded in
//! place, every other byte of the request as it was.

use serde_json::{Value, json};

use super::support::*;
use crate::image_fit::test_images::test_png;
use crate::image_fit::{Formula, Limits, base64_len, fit};
use crate::transform::*;

fn b64(bytes: &[u8]) -> String {
    base64_simd::STANDARD.encode_type::<String>(bytes)
}

fn anthropic() -> Limits {
    Limits {
        max_bytes: Some(5 * 1024 * 1024),
        max_edge: Some(8000),
        many_images: Some(20),
        many_edge: Some(2000),
        formula: Some(Formula::Anthropic),
        hoist_text: true,
        ..Limits::NONE
    }
}

/// Nothing to fit; base64 in text hoisted.
const HOIST: Limits = Limits {
    hoist_text: true,
    ..Limits::NONE
};

/// The request as the proxy sends it: fitted as the proxy fits (without
/// its cache), then finished.
fn fitted(body: &Value, shape: Shape, limits: Limits) -> (Value, Rewrite) {
    let bytes = serde_json::to_vec(body).unwrap();
    let p = Plan {
        fit: limits,
        ..plan(shape, true, Rules::NONE)
    };
    let mut scanned = match scan(&bytes, &p) {
        Ok(s) => s,
        Err(done) => return (body.clone(), *done),
    };
    fit_here(&mut scanned, &bytes);
    let r = scanned.finish(&bytes, &[]);
    let sent: Value = serde_json::from_slice(r.body.as_deref().unwrap_or(&bytes)).unwrap();
    (sent, r)
}

fn decoded_size(b64_text: &str) -> (u32, u32, usize) {
    let bytes = base64_simd::STANDARD.decode_to_vec(b64_text).unwrap();
    let img = image::load_from_memory(&bytes).unwrap();
    (img.width(), img.height(), bytes.len())
}

#[test]
fn an_anthropic_image_over_the_edge_bound_is_scaled_in_place() {
    let png = test_png(9000, 150, false);
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "What is on this banner?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(&png)},
             "cache_control": {"type": "ephemeral"}}
        ]}
    ]});
    let (sent, r) = fitted(&body, Shape::Messages, anthropic());
    let block = &sent["messages"][0]["content"][1];
    assert_eq!(block["source"]["media_type"], "image/png");
    let (w, h, _) = decoded_size(block["source"]["data"].as_str().unwrap());
    assert_eq!((w, h), (8000, 133));
    // Everything else as it was: the text, the marker, the block's shape.
    assert_eq!(
        sent["messages"][0]["content"][0],
        body["messages"][0]["content"][0]
    );
    assert_eq!(block["cache_control"], json!({"type": "ephemeral"}));
    assert_eq!(block["type"], "image");
    // Reported, and the original saved.
    assert_eq!(r.report.images_resized, 1);
    let note = &r.report.images[0];
    assert_eq!(note.action, "resized");
    assert_eq!(note.width, Some(9000));
    assert_eq!(note.sent.map(|s| (s.width, s.height)), Some((8000, 133)));
    assert_eq!(r.artifacts.len(), 1);
    assert_eq!(r.artifacts[0].bytes.as_ref(), &png[..]);
}

#[test]
fn an_image_within_every_limit_is_not_touched() {
    let png = test_png(640, 480, false);
    let body = json!({"model": "claude-sonnet-4-5", "messages": [
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(&png)}}
        ]}
    ]});
    let (sent, r) = fitted(&body, Shape::Messages, anthropic());
    assert!(
        r.body.is_none(),
        "nothing to change: the original is forwarded"
    );
    assert_eq!(sent, body);
}

#[test]
fn a_chat_data_url_over_the_byte_bound_becomes_a_smaller_jpeg() {
    let png = test_png(800, 800, true);
    let max = 40_000;
    assert!(base64_len(png.len()) > max);
    let url = format!("data:image/png;base64,{}", b64(&png));
    let body = json!({"model": "gpt-4o", "messages": [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url, "detail": "high"}}
        ]}
    ]});
    let limits = Limits {
        max_bytes: Some(max),
        ..Limits::NONE
    };
    let (sent, _) = fitted(&body, Shape::Chat, limits);
    let part = &sent["messages"][0]["content"][0]["image_url"];
    let url = part["url"].as_str().unwrap();
    let data = url.strip_prefix("data:image/jpeg;base64,").expect(url);
    assert!(data.len() as u64 <= max);
    let (w, h, _) = decoded_size(data);
    assert_eq!(w, h, "aspect kept");
    assert_eq!(part["detail"], "high", "the part's other members stay");
}

#[test]
fn many_images_each_get_the_lower_edge_bound() {
    let png = test_png(2400, 100, false);
    let blocks: Vec<Value> = (0..21)
        .map(|_| json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(&png)}}))
        .collect();
    let body =
        json!({"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": blocks}]});
    let (sent, r) = fitted(&body, Shape::Messages, anthropic());
    for b in sent["messages"][0]["content"].as_array().unwrap() {
        let (w, _, _) = decoded_size(b["source"]["data"].as_str().unwrap());
        assert_eq!(w, 2000);
    }
    // One image, one original saved (the same bytes 21 times).
    assert_eq!(r.report.images_resized, 21);
    assert_eq!(r.artifacts.len(), 1);
}

#[test]
fn a_request_over_its_byte_bound_has_its_largest_images_made_smaller() {
    let big = test_png(900, 900, false);
    let small = test_png(100, 100, false);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&big))}},
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&small))}},
        {"type": "text", "text": "compare"}
    ]}]});
    let len = serde_json::to_vec(&body).unwrap().len() as u64;
    let max = len / 2;
    let limits = Limits {
        max_request_bytes: Some(max),
        ..Limits::NONE
    };
    let (sent, r) = fitted(&body, Shape::Chat, limits);
    let out = r.body.as_ref().unwrap();
    assert!((out.len() as u64) <= max, "{} > {max}", out.len());
    // The small one was not the one cut.
    assert_eq!(
        sent["messages"][0]["content"][1],
        body["messages"][0]["content"][1]
    );
}

#[test]
fn what_cannot_be_read_as_an_image_is_left_as_it_came() {
    let body = json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(b"not a png at all, just text"))}}
    ]}]});
    let limits = Limits {
        max_bytes: Some(8),
        max_edge: Some(10),
        ..Limits::NONE
    };
    let bytes = serde_json::to_vec(&body).unwrap();
    let p = Plan {
        fit: limits,
        ..plan(Shape::Chat, true, Rules::NONE)
    };
    let mut scanned = scan(&bytes, &p).unwrap();
    // No size can be read from it: nothing to fit, nothing decoded.
    assert!(scanned.fit_jobs(&bytes, 0, &|_| None).is_empty());
    assert!(scanned.finish(&bytes, &[]).body.is_none());
    // Given to the fitter anyway, it is refused, not mangled.
    assert!(fit(b"not a png at all, just text", Some((5, 5)), Some(8)).is_err());
}

/// The next turn finds its fit by the image's text: nothing decoded, no
/// job, the same bytes sent, the note still naming the original; a
/// different image (one byte of its text changed) is not taken for it.
#[test]
fn a_fit_is_found_again_by_the_image_text_without_decoding_it() {
    let png = test_png(9000, 150, false);
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(&png)}}
        ]}
    ]});
    let bytes = serde_json::to_vec(&body).unwrap();
    let p = Plan {
        fit: anthropic(),
        ..plan(Shape::Messages, true, Rules::NONE)
    };
    // First turn: decoded, fitted, its result kept under the quick key.
    let mut first = scan(&bytes, &p).unwrap();
    let jobs = first.fit_jobs(&bytes, 0, &|_| None);
    assert_eq!(jobs.len(), 1);
    let job = &jobs[0];
    let quick = job.quick.expect("an encoded image has a quick key");
    assert_eq!(job.original.sha256, job.sha256);
    assert_eq!(job.original.dims, Some((9000, 150)));
    let done = fit(&job.bytes, job.size, job.max_base64).unwrap();
    first.set_fitted(job.index, done.clone());
    let sent = first.finish(&bytes, &[]);
    assert_eq!(
        sent.artifacts.len(),
        1,
        "the original is saved the first time"
    );

    // Next turn: found by the key.
    let kept = Quick {
        fitted: Some(done),
        original: job.original.clone(),
    };
    let mut next = scan(&bytes, &p).unwrap();
    let asked = std::cell::Cell::new(0);
    let jobs = next.fit_jobs(&bytes, 0, &|q| {
        asked.set(asked.get() + 1);
        (q == quick).then(|| kept.clone())
    });
    assert!(jobs.is_empty());
    assert_eq!(asked.get(), 1);
    let again = next.finish(&bytes, &[]);
    assert_eq!(again.body, sent.body, "the same bytes as the first turn");
    assert!(
        again.artifacts.is_empty(),
        "nothing decoded, nothing saved again"
    );
    assert_eq!(again.report.images_resized, 1);
    assert_eq!(again.report.images[0].sha256, job.sha256);
    assert_eq!(again.report.images[0].width, Some(9000));

    // Another image's text (one base64 character changed) has another key.
    let mut other = b64(&png);
    let at = other.len() / 2;
    let c = if &other[at..at + 1] == "A" { "B" } else { "A" };
    other.replace_range(at..at + 1, c);
    let body2 = json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": other}}
        ]}
    ]});
    let bytes2 = serde_json::to_vec(&body2).unwrap();
    let mut third = scan(&bytes2, &p).unwrap();
    let jobs = third.fit_jobs(&bytes2, 0, &|q| (q == quick).then(|| kept.clone()));
    assert_eq!(
        jobs.len(),
        1,
        "not found: decoded and fitted as an image of its own"
    );
    assert_ne!(jobs[0].sha256, job.sha256);
    let k1 = quick_key(b64(&png).as_bytes(), job.size, job.max_base64);
    let k2 = quick_key(other.as_bytes(), job.size, job.max_base64);
    assert_ne!(k1, k2);
    // The key is the fit asked too: another size, another key.
    assert_ne!(
        k1,
        quick_key(b64(&png).as_bytes(), Some((100, 2)), job.max_base64)
    );
}

/// A request still over its byte bound once its images are fitted to
/// their own limits gets a second pass (byte budgets on its largest
/// images) — on the turn that fits them, and on the next, which finds the
/// first pass's fits by their text and must still decode what the second
/// pass needs. Both turns send the same bytes, within the bound.
#[test]
fn a_request_over_its_bound_is_brought_within_on_every_turn() {
    let big = test_png(3000, 900, false);
    let small = test_png(100, 100, false);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&big))}},
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&small))}},
        {"type": "text", "text": "compare"}
    ]}]});
    let bytes = serde_json::to_vec(&body).unwrap();
    let plan_for = |max: Option<u64>| Plan {
        fit: Limits {
            max_edge: Some(2000),
            max_request_bytes: max,
            ..Limits::NONE
        },
        ..plan(Shape::Chat, true, Rules::NONE)
    };
    // The length once the big image is fitted to its edge bound.
    let mut dry = scan(&bytes, &plan_for(None)).unwrap();
    fit_here(&mut dry, &bytes);
    let after_first = dry.len_with_fitted(bytes.len());
    let max = after_first * 3 / 4;
    let p = plan_for(Some(max));
    let cache: std::cell::RefCell<std::collections::HashMap<u128, Quick>> = Default::default();
    // As the proxy does it (prepare.rs fit_images), with `cache` for its
    // fitter's quick keys.
    let turn = || {
        let mut s = scan(&bytes, &p).unwrap();
        let pass = |s: &mut Scanned, over: u64| {
            let jobs = s.fit_jobs(&bytes, over, &|q| cache.borrow().get(&q).cloned());
            for job in jobs {
                let done = fit(&job.bytes, job.size, job.max_base64).unwrap();
                if let Some(q) = job.quick {
                    let kept = Quick {
                        fitted: Some(done.clone()),
                        original: job.original.clone(),
                    };
                    cache.borrow_mut().insert(q, kept);
                }
                s.set_fitted(job.index, done);
            }
        };
        pass(&mut s, 0);
        let len = s.len_with_fitted(bytes.len());
        if len > max {
            pass(&mut s, len - max + max / 100);
        }
        s.finish(&bytes, &[]).body.unwrap()
    };
    let first = turn();
    assert!((first.len() as u64) <= max, "{} > {max}", first.len());
    assert!(!cache.borrow().is_empty());
    let second = turn();
    assert!((second.len() as u64) <= max, "{} > {max}", second.len());
    assert_eq!(first, second, "the next turn sends the same bytes");
}

/// No text in `v` (a `text` member, a string content or output) holds the
/// base64 `b64_text`.
fn no_base64_text(v: &Value, b64_text: &str) {
    fn walk(v: &Value, key: &str, needle: &str) {
        match v {
            Value::String(s) if matches!(key, "text" | "content" | "output") => {
                assert!(
                    !s.contains(needle),
                    "base64 left in a text: {}",
                    &s[..s.len().min(200)]
                );
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, key, needle)),
            Value::Object(o) => o.iter().for_each(|(k, x)| walk(x, k, needle)),
            _ => {}
        }
    }
    walk(v, "", &b64_text[..64]);
}

#[test]
fn base64_in_an_anthropic_tool_result_becomes_an_image_block() {
    let png = test_png(64, 48, false);
    let data = b64(&png);
    let mcp =
        json!({"content": [{"type": "image", "data": data, "mimeType": "image/png"}]}).to_string();
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": [
        {"role": "user", "content": "take a screenshot"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": mcp}]}
    ]});
    let (sent, r) = fitted(&body, Shape::Messages, anthropic());
    let result = &sent["messages"][2]["content"][0];
    assert_eq!(result["tool_use_id"], "t1");
    let blocks = result["content"]
        .as_array()
        .expect("the string became blocks");
    assert_eq!(blocks.len(), 2);
    assert_eq!(blocks[0]["type"], "text");
    let text = blocks[0]["text"].as_str().unwrap();
    assert!(text.contains("sent as an image part"), "{text}");
    // The text keeps its structure: still the JSON it was, the image
    // object now a reference.
    let inner: Value = serde_json::from_str(text).unwrap();
    assert_eq!(inner["content"][0]["type"], "text");
    assert_eq!(blocks[1]["type"], "image");
    assert_eq!(blocks[1]["source"]["media_type"], "image/png");
    assert_eq!(blocks[1]["source"]["data"], data.as_str());
    assert_eq!(r.report.images_hoisted, 1);
    assert_eq!(r.report.images[0].action, "hoisted");
    no_base64_text(&sent, &data);
    // Nothing else moved.
    assert_eq!(sent["messages"][0], body["messages"][0]);
    assert_eq!(sent["messages"][1], body["messages"][1]);
}

#[test]
fn base64_in_a_text_block_is_followed_by_its_image_block() {
    let png = test_png(40, 30, false);
    let data = b64(&png);
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": [
            {"type": "text", "text": format!("saved: data:image/png;base64,{data} (ok)")},
            {"type": "text", "text": "done"}
        ]}]}
    ]});
    let (sent, _) = fitted(&body, Shape::Messages, anthropic());
    let blocks = sent["messages"][0]["content"][0]["content"]
        .as_array()
        .unwrap();
    assert_eq!(blocks.len(), 3);
    assert!(
        blocks[0]["text"]
            .as_str()
            .unwrap()
            .starts_with("saved: [image sha256:")
    );
    assert!(blocks[0]["text"].as_str().unwrap().ends_with("] (ok)"));
    assert_eq!(blocks[1]["type"], "image");
    assert_eq!(blocks[2]["text"], "done");
    no_base64_text(&sent, &data);
}

#[test]
fn base64_in_a_responses_function_output_becomes_an_input_image() {
    let png = test_png(32, 32, true);
    let data = b64(&png);
    let out = json!({"type": "image", "data": data, "mimeType": "image/png"}).to_string();
    let body = json!({"model": "gpt-4.1", "input": [
        {"role": "user", "content": "look"},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": out}
    ]});
    let (sent, _) = fitted(&body, Shape::Responses, HOIST);
    let output = sent["input"][2]["output"].as_array().expect("an array now");
    assert_eq!(output[0]["type"], "input_text");
    assert_eq!(output[1]["type"], "input_image");
    let url = output[1]["image_url"].as_str().unwrap();
    assert_eq!(url, format!("data:image/png;base64,{data}"));
    assert_eq!(sent["input"][2]["call_id"], "c1");
    no_base64_text(&sent, &data);
}

#[test]
fn base64_in_a_chat_tool_message_is_replaced_not_sent_as_text() {
    let png = test_png(32, 32, false);
    let data = b64(&png);
    let body = json!({"model": "gpt-4o", "messages": [
        {"role": "user", "content": "look"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": json!({"type": "image", "data": data, "mimeType": "image/png"}).to_string()}
    ]});
    let (sent, r) = fitted(&body, Shape::Chat, HOIST);
    assert_eq!(sent["messages"].as_array().unwrap().len(), 3);
    assert_eq!(sent["messages"][2]["tool_call_id"], "c1");
    let text = serde_json::to_string(&sent["messages"][2]["content"]).unwrap();
    assert!(!text.contains(&data[..64]));
    assert!(text.contains("no image can be sent"), "{text}");
    assert_eq!(r.report.images_replaced, 1);
    assert_eq!(r.artifacts.len(), 1, "the original is saved");
}

#[test]
fn a_hoisted_image_is_fitted_too() {
    let png = test_png(3000, 200, false);
    let data = b64(&png);
    let mcp = json!({"type": "image", "data": data, "mimeType": "image/png"}).to_string();
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": mcp}]}
    ]});
    let limits = Limits {
        max_edge: Some(1000),
        ..anthropic()
    };
    let (sent, _) = fitted(&body, Shape::Messages, limits);
    let img = &sent["messages"][0]["content"][0]["content"][1];
    let (w, h, _) = decoded_size(img["source"]["data"].as_str().unwrap());
    assert_eq!((w, h), (1000, 66));
}

#[test]
fn only_where_the_api_takes_an_image_is_one_put() {
    let png = test_png(32, 32, false);
    let data = b64(&png);
    let url = format!("data:image/png;base64,{data}");
    // A Responses item whose output is a string only.
    let body = json!({"model": "gpt-4.1", "input": [
        {"type": "local_shell_call_output", "call_id": "s1", "output": format!("wrote {url}")}
    ]});
    let (sent, _) = fitted(&body, Shape::Responses, HOIST);
    assert!(
        sent["input"][0]["output"].is_string(),
        "{}",
        sent["input"][0]["output"]
    );
    no_base64_text(&sent, &data);
    // A content that is one part, not an array: nothing can go beside it.
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 5, "messages": [
        {"role": "user", "content": {"type": "text", "text": format!("see {url}")}}
    ]});
    let (sent, r) = fitted(&body, Shape::Messages, HOIST);
    assert!(r.body.is_some());
    assert!(sent["messages"][0]["content"].is_object());
    no_base64_text(&sent, &data);
    // A search result's content takes text blocks only.
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "search_result", "source": "s", "title": "t",
            "content": [{"type": "text", "text": format!("logo {url}")}]}]}
    ]});
    let (sent, _) = fitted(&body, Shape::Messages, HOIST);
    let blocks = sent["messages"][0]["content"][0]["content"]
        .as_array()
        .unwrap();
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0]["type"], "text");
    no_base64_text(&sent, &data);
}

#[test]
fn an_image_replaced_as_text_is_no_image_for_dedupe_or_the_cap() {
    let png = test_png(32, 32, false);
    let data = b64(&png);
    let body = json!({"model": "gpt-4o", "messages": [
        {"role": "user", "content": "look"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": json!({"type": "image", "data": data, "mimeType": "image/png"}).to_string()},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{data}")}}]}
    ]});
    let p = Plan {
        fit: HOIST,
        ..plan(Shape::Chat, true, DEFAULTS)
    };
    let bytes = serde_json::to_vec(&body).unwrap();
    let r = rewrite(&bytes, &p);
    let sent: Value = serde_json::from_slice(r.body.as_deref().unwrap()).unwrap();
    // The user's copy is the image the model sees, not a reference to
    // the text one.
    assert_eq!(sent["messages"][3], body["messages"][3]);
    no_base64_text(&sent, &data);
}
