//! WebSocket upgrades under `/v1/`: the Responses WebSocket mode
//! (`GET /v1/responses` with `Upgrade: websocket`), and any other upgrade
//! (`/v1/realtime`…) passed through untouched.
//!
//! Phases of one socket:
//! 1. connect — visor opens its own WebSocket to the upstream (the first
//!    `[[upstream]]`: a handshake carries no model), with the client's
//!    headers as for any request (credentials per the upstream, hop-by-hop
//!    and `x-visor-*` removed; `Sec-WebSocket-Protocol` kept), within
//!    the connect and first-byte deadlines. A refusal (401, 404…) is passed
//!    back as it came; no answer is 502/504.
//! 2. accept — the client's upgrade is answered 101 (no extensions:
//!    frames are relayed one by one).
//! 3. relay — messages both ways, in order. On `/v1/responses`, each client
//!    event that carries input items (`response.create`, `response.steer`…)
//!    goes through the same transforms as `POST /v1/responses` (images for
//!    the event's model, the image rules, dedup); every other message passes
//!    as it came. Server events are watched for the end of each response
//!    (`response.completed`, `.failed`, `.incomplete`, `error`): usage and
//!    one `visor_requests_total` count per response. While a response is
//!    under way, an upstream silent for `idle_timeout_secs` ends the socket
//!    (1011). Either side closing or going away closes the other.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::time::Instant;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use super::answer::refuse;
use super::body::ProxyBody;
use super::headers::upstream_request_headers;
use super::prepare::{self, Options};
use super::usage::Usage;
use super::{AppState, RequestIdExt};
use crate::error::VisorError;
use crate::metrics::NO_UPSTREAM;
use crate::transform::Shape;
use crate::upstream::RequestBody;

/// True for an HTTP/1.1 WebSocket upgrade request.
pub fn is_upgrade<B>(req: &Request<B>) -> bool {
    let has = |name: header::HeaderName, token: &str| {
        req.headers().get_all(name).iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
        })
    };
    req.method() == http::Method::GET
        && has(header::UPGRADE, "websocket")
        && has(header::CONNECTION, "upgrade")
}

/// How the client's `Sec-WebSocket-Version` is described when it is not
/// 13, the only version visor speaks (and asks of the upstream); `None`
/// when it is 13.
fn unsupported_version(headers: &HeaderMap) -> Option<String> {
    let mut values = headers.get_all(header::SEC_WEBSOCKET_VERSION).iter();
    match (values.next(), values.next()) {
        (None, _) => Some("none".to_owned()),
        (Some(v), None) if v.as_bytes().trim_ascii() == b"13" => None,
        (Some(v), None) => {
            let shown: String = String::from_utf8_lossy(v.as_bytes())
                .chars()
                .take(40)
                .collect();
            Some(format!("`{shown}`"))
        }
        (Some(_), Some(_)) => Some("several".to_owned()),
    }
}

