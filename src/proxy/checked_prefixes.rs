//! Where a client's request bodies were checked to be JSON objects, up to
//! the end of their last message: the next request of a conversation
//! begins with the same bytes, so only what follows them is checked again
//! (and read for its `model`), once those bytes are known to be the same —
//! by a hash of the client's earlier body up to there.
//!
//! Per client (a keyed hash of its credential headers: one client never
//! times another's bodies) and per beginning (the body's first
//! [`crate::transform::START`] bytes), the newest [`PER_START`] prefixes,
//! bounded in all by [`BYTES`] (least recently used out first). A body
//! that matches none is checked whole, as one of under [`MIN_BODY`] always
//! is. Nothing of a body is kept but its hash, where its messages end and
//! its `model`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use moka::policy::EvictionPolicy;
use xxhash_rust::xxh3::Xxh3;

use super::dedup_states::MIN_BODY;
use super::request_body::JsonScanner;

/// Prefixes kept per client and beginning, the oldest out first.
const PER_START: usize = 64;
/// The bound on all that is kept.
const BYTES: u64 = 16 << 20;
/// The bytes before a prefix's end a candidate is checked by first.
const TAIL: usize = 64;

/// One body checked up to the end of its last message.
#[derive(Debug, Clone)]
pub struct Checked {
    end: usize,
    /// A hash of its last [`TAIL`] bytes, then of all of them.
    tail: u64,
    hash: u128,
    /// A top-level `model` key (any case) came before `end`, and the
    /// model it named.
    model_key: bool,
    model: Option<Arc<str>>,
    /// Set once the inspector found the body holds nothing it strips.
    clean: Arc<AtomicBool>,
}

/// What a body shares with the one its client sent before, for the
/// inspector: its first `clean` bytes are that body's, which held nothing
/// to strip; `mark`, set once this body is found to hold nothing either.
/// And the digests its check computed.
#[derive(Debug, Default)]
pub struct Shared {
    pub clean: usize,
    pub mark: Option<Arc<AtomicBool>>,
    pub digests: Digests,
    /// The body waited to be checked whole: its first bytes matched a
    /// body its client sent before.
    pub waited: bool,
}

/// The [`crate::transform::prefix_digest`]s a body's check computed — of
/// its bytes up to where the body it continues ended its messages, and up
/// to where its own end — for the body whose bytes are at `body` (address
/// and length: a body that is not the one checked, a session's history
/// added, has none).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Digests {
    body: (usize, usize),
    pub before: Option<(usize, u128)>,
    pub now: Option<(usize, u128)>,
}

impl Digests {
    /// The digests of `body`, when they are its.
    pub fn of(self, body: &[u8]) -> Digests {
        match self.body == (body.as_ptr() as usize, body.len()) {
            true => self,
            false => Digests::default(),
        }
    }

    pub fn new(body: &[u8], before: Option<(usize, u128)>, now: Option<(usize, u128)>) -> Self {
        Digests {
            body: (body.as_ptr() as usize, body.len()),
            before,
            now,
        }
    }
}

type List = Arc<Mutex<VecDeque<Checked>>>;

pub struct CheckedPrefixes {
    starts: moka::sync::Cache<u64, List>,
}

/// The keyed hash of a body's bytes up to a prefix's end
/// ([`crate::transform::prefix_digest`]) as it goes: checked at a
/// candidate's end, then carried on to the body's own.
#[derive(Clone)]
pub struct Hashed {
    at: usize,
    hasher: Xxh3,
    /// The digest up to `at`.
    digest: u128,
}

impl Hashed {
    fn new() -> Hashed {
        Hashed {
            at: 0,
            hasher: crate::transform::prefix_hasher(),
            digest: 0,
        }
    }

    /// Where the bytes hashed end.
    pub fn end(&self) -> usize {
        self.at
    }

    /// The digest of the bytes up to [`Hashed::end`].
    pub fn digest(&self) -> u128 {
        self.digest
    }

    fn upto(mut self, body: &[u8], end: usize) -> (Hashed, u128) {
        if end > self.at {
            self.hasher.update(&body[self.at..end]);
            self.at = end;
        }
        let h = self.hasher.digest128();
        self.digest = h;
        (self, h)
    }
}

fn tail(prefix: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&prefix[prefix.len().saturating_sub(TAIL)..])
}

