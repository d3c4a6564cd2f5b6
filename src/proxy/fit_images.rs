//! Kept images fitted to the model that sees them: each distinct image
//! and setting scaled once (single flight), on the blocking pool, a few at
//! a time, the result kept in memory (bounded by bytes) and on disk under
//! `<artifacts_dir>/fitted/`, so the next turn — and the next start —
//! sends the same bytes without decoding anything.

use std::path::PathBuf;
use std::sync::Arc;
use tokio::time::Instant;

use bytes::Bytes;
use moka::future::Cache;
use tokio::sync::Semaphore;

use crate::image_fit::{Fitted, Unfit, fit};
use crate::transform::{FitJob, Quick, Scanned};

/// Bytes of fitted images kept in memory: by their image's SHA-256, and
/// (the same results, their bytes shared while both hold them) by their
/// text's quick key; half each, so never more than this together.
const MEMORY_BYTES: u64 = 256 * 1024 * 1024;

/// Memory all fits at once may take, in MiB: a fit takes about 8 bytes a
/// pixel of the image it decodes (decoded, scaled, encoding; 431 MB peak
/// for a 9000×6000 PNG, `crates/image-fit/tests/timing.rs`), so a large
/// photo waits for the others rather than take the process past its
/// memory limit.
const FIT_MEMORY_MIB: u32 = 512;
const BYTES_PER_PIXEL: u64 = 8;

/// A fitted image or why it was left (both kept: an image that cannot be
/// decoded is not tried again every turn).
type Outcome = Arc<Result<Fitted, Unfit>>;

/// The cache of fitted images and the bound on how many are fitted at once.
pub struct Fitter {
    memory: Cache<String, Outcome>,
    /// The same results by their [`crate::transform::quick_key`]: the next
    /// turn's image found by its text, not decoded and hashed again
    /// (bounded like `memory`; the fitted bytes are shared with it).
    quick: moka::sync::Cache<u128, Quick>,
    dir: Option<PathBuf>,
    permits: Arc<Semaphore>,
    /// [`FIT_MEMORY_MIB`], a permit a MiB.
    fit_memory: Arc<Semaphore>,
}

impl Fitter {
    /// Fitted images kept under `dir` (none on disk with `None`), at most
    /// `concurrency` fitted at a time.
    pub fn new(dir: Option<PathBuf>, concurrency: usize) -> Fitter {
        let memory = Cache::builder()
            .max_capacity(MEMORY_BYTES / 2)
            .weigher(|k: &String, v: &Outcome| {
                let n = v.as_ref().as_ref().map_or(0, |f| f.bytes.len()) + k.len() + 64;
                u32::try_from(n).unwrap_or(u32::MAX)
            })
            .build();
        let quick = moka::sync::Cache::builder()
            .max_capacity(MEMORY_BYTES / 2)
            .weigher(|_: &u128, q: &Quick| {
                let n =
                    q.fitted.as_ref().map_or(0, |f| f.bytes.len()) + q.original.sha256.len() + 96;
                u32::try_from(n).unwrap_or(u32::MAX)
            })
            .build();
        Fitter {
            memory,
            quick,
            dir,
            permits: Arc::new(Semaphore::new(concurrency.max(1))),
            fit_memory: Arc::new(Semaphore::new(FIT_MEMORY_MIB as usize)),
        }
    }

    /// Fits `jobs` into `scanned`, by `stop_at` (an image not fitted by
    /// then is sent as it came). Returns how many could not be fitted.
    pub async fn fit_into(
        &self,
        scanned: &mut Scanned,
        jobs: Vec<FitJob>,
        stop_at: Option<Instant>,
    ) -> usize {
        let all = futures_util::future::join_all(jobs.iter().map(|j| self.fitted(j)));
        let Some(done) = crate::media_text::until(stop_at, all).await else {
            return jobs.len();
        };
        let mut unfit = 0;
        for (job, outcome) in jobs.iter().zip(done) {
            if let Some(q) = job.quick {
                let fitted = outcome.as_ref().as_ref().ok().cloned();
                let original = job.original.clone();
                self.quick.insert(q, Quick { fitted, original });
            }
            match outcome.as_ref() {
                Ok(f) => scanned.set_fitted(job.index, f.clone()),
                Err(why) => {
                    unfit += 1;
                    tracing::debug!(sha256 = %&job.sha256[..12.min(job.sha256.len())], %why, "image left as it came");
                }
            }
        }
        unfit
    }

