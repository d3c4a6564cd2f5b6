//! https upstreams: rustls, HTTP/2 negotiated by ALPN, a private CA trusted
//! through `ca_file`, and certificate checks that refuse an unknown CA.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

const BOUND: std::time::Duration = std::time::Duration::from_secs(5);

use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::{Request, Version};
use http_body_util::Full;
use support::*;

/// An https mock with its own CA; answers JSON, SSE when asked to stream,
/// and for the model `hang` one event and then silence.
async fn tls_mock() -> MockUpstream {
    MockUpstream::builder()
        .tls()
        .reply(|r| {
            let stream = r.body.windows(13).any(|w| w == b"\"stream\":true");
            let hang = r.body.windows(14).any(|w| w == b"\"model\":\"hang\"");
            if hang {
                Reply::stall_after(1)
            } else if stream {
                Reply::sse_chunks(vec![Chunk::Data(Bytes::from_static(
                    b"data: {\"choices\":[{\"delta\":{\"content\":\"secure\"}}]}\n\ndata: [DONE]\n\n",
                ))])
            } else {
                Reply::json(200, r#"{"ok":"tls"}"#)
            }
        })
        .start()
        .await
}

fn versions(mock: &MockUpstream) -> Vec<Version> {
    mock.recorded().iter().map(|r| r.version).collect()
}

#[tokio::test]
async fn https_upstream_with_private_ca_speaks_http2_and_reuses_the_connection() {
    let mock = tls_mock().await;
    let visor = Visor::for_mock(&mock, "").await;
    let (status, _, body) = post_chat(&visor, CHAT).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(body, Bytes::from_static(br#"{"ok":"tls"}"#));
    let (status, headers, body) =
        post_chat(&visor, r#"{"model":"m","stream":true,"messages":[]}"#).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "text/event-stream");
    assert!(body.ends_with(b"data: [DONE]\n\n"));
    let (status, _, _) = send(
        Request::get(visor.url("/v1/models"))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        versions(&mock),
        vec![Version::HTTP_2; 3],
        "ALPN should pick HTTP/2"
    );
    assert_eq!(
        mock.connections.load(Ordering::SeqCst),
        1,
        "one pooled TLS connection"
    );
}

#[tokio::test]
async fn a_client_leaving_mid_stream_resets_the_https_upstream_stream() {
    let mock = tls_mock().await;
    let visor = Visor::for_mock(&mock, "").await;
    let req = post_json(
        &visor.url("/v1/chat/completions"),
        r#"{"model":"hang","stream":true,"messages":[]}"#,
    );
    let resp = tokio::time::timeout(BOUND, client().request(req))
        .await
        .unwrap()
        .unwrap();
    let mut body = resp.into_body();
    let first = next_data(&mut body, BOUND).await.unwrap().unwrap();
    assert_eq!(first, sse_event(0));
    assert_eq!(mock.cancelled.load(Ordering::SeqCst), 0);
    drop(body); // the client leaves
    assert!(
        mock.wait_cancelled(1, BOUND).await,
        "the upstream HTTP/2 stream was not reset after the client left"
    );
    assert_eq!(versions(&mock), vec![Version::HTTP_2]);
    // Reset, not closed: the pooled connection stays.
    assert_eq!(mock.closed.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn an_untrusted_certificate_is_refused_with_502() {
    let mock = MockUpstream::builder()
        .fault(Fault::UntrustedTls)
        .start()
        .await;
    // No ca_file: only the public webpki roots are trusted.
    assert!(mock.ca_file.is_none());
    let visor = Visor::for_mock(&mock, "").await;
    let text = assert_error(&post_chat(&visor, CHAT).await, 502, "upstream_unreachable");
    assert!(text.contains("TLS handshake failed"), "{text}");
    assert!(mock.connections.load(Ordering::SeqCst) >= 1);
    assert_eq!(mock.count(), 0);
}

#[test]
fn a_bad_ca_file_is_a_config_error() {
    let e = visor::config::Config::from_toml(
        "[[upstream]]\nname=\"x\"\nbase_url=\"https://x\"\nca_file=\"/nonexistent/ca.pem\"\n",
        std::path::Path::new("t.toml"),
        &|_| None,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("upstream[0].ca_file: \"/nonexistent/ca.pem\" — cannot read"),
        "{e}"
    );
}
