//! Spans on their way to the collector: a bounded queue the request path
//! pushes into without waiting (a full queue drops the span and counts it),
//! and one task that sends them in batches over OTLP/HTTP (protobuf).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use opentelemetry::Context;
use opentelemetry_http::{HttpClient, HttpError};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use prometheus::IntCounterVec;

/// Spans held for export at most; past it a span is dropped (counted).
pub const QUEUE: usize = 4096;

/// Bytes of span text held for export at most (with `capture_content` a
/// span may carry 128 KiB): past it a span is dropped (counted).
pub const QUEUE_BYTES: usize = 32 * 1024 * 1024;

/// Spans sent in one request to the collector, at most.
pub const BATCH: usize = 512;

/// Bytes of span text in one request to the collector, about at most
/// (well under the exporter's 64 MiB).
pub const BATCH_BYTES: usize = 4 * 1024 * 1024;

/// The longest a span waits for its batch.
pub const EVERY: Duration = Duration::from_secs(1);

/// One export's bound (the collector's answer included).
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// Ended spans waiting for the exporting task.
#[derive(Debug)]
pub struct Queue {
    /// The spans, each with its size as [`size`] estimates it.
    spans: Mutex<Held>,
    ready: tokio::sync::Notify,
    /// `visor_telemetry_spans_total{result}`.
    counted: IntCounterVec,
}

impl Queue {
    pub fn new(counted: IntCounterVec) -> Arc<Queue> {
        Arc::new(Queue {
            spans: Mutex::new(Held::default()),
            ready: tokio::sync::Notify::new(),
            counted,
        })
    }

    fn push(&self, span: SpanData) {
        let bytes = size(&span);
        let Ok(mut q) = self.spans.lock() else {
            return;
        };
        if q.spans.len() >= QUEUE || q.bytes + bytes > QUEUE_BYTES {
            drop(q);
            self.counted.with_label_values(&["dropped"]).inc();
            return;
        }
        q.bytes += bytes;
        q.spans.push_back((span, bytes));
        if q.spans.len() == BATCH || q.bytes >= BATCH_BYTES {
            self.ready.notify_one();
        }
    }

    /// The oldest spans: up to [`BATCH`] of them and about [`BATCH_BYTES`]
    /// (at least one); whether it was a full batch.
    fn take(&self) -> (Vec<SpanData>, bool) {
        let Ok(mut q) = self.spans.lock() else {
            return (Vec::new(), false);
        };
        let mut batch = Vec::new();
        let mut bytes = 0;
        while batch.len() < BATCH && (batch.is_empty() || bytes < BATCH_BYTES) {
            let Some((span, size)) = q.spans.pop_front() else {
                return (batch, false);
            };
            q.bytes -= size;
            bytes += size;
            batch.push(span);
        }
        (batch, true)
    }

    fn len(&self) -> usize {
        self.spans.lock().map_or(0, |q| q.spans.len())
    }
}

/// The queue's spans and their estimated bytes.
#[derive(Debug, Default)]
struct Held {
    spans: VecDeque<(SpanData, usize)>,
    bytes: usize,
}

/// About what a span takes to hold and send: its strings, and a little for
/// each attribute and the span itself.
fn size(span: &SpanData) -> usize {
    let attrs: usize = span
        .attributes
        .iter()
        .map(|kv| {
            let value = match &kv.value {
                opentelemetry::Value::String(s) => s.as_str().len(),
                opentelemetry::Value::Array(opentelemetry::Array::String(a)) => {
                    a.iter().map(|s| s.as_str().len() + 8).sum()
                }
                _ => 8,
            };
            kv.key.as_str().len() + value + 16
        })
        .sum();
    span.name.len() + attrs + 128
}

/// The tracer provider's processor: each ended span into the [`Queue`].
#[derive(Debug)]
pub struct Enqueue(pub Arc<Queue>);

impl SpanProcessor for Enqueue {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        self.0.push(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// Runs [`run`] on a thread of its own (encoding and sending never take a
/// serving thread); the receiver is told when it has ended.
pub fn thread<E: SpanExporter + 'static>(
    queue: Arc<Queue>,
    exporter: E,
    stop: tokio_util::sync::CancellationToken,
) -> std::io::Result<tokio::sync::oneshot::Receiver<()>> {
    let (done, ended) = tokio::sync::oneshot::channel();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("visor-traces".to_owned())
        .spawn(move || {
            runtime.block_on(run(queue, exporter, stop));
            let _ = done.send(());
        })?;
    Ok(ended)
}

/// Sends the queue's spans with `exporter` until `stop` is cancelled, then
/// what is left (within [`TIMEOUT`]).
pub async fn run<E: SpanExporter>(
    queue: Arc<Queue>,
    exporter: E,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        let stopping = tokio::select! {
            () = queue.ready.notified() => false,
            () = tokio::time::sleep(EVERY) => false,
            () = stop.cancelled() => true,
        };
        // A full batch goes at once; what remains waits for the next turn.
        loop {
            let (batch, full) = queue.take();
            if batch.is_empty() {
                break;
            }
            send(&queue, &exporter, batch).await;
            if !full && !stopping {
                break;
            }
        }
        if stopping {
            let _ = exporter.shutdown();
            return;
        }
    }
}

