//! Fuzzes the reader of the Responses WebSocket mode's client events
//! (`read_event` of `src/proxy/websocket.rs`, copied by `fuzz/build.rs`):
//! any text. Every event is read by the rules an HTTP body is, so:
//!
//! - what it accepts is one JSON object serde reads as the same object,
//!   each top-level key once in any letter case (counted by a reader of
//!   this target's own, since serde's map keeps the last of a duplicate),
//!   `model`, if any, a string of at most `MAX_MODEL` bytes;
//! - the HTTP path's reader (`request_body::probe`) accepts it too, with
//!   the same model: nothing the socket sends on is refused over HTTP;
//! - what it refuses is a 400 `invalid_json`, and never a panic.
#![no_main]

use std::fmt;

use libfuzzer_sys::fuzz_target;
use serde::de::{Deserializer as _, IgnoredAny, MapAccess, Visitor};

mod ws {
    #![allow(dead_code)]
    use serde_json::Value;
    use visor::error::VisorError;

    include!(concat!(env!("OUT_DIR"), "/ws_event.rs"));
}

/// The top-level keys of a JSON object, every one as written (duplicates
/// kept).
fn top_level_keys(text: &str) -> Option<Vec<String>> {
    struct Keys;
    impl<'de> Visitor<'de> for Keys {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Vec<String>, A::Error> {
            let mut keys = Vec::new();
            while let Some(k) = map.next_key::<String>()? {
                map.next_value::<IgnoredAny>()?;
                keys.push(k);
            }
            Ok(keys)
        }
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let keys = (&mut de).deserialize_map(Keys).ok()?;
    de.end().ok()?;
    Some(keys)
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match ws::read_event(text) {
        Ok(event) => {
            let v: serde_json::Value =
                serde_json::from_str(text).expect("accepted, but serde does not read it");
            assert_eq!(v, serde_json::Value::Object(event.clone()));
            let keys = top_level_keys(text).expect("accepted, but its keys cannot be read");
            let mut lower: Vec<String> = keys.iter().map(|k| k.to_lowercase()).collect();
            lower.sort();
            let n = lower.len();
            lower.dedup();
            assert_eq!(n, lower.len(), "accepted with a key twice: {keys:?}");
            let model = event.get("model").map(|m| {
                let m = m.as_str().expect("accepted a model that is not a string");
                assert!(m.len() <= ws::MAX_MODEL);
                m.to_owned()
            });
            let http = visor::proxy::request_body::probe(text.as_bytes())
                .unwrap_or_else(|e| panic!("the socket accepts what HTTP refuses: {e}"));
            assert_eq!(http.model, model, "HTTP reads another model");
        }
        Err(e) => {
            assert_eq!(e.status().as_u16(), 400);
            assert_eq!(e.label(), "invalid_json");
        }
    }
});
