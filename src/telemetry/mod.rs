//! OpenTelemetry traces: one span per request (server kind, named like
//! `POST /v1/chat/completions`) with the GenAI semantic conventions and
//! visor's own attributes, a child span for each upstream attempt (client
//! kind, `chat gpt-4o`), and child spans for the describer, transcriber and
//! document reader. The client's `traceparent` is continued, and each
//! attempt's is sent upstream. Spans go out over OTLP/HTTP in batches from
//! a bounded queue ([`export`]): a slow or absent collector drops spans
//! (counted), it never slows a request. Off (no tracer, nothing on the
//! request path) unless `[telemetry] otlp_endpoint` is set.
//!
//! Parts below the proxy open their child spans with [`child`], which
//! finds the request's span in the current OpenTelemetry [`Context`] (the
//! proxy runs each request's future within it): no part is handed the
//! telemetry, and with tracing off `child` finds nothing.

pub mod export;
pub mod genai;

use std::borrow::Cow;
use std::sync::Arc;

use opentelemetry::propagation::TextMapPropagator as _;
use opentelemetry::trace::{
    SpanKind, Status, TraceContextExt as _, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Array, Context, KeyValue, StringValue, Value};
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, SpanExporter as _};

use crate::config::Telemetry as Config;

pub use opentelemetry::context::FutureExt;

/// Content exported with `capture_content = true` is cut to this many
/// bytes per attribute.
pub const CONTENT_MAX: usize = 64 * 1024;

/// The tracer and where its spans go.
pub struct Telemetry {
    tracer: SdkTracer,
    /// Kept so the tracer stays live.
    _provider: SdkTracerProvider,
    propagator: TraceContextPropagator,
    pub capture_content: bool,
    queue: Arc<export::Queue>,
    stop: tokio_util::sync::CancellationToken,
    /// Said when the exporting thread has sent what was left and ended.
    exporting: std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry").finish_non_exhaustive()
    }
}

/// The tracer, as a request's [`Context`] carries it for [`child`].
#[derive(Clone)]
struct Carried(SdkTracer);

impl Telemetry {
    /// The tracer and its exporting task (on the current Tokio runtime);
    /// `None` without an endpoint, or when the exporter cannot be built
    /// (said in the log: traces are never worth failing to start for).
    pub fn start(
        config: &Config,
        client: export::Client,
        counted: prometheus::IntCounterVec,
    ) -> Option<Arc<Telemetry>> {
        let url = config.traces_url.as_ref()?;
        use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
        // No retries: a failed batch is counted and dropped (the exporter's
        // retries would wait between tries, and spans are not worth it).
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_retry_policy(opentelemetry_otlp::RetryPolicy::disabled())
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(url.to_string())
            .with_timeout(export::TIMEOUT)
            .build();
        let mut exporter = match exporter {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(error = %e, "traces are off: the OTLP exporter could not be built");
                return None;
            }
        };
        let resource = Resource::builder_empty()
            .with_service_name(config.service_name.clone())
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .build();
        exporter.set_resource(&resource);
        let queue = export::Queue::new(counted);
        let provider = SdkTracerProvider::builder()
            .with_resource(resource)
            .with_span_processor(export::Enqueue(queue.clone()))
            .build();
        let stop = tokio_util::sync::CancellationToken::new();
        let exporting = match export::thread(queue.clone(), exporter, stop.clone()) {
            Ok(done) => done,
            Err(e) => {
                tracing::warn!(error = %e, "traces are off: the exporting thread did not start");
                return None;
            }
        };
        Some(Arc::new(Telemetry {
            tracer: provider.tracer("visor"),
            _provider: provider,
            propagator: TraceContextPropagator::new(),
            capture_content: config.capture_content,
            queue,
            stop,
            exporting: std::sync::Mutex::new(Some(exporting)),
        }))
    }

    /// A request's trace: its span, continuing the client's `traceparent`
    /// (a new trace without one).
    pub fn request(
        self: &Arc<Self>,
        method: &http::Method,
        path: &str,
        headers: &http::HeaderMap,
    ) -> Trace {
        let parent = self.propagator.extract(&HeaderExtractor(headers));
        let (method, route) = (genai::method(method), genai::route(path));
        let span = self
            .tracer
            .span_builder(format!("{method} {route}"))
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("http.request.method", method),
                KeyValue::new("http.route", route),
                KeyValue::new("url.path", path.to_owned()),
            ])
            .start_with_context(&self.tracer, &parent);
        let cx = parent
            .with_span(span)
            .with_value(Carried(self.tracer.clone()));
        Trace {
            telemetry: self.clone(),
            cx,
        }
    }

    /// Sends what is queued and stops exporting (at shutdown), within
    /// `bound`.
    pub async fn flush(&self, bound: std::time::Duration) {
        self.stop.cancel();
        let done = self.exporting.lock().ok().and_then(|mut t| t.take());
        if let Some(done) = done {
            let _ = tokio::time::timeout(bound, done).await;
        }
    }

    /// Spans waiting to be exported.
    pub fn queued(&self) -> bool {
        !self.queue.is_empty()
    }
}

