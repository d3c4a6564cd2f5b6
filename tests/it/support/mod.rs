//! Test support: a scriptable mock upstream and an in-process visor, both on
//! real loopback sockets (port 0), plus a small HTTP client.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod anthropic_cache;
pub mod pdf_build;
pub mod webdriver;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, oneshot};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request as the mock received it.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: http::Method,
    pub uri: http::Uri,
    pub version: http::Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// One piece of a scripted response body.
pub enum Chunk {
    Data(Bytes),
    /// Break the response here (the connection is cut mid-body).
    Fail,
    /// Say nothing more and keep the stream open, until the client side
    /// goes away (the mock counts it in `cancelled`).
    Stall,
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
    /// Close without answering: over HTTP/1 the connection closes before a
    /// byte of the response; over HTTP/2 the stream is reset.
    Close,
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

    /// A 200 SSE stream of `n` events ([`sse_event`] `0..n`), then `end`.
    fn events_then(n: usize, end: Chunk) -> Reply {
        let mut chunks: Vec<_> = (0..n).map(|i| Chunk::Data(sse_event(i))).collect();
        chunks.push(end);
        Reply::sse_chunks(chunks)
    }

    /// [`Fault::CutAfterChunks`] as one answer.
    pub fn cut_after(n: usize) -> Reply {
        Reply::events_then(n, Chunk::Fail)
    }

    /// [`Fault::StallAfterChunks`] as one answer.
    pub fn stall_after(n: usize) -> Reply {
        Reply::events_then(n, Chunk::Stall)
    }
}

/// The `i`th event of a scripted SSE stream: a Chat chunk whose delta is
/// `t{i}`.
pub fn sse_event(i: usize) -> Bytes {
    Bytes::from(format!(
        "data: {{\"choices\":[{{\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n"
    ))
}

/// A fault the mock upstream plays, by name (see [`MockUpstream::builder`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Nothing listens on the mock's port (it stays bound, so nothing else
    /// takes it while the mock lives): every connection is refused.
    RefuseConnect,
    /// Reads each request, then closes the connection before a byte of the
    /// response.
    CloseBeforeHead,
    /// Reads each request and never answers; the connection stays open.
    NeverAnswer,
    /// Answers every request with this status and JSON body.
    Status(u16, &'static str),
    /// A 200 SSE stream of `n` events ([`sse_event`] `0..n`), then the
    /// connection is cut mid-body.
    CutAfterChunks(usize),
    /// A 200 SSE stream of `n` events, then silence: the stream stays open
    /// until the client side goes away (counted in `cancelled`).
    StallAfterChunks(usize),
    /// Answers each request whole (the handler's [`Reply::Full`]) and then
    /// closes the connection without saying so (no `Connection: close`).
    CloseAfterResponse,
    /// https on a self-signed certificate that nobody trusts: every TLS
    /// handshake fails, no request is read.
    UntrustedTls,
}

impl Fault {
    /// The answer this fault gives each request, for the faults that are an
    /// answer.
    fn reply(self) -> Option<Reply> {
        match self {
            Fault::CloseBeforeHead => Some(Reply::Close),
            Fault::NeverAnswer => Some(Reply::Hang),
            Fault::Status(status, body) => Some(Reply::json(status, body)),
            Fault::CutAfterChunks(n) => Some(Reply::cut_after(n)),
            Fault::StallAfterChunks(n) => Some(Reply::stall_after(n)),
            Fault::RefuseConnect | Fault::CloseAfterResponse | Fault::UntrustedTls => None,
        }
    }
}

type Handler = Arc<dyn Fn(&Recorded) -> Reply + Send + Sync>;

/// What the mock saw, shared with its connection tasks.
#[derive(Clone, Default)]
struct Book {
    requests: Arc<Mutex<Vec<Recorded>>>,
    connections: Arc<AtomicUsize>,
    closed: Arc<AtomicUsize>,
    cancelled: Arc<AtomicUsize>,
    /// Woken on every change above.
    changed: Arc<Notify>,
}

