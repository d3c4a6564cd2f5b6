//! Phase 1: TOML text → `${VAR}`s expanded → [`RawConfig`], with the
//! parser's and serde's errors said the way a config's reader thinks.

use std::path::Path;

use super::{ConfigError, RawConfig};

/// Parses `text`, expands `${VAR}` from `env`, and deserialises the result.
pub(super) fn raw(
    text: &str,
    path: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<RawConfig, ConfigError> {
    let table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: path.to_owned(),
        message: with_hint(e.to_string().trim_end()),
    })?;
    let mut missing = Vec::new();
    let mut root = toml::Value::Table(table);
    expand_env(&mut root, &mut String::new(), env, &mut missing);
    if !missing.is_empty() {
        return Err(ConfigError::Invalid {
            path: path.to_owned(),
            problems: missing,
        });
    }
    serde_path_to_error::deserialize(root).map_err(|e| {
        let key = e.path().to_string();
        // The TOML layer appends "in `table`" on a second line; the
        // dotted key already says where.
        let message = e.into_inner().to_string();
        let message = message.lines().next().unwrap_or_default().trim_end();
        let message = plain_types(message);
        ConfigError::Invalid {
            path: path.to_owned(),
            problems: vec![format!("{key}: {message}")],
        }
    })
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
