//! `[store]`: where descriptions, learned models and sessions are kept.

use std::fmt;

use serde::Deserialize;

use super::Problems;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    #[serde(default = "default_backend")]
    pub backend: String,
    #[serde(default = "default_prefix")]
    pub prefix: String,
}

impl Default for RawStore {
    fn default() -> Self {
        Self {
            backend: default_backend(),
            prefix: default_prefix(),
        }
    }
}

fn default_backend() -> String {
    "disk".to_owned()
}
fn default_prefix() -> String {
    "visor:".to_owned()
}

/// `[store]`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    pub backend: StoreBackend,
    /// Key prefix (Redis).
    pub prefix: String,
}

/// Where descriptions, learned models and sessions are kept
/// (`store.backend`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreBackend {
    /// This process only.
    Memory,
    /// A file under `server.data_dir`.
    Disk,
    /// A `redis://` or `rediss://` URL (shared by replicas).
    Redis(String),
}

impl fmt::Display for StoreBackend {
    /// `memory`, `disk`, or the Redis URL without its password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreBackend::Memory => f.write_str("memory"),
            StoreBackend::Disk => f.write_str("disk"),
            StoreBackend::Redis(url) => f.write_str(&redacted_url(url)),
        }
    }
}

/// A URL without its password (`redis://:pw@host` → `redis://…@host`), for
/// logs, `/readyz` and the CLI.
pub fn redacted_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://…@{}", &url[..s], &url[at + 1..]),
        _ => url.to_owned(),
    }
}

impl RawStore {
    pub(super) fn validate(self, p: &mut Problems) -> StoreConfig {
        let backend = match self.backend.as_str() {
            "memory" => StoreBackend::Memory,
            "disk" => StoreBackend::Disk,
            url if url.starts_with("redis://") || url.starts_with("rediss://") => {
                StoreBackend::Redis(url.to_owned())
            }
            other => {
                p.bad(
                    "store.backend",
                    format_args!("{:?}", redacted_url(other)),
                    "must be \"memory\", \"disk\" or a redis://host:port/db URL",
                );
                StoreBackend::Memory
            }
        };
        if !cfg!(feature = "redis") && matches!(backend, StoreBackend::Redis(_)) {
            p.bad(
                "store.backend",
                format_args!("{:?}", redacted_url(&self.backend)),
                "this build of visor has no Redis support (it was built without the `redis` feature)",
            );
        }
        StoreConfig {
            backend,
            prefix: self.prefix,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{load, problems, ups};
    use super::StoreBackend;

    #[test]
    fn backends_are_checked_and_passwords_never_printed() {
        let with =
            |backend: &str| format!("{}[store]\nbackend = \"{backend}\"\n", ups(&[("a", "")]));
        let cfg = load(&with("memory")).unwrap();
        assert_eq!(cfg.store.backend, StoreBackend::Memory);
        let e = problems(&with("postgres://u:pw@h/db"));
        assert!(
            e.contains("store.backend: \"postgres://…@h/db\" — must be \"memory\""),
            "{e}"
        );
        let e = problems(&with("redis://:pw@h:6379/0"));
        if cfg!(feature = "redis") {
            assert_eq!(e, "(valid)");
        } else {
            assert!(
                e.contains("store.backend: \"redis://…@h:6379/0\" — this build of visor has no Redis support"),
                "{e}"
            );
        }
    }
}
