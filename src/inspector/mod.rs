//! The inspector: what visor did to each recent request. A request's
//! summary is kept in a bounded ring (`[inspector] keep`, newest first;
//! with a shared store also in the replicas' stream), its bodies without
//! their media bytes up to `[inspector] body_bytes`; shown as JSON at
//! `/visor/api/…` and as pages at `/visor/ui` (readable without
//! JavaScript). Recording is one send on a bounded queue at the end of a
//! response; a task does the rest. Never a credential is kept.

pub mod access;
pub mod bodies;
pub mod chart;
pub mod detail;
pub mod filter;
pub mod page;
pub mod savings;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc};

pub use access::Access;
use access::Gate;
use bodies::{Bodies, Kept};
pub use filter::Filter;
pub use savings::{Prices, Saving};

use crate::config::Inspector as Config;
use crate::models::ModelTable;
use crate::store::{Shared, Store};
use crate::transform::Report;

/// What one request was and what visor did to it.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct Summary {
    /// Its `x-request-id`.
    pub id: String,
    /// When it arrived, milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// The replica that served it.
    pub replica: String,
    /// The caller's key name (`none` without one).
    pub key: Arc<str>,
    /// `/v1/chat/completions`…
    pub endpoint: std::borrow::Cow<'static, str>,
    pub model: String,
    pub upstream: Arc<str>,
    pub status: u16,
    /// `complete`, `client_cancelled`, `reset`…
    pub outcome: std::borrow::Cow<'static, str>,
    pub first_byte_ms: Option<u64>,
    pub total_ms: u64,
    /// From the provider's `usage`, when it said it.
    pub tokens: Option<Tokens>,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub changes: Changes,
    /// The prompt cache, when the request was followed.
    pub cache: Option<CacheSeen>,
    /// The conversation (as the prompt cache follows it), 16 hex digits.
    pub conversation: Option<String>,
    /// The same as a number, as the request's path leaves it (written out
    /// off that path).
    #[serde(skip)]
    pub conversation_id: Option<u64>,
    /// The model's prices per million tokens, when the table has them.
    pub prices: Option<Prices>,
    /// What visor saved it.
    pub saving: Saving,
    /// What the provider billed, in dollars (with prices and usage).
    pub cost: Option<f64>,
    /// Whether the replica that served it keeps its bodies.
    pub bodies_kept: bool,
    /// The inspector's own number for it, on the replica that served it
    /// (ids are the client's and may repeat).
    pub seq: u64,
    /// That replica's process.
    pub instance: u64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct Tokens {
    pub prompt: u64,
    pub cached_read: u64,
    pub cache_written: u64,
    pub completion: u64,
}

/// What visor changed.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
#[serde(default)]
pub struct Changes {
    pub images_replaced: usize,
    /// Of the replaced images, by what became of each.
    pub images_described: usize,
    pub images_stripped: usize,
    pub images_aged_out: usize,
    pub images_capped: usize,
    pub images_deduped: usize,
    /// Kept images scaled or re-encoded to fit the model.
    pub images_resized: usize,
    /// Base64 in a text sent as an image part.
    pub images_hoisted: usize,
    pub media_replaced: usize,
    pub lines_omitted: usize,
    pub items_omitted: usize,
    pub bytes_saved: i64,
    pub history_used: usize,
    pub breakpoints: usize,
    pub prompt_cache_key: bool,
}

impl Changes {
    pub fn any(&self) -> bool {
        *self != Changes::default()
    }

    /// The counts of `report`.
    pub fn of(r: &Report) -> Changes {
        let images = |action: &str| {
            r.images
                .iter()
                .filter(|n| n.medium == "image" && n.action == action)
                .count()
        };
        Changes {
            images_replaced: r.images_replaced,
            images_described: r.images_described,
            images_stripped: images("stripped"),
            images_aged_out: images("aged_out"),
            images_capped: images("capped"),
            images_deduped: images("deduped"),
            images_resized: r.images_resized,
            images_hoisted: r.images_hoisted,
            media_replaced: r.media_replaced,
            lines_omitted: r.lines_omitted,
            items_omitted: r.items_omitted,
            bytes_saved: r.bytes_saved,
            history_used: r.history_used,
            breakpoints: r.breakpoints,
            prompt_cache_key: r.cache_key,
        }
    }
}

