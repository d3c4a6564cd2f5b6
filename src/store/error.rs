//! What a store operation's failure was: one variant per kind of failure,
//! with what the backend said as its source. The texts are the ones the
//! logs, `/readyz` reasons and error bodies show.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// What a backend (redb, Redis, a task) said went wrong. Shared, so the
/// failure that took the store down is both returned and kept as the
/// reason the store is down.
pub type Source = Arc<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// Not attempted: the store is down (for this failure) and not due for
    /// another try.
    #[error("the store is down: {0}")]
    Down(#[source] Box<StoreError>),
    /// No answer within the operation's time.
    #[error("no answer within {} ms", .0.as_millis())]
    TimedOut(Duration),
    /// It cannot be reached: the connection was refused, dropped, or timed
    /// out (Redis).
    #[error(transparent)]
    Unreachable(Source),
    /// An I/O error (a full disk); the disk store opens its file again.
    #[error(transparent)]
    Io(Source),
    /// What it holds cannot be read: a corrupt file, a reply that does not
    /// decode.
    #[error(transparent)]
    Corrupt(Source),
    /// Any other error the database reported.
    #[error(transparent)]
    Database(Source),
    /// The disk store's file is held by another process.
    #[error("{} is in use by another process (another visor on the same data_dir?)", .0.display())]
    InUse(PathBuf),
    /// The disk store's file cannot be opened.
    #[error("cannot open {}: {source}", path.display())]
    Open { path: PathBuf, source: Source },
    /// The disk store's file was deleted or replaced under the process.
    #[error(
        "{} was deleted or replaced while visor ran (what it held is lost); a new file is made",
        .0.display()
    )]
    Replaced(PathBuf),
    /// The task running the operation ended without an answer (a panic).
    #[error("the store task failed")]
    TaskFailed(#[source] Source),
    /// A lock poisoned by a panic.
    #[error("store lock poisoned")]
    Poisoned,
}