/// One request's trace: its span in a [`Context`] (cheap to clone; the
/// span ends with [`Trace::end`], or when the last clone is dropped).
#[derive(Clone)]
pub struct Trace {
    telemetry: Arc<Telemetry>,
    cx: Context,
}

/// What an upstream attempt is.
pub struct Attempt<'a> {
    pub method: &'a http::Method,
    pub operation: &'static str,
    pub provider: &'static str,
    pub model: &'a str,
    pub upstream: &'a str,
    pub uri: &'a http::Uri,
}

/// How a request ended, for its span.
#[derive(Default)]
pub struct Ended<'a> {
    pub status: u16,
    /// `complete`, `client_cancelled`, `upstream_reset`…
    pub outcome: &'a str,
    /// An error's kind (`error.type`), when it failed.
    pub error: Option<&'a str>,
    pub usage: Option<crate::api::usage::Usage>,
    /// Whether the usage is Anthropic's (cache tokens apart from input).
    pub cache_apart: bool,
    pub response_model: Option<&'a str>,
    pub finish_reasons: &'a [String],
    /// The response's content, with `capture_content`.
    pub output: Option<&'a [u8]>,
}

impl Trace {
    /// The context the request's work runs in (child spans find it).
    pub fn context(&self) -> Context {
        self.cx.clone()
    }

    /// The trace's id (32 hex digits), for log lines.
    pub fn trace_id(&self) -> String {
        self.cx.span().span_context().trace_id().to_string()
    }

    /// Whether message contents may be exported.
    pub fn captures_content(&self) -> bool {
        self.telemetry.capture_content
    }

    /// Sets attributes on the request's span.
    pub fn set(&self, attributes: impl IntoIterator<Item = KeyValue>) {
        self.cx.span().set_attributes(attributes);
    }

    /// The request's content (the body sent upstream), with
    /// `capture_content`.
    pub fn input(&self, body: &[u8]) {
        if self.telemetry.capture_content {
            self.set([KeyValue::new("gen_ai.input.messages", content(body))]);
        }
    }

    /// Writes the request span's `traceparent` into `headers` (replacing
    /// the client's): a WebSocket upgrade's, which has no attempt span.
    pub fn inject(&self, headers: &mut http::HeaderMap) {
        headers.remove("traceparent");
        headers.remove("tracestate");
        self.telemetry
            .propagator
            .inject_context(&self.cx, &mut HeaderInjector(headers));
    }

