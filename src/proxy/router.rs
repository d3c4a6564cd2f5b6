//! Which handler answers: visor's own endpoints, or the proxy.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, Version, header};
use http_body::Body as _;

use super::AppState;
use super::body::ProxyBody;
use super::edge::{Edge, refuse};
use super::{forward, inspect, websocket};
use crate::artifacts::Found;
use crate::error::VisorError;
use crate::upstream::RequestBody;

pub async fn handle(state: Arc<AppState>, mut req: Request<RequestBody>) -> Response<ProxyBody> {
    if let Err(e) = check_target(&req) {
        return refuse(&state.metrics, e);
    }
    // One spelling of each path before anything classifies it (HTTP and
    // WebSocket alike), and the one the upstream is sent.
    match canonical_path(req.uri().path(), plain_get(&req)) {
        Ok(None) => {}
        Ok(Some(path)) => {
            if let Some(uri) = with_path(req.uri(), &path) {
                *req.uri_mut() = uri;
            } else {
                return refuse(
                    &state.metrics,
                    VisorError::BadRequest("the request target is not a valid URL path"),
                );
            }
        }
        Err(why) => return refuse(&state.metrics, VisorError::BadRequest(why)),
    }
    let path = req.uri().path();
    // Everything under /v1 goes upstream, whatever its method.
    if path == "/v1" || path.starts_with("/v1/") {
        return proxy(&state, req).await;
    }
    let head = req.method() == Method::HEAD;
    if inspect::is_inspector(path) && state.inspector.enabled {
        // Boxed: the inspector's pages are rare, and their state (2 KB) is
        // then not in every proxied request's future.
        let resp = Box::pin(inspect::handle(&state, req)).await;
        return if head { without_body(resp) } else { resp };
    }
    let endpoint = Own::of(path);
    let Some(endpoint) = endpoint else {
        let resp = refuse(&state.metrics, VisorError::NotFound(truncate(path, 200)));
        return if head { without_body(resp) } else { resp };
    };
    let method = req.method().clone();
    if !endpoint.answers(&method) {
        let e = VisorError::MethodNotAllowed {
            method: truncate(method.as_str(), 40),
            path: truncate(path, 200),
            allow: endpoint.allow(),
        };
        return refuse(&state.metrics, e);
    }
    let resp = match endpoint {
        Own::Healthz => json(StatusCode::OK, r#"{"status":"ok"}"#),
        Own::Readyz => {
            if state.life.draining.load(Ordering::Relaxed) {
                json(StatusCode::SERVICE_UNAVAILABLE, r#"{"status":"draining"}"#)
            } else {
                // Degraded (still 200: requests are served): the store, or a
                // describer or transcriber whose upstream refuses its
                // credential.
                let reasons: Vec<String> = [
                    state.store.check().await,
                    state.rewrite.media.describer().problem(),
                    state.rewrite.media.transcriber().problem(),
                ]
                .into_iter()
                .flatten()
                .collect();
                match reasons.is_empty() {
                    true => json(StatusCode::OK, r#"{"status":"ready"}"#),
                    false => {
                        let body = serde_json::json!({"status": "degraded", "reasons": reasons});
                        json_owned(StatusCode::OK, body.to_string())
                    }
                }
            }
        }
        Own::Metrics => {
            state.metrics.describe_cache_entries.set(
                i64::try_from(state.rewrite.media.describer().cache_entries().await)
                    .unwrap_or(i64::MAX),
            );
            let mut resp = Response::new(ProxyBody::from(Bytes::from(state.metrics.render())));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            resp
        }
        Own::Artifact(id) => artifact(&state, id.to_owned()).await,
        Own::Session(id) => {
            let id = id.to_owned();
            session_endpoint(&state, method == Method::DELETE, req.headers(), id).await
        }
    };
    if head { without_body(resp) } else { resp }
}

/// Everything under `/v1`: a WebSocket upgrade or an HTTP request, each
/// answered through one [`Edge`] that logs and counts what visor answers
/// itself.
async fn proxy(state: &Arc<AppState>, req: Request<RequestBody>) -> Response<ProxyBody> {
    let mut edge = Edge::new(&state.metrics, &state.routes.names);
    // The caller's key name, known from the auth layer: every count of this
    // request carries it (a refusal before its limits are checked too).
    let caller = req.extensions().get::<super::headers::Caller>().copied();
    let key = state.gate.caller_key(req.extensions());
    edge.keyed(
        state
            .gate
            .label(caller.unwrap_or(super::headers::Caller::Anonymous), key),
    );
    // What the inspector keeps of a request visor answers itself.
    let asked = state.inspector.enabled.then(|| Asked {
        id: super::RequestIdExt::of(req.extensions()),
        endpoint: req.uri().clone(),
        caller: req.extensions().get::<super::headers::Caller>().copied(),
        bytes_in: req.body().size_hint().exact().unwrap_or(0),
    });
    // Traced: the request's span (continuing the client's `traceparent`),
    // the request's work run within it so the parts' spans find it.
    let trace = state
        .telemetry
        .as_ref()
        .map(|t| t.request(req.method(), req.uri().path(), req.headers()));
    let mut req = req;
    if let Some(t) = &trace {
        req.extensions_mut().insert(t.clone());
    }
    // The request's work boxed once, here: its state (about 12 KB) is
    // then not copied again into each future that awaits it. Made in its
    // box, not made and then moved there (`Box::pin` copied all of it).
    let work = async {
        match websocket::is_upgrade(&req) {
            true => super::in_box(|| websocket::upgrade(state, req, &mut edge)).await,
            false => super::in_box(|| forward::handle(state, req, &mut edge)).await,
        }
    };
    let result = match &trace {
        Some(t) => {
            use crate::telemetry::FutureExt as _;
            work.with_context(t.context()).await
        }
        None => work.await,
    };
    match result {
        Ok(resp) => {
            if let Some(t) = &trace {
                t.head(resp.status().as_u16());
            }
            resp
        }
        Err(stop) => {
            let seen = edge.seen();
            let code = stop.label();
            let resp = edge.answer(stop);
            if let Some(t) = &trace {
                t.answered(resp.status().as_u16(), code);
            }
            if let Some(a) = asked {
                record_refusal(state, a, seen, &resp);
            }
            resp
        }
    }
}

/// A request as it arrived, for the inspector.
struct Asked {
    id: HeaderValue,
    /// (A copy of the request's target: no allocation.)
    endpoint: http::Uri,
    caller: Option<super::headers::Caller>,
    bytes_in: u64,
}

/// Keeps a request visor answered itself (a refusal, an upstream that
/// could not be reached): its status, what it was for, and visor's error
/// code as its outcome.
fn record_refusal(state: &AppState, a: Asked, seen: super::edge::Seen, resp: &Response<ProxyBody>) {
    let key = match a.caller {
        Some(c @ super::headers::Caller::Key(i)) => state.gate.label(c, Some(i)),
        Some(c) => state.gate.label(c, None),
        None => state.gate.label(super::headers::Caller::Anonymous, None),
    };
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let elapsed = seen.started.elapsed().as_millis() as u64;
    let summary = crate::inspector::Summary {
        id: a.id.to_str().unwrap_or_default().to_owned(),
        time_ms: now_ms.saturating_sub(elapsed),
        key,
        endpoint: a.endpoint.path().to_owned().into(),
        model: seen.model.unwrap_or_default(),
        upstream: seen.upstream.map_or_else(|| "visor".into(), Arc::from),
        status: resp.status().as_u16(),
        outcome: "answered by visor".into(),
        total_ms: elapsed,
        bytes_in: a.bytes_in,
        ..Default::default()
    };
    state.inspector.record(crate::inspector::Record {
        summary,
        names: crate::inspector::Names::default(),
        client: None,
        upstream: None,
        report: None,
    });
}

/// One of visor's own endpoints (outside `/v1`).
enum Own<'a> {
    Healthz,
    Readyz,
    Metrics,
    /// `/visor/artifacts/<id>`
    Artifact(&'a str),
    /// `/visor/sessions/<id>`
    Session(&'a str),
}

impl<'a> Own<'a> {
    fn of(path: &'a str) -> Option<Self> {
        match path {
            "/healthz" => Some(Own::Healthz),
            "/readyz" => Some(Own::Readyz),
            "/metrics" => Some(Own::Metrics),
            _ => {
                if let Some(id) = path.strip_prefix("/visor/artifacts/") {
                    Some(Own::Artifact(id))
                } else {
                    path.strip_prefix("/visor/sessions/").map(Own::Session)
                }
            }
        }
    }

    /// The methods it answers, as an `Allow` header lists them: HEAD
    /// wherever GET is.
    fn allow(&self) -> &'static str {
        match self {
            Own::Session(_) => "GET, HEAD, DELETE",
            _ => "GET, HEAD",
        }
    }

    fn answers(&self, method: &Method) -> bool {
        *method == Method::GET
            || *method == Method::HEAD
            || (*method == Method::DELETE && matches!(self, Own::Session(_)))
    }
}

/// The answer to a HEAD request: the GET's status and headers (its
/// `Content-Length` included), no body.
fn without_body(resp: Response<ProxyBody>) -> Response<ProxyBody> {
    let (mut parts, body) = resp.into_parts();
    if let Some(len) = body.size_hint().exact()
        && !parts.headers.contains_key(header::CONTENT_LENGTH)
    {
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    }
    Response::from_parts(parts, ProxyBody::from(Bytes::new()))
}

/// `GET /visor/artifacts/<sha256>`: a replaced image, with its media type.
/// The id is the full SHA-256, or the 12 digits the model sees
/// (`sha256:7ae32ec79dcb`, the `sha256:` optional) when they name one.
async fn artifact(state: &AppState, id: String) -> Response<ProxyBody> {
    let id = id.strip_prefix("sha256:").unwrap_or(&id).to_owned();
    let id = match crate::artifacts::is_short_id(&id) {
        true => match find_artifact(state, &id).await {
            Ok(full) => full,
            Err(e) => return refuse(&state.metrics, e),
        },
        false => id,
    };
    if !crate::artifacts::valid_id(&id) {
        return refuse(
            &state.metrics,
            VisorError::BadRequest(
                "an artifact id is its SHA-256 in lower-case hex: all 64 digits, or the first 12 (as the model sees it)",
            ),
        );
    }
    let store = state.rewrite.artifacts.clone();
    let key = id.clone();
    let read = tokio::task::spawn_blocking(move || store.read(&key)).await;
    match read {
        Ok(Ok(Some((bytes, media_type)))) => {
            let mut resp = Response::new(ProxyBody::from(Bytes::from(bytes)));
            let h = resp.headers_mut();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(media_type));
            h.insert(
                header::CACHE_CONTROL,
                HeaderValue::from_static("private, max-age=31536000, immutable"),
            );
            h.insert(
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            );
            // An SVG is a document that may carry script: opened from this
            // origin it must run nothing and load nothing.
            h.insert(
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static("default-src 'none'; style-src 'unsafe-inline'; sandbox"),
            );
            resp
        }
        Ok(Ok(None)) => refuse(&state.metrics, VisorError::ArtifactNotFound(id)),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot read artifact");
            refuse(&state.metrics, VisorError::ArtifactNotFound(id))
        }
        Err(_) => refuse(&state.metrics, VisorError::ArtifactNotFound(id)),
    }
}

/// The full id of the one artifact whose id begins with `short`.
async fn find_artifact(state: &AppState, short: &str) -> Result<String, VisorError> {
    let store = state.rewrite.artifacts.clone();
    let key = short.to_owned();
    match tokio::task::spawn_blocking(move || store.find(&key)).await {
        Ok(Ok(Found::One(full))) => Ok(full),
        Ok(Ok(Found::Many(n))) => Err(VisorError::AmbiguousArtifact(format!(
            "{n} saved artifacts begin with {short}: ask for one by its full SHA-256"
        ))),
        Ok(Ok(Found::None)) | Ok(Err(_)) | Err(_) => {
            Err(VisorError::ArtifactNotFound(short.to_owned()))
        }
    }
}

/// `GET /visor/sessions/<id>`: `{"session": id, "messages": [...]}`, oldest
/// first (404 when unknown); `DELETE`: forgets it (204, also when there was
/// nothing to forget). Sessions are those of the proxy key that asks.
async fn session_endpoint(
    state: &AppState,
    delete: bool,
    headers: &http::HeaderMap,
    id: String,
) -> Response<ProxyBody> {
    if crate::sessions::valid_id(&id).is_err() {
        return refuse(
            &state.metrics,
            VisorError::BadRequest(crate::sessions::BAD_PATH_ID),
        );
    }
    let sessions = &state.sessions;
    let key = sessions.key(headers, &id);
    let ttl = sessions.ttl;
    if delete {
        return match sessions.store.delete_session(&key, ttl).await {
            Ok(_) => {
                let mut resp = Response::new(ProxyBody::from(Bytes::new()));
                *resp.status_mut() = StatusCode::NO_CONTENT;
                resp
            }
            Err(e) => refuse(&state.metrics, VisorError::StoreUnavailable(e.to_string())),
        };
    }
    match sessions.store.session(&key, sessions.max_depth, ttl).await {
        Ok(Some(messages)) => {
            // The stored messages are JSON already: joined, not re-parsed.
            let mut body =
                serde_json::to_vec(&serde_json::json!({ "session": id })).unwrap_or_default();
            body.pop();
            body.extend_from_slice(b",\"messages\":[");
            for (i, m) in messages.iter().enumerate() {
                if i > 0 {
                    body.push(b',');
                }
                body.extend_from_slice(m);
            }
            body.extend_from_slice(b"]}");
            json_owned(StatusCode::OK, body)
        }
        Ok(None) => refuse(&state.metrics, VisorError::SessionNotFound(id)),
        Err(e) => refuse(&state.metrics, VisorError::StoreUnavailable(e.to_string())),
    }
}

fn json(status: StatusCode, body: &'static str) -> Response<ProxyBody> {
    json_owned(status, body)
}

pub(super) fn json_owned(status: StatusCode, body: impl Into<Bytes>) -> Response<ProxyBody> {
    let mut resp = Response::new(ProxyBody::from(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

pub(super) fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

/// No open relay: only origin-form targets under our own prefixes, without
/// `.` / `..` segments (also percent-encoded, also with `\`).
fn check_target<B>(req: &Request<B>) -> Result<(), VisorError> {
    if req.method() == Method::CONNECT {
        return Err(VisorError::BadRequest(
            "CONNECT is not supported: visor is not a forward proxy",
        ));
    }
    // HTTP/2 requests always carry :scheme and :authority; for HTTP/1 a
    // scheme or authority in the target means absolute form.
    if req.version() < Version::HTTP_2
        && (req.uri().scheme().is_some() || req.uri().authority().is_some())
    {
        return Err(VisorError::BadRequest(
            "absolute-form request targets are refused: visor only forwards to its configured upstreams",
        ));
    }
    let path = req.uri().path();
    if !path.starts_with('/') {
        return Err(VisorError::BadRequest("the request target must be a path"));
    }
    if let Some(why) = path_problem(path) {
        return Err(VisorError::BadRequest(why));
    }
    Ok(())
}

/// Why a path is refused, if it is: looked at as the upstream would read it
/// (percent escapes decoded, repeatedly, so `%252e` is caught too).
/// Refused: `.` and `..` segments (also with a `;parameter`, `..;/`, and
/// with `\` as a separator); bytes that are not UTF-8 once decoded (overlong
/// encodings such as `%c0%ae`); NUL and other control characters.
pub fn path_problem(path: &str) -> Option<&'static str> {
    let decoded = percent_decode(path.as_bytes());
    let Ok(decoded) = std::str::from_utf8(&decoded) else {
        return Some("the path is not UTF-8 once percent-decoded");
    };
    if decoded.chars().any(char::is_control) {
        return Some("control characters (NUL included) in the path are refused");
    }
    let dot = decoded.split(['/', '\\']).any(|seg| {
        let name = seg.split(';').next().unwrap_or(seg);
        name == "." || name == ".."
    });
    dot.then_some("paths with `.` or `..` segments are refused")
}

/// A GET or HEAD that is not a WebSocket upgrade: reads only, nothing
/// transformed or charged by its path.
pub(super) fn plain_get<B>(req: &Request<B>) -> bool {
    (req.method() == Method::GET || req.method() == Method::HEAD)
        && !req.headers().contains_key(header::UPGRADE)
}

/// The one spelling of a path, as servers that decode it read it, when it
/// is not already that (`None`): escapes of unreserved characters decoded
/// (`/v1/chat/completion%73`), runs of `/` made one (`/v1//responses`), a
/// trailing `/` dropped. Escaped separators and escaped `%` (`%2F`, `%5C`,
/// `%25`), which servers read differently, are refused on anything but a
/// plain GET (there they may name an id, `/v1/models/org%2Fname`), as is a
/// `%` that starts no escape (on a plain GET such a path has no escape
/// decoded: decoding could make a new one).
pub(super) fn canonical_path(path: &str, plain_get: bool) -> Result<Option<String>, &'static str> {
    let b = path.as_bytes();
    // A `%` that starts no escape: readers differ on it, and decoding the
    // escapes after it could make it one (`%4%43` would become `%4C`).
    let stray = (0..b.len()).any(|i| {
        b[i] == b'%'
            && !(b.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
    });
    if stray && !plain_get {
        return Err(
            "a `%` that starts no escape in the path is refused: servers read it differently",
        );
    }
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'%'
            && !stray
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            let d = h * 16 + l;
            if d.is_ascii_alphanumeric() || matches!(d, b'-' | b'.' | b'_' | b'~') {
                out.push(d);
            } else if matches!(d, b'/' | b'\\' | b'%') && !plain_get {
                return Err(
                    "escaped `/`, `\\` or `%` in the path are refused: servers read them differently",
                );
            } else {
                out.extend_from_slice(&b[i..i + 3]);
            }
            i += 3;
            continue;
        }
        if c == b'\\' && !plain_get {
            return Err("`\\` in the path is refused: some servers read it as `/`");
        }
        if c == b'/' && out.last() == Some(&b'/') {
            i += 1;
            continue;
        }
        out.push(c);
        i += 1;
    }
    if out.len() > 1 && out.last() == Some(&b'/') {
        out.pop();
    }
    if out == b {
        return Ok(None);
    }
    // Only ASCII was decoded: still UTF-8.
    Ok(String::from_utf8(out).ok())
}

/// `uri` with its path replaced (its query kept).
fn with_path(uri: &http::Uri, path: &str) -> Option<http::Uri> {
    let mut parts = uri.clone().into_parts();
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_owned(),
    };
    parts.path_and_query = Some(pq.parse().ok()?);
    http::Uri::from_parts(parts).ok()
}

