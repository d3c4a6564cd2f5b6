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
//! The savings are printed once before timing. `cargo bench --bench
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
    min_line_chars: Some(16),
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

fn bench(c: &mut Criterion) {
    let big = common::large("agent-history-200turns.json");
    let refetch = small("agent-history-refetch.json");
    let array = small("agent-history-refetch-jsonarray.json");
    let shots = small("agent-tool-images-6turns.json");
    let image = common::large("large-image-4mb.json");
    report_savings("agent-history-200turns", &big);
    report_savings("agent-history-refetch", &refetch);
    report_savings("agent-history-refetch-jsonarray", &array);

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
