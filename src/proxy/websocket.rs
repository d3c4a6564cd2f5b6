//! WebSocket upgrades under `/v1/`: the Responses WebSocket mode
//! (`GET /v1/responses` with `Upgrade: websocket`), and any other upgrade
//! (`/v1/realtime`…) passed through untouched.
//!
//! Phases of one socket:
//! 1. connect — visor opens its own WebSocket to the upstream (the first
//!    `[[upstream]]`: a handshake carries no model), with the client's
//!    headers as for any request (credentials per the upstream, hop-by-hop
//!    and `x-visor-*` removed; `Sec-WebSocket-Protocol` kept), within
//!    the connect and first-byte deadlines. The upgrade is an HTTP/1.1
//!    request sent by hyper: a refusal (401, 404…) is passed back with its
//!    status, `Content-Type` and body (read whole, up to 64 KiB, also when
//!    it comes after the head); no answer is 502/504.
//! 2. accept — the client's upgrade is answered 101 (no extensions:
//!    frames are relayed one by one). The client's side takes no message
//!    or frame over `server.max_body_bytes` (an event is a request body).
//! 3. relay — messages both ways, in order. On `/v1/responses` every client
//!    event is read by the rules an HTTP body is read by, whether or not a
//!    `[[key]]` holds the socket: one JSON object serde reads (no lone
//!    surrogate, no nesting past 128 levels), no key named twice in any
//!    case, `model` a string; one that is not is answered with an `error`
//!    event (400 `invalid_json`, as HTTP answers) and never sent upstream.
//!    A binary frame is read as the same event in text when it is UTF-8
//!    (it goes upstream as text), refused so when it is not. Each event
//!    that carries input items (`response.create`, `response.steer`…)
//!    goes through the same transforms as `POST /v1/responses` (images for
//!    the model, the image rules, dedup); the model is the event's own, or
//!    the last one a `response.create` or `response.steer` named (no other
//!    event changes it); every other message passes as it came. Server
//!    events are watched for the end of each response
//!    (`response.completed`, `.failed`, `.incomplete`, `error`): usage and
//!    one `visor_requests_total` count per response.
//!
//! Manners and deadlines of the relay:
//! - Pings are answered by the side that received them (tungstenite
//!   answers each once); pings and pongs are never relayed.
//! - While a response is under way, an upstream silent for
//!   `idle_timeout_secs` ends the socket (1011, `idle_timeout`). The
//!   deadline starts with a `response.create` sent while nothing was under
//!   way and is restarted only by the upstream's messages (its pings too),
//!   never by the client's.
//! - Nothing under way and no message either way (pings and pongs do not
//!   count) for `request_timeout_secs`: the socket is closed (1001), so an
//!   idle or half-open one frees its `max_connections` slot.
//! - Every write to either side must go out within `idle_timeout_secs`
//!   (the write deadline: the same "no progress for this long" a stalled
//!   upstream is given). A client that stops reading then has both sockets
//!   closed and its responses under way counted as `client_cancelled`
//!   (499); an upstream that stops reading, as an idle timeout. Close
//!   frames are given a second.
//! - What the client sends wrong closes its socket with a code that says
//!   why (RFC 6455 7.4.1): 1002 a protocol error, 1007 text that is not
//!   UTF-8, 1009 a message over `max_body_bytes`; the upstream's socket is
//!   closed. Either side closing or going away closes the other.

use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::time::Instant;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::client::generate_key;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::Utf8Bytes;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use super::body::ProxyBody;
use super::edge::{Edge, Stop, Transport, refused};
use super::headers::upstream_request_headers;
use super::prepare::{self, Options};
use super::{AppState, RequestIdExt};
use crate::api::usage::Usage;
use crate::error::VisorError;
use crate::failure::UpstreamFailure;
use crate::transform::Shape;
use crate::upstream::{RawConn, RequestBody};

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

