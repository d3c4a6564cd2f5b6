//! What visor's transforms do to real agent traffic, and what that does to
//! the bill under prompt caching.
//!
//! Reads the real conversations in `../shared/corpus/real/` (or the folder
//! in `VISOR_CORPUS`) by path — they are not part of the repo; without them
//! this says so and measures nothing. Every turn of every conversation
//! (`turn-NNN.json`, the Chat Completions body the agent sent) goes through
//! the transform with the shipped config's rules and the model the agent
//! used, and per conversation and overall it prints:
//!
//! - request bytes removed;
//! - billed saving: the conversation's cost through visor against the
//!   original, where in each turn the leading run of messages
//!   byte-identical to the previous turn's costs 0.1 per token and the rest
//!   1 (text at 4 bytes per token, an image at 765 tokens);
//! - distinct lines lost: lines of a request's texts that appear nowhere in
//!   its rewrite;
//! - prefix stability: turn pairs where the rewrite of turn k is a
//!   byte-identical prefix (message by message) of the rewrite of turn k+1;
//! - harm, on the last request of each conversation (what the model reads
//!   at the end): status lines removed (as `transform::status` marks them),
//!   notes saving less than 128 bytes net, references to whole results
//!   under 256 bytes, the first user message rewritten, lines repeating
//!   the instructions removed, notes pointing into their own message (but
//!   for a block repeated back to back); and, as a check on the status
//!   classifier from outside, removed lines holding an outcome word
//!   (`exit`, `error`, `fail`, `denied`, …) — code in a re-read file view
//!   may hold them, so these are for reading, not a target.
//!
//! `cargo bench --bench corpus`. It times nothing (see `benches/context.rs`
//! for speed); the figures are in the README.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench setup

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use serde_json::Value;
use visor::config::Config;
use visor::models::{Learned, ModelTable};
use visor::proxy::dedup_states::{DedupStates, Read};
use visor::transform::dedup::{NOTE_MIN_SAVING, Note, SMALL_TEXT};
use visor::transform::status;
use visor::transform::{Plan, Rules, Shape, Takes, rewrite};

/// Tokens of an image, and bytes of text per token.
const IMAGE_TOKENS: f64 = 765.0;
const BYTES_PER_TOKEN: f64 = 4.0;
const CACHED: f64 = 0.1;

fn corpus_dir() -> PathBuf {
    match std::env::var_os("VISOR_CORPUS") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/corpus/real"),
    }
}

#[derive(Default, Clone, Copy)]
struct Figures {
    turns: usize,
    bytes_in: usize,
    bytes_out: usize,
    billed_in: f64,
    billed_out: f64,
    lines_lost: usize,
    pairs: usize,
    stable: usize,
    images_replaced: usize,
    harm: Harm,
    /// Turns dedup continued from the turn before's state, and turns whose
    /// continued body differed from the full read (must stay 0).
    continued: usize,
    differed: usize,
}

/// What dedup did to the last request that it may not do.
#[derive(Default, Clone, Copy)]
struct Harm {
    status_lost: usize,
    notes_small: usize,
    references_small: usize,
    first_user_rewritten: usize,
    instructions_removed: usize,
    own_message: usize,
    /// Removed lines holding an outcome word (for reading).
    suspect: usize,
    /// Bytes removed from the last request, and from its messages with
    /// any harm.
    removed_bytes: usize,
    harmed_bytes: usize,
}

impl Harm {
    fn add(&mut self, o: &Harm) {
        self.status_lost += o.status_lost;
        self.notes_small += o.notes_small;
        self.references_small += o.references_small;
        self.first_user_rewritten += o.first_user_rewritten;
        self.instructions_removed += o.instructions_removed;
        self.own_message += o.own_message;
        self.suspect += o.suspect;
        self.removed_bytes += o.removed_bytes;
        self.harmed_bytes += o.harmed_bytes;
    }

    fn print(&self, name: &str) {
        println!(
            "{name:<28} {:>7} {:>7} {:>6} {:>6} {:>6} {:>5} {:>8} {:>9} {:>7}",
            self.status_lost,
            self.notes_small,
            self.references_small,
            self.first_user_rewritten,
            self.instructions_removed,
            self.own_message,
            self.suspect,
            self.removed_bytes,
            self.harmed_bytes,
        );
    }
}

