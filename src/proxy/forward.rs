//! The proxy path: read (or stream) the body, route by model, forward, and
//! hand back the upstream's response through an [`ObservedBody`].
//!
//! Each phase is a function returning `Result<_, Stop>`; [`handle`] joins
//! them in order. A request that stops is answered at one edge
//! ([`Edge::answer`]: logged, counted, the OpenAI error shape); one that
//! gets an upstream answer is counted when that answer's body ends.
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
//!    merged in ([`super::session_turn`]); a store that cannot be read
//!    → 503.
//! 5. transform — the model-spec table decides; images are replaced for a
//!    model that cannot see, the rules for every model and line
//!    dedup applied ([`super::prepare`]); the replaced originals
//!    are written in the background.
//! 6. send      — headers rewritten, the body as held (byte for byte when
//!    nothing changed); wait for the response head under the
//!    first-byte and total deadlines (peek, then commit: failures
//!    here still become 502/504). A route with `fallbacks`
//!    ([`send_chain`]): a failure before the head, a 5xx or a 429
//!    moves on to the next upstream the breakers admit, within the
//!    retry budget ([`crate::retries`]); the same body, each
//!    upstream's own headers and credential.
//! 7. learn     — a model of unknown vision whose upstream answers with an
//!    "images not supported" 4xx: retried once with the images
//!    replaced, and remembered.
//! 8. respond   — status and headers passed through (plus the `x-visor-*`
//!    counts); once the originals are on disk the body streams
//!    through `ObservedBody` (idle-gap and total deadlines, usage,
//!    metrics, the session's reply stored before the last bytes).

use std::collections::VecDeque;
use std::sync::Arc;

use http::{HeaderMap, HeaderValue, Method, Request, Response, Version, header};
use http_body_util::BodyExt;
use tokio::time::Instant;

use std::pin::Pin;

use bytes::Bytes;
use tokio::time::Sleep;

use super::answer::refuse;
use super::body::{Finish, InflightGuard, ObservedBody, ProxyBody};
use super::headers::{strip_hop_by_hop, upstream_request_headers};
use super::prepare::{self, Options, Prepared};
use super::request_body::{FormScanner, JsonScanner, WholeBody};
use super::session_turn::{self, Recorder};
use super::usage::UsageObserver;
use super::{AppState, RequestIdExt};
use crate::error::VisorError;
use crate::failure::UpstreamFailure;
use crate::metrics::NO_UPSTREAM;
use crate::transform::{Report, Shape};
use crate::upstream::{
    BodyState, LimitedBody, RequestBody, ResponseBody, SendFailure, UpstreamBody,
};

pub async fn proxy(state: Arc<AppState>, req: Request<RequestBody>) -> Response<ProxyBody> {
    if super::websocket::is_upgrade(&req) {
        return super::websocket::proxy(state, req).await;
    }
    let mut edge = Edge::new(&state);
    match handle(&state, req, &mut edge).await {
        Ok(resp) => resp,
        Err(stop) => edge.answer(stop),
    }
}

/// The phases, in order (see the module's list). Each returns what the next
/// needs, or a [`Stop`] that [`Edge::answer`] turns into visor's answer.
async fn handle(
    state: &Arc<AppState>,
    req: Request<RequestBody>,
    edge: &mut Edge<'_>,
) -> Result<Response<ProxyBody>, Stop> {
    let (mut call, parts, body) = Call::new(state, req)?; // 1. limit
    let (model, held) = read_body(state, &call, &parts, body).await?; // 2. body
    edge.model_read(model.as_deref());
    let index = route(state, model.as_deref())?; // 3. route
    edge.routed(index, model.as_deref());
    let mut grant = limit(state, &parts, model.as_deref(), &held).await?; // 3b. key limits
    let (held, mut session) = open_session(state, &call, &parts, held).await?; // 4. session
    let mut prepared = transform(state, &mut call, &parts, index, &model, held, &session).await?; // 5. transform
    edge.prepared(prepared.as_ref());
    grant.count_context(state, prepared.as_ref());
    // 5b. the key charged for what goes, not for what came (documents read,
    // history inserted).
    if let Some(p) = &prepared {
        grant.charge_sent(state, p.body.len() as u64).await?;
    }
    let sent = send(
        state,
        &call,
        edge,
        parts,
        index,
        &model,
        &prepared,
        &mut session,
    )
    .await;
    let (exchange, resp, timer, retry_head) = match sent {
        Ok(sent) => sent,
        Err(stop) => {
            // No answer: the session's new messages are stored (without a
            // reply) before the client hears why, so what it sent is there
            // when it asks again.
            if let Some(storing) = session.recorder.as_mut().and_then(|r| r.finish(false)) {
                storing.await;
            }
            return Err(stop);
        }
    };
    let learned = learn(
        state,
        &exchange,
        &call,
        edge,
        &model,
        &mut prepared,
        retry_head,
        resp,
        timer,
    )
    .await?; // 7. learn
    let (resp, timer) = match learned {
        Learned::Answer(resp, timer) => (resp, timer),
        Learned::Passed(head, body) => return Ok(edge.passed(head, body)),
    };
    Ok(respond(
        state,
        call,
        &exchange,
        edge,
        prepared,
        session.recorder,
        resp,
        timer,
        grant,
    )
    .await) // 8. respond
}

/// Why a request stops before an upstream answer streams back.
enum Stop {
    /// Refused by visor itself: counted with no upstream.
    Refused(VisorError),
    /// The upstream failed: the error and its `visor_upstream_errors_total`
    /// kind; counted with the upstream.
    Upstream(VisorError, UpstreamFailure),
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

/// Where visor's own answers to a proxied request leave: each is logged and
/// counted here, once. (An upstream answer that streams back is counted
/// once when its body ends, by [`Finish`].)
struct Edge<'a> {
    state: &'a AppState,
    started: Instant,
    /// Once routed: the upstream's name and the model's metric label.
    routed: Option<(Arc<str>, String)>,
    /// Once the body was read: the model's metric label (a request refused
    /// for its model, 404 or 403, is counted under it).
    model: Option<String>,
    /// Once transformed: the `x-visor-*` counts.
    counts: Option<Counts>,
}

