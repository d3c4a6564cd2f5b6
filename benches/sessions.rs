//! What a session adds to a request before it goes upstream, with
//! criterion: read the newest stored messages, merge them with the
//! request's (overlap by content, no orphaned tool result), and write the
//! merged body — the work of `proxy::session_turn::open`.
//!
//! - `sessions/prepend-25-disk`: 25 of 200 stored messages, from the disk
//!   store (redb, on the blocking pool).
//! - `sessions/prepend-25-memory`: the same from the memory store.
//! - `sessions/merge-25`: the merge and the body alone.
//! - `sessions/prepend-25-redis`: from Redis, when `VISOR_BENCH_REDIS` names
//!   one (`redis://127.0.0.1:6379/0`; keys under `visor-bench:`).
//!
//! `cargo bench --bench sessions`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench setup

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use serde_json::{Value, json};
use visor::config::StoreBackend;
use visor::metrics::Metrics;
use visor::sessions;
use visor::store::Store;

const DAY: Duration = Duration::from_secs(86_400);

/// 200 stored messages of a support chat (~200 bytes each).
fn history() -> Vec<Bytes> {
    (0..200)
        .map(|i| {
            let m = match i % 2 {
                0 => json!({"role": "user", "content": format!("Question {i}: the invoice for order {} shows the wrong VAT rate, can you check it?", 1000 + i)}),
                _ => json!({"role": "assistant", "content": format!("Answer {i}: the VAT rate on order {} was 19 %; the corrected invoice is attached.", 1000 + i)}),
            };
            Bytes::from(serde_json::to_vec(&m).unwrap())
        })
        .collect()
}

/// One step of `open`: read, merge, write the body.
async fn prepend(store: &Store, request: &Value) -> usize {
    let messages = request["messages"].as_array().unwrap().clone();
    let raw = store.session("bench", 25, DAY).await.unwrap().unwrap();
    let stored: Vec<Value> = raw
        .iter()
        .map(|b| serde_json::from_slice(b).unwrap())
        .collect();
    let merged = sessions::merge(&messages, &stored, 25);
    let body = serde_json::to_vec(request).unwrap();
    let history: Vec<&[u8]> = raw[merged.history_from..][..merged.history_used]
        .iter()
        .map(|b| &b[..])
        .collect();
    sessions::insert_items(&body, "messages", merged.at, &history)
        .unwrap()
        .len()
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let metrics = Arc::new(Metrics::new().unwrap());
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/tmp/bench-sessions");
    let _ = std::fs::remove_dir_all(&dir);
    let disk = rt.block_on(async {
        let s = Store::open(&StoreBackend::Disk, "visor:", &dir, metrics.clone()).unwrap();
        s.append_session("bench", history(), 200, DAY)
            .await
            .unwrap();
        s
    });
    let memory = rt.block_on(async {
        let s = Store::memory(metrics.clone());
        s.append_session("bench", history(), 200, DAY)
            .await
            .unwrap();
        s
    });
    let request = json!({"model": "gpt-4o-mini", "messages": [
        {"role": "system", "content": "You are the billing assistant."},
        {"role": "user", "content": "And the one for order 1201?"}
    ]});
    assert!(rt.block_on(prepend(&disk, &request)) > 25 * 100);

    let redis = std::env::var("VISOR_BENCH_REDIS").ok().map(|url| {
        rt.block_on(async {
            let s = Store::open(
                &StoreBackend::Redis(url.clone()),
                "visor-bench:",
                &dir,
                metrics.clone(),
            )
            .unwrap();
            s.delete_session("bench", DAY).await.unwrap();
            s.append_session("bench", history(), 200, DAY)
                .await
                .unwrap();
            s
        })
    });
    let mut g = c.benchmark_group("sessions");
    if let Some(redis) = &redis {
        g.bench_function("prepend-25-redis", |b| {
            b.iter(|| rt.block_on(prepend(redis, &request)))
        });
    }
    g.bench_function("prepend-25-disk", |b| {
        b.iter(|| rt.block_on(prepend(&disk, &request)))
    });
    g.bench_function("prepend-25-memory", |b| {
        b.iter(|| rt.block_on(prepend(&memory, &request)))
    });
    let stored: Vec<Value> = history()[175..]
        .iter()
        .map(|b| serde_json::from_slice(b).unwrap())
        .collect();
    g.bench_function("merge-25", |b| {
        b.iter(|| {
            let messages = request["messages"].as_array().unwrap().clone();
            sessions::merge(&messages, &stored, 25).history.len()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
