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
//!    are written in the background. Then (5c) the prompt cache
//!    ([`crate::prompt_cache`]): breakpoints on a Messages request
//!    to an Anthropic-kind upstream that carries none, a
//!    `prompt_cache_key` for an upstream that opted in; the request
//!    judged against the previous one of its conversation
//!    (`x-visor-cache`, settled at the end).
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

use super::admission::{Asking, Gate, Grant, write_standing};
use super::body::{Finish, InflightGuard, Inspected, ObservedBody, ProxyBody, Traced};
use super::edge::{Counts, Edge, Stop};
use super::headers::{
    Caller, X_VISOR_CACHE, X_VISOR_SESSION, for_the_client, upstream_request_headers,
};
use super::prepare::{self, Options, Prepared, Rewriter};
use super::request_body::{FormScanner, JsonScanner, WholeBody};
use super::session_turn::{self, Recorder, Sessions};
use super::traced::{self, Target};
use super::{AppState, RequestIdExt, Routes};
use crate::api::usage::{SaidObserver, UsageObserver};
use crate::config::Server;
use crate::error::VisorError;
use crate::failure::UpstreamFailure;
use crate::inspector::{Changes, Summary};
use crate::metrics::Metrics;
use crate::prompt_cache::{Asked, Seen};
use crate::telemetry::AttemptSpan;
use crate::transform::Shape;
use crate::upstream::{BodyState, LimitedBody, RequestBody, ResponseBody, UpstreamBody};

/// The body as the client sent it, held for the inspector: a small one
/// copied, a large one stripped of its media as soon as it is read (only
/// after what it shares with its client's body before, when that held
/// nothing to strip).
fn hold_for_inspector(
    state: &AppState,
    call: &mut Call,
    held: &Held,
) -> Option<crate::inspector::Held> {
    match held {
        // A request of a known API was checked to be JSON as it was read.
        Held::Whole(b) if call.shape.is_some() => {
            let (clean, mark) = (call.shared.clean, call.shared.mark.take());
            if b.len() >= super::dedup_states::MIN_BODY && state.inspector.holds(b) {
                count_prefix_read(&state.metrics, "inspector", clean > 0);
            }
            state.inspector.hold_json_after(b, clean, mark)
        }
        Held::Whole(b) => state.inspector.hold(b),
        Held::Streamed(_) => None,
    }
}

/// `visor_prefix_reads_total{part, read}`: `part` read on from the bytes
/// shared with the conversation's previous request, or in full.
fn count_prefix_read(metrics: &Metrics, part: &str, continued: bool) {
    let read = if continued { "continued" } else { "full" };
    metrics.prefix_reads.with_label_values(&[part, read]).inc();
}

