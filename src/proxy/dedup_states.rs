//! What visor read of each conversation, kept so that its next request
//! reads only its new messages: after a request, its walk (up to the end
//! of its last message) and dedup's [`State`], under the key of the body's
//! bytes up to there ([`prefix_key`]), bounded in bytes (least recently
//! used out first). The next request is matched before it is walked: the
//! states of the same client's conversations that begin with its first
//! bytes ([`start_key`]) are candidates, each checked by the hash of its
//! last bytes and then of the whole prefix. A request takes the state it
//! continues out of the cache — two requests of one conversation at once:
//! the second reads in full — and puts back the state it leaves. A request
//! whose earlier messages changed, or whose state was evicted, is read in
//! full: its body is the same either way. Bodies under [`MIN_BODY`] are
//! always read in full (reading them costs less than the bookkeeping).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use moka::policy::EvictionPolicy;

use crate::prompt_cache::Prefixes;
use crate::transform::dedup::State;
use crate::transform::walk::Scan;
use crate::transform::{Plan, Rewrite, conversation_seed, prefix_digest, prefix_key_of, start_key};

/// Bodies shorter than this are read in full and leave no state (the
/// bookkeeping of a state, about 20 µs, is what reading about 8 KB costs).
pub const MIN_BODY: usize = 8 * 1024;
/// Candidates kept per beginning (one client's conversations with one
/// agent share their first bytes), the oldest out first.
const CANDIDATES: usize = 1024;
/// The bytes before a prefix's end a candidate is checked by first.
const TAIL: usize = 64;

