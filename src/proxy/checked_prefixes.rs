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
//! is. Nothing of a body is kept but its hash, where its messages end, its
//! `model` and which of the [`Words`] it holds up to there.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use moka::policy::EvictionPolicy;

use super::dedup_states::MIN_BODY;
use super::request_body::JsonScanner;

/// Prefixes kept per client and beginning, the oldest out first.
const PER_START: usize = 64;
/// The bound on all that is kept.
const BYTES: u64 = 16 << 20;
/// The bytes before a prefix's end a candidate is checked by first.
const TAIL: usize = 64;
/// A body that continues none has its [`Words`] looked for (one pass up
/// to its messages' end) only when they end within this many bytes: a
/// first body larger (a large image sent once) is not read for them.
const WORDS_FIRST_MAX: usize = 1 << 20;
/// A body that continues one without words (a large first body, or the
/// first seen after a restart) is read for them, once a conversation,
/// when its messages end within this many bytes; the bodies after it are
/// then read only after it, where without the words each would be
/// searched whole (at most to a needle's first place) on every turn.
const WORDS_CONTINUED_MAX: usize = 16 << 20;

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
    /// The [`Words`] in its bytes up to `end`, when they were looked for.
    words: Option<Words>,
    /// Set once the inspector found the body holds nothing it strips.
    clean: Arc<AtomicBool>,
}

/// Which of [`Words::NEEDLES`] some bytes hold: what the transforms look
/// for before reading a body (a body without the word `image` holds no
/// image), known for a conversation's earlier bytes so that its next body
/// is looked at only after them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Words(u8);

/// The [`Words`] of a body's bytes up to a point, and the point.
pub type WordsAt = (usize, Words);

impl Words {
    pub const NEEDLES: [&'static [u8]; 6] = [
        b"image",
        b"\"file\"",
        b"\"input_file\"",
        b"\"document\"",
        b"\"input_audio\"",
        b"\"audio\"",
    ];
    const ALL: u8 = (1 << Self::NEEDLES.len()) - 1;

    /// The words in `bytes`, in one pass.
    pub fn in_bytes(bytes: &[u8]) -> Words {
        static SEARCHER: std::sync::LazyLock<Option<aho_corasick::AhoCorasick>> =
            std::sync::LazyLock::new(|| aho_corasick::AhoCorasick::new(Words::NEEDLES).ok());
        let Some(searcher) = SEARCHER.as_ref() else {
            // (Literal needles always build a searcher.) A pass a needle.
            let found = Self::NEEDLES.iter().enumerate();
            return Words(
                found.fold(0, |w, (i, n)| match memchr::memmem::find(bytes, n) {
                    Some(_) => w | 1 << i,
                    None => w,
                }),
            );
        };
        let mut seen = 0u8;
        // Overlapping: a needle that shares bytes with another is found too.
        for m in searcher.find_overlapping_iter(bytes) {
            seen |= 1 << m.pattern().as_usize();
            if seen == Self::ALL {
                break;
            }
        }
        Words(seen)
    }

    /// The words in `body[..to]`, `self` being those in `body[..from]`:
    /// only the bytes after `from` (and a needle's length before) are read.
    pub fn on(self, body: &[u8], from: usize, to: usize) -> Words {
        let longest = Self::NEEDLES.iter().map(|n| n.len()).max().unwrap_or(1);
        let to = to.min(body.len());
        match from.min(to) {
            0 => Words::in_bytes(&body[..to]),
            from => {
                Words(self.0 | Words::in_bytes(&body[(from + 1).saturating_sub(longest)..to]).0)
            }
        }
    }

