//! Prompt caching: providers bill a cached prefix at about a tenth, and
//! visor helps every request be read from the cache — and says why, when
//! it is not.
//!
//! - [`anatomy`]: a request as the cache sees it (the head, then each
//!   message; hashed without cache markers; tokens estimated).
//! - [`breakpoints`]: where visor's `cache_control` markers go on a
//!   Messages request to an Anthropic-kind upstream that carries none.
//! - [`ledger`]: a conversation's last request kept as hashes, and the next
//!   request judged against it (readable tokens, the cause of a miss).
//! - [`PromptCache`] (here): the part the proxy calls once per request —
//!   markers or a `prompt_cache_key` added, the judging done, the record
//!   kept (in this process, or in a shared store so replicas follow one
//!   conversation).
//!
//! The first three are pure; this file holds the little state.

pub mod anatomy;
pub mod breakpoints;
pub mod ledger;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use std::time::Duration;

use bytes::Bytes;
use http::HeaderValue;

use crate::api::Shape;
use crate::config::Cache;
use crate::metrics::Metrics;
use crate::store::{Shared, Store};
use anatomy::Anatomy;
use ledger::{Cause, Judging, Reads, Record, Said, Verdict};

/// A conversation's last request is kept this long after it (long past
/// any cache's lifetime, so a late request is `expired`, not `first`).
pub const RECORD_TTL: Duration = Duration::from_secs(24 * 3600);

/// Records kept in this process, in bytes at most.
const MEMORY_BYTES: u64 = 64 * 1024 * 1024;

/// The cache minimum when the model table does not say.
pub const DEFAULT_MIN_TOKENS: u64 = 1024;

pub struct PromptCache {
    config: Cache,
    /// Conversations' last requests, by conversation.
    recent: moka::future::Cache<u64, Arc<Record>>,
    store: Arc<Store>,
}

/// One request, as the proxy hands it over.
pub struct Asked<'a> {
    pub shape: Shape,
    /// The body as the client sent it (with a session's history).
    pub received: &'a Bytes,
    /// The body the transforms made of it.
    pub prepared: &'a Bytes,
    pub model: &'a str,
    /// The caller's key name (`none` without one).
    pub key_name: &'a str,
    /// `x-visor-session`, when set.
    pub session: Option<&'a str>,
    /// The upstream is of the Anthropic kind (caches at breakpoints).
    pub anthropic_kind: bool,
    /// Every upstream the request may go to opted in to
    /// `prompt_cache_key`.
    pub cache_key: bool,
    /// The model's `cache_min_tokens`.
    pub min_tokens: Option<u32>,
    /// The request may be changed (`x-visor-transform` is not `off`).
    pub may_change: bool,
    /// What was read of the conversation's previous request, which this
    /// one begins with up to the end of its messages (the caller checked
    /// the received bytes; the sent ones are checked here).
    pub continues: Option<Prefixes>,
    /// Keep what is read of this request ([`Applied::prefixes`]).
    pub leaves: bool,
}

/// What was read of a request up to the end of its messages, as received
/// and as sent, for its conversation's next request to read only what
/// follows ([`anatomy::Anatomy::of_from`]).
#[derive(Debug, Clone)]
pub struct Prefixes {
    received: anatomy::Prefix,
    sent: Sent,
}

/// The body as sent, against the body as received.
#[derive(Debug, Clone)]
enum Sent {
    /// It was the same body.
    Same,
    /// Another body, read up to the end of its messages, a hash of its
    /// bytes up to there, and a flag the inspector sets once it finds the
    /// body holds nothing it strips.
    Read(anatomy::Prefix, u128, Arc<AtomicBool>),
    /// Another body, nothing kept of it.
    Unread,
}

impl Prefixes {
    /// What reading `body` (sent as received) keeps.
    #[cfg(test)]
    pub(crate) fn of(shape: Shape, body: &[u8]) -> Option<Prefixes> {
        let received = Anatomy::of(shape, body)?.into_prefix()?;
        Some(Prefixes {
            received,
            sent: Sent::Same,
        })
    }

