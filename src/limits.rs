//! Per-key rate limits (`[[key]]`): requests and tokens per minute.
//!
//! Counted in fixed one-minute windows (the wall clock's minutes), the same
//! way in memory and in a shared store: with a `redis://` store every
//! replica adds to the same two counters in one round trip
//! ([`Store::count_window`]), so a key's limit holds across replicas;
//! while the store cannot be reached each replica counts on its own (never
//! open: the limit still holds per replica) and the fallback is counted.
//! Fixed windows give exact `remaining` and `reset` figures for the
//! `x-ratelimit-*` headers and the same answer from both backends; the
//! cost is that a key may spend up to twice its limit across the edge of
//! two windows.
//!
//! Tokens are estimated before the request goes (its body at 4 bytes a
//! token) and corrected when the upstream's `usage` comes back
//! ([`Limiter::correct`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use globset::GlobSet;

use crate::metrics::Metrics;
use crate::store::Store;

/// A window: one minute.
pub const WINDOW: Duration = Duration::from_secs(60);

/// Bytes of request body counted as one token in the estimate.
pub const BYTES_PER_TOKEN: u64 = 4;

/// One `[[key]]`, checked.
#[derive(Debug, Clone)]
pub struct KeyLimits {
    pub name: String,
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    /// The models the key may use (globs, lower case).
    pub models: GlobSet,
    /// `models = ["*"]`: any model (a streamed body's model need not be
    /// read to check it).
    pub any_model: bool,
}

impl KeyLimits {
    pub fn allows(&self, model: &str) -> bool {
        self.models.is_match(model.to_ascii_lowercase())
    }
}

/// Which limit a request went over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    Requests,
    Tokens,
}

impl Limit {
    pub fn label(self) -> &'static str {
        match self {
            Limit::Requests => "requests",
            Limit::Tokens => "tokens",
        }
    }
}

/// Where a window stands after a request was counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    pub limit: u64,
    pub remaining: u64,
    /// Until the window ends.
    pub reset: Duration,
}

/// A key's answer for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub requests: Option<Standing>,
    pub tokens: Option<Standing>,
    /// The limit the request is over (then it must not be sent).
    pub over: Option<Limit>,
}

pub struct Limiter {
    keys: Vec<KeyLimits>,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    /// (key, limit) → (window, count): this replica's counters.
    local: Mutex<HashMap<(usize, Limit), (u64, u64)>>,
}

impl Limiter {
    pub fn new(keys: Vec<KeyLimits>, store: Arc<Store>, metrics: Arc<Metrics>) -> Self {
        Self {
            keys,
            store,
            metrics,
            local: Mutex::new(HashMap::new()),
        }
    }

    pub fn key(&self, i: usize) -> Option<&KeyLimits> {
        self.keys.get(i)
    }

    /// Counts a request of about `tokens` tokens for key `i` and says
    /// whether it may go.
    pub async fn check(&self, i: usize, tokens: u64) -> Verdict {
        self.check_at(i, tokens, now()).await
    }

    /// [`Limiter::check`] at a given time (seconds since the epoch, with
    /// fraction).
    pub async fn check_at(&self, i: usize, tokens: u64, at: f64) -> Verdict {
        let Some(k) = self.keys.get(i) else {
            return Verdict {
                requests: None,
                tokens: None,
                over: None,
            };
        };
        if k.requests_per_minute.is_none() && k.tokens_per_minute.is_none() {
            return Verdict {
                requests: None,
                tokens: None,
                over: None,
            };
        }
        let window = (at / WINDOW.as_secs_f64()).floor() as u64;
        let reset = Duration::from_secs_f64(((window + 1) as f64) * WINDOW.as_secs_f64() - at);
        let (requests, used_tokens) = self.count(i, window, 1, tokens).await;
        let standing = |limit: Option<u64>, used: u64| {
            limit.map(|limit| Standing {
                limit,
                remaining: limit.saturating_sub(used),
                reset,
            })
        };
        // A request goes while the window has room: requests up to the
        // limit, tokens while some were left before it.
        let over = if k.requests_per_minute.is_some_and(|l| requests > l) {
            Some(Limit::Requests)
        } else if k
            .tokens_per_minute
            .is_some_and(|l| used_tokens.saturating_sub(tokens) >= l)
        {
            Some(Limit::Tokens)
        } else {
            None
        };
        if let Some(limit) = over {
            self.metrics
                .ratelimited
                .with_label_values(&[&k.name, limit.label()])
                .inc();
        }
        Verdict {
            requests: standing(k.requests_per_minute, requests),
            tokens: standing(k.tokens_per_minute, used_tokens),
            over,
        }
    }

