//! What reading a PDF may cost, checked where hayro would pay it.
//!
//! hayro decodes without bounds of its own: a stream's filters run to the
//! end whatever they make, and an image is decoded to the size its codestream
//! says. So, before hayro decodes anything a hostile file controls:
//!
//! - every stream's non-image filters (Flate, LZW, RunLength, ASCII) are run
//!   here, bounded, and counted ([`unfilter`]; the document's total is
//!   capped);
//! - every image a page draws (XObject or inline, and those inside patterns,
//!   soft masks and Type 3 glyphs, which only the renderer interprets) is
//!   sized before a page is rendered: its declared size, and the size its
//!   JPEG, JPEG 2000, JBIG2 or CCITT data says ([`ImageCheck`]); an image
//!   whose size cannot be known, or is over the cap, keeps the page from
//!   being rendered;
//! - the interpreter's work is metered ([`Meter`]): every device call is
//!   charged, and once the document's budget, deadline or the request is
//!   gone, the next call unwinds out of the interpreter (caught by the page's
//!   `catch_unwind`).

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::panic::resume_unwind;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use hayro::hayro_interpret::font::{Glyph, GlyphRun};
use hayro::hayro_interpret::hayro_syntax::object::{
    Array, Dict, Name, Object, ObjectIdentifier, Stream,
};
use hayro::hayro_interpret::kurbo::{Affine, BezPath, Rect, Shape};
use hayro::hayro_interpret::pattern::{Pattern, TilingPattern};
use hayro::hayro_interpret::util::x_y_advances;
use hayro::hayro_interpret::{
    BlendMode, CacheKey, ClipPath, Device, DrawMode, DrawProps, Image, ImageDrawProps, Paint,
    SoftMask,
};

/// The largest image (width × height) a page may draw and still be rendered.
pub const MAX_IMAGE_PIXELS: u64 = 100_000_000;
/// The most samples (pixels × components) one image may decode to.
pub const MAX_IMAGE_SAMPLES: u64 = 4 * MAX_IMAGE_PIXELS;
/// The most image pixels one page may draw, all its images together.
pub const MAX_PAGE_IMAGE_PIXELS: u64 = 2 * MAX_IMAGE_PIXELS;

const TOO_LARGE: &str = "too large when unpacked";

/// Why the interpreter was stopped mid-page (the payload it unwinds with).
pub(crate) struct Spent(pub(crate) &'static str);

/// Interpreter work for one document: device calls, path elements and
/// glyphs, against a budget, a deadline and the request's stop flag.
pub(crate) struct Meter<'s> {
    work: Cell<u64>,
    max_work: u64,
    deadline: Instant,
    stop: &'s AtomicBool,
    calls: Cell<u32>,
}

impl<'s> Meter<'s> {
    pub(crate) fn new(max_work: u64, deadline: Instant, stop: &'s AtomicBool) -> Self {
        Self {
            work: Cell::new(0),
            max_work,
            deadline,
            stop,
            calls: Cell::new(0),
        }
    }

    /// The work done so far.
    pub(crate) fn work(&self) -> u64 {
        self.work.get()
    }

    /// Adds `n` units of work (for a page about to be rendered again).
    pub(crate) fn add(&self, n: u64) {
        self.work.set(self.work.get().saturating_add(n));
    }

    /// Why no more work may be done, if so.
    pub(crate) fn spent(&self) -> Option<&'static str> {
        if self.stop.load(Ordering::Relaxed) {
            Some("the request was cancelled")
        } else if self.work.get() > self.max_work {
            Some("over the work budget")
        } else if Instant::now() >= self.deadline {
            Some("over the time budget")
        } else {
            None
        }
    }

    /// Charges `n` units from inside the interpreter; unwinds out of it
    /// (with [`Spent`]) once nothing more may be done. The clock is read
    /// every 64th call.
    pub(crate) fn charge(&self, n: u64) {
        self.add(n.saturating_add(1));
        let calls = self.calls.get().wrapping_add(1);
        self.calls.set(calls);
        if (calls.is_multiple_of(64) || self.work.get() > self.max_work)
            && let Some(why) = self.spent()
        {
            resume_unwind(Box::new(Spent(why)));
        }
    }
}

/// What [`unfilter`] makes: the bytes, their count, the codec after.
pub(crate) type Unfiltered<'d> = (Cow<'d, [u8]>, usize, Option<Filter>);

