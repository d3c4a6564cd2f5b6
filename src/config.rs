//! Configuration in two phases.
//!
//! 1. The TOML text is parsed into a `toml::Table`, every `${VAR}` in a string
//!    value is replaced from the environment, and the result is deserialised
//!    into the `Raw*` structs (`deny_unknown_fields`: an unknown key is an
//!    error that names its dotted path).
//! 2. [`RawConfig::validate`] checks every value, collects *all* problems as
//!    `dotted.path: bad value — why`, and builds the runtime [`Config`].

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use globset::{Glob, GlobBuilder, GlobSet, GlobSetBuilder};
use http::Uri;
use serde::Deserialize;

/// A secret from the config (an API key). It never prints its value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself, for the one place that needs it (a header).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("*****")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("*****")
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Secret)
    }
}

/// Every problem found in a config file, each one line.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: invalid configuration:\n{}", problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid {
        path: PathBuf,
        problems: Vec<String>,
    },
}

// ---------------------------------------------------------------- raw phase

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub upstream: Vec<RawUpstream>,
    #[serde(default)]
    pub model: Vec<RawModel>,
    #[serde(default)]
    pub images: RawImages,
    #[serde(default)]
    pub describer: RawDescriber,
    #[serde(default)]
    pub transcriber: RawTranscriber,
    #[serde(default)]
    pub documents: RawDocuments,
    #[serde(default)]
    pub dedup: RawDedup,
    #[serde(default)]
    pub sessions: RawSessions,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub retries: RawRetries,
    /// `[[key]]`: proxy keys with a name, limits and allowed models.
    #[serde(default)]
    pub key: Vec<RawKey>,
}

/// One `[[key]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKey {
    pub name: String,
    /// The key clients send; absent: the limits of requests that send no
    /// key (when visor asks for none).
    #[serde(default)]
    pub key: Option<Secret>,
    #[serde(default)]
    pub requests_per_minute: Option<u64>,
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    #[serde(default = "default_key_models")]
    pub models: Vec<String>,
}

fn default_key_models() -> Vec<String> {
    vec!["*".to_owned()]
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    #[serde(default = "default_listen")]
    pub listen: String,
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: u64,
    #[serde(default = "default_request_timeout_secs")]
    pub request_timeout_secs: f64,
    #[serde(default = "default_connect_timeout_secs")]
    pub connect_timeout_secs: f64,
    #[serde(default = "default_first_byte_timeout_secs")]
    pub first_byte_timeout_secs: f64,
    #[serde(default = "default_idle_timeout_secs")]
    pub idle_timeout_secs: f64,
    #[serde(default = "default_drain_timeout_secs")]
    pub drain_timeout_secs: f64,
    #[serde(default = "default_data_dir")]
    pub data_dir: String,
    #[serde(default)]
    pub api_keys: Vec<Secret>,
    /// Worker threads, each with its own listener; 0 = one per CPU.
    #[serde(default)]
    pub workers: usize,
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    #[serde(default = "default_header_timeout_secs")]
    pub header_timeout_secs: f64,
    #[serde(default = "default_drain_delay_secs")]
    pub drain_delay_secs: f64,
}

impl Default for RawServer {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            max_body_bytes: default_max_body_bytes(),
            request_timeout_secs: default_request_timeout_secs(),
            connect_timeout_secs: default_connect_timeout_secs(),
            first_byte_timeout_secs: default_first_byte_timeout_secs(),
            idle_timeout_secs: default_idle_timeout_secs(),
            drain_timeout_secs: default_drain_timeout_secs(),
            data_dir: default_data_dir(),
            api_keys: Vec::new(),
            workers: 0,
            max_connections: default_max_connections(),
            header_timeout_secs: default_header_timeout_secs(),
            drain_delay_secs: default_drain_delay_secs(),
        }
    }
}

/// `server.max_connections` when not set (lowered quietly to fit the
/// open-file limit; a value of the user's own is lowered with a warning).
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;

fn default_max_connections() -> usize {
    DEFAULT_MAX_CONNECTIONS
}
fn default_header_timeout_secs() -> f64 {
    10.0
}
/// 0: a plain stop (nothing in flight) exits at once. Behind a load
/// balancer set it (`deploy/k8s/configmap.yaml` sets 5); only SIGTERM
/// waits it.
fn default_drain_delay_secs() -> f64 {
    0.0
}

fn default_listen() -> String {
    "127.0.0.1:8787".to_owned()
}
fn default_max_body_bytes() -> u64 {
    32 * 1024 * 1024
}
fn default_request_timeout_secs() -> f64 {
    600.0
}
fn default_connect_timeout_secs() -> f64 {
    10.0
}
fn default_first_byte_timeout_secs() -> f64 {
    300.0
}
fn default_idle_timeout_secs() -> f64 {
    120.0
}
fn default_drain_timeout_secs() -> f64 {
    30.0
}
fn default_data_dir() -> String {
    "var".to_owned()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub name: String,
    pub base_url: String,
    #[serde(default)]
    pub api_key: Option<Secret>,
    #[serde(default = "default_models")]
    pub models: Vec<String>,
    #[serde(default = "default_auth")]
    pub auth: String,
    /// PEM file of extra CA certificates trusted for this upstream (besides
    /// the webpki roots), for providers behind a private CA.
    #[serde(default)]
    pub ca_file: Option<String>,
    /// Upstreams tried in order when this one fails before its response
    /// head (names of other `[[upstream]]`s of the same API shape).
    #[serde(default)]
    pub fallbacks: Vec<String>,
}

fn default_models() -> Vec<String> {
    vec!["*".to_owned()]
}
fn default_auth() -> String {
    "bearer".to_owned()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    #[serde(rename = "match")]
    pub pattern: String,
    #[serde(default)]
    pub vision: Option<bool>,
    #[serde(default)]
    pub audio: Option<bool>,
    #[serde(default)]
    pub pdf: Option<bool>,
    /// DOCX, PPTX and XLSX taken as they are.
    #[serde(default)]
    pub office: Option<bool>,
    #[serde(default)]
    pub max_images: Option<u32>,
    #[serde(default)]
    pub context_window: Option<u64>,
}

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
    #[serde(default)]
    pub artifacts_dir: Option<String>,
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
            artifacts_dir: None,
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
fn default_true() -> bool {
    true
}

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

/// `[documents]`: PDFs and Office files for models that cannot take them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDocuments {
    /// Rendered pages (and embedded images) described per document; the
    /// rest keep their text only, with a line that says so.
    #[serde(default = "default_max_pages_described")]
    pub max_pages_described: u32,
    /// Read each document in a child process (this binary, `visor
    /// media-worker`) under memory and CPU limits, so a hostile file can
    /// only end its own reader; false: on a thread of this process.
    #[serde(default = "default_true")]
    pub isolate: bool,
    /// The binary the child runs; default: this executable.
    #[serde(default)]
    pub reader_binary: Option<PathBuf>,
    /// The child's address-space limit, MiB.
    #[serde(default = "default_reader_memory_mib")]
    pub reader_memory_mib: u64,
    /// The child's CPU-time limit, and (with 5 s more) its wall-clock limit.
    #[serde(default = "default_reader_cpu_secs")]
    pub reader_cpu_secs: u64,
    /// Characters one document's text is at most (its reader stops there);
    /// the text says where it was cut.
    #[serde(default = "default_max_document_chars")]
    pub max_document_chars: u64,
    /// Characters of document text one request carries at most, over all
    /// its documents; absent: 1,000,000, or `server.max_body_bytes / 8`
    /// when smaller.
    #[serde(default)]
    pub max_request_chars: Option<u64>,
}

