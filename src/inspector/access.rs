//! Who may read the inspector: anyone when visor listens on loopback
//! without proxy keys; otherwise whoever shows an `[inspector] admin_keys`
//! key — `Authorization: Bearer` for scripts, or the cookie the sign-in
//! form sets for a browser. The cookie holds no key: an expiry and an
//! HMAC-SHA256 of it under the admin key, so any replica with the same
//! keys accepts it and none has to remember it.

use sha2::{Digest, Sha256};

use crate::config::Secret;

/// The sign-in cookie's name.
pub const COOKIE: &str = "visor_inspector";

/// How long a sign-in lasts.
pub const SIGN_IN_SECS: u64 = 12 * 3600;

/// Who may read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Granted,
    /// No admin key sent, or a wrong one.
    Unauthorized,
    /// Not open, and no admin key configured.
    NotConfigured,
}

/// The keys and whether it is open.
pub struct Gate {
    pub admin_keys: Vec<Secret>,
    /// Open without a key: a loopback listener and no proxy keys.
    pub open: bool,
}

impl Gate {
    /// Whether a request with these headers (to `uri`) may read the
    /// inspector. Open means open to this machine: a request that names
    /// another host (a page that rebound its name to 127.0.0.1) or that a
    /// browser says comes from another site is not let in without a key.
    pub fn access(&self, headers: &http::HeaderMap, uri: &http::Uri, now_secs: u64) -> Access {
        if self.open && is_local(headers, uri) {
            return Access::Granted;
        }
        if self.admin_keys.is_empty() {
            return Access::NotConfigured;
        }
        let bearer = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if bearer.is_some_and(|b| self.is_admin_key(b)) {
            return Access::Granted;
        }
        let signed_in = headers
            .get_all(http::header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='))
            .any(|v| self.valid_cookie(v, now_secs));
        match signed_in {
            true => Access::Granted,
            false => Access::Unauthorized,
        }
    }

    /// Whether this request is one a browser on this machine, or a
    /// script, sends to visor itself: no other host named, not cross-site.
    pub fn is_local(headers: &http::HeaderMap, uri: &http::Uri) -> bool {
        is_local(headers, uri)
    }

    pub fn is_admin_key(&self, key: &str) -> bool {
        self.admin_keys
            .iter()
            .any(|k| constant_time_eq(k.expose().as_bytes(), key.as_bytes()))
    }

    /// The cookie's value for a sign-in with `key` (`None`: not an admin
    /// key).
    pub fn sign_in(&self, key: &str, now_secs: u64) -> Option<String> {
        let k = self
            .admin_keys
            .iter()
            .find(|k| constant_time_eq(k.expose().as_bytes(), key.as_bytes()))?;
        let expires = now_secs + SIGN_IN_SECS;
        Some(format!(
            "{expires}.{}",
            hex(&hmac(k.expose().as_bytes(), expires))
        ))
    }

    fn valid_cookie(&self, v: &str, now_secs: u64) -> bool {
        let Some((expires, mac)) = v.split_once('.') else {
            return false;
        };
        let Ok(expires) = expires.parse::<u64>() else {
            return false;
        };
        expires > now_secs
            && self.admin_keys.iter().any(|k| {
                constant_time_eq(
                    hex(&hmac(k.expose().as_bytes(), expires)).as_bytes(),
                    mac.as_bytes(),
                )
            })
    }
}

/// A request to a loopback name (or none named), not from another site.
fn is_local(headers: &http::HeaderMap, uri: &http::Uri) -> bool {
    let host = uri.authority().map(|a| a.host().to_owned()).or_else(|| {
        let h = headers.get(http::header::HOST)?.to_str().ok()?;
        let h = match h.strip_prefix('[') {
            Some(v6) => v6.split(']').next().unwrap_or(""),
            None => h.rsplit_once(':').map_or(h, |(name, _)| name),
        };
        Some(h.to_owned())
    });
    let loopback = host.is_none_or(|h| {
        let h = h.trim_start_matches('[').trim_end_matches(']');
        h.eq_ignore_ascii_case("localhost")
            || h.parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    });
    let cross_site = headers
        .get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"cross-site"));
    loopback && !cross_site
}

/// The signature of an expiry under `key`.
fn hmac(key: &[u8], expires: u64) -> [u8; 32] {
    hmac_sha256(key, format!("visor-inspector.{expires}").as_bytes())
}

/// HMAC-SHA256 (RFC 2104).
fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let pad = |b: u8| k.map(|x| x ^ b);
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(message)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .into()
}

