//! The store: what visor keeps beyond one request — image descriptions,
//! the models learned to refuse images, and sessions' histories — behind one
//! small interface with three backends (`[store] backend`):
//!
//! - `"disk"` (the default): one [redb] file, `<data_dir>/store.redb`.
//!   Every write is a committed, fsynced transaction, so a crash mid-write
//!   leaves the file as it was before that write. One process at a time.
//! - `"redis://host:port/db"` (or `rediss://`): shared by several visor
//!   replicas. Keys start with `[store] prefix`.
//! - `"memory"`: a map in this process, gone at exit (tests, throwaway runs).
//!
//! Descriptions and learned models never fail a user's request (session
//! operations return their error: the caller answers 503 rather than lose
//! a history). Every operation is bounded by
//! [`OP_TIMEOUT`]; one that fails or times out marks the store *down*: a
//! warning is logged once, `visor_store_errors_total{op}` counts it,
//! `visor_store_up` drops to 0 and `/readyz` reports `degraded` with the
//! reason. While down, operations are not attempted (callers carry on with
//! memory only) until [`RETRY_AFTER`] has passed; then the next operation,
//! or a `/readyz` probe, tries again, and the first success brings it back.
//! Meanwhile the server pings it every [`PROBE_EVERY`], so a store that
//! comes back is used again within half a second. A Redis command whose
//! connection failed (a Redis restart) is retried once on a new connection
//! before the store counts as down.

// redb's one error type is large; it lives only on the cold failure path.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use redb::{ReadableTable as _, TableDefinition};
use tokio::time::Instant;

use crate::config::StoreBackend;
use crate::metrics::Metrics;

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

/// Expired descriptions one disk sweep removes at most (a sweep is one
/// operation under [`OP_TIMEOUT`]; the next sweep takes the rest).
const SWEEP_BATCH: usize = 2048;

/// Rows of each table one disk sweep looks at, at most, from where the
/// last sweep stopped.
const SWEEP_SCAN: usize = 16_384;

/// The disk store's file name under `server.data_dir`.
pub const DISK_FILE: &str = "store.redb";

const DESCRIPTIONS: TableDefinition<&str, &str> = TableDefinition::new("descriptions");
/// When each description was written (Unix seconds).
const DESCRIPTION_WRITTEN: TableDefinition<&str, u64> = TableDefinition::new("description_written");
const LEARNED: TableDefinition<&str, &str> = TableDefinition::new("learned_non_vision");
/// A session's messages by (session key, sequence number).
const SESSION_MESSAGES: TableDefinition<(&str, u64), &[u8]> =
    TableDefinition::new("session_messages");
/// A session's next sequence number and when it was last written (Unix
/// seconds).
const SESSION_META: TableDefinition<&str, (u64, u64)> = TableDefinition::new("session_meta");
/// When the store last took a write probe (Unix seconds): a down disk store
/// comes back only once it can be written again.
const HEALTH: TableDefinition<&str, u64> = TableDefinition::new("health");

/// The seconds since the Unix epoch.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Not attempted: the store is down and not due for another try.
    #[error("the store is down: {0}")]
    Down(String),
    #[error("{0}")]
    Failed(String),
}

/// A down store: why, and when to try again.
struct Down {
    reason: String,
    retry_at: Instant,
}

pub struct Store {
    backend: Backend,
    /// What the store is, for logs and `/readyz` (never a password).
    label: String,
    down: Mutex<Option<Down>>,
    metrics: Arc<Metrics>,
}

enum Backend {
    Memory(Memory),
    Disk(Arc<Disk>),
    Redis(Redis),
}

impl Store {
    /// Opens the configured backend. Never fails: a backend that cannot be
    /// reached yet starts down (and is retried), so visor still serves.
    /// Must be called inside a Tokio runtime (the Redis client needs one).
    pub fn open(
        backend: &StoreBackend,
        prefix: &str,
        data_dir: &Path,
        metrics: Arc<Metrics>,
    ) -> Result<Store, String> {
        let (backend, label) = match backend {
            StoreBackend::Memory => (Backend::Memory(Memory::default()), "memory".to_owned()),
            StoreBackend::Disk => {
                let path = data_dir.join(DISK_FILE);
                let label = format!("disk {}", path.display());
                (
                    Backend::Disk(Arc::new(Disk {
                        path,
                        sweep_at: Mutex::new((None, None)),
                        db: Mutex::new(None),
                        writing: Mutex::new(()),
                    })),
                    label,
                )
            }
            StoreBackend::Redis(url) => {
                let redis = Redis::new(url, prefix)?;
                (Backend::Redis(redis), backend.to_string())
            }
        };
        metrics.store_up.set(1);
        Ok(Store {
            backend,
            label,
            down: Mutex::new(None),
            metrics,
        })
    }

