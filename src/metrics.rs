//! Every metric, registered once, and the `/metrics` text.
//!
//! Names follow `visor_<noun>_<unit>`; labels are bounded: upstream names come
//! from the config, `model` is capped at [`MAX_MODEL_LABELS`] distinct values
//! per process (`other` after that), status and error kinds are fixed sets.

use std::collections::HashSet;
use std::sync::Mutex;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Distinct `model` label values kept per process.
pub const MAX_MODEL_LABELS: usize = 200;

/// Upstream label for requests that never reached one (401, 404, 400…).
pub const NO_UPSTREAM: &str = "none";

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
];

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub request_duration: HistogramVec,
    pub first_byte: HistogramVec,
    pub inflight: IntGauge,
    pub upstream_errors: IntCounterVec,
    pub tokens: IntCounterVec,
    pub images: IntCounterVec,
    pub media: IntCounterVec,
    pub ratelimited: IntCounterVec,
    pub ratelimit_shared: IntGauge,
    pub ratelimit_local_checks: IntCounter,
    pub context_resent: IntCounterVec,
    /// `visor_cache_tokens_total{kind}`: readable, read, written.
    pub cache_tokens: IntCounterVec,
    /// `visor_cache_misses_total{cause}`.
    pub cache_misses: IntCounterVec,
    pub context_received: IntCounterVec,
    pub context_long: IntCounterVec,
    pub bytes_saved: IntCounterVec,
    pub capability_learned: IntCounter,
    pub transform_duration: Histogram,
    pub artifact_errors: IntCounter,
    /// `visor_inspector_dropped_total`.
    pub inspector_dropped: IntCounter,
    /// `visor_telemetry_spans_total{result}`: exported, dropped, failed.
    pub telemetry_spans: IntCounterVec,
    /// `visor_dedup_reads_total{read}`: continued, full.
    pub dedup_reads: IntCounterVec,
    /// `visor_prefix_reads_total{part, read}`: json, prompt_cache,
    /// inspector; continued, full.
    pub prefix_reads: IntCounterVec,
    pub describe: IntCounterVec,
    /// `visor_credential_refused_total{role, upstream}`
    pub credential_refused: IntCounterVec,
    pub describe_duration: Histogram,
    pub describe_cache_entries: IntGauge,
    pub describe_background: IntGauge,
    pub store_errors: IntCounterVec,
    pub store_up: IntGauge,
    pub session_history: Histogram,
    pub session_turns: IntCounterVec,
    pub connections: IntGauge,
    pub connections_closed: IntCounterVec,
    pub retries: IntCounterVec,
    pub upstream_state: IntGaugeVec,
    models_seen: Mutex<HashSet<String>>,
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        // Which build is running: always 1, the version and commit as
        // labels (join on them in queries and dashboards).
        gauge_vec(
            &registry,
            "visor_build_info",
            "Always 1: the version and the commit this visor was built from",
            &["version", "commit"],
        )?
        .with_label_values(&[env!("CARGO_PKG_VERSION"), env!("VISOR_COMMIT")])
        .set(1);
        let traffic = Traffic::register(&registry)?;
        let upstreams = Upstreams::register(&registry)?;
        let transforms = Transforms::register(&registry)?;
        let describer = Describer::register(&registry)?;
        let context = Context::register(&registry)?;
        let limits = Limits::register(&registry)?;
        let persistence = Persistence::register(&registry)?;
        Ok(Self {
            registry,
            requests: traffic.requests,
            request_duration: traffic.request_duration,
            first_byte: traffic.first_byte,
            inflight: traffic.inflight,
            upstream_errors: upstreams.upstream_errors,
            tokens: traffic.tokens,
            images: transforms.images,
            media: transforms.media,
            ratelimited: limits.ratelimited,
            ratelimit_shared: limits.ratelimit_shared,
            ratelimit_local_checks: limits.ratelimit_local_checks,
            context_resent: context.context_resent,
            cache_tokens: context.cache_tokens,
            cache_misses: context.cache_misses,
            context_received: context.context_received,
            context_long: context.context_long,
            bytes_saved: transforms.bytes_saved,
            capability_learned: transforms.capability_learned,
            transform_duration: transforms.transform_duration,
            artifact_errors: transforms.artifact_errors,
            inspector_dropped: transforms.inspector_dropped,
            telemetry_spans: transforms.telemetry_spans,
            dedup_reads: transforms.dedup_reads,
            prefix_reads: transforms.prefix_reads,
            describe: describer.describe,
            credential_refused: describer.credential_refused,
            describe_duration: describer.describe_duration,
            describe_cache_entries: describer.describe_cache_entries,
            describe_background: describer.describe_background,
            store_errors: persistence.store_errors,
            store_up: persistence.store_up,
            session_history: persistence.session_history,
            session_turns: persistence.session_turns,
            connections: traffic.connections,
            connections_closed: traffic.connections_closed,
            retries: upstreams.retries,
            upstream_state: upstreams.upstream_state,
            models_seen: Mutex::new(HashSet::new()),
        })
    }

    /// `visor_tokens_total{kind, key}` for one response's usage: prompt,
    /// completion, cached_read, cache_write (a kind of 0 is not touched).
    pub fn count_tokens(&self, key: &str, tokens: [u64; 4]) {
        let kinds = ["prompt", "completion", "cached_read", "cache_write"];
        for (kind, n) in kinds.into_iter().zip(tokens) {
            if n > 0 {
                self.tokens.with_label_values(&[kind, key]).inc_by(n);
            }
        }
    }

    /// The label to use for `model`: the model itself while fewer than
    /// [`MAX_MODEL_LABELS`] distinct ones were seen, `other` after that.
    pub fn model_label(&self, model: &str) -> String {
        if model.is_empty() {
            return String::new();
        }
        let Ok(mut seen) = self.models_seen.lock() else {
            return "other".to_owned();
        };
        if seen.contains(model) {
            return model.to_owned();
        }
        if seen.len() < MAX_MODEL_LABELS {
            seen.insert(model.to_owned());
            return model.to_owned();
        }
        "other".to_owned()
    }

    pub fn upstream_error(&self, upstream: &str, kind: &str) {
        self.upstream_errors
            .with_label_values(&[upstream, kind])
            .inc();
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> Vec<u8> {
        let mut buf = Vec::with_capacity(8 * 1024);
        // Encoding into a Vec cannot fail on I/O; a metric family error would
        // be a programming error, and an empty answer is the safe outcome.
        if TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .is_err()
        {
            buf.clear();
        }
        buf
    }
}