impl Default for RawDocuments {
    fn default() -> Self {
        Self {
            max_pages_described: default_max_pages_described(),
            isolate: true,
            reader_binary: None,
            reader_memory_mib: default_reader_memory_mib(),
            reader_cpu_secs: default_reader_cpu_secs(),
            max_document_chars: default_max_document_chars(),
            max_request_chars: None,
        }
    }
}

fn default_max_document_chars() -> u64 {
    150_000
}

fn default_reader_memory_mib() -> u64 {
    1024
}

fn default_reader_cpu_secs() -> u64 {
    10
}

fn default_max_pages_described() -> u32 {
    20
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDedup {
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// A repeated run of lines is replaced by a note when it has at least
    /// this many lines…
    #[serde(default = "default_min_run_lines")]
    pub min_run_lines: u32,
    /// …and this many bytes (chosen on the real-traffic corpus: docs/dedup.md).
    #[serde(default = "default_min_run_bytes")]
    pub min_run_bytes: u32,
    /// The line dedup of earlier versions; accepted and ignored, with a
    /// warning (see [`Config::warnings`]).
    #[serde(default)]
    pub min_line_chars: Option<u32>,
}

impl Default for RawDedup {
    fn default() -> Self {
        Self {
            enabled: true,
            min_run_lines: default_min_run_lines(),
            min_run_bytes: default_min_run_bytes(),
            min_line_chars: None,
        }
    }
}

fn default_min_run_lines() -> u32 {
    2
}
fn default_min_run_bytes() -> u32 {
    64
}

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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    #[serde(default = "default_backend")]
    pub backend: String,
    #[serde(default = "default_prefix")]
    pub prefix: String,
}

impl Default for RawStore {
    fn default() -> Self {
        Self {
            backend: default_backend(),
            prefix: default_prefix(),
        }
    }
}

fn default_backend() -> String {
    "disk".to_owned()
}
fn default_prefix() -> String {
    "visor:".to_owned()
}

/// `[retries]`: the fallback budget and the per-upstream circuit breaker.
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

// ------------------------------------------------------------ runtime phase

/// The validated configuration the proxy runs with.
#[derive(Debug)]
pub struct Config {
    pub server: Server,
    pub upstreams: Vec<Upstream>,
    /// Sections that are parsed and validated now and used by later stages.
    pub models: Vec<RawModel>,
    pub images: RawImages,
    pub describer: RawDescriber,
    pub transcriber: RawTranscriber,
    pub documents: RawDocuments,
    pub dedup: RawDedup,
    pub sessions: RawSessions,
    /// `[store]`, checked.
    pub store: StoreConfig,
    /// `[retries]`, checked.
    pub retries: Retries,
    /// `[[key]]`, checked: each entry's limits, and its key when it has one.
    pub keys: Vec<(crate::limits::KeyLimits, Option<Secret>)>,
    /// `images.non_vision`, checked.
    pub non_vision: NonVision,
    /// `describer.on_miss`, checked.
    pub on_miss: OnMiss,
    /// Keys that still load but no longer do anything: said once at start
    /// (`visor serve` logs them, `visor check` prints them).
    pub warnings: Vec<String>,
}

/// `[retries]`, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retries {
    pub budget_percent: u32,
    pub min_retries_per_minute: u32,
    pub breaker_failures: u32,
    pub breaker_cooldown: Duration,
}

/// `[store]`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    pub backend: StoreBackend,
    /// Key prefix (Redis).
    pub prefix: String,
}

/// Where descriptions, learned models and sessions are kept
/// (`store.backend`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreBackend {
    /// This process only.
    Memory,
    /// A file under `server.data_dir`.
    Disk,
    /// A `redis://` or `rediss://` URL (shared by replicas).
    Redis(String),
}

impl fmt::Display for StoreBackend {
    /// `memory`, `disk`, or the Redis URL without its password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreBackend::Memory => f.write_str("memory"),
            StoreBackend::Disk => f.write_str("disk"),
            StoreBackend::Redis(url) => f.write_str(&redacted_url(url)),
        }
    }
}

/// A URL without its password (`redis://:pw@host` → `redis://…@host`), for
/// logs, `/readyz` and the CLI.
pub fn redacted_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://…@{}", &url[..s], &url[at + 1..]),
        _ => url.to_owned(),
    }
}

/// What replaces an image a model cannot see (`images.non_vision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NonVision {
    /// A description by the `[describer]` model.
    Describe,
    /// A placeholder.
    Strip,
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

#[derive(Debug)]
pub struct Server {
    pub listen: SocketAddr,
    pub max_body_bytes: u64,
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    pub first_byte_timeout: Duration,
    pub idle_timeout: Duration,
    pub drain_timeout: Duration,
    pub data_dir: PathBuf,
    pub api_keys: Vec<Secret>,
    pub workers: usize,
    /// Open client connections at most (all workers together).
    pub max_connections: usize,
    /// A connection sends a whole request head (HTTP/2: its preface) within
    /// this — counted from its opening, and from the end of its last
    /// response while it sits idle.
    pub header_timeout: Duration,
    /// At shutdown on SIGTERM (not SIGINT): `/readyz` answers 503 this long
    /// before the listeners close. 0 by default.
    pub drain_delay: Duration,
}

/// How an upstream's own key is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMode {
    /// `Authorization: Bearer KEY`
    Bearer,
    /// `x-api-key: KEY` (Anthropic kind)
    XApiKey,
}

impl AuthMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AuthMode::Bearer => "bearer",
            AuthMode::XApiKey => "x-api-key",
        }
    }
}

#[derive(Debug)]
pub struct Upstream {
    pub name: String,
    /// The base URL without a trailing slash, e.g. `https://api.openai.com/v1`.
    pub base_url: Uri,
    pub api_key: Option<Secret>,
    pub auth: AuthMode,
    pub models: Vec<String>,
    pub matcher: GlobSet,
    /// Extra trusted CA certificates (`ca_file`).
    pub ca_certs: Vec<rustls::pki_types::CertificateDer<'static>>,
    /// `fallbacks`, as written.
    pub fallbacks: Vec<String>,
    /// The upstreams a request routed here may go to, in order: this one,
    /// then its fallbacks, each followed by its own (depth first, each
    /// once). Just this one when it has no fallbacks.
    pub chain: Vec<usize>,
}

impl AuthMode {
    /// The API shape an upstream of this auth mode speaks: `x-api-key` is
    /// the Anthropic kind, `bearer` the OpenAI kind. Visor never translates
    /// between shapes, so a fallback must speak the same one.
    pub fn shape(self) -> &'static str {
        match self {
            AuthMode::Bearer => "OpenAI (auth = \"bearer\")",
            AuthMode::XApiKey => "Anthropic (auth = \"x-api-key\")",
        }
    }
}

impl Upstream {
    /// True when a request routed here may fall back to another upstream.
    pub fn has_fallbacks(&self) -> bool {
        self.chain.len() > 1
    }