    /// A memory store (tests, benches, the CLI).
    pub fn memory(metrics: Arc<Metrics>) -> Store {
        Store {
            backend: Backend::Memory(Memory::default()),
            label: "memory".to_owned(),
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
            .map(|d| format!("store {}: {}", self.label, d.reason))
    }

    /// Checks the store now (the first operation, or a `/readyz` probe
    /// while down and due for a retry). Returns the problem, if any.
    pub async fn check(&self) -> Option<String> {
        // A store that is down must show it can be written again (a disk
        // that is still full reads fine).
        let write = self.problem().is_some();
        let _ = self.guarded("ping", self.ping(write)).await;
        self.problem()
    }

    /// While the store is down: pings it now, whatever the retry time, and
    /// brings it back on success (the server calls this every
    /// [`PROBE_EVERY`], so a store that returns is used again at once
    /// rather than up to [`RETRY_AFTER`] later). A failed probe is not
    /// counted as an error. True when the store came back.
    pub async fn probe_if_down(&self) -> bool {
        // Redis only: the disk store is retried at the normal pace (each
        // try after an I/O error reopens the file, which redb repairs and
        // caches anew — measured: every half second on a full disk, the heap
        // grew by tens of MB).
        if self.problem().is_none() || !matches!(self.backend, Backend::Redis(_)) {
            return false;
        }
        match tokio::time::timeout(OP_TIMEOUT, self.ping(true)).await {
            Ok(Ok(())) => {
                self.mark_up();
                true
            }
            _ => false,
        }
    }

    /// True when several replicas may share this store (Redis).
    pub fn is_shared(&self) -> bool {
        matches!(self.backend, Backend::Redis(_))
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
        let Backend::Redis(r) = &self.backend else {
            return Ok(None);
        };
        let op = async {
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(COUNT_WINDOW)
                .arg(2)
                .arg(r.key("limit:", requests_key))
                .arg(r.key("limit:", tokens_key))
                .arg(requests)
                .arg(tokens)
                .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
            r.query::<(u64, u64)>(&mut cmd).await
        };
        self.guarded("put", op).await.map(Some)
    }

    /// Takes `tokens` back off a window's counter [`Store::count_window`]
    /// added them to (a request refused for them); a counter that is gone
    /// stays gone. `Ok(false)` without a shared store.
    pub async fn uncount_window(&self, tokens_key: &str, tokens: u64) -> Result<bool, StoreError> {
        let Backend::Redis(r) = &self.backend else {
            return Ok(false);
        };
        let op = async {
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(UNCOUNT_WINDOW)
                .arg(1)
                .arg(r.key("limit:", tokens_key))
                .arg(tokens);
            r.query::<i64>(&mut cmd).await
        };
        self.guarded("put", op).await.map(|_| true)
    }

    /// Whether `name` (normalised) is learned as non-vision in the store.
    pub async fn is_learned(&self, name: &str) -> Result<bool, StoreError> {
        let op = async {
            match &self.backend {
                Backend::Memory(m) => Ok(m.learned.lock().is_ok_and(|l| l.contains(name))),
                Backend::Disk(d) => {
                    let name = name.to_owned();
                    d.run(move |db| {
                        let txn = db.begin_read()?;
                        Ok(txn.open_table(LEARNED)?.get(name.as_str())?.is_some())
                    })
                    .await
                }
                Backend::Redis(r) => {
                    r.query(redis::cmd("SISMEMBER").arg(r.key("learned", "")).arg(name))
                        .await
                }
            }
        };
        self.guarded("get", op).await
    }

    /// The description stored under `key`.
    pub async fn description(&self, key: &str) -> Result<Option<String>, StoreError> {
        let op = async {
            match &self.backend {
                Backend::Memory(m) => Ok(m
                    .descriptions
                    .lock()
                    .ok()
                    .and_then(|d| d.map.get(key).cloned())),
                Backend::Disk(d) => {
                    let key = key.to_owned();
                    d.run(move |db| {
                        let txn = db.begin_read()?;
                        let table = txn.open_table(DESCRIPTIONS)?;
                        Ok(table.get(key.as_str())?.map(|v| v.value().to_owned()))
                    })
                    .await
                }
                Backend::Redis(r) => r.query(redis::cmd("GET").arg(r.key("desc:", key))).await,
            }
        };
        self.guarded("get", op).await
    }

    pub async fn put_description(&self, key: &str, text: &str) -> Result<(), StoreError> {
        let op = async {
            match &self.backend {
                Backend::Memory(m) => {
                    if let Ok(mut d) = m.descriptions.lock() {
                        d.insert(key, text);
                    }
                    Ok(())
                }
                Backend::Disk(d) => {
                    let (key, text) = (key.to_owned(), text.to_owned());
                    d.run_write(move |db| {
                        let txn = db.begin_write()?;
                        txn.open_table(DESCRIPTIONS)?
                            .insert(key.as_str(), text.as_str())?;
                        txn.open_table(DESCRIPTION_WRITTEN)?
                            .insert(key.as_str(), unix_now())?;
                        txn.commit()?;
                        Ok(())
                    })
                    .await
                }
                Backend::Redis(r) => {
                    r.query(
                        redis::cmd("SET")
                            .arg(r.key("desc:", key))
                            .arg(text)
                            .arg("EX")
                            .arg(DESCRIPTION_TTL.as_secs()),
                    )
                    .await
                }
            }
        };
        self.guarded("put", op).await
    }

    /// Every model name learned as non-vision.
    pub async fn learned(&self) -> Result<Vec<String>, StoreError> {
        let op = async {
            match &self.backend {
                Backend::Memory(m) => Ok(m
                    .learned
                    .lock()
                    .map(|l| l.iter().cloned().collect())
                    .unwrap_or_default()),
                Backend::Disk(d) => {
                    d.run(|db| {
                        let txn = db.begin_read()?;
                        let table = txn.open_table(LEARNED)?;
                        let mut names = Vec::new();
                        for row in table.iter()? {
                            names.push(row?.0.value().to_owned());
                        }
                        Ok(names)
                    })
                    .await
                }
                Backend::Redis(r) => {
                    r.query(redis::cmd("SMEMBERS").arg(r.key("learned", "")))
                        .await
                }
            }
        };
        self.guarded("list", op).await
    }

    /// Records `name` (normalised) as a model that refuses images.
    pub async fn learn(&self, name: &str) -> Result<(), StoreError> {
        let op = async {
            match &self.backend {
                Backend::Memory(m) => {
                    if let Ok(mut l) = m.learned.lock() {
                        l.insert(name.to_owned());
                    }
                    Ok(())
                }
                Backend::Disk(d) => {
                    let name = name.to_owned();
                    d.run_write(move |db| {
                        let txn = db.begin_write()?;
                        txn.open_table(LEARNED)?
                            .insert(name.as_str(), "vision=false")?;
                        txn.commit()?;
                        Ok(())
                    })
                    .await
                }
                Backend::Redis(r) => r
                    .query::<i64>(redis::cmd("SADD").arg(r.key("learned", "")).arg(name))
                    .await
                    .map(drop),
            }
        };
        self.guarded("put", op).await
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
        let op = async {
            match &self.backend {
                Backend::Memory(m) => {
                    let Ok(mut sessions) = m.sessions.lock() else {
                        return Err("store lock poisoned".to_owned());
                    };
                    match sessions.get(key) {
                        Some(s) if s.touched.elapsed() > ttl => {
                            sessions.remove(key);
                            Ok(None)
                        }
                        Some(s) => {
                            let skip = s.messages.len().saturating_sub(newest);
                            Ok(Some(s.messages.iter().skip(skip).cloned().collect()))
                        }
                        None => Ok(None),
                    }
                }
                Backend::Disk(d) => {
                    let key = key.to_owned();
                    d.run(move |db| {
                        let txn = db.begin_read()?;
                        let Some((next, touched)) = txn
                            .open_table(SESSION_META)?
                            .get(key.as_str())?
                            .map(|v| v.value())
                        else {
                            return Ok(None);
                        };
                        if unix_now().saturating_sub(touched) > ttl.as_secs() {
                            return Ok(None);
                        }
                        let table = txn.open_table(SESSION_MESSAGES)?;
                        let from = next.saturating_sub(newest as u64);
                        let mut out = Vec::new();
                        for row in table.range((key.as_str(), from)..(key.as_str(), next))? {
                            out.push(Bytes::copy_from_slice(row?.1.value()));
                        }
                        Ok(Some(out))
                    })
                    .await
                }
                Backend::Redis(r) => {
                    let k = r.key("session:", key);
                    let newest = i64::try_from(newest).unwrap_or(i64::MAX);
                    let (exists, items): (bool, Vec<Vec<u8>>) = r
                        .pipe(
                            redis::pipe()
                                .cmd("EXISTS")
                                .arg(&k)
                                .cmd("LRANGE")
                                .arg(&k)
                                .arg(-newest)
                                .arg(-1),
                        )
                        .await?;
                    Ok(exists.then(|| items.into_iter().map(Bytes::from).collect()))
                }
            }
        };
        self.guarded_needed("get", op).await
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
        let op = async {
            match &self.backend {
                Backend::Memory(m) => {
                    let Ok(mut sessions) = m.sessions.lock() else {
                        return Err("store lock poisoned".to_owned());
                    };
                    let s = sessions
                        .entry(key.to_owned())
                        .or_insert_with(|| MemSession {
                            messages: std::collections::VecDeque::new(),
                            touched: std::time::Instant::now(),
                        });
                    if s.touched.elapsed() > ttl {
                        s.messages.clear();
                    }
                    s.messages.extend(messages);
                    while s.messages.len() > keep {
                        s.messages.pop_front();
                    }
                    s.touched = std::time::Instant::now();
                    Ok(())
                }
                Backend::Disk(d) => {
                    let key = key.to_owned();
                    d.run_write(move |db| {
                        let now = unix_now();
                        let txn = db.begin_write()?;
                        {
                            let mut meta = txn.open_table(SESSION_META)?;
                            let mut table = txn.open_table(SESSION_MESSAGES)?;
                            let (mut next, touched) = meta
                                .get(key.as_str())?
                                .map(|v| v.value())
                                .unwrap_or((0, now));
                            // An expired session starts again, empty.
                            let mut first = if now.saturating_sub(touched) > ttl.as_secs() {
                                next
                            } else {
                                0
                            };
                            for m in &messages {
                                table.insert((key.as_str(), next), m.as_ref())?;
                                next += 1;
                            }
                            first = first.max(next.saturating_sub(keep as u64));
                            table.retain_in((key.as_str(), 0)..(key.as_str(), first), |_, _| {
                                false
                            })?;
                            meta.insert(key.as_str(), (next, now))?;
                        }
                        txn.commit()?;
                        Ok(())
                    })
                    .await
                }
                Backend::Redis(r) => {
                    let k = r.key("session:", key);
                    let keep = i64::try_from(keep).unwrap_or(i64::MAX);
                    let mut pipe = redis::pipe();
                    pipe.atomic().cmd("RPUSH").arg(&k);
                    for m in &messages {
                        pipe.arg(m.as_ref());
                    }
                    pipe.ignore()
                        .cmd("LTRIM")
                        .arg(&k)
                        .arg(-keep)
                        .arg(-1)
                        .ignore()
                        .cmd("EXPIRE")
                        .arg(&k)
                        .arg(ttl.as_secs().max(1))
                        .ignore();
                    r.pipe::<()>(&pipe).await
                }
            }
        };
        self.guarded_needed("put", op).await
    }

    /// Forgets session `key`; true when there was one.
    pub async fn delete_session(&self, key: &str, ttl: Duration) -> Result<bool, StoreError> {
        let op = async {
            match &self.backend {
                Backend::Memory(m) => {
                    let Ok(mut sessions) = m.sessions.lock() else {
                        return Err("store lock poisoned".to_owned());
                    };
                    Ok(sessions
                        .remove(key)
                        .is_some_and(|s| s.touched.elapsed() <= ttl))
                }
                Backend::Disk(d) => {
                    let key = key.to_owned();
                    d.run_write(move |db| {
                        let txn = db.begin_write()?;
                        let existed;
                        {
                            let mut meta = txn.open_table(SESSION_META)?;
                            let mut table = txn.open_table(SESSION_MESSAGES)?;
                            let was = meta.remove(key.as_str())?.map(|v| v.value());
                            existed = was.is_some_and(|(_, touched)| {
                                unix_now().saturating_sub(touched) <= ttl.as_secs()
                            });
                            table.retain_in(
                                (key.as_str(), 0)..=(key.as_str(), u64::MAX),
                                |_, _| false,
                            )?;
                        }
                        txn.commit()?;
                        Ok(existed)
                    })
                    .await
                }
                Backend::Redis(r) => r
                    .query::<i64>(redis::cmd("DEL").arg(r.key("session:", key)))
                    .await
                    .map(|n| n > 0),
            }
        };
        self.guarded_needed("put", op).await
    }

    /// Forgets every session idle longer than `ttl`; how many went. Redis
    /// expires its own (a no-op there).
    pub async fn sweep_sessions(&self, ttl: Duration) -> Result<usize, StoreError> {
        let op = async {
            match &self.backend {
                Backend::Memory(m) => {
                    let Ok(mut sessions) = m.sessions.lock() else {
                        return Err("store lock poisoned".to_owned());
                    };
                    let before = sessions.len();
                    sessions.retain(|_, s| s.touched.elapsed() <= ttl);
                    Ok(before - sessions.len())
                }
                Backend::Disk(d) => {
                    d.run_write(move |db| {
                        let now = unix_now();
                        let expired: Vec<String> = {
                            let txn = db.begin_read()?;
                            let meta = txn.open_table(SESSION_META)?;
                            let mut out = Vec::new();
                            for row in meta.iter()? {
                                let (k, v) = row?;
                                if now.saturating_sub(v.value().1) > ttl.as_secs() {
                                    out.push(k.value().to_owned());
                                }
                            }
                            out
                        };
                        if expired.is_empty() {
                            return Ok(0);
                        }
                        let txn = db.begin_write()?;
                        let mut gone = 0;
                        {
                            let mut meta = txn.open_table(SESSION_META)?;
                            let mut table = txn.open_table(SESSION_MESSAGES)?;
                            for key in &expired {
                                // Touched again since the read: kept.
                                let still = meta
                                    .get(key.as_str())?
                                    .map(|v| v.value())
                                    .is_some_and(|(_, t)| now.saturating_sub(t) > ttl.as_secs());
                                if !still {
                                    continue;
                                }
                                meta.remove(key.as_str())?;
                                table.retain_in(
                                    (key.as_str(), 0)..=(key.as_str(), u64::MAX),
                                    |_, _| false,
                                )?;
                                gone += 1;
                            }
                        }
                        txn.commit()?;
                        Ok(gone)
                    })
                    .await
                }
                Backend::Redis(_) => Ok(0),
            }
        };
        self.guarded("put", op).await
    }

    /// Forgets descriptions written `ttl` or more ago (at most
    /// [`SWEEP_BATCH`] a call); how many went. A description from a file
    /// older than the write times is dated now (it expires a `ttl` later).
    /// Redis expires its own; the memory store is bounded by size.
    pub async fn sweep_descriptions(&self, ttl: Duration) -> Result<usize, StoreError> {
        let Backend::Disk(d) = &self.backend else {
            return Ok(0);
        };
        // Each sweep looks at a bounded stretch of each table, from where
        // the last one stopped, so a large store is swept over several
        // rounds, each well inside the operation's timeout.
        let (from_written, from_undated) = d.sweep_at.lock().map(|c| c.clone()).unwrap_or_default();
        let op = d.run_write(move |db| {
            let now = unix_now();
            let due = |t: u64| now.saturating_sub(t) >= ttl.as_secs();
            let (expired, undated, next) = {
                let txn = db.begin_read()?;
                let written = txn.open_table(DESCRIPTION_WRITTEN)?;
                let mut expired = Vec::new();
                let mut seen = 0;
                let mut last = None;
                for row in written.range(from_written.as_deref().unwrap_or("")..)? {
                    let (k, v) = row?;
                    seen += 1;
                    last = Some(k.value().to_owned());
                    if due(v.value()) {
                        expired.push(k.value().to_owned());
                    }
                    if seen == SWEEP_SCAN || expired.len() == SWEEP_BATCH {
                        break;
                    }
                }
                let next_written = (seen == SWEEP_SCAN || expired.len() == SWEEP_BATCH)
                    .then_some(last)
                    .flatten();
                let descriptions = txn.open_table(DESCRIPTIONS)?;
                let mut undated = Vec::new();
                let mut seen = 0;
                let mut last = None;
                for row in descriptions.range(from_undated.as_deref().unwrap_or("")..)? {
                    let (k, _) = row?;
                    seen += 1;
                    last = Some(k.value().to_owned());
                    if written.get(k.value())?.is_none() {
                        undated.push(k.value().to_owned());
                    }
                    if seen == SWEEP_SCAN || undated.len() == SWEEP_BATCH {
                        break;
                    }
                }
                let next_undated = (seen == SWEEP_SCAN || undated.len() == SWEEP_BATCH)
                    .then_some(last)
                    .flatten();
                (expired, undated, (next_written, next_undated))
            };
            if expired.is_empty() && undated.is_empty() {
                return Ok((0, next));
            }
            let txn = db.begin_write()?;
            let mut gone = 0;
            {
                let mut written = txn.open_table(DESCRIPTION_WRITTEN)?;
                let mut descriptions = txn.open_table(DESCRIPTIONS)?;
                for key in &expired {
                    // Written again since the read: kept.
                    let still = written.get(key.as_str())?.is_some_and(|t| due(t.value()));
                    if still {
                        written.remove(key.as_str())?;
                        descriptions.remove(key.as_str())?;
                        gone += 1;
                    }
                }
                for key in &undated {
                    if written.get(key.as_str())?.is_none() {
                        written.insert(key.as_str(), now)?;
                    }
                }
            }
            txn.commit()?;
            Ok((gone, next))
        });
        let (gone, next) = self.guarded("put", op).await?;
        if let Ok(mut at) = d.sweep_at.lock() {
            *at = next;
        }
        Ok(gone)
    }

    /// Asks the store whether it answers; `write`: whether it takes a write
    /// (the disk store commits a one-row transaction).
    async fn ping(&self, write: bool) -> Result<(), String> {
        match &self.backend {
            Backend::Memory(_) => Ok(()),
            Backend::Disk(d) if write => {
                d.run_write(|db| {
                    let txn = db.begin_write()?;
                    txn.open_table(HEALTH)?.insert("written", unix_now())?;
                    txn.commit()?;
                    Ok(())
                })
                .await
            }
            Backend::Disk(d) => d.run(|_| Ok(())).await,
            Backend::Redis(r) => r.query::<String>(&mut redis::cmd("PING")).await.map(drop),
        }
    }

    /// Runs one operation under the timeout and the down/up bookkeeping.
    async fn guarded<T>(
        &self,
        op: &'static str,
        f: impl Future<Output = Result<T, String>>,
    ) -> Result<T, StoreError> {
        if let Ok(down) = self.down.lock()
            && let Some(d) = down.as_ref()
            && Instant::now() < d.retry_at
        {
            return Err(StoreError::Down(d.reason.clone()));
        }
        self.attempt(op, f).await
    }

    /// [`Store::guarded`] for an operation a request fails without (a
    /// session's history): while Redis is marked down it is tried anyway
    /// rather than at the next retry time — one restarted on its port
    /// answers the first request after it on a new connection, instead of
    /// a 503 until the next probe.
    async fn guarded_needed<T>(
        &self,
        op: &'static str,
        f: impl Future<Output = Result<T, String>>,
    ) -> Result<T, StoreError> {
        if matches!(self.backend, Backend::Redis(_)) {
            return self.attempt(op, f).await;
        }
        self.guarded(op, f).await
    }

    /// Runs `f` within [`OP_TIMEOUT`], marking the store up or down by its
    /// result.
    async fn attempt<T>(
        &self,
        op: &'static str,
        f: impl Future<Output = Result<T, String>>,
    ) -> Result<T, StoreError> {
        let result = match tokio::time::timeout(OP_TIMEOUT, f).await {
            Ok(r) => r,
            Err(_) => Err(format!("no answer within {} ms", OP_TIMEOUT.as_millis())),
        };
        match result {
            Ok(v) => {
                // A disk store that went down (a full disk) is back only
                // when a write succeeds: reads work on a full disk.
                let read = matches!(op, "get" | "list");
                if !(read && matches!(self.backend, Backend::Disk(_))) {
                    self.mark_up();
                }
                Ok(v)
            }
            Err(reason) => {
                self.mark_down(op, &reason);
                Err(StoreError::Failed(reason))
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

    fn mark_down(&self, op: &'static str, reason: &str) {
        self.metrics.store_errors.with_label_values(&[op]).inc();
        let Ok(mut down) = self.down.lock() else {
            return;
        };
        let was_up = down.is_none();
        *down = Some(Down {
            reason: reason.to_owned(),
            retry_at: Instant::now() + RETRY_AFTER,
        });
        self.metrics.store_up.set(0);
        if self.is_shared() {
            self.metrics.ratelimit_shared.set(0);
        }
        if was_up {
            tracing::warn!(store = %self.label, op, error = %reason,
                "store unavailable: going on with memory only (requests are not failed); retrying every {} s",
                RETRY_AFTER.as_secs());
        } else {
            tracing::debug!(store = %self.label, op, error = %reason, "store still unavailable");
        }
    }
}

#[derive(Default)]
struct Memory {
    descriptions: Mutex<Texts>,
    learned: Mutex<BTreeSet<String>>,
    sessions: Mutex<HashMap<String, MemSession>>,
}

/// The memory backend's descriptions and document texts, at most
/// [`MEMORY_TEXT_BYTES`] (a client sending ever new documents must not grow
/// the process without end): past it, entries are dropped — any, it is a
/// cache — until a quarter is free.
#[derive(Default)]
struct Texts {
    map: HashMap<String, String>,
    bytes: usize,
}

/// What the memory backend keeps of descriptions and document texts.
const MEMORY_TEXT_BYTES: usize = 64 << 20;

/// The disk backend's page cache (redb's default is 1 GiB).
const DISK_CACHE_BYTES: usize = 32 << 20;

impl Texts {
    fn insert(&mut self, key: &str, text: &str) {
        let size = |k: &str, v: &str| k.len() + v.len();
        if let Some(old) = self.map.remove(key) {
            self.bytes -= size(key, &old);
        }
        let add = size(key, text);
        if add > MEMORY_TEXT_BYTES / 4 {
            return;
        }
        if self.bytes + add > MEMORY_TEXT_BYTES {
            let keep = MEMORY_TEXT_BYTES / 4 * 3 - add;
            let drop: Vec<String> = self
                .map
                .iter()
                .scan(self.bytes, |total, (k, v)| {
                    let over = *total > keep;
                    *total -= size(k, v);
                    Some((over, k))
                })
                .take_while(|(over, _)| *over)
                .map(|(_, k)| k.clone())
                .collect();
            for k in drop {
                if let Some(v) = self.map.remove(&k) {
                    self.bytes -= size(&k, &v);
                }
            }
        }
        self.bytes += add;
        self.map.insert(key.to_owned(), text.to_owned());
    }
}

struct MemSession {
    messages: std::collections::VecDeque<Bytes>,
    touched: std::time::Instant,
}

struct Disk {
    path: PathBuf,
    /// Where the next description sweep goes on in each table (written
    /// times, descriptions); `None`: from the start.
    sweep_at: Mutex<(Option<String>, Option<String>)>,
    /// Opened on first use, and again after a failed open, an I/O error, or
    /// when the file was deleted or replaced under it; with the file's
    /// identity (device, inode) when it was opened.
    db: Mutex<Option<(Arc<redb::Database>, Option<FileId>)>>,
    /// Held by each write from its handle to its commit. redb asserts (a
    /// panic) when a commit follows another commit's I/O error on the same
    /// handle; with one writer at a time, the failed one drops the handle
    /// before the next writer takes one (and opens the file again).
    writing: Mutex<()>,
}

/// A file's (device, inode).
type FileId = (u64, u64);

/// A file's (device, inode), where the platform has them.
fn file_id(path: &Path) -> Option<FileId> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
    }
    #[cfg(not(unix))]
    {
        std::fs::metadata(path).ok().map(|_| (0, 0))
    }
}

impl Disk {
    /// Runs `f` on the blocking pool (redb is synchronous; a commit waits
    /// for fsync).
    async fn run<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&redb::Database) -> Result<T, redb::Error> + Send + 'static,
    ) -> Result<T, String> {
        self.run_as(false, f).await
    }

