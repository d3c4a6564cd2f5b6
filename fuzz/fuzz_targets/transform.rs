//! Fuzzes the transform entry point: any bytes that pass visor's JSON
//! validation, in each API shape, must give a rewrite that is valid JSON, is
//! idempotent, and never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use visor::proxy::probe::probe;
use visor::transform::{Plan, Shape, rewrite};

fuzz_target!(|data: &[u8]| {
    if probe(data).is_err() {
        return;
    }
    for shape in [Shape::Chat, Shape::Responses, Shape::Messages] {
        let plan = Plan {
            shape,
            vision: false,
            describe: false,
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
