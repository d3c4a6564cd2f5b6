//! PDF: text and "needs a look" by hayro's interpreter, pages rendered by
//! hayro's rasterizer (both pure Rust; see benches/README.md for the choice).
//!
//! The text comes from a [`Device`] that receives every glyph hayro draws,
//! with its Unicode value (ToUnicode, glyph names) and its place on the page.
//! Glyphs are joined into lines by baseline and direction, with a space where
//! the gap between two glyphs is wider than a fraction of the font size;
//! lines are gathered into blocks (runs of lines going down the page in the
//! same column), and blocks are ordered top to bottom, then left to right.
//! Each page is interpreted under its own `catch_unwind`: a page that panics
//! the interpreter comes out empty and marked for a look.

use std::panic::{AssertUnwindSafe, catch_unwind};

use hayro::hayro_interpret::font::{Glyph, GlyphRun};
use hayro::hayro_interpret::hayro_cmap::BfString;
use hayro::hayro_interpret::hayro_syntax::{LoadPdfError, Pdf};
use hayro::hayro_interpret::kurbo::{Affine, BezPath, Point, Rect, Shape};
use hayro::hayro_interpret::{
    BlendMode, ClipPath, Context, Device, DrawMode, DrawProps, Image, ImageDrawProps,
    InterpreterCache, InterpreterSettings, SoftMask, TransformExt, interpret_page,
};
use hayro::vello_cpu::color::palette::css::WHITE;
use hayro::{PixmapSettings, RenderCache, RenderSettings};

use super::{DocKind, Document, Limits, PageSink, ReadError, guarded};

/// The longest side of a rendered page, in pixels; larger pages are scaled down.
pub const MAX_RENDER_SIDE: f32 = 4096.0;

/// An image covering at least this share of the page is a figure (smaller
/// ones are logos and bullets).
const IMAGE_SHARE: f64 = 0.02;
/// Vector graphics need a look when at least this many paths are drawn…
const MIN_PATHS: usize = 8;
/// …over at least this share of the page.
const PATH_SHARE: f64 = 0.05;
/// A path covering this share of the page is a background, not a figure.
const BACKGROUND_SHARE: f64 = 0.9;

/// The most bytes a PDF's Flate streams may inflate to, all together
/// (hayro inflates without a bound of its own: a small file whose streams
/// inflate to gigabytes would take the process's memory).
const MAX_INFLATED: usize = 256 << 20;
/// The largest image (pixels) a PDF may declare: decoding one takes width
/// × height × components bytes, whatever the file's size.
const MAX_IMAGE_PIXELS: u64 = 150_000_000;

fn open(bytes: &[u8]) -> Result<Pdf, ReadError> {
    let head = bytes.get(..bytes.len().min(1024)).unwrap_or_default();
    if memchr::memmem::find(head, b"%PDF-").is_none() {
        return Err(ReadError::new("not a PDF"));
    }
    within_bounds(bytes, MAX_INFLATED, MAX_IMAGE_PIXELS)?;
    match Pdf::new(bytes.to_vec()) {
        Ok(pdf) => Ok(pdf),
        Err(LoadPdfError::Decryption(_)) => Err(ReadError::encrypted()),
        Err(LoadPdfError::Invalid) => {
            Err(ReadError::damaged("the file's structure cannot be read"))
        }
    }
}

