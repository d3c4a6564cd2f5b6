//! Description lookups, measured with criterion (no describer is called:
//! every description is cached before the timing starts).
//!
//! - `describe/hit-memory`: one image whose description is in the memory
//!   cache (key built, moka lookup, metric counted).
//! - `describe/hit-disk-store`: reading one description from the disk
//!   store (redb, on the blocking pool), what a lookup costs when the
//!   memory cache does not hold it (after a restart, or evicted).
//! - `request/10-cached-images` vs `request/no-images`: the whole rewrite
//!   of a Chat request (find, decode and hash each image, look up its
//!   description, splice the text in) with 10 distinct images, all
//!   described already, against the same request without the images.
//!   `request/10-images-strip` is the same 10 images with placeholders (no
//!   lookups), to separate the lookups from the image work.
//! - `request/cached-pdf-20-pages`: a Chat request carrying the 20-page
//!   PDF fixture (19.6 KB) to a model that reads no PDF, its text made by
//!   an earlier request: decode and hash the document, one lookup of its
//!   whole text, splice it in — what the second request with a document
//!   costs (no parsing).
//!
//! `cargo bench --bench describe`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench setup

use std::hint::black_box;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use visor::config::Config;
use visor::media_text::describe::{Credential, describe};
use visor::media_text::{self, Credentials};
use visor::metrics::Metrics;
use visor::proxy::AppState;
use visor::transform::{self, Payload, Plan, Shape, Subject, Takes};
use visor::upstream::Upstreams;

fn state(rt: &tokio::runtime::Runtime, backend: &str, data_dir: &Path) -> Arc<AppState> {
    let toml = format!(
        "[server]\ndata_dir = \"{}\"\n[images]\nnon_vision = \"describe\"\n[store]\nbackend = \"{backend}\"\n\
         [[upstream]]\nname = \"none\"\nbase_url = \"http://127.0.0.1:9/v1\"\nmodels = [\"*\"]\n",
        data_dir.display()
    );
    let config = Config::from_toml(&toml, Path::new("bench.toml"), &|_| None).unwrap();
    let metrics = Arc::new(Metrics::new().unwrap());
    let upstreams = Upstreams::new(Duration::from_secs(1), &config.upstreams).unwrap();
    rt.block_on(async { Arc::new(visor::app::build(config, metrics, upstreams).unwrap()) })
}

fn png(salt: usize) -> Vec<u8> {
    let mut png = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/chart.png"
    ))
    .unwrap();
    png.extend_from_slice(format!("salt-{salt}").as_bytes());
    png
}

fn subject(bytes: &[u8]) -> Subject {
    Subject {
        sha256: visor::transform::decode::sha256_hex(bytes),
        payload: Payload::Inline {
            media_type: "image/png".into(),
            bytes: bytes.to_vec().into(),
        },
        lookup_only: false,
        query: None,
    }
}

/// A Chat request with these images (or none) and the same text.
fn request(images: &[Vec<u8>]) -> Vec<u8> {
    let mut content =
        vec![serde_json::json!({"type": "text", "text": "Compare these screenshots."})];
    for png in images {
        let url = format!(
            "data:image/png;base64,{}",
            base64_simd::STANDARD.encode_to_string(png)
        );
        content.push(serde_json::json!({"type": "image_url", "image_url": {"url": url}}));
    }
    serde_json::to_vec(&serde_json::json!({
        "model": "gpt-oss-120b",
        "messages": [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": content},
        ],
    }))
    .unwrap()
}

/// What the proxy does to a body: scan, describe (and turn documents into
/// text), finish. Returns the images described plus the media replaced.
async fn rewrite(state: &Arc<AppState>, body: &[u8], plan: &Plan) -> usize {
    match transform::scan(body, plan) {
        Err(done) => done.report.images_replaced,
        Ok(scanned) => {
            let subjects = scanned.subjects(body).into_iter().map(|(_, s)| s).collect();
            let jobs = scanned.media(body);
            let mut descriptions = describe(
                state.rewrite.media.describer(),
                subjects,
                &Credential::default(),
            )
            .await;
            let made =
                media_text::make(&state.rewrite.media, jobs, true, &Credentials::default()).await;
            descriptions.extend(made.into_iter().map(|m| (m.sha256, m.text)));
            let report = scanned.finish(body, &descriptions).report;
            report.images_described + report.media_replaced
        }
    }
}

