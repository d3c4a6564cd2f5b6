//! The memory a large document holds while visor turns it into text: a
//! 30 MB PDF (one page drawing a 30 MB image, plus a page of text) sent in
//! a Chat request (40 MB of base64) to a model that reads no PDF, taken
//! through the same steps as the proxy — walk, decode and hash, read the
//! PDF, render the page that needs a look, splice the text in — with the
//! peak resident memory measured around them (Linux: `/proc/self/status`
//! `VmHWM`, reset through `/proc/self/clear_refs`).
//!
//! Prints the peak above what the request itself holds (its body, as the
//! proxy holds it once read). `cargo bench --bench media_memory`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench setup

use std::io::Write as _;
use std::time::Instant;

use visor::media::{DocKind, Limits, read, render_page};
use visor::media_text;
use visor::transform::{Plan, Rules, Shape, Takes, scan};

/// A PDF of two pages: text, then one `side`×`side` RGB image (raw,
/// uncompressed: `3·side²` bytes of noise) drawn over the page.
fn pdf_with_image(side: usize) -> Vec<u8> {
    let mut out: Vec<u8> = Vec::new();
    let mut offsets = Vec::new();
    let mut obj = |out: &mut Vec<u8>, body: &[u8]| {
        offsets.push(out.len());
        out.extend_from_slice(format!("{} 0 obj\n", offsets.len()).as_bytes());
        out.extend_from_slice(body);
        out.extend_from_slice(b"\nendobj\n");
    };
    out.extend_from_slice(b"%PDF-1.4\n");
    obj(&mut out, b"<< /Type /Catalog /Pages 2 0 R >>");
    obj(&mut out, b"<< /Type /Pages /Kids [3 0 R 6 0 R] /Count 2 >>");
    obj(
        &mut out,
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 4 0 R >> >> /Contents 5 0 R >>",
    );
    obj(
        &mut out,
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    );
    let text = b"BT /F1 12 Tf 72 720 Td (The quarterly revenue grew by twelve percent.) Tj ET";
    let mut s = format!("<< /Length {} >>\nstream\n", text.len()).into_bytes();
    s.extend_from_slice(text);
    s.extend_from_slice(b"\nendstream");
    obj(&mut out, &s);
    obj(
        &mut out,
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /XObject << /Im1 8 0 R >> >> /Contents 7 0 R >>",
    );
    let draw = b"q 612 0 0 792 0 0 cm /Im1 Do Q";
    let mut s = format!("<< /Length {} >>\nstream\n", draw.len()).into_bytes();
    s.extend_from_slice(draw);
    s.extend_from_slice(b"\nendstream");
    obj(&mut out, &s);
    let n = 3 * side * side;
    let mut pixels = vec![0u8; n];
    let mut x: u32 = 0x9e37_79b9;
    for p in pixels.iter_mut() {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        *p = x as u8;
    }
    let mut s = format!(
        "<< /Type /XObject /Subtype /Image /Width {side} /Height {side} /ColorSpace /DeviceRGB /BitsPerComponent 8 /Length {n} >>\nstream\n"
    )
    .into_bytes();
    s.extend_from_slice(&pixels);
    s.extend_from_slice(b"\nendstream");
    obj(&mut out, &s);
    let xref = out.len();
    out.extend_from_slice(
        format!("xref\n0 {}\n0000000000 65535 f \n", offsets.len() + 1).as_bytes(),
    );
    for o in &offsets {
        out.extend_from_slice(format!("{o:010} 00000 n \n").as_bytes());
    }
    out.extend_from_slice(
        format!(
            "trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n",
            offsets.len() + 1
        )
        .as_bytes(),
    );
    out
}

/// Peak resident memory since the last reset, in bytes.
fn peak() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

fn resident() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

fn reset_peak() {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/self/clear_refs")
        .unwrap();
    f.write_all(b"5").unwrap();
}

fn mb(n: usize) -> f64 {
    n as f64 / 1e6
}

fn main() {
    // 3162² · 3 ≈ 30 MB of pixels.
    let pdf = pdf_with_image(3162);
    let body = serde_json::to_vec(&serde_json::json!({
        "model": "gpt-oss-120b",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Summarise."},
            {"type": "file", "file": {
                "file_data": format!("data:application/pdf;base64,{}", base64_simd::STANDARD.encode_to_string(&pdf)),
                "filename": "big.pdf",
            }},
        ]}],
    }))
    .unwrap();
    let body = bytes::Bytes::from(body);
    println!(
        "document: {:.1} MB PDF (2 pages, one a {:.1} MB image), request body {:.1} MB",
        mb(pdf.len()),
        mb(3 * 3162 * 3162),
        mb(body.len())
    );
    drop(pdf);
    let plan = Plan {
        shape: Shape::Chat,
        vision: false,
        describe: true,
        rules: Rules::NONE,
        takes: Takes {
            pdf: false,
            office: false,
            audio: false,
        },
        query_aware: false,
        fit: visor::transform::Limits::NONE,
    };
    let base = resident();
    reset_peak();
    let started = Instant::now();
    let scanned = scan(&body, &plan).unwrap();
    let jobs = scanned.media(&body);
    let scanned_at = peak();
    let job = &jobs[0];
    let doc = read(DocKind::Pdf, &job.bytes, &Limits::default()).unwrap();
    assert!(doc.pages[1].needs_look, "the image page needs a look");
    let read_at = peak();
    let png = render_page(&job.bytes, 2, 110.0).unwrap();
    let rendered_at = peak();
    let text = media_text::offline(job).text;
    let out = scanned.finish(&body, &[(job.sha256.clone(), text)]);
    let sent = out.body.unwrap();
    let took = started.elapsed();
    let end = peak();
    assert!(sent.len() < 2000, "the 40 MB request went out as text");
    println!(
        "peak above the request held in memory ({:.1} MB resident before): walk + decode {:.1} MB, read {:.1} MB, render 110 dpi ({} KB PNG) {:.1} MB, whole {:.1} MB; {:.2} s",
        mb(base),
        mb(scanned_at.saturating_sub(base)),
        mb(read_at.saturating_sub(base)),
        png.len() / 1024,
        mb(rendered_at.saturating_sub(base)),
        mb(end.saturating_sub(base)),
        took.as_secs_f64()
    );
}
