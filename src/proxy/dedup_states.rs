//! What visor read of each conversation, kept so that its next request
//! reads only its new messages: after a request, its walk (up to the end
//! of its last message) and dedup's [`State`], under the key of the body's
//! bytes up to there ([`prefix_key`]), bounded in bytes (least recently
//! used first out). The next request is matched before it is walked: the
//! states of conversations that begin with its first bytes
//! ([`start_key`]) are candidates, each checked by the hash of its last
//! bytes and then of the whole prefix. A request takes the state it
//! continues out of the cache — two requests of one conversation at
//! once: the second reads in full — and puts back the state it leaves. A
//! request whose earlier messages changed, or whose state was evicted, is
//! read in full: its body is the same either way.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crate::transform::dedup::State;
use crate::transform::walk::Scan;
use crate::transform::{Plan, Rewrite, Scanned, prefix_key, start_key};

/// Candidates kept per beginning (conversations of one agent share their
/// first bytes): the newest first out last.
const CANDIDATES: usize = 64;
/// The bytes before a prefix's end a candidate is checked by first.
const TAIL: usize = 64;

/// What a request continues: the walk and dedup's state of the request
/// before, whose messages end at `end`.
pub struct Resume {
    pub scan: Scan,
    pub end: usize,
    pub state: State,
}

/// A kept state's place: where its prefix ends, its key, a hash of the
/// prefix's last [`TAIL`] bytes.
#[derive(Clone, Copy)]
struct Candidate {
    end: usize,
    key: u128,
    tail: u64,
}

fn tail(prefix: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&prefix[prefix.len().saturating_sub(TAIL)..])
}

type Slot<T> = Arc<Mutex<T>>;

/// The states, by prefix key, and their candidates, by beginning.
pub struct DedupStates {
    states: moka::sync::Cache<u128, Slot<Option<Resume>>>,
    starts: moka::sync::Cache<u64, Slot<VecDeque<Candidate>>>,
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

fn weight(r: &Resume) -> usize {
    r.state.size() + r.scan.size() + 64
}

impl DedupStates {
    /// States of at most `bytes` in all; `None` for 0 (every request read
    /// in full).
    pub fn new(bytes: u64) -> Option<DedupStates> {
        (bytes > 0).then(|| DedupStates {
            states: moka::sync::Cache::builder()
                .max_capacity(bytes)
                .weigher(|_: &u128, s: &Slot<Option<Resume>>| {
                    let n = s.lock().map(|s| s.as_ref().map_or(0, weight)).unwrap_or(0);
                    u32::try_from(n).unwrap_or(u32::MAX)
                })
                .build(),
            // A beginning's candidates are small; as many beginnings as a
            // state of a few KiB each would fill the bound.
            starts: moka::sync::Cache::builder()
                .max_capacity((bytes / 4096).max(64))
                .build(),
            bytes,
        })
    }

    /// The state `body` continues, taken out: the newest kept for a
    /// conversation that begins with its first bytes and whose messages
    /// it begins with, byte for byte.
    pub fn find(&self, body: &[u8], plan: &Plan) -> Option<Resume> {
        let start = start_key(plan, body)?;
        let list = self.starts.get(&start)?;
        let fits: Vec<Candidate> = {
            let list = list.lock().ok()?;
            list.iter()
                .rev()
                .filter(|c| c.end < body.len() && tail(&body[..c.end]) == c.tail)
                .copied()
                .collect()
        };
        for c in fits {
            if prefix_key(plan, &body[..c.end]) != c.key {
                continue;
            }
            if let Ok(mut l) = list.lock() {
                l.retain(|o| o.key != c.key);
            }
            let taken = self
                .states
                .remove(&c.key)
                .and_then(|s| s.lock().ok()?.take());
            if let Some(r) = taken.filter(|r| r.end == c.end) {
                return Some(r);
            }
        }
        None
    }