/// Runs `raw` through the non-image `filters` (in order; a leading Crypt is
/// skipped, decryption being done by hayro), making at most `cap` bytes.
/// Returns the bytes (only when `keep`, else empty) with their count, and
/// the image filter that follows, if any. `Err`: over the cap, or a filter
/// after an image filter (what it would make cannot be known).
pub(crate) fn unfilter<'d>(
    raw: &'d [u8],
    filters: &[Filter],
    cap: usize,
    keep: bool,
) -> Result<Unfiltered<'d>, String> {
    let mut data: Cow<'d, [u8]> = Cow::Borrowed(raw);
    let mut made = raw.len();
    let filters = match filters.first() {
        Some(Filter::Crypt) => &filters[1..],
        _ => filters,
    };
    for (i, filter) in filters.iter().enumerate() {
        let last = i + 1 == filters.len();
        if is_image_filter(*filter) {
            if !last {
                return Err("an image filtered after its codec".to_owned());
            }
            return Ok((data, made, Some(*filter)));
        }
        // What the next filter reads is kept; the last one's only when asked.
        let mut out = Out::new(cap, keep || !last);
        let ok = match filter {
            Filter::FlateDecode => inflate(&data, &mut out),
            Filter::LzwDecode => lzw(&data, &mut out),
            Filter::RunLengthDecode => run_length(&data, &mut out),
            Filter::AsciiHexDecode => ascii_hex(&data, &mut out),
            Filter::Ascii85Decode => ascii85(&data, &mut out),
            _ => Ok(()),
        };
        if ok.is_err() {
            return Err(TOO_LARGE.to_owned());
        }
        made = out.count;
        data = Cow::Owned(out.bytes);
    }
    Ok((data, made, None))
}

/// A stream filter, as hayro resolves them ([`Stream::filters`]; its own
/// type is not exported, so it is known here by its `Debug` name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Filter {
    AsciiHexDecode,
    Ascii85Decode,
    LzwDecode,
    FlateDecode,
    RunLengthDecode,
    CcittFaxDecode,
    Jbig2Decode,
    DctDecode,
    JpxDecode,
    Crypt,
    /// One this version of hayro added: treated as a codec (its output
    /// cannot be known).
    Other,
}

/// The filters hayro applies to `stream`, in order.
pub(crate) fn filters(stream: &Stream<'_>) -> Vec<Filter> {
    stream
        .filters()
        .iter()
        .map(|f| match format!("{f:?}").as_str() {
            "AsciiHexDecode" => Filter::AsciiHexDecode,
            "Ascii85Decode" => Filter::Ascii85Decode,
            "LzwDecode" => Filter::LzwDecode,
            "FlateDecode" => Filter::FlateDecode,
            "RunLengthDecode" => Filter::RunLengthDecode,
            "CcittFaxDecode" => Filter::CcittFaxDecode,
            "Jbig2Decode" => Filter::Jbig2Decode,
            "DctDecode" => Filter::DctDecode,
            "JpxDecode" => Filter::JpxDecode,
            "Crypt" => Filter::Crypt,
            _ => Filter::Other,
        })
        .collect()
}

impl Filter {
    /// The filter a PDF name stands for (full or abbreviated, as hayro
    /// reads them); one hayro does not know is [`Filter::Other`].
    fn from_name(name: &[u8]) -> Self {
        match name {
            b"ASCIIHexDecode" | b"AHx" => Self::AsciiHexDecode,
            b"ASCII85Decode" | b"A85" => Self::Ascii85Decode,
            b"LZWDecode" | b"LZW" => Self::LzwDecode,
            b"FlateDecode" | b"Fl" => Self::FlateDecode,
            b"RunLengthDecode" | b"RL" => Self::RunLengthDecode,
            b"CCITTFaxDecode" | b"CCF" => Self::CcittFaxDecode,
            b"JBIG2Decode" => Self::Jbig2Decode,
            b"DCTDecode" | b"DCT" => Self::DctDecode,
            b"JPXDecode" => Self::JpxDecode,
            b"Crypt" => Self::Crypt,
            _ => Self::Other,
        }
    }
}

/// What `raw` decodes to through `filters` (up to an image codec), made
/// within `cap` bytes: 0 when no filter decodes it. `Err`: over the cap.
pub(crate) fn decoded_len(raw: &[u8], filters: &[Filter], cap: usize) -> Result<usize, String> {
    let decodes = filters
        .iter()
        .find(|f| **f != Filter::Crypt)
        .is_some_and(|f| !is_image_filter(*f));
    if !decodes {
        return Ok(0);
    }
    match unfilter(raw, filters, cap, false) {
        Ok((_, made, _)) => Ok(made),
        Err(why) if why == TOO_LARGE => Err(why),
        // A filter after a codec: what the codec makes is sized where drawn.
        Err(_) => Ok(0),
    }
}

/// The filters a stream's dictionary names directly, read from the file as
/// written (before hayro opens it): the dictionary after the nearest `obj`
/// keyword (of at most 8, searched back to `from`) that is read to end just
/// before the `stream` keyword at `keyword`. `None`: no such dictionary, or
/// no direct `/Filter` in it (a name, or an array whose names are taken up
/// to its first other entry, taken as a codec).
pub(crate) fn raw_stream_filters(bytes: &[u8], from: usize, keyword: usize) -> Option<Vec<Filter>> {
    use hayro::hayro_interpret::hayro_syntax::reader::{Reader, ReaderExt};
    let region = bytes.get(from..keyword)?;
    let mut end = region.len();
    for _ in 0..8 {
        let at = from + memchr::memmem::rfind(region.get(..end)?, b"obj")?;
        end = at - from;
        let mut r = Reader::new(bytes.get(..keyword)?);
        r.jump(at + 3);
        r.skip_white_spaces_and_comments();
        let Some(dict) = r.read_without_context::<Dict<'_>>() else {
            continue;
        };
        r.skip_white_spaces_and_comments();
        if !r.at_end() {
            continue;
        }
        if let Some(name) = dict.get::<Name<'_>>(b"Filter") {
            return Some(vec![Filter::from_name(&name)]);
        }
        let names = dict.get::<Array<'_>>(b"Filter")?;
        let mut chain = Vec::new();
        for entry in names.iter::<Object<'_>>() {
            match entry {
                Object::Name(n) => chain.push(Filter::from_name(&n)),
                _ => {
                    chain.push(Filter::Other);
                    break;
                }
            }
        }
        return Some(chain);
    }
    None
}

