//! visor's image fitting: one image decoded (bounded), scaled and encoded
//! again. PNG, GIF and WebP come out as PNG, JPEG as JPEG; when that is
//! still over the byte bound, as JPEG, then smaller, until it fits.
//! Deterministic: the same bytes and settings give the same output, so
//! each turn of a conversation sends the same image.
//!
//! A crate of its own so that it is optimised in test builds too (the
//! scaler's generic code is compiled where it is used): visor's tests fit
//! real multi-megapixel images.

use std::io::Cursor;

use bytes::Bytes;
use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use image::codecs::jpeg::JpegEncoder;
use image::codecs::png::{CompressionType, FilterType as PngFilter, PngEncoder};
use image::{DynamicImage, ImageDecoder, ImageEncoder, ImageFormat, ImageReader};

/// The most pixels visor decodes (a 9000×6000 photo is 54 MP); larger
/// images are left as they came.
pub const DECODE_MAX_PIXELS: u64 = 80_000_000;
/// The most memory a decoder may take.
pub const DECODE_MAX_ALLOC: u64 = 512 * 1024 * 1024;
/// JPEG quality of a re-encoded image.
const JPEG_QUALITY: u8 = 85;
/// Attempts at a smaller size when an encoding is over the byte bound.
const SHRINK_TRIES: usize = 8;
const SHRINK_STEP: f64 = 0.75;

/// An image as it is sent after fitting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fitted {
    pub media_type: &'static str,
    pub bytes: Bytes,
    pub width: u32,
    pub height: u32,
}

/// Why an image was left as it came.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unfit {
    #[error("not an image visor decodes (PNG, JPEG, GIF, WebP)")]
    Format,
    #[error("{0}×{1} is over the decoder's bound of {DECODE_MAX_PIXELS} pixels")]
    TooLarge(u32, u32),
    #[error("cannot be decoded: {0}")]
    Broken(String),
    #[error("still over {0} bytes at 1×1")]
    CannotFit(u64),
}

/// `bytes` (an image) as it is to be sent: at `size` (its own to only
/// encode again) and, with `max_base64`, no longer than that once base64
/// encoded.
pub fn fit(
    bytes: &[u8],
    size: Option<(u32, u32)>,
    max_base64: Option<u64>,
) -> Result<Fitted, Unfit> {
    let format = image::guess_format(bytes).map_err(|_| Unfit::Format)?;
    if !matches!(
        format,
        ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::Gif | ImageFormat::WebP
    ) {
        return Err(Unfit::Format);
    }
    let src = pixels(decode(bytes, format)?);
    let (mut w, mut h) = size.unwrap_or((src.width, src.height));
    let as_jpeg = format == ImageFormat::Jpeg;
    let mut out = encode(&*resize(&src, w, h)?, as_jpeg)?;
    let Some(max) = max_base64 else {
        return Ok(out);
    };
    if base64_len(out.bytes.len()) > max && !as_jpeg {
        out = encode(&*resize(&src, w, h)?, true)?;
    }
    for _ in 0..SHRINK_TRIES {
        if base64_len(out.bytes.len()) <= max {
            return Ok(out);
        }
        let s = |v: u32| ((f64::from(v) * SHRINK_STEP) as u32).max(1);
        (w, h) = (s(w), s(h));
        out = encode(&*resize(&src, w, h)?, true)?;
    }
    match base64_len(out.bytes.len()) <= max {
        true => Ok(out),
        false => Err(Unfit::CannotFit(max)),
    }
}

/// The length of `n` bytes in base64 (padded).
pub fn base64_len(n: usize) -> u64 {
    (n as u64).div_ceil(3) * 4
}