/// The phases, in order (see the module's list). Each returns what the next
/// needs, or a [`Stop`] that the edge ([`super::edge::Edge::answer`]) turns
/// into visor's answer.
pub async fn handle(
    state: &Arc<AppState>,
    req: Request<RequestBody>,
    edge: &mut Edge<'_>,
) -> Result<Response<ProxyBody>, Stop> {
    let (mut call, parts, body) = Call::new(state, req)?; // 1. limit
    let held = read_body(state, &mut call, &parts, body).await?; // 2. body
    let client_body = hold_for_inspector(state, &mut call, &held);
    edge.model_read(call.model.as_deref());
    call.index = state.routes.route(call.model.as_deref())?; // 3. route
    edge.routed(call.index, call.model.as_deref());
    call.trace_route(&state.routes);
    let mut grant = limit(&state.gate, &call, edge, &parts, &held).await?; // 3b. key limits
    let (held, mut session) = open_session(&state.sessions, &call, &parts, held).await?; // 4. session
    let received = held.clone();
    let may_change = !call.opts.off;
    let mut prepared = transform(&state.rewrite, &mut call, &parts, held, &session).await?; // 5. transform
    // (Kept for a refusal's retry, whose body is asked of the cache again;
    // looked up only for a body the cache reads.)
    let conversation = prepared
        .as_ref()
        .and_then(|_| parts.headers.get(&X_VISOR_SESSION))
        .cloned();
    let conversation = conversation.as_ref().and_then(|v| v.to_str().ok());
    let asked = (conversation, &grant, may_change);
    let (mut cache, read_on) = prompt_cache(state, &call, asked, received, prepared.as_mut()).await; // 5c. cache
    if let Some(continued) = read_on {
        count_prefix_read(&state.metrics, "prompt_cache", continued);
    }
    edge.prepared(prepared.as_ref().map(|p| Counts::of(&p.report)));
    if let (Some(t), Some(p)) = (&call.trace, &prepared) {
        traced::changes(t, &p.report, &p.body);
    }
    if let Some(p) = &prepared {
        state.gate.count_context(&grant, &p.report);
        // 5b. the key charged for what goes, not for what came (documents
        // read, history inserted).
        state
            .gate
            .charge_sent(&mut grant, p.body.len() as u64)
            .await?;
    }
    // 6. send. (What it returns is taken apart within this block: a local
    // moved out of stays in the future's state until its scope ends.)
    let (exchange, mut answer, retry_head) = {
        let sent = match send(
            Sending::of(state),
            &call,
            edge,
            parts,
            &prepared,
            &mut session,
        )
        .await
        {
            Ok(sent) => sent,
            Err(stop) => {
                // No answer: the session's new messages are stored (without
                // a reply) before the client hears why, so what it sent is
                // there when it asks again.
                if let Some(storing) = session.recorder.as_mut().and_then(|r| r.finish(false)) {
                    storing.await;
                }
                return Err(stop);
            }
        };
        (sent.exchange, sent.answer, sent.retry_head)
    };
    // 7. learn: only an answer that may be a refusal to learn from waits
    // for it (boxed: its state is not carried by every request's future).
    let may_learn = retry_head.is_some()
        && prepared.as_ref().is_some_and(|p| p.learn.is_some())
        && may_be_refusal(answer.resp.status(), answer.resp.headers());
    if may_learn {
        let learned = Box::pin(learn(
            state,
            &call,
            edge,
            &mut prepared,
            &exchange,
            (retry_head, (conversation, &grant, may_change)),
            answer,
        ))
        .await?;
        answer = match learned {
            Learned::Answer(answer) => answer,
            Learned::Retried(answer, seen) => {
                cache = seen;
                answer
            }
            Learned::Passed(head, body) => return Ok(edge.passed(head, body)),
        };
    }
    // 8. respond: counted as an upstream error first (a client that leaves
    // during the waits below does not take the count with it), then what
    // the response waits for, then the response built without another
    // await (its state is not carried by this future).
    if answer.resp.status().is_server_error() {
        state
            .metrics
            .upstream_error(&exchange.upstream, UpstreamFailure::Status5xx.label());
    }
    kept_and_saved(
        state,
        cache.as_ref(),
        answer.resp.status(),
        prepared.as_mut(),
    )
    .await;
    let outgoing = Outgoing {
        prepared,
        recorder: session.recorder,
        grant,
        cache,
        client_body,
    };
    Ok(respond(state, call, &exchange, edge, outgoing, answer))
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
    /// The body's `model` (phase 2), when it names one visor can read.
    model: Option<String>,
    /// The routed upstream (phase 3).
    index: usize,
    /// The body's size as the client sent it (when known).
    bytes_in: u64,
    /// What a body read whole shares with its client's body before.
    shared: super::checked_prefixes::Shared,
    /// The request's trace, when traced; its attempts' target once routed.
    trace: Option<crate::telemetry::Trace>,
    target: Option<super::traced::Target>,
}

impl Call {
    /// A traced request routed: its span says where, and its attempts'
    /// target is set.
    fn trace_route(&mut self, routes: &Routes) {
        if let Some(t) = &self.trace {
            let upstream = &routes.upstreams[self.index];
            let model = self.model.as_deref();
            self.target = Some(Target::routed(t, upstream, &self.rest, self.shape, model));
        }
    }

    /// What a traced request's body carries to its end: the span, the
    /// attempt's, and the reader of what the response says of itself.
    fn traced(
        &mut self,
        head: &http::response::Parts,
        attempt: Option<AttemptSpan>,
    ) -> Option<Traced> {
        let trace = self.trace.take()?;
        let content_max = match trace.captures_content() {
            true => crate::telemetry::CONTENT_MAX,
            false => 0,
        };
        Some(Traced {
            said: Box::new(SaidObserver::for_response(&head.headers, content_max)),
            trace,
            attempt,
            shape: self.shape,
        })
    }

