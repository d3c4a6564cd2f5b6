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

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use hayro::hayro_interpret::font::{Glyph, GlyphRun};
use hayro::hayro_interpret::hayro_cmap::BfString;
use hayro::hayro_interpret::hayro_syntax::object::{Array, ObjectIdentifier, Stream};
use hayro::hayro_interpret::hayro_syntax::page::Page;
use hayro::hayro_interpret::hayro_syntax::{LoadPdfError, Pdf};
use hayro::hayro_interpret::kurbo::{Affine, BezPath, Point, Rect, Shape};
use hayro::hayro_interpret::{
    BlendMode, ClipPath, Context, Device, DrawMode, DrawProps, Image, ImageDrawProps,
    InterpreterCache, InterpreterSettings, SoftMask, TransformExt, interpret_page,
};
use hayro::vello_cpu::color::palette::css::WHITE;
use hayro::{PixmapSettings, RenderCache, RenderSettings};

use super::pdf_guard::{
    Filter, ImageCheck, Meter, Spent, decoded_len, raw_stream_filters, streams_within,
};
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

/// The most bytes a PDF's streams may decode to, all together (hayro
/// decodes without a bound of its own: a small file whose streams inflate to
/// gigabytes would take the process's memory).
const MAX_INFLATED: usize = 256 << 20;

/// Opens the file after checking what opening it costs: the raw file's
/// Flate streams (hayro inflates object and xref streams as it opens the
/// file), then every stream's filters as hayro resolves them (indirect
/// `/Filter`, chains, LZW, RunLength). Returns the decoded size of each
/// stream that is not an image.
fn open(bytes: &[u8]) -> Result<(Pdf, HashMap<ObjectIdentifier, usize>), ReadError> {
    let head = bytes.get(..bytes.len().min(1024)).unwrap_or_default();
    if memchr::memmem::find(head, b"%PDF-").is_none() {
        return Err(ReadError::new("not a PDF"));
    }
    within_bounds(bytes, MAX_INFLATED)?;
    let pdf = match Pdf::new(bytes.to_vec()) {
        Ok(pdf) => pdf,
        Err(LoadPdfError::Decryption(_)) => return Err(ReadError::encrypted()),
        Err(LoadPdfError::Invalid) if nesting(bytes) > MAX_NESTING => {
            return Err(too_deep());
        }
        Err(LoadPdfError::Invalid) => {
            return Err(ReadError::damaged("the file's structure cannot be read"));
        }
    };
    let sizes = streams_within(pdf.objects(), MAX_INFLATED).map_err(ReadError::new)?;
    Ok((pdf, sizes))
}

/// How deep hayro reads objects inside objects (its
/// `MAX_OBJECT_NESTING_DEPTH`): an object nested deeper is not read, and a
/// page or page tree holding one is lost without a word.
const MAX_NESTING: usize = 512;

fn too_deep() -> ReadError {
    ReadError::new(format!(
        "too deeply nested (objects nested over {MAX_NESTING} levels deep)"
    ))
}

