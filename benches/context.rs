//! Context dedup and the image rules, measured with criterion:
//!
//! - `context/dedup-200turns`: `agent-history-200turns.json` (an agent that
//!   re-fetches the last 25 chat lines every turn, 200 turns, ~0.7 MB):
//!   find every message's text, remove the repeated lines, splice.
//! - `context/dedup-30turns`, `context/dedup-30turns-jsonarray`: the
//!   committed 30-turn fixtures (lines, and JSON array items).
//! - `context/rules-6turns`: the 6-turn screenshot fixture for a vision
//!   model: age out three screenshots (decode, hash, replace).
//! - `context/rules-small-request`: a one-line chat request (the load
//!   script's) with every rule on: what the rules cost a request they leave
//!   alone.
//! - `context/rules-vision-4mb`: the 4 MB image request for a vision model
//!   with every rule on and nothing to change: the walk over the body (the
//!   image is kept, so never decoded).
//!
//! The savings, and the prompt-cache prefix kept turn by turn on the 6-turn
//! fixture, are printed once before timing. `cargo bench --bench
//! context`; the large fixtures are made on first use (python3).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench setup

mod common;

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use serde_json::Value;
use visor::transform::{Plan, Rules, Shape, rewrite};

const DEFAULTS: Rules = Rules {
    keep_turns: 2,
    max_images: 10,
    dedupe: true,
    prompt_cache: true,
    hard_max_images: None,
    dedup: Some(visor::transform::dedup::Blocks {
        min_lines: 2,
        min_bytes: 64,
    }),
};

fn plan(vision: bool) -> Plan {
    Plan {
        shape: Shape::Chat,
        vision,
        describe: false,
        rules: DEFAULTS,
    }
}

fn small(name: &str) -> Vec<u8> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures");
    std::fs::read(dir.join(name)).unwrap()
}

/// Bytes of tool-result text in a request.
fn tool_text(body: &[u8]) -> usize {
    let v: Value = serde_json::from_slice(body).unwrap();
    v["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| m["content"].as_str())
        .map(str::len)
        .sum()
}

fn report_savings(name: &str, body: &[u8]) {
    let r = rewrite(body, &plan(false));
    let out = r.body.as_deref().unwrap_or(body);
    let pct = |after: usize, before: usize| 100.0 * (1.0 - after as f64 / before as f64);
    eprintln!(
        "{name}: request {} -> {} bytes ({:.1}% less); tool results {} -> {} ({:.1}% less); {} lines, {} items omitted",
        body.len(),
        out.len(),
        pct(out.len(), body.len()),
        tool_text(body),
        tool_text(out),
        pct(tool_text(out), tool_text(body)),
        r.report.lines_omitted,
        r.report.items_omitted,
    );
}

/// The prompt-cache cost of the recency window on the 6-turn screenshot
/// fixture (a vision model): for each request an agent sends (after each
/// user message and tool result), how much of the previous request's
/// rewrite it still starts with (its cacheable prefix, in bytes of compact
/// JSON messages), and its own size against the original's.
fn report_prefix(body: &[u8]) {
    let v: Value = serde_json::from_slice(body).unwrap();
    let msgs = v["messages"].as_array().unwrap();
    let size = |ms: &[Value]| -> usize {
        ms.iter()
            .map(|m| serde_json::to_vec(m).unwrap().len())
            .sum()
    };
    let mut previous: Option<Vec<Value>> = None;
    for (i, m) in msgs.iter().enumerate() {
        if !matches!(m["role"].as_str(), Some("user" | "tool")) {
            continue;
        }
        let mut req = v.clone();
        req["messages"] = Value::Array(msgs[..=i].to_vec());
        let bytes = serde_json::to_vec(&req).unwrap();
        let r = rewrite(&bytes, &plan(true));
        let out: Value = serde_json::from_slice(r.body.as_deref().unwrap_or(&bytes)).unwrap();
        let sent = out["messages"].as_array().unwrap().clone();
        if let Some(prev) = &previous {
            let kept = prev.iter().zip(&sent).take_while(|(a, b)| a == b).count();
            eprintln!(
                "6-turn request after message {i}: sent {} B (original {} B); cacheable prefix {} of the previous {} B ({:.0}%)",
                size(&sent),
                size(&msgs[..=i]),
                size(&prev[..kept]),
                size(prev),
                100.0 * size(&prev[..kept]) as f64 / size(prev) as f64
            );
        }
        previous = Some(sent);
    }
}

fn bench(c: &mut Criterion) {
    let big = common::large("agent-history-200turns.json");
    let refetch = small("agent-history-refetch.json");
    let array = small("agent-history-refetch-jsonarray.json");
    let shots = small("agent-tool-images-6turns.json");
    let image = common::large("large-image-4mb.json");
    report_savings("agent-history-200turns", &big);
    report_savings("agent-history-refetch", &refetch);
    report_savings("agent-history-refetch-jsonarray", &array);
    report_prefix(&shots);

    let mut g = c.benchmark_group("context");
    for (name, body) in [
        ("dedup-200turns", &big),
        ("dedup-30turns", &refetch),
        ("dedup-30turns-jsonarray", &array),
    ] {
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(name, |b| {
            b.iter(|| {
                let r = rewrite(black_box(body), &plan(false));
                assert!(r.report.lines_omitted + r.report.items_omitted > 0);
                r
            })
        });
    }
    g.throughput(Throughput::Bytes(shots.len() as u64));
    g.bench_function("rules-6turns", |b| {
        b.iter(|| {
            let r = rewrite(black_box(&shots), &plan(true));
            assert_eq!(r.report.images_replaced, 3);
            r
        })
    });
    let tiny = br#"{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Say hello."}]}"#;
    g.throughput(Throughput::Bytes(tiny.len() as u64));
    g.bench_function("rules-small-request", |b| {
        b.iter(|| {
            let r = rewrite(black_box(tiny), &plan(true));
            assert!(r.body.is_none());
            r
        })
    });
    g.throughput(Throughput::Bytes(image.len() as u64));
    g.bench_function("rules-vision-4mb", |b| {
        b.iter(|| {
            let r = rewrite(black_box(&image), &plan(true));
            assert!(r.body.is_none());
            r
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
