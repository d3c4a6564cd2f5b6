//! The proxy path: read (or stream) the body, route by model, forward, and
//! hand back the upstream's response through an [`ObservedBody`].
//!
//! Phases of one request:
//! 1. limit     — `Content-Length` over `max_body_bytes` → 413 before reading.
//! 2. body      — transformed endpoints (`POST` chat/completions, responses,
//!    messages) are read whole, bounded, into one buffer and
//!    validated (400 on invalid JSON); any other body is streamed,
//!    with its first chunks scanned for `model` only when routing
//!    depends on it.
//! 3. route     — first upstream whose globs match the model; no model → the
//!    first upstream; a model nobody matches → 404.
//! 4. session   — with `x-visor-session`, the stored history is read and
//!    merged in ([`super::session`]); a store that cannot be read
//!    → 503.
//! 5. transform — the model-spec table decides; images are replaced for a
//!    model that cannot see, the rules for every model and line
//!    dedup applied ([`super::transform`]); the replaced originals
//!    are written in the background.
//! 6. send      — headers rewritten, the body as held (byte for byte when
//!    nothing changed); wait for the response head under the
//!    first-byte and total deadlines (peek, then commit: failures
//!    here still become 502/504).
//! 7. learn     — a model of unknown vision whose upstream answers with an
//!    "images not supported" 4xx: retried once with the images
//!    replaced, and remembered.
//! 8. respond   — status and headers passed through (plus the `x-visor-*`
//!    counts); once the originals are on disk the body streams
//!    through `ObservedBody` (idle-gap and total deadlines, usage,
//!    metrics, the session's reply stored before the last bytes).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use http::{HeaderMap, HeaderValue, Method, Request, Response, Version, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::time::Instant;

use std::pin::Pin;

use bytes::Bytes;
use tokio::time::Sleep;

use super::answer::refuse;
use super::body::{Finish, InflightGuard, ObservedBody, ProxyBody};
use super::headers::{strip_hop_by_hop, upstream_request_headers};
use super::probe::{FormScanner, JsonScanner, WholeBody};
use super::session;
use super::transform::{self, Options, Prepared};
use super::usage::UsageObserver;
use super::{AppState, RequestIdExt};
use crate::error::VisorError;
use crate::transform::{Report, Shape};
use crate::upstream::{LimitedIncoming, ResponseBody, SendFailure, UpstreamBody};