/// What the transforms did to a request, for the `x-visor-*` headers and the
/// log line.
#[derive(Clone, Copy)]
struct Counts {
    images_replaced: usize,
    media_replaced: usize,
    bytes_saved: i64,
    history_used: usize,
}

impl Counts {
    fn of(report: &Report) -> Self {
        Counts {
            images_replaced: report.images_replaced,
            media_replaced: report.media_replaced,
            bytes_saved: report.bytes_saved,
            history_used: report.history_used,
        }
    }
}

impl<'a> Edge<'a> {
    fn new(state: &'a AppState) -> Self {
        Edge {
            state,
            started: Instant::now(),
            routed: None,
            model: None,
            counts: None,
        }
    }

    fn model_read(&mut self, model: Option<&str>) {
        if let Some(m) = model {
            self.model = Some(self.state.metrics.model_label(m));
        }
    }

    fn routed(&mut self, index: usize, model: Option<&str>) {
        let name = self.state.upstream_names[index].clone();
        let label = self.state.metrics.model_label(model.unwrap_or(""));
        tracing::debug!(upstream = %name, model = %label, "routed");
        self.routed = Some((name, label));
    }

    fn prepared(&mut self, prepared: Option<&Prepared>) {
        self.counts = prepared.map(|p| Counts::of(&p.report));
    }

    /// The model's metric label (empty before routing).
    fn model_label(&self) -> String {
        self.routed
            .as_ref()
            .map(|(_, m)| m.clone())
            .unwrap_or_default()
    }

    fn count(&self, status: http::StatusCode) {
        let (upstream, model) = match &self.routed {
            Some((u, m)) => (&**u, m.as_str()),
            None => (NO_UPSTREAM, ""),
        };
        self.state
            .metrics
            .requests
            .with_label_values(&[upstream, model, status.as_str()])
            .inc();
    }

    /// Visor's answer to a request that stopped.
    fn answer(self, stop: Stop) -> Response<ProxyBody> {
        match stop {
            Stop::Refused(e) => match &self.model {
                None => refuse(self.state, e),
                Some(model) => {
                    tracing::info!(error = e.label(), status = e.status().as_u16(), model = %model, "refused");
                    self.state
                        .metrics
                        .requests
                        .with_label_values(&[NO_UPSTREAM, model, e.status().as_str()])
                        .inc();
                    e.into_response()
                }
            },
            Stop::Upstream(e, kind) => {
                let upstream = self.routed.as_ref().map_or("", |(u, _)| &**u);
                self.state.metrics.upstream_error(upstream, kind.label());
                self.count(e.status());
                let counts = self.counts;
                tracing::warn!(
                    upstream = %upstream,
                    error = e.label(),
                    kind = kind.label(),
                    images_replaced = counts.map_or(0, |c| c.images_replaced),
                    media_replaced = counts.map_or(0, |c| c.media_replaced),
                    bytes_saved = counts.map_or(0, |c| c.bytes_saved),
                    "upstream request failed"
                );
                let mut resp = e.into_response();
                if let Some(c) = counts {
                    visor_counts(resp.headers_mut(), c);
                }
                resp
            }
        }
    }

    /// An upstream 4xx read whole to look for an image refusal, and passed
    /// back as it was.
    fn passed(&self, mut head: http::response::Parts, body: Bytes) -> Response<ProxyBody> {
        for_the_client(&mut head);
        if let Some(c) = self.counts {
            visor_counts(&mut head.headers, c);
        }
        self.count(head.status);
        if let Some((upstream, _)) = &self.routed {
            self.state
                .metrics
                .request_duration
                .with_label_values(&[&**upstream])
                .observe(self.started.elapsed().as_secs_f64());
        }
        Response::from_parts(head, ProxyBody::from(body))
    }
}

/// One request on its way, as the phases pass it on.
struct Call {
    started: Instant,
    inflight: InflightGuard,
    request_id: HeaderValue,
    /// The path after `/v1`.
    rest: String,
    /// The API shape of a transformed endpoint (`POST` only).
    shape: Option<Shape>,
    opts: Options,
    /// The request's total deadline.
    deadline: Instant,
    /// Set when a streamed body runs over `max_body_bytes`.
    exceeded: Arc<BodyState>,
}

impl Call {
    /// Phase 1: the request's head read, its options checked, a declared
    /// length over `max_body_bytes` refused before any byte is read.
    fn new(
        state: &AppState,
        req: Request<RequestBody>,
    ) -> Result<(Call, http::request::Parts, RequestBody), Stop> {
        let started = Instant::now();
        let inflight = InflightGuard::new(state.metrics.clone());
        let request_id = req
            .extensions()
            .get::<RequestIdExt>()
            .map(|r| r.0.clone())
            .unwrap_or_else(|| HeaderValue::from_static("req_unknown"));
        let (parts, body) = req.into_parts();
        let rest = parts.uri.path()["/v1".len()..].to_owned();
        let shape = match parts.method == Method::POST {
            true => Shape::of_path(&rest),
            false => None,
        };
        let opts = match shape {
            Some(_) => {
                // A malformed x-visor-history is refused even without
                // x-visor-session (the header table says 400).
                session_turn::check_history(&parts.headers)?;
                Options::from_headers(&parts.headers)?
            }
            None => Options::default(),
        };
        let limit = state.config.server.max_body_bytes;
        if content_length(&parts.headers).is_some_and(|n| n > limit) {
            return Err(VisorError::BodyTooLarge { limit }.into());
        }
        let call = Call {
            started,
            inflight,
            request_id,
            rest,
            shape,
            opts,
            // A body visor reads before forwarding must arrive within the
            // request's total deadline (no slow-loris uploads holding a
            // worker's memory).
            deadline: started + state.config.server.request_timeout,
            exceeded: Arc::new(BodyState::default()),
        };
        Ok((call, parts, body))
    }
}