/// Checks, before hayro reads the file, what reading it would cost: every
/// Flate stream is inflated into a scratch buffer (nothing kept) and the
/// total counted, and every image's declared size is read from its
/// dictionary (image XObjects are streams, so their dictionaries are in the
/// file as written, never inside an object stream).
pub(crate) fn within_bounds(
    bytes: &[u8],
    max_inflated: usize,
    max_pixels: u64,
) -> Result<(), ReadError> {
    let mut inflated = 0usize;
    let mut at = 0;
    let mut scratch = vec![0u8; 64 * 1024];
    while let Some(k) = memchr::memmem::find(&bytes[at..], b"stream") {
        let start = at + k;
        at = start + 6;
        if bytes[..start].ends_with(b"end") {
            continue;
        }
        // The data starts after the keyword's end of line.
        let data = match bytes.get(start + 6..start + 8) {
            Some([b'\r', b'\n']) => start + 8,
            Some([b'\n', _]) | Some([b'\r', _]) => start + 7,
            _ => continue,
        };
        // Its dictionary: from the object's start (`obj`) to the keyword.
        let from = start.saturating_sub(4096);
        let dict = &bytes[from..start];
        let dict = match memchr::memmem::rfind(dict, b"obj") {
            Some(o) => &dict[o..],
            None => dict,
        };
        if memchr::memmem::find(dict, b"/Image").is_some() {
            // A size given by reference (`/Width 6 0 R`) cannot be checked
            // here: such an image is refused rather than decoded blind.
            let (Some(w), Some(h)) = (
                direct_number(dict, b"/Width"),
                direct_number(dict, b"/Height"),
            ) else {
                return Err(ReadError::new("an image whose size is given by reference"));
            };
            if w.saturating_mul(h) > max_pixels {
                return Err(ReadError::new(format!(
                    "an image of {w}x{h} pixels is too large"
                )));
            }
        }
        let end =
            memchr::memmem::find(&bytes[data..], b"endstream").map_or(bytes.len(), |e| data + e);
        at = at.max(end);
        if memchr::memmem::find(dict, b"FlateDecode").is_none() {
            continue;
        }
        let mut z = flate2::Decompress::new(true);
        let mut input = &bytes[data..end];
        loop {
            let (in_before, out_before) = (z.total_in(), z.total_out());
            let status = z.decompress(input, &mut scratch, flate2::FlushDecompress::None);
            let used = usize::try_from(z.total_in() - in_before).unwrap_or(usize::MAX);
            let made = usize::try_from(z.total_out() - out_before).unwrap_or(usize::MAX);
            input = input.get(used..).unwrap_or_default();
            inflated = inflated.saturating_add(made);
            if inflated > max_inflated {
                return Err(ReadError::too_large());
            }
            match status {
                Ok(flate2::Status::StreamEnd) | Err(_) => break,
                Ok(_) if used == 0 && made == 0 => break,
                Ok(_) => {}
            }
        }
    }
    Ok(())
}

/// The number after `key` when it is a number and not a reference
/// (`/Width 3162`, not `/Width 6 0 R`); `None` otherwise.
fn direct_number(dict: &[u8], key: &[u8]) -> Option<u64> {
    let n = number_after(dict, key)?;
    let at = memchr::memmem::find(dict, key)? + key.len();
    let rest = std::str::from_utf8(dict.get(at..)?).unwrap_or_default();
    let mut words = rest.split_ascii_whitespace();
    words.next();
    let reference = words
        .next()
        .is_some_and(|w| w.chars().all(|c| c.is_ascii_digit()))
        && words.next().is_some_and(|w| w.starts_with('R'));
    (!reference).then_some(n)
}