pub async fn proxy(state: Arc<AppState>, req: Request<Incoming>) -> Response<ProxyBody> {
    if super::websocket::is_upgrade(&req) {
        return super::websocket::proxy(state, req).await;
    }
    let started = Instant::now();
    let inflight = InflightGuard::new(state.metrics.clone());
    let request_id = req
        .extensions()
        .get::<RequestIdExt>()
        .map(|r| r.0.clone())
        .unwrap_or_else(|| HeaderValue::from_static("req_unknown"));
    let (mut parts, body) = req.into_parts();
    let rest = parts.uri.path()["/v1".len()..].to_owned();
    let limit = state.config.server.max_body_bytes;
    let shape = if parts.method == Method::POST {
        Shape::of_path(&rest)
    } else {
        None
    };
    let opts = match shape.map(|_| Options::from_headers(&parts.headers)) {
        Some(Err(e)) => return refuse(&state, e),
        Some(Ok(o)) => o,
        None => Options::default(),
    };

    // 1. limit
    if content_length(&parts.headers).is_some_and(|n| n > limit) {
        return refuse(&state, VisorError::BodyTooLarge { limit });
    }

    // 2. body
    // A body visor reads before forwarding must arrive within the request's
    // total deadline (no slow-loris uploads holding a worker's memory).
    let deadline = started + state.config.server.request_timeout;
    let exceeded = Arc::new(AtomicBool::new(false));
    let mut whole = None;
    let (model, up_body) = if shape.is_some() {
        let hint = content_length(&parts.headers).unwrap_or(0);
        match tokio::time::timeout_at(deadline, read_validated(body, limit, hint)).await {
            Ok(Ok((model, bytes))) => {
                whole = Some(bytes);
                (model, None)
            }
            Ok(Err(e)) => return refuse(&state, e),
            Err(_) => return refuse(&state, VisorError::BodyTimeout),
        }
    } else if state.route_by_model {
        // The route depends on the model: read it from the body whatever the
        // Content-Type says (a JSON object, or a multipart form's `model`
        // field); a body that cannot be read is refused, never guessed.
        let form = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| FormScanner::for_content_type(v.as_bytes()));
        let scan = scan_model(body, limit, exceeded.clone(), form);
        match tokio::time::timeout_at(deadline, scan).await {
            Ok(Ok((model, b))) => (model, Some(b)),
            Ok(Err(e)) => return refuse(&state, e),
            Err(_) => return refuse(&state, VisorError::BodyTimeout),
        }
    } else {
        let rest = LimitedIncoming::new(body, limit, exceeded.clone());
        let b = UpstreamBody {
            prefix: VecDeque::new(),
            rest: Some(rest),
        };
        (None, Some(b))
    };

    // 3. route
    let Some(index) = route(&state, model.as_deref()) else {
        let m = model.unwrap_or_default();
        return refuse(&state, VisorError::NoRoute(m));
    };
    let upstream = &state.config.upstreams[index];
    let upstream_name = state.upstream_names[index].clone();
    let model_label = state.metrics.model_label(model.as_deref().unwrap_or(""));
    tracing::debug!(upstream = %upstream_name, model = %model_label, "routed");

    // 4. session: the stored history merged in.
    let mut recorder = None;
    let mut history_used = 0;
    if let (Some(shape), Some(bytes)) = (shape, whole.as_ref()) {
        let id = match session::requested(&parts.headers) {
            Ok(id) => id,
            Err(e) => return refuse(&state, e),
        };
        if let Some(id) = id {
            match session::open(&state, shape, &parts.headers, &id, bytes).await {
                Ok(opened) => {
                    whole = Some(opened.body);
                    history_used = opened.history_used;
                    recorder = Some(opened.recorder);
                }
                Err(e) => return refuse(&state, e),
            }
        }
    }

    // 5. transform: the pure rewrite of the body visor holds whole.
    let mut prepared = match (shape, whole) {
        (Some(shape), Some(bytes)) => {
            let asker = transform::Asker {
                headers: &parts.headers,
                upstream: index,
            };
            let mut p =
                transform::prepare(&state, shape, model.as_deref(), bytes, opts, asker).await;
            p.report.history_used = history_used;
            Some(p)
        }
        _ => None,
    };

    // 6. send
    let uri = match state.upstreams.uri(index, &rest, parts.uri.query()) {
        Some(u) => u,
        None => {
            return refuse(
                &state,
                VisorError::BadRequest("the request target is not a valid URL path"),
            );
        }
    };
    upstream_request_headers(
        &mut parts.headers,
        upstream,
        state.keys.is_set(),
        &request_id,
    );
    parts.uri = uri;
    parts.version = Version::HTTP_11;
    parts.extensions = http::Extensions::new();
    // Kept only while an upstream refusal may still be learned from.
    let retry_head = prepared
        .as_ref()
        .is_some_and(|p| p.learn.is_some())
        .then(|| {
            (
                parts.method.clone(),
                parts.uri.clone(),
                parts.headers.clone(),
            )
        });
    let up_body = match &prepared {
        Some(p) => {
            set_content_length(&mut parts.headers, p.body.len());
            p.upstream_body()
        }
        None => up_body.unwrap_or_default(),
    };
    let up_req = Request::from_parts(parts, up_body);

    let server = &state.config.server;
    let sent = Instant::now();
    let head_deadline = (sent + server.first_byte_timeout).min(deadline);
    // For the log line (the retry after a refusal may replace more images).
    let (images_replaced, bytes_saved) = prepared
        .as_ref()
        .map_or((0, 0), |p| (p.report.images_replaced, p.report.bytes_saved));
    let fail = |e: VisorError, kind: &'static str| {
        state.metrics.upstream_error(&upstream_name, kind);
        state
            .metrics
            .requests
            .with_label_values(&[&*upstream_name, model_label.as_str(), e.status().as_str()])
            .inc();
        tracing::warn!(
            upstream = %upstream_name,
            error = e.label(),
            kind,
            images_replaced,
            bytes_saved,
            "upstream request failed"
        );
        e.into_response()
    };
    let exchange = Exchange {
        state: &state,
        index,
        head_deadline,
        deadline,
        limit,
        upstream: &upstream_name,
    };
    let (mut resp, mut timer) = match exchange.run(up_req, &exceeded, sent).await {
        Ok(r) => r,
        Err(Refused::Limit(r)) => return r,
        Err(Refused::Failed(e, kind)) => return counted(fail(e, kind), prepared.as_ref()),
    };

    // 7. learn: a model of unknown vision whose upstream refuses images is
    // retried once with them replaced, and remembered as non-vision.
    if let Some(p) = prepared.as_mut()
        && let Some(learn) = p.learn.take()
        && let Some((method, uri, mut headers)) = retry_head
        && may_be_refusal(resp.status(), resp.headers())
    {
        let (head, incoming) = resp.into_parts();
        let error_body = match read_error_body(incoming, head_deadline, &upstream_name).await {
            Ok(b) => b,
            Err((e, kind)) => return counted(fail(e, kind), Some(p)),
        };
        let retry =
            transform::after_refusal(&state, &learn, model.as_deref().unwrap_or(""), &error_body)
                .await;
        let Some(retry) = retry else {
            // Not about images: the upstream's answer, as it was.
            let mut head = head;
            strip_hop_by_hop(&mut head.headers);
            visor_counts(&mut head.headers, &p.report);
            let status = head.status.as_str().to_owned();
            state
                .metrics
                .requests
                .with_label_values(&[&*upstream_name, model_label.as_str(), status.as_str()])
                .inc();
            state
                .metrics
                .request_duration
                .with_label_values(&[&upstream_name])
                .observe(started.elapsed().as_secs_f64());
            return Response::from_parts(head, ProxyBody::from(error_body));
        };
        set_content_length(&mut headers, retry.body.len());
        let mut req = Request::new(retry.upstream_body());
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        *req.headers_mut() = headers;
        *p = retry;
        p.report.history_used = history_used;
        (resp, timer) = match exchange.run(req, &exceeded, Instant::now()).await {
            Ok(r) => r,
            Err(Refused::Limit(r)) => return r,
            Err(Refused::Failed(e, kind)) => return counted(fail(e, kind), Some(p)),
        };
    }

    // 8. respond
    let (mut head, incoming) = resp.into_parts();
    if head.status.is_server_error() {
        state.metrics.upstream_error(&upstream_name, "status_5xx");
    }
    strip_hop_by_hop(&mut head.headers);
    if let Some(p) = prepared.as_mut() {
        visor_counts(&mut head.headers, &p.report);
        // The replaced images are on disk before the response is returned
        // (the write overlapped the upstream call).
        if let Some(saving) = p.saving.take() {
            let _ = saving.await;
        }
    }
    let usage = UsageObserver::for_response(&head.headers);
    if let Some(rec) = recorder.as_mut() {
        rec.head(head.status, &head.headers);
    }
    let finish = Finish {
        metrics: state.metrics.clone(),
        upstream: upstream_name,
        model: model_label,
        status: head.status.as_u16(),
        request_id,
        started,
        sent,
        inflight,
        images_replaced: prepared.as_ref().map_or(0, |p| p.report.images_replaced),
        bytes_saved: prepared.as_ref().map_or(0, |p| p.report.bytes_saved),
    };
    let mut observed = ObservedBody::new(
        incoming,
        usage,
        server.idle_timeout,
        deadline,
        timer,
        finish,
    );
    if let Some(rec) = recorder {
        observed = observed.with_session(rec);
    }
    Response::from_parts(head, ProxyBody::Upstream(Box::new(observed)))
}

