//! The service stack called in process (`tower::ServiceExt::oneshot`), no
//! listening socket of visor's: a request body built in the test goes
//! through the same layers and phases as hyper's from a socket. The
//! upstream is the loopback mock.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use support::*;
use tower::ServiceExt;
use visor::config::Config;
use visor::metrics::{Metrics, NO_UPSTREAM};
use visor::proxy::{AppState, stack};
use visor::upstream::{RequestBody, Upstreams};

async fn state(upstream: &str) -> Arc<AppState> {
    let dir = temp_dir("in-process");
    let toml = format!(
        "[server]\ndata_dir = \"{}\"\n[store]\nbackend = \"memory\"\n\
         [[upstream]]\nname = \"mock\"\nbase_url = \"{upstream}/v1\"\nmodels = [\"*\"]\n",
        dir.display()
    );
    let config = Config::from_toml(&toml, Path::new("in-process.toml"), &|_| None).unwrap();
    let metrics = Arc::new(Metrics::new().unwrap());
    let upstreams = Upstreams::new(config.server.connect_timeout, &config.upstreams).unwrap();
    Arc::new(visor::app::build(config, metrics, upstreams).unwrap())
}

fn request(method: &str, path: &str, body: &'static str) -> Request<RequestBody> {
    Request::builder()
        .method(method)
        .uri(path)
        .header("host", "visor.test")
        .header("content-type", "application/json")
        .body(RequestBody::new(Full::new(Bytes::from_static(
            body.as_bytes(),
        ))))
        .unwrap()
}

async fn answer(state: &Arc<AppState>, req: Request<RequestBody>) -> (StatusCode, Bytes) {
    let resp = stack(state.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, body)
}

