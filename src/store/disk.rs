//! The disk backend (`store.backend = "disk"`, the default): one [redb]
//! file, `<data_dir>/store.redb`. Every write is a committed, fsynced
//! transaction, so a crash mid-write leaves the file as it was before that
//! write. One process at a time. redb is synchronous: each operation runs
//! on the blocking pool.

#![expect(
    clippy::result_large_err,
    reason = "redb's one error type is large; it lives only on the cold failure path, and becomes a StoreError there"
)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use redb::{ReadableTable as _, TableDefinition};

use super::{Backend, StoreError, StoreFuture, Traits, unix_now};

/// The disk store's file name under `server.data_dir`.
pub const DISK_FILE: &str = "store.redb";

/// Expired descriptions one disk sweep removes at most (a sweep is one
/// operation under [`super::OP_TIMEOUT`]; the next sweep takes the rest).
const SWEEP_BATCH: usize = 2048;

/// Rows of each table one disk sweep looks at, at most, from where the
/// last sweep stopped.
const SWEEP_SCAN: usize = 16_384;

/// The disk backend's page cache (redb's default is 1 GiB: a store of
/// document texts would hold that much of the process's memory).
const DISK_CACHE_BYTES: usize = 32 << 20;

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

/// Where the next description sweep goes on in each table (written times,
/// descriptions); `None`: from the start.
type Cursor = (Option<String>, Option<String>);

pub(super) struct Disk {
    file: Arc<DbFile>,
    sweep_at: Mutex<Cursor>,
}

impl Disk {
    pub(super) fn new(path: PathBuf) -> Disk {
        Disk {
            file: Arc::new(DbFile {
                path,
                db: Mutex::new(None),
                writing: Mutex::new(()),
            }),
            sweep_at: Mutex::new((None, None)),
        }
    }

    /// What it is, for logs and `/readyz`.
    pub(super) fn label(&self) -> String {
        format!("disk {}", self.file.path.display())
    }
}