/// The request body as phase 2 leaves it.
enum Held {
    /// Read whole and validated (a transformed endpoint).
    Whole(Bytes),
    /// Streamed through (its first chunks held while the model was looked
    /// for).
    Streamed(UpstreamBody),
}

/// Phase 2: a transformed endpoint's body read whole and validated; any
/// other streamed, its model read from the first chunks when the route
/// depends on it.
async fn read_body(
    state: &AppState,
    call: &Call,
    parts: &http::request::Parts,
    body: RequestBody,
) -> Result<(Option<String>, Held), Stop> {
    let limit = state.config.server.max_body_bytes;
    if call.shape.is_some() {
        let hint = content_length(&parts.headers).unwrap_or(0);
        return match tokio::time::timeout_at(call.deadline, read_validated(body, limit, hint)).await
        {
            Ok(Ok((model, bytes))) => Ok((model, Held::Whole(bytes))),
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(VisorError::BodyTimeout.into()),
        };
    }
    // The model is read when the route depends on it, or when the caller's
    // `[[key]]` allows only some models.
    let key = caller_key(state, &parts.extensions).and_then(|i| state.limits.key(i));
    let restricted = key.is_some_and(|k| !k.any_model);
    // A key with a token limit is charged by the body's size: one that
    // does not say it (chunked) is read whole first, so it is counted.
    let metered = key.is_some_and(|k| k.tokens_per_minute.is_some())
        && content_length(&parts.headers).is_none();
    if !state.route_by_model && !restricted {
        let rest = LimitedBody::new(body, limit, call.exceeded.clone());
        let mut b = UpstreamBody {
            prefix: VecDeque::new(),
            rest: Some(rest),
        };
        if metered {
            match tokio::time::timeout_at(call.deadline, read_rest(&mut b, &call.exceeded, limit))
                .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => return Err(VisorError::BodyTimeout.into()),
            }
        }
        return Ok((None, Held::Streamed(b)));
    }
    // The route depends on the model: read it from the body whatever the
    // Content-Type says (a JSON object, or a multipart form's `model`
    // field); a body that cannot be read is refused, never guessed.
    let form = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| FormScanner::for_content_type(v.as_bytes()));
    // For a key limited to some models the whole body is read first: a body
    // that names a second model after the one checked (most parsers take
    // the last) is refused, never sent.
    let form = form.map(|f| if restricted { f.whole() } else { f });
    let scan = scan_model(body, limit, call.exceeded.clone(), form, restricted);
    let read = async {
        let (model, mut b) = scan.await?;
        if metered {
            read_rest(&mut b, &call.exceeded, limit).await?;
        }
        Ok::<_, VisorError>((model, b))
    };
    match tokio::time::timeout_at(call.deadline, read).await {
        Ok(Ok((model, b))) => Ok((model, Held::Streamed(b))),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(VisorError::BodyTimeout.into()),
    }
}

/// Reads what is left of a streamed body into its held chunks (within its
/// `max_body_bytes`), so its size is known before it goes.
async fn read_rest(
    b: &mut UpstreamBody,
    exceeded: &BodyState,
    limit: u64,
) -> Result<(), VisorError> {
    let Some(mut rest) = b.rest.take() else {
        return Ok(());
    };
    while let Some(frame) = rest.frame().await {
        match frame {
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    b.prefix.push_back(data);
                }
            }
            Err(_) if exceeded.exceeded() => {
                return Err(VisorError::BodyTooLarge { limit });
            }
            Err(_) => return Err(VisorError::BadRequest("the request body could not be read")),
        }
    }
    Ok(())
}

/// A request sent, up to its response head: the exchange, the head (and
/// body), the total deadline's timer, and what a learned-refusal retry
/// needs.
type Sent<'s> = (
    Exchange<'s>,
    Response<ResponseBody>,
    Pin<Box<Sleep>>,
    Option<RetryHead>,
);

/// Phase 6: the request sent — to its upstream, or along its fallbacks —
/// until a response head.
#[expect(
    clippy::too_many_arguments,
    reason = "the request's parts, until issue 30 gives each phase a narrow context"
)]
async fn send<'s>(
    state: &'s Arc<AppState>,
    call: &Call,
    edge: &mut Edge<'_>,
    parts: http::request::Parts,
    index: usize,
    model: &Option<String>,
    prepared: &Option<Prepared>,
    session: &mut Session,
) -> Result<Sent<'s>, Stop> {
    let chain = fallback_chain(state, call, &parts, index, session).await?;
    match chain {
        None => {
            let (up_req, retry_head) =
                upstream_request(state, call, parts, index, prepared, session)?;
            let exchange = Exchange::new(state, call, index);
            let (resp, timer) = exchange.run(up_req, &call.exceeded, exchange.sent).await?;
            Ok((exchange, resp, timer, retry_head))
        }
        Some(chain) => {
            let to = Chain {
                upstreams: chain,
                model: model.as_deref(),
            };
            send_chain(state, call, edge, &parts, to, prepared, session).await
        }
    }
}

/// Phase 3: the first upstream whose globs match; no model → the first
/// upstream; a model nobody takes → 404.
/// What phase 3b let through: the caller's `[[key]]` (when it has one)
/// and the tokens its request was estimated at.
struct Grant {
    key: Option<usize>,
    /// The key's name for metrics (`api_keys`, or `none` without a key).
    label: String,
    estimate: u64,
    /// Where the key's windows stand with this request counted: its
    /// `x-ratelimit-*` headers.
    standing: Option<crate::limits::Verdict>,
}

