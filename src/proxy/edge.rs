//! The one edge every proxied request leaves by, HTTP or WebSocket: visor's
//! own answers (a request that stopped before an upstream answer streams
//! back) are logged and counted here, once, and the error's label is the
//! metric label. An upstream answer that streams back is counted once when
//! its body ends ([`super::body::Finish`]); one read whole and passed back
//! ([`Edge::passed`]) and a WebSocket handshake an upstream refused
//! ([`Edge::refused_upgrade`]) here.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, header};
use tokio::time::Instant;

use super::body::ProxyBody;
use super::headers::for_the_client;
use crate::error::VisorError;
use crate::failure::UpstreamFailure;
use crate::metrics::{Metrics, NO_UPSTREAM};
use crate::transform::Report;
use crate::upstream::SendFailure;

/// Why a request stops before an upstream answer streams back.
pub enum Stop {
    /// Refused by visor itself: counted with no upstream.
    Refused(VisorError),
    /// The upstream failed: the error and its `visor_upstream_errors_total`
    /// kind; counted with the upstream.
    Upstream(VisorError, UpstreamFailure),
}

impl Stop {
    /// visor's error code for it (`error.type` on its trace).
    pub fn label(&self) -> &'static str {
        match self {
            Stop::Refused(e) | Stop::Upstream(e, _) => e.label(),
        }
    }

    /// A request that could not be sent to `upstream` (HTTP or a WebSocket
    /// handshake): the client's own doing or visor's limit (`limit`, its
    /// `max_body_bytes`) is refused; the upstream's failure is counted as
    /// its kind, `cause` saying how the connection failed.
    pub fn of_send(upstream: &str, failure: SendFailure, cause: &'static str, limit: u64) -> Stop {
        let upstream = upstream.to_owned();
        let e = match failure {
            SendFailure::BodyTooLarge => return Stop::Refused(VisorError::BodyTooLarge { limit }),
            // The client went away mid-upload: its doing, not the
            // upstream's (no upstream error counted).
            SendFailure::ClientBody => {
                return Stop::Refused(VisorError::BadRequest(
                    "the request body could not be read: the client stopped sending it",
                ));
            }
            SendFailure::Connect | SendFailure::Reset => VisorError::UpstreamUnreachable {
                upstream,
                reason: cause,
            },
            SendFailure::ConnectTimeout => VisorError::UpstreamTimeout {
                upstream,
                which: "connect timeout",
            },
        };
        // The client's or visor's own failures returned above.
        let kind = UpstreamFailure::of_send(failure).unwrap_or(UpstreamFailure::Reset);
        Stop::Upstream(e, kind)
    }
}

impl From<VisorError> for Stop {
    fn from(e: VisorError) -> Self {
        Stop::Refused(e)
    }
}

impl From<(VisorError, UpstreamFailure)> for Stop {
    fn from((e, kind): (VisorError, UpstreamFailure)) -> Self {
        Stop::Upstream(e, kind)
    }
}

// The counts' names, made once (`from_static` outside a constant checks
// its name at each call).
static X_VISOR_IMAGES_REPLACED: header::HeaderName =
    header::HeaderName::from_static("x-visor-images-replaced");
static X_VISOR_MEDIA_REPLACED: header::HeaderName =
    header::HeaderName::from_static("x-visor-media-replaced");
static X_VISOR_BYTES_SAVED: header::HeaderName =
    header::HeaderName::from_static("x-visor-bytes-saved");
static X_VISOR_HISTORY_USED: header::HeaderName =
    header::HeaderName::from_static("x-visor-history-used");

/// What the transforms did to a request, for the `x-visor-*` headers and the
/// log line.
#[derive(Clone, Copy)]
pub struct Counts {
    pub images_replaced: usize,
    pub media_replaced: usize,
    pub bytes_saved: i64,
    pub history_used: usize,
}

impl Counts {
    pub fn of(report: &Report) -> Self {
        Counts {
            images_replaced: report.images_replaced,
            media_replaced: report.media_replaced,
            bytes_saved: report.bytes_saved,
            history_used: report.history_used,
        }
    }

