//! What visor's cache breakpoints do to the bill of real agent
//! conversations sent to an Anthropic-kind upstream (issue 31's measure).
//!
//! Reads the real conversations in `../shared/corpus/real/` (or the folder
//! in `VISOR_CORPUS`) by path — they are not part of the repo; without them
//! this says so and measures nothing.
//!
//! Every turn (`turn-NNN.json`, the Chat Completions body the agent sent)
//! becomes the Messages request an agent *without* cache breakpoints would
//! send:
//!
//! - system (and developer) messages → the top-level `system`, one string
//!   (several joined by a blank line);
//! - `tools` (function tools) → `{name, description, input_schema}`;
//! - an assistant's `tool_calls` → `tool_use` blocks after its text (the
//!   input parsed from the arguments string; `{}` when it is not a JSON
//!   object);
//! - `tool` messages → `tool_result` blocks in a user message (an empty
//!   result without `content`);
//! - `image_url` parts → `image` blocks (a data URL as a base64 source,
//!   any other as a url source);
//! - consecutive messages of one role **merged** into one message (tool
//!   results and a user message after them included), as the Messages API
//!   takes alternate roles (`VISOR_CACHE_KEEP_ROLES=1` keeps them apart,
//!   as the API also takes); a message that is one text stays a string;
//! - every `cache_control` removed; an assistant message with neither text
//!   nor tool calls dropped.
//!
//! Each request then goes through what visor does to it, as the proxy
//! does: the transforms first (`transform::rewrite` with the shipped
//! config's rules and the model's row: dedup, images; `VISOR_CACHE_RAW=1`
//! leaves them out), then the prompt-cache code: [`Anatomy::of`] of the
//! request as received and as rewritten, [`breakpoints::place`] (the model's
//! `cache_min_tokens` from the shipped table, else 1024;
//! `VISOR_CACHE_MIN_TOKENS` overrides it), [`breakpoints::mark`] (5-minute
//! markers), and [`ledger::judge`] against the previous turn's [`Record`]
//! (turns 30 s apart: no prefix expires, TTL is otherwise ignored).
//!
//! The bill, in tokens (text 4 bytes a token, an image 765): without
//! caching every turn costs its whole input. With visor's breakpoints,
//! Anthropic's cache is simulated, one cache per conversation: it holds the
//! prefix written at each breakpoint of an earlier turn that reaches the
//! minimum (a prefix is the block position and every block and message up
//! to it); for each breakpoint of a turn it looks for the longest cached
//! prefix ending there or up to 20 blocks before; the tokens up to the best
//! hit are read (0.1), those after it up to the last breakpoint written
//! (1.25), the rest cost 1.
//!
//! Per conversation and overall it prints the turns, the tokens without
//! caching and billed with breakpoints, their ratio, and the ratio of a
//! perfect cache (every turn reads all of the previous request and writes
//! the rest: the floor any breakpoints can reach; with the minimum, and
//! without it), the tokens read and written, the turns with no breakpoint,
//! the most markers on a request (at most 4), the turns whose sent request
//! is not a prefix of the next one's (markers aside, as the provider sees
//! it, a string content being its one text block; and by visor's element
//! hashes), the misses the ledger blames on visor (and any other but
//! `first`), and, for reading, the turns where the ledger's `readable` is
//! not what the simulated provider read. Then a forensic check: one
//! conversation whose system prompt gains a timestamp from the middle turn
//! on must be judged `client` at message 0 on that turn. A check that fails
//! is printed and the bench exits 1.
//!
//! `cargo bench --bench cache`. It times nothing; the figures are in the
//! README. `VISOR_CACHE_DEBUG=1` prints each turn (its breakpoints, tokens
//! read and written, verdict) on stderr.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench setup

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};
use visor::config::{CacheTtl, Config};
use visor::models::{Learned, ModelTable};
use visor::prompt_cache::DEFAULT_MIN_TOKENS;
use visor::prompt_cache::anatomy::{Anatomy, Role};
use visor::prompt_cache::breakpoints::{self, LOOKBACK, Place};
use visor::prompt_cache::ledger::{self, Cause, Judging, Point, Reads, Record, Verdict};
use visor::transform::{Plan, Rules, Shape, Takes, rewrite};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

