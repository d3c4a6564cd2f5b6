//! Images for models that see: what fitting them to the provider's limits
//! and read size changes, and what it costs.
//!
//! Printed before timing (each figure against the same requests sent
//! unchanged), for `claude-sonnet-4-5` and `gpt-4o` with the built-in
//! table's limits and `[images]` defaults:
//! - the WebVoyager conversations of `../shared/corpus/real/` (or
//!   `VISOR_CORPUS`), every turn: request bytes, image tokens by the
//!   provider's formula, and requests the provider's documented limits
//!   would refuse;
//! - a 2880×1800 screenshot agent (a retina screen: one new screenshot a
//!   turn, in tool results, 12 turns).
//!
//! Timed: `fit/2880x1800-png` (decode, scale to Anthropic's read size,
//! encode), `fit/cached` (an image already fitted: the proxy's cache),
//! `fit/screenshot-request-cached` (a 12-screenshot request's transform
//! with every image fitted before: walk, hash, splice).
//!
//! `cargo bench --bench fit`. Exits 1 when a request visor sends would
//! still be refused by the provider's limits.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench setup

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use image::ImageEncoder;
use serde_json::{Value, json};
use visor::image_fit::{Formula, Limits, fit};
use visor::models::{Caps, Learned, ModelTable};
use visor::proxy::fit_images::Fitter;
use visor::transform::{FitJob, Plan, Rules, Shape, Takes, rewrite_fitted};

const MODELS: [&str; 2] = ["claude-sonnet-4-5", "gpt-4o"];

fn corpus_dir() -> PathBuf {
    match std::env::var_os("VISOR_CORPUS") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/corpus/real"),
    }
}

/// The plan the proxy makes for `model` (a model that sees, `[images]`
/// defaults: the provider's read size on, no diet).
fn plan(caps: &Caps) -> Plan {
    let base = Limits {
        provider_size: true,
        ..Limits::NONE
    };
    Plan {
        shape: Shape::Chat,
        vision: true,
        describe: false,
        rules: Rules::NONE,
        takes: Takes::ALL,
        query_aware: false,
        fit: visor::proxy::fit_limits(caps, base),
    }
}

/// Every base64 image of a Chat request: its base64 length and size.
fn images(v: &Value) -> Vec<(usize, (u32, u32))> {
    let mut out = Vec::new();
    for m in v["messages"].as_array().into_iter().flatten() {
        for p in m["content"].as_array().into_iter().flatten() {
            let Some(url) = p["image_url"]["url"].as_str() else {
                continue;
            };
            let Some((_, b64)) = url.split_once(";base64,") else {
                continue;
            };
            let bytes = base64_simd::STANDARD.decode_to_vec(b64).unwrap();
            let s = imagesize::blob_size(&bytes).unwrap();
            out.push((b64.len(), (s.width as u32, s.height as u32)));
        }
    }
    out
}

/// Why the provider would refuse this request, by its documented limits.
fn refused(body: &[u8], l: &Limits) -> Option<String> {
    if l.max_request_bytes.is_some_and(|m| body.len() as u64 > m) {
        return Some(format!("request of {} bytes", body.len()));
    }
    let v: Value = serde_json::from_slice(body).unwrap();
    let imgs = images(&v);
    let many = l.many_images.is_some_and(|n| imgs.len() > n as usize);
    for (b64, (w, h)) in &imgs {
        let edge = match many {
            true => l.many_edge.or(l.max_edge),
            false => l.max_edge,
        };
        if l.max_bytes.is_some_and(|m| *b64 as u64 > m) {
            return Some(format!("an image of {b64} base64 bytes"));
        }
        if edge.is_some_and(|e| w.max(h) > &e) {
            return Some(format!("an image of {w}x{h}"));
        }
    }
    None
}

/// Image tokens of a request by `formula`.
fn image_tokens(body: &[u8], formula: Option<Formula>) -> u64 {
    let v: Value = serde_json::from_slice(body).unwrap();
    let f = formula.unwrap_or(Formula::Anthropic);
    images(&v).iter().map(|(_, (w, h))| f.tokens(*w, *h)).sum()
}