impl Book {
    fn count(&self, counter: &AtomicUsize) {
        counter.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    fn record(&self, rec: Recorded) {
        self.requests.lock().unwrap().push(rec);
        self.changed.notify_waiters();
    }
}

/// Counts a connection's close when its task ends (the socket is dropped
/// with it).
struct CountsClose(Book);

impl Drop for CountsClose {
    fn drop(&mut self) {
        self.0.count(&self.0.closed);
    }
}

/// Counts a response body dropped before its end (the client side left).
struct Unfinished(Option<Book>);

impl Unfinished {
    fn finish(&mut self) {
        self.0 = None;
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some(book) = self.0.take() {
            book.count(&book.cancelled);
        }
    }
}

/// A mock upstream on 127.0.0.1:0: plain HTTP/1.1, or https (h2 or
/// http/1.1 by ALPN); answers as its handler or its [`Fault`] says.
pub struct MockUpstream {
    pub addr: SocketAddr,
    pub requests: Arc<Mutex<Vec<Recorded>>>,
    pub connections: Arc<AtomicUsize>,
    pub closed: Arc<AtomicUsize>,
    /// Response bodies dropped before their end: the client side left (or
    /// reset its HTTP/2 stream).
    pub cancelled: Arc<AtomicUsize>,
    /// The CA of an https mock made with [`MockBuilder::tls`].
    pub ca_file: Option<PathBuf>,
    https: bool,
    changed: Arc<Notify>,
    _stop: Option<oneshot::Sender<()>>,
    /// [`Fault::RefuseConnect`]: the port, bound and never listened on.
    _bound: Option<tokio::net::TcpSocket>,
}

/// Builds a [`MockUpstream`]: `MockUpstream::builder().fault(..).start()`.
#[derive(Default)]
pub struct MockBuilder {
    handler: Option<Handler>,
    fault: Option<Fault>,
    tls: bool,
}

impl MockBuilder {
    /// Answers each request as `handler` says (without: [`chat_ok`]).
    pub fn reply(mut self, handler: impl Fn(&Recorded) -> Reply + Send + Sync + 'static) -> Self {
        self.handler = Some(Arc::new(handler));
        self
    }

    /// Plays `fault`. A fault that is an answer (a status, a cut or stalled
    /// stream, no answer, a close before the head) is every request's.
    pub fn fault(mut self, fault: Fault) -> Self {
        self.fault = Some(fault);
        self
    }

    /// https with a CA of its own, written to `ca_file` (which
    /// [`MockUpstream::upstream_toml`] passes on to visor).
    pub fn tls(mut self) -> Self {
        self.tls = true;
        self
    }

    pub async fn start(self) -> MockUpstream {
        let book = Book::default();
        let mut mock = MockUpstream {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            requests: book.requests.clone(),
            connections: book.connections.clone(),
            closed: book.closed.clone(),
            cancelled: book.cancelled.clone(),
            ca_file: None,
            https: self.tls || self.fault == Some(Fault::UntrustedTls),
            changed: book.changed.clone(),
            _stop: None,
            _bound: None,
        };
        if self.fault == Some(Fault::RefuseConnect) {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(mock.addr).unwrap();
            mock.addr = socket.local_addr().unwrap();
            mock._bound = Some(socket);
            return mock;
        }
        let handler: Handler = match self.fault {
            Some(fault) if fault.reply().is_some() => Arc::new(move |_| fault.reply().unwrap()),
            _ => self.handler.unwrap_or_else(|| Arc::new(|_| chat_ok())),
        };
        let acceptor = if mock.https {
            let (acceptor, ca_file) = tls_acceptor(self.tls);
            mock.ca_file = ca_file;
            Some(acceptor)
        } else {
            None
        };
        let close_after_response = self.fault == Some(Fault::CloseAfterResponse);
        let listener = TcpListener::bind(mock.addr).await.unwrap();
        mock.addr = listener.local_addr().unwrap();
        let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
        mock._stop = Some(stop_tx);
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    a = listener.accept() => match a { Ok((s, _)) => s, Err(_) => continue },
                    _ = &mut stop_rx => return,
                };
                book.count(&book.connections);
                let (h, book, acceptor) = (handler.clone(), book.clone(), acceptor.clone());
                tokio::spawn(async move {
                    let _close = CountsClose(book.clone());
                    if close_after_response {
                        return answer_then_close(stream, &h, &book).await;
                    }
                    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let (h, book) = (h.clone(), book.clone());
                        async move { answer(req, &h, &book).await }
                    });
                    match acceptor {
                        None => {
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), svc)
                                .await;
                        }
                        Some(acceptor) => {
                            let Ok(tls) = acceptor.accept(stream).await else {
                                return;
                            };
                            let _ =
                                hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                                    .serve_connection(TokioIo::new(tls), svc)
                                    .await;
                        }
                    }
                });
            }
        });
        mock
    }
}

