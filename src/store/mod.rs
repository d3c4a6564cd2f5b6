//! The store: what visor keeps beyond one request — image descriptions,
//! the models learned to refuse images, and sessions' histories — behind one
//! small interface ([`Backend`]) with three backends (`[store] backend`),
//! one file each:
//!
//! - `"disk"` (the default, [`disk`]): one [redb] file,
//!   `<data_dir>/store.redb`. Every write is a committed, fsynced
//!   transaction, so a crash mid-write leaves the file as it was before that
//!   write. One process at a time.
//! - `"redis://host:port/db"` (or `rediss://`, [`redis`], with the `redis`
//!   feature): shared by several visor replicas. Keys start with
//!   `[store] prefix`.
//! - `"memory"` ([`memory`]): a map in this process, gone at exit (tests,
//!   throwaway runs).
//!
//! [`Store`] is the one the rest of visor holds; it applies the timeout and
//! the down/up bookkeeping to every operation of every backend, once.
//! Descriptions and learned models never fail a user's request (session
//! operations return their error: the caller answers 503 rather than lose
//! a history). Every operation is bounded by
//! [`OP_TIMEOUT`]; one that fails or times out marks the store *down*: a
//! warning is logged once, `visor_store_errors_total{op}` counts it,
//! `visor_store_up` drops to 0 and `/readyz` reports `degraded` with the
//! reason. While down, operations are not attempted ([`StoreError::Down`]:
//! callers carry on with memory only) until [`RETRY_AFTER`] has passed; then
//! the next operation, or a `/readyz` probe, tries again, and the first
//! success brings it back. Meanwhile the server pings a shared store every
//! [`PROBE_EVERY`], so one that comes back is used again within half a
//! second.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::config::StoreBackend;
use crate::metrics::Metrics;

mod disk;
mod error;
mod memory;
#[cfg(feature = "redis")]
mod redis;

pub use disk::DISK_FILE;
pub use error::StoreError;

/// How long one store operation may take before the store counts as down.
pub const OP_TIMEOUT: Duration = Duration::from_secs(1);

/// While the store is down, how long requests go without asking it again.
pub const RETRY_AFTER: Duration = Duration::from_secs(5);

/// While the store is down, how often the server pings it in the background
/// ([`Store::probe_if_down`]).
pub const PROBE_EVERY: Duration = Duration::from_millis(500);

/// Descriptions (and document texts) expire this long after they were
/// written, so a store does not grow without bound; an expired one is made
/// again. Redis expires its own; the disk store's are swept
/// ([`Store::sweep_descriptions`]).
pub const DESCRIPTION_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// The seconds since the Unix epoch.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One backend operation, to be run (nothing happens until it is polled:
/// the store may decide not to attempt it).
type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// How a backend differs in how the store treats it.
#[derive(Debug, Clone, Copy, Default)]
struct Traits {
    /// Several replicas may share it (Redis): rate limits are counted in it.
    shared: bool,
    /// While down, pinged in the background every [`PROBE_EVERY`] (Redis;
    /// the disk store is retried at the normal pace: each try after an I/O
    /// error reopens the file, which redb repairs and caches anew —
    /// measured: every half second on a full disk, the heap grew by tens of
    /// MB).
    probed_while_down: bool,
    /// While down, an operation a request fails without (a session's
    /// history) is tried anyway rather than at the next retry time (Redis:
    /// one restarted on its port answers the first request after it on a new
    /// connection, instead of a 503 until the next probe).
    needed_tried_while_down: bool,
    /// Down until a write succeeds; a read that succeeds does not bring it
    /// back (disk: a full disk still reads).
    up_only_on_write: bool,
}

/// What every backend does. The [`Store`] adds the timeout and the down/up
/// bookkeeping; a backend only answers.
trait Backend: Send + Sync {
    fn traits(&self) -> Traits {
        Traits::default()
    }

    /// Whether it answers; `write`: whether it takes a write (the disk
    /// store commits a one-row transaction).
    fn ping(&self, write: bool) -> StoreFuture<'_, ()>;

    fn is_learned<'a>(&'a self, name: &'a str) -> StoreFuture<'a, bool>;

    fn learned(&self) -> StoreFuture<'_, Vec<String>>;