/// Requests and client connections: what every answer counts.
struct Traffic {
    requests: IntCounterVec,
    request_duration: HistogramVec,
    first_byte: HistogramVec,
    inflight: IntGauge,
    tokens: IntCounterVec,
    connections: IntGauge,
    connections_closed: IntCounterVec,
}

impl Traffic {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        Ok(Self {
            requests: counter_vec(
                registry,
                "visor_requests_total",
                "Requests answered, by upstream, model as requested, status, and the caller's key name (none without one, api_keys for a server.api_keys key)",
                &["upstream", "model", "status", "key"],
            )?,
            request_duration: histogram_vec(
                registry,
                HistogramOpts::new(
                    "visor_request_duration_seconds",
                    "Time from the request's arrival to the end of its response body",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
                &["upstream"],
            )?,
            first_byte: histogram_vec(
                registry,
                HistogramOpts::new(
                    "visor_upstream_first_byte_seconds",
                    "Time from sending the request upstream to the first byte of the response body",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
                &["upstream"],
            )?,
            inflight: gauge(
                registry,
                "visor_inflight_requests",
                "Requests whose response has not finished yet",
            )?,
            tokens: counter_vec(
                registry,
                "visor_tokens_total",
                "Tokens reported by upstreams in `usage`, by kind (prompt, completion; cached_read and cache_write: the provider's prompt cache) and the caller's key name",
                &["kind", "key"],
            )?,
            connections: gauge(
                registry,
                "visor_client_connections",
                "Client connections open (server.max_connections at most)",
            )?,
            connections_closed: counter_vec(
                registry,
                "visor_client_connections_closed_total",
                "Client connections visor closed itself, by reason (header_timeout: no request head in time; idle: no request in time after the last one; shed: idle, closed to make room at max_connections)",
                &["reason"],
            )?,
        })
    }
}

/// Upstream failures, fallbacks and circuit breakers.
struct Upstreams {
    upstream_errors: IntCounterVec,
    retries: IntCounterVec,
    upstream_state: IntGaugeVec,
}

impl Upstreams {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        Ok(Self {
            upstream_errors: counter_vec(
                registry,
                "visor_upstream_errors_total",
                "Upstream failures by kind: connect, connect_timeout, first_byte_timeout, idle_timeout, request_timeout, reset, status_5xx",
                &["upstream", "kind"],
            )?,
            retries: counter_vec(
                registry,
                "visor_retries_total",
                "Requests sent on to an upstream's fallback, by the upstream that failed and why (connect, connect_timeout, reset, first_byte_timeout, status_5xx, status_429)",
                &["upstream", "reason"],
            )?,
            upstream_state: gauge_vec(
                registry,
                "visor_upstream_state",
                "Circuit breaker of each upstream in a fallback chain: 0 closed, 1 open (skipped), 2 half-open (one probe out)",
                &["upstream"],
            )?,
        })
    }
}

