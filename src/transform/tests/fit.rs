//! Kept images fitted to a model that sees them: scaled and re-encoded in
//! place, every other byte of the request as it was.

use serde_json::{Value, json};

use super::support::*;
use crate::image_fit::codec::test_png;
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
        ..Limits::NONE
    }
}

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
    let mut over = 0;
    for _ in 0..2 {
        for job in scanned.fit_jobs(&bytes, over) {
            let f = fit(&job.bytes, job.size, job.max_base64).unwrap();
            scanned.set_fitted(job.index, f);
        }
        match limits.max_request_bytes {
            Some(max) if scanned.len_with_fitted(bytes.len()) > max => {
                over = scanned.len_with_fitted(bytes.len()) - max + max / 100;
            }
            _ => break,
        }
    }
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
    assert_eq!(sent["messages"][0]["content"][0], body["messages"][0]["content"][0]);
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
    assert!(r.body.is_none(), "nothing to change: the original is forwarded");
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
    let body = json!({"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": blocks}]});
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
    assert_eq!(sent["messages"][0]["content"][1], body["messages"][0]["content"][1]);
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
    assert!(scanned.fit_jobs(&bytes, 0).is_empty());
    assert!(scanned.finish(&bytes, &[]).body.is_none());
    // Given to the fitter anyway, it is refused, not mangled.
    assert!(fit(b"not a png at all, just text", Some((5, 5)), Some(8)).is_err());
}
