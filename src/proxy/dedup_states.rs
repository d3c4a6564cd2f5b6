//! What dedup read of each conversation, kept so that its next request
//! reads only its new messages: each request's [`State`] under the key of
//! its messages ([`Scanned::prefix_keys`]), bounded in bytes (least
//! recently used first out). A request takes the state of the longest
//! prefix of its messages that has one, out of the cache — two requests of
//! one conversation at once: the second reads in full — and puts back the
//! state it leaves. A request whose earlier messages changed, or whose
//! state was evicted, is read in full: its body is the same either way.

use std::sync::{Arc, Mutex};

use crate::transform::dedup::State;
use crate::transform::{Rewrite, Scanned};

/// The states, by prefix key.
pub struct DedupStates {
    cache: moka::sync::Cache<u128, Arc<Mutex<Option<State>>>>,
    /// The bound: a state larger than all of it is never kept.
    bytes: u64,
}

/// What a request's finish found: whether dedup continued a state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    Continued,
    Full,
}

impl Read {
    /// The `read` label of `visor_dedup_reads_total`.
    pub fn label(self) -> &'static str {
        match self {
            Read::Continued => "continued",
            Read::Full => "full",
        }
    }
}

impl DedupStates {
    /// States of at most `bytes` in all; `None` for 0 (every request read
    /// in full).
    pub fn new(bytes: u64) -> Option<DedupStates> {
        (bytes > 0).then(|| DedupStates {
            cache: moka::sync::Cache::builder()
                .max_capacity(bytes)
                .weigher(|_: &u128, s: &Arc<Mutex<Option<State>>>| {
                    let n = s
                        .lock()
                        .map(|s| s.as_ref().map_or(0, State::size))
                        .unwrap_or(0);
                    u32::try_from(n + 64).unwrap_or(u32::MAX)
                })
                .build(),
            bytes,
        })
    }

    /// The state of the longest prefix of `keys` (newest first) kept,
    /// taken out.
    pub fn take(&self, keys: &[(usize, u128)]) -> Option<State> {
        keys.iter().find_map(|&(items, key)| {
            let kept = self.cache.remove(&key)?;
            let state = kept.lock().ok()?.take()?;
            (state.items() == items).then_some(state)
        })
    }

    /// Keeps `state` under `key` (not when it alone is over the bound).
    pub fn put(&self, key: u128, state: State) {
        if state.size() as u64 + 64 > self.bytes {
            return;
        }
        self.cache.insert(key, Arc::new(Mutex::new(Some(state))));
    }

    /// Bytes held (after pending evictions).
    pub fn weight(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.weighted_size()
    }

    /// Finishes `scanned` (no descriptions: nothing was replaced by a
    /// text made for it) from the state of its conversation's previous
    /// request when one is kept, and keeps the state it leaves.
    pub fn finish(&self, scanned: Scanned, body: &[u8]) -> (Rewrite, Read) {
        let keys = scanned.prefix_keys(body);
        let resume = self.take(&keys);
        let read = match resume {
            Some(_) => Read::Continued,
            None => Read::Full,
        };
        let (rewrite, state) = scanned.finish_from(body, &[], resume);
        if let (Some(state), Some(&(_, key))) = (state, keys.first()) {
            self.put(key, state);
        }
        (rewrite, read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transform::{Limits, Plan, Rules, Shape, Takes, dedup};

    fn plan() -> Plan {
        let rules = Rules {
            keep_turns: 2,
            max_images: 10,
            hard_max_images: None,
            dedupe: true,
            prompt_cache: true,
            context_permille: 800,
            context_window: None,
            dedup: Some(dedup::Blocks {
                min_lines: 2,
                min_bytes: 64,
            }),
        };
        Plan {
            shape: Shape::Chat,
            vision: true,
            describe: false,
            rules,
            takes: Takes::ALL,
            query_aware: false,
            fit: Limits::NONE,
        }
    }

    /// Conversation `c`'s first request: a task and a 4 KB tool result.
    fn body(c: usize) -> Vec<u8> {
        let result: String = (0..100)
            .map(|l| format!("conversation {c} line {l:03}\n"))
            .collect();
        serde_json::to_vec(&serde_json::json!({"model": "m", "messages": [
            {"role": "user", "content": format!("task {c}")},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": result},
        ]}))
        .unwrap()
    }

    #[test]
    fn the_states_kept_stay_within_their_bound() {
        let states = DedupStates::new(64 << 10).unwrap();
        let p = plan();
        for c in 0..200 {
            let b = body(c);
            let scanned = crate::transform::walk(&b, &p).unwrap();
            let (_, read) = states.finish(scanned, &b);
            assert_eq!(read, Read::Full);
        }
        let weight = states.weight();
        assert!(weight <= 64 << 10, "{weight}");
        // Something is kept: the newest conversations continue.
        assert!(weight > 16 << 10, "{weight}");
    }

    #[test]
    fn a_state_is_taken_once() {
        let states = DedupStates::new(1 << 20).unwrap();
        let p = plan();
        let b = body(1);
        let scanned = crate::transform::walk(&b, &p).unwrap();
        let keys = scanned.prefix_keys(&b);
        let (_, read) = states.finish(scanned.clone(), &b);
        assert_eq!(read, Read::Full);
        let state = states.take(&keys).expect("kept");
        assert_eq!(state.items(), 3);
        assert!(states.take(&keys).is_none(), "taken twice");
        // A key found with another number of messages is not continued.
        states.put(keys[0].1, state);
        assert!(states.take(&[(2, keys[0].1)]).is_none());
    }
}
