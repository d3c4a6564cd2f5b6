//! Images for models that see, through the real proxy: images over the
//! provider's documented limits (the built-in table's Claude row) arrive
//! within them, originals saved; base64 written in a tool result arrives
//! as an image block, or as text that is not base64 where the API takes
//! no image; a decompression bomb is refused by the decoder and the
//! request still answered.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use image::ImageEncoder;
use serde_json::{Value, json};
use sha2::Digest;
use support::*;

/// Anthropic's documented limits (the built-in table's Claude row).
const MAX_IMAGE_BASE64: usize = 5_242_880;
const MAX_EDGE: u32 = 8000;

fn b64(bytes: &[u8]) -> String {
    base64_simd::STANDARD.encode_type::<String>(bytes)
}

/// A PNG of `w`×`h`: `noise` for one that barely compresses (a photo's
/// worth of bytes), else smooth bands (a large image in few bytes).
fn png(w: u32, h: u32, noise: bool) -> Vec<u8> {
    png_tinted(w, h, noise, 128)
}

/// [`png`] with its blue channel `tint` (distinct images, alike).
fn png_tinted(w: u32, h: u32, noise: bool, tint: u8) -> Vec<u8> {
    let mut data = Vec::with_capacity((w * h * 3) as usize);
    let mut x: u32 = 0x9e37_79b9 ^ (u32::from(tint) << 16);
    for y in 0..h {
        for i in 0..w {
            if noise {
                for _ in 0..3 {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    data.push(x as u8);
                }
            } else {
                data.extend_from_slice(&[(i / 64) as u8, (y / 64) as u8, tint]);
            }
        }
    }
    let mut out = Vec::new();
    image::codecs::png::PngEncoder::new(&mut out)
        .write_image(&data, w, h, image::ExtendedColorType::Rgb8)
        .unwrap();
    out
}

fn messages_ok() -> Reply {
    Reply::json(
        200,
        r#"{"id":"m1","type":"message","role":"assistant","content":[{"type":"text","text":"ok"}],"model":"claude-sonnet-4-5","stop_reason":"end_turn","usage":{"input_tokens":10,"output_tokens":1}}"#,
    )
}

/// Every Anthropic image block's media type and decoded bytes in `v`.
fn image_blocks(v: &Value) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    fn walk(v: &Value, out: &mut Vec<(String, Vec<u8>)>) {
        match v {
            Value::Object(m) if m.get("type") == Some(&json!("image")) => {
                let src = &m["source"];
                let bytes = base64_simd::STANDARD
                    .decode_to_vec(src["data"].as_str().unwrap())
                    .unwrap();
                out.push((src["media_type"].as_str().unwrap().to_owned(), bytes));
            }
            Value::Object(m) => m.values().for_each(|x| walk(x, out)),
            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    walk(v, &mut out);
    out
}

fn size_of(bytes: &[u8]) -> (u32, u32) {
    let img = image::load_from_memory(bytes).unwrap();
    (img.width(), img.height())
}

async fn send_messages(visor: &Visor, body: &Value) -> (http::StatusCode, Value) {
    let (status, _, _) = send(post_json(
        &visor.url("/v1/messages"),
        serde_json::to_vec(body).unwrap(),
    ))
    .await;
    (status, Value::Null)
}

fn one_image(data: &[u8]) -> Value {
    json!({"model": "claude-sonnet-4-5", "max_tokens": 16, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(data)}}
    ]}]})
}