#[derive(Default)]
struct Tally {
    requests: usize,
    bytes_in: usize,
    bytes_out: usize,
    tokens_in: u64,
    tokens_out: u64,
    refused_in: usize,
    refused_out: usize,
}

impl Tally {
    fn add(&mut self, body: &[u8], plan: &Plan) {
        let r = rewrite_fitted(body, plan);
        let out = r.body.as_deref().unwrap_or(body);
        self.requests += 1;
        self.bytes_in += body.len();
        self.bytes_out += out.len();
        self.tokens_in += image_tokens(body, plan.fit.formula);
        self.tokens_out += image_tokens(out, plan.fit.formula);
        self.refused_in += usize::from(refused(body, &plan.fit).is_some());
        if let Some(why) = refused(out, &plan.fit) {
            eprintln!("  still refused after visor: {why}");
            self.refused_out += 1;
        }
    }

    fn print(&self, name: &str, model: &str) {
        let pct = |a: f64, b: f64| 100.0 * (a / b.max(1.0) - 1.0);
        eprintln!(
            "{name}, {model}: {} requests, bytes {} → {} ({:+.1}%), image tokens {} → {} ({:+.1}%), refused by the provider's limits {} → {}",
            self.requests,
            self.bytes_in,
            self.bytes_out,
            pct(self.bytes_out as f64, self.bytes_in as f64),
            self.tokens_in,
            self.tokens_out,
            pct(self.tokens_out as f64, self.tokens_in as f64),
            self.refused_in,
            self.refused_out,
        );
    }
}

/// A 2880×1800 screenshot: window frames, text-like rows, a gradient (a
/// PNG of a few megabytes, as a retina screen gives).
fn screenshot(seed: u32) -> Vec<u8> {
    let (w, h) = (2880u32, 1800u32);
    let mut data = Vec::with_capacity((w * h * 3) as usize);
    let mut x: u32 = 0x2545_f491 ^ seed.wrapping_mul(0x9e37_79b9);
    for y in 0..h {
        for i in 0..w {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let text_row = (y / 18) % 3 == 1 && (i / 9) % 7 != 0;
            let frame = i % 960 < 4 || y % 600 < 4;
            let px = if frame {
                [40, 40, 48]
            } else if text_row && x.is_multiple_of(3) {
                [20, 20, 20]
            } else {
                [(230 - y / 30) as u8, (235 - i / 60) as u8, 245]
            };
            data.extend_from_slice(&px);
        }
    }
    let mut out = Vec::new();
    image::codecs::png::PngEncoder::new(&mut out)
        .write_image(&data, w, h, image::ExtendedColorType::Rgb8)
        .unwrap();
    out
}

/// A screenshot agent's request at turn `turns`: a task, then per turn an
/// assistant tool call and a tool result plus a user message with the new
/// screenshot (Chat carries tool images in a user message).
fn screenshot_request(shots: &[String], model: &str) -> Vec<u8> {
    let mut messages =
        vec![json!({"role": "user", "content": "Book the cheapest flight to Lisbon."})];
    for (t, shot) in shots.iter().enumerate() {
        messages.push(
            json!({"role": "assistant", "tool_calls": [{"id": format!("c{t}"), "type": "function",
            "function": {"name": "screenshot", "arguments": "{}"}}]}),
        );
        messages.push(
            json!({"role": "tool", "tool_call_id": format!("c{t}"), "content": "screenshot taken"}),
        );
        messages.push(json!({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{shot}")}}
        ]}));
    }
    serde_json::to_vec(&json!({"model": model, "messages": messages})).unwrap()
}

