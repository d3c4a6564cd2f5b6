//! Fuzzes the transform entry point: any bytes that pass visor's JSON
//! validation, in each API shape, for a model that can see and one that
//! cannot, with every image rule and line dedup on, must give a rewrite that
//! is valid JSON, is idempotent, and never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use visor::proxy::request_body::probe;
use visor::transform::{Plan, Rules, Shape, Takes, rewrite};

fuzz_target!(|data: &[u8]| {
    if probe(data).is_err() {
        return;
    }
    // The SPEC's defaults, with a small cap and line threshold so short
    // inputs reach every rule.
    let rules = Rules {
        keep_turns: 1,
        max_images: 2,
        dedupe: true,
        prompt_cache: true,
        hard_max_images: None,
        dedup: Some(visor::transform::dedup::Blocks {
            min_lines: 2,
            min_bytes: 16,
        }),
    };
    for (shape, vision) in [
        (Shape::Chat, false),
        (Shape::Chat, true),
        (Shape::Responses, false),
        (Shape::Responses, true),
        (Shape::Messages, false),
        (Shape::Messages, true),
    ] {
        let plan = Plan {
            shape,
            vision,
            describe: false,
            rules,
            takes: Takes::ALL,
            query_aware: false,
        };
        let out = rewrite(data, &plan);
        if let Some(body) = &out.body {
            assert!(
                serde_json::from_slice::<serde_json::Value>(body).is_ok()
                    || serde_json::from_slice::<serde_json::Value>(data).is_err(),
                "rewrite produced invalid JSON"
            );
            assert!(rewrite(body, &plan).body.is_none(), "not idempotent");
        }
    }
});
