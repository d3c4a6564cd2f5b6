//! Shared bench setup.

use std::path::PathBuf;

/// `large-image-4mb.json` (one ~3 MB PNG of noise, base64, for a text-only
/// model), made on first use by `tests/fixtures/make_fixtures.py
/// --large` into `target/load/` (python3).
#[allow(dead_code)]
pub fn large_fixture() -> Vec<u8> {
    large("large-image-4mb.json")
}

/// One of the fixtures `make_fixtures.py --large` writes (not committed):
/// `large-image-4mb.json` or `agent-history-200turns.json`.
#[allow(dead_code)] // not every bench uses every fixture
pub fn large(name: &str) -> Vec<u8> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = root.join("target/load");
    let path = dir.join(name);
    if !path.exists() {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(
            root.join("tests/fixtures/make_fixtures.py"),
            dir.join("make_fixtures.py"),
        )
        .unwrap();
        let ok = std::process::Command::new("python3")
            .arg(dir.join("make_fixtures.py"))
            .arg("--large")
            .status()
            .unwrap()
            .success();
        assert!(ok, "make_fixtures.py --large failed");
    }
    std::fs::read(path).unwrap()
}