fn is_image_filter(f: Filter) -> bool {
    matches!(
        f,
        Filter::DctDecode
            | Filter::JpxDecode
            | Filter::Jbig2Decode
            | Filter::CcittFaxDecode
            | Filter::Other
    )
}

/// A filter's output: counted, and kept when asked.
struct Out {
    bytes: Vec<u8>,
    count: usize,
    cap: usize,
    keep: bool,
}

struct Over;

impl Out {
    fn new(cap: usize, keep: bool) -> Self {
        Self {
            bytes: Vec::new(),
            count: 0,
            cap,
            keep,
        }
    }

    fn push(&mut self, b: &[u8]) -> Result<(), Over> {
        self.count = self.count.saturating_add(b.len());
        if self.count > self.cap {
            return Err(Over);
        }
        if self.keep {
            // Grown by doubling, but never past the cap.
            if self.bytes.capacity() < self.count {
                let want = (self.bytes.capacity() * 2).clamp(self.count, self.cap);
                self.bytes.reserve_exact(want - self.bytes.len());
            }
            self.bytes.extend_from_slice(b);
        }
        Ok(())
    }
}

/// zlib, or raw deflate when the zlib header is missing (as hayro allows).
/// A stream that breaks off ends there.
fn inflate(data: &[u8], out: &mut Out) -> Result<(), Over> {
    let mut scratch = vec![0u8; 64 * 1024];
    for zlib in [true, false] {
        let mut z = flate2::Decompress::new(zlib);
        let mut input = data;
        loop {
            let (in_before, out_before) = (z.total_in(), z.total_out());
            let status = z.decompress(input, &mut scratch, flate2::FlushDecompress::None);
            let used = usize::try_from(z.total_in() - in_before).unwrap_or(usize::MAX);
            let made = usize::try_from(z.total_out() - out_before).unwrap_or(usize::MAX);
            input = input.get(used..).unwrap_or_default();
            out.push(scratch.get(..made).unwrap_or_default())?;
            match status {
                Ok(flate2::Status::StreamEnd) => return Ok(()),
                Err(_) if z.total_out() == 0 && zlib => break,
                Err(_) => return Ok(()),
                Ok(_) if used == 0 && made == 0 => return Ok(()),
                Ok(_) => {}
            }
        }
    }
    Ok(())
}

/// LZW as PDF uses it (MSB first, 9 to 12 bits, early change).
fn lzw(data: &[u8], out: &mut Out) -> Result<(), Over> {
    // Each entry: where its bytes start in `made`, and how many.
    let mut made: Vec<u8> = Vec::new();
    let mut table: Vec<(usize, usize)> = Vec::new();
    let reset = |table: &mut Vec<(usize, usize)>| {
        table.clear();
        table.extend((0..258).map(|_| (0, 0)));
    };
    reset(&mut table);
    let (mut acc, mut bits, mut width) = (0u32, 0u32, 9u32);
    let mut prev: Option<(usize, usize)> = None;
    // The output is kept for the table's references even when only counted;
    // it is bounded by the cap.
    for &byte in data {
        acc = (acc << 8) | u32::from(byte);
        bits += 8;
        while bits >= width {
            let code = ((acc >> (bits - width)) & ((1 << width) - 1)) as usize;
            bits -= width;
            match code {
                256 => {
                    reset(&mut table);
                    width = 9;
                    prev = None;
                    continue;
                }
                257 => return finish_lzw(made, out),
                _ => {}
            }
            let start = made.len();
            let entry = if code < 256 {
                made.push(code as u8);
                (start, 1)
            } else if let Some(&(s, n)) = table.get(code).filter(|_| code < table.len()) {
                made.extend_from_within(s..s + n);
                (start, n)
            } else if let (Some((s, n)), true) = (prev, code == table.len()) {
                made.extend_from_within(s..s + n);
                made.push(made[s]);
                (start, n + 1)
            } else {
                return finish_lzw(made, out);
            };
            if made.len() > out.cap {
                return Err(Over);
            }
            if let Some((s, n)) = prev
                && table.len() < 4096
            {
                table.push((s, n + 1));
            }
            prev = Some(entry);
            let early = table.len() + 1;
            width = match early {
                0..512 => 9,
                512..1024 => 10,
                1024..2048 => 11,
                _ => 12,
            };
        }
    }
    finish_lzw(made, out)
}