    /// [`Disk::run`] for an operation that commits: one at a time.
    async fn run_write<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&redb::Database) -> Result<T, redb::Error> + Send + 'static,
    ) -> Result<T, String> {
        self.run_as(true, f).await
    }

    async fn run_as<T: Send + 'static>(
        self: &Arc<Self>,
        write: bool,
        f: impl FnOnce(&redb::Database) -> Result<T, redb::Error> + Send + 'static,
    ) -> Result<T, String> {
        let me = self.clone();
        let after_panic = self.clone();
        tokio::task::spawn_blocking(move || {
            let _one = match write {
                true => Some(
                    me.writing
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner),
                ),
                false => None,
            };
            let db = me.database()?;
            f(&db).map_err(|e| {
                // After an I/O error (a full disk) redb refuses everything
                // until the file is closed and opened again: drop this
                // handle, so the next operation reopens it.
                if matches!(
                    e,
                    redb::Error::Io(_) | redb::Error::PreviousIo | redb::Error::Corrupted(_)
                ) {
                    drop(db);
                    me.forget();
                }
                e.to_string()
            })
        })
        .await
        .map_err(|_| {
            // A panic in redb leaves its handle unusable: open it again.
            after_panic.forget();
            "the store task failed".to_owned()
        })?
    }

    fn database(&self) -> Result<Arc<redb::Database>, String> {
        let mut slot = self
            .db
            .lock()
            .map_err(|_| "store lock poisoned".to_owned())?;
        if let Some((db, id)) = slot.as_ref() {
            let now = file_id(&self.path);
            if now == *id {
                return Ok(db.clone());
            }
            // Deleted (or replaced) while visor ran: what it held is gone
            // with the old file. Say so, and start a new file next time.
            *slot = None;
            tracing::error!(
                path = %self.path.display(),
                "the store file was deleted or replaced while visor ran: what it held is lost; a new file is made"
            );
            return Err(format!(
                "{} was deleted or replaced while visor ran (what it held is lost); a new file is made",
                self.path.display()
            ));
        }
        let db = self.create().map_err(|e| match e {
            redb::Error::DatabaseAlreadyOpen => format!(
                "{} is in use by another process (another visor on the same data_dir?)",
                self.path.display()
            ),
            e => format!("cannot open {}: {e}", self.path.display()),
        })?;
        let db = Arc::new(db);
        *slot = Some((db.clone(), file_id(&self.path)));
        Ok(db)
    }

    /// Drops the open handle (the file is opened again on next use).
    fn forget(&self) {
        if let Ok(mut slot) = self.db.lock() {
            *slot = None;
        }
    }

    fn create(&self) -> Result<redb::Database, redb::Error> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(redb::Error::Io)?;
        }
        // redb caches up to 1 GiB of pages by default: a store of
        // document texts would hold that much of the process's memory.
        let db = redb::Builder::new()
            .set_cache_size(DISK_CACHE_BYTES)
            .create(&self.path)?;
        // The tables exist from the start, so a read never meets a missing one.
        let txn = db.begin_write()?;
        txn.open_table(DESCRIPTIONS)?;
        txn.open_table(DESCRIPTION_WRITTEN)?;
        txn.open_table(LEARNED)?;
        txn.open_table(SESSION_MESSAGES)?;
        txn.open_table(SESSION_META)?;
        txn.commit()?;
        Ok(db)
    }
}

