//! Header rules: hop-by-hop removal, credentials, proxy keys, request ids.

use std::sync::atomic::{AtomicU64, Ordering};

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use sha2::{Digest, Sha256};

use crate::config::{Secret, Upstream};

pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// visor's request headers, named once (a name looked up as a `&str` is
/// parsed and checked on every request).
pub static X_VISOR_TRANSFORM: HeaderName = HeaderName::from_static("x-visor-transform");
pub static X_VISOR_VISION: HeaderName = HeaderName::from_static("x-visor-vision");
pub static X_VISOR_SESSION: HeaderName = HeaderName::from_static("x-visor-session");
pub static X_VISOR_HISTORY: HeaderName = HeaderName::from_static("x-visor-history");
pub static X_VISOR_CACHE: HeaderName = HeaderName::from_static("x-visor-cache");
pub use crate::upstream::{X_API_KEY, own_credential};

/// Headers that belong to one connection, never forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Removes hop-by-hop headers, including those the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // A head without any (as the bench's; a `Connection` header is one)
    // takes one pass over the names, without a name hashed to remove.
    if !headers.keys().any(|k| HOP_BY_HOP.contains(&k.as_str())) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
}

/// Prepares the client's headers for the upstream: hop-by-hop, `Host` and
/// `x-visor-*` removed; credentials per the SPEC:
/// - the upstream has a key → it replaces whatever the client sent;
/// - visor has proxy keys → the client's key is visor's, never forwarded;
/// - otherwise the client's `Authorization` / `x-api-key` pass through.
pub fn upstream_request_headers(
    headers: &mut HeaderMap,
    upstream: &Upstream,
    proxy_keys_set: bool,
    request_id: &HeaderValue,
) {
    strip_hop_by_hop(headers);
    headers.remove(header::HOST);
    // `Expect: 100-continue` was answered by visor's own server when it read
    // the body; the upstream gets the body at once.
    headers.remove(header::EXPECT);
    let visor: Vec<HeaderName> = headers
        .keys()
        .filter(|k| k.as_str().starts_with("x-visor-"))
        .cloned()
        .collect();
    for k in visor {
        headers.remove(k);
    }
    if upstream.api_key.is_some() || proxy_keys_set {
        headers.remove(header::AUTHORIZATION);
        headers.remove(&X_API_KEY);
    }
    if let Some((name, value)) = own_credential(upstream) {
        headers.insert(name, value);
    }
    // Forwarded client credentials are marked sensitive too, so no HTTP/2
    // frame log or HPACK table ever holds them in the clear.
    for name in [header::AUTHORIZATION, X_API_KEY.clone()] {
        if let Some(v) = headers.get_mut(name) {
            v.set_sensitive(true);
        }
    }
    headers.insert(X_REQUEST_ID.clone(), request_id.clone());
}

/// The proxy's own keys, held as SHA-256 digests and compared in constant
/// time: every key is compared in full, whatever matched before.
pub struct ProxyKeys {
    /// Each key's digest, and the `[[key]]` it belongs to (`None`: one of
    /// `server.api_keys`, unlimited).
    digests: Vec<([u8; 32], Option<usize>)>,
}

/// Who a request is, by the proxy key it presents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    /// A `server.api_keys` key: no limits.
    Unlimited,
    /// The `[[key]]` at this index.
    Key(usize),
    /// No key, where visor asks for none.
    Anonymous,
}

impl ProxyKeys {
    /// `server.api_keys`, then the `[[key]]` entries that have a key.
    pub fn new(api_keys: &[Secret], keys: &[Option<&Secret>]) -> Self {
        let mut digests: Vec<([u8; 32], Option<usize>)> = api_keys
            .iter()
            .map(|k| (digest(k.expose().as_bytes()), None))
            .collect();
        for (i, k) in keys.iter().enumerate() {
            if let Some(k) = k {
                digests.push((digest(k.expose().as_bytes()), Some(i)));
            }
        }
        Self { digests }
    }

    pub fn is_set(&self) -> bool {
        !self.digests.is_empty()
    }

    /// True when the request carries one of the keys, as
    /// `Authorization: Bearer KEY` or `x-api-key: KEY`.
    pub fn accepts(&self, headers: &HeaderMap) -> bool {
        self.caller(headers).is_some()
    }