    /// Whether `needle` (one of [`Words::NEEDLES`]) is among them; `None`
    /// for another needle.
    pub fn has(self, needle: &[u8]) -> Option<bool> {
        let i = Self::NEEDLES.iter().position(|n| *n == needle)?;
        Some(self.0 & (1 << i) != 0)
    }
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
    /// The [`Words`] in the body's bytes up to the first number.
    seen: Option<WordsAt>,
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
            seen: None,
        }
    }

    /// With the [`Words`] in the body's first `upto` bytes known.
    pub fn seeing(self, upto: usize, words: Words) -> Self {
        Digests {
            seen: Some((upto, words)),
            ..self
        }
    }

    /// Whether `body` (the one these are [`Digests::of`]) holds `needle`:
    /// for one of [`Words::NEEDLES`], only the bytes after those whose
    /// words are known are read.
    pub fn holds(&self, body: &[u8], needle: &[u8]) -> bool {
        let known = self
            .seen
            .filter(|(upto, _)| {
                *upto <= body.len() && self.body == (body.as_ptr() as usize, body.len())
            })
            .and_then(|(upto, words)| Some((upto, words.has(needle)?)));
        match known {
            Some((_, true)) => true,
            Some((upto, false)) => {
                let from = (upto + 1).saturating_sub(needle.len());
                memchr::memmem::find(&body[from.min(upto)..], needle).is_some()
            }
            None => memchr::memmem::find(body, needle).is_some(),
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
    hasher: crate::transform::PrefixHasher,
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
        self.feed(body, end);
        let h = self.hasher.digest128();
        self.digest = h;
        (self, h)
    }

    /// Hashes on up to `end` (no digest).
    fn feed(&mut self, body: &[u8], end: usize) {
        if end > self.at {
            self.hasher.update(&body[self.at..end]);
            self.at = end;
        }
    }
}

/// The hash of a body that may continue one of its candidates, taken on
/// as its bytes come (while the rest is on its way), up to the furthest
/// candidate's end, with the hash kept at each candidate's end.
#[derive(Clone)]
struct Hashing {
    /// The candidates' ends still ahead, furthest first.
    ahead: Vec<usize>,
    hashed: Hashed,
    /// The hash as it was at each end passed.
    at_ends: Vec<Hashed>,
}

impl Hashing {
    fn new(candidates: &[Checked]) -> Hashing {
        let mut ahead: Vec<usize> = candidates.iter().map(|c| c.end).collect();
        ahead.sort_unstable_by(|a, b| b.cmp(a));
        ahead.dedup();
        Hashing {
            ahead,
            hashed: Hashed::new(),
            at_ends: Vec::new(),
        }
    }

    /// On over `received` (the body's bytes so far).
    fn on(&mut self, received: &[u8]) {
        // `ahead` is kept furthest first: the nearest is popped.
        while let Some(&end) = self.ahead.last() {
            if end > received.len() {
                self.hashed.feed(received, received.len());
                return;
            }
            let (hashed, _) = self.hashed.clone().upto(received, end);
            self.hashed = hashed.clone();
            self.at_ends.push(hashed);
            self.ahead.pop();
        }
    }