    fn learn<'a>(&'a self, name: &'a str) -> StoreFuture<'a, ()>;

    fn description<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Option<String>>;

    fn put_description<'a>(&'a self, key: &'a str, text: &'a str) -> StoreFuture<'a, ()>;

    fn session<'a>(
        &'a self,
        key: &'a str,
        newest: usize,
        ttl: Duration,
    ) -> StoreFuture<'a, Option<Vec<Bytes>>>;

    fn append_session<'a>(
        &'a self,
        key: &'a str,
        messages: Vec<Bytes>,
        keep: usize,
        ttl: Duration,
    ) -> StoreFuture<'a, ()>;

    fn delete_session<'a>(&'a self, key: &'a str, ttl: Duration) -> StoreFuture<'a, bool>;

    /// `None`: it expires sessions itself (Redis).
    fn sweep_sessions(&self, ttl: Duration) -> Option<StoreFuture<'_, usize>>;

    /// `None`: nothing to sweep (Redis expires its own; the memory store is
    /// bounded by size).
    fn sweep_descriptions(&self, _ttl: Duration) -> Option<StoreFuture<'_, usize>> {
        None
    }

    /// `None`: not shared, rate limits are counted in this process.
    fn count_window<'a>(
        &'a self,
        _requests_key: &'a str,
        _requests: u64,
        _tokens_key: &'a str,
        _tokens: u64,
        _ttl: Duration,
    ) -> Option<StoreFuture<'a, (u64, u64)>> {
        None
    }

    /// `None`: not shared (a conversation's last request is kept in the
    /// process). Otherwise what `key` holds.
    fn record<'a>(&'a self, _key: &'a str) -> Option<StoreFuture<'a, Option<Vec<u8>>>> {
        None
    }

    /// `None`: not shared. Otherwise sets `key` to `value`, expiring after
    /// `ttl`.
    fn put_record<'a>(
        &'a self,
        _key: &'a str,
        _value: Vec<u8>,
        _ttl: Duration,
    ) -> Option<StoreFuture<'a, ()>> {
        None
    }

    /// `None`: not shared. Otherwise appends `entry` to the inspector's
    /// stream of request summaries, trimmed to about `keep` entries.
    fn publish_summary<'a>(&'a self, _entry: Vec<u8>, _keep: usize) -> Option<StoreFuture<'a, ()>> {
        None
    }

    /// `None`: not shared. Otherwise the newest `n` entries of the
    /// inspector's stream, newest first.
    fn recent_summaries(&self, _n: usize) -> Option<StoreFuture<'_, Vec<Vec<u8>>>> {
        None
    }

    /// `None`: not shared.
    fn uncount_window<'a>(
        &'a self,
        _tokens_key: &'a str,
        _tokens: u64,
    ) -> Option<StoreFuture<'a, ()>> {
        None
    }
}

/// What an operation does, for the `op` label of
/// `visor_store_errors_total` and for whether its success shows a store
/// that is down is back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    Get,
    List,
    Put,
    Ping,
}

impl Access {
    fn label(self) -> &'static str {
        match self {
            Access::Get => "get",
            Access::List => "list",
            Access::Put => "put",
            Access::Ping => "ping",
        }
    }

    fn is_read(self) -> bool {
        matches!(self, Access::Get | Access::List)
    }
}

/// What an operation only a shared store does came to.
#[derive(Debug, PartialEq, Eq)]
pub enum Shared<T> {
    /// The store is not shared: the process keeps its own.
    NotShared,
    /// The store failed (counted and logged as any store failure).
    Failed,
    Done(T),
}

/// A down store: what took it down, and when to try again.
struct Down {
    cause: StoreError,
    retry_at: Instant,
}

pub struct Store {
    backend: Box<dyn Backend>,
    traits: Traits,
    /// What the store is, for logs and `/readyz` (never a password).
    label: String,
    down: Mutex<Option<Down>>,
    metrics: Arc<Metrics>,
}

