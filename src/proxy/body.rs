//! Response bodies: visor's own answers, and upstream bodies passed through
//! one observing wrapper.
//!
//! [`ObservedBody`] forwards each upstream frame the moment it arrives (no
//! re-framing, `[DONE]` untouched) and on the side: stamps the first byte,
//! reads `usage`, enforces the idle-gap and total deadlines, and reports one
//! [`Outcome`] — at end of stream, on an upstream error, or on drop when the
//! client went away. Dropping it drops the upstream body, which closes (HTTP/1)
//! or resets (HTTP/2) the upstream request: a disconnecting client cancels it.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use tokio::time::{Instant, Sleep};

use crate::api::usage::UsageObserver;
use crate::failure::UpstreamFailure;
use crate::metrics::Metrics;
use crate::prompt_cache::Answered;
use crate::proxy::coalesce::Coalesced;
use crate::proxy::session_turn::{Recorder, Storing};
use crate::upstream::{BoxError, ResponseBody};
use tokio_util::task::TaskTracker;

/// Every response visor writes.
pub enum ProxyBody {
    Full(Full<Bytes>),
    Upstream(Box<ObservedBody>),
    /// Chunks made by a task of visor's own (the inspector's events).
    Events(tokio::sync::mpsc::Receiver<Bytes>),
}

impl From<Bytes> for ProxyBody {
    fn from(b: Bytes) -> Self {
        ProxyBody::Full(Full::new(b))
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ProxyBody::Full(f) => Pin::new(f).poll_frame(cx).map_err(|e| match e {}),
            ProxyBody::Upstream(o) => Pin::new(o.as_mut()).poll_frame(cx),
            ProxyBody::Events(rx) => rx.poll_recv(cx).map(|c| c.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(f) => f.is_end_stream(),
            ProxyBody::Upstream(o) => o.inner.is_end_stream(),
            ProxyBody::Events(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(f) => f.size_hint(),
            ProxyBody::Upstream(o) => o.inner.size_hint(),
            ProxyBody::Events(_) => SizeHint::default(),
        }
    }
}

/// How a response body ended. Reported once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Complete,
    /// The upstream broke the stream or went quiet; the client's stream is
    /// cut (HTTP/1.1: no final chunk; HTTP/2: reset).
    UpstreamError(UpstreamFailure),
    ClientCancelled,
    /// The session turn could not be stored: the response is cut before
    /// its last bytes (counted in `visor_session_turns_total{result="failed"}`).
    SessionNotStored,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Complete => "complete",
            Outcome::UpstreamError(kind) => kind.label(),
            Outcome::ClientCancelled => "client_cancelled",
            Outcome::SessionNotStored => "session_not_stored",
        }
    }
}

/// Decrements `visor_inflight_requests` when dropped.
pub struct InflightGuard(Arc<Metrics>);

impl InflightGuard {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        metrics.inflight.inc();
        Self(metrics)
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.dec();
    }
}

/// Charges a key for what a response used: (prompt tokens when the
/// provider said them, completion tokens).
pub type Charge = Box<dyn FnOnce(Option<u64>, u64) + Send + Sync>;

/// A request's summary on its way to the inspector.
pub struct Inspected {
    pub inspector: Arc<crate::inspector::Inspector>,
    pub summary: crate::inspector::Summary,
    /// The request's id.
    pub id: http::HeaderValue,
    /// The body as the client sent it (a transformed endpoint's).
    pub client_body: Option<crate::inspector::Held>,
    /// The body sent upstream, when it differs.
    pub upstream_body: Option<crate::inspector::Held>,
    pub report: Option<crate::transform::Report>,
}

/// How a response ended, as the inspector keeps it.
struct Ended {
    upstream: Arc<str>,
    status: u16,
    outcome: Outcome,
    first_byte_ms: Option<u64>,
    total_ms: u64,
    /// The provider's usage, when it said it.
    usage: Option<crate::api::usage::Usage>,
    cache: Option<crate::inspector::CacheSeen>,
}