/// What a request continues: the walk and dedup's state of the request
/// before, whose messages end at `end`, and what the prompt cache read of
/// it (added once it did: [`DedupStates::attach`]).
pub struct Resume {
    pub scan: Scan,
    pub end: usize,
    pub state: State,
    pub cache: Option<Prefixes>,
    /// Its bytes, counted once when kept and once more when `cache` is
    /// added (the cache's weigher reads this, at every put).
    weight: usize,
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
    /// The states' share of the bound: a state larger than all of it is
    /// never kept.
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

fn clamp(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The walk a request keeps for the next one of its conversation, as it
/// was before its images were decoded. Only the image-indexed steps
/// (`Scanned::resolve` and the fits) change a walk, so one that found no
/// images or media is kept as its finish leaves it, without a copy.
pub enum Walked {
    /// A copy taken before the images were decoded.
    Copy(Scan),
    /// The walk itself, taken back from its finish.
    Itself,
}

impl Walked {
    pub fn of(scan: &Scan) -> Walked {
        match scan.images.is_empty() {
            true => Walked::Itself,
            false => Walked::Copy(scan.clone()),
        }
    }

    /// The walk to keep, given the one the finish read.
    pub fn or(self, finished: Scan) -> Scan {
        match self {
            Walked::Copy(before) => before,
            Walked::Itself => finished,
        }
    }
}

impl DedupStates {
    /// States and their candidates of at most `bytes` in all (an eighth
    /// for the candidates); `None` for 0 (every request read in full).
    pub fn new(bytes: u64) -> Option<DedupStates> {
        (bytes > 0).then(|| {
            let lists = bytes / 8;
            let bytes = bytes - lists;
            DedupStates {
                // Least recently used out first: a state is read once
                // (taken), so a policy by frequency would keep the first
                // states it admitted and turn every later one away.
                states: moka::sync::Cache::builder()
                    .max_capacity(bytes)
                    .eviction_policy(EvictionPolicy::lru())
                    .weigher(|_: &u128, s: &Slot<Option<Resume>>| {
                        clamp(s.lock().map_or(0, |s| s.as_ref().map_or(0, |r| r.weight)))
                    })
                    .build(),
                starts: moka::sync::Cache::builder()
                    .max_capacity(lists)
                    .eviction_policy(EvictionPolicy::lru())
                    .weigher(|_: &u64, l: &Slot<VecDeque<Candidate>>| {
                        let n = l.lock().map_or(0, |l| l.capacity());
                        clamp(n * std::mem::size_of::<Candidate>() + 64)
                    })
                    .build(),
                bytes,
            }
        })
    }

    /// The state `body` continues, taken out: the newest kept (under the
    /// same `seed`: plan and client, see [`conversation_seed`]) for a
    /// conversation that begins with its first bytes and whose messages
    /// it begins with, byte for byte. `known`: the body's
    /// [`prefix_digest`] up to a point, when computed already.
    pub fn find(&self, body: &[u8], seed: u64, known: Option<(usize, u128)>) -> Option<Resume> {
        if body.len() < MIN_BODY {
            return None;
        }
        let start = start_key(seed, body)?;
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
            let digest = match known {
                Some((end, d)) if end == c.end => d,
                _ => prefix_digest(&body[..c.end]),
            };
            if prefix_key_of(seed, c.end, digest) != c.key {
                continue;
            }
            // Taken (or gone: evicted): no longer a candidate either way.
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
    /// together are over the bound); the key it is kept under. `known`: as
    /// for [`DedupStates::find`].
    pub fn keep(
        &self,
        body: &[u8],
        (seed, known): (u64, Option<(usize, u128)>),
        scan: Scan,
        state: State,
    ) -> Option<u128> {
        if body.len() < MIN_BODY {
            return None;
        }
        let (scan, end) = scan.upto_messages()?;
        if state.items() != scan.items.len() || end > body.len() {
            return None;
        }
        let prefix = &body[..end];
        // The next request begins with `prefix`: its first bytes must be
        // in it.
        let start = start_key(seed, prefix)?;
        let resume = Resume {
            weight: state.size() + scan.size() + 64,
            scan,
            end,
            state,
            cache: None,
        };
        if resume.weight as u64 > self.bytes {
            return None;
        }
        let digest = match known {
            Some((at, d)) if at == end => d,
            _ => prefix_digest(prefix),
        };
        let key = prefix_key_of(seed, end, digest);
        self.states.insert(key, Arc::new(Mutex::new(Some(resume))));
        let candidate = Candidate {
            end,
            key,
            tail: tail(prefix),
        };
        // One request at a time per beginning (moka locks the key), the
        // list put back to be weighed as it is now.
        self.starts.entry(start).and_compute_with(|found| {
            let list = found.map(|e| e.into_value()).unwrap_or_default();
            if let Ok(mut l) = list.lock() {
                l.retain(|o| o.key != key);
                while l.len() >= CANDIDATES {
                    l.pop_front();
                }
                l.push_back(candidate);
            }
            moka::ops::compute::Op::Put(list)
        });
        Some(key)
    }

    /// Adds to the state kept under `key` what the prompt cache read of
    /// its request (when it reads up to where the state's messages end),
    /// the state weighed again. Nothing when the state was taken already.
    pub fn attach(&self, key: u128, cache: Prefixes) {
        let Some(slot) = self.states.get(&key) else {
            return;
        };
        let fits = match slot.lock() {
            Ok(mut s) => match s.as_mut() {
                Some(r) if r.end == cache.end() => {
                    let before = r.cache.as_ref().map_or(0, Prefixes::size);
                    r.weight = r.weight - before + cache.size();
                    r.cache = Some(cache);
                    r.weight as u64 <= self.bytes
                }
                _ => return,
            },
            Err(_) => return,
        };
        match fits {
            // Put again, to be weighed with it.
            true => self.states.insert(key, slot.clone()),
            false => self.states.invalidate(&key),
        }
        // Taken meanwhile (the lock let go before the put): not put back
        // empty.
        if slot.lock().map_or(true, |s| s.is_none()) {
            self.states.invalidate(&key);
        }
    }

    /// Bytes held by the states (after pending evictions).
    pub fn weight(&self) -> u64 {
        self.states.run_pending_tasks();
        self.states.weighted_size()
    }

    /// `body` transformed by `plan` for the client `tenant` (see
    /// [`conversation_seed`]) as the proxy does when nothing is to be
    /// described, fitted or converted: continued from the state its
    /// conversation's previous request left when one is kept, its own
    /// state kept (the benches' and tests' way; the proxy runs the same
    /// steps around its other work).
    pub fn rewrite(&self, body: &[u8], plan: &Plan, tenant: u64) -> (Rewrite, Read) {
        let seed = conversation_seed(plan, tenant);
        let resume = self.find(body, seed, None);
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
        let state = state.filter(|s| scanned.continues(s, body));
        let walked = Walked::of(scanned.scan());
        scanned.resolve(body);
        let (rewrite, left, scan) = scanned.finish_keeping(body, &[], state);
        let (read, _) = self.kept(body, seed, &rewrite, left, (walked.or(scan), None));
        (rewrite, read)
    }

    /// After a request's finish: keeps the state it `left` (with its walk,
    /// `walked`); says how it was read, and the key the state is kept
    /// under.
    pub fn kept(
        &self,
        body: &[u8],
        seed: u64,
        rewrite: &Rewrite,
        left: Option<State>,
        (walked, known): (Scan, Option<(usize, u128)>),
    ) -> (Read, Option<u128>) {
        let key = left.and_then(|left| self.keep(body, (seed, known), walked, left));
        let read = match rewrite.report.dedup_continued {
            true => Read::Continued,
            false => Read::Full,
        };
        (read, key)
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::transform::{Limits, Plan, Rules, Shape, Takes};

    /// A model that can see, under the default `[images]` and `[dedup]`.
    fn plan() -> Plan {
        let cfg = crate::config::Config::from_toml(
            "[[upstream]]\nname = \"u\"\nbase_url = \"http://127.0.0.1:9/v1\"\n",
            std::path::Path::new("test.toml"),
            &|_| None,
        )
        .unwrap();
        let rules = Rules::new(&cfg.images, &cfg.dedup, None, None);
        assert!(rules.dedup.is_some());
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

    /// Conversation `c`'s first request: a task and a 20 KB tool result.
    fn body(c: usize) -> Vec<u8> {
        let result: String = (0..800)
            .map(|l| format!("conversation {c} line {l:03}\n"))
            .collect();
        serde_json::to_vec(&serde_json::json!({"model": "m", "messages": [
            {"role": "user", "content": format!("task {c}")},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": result},
        ]}))
        .unwrap()
    }

    /// `body(c)` one turn on.
    fn next(c: usize) -> Vec<u8> {
        let mut v: serde_json::Value = serde_json::from_slice(&body(c)).unwrap();
        let msgs = v["messages"].as_array_mut().unwrap();
        msgs.push(serde_json::json!({"role": "assistant", "content": "done"}));
        msgs.push(serde_json::json!({"role": "user", "content": "thanks"}));
        serde_json::to_vec(&v).unwrap()
    }

    #[test]
    fn the_states_kept_stay_within_their_bound_the_newest_kept() {
        let bound = 1 << 20;
        let states = DedupStates::new(bound).unwrap();
        let p = plan();
        for c in 0..200 {
            let (_, read) = states.rewrite(&body(c), &p, 0);
            assert_eq!(read, Read::Full);
        }
        let weight = states.weight();
        assert!(weight <= bound, "{weight}");
        assert!(weight > bound / 4, "{weight}");
        // Least recently used out first: the newest conversations go on,
        // the oldest were evicted.
        assert_eq!(states.rewrite(&next(199), &p, 0).1, Read::Continued);
        assert_eq!(states.rewrite(&next(198), &p, 0).1, Read::Continued);
        assert_eq!(states.rewrite(&next(0), &p, 0).1, Read::Full);
    }

    #[test]
    fn a_state_is_taken_once_by_a_body_that_begins_with_its_messages() {
        let states = DedupStates::new(1 << 20).unwrap();
        let p = plan();
        let seed = conversation_seed(&p, 0);
        let b = body(1);
        assert_eq!(states.rewrite(&b, &p, 0).1, Read::Full);
        // The same request again (a retry) begins with its messages.
        let r = states.find(&b, seed, None).expect("kept");
        assert_eq!(r.state.items(), 3);
        assert!(states.find(&b, seed, None).is_none(), "taken twice");
        // Put back; a body that differs inside its prefix, past its first
        // bytes and before its last (the whole prefix's hash tells), is
        // not its continuation.
        let end = r.end;
        states.keep(&b, (seed, None), r.scan, r.state);
        let mut other = b.clone();
        other[end / 2] ^= 1;
        assert!(states.find(&other, seed, None).is_none());
        // Nor under another plan, nor another client's.
        let mut q = p;
        q.vision = false;
        assert!(states.find(&b, conversation_seed(&q, 0), None).is_none());
        assert!(states.find(&b, conversation_seed(&p, 7), None).is_none());
        // A digest the body's check computed is taken for its own end
        // only: a wrong one there is no match, one for another end is not
        // used.
        let digest = crate::transform::prefix_digest(&b[..end]);
        assert!(states.find(&b, seed, Some((end, digest ^ 1))).is_none());
        let r = states.find(&b, seed, Some((end + 1, digest ^ 1))).unwrap();
        states.keep(&b, (seed, Some((end, digest))), r.scan, r.state);
        assert!(states.find(&b, seed, Some((end, digest))).is_some());
    }

    #[test]
    fn a_small_body_is_read_in_full_and_leaves_nothing() {
        let states = DedupStates::new(1 << 20).unwrap();
        let p = plan();
        let small = serde_json::to_vec(&serde_json::json!({"model": "m", "messages": [
            {"role": "user", "content": "x".repeat(200)},
            {"role": "assistant", "content": "y".repeat(200)},
        ]}))
        .unwrap();
        assert!(small.len() < MIN_BODY);
        states.rewrite(&small, &p, 0);
        assert_eq!(states.weight(), 0);
    }

    #[test]
    fn many_conversations_that_begin_alike_each_continue() {
        // One agent's conversations: the same long system prompt (the
        // same first 128 bytes), then each its own task.
        let states = DedupStates::new(64 << 20).unwrap();
        let p = plan();
        let system = "You are a coding agent. ".repeat(20);
        let conv = |c: usize, turns: usize| {
            let mut msgs = vec![
                serde_json::json!({"role": "system", "content": system}),
                serde_json::json!({"role": "user", "content": format!("task {c}")}),
            ];
            for t in 0..turns {
                let out: String = (0..300)
                    .map(|l| format!("conversation {c} turn {t} line {l}\n"))
                    .collect();
                msgs.push(serde_json::json!({"role": "assistant", "content": format!("step {t}")}));
                msgs.push(serde_json::json!({"role": "user", "content": out}));
            }
            serde_json::to_vec(&serde_json::json!({"model": "m", "messages": msgs})).unwrap()
        };
        for c in 0..300 {
            assert_eq!(states.rewrite(&conv(c, 1), &p, 0).1, Read::Full);
        }
        for c in 0..300 {
            assert_eq!(
                states.rewrite(&conv(c, 2), &p, 0).1,
                Read::Continued,
                "conversation {c}"
            );
        }
    }

    /// What the prompt cache read of a request joins its kept state when
    /// it read up to the same end, and is taken with it; not when its end
    /// differs, nor once the state was taken.
    #[test]
    fn the_prompt_caches_reading_joins_the_state_of_its_request() {
        let states = DedupStates::new(1 << 20).unwrap();
        let p = plan();
        let seed = conversation_seed(&p, 0);
        let b = body(1);
        let read = crate::prompt_cache::Prefixes::of(Shape::Chat, &b).unwrap();
        let r = {
            states.rewrite(&b, &p, 0);
            states.find(&b, seed, None).unwrap()
        };
        assert_eq!(read.end(), r.end, "the walk and the reading end alike");
        let key = states.keep(&b, (seed, None), r.scan, r.state).unwrap();
        let before = states.weight();
        states.attach(key, read.clone());
        assert!(states.weight() > before, "weighed with it");
        let r = states.find(&b, seed, None).unwrap();
        assert_eq!(r.cache.as_ref().map(|c| c.end()), Some(read.end()));
        // Another end: not joined.
        let key = states.keep(&b, (seed, None), r.scan, r.state).unwrap();
        let other = crate::prompt_cache::Prefixes::of(Shape::Chat, &next(1)).unwrap();
        assert_ne!(other.end(), read.end());
        states.attach(key, other);
        let r = states.find(&b, seed, None).unwrap();
        assert!(r.cache.is_none());
        // Taken: nothing put back.
        let key = states.keep(&b, (seed, None), r.scan, r.state).unwrap();
        assert!(states.find(&b, seed, None).is_some());
        states.attach(key, read);
        assert!(states.find(&b, seed, None).is_none());
        states.states.run_pending_tasks();
        assert_eq!(states.states.entry_count(), 0);
    }
}
