//! Images for models that cannot see, through the real proxy: replaced in
//! place in every API shape, saved and served back, learned from upstream
//! refusals (and remembered across a restart).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use serde_json::Value;
use sha2::{Digest, Sha256};
use support::*;

/// These tests are about placeholders: `describe` mode has its own
/// (tests/it/describe.rs).
const STRIP: &str = "[images]\nnon_vision = \"strip\"\n";

fn ok() -> Reply {
    Reply::json(
        200,
        r#"{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}"#,
    )
}

fn sha_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn json(b: &[u8]) -> Value {
    serde_json::from_slice(b).unwrap()
}

fn has_base64_image(b: &[u8]) -> bool {
    let s = String::from_utf8_lossy(b);
    s.contains(";base64,") || s.contains("iVBORw0KGgo")
}

fn with_header(
    mut req: Request<Full<Bytes>>,
    k: &'static str,
    v: &'static str,
) -> Request<Full<Bytes>> {
    req.headers_mut()
        .insert(k, http::HeaderValue::from_static(v));
    req
}

#[tokio::test]
async fn chat_images_replaced_saved_and_served_back() {
    let mock = MockUpstream::start(|_| ok()).await;
    let visor = Visor::for_mock(&mock, STRIP).await;
    let body = fixture("chat-image-nonvision.json");
    let (status, headers, _) =
        send(post_json(&visor.url("/v1/chat/completions"), body.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "2");
    let saved: i64 = headers["x-visor-bytes-saved"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let rec = mock.recorded().pop().unwrap();
    assert_eq!(saved, body.len() as i64 - rec.body.len() as i64);
    assert!(saved > 500, "{saved}");
    assert_eq!(
        rec.headers["content-length"],
        rec.body.len().to_string().as_str()
    );
    assert!(!has_base64_image(&rec.body));
    let sent = json(&rec.body);
    let parts = sent["messages"][1]["content"].as_array().unwrap();
    assert_eq!(parts.len(), 3, "in place: one text part per image");
    let png = std::fs::read(fixtures().join("chart.png")).unwrap();
    let sha = sha_hex(&png);
    assert!(
        parts[1]["text"]
            .as_str()
            .unwrap()
            .contains(&format!("sha256:{}", &sha[..12]))
    );

    // The original is on disk when the response has come, and served back.
    let (status, headers, got) = send(
        Request::get(visor.url(&format!("/visor/artifacts/{sha}")))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "image/png");
    assert_eq!(got, png);
    let file = visor.data_dir().join("artifacts").join(&sha);
    assert_eq!(std::fs::read(file).unwrap(), png);
    // By the 12 digits the model sees, as it sees them or bare.
    for short in [format!("sha256:{}", &sha[..12]), sha[..12].to_owned()] {
        let (status, _, got) = send(
            Request::get(visor.url(&format!("/visor/artifacts/{short}")))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await;
        assert_eq!((status.as_u16(), got.len()), (200, png.len()), "{short}");
    }

    let m = visor.metrics().await;
    assert_eq!(
        metric(&m, "visor_images_total", &[("action", "stripped")]),
        Some(2.0)
    );
    assert_eq!(
        metric(&m, "visor_bytes_saved_total", &[("reason", "images")]),
        Some(saved as f64)
    );
    assert!(metric(&m, "visor_transform_duration_seconds_count", &[]).unwrap() >= 1.0);
}

#[tokio::test]
async fn artifact_ids_are_checked() {
    let mock = MockUpstream::start(|_| ok()).await;
    let visor = Visor::for_mock(&mock, STRIP).await;
    let get = |p: String| {
        Request::get(visor.url(&p))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let (status, _, body) = send(get(format!("/visor/artifacts/{}", "ab".repeat(32)))).await;
    assert_eq!(status, 404);
    assert_eq!(error_code(&body), "artifact_not_found");
    // Two saved images that the model's 12 digits do not tell apart.
    let dir = visor.data_dir().join("artifacts");
    std::fs::create_dir_all(&dir).unwrap();
    for last in ["1", "2"] {
        std::fs::write(dir.join(format!("{}{last}", "c".repeat(63))), b"x").unwrap();
    }
    let (status, _, body) = send(get(format!("/visor/artifacts/{}", "c".repeat(12)))).await;
    assert_eq!(status, 409);
    assert_eq!(error_code(&body), "artifact_ambiguous");
    let (status, _, body) = send(get(format!("/visor/artifacts/{}", "d".repeat(12)))).await;
    assert_eq!(
        (status.as_u16(), error_code(&body).as_str()),
        (404, "artifact_not_found")
    );
    for bad in [
        "nothex",
        "ABCDEF",
        "%2e%2e%2fetc%2fpasswd",
        "..%2f..%2fCargo.toml",
    ] {
        let (status, _, body) = send(get(format!("/visor/artifacts/{bad}"))).await;
        assert_eq!(status, 400, "{bad}");
        assert!(error_code(&body).starts_with("invalid"), "{bad}");
    }
    assert_eq!(mock.count(), 0);
}

#[tokio::test]
async fn artifacts_need_the_proxy_key_when_keys_are_set() {
    let mock = MockUpstream::start(|_| ok()).await;
    let visor = Visor::for_mock(&mock, &format!("{STRIP}[server]\napi_keys = [\"vk-1\"]\n")).await;
    let url = visor.url(&format!("/visor/artifacts/{}", "0".repeat(64)));
    let (status, _, _) = send(Request::get(&url).body(Full::new(Bytes::new())).unwrap()).await;
    assert_eq!(status, 401);
    let req = Request::get(&url)
        .header("authorization", "Bearer vk-1")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(send(req).await.0, 404);
}

#[tokio::test]
async fn responses_and_anthropic_shapes() {
    let mock = MockUpstream::start(|_| ok()).await;
    let visor = Visor::start(&format!(
        "{STRIP}[[upstream]]\nname = \"anthropic\"\nbase_url = \"{0}/v1\"\nmodels = [\"glm-*\", \"claude-*\"]\napi_key = \"sk-ant\"\nauth = \"x-api-key\"\n\
         [[upstream]]\nname = \"rest\"\nbase_url = \"{0}/v1\"\nmodels = [\"*\"]\n",
        mock.url()
    ))
    .await;

    let body = fixture("responses-input-image.json");
    let (status, headers, _) = send(post_json(&visor.url("/v1/responses"), body)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "1");
    let rec = mock.recorded().pop().unwrap();
    assert!(!has_base64_image(&rec.body));
    assert_eq!(
        json(&rec.body)["input"][0]["content"][1]["type"],
        "input_text"
    );

    let body = fixture("anthropic-messages-image.json");
    let (status, headers, _) = send(post_json(&visor.url("/v1/messages"), body.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "2");
    let rec = mock.recorded().pop().unwrap();
    assert_eq!(rec.headers["x-api-key"], "sk-ant");
    assert!(rec.headers.get("authorization").is_none());
    assert!(!has_base64_image(&rec.body));
    let sent = json(&rec.body);
    let orig = json(&body);
    assert_eq!(sent["messages"].as_array().unwrap().len(), 3);
    assert_eq!(sent["messages"][2]["content"][0]["tool_use_id"], "toolu_01");
    assert_eq!(sent["messages"][1], orig["messages"][1]);

    // A vision model on the same route: nothing changed but visor's cache
    // breakpoints (an Anthropic-kind upstream, a request without markers:
    // tests/it/prompt_cache.rs); with them left out, byte for byte.
    let mut v = orig.clone();
    v["model"] = "claude-3-5-sonnet-20240620".into();
    let body = Bytes::from(serde_json::to_vec(&v).unwrap());
    let (_, headers, _) = send(post_json(&visor.url("/v1/messages"), body.clone())).await;
    assert_eq!(headers["x-visor-images-replaced"], "0");
    let sent = mock.recorded().pop().unwrap().body;
    assert!(String::from_utf8_lossy(&sent).contains("cache_control"));
    let unmarked = |v: &Value| {
        let b = crate::support::anthropic_cache::blocks(v);
        b.into_iter().map(|(b, _)| b).collect::<Vec<_>>()
    };
    assert_eq!(unmarked(&json(&sent)), unmarked(&v));
    assert_eq!(json(&sent)["model"], v["model"]);
    let req = Request::post(visor.url("/v1/messages"))
        .header("content-type", "application/json")
        .header("x-visor-transform", "off")
        .body(Full::new(body.clone()))
        .unwrap();
    send(req).await;
    assert_eq!(mock.recorded().pop().unwrap().body, body);
}

#[tokio::test]
async fn tool_images_and_headers_that_steer() {
    let mock = MockUpstream::start(|_| ok()).await;
    let visor = Visor::for_mock(
        &mock,
        &format!("{STRIP}[[model]]\nmatch = \"house-*\"\nvision = false\n"),
    )
    .await;
    let url = visor.url("/v1/chat/completions");

    // MCP and image_url parts in tool results: pairing kept, strings out.
    let body = fixture("chat-tool-mcp-image.json");
    let (_, headers, _) = send(post_json(&url, body.clone())).await;
    assert_eq!(headers["x-visor-images-replaced"], "2");
    let sent = json(&mock.recorded().pop().unwrap().body);
    for (i, id) in [(2, "call_shot_1"), (4, "call_shot_2")] {
        assert_eq!(sent["messages"][i]["tool_call_id"], id);
        assert!(
            sent["messages"][i]["content"]
                .as_str()
                .unwrap()
                .contains("sha256:")
        );
    }

    // x-visor-transform: off → as sent, even for a text-only model.
    let req = with_header(post_json(&url, body.clone()), "x-visor-transform", "off");
    let (_, headers, _) = send(req).await;
    assert_eq!(headers["x-visor-images-replaced"], "0");
    assert_eq!(mock.recorded().pop().unwrap().body, body);

    // x-visor-vision overrides the table both ways.
    let vision_body = fixture("chat-image-vision-stream.json");
    let req = with_header(
        post_json(&url, vision_body.clone()),
        "x-visor-vision",
        "false",
    );
    let (_, headers, _) = send(req).await;
    assert_eq!(headers["x-visor-images-replaced"], "1");
    let req = with_header(post_json(&url, body.clone()), "x-visor-vision", "true");
    send(req).await;
    assert_eq!(mock.recorded().pop().unwrap().body, body);
    for (name, value) in [
        ("x-visor-vision", "maybe"),
        ("x-visor-transform", "sometimes"),
    ] {
        let req = with_header(post_json(&url, body.clone()), name, value);
        let (status, _, err) = send(req).await;
        assert_eq!(status, 400, "{name}: {value}");
        assert_eq!(error_code(&err), "invalid_request");
    }

    // A user row decides for a name no built-in row knows.
    let mut v = json(&fixture("chat-image-vision-stream.json"));
    v["model"] = "openrouter/acme/house-7b-2025-01-01".into();
    let (_, headers, _) = send(post_json(&url, serde_json::to_vec(&v).unwrap())).await;
    assert_eq!(headers["x-visor-images-replaced"], "1");

    // A vision model with images: byte for byte, counts 0.
    let (_, headers, _) = send(post_json(&url, vision_body.clone())).await;
    assert_eq!(headers["x-visor-images-replaced"], "0");
    assert_eq!(headers["x-visor-bytes-saved"], "0");
    assert_eq!(mock.recorded().pop().unwrap().body, vision_body);
}

/// The mock refuses images for `mystery-*` models with OpenAI's wording.
fn refusing(req: &Recorded) -> Reply {
    let body = String::from_utf8_lossy(&req.body);
    if body.contains("\"mystery-") && body.contains("image_url") {
        return Reply::json(
            400,
            r#"{"error":{"message":"Invalid content type. image_url is only supported by certain models.","type":"invalid_request_error","param":"messages.[1].content.[1].type","code":null}}"#,
        );
    }
    if body.contains("\"denied-") {
        return Reply::json(
            403,
            r#"{"error":{"message":"this key does not support image input for this project"}}"#,
        );
    }
    if body.contains("\"other-") {
        return Reply::json(
            400,
            r#"{"error":{"message":"max_tokens is too large","type":"invalid_request_error"}}"#,
        );
    }
    ok()
}

fn with_model(name: &str, fixture_name: &str) -> Bytes {
    let mut v = json(&fixture(fixture_name));
    v["model"] = name.into();
    Bytes::from(serde_json::to_vec(&v).unwrap())
}

#[tokio::test]
async fn learns_from_a_refusal_retries_once_and_remembers_across_a_restart() {
    let mock = MockUpstream::start(refusing).await;
    let data_dir = temp_dir("learn");
    let extra = format!("{STRIP}[server]\ndata_dir = \"{}\"\n", data_dir.display());
    let mut visor = Visor::for_mock(&mock, &extra).await;
    let url = visor.url("/v1/chat/completions");
    let body = with_model("mystery-9b", "chat-image-nonvision.json");

    let (status, headers, resp) = send(post_json(&url, body.clone())).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
    assert_eq!(headers["x-visor-images-replaced"], "2");
    let recs = mock.recorded();
    assert_eq!(recs.len(), 2, "one refusal, one retry");
    assert_eq!(recs[0].body, body);
    assert!(!has_base64_image(&recs[1].body));
    let m = visor.metrics().await;
    assert_eq!(metric(&m, "visor_capability_learned_total", &[]), Some(1.0));
    assert_eq!(
        metric(
            &m,
            "visor_requests_total",
            &[("model", "mystery-9b"), ("status", "200")]
        ),
        Some(1.0)
    );

    // Known now: replaced up front, one upstream call.
    let (status, _, _) = send(post_json(&url, body.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(mock.count(), 3);

    // A 400 about something else passes through unchanged, without a retry.
    let other = with_model("other-1b", "chat-image-nonvision.json");
    let (status, headers, resp) = send(post_json(&url, other)).await;
    assert_eq!(status, 400);
    assert_eq!(json(&resp)["error"]["message"], "max_tokens is too large");
    assert_eq!(headers["x-visor-images-replaced"], "0");
    assert_eq!(mock.count(), 4);

    // An auth answer is never taken for a refusal, whatever it says.
    let denied = with_model("denied-1b", "chat-image-nonvision.json");
    let (status, _, _) = send(post_json(&url, denied)).await;
    assert_eq!(status, 403);
    let before_known = mock.count();
    assert_eq!(before_known, 5);

    // A model whose vision is stated (here by the header) is never
    // retried: the refusal passes through.
    let header_known = with_header(
        post_json(
            &url,
            with_model("mystery-known", "chat-image-nonvision.json"),
        ),
        "x-visor-vision",
        "true",
    );
    let (status, _, _) = send(header_known).await;
    assert_eq!(status, 400);
    assert_eq!(mock.count(), 6);

    // The learned row survives a restart on the same data dir (it is in
    // the disk store, which the first visor must let go of).
    visor.shutdown();
    let _ = visor.task.take().unwrap().await;
    drop(visor);
    let visor = Visor::for_mock(&mock, &extra).await;
    assert_eq!(visor.state.store.problem(), None);
    assert!(
        visor
            .state
            .rewrite
            .models
            .learned
            .names()
            .contains(&"mystery-9b".to_owned())
    );
    let (status, headers, _) = send(post_json(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "2");
    assert_eq!(mock.count(), 7, "no second refusal after the restart");
    assert!(data_dir.join("store.redb").is_file());
    let _ = std::fs::remove_dir_all(data_dir);
}

#[tokio::test]
async fn refusal_phrases_are_configurable() {
    let mock = MockUpstream::start(|req| {
        if String::from_utf8_lossy(&req.body).contains("image_url") {
            Reply::json(
                422,
                r#"{"detail":"Les images ne sont pas prises en charge"}"#,
            )
        } else {
            ok()
        }
    })
    .await;
    let visor = Visor::for_mock(
        &mock,
        "[images]\nnon_vision = \"strip\"\nrefusal_phrases = [\"images ne sont pas prises\"]\n",
    )
    .await;
    let body = with_model("modele-maison", "chat-image-nonvision.json");
    let (status, _, _) = send(post_json(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200);
    assert_eq!(mock.count(), 2);
}

#[tokio::test]
async fn a_large_image_is_replaced_while_others_are_served() {
    // A 6 MB base64 image goes to the blocking pool; a small request on the
    // same visor is answered meanwhile and the big one completes.
    let mock = MockUpstream::start(|_| ok()).await;
    let visor = Visor::for_mock(&mock, STRIP).await;
    let png = std::fs::read(fixtures().join("chart.png")).unwrap();
    let mut big = png.clone();
    while big.len() < 4_500_000 {
        big.extend_from_slice(&png);
    }
    let b64 = base64_simd::STANDARD.encode_to_string(&big);
    let body = format!(
        r#"{{"model":"gpt-oss-120b","messages":[{{"role":"user","content":[{{"type":"text","text":"what is it"}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{b64}"}}}}]}}]}}"#
    );
    let done = Arc::new(AtomicBool::new(false));
    let url = visor.url("/v1/chat/completions");
    let big_req = {
        let (url, done) = (url.clone(), done.clone());
        tokio::spawn(async move {
            let r = send(post_json(&url, body)).await;
            done.store(true, Ordering::SeqCst);
            r
        })
    };
    let (status, _, _) = send(post_json(&url, r#"{"model":"m","messages":[]}"#)).await;
    assert_eq!(status, 200);
    let (status, headers, _) = big_req.await.unwrap();
    assert!(done.load(Ordering::SeqCst));
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "1");
    let sent = mock
        .recorded()
        .into_iter()
        .find(|r| r.body.len() < 10_000 && String::from_utf8_lossy(&r.body).contains("what is it"))
        .expect("the rewritten request reached the upstream");
    assert!(!has_base64_image(&sent.body));
    let sha = sha_hex(&big);
    assert_eq!(
        std::fs::read(visor.data_dir().join("artifacts").join(sha))
            .unwrap()
            .len(),
        big.len()
    );
}

#[tokio::test]
async fn bad_input_through_the_proxy() {
    let mock = MockUpstream::start(|_| ok()).await;
    let visor = Visor::for_mock(
        &mock,
        &format!("{STRIP}[server]\nmax_body_bytes = 50000000\n"),
    )
    .await;
    let url = visor.url("/v1/chat/completions");
    let chat = |content: String| {
        format!(r#"{{"model":"deepseek-chat","messages":[{{"role":"user","content":{content}}}]}}"#)
    };

    // Broken base64, an empty image, an odd part, a string where an array
    // was expected: 200, each image a placeholder saying what was wrong.
    let body = chat(
        r#"[{"type":"image_url","image_url":{"url":"data:image/png;base64,@@@"}},
            {"type":"image_url","image_url":{"url":"data:image/png;base64,"}},
            {"type":"image_url","image_url":[1,2]},
            {"type":"text","text":"still here","x-unknown":{"kept":true}}]"#
            .to_owned(),
    );
    let (status, headers, _) = send(post_json(&url, body)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "3");
    let sent = json(&mock.recorded().pop().unwrap().body);
    let parts = sent["messages"][0]["content"].as_array().unwrap();
    assert!(parts[0]["text"].as_str().unwrap().contains("invalid"));
    assert!(parts[1]["text"].as_str().unwrap().contains("empty"));
    assert!(
        parts[2]["text"]
            .as_str()
            .unwrap()
            .contains("unexpected shape")
    );
    assert_eq!(parts[3]["x-unknown"]["kept"], true);

    let (status, headers, _) = send(post_json(&url, chat("\"just text\"".to_owned()))).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "0");

    // Deeply nested JSON: valid, forwarded as it is.
    let deep = format!(
        r#"{{"model":"deepseek-chat","metadata":{}0{},"messages":[]}}"#,
        "[".repeat(200_000),
        "]".repeat(200_000)
    );
    let (status, _, _) = send(post_json(&url, deep.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(mock.recorded().pop().unwrap().body, deep);

    // A 30 MB image (under a raised body limit): replaced, saved once.
    let png = std::fs::read(fixtures().join("chart.png")).unwrap();
    let mut big = png.clone();
    big.resize(22_500_000, 7);
    let b64 = base64_simd::STANDARD.encode_to_string(&big);
    assert!(b64.len() >= 30_000_000);
    let body = chat(format!(
        r#"[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{b64}"}}}}]"#
    ));
    let (status, headers, _) = send(post_json(&url, body)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "1");
    assert!(mock.recorded().pop().unwrap().body.len() < 1_000);
    let saved = visor.data_dir().join("artifacts").join(sha_hex(&big));
    assert_eq!(std::fs::metadata(saved).unwrap().len(), big.len() as u64);
    // (Bodies over the limit: tests/it/proxy/bad_input.rs, over raw sockets.)
}

#[tokio::test]
async fn an_error_after_the_transform_still_says_what_was_replaced() {
    // Nothing listens on the upstream's port: 502, with the counts.
    let dead = MockUpstream::builder()
        .fault(Fault::RefuseConnect)
        .start()
        .await;
    let visor = Visor::for_mock(&dead, STRIP).await;
    let body = fixture("chat-image-nonvision.json");
    let (status, headers, resp) = send(post_json(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 502);
    assert_eq!(error_code(&resp), "upstream_unreachable");
    assert_eq!(headers["x-visor-images-replaced"], "2");
    assert_ne!(headers["x-visor-bytes-saved"], "0");
}

#[tokio::test]
async fn learned_models_of_the_previous_version_move_into_the_store() {
    let mock = MockUpstream::start(|_| ok()).await;
    let data_dir = temp_dir("legacy-learned");
    std::fs::write(
        data_dir.join("learned-models.json"),
        r#"{"non_vision":["house-model"]}"#,
    )
    .unwrap();
    let extra = format!("{STRIP}[server]\ndata_dir = \"{}\"\n", data_dir.display());
    let mut visor = Visor::for_mock(&mock, &extra).await;
    assert_eq!(
        visor.state.rewrite.models.learned.names(),
        vec!["house-model".to_owned()]
    );
    assert_eq!(
        visor.state.store.learned().await.unwrap(),
        vec!["house-model".to_owned()]
    );
    assert!(!data_dir.join("learned-models.json").exists());
    assert!(data_dir.join("learned-models.json.imported").exists());
    let body = with_model("house-model", "chat-image-nonvision.json");
    let (status, headers, _) = send(post_json(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "2");
    visor.shutdown();
    let _ = visor.task.take().unwrap().await;
    drop(visor);
    let _ = std::fs::remove_dir_all(data_dir);
}
