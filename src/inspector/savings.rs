//! What a request cost and what visor saved it, in tokens and money, and
//! the same summed per key and per model over the kept window.
//!
//! Saved tokens are estimates, by rule:
//! - `images`: images every model would have paid for, removed (aged out,
//!   capped, deduped) — w·h/750 tokens each, at most 1,600 (Anthropic's
//!   formula), 765 when the size is unknown. Images replaced for a model
//!   that cannot see them are fitted, not saved: it could not take them.
//! - `dedup`: the bytes dedup removed, at 4 bytes a token.
//! - `cache`: prompt tokens read from the provider's cache when visor
//!   placed the breakpoints (the client had set none: without them nothing
//!   was cached) — saved at the difference between the input and the
//!   cached-input price. OpenAI-kind caches read on their own, so a
//!   `prompt_cache_key` visor adds is not counted as a saving.
//!
//! Money needs the model's prices (the model table's `input`,
//! `cached_input`, `cache_write`, `output` per million tokens); a model
//! without them shows tokens only.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Summary;
use crate::limits::BYTES_PER_TOKEN;
use crate::transform::ImageNote;

/// Prices per million tokens.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq)]
pub struct Prices {
    pub input: f64,
    pub cached_input: Option<f64>,
    pub cache_write: Option<f64>,
    pub output: f64,
}

/// One request's saving.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq)]
#[serde(default)]
pub struct Saving {
    /// All rules together.
    pub tokens: u64,
    pub images: u64,
    pub dedup: u64,
    /// Read from the cache at visor's breakpoints.
    pub cache: u64,
    /// In dollars, with prices.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub money: Option<f64>,
}

/// An image as many tokens as a provider bills for it (Anthropic's w·h/750,
/// at most 1,600 after its own downscale), 765 unknown.
fn image_tokens(n: &ImageNote) -> u64 {
    match (n.width, n.height) {
        (Some(w), Some(h)) => ((w as u64 * h as u64) / 750).clamp(1, 1600),
        _ => 765,
    }
}

/// The saving of one request, from what visor did and what the provider
/// said.
pub fn saving(notes: &[ImageNote], dedup_bytes: i64, visor_cached: bool, s: &Summary) -> Saving {
    let images = notes
        .iter()
        .filter(|n| matches!(n.action, "aged_out" | "capped" | "deduped") && n.medium == "image")
        .map(image_tokens)
        .fold(0u64, u64::saturating_add);
    let dedup = dedup_bytes.max(0) as u64 / BYTES_PER_TOKEN;
    let cache = match (visor_cached, s.tokens) {
        (true, Some(t)) => t.cached_read,
        _ => 0,
    };
    let money = s.prices.map(|p| {
        let read_discount = p.input - p.cached_input.unwrap_or(p.input);
        ((images + dedup) as f64 * p.input + cache as f64 * read_discount) / 1e6
    });
    Saving {
        tokens: images.saturating_add(dedup).saturating_add(cache),
        images,
        dedup,
        cache,
        money,
    }
}

/// What the provider billed, in dollars, when the model has prices and
/// the provider said its usage. Anthropic's `input_tokens` leave out the
/// cache's reads and writes; OpenAI's `prompt_tokens` hold the reads.
pub fn cost(s: &Summary) -> Option<f64> {
    let (p, t) = (s.prices?, s.tokens?);
    let anthropic = s.endpoint == "/v1/messages";
    let uncached = match anthropic {
        true => t.prompt,
        false => t.prompt.saturating_sub(t.cached_read),
    };
    let read = t.cached_read as f64 * p.cached_input.unwrap_or(p.input);
    // Without a cache-write price: Anthropic's 1.25 times the input's.
    let written = t.cache_written as f64 * p.cache_write.unwrap_or(p.input * 1.25);
    Some((uncached as f64 * p.input + read + written + t.completion as f64 * p.output) / 1e6)
}

/// The prompt tokens a request sent in all (read from the cache included).
pub fn prompt_total(s: &Summary) -> u64 {
    let Some(t) = s.tokens else { return 0 };
    match s.endpoint == "/v1/messages" {
        true => t
            .prompt
            .saturating_add(t.cached_read)
            .saturating_add(t.cache_written),
        false => t.prompt,
    }
}

/// One key's or one model's sums.
#[derive(Debug, Clone, Serialize, Default, PartialEq)]
pub struct Sums {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_read: u64,
    pub completion_tokens: u64,
    pub saved: Saving,
    /// Prompt tokens read from the cache, of all prompt tokens.
    pub cache_read_ratio: f64,
    /// Dollars billed (requests with prices only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
}

impl Sums {
    fn add(&mut self, s: &Summary) {
        let t = s.tokens.unwrap_or_default();
        let plus = |a: &mut u64, b: u64| *a = a.saturating_add(b);
        plus(&mut self.requests, 1);
        plus(&mut self.prompt_tokens, prompt_total(s));
        plus(&mut self.cached_read, t.cached_read);
        plus(&mut self.completion_tokens, t.completion);
        let v = &s.saving;
        plus(&mut self.saved.tokens, v.tokens);
        plus(&mut self.saved.images, v.images);
        plus(&mut self.saved.dedup, v.dedup);
        plus(&mut self.saved.cache, v.cache);
        if let Some(m) = v.money {
            *self.saved.money.get_or_insert(0.0) += m;
        }
        if let Some(c) = s.cost {
            *self.cost.get_or_insert(0.0) += c;
        }
        self.cache_read_ratio = match self.prompt_tokens {
            0 => 0.0,
            p => self.cached_read as f64 / p as f64,
        };
    }
}

