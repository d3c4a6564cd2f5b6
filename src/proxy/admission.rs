//! Admission: who may call, and what each `[[key]]` may spend. The auth
//! layer asks [`ProxyKeys`] for the caller; phase 3b of an HTTP request asks
//! [`Gate::grant`], and each input-carrying event of a WebSocket
//! [`Gate::admit`], whether the caller's `[[key]]` may send it now.

use std::sync::Arc;

use http::HeaderValue;

use super::headers::{Caller, ProxyKeys};
use crate::error::VisorError;
use crate::limits::{BYTES_PER_TOKEN, KeyLimits, Limit, Limiter, Standing, Verdict};
use crate::metrics::Metrics;

/// Who may call, and what each `[[key]]` may spend.
pub struct Gate {
    /// `server.api_keys` and the `[[key]]`s' keys.
    pub keys: Arc<ProxyKeys>,
    /// The `[[key]]` limits (counted in the store when it is shared).
    pub limits: Limiter,
    /// The `[[key]]` that has no key, if there is one: a caller without a
    /// key is held to it.
    pub keyless: Option<usize>,
    /// `sessions.max_depth`: a request with more messages is counted as
    /// long context.
    pub max_depth: usize,
    pub metrics: Arc<Metrics>,
}

/// What phase 3b let through: the caller's `[[key]]` (when it has one)
/// and the tokens its request was estimated at.
pub struct Grant {
    pub key: Option<usize>,
    /// The key's name for metrics (`api_keys`, or `none` without a key).
    pub label: Arc<str>,
    pub estimate: u64,
    /// Where the key's windows stand with this request counted: its
    /// `x-ratelimit-*` headers.
    pub standing: Option<Verdict>,
}

/// A request as phase 3b sees it.
pub struct Asking<'a> {
    pub caller: Caller,
    pub model: Option<&'a str>,
    /// The body's size, as sent or as declared.
    pub bytes: u64,
    /// False for a request without a body (a listing like `GET /v1/models`).
    pub bodied: bool,
}

impl Gate {
    /// The `[[key]]` a request is held to: its own, or — without a key —
    /// the `[[key]]` that has none, if there is one.
    pub fn caller_key(&self, extensions: &http::Extensions) -> Option<usize> {
        match extensions.get::<Caller>().copied() {
            Some(Caller::Key(i)) => Some(i),
            Some(Caller::Unlimited) => None,
            Some(Caller::Anonymous) | None => self.keyless,
        }
    }

