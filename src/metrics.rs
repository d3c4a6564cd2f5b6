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
    pub context_received: IntCounterVec,
    pub context_long: IntCounterVec,
    pub bytes_saved: IntCounterVec,
    pub capability_learned: IntCounter,
    pub transform_duration: Histogram,
    pub artifact_errors: IntCounter,
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
        let requests = IntCounterVec::new(
            Opts::new(
                "visor_requests_total",
                "Requests answered, by upstream, model as requested, and status",
            ),
            &["upstream", "model", "status"],
        )?;
        let request_duration = HistogramVec::new(
            HistogramOpts::new(
                "visor_request_duration_seconds",
                "Time from the request's arrival to the end of its response body",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["upstream"],
        )?;
        let first_byte = HistogramVec::new(
            HistogramOpts::new(
                "visor_upstream_first_byte_seconds",
                "Time from sending the request upstream to the first byte of the response body",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["upstream"],
        )?;
        let inflight = IntGauge::new(
            "visor_inflight_requests",
            "Requests whose response has not finished yet",
        )?;
        let upstream_errors = IntCounterVec::new(
            Opts::new(
                "visor_upstream_errors_total",
                "Upstream failures by kind: connect, connect_timeout, first_byte_timeout, idle_timeout, request_timeout, reset, status_5xx",
            ),
            &["upstream", "kind"],
        )?;
        let tokens = IntCounterVec::new(
            Opts::new(
                "visor_tokens_total",
                "Tokens reported by upstreams in `usage`, by kind (prompt, completion; cached_read and cache_write: the provider's prompt cache)",
            ),
            &["kind"],
        )?;
        let images = IntCounterVec::new(
            Opts::new(
                "visor_images_total",
                "Images seen in transformed requests, by what was done: kept, described, stripped, aged_out, capped, deduped",
            ),
            &["action"],
        )?;
        let media = IntCounterVec::new(
            Opts::new(
                "visor_media_total",
                "Documents and audio replaced for models that cannot take them, by kind (document, audio) and what was done: described (a document turned into text, with descriptions of its figures), transcribed, stripped (a reference or a line that says why), deduped",
            ),
            &["kind", "action"],
        )?;
        let ratelimited = IntCounterVec::new(
            Opts::new(
                "visor_ratelimited_total",
                "Requests answered 429 for a key over its limit, by key name and limit (requests, tokens)",
            ),
            &["key", "limit"],
        )?;
        let ratelimit_shared = IntGauge::new(
            "visor_ratelimit_shared",
            "1 while rate limits are counted in the shared (Redis) store, 0 while each replica counts on its own because the store cannot be reached",
        )?;
        let ratelimit_local_checks = IntCounter::new(
            "visor_ratelimit_local_checks_total",
            "Rate-limit checks counted by this replica alone because the shared store failed",
        )?;
        let context_resent = IntCounterVec::new(
            Opts::new(
                "visor_context_resent_bytes_total",
                "Request bytes dedup removed (context the client sent again), by key name",
            ),
            &["key"],
        )?;
        let context_received = IntCounterVec::new(
            Opts::new(
                "visor_context_received_bytes_total",
                "Request body bytes received on the transformed endpoints, by key name",
            ),
            &["key"],
        )?;
        let context_long = IntCounterVec::new(
            Opts::new(
                "visor_context_long_requests_total",
                "Requests whose history holds more messages than sessions.max_depth, by key name",
            ),
            &["key"],
        )?;
        let bytes_saved = IntCounterVec::new(
            Opts::new(
                "visor_bytes_saved_total",
                "Request bytes removed by the transforms, by reason (images, dedup)",
            ),
            &["reason"],
        )?;
        let capability_learned = IntCounter::new(
            "visor_capability_learned_total",
            "Models learned to refuse image input from an upstream's 4xx answer",
        )?;
        let transform_duration = Histogram::with_opts(
            HistogramOpts::new(
                "visor_transform_duration_seconds",
                "Time spent rewriting a request body (finding, decoding, hashing and replacing images)",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
            ]),
        )?;
        let artifact_errors = IntCounter::new(
            "visor_artifact_write_errors_total",
            "Replaced images that could not be saved under artifacts_dir (the request still went on)",
        )?;
        let describe = IntCounterVec::new(
            Opts::new(
                "visor_describe_total",
                "Image descriptions looked up, by result: hit (cached), miss (made by a describer call), error (describer failed or timed out; the placeholder was used)",
            ),
            &["result"],
        )?;
        let credential_refused = IntCounterVec::new(
            Opts::new(
                "visor_credential_refused_total",
                "Describer and transcriber calls their upstream refused with 401 or 403 (a missing or wrong credential), by role and upstream",
            ),
            &["role", "upstream"],
        )?;
        let describe_duration = Histogram::with_opts(
            HistogramOpts::new(
                "visor_describe_duration_seconds",
                "Time of one describer call, from sending it to the whole answer (failed calls too)",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
        )?;
        let describe_cache_entries = IntGauge::new(
            "visor_describe_cache_entries",
            "Descriptions held in the in-memory cache",
        )?;
        let describe_background = IntGauge::new(
            "visor_describe_background",
            "Descriptions being made in the background (describer.on_miss = \"placeholder\")",
        )?;
        let store_errors = IntCounterVec::new(
            Opts::new(
                "visor_store_errors_total",
                "Store operations that failed or timed out, by operation (get, put, list, ping)",
            ),
            &["op"],
        )?;
        let connections = IntGauge::new(
            "visor_client_connections",
            "Client connections open (server.max_connections at most)",
        )?;
        let connections_closed = IntCounterVec::new(
            Opts::new(
                "visor_client_connections_closed_total",
                "Client connections visor closed itself, by reason (header_timeout: no request head in time; idle: no request in time after the last one; shed: idle, closed to make room at max_connections)",
            ),
            &["reason"],
        )?;
        let store_up = IntGauge::new(
            "visor_store_up",
            "1 while the store answers, 0 while visor runs on memory only",
        )?;
        let session_history = Histogram::with_opts(
            HistogramOpts::new(
                "visor_session_history_messages",
                "Stored messages prepended to a request with x-visor-session",
            )
            .buckets(vec![0.0, 1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 500.0]),
        )?;
        let session_turns = IntCounterVec::new(
            Opts::new(
                "visor_session_turns_total",
                "Session turns stored, by result (with_reply, without_reply: an error, a cut stream or a client that left; failed: the store refused it)",
            ),
            &["result"],
        )?;
        let retries = IntCounterVec::new(
            Opts::new(
                "visor_retries_total",
                "Requests sent on to an upstream's fallback, by the upstream that failed and why (connect, connect_timeout, reset, first_byte_timeout, status_5xx, status_429)",
            ),
            &["upstream", "reason"],
        )?;
        let upstream_state = IntGaugeVec::new(
            Opts::new(
                "visor_upstream_state",
                "Circuit breaker of each upstream in a fallback chain: 0 closed, 1 open (skipped), 2 half-open (one probe out)",
            ),
            &["upstream"],
        )?;
        registry.register(Box::new(retries.clone()))?;
        registry.register(Box::new(upstream_state.clone()))?;
        registry.register(Box::new(session_history.clone()))?;
        registry.register(Box::new(session_turns.clone()))?;
        for result in ["with_reply", "without_reply", "failed"] {
            session_turns.with_label_values(&[result]);
        }
        registry.register(Box::new(describe.clone()))?;
        registry.register(Box::new(credential_refused.clone()))?;
        registry.register(Box::new(describe_duration.clone()))?;
        registry.register(Box::new(describe_cache_entries.clone()))?;
        registry.register(Box::new(describe_background.clone()))?;
        registry.register(Box::new(store_errors.clone()))?;
        registry.register(Box::new(store_up.clone()))?;
        registry.register(Box::new(connections.clone()))?;
        registry.register(Box::new(connections_closed.clone()))?;
        for result in ["hit", "miss", "error"] {
            describe.with_label_values(&[result]);
        }
        for op in ["get", "put", "list", "ping"] {
            store_errors.with_label_values(&[op]);
        }
        registry.register(Box::new(images.clone()))?;
        registry.register(Box::new(media.clone()))?;
        registry.register(Box::new(ratelimited.clone()))?;
        registry.register(Box::new(ratelimit_shared.clone()))?;
        registry.register(Box::new(ratelimit_local_checks.clone()))?;
        registry.register(Box::new(context_resent.clone()))?;
        registry.register(Box::new(context_received.clone()))?;
        registry.register(Box::new(context_long.clone()))?;
        ratelimit_shared.set(1);
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
        registry.register(Box::new(bytes_saved.clone()))?;
        registry.register(Box::new(capability_learned.clone()))?;
        registry.register(Box::new(transform_duration.clone()))?;
        registry.register(Box::new(artifact_errors.clone()))?;
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
        for reason in ["images", "dedup"] {
            bytes_saved.with_label_values(&[reason]);
        }
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(request_duration.clone()))?;
        registry.register(Box::new(first_byte.clone()))?;
        registry.register(Box::new(inflight.clone()))?;
        registry.register(Box::new(upstream_errors.clone()))?;
        registry.register(Box::new(tokens.clone()))?;
        Ok(Self {
            registry,
            requests,
            request_duration,
            first_byte,
            inflight,
            upstream_errors,
            tokens,
            images,
            media,
            ratelimited,
            ratelimit_shared,
            ratelimit_local_checks,
            context_resent,
            context_received,
            context_long,
            bytes_saved,
            capability_learned,
            transform_duration,
            artifact_errors,
            describe,
            credential_refused,
            describe_duration,
            describe_cache_entries,
            describe_background,
            store_errors,
            store_up,
            session_history,
            session_turns,
            connections,
            connections_closed,
            retries,
            upstream_state,
            models_seen: Mutex::new(HashSet::new()),
        })
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
        m.requests.with_label_values(&["u", "m", "200"]).inc();
        m.request_duration.with_label_values(&["u"]).observe(0.1);
        m.first_byte.with_label_values(&["u"]).observe(0.1);
        m.upstream_error("u", "connect");
        m.tokens.with_label_values(&["prompt"]).inc_by(3);
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