/// A span of the window.
#[derive(Debug, Clone, Serialize, Default, PartialEq)]
pub struct Bucket {
    pub from_ms: u64,
    pub sums: Sums,
}

/// The savings over the kept window.
#[derive(Debug, Clone, Serialize, Default, PartialEq)]
pub struct Savings {
    pub from_ms: u64,
    pub to_ms: u64,
    pub all: Sums,
    pub by_key: BTreeMap<String, Sums>,
    pub by_model: BTreeMap<String, Sums>,
    /// The window cut in [`BUCKETS`] spans, oldest first.
    pub over_time: Vec<Bucket>,
}

/// Spans of the chart over time.
pub const BUCKETS: usize = 24;

/// Sums `list` (any order).
pub fn savings<'a>(list: impl Iterator<Item = &'a Summary> + Clone) -> Savings {
    let mut out = Savings {
        from_ms: list.clone().map(|s| s.time_ms).min().unwrap_or(0),
        to_ms: list.clone().map(|s| s.time_ms).max().unwrap_or(0),
        ..Savings::default()
    };
    let span = (out.to_ms - out.from_ms) / BUCKETS as u64 + 1;
    if out.to_ms > 0 {
        out.over_time = (0..BUCKETS)
            .map(|i| Bucket {
                from_ms: out.from_ms + i as u64 * span,
                sums: Sums::default(),
            })
            .collect();
    }
    for s in list {
        out.all.add(s);
        out.by_key.entry(s.key.to_string()).or_default().add(s);
        out.by_model.entry(s.model.clone()).or_default().add(s);
        let i = ((s.time_ms - out.from_ms) / span) as usize;
        if let Some(b) = out.over_time.get_mut(i.min(BUCKETS - 1)) {
            b.sums.add(s);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::Tokens;
    use super::*;

    fn priced(endpoint: &str, t: Tokens) -> Summary {
        Summary {
            endpoint: endpoint.to_owned().into(),
            tokens: Some(t),
            prices: Some(Prices {
                input: 3.0,
                cached_input: Some(0.3),
                cache_write: Some(3.75),
                output: 15.0,
            }),
            ..Summary::default()
        }
    }

    #[test]
    fn cost_reads_each_provider_as_it_counts() {
        let t = Tokens {
            prompt: 1_000_000,
            cached_read: 1_000_000,
            cache_written: 0,
            completion: 100_000,
        };
        // Anthropic: 1M uncached + 1M read; OpenAI: the 1M includes the read.
        let a = cost(&priced("/v1/messages", t)).unwrap();
        assert!((a - (3.0 + 0.3 + 1.5)).abs() < 1e-9, "{a}");
        let o = cost(&priced("/v1/chat/completions", t)).unwrap();
        assert!((o - (0.3 + 1.5)).abs() < 1e-9, "{o}");
        let mut no_prices = priced("/v1/messages", t);
        no_prices.prices = None;
        assert!(cost(&no_prices).is_none());
    }

    #[test]
    fn savings_by_rule_and_money() {
        let t = Tokens {
            prompt: 500,
            cached_read: 10_000,
            cache_written: 0,
            completion: 5,
        };
        let s = priced("/v1/messages", t);
        let mut aged = crate::inspector::detail::tests_note("aged_out");
        aged.width = Some(1500);
        aged.height = Some(1000);
        let stripped = crate::inspector::detail::tests_note("stripped");
        let v = saving(&[aged, stripped], 4000, true, &s);
        assert_eq!(
            (v.images, v.dedup, v.cache, v.tokens),
            (1600, 1000, 10_000, 12_600)
        );
        let money = v.money.unwrap();
        assert!((money - (2600.0 * 3.0 + 10_000.0 * 2.7) / 1e6).abs() < 1e-12);
        // The cache is visor's only where visor placed the breakpoints.
        assert_eq!(saving(&[], 0, false, &s).tokens, 0);
    }

    #[test]
    fn sums_per_key_model_and_time() {
        let mut list = Vec::new();
        for i in 0..4u64 {
            let mut s = priced(
                "/v1/chat/completions",
                Tokens {
                    prompt: 100,
                    cached_read: 50,
                    cache_written: 0,
                    completion: 1,
                },
            );
            s.time_ms = 1_000 + i * 1000;
            s.key = if i % 2 == 0 { "a" } else { "b" }.into();
            s.model = "m".to_owned();
            s.saving.tokens = 10;
            list.push(s);
        }
        let v = savings(list.iter());
        assert_eq!(v.all.requests, 4);
        assert_eq!(v.by_key["a"].requests, 2);
        assert_eq!(v.by_model["m"].saved.tokens, 40);
        assert!((v.all.cache_read_ratio - 0.5).abs() < 1e-9);
        assert_eq!(v.over_time.len(), BUCKETS);
        assert_eq!(v.over_time.iter().map(|b| b.sums.requests).sum::<u64>(), 4);
        assert_eq!(v.over_time[BUCKETS - 1].sums.requests, 1);
        assert_eq!(savings([].iter()).all.requests, 0);
    }
}