/// Anthropic's prices of a token read from the cache and written to it,
/// against 1 for an input token.
const READ: f64 = 0.1;
const WRITE: f64 = 1.25;
/// Turns are this far apart (well inside the 5-minute lifetime).
const TURN_MS: u64 = 30_000;
const EXPIRE_MS: u64 = 300_000;
/// Appended to the system prompt from the middle turn on, in the forensic
/// variant.
const TIMESTAMP: &str = "\n\nCurrent date and time: 2026-11-28 10:42:07 UTC";

fn corpus_dir() -> PathBuf {
    match std::env::var_os("VISOR_CORPUS") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/corpus/real"),
    }
}

// ---- Chat Completions → Messages, as an agent without markers sends it ----

fn remove_markers(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.remove("cache_control");
            m.values_mut().for_each(remove_markers);
        }
        Value::Array(a) => a.iter_mut().for_each(remove_markers),
        _ => {}
    }
}

fn text_block(s: &str) -> Value {
    json!({"type": "text", "text": s})
}

fn image(url: &str) -> Value {
    if let Some(rest) = url.strip_prefix("data:")
        && let Some((meta, data)) = rest.split_once(',')
    {
        let media = meta.strip_suffix(";base64").unwrap_or(meta);
        return json!({"type": "image", "source": {"type": "base64", "media_type": media, "data": data}});
    }
    json!({"type": "image", "source": {"type": "url", "url": url}})
}