    pub fn matches(&self, model: &str) -> bool {
        self.matcher.is_match(model)
    }

    /// True when this upstream takes every model name.
    pub fn matches_all(&self) -> bool {
        self.models.iter().any(|m| m == "*" || m == "**")
    }
}

impl Config {
    /// Where replaced images are saved: `images.artifacts_dir`, else
    /// `<data_dir>/artifacts`.
    pub fn artifacts_dir(&self) -> PathBuf {
        match &self.images.artifacts_dir {
            Some(d) => PathBuf::from(d),
            None => self.server.data_dir.join("artifacts"),
        }
    }

    /// Where visor kept learned model capabilities before the store (read
    /// once at start and moved into the store).
    pub fn learned_path(&self) -> PathBuf {
        self.server.data_dir.join("learned-models.json")
    }

    /// Reads, expands and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text, path, &|name| std::env::var(name).ok())
    }

    /// Parses `text`; `env` looks up `${VAR}` references (injectable for tests).
    pub fn from_toml(
        text: &str,
        path: &Path,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let mut table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: with_hint(e.to_string().trim_end()),
        })?;
        let mut missing = Vec::new();
        let mut root = toml::Value::Table(std::mem::take(&mut table));
        expand_env(&mut root, &mut String::new(), env, &mut missing);
        if !missing.is_empty() {
            return Err(ConfigError::Invalid {
                path: path.to_owned(),
                problems: missing,
            });
        }
        let raw: RawConfig = serde_path_to_error::deserialize(root).map_err(|e| {
            let key = e.path().to_string();
            // The TOML layer appends "in `table`" on a second line; the
            // dotted key already says where.
            let message = e.into_inner().to_string();
            let message = message.lines().next().unwrap_or_default().trim_end();
            let message = plain_types(message);
            let message = message.as_str();
            ConfigError::Invalid {
                path: path.to_owned(),
                problems: vec![format!("{key}: {message}")],
            }
        })?;
        raw.validate().map_err(|problems| ConfigError::Invalid {
            path: path.to_owned(),
            problems,
        })
    }
}

/// A TOML parse error, with a hint when a text value lacks its quotes
/// (`name = team-a` reads as a broken `true`): the line as it should be.
fn with_hint(message: &str) -> String {
    let unquoted = [
        "invalid boolean",
        "string values must be quoted",
        "invalid number",
    ]
    .iter()
    .any(|m| message.contains(m));
    let line = message.lines().find_map(|l| {
        let (num, rest) = l.split_once(" | ")?;
        num.trim().parse::<u32>().ok()?;
        let (key, value) = rest.split_once('=')?;
        let value = value.split(" #").next().unwrap_or(value).trim();
        Some((key.trim().to_owned(), value.to_owned()))
    });
    match (unquoted, line) {
        (true, Some((key, value))) if value.starts_with(|c: char| c.is_ascii_alphabetic()) => {
            format!(
                "{message}\n  hint: text needs quotes: {key} = \"{}\"",
                value.replace('"', "\\\"")
            )
        }
        _ => message.to_owned(),
    }
}

/// serde's type names said the way a config's reader thinks of them
/// (`expected u64` → a whole number, without quotes).
fn plain_types(message: &str) -> String {
    let mut m = message.to_owned();
    for (rust, plain) in [
        ("expected u64", "expected a whole number (no quotes)"),
        ("expected u32", "expected a whole number (no quotes)"),
        ("expected usize", "expected a whole number (no quotes)"),
        ("expected u16", "expected a whole number (no quotes)"),
        ("expected i64", "expected a whole number (no quotes)"),
        ("expected f64", "expected a number (no quotes)"),
        ("expected a boolean", "expected true or false (no quotes)"),
    ] {
        m = m.replace(rust, plain);
    }
    m
}

/// Replaces `${NAME}` in every string value; records each missing variable
/// with the dotted key that referenced it.
fn expand_env(
    value: &mut toml::Value,
    key: &mut String,
    env: &dyn Fn(&str) -> Option<String>,
    missing: &mut Vec<String>,
) {
    match value {
        toml::Value::String(s) => {
            if s.contains("${") {
                match expand_str(s, env) {
                    Ok(expanded) => *s = expanded,
                    Err(name) => missing.push(format!(
                        "{key}: environment variable `{name}` is not set (referenced as ${{{name}}})"
                    )),
                }
            }
        }
        toml::Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                let len = key.len();
                key.push_str(&format!("[{i}]"));
                expand_env(item, key, env, missing);
                key.truncate(len);
            }
        }
        toml::Value::Table(table) => {
            for (name, item) in table.iter_mut() {
                let len = key.len();
                if !key.is_empty() {
                    key.push('.');
                }
                key.push_str(name);
                expand_env(item, key, env, missing);
                key.truncate(len);
            }
        }
        toml::Value::Integer(_)
        | toml::Value::Float(_)
        | toml::Value::Boolean(_)
        | toml::Value::Datetime(_) => {}
    }
}

