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
    /// Whether a request with these headers may read the inspector.
    pub fn access(&self, headers: &http::HeaderMap, now_secs: u64) -> Access {
        if self.open {
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

/// HMAC-SHA256 (RFC 2104) of the expiry under `key`.
fn hmac(key: &[u8], expires: u64) -> [u8; 32] {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let pad = |b: u8| k.map(|x| x ^ b);
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(b"visor-inspector.")
        .chain_update(expires.to_string())
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
        let mut h = http::HeaderMap::new();
        assert_eq!(gate(true, &[]).access(&h, 0), Access::Granted);
        assert_eq!(gate(false, &[]).access(&h, 0), Access::NotConfigured);
        let closed = gate(false, &["adm-1"]);
        assert_eq!(closed.access(&h, 0), Access::Unauthorized);
        h.insert(http::header::AUTHORIZATION, "Bearer adm-2".parse().unwrap());
        assert_eq!(closed.access(&h, 0), Access::Unauthorized);
        h.insert(http::header::AUTHORIZATION, "Bearer adm-1".parse().unwrap());
        assert_eq!(closed.access(&h, 0), Access::Granted);
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
        let ok = with(&format!("theme=dark; {COOKIE}={c}"));
        assert_eq!(g.access(&ok, 1000), Access::Granted);
        assert_eq!(g.access(&ok, 1000 + SIGN_IN_SECS), Access::Unauthorized);
        // Another replica with the same keys takes it; other keys do not.
        assert_eq!(gate(false, &["adm-2"]).access(&ok, 1000), Access::Granted);
        assert_eq!(
            gate(false, &["adm-3"]).access(&ok, 1000),
            Access::Unauthorized
        );
        // A later expiry under the old signature is refused.
        let (_, mac) = c.split_once('.').unwrap();
        let forged = with(&format!("{COOKIE}={}.{mac}", 1000 + 10 * SIGN_IN_SECS));
        assert_eq!(g.access(&forged, 1000), Access::Unauthorized);
        assert_eq!(
            g.access(&with(&format!("{COOKIE}=x")), 0),
            Access::Unauthorized
        );
    }

    #[test]
    fn hmac_matches_rfc_4231_shape() {
        // A key longer than the block is hashed first; a short one padded.
        assert_ne!(hmac(&[1; 100], 5), hmac(&[1; 10], 5));
        assert_eq!(hmac(b"k", 5), hmac(b"k", 5));
        assert_ne!(hmac(b"k", 5), hmac(b"k", 6));
    }
}