/// Answers a WebSocket upgrade: admits it, connects upstream, accepts,
/// then relays on a tracked task. A refusal or an upstream failure before
/// the 101 is a [`Stop`] the edge answers, as for HTTP.
pub async fn upgrade(
    state: &Arc<AppState>,
    mut req: Request<RequestBody>,
    edge: &mut Edge<'_>,
) -> Result<Response<ProxyBody>, Stop> {
    edge.websocket();
    let key = check_handshake(req.headers())?;
    let opts = Options::from_headers(req.headers())?;
    let request_id = RequestIdExt::of(req.extensions());
    let rest = req.uri().path()["/v1".len()..].to_owned();
    let responses = rest == "/responses";
    let holder = admit_socket(state, &req, responses).await?;
    // 1. connect: the first upstream (no model at the handshake).
    let index = 0;
    edge.routed(index, None);
    let started = Instant::now();
    let (upstream_ws, up_headers) = match connect(state, &req, &rest, &request_id).await? {
        Opened::Open(ws, headers) => (ws, headers),
        // Refused by the upstream (401, 404, 426…): its answer, status
        // and body.
        Opened::Refused(parts, body) => return Ok(edge.refused_upgrade(&parts, body)),
    };
    // 2. accept
    let on_upgrade = hyper::upgrade::on(&mut req);
    let resp = switching(&key, &up_headers);
    let name = state.routes.names[index].clone();
    tracing::debug!(upstream = %name, path = %rest, "websocket opened");
    // 3. relay, once the client's side has switched. The connection's slot
    // under max_connections is held until the socket ends.
    let slot = req.extensions_mut().remove::<crate::connections::Slot>();
    // With the gate as a connection of its own: idle, it may be asked to
    // close to make room (a health check at max_connections).
    // (The Responses mode only: a Realtime socket's traffic says nothing
    // of whether it is idle, so it is never closed to make room.)
    let registered = slot
        .as_ref()
        .filter(|_| responses)
        .map(crate::connections::Slot::register);
    let caller = req
        .extensions()
        .get::<super::headers::Caller>()
        .copied()
        .unwrap_or(super::headers::Caller::Anonymous);
    let relay = Relay {
        registered,
        state: state.clone(),
        upstream: name,
        label: state
            .gate
            .label(caller, state.gate.caller_key(req.extensions())),
        key: holder,
        request_id,
        responses,
        opts,
        headers: req.headers().clone(),
        started,
    };
    // A client's event is a request body: none over max_body_bytes, whole
    // or in one frame (1009 closes the socket before it is held).
    let limit = usize::try_from(state.server.max_body_bytes).unwrap_or(usize::MAX);
    let client_config = WebSocketConfig::default()
        .max_message_size(Some(limit))
        .max_frame_size(Some(limit));
    // On the tracked task set: shutdown waits for the socket to close.
    state.life.tasks.spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => {
                let client = WebSocketStream::from_raw_socket(
                    TokioIo::new(upgraded),
                    Role::Server,
                    Some(client_config),
                )
                .await;
                relay.run(client, *upstream_ws).await;
            }
            Err(e) => tracing::debug!(error = %e, "websocket upgrade failed"),
        }
        drop(slot);
    });
    Ok(resp)
}

/// The client's `Sec-WebSocket-Key`, when the handshake is one visor
/// speaks. RFC 6455 4.2.2: a version visor does not speak (or none) is 426
/// with the one it does, before any upstream is contacted.
fn check_handshake(headers: &HeaderMap) -> Result<HeaderValue, VisorError> {
    let Some(key) = headers.get(header::SEC_WEBSOCKET_KEY).cloned() else {
        return Err(VisorError::BadRequest(
            "a WebSocket upgrade without Sec-WebSocket-Key",
        ));
    };
    if let Some(other) = unsupported_version(headers) {
        return Err(VisorError::WebSocketVersion(other));
    }
    Ok(key)
}

/// The caller's `[[key]]`, when it has limits: each `response.create` of
/// the Responses mode is a request it is held to (as the events come); any
/// other upgrade (the Realtime API) names its model in the URL and is one
/// request, admitted here.
async fn admit_socket(
    state: &AppState,
    req: &Request<RequestBody>,
    responses: bool,
) -> Result<Option<usize>, VisorError> {
    let gate = &state.gate;
    let holder = gate
        .caller_key(req.extensions())
        .filter(|&i| gate.limits.key(i).is_some());
    let Some(i) = holder.filter(|_| !responses) else {
        return Ok(holder);
    };
    let restricted = gate.limits.key(i).is_some_and(|k| !k.any_model);
    let model = match query_model(req.uri().query()) {
        Ok(m) => m,
        Err(()) if restricted => {
            return Err(VisorError::BadRequest(
                "the WebSocket URL names its model more than once (or not in UTF-8)",
            ));
        }
        Err(()) => None,
    };
    if restricted && model.is_none() {
        return Err(VisorError::BadRequest(
            "this key may use only some models: name the model in the WebSocket URL (?model=…)",
        ));
    }
    gate.admit(i, model.as_deref(), false, 0).await?;
    Ok(holder)
}

/// Phase 1 of a socket: visor's own WebSocket to the first upstream, with
/// the client's headers as for any request, within the connect and
/// first-byte deadlines.
async fn connect(
    state: &AppState,
    req: &Request<RequestBody>,
    rest: &str,
    request_id: &HeaderValue,
) -> Result<Opened, Stop> {
    let index = 0;
    let routes = &state.routes;
    let bad_target = || VisorError::BadRequest("the request target is not a valid URL path");
    let http_uri = routes
        .client
        .uri(index, rest, req.uri().query())
        .ok_or_else(bad_target)?;
    let ws_uri = ws_uri(&http_uri).ok_or_else(bad_target)?;
    let mut headers = req.headers().clone();
    let upstream = &routes.upstreams[index];
    upstream_request_headers(&mut headers, upstream, state.gate.keys.is_set(), request_id);
    // Traced: the upgrade's span is the upstream's parent.
    if let Some(t) = req.extensions().get::<crate::telemetry::Trace>() {
        t.inject(&mut headers);
    }
    for h in [
        header::SEC_WEBSOCKET_KEY,
        header::SEC_WEBSOCKET_VERSION,
        header::SEC_WEBSOCKET_EXTENSIONS,
        header::SEC_WEBSOCKET_ACCEPT,
    ] {
        headers.remove(h);
    }
    let up_req = upstream_upgrade(&ws_uri, &headers).ok_or_else(bad_target)?;
    let name = routes.names[index].to_string();
    let limit = state.server.max_body_bytes;
    let stream = routes
        .client
        .connect_raw(index, http_uri)
        .await
        .map_err(|f| Stop::of_send(&name, f, "connection refused or failed", limit))?;
    let first_byte = state.server.first_byte_timeout;
    let handshake = open_upstream(stream, up_req, first_byte);
    match tokio::time::timeout(first_byte, handshake).await {
        Ok(Ok(opened)) => Ok(opened),
        Ok(Err(())) => {
            let e = VisorError::UpstreamUnreachable {
                upstream: name,
                reason: "the WebSocket handshake failed",
            };
            Err(Stop::Upstream(e, UpstreamFailure::Reset))
        }
        Err(_) => {
            let e = VisorError::UpstreamTimeout {
                upstream: name,
                which: "first byte timeout",
            };
            Err(Stop::Upstream(e, UpstreamFailure::FirstByteTimeout))
        }
    }
}

