//! The service stack called in process (`tower::ServiceExt::oneshot`), no
//! listening socket of visor's: a request body built in the test goes
//! through the same layers and phases as hyper's from a socket. The
//! upstream is the loopback mock.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use support::*;
use tower::ServiceExt;
use visor::config::Config;
use visor::metrics::Metrics;
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