/// Decodes within [`DECODE_MAX_PIXELS`] and [`DECODE_MAX_ALLOC`]: the
/// size is read from the header first, so a bomb is refused before any
/// pixel is allocated.
pub fn decode(bytes: &[u8], format: ImageFormat) -> Result<DynamicImage, Unfit> {
    let reader = || {
        let mut r = ImageReader::with_format(Cursor::new(bytes), format);
        let mut limits = image::Limits::default();
        limits.max_alloc = Some(DECODE_MAX_ALLOC);
        r.limits(limits);
        r
    };
    let (w, h) = match imagesize::blob_size(bytes) {
        Ok(s) => (s.width as u64, s.height as u64),
        Err(_) => {
            let (w, h) = reader()
                .into_dimensions()
                .map_err(|e| Unfit::Broken(e.to_string()))?;
            (u64::from(w), u64::from(h))
        }
    };
    if w.saturating_mul(h) > DECODE_MAX_PIXELS {
        let side = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
        return Err(Unfit::TooLarge(side(w), side(h)));
    }
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(u32::try_from(w).unwrap_or(u32::MAX));
    limits.max_image_height = Some(u32::try_from(h).unwrap_or(u32::MAX));
    limits.max_alloc = Some(DECODE_MAX_ALLOC);
    let mut r = reader();
    r.limits(limits);
    let broken = |e: image::ImageError| Unfit::Broken(e.to_string());
    let mut decoder = r.into_decoder().map_err(broken)?;
    // A photo's EXIF orientation is applied: the pixels sent are the
    // picture as it is seen (the tag does not survive re-encoding).
    let orientation = decoder
        .orientation()
        .unwrap_or(image::metadata::Orientation::NoTransforms);
    let mut img = DynamicImage::from_decoder(decoder).map_err(broken)?;
    img.apply_orientation(orientation);
    Ok(img)
}

/// Pixels to encode: 8-bit RGB or RGBA.
#[derive(Debug, Clone)]
pub struct Pixels {
    pub width: u32,
    pub height: u32,
    pub alpha: bool,
    pub data: Vec<u8>,
}

/// `img`'s pixels, 8-bit RGB or RGBA (moved, not copied, when it
/// decoded as that already).
pub fn pixels(img: DynamicImage) -> Pixels {
    let alpha = img.color().has_alpha();
    let (width, height) = (img.width(), img.height());
    let data = match alpha {
        true => img.into_rgba8().into_raw(),
        false => img.into_rgb8().into_raw(),
    };
    Pixels {
        width,
        height,
        alpha,
        data,
    }
}

/// `p` at `w`×`h` (Catmull-Rom: sharp text at a third of Lanczos' cost;
/// alpha weighted). Borrowed as it is when the size is its own.
pub fn resize(p: &Pixels, w: u32, h: u32) -> Result<std::borrow::Cow<'_, Pixels>, Unfit> {
    if (w, h) == (p.width, p.height) {
        return Ok(std::borrow::Cow::Borrowed(p));
    }
    let pixel = match p.alpha {
        true => PixelType::U8x4,
        false => PixelType::U8x3,
    };
    let broken = |e: &dyn std::fmt::Display| Unfit::Broken(e.to_string());
    let src = ImageRef::new(p.width, p.height, &p.data, pixel).map_err(|e| broken(&e))?;
    let mut dst = Image::new(w.max(1), h.max(1), pixel);
    let opts = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::CatmullRom));
    Resizer::new()
        .resize(&src, &mut dst, &opts)
        .map_err(|e| broken(&e))?;
    Ok(std::borrow::Cow::Owned(Pixels {
        width: dst.width(),
        height: dst.height(),
        alpha: p.alpha,
        data: dst.into_vec(),
    }))
}

/// PNG (fast deflate, adaptive filters), or JPEG (alpha over white).
pub fn encode(p: &Pixels, jpeg: bool) -> Result<Fitted, Unfit> {
    let mut out = Vec::new();
    let broken = |e: image::ImageError| Unfit::Broken(e.to_string());
    let media_type = match jpeg {
        true => {
            let rgb;
            let data = match p.alpha {
                true => {
                    rgb = over_white(&p.data);
                    &rgb
                }
                false => &p.data,
            };
            JpegEncoder::new_with_quality(&mut out, JPEG_QUALITY)
                .write_image(data, p.width, p.height, image::ExtendedColorType::Rgb8)
                .map_err(broken)?;
            "image/jpeg"
        }
        false => {
            let color = match p.alpha {
                true => image::ExtendedColorType::Rgba8,
                false => image::ExtendedColorType::Rgb8,
            };
            PngEncoder::new_with_quality(&mut out, CompressionType::Fast, PngFilter::Adaptive)
                .write_image(&p.data, p.width, p.height, color)
                .map_err(broken)?;
            "image/png"
        }
    };
    Ok(Fitted {
        media_type,
        bytes: Bytes::from(out),
        width: p.width,
        height: p.height,
    })
}

/// RGBA pixels composed over white, as RGB.
fn over_white(rgba: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(rgba.len() / 4 * 3);
    for px in rgba.chunks_exact(4) {
        let a = u16::from(px[3]);
        for &c in &px[..3] {
            out.push(((u16::from(c) * a + 255 * (255 - a) + 127) / 255) as u8);
        }
    }
    out
}