fn finish_lzw(made: Vec<u8>, out: &mut Out) -> Result<(), Over> {
    out.push(&made)
}

fn run_length(data: &[u8], out: &mut Out) -> Result<(), Over> {
    let mut i = 0;
    while let Some(&n) = data.get(i) {
        match n {
            128 => break,
            0..128 => {
                let run = data
                    .get(i + 1..(i + 2 + n as usize).min(data.len()))
                    .unwrap_or_default();
                out.push(run)?;
                i += 2 + n as usize;
            }
            _ => {
                let b = data.get(i + 1).copied().unwrap_or(0);
                out.push(&vec![b; 257 - n as usize])?;
                i += 2;
            }
        }
    }
    Ok(())
}

/// Decoded bytes are handed on in chunks of this size.
const CHUNK: usize = 16 * 1024;

fn ascii_hex(data: &[u8], out: &mut Out) -> Result<(), Over> {
    let mut buf = Vec::with_capacity(CHUNK);
    let mut high: Option<u8> = None;
    for &b in data.iter().take_while(|&&b| b != b'>') {
        let Some(d) = (b as char).to_digit(16) else {
            continue;
        };
        let d = d as u8;
        match high.take() {
            None => high = Some(d),
            Some(hi) => {
                buf.push(hi << 4 | d);
                if buf.len() == CHUNK {
                    out.push(&buf)?;
                    buf.clear();
                }
            }
        }
    }
    if let Some(hi) = high {
        buf.push(hi << 4);
    }
    out.push(&buf)
}

fn ascii85(data: &[u8], out: &mut Out) -> Result<(), Over> {
    let mut buf = Vec::with_capacity(CHUNK + 4);
    let mut group = [0u32; 5];
    let mut n = 0;
    for &b in data {
        match b {
            b'~' => break,
            b'z' if n == 0 => buf.extend_from_slice(&[0; 4]),
            b'!'..=b'u' => {
                group[n] = u32::from(b - b'!');
                n += 1;
                if n == 5 {
                    let v = group
                        .iter()
                        .fold(0u32, |a, &d| a.wrapping_mul(85).wrapping_add(d));
                    buf.extend_from_slice(&v.to_be_bytes());
                    n = 0;
                }
            }
            _ => {}
        }
        if buf.len() >= CHUNK {
            out.push(&buf)?;
            buf.clear();
        }
    }
    if n > 1 {
        for d in group.iter_mut().skip(n) {
            *d = 84;
        }
        let v = group
            .iter()
            .fold(0u32, |a, &d| a.wrapping_mul(85).wrapping_add(d));
        buf.extend_from_slice(&v.to_be_bytes()[..n - 1]);
    }
    out.push(&buf)
}

/// The images a page draws, sized before it is rendered.
#[derive(Default)]
pub(crate) struct ImageCheck {
    /// Why the page may not be rendered (the first refusal).
    pub(crate) refused: Option<String>,
    /// Image pixels drawn so far on the page.
    pixels: u64,
    /// Images, patterns, masks and glyphs already looked at.
    seen: HashSet<u128>,
    /// Pattern tiles the renderer would draw on the page, all together.
    tiles: u64,
    /// While a pattern's cell is looked at: how many times it is drawn.
    tile_factor: u64,
}

impl ImageCheck {
    pub(crate) fn image(&mut self, image: &Image<'_, '_>, meter: &Meter<'_>) {
        if self.refused.is_some() {
            return;
        }
        let (w, h) = (u64::from(image.width()), u64::from(image.height()));
        let key = image.cache_key();
        let pixels = match self.seen.contains(&key) {
            true => w.saturating_mul(h),
            false => {
                let stream = match image {
                    Image::Stencil(s) => s.stream(),
                    Image::Raster(r) => r.stream(),
                };
                match image_size(stream, w, h) {
                    Ok(p) => p,
                    Err(why) => {
                        self.refused = Some(why);
                        return;
                    }
                }
            }
        };
        self.seen.insert(key);
        meter.charge(0);
        self.pixels = self.pixels.saturating_add(pixels);
        if self.pixels > MAX_PAGE_IMAGE_PIXELS {
            self.refused = Some(format!(
                "its images are over {} million pixels together",
                MAX_PAGE_IMAGE_PIXELS / 1_000_000
            ));
        }
    }