/// Decodes `%XX` escapes, up to three times over (so `%252e` becomes `.`);
/// invalid escapes stay as they are.
pub(super) fn percent_decode(s: &[u8]) -> Vec<u8> {
    let mut cur = s.to_vec();
    for _ in 0..3 {
        if !cur.contains(&b'%') {
            break;
        }
        let mut out = Vec::with_capacity(cur.len());
        let mut i = 0;
        while i < cur.len() {
            if cur[i] == b'%'
                && i + 2 < cur.len()
                && let (Some(h), Some(l)) = (hex(cur[i + 1]), hex(cur[i + 2]))
            {
                out.push(h * 16 + l);
                i += 3;
                continue;
            }
            out.push(cur[i]);
            i += 1;
        }
        if out == cur {
            break;
        }
        cur = out;
    }
    cur
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(target: &str) -> Request<()> {
        Request::builder().uri(target).body(()).unwrap()
    }

    #[test]
    fn dot_segments_refused_in_every_spelling() {
        for bad in [
            "/v1/../admin",
            "/v1/%2e%2e/admin",
            "/v1/%2E%2e/x",
            "/v1/.%2e/x",
            "/v1/%252e%252e/x",
            "/v1/..%5cx",
            "/v1/./chat/completions",
            "/v1/..",
            "/v1/models/..;/x",
            "/v1/models/.;x/y",
            "/v1/%c0%ae%c0%ae/x",
            "/v1/models%00",
            "/v1/models/%2500",
            "/v1/a%0d%0aHost:x",
            "/v1/%ff",
        ] {
            assert!(check_target(&req(bad)).is_err(), "{bad} accepted");
        }
        for good in [
            "/v1/chat/completions",
            "/v1/files/file-..abc",
            "/v1/models?x=..",
            "/v1/a..b",
            "/v1/files/..a;b",
            "/v1/models/caf%C3%A9",
        ] {
            assert!(check_target(&req(good)).is_ok(), "{good} refused");
        }
    }

    #[test]
    fn each_path_has_one_spelling() {
        let canon = |p: &str| canonical_path(p, false);
        for (alias, want) in [
            ("/v1/chat/completion%73", "/v1/chat/completions"),
            ("/v1/chat/%63ompletions", "/v1/chat/completions"),
            ("/v1//chat/completions", "/v1/chat/completions"),
            ("//v1///responses", "/v1/responses"),
            ("/v1/respons%65s", "/v1/responses"),
            ("/v1/messages/", "/v1/messages"),
            ("/v1/%6D%65ssages", "/v1/messages"),
            ("/v1/", "/v1"),
        ] {
            assert_eq!(canon(alias), Ok(Some(want.to_owned())), "{alias}");
        }
        for same in [
            "/v1/chat/completions",
            "/",
            "/v1/models/caf%C3%A9",
            "/v1/a%20b",
        ] {
            assert_eq!(canon(same), Ok(None), "{same}");
        }
        for refused in [
            "/v1/chat\\completions",
            "/v1/chat%2Fcompletions",
            "/v1%2fresponses",
            "/v1/chat%5Ccompletions",
            "/v1/x%25y",
        ] {
            assert!(canon(refused).is_err(), "{refused}");
        }
        // A plain GET may name an id with an escaped `/`.
        assert_eq!(canonical_path("/v1/models/org%2Fname", true), Ok(None));
        // A `%` that starts no escape is refused on a write (decoding what
        // follows it could make it one: `%4%43` is not `%4C`), left as it
        // is on a plain GET.
        for stray in ["/v1/x%4", "/v1/x%zz", "/3=f+z%4%43", "/v1/%"] {
            assert!(canon(stray).is_err(), "{stray}");
            assert_eq!(canonical_path(stray, true), Ok(None), "{stray}");
        }
        // There, no escape is decoded, but `/` runs are still one.
        assert_eq!(
            canonical_path("//v1/a%41%/", true),
            Ok(Some("/v1/a%41%".to_owned()))
        );
    }

    #[test]
    fn a_changed_path_keeps_its_query() {
        let uri: http::Uri = "/v1//responses?model=m%20x".parse().unwrap();
        let p = canonical_path(uri.path(), true).unwrap().unwrap();
        assert_eq!(
            with_path(&uri, &p).unwrap().to_string(),
            "/v1/responses?model=m%20x"
        );
    }

    #[test]
    fn absolute_form_refused_on_http1() {
        assert!(check_target(&req("http://evil.example/v1/models")).is_err());
        let mut r = req("http://host/v1/models");
        *r.version_mut() = Version::HTTP_2;
        assert!(check_target(&r).is_ok());
    }
}