    /// The name a caller is counted under: its `[[key]]`'s, `api_keys`
    /// for a `server.api_keys` key, `none` without a key.
    pub fn label(&self, caller: Caller, key: Option<usize>) -> Arc<str> {
        static NONE: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from("none"));
        static API_KEYS: std::sync::LazyLock<Arc<str>> =
            std::sync::LazyLock::new(|| Arc::from("api_keys"));
        match (caller, key.and_then(|i| self.limits.key(i))) {
            (_, Some(k)) => k.label.clone(),
            (Caller::Unlimited, None) => API_KEYS.clone(),
            _ => NONE.clone(),
        }
    }

    /// The limits of the `[[key]]` a request is held to, if it has any.
    pub fn held_to(&self, extensions: &http::Extensions) -> Option<&KeyLimits> {
        self.caller_key(extensions).and_then(|i| self.limits.key(i))
    }

    /// Phase 3b: the caller's `[[key]]` — a model outside its `models` is
    /// 403, a request over its limits 429 (with `Retry-After` and the
    /// `x-ratelimit-*` headers).
    pub async fn grant(&self, key: Option<usize>, ask: Asking<'_>) -> Result<Grant, VisorError> {
        let estimate = ask.bytes / BYTES_PER_TOKEN;
        let label = self.label(ask.caller, key);
        let Some(i) = key.filter(|&i| self.limits.key(i).is_some()) else {
            return Ok(Grant {
                key: None,
                label,
                estimate,
                standing: None,
            });
        };
        let standing = self.standing(i, ask.model, ask.bodied, estimate).await?;
        Ok(Grant {
            key: Some(i),
            label,
            estimate,
            standing,
        })
    }

    /// Whether `[[key]]` `i` may send a request for `model` estimated at
    /// `estimate` tokens now: 403 for a model outside its `models`, 429 over
    /// its limits (the request is counted in its window either way it
    /// goes). The HTTP path and each `response.create` of the WebSocket
    /// mode.
    pub async fn admit(
        &self,
        i: usize,
        model: Option<&str>,
        bodied: bool,
        estimate: u64,
    ) -> Result<(), VisorError> {
        self.standing(i, model, bodied, estimate).await.map(drop)
    }

    /// [`Gate::admit`], with the key's standing after the request when it
    /// goes (for its `x-ratelimit-*` headers).
    async fn standing(
        &self,
        i: usize,
        model: Option<&str>,
        bodied: bool,
        estimate: u64,
    ) -> Result<Option<Verdict>, VisorError> {
        let Some(k) = self.limits.key(i) else {
            return Ok(None);
        };
        if let Some(m) = model
            && !k.allows(m)
        {
            return Err(VisorError::ModelNotAllowed {
                key: k.name.clone(),
                model: m.to_owned(),
            });
        }
        if model.is_none() && !k.any_model && bodied {
            // A body whose model visor cannot find might name one to the
            // upstream (`MODEL` to a case-blind reader, a form part written
            // another way): a key limited to some models must name it
            // plainly.
            return Err(VisorError::Unroutable(format!(
                "key `{}` may use only some models, and this body names none visor can read",
                k.name
            )));
        }
        let verdict = self.limits.check(i, estimate).await;
        let Some(over) = verdict.over else {
            return Ok(Some(verdict));
        };
        Err(rate_limited(k, &verdict, over, estimate))
    }

    /// The body that goes is `bytes` long: when that is more than the
    /// estimate, the key is charged the rest, and refused (429, nothing
    /// sent) when its window has no room for all of it.
    pub async fn charge_sent(&self, grant: &mut Grant, bytes: u64) -> Result<(), VisorError> {
        let Some(i) = grant.key else { return Ok(()) };
        let sent = bytes / BYTES_PER_TOKEN;
        if sent <= grant.estimate {
            return Ok(());
        }
        let window = grant.standing.as_ref().map(|v| v.window);
        let more = sent - grant.estimate;
        let Some(verdict) = self.limits.charge_more(i, more, sent, window).await else {
            return Ok(());
        };
        if let (Some(over), Some(k)) = (verdict.over, self.limits.key(i)) {
            let mut verdict = verdict;
            verdict.requests = grant.standing.as_ref().and_then(|v| v.requests);
            return Err(rate_limited(k, &verdict, over, sent));
        }
        if let Some(v) = grant.standing.as_mut() {
            v.tokens = verdict.tokens;
        }
        grant.estimate = sent;
        Ok(())
    }

    /// The context a key sends: body bytes received, and the bytes dedup
    /// removed (context sent again).
    pub fn count_context(&self, grant: &Grant, report: &crate::transform::Report) {
        let m = &self.metrics;
        m.context_received
            .with_label_values(&[&grant.label])
            .inc_by(grant.estimate * BYTES_PER_TOKEN);
        if report.messages > self.max_depth {
            m.context_long.with_label_values(&[&grant.label]).inc();
        }
        if report.lines_omitted + report.items_omitted > 0 {
            m.context_resent
                .with_label_values(&[&grant.label])
                .inc_by(report.bytes_saved_dedup.max(0) as u64);
        }
    }
}

/// The 429 for a request over key `k`'s `over` limit: `Retry-After` and
/// the `x-ratelimit-*` headers of its standing.
pub fn rate_limited(k: &KeyLimits, verdict: &Verdict, over: Limit, asked: u64) -> VisorError {
    let headers = rate_limit_headers(verdict);
    let reset = verdict
        .requests
        .or(verdict.tokens)
        .map_or(60, |s| s.reset.as_secs().max(1));
    tracing::info!(key = %k.name, limit = over.label(), "rate limited");
    let detail = match (over, verdict.requests, verdict.tokens) {
        (Limit::Requests, Some(r), _) => {
            format!("{} requests per minute, all used", r.limit)
        }
        (Limit::Tokens, _, Some(t)) => format!(
            "this request is about {asked} tokens, and {} of its {} tokens per minute are left",
            t.remaining, t.limit
        ),
        _ => format!("{} per minute", over.label()),
    };
    VisorError::RateLimited {
        key: k.name.clone(),
        detail,
        retry_after_secs: reset,
        headers,
    }
}

/// The `x-ratelimit-*` headers of a key's standing, as OpenAI sends them:
/// on every answer to a request of a limited key, 429 or not.
pub fn rate_limit_headers(verdict: &Verdict) -> Vec<(&'static str, String)> {
    let mut headers = Vec::new();
    let mut add = |names: [&'static str; 3], s: Option<Standing>| {
        if let Some(s) = s {
            let [l, r, t] = names;
            headers.push((l, s.limit.to_string()));
            headers.push((r, s.remaining.to_string()));
            headers.push((t, format!("{}s", s.reset.as_secs().max(1))));
        }
    };
    add(
        [
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
        ],
        verdict.requests,
    );
    add(
        [
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
        ],
        verdict.tokens,
    );
    headers
}

/// A limited key's standing written into a response head, in place of the
/// provider's own (the key is what the client is held to).
pub fn write_standing(headers: &mut http::HeaderMap, standing: &Verdict) {
    for (name, value) in rate_limit_headers(standing) {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(name, value);
        }
    }
}