/// A Chat content as blocks (empty texts left out).
fn blocks(content: &Value) -> Vec<Value> {
    match content {
        Value::String(s) if s.is_empty() => Vec::new(),
        Value::String(s) => vec![text_block(s)],
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| match p.get("type").and_then(Value::as_str) {
                Some("text") => {
                    let t = p["text"].as_str().unwrap_or("");
                    (!t.is_empty()).then(|| text_block(t))
                }
                Some("image_url") => {
                    let url = p["image_url"]["url"]
                        .as_str()
                        .or(p["image_url"].as_str())
                        .unwrap_or("");
                    Some(image(url))
                }
                _ => Some(p.clone()),
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// A message's content: one text (sent as a string) or blocks.
enum Content {
    Text(String),
    Blocks(Vec<Value>),
}

impl Content {
    fn into_blocks(self) -> Vec<Value> {
        match self {
            Content::Text(s) => vec![text_block(&s)],
            Content::Blocks(b) => b,
        }
    }

    fn into_value(self) -> Value {
        match self {
            Content::Text(s) => Value::String(s),
            Content::Blocks(b) => Value::Array(b),
        }
    }

    /// A string stays a string; anything else is blocks (`None`: nothing).
    fn of(content: &Value) -> Option<Content> {
        match content {
            Value::String(s) if !s.is_empty() => Some(Content::Text(s.clone())),
            _ => {
                let b = blocks(content);
                (!b.is_empty()).then_some(Content::Blocks(b))
            }
        }
    }
}

/// One Chat message (not a system one) as a Messages role and content.
fn convert(m: &Value) -> Option<(&'static str, Content)> {
    let content = m.get("content").unwrap_or(&Value::Null);
    match m["role"].as_str().unwrap_or("") {
        "assistant" => {
            let calls = m
                .get("tool_calls")
                .and_then(Value::as_array)
                .filter(|c| !c.is_empty());
            let Some(calls) = calls else {
                return Content::of(content).map(|c| ("assistant", c));
            };
            let mut out = blocks(content);
            for c in calls {
                let f = &c["function"];
                let input = f["arguments"]
                    .as_str()
                    .and_then(|a| serde_json::from_str::<Value>(a).ok())
                    .filter(Value::is_object)
                    .unwrap_or_else(|| json!({}));
                out.push(
                    json!({"type": "tool_use", "id": c["id"], "name": f["name"], "input": input}),
                );
            }
            Some(("assistant", Content::Blocks(out)))
        }
        "tool" => {
            let mut r = Map::new();
            r.insert("type".into(), "tool_result".into());
            r.insert("tool_use_id".into(), m["tool_call_id"].clone());
            match content {
                Value::String(s) if !s.is_empty() => {
                    r.insert("content".into(), s.clone().into());
                }
                Value::Array(_) => {
                    r.insert("content".into(), Value::Array(blocks(content)));
                }
                _ => {}
            }
            Some(("user", Content::Blocks(vec![Value::Object(r)])))
        }
        _ => Content::of(content).map(|c| ("user", c)),
    }
}

fn tool(t: &Value) -> Value {
    let f = t.get("function").unwrap_or(t);
    let mut o = Map::new();
    o.insert("name".into(), f["name"].clone());
    if let Some(d) = f.get("description") {
        o.insert("description".into(), d.clone());
    }
    let schema = f
        .get("parameters")
        .cloned()
        .unwrap_or_else(|| json!({"type": "object"}));
    o.insert("input_schema".into(), schema);
    Value::Object(o)
}

/// The Messages body of a Chat body, `extra` appended to its system prompt;
/// consecutive messages of one role merged unless `keep` (the Messages API
/// merges them itself).
fn to_messages(chat: &Value, extra: &str, keep: bool) -> Vec<u8> {
    let mut chat = chat.clone();
    remove_markers(&mut chat);
    let mut system = Vec::new();
    let mut messages: Vec<(&str, Content)> = Vec::new();
    for m in chat["messages"].as_array().into_iter().flatten() {
        if matches!(m["role"].as_str(), Some("system" | "developer")) {
            let text = match &m["content"] {
                Value::String(s) => s.clone(),
                c => blocks(c)
                    .iter()
                    .filter_map(|b| b["text"].as_str())
                    .collect::<Vec<_>>()
                    .join("\n"),
            };
            system.push(text);
            continue;
        }
        let Some((role, content)) = convert(m) else {
            continue;
        };
        match messages.last_mut() {
            Some((r, prev)) if *r == role && !keep => {
                let mut b = std::mem::replace(prev, Content::Blocks(Vec::new())).into_blocks();
                b.extend(content.into_blocks());
                *prev = Content::Blocks(b);
            }
            _ => messages.push((role, content)),
        }
    }
    let mut body = Map::new();
    body.insert("model".into(), chat["model"].clone());
    let max = chat.get("max_tokens").cloned().unwrap_or(json!(4096));
    body.insert("max_tokens".into(), max);
    let mut system = system.join("\n\n");
    system.push_str(extra);
    if !system.is_empty() {
        body.insert("system".into(), system.into());
    }
    if let Some(tools) = chat.get("tools").and_then(Value::as_array) {
        body.insert("tools".into(), tools.iter().map(tool).collect());
    }
    let messages: Vec<Value> = messages
        .into_iter()
        .map(|(r, c)| json!({"role": r, "content": c.into_value()}))
        .collect();
    body.insert("messages".into(), messages.into());
    serde_json::to_vec(&Value::Object(body)).unwrap()
}

// ---- What the provider sees ----

/// A Messages body as the provider caches it, element by element (the
/// tools with the system prompt, then each message): markers removed, a
/// string content as its one text block.
fn normalized(body: &[u8]) -> Vec<Value> {
    let mut v: Value = serde_json::from_slice(body).unwrap();
    remove_markers(&mut v);
    let as_blocks = |c: &Value| match c {
        Value::String(s) => json!([text_block(s)]),
        other => other.clone(),
    };
    let mut out = vec![json!({"tools": v["tools"], "system": as_blocks(&v["system"])})];
    for m in v["messages"].as_array().into_iter().flatten() {
        out.push(json!({"role": m["role"], "content": as_blocks(&m["content"])}));
    }
    out
}

fn count_markers(v: &Value) -> usize {
    match v {
        Value::Object(m) => {
            usize::from(m.contains_key("cache_control"))
                + m.values().map(count_markers).sum::<usize>()
        }
        Value::Array(a) => a.iter().map(count_markers).sum(),
        _ => 0,
    }
}

/// Every block of a request in order: its prefix's identity (every block
/// and message before it, and itself) and the tokens up to it, counted as
/// [`ledger::points`] counts them.
fn prefixes(body: &[u8], a: &Anatomy) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut h = Xxh3::new();
    let mut tokens = 0;
    for e in &a.elements {
        h.update(&[match e.role {
            Role::User => 1,
            Role::Assistant => 2,
            Role::Other => 3,
        }]);
        let mut within = 0;
        for b in &e.blocks {
            within += b.tokens;
            h.update(&xxh3_64(&body[b.range.clone()]).to_le_bytes());
            out.push((h.digest(), tokens + within.min(e.tokens)));
        }
        // What lies outside the blocks (the message's other fields).
        h.update(&e.hash.to_le_bytes());
        tokens += e.tokens;
    }
    out
}

/// Anthropic's cache for one conversation: a prefix (block position and
/// identity) written at an earlier breakpoint → its tokens.
#[derive(Default)]
struct Provider {
    cached: HashMap<(usize, u64), u64>,
}

impl Provider {
    /// One request: the tokens read and written.
    fn request(&mut self, prefixes: &[(u64, u64)], points: &[Point], min: u64) -> (u64, u64) {
        let mut read = 0;
        for p in points {
            let at = p.ordinal as usize;
            let from = at.saturating_sub(LOOKBACK);
            for (q, prefix) in prefixes.iter().enumerate().take(at + 1).skip(from) {
                if let Some(&t) = self.cached.get(&(q, prefix.0)) {
                    read = read.max(t);
                }
            }
        }
        let last = points
            .iter()
            .map(|p| p.tokens)
            .filter(|&t| t >= min)
            .max()
            .unwrap_or(0);
        for p in points.iter().filter(|p| p.tokens >= min) {
            let at = p.ordinal as usize;
            self.cached.insert((at, prefixes[at].0), p.tokens);
        }
        (read, last.saturating_sub(read))
    }
}

// ---- One conversation ----

#[derive(Default, Clone, Copy)]
struct Figures {
    turns: usize,
    /// The requests as sent (after visor's transforms), without caching.
    uncached: u64,
    /// The requests as the agent sent them, without visor or caching.
    received: u64,
    billed: f64,
    /// The bill of a perfect cache: every turn reads all of the previous
    /// request and writes the rest (no breakpoints, no minimum).
    ideal: f64,
    /// The same with the minimum: a request under it is neither read nor
    /// written.
    floor: f64,
    read: u64,
    written: u64,
    /// Turns visor put no breakpoint on.
    unmarked: usize,
    max_markers: usize,
    pairs: usize,
    /// Turns whose sent request is not a prefix of the next one's: as the
    /// provider sees it, or by visor's element hashes.
    unstable: usize,
    unstable_hashes: usize,
    /// The ledger's causes, in [`Cause::ALL`]'s order.
    causes: [usize; 5],
    /// Turns where the ledger's `readable` is not what the provider read.
    readable_differs: usize,
    /// Requests whose markers are not where `place` put them, or whose
    /// body changed otherwise.
    bad_marks: usize,
}

impl Figures {
    fn add(&mut self, o: &Figures) {
        self.turns += o.turns;
        self.uncached += o.uncached;
        self.received += o.received;
        self.billed += o.billed;
        self.ideal += o.ideal;
        self.floor += o.floor;
        self.read += o.read;
        self.written += o.written;
        self.unmarked += o.unmarked;
        self.max_markers = self.max_markers.max(o.max_markers);
        self.pairs += o.pairs;
        self.unstable += o.unstable;
        self.unstable_hashes += o.unstable_hashes;
        for (a, b) in self.causes.iter_mut().zip(o.causes) {
            *a += b;
        }
        self.readable_differs += o.readable_differs;
        self.bad_marks += o.bad_marks;
    }

    fn ratio(&self) -> f64 {
        self.pct(self.billed)
    }

    fn pct(&self, tokens: f64) -> f64 {
        match self.uncached {
            0 => 0.0,
            u => 100.0 * tokens / u as f64,
        }
    }

    /// The bill against the requests as the agent sent them.
    fn of_received(&self) -> f64 {
        match self.received {
            0 => 0.0,
            r => 100.0 * self.billed / r as f64,
        }
    }

    fn cause(&self, c: Cause) -> usize {
        let i = Cause::ALL.iter().position(|&x| x == c).unwrap();
        self.causes[i]
    }

    fn print(&self, name: &str) {
        let other_causes =
            self.causes.iter().sum::<usize>() - self.cause(Cause::First) - self.cause(Cause::Visor);
        println!(
            "{name:<26} {:>5} {:>9} {:>9.0} {:>6.1}% {:>6.1}% {:>6.1}% {:>8} {:>8} {:>5} {:>4} {:>5}/{:<4} {:>5} {:>5} {:>6} {:>4}",
            self.turns,
            self.uncached,
            self.billed,
            self.ratio(),
            self.pct(self.floor),
            self.pct(self.ideal),
            self.read,
            self.written,
            self.unmarked,
            self.max_markers,
            self.unstable.max(self.unstable_hashes),
            self.pairs,
            self.cause(Cause::Visor),
            other_causes,
            self.readable_differs,
            self.bad_marks,
        );
    }
}

fn turns(dir: &Path) -> Vec<Value> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("turn-") && n.ends_with(".json"))
        })
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap())
        .collect()
}