    /// Phase 1: the request's head read, its options checked, a declared
    /// length over `max_body_bytes` refused before any byte is read.
    fn new(
        state: &AppState,
        req: Request<RequestBody>,
    ) -> Result<(Call, http::request::Parts, RequestBody), Stop> {
        let started = Instant::now();
        let inflight = InflightGuard::new(state.metrics.clone());
        let request_id = RequestIdExt::of(req.extensions());
        let (mut parts, body) = req.into_parts();
        let trace = parts.extensions.remove::<crate::telemetry::Trace>();
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
        let limit = state.server.max_body_bytes;
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
            deadline: started + state.server.request_timeout,
            exceeded: Arc::new(BodyState::default()),
            model: None,
            index: 0,
            bytes_in: content_length(&parts.headers).unwrap_or(0),
            shared: Default::default(),
            trace,
            target: None,
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
    call: &mut Call,
    parts: &http::request::Parts,
    body: RequestBody,
) -> Result<Held, Stop> {
    let (model, held, shared) = read_model_and_body(state, call, parts, body).await?;
    if shared.waited {
        let resumed = shared.digests.before.is_some();
        count_prefix_read(&state.metrics, "json", resumed);
    }
    call.model = model;
    call.shared = shared;
    if let Held::Whole(b) = &held {
        call.bytes_in = b.len() as u64;
    }
    Ok(held)
}

#[allow(clippy::type_complexity)]
async fn read_model_and_body(
    state: &AppState,
    call: &Call,
    parts: &http::request::Parts,
    body: RequestBody,
) -> Result<(Option<String>, Held, super::checked_prefixes::Shared), Stop> {
    let limit = state.server.max_body_bytes;
    if call.shape.is_some() {
        let hint = content_length(&parts.headers).unwrap_or(0);
        // A large body may begin with one its client sent before.
        let resumable = state
            .checked
            .as_ref()
            .filter(|_| hint >= super::dedup_states::MIN_BODY as u64)
            .and_then(|c| c.for_body(super::prepare::tenant(&parts.headers), hint));
        let read = read_validated(body, limit, hint, resumable);
        return match tokio::time::timeout_at(call.deadline, read).await {
            Ok(Ok((model, bytes, shared))) => Ok((model, Held::Whole(bytes), shared)),
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(VisorError::BodyTimeout.into()),
        };
    }
    // The model is read when the route depends on it, or when the caller's
    // `[[key]]` allows only some models.
    let key = state.gate.held_to(&parts.extensions);
    let restricted = key.is_some_and(|k| !k.any_model);
    // A key with a token limit is charged by the body's size: one that
    // does not say it (chunked) is read whole first, so it is counted.
    let metered = key.is_some_and(|k| k.tokens_per_minute.is_some())
        && content_length(&parts.headers).is_none();
    if !state.routes.by_model && !restricted {
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
        return Ok((None, Held::Streamed(b), Default::default()));
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
        Ok(Ok((model, b))) => Ok((model, Held::Streamed(b), Default::default())),
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

/// An upstream's answer, up to its head: the response, and the request's
/// one timer (the total deadline, handed on to the body).
struct Answer {
    resp: Response<ResponseBody>,
    timer: Pin<Box<Sleep>>,
    /// The attempt's span (traced requests): ends with the body.
    attempt: Option<crate::telemetry::AttemptSpan>,
}

/// A request sent, up to its response head: the exchange, the answer, and
/// what a learned-refusal retry needs.
struct Sent<'s> {
    exchange: Exchange<'s>,
    answer: Answer,
    retry_head: Option<RetryHead>,
}

/// What phase 6 reads: the server's bounds and deadlines, the upstreams
/// and their client (with the fallback budget and breakers), whether proxy
/// keys are set (the client's own key is then not forwarded), the metrics.
#[derive(Clone, Copy)]
struct Sending<'s> {
    server: &'s Server,
    routes: &'s Routes,
    keys_set: bool,
    metrics: &'s Metrics,
}

impl<'s> Sending<'s> {
    fn of(state: &'s AppState) -> Self {
        Sending {
            server: &state.server,
            routes: &state.routes,
            keys_set: state.gate.keys.is_set(),
            metrics: &state.metrics,
        }
    }
}

/// Phase 6: the request sent — to its upstream, or along its fallbacks —
/// until a response head.
async fn send<'s>(
    to: Sending<'s>,
    call: &Call,
    edge: &mut Edge<'_>,
    parts: http::request::Parts,
    prepared: &Option<Prepared>,
    session: &mut Session,
) -> Result<Sent<'s>, Stop> {
    let chain = fallback_chain(to, call, &parts, session).await?;
    let Some(chain) = chain else {
        let (up_req, retry_head) =
            upstream_request(to, call, parts, call.index, prepared, session)?;
        let exchange = Exchange::new(to, call, call.index);
        let answer = exchange.run(up_req, &call.exceeded, exchange.sent).await?;
        return Ok(Sent {
            exchange,
            answer,
            retry_head,
        });
    };
    let chain = Chain {
        upstreams: chain,
        model: call.model.as_deref(),
    };
    // Boxed: only routes with fallbacks carry its state.
    Box::pin(send_chain(to, call, edge, &parts, chain, prepared, session)).await
}

/// What phase 4 found of a session.
#[derive(Default)]
struct Session {
    history_used: usize,
    history_at: usize,
    recorder: Option<Recorder>,
    /// The body, when it is streamed (no session applies then).
    streamed: Option<UpstreamBody>,
}