impl Figures {
    fn add(&mut self, o: &Figures) {
        self.continued += o.continued;
        self.differed += o.differed;
        self.turns += o.turns;
        self.bytes_in += o.bytes_in;
        self.bytes_out += o.bytes_out;
        self.billed_in += o.billed_in;
        self.billed_out += o.billed_out;
        self.lines_lost += o.lines_lost;
        self.pairs += o.pairs;
        self.stable += o.stable;
        self.images_replaced += o.images_replaced;
        self.harm.add(&o.harm);
    }

    fn print(&self, name: &str) {
        let pct = |a: f64, b: f64| if b > 0.0 { 100.0 * (1.0 - a / b) } else { 0.0 };
        println!(
            "{name:<28} {:>5} {:>10} {:>6.2}% {:>7.2}% {:>6} {:>5}/{:<5} {:>6}",
            self.turns,
            self.bytes_in,
            pct(self.bytes_out as f64, self.bytes_in as f64),
            pct(self.billed_out, self.billed_in),
            self.lines_lost,
            self.stable,
            self.pairs,
            self.images_replaced,
        );
    }
}

fn is_image(part: &Value) -> bool {
    matches!(
        part.get("type").and_then(Value::as_str),
        Some("image_url" | "input_image" | "image")
    )
}

/// A message's tokens: its JSON without image parts at 4 bytes a token,
/// plus 765 per image.
fn tokens(message: &Value) -> f64 {
    let mut m = message.clone();
    let mut images = 0;
    if let Some(parts) = m.get_mut("content").and_then(Value::as_array_mut) {
        let before = parts.len();
        parts.retain(|p| !is_image(p));
        images = before - parts.len();
    }
    serde_json::to_vec(&m).unwrap().len() as f64 / BYTES_PER_TOKEN + images as f64 * IMAGE_TOKENS
}

/// A request's cost given the messages the previous request sent.
fn billed(messages: &[String], values: &[Value], previous: Option<&[String]>) -> f64 {
    let cached = previous.map_or(0, |p| {
        p.iter().zip(messages).take_while(|(a, b)| a == b).count()
    });
    values
        .iter()
        .enumerate()
        .map(|(i, m)| tokens(m) * if i < cached { CACHED } else { 1.0 })
        .sum()
}

/// A message's texts joined as its lines are numbered (notes count lines
/// across its texts).
fn message_lines(m: &Value) -> Vec<String> {
    let texts: Vec<&str> = match m.get("content") {
        Some(Value::String(s)) => vec![s.as_str()],
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => vec![],
    };
    texts.join("\n").split('\n').map(str::to_owned).collect()
}

/// Lines of `before` missing from `after` (as a multiset), with whether
/// each is a status line there.
fn removed(before: &[String], after: &[String]) -> Vec<(String, bool)> {
    let mut kept: HashMap<&str, usize> = HashMap::new();
    for l in after {
        *kept.entry(l.as_str()).or_default() += 1;
    }
    let refs: Vec<&str> = before.iter().map(String::as_str).collect();
    let marks = status::mark(&refs);
    let mut out = Vec::new();
    for (l, is_status) in before.iter().zip(marks) {
        match kept.get_mut(l.as_str()) {
            Some(n) if *n > 0 => *n -= 1,
            _ => out.push((l.clone(), is_status)),
        }
    }
    out
}

