//! The pooled HTTP client to providers, used by the proxy (and later the
//! describer): keep-alive connections, rustls (ring, webpki roots) for https,
//! HTTP/2 when the upstream offers it by ALPN, and a connect timeout.
//!
//! Two transports behind one [`Upstreams::send`]:
//! - `http://` upstreams (local inference servers, sidecars) use HTTP/1.1
//!   connections that are *driven by the request's own task*: the connection
//!   future is polled from the response body, so a response's bytes go from
//!   the upstream socket to the client socket without a hop between tasks,
//!   and chunks that arrived together leave together. Idle connections wait
//!   in a small pool per worker thread.
//! - `https://` upstreams use hyper-util's pooled client (TLS, ALPN h2/h1.1),
//!   whose connections run in their own tasks.

use std::error::Error as StdError;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::cell::RefCell;
use std::collections::HashMap;

use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tokio::time::Instant;

pub type BoxError = Box<dyn StdError + Send + Sync>;

/// Anthropic's credential header.
pub static X_API_KEY: http::HeaderName = http::HeaderName::from_static("x-api-key");

/// The upstream's own `api_key` as the header its `auth` mode names
/// (marked sensitive), when it has one.
pub fn own_credential(
    upstream: &crate::config::Upstream,
) -> Option<(http::HeaderName, http::HeaderValue)> {
    let key = upstream.api_key.as_ref()?;
    let (name, value) = match upstream.auth {
        crate::config::AuthMode::Bearer => (
            http::header::AUTHORIZATION,
            format!("Bearer {}", key.expose()),
        ),
        crate::config::AuthMode::XApiKey => (X_API_KEY.clone(), key.expose().to_owned()),
    };
    let mut v = http::HeaderValue::from_str(&value).ok()?;
    v.set_sensitive(true);
    Some((name, v))
}

/// The one client type: pooled, TLS-capable, over [`UpstreamBody`].
pub type UpstreamClient = Client<HttpsConnector<HttpConnector>, UpstreamBody>;

/// Builds a pooled TLS client trusting the webpki roots plus `extra_roots`.
pub fn client(
    connect_timeout: Duration,
    extra_roots: &[rustls::pki_types::CertificateDer<'static>],
) -> Result<UpstreamClient, rustls::Error> {
    let https = connector(connect_timeout, extra_roots, true)?;
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .build(https))
}

/// A pooled TLS client (webpki roots) for any body type: the one the
/// trace exporter sends with.
pub fn client_of<B>(
    connect_timeout: Duration,
) -> Result<Client<HttpsConnector<HttpConnector>, B>, rustls::Error>
where
    B: Body + Send + 'static + Unpin,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let https = connector(connect_timeout, &[], true)?;
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .build(https))
}

/// The TCP (+ TLS for https) connector: ALPN h2 and http/1.1, or only
/// http/1.1 (`h2 = false`: WebSocket connections).
fn connector(
    connect_timeout: Duration,
    extra_roots: &[rustls::pki_types::CertificateDer<'static>],
    h2: bool,
) -> Result<HttpsConnector<HttpConnector>, rustls::Error> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(connect_timeout));
    http.set_nodelay(true);
    http.set_keepalive(Some(Duration::from_secs(60)));
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    for cert in extra_roots {
        roots.add(cert.clone())?;
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1();
    Ok(if h2 {
        builder.enable_http2().wrap_connector(http)
    } else {
        builder.wrap_connector(http)
    })
}

/// A raw connection to an upstream (TLS for https), as a Tokio stream: what
/// a WebSocket runs over.
pub type RawConn = TokioIo<hyper_rustls::MaybeHttpsStream<TokioIo<TcpStream>>>;

