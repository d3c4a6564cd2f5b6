//! `[retries]`: the fallback budget and the per-upstream circuit breaker.

use std::time::Duration;

use serde::Deserialize;

use super::Problems;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRetries {
    /// Retries (fallback attempts) at most this share of the requests of the
    /// last minute, in percent.
    #[serde(default = "default_budget_percent")]
    pub budget_percent: u32,
    /// Retries allowed per minute whatever the share (the budget is the
    /// larger of the two), so the first failures of a quiet visor still
    /// fall back.
    #[serde(default = "default_min_retries_per_minute")]
    pub min_retries_per_minute: u32,
    /// Consecutive failures that open an upstream's breaker.
    #[serde(default = "default_breaker_failures")]
    pub breaker_failures: u32,
    /// How long an open breaker skips its upstream before one probe.
    #[serde(default = "default_breaker_cooldown_secs")]
    pub breaker_cooldown_secs: f64,
}

impl Default for RawRetries {
    fn default() -> Self {
        Self {
            budget_percent: default_budget_percent(),
            min_retries_per_minute: default_min_retries_per_minute(),
            breaker_failures: default_breaker_failures(),
            breaker_cooldown_secs: default_breaker_cooldown_secs(),
        }
    }
}

fn default_budget_percent() -> u32 {
    20
}
fn default_min_retries_per_minute() -> u32 {
    10
}
fn default_breaker_failures() -> u32 {
    5
}
fn default_breaker_cooldown_secs() -> f64 {
    30.0
}

/// `[retries]`, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retries {
    /// 0 to 100.
    pub budget_percent: u32,
    pub min_retries_per_minute: u32,
    /// At least 1.
    pub breaker_failures: u32,
    pub breaker_cooldown: Duration,
}

impl RawRetries {
    pub(super) fn validate(self, p: &mut Problems) -> Retries {
        if self.budget_percent > 100 {
            p.bad(
                "retries.budget_percent",
                self.budget_percent,
                "at most 100 (0: no retries beyond min_retries_per_minute)",
            );
        }
        p.at_least_one("retries.breaker_failures", self.breaker_failures.into());
        Retries {
            budget_percent: self.budget_percent,
            min_retries_per_minute: self.min_retries_per_minute,
            breaker_failures: self.breaker_failures,
            breaker_cooldown: p.secs("retries.breaker_cooldown_secs", self.breaker_cooldown_secs),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::testing::{load, problems, ups};

    #[test]
    fn defaults_and_bad_values() {
        let cfg = load(&ups(&[("a", "")])).unwrap();
        assert_eq!(cfg.retries.budget_percent, 20);
        assert_eq!(cfg.retries.breaker_failures, 5);
        assert_eq!(cfg.retries.breaker_cooldown, Duration::from_secs(30));
        let e = problems(&format!(
            "{}[retries]\nbudget_percent = 101\nbreaker_failures = 0\nbreaker_cooldown_secs = -1\n",
            ups(&[("a", "")])
        ));
        assert!(e.contains("retries.budget_percent: 101"), "{e}");
        assert!(e.contains("retries.breaker_failures: 0"), "{e}");
        assert!(e.contains("retries.breaker_cooldown_secs"), "{e}");
    }
}