/// The prompt cache as judged and settled.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct CacheSeen {
    pub readable: Option<u64>,
    /// `client at message 3`, `expired`…
    pub miss: Option<String>,
}

/// A body held for the inspector until its request ends: as it came
/// (small), or already being stripped of its media on a blocking thread
/// (large: its bytes are let go as soon as that is done, not held while
/// the response streams).
pub enum Held {
    Raw(Bytes),
    /// A body already checked to be JSON.
    Json(Bytes),
    /// A body checked to be JSON whose first bytes are known to hold
    /// nothing to strip, and the flag to set when the rest holds nothing
    /// either ([`Inspector::hold_json_after`]).
    JsonAfter(Bytes, usize, Option<Arc<std::sync::atomic::AtomicBool>>),
    Stripping(tokio::task::JoinHandle<Option<Bytes>>),
}

/// A body up to this size is held as it came.
pub const RAW_MAX: usize = 256 * 1024;

/// Bodies up to this size are copied into a chunk of [`CHUNK`] bytes
/// shared with the bodies held before them on the same thread.
const SMALL: usize = 4 * 1024;
const CHUNK: usize = 64 * 1024;

thread_local! {
    static CHUNKS: std::cell::RefCell<bytes::BytesMut> = std::cell::RefCell::new(bytes::BytesMut::new());
}

/// A copy of `body`. A small one is taken from this thread's current
/// chunk: no allocation of its own, and none for the recording thread to
/// free one by one (a chunk goes once every body in it has; bodies leave
/// the inspector in the order they came, so few chunks live at a time).
fn copy_small(body: &[u8]) -> Bytes {
    if body.len() > SMALL {
        return Bytes::copy_from_slice(body);
    }
    CHUNKS.with(|c| {
        let mut c = c.borrow_mut();
        if c.capacity() - c.len() < body.len() {
            *c = bytes::BytesMut::with_capacity(CHUNK);
        }
        c.extend_from_slice(body);
        c.split().freeze()
    })
}

/// Raw bytes the recording queue may hold in all; past it a record keeps
/// its summary and drops its bodies.
pub const QUEUE_BYTES: usize = 32 * 1024 * 1024;

impl Held {
    fn raw_len(&self) -> usize {
        match self {
            Held::Raw(b) | Held::Json(b) | Held::JsonAfter(b, ..) => b.len(),
            Held::Stripping(_) => 0,
        }
    }
}

/// A held body as kept (not one still being stripped off the worker).
fn strip_held(h: Option<Held>) -> Option<Bytes> {
    match h? {
        Held::Raw(b) => bodies::without_media(&b),
        Held::Json(b) => bodies::without_media_of_json(&b),
        Held::JsonAfter(b, clean, found_clean) => {
            let (kept, whole) = bodies::without_media_of_json_after(&b, clean);
            if let (true, Some(f)) = (whole, found_clean) {
                f.store(true, Ordering::Relaxed);
            }
            kept
        }
        Held::Stripping(_) => None,
    }
}

/// A finished request on its way to the inspector: its summary, and what
/// the detail is read from later.
pub struct Record {
    pub summary: Summary,
    /// Text fields of the summary, passed as they are (shared or static)
    /// and written out on the recording thread.
    pub names: Names,
    /// The body as the client sent it (a transformed endpoint's).
    pub client: Option<Held>,
    /// The body sent upstream, when visor changed it.
    pub upstream: Option<Held>,
    /// What the transforms did.
    pub report: Option<Report>,
}

/// The summary's `id`, `upstream` and `outcome` as the request's path has
/// them: no allocation there, and none freed by another thread.
#[derive(Debug, Default)]
pub struct Names {
    pub id: Option<http::HeaderValue>,
    pub upstream: Option<Arc<str>>,
    pub outcome: Option<&'static str>,
}

