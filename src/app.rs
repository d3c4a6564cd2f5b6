//! The composition root: every part is built here, once, from the checked
//! config, in the order the parts depend on each other, and handed to the
//! proxy as the narrow contexts its phases take. Nothing else on the
//! serving path builds a part (the CLI's `check` and `explain` build the
//! few they read); no part reaches back into the proxy.
//!
//! ```text
//! config ─► metrics, upstream client           (given by the caller)
//!        ─► store ─► describer, transcriber ─► media_text
//!        ─► model table, artifacts, image and dedup rules ─► proxy::Rewriter
//!        ─► proxy keys, [[key]] limits (store)  ─► proxy::Gate
//!        ─► sessions (store, proxy keys)        ─► proxy::Sessions
//!        ─► retry budget and breakers, upstreams ─► proxy::Routes
//!        ─► [cache] (store)                     ─► prompt_cache::PromptCache
//!        ─► [inspector] (listen, proxy keys, store) ─► inspector::Inspector
//!        ─► [telemetry] (metrics)               ─► telemetry::Telemetry
//! ```

use std::sync::Arc;

use crate::artifacts::Artifacts;
use crate::config::Config;
use crate::inspector::Inspector;
use crate::limits::Limiter;
use crate::media_text::MediaText;
use crate::media_text::describe::Describer;
use crate::metrics::Metrics;
use crate::models::{Learned, ModelTable};
use crate::prompt_cache::PromptCache;
use crate::proxy::{AppState, Gate, Lifecycle, ProxyKeys, Rewriter, Routes, Sessions};
use crate::retries::Retries;
use crate::store::Store;
use crate::transform::Rules;
use crate::upstream::Upstreams;

/// Builds the proxy's state from `config`. Must be called inside a Tokio
/// runtime (the Redis store's client needs one). `Err`: a config the
/// parts cannot run with (no upstream, a model table that does not load,
/// a store that cannot be opened).
pub fn build(
    config: Config,
    metrics: Arc<Metrics>,
    upstreams: Upstreams,
) -> Result<AppState, String> {
    if config.upstreams.is_empty() {
        return Err("no upstream configured".to_owned());
    }
    let models =
        Arc::new(ModelTable::new(&config.models, Learned::default()).map_err(|e| e.to_string())?);
    let upstreams = Arc::new(upstreams);
    let store = Arc::new(Store::open(
        &config.store.backend,
        &config.store.prefix,
        &config.server.data_dir,
        metrics.clone(),
    )?);
    // Limits are counted in the store only when it is shared (Redis).
    metrics.ratelimit_shared.set(i64::from(store.is_shared()));
    let media = Arc::new(media_text(&config, &upstreams, &store, &metrics));
    let gate = gate(&config, store.clone(), metrics.clone());
    let rewrite = rewriter(
        &config,
        &gate,
        models,
        media,
        store.clone(),
        metrics.clone(),
    );
    let life = Lifecycle::default();
    let sessions = Sessions::new(
        &config.sessions,
        store.clone(),
        gate.keys.clone(),
        metrics.clone(),
        life.tasks.clone(),
    );
    let retries = retries(&config, &metrics);
    let cache = PromptCache::new(config.cache, store.clone(), &metrics);
    let inspector = Arc::new(Inspector::new(
        &config.inspector,
        Some(config.server.listen),
        gate.keys.is_set(),
        &config.describer.model,
    ));
    inspector.start(
        store.clone(),
        rewrite.models.clone(),
        metrics.inspector_dropped.clone(),
    );
    let telemetry = telemetry(&config, &metrics);
    // What the phases keep of the config itself: the server's bounds and
    // deadlines, and the upstreams to route to.
    let Config {
        server,
        upstreams: upstream_configs,
        ..
    } = config;
    let routes = Routes {
        names: upstream_configs
            .iter()
            .map(|u| Arc::from(u.name.as_str()))
            .collect(),
        by_model: !upstream_configs.first().is_some_and(|u| u.matches_all()),
        upstreams: upstream_configs,
        client: upstreams,
        retries,
    };
    Ok(AppState {
        server,
        metrics,
        gate,
        routes,
        rewrite,
        sessions,
        cache,
        inspector,
        store,
        life,
        telemetry,
        checked: (config.dedup.state_bytes > 0)
            .then(|| Arc::new(crate::proxy::checked_prefixes::CheckedPrefixes::new())),
    })
}

