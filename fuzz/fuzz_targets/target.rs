//! Fuzzes the request-target check of `src/proxy/router.rs` (`check_target`
//! and `path_problem`): any request target, any method, HTTP/1.1 or 2.
//!
//! `mod router` is private to visor, so `fuzz/build.rs` copies these four
//! functions out of `src/proxy/router.rs` verbatim (`check_target`,
//! `path_problem`, `percent_decode`, `hex`) and this target compiles them
//! against visor's public `VisorError`: the code fuzzed is the file's.
//!
//! Invariants, for every target `check_target` accepts (checked with a
//! percent decoder of its own, at each of the three levels of decoding the
//! router promises to look through):
//! - not CONNECT; on HTTP/1 no scheme and no authority; the path starts
//!   with `/`;
//! - no `.` or `..` segment (`/` and `\` separate, a `;parameter` does not
//!   count), no NUL or other control byte, no overlong UTF-8 encoding (and
//!   the fully decoded path is UTF-8).
//!
//! And the same for `path_problem` over any UTF-8 string (raw bytes that
//! `http::Uri` would refuse included).
//!
//! `canonical_path` (the one spelling every path is given before it is
//! classified), over any path `check_target` accepts: its answer is
//! canonical itself (a second pass changes nothing); it has no `//`, no
//! trailing `/` (but `/`), no escape of an unreserved character; on a
//! write, no escaped `/`, `\` or `%`; and decoded once, it reads as the
//! input does (runs of `/` taken as one, a trailing one dropped).
#![no_main]

use libfuzzer_sys::fuzz_target;

/// The check, copied verbatim from `src/proxy/router.rs` by `build.rs`.
mod router {
    #![allow(dead_code)]
    use http::{Method, Request, Version};
    use visor::error::VisorError;

    include!(concat!(env!("OUT_DIR"), "/router_check.rs"));
}

/// One level of `%XX` decoding; anything else (a lone `%`, bad hex) is
/// kept as it is.
fn decode_once(s: &[u8]) -> Vec<u8> {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'%'
            && let (Some(&h), Some(&l)) = (s.get(i + 1), s.get(i + 2))
            && let (Some(h), Some(l)) = (hex(h), hex(l))
        {
            out.push(h << 4 | l);
            i += 3;
        } else {
            out.push(s[i]);
            i += 1;
        }
    }
    out
}

/// An overlong UTF-8 encoding starts here: C0/C1 lead bytes, E0 80-9F,
/// F0 80-8F.
fn overlong_at(s: &[u8], i: usize) -> bool {
    match (s[i], s.get(i + 1)) {
        (0xC0 | 0xC1, _) => true,
        (0xE0, Some(0x80..=0x9F)) => true,
        (0xF0, Some(0x80..=0x8F)) => true,
        _ => false,
    }
}

/// Why a decoded path breaks an invariant, if it does.
fn broken(level: usize, d: &[u8]) -> Option<String> {
    if let Some(b) = d.iter().find(|&&b| b < 0x20 || b == 0x7F) {
        return Some(format!("control byte {b:#04x} after {level} decodings"));
    }
    if (0..d.len()).any(|i| overlong_at(d, i)) {
        return Some(format!("overlong UTF-8 after {level} decodings"));
    }
    for seg in d.split(|&b| b == b'/' || b == b'\\') {
        let name = seg.split(|&b| b == b';').next().unwrap_or(seg);
        if name == b"." || name == b".." {
            return Some(format!("dot segment after {level} decodings"));
        }
    }
    None
}