/// Phase 3b: the caller's `[[key]]` — a model outside its `models` is
/// 403, a request over its limits 429 ([`Gate::grant`]).
async fn limit(
    gate: &Gate,
    call: &Call,
    edge: &mut Edge<'_>,
    parts: &http::request::Parts,
    held: &Held,
) -> Result<Grant, Stop> {
    let caller = parts
        .extensions
        .get::<Caller>()
        .copied()
        .unwrap_or(Caller::Anonymous);
    let (bytes, bodied) = match held {
        Held::Whole(b) => (b.len() as u64, !b.is_empty()),
        // Read whole when it does not say its length and the key counts
        // tokens (phase 2).
        Held::Streamed(b) => (
            content_length(&parts.headers)
                .unwrap_or_else(|| b.prefix.iter().map(|c| c.len() as u64).sum()),
            b.prefix.iter().any(|c| !c.is_empty())
                || b.rest.is_some()
                || content_length(&parts.headers).is_some_and(|n| n > 0),
        ),
    };
    let ask = Asking {
        caller,
        model: call.model.as_deref(),
        bytes,
        bodied,
    };
    let key = gate.caller_key(&parts.extensions);
    let label = gate.label(caller, key);
    if let Some(t) = &call.trace {
        traced::key(t, &label);
    }
    edge.keyed(label);
    Ok(gate.grant(key, ask).await?)
}

/// Phase 4: with `x-visor-session`, the stored history merged into a body
/// held whole; a store that cannot be read → 503.
async fn open_session(
    sessions: &Sessions,
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
    let opened = sessions.open(shape, &parts.headers, &id, &bytes).await?;
    let s = Session {
        history_used: opened.history_used,
        history_at: opened.history_at,
        recorder: Some(opened.recorder),
        streamed: None,
    };
    Ok((Some(opened.body), s))
}

/// Phase 5: the pure rewrite of a body visor holds whole.
async fn transform(
    rewrite: &Rewriter,
    call: &mut Call,
    parts: &http::request::Parts,
    held: Option<Bytes>,
    session: &Session,
) -> Result<Option<Prepared>, Stop> {
    let (Some(shape), Some(bytes)) = (call.shape, held) else {
        return Ok(None);
    };
    let asker = prepare::Asker {
        headers: &parts.headers,
        upstream: call.index,
        digests: call.shared.digests,
    };
    let opts = std::mem::take(&mut call.opts);
    // Read under the request's deadline: past it, 504 and nothing sent.
    let (model, deadline) = (call.model.as_deref(), call.deadline);
    let mut p = rewrite
        .prepare_by(shape, model, bytes, opts, asker, deadline)
        .await?;
    p.report.history_used = session.history_used;
    p.report.history_at = session.history_at;
    Ok(Some(p))
}

/// What the prompt cache is asked with besides the bodies: the request's
/// `x-visor-session`, its key's grant, and whether visor may change it
/// (not `x-visor-transform: off`).
type CacheAsk<'a> = (Option<&'a str>, &'a Grant, bool);

/// Phase 5c: the prompt cache's breakpoints or key added to the body to
/// send, and the request judged against its conversation's previous one;
/// and, for a body that may continue its conversation, whether its reading
/// went on from the previous one's (for `visor_prefix_reads_total`).
/// Asked again for a refusal's retry (another body).
async fn prompt_cache(
    state: &AppState,
    call: &Call,
    (session, grant, may_change): CacheAsk<'_>,
    received: Option<Bytes>,
    prepared: Option<&mut Prepared>,
) -> (Option<Seen>, Option<bool>) {
    let (Some(shape), Some(received), Some(p)) = (call.shape, received, prepared) else {
        return (None, None);
    };
    let (anthropic_kind, cache_key) =
        crate::config::upstreams::cache_kind(&state.routes.upstreams, call.index);
    let model = call.model.as_deref().unwrap_or("");
    let asked = Asked {
        shape,
        received: &received,
        prepared: &p.body,
        model,
        key_name: &grant.label,
        session: session.map(str::trim),
        anthropic_kind,
        cache_key,
        min_tokens: state.rewrite.models.caps(model).cache_min_tokens,
        may_change,
        continues: p.conversation.as_mut().and_then(|c| c.from.take()),
        leaves: p
            .conversation
            .as_ref()
            .is_some_and(|c| c.kept.get().is_some()),
    };
    let applied = state.cache.apply(asked).await;
    let read_on = p.conversation.is_some().then_some(applied.continued);
    if let (Some(c), Some(read)) = (&p.conversation, applied.prefixes) {
        c.attach(read);
    }
    if applied.body.is_none() {
        // The body as sent is the transforms' (no marker or key added):
        // what it shares with the one before holds for it.
        p.shared = super::checked_prefixes::Shared {
            clean: applied.sent_clean,
            mark: applied.sent_mark,
            ..Default::default()
        };
    }
    p.report.breakpoints = applied.breakpoints;
    if let Some(body) = applied.body {
        // Not a Messages request: what was added is a prompt_cache_key.
        p.report.cache_key = shape != crate::api::Shape::Messages;
        p.body = body;
    }
    (applied.seen, read_on)
}