/// The store's file and its open handle.
struct DbFile {
    path: PathBuf,
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

/// A redb error as the kind of failure it is.
fn failure(e: redb::Error) -> StoreError {
    match e {
        redb::Error::Io(_) | redb::Error::PreviousIo => StoreError::Io(Arc::new(e)),
        redb::Error::Corrupted(_) => StoreError::Corrupt(Arc::new(e)),
        e => StoreError::Database(Arc::new(e)),
    }
}

impl DbFile {
    /// Runs `f` on the blocking pool (redb is synchronous; a commit waits
    /// for fsync).
    async fn run<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&redb::Database) -> Result<T, redb::Error> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.run_as(false, f).await
    }

    /// [`DbFile::run`] for an operation that commits: one at a time.
    async fn run_write<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&redb::Database) -> Result<T, redb::Error> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.run_as(true, f).await
    }

    async fn run_as<T: Send + 'static>(
        self: &Arc<Self>,
        write: bool,
        f: impl FnOnce(&redb::Database) -> Result<T, redb::Error> + Send + 'static,
    ) -> Result<T, StoreError> {
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
                let e = failure(e);
                // After an I/O error (a full disk) redb refuses everything
                // until the file is closed and opened again: drop this
                // handle, so the next operation reopens it.
                if matches!(e, StoreError::Io(_) | StoreError::Corrupt(_)) {
                    drop(db);
                    me.forget();
                }
                e
            })
        })
        .await
        .map_err(|e| {
            // A panic in redb leaves its handle unusable: open it again.
            after_panic.forget();
            StoreError::TaskFailed(Arc::new(e))
        })?
    }

    fn database(&self) -> Result<Arc<redb::Database>, StoreError> {
        let mut slot = self.db.lock().map_err(|_| StoreError::Poisoned)?;
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
            return Err(StoreError::Replaced(self.path.clone()));
        }
        let db = self.create().map_err(|e| match e {
            redb::Error::DatabaseAlreadyOpen => StoreError::InUse(self.path.clone()),
            e => StoreError::Open {
                path: self.path.clone(),
                source: Arc::new(e),
            },
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

impl Backend for Disk {
    fn traits(&self) -> Traits {
        Traits {
            up_only_on_write: true,
            ..Traits::default()
        }
    }

    fn ping(&self, write: bool) -> StoreFuture<'_, ()> {
        if !write {
            return Box::pin(self.file.run(|_| Ok(())));
        }
        Box::pin(self.file.run_write(|db| {
            let txn = db.begin_write()?;
            txn.open_table(HEALTH)?.insert("written", unix_now())?;
            txn.commit()?;
            Ok(())
        }))
    }

    fn is_learned<'a>(&'a self, name: &'a str) -> StoreFuture<'a, bool> {
        let name = name.to_owned();
        Box::pin(self.file.run(move |db| {
            let txn = db.begin_read()?;
            Ok(txn.open_table(LEARNED)?.get(name.as_str())?.is_some())
        }))
    }

    fn learned(&self) -> StoreFuture<'_, Vec<String>> {
        Box::pin(self.file.run(|db| {
            let txn = db.begin_read()?;
            let table = txn.open_table(LEARNED)?;
            let mut names = Vec::new();
            for row in table.iter()? {
                names.push(row?.0.value().to_owned());
            }
            Ok(names)
        }))
    }

    fn learn<'a>(&'a self, name: &'a str) -> StoreFuture<'a, ()> {
        let name = name.to_owned();
        Box::pin(self.file.run_write(move |db| {
            let txn = db.begin_write()?;
            txn.open_table(LEARNED)?
                .insert(name.as_str(), "vision=false")?;
            txn.commit()?;
            Ok(())
        }))
    }

    fn description<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Option<String>> {
        let key = key.to_owned();
        Box::pin(self.file.run(move |db| {
            let txn = db.begin_read()?;
            let table = txn.open_table(DESCRIPTIONS)?;
            Ok(table.get(key.as_str())?.map(|v| v.value().to_owned()))
        }))
    }

    fn put_description<'a>(&'a self, key: &'a str, text: &'a str) -> StoreFuture<'a, ()> {
        let (key, text) = (key.to_owned(), text.to_owned());
        Box::pin(self.file.run_write(move |db| {
            let txn = db.begin_write()?;
            txn.open_table(DESCRIPTIONS)?
                .insert(key.as_str(), text.as_str())?;
            txn.open_table(DESCRIPTION_WRITTEN)?
                .insert(key.as_str(), unix_now())?;
            txn.commit()?;
            Ok(())
        }))
    }

    fn session<'a>(
        &'a self,
        key: &'a str,
        newest: usize,
        ttl: Duration,
    ) -> StoreFuture<'a, Option<Vec<Bytes>>> {
        let key = key.to_owned();
        Box::pin(self.file.run(move |db| read_session(db, &key, newest, ttl)))
    }

    fn append_session<'a>(
        &'a self,
        key: &'a str,
        messages: Vec<Bytes>,
        keep: usize,
        ttl: Duration,
    ) -> StoreFuture<'a, ()> {
        let key = key.to_owned();
        Box::pin(
            self.file
                .run_write(move |db| append_session(db, &key, &messages, keep, ttl)),
        )
    }

    fn delete_session<'a>(&'a self, key: &'a str, ttl: Duration) -> StoreFuture<'a, bool> {
        let key = key.to_owned();
        Box::pin(self.file.run_write(move |db| delete_session(db, &key, ttl)))
    }

    fn sweep_sessions(&self, ttl: Duration) -> Option<StoreFuture<'_, usize>> {
        Some(Box::pin(
            self.file.run_write(move |db| sweep_sessions(db, ttl)),
        ))
    }

    /// Each sweep looks at a bounded stretch of each table, from where the
    /// last one stopped, so a large store is swept over several rounds,
    /// each well inside the operation's timeout.
    fn sweep_descriptions(&self, ttl: Duration) -> Option<StoreFuture<'_, usize>> {
        Some(Box::pin(async move {
            let from = self.sweep_at.lock().map(|c| c.clone()).unwrap_or_default();
            let (gone, next) = self
                .file
                .run_write(move |db| sweep_descriptions(db, from, ttl))
                .await?;
            if let Ok(mut at) = self.sweep_at.lock() {
                *at = next;
            }
            Ok(gone)
        }))
    }
}

