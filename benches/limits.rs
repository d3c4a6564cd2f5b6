//! What a `[[key]]` limit adds to a request: one check of a key with
//! requests and tokens per minute, counted in memory (the store is not
//! shared), and — with `VISOR_BENCH_REDIS=redis://127.0.0.1:6379/15` — in
//! a shared Redis (one round trip).
//!
//! `cargo bench --bench limits`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench setup

use std::hint::black_box;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use visor::config::StoreBackend;
use visor::limits::{KeyLimits, Limiter};
use visor::metrics::Metrics;
use visor::store::Store;

fn limiter(store: Arc<Store>, metrics: Arc<Metrics>) -> Limiter {
    let mut models = globset::GlobSetBuilder::new();
    models.add(globset::Glob::new("*").unwrap());
    Limiter::new(
        vec![KeyLimits {
            name: "team-a".into(),
            label: "team-a".into(),
            // High enough never to refuse during the run.
            requests_per_minute: Some(u64::MAX / 2),
            tokens_per_minute: Some(u64::MAX / 2),
            models: models.build().unwrap(),
            any_model: true,
        }],
        store,
        metrics,
    )
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let metrics = Arc::new(Metrics::new().unwrap());
    let memory = limiter(Arc::new(Store::memory(metrics.clone())), metrics.clone());
    let mut g = c.benchmark_group("limits");
    g.bench_function("check-memory", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let started = Instant::now();
                for _ in 0..iters {
                    black_box(memory.check(0, 250).await);
                }
                started.elapsed()
            })
        })
    });
    if let Ok(url) = std::env::var("VISOR_BENCH_REDIS") {
        let store = rt.block_on(async {
            Store::open(
                &StoreBackend::Redis(url),
                "visor-bench:",
                Path::new("target"),
                metrics.clone(),
            )
            .unwrap()
        });
        let shared = limiter(Arc::new(store), metrics.clone());
        g.bench_function("check-redis", |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let started = Instant::now();
                    for _ in 0..iters {
                        black_box(shared.check(0, 250).await);
                    }
                    started.elapsed()
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