#[tokio::test]
async fn a_9000x6000_png_arrives_within_the_providers_limits_and_is_saved() {
    let mock = MockUpstream::start(|_| messages_ok()).await;
    // Only the documented limits: not the size Anthropic reads images at.
    let visor = Visor::for_mock(&mock, "[images]\nprovider_size = false\n").await;
    let original = png(9000, 6000, false);
    let body = one_image(&original);
    let (status, _) = send_messages(&visor, &body).await;
    assert_eq!(status, 200);
    let sent: Value = serde_json::from_slice(&mock.recorded().pop().unwrap().body).unwrap();
    let images = image_blocks(&sent);
    assert_eq!(images.len(), 1);
    let (w, h) = size_of(&images[0].1);
    assert!(w <= MAX_EDGE && h <= MAX_EDGE, "{w}x{h}");
    assert_eq!((w, h), (8000, 5333), "scaled with its aspect, no further");
    assert!(b64(&images[0].1).len() <= MAX_IMAGE_BASE64);
    // The text beside it as it was.
    assert_eq!(
        sent["messages"][0]["content"][0],
        body["messages"][0]["content"][0]
    );
    // The original is saved, under the SHA-256 of its bytes.
    let sha = hex(&sha2::Sha256::digest(&original));
    let (status, _, saved) = send(
        Request::get(visor.url(&format!("/visor/artifacts/{sha}")))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(saved.as_ref(), &original[..]);
    // The next turn sends the same bytes (cached, and deterministic).
    send_messages(&visor, &body).await;
    let last = mock.recorded().pop().unwrap().body;
    let again: Value = serde_json::from_slice(&last).unwrap();
    assert_eq!(image_blocks(&again), images);
    let m = visor.metrics().await;
    assert_eq!(
        metric(&m, "visor_images_total", &[("action", "resized")]),
        Some(2.0)
    );
    // What the resizes saved is counted, as the header says it.
    let each = serde_json::to_vec(&body).unwrap().len() - last.len();
    assert_eq!(
        metric(&m, "visor_bytes_saved_total", &[("reason", "images")]),
        Some(2.0 * each as f64)
    );
}

#[tokio::test]
async fn a_6mb_png_arrives_under_5mb_and_a_large_one_at_the_size_the_provider_reads() {
    let mock = MockUpstream::start(|_| messages_ok()).await;
    let visor = Visor::for_mock(&mock, "[images]\nprovider_size = false\n").await;
    let original = png(1500, 1400, true);
    assert!(original.len() > 6_000_000, "{}", original.len());
    let (status, _) = send_messages(&visor, &one_image(&original)).await;
    assert_eq!(status, 200);
    let sent: Value = serde_json::from_slice(&mock.recorded().pop().unwrap().body).unwrap();
    let images = image_blocks(&sent);
    assert!(b64(&images[0].1).len() <= MAX_IMAGE_BASE64);
    let (w, h) = size_of(&images[0].1);
    assert_eq!(w * 14, h * 15, "aspect kept: {w}x{h}");

    // By default, also no larger than Anthropic reads images (1568 px,
    // ~1.15 megapixels): a retina screenshot goes at that size.
    let plain = Visor::for_mock(&mock, "").await;
    send_messages(&plain, &one_image(&png(2880, 1800, false))).await;
    let sent: Value = serde_json::from_slice(&mock.recorded().pop().unwrap().body).unwrap();
    let (w, h) = size_of(&image_blocks(&sent)[0].1);
    assert!(
        w <= 1568 && u64::from(w) * u64::from(h) <= 1_200_000,
        "{w}x{h}"
    );
}

#[tokio::test]
async fn twenty_five_images_each_arrive_within_the_many_images_bound() {
    let mock = MockUpstream::start(|_| messages_ok()).await;
    let visor = Visor::for_mock(
        &mock,
        "[images]\nprovider_size = false\nmax_per_request = 30\n",
    )
    .await;
    // 25 different screenshots (a copy would be sent as a reference).
    let blocks: Vec<Value> = (0..25)
        .map(|i| {
            let shot = b64(&png_tinted(2400, 300, false, i));
            json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": shot}})
        })
        .collect();
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 16,
        "messages": [{"role": "user", "content": blocks}]});
    let (status, _) = send_messages(&visor, &body).await;
    assert_eq!(status, 200);
    let sent: Value = serde_json::from_slice(&mock.recorded().pop().unwrap().body).unwrap();
    let images = image_blocks(&sent);
    assert_eq!(images.len(), 25);
    for (_, bytes) in &images {
        assert_eq!(size_of(bytes), (2000, 250));
    }
}

