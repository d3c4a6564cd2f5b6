//! `[describer]` (images and document pages to text, for models that cannot
//! see) and `[transcriber]` (speech to text, for models that cannot hear):
//! the upstream and model each calls, its timeout and concurrency.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;

use super::{Problems, Upstream};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDescriber {
    #[serde(default)]
    pub upstream: Option<String>,
    #[serde(default = "default_describer_model")]
    pub model: String,
    #[serde(default = "default_describer_timeout_secs")]
    pub timeout_secs: f64,
    #[serde(default = "default_describer_concurrency")]
    pub concurrency: u32,
    #[serde(default = "default_on_miss")]
    pub on_miss: String,
    /// The user text of the message that holds an image (or a document
    /// page) shapes its description; part of the description's key.
    #[serde(default)]
    pub query_aware: bool,
}

impl Default for RawDescriber {
    fn default() -> Self {
        Self {
            upstream: None,
            model: default_describer_model(),
            timeout_secs: default_describer_timeout_secs(),
            concurrency: default_describer_concurrency(),
            on_miss: default_on_miss(),
            query_aware: false,
        }
    }
}

fn default_describer_model() -> String {
    "gpt-4o-mini".to_owned()
}
fn default_describer_timeout_secs() -> f64 {
    20.0
}
fn default_describer_concurrency() -> u32 {
    4
}
fn default_on_miss() -> String {
    "wait".to_owned()
}

/// `[transcriber]`: speech to text for models that take no audio
/// (`POST <upstream>/audio/transcriptions`, multipart).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTranscriber {
    #[serde(default)]
    pub upstream: Option<String>,
    #[serde(default = "default_transcriber_model")]
    pub model: String,
    #[serde(default = "default_transcriber_timeout_secs")]
    pub timeout_secs: f64,
    #[serde(default = "default_transcriber_concurrency")]
    pub concurrency: u32,
}

impl Default for RawTranscriber {
    fn default() -> Self {
        Self {
            upstream: None,
            model: default_transcriber_model(),
            timeout_secs: default_transcriber_timeout_secs(),
            concurrency: default_transcriber_concurrency(),
        }
    }
}

fn default_transcriber_model() -> String {
    "whisper-1".to_owned()
}
fn default_transcriber_timeout_secs() -> f64 {
    60.0
}
fn default_transcriber_concurrency() -> u32 {
    2
}

/// What a request does when a description is not cached yet
/// (`describer.on_miss`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnMiss {
    /// Waits up to `timeout_secs` for it.
    Wait,
    /// Answers with a placeholder at once; describes in the background.
    Placeholder,
}

impl fmt::Display for OnMiss {
    /// As written in the config.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OnMiss::Wait => "wait",
            OnMiss::Placeholder => "placeholder",
        })
    }
}

/// `[describer]`, checked.
#[derive(Debug, Clone)]
pub struct Describer {
    /// The `[[upstream]]` it calls, by name (a known one); `None`: the
    /// first.
    pub upstream: Option<String>,
    pub model: String,
    pub timeout: Duration,
    /// At least 1.
    pub concurrency: u32,
    pub on_miss: OnMiss,
    /// See [`RawDescriber::query_aware`].
    pub query_aware: bool,
}

/// `[transcriber]`, checked.
#[derive(Debug, Clone)]
pub struct Transcriber {
    /// The `[[upstream]]` it calls, by name (a known one); `None`: the
    /// first.
    pub upstream: Option<String>,
    pub model: String,
    pub timeout: Duration,
    /// At least 1.
    pub concurrency: u32,
}

/// `{section}.upstream` names an `[[upstream]]`.
fn known_upstream(section: &str, name: Option<&String>, upstreams: &[Upstream], p: &mut Problems) {
    if let Some(name) = name
        && !upstreams.iter().any(|u| &u.name == name)
    {
        p.bad(
            format_args!("{section}.upstream"),
            format_args!("{name:?}"),
            "no [[upstream]] has this name",
        );
    }
}

impl RawDescriber {
    pub(super) fn validate(self, upstreams: &[Upstream], p: &mut Problems) -> Describer {
        known_upstream("describer", self.upstream.as_ref(), upstreams, p);
        let timeout = p.secs("describer.timeout_secs", self.timeout_secs);
        p.at_least_one("describer.concurrency", self.concurrency.into());
        let on_miss = p
            .one_of(
                "describer.on_miss",
                &self.on_miss,
                &[("wait", OnMiss::Wait), ("placeholder", OnMiss::Placeholder)],
            )
            .unwrap_or(OnMiss::Wait);
        Describer {
            upstream: self.upstream,
            model: self.model,
            timeout,
            concurrency: self.concurrency,
            on_miss,
            query_aware: self.query_aware,
        }
    }
}

impl RawTranscriber {
    pub(super) fn validate(self, upstreams: &[Upstream], p: &mut Problems) -> Transcriber {
        known_upstream("transcriber", self.upstream.as_ref(), upstreams, p);
        let timeout = p.secs("transcriber.timeout_secs", self.timeout_secs);
        p.at_least_one("transcriber.concurrency", self.concurrency.into());
        Transcriber {
            upstream: self.upstream,
            model: self.model,
            timeout,
            concurrency: self.concurrency,
        }
    }
}