/// The deepest nesting of dictionaries and arrays in the file as written
/// (strings, comments and stream data skipped), counted up to a little
/// past [`MAX_NESTING`]. One pass, no allocation.
fn nesting(bytes: &[u8]) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let mut i = 0;
    while i < bytes.len() && deepest <= MAX_NESTING {
        match bytes[i] {
            b'%' => {
                i = memchr::memchr2(b'\n', b'\r', &bytes[i..]).map_or(bytes.len(), |e| i + e);
            }
            b'(' => {
                // A literal string: balanced parentheses, `\` escapes.
                let mut open = 0usize;
                while i < bytes.len() {
                    match bytes[i] {
                        b'\\' => i += 1,
                        b'(' => open += 1,
                        b')' => {
                            open -= 1;
                            if open == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                    i += 1;
                }
            }
            b'<' if bytes.get(i + 1) == Some(&b'<') => {
                depth += 1;
                i += 1;
            }
            b'<' => {
                // A hex string.
                i = memchr::memchr(b'>', &bytes[i..]).map_or(bytes.len(), |e| i + e);
            }
            b'>' if bytes.get(i + 1) == Some(&b'>') => {
                depth = depth.saturating_sub(1);
                i += 1;
            }
            b'[' => depth += 1,
            b']' => depth = depth.saturating_sub(1),
            b's' if bytes[i..].starts_with(b"stream")
                && !bytes[..i].ends_with(b"end")
                && matches!(bytes.get(i + 6), Some(b'\r' | b'\n')) =>
            {
                i = memchr::memmem::find(&bytes[i..], b"endstream")
                    .map_or(bytes.len(), |e| i + e + 9);
                continue;
            }
            _ => {}
        }
        deepest = deepest.max(depth);
        i += 1;
    }
    deepest
}

/// Checks, before hayro opens the file, what its streams decode to: every
/// stream in the file as written is tried as Flate (whatever its dictionary
/// says: a filter may be given by reference), inflated into a scratch
/// buffer (nothing kept), and, when its dictionary can be read from the
/// bytes, run through the filters it names ([`raw_stream_filters`], bounded
/// as [`unfilter`](super::pdf_guard) runs them). The larger of the two is
/// counted for each stream, and the total capped.
pub(crate) fn within_bounds(bytes: &[u8], max_inflated: usize) -> Result<(), ReadError> {
    let mut inflated = 0usize;
    let mut at = 0;
    let mut scratch = vec![0u8; 64 * 1024];
    while let Some(k) = memchr::memmem::find(&bytes[at..], b"stream") {
        let start = at + k;
        let after_previous = at;
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
        let end =
            memchr::memmem::find(&bytes[data..], b"endstream").map_or(bytes.len(), |e| data + e);
        at = at.max(end);
        let raw = &bytes[data..end];
        let named = match raw_stream_filters(bytes, after_previous, start) {
            Some(chain) if chain != [Filter::FlateDecode] => {
                decoded_len(raw, &chain, max_inflated.saturating_sub(inflated))
                    .map_err(|_| ReadError::too_large())?
            }
            _ => 0,
        };
        let mut made_raw = 0usize;
        let mut z = flate2::Decompress::new(true);
        let mut input = &bytes[data..end];
        loop {
            let (in_before, out_before) = (z.total_in(), z.total_out());
            let status = z.decompress(input, &mut scratch, flate2::FlushDecompress::None);
            let used = usize::try_from(z.total_in() - in_before).unwrap_or(usize::MAX);
            let made = usize::try_from(z.total_out() - out_before).unwrap_or(usize::MAX);
            input = input.get(used..).unwrap_or_default();
            made_raw = made_raw.saturating_add(made);
            if inflated.saturating_add(made_raw) > max_inflated {
                return Err(ReadError::too_large());
            }
            match status {
                Ok(flate2::Status::StreamEnd) | Err(_) => break,
                Ok(_) if used == 0 && made == 0 => break,
                Ok(_) => {}
            }
        }
        inflated = inflated.saturating_add(made_raw.max(named));
    }
    Ok(())
}

/// Whether the file ends as a PDF ends (`%%EOF` near its end): one that
/// doesn't was cut short.
fn looks_complete(bytes: &[u8]) -> bool {
    let tail = bytes
        .get(bytes.len().saturating_sub(1024)..)
        .unwrap_or_default();
    memchr::memmem::find(tail, b"%%EOF").is_some()
}

/// A PDF's text, and its pages that need a look rendered.
#[derive(Debug)]
pub struct PdfRead {
    pub doc: Document,
    /// Each page rendered (1-based number), or why it was not: up to the
    /// number asked for, the pages that need a look in page order.
    pub rendered: Vec<(usize, Result<Vec<u8>, ReadError>)>,
    /// The interpreter work done (reading and rendering), as counted
    /// against [`Limits::max_work`].
    pub work: u64,
}

pub(crate) fn read(bytes: &[u8], limits: &Limits) -> Result<Document, ReadError> {
    read_pdf(bytes, limits, &AtomicBool::new(false), 0, 72.0).map(|r| r.doc)
}

/// Reads a PDF's text and renders up to `looks` of its pages that need a
/// look, at `dpi`, from one opening of the file, within `limits`' work
/// budget and deadline. `stop` set (the request is gone): reading stops at
/// the next check. Never panics.
pub fn read_and_render(
    bytes: &[u8],
    limits: &Limits,
    stop: &AtomicBool,
    looks: usize,
    dpi: f32,
) -> Result<PdfRead, ReadError> {
    guarded(|| read_pdf(bytes, limits, stop, looks, dpi))
}

/// One page read: whether it needs a look, what keeps it from being
/// rendered, and the work reading it took.
struct PageRead {
    number: usize,
    look: bool,
    refused: Option<String>,
    work: u64,
}

fn read_pdf(
    bytes: &[u8],
    limits: &Limits,
    stop: &AtomicBool,
    looks: usize,
    dpi: f32,
) -> Result<PdfRead, ReadError> {
    let (pdf, sizes) = open(bytes)?;
    let meter = Meter::new(limits.max_work, Instant::now() + limits.deadline, stop);
    let pages = pdf.pages();
    let cache = InterpreterCache::new();
    let mut sink = PageSink::new(limits);
    let mut anything = false;
    let mut content = 0usize;
    let mut read = Vec::new();
    for (i, page) in pages.iter().enumerate() {
        if !sink.wants_more() {
            break;
        }
        if let Some(why) = meter.spent() {
            sink.stop(why);
            break;
        }
        // Its content streams, decoded, counted before hayro decodes them.
        content = content.saturating_add(content_len(page, &sizes));
        if content > limits.max_content_bytes {
            sink.stop("over the content budget");
            break;
        }
        let before = meter.work();
        match read_page(page, &cache, &meter) {
            Ok(device) => {
                anything |= device.drew_anything();
                let look = device.needs_look();
                sink.push(&device.text(), look, Vec::new());
                read.push(PageRead {
                    number: i + 1,
                    look,
                    refused: device.check.refused,
                    work: meter.work() - before,
                });
            }
            Err(payload) => match payload.downcast_ref::<Spent>() {
                Some(Spent(why)) => {
                    sink.stop(why);
                    break;
                }
                None => sink.push("", true, Vec::new()),
            },
        }
    }
    if !anything && !looks_complete(bytes) {
        // A truncated file whose page objects survive but whose content
        // does not (hayro rebuilds the object table by scanning).
        return Err(ReadError::damaged("the file is cut short"));
    }
    if pages.is_empty() && nesting(bytes) > MAX_NESTING {
        // No page at all: one that the parser could not reach.
        return Err(too_deep());
    }
    let doc = sink.finish(DocKind::Pdf);
    let mut rendered = Vec::new();
    for p in read.iter().filter(|p| p.look).take(looks) {
        let result = match (&p.refused, meter.spent()) {
            (Some(why), _) => Err(ReadError::new(why.clone())),
            (None, Some(why)) => Err(ReadError::new(why)),
            (None, None) => {
                // Rendering interprets the page again: charged as much.
                meter.add(p.work);
                match meter.spent() {
                    Some(why) => Err(ReadError::new(why)),
                    None => {
                        number_page(&pdf, p.number).and_then(|page| guarded(|| render(page, dpi)))
                    }
                }
            }
        };
        rendered.push((p.number, result));
    }
    Ok(PdfRead {
        doc,
        rendered,
        work: meter.work(),
    })
}

/// Interprets one page with the text device, under its own
/// `catch_unwind`: a page that panics the interpreter, or runs out of
/// budget ([`Spent`]), comes out as the payload.
fn read_page<'a, 'm, 's>(
    page: &'a Page<'a>,
    cache: &'a InterpreterCache<'a>,
    meter: &'m Meter<'s>,
) -> std::thread::Result<TextDevice<'m, 's>> {
    let (w, h) = page.render_dimensions();
    catch_unwind(AssertUnwindSafe(|| {
        let area = Rect::new(0.0, 0.0, f64::from(w), f64::from(h));
        let mut device = TextDevice::new(area, meter);
        let mut ctx = Context::new(
            page.initial_transform(true).to_kurbo(),
            area,
            cache,
            page.xref(),
            InterpreterSettings::default(),
        );
        interpret_page(page, &mut ctx, &mut device);
        device
    }))
}

