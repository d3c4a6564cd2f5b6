//! Test support: a scriptable mock upstream and an in-process visor, both on
//! real loopback sockets (port 0), plus a small HTTP client.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, oneshot};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request as the mock received it.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: http::Method,
    pub uri: http::Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// One piece of a scripted response body.
pub enum Chunk {
    Data(Bytes),
    /// Break the response here (the connection is cut mid-body).
    Fail,
}

/// What the mock answers.
pub enum Reply {
    Full {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: Bytes,
    },
    /// Body pieces fed by the test through a channel: the mock sends each one
    /// the moment it is given, and nothing before.
    Channel {
        status: u16,
        headers: Vec<(&'static str, String)>,
        rx: mpsc::Receiver<Chunk>,
    },
    /// Accept the request and never answer.
    Hang,
    /// Wait, then answer as the inner reply does.
    After(Duration, Box<Reply>),
}

impl Reply {
    pub fn json(status: u16, body: impl Into<String>) -> Reply {
        Reply::Full {
            status,
            headers: vec![("content-type", "application/json".to_owned())],
            body: Bytes::from(body.into()),
        }
    }

    pub fn sse(rx: mpsc::Receiver<Chunk>) -> Reply {
        Reply::Channel {
            status: 200,
            headers: vec![("content-type", "text/event-stream".to_owned())],
            rx,
        }
    }

    /// An SSE stream whose pieces are all given up front.
    pub fn sse_chunks(chunks: Vec<Chunk>) -> Reply {
        let (tx, rx) = mpsc::channel(chunks.len().max(1));
        for c in chunks {
            let _ = tx.try_send(c);
        }
        Reply::sse(rx)
    }
}

type Handler = Arc<dyn Fn(&Recorded) -> Reply + Send + Sync>;

/// A mock upstream on 127.0.0.1:0.
pub struct MockUpstream {
    pub addr: SocketAddr,
    pub requests: Arc<Mutex<Vec<Recorded>>>,
    pub connections: Arc<AtomicUsize>,
    pub closed: Arc<AtomicUsize>,
    closed_notify: Arc<Notify>,
    received: Arc<Notify>,
    _stop: oneshot::Sender<()>,
}

impl MockUpstream {
    pub async fn start(handler: impl Fn(&Recorded) -> Reply + Send + Sync + 'static) -> Self {
        let handler: Handler = Arc::new(handler);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let closed_notify = Arc::new(Notify::new());
        let received = Arc::new(Notify::new());
        let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
        let (reqs, conns, clo, cn, rcv) = (
            requests.clone(),
            connections.clone(),
            closed.clone(),
            closed_notify.clone(),
            received.clone(),
        );
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
                    _ = &mut stop_rx => return,
                };
                conns.fetch_add(1, Ordering::SeqCst);
                let io = Tracked {
                    io: TokioIo::new(stream),
                    closed: clo.clone(),
                    notify: cn.clone(),
                };
                let (h, reqs, rcv) = (handler.clone(), reqs.clone(), rcv.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let (h, reqs, rcv) = (h.clone(), reqs.clone(), rcv.clone());
                        async move { Ok::<_, Infallible>(answer(req, h, reqs, rcv).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, svc)
                        .await;
                });
            }
        });
        MockUpstream {
            addr,
            requests,
            connections,
            closed,
            closed_notify,
            received,
            _stop: stop_tx,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn recorded(&self) -> Vec<Recorded> {
        self.requests.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.requests.lock().unwrap().len()
    }

    /// Waits (bounded) until `n` connections to the mock have closed.
    pub async fn wait_closed(&self, n: usize, bound: Duration) -> bool {
        wait_for(
            bound,
            || self.closed.load(Ordering::SeqCst) >= n,
            &self.closed_notify,
        )
        .await
    }

    /// Waits (bounded) until the mock has received `n` requests.
    pub async fn wait_requests(&self, n: usize, bound: Duration) -> bool {
        wait_for(bound, || self.count() >= n, &self.received).await
    }
}

async fn wait_for(bound: Duration, cond: impl Fn() -> bool, notify: &Notify) -> bool {
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        let notified = notify.notified();
        if cond() {
            return true;
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return cond();
        }
    }
}