/// A request body sent upstream: the chunks visor already read (all of a
/// body it had to hold, or the first ones, scanned for the model), then the
/// rest of the client's body streamed through with the `max_body_bytes`
/// limit enforced as it passes.
#[derive(Default)]
pub struct UpstreamBody {
    pub prefix: std::collections::VecDeque<Bytes>,
    pub rest: Option<LimitedBody>,
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(b) = this.prefix.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        match &mut this.rest {
            Some(r) => Pin::new(r).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_empty() && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let held: u64 = self.prefix.iter().map(|b| b.len() as u64).sum();
        let inner = match &self.rest {
            Some(r) => r.size_hint(),
            None => SizeHint::with_exact(0),
        };
        // Upper first: a fresh hint's lower bound is 0, so neither setter
        // can see lower > upper.
        let mut hint = SizeHint::new();
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(held));
        }
        hint.set_lower(inner.lower().saturating_add(held));
        hint
    }
}

/// The body limit was crossed while streaming a request body upstream.
#[derive(Debug, thiserror::Error)]
#[error("request body exceeds the configured limit")]
pub struct BodyLimitExceeded;

/// A client's request body as the proxy takes it: hyper's, read from a
/// socket, or any other body (a request built in process, e.g. a test
/// calling the service stack with `tower::ServiceExt::oneshot`).
pub enum RequestBody {
    Incoming(Incoming),
    Other(http_body_util::combinators::BoxBody<Bytes, BoxError>),
}

impl RequestBody {
    /// Any body of bytes.
    pub fn new<B>(body: B) -> Self
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        use http_body_util::BodyExt as _;
        RequestBody::Other(body.map_err(Into::into).boxed())
    }
}

impl From<Incoming> for RequestBody {
    fn from(b: Incoming) -> Self {
        RequestBody::Incoming(b)
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            RequestBody::Incoming(b) => Pin::new(b)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(Into::into))),
            RequestBody::Other(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Incoming(b) => b.is_end_stream(),
            RequestBody::Other(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Incoming(b) => b.size_hint(),
            RequestBody::Other(b) => b.size_hint(),
        }
    }
}

/// What went wrong with the client's streamed body, if anything: shared by
/// the body and the proxy, so a send that failed because of the client
/// (too large: 413; broken off) is told apart from a broken upstream.
#[derive(Debug, Default)]
pub struct BodyState(AtomicU8);

const BODY_EXCEEDED: u8 = 1;
const BODY_BROKEN: u8 = 2;

impl BodyState {
    /// More than `max_body_bytes` came.
    pub fn exceeded(&self) -> bool {
        self.0.load(Ordering::Relaxed) == BODY_EXCEEDED
    }

    /// The client's body broke off (it went away mid-upload).
    pub fn broken(&self) -> bool {
        self.0.load(Ordering::Relaxed) == BODY_BROKEN
    }

    /// The first thing that went wrong, if any.
    fn failure(&self) -> Option<SendFailure> {
        match self.0.load(Ordering::Relaxed) {
            BODY_EXCEEDED => Some(SendFailure::BodyTooLarge),
            BODY_BROKEN => Some(SendFailure::ClientBody),
            _ => None,
        }
    }