fn report(table: &ModelTable) -> bool {
    let mut clean = true;
    let dir = corpus_dir();
    let mut voyages: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(d) => d
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("webvoyager")
            })
            .collect(),
        Err(_) => {
            eprintln!(
                "corpus not found at {} (set VISOR_CORPUS): the WebVoyager figures are skipped",
                dir.display()
            );
            Vec::new()
        }
    };
    voyages.sort();
    for model in MODELS {
        let plan = plan(&table.resolve(model, None).caps);
        for conv in &voyages {
            let mut turns: Vec<PathBuf> = std::fs::read_dir(conv)
                .unwrap()
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "json"))
                .collect();
            turns.sort();
            let mut t = Tally::default();
            for turn in turns {
                t.add(&std::fs::read(turn).unwrap(), &plan);
            }
            t.print(&conv.file_name().unwrap().to_string_lossy(), model);
            clean &= t.refused_out == 0;
        }
    }
    let shots: Vec<String> = (0..12)
        .map(|i| base64_simd::STANDARD.encode_type::<String>(&screenshot(i)))
        .collect();
    eprintln!(
        "a 2880x1800 screenshot is {} bytes of base64",
        shots[0].len()
    );
    for model in MODELS {
        let plan = plan(&table.resolve(model, None).caps);
        let mut t = Tally::default();
        for n in 1..=shots.len() {
            t.add(&screenshot_request(&shots[..n], model), &plan);
        }
        t.print("2880x1800 screenshot agent, 12 turns", model);
        clean &= t.refused_out == 0;
    }
    clean
}

fn bench(c: &mut Criterion) {
    let table = ModelTable::new(&[], Learned::default()).unwrap();
    if !report(&table) {
        eprintln!("FAILED: a request visor sends would still be refused");
        std::process::exit(1);
    }
    let shot = screenshot(0);
    let claude = plan(&table.resolve("claude-sonnet-4-5", None).caps);
    let size = claude.fit.target(2880, 1800, 1);
    let mut g = c.benchmark_group("fit");
    g.bench_function("2880x1800-png", |b| {
        b.iter(|| fit(black_box(&shot), size, claude.fit.max_bytes).unwrap())
    });

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let fitter = Arc::new(Fitter::new(None, 2));
    let job = FitJob {
        index: 0,
        quick: None,
        original: Default::default(),
        sha256: "a".repeat(64),
        bytes: bytes::Bytes::from(shot.clone()),
        from: (2880, 1800),
        size,
        max_base64: claude.fit.max_bytes,
    };
    assert!(rt.block_on(fitter.fitted(&job)).is_ok());
    g.bench_function("cached", |b| {
        b.iter(|| rt.block_on(fitter.fitted(black_box(&job))))
    });

    let shots: Vec<String> = (0..12)
        .map(|i| base64_simd::STANDARD.encode_type::<String>(&screenshot(i)))
        .collect();
    let body = screenshot_request(&shots, "claude-sonnet-4-5");
    let mut warm = visor::transform::scan(&body, &claude).unwrap();
    let jobs = warm.fit_jobs(&body, 0, &|_| None);
    assert_eq!(jobs.len(), 12);
    assert_eq!(rt.block_on(fitter.fit_into(&mut warm, jobs, None)), 0);
    g.sample_size(20);
    // The next turn: each image found by its text (not decoded, not hashed).
    g.bench_function("screenshot-request-cached", |b| {
        b.iter(|| {
            let mut s = visor::transform::scan(black_box(&body), &claude).unwrap();
            let jobs = s.fit_jobs(&body, 0, &|q| fitter.quick(q));
            assert!(jobs.is_empty());
            s.finish(&body, &[])
        })
    });
    // As before the quick key: each image decoded and hashed to find its fit.
    g.bench_function("screenshot-request-cached-by-sha256", |b| {
        b.iter(|| {
            let mut s = visor::transform::scan(black_box(&body), &claude).unwrap();
            let jobs = s.fit_jobs(&body, 0, &|_| None);
            for j in jobs {
                let f = rt.block_on(fitter.fitted(&j));
                s.set_fitted(j.index, (*f).clone().unwrap());
            }
            s.finish(&body, &[])
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