#[tokio::test]
async fn base64_in_a_tool_result_arrives_as_an_image_block_or_a_description_never_as_text() {
    let mock = MockUpstream::start(|r| match r.uri.path().contains("/messages") {
        true => messages_ok(),
        false => describer_or_chat_ok(r),
    })
    .await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    let shot = png(320, 200, false);
    let data = b64(&shot);
    let mcp =
        json!({"content": [{"type": "image", "data": data, "mimeType": "image/png"}]}).to_string();

    // Anthropic: a tool_result takes image blocks.
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 16, "messages": [
        {"role": "user", "content": "screenshot please"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": mcp}]}
    ]});
    let (status, _) = send_messages(&visor, &body).await;
    assert_eq!(status, 200);
    let sent: Value = serde_json::from_slice(&mock.recorded().pop().unwrap().body).unwrap();
    let result = &sent["messages"][2]["content"][0];
    assert_eq!(result["tool_use_id"], "t1");
    assert_eq!(
        image_blocks(result),
        vec![("image/png".to_owned(), shot.clone())]
    );
    let text = result["content"][0]["text"].as_str().unwrap();
    assert!(
        !text.contains(&data[..64]) && text.contains("sent as an image part"),
        "{text}"
    );

    // Chat: a tool message takes no image: described, not base64.
    let chat = json!({"model": "gpt-4o", "messages": [
        {"role": "user", "content": "screenshot please"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": mcp}
    ]});
    let (status, _, _) = post_chat(&visor, serde_json::to_vec(&chat).unwrap()).await;
    assert_eq!(status, 200);
    let sent = mock
        .recorded()
        .into_iter()
        .rev()
        .find(|r| !is_describer_call(r))
        .unwrap();
    let v: Value = serde_json::from_slice(&sent.body).unwrap();
    assert_eq!(v["messages"].as_array().unwrap().len(), 3);
    assert_eq!(v["messages"][2]["tool_call_id"], "c1");
    let tool = v["messages"][2]["content"].as_str().unwrap();
    assert!(!tool.contains(&data[..64]), "base64 sent as text");
    assert!(tool.contains("described:"), "{tool}");
}

/// The mock as describer (its answer derived from the image) or as the
/// chat upstream.
fn describer_or_chat_ok(r: &Recorded) -> Reply {
    match is_describer_call(r) {
        true => {
            let d = description_for(&described_url(r));
            Reply::json(
                200,
                json!({"id": "d", "object": "chat.completion", "choices": [{"index": 0,
                    "message": {"role": "assistant", "content": d}, "finish_reason": "stop"}]})
                .to_string(),
            )
        }
        false => chat_ok(),
    }
}

#[tokio::test]
async fn a_decompression_bomb_is_refused_by_the_decoder_and_the_request_answered() {
    let mock = MockUpstream::start(|_| messages_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    // A PNG whose header claims 100000×100000 pixels (40 GB decoded).
    let bomb = bomb_png(100_000, 100_000);
    let body = one_image(&bomb);
    let (status, _) = send_messages(&visor, &body).await;
    assert_eq!(status, 200, "answered");
    let sent: Value = serde_json::from_slice(&mock.recorded().pop().unwrap().body).unwrap();
    // Left as it came (the provider says what it says of it).
    assert_eq!(image_blocks(&sent)[0].1, bomb);
}

/// A valid PNG head (signature, IHDR) for `w`×`h` RGBA and one IDAT of a
/// few zero bytes: small on the wire, enormous decoded.
fn bomb_png(w: u32, h: u32) -> Vec<u8> {
    fn chunk(out: &mut Vec<u8>, kind: &[u8], data: &[u8]) {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let mut c = kind.to_vec();
        c.extend_from_slice(data);
        out.extend_from_slice(&c);
        out.extend_from_slice(&crc32(&c).to_be_bytes());
    }
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = w.to_be_bytes().to_vec();
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[8, 6, 0, 0, 0]);
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(&mut out, b"IDAT", &[0x78, 0x9c, 0x63, 0, 0, 0, 1, 0, 1]);
    chunk(&mut out, b"IEND", &[]);
    out
}

