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
    /// The name as metrics and summaries carry it (shared, not copied).
    pub label: std::sync::Arc<str>,
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    /// The models the key may use (globs, lower case).
    pub models: GlobSet,
    /// `models = ["*"]`: any model (a streamed body's model need not be
    /// read to check it).
    pub any_model: bool,
}

impl From<&crate::config::Key> for KeyLimits {
    /// The limits and models of a `[[key]]` as the config checked them.
    fn from(k: &crate::config::Key) -> Self {
        Self {
            name: k.name.clone(),
            label: std::sync::Arc::from(k.name.as_str()),
            requests_per_minute: k.requests_per_minute,
            tokens_per_minute: k.tokens_per_minute,
            models: k.matcher.clone(),
            any_model: k.any_model,
        }
    }
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
    /// The window the request's tokens were counted in.
    pub window: u64,
}

pub struct Limiter {
    keys: Vec<KeyLimits>,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    /// Per key: this replica's view of the current window.
    local: Mutex<HashMap<usize, Local>>,
}

/// Where a request's counts went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Counted {
    /// In the shared store.
    Shared,
    /// Here, with no shared store.
    Here,
    /// Here, the shared store away: added to it when it answers again.
    Unshared,
}

/// A key's window as this replica knows it: the counts the shared store
/// last said (or this replica's own, without one), plus what was counted
/// here while the store could not be reached — added to the store's
/// counters when it answers again, so a replica that lost the store for a
/// while neither forgets the window's earlier requests nor hides its own.
#[derive(Debug, Clone, Copy, Default)]
struct Local {
    window: u64,
    requests: u64,
    tokens: u64,
    /// Counted here, not yet in the shared store.
    unshared_requests: u64,
    unshared_tokens: u64,
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
                window: 0,
            };
        };
        if k.requests_per_minute.is_none() && k.tokens_per_minute.is_none() {
            return Verdict {
                requests: None,
                tokens: None,
                over: None,
                window: 0,
            };
        }
        let window = (at / WINDOW.as_secs_f64()).floor() as u64;
        let reset = Duration::from_secs_f64(((window + 1) as f64) * WINDOW.as_secs_f64() - at);
        let (requests, mut used_tokens, counted) = self.count(i, window, 1, tokens).await;
        // A request goes while the window has room for it: requests up to
        // the limit, tokens while its estimate fits in what is left.
        let over = if k.requests_per_minute.is_some_and(|l| requests > l) {
            Some(Limit::Requests)
        } else if k.tokens_per_minute.is_some_and(|l| used_tokens > l) {
            Some(Limit::Tokens)
        } else {
            None
        };
        // A refused request is counted as a request, but its tokens are not
        // spent.
        if over.is_some() && tokens > 0 && k.tokens_per_minute.is_some() {
            self.uncount(i, window, tokens, counted).await;
            used_tokens = used_tokens.saturating_sub(tokens);
        }
        let standing = |limit: Option<u64>, used: u64| {
            limit.map(|limit| Standing {
                limit,
                remaining: limit.saturating_sub(used),
                reset,
            })
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
            window,
        }
    }

    /// The body actually sent is larger than the one estimated (documents
    /// read, history inserted): the `extra` tokens are counted now, and the
    /// request may go only as [`Limiter::check`] would have let a request
    /// of `total` tokens go. `estimated_in`: the window the estimate was
    /// counted in (`None`: unknown), from which it is taken back too when
    /// the request is refused in that same window. `None` for a key without
    /// a token limit.
    pub async fn charge_more(
        &self,
        i: usize,
        extra: u64,
        total: u64,
        estimated_in: Option<u64>,
    ) -> Option<Verdict> {
        let k = self.keys.get(i)?;
        let limit = k.tokens_per_minute?;
        let at = now();
        let window = (at / WINDOW.as_secs_f64()).floor() as u64;
        let reset = Duration::from_secs_f64(((window + 1) as f64) * WINDOW.as_secs_f64() - at);
        let (_, mut used, counted) = self.count(i, window, 0, extra).await;
        let over = (used > limit).then_some(Limit::Tokens);
        if over.is_some() {
            // Not sent: none of its tokens are spent — the estimate's only
            // where it was counted (a window that has ended keeps it).
            let back = match estimated_in == Some(window) {
                true => total,
                false => extra,
            };
            self.uncount(i, window, back, counted).await;
            used = used.saturating_sub(back);
        }
        if let Some(limit) = over {
            self.metrics
                .ratelimited
                .with_label_values(&[&k.name, limit.label()])
                .inc();
        }
        Some(Verdict {
            requests: None,
            tokens: Some(Standing {
                limit,
                remaining: limit.saturating_sub(used),
                reset,
            }),
            over,
            window,
        })
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
    async fn count(
        &self,
        i: usize,
        window: u64,
        requests: u64,
        tokens: u64,
    ) -> (u64, u64, Counted) {
        let name = self.keys.get(i).map_or("", |k| k.name.as_str());
        if !self.store.is_shared() {
            let (r, t) = self.count_here(i, window, requests, tokens, false);
            return (r, t, Counted::Here);
        }
        // What this replica counted while the store was away goes in with
        // this request.
        let (held_r, held_t) = self.take_unshared(i, window);
        let r = format!("{name}:r:{window}");
        let t = format!("{name}:t:{window}");
        // Past the window's end and a margin, the counters go.
        let shared = self
            .store
            .count_window(
                &r,
                requests + held_r,
                &t,
                tokens + held_t,
                WINDOW + Duration::from_secs(5),
            )
            .await;
        if let Ok(Some((r, t))) = shared {
            self.metrics.ratelimit_shared.set(1);
            self.seen_shared(i, window, r, t);
            return (r, t, Counted::Shared);
        }
        self.give_back_unshared(i, window, held_r, held_t);
        self.metrics.ratelimit_shared.set(0);
        self.metrics.ratelimit_local_checks.inc();
        let (r, t) = self.count_here(i, window, requests, tokens, true);
        (r, t, Counted::Unshared)
    }

    /// Takes back `tokens` counted in `window` (where they were counted)
    /// for a request that did not go.
    async fn uncount(&self, i: usize, window: u64, tokens: u64, counted: Counted) {
        if counted == Counted::Shared {
            let name = self.keys.get(i).map_or("", |k| k.name.as_str());
            // A store gone again keeps them: the limit errs on the safe side.
            let _ = self
                .store
                .uncount_window(&format!("{name}:t:{window}"), tokens)
                .await;
        }
        if let Ok(mut local) = self.local.lock() {
            let slot = Self::window_here(&mut local, i, window);
            slot.tokens = slot.tokens.saturating_sub(tokens);
            if counted == Counted::Unshared {
                slot.unshared_tokens = slot.unshared_tokens.saturating_sub(tokens);
            }
        }
    }

    /// The key's window here, started over when `window` is a newer one.
    fn window_here(local: &mut HashMap<usize, Local>, i: usize, window: u64) -> &mut Local {
        let slot = local.entry(i).or_insert(Local {
            window,
            ..Local::default()
        });
        if slot.window != window {
            *slot = Local {
                window,
                ..Local::default()
            };
        }
        slot
    }

    /// Counts here; `unshared`: to be added to the shared store later.
    fn count_here(
        &self,
        i: usize,
        window: u64,
        requests: u64,
        tokens: u64,
        unshared: bool,
    ) -> (u64, u64) {
        let Ok(mut local) = self.local.lock() else {
            return (0, 0);
        };
        let slot = Self::window_here(&mut local, i, window);
        slot.requests = slot.requests.saturating_add(requests);
        slot.tokens = slot.tokens.saturating_add(tokens);
        if unshared {
            slot.unshared_requests = slot.unshared_requests.saturating_add(requests);
            slot.unshared_tokens = slot.unshared_tokens.saturating_add(tokens);
        }
        (slot.requests, slot.tokens)
    }

    fn take_unshared(&self, i: usize, window: u64) -> (u64, u64) {
        let Ok(mut local) = self.local.lock() else {
            return (0, 0);
        };
        let slot = Self::window_here(&mut local, i, window);
        (
            std::mem::take(&mut slot.unshared_requests),
            std::mem::take(&mut slot.unshared_tokens),
        )
    }

    fn give_back_unshared(&self, i: usize, window: u64, requests: u64, tokens: u64) {
        if let Ok(mut local) = self.local.lock() {
            let slot = Self::window_here(&mut local, i, window);
            slot.unshared_requests = slot.unshared_requests.saturating_add(requests);
            slot.unshared_tokens = slot.unshared_tokens.saturating_add(tokens);
        }
    }

    /// The shared store's counts of the window, as this replica's view.
    fn seen_shared(&self, i: usize, window: u64, requests: u64, tokens: u64) {
        if let Ok(mut local) = self.local.lock() {
            let slot = Self::window_here(&mut local, i, window);
            slot.requests = slot.requests.max(requests);
            slot.tokens = slot.tokens.max(tokens);
        }
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
                label: "team-a".into(),
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
    async fn tokens_go_while_the_estimate_fits_and_usage_corrects_it() {
        let l = limiter(None, Some(1000));
        let t = 6_000_000.0;
        assert_eq!(l.check_at(0, 600, t).await.over, None);
        // 400 left: a request of 600 does not go, and spends none of them…
        let v = l.check_at(0, 600, t + 1.0).await;
        assert_eq!(v.over, Some(Limit::Tokens));
        assert_eq!(v.tokens.unwrap().remaining, 400);
        // …so one of 400 still does, and then none.
        let v = l.check_at(0, 400, t + 2.0).await;
        assert_eq!(v.over, None);
        assert_eq!(v.tokens.unwrap().remaining, 0);
        assert_eq!(l.check_at(0, 1, t + 3.0).await.over, Some(Limit::Tokens));
        // One larger than the whole limit never goes.
        let l = limiter(None, Some(1000));
        assert_eq!(l.check_at(0, 1001, t).await.over, Some(Limit::Tokens));
        assert_eq!(l.check_at(0, 1000, t).await.over, None);
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

    #[tokio::test]
    async fn a_body_larger_than_estimated_is_charged_and_may_be_refused() {
        let l = limiter(None, Some(1000));
        let now = now();
        let v0 = l.check_at(0, 100, now).await;
        assert_eq!(v0.over, None);
        // Sent 300 (documents read): 200 more, within the limit.
        let v = l.charge_more(0, 200, 300, Some(v0.window)).await.unwrap();
        assert_eq!(v.over, None);
        let same_window = |v: &Verdict| {
            (now / 60.0).floor() == (super::now() / 60.0).floor() && v.tokens.is_some()
        };
        if same_window(&v) {
            assert_eq!(v.tokens.unwrap().remaining, 700);
        }
        // Sent 5000 for an estimate of 100: refused, nothing spent.
        let v1 = l.check_at(0, 100, now).await;
        assert_eq!(v1.over, None);
        let v = l.charge_more(0, 4900, 5000, Some(v1.window)).await.unwrap();
        assert_eq!(v.over, Some(Limit::Tokens));
        if same_window(&v) {
            assert_eq!(v.tokens.unwrap().remaining, 700);
        }
        // A key without a token limit is not charged.
        assert!(
            limiter(Some(5), None)
                .charge_more(0, 10, 10, None)
                .await
                .is_none()
        );
    }

    #[test]
    fn models_are_globs_matched_in_lower_case() {
        let l = limiter(None, None);
        let k = l.key(0).unwrap();
        assert!(k.allows("GPT-4o"));
        assert!(!k.allows("claude-3"));
    }
}