/// The method, URI and headers of the upstream request, kept while an
/// upstream refusal may still be learned from (the retry reuses them).
type RetryHead = (Method, http::Uri, HeaderMap);

/// Phase 6 (first half): the upstream request — its URI under the
/// upstream's base URL, headers rewritten, the body as held (byte for byte
/// when nothing changed).
fn upstream_request(
    to: Sending<'_>,
    call: &Call,
    mut parts: http::request::Parts,
    index: usize,
    prepared: &Option<Prepared>,
    session: &mut Session,
) -> Result<(Request<UpstreamBody>, Option<RetryHead>), Stop> {
    let uri = to
        .routes
        .client
        .uri(index, &call.rest, parts.uri.query())
        .ok_or(VisorError::BadRequest(
            "the request target is not a valid URL path",
        ))?;
    upstream_request_headers(
        &mut parts.headers,
        &to.routes.upstreams[index],
        to.keys_set,
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
    to: Sending<'s>,
    call: &Call,
    parts: &http::request::Parts,
    session: &mut Session,
) -> Result<Option<&'s [usize]>, Stop> {
    let upstream = &to.routes.upstreams[call.index];
    if !upstream.has_fallbacks() {
        return Ok(None);
    }
    let Some(body) = session.streamed.as_mut() else {
        return Ok(Some(&upstream.chain));
    };
    let limit = REPLAY_LIMIT.min(to.server.max_body_bytes);
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
                    limit: to.server.max_body_bytes,
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
    to: Sending<'s>,
    call: &Call,
    edge: &mut Edge<'_>,
    parts: &http::request::Parts,
    chain: Chain<'s, '_>,
    prepared: &Option<Prepared>,
    session: &mut Session,
) -> Result<Sent<'s>, Stop> {
    let retries = &to.routes.retries;
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
            upstream_request(to, call, copy_head(parts), index, prepared, session)?;
        let exchange = Exchange::new(to, call, index);
        let result = exchange.run(up_req, &call.exceeded, exchange.sent).await;
        let done = |result: Result<Answer, Stop>, exchange| {
            result.map(|answer| Sent {
                exchange,
                answer,
                retry_head,
            })
        };
        let (reason, hold) = match &result {
            Ok(a) if a.resp.status().is_server_error() => (UpstreamFailure::Status5xx, None),
            Ok(a) if a.resp.status() == http::StatusCode::TOO_MANY_REQUESTS => (
                UpstreamFailure::Status429,
                crate::retries::retry_after(a.resp.headers().get(header::RETRY_AFTER)),
            ),
            Ok(_) => {
                attempt.succeeded();
                return done(result, exchange);
            }
            Err(Stop::Upstream(_, kind)) if kind.retryable() => (*kind, None),
            // The request's own deadline, or visor refused it (too large):
            // no other upstream would do better.
            Err(_) => return done(result, exchange),
        };
        attempt.failed(hold);
        let next = upstreams
            .iter()
            .enumerate()
            .skip(pos + 1)
            .find_map(|(p, &i)| retries.admit(i).map(|a| (p, i, a)));
        let name = &to.routes.names[index];
        let next = match next {
            Some(n) if retries.budget.try_retry() => n,
            Some(_) => {
                tracing::warn!(upstream = %name, reason = reason.label(), "retry budget spent: no fallback");
                return done(result, exchange);
            }
            None => return done(result, exchange),
        };
        // This attempt is over: counted at its upstream, its answer (if
        // any) dropped unread, which closes its connection.
        to.metrics
            .retries
            .with_label_values(&[&**name, reason.label()])
            .inc();
        if reason != UpstreamFailure::Status429 {
            to.metrics.upstream_error(name, reason.label());
        }
        tracing::info!(
            upstream = %name,
            reason = reason.label(),
            fallback = %to.routes.names[next.1],
            "falling back"
        );
        drop(result);
        (pos, index, attempt) = next;
    }
}

/// What phase 7 leaves.
enum Learned {
    /// The upstream's answer to stream back (no retry).
    Answer(Answer),
    /// The retry's answer, and its body as the prompt cache judged it.
    Retried(Answer, Option<Seen>),
    /// An upstream 4xx read whole that was not about images: passed back as
    /// it was.
    Passed(http::response::Parts, Bytes),
}