impl Grant {
    /// The body that goes is `bytes` long: when that is more than the
    /// estimate, the key is charged the rest, and refused (429, nothing
    /// sent) when its window has no room for all of it.
    async fn charge_sent(&mut self, state: &AppState, bytes: u64) -> Result<(), Stop> {
        let Some(i) = self.key else { return Ok(()) };
        let sent = bytes / crate::limits::BYTES_PER_TOKEN;
        if sent <= self.estimate {
            return Ok(());
        }
        let Some(verdict) = state
            .limits
            .charge_more(
                i,
                sent - self.estimate,
                sent,
                self.standing.as_ref().map(|v| v.window),
            )
            .await
        else {
            return Ok(());
        };
        if let (Some(over), Some(k)) = (verdict.over, state.limits.key(i)) {
            let mut verdict = verdict;
            verdict.requests = self.standing.as_ref().and_then(|v| v.requests);
            return Err(rate_limited(k, &verdict, over, sent).into());
        }
        if let Some(v) = self.standing.as_mut() {
            v.tokens = verdict.tokens;
        }
        self.estimate = sent;
        Ok(())
    }

    /// The context a key sends: body bytes received, and the bytes dedup
    /// removed (context sent again).
    fn count_context(&self, state: &AppState, prepared: Option<&Prepared>) {
        let Some(p) = prepared else { return };
        let m = &state.metrics;
        m.context_received
            .with_label_values(&[&self.label])
            .inc_by(self.estimate * crate::limits::BYTES_PER_TOKEN);
        if p.report.messages > state.config.sessions.max_depth as usize {
            m.context_long.with_label_values(&[&self.label]).inc();
        }
        if p.report.lines_omitted + p.report.items_omitted > 0 {
            m.context_resent
                .with_label_values(&[&self.label])
                .inc_by(p.report.bytes_saved_dedup.max(0) as u64);
        }
    }
}

/// The `[[key]]` a request is held to: its own, or — without a key — the
/// `[[key]]` that has none, if there is one.
pub(super) fn caller_key(state: &AppState, extensions: &http::Extensions) -> Option<usize> {
    use super::headers::Caller;
    match extensions.get::<Caller>().copied() {
        Some(Caller::Key(i)) => Some(i),
        Some(Caller::Unlimited) => None,
        Some(Caller::Anonymous) | None => state.config.keys.iter().position(|k| k.key.is_none()),
    }
}

/// Phase 3b: the caller's `[[key]]` — a model outside its `models` is
/// 403, a request over its limits 429 (with `Retry-After` and the
/// `x-ratelimit-*` headers).
async fn limit(
    state: &AppState,
    parts: &http::request::Parts,
    model: Option<&str>,
    held: &Held,
) -> Result<Grant, Stop> {
    use super::headers::Caller;
    let caller = parts
        .extensions
        .get::<Caller>()
        .copied()
        .unwrap_or(Caller::Anonymous);
    let bytes = match held {
        Held::Whole(b) => b.len() as u64,
        // Read whole when it does not say its length and the key counts
        // tokens (above).
        Held::Streamed(b) => content_length(&parts.headers)
            .unwrap_or_else(|| b.prefix.iter().map(|c| c.len() as u64).sum()),
    };
    let estimate = bytes / crate::limits::BYTES_PER_TOKEN;
    let key = caller_key(state, &parts.extensions);
    let label = match (caller, key.and_then(|i| state.limits.key(i))) {
        (_, Some(k)) => k.name.clone(),
        (Caller::Unlimited, None) => "api_keys".to_owned(),
        _ => "none".to_owned(),
    };
    let Some(i) = key.filter(|&i| state.limits.key(i).is_some()) else {
        return Ok(Grant {
            key: None,
            label,
            estimate,
            standing: None,
        });
    };
    // A request with a body (a listing like `GET /v1/models` has none).
    let bodied = match held {
        Held::Whole(b) => !b.is_empty(),
        Held::Streamed(b) => {
            b.prefix.iter().any(|c| !c.is_empty())
                || b.rest.is_some()
                || content_length(&parts.headers).is_some_and(|n| n > 0)
        }
    };
    let standing = admit_standing(state, i, model, bodied, estimate).await?;
    Ok(Grant {
        key: Some(i),
        label,
        estimate,
        standing,
    })
}

/// Whether `[[key]]` `i` may send a request for `model` estimated at
/// `estimate` tokens now: 403 for a model outside its `models`, 429 over
/// its limits (the request is counted in its window either way it goes).
/// The HTTP path and each `response.create` of the WebSocket mode.
pub(super) async fn admit(
    state: &AppState,
    i: usize,
    model: Option<&str>,
    bodied: bool,
    estimate: u64,
) -> Result<(), VisorError> {
    admit_standing(state, i, model, bodied, estimate)
        .await
        .map(drop)
}

/// [`admit`], with the key's standing after the request when it goes (for
/// its `x-ratelimit-*` headers).
async fn admit_standing(
    state: &AppState,
    i: usize,
    model: Option<&str>,
    bodied: bool,
    estimate: u64,
) -> Result<Option<crate::limits::Verdict>, VisorError> {
    let Some(k) = state.limits.key(i) else {
        return Ok(None);
    };
    if let Some(m) = model
        && !k.allows(m)
    {
        return Err(VisorError::ModelNotAllowed {
            key: k.name.clone(),
            model: m.to_owned(),
        });
    }
    if model.is_none() && !k.any_model && bodied {
        // A body whose model visor cannot find might name one to the
        // upstream (`MODEL` to a case-blind reader, a form part written
        // another way): a key limited to some models must name it plainly.
        return Err(VisorError::Unroutable(format!(
            "key `{}` may use only some models, and this body names none visor can read",
            k.name
        )));
    }
    let verdict = state.limits.check(i, estimate).await;
    let Some(over) = verdict.over else {
        return Ok(Some(verdict));
    };
    Err(rate_limited(k, &verdict, over, estimate))
}

