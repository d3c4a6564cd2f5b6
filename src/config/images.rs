//! `[images]`: what becomes of images — replaced for models that cannot
//! see them, aged out, capped, deduplicated — and the phrases that say a
//! model takes none.

use std::fmt;
use std::path::PathBuf;

use serde::Deserialize;

use super::Problems;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawImages {
    #[serde(default = "default_non_vision")]
    pub non_vision: String,
    #[serde(default = "default_keep_turns")]
    pub keep_turns: u32,
    #[serde(default = "default_max_per_request")]
    pub max_per_request: u32,
    #[serde(default = "default_true")]
    pub dedupe: bool,
    /// The provider bills a re-sent prompt prefix at about a tenth (OpenAI,
    /// Anthropic, DeepSeek, vLLM prefix caching): an image already sent is
    /// aged out or capped only when that makes the request cheaper. False:
    /// every input token costs the same each turn, so ageing always pays.
    #[serde(default = "default_true")]
    pub prompt_cache: bool,
    /// Whatever the cache: when a request's estimated tokens pass this
    /// fraction of the model's `context_window`, the images due age out at
    /// that request (0 < f ≤ 1).
    #[serde(default = "default_context_fraction")]
    pub context_fraction: f64,
    #[serde(default)]
    pub artifacts_dir: Option<String>,
    /// A model that can see: an image larger than the size its provider
    /// reads it at (the table's `image_tokens` formula) is scaled down to
    /// that size before it is sent. Nothing the model sees changes; bytes
    /// and upload time are saved.
    #[serde(default = "default_true")]
    pub provider_size: bool,
    /// Opt-in token diet: images sent to a model that can see are scaled
    /// to at most this long edge.
    #[serde(default)]
    pub max_edge: Option<u32>,
    /// Opt-in token diet: images are scaled until the provider's token
    /// formula for the model says at most this many tokens.
    #[serde(default)]
    pub max_image_tokens: Option<u32>,
    /// Phrases (case-insensitive) that mark an upstream's 4xx answer as
    /// "this model does not take images": visor then retries once with the
    /// images replaced and learns the model.
    #[serde(default = "default_refusal_phrases")]
    pub refusal_phrases: Vec<String>,
}

impl Default for RawImages {
    fn default() -> Self {
        Self {
            non_vision: default_non_vision(),
            keep_turns: default_keep_turns(),
            max_per_request: default_max_per_request(),
            dedupe: true,
            prompt_cache: true,
            context_fraction: default_context_fraction(),
            artifacts_dir: None,
            provider_size: true,
            max_edge: None,
            max_image_tokens: None,
            refusal_phrases: default_refusal_phrases(),
        }
    }
}

/// How providers and servers say "no images for this model" (OpenAI, vLLM,
/// DeepSeek, OpenRouter, Ollama, LiteLLM, llama.cpp, TGI phrasings).
pub fn default_refusal_phrases() -> Vec<String> {
    [
        "image_url is only supported by certain models",
        "does not support image",
        "doesn't support image",
        "image input is not supported",
        "image inputs are not supported",
        "images are not supported",
        "image content is not supported",
        "does not support vision",
        "vision is not supported",
        "not a multimodal model",
        "does not support multimodal",
        "multimodal input is not supported",
        "unknown variant `image_url`",
        "unknown variant `image`",
        "no endpoints found that support image input",
        "image input not supported",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect()
}

fn default_non_vision() -> String {
    "describe".to_owned()
}
fn default_keep_turns() -> u32 {
    2
}
fn default_max_per_request() -> u32 {
    10
}
fn default_context_fraction() -> f64 {
    0.8
}
fn default_true() -> bool {
    true
}

/// What replaces an image a model cannot see (`images.non_vision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NonVision {
    /// A description by the `[describer]` model.
    Describe,
    /// A placeholder.
    Strip,
}

impl fmt::Display for NonVision {
    /// As written in the config.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NonVision::Describe => "describe",
            NonVision::Strip => "strip",
        })
    }
}

/// `[images]`, checked.
#[derive(Debug, Clone)]
pub struct Images {
    pub non_vision: NonVision,
    pub keep_turns: u32,
    pub max_per_request: u32,
    pub dedupe: bool,
    /// See [`RawImages::prompt_cache`].
    pub prompt_cache: bool,
    /// See [`RawImages::context_fraction`].
    pub context_fraction: f64,
    pub artifacts_dir: Option<PathBuf>,
    /// See [`RawImages::provider_size`].
    pub provider_size: bool,
    /// See [`RawImages::max_edge`] and [`RawImages::max_image_tokens`].
    pub max_edge: Option<u32>,
    pub max_image_tokens: Option<u32>,
    /// See [`RawImages::refusal_phrases`]; lower case, matched against an
    /// answer lower-cased.
    pub refusal_phrases: Vec<String>,
}

impl RawImages {
    pub(super) fn validate(self, p: &mut Problems) -> Images {
        let non_vision = p
            .one_of(
                "images.non_vision",
                &self.non_vision,
                &[
                    ("describe", NonVision::Describe),
                    ("strip", NonVision::Strip),
                ],
            )
            .unwrap_or(NonVision::Describe);
        for (i, ph) in self.refusal_phrases.iter().enumerate() {
            if ph.trim().is_empty() {
                p.bad(
                    format_args!("images.refusal_phrases[{i}]"),
                    "\"\"",
                    "a phrase must not be empty",
                );
            }
        }
        p.at_least_one("images.max_per_request", self.max_per_request.into());
        if let Some(e) = self.max_edge {
            p.at_least_one("images.max_edge", e.into());
        }
        if let Some(t) = self.max_image_tokens {
            p.at_least_one("images.max_image_tokens", t.into());
        }
        // NaN is not a fraction either.
        let fraction = self.context_fraction > 0.0 && self.context_fraction <= 1.0;
        if !fraction {
            p.bad(
                "images.context_fraction",
                self.context_fraction,
                "must be a fraction of the context window, more than 0 and at most 1",
            );
        }
        Images {
            non_vision,
            keep_turns: self.keep_turns,
            max_per_request: self.max_per_request,
            dedupe: self.dedupe,
            prompt_cache: self.prompt_cache,
            context_fraction: self.context_fraction,
            artifacts_dir: self.artifacts_dir.map(PathBuf::from),
            provider_size: self.provider_size,
            max_edge: self.max_edge,
            max_image_tokens: self.max_image_tokens,
            refusal_phrases: self
                .refusal_phrases
                .iter()
                .map(|ph| ph.to_lowercase())
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{load, problems};

    #[test]
    fn context_fraction_defaults_to_0_8_and_must_be_in_0_to_1() {
        let up = "[[upstream]]\nname=\"a\"\nbase_url=\"http://x/v1\"\n";
        assert_eq!(load(up).unwrap().images.context_fraction, 0.8);
        let cfg = load(&format!("[images]\ncontext_fraction = 1.0\n{up}")).unwrap();
        assert_eq!(cfg.images.context_fraction, 1.0);
        for bad in ["0.0", "-0.5", "1.5", "nan"] {
            let e = problems(&format!("[images]\ncontext_fraction = {bad}\n{up}"));
            assert!(
                e.contains("images.context_fraction:")
                    && e.contains("must be a fraction of the context window"),
                "{bad}: {e}"
            );
        }
    }
}
