//! Fuzzes the config loader, `visor::config::Config::from_toml`, over any
//! text (seeded with `config/visor.toml`), with a fixed environment for
//! `${VAR}`.
//!
//! Invariants:
//! - no panic, and an accepted config the same twice;
//! - an error names the file (`PATH: ...`), and an invalid config names at
//!   least one problem;
//! - an accepted config holds what `validate` promises: at least one
//!   upstream, each with an http(s) base URL that has a host and no query,
//!   non-zero limits, `default_depth <= max_depth`, `min_run_lines >= 2`, a
//!   known store backend, a describer upstream that exists; and what is
//!   built from it at start does not fail: the model table from its
//!   `[[model]]` rows, the transform rules, the upstream globs.
//!
//! Inputs naming `ca_file` are skipped: that key reads a file (a device
//! such as /dev/stdin would hang the fuzzer, not visor's parser).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use visor::config::{Config, ConfigError, StoreBackend};
use visor::models::{Learned, ModelTable};
use visor::transform::Rules;

fn env(name: &str) -> Option<String> {
    match name {
        "OPENAI_API_KEY" => Some("sk-test".to_owned()),
        "VISOR_API_KEY" => Some("proxy-key".to_owned()),
        "EMPTY" => Some(String::new()),
        "URL" => Some("https://example.com/v1".to_owned()),
        // Not expanded again.
        "NESTED" => Some("${OPENAI_API_KEY}".to_owned()),
        _ => None,
    }
}

fn answer(r: &Result<Config, ConfigError>) -> String {
    match r {
        Ok(c) => format!("{c:?}"),
        Err(e) => e.to_string(),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if text.contains("ca_file") {
        return;
    }
    let path = Path::new("fuzz.toml");
    let first = Config::from_toml(text, path, &env);
    if first.is_ok() {
        let second = Config::from_toml(text, path, &env);
        assert_eq!(answer(&first), answer(&second), "not deterministic");
    }
    let cfg = match first {
        Ok(cfg) => cfg,
        Err(e) => {
            assert!(e.to_string().starts_with("fuzz.toml: "), "{e}");
            if let ConfigError::Invalid { problems, .. } = &e {
                assert!(!problems.is_empty());
            }
            return;
        }
    };
    assert!(!cfg.upstreams.is_empty());
    for u in &cfg.upstreams {
        assert!(matches!(u.base_url.scheme_str(), Some("http" | "https")));
        assert!(u.base_url.authority().is_some() && u.base_url.query().is_none());
        assert!(!u.models.is_empty());
        let _ = u.matches("gpt-4o-mini");
        let _ = u.matches_all();
    }
    assert!(cfg.server.max_body_bytes >= 1 && cfg.server.max_connections >= 1);
    assert!(cfg.server.workers <= 1024);
    assert!(cfg.sessions.max_depth >= 1 && cfg.sessions.default_depth <= cfg.sessions.max_depth);
    assert!(cfg.dedup.min_run_lines >= 2 && cfg.images.max_per_request >= 1);
    assert!(cfg.describer.concurrency >= 1);
    if let StoreBackend::Redis(url) = &cfg.store.backend {
        assert!(url.starts_with("redis://") || url.starts_with("rediss://"));
    }
    if let Some(d) = &cfg.describer.upstream {
        assert!(cfg.upstreams.iter().any(|u| &u.name == d));
    }
    let rules = Rules::new(&cfg.images, &cfg.dedup, Some(3));
    assert!(rules.max_images <= 3);
    let _ = Rules::new(&cfg.images, &cfg.dedup, None);
    let _ = (cfg.artifacts_dir(), cfg.learned_path());
    // `visor serve` and `visor check` build the model table at start. Its
    // globs are validation's, lower-cased: only a pattern with upper case
    // can fare differently (building the table parses the 274 built-in
    // rows, so it is not done for every input).
    if cfg
        .models
        .iter()
        .any(|m| m.pattern.bytes().any(|b| b.is_ascii_uppercase()))
    {
        if let Err(e) = ModelTable::new(&cfg.models, Learned::default()) {
            panic!("accepted config, but its model table fails: {e}");
        }
    }
});