/// The harm checks on one request and its rewrite.
fn harm(mi: &[Value], mo: &[Value]) -> Harm {
    let mut h = Harm::default();
    let first_user = mi.iter().position(|m| m["role"] == "user");
    let mut instructions: HashSet<String> = HashSet::new();
    for (i, m) in mi.iter().enumerate() {
        if m["role"] == "system" || m["role"] == "developer" || Some(i) == first_user {
            instructions.extend(
                message_lines(m)
                    .into_iter()
                    .filter(|l| l.trim().len() >= 16),
            );
        }
    }
    if let Some(f) = first_user
        && mi[f] != mo[f]
    {
        h.first_user_rewritten += 1;
    }
    let sent: Vec<Vec<String>> = mo.iter().map(message_lines).collect();
    for (i, a) in mi.iter().enumerate() {
        let (la, lb) = (message_lines(a), &sent[i]);
        let bytes = |ls: &[String]| ls.iter().map(|l| l.len() + 1).sum::<usize>();
        let saved = bytes(&la).saturating_sub(bytes(lb));
        h.removed_bytes += saved;
        let mut harmed = 0;
        // A status line is lost when no copy of it is left in the message
        // (a block repeated back to back keeps one copy and a count).
        let left: HashSet<&str> = lb.iter().map(String::as_str).collect();
        for (line, is_status) in removed(&la, lb) {
            let lost = is_status && !left.contains(line.as_str());
            harmed += usize::from(lost);
            h.status_lost += usize::from(lost);
            let lower = line.to_ascii_lowercase();
            if std::env::var_os("VISOR_HARM_DEBUG").is_some()
                && [
                    "exit",
                    "error",
                    "fail",
                    "denied",
                    "traceback",
                    "warning",
                    "timed out",
                    "returncode",
                    "exception",
                ]
                .iter()
                .any(|w| lower.contains(w))
            {
                eprintln!("suspect removed in message {}: {line:?}", i + 1);
            }
            h.suspect += usize::from(
                [
                    "exit",
                    "error",
                    "fail",
                    "denied",
                    "traceback",
                    "warning",
                    "timed out",
                    "returncode",
                    "exception",
                ]
                .iter()
                .any(|w| lower.contains(w)),
            );
            if instructions.contains(&line) && a["role"] != "assistant" {
                if std::env::var_os("VISOR_HARM_DEBUG").is_some() {
                    eprintln!("instr removed in message {}: {line:?}", i + 1);
                }
                h.instructions_removed += 1;
                harmed += 1;
            }
        }
        for (pos, line) in lb.iter().enumerate() {
            match Note::parse(line) {
                Some(Note::Run(places)) => {
                    let mut run = 0;
                    for p in &places {
                        if let Some(src) = sent.get(p.message - 1)
                            && p.last <= src.len()
                        {
                            run += src[p.first - 1..p.last]
                                .iter()
                                .map(|l| l.len() + 1)
                                .sum::<usize>();
                        }
                        if p.message == i + 1 && p.last != pos {
                            h.own_message += 1;
                            harmed += 1;
                        }
                    }
                    if run < line.len() + 1 + NOTE_MIN_SAVING {
                        h.notes_small += 1;
                        harmed += 1;
                    }
                }
                Some(Note::Same { .. }) => {
                    if bytes(&la) < SMALL_TEXT {
                        h.references_small += 1;
                        harmed += 1;
                    }
                    if saved < NOTE_MIN_SAVING {
                        h.notes_small += 1;
                        harmed += 1;
                    }
                }
                _ => {}
            }
        }
        if harmed > 0 {
            h.harmed_bytes += saved;
        }
    }
    h
}

/// Every line of every text of a request's messages.
fn lines(values: &[Value]) -> HashSet<String> {
    let mut out = HashSet::new();
    let mut add = |s: &str| {
        for l in s.split('\n') {
            out.insert(l.to_owned());
        }
    };
    for m in values {
        match m.get("content") {
            Some(Value::String(s)) => add(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        add(t);
                    }
                }
            }
            _ => {}
        }
    }
    out
}

fn messages(body: &[u8]) -> Vec<Value> {
    let v: Value = serde_json::from_slice(body).unwrap();
    v["messages"].as_array().cloned().unwrap_or_default()
}

