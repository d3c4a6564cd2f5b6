//! Configuration in two phases.
//!
//! 1. The TOML text is parsed into a `toml::Table`, every `${VAR}` in a string
//!    value is replaced from the environment, and the result is deserialised
//!    into the `Raw*` structs (`deny_unknown_fields`: an unknown key is an
//!    error that names its dotted path) — `parse.rs`.
//! 2. [`RawConfig::validate`] hands each section to its own module, which
//!    checks its values into its typed runtime form (durations, enums, glob
//!    sets built here, at load) and reports each problem to one
//!    `Problems` as `dotted.path: bad value — why`; all of them are
//!    reported at once.
//!
//! One module per section: [`server`], [`keys`] (`[[key]]`), [`upstreams`]
//! (`[[upstream]]`, routing globs, fallback chains), [`models`]
//! (`[[model]]`), [`images`], [`describer`] (and `[transcriber]`),
//! [`documents`], [`dedup`], [`sessions`], [`store`], [`retries`],
//! [`cache`], [`inspector`]; and
//! `mistakes`, the warnings a valid config can still earn. The config
//! depends on no other part of the crate but one type: the model table's
//! image token formula ([`crate::models::ImageTokens`]), which a
//! `[[model]]` row names.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

pub mod cache;
pub mod dedup;
pub mod describer;
pub mod documents;
pub mod images;
pub mod inspector;
pub mod keys;
mod mistakes;
pub mod models;
mod parse;
pub mod retries;
pub mod server;
pub mod sessions;
pub mod store;
pub mod telemetry;
pub mod upstreams;

#[cfg(test)]
mod testing;

pub use cache::{Cache, CacheTtl, RawCache};
pub use dedup::{Dedup, RawDedup};
pub use describer::{Describer, OnMiss, RawDescriber, RawTranscriber, Transcriber};
pub use documents::{Documents, RawDocuments};
pub use images::{Images, NonVision, RawImages, default_refusal_phrases};
pub use inspector::{Inspector, RawInspector};
pub use keys::{Key, RawKey};
pub use models::{Model, RawModel, model_glob};
pub use retries::{RawRetries, Retries};
pub use server::{DEFAULT_MAX_CONNECTIONS, LogFormat, RawServer, Server};
pub use sessions::{RawSessions, Sessions};
pub use store::{RawStore, StoreBackend, StoreConfig, redacted_url};
pub use telemetry::{RawTelemetry, Telemetry};
pub use upstreams::{AuthMode, RawUpstream, Upstream};

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

/// The problems validation finds, in the order it finds them; each section
/// reports to the same one, so a config's every mistake is said at once.
#[derive(Debug, Default)]
struct Problems(Vec<String>);

impl Problems {
    /// `key: value — why`, the shape of almost every problem.
    fn bad(&mut self, key: impl fmt::Display, value: impl fmt::Display, why: impl fmt::Display) {
        self.0.push(format!("{key}: {value} — {why}"));
    }

    /// A problem said another way (`key: what is wrong`).
    fn say(&mut self, line: String) {
        self.0.push(line);
    }

    /// `value` seconds as a duration: positive and at most a year, else a
    /// problem (and one second, so validation goes on).
    fn secs(&mut self, key: &str, value: f64) -> Duration {
        if value.is_finite() && value > 0.0 && value <= 31_536_000.0 {
            Duration::from_secs_f64(value)
        } else {
            self.bad(key, value, "must be a positive number of seconds");
            Duration::from_secs(1)
        }
    }

    /// A count that must not be 0.
    fn at_least_one(&mut self, key: &str, value: u64) {
        if value == 0 {
            self.bad(key, 0, "must be at least 1");
        }
    }