/// The newest `newest` messages of session `key`, unless it is unknown or
/// idle longer than `ttl`.
fn read_session(
    db: &redb::Database,
    key: &str,
    newest: usize,
    ttl: Duration,
) -> Result<Option<Vec<Bytes>>, redb::Error> {
    let txn = db.begin_read()?;
    let Some((next, touched)) = txn.open_table(SESSION_META)?.get(key)?.map(|v| v.value()) else {
        return Ok(None);
    };
    if unix_now().saturating_sub(touched) > ttl.as_secs() {
        return Ok(None);
    }
    let table = txn.open_table(SESSION_MESSAGES)?;
    let from = next.saturating_sub(newest as u64);
    let mut out = Vec::new();
    for row in table.range((key, from)..(key, next))? {
        out.push(Bytes::copy_from_slice(row?.1.value()));
    }
    Ok(Some(out))
}

/// Appends `messages` to session `key` in one transaction, keeping its
/// newest `keep`; an expired session starts again, empty.
fn append_session(
    db: &redb::Database,
    key: &str,
    messages: &[Bytes],
    keep: usize,
    ttl: Duration,
) -> Result<(), redb::Error> {
    let now = unix_now();
    let txn = db.begin_write()?;
    {
        let mut meta = txn.open_table(SESSION_META)?;
        let mut table = txn.open_table(SESSION_MESSAGES)?;
        let (mut next, touched) = meta.get(key)?.map(|v| v.value()).unwrap_or((0, now));
        let mut first = if now.saturating_sub(touched) > ttl.as_secs() {
            next
        } else {
            0
        };
        for m in messages {
            table.insert((key, next), m.as_ref())?;
            next += 1;
        }
        first = first.max(next.saturating_sub(keep as u64));
        table.retain_in((key, 0)..(key, first), |_, _| false)?;
        meta.insert(key, (next, now))?;
    }
    txn.commit()?;
    Ok(())
}

/// Forgets session `key`; true when there was one, not idle past `ttl`.
fn delete_session(db: &redb::Database, key: &str, ttl: Duration) -> Result<bool, redb::Error> {
    let txn = db.begin_write()?;
    let existed;
    {
        let mut meta = txn.open_table(SESSION_META)?;
        let mut table = txn.open_table(SESSION_MESSAGES)?;
        let was = meta.remove(key)?.map(|v| v.value());
        existed =
            was.is_some_and(|(_, touched)| unix_now().saturating_sub(touched) <= ttl.as_secs());
        table.retain_in((key, 0)..=(key, u64::MAX), |_, _| false)?;
    }
    txn.commit()?;
    Ok(existed)
}

/// Forgets every session idle longer than `ttl`; how many went.
fn sweep_sessions(db: &redb::Database, ttl: Duration) -> Result<usize, redb::Error> {
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
            table.retain_in((key.as_str(), 0)..=(key.as_str(), u64::MAX), |_, _| false)?;
            gone += 1;
        }
    }
    txn.commit()?;
    Ok(gone)
}

