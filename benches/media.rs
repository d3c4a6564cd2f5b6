//! Reading documents (`src/media`), measured with criterion on the committed
//! fixtures in `tests/fixtures/media/`:
//!
//! - `media/pdf-text-20-pages`: `read` of `twenty.pdf` (hayro's interpreter
//!   with the text device: 20 US-letter pages of prose, ~38 lines each).
//! - `media/pdf-text-100-pages`: the same for `long.pdf`.
//! - `media/pdf-render-150dpi`: `render_page` of `chart.pdf` page 2 (the bar
//!   chart) at 150 dpi, PNG encoding included (1275x1650).
//! - `media/docx-read`: `read` of `report.docx` (unzip, XML, the PNG copied).
//! - `media/pdf-hostile-shared-stream`: a 46 KB PDF whose 400 pages all
//!   draw one content stream of 40,000 filled squares, read with the default
//!   limits until its work budget stops it (how long a hostile document
//!   holds a reader; the 5 s deadline should not be what stops it).
//!
//! `cargo bench --bench media`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench setup

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use std::sync::atomic::AtomicBool;

use visor::media::{DocKind, Limits, read, read_and_render, render_page};

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/fixtures/media/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[path = "../tests/it/support/pdf_build.rs"]
mod pdf_build;

/// `pages` pages, each drawing object 3 (`content`, deflated) as its
/// content.
fn shared_stream_pdf(pages: usize, content: &[u8]) -> Vec<u8> {
    let data = pdf_build::deflate(content);
    pdf_build::pdf(
        pages,
        200,
        "",
        &[pdf_build::stream("/Filter /FlateDecode", &data)],
    )
}

fn bench(c: &mut Criterion) {
    let limits = Limits::default();
    let twenty = fixture("twenty.pdf");
    let long = fixture("long.pdf");
    let chart = fixture("chart.pdf");
    let docx = fixture("report.docx");
    assert_eq!(
        read(DocKind::Pdf, &twenty, &limits).unwrap().pages.len(),
        20
    );

    let mut g = c.benchmark_group("media");
    g.sample_size(30);
    g.bench_function("pdf-text-20-pages", |b| {
        b.iter(|| read(DocKind::Pdf, black_box(&twenty), &limits).unwrap())
    });
    g.bench_function("pdf-text-100-pages", |b| {
        b.iter(|| read(DocKind::Pdf, black_box(&long), &limits).unwrap())
    });
    g.bench_function("pdf-render-150dpi", |b| {
        b.iter(|| render_page(black_box(&chart), 2, 150.0).unwrap())
    });
    g.bench_function("docx-read", |b| {
        b.iter(|| read(DocKind::Docx, black_box(&docx), &limits).unwrap())
    });
    g.finish();

    let hostile = shared_stream_pdf(400, "0 0 1 1 re f\n".repeat(40_000).as_bytes());
    let stop = AtomicBool::new(false);
    let r = read_and_render(&hostile, &limits, &stop, 0, 110.0).unwrap();
    println!(
        "hostile PDF: {} KB, {} pages read of 400, stopped: {:?}",
        hostile.len() / 1024,
        r.doc.pages.len(),
        r.doc.stopped
    );
    let mut g = c.benchmark_group("media");
    g.sample_size(10);
    g.bench_function("pdf-hostile-shared-stream", |b| {
        b.iter(|| read_and_render(black_box(&hostile), &limits, &stop, 0, 110.0).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