/// Phase 7: a model of unknown vision whose upstream answers with an
/// "images not supported" 4xx is retried once with the images replaced, and
/// remembered as non-vision.
async fn learn(
    state: &AppState,
    call: &Call,
    edge: &mut Edge<'_>,
    prepared: &mut Option<Prepared>,
    exchange: &Exchange<'_>,
    (retry_head, asked): (Option<RetryHead>, CacheAsk<'_>),
    answer: Answer,
) -> Result<Learned, Stop> {
    let rewrite = &state.rewrite;
    let Some(p) = prepared.as_mut() else {
        return Ok(Learned::Answer(answer));
    };
    let (Some((method, uri, mut headers)), true) = (retry_head, p.learn.is_some()) else {
        return Ok(Learned::Answer(answer));
    };
    if !may_be_refusal(answer.resp.status(), answer.resp.headers()) {
        return Ok(Learned::Answer(answer));
    }
    let Some(learn) = p.learn.take() else {
        return Ok(Learned::Answer(answer));
    };
    let (head, incoming) = answer.resp.into_parts();
    let error_body = read_error_body(incoming, exchange.head_deadline, &exchange.upstream).await?;
    // The refused attempt is over (the retry is an attempt of its own).
    drop(answer.attempt);
    let model = call.model.as_deref().unwrap_or("");
    // Boxed: a refusal's retry is rare, and its state (6 KB) would
    // otherwise be part of every request's future, copied at each await.
    let Some(prepare::Retry {
        prepared: retry,
        lesson,
    }) = Box::pin(rewrite.after_refusal(&learn, model, &error_body)).await
    else {
        // Not about what it was assumed to take: the upstream's answer,
        // as it was.
        return Ok(Learned::Passed(head, error_body));
    };
    let (history_used, history_at) = (p.report.history_used, p.report.history_at);
    // The refused attempt's originals are on disk before the retry goes:
    // the retry's own write does not hold them all (an image it fits
    // again from the fit cache is not decoded, and not saved again). The
    // write overlapped the refused round trip, so it is seldom waited for.
    if let Some(first) = p.saving.take() {
        let _ = first.await;
    }
    *p = retry;
    p.report.history_used = history_used;
    p.report.history_at = history_at;
    // Another body: its breakpoints or key, as a request sent so at first
    // would have had them (the client's body is the one the first asked
    // with).
    // (Its reading is not counted again: one request, one count.)
    let (seen, _) = prompt_cache(state, call, asked, Some(learn.original), Some(&mut *p)).await;
    edge.prepared(Some(Counts::of(&p.report)));
    set_content_length(&mut headers, p.body.len());
    let mut req = Request::new(p.upstream_body());
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    let answer = exchange.run(req, &call.exceeded, Instant::now()).await?;
    if answer.resp.status().is_success() {
        rewrite.learn(lesson).await;
    }
    Ok(Learned::Retried(answer, seen))
}

/// What phase 8 sends back along with the answer: the rewrite (its counts
/// and its originals still being saved), the session's recorder, and the
/// key's grant.
struct Outgoing {
    prepared: Option<Prepared>,
    recorder: Option<Recorder>,
    grant: Grant,
    /// The request's cache, as judged before the answer.
    cache: Option<Seen>,
    /// The body as the client sent it, for the inspector.
    client_body: Option<crate::inspector::Held>,
}

/// What phase 8 waits for before the response is returned: a request the
/// provider took is kept for the prompt cache (the next request of its
/// conversation is judged against it, and the client cannot send that one
/// before it has this answer), and the replaced images are on disk (the
/// write overlapped the upstream call).
async fn kept_and_saved(
    state: &AppState,
    cache: Option<&Seen>,
    status: http::StatusCode,
    prepared: Option<&mut Prepared>,
) {
    if let Some(seen) = cache
        && status.is_success()
    {
        state.cache.keep(seen).await;
    }
    if let Some(saving) = prepared.and_then(|p| p.saving.take()) {
        let _ = saving.await;
    }
}

/// Phase 8, once [`kept_and_saved`]: status and headers passed through (plus the
/// `x-visor-*` counts); the body streams back through an [`ObservedBody`]
/// that counts the request when it ends.
fn respond(
    state: &Arc<AppState>,
    mut call: Call,
    exchange: &Exchange<'_>,
    edge: &Edge<'_>,
    out: Outgoing,
    answer: Answer,
) -> Response<ProxyBody> {
    let Outgoing {
        mut prepared,
        mut recorder,
        mut grant,
        cache,
        client_body,
    } = out;
    let upstream = exchange.upstream.clone();
    let (mut head, incoming) = answer.resp.into_parts();
    for_the_client(&mut head);
    if let Some(seen) = &cache {
        head.headers.insert(X_VISOR_CACHE.clone(), seen.header());
    }
    if let Some(v) = &grant.standing {
        write_standing(&mut head.headers, v);
    }
    // For the log line (the retry after a refusal may replace more images).
    let counts = prepared.as_ref().map(|p| Counts::of(&p.report));
    if let Some(p) = prepared.as_ref() {
        Counts::of(&p.report).write(&mut head.headers);
    }
    let usage = UsageObserver::for_response(&head.headers);
    let traced = call.traced(&head, answer.attempt);
    if let Some(rec) = recorder.as_mut() {
        rec.head(head.status, &head.headers);
    }
    let breakpoints = prepared.as_ref().map_or(0, |p| p.report.breakpoints);
    let inspected = state.inspector.enabled.then(|| {
        let summary = summary(&mut call, &mut grant, prepared.as_ref(), cache.as_ref());
        let changed = summary.changes.any();
        Inspected {
            inspector: state.inspector.clone(),
            id: call.request_id.clone(),
            upstream_body: prepared
                .as_mut()
                .filter(|p| p.body.len() as u64 != call.bytes_in || changed)
                .and_then(|p| {
                    let shared = std::mem::take(&mut p.shared);
                    let inspector = &state.inspector;
                    if p.body.len() >= super::dedup_states::MIN_BODY && inspector.holds(&p.body) {
                        count_prefix_read(&state.metrics, "inspector", shared.clean > 0);
                    }
                    inspector.hold_json_after(&p.body, shared.clean, shared.mark)
                }),
            summary,
            client_body,
            report: prepared.as_mut().map(|p| std::mem::take(&mut p.report)),
        }
    });
    let finish = Finish {
        metrics: state.metrics.clone(),
        upstream,
        model: edge.model_label(),
        key: grant.label.clone(),
        status: head.status.as_u16(),
        request_id: call.request_id,
        started: call.started,
        sent: exchange.sent,
        inflight: call.inflight,
        images_replaced: counts.map_or(0, |c| c.images_replaced),
        media_replaced: counts.map_or(0, |c| c.media_replaced),
        bytes_saved: counts.map_or(0, |c| c.bytes_saved),
        breakpoints,
        inspected,
        cache,
        on_usage: grant.key.map(|i| charge_usage(state, i, grant.estimate)),
        traced,
    };
    let idle = state.server.idle_timeout;
    let mut observed =
        ObservedBody::new(incoming, usage, idle, call.deadline, answer.timer, finish);
    if let Some(rec) = recorder {
        observed = observed.with_session(rec);
    }
    Response::from_parts(head, ProxyBody::Upstream(Box::new(observed)))
}

/// What the inspector keeps of a request, as far as it is known at its
/// response head (the rest when its body ends).
/// The key's name and the model are moved out of `grant` and `call`:
/// neither is read after (no copy on the request's path).
fn summary(
    call: &mut Call,
    grant: &mut Grant,
    prepared: Option<&Prepared>,
    cache: Option<&Seen>,
) -> Summary {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let changes = prepared.map_or(Changes::default(), |p| Changes::of(&p.report));
    Summary {
        endpoint: match call.shape {
            Some(crate::api::Shape::Chat) => "/v1/chat/completions".into(),
            Some(crate::api::Shape::Responses) => "/v1/responses".into(),
            Some(crate::api::Shape::Messages) => "/v1/messages".into(),
            None => format!("/v1{}", call.rest).into(),
        },
        time_ms: now_ms.saturating_sub(call.started.elapsed().as_millis() as u64),
        key: grant.label.clone(),
        model: call.model.take().unwrap_or_default(),
        bytes_in: call.bytes_in,
        bytes_out: prepared.map_or(call.bytes_in, |p| p.body.len() as u64),
        changes,
        conversation_id: cache.map(|c| c.conversation()),
        ..Summary::default()
    }
}

/// What key `i` is charged once the provider says what a request used (the
/// prompt as the estimate charged it when the provider did not say).
fn charge_usage(state: &Arc<AppState>, i: usize, estimate: u64) -> super::body::Charge {
    let state = state.clone();
    Box::new(move |prompt: Option<u64>, completion: u64| {
        let used = prompt.unwrap_or(estimate) + completion;
        let s = state.clone();
        state.life.tasks.spawn(async move {
            s.gate.limits.correct(i, estimate, used).await;
        });
    })
}

/// One request/response-head exchange with the chosen upstream, under the
/// first-byte and total deadlines.
struct Exchange<'a> {
    to: Sending<'a>,
    /// The attempts' span target (traced requests).
    target: Option<Target>,
    index: usize,
    upstream: Arc<str>,
    /// When the request was first sent upstream.
    sent: Instant,
    head_deadline: Instant,
    deadline: Instant,
    limit: u64,
}

