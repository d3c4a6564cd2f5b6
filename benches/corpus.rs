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
//!   byte-identical prefix (message by message) of the rewrite of turn k+1.
//!
//! `cargo bench --bench corpus`. It times nothing (see `benches/context.rs`
//! for speed); the figures are in the README.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench setup

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde_json::Value;
use visor::config::Config;
use visor::models::{Learned, ModelTable};
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
}

impl Figures {
    fn add(&mut self, o: &Figures) {
        self.turns += o.turns;
        self.bytes_in += o.bytes_in;
        self.bytes_out += o.bytes_out;
        self.billed_in += o.billed_in;
        self.billed_out += o.billed_out;
        self.lines_lost += o.lines_lost;
        self.pairs += o.pairs;
        self.stable += o.stable;
        self.images_replaced += o.images_replaced;
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
            rules: Rules::new(&cfg.images, &cfg.dedup, resolved.caps.max_images),
            takes: Takes::ALL,
            query_aware: false,
        };
        let r = rewrite(&body, &plan);
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
    for d in &names {
        let f = conversation(d, &cfg, &table);
        if f.billed_out > f.billed_in {
            negative += 1;
        }
        f.print(&d.file_name().unwrap().to_string_lossy());
        total.add(&f);
    }
    total.print("overall");
    println!(
        "billed: saving of the conversation's cost through visor against the original (cached prefix at {CACHED}); {negative} conversation(s) cost more"
    );
}