/// The 101 that switches the client's connection: no extensions (frames
/// are relayed one by one), the upstream's subprotocol.
fn switching(key: &HeaderValue, up_headers: &HeaderMap) -> Response<ProxyBody> {
    let mut resp = Response::new(ProxyBody::from(Bytes::new()));
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    if let Ok(v) = HeaderValue::from_str(&derive_accept_key(key.as_bytes())) {
        h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    if let Some(p) = up_headers.get(header::SEC_WEBSOCKET_PROTOCOL) {
        h.insert(header::SEC_WEBSOCKET_PROTOCOL, p.clone());
    }
    resp
}

/// Closes both sides for shutdown (1001), each write bounded: a peer that
/// stopped reading does not hold shutdown up.
async fn shut<C, U>(c_tx: &mut C, u_tx: &mut U)
where
    C: futures_util::Sink<Message> + Unpin,
    U: futures_util::Sink<Message> + Unpin,
{
    let why = || close(CloseCode::Away, "server shutting down");
    end(c_tx, Some(why())).await;
    end(u_tx, Some(why())).await;
}

/// How long a close frame (or the end of a stream) may take to go out:
/// a peer that stopped reading does not hold a closing socket up.
const CLOSE_BOUND: Duration = Duration::from_secs(1);

/// What became of one write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Put {
    Sent,
    /// The peer's connection broke.
    Broken,
    /// Not gone out within the write deadline: the peer stopped reading.
    Stalled,
}

impl Put {
    /// The outcome of the responses under way when a write upstream
    /// failed, `None` when it went.
    fn failed(self) -> Option<Ended> {
        match self {
            Put::Sent => None,
            Put::Broken => Some(Ended::Failed(UpstreamFailure::Reset)),
            Put::Stalled => Some(Ended::Failed(UpstreamFailure::IdleTimeout)),
        }
    }
}

/// One message to one side, within `bound`.
async fn put<S>(tx: &mut S, m: Message, bound: Duration) -> Put
where
    S: futures_util::Sink<Message> + Unpin,
{
    match tokio::time::timeout(bound, tx.send(m)).await {
        Ok(Ok(())) => Put::Sent,
        Ok(Err(_)) => Put::Broken,
        Err(_) => Put::Stalled,
    }
}

/// Closes one side: its close frame, if any, then the end of its stream,
/// each within [`CLOSE_BOUND`].
async fn end<S>(tx: &mut S, frame: Option<Message>)
where
    S: futures_util::Sink<Message> + Unpin,
{
    if let Some(frame) = frame {
        let _ = tokio::time::timeout(CLOSE_BOUND, tx.send(frame)).await;
    }
    let _ = tokio::time::timeout(CLOSE_BOUND, tx.close()).await;
}

/// The close frame that tells a client why its socket ends, for an error
/// in what it sent (RFC 6455 7.4.1): 1002 a protocol error, 1007 text
/// that is not UTF-8, 1009 a message or frame over `max_body_bytes`;
/// `None` when it went away.
fn violation(e: &WsError) -> Option<Message> {
    match e {
        WsError::Protocol(_) => Some(close(CloseCode::Protocol, "protocol error")),
        WsError::Utf8(_) => Some(close(CloseCode::Invalid, "text that is not UTF-8")),
        WsError::Capacity(_) => Some(close(
            CloseCode::Size,
            "message too big (server.max_body_bytes)",
        )),
        _ => None,
    }
}

/// The longest `model` read (as for an HTTP body).
const MAX_MODEL: usize = 1024;

/// A client event of the Responses mode read by the rules an HTTP body is
/// read by: one JSON object (serde's reading of it: no lone surrogate, no
/// nesting past 128 levels), no key named twice in any case, and what the
/// HTTP path's reader accepts (`model` a string of at most 1024 bytes as
/// written); else why not, as the HTTP path refuses a body (400
/// `invalid_json`).
fn read_event(text: &str) -> Result<serde_json::Map<String, Value>, VisorError> {
    let event = match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(event)) => event,
        Ok(_) => return Err(VisorError::InvalidJson("not a JSON object".to_owned())),
        Err(e) => return Err(VisorError::InvalidJson(e.to_string())),
    };
    if let Some(k) = twice_named_key(text.as_bytes()) {
        return Err(VisorError::InvalidJson(format!("duplicate field `{k}`")));
    }
    // And as the HTTP path reads a body (its `model` measured as written):
    // nothing goes on over the socket that HTTP would refuse.
    if let Err(why) = crate::proxy::request_body::probe(text.as_bytes()) {
        return Err(VisorError::InvalidJson(why));
    }
    match event.get("model") {
        None => {}
        Some(Value::String(m)) if m.len() <= MAX_MODEL => {}
        Some(Value::String(_)) => {
            return Err(VisorError::InvalidJson(format!(
                "`model` is longer than {MAX_MODEL} bytes"
            )));
        }
        Some(_) => {
            return Err(VisorError::InvalidJson(
                "`model` must be a string".to_owned(),
            ));
        }
    }
    Ok(event)
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