    /// Where the received body's messages end.
    pub fn end(&self) -> usize {
        self.received.end()
    }

    /// About how much memory it holds, in bytes.
    pub fn size(&self) -> usize {
        self.received.size()
            + match &self.sent {
                Sent::Read(p, ..) => p.size(),
                Sent::Same | Sent::Unread => 0,
            }
    }
}

/// What the proxy does with a request's caching.
#[derive(Debug, Default)]
pub struct Applied {
    /// The body with visor's markers or key, when it added any.
    pub body: Option<Bytes>,
    /// The breakpoints visor placed.
    pub breakpoints: usize,
    /// The judging, for the response header and, at the end, the metrics
    /// and the log line. `None`: not followed (a Responses request that
    /// continues a stored response, a body visor cannot read).
    pub seen: Option<Seen>,
    /// What was read of the request, when [`Asked::leaves`].
    pub prefixes: Option<Prefixes>,
    /// The body as sent (when the transforms changed it) begins with this
    /// many bytes of the conversation's previous one as sent, which held
    /// nothing the inspector strips.
    pub sent_clean: usize,
    /// Set by the inspector once it finds the body as sent (not
    /// [`Applied::body`]) holds nothing it strips.
    pub sent_mark: Option<Arc<AtomicBool>>,
    /// The body as received was read on from [`Asked::continues`].
    pub continued: bool,
}

/// What is known of a request's caching before its answer, and what is
/// kept of it once the answer comes.
#[derive(Debug, Clone)]
pub struct Seen {
    pub verdict: Verdict,
    /// visor's estimate of the prompt's tokens.
    pub estimated: u64,
    pub shape: Shape,
    conversation: u64,
    record: Arc<Record>,
}

/// What the answer's `usage` said of the prompt.
#[derive(Debug, Clone, Copy, Default)]
pub struct Answered {
    /// Input tokens as the provider counts them (Anthropic's leave out
    /// what it read and wrote).
    pub prompt: u64,
    pub read: u64,
    pub written: u64,
    /// It said a cache figure at all.
    pub cache_said: bool,
}

impl Seen {
    /// The conversation it belongs to.
    pub fn conversation(&self) -> u64 {
        self.conversation
    }

    /// `x-visor-cache`: `readable=M`, and `; miss=CAUSE` when a cause is
    /// known before the answer.
    pub fn header(&self) -> HeaderValue {
        let v = &self.verdict;
        if v.readable == 0 && v.cause.is_none() {
            // Most requests: nothing readable and nothing missed.
            return HeaderValue::from_static("readable=0");
        }
        let text = match v.cause {
            Some(c) => format!("readable={}; miss={}", v.readable, c.label()),
            None => format!("readable={}", v.readable),
        };
        HeaderValue::from_str(&text).unwrap_or(HeaderValue::from_static("readable=0"))
    }

    /// Once the answer ended: counts the tokens (when the provider said
    /// its cache figures) and the miss, and returns them for the log line.
    /// `answered`: `None` when the answer never said its usage; then only a
    /// cause known before it is counted, as when the provider says nothing
    /// of a cache (it may have none: no `provider` miss is made up).
    pub fn settle(&self, metrics: &Metrics, answered: Option<Answered>) -> Settled {
        let known = |cause: Option<Cause>| {
            if let Some(c) = cause {
                metrics.cache_misses.with_label_values(&[c.label()]).inc();
            }
            Settled {
                readable: None,
                cause,
                at: self.verdict.at,
            }
        };
        let Some(a) = answered.filter(|a| a.cache_said) else {
            return known(self.verdict.cause);
        };
        let total = match self.shape {
            Shape::Messages => a.prompt + a.read + a.written,
            Shape::Chat | Shape::Responses => a.prompt,
        };
        let said = Said {
            prompt: total,
            read: a.read,
            written: a.written,
        };
        let (readable, cause) = ledger::settle(self.verdict, self.estimated, said);
        let kinds = [
            ("readable", readable),
            ("read", a.read),
            ("written", a.written),
        ];
        for (kind, n) in kinds {
            metrics.cache_tokens.with_label_values(&[kind]).inc_by(n);
        }
        Settled {
            readable: Some(readable),
            ..known(cause)
        }
    }
}

