//! Descriptions of images for models that cannot see them
//! (`images.non_vision = "describe"`).
//!
//! The describer is the `[describer]` model on its upstream, called through
//! `POST /chat/completions` with one image per call and [`PROMPT`]. Each
//! description is known by SHA-256(image bytes, or URL), describer model
//! and [`PROMPT_VERSION`], and looked up in a bounded in-memory cache
//! (moka), then in the store (`[store]`), before the describer is asked.
//!
//! - Single-flight: concurrent requests that need the same image wait for
//!   one call (moka's `try_get_with`); at most `describer.concurrency`
//!   calls run at once in the process.
//! - Never fails the user's request: a timeout, an error answer, an empty
//!   description or a dead describer gives the placeholder, counts
//!   `visor_describe_total{result="error"}`, and caches nothing. After a
//!   failure that says the describer is unwell (unreachable, timed out,
//!   5xx, 429), calls pause for a back-off (1 s, doubling to 60 s, reset by
//!   a success), so a dead describer is not hammered.
//! - `on_miss = "wait"`: the request waits up to `timeout_secs` for its
//!   images' descriptions (described concurrently). `"placeholder"`: it goes
//!   on at once with the placeholder while the description is made in the
//!   background (at most [`MAX_BACKGROUND`] at a time, cancelled at
//!   shutdown) for the next request.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, header};
use http_body_util::BodyExt;
use moka::future::Cache;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::store::Store;
use crate::transform::{Payload, Subject, subject_key};
use crate::upstream::{UpstreamBody, Upstreams, X_API_KEY, own_credential};

/// The prompt's version: part of every description's key, so a new prompt
/// makes new descriptions instead of mixing with the old ones.
pub const PROMPT_VERSION: u32 = 1;

/// Version of the transcription request (bump when its form changes, so
/// transcripts cached under the old one are not reused).
pub const TRANSCRIBE_VERSION: u32 = 1;

/// The one prompt the describer is given (as the system message).
pub const PROMPT: &str = "You describe images for a reader who cannot see them: a language model that \
will answer questions about the image from your words alone. Write down what that reader needs:\n\
- all visible text, verbatim and in reading order (code, commands, error messages, labels, UI text, \
captions);\n\
- for a chart or graph: its kind, title, axes with units, each series, and the numbers shown;\n\
- for a table: its columns and its rows with their values;\n\
- the layout (what is where), and the people, objects, colours and states that matter.\n\
Be concise and factual: no preamble, no guessing beyond what is shown, no opinions. Plain text.";

/// Descriptions held in memory, in bytes (key + text).
const CACHE_BYTES: u64 = 64 << 20;

/// Background descriptions (`on_miss = "placeholder"`) in flight at most;
/// an image beyond that is left for a later request.
pub const MAX_BACKGROUND: usize = 64;

/// A describer answer larger than this is refused (an error).
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// A description longer than this (in characters) is cut, ending in `…`.
const MAX_DESCRIPTION_CHARS: usize = 8_000;
/// A transcript longer than this is cut alike.
const MAX_TRANSCRIPT_CHARS: usize = 32_000;

/// How a [`Describer`] is set up: its section of the configuration.
struct Service<'a> {
    job: Job,
    upstream: Option<&'a str>,
    model: &'a str,
    timeout: Duration,
    concurrency: u32,
    in_background: bool,
}

const BACKOFF_START: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(60);

/// What a [`Describer`] does with what it is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Job {
    /// `[describer]`: an image described by a vision model.
    Describe,
    /// `[transcriber]`: speech written down by a transcription model.
    Transcribe,
}

/// The describer (`[describer]`) or the transcriber (`[transcriber]`): one
/// upstream model called once per distinct subject, cached, bounded and
/// backed off alike.
pub struct Describer {
    job: Job,
    /// Index of the describer's upstream in `[[upstream]]`.
    upstream: usize,
    /// That upstream has an `api_key` of its own (then a client's key is
    /// never carried to it)…
    has_own_key: bool,
    /// …and that key as the header it is sent in.
    own_credential: Option<(HeaderName, HeaderValue)>,
    upstreams: Arc<Upstreams>,
    /// Descriptions beyond one process.
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    model: String,
    timeout: Duration,
    /// `on_miss = "placeholder"`
    in_background: bool,
    calls: Semaphore,
    cache: Cache<String, Arc<str>>,
    backoff: Mutex<Backoff>,
    background: TaskTracker,
    cancel: CancellationToken,
    /// Keys being described in the background.
    pending: Mutex<HashSet<String>>,
    /// The upstream's name, for what is said of a refusal.
    upstream_name: String,
    /// The last time its upstream refused the credential (401/403), why,
    /// and when that was last logged: `/readyz` says degraded while it is
    /// recent, the log says it once a minute.
    refused: Mutex<Option<Refused>>,
}

