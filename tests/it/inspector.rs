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
    assert_eq!(s["changes"]["images_stripped"], 1);
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
        page.contains("1 images replaced, 1 stripped") && page.contains("text-only → mock"),
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
        state.inspector.access(&h, &"/visor/ui".parse().unwrap()),
        visor::inspector::Access::Granted
    );
}

/// GET with extra headers.
async fn get_with(
    visor: &Visor,
    path: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, http::HeaderMap, Bytes) {
    let mut req = Request::get(visor.url(path));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    send(req.body(Full::new(Bytes::new())).unwrap()).await
}

/// Waits (bounded) until request `id` is kept; its detail.
async fn detail(visor: &Visor, id: &str, bearer: Option<&str>) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let (status, _, body) = get(visor, &format!("/visor/api/requests/{id}"), bearer).await;
        if status == 200 || std::time::Instant::now() > deadline {
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            return serde_json::from_slice(&body).unwrap();
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

fn with_id(path: &str, visor: &Visor, id: &str, body: String) -> Request<Full<Bytes>> {
    Request::post(visor.url(path))
        .header("content-type", "application/json")
        .header("x-request-id", id)
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

#[tokio::test]
async fn one_request_side_by_side_with_its_rules_and_the_original_image() {
    let mock = MockUpstream::start(|_: &Recorded| answered()).await;
    let visor = Visor::for_mock(&mock, TEXT_ONLY).await;
    send(with_id(
        "/v1/chat/completions",
        &visor,
        "req-side",
        with_image(),
    ))
    .await;
    let d = detail(&visor, "req-side", None).await;
    assert_eq!(d["request"]["bodies_kept"], true);
    let m = &d["messages"][0];
    assert_eq!(
        (m["at"].as_str(), m["changed"].as_bool()),
        (Some("0"), Some(true))
    );
    let label = &m["labels"][0];
    assert_eq!(label["rule"], "images");
    assert_eq!(label["reason"], "not shown: this model cannot see images");
    // The client's side keeps no image bytes: a reference the artifacts
    // answer to, whose bytes are the original.
    let png = std::fs::read(fixtures().join("chart.png")).unwrap();
    let b64 = base64_encode(&png);
    let client = m["client"].to_string();
    assert!(!client.contains(&b64[..80]), "{client}");
    let hex = label["artifact"].as_str().unwrap();
    assert!(client.contains(&format!("sha256:{hex}")), "{client}");
    let (status, h, bytes) = get(&visor, &format!("/visor/artifacts/{hex}"), None).await;
    assert_eq!(
        (status, h["content-type"].to_str().unwrap()),
        (StatusCode::OK, "image/png")
    );
    assert_eq!(bytes.as_ref(), png.as_slice());
    // The upstream's side is what the provider got.
    let sent: Value = serde_json::from_slice(&mock.recorded().pop().unwrap().body).unwrap();
    assert_eq!(m["upstream"], sent["messages"][0]);
    // The page: both sides, the label, the thumbnail.
    let (_, _, page) = get(&visor, "/visor/ui/requests/req-side", None).await;
    let page = String::from_utf8(page.to_vec()).unwrap();
    assert!(page.contains("images: not shown: this model cannot see images"));
    assert!(page.contains(&format!("<img src=\"/visor/artifacts/{hex}\"")));
    assert!(!page.contains(&b64[..80]));
}

#[tokio::test]
async fn a_dedup_note_is_labelled_with_its_source() {
    let mock = MockUpstream::start(|_: &Recorded| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let block = (0..6)
        .map(|i| format!("[10:0{i}] member {i}: the retention policy needs a tax branch first, see section {i}"))
        .collect::<Vec<_>>()
        .join("\n");
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what changed in the channel?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "fetch", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": block}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "fetch", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": format!("{block}\na new line from the tool")}]},
    ]});
    send(with_id(
        "/v1/messages",
        &visor,
        "req-dedup",
        body.to_string(),
    ))
    .await;
    let d = detail(&visor, "req-dedup", None).await;
    let m = d["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["at"] == "4")
        .unwrap();
    assert_eq!(
        m["labels"],
        json!([{"rule": "dedup", "reason": "omitted: message 3 lines 1-6"}])
    );
    assert!(d["request"]["saving"]["dedup"].as_u64().unwrap() > 0);
    // Unchanged messages are marked so.
    assert!(
        d["messages"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["changed"] == false)
    );
}