/// The most of an upstream's refusal body (at the handshake) passed back.
const REFUSAL_LIMIT: usize = 64 * 1024;

/// The upstream's upgrade request: origin-form target, `Host` for the
/// upstream, the WebSocket headers (a key of visor's own), then the
/// client's headers as prepared for the upstream.
fn upstream_upgrade(ws_uri: &http::Uri, headers: &HeaderMap) -> Option<Request<Empty<Bytes>>> {
    let target = ws_uri.path_and_query().map_or("/", |p| p.as_str());
    let mut req = Request::get(target).body(Empty::new()).ok()?;
    let h = req.headers_mut();
    h.insert(
        header::HOST,
        HeaderValue::from_str(ws_uri.authority()?.as_str()).ok()?,
    );
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(
        header::SEC_WEBSOCKET_VERSION,
        HeaderValue::from_static("13"),
    );
    h.insert(
        header::SEC_WEBSOCKET_KEY,
        HeaderValue::from_str(&generate_key()).ok()?,
    );
    for (k, v) in headers {
        if !h.contains_key(k) {
            h.append(k.clone(), v.clone());
        }
    }
    Some(req)
}

/// What the upstream said to the upgrade.
enum Opened {
    /// 101: its socket, and its answer's headers.
    Open(
        Box<WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>>,
        HeaderMap,
    ),
    /// Any other answer: its head and its body (read whole, up to
    /// [`REFUSAL_LIMIT`]: a refusal's body often comes after its head).
    Refused(http::response::Parts, Bytes),
}

/// The upgrade sent over `stream` (HTTP/1.1, by hyper), within `bound`
/// (the caller's deadline): the upstream's socket, or its refusal; `Err`
/// when it broke off or answered 101 without a WebSocket accept for
/// visor's key.
async fn open_upstream(
    stream: RawConn,
    req: Request<Empty<Bytes>>,
    bound: Duration,
) -> Result<Opened, ()> {
    let key = req
        .headers()
        .get(header::SEC_WEBSOCKET_KEY)
        .map(|k| derive_accept_key(k.as_bytes()))
        .ok_or(())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(stream.into_inner())
        .await
        .map_err(drop)?;
    // The connection's task ends when it hands over its socket (or ends),
    // and at the latest with the handshake's deadline (a handshake given
    // up on leaves no connection behind).
    tokio::spawn(async move {
        let _ = tokio::time::timeout(bound, conn.with_upgrades()).await;
    });
    let resp = sender.send_request(req).await.map_err(drop)?;
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        let (parts, body) = resp.into_parts();
        let body = match Limited::new(body, REFUSAL_LIMIT).collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => Bytes::new(),
        };
        return Ok(Opened::Refused(parts, body));
    }
    let accepted = resp
        .headers()
        .get(header::SEC_WEBSOCKET_ACCEPT)
        .is_some_and(|v| v.as_bytes() == key.as_bytes());
    let upgrades = resp.headers().get_all(header::UPGRADE).iter().any(|v| {
        v.to_str()
            .is_ok_and(|v| v.trim().eq_ignore_ascii_case("websocket"))
    });
    if !accepted || !upgrades {
        return Err(());
    }
    let headers = resp.headers().clone();
    let upgraded = hyper::upgrade::on(resp).await.map_err(drop)?;
    let ws = WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Client, None).await;
    Ok(Opened::Open(Box::new(ws), headers))
}

/// What one relayed socket needs.
struct Relay {
    /// The socket as a connection of the gate's (`None` in tests that
    /// build no gate).
    registered: Option<crate::connections::Registered>,
    state: Arc<AppState>,
    upstream: Arc<str>,
    /// The caller's `[[key]]`, which each `response.create` is held to.
    key: Option<usize>,
    /// The caller's key name, as its requests and tokens are counted.
    label: Arc<str>,
    /// The upgrade's request id (each response's log line carries it).
    request_id: HeaderValue,
    /// The Responses WebSocket mode: client events are transformed.
    responses: bool,
    opts: Options,
    headers: HeaderMap,
    started: Instant,
}

/// How a response on the socket ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    Complete,
    /// The client left (or stopped reading) first.
    ClientCancelled,
    Failed(UpstreamFailure),
}

impl Ended {
    /// Its label in the log line (as the HTTP path's outcomes).
    fn label(self) -> &'static str {
        match self {
            Ended::Complete => "complete",
            Ended::ClientCancelled => "client_cancelled",
            Ended::Failed(kind) => kind.label(),
        }
    }
}

/// A response under way on the socket.
struct InFlight {
    model: String,
    /// Tokens the key's limit was charged before the answer (corrected by
    /// its `usage`).
    estimate: u64,
    /// Bytes of generated text its events carried so far: what it is
    /// charged when the socket ends before its usage comes.
    text_bytes: u64,
    since: Instant,
    /// The upstream said `response.created` for it.
    created: bool,
    images_replaced: usize,
    media_replaced: usize,
    bytes_saved: i64,
}