impl<'a> Exchange<'a> {
    fn new(to: Sending<'a>, call: &Call, index: usize) -> Self {
        let server = to.server;
        let sent = Instant::now();
        Exchange {
            to,
            target: call.target.clone(),
            index,
            upstream: to.routes.names[index].clone(),
            sent,
            head_deadline: (sent + server.first_byte_timeout).min(call.deadline),
            deadline: call.deadline,
            limit: server.max_body_bytes,
        }
    }

    /// Phase 6 (second half): sends `req` and waits for the response head.
    async fn run(
        &self,
        mut req: Request<UpstreamBody>,
        exceeded: &BodyState,
        sent: Instant,
    ) -> Result<Answer, Stop> {
        let idle = self.to.server.idle_timeout;
        let mut attempt = self.target.as_ref().map(|t| {
            let (method, uri) = (req.method().clone(), req.uri().clone());
            t.attempt(&self.upstream, &method, &uri, req.headers_mut())
        });
        let sending = self.to.routes.client.send(self.index, req, exceeded);
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
        let result = match outcome {
            Ok(Ok(resp)) => {
                if let Some(a) = &mut attempt {
                    a.head(resp.status().as_u16());
                }
                return Ok(Answer {
                    resp,
                    timer,
                    attempt,
                });
            }
            Ok(Err(failed)) => Err(Stop::of_send(
                &self.upstream,
                failed.failure,
                failed.cause,
                self.limit,
            )),
            Err(()) => {
                let (which, kind) = if self.head_deadline >= self.deadline {
                    ("request timeout", UpstreamFailure::RequestTimeout)
                } else {
                    ("first byte timeout", UpstreamFailure::FirstByteTimeout)
                };
                let upstream = self.upstream.to_string();
                let e = VisorError::UpstreamTimeout { upstream, which };
                Err(Stop::Upstream(e, kind))
            }
        };
        if let (Some(a), Err(stop)) = (attempt, &result) {
            a.failed(stop.label());
        }
        result
    }
}

