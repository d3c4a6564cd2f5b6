//! Transparency, routing, credentials, own endpoints and metrics, over real
//! loopback sockets against the mock upstream.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::*;

fn ok_chat() -> Reply {
    Reply::json(
        200,
        r#"{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":11,"completion_tokens":4,"total_tokens":15}}"#,
    )
}

#[tokio::test]
async fn untouched_request_reaches_upstream_byte_for_byte() {
    let mock = MockUpstream::start(|_| ok_chat()).await;
    let visor = Visor::for_mock(&mock, "").await;
    // Odd spacing, key order, escapes and a 1 KB image: any re-serialisation shows.
    let fixture = fixture("chat-image-vision-stream.json");
    let odd = Bytes::from_static(
        b"{ \"messages\" : [ {\"role\":\"user\",\"content\":\"caf\\u00e9 \\\"q\\\"\"} ],\n\t\"model\":\"gpt-4o\" ,\"temperature\":0.50 }",
    );
    for body in [fixture, odd] {
        let (status, _, _) =
            send(post_json(&visor.url("/v1/chat/completions"), body.clone())).await;
        assert_eq!(status, 200);
        let rec = mock.recorded().pop().unwrap();
        assert_eq!(rec.body, body, "body changed on the way");
        assert_eq!(rec.uri.path(), "/v1/chat/completions");
        assert_eq!(
            rec.headers["content-length"],
            body.len().to_string().as_str()
        );
    }
    // A streamed endpoint (not transformed) is byte for byte too.
    let emb =
        Bytes::from_static(b"{\"input\": [\"a\",\"b\"], \"model\": \"text-embedding-3-small\"}");
    let (status, _, _) = send(post_json(&visor.url("/v1/embeddings"), emb.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(mock.recorded().pop().unwrap().body, emb);
}

#[tokio::test]
async fn headers_hop_by_hop_dropped_client_key_forwarded_request_id_echoed() {
    let mock = MockUpstream::start(|_| ok_chat()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let req = Request::post(visor.url("/v1/chat/completions?api-version=2024-06-01"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-client")
        .header("connection", "keep-alive, x-hop")
        .header("x-hop", "1")
        .header("x-visor-vision", "false")
        .header("openai-organization", "org-7")
        .header("x-request-id", "trace-abc")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"m","messages":[]}"#,
        )))
        .unwrap();
    let (status, headers, _) = send(req).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-request-id"], "trace-abc");
    assert_eq!(headers["x-visor-images-replaced"], "0");
    assert_eq!(headers["x-visor-bytes-saved"], "0");
    let rec = mock.recorded().pop().unwrap();
    assert_eq!(rec.uri.query(), Some("api-version=2024-06-01"));
    assert_eq!(rec.headers["authorization"], "Bearer sk-client");
    assert_eq!(rec.headers["openai-organization"], "org-7");
    assert_eq!(rec.headers["x-request-id"], "trace-abc");
    assert!(rec.headers.get("x-hop").is_none());
    assert!(rec.headers.get("x-visor-vision").is_none());
    assert_eq!(rec.headers["host"], mock.addr.to_string().as_str());

    // Without a client id, one is generated and forwarded.
    let (_, headers, _) = send(post_json(
        &visor.url("/v1/chat/completions"),
        r#"{"model":"m"}"#,
    ))
    .await;
    let id = headers["x-request-id"].to_str().unwrap().to_owned();
    assert!(id.starts_with("req_") && id.len() > 20, "{id}");
    assert_eq!(
        mock.recorded().pop().unwrap().headers["x-request-id"],
        id.as_str()
    );
}

#[tokio::test]
async fn upstream_key_replaces_client_key_and_anthropic_kind_uses_x_api_key() {
    let mock = MockUpstream::start(|_| ok_chat()).await;
    let visor = Visor::start(&format!(
        "[[upstream]]\nname=\"oai\"\nbase_url=\"{0}/v1\"\nmodels=[\"gpt-*\"]\napi_key=\"sk-upstream\"\n\
         [[upstream]]\nname=\"ant\"\nbase_url=\"{0}/anthropic/v1\"\nmodels=[\"claude-*\"]\napi_key=\"sk-ant\"\nauth=\"x-api-key\"\n",
        mock.url()
    ))
    .await;
    let req = |model: &str, path: &str| {
        Request::post(visor.url(path))
            .header("authorization", "Bearer sk-client")
            .header("x-api-key", "sk-client")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(format!(
                r#"{{"model":"{model}","messages":[]}}"#
            ))))
            .unwrap()
    };
    send(req("gpt-4o", "/v1/chat/completions")).await;
    let rec = mock.recorded().pop().unwrap();
    assert_eq!(rec.headers["authorization"], "Bearer sk-upstream");
    assert!(rec.headers.get("x-api-key").is_none());
    send(req("claude-sonnet-4", "/v1/messages")).await;
    let rec = mock.recorded().pop().unwrap();
    assert_eq!(rec.uri.path(), "/anthropic/v1/messages");
    assert_eq!(rec.headers["x-api-key"], "sk-ant");
    assert!(rec.headers.get("authorization").is_none());
}