/// The relay's state between two messages: both sides' write halves, the
/// responses under way (oldest first: a client may start one before the
/// last ended), the clocks, and the model the last create named.
struct Sides<CT, UT> {
    c_tx: CT,
    u_tx: UT,
    inflight: VecDeque<InFlight>,
    /// The upstream's last message (its idle deadline while a response is
    /// under way).
    last_upstream: Instant,
    /// The last message either way (pings and pongs aside).
    last_any: Instant,
    model: String,
    /// A write to either side that has not gone out by then: that peer
    /// stopped reading.
    write_bound: Duration,
}

impl<CT, UT> Sides<CT, UT>
where
    CT: futures_util::Sink<Message> + Unpin,
    UT: futures_util::Sink<Message> + Unpin,
{
    /// The client left, or stopped reading: the upstream is closed and
    /// every response under way counted as cancelled.
    async fn client_gone(&mut self, relay: &Relay) -> ControlFlow<()> {
        end(
            &mut self.u_tx,
            Some(close(CloseCode::Away, "client went away")),
        )
        .await;
        relay.finish_all(&mut self.inflight, Ended::ClientCancelled);
        ControlFlow::Break(())
    }

    /// The upstream broke or stopped reading: the client is closed and
    /// every response under way ends as `outcome`.
    async fn upstream_gone(&mut self, relay: &Relay, outcome: Ended) -> ControlFlow<()> {
        end(
            &mut self.c_tx,
            Some(close(CloseCode::Away, "upstream went away")),
        )
        .await;
        relay.finish_all(&mut self.inflight, outcome);
        ControlFlow::Break(())
    }

    async fn send_client(&mut self, relay: &Relay, m: Message) -> ControlFlow<()> {
        match put(&mut self.c_tx, m, self.write_bound).await {
            Put::Sent => ControlFlow::Continue(()),
            _ => self.client_gone(relay).await,
        }
    }

    async fn send_upstream(&mut self, relay: &Relay, m: Message) -> ControlFlow<()> {
        match put(&mut self.u_tx, m, self.write_bound).await.failed() {
            None => ControlFlow::Continue(()),
            Some(outcome) => self.upstream_gone(relay, outcome).await,
        }
    }
}