/// `Err(name)` names the first variable that is not set.
fn expand_str(s: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            out.push_str(&rest[start..]);
            return Ok(out);
        };
        let name = &after[..end];
        match env(name) {
            Some(v) => out.push_str(&v),
            None => return Err(name.to_owned()),
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn secs(problems: &mut Vec<String>, key: &str, value: f64) -> Duration {
    if value.is_finite() && value > 0.0 && value <= 31_536_000.0 {
        Duration::from_secs_f64(value)
    } else {
        problems.push(format!(
            "{key}: {value} — must be a positive number of seconds"
        ));
        Duration::from_secs(1)
    }
}

fn one_of(problems: &mut Vec<String>, key: &str, value: &str, allowed: &[&str]) {
    if !allowed.contains(&value) {
        problems.push(format!(
            "{key}: {value:?} — must be one of {}",
            allowed
                .iter()
                .map(|a| format!("{a:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
}

impl RawConfig {
    /// Checks every value; returns all problems at once.
    pub fn validate(self) -> Result<Config, Vec<String>> {
        let mut p = Vec::new();
        let s = &self.server;
        let listen = match s.listen.parse::<SocketAddr>() {
            Ok(a) => a,
            Err(_) => {
                p.push(format!(
                    "server.listen: {:?} — must be an IP:port address such as \"127.0.0.1:8787\"",
                    s.listen
                ));
                SocketAddr::from(([127, 0, 0, 1], 0))
            }
        };
        if s.max_body_bytes == 0 {
            p.push("server.max_body_bytes: 0 — must be at least 1".to_owned());
        }
        let server = Server {
            listen,
            max_body_bytes: s.max_body_bytes,
            request_timeout: secs(
                &mut p,
                "server.request_timeout_secs",
                s.request_timeout_secs,
            ),
            connect_timeout: secs(
                &mut p,
                "server.connect_timeout_secs",
                s.connect_timeout_secs,
            ),
            first_byte_timeout: secs(
                &mut p,
                "server.first_byte_timeout_secs",
                s.first_byte_timeout_secs,
            ),
            idle_timeout: secs(&mut p, "server.idle_timeout_secs", s.idle_timeout_secs),
            drain_timeout: secs(&mut p, "server.drain_timeout_secs", s.drain_timeout_secs),
            data_dir: PathBuf::from(&s.data_dir),
            api_keys: s.api_keys.clone(),
            workers: s.workers,
            max_connections: s.max_connections,
            header_timeout: secs(&mut p, "server.header_timeout_secs", s.header_timeout_secs),
            drain_delay: if s.drain_delay_secs == 0.0 {
                Duration::ZERO
            } else {
                secs(&mut p, "server.drain_delay_secs", s.drain_delay_secs)
            },
        };
        if s.max_connections == 0 {
            p.push("server.max_connections: 0 — must be at least 1".to_owned());
        }
        if s.workers > 1024 {
            p.push(format!(
                "server.workers: {} — at most 1024 (0 = one per CPU)",
                s.workers
            ));
        }
        for (i, k) in s.api_keys.iter().enumerate() {
            if k.expose().trim().is_empty() {
                p.push(format!(
                    "server.api_keys[{i}]: \"\" — a proxy key must not be empty"
                ));
            }
        }

        let mut keys = Vec::with_capacity(self.key.len());
        for (i, k) in self.key.iter().enumerate() {
            let at = format!("key[{i}]");
            if k.name.trim().is_empty() || k.name.len() > 64 {
                p.push(format!("{at}.name: {:?} — 1 to 64 characters", k.name));
            }
            if self.key[..i].iter().any(|o| o.name == k.name) {
                p.push(format!(
                    "{at}.name: {:?} — used by an earlier [[key]]",
                    k.name
                ));
            }
            match &k.key {
                Some(s) if s.expose().trim().is_empty() => {
                    p.push(format!("{at}.key: \"\" — a proxy key must not be empty"));
                }
                Some(s)
                    if self
                        .server
                        .api_keys
                        .iter()
                        .any(|a| a.expose() == s.expose()) =>
                {
                    p.push(format!(
                        "{at}.key: also in server.api_keys, whose keys have no limits — the [[key]]'s limits would be ignored; keep it in one place"
                    ));
                }
                Some(s)
                    if self.key[..i]
                        .iter()
                        .any(|o| o.key.as_ref().is_some_and(|ok| ok.expose() == s.expose())) =>
                {
                    p.push(format!("{at}.key: the same key as an earlier [[key]]"));
                }
                None if self.key[..i].iter().any(|o| o.key.is_none()) => {
                    p.push(format!(
                        "{at}.key: (none) — only one [[key]] may be the default for requests without a key"
                    ));
                }
                _ => {}
            }
            for (what, v) in [
                ("requests_per_minute", k.requests_per_minute),
                ("tokens_per_minute", k.tokens_per_minute),
            ] {
                if v == Some(0) {
                    p.push(format!(
                        "{at}.{what}: 0 — at least 1 (leave it out for no limit)"
                    ));
                }
            }
            let mut b = globset::GlobSetBuilder::new();
            for (j, m) in k.models.iter().enumerate() {
                match model_glob(m) {
                    Ok(g) => {
                        b.add(g);
                    }
                    Err(_) => p.push(format!("{at}.models[{j}]: {m:?} — not a valid glob")),
                }
            }
            if let Ok(models) = b.build() {
                keys.push((
                    crate::limits::KeyLimits {
                        name: k.name.clone(),
                        requests_per_minute: k.requests_per_minute,
                        tokens_per_minute: k.tokens_per_minute,
                        models,
                        any_model: k.models.iter().any(|m| m == "*"),
                    },
                    k.key.clone(),
                ));
            }
        }

        if self.upstream.is_empty() {
            p.push("upstream: (none) — at least one [[upstream]] is required".to_owned());
        }
        let mut upstreams = Vec::with_capacity(self.upstream.len());
        for (i, u) in self.upstream.iter().enumerate() {
            let key = format!("upstream[{i}]");
            if u.name.is_empty()
                || !u
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            {
                p.push(format!(
                    "{key}.name: {:?} — must be non-empty ASCII letters, digits, '-', '_' or '.'",
                    u.name
                ));
            }
            if self.upstream[..i].iter().any(|o| o.name == u.name) {
                p.push(format!(
                    "{key}.name: {:?} — another upstream has this name",
                    u.name
                ));
            }
            let base_url = match parse_base_url(&u.base_url) {
                Ok(uri) => uri,
                Err(why) => {
                    p.push(format!("{key}.base_url: {:?} — {why}", u.base_url));
                    Uri::from_static("http://invalid")
                }
            };
            let auth = match u.auth.as_str() {
                "bearer" => AuthMode::Bearer,
                "x-api-key" => AuthMode::XApiKey,
                other => {
                    one_of(
                        &mut p,
                        &format!("{key}.auth"),
                        other,
                        &["bearer", "x-api-key"],
                    );
                    AuthMode::Bearer
                }
            };
            if let Some(k) = &u.api_key
                && k.expose().trim().is_empty()
            {
                p.push(format!(
                    "{key}.api_key: \"\" — empty; remove the key to forward the client's own"
                ));
            }
            if u.models.is_empty() {
                p.push(format!(
                    "{key}.models: [] — list at least one glob, e.g. [\"*\"]"
                ));
            }
            let mut set = GlobSetBuilder::new();
            for (j, m) in u.models.iter().enumerate() {
                match Glob::new(m) {
                    Ok(g) => {
                        set.add(g);
                    }
                    Err(e) => p.push(format!("{key}.models[{j}]: {m:?} — not a valid glob: {e}")),
                }
            }
            let matcher = set.build().unwrap_or_else(|_| GlobSet::empty());
            let ca_certs = match &u.ca_file {
                None => Vec::new(),
                Some(f) => match read_ca_file(f) {
                    Ok(certs) => certs,
                    Err(why) => {
                        p.push(format!("{key}.ca_file: {f:?} — {why}"));
                        Vec::new()
                    }
                },
            };
            upstreams.push(Upstream {
                name: u.name.clone(),
                base_url,
                api_key: u.api_key.clone(),
                auth,
                models: u.models.clone(),
                matcher,
                ca_certs,
                fallbacks: u.fallbacks.clone(),
                chain: vec![i],
            });
        }
        fallback_chains(&mut p, &mut upstreams);
        // Without proxy keys, a client's own key is forwarded to the upstream
        // that has none of its own: never to another provider on fallback.
        let proxy_keys =
            !self.server.api_keys.is_empty() || self.key.iter().any(|k| k.key.is_some());
        if !proxy_keys {
            fallback_credentials(&mut p, &upstreams);
        }
        let r = &self.retries;
        if r.budget_percent > 100 {
            p.push(format!(
                "retries.budget_percent: {} — at most 100 (0: no retries beyond min_retries_per_minute)",
                r.budget_percent
            ));
        }
        if r.breaker_failures == 0 {
            p.push("retries.breaker_failures: 0 — must be at least 1".to_owned());
        }
        let retries = Retries {
            budget_percent: r.budget_percent,
            min_retries_per_minute: r.min_retries_per_minute,
            breaker_failures: r.breaker_failures,
            breaker_cooldown: secs(
                &mut p,
                "retries.breaker_cooldown_secs",
                r.breaker_cooldown_secs,
            ),
        };

        for (i, m) in self.model.iter().enumerate() {
            if let Err(e) = model_glob(&m.pattern) {
                p.push(format!(
                    "model[{i}].match: {:?} — not a valid glob: {e}",
                    m.pattern
                ));
            }
        }
        one_of(
            &mut p,
            "images.non_vision",
            &self.images.non_vision,
            &["describe", "strip"],
        );
        for (i, ph) in self.images.refusal_phrases.iter().enumerate() {
            if ph.trim().is_empty() {
                p.push(format!(
                    "images.refusal_phrases[{i}]: \"\" — a phrase must not be empty"
                ));
            }
        }
        if self.images.max_per_request == 0 {
            p.push("images.max_per_request: 0 — must be at least 1".to_owned());
        }
        if let Some(name) = &self.describer.upstream
            && !self.upstream.iter().any(|u| &u.name == name)
        {
            p.push(format!(
                "describer.upstream: {name:?} — no [[upstream]] has this name"
            ));
        }
        secs(
            &mut p,
            "describer.timeout_secs",
            self.describer.timeout_secs,
        );
        if self.describer.concurrency == 0 {
            p.push("describer.concurrency: 0 — must be at least 1".to_owned());
        }
        one_of(
            &mut p,
            "describer.on_miss",
            &self.describer.on_miss,
            &["wait", "placeholder"],
        );
        if let Some(name) = &self.transcriber.upstream
            && !self.upstream.iter().any(|u| &u.name == name)
        {
            p.push(format!(
                "transcriber.upstream: {name:?} — no [[upstream]] has this name"
            ));
        }
        secs(
            &mut p,
            "transcriber.timeout_secs",
            self.transcriber.timeout_secs,
        );
        if self.transcriber.concurrency == 0 {
            p.push("transcriber.concurrency: 0 — must be at least 1".to_owned());
        }
        if self.documents.reader_memory_mib > 1 << 20 {
            p.push(format!(
                "documents.reader_memory_mib: {} — at most 1048576 (1 TiB)",
                self.documents.reader_memory_mib
            ));
        }
        if self.documents.reader_cpu_secs > 3600 {
            p.push(format!(
                "documents.reader_cpu_secs: {} — at most 3600",
                self.documents.reader_cpu_secs
            ));
        }
        if self.documents.reader_memory_mib < 256 {
            p.push(format!(
                "documents.reader_memory_mib: {} — must be at least 256 (the reader's own code and a rendered page need that much)",
                self.documents.reader_memory_mib
            ));
        }
        if self.documents.reader_cpu_secs == 0 {
            p.push("documents.reader_cpu_secs: 0 — must be at least 1".to_owned());
        }
        if self.dedup.min_run_lines < 2 {
            p.push(format!(
                "dedup.min_run_lines: {} — must be at least 2 (a single repeated line always stays)",
                self.dedup.min_run_lines
            ));
        }
        let mut warnings = Vec::new();
        if self.dedup.min_line_chars.is_some() {
            warnings.push(
                "dedup.min_line_chars: no longer used (dedup removes repeated runs of lines; see dedup.min_run_lines and dedup.min_run_bytes) — ignored"
                    .to_owned(),
            );
        }
        if self.sessions.max_depth == 0 {
            p.push("sessions.max_depth: 0 — must be at least 1".to_owned());
        }
        if self.sessions.default_depth > self.sessions.max_depth {
            p.push(format!(
                "sessions.default_depth: {} — must not exceed sessions.max_depth ({})",
                self.sessions.default_depth, self.sessions.max_depth
            ));
        }
        let b = self.store.backend.as_str();
        let backend = match b {
            "memory" => Some(StoreBackend::Memory),
            "disk" => Some(StoreBackend::Disk),
            url if url.starts_with("redis://") || url.starts_with("rediss://") => {
                Some(StoreBackend::Redis(url.to_owned()))
            }
            _ => {
                p.push(format!(
                    "store.backend: {:?} — must be \"memory\", \"disk\" or a redis://host:port/db URL",
                    redacted_url(b)
                ));
                None
            }
        };
        if !cfg!(feature = "redis") && matches!(backend, Some(StoreBackend::Redis(_))) {
            p.push(format!(
                "store.backend: {:?} — this build of visor has no Redis support (it was built without the `redis` feature)",
                redacted_url(b)
            ));
        }

        if !p.is_empty() {
            return Err(p);
        }
        let key_models: Vec<(String, Vec<String>)> = self
            .key
            .iter()
            .map(|k| (k.name.clone(), k.models.clone()))
            .collect();
        warnings.extend(usual_mistakes(&Mistakes {
            upstreams: &upstreams,
            describer: self.describer.upstream.as_deref(),
            transcriber: self.transcriber.upstream.as_deref(),
            keys: &key_models,
            proxy_keys,
        }));
        let non_vision = match self.images.non_vision.as_str() {
            "strip" => NonVision::Strip,
            _ => NonVision::Describe,
        };
        let on_miss = match self.describer.on_miss.as_str() {
            "placeholder" => OnMiss::Placeholder,
            _ => OnMiss::Wait,
        };
        Ok(Config {
            non_vision,
            on_miss,
            server,
            upstreams,
            models: self.model,
            images: self.images,
            describer: self.describer,
            transcriber: self.transcriber,
            documents: self.documents,
            dedup: self.dedup,
            sessions: self.sessions,
            store: StoreConfig {
                backend: backend.unwrap_or(StoreBackend::Memory),
                prefix: self.store.prefix,
            },
            retries,
            keys,
            warnings,
        })
    }
}

/// Checks every upstream's `fallbacks` (known names, not itself, the same
/// API shape, no cycle through other upstreams' fallbacks) and sets each
/// upstream's `chain`.
fn fallback_chains(p: &mut Vec<String>, upstreams: &mut [Upstream]) {
    let index_of = |name: &str| upstreams.iter().position(|u| u.name == name);
    let mut edges: Vec<Vec<usize>> = Vec::with_capacity(upstreams.len());
    let mut sound = true;
    for (i, u) in upstreams.iter().enumerate() {
        let mut next = Vec::new();
        for (j, f) in u.fallbacks.iter().enumerate() {
            let key = format!("upstream[{i}].fallbacks[{j}]");
            match index_of(f) {
                None => {
                    p.push(format!("{key}: {f:?} — no [[upstream]] has this name"));
                    sound = false;
                }
                Some(t) if t == i => {
                    p.push(format!(
                        "{key}: {f:?} — an upstream cannot fall back to itself"
                    ));
                    sound = false;
                }
                Some(t) if upstreams[t].auth != u.auth => {
                    p.push(format!(
                        "{key}: {f:?} — speaks {}, but {:?} speaks {}; visor never translates between API shapes, so a fallback must speak the same one",
                        upstreams[t].auth.shape(),
                        u.name,
                        u.auth.shape()
                    ));
                    sound = false;
                }
                Some(t) if next.contains(&t) => {
                    p.push(format!("{key}: {f:?} — listed twice"));
                    sound = false;
                }
                Some(t) => next.push(t),
            }
        }
        edges.push(next);
    }
    if !sound {
        return;
    }
    // A cycle (a → b → a) would make the order of a chain ambiguous.
    for start in 0..upstreams.len() {
        let mut path = vec![start];
        if let Some(cycle) = find_cycle(&edges, &mut path) {
            let names: Vec<&str> = cycle.iter().map(|&k| upstreams[k].name.as_str()).collect();
            p.push(format!(
                "upstream[{start}].fallbacks: {:?} — fallbacks form a cycle: {}",
                upstreams[start].fallbacks,
                names.join(" → ")
            ));
            return;
        }
    }
    for (i, u) in upstreams.iter_mut().enumerate() {
        let mut chain = vec![i];
        flatten(&edges, i, &mut chain);
        u.chain = chain;
    }
}

/// What [`usual_mistakes`] looks at.
struct Mistakes<'a> {
    upstreams: &'a [Upstream],
    /// `describer.upstream` / `transcriber.upstream` as written (`None`:
    /// the first upstream).
    describer: Option<&'a str>,
    transcriber: Option<&'a str>,
    /// Each `[[key]]`'s name and `models` globs.
    keys: &'a [(String, Vec<String>)],
    /// `server.api_keys` or a `[[key]]` with a key: clients' keys are never
    /// forwarded.
    proxy_keys: bool,
}

/// The mistakes a valid config can still hold, as warnings (`visor check`
/// prints them; `--strict` makes them errors): a `base_url` that names an
/// endpoint or has no version segment, a route an earlier upstream's `*`
/// shadows, a `[[key]]` whose models no upstream serves, a describer or
/// transcriber that would call without a credential or call an upstream of
/// the other API kind.
fn usual_mistakes(m: &Mistakes<'_>) -> Vec<String> {
    let mut w = Vec::new();
    let ups = m.upstreams;
    for (i, u) in ups.iter().enumerate() {
        let path = u.base_url.path().trim_end_matches('/');
        let at = format!("upstream[{i}].base_url {:?}", u.base_url.to_string());
        if let Some(end) = [
            "/chat/completions",
            "/completions",
            "/responses",
            "/messages",
            "/embeddings",
        ]
        .into_iter()
        .find(|e| path.ends_with(e))
        {
            w.push(format!(
                "{at} ends in {end}: visor appends the client's path after /v1 to base_url (a client's /v1{end} goes to <base_url>{end}); give the API's base, e.g. https://api.example.com/v1"
            ));
        } else if !path.split('/').any(is_version_segment) {
            w.push(format!(
                "{at} has no version segment such as /v1: visor appends the client's path after /v1 (/chat/completions, /messages…) to it, and most OpenAI-compatible APIs serve them under …/v1"
            ));
        }
    }
    // Upstreams used other than by routing: a describer's or transcriber's,
    // a fallback.
    let named = |n: Option<&str>| match n {
        Some(n) => ups.iter().position(|u| u.name == n),
        None => (!ups.is_empty()).then_some(0),
    };
    let describer = named(m.describer);
    let transcriber = named(m.transcriber);
    let fallback = |j: usize| ups.iter().any(|u| u.fallbacks.contains(&ups[j].name));
    for (j, u) in ups.iter().enumerate() {
        if Some(j) == describer || Some(j) == transcriber || fallback(j) {
            continue;
        }
        let wide = ups[..j]
            .iter()
            .position(|e| e.models.iter().any(|g| g == "*" || g == "**"));
        let literal_taken = !u.models.is_empty()
            && u.models.iter().all(|g| {
                !g.contains(['*', '?', '[', '{'])
                    && ups[..j]
                        .iter()
                        .any(|e| e.matches(&g.to_ascii_lowercase()) || e.matches(g))
            });
        if let Some(e) = wide {
            w.push(format!(
                "upstream[{j}] {:?}: no request is ever routed to it — upstream[{e}] {:?} before it takes every model (\"*\"); put it first, or narrow {:?}'s models",
                u.name, ups[e].name, ups[e].name
            ));
        } else if literal_taken {
            w.push(format!(
                "upstream[{j}] {:?}: every model it lists is taken by an earlier upstream (first match wins)",
                u.name
            ));
        }
    }
    for (name, globs) in m.keys {
        for (g_at, g) in globs.iter().enumerate() {
            if g == "*" || g == "**" {
                continue;
            }
            let samples = [
                g.replace('*', "").replace('?', "x"),
                g.replace(['*', '?'], "x"),
            ];
            // Either side's globs, tried on names made from the other's.
            let key_glob = Glob::new(&g.to_ascii_lowercase())
                .ok()
                .map(|g| g.compile_matcher());
            let served = ups.iter().any(|u| {
                samples.iter().any(|s| u.matches(s))
                    || u.models.iter().any(|ug| {
                        let sample = ug.to_ascii_lowercase().replace(['*', '?'], "x");
                        key_glob.as_ref().is_some_and(|k| k.is_match(&sample))
                    })
            });
            if !served {
                w.push(format!(
                    "key {name:?} models[{g_at}] {g:?}: no [[upstream]] serves a model it names"
                ));
            }
        }
    }
    // An upstream some request is routed to: no earlier one takes `*`.
    let routed = |k: usize| {
        !ups[..k]
            .iter()
            .any(|e| e.models.iter().any(|g| g == "*" || g == "**"))
    };
    // The transcriber only when it is set (it serves audio alone).
    let transcriber = m.transcriber.and(transcriber);
    for (role, at) in [("describer", describer), ("transcriber", transcriber)] {
        let Some(at) = at else { continue };
        let u = &ups[at];
        let which = match (role, m.describer, m.transcriber) {
            ("describer", None, _) | ("transcriber", _, None) => {
                format!(
                    "{role}.upstream is not set, so it is the first upstream, {:?},",
                    u.name
                )
            }
            _ => format!("{role}.upstream {:?}", u.name),
        };
        if u.auth == AuthMode::XApiKey {
            w.push(format!(
                "{which} is of the Anthropic kind (auth = \"x-api-key\"), but {role} calls are OpenAI-kind ({}): name an OpenAI-kind upstream with a vision model",
                match role {
                    "describer" => "POST /chat/completions",
                    _ => "POST /audio/transcriptions",
                }
            ));
        }
        if u.api_key.is_some() {
            continue;
        }
        if m.proxy_keys {
            w.push(format!(
                "{which} has no api_key, and with proxy keys clients' keys are never forwarded: its calls go out without a credential (a provider that needs one answers 401{}) — give it an api_key (any value for a local server)",
                match role {
                    "describer" => ", and images become \"not shown\" placeholders",
                    _ => "",
                }
            ));
        } else if ups
            .iter()
            .enumerate()
            .any(|(k, o)| k != at && routed(k) && o.base_url.authority() != u.base_url.authority())
        {
            w.push(format!(
                "{which} has no api_key: it gets the client's key only for requests routed to {:?}; for requests routed elsewhere its calls go out without a credential (a provider that needs one answers 401) — give it an api_key (any value for a local server)",
                u.name
            ));
        }
    }
    w
}

/// `v1`, `v4`, `v1beta`, `v2alpha1`: a path segment naming an API version.
fn is_version_segment(seg: &str) -> bool {
    let Some(rest) = seg.strip_prefix('v') else {
        return false;
    };
    let digits = rest.chars().take_while(char::is_ascii_digit).count();
    digits > 0 && rest[digits..].chars().all(|c| c.is_ascii_alphanumeric())
}

/// A fallback without an `api_key` is sent the client's own key, which the
/// client sent for the upstream it falls back from: refused unless that one
/// also forwards the client's key and is the same origin (scheme, host,
/// port) — the same provider.
fn fallback_credentials(p: &mut Vec<String>, upstreams: &[Upstream]) {
    let origin = |u: &Upstream| {
        (
            u.base_url.scheme_str().map(str::to_ascii_lowercase),
            u.base_url.host().map(str::to_ascii_lowercase),
            u.base_url.port_u16(),
        )
    };
    for (i, u) in upstreams.iter().enumerate() {
        for (j, f) in u.fallbacks.iter().enumerate() {
            let Some(t) = upstreams.iter().find(|t| &t.name == f) else {
                continue;
            };
            if t.api_key.is_some() || (u.api_key.is_none() && origin(u) == origin(t)) {
                continue;
            }
            p.push(format!(
                "upstream[{i}].fallbacks[{j}]: {f:?} has no api_key, so it would be sent the client's own key, which the client sent for {:?} ({}): give {f:?} an api_key of its own (or give visor proxy keys: server.api_keys or [[key]])",
                u.name,
                u.base_url.host().unwrap_or("")
            ));
        }
    }
}

/// A cycle reachable from the end of `path`, as the names along it.
fn find_cycle(edges: &[Vec<usize>], path: &mut Vec<usize>) -> Option<Vec<usize>> {
    let last = *path.last()?;
    for &n in &edges[last] {
        if let Some(pos) = path.iter().position(|&k| k == n) {
            let mut cycle = path[pos..].to_vec();
            cycle.push(n);
            return Some(cycle);
        }
        path.push(n);
        if let Some(c) = find_cycle(edges, path) {
            return Some(c);
        }
        path.pop();
    }
    None
}

fn flatten(edges: &[Vec<usize>], from: usize, chain: &mut Vec<usize>) {
    for &n in &edges[from] {
        if !chain.contains(&n) {
            chain.push(n);
            flatten(edges, n, chain);
        }
    }
}

fn read_ca_file(path: &str) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
    use rustls::pki_types::pem::PemObject;
    let certs = rustls::pki_types::CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read: {e}"))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not a PEM certificate file: {e}"))?;
    if certs.is_empty() {
        return Err("holds no PEM certificate".to_owned());
    }
    Ok(certs)
}

fn parse_base_url(s: &str) -> Result<Uri, &'static str> {
    let uri: Uri = s
        .trim_end_matches('/')
        .parse()
        .map_err(|_| "not a valid URL")?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => return Err("must start with http:// or https://"),
    }
    if uri.authority().is_none() {
        return Err("has no host");
    }
    if uri.query().is_some() {
        return Err("must not have a query string");
    }
    Ok(uri)
}