#[tokio::test]
async fn routes_by_model_glob_and_modelless_requests_go_to_first() {
    let a = MockUpstream::start(|_| ok_chat()).await;
    let b = MockUpstream::start(|_| ok_chat()).await;
    let visor = Visor::start(&format!(
        "[[upstream]]\nname=\"a\"\nbase_url=\"{}/v1\"\nmodels=[\"gpt-*\",\"o[0-9]*\"]\n\
         [[upstream]]\nname=\"b\"\nbase_url=\"{}/openai\"\nmodels=[\"*\"]\n",
        a.url(),
        b.url()
    ))
    .await;
    let chat = |m: &str| format!(r#"{{"model":"{m}","messages":[]}}"#);
    send(post_json(
        &visor.url("/v1/chat/completions"),
        chat("gpt-4o"),
    ))
    .await;
    send(post_json(
        &visor.url("/v1/chat/completions"),
        chat("o3-mini"),
    ))
    .await;
    send(post_json(
        &visor.url("/v1/chat/completions"),
        chat("llama-3.1-8b"),
    ))
    .await;
    assert_eq!(a.count(), 2);
    assert_eq!(b.count(), 1);
    assert_eq!(b.recorded()[0].uri.path(), "/openai/chat/completions");

    // Streamed endpoint: the model comes after a long input and still routes.
    let long = "x".repeat(200_000);
    let body = format!(r#"{{"input":"{long}","model":"nomic-embed"}}"#);
    let (status, _, _) = send(post_json(&visor.url("/v1/embeddings"), body.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(b.count(), 2);
    assert_eq!(b.recorded()[1].body, body.as_bytes());

    // No model: the first upstream, path and query mapped.
    let (status, _, _) = send(
        Request::get(visor.url("/v1/models?limit=3"))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    let rec = a.recorded().pop().unwrap();
    assert_eq!(rec.uri.to_string(), "/v1/models?limit=3");
}

#[tokio::test]
async fn upstream_errors_and_response_headers_pass_through_unchanged() {
    let gz: &'static [u8] = &[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 1, 2, 3, 0xff, 0];
    let mock = MockUpstream::start(move |r| {
        if r.uri.path().ends_with("/embeddings") {
            Reply::Full {
                status: 200,
                headers: vec![
                    ("content-type", "application/json".into()),
                    ("content-encoding", "gzip".into()),
                    ("x-ratelimit-remaining-requests", "99".into()),
                ],
                body: Bytes::from_static(gz),
            }
        } else {
            Reply::Full {
                status: 429,
                headers: vec![
                    ("content-type", "application/json".into()),
                    ("retry-after", "7".into()),
                ],
                body: Bytes::from_static(
                    br#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#,
                ),
            }
        }
    })
    .await;
    let visor = Visor::for_mock(&mock, "").await;
    let (status, headers, body) = send(post_json(
        &visor.url("/v1/chat/completions"),
        r#"{"model":"m"}"#,
    ))
    .await;
    assert_eq!(status, 429);
    assert_eq!(headers["retry-after"], "7");
    assert_eq!(
        body,
        Bytes::from_static(br#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#)
    );
    let (status, headers, body) =
        send(post_json(&visor.url("/v1/embeddings"), r#"{"model":"m"}"#)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-encoding"], "gzip");
    assert_eq!(headers["x-ratelimit-remaining-requests"], "99");
    assert_eq!(body, Bytes::from_static(gz));
}

#[tokio::test]
async fn proxy_keys_guard_v1_and_visor_but_not_health_or_metrics() {
    let mock = MockUpstream::start(|_| ok_chat()).await;
    let visor = Visor::for_mock(&mock, "[server]\napi_keys = [\"vk-1\", \"vk-2\"]\n").await;
    let chat = || r#"{"model":"m","messages":[]}"#;

    let (status, _, body) = send(post_json(&visor.url("/v1/chat/completions"), chat())).await;
    assert_eq!(status, 401);
    assert_eq!(error_code(&body), "invalid_api_key");

    let with = |name: &str, value: &str, path: &str| {
        Request::post(visor.url(path))
            .header(name, value)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(chat().as_bytes())))
            .unwrap()
    };
    let (status, _, _) = send(with("authorization", "Bearer vk-3", "/v1/chat/completions")).await;
    assert_eq!(status, 401);
    let (status, _, _) = send(with("authorization", "vk-1", "/v1/chat/completions")).await;
    assert_eq!(status, 401, "a key without Bearer is not accepted");
    let (status, _, _) = send(with("x-api-key", "vk-1", "/visor/sessions/abc")).await;
    assert_ne!(status, 401);
    // Other spellings of a guarded path are guarded too (the router reads
    // them as the one spelling).
    for path in [
        "//v1/chat/completions",
        "/v1//chat/completions",
        "/%76%31/chat/completions",
        "//visor/sessions/abc",
        "/%76isor/sessions/abc",
    ] {
        let (status, _, body) = send(post_json(&visor.url(path), chat())).await;
        assert!(
            status == 401 || status == 400,
            "{path}: {status} {}",
            String::from_utf8_lossy(&body)
        );
    }
    assert_eq!(
        mock.count(),
        0,
        "refused requests must not reach the upstream"
    );

    let (status, _, _) = send(with("authorization", "Bearer vk-2", "/v1/chat/completions")).await;
    assert_eq!(status, 200);
    let (status, _, _) = send(with("x-api-key", "vk-1", "/v1/chat/completions")).await;
    assert_eq!(status, 200);
    for rec in mock.recorded() {
        assert!(
            rec.headers.get("authorization").is_none(),
            "proxy key forwarded"
        );
        assert!(
            rec.headers.get("x-api-key").is_none(),
            "proxy key forwarded"
        );
    }

    for path in ["/healthz", "/readyz", "/metrics"] {
        let (status, _, _) = send(
            Request::get(visor.url(path))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await;
        assert_eq!(status, 200, "{path}");
    }
}

#[tokio::test]
async fn own_endpoints_answer() {
    let mock = MockUpstream::start(|_| ok_chat()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let get = |p: &str| {
        Request::get(visor.url(p))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let (status, _, body) = send(get("/healthz")).await;
    assert_eq!(
        (status.as_u16(), &body[..]),
        (200, &br#"{"status":"ok"}"#[..])
    );
    let (status, _, body) = send(get("/readyz")).await;
    assert_eq!(
        (status.as_u16(), &body[..]),
        (200, &br#"{"status":"ready"}"#[..])
    );
    let (status, headers, _) = send(get("/metrics")).await;
    assert_eq!(status, 200);
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let (status, _, body) = send(get("/admin")).await;
    assert_eq!(status, 404);
    assert_eq!(error_code(&body), "unknown_url");
}

/// HEAD answers wherever GET does (same status and headers, the GET's
/// Content-Length, no body — over HTTP/1 on the wire, and over HTTP/2); any
/// other method on one of visor's own endpoints is 405 with `Allow`, in the
/// OpenAI error shape; under /v1 every method is still forwarded.
#[tokio::test]
async fn own_endpoints_answer_head_and_refuse_other_methods() {
    let mock = MockUpstream::start(|_| ok_chat()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let req = |method: &str, p: &str| {
        Request::builder()
            .method(method)
            .uri(visor.url(p))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let artifact = format!("/visor/artifacts/{}", "0".repeat(64));
    for path in [
        "/healthz",
        "/readyz",
        "/metrics",
        "/visor/sessions/none-yet",
        &artifact,
        "/nowhere",
    ] {
        let get = send(req("GET", path)).await;
        let head = send(req("HEAD", path)).await;
        assert_eq!(head.0, get.0, "{path}");
        assert!(head.2.is_empty(), "{path}: a HEAD answer has no body");
        assert_eq!(
            head.1.get("content-type"),
            get.1.get("content-type"),
            "{path}"
        );
        let len: usize = head.1["content-length"].to_str().unwrap().parse().unwrap();
        // /metrics changes between the two calls; the others do not.
        if path != "/metrics" {
            assert_eq!(len, get.2.len(), "{path}");
        } else {
            assert!(len > 0);
        }
    }
    // On the wire: the head, and not a byte more.
    let mut s = tokio::net::TcpStream::connect(visor.addr).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut wire = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(10), s.read_to_end(&mut wire))
        .await
        .unwrap()
        .unwrap();
    let wire = String::from_utf8(wire).unwrap();
    assert!(wire.starts_with("HTTP/1.1 200"), "{wire}");
    assert!(
        wire.to_ascii_lowercase().contains("content-length: 15\r\n"),
        "{wire}"
    );
    assert!(wire.ends_with("\r\n\r\n"), "a body after the head: {wire}");
    // Over HTTP/2 too.
    let h2 = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let got = send_on(&h2, req("HEAD", "/healthz")).await;
    assert_eq!(got.0, 200);
    assert!(got.2.is_empty(), "HTTP/2 HEAD with a body");

    for (method, path, allow) in [
        ("DELETE", "/healthz", "GET, HEAD"),
        ("POST", "/healthz", "GET, HEAD"),
        ("PUT", "/readyz", "GET, HEAD"),
        ("POST", "/metrics", "GET, HEAD"),
        ("OPTIONS", "/metrics", "GET, HEAD"),
        ("DELETE", artifact.as_str(), "GET, HEAD"),
        ("POST", "/visor/sessions/abc", "GET, HEAD, DELETE"),
        ("PUT", "/visor/sessions/abc", "GET, HEAD, DELETE"),
        ("PATCH", "/visor/sessions/abc", "GET, HEAD, DELETE"),
    ] {
        let got = send(req(method, path)).await;
        let text = assert_error(&got, 405, "method_not_allowed");
        assert_eq!(got.1["allow"], allow, "{method} {path}");
        assert_eq!(got.1["content-type"], "application/json");
        assert!(
            text.contains(method) && !text.contains("unknown path"),
            "{method} {path}: {text}"
        );
    }
    assert_eq!(mock.count(), 0, "nothing of visor's own went upstream");
    // /v1/* goes upstream whatever the method.
    for method in ["DELETE", "PUT", "HEAD", "OPTIONS"] {
        let (status, _, _) = send(req(method, "/v1/files/file-1")).await;
        assert_eq!(status, 200, "{method}");
    }
    assert_eq!(mock.count(), 4);
    let methods: Vec<_> = mock.recorded().iter().map(|r| r.method.clone()).collect();
    assert_eq!(methods, ["DELETE", "PUT", "HEAD", "OPTIONS"]);
}

#[tokio::test]
async fn metrics_count_requests_tokens_and_first_byte() {
    let mock = MockUpstream::start(|r| {
        if r.body.windows(14).any(|w| w == b"\"stream\": true") {
            Reply::sse_chunks(vec![
                Chunk::Data(Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n")),
                Chunk::Data(Bytes::from_static(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":20}}\n\n")),
                Chunk::Data(Bytes::from_static(b"data: [DONE]\n\n")),
            ])
        } else {
            ok_chat()
        }
    })
    .await;
    let visor = Visor::for_mock(&mock, "").await;
    send(post_json(
        &visor.url("/v1/chat/completions"),
        r#"{"model":"gpt-x","messages":[]}"#,
    ))
    .await;
    let (_, _, body) = send(post_json(
        &visor.url("/v1/chat/completions"),
        r#"{"model":"gpt-x","stream": true,"messages":[]}"#,
    ))
    .await;
    assert!(body.ends_with(b"data: [DONE]\n\n"));
    let text = visor.metrics().await;
    let reqs = metric(
        &text,
        "visor_requests_total",
        &[("upstream", "mock"), ("model", "gpt-x"), ("status", "200")],
    );
    assert_eq!(reqs, Some(2.0), "{text}");
    assert_eq!(
        metric(&text, "visor_tokens_total", &[("kind", "prompt")]),
        Some(111.0)
    );
    assert_eq!(
        metric(&text, "visor_tokens_total", &[("kind", "completion")]),
        Some(24.0)
    );
    assert_eq!(
        metric(
            &text,
            "visor_upstream_first_byte_seconds_count",
            &[("upstream", "mock")]
        ),
        Some(2.0)
    );
    assert_eq!(
        metric(
            &text,
            "visor_request_duration_seconds_count",
            &[("upstream", "mock")]
        ),
        Some(2.0)
    );
    assert_eq!(metric(&text, "visor_inflight_requests", &[]), Some(0.0));
}

#[tokio::test]
async fn upstream_connections_are_kept_alive_and_reused() {
    let mock = MockUpstream::start(|r| {
        if r.body.windows(13).any(|w| w == b"\"stream\":true") {
            Reply::sse_chunks(vec![
                Chunk::Data(Bytes::from_static(b"data: {}\n\n")),
                Chunk::Data(Bytes::from_static(b"data: [DONE]\n\n")),
            ])
        } else {
            ok_chat()
        }
    })
    .await;
    let visor = Visor::for_mock(&mock, "").await;
    // One client connection: visor serves it on one worker, and each
    // worker keeps its own idle upstream connections.
    let client = client();
    for i in 0..6 {
        let body = if i % 2 == 0 {
            r#"{"model":"m","messages":[]}"#
        } else {
            r#"{"model":"m","stream":true,"messages":[]}"#
        };
        let (status, _, body) =
            send_on(&client, post_json(&visor.url("/v1/chat/completions"), body)).await;
        assert_eq!(status, 200);
        assert!(!body.is_empty());
    }
    assert_eq!(mock.count(), 6);
    assert_eq!(
        mock.connections.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "sequential requests should share one upstream connection"
    );
}

#[tokio::test]
async fn an_upstream_that_closes_after_each_response_is_not_reused_stale() {
    // Answers one request per connection and closes it, without saying so.
    let mock = MockUpstream::builder()
        .fault(Fault::CloseAfterResponse)
        .reply(|_| Reply::json(200, r#"{"ok":true}"#))
        .start()
        .await;
    let visor = Visor::start(&mock.upstream_toml("oneshot")).await;
    let client = client();
    for _ in 0..20 {
        let (status, _, body) = send_on(
            &client,
            post_json(
                &visor.url("/v1/chat/completions"),
                r#"{"model":"m","messages":[]}"#,
            ),
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    assert_eq!(
        mock.connections.load(std::sync::atomic::Ordering::SeqCst),
        20
    );
    assert_eq!(mock.count(), 20);
}

/// A client's key goes only to the upstream its body's model picks, whatever
/// the Content-Type says; a body that cannot be read is refused, not guessed.
#[tokio::test]
async fn routes_by_body_model_whatever_the_content_type() {
    let a = MockUpstream::start(|_| ok_chat()).await;
    let b = MockUpstream::start(|_| ok_chat()).await;
    let visor = Visor::start(&format!(
        "[[upstream]]\nname=\"a\"\nbase_url=\"{}/v1\"\nmodels=[\"gpt-*\"]\n\
         [[upstream]]\nname=\"b\"\nbase_url=\"{}/v1\"\nmodels=[\"echo-*\"]\n",
        a.url(),
        b.url()
    ))
    .await;
    let url = visor.url("/v1/embeddings");
    let body = r#"{"model":"echo-route","input":"a"}"#;
    let with = |ct: Option<&str>, body: &'static [u8]| {
        let mut r = Request::post(&url).header("authorization", "Bearer K");
        if let Some(ct) = ct {
            r = r.header("content-type", ct);
        }
        r.body(Full::new(Bytes::from_static(body))).unwrap()
    };
    let body: &'static [u8] = body.as_bytes();
    for ct in [
        Some("application/x-www-form-urlencoded"),
        Some("APPLICATION/JSON"),
        Some("text/plain"),
        None,
    ] {
        let (status, _, _) = send(with(ct, body)).await;
        assert_eq!(status, 200, "{ct:?}");
    }
    assert_eq!(b.count(), 4);
    assert_eq!(a.count(), 0, "the key reached the wrong upstream");

    // Not JSON, or a model that is not a string: 400, sent nowhere.
    for bad in [
        &b"model=echo-route&input=a"[..],
        b"{\"input\":\"a\",",
        br#"{"model":null,"input":"a"}"#,
        br#"{"model":["echo-x"]}"#,
    ] {
        let (status, _, resp) = send(with(Some("text/plain"), bad)).await;
        assert_eq!(status, 400, "{}", String::from_utf8_lossy(bad));
        assert!(
            ["model_unreadable"].contains(&error_code(&resp).as_str()),
            "{}",
            String::from_utf8_lossy(&resp)
        );
    }
    assert_eq!(a.count() + b.count(), 4);

    // A multipart form routes by its `model` field.
    let form = b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF....\r\n--B\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\necho-whisper\r\n--B--\r\n";
    let (status, _, _) = send(
        Request::post(visor.url("/v1/audio/transcriptions"))
            .header("content-type", "multipart/form-data; boundary=B")
            .body(Full::new(Bytes::from_static(form)))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(b.count(), 5);
    assert_eq!(b.recorded()[4].body, &form[..]);
    // No model at all (an empty body): the first upstream.
    let (status, _, _) = send(with(None, b"")).await;
    assert_eq!(status, 200);
    assert_eq!(a.count(), 1);

    // A transformed endpoint refuses `model: null` and invalid UTF-8.
    for bad in [
        &br#"{"model":null,"messages":[]}"#[..],
        b"{\"model\":\"gpt-4o\",\"messages\":[{\"role\":\"user\",\"content\":\"\xc0\xae\"}]}",
    ] {
        let (status, _, resp) = send(post_json(&visor.url("/v1/chat/completions"), bad)).await;
        assert_eq!(status, 400);
        assert_eq!(error_code(&resp), "invalid_json");
    }
    assert_eq!(a.count() + b.count(), 6);
}

/// An upstream that answers HTTP/1.0 (an old server, a script) does not
/// make visor answer its own client so: the client's connection stays
/// HTTP/1.1 and is kept for the next request.
#[tokio::test]
async fn an_upstream_answering_http_1_0_leaves_the_client_on_http_1_1() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                // One request (its head and body), one HTTP/1.0 answer, closed.
                let mut got = Vec::new();
                let mut chunk = [0u8; 4096];
                while !got.windows(4).any(|w| w == b"\r\n\r\n") || !got.ends_with(b"}") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&chunk[..n]),
                    }
                }
                let body = r#"{"id":"c1","object":"chat.completion","choices":[]}"#;
                let answer = format!(
                    "HTTP/1.0 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(answer.as_bytes()).await;
            });
        }
    });
    let visor = Visor::start(&format!(
        "[[upstream]]\nname = \"old\"\nbase_url = \"http://127.0.0.1:{port}/v1\"\n"
    ))
    .await;
    let mut s = TcpStream::connect(visor.addr).await.unwrap();
    let body = r#"{"model":"m","messages":[]}"#;
    for turn in 0..2 {
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(request.as_bytes()).await.unwrap();
        // The head, then its content-length body, within the bound.
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        let read = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            loop {
                if let Some(len) = http_message_len(&got) {
                    return String::from_utf8_lossy(&got[..len]).to_ascii_lowercase();
                }
                match s.read(&mut chunk).await {
                    Ok(0) | Err(_) => return String::from_utf8_lossy(&got).into_owned(),
                    Ok(n) => got.extend_from_slice(&chunk[..n]),
                }
            }
        })
        .await
        .expect("an answer within the bound");
        assert!(read.starts_with("http/1.1 200"), "turn {turn}: {read}");
        assert!(!read.contains("connection: close"), "turn {turn}: {read}");
    }
}