#[tokio::test]
async fn the_stack_answers_in_process_like_over_a_socket() {
    let mock = MockUpstream::start(|_| {
        Reply::json(
            200,
            r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"seen"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#,
        )
    })
    .await;
    let state = state(&mock.url()).await;

    // visor's own endpoint, and a refusal at the edge in the error shape.
    let (status, _) = answer(&state, request("GET", "/healthz", "")).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = answer(
        &state,
        request("POST", "/v1/chat/completions", "{\"model\":"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&body), "invalid_json");
    assert_eq!(
        mock.count(),
        0,
        "a refused request never reaches the upstream"
    );

    // A transformed request: an image for a model that cannot see is
    // described and replaced before the upstream sees the body; the answer
    // streams back.
    let png = base64_simd::STANDARD.encode_to_string(fixture("chart.png"));
    let body: &'static str = Box::leak(
        format!(
            r#"{{"model":"gpt-oss-120b","messages":[{{"role":"user","content":[{{"type":"text","text":"what is this?"}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{png}"}}}}]}}]}}"#
        )
        .into_boxed_str(),
    );
    let (status, answer_body) = answer(&state, request("POST", "/v1/chat/completions", body)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(String::from_utf8_lossy(&answer_body).contains("seen"));
    // The describer (the mock, as the first upstream) was asked first; the
    // chat request then carried its description instead of the image.
    let sent = mock.recorded();
    assert_eq!(sent.len(), 2);
    assert!(String::from_utf8_lossy(&sent[0].body).contains(";base64,"));
    let chat = String::from_utf8_lossy(&sent[1].body).into_owned();
    assert!(!chat.contains(";base64,"), "{chat:.300}");
    assert!(chat.contains("described: seen]"), "{chat:.300}");
    assert!(chat.contains("what is this?"));

    // A streamed (untransformed) body goes through byte for byte.
    let (status, _) = answer(
        &state,
        request("POST", "/v1/embeddings", r#"{"model":"e","input":"a"}"#),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let sent = mock.recorded();
    assert_eq!(&sent[2].body[..], br#"{"model":"e","input":"a"}"#);
}

/// The `visor_requests_total` series of `metrics` for `upstream`, `model`
/// and `status`, as `/metrics` renders it (0 when absent).
/// `visor_requests_total{upstream, model, status}`, over every key name.
fn requests_total(state: &AppState, upstream: &str, model: &str, status: &str) -> u64 {
    use prometheus::core::Collector as _;
    let want = [("upstream", upstream), ("model", model), ("status", status)];
    state
        .metrics
        .requests
        .collect()
        .iter()
        .flat_map(|f| f.get_metric())
        .filter(|m| {
            want.iter().all(|(k, v)| {
                m.get_label()
                    .iter()
                    .any(|l| l.name() == *k && l.value() == *v)
            })
        })
        .map(|m| m.get_counter().get_value() as u64)
        .sum()
}

/// A state whose one upstream is `url`, taking `gpt-*`, behind the proxy
/// key `sk-edge`.
fn edge_state(url: &str) -> Arc<AppState> {
    let dir = temp_dir("in-process-edge");
    let toml = format!(
        "[server]\ndata_dir = \"{}\"\napi_keys = [\"sk-edge\"]\n[store]\nbackend = \"memory\"\n\
         [[upstream]]\nname = \"mock\"\nbase_url = \"{url}/v1\"\nmodels = [\"gpt-*\"]\n",
        dir.display(),
    );
    let config = Config::from_toml(&toml, Path::new("edge.toml"), &|_| None).unwrap();
    let metrics = Arc::new(Metrics::new().unwrap());
    let upstreams = Upstreams::new(config.server.connect_timeout, &config.upstreams).unwrap();
    Arc::new(visor::app::build(config, metrics, upstreams).unwrap())
}

/// `GET /v1/responses` as a WebSocket upgrade in `version`, with the key.
fn upgrade(version: &str) -> Request<RequestBody> {
    let mut req = request("GET", "/v1/responses", "");
    for (name, value) in [
        ("authorization", "Bearer sk-edge"),
        ("upgrade", "websocket"),
        ("connection", "Upgrade"),
        ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ("sec-websocket-version", version),
    ] {
        req.headers_mut().insert(name, value.parse().unwrap());
    }
    req
}

#[tokio::test]
async fn every_answer_visor_gives_itself_leaves_by_one_edge_http_or_websocket() {
    let mock = MockUpstream::start(|_| Reply::json(200, "{}")).await;
    let state = edge_state(&mock.url());

    // No key: 401 at the auth layer, counted once with no upstream.
    let (status, body) = answer(&state, request("GET", "/v1/models", "")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(error_code(&body), "invalid_api_key");
    assert_eq!(requests_total(&state, NO_UPSTREAM, "", "401"), 1);

    // A model no upstream takes: 404, counted under the model it named.
    let mut req = request(
        "POST",
        "/v1/chat/completions",
        r#"{"model":"claude-x","messages":[]}"#,
    );
    req.headers_mut()
        .insert("authorization", "Bearer sk-edge".parse().unwrap());
    let (status, _) = answer(&state, req).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(requests_total(&state, NO_UPSTREAM, "claude-x", "404"), 1);

    // A WebSocket upgrade in a version visor does not speak: 426 from the
    // same edge, counted the same way, and no upstream contacted.
    let (status, body) = answer(&state, upgrade("8")).await;
    assert_eq!(status, StatusCode::UPGRADE_REQUIRED);
    assert!(!error_code(&body).is_empty());
    assert_eq!(requests_total(&state, NO_UPSTREAM, "", "426"), 1);
    assert_eq!(mock.count(), 0, "nothing reached the upstream");
}

#[tokio::test]
async fn a_websocket_upstream_that_cannot_be_reached_is_counted_at_the_edge_as_http_is() {
    // An address where nothing listens (bound, then closed).
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let state = edge_state(&url);
    let (status, body) = answer(&state, upgrade("13")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body:?}");
    assert_eq!(requests_total(&state, "mock", "", "502"), 1);
    let connect_errors = state
        .metrics
        .upstream_errors
        .get_metric_with_label_values(&["mock", "connect"])
        .map_or(0, |c| c.get());
    assert_eq!(connect_errors, 1);
}