impl Inspected {
    /// The summary finished with how the response ended, and recorded.
    fn finish(self, e: Ended) {
        let Inspected {
            inspector,
            mut summary,
            id,
            client_body,
            upstream_body,
            report,
        } = self;
        let names = crate::inspector::Names {
            id: Some(id),
            upstream: Some(e.upstream),
            outcome: Some(e.outcome.label()),
        };
        summary.status = e.status;
        summary.first_byte_ms = e.first_byte_ms;
        summary.total_ms = e.total_ms;
        summary.tokens = e.usage.map(|u| crate::inspector::Tokens {
            prompt: u.prompt,
            cached_read: u.cached_read,
            cache_written: u.cache_write,
            completion: u.completion,
        });
        summary.cache = e.cache;
        inspector.record(crate::inspector::Record {
            summary,
            names,
            client: client_body,
            upstream: upstream_body,
            report,
        });
    }
}

/// What is recorded when the body ends.
pub struct Finish {
    pub metrics: Arc<Metrics>,
    pub upstream: Arc<str>,
    pub model: String,
    /// The caller's key name (a label of the request and token counts).
    pub key: Arc<str>,
    pub status: u16,
    pub request_id: http::HeaderValue,
    /// When the request arrived.
    pub started: Instant,
    /// When the request was sent upstream.
    pub sent: Instant,
    pub inflight: InflightGuard,
    /// What the transforms did, for the log line (agent CLIs never show
    /// the `x-visor-*` headers).
    pub images_replaced: usize,
    pub media_replaced: usize,
    pub bytes_saved: i64,
    /// Cache breakpoints visor placed.
    pub breakpoints: usize,
    /// The inspector's summary of the request, finished and kept when the
    /// body ends.
    pub inspected: Option<Inspected>,
    /// The request's cache as judged before the answer: settled by the
    /// answer's usage (metrics, the log line).
    pub cache: Option<crate::prompt_cache::Seen>,
    /// Called with the tokens the upstream's `usage` reports (prompt, when
    /// it said, and completion — estimated from the text streamed when it
    /// did not say): the caller's rate limit is corrected by them.
    pub on_usage: Option<Charge>,
    /// The request's trace, ended with the body (traced requests).
    pub traced: Option<Traced>,
}

/// A traced request's span, its upstream attempt's, and what the response
/// says of itself (read as it passes).
pub struct Traced {
    pub trace: crate::telemetry::Trace,
    pub attempt: Option<crate::telemetry::AttemptSpan>,
    pub shape: Option<crate::transform::Shape>,
    pub said: Box<crate::api::usage::SaidObserver>,
}

impl Traced {
    /// Ends the spans with how the response ended; the trace's id.
    fn end(
        self,
        status: u16,
        outcome: Outcome,
        usage: Option<crate::api::usage::Usage>,
        cache: Option<crate::prompt_cache::Settled>,
    ) -> String {
        let id = self.trace.trace_id();
        let cache_miss = cache.and_then(|c| c.miss());
        super::traced::End {
            trace: self.trace,
            attempt: self.attempt,
            status,
            outcome: outcome.label(),
            failed: match outcome {
                Outcome::UpstreamError(kind) => Some(kind.label()),
                Outcome::SessionNotStored => Some("session_not_stored"),
                Outcome::Complete | Outcome::ClientCancelled => None,
            },
            usage,
            shape: self.shape,
            said: Some(self.said.finish()),
            cache_readable: cache.and_then(|c| c.readable),
            cache_miss: cache_miss.as_deref(),
        }
        .end();
        id
    }
}