impl Store {
    /// Opens the configured backend. Never fails on a store that cannot be
    /// reached: one that cannot be reached yet starts down (and is
    /// retried), so visor still serves. Fails on a Redis URL the client does
    /// not take, or one given to a build without the `redis` feature. Must
    /// be called inside a Tokio runtime (the Redis client needs one).
    pub fn open(
        backend: &StoreBackend,
        prefix: &str,
        data_dir: &Path,
        metrics: Arc<Metrics>,
    ) -> Result<Store, String> {
        let (opened, label): (Box<dyn Backend>, String) = match backend {
            StoreBackend::Memory => (Box::new(memory::Memory::default()), "memory".to_owned()),
            StoreBackend::Disk => {
                let disk = disk::Disk::new(data_dir.join(DISK_FILE));
                let label = disk.label();
                (Box::new(disk), label)
            }
            StoreBackend::Redis(url) => (open_redis(url, prefix)?, backend.to_string()),
        };
        metrics.store_up.set(1);
        Ok(Store::new(opened, label, metrics))
    }

    /// A memory store (tests, benches, the CLI).
    pub fn memory(metrics: Arc<Metrics>) -> Store {
        Store::new(
            Box::new(memory::Memory::default()),
            "memory".to_owned(),
            metrics,
        )
    }