    /// After the upstream's `usage`: the tokens the estimate missed are
    /// added to the current window (an overestimate is not given back).
    pub async fn correct(&self, i: usize, estimated: u64, actual: u64) {
        let Some(k) = self.keys.get(i) else { return };
        if k.tokens_per_minute.is_none() || actual <= estimated {
            return;
        }
        let window = (now() / WINDOW.as_secs_f64()).floor() as u64;
        self.count(i, window, 0, actual - estimated).await;
    }

    /// Adds to the key's two counters of `window`: in the shared store when
    /// there is one, else (or while it is down) here.
    async fn count(&self, i: usize, window: u64, requests: u64, tokens: u64) -> (u64, u64) {
        let name = self.keys.get(i).map_or("", |k| k.name.as_str());
        if self.store.is_shared() {
            let r = format!("{name}:r:{window}");
            let t = format!("{name}:t:{window}");
            // Past the window's end and a margin, the counters go.
            match self
                .store
                .count_window(&r, requests, &t, tokens, WINDOW + Duration::from_secs(5))
                .await
            {
                Ok(Some(counts)) => {
                    self.metrics.ratelimit_shared.set(1);
                    return counts;
                }
                Ok(None) => {}
                Err(_) => {
                    self.metrics.ratelimit_shared.set(0);
                    self.metrics.ratelimit_local_checks.inc();
                }
            }
        }
        let Ok(mut local) = self.local.lock() else {
            return (0, 0);
        };
        let mut add = |limit: Limit, n: u64| {
            let slot = local.entry((i, limit)).or_insert((window, 0));
            if slot.0 != window {
                *slot = (window, 0);
            }
            slot.1 = slot.1.saturating_add(n);
            slot.1
        };
        (add(Limit::Requests, requests), add(Limit::Tokens, tokens))
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn limiter(rpm: Option<u64>, tpm: Option<u64>) -> Limiter {
        let metrics = Arc::new(Metrics::new().unwrap());
        let mut b = globset::GlobSetBuilder::new();
        b.add(globset::Glob::new("gpt-*").unwrap());
        Limiter::new(
            vec![KeyLimits {
                name: "team-a".into(),
                requests_per_minute: rpm,
                tokens_per_minute: tpm,
                models: b.build().unwrap(),
                any_model: false,
            }],
            Arc::new(Store::memory(metrics.clone())),
            metrics,
        )
    }

    #[tokio::test]
    async fn requests_per_minute_hold_within_a_window_and_start_over_in_the_next() {
        let l = limiter(Some(3), None);
        let t0 = 6_000_000.0 + 10.0; // 10 s into a minute
        for n in 1..=3 {
            let v = l.check_at(0, 10, t0 + n as f64).await;
            assert_eq!(v.over, None);
            assert_eq!(v.requests.unwrap().remaining, 3 - n);
        }
        let v = l.check_at(0, 10, t0 + 4.0).await;
        assert_eq!(v.over, Some(Limit::Requests));
        let s = v.requests.unwrap();
        assert_eq!((s.limit, s.remaining), (3, 0));
        assert_eq!(s.reset, Duration::from_secs(46), "the window ends at 60 s");
        assert_eq!(
            l.metrics
                .ratelimited
                .with_label_values(&["team-a", "requests"])
                .get(),
            1
        );
        // The next minute starts over.
        assert_eq!(l.check_at(0, 10, t0 + 50.0).await.over, None);
    }

    #[tokio::test]
    async fn tokens_go_while_some_are_left_and_usage_corrects_the_estimate() {
        let l = limiter(None, Some(1000));
        let t = 6_000_000.0;
        assert_eq!(l.check_at(0, 600, t).await.over, None);
        // 600 used: 400 left, a request of 600 still goes…
        let v = l.check_at(0, 600, t + 1.0).await;
        assert_eq!(v.over, None);
        assert_eq!(v.tokens.unwrap().remaining, 0);
        // …and then none does.
        assert_eq!(l.check_at(0, 1, t + 2.0).await.over, Some(Limit::Tokens));
        // Correction adds what the estimate missed.
        let l = limiter(None, Some(1000));
        let now = now();
        l.check_at(0, 100, now).await;
        l.correct(0, 100, 1500).await;
        let v = l.check_at(0, 1, now).await;
        if (now / 60.0).floor() == (super::now() / 60.0).floor() {
            assert_eq!(v.over, Some(Limit::Tokens), "1500 used of 1000");
        }
    }

    #[test]
    fn models_are_globs_matched_in_lower_case() {
        let l = limiter(None, None);
        let k = l.key(0).unwrap();
        assert!(k.allows("GPT-4o"));
        assert!(!k.allows("claude-3"));
    }
}