#[derive(Debug, thiserror::Error)]
#[error("upstream {0}")]
pub struct StreamCut(&'static str);

pub struct ObservedBody {
    /// The upstream's body, its ready frames merged (see
    /// [`crate::proxy::coalesce`]).
    inner: Coalesced<ResponseBody>,
    /// Fires at the idle or total deadline. It is not reset per chunk (that
    /// would touch the timer wheel for every SSE event): chunks only stamp
    /// `last_data`, and when the timer fires it is re-armed if data came.
    timer: Pin<Box<Sleep>>,
    idle: Duration,
    deadline: Instant,
    last_data: Instant,
    first_byte: bool,
    /// When the first body byte came.
    first_byte_at: Instant,
    usage: UsageObserver,
    finish: Option<Finish>,
    /// The session turn this response completes, if any.
    session: Option<Recorder>,
    /// The turn being stored, and the frame held until it is (`None`: the
    /// end of the body).
    storing: Option<(Storing, Option<Frame<Bytes>>)>,
    /// Where a turn still being stored when the client goes away is
    /// finished (the session's tracked tasks).
    tasks: Option<TaskTracker>,
}

impl ObservedBody {
    /// `timer` is the request's one timer; it is left as it is when it is
    /// due within one idle gap (the poll re-arms it from `last_data`).
    pub fn new(
        inner: ResponseBody,
        usage: UsageObserver,
        idle: Duration,
        deadline: Instant,
        mut timer: Pin<Box<Sleep>>,
        finish: Finish,
    ) -> Self {
        let now = Instant::now();
        // Usually already due within one idle gap: left alone. Re-armed only
        // when the head took longer than that.
        let due = (now + idle).min(deadline);
        if timer.deadline() > due {
            timer.as_mut().reset(due);
        }
        Self {
            inner: Coalesced::new(inner),
            timer,
            idle,
            deadline,
            last_data: now,
            first_byte: false,
            first_byte_at: now,
            usage,
            finish: Some(finish),
            session: None,
            storing: None,
            tasks: None,
        }
    }

    /// Records the reply into its session; the response's last bytes are
    /// held until the turn is stored.
    pub fn with_session(mut self, recorder: Recorder) -> Self {
        self.tasks = Some(recorder.tasks());
        self.session = Some(recorder);
        self
    }

    fn stamp_first_byte(&mut self) {
        if !self.first_byte {
            self.first_byte = true;
            self.first_byte_at = Instant::now();
            if let Some(f) = &self.finish {
                f.metrics
                    .first_byte
                    .with_label_values(&[&f.upstream])
                    .observe(f.sent.elapsed().as_secs_f64());
            }
        }
    }

    fn report(&mut self, outcome: Outcome) {
        let Some(f) = self.finish.take() else {
            return;
        };
        let usage = self.usage.finish();
        let m = &f.metrics;
        // A status code's label is its three digits, written without a
        // formatter.
        let code = f.status.min(999);
        let digits = [100, 10, 1].map(|d| b'0' + (code / d % 10) as u8);
        let status = std::str::from_utf8(&digits).unwrap_or("000");
        m.requests
            .with_label_values(&[&*f.upstream, f.model.as_str(), status, &f.key])
            .inc();
        let elapsed = f.started.elapsed();
        m.request_duration
            .with_label_values(&[&f.upstream])
            .observe(elapsed.as_secs_f64());
        m.count_tokens(
            &f.key,
            [
                usage.prompt,
                usage.completion,
                usage.cached_read,
                usage.cache_write,
            ],
        );
        if let Outcome::UpstreamError(kind) = outcome {
            m.upstream_error(&f.upstream, kind.label());
        }
        // A stream the client left before its usage came is charged the
        // text it carried.
        let prompt = (usage.prompt > 0).then_some(usage.prompt);
        let completion = usage.completion_charged(outcome == Outcome::Complete);
        if (prompt.is_some() || completion > 0)
            && let Some(charge) = f.on_usage
        {
            charge(prompt, completion);
        }
        // The token fields are on the line only when the provider said its
        // usage (every response that does has prompt tokens or completion
        // tokens): a stream without `include_usage` is not "0 tokens".
        let said = usage.prompt > 0 || usage.completion > 0;
        let cache = f.cache.map(|seen| {
            let answered = (said && outcome == Outcome::Complete).then_some(Answered {
                prompt: usage.prompt,
                read: usage.cached_read,
                written: usage.cache_write,
                cache_said: usage.cache_said,
            });
            seen.settle(m, answered)
        });
        let cache_miss = cache.and_then(|c| c.miss());
        let trace_id = (f.traced).map(|t| t.end(f.status, outcome, said.then_some(usage), cache));
        if let Some(inspected) = f.inspected {
            let first_byte_ms = self.first_byte.then(|| {
                self.first_byte_at
                    .saturating_duration_since(f.sent)
                    .as_millis() as u64
            });
            let ended = Ended {
                upstream: f.upstream.clone(),
                status: f.status,
                outcome,
                first_byte_ms,
                total_ms: elapsed.as_millis() as u64,
                usage: said.then_some(usage),
                cache: cache.map(|c| crate::inspector::CacheSeen {
                    readable: c.readable,
                    miss: cache_miss.clone(),
                }),
            };
            inspected.finish(ended);
        }
        tracing::info!(
            request_id = f.request_id.to_str().unwrap_or_default(),
            upstream = %f.upstream,
            model = %f.model,
            status = f.status,
            outcome = outcome.label(),
            prompt_tokens = said.then_some(usage.prompt),
            completion_tokens = said.then_some(usage.completion),
            cache_read = said.then_some(usage.cached_read),
            cache_written = said.then_some(usage.cache_write),
            cache_readable = cache.and_then(|c| c.readable),
            cache_miss = cache_miss.as_deref(),
            cache_breakpoints = (f.breakpoints > 0).then_some(f.breakpoints),
            images_replaced = f.images_replaced,
            media_replaced = f.media_replaced,
            bytes_saved = f.bytes_saved,
            duration_ms = elapsed.as_millis() as u64,
            trace_id = trace_id.as_deref(),
            "response finished"
        );
    }
}

impl Body for ObservedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.finish.is_none() {
            // Already ended (an error was returned); stay ended.
            return Poll::Ready(None);
        }
        if let Some((storing, held)) = &mut this.storing {
            // A session turn is being stored (bounded by the store's own
            // timeout): the last bytes wait for it.
            let Poll::Ready(stored) = storing.as_mut().poll(cx) else {
                return Poll::Pending;
            };
            let held = held.take();
            this.storing = None;
            if !stored {
                // "A reply is stored before its last bytes reach the
                // client": the turn was not, so the response does not
                // complete — the client sees a cut, as for a broken stream,
                // and may retry.
                this.report(Outcome::SessionNotStored);
                return Poll::Ready(Some(Err(Box::new(StreamCut(
                    "response cut: its session turn could not be stored",
                )))));
            }
            return match held {
                Some(frame) => Poll::Ready(Some(Ok(frame))),
                None => {
                    this.report(Outcome::Complete);
                    Poll::Ready(None)
                }
            };
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.stamp_first_byte();
                if let Some(data) = frame.data_ref() {
                    this.usage.observe(data);
                    if let Some(t) = this.finish.as_mut().and_then(|f| f.traced.as_mut()) {
                        t.said.observe(data);
                    }
                }
                this.last_data = Instant::now();
                if let Some(rec) = &mut this.session {
                    if let Some(data) = frame.data_ref() {
                        rec.observe(data);
                    }
                    let last = rec.stream_complete() || this.inner.is_end_stream();
                    if last && let Some(storing) = rec.finish(true) {
                        this.storing = Some((storing, Some(frame)));
                        return self.poll_frame(cx);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.report(Outcome::UpstreamError(UpstreamFailure::Reset));
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                this.stamp_first_byte();
                if let Some(storing) = this.session.as_mut().and_then(|r| r.finish(true)) {
                    this.storing = Some((storing, None));
                    return self.poll_frame(cx);
                }
                this.report(Outcome::Complete);
                Poll::Ready(None)
            }
            Poll::Pending => {
                while this.timer.as_mut().poll(cx).is_ready() {
                    let now = Instant::now();
                    let kind = if now >= this.deadline {
                        UpstreamFailure::RequestTimeout
                    } else if now >= this.last_data + this.idle {
                        UpstreamFailure::IdleTimeout
                    } else {
                        // Data came since the timer was set: re-arm it.
                        let next = (this.last_data + this.idle).min(this.deadline);
                        this.timer.as_mut().reset(next);
                        continue;
                    };
                    this.report(Outcome::UpstreamError(kind));
                    return Poll::Ready(Some(Err(Box::new(StreamCut(kind.label())))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // A held frame is still to come.
        self.storing.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.inner.size_hint();
        if let Some((_, Some(frame))) = &self.storing {
            let held = frame.data_ref().map_or(0, |d| d.len() as u64);
            if let Some(upper) = hint.upper() {
                hint.set_upper(upper + held);
            }
            hint.set_lower(hint.lower() + held);
        }
        hint
    }
}

impl Drop for ObservedBody {
    fn drop(&mut self) {
        // A turn being stored is stored, whether or not the client waits.
        if let Some((storing, _)) = self.storing.take()
            && let Some(tasks) = &self.tasks
            && tokio::runtime::Handle::try_current().is_ok()
        {
            tasks.spawn(storing);
        }
        if self.finish.is_some() {
            // hyper stops polling a body whose length is known once it has
            // all of it; only a body with bytes still to come was cut short.
            let outcome = if self.inner.is_end_stream() {
                Outcome::Complete
            } else {
                Outcome::ClientCancelled
            };
            self.report(outcome);
        }
    }
}