/// A TLS acceptor for `localhost` and 127.0.0.1, offering h2 and http/1.1.
/// `trusted`: its certificate is signed by a CA of its own, whose file is
/// returned; otherwise it is self-signed and no client trusts it.
fn tls_acceptor(trusted: bool) -> (tokio_rustls::TlsAcceptor, Option<PathBuf>) {
    let names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(names).unwrap();
    let (cert, ca_file) = if trusted {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
        let ca_file = temp_dir("mock-ca").join("ca.pem");
        std::fs::write(&ca_file, ca.pem()).unwrap();
        (params.signed_by(&key, &ca).unwrap(), Some(ca_file))
    } else {
        (params.self_signed(&key).unwrap(), None)
    };
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
    (tokio_rustls::TlsAcceptor::from(Arc::new(config)), ca_file)
}

impl MockUpstream {
    /// A plain HTTP/1.1 mock answering as `handler` says.
    pub async fn start(handler: impl Fn(&Recorded) -> Reply + Send + Sync + 'static) -> Self {
        MockUpstream::builder().reply(handler).start().await
    }

    pub fn builder() -> MockBuilder {
        MockBuilder::default()
    }

    /// `http://127.0.0.1:PORT`, or `https://localhost:PORT` for an https mock.
    pub fn url(&self) -> String {
        if self.https {
            format!("https://localhost:{}", self.addr.port())
        } else {
            format!("http://{}", self.addr)
        }
    }

    /// An `[[upstream]]` named `name` for this mock (`base_url` its `/v1`,
    /// and its CA file when it has one); `models` and more keys may follow.
    pub fn upstream_toml(&self, name: &str) -> String {
        let mut toml = format!(
            "[[upstream]]\nname = \"{name}\"\nbase_url = \"{}/v1\"\n",
            self.url()
        );
        if let Some(ca) = &self.ca_file {
            toml.push_str(&format!("ca_file = \"{}\"\n", ca.display()));
        }
        toml
    }

    pub fn recorded(&self) -> Vec<Recorded> {
        self.requests.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.requests.lock().unwrap().len()
    }

    /// Waits (bounded) until `n` connections to the mock have closed.
    pub async fn wait_closed(&self, n: usize, bound: Duration) -> bool {
        self.wait_count(&self.closed, n, bound).await
    }

    /// Waits (bounded) until the mock has received `n` requests.
    pub async fn wait_requests(&self, n: usize, bound: Duration) -> bool {
        wait_for(bound, || self.count() >= n, &self.changed).await
    }

    /// Waits (bounded) until `n` response bodies were dropped before their
    /// end.
    pub async fn wait_cancelled(&self, n: usize, bound: Duration) -> bool {
        self.wait_count(&self.cancelled, n, bound).await
    }