/// Why an exchange gave no response head.
enum Refused {
    /// Answered already (413 when a streamed body ran over the limit).
    Limit(Response<ProxyBody>),
    /// An upstream failure: the error and its metric kind.
    Failed(VisorError, &'static str),
}

/// One request/response-head exchange with the chosen upstream, under the
/// first-byte and total deadlines.
struct Exchange<'a> {
    state: &'a Arc<AppState>,
    index: usize,
    head_deadline: Instant,
    deadline: Instant,
    limit: u64,
    upstream: &'a Arc<str>,
}

impl Exchange<'_> {
    async fn run(
        &self,
        req: Request<UpstreamBody>,
        exceeded: &AtomicBool,
        sent: Instant,
    ) -> Result<(Response<ResponseBody>, Pin<Box<Sleep>>), Refused> {
        let state = self.state;
        let idle = state.config.server.idle_timeout;
        let sending = state.upstreams.send(self.index, req, exceeded);
        // The request's one timer, armed once at the earlier of the head
        // deadline and one idle gap from now. A head that comes sooner (the
        // usual case) hands it to the body as is, already right for the
        // body's idle check; re-arming it would make tokio wake its driver
        // (a system call) just before the first byte goes out.
        let mut timer = Box::pin(tokio::time::sleep_until(
            self.head_deadline.min(sent + idle),
        ));
        tokio::pin!(sending);
        let outcome = loop {
            tokio::select! {
                biased;
                r = &mut sending => break Ok(r),
                () = timer.as_mut() => {
                    if Instant::now() >= self.head_deadline {
                        break Err(());
                    }
                    timer.as_mut().reset(self.head_deadline);
                }
            }
        };
        let upstream = self.upstream.to_string();
        match outcome {
            Ok(Ok(resp)) => Ok((resp, timer)),
            Ok(Err(failed)) => {
                let failure = failed.failure;
                let e = match failure {
                    SendFailure::BodyTooLarge => {
                        let limit = self.limit;
                        return Err(Refused::Limit(refuse(
                            state,
                            VisorError::BodyTooLarge { limit },
                        )));
                    }
                    SendFailure::Connect | SendFailure::Reset => VisorError::UpstreamUnreachable {
                        upstream,
                        reason: failed.cause,
                    },
                    SendFailure::ConnectTimeout => VisorError::UpstreamTimeout {
                        upstream,
                        which: "connect timeout",
                    },
                };
                Err(Refused::Failed(e, failure.label()))
            }
            Err(()) => {
                let (which, kind) = if self.head_deadline >= self.deadline {
                    ("request timeout", "request_timeout")
                } else {
                    ("first byte timeout", "first_byte_timeout")
                };
                let e = VisorError::UpstreamTimeout { upstream, which };
                Err(Refused::Failed(e, kind))
            }
        }
    }
}