#[tokio::test]
async fn a_conversation_in_order_and_the_savings_in_money() {
    let mock = MockUpstream::start(|_: &Recorded| answered()).await;
    let prices = "[[model]]\nmatch = \"priced\"\ninput = 2.5\ncached_input = 1.25\noutput = 10.0\n";
    let visor = Visor::for_mock(&mock, prices).await;
    for (i, key) in ["req-c1", "req-c2"].iter().enumerate() {
        let mut messages = vec![json!({"role": "user", "content": "plan the trip"})];
        if i == 1 {
            messages.push(json!({"role": "assistant", "content": "ok"}));
            messages.push(json!({"role": "user", "content": "and the hotel"}));
        }
        let body = json!({"model": "priced", "messages": messages}).to_string();
        send(with_id("/v1/chat/completions", &visor, key, body)).await;
    }
    listed(&visor, 2, None).await;
    let d = detail(&visor, "req-c2", None).await;
    let conversation = d["request"]["conversation"].as_str().unwrap().to_owned();
    // Prompt 120 of which 64 cached, completion 7: (56·2.5 + 64·1.25 + 7·10) / 1e6.
    let cost = d["request"]["cost"].as_f64().unwrap();
    assert!(
        (cost - (56.0 * 2.5 + 64.0 * 1.25 + 70.0) / 1e6).abs() < 1e-12,
        "{cost}"
    );
    let (status, _, body) = get(
        &visor,
        &format!("/visor/api/conversations/{conversation}"),
        None,
    )
    .await;
    assert_eq!(status, 200);
    let c: Value = serde_json::from_slice(&body).unwrap();
    let ids: Vec<&str> = c["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["req-c1", "req-c2"], "oldest first");
    let (_, _, page) = get(
        &visor,
        &format!("/visor/ui/conversations/{conversation}"),
        None,
    )
    .await;
    let page = String::from_utf8(page.to_vec()).unwrap();
    assert!(
        page.contains("<svg class=chart") && page.contains("request 2: sent: "),
        "{page}"
    );
    let (_, _, body) = get(&visor, "/visor/api/savings", None).await;
    let v: Value = serde_json::from_slice(&body).unwrap();
    let sums = &v["by_model"]["priced"];
    assert_eq!(sums["requests"], 2);
    assert!((sums["cost"].as_f64().unwrap() - 2.0 * cost).abs() < 1e-12);
    assert_eq!(v["by_key"]["none"]["requests"], 2);
    let (_, _, page) = get(&visor, "/visor/ui/savings", None).await;
    assert!(String::from_utf8_lossy(&page).contains("<h2>Per model</h2>"));
}

#[tokio::test]
async fn events_stream_each_request_as_it_is_kept() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mock = MockUpstream::start(|_: &Recorded| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let url = visor.url("/");
    let addr = url.trim_start_matches("http://").trim_end_matches('/');
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(format!("GET /visor/api/events HTTP/1.1\r\nhost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut seen = Vec::new();
    async fn read_until(conn: &mut tokio::net::TcpStream, seen: &mut Vec<u8>, what: &str) {
        let fut = async {
            let mut buf = [0u8; 4096];
            while !String::from_utf8_lossy(seen).contains(what) {
                let n = conn.read(&mut buf).await.unwrap();
                assert!(n > 0, "the stream ended");
                seen.extend_from_slice(&buf[..n]);
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), fut)
            .await
            .unwrap_or_else(|_| panic!("no {what:?} within 10 s"));
    }
    read_until(&mut conn, &mut seen, ": visor inspector events").await;
    assert!(String::from_utf8_lossy(&seen).contains("text/event-stream"));
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    send(with_id("/v1/chat/completions", &visor, "req-live", body)).await;
    read_until(&mut conn, &mut seen, "\"id\":\"req-live\"").await;
    let text = String::from_utf8_lossy(&seen);
    assert!(text.contains("data: {"), "{text}");
}

#[tokio::test]
async fn explain_runs_in_the_proxy_with_its_caches() {
    let mock = MockUpstream::start(|_: &Recorded| chat_ok()).await;
    let visor = Visor::for_mock(&mock, TEXT_ONLY).await;
    let req = Request::post(visor.url("/visor/api/explain?endpoint=chat"))
        .body(Full::new(Bytes::from(with_image())))
        .unwrap();
    let (status, _, body) = send(req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["report"]["images_replaced"], 1);
    assert_eq!(v["report"]["model"], "text-only");
    assert!(!v["request"].to_string().contains("base64,"));
    assert!(mock.recorded().is_empty(), "nothing sent upstream");
    for (q, code) in [("?endpoint=soap", 400), ("?colour=red", 400)] {
        let req = Request::post(visor.url(&format!("/visor/api/explain{q}")))
            .body(Full::new(Bytes::from(with_image())))
            .unwrap();
        assert_eq!(send(req).await.0.as_u16(), code, "{q}");
    }
    let req = Request::post(visor.url("/visor/api/explain"))
        .body(Full::new(Bytes::from_static(b"{not json")))
        .unwrap();
    let (status, _, body) = send(req).await;
    assert_eq!(status, 400);
    assert_eq!(error_code(&body), "invalid_json");
}

#[tokio::test]
async fn a_browser_signs_in_with_an_admin_key_and_gets_an_http_only_cookie() {
    let mock = MockUpstream::start(|_: &Recorded| answered()).await;
    let visor = Visor::for_mock(
        &mock,
        &format!("[server]\napi_keys = [\"vk-proxy\"]\n[inspector]\nadmin_keys = [\"adm-1\"]\n{TEXT_ONLY}"),
    )
    .await;
    // The page offers the form; the API says 401 in the error shape.
    let (status, _, page) = get(&visor, "/visor/ui", None).await;
    assert_eq!(status, 401);
    assert!(String::from_utf8_lossy(&page).contains("action=/visor/ui/sign-in"));
    let sign_in = |key: &str| {
        Request::post(visor.url("/visor/ui/sign-in"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(Full::new(Bytes::from(format!("key={key}"))))
            .unwrap()
    };
    let (status, h, _) = send(sign_in("vk-proxy")).await;
    assert_eq!(status, 401, "a proxy key does not sign in");
    assert!(h.get("set-cookie").is_none());
    let (status, h, _) = send(sign_in("adm-1")).await;
    assert_eq!(status, 303);
    assert_eq!(h["location"], "/visor/ui");
    let cookie = h["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    assert!(!cookie.contains("adm-1"), "the cookie holds no key");
    let pair = cookie.split(';').next().unwrap().to_owned();
    let (status, _, _) = get_with(&visor, "/visor/ui", &[("cookie", &pair)]).await;
    assert_eq!(status, 200);
    // The thumbnails load with the cookie alone.
    let req = Request::post(visor.url("/v1/chat/completions"))
        .header("authorization", "Bearer vk-proxy")
        .header("x-request-id", "req-signed")
        .body(Full::new(Bytes::from(with_image())))
        .unwrap();
    assert_eq!(send(req).await.0, 200);
    let d = detail(&visor, "req-signed", Some("adm-1")).await;
    let hex = d["messages"][0]["labels"][0]["artifact"]
        .as_str()
        .unwrap()
        .to_owned();
    let artifact = format!("/visor/artifacts/{hex}");
    assert_eq!(
        get_with(&visor, &artifact, &[("cookie", &pair)]).await.0,
        200
    );
    assert_eq!(get_with(&visor, &artifact, &[]).await.0, 401);
    assert_eq!(
        get_with(&visor, "/visor/ui", &[("cookie", "visor_inspector=1.abc")])
            .await
            .0,
        401
    );
}

#[tokio::test]
async fn body_bytes_bounds_what_is_kept() {
    let mock = MockUpstream::start(|_: &Recorded| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "[inspector]\nbody_bytes = 300\n").await;
    let small = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let large = json!({"model": "m", "messages": [{"role": "user", "content": "x ".repeat(400)}]})
        .to_string();
    send(with_id("/v1/chat/completions", &visor, "req-small", small)).await;
    send(with_id("/v1/chat/completions", &visor, "req-large", large)).await;
    let d = detail(&visor, "req-large", None).await;
    assert_eq!(d["request"]["bodies_kept"], false);
    assert!(d["messages"].is_null());
    let d = detail(&visor, "req-small", None).await;
    assert_eq!(d["request"]["bodies_kept"], true);
    assert_eq!(d["messages"][0]["client"]["content"], "hi");
    let (_, _, page) = get(&visor, "/visor/ui/requests/req-large", None).await;
    assert!(String::from_utf8_lossy(&page).contains("bodies are not kept"));
}

#[tokio::test]
async fn two_replicas_on_one_redis_are_listed_together() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let mock = MockUpstream::start(|_: &Recorded| chat_ok()).await;
    let store = format!(
        "[store]\nbackend = \"{}\"\nprefix = \"visor-inspector-test:\"\n",
        redis.url()
    );
    let a = Visor::for_mock(&mock, &store).await;
    let b = Visor::for_mock(&mock, &store).await;
    let body =
        |m: &str| json!({"model": m, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    send(with_id("/v1/chat/completions", &a, "req-on-a", body("ma"))).await;
    send(with_id("/v1/chat/completions", &b, "req-on-b", body("mb"))).await;
    for v in [&a, &b] {
        let list = listed(v, 2, None).await;
        let mut ids: Vec<&str> = list.iter().map(|s| s["id"].as_str().unwrap()).collect();
        ids.sort();
        assert_eq!(ids, ["req-on-a", "req-on-b"]);
        let (_, _, body) = get(v, "/visor/api/requests", None).await;
        assert_eq!(
            serde_json::from_slice::<Value>(&body).unwrap()["fleet"],
            true
        );
    }
    // The detail of a request served by the other replica says so.
    let d = detail(&a, "req-on-b", None).await;
    assert_eq!(d["request"]["id"], "req-on-b");
    assert!(d["messages"].is_null());
}

#[tokio::test]
async fn what_visor_answers_itself_is_listed_too() {
    // The quick start without a network: the upstream cannot be reached,
    // visor answers 502 — and the inspector says so.
    let mock = MockUpstream::builder()
        .fault(Fault::RefuseConnect)
        .start()
        .await;
    let visor = Visor::start(&mock.upstream_toml("dead")).await;
    let body =
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let (status, _, _) = send(with_id("/v1/chat/completions", &visor, "req-dead", body)).await;
    assert_eq!(status, 502);
    let d = detail(&visor, "req-dead", None).await;
    let s = &d["request"];
    assert_eq!(
        (
            s["status"].as_u64(),
            s["upstream"].as_str(),
            s["outcome"].as_str()
        ),
        (Some(502), Some("dead"), Some("answered by visor"))
    );
    assert_eq!(s["endpoint"], "/v1/chat/completions");
    let (status, _, _) = send(with_id(
        "/v1/chat/completions",
        &visor,
        "req-bad",
        "{oops".into(),
    ))
    .await;
    assert_eq!(status, 400);
    let d = detail(&visor, "req-bad", None).await;
    assert_eq!(d["request"]["status"], 400);
}

#[tokio::test]
async fn open_means_open_to_this_machine_and_bodies_keep_no_credential() {
    let mock = MockUpstream::start(|_: &Recorded| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let body = json!({"model": "m", "api_key": "sk-body-SECRET",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}, "headers": {"Authorization": "Bearer sk-tool-SECRET"}}],
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    send(with_id("/v1/chat/completions", &visor, "req-creds", body)).await;
    let d = detail(&visor, "req-creds", None).await;
    let text = d.to_string();
    assert!(!text.contains("SECRET"), "{text}");
    assert!(text.contains("[redacted]"), "{text}");
    // A page that rebinds its own name to 127.0.0.1 is not this machine.
    for (host, want) in [("evil.example", 403), ("localhost", 200)] {
        let (status, _, _) = get_with(&visor, "/visor/api/requests", &[("host", host)]).await;
        assert_eq!(status.as_u16(), want, "{host}");
    }
    let (status, _, _) = get_with(
        &visor,
        "/visor/api/requests",
        &[("sec-fetch-site", "cross-site")],
    )
    .await;
    assert_eq!(status, 403);
    // Explain is a POST; sign-out clears the cookie.
    let (status, h, _) = get(&visor, "/visor/api/explain", None).await;
    assert_eq!(
        (status.as_u16(), h["allow"].to_str().unwrap()),
        (405, "POST")
    );
    let req = Request::post(visor.url("/visor/ui/sign-out"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (status, h, _) = send(req).await;
    assert_eq!(status, 303);
    assert!(h["set-cookie"].to_str().unwrap().contains("Max-Age=0"));
}

/// A conversation's large requests (read off the worker): each one's
/// body, and its rewrite as sent (dedup shortens the files read again),
/// is looked at for credentials and media only after the bytes it shares
/// with the request before, which held none — and what a later turn adds
/// is still taken out of both.
#[tokio::test]
async fn a_continued_conversation_keeps_no_credential_or_image_its_new_turn_adds() {
    let mock = MockUpstream::start(|_: &Recorded| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    // Over the 256 KiB from which a body is read off the worker.
    let file: String = (0..400)
        .map(|l| format!("{l:>4}  let value_{l} = compute(input_{l}, {l});\n"))
        .collect();
    let mut messages: Vec<Value> = (0..40)
        .map(|i| {
            let log = format!("run {i}: {}", format!("step{i} ").repeat(1200));
            json!({"role": "tool", "content": format!("$ cat lib.rs # {i}\n{file}{log}")})
        })
        .collect();
    let body = |m: &[Value]| json!({"model": "m", "messages": m}).to_string();
    for turn in 0..2 {
        messages.push(json!({"role": "user", "content": format!("go on {turn}")}));
        let id = format!("req-turn-{turn}");
        send(with_id(
            "/v1/chat/completions",
            &visor,
            &id,
            body(&messages),
        ))
        .await;
        // Kept (so its body was looked at) before the next turn.
        detail(&visor, &id, None).await;
    }
    // A credential (the same plan: its state goes on), then an image.
    let png: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
    let image = format!("data:image/png;base64,{}", base64_encode(&png));
    let added = [
        json!({"role": "user", "api_key": "sk-turn-SECRET", "content": "and this"}),
        json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}),
    ];
    for (turn, m) in added.into_iter().enumerate() {
        messages.push(m);
        let id = format!("req-added-{turn}");
        send(with_id(
            "/v1/chat/completions",
            &visor,
            &id,
            body(&messages),
        ))
        .await;
        let d = detail(&visor, &id, None).await;
        assert_eq!(d["request"]["bodies_kept"], true);
        let sent = mock.recorded().pop().unwrap().body;
        assert!(sent.len() < body(&messages).len() / 2, "dedup rewrote it");
        let text = d.to_string();
        assert!(
            !text.contains("SECRET"),
            "turn {turn}: a credential was kept"
        );
        assert!(
            !text.contains(&base64_encode(&png)[..200]),
            "turn {turn}: image bytes were kept"
        );
        assert!(text.contains("[redacted]"), "turn {turn}");
        assert_eq!(
            text.contains("[base64: 3000 bytes"),
            turn == 1,
            "turn {turn}"
        );
    }
    // Looked at after the shared bytes: the second turn's body, the
    // credential's turn as received and as sent (each after a clean one);
    // the rest in full (the first, the one after the credential).
    assert_eq!(prefix_reads(&visor, "inspector").await, (4.0, 4.0));
}

/// The same for bodies of 8 to 256 KiB, looked at when their request is
/// recorded: the next turn is looked at after the bytes it shares with a
/// body found clean, and a credential it adds is still taken out.
#[tokio::test]
async fn a_continued_conversation_of_small_bodies_is_looked_at_after_its_clean_prefix() {
    let mock = MockUpstream::start(|_: &Recorded| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let mut messages: Vec<Value> = (0..6)
        .map(|i| json!({"role": "tool", "content": format!("run {i}: {}", format!("step{i} ").repeat(300))}))
        .collect();
    let added = [
        json!({"role": "user", "content": "go on"}),
        json!({"role": "user", "content": "and again"}),
        json!({"role": "user", "password": "turn-SECRET", "content": "with this"}),
    ];
    for (turn, m) in added.into_iter().enumerate() {
        messages.push(m);
        let body = json!({"model": "m", "messages": messages}).to_string();
        assert!((8 << 10..256 << 10).contains(&body.len()));
        let id = format!("req-small-{turn}");
        send(with_id("/v1/chat/completions", &visor, &id, body)).await;
        let d = detail(&visor, &id, None).await;
        assert!(!d.to_string().contains("SECRET"), "turn {turn}");
    }
    assert_eq!(prefix_reads(&visor, "inspector").await, (2.0, 1.0));
}