/// A describer's upstream refusing its credential.
struct Refused {
    at: Instant,
    why: String,
    logged: Option<Instant>,
}

/// How long a credential refusal keeps `/readyz` degraded after the last one.
const REFUSED_FOR: Duration = Duration::from_secs(300);
/// At most one error line per this long about refusals.
const REFUSED_LOG_EVERY: Duration = Duration::from_secs(60);

/// The client's credential, carried to the describer when the describer's
/// upstream has no `api_key` of its own, visor has no proxy keys, and the
/// request is going to that same upstream (a key is never sent to a
/// provider other than the one the client sent it for).
#[derive(Clone, Default)]
pub struct Credential(Vec<(HeaderName, HeaderValue)>);

impl Credential {
    /// `proxy_keys`: visor checks keys of its own (`server.api_keys`), so
    /// the client's header is not a provider key.
    pub fn for_request(
        d: &Describer,
        proxy_keys: bool,
        headers: &HeaderMap,
        request_upstream: usize,
    ) -> Self {
        if d.has_own_key || proxy_keys || request_upstream != d.upstream {
            return Credential::default();
        }
        let mut out = Vec::new();
        for name in [header::AUTHORIZATION, X_API_KEY.clone()] {
            if let Some(v) = headers.get(&name) {
                let mut v = v.clone();
                v.set_sensitive(true);
                out.push((name, v));
            }
        }
        Credential(out)
    }
}

/// Why a description could not be had.
#[derive(Debug)]
struct Failure {
    reason: String,
    /// The describer looks unwell: pause calls for a while.
    back_off: bool,
}

impl Failure {
    fn new(reason: impl Into<String>, back_off: bool) -> Self {
        Self {
            reason: reason.into(),
            back_off,
        }
    }
}

/// Where a description came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// The memory cache, the store, or another request's call.
    Cached,
    /// A describer call made for this lookup.
    Described,
}

#[derive(Default)]
struct Backoff {
    failures: u32,
    until: Option<Instant>,
}

impl Backoff {
    fn active(&self) -> bool {
        self.until.is_some_and(|u| Instant::now() < u)
    }

    /// Records a failure; returns the pause. Failures while a pause is on
    /// (concurrent calls failing together) do not lengthen it.
    fn fail(&mut self) -> Duration {
        if let Some(until) = self.until
            && self.active()
        {
            return until.saturating_duration_since(Instant::now());
        }
        self.failures = self.failures.saturating_add(1);
        let pause = BACKOFF_START
            .saturating_mul(1u32 << self.failures.saturating_sub(1).min(6))
            .min(BACKOFF_MAX);
        self.until = Some(Instant::now() + pause);
        pause
    }

    fn reset(&mut self) {
        self.failures = 0;
        self.until = None;
    }
}

impl Describer {
    /// The describer of `config.describer`, calling through `upstreams`,
    /// keeping descriptions in `store`, counted in `metrics`.
    pub fn new(
        config: &Config,
        upstreams: Arc<Upstreams>,
        store: Arc<Store>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let d = &config.describer;
        let service = Service {
            job: Job::Describe,
            upstream: d.upstream.as_deref(),
            model: &d.model,
            timeout: d.timeout,
            concurrency: d.concurrency,
            in_background: d.on_miss == crate::config::OnMiss::Placeholder,
        };
        Self::with(service, config, upstreams, store, metrics)
    }

    /// The transcriber of `config.transcriber` (speech to text; never in
    /// the background: a request waits for its transcripts).
    pub fn transcriber(
        config: &Config,
        upstreams: Arc<Upstreams>,
        store: Arc<Store>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let t = &config.transcriber;
        let service = Service {
            job: Job::Transcribe,
            upstream: t.upstream.as_deref(),
            model: &t.model,
            timeout: t.timeout,
            concurrency: t.concurrency,
            in_background: false,
        };
        Self::with(service, config, upstreams, store, metrics)
    }