/// Adds ARGV[1] to KEYS[1] and ARGV[2] to KEYS[2], each expiring ARGV[3]
/// ms after it was created; returns both values.
const COUNT_WINDOW: &str = "local r = redis.call('INCRBY', KEYS[1], ARGV[1]) \
if r == tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end \
local t = redis.call('INCRBY', KEYS[2], ARGV[2]) \
if t == tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end \
return {r, t}";

const UNCOUNT_WINDOW: &str = "if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end \
local t = redis.call('DECRBY', KEYS[1], ARGV[1]) \
if t < 0 then redis.call('INCRBY', KEYS[1], -t) return 0 end \
return t";

struct Redis {
    conn: redis::aio::ConnectionManager,
    prefix: String,
}

impl Redis {
    fn new(url: &str, prefix: &str) -> Result<Redis, String> {
        let client = redis::Client::open(url)
            .map_err(|e| format!("store.backend: not a usable Redis URL: {e}"))?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(OP_TIMEOUT))
            .set_response_timeout(Some(OP_TIMEOUT))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn = redis::aio::ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|e| format!("store.backend: cannot set up the Redis client: {e}"))?;
        Ok(Redis {
            conn,
            prefix: prefix.to_owned(),
        })
    }

    fn key(&self, kind: &str, key: &str) -> String {
        format!("{}{kind}{key}", self.prefix)
    }

    /// Runs `cmd`; a connection-level failure (the connection died with a
    /// Redis restart, or the last reconnect failed while Redis was down) is
    /// retried once, on the connection the manager makes anew, before the
    /// store counts as down.
    async fn query<T: redis::FromRedisValue>(&self, cmd: &mut redis::Cmd) -> Result<T, String> {
        let mut conn = self.conn.clone();
        match cmd.query_async(&mut conn).await {
            Err(e) if connection_failed(&e) => {
                cmd.query_async(&mut conn).await.map_err(|e| e.to_string())
            }
            r => r.map_err(|e| e.to_string()),
        }
    }

    async fn pipe<T: redis::FromRedisValue>(&self, pipe: &redis::Pipeline) -> Result<T, String> {
        let mut conn = self.conn.clone();
        match pipe.query_async(&mut conn).await {
            Err(e) if connection_failed(&e) => {
                pipe.query_async(&mut conn).await.map_err(|e| e.to_string())
            }
            r => r.map_err(|e| e.to_string()),
        }
    }
}

