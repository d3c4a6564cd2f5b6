//! `[[model]]`: the user's rows of the model table, each a glob and the
//! capabilities it states. The glob is built here, at load, the way the
//! table matches it.

use globset::{Glob, GlobBuilder};
use serde::Deserialize;

use super::Problems;

/// One `[[model]]` row as written (also the shape of the built-in table's
/// rows, `config/models.toml`).
#[derive(Debug, Clone, Default, Deserialize)]
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
    /// The shortest prefix, in tokens, the provider caches.
    #[serde(default)]
    pub cache_min_tokens: Option<u32>,
}

/// One row, its glob built.
#[derive(Debug, Clone)]
pub struct Model {
    /// `match`, as written.
    pub pattern: String,
    /// `match` as the table matches it ([`model_glob`]).
    pub glob: Glob,
    pub vision: Option<bool>,
    pub audio: Option<bool>,
    pub pdf: Option<bool>,
    pub office: Option<bool>,
    pub max_images: Option<u32>,
    pub context_window: Option<u64>,
    pub cache_min_tokens: Option<u32>,
}

impl Model {
    /// The row with its glob built; `Err` when `match` is not a glob.
    pub fn new(raw: RawModel) -> Result<Model, globset::Error> {
        Ok(Model {
            glob: model_glob(&raw.pattern)?,
            pattern: raw.pattern,
            vision: raw.vision,
            audio: raw.audio,
            pdf: raw.pdf,
            office: raw.office,
            max_images: raw.max_images,
            context_window: raw.context_window,
            cache_min_tokens: raw.cache_min_tokens,
        })
    }
}

/// A `[[model]]` pattern as the model table matches it: case-insensitive
/// (the pattern lower-cased, as each model name is), `*` across `/`.
pub fn model_glob(pattern: &str) -> Result<Glob, globset::Error> {
    GlobBuilder::new(&pattern.to_ascii_lowercase())
        .literal_separator(false)
        .build()
}

/// Every `[[model]]` row, its glob built (a row whose glob is not one is a
/// problem).
pub(super) fn validate(rows: Vec<RawModel>, p: &mut Problems) -> Vec<Model> {
    let mut models = Vec::with_capacity(rows.len());
    for (i, row) in rows.into_iter().enumerate() {
        let pattern = row.pattern.clone();
        match Model::new(row) {
            Ok(m) => models.push(m),
            Err(e) => p.bad(
                format_args!("model[{i}].match"),
                format_args!("{pattern:?}"),
                format_args!("not a valid glob: {e}"),
            ),
        }
    }
    models
}

#[cfg(test)]
mod tests {
    use super::super::testing::problems;

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
}