    fn with(
        service: Service<'_>,
        config: &Config,
        upstreams: Arc<Upstreams>,
        store: Arc<Store>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let upstream = service
            .upstream
            .and_then(|name| config.upstreams.iter().position(|u| u.name == name))
            .unwrap_or(0);
        let cache = Cache::builder()
            .max_capacity(CACHE_BYTES)
            .weigher(|k: &String, v: &Arc<str>| {
                u32::try_from(k.len() + v.len()).unwrap_or(u32::MAX)
            })
            .build();
        Self {
            job: service.job,
            upstream,
            has_own_key: config
                .upstreams
                .get(upstream)
                .is_some_and(|u| u.api_key.is_some()),
            own_credential: config.upstreams.get(upstream).and_then(own_credential),
            upstreams,
            store,
            metrics,
            model: service.model.to_owned(),
            timeout: service.timeout,
            in_background: service.in_background,
            calls: Semaphore::new(service.concurrency.max(1) as usize),
            cache,
            backoff: Mutex::new(Backoff::default()),
            background: TaskTracker::new(),
            cancel: CancellationToken::new(),
            pending: Mutex::new(HashSet::new()),
            upstream_name: config
                .upstreams
                .get(upstream)
                .map(|u| u.name.clone())
                .unwrap_or_default(),
            refused: Mutex::new(None),
        }
    }

    /// Why `/readyz` should say degraded: the upstream refused this
    /// describer's credential within the last five minutes (none since
    /// answered).
    pub fn problem(&self) -> Option<String> {
        let r = self.refused.lock().ok()?;
        let r = r.as_ref()?;
        (r.at.elapsed() < REFUSED_FOR).then(|| r.why.clone())
    }

    /// The upstream answered `status` (401/403): counted, remembered for
    /// `/readyz`, logged as an error at most once a minute.
    fn credential_refused(&self, status: u16) {
        let role = match self.job {
            Job::Describe => "describer",
            Job::Transcribe => "transcriber",
        };
        self.metrics
            .credential_refused
            .with_label_values(&[role, &self.upstream_name])
            .inc();
        let why = format!(
            "{role} {:?} refused by upstream `{}` ({status}): check its credential (an api_key of its own, or clients' keys forwarded to it); {}",
            self.model,
            self.upstream_name,
            match self.job {
                Job::Describe => "images get placeholders meanwhile",
                Job::Transcribe => "audio gets placeholders meanwhile",
            }
        );
        let Ok(mut r) = self.refused.lock() else {
            return;
        };
        let now = Instant::now();
        let logged = r.as_ref().and_then(|r| r.logged);
        let log = logged.is_none_or(|l| now.duration_since(l) >= REFUSED_LOG_EVERY);
        if log {
            tracing::error!(upstream = %self.upstream_name, status, "{why}");
        }
        *r = Some(Refused {
            at: now,
            why,
            logged: if log { Some(now) } else { logged },
        });
    }

    /// The key a description is known by: image SHA-256 hex, describer
    /// model, prompt version (and the query's hash, when it has one).
    pub fn key(&self, sha256: &str) -> String {
        match self.job {
            Job::Describe => description_key(sha256, &self.model),
            Job::Transcribe => format!("transcript/{sha256}/{}/v{TRANSCRIBE_VERSION}", self.model),
        }
    }

    /// The key of a subject (its image and query).
    fn key_of(&self, s: &Subject) -> String {
        self.key(&subject_key(&s.sha256, s.query.as_deref()))
    }

    /// Counts one lookup in `visor_describe_total` (the describer's; the
    /// transcriber's are counted by the caller, by medium).
    fn count(&self, result: &str) {
        if self.job == Job::Describe {
            self.metrics.describe.with_label_values(&[result]).inc();
        }
    }

    /// A text kept for `key` (memory, then the store): for texts made of
    /// several descriptions, such as a whole document's.
    pub async fn cached(&self, key: &str) -> Option<Arc<str>> {
        self.lookup(key).await
    }

