//! `[[model]]`: the user's rows of the model table, each a glob and the
//! capabilities it states. The glob is built here, at load, the way the
//! table matches it.

use globset::{Glob, GlobBuilder};
use serde::Deserialize;

use super::Problems;
use crate::models::ImageTokens;

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
    /// The provider's image and request limits ([`crate::models::Caps`]
    /// says what each means).
    #[serde(default)]
    pub max_image_bytes: Option<u64>,
    #[serde(default)]
    pub max_image_edge: Option<u32>,
    #[serde(default)]
    pub max_image_pixels: Option<u64>,
    #[serde(default)]
    pub max_request_bytes: Option<u64>,
    #[serde(default)]
    pub many_images: Option<u32>,
    #[serde(default)]
    pub many_images_edge: Option<u32>,
    /// The provider's token formula for images; an unknown name is an
    /// error that lists the known ones.
    #[serde(default)]
    pub image_tokens: Option<ImageTokens>,
    /// Prices in money per million tokens: prompt tokens read at the full
    /// price, prompt tokens read from the provider's cache, prompt tokens
    /// written to it, and completion tokens.
    #[serde(default)]
    pub input: Option<f64>,
    #[serde(default)]
    pub cached_input: Option<f64>,
    #[serde(default)]
    pub cache_write: Option<f64>,
    #[serde(default)]
    pub output: Option<f64>,
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
    /// Image and request limits, and the image token formula
    /// ([`crate::models::Caps`]).
    pub max_image_bytes: Option<u64>,
    pub max_image_edge: Option<u32>,
    pub max_image_pixels: Option<u64>,
    pub max_request_bytes: Option<u64>,
    pub many_images: Option<u32>,
    pub many_images_edge: Option<u32>,
    pub image_tokens: Option<ImageTokens>,
    /// Prices per million tokens ([`RawModel`]).
    pub input: Option<f64>,
    pub cached_input: Option<f64>,
    pub cache_write: Option<f64>,
    pub output: Option<f64>,
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
            max_image_bytes: raw.max_image_bytes,
            max_image_edge: raw.max_image_edge,
            max_image_pixels: raw.max_image_pixels,
            max_request_bytes: raw.max_request_bytes,
            many_images: raw.many_images,
            many_images_edge: raw.many_images_edge,
            image_tokens: raw.image_tokens,
            input: raw.input,
            cached_input: raw.cached_input,
            cache_write: raw.cache_write,
            output: raw.output,
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
/// problem, and so are a price that is not a finite number ≥ 0 and a size
/// limit of 0).
pub(super) fn validate(rows: Vec<RawModel>, p: &mut Problems) -> Vec<Model> {
    let mut models = Vec::with_capacity(rows.len());
    for (i, row) in rows.into_iter().enumerate() {
        // `many_images = 0` is a bound like any other (every request with
        // an image); these five bound a size, and a size of 0 is a mistake.
        for (key, limit) in [
            ("max_image_bytes", row.max_image_bytes),
            ("max_image_edge", row.max_image_edge.map(u64::from)),
            ("max_image_pixels", row.max_image_pixels),
            ("max_request_bytes", row.max_request_bytes),
            ("many_images_edge", row.many_images_edge.map(u64::from)),
        ] {
            if limit == Some(0) {
                p.bad(
                    format_args!("model[{i}].{key}"),
                    0,
                    "must be at least 1 (leave it out for \"not stated\")",
                );
            }
        }
        for (key, price) in [
            ("input", row.input),
            ("cached_input", row.cached_input),
            ("cache_write", row.cache_write),
            ("output", row.output),
        ] {
            if let Some(v) = price
                && !(v.is_finite() && v >= 0.0)
            {
                p.bad(
                    format_args!("model[{i}].{key}"),
                    v,
                    "must be a price per million tokens: a number, 0 or more",
                );
            }
        }
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

    #[test]
    fn model_limits_are_checked() {
        let up = "[[upstream]]\nname=\"a\"\nbase_url=\"http://x\"\n";
        let e = problems(&format!(
            "{up}[[model]]\nmatch = \"x\"\nimage_tokens = \"tiles\"\n"
        ));
        assert!(
            e.contains(
                "model[0].image_tokens: unknown variant `tiles`, expected one of \
                 `anthropic`, `openai_tiles`, `openai_patches`, `gemini`"
            ),
            "{e}"
        );
        let e = problems(&format!(
            "{up}[[model]]\nmatch = \"x\"\nmax_image_edge = 0\nmany_images = 0\n\
             max_request_bytes = 0\n"
        ));
        assert!(
            e.contains("model[0].max_image_edge: 0 — must be at least 1"),
            "{e}"
        );
        assert!(e.contains("model[0].max_request_bytes: 0"), "{e}");
        assert!(!e.contains("many_images:"), "{e}");
        let e = problems(&format!(
            "{up}[[model]]\nmatch = \"claude-*\"\nmax_image_bytes = 5242880\n\
             max_image_edge = 8000\nmax_image_pixels = 64000000\n\
             max_request_bytes = 32000000\nmany_images = 20\nmany_images_edge = 2000\n\
             image_tokens = \"anthropic\"\n\
             [[model]]\nmatch = \"gpt-*\"\nimage_tokens = \"openai_tiles\"\n\
             [[model]]\nmatch = \"o4-*\"\nimage_tokens = \"openai_patches\"\n\
             [[model]]\nmatch = \"gemini-*\"\nimage_tokens = \"gemini\"\n"
        ));
        assert_eq!(e, "(valid)");
    }

    #[test]
    fn model_prices_are_finite_and_not_negative() {
        let up = "[[upstream]]\nname=\"a\"\nbase_url=\"http://x\"\n";
        let e = problems(&format!(
            "{up}[[model]]\nmatch = \"gpt-4o\"\ninput = -2.5\noutput = 10\n\
             [[model]]\nmatch = \"x\"\ncached_input = inf\ncache_write = nan\n"
        ));
        assert!(
            e.contains("model[0].input: -2.5 — must be a price per million tokens"),
            "{e}"
        );
        assert!(!e.contains("model[0].output"), "{e}");
        assert!(e.contains("model[1].cached_input: inf"), "{e}");
        assert!(e.contains("model[1].cache_write: NaN"), "{e}");
        // Integers are prices too; 0 is one (a free model).
        let e = problems(&format!(
            "{up}[[model]]\nmatch = \"gpt-4o\"\ninput = 0\ncached_input = 1.25\n\
             cache_write = 0.0\noutput = 10\n"
        ));
        assert_eq!(e, "(valid)");
    }
}