/// Where a scanned body's messages end, and whether its `model` key came
/// before.
pub struct Mark {
    end: Option<usize>,
    model_key: bool,
}

impl Mark {
    pub fn of(scanner: &JsonScanner) -> Mark {
        let end = scanner.items_end().and_then(|e| usize::try_from(e).ok());
        Mark {
            end,
            model_key: end.is_some_and(|e| scanner.model_key_before(e as u64)),
        }
    }
}

/// A body to check: its client, and the prefixes it may continue.
pub struct Resumable {
    checked: Arc<CheckedPrefixes>,
    tenant: u64,
    /// `Some` once the first bytes were looked up: the candidates, newest
    /// first (none: the body is checked as it comes).
    candidates: Option<Vec<Checked>>,
}

impl Default for CheckedPrefixes {
    fn default() -> Self {
        Self::new()
    }
}

impl CheckedPrefixes {
    pub fn new() -> CheckedPrefixes {
        CheckedPrefixes {
            starts: moka::sync::Cache::builder()
                .max_capacity(BYTES)
                .eviction_policy(EvictionPolicy::lru())
                .weigher(|_: &u64, l: &List| {
                    // Each entry with its two shared allocations (the model,
                    // the flag); the list with its lock and the cache's own
                    // bookkeeping.
                    let weight = l.lock().map_or(0, |l| {
                        l.capacity() * std::mem::size_of::<Checked>()
                            + l.iter()
                                .map(|c| 64 + c.model.as_ref().map_or(0, |m| m.len()))
                                .sum::<usize>()
                    });
                    u32::try_from(weight + 256).unwrap_or(u32::MAX)
                })
                .build(),
        }
    }

    /// For a body of `len` bytes (its `Content-Length`) from `tenant`:
    /// `None` for one under [`MIN_BODY`].
    pub fn for_body(self: &Arc<Self>, tenant: u64, len: u64) -> Option<Resumable> {
        (len >= MIN_BODY as u64).then(|| Resumable {
            checked: self.clone(),
            tenant,
            candidates: None,
        })
    }

    fn start(tenant: u64, body: &[u8]) -> Option<u64> {
        crate::transform::start_key(tenant, body)
    }

    /// Bytes kept (after pending evictions).
    pub fn weight(&self) -> u64 {
        self.starts.run_pending_tasks();
        self.starts.weighted_size()
    }
}

impl Resumable {
    /// Looks up the candidates by the body's first bytes (`first`: at
    /// least [`crate::transform::START`] of them); whether there are any,
    /// so the check waits for the whole body.
    pub fn look_up(&mut self, first: &[u8]) -> bool {
        let found: Vec<Checked> = CheckedPrefixes::start(self.tenant, first)
            .and_then(|s| self.checked.starts.get(&s))
            .and_then(|l| l.lock().ok().map(|l| l.iter().rev().cloned().collect()))
            .unwrap_or_default();
        let any = !found.is_empty();
        self.candidates = Some(found);
        any
    }

    /// The scanner for the whole `body`, from the newest candidate whose
    /// bytes it begins with, the hash up to there, and whether those bytes
    /// were found to hold nothing the inspector strips; `None`: none is.
    pub fn resume(&self, body: &[u8]) -> Option<(JsonScanner, Hashed, bool)> {
        let candidates = self.candidates.as_ref()?;
        for c in candidates {
            if c.end >= body.len() || tail(&body[..c.end]) != c.tail {
                continue;
            }
            let (hashed, h) = Hashed::new().upto(body, c.end);
            if h == c.hash {
                let model = c.model.as_deref().map(str::to_owned);
                let scanner = JsonScanner::resumed(c.end as u64, c.model_key, model);
                return Some((scanner, hashed, c.clean.load(Ordering::Relaxed)));
            }
        }
        None
    }