    fn new(backend: Box<dyn Backend>, label: String, metrics: Arc<Metrics>) -> Store {
        Store {
            traits: backend.traits(),
            backend,
            label,
            down: Mutex::new(None),
            metrics,
        }
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    /// Why the store is down, while it is.
    pub fn problem(&self) -> Option<String> {
        let down = self.down.lock().ok()?;
        down.as_ref()
            .map(|d| format!("store {}: {}", self.label, d.cause))
    }

    /// Checks the store now (the first operation, or a `/readyz` probe
    /// while down and due for a retry). Returns the problem, if any.
    pub async fn check(&self) -> Option<String> {
        // A store that is down must show it can be written again (a disk
        // that is still full reads fine).
        let write = self.problem().is_some();
        let _ = self.guarded(Access::Ping, self.backend.ping(write)).await;
        self.problem()
    }

    /// While the store is down: pings it now, whatever the retry time, and
    /// brings it back on success (the server calls this every
    /// [`PROBE_EVERY`], so a store that returns is used again at once
    /// rather than up to [`RETRY_AFTER`] later). A failed probe is not
    /// counted as an error. True when the store came back. Only for a
    /// backend probed while down (Redis).
    pub async fn probe_if_down(&self) -> bool {
        if self.problem().is_none() || !self.traits.probed_while_down {
            return false;
        }
        match tokio::time::timeout(OP_TIMEOUT, self.backend.ping(true)).await {
            Ok(Ok(())) => {
                self.mark_up();
                true
            }
            _ => false,
        }
    }

    /// True when several replicas may share this store (Redis).
    pub fn is_shared(&self) -> bool {
        self.traits.shared
    }

    /// Adds `requests` and `tokens` to two counters of a rate-limit window
    /// shared by every replica (Redis; one round trip: a script that adds
    /// to both and sets their expiry when it creates them). Returns their
    /// new values. `Ok(None)` when the store is not shared.
    pub async fn count_window(
        &self,
        requests_key: &str,
        requests: u64,
        tokens_key: &str,
        tokens: u64,
        ttl: Duration,
    ) -> Result<Option<(u64, u64)>, StoreError> {
        let Some(op) = self
            .backend
            .count_window(requests_key, requests, tokens_key, tokens, ttl)
        else {
            return Ok(None);
        };
        self.guarded(Access::Put, op).await.map(Some)
    }

    /// Takes `tokens` back off a window's counter [`Store::count_window`]
    /// added them to (a request refused for them); a counter that is gone
    /// stays gone. `Ok(false)` without a shared store.
    pub async fn uncount_window(&self, tokens_key: &str, tokens: u64) -> Result<bool, StoreError> {
        let Some(op) = self.backend.uncount_window(tokens_key, tokens) else {
            return Ok(false);
        };
        self.guarded(Access::Put, op).await.map(|()| true)
    }

    /// Conversation `key`'s last request, as kept by [`Store::put_record`]
    /// on a shared store, so replicas follow one conversation
    /// ([`Shared`]).
    pub async fn record(&self, key: &str) -> Shared<Option<Vec<u8>>> {
        let Some(op) = self.backend.record(key) else {
            return Shared::NotShared;
        };
        match self.guarded(Access::Get, op).await {
            Ok(v) => Shared::Done(v),
            Err(_) => Shared::Failed,
        }
    }

    /// Keeps `value` as conversation `key`'s last request (for `ttl`).
    pub async fn put_record(&self, key: &str, value: Vec<u8>, ttl: Duration) -> Shared<()> {
        let Some(op) = self.backend.put_record(key, value, ttl) else {
            return Shared::NotShared;
        };
        match self.guarded(Access::Put, op).await {
            Ok(()) => Shared::Done(()),
            Err(_) => Shared::Failed,
        }
    }

    /// Appends a request summary to the replicas' shared stream (the
    /// inspector's fleet view).
    pub async fn publish_summary(&self, entry: Vec<u8>, keep: usize) -> Shared<()> {
        let Some(op) = self.backend.publish_summary(entry, keep) else {
            return Shared::NotShared;
        };
        match self.guarded(Access::Put, op).await {
            Ok(()) => Shared::Done(()),
            Err(_) => Shared::Failed,
        }
    }

    /// The newest `n` summaries of every replica, newest first.
    pub async fn recent_summaries(&self, n: usize) -> Shared<Vec<Vec<u8>>> {
        let Some(op) = self.backend.recent_summaries(n) else {
            return Shared::NotShared;
        };
        match self.guarded(Access::Get, op).await {
            Ok(v) => Shared::Done(v),
            Err(_) => Shared::Failed,
        }
    }

    /// Whether `name` (normalised) is learned as non-vision in the store.
    pub async fn is_learned(&self, name: &str) -> Result<bool, StoreError> {
        self.guarded(Access::Get, self.backend.is_learned(name))
            .await
    }

    /// The description stored under `key`.
    pub async fn description(&self, key: &str) -> Result<Option<String>, StoreError> {
        self.guarded(Access::Get, self.backend.description(key))
            .await
    }

    pub async fn put_description(&self, key: &str, text: &str) -> Result<(), StoreError> {
        self.guarded(Access::Put, self.backend.put_description(key, text))
            .await
    }

    /// Every model name learned as non-vision.
    pub async fn learned(&self) -> Result<Vec<String>, StoreError> {
        self.guarded(Access::List, self.backend.learned()).await
    }

    /// Records `name` (normalised) as a model that refuses images.
    pub async fn learn(&self, name: &str) -> Result<(), StoreError> {
        self.guarded(Access::Put, self.backend.learn(name)).await
    }

    /// The newest `newest` messages of session `key`, oldest first; `None`
    /// when the session is unknown (never written, deleted, or idle longer
    /// than `ttl`).
    pub async fn session(
        &self,
        key: &str,
        newest: usize,
        ttl: Duration,
    ) -> Result<Option<Vec<Bytes>>, StoreError> {
        self.guarded_needed(Access::Get, self.backend.session(key, newest, ttl))
            .await
    }

    /// Appends `messages` to session `key` in one atomic step (no other
    /// append lands between them), keeps its newest `keep`, and restarts
    /// its idle clock (`ttl`).
    pub async fn append_session(
        &self,
        key: &str,
        messages: Vec<Bytes>,
        keep: usize,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let op = self.backend.append_session(key, messages, keep, ttl);
        self.guarded_needed(Access::Put, op).await
    }

    /// Forgets session `key`; true when there was one.
    pub async fn delete_session(&self, key: &str, ttl: Duration) -> Result<bool, StoreError> {
        self.guarded_needed(Access::Put, self.backend.delete_session(key, ttl))
            .await
    }

    /// Forgets every session idle longer than `ttl`; how many went. Redis
    /// expires its own (a no-op there).
    pub async fn sweep_sessions(&self, ttl: Duration) -> Result<usize, StoreError> {
        let Some(op) = self.backend.sweep_sessions(ttl) else {
            return Ok(0);
        };
        self.guarded(Access::Put, op).await
    }

    /// Forgets descriptions written `ttl` or more ago (at most a bounded
    /// batch a call); how many went. A description from a file older than
    /// the write times is dated now (it expires a `ttl` later). Redis
    /// expires its own; the memory store is bounded by size.
    pub async fn sweep_descriptions(&self, ttl: Duration) -> Result<usize, StoreError> {
        let Some(op) = self.backend.sweep_descriptions(ttl) else {
            return Ok(0);
        };
        self.guarded(Access::Put, op).await
    }

    /// Runs one operation under the timeout and the down/up bookkeeping;
    /// while the store is down and not due for a retry, not at all.
    async fn guarded<T>(&self, access: Access, op: StoreFuture<'_, T>) -> Result<T, StoreError> {
        if let Ok(down) = self.down.lock()
            && let Some(d) = down.as_ref()
            && Instant::now() < d.retry_at
        {
            return Err(StoreError::Down(Box::new(d.cause.clone())));
        }
        self.attempt(access, op).await
    }

    /// [`Store::guarded`] for an operation a request fails without (a
    /// session's history): tried even while down by a backend that says so
    /// ([`Traits::needed_tried_while_down`]).
    async fn guarded_needed<T>(
        &self,
        access: Access,
        op: StoreFuture<'_, T>,
    ) -> Result<T, StoreError> {
        if self.traits.needed_tried_while_down {
            return self.attempt(access, op).await;
        }
        self.guarded(access, op).await
    }

    /// Runs `op` within [`OP_TIMEOUT`], marking the store up or down by its
    /// result.
    async fn attempt<T>(&self, access: Access, op: StoreFuture<'_, T>) -> Result<T, StoreError> {
        let result = match tokio::time::timeout(OP_TIMEOUT, op).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::TimedOut(OP_TIMEOUT)),
        };
        match result {
            Ok(v) => {
                if !(access.is_read() && self.traits.up_only_on_write) {
                    self.mark_up();
                }
                Ok(v)
            }
            Err(e) => {
                self.mark_down(access, &e);
                Err(e)
            }
        }
    }

    fn mark_up(&self) {
        let Ok(mut down) = self.down.lock() else {
            return;
        };
        if down.take().is_some() {
            self.metrics.store_up.set(1);
            // Rate limits are shared again (the gauge follows the store, not
            // only the next key's check).
            if self.is_shared() {
                self.metrics.ratelimit_shared.set(1);
            }
            tracing::warn!(store = %self.label, "store is back: descriptions and learned models are stored again");
        }
    }

    fn mark_down(&self, access: Access, cause: &StoreError) {
        let op = access.label();
        self.metrics.store_errors.with_label_values(&[op]).inc();
        let Ok(mut down) = self.down.lock() else {
            return;
        };
        let was_up = down.is_none();
        *down = Some(Down {
            cause: cause.clone(),
            retry_at: Instant::now() + RETRY_AFTER,
        });
        self.metrics.store_up.set(0);
        if self.is_shared() {
            self.metrics.ratelimit_shared.set(0);
        }
        if was_up {
            tracing::warn!(store = %self.label, op, error = %cause,
                "store unavailable: going on with memory only (requests are not failed); retrying every {} s",
                RETRY_AFTER.as_secs());
        } else {
            tracing::debug!(store = %self.label, op, error = %cause, "store still unavailable");
        }
    }
}