/// The number after `key` in a dictionary (`/Width 3162`).
fn number_after(dict: &[u8], key: &[u8]) -> Option<u64> {
    let at = memchr::memmem::find(dict, key)? + key.len();
    let rest = dict.get(at..)?;
    let digits: Vec<u8> = rest
        .iter()
        .skip_while(|b| b.is_ascii_whitespace())
        .take_while(|b| b.is_ascii_digit())
        .copied()
        .collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

/// Whether the file ends as a PDF ends (`%%EOF` near its end): one that
/// doesn't was cut short.
fn looks_complete(bytes: &[u8]) -> bool {
    let tail = bytes
        .get(bytes.len().saturating_sub(1024)..)
        .unwrap_or_default();
    memchr::memmem::find(tail, b"%%EOF").is_some()
}

pub(crate) fn read(bytes: &[u8], limits: &Limits) -> Result<Document, ReadError> {
    let pdf = open(bytes)?;
    let pages = pdf.pages();
    let cache = InterpreterCache::new();
    let mut sink = PageSink::new(limits);
    let mut anything = false;
    for page in pages.iter() {
        if !sink.wants_more() {
            break;
        }
        let (w, h) = page.render_dimensions();
        let read = catch_unwind(AssertUnwindSafe(|| {
            let mut device = TextDevice::new(f64::from(w) * f64::from(h));
            let mut ctx = Context::new(
                page.initial_transform(true).to_kurbo(),
                Rect::new(0.0, 0.0, f64::from(w), f64::from(h)),
                &cache,
                page.xref(),
                InterpreterSettings::default(),
            );
            interpret_page(page, &mut ctx, &mut device);
            device
        }));
        match read {
            Ok(device) => {
                anything |= device.drew_anything();
                let look = device.needs_look();
                sink.push(&device.text(), look, Vec::new());
            }
            Err(_) => sink.push("", true, Vec::new()),
        }
    }
    if !anything && !looks_complete(bytes) {
        // A truncated file whose page objects survive but whose content
        // does not (hayro rebuilds the object table by scanning).
        return Err(ReadError::damaged("the file is cut short"));
    }
    Ok(sink.finish(DocKind::Pdf))
}

/// One PDF page (1-based) rendered to PNG at `dpi` on a white background;
/// a page larger than [`MAX_RENDER_SIDE`] pixels on a side is scaled down to
/// fit. Never panics.
pub fn render_page(bytes: &[u8], number: usize, dpi: f32) -> Result<Vec<u8>, ReadError> {
    guarded(|| {
        if !(dpi.is_finite() && dpi > 0.0) {
            return Err(ReadError::new("invalid resolution"));
        }
        let pdf = open(bytes)?;
        let page = number
            .checked_sub(1)
            .and_then(|i| pdf.pages().get(i))
            .ok_or_else(|| ReadError::new(format!("no page {number}")))?;
        let (w, h) = page.render_dimensions();
        if !(w.is_finite() && h.is_finite() && w > 0.0 && h > 0.0) {
            return Err(ReadError::damaged("the page has no size"));
        }
        let scale = (dpi / 72.0)
            .min(MAX_RENDER_SIDE / w)
            .min(MAX_RENDER_SIDE / h);
        if w * scale < 1.0 || h * scale < 1.0 {
            return Err(ReadError::damaged("the page is too small to render"));
        }
        let pixmap = hayro::render(
            page,
            &RenderCache::new(),
            &InterpreterSettings::default(),
            &RenderSettings::default(),
            &PixmapSettings {
                x_scale: scale,
                y_scale: scale,
                bg_color: WHITE,
            },
        );
        pixmap
            .into_png()
            .map_err(|e| ReadError::damaged(format!("PNG encoding failed ({e})")))
    })
}

/// A line of text: glyphs on one baseline in one direction.
struct Line {
    /// Direction of writing (unit vector, device space, y down).
    dir: (f64, f64),
    /// The baseline origin of the first glyph.
    origin: Point,
    /// Along `dir`, from `origin`: where the last glyph ended.
    end: f64,
    /// The largest font size on the line.
    size: f64,
    /// The extent of the line in device space.
    min: Point,
    max: Point,
    text: String,
}

impl Line {
    fn along(&self, p: Point) -> f64 {
        (p.x - self.origin.x) * self.dir.0 + (p.y - self.origin.y) * self.dir.1
    }

    fn across(&self, p: Point) -> f64 {
        (p.y - self.origin.y) * self.dir.0 - (p.x - self.origin.x) * self.dir.1
    }

    fn extend(&mut self, p: Point) {
        self.min = Point::new(self.min.x.min(p.x), self.min.y.min(p.y));
        self.max = Point::new(self.max.x.max(p.x), self.max.y.max(p.y));
    }
}

/// Collects what a page draws: glyphs into lines, and how much is image or
/// vector graphics.
struct TextDevice {
    /// The page's area in device space (points squared).
    page_area: f64,
    lines: Vec<Line>,
    glyphs: usize,
    /// The largest area one image covers.
    image_area: f64,
    images: usize,
    paths: usize,
    /// The union of the drawn paths' boxes (backgrounds left out).
    path_box: Option<Rect>,
}

impl TextDevice {
    fn new(page_area: f64) -> Self {
        Self {
            page_area,
            lines: Vec::new(),
            glyphs: 0,
            image_area: 0.0,
            images: 0,
            paths: 0,
            path_box: None,
        }
    }

    fn drew_anything(&self) -> bool {
        self.glyphs > 0 || self.images > 0 || self.paths > 0
    }

    fn needs_look(&self) -> bool {
        let has_text = self.lines.iter().any(|l| !l.text.trim().is_empty());
        if !has_text {
            return true;
        }
        if self.page_area.is_nan() || self.page_area <= 0.0 {
            return self.images > 0 || self.paths >= MIN_PATHS;
        }
        let path_area = self.path_box.map_or(0.0, |r| r.area());
        self.image_area / self.page_area >= IMAGE_SHARE
            || (self.paths >= MIN_PATHS && path_area / self.page_area >= PATH_SHARE)
    }

    fn glyph(&mut self, origin: Point, dir: (f64, f64), size: f64, end: Point, text: &str) {
        self.glyphs += 1;
        let continues = self.lines.last().is_some_and(|line| {
            let same_dir = line.dir.0 * dir.0 + line.dir.1 * dir.1 > 0.99;
            let tol = line.size.max(size);
            same_dir
                && line.across(origin).abs() < tol * 0.5
                && line.along(origin) > line.end - tol * 3.0
                && line.along(origin) < line.end + tol * 20.0
        });
        if continues && let Some(line) = self.lines.last_mut() {
            let gap = line.along(origin) - line.end;
            if gap > size.max(line.size) * 0.15
                && !line.text.ends_with(' ')
                && !text.starts_with(' ')
            {
                line.text.push(' ');
            }
            line.text.push_str(text);
            line.end = line.end.max(line.along(end));
            line.size = line.size.max(size);
            line.extend(origin);
            line.extend(end);
            return;
        }
        let mut line = Line {
            dir,
            origin,
            end: 0.0,
            size,
            min: origin,
            max: origin,
            text: text.to_owned(),
        };
        line.end = line.along(end);
        line.extend(end);
        self.lines.push(line);
    }

    /// The page's text: lines gathered into blocks, blocks in reading order.
    fn text(&self) -> String {
        struct Block {
            top: f64,
            left: f64,
            right: f64,
            last_y: f64,
            last_size: f64,
            text: String,
        }
        let mut blocks: Vec<Block> = Vec::new();
        for line in &self.lines {
            let text = line.text.trim_end();
            if text.trim().is_empty() {
                continue;
            }
            let y = line.origin.y;
            let joins = blocks.last().is_some_and(|b| {
                let down = y - b.last_y;
                down > 0.0
                    && down < b.last_size.max(line.size) * 3.0
                    && line.min.x < b.right
                    && line.max.x > b.left
            });
            match blocks.last_mut() {
                Some(b) if joins => {
                    if y - b.last_y > b.last_size.min(line.size) * 1.9 {
                        b.text.push('\n');
                    }
                    b.text.push('\n');
                    b.text.push_str(text);
                    b.last_y = y;
                    b.last_size = line.size;
                    b.left = b.left.min(line.min.x);
                    b.right = b.right.max(line.max.x);
                }
                _ => blocks.push(Block {
                    top: line.min.y.min(y - line.size),
                    left: line.min.x,
                    right: line.max.x,
                    last_y: y,
                    last_size: line.size,
                    text: text.to_owned(),
                }),
            }
        }
        // Top to bottom in bands of 6 pt, then left to right (a total order).
        blocks.sort_by(|a, b| {
            (a.top / 6.0)
                .floor()
                .total_cmp(&(b.top / 6.0).floor())
                .then(a.left.total_cmp(&b.left))
        });
        let mut out = String::new();
        for block in blocks {
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(&block.text);
            out.push('\n');
        }
        out
    }
}

fn unicode(glyph: &Glyph<'_>) -> String {
    match glyph.as_unicode() {
        Some(BfString::Char(c)) => c.to_string(),
        Some(BfString::String(s)) => s,
        None => String::new(),
    }
}

impl<'a> Device<'a> for TextDevice {
    fn draw_path(&mut self, path: &BezPath, props: DrawProps<'a>, _mode: &DrawMode) {
        let bbox = (props.transform * path.clone()).bounding_box();
        if !bbox.is_finite() || bbox.area() >= self.page_area * BACKGROUND_SHARE {
            // A background (a fill over nearly the whole page) is not a figure.
            return;
        }
        self.paths += 1;
        self.path_box = Some(match self.path_box {
            Some(r) => r.union(bbox),
            None => bbox,
        });
    }

    fn push_clip_path(&mut self, _clip: &ClipPath) {}

    fn push_transparency_group(&mut self, _o: f32, _m: Option<SoftMask<'a>>, _b: BlendMode) {}

    fn draw_glyph_run(&mut self, run: &GlyphRun<'_, 'a>, props: DrawProps<'a>, _mode: &DrawMode) {
        for glyph in run.glyphs() {
            let t: Affine = props.transform * glyph.transform();
            let origin = t * Point::ZERO;
            let [a, b, c, d, _, _] = t.as_coeffs();
            // Glyph space has 1000 units to the em.
            let size = (c * c + d * d).sqrt() * 1000.0;
            let run_len = (a * a + b * b).sqrt();
            if !(origin.is_finite() && size.is_finite() && run_len > 0.0 && run_len.is_finite()) {
                continue;
            }
            let dir = (a / run_len, b / run_len);
            let advance = match &**glyph {
                Glyph::Outline(g) => g.advance_width(),
                Glyph::Type3(g) => g.advance_width(),
            };
            let end = match advance {
                Some(adv) if adv.is_finite() && adv > 0.0 => t * Point::new(f64::from(adv), 0.0),
                _ => Point::new(origin.x + dir.0 * size * 0.5, origin.y + dir.1 * size * 0.5),
            };
            self.glyph(origin, dir, size, end, &unicode(glyph));
        }
    }

    fn draw_image(&mut self, _image: Image<'a, '_>, props: ImageDrawProps<'a>) {
        self.images += 1;
        // An image fills the unit square under its transform.
        let area = props.transform.determinant().abs();
        if area.is_finite() {
            self.image_area = self.image_area.max(area);
        }
    }

    fn pop_clip(&mut self) {}

    fn pop_transparency_group(&mut self) {}
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::super::tests::fixture;
    use super::super::{DocKind, Limits, read};
    use super::*;

    const SENTENCE: &str = "The quarterly revenue grew by twelve percent.";

    /// A PDF object whose stream is `data` under `dict`.
    fn with_stream(dict: &str, data: &[u8]) -> Vec<u8> {
        let mut b = b"%PDF-1.4\n4 0 obj\n".to_vec();
        b.extend_from_slice(format!("<< {dict} /Length {} >>\nstream\n", data.len()).as_bytes());
        b.extend_from_slice(data);
        b.extend_from_slice(b"\nendstream\nendobj\n%%EOF\n");
        b
    }

    #[test]
    fn a_flate_bomb_or_a_giant_image_is_refused_before_hayro_reads_it() {
        use std::io::Write as _;
        // 4 MiB of zeros deflate to a few KB.
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
        z.write_all(&vec![0u8; 4 << 20]).unwrap();
        let bomb = with_stream("/Filter /FlateDecode", &z.finish().unwrap());
        assert!(bomb.len() < 64 * 1024);
        let err = within_bounds(&bomb, 1 << 20, MAX_IMAGE_PIXELS).unwrap_err();
        assert_eq!(err.reason(), "too large when unpacked");
        assert!(within_bounds(&bomb, 8 << 20, MAX_IMAGE_PIXELS).is_ok());
        // An image whose declared size would take gigabytes to decode.
        let giant = with_stream(
            "/Type /XObject /Subtype /Image /Width 40000 /Height 40000 /BitsPerComponent 8",
            b"tiny",
        );
        let err = within_bounds(&giant, MAX_INFLATED, MAX_IMAGE_PIXELS).unwrap_err();
        assert!(err.reason().contains("40000x40000"), "{err}");
        assert!(read(DocKind::Pdf, &giant, &Limits::default()).is_err());
        // Its size by reference: refused, not decoded blind.
        let hidden = with_stream(
            "/Type /XObject /Subtype /Image /Width 6 0 R /Height 7 0 R /Filter /DCTDecode",
            b"tiny",
        );
        let err = within_bounds(&hidden, MAX_INFLATED, MAX_IMAGE_PIXELS).unwrap_err();
        assert!(err.reason().contains("by reference"), "{err}");
        // The fixtures are within bounds, the scanned page's image included.
        for name in ["text.pdf", "chart.pdf", "scanned.pdf", "long.pdf"] {
            within_bounds(&fixture(name), MAX_INFLATED, MAX_IMAGE_PIXELS).unwrap();
        }
    }

    fn pages_with(doc: &Document, needle: &str) -> Vec<usize> {
        doc.pages
            .iter()
            .filter(|p| p.text.contains(needle))
            .map(|p| p.number)
            .collect()
    }

    #[test]
    fn text_pdf_sentences_on_their_pages() {
        let doc = read(DocKind::Pdf, &fixture("text.pdf"), &Limits::default()).unwrap();
        assert_eq!(doc.pages.len(), 3);
        assert!(!doc.truncated);
        assert_eq!(pages_with(&doc, SENTENCE), [2]);
        assert_eq!(pages_with(&doc, "Annual Report, Part 3"), [3]);
        assert_eq!(pages_with(&doc, "short summary."), [3]);
        let first = &doc.pages[0];
        assert!(
            first.text.starts_with(
                "Annual Report, Part 1\n\nVisor reads documents that a model cannot read itself"
            ),
            "{:?}",
            first.text
        );
        assert!(
            doc.pages
                .iter()
                .all(|p| !p.needs_look && p.images.is_empty())
        );
        assert_eq!(doc.pages[1].number, 2);
    }

    #[test]
    fn chart_page_needs_a_look_and_reads_top_down() {
        let doc = read(DocKind::Pdf, &fixture("chart.pdf"), &Limits::default()).unwrap();
        assert_eq!(doc.pages.len(), 2);
        assert!(!doc.pages[0].needs_look);
        assert!(doc.pages[1].needs_look);
        let chart = &doc.pages[1].text;
        let title = chart.find("Sales by Region (units)").unwrap();
        let axis = chart.find("North South East West").unwrap();
        let caption = chart
            .find("Figure 1: The West region sold the most units this year.")
            .unwrap();
        assert!(title < axis && axis < caption, "{chart:?}");
    }

    #[test]
    fn scanned_page_has_no_text_and_needs_a_look() {
        let doc = read(DocKind::Pdf, &fixture("scanned.pdf"), &Limits::default()).unwrap();
        assert_eq!(doc.pages.len(), 1);
        assert!(
            doc.pages[0].text.trim().is_empty(),
            "{:?}",
            doc.pages[0].text
        );
        assert!(doc.pages[0].needs_look);
    }

    #[test]
    fn long_pdf_reads_all_pages_or_stops_at_the_limit() {
        let bytes = fixture("long.pdf");
        let doc = read(DocKind::Pdf, &bytes, &Limits::default()).unwrap();
        assert_eq!(doc.pages.len(), 100);
        assert!(!doc.truncated);
        for page in [1, 37, 100] {
            let heading = format!("Page {page}\n");
            assert!(doc.pages[page - 1].text.starts_with(&heading), "{page}");
        }
        let limited = Limits {
            max_pages: 10,
            ..Limits::default()
        };
        let doc = read(DocKind::Pdf, &bytes, &limited).unwrap();
        assert_eq!(doc.pages.len(), 10);
        assert!(doc.truncated);
        let tiny = Limits {
            max_text_bytes: 1000,
            ..Limits::default()
        };
        let doc = read(DocKind::Pdf, &bytes, &tiny).unwrap();
        assert!(doc.truncated);
        assert!(doc.pages.iter().map(|p| p.text.len()).sum::<usize>() <= 1000);
    }

    #[test]
    fn broken_inputs_are_errors_not_panics() {
        let limits = Limits::default();
        let corrupt = read(DocKind::Pdf, &fixture("corrupt.pdf"), &limits).unwrap_err();
        assert!(corrupt.reason().starts_with("damaged"), "{corrupt}");
        assert_eq!(
            read(DocKind::Pdf, b"", &limits).unwrap_err().reason(),
            "not a PDF"
        );
        assert_eq!(
            read(DocKind::Pdf, b"hello world", &limits)
                .unwrap_err()
                .reason(),
            "not a PDF"
        );
        assert!(read(DocKind::Pdf, b"%PDF-1.7\n garbage", &limits).is_err());
        assert!(read(DocKind::Pdf, &fixture("report.docx"), &limits).is_err());
        let encrypted = read(DocKind::Pdf, &fixture("encrypted.pdf"), &limits).unwrap_err();
        assert_eq!(encrypted.to_string(), "encrypted");
        // Every prefix of a real PDF: an error or some pages, never a panic.
        let text = fixture("text.pdf");
        for cut in (0..text.len()).step_by(97) {
            let _ = read(DocKind::Pdf, &text[..cut], &limits);
        }
    }

    fn png_size(png: &[u8]) -> (u32, u32) {
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
        assert_eq!(&png[12..16], b"IHDR");
        let be = |i: usize| u32::from_be_bytes(png[i..i + 4].try_into().unwrap());
        (be(16), be(20))
    }

    #[test]
    fn render_chart_page_at_150_dpi() {
        let png = render_page(&fixture("chart.pdf"), 2, 150.0).unwrap();
        // US letter: 8.5 x 11 in.
        let (w, h) = png_size(&png);
        assert!(
            (1274..=1276).contains(&w) && (1649..=1651).contains(&h),
            "{w}x{h}"
        );
        // Huge resolutions are capped at MAX_RENDER_SIDE on the longer side.
        let (w, h) = png_size(&render_page(&fixture("text.pdf"), 1, 2000.0).unwrap());
        assert!((4090..=4096).contains(&h) && w < h, "{w}x{h}");
    }

    #[test]
    fn render_refuses_bad_requests() {
        let chart = fixture("chart.pdf");
        assert!(render_page(&chart, 0, 150.0).is_err());
        assert_eq!(
            render_page(&chart, 3, 150.0).unwrap_err().reason(),
            "no page 3"
        );
        assert!(render_page(&chart, 1, 0.0).is_err());
        assert!(render_page(&chart, 1, f32::NAN).is_err());
        assert!(render_page(b"nope", 1, 150.0).is_err());
        assert_eq!(
            render_page(&fixture("encrypted.pdf"), 1, 72.0)
                .unwrap_err()
                .reason(),
            "encrypted"
        );
        let _ = render_page(&fixture("corrupt.pdf"), 1, 72.0);
    }
}
