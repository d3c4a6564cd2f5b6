//! What a traced request's span says, phase by phase: where it was routed,
//! whose key it came with, what visor changed, and how it ended. Only
//! called when the request is traced (`[telemetry]`).

use opentelemetry::KeyValue;

use crate::api::usage::{Said, Usage};
use crate::config::Upstream;
use crate::telemetry::{AttemptSpan, Ended, Trace, genai};
use crate::transform::{Report, Shape};

/// What an upstream attempt's span names, fixed once the request is
/// routed.
#[derive(Clone)]
pub struct Target {
    pub trace: Trace,
    pub operation: &'static str,
    pub provider: &'static str,
    pub model: String,
}

impl Target {
    /// The request routed to `upstream` (`rest`: its path after `/v1`).
    pub fn routed(
        trace: &Trace,
        upstream: &Upstream,
        rest: &str,
        shape: Option<Shape>,
        model: Option<&str>,
    ) -> Target {
        let operation = genai::operation(rest);
        let provider = genai::provider(
            upstream.base_url.host().unwrap_or_default(),
            shape == Some(Shape::Messages) || upstream.auth == crate::config::AuthMode::XApiKey,
        );
        let model = model.unwrap_or_default().to_owned();
        let mut attrs = vec![
            KeyValue::new("gen_ai.operation.name", operation),
            KeyValue::new("gen_ai.provider.name", provider),
            KeyValue::new("visor.upstream", upstream.name.clone()),
        ];
        if !model.is_empty() {
            attrs.push(KeyValue::new("gen_ai.request.model", model.clone()));
        }
        if let Some(host) = upstream.base_url.host() {
            attrs.push(KeyValue::new("server.address", host.to_owned()));
        }
        let port = (upstream.base_url.port_u16()).or(match upstream.base_url.scheme_str() {
            Some("http") => Some(80),
            _ => Some(443),
        });
        if let Some(p) = port {
            attrs.push(KeyValue::new("server.port", i64::from(p)));
        }
        trace.set(attrs);
        Target {
            trace: trace.clone(),
            operation,
            provider,
            model,
        }
    }

    /// An attempt at `upstream` (a fallback's name differs from the routed
    /// one's), its `traceparent` written into `headers`.
    pub fn attempt(
        &self,
        upstream: &str,
        method: &http::Method,
        uri: &http::Uri,
        headers: &mut http::HeaderMap,
    ) -> AttemptSpan {
        self.trace.attempt(
            &crate::telemetry::Attempt {
                method,
                operation: self.operation,
                provider: self.provider,
                model: &self.model,
                upstream,
                uri,
            },
            headers,
        )
    }
}

/// The key the request came with.
pub fn key(trace: &Trace, name: &str) {
    trace.set([KeyValue::new("visor.key", name.to_owned())]);
}

/// What visor changed, and (with `capture_content`) the body sent.
pub fn changes(trace: &Trace, report: &Report, sent: &[u8]) {
    trace.set([
        KeyValue::new("visor.images.replaced", report.images_replaced as i64),
        KeyValue::new("visor.images.resized", report.images_resized as i64),
        KeyValue::new("visor.media.replaced", report.media_replaced as i64),
        KeyValue::new("visor.bytes_saved", report.bytes_saved),
        KeyValue::new("visor.dedup.lines_omitted", report.lines_omitted as i64),
        KeyValue::new("visor.dedup.items_omitted", report.items_omitted as i64),
        KeyValue::new("visor.history.messages", report.history_used as i64),
        KeyValue::new("visor.cache.breakpoints", report.breakpoints as i64),
    ]);
    trace.input(sent);
}

/// The request's end, as its response body ended.
pub struct End<'a> {
    pub trace: Trace,
    pub attempt: Option<AttemptSpan>,
    pub status: u16,
    pub outcome: &'a str,
    pub failed: Option<&'a str>,
    /// The usage, when the provider said it.
    pub usage: Option<Usage>,
    pub shape: Option<Shape>,
    pub said: Option<Said>,
    pub cache_readable: Option<u64>,
    pub cache_miss: Option<&'a str>,
}

impl End<'_> {
    pub fn end(self) {
        let mut attrs = Vec::new();
        if let Some(r) = self.cache_readable {
            attrs.push(KeyValue::new("visor.cache.readable", r as i64));
        }
        if let Some(m) = self.cache_miss {
            attrs.push(KeyValue::new("visor.cache.miss", m.to_owned()));
        }
        self.trace.set(attrs);
        let said = self.said.unwrap_or_default();
        self.trace.end(
            self.attempt,
            &Ended {
                status: self.status,
                outcome: self.outcome,
                error: self.failed,
                usage: self.usage,
                cache_apart: self.shape == Some(Shape::Messages),
                response_model: said.model.as_deref(),
                finish_reasons: &said.finish_reasons,
                output: said.content.as_deref(),
            },
        );
    }
}