    /// The `x-visor-*` counts of a transformed endpoint.
    pub fn write(self, headers: &mut HeaderMap) {
        // Most requests change nothing: a zero needs no allocation.
        let num = |n: i64| match n {
            0 => HeaderValue::from_static("0"),
            n => HeaderValue::from(n),
        };
        headers.insert(
            X_VISOR_IMAGES_REPLACED.clone(),
            num(self.images_replaced as i64),
        );
        headers.insert(
            X_VISOR_MEDIA_REPLACED.clone(),
            num(self.media_replaced as i64),
        );
        headers.insert(X_VISOR_BYTES_SAVED.clone(), num(self.bytes_saved.max(0)));
        headers.insert(X_VISOR_HISTORY_USED.clone(), num(self.history_used as i64));
    }
}

/// Where visor's own answers to a proxied request leave: what the request
/// became known as along its phases (model, upstream, transform counts),
/// and the one place that logs and counts it.
pub struct Edge<'a> {
    metrics: &'a Metrics,
    names: &'a [Arc<str>],
    started: Instant,
    /// Once routed: the upstream's name and the model's metric label.
    routed: Option<(Arc<str>, String)>,
    /// Once the body was read: the model's metric label (a request refused
    /// for its model, 404 or 403, is counted under it).
    model: Option<String>,
    /// Once transformed: the `x-visor-*` counts.
    counts: Option<Counts>,
    transport: Transport,
    /// The caller's key name, once known (`none` before).
    key: Option<Arc<str>>,
}

/// What an edge has seen of a request.
pub struct Seen {
    pub model: Option<String>,
    pub upstream: Option<String>,
    pub started: Instant,
}

/// How a request came: its log lines say so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Http,
    /// A WebSocket upgrade, or an event on the socket.
    WebSocket,
}

/// A request (or a WebSocket event) visor refused itself: logged, and
/// counted in `visor_requests_total` with no upstream, under the model it
/// named (its metric label) when it named one.
pub fn refused(
    metrics: &Metrics,
    e: &VisorError,
    model: Option<&str>,
    key: &str,
    transport: Transport,
) {
    let status = e.status();
    match (model, transport) {
        (None, Transport::Http) => {
            tracing::info!(error = e.label(), status = status.as_u16(), "refused")
        }
        (Some(model), Transport::Http) => {
            tracing::info!(error = e.label(), status = status.as_u16(), model = %model, "refused")
        }
        (model, Transport::WebSocket) => tracing::info!(
            error = e.label(),
            status = status.as_u16(),
            model = %model.unwrap_or(""),
            transport = "websocket",
            "refused"
        ),
    }
    metrics
        .requests
        .with_label_values(&[NO_UPSTREAM, model.unwrap_or(""), status.as_str(), key])
        .inc();
}

impl<'a> Edge<'a> {
    /// An edge for one request; `names`: the upstreams' names, by index.
    pub fn new(metrics: &'a Metrics, names: &'a [Arc<str>]) -> Self {
        Edge {
            metrics,
            names,
            started: Instant::now(),
            routed: None,
            model: None,
            counts: None,
            transport: Transport::Http,
            key: None,
        }
    }

    /// The request is a WebSocket upgrade (its log lines say so).
    pub fn websocket(&mut self) {
        self.transport = Transport::WebSocket;
    }

    pub fn model_read(&mut self, model: Option<&str>) {
        if let Some(m) = model {
            self.model = Some(self.metrics.model_label(m));
        }
    }

    pub fn routed(&mut self, index: usize, model: Option<&str>) {
        let name = self.names[index].clone();
        let label = self.metrics.model_label(model.unwrap_or(""));
        tracing::debug!(upstream = %name, model = %label, "routed");
        self.routed = Some((name, label));
    }

    /// The caller's key name, for its counts.
    pub fn keyed(&mut self, key: Arc<str>) {
        self.key = Some(key);
    }