    /// Starts an upstream attempt: a client span under the request's,
    /// whose `traceparent` replaces the client's in `headers`.
    pub fn attempt(&self, a: &Attempt<'_>, headers: &mut http::HeaderMap) -> AttemptSpan {
        let tracer = &self.telemetry.tracer;
        let mut attrs = vec![
            KeyValue::new("gen_ai.operation.name", a.operation),
            KeyValue::new("gen_ai.provider.name", a.provider),
            KeyValue::new("visor.upstream", a.upstream.to_owned()),
            KeyValue::new("http.request.method", genai::method(a.method)),
        ];
        if !a.model.is_empty() {
            attrs.push(KeyValue::new("gen_ai.request.model", a.model.to_owned()));
        }
        if let Some(host) = a.uri.host() {
            attrs.push(KeyValue::new("server.address", host.to_owned()));
        }
        let port = a.uri.port_u16().or(match a.uri.scheme_str() {
            Some("https") => Some(443),
            Some("http") => Some(80),
            _ => None,
        });
        if let Some(p) = port {
            attrs.push(KeyValue::new("server.port", i64::from(p)));
        }
        let name = match a.model {
            "" => a.operation.to_owned(),
            m => format!("{} {m}", a.operation),
        };
        let span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Client)
            .with_attributes(attrs)
            .start_with_context(tracer, &self.cx);
        let cx = self.cx.with_span(span);
        headers.remove("traceparent");
        headers.remove("tracestate");
        self.telemetry
            .propagator
            .inject_context(&cx, &mut HeaderInjector(headers));
        AttemptSpan { cx, failed: false }
    }

    /// The response's status, as its head goes back (a span that ends
    /// without [`Trace::end`] keeps it).
    pub fn head(&self, status: u16) {
        self.cx.span().set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
    }

    /// Ends the request's span as visor answered it itself (a refusal, an
    /// upstream that could not be reached).
    pub fn answered(&self, status: u16, code: &str) {
        let span = self.cx.span();
        span.set_attributes([
            KeyValue::new("http.response.status_code", i64::from(status)),
            KeyValue::new("error.type", code.to_owned()),
            KeyValue::new("visor.outcome", "answered by visor"),
        ]);
        span.set_status(Status::error(code.to_owned()));
        span.end();
    }

    /// Ends the request's span (and `attempt`'s) with how it ended.
    pub fn end(&self, attempt: Option<AttemptSpan>, e: &Ended<'_>) {
        // (`http.response.status_code` was set with the response's head.)
        let mut attrs = vec![KeyValue::new("visor.outcome", e.outcome.to_owned())];
        if let Some(m) = e.response_model {
            attrs.push(KeyValue::new("gen_ai.response.model", m.to_owned()));
        }
        if !e.finish_reasons.is_empty() {
            attrs.push(KeyValue::new(
                "gen_ai.response.finish_reasons",
                Value::Array(Array::String(
                    e.finish_reasons
                        .iter()
                        .map(|r| StringValue::from(r.clone()))
                        .collect(),
                )),
            ));
        }
        if let Some(u) = e.usage {
            attrs.extend(usage_attributes(&u, e.cache_apart));
        }
        // A failure: how the body failed, else the provider's 5xx status.
        let error = e
            .error
            .map(str::to_owned)
            .or_else(|| (e.status >= 500).then(|| e.status.to_string()));
        if let Some(a) = attempt {
            let span = a.cx.span();
            // The attempt's own: what came back from the provider (the
            // content is on the request's span only).
            span.set_attributes(
                attrs
                    .iter()
                    .filter(|kv| !kv.key.as_str().starts_with("visor."))
                    .cloned(),
            );
            if let (Some(err), false) = (&error, a.failed) {
                span.set_attribute(KeyValue::new("error.type", err.clone()));
                span.set_status(Status::error(err.clone()));
            }
            span.end();
        }
        if let (Some(out), true) = (e.output, self.telemetry.capture_content) {
            attrs.push(KeyValue::new("gen_ai.output.messages", content(out)));
        }
        let span = self.cx.span();
        if let Some(err) = error {
            attrs.push(KeyValue::new("error.type", err.clone()));
            span.set_status(Status::error(err));
        }
        span.set_attributes(attrs);
        span.end();
    }
}

/// An upstream attempt's span (ends when dropped, or with the request).
pub struct AttemptSpan {
    cx: Context,
    /// Marked failed already (by its response head).
    failed: bool,
}

impl AttemptSpan {
    /// The provider answered with `status` (a 5xx or 429 marks the
    /// attempt failed: a fallback may follow).
    pub fn head(&mut self, status: u16) {
        let span = self.cx.span();
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        if status >= 500 || status == 429 {
            self.failed = true;
            span.set_attribute(KeyValue::new("error.type", status.to_string()));
            span.set_status(Status::error(format!("the upstream answered {status}")));
        }
    }

    /// The attempt failed before a response head (`kind`: connect,
    /// timeout, reset…).
    pub fn failed(self, kind: &str) {
        let span = self.cx.span();
        span.set_attribute(KeyValue::new("error.type", kind.to_owned()));
        span.set_status(Status::error(kind.to_owned()));
        span.end();
    }
}