/// The markers on `sent` are where `places` says and on blocks that take
/// one, and nothing else of `body` changed.
fn marks_ok(body: &[u8], a: &Anatomy, sent: &[u8], places: &[Place]) -> bool {
    let Some(s) = Anatomy::of(Shape::Messages, sent) else {
        return false;
    };
    let marked: Vec<(usize, usize)> = s
        .elements
        .iter()
        .enumerate()
        .flat_map(|(i, e)| {
            e.blocks
                .iter()
                .enumerate()
                .filter(|(_, b)| b.marked)
                .map(move |(j, _)| (i, j))
        })
        .collect();
    let want: Vec<(usize, usize)> = places.iter().map(|p| (p.element, p.block)).collect();
    let markable = places
        .iter()
        .all(|p| a.elements[p.element].blocks[p.block].kind.markable());
    marked == want && markable && normalized(sent) == normalized(body)
}

/// A conversation through visor: its figures and each turn's verdict.
/// `change`: from that turn on, [`TIMESTAMP`] is appended to the system
/// prompt.
fn conversation(
    chats: &[Value],
    min_of: &dyn Fn(&str) -> u64,
    plan_of: &dyn Fn(&str) -> Option<Plan>,
    keep: bool,
    change: Option<usize>,
) -> (Figures, Vec<Verdict>) {
    let mut f = Figures::default();
    let mut verdicts = Vec::new();
    let mut provider = Provider::default();
    let mut prev: Option<Record> = None;
    let mut prev_sent: Option<Vec<Value>> = None;
    let mut prev_total = 0;
    let mut prev_cached = 0;
    let debug = std::env::var_os("VISOR_CACHE_DEBUG").is_some();
    for (k, chat) in chats.iter().enumerate() {
        let extra = match change {
            Some(at) if k >= at => TIMESTAMP,
            _ => "",
        };
        let received = to_messages(chat, extra, keep);
        let model = chat["model"].as_str().unwrap_or("");
        let min = min_of(model);
        // What visor's transforms make of it (the client's request: `received`).
        let body = match plan_of(model) {
            Some(plan) => rewrite(&received, &plan)
                .body
                .unwrap_or_else(|| received.clone()),
            None => received.clone(),
        };
        let client = Anatomy::of(Shape::Messages, &received).expect("a Messages body");
        let a = Anatomy::of(Shape::Messages, &body).expect("a Messages body");
        let places = breakpoints::place(&a, min);
        let sent = match places.is_empty() {
            true => body.clone(),
            false => breakpoints::mark(&body, &a, &places, CacheTtl::FiveMinutes),
        };
        let sent_value: Value = serde_json::from_slice(&sent).expect("the marked body is JSON");
        f.turns += 1;
        f.unmarked += usize::from(places.is_empty());
        f.max_markers = f.max_markers.max(count_markers(&sent_value));
        f.bad_marks += usize::from(!marks_ok(&body, &a, &sent, &places));
        let now_sent = normalized(&sent);
        if let Some(p) = &prev_sent {
            f.pairs += 1;
            f.unstable += usize::from(!(p.len() <= now_sent.len() && now_sent[..p.len()] == p[..]));
        }
        prev_sent = Some(now_sent);

        let record = Record::new(k as u64 * TURN_MS, model, &client, &a, &places, true);
        let judging = Judging {
            reads: Reads::AtBreakpoints,
            min_tokens: min,
            expire_after_ms: EXPIRE_MS,
        };
        let verdict = ledger::judge(prev.as_ref(), &record, judging);
        if let Some(p) = &prev {
            // As visor keeps them: the previous request's element hashes.
            let n = p.sent.len();
            f.unstable_hashes +=
                usize::from(record.sent.len() < n || record.sent[..n] != p.sent[..]);
        }
        if let Some(c) = verdict.cause {
            f.causes[Cause::ALL.iter().position(|&x| x == c).unwrap()] += 1;
        }
        verdicts.push(verdict);
        prev = Some(record);

        let points = ledger::points(&a, &places);
        let prefixes = prefixes(&body, &a);
        for p in &points {
            assert_eq!(
                prefixes[p.ordinal as usize].1, p.tokens,
                "tokens at a breakpoint"
            );
        }
        let total = a.total_tokens();
        let (read, written) = provider.request(&prefixes, &points, min);
        f.readable_differs += usize::from(verdict.readable != read);
        f.uncached += total;
        f.received += client.total_tokens();
        f.read += read;
        f.written += written;
        let billed = READ * read as f64 + WRITE * written as f64 + (total - read - written) as f64;
        f.billed += billed;
        let kept = prev_total.min(total);
        f.ideal += READ * kept as f64 + WRITE * (total - kept) as f64;
        prev_total = total;
        if total < min {
            f.floor += total as f64;
        } else {
            let kept = prev_cached.min(total);
            f.floor += READ * kept as f64 + WRITE * (total - kept) as f64;
            prev_cached = total;
        }
        if debug {
            let whys: Vec<&str> = places.iter().map(|p| p.why.label()).collect();
            eprintln!(
                "  turn {:>3}: {:>6} tokens, {:>3} elements, breakpoints {:?} at {:?}, read {read}, written {written}, billed {billed:.0}, verdict {:?}",
                k + 1,
                total,
                a.elements.len(),
                whys,
                points
                    .iter()
                    .map(|p| (p.element, p.ordinal, p.tokens))
                    .collect::<Vec<_>>(),
                verdict.cause.map(Cause::label),
            );
        }
    }
    (f, verdicts)
}