    async fn wait_count(&self, counter: &AtomicUsize, n: usize, bound: Duration) -> bool {
        wait_for(bound, || counter.load(Ordering::SeqCst) >= n, &self.changed).await
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

type MockBody = UnsyncBoxBody<Bytes, BoxError>;

/// A response body fed by the test, piece by piece.
fn channel_body(rx: mpsc::Receiver<Chunk>, book: &Book) -> MockBody {
    let state = (rx, Unfinished(Some(book.clone())));
    let frames = futures_util::stream::unfold(state, |(mut rx, mut end)| async move {
        // "Not yet" once before each piece, so hyper flushes what it has
        // before the next one (a scripted failure included) is taken: each
        // piece really goes out on its own.
        tokio::task::yield_now().await;
        match rx.recv().await {
            Some(Chunk::Data(b)) => Some((Ok(Frame::data(b)), (rx, end))),
            Some(Chunk::Fail) => {
                end.finish();
                Some((Err(BoxError::from("scripted failure")), (rx, end)))
            }
            Some(Chunk::Stall) => std::future::pending().await,
            None => {
                end.finish();
                None
            }
        }
    });
    StreamBody::new(frames).boxed_unsync()
}

fn response(
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: MockBody,
) -> Response<MockBody> {
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::from_u16(status).unwrap();
    for (k, v) in headers {
        r.headers_mut().append(k, v.parse().unwrap());
    }
    r
}

async fn answer(
    req: Request<Incoming>,
    handler: &Handler,
    book: &Book,
) -> std::io::Result<Response<MockBody>> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let rec = Recorded {
        method: parts.method,
        uri: parts.uri,
        version: parts.version,
        headers: parts.headers,
        body,
    };
    let mut reply = handler(&rec);
    book.record(rec);
    while let Reply::After(wait, inner) = reply {
        tokio::time::sleep(wait).await;
        reply = *inner;
    }
    Ok(match reply {
        Reply::Full {
            status,
            headers,
            body,
        } => response(
            status,
            headers,
            Full::new(body).map_err(|e| match e {}).boxed_unsync(),
        ),
        Reply::Channel {
            status,
            headers,
            rx,
        } => response(status, headers, channel_body(rx, book)),
        Reply::Hang => std::future::pending().await,
        // hyper drops the connection (HTTP/1) or resets the stream (HTTP/2).
        Reply::Close => return Err(std::io::Error::other("scripted close")),
        Reply::After(..) => unreachable!("unwrapped above"),
    })
}

/// [`Fault::CloseAfterResponse`] on one raw connection: reads a request,
/// writes the handler's whole answer, and drops the socket.
async fn answer_then_close(mut stream: TcpStream, handler: &Handler, book: &Book) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let len = loop {
        if let Some(len) = http_message_len(&buf) {
            break len;
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let rec = parse_request(&buf[..len]);
    let reply = handler(&rec);
    book.record(rec);
    let Reply::Full {
        status,
        headers,
        body,
    } = reply
    else {
        panic!("Fault::CloseAfterResponse writes only a Reply::Full");
    };
    let mut out = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
    let mut out = out.into_bytes();
    out.extend_from_slice(&body);
    let _ = stream.write_all(&out).await;
    // Dropped: the connection closes, unannounced.
}

fn reason(status: u16) -> &'static str {
    StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Unknown")
}

/// One whole HTTP/1.1 request (head and `Content-Length` body) as recorded.
fn parse_request(raw: &[u8]) -> Recorded {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..end]);
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap().split(' ');
    let method = first.next().unwrap().parse().unwrap();
    let uri = first.next().unwrap().parse().unwrap();
    let mut headers = HeaderMap::new();
    for line in lines {
        let (k, v) = line.split_once(':').unwrap();
        headers.append(
            http::HeaderName::from_bytes(k.trim().as_bytes()).unwrap(),
            v.trim().parse().unwrap(),
        );
    }
    Recorded {
        method,
        uri,
        version: http::Version::HTTP_11,
        headers,
        body: Bytes::copy_from_slice(&raw[end + 4..]),
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
        // Documents are read by the visor binary in a child process, as
        // `visor serve` does (this process is the test harness).
        if cfg.documents.reader_binary.is_none() {
            cfg.documents.reader_binary = Some(PathBuf::from(env!("CARGO_BIN_EXE_visor")));
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
            "{extra}\n{}models = [\"*\"]\n",
            mock.upstream_toml("mock")
        ))
        .await
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn data_dir(&self) -> PathBuf {
        self.state.server.data_dir.clone()
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
/// `visor_prefix_reads_total{part}` of `visor`: (continued, full).
pub async fn prefix_reads(visor: &Visor, part: &str) -> (f64, f64) {
    let m = visor.metrics().await;
    let read = |r| {
        metric(
            &m,
            "visor_prefix_reads_total",
            &[("part", part), ("read", r)],
        )
    };
    (
        read("continued").unwrap_or(-1.0),
        read("full").unwrap_or(-1.0),
    )
}

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

/// visor's `visor_upstream_errors_total` of this `kind`, all upstreams.
pub async fn upstream_errors(visor: &Visor, kind: &str) -> Option<f64> {
    metric(
        &visor.metrics().await,
        "visor_upstream_errors_total",
        &[("kind", kind)],
    )
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

/// The smallest Chat request visor forwards.
pub const CHAT: &str = r#"{"model":"m","messages":[]}"#;

/// A streamed Chat request.
pub const CHAT_STREAM: &str =
    r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

/// POSTs `body` to visor's `/v1/chat/completions` and collects the answer.
pub async fn post_chat(visor: &Visor, body: impl Into<Bytes>) -> (StatusCode, HeaderMap, Bytes) {
    send(post_json(&visor.url("/v1/chat/completions"), body)).await
}

/// Asserts one of visor's own errors, `status` with `error.code` `code`;
/// returns the body as text.
pub fn assert_error(got: &(StatusCode, HeaderMap, Bytes), status: u16, code: &str) -> String {
    let text = String::from_utf8_lossy(&got.2).into_owned();
    assert_eq!(got.0, status, "{text}");
    assert_eq!(error_code(&got.2), code, "{text}");
    text
}

/// Opens a [`CHAT_STREAM`] request on a new client: the response head,
/// within 10 s.
pub async fn open_stream(visor: &Visor) -> Response<Incoming> {
    let req = post_json(&visor.url("/v1/chat/completions"), CHAT_STREAM);
    tokio::time::timeout(Duration::from_secs(10), client().request(req))
        .await
        .expect("response head within 10 s")
        .expect("request sent")
}

/// A mock whose first request gets an SSE stream fed through the returned
/// sender (each piece goes out the moment it is given, and nothing
/// before); later requests get [`chat_ok`].
pub async fn fed_once() -> (MockUpstream, mpsc::Sender<Chunk>) {
    let (tx, rx) = mpsc::channel(1);
    let rx = Mutex::new(Some(rx));
    let mock = MockUpstream::start(move |_| match rx.lock().unwrap().take() {
        Some(rx) => Reply::sse(rx),
        None => chat_ok(),
    })
    .await;
    (mock, tx)
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

/// The test's own bound in a paused-time test: virtual, so it costs nothing
/// and stays far above any deadline of visor's it waits for.
pub const PAUSED_BOUND: Duration = Duration::from_secs(600);

/// In paused time: `took` is `deadline` (within the 0.5 s visor's store
/// probe may add), not less and not much more.
pub fn assert_at(took: Duration, deadline: Duration) {
    assert!(
        took >= deadline && took <= deadline + Duration::from_millis(500),
        "took {took:?}, the deadline is {deadline:?}"
    );
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

/// Held while `target/tmp/py-venv` is made or installed into: the SDK test
/// and the client tests share that venv, and this process.
pub static PY_VENV: Mutex<()> = Mutex::new(());

/// An exclusive lock on `target/tmp/NAME.lock`, held until dropped:
/// nextest runs each test in a process of its own, and two processes
/// installing one environment at once each remove what the other wrote
/// (`npm ci` begins by deleting `node_modules`).
pub fn install_lock(name: &str) -> Result<std::fs::File, String> {
    let tmp = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(tmp).map_err(|e| e.to_string())?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(tmp.join(format!("{name}.lock")))
        .map_err(|e| e.to_string())?;
    file.lock().map_err(|e| e.to_string())?;
    Ok(file)
}

pub fn visor() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_visor"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    c.env_remove("VISOR_CONFIG");
    c
}

/// A config file of `text` under `target/tmp`, named after `name` and made
/// unique in this process (all the test files share it).
pub fn temp_config(name: &str, text: &str) -> PathBuf {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join(format!(
        "{name}-{}-{}.toml",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    ));
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
                // A text line (`addr=…`), or a JSON one (`"addr":"…"`).
                addr = match serde_json::from_str::<serde_json::Value>(&line) {
                    Ok(v) => v["fields"]["addr"].as_str().map(str::to_owned),
                    Err(_) => line
                        .split_whitespace()
                        .find_map(|w| w.strip_prefix("addr="))
                        .map(str::to_owned),
                };
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

impl RedisServer {
    /// Freezes it (SIGSTOP): connections stay open, nothing is answered.
    pub fn freeze(&self) {
        let _ = Command::new("kill")
            .args(["-STOP", &self.child.id().to_string()])
            .status();
    }

    /// Lets a frozen one go on (SIGCONT), its data as it was.
    pub fn resume(&self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        self.wait_ready();
    }
}