/// Answers a WebSocket upgrade: connects upstream, then relays.
pub async fn proxy(state: Arc<AppState>, mut req: Request<RequestBody>) -> Response<ProxyBody> {
    let Some(key) = req.headers().get(header::SEC_WEBSOCKET_KEY).cloned() else {
        return refuse(
            &state,
            VisorError::BadRequest("a WebSocket upgrade without Sec-WebSocket-Key"),
        );
    };
    // RFC 6455 4.2.2: a version visor does not speak (or none) is 426 with
    // the one it does, before any upstream is contacted.
    if let Some(other) = unsupported_version(req.headers()) {
        return refuse(&state, VisorError::WebSocketVersion(other));
    }
    let opts = match Options::from_headers(req.headers()) {
        Ok(o) => o,
        Err(e) => return refuse(&state, e),
    };
    let request_id = req
        .extensions()
        .get::<RequestIdExt>()
        .map(|r| r.0.clone())
        .unwrap_or_else(|| HeaderValue::from_static("req_unknown"));
    let rest = req.uri().path()["/v1".len()..].to_owned();
    let responses = rest == "/responses";
    // The caller's `[[key]]`: each `response.create` of the Responses mode
    // is a request it is held to (below, as the events come); any other
    // upgrade (the Realtime API) names its model in the URL and is one
    // request.
    let holder = super::forward::caller_key(&state, req.extensions())
        .filter(|&i| state.limits.key(i).is_some());
    if !responses && let Some(i) = holder {
        let restricted = state.limits.key(i).is_some_and(|k| !k.any_model);
        let model = match query_model(req.uri().query()) {
            Ok(m) => m,
            Err(()) if restricted => {
                return refuse(
                    &state,
                    VisorError::BadRequest(
                        "the WebSocket URL names its model more than once (or not in UTF-8)",
                    ),
                );
            }
            Err(()) => None,
        };
        if restricted && model.is_none() {
            return refuse(
                &state,
                VisorError::BadRequest(
                    "this key may use only some models: name the model in the WebSocket URL (?model=…)",
                ),
            );
        }
        if let Err(e) = super::forward::admit(&state, i, model.as_deref(), false, 0).await {
            return refuse(&state, e);
        }
    }
    // 1. connect: the first upstream (no model at the handshake).
    let index = 0;
    let upstream = &state.config.upstreams[index];
    let name = state.upstream_names[index].clone();
    let Some(http_uri) = state.upstreams.uri(index, &rest, req.uri().query()) else {
        return refuse(
            &state,
            VisorError::BadRequest("the request target is not a valid URL path"),
        );
    };
    let ws_uri = match ws_uri(&http_uri) {
        Some(u) => u,
        None => {
            return refuse(
                &state,
                VisorError::BadRequest("the request target is not a valid URL path"),
            );
        }
    };
    let mut headers = req.headers().clone();
    upstream_request_headers(&mut headers, upstream, state.keys.is_set(), &request_id);
    for h in [
        header::SEC_WEBSOCKET_KEY,
        header::SEC_WEBSOCKET_VERSION,
        header::SEC_WEBSOCKET_EXTENSIONS,
        header::SEC_WEBSOCKET_ACCEPT,
    ] {
        headers.remove(h);
    }
    let mut up_req = match ws_uri.clone().into_client_request() {
        Ok(r) => r,
        Err(_) => {
            return refuse(
                &state,
                VisorError::BadRequest("the request target is not a valid URL path"),
            );
        }
    };
    for (k, v) in &headers {
        if !up_req.headers().contains_key(k) {
            up_req.headers_mut().append(k.clone(), v.clone());
        }
    }
    let server = &state.config.server;
    let started = Instant::now();
    let fail = |e: VisorError, kind: &'static str| {
        state.metrics.upstream_error(&name, kind);
        state
            .metrics
            .requests
            .with_label_values(&[&*name, "", e.status().as_str()])
            .inc();
        tracing::warn!(upstream = %name, error = e.label(), kind, "websocket upstream failed");
        e.into_response()
    };
    let stream = match state.upstreams.connect_raw(index, http_uri).await {
        Ok(s) => s,
        Err(cause) if cause == "connect timeout" => {
            let e = VisorError::UpstreamTimeout {
                upstream: name.to_string(),
                which: "connect timeout",
            };
            return fail(e, "connect_timeout");
        }
        Err(_) => {
            let e = VisorError::UpstreamUnreachable {
                upstream: name.to_string(),
                reason: "connection refused or failed",
            };
            return fail(e, "connect");
        }
    };
    let handshake = tokio_tungstenite::client_async(up_req, stream);
    let (upstream_ws, up_resp) =
        match tokio::time::timeout(server.first_byte_timeout, handshake).await {
            Ok(Ok(pair)) => pair,
            Ok(Err(WsError::Http(resp))) => {
                // Refused by the upstream (401, 404, 426…): its answer.
                let (parts, body) = resp.into_parts();
                let mut out = Response::new(ProxyBody::from(Bytes::from(body.unwrap_or_default())));
                *out.status_mut() = parts.status;
                for h in [header::CONTENT_TYPE, header::RETRY_AFTER] {
                    if let Some(v) = parts.headers.get(&h) {
                        out.headers_mut().insert(h, v.clone());
                    }
                }
                state
                    .metrics
                    .requests
                    .with_label_values(&[&*name, "", parts.status.as_str()])
                    .inc();
                return out;
            }
            Ok(Err(_)) => {
                let e = VisorError::UpstreamUnreachable {
                    upstream: name.to_string(),
                    reason: "the WebSocket handshake failed",
                };
                return fail(e, "reset");
            }
            Err(_) => {
                let e = VisorError::UpstreamTimeout {
                    upstream: name.to_string(),
                    which: "first byte timeout",
                };
                return fail(e, "first_byte_timeout");
            }
        };

    // 2. accept
    let on_upgrade = hyper::upgrade::on(&mut req);
    let mut resp = Response::new(ProxyBody::from(Bytes::new()));
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    if let Ok(v) = HeaderValue::from_str(&derive_accept_key(key.as_bytes())) {
        h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    if let Some(p) = up_resp.headers().get(header::SEC_WEBSOCKET_PROTOCOL) {
        h.insert(header::SEC_WEBSOCKET_PROTOCOL, p.clone());
    }
    tracing::debug!(upstream = %name, path = %rest, "websocket opened");

    // 3. relay, once the client's side has switched. The connection's slot
    // under max_connections is held until the socket ends.
    let slot = req.extensions_mut().remove::<crate::connections::Slot>();
    let relay = Relay {
        state: state.clone(),
        upstream: name,
        key: holder,
        request_id: request_id.clone(),
        responses,
        opts,
        headers: req.headers().clone(),
        started,
    };
    // On the tracked task set: shutdown waits for the socket to close.
    state.tasks.spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => {
                let client =
                    WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None)
                        .await;
                relay.run(client, upstream_ws).await;
            }
            Err(e) => tracing::debug!(error = %e, "websocket upgrade failed"),
        }
        drop(slot);
    });
    resp
}

