//! Hot paths of the proxy core, measured with criterion:
//!
//! - `probe/4mb-image`: validate a 4 MB image request and read its model,
//!   in one piece.
//! - `scan/4mb-image-64k-chunks`: the same in 64 KiB chunks, as a request
//!   arrives (what every transformed request pays before routing).
//! - `serde/4mb-image`: `serde_json` checking the same body, for scale.
//! - `usage/sse-18-events`: the usage observer on a typical short stream.
//! - `cache/anatomy-*`: the prompt cache's read of a request (each message
//!   hashed, tokens estimated) on the 4 MB image request and a 109 KB
//!   agent history; visor pays it once per transformed request (twice when
//!   the transforms changed the body).
//!
//! `cargo bench --bench proxy`. The 4 MB fixture is made by
//! `tests/fixtures/make_fixtures.py --large` into `target/load/` on
//! first use (python3).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench setup

mod common;

use std::hint::black_box;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use visor::api::Shape;
use visor::api::usage::UsageObserver;
use visor::prompt_cache::anatomy::Anatomy;
use visor::proxy::request_body::{JsonScanner, probe};

fn bench(c: &mut Criterion) {
    let body = common::large_fixture();
    assert_eq!(probe(&body).unwrap().model.as_deref(), Some("gpt-oss-120b"));

    let mut g = c.benchmark_group("probe");
    g.throughput(Throughput::Bytes(body.len() as u64));
    g.bench_function("4mb-image", |b| b.iter(|| probe(black_box(&body)).unwrap()));
    g.finish();

    let mut g = c.benchmark_group("serde");
    g.throughput(Throughput::Bytes(body.len() as u64));
    g.bench_function("4mb-image", |b| {
        b.iter(|| serde_json::from_slice::<serde::de::IgnoredAny>(black_box(&body)).unwrap())
    });
    g.finish();

    let chunks: Vec<Bytes> = body.chunks(64 * 1024).map(Bytes::copy_from_slice).collect();
    let mut g = c.benchmark_group("scan");
    g.throughput(Throughput::Bytes(body.len() as u64));
    g.bench_function("4mb-image-64k-chunks", |b| {
        b.iter(|| {
            let mut s = JsonScanner::new();
            for c in &chunks {
                s.feed(black_box(c));
            }
            assert!(s.finish().unwrap().model.is_some());
        })
    });
    g.finish();

    let history = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/agent-history-refetch.json"),
    )
    .unwrap();
    let mut g = c.benchmark_group("cache");
    for (name, b) in [
        ("anatomy-4mb-image", &body[..]),
        ("anatomy-agent-history", &history[..]),
    ] {
        g.throughput(Throughput::Bytes(b.len() as u64));
        g.bench_function(name, |bench| {
            bench.iter(|| Anatomy::of(Shape::Chat, black_box(b)).unwrap())
        });
    }
    g.finish();

    let mut events: Vec<Bytes> = (0..16)
        .map(|i| {
            Bytes::from(format!(
                "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"token{i} \"}}}}],\"usage\":null}}\n\n"
            ))
        })
        .collect();
    events.push(Bytes::from_static(
        b"data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":16}}\n\n",
    ));
    events.push(Bytes::from_static(b"data: [DONE]\n\n"));
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        "text/event-stream".parse().unwrap(),
    );
    c.bench_function("usage/sse-18-events", |b| {
        b.iter(|| {
            let mut o = UsageObserver::for_response(&headers);
            for e in &events {
                o.observe(black_box(e));
            }
            assert_eq!(o.finish().completion, 16);
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
