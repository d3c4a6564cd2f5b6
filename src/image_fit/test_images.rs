//! Test images, and the codec's behaviour as visor relies on it.

use image::ImageEncoder;
use image::codecs::png::PngEncoder;

/// A PNG of `w`×`h` with a pattern and some detail (not one colour,
/// which any encoder shrinks to nothing).
pub(crate) fn test_png(w: u32, h: u32, alpha: bool) -> Vec<u8> {
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

mod tests {
    use super::test_png as png;
    use crate::image_fit::{Unfit, base64_len, fit};

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
        assert_eq!(
            fit(&b, Some((10, 10)), None),
            Err(Unfit::TooLarge(100_000, 100_000))
        );
    }

    #[test]
    fn what_is_not_an_image_is_left() {
        assert_eq!(fit(b"%PDF-1.7", None, None), Err(Unfit::Format));
        let mut broken = png(50, 50, false);
        broken.truncate(60);
        assert!(matches!(fit(&broken, None, None), Err(Unfit::Broken(_))));
    }

    /// The PNG chunk checksum (zlib's CRC-32).
    fn crc32(data: &[u8]) -> u32 {
        let mut crc = flate2::Crc::new();
        crc.update(data);
        crc.sum()
    }
}