/// The 429 for a request over key `k`'s `over` limit: `Retry-After` and
/// the `x-ratelimit-*` headers of its standing.
pub(super) fn rate_limited(
    k: &crate::limits::KeyLimits,
    verdict: &crate::limits::Verdict,
    over: crate::limits::Limit,
    asked: u64,
) -> VisorError {
    let headers = rate_limit_headers(verdict);
    let reset = verdict
        .requests
        .or(verdict.tokens)
        .map_or(60, |s| s.reset.as_secs().max(1));
    tracing::info!(key = %k.name, limit = over.label(), "rate limited");
    let detail = match (over, verdict.requests, verdict.tokens) {
        (crate::limits::Limit::Requests, Some(r), _) => {
            format!("{} requests per minute, all used", r.limit)
        }
        (crate::limits::Limit::Tokens, _, Some(t)) => format!(
            "this request is about {asked} tokens, and {} of its {} tokens per minute are left",
            t.remaining, t.limit
        ),
        _ => format!("{} per minute", over.label()),
    };
    VisorError::RateLimited {
        key: k.name.clone(),
        detail,
        retry_after_secs: reset,
        headers,
    }
}

/// The `x-ratelimit-*` headers of a key's standing, as OpenAI sends them:
/// on every answer to a request of a limited key, 429 or not.
fn rate_limit_headers(verdict: &crate::limits::Verdict) -> Vec<(&'static str, String)> {
    let mut headers = Vec::new();
    let mut add = |kind: &str, s: Option<crate::limits::Standing>| {
        if let Some(s) = s {
            let reset = format!("{}s", s.reset.as_secs().max(1));
            let (l, r, t) = match kind {
                "requests" => (
                    "x-ratelimit-limit-requests",
                    "x-ratelimit-remaining-requests",
                    "x-ratelimit-reset-requests",
                ),
                _ => (
                    "x-ratelimit-limit-tokens",
                    "x-ratelimit-remaining-tokens",
                    "x-ratelimit-reset-tokens",
                ),
            };
            headers.push((l, s.limit.to_string()));
            headers.push((r, s.remaining.to_string()));
            headers.push((t, reset));
        }
    };
    add("requests", verdict.requests);
    add("tokens", verdict.tokens);
    headers
}

fn route(state: &AppState, model: Option<&str>) -> Result<usize, Stop> {
    let index = match model {
        None => Some(0),
        Some(m) => state.config.upstreams.iter().position(|u| u.matches(m)),
    };
    index.ok_or_else(|| VisorError::NoRoute(model.unwrap_or_default().to_owned()).into())
}

/// What phase 4 found of a session.
#[derive(Default)]
struct Session {
    history_used: usize,
    recorder: Option<Recorder>,
    /// The body, when it is streamed (no session applies then).
    streamed: Option<UpstreamBody>,
}

/// Phase 4: with `x-visor-session`, the stored history merged into a body
/// held whole; a store that cannot be read → 503.
async fn open_session(
    state: &Arc<AppState>,
    call: &Call,
    parts: &http::request::Parts,
    held: Held,
) -> Result<(Option<Bytes>, Session), Stop> {
    let bytes = match held {
        Held::Streamed(b) => {
            let s = Session {
                streamed: Some(b),
                ..Session::default()
            };
            return Ok((None, s));
        }
        Held::Whole(bytes) => bytes,
    };
    let Some(shape) = call.shape else {
        return Ok((Some(bytes), Session::default()));
    };
    let Some(id) = session_turn::requested(&parts.headers)? else {
        return Ok((Some(bytes), Session::default()));
    };
    let opened = session_turn::open(state, shape, &parts.headers, &id, &bytes).await?;
    let s = Session {
        history_used: opened.history_used,
        recorder: Some(opened.recorder),
        streamed: None,
    };
    Ok((Some(opened.body), s))
}

/// Phase 5: the pure rewrite of a body visor holds whole.
async fn transform(
    state: &Arc<AppState>,
    call: &mut Call,
    parts: &http::request::Parts,
    index: usize,
    model: &Option<String>,
    held: Option<Bytes>,
    session: &Session,
) -> Result<Option<Prepared>, Stop> {
    let (Some(shape), Some(bytes)) = (call.shape, held) else {
        return Ok(None);
    };
    let asker = prepare::Asker {
        headers: &parts.headers,
        upstream: index,
    };
    let opts = std::mem::take(&mut call.opts);
    // Read under the request's deadline: past it, 504 and nothing sent.
    let (model, deadline) = (model.as_deref(), call.deadline);
    let mut p = prepare::prepare_by(state, shape, model, bytes, opts, asker, deadline).await?;
    p.report.history_used = session.history_used;
    Ok(Some(p))
}

/// The method, URI and headers of the upstream request, kept while an
/// upstream refusal may still be learned from (the retry reuses them).
type RetryHead = (Method, http::Uri, HeaderMap);

/// Phase 6 (first half): the upstream request — its URI under the
/// upstream's base URL, headers rewritten, the body as held (byte for byte
/// when nothing changed).
fn upstream_request(
    state: &AppState,
    call: &Call,
    mut parts: http::request::Parts,
    index: usize,
    prepared: &Option<Prepared>,
    session: &mut Session,
) -> Result<(Request<UpstreamBody>, Option<RetryHead>), Stop> {
    let uri = state
        .upstreams
        .uri(index, &call.rest, parts.uri.query())
        .ok_or(VisorError::BadRequest(
            "the request target is not a valid URL path",
        ))?;
    upstream_request_headers(
        &mut parts.headers,
        &state.config.upstreams[index],
        state.keys.is_set(),
        &call.request_id,
    );
    parts.uri = uri;
    parts.version = Version::HTTP_11;
    parts.extensions = http::Extensions::new();
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
    let body = match prepared {
        Some(p) => {
            set_content_length(&mut parts.headers, p.body.len());
            p.upstream_body()
        }
        None => session.streamed.take().unwrap_or_default(),
    };
    Ok((Request::from_parts(parts, body), retry_head))
}

