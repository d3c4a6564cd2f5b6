//! The service stack: what happens to a request, in order.

mod answer;
pub mod body;
pub mod coalesce;
mod forward;
pub mod headers;
pub mod media_text;
mod prepare;
pub mod request_body;
mod router;
pub mod session_turn;
pub mod usage;
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

use crate::artifacts::Artifacts;
use crate::config::Config;
use crate::describe::Describer;
use crate::error::VisorError;
use crate::metrics::{Metrics, NO_UPSTREAM};
use crate::models::{Learned, ModelTable};
use crate::store::Store;
use crate::upstream::{RequestBody, Upstreams};
use body::ProxyBody;
use headers::{ProxyKeys, X_REQUEST_ID};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What every request handler shares.
pub struct AppState {
    pub config: Config,
    pub metrics: Arc<Metrics>,
    pub upstreams: Arc<Upstreams>,
    pub keys: ProxyKeys,
    /// Set at shutdown: `/readyz` answers 503.
    pub draining: AtomicBool,
    /// Work a request leaves behind (a session turn still being stored when
    /// its client went away): waited for at shutdown, within the drain
    /// timeout.
    pub tasks: TaskTracker,
    /// Fired when shutdown starts draining: a WebSocket closes (1001) once
    /// no response is under way on it.
    pub shutdown: CancellationToken,
    /// Upstream names, shared into response bodies for their metrics.
    pub upstream_names: Vec<Arc<str>>,
    /// False when the first upstream takes every model: then the route never
    /// depends on the body, and bodies visor does not transform are not read.
    pub route_by_model: bool,
    /// The model-spec table (user, built-in and learned rows).
    pub models: ModelTable,
    /// Where replaced images are saved and served from.
    pub artifacts: Artifacts,
    /// `images.refusal_phrases`, lower case.
    pub refusal_phrases: Vec<String>,
    /// Descriptions and learned models beyond one request (`[store]`).
    pub store: Arc<Store>,
    /// The vision model that describes images, and its cache.
    pub describer: Arc<Describer>,
    /// The model that writes down speech (`[transcriber]`), and its cache.
    pub transcriber: Arc<Describer>,
    /// The fallback budget and the breakers of the upstreams in a chain.
    pub retries: crate::retries::Retries,
    /// `[[key]]` limits (counted in the store when it is shared).
    pub limits: crate::limits::Limiter,
}

impl AppState {
    pub fn new(
        config: Config,
        metrics: Arc<Metrics>,
        upstreams: Upstreams,
    ) -> Result<Self, String> {
        let keys = ProxyKeys::new(
            &config.server.api_keys,
            &config
                .keys
                .iter()
                .map(|k| k.key.as_ref())
                .collect::<Vec<_>>(),
        );
        let upstream_names = config
            .upstreams
            .iter()
            .map(|u| Arc::from(u.name.as_str()))
            .collect();
        let route_by_model = !config.upstreams.first().is_some_and(|u| u.matches_all());
        if config.upstreams.is_empty() {
            return Err("no upstream configured".to_owned());
        }
        let models =
            ModelTable::new(&config.models, Learned::default()).map_err(|e| e.to_string())?;
        let upstreams = Arc::new(upstreams);
        let store = Arc::new(Store::open(
            &config.store.backend,
            &config.store.prefix,
            &config.server.data_dir,
            metrics.clone(),
        )?);
        let describer = Arc::new(Describer::new(
            &config,
            upstreams.clone(),
            store.clone(),
            metrics.clone(),
        ));
        let transcriber = Arc::new(Describer::transcriber(
            &config,
            upstreams.clone(),
            store.clone(),
            metrics.clone(),
        ));
        // Only upstreams a chain may send to show a breaker state: a config
        // without fallbacks exposes no new series.
        let in_chain = |i: usize| {
            config
                .upstreams
                .iter()
                .any(|u| u.has_fallbacks() && u.chain.contains(&i))
        };
        let retries = crate::retries::Retries::new(&config.retries, config.upstreams.len(), |i| {
            in_chain(i).then(|| {
                metrics
                    .upstream_state
                    .with_label_values(&[config.upstreams[i].name.as_str()])
            })
        });
        // Every key's context series exist from the start (at 0), so the
        // alert on a jump has a baseline.
        for name in config
            .keys
            .iter()
            .map(|k| k.name.as_str())
            .chain(["api_keys", "none"])
        {
            metrics.context_resent.with_label_values(&[name]);
            metrics.context_received.with_label_values(&[name]);
            metrics.context_long.with_label_values(&[name]);
        }
        let limits = crate::limits::Limiter::new(
            config
                .keys
                .iter()
                .map(crate::limits::KeyLimits::from)
                .collect(),
            store.clone(),
            metrics.clone(),
        );
        let artifacts = Artifacts::new(config.artifacts_dir());
        let refusal_phrases = config
            .images
            .refusal_phrases
            .iter()
            .map(|p| p.to_lowercase())
            .collect();
        Ok(Self {
            retries,
            models,
            store,
            describer,
            transcriber,
            limits,
            artifacts,
            refusal_phrases,
            config,
            metrics,
            upstreams,
            keys,
            draining: AtomicBool::new(false),
            tasks: TaskTracker::new(),
            shutdown: CancellationToken::new(),
            upstream_names,
            route_by_model,
        })
    }

    /// Loads the learned models from the store; returns how many were new.
    pub async fn sync_learned(&self) -> usize {
        match self.store.learned().await {
            Ok(names) => self.models.learned.merge(names),
            Err(_) => 0,
        }
    }

    /// Moves the models in `learned-models.json` (where the version before
    /// the store kept them) into the store, then renames the file to
    /// `learned-models.json.imported`. While the store is down they are
    /// learned in memory and the file stays for the next start.
    pub async fn import_legacy_learned(&self) {
        let path = self.config.learned_path();
        let legacy = crate::models::legacy_learned(&path);
        if legacy.is_empty() {
            return;
        }
        let mut stored = true;
        for name in &legacy {
            stored &= self.store.learn(name).await.is_ok();
        }
        self.models.learned.merge(legacy);
        if stored {
            let done = path.with_extension("json.imported");
            match std::fs::rename(&path, &done) {
                Ok(()) => {
                    tracing::info!(from = %path.display(), "learned models moved into the store")
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cannot rename the imported learned-models file")
                }
            }
        }
    }
}

/// The request id of this request, put in the extensions by [`RequestSpan`].
#[derive(Clone)]
pub struct RequestIdExt(pub HeaderValue);

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
///    (the model-spec table in [`AppState::models`]), forward, and answer
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
        let path = req.uri().path();
        let guarded = path == "/v1"
            || path.starts_with("/v1/")
            || path == "/visor"
            || path.starts_with("/visor/");
        let caller = self.state.keys.caller(req.headers());
        if guarded && caller.is_none() {
            let err = VisorError::Unauthorized;
            tracing::info!(error = err.label(), "refused");
            self.state
                .metrics
                .requests
                .with_label_values(&[NO_UPSTREAM, "", "401"])
                .inc();
            return Box::pin(async move { Ok(err.into_response()) });
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
        Box::pin(async move { Ok(router::handle(state, req).await) })
    }
}
