//! The proxy path: read (or stream) the body, route by model, forward, and
//! hand back the upstream's response through an [`ObservedBody`].
//!
//! Phases of one request:
//! 1. limit   — `Content-Length` over `max_body_bytes` → 413 before reading.
//! 2. body    — transformed endpoints (`POST` chat/completions, responses,
//!    messages) are read whole, bounded, and probed (400 on invalid
//!    JSON); any other body is streamed, with its first chunks
//!    scanned for `model` only when routing depends on it.
//! 3. route   — first upstream whose globs match the model; no model → the
//!    first upstream; a model nobody matches → 404.
//! 4. send    — headers rewritten, the body byte for byte; wait for the
//!    response head under the first-byte and total deadlines
//!    (peek, then commit: failures here still become 502/504).
//! 5. respond — status and headers passed through; the body streams through
//!    `ObservedBody` (idle-gap and total deadlines, usage, metrics).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request, Response, Uri, Version, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::time::Instant;

use super::body::{Finish, InflightGuard, ObservedBody, ProxyBody};
use super::headers::{strip_hop_by_hop, upstream_request_headers};
use super::probe::JsonScanner;
use super::router::refuse;
use super::usage::UsageObserver;
use super::{AppState, RequestIdExt};
use crate::error::VisorError;
use crate::upstream::{LimitedIncoming, SendFailure, UpstreamBody};

/// Endpoints whose JSON body visor reads whole (and, in later stages, rewrites).
fn is_transformed(method: &Method, rest: &str) -> bool {
    method == Method::POST && matches!(rest, "/chat/completions" | "/responses" | "/messages")
}

pub async fn proxy(state: Arc<AppState>, req: Request<Incoming>) -> Response<ProxyBody> {
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

    // 1. limit
    if content_length(&parts.headers).is_some_and(|n| n > limit) {
        return refuse(&state, VisorError::BodyTooLarge { limit });
    }

    // 2. body
    // A body visor reads before forwarding must arrive within the request's
    // total deadline (no slow-loris uploads holding a worker's memory).
    let deadline = started + state.config.server.request_timeout;
    let transformed = is_transformed(&parts.method, &rest);
    let exceeded = Arc::new(AtomicBool::new(false));
    let (model, up_body) = if transformed {
        match tokio::time::timeout_at(deadline, read_validated(body, limit)).await {
            Ok(Ok(read)) => read,
            Ok(Err(e)) => return refuse(&state, e),
            Err(_) => return refuse(&state, VisorError::BodyTimeout),
        }
    } else if state.route_by_model && carries_json(&parts.method, &parts.headers) {
        let scan = scan_model(body, limit, exceeded.clone());
        match tokio::time::timeout_at(deadline, scan).await {
            Ok(Ok(found)) => found,
            Ok(Err(e)) => return refuse(&state, e),
            Err(_) => return refuse(&state, VisorError::BodyTimeout),
        }
    } else {
        let rest = LimitedIncoming::new(body, limit, exceeded.clone());
        (
            None,
            UpstreamBody {
                prefix: VecDeque::new(),
                rest: Some(rest),
            },
        )
    };

    // 3. route
    let Some(index) = route(&state, model.as_deref()) else {
        let m = model.unwrap_or_default();
        return refuse(&state, VisorError::NoRoute(m));
    };
    let upstream = &state.config.upstreams[index];
    let target = &state.targets[index];
    let upstream_name = state.upstream_names[index].clone();
    let model_label = state.metrics.model_label(model.as_deref().unwrap_or(""));
    tracing::debug!(upstream = %upstream_name, model = %model_label, "routed");

    // 4. send
    let uri = match target.uri(&rest, parts.uri.query()) {
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
    let up_req = Request::from_parts(parts, up_body);

    let server = &state.config.server;
    let sent = Instant::now();
    let head_deadline = (sent + server.first_byte_timeout).min(deadline);
    let fail = |e: VisorError, kind: &'static str| {
        state.metrics.upstream_error(&upstream_name, kind);
        state
            .metrics
            .requests
            .with_label_values(&[&*upstream_name, model_label.as_str(), e.status().as_str()])
            .inc();
        tracing::warn!(upstream = %upstream_name, error = e.label(), kind, "upstream request failed");
        e.into_response()
    };
    let sending = state
        .upstreams
        .send(index, &state.routes[index], up_req, &exceeded);
    // The request's one timer, armed once at the earlier of the head
    // deadline and one idle gap from now. A head that comes sooner (the usual
    // case) hands it to the body as is, already right for the body's idle
    // check; re-arming it would make tokio wake its driver (a system call)
    // just before the first byte goes out.
    let mut timer = Box::pin(tokio::time::sleep_until(
        head_deadline.min(sent + server.idle_timeout),
    ));
    tokio::pin!(sending);
    let outcome = loop {
        tokio::select! {
            biased;
            r = &mut sending => break Ok(r),
            () = timer.as_mut() => {
                if Instant::now() >= head_deadline {
                    break Err(());
                }
                timer.as_mut().reset(head_deadline);
            }
        }
    };
    let resp = match outcome {
        Ok(Ok(resp)) => resp,
        Ok(Err(failed)) => {
            let failure = failed.failure;
            let e = match failure {
                SendFailure::BodyTooLarge => {
                    return refuse(&state, VisorError::BodyTooLarge { limit });
                }
                SendFailure::Connect | SendFailure::Reset => VisorError::UpstreamUnreachable {
                    upstream: upstream_name.to_string(),
                    reason: failed.cause,
                },
                SendFailure::ConnectTimeout => VisorError::UpstreamTimeout {
                    upstream: upstream_name.to_string(),
                    which: "connect timeout",
                },
            };
            return fail(e, failure.label());
        }
        Err(_) => {
            let (which, kind) = if head_deadline >= deadline {
                ("request timeout", "request_timeout")
            } else {
                ("first byte timeout", "first_byte_timeout")
            };
            let e = VisorError::UpstreamTimeout {
                upstream: upstream_name.to_string(),
                which,
            };
            return fail(e, kind);
        }
    };

    // 5. respond
    let (mut head, incoming) = resp.into_parts();
    if head.status.is_server_error() {
        state.metrics.upstream_error(&upstream_name, "status_5xx");
    }
    strip_hop_by_hop(&mut head.headers);
    if transformed {
        for name in [
            "x-visor-images-replaced",
            "x-visor-bytes-saved",
            "x-visor-history-used",
        ] {
            head.headers.insert(
                header::HeaderName::from_static(name),
                HeaderValue::from_static("0"),
            );
        }
    }
    let usage = UsageObserver::for_response(&head.headers);
    let finish = Finish {
        metrics: state.metrics.clone(),
        upstream: upstream_name,
        model: model_label,
        status: head.status.as_u16(),
        request_id,
        started,
        sent,
        inflight,
    };
    let observed = ObservedBody::new(
        incoming,
        usage,
        server.idle_timeout,
        deadline,
        timer,
        finish,
    );
    Response::from_parts(head, ProxyBody::Upstream(Box::new(observed)))
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

fn carries_json(method: &Method, headers: &HeaderMap) -> bool {
    matches!(*method, Method::POST | Method::PUT | Method::PATCH)
        && headers
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| memchr::memmem::find(v.as_bytes(), b"json").is_some())
}