/// A streamed body (one visor does not transform) is held whole for a
/// replay on a fallback only up to this size; a larger one goes to the
/// routed upstream alone.
pub const REPLAY_LIMIT: u64 = 4 * 1024 * 1024;

/// The upstreams a request may go to, when it may fall back: its route has
/// `fallbacks` and its body can be sent again (a transformed body is held
/// already; a streamed one is read whole here up to [`REPLAY_LIMIT`]).
/// `None`: the routed upstream alone, exactly as without fallbacks.
async fn fallback_chain<'s>(
    state: &'s AppState,
    call: &Call,
    parts: &http::request::Parts,
    index: usize,
    session: &mut Session,
) -> Result<Option<&'s [usize]>, Stop> {
    let upstream = &state.config.upstreams[index];
    if !upstream.has_fallbacks() {
        return Ok(None);
    }
    let Some(body) = session.streamed.as_mut() else {
        return Ok(Some(&upstream.chain));
    };
    let limit = REPLAY_LIMIT.min(state.config.server.max_body_bytes);
    if content_length(&parts.headers).is_some_and(|n| n > limit) {
        return Ok(None);
    }
    let UpstreamBody { prefix, rest } = body;
    let Some(stream) = rest.as_mut() else {
        return Ok(Some(&upstream.chain));
    };
    let mut held: u64 = prefix.iter().map(|b| b.len() as u64).sum();
    let read = async {
        while let Some(frame) = stream.frame().await {
            let frame = frame.map_err(|_| match call.exceeded.exceeded() {
                true => VisorError::BodyTooLarge {
                    limit: state.config.server.max_body_bytes,
                },
                false => VisorError::BadRequest("the request body could not be read"),
            })?;
            if let Ok(data) = frame.into_data() {
                held += data.len() as u64;
                prefix.push_back(data);
                if held > limit {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    };
    let whole = match tokio::time::timeout_at(call.deadline, read).await {
        Ok(Ok(whole)) => whole,
        Ok(Err(e)) => return Err(Stop::Refused(e)),
        Err(_) => return Err(VisorError::BodyTimeout.into()),
    };
    if !whole {
        // Too large to hold: what was read goes first, the rest streams.
        return Ok(None);
    }
    *rest = None;
    Ok(Some(&upstream.chain))
}

/// Where [`send_chain`] may send a request.
struct Chain<'s, 'm> {
    /// The routed upstream, then its fallbacks.
    upstreams: &'s [usize],
    model: Option<&'m str>,
}

/// A copy of the client's request head, for one more attempt.
fn copy_head(parts: &http::request::Parts) -> http::request::Parts {
    let mut req = Request::new(());
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = parts.uri.clone();
    *req.version_mut() = parts.version;
    *req.headers_mut() = parts.headers.clone();
    req.into_parts().0
}

/// Phase 6 along a fallback chain: the first upstream whose breaker admits
/// the request (the routed one if every breaker is open), then, while an
/// attempt fails before its response head (connect error, reset, first-byte
/// timeout) or answers 5xx or 429, the next admitted upstream, within the
/// retry budget. Each attempt gets the same body and that upstream's own
/// headers and credential. Once a response head is taken (any other
/// status), nothing is retried.
async fn send_chain<'s>(
    state: &'s Arc<AppState>,
    call: &Call,
    edge: &mut Edge<'_>,
    parts: &http::request::Parts,
    chain: Chain<'s, '_>,
    prepared: &Option<Prepared>,
    session: &mut Session,
) -> Result<Sent<'s>, Stop> {
    let retries = &state.retries;
    retries.budget.record_request();
    // A streamed body, held whole by `fallback_chain`: sent again as is.
    let replay = session.streamed.as_ref().map(|b| b.prefix.clone());
    let upstreams = chain.upstreams;
    let first = upstreams
        .iter()
        .enumerate()
        .find_map(|(pos, &i)| retries.admit(i).map(|a| (pos, i, a)));
    let (mut pos, mut index, mut attempt) = match first {
        Some(f) => f,
        None => {
            let i = upstreams[0];
            let forced = retries.force(i).ok_or(VisorError::NoRoute(String::new()))?;
            (0, i, forced)
        }
    };
    loop {
        edge.routed(index, chain.model);
        if let Some(prefix) = &replay {
            session.streamed = Some(UpstreamBody {
                prefix: prefix.clone(),
                rest: None,
            });
        }
        let (up_req, retry_head) =
            upstream_request(state, call, copy_head(parts), index, prepared, session)?;
        let exchange = Exchange::new(state, call, index);
        let result = exchange.run(up_req, &call.exceeded, exchange.sent).await;
        let (reason, hold) = match &result {
            Ok((resp, _)) if resp.status().is_server_error() => (UpstreamFailure::Status5xx, None),
            Ok((resp, _)) if resp.status() == http::StatusCode::TOO_MANY_REQUESTS => (
                UpstreamFailure::Status429,
                crate::retries::retry_after(resp.headers().get(header::RETRY_AFTER)),
            ),
            Ok(_) => {
                attempt.succeeded();
                let (resp, timer) = result?;
                return Ok((exchange, resp, timer, retry_head));
            }
            Err(Stop::Upstream(_, kind)) if kind.retryable() => (*kind, None),
            // The request's own deadline, or visor refused it (too large):
            // no other upstream would do better.
            Err(_) => {
                let (resp, timer) = result?;
                return Ok((exchange, resp, timer, retry_head));
            }
        };
        attempt.failed(hold);
        let next = upstreams
            .iter()
            .enumerate()
            .skip(pos + 1)
            .find_map(|(p, &i)| retries.admit(i).map(|a| (p, i, a)));
        let name = &state.upstream_names[index];
        let next = match next {
            Some(n) if retries.budget.try_retry() => n,
            Some(_) => {
                tracing::warn!(upstream = %name, reason = reason.label(), "retry budget spent: no fallback");
                let (resp, timer) = result?;
                return Ok((exchange, resp, timer, retry_head));
            }
            None => {
                let (resp, timer) = result?;
                return Ok((exchange, resp, timer, retry_head));
            }
        };
        // This attempt is over: counted at its upstream, its answer (if
        // any) dropped unread, which closes its connection.
        state
            .metrics
            .retries
            .with_label_values(&[&**name, reason.label()])
            .inc();
        if reason != UpstreamFailure::Status429 {
            state.metrics.upstream_error(name, reason.label());
        }
        tracing::info!(
            upstream = %name,
            reason = reason.label(),
            fallback = %state.upstream_names[next.1],
            "falling back"
        );
        drop(result);
        (pos, index, attempt) = next;
    }
}