    /// Who the request is: `None` when visor asks for a key and it carries
    /// none of them. Every key is compared, in constant time.
    pub fn caller(&self, headers: &HeaderMap) -> Option<Caller> {
        if self.digests.is_empty() {
            return Some(Caller::Anonymous);
        }
        let mut found: Option<Caller> = None;
        for presented in presented(headers).into_iter().flatten() {
            let d = digest(presented);
            for (k, owner) in &self.digests {
                if ct_eq(&d, k) && found.is_none() {
                    found = Some(owner.map_or(Caller::Unlimited, Caller::Key));
                }
            }
        }
        found
    }

    /// A short id of the proxy key `headers` carry (16 hex digits of its
    /// SHA-256), when it is one of visor's keys: the namespace of its
    /// sessions.
    pub fn key_id(&self, headers: &HeaderMap) -> Option<String> {
        presented(headers)
            .into_iter()
            .flatten()
            .find_map(|presented| {
                let d = digest(presented);
                self.digests
                    .iter()
                    .any(|(k, _)| ct_eq(&d, k))
                    .then(|| d[..8].iter().map(|b| format!("{b:02x}")).collect())
            })
    }
}

/// The keys a request presents: `Authorization: Bearer …` and `x-api-key`.
fn presented(headers: &HeaderMap) -> [Option<&[u8]>; 2] {
    let bearer = headers.get(header::AUTHORIZATION).and_then(|v| {
        v.as_bytes()
            .strip_prefix(b"Bearer ")
            .map(<[u8]>::trim_ascii)
    });
    let x_api_key = headers.get(&X_API_KEY).map(|v| v.as_bytes().trim_ascii());
    [bearer, x_api_key]
}

fn digest(b: &[u8]) -> [u8; 32] {
    Sha256::digest(b).into()
}

fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// The request id: the client's `x-request-id` when it is short printable
/// ASCII, else a new random one.
pub fn request_id(headers: &HeaderMap) -> HeaderValue {
    if let Some(v) = headers.get(&X_REQUEST_ID)
        && !v.is_empty()
        && v.len() <= 128
        && v.as_bytes().iter().all(|b| b.is_ascii_graphic())
    {
        return v.clone();
    }
    new_request_id()
}

fn new_request_id() -> HeaderValue {
    use std::hash::{BuildHasher, RandomState};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    thread_local! {
        static SEED: RandomState = RandomState::new();
    }
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let (a, b) = SEED.with(|s| (s.hash_one(n), s.hash_one(!n)));
    HeaderValue::from_bytes(&id_text(a, b))
        .unwrap_or_else(|_| HeaderValue::from_static("req_unknown"))
}

/// `req_` and the 32 hex digits of `a` then `b`, written without a
/// formatter (once per request).
fn id_text(a: u64, b: u64) -> [u8; 36] {
    let mut id = *b"req_00000000000000000000000000000000";
    for (i, digit) in id[4..].iter_mut().enumerate() {
        let word = if i < 16 { a } else { b };
        let nibble = (word >> (60 - 4 * (i % 16))) & 0xf;
        *digit = b"0123456789abcdef"[nibble as usize];
    }
    id
}

