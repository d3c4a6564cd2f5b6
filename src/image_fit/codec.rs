//! One image decoded (bounded), scaled and encoded again: PNG, GIF and
//! WebP come out as PNG, JPEG as JPEG; when that is still over the byte
//! bound, as JPEG, then smaller, until it fits. Deterministic: the same
//! bytes and settings give the same output, so each turn of a
//! conversation sends the same image.

use std::io::Cursor;

use bytes::Bytes;
use fast_image_resize::images::Image;
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use image::codecs::jpeg::JpegEncoder;
use image::codecs::png::{CompressionType, FilterType as PngFilter, PngEncoder};
use image::{DynamicImage, ImageEncoder, ImageFormat, ImageReader};

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
pub fn fit(bytes: &[u8], size: Option<(u32, u32)>, max_base64: Option<u64>) -> Result<Fitted, Unfit> {
    let format = image::guess_format(bytes).map_err(|_| Unfit::Format)?;
    if !matches!(
        format,
        ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::Gif | ImageFormat::WebP
    ) {
        return Err(Unfit::Format);
    }
    let img = decode(bytes, format)?;
    let (w, h) = size.unwrap_or((img.width(), img.height()));
    let as_jpeg = format == ImageFormat::Jpeg;
    let mut out = encode(&scale(&img, w, h)?, as_jpeg)?;
    let Some(max) = max_base64 else {
        return Ok(out);
    };
    if base64_len(out.bytes.len()) > max && !as_jpeg {
        out = encode(&scale(&img, w, h)?, true)?;
    }
    let (mut w, mut h) = (w, h);
    for _ in 0..SHRINK_TRIES {
        if base64_len(out.bytes.len()) <= max {
            return Ok(out);
        }
        let s = |v: u32| ((f64::from(v) * SHRINK_STEP) as u32).max(1);
        (w, h) = (s(w), s(h));
        out = encode(&scale(&img, w, h)?, true)?;
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
fn decode(bytes: &[u8], format: ImageFormat) -> Result<DynamicImage, Unfit> {
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
    r.decode().map_err(|e| Unfit::Broken(e.to_string()))
}

/// Pixels to encode: 8-bit RGB or RGBA.
struct Pixels {
    width: u32,
    height: u32,
    alpha: bool,
    data: Vec<u8>,
}

/// `img` at `w`×`h` (Lanczos3; alpha weighted), 8-bit RGB or RGBA.
fn scale(img: &DynamicImage, w: u32, h: u32) -> Result<Pixels, Unfit> {
    let alpha = img.color().has_alpha();
    let (data, pixel) = match alpha {
        true => (img.to_rgba8().into_raw(), PixelType::U8x4),
        false => (img.to_rgb8().into_raw(), PixelType::U8x3),
    };
    let (sw, sh) = (img.width(), img.height());
    if (w, h) == (sw, sh) {
        return Ok(Pixels {
            width: w,
            height: h,
            alpha,
            data,
        });
    }
    let broken = |e: &dyn std::fmt::Display| Unfit::Broken(e.to_string());
    let src = Image::from_vec_u8(sw, sh, data, pixel).map_err(|e| broken(&e))?;
    let mut dst = Image::new(w.max(1), h.max(1), pixel);
    let opts = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Lanczos3));
    Resizer::new()
        .resize(&src, &mut dst, &opts)
        .map_err(|e| broken(&e))?;
    Ok(Pixels {
        width: dst.width(),
        height: dst.height(),
        alpha,
        data: dst.into_vec(),
    })
}

/// PNG (fast deflate, adaptive filters), or JPEG (alpha over white).
fn encode(p: &Pixels, jpeg: bool) -> Result<Fitted, Unfit> {
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

/// A PNG of `w`×`h` with a pattern and some detail (not one colour,
/// which any encoder shrinks to nothing), for tests.
#[cfg(test)]
pub(crate) fn test_png(w: u32, h: u32, alpha: bool) -> Vec<u8> {
    tests::png(w, h, alpha)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn png(w: u32, h: u32, alpha: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let px = |x: u32, y: u32| {
            let v = (x.wrapping_mul(7) ^ y.wrapping_mul(13)) as u8;
            [v, (x % 256) as u8, (y % 256) as u8, 200]
        };
        let mut data = Vec::new();
        for y in 0..h {
            for x in 0..w {
                let p = px(x, y);
                data.extend_from_slice(if alpha { &p[..] } else { &p[..3] });
            }
        }
        let color = match alpha {
            true => image::ExtendedColorType::Rgba8,
            false => image::ExtendedColorType::Rgb8,
        };
        PngEncoder::new(&mut out)
            .write_image(&data, w, h, color)
            .unwrap();
        out
    }

    #[test]
    fn scales_to_the_size_asked_and_stays_png() {
        let src = png(300, 200, false);
        let f = fit(&src, Some((150, 100)), None).unwrap();
        assert_eq!((f.width, f.height, f.media_type), (150, 100, "image/png"));
        let back = image::load_from_memory(&f.bytes).unwrap();
        assert_eq!((back.width(), back.height()), (150, 100));
    }

    #[test]
    fn the_same_input_gives_the_same_bytes() {
        let src = png(257, 131, true);
        let a = fit(&src, Some((100, 51)), Some(20_000)).unwrap();
        let b = fit(&src, Some((100, 51)), Some(20_000)).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn over_the_byte_bound_it_becomes_jpeg_then_smaller() {
        let src = png(400, 400, true);
        let max = 6_000;
        let f = fit(&src, None, Some(max)).unwrap();
        assert!(base64_len(f.bytes.len()) <= max);
        assert_eq!(f.media_type, "image/jpeg");
        assert!(f.width < 400, "had to shrink too: {}", f.width);
        assert_eq!(f.width, f.height, "aspect kept");
    }

    #[test]
    fn a_bomb_is_refused_before_it_is_decoded() {
        // A valid PNG header claiming 100000×100000 pixels, and no data.
        let mut b = Vec::new();
        b.extend_from_slice(b"\x89PNG\r\n\x1a\n");
        let mut ihdr = Vec::new();
        ihdr.extend_from_slice(&100_000u32.to_be_bytes());
        ihdr.extend_from_slice(&100_000u32.to_be_bytes());
        ihdr.extend_from_slice(&[8, 6, 0, 0, 0]);
        b.extend_from_slice(&(ihdr.len() as u32).to_be_bytes());
        let mut chunk = b"IHDR".to_vec();
        chunk.extend_from_slice(&ihdr);
        b.extend_from_slice(&chunk);
        b.extend_from_slice(&crc32(&chunk).to_be_bytes());
        assert_eq!(fit(&b, Some((10, 10)), None), Err(Unfit::TooLarge(100_000, 100_000)));
    }

    #[test]
    fn what_is_not_an_image_is_left() {
        assert_eq!(fit(b"%PDF-1.7", None, None), Err(Unfit::Format));
        let mut broken = png(50, 50, false);
        broken.truncate(60);
        assert!(matches!(fit(&broken, None, None), Err(Unfit::Broken(_))));
    }

    fn crc32(data: &[u8]) -> u32 {
        let mut crc = 0xffff_ffffu32;
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 == 1 { (crc >> 1) ^ 0xedb8_8320 } else { crc >> 1 };
            }
        }
        !crc
    }
}
