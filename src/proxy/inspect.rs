//! The inspector's HTTP surface: the pages under `/visor/ui` and the JSON
//! under `/visor/api/`, behind the inspector's own access (open on
//! loopback without proxy keys, else an admin key or the sign-in cookie).

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt as _;

use super::AppState;
use super::body::ProxyBody;
use super::edge::refuse;
use super::router::{json_owned, truncate};
use crate::error::VisorError;
use crate::inspector::access::{COOKIE, SIGN_IN_SECS};
use crate::inspector::{Access, Filter, SignIn, page};
use crate::upstream::RequestBody;

/// Whether `path` is the inspector's.
pub fn is_inspector(path: &str) -> bool {
    path == "/visor/ui" || path.starts_with("/visor/ui/") || path.starts_with("/visor/api/")
}

/// The methods a path of the inspector answers.
pub fn allow(path: &str) -> &'static str {
    match path {
        "/visor/ui/sign-in" => "GET, HEAD, POST",
        "/visor/ui/sign-out" | "/visor/api/explain" => "POST",
        _ => "GET, HEAD",
    }
}

/// Answers an inspector path (`enabled` was checked by the caller).
pub async fn handle(state: &AppState, req: Request<RequestBody>) -> Response<ProxyBody> {
    let path = req.uri().path().to_owned();
    if !allow(&path).split(", ").any(|m| m == req.method().as_str()) {
        return refuse(
            &state.metrics,
            VisorError::MethodNotAllowed {
                method: truncate(req.method().as_str(), 40),
                path: truncate(&path, 200),
                allow: allow(&path),
            },
        );
    }
    if path == "/visor/ui/live.js" {
        let mut r = Response::new(ProxyBody::from(Bytes::from_static(
            page::LIVE_JS.as_bytes(),
        )));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/javascript; charset=utf-8"),
        );
        return r;
    }
    let is_page = path.starts_with("/visor/ui");
    if path == "/visor/ui/sign-in" {
        return sign_in(state, req).await;
    }
    if path == "/visor/ui/sign-out" {
        // The cookie goes; the key it was made with still opens it.
        let gone = format!("{COOKIE}=; Path=/visor; HttpOnly; SameSite=Strict; Max-Age=0");
        return redirect("/visor/ui/sign-in", Some(gone));
    }
    match state.inspector.access(req.headers(), req.uri()) {
        Access::Granted => {}
        Access::NotConfigured => return refuse(&state.metrics, VisorError::InspectorClosed),
        Access::Unauthorized if is_page => {
            return html(StatusCode::UNAUTHORIZED, page::sign_in(false));
        }
        Access::Unauthorized => return refuse(&state.metrics, VisorError::Unauthorized),
    }
    let mut resp = answer(state, &path, req).await;
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

async fn answer(state: &AppState, path: &str, req: Request<RequestBody>) -> Response<ProxyBody> {
    let inspector = &state.inspector;
    let bad = |e| refuse(&state.metrics, e);
    match path {
        "/visor/ui" | "/visor/api/requests" => {
            let filter = match Filter::parse(req.uri().query()) {
                Ok(f) => f,
                Err(why) => return bad(VisorError::BadFilter(why)),
            };
            let (list, fleet) = inspector.requests(&filter).await;
            if path == "/visor/ui" {
                return html(
                    StatusCode::OK,
                    page::requests(&list, &filter, &inspector.replica, fleet),
                );
            }
            let list: Vec<&crate::inspector::Summary> = list.iter().map(|s| &**s).collect();
            let body = serde_json::json!({"replica": inspector.replica, "fleet": fleet, "dropped": inspector.dropped.load(std::sync::atomic::Ordering::Relaxed), "requests": list});
            json_owned(StatusCode::OK, body.to_string())
        }
        "/visor/ui/savings" => html(StatusCode::OK, page::savings(&inspector.savings().await)),
        "/visor/api/savings" => json(&inspector.savings().await),
        "/visor/api/events" => events(state),
        "/visor/api/explain" if req.method() == Method::POST => {
            super::explain::answer(state, req).await
        }
        _ => by_id(state, path).await,
    }
}

/// The pages and JSON of one request or one conversation.
async fn by_id(state: &AppState, path: &str) -> Response<ProxyBody> {
    let inspector = &state.inspector;
    let bad = |e| refuse(&state.metrics, e);
    let decoded = crate::inspector::filter::percent_decode_path(path);
    let path = decoded.as_deref().unwrap_or(path);
    if let Some((api, id)) = path
        .strip_prefix("/visor/ui/requests/")
        .map(|id| (false, id))
        .or_else(|| {
            path.strip_prefix("/visor/api/requests/")
                .map(|id| (true, id))
        })
    {
        let Some(s) = inspector.request(id).await else {
            return bad(VisorError::RequestNotKept(truncate(id, 100)));
        };
        let pairs = inspector.detail(&s);
        if api {
            let body = serde_json::json!({"request": &*s, "messages": pairs});
            return json_owned(StatusCode::OK, body.to_string());
        }
        return html(
            StatusCode::OK,
            page::request(&s, pairs.as_deref(), &inspector.replica),
        );
    }
    if let Some((api, id)) = path
        .strip_prefix("/visor/ui/conversations/")
        .map(|id| (false, id))
        .or_else(|| {
            path.strip_prefix("/visor/api/conversations/")
                .map(|id| (true, id))
        })
    {
        let list = inspector.conversation(id).await;
        if api {
            let list: Vec<&crate::inspector::Summary> = list.iter().map(|s| &**s).collect();
            let body = serde_json::json!({"conversation": id, "requests": list});
            return json_owned(StatusCode::OK, body.to_string());
        }
        return html(StatusCode::OK, page::conversation(id, &list));
    }
    bad(VisorError::NotFound(truncate(path, 200)))
}

