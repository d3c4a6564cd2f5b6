//! Copies the request-target check out of `src/proxy/router.rs` (its module
//! is private to visor) for the `target` fuzz target: the functions
//! `check_target`, `path_problem`, `percent_decode`, `hex` and
//! `canonical_path`, verbatim,
//! made `pub`, into `$OUT_DIR/router_check.rs`; and the WebSocket event
//! reader out of `src/proxy/websocket.rs` for the `ws_event` target.

use std::path::PathBuf;

const ITEMS: [&str; 5] = [
    "check_target",
    "path_problem",
    "percent_decode",
    "hex",
    "canonical_path",
];

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let src = dir.join("../src/proxy/router.rs");
    println!("cargo:rerun-if-changed={}", src.display());
    let text = std::fs::read_to_string(&src)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", src.display()));
    let mut out = String::from("// Copied from src/proxy/router.rs by fuzz/build.rs.\n\n");
    for name in ITEMS {
        match item(&text, name) {
            Some(f) => {
                out.push_str(&f);
                out.push_str("\n\n");
            }
            None => panic!("fn {name} not found in src/proxy/router.rs: update fuzz/build.rs"),
        }
    }
    let dest = PathBuf::from(std::env::var("OUT_DIR").unwrap_or_default()).join("router_check.rs");
    if let Err(e) = std::fs::write(&dest, out) {
        panic!("cannot write {}: {e}", dest.display());
    }
    ws_event(&dir);
}

/// The WebSocket event reader of `src/proxy/websocket.rs` (`read_event`,
/// `twice_named_key` and `MAX_MODEL`), verbatim but for `crate::` read as
/// `visor::`, into `$OUT_DIR/ws_event.rs` for the `ws_event` target.
fn ws_event(dir: &std::path::Path) {
    let src = dir.join("../src/proxy/websocket.rs");
    println!("cargo:rerun-if-changed={}", src.display());
    let text = std::fs::read_to_string(&src)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", src.display()));
    let mut out = String::from("// Copied from src/proxy/websocket.rs by fuzz/build.rs.\n\n");
    let max = text
        .lines()
        .find(|l| l.starts_with("const MAX_MODEL"))
        .unwrap_or_else(|| panic!("const MAX_MODEL not found in src/proxy/websocket.rs: update fuzz/build.rs"));
    out.push_str(&format!("pub {max}\n\n"));
    for name in ["read_event", "twice_named_key"] {
        match item(&text, name) {
            Some(f) => {
                out.push_str(&f.replace("crate::", "visor::"));
                out.push_str("\n\n");
            }
            None => panic!("fn {name} not found in src/proxy/websocket.rs: update fuzz/build.rs"),
        }
    }
    let dest = PathBuf::from(std::env::var("OUT_DIR").unwrap_or_default()).join("ws_event.rs");
    if let Err(e) = std::fs::write(&dest, out) {
        panic!("cannot write {}: {e}", dest.display());
    }
}

/// The text of top-level `fn name` (any visibility), made `pub`.
fn item(text: &str, name: &str) -> Option<String> {
    let head = format!("fn {name}");
    let mut at = 0;
    let start = loop {
        let i = at + text[at..].find(&head)?;
        let line = text[..i].rfind('\n').map_or(0, |n| n + 1);
        let before = text[line..i].trim();
        let next = text[i + head.len()..].chars().next();
        let whole = matches!(next, Some('(' | '<'));
        if whole && (before.is_empty() || before.starts_with("pub")) {
            break i;
        }
        at = i + head.len();
    };
    let open = start + text[start..].find('{')?;
    let bytes = text.as_bytes();
    let mut depth = 0usize;
    let mut i = open;
    while i < bytes.len() {
        match bytes[i] {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(format!("pub {}", &text[start..=i]));
                }
            }
            b'"' => {
                // A string literal: to its closing quote.
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
            }
            b'\'' => {
                // A char literal ('x', '\n', '{'); a lifetime has no
                // closing quote.
                if bytes.get(i + 1) == Some(&b'\\') {
                    i += 1;
                    while i < bytes.len() && bytes[i] != b'\'' {
                        i += 1;
                    }
                } else if bytes.get(i + 2) == Some(&b'\'') {
                    i += 2;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}
