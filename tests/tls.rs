//! https upstreams: rustls, HTTP/2 negotiated by ALPN, a private CA trusted
//! through `ca_file`, and certificate checks that refuse an unknown CA.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

const BOUND: std::time::Duration = std::time::Duration::from_secs(5);

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, Version};
use http_body_util::{BodyExt, Either, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::*;

struct TlsMock {
    addr: SocketAddr,
    ca_file: std::path::PathBuf,
    versions: Arc<Mutex<Vec<Version>>>,
    connections: Arc<AtomicUsize>,
    /// Streams the mock was still sending when the client side went away.
    cancelled: Arc<AtomicUsize>,
    cancelled_notify: Arc<tokio::sync::Notify>,
}

/// One SSE event, then silence until dropped; counts the drop.
struct HangBody {
    sent: bool,
    cancelled: Arc<AtomicUsize>,
    notify: Arc<tokio::sync::Notify>,
}

impl http_body::Body for HangBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        if self.sent {
            return std::task::Poll::Pending;
        }
        self.sent = true;
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"first\"}}]}\n\n",
        )))))
    }
}

impl Drop for HangBody {
    fn drop(&mut self) {
        self.cancelled.fetch_add(1, Ordering::SeqCst);
        self.notify.notify_waiters();
    }
}

/// An https mock with its own CA; answers JSON, or SSE when asked to stream.
async fn tls_mock() -> TlsMock {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let ca_file = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "mock-ca-{}-{}.pem",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::write(&ca_file, ca.pem()).unwrap();

    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
    )
    .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let versions = Arc::new(Mutex::new(Vec::new()));
    let connections = Arc::new(AtomicUsize::new(0));
    let cancelled = Arc::new(AtomicUsize::new(0));
    let cancelled_notify = Arc::new(tokio::sync::Notify::new());
    let (v, c) = (versions.clone(), connections.clone());
    let (x, xn) = (cancelled.clone(), cancelled_notify.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (acceptor, v) = (acceptor.clone(), v.clone());
            let (x, xn) = (x.clone(), xn.clone());
            c.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(stream).await else {
                    return;
                };
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let v = v.clone();
                    let (x, xn) = (x.clone(), xn.clone());
                    async move {
                        v.lock().unwrap().push(req.version());
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let stream = body.windows(13).any(|w| w == b"\"stream\":true");
                        let hang = body.windows(14).any(|w| w == b"\"model\":\"hang\"");
                        let resp = if hang {
                            Response::builder()
                                .header("content-type", "text/event-stream")
                                .body(Either::Right(HangBody {
                                    sent: false,
                                    cancelled: x,
                                    notify: xn,
                                }))
                                .unwrap()
                        } else if stream {
                            Response::builder()
                                .header("content-type", "text/event-stream")
                                .body(Either::Left(Full::new(Bytes::from_static(
                                    b"data: {\"choices\":[{\"delta\":{\"content\":\"secure\"}}]}\n\ndata: [DONE]\n\n",
                                ))))
                                .unwrap()
                        } else {
                            Response::builder()
                                .header("content-type", "application/json")
                                .body(Either::Left(Full::new(Bytes::from_static(
                                    br#"{"ok":"tls"}"#,
                                ))))
                                .unwrap()
                        };
                        Ok::<_, Infallible>(resp)
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    TlsMock {
        addr,
        ca_file,
        versions,
        connections,
        cancelled,
        cancelled_notify,
    }
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(0u8)
}

#[tokio::test]
async fn https_upstream_with_private_ca_speaks_http2_and_reuses_the_connection() {
    let mock = tls_mock().await;
    let visor = Visor::start(&format!(
        "[[upstream]]\nname=\"secure\"\nbase_url=\"https://localhost:{}/v1\"\nca_file=\"{}\"\n",
        mock.addr.port(),
        mock.ca_file.display()
    ))
    .await;
    let (status, _, body) = send(post_json(
        &visor.url("/v1/chat/completions"),
        r#"{"model":"m","messages":[]}"#,
    ))
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(body, Bytes::from_static(br#"{"ok":"tls"}"#));
    let (status, headers, body) = send(post_json(
        &visor.url("/v1/chat/completions"),
        r#"{"model":"m","stream":true,"messages":[]}"#,
    ))
    .await;
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
        *mock.versions.lock().unwrap(),
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
    let visor = Visor::start(&format!(
        "[[upstream]]\nname=\"secure\"\nbase_url=\"https://localhost:{}/v1\"\nca_file=\"{}\"\n",
        mock.addr.port(),
        mock.ca_file.display()
    ))
    .await;
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
    assert!(String::from_utf8_lossy(&first).contains("first"));
    assert_eq!(mock.cancelled.load(Ordering::SeqCst), 0);
    drop(body); // the client leaves
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let notified = mock.cancelled_notify.notified();
        if mock.cancelled.load(Ordering::SeqCst) == 1 {
            break;
        }
        assert!(
            tokio::time::timeout_at(deadline, notified).await.is_ok(),
            "the upstream HTTP/2 stream was not reset after the client left"
        );
    }
    assert_eq!(*mock.versions.lock().unwrap(), vec![Version::HTTP_2]);
}

#[tokio::test]
async fn an_untrusted_certificate_is_refused_with_502() {
    let mock = tls_mock().await;
    // No ca_file: only the public webpki roots are trusted.
    let visor = Visor::start(&format!(
        "[[upstream]]\nname=\"secure\"\nbase_url=\"https://localhost:{}/v1\"\n",
        mock.addr.port()
    ))
    .await;
    let (status, _, body) = send(post_json(
        &visor.url("/v1/chat/completions"),
        r#"{"model":"m","messages":[]}"#,
    ))
    .await;
    assert_eq!(status, 502);
    assert_eq!(error_code(&body), "upstream_unreachable");
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("TLS handshake failed"), "{text}");
    assert!(mock.versions.lock().unwrap().is_empty());
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