    /// The choice `value` names among `allowed`; `None` (and a problem)
    /// when it names none of them.
    fn one_of<T: Copy>(&mut self, key: &str, value: &str, allowed: &[(&str, T)]) -> Option<T> {
        if let Some(&(_, choice)) = allowed.iter().find(|(name, _)| *name == value) {
            return Some(choice);
        }
        let names: Vec<String> = allowed.iter().map(|(a, _)| format!("{a:?}")).collect();
        self.bad(
            key,
            format_args!("{value:?}"),
            format_args!("must be one of {}", names.join(", ")),
        );
        None
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
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
    #[serde(default)]
    pub cache: RawCache,
    #[serde(default)]
    pub inspector: RawInspector,
    #[serde(default)]
    pub telemetry: RawTelemetry,
}

// ------------------------------------------------------------ runtime phase

/// The validated configuration the proxy runs with: every section in its
/// typed form.
#[derive(Debug)]
pub struct Config {
    pub server: Server,
    pub upstreams: Vec<Upstream>,
    /// `[[model]]` rows, their globs built.
    pub models: Vec<Model>,
    pub images: Images,
    pub describer: Describer,
    pub transcriber: Transcriber,
    pub documents: Documents,
    pub dedup: Dedup,
    pub sessions: Sessions,
    pub store: StoreConfig,
    pub retries: Retries,
    /// `[cache]`: prompt-cache breakpoints and how misses are explained.
    pub cache: Cache,
    /// `[inspector]`: the page of recent requests.
    pub inspector: Inspector,
    /// `[telemetry]`: OpenTelemetry traces.
    pub telemetry: Telemetry,
    /// `[[key]]`: each entry's limits and models, and its key when it has
    /// one.
    pub keys: Vec<Key>,
    /// Keys that still load but no longer do anything, and the mistakes a
    /// valid config can still hold: said once at start (`visor serve` logs
    /// them, `visor check` prints them).
    pub warnings: Vec<String>,
}

impl Config {
    /// Where replaced images are saved: `images.artifacts_dir`, else
    /// `<data_dir>/artifacts`.
    pub fn artifacts_dir(&self) -> PathBuf {
        match &self.images.artifacts_dir {
            Some(d) => d.clone(),
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
        let raw = parse::raw(text, path, env)?;
        raw.validate().map_err(|problems| ConfigError::Invalid {
            path: path.to_owned(),
            problems,
        })
    }
}

impl RawConfig {
    /// Checks every section into its runtime form; returns all problems at
    /// once.
    pub fn validate(self) -> Result<Config, Vec<String>> {
        let mut p = Problems::default();
        let server = self.server.validate(&mut p);
        let keys = keys::validate(self.key, &server.api_keys, &mut p);
        // Without proxy keys, a client's own key is forwarded to the
        // upstream that has none of its own: never to another provider on
        // fallback.
        let proxy_keys = !server.api_keys.is_empty() || keys.iter().any(|k| k.key.is_some());
        let upstreams = upstreams::validate(self.upstream, proxy_keys, &mut p);
        let retries = self.retries.validate(&mut p);
        let models = models::validate(self.model, &mut p);
        let images = self.images.validate(&mut p);
        let describer = self.describer.validate(&upstreams, &mut p);
        let transcriber = self.transcriber.validate(&upstreams, &mut p);
        let documents = self.documents.validate(&mut p);
        let mut warnings = Vec::new();
        let dedup = self.dedup.validate(&mut p, &mut warnings);
        let sessions = self.sessions.validate(&mut p);
        let store = self.store.validate(&mut p);
        let cache = self.cache.validate(&mut p);
        let inspector = self.inspector.validate(&mut p);
        let telemetry = self.telemetry.validate(&mut p);
        if !p.is_empty() {
            return Err(p.0);
        }
        warnings.extend(mistakes::usual_mistakes(&mistakes::Mistakes {
            upstreams: &upstreams,
            describer: describer.upstream.as_deref(),
            transcriber: transcriber.upstream.as_deref(),
            keys: &keys,
            proxy_keys,
        }));
        Ok(Config {
            server,
            upstreams,
            models,
            images,
            describer,
            transcriber,
            documents,
            dedup,
            sessions,
            store,
            retries,
            cache,
            inspector,
            telemetry,
            keys,
            warnings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{load, problems, ups};
    use super::*;

    #[test]
    fn every_file_in_config_dir_parses() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        let mut seen = 0;
        for dir in [root.clone(), root.join("examples")] {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let path = entry.path();
                if path.extension().and_then(|e| e.to_str()) != Some("toml") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                if path.file_name() == Some("models.toml".as_ref()) {
                    // The built-in model table: models::tests loads it.
                    continue;
                }
                // Each variable its own value (two keys are never the same).
                let env = |name: &str| Some(format!("sk-test-{name}"));
                let r = Config::from_toml(&text, &path, &env);
                // A slim build (no `redis` feature) refuses a Redis store,
                // and only that.
                let slim = !cfg!(feature = "redis")
                    && matches!(&r, Err(ConfigError::Invalid { problems, .. })
                        if problems.iter().all(|p| p.contains("no Redis support")));
                assert!(r.is_ok() || slim, "{path:?}: {:?}", r.err());
                seen += 1;
            }
        }
        assert!(seen >= 5, "config files missing in {root:?}");
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
    fn a_valid_config_has_no_problems() {
        assert!(load(&ups(&[("a", "")])).is_ok());
    }
}