/// What a page's content streams decode to, each counted as often as the
/// page draws it (known from [`streams_within`]; a stream it did not see is
/// counted at its raw size).
fn content_len(page: &Page<'_>, sizes: &HashMap<ObjectIdentifier, usize>) -> usize {
    let size = |s: Stream<'_>| {
        sizes
            .get(&s.obj_id())
            .copied()
            .unwrap_or_else(|| s.raw_data().len())
    };
    let dict = page.raw();
    if let Some(s) = dict.get::<Stream<'_>>(b"Contents") {
        size(s)
    } else if let Some(a) = dict.get::<Array<'_>>(b"Contents") {
        a.iter::<Stream<'_>>()
            .map(size)
            .fold(0usize, usize::saturating_add)
    } else {
        0
    }
}

fn number_page<'p>(pdf: &'p Pdf, number: usize) -> Result<&'p Page<'p>, ReadError> {
    number
        .checked_sub(1)
        .and_then(|i| pdf.pages().get(i))
        .ok_or_else(|| ReadError::new(format!("no page {number}")))
}

/// One PDF page (1-based) rendered to PNG at `dpi` on a white background;
/// a page larger than [`MAX_RENDER_SIDE`] pixels on a side is scaled down to
/// fit. The page is read first (its images sized, its work counted, within
/// the default [`Limits`]). Never panics.
pub fn render_page(bytes: &[u8], number: usize, dpi: f32) -> Result<Vec<u8>, ReadError> {
    guarded(|| {
        if !(dpi.is_finite() && dpi > 0.0) {
            return Err(ReadError::new("invalid resolution"));
        }
        let limits = Limits::default();
        let (pdf, sizes) = open(bytes)?;
        let page = number_page(&pdf, number)?;
        if content_len(page, &sizes) > limits.max_content_bytes {
            return Err(ReadError::new("over the content budget"));
        }
        let stop = AtomicBool::new(false);
        let meter = Meter::new(limits.max_work, Instant::now() + limits.deadline, &stop);
        let cache = InterpreterCache::new();
        match read_page(page, &cache, &meter) {
            Ok(device) => match device.check.refused {
                Some(why) => Err(ReadError::new(why)),
                None => render(page, dpi),
            },
            Err(payload) => match payload.downcast_ref::<Spent>() {
                Some(Spent(why)) => Err(ReadError::new(*why)),
                None => Err(ReadError::damaged("the page cannot be read")),
            },
        }
    })
}