type MockBody = http_body_util::Either<Full<Bytes>, ChannelBody>;

/// A response body fed by the test, piece by piece.
pub struct ChannelBody {
    rx: mpsc::Receiver<Chunk>,
    /// After each data frame the body says "not yet" once, so hyper flushes
    /// what it has before the next piece (a scripted failure included) is
    /// taken: each piece really goes out on its own.
    flushed: bool,
}

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if !self.flushed {
            self.flushed = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Chunk::Data(b))) => {
                self.flushed = false;
                Poll::Ready(Some(Ok(Frame::data(b))))
            }
            Poll::Ready(Some(Chunk::Fail)) => Poll::Ready(Some(Err("scripted failure".into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

async fn answer(
    req: Request<Incoming>,
    handler: Handler,
    reqs: Arc<Mutex<Vec<Recorded>>>,
    received: Arc<Notify>,
) -> Response<MockBody> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let rec = Recorded {
        method: parts.method,
        uri: parts.uri,
        headers: parts.headers,
        body,
    };
    let mut reply = handler(&rec);
    reqs.lock().unwrap().push(rec);
    received.notify_waiters();
    while let Reply::After(wait, inner) = reply {
        tokio::time::sleep(wait).await;
        reply = *inner;
    }
    match reply {
        Reply::Full {
            status,
            headers,
            body,
        } => {
            let mut r = Response::new(http_body_util::Either::Left(Full::new(body)));
            *r.status_mut() = StatusCode::from_u16(status).unwrap();
            for (k, v) in headers {
                r.headers_mut().append(k, v.parse().unwrap());
            }
            r
        }
        Reply::Channel {
            status,
            headers,
            rx,
        } => {
            let mut r = Response::new(http_body_util::Either::Right(ChannelBody {
                rx,
                flushed: false,
            }));
            *r.status_mut() = StatusCode::from_u16(status).unwrap();
            for (k, v) in headers {
                r.headers_mut().append(k, v.parse().unwrap());
            }
            r
        }
        Reply::Hang => std::future::pending().await,
        Reply::After(..) => unreachable!("unwrapped above"),
    }
}

/// The mock's side of a connection; counts the close when hyper drops it.
struct Tracked {
    io: TokioIo<TcpStream>,
    closed: Arc<AtomicUsize>,
    notify: Arc<Notify>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.closed.fetch_add(1, Ordering::SeqCst);
        self.notify.notify_waiters();
    }
}

impl hyper::rt::Read for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

// ------------------------------------------------------------------ visor

/// visor running in this process on 127.0.0.1:0.
pub struct Visor {
    pub addr: SocketAddr,
    pub state: Arc<visor::proxy::AppState>,
    stop: Option<oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    /// The data dir made for this visor, removed when it is dropped.
    own_dir: Option<PathBuf>,
}

impl Drop for Visor {
    fn drop(&mut self) {
        if let Some(dir) = self.own_dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl Visor {
    /// Starts visor with `toml`; `{mock}` in it is replaced by `mock_url`.
    pub async fn start(toml: &str) -> Visor {
        let mut cfg = visor::config::Config::from_toml(toml, Path::new("test.toml"), &|_| None)
            .unwrap_or_else(|e| panic!("test config: {e}"));
        // Each visor gets its own data dir under target/, unless the test
        // chose one (to restart on the same one).
        let mut own_dir = None;
        if cfg.server.data_dir == Path::new("var") {
            cfg.server.data_dir = temp_dir("data");
            own_dir = Some(cfg.server.data_dir.clone());
        }
        let server = visor::server::Server::bind(cfg, Some("127.0.0.1:0".parse().unwrap()))
            .await
            .unwrap();
        let addr = server.local_addr().unwrap();
        let state = server.state();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(async move {
            let _ = rx.await;
        }));
        Visor {
            addr,
            state,
            stop: Some(tx),
            task: Some(task),
            own_dir,
        }
    }

    /// A config forwarding everything to `mock`, plus `extra` TOML.
    pub async fn for_mock(mock: &MockUpstream, extra: &str) -> Visor {
        Visor::start(&format!(
            "{extra}\n[[upstream]]\nname = \"mock\"\nbase_url = \"{}/v1\"\nmodels = [\"*\"]\n",
            mock.url()
        ))
        .await
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn data_dir(&self) -> PathBuf {
        self.state.config.server.data_dir.clone()
    }

    /// Begins the graceful shutdown.
    pub fn shutdown(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }

    pub async fn metrics(&self) -> String {
        let (_, _, body) = send(
            Request::get(self.url("/metrics"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await;
        String::from_utf8(body.to_vec()).unwrap()
    }
}

/// A header-and-label match on a metrics line, returning its value.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .reduce(|a, b| a + b)
}

// ----------------------------------------------------------------- client

pub type Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
>;

pub fn client() -> Client {
    hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http()
}

/// Sends on a new client and collects: (status, headers, body).
pub async fn send(req: Request<Full<Bytes>>) -> (StatusCode, HeaderMap, Bytes) {
    send_on(&client(), req).await
}

/// Sends on `client` (keeping its connections) and collects.
pub async fn send_on(client: &Client, req: Request<Full<Bytes>>) -> (StatusCode, HeaderMap, Bytes) {
    let resp = tokio::time::timeout(Duration::from_secs(20), client.request(req))
        .await
        .expect("response within 20 s")
        .expect("request sent");
    let (parts, body) = resp.into_parts();
    let body = tokio::time::timeout(Duration::from_secs(20), body.collect())
        .await
        .expect("body within 20 s")
        .expect("body read")
        .to_bytes();
    (parts.status, parts.headers, body)
}

pub fn post_json(url: &str, body: impl Into<Bytes>) -> Request<Full<Bytes>> {
    Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(body.into()))
        .unwrap()
}

/// The next data frame of a streaming response, within `bound`.
/// `Ok(None)` at a clean end, `Err` when the stream was cut.
pub async fn next_data(body: &mut Incoming, bound: Duration) -> Result<Option<Bytes>, String> {
    loop {
        match tokio::time::timeout(bound, body.frame()).await {
            Err(_) => return Err("no frame within the bound".into()),
            Ok(None) => return Ok(None),
            Ok(Some(Err(e))) => return Err(format!("stream error: {e}")),
            Ok(Some(Ok(f))) => {
                if let Ok(d) = f.into_data() {
                    return Ok(Some(d));
                }
            }
        }
    }
}

/// Reads a streaming body to its end, each frame within `bound`: the bytes,
/// and how it ended (`Ok` clean, `Err` cut or stalled).
pub async fn read_stream(body: &mut Incoming, bound: Duration) -> (String, Result<(), String>) {
    let mut got = Vec::new();
    let end = loop {
        match next_data(body, bound).await {
            Ok(Some(d)) => got.extend_from_slice(&d),
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    (String::from_utf8_lossy(&got).into_owned(), end)
}

/// The length of the first complete HTTP/1.1 message in `buf` (head plus a
/// `Content-Length` body), or `None` while it is incomplete.
pub fn http_message_len(buf: &[u8]) -> Option<usize> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    (buf.len() >= end + 4 + len).then_some(end + 4 + len)
}

/// Asserts a stream was cut by visor (an error), not a stall of the test's
/// own bound and not a clean end.
pub fn assert_cut<T: std::fmt::Debug>(end: &Result<T, String>) {
    match end {
        Err(e) => assert!(!e.contains("bound"), "the stream stalled instead: {e}"),
        Ok(v) => panic!("the stream went on ({v:?}); it should have been cut"),
    }
}

/// The error body's `error.code`.
pub fn error_code(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "error body is not JSON ({e}): {}",
            String::from_utf8_lossy(body)
        )
    });
    assert!(v["error"]["message"].is_string(), "no error.message: {v}");
    assert!(v["error"]["type"].is_string(), "no error.type: {v}");
    v["error"]["code"].as_str().unwrap_or_default().to_owned()
}

/// A new, empty folder under `target/tmp`.
pub fn temp_dir(what: &str) -> PathBuf {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!(
        "target/tmp/{what}-{}-{}-{nanos}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures")
}

pub fn fixture(name: &str) -> Bytes {
    Bytes::from(std::fs::read(fixtures().join(name)).unwrap_or_else(|e| panic!("{name}: {e}")))
}
