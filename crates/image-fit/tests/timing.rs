//! Where a fit's time goes (run by hand: `cargo test --release -p
//! visor-image-fit --test timing -- --ignored --nocapture`).
#![allow(clippy::unwrap_used)]

use image::ImageEncoder;

fn screenshot() -> Vec<u8> {
    let (w, h) = (2880u32, 1800u32);
    let mut data = Vec::with_capacity((w * h * 3) as usize);
    let mut x: u32 = 0x2545_f491;
    for y in 0..h {
        for i in 0..w {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let text_row = (y / 18) % 3 == 1 && (i / 9) % 7 != 0;
            let frame = i % 960 < 4 || y % 600 < 4;
            let px = if frame {
                [40, 40, 48]
            } else if text_row && x.is_multiple_of(3) {
                [20, 20, 20]
            } else {
                [(230 - y / 30) as u8, (235 - i / 60) as u8, 245]
            };
            data.extend_from_slice(&px);
        }
    }
    let mut out = Vec::new();
    image::codecs::png::PngEncoder::new(&mut out)
        .write_image(&data, w, h, image::ExtendedColorType::Rgb8)
        .unwrap();
    out
}

#[test]
#[ignore]
fn where_the_time_goes() {
    let png = screenshot();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let img = visor_image_fit::decode(&png, image::ImageFormat::Png).unwrap();
        let d = t.elapsed();
        let t = std::time::Instant::now();
        let p = visor_image_fit::pixels(img);
        let px = t.elapsed();
        let t = std::time::Instant::now();
        let r = visor_image_fit::resize(&p, 1385, 865).unwrap();
        let rs = t.elapsed();
        let t = std::time::Instant::now();
        let out = visor_image_fit::encode(&r, false).unwrap();
        let e = t.elapsed();
        eprintln!(
            "decode {d:?} pixels {px:?} resize {rs:?} encode {e:?} ({} bytes)",
            out.bytes.len()
        );
    }
}

/// The memory one large fit takes (run by hand under `/usr/bin/time -v`:
/// its maximum resident set size).
#[test]
#[ignore]
fn memory_of_a_9000x6000_fit() {
    let (w, h) = (9000u32, 6000u32);
    let mut data = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for i in 0..w {
            data.extend_from_slice(&[(i / 64) as u8, (y / 64) as u8, 128]);
        }
    }
    let mut png = Vec::new();
    image::codecs::png::PngEncoder::new(&mut png)
        .write_image(&data, w, h, image::ExtendedColorType::Rgb8)
        .unwrap();
    drop(data);
    let out = visor_image_fit::fit(&png, Some((8000, 5333)), Some(5_242_880)).unwrap();
    eprintln!("{}x{} {} bytes", out.width, out.height, out.bytes.len());
}