/// A request's caching, once its answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// The readable tokens in the provider's count (`None`: it did not say).
    pub readable: Option<u64>,
    pub cause: Option<Cause>,
    pub at: Option<usize>,
}

/// The request as received and, when the transforms changed it, as sent
/// (`None` for either: a body that is not its API's object). Each read
/// from where the conversation's previous request's messages ended when
/// [`Asked::continues`] (the sent one when its bytes up to there are the
/// same: then also how many of them held nothing the inspector strips);
/// and whether the received one was read on so.
fn read(asked: &mut Asked<'_>) -> Option<(Anatomy, Option<SentBody>, bool)> {
    let shape = asked.shape;
    let (from_received, from_sent) = match asked.continues.take() {
        Some(p) => (Some(p.received), Some(p.sent)),
        None => (None, None),
    };
    let of = |body: &[u8], from: Option<anatomy::Prefix>| match from {
        Some(p) => Anatomy::of_from(shape, body, p),
        None => Anatomy::of(shape, body),
    };
    let (received, continued) = match from_received {
        Some(p) => Anatomy::read_on(shape, asked.received, p)?,
        None => (Anatomy::of(shape, asked.received)?, false),
    };
    // The same bytes (most often the same buffer: not compared).
    let (p, r) = (asked.prepared, asked.received);
    if p.as_ptr() == r.as_ptr() && p.len() == r.len() || p == r {
        return Some((received, None, continued));
    }
    let (mut from, mut clean, mut hashed) = (None, 0, None);
    if let Some(Sent::Read(prefix, hash, was_clean)) = from_sent
        && prefix.end() <= p.len()
    {
        let mut h = crate::transform::prefix_hasher();
        h.update(&p[..prefix.end()]);
        if h.digest128() == hash {
            // (After a closing bracket: no string or run crosses there.)
            let closed = p[..prefix.end()].ends_with(b"}") || p[..prefix.end()].ends_with(b"]");
            if was_clean.load(Ordering::Relaxed) && closed {
                clean = prefix.end();
            }
            hashed = Some((h, prefix.end()));
            from = Some(prefix);
        }
    }
    let anatomy = of(p, from)?;
    let sent = SentBody {
        anatomy,
        clean,
        hashed,
    };
    Some((received, Some(sent), continued))
}

/// The body as sent, when it is not the one received: its reading; how
/// many of its first bytes are the conversation's previous body as sent,
/// which held nothing the inspector strips; the hash of the bytes it
/// shares with that body (to go on to its own prefix's).
struct SentBody {
    anatomy: Anatomy,
    clean: usize,
    hashed: Option<(crate::transform::PrefixHasher, usize)>,
}

/// What is kept of a request's reading for its conversation's next one;
/// and, for a body sent that is not the one received, the flag for the
/// inspector to set.
fn prefixes(
    received: Anatomy,
    rewritten: Option<SentBody>,
    prepared: &[u8],
) -> (Option<Prefixes>, Option<Arc<AtomicBool>>) {
    let mut mark = None;
    let sent = match rewritten.map(|s| (s.anatomy.into_prefix(), s.hashed)) {
        None => Sent::Same,
        Some((Some(p), hashed)) if p.end() <= prepared.len() => {
            // Hashed on from where the bytes shared with the body before end.
            let (mut h, at) = hashed
                .filter(|&(_, at)| at <= p.end())
                .unwrap_or_else(|| (crate::transform::prefix_hasher(), 0));
            h.update(&prepared[at..p.end()]);
            let hash = h.digest128();
            let clean = Arc::new(AtomicBool::new(false));
            mark = Some(clean.clone());
            Sent::Read(p, hash, clean)
        }
        Some(_) => Sent::Unread,
    };
    let Some(received) = received.into_prefix() else {
        return (None, None);
    };
    (Some(Prefixes { received, sent }), mark)
}