fn main() {
    let dir = corpus_dir();
    if !dir.is_dir() {
        println!(
            "corpus: {} is absent — nothing measured (set VISOR_CORPUS to a folder of conversations, each with turn-NNN.json files)",
            dir.display()
        );
        return;
    }
    let cfg = Config::from_toml(
        include_str!("../config/visor.toml"),
        Path::new("config/visor.toml"),
        &|_| None,
    )
    .unwrap();
    let table = ModelTable::new(&cfg.models, Learned::new(Vec::<String>::new())).unwrap();
    let forced = std::env::var("VISOR_CACHE_MIN_TOKENS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    let min_of = |model: &str| {
        forced.unwrap_or_else(|| {
            table
                .resolve(model, None)
                .caps
                .cache_min_tokens
                .map_or(DEFAULT_MIN_TOKENS, u64::from)
        })
    };
    let keep = std::env::var_os("VISOR_CACHE_KEEP_ROLES").is_some();
    let raw = std::env::var_os("VISOR_CACHE_RAW").is_some();
    let plan_of = |model: &str| {
        let resolved = table.resolve(model, None);
        (!raw).then(|| Plan {
            shape: Shape::Messages,
            vision: resolved.vision,
            describe: false,
            rules: Rules::new(
                &cfg.images,
                &cfg.dedup,
                resolved.caps.max_images,
                resolved.caps.context_window,
            ),
            takes: Takes::ALL,
            query_aware: false,
            fit: visor::transform::Limits::NONE,
        })
    };
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    names.sort();
    println!("corpus: {}", dir.display());
    match forced {
        Some(n) => println!("cache minimum: {n} tokens (VISOR_CACHE_MIN_TOKENS)"),
        None => println!(
            "cache minimum: the model table's cache_min_tokens, else {DEFAULT_MIN_TOKENS} tokens"
        ),
    }
    println!(
        "visor's transforms: {}",
        match raw {
            true => "left out (VISOR_CACHE_RAW)",
            false => "the shipped config's (dedup, images), then the breakpoints",
        }
    );
    println!(
        "consecutive messages of one role: {}",
        match keep {
            true => "kept apart (VISOR_CACHE_KEEP_ROLES)",
            false => "merged into one",
        }
    );
    println!(
        "{:<26} {:>5} {:>9} {:>9} {:>7} {:>7} {:>7} {:>8} {:>8} {:>5} {:>4} {:>10} {:>5} {:>5} {:>6} {:>4}",
        "conversation",
        "turns",
        "uncached",
        "billed",
        "ratio",
        "floor",
        "ideal",
        "read",
        "written",
        "none",
        "bps",
        "unstable",
        "visor",
        "other",
        "≠ledg",
        "bad"
    );
    let mut total = Figures::default();
    let mut failures = Vec::new();
    let mut forensic = None;
    for d in &names {
        let name = d.file_name().unwrap().to_string_lossy().into_owned();
        let chats = turns(d);
        let (f, verdicts) = conversation(&chats, &min_of, &plan_of, keep, None);
        f.print(&name);
        total.add(&f);
        if f.ratio() > 100.0 {
            failures.push(format!("{name}: billed {:.1} % of uncached", f.ratio()));
        }
        for (k, v) in verdicts.iter().enumerate() {
            let want = if k == 0 { Some(Cause::First) } else { None };
            if v.cause != want {
                failures.push(format!(
                    "{name} turn {}: cause {:?} at {:?}, expected {:?}",
                    k + 1,
                    v.cause.map(Cause::label),
                    v.at,
                    want.map(Cause::label)
                ));
            }
        }
        let has_system = chats
            .first()
            .is_some_and(|c| c["messages"][0]["role"] == "system");
        if forensic.is_none() && has_system && chats.len() >= 4 {
            forensic = Some((name, chats, f));
        }
    }
    total.print("overall");
    println!(
        "overall against the requests as the agents sent them ({} tokens, no visor, no cache): billed {:.1} %",
        total.received,
        total.of_received()
    );
    println!(
        "ratio: billed with visor's breakpoints against uncached (read {READ}, written {WRITE}); floor: the same for a perfect cache (each turn reads all of the previous request if it reached the minimum, writes the rest if it reaches it); ideal: a perfect cache without the minimum; none: turns without a breakpoint; bps: most markers on a request; unstable: turns whose sent request (markers aside) or visor's element hashes of it are not a prefix of the next; visor / other: ledger misses blamed on visor / any cause but first; ≠ledg: turns where the ledger's readable is not what the simulated provider read; bad: requests whose markers are not where place put them"
    );
    if total.max_markers > 4 {
        failures.push(format!("{} markers on a request", total.max_markers));
    }
    if total.unstable > 0 || total.unstable_hashes > 0 {
        failures.push(format!(
            "{} turns not a prefix of the next as sent, {} by visor's hashes",
            total.unstable, total.unstable_hashes
        ));
    }
    if total.bad_marks > 0 {
        failures.push(format!("{} requests marked wrongly", total.bad_marks));
    }

    println!();
    match forensic {
        None => println!("forensic: no conversation with a system prompt and 4 turns"),
        Some((name, chats, plain)) => {
            let at = chats.len() / 2;
            let (f, verdicts) = conversation(&chats, &min_of, &plan_of, keep, Some(at));
            let v = verdicts[at];
            let ok = v.cause == Some(Cause::Client) && v.at == Some(0);
            let rest_ok = verdicts
                .iter()
                .enumerate()
                .all(|(k, v)| k == at || v.cause == (k == 0).then_some(Cause::First));
            println!(
                "forensic: {name} with a timestamp appended to its system prompt from turn {}: that turn judged {} at message {} (readable {}), the other turns {}; {} turn(s) not a prefix of the next; billed {:.1} % against {:.1} % unchanged",
                at + 1,
                v.cause.map_or("no miss", Cause::label),
                v.at.map_or("-".to_owned(), |m| m.to_string()),
                v.readable,
                match rest_ok {
                    true => "as before",
                    false => "NOT as before",
                },
                f.unstable,
                f.ratio(),
                plain.ratio(),
            );
            if !ok || !rest_ok || f.unstable != 1 || f.unstable_hashes != 1 {
                failures.push("forensic: the changed system prompt is not client at 0".into());
            }
        }
    }
    if !failures.is_empty() {
        println!();
        for m in &failures {
            println!("FAILED: {m}");
        }
        std::process::exit(1);
    }
    println!("checks: all hold");
}