    /// The hash of `body` up to `end`, from what was hashed already.
    fn to(&self, body: &[u8], end: usize) -> (Hashed, u128) {
        if let Some(h) = self.at_ends.iter().find(|h| h.at == end) {
            return (h.clone(), h.digest);
        }
        match self.hashed.at <= end {
            true => self.hashed.clone().upto(body, end),
            false => Hashed::new().upto(body, end),
        }
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

/// What [`Resumable::keep`] kept of a body: the flag to set once it is
/// found to hold nothing the inspector strips, its digest up to its
/// messages' end, and the [`Words`] up to there (when looked for).
pub struct Kept {
    pub clean: Arc<AtomicBool>,
    pub digest: (usize, u128),
    pub words: Option<Words>,
}

/// A body to check: its client, and the prefixes it may continue.
pub struct Resumable {
    checked: Arc<CheckedPrefixes>,
    tenant: u64,
    /// `Some` once the first bytes were looked up: the candidates, newest
    /// first (none: the body is checked as it comes).
    candidates: Option<Vec<Checked>>,
    /// The body's hash as it comes, once there are candidates.
    hashing: Option<Hashing>,
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
            hashing: None,
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
        self.hashing = any.then(|| Hashing::new(&found));
        self.candidates = Some(found);
        any
    }

    /// Hashes on over the body's bytes so far (`received`), when it has
    /// candidates: the hash is then ready, or nearly, when the body is
    /// whole.
    pub fn on(&mut self, received: &[u8]) {
        if let Some(h) = self.hashing.as_mut() {
            h.on(received);
        }
    }

    /// The scanner for the whole `body`, from the newest candidate whose
    /// bytes it begins with, the hash up to there, the [`Words`] in those
    /// bytes, and whether they were found to hold nothing the inspector
    /// strips; `None`: none is.
    pub fn resume(&self, body: &[u8]) -> Option<(JsonScanner, Hashed, Option<WordsAt>, bool)> {
        let candidates = self.candidates.as_ref()?;
        for c in candidates {
            if c.end >= body.len() || tail(&body[..c.end]) != c.tail {
                continue;
            }
            let (hashed, h) = match &self.hashing {
                Some(hashing) => hashing.to(body, c.end),
                None => Hashed::new().upto(body, c.end),
            };
            if h == c.hash {
                let model = c.model.as_deref().map(str::to_owned);
                let scanner = JsonScanner::resumed(c.end as u64, c.model_key, model);
                let words = c.words.map(|w| (c.end, w));
                return Some((scanner, hashed, words, c.clean.load(Ordering::Relaxed)));
            }
        }
        None
    }

    /// Keeps where `body`, found to be a JSON object, ends its messages
    /// (`mark`: [`Mark::of`] its scanner), and its `model`; `hashed`: its
    /// hash so far, `words` those of its first bytes (from [`Resumable::resume`]).
    /// The flag to set once the body is found to hold nothing the inspector
    /// strips, the digest up to the messages' end, and the words up to there.
    pub fn keep(
        &self,
        body: &[u8],
        mark: Mark,
        model: Option<&str>,
        (hashed, words): (Option<Hashed>, Option<WordsAt>),
    ) -> Option<Kept> {
        let end = mark.end?;
        if body.len() < MIN_BODY || end > body.len() {
            return None;
        }
        let start = CheckedPrefixes::start(self.tenant, &body[..end])?;
        let clean = Arc::new(AtomicBool::new(false));
        let continues = hashed.is_some();
        let hashed = hashed.filter(|h| h.at <= end).unwrap_or_else(Hashed::new);
        let (_, hash) = hashed.upto(body, end);
        let model_key = mark.model_key;
        let words = match words.filter(|(at, _)| *at <= end) {
            Some((from, words)) => Some(words.on(body, from, end)),
            None => {
                let within = match continues {
                    true => WORDS_CONTINUED_MAX,
                    false => WORDS_FIRST_MAX,
                };
                (end <= within).then(|| Words::in_bytes(&body[..end]))
            }
        };
        let checked = Checked {
            end,
            tail: tail(&body[..end]),
            hash,
            model_key,
            model: model.filter(|_| model_key).map(Arc::from),
            words,
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
        Some(Kept {
            clean,
            digest: (end, hash),
            words,
        })
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

    /// A message with `needle` (an index into [`Words::NEEDLES`]; others:
    /// none) in its text at `at`, and a needle's first bytes at its end.
    fn message_with(needle: usize, at: usize) -> String {
        let mut text = "y".repeat(1600);
        if let Some(n) = Words::NEEDLES.get(needle) {
            let n = String::from_utf8_lossy(n).replace('"', "\\\"");
            text.insert_str(at.min(text.len()), &n);
        }
        format!(r#"{{"role":"user","content":"{text} \"inp"}}"#)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Whether a body holds each word, looked for only after the bytes
        /// it shares with its conversation's body before, is what a look
        /// at all of it finds, turn after turn; each turn goes on from the
        /// one before, however its bytes came.
        #[test]
        fn a_continued_body_holds_the_words_a_look_at_all_of_it_finds(
            placed in proptest::collection::vec((0usize..12, 0usize..1700), 24..48),
            model_first in any::<bool>(),
            tails in proptest::collection::vec(0usize..12, 4..8),
            piece in prop_oneof![Just(usize::MAX), 500usize..7000],
        ) {
            let checked = Arc::new(CheckedPrefixes::new());
            let mut messages = Vec::new();
            let mut p = placed.iter();
            for (turn, t) in tails.iter().enumerate() {
                for _ in 0..6 {
                    let (n, at) = p.next().copied().unwrap_or((9, 0));
                    messages.push(message_with(n, at));
                }
                let tail = match Words::NEEDLES.get(*t) {
                    Some(n) => format!(
                        r#","tools":[{{"type":"{}"}}]"#,
                        String::from_utf8_lossy(n).replace('"', "\\\"")
                    ),
                    None => String::new(),
                };
                let text = body(&messages, model_first, &tail);
                // Pushed as it comes, in pieces: hashed on as they come.
                let mut w = WholeBody::resuming(text.len() as u64, checked.for_body(3, text.len() as u64));
                for c in text.as_bytes().chunks(piece) {
                    w.push(Bytes::copy_from_slice(c));
                }
                let (_, bytes, shared) = w.finish_shared().unwrap();
                let digests = shared.digests.of(&bytes);
                prop_assert_eq!(digests.seen.is_some(), true, "turn {}", turn);
                prop_assert_eq!(digests.before.is_some(), turn > 0, "turn {}", turn);
                for n in Words::NEEDLES {
                    let all = memchr::memmem::find(&bytes, n).is_some();
                    prop_assert_eq!(digests.holds(&bytes, n), all, "turn {} {:?}", turn, String::from_utf8_lossy(n));
                }
                // Another body, or a needle not kept: looked for in all of it.
                prop_assert!(Digests::default().holds(b"an image", b"image"));
                prop_assert!(!digests.holds(b"an image", b"\"pdf\""));
            }
        }
    }

    /// A first body over [`WORDS_FIRST_MAX`] is not read for its words (it
    /// is looked at whole); the first body that continues it is, and the
    /// bodies after that one are read only after it. All say what a look
    /// at the whole body says.
    #[test]
    fn a_large_first_body_leaves_no_words_and_its_next_learns_them() {
        let checked = Arc::new(CheckedPrefixes::new());
        // One word in the first body; `image` only in the third's new message.
        let mut messages: Vec<String> = (0..700)
            .map(|i| message_with(if i == 3 { 1 } else { 9 }, i))
            .collect();
        for turn in 0..3 {
            let text = body(&messages, true, "");
            assert!(text.len() > WORDS_FIRST_MAX);
            let mut w =
                WholeBody::resuming(text.len() as u64, checked.for_body(5, text.len() as u64));
            w.push(Bytes::copy_from_slice(text.as_bytes()));
            let (_, bytes, shared) = w.finish_shared().unwrap();
            let digests = shared.digests.of(&bytes);
            assert_eq!(digests.before.is_some(), turn > 0);
            // Known up to this body's messages' end from its second turn.
            let end = digests.now.map(|(end, _)| end);
            assert_eq!(
                digests.seen.map(|(at, _)| at),
                end.filter(|_| turn > 0),
                "turn {turn}"
            );
            for n in Words::NEEDLES {
                assert_eq!(
                    digests.holds(&bytes, n),
                    memchr::memmem::find(&bytes, n).is_some()
                );
            }
            assert_eq!(digests.holds(&bytes, b"image"), turn == 2, "turn {turn}");
            messages.push(message_with(if turn == 1 { 0 } else { 9 }, 5));
        }
    }

    #[test]
    fn words_read_on_from_a_point_are_the_words_of_the_whole() {
        let text = br#"{"a":"im","b":"age \"file\" "input_audio" x"#;
        for from in 0..text.len() {
            let before = Words::in_bytes(&text[..from]);
            for to in from..=text.len() {
                assert_eq!(
                    before.on(text, from, to),
                    Words::in_bytes(&text[..to]),
                    "{from}..{to}"
                );
            }
        }
        assert_eq!(Words::in_bytes(b"image").has(b"image"), Some(true));
        assert_eq!(Words::in_bytes(b"imag").has(b"image"), Some(false));
        assert_eq!(Words::default().has(b"pdf"), None);
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
