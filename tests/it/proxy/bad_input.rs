//! Bad input: each gets a clear OpenAI-shaped error, never a panic or a hang.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

const BOUND: Duration = Duration::from_secs(10);

async fn ok_mock() -> MockUpstream {
    MockUpstream::start(|_| Reply::json(200, r#"{"ok":true}"#)).await
}

/// Writes `head` (and optionally some body) on a raw socket and reads the
/// response visor sends back.
async fn raw(addr: std::net::SocketAddr, head: &str, body: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    if !body.is_empty() {
        let _ = s.write_all(body).await;
    }
    read_response(&mut s).await
}

/// Reads one HTTP/1.1 response — the head, then a `Content-Length` body —
/// from a raw socket, within the bound; what came if the socket closes first.
async fn read_response<R: AsyncReadExt + Unpin>(s: &mut R) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let _ = tokio::time::timeout(BOUND, async {
        loop {
            if let Some(len) = http_message_len(&buf) {
                buf.truncate(len);
                return;
            }
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    String::from_utf8_lossy(&buf).into_owned()
}

#[tokio::test]
async fn invalid_json_on_chat_completions_is_400_and_never_forwarded() {
    let mock = ok_mock().await;
    let visor = Visor::for_mock(&mock, "").await;
    for body in [
        &b"{\"model\":\"m\",\"messages\":["[..],
        b"not json at all",
        b"",
        b"[{\"model\":\"m\"}]",
        b"{\"model\":42}",
    ] {
        let got = post_chat(&visor, Bytes::copy_from_slice(body)).await;
        assert_error(&got, 400, "invalid_json");
    }
    assert_eq!(mock.count(), 0);
}

#[tokio::test]
async fn body_over_the_limit_is_413_without_reading_it() {
    let mock = ok_mock().await;
    let visor = Visor::for_mock(&mock, "").await;
    // Content-Length says 40 MB; visor answers before a single body byte.
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        40 * 1024 * 1024
    );
    let resp = raw(visor.addr, &head, b"").await;
    assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
    assert!(resp.contains("\"code\":\"body_too_large\""), "{resp}");
    assert_eq!(mock.count(), 0);
}

#[tokio::test]
async fn chunked_body_over_the_limit_is_413_on_every_endpoint() {
    let mock = ok_mock().await;
    let visor = Visor::for_mock(&mock, "[server]\nmax_body_bytes = 1048576\n").await;
    for path in ["/v1/chat/completions", "/v1/files"] {
        let mut s = TcpStream::connect(visor.addr).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let (mut rd, mut wr) = s.into_split();
        // 40 MB in 64 KB chunks; visor may stop reading at any point.
        let writer = tokio::spawn(async move {
            let chunk = vec![b'a'; 64 * 1024];
            for _ in 0..640 {
                let framed =
                    [format!("{:x}\r\n", chunk.len()).as_bytes(), &chunk, b"\r\n"].concat();
                if wr.write_all(&framed).await.is_err() {
                    return;
                }
            }
            let _ = wr.write_all(b"0\r\n\r\n").await;
        });
        let resp = read_response(&mut rd).await;
        assert!(resp.starts_with("HTTP/1.1 413"), "{path}: {resp}");
        assert!(resp.contains("body_too_large"), "{path}: {resp}");
        writer.abort();
    }
}

#[tokio::test]
async fn dot_segments_absolute_targets_and_unknown_prefixes_are_refused() {
    let mock = ok_mock().await;
    let visor = Visor::for_mock(&mock, "").await;
    for path in [
        "/v1/../admin",
        "/v1/%2e%2e/secrets",
        "/v1/chat/%2E%2E/%2e%2e/x",
    ] {
        let resp = raw(
            visor.addr,
            &format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n"),
            b"",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 400"), "{path}: {resp}");
        assert!(resp.contains("invalid_request"), "{resp}");
    }
    let resp = raw(
        visor.addr,
        "GET http://169.254.169.254/latest/meta-data HTTP/1.1\r\nhost: 169.254.169.254\r\n\r\n",
        b"",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    let resp = raw(
        visor.addr,
        "CONNECT evil.example:443 HTTP/1.1\r\nhost: evil.example:443\r\n\r\n",
        b"",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    let (status, _, body) = send(
        Request::get(visor.url("/v2/models"))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(error_code(&body), "unknown_url");
    assert_eq!(mock.count(), 0, "nothing may reach the upstream");
}

#[tokio::test]
async fn a_model_no_upstream_matches_is_404() {
    let mock = ok_mock().await;
    let visor = Visor::start(&format!(
        "[[upstream]]\nname=\"only-gpt\"\nbase_url=\"{}/v1\"\nmodels=[\"gpt-*\"]\n",
        mock.url()
    ))
    .await;
    let got = post_chat(&visor, r#"{"model":"llama-3-70b","messages":[]}"#).await;
    let text = assert_error(&got, 404, "model_not_found");
    assert!(text.contains("llama-3-70b"), "{text}");
    assert_eq!(mock.count(), 0);
    // Counted under the model as requested (no upstream).
    let m = visor.metrics().await;
    assert_eq!(
        metric(
            &m,
            "visor_requests_total",
            &[
                ("upstream", "none"),
                ("model", "llama-3-70b"),
                ("status", "404")
            ]
        ),
        Some(1.0),
        "{m}"
    );
}

#[tokio::test]
async fn a_closed_upstream_port_is_502() {
    let mock = MockUpstream::builder()
        .fault(Fault::RefuseConnect)
        .start()
        .await;
    let visor = Visor::start(&mock.upstream_toml("dead")).await;
    let text = assert_error(&post_chat(&visor, CHAT).await, 502, "upstream_unreachable");
    assert!(
        text.contains("`dead` is unreachable: connection refused"),
        "{text}"
    );
    let m = visor.metrics().await;
    assert_eq!(
        metric(
            &m,
            "visor_upstream_errors_total",
            &[("upstream", "dead"), ("kind", "connect")]
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m,
            "visor_requests_total",
            &[("upstream", "dead"), ("status", "502")]
        ),
        Some(1.0)
    );
}

/// Paused time (one worker, so all of visor runs on the test's clock): the
/// 504 comes at the 10 s deadline, at no cost.
#[tokio::test(start_paused = true)]
async fn an_upstream_that_never_answers_is_504() {
    let mock = MockUpstream::builder()
        .fault(Fault::NeverAnswer)
        .start()
        .await;
    let visor = Visor::for_mock(
        &mock,
        "[server]\nworkers = 1\nfirst_byte_timeout_secs = 10\n",
    )
    .await;
    let started = Instant::now();
    assert_error(&post_chat(&visor, CHAT).await, 504, "upstream_timeout");
    assert_at(started.elapsed(), Duration::from_secs(10));
    // The abandoned upstream request is closed, not left hanging.
    assert!(mock.wait_closed(1, BOUND).await);
    assert_eq!(
        upstream_errors(&visor, "first_byte_timeout").await,
        Some(1.0)
    );
}

#[tokio::test]
async fn an_upstream_that_closes_without_answering_is_502() {
    let mock = MockUpstream::builder()
        .fault(Fault::CloseBeforeHead)
        .start()
        .await;
    let visor = Visor::start(&mock.upstream_toml("rude")).await;
    let text = assert_error(&post_chat(&visor, CHAT).await, 502, "upstream_unreachable");
    assert!(text.contains("closed before a response"), "{text}");
    // It did read the request before it closed.
    assert_eq!(mock.count(), 1);
}

#[tokio::test]
async fn odd_but_valid_requests_still_pass() {
    let mock = ok_mock().await;
    let visor = Visor::for_mock(&mock, "").await;
    // No model, unicode, huge numbers, deep nesting: forwarded as is.
    let deep = format!(
        "{{\"messages\":{}1{},\"x\":\"é😀\",\"n\":1e400}}",
        "[".repeat(100),
        "]".repeat(100)
    );
    let (status, _, _) = post_chat(&visor, deep.clone()).await;
    assert_eq!(status, 200);
    assert_eq!(mock.recorded()[0].body, deep.as_bytes());
    // Nesting far deeper than any recursion limit: validated without
    // recursion, so no stack overflow, and forwarded as is.
    let deeper = format!("{{\"m\":{}1{}}}", "[".repeat(100_000), "]".repeat(100_000));
    let (status, _, _) = post_chat(&visor, deeper.clone()).await;
    assert_eq!(status, 200);
    assert_eq!(mock.recorded()[1].body, deeper.as_bytes());
}

/// Paused time: the 408 comes at the 5 s deadline, at no cost.
#[tokio::test(start_paused = true)]
async fn a_body_that_never_finishes_arriving_is_408() {
    let mock = ok_mock().await;
    let visor = Visor::for_mock(&mock, "[server]\nworkers = 1\nrequest_timeout_secs = 5\n").await;
    let started = Instant::now();
    // Promise 100 bytes, send 10, then wait.
    let mut s = TcpStream::connect(visor.addr).await.unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":",
    )
    .await
    .unwrap();
    let resp = read_response(&mut s).await;
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
    assert!(resp.contains("request_timeout"), "{resp}");
    assert_at(started.elapsed(), Duration::from_secs(5));
    assert_eq!(mock.count(), 0);
}

#[tokio::test]
async fn expect_100_continue_is_answered_by_visor_and_not_forwarded() {
    let mock = ok_mock().await;
    let visor = Visor::for_mock(&mock, "").await;
    let body = br#"{"model":"m","messages":[]}"#;
    let mut s = TcpStream::connect(visor.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nexpect: 100-continue\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let interim = read_response(&mut s).await;
    assert!(interim.starts_with("HTTP/1.1 100 Continue"), "{interim}");
    s.write_all(body).await.unwrap();
    let resp = read_response(&mut s).await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let rec = mock.recorded().pop().unwrap();
    assert!(rec.headers.get("expect").is_none());
    assert_eq!(rec.body, Bytes::from_static(body));
}

/// A client that goes away mid-upload on a body visor streams (here:
/// promises 1000 bytes, sends 28, closes its side) is the client's doing:
/// counted as a 400 of visor's, not as an upstream that broke.
#[tokio::test]
async fn a_client_that_abandons_its_upload_is_not_an_upstream_failure() {
    let mock = ok_mock().await;
    let visor = Visor::for_mock(&mock, "").await;
    let mut s = TcpStream::connect(visor.addr).await.unwrap();
    s.write_all(
        b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"model\":\"m\",\"input\":\"abc",
    )
    .await
    .unwrap();
    s.shutdown().await.unwrap();
    let resp = read_response(&mut s).await;
    assert!(
        resp.is_empty() || resp.starts_with("HTTP/1.1 400"),
        "{resp}"
    );
    // Counted once the request is over: wait for it, bounded.
    let deadline = Instant::now() + BOUND;
    let m = loop {
        let m = visor.metrics().await;
        if m.contains("status=\"400\"") || Instant::now() > deadline {
            break m;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(
        metric(
            &m,
            "visor_requests_total",
            &[("upstream", "none"), ("status", "400")]
        ),
        Some(1.0),
        "{m}"
    );
    assert!(!m.contains("visor_upstream_errors_total{"), "{m}");
}