fn hex(b: &[u8]) -> String {
    use std::fmt::Write as _;
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

/// Compares two secrets in time that does not depend on where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(open: bool, admin: &[&str]) -> Gate {
        Gate {
            admin_keys: admin.iter().map(|k| Secret::new(*k)).collect(),
            open,
        }
    }

    #[test]
    fn open_on_loopback_without_keys_else_an_admin_key() {
        let uri: http::Uri = "/visor/ui".parse().unwrap();
        let mut h = http::HeaderMap::new();
        assert_eq!(gate(true, &[]).access(&h, &uri, 0), Access::Granted);
        assert_eq!(gate(false, &[]).access(&h, &uri, 0), Access::NotConfigured);
        let closed = gate(false, &["adm-1"]);
        assert_eq!(closed.access(&h, &uri, 0), Access::Unauthorized);
        h.insert(http::header::AUTHORIZATION, "Bearer adm-2".parse().unwrap());
        assert_eq!(closed.access(&h, &uri, 0), Access::Unauthorized);
        h.insert(http::header::AUTHORIZATION, "Bearer adm-1".parse().unwrap());
        assert_eq!(closed.access(&h, &uri, 0), Access::Granted);
    }

    #[test]
    fn the_cookie_is_signed_expires_and_holds_no_key() {
        let g = gate(false, &["adm-1", "adm-2"]);
        assert!(g.sign_in("nope", 1000).is_none());
        let c = g.sign_in("adm-2", 1000).unwrap();
        assert!(!c.contains("adm"));
        let with = |v: &str| {
            let mut h = http::HeaderMap::new();
            h.insert(http::header::COOKIE, v.parse().unwrap());
            h
        };
        let uri: http::Uri = "/visor/ui".parse().unwrap();
        let ok = with(&format!("theme=dark; {COOKIE}={c}"));
        assert_eq!(g.access(&ok, &uri, 1000), Access::Granted);
        assert_eq!(
            g.access(&ok, &uri, 1000 + SIGN_IN_SECS),
            Access::Unauthorized
        );
        // Another replica with the same keys takes it; other keys do not.
        assert_eq!(
            gate(false, &["adm-2"]).access(&ok, &uri, 1000),
            Access::Granted
        );
        assert_eq!(
            gate(false, &["adm-3"]).access(&ok, &uri, 1000),
            Access::Unauthorized
        );
        // A later expiry under the old signature is refused.
        let (_, mac) = c.split_once('.').unwrap();
        let forged = with(&format!("{COOKIE}={}.{mac}", 1000 + 10 * SIGN_IN_SECS));
        assert_eq!(g.access(&forged, &uri, 1000), Access::Unauthorized);
        assert_eq!(
            g.access(&with(&format!("{COOKIE}=x")), &uri, 0),
            Access::Unauthorized
        );
    }

    #[test]
    fn hmac_sha256_gives_the_rfc_4231_vectors() {
        // Test case 1 (a short key) and 6 (a key longer than the block).
        assert_eq!(
            hex(&hmac_sha256(&[0x0b; 20], b"Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        assert_eq!(
            hex(&hmac_sha256(
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
        assert_ne!(hmac(b"k", 5), hmac(b"k", 6));
    }

    #[test]
    fn open_is_open_to_this_machine_only() {
        let g = gate(true, &[]);
        let uri: http::Uri = "/visor/ui".parse().unwrap();
        let with = |pairs: &[(&str, &str)]| {
            let mut h = http::HeaderMap::new();
            for (k, v) in pairs {
                h.insert(
                    http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                );
            }
            g.access(&h, &uri, 0)
        };
        for host in [
            "127.0.0.1:8787",
            "localhost:8787",
            "[::1]:8787",
            "localhost",
        ] {
            assert_eq!(with(&[("host", host)]), Access::Granted, "{host}");
        }
        assert_eq!(with(&[]), Access::Granted, "no host named");
        // A name rebound to 127.0.0.1 by some page: not open to it.
        assert_eq!(
            with(&[("host", "evil.example:8787")]),
            Access::NotConfigured
        );
        assert_eq!(
            with(&[("host", "127.0.0.1:8787"), ("sec-fetch-site", "cross-site")]),
            Access::NotConfigured
        );
        assert_eq!(
            with(&[
                ("host", "127.0.0.1:8787"),
                ("sec-fetch-site", "same-origin")
            ]),
            Access::Granted
        );
        let h2: http::Uri = "http://evil.example:8787/visor/ui".parse().unwrap();
        assert_eq!(
            g.access(&http::HeaderMap::new(), &h2, 0),
            Access::NotConfigured
        );
    }
}