fn json<T: serde::Serialize>(v: &T) -> Response<ProxyBody> {
    json_owned(StatusCode::OK, serde_json::to_string(v).unwrap_or_default())
}

/// A page: no script but the page's own, no request elsewhere.
fn html(status: StatusCode, body: String) -> Response<ProxyBody> {
    let mut resp = Response::new(ProxyBody::from(Bytes::from(body)));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'unsafe-inline'; \
             img-src 'self'; form-action 'self'; frame-ancestors 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    resp
}

/// The sign-in form (GET) and its answer (POST `key=…`): a cookie and
/// back to the page, or the form again with 401.
async fn sign_in(state: &AppState, req: Request<RequestBody>) -> Response<ProxyBody> {
    if state.inspector.is_open() {
        return redirect("/visor/ui", None);
    }
    if req.method() != Method::POST {
        return html(StatusCode::OK, page::sign_in(false));
    }
    let https = req
        .headers()
        .get("x-forwarded-proto")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
    let body = match http_body_util::Limited::new(req.into_body(), 4096)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => return html(StatusCode::BAD_REQUEST, page::sign_in(true)),
    };
    let key = std::str::from_utf8(&body)
        .ok()
        .into_iter()
        .flat_map(|b| b.split('&'))
        .filter_map(|p| p.strip_prefix("key="))
        .find_map(crate::inspector::filter::percent_decode);
    let signed = match key {
        Some(k) => state.inspector.sign_in(k.trim()),
        None => Err(SignIn::Wrong),
    };
    match signed {
        Ok(v) => {
            // Behind a TLS terminator the cookie is sent over TLS only.
            let secure = match https {
                true => "; Secure",
                false => "",
            };
            let c = format!(
                "{COOKIE}={v}; Path=/visor; HttpOnly; SameSite=Strict; Max-Age={SIGN_IN_SECS}{secure}"
            );
            redirect("/visor/ui", Some(c))
        }
        Err(SignIn::Wrong) => html(StatusCode::UNAUTHORIZED, page::sign_in(true)),
        Err(SignIn::TooMany) => refuse(
            &state.metrics,
            VisorError::InspectorBusy("too many wrong admin keys this minute"),
        ),
    }
}

fn redirect(to: &'static str, cookie: Option<String>) -> Response<ProxyBody> {
    let mut resp = Response::new(ProxyBody::from(Bytes::new()));
    *resp.status_mut() = StatusCode::SEE_OTHER;
    resp.headers_mut()
        .insert(header::LOCATION, HeaderValue::from_static(to));
    if let Some(c) = cookie.and_then(|c| HeaderValue::from_str(&c).ok()) {
        resp.headers_mut().insert(header::SET_COOKIE, c);
    }
    resp
}

/// `/visor/api/events`: each request's summary as it is kept, one
/// Server-Sent Event each (`data: {json}`); a comment every 15 s keeps
/// idle connections open. A watcher too slow for the stream misses events
/// (it is told with a `lagged` event), never slows the proxy.
fn events(state: &AppState) -> Response<ProxyBody> {
    let Some(watching) = state.inspector.watch() else {
        return refuse(
            &state.metrics,
            VisorError::InspectorBusy("too many event streams are open"),
        );
    };
    let mut rx = state.inspector.events();
    let shutdown = state.life.shutdown.clone();
    let (tx, out) = tokio::sync::mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let _watching = watching;
        let _ = tx
            .send(Bytes::from_static(b": visor inspector events\n\n"))
            .await;
        loop {
            let next = tokio::select! {
                // Shutdown: the stream ends, so draining does not wait on it.
                () = shutdown.cancelled() => return,
                n = tokio::time::timeout(std::time::Duration::from_secs(15), rx.recv()) => n,
            };
            let frame = match next {
                Err(_) => Bytes::from_static(b": keep-alive\n\n"),
                Ok(Ok(s)) => match serde_json::to_string(&*s) {
                    Ok(j) => Bytes::from(format!("data: {j}\n\n")),
                    Err(_) => continue,
                },
                Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(n))) => {
                    Bytes::from(format!("event: lagged\ndata: {n}\n\n"))
                }
                Ok(Err(tokio::sync::broadcast::error::RecvError::Closed)) => return,
            };
            if tx.send(frame).await.is_err() {
                return;
            }
        }
    });
    let mut resp = Response::new(ProxyBody::Events(out));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    resp
}
