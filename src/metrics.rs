//! Every metric, registered once, and the `/metrics` text.
//!
//! Names follow `visor_<noun>_<unit>`; labels are bounded: upstream names come
//! from the config, `model` is capped at [`MAX_MODEL_LABELS`] distinct values
//! per process (`other` after that), status and error kinds are fixed sets.

use std::collections::HashSet;
use std::sync::Mutex;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
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
                "Tokens reported by upstreams in `usage`, by kind (prompt, completion)",
            ),
            &["kind"],
        )?;
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