/// Closes both sides for shutdown (1001), each write bounded: a peer that
/// stopped reading does not hold shutdown up.
async fn shut<C, U>(c_tx: &mut C, u_tx: &mut U)
where
    C: futures_util::Sink<Message> + Unpin,
    U: futures_util::Sink<Message> + Unpin,
{
    let bound = std::time::Duration::from_secs(1);
    let why = || close(CloseCode::Away, "server shutting down");
    let _ = tokio::time::timeout(bound, c_tx.send(why())).await;
    let _ = tokio::time::timeout(bound, c_tx.close()).await;
    let _ = tokio::time::timeout(bound, u_tx.send(why())).await;
    let _ = tokio::time::timeout(bound, u_tx.close()).await;
}

/// The `model` of a query string (`?model=gpt-realtime`), name and value
/// decoded; `Err` when it is named more than once (readers differ on which
/// counts) or is not UTF-8.
fn query_model(query: Option<&str>) -> Result<Option<String>, ()> {
    let decode = |s: &str| {
        String::from_utf8(super::router::percent_decode(
            s.replace('+', " ").as_bytes(),
        ))
        .map_err(drop)
    };
    let mut found = None;
    for pair in query.unwrap_or("").split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if !decode(name)?.eq_ignore_ascii_case("model") {
            continue;
        }
        if found.is_some() {
            return Err(());
        }
        found = Some(decode(value)?);
    }
    Ok(found.filter(|m| !m.is_empty()))
}

/// A top-level key of the JSON object `text` named more than once (in any
/// case: readers differ on which one counts, and some match keys without
/// regard to case).
fn twice_named_key(text: &[u8]) -> Option<String> {
    use crate::transform::json::Cursor;
    let mut keys: Vec<String> = Vec::new();
    let mut twice = None;
    let mut c = Cursor::new(text);
    let walked = c.object(|c, k| {
        let name = k.decode(text).map(|n| n.to_lowercase()).unwrap_or_default();
        if twice.is_none() && keys.contains(&name) {
            twice = Some(name.clone());
        }
        keys.push(name);
        c.skip().map(drop)
    });
    walked.ok().and(twice)
}