/// The tracer and its exporter, when `[telemetry] otlp_endpoint` is set
/// (a client that cannot be built turns traces off, said in the log).
fn telemetry(config: &Config, metrics: &Metrics) -> Option<Arc<crate::telemetry::Telemetry>> {
    config.telemetry.traces_url.as_ref()?;
    let client = match crate::upstream::client_of(config.server.connect_timeout) {
        Ok(c) => crate::telemetry::export::Client(c),
        Err(e) => {
            tracing::warn!(error = %e, "traces are off: no TLS client for the collector");
            return None;
        }
    };
    crate::telemetry::Telemetry::start(&config.telemetry, client, metrics.telemetry_spans.clone())
}

/// The describer and transcriber (calls through the upstream client, kept
/// in the store), and what reads documents.
fn media_text(
    config: &Config,
    upstreams: &Arc<Upstreams>,
    store: &Arc<Store>,
    metrics: &Arc<Metrics>,
) -> MediaText {
    let describer = Describer::new(config, upstreams.clone(), store.clone(), metrics.clone());
    let transcriber =
        Describer::transcriber(config, upstreams.clone(), store.clone(), metrics.clone());
    MediaText::new(
        config,
        Arc::new(describer),
        Arc::new(transcriber),
        metrics.clone(),
    )
}

/// What the transform phase reads: the model table, the rules built once,
/// the media part, where originals go.
fn rewriter(
    config: &Config,
    gate: &Gate,
    models: Arc<ModelTable>,
    media: Arc<MediaText>,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
) -> Rewriter {
    Rewriter {
        models,
        rules: Rules::new(&config.images, &config.dedup, None, None),
        describes: config.images.non_vision == crate::config::NonVision::Describe,
        query_aware: config.describer.query_aware,
        // Lower case already (config's images section).
        refusal_phrases: config.images.refusal_phrases.clone(),
        artifacts: Artifacts::new(config.artifacts_dir()),
        proxy_keys_set: gate.keys.is_set(),
        request_timeout: config.server.request_timeout,
        max_body_bytes: config.server.max_body_bytes,
        media,
        store,
        metrics,
        fit: crate::transform::Limits {
            provider_size: config.images.provider_size,
            diet_edge: config.images.max_edge,
            diet_tokens: config.images.max_image_tokens,
            ..crate::transform::Limits::NONE
        },
        fitter: Arc::new(crate::proxy::fit_images::Fitter::new(
            Some(config.artifacts_dir().join("fitted")),
            std::thread::available_parallelism().map_or(2, |n| n.get()),
        )),
        dedup_states: crate::proxy::dedup_states::DedupStates::new(config.dedup.state_bytes)
            .map(Arc::new),
    }
}

/// Who may call (proxy keys), and what each `[[key]]` may spend.
fn gate(config: &Config, store: Arc<Store>, metrics: Arc<Metrics>) -> Gate {
    let keys = ProxyKeys::new(
        &config.server.api_keys,
        &config
            .keys
            .iter()
            .map(|k| k.key.as_ref())
            .collect::<Vec<_>>(),
    );
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
    let limits = Limiter::new(
        config
            .keys
            .iter()
            .map(crate::limits::KeyLimits::from)
            .collect(),
        store,
        metrics.clone(),
    );
    Gate {
        keys: Arc::new(keys),
        limits,
        keyless: config.keys.iter().position(|k| k.key.is_none()),
        max_depth: config.sessions.max_depth as usize,
        metrics,
    }
}

/// The fallback budget, and the breakers of the upstreams a chain may send
/// to.
fn retries(config: &Config, metrics: &Metrics) -> Retries {
    // Only upstreams a chain may send to show a breaker state: a config
    // without fallbacks exposes no new series.
    let in_chain = |i: usize| {
        config
            .upstreams
            .iter()
            .any(|u| u.has_fallbacks() && u.chain.contains(&i))
    };
    Retries::new(&config.retries, config.upstreams.len(), |i| {
        in_chain(i).then(|| {
            metrics
                .upstream_state
                .with_label_values(&[config.upstreams[i].name.as_str()])
        })
    })
}
