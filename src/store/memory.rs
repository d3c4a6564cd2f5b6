//! The memory backend (`store.backend = "memory"`): maps in this process,
//! gone at exit (tests, throwaway runs, the CLI).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{Backend, StoreError, StoreFuture};

/// What the memory backend keeps of descriptions and document texts.
const MEMORY_TEXT_BYTES: usize = 64 << 20;

#[derive(Default)]
pub(super) struct Memory {
    descriptions: Mutex<Texts>,
    learned: Mutex<BTreeSet<String>>,
    sessions: Mutex<HashMap<String, MemSession>>,
}

struct MemSession {
    messages: VecDeque<Bytes>,
    touched: Instant,
}

impl Memory {
    fn sessions(&self) -> Result<MutexGuard<'_, HashMap<String, MemSession>>, StoreError> {
        self.sessions.lock().map_err(|_| StoreError::Poisoned)
    }
}

/// Every memory operation is done when it is first polled (not when it is
/// made: the store may not attempt it).
fn now<'a, T: Send + 'a>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'a,
) -> StoreFuture<'a, T> {
    Box::pin(async move { f() })
}

impl Backend for Memory {
    fn ping(&self, _write: bool) -> StoreFuture<'_, ()> {
        now(|| Ok(()))
    }

    fn is_learned<'a>(&'a self, name: &'a str) -> StoreFuture<'a, bool> {
        now(move || Ok(self.learned.lock().is_ok_and(|l| l.contains(name))))
    }

    fn learned(&self) -> StoreFuture<'_, Vec<String>> {
        now(|| {
            Ok(self
                .learned
                .lock()
                .map(|l| l.iter().cloned().collect())
                .unwrap_or_default())
        })
    }

    fn learn<'a>(&'a self, name: &'a str) -> StoreFuture<'a, ()> {
        now(move || {
            if let Ok(mut l) = self.learned.lock() {
                l.insert(name.to_owned());
            }
            Ok(())
        })
    }

    fn description<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Option<String>> {
        now(move || {
            Ok(self
                .descriptions
                .lock()
                .ok()
                .and_then(|d| d.map.get(key).cloned()))
        })
    }

    fn put_description<'a>(&'a self, key: &'a str, text: &'a str) -> StoreFuture<'a, ()> {
        now(move || {
            if let Ok(mut d) = self.descriptions.lock() {
                d.insert(key, text);
            }
            Ok(())
        })
    }

    fn session<'a>(
        &'a self,
        key: &'a str,
        newest: usize,
        ttl: Duration,
    ) -> StoreFuture<'a, Option<Vec<Bytes>>> {
        now(move || {
            let mut sessions = self.sessions()?;
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
        })
    }

    fn append_session<'a>(
        &'a self,
        key: &'a str,
        messages: Vec<Bytes>,
        keep: usize,
        ttl: Duration,
    ) -> StoreFuture<'a, ()> {
        now(move || {
            let mut sessions = self.sessions()?;
            let s = sessions
                .entry(key.to_owned())
                .or_insert_with(|| MemSession {
                    messages: VecDeque::new(),
                    touched: Instant::now(),
                });
            if s.touched.elapsed() > ttl {
                s.messages.clear();
            }
            s.messages.extend(messages);
            while s.messages.len() > keep {
                s.messages.pop_front();
            }
            s.touched = Instant::now();
            Ok(())
        })
    }

    fn delete_session<'a>(&'a self, key: &'a str, ttl: Duration) -> StoreFuture<'a, bool> {
        now(move || {
            Ok(self
                .sessions()?
                .remove(key)
                .is_some_and(|s| s.touched.elapsed() <= ttl))
        })
    }

    fn sweep_sessions(&self, ttl: Duration) -> Option<StoreFuture<'_, usize>> {
        Some(now(move || {
            let mut sessions = self.sessions()?;
            let before = sessions.len();
            sessions.retain(|_, s| s.touched.elapsed() <= ttl);
            Ok(before - sessions.len())
        }))
    }
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
