//! Fuzzes the transform walk, `visor::transform::rewrite`, over any bytes
//! that pass visor's JSON probe (as the proxy only transforms those),
//! seeded with `tests/fixtures/*.json`, in all three API shapes.
//!
//! The raw bytes (odd whitespace, escapes, duplicate keys, bytes that are
//! not UTF-8) go through every plan of `common/transform_checks.rs`: no
//! panic, the same rewrite twice, and a rewrite that is valid JSON when
//! the input was. When serde_json reads the input as an object, its compact
//! form (one value per key) is checked against every invariant there, but
//! "no image left" (an arbitrary body holds images where no API puts them).
//! The rules (ageing, caps, hard limit, copies, prompt cache, line dedup)
//! are chosen from a hash of the input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use visor::proxy::request_body::probe;
use visor::transform::dedup::Blocks;
use visor::transform::{Rules, Shape, rewrite};

#[path = "../common/transform_checks.rs"]
mod transform_checks;
use transform_checks::{check, checks};

fn rules(data: &[u8]) -> Rules {
    // FNV-1a: the same input, the same rules.
    let h = data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let pick = |shift: u32, n: u64| ((h >> shift) % n) as usize;
    let hard = (pick(0, 3) > 0).then(|| pick(2, 5) + 1);
    let max_images = pick(5, 6) + 1;
    Rules {
        keep_turns: pick(8, 4),
        max_images: hard.map_or(max_images, |h| max_images.min(h)),
        hard_max_images: hard,
        dedupe: pick(11, 2) == 0,
        prompt_cache: pick(12, 2) == 0,
        dedup: (pick(13, 6) > 0).then(|| Blocks {
            min_lines: 2 + pick(16, 2),
            min_bytes: [0, 16, 64][pick(18, 3)],
        }),
    }
}

fuzz_target!(|data: &[u8]| {
    if probe(data).is_err() {
        return;
    }
    let rules = rules(data);
    let value: Option<Value> = serde_json::from_slice(data).ok();
    for shape in [Shape::Chat, Shape::Responses, Shape::Messages] {
        for c in checks(shape, rules) {
            let out = rewrite(data, &c.plan);
            assert_eq!(out.body, rewrite(data, &c.plan).body, "not deterministic");
            if let Some(body) = &out.body {
                assert!(
                    value.is_none() || serde_json::from_slice::<Value>(body).is_ok(),
                    "rewrite produced invalid JSON"
                );
            }
        }
    }
    let Some(value) = value.filter(Value::is_object) else {
        return;
    };
    let Ok(compact) = serde_json::to_vec(&value) else {
        return;
    };
    for shape in [Shape::Chat, Shape::Responses, Shape::Messages] {
        for mut c in checks(shape, rules) {
            c.no_images = false;
            check(&compact, &value, shape, &c);
        }
    }
});
