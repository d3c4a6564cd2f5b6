//! The model-spec table: which models accept images, documents and audio,
//! how many images, how large a context they take, the shortest prefix
//! their provider caches, the provider's image and request size limits and
//! image token formula, and their prices per million tokens.
//!
//! Resolution for a request: the `x-visor-vision` header, then the user's
//! `[[model]]` rows, then a vision marker in the name ([`vision_marker`]:
//! `qwen2.5vl:7b`, `glm-4.5v`, `llava:13b`…, so a vision member of a
//! text-only family is not caught by the family's row), then the built-in
//! rows (`config/models.toml`, compiled in), then rows learned from
//! upstream refusals; a model none of them states is "unknown" and treated
//! as capable. Each field is taken from the
//! first row that states it, so a user row that only sets `max_images`
//! keeps the built-in vision flag.
//!
//! Names are compared lower case, and each request's model is tried in a few
//! forms so that a provider path (`openrouter/…`), a dotted vendor prefix
//! (`us.anthropic.…`) or a date/version suffix (`-2024-08-06`, `@20240620`,
//! `-v1:0`, `:8b`) does not defeat a match. `scripts/gen_models.py` applies
//! the same normalisation when it builds the built-in table.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::path::Path;
use std::sync::{Arc, OnceLock, RwLock};

use globset::{GlobSet, GlobSetBuilder};
use serde::Deserialize;

use crate::config::{Model, RawModel};

/// The built-in table, compiled in.
const BUILT_IN: &str = include_str!("../config/models.toml");

/// Which formula a provider counts an image's tokens by (`image_tokens` in
/// a `[[model]]` row, written in snake case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImageTokens {
    /// Anthropic: about w·h/750 tokens. The provider first scales an image
    /// down when its long edge is over 1568 px or it is over about 1.15
    /// megapixels.
    Anthropic,
    /// OpenAI's tiles (GPT-4o, GPT-4.1, GPT-4.5, o1, o3, GPT-5): fit in
    /// 2048×2048, scale the shortest side to 768 px, then a fixed number of
    /// tokens per 512-px tile plus a base (170 and 85 for GPT-4o; other
    /// models use other figures).
    OpenaiTiles,
    /// OpenAI's patches (gpt-4.1-mini, gpt-4.1-nano, o4-mini, gpt-5-mini,
    /// gpt-5-nano): 32-px patches, at most 1536, the image scaled down to
    /// fit; the provider multiplies the count per model.
    OpenaiPatches,
    /// Gemini 2.0 and 2.5: 258 tokens when both sides are at most 384 px,
    /// else 258 tokens per 768-px tile.
    Gemini,
}

impl ImageTokens {
    /// The name a `[[model]]` row writes.
    pub fn name(self) -> &'static str {
        match self {
            ImageTokens::Anthropic => "anthropic",
            ImageTokens::OpenaiTiles => "openai_tiles",
            ImageTokens::OpenaiPatches => "openai_patches",
            ImageTokens::Gemini => "gemini",
        }
    }
}

impl fmt::Display for ImageTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a table says about one model. `None` means "not stated".
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Caps {
    pub vision: Option<bool>,
    pub audio: Option<bool>,
    pub pdf: Option<bool>,
    pub office: Option<bool>,
    pub max_images: Option<u32>,
    pub context_window: Option<u64>,
    /// The shortest prefix the provider caches, in tokens.
    pub cache_min_tokens: Option<u32>,
    /// The largest single image the provider takes, in bytes. Visor
    /// compares it with the image's base64 length as sent, not with the
    /// decoded bytes: the stricter reading, and the one Anthropic applies.
    pub max_image_bytes: Option<u64>,
    /// The longest side, in pixels, the provider takes; it refuses a
    /// larger image.
    pub max_image_edge: Option<u32>,
    /// The most pixels (width × height) the provider takes in one image.
    pub max_image_pixels: Option<u64>,
    /// The largest request body the provider takes, in bytes.
    pub max_request_bytes: Option<u64>,
    /// With more images than this in one request, the provider's edge
    /// bound becomes `many_images_edge` (Anthropic: more than 20).
    pub many_images: Option<u32>,
    /// The edge bound, in pixels, of a request with more than
    /// `many_images` images (Anthropic: 2000).
    pub many_images_edge: Option<u32>,
    /// The formula the provider counts an image's tokens by.
    pub image_tokens: Option<ImageTokens>,
    /// Prices per million tokens: prompt tokens at the full price, prompt
    /// tokens read from the provider's cache, prompt tokens written to it,
    /// completion tokens. Each from the first row that states it.
    pub input: Option<f64>,
    pub cached_input: Option<f64>,
    pub cache_write: Option<f64>,
    pub output: Option<f64>,
}

impl Caps {
    fn of_row(m: &Model) -> Self {
        Self {
            vision: m.vision,
            audio: m.audio,
            pdf: m.pdf,
            office: m.office,
            max_images: m.max_images,
            context_window: m.context_window,
            cache_min_tokens: m.cache_min_tokens,
            max_image_bytes: m.max_image_bytes,
            max_image_edge: m.max_image_edge,
            max_image_pixels: m.max_image_pixels,
            max_request_bytes: m.max_request_bytes,
            many_images: m.many_images,
            many_images_edge: m.many_images_edge,
            image_tokens: m.image_tokens,
            input: m.input,
            cached_input: m.cached_input,
            cache_write: m.cache_write,
            output: m.output,
        }
    }
}

/// Where a decision came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The `x-visor-vision` request header.
    Header,
    /// A user `[[model]]` row: index and pattern.
    User(usize, String),
    /// A vision marker in the name (`vl`, `vision`, `4.5v`…): after the
    /// user rows, before the built-in ones.
    Marker(&'static str),
    /// A built-in row: index and pattern.
    BuiltIn(usize, String),
    /// Learned from an upstream refusal (the learned name).
    Learned(String),
    /// No row states it.
    Unknown,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Header => f.write_str("x-visor-vision header"),
            Source::User(i, p) => write!(f, "user row model[{i}] match = {p:?}"),
            Source::Marker(m) => write!(f, "vision marker {m:?} in the name (built in)"),
            Source::BuiltIn(i, p) => write!(f, "built-in row {i} match = {p:?}"),
            Source::Learned(n) => write!(f, "learned: {n:?} refused images"),
            Source::Unknown => f.write_str("no row (unknown: treated as capable)"),
        }
    }
}

/// The table's answer for one model.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub caps: Caps,
    /// Whether images may be sent: the stated flag, else true (unknown).
    pub vision: bool,
    pub vision_from: Source,
    /// Whether PDFs (and other documents but Office files), Office files
    /// and audio may be sent as they are. A flag no row states follows
    /// `vision` for PDFs and audio (a model that cannot see reads no PDF
    /// and hears nothing; a refusal teaches the rest), unless a refusal
    /// taught it; Office files only when a row says `office = true`.
    pub pdf: bool,
    pub office: bool,
    pub audio: bool,
}