    /// A result found by its quick key (see [`crate::transform::quick_key`]).
    pub fn quick(&self, key: u128) -> Option<Quick> {
        self.quick.get(&key)
    }

    /// One job's image: from memory, from disk, or fitted now.
    pub async fn fitted(&self, job: &FitJob) -> Outcome {
        let key = job.key();
        self.memory
            .get_with(key.clone(), async {
                if let Some(f) = self.read(&key).await {
                    return Arc::new(Ok(f));
                }
                let (w, h) = job.from;
                let mib = (u64::from(w) * u64::from(h) * BYTES_PER_PIXEL).div_ceil(1 << 20);
                let mib = u32::try_from(mib)
                    .unwrap_or(u32::MAX)
                    .clamp(1, FIT_MEMORY_MIB);
                let Ok(memory) = self.fit_memory.clone().acquire_many_owned(mib).await else {
                    return Arc::new(Err(Unfit::Broken("shutting down".to_owned())));
                };
                let Ok(permit) = self.permits.clone().acquire_owned().await else {
                    return Arc::new(Err(Unfit::Broken("shutting down".to_owned())));
                };
                let (bytes, size, max) = (job.bytes.clone(), job.size, job.max_base64);
                // The permit goes with the work: a request that stops
                // waiting (its deadline, a client gone) does not free it
                // while the fit still runs.
                let outcome = tokio::task::spawn_blocking(move || {
                    let _permits = (permit, memory);
                    fit(&bytes, size, max)
                })
                .await
                .unwrap_or_else(|e| Err(Unfit::Broken(e.to_string())));
                if let Ok(f) = &outcome {
                    self.write(&key, f).await;
                }
                Arc::new(outcome)
            })
            .await
    }

    /// The file a key's image is kept in.
    fn path(&self, key: &str) -> Option<PathBuf> {
        let name = crate::transform::decode::sha256_hex(key.as_bytes());
        Some(self.dir.as_ref()?.join(name))
    }

    /// A fitted image from disk: a head line `media_type width height`,
    /// then its bytes.
    async fn read(&self, key: &str) -> Option<Fitted> {
        let path = self.path(key)?;
        let raw = tokio::task::spawn_blocking(move || std::fs::read(path))
            .await
            .ok()?
            .ok()?;
        let nl = memchr::memchr(b'\n', &raw)?;
        let head = std::str::from_utf8(&raw[..nl]).ok()?;
        let mut it = head.split(' ');
        let media_type = match it.next()? {
            "image/png" => "image/png",
            "image/jpeg" => "image/jpeg",
            _ => return None,
        };
        let width = it.next()?.parse().ok()?;
        let height = it.next()?.parse().ok()?;
        Some(Fitted {
            media_type,
            bytes: Bytes::from(raw).slice(nl + 1..),
            width,
            height,
        })
    }

    /// Keeps a fitted image on disk (a failure only costs a later decode).
    async fn write(&self, key: &str, f: &Fitted) {
        let Some(path) = self.path(key) else { return };
        let mut raw = format!("{} {} {}\n", f.media_type, f.width, f.height).into_bytes();
        raw.extend_from_slice(&f.bytes);
        let done = tokio::task::spawn_blocking(move || {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            crate::artifacts::write_atomic(&path, &raw)
        })
        .await;
        if let Ok(Err(e)) = done {
            tracing::debug!(error = %e, "a fitted image was not kept on disk");
        }
    }
}
