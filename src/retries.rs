//! What lets a request fall back to another upstream, and what stops it:
//! the retry [`Budget`] (retries at most a share of the last minute's
//! requests, so a failing provider does not double the load on the next)
//! and a per-upstream circuit [`Breaker`] (open after N consecutive
//! failures, then one probe request after a cooldown).
//!
//! Pure bookkeeping on [`tokio::time::Instant`] (tests run on paused time);
//! the proxy asks and reports, this module never sends anything.

use std::sync::Mutex;
use std::time::Duration;

use prometheus::IntGauge;
use tokio::time::Instant;

use crate::config;

/// The budget's window.
pub const WINDOW: Duration = Duration::from_secs(60);
/// One slot per second of the window.
const SLOTS: usize = 60;

/// The longest a 429's `Retry-After` keeps its upstream skipped.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(10);

/// Retries at most `percent` % of the requests of the last minute, or
/// `floor` a minute, whichever is more.
pub struct Budget {
    percent: u64,
    floor: u64,
    epoch: Instant,
    window: Mutex<Window>,
}

struct Window {
    /// The second (since `epoch`) of the newest slot written.
    last: u64,
    requests: [u32; SLOTS],
    retries: [u32; SLOTS],
}

impl Window {
    /// Clears the slots of the seconds between the newest slot and `now`.
    fn advance(&mut self, now: u64) {
        if now <= self.last {
            return;
        }
        let gap = (now - self.last).min(SLOTS as u64);
        for k in 1..=gap {
            let slot = ((self.last + k) % SLOTS as u64) as usize;
            self.requests[slot] = 0;
            self.retries[slot] = 0;
        }
        self.last = now;
    }

    fn slot(&self) -> usize {
        (self.last % SLOTS as u64) as usize
    }
}

impl Budget {
    pub fn new(percent: u32, floor: u32) -> Self {
        Budget {
            percent: u64::from(percent),
            floor: u64::from(floor),
            epoch: Instant::now(),
            window: Mutex::new(Window {
                last: 0,
                requests: [0; SLOTS],
                retries: [0; SLOTS],
            }),
        }
    }

    fn second(&self) -> u64 {
        Instant::now()
            .saturating_duration_since(self.epoch)
            .as_secs()
    }

    /// A request that may be retried arrived.
    pub fn record_request(&self) {
        let now = self.second();
        if let Ok(mut w) = self.window.lock() {
            w.advance(now);
            let s = w.slot();
            w.requests[s] = w.requests[s].saturating_add(1);
        }
    }

    /// Takes one retry from the budget; false when it is spent.
    pub fn try_retry(&self) -> bool {
        let now = self.second();
        let Ok(mut w) = self.window.lock() else {
            return false;
        };
        w.advance(now);
        let requests: u64 = w.requests.iter().map(|&n| u64::from(n)).sum();
        let retries: u64 = w.retries.iter().map(|&n| u64::from(n)).sum();
        // The share of the window's requests, or the floor: whichever is more.
        if retries * 100 >= (self.floor * 100).max(requests * self.percent) {
            return false;
        }
        let s = w.slot();
        w.retries[s] = w.retries[s].saturating_add(1);
        true
    }
}

/// A breaker's state, as `visor_upstream_state` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed = 0,
    Open = 1,
    HalfOpen = 2,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    Closed,
    Open {
        until: Instant,
    },
    /// One probe request is out.
    HalfOpen,
}

/// What a breaker says to a request that would go to its upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Closed: go.
    Go,
    /// The cooldown has passed: this request is the one probe.
    Probe,
    /// Open (or a probe is out): skip this upstream.
    Skip,
}

/// One upstream's circuit breaker.
pub struct Breaker {
    failures_to_open: u32,
    cooldown: Duration,
    inner: Mutex<Inner>,
    gauge: Option<IntGauge>,
}

struct Inner {
    phase: Phase,
    /// Consecutive failures while closed.
    failures: u32,
}

impl Breaker {
    pub fn new(failures_to_open: u32, cooldown: Duration, gauge: Option<IntGauge>) -> Self {
        if let Some(g) = &gauge {
            g.set(State::Closed as i64);
        }
        Breaker {
            failures_to_open: failures_to_open.max(1),
            cooldown,
            inner: Mutex::new(Inner {
                phase: Phase::Closed,
                failures: 0,
            }),
            gauge,
        }
    }

    fn set(&self, inner: &mut Inner, phase: Phase) {
        inner.phase = phase;
        if let Some(g) = &self.gauge {
            g.set(state_of(phase) as i64);
        }
    }

    pub fn state(&self) -> State {
        self.inner
            .lock()
            .map_or(State::Closed, |i| state_of(i.phase))
    }

