//! The service stack: what happens to a request, in order.

mod admission;
pub mod body;
pub mod checked_prefixes;
pub mod coalesce;
pub mod dedup_states;
mod edge;
mod explain;
pub mod fit_images;
mod forward;
pub mod headers;
mod inspect;
mod prepare;
pub mod request_body;
mod router;
pub mod session_turn;
mod traced;
mod websocket;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::task::{Context, Poll};

use http::{HeaderValue, Request, Response};
use tower::{Layer, Service, ServiceBuilder};
use tracing::Instrument;

use crate::config::{Server, Upstream};
use crate::error::VisorError;
use crate::metrics::Metrics;
use crate::retries::Retries;
use crate::store::Store;
use crate::upstream::{RequestBody, Upstreams};
use body::ProxyBody;
use headers::X_REQUEST_ID;

pub use admission::Gate;
pub use headers::ProxyKeys;
pub use prepare::{Rewriter, fit_limits};
pub use session_turn::Sessions;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What the proxy's phases share, as narrow contexts: each phase takes the
/// one it reads (built by [`crate::app::build`], the composition root).
pub struct AppState {
    /// `[server]`: the body limit and the deadlines.
    pub server: Server,
    pub metrics: Arc<Metrics>,
    /// Who may call, and what each `[[key]]` may spend (the auth layer,
    /// phase 3b, each WebSocket event).
    pub gate: Gate,
    /// Where a request goes (phases 3 and 6, the WebSocket connect).
    pub routes: Routes,
    /// What a request becomes (phases 5 and 7).
    pub rewrite: Rewriter,
    /// Conversations kept by visor (phase 4, `/visor/sessions`).
    pub sessions: Sessions,
    /// Cache breakpoints and keys, and each request's cache judged (phase
    /// 5c; settled when its answer ends).
    pub cache: crate::prompt_cache::PromptCache,
    /// What visor did to recent requests (`/visor/ui`, `/visor/api/…`).
    pub inspector: Arc<crate::inspector::Inspector>,
    /// Descriptions, learned models, sessions and shared counts beyond one
    /// request (`[store]`): `/readyz`, the sweeps.
    pub store: Arc<Store>,
    /// Start, drain and stop.
    pub life: Lifecycle,
    /// OpenTelemetry traces (`[telemetry]`; `None`: off).
    pub telemetry: Option<Arc<crate::telemetry::Telemetry>>,
    /// Where clients' bodies were checked, for their next requests
    /// (phase 2; `None`: `[dedup] state_bytes = 0`).
    pub checked: Option<Arc<checked_prefixes::CheckedPrefixes>>,
}

/// Where requests go: the upstreams in config order, their pooled client,
/// and the fallback budget and breakers.
pub struct Routes {
    /// `[[upstream]]`, checked, in order.
    pub upstreams: Vec<Upstream>,
    /// Upstream names, shared into response bodies for their metrics.
    pub names: Vec<Arc<str>>,
    /// False when the first upstream takes every model: then the route
    /// never depends on the body, and bodies visor does not transform are
    /// not read.
    pub by_model: bool,
    pub client: Arc<Upstreams>,
    /// The fallback budget and the breakers of the upstreams in a chain.
    pub retries: Retries,
}

impl Routes {
    /// Phase 3: the first upstream whose globs match; no model → the first
    /// upstream; a model nobody takes → 404.
    pub fn route(&self, model: Option<&str>) -> Result<usize, VisorError> {
        let index = match model {
            None => Some(0),
            Some(m) => self.upstreams.iter().position(|u| u.matches(m)),
        };
        index.ok_or_else(|| VisorError::NoRoute(model.unwrap_or_default().to_owned()))
    }
}

/// Start, drain and stop: what shutdown sets and waits for.
#[derive(Default)]
pub struct Lifecycle {
    /// Set at shutdown: `/readyz` answers 503.
    pub draining: AtomicBool,
    /// Work a request leaves behind (a session turn still being stored when
    /// its client went away): waited for at shutdown, within the drain
    /// timeout.
    pub tasks: TaskTracker,
    /// Fired when shutdown starts draining: a WebSocket closes (1001) once
    /// no response is under way on it.
    pub shutdown: CancellationToken,
}

/// The request id of this request, put in the extensions by [`RequestSpan`].
#[derive(Clone)]
pub struct RequestIdExt(pub HeaderValue);

impl RequestIdExt {
    /// The id layer 1 gave the request of `extensions`.
    pub fn of(extensions: &http::Extensions) -> HeaderValue {
        extensions
            .get::<RequestIdExt>()
            .map_or_else(|| HeaderValue::from_static("req_unknown"), |r| r.0.clone())
    }
}

type BoxFut = Pin<Box<dyn Future<Output = Result<Response<ProxyBody>, Infallible>> + Send>>;