    /// A path drawn (`clip`: the page, where what is painted is clipped to
    /// it): its work charged, its paint and its soft mask checked.
    pub(crate) fn path<'a>(
        &mut self,
        path: &BezPath,
        props: &DrawProps<'a>,
        mode: &DrawMode,
        clip: Option<Rect>,
        meter: &Meter<'_>,
    ) {
        meter.charge(path.elements().len() as u64);
        let area = painted_area(path, props.transform, mode, clip);
        self.paint(&props.paint, DrawTransform(props.transform), area, meter);
        self.mask(props.soft_mask.as_ref(), meter);
    }

    /// A glyph run drawn over `area` (its glyphs' place is not worked out:
    /// the page, or nothing, within a tile or two a side of their box).
    pub(crate) fn glyph_run<'a>(
        &mut self,
        run: &GlyphRun<'_, 'a>,
        props: &DrawProps<'a>,
        area: Rect,
        meter: &Meter<'_>,
    ) {
        meter.charge(run.glyphs().len() as u64);
        self.glyphs(run, props, meter);
        self.paint(&props.paint, DrawTransform(props.transform), area, meter);
    }

    /// An image drawn, and its soft mask.
    pub(crate) fn drawn_image<'a>(
        &mut self,
        image: &Image<'a, '_>,
        props: &ImageDrawProps<'a>,
        meter: &Meter<'_>,
    ) {
        self.image(image, meter);
        self.mask(props.soft_mask.as_ref(), meter);
    }

    /// A transparency group pushed, and its soft mask.
    pub(crate) fn group<'a>(&mut self, mask: Option<&SoftMask<'a>>, meter: &Meter<'_>) {
        meter.charge(0);
        self.mask(mask, meter);
    }

    /// Counts the tiles a tiling pattern is drawn with over `area` (what is
    /// painted, device space), and looks inside what only the renderer
    /// interprets: the pattern's cell.
    pub(crate) fn paint<'a>(
        &mut self,
        paint: &Paint<'a>,
        props_transform: DrawTransform,
        area: Rect,
        meter: &Meter<'_>,
    ) {
        if self.refused.is_some() {
            return;
        }
        if let Paint::Pattern(p) = paint
            && let Pattern::Tiling(t) = &**p
        {
            let copies = tile_copies(t, area).saturating_mul(self.tile_factor.max(1));
            self.tiles = self.tiles.saturating_add(copies);
            if copies > MAX_PAGE_TILES {
                self.refused = Some(format!("a pattern of {copies} tiles"));
                return;
            }
            if self.tiles > MAX_PAGE_TILES {
                self.refused = Some(format!("patterns of {} tiles", self.tiles));
                return;
            }
            if self.seen.insert(t.cache_key()) {
                // What the cell draws is drawn once per tile.
                let outer = self.tile_factor;
                self.tile_factor = copies.max(1);
                let mut probe = Probe { check: self, meter };
                let _ = t.interpret(&mut probe, props_transform.0, false);
                self.tile_factor = outer;
            }
        }
    }

    /// …a soft mask.
    pub(crate) fn mask<'a>(&mut self, mask: Option<&SoftMask<'a>>, meter: &Meter<'_>) {
        if self.refused.is_some() {
            return;
        }
        if let Some(m) = mask
            && self.seen.insert(m.cache_key())
        {
            let mut probe = Probe { check: self, meter };
            m.interpret(&mut probe);
        }
    }

    /// …Type 3 glyphs.
    pub(crate) fn glyphs<'a>(
        &mut self,
        run: &GlyphRun<'_, 'a>,
        props: &DrawProps<'a>,
        meter: &Meter<'_>,
    ) {
        if self.refused.is_some() {
            return;
        }
        for glyph in run.glyphs() {
            if let Glyph::Type3(g) = &**glyph
                && self.seen.insert(g.cache_key())
            {
                let mut probe = Probe { check: self, meter };
                g.interpret(&mut probe, props.transform, glyph.transform(), &props.paint);
            }
        }
    }
}

/// The most pattern tiles (copies of a tiling pattern's cell, each one
/// interpreted and drawn by the renderer) one page may draw and still be
/// rendered.
pub const MAX_PAGE_TILES: u64 = 4_000_000;

/// How many copies of its cell hayro's renderer draws to paint `t` over
/// `area` (device space, clipped to the page): hayro's `tiling::TileAxis`,
/// the copies on each axis multiplied.
fn tile_copies(t: &TilingPattern<'_>, area: Rect) -> u64 {
    let area = t.matrix.inverse().transform_rect_bbox(area);
    let axis = |cell: (f64, f64), step: f32, area: (f64, f64)| -> u64 {
        let step = f64::from(step.abs());
        let width = cell.1 - cell.0;
        let visible = (area.1 - area.0).max(0.0);
        let (first, last) = if visible >= step {
            (i64::from((-width / step).floor() as i32) + 1, 0)
        } else {
            (
                i64::from(((area.0 - cell.1) / step).ceil() as i32),
                i64::from(((area.1 - cell.0) / step).floor() as i32),
            )
        };
        u64::try_from(last - first + 1).unwrap_or(0)
    };
    let x = axis((t.bbox.x0, t.bbox.x1), t.x_step, (area.x0, area.x1));
    let y = axis((t.bbox.y0, t.bbox.y1), t.y_step, (area.y0, area.y1));
    x.saturating_mul(y)
}

/// What a path paints (device space), as hayro's renderer sizes a pattern
/// for it: its box, widened by the line width when stroked, clipped to the
/// `page` when known.
pub(crate) fn painted_area(
    path: &BezPath,
    transform: Affine,
    mode: &DrawMode,
    page: Option<Rect>,
) -> Rect {
    let mut area = transform.transform_rect_bbox(path.bounding_box());
    if let DrawMode::Stroke(s) | DrawMode::FillAndStroke(_, s) = mode {
        let (a, b) = x_y_advances(&transform);
        let widen = a.length().max(b.length()) * f64::from(s.line_width);
        area = area.inflate(widen, widen);
    }
    match page {
        Some(page) => area.intersect(page),
        None => area,
    }
}