    /// Keeps `text` under `key` in memory and in the store.
    pub async fn remember(&self, key: &str, text: Arc<str>) {
        self.cache.insert(key.to_owned(), text.clone()).await;
        let _ = self.store.put_description(key, &text).await;
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    pub fn upstream(&self) -> usize {
        self.upstream
    }

    /// Descriptions held in memory (moka's pending bookkeeping done first,
    /// so the count is current).
    pub async fn cache_entries(&self) -> u64 {
        self.cache.run_pending_tasks().await;
        self.cache.entry_count()
    }

    /// Stops background descriptions and takes no new ones (shutdown).
    pub fn shutdown(&self) {
        self.cancel.cancel();
        self.background.close();
    }

    /// The memory cache, then the store; the store's answer is kept in
    /// memory. A store that fails counts as a miss.
    async fn lookup(&self, key: &str) -> Option<Arc<str>> {
        if let Some(d) = self.cache.get(key).await {
            return Some(d);
        }
        let text = self.store.description(key).await.ok().flatten()?;
        let text: Arc<str> = Arc::from(text);
        self.cache.insert(key.to_owned(), text.clone()).await;
        Some(text)
    }

    /// The description of `subject`: cached, or made by one describer call
    /// shared by every concurrent lookup of the same key.
    async fn get_or_make(
        &self,
        key: &str,
        subject: &Subject,
        cred: &Credential,
    ) -> Result<(Arc<str>, Origin), Arc<Failure>> {
        if let Some(d) = self.cache.get(key).await {
            return Ok((d, Origin::Cached));
        }
        let called = AtomicBool::new(false);
        let made = self
            .cache
            .try_get_with(key.to_owned(), async {
                if let Ok(Some(text)) = self.store.description(key).await {
                    return Ok(Arc::from(text));
                }
                called.store(true, Ordering::Relaxed);
                let text = self.call(subject, cred).await?;
                // A store that is down was logged and counted by the store;
                // the description still serves from memory.
                let _ = self.store.put_description(key, &text).await;
                Ok::<_, Failure>(text)
            })
            .await?;
        let origin = if called.load(Ordering::Relaxed) {
            Origin::Described
        } else {
            Origin::Cached
        };
        Ok((made, origin))
    }

    /// One describer call, within the concurrency bound and the back-off.
    async fn call(&self, subject: &Subject, cred: &Credential) -> Result<Arc<str>, Failure> {
        if self.backing_off() {
            return Err(Failure::new(
                "describer paused after failures (back-off)",
                false,
            ));
        }
        let _permit = self
            .calls
            .acquire()
            .await
            .map_err(|_| Failure::new("describer closed", false))?;
        // A call that failed while this one queued started a back-off.
        if self.backing_off() {
            return Err(Failure::new(
                "describer paused after failures (back-off)",
                false,
            ));
        }
        let span = crate::telemetry::child(
            match self.job {
                Job::Describe => format!("describe {}", self.model),
                _ => format!("transcribe {}", self.model),
            },
            vec![
                opentelemetry::KeyValue::new(
                    "visor.job",
                    match self.job {
                        Job::Describe => "describe",
                        _ => "transcribe",
                    },
                ),
                opentelemetry::KeyValue::new("gen_ai.request.model", self.model.to_string()),
                opentelemetry::KeyValue::new(
                    "visor.media.sha256",
                    short(&subject.sha256).to_string(),
                ),
            ],
        );
        let started = Instant::now();
        let result = tokio::time::timeout(self.timeout, self.request(subject, cred)).await;
        if self.job == Job::Describe {
            self.metrics
                .describe_duration
                .observe(started.elapsed().as_secs_f64());
        }
        let result = result.unwrap_or_else(|_| {
            Err(Failure::new(
                format!("no answer within {:.1} s", self.timeout.as_secs_f64()),
                true,
            ))
        });
        match &result {
            Ok(_) => {
                if let Ok(mut b) = self.backoff.lock() {
                    b.reset();
                }
                if let Ok(mut r) = self.refused.lock() {
                    *r = None;
                }
            }
            Err(f) => {
                if let Some(span) = &span {
                    span.failed(&f.reason);
                }
                let pause = f.back_off.then(|| self.fail());
                tracing::warn!(
                    describer = %self.model,
                    image = %short(&subject.sha256),
                    error = %f.reason,
                    pause_secs = pause.map(|p| p.as_secs_f64()),
                    "describer failed: the placeholder is used"
                );
            }
        }
        result
    }

    /// Whether calls are paused after failures (back-off): work made only
    /// to be described (rendering a page) can be skipped.
    pub fn is_backing_off(&self) -> bool {
        self.backing_off()
    }

    fn backing_off(&self) -> bool {
        self.backoff.lock().map(|b| b.active()).unwrap_or(false)
    }

    fn fail(&self) -> Duration {
        self.backoff
            .lock()
            .map(|mut b| b.fail())
            .unwrap_or(BACKOFF_START)
    }

    /// Sends the describer request and reads its answer.
    async fn request(&self, subject: &Subject, cred: &Credential) -> Result<Arc<str>, Failure> {
        let i = self.upstream;
        let path = match self.job {
            Job::Describe => "/chat/completions",
            Job::Transcribe => "/audio/transcriptions",
        };
        let uri = self.upstreams.uri(i, path, None).ok_or_else(|| {
            Failure::new(
                "the describer upstream's base_url has no usable path",
                false,
            )
        })?;
        let (body, content_type) = match self.job {
            Job::Describe => (
                request_body(&self.model, subject),
                HeaderValue::from_static("application/json"),
            ),
            Job::Transcribe => transcription_body(&self.model, subject)
                .ok_or_else(|| Failure::new("the transcriber is sent audio bytes only", false))?,
        };
        let mut req = Request::new(UpstreamBody {
            prefix: VecDeque::from([body.clone()]),
            rest: None,
        });
        *req.method_mut() = Method::POST;
        *req.uri_mut() = uri;
        let h = req.headers_mut();
        h.insert(header::CONTENT_TYPE, content_type);
        h.insert(header::ACCEPT, HeaderValue::from_static("application/json"));
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        h.insert(
            header::USER_AGENT,
            HeaderValue::from_static(concat!("visor/", env!("CARGO_PKG_VERSION"), " (describer)")),
        );
        match &self.own_credential {
            Some((name, value)) => {
                h.insert(name.clone(), value.clone());
            }
            None => {
                for (name, value) in &cred.0 {
                    h.insert(name.clone(), value.clone());
                }
            }
        }
        let no_limit = crate::upstream::BodyState::default();
        let resp = self
            .upstreams
            .send(i, req, &no_limit)
            .await
            .map_err(|f| Failure::new(format!("describer unreachable: {}", f.cause), true))?;
        let status = resp.status();
        let mut body = resp.into_body();
        let mut answer = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|_| Failure::new("describer answer cut off", true))?;
            if let Ok(data) = frame.into_data() {
                answer.extend_from_slice(&data);
                if answer.len() > MAX_ANSWER_BYTES {
                    return Err(Failure::new("describer answer larger than 1 MiB", false));
                }
            }
        }
        // Visor's own credential refused, or none sent: a config problem.
        // A client's own key refused is that client's (its request is
        // answered; the proxy is not degraded for it).
        if matches!(status.as_u16(), 401 | 403)
            && (self.own_credential.is_some() || cred.0.is_empty())
        {
            self.credential_refused(status.as_u16());
        }
        if !status.is_success() {
            let unwell = status.is_server_error() || status.as_u16() == 429;
            return Err(Failure::new(
                format!("describer answered {status}: {}", error_message(&answer)),
                unwell,
            ));
        }
        let (text, max_chars) = match self.job {
            Job::Describe => (description_of(&answer), MAX_DESCRIPTION_CHARS),
            Job::Transcribe => (transcript_of(&answer), MAX_TRANSCRIPT_CHARS),
        };
        let text =
            text.ok_or_else(|| Failure::new("describer answer has no message content", false))?;
        let text = text.trim();
        if text.is_empty() {
            return Err(Failure::new("describer gave an empty description", false));
        }
        Ok(Arc::from(cut(text, max_chars)))
    }
}