    pub fn prepared(&mut self, counts: Option<Counts>) {
        self.counts = counts;
    }

    /// The model's metric label (empty before routing).
    pub fn model_label(&self) -> String {
        self.routed
            .as_ref()
            .map(|(_, m)| m.clone())
            .unwrap_or_default()
    }

    fn count(&self, status: http::StatusCode) {
        let (upstream, model) = match &self.routed {
            Some((u, m)) => (&**u, m.as_str()),
            // (Every count of an answer without an upstream is a refusal,
            // counted by `refused`.)
            None => (NO_UPSTREAM, ""),
        };
        let key = self.key.as_deref().unwrap_or("none");
        self.metrics
            .requests
            .with_label_values(&[upstream, model, status.as_str(), key])
            .inc();
    }

    /// What is known of the request so far: the model read, the upstream
    /// routed to, when it arrived.
    pub fn seen(&self) -> Seen {
        Seen {
            model: self.model.clone(),
            upstream: self.routed.as_ref().map(|(u, _)| u.to_string()),
            started: self.started,
        }
    }

    /// Visor's answer to a request that stopped.
    pub fn answer(self, stop: Stop) -> Response<ProxyBody> {
        match stop {
            Stop::Refused(e) => {
                let key = self.key.as_deref().unwrap_or("none");
                refused(
                    self.metrics,
                    &e,
                    self.model.as_deref(),
                    key,
                    Transport::Http,
                );
                e.into_response()
            }
            Stop::Upstream(e, kind) => {
                let upstream = self.routed.as_ref().map_or("", |(u, _)| &**u);
                self.metrics.upstream_error(upstream, kind.label());
                self.count(e.status());
                let counts = self.counts;
                match self.transport {
                    Transport::Http => tracing::warn!(
                        upstream = %upstream,
                        error = e.label(),
                        kind = kind.label(),
                        images_replaced = counts.map_or(0, |c| c.images_replaced),
                        media_replaced = counts.map_or(0, |c| c.media_replaced),
                        bytes_saved = counts.map_or(0, |c| c.bytes_saved),
                        "upstream request failed"
                    ),
                    Transport::WebSocket => tracing::warn!(
                        upstream = %upstream,
                        error = e.label(),
                        kind = kind.label(),
                        "websocket upstream failed"
                    ),
                }
                let mut resp = e.into_response();
                if let Some(c) = counts {
                    c.write(resp.headers_mut());
                }
                resp
            }
        }
    }

    /// An upstream 4xx read whole to look for an image refusal, and passed
    /// back as it was.
    pub fn passed(&self, mut head: http::response::Parts, body: Bytes) -> Response<ProxyBody> {
        for_the_client(&mut head);
        if let Some(c) = self.counts {
            c.write(&mut head.headers);
        }
        self.count(head.status);
        if let Some((upstream, _)) = &self.routed {
            self.metrics
                .request_duration
                .with_label_values(&[&**upstream])
                .observe(self.started.elapsed().as_secs_f64());
        }
        Response::from_parts(head, ProxyBody::from(body))
    }

    /// A WebSocket handshake the upstream refused (401, 404, 426…): its
    /// status, `Content-Type`, `Retry-After` and body, counted at the
    /// upstream.
    pub fn refused_upgrade(
        &self,
        head: &http::response::Parts,
        body: Bytes,
    ) -> Response<ProxyBody> {
        let mut out = Response::new(ProxyBody::from(body));
        *out.status_mut() = head.status;
        for h in [header::CONTENT_TYPE, header::RETRY_AFTER] {
            if let Some(v) = head.headers.get(&h) {
                out.headers_mut().insert(h, v.clone());
            }
        }
        self.count(head.status);
        out
    }
}

/// Visor's answer to a request refused before anything was known of it (a
/// bad target, a visor endpoint's error): logged and counted with no
/// upstream, in the OpenAI error shape.
pub fn refuse(metrics: &Metrics, e: VisorError) -> Response<ProxyBody> {
    Edge::new(metrics, &[]).answer(Stop::Refused(e))
}