async fn send<E: SpanExporter>(queue: &Queue, exporter: &E, batch: Vec<SpanData>) {
    let n = batch.len() as u64;
    let result = match tokio::time::timeout(TIMEOUT, exporter.export(batch)).await {
        Ok(Ok(())) => "exported",
        Ok(Err(e)) => {
            tracing::warn!(error = %e, spans = n, "traces not exported");
            "failed"
        }
        Err(_) => {
            tracing::warn!(
                spans = n,
                "traces not exported: the collector did not answer in time"
            );
            "failed"
        }
    };
    queue.counted.with_label_values(&[result]).inc_by(n);
}

impl Queue {
    /// Whether spans wait (for tests and the shutdown's flush).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The HTTP client the exporter sends with: hyper over rustls (the one TLS
/// stack visor has), each call bounded by [`TIMEOUT`], the collector's
/// answer read up to 64 KiB.
#[derive(Clone)]
pub struct Client(
    pub  hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        Full<Bytes>,
    >,
);

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("telemetry::Client")
    }
}

#[async_trait::async_trait]
impl HttpClient for Client {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let req = http::Request::from_parts(parts, Full::new(body));
        let call = async {
            let resp = self.0.request(req).await?;
            let (parts, body) = resp.into_parts();
            let body = Limited::new(body, 64 * 1024).collect().await?.to_bytes();
            Ok::<_, HttpError>(http::Response::from_parts(parts, body))
        };
        tokio::time::timeout(TIMEOUT, call)
            .await
            .map_err(|_| HttpError::from("the collector did not answer in time"))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanKind, Status, TraceFlags, TraceState};
    use opentelemetry::{InstrumentationScope, SpanId, TraceId};
    use std::time::SystemTime;

    fn span(i: u64) -> SpanData {
        SpanData {
            span_context: SpanContext::new(
                TraceId::from(u128::from(i) + 1),
                SpanId::from(i + 1),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ),
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Server,
            name: "POST /v1/chat/completions".into(),
            start_time: SystemTime::now(),
            end_time: SystemTime::now(),
            attributes: Vec::new(),
            dropped_attributes_count: 0,
            events: Default::default(),
            links: Default::default(),
            status: Status::Unset,
            instrumentation_scope: InstrumentationScope::builder("visor").build(),
        }
    }

    fn counted() -> IntCounterVec {
        IntCounterVec::new(prometheus::Opts::new("t", "t"), &["result"]).unwrap()
    }

    #[test]
    fn a_full_queue_drops_and_counts_and_batches_are_bounded() {
        let q = Queue::new(counted());
        for i in 0..(QUEUE as u64 + 3) {
            q.push(span(i));
        }
        assert_eq!(q.counted.with_label_values(&["dropped"]).get(), 3);
        let (first, full) = q.take();
        assert!(full);
        assert_eq!(first.len(), BATCH);
        // Oldest first: the spans kept are the first QUEUE pushed.
        assert_eq!(first[0].span_context.span_id(), SpanId::from(1));
        let mut left = QUEUE - BATCH;
        while left > 0 {
            let (b, _) = q.take();
            assert_eq!(b.len(), left.min(BATCH));
            left -= b.len();
        }
        assert!(q.is_empty());
    }

    #[test]
    fn large_spans_are_bounded_by_bytes_in_the_queue_and_in_a_batch() {
        let q = Queue::new(counted());
        let big = |i| {
            let mut s = span(i);
            s.attributes.push(opentelemetry::KeyValue::new(
                "gen_ai.input.messages",
                "x".repeat(128 * 1024),
            ));
            s
        };
        let fits = QUEUE_BYTES / (128 * 1024 + 200);
        for i in 0..(fits as u64 + 5) {
            q.push(big(i));
        }
        assert!(q.counted.with_label_values(&["dropped"]).get() >= 5);
        let (batch, _) = q.take();
        // About 4 MiB of them, not 512.
        assert!((30..=33).contains(&batch.len()), "{}", batch.len());
    }
}