    fn set(&self, what: u8) {
        let _ = self
            .0
            .compare_exchange(0, what, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// The client's body, streamed, failing once more than `remaining` bytes
/// pass; what went wrong is told in its [`BodyState`].
pub struct LimitedBody {
    inner: RequestBody,
    remaining: u64,
    state: Arc<BodyState>,
}

impl LimitedBody {
    pub fn new(inner: RequestBody, remaining: u64, state: Arc<BodyState>) -> Self {
        Self {
            inner,
            remaining,
            state,
        }
    }
}

impl Body for LimitedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    let len = data.len() as u64;
                    if len > self.remaining {
                        self.state.set(BODY_EXCEEDED);
                        return Poll::Ready(Some(Err(Box::new(BodyLimitExceeded))));
                    }
                    self.remaining -= len;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                self.state.set(BODY_BROKEN);
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Why a request to an upstream failed before its response head arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendFailure {
    /// TCP/TLS connect refused, unreachable, or DNS failed.
    Connect,
    /// The connect timeout passed.
    ConnectTimeout,
    /// The connection broke after it was made (reset, closed early).
    Reset,
    /// The client's body went over `max_body_bytes` while streaming.
    BodyTooLarge,
    /// The client's body broke off while streaming (the client went away).
    ClientBody,
}

impl SendFailure {
    fn default_cause(self) -> &'static str {
        match self {
            SendFailure::Connect => "connection failed",
            SendFailure::ConnectTimeout => "timed out",
            SendFailure::Reset => "connection closed before a response",
            SendFailure::BodyTooLarge => "request body too large",
            SendFailure::ClientBody => "the client's request body broke off",
        }
    }
}

/// A short fixed description of why a connection failed, read from the
/// error chain (never the error's own text, which may hold anything).
pub fn cause_of(err: &(dyn StdError + 'static)) -> &'static str {
    use std::io::ErrorKind;
    let mut source: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(e) = source {
        if e.is::<rustls::Error>() {
            return "TLS handshake failed (certificate not trusted, or TLS error)";
        }
        if let Some(h) = e.downcast_ref::<hyper::Error>()
            && (h.is_incomplete_message() || h.is_closed() || h.is_canceled())
        {
            return "connection closed before a response";
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            match io.kind() {
                ErrorKind::ConnectionRefused => return "connection refused",
                ErrorKind::ConnectionReset => return "connection reset",
                ErrorKind::ConnectionAborted => return "connection aborted",
                ErrorKind::TimedOut => return "timed out",
                ErrorKind::UnexpectedEof => return "connection closed before a response",
                _ => {}
            }
            if io.to_string().contains("lookup address") {
                return "DNS lookup failed";
            }
            // An io::Error's source() skips the error it wraps; look inside.
            if let Some(inner) = io.get_ref() {
                source = Some(inner);
                continue;
            }
        }
        let text = e.to_string();
        if text.contains("dns error") || text.contains("lookup address") {
            return "DNS lookup failed";
        }
        source = e.source();
    }
    "connection failed"
}

/// Sorts a client error into a [`SendFailure`].
pub fn classify(err: &hyper_util::client::legacy::Error, body: &BodyState) -> SendFailure {
    if let Some(f) = body.failure() {
        return f;
    }
    let mut timed_out = false;
    let mut source: Option<&(dyn StdError + 'static)> = err.source();
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::TimedOut
        {
            timed_out = true;
        }
        if e.is::<BodyLimitExceeded>() {
            return SendFailure::BodyTooLarge;
        }
        source = e.source();
    }
    if err.is_connect() {
        if timed_out || format!("{err:?}").contains("timed out") {
            SendFailure::ConnectTimeout
        } else {
            SendFailure::Connect
        }
    } else {
        SendFailure::Reset
    }
}

// ------------------------------------------------------------------ transport

/// Idle inline connections kept per upstream.
const MAX_IDLE_PER_UPSTREAM: usize = 512;
/// An idle connection older than this is closed instead of reused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// An HTTP/1.1 connection whose driver is polled by whoever holds it.
struct InlineConn {
    tx: http1::SendRequest<UpstreamBody>,
    conn: http1::Connection<TokioIo<TcpStream>, UpstreamBody>,
}

impl InlineConn {
    /// Lets the connection make progress (read, write, notice a close).
    /// Returns false once the connection has ended.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        Pin::new(&mut self.conn).poll(cx).is_pending()
    }

    /// True when a pooled connection can take a request now.
    fn usable(&mut self) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        self.drive(&mut cx) && matches!(self.tx.poll_ready(&mut cx), Poll::Ready(Ok(())))
    }
}

/// Idle inline connections. Each worker thread keeps its own: a connection
/// is registered with the I/O driver of the runtime that opened it, so it is
/// only ever reused on that thread (no wake-ups across threads, and nothing
/// left pointing at a worker that has shut down).
struct Pool {
    /// Tells this client's connections from another's (tests run several
    /// visors in one process).
    id: u64,
}

type IdleKey = (u64, usize);

thread_local! {
    static IDLE: RefCell<HashMap<IdleKey, Vec<(InlineConn, Instant)>>> =
        RefCell::new(HashMap::new());
}

impl Pool {
    fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Self {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
        }
    }

    fn checkout(&self, index: usize) -> Option<InlineConn> {
        IDLE.with_borrow_mut(|idle| {
            let list = idle.get_mut(&(self.id, index))?;
            while let Some((mut c, since)) = list.pop() {
                if since.elapsed() < IDLE_TIMEOUT && c.usable() {
                    return Some(c);
                }
            }
            None
        })
    }

    fn checkin(&self, index: usize, mut c: InlineConn) {
        if !c.usable() {
            return;
        }
        IDLE.with_borrow_mut(|idle| {
            let list = idle.entry((self.id, index)).or_default();
            if list.len() < MAX_IDLE_PER_UPSTREAM {
                list.push((c, Instant::now()));
            }
        });
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // This thread's idle connections of this client; other threads' go
        // when those threads end.
        let id = self.id;
        let _ = IDLE.try_with(|idle| idle.borrow_mut().retain(|(pool, _), _| *pool != id));
    }
}

/// An upstream's base URL split once, at startup.
struct Target {
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    /// The base path without a trailing slash (`/v1`, or empty).
    base_path: String,
}

impl Target {
    fn new(base: &Uri) -> Option<Self> {
        Some(Self {
            scheme: base.scheme()?.clone(),
            authority: base.authority()?.clone(),
            base_path: base.path().trim_end_matches('/').to_owned(),
        })
    }

