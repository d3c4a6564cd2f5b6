//! `[cache]`: prompt caching — whether visor places cache breakpoints on
//! requests to Anthropic-kind upstreams, the lifetime they ask for, and how
//! long a provider is taken to keep a prefix when a miss is explained.

use std::time::Duration;

use serde::Deserialize;

use super::Problems;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCache {
    #[serde(default = "default_breakpoints")]
    pub breakpoints: String,
    #[serde(default = "default_ttl")]
    pub ttl: String,
    /// How long after a request its prefix is taken to be gone from the
    /// provider's cache (the `expired` cause); default: the `ttl`.
    #[serde(default)]
    pub expire_after_secs: Option<f64>,
}

impl Default for RawCache {
    fn default() -> Self {
        Self {
            breakpoints: default_breakpoints(),
            ttl: default_ttl(),
            expire_after_secs: None,
        }
    }
}

fn default_breakpoints() -> String {
    "auto".to_owned()
}
fn default_ttl() -> String {
    "5m".to_owned()
}

/// The lifetime a breakpoint asks the provider for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheTtl {
    /// The provider's default (the marker carries no `ttl`).
    FiveMinutes,
    /// `"ttl": "1h"` (written at twice the base price instead of 1.25).
    OneHour,
}

impl CacheTtl {
    pub fn duration(self) -> Duration {
        match self {
            CacheTtl::FiveMinutes => Duration::from_secs(300),
            CacheTtl::OneHour => Duration::from_secs(3600),
        }
    }
}

/// `[cache]`, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cache {
    /// `breakpoints = "auto"`.
    pub breakpoints: bool,
    pub ttl: CacheTtl,
    /// `expire_after_secs`, else the `ttl`'s duration.
    pub expire_after: Duration,
}

impl Default for Cache {
    fn default() -> Self {
        RawCache::default().validate(&mut Problems::default())
    }
}

impl RawCache {
    pub(super) fn validate(self, p: &mut Problems) -> Cache {
        let breakpoints = p
            .one_of(
                "cache.breakpoints",
                &self.breakpoints,
                &[("auto", true), ("off", false)],
            )
            .unwrap_or(true);
        let ttl = p
            .one_of(
                "cache.ttl",
                &self.ttl,
                &[("5m", CacheTtl::FiveMinutes), ("1h", CacheTtl::OneHour)],
            )
            .unwrap_or(CacheTtl::FiveMinutes);
        let expire_after = match self.expire_after_secs {
            Some(s) => p.secs("cache.expire_after_secs", s),
            None => ttl.duration(),
        };
        Cache {
            breakpoints,
            ttl,
            expire_after,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{load, problems, ups};
    use super::*;

    fn cache(extra: &str) -> Cache {
        load(&format!("{}{extra}", ups(&[("a", "")])))
            .unwrap()
            .cache
    }

    #[test]
    fn defaults_are_auto_five_minutes() {
        let c = cache("");
        assert!(c.breakpoints);
        assert_eq!(c.ttl, CacheTtl::FiveMinutes);
        assert_eq!(c.expire_after, Duration::from_secs(300));
    }

    #[test]
    fn an_hour_expires_after_an_hour_unless_told() {
        let c = cache("[cache]\nttl = \"1h\"\nbreakpoints = \"off\"\n");
        assert!(!c.breakpoints);
        assert_eq!(c.expire_after, Duration::from_secs(3600));
        let c = cache("[cache]\nexpire_after_secs = 2\n");
        assert_eq!(c.expire_after, Duration::from_secs(2));
    }

    #[test]
    fn other_values_are_named() {
        let p = problems(&format!(
            "{}[cache]\nttl = \"10m\"\nbreakpoints = \"on\"\nexpire_after_secs = 0\n",
            ups(&[("a", "")])
        ));
        assert!(p.contains("cache.ttl: \"10m\""), "{p}");
        assert!(p.contains("cache.breakpoints: \"on\""), "{p}");
        assert!(p.contains("cache.expire_after_secs: 0"), "{p}");
    }
}