impl Resolved {
    /// True when some row (or the header) states the vision flag: visor then
    /// never tries to learn it.
    pub fn known(&self) -> bool {
        self.vision_from != Source::Unknown
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error("built-in model table: {0}")]
    BuiltIn(String),
}

struct Layer {
    patterns: Vec<String>,
    caps: Vec<Caps>,
    set: GlobSet,
}

impl Layer {
    /// The rows' globs, built at load, in one set.
    fn new(rows: &[Model]) -> Result<Self, TableError> {
        let mut b = GlobSetBuilder::new();
        for r in rows {
            b.add(r.glob.clone());
        }
        Ok(Self {
            patterns: rows.iter().map(|r| r.pattern.clone()).collect(),
            caps: rows.iter().map(Caps::of_row).collect(),
            set: b
                .build()
                .map_err(|e| TableError::BuiltIn(format!("glob set: {e}")))?,
        })
    }

    /// Indices of matching rows for any of the name's forms, in row order.
    fn matching(&self, forms: &[String]) -> Vec<usize> {
        let mut hits = Vec::new();
        for f in forms {
            hits.extend(self.set.matches(f.as_str()));
        }
        hits.sort_unstable();
        hits.dedup();
        hits
    }
}

/// A medium a refusal can teach a model not to take, besides images.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    Pdf,
    Audio,
}

impl Medium {
    /// How a learned row for this medium is kept among the learned names
    /// (a model name never holds `[` or a space, so it never matches a
    /// name learned for images).
    pub fn learned_name(self, model: &str) -> String {
        match self {
            Medium::Pdf => format!("[pdf] {model}"),
            Medium::Audio => format!("[audio] {model}"),
        }
    }

    /// A learned name read back: the medium it was learned for (`None`:
    /// images) and the model.
    pub fn of_learned(name: &str) -> (Option<Medium>, &str) {
        if let Some(model) = name.strip_prefix("[pdf] ") {
            (Some(Medium::Pdf), model)
        } else if let Some(model) = name.strip_prefix("[audio] ") {
            (Some(Medium::Audio), model)
        } else {
            (None, name)
        }
    }
}

/// Models learned to refuse images, held in memory for the table lookup.
/// They are kept in the store (`[store]`): loaded at start, written when
/// learned, and re-read every [`LEARNED_REFRESH`] so replicas sharing a
/// Redis store learn together.
#[derive(Default)]
pub struct Learned {
    names: RwLock<BTreeSet<String>>,
}

/// How often the learned rows are re-read from the store.
pub const LEARNED_REFRESH: std::time::Duration = std::time::Duration::from_secs(30);

impl Learned {
    pub fn new(names: impl IntoIterator<Item = String>) -> Self {
        let l = Self::default();
        l.merge(names);
        l
    }

    pub fn len(&self) -> usize {
        self.names.read().map(|n| n.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn names(&self) -> Vec<String> {
        self.names
            .read()
            .map(|n| n.iter().cloned().collect())
            .unwrap_or_default()
    }

    fn find(&self, forms: &[String]) -> Option<String> {
        let names = self.names.read().ok()?;
        forms.iter().find(|f| names.contains(f.as_str())).cloned()
    }

    /// Whether a refusal taught that the model does not take `medium`.
    fn find_media(&self, medium: Medium, forms: &[String]) -> bool {
        let Ok(names) = self.names.read() else {
            return false;
        };
        // Most tables learn nothing: no name built per lookup then.
        if names.is_empty() {
            return false;
        }
        forms
            .iter()
            .any(|f| names.contains(&medium.learned_name(f)))
    }

    /// Records `model` as unable to take `medium` (see [`Learned::learn`]).
    pub fn learn_media(&self, medium: Medium, model: &str) -> Option<String> {
        let name = normalise(model);
        if name.is_empty() {
            return None;
        }
        let name = medium.learned_name(&name);
        let mut names = self.names.write().ok()?;
        names.insert(name.clone()).then_some(name)
    }

    /// Records `model` as unable to take images. Returns the name it is
    /// kept under (normalised) when it was not known yet; the caller
    /// writes it to the store.
    pub fn learn(&self, model: &str) -> Option<String> {
        let name = normalise(model);
        if name.is_empty() {
            // A request without a model: nothing to remember it by.
            return None;
        }
        let mut names = self.names.write().ok()?;
        names.insert(name.clone()).then_some(name)
    }

    /// Adds names learned elsewhere (read from the store); returns how many
    /// were new.
    pub fn merge(&self, names: impl IntoIterator<Item = String>) -> usize {
        let Ok(mut known) = self.names.write() else {
            return 0;
        };
        names
            .into_iter()
            .filter(|n| !n.is_empty())
            .map(|n| usize::from(known.insert(n)))
            .sum()
    }
}

/// The names in `<data_dir>/learned-models.json`, where visor kept learned
/// models before the store existed; empty when there is no such file. The
/// caller moves them into the store.
pub fn legacy_learned(path: &Path) -> Vec<String> {
    match std::fs::read_to_string(path) {
        Ok(text) => match serde_json::from_str::<LearnedFile>(&text) {
            Ok(f) => f.non_vision,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "ignoring unreadable learned-models file");
                Vec::new()
            }
        },
        Err(_) => Vec::new(),
    }
}

#[derive(Deserialize)]
struct LearnedFile {
    non_vision: Vec<String>,
}

pub struct ModelTable {
    user: Layer,
    builtin: Arc<Layer>,
    pub learned: Learned,
    cache: RwLock<HashMap<String, (Caps, Source)>>,
}

#[derive(Deserialize)]
struct BuiltInFile {
    model: Vec<RawModel>,
}