impl Relay {
    async fn run<C, U>(self, client: WebSocketStream<C>, upstream: WebSocketStream<U>)
    where
        C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
        U: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let (c_tx, mut c_rx) = client.split();
        let (u_tx, mut u_rx) = upstream.split();
        let idle = self.state.server.idle_timeout;
        let mut s = Sides {
            c_tx,
            u_tx,
            inflight: VecDeque::new(),
            last_upstream: Instant::now(),
            last_any: Instant::now(),
            model: String::new(),
            write_bound: idle,
        };
        // Nothing in flight and nothing either way this long: the socket is
        // closed (1001), so an idle or half-open one frees its slot.
        let quiet = self.state.server.request_timeout;
        // Once shutdown starts with a response under way: it may finish
        // within the drain timeout, no longer.
        let mut drain_until: Option<Instant> = None;
        // Counted as in flight on the gate while a response is under way:
        // only an idle socket is closed to make room.
        let mut busy: Option<crate::connections::InFlight> = None;
        let shutdown = &self.state.life.shutdown;
        loop {
            match (&self.registered, s.inflight.is_empty(), busy.is_some()) {
                (Some(r), false, false) => busy = Some(r.conn.begin()),
                (_, true, true) => busy = None,
                _ => {}
            }
            let deadline = match s.inflight.is_empty() {
                false => s.last_upstream + idle,
                true => s.last_any + quiet,
            };
            let deadline = drain_until.map_or(deadline, |d| deadline.min(d));
            let flow = tokio::select! {
                m = c_rx.next() => self.client_message(&mut s, m).await,
                m = u_rx.next() => self.upstream_message(&mut s, m).await,
                // At max_connections, the gate asks the connection idle the
                // longest to make room: this socket, with nothing under way.
                () = shed_asked(self.registered.as_ref()), if s.inflight.is_empty() => {
                    end(&mut s.c_tx, Some(close(CloseCode::Away, "connection limit reached: idle socket closed"))).await;
                    end(&mut s.u_tx, Some(close(CloseCode::Away, "idle socket closed"))).await;
                    ControlFlow::Break(())
                }
                // Shutdown: closed once no response is under way (one that
                // is finishes first).
                () = shutdown.cancelled(), if s.inflight.is_empty() => {
                    shut(&mut s.c_tx, &mut s.u_tx).await;
                    ControlFlow::Break(())
                }
                () = shutdown.cancelled(), if drain_until.is_none() => {
                    drain_until = Some(Instant::now() + self.state.server.drain_timeout);
                    ControlFlow::Continue(())
                }
                () = tokio::time::sleep_until(deadline), if drain_until.is_some_and(|d| d <= deadline) => {
                    shut(&mut s.c_tx, &mut s.u_tx).await;
                    self.finish_all(&mut s.inflight, Ended::ClientCancelled);
                    ControlFlow::Break(())
                }
                () = tokio::time::sleep_until(deadline), if drain_until.is_none_or(|d| d > deadline) => {
                    self.timed_out(&mut s).await
                }
            };
            if flow.is_break() {
                break;
            }
        }
        tracing::debug!(
            upstream = %self.upstream,
            duration_ms = self.started.elapsed().as_millis() as u64,
            "websocket closed"
        );
    }

    /// What the client sent: relayed, transformed or refused — or the
    /// socket ends.
    async fn client_message<CT, UT>(
        &self,
        s: &mut Sides<CT, UT>,
        m: Option<Result<Message, WsError>>,
    ) -> ControlFlow<()>
    where
        CT: futures_util::Sink<Message> + Unpin,
        UT: futures_util::Sink<Message> + Unpin,
    {
        let m = match m {
            Some(Ok(m)) => m,
            // A frame that breaks the protocol, text that is not UTF-8, a
            // message over max_body_bytes: the client hears why (1002,
            // 1007, 1009); a client gone nothing. The upstream socket is
            // closed.
            Some(Err(e)) => {
                if let Some(frame) = violation(&e) {
                    tracing::debug!(error = %e, "websocket client broke the protocol");
                    end(&mut s.c_tx, Some(frame)).await;
                }
                return s.client_gone(self).await;
            }
            None => return s.client_gone(self).await,
        };
        let text = match m {
            // tungstenite answers a ping itself (once): neither goes
            // upstream, and neither is activity that keeps a quiet socket
            // open.
            Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => {
                return ControlFlow::Continue(());
            }
            Message::Close(frame) => {
                end(&mut s.u_tx, Some(Message::Close(frame))).await;
                // The reply to the client's close, queued by tungstenite,
                // goes out now.
                let _ = tokio::time::timeout(CLOSE_BOUND, s.c_tx.close()).await;
                self.finish_all(&mut s.inflight, Ended::ClientCancelled);
                return ControlFlow::Break(());
            }
            Message::Text(text) => text,
            // On a Responses socket a binary frame is an event like any
            // other when it is UTF-8 (lenient servers read its bytes as
            // JSON), refused when it is not.
            Message::Binary(bytes) if self.responses => match Utf8Bytes::try_from(bytes) {
                Ok(text) => text,
                Err(e) => {
                    s.last_any = Instant::now();
                    let why = format!("invalid UTF-8 at byte {}", e.valid_up_to());
                    let refusal = self.refusal(VisorError::InvalidJson(why), None);
                    return s.send_client(self, refusal).await;
                }
            },
            other => {
                s.last_any = Instant::now();
                return s.send_upstream(self, other).await;
            }
        };
        s.last_any = Instant::now();
        // Activity: the socket is the last the gate would ask to make room.
        if let Some(r) = &self.registered {
            drop(r.conn.begin());
        }
        let (out, started) = match self.client_event(text, &mut s.model).await {
            Ok(pair) => pair,
            // Refused (unreadable, or by the key): the client hears why, the
            // upstream nothing.
            Err(refusal) => return s.send_client(self, refusal).await,
        };
        if let Some(f) = started {
            // The upstream's idle deadline starts with the first response
            // under way; while one is, only the upstream's messages restart
            // it.
            if s.inflight.is_empty() {
                s.last_upstream = Instant::now();
            }
            s.inflight.push_back(f);
        }
        s.send_upstream(self, out).await
    }

    /// What the upstream sent: relayed (a response's end counted) — or the
    /// socket ends.
    async fn upstream_message<CT, UT>(
        &self,
        s: &mut Sides<CT, UT>,
        m: Option<Result<Message, WsError>>,
    ) -> ControlFlow<()>
    where
        CT: futures_util::Sink<Message> + Unpin,
        UT: futures_util::Sink<Message> + Unpin,
    {
        // Any message, a ping too, says the upstream is alive.
        s.last_upstream = Instant::now();
        match m {
            // Answered by tungstenite (pings), never relayed.
            Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {
                ControlFlow::Continue(())
            }
            Some(Ok(Message::Text(text))) => {
                s.last_any = s.last_upstream;
                // The key's tokens corrected by the usage before the client
                // hears the response is done.
                if let Some((i, estimate, used)) = self.server_event(text.as_str(), &mut s.inflight)
                {
                    self.state.gate.limits.correct(i, estimate, used).await;
                }
                s.send_client(self, Message::Text(text)).await
            }
            Some(Ok(Message::Close(frame))) => {
                end(&mut s.c_tx, Some(Message::Close(frame))).await;
                end(&mut s.u_tx, None).await;
                self.finish_all(&mut s.inflight, Ended::Failed(UpstreamFailure::Reset));
                ControlFlow::Break(())
            }
            Some(Ok(other)) => {
                s.last_any = s.last_upstream;
                s.send_client(self, other).await
            }
            Some(Err(_)) | None => {
                let lost = close(CloseCode::Error, "upstream connection lost");
                end(&mut s.c_tx, Some(lost)).await;
                self.finish_all(&mut s.inflight, Ended::Failed(UpstreamFailure::Reset));
                ControlFlow::Break(())
            }
        }
    }

    /// The upstream was silent too long with a response under way, or the
    /// socket was quiet too long with none: both sides closed.
    async fn timed_out<CT, UT>(&self, s: &mut Sides<CT, UT>) -> ControlFlow<()>
    where
        CT: futures_util::Sink<Message> + Unpin,
        UT: futures_util::Sink<Message> + Unpin,
    {
        let (code, why) = match s.inflight.is_empty() {
            false => (CloseCode::Error, "upstream idle timeout"),
            true => (CloseCode::Away, "idle socket closed"),
        };
        end(&mut s.c_tx, Some(close(code, why))).await;
        end(&mut s.u_tx, Some(close(CloseCode::Away, "idle timeout"))).await;
        self.finish_all(&mut s.inflight, Ended::Failed(UpstreamFailure::IdleTimeout));
        ControlFlow::Break(())
    }

    /// A client event: transformed when it carries Responses input items;
    /// the message to send upstream, and the response it starts, if any —
    /// or, for an event visor cannot read as it reads an HTTP body, or a
    /// `response.create` the caller's `[[key]]` refuses, the `error` event
    /// that answers it.
    async fn client_event(
        &self,
        text: Utf8Bytes,
        model: &mut String,
    ) -> Result<(Message, Option<InFlight>), Message> {
        if !self.responses {
            return Ok((Message::Text(text), None));
        }
        // Every event is read strictly, as an HTTP body is, whether or not
        // a key holds the socket: one visor cannot read for sure (not JSON
        // serde takes — a lone surrogate, nesting past 128 levels —, a key
        // twice) might carry an image or name another model to a more
        // lenient upstream, so it is refused, never passed on unread.
        let event = match read_event(text.as_str()) {
            Ok(event) => event,
            Err(e) => {
                if let VisorError::InvalidJson(why) = &e {
                    let shown: String = why.chars().take(200).collect();
                    tracing::debug!(why = %shown, "websocket event refused");
                }
                return Err(self.refusal(e, None));
            }
        };
        let own_model = event.get("model").and_then(Value::as_str);
        let ty = event.get("type").and_then(Value::as_str);
        let creates = ty == Some("response.create");
        let has_input = event.get("input").is_some_and(Value::is_array);
        let estimate = text.len() as u64 / crate::limits::BYTES_PER_TOKEN;
        if let Some(i) = self.key {
            match ty {
                Some("response.create") => self.admit(i, own_model, estimate).await?,
                // Input that extends the response under way (its model), or
                // any other event carrying input visor transforms: counted
                // and charged as a request of the key too.
                Some("response.steer") => self.admit_more(i, own_model, estimate).await?,
                _ if has_input => self.admit_more(i, own_model, estimate).await?,
                _ => {}
            }
        }
        // Only the events that start or extend a response, once let
        // through, say which model the next ones are for (a
        // `session.update` naming another says nothing of the responses; a
        // refused create nothing at all).
        if matches!(ty, Some("response.create" | "response.steer"))
            && let Some(m) = own_model
        {
            m.clone_into(model);
        }
        let started = creates.then(|| InFlight {
            model: model.clone(),
            estimate,
            text_bytes: 0,
            since: Instant::now(),
            created: false,
            images_replaced: 0,
            media_replaced: 0,
            bytes_saved: 0,
        });
        if !has_input {
            return Ok((Message::Text(text), started));
        }
        self.rewrite_event(text, model.as_str(), estimate, started)
            .await
    }

    /// An event carrying input items, through the transforms of `POST
    /// /v1/responses` under its own deadline; the key charged for what
    /// goes (documents read, history), not for what came: the rest is
    /// charged, and the event refused when it no longer fits.
    async fn rewrite_event(
        &self,
        text: Utf8Bytes,
        model: &str,
        estimate: u64,
        started: Option<InFlight>,
    ) -> Result<(Message, Option<InFlight>), Message> {
        let asker = prepare::Asker {
            headers: &self.headers,
            upstream: 0,
            digests: Default::default(),
        };
        let body = Bytes::from(text.clone());
        // An event is a request: read under its own deadline.
        let deadline = Instant::now() + self.state.server.request_timeout;
        let prepared = self
            .state
            .rewrite
            .prepare_by(
                Shape::Responses,
                Some(model),
                body,
                self.opts,
                asker,
                deadline,
            )
            .await
            .map_err(|e| self.refusal(e, Some(model)))?;
        if let Some(saving) = prepared.saving {
            let _ = saving.await;
        }
        // The key pays for what goes (documents read, history), not for
        // what came: the rest is charged, and the event refused when it no
        // longer fits.
        let sent = prepared.body.len() as u64 / crate::limits::BYTES_PER_TOKEN;
        let mut started = started;
        if let Some(i) = self.key
            && sent > estimate
            && let Some(verdict) = self
                .state
                .gate
                .limits
                .charge_more(i, sent - estimate, sent, None)
                .await
        {
            if let (Some(over), Some(k)) = (verdict.over, self.state.gate.limits.key(i)) {
                let e = super::admission::rate_limited(k, &verdict, over, sent);
                return Err(self.refusal(e, Some(model)));
            }
            if let Some(f) = started.as_mut() {
                f.estimate = sent;
            }
        }
        let started = started.map(|mut f| {
            f.images_replaced = prepared.report.images_replaced;
            f.media_replaced = prepared.report.media_replaced;
            f.bytes_saved = prepared.report.bytes_saved;
            f
        });
        match Utf8Bytes::try_from(prepared.body) {
            Ok(s) => Ok((Message::Text(s), started)),
            Err(_) => Ok((Message::Text(text), started)),
        }
    }

    /// Holds one `response.create` to `[[key]]` `i`: a model outside its
    /// `models` (or none named, for a key limited to some) or a request
    /// over its limits is answered with an `error` event carrying the
    /// status and headers HTTP would have had, logged and counted like an
    /// HTTP refusal; the socket stays open.
    async fn admit(&self, i: usize, model: Option<&str>, estimate: u64) -> Result<(), Message> {
        let restricted = self.state.gate.limits.key(i).is_some_and(|k| !k.any_model);
        let verdict = match model {
            None if restricted => Err(VisorError::BadRequest(
                "this key may use only some models: name the model in each response.create",
            )),
            _ => self.state.gate.admit(i, model, true, estimate).await,
        };
        verdict.map_err(|e| self.refusal(e, model))
    }

    /// Holds an event that extends a response (or carries input) to
    /// `[[key]]` `i` as a request of its own.
    async fn admit_more(
        &self,
        i: usize,
        model: Option<&str>,
        estimate: u64,
    ) -> Result<(), Message> {
        self.state
            .gate
            .admit(i, model, false, estimate)
            .await
            .map_err(|e| self.refusal(e, model))
    }

    /// A client event visor refuses: logged and counted like an HTTP
    /// refusal, answered with an `error` event; nothing goes upstream.
    fn refusal(&self, e: VisorError, model: Option<&str>) -> Message {
        let metrics = &self.state.metrics;
        let model = model.map(|m| metrics.model_label(m));
        refused(
            metrics,
            &e,
            model.as_deref(),
            &self.label,
            Transport::WebSocket,
        );
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
            "response.completed" | "response.incomplete" => {
                (inflight.pop_front()?, Ended::Complete)
            }
            "response.failed" => (
                inflight.pop_front()?,
                Ended::Failed(UpstreamFailure::UpstreamError),
            ),
            "error" => {
                let at = inflight.iter().position(|f| !f.created)?;
                (
                    inflight.remove(at)?,
                    Ended::Failed(UpstreamFailure::UpstreamError),
                )
            }
            // Generated text, for the charge of a response the socket ends
            // before its usage comes.
            _ => {
                if self.key.is_some()
                    && let Some(f) = inflight.iter_mut().find(|f| f.created)
                {
                    f.text_bytes += crate::api::usage::text_bytes(text.as_bytes());
                }
                return None;
            }
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

    /// Ends every response under way (the socket closed) with `outcome`;
    /// the caller's key is charged the text each carried (no usage came).
    fn finish_all(&self, inflight: &mut VecDeque<InFlight>, outcome: Ended) {
        while let Some(f) = inflight.pop_front() {
            let completion = f.text_bytes / crate::limits::BYTES_PER_TOKEN;
            if let Some(i) = self.key
                && completion > 0
            {
                let (state, estimate) = (self.state.clone(), f.estimate);
                self.state.life.tasks.spawn(async move {
                    state
                        .gate
                        .limits
                        .correct(i, estimate, estimate + completion)
                        .await;
                });
            }
            self.finish(f, outcome, None);
        }
    }

    /// Counts the response under way (once), as the HTTP path counts one.
    fn finish(&self, f: InFlight, outcome: Ended, usage: Option<Usage>) {
        let m = &self.state.metrics;
        let status = match outcome {
            Ended::Complete => "200",
            Ended::ClientCancelled => "499",
            Ended::Failed(_) => "502",
        };
        let model = m.model_label(&f.model);
        m.requests
            .with_label_values(&[&*self.upstream, model.as_str(), status, &self.label])
            .inc();
        m.request_duration
            .with_label_values(&[&self.upstream])
            .observe(f.since.elapsed().as_secs_f64());
        if let Ended::Failed(kind) = outcome {
            m.upstream_error(&self.upstream, kind.label());
        }
        let u = usage.unwrap_or_default();
        m.count_tokens(
            &self.label,
            [u.prompt, u.completion, u.cached_read, u.cache_write],
        );
        tracing::info!(
            request_id = self.request_id.to_str().unwrap_or_default(),
            upstream = %self.upstream,
            model = %model,
            status,
            transport = "websocket",
            outcome = outcome.label(),
            // Only when the provider said them (absent, not 0, otherwise).
            prompt_tokens = usage.map(|u| u.prompt),
            completion_tokens = usage.map(|u| u.completion),
            cache_read = usage.map(|u| u.cached_read),
            cache_written = usage.map(|u| u.cache_write),
            images_replaced = f.images_replaced,
            media_replaced = f.media_replaced,
            bytes_saved = f.bytes_saved,
            duration_ms = f.since.elapsed().as_millis() as u64,
            "response finished"
        );
    }
}