impl Names {
    /// Writes them into `s`.
    fn write(self, s: &mut Summary) {
        if let Some(id) = self.id {
            s.id = id.to_str().unwrap_or_default().to_owned();
        }
        if let Some(u) = self.upstream {
            s.upstream = u;
        }
        if let Some(o) = self.outcome {
            s.outcome = o.into();
        }
    }
}

/// The recording queue's length: past it, a record is dropped (counted),
/// never waited for.
pub const QUEUE: usize = 4096;

/// Records that wake the recording thread at once.
pub const BATCH: usize = 256;

/// The longest a record waits for the recording thread.
pub const BATCH_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// Records waiting for the recording thread.
#[derive(Default)]
struct Pending {
    records: Mutex<Vec<Record>>,
    ready: std::sync::Condvar,
}

impl Pending {
    /// `false`: full (the record is let go).
    fn push(&self, r: Record) -> bool {
        let Ok(mut q) = self.records.lock() else {
            return false;
        };
        if q.len() >= QUEUE {
            return false;
        }
        q.push(r);
        if q.len() == BATCH {
            self.ready.notify_one();
        }
        true
    }

    /// The records waiting, once a batch is full or [`BATCH_WAIT`] passed.
    fn next_batch(&self) -> Vec<Record> {
        let Ok(q) = self.records.lock() else {
            std::thread::sleep(BATCH_WAIT);
            return Vec::new();
        };
        let mut q = match self
            .ready
            .wait_timeout_while(q, BATCH_WAIT, |q| q.len() < BATCH)
        {
            Ok((q, _)) => q,
            Err(_) => return Vec::new(),
        };
        std::mem::replace(&mut *q, Vec::with_capacity(BATCH))
    }
}

/// The replicas' list as last read, and when.
type FleetRead = (std::time::Instant, Arc<Vec<Arc<Summary>>>);

/// How long a list read from the replicas' stream is reused.
const FLEET_FRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// The recent requests: this replica's, and with a shared store every
/// replica's summaries.
pub struct Inspector {
    pub enabled: bool,
    keep: usize,
    body_bytes: usize,
    gate: Gate,
    /// This replica's name (`HOSTNAME`, else `local`).
    pub replica: String,
    /// This process, among replicas that may share a name.
    instance: u64,
    /// The `[describer]` model, for `described by …`.
    describer: String,
    next: AtomicU64,
    recent: Mutex<VecDeque<Arc<Summary>>>,
    bodies: Mutex<Bodies>,
    events: broadcast::Sender<Arc<Summary>>,
    /// Records waiting for the recording thread (at most [`QUEUE`]); it
    /// takes them in batches, so a request wakes no thread.
    pending: Arc<Pending>,
    /// Whether the recording thread runs (else records are kept at once).
    threaded: std::sync::atomic::AtomicBool,
    /// Raw body bytes waiting in the queue.
    queued: AtomicUsize,
    /// Records dropped because the queue was full (and the metric).
    pub dropped: AtomicU64,
    dropped_metric: OnceLock<prometheus::IntCounter>,
    /// The store the replicas share (`redis://`), and where summaries go
    /// to it.
    fleet: OnceLock<(Arc<Store>, mpsc::Sender<Arc<Summary>>)>,
    fleet_read: Mutex<Option<FleetRead>>,
    /// The model table, for prices (read off the request's path), and
    /// the prices read so far by model name.
    models: OnceLock<Arc<ModelTable>>,
    prices_seen: Mutex<std::collections::HashMap<String, Option<Prices>>>,
    /// Event streams open now.
    watchers: Arc<AtomicUsize>,
    /// One explain at a time (it reads documents).
    pub explaining: Arc<tokio::sync::Semaphore>,
    /// Failed sign-ins in the current minute: (minute, count).
    failures: Mutex<(u64, u32)>,
}

/// Event streams open at once, at most.
pub const MAX_WATCHERS: usize = 64;

