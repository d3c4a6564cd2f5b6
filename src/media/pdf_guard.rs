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
use hayro::hayro_interpret::kurbo::BezPath;
use hayro::hayro_interpret::pattern::Pattern;
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

fn ascii_hex(data: &[u8], out: &mut Out) -> Result<(), Over> {
    let digits = data
        .iter()
        .take_while(|&&b| b != b'>')
        .filter_map(|&b| (b as char).to_digit(16))
        .collect::<Vec<_>>();
    let bytes: Vec<u8> = digits
        .chunks(2)
        .map(|p| (p[0] << 4 | p.get(1).copied().unwrap_or(0)) as u8)
        .collect();
    out.push(&bytes)
}

fn ascii85(data: &[u8], out: &mut Out) -> Result<(), Over> {
    let mut bytes = Vec::with_capacity(data.len());
    let mut group = [0u32; 5];
    let mut n = 0;
    for &b in data {
        match b {
            b'~' => break,
            b'z' if n == 0 => bytes.extend_from_slice(&[0; 4]),
            b'!'..=b'u' => {
                group[n] = u32::from(b - b'!');
                n += 1;
                if n == 5 {
                    let v = group
                        .iter()
                        .fold(0u32, |a, &d| a.wrapping_mul(85).wrapping_add(d));
                    bytes.extend_from_slice(&v.to_be_bytes());
                    n = 0;
                }
            }
            _ => {}
        }
    }
    if n > 1 {
        for d in group.iter_mut().skip(n) {
            *d = 84;
        }
        let v = group
            .iter()
            .fold(0u32, |a, &d| a.wrapping_mul(85).wrapping_add(d));
        bytes.extend_from_slice(&v.to_be_bytes()[..n - 1]);
    }
    out.push(&bytes)
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

    /// Looks inside what only the renderer interprets: a tiling pattern.
    pub(crate) fn paint<'a>(
        &mut self,
        paint: &Paint<'a>,
        props_transform: DrawTransform,
        meter: &Meter<'_>,
    ) {
        if self.refused.is_some() {
            return;
        }
        if let Paint::Pattern(p) = paint
            && let Pattern::Tiling(t) = &**p
            && self.seen.insert(t.cache_key())
        {
            let mut probe = Probe { check: self, meter };
            let _ = t.interpret(&mut probe, props_transform.0, false);
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

/// A transform handed to [`ImageCheck::paint`].
#[derive(Clone, Copy)]
pub(crate) struct DrawTransform(pub(crate) hayro::hayro_interpret::kurbo::Affine);

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
        Some(Filter::DctDecode) => {
            jpeg_size(&data).ok_or("a JPEG image whose size cannot be read")?
        }
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
    fn draw_path(&mut self, path: &BezPath, props: DrawProps<'a>, _mode: &DrawMode) {
        self.meter.charge(path.elements().len() as u64);
        self.check
            .paint(&props.paint, DrawTransform(props.transform), self.meter);
        self.check.mask(props.soft_mask.as_ref(), self.meter);
    }

    fn push_clip_path(&mut self, clip: &ClipPath) {
        self.meter.charge(clip.path.elements().len() as u64);
    }

    fn push_transparency_group(&mut self, _o: f32, mask: Option<SoftMask<'a>>, _b: BlendMode) {
        self.meter.charge(0);
        self.check.mask(mask.as_ref(), self.meter);
    }

    fn draw_glyph_run(&mut self, run: &GlyphRun<'_, 'a>, props: DrawProps<'a>, _mode: &DrawMode) {
        self.meter.charge(run.glyphs().len() as u64);
        self.check.glyphs(run, &props, self.meter);
        self.check
            .paint(&props.paint, DrawTransform(props.transform), self.meter);
    }

    fn draw_image(&mut self, image: Image<'a, '_>, props: ImageDrawProps<'a>) {
        self.check.image(&image, self.meter);
        self.check.mask(props.soft_mask.as_ref(), self.meter);
    }

    fn pop_clip(&mut self) {}

    fn pop_transparency_group(&mut self) {}
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
            sizes.insert(s.obj_id(), made);
        }
        total = total.saturating_add(made);
    }
    Ok(sizes)
}