/// Renders a page already read and checked.
fn render(page: &Page<'_>, dpi: f32) -> Result<Vec<u8>, ReadError> {
    if !(dpi.is_finite() && dpi > 0.0) {
        return Err(ReadError::new("invalid resolution"));
    }
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
/// vector graphics; sizes its images and charges its work.
struct TextDevice<'m, 's> {
    meter: &'m Meter<'s>,
    check: ImageCheck,
    /// The page in device space, and its area (points squared).
    page: Rect,
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

impl<'m, 's> TextDevice<'m, 's> {
    fn new(page: Rect, meter: &'m Meter<'s>) -> Self {
        Self {
            meter,
            check: ImageCheck::default(),
            page,
            page_area: page.area(),
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

/// The area of `page` an image covers (device space, points squared),
/// raster or stencil mask, XObject or inline. hayro hands a device the
/// image's transform from its pixel space (`width` x `height`, y down) to
/// the page, not from the unit square: it pre-concatenates
/// `scale(1 / width, -1 / height)` to the CTM before `draw_image`. So the
/// drawn area is the determinant times the pixel count, bounded by what of
/// the image's box lies on the page.
fn drawn_area(image: &Image<'_, '_>, transform: Affine, page: Rect) -> f64 {
    let (w, h) = (f64::from(image.width()), f64::from(image.height()));
    let area = transform.determinant().abs() * w * h;
    if !area.is_finite() {
        return area;
    }
    let on_page = transform
        .transform_rect_bbox(Rect::new(0.0, 0.0, w, h))
        .intersect(page)
        .area();
    area.min(on_page)
}

fn unicode(glyph: &Glyph<'_>) -> String {
    match glyph.as_unicode() {
        Some(BfString::Char(c)) => c.to_string(),
        Some(BfString::String(s)) => s,
        None => String::new(),
    }
}

impl<'a> Device<'a> for TextDevice<'_, '_> {
    fn draw_path(&mut self, path: &BezPath, props: DrawProps<'a>, mode: &DrawMode) {
        self.check
            .path(path, &props, mode, Some(self.page), self.meter);
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

    fn push_clip_path(&mut self, clip: &ClipPath) {
        self.meter.charge(clip.path.elements().len() as u64);
    }

    fn push_transparency_group(&mut self, _o: f32, mask: Option<SoftMask<'a>>, _b: BlendMode) {
        self.check.group(mask.as_ref(), self.meter);
    }

    fn draw_glyph_run(&mut self, run: &GlyphRun<'_, 'a>, props: DrawProps<'a>, _mode: &DrawMode) {
        self.check.glyph_run(run, &props, self.page, self.meter);
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

    fn draw_image(&mut self, image: Image<'a, '_>, props: ImageDrawProps<'a>) {
        self.check.drawn_image(&image, &props, self.meter);
        self.images += 1;
        let area = drawn_area(&image, props.transform, self.page);
        if area.is_finite() {
            self.image_area = self.image_area.max(area);
        }
    }

    fn pop_clip(&mut self) {}

    fn pop_transparency_group(&mut self) {}
}

/// Hand-written PDFs for the tests (shared with the integration tests and
/// benches).
#[cfg(test)]
#[path = "../../tests/it/support/pdf_build.rs"]
pub(crate) mod pdf_build;

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
    fn a_flate_bomb_is_refused_before_hayro_reads_it() {
        use std::io::Write as _;
        // 4 MiB of zeros deflate to a few KB.
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
        z.write_all(&vec![0u8; 4 << 20]).unwrap();
        let data = z.finish().unwrap();
        let bomb = with_stream("/Filter /FlateDecode", &data);
        assert!(bomb.len() < 64 * 1024);
        let err = within_bounds(&bomb, 1 << 20).unwrap_err();
        assert_eq!(err.reason(), "too large when unpacked");
        assert!(within_bounds(&bomb, 8 << 20).is_ok());
        // Whatever the dictionary says (a filter by reference).
        let hidden = with_stream("/Filter 7 0 R", &data);
        assert!(within_bounds(&hidden, 1 << 20).is_err());
        for name in ["text.pdf", "chart.pdf", "scanned.pdf", "long.pdf"] {
            within_bounds(&fixture(name), MAX_INFLATED).unwrap();
        }
    }

    use super::pdf_build::{self, deflate, stream};

    /// [`pdf_build::pdf`] with 200 pt pages.
    fn build(pages: usize, resources: &str, objects: &[Vec<u8>]) -> Vec<u8> {
        pdf_build::pdf(pages, 200, resources, objects)
    }

    /// A JPEG's headers claiming `w`x`h` pixels in three colors (no data).
    fn jpeg_header(w: u16, h: u16) -> Vec<u8> {
        let mut j = vec![0xFF, 0xD8, 0xFF, 0xC0, 0x00, 0x11, 0x08];
        j.extend_from_slice(&h.to_be_bytes());
        j.extend_from_slice(&w.to_be_bytes());
        j.extend_from_slice(&[3, 1, 0x11, 0, 2, 0x11, 1, 3, 0x11, 1, 0xFF, 0xD9]);
        j
    }

    /// Reads `pdf` and renders its first page that needs a look: the text
    /// is read, the page is not rendered, and says why.
    fn refused_render(pdf: &[u8]) -> String {
        let r =
            read_and_render(pdf, &Limits::default(), &AtomicBool::new(false), 1, 110.0).unwrap();
        assert_eq!(r.doc.pages.len(), 1);
        assert!(r.doc.pages[0].needs_look);
        assert_eq!(r.rendered.len(), 1, "{:?}", r.rendered);
        let err = r.rendered[0].1.clone().unwrap_err();
        assert!(render_page(pdf, 1, 110.0).is_err());
        err.reason().to_owned()
    }

    const DRAW_IM: &[u8] = b"q 200 0 0 200 0 0 cm /Im1 Do Q";

    #[test]
    fn an_image_with_a_dictionary_over_4k_is_sized_where_it_is_drawn() {
        // The old raw scan looked 4 KB back from `stream` for `/Image`.
        let pad = "0".repeat(6000);
        let image = stream(
            &format!(
                "/Type /XObject /Subtype /Image /Width 40000 /Height 40000 /ColorSpace /DeviceRGB /BitsPerComponent 8 /Filter /DCTDecode /Pad <{pad}>"
            ),
            &jpeg_header(40000, 40000),
        );
        let pdf = build(
            1,
            "/XObject << /Im1 4 0 R >>",
            &[stream("", DRAW_IM), image],
        );
        let why = refused_render(&pdf);
        assert!(why.contains("40000x40000"), "{why}");
    }

    /// Reads `pdf` and renders its first page: it needs a look and is
    /// rendered.
    fn renders(pdf: &[u8]) -> PdfRead {
        let r = read_and_render(pdf, &Limits::default(), &AtomicBool::new(false), 1, 72.0).unwrap();
        assert_eq!(r.doc.pages.len(), 1);
        assert!(r.doc.pages[0].needs_look);
        assert_eq!(r.rendered.len(), 1, "{:?}", r.rendered);
        assert!(r.rendered[0].1.is_ok(), "{:?}", r.rendered[0].1);
        render_page(pdf, 1, 72.0).unwrap();
        r
    }

    #[test]
    fn a_jpeg_larger_than_its_dictionary_is_decoded_at_the_dictionary_size() {
        // hayro writes the dictionary's size into the JPEG's frame header.
        let image = stream(
            "/Type /XObject /Subtype /Image /Width 10 /Height 10 /ColorSpace /DeviceRGB /BitsPerComponent 8 /Filter /DCTDecode",
            &jpeg_header(60000, 60000),
        );
        let pdf = build(
            1,
            "/XObject << /Im1 4 0 R >>",
            &[stream("", DRAW_IM), image],
        );
        renders(&pdf);
        // A dictionary that is itself huge is refused.
        let image = stream(
            "/Type /XObject /Subtype /Image /Width 40000 /Height 40000 /ColorSpace /DeviceRGB /BitsPerComponent 8 /Filter /DCTDecode",
            &jpeg_header(60000, 60000),
        );
        let pdf = build(
            1,
            "/XObject << /Im1 4 0 R >>",
            &[stream("", DRAW_IM), image],
        );
        let why = refused_render(&pdf);
        assert!(why.contains("40000x40000"), "{why}");
        // Its size given by reference is read (resolved), not refused blind.
        let image = stream(
            "/Type /XObject /Subtype /Image /Width 5 0 R /Height 5 0 R /ColorSpace /DeviceRGB /BitsPerComponent 8 /Filter /DCTDecode",
            &jpeg_header(40000, 40000),
        );
        let pdf = build(
            1,
            "/XObject << /Im1 4 0 R >>",
            &[stream("", DRAW_IM), image, b"40000".to_vec()],
        );
        let why = refused_render(&pdf);
        assert!(why.contains("40000x40000"), "{why}");
        // A JPEG smaller than its dictionary is decoded at its own size.
        let image = stream(
            "/Type /XObject /Subtype /Image /Width 10000 /Height 10000 /ColorSpace /DeviceRGB /BitsPerComponent 8 /Filter /DCTDecode",
            &jpeg_header(20, 20),
        );
        let pdf = build(
            1,
            "/XObject << /Im1 4 0 R >>",
            &[stream("", DRAW_IM), image],
        );
        renders(&pdf);
    }

    /// `bytes` with the first `from` replaced by `to`.
    fn replace(bytes: &[u8], from: &str, to: &str) -> Vec<u8> {
        let at = memchr::memmem::find(bytes, from.as_bytes()).unwrap();
        [&bytes[..at], to.as_bytes(), &bytes[at + from.len()..]].concat()
    }

    #[test]
    fn a_sampled_function_with_too_many_samples_is_refused() {
        // One-bit samples: a byte holds eight.
        let function = |size: u32, outputs: usize| {
            stream(
                &format!(
                    "/FunctionType 0 /Domain [0 1] /Range [{}] /Size [{size}] /BitsPerSample 1 /Filter /FlateDecode",
                    "0 1 ".repeat(outputs)
                ),
                &deflate(&vec![0u8; (size as usize * outputs).div_ceil(8)]),
            )
        };
        let shading =
            b"<< /ShadingType 2 /ColorSpace /DeviceGray /Coords [0 0 200 0] /Function 5 0 R >>"
                .to_vec();
        let with = |function: Vec<u8>| {
            build(
                1,
                "/Shading << /Sh1 4 0 R >>",
                &[stream("", b"/Sh1 sh"), shading.clone(), function],
            )
        };
        let err = read(
            DocKind::Pdf,
            &with(function(40_000_000, 1)),
            &Limits::default(),
        )
        .unwrap_err();
        assert_eq!(
            err.reason(),
            "a sampled function of 40000000 samples is too large"
        );
        // Two outputs: twice the samples.
        let err = read(
            DocKind::Pdf,
            &with(function(10_000_000, 2)),
            &Limits::default(),
        )
        .unwrap_err();
        assert!(err.reason().contains(" 20000000 samples"), "{err}");
        // A size its data does not hold is not read by hayro: not refused.
        let short = replace(&function(1024, 1), "/Size [1024]", "/Size [40000000]");
        read(DocKind::Pdf, &with(short), &Limits::default()).unwrap();
        renders(&with(function(1024, 1)));
    }

    #[test]
    fn a_pattern_of_too_many_tiles_is_not_rendered_but_its_page_is_read() {
        let resources = "/Pattern << /P1 4 0 R >> /Font << /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >>";
        // Eight fills of a quarter of the page, and a word.
        let content = format!(
            "/Pattern cs /P1 scn {}BT /F1 12 Tf 10 180 Td (hello) Tj ET",
            "20 20 100 100 re f ".repeat(8)
        );
        let with_step = |step: &str| {
            let pattern = stream(
                &format!(
                    "/Type /Pattern /PatternType 1 /PaintType 1 /TilingType 1 /BBox [0 0 1000 1000] /XStep {step} /YStep {step} /Resources << >>"
                ),
                b"0 0 1 1 re f",
            );
            build(1, resources, &[stream("", content.as_bytes()), pattern])
        };
        // 1000 / 0.01 copies of the cell on each axis, and one more (0.01
        // as an f32 is a little less, as hayro reads it).
        let pdf = with_step("0.01");
        let why = refused_render(&pdf);
        assert_eq!(why, "a pattern of 10000200001 tiles");
        let doc = read(DocKind::Pdf, &pdf, &Limits::default()).unwrap();
        assert!(doc.pages[0].text.contains("hello"), "{:?}", doc.pages);
        // One copy a side when the step is the cell's size.
        renders(&with_step("1000"));
    }

    /// Whether the one page of an 800 pt PDF needs a look when it draws a
    /// line of text and then `draws` (with `/Im1` = object 4, `image`).
    fn text_page_needs_look(draws: &[u8], image: Option<Vec<u8>>) -> bool {
        let mut content = format!("BT /F1 12 Tf 50 750 Td ({SENTENCE}) Tj ET\n").into_bytes();
        content.extend_from_slice(draws);
        let resources = "/Font << /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >> /XObject << /Im1 4 0 R >>";
        let mut objects = vec![stream("", &content)];
        objects.extend(image);
        let pdf = pdf_build::pdf(1, 800, resources, &objects);
        let doc = read(DocKind::Pdf, &pdf, &Limits::default()).unwrap();
        assert_eq!(doc.pages.len(), 1);
        assert!(doc.pages[0].text.contains(SENTENCE), "{:?}", doc.pages);
        doc.pages[0].needs_look
    }

    /// A `w`x`h` gray image XObject.
    fn gray_image(w: usize, h: usize) -> Vec<u8> {
        stream(
            &format!(
                "/Type /XObject /Subtype /Image /Width {w} /Height {h} /ColorSpace /DeviceGray /BitsPerComponent 8"
            ),
            &vec![0x80; w * h],
        )
    }

    #[test]
    fn a_text_page_with_a_picture_holds_a_figure_whatever_its_pixel_count() {
        // hayro's image transform maps the image's pixels, not the unit
        // square: 16x16 px at 400x300 pt is 19% of the page, whatever
        // 1/256 of it the determinant alone says.
        let at_400x300 = b"q 400 0 0 300 100 100 cm /Im1 Do Q";
        for (w, h) in [(1, 1), (2, 2), (16, 16), (40, 40), (300, 300), (32, 20)] {
            assert!(
                text_page_needs_look(at_400x300, Some(gray_image(w, h))),
                "{w}x{h} px at 400x300 pt"
            );
        }
        // Rotated and flipped: the same area.
        let rotated = b"q 0 300 -400 0 500 100 cm /Im1 Do Q";
        assert!(text_page_needs_look(rotated, Some(gray_image(16, 16))));
        // A stencil mask and an inline image are measured the same way.
        let mask = stream(
            "/Type /XObject /Subtype /Image /Width 16 /Height 16 /ImageMask true /BitsPerComponent 1",
            &[0x55; 32],
        );
        assert!(text_page_needs_look(at_400x300, Some(mask)));
        let mut inline = b"q 400 0 0 300 100 100 cm BI /W 16 /H 16 /BPC 8 /CS /G ID ".to_vec();
        inline.extend_from_slice(&[0x80; 256]);
        inline.extend_from_slice(b" EI Q");
        assert!(text_page_needs_look(&inline, None));
    }

    #[test]
    fn a_text_page_with_only_icons_or_pictures_off_the_page_holds_no_figure() {
        // A bullet: 300x300 px drawn at 5x5 pt, several times.
        let bullets = b"q 5 0 0 5 40 700 cm /Im1 Do Q q 5 0 0 5 40 680 cm /Im1 Do Q";
        assert!(!text_page_needs_look(bullets, Some(gray_image(300, 300))));
        // A logo of 1x1 px at 30x30 pt (0.14% of the page).
        let logo = b"q 30 0 0 30 700 740 cm /Im1 Do Q";
        assert!(!text_page_needs_look(logo, Some(gray_image(1, 1))));
        // Large, but drawn past the page's edge.
        let off_page = b"q 400 0 0 300 900 100 cm /Im1 Do Q";
        assert!(!text_page_needs_look(off_page, Some(gray_image(16, 16))));
        // Text alone.
        assert!(!text_page_needs_look(b"", None));
    }

    #[test]
    fn xref_and_object_streams_are_bounded_through_their_filter_chains() {
        // An xref stream (hayro decodes it as it opens the file).
        let bomb = deflate(&deflate(&vec![0u8; 4 << 20]));
        let mut file = b"%PDF-1.7\n1 0 obj\n<< /Type /Catalog >>\nendobj\n3 0 obj\n".to_vec();
        file.extend_from_slice(&stream(
            "/Type /XRef /Size 4 /W [1 4 1] /Root 1 0 R /Filter [/FlateDecode /FlateDecode]",
            &bomb,
        ));
        file.extend_from_slice(b"\nendobj\nstartxref\n45\n%%EOF\n");
        let err = within_bounds(&file, 1 << 20).unwrap_err();
        assert_eq!(err.reason(), "too large when unpacked");
        within_bounds(&file, 8 << 20).unwrap();
        // An object stream: abbreviated names, hex around the deflate, a
        // dictionary over 4 KB with a string holding `obj`.
        let hex: Vec<u8> = deflate(&vec![0u8; 4 << 20])
            .iter()
            .flat_map(|b| format!("{b:02x}").into_bytes())
            .collect();
        let pad = "0".repeat(6000);
        let mut file = b"%PDF-1.7\n4 0 obj\n".to_vec();
        file.extend_from_slice(&stream(
            &format!(
                "/Type /ObjStm /N 1 /First 4 /Filter [/AHx /Fl] /Pad <{pad}> /Note (obj << >>)"
            ),
            &hex,
        ));
        file.extend_from_slice(b"\nendobj\n%%EOF\n");
        let err = within_bounds(&file, 1 << 20).unwrap_err();
        assert_eq!(err.reason(), "too large when unpacked");
        within_bounds(&file, 8 << 20).unwrap();
    }

    #[test]
    fn an_image_whose_filter_is_by_reference_is_inflated_within_bounds() {
        // 100x100 gray wants 10 KB; its data inflates to 16 MiB.
        let image = stream(
            "/Type /XObject /Subtype /Image /Width 100 /Height 100 /ColorSpace /DeviceGray /BitsPerComponent 8 /Filter 5 0 R",
            &deflate(&vec![0u8; 16 << 20]),
        );
        let pdf = build(
            1,
            "/XObject << /Im1 4 0 R >>",
            &[stream("", DRAW_IM), image, b"/FlateDecode".to_vec()],
        );
        let why = refused_render(&pdf);
        assert!(why.contains("too large when unpacked"), "{why}");
    }

    #[test]
    fn inline_images_in_a_compressed_content_stream_are_sized() {
        let giant = deflate(
            b"q 200 0 0 200 0 0 cm BI /W 40000 /H 40000 /BPC 8 /CS /G ID \x00\x00\x00\x00 EI Q",
        );
        let pdf = build(1, "", &[stream("/Filter /FlateDecode", &giant)]);
        let why = refused_render(&pdf);
        assert!(why.contains("40000x40000"), "{why}");
        // A small inline image whose own data is a deflate bomb.
        let mut content = b"q 200 0 0 200 0 0 cm BI /W 10 /H 10 /BPC 8 /CS /G /F /Fl ID ".to_vec();
        content.extend_from_slice(&deflate(&vec![0u8; 16 << 20]));
        content.extend_from_slice(b" EI Q");
        let pdf = build(1, "", &[stream("/Filter /FlateDecode", &deflate(&content))]);
        let why = refused_render(&pdf);
        assert!(why.contains("too large when unpacked"), "{why}");
    }

    #[test]
    fn streams_are_counted_through_filter_chains_and_references() {
        // ASCII85 around a deflate bomb: the raw scan cannot inflate it.
        let bomb = deflate(&vec![b' '; 4 << 20]);
        let mut a85 = Vec::new();
        for chunk in bomb.chunks(4) {
            let mut c = [0u8; 4];
            c[..chunk.len()].copy_from_slice(chunk);
            let mut v = u32::from_be_bytes(c);
            let mut d = [0u8; 5];
            for k in (0..5).rev() {
                d[k] = (v % 85) as u8 + b'!';
                v /= 85;
            }
            a85.extend_from_slice(&d[..chunk.len() + 1]);
        }
        a85.extend_from_slice(b"~>");
        let pdf = build(
            1,
            "",
            &[stream("/Filter 4 0 R", &a85), b"[/A85 /Fl]".to_vec()],
        );
        within_bounds(&pdf, 1 << 20).unwrap();
        let (pdf, _) = (Pdf::new(pdf).unwrap(), ());
        let err = streams_within(pdf.objects(), 1 << 20).unwrap_err();
        assert_eq!(err, "too large when unpacked");
        let sizes = streams_within(pdf.objects(), 8 << 20).unwrap();
        assert!(sizes.values().any(|&n| n == 4 << 20), "{sizes:?}");
    }

    #[test]
    fn pages_sharing_one_big_content_stream_stop_at_the_budget() {
        // 20000 filled squares (about 300 KB), drawn by 400 pages.
        let content = "0 0 1 1 re f\n".repeat(20_000);
        let pdf = build(
            400,
            "",
            &[stream("/Filter /FlateDecode", &deflate(content.as_bytes()))],
        );
        let stop = AtomicBool::new(false);
        let limits = Limits {
            max_work: 500_000,
            ..Limits::default()
        };
        let r = read_and_render(&pdf, &limits, &stop, 0, 72.0).unwrap();
        assert_eq!(r.doc.stopped.as_deref(), Some("over the work budget"));
        assert!(r.doc.truncated);
        // A page is ~60000 units (a call and 5 elements per square).
        assert!(r.doc.pages.len() <= 9, "{}", r.doc.pages.len());
        assert!(r.work <= limits.max_work + 64 * 6 + 6, "{}", r.work);
        // The content budget counts the stream once per page.
        let limits = Limits {
            max_content_bytes: content.len() * 3,
            ..Limits::default()
        };
        let r = read_and_render(&pdf, &limits, &stop, 0, 72.0).unwrap();
        assert_eq!(r.doc.stopped.as_deref(), Some("over the content budget"));
        assert_eq!(r.doc.pages.len(), 3);
        // A request gone: nothing more is read.
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let r = read_and_render(&pdf, &Limits::default(), &stop, 0, 72.0).unwrap();
        assert_eq!(r.doc.stopped.as_deref(), Some("the request was cancelled"));
        assert!(r.doc.pages.is_empty());
    }

    #[test]
    fn one_opening_reads_and_renders() {
        let r = read_and_render(
            &fixture("chart.pdf"),
            &Limits::default(),
            &AtomicBool::new(false),
            4,
            110.0,
        )
        .unwrap();
        assert_eq!(r.doc.pages.len(), 2);
        assert_eq!(r.rendered.len(), 1);
        assert_eq!(r.rendered[0].0, 2);
        let png = r.rendered[0].1.as_ref().unwrap();
        assert_eq!(png, &render_page(&fixture("chart.pdf"), 2, 110.0).unwrap());
        let none = read_and_render(
            &fixture("chart.pdf"),
            &Limits::default(),
            &AtomicBool::new(false),
            0,
            110.0,
        )
        .unwrap();
        assert!(none.rendered.is_empty());
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
    fn objects_nested_deeper_than_the_parser_reads_say_so() {
        let content = b"BT /F1 12 Tf 20 100 Td (Deep inside) Tj ET";
        // A page tree 1,000 levels deep by reference is read.
        let deep = pdf_build::nested_pdf(1000, content);
        let doc = read(DocKind::Pdf, &deep, &Limits::default()).unwrap();
        assert_eq!(doc.pages.len(), 1);
        assert_eq!(doc.pages[0].text, "Deep inside");
        // Written inside each other, or a page whose resources nest 1,000
        // deep: the parser reads neither, and the reason is given.
        let inline = pdf_build::inline_nested_pdf(1000, content);
        let res = format!(
            "{}/Font << /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >>{}",
            "/X [".repeat(1000),
            "]".repeat(1000)
        );
        let resources = pdf_build::pdf(1, 200, &res, &[stream("", content)]);
        for pdf in [inline, resources] {
            let err = read(DocKind::Pdf, &pdf, &Limits::default()).unwrap_err();
            assert_eq!(
                err.reason(),
                "too deeply nested (objects nested over 512 levels deep)"
            );
        }
        // Nested as deep as it reads: read.
        let inline = pdf_build::inline_nested_pdf(100, content);
        assert_eq!(
            read(DocKind::Pdf, &inline, &Limits::default())
                .unwrap()
                .pages
                .len(),
            1
        );
        assert_eq!(nesting(b"<< /A [ [ (]]]) <</B 1>> ] ] >> % [[[[\n"), 4);
        assert_eq!(nesting(b"<< /Length 3 >>\nstream\n[[[\nendstream"), 1);
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