/// A transform handed to [`ImageCheck::paint`].
#[derive(Clone, Copy)]
pub(crate) struct DrawTransform(pub(crate) Affine);

/// The pixels an image decodes to, or why it may not be decoded: over the
/// caps, or a size its data does not let be known.
fn image_size(stream: &Stream<'_>, w: u64, h: u64) -> Result<u64, String> {
    let too_large = |w: u64, h: u64| format!("an image of {w}x{h} pixels is too large");
    if w.saturating_mul(h) > MAX_IMAGE_PIXELS {
        return Err(too_large(w, h));
    }
    let dict = stream.dict();
    let comps = components(dict);
    if w.saturating_mul(h).saturating_mul(comps) > MAX_IMAGE_SAMPLES {
        return Err(format!(
            "an image of {w}x{h} pixels in {comps} colors is too large"
        ));
    }
    let bpc = dict
        .get::<u8>(b"BitsPerComponent")
        .or_else(|| dict.get::<u8>(b"BPC"))
        .unwrap_or(8)
        .clamp(1, 16);
    // What its samples take, with room for sloppy writers.
    let expected = (w * comps * u64::from(bpc)).div_ceil(8) * h;
    let cap = usize::try_from(expected + expected / 8 + (64 << 10)).unwrap_or(usize::MAX);
    let raw = stream.raw_data();
    let (data, _, codec) = unfilter(&raw, &filters(stream), cap, false)
        .map_err(|why| format!("an image whose data is {why}"))?;
    let (cw, ch, cc) = match codec {
        None => return Ok(w.saturating_mul(h)),
        Some(Filter::DctDecode) => match dct_decoded(&data, w, h) {
            Some(data) => jpeg_size(&data).ok_or("a JPEG image whose size cannot be read")?,
            // hayro does not decode it.
            None => return Ok(w.saturating_mul(h)),
        },
        Some(Filter::JpxDecode) => {
            jpx_size(&data).ok_or("a JPEG 2000 image whose size cannot be read")?
        }
        Some(Filter::Jbig2Decode) => {
            let page = hayro_jbig2::Page::new_embedded(
                &data,
                None,
                &hayro_jbig2::DecodeSettings { strict: false },
            )
            .map_err(|_| "a JBIG2 image whose size cannot be read")?;
            (u64::from(page.width()), u64::from(page.height()), 1)
        }
        Some(Filter::CcittFaxDecode) => {
            let columns = decode_params(dict)
                .and_then(|p| p.get::<u32>(b"Columns"))
                .map_or(1728, u64::from);
            (columns, h, 1)
        }
        Some(_) => return Err("an image in a format whose size cannot be read".to_owned()),
    };
    if cw == 0 || ch == 0 {
        return Err("an image whose size cannot be read".to_owned());
    }
    if cw.saturating_mul(ch) > MAX_IMAGE_PIXELS {
        return Err(too_large(cw, ch));
    }
    if cw.saturating_mul(ch).saturating_mul(cc.max(1)) > MAX_IMAGE_SAMPLES {
        return Err(format!(
            "an image of {cw}x{ch} pixels in {cc} colors is too large"
        ));
    }
    Ok(cw.saturating_mul(ch).max(w.saturating_mul(h)))
}

fn decode_params<'a>(dict: &Dict<'a>) -> Option<Dict<'a>> {
    for key in [&b"DecodeParms"[..], b"DP"] {
        if let Some(d) = dict.get::<Dict<'_>>(key) {
            return Some(d);
        }
        if let Some(a) = dict.get::<Array<'_>>(key) {
            return a.iter::<Dict<'_>>().last();
        }
    }
    None
}