/// The key a description is known by in the cache and the store.
pub fn description_key(sha256: &str, describer_model: &str) -> String {
    format!("{sha256}/{describer_model}/v{PROMPT_VERSION}")
}

/// Descriptions for `subjects` (each a distinct image), as pairs of full
/// SHA-256 hex and text; images without one get the placeholder.
pub async fn describe(
    d: &Arc<Describer>,
    subjects: Vec<Subject>,
    cred: &Credential,
) -> Vec<(String, Arc<str>)> {
    let (lookups, calls): (Vec<Subject>, Vec<Subject>) =
        subjects.into_iter().partition(|s| s.lookup_only);
    let (mut found, made) =
        futures_util::future::join(cached_only(d, lookups), make(d, calls, cred)).await;
    found.extend(made);
    found
}

/// Cached descriptions only (aged-out and capped images): the describer is
/// never called for these.
async fn cached_only(d: &Describer, subjects: Vec<Subject>) -> Vec<(String, Arc<str>)> {
    let found = futures_util::future::join_all(subjects.into_iter().map(|s| async move {
        let text = d.lookup(&d.key_of(&s)).await?;
        d.count("hit");
        Some((subject_key(&s.sha256, s.query.as_deref()), text))
    }))
    .await;
    found.into_iter().flatten().collect()
}