/// Builds the whole request path. Layers, outermost first:
///
/// 1. [`RequestSpan`] — takes a sane `x-request-id` from the client or
///    makes one, stores it as [`RequestIdExt`] (read by the proxy and the
///    upstream headers), opens the request span (id, method, path) that
///    every log line of the request is inside (never headers or bodies),
///    and echoes the id on every response.
/// 2. [`Auth`] — when `server.api_keys` is set, `/v1/*` and `/visor/*` need one
///    of them (`Authorization: Bearer` or `x-api-key`, constant-time compare);
///    401 otherwise. `/healthz`, `/readyz`, `/metrics` stay open.
/// 3. the router ([`router::handle`]) — visor's own endpoints, or the proxy:
///    refuse bad targets (400/404), read or stream the body (413 over the
///    limit, 400 for invalid JSON on transformed endpoints), pick the upstream
///    by `model` (404 if none), replace images for a model that cannot see
///    (the model-spec table in [`Rewriter::models`]), forward, and answer
///    with the upstream's response passed through an observing body
///    (metrics, usage, deadlines). It also serves `/visor/artifacts/<sha256>`.
///
/// The stack takes any request body that converts into a [`RequestBody`]:
/// hyper's `Incoming` from a socket (the server), or a body built in
/// process ([`RequestBody::new`]: tests call the stack with
/// `tower::ServiceExt::oneshot`).
pub fn stack<B>(
    state: Arc<AppState>,
) -> impl Service<Request<B>, Response = Response<ProxyBody>, Error = Infallible, Future = BoxFut>
+ Clone
+ Send
+ 'static
where
    B: Into<RequestBody> + 'static,
{
    ServiceBuilder::new()
        .map_request(|req: Request<B>| req.map(Into::into))
        .layer(tower::layer::layer_fn(|inner| RequestSpan { inner }))
        .layer(AuthLayer {
            state: state.clone(),
        })
        .service(Router { state })
}

/// Layer 1: the request's id and span. Takes a sane `x-request-id` from
/// the client or makes one, stores it as [`RequestIdExt`] (read by the
/// proxy and the upstream headers), opens the request span (id, method,
/// path) that every log line of the request is inside — never headers or
/// bodies — and echoes the id on the response.
#[derive(Clone)]
pub struct RequestSpan<S> {
    inner: S,
}

impl<S> Service<Request<RequestBody>> for RequestSpan<S>
where
    S: Service<
            Request<RequestBody>,
            Response = Response<ProxyBody>,
            Error = Infallible,
            Future = BoxFut,
        >,
{
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = BoxFut;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<RequestBody>) -> BoxFut {
        let id = headers::request_id(req.headers());
        req.extensions_mut().insert(RequestIdExt(id.clone()));
        let span = tracing::info_span!(
            "request",
            request_id = %id.to_str().unwrap_or_default(),
            method = %req.method(),
            path = %req.uri().path(),
        );
        let fut = self.inner.call(req);
        Box::pin(
            async move {
                let mut resp = fut.await?;
                tracing::debug!(status = resp.status().as_u16(), "response head sent");
                resp.headers_mut().insert(X_REQUEST_ID.clone(), id);
                Ok(resp)
            }
            .instrument(span),
        )
    }
}

/// Layer 2: proxy keys.
#[derive(Clone)]
pub struct AuthLayer {
    state: Arc<AppState>,
}

impl<S> Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Auth<S> {
        Auth {
            inner,
            state: self.state.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Auth<S> {
    inner: S,
    state: Arc<AppState>,
}

impl<S> Service<Request<RequestBody>> for Auth<S>
where
    S: Service<
            Request<RequestBody>,
            Response = Response<ProxyBody>,
            Error = Infallible,
            Future = BoxFut,
        >,
{
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = BoxFut;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<RequestBody>) -> BoxFut {
        // Guarded as the router reads it: `//v1/…` and `/%76%31/…` are
        // `/v1/…` (a path the router refuses is guarded as it came).
        let canonical = router::canonical_path(req.uri().path(), router::plain_get(&req));
        let path = match &canonical {
            Ok(Some(p)) => p.as_str(),
            _ => req.uri().path(),
        };
        // The inspector asks for its own (admin) keys; an artifact is also
        // shown to whoever may read the inspector (its thumbnails).
        let inspector = inspect::is_inspector(path)
            || (path.starts_with("/visor/artifacts/")
                && self.state.inspector.enabled
                && self.state.inspector.access(req.headers(), req.uri())
                    == crate::inspector::Access::Granted);
        let guarded = !inspector
            && (path == "/v1"
                || path.starts_with("/v1/")
                || path == "/visor"
                || path.starts_with("/visor/"));
        let caller = self.state.gate.keys.caller(req.headers());
        if guarded && caller.is_none() {
            let resp = edge::refuse(&self.state.metrics, VisorError::Unauthorized);
            return Box::pin(async move { Ok(resp) });
        }
        let mut req = req;
        req.extensions_mut()
            .insert(caller.unwrap_or(headers::Caller::Anonymous));
        self.inner.call(req)
    }
}

/// Layer 3: the innermost service.
#[derive(Clone)]
pub struct Router {
    state: Arc<AppState>,
}

impl Service<Request<RequestBody>> for Router {
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = BoxFut;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<RequestBody>) -> BoxFut {
        let state = self.state.clone();
        in_box(|| async move { Ok(router::handle(state, req).await) })
    }
}

/// The future `make` returns, written into a box allocated first, which
/// lets the compiler build a large future where it stays (an optimisation,
/// not a promise of the language: `benches/instructions.sh` shows a `memcpy`
/// of the future's size when it is not made). `Box::pin(make())` builds it
/// on the stack and copies all of its size into the box: 12 KB for a
/// proxied request's, most of it not yet written.
pub(crate) fn in_box<F: Future>(make: impl FnOnce() -> F) -> Pin<Box<F>> {
    Box::into_pin(Box::write(Box::new_uninit(), make()))
}