/// A failure of the connection rather than of the command: worth one more
/// try on a new connection. Reads and the idempotent writes (SET, SADD,
/// DEL) are safe to repeat. A session append (one MULTI/EXEC) that died
/// after Redis ran it but before its answer came back could be applied
/// twice; the same holds for a client that retries a cut response, and a
/// turn lost is worse than a turn doubled.
fn connection_failed(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
}

#[cfg(test)]
mod tests {

    #![allow(clippy::unwrap_used)]
    use super::*;
    use redb::ReadableTableMetadata as _;
    #[test]
    fn memory_texts_stay_under_their_bound() {
        let mut t = Texts::default();
        let text = "x".repeat(1 << 20);
        for i in 0..200 {
            t.insert(&format!("document/{i}"), &text);
            assert!(t.bytes <= MEMORY_TEXT_BYTES, "{i}: {}", t.bytes);
        }
        let counted: usize = t.map.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert_eq!(counted, t.bytes);
        assert!(t.map.contains_key("document/199"), "the newest is kept");
        assert!(t.map.len() >= 40, "{}", t.map.len());
        // Replacing an entry counts it once.
        t.insert("document/199", "short");
        let counted: usize = t.map.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert_eq!(counted, t.bytes);
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

    #[tokio::test]
    async fn disk_store_keeps_what_it_was_given_across_reopen() {
        let dir = std::env::temp_dir().join(format!("visor-store-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let metrics = Arc::new(Metrics::new().unwrap());
        {
            let s = Store::open(&StoreBackend::Disk, "visor:", &dir, metrics.clone()).unwrap();
            assert_eq!(s.description("k").await.unwrap(), None);
            s.put_description("k", "a chart").await.unwrap();
            s.learn("gpt-oss").await.unwrap();
        }
        let s = Store::open(&StoreBackend::Disk, "visor:", &dir, metrics).unwrap();
        assert_eq!(
            s.description("k").await.unwrap().as_deref(),
            Some("a chart")
        );
        assert_eq!(s.learned().await.unwrap(), vec!["gpt-oss".to_owned()]);
        assert!(s.problem().is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn disk_descriptions_expire_and_older_files_get_dated() {
        let dir = std::env::temp_dir().join(format!("visor-store-ttl-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let metrics = Arc::new(Metrics::new().unwrap());
        let s = Store::open(&StoreBackend::Disk, "visor:", &dir, metrics).unwrap();
        s.put_description("new", "a chart").await.unwrap();
        // A row from a file written before descriptions were dated.
        let Backend::Disk(d) = &s.backend else {
            unreachable!()
        };
        d.run_write(|db| {
            let txn = db.begin_write()?;
            txn.open_table(DESCRIPTIONS)?.insert("old", "a diagram")?;
            txn.commit()?;
            Ok(())
        })
        .await
        .unwrap();
        // Within the TTL nothing goes; the undated row is dated now.
        assert_eq!(s.sweep_descriptions(DESCRIPTION_TTL).await.unwrap(), 0);
        assert_eq!(
            s.description("new").await.unwrap().as_deref(),
            Some("a chart")
        );
        assert_eq!(
            s.description("old").await.unwrap().as_deref(),
            Some("a diagram")
        );
        let dated = d
            .run(|db| {
                let txn = db.begin_read()?;
                Ok(txn.open_table(DESCRIPTION_WRITTEN)?.len()?)
            })
            .await
            .unwrap();
        assert_eq!(dated, 2);
        // Past it (a TTL of zero: everything written is due) both go.
        assert_eq!(s.sweep_descriptions(Duration::ZERO).await.unwrap(), 2);
        assert_eq!(s.description("new").await.unwrap(), None);
        assert_eq!(s.description("old").await.unwrap(), None);
        assert_eq!(s.sweep_descriptions(Duration::ZERO).await.unwrap(), 0);

        // Many rows: swept over several rounds, each bounded, none left.
        d.run_write(|db| {
            let txn = db.begin_write()?;
            {
                let mut t = txn.open_table(DESCRIPTIONS)?;
                let mut w = txn.open_table(DESCRIPTION_WRITTEN)?;
                for i in 0..5000 {
                    let k = format!("k{i:05}");
                    t.insert(k.as_str(), "text")?;
                    w.insert(k.as_str(), 0)?;
                }
            }
            txn.commit()?;
            Ok(())
        })
        .await
        .unwrap();
        let mut rounds = Vec::new();
        for _ in 0..10 {
            match s.sweep_descriptions(DESCRIPTION_TTL).await.unwrap() {
                0 => break,
                n => rounds.push(n),
            }
        }
        assert_eq!(rounds, [SWEEP_BATCH, SWEEP_BATCH, 5000 - 2 * SWEEP_BATCH]);
        let left = d
            .run(|db| Ok(db.begin_read()?.open_table(DESCRIPTIONS)?.len()?))
            .await
            .unwrap();
        assert_eq!(left, 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_disk_store_in_use_is_down_not_fatal() {
        let dir = std::env::temp_dir().join(format!("visor-store-busy-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let metrics = Arc::new(Metrics::new().unwrap());
        let first = Store::open(&StoreBackend::Disk, "visor:", &dir, metrics.clone()).unwrap();
        first.put_description("k", "v").await.unwrap();
        let second = Store::open(&StoreBackend::Disk, "visor:", &dir, metrics.clone()).unwrap();
        assert!(matches!(
            second.description("k").await,
            Err(StoreError::Failed(_))
        ));
        let problem = second.problem().unwrap();
        assert!(problem.contains("in use by another process"), "{problem}");
        assert_eq!(metrics.store_up.get(), 0);
        // While down, nothing is attempted until the retry is due.
        assert!(matches!(
            second.description("k").await,
            Err(StoreError::Down(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