    /// Keeps what was read of `body`: `scan` as its walk left it (before
    /// its images were decoded) and dedup's `state` (not when the two
    /// together are over the bound).
    pub fn keep(&self, body: &[u8], plan: &Plan, scan: Scan, state: State) {
        let Some((scan, end)) = scan.upto_messages() else {
            return;
        };
        if state.items() != scan.items.len() || end > body.len() {
            return;
        }
        let prefix = &body[..end];
        // The next request begins with `prefix`: its first bytes must be
        // in it.
        let Some(start) = start_key(plan, prefix) else {
            return;
        };
        let resume = Resume { scan, end, state };
        if weight(&resume) as u64 > self.bytes {
            return;
        }
        let key = prefix_key(plan, prefix);
        self.states.insert(key, Arc::new(Mutex::new(Some(resume))));
        let list = self
            .starts
            .get_with(start, || Arc::new(Mutex::new(VecDeque::new())));
        if let Ok(mut l) = list.lock() {
            l.retain(|o| o.key != key);
            l.push_back(Candidate {
                end,
                key,
                tail: tail(prefix),
            });
            while l.len() > CANDIDATES {
                l.pop_front();
            }
        }
    }

    /// Bytes held (after pending evictions).
    pub fn weight(&self) -> u64 {
        self.states.run_pending_tasks();
        self.states.weighted_size()
    }

    /// `body` transformed by `plan` as the proxy does when nothing is to
    /// be described, fitted or converted: continued from the state its
    /// conversation's previous request left when one is kept, its own
    /// state kept (the benches' and tests' way; the proxy runs the same
    /// steps around its other work).
    pub fn rewrite(&self, body: &[u8], plan: &Plan) -> (Rewrite, Read) {
        let resume = self.find(body, plan);
        let (scanned, state) = match resume {
            Some(r) => match crate::transform::walk_from(body, plan, r.scan, r.end) {
                Ok(s) => (Ok(s), Some(r.state)),
                Err(_) => (crate::transform::walk(body, plan), None),
            },
            None => (crate::transform::walk(body, plan), None),
        };
        let mut scanned = match scanned {
            Ok(s) => s,
            Err(done) => return (*done, Read::Full),
        };
        let walked = scanned.scan().clone();
        scanned.resolve(body);
        self.finish(scanned, body, state, walked)
    }

    /// Finishes `scanned` (nothing was replaced by a text made for it),
    /// continuing dedup from `state`, and keeps what it read (`walked`:
    /// its scan before its images were decoded).
    pub fn finish(
        &self,
        scanned: Scanned,
        body: &[u8],
        state: Option<State>,
        walked: Scan,
    ) -> (Rewrite, Read) {
        let plan = *scanned.plan();
        let (rewrite, left) = scanned.finish_from(body, &[], state);
        if let Some(left) = left {
            self.keep(body, &plan, walked, left);
        }
        let read = match rewrite.report.dedup_continued {
            true => Read::Continued,
            false => Read::Full,
        };
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
            let (_, read) = states.rewrite(&body(c), &p);
            assert_eq!(read, Read::Full);
        }
        let weight = states.weight();
        assert!(weight <= 64 << 10, "{weight}");
        // Something is kept: the newest conversations continue.
        assert!(weight > 16 << 10, "{weight}");
    }

    #[test]
    fn a_state_is_taken_once_by_a_body_that_begins_with_its_messages() {
        let states = DedupStates::new(1 << 20).unwrap();
        let p = plan();
        let b = body(1);
        assert_eq!(states.rewrite(&b, &p).1, Read::Full);
        // The same request again (a retry) begins with its messages.
        let r = states.find(&b, &p).expect("kept");
        assert_eq!(r.state.items(), 3);
        assert!(states.find(&b, &p).is_none(), "taken twice");
        // Put back, then a body that differs in its last message's last
        // byte: its prefix is not the state's.
        let end = r.end;
        states.keep(&b, &p, r.scan, r.state);
        let mut other = b.clone();
        other[end - 3] ^= 1;
        assert!(states.find(&other, &p).is_none());
        // Nor under another plan.
        let mut q = p;
        q.vision = false;
        assert!(states.find(&b, &q).is_none());
        assert!(states.find(&b, &p).is_some());
    }
}