    /// Keeps where `body`, found to be a JSON object, ends its messages
    /// (`mark`: [`Mark::of`] its scanner), and its `model`; `hashed`: its
    /// hash so far. The flag to set once the body is found to hold nothing
    /// the inspector strips, and the digest up to the messages' end.
    pub fn keep(
        &self,
        body: &[u8],
        mark: Mark,
        model: Option<&str>,
        hashed: Option<Hashed>,
    ) -> Option<(Arc<AtomicBool>, (usize, u128))> {
        let end = mark.end?;
        if body.len() < MIN_BODY || end > body.len() {
            return None;
        }
        let start = CheckedPrefixes::start(self.tenant, &body[..end])?;
        let clean = Arc::new(AtomicBool::new(false));
        let hashed = hashed.filter(|h| h.at <= end).unwrap_or_else(Hashed::new);
        let (_, hash) = hashed.upto(body, end);
        let model_key = mark.model_key;
        let checked = Checked {
            end,
            tail: tail(&body[..end]),
            hash,
            model_key,
            model: model.filter(|_| model_key).map(Arc::from),
            clean: clean.clone(),
        };
        self.checked.starts.entry(start).and_compute_with(|found| {
            let list = found.map(|e| e.into_value()).unwrap_or_default();
            if let Ok(mut l) = list.lock() {
                l.retain(|o| o.end != end || o.hash != hash);
                while l.len() >= PER_START {
                    l.pop_front();
                }
                l.push_back(checked);
            }
            moka::ops::compute::Op::Put(list)
        });
        Some((clean, (end, hash)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::request_body::WholeBody;
    use super::*;
    use bytes::Bytes;
    use proptest::prelude::*;

    /// `body` pushed in `piece`-byte chunks and finished, with the client's
    /// checked prefixes or without.
    fn check(
        body: impl AsRef<[u8]>,
        piece: usize,
        resumable: Option<Resumable>,
    ) -> Result<(Option<String>, Bytes), String> {
        let body = body.as_ref();
        let mut w = WholeBody::resuming(body.len() as u64, resumable);
        for c in body.chunks(piece.max(1)) {
            w.push(Bytes::copy_from_slice(c));
        }
        w.finish()
    }

    fn message(i: usize, kind: u8) -> String {
        let text = "x".repeat(1500 + i % 17);
        match kind % 4 {
            0 => format!(r#"{{"role":"user","content":"{text} \"{i}\"\n"}}"#),
            1 => format!(
                r#"{{"role":"assistant","content":[{{"type":"text","text":"{text}"}}],"n":[1,2.5e3,true,null]}}"#
            ),
            2 => format!(r#"{{ "role" : "tool" , "content" : "é {text}" }}"#),
            // Not a list of messages: an object (nothing to go on from).
            _ if i == 0 && kind == 7 => format!(r#"{{"pad":"{text}","a":{{}}}}"#),
            _ => format!(r#"[{{"a":"{text}"}}]"#),
        }
    }

    /// A body with `messages` and the model's key before or after them
    /// (an object-valued `messages` when the first message is a member).
    fn body(messages: &[String], model_first: bool, tail: &str) -> String {
        if messages.first().is_some_and(|m| m.starts_with(r#"{"pad""#)) {
            let rest = messages[1..]
                .iter()
                .map(|m| format!(r#","m{}":{m}"#, m.len()));
            let object = format!(
                "{}{}",
                &messages[0][..messages[0].len() - 1],
                rest.collect::<String>()
            );
            return format!(r#"{{"model":"m-1","messages":{object}}}{tail}}}"#);
        }
        let items = messages.join(",\n ");
        match model_first {
            true => format!(r#"{{"model":"m-1","messages":[{items}]{tail}}}"#),
            false => format!(r#"{{"messages": [ {items} ],"stream":false{tail},"model":"m-1"}}"#),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Each turn checked from where the turn before's messages ended
        /// finds what a check of the whole body finds — the model, or the
        /// same error at the same byte — and continues every valid turn
        /// after the first.
        #[test]
        fn a_body_checked_on_from_its_prefix_is_checked_as_a_whole(
            kinds in proptest::collection::vec(0u8..8, 30..60),
            model_first in any::<bool>(),
            piece in prop_oneof![Just(usize::MAX), 1000usize..9000],
            tails in proptest::collection::vec(0u8..6, 4..8),
        ) {
            let checked = Arc::new(CheckedPrefixes::new());
            let mut messages = Vec::new();
            let mut k = kinds.iter();
            let mut before_ok = false;
            for (turn, t) in tails.iter().enumerate() {
                for _ in 0..6 {
                    let i = messages.len();
                    messages.push(message(i, *k.next().unwrap_or(&0)));
                }
                let tail = match t {
                    0 => r#","tools":[{"name":"sh"}]"#,
                    1 => r#","Model":"again""#,
                    2 => r#","x":"\ud800 not closed"#,
                    3 => r#","y":tru"#,
                    4 => ",\"z\":\"\u{7f}\"",
                    _ => "",
                };
                // Not UTF-8 after the messages (a DEL byte made 0xff).
                let mut text = body(&messages, model_first, tail).into_bytes();
                if let Some(at) = text.iter().rposition(|&b| b == 0x7f) {
                    text[at] = 0xff;
                }
                let mut r = checked.for_body(7, text.len() as u64).unwrap();
                let whole = check(&text, piece, None);
                let resumed = match r.look_up(&text[..crate::transform::START]) {
                    true => r.resume(&text).is_some(),
                    false => false,
                };
                let on = check(&text, piece, checked.for_body(7, text.len() as u64));
                prop_assert_eq!(on.as_ref().map(|(m, b)| (m, b.len())), whole.as_ref().map(|(m, b)| (m, b.len())), "turn {}", turn);
                // Each valid turn left its prefix, and later ones take up
                // the newest.
                prop_assert_eq!(resumed, before_ok, "turn {}", turn);
                let listed = !messages[0].starts_with(r#"{"pad""#);
                before_ok |= whole.is_ok() && listed;
            }
        }
    }

    fn conversation(n: usize) -> String {
        let messages: Vec<String> = (0..n).map(|i| message(i, 0)).collect();
        body(&messages, true, "")
    }

    /// An object-valued `messages` leaves no point to go on from: what
    /// follows its members is checked as part of the whole body.
    #[test]
    fn messages_that_are_not_a_list_are_checked_whole() {
        let checked = Arc::new(CheckedPrefixes::new());
        let pad = "p".repeat(9000);
        let first = format!(r#"{{"model":"m","messages":{{"pad":"{pad}","a":{{}}}}}}"#);
        check(&first, usize::MAX, checked.for_body(1, first.len() as u64)).unwrap();
        let cut = first.len() - 2;
        for rest in [",{}]}", r#","b":1}}"#] {
            let next = format!("{}{rest}", &first[..cut]);
            let got = check(&next, usize::MAX, checked.for_body(1, next.len() as u64));
            assert_eq!(got, check(&next, usize::MAX, None), "{rest}");
        }
        assert!(check(format!("{},{{}}]}}", &first[..cut]), 1000, None).is_err());
    }

    #[test]
    fn a_changed_byte_before_the_end_is_checked_and_refused() {
        let checked = Arc::new(CheckedPrefixes::new());
        let first = conversation(40);
        assert!(check(&first, usize::MAX, checked.for_body(1, first.len() as u64)).is_ok());
        // The next turn, with a control byte slipped into an earlier
        // message: not the bytes checked, so checked whole and refused.
        let next = conversation(42).replacen(" \\\"3\\\"", " \\\"3\u{1}\\\"", 1);
        assert!(next.as_bytes()[..first.len() - 2] != first.as_bytes()[..first.len() - 2]);
        let got = check(&next, usize::MAX, checked.for_body(1, next.len() as u64));
        assert_eq!(got, check(&next, usize::MAX, None));
        assert!(got.unwrap_err().contains("control character"));
    }

    #[test]
    fn another_clients_prefix_is_never_a_candidate_and_the_bound_holds() {
        let checked = Arc::new(CheckedPrefixes::new());
        let first = conversation(40);
        check(&first, usize::MAX, checked.for_body(1, first.len() as u64)).unwrap();
        let next = conversation(41);
        let mut bob = checked.for_body(2, next.len() as u64).unwrap();
        assert!(!bob.look_up(next.as_bytes()));
        let mut alice = checked.for_body(1, next.len() as u64).unwrap();
        assert!(alice.look_up(next.as_bytes()));
        assert!(alice.resume(next.as_bytes()).is_some());
        // Small bodies are not followed.
        assert!(checked.for_body(1, 100).is_none());
        // Many clients: what is kept stays within its bound.
        for client in 0..3000 {
            check(
                &first,
                usize::MAX,
                checked.for_body(client, first.len() as u64),
            )
            .unwrap();
        }
        assert!(checked.weight() <= BYTES);
        assert!(checked.weight() > 0);
    }
}