#[cfg(feature = "redis")]
fn open_redis(url: &str, prefix: &str) -> Result<Box<dyn Backend>, String> {
    Ok(Box::new(redis::Redis::new(url, prefix)?))
}

/// A build without the `redis` feature: a `redis://` store is refused at
/// startup (the config check refuses it first).
#[cfg(not(feature = "redis"))]
fn open_redis(_url: &str, _prefix: &str) -> Result<Box<dyn Backend>, String> {
    Err(NO_REDIS.to_owned())
}

/// Why a `redis://` store cannot be opened by a build without the `redis`
/// feature.
#[cfg(not(feature = "redis"))]
const NO_REDIS: &str = "store.backend: this build of visor has no Redis support (it was built without the `redis` feature); use \"disk\" or \"memory\", or a build with default features";

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};

    use super::*;

    /// What a [`Scripted`] backend does next.
    #[derive(Default)]
    struct Script {
        calls: AtomicUsize,
        fail: AtomicBool,
        hang: AtomicBool,
    }

    /// A backend that answers as its script says, and counts the
    /// operations it was asked to run.
    struct Scripted {
        script: Arc<Script>,
        traits: Traits,
    }

    impl Scripted {
        fn answer<'a, T: Send + 'a>(&'a self, v: T) -> StoreFuture<'a, T> {
            Box::pin(async move {
                self.script.calls.fetch_add(1, SeqCst);
                if self.script.hang.load(SeqCst) {
                    std::future::pending::<()>().await;
                }
                if self.script.fail.load(SeqCst) {
                    let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
                    return Err(StoreError::Unreachable(Arc::new(refused)));
                }
                Ok(v)
            })
        }
    }

    impl Backend for Scripted {
        fn traits(&self) -> Traits {
            self.traits
        }
        fn ping(&self, _write: bool) -> StoreFuture<'_, ()> {
            self.answer(())
        }
        fn is_learned<'a>(&'a self, _: &'a str) -> StoreFuture<'a, bool> {
            self.answer(false)
        }
        fn learned(&self) -> StoreFuture<'_, Vec<String>> {
            self.answer(Vec::new())
        }
        fn learn<'a>(&'a self, _: &'a str) -> StoreFuture<'a, ()> {
            self.answer(())
        }
        fn description<'a>(&'a self, _: &'a str) -> StoreFuture<'a, Option<String>> {
            self.answer(Some("a chart".to_owned()))
        }
        fn put_description<'a>(&'a self, _: &'a str, _: &'a str) -> StoreFuture<'a, ()> {
            self.answer(())
        }
        fn session<'a>(
            &'a self,
            _: &'a str,
            _: usize,
            _: Duration,
        ) -> StoreFuture<'a, Option<Vec<Bytes>>> {
            self.answer(None)
        }
        fn append_session<'a>(
            &'a self,
            _: &'a str,
            _: Vec<Bytes>,
            _: usize,
            _: Duration,
        ) -> StoreFuture<'a, ()> {
            self.answer(())
        }
        fn delete_session<'a>(&'a self, _: &'a str, _: Duration) -> StoreFuture<'a, bool> {
            self.answer(false)
        }
        fn sweep_sessions(&self, _: Duration) -> Option<StoreFuture<'_, usize>> {
            Some(self.answer(0))
        }
    }

    fn scripted(traits: Traits) -> (Store, Arc<Script>, Arc<Metrics>) {
        let script = Arc::new(Script::default());
        let metrics = Arc::new(Metrics::new().unwrap());
        let backend = Scripted {
            script: script.clone(),
            traits,
        };
        let store = Store::new(Box::new(backend), "scripted".to_owned(), metrics.clone());
        (store, script, metrics)
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_takes_the_store_down_and_a_down_store_is_not_asked() {
        let (s, script, metrics) = scripted(Traits::default());
        script.fail.store(true, SeqCst);
        let e = s.description("k").await.unwrap_err();
        assert!(matches!(e, StoreError::Unreachable(_)), "{e:?}");
        assert_eq!(script.calls.load(SeqCst), 1);
        let problem = s.problem().unwrap();
        assert_eq!(problem, format!("store scripted: {e}"));
        assert_eq!(metrics.store_up.get(), 0);
        assert_eq!(metrics.store_errors.with_label_values(&["get"]).get(), 1);

        // Down and not due for a retry: not asked, and the error says why.
        let Err(StoreError::Down(cause)) = s.put_description("k", "v").await else {
            panic!("a down store was asked");
        };
        assert!(matches!(*cause, StoreError::Unreachable(_)), "{cause:?}");
        assert_eq!(
            StoreError::Down(cause).to_string(),
            format!("the store is down: {e}")
        );
        assert!(matches!(
            s.session("k", 10, RETRY_AFTER).await,
            Err(StoreError::Down(_))
        ));
        assert_eq!(script.calls.load(SeqCst), 1);
        assert_eq!(metrics.store_errors.with_label_values(&["put"]).get(), 0);

        // Due again: asked, and a success brings it back.
        script.fail.store(false, SeqCst);
        tokio::time::advance(RETRY_AFTER).await;
        assert_eq!(
            s.description("k").await.unwrap().as_deref(),
            Some("a chart")
        );
        assert_eq!(script.calls.load(SeqCst), 2);
        assert_eq!(s.problem(), None);
        assert_eq!(metrics.store_up.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn an_operation_without_an_answer_times_out_and_takes_the_store_down() {
        let (s, script, _) = scripted(Traits::default());
        script.hang.store(true, SeqCst);
        let e = s.learn("m").await.unwrap_err();
        assert!(matches!(e, StoreError::TimedOut(OP_TIMEOUT)), "{e:?}");
        assert_eq!(e.to_string(), "no answer within 1000 ms");
        assert_eq!(
            s.problem().as_deref(),
            Some("store scripted: no answer within 1000 ms")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_backend_tried_while_down_is_asked_for_what_a_request_needs() {
        let traits = Traits {
            needed_tried_while_down: true,
            ..Traits::default()
        };
        let (s, script, _) = scripted(traits);
        script.fail.store(true, SeqCst);
        assert!(s.description("k").await.is_err());
        script.fail.store(false, SeqCst);
        // Descriptions wait for the retry time; a session's history does not.
        assert!(matches!(s.description("k").await, Err(StoreError::Down(_))));
        assert_eq!(s.session("k", 10, RETRY_AFTER).await.unwrap(), None);
        assert_eq!(script.calls.load(SeqCst), 2);
        assert_eq!(s.problem(), None, "its success brought the store back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_up_only_on_write_is_not_brought_back_by_a_read() {
        let traits = Traits {
            up_only_on_write: true,
            ..Traits::default()
        };
        let (s, script, _) = scripted(traits);
        script.fail.store(true, SeqCst);
        assert!(s.put_description("k", "v").await.is_err());
        script.fail.store(false, SeqCst);
        tokio::time::advance(RETRY_AFTER).await;
        assert!(s.description("k").await.is_ok());
        assert!(
            s.problem().is_some(),
            "a read does not show it takes writes"
        );
        // `/readyz` while down pings with a write.
        assert_eq!(s.check().await, None);
    }

    #[tokio::test(start_paused = true)]
    async fn what_a_backend_lacks_is_answered_without_asking_it() {
        let (s, script, _) = scripted(Traits::default());
        script.fail.store(true, SeqCst);
        assert!(s.learned().await.is_err());
        // Down, yet these answer: the backend has no such operation.
        assert_eq!(
            s.count_window("r", 1, "t", 1, RETRY_AFTER).await.unwrap(),
            None
        );
        assert!(!s.uncount_window("t", 1).await.unwrap());
        assert_eq!(s.sweep_descriptions(RETRY_AFTER).await.unwrap(), 0);
        assert!(!s.probe_if_down().await, "only a probed backend is probed");
        assert_eq!(script.calls.load(SeqCst), 1);
        assert!(!s.is_shared());
    }

    #[test]
    fn redis_urls_lose_their_password_in_labels() {
        let label = |url: &str| StoreBackend::Redis(url.to_owned()).to_string();
        assert_eq!(
            label("redis://:s3cret@cache:6379/0"),
            "redis://…@cache:6379/0"
        );
        assert_eq!(label("redis://cache:6379/2"), "redis://cache:6379/2");
    }

    /// A build without the `redis` feature refuses a Redis store: the
    /// config check says so, and so does opening one.
    #[cfg(not(feature = "redis"))]
    #[tokio::test]
    async fn a_build_without_redis_refuses_a_redis_store() {
        let toml = "[[upstream]]\nname = \"u\"\nbase_url = \"http://127.0.0.1:9/v1\"\n\
                    [store]\nbackend = \"redis://:pw@cache:6379/0\"\n";
        let e = crate::config::Config::from_toml(toml, Path::new("t.toml"), &|_| None)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("this build of visor has no Redis support"),
            "{e}"
        );
        assert!(!e.contains("pw"), "{e}");
        let backend = StoreBackend::Redis("redis://cache:6379/0".to_owned());
        let metrics = Arc::new(Metrics::new().unwrap());
        let Err(e) = Store::open(&backend, "visor:", Path::new("."), metrics) else {
            panic!("a Redis store opened without Redis support");
        };
        assert_eq!(e, NO_REDIS);
    }
}