/// Components per pixel from the image's color space: the count of a
/// DeviceN's names, else at most four (CMYK).
fn components(dict: &Dict<'_>) -> u64 {
    let cs = dict
        .get::<Object<'_>>(b"ColorSpace")
        .or_else(|| dict.get::<Object<'_>>(b"CS"));
    if let Some(Object::Array(a)) = cs
        && a.iter::<Name<'_>>()
            .next()
            .is_some_and(|n| &*n == b"DeviceN" || &*n == b"NChannel")
        && let Some(names) = a.iter::<Array<'_>>().next()
    {
        return (names.iter::<Object<'_>>().count() as u64).max(1);
    }
    4
}

/// The JPEG hayro-syntax decodes (its `dct::maybe_patch_jpeg_dimensions`):
/// none when the dictionary's size is over 65535 on a side or no frame
/// header is found; the data with the dictionary's size written into the
/// first frame header when that header's area is larger (a JPEG that says it
/// is larger than its dictionary is decoded at the dictionary's size).
fn dct_decoded(data: &[u8], w: u64, h: u64) -> Option<Cow<'_, [u8]>> {
    let (w, h) = (u16::try_from(w).ok()?, u16::try_from(h).ok()?);
    let at = hayro_sof_marker(data)?;
    let be = |k: usize| Some(u16::from_be_bytes([*data.get(k)?, *data.get(k + 1)?]));
    let (jpeg_h, jpeg_w) = (be(at + 5)?, be(at + 7)?);
    if u32::from(jpeg_w) * u32::from(jpeg_h) <= u32::from(w) * u32::from(h) {
        return Some(Cow::Borrowed(data));
    }
    let mut patched = data.to_vec();
    patched
        .get_mut(at + 5..at + 7)?
        .copy_from_slice(&h.to_be_bytes());
    patched
        .get_mut(at + 7..at + 9)?
        .copy_from_slice(&w.to_be_bytes());
    Some(Cow::Owned(patched))
}

/// Where hayro-syntax finds a JPEG's frame header (`dct::find_sof_marker`,
/// the same walk): the offset of its 0xFF.
fn hayro_sof_marker(data: &[u8]) -> Option<usize> {
    let mut i = 0usize;
    while i + 1 < data.len() {
        if data[i] != 0xFF {
            i += 1;
            continue;
        }
        match data[i + 1] {
            0xC0..=0xCF if !matches!(data[i + 1], 0xC4 | 0xC8 | 0xCC) => return Some(i),
            0xFF => i += 1,
            0xD8 | 0xD9 | 0x01 | 0x00 => i += 2,
            _ => {
                let len = u16::from_be_bytes([*data.get(i + 2)?, *data.get(i + 3)?]);
                i = i.checked_add(2)?.checked_add(usize::from(len))?;
            }
        }
    }
    None
}

/// Width, height and components from a JPEG's frame header (SOFn).
pub(crate) fn jpeg_size(data: &[u8]) -> Option<(u64, u64, u64)> {
    let mut i = data.windows(2).position(|w| w == [0xFF, 0xD8])? + 2;
    loop {
        while *data.get(i)? != 0xFF {
            i += 1;
        }
        while *data.get(i)? == 0xFF {
            i += 1;
        }
        let marker = *data.get(i)?;
        i += 1;
        if matches!(marker, 0x01 | 0xD0..=0xD7) {
            continue;
        }
        let len = usize::from(u16::from_be_bytes([*data.get(i)?, *data.get(i + 1)?]));
        if matches!(marker, 0xC0..=0xCF) && !matches!(marker, 0xC4 | 0xC8 | 0xCC) {
            let be = |k: usize| Some(u16::from_be_bytes([*data.get(k)?, *data.get(k + 1)?]));
            let h = be(i + 3)?;
            let w = be(i + 5)?;
            let c = *data.get(i + 7)?;
            return Some((u64::from(w), u64::from(h), u64::from(c)));
        }
        if marker == 0xDA || marker == 0xD9 {
            return None;
        }
        i += len;
    }
}

/// Width, height and components from a JPEG 2000 codestream's SIZ marker.
pub(crate) fn jpx_size(data: &[u8]) -> Option<(u64, u64, u64)> {
    let at = memchr::memmem::find(data, &[0xFF, 0x4F, 0xFF, 0x51])? + 4;
    let be32 = |k: usize| {
        Some(u32::from_be_bytes(
            data.get(at + k..at + k + 4)?.try_into().ok()?,
        ))
    };
    let w = be32(4)?;
    let h = be32(8)?;
    let c = u16::from_be_bytes(data.get(at + 36..at + 38)?.try_into().ok()?);
    Some((u64::from(w), u64::from(h), u64::from(c)))
}

/// A device that only looks for images (inside patterns, masks, glyphs).
struct Probe<'c, 'm, 's> {
    check: &'c mut ImageCheck,
    meter: &'m Meter<'s>,
}

impl<'a> Device<'a> for Probe<'_, '_, '_> {
    fn draw_path(&mut self, path: &BezPath, props: DrawProps<'a>, mode: &DrawMode) {
        self.check.path(path, &props, mode, None, self.meter);
    }

    fn push_clip_path(&mut self, clip: &ClipPath) {
        self.meter.charge(clip.path.elements().len() as u64);
    }

    fn push_transparency_group(&mut self, _o: f32, mask: Option<SoftMask<'a>>, _b: BlendMode) {
        self.check.group(mask.as_ref(), self.meter);
    }

    fn draw_glyph_run(&mut self, run: &GlyphRun<'_, 'a>, props: DrawProps<'a>, _mode: &DrawMode) {
        self.check.glyph_run(run, &props, Rect::ZERO, self.meter);
    }

    fn draw_image(&mut self, image: Image<'a, '_>, props: ImageDrawProps<'a>) {
        self.check.drawn_image(&image, &props, self.meter);
    }

    fn pop_clip(&mut self) {}

    fn pop_transparency_group(&mut self) {}
}

/// The most samples (grid points × outputs) a sampled (Type 0) function may
/// have: hayro reads them all into `f32`s when the function is used.
pub const MAX_FUNCTION_SAMPLES: u64 = 16 << 20;