/// Forgets descriptions written `ttl` or more ago (at most [`SWEEP_BATCH`]
/// a call), and dates the undated ones (from a file older than the write
/// times) now; how many went, and where the next sweep goes on.
fn sweep_descriptions(
    db: &redb::Database,
    (from_written, from_undated): Cursor,
    ttl: Duration,
) -> Result<(usize, Cursor), redb::Error> {
    let now = unix_now();
    let due = |t: u64| now.saturating_sub(t) >= ttl.as_secs();
    let (expired, undated, next) = {
        let txn = db.begin_read()?;
        let written = txn.open_table(DESCRIPTION_WRITTEN)?;
        let (expired, next_written) = scan(&written, from_written, |_, v| Ok(due(v)))?;
        let descriptions = txn.open_table(DESCRIPTIONS)?;
        let (undated, next_undated) = scan(&descriptions, from_undated, |k, _| {
            Ok(written.get(k)?.is_none())
        })?;
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
}

/// The keys of `table` from `from` on that `pick` takes, looking at
/// [`SWEEP_SCAN`] rows or taking [`SWEEP_BATCH`] at most; and the key the
/// next scan goes on from (`None`: this one reached the end).
fn scan<V: redb::Value + 'static>(
    table: &redb::ReadOnlyTable<&'static str, V>,
    from: Option<String>,
    mut pick: impl FnMut(&str, V::SelfType<'_>) -> Result<bool, redb::Error>,
) -> Result<(Vec<String>, Option<String>), redb::Error> {
    let mut picked = Vec::new();
    let mut seen = 0;
    let mut last = None;
    for row in table.range(from.as_deref().unwrap_or("")..)? {
        let (k, v) = row?;
        seen += 1;
        last = Some(k.value().to_owned());
        if pick(k.value(), v.value())? {
            picked.push(k.value().to_owned());
        }
        if seen == SWEEP_SCAN || picked.len() == SWEEP_BATCH {
            break;
        }
    }
    let more = seen == SWEEP_SCAN || picked.len() == SWEEP_BATCH;
    Ok((picked, more.then_some(last).flatten()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use redb::ReadableTableMetadata as _;

    use super::*;
    use crate::config::StoreBackend;
    use crate::metrics::Metrics;
    use crate::store::{DESCRIPTION_TTL, Store};

    /// A disk store on a fresh `dir`, and its file (to write rows past the
    /// store's interface).
    fn disk_store(dir: &Path, metrics: Arc<Metrics>) -> (Store, Arc<DbFile>) {
        let _ = std::fs::remove_dir_all(dir);
        let disk = Disk::new(dir.join(DISK_FILE));
        let file = disk.file.clone();
        let label = disk.label();
        (Store::new(Box::new(disk), label, metrics), file)
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
        let metrics = Arc::new(Metrics::new().unwrap());
        let (s, d) = disk_store(&dir, metrics);
        s.put_description("new", "a chart").await.unwrap();
        // A row from a file written before descriptions were dated.
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
        let Err(StoreError::InUse(path)) = second.description("k").await else {
            panic!("the second store opened a file in use");
        };
        assert_eq!(path, dir.join(DISK_FILE));
        let problem = second.problem().unwrap();
        assert!(problem.contains("in use by another process"), "{problem}");
        assert_eq!(metrics.store_up.get(), 0);
        // While down, nothing is attempted until the retry is due; the
        // error says why it is down.
        let Err(StoreError::Down(cause)) = second.description("k").await else {
            panic!("a down store was asked");
        };
        assert!(matches!(*cause, StoreError::InUse(_)), "{cause:?}");
        assert!(
            cause.to_string().contains("in use by another process"),
            "{cause}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn redb_errors_are_told_apart() {
        let io = failure(redb::Error::Io(std::io::Error::other("disk full")));
        assert!(matches!(io, StoreError::Io(_)), "{io:?}");
        assert!(matches!(
            failure(redb::Error::PreviousIo),
            StoreError::Io(_)
        ));
        let corrupt = failure(redb::Error::Corrupted("bad page".to_owned()));
        assert!(matches!(corrupt, StoreError::Corrupt(_)), "{corrupt:?}");
        // The text is redb's own, as before.
        assert_eq!(
            corrupt.to_string(),
            redb::Error::Corrupted("bad page".to_owned()).to_string()
        );
        assert!(matches!(
            failure(redb::Error::TableDoesNotExist("t".to_owned())),
            StoreError::Database(_)
        ));
    }
}