/// What the request transforms did: images and media replaced, bytes saved.
struct Transforms {
    images: IntCounterVec,
    media: IntCounterVec,
    bytes_saved: IntCounterVec,
    capability_learned: IntCounter,
    transform_duration: Histogram,
    artifact_errors: IntCounter,
    inspector_dropped: IntCounter,
    telemetry_spans: IntCounterVec,
    dedup_reads: IntCounterVec,
    prefix_reads: IntCounterVec,
}

impl Transforms {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let images = counter_vec(
            registry,
            "visor_images_total",
            "Images seen in transformed requests, by what was done: kept, described, stripped, aged_out, capped, deduped",
            &["action"],
        )?;
        for action in [
            "kept",
            "described",
            "stripped",
            "aged_out",
            "capped",
            "deduped",
        ] {
            images.with_label_values(&[action]);
        }
        let media = counter_vec(
            registry,
            "visor_media_total",
            "Documents and audio replaced for models that cannot take them, by kind (document, audio) and what was done: described (a document turned into text, with descriptions of its figures), transcribed, stripped (a reference or a line that says why), deduped",
            &["kind", "action"],
        )?;
        for (kind, action) in [
            ("document", "described"),
            ("document", "stripped"),
            ("document", "deduped"),
            ("audio", "transcribed"),
            ("audio", "stripped"),
            ("audio", "deduped"),
        ] {
            media.with_label_values(&[kind, action]);
        }
        let bytes_saved = counter_vec(
            registry,
            "visor_bytes_saved_total",
            "Request bytes removed by the transforms, by reason (images, dedup)",
            &["reason"],
        )?;
        for reason in ["images", "dedup"] {
            bytes_saved.with_label_values(&[reason]);
        }
        let telemetry_spans = counter_vec(
            registry,
            "visor_telemetry_spans_total",
            "Trace spans by what became of them: exported to the OTLP collector, dropped (the export queue was full: the request was not slowed), failed (the collector refused them or did not answer)",
            &["result"],
        )?;
        // At 0 from the start, so the first spans lost are a rise.
        for result in ["exported", "dropped", "failed"] {
            telemetry_spans.with_label_values(&[result]);
        }
        let (dedup_reads, prefix_reads) = reads(registry)?;
        Ok(Self {
            telemetry_spans,
            dedup_reads,
            prefix_reads,
            images,
            media,
            bytes_saved,
            capability_learned: counter(
                registry,
                "visor_capability_learned_total",
                "Models learned to refuse image input from an upstream's 4xx answer",
            )?,
            transform_duration: histogram(
                registry,
                HistogramOpts::new(
                    "visor_transform_duration_seconds",
                    "Time spent rewriting a request body (finding, decoding, hashing and replacing images)",
                )
                .buckets(vec![
                    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                    1.0,
                ]),
            )?,
            artifact_errors: counter(
                registry,
                "visor_artifact_write_errors_total",
                "Replaced images that could not be saved under artifacts_dir (the request still went on)",
            )?,
            inspector_dropped: counter(
                registry,
                "visor_inspector_dropped_total",
                "Requests the inspector let go because its recording queue was full (the requests were served)",
            )?,
        })
    }
}