/// Reads a whole body, never more than `limit` bytes, checking it is a
/// JSON object and finding its model as the chunks arrive. The chunks are
/// held as they came (no copy) and go upstream as they are. This is the one
/// place a request body is held whole: the transformed endpoints need all of
/// it before the request may leave.
async fn read_validated(
    mut body: Incoming,
    limit: u64,
) -> Result<(Option<String>, UpstreamBody), VisorError> {
    let mut scanner = JsonScanner::new();
    let mut chunks = VecDeque::new();
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
        scanner.feed(&data);
        chunks.push_back(data);
    }
    let probed = scanner.finish().map_err(VisorError::InvalidJson)?;
    Ok((
        probed.model,
        UpstreamBody {
            prefix: chunks,
            rest: None,
        },
    ))
}

/// Streams a body while looking for its top-level `model`: chunks are held
/// only until the model has passed, then the rest flows straight through.
async fn scan_model(
    mut body: Incoming,
    limit: u64,
    exceeded: Arc<AtomicBool>,
) -> Result<(Option<String>, UpstreamBody), VisorError> {
    let mut scanner = JsonScanner::new();
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
    let model = scanner.model().map(str::to_owned);
    let rest = (!ended).then(|| LimitedIncoming::new(body, limit - held, exceeded));
    Ok((model, UpstreamBody { prefix, rest }))
}

/// An upstream's base URL split once, at startup.
pub struct Target {
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    /// The base path without a trailing slash (`/v1`, or empty).
    base_path: String,
}

impl Target {
    pub fn new(base: &Uri) -> Option<Self> {
        Some(Self {
            scheme: base.scheme()?.clone(),
            authority: base.authority()?.clone(),
            base_path: base.path().trim_end_matches('/').to_owned(),
        })
    }

    /// `base_url` + the path after `/v1` + the query, as sent by the client.
    pub fn uri(&self, rest: &str, query: Option<&str>) -> Option<Uri> {
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
        let pq = PathAndQuery::try_from(pq).ok()?;
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(pq)
            .build()
            .ok()
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

    #[test]
    fn transformed_endpoints() {
        assert!(is_transformed(&Method::POST, "/chat/completions"));
        assert!(is_transformed(&Method::POST, "/responses"));
        assert!(is_transformed(&Method::POST, "/messages"));
        assert!(!is_transformed(&Method::GET, "/chat/completions"));
        assert!(!is_transformed(&Method::POST, "/embeddings"));
        assert!(!is_transformed(&Method::POST, "/responses/abc/cancel"));
    }
}