/// `http(s)://…` as `ws(s)://…`.
fn ws_uri(uri: &http::Uri) -> Option<http::Uri> {
    let scheme = match uri.scheme_str()? {
        "https" => "wss",
        _ => "ws",
    };
    let authority = uri.authority()?;
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    format!("{scheme}://{authority}{path}").parse().ok()
}

/// What one relayed socket needs.
struct Relay {
    state: Arc<AppState>,
    upstream: Arc<str>,
    /// The caller's `[[key]]`, which each `response.create` is held to.
    key: Option<usize>,
    /// The upgrade's request id (each response's log line carries it).
    request_id: HeaderValue,
    /// The Responses WebSocket mode: client events are transformed.
    responses: bool,
    opts: Options,
    headers: HeaderMap,
    started: Instant,
}

/// A response under way on the socket.
struct InFlight {
    model: String,
    /// Tokens the key's limit was charged before the answer (corrected by
    /// its `usage`).
    estimate: u64,
    since: Instant,
    /// The upstream said `response.created` for it.
    created: bool,
    images_replaced: usize,
    media_replaced: usize,
    bytes_saved: i64,
}

impl Relay {
    async fn run<C, U>(self, client: WebSocketStream<C>, upstream: WebSocketStream<U>)
    where
        C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
        U: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let (mut c_tx, mut c_rx) = client.split();
        let (mut u_tx, mut u_rx) = upstream.split();
        let idle = self.state.config.server.idle_timeout;
        // The responses under way, oldest first (a client may start one
        // before the last ended).
        let mut inflight: VecDeque<InFlight> = VecDeque::new();
        let mut last_upstream = Instant::now();
        let mut last_any = Instant::now();
        // Nothing in flight and nothing either way this long: the socket is
        // closed (1001), so an idle or half-open one frees its slot.
        let quiet = self.state.config.server.request_timeout;
        let mut model = String::new();
        // Once shutdown starts with a response under way: it may finish
        // within the drain timeout, no longer.
        let mut drain_until: Option<Instant> = None;
        loop {
            let deadline = match inflight.is_empty() {
                false => last_upstream + idle,
                true => last_any + quiet,
            };
            let deadline = drain_until.map_or(deadline, |d| deadline.min(d));
            tokio::select! {
                m = c_rx.next() => {
                    last_any = Instant::now();
                    match m {
                        Some(Ok(Message::Text(text))) => {
                            let (out, started) = match self.client_event(text.as_str(), &mut model).await {
                                Ok(pair) => pair,
                                // Refused by the key: the client hears why,
                                // the upstream nothing.
                                Err(refusal) => {
                                    if c_tx.send(refusal).await.is_err() {
                                        let _ = u_tx.close().await;
                                        break;
                                    }
                                    continue;
                                }
                            };
                            if let Some(f) = started {
                                last_upstream = Instant::now();
                                inflight.push_back(f);
                            }
                            if u_tx.send(out).await.is_err() {
                                let _ = c_tx.send(close(CloseCode::Away, "upstream went away")).await;
                                let _ = c_tx.close().await;
                                self.finish_all(&mut inflight, "reset");
                                break;
                            }
                        }
                        Some(Ok(Message::Close(frame))) => {
                            let _ = u_tx.send(Message::Close(frame)).await;
                            let _ = u_tx.close().await;
                            // The reply to the client's close, queued by
                            // tungstenite, goes out now.
                            let _ = c_tx.close().await;
                            self.finish_all(&mut inflight, "client_cancelled");
                            break;
                        }
                        // A binary frame on a Responses socket held to a key:
                        // its events are text; one visor cannot read is not
                        // passed on.
                        Some(Ok(Message::Binary(_))) if self.responses && self.key.is_some() => {
                            let refusal = self.refusal(
                                VisorError::BadRequest(
                                    "binary frames are not taken on a socket held to a key: send events as text",
                                ),
                                None,
                            );
                            if c_tx.send(refusal).await.is_err() {
                                let _ = u_tx.close().await;
                                break;
                            }
                        }
                        Some(Ok(other)) => {
                            if u_tx.send(other).await.is_err() {
                                let _ = c_tx.close().await;
                                break;
                            }
                        }
                        // The client went away: close the upstream socket.
                        Some(Err(_)) | None => {
                            let _ = u_tx.send(close(CloseCode::Away, "client went away")).await;
                            let _ = u_tx.close().await;
                            self.finish_all(&mut inflight, "client_cancelled");
                            break;
                        }
                    }
                }
                m = u_rx.next() => {
                    last_upstream = Instant::now();
                    last_any = last_upstream;
                    match m {
                        Some(Ok(Message::Text(text))) => {
                            // The key's tokens corrected by the usage before
                            // the client hears the response is done.
                            if let Some((i, estimate, used)) = self.server_event(text.as_str(), &mut inflight) {
                                self.state.limits.correct(i, estimate, used).await;
                            }
                            if c_tx.send(Message::Text(text)).await.is_err() {
                                let _ = u_tx.close().await;
                                self.finish_all(&mut inflight, "client_cancelled");
                                break;
                            }
                        }
                        Some(Ok(Message::Close(frame))) => {
                            let _ = c_tx.send(Message::Close(frame)).await;
                            let _ = c_tx.close().await;
                            let _ = u_tx.close().await;
                            self.finish_all(&mut inflight, "reset");
                            break;
                        }
                        Some(Ok(other)) => {
                            if c_tx.send(other).await.is_err() {
                                let _ = u_tx.close().await;
                                break;
                            }
                        }
                        Some(Err(_)) | None => {
                            let _ = c_tx.send(close(CloseCode::Error, "upstream connection lost")).await;
                            let _ = c_tx.close().await;
                            self.finish_all(&mut inflight, "reset");
                            break;
                        }
                    }
                }
                // Shutdown: closed once no response is under way (one that
                // is finishes first).
                () = self.state.shutdown.cancelled(), if inflight.is_empty() => {
                    shut(&mut c_tx, &mut u_tx).await;
                    break;
                }
                () = self.state.shutdown.cancelled(), if drain_until.is_none() => {
                    drain_until = Some(Instant::now() + self.state.config.server.drain_timeout);
                }
                () = tokio::time::sleep_until(deadline), if drain_until.is_some_and(|d| d <= deadline) => {
                    shut(&mut c_tx, &mut u_tx).await;
                    self.finish_all(&mut inflight, "client_cancelled");
                    break;
                }
                () = tokio::time::sleep_until(deadline), if drain_until.is_none_or(|d| d > deadline) => {
                    let (code, why) = match inflight.is_empty() {
                        false => (CloseCode::Error, "upstream idle timeout"),
                        true => (CloseCode::Away, "idle socket closed"),
                    };
                    let _ = c_tx.send(close(code, why)).await;
                    let _ = c_tx.close().await;
                    let _ = u_tx.send(close(CloseCode::Away, "idle timeout")).await;
                    let _ = u_tx.close().await;
                    self.finish_all(&mut inflight, "idle_timeout");
                    break;
                }
            }
        }
        tracing::debug!(
            upstream = %self.upstream,
            duration_ms = self.started.elapsed().as_millis() as u64,
            "websocket closed"
        );
    }

    /// A client event: transformed when it carries Responses input items;
    /// the message to send upstream, and the response it starts, if any —
    /// or, for a `response.create` the caller's `[[key]]` refuses, the
    /// `error` event that answers it.
    async fn client_event(
        &self,
        text: &str,
        model: &mut String,
    ) -> Result<(Message, Option<InFlight>), Message> {
        let unchanged = || Message::Text(text.into());
        if !self.responses {
            return Ok((unchanged(), None));
        }
        // On a socket held to a key every event is read strictly, as an HTTP
        // body is: one it cannot read for sure (not JSON serde takes — a lone
        // surrogate, nesting past 128 levels —, `model` twice) might name
        // another model to a more lenient upstream, so it is refused.
        let parsed = serde_json::from_str::<Value>(text);
        if self.key.is_some() {
            let strict = match &parsed {
                Err(e) => Err(e.to_string()),
                Ok(v) if !v.is_object() => Err("not a JSON object".to_owned()),
                Ok(_) => match twice_named_key(text.as_bytes()) {
                    Some(k) => Err(format!("`{k}` is named twice")),
                    None => Ok(()),
                },
            };
            if let Err(why) = strict {
                let shown: String = why.chars().take(200).collect();
                tracing::debug!(why = %shown, "websocket event refused");
                return Err(self.refusal(
                    VisorError::BadRequest(
                        "the event is not JSON visor can read for sure (a socket held to a key); send one JSON object, each key once",
                    ),
                    None,
                ));
            }
        }
        let Ok(Value::Object(event)) = parsed else {
            return Ok((unchanged(), None));
        };
        let own_model = event.get("model").and_then(Value::as_str);
        if let Some(m) = own_model {
            m.clone_into(model);
        }
        let ty = event.get("type").and_then(Value::as_str);
        let creates = ty == Some("response.create");
        let estimate = text.len() as u64 / crate::limits::BYTES_PER_TOKEN;
        if let Some(i) = self.key {
            match ty {
                Some("response.create") => self.admit(i, own_model, estimate).await?,
                // Input that extends the response under way (its model):
                // counted and charged as a request of the key too.
                Some("response.steer") => {
                    super::forward::admit(&self.state, i, own_model, false, estimate)
                        .await
                        .map_err(|e| self.refusal(e, own_model))?
                }
                _ => {}
            }
        }
        let started = creates.then(|| InFlight {
            model: model.clone(),
            estimate,
            since: Instant::now(),
            created: false,
            images_replaced: 0,
            media_replaced: 0,
            bytes_saved: 0,
        });
        if !event.get("input").is_some_and(Value::is_array) {
            return Ok((unchanged(), started));
        }
        let asker = prepare::Asker {
            headers: &self.headers,
            upstream: 0,
        };
        let body = Bytes::copy_from_slice(text.as_bytes());
        let prepared = prepare::prepare(
            &self.state,
            Shape::Responses,
            Some(model.as_str()),
            body,
            self.opts,
            asker,
        )
        .await;
        if let Some(saving) = prepared.saving {
            let _ = saving.await;
        }
        let started = started.map(|mut f| {
            f.images_replaced = prepared.report.images_replaced;
            f.media_replaced = prepared.report.media_replaced;
            f.bytes_saved = prepared.report.bytes_saved;
            f
        });
        match String::from_utf8(prepared.body.to_vec()) {
            Ok(s) => Ok((Message::Text(s.into()), started)),
            Err(_) => Ok((unchanged(), started)),
        }
    }

    /// Holds one `response.create` to `[[key]]` `i`: a model outside its
    /// `models` (or none named, for a key limited to some) or a request
    /// over its limits is answered with an `error` event carrying the
    /// status and headers HTTP would have had, logged and counted like an
    /// HTTP refusal; the socket stays open.
    async fn admit(&self, i: usize, model: Option<&str>, estimate: u64) -> Result<(), Message> {
        let restricted = self.state.limits.key(i).is_some_and(|k| !k.any_model);
        let verdict = match model {
            None if restricted => Err(VisorError::BadRequest(
                "this key may use only some models: name the model in each response.create",
            )),
            _ => super::forward::admit(&self.state, i, model, true, estimate).await,
        };
        verdict.map_err(|e| self.refusal(e, model))
    }

    /// A client event visor refuses: logged and counted like an HTTP
    /// refusal, answered with an `error` event; nothing goes upstream.
    fn refusal(&self, e: VisorError, model: Option<&str>) -> Message {
        let model = model.map_or_else(String::new, |m| self.state.metrics.model_label(m));
        tracing::info!(
            error = e.label(),
            status = e.status().as_u16(),
            model = %model,
            transport = "websocket",
            "refused"
        );
        self.state
            .metrics
            .requests
            .with_label_values(&[NO_UPSTREAM, &model, e.status().as_str()])
            .inc();
        Message::Text(e.ws_event().into())
    }

    /// A server event: the end of a response is counted; when its `usage`
    /// says more tokens than the caller's `[[key]]` was charged, the
    /// correction due (key, charged, used). Responses end in the order they
    /// were asked for; an `error` event ends the oldest one the upstream
    /// has not started (a create it refused) and nothing else — it may be
    /// the answer to another client event.
    fn server_event(
        &self,
        text: &str,
        inflight: &mut VecDeque<InFlight>,
    ) -> Option<(usize, u64, u64)> {
        if inflight.is_empty() || !self.responses {
            return None;
        }
        // The event's own top-level `type` (a `"status"` or `"error": null`
        // inside `response` says nothing).
        #[derive(serde::Deserialize)]
        struct Event<'a> {
            #[serde(rename = "type", borrow)]
            ty: Option<std::borrow::Cow<'a, str>>,
        }
        let Ok(Event { ty: Some(ty) }) = serde_json::from_str::<Event<'_>>(text) else {
            return None;
        };
        let (f, outcome) = match ty.as_ref() {
            "response.created" => {
                if let Some(f) = inflight.iter_mut().find(|f| !f.created) {
                    f.created = true;
                }
                return None;
            }
            "response.completed" | "response.incomplete" => (inflight.pop_front()?, "complete"),
            "response.failed" => (inflight.pop_front()?, "upstream_error"),
            "error" => {
                let at = inflight.iter().position(|f| !f.created)?;
                (inflight.remove(at)?, "upstream_error")
            }
            _ => return None,
        };
        let usage = Usage::of_event(text.as_bytes());
        let used = usage.map_or(0, |u| u.prompt + u.completion);
        let correction = match self.key {
            Some(i) if used > f.estimate => Some((i, f.estimate, used)),
            _ => None,
        };
        self.finish(f, outcome, usage);
        correction
    }

    /// Ends every response under way (the socket closed) with `outcome`.
    fn finish_all(&self, inflight: &mut VecDeque<InFlight>, outcome: &str) {
        while let Some(f) = inflight.pop_front() {
            self.finish(f, outcome, None);
        }
    }

    /// Counts the response under way (once), as the HTTP path counts one.
    fn finish(&self, f: InFlight, outcome: &str, usage: Option<Usage>) {
        let m = &self.state.metrics;
        let status = match outcome {
            "complete" => "200",
            "client_cancelled" => "499",
            _ => "502",
        };
        let model = m.model_label(&f.model);
        m.requests
            .with_label_values(&[&*self.upstream, model.as_str(), status])
            .inc();
        m.request_duration
            .with_label_values(&[&self.upstream])
            .observe(f.since.elapsed().as_secs_f64());
        if !matches!(outcome, "complete" | "client_cancelled") {
            m.upstream_error(&self.upstream, outcome);
        }
        let u = usage.unwrap_or_default();
        for (kind, n) in [
            ("prompt", u.prompt),
            ("completion", u.completion),
            ("cached_read", u.cached_read),
            ("cache_write", u.cache_write),
        ] {
            if n > 0 {
                m.tokens.with_label_values(&[kind]).inc_by(n);
            }
        }
        tracing::info!(
            request_id = self.request_id.to_str().unwrap_or_default(),
            upstream = %self.upstream,
            model = %model,
            status,
            transport = "websocket",
            outcome,
            prompt_tokens = u.prompt,
            completion_tokens = u.completion,
            cached_tokens = u.cached_read,
            cache_write_tokens = u.cache_write,
            images_replaced = f.images_replaced,
            media_replaced = f.media_replaced,
            bytes_saved = f.bytes_saved,
            duration_ms = f.since.elapsed().as_millis() as u64,
            "response finished"
        );
    }
}

fn close(code: CloseCode, reason: &'static str) -> Message {
    Message::Close(Some(CloseFrame {
        code,
        reason: reason.into(),
    }))
}