/// `visor_dedup_reads_total` and `visor_prefix_reads_total`, every label
/// at 0 from the start.
fn reads(registry: &Registry) -> Result<(IntCounterVec, IntCounterVec), prometheus::Error> {
    let dedup_reads = counter_vec(
        registry,
        "visor_dedup_reads_total",
        "Requests of 8 KiB or more dedup read, by how: continued (only the messages new since the conversation's previous request, from the state it left) or full (every message: a new conversation, one whose state was evicted, or one that changed an earlier message)",
        &["read"],
    )?;
    for read in ["continued", "full"] {
        dedup_reads.with_label_values(&[read]);
    }
    let prefix_reads = counter_vec(
        registry,
        "visor_prefix_reads_total",
        "Large requests' other readings by how: continued (only what follows the bytes shared with the conversation's previous request) or full. part: json (accepted bodies of 8 KiB or more whose first 128 bytes match one their client sent), prompt_cache (each request of 8 KiB or more with dedup on), inspector (each body of 8 KiB or more it keeps: a request's body as received and as sent are two)",
        &["part", "read"],
    )?;
    for part in ["json", "prompt_cache", "inspector"] {
        for read in ["continued", "full"] {
            prefix_reads.with_label_values(&[part, read]);
        }
    }
    Ok((dedup_reads, prefix_reads))
}

/// The describer and transcriber calls, and the description cache.
struct Describer {
    describe: IntCounterVec,
    credential_refused: IntCounterVec,
    describe_duration: Histogram,
    describe_cache_entries: IntGauge,
    describe_background: IntGauge,
}

impl Describer {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let describe = counter_vec(
            registry,
            "visor_describe_total",
            "Image descriptions looked up, by result: hit (cached), miss (made by a describer call), error (describer failed or timed out; the placeholder was used)",
            &["result"],
        )?;
        for result in ["hit", "miss", "error"] {
            describe.with_label_values(&[result]);
        }
        Ok(Self {
            describe,
            credential_refused: counter_vec(
                registry,
                "visor_credential_refused_total",
                "Describer and transcriber calls their upstream refused with 401 or 403 (a missing or wrong credential), by role and upstream",
                &["role", "upstream"],
            )?,
            describe_duration: histogram(
                registry,
                HistogramOpts::new(
                    "visor_describe_duration_seconds",
                    "Time of one describer call, from sending it to the whole answer (failed calls too)",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
            )?,
            describe_cache_entries: gauge(
                registry,
                "visor_describe_cache_entries",
                "Descriptions held in the in-memory cache",
            )?,
            describe_background: gauge(
                registry,
                "visor_describe_background",
                "Descriptions being made in the background (describer.on_miss = \"placeholder\")",
            )?,
        })
    }
}

/// Context clients send again, by key.
struct Context {
    context_resent: IntCounterVec,
    cache_tokens: IntCounterVec,
    cache_misses: IntCounterVec,
    context_received: IntCounterVec,
    context_long: IntCounterVec,
}

impl Context {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        Ok(Self {
            context_resent: counter_vec(
                registry,
                "visor_context_resent_bytes_total",
                "Request bytes dedup removed (context the client sent again), by key name",
                &["key"],
            )?,
            cache_tokens: counter_vec(
                registry,
                "visor_cache_tokens_total",
                "Prompt tokens the provider could read from its cache (readable), read and wrote, as its usage says",
                &["kind"],
            )?,
            cache_misses: counter_vec(
                registry,
                "visor_cache_misses_total",
                "Requests whose cached prefix fell short, by cause (first, client, visor, expired, provider)",
                &["cause"],
            )?,
            context_received: counter_vec(
                registry,
                "visor_context_received_bytes_total",
                "Request body bytes received on the transformed endpoints, by key name",
                &["key"],
            )?,
            context_long: counter_vec(
                registry,
                "visor_context_long_requests_total",
                "Requests whose history holds more messages than sessions.max_depth, by key name",
                &["key"],
            )?,
        })
    }
}

/// Rate limits, and whether they are counted in the shared store.
struct Limits {
    ratelimited: IntCounterVec,
    ratelimit_shared: IntGauge,
    ratelimit_local_checks: IntCounter,
}