    /// May a request go to this upstream now?
    pub fn admit(&self) -> Admit {
        let Ok(mut inner) = self.inner.lock() else {
            return Admit::Go;
        };
        match inner.phase {
            Phase::Closed => Admit::Go,
            Phase::HalfOpen => Admit::Skip,
            Phase::Open { until } if Instant::now() < until => Admit::Skip,
            Phase::Open { .. } => {
                self.set(&mut inner, Phase::HalfOpen);
                Admit::Probe
            }
        }
    }

    /// The upstream answered (a head that is no 5xx or 429): closed.
    pub fn success(&self) {
        if let Ok(mut inner) = self.inner.lock() {
            inner.failures = 0;
            if !matches!(inner.phase, Phase::Closed) {
                self.set(&mut inner, Phase::Closed);
            }
        }
    }

    /// The upstream failed before its head (or answered 5xx or 429). `hold`:
    /// skip it at least this long whatever the count (a 429's
    /// `Retry-After`, already bounded).
    pub fn failure(&self, hold: Option<Duration>) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        let now = Instant::now();
        let held = hold.map(|h| now + h);
        match inner.phase {
            Phase::Closed => {
                inner.failures = inner.failures.saturating_add(1);
                let opened = (inner.failures >= self.failures_to_open).then(|| now + self.cooldown);
                if let Some(until) = opened.max(held) {
                    inner.failures = 0;
                    self.set(&mut inner, Phase::Open { until });
                }
            }
            Phase::HalfOpen => {
                let until = (now + self.cooldown).max(held.unwrap_or(now));
                self.set(&mut inner, Phase::Open { until });
            }
            Phase::Open { until } => {
                let until = until.max(held.unwrap_or(until));
                self.set(&mut inner, Phase::Open { until });
            }
        }
    }

    /// A probe ended with no verdict (its client left, or visor refused the
    /// request itself): the next request probes instead.
    pub fn probe_abandoned(&self) {
        if let Ok(mut inner) = self.inner.lock()
            && matches!(inner.phase, Phase::HalfOpen)
        {
            let until = Instant::now();
            self.set(&mut inner, Phase::Open { until });
        }
    }
}

fn state_of(phase: Phase) -> State {
    match phase {
        Phase::Closed => State::Closed,
        Phase::Open { .. } => State::Open,
        Phase::HalfOpen => State::HalfOpen,
    }
}

/// One attempt at an upstream, holding its breaker's admission: report
/// [`Attempt::succeeded`] or [`Attempt::failed`]; a probe dropped without
/// either lets the next request probe.
pub struct Attempt<'a> {
    breaker: &'a Breaker,
    probe: bool,
    done: bool,
}

impl Attempt<'_> {
    pub fn succeeded(mut self) {
        self.done = true;
        self.breaker.success();
    }

    pub fn failed(mut self, hold: Option<Duration>) {
        self.done = true;
        self.breaker.failure(hold);
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if !self.done && self.probe {
            self.breaker.probe_abandoned();
        }
    }
}

/// The budget and every upstream's breaker.
pub struct Retries {
    pub budget: Budget,
    breakers: Vec<Breaker>,
}

impl Retries {
    /// `gauge(i)`: where upstream `i`'s breaker shows its state, if anywhere.
    pub fn new(
        cfg: &config::Retries,
        upstreams: usize,
        gauge: impl Fn(usize) -> Option<IntGauge>,
    ) -> Self {
        Retries {
            budget: Budget::new(cfg.budget_percent, cfg.min_retries_per_minute),
            breakers: (0..upstreams)
                .map(|i| Breaker::new(cfg.breaker_failures, cfg.breaker_cooldown, gauge(i)))
                .collect(),
        }
    }

    pub fn breaker(&self, upstream: usize) -> Option<&Breaker> {
        self.breakers.get(upstream)
    }

    /// An attempt at `upstream` if its breaker lets one through now.
    pub fn admit(&self, upstream: usize) -> Option<Attempt<'_>> {
        let breaker = self.breakers.get(upstream)?;
        match breaker.admit() {
            Admit::Go => Some(Attempt {
                breaker,
                probe: false,
                done: false,
            }),
            Admit::Probe => Some(Attempt {
                breaker,
                probe: true,
                done: false,
            }),
            Admit::Skip => None,
        }
    }

    /// An attempt at `upstream` whatever its breaker says (every upstream of
    /// a chain is open: the first is tried anyway).
    pub fn force(&self, upstream: usize) -> Option<Attempt<'_>> {
        let breaker = self.breakers.get(upstream)?;
        Some(Attempt {
            breaker,
            probe: false,
            done: false,
        })
    }
}