/// Resolves when the gate asks this socket to close to make room; never
/// without a gate.
async fn shed_asked(registered: Option<&crate::connections::Registered>) {
    match registered {
        Some(r) => r.conn.close_asked().await,
        None => std::future::pending().await,
    }
}

fn close(code: CloseCode, reason: &'static str) -> Message {
    Message::Close(Some(CloseFrame {
        code,
        reason: reason.into(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_read_as_an_http_body_is() {
        let ok = r#"{"type":"response.create","model":"gpt-5.1","input":[]}"#;
        assert!(read_event(ok).is_ok());
        // The HTTP reader measures `model` as written: 600 escaped
        // backslashes are 1,200 bytes there (found by the ws_event fuzz
        // target: the socket took what HTTP refuses).
        let long = format!(
            r#"{{"type":"response.create","model":"{}"}}"#,
            "\\\\".repeat(600)
        );
        assert!(crate::proxy::request_body::probe(long.as_bytes()).is_err());
        assert!(read_event(&long).is_err());
        for bad in [
            r#"{"type":"response.create","model":"a","MODEL":"b"}"#,
            r#"{"type":"response.create","input":"\ud800"}"#,
            r#"["response.create"]"#,
            r#"{"type":"response.create","model":5}"#,
        ] {
            let e = read_event(bad).unwrap_err();
            assert_eq!(e.label(), "invalid_json", "{bad}");
        }
    }
}