/// What phase 7 leaves (one value, moved once: its size does not matter).
#[expect(
    clippy::large_enum_variant,
    reason = "one value, moved once: its size does not matter"
)]
enum Learned {
    /// The upstream's answer to stream back (to the retry, if there was one).
    Answer(Response<ResponseBody>, Pin<Box<Sleep>>),
    /// An upstream 4xx read whole that was not about images: passed back as
    /// it was.
    Passed(http::response::Parts, Bytes),
}

/// Phase 7: a model of unknown vision whose upstream answers with an
/// "images not supported" 4xx is retried once with the images replaced, and
/// remembered as non-vision.
#[expect(
    clippy::too_many_arguments,
    reason = "the request's parts, until issue 30 gives each phase a narrow context"
)]
async fn learn(
    state: &Arc<AppState>,
    exchange: &Exchange<'_>,
    call: &Call,
    edge: &mut Edge<'_>,
    model: &Option<String>,
    prepared: &mut Option<Prepared>,
    retry_head: Option<RetryHead>,
    resp: Response<ResponseBody>,
    timer: Pin<Box<Sleep>>,
) -> Result<Learned, Stop> {
    let Some(p) = prepared.as_mut() else {
        return Ok(Learned::Answer(resp, timer));
    };
    let (Some((method, uri, mut headers)), true) = (retry_head, p.learn.is_some()) else {
        return Ok(Learned::Answer(resp, timer));
    };
    if !may_be_refusal(resp.status(), resp.headers()) {
        return Ok(Learned::Answer(resp, timer));
    }
    let Some(learn) = p.learn.take() else {
        return Ok(Learned::Answer(resp, timer));
    };
    let (head, incoming) = resp.into_parts();
    let error_body = read_error_body(incoming, exchange.head_deadline, &exchange.upstream).await?;
    let model = model.as_deref().unwrap_or("");
    let Some(prepare::Retry {
        prepared: retry,
        lesson,
    }) = prepare::after_refusal(state, &learn, model, &error_body).await
    else {
        // Not about what it was assumed to take: the upstream's answer,
        // as it was.
        return Ok(Learned::Passed(head, error_body));
    };
    set_content_length(&mut headers, retry.body.len());
    let mut req = Request::new(retry.upstream_body());
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    let history_used = p.report.history_used;
    *p = retry;
    p.report.history_used = history_used;
    edge.prepared(Some(p));
    let (resp, timer) = exchange.run(req, &call.exceeded, Instant::now()).await?;
    if resp.status().is_success() {
        prepare::learn(state, lesson).await;
    }
    Ok(Learned::Answer(resp, timer))
}

/// Phase 8: status and headers passed through (plus the `x-visor-*`
/// counts); once the replaced originals are on disk, the body streams back
/// through an [`ObservedBody`] that counts the request when it ends.
#[expect(
    clippy::too_many_arguments,
    reason = "the request's parts, until issue 30 gives each phase a narrow context"
)]
async fn respond(
    state: &Arc<AppState>,
    call: Call,
    exchange: &Exchange<'_>,
    edge: &Edge<'_>,
    mut prepared: Option<Prepared>,
    recorder: Option<Recorder>,
    resp: Response<ResponseBody>,
    timer: Pin<Box<Sleep>>,
    grant: Grant,
) -> Response<ProxyBody> {
    let upstream = exchange.upstream.clone();
    let (mut head, incoming) = resp.into_parts();
    if head.status.is_server_error() {
        state
            .metrics
            .upstream_error(&upstream, UpstreamFailure::Status5xx.label());
    }
    for_the_client(&mut head);
    // A limited key's standing, in place of the provider's own (the key is
    // what the client is held to).
    if let Some(v) = &grant.standing {
        for (name, value) in rate_limit_headers(v) {
            if let Ok(value) = HeaderValue::from_str(&value) {
                head.headers.insert(name, value);
            }
        }
    }
    if let Some(p) = prepared.as_mut() {
        visor_counts(&mut head.headers, Counts::of(&p.report));
        // The replaced images are on disk before the response is returned
        // (the write overlapped the upstream call).
        if let Some(saving) = p.saving.take() {
            let _ = saving.await;
        }
    }
    let usage = UsageObserver::for_response(&head.headers);
    let mut recorder = recorder;
    if let Some(rec) = recorder.as_mut() {
        rec.head(head.status, &head.headers);
    }
    // For the log line (the retry after a refusal may replace more images).
    let counts = prepared.as_ref().map(|p| Counts::of(&p.report));
    let finish = Finish {
        metrics: state.metrics.clone(),
        upstream,
        model: edge.model_label(),
        status: head.status.as_u16(),
        request_id: call.request_id,
        started: call.started,
        sent: exchange.sent,
        inflight: call.inflight,
        images_replaced: counts.map_or(0, |c| c.images_replaced),
        media_replaced: counts.map_or(0, |c| c.media_replaced),
        bytes_saved: counts.map_or(0, |c| c.bytes_saved),
        on_usage: grant.key.map(|i| {
            let state = state.clone();
            let estimate = grant.estimate;
            Box::new(move |prompt: Option<u64>, completion: u64| {
                // The prompt as the estimate charged it when the provider
                // did not say.
                let used = prompt.unwrap_or(estimate) + completion;
                let s = state.clone();
                state.tasks.spawn(async move {
                    s.limits.correct(i, estimate, used).await;
                });
            }) as super::body::Charge
        }),
    };
    let mut observed = ObservedBody::new(
        incoming,
        usage,
        state.config.server.idle_timeout,
        call.deadline,
        timer,
        finish,
    );
    if let Some(rec) = recorder {
        observed = observed.with_session(rec);
    }
    Response::from_parts(head, ProxyBody::Upstream(Box::new(observed)))
}