impl Limits {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let ratelimit_shared = gauge(
            registry,
            "visor_ratelimit_shared",
            "1 while rate limits are counted in the shared (Redis) store; 0 while each replica counts on its own: no shared store is configured, or it cannot be reached",
        )?;
        // Set to 1 at startup when the store is shared (`app::build`).
        ratelimit_shared.set(0);
        Ok(Self {
            ratelimited: counter_vec(
                registry,
                "visor_ratelimited_total",
                "Requests answered 429 for a key over its limit, by key name and limit (requests, tokens)",
                &["key", "limit"],
            )?,
            ratelimit_shared,
            ratelimit_local_checks: counter(
                registry,
                "visor_ratelimit_local_checks_total",
                "Rate-limit checks counted by this replica alone because the shared store failed",
            )?,
        })
    }
}

/// The store, and the session turns kept in it.
struct Persistence {
    store_errors: IntCounterVec,
    store_up: IntGauge,
    session_history: Histogram,
    session_turns: IntCounterVec,
}

impl Persistence {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let store_errors = counter_vec(
            registry,
            "visor_store_errors_total",
            "Store operations that failed or timed out, by operation (get, put, list, ping)",
            &["op"],
        )?;
        for op in ["get", "put", "list", "ping"] {
            store_errors.with_label_values(&[op]);
        }
        let session_turns = counter_vec(
            registry,
            "visor_session_turns_total",
            "Session turns stored, by result (with_reply, without_reply: an error, a cut stream or a client that left; failed: the store refused it)",
            &["result"],
        )?;
        for result in ["with_reply", "without_reply", "failed"] {
            session_turns.with_label_values(&[result]);
        }
        Ok(Self {
            store_errors,
            store_up: gauge(
                registry,
                "visor_store_up",
                "1 while the store answers, 0 while visor runs on memory only",
            )?,
            session_history: histogram(
                registry,
                HistogramOpts::new(
                    "visor_session_history_messages",
                    "Stored messages prepended to a request with x-visor-session",
                )
                .buckets(vec![0.0, 1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 500.0]),
            )?,
            session_turns,
        })
    }
}

fn counter_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntCounterVec, prometheus::Error> {
    let metric = IntCounterVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

fn counter(registry: &Registry, name: &str, help: &str) -> Result<IntCounter, prometheus::Error> {
    let metric = IntCounter::new(name, help)?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

fn gauge(registry: &Registry, name: &str, help: &str) -> Result<IntGauge, prometheus::Error> {
    let metric = IntGauge::new(name, help)?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

fn gauge_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntGaugeVec, prometheus::Error> {
    let metric = IntGaugeVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

fn histogram(registry: &Registry, opts: HistogramOpts) -> Result<Histogram, prometheus::Error> {
    let metric = Histogram::with_opts(opts)?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

fn histogram_vec(
    registry: &Registry,
    opts: HistogramOpts,
    labels: &[&str],
) -> Result<HistogramVec, prometheus::Error> {
    let metric = HistogramVec::new(opts, labels)?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_label_is_capped() {
        let m = Metrics::new().unwrap();
        for i in 0..MAX_MODEL_LABELS {
            assert_eq!(m.model_label(&format!("m{i}")), format!("m{i}"));
        }
        assert_eq!(m.model_label("one-too-many"), "other");
        assert_eq!(m.model_label("m7"), "m7");
    }

    #[test]
    fn render_names_every_metric() {
        let m = Metrics::new().unwrap();
        m.requests
            .with_label_values(&["u", "m", "200", "none"])
            .inc();
        m.request_duration.with_label_values(&["u"]).observe(0.1);
        m.first_byte.with_label_values(&["u"]).observe(0.1);
        m.upstream_error("u", "connect");
        m.tokens.with_label_values(&["prompt", "none"]).inc_by(3);
        let text = String::from_utf8(m.render()).unwrap();
        for name in [
            "visor_requests_total",
            "visor_request_duration_seconds",
            "visor_upstream_first_byte_seconds",
            "visor_inflight_requests",
            "visor_upstream_errors_total",
            "visor_tokens_total",
        ] {
            assert!(text.contains(name), "{name} missing");
        }
    }
}