/// A `[[model]]` pattern as the model table matches it: case-insensitive
/// (the pattern lower-cased, as each model name is), `*` across `/`.
/// Validation checks patterns with it, so a pattern it accepts builds.
pub fn model_glob(pattern: &str) -> Result<Glob, globset::Error> {
    GlobBuilder::new(&pattern.to_ascii_lowercase())
        .literal_separator(false)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_none(_: &str) -> Option<String> {
        None
    }

    fn load(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(text, Path::new("test.toml"), &env_none)
    }

    fn problems(text: &str) -> String {
        match load(text) {
            Ok(_) => String::from("(valid)"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn every_file_in_config_dir_parses() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("toml") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            if path.file_name() == Some("models.toml".as_ref()) {
                // The built-in model table, checked by models::tests.
                let table = crate::models::ModelTable::new(&[], crate::models::Learned::default());
                assert!(table.is_ok_and(|t| t.builtin_len() > 200));
                seen += 1;
                continue;
            }
            let env = |_: &str| Some("sk-test".to_owned());
            let r = Config::from_toml(&text, &path, &env);
            assert!(r.is_ok(), "{path:?}: {:?}", r.err());
            seen += 1;
        }
        assert!(seen >= 1, "no config files found in {dir:?}");
    }

    #[test]
    fn shipped_default_forwards_client_key_to_openai() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/visor.toml");
        let cfg = Config::load(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cfg.upstreams.len(), 1);
        assert_eq!(cfg.upstreams[0].base_url, "https://api.openai.com/v1");
        assert!(cfg.upstreams[0].api_key.is_none());
        assert!(cfg.server.api_keys.is_empty());
        assert!(cfg.upstreams[0].matches("gpt-4o"));
    }

    #[test]
    fn the_old_line_dedup_key_loads_with_a_warning_and_runs_are_checked() {
        let up = "[[upstream]]\nname=\"a\"\nbase_url=\"http://x/v1\"\n";
        let cfg = load(&format!("[dedup]\nmin_line_chars = 16\n{up}")).unwrap();
        assert_eq!(cfg.warnings.len(), 1);
        assert!(
            cfg.warnings[0].starts_with("dedup.min_line_chars"),
            "{:?}",
            cfg.warnings
        );
        assert_eq!((cfg.dedup.min_run_lines, cfg.dedup.min_run_bytes), (2, 64));
        assert!(load(up).unwrap().warnings.is_empty());
        let e = problems(&format!("[dedup]\nmin_run_lines = 1\n{up}"));
        assert!(
            e.contains("dedup.min_run_lines: 1 — must be at least 2"),
            "{e}"
        );
    }

    #[test]
    fn model_pattern_is_checked_as_the_table_matches_it() {
        let up = "[[upstream]]\nname=\"a\"\nbase_url=\"http://x\"\n";
        // Valid as written, not once lower-cased (`[z-a]`): found by the
        // config fuzz target (fuzz/seeds/config/model-glob-upper-range.toml).
        let e = problems(&format!(
            "{up}[[model]]\nmatch = \"[Z-a]\"\nvision = false\n"
        ));
        assert!(e.contains("model[0].match: \"[Z-a]\""), "{e}");
        let e = problems(&format!(
            "{up}[[model]]\nmatch = \"GPT-[A-Z]*\"\nvision = false\n"
        ));
        assert_eq!(e, "(valid)");
    }

    #[test]
    fn unknown_key_is_named_with_its_path() {
        let e = problems(
            "[server]\nlisten = \"127.0.0.1:1\"\nlisen = 3\n[[upstream]]\nname=\"a\"\nbase_url=\"http://x\"\n",
        );
        assert!(e.contains("server"), "{e}");
        assert!(e.contains("lisen"), "{e}");
        let e = problems("[[upstream]]\nname=\"a\"\nbase_url=\"http://x\"\nmodel=[\"*\"]\n");
        assert!(e.contains("upstream[0]") && e.contains("model"), "{e}");
    }

    #[test]
    fn bad_values_are_all_reported_with_key_value_and_reason() {
        let e = problems(
            "[server]\nlisten = \"nowhere\"\nrequest_timeout_secs = -1\n[[upstream]]\nname=\"a\"\nbase_url=\"ftp://x\"\nauth=\"basic\"\n",
        );
        assert!(e.contains("server.listen: \"nowhere\""), "{e}");
        assert!(e.contains("server.request_timeout_secs: -1"), "{e}");
        assert!(
            e.contains("upstream[0].base_url: \"ftp://x\" — must start with http"),
            "{e}"
        );
        assert!(e.contains("upstream[0].auth: \"basic\""), "{e}");
    }

    #[test]
    fn wrong_type_names_the_key() {
        let e = problems(
            "[server]\nmax_body_bytes = \"big\"\n[[upstream]]\nname=\"a\"\nbase_url=\"http://x\"\n",
        );
        assert!(e.contains("server.max_body_bytes"), "{e}");
    }

    #[test]
    fn missing_env_var_is_named() {
        let e = problems(
            "[[upstream]]\nname=\"a\"\nbase_url=\"http://x\"\napi_key=\"${VISOR_TEST_NOPE}\"\n",
        );
        assert!(e.contains("VISOR_TEST_NOPE"), "{e}");
        assert!(e.contains("upstream[0].api_key"), "{e}");
    }

    #[test]
    fn env_vars_are_expanded_and_secrets_never_print() {
        let env = |n: &str| (n == "KEY").then(|| "sk-secret-value".to_owned());
        let cfg = Config::from_toml(
            "[[upstream]]\nname=\"a\"\nbase_url=\"http://x/v1/\"\napi_key=\"${KEY}\"\n",
            Path::new("t.toml"),
            &env,
        );
        let cfg = cfg.expect("config loads");
        let key = cfg.upstreams[0].api_key.as_ref().map(Secret::expose);
        assert_eq!(key, Some("sk-secret-value"));
        assert_eq!(cfg.upstreams[0].base_url, "http://x/v1");
        let printed = format!("{cfg:?}");
        assert!(!printed.contains("sk-secret-value"), "{printed}");
        assert!(printed.contains("*****"));
    }

    #[test]
    fn no_upstream_is_an_error() {
        assert!(problems("").contains("at least one [[upstream]]"));
    }

    fn ups(extra: &[(&str, &str)]) -> String {
        extra
            .iter()
            .map(|(name, more)| {
                format!("[[upstream]]\nname = \"{name}\"\nbase_url = \"http://{name}.test/v1\"\n{more}\n")
            })
            .collect()
    }

    #[test]
    fn fallback_chains_are_flattened_in_order() {
        let cfg = load(&ups(&[
            ("a", "fallbacks = [\"b\", \"c\"]\napi_key = \"k-a\""),
            ("b", "fallbacks = [\"d\"]\napi_key = \"k-b\""),
            ("c", "fallbacks = [\"d\"]\napi_key = \"k-c\""),
            ("d", "api_key = \"k-d\""),
        ]))
        .unwrap();
        assert_eq!(cfg.upstreams[0].chain, vec![0, 1, 3, 2]);
        assert_eq!(cfg.upstreams[1].chain, vec![1, 3]);
        assert_eq!(cfg.upstreams[3].chain, vec![3]);
        assert!(!cfg.upstreams[3].has_fallbacks());
        assert_eq!(cfg.retries.budget_percent, 20);
        assert_eq!(cfg.retries.breaker_failures, 5);
        assert_eq!(cfg.retries.breaker_cooldown, Duration::from_secs(30));
    }

    #[test]
    fn a_key_in_api_keys_and_a_key_entry_is_refused() {
        let e = problems(&format!(
            "[server]\napi_keys = [\"sk-1\"]\n{}[[key]]\nname = \"team\"\nkey = \"sk-1\"\nrequests_per_minute = 5\n",
            ups(&[("a", "")])
        ));
        assert!(e.contains("key[0].key: also in server.api_keys"), "{e}");
        let ok = format!(
            "[server]\napi_keys = [\"sk-1\"]\n{}[[key]]\nname = \"team\"\nkey = \"sk-2\"\n",
            ups(&[("a", "")])
        );
        assert_eq!(problems(&ok), "(valid)");
    }

    #[test]
    fn type_errors_say_what_to_write() {
        let e = problems("[[upstream]]\nname = team-a\nbase_url = \"https://a.test/v1\"\n");
        assert!(
            e.contains("hint: text needs quotes: name = \"team-a\""),
            "{e}"
        );
        let e = problems("[[upstream]]\nname = openai\nbase_url = \"https://a.test/v1\"\n");
        assert!(e.contains("name = \"openai\""), "{e}");
        let e = problems(&format!(
            "[server]\nmax_body_bytes = \"32MB\"\n{}",
            ups(&[("a", "")])
        ));
        assert!(
            e.contains("server.max_body_bytes: invalid type: string \"32MB\", expected a whole number (no quotes"),
            "{e}"
        );
        assert!(!e.contains("u64"), "{e}");
    }

    #[test]
    fn bad_fallbacks_are_refused() {
        let e = problems(&ups(&[("a", "fallbacks = [\"nope\"]")]));
        assert!(
            e.contains("upstream[0].fallbacks[0]: \"nope\" — no [[upstream]]"),
            "{e}"
        );
        let e = problems(&ups(&[("a", "fallbacks = [\"a\"]")]));
        assert!(e.contains("cannot fall back to itself"), "{e}");
        let e = problems(&ups(&[
            ("a", "fallbacks = [\"b\"]"),
            ("b", "fallbacks = [\"c\"]"),
            ("c", "fallbacks = [\"a\"]"),
        ]));
        assert!(e.contains("cycle: a → b → c → a"), "{e}");
        let e = problems(&ups(&[
            ("a", "fallbacks = [\"b\"]"),
            ("b", "auth = \"x-api-key\""),
        ]));
        assert!(e.contains("never translates between API shapes"), "{e}");
        // The client's key, sent for `a`, is never sent to another host.
        let e = problems(&ups(&[("a", "fallbacks = [\"b\"]"), ("b", "")]));
        assert!(
            e.contains("upstream[0].fallbacks[0]: \"b\" has no api_key, so it would be sent the client's own key"),
            "{e}"
        );
        // Fine: the fallback has its own key; proxy keys (clients' keys are
        // never forwarded); the same host's other port is another origin,
        // the same origin is the same provider.
        assert_eq!(
            problems(&ups(&[
                ("a", "fallbacks = [\"b\"]"),
                ("b", "api_key = \"k\"")
            ])),
            "(valid)"
        );
        assert_eq!(
            problems(&format!(
                "[server]\napi_keys = [\"p\"]\n{}",
                ups(&[("a", "fallbacks = [\"b\"]"), ("b", "")])
            )),
            "(valid)"
        );
        let same = "[[upstream]]\nname = \"a\"\nbase_url = \"http://h.test/v1\"\nfallbacks = [\"b\"]\n\
                    [[upstream]]\nname = \"b\"\nbase_url = \"http://h.test/v2\"\n";
        assert_eq!(problems(same), "(valid)");
        assert!(problems(&same.replace("h.test/v2", "h.test:8080/v2")).contains("has no api_key"));
        // `a` has a key of its own: the client's key was not for it either.
        assert!(
            problems(&same.replace("fallbacks", "api_key = \"k\"\nfallbacks"))
                .contains("has no api_key")
        );
        let e = problems(&format!(
            "{}[retries]\nbudget_percent = 101\nbreaker_failures = 0\nbreaker_cooldown_secs = -1\n",
            ups(&[("a", "")])
        ));
        assert!(e.contains("retries.budget_percent: 101"), "{e}");
        assert!(e.contains("retries.breaker_failures: 0"), "{e}");
        assert!(e.contains("retries.breaker_cooldown_secs"), "{e}");
    }
}