/// An error visor answers after the transform ran: it still carries the
/// `x-visor-*` counts of what was done to the request.
fn counted(mut resp: Response<ProxyBody>, prepared: Option<&Prepared>) -> Response<ProxyBody> {
    if let Some(p) = prepared {
        visor_counts(resp.headers_mut(), &p.report);
    }
    resp
}

/// The three `x-visor-*` counts of a transformed endpoint.
fn visor_counts(headers: &mut HeaderMap, report: &Report) {
    let num = |n: i64| HeaderValue::from(n);
    headers.insert(
        header::HeaderName::from_static("x-visor-images-replaced"),
        num(report.images_replaced as i64),
    );
    headers.insert(
        header::HeaderName::from_static("x-visor-bytes-saved"),
        num(report.bytes_saved.max(0)),
    );
    headers.insert(
        header::HeaderName::from_static("x-visor-history-used"),
        num(report.history_used as i64),
    );
}

fn set_content_length(headers: &mut HeaderMap, len: usize) {
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    headers.remove(header::TRANSFER_ENCODING);
}

/// Largest upstream error body read to look for an image refusal.
const MAX_ERROR_BODY: usize = 256 * 1024;

/// A 4xx that may say "this model takes no images": not an auth, rate or
/// timeout answer, and not announced as larger than we would read.
fn may_be_refusal(status: http::StatusCode, headers: &HeaderMap) -> bool {
    status.is_client_error()
        && !matches!(status.as_u16(), 401 | 403 | 407 | 408 | 429)
        && content_length(headers).is_none_or(|n| n <= MAX_ERROR_BODY as u64)
}

async fn read_error_body(
    mut body: ResponseBody,
    deadline: Instant,
    upstream: &str,
) -> Result<Bytes, (VisorError, &'static str)> {
    let read = async {
        let mut out = bytes::BytesMut::new();
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else {
                return Err("closed before a response");
            };
            if let Ok(data) = frame.into_data() {
                out.extend_from_slice(&data);
                if out.len() > MAX_ERROR_BODY {
                    return Err("error body too large");
                }
            }
        }
        Ok(out.freeze())
    };
    match tokio::time::timeout_at(deadline, read).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(reason)) => Err((
            VisorError::UpstreamUnreachable {
                upstream: upstream.to_owned(),
                reason,
            },
            "reset",
        )),
        Err(_) => Err((
            VisorError::UpstreamTimeout {
                upstream: upstream.to_owned(),
                which: "first byte timeout",
            },
            "first_byte_timeout",
        )),
    }
}

