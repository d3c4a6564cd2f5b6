//! The image path, measured with criterion on the 4 MB request
//! (`large-image-4mb.json`: one ~3 MB PNG of noise, base64, for a text-only
//! model):
//!
//! - `images/strip-4mb`: find the image, base64-decode it, SHA-256 it, and
//!   rewrite the body with the placeholder (the transform, one core).
//! - `images/strip-4mb+artifact-write`: the same plus writing the image to a
//!   new file under a fresh artifacts dir (what the first request with this
//!   image pays; later ones find the file and skip the write).
//! - `images/vision-4mb-passthrough`: a vision model with nothing to change:
//!   the body arriving in 64 KiB chunks, validated and gathered into the one
//!   buffer that goes upstream as is (no parse, no re-serialisation).
//! - `models/resolve`: looking a model up in the model-spec table.
//!
//! `cargo bench --bench images`. The fixture is made on first use by
//! `tests/fixtures/make_fixtures.py --large` into `target/load/`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench setup

mod common;

use std::hint::black_box;
use std::path::PathBuf;

use bytes::Bytes;
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use visor::artifacts::Artifacts;
use visor::models::{Learned, ModelTable};
use visor::proxy::request_body::WholeBody;
use visor::transform::{Plan, Shape, rewrite};

fn bench(c: &mut Criterion) {
    let body = common::large_fixture();
    let plan = Plan::images_only(Shape::Chat, false, false);
    let once = rewrite(&body, &plan);
    assert_eq!(once.report.images_replaced, 1);
    assert!(once.body.as_ref().unwrap().len() < 10_000);

    let mut g = c.benchmark_group("images");
    g.throughput(Throughput::Bytes(body.len() as u64));
    g.bench_function("strip-4mb", |b| {
        b.iter(|| {
            let r = rewrite(black_box(&body), &plan);
            assert_eq!(r.artifacts.len(), 1);
            r
        })
    });
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/tmp/bench-artifacts");
    g.bench_function("strip-4mb+artifact-write", |b| {
        b.iter_batched(
            || {
                let _ = std::fs::remove_dir_all(&dir);
                Artifacts::new(dir.clone())
            },
            |store| {
                let r = rewrite(black_box(&body), &plan);
                assert_eq!(store.save_all(&r.artifacts).unwrap(), 1);
                r
            },
            BatchSize::PerIteration,
        )
    });
    let chunks: Vec<Bytes> = body.chunks(64 * 1024).map(Bytes::copy_from_slice).collect();
    let vision = Plan::images_only(Shape::Chat, true, false);
    g.bench_function("vision-4mb-passthrough", |b| {
        b.iter(|| {
            let mut w = WholeBody::new(body.len() as u64);
            for c in &chunks {
                w.push(black_box(c.clone()));
            }
            let (model, bytes) = w.finish().unwrap();
            assert!(model.is_some());
            assert!(rewrite(&bytes, &vision).body.is_none());
            bytes
        })
    });
    g.finish();

    let table = ModelTable::new(&[], Learned::default()).unwrap();
    c.bench_function("models/resolve", |b| {
        b.iter(|| {
            table.resolve(
                black_box("openrouter/meta-llama/llama-3.3-70b-instruct"),
                None,
            )
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