/// Checks a path that was accepted, at each level of decoding.
fn check_accepted(path: &[u8], what: &str) {
    let mut cur = path.to_vec();
    for level in 0..=3 {
        if let Some(why) = broken(level, &cur) {
            panic!("{what} accepted {:?}: {why}", String::from_utf8_lossy(path));
        }
        if level == 3 || !cur.contains(&b'%') {
            break;
        }
        let next = decode_once(&cur);
        if next == cur {
            break;
        }
        cur = next;
    }
    assert!(
        std::str::from_utf8(&cur).is_ok(),
        "{what} accepted {:?}: not UTF-8 once decoded",
        String::from_utf8_lossy(path)
    );
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, target)) = data.split_first() else {
        return;
    };
    // `path_problem` over any UTF-8 text.
    if let Ok(s) = std::str::from_utf8(target)
        && router::path_problem(s).is_none()
    {
        check_accepted(s.as_bytes(), "path_problem");
    }
    // `check_target` over a request whose target `http` parses, as hyper
    // gives it to the router.
    let Ok(uri) = http::Uri::try_from(target) else {
        return;
    };
    let method = match flags & 3 {
        0 => http::Method::GET,
        1 => http::Method::POST,
        2 => http::Method::CONNECT,
        _ => http::Method::DELETE,
    };
    let version = match flags & 4 {
        0 => http::Version::HTTP_11,
        _ => http::Version::HTTP_2,
    };
    let Ok(req) = http::Request::builder()
        .method(method)
        .version(version)
        .uri(uri)
        .body(())
    else {
        return;
    };
    if router::check_target(&req).is_ok() {
        assert_ne!(req.method(), http::Method::CONNECT);
        if req.version() < http::Version::HTTP_2 {
            assert!(req.uri().scheme().is_none() && req.uri().authority().is_none());
        }
        let path = req.uri().path();
        assert!(path.starts_with('/'), "accepted path {path:?}");
        check_accepted(path.as_bytes(), "check_target");
        let plain_get = flags & 8 != 0;
        if let Ok(canon) = router::canonical_path(path, plain_get) {
            check_canonical(path, canon.as_deref().unwrap_or(path), plain_get);
        }
    }
});

/// `path` collapsed as the canonical form reads it: decoded once, runs of
/// `/` as one, no trailing `/`.
fn read_as(path: &[u8]) -> Vec<u8> {
    let mut out: Vec<u8> = Vec::new();
    for &b in &decode_once(path) {
        if b == b'/' && out.last() == Some(&b'/') {
            continue;
        }
        out.push(b);
    }
    if out.len() > 1 && out.last() == Some(&b'/') {
        out.pop();
    }
    out
}

fn check_canonical(input: &str, canon: &str, plain_get: bool) {
    assert_eq!(
        router::canonical_path(canon, plain_get),
        Ok(None),
        "{input:?} → {canon:?} is not canonical"
    );
    assert!(!canon.contains("//"), "{input:?} → {canon:?}");
    assert!(plain_get || !canon.contains('\\'), "{input:?} → {canon:?}: `\\` on a write");
    assert!(canon == "/" || !canon.ends_with('/'), "{input:?} → {canon:?}");
    let b = canon.as_bytes();
    // A plain GET with a `%` that starts no escape has none decoded.
    let stray = (0..b.len()).any(|i| {
        b[i] == b'%'
            && !(b.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
    });
    assert!(plain_get || !stray, "{input:?} → {canon:?}: a stray `%` on a write");
    for i in (0..b.len()).filter(|_| !stray) {
        let escape = b[i] == b'%'
            && b.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
            && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit);
        if !escape {
            continue;
        }
        let esc = decode_once(&b[i..i + 3]);
        if esc.len() == 1 {
            let d = esc[0];
            assert!(
                !(d.is_ascii_alphanumeric() || matches!(d, b'-' | b'.' | b'_' | b'~')),
                "{input:?} → {canon:?}: an unreserved character still escaped"
            );
            assert!(
                plain_get || !matches!(d, b'/' | b'\\' | b'%'),
                "{input:?} → {canon:?}: an escaped separator on a write"
            );
        }
    }
    assert_eq!(
        read_as(input.as_bytes()),
        read_as(b),
        "{input:?} → {canon:?} reads differently"
    );
}