/// Descriptions for images a model cannot see: cached, or made by the
/// describer (waited for, or in the background with `on_miss =
/// "placeholder"`).
async fn make(
    d: &Arc<Describer>,
    subjects: Vec<Subject>,
    cred: &Credential,
) -> Vec<(String, Arc<str>)> {
    if subjects.is_empty() {
        return Vec::new();
    }
    if d.in_background {
        let found = futures_util::future::join_all(subjects.into_iter().map(|s| async move {
            let key = d.key_of(&s);
            match d.lookup(&key).await {
                Some(text) => {
                    d.count("hit");
                    Some((subject_key(&s.sha256, s.query.as_deref()), text))
                }
                None => {
                    spawn_background(d, key, s, cred.clone());
                    None
                }
            }
        }))
        .await;
        return found.into_iter().flatten().collect();
    }
    let deadline = Instant::now() + d.timeout;
    let results = futures_util::future::join_all(subjects.iter().map(|s| async move {
        let key = d.key_of(s);
        tokio::time::timeout_at(deadline, d.get_or_make(&key, s, cred)).await
    }))
    .await;
    let mut out = Vec::new();
    let mut timed_out = 0;
    for (s, r) in subjects.into_iter().zip(results) {
        match r {
            Ok(Ok((text, origin))) => {
                let result = match origin {
                    Origin::Cached => "hit",
                    Origin::Described => "miss",
                };
                d.count(result);
                out.push((subject_key(&s.sha256, s.query.as_deref()), text));
            }
            Ok(Err(_)) => d.count("error"),
            Err(_) => {
                d.count("error");
                timed_out += 1;
            }
        }
    }
    if timed_out > 0 {
        let pause = d.fail();
        tracing::warn!(
            describer = %d.model,
            images = timed_out,
            timeout_secs = d.timeout.as_secs_f64(),
            pause_secs = pause.as_secs_f64(),
            "describer timed out: the placeholder is used"
        );
    }
    out
}

/// Makes a description in the background for a later request.
fn spawn_background(d: &Arc<Describer>, key: String, subject: Subject, cred: Credential) {
    if d.cancel.is_cancelled() {
        return;
    }
    {
        let Ok(mut pending) = d.pending.lock() else {
            return;
        };
        if pending.len() >= MAX_BACKGROUND || !pending.insert(key.clone()) {
            return;
        }
    }
    d.metrics.describe_background.inc();
    let cancel = d.cancel.clone();
    let d2 = d.clone();
    d.background.spawn(async move {
        let d = &d2;
        let m = &d.metrics;
        tokio::select! {
            () = cancel.cancelled() => {}
            r = tokio::time::timeout(d.timeout, d.get_or_make(&key, &subject, &cred)) => {
                let result = match r {
                    Ok(Ok((_, Origin::Described))) => "miss",
                    Ok(Ok((_, Origin::Cached))) => "hit",
                    Ok(Err(_)) => "error",
                    Err(_) => {
                        d.fail();
                        tracing::warn!(describer = %d.model, "describer timed out (background)");
                        "error"
                    }
                };
                m.describe.with_label_values(&[result]).inc();
            }
        }
        if let Ok(mut pending) = d.pending.lock() {
            pending.remove(&key);
        }
        m.describe_background.dec();
    });
}

