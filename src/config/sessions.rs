//! `[sessions]`: how much history a session carries and how long it is kept.

use std::time::Duration;

use serde::Deserialize;

use super::Problems;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSessions {
    #[serde(default = "default_depth")]
    pub default_depth: u32,
    #[serde(default = "default_max_depth")]
    pub max_depth: u32,
    #[serde(default = "default_idle_ttl_secs")]
    pub idle_ttl_secs: u64,
}

impl Default for RawSessions {
    fn default() -> Self {
        Self {
            default_depth: default_depth(),
            max_depth: default_max_depth(),
            idle_ttl_secs: default_idle_ttl_secs(),
        }
    }
}

fn default_depth() -> u32 {
    25
}
fn default_max_depth() -> u32 {
    200
}
fn default_idle_ttl_secs() -> u64 {
    604_800
}

/// `[sessions]`, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sessions {
    /// At most `max_depth`.
    pub default_depth: u32,
    /// At least 1.
    pub max_depth: u32,
    /// A session untouched this long is forgotten (`idle_ttl_secs`).
    pub idle_ttl: Duration,
}

impl RawSessions {
    pub(super) fn validate(self, p: &mut Problems) -> Sessions {
        p.at_least_one("sessions.max_depth", self.max_depth.into());
        if self.default_depth > self.max_depth {
            p.bad(
                "sessions.default_depth",
                self.default_depth,
                format_args!("must not exceed sessions.max_depth ({})", self.max_depth),
            );
        }
        Sessions {
            default_depth: self.default_depth,
            max_depth: self.max_depth,
            idle_ttl: Duration::from_secs(self.idle_ttl_secs),
        }
    }
}