/// An upstream's response head made visor's: without the hop-by-hop
/// headers, in the protocol of the client's connection (an upstream that
/// answers HTTP/1.0 would otherwise make visor answer its client so, and
/// close a connection the client meant to keep).
pub fn for_the_client(head: &mut http::response::Parts) {
    strip_hop_by_hop(&mut head.headers);
    head.version = http::Version::HTTP_11;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AuthMode;

    fn upstream(key: Option<&str>, auth: AuthMode) -> Upstream {
        Upstream {
            name: "u".into(),
            base_url: http::Uri::from_static("http://x/v1"),
            api_key: key.map(Secret::new),
            auth,
            models: vec!["*".into()],
            matcher: globset::GlobSet::empty(),
            ca_certs: Vec::new(),
            fallbacks: Vec::new(),
            prompt_cache_key: false,
            chain: vec![0],
        }
    }

    fn client_headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, "Bearer sk-client".parse().unwrap());
        h.insert(
            header::CONNECTION,
            "keep-alive, x-secret-hop".parse().unwrap(),
        );
        h.insert("x-secret-hop", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert(header::HOST, "visor".parse().unwrap());
        h.insert("x-visor-vision", "false".parse().unwrap());
        h.insert("openai-organization", "org-1".parse().unwrap());
        h.insert(header::EXPECT, "100-continue".parse().unwrap());
        h
    }

    #[test]
    fn hop_by_hop_host_and_visor_headers_dropped() {
        let mut h = client_headers();
        let id = HeaderValue::from_static("req_1");
        upstream_request_headers(&mut h, &upstream(None, AuthMode::Bearer), false, &id);
        for gone in [
            "connection",
            "x-secret-hop",
            "keep-alive",
            "host",
            "x-visor-vision",
        ] {
            assert!(h.get(gone).is_none(), "{gone} kept");
        }
        assert_eq!(h["openai-organization"], "org-1");
        assert_eq!(h[header::AUTHORIZATION], "Bearer sk-client");
        assert_eq!(h[&X_REQUEST_ID], "req_1");
    }

    #[test]
    fn each_hop_by_hop_header_goes_alone_and_a_head_without_one_stays_whole() {
        for name in HOP_BY_HOP {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
            h.insert(*name, "x".parse().unwrap());
            strip_hop_by_hop(&mut h);
            assert!(h.get(*name).is_none(), "{name} kept");
            assert_eq!(h.len(), 1, "{name}: {h:?}");
        }
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        h.append("x-tag", "a".parse().unwrap());
        h.append("x-tag", "b".parse().unwrap());
        let before = h.clone();
        strip_hop_by_hop(&mut h);
        assert_eq!(h, before);
    }

    #[test]
    fn upstream_key_replaces_client_key() {
        let id = HeaderValue::from_static("r");
        let mut h = client_headers();
        upstream_request_headers(
            &mut h,
            &upstream(Some("sk-up"), AuthMode::Bearer),
            false,
            &id,
        );
        assert_eq!(h[header::AUTHORIZATION], "Bearer sk-up");
        let mut h = client_headers();
        upstream_request_headers(
            &mut h,
            &upstream(Some("sk-ant"), AuthMode::XApiKey),
            false,
            &id,
        );
        assert!(h.get(header::AUTHORIZATION).is_none());
        assert_eq!(h[&X_API_KEY], "sk-ant");
    }

    #[test]
    fn proxy_key_is_never_forwarded() {
        let id = HeaderValue::from_static("r");
        let mut h = client_headers();
        h.insert(&X_API_KEY, "visor-key".parse().unwrap());
        upstream_request_headers(&mut h, &upstream(None, AuthMode::Bearer), true, &id);
        assert!(h.get(header::AUTHORIZATION).is_none());
        assert!(h.get(&X_API_KEY).is_none());
    }

    #[test]
    fn proxy_keys_accept_bearer_or_x_api_key_only_when_equal() {
        let keys = ProxyKeys::new(&[Secret::new("k1"), Secret::new("k2")], &[]);
        let mut h = HeaderMap::new();
        assert!(!keys.accepts(&h));
        h.insert(header::AUTHORIZATION, "Bearer k2".parse().unwrap());
        assert!(keys.accepts(&h));
        h.insert(header::AUTHORIZATION, "Bearer k3".parse().unwrap());
        assert!(!keys.accepts(&h));
        h.insert(header::AUTHORIZATION, "k1".parse().unwrap());
        assert!(!keys.accepts(&h));
        h.insert(&X_API_KEY, "k1".parse().unwrap());
        assert!(keys.accepts(&h));
    }

    #[test]
    fn a_new_id_is_its_two_words_in_hex() {
        for (a, b) in [
            (0, u64::MAX),
            (0x0123_4567_89ab_cdef, 1),
            (u64::MAX / 3, 42),
        ] {
            let text = id_text(a, b);
            assert_eq!(
                std::str::from_utf8(&text).unwrap(),
                format!("req_{a:016x}{b:016x}")
            );
        }
    }

    #[test]
    fn request_ids_echoed_when_sane_else_generated_and_unique() {
        let mut h = HeaderMap::new();
        h.insert(&X_REQUEST_ID, "abc-123".parse().unwrap());
        assert_eq!(request_id(&h), "abc-123");
        h.insert(&X_REQUEST_ID, "has space".parse().unwrap());
        let a = request_id(&h);
        assert_ne!(a, "has space");
        assert_ne!(request_id(&HeaderMap::new()), request_id(&HeaderMap::new()));
    }
}
