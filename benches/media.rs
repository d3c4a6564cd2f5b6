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

/// `pages` pages, each drawing object 3 (`content`, deflated) as its
/// content, with a cross-reference table.
fn shared_stream_pdf(pages: usize, content: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
    z.write_all(content).unwrap();
    let data = z.finish().unwrap();
    let kids: Vec<String> = (0..pages).map(|i| format!("{} 0 R", 4 + i)).collect();
    let mut bodies: Vec<Vec<u8>> = vec![
        b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(),
        format!(
            "<< /Type /Pages /Kids [{}] /Count {pages} >>",
            kids.join(" ")
        )
        .into_bytes(),
    ];
    let mut stream = format!(
        "<< /Filter /FlateDecode /Length {} >>\nstream\n",
        data.len()
    )
    .into_bytes();
    stream.extend_from_slice(&data);
    stream.extend_from_slice(b"\nendstream");
    bodies.push(stream);
    for _ in 0..pages {
        bodies.push(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 200] /Contents 3 0 R >>".to_vec(),
        );
    }
    let mut out = b"%PDF-1.7\n".to_vec();
    let mut offsets = Vec::new();
    for (i, body) in bodies.iter().enumerate() {
        offsets.push(out.len());
        out.extend_from_slice(format!("{} 0 obj\n", i + 1).as_bytes());
        out.extend_from_slice(body);
        out.extend_from_slice(b"\nendobj\n");
    }
    let xref = out.len();
    out.extend_from_slice(
        format!("xref\n0 {}\n0000000000 65535 f \n", bodies.len() + 1).as_bytes(),
    );
    for o in offsets {
        out.extend_from_slice(format!("{o:010} 00000 n \n").as_bytes());
    }
    out.extend_from_slice(
        format!(
            "trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n",
            bodies.len() + 1
        )
        .as_bytes(),
    );
    out
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