/// The PNG chunk checksum (zlib's CRC-32).
fn crc32(data: &[u8]) -> u32 {
    let mut crc = flate2::Crc::new();
    crc.update(data);
    crc.sum()
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// A screenshot agent, turn by turn through the proxy (a vision model
/// behind a prompt cache): every request sends the previous request's
/// messages unchanged, except on the few turns where the due screenshots
/// age out — all of them at once — and those turns come only after the
/// first screenshots have been due for a while.
#[tokio::test]
async fn a_screenshot_agent_ages_its_screenshots_in_few_rewrites_and_keeps_its_prefix_otherwise() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let mut messages =
        vec![json!({"role": "user", "content": "Find the cheapest flight to Lisbon."})];
    let mut previous: Option<Vec<Value>> = None;
    let mut rewrites = Vec::new();
    for turn in 0..40u8 {
        messages.push(json!({"role": "assistant", "content": "Looking.",
            "tool_calls": [{"id": format!("c{turn}"), "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}]}));
        let shot = b64(&png_tinted(64, 48, false, turn));
        messages.push(json!({"role": "tool", "tool_call_id": format!("c{turn}"), "content": [
            {"type": "text", "text": format!("Screenshot {turn} of the booking page, after the agent's click on the search results.")},
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{shot}")}}
        ]}));
        let body = json!({"model": "gpt-4o", "messages": messages});
        let (status, _, _) = post_chat(&visor, serde_json::to_vec(&body).unwrap()).await;
        assert_eq!(status, 200);
        let sent: Value = serde_json::from_slice(&mock.recorded().pop().unwrap().body).unwrap();
        let sent = sent["messages"].as_array().unwrap().clone();
        assert_eq!(sent.len(), messages.len(), "no message added or removed");
        if let Some(prev) = &previous {
            let same = prev.iter().zip(&sent).take_while(|(a, b)| a == b).count();
            if same < prev.len() {
                // A rewrite: more than one screenshot aged in it.
                let aged = |m: &[Value]| {
                    m.iter()
                        .filter(|x| x.to_string().contains("older tool result"))
                        .count()
                };
                assert!(
                    aged(&sent) >= aged(prev) + 2,
                    "turn {turn}: one image at a time"
                );
                rewrites.push(turn);
            }
        }
        previous = Some(sent);
    }
    assert!(!rewrites.is_empty(), "40 screenshots and none aged");
    assert!(rewrites.len() <= 8, "rewrites on turns {rewrites:?}");
    // Not at the first chance (keep_turns = 2): keeping had to cost first.
    assert!(rewrites[0] > 4, "rewrites on turns {rewrites:?}");
}

#[tokio::test]
async fn a_request_over_its_bound_is_brought_within_though_no_image_is_over_its_own() {
    let mock = MockUpstream::start(|_| messages_ok()).await;
    let max = 300_000;
    let visor = Visor::for_mock(
        &mock,
        &format!(
            "[images]\nprovider_size = false\n[[model]]\nmatch = \"claude-*\"\nmax_request_bytes = {max}\n"
        ),
    )
    .await;
    let blocks: Vec<Value> = (0..2)
        .map(|i| {
            let shot = b64(&png_tinted(300, 300, true, i));
            json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": shot}})
        })
        .collect();
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 16,
        "messages": [{"role": "user", "content": blocks}]});
    assert!(serde_json::to_vec(&body).unwrap().len() > 2 * max);
    let (status, _) = send_messages(&visor, &body).await;
    assert_eq!(status, 200);
    let sent = mock.recorded().pop().unwrap().body;
    assert!(
        sent.len() <= max,
        "{} bytes sent, the bound is {max}",
        sent.len()
    );
    let v: Value = serde_json::from_slice(&sent).unwrap();
    assert_eq!(image_blocks(&v).len(), 2, "both images still sent");
}