/// A 429's `Retry-After` as a hold, bounded by [`MAX_RETRY_AFTER`]:
/// delta-seconds; an HTTP date (or anything else) counts as the bound.
pub fn retry_after(value: Option<&http::HeaderValue>) -> Option<Duration> {
    let v = value?.to_str().ok()?.trim();
    let d = match v.parse::<u64>() {
        Ok(secs) => Duration::from_secs(secs),
        Err(_) => MAX_RETRY_AFTER,
    };
    (!d.is_zero()).then(|| d.min(MAX_RETRY_AFTER))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[tokio::test(start_paused = true)]
    async fn budget_allows_a_share_of_recent_requests() {
        let b = Budget::new(20, 0);
        assert!(!b.try_retry(), "no requests, no floor: no retry");
        for _ in 0..10 {
            b.record_request();
        }
        assert!(b.try_retry());
        assert!(b.try_retry());
        assert!(!b.try_retry(), "20 % of 10 is 2");
        // Half a minute later: still the same window.
        tokio::time::advance(secs(30)).await;
        assert!(!b.try_retry());
        for _ in 0..5 {
            b.record_request();
        }
        assert!(b.try_retry(), "20 % of 15 is 3");
        assert!(!b.try_retry());
        // The first ten requests and two retries leave the window.
        tokio::time::advance(secs(31)).await;
        assert!(!b.try_retry(), "5 requests, 1 retry left in the window");
        tokio::time::advance(secs(60)).await;
        for _ in 0..5 {
            b.record_request();
        }
        assert!(b.try_retry());
        assert!(!b.try_retry());
    }

    #[tokio::test(start_paused = true)]
    async fn budget_floor_lets_a_quiet_visor_retry() {
        let b = Budget::new(20, 2);
        b.record_request();
        assert!(b.try_retry());
        assert!(b.try_retry());
        assert!(!b.try_retry());
        tokio::time::advance(WINDOW + secs(1)).await;
        assert!(b.try_retry());
    }

    #[tokio::test(start_paused = true)]
    async fn breaker_opens_after_n_failures_then_probes_once() {
        let gauge = IntGauge::new("g", "g").unwrap();
        let br = Breaker::new(3, secs(30), Some(gauge.clone()));
        br.failure(None);
        br.failure(None);
        br.success(); // consecutive failures only
        br.failure(None);
        br.failure(None);
        assert_eq!(br.admit(), Admit::Go);
        br.failure(None);
        assert_eq!(br.state(), State::Open);
        assert_eq!(gauge.get(), 1);
        assert_eq!(br.admit(), Admit::Skip);
        tokio::time::advance(secs(29)).await;
        assert_eq!(br.admit(), Admit::Skip);
        tokio::time::advance(secs(1)).await;
        assert_eq!(br.admit(), Admit::Probe);
        assert_eq!(gauge.get(), 2);
        assert_eq!(br.admit(), Admit::Skip, "one probe at a time");
        br.failure(None);
        assert_eq!(br.state(), State::Open, "a failed probe opens it again");
        tokio::time::advance(secs(30)).await;
        assert_eq!(br.admit(), Admit::Probe);
        br.success();
        assert_eq!(br.state(), State::Closed);
        assert_eq!(gauge.get(), 0);
        assert_eq!(br.admit(), Admit::Go);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hold_skips_the_upstream_for_its_time() {
        let br = Breaker::new(5, secs(30), None);
        br.failure(Some(secs(2)));
        assert_eq!(br.admit(), Admit::Skip);
        tokio::time::advance(secs(2)).await;
        assert_eq!(br.admit(), Admit::Probe);
        br.success();
        assert_eq!(br.admit(), Admit::Go);
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_probe_lets_the_next_request_probe() {
        let cfg = config::Retries {
            budget_percent: 20,
            min_retries_per_minute: 0,
            breaker_failures: 1,
            breaker_cooldown: secs(5),
        };
        let r = Retries::new(&cfg, 1, |_| None);
        r.admit(0).unwrap().failed(None);
        assert!(r.admit(0).is_none());
        tokio::time::advance(secs(5)).await;
        let probe = r.admit(0).unwrap();
        assert!(r.admit(0).is_none());
        drop(probe);
        let probe = r.admit(0).unwrap();
        probe.succeeded();
        assert_eq!(r.breaker(0).unwrap().state(), State::Closed);
        // A forced attempt reports like any other.
        r.force(0).unwrap().failed(None);
        assert_eq!(r.breaker(0).unwrap().state(), State::Open);
    }

    #[test]
    fn retry_after_is_bounded() {
        let h = |s: &'static str| http::HeaderValue::from_static(s);
        assert_eq!(retry_after(Some(&h("3"))), Some(secs(3)));
        assert_eq!(retry_after(Some(&h("120"))), Some(MAX_RETRY_AFTER));
        assert_eq!(
            retry_after(Some(&h("Wed, 21 Oct 2015 07:28:00 GMT"))),
            Some(MAX_RETRY_AFTER)
        );
        assert_eq!(retry_after(Some(&h("0"))), None);
        assert_eq!(retry_after(None), None);
    }
}