    /// `base_url` + the path after `/v1` + the query, as sent by the client.
    fn uri(&self, rest: &str, query: Option<&str>) -> Option<Uri> {
        let mut pq = String::with_capacity(self.base_path.len() + rest.len() + 64);
        pq.push_str(&self.base_path);
        pq.push_str(rest);
        if pq.is_empty() {
            pq.push('/');
        }
        if let Some(q) = query {
            pq.push('?');
            pq.push_str(q);
        }
        let pq = http::uri::PathAndQuery::try_from(pq).ok()?;
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(pq)
            .build()
            .ok()
    }
}

/// Where one upstream is reached.
enum Route {
    /// `http://host:port`: inline HTTP/1.1 connections to this address.
    Plain {
        authority: String,
        host: http::HeaderValue,
    },
    /// `https://…`: the pooled TLS client.
    Tls,
}

/// The client to every upstream.
pub struct Upstreams {
    /// One per upstream; those without a `ca_file` share one client (and
    /// its connection pool).
    tls: Vec<UpstreamClient>,
    /// One per upstream: HTTP/1.1-only connectors for WebSockets.
    raw: Vec<HttpsConnector<HttpConnector>>,
    pool: Arc<Pool>,
    connect_timeout: Duration,
    /// One per upstream: its base URL, split once.
    targets: Vec<Target>,
    /// One per upstream: how it is reached (plain HTTP/1.1 inline, or TLS).
    routes: Vec<Route>,
}

/// What a failed send tells.
pub struct Failed {
    pub failure: SendFailure,
    /// A short, fixed description of the cause, for the error message.
    pub cause: &'static str,
}

impl Upstreams {
    pub fn new(
        connect_timeout: Duration,
        upstreams: &[crate::config::Upstream],
    ) -> Result<Self, String> {
        let tls_error = |e: rustls::Error| format!("TLS client: {e}");
        let targets = upstreams
            .iter()
            .map(|u| {
                Target::new(&u.base_url)
                    .ok_or_else(|| format!("upstream {}: base_url has no host", u.name))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let routes = upstreams
            .iter()
            .map(
                |u| match (u.base_url.scheme_str(), u.base_url.authority()) {
                    (Some("http"), Some(a)) => Ok(Route::Plain {
                        authority: match a.port_u16() {
                            Some(_) => a.as_str().to_owned(),
                            None => format!("{}:80", a.host()),
                        },
                        host: http::HeaderValue::from_str(a.as_str())
                            .map_err(|_| format!("upstream {}: invalid host", u.name))?,
                    }),
                    _ => Ok(Route::Tls),
                },
            )
            .collect::<Result<Vec<_>, String>>()?;
        let shared = client(connect_timeout, &[]).map_err(tls_error)?;
        let tls = upstreams
            .iter()
            .map(|u| {
                if u.ca_certs.is_empty() {
                    Ok(shared.clone())
                } else {
                    client(connect_timeout, &u.ca_certs)
                }
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(tls_error)?;
        let raw = upstreams
            .iter()
            .map(|u| connector(connect_timeout, &u.ca_certs, false))
            .collect::<Result<Vec<_>, _>>()
            .map_err(tls_error)?;
        Ok(Self {
            tls,
            raw,
            pool: Arc::new(Pool::new()),
            connect_timeout,
            targets,
            routes,
        })
    }

    /// Upstream `index`'s `base_url` + the path after `/v1` + the query, as
    /// the client sent them; `None` when that is no valid URI.
    pub fn uri(&self, index: usize, rest: &str, query: Option<&str>) -> Option<Uri> {
        self.targets.get(index)?.uri(rest, query)
    }

    /// Opens a connection of its own to upstream `index` at `uri`'s host
    /// (http or https), within the connect timeout: for a WebSocket.
    pub async fn connect_raw(&self, index: usize, uri: http::Uri) -> Result<RawConn, SendFailure> {
        use tower::Service as _;
        let Some(connector) = self.raw.get(index) else {
            return Err(SendFailure::Connect);
        };
        let mut connector = connector.clone();
        match tokio::time::timeout(self.connect_timeout, connector.call(uri)).await {
            Ok(Ok(stream)) => Ok(TokioIo::new(stream)),
            Ok(Err(e)) => {
                tracing::debug!(
                    cause = cause_of(e.as_ref()),
                    "websocket upstream connect failed"
                );
                Err(SendFailure::Connect)
            }
            Err(_) => Err(SendFailure::ConnectTimeout),
        }
    }

    /// Sends `req` (absolute URI) to upstream `index` and waits for the
    /// response head. `body` tells what the client's body did.
    pub async fn send(
        &self,
        index: usize,
        req: Request<UpstreamBody>,
        body: &BodyState,
    ) -> Result<Response<ResponseBody>, Failed> {
        let Some(route) = self.routes.get(index) else {
            return Err(Failed {
                failure: SendFailure::Connect,
                cause: "no such upstream",
            });
        };
        match route {
            Route::Tls => match self.tls[index].request(req).await {
                Ok(resp) => Ok(resp.map(|body| ResponseBody::new(body, None))),
                Err(e) => Err(Failed {
                    failure: classify(&e, body),
                    cause: cause_of(&e),
                }),
            },
            Route::Plain { authority, host } => {
                self.send_inline(index, authority, host, req, body).await
            }
        }
    }

    async fn send_inline(
        &self,
        index: usize,
        authority: &str,
        host: &http::HeaderValue,
        mut req: Request<UpstreamBody>,
        body: &BodyState,
    ) -> Result<Response<ResponseBody>, Failed> {
        // Origin-form target and a Host header, as a client library would.
        if let Some(pq) = req.uri().path_and_query().cloned() {
            *req.uri_mut() = http::Uri::from(pq);
        }
        req.headers_mut().insert(http::header::HOST, host.clone());
        let fail = |failure: SendFailure| Failed {
            failure,
            cause: failure.default_cause(),
        };
        // A pooled connection may have been closed by the upstream a moment
        // ago; a request it never took is retried once on a new connection.
        let mut req = Some(req);
        for attempt in 0..2 {
            let Some(r) = req.take() else { break };
            let idle = if attempt == 0 {
                self.pool.checkout(index)
            } else {
                None
            };
            let (mut conn, pooled) = match idle {
                Some(c) => (c, true),
                None => (self.connect(authority).await?, false),
            };
            let mut sending = std::pin::pin!(conn.tx.try_send_request(r));
            let result = std::future::poll_fn(|cx| {
                let _ = conn.drive(cx);
                sending.as_mut().poll(cx)
            })
            .await;
            match result {
                Ok(resp) => {
                    let pool = self.pool.clone();
                    return Ok(resp
                        .map(|body| ResponseBody::new(body, Some(Inline { conn, pool, index }))));
                }
                Err(mut e) => {
                    if let Some(f) = body.failure() {
                        return Err(fail(f));
                    }
                    match e.take_message() {
                        Some(unsent) if pooled => req = Some(unsent),
                        _ => {
                            return Err(Failed {
                                failure: SendFailure::Reset,
                                cause: cause_of(e.error()),
                            });
                        }
                    }
                }
            }
        }
        Err(fail(SendFailure::Reset))
    }

    async fn connect(&self, authority: &str) -> Result<InlineConn, Failed> {
        let connecting = TcpStream::connect(authority);
        let stream = match tokio::time::timeout(self.connect_timeout, connecting).await {
            Err(_) => {
                return Err(Failed {
                    failure: SendFailure::ConnectTimeout,
                    cause: "timed out",
                });
            }
            Ok(Err(e)) => {
                let failure = if e.kind() == std::io::ErrorKind::TimedOut {
                    SendFailure::ConnectTimeout
                } else {
                    SendFailure::Connect
                };
                return Err(Failed {
                    failure,
                    cause: cause_of(&e),
                });
            }
            Ok(Ok(s)) => s,
        };
        let _ = stream.set_nodelay(true);
        let (tx, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| Failed {
                failure: SendFailure::Reset,
                cause: cause_of(&e),
            })?;
        Ok(InlineConn { tx, conn })
    }
}

/// The inline connection a response body drives, and where it goes back.
struct Inline {
    conn: InlineConn,
    pool: Arc<Pool>,
    index: usize,
}

/// An upstream response body. Polling it drives its connection (inline
/// transport); read to its end, the connection goes back to the pool.
/// Merging ready frames for the client is a step of its own
/// (`proxy::coalesce`).
pub struct ResponseBody {
    body: Incoming,
    inline: Option<Inline>,
}

impl ResponseBody {
    fn new(body: Incoming, inline: Option<Inline>) -> Self {
        Self { body, inline }
    }

    /// The body ended cleanly: its connection can serve the next request.
    fn release(&mut self) {
        if let Some(mut i) = self.inline.take() {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            let _ = i.conn.drive(&mut cx);
            i.pool.checkin(i.index, i.conn);
        }
    }
}

impl Drop for ResponseBody {
    fn drop(&mut self) {
        // A body read to its end gives its connection back; one dropped
        // early (the client left) closes it, cancelling the upstream request.
        if self.body.is_end_stream() {
            self.release();
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(i) = this.inline.as_mut() {
            let _ = i.conn.drive(cx);
        }
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if this.body.is_end_stream() {
                    // hyper may not poll a finished body again.
                    this.release();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.inline = None; // a broken connection is not reused
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(None) => {
                this.release();
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_joins_base_path_rest_and_query() {
        let t = Target::new(&Uri::from_static("https://api.example.com/v1")).unwrap();
        assert_eq!(
            t.uri("/chat/completions", None).unwrap(),
            "https://api.example.com/v1/chat/completions"
        );
        assert_eq!(
            t.uri("/models", Some("limit=2&after=x")).unwrap(),
            "https://api.example.com/v1/models?limit=2&after=x"
        );
        let root = Target::new(&Uri::from_static("http://127.0.0.1:9000")).unwrap();
        assert_eq!(
            root.uri("/embeddings", None).unwrap(),
            "http://127.0.0.1:9000/embeddings"
        );
        assert_eq!(root.uri("", None).unwrap(), "http://127.0.0.1:9000/");
    }
}