/// The built-in rows, parsed and their globs built once per process (the
/// table holds some 1,600 rows, most of them prices; a test process builds
/// many tables).
fn builtin_layer() -> Result<Arc<Layer>, TableError> {
    static LAYER: OnceLock<Result<Arc<Layer>, String>> = OnceLock::new();
    LAYER
        .get_or_init(|| {
            let file: BuiltInFile = toml::from_str(BUILT_IN).map_err(|e| e.to_string())?;
            let rows = file
                .model
                .into_iter()
                .enumerate()
                .map(|(i, r)| {
                    let pattern = r.pattern.clone();
                    Model::new(r).map_err(|e| format!("row {i} match = {pattern:?}: {e}"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            Layer::new(&rows).map(Arc::new).map_err(|e| match e {
                TableError::BuiltIn(m) => m,
            })
        })
        .clone()
        .map_err(TableError::BuiltIn)
}

impl ModelTable {
    pub fn new(user: &[Model], learned: Learned) -> Result<Self, TableError> {
        Ok(Self {
            user: Layer::new(user)?,
            builtin: builtin_layer()?,
            learned,
            cache: RwLock::new(HashMap::new()),
        })
    }

    pub fn builtin_len(&self) -> usize {
        self.builtin.patterns.len()
    }

    pub fn user_rows(&self) -> impl Iterator<Item = (&str, &Caps)> {
        self.user
            .patterns
            .iter()
            .map(String::as_str)
            .zip(&self.user.caps)
    }

    /// The table's answer for `model`; `header` is the `x-visor-vision`
    /// override, when the request has one.
    /// What the user and built-in rows say of `model` (no header, nothing
    /// learned).
    pub fn caps(&self, model: &str) -> Caps {
        self.rows(model).0
    }

    pub fn resolve(&self, model: &str, header: Option<bool>) -> Resolved {
        let (mut caps, mut vision_from) = self.rows(model);
        if let Some(v) = header {
            caps.vision = Some(v);
            vision_from = Source::Header;
        }
        if caps.vision.is_none()
            && let Some(name) = self.learned.find(&candidates(model))
        {
            caps.vision = Some(false);
            vision_from = Source::Learned(name);
        }
        let vision = caps.vision.unwrap_or(true);
        let learned = |medium: Medium| {
            !self.learned.is_empty() && self.learned.find_media(medium, &candidates(model))
        };
        Resolved {
            vision,
            pdf: caps.pdf.unwrap_or_else(|| vision && !learned(Medium::Pdf)),
            office: caps.office.unwrap_or(false),
            audio: caps
                .audio
                .unwrap_or_else(|| vision && !learned(Medium::Audio)),
            caps,
            vision_from,
        }
    }

    /// What the user and built-in rows say, remembered per model name (the
    /// rows never change while visor runs). Measured with `wrk -c1` against
    /// the binary before the table existed: without this cache a request
    /// paid about 30 µs more at p50, though the same lookup takes 0.7 µs in
    /// a criterion loop — where inside the glob set the time goes in the
    /// server was not pinned down. At most [`MAX_CACHED`] names are kept;
    /// the cache starts over when full.
    fn rows(&self, model: &str) -> (Caps, Source) {
        if let Ok(cache) = self.cache.read()
            && let Some(hit) = cache.get(model)
        {
            return hit.clone();
        }
        let found = self.rows_uncached(model);
        if let Ok(mut cache) = self.cache.write() {
            if cache.len() >= MAX_CACHED {
                cache.clear();
            }
            cache.insert(model.to_owned(), found.clone());
        }
        found
    }

    fn rows_uncached(&self, model: &str) -> (Caps, Source) {
        let forms = candidates(model);
        let mut caps = Caps::default();
        let mut vision_from = Source::Unknown;
        for (layer, is_user) in [(&self.user, true), (&self.builtin, false)] {
            if !is_user
                && caps.vision.is_none()
                && let Some(m) = vision_marker(model)
            {
                caps.vision = Some(true);
                vision_from = Source::Marker(m);
            }
            for i in layer.matching(&forms) {
                let row = &layer.caps[i];
                if caps.vision.is_none() && row.vision.is_some() {
                    caps.vision = row.vision;
                    let p = layer.patterns[i].clone();
                    vision_from = if is_user {
                        Source::User(i, p)
                    } else {
                        Source::BuiltIn(i, p)
                    };
                }
                caps.audio = caps.audio.or(row.audio);
                caps.pdf = caps.pdf.or(row.pdf);
                caps.office = caps.office.or(row.office);
                caps.max_images = caps.max_images.or(row.max_images);
                caps.context_window = caps.context_window.or(row.context_window);
                caps.cache_min_tokens = caps.cache_min_tokens.or(row.cache_min_tokens);
                caps.max_image_bytes = caps.max_image_bytes.or(row.max_image_bytes);
                caps.max_image_edge = caps.max_image_edge.or(row.max_image_edge);
                caps.max_image_pixels = caps.max_image_pixels.or(row.max_image_pixels);
                caps.max_request_bytes = caps.max_request_bytes.or(row.max_request_bytes);
                caps.many_images = caps.many_images.or(row.many_images);
                caps.many_images_edge = caps.many_images_edge.or(row.many_images_edge);
                caps.image_tokens = caps.image_tokens.or(row.image_tokens);
                caps.input = caps.input.or(row.input);
                caps.cached_input = caps.cached_input.or(row.cached_input);
                caps.cache_write = caps.cache_write.or(row.cache_write);
                caps.output = caps.output.or(row.output);
            }
        }
        // A model known to see only by a marker in its name (a local VL
        // model on Ollama or vLLM) takes images, not files or speech — unless
        // a row says otherwise, or it is an `omni` model.
        if let Source::Marker(m) = &vision_from
            && *m != "omni"
        {
            caps.pdf = caps.pdf.or(Some(false));
            caps.audio = caps.audio.or(Some(false));
        }
        (caps, vision_from)
    }
}

/// The vision marker in a model's name, if it has one: a token that names a
/// model which sees, in any naming style — `qwen2.5vl:7b` (Ollama),
/// `qwen/qwen2.5-vl-72b-instruct` (OpenRouter), `Qwen/Qwen2.5-VL-7B-Instruct`
/// (Hugging Face), `glm-4.5v`, `llava:13b`, `llama-3.2-11b-vision`,
/// `qwen2.5-omni-7b`. The last path segment is cut into runs of letters and
/// runs of digits (everything else separates), and a run of letters is a
/// marker when it is `vl`, `vlm` (or ends in it: `smolvlm`), `vision`,
/// `omni`, ends in `llava` (`bakllava`), is `internvl`, `qvq`, or is a lone
/// `v` glued to the version before it and followed by no digit (`4.5v`,
/// `5v-turbo`, `4p5v`, `step-1v`). So `deepseek-v3` (`v` then a version),
/// `devstral`, `vllm`, `vicuna` carry none.
pub fn vision_marker(model: &str) -> Option<&'static str> {
    let lower = model.trim().to_ascii_lowercase();
    let name = lower.rsplit('/').next().unwrap_or(&lower);
    let b = name.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if !b[i].is_ascii_lowercase() {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && b[i].is_ascii_lowercase() {
            i += 1;
        }
        let run = &name[start..i];
        let found = match run {
            "vl" | "vlm" => Some("vl"),
            "vision" => Some("vision"),
            "omni" => Some("omni"),
            "internvl" => Some("internvl"),
            "qvq" => Some("qvq"),
            "v" if start > 0
                && b[start - 1].is_ascii_digit()
                && !b.get(i).is_some_and(u8::is_ascii_digit) =>
            {
                Some("v")
            }
            r if r.ends_with("llava") => Some("llava"),
            r if r.ends_with("vlm") => Some("vl"),
            _ => None,
        };
        if found.is_some() {
            return found;
        }
    }
    None
}

/// Model names whose table answer is remembered.
const MAX_CACHED: usize = 4096;

/// The forms a requested model name is matched in, most specific first:
/// as sent (lower case), without its provider path, without a dotted vendor
/// or region prefix, and without version/date/tag suffixes.
pub fn candidates(model: &str) -> Vec<String> {
    let lower = model.trim().to_ascii_lowercase();
    let mut out = vec![lower.clone()];
    let mut push = |s: &str| {
        if !s.is_empty() && !out.iter().any(|o| o == s) {
            out.push(s.to_owned());
        }
    };
    let base = lower.rsplit('/').next().unwrap_or(&lower);
    push(base);
    let unprefixed = strip_prefixes(base);
    push(unprefixed);
    push(strip_suffixes(unprefixed));
    out
}

/// The fully normalised name: the last of [`candidates`].
pub fn normalise(model: &str) -> String {
    candidates(model).pop().unwrap_or_default()
}

const REGIONS: &[&str] = &[
    "us.", "eu.", "apac.", "global.", "jp.", "au.", "ca.", "us-gov.",
];

/// `us.anthropic.claude…` → `claude…`: a region, then a vendor made of
/// `[a-z0-9_-]` that starts with a letter and is followed by a letter.
fn strip_prefixes(name: &str) -> &str {
    let mut n = name;
    for r in REGIONS {
        if let Some(rest) = n.strip_prefix(r) {
            n = rest;
            break;
        }
    }
    let bytes = n.as_bytes();
    if bytes.first().is_some_and(u8::is_ascii_lowercase)
        && let Some(dot) = n.find('.')
        && n[..dot]
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        && bytes.get(dot + 1).is_some_and(u8::is_ascii_lowercase)
    {
        n = &n[dot + 1..];
    }
    n
}

/// Drops trailing `:tag`, `-vN`, `@…`, `-YYYY-MM-DD`, `-YYYYMMDD`, `-MMDD`
/// and `-latest`, repeatedly, never down to nothing.
fn strip_suffixes(name: &str) -> &str {
    let mut n = name;
    loop {
        let before = n;
        if let Some(i) = n.rfind(':')
            && n[i + 1..]
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        {
            n = &n[..i];
        }
        if let Some(i) = n.rfind('@')
            && n[i + 1..]
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            n = &n[..i];
        }
        if let Some(i) = n.rfind("-v")
            && n.len() > i + 2
            && n[i + 2..].bytes().all(|b| b.is_ascii_digit())
        {
            n = &n[..i];
        }
        n = n.strip_suffix("-latest").unwrap_or(n);
        n = strip_date(n);
        if n == before || n.is_empty() {
            return if n.is_empty() { before } else { n };
        }
    }
}

fn strip_date(n: &str) -> &str {
    let b = n.as_bytes();
    let digits = |s: &[u8]| s.iter().all(u8::is_ascii_digit);
    let ends = |len: usize, shape: &dyn Fn(&[u8]) -> bool| {
        b.len() > len + 1 && b[b.len() - len - 1] == b'-' && shape(&b[b.len() - len..])
    };
    let iso = |s: &[u8]| {
        digits(&s[0..4]) && s[4] == b'-' && digits(&s[5..7]) && s[7] == b'-' && digits(&s[8..10])
    };
    if ends(10, &iso) {
        return &n[..n.len() - 11];
    }
    if ends(8, &digits) {
        return &n[..n.len() - 9];
    }
    if ends(4, &digits) {
        return &n[..n.len() - 5];
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> ModelTable {
        ModelTable::new(&[], Learned::default()).unwrap()
    }

    #[test]
    fn candidates_strip_prefixes_and_suffixes() {
        assert_eq!(
            candidates("us.anthropic.claude-3-5-sonnet-20240620-v1:0"),
            vec![
                "us.anthropic.claude-3-5-sonnet-20240620-v1:0",
                "claude-3-5-sonnet-20240620-v1:0",
                "claude-3-5-sonnet"
            ]
        );
        assert_eq!(normalise("openrouter/openai/GPT-4o-2024-08-06"), "gpt-4o");
        assert_eq!(normalise("claude-3-5-sonnet@20240620"), "claude-3-5-sonnet");
        assert_eq!(normalise("gpt-4-0613"), "gpt-4");
        assert_eq!(normalise("llama3.1:8b"), "llama3.1");
        assert_eq!(normalise("gpt-4.1"), "gpt-4.1");
        assert_eq!(normalise("mistral-large-latest"), "mistral-large");
        assert_eq!(normalise("-2024-01-01"), "-2024-01-01");
        assert_eq!(normalise(""), "");
    }

    /// `config/models.toml` parses, every row's glob builds.
    #[test]
    fn built_in_table_loads_whole() {
        assert!(table().builtin_len() > 200);
    }

    /// Known answers both ways, through provider prefixes and date suffixes.
    #[test]
    fn built_in_table_known_answers() {
        let t = table();
        let cannot_see = [
            "gpt-oss-120b",
            "gpt-oss-20b",
            "openrouter/openai/gpt-oss-120b",
            "deepseek-chat",
            "deepseek-reasoner",
            "deepseek/deepseek-chat",
            "deepseek-r1",
            "gpt-3.5-turbo",
            "gpt-3.5-turbo-0125",
            "azure/gpt-35-turbo",
            "gpt-4",
            "gpt-4-0613",
            "o1-mini",
            "o3-mini-2025-01-31",
            "meta-llama/Llama-3.3-70B-Instruct",
            "llama-3.1-8b-instruct",
            "llama3.1:8b",
            "Qwen/Qwen2.5-72B-Instruct",
            "qwen3-32b",
            "qwq-32b",
            "mixtral-8x7b-instruct",
            "mistral-7b-instruct-v0.3",
            "codestral-latest",
            "glm-4.6",
            "command-r-plus",
            "kimi-k2-instruct",
        ];
        let can_see = [
            "gpt-4o",
            "gpt-4o-2024-08-06",
            "gpt-4o-mini",
            "azure/gpt-4o",
            "gpt-4.1",
            "gpt-5",
            "gpt-4-turbo",
            "o1",
            "claude-3-5-sonnet-20240620",
            "us.anthropic.claude-3-5-sonnet-20240620-v1:0",
            "claude-opus-4-1",
            "gemini-2.5-flash",
            "gemini/gemini-1.5-pro",
            "Qwen/Qwen2.5-VL-72B-Instruct",
            "qwen-vl-max",
            "llama-3.2-11b-vision-instruct",
            "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
            "pixtral-12b",
            "grok-4",
            "gemma-3-27b-it",
        ];
        for m in cannot_see {
            let r = t.resolve(m, None);
            assert!(!r.vision && r.known(), "{m}: {r:?}");
        }
        for m in can_see {
            let r = t.resolve(m, None);
            assert!(r.vision && r.known(), "{m}: {r:?}");
        }
        let unknown = t.resolve("my-own-finetune-7b", None);
        assert!(unknown.vision && !unknown.known());
    }

    /// A model seen by its marker alone takes images, not PDFs or audio
    /// (an `omni` one is left to its rows).
    #[test]
    fn a_marker_vision_model_takes_no_files_or_speech() {
        let table = ModelTable::new(&[], Learned::default()).unwrap();
        for m in ["qwen2.5vl:7b", "llava:13b"] {
            let r = table.resolve(m, None);
            assert!(r.vision, "{m}");
            assert_eq!(
                (r.caps.pdf, r.caps.audio),
                (Some(false), Some(false)),
                "{m}"
            );
        }
    }

    /// Vision markers are tokens, in every naming style, and a version `v`
    /// is not one.
    #[test]
    fn vision_markers_are_tokens() {
        let marked = [
            ("qwen2.5vl:7b", "vl"),
            ("qwen/qwen2.5-vl-72b-instruct", "vl"),
            ("Qwen/Qwen2.5-VL-7B-Instruct", "vl"),
            ("accounts/fireworks/models/qwen2p5-vl-32b-instruct", "vl"),
            ("deepseek-ai/DeepSeek-VL2", "vl"),
            ("HuggingFaceTB/SmolVLM-Instruct", "vl"),
            ("zai-org/GLM-4.5V", "v"),
            ("glm-5v-turbo", "v"),
            ("accounts/fireworks/models/glm-4p5v", "v"),
            ("zai-org/GLM-4.1V-9B-Thinking", "v"),
            ("step-1v-8k", "v"),
            ("llava:13b", "llava"),
            ("bakllava:7b", "llava"),
            ("llama3.2-vision:11b", "vision"),
            ("grok-2-vision-1212", "vision"),
            ("Qwen/Qwen2.5-Omni-7B", "omni"),
            ("OpenGVLab/InternVL3-8B", "internvl"),
            ("Qwen/QVQ-72B-Preview", "qvq"),
        ];
        for (m, want) in marked {
            assert_eq!(vision_marker(m), Some(want), "{m}");
        }
        let unmarked = [
            "deepseek-v3",
            "deepseek-ai/DeepSeek-V3.2-Exp",
            "deepseek-v4-pro",
            "devstral-small-2507",
            "vllm/my-model",
            "vllm-served-llama",
            "mistral-7b-instruct-v0.3",
            "lmsys/vicuna-13b-v1.5",
            "claude-3-5-sonnet-20240620-v1:0",
            "accounts/fireworks/models/llama-v3p1-8b-instruct",
            "kimi-dev-72b",
            "moonshot-v1-8k",
            "mimo-v2-flash",
            "gemma3:27b",
            "qwen2.5:7b",
            "gpt-4o",
            "",
        ];
        for m in unmarked {
            assert_eq!(vision_marker(m), None, "{m}");
        }
        // The marker beats the text-only family row (`qwen2.5*`), and a
        // user row beats the marker.
        let r = table().resolve("qwen2.5vl:7b", None);
        assert!(r.vision);
        assert_eq!(r.vision_from, Source::Marker("vl"));
        let user = [Model::new(RawModel {
            pattern: "qwen2.5vl*".into(),
            vision: Some(false),
            audio: None,
            pdf: None,
            office: None,
            max_images: None,
            context_window: None,
            ..RawModel::default()
        })
        .unwrap()];
        let t = ModelTable::new(&user, Learned::default()).unwrap();
        assert!(!t.resolve("qwen2.5vl:7b", None).vision);
    }

    /// Real model ids, in each naming style (Ollama tags, OpenRouter paths,
    /// Hugging Face repo ids, provider and cloud ids), with the vision fact
    /// their publishers document.
    const REAL_MODEL_IDS: &[(&str, bool)] = &[
        // Ollama
        ("qwen2.5vl:7b", true),
        ("qwen2.5vl:72b", true),
        ("llava:13b", true),
        ("llava:7b-v1.6", true),
        ("bakllava:7b", true),
        ("llava-llama3:8b", true),
        ("gemma3:27b", true),
        ("gemma3:4b", true),
        ("gemma3:1b", false),
        ("gemma3:270m", false),
        ("gemma3n:e4b", true),
        ("llama3.2-vision:11b", true),
        ("llama4:scout", true),
        ("llama3.1:8b", false),
        ("qwen3:8b", false),
        ("qwen3-coder:30b", false),
        ("qwen3-vl:8b", true),
        ("qwen3.5:27b", true),
        ("qwen2.5:7b", false),
        ("qwen2.5-coder:7b", false),
        ("deepseek-r1:8b", false),
        ("deepseek-v3.1:671b-cloud", false),
        ("gpt-oss:20b", false),
        ("gpt-oss:120b-cloud", false),
        ("minicpm-v:8b", true),
        ("mistral-small3.1:24b", true),
        ("granite3.2-vision:2b", true),
        ("ministral-3:8b", true),
        ("kimi-k2.5:cloud", true),
        ("glm-4.6:cloud", false),
        // OpenRouter
        ("qwen/qwen2.5-vl-72b-instruct", true),
        ("qwen/qwen3-vl-235b-a22b-instruct", true),
        ("qwen/qwen3-235b-a22b-2507", false),
        ("qwen/qwen3-coder", false),
        ("qwen/qwen3-next-80b-a3b-instruct", false),
        ("qwen/qwen3.5-9b", true),
        ("meta-llama/llama-4-maverick", true),
        ("meta-llama/llama-4-scout", true),
        ("meta-llama/llama-3.3-70b-instruct", false),
        ("meta-llama/llama-3.2-11b-vision-instruct", true),
        ("deepseek/deepseek-chat-v3.1", false),
        ("deepseek/deepseek-v3.2", false),
        ("deepseek/deepseek-v3.2-exp", false),
        ("deepseek/deepseek-r1-0528", false),
        ("deepseek/deepseek-v4-pro", false),
        ("deepseek/deepseek-v4-flash-vision-exp", true),
        ("z-ai/glm-4.5", false),
        ("z-ai/glm-4.5-air", false),
        ("z-ai/glm-4.5v", true),
        ("z-ai/glm-4.6", false),
        ("z-ai/glm-4.6v", true),
        ("z-ai/glm-4.7", false),
        ("z-ai/glm-5", false),
        ("z-ai/glm-5.1", false),
        ("minimax/minimax-m2", false),
        ("minimax/minimax-m2.1", false),
        ("minimax/minimax-m2.5", false),
        ("moonshotai/kimi-k2", false),
        ("moonshotai/kimi-k2-0905", false),
        ("moonshotai/kimi-k2-thinking", false),
        ("moonshotai/kimi-k2.5", true),
        ("openai/gpt-oss-120b", false),
        ("google/gemma-3-27b-it", true),
        ("google/gemma-3-4b-it", true),
        ("google/gemma-3n-e4b-it", true),
        ("mistralai/mistral-small-3.2-24b-instruct", true),
        ("mistralai/codestral-2508", false),
        ("mistralai/mistral-large-2512", true),
        ("mistralai/mistral-large-2411", false),
        ("mistralai/ministral-8b-2512", true),
        ("openai/gpt-4o", true),
        ("x-ai/grok-4", true),
        // Hugging Face repo ids
        ("Qwen/Qwen2.5-VL-7B-Instruct", true),
        ("Qwen/Qwen2.5-VL-72B-Instruct-AWQ", true),
        ("Qwen/Qwen3-VL-30B-A3B-Instruct", true),
        ("Qwen/Qwen3-8B", false),
        ("Qwen/Qwen3-Coder-480B-A35B-Instruct", false),
        ("Qwen/Qwen2.5-Omni-7B", true),
        ("Qwen/Qwen3-Omni-30B-A3B-Instruct", true),
        ("Qwen/QVQ-72B-Preview", true),
        ("Qwen/Qwen3.5-397B-A17B", true),
        ("zai-org/GLM-4.5V", true),
        ("zai-org/GLM-4.6V", true),
        ("zai-org/GLM-4.1V-9B-Thinking", true),
        ("zai-org/GLM-4.5", false),
        ("zai-org/GLM-4.5-Air", false),
        ("zai-org/GLM-4.6", false),
        ("deepseek-ai/DeepSeek-V3", false),
        ("deepseek-ai/DeepSeek-V3.1-Terminus", false),
        ("deepseek-ai/DeepSeek-V3.2-Exp", false),
        ("deepseek-ai/DeepSeek-VL2", true),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", false),
        ("moonshotai/Kimi-K2-Instruct", false),
        ("moonshotai/Kimi-K2.5", true),
        ("moonshotai/Kimi-VL-A3B-Instruct", true),
        ("MiniMaxAI/MiniMax-M2", false),
        ("meta-llama/Llama-4-Scout-17B-16E-Instruct", true),
        ("meta-llama/Llama-3.2-11B-Vision-Instruct", true),
        ("openai/gpt-oss-20b", false),
        ("google/gemma-3-1b-it", false),
        ("google/gemma-3-12b-it", true),
        ("google/gemma-3-270m-it", false),
        ("llava-hf/llava-1.5-7b-hf", true),
        ("llava-hf/llava-v1.6-mistral-7b-hf", true),
        ("OpenGVLab/InternVL3-8B", true),
        ("HuggingFaceTB/SmolVLM-Instruct", true),
        ("microsoft/Phi-3.5-vision-instruct", true),
        ("mistralai/Mistral-Small-3.1-24B-Instruct-2503", true),
        ("mistralai/Devstral-Small-2505", false),
        ("mistralai/Ministral-3-8B-Instruct-2512", true),
        ("mistralai/Mistral-Large-3-675B-Instruct-2512", true),
        ("mistralai/Codestral-22B-v0.1", false),
        ("mistralai/Pixtral-12B-2409", true),
        // provider and cloud ids
        ("glm-4.5v", true),
        ("glm-4.6v", true),
        ("glm-5v-turbo", true),
        ("glm-4.5", false),
        ("glm-4.7", false),
        ("glm-5", false),
        ("deepseek-chat", false),
        ("deepseek-reasoner", false),
        ("kimi-k2-0905-preview", false),
        ("kimi-k2-turbo-preview", false),
        ("kimi-k2.5", true),
        ("MiniMax-M2", false),
        ("qwen3-vl-plus", true),
        ("qwen-vl-max", true),
        ("qwen3-max", false),
        ("qwen3-coder-plus", false),
        ("accounts/fireworks/models/glm-4p5v", true),
        ("accounts/fireworks/models/qwen2p5-vl-32b-instruct", true),
        ("accounts/fireworks/models/deepseek-v3p1", false),
        ("us.meta.llama4-maverick-17b-instruct-v1:0", true),
        ("qwen.qwen3-vl-235b-a22b", true),
        ("qwen.qwen3-32b-v1:0", false),
        ("openai.gpt-oss-120b-1:0", false),
        ("step-1v-8k", true),
        ("grok-2-vision-1212", true),
        ("pixtral-large-latest", true),
        ("codestral-latest", false),
    ];

    #[test]
    fn real_model_ids_in_every_naming_style() {
        let t = table();
        let cases = REAL_MODEL_IDS;
        assert!(cases.len() >= 60);
        let wrong: Vec<String> = cases
            .iter()
            .filter_map(|&(m, want)| {
                let r = t.resolve(m, None);
                (r.vision != want || !r.known())
                    .then(|| format!("{m}: want {want}, got {} from {}", r.vision, r.vision_from))
            })
            .collect();
        assert!(
            wrong.is_empty(),
            "{} wrong:\n{}",
            wrong.len(),
            wrong.join("\n")
        );
    }

    /// The providers' documented shortest cached prefix (the sources are
    /// cited beside `CACHE_MIN_TOKENS` in `scripts/gen_models.py`), through
    /// provider paths, vendor prefixes and date suffixes; a model no row
    /// states stays `None` (the cache code assumes 1024).
    #[test]
    fn built_in_cache_min_tokens_follow_the_providers_docs() {
        let t = table();
        let cases: &[(&str, Option<u32>)] = &[
            // Anthropic: Haiku 3 and 3.5 need 2,048 tokens.
            ("claude-3-5-haiku-20241022", Some(2048)),
            ("anthropic/claude-3-5-haiku-20241022", Some(2048)),
            ("us.anthropic.claude-3-5-haiku-20241022-v1:0", Some(2048)),
            ("claude-3-5-haiku@20241022", Some(2048)),
            ("openrouter/anthropic/claude-3.5-haiku", Some(2048)),
            ("claude-3-haiku-20240307", Some(2048)),
            // Sonnet 3.5 to 4.6, Opus 4, 4.1, 4.8, Sonnet 5: 1,024.
            ("claude-3-5-sonnet-20241022", Some(1024)),
            ("claude-3-7-sonnet-latest", Some(1024)),
            ("claude-sonnet-4-20250514", Some(1024)),
            ("claude-sonnet-4-5-20250929", Some(1024)),
            ("anthropic/claude-sonnet-4.6", Some(1024)),
            ("claude-opus-4-20250514", Some(1024)),
            ("claude-opus-4-1-20250805", Some(1024)),
            ("claude-opus-4-8", Some(1024)),
            ("claude-sonnet-5", Some(1024)),
            // Opus 4.5, 4.6 and Haiku 4.5: 4,096; Opus 4.7: 2,048.
            ("claude-opus-4-5-20251101", Some(4096)),
            ("anthropic/claude-opus-4.6", Some(4096)),
            ("claude-haiku-4-5-20251001", Some(4096)),
            ("eu.anthropic.claude-haiku-4-5-20251001-v1:0", Some(4096)),
            ("claude-opus-4-7", Some(2048)),
            // The 5.x generation: 512, but Sonnet 5 (above).
            ("claude-opus-5", Some(512)),
            ("claude-sonnet-5-5", Some(512)),
            ("anthropic/claude-opus-5.5", Some(512)),
            // OpenAI: 1,024 from gpt-4o on.
            ("gpt-4o", Some(1024)),
            ("openai/gpt-4o-2024-08-06", Some(1024)),
            ("gpt-4.1-mini", Some(1024)),
            ("gpt-5.1", Some(1024)),
            ("o3-mini-2025-01-31", Some(1024)),
            // DeepSeek: 64-token units.
            ("deepseek-chat", Some(64)),
            ("deepseek/deepseek-reasoner", Some(64)),
            // Gemini implicit caching.
            ("gemini-2.5-flash", Some(2048)),
            ("google/gemini-2.5-pro", Some(2048)),
            ("gemini-3.1-pro-preview", Some(4096)),
            // Not documented: no row, the default applies.
            ("gemini-2.5-flash-lite", None),
            ("llama3.1:8b", None),
            ("my-own-finetune-7b", None),
        ];
        let wrong: Vec<String> = cases
            .iter()
            .filter_map(|&(m, want)| {
                let got = t.resolve(m, None).caps.cache_min_tokens;
                (got != want).then(|| format!("{m}: want {want:?}, got {got:?}"))
            })
            .collect();
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        // A user row's own figure comes first.
        let user = Model::new(RawModel {
            pattern: "claude-3-5-haiku*".into(),
            cache_min_tokens: Some(1024),
            ..RawModel::default()
        })
        .unwrap();
        let t = ModelTable::new(&[user], Learned::default()).unwrap();
        let r = t.resolve("anthropic/claude-3-5-haiku-20241022", None);
        assert_eq!(r.caps.cache_min_tokens, Some(1024));
    }

    /// The limit fields of one model, in the order `Caps` holds them.
    type Limits = (
        Option<u64>,
        Option<u32>,
        Option<u64>,
        Option<u64>,
        Option<u32>,
        Option<u32>,
        Option<ImageTokens>,
    );

    fn limits(c: &Caps) -> Limits {
        (
            c.max_image_bytes,
            c.max_image_edge,
            c.max_image_pixels,
            c.max_request_bytes,
            c.many_images,
            c.many_images_edge,
            c.image_tokens,
        )
    }

    /// The providers' documented image and request limits and image token
    /// formulas (sources beside `LIMITS` in `scripts/gen_models.py`),
    /// through provider paths, vendor prefixes and date suffixes.
    #[test]
    fn built_in_limits_follow_the_providers_docs() {
        let t = table();
        let claude: Limits = (
            Some(5_242_880),
            Some(8000),
            None,
            Some(32_000_000),
            Some(20),
            Some(2000),
            Some(ImageTokens::Anthropic),
        );
        let openai = |f: Option<ImageTokens>| -> Limits {
            (
                Some(20_000_000),
                None,
                None,
                Some(50_000_000),
                None,
                None,
                f,
            )
        };
        let tiles = openai(Some(ImageTokens::OpenaiTiles));
        let patches = openai(Some(ImageTokens::OpenaiPatches));
        let gemini_2: Limits = (
            None,
            None,
            None,
            Some(20_000_000),
            None,
            None,
            Some(ImageTokens::Gemini),
        );
        let none: Limits = (None, None, None, None, None, None, None);
        let cases: &[(&str, Limits)] = &[
            ("claude-sonnet-4-5", claude),
            ("claude-sonnet-4-5-20250929", claude),
            ("anthropic/claude-opus-4.6", claude),
            ("us.anthropic.claude-3-5-sonnet-20240620-v1:0", claude),
            ("gpt-4o", tiles),
            ("openai/gpt-4o-2024-08-06", tiles),
            ("gpt-4o-mini", tiles),
            ("gpt-4.1", tiles),
            ("gpt-4.1-mini", patches),
            ("gpt-4.1-nano-2025-04-14", patches),
            ("o4-mini", patches),
            ("o3", tiles),
            ("gpt-5", tiles),
            ("gpt-5-mini", patches),
            // A later GPT-5.x: the API's limits, no formula stated.
            ("gpt-5.1", openai(None)),
            ("gemini-2.5-pro", gemini_2),
            ("google/gemini-2.0-flash", gemini_2),
            (
                "gemini-3-pro-preview",
                (None, None, None, Some(20_000_000), None, None, None),
            ),
            (
                "grok-4",
                (Some(10_485_760), None, None, None, None, None, None),
            ),
            ("llama3.1:8b", none),
            ("my-own-finetune-7b", none),
        ];
        let wrong: Vec<String> = cases
            .iter()
            .filter_map(|&(m, want)| {
                let got = limits(&t.caps(m));
                (got != want).then(|| format!("{m}: want {want:?}, got {got:?}"))
            })
            .collect();
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        // The limit rows state nothing else: claude keeps its cache minimum.
        assert_eq!(
            t.caps("claude-sonnet-4-5").cache_min_tokens,
            Some(1024),
            "the cache row still answers"
        );
    }

    /// A user row that states one limit keeps the others from the
    /// built-in row, field by field; an `image_tokens` of its own wins.
    #[test]
    fn a_user_row_overrides_one_limit() {
        let user = Model::new(RawModel {
            pattern: "claude-*".into(),
            max_request_bytes: Some(20_000_000),
            ..RawModel::default()
        })
        .unwrap();
        let t = ModelTable::new(&[user], Learned::default()).unwrap();
        let c = t.caps("us.anthropic.claude-sonnet-4-5-20250929-v1:0");
        assert_eq!(c.max_request_bytes, Some(20_000_000));
        assert_eq!(c.max_image_bytes, Some(5_242_880), "from the built-in row");
        assert_eq!(c.max_image_edge, Some(8000));
        assert_eq!((c.many_images, c.many_images_edge), (Some(20), Some(2000)));
        assert_eq!(c.image_tokens, Some(ImageTokens::Anthropic));
        // A house model gets the fields only from a row of its own.
        let user = Model::new(RawModel {
            pattern: "house-vl-*".into(),
            max_image_pixels: Some(4_000_000),
            image_tokens: Some(ImageTokens::Gemini),
            ..RawModel::default()
        })
        .unwrap();
        let t = ModelTable::new(&[user], Learned::default()).unwrap();
        let c = t.caps("house-vl-7b");
        assert_eq!(c.max_image_pixels, Some(4_000_000));
        assert_eq!(c.image_tokens, Some(ImageTokens::Gemini));
        assert_eq!(c.max_image_bytes, None);
        assert_eq!(ImageTokens::OpenaiPatches.to_string(), "openai_patches");
    }

    /// Prices per million tokens from litellm's model map
    /// (`scripts/data/model-prices.tsv`), through provider paths, vendor
    /// prefixes and date suffixes; the four fields stated or not as the
    /// chosen entry states them.
    #[test]
    fn built_in_prices_resolve_real_names() {
        let t = table();
        type Prices = [Option<f64>; 4];
        let prices = |m: &str| -> Prices {
            let c = t.caps(m);
            [c.input, c.cached_input, c.cache_write, c.output]
        };
        let gpt_4o = [Some(2.5), Some(1.25), None, Some(10.0)];
        let gpt_4o_mini = [Some(0.15), Some(0.075), None, Some(0.6)];
        let sonnet_4_5 = [Some(3.0), Some(0.3), Some(3.75), Some(15.0)];
        let haiku_3_5 = [Some(0.8), Some(0.08), Some(1.0), Some(4.0)];
        let deepseek_chat = [Some(0.28), Some(0.028), None, Some(0.42)];
        let gemini_2_5_flash = [Some(0.3), Some(0.03), None, Some(2.5)];
        let cases: &[(&str, Prices)] = &[
            ("gpt-4o", gpt_4o),
            ("openai/gpt-4o-2024-08-06", gpt_4o),
            ("GPT-4o", gpt_4o),
            // A snapshot its publisher prices differently has its own row;
            // the cache price it does not state is gpt-4o's.
            (
                "gpt-4o-2024-05-13",
                [Some(5.0), Some(1.25), None, Some(15.0)],
            ),
            ("gpt-4o-mini", gpt_4o_mini),
            ("gpt-4o-mini-2024-07-18", gpt_4o_mini),
            ("openrouter/openai/gpt-4o-mini", gpt_4o_mini),
            ("claude-sonnet-4-5", sonnet_4_5),
            ("claude-sonnet-4-5-20250929", sonnet_4_5),
            ("anthropic/claude-sonnet-4.5", sonnet_4_5),
            ("claude-3-5-haiku-20241022", haiku_3_5),
            ("us.anthropic.claude-3-5-haiku-20241022-v1:0", haiku_3_5),
            ("deepseek-chat", deepseek_chat),
            ("deepseek/deepseek-chat", deepseek_chat),
            ("gemini-2.5-flash", gemini_2_5_flash),
            ("google/gemini-2.5-flash", gemini_2_5_flash),
            // No price anywhere: none stated (tokens only).
            ("my-own-finetune-7b", [None; 4]),
        ];
        let wrong: Vec<String> = cases
            .iter()
            .filter_map(|&(m, want)| {
                let got = prices(m);
                (got != want).then(|| format!("{m}: want {want:?}, got {got:?}"))
            })
            .collect();
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        // A family's members are priced apart: no glob row carries a price.
        assert_ne!(prices("gpt-4o-mini"), prices("gpt-4o"));
        // The price rows state nothing else: gpt-4o's capabilities are as
        // before.
        let r = t.resolve("gpt-4o", None);
        assert!(r.vision);
        assert_eq!(r.caps.context_window, Some(128_000));
        assert_eq!(r.caps.cache_min_tokens, Some(1024));
    }

    /// A user row's price comes first, field by field: the fields it does
    /// not state still come from the built-in row.
    #[test]
    fn a_user_row_overrides_a_built_in_price() {
        let user = Model::new(RawModel {
            pattern: "gpt-4o".into(),
            input: Some(2.0),
            output: Some(8.0),
            ..RawModel::default()
        })
        .unwrap();
        let t = ModelTable::new(&[user], Learned::default()).unwrap();
        let c = t.caps("openai/gpt-4o-2024-08-06");
        assert_eq!(c.input, Some(2.0));
        assert_eq!(c.output, Some(8.0));
        assert_eq!(c.cached_input, Some(1.25), "from the built-in row");
        assert_eq!(c.cache_write, None);
        // Other models keep the built-in prices.
        assert_eq!(t.caps("gpt-4o-mini").input, Some(0.15));
        // A house model gets prices only from a row of its own.
        let user = Model::new(RawModel {
            pattern: "house-*".into(),
            input: Some(0.0),
            cached_input: Some(0.0),
            cache_write: Some(0.0),
            output: Some(0.0),
            ..RawModel::default()
        })
        .unwrap();
        let t = ModelTable::new(&[user], Learned::default()).unwrap();
        let c = t.caps("house-llm-70b");
        assert_eq!(
            [c.input, c.cached_input, c.cache_write, c.output],
            [Some(0.0); 4]
        );
    }

    #[test]
    fn resolution_order_header_user_builtin_learned() {
        let user = vec![
            RawModel {
                pattern: "gpt-4o*".into(),
                vision: Some(false),
                audio: None,
                pdf: None,
                office: None,
                max_images: None,
                context_window: None,
                ..RawModel::default()
            },
            RawModel {
                pattern: "gpt-oss-*".into(),
                vision: None,
                audio: None,
                pdf: None,
                office: None,
                max_images: Some(3),
                context_window: None,
                ..RawModel::default()
            },
        ];
        let user: Vec<Model> = user.into_iter().map(|r| Model::new(r).unwrap()).collect();
        let t = ModelTable::new(&user, Learned::default()).unwrap();
        let r = t.resolve("openrouter/openai/gpt-4o-2024-08-06", None);
        assert!(!r.vision);
        assert_eq!(r.vision_from, Source::User(0, "gpt-4o*".into()));
        let r = t.resolve("gpt-4o", Some(true));
        assert!(r.vision);
        assert_eq!(r.vision_from, Source::Header);
        // A user row that states only max_images keeps the built-in flag.
        let r = t.resolve("gpt-oss-120b", None);
        assert!(!r.vision);
        assert_eq!(r.caps.max_images, Some(3));
        assert!(matches!(r.vision_from, Source::BuiltIn(_, _)));
        // Learned rows come after every stated row.
        assert_eq!(
            t.learned.learn("acme/my-text-model-2025-01-01").as_deref(),
            Some("my-text-model")
        );
        assert_eq!(t.learned.learn("my-text-model"), None);
        assert_eq!(t.learned.learn(""), None, "no model, nothing learned");
        assert!(t.resolve("", None).vision);
        let r = t.resolve("other/my-text-model", None);
        assert!(!r.vision);
        assert_eq!(r.vision_from, Source::Learned("my-text-model".into()));
    }

    #[test]
    fn learned_rows_merge_and_legacy_files_are_read() {
        let l = Learned::new(["house-model".to_owned()]);
        assert_eq!(
            l.merge(["house-model".to_owned(), "other".to_owned(), String::new()]),
            1
        );
        assert_eq!(
            l.names(),
            vec!["house-model".to_owned(), "other".to_owned()]
        );
        let dir = std::env::temp_dir().join(format!("visor-learned-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("learned-models.json");
        std::fs::write(&path, r#"{"non_vision":["a","b"]}"#).unwrap();
        assert_eq!(legacy_learned(&path), vec!["a".to_owned(), "b".to_owned()]);
        std::fs::write(&path, "not json").unwrap();
        assert!(legacy_learned(&path).is_empty());
        assert!(legacy_learned(&dir.join("missing.json")).is_empty());
        let _ = std::fs::remove_dir_all(dir);
    }
}