fn set_content_length(headers: &mut HeaderMap, len: usize) {
    // An unchanged body keeps the one length its client sent (no new
    // value), when it was written as `len` is: digits, no leading zero.
    let mut said = headers.get_all(header::CONTENT_LENGTH).iter();
    let kept = match (said.next(), said.next()) {
        (Some(v), None) => written_as(v.as_bytes(), len),
        _ => false,
    };
    if !kept {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    }
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

/// `v` is `len` in decimal as a header value writes it: digits only, no
/// leading zero.
fn written_as(v: &[u8], len: usize) -> bool {
    let canonical = v.iter().all(u8::is_ascii_digit) && (v.len() == 1 || v.first() != Some(&b'0'));
    canonical
        && std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            == Some(len as u64)
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
    resumable: Option<super::checked_prefixes::Resumable>,
) -> Result<(Option<String>, Bytes, super::checked_prefixes::Shared), VisorError> {
    let mut whole = WholeBody::resuming(hint.min(limit), resumable);
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
    whole.finish_shared().map_err(VisorError::InvalidJson)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_length_is_set_to_the_body_sent_and_said_once() {
        let length = |values: &[&str], len: usize| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::CONTENT_LENGTH, HeaderValue::from_str(v).unwrap());
            }
            h.insert(
                header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            );
            set_content_length(&mut h, len);
            assert!(h.get(header::TRANSFER_ENCODING).is_none());
            h.get_all(header::CONTENT_LENGTH)
                .iter()
                .map(|v| v.to_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        };
        // Unchanged: the client's value stays; changed or absent: the new one.
        assert_eq!(length(&["120"], 120), ["120"]);
        assert_eq!(length(&["120"], 95), ["95"]);
        assert_eq!(length(&[], 95), ["95"]);
        assert_eq!(length(&["0"], 0), ["0"]);
        // Said twice by the client, or with leading zeros: written anew.
        assert_eq!(length(&["120", "120"], 120), ["120"]);
        assert_eq!(length(&["0120"], 120), ["120"]);
        assert_eq!(length(&["00"], 0), ["0"]);
    }

    #[test]
    fn an_unchanged_length_is_the_clients_value_not_a_new_one() {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(120u64));
        let before = h[header::CONTENT_LENGTH].as_bytes().as_ptr();
        set_content_length(&mut h, 120);
        assert_eq!(h[header::CONTENT_LENGTH].as_bytes().as_ptr(), before);
        set_content_length(&mut h, 95);
        assert_ne!(h[header::CONTENT_LENGTH].as_bytes().as_ptr(), before);
    }
}