/// A Chat request carrying one PDF.
fn pdf_request(pdf: &[u8]) -> Vec<u8> {
    let url = format!(
        "data:application/pdf;base64,{}",
        base64_simd::STANDARD.encode_to_string(pdf)
    );
    serde_json::to_vec(&serde_json::json!({
        "model": "gpt-oss-120b",
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "Summarise this report."},
                {"type": "file", "file": {"file_data": url, "filename": "twenty.pdf"}},
            ]},
        ],
    }))
    .unwrap()
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-describe");
    let _ = std::fs::remove_dir_all(&dir);

    // Memory: one description cached.
    let mem = state(&rt, "memory", &dir.join("mem"));
    let one = subject(&png(0));
    let key = mem.rewrite.media.describer().key(&one.sha256);
    rt.block_on(mem.store.put_description(&key, "A bar chart: 42% / 58%."))
        .unwrap();
    let warm = rt.block_on(describe(
        mem.rewrite.media.describer(),
        vec![one.clone()],
        &Credential::default(),
    ));
    assert_eq!(warm.len(), 1);
    c.bench_function("describe/hit-memory", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let started = Instant::now();
                for _ in 0..iters {
                    let d = describe(
                        mem.rewrite.media.describer(),
                        vec![one.clone()],
                        &Credential::default(),
                    )
                    .await;
                    black_box(d);
                }
                started.elapsed()
            })
        })
    });

    // Disk store: one description on disk, read back each time.
    let disk = state(&rt, "disk", &dir.join("disk"));
    rt.block_on(disk.store.put_description(&key, "A bar chart: 42% / 58%."))
        .unwrap();
    c.bench_function("describe/hit-disk-store", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let started = Instant::now();
                for _ in 0..iters {
                    let d = disk.store.description(&key).await.unwrap();
                    assert!(d.is_some());
                }
                started.elapsed()
            })
        })
    });

    // A request with 10 cached images, against the same without images.
    let pngs: Vec<Vec<u8>> = (1..=10).map(png).collect();
    for p in &pngs {
        let k = mem.rewrite.media.describer().key(&subject(p).sha256);
        rt.block_on(mem.store.put_description(
            &k,
            "A screenshot of a terminal: `cargo test` passed, 105 tests.",
        ))
        .unwrap();
    }
    let with_images = request(&pngs);
    let without = request(&[]);
    let describe_plan = Plan::images_only(Shape::Chat, false, true);
    let strip_plan = Plan {
        describe: false,
        ..describe_plan
    };
    assert_eq!(rt.block_on(rewrite(&mem, &with_images, &describe_plan)), 10);
    let mut g = c.benchmark_group("request");
    for (name, body, plan) in [
        ("10-cached-images", &with_images, &describe_plan),
        ("10-images-strip", &with_images, &strip_plan),
        ("no-images", &without, &describe_plan),
    ] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let started = Instant::now();
                    for _ in 0..iters {
                        black_box(rewrite(&mem, body, plan).await);
                    }
                    started.elapsed()
                })
            })
        });
    }
    // A document whose text an earlier request made.
    let pdf = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/media/twenty.pdf"
    ))
    .unwrap();
    let with_pdf = pdf_request(&pdf);
    let pdf_plan = Plan {
        takes: Takes {
            pdf: false,
            office: false,
            audio: false,
        },
        ..describe_plan
    };
    assert_eq!(rt.block_on(rewrite(&mem, &with_pdf, &pdf_plan)), 1);
    g.bench_function("cached-pdf-20-pages", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let started = Instant::now();
                for _ in 0..iters {
                    black_box(rewrite(&mem, &with_pdf, &pdf_plan).await);
                }
                started.elapsed()
            })
        })
    });
    g.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, bench);
criterion_main!(benches);