/// One request/response-head exchange with the chosen upstream, under the
/// first-byte and total deadlines.
struct Exchange<'a> {
    state: &'a Arc<AppState>,
    index: usize,
    upstream: Arc<str>,
    /// When the request was first sent upstream.
    sent: Instant,
    head_deadline: Instant,
    deadline: Instant,
    limit: u64,
}

impl<'a> Exchange<'a> {
    fn new(state: &'a Arc<AppState>, call: &Call, index: usize) -> Self {
        let server = &state.config.server;
        let sent = Instant::now();
        Exchange {
            state,
            index,
            upstream: state.upstream_names[index].clone(),
            sent,
            head_deadline: (sent + server.first_byte_timeout).min(call.deadline),
            deadline: call.deadline,
            limit: server.max_body_bytes,
        }
    }

    /// Phase 6 (second half): sends `req` and waits for the response head.
    async fn run(
        &self,
        req: Request<UpstreamBody>,
        exceeded: &BodyState,
        sent: Instant,
    ) -> Result<(Response<ResponseBody>, Pin<Box<Sleep>>), Stop> {
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
                        return Err(Stop::Refused(VisorError::BodyTooLarge { limit }));
                    }
                    // The client went away mid-upload: its doing, not the
                    // upstream's (no upstream error counted).
                    SendFailure::ClientBody => {
                        return Err(Stop::Refused(VisorError::BadRequest(
                            "the request body could not be read: the client stopped sending it",
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
                // The client's or visor's own failures returned above.
                let kind = UpstreamFailure::of_send(failure).unwrap_or(UpstreamFailure::Reset);
                Err(Stop::Upstream(e, kind))
            }
            Err(()) => {
                let (which, kind) = if self.head_deadline >= self.deadline {
                    ("request timeout", UpstreamFailure::RequestTimeout)
                } else {
                    ("first byte timeout", UpstreamFailure::FirstByteTimeout)
                };
                let e = VisorError::UpstreamTimeout { upstream, which };
                Err(Stop::Upstream(e, kind))
            }
        }
    }
}

/// The `x-visor-*` counts of a transformed endpoint.
fn visor_counts(headers: &mut HeaderMap, report: Counts) {
    let num = |n: i64| HeaderValue::from(n);
    headers.insert(
        header::HeaderName::from_static("x-visor-images-replaced"),
        num(report.images_replaced as i64),
    );
    headers.insert(
        header::HeaderName::from_static("x-visor-media-replaced"),
        num(report.media_replaced as i64),
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
) -> Result<Bytes, (VisorError, UpstreamFailure)> {
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
            UpstreamFailure::Reset,
        )),
        Err(_) => Err((
            VisorError::UpstreamTimeout {
                upstream: upstream.to_owned(),
                which: "first byte timeout",
            },
            UpstreamFailure::FirstByteTimeout,
        )),
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
    mut body: RequestBody,
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
/// the model has passed (`whole`: until the body ends), then the rest flows
/// straight through. An empty body, or a form without a `model` field, has
/// none (the first upstream); a non-empty body that is not a JSON object,
/// or whose `model` is not a string (`whole`: or that names it twice),
/// cannot be routed: [`VisorError::Unroutable`].
async fn scan_model(
    mut body: RequestBody,
    limit: u64,
    exceeded: Arc<BodyState>,
    form: Option<FormScanner>,
    whole: bool,
) -> Result<(Option<String>, UpstreamBody), VisorError> {
    let mut scanner = match form {
        Some(f) => ModelScan::Form(f),
        None => ModelScan::Json(JsonScanner::new()),
    };
    let mut prefix = VecDeque::new();
    let mut held: u64 = 0;
    let mut ended = false;
    while whole || !scanner.found() {
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
            if s.duplicate() {
                return Err(VisorError::Unroutable(
                    "the form has more than one `model` field".to_owned(),
                ));
            }
            if s.too_long() {
                return Err(VisorError::Unroutable(
                    "the form's `model` is longer than 1024 bytes".to_owned(),
                ));
            }
            s.model().map(str::to_owned)
        }
        ModelScan::Json(s) => match (s.model(), s.error()) {
            // Read whole: a duplicate `model` (or anything else wrong after
            // it) is refused.
            (Some(_), Some(why)) if whole => return Err(VisorError::Unroutable(why.to_owned())),
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
    let rest = (!ended).then(|| LimitedBody::new(body, limit - held, exceeded));
    Ok((model, UpstreamBody { prefix, rest }))
}

/// An upstream's response head made visor's: without the hop-by-hop
/// headers, in the protocol of the client's connection (an upstream that
/// answers HTTP/1.0 would otherwise make visor answer its client so, and
/// close a connection the client meant to keep).
fn for_the_client(head: &mut http::response::Parts) {
    strip_hop_by_hop(&mut head.headers);
    head.version = Version::HTTP_11;
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