/// The GenAI usage attributes; `cache_apart`: the provider counts cached
/// tokens apart from its input tokens (Anthropic), so they are added in
/// (the conventions count them within `gen_ai.usage.input_tokens`).
pub fn usage_attributes(u: &crate::api::usage::Usage, cache_apart: bool) -> Vec<KeyValue> {
    let input = match cache_apart {
        true => u
            .prompt
            .saturating_add(u.cached_read)
            .saturating_add(u.cache_write),
        false => u.prompt,
    };
    let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    let mut attrs = vec![
        KeyValue::new("gen_ai.usage.input_tokens", int(input)),
        KeyValue::new("gen_ai.usage.output_tokens", int(u.completion)),
    ];
    if u.cache_said {
        attrs.push(KeyValue::new(
            "gen_ai.usage.cache_read.input_tokens",
            int(u.cached_read),
        ));
        attrs.push(KeyValue::new(
            "gen_ai.usage.cache_creation.input_tokens",
            int(u.cache_write),
        ));
    }
    attrs
}

/// `bytes` as an attribute's text, cut at [`CONTENT_MAX`].
fn content(bytes: &[u8]) -> String {
    let cut = &bytes[..bytes.len().min(CONTENT_MAX)];
    let mut s = String::from_utf8_lossy(cut).into_owned();
    if bytes.len() > CONTENT_MAX {
        s.push_str("…[cut]");
    }
    s
}

/// A child span of the request running now (the describer, transcriber or
/// document reader): `None` when the request is not traced.
pub fn child(name: impl Into<Cow<'static, str>>, attributes: Vec<KeyValue>) -> Option<Child> {
    let cx = Context::current();
    let tracer = cx.get::<Carried>()?.0.clone();
    if !cx.has_active_span() {
        return None;
    }
    let span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Internal)
        .with_attributes(attributes)
        .start_with_context(&tracer, &cx);
    Some(Child(cx.with_span(span)))
}

/// A child span: ends when dropped.
pub struct Child(Context);

impl Child {
    pub fn set(&self, attributes: impl IntoIterator<Item = KeyValue>) {
        self.0.span().set_attributes(attributes);
    }

    /// Marks it failed, with why.
    pub fn failed(&self, why: &str) {
        let span = self.0.span();
        span.set_attribute(KeyValue::new("error.type", why.to_owned()));
        span.set_status(Status::error(why.to_owned()));
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.0.span().end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(attrs: &[KeyValue], key: &str) -> Option<i64> {
        attrs
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| match &kv.value {
                Value::I64(i) => *i,
                other => panic!("{key}: {other:?}"),
            })
    }

    #[test]
    fn input_tokens_count_the_cache_as_the_conventions_do() {
        let u = crate::api::usage::Usage {
            prompt: 10,
            completion: 5,
            cached_read: 1000,
            cache_write: 200,
            cache_said: true,
            ..Default::default()
        };
        // Anthropic counts cache reads and writes apart from input_tokens.
        let a = usage_attributes(&u, true);
        assert_eq!(get(&a, "gen_ai.usage.input_tokens"), Some(1210));
        assert_eq!(get(&a, "gen_ai.usage.cache_read.input_tokens"), Some(1000));
        assert_eq!(
            get(&a, "gen_ai.usage.cache_creation.input_tokens"),
            Some(200)
        );
        // OpenAI's prompt_tokens already hold the cached ones.
        let o = usage_attributes(&u, false);
        assert_eq!(get(&o, "gen_ai.usage.input_tokens"), Some(10));
        assert_eq!(get(&o, "gen_ai.usage.output_tokens"), Some(5));
        // No cache figure said: none made up.
        let quiet = crate::api::usage::Usage {
            cache_said: false,
            ..u
        };
        assert_eq!(
            get(
                &usage_attributes(&quiet, false),
                "gen_ai.usage.cache_read.input_tokens"
            ),
            None
        );
    }

    #[test]
    fn content_is_cut_at_its_bound() {
        let long = vec![b'a'; CONTENT_MAX + 10];
        let c = content(&long);
        assert!(c.ends_with("…[cut]"));
        assert_eq!(c.len(), CONTENT_MAX + "…[cut]".len());
        assert_eq!(content(b"{}"), "{}");
    }
}
