//! What the config's unit tests share: loading a text, its problems as one
//! string, upstreams by name.

use std::path::Path;

use super::{Config, ConfigError};

fn env_none(_: &str) -> Option<String> {
    None
}

pub fn load(text: &str) -> Result<Config, ConfigError> {
    Config::from_toml(text, Path::new("test.toml"), &env_none)
}

/// The error as printed, or `(valid)`.
pub fn problems(text: &str) -> String {
    match load(text) {
        Ok(_) => String::from("(valid)"),
        Err(e) => e.to_string(),
    }
}

/// `[[upstream]]`s named as given, at `http://<name>.test/v1`, each with
/// its extra lines.
pub fn ups(extra: &[(&str, &str)]) -> String {
    extra
        .iter()
        .map(|(name, more)| {
            format!(
                "[[upstream]]\nname = \"{name}\"\nbase_url = \"http://{name}.test/v1\"\n{more}\n"
            )
        })
        .collect()
}