fn conversation(dir: &Path, cfg: &Config, table: &ModelTable) -> Figures {
    let mut turns: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("turn-") && n.ends_with(".json"))
        })
        .collect();
    turns.sort();
    let mut f = Figures::default();
    let states = DedupStates::new(128 << 20).unwrap();
    let mut prev_in: Option<Vec<String>> = None;
    let mut prev_out: Option<Vec<String>> = None;
    for path in &turns {
        let body = std::fs::read(path).unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        let model = v["model"].as_str().unwrap_or("");
        let resolved = table.resolve(model, None);
        let plan = Plan {
            shape: Shape::Chat,
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
        };
        let r = rewrite(&body, &plan);
        // The same turn continued from the turn before's dedup state, as
        // the proxy does: the same body, byte for byte.
        let (again, read) = states.rewrite(&body, &plan, 0);
        let again = again.body;
        f.continued += usize::from(read == Read::Continued);
        f.differed += usize::from(again != r.body);
        let out = r.body.as_deref().unwrap_or(&body);
        let (mi, mo) = (messages(&body), messages(out));
        let si: Vec<String> = mi.iter().map(|m| m.to_string()).collect();
        let so: Vec<String> = mo.iter().map(|m| m.to_string()).collect();
        f.turns += 1;
        f.bytes_in += body.len();
        f.bytes_out += out.len();
        f.billed_in += billed(&si, &mi, prev_in.as_deref());
        f.billed_out += billed(&so, &mo, prev_out.as_deref());
        f.images_replaced += r.report.images_replaced;
        let kept = lines(&mo);
        f.lines_lost += lines(&mi).iter().filter(|l| !kept.contains(*l)).count();
        if let Some(p) = &prev_out {
            f.pairs += 1;
            f.stable += usize::from(p.len() <= so.len() && so[..p.len()] == p[..]);
        }
        prev_in = Some(si);
        prev_out = Some(so);
        if Some(path) == turns.last() {
            f.harm = harm(&mi, &mo);
        }
    }
    f
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
    let mut cfg = cfg;
    // Thresholds to try instead of the shipped ones (how the defaults were
    // chosen): VISOR_MIN_RUN_LINES, VISOR_MIN_RUN_BYTES.
    let env_u32 = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u32>().ok());
    if let Some(n) = env_u32("VISOR_MIN_RUN_LINES") {
        cfg.dedup.min_run_lines = n;
    }
    if let Some(n) = env_u32("VISOR_MIN_RUN_BYTES") {
        cfg.dedup.min_run_bytes = n;
    }
    println!(
        "dedup: runs of at least {} lines and {} bytes",
        cfg.dedup.min_run_lines, cfg.dedup.min_run_bytes
    );
    let table = ModelTable::new(&cfg.models, Learned::new(Vec::<String>::new())).unwrap();
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    names.sort();
    println!("corpus: {}", dir.display());
    println!(
        "{:<28} {:>5} {:>10} {:>7} {:>8} {:>6} {:>11} {:>6}",
        "conversation", "turns", "bytes", "removed", "billed", "lost", "prefix", "images"
    );
    let mut total = Figures::default();
    let mut negative = 0;
    let mut each = Vec::new();
    for d in &names {
        let f = conversation(d, &cfg, &table);
        if f.billed_out > f.billed_in {
            negative += 1;
        }
        let name = d.file_name().unwrap().to_string_lossy().into_owned();
        f.print(&name);
        total.add(&f);
        each.push((name, f.harm));
    }
    total.print("overall");
    println!(
        "continued: {} of {} turns read only their new messages (dedup continued the turn before's state); {} differed from the full read",
        total.continued, total.turns, total.differed
    );
    assert_eq!(
        total.differed, 0,
        "a continued turn differs from its full read"
    );
    println!(
        "billed: saving of the conversation's cost through visor against the original (cached prefix at {CACHED}); {negative} conversation(s) cost more"
    );
    println!();
    println!("harm, on the last request of each conversation:");
    println!(
        "{:<28} {:>7} {:>7} {:>6} {:>6} {:>6} {:>5} {:>8} {:>9} {:>7}",
        "conversation",
        "status",
        "notes",
        "refs",
        "first",
        "instr",
        "own",
        "suspect",
        "removed",
        "harmed"
    );
    for (name, h) in &each {
        h.print(name);
    }
    total.harm.print("overall");
    println!(
        "status: status lines removed; notes: notes saving < {NOTE_MIN_SAVING} bytes net; refs: whole-result references under {SMALL_TEXT} bytes; first: first user message rewritten; instr: lines repeating the instructions removed; own: notes into their own message (not back to back); suspect: removed lines holding an outcome word (for reading); removed/harmed: bytes removed, and of those from messages with any harm"
    );
}