/// The describer request: the prompt, one image, nothing else.
fn request_body(model: &str, subject: &Subject) -> Bytes {
    let url = match &subject.payload {
        Payload::Inline { media_type, bytes } => {
            let mut s = String::with_capacity(bytes.len() * 4 / 3 + 64);
            s.push_str("data:");
            s.push_str(media_type);
            s.push_str(";base64,");
            s.push_str(&base64_simd::STANDARD.encode_to_string(bytes));
            s
        }
        Payload::Url(u) => u.clone(),
    };
    // Query-aware: the user's words from the message holding the image
    // say what matters in it (the description still covers the rest).
    let ask = match &subject.query {
        Some(q) => format!(
            "Describe this image. The user sent it with these words; make sure the description \
             answers what they ask about it:\n\"\"\"\n{q}\n\"\"\""
        ),
        None => "Describe this image.".to_owned(),
    };
    let body = serde_json::json!({
        "model": model,
        "messages": [
            {"role": "system", "content": PROMPT},
            {"role": "user", "content": [
                {"type": "text", "text": ask},
                {"type": "image_url", "image_url": {"url": url}},
            ]},
        ],
        "stream": false,
    });
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

/// The transcription request (`multipart/form-data`, as OpenAI, Groq and
/// whisper servers take it): the model and the audio as a file whose name
/// says its format. `None` for a URL (visor never fetches one).
fn transcription_body(model: &str, subject: &Subject) -> Option<(Bytes, HeaderValue)> {
    let Payload::Inline { media_type, bytes } = &subject.payload else {
        return None;
    };
    let ext = audio_extension(media_type);
    // The media type was checked when the audio was read; this guards the
    // form's headers all the same.
    let media_type = match media_type
        .bytes()
        .all(|b| b.is_ascii_graphic() && !b"\";\\".contains(&b))
    {
        true => media_type.as_str(),
        false => "application/octet-stream",
    };
    // A boundary that cannot occur in the audio: derived from its hash.
    let boundary = format!("visor-{}", subject.sha256.get(..32).unwrap_or("boundary"));
    let mut body = BytesMut::with_capacity(bytes.len() + 512);
    let field = |body: &mut BytesMut, name: &str, value: &str| {
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
            )
            .as_bytes(),
        );
    };
    field(&mut body, "model", model);
    field(&mut body, "response_format", "json");
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"audio.{ext}\"\r\nContent-Type: {media_type}\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(bytes);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let ct = HeaderValue::from_str(&format!("multipart/form-data; boundary={boundary}")).ok()?;
    Some((body.freeze(), ct))
}

/// The file name extension a transcription server knows a format by
/// (they go by the name): `audio/mpeg` → `mp3`, `audio/x-m4a` → `m4a`;
/// `wav` when the type says nothing known.
fn audio_extension(media_type: &str) -> &'static str {
    let sub = media_type.strip_prefix("audio/").unwrap_or("");
    let sub = sub.strip_prefix("x-").unwrap_or(sub);
    match sub {
        "mpeg" | "mp3" | "mpga" => "mp3",
        "ogg" | "oga" | "opus" => "ogg",
        "flac" => "flac",
        "webm" => "webm",
        "mp4" | "m4a" | "aac" => "m4a",
        _ => "wav",
    }
}

/// The `text` of a transcription answer.
fn transcript_of(answer: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(answer).ok()?;
    v.get("text")?.as_str().map(str::to_owned)
}