impl Settled {
    /// `client at message 3`, `expired`… for the log line.
    pub fn miss(&self) -> Option<String> {
        let c = self.cause?;
        Some(match self.at {
            Some(k) => format!("{} at message {k}", c.label()),
            None => c.label().to_owned(),
        })
    }
}

impl PromptCache {
    pub fn new(config: Cache, store: Arc<Store>, metrics: &Metrics) -> Self {
        for c in Cause::ALL {
            metrics.cache_misses.with_label_values(&[c.label()]);
        }
        for kind in ["readable", "read", "written"] {
            metrics.cache_tokens.with_label_values(&[kind]);
        }
        let recent = moka::future::Cache::builder()
            .max_capacity(MEMORY_BYTES)
            .weigher(|_, r: &Arc<Record>| r.weight().min(u32::MAX as usize) as u32)
            .time_to_idle(RECORD_TTL)
            .build();
        PromptCache {
            config,
            recent,
            store,
        }
    }

    /// The `[cache]` settings it follows.
    pub fn config(&self) -> &Cache {
        &self.config
    }

    /// Adds visor's breakpoints (Messages, Anthropic kind, none set by the
    /// client) or a `prompt_cache_key` (an upstream that opted in), and
    /// judges the request against the previous one of its conversation.
    /// Nothing is kept yet: [`PromptCache::keep`] does, once the provider
    /// took the request.
    pub async fn apply(&self, mut asked: Asked<'_>) -> Applied {
        let Some((received, rewritten, continued)) = read(&mut asked) else {
            return Applied::default();
        };
        let sent = rewritten.as_ref().map_or(&received, |s| &s.anatomy);
        let sent_clean = rewritten.as_ref().map_or(0, |s| s.clean);
        if received.chained {
            return Applied::default();
        }
        let min = asked.min_tokens.map_or(DEFAULT_MIN_TOKENS, u64::from);
        let conversation = conversation(asked.session, asked.key_name, received.first_user);
        let (body, placed) = add(&self.config, &asked, sent, conversation);
        let mut applied = Applied {
            body,
            breakpoints: placed.len(),
            sent_clean,
            continued,
            ..Applied::default()
        };
        let record = Arc::new(Record::new(
            unix_ms(),
            asked.model,
            &received,
            sent,
            &placed,
            asked.may_change,
        ));
        let judging = Judging {
            // An Anthropic-kind upstream's Messages API caches at breakpoints;
            // everything else caches prefixes on its own.
            reads: match asked.anthropic_kind && asked.shape == Shape::Messages {
                true => Reads::AtBreakpoints,
                false => Reads::Automatically,
            },
            min_tokens: min,
            expire_after_ms: self.config.expire_after.as_millis() as u64,
        };
        let previous = self.previous(conversation).await;
        let verdict = ledger::judge(previous.as_deref(), &record, judging);
        applied.seen = Some(Seen {
            verdict,
            estimated: record.total_tokens(),
            shape: asked.shape,
            conversation,
            record,
        });
        if asked.leaves {
            let (prefixes, mark) = prefixes(received, rewritten, asked.prepared);
            applied.prefixes = prefixes;
            applied.sent_mark = mark;
        }
        applied
    }

    /// The conversation's last request: from the shared store when there
    /// is one and it answers, else from this process.
    async fn previous(&self, conversation: u64) -> Option<Arc<Record>> {
        let local = self.recent.get(&conversation).await;
        // Only a shared store keeps records (`record` answers `NotShared`
        // otherwise): the key is not written for one that does not.
        if !self.store.is_shared() {
            return local;
        }
        match self.store.record(&format!("{conversation:016x}")).await {
            Shared::Done(Some(bytes)) => Record::decode(&bytes).map(Arc::new).or(local),
            Shared::Done(None) => None,
            Shared::NotShared | Shared::Failed => local,
        }
    }