/// The first upstream whose globs match; no model → the first upstream.
fn route(state: &AppState, model: Option<&str>) -> Option<usize> {
    match model {
        None => Some(0),
        Some(m) => state.config.upstreams.iter().position(|u| u.matches(m)),
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Reads a whole body, never more than `limit` bytes, through a
/// [`WholeBody`] (validated as it arrives, held in one buffer). This is the
/// one place a request body is held whole: the transformed endpoints need
/// all of it before the request may leave.
async fn read_validated(
    mut body: Incoming,
    limit: u64,
    hint: u64,
) -> Result<(Option<String>, Bytes), VisorError> {
    let mut whole = WholeBody::new(hint.min(limit));
    let mut total: u64 = 0;
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|_| VisorError::BadRequest("the request body could not be read"))?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers
        };
        total += data.len() as u64;
        if total > limit {
            return Err(VisorError::BodyTooLarge { limit });
        }
        whole.push(data);
    }
    let (model, bytes) = whole.finish().map_err(VisorError::InvalidJson)?;
    Ok((model, bytes))
}

/// Finds a body's model as it streams: a JSON object's top-level `model`,
/// or a multipart form's `model` field.
enum ModelScan {
    Json(JsonScanner),
    Form(FormScanner),
}

impl ModelScan {
    fn found(&self) -> bool {
        match self {
            ModelScan::Json(s) => s.found(),
            ModelScan::Form(s) => s.found(),
        }
    }

    fn feed(&mut self, data: &[u8]) {
        match self {
            ModelScan::Json(s) => s.feed(data),
            ModelScan::Form(s) => s.feed(data),
        }
    }
}

/// Streams a body while looking for its model: chunks are held only until
/// the model has passed, then the rest flows straight through. An empty
/// body, or a form without a `model` field, has none (the first upstream);
/// a non-empty body that is not a JSON object, or whose `model` is not a
/// string, cannot be routed: [`VisorError::Unroutable`].
async fn scan_model(
    mut body: Incoming,
    limit: u64,
    exceeded: Arc<AtomicBool>,
    form: Option<FormScanner>,
) -> Result<(Option<String>, UpstreamBody), VisorError> {
    let mut scanner = match form {
        Some(f) => ModelScan::Form(f),
        None => ModelScan::Json(JsonScanner::new()),
    };
    let mut prefix = VecDeque::new();
    let mut held: u64 = 0;
    let mut ended = false;
    while !scanner.found() {
        match body.frame().await {
            None => {
                ended = true;
                break;
            }
            Some(Err(_)) => {
                return Err(VisorError::BadRequest("the request body could not be read"));
            }
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                held += data.len() as u64;
                if held > limit {
                    return Err(VisorError::BodyTooLarge { limit });
                }
                scanner.feed(&data);
                prefix.push_back(data);
            }
        }
    }
    let model = match &mut scanner {
        ModelScan::Form(s) => {
            s.finish();
            if s.too_long() {
                return Err(VisorError::Unroutable(
                    "the form's `model` is longer than 1024 bytes".to_owned(),
                ));
            }
            s.model().map(str::to_owned)
        }
        ModelScan::Json(s) => match (s.model(), s.error()) {
            (Some(m), _) => Some(m.to_owned()),
            (None, Some(why)) => return Err(VisorError::Unroutable(why.to_owned())),
            // Ended before the model came: whole and valid without one
            // (or empty) is no model; anything else cannot be read.
            (None, None) if held == 0 => None,
            (None, None) => match std::mem::take(s).finish() {
                Ok(_) => None,
                Err(why) => return Err(VisorError::Unroutable(why)),
            },
        },
    };
    let rest = (!ended).then(|| LimitedIncoming::new(body, limit - held, exceeded));
    Ok((model, UpstreamBody { prefix, rest }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transformed_endpoints() {
        assert_eq!(Shape::of_path("/chat/completions"), Some(Shape::Chat));
        assert_eq!(Shape::of_path("/responses"), Some(Shape::Responses));
        assert_eq!(Shape::of_path("/messages"), Some(Shape::Messages));
        assert_eq!(Shape::of_path("/embeddings"), None);
        assert_eq!(Shape::of_path("/responses/abc/cancel"), None);
    }
}