/// Refuses a sampled function (`/FunctionType 0`) with more samples than
/// [`MAX_FUNCTION_SAMPLES`] whose data (`made` bytes decoded) holds them
/// all (hayro's `Type0::new` reads none when the data is short).
fn sampled_function_within(dict: &Dict<'_>, made: usize) -> Result<(), String> {
    if dict.get::<u8>(b"FunctionType") != Some(0) {
        return Ok(());
    }
    let Some(sizes) = dict.get::<Array<'_>>(b"Size") else {
        return Ok(());
    };
    let outputs = dict
        .get::<Array<'_>>(b"Range")
        .map_or(0, |r| r.iter::<f32>().count() / 2);
    let samples = sizes
        .iter::<u32>()
        .fold(outputs as u64, |n, s| n.saturating_mul(u64::from(s)));
    let bits = u64::from(dict.get::<u8>(b"BitsPerSample").unwrap_or(1).max(1));
    let held = (made as u64).saturating_mul(8) / bits;
    if samples > MAX_FUNCTION_SAMPLES && held >= samples {
        return Err(format!(
            "a sampled function of {samples} samples is too large"
        ));
    }
    Ok(())
}

/// Runs every stream of the file through its non-image filters, bounded
/// (`max` bytes made over the file); records what each content-like stream
/// decodes to, by object.
pub(crate) fn streams_within<'o>(
    objects: impl IntoIterator<Item = Object<'o>>,
    max: usize,
) -> Result<HashMap<ObjectIdentifier, usize>, String> {
    let mut total = 0usize;
    let mut sizes = HashMap::new();
    for obj in objects {
        let Object::Stream(s) = obj else { continue };
        let raw = s.raw_data();
        let (made, codec) = match unfilter(&raw, &filters(&s), max.saturating_sub(total), false) {
            Ok((_, made, codec)) => (made, codec),
            // A filter after a codec: its image is refused where it is drawn.
            Err(why) if why != TOO_LARGE => (raw.len(), Some(Filter::Other)),
            Err(why) => return Err(why),
        };
        if codec.is_none() {
            sampled_function_within(s.dict(), made)?;
            sizes.insert(s.obj_id(), made);
        }
        total = total.saturating_add(made);
    }
    Ok(sizes)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn ascii_filters_decode_into_the_capped_output() {
        let run = |f: Filter, data: &[u8], cap: usize| {
            unfilter(data, &[f], cap, true).map(|(bytes, n, _)| (bytes.into_owned(), n))
        };
        let hello = b"Hello".to_vec();
        assert_eq!(
            run(Filter::AsciiHexDecode, b"48 65\n6c6C6f>", 64).unwrap(),
            (hello.clone(), 5)
        );
        // An odd last digit is followed by a 0.
        assert_eq!(run(Filter::AsciiHexDecode, b"4", 64).unwrap().0, [0x40]);
        assert_eq!(
            run(Filter::Ascii85Decode, b"87cURDZ~>", 64).unwrap().0,
            hello
        );
        assert_eq!(run(Filter::Ascii85Decode, b"zz~>", 64).unwrap().0, [0; 8]);
        // Over the cap, however long the input: refused.
        let zeros = vec![b'0'; 1 << 20];
        assert!(run(Filter::AsciiHexDecode, &zeros, 1000).is_err());
        assert_eq!(
            run(Filter::AsciiHexDecode, &zeros, 1 << 19).unwrap().1,
            1 << 19
        );
        let zs = vec![b'z'; 1 << 20];
        assert!(run(Filter::Ascii85Decode, &zs, 1000).is_err());
        // What is kept grows to the cap, not past it.
        let mut out = Out::new(100_000, true);
        for _ in 0..100 {
            out.push(&[7; 1000]).ok().unwrap();
        }
        assert!(out.push(&[7]).is_err());
        assert!(out.bytes.capacity() <= 100_000, "{}", out.bytes.capacity());
    }

    #[test]
    fn a_jpeg_is_sized_as_hayro_patches_it() {
        let jpeg = |w: u16, h: u16| {
            let mut j = vec![0xFF, 0xD8, 0xFF, 0xC0, 0x00, 0x11, 0x08];
            j.extend_from_slice(&h.to_be_bytes());
            j.extend_from_slice(&w.to_be_bytes());
            j.extend_from_slice(&[3, 1, 0x11, 0, 2, 0x11, 1, 3, 0x11, 1, 0xFF, 0xD9]);
            j
        };
        let size = |data: &[u8], w, h| dct_decoded(data, w, h).and_then(|d| jpeg_size(&d));
        assert_eq!(size(&jpeg(60000, 60000), 10, 20), Some((10, 20, 3)));
        assert_eq!(size(&jpeg(30, 40), 100, 100), Some((30, 40, 3)));
        // Larger in area only: patched.
        assert_eq!(size(&jpeg(200, 1), 10, 10), Some((10, 10, 3)));
        // A dictionary over 65535 a side: hayro does not decode it.
        assert!(dct_decoded(&jpeg(10, 10), 70000, 1).is_none());
    }
}
