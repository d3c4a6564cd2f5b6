//! Test support: a scriptable mock upstream and an in-process visor, both on
//! real loopback sockets (port 0), plus a small HTTP client.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

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
        // Tests that shut down do not wait for load balancers.
        if !toml.contains("drain_delay_secs") {
            cfg.server.drain_delay = Duration::ZERO;
        }
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
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn fixture(name: &str) -> Bytes {
    Bytes::from(std::fs::read(fixtures().join(name)).unwrap_or_else(|e| panic!("{name}: {e}")))
}

// ------------------------------------------------------------ processes

pub fn visor() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_visor"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    c.env_remove("VISOR_CONFIG");
    c
}

pub fn temp_config(name: &str, text: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join(format!("{name}-{}.toml", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

/// A `visor serve` child process, its log lines, and its address.
pub struct Serving {
    pub child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    /// Lines read so far.
    pub log: Vec<String>,
    pub addr: String,
}

impl Serving {
    /// Starts `visor serve --listen 127.0.0.1:0 ARGS` and waits (bounded)
    /// for its "listening" line.
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Serving {
        let mut cmd = visor();
        cmd.args(["serve", "--listen", "127.0.0.1:0"])
            .args(args)
            .stderr(Stdio::piped())
            .stdout(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut log = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut addr = None;
        while addr.is_none() {
            let Ok(line) = lines.recv_timeout(deadline.saturating_duration_since(Instant::now()))
            else {
                let _ = child.kill();
                panic!("visor did not report listening:\n{}", log.join("\n"));
            };
            if line.contains("visor listening") {
                addr = line
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("addr="))
                    .map(str::to_owned);
            }
            log.push(line);
        }
        Serving {
            child,
            lines,
            log,
            addr: addr.unwrap_or_default(),
        }
    }

    /// Sends SIGTERM and waits (bounded) for the exit; returns its code and
    /// every log line.
    pub fn terminate(mut self) -> (Option<i32>, String) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(20);
        // The reader thread ends when the process closes stderr.
        while let Ok(line) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            self.log.push(line);
        }
        let code = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s.code();
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        (code, self.log.join("\n"))
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ------------------------------------------------------------------ redis

/// A `redis-server` of this test's own on 127.0.0.1, stopped on drop.
pub struct RedisServer {
    child: std::process::Child,
    pub port: u16,
}

impl RedisServer {
    /// Starts one and waits (bounded) until it answers PING. Without
    /// `redis-server` installed: `None` and a printed reason, except under
    /// CI (`CI=true`), where `.ci/run` installed it and a skip would hide
    /// untested code — then it panics.
    pub fn start() -> Option<RedisServer> {
        let found = Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("redis-server is not installed, and under CI=true Redis tests may not skip");
            }
            eprintln!(
                "SKIPPED: redis-server is not installed (apt-get install redis-server); the Redis tests did not run"
            );
            return None;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Self::spawn(port);
        let server = RedisServer { child, port };
        server.wait_ready();
        Some(server)
    }

    fn spawn(port: u16) -> std::process::Child {
        Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.answers() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer PING within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills it (its data goes with it).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts it again on the same port and waits until it answers.
    pub fn restart(&mut self) {
        self.child = Self::spawn(self.port);
        self.wait_ready();
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    fn answers(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        let mut buf = [0u8; 7];
        s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// -------------------------------------------------------------- describer

/// The describer model the describe tests configure.
pub const DESCRIBER: &str = "vision-mini";

/// `describe` mode with the mock as describer (its first upstream); more
/// `[describer]` keys may follow.
pub const DESCRIBE: &str =
    "[images]\nnon_vision = \"describe\"\n[describer]\nmodel = \"vision-mini\"\n";

/// A chat completion answer.
pub fn chat_ok() -> Reply {
    Reply::json(
        200,
        r#"{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}"#,
    )
}

/// True when `req` is a describer call (its model is [`DESCRIBER`]).
pub fn is_describer_call(req: &Recorded) -> bool {
    serde_json::from_slice::<serde_json::Value>(&req.body).is_ok_and(|v| v["model"] == DESCRIBER)
}

/// The one image URL a describer call carries.
pub fn described_url(req: &Recorded) -> String {
    let v: serde_json::Value = serde_json::from_slice(&req.body).unwrap();
    let parts = v["messages"][1]["content"].as_array().unwrap();
    let images: Vec<_> = parts.iter().filter(|p| p["type"] == "image_url").collect();
    assert_eq!(images.len(), 1, "one image per describer call");
    images[0]["image_url"]["url"].as_str().unwrap().to_owned()
}

/// What the mock describer says about an image: derived from the bytes it
/// was sent (decoded from the data URL), or from the URL.
pub fn description_for(url: &str) -> String {
    match url
        .strip_prefix("data:")
        .and_then(|r| r.split_once(";base64,"))
    {
        Some((media_type, b64)) => {
            let bytes = base64_simd::STANDARD.decode_to_vec(b64).unwrap();
            let sha = sha256_hex(&bytes);
            format!(
                "A test image ({media_type}, {} bytes, {}): the chart says \"42%\".",
                bytes.len(),
                &sha[..16]
            )
        }
        None => format!("The picture at {url}."),
    }
}

/// The mock describer's answer to a describer call.
pub fn describer_answer(req: &Recorded) -> Reply {
    let text = description_for(&described_url(req));
    let body = serde_json::json!({
        "id": "d1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
    });
    Reply::json(200, body.to_string())
}

pub fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(b)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A Chat request for `model` whose user message holds these image URLs.
pub fn chat_with_images(model: &str, urls: &[String]) -> Bytes {
    let mut content = vec![serde_json::json!({"type": "text", "text": "What is in these?"})];
    for u in urls {
        content.push(serde_json::json!({"type": "image_url", "image_url": {"url": u}}));
    }
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
    });
    Bytes::from(serde_json::to_vec(&body).unwrap())
}

/// A PNG data URL: the fixture chart with `salt` appended (a new image,
/// same header, so the same size is read from it).
pub fn png_data_url(salt: &str) -> (String, Vec<u8>) {
    let mut png = std::fs::read(fixtures().join("chart.png")).unwrap();
    png.extend_from_slice(salt.as_bytes());
    let url = format!(
        "data:image/png;base64,{}",
        base64_simd::STANDARD.encode_to_string(&png)
    );
    (url, png)
}

/// The texts of the user message's parts in a forwarded Chat body.
pub fn user_texts(body: &[u8]) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap();
    let msgs = v["messages"].as_array().unwrap();
    let user = msgs.iter().rev().find(|m| m["role"] == "user").unwrap();
    match &user["content"] {
        serde_json::Value::String(s) => vec![s.clone()],
        serde_json::Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str().map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    }
}

/// Waits (bounded) until `cond` holds on visor's metrics text.
pub async fn wait_metrics(visor: &Visor, bound: Duration, cond: impl Fn(&str) -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        let m = visor.metrics().await;
        if cond(&m) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
