//! The inspector through the real proxy: a request visor changed is listed
//! with what it did (JSON and the page), found by its id, filtered; the
//! kept number is bounded; who may read it (open on loopback without keys,
//! else only an admin key, never a proxy key); no credential in any answer;
//! off is a 404.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use serde_json::{Value, json};
use support::*;

/// An answer with usage.
fn answered() -> Reply {
    Reply::json(
        200,
        json!({"id": "c1", "object": "chat.completion",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 120, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 64}}})
        .to_string(),
    )
}

/// A chat with a screenshot, to a model that cannot see.
fn with_image() -> String {
    let png = std::fs::read(fixtures().join("chart.png")).unwrap();
    let b64 = base64_encode(&png);
    json!({"model": "text-only", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}}]}]})
    .to_string()
}

fn base64_encode(bytes: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

const TEXT_ONLY: &str =
    "[images]\nnon_vision = \"strip\"\n[[model]]\nmatch = \"text-only\"\nvision = false\n";

async fn get(
    visor: &Visor,
    path: &str,
    bearer: Option<&str>,
) -> (StatusCode, http::HeaderMap, Bytes) {
    let mut req = Request::get(visor.url(path));
    if let Some(b) = bearer {
        req = req.header("authorization", format!("Bearer {b}"));
    }
    send(req.body(Full::new(Bytes::new())).unwrap()).await
}

/// Waits (bounded) until the inspector lists `n` requests.
async fn listed(visor: &Visor, n: usize, bearer: Option<&str>) -> Vec<Value> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let (_, _, body) = get(visor, "/visor/api/requests", bearer).await;
        let v: Value = serde_json::from_slice(&body).unwrap_or_default();
        let list = v["requests"].as_array().cloned().unwrap_or_default();
        if list.len() >= n || std::time::Instant::now() > deadline {
            return list;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_changed_request_is_listed_with_what_visor_did_and_found_by_its_id() {
    let mock = MockUpstream::start(|_: &Recorded| answered()).await;
    let visor = Visor::for_mock(&mock, TEXT_ONLY).await;
    let req = Request::post(visor.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", "req-inspect-1")
        .header("authorization", "Bearer sk-client-SECRET")
        .body(Full::new(Bytes::from(with_image())))
        .unwrap();
    let (status, _, _) = send(req).await;
    assert_eq!(status, 200);
    let plain =
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    send(post_json(&visor.url("/v1/chat/completions"), plain)).await;
    let list = listed(&visor, 2, None).await;
    assert_eq!(list.len(), 2);
    // Newest first.
    assert_eq!(list[0]["model"], "gpt-4o");
    let s = &list[1];
    assert_eq!(s["id"], "req-inspect-1");
    assert_eq!(
        (
            s["model"].as_str(),
            s["upstream"].as_str(),
            s["status"].as_u64()
        ),
        (Some("text-only"), Some("mock"), Some(200))
    );
    assert_eq!(s["changes"]["images_replaced"], 1);
    assert!(s["bytes_in"].as_u64().unwrap() > s["bytes_out"].as_u64().unwrap());
    assert_eq!(
        s["tokens"],
        json!({"prompt": 120, "cached_read": 64, "cache_written": 0, "completion": 7})
    );
    assert_eq!(s["cache"]["miss"], "first");
    assert!(s["total_ms"].as_u64().is_some() && s["conversation"].as_str().unwrap().len() == 16);
    // By id, and filtered.
    let (status, _, one) = get(&visor, "/visor/api/requests/req-inspect-1", None).await;
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_slice::<Value>(&one).unwrap()["request"]["changes"]["images_replaced"],
        1
    );
    let (status, _, body) = get(&visor, "/visor/api/requests/nope", None).await;
    assert_eq!(
        (status.as_u16(), error_code(&body).as_str()),
        (404, "request_not_found")
    );
    let (_, _, changed) = get(&visor, "/visor/api/requests?changed=true", None).await;
    let changed: Value = serde_json::from_slice(&changed).unwrap();
    assert_eq!(changed["requests"].as_array().unwrap().len(), 1);
    let (status, _, body) = get(&visor, "/visor/api/requests?colour=red", None).await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    // The page lists it without JavaScript, loads nothing from elsewhere.
    let (status, h, page) = get(&visor, "/visor/ui?model=text-only", None).await;
    assert_eq!(status, 200);
    assert!(h["content-type"].to_str().unwrap().starts_with("text/html"));
    let page = String::from_utf8(page.to_vec()).unwrap();
    assert!(
        page.contains("1 images replaced") && page.contains("text-only → mock"),
        "{page}"
    );
    assert!(!page.contains("gpt-4o"), "filtered by model");
    // Its one script is its own (it only adds live rows).
    assert_eq!(page.matches("<script").count(), 1);
    assert!(page.contains("<script src=/visor/ui/live.js defer>"));
    assert!(!page.contains("https://") && !page.contains("http://"));
    // No credential anywhere.
    for path in [
        "/visor/api/requests",
        "/visor/api/requests/req-inspect-1",
        "/visor/ui",
        "/visor/ui/requests/req-inspect-1",
        "/visor/api/savings",
        "/visor/ui/savings",
    ] {
        let (_, _, body) = get(&visor, path, None).await;
        assert!(!String::from_utf8_lossy(&body).contains("SECRET"), "{path}");
    }
}

#[tokio::test]
async fn it_keeps_no_more_than_keep() {
    let mock = MockUpstream::start(|_: &Recorded| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "[inspector]\nkeep = 2\n").await;
    for i in 0..3 {
        let body =
            json!({"model": format!("m{i}"), "messages": [{"role": "user", "content": "hi"}]})
                .to_string();
        send(post_json(&visor.url("/v1/chat/completions"), body)).await;
    }
    // The third is in once it is listed first.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let list = loop {
        let list = listed(&visor, 2, None).await;
        if list.first().is_some_and(|s| s["model"] == "m2") || std::time::Instant::now() > deadline
        {
            break list;
        }
    };
    let models: Vec<&str> = list.iter().map(|s| s["model"].as_str().unwrap()).collect();
    assert_eq!(models, ["m2", "m1"]);
}

#[tokio::test]
async fn with_keys_only_an_admin_key_opens_it_and_never_a_proxy_key() {
    let mock = MockUpstream::start(|_: &Recorded| chat_ok()).await;
    let visor = Visor::for_mock(
        &mock,
        "[server]\napi_keys = [\"vk-proxy\"]\n[inspector]\nadmin_keys = [\"adm-1\"]\n",
    )
    .await;
    let (status, _, _) = get(&visor, "/visor/api/requests", None).await;
    assert_eq!(status, 401);
    let (status, _, _) = get(&visor, "/visor/api/requests", Some("vk-proxy")).await;
    assert_eq!(status, 401, "a proxy key is not an admin key");
    let (status, _, _) = get(&visor, "/visor/ui", Some("adm-1")).await;
    assert_eq!(status, 200);
    // And the admin key is no proxy key.
    let req = Request::post(visor.url("/v1/chat/completions"))
        .header("authorization", "Bearer adm-1")
        .body(Full::new(Bytes::from(r#"{"model":"m","messages":[]}"#)))
        .unwrap();
    assert_eq!(send(req).await.0, 401);
    // Keys but no admin key: closed, saying how to open it.
    let closed = Visor::for_mock(&mock, "[server]\napi_keys = [\"vk-proxy\"]\n").await;
    let (status, _, body) = get(&closed, "/visor/api/requests", Some("vk-proxy")).await;
    assert_eq!(
        (status.as_u16(), error_code(&body).as_str()),
        (403, "inspector_closed")
    );
    assert!(String::from_utf8_lossy(&body).contains("admin_keys"));
}

#[tokio::test]
async fn off_is_not_there() {
    let mock = MockUpstream::start(|_: &Recorded| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "[inspector]\nenabled = false\n").await;
    for path in [
        "/visor/ui",
        "/visor/api/requests",
        "/visor/ui/savings",
        "/visor/api/events",
        "/visor/ui/sign-in",
    ] {
        let (status, _, _) = get(&visor, path, None).await;
        assert_eq!(status, 404, "{path}");
    }
}

#[tokio::test]
async fn it_goes_by_the_address_served_not_the_one_configured() {
    // The config says every address; `serve --listen` (here: bind) chose
    // loopback: open. (The other way round is the unit test's: a server of
    // the tests never listens beyond loopback.)
    let mock = MockUpstream::start(|_: &Recorded| chat_ok()).await;
    let mut cfg = visor::config::Config::from_toml(
        &format!(
            "[server]\nlisten = \"0.0.0.0:8787\"\n{}models = [\"*\"]\n",
            mock.upstream_toml("mock")
        ),
        std::path::Path::new("t.toml"),
        &|_| None,
    )
    .unwrap();
    cfg.server.data_dir = temp_dir("inspector-listen");
    let server = visor::server::Server::bind(cfg, Some("127.0.0.1:0".parse().unwrap()))
        .await
        .unwrap();
    let state = server.state();
    assert!(state.server.listen.ip().is_loopback());
    let h = http::HeaderMap::new();
    assert_eq!(
        state.inspector.access(&h),
        visor::inspector::Access::Granted
    );
}
