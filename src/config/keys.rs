//! `[[key]]`: proxy keys with a name, per-minute limits and the models they
//! may use. The limits themselves are counted by `limits`, which builds its
//! own structure from these entries.

use globset::{GlobSet, GlobSetBuilder};
use serde::Deserialize;

use super::models::model_glob;
use super::{Problems, Secret};

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

/// One `[[key]]`, checked.
#[derive(Debug, Clone)]
pub struct Key {
    pub name: String,
    /// The key clients send; `None`: the entry for requests without one.
    pub key: Option<Secret>,
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    /// `models`, as written.
    pub models: Vec<String>,
    /// `models` built: the key's globs, lower case (a model name is
    /// lower-cased before it is matched).
    pub matcher: GlobSet,
    /// `models = ["*"]`: any model (a streamed body's model need not be
    /// read to check it).
    pub any_model: bool,
}

/// Checks every `[[key]]` (names and keys unique, none also in
/// `server.api_keys`, at most one without a key, limits above 0, globs
/// valid) into its runtime form.
pub(super) fn validate(raw: Vec<RawKey>, api_keys: &[Secret], p: &mut Problems) -> Vec<Key> {
    let mut keys: Vec<Key> = Vec::with_capacity(raw.len());
    for (i, k) in raw.into_iter().enumerate() {
        let at = format!("key[{i}]");
        if k.name.trim().is_empty() || k.name.len() > 64 {
            p.bad(
                format_args!("{at}.name"),
                format_args!("{:?}", k.name),
                "1 to 64 characters",
            );
        }
        if keys.iter().any(|o| o.name == k.name) {
            p.bad(
                format_args!("{at}.name"),
                format_args!("{:?}", k.name),
                "used by an earlier [[key]]",
            );
        }
        check_secret(&at, k.key.as_ref(), api_keys, &keys, p);
        for (what, v) in [
            ("requests_per_minute", k.requests_per_minute),
            ("tokens_per_minute", k.tokens_per_minute),
        ] {
            if v == Some(0) {
                p.bad(
                    format_args!("{at}.{what}"),
                    0,
                    "at least 1 (leave it out for no limit)",
                );
            }
        }
        let mut b = GlobSetBuilder::new();
        for (j, m) in k.models.iter().enumerate() {
            match model_glob(m) {
                Ok(g) => {
                    b.add(g);
                }
                Err(_) => p.bad(
                    format_args!("{at}.models[{j}]"),
                    format_args!("{m:?}"),
                    "not a valid glob",
                ),
            }
        }
        let matcher = b.build().unwrap_or_else(|e| {
            p.bad(
                format_args!("{at}.models"),
                format_args!("{:?}", k.models),
                e,
            );
            GlobSet::empty()
        });
        keys.push(Key {
            any_model: k.models.iter().any(|m| m == "*"),
            name: k.name,
            key: k.key,
            requests_per_minute: k.requests_per_minute,
            tokens_per_minute: k.tokens_per_minute,
            models: k.models,
            matcher,
        });
    }
    keys
}

/// A key is not empty, not also in `server.api_keys`, not an earlier
/// entry's; and only one entry goes without.
fn check_secret(
    at: &str,
    key: Option<&Secret>,
    api_keys: &[Secret],
    earlier: &[Key],
    p: &mut Problems,
) {
    match key {
        Some(s) if s.expose().trim().is_empty() => {
            p.bad(
                format_args!("{at}.key"),
                "\"\"",
                "a proxy key must not be empty",
            );
        }
        Some(s) if api_keys.iter().any(|a| a.expose() == s.expose()) => {
            p.say(format!(
                "{at}.key: also in server.api_keys, whose keys have no limits — the [[key]]'s limits would be ignored; keep it in one place"
            ));
        }
        Some(s)
            if earlier
                .iter()
                .any(|o| o.key.as_ref().is_some_and(|ok| ok.expose() == s.expose())) =>
        {
            p.say(format!("{at}.key: the same key as an earlier [[key]]"));
        }
        None if earlier.iter().any(|o| o.key.is_none()) => {
            p.bad(
                format_args!("{at}.key"),
                "(none)",
                "only one [[key]] may be the default for requests without a key",
            );
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{problems, ups};

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
}