/// Failed sign-ins a minute, at most (then each is refused until the
/// minute ends).
pub const MAX_FAILED_SIGN_INS: u32 = 20;

/// Why a sign-in did not set a cookie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignIn {
    /// Not an admin key.
    Wrong,
    /// Too many wrong keys this minute.
    TooMany,
}

/// An open event stream, counted until it is dropped.
pub struct Watching(Arc<AtomicUsize>);

impl Drop for Watching {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Inspector {
    /// `listen`: where visor listens; `proxy_keys`: whether clients need a
    /// key (then the inspector does too, an admin one).
    pub fn new(
        config: &Config,
        listen: Option<SocketAddr>,
        proxy_keys: bool,
        describer: &str,
    ) -> Self {
        let loopback = listen.is_some_and(|a| a.ip().is_loopback());
        Inspector {
            enabled: config.enabled,
            keep: config.keep,
            body_bytes: config.body_bytes,
            gate: Gate {
                admin_keys: config.admin_keys.clone(),
                open: loopback && !proxy_keys,
            },
            replica: std::env::var("HOSTNAME")
                .ok()
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "local".to_owned()),
            instance: {
                use std::hash::{BuildHasher, Hasher};
                let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                h.write_u128(
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_nanos()),
                );
                h.finish()
            },
            describer: describer.to_owned(),
            next: AtomicU64::new(1),
            recent: Mutex::new(VecDeque::new()),
            bodies: Mutex::new(Bodies::new(config.body_bytes, config.keep)),
            events: broadcast::channel(256).0,
            pending: Arc::new(Pending::default()),
            threaded: std::sync::atomic::AtomicBool::new(false),
            queued: AtomicUsize::new(0),
            dropped: AtomicU64::new(0),
            dropped_metric: OnceLock::new(),
            fleet: OnceLock::new(),
            fleet_read: Mutex::new(None),
            models: OnceLock::new(),
            prices_seen: Mutex::new(std::collections::HashMap::new()),
            watchers: Arc::new(AtomicUsize::new(0)),
            explaining: Arc::new(tokio::sync::Semaphore::new(1)),
            failures: Mutex::new((0, 0)),
        }
    }

    /// Starts the tasks that keep what is recorded (inside a Tokio
    /// runtime): one strips bodies (on blocking threads) and keeps
    /// summaries; with a shared store another appends them to the
    /// replicas' stream (from which the lists then come).
    pub fn start(
        self: &Arc<Self>,
        store: Arc<Store>,
        models: Arc<ModelTable>,
        dropped: prometheus::IntCounter,
    ) {
        if !self.enabled {
            return;
        }
        let _ = self.models.set(models);
        let _ = self.dropped_metric.set(dropped);
        if store.is_shared() {
            let (tx, mut rx) = mpsc::channel::<Arc<Summary>>(QUEUE);
            let keep = self.keep;
            let shared = store.clone();
            // Not tracked tasks: they hold nothing to finish at shutdown.
            tokio::spawn(async move {
                while let Some(s) = rx.recv().await {
                    if let Ok(json) = serde_json::to_vec(&*s) {
                        let _ = shared.publish_summary(json, keep).await;
                    }
                }
            });
            let _ = self.fleet.set((store, tx));
        }
        if self.threaded.swap(true, Ordering::AcqRel) {
            return;
        }
        // A thread of its own: what recording defers never runs on a
        // runtime that serves connections. It wakes when a batch is full
        // or every [`BATCH_WAIT`], whichever comes first.
        let me = Arc::downgrade(self);
        let pending = self.pending.clone();
        let runtime = tokio::runtime::Handle::current();
        let started = std::thread::Builder::new()
            .name("visor-inspector".to_owned())
            .spawn(move || {
                loop {
                    let batch = pending.next_batch();
                    let Some(me) = me.upgrade() else { return };
                    for r in batch {
                        me.take(r, &runtime);
                    }
                }
            });
        if let Err(e) = started {
            self.threaded.store(false, Ordering::Release);
            tracing::warn!(error = %e, "the inspector's thread did not start: requests are kept as they end");
        }
    }

    /// What the recording thread does with one record.
    fn take(&self, r: Record, runtime: &tokio::runtime::Handle) {
        let raw = r.client.as_ref().map_or(0, Held::raw_len)
            + r.upstream.as_ref().map_or(0, Held::raw_len);
        let strip = |h: Option<Held>| match h {
            Some(Held::Stripping(h)) => runtime.block_on(h).ok().flatten(),
            h => strip_held(h),
        };
        let (client, upstream) = (strip(r.client), strip(r.upstream));
        self.queued.fetch_sub(raw, Ordering::Relaxed);
        let mut summary = r.summary;
        r.names.write(&mut summary);
        let s = self.keep_record(summary, client, upstream, r.report);
        if let Some((_, publish)) = self.fleet.get() {
            let _ = publish.try_send(s);
        }
    }

    /// A body to hold for the inspector while its request runs (`None`:
    /// bodies are not kept, or this one is larger than they may be).
    pub fn hold(&self, body: &Bytes) -> Option<Held> {
        self.hold_checked(body, false)
    }

    /// [`Inspector::hold`] of a body already checked to be JSON (a request
    /// the proxy read whole, visor's rewrite of it).
    pub fn hold_json(&self, body: &Bytes) -> Option<Held> {
        self.hold_checked(body, true)
    }

    /// [`Inspector::hold_json`] of a body whose first `clean` bytes are
    /// known to hold nothing to strip (see
    /// [`bodies::without_media_of_json_after`]); `found_clean` is set when
    /// the whole body holds nothing either (a large body's, once read).
    pub fn hold_json_after(
        &self,
        body: &Bytes,
        clean: usize,
        found_clean: Option<Arc<std::sync::atomic::AtomicBool>>,
    ) -> Option<Held> {
        if !self.holds(body) {
            return None;
        }
        if body.len() <= RAW_MAX || tokio::runtime::Handle::try_current().is_err() {
            // Copied, and looked at when recorded (see `hold_checked`).
            return Some(Held::JsonAfter(copy_small(body), clean, found_clean));
        }
        let b = body.clone();
        Some(Held::Stripping(tokio::task::spawn_blocking(move || {
            let (kept, whole) = bodies::without_media_of_json_after(&b, clean);
            if let (true, Some(f)) = (whole, found_clean) {
                f.store(true, Ordering::Relaxed);
            }
            kept
        })))
    }

    /// A body of this size is kept.
    pub fn holds(&self, body: &Bytes) -> bool {
        self.enabled && body.len() <= self.body_bytes.saturating_mul(4) && self.body_bytes != 0
    }

    fn hold_checked(&self, body: &Bytes, json: bool) -> Option<Held> {
        if !self.holds(body) {
            return None;
        }
        if body.len() <= RAW_MAX || tokio::runtime::Handle::try_current().is_err() {
            // Copied: the body may be a slice of the connection's read
            // buffer, which holding would keep from being reused.
            let b = copy_small(body);
            return Some(if json { Held::Json(b) } else { Held::Raw(b) });
        }
        let b = body.clone();
        Some(Held::Stripping(tokio::task::spawn_blocking(
            move || match json {
                true => bodies::without_media_of_json(&b),
                false => bodies::without_media(&b),
            },
        )))
    }

    /// Records a finished request: one short lock and a push (kept at
    /// once when no thread was started).
    pub fn record(&self, mut r: Record) {
        if !self.enabled {
            return;
        }
        if !self.threaded.load(Ordering::Acquire) {
            let (c, u) = (strip_held(r.client), strip_held(r.upstream));
            let mut summary = r.summary;
            r.names.write(&mut summary);
            self.keep_record(summary, c, u, r.report);
            return;
        }
        let mut raw = r.client.as_ref().map_or(0, Held::raw_len)
            + r.upstream.as_ref().map_or(0, Held::raw_len);
        // Counted back when the thread takes it.
        if self.queued.fetch_add(raw, Ordering::Relaxed) + raw > QUEUE_BYTES {
            r.client = None;
            r.upstream = None;
            self.queued.fetch_sub(raw, Ordering::Relaxed);
            raw = 0;
        }
        if !self.pending.push(r) {
            self.queued.fetch_sub(raw, Ordering::Relaxed);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            if let Some(m) = self.dropped_metric.get() {
                m.inc();
            }
        }
    }

    /// What recording leaves to later: the saving, the bodies kept, the
    /// summary kept and sent to whoever watches the events.
    fn keep_record(
        &self,
        mut summary: Summary,
        client: Option<Bytes>,
        upstream: Option<Bytes>,
        report: Option<Report>,
    ) -> Arc<Summary> {
        let report = report.unwrap_or_default();
        if summary.replica.is_empty() {
            summary.replica.clone_from(&self.replica);
        }
        if let Some(c) = summary.conversation_id.take() {
            summary.conversation = Some(format!("{c:016x}"));
        }
        if summary.prices.is_none() {
            summary.prices = self.prices(&summary.model);
        }
        summary.saving = savings::saving(
            &report.images,
            report.bytes_saved_dedup,
            report.breakpoints > 0,
            &summary,
        );
        summary.cost = savings::cost(&summary);
        summary.seq = self.next.fetch_add(1, Ordering::Relaxed);
        summary.instance = self.instance;
        if let Some(c) = client
            && let Ok(mut b) = self.bodies.lock()
        {
            let mut k = Kept::new(c, upstream);
            k.notes = report.images;
            k.history_used = report.history_used;
            k.history_at = report.history_at;
            summary.bodies_kept = b.keep(summary.seq, k);
        }
        let s = Arc::new(summary);
        if let Ok(mut r) = self.recent.lock() {
            if r.len() >= self.keep {
                r.pop_back();
            }
            r.push_front(s.clone());
        }
        let _ = self.events.send(s.clone());
        s
    }

    /// Model `model`'s prices (the table's rows read once per model name).
    fn prices(&self, model: &str) -> Option<Prices> {
        let models = self.models.get()?;
        if let Ok(seen) = self.prices_seen.lock()
            && let Some(p) = seen.get(model)
        {
            return *p;
        }
        let c = models.caps(model);
        let p = c.input.zip(c.output).map(|(input, output)| Prices {
            input,
            cached_input: c.cached_input,
            cache_write: c.cache_write,
            output,
        });
        if let Ok(mut seen) = self.prices_seen.lock() {
            if seen.len() >= 4096 {
                seen.clear();
            }
            seen.insert(model.to_owned(), p);
        }
        p
    }

    /// Whether a request with these headers may read the inspector: open,
    /// or an admin key as a Bearer token or the sign-in cookie.
    pub fn access(&self, headers: &http::HeaderMap, uri: &http::Uri) -> Access {
        self.gate.access(headers, uri, unix_secs())
    }

    /// The sign-in cookie's value for `key`, when it is an admin key and
    /// fewer than [`MAX_FAILED_SIGN_INS`] wrong keys came this minute.
    pub fn sign_in(&self, key: &str) -> Result<String, SignIn> {
        let now = unix_secs();
        let minute = now / 60;
        let mut f = self.failures.lock().map_err(|_| SignIn::TooMany)?;
        if f.0 != minute {
            *f = (minute, 0);
        }
        if f.1 >= MAX_FAILED_SIGN_INS {
            return Err(SignIn::TooMany);
        }
        match self.gate.sign_in(key, now) {
            Some(c) => Ok(c),
            None => {
                f.1 += 1;
                Err(SignIn::Wrong)
            }
        }
    }

    /// A new event stream, when fewer than [`MAX_WATCHERS`] are open.
    pub fn watch(&self) -> Option<Watching> {
        let n = self.watchers.fetch_add(1, Ordering::Relaxed);
        let w = Watching(self.watchers.clone());
        (n < MAX_WATCHERS).then_some(w)
    }

    /// Whether the inspector needs no key here.
    pub fn is_open(&self) -> bool {
        self.gate.open
    }

    /// New summaries as they are kept.
    pub fn events(&self) -> broadcast::Receiver<Arc<Summary>> {
        self.events.subscribe()
    }

    /// The kept summaries, newest first: every replica's through the
    /// shared store (read at most once a second), else (or when it fails)
    /// this replica's. `bool`: the fleet's.
    pub async fn all(&self) -> (Vec<Arc<Summary>>, bool) {
        if let Some((store, _)) = self.fleet.get() {
            let fresh = self.fleet_read.lock().ok().and_then(|r| {
                r.as_ref()
                    .filter(|(at, _)| at.elapsed() < FLEET_FRESH)
                    .map(|(_, l)| l.clone())
            });
            if let Some(list) = fresh {
                return (list.to_vec(), true);
            }
            if let Shared::Done(list) = store.recent_summaries(self.keep).await {
                let list: Vec<Arc<Summary>> = list
                    .iter()
                    .filter_map(|j| serde_json::from_slice::<Summary>(j).ok())
                    .map(Arc::new)
                    .collect();
                if let Ok(mut r) = self.fleet_read.lock() {
                    *r = Some((std::time::Instant::now(), Arc::new(list.clone())));
                }
                return (list, true);
            }
        }
        let list = self
            .recent
            .lock()
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default();
        (list, false)
    }

    /// The kept summaries that pass `filter`, newest first, at most
    /// `filter.limit`; `bool`: every replica's.
    pub async fn requests(&self, filter: &Filter) -> (Vec<Arc<Summary>>, bool) {
        let (all, fleet) = self.all().await;
        let list = all
            .into_iter()
            .filter(|s| filter.passes(s))
            .take(filter.limit)
            .collect();
        (list, fleet)
    }

    /// The summary of request `id`, if it is still kept (by any replica).
    pub async fn request(&self, id: &str) -> Option<Arc<Summary>> {
        let local = self
            .recent
            .lock()
            .ok()
            .and_then(|r| r.iter().find(|s| s.id == id).cloned());
        match local {
            Some(s) => Some(s),
            None => self.all().await.0.into_iter().find(|s| s.id == id),
        }
    }

    /// Request `id`'s messages side by side, when this replica keeps its
    /// bodies.
    pub fn detail(&self, s: &Summary) -> Option<Vec<detail::Pair>> {
        if s.instance != self.instance {
            return None;
        }
        let kept = self.bodies.lock().ok()?.get(s.seq)?;
        let shape = crate::api::Shape::of_path(s.endpoint.strip_prefix("/v1")?)?;
        let client: serde_json::Value = serde_json::from_slice(&kept.client).ok()?;
        let upstream: Option<serde_json::Value> = kept
            .upstream
            .as_ref()
            .and_then(|u| serde_json::from_slice(u).ok());
        Some(detail::pairs(&detail::Sides {
            shape,
            client: &client,
            upstream: upstream.as_ref(),
            notes: &kept.notes,
            history_used: kept.history_used,
            history_at: kept.history_at,
            describer: &self.describer,
        }))
    }

    /// Whether this replica kept request `s` (its bodies may be here).
    pub fn served(&self, s: &Summary) -> bool {
        s.instance == self.instance
    }

    /// Conversation `id`'s requests, oldest first.
    pub async fn conversation(&self, id: &str) -> Vec<Arc<Summary>> {
        let (all, _) = self.all().await;
        let mut list: Vec<_> = all
            .into_iter()
            .filter(|s| s.conversation.as_deref() == Some(id))
            .collect();
        list.reverse();
        list
    }

    /// The savings over the kept window.
    pub async fn savings(&self) -> savings::Savings {
        let (all, _) = self.all().await;
        savings::savings(all.iter().map(|s| &**s))
    }
}

fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;

    #[test]
    fn small_copies_share_chunks_and_never_overlap() {
        // Sizes that fill a chunk unevenly and cross into new ones, and
        // one over the small bound.
        let sources: Vec<Vec<u8>> = (0..400)
            .map(|i| vec![(i % 251) as u8; (i * 37) % 3000 + usize::from(i == 7) * SMALL * 2])
            .collect();
        let copies: Vec<Bytes> = sources.iter().map(|s| copy_small(s)).collect();
        for (s, c) in sources.iter().zip(&copies) {
            assert_eq!(&c[..], &s[..]);
        }
        // Two small ones in a row sit side by side in one chunk.
        let (a, b) = (copy_small(b"first"), copy_small(b"second"));
        assert_eq!(a.as_ptr().wrapping_add(a.len()), b.as_ptr());
    }

    fn summary(id: &str, key: &str, changed: bool) -> Summary {
        Summary {
            id: id.to_owned(),
            key: key.into(),
            model: "m".to_owned(),
            status: 200,
            changes: Changes {
                images_replaced: usize::from(changed),
                ..Changes::default()
            },
            ..Summary::default()
        }
    }

    fn record(s: Summary) -> Record {
        Record {
            summary: s,
            names: Names::default(),
            client: None,
            upstream: None,
            report: None,
        }
    }

    fn inspector(keep: usize, body_bytes: usize, listen: [u8; 4], admin: &[&str]) -> Inspector {
        let config = Config {
            enabled: true,
            keep,
            body_bytes,
            admin_keys: admin.iter().map(|k| Secret::new(*k)).collect(),
        };
        Inspector::new(&config, Some(SocketAddr::from((listen, 8787))), false, "d")
    }

    #[tokio::test]
    async fn keeps_the_newest_first_and_no_more_than_keep() {
        let i = inspector(3, 0, [127, 0, 0, 1], &[]);
        for n in 0..5 {
            i.record(record(summary(&n.to_string(), "a", n % 2 == 0)));
        }
        let ids: Vec<String> = i
            .requests(&Filter::parse(None).unwrap())
            .await
            .0
            .iter()
            .map(|s| s.id.clone())
            .collect();
        assert_eq!(ids, ["4", "3", "2"]);
        assert!(i.request("1").await.is_none() && i.request("3").await.is_some());
        let changed = i
            .requests(&Filter::parse(Some("changed=true&limit=1")).unwrap())
            .await
            .0;
        assert_eq!(changed.len(), 1);
        assert_eq!(changed[0].id, "4");
    }

    #[tokio::test]
    async fn bodies_are_kept_without_media_and_read_side_by_side() {
        let i = inspector(10, 1 << 20, [127, 0, 0, 1], &[]);
        let png = "iVBORw0KGgo".repeat(100);
        let client = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{png}"}}}}]}}]}}"#
        );
        let upstream = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"[image sha256:7ae32ec79dcb: a chart]"}]}]}"#;
        let mut report = Report::default();
        report.images.push(detail::tests_note("described"));
        let mut s = summary("r1", "a", true);
        s.endpoint = "/v1/chat/completions".into();
        i.record(Record {
            summary: s,
            names: Names::default(),
            client: Some(Held::Raw(Bytes::from(client))),
            upstream: Some(Held::Raw(Bytes::from_static(upstream.as_bytes()))),
            report: Some(report),
        });
        let s = i.request("r1").await.unwrap();
        assert!(s.bodies_kept);
        let pairs = i.detail(&s).unwrap();
        assert_eq!(pairs.len(), 1);
        assert!(pairs[0].changed);
        assert_eq!(pairs[0].labels[0].rule, "images");
        let kept = pairs[0].client.as_ref().unwrap().to_string();
        assert!(
            kept.contains("[base64: ") && !kept.contains(&png[..64]),
            "{kept}"
        );
    }

    #[test]
    fn listening_on_every_address_is_not_open() {
        let any = inspector(1, 0, [0, 0, 0, 0], &[]);
        assert!(!any.is_open());
        let uri: http::Uri = "/visor/ui".parse().unwrap();
        assert_eq!(
            any.access(&http::HeaderMap::new(), &uri),
            Access::NotConfigured
        );
        assert!(inspector(1, 0, [127, 0, 0, 1], &[]).is_open());
    }
}