    /// Keeps `seen`'s request as its conversation's last, once the provider
    /// answered it (a request refused, or never answered, wrote no cache:
    /// the next is judged against the one before). In this process, and in
    /// a shared store (one write, before the answer goes on: the client's
    /// next request may reach another replica at once; a store that fails
    /// is passed over as every store failure is).
    pub async fn keep(&self, seen: &Seen) {
        self.recent
            .insert(seen.conversation, seen.record.clone())
            .await;
        if self.store.is_shared() {
            let key = format!("{:016x}", seen.conversation);
            let _ = self
                .store
                .put_record(&key, seen.record.encode(), RECORD_TTL)
                .await;
        }
    }
}

/// What [`PromptCache::apply`] adds to a body to send (its breakpoints, or
/// a `prompt_cache_key`) and the breakpoints' count, without judging or
/// keeping anything: `visor explain`'s dry run. `None`: nothing added.
pub fn added(config: &Cache, mut asked: Asked<'_>) -> Option<(Bytes, usize)> {
    let (received, rewritten, _) = read(&mut asked)?;
    if received.chained {
        return None;
    }
    let sent = rewritten.as_ref().map_or(&received, |s| &s.anatomy);
    let conversation = conversation(asked.session, asked.key_name, received.first_user);
    let (body, placed) = add(config, &asked, sent, conversation);
    body.map(|b| (b, placed.len()))
}

/// The body `sent` (read from `asked.prepared`) with visor's breakpoints
/// (Messages, Anthropic kind, none set by the client) or a
/// `prompt_cache_key` (an upstream that opted in), and the breakpoints.
fn add(
    config: &Cache,
    asked: &Asked<'_>,
    sent: &Anatomy,
    conversation: u64,
) -> (Option<Bytes>, Vec<breakpoints::Place>) {
    let min = asked.min_tokens.map_or(DEFAULT_MIN_TOKENS, u64::from);
    let (mut body, mut placed) = (None, Vec::new());
    if asked.shape == Shape::Messages
        && asked.anthropic_kind
        && asked.may_change
        && config.breakpoints
    {
        placed = breakpoints::place(sent, min);
        if !placed.is_empty() {
            let marked = breakpoints::mark(asked.prepared, sent, &placed, config.ttl);
            body = Some(Bytes::from(marked));
        }
    }
    if asked.shape != Shape::Messages && asked.cache_key && asked.may_change && !sent.has_cache_key
    {
        body = Some(with_cache_key(asked.prepared, sent, conversation));
    }
    (body, placed)
}

/// A conversation: its `x-visor-session`, else its key name and first user
/// message (so a changed system prompt is the client's change, not a new
/// conversation).
pub fn conversation(session: Option<&str>, key_name: &str, first_user: u64) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(key_name.as_bytes());
    h.update(&[0]);
    match session {
        Some(s) => {
            h.update(b"session\0");
            h.update(s.as_bytes());
        }
        None => h.update(&first_user.to_le_bytes()),
    }
    h.digest()
}

/// The `prompt_cache_key` visor gives a conversation.
pub fn cache_key(conversation: u64) -> String {
    format!("visor-{conversation:016x}")
}

/// `body` with `"prompt_cache_key"` as its first field.
fn with_cache_key(body: &[u8], a: &Anatomy, conversation: u64) -> Bytes {
    let open = a.open + 1;
    let rest = &body[open..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let field = format!(
        "\"prompt_cache_key\":\"{}\"{}",
        cache_key(conversation),
        if empty { "" } else { "," }
    );
    let mut out = Vec::with_capacity(body.len() + field.len());
    out.extend_from_slice(&body[..open]);
    out.extend_from_slice(field.as_bytes());
    out.extend_from_slice(rest);
    Bytes::from(out)
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