/// `choices[0].message.content`: a string, or text parts joined.
fn description_of(answer: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(answer).ok()?;
    let content = v.get("choices")?.get(0)?.get("message")?.get("content")?;
    match content {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(parts) => Some(
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        _ => None,
    }
}

/// The `error.message` of an error answer, cut short, for the log.
fn error_message(answer: &[u8]) -> String {
    let v: Option<serde_json::Value> = serde_json::from_slice(answer).ok();
    let msg = v
        .as_ref()
        .and_then(|v| v.get("error"))
        .and_then(|e| e.get("message").or(Some(e)))
        .and_then(|m| m.as_str())
        .unwrap_or("(no error message)");
    cut(msg, 200)
}

fn cut(text: &str, max_chars: usize) -> String {
    match text.char_indices().nth(max_chars) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

fn short(sha256: &str) -> &str {
    sha256.get(..12).unwrap_or(sha256)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn reads_string_and_part_contents() {
        let a = br#"{"choices":[{"message":{"role":"assistant","content":"A bar chart."}}]}"#;
        assert_eq!(description_of(a).as_deref(), Some("A bar chart."));
        let b = br#"{"choices":[{"message":{"content":[{"type":"text","text":"one"},{"type":"text","text":"two"}]}}]}"#;
        assert_eq!(description_of(b).as_deref(), Some("one\ntwo"));
        assert_eq!(description_of(br#"{"choices":[]}"#), None);
        assert_eq!(
            description_of(br#"{"choices":[{"message":{"content":null}}]}"#),
            None
        );
        assert_eq!(description_of(b"not json"), None);
    }

    #[test]
    fn transcription_form_names_the_format_and_keeps_headers_whole() {
        let subject = |media_type: &str| Subject {
            sha256: "ab".repeat(32),
            payload: Payload::Inline {
                media_type: media_type.to_owned(),
                bytes: Bytes::from_static(b"AUDIO"),
            },
            lookup_only: false,
            query: None,
        };
        let form = |mt: &str| {
            let (body, ct) = transcription_body("whisper-1", &subject(mt)).unwrap();
            let boundary = ct.to_str().unwrap().rsplit('=').next().unwrap().to_owned();
            (String::from_utf8(body.to_vec()).unwrap(), boundary)
        };
        for (mt, name) in [
            ("audio/mpeg", "audio.mp3"),
            ("audio/x-m4a", "audio.m4a"),
            ("audio/webm", "audio.webm"),
            ("audio/ogg", "audio.ogg"),
            ("audio/wav", "audio.wav"),
            ("application/octet-stream", "audio.wav"),
        ] {
            let (body, boundary) = form(mt);
            assert!(
                body.contains(&format!("filename=\"{name}\"")),
                "{mt}: {body}"
            );
            assert!(body.contains(&format!("Content-Type: {mt}\r\n")), "{mt}");
            assert!(body.ends_with(&format!("--{boundary}--\r\n")));
            assert!(body.contains("name=\"model\"\r\n\r\nwhisper-1\r\n"));
        }
        // A type that would break the part's headers never goes in as is.
        let (body, _) = form("audio/wav\r\nX-Evil: 1");
        assert!(!body.contains("X-Evil"), "{body}");
        assert!(body.contains("Content-Type: application/octet-stream\r\n"));
    }

    #[test]
    fn long_descriptions_are_cut_on_a_character() {
        assert_eq!(cut("ééé", 2), "éé…");
        assert_eq!(cut("abc", 3), "abc");
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let mut b = Backoff::default();
        assert!(!b.active());
        assert_eq!(b.fail(), Duration::from_secs(1));
        assert!(b.active());
        // A second failure inside the pause does not lengthen it.
        assert!(b.fail() <= Duration::from_secs(1));
        assert_eq!(b.failures, 1);
        // Failures after each pause double it, up to the cap.
        let mut pauses = Vec::new();
        for _ in 0..10 {
            b.until = None;
            pauses.push(b.fail().as_secs());
        }
        assert_eq!(pauses, vec![2, 4, 8, 16, 32, 60, 60, 60, 60, 60]);
        b.reset();
        assert!(!b.active());
    }

    #[test]
    fn the_request_carries_one_image_and_the_prompt() {
        let s = Subject {
            sha256: "ab".repeat(32),
            payload: Payload::Inline {
                media_type: "image/png".into(),
                bytes: Bytes::from_static(b"\x89PNG"),
            },
            lookup_only: false,
            query: None,
        };
        let v: serde_json::Value =
            serde_json::from_slice(&request_body("vision-mini", &s)).unwrap();
        assert_eq!(v["model"], "vision-mini");
        assert_eq!(v["messages"][0]["content"], PROMPT);
        assert_eq!(
            v["messages"][1]["content"][1]["image_url"]["url"],
            "data:image/png;base64,iVBORw=="
        );
        let u = Subject {
            sha256: "cd".repeat(32),
            payload: Payload::Url("https://example.com/a.png".into()),
            lookup_only: false,
            query: None,
        };
        let v: serde_json::Value = serde_json::from_slice(&request_body("m", &u)).unwrap();
        assert_eq!(
            v["messages"][1]["content"][1]["image_url"]["url"],
            "https://example.com/a.png"
        );
    }
}
