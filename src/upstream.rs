//! The pooled HTTP client to providers, used by the proxy (and later the
//! describer): keep-alive connections, rustls (ring, webpki roots) for https,
//! HTTP/2 when the upstream offers it by ALPN, and a connect timeout.

use std::error::Error as StdError;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

pub type BoxError = Box<dyn StdError + Send + Sync>;

/// The one client type: pooled, TLS-capable, over [`UpstreamBody`].
pub type UpstreamClient = Client<HttpsConnector<HttpConnector>, UpstreamBody>;

/// Builds the pooled client.
pub fn client(connect_timeout: Duration) -> Result<UpstreamClient, rustls::Error> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(connect_timeout));
    http.set_nodelay(true);
    http.set_keepalive(Some(Duration::from_secs(60)));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())?
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .build(https))
}

/// A request body sent upstream: either bytes visor holds (a body it read to
/// route or rewrite), or the client's body streamed through with the
/// `max_body_bytes` limit enforced as it passes.
pub enum UpstreamBody {
    /// Held bytes, sent as one frame.
    Full(Option<Bytes>),
    /// Chunks already read (to find the model) followed by the rest of the
    /// client's body.
    Stream {
        prefix: std::collections::VecDeque<Bytes>,
        rest: Option<LimitedIncoming>,
    },
}

impl UpstreamBody {
    pub fn full(bytes: Bytes) -> Self {
        UpstreamBody::Full(Some(bytes))
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            UpstreamBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            UpstreamBody::Stream { prefix, rest } => {
                if let Some(b) = prefix.pop_front() {
                    return Poll::Ready(Some(Ok(Frame::data(b))));
                }
                match rest {
                    Some(r) => Pin::new(r).poll_frame(cx),
                    None => Poll::Ready(None),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Full(b) => b.is_none(),
            UpstreamBody::Stream { prefix, rest } => {
                prefix.is_empty() && rest.as_ref().is_none_or(|r| r.is_end_stream())
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            UpstreamBody::Full(None) => SizeHint::with_exact(0),
            UpstreamBody::Stream { prefix, rest } => {
                let held: u64 = prefix.iter().map(|b| b.len() as u64).sum();
                let inner = match rest {
                    Some(r) => r.size_hint(),
                    None => SizeHint::with_exact(0),
                };
                // Upper first: a fresh hint's lower bound is 0, so neither
                // setter can see lower > upper.
                let mut hint = SizeHint::new();
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper.saturating_add(held));
                }
                hint.set_lower(inner.lower().saturating_add(held));
                hint
            }
        }
    }
}

/// The body limit was crossed while streaming a request body upstream.
#[derive(Debug, thiserror::Error)]
#[error("request body exceeds the configured limit")]
pub struct BodyLimitExceeded;

/// The client's body, streamed, failing once more than `remaining` bytes pass.
/// `exceeded` lets the proxy tell "too large" (413) from a broken upstream.
pub struct LimitedIncoming {
    inner: Incoming,
    remaining: u64,
    exceeded: Arc<AtomicBool>,
}

impl LimitedIncoming {
    pub fn new(inner: Incoming, remaining: u64, exceeded: Arc<AtomicBool>) -> Self {
        Self {
            inner,
            remaining,
            exceeded,
        }
    }
}

impl Body for LimitedIncoming {
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
                        self.exceeded.store(true, Ordering::Relaxed);
                        return Poll::Ready(Some(Err(Box::new(BodyLimitExceeded))));
                    }
                    self.remaining -= len;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(e)))),
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
}

impl SendFailure {
    pub fn label(self) -> &'static str {
        match self {
            SendFailure::Connect => "connect",
            SendFailure::ConnectTimeout => "connect_timeout",
            SendFailure::Reset => "reset",
            SendFailure::BodyTooLarge => "body_too_large",
        }
    }
}

/// Sorts a client error into a [`SendFailure`].
pub fn classify(err: &hyper_util::client::legacy::Error, body_exceeded: bool) -> SendFailure {
    if body_exceeded {
        return SendFailure::BodyTooLarge;
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
