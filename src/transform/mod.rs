//! Request transforms: pure functions from a request body (and the data
//! they need, looked up by the async edges) to a rewritten body and a
//! [`Report`]. No I/O here.
//!
//! - [`images`]: finds every image and replaces the chosen ones in place.
//! - the image rules for every model ([`decide`]): tool-result images older
//!   than `keep_turns` aged out, later copies of an image turned into a
//!   reference, only the newest `max_per_request` kept.
//! - [`dedup`]: repeated lines and JSON array elements removed.
//!
//! A body nothing applies to is left alone: the caller forwards the
//! original bytes.

mod assemble;
pub mod decode;
pub mod dedup;
mod in_text;
pub mod json;
pub mod placeholder;
pub mod report;
pub mod rules;
pub mod status;
pub mod walk;

use std::collections::HashMap;
use std::sync::Arc;

use crate::artifacts::Artifact;
use crate::config::{Dedup, Images};
pub use crate::image_fit::{Fitted, Limits};
use placeholder::{Reason, placeholder};
use report::{Action, note};
pub use report::{ImageNote, Report};
pub use rules::{Fate, decide};
use walk::Source;
pub use walk::{DocFamily, Medium};

pub use crate::api::Shape;

/// What the transforms need to know about the request's model.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub shape: Shape,
    /// False: every image is replaced.
    pub vision: bool,
    /// True: replaced images that can be described are given their
    /// description when one is supplied (`images.non_vision = "describe"`).
    pub describe: bool,
    pub rules: Rules,
    /// Which documents and audio the model takes; the others are replaced.
    pub takes: Takes,
    /// `describer.query_aware`: each subject carries the user text of its
    /// message.
    pub query_aware: bool,
    /// What a kept image must fit (a model that can see): see
    /// [`Scanned::fit_jobs`].
    pub fit: Limits,
}

/// Which documents and audio a model takes (the table's `pdf`, `office`
/// and `audio`, resolved).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Takes {
    pub pdf: bool,
    pub office: bool,
    pub audio: bool,
}

impl Takes {
    /// Everything passes as it is.
    pub const ALL: Takes = Takes {
        pdf: true,
        office: true,
        audio: true,
    };

    /// Whether the model takes a found part of this medium as it is.
    pub fn medium(&self, m: &Medium) -> bool {
        match m {
            Medium::Image => true,
            Medium::Document { family, .. } => match family {
                DocFamily::Pdf | DocFamily::Other => self.pdf,
                DocFamily::Office => self.office,
            },
            Medium::Audio { .. } => self.audio,
        }
    }
}

/// The rules for every model: `[images]` and `[dedup]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// A tool-result image with more than this many assistant turns after
    /// it is replaced.
    pub keep_turns: usize,
    /// Only the newest this many images stay (when it pays, see [`decide`]).
    pub max_images: usize,
    /// The model's own limit (its table row's `max_images`): always held.
    pub hard_max_images: Option<usize>,
    /// A later copy of an image becomes a reference to the first.
    pub dedupe: bool,
    /// The provider caches prompt prefixes (cached input at a tenth): the
    /// images due that were already sent age out together, when what
    /// keeping them has cost reaches what the rewrite costs (see
    /// [`decide`]); false: each as soon as it is due.
    pub prompt_cache: bool,
    /// `images.context_fraction` in thousandths: a request estimated past
    /// this share of `context_window` ages the images due, whatever the
    /// cache.
    pub context_permille: u32,
    /// The model's context window in tokens (its table row's
    /// `context_window`); `None`: unknown, only the cost decides.
    pub context_window: Option<u64>,
    /// When a repeated run of lines is worth a note; `None`: no dedup.
    pub dedup: Option<dedup::Blocks>,
}

impl Rules {
    /// No rule applies: only a non-vision model's images are replaced.
    pub const NONE: Rules = Rules {
        keep_turns: usize::MAX,
        max_images: usize::MAX,
        hard_max_images: None,
        dedupe: false,
        prompt_cache: true,
        context_permille: 1000,
        context_window: None,
        dedup: None,
    };

    /// The rules of the `[images]` and `[dedup]` sections, for a model
    /// whose table row says `max_images` (the smaller cap wins) and
    /// `context_window`.
    pub fn new(
        images: &Images,
        dedup: &Dedup,
        model_max_images: Option<u32>,
        context_window: Option<u64>,
    ) -> Rules {
        let at_load = Rules {
            keep_turns: images.keep_turns as usize,
            max_images: images.max_per_request as usize,
            hard_max_images: None,
            dedupe: images.dedupe,
            prompt_cache: images.prompt_cache,
            // Validated to (0, 1]; at least a thousandth.
            context_permille: ((images.context_fraction * 1000.0).round() as u32).clamp(1, 1000),
            context_window: None,
            dedup: dedup.enabled.then_some(dedup::Blocks {
                min_lines: dedup.min_run_lines as usize,
                min_bytes: dedup.min_run_bytes as usize,
            }),
        };
        at_load.for_model(model_max_images, context_window)
    }

    /// These rules (built at load, for no model in particular) for a model
    /// whose table row says `max_images` and `context_window`: the smaller
    /// cap wins. The same as [`Rules::new`] with that model's row.
    pub fn for_model(self, model_max_images: Option<u32>, context_window: Option<u64>) -> Rules {
        Rules {
            max_images: model_max_images
                .map_or(self.max_images, |m| self.max_images.min(m as usize)),
            hard_max_images: model_max_images.map(|m| m as usize),
            context_window,
            ..self
        }
    }

    /// Whether a rule may change something. The context window alone
    /// changes nothing: it only hastens the ageing of images already due.
    fn any(&self) -> bool {
        let context = Rules {
            context_permille: Rules::NONE.context_permille,
            context_window: None,
            ..*self
        };
        context != Rules::NONE
    }
}

impl Plan {
    /// A plan with no rule for every model (the image replacement of a
    /// non-vision model only).
    pub fn images_only(shape: Shape, vision: bool, describe: bool) -> Plan {
        Plan {
            shape,
            vision,
            describe,
            rules: Rules::NONE,
            takes: Takes::ALL,
            query_aware: false,
            fit: Limits::NONE,
        }
    }
}

/// What a describer (or the transcriber) can be sent: the full SHA-256
/// hex it is known by (of its bytes, or of its URL) and the image (audio)
/// itself.
#[derive(Debug, Clone)]
pub struct Subject {
    pub sha256: String,
    pub payload: Payload,
    /// Only a cached description may be used (an aged-out or capped
    /// image): the describer is not called for it.
    pub lookup_only: bool,
    /// `describer.query_aware`: the user text of the message that holds
    /// it, which shapes its description (and is part of its key).
    pub query: Option<String>,
}

#[derive(Debug, Clone)]
pub enum Payload {
    /// Decoded bytes and their media type.
    Inline {
        media_type: String,
        bytes: bytes::Bytes,
    },
    /// An http(s) URL, passed on as it is.
    Url(String),
}

/// The key a description is given back under: the image's SHA-256 hex,
/// and a hash of the query that shaped it (`describer.query_aware`).
pub fn subject_key(sha256: &str, query: Option<&str>) -> String {
    match query {
        Some(q) => format!("{sha256}?q={}", &decode::sha256_hex(q.as_bytes())[..16]),
        None => sha256.to_owned(),
    }
}

/// Which images found as base64 in a text are sent, to a model that can
/// see, as image parts beside that text: where the API takes an image
/// there (a Chat user message; an Anthropic user message or `tool_result`;
/// a Responses message or function output), the text a whole content or a
/// text part. Anywhere else (a Chat `tool` message, an assistant's text)
/// the image is replaced as for a model that cannot see: base64 is never
/// sent to a model as text.
fn hoists(scan: &walk::Scan, plan: &Plan, fates: &mut [Fate]) -> Vec<bool> {
    let mut hoisted = vec![false; scan.images.len()];
    if !plan.vision || !plan.fit.hoist_text {
        return hoisted;
    }
    for (i, f) in scan.images.iter().enumerate() {
        let walk::Site::InText { .. } = &f.site else {
            continue;
        };
        let base64 = matches!(f.source, Source::Encoded { .. } | Source::Inline { .. });
        if fates[i] != Fate::Kept || f.medium != Medium::Image || !base64 {
            continue;
        }
        match f.hoistable {
            true => hoisted[i] = true,
            false => fates[i] = Fate::Replaced(Reason::AsText),
        }
    }
    hoisted
}

/// An image found in a text, as the part it is sent as.
#[derive(Debug, Clone)]
pub(crate) struct HoistedPart {
    pub(crate) media_type: String,
    pub(crate) bytes: bytes::Bytes,
    /// What takes its place in the text.
    pub(crate) reference: String,
}

impl HoistedPart {
    /// `None` when it cannot be sent as an image (not a type providers
    /// take, or no size could be read from it).
    fn of(f: &walk::Found, fitted: Option<&Fitted>) -> Option<HoistedPart> {
        let (media_type, bytes, (w, h)) = match (fitted, &f.source, &f.bytes) {
            (Some(d), _, _) => (
                d.media_type.to_owned(),
                d.bytes.clone(),
                (d.width as usize, d.height as usize),
            ),
            // The type the bytes are, not the one the text declared.
            (
                None,
                Source::Inline {
                    dims: Some(dims), ..
                },
                Some(b),
            ) => (
                crate::artifacts::sniff_media_type(b)?.to_owned(),
                b.clone(),
                *dims,
            ),
            _ => return None,
        };
        if !matches!(
            media_type.as_str(),
            "image/png" | "image/jpeg" | "image/gif" | "image/webp"
        ) {
            return None;
        }
        let short = f.sha256.get(..12).unwrap_or(&f.sha256);
        let reference = format!(
            "[image sha256:{short}, {media_type} {w}x{h}: sent as an image part after this text]"
        );
        Some(HoistedPart {
            media_type,
            bytes,
            reference,
        })
    }
}

/// Byte budgets that take a request `over` bytes back within its bound:
/// the largest images first, each cut to no less than a quarter of its
/// base64 (`sized`: index, size, base64 length).
fn request_budgets(sized: &[(usize, (u32, u32), u64)], over: u64) -> Vec<Option<u64>> {
    let mut budgets = vec![None; sized.len()];
    if over == 0 {
        return budgets;
    }
    let mut order: Vec<usize> = (0..sized.len()).collect();
    order.sort_by_key(|&k| std::cmp::Reverse(sized[k].2));
    let mut left = over;
    for k in order {
        if left == 0 {
            break;
        }
        let b64 = sized[k].2;
        let cut = left.min(b64 - b64 / 4);
        budgets[k] = Some(b64 - cut);
        left -= cut;
    }
    budgets
}

/// The longest query (characters) a description is shaped by.
const MAX_QUERY_CHARS: usize = 1000;

/// A document or audio to turn into text (see [`Scanned::media`]).
#[derive(Debug, Clone)]
pub struct MediaJob {
    /// Full SHA-256 hex of its bytes: the text made for it is given back
    /// under this key.
    pub sha256: String,
    pub medium: Medium,
    pub media_type: String,
    pub bytes: bytes::Bytes,
    /// `describer.query_aware`: the user text of its message.
    pub query: Option<String>,
}

/// A rewrite: the new body (`None`: forward the original), the report, and
/// the replaced images' bytes to save.
#[derive(Debug, Default)]
pub struct Rewrite {
    pub body: Option<Vec<u8>>,
    pub report: Report,
    pub artifacts: Vec<Artifact>,
}

/// True when the plan may change something, so the body must be walked.
pub fn needed(plan: &Plan) -> bool {
    !plan.vision
        || plan.rules.any()
        || plan.takes != Takes::ALL
        || !plan.fit.is_none()
        || plan.fit.hoist_text
}

/// A kept image to fit to its model (see [`Scanned::fit_jobs`]): scaled
/// to `size` when set, and re-encoded until its base64 is at most
/// `max_base64` when set.
#[derive(Debug, Clone)]
pub struct FitJob {
    /// The image's index in the scan.
    pub index: usize,
    /// Its [`quick_key`] (the base64 as written and the fit asked), when
    /// it came encoded: what the next turn finds the result by without
    /// decoding the image.
    pub quick: Option<u128>,
    /// The image as it came (kept with the result under `quick`).
    pub original: Original,
    /// Full SHA-256 hex of its bytes.
    pub sha256: String,
    pub bytes: bytes::Bytes,
    /// Its size as it came.
    pub from: (u32, u32),
    pub size: Option<(u32, u32)>,
    pub max_base64: Option<u64>,
}

impl FitJob {
    /// What the result is cached under: the image and the settings.
    pub fn key(&self) -> String {
        let (w, h) = self.size.unwrap_or(self.from);
        let max = self.max_base64.map_or(String::new(), |m| m.to_string());
        format!("{}:{w}x{h}:{max}", self.sha256)
    }
}

/// An image as it came, as a fit found by [`quick_key`] says it (its note
/// and artifact link need it, and it is not decoded again).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Original {
    pub sha256: String,
    pub media_type: String,
    pub size: usize,
    pub dims: Option<(usize, usize)>,
}

impl Original {
    fn of(f: &walk::Found) -> Original {
        match &f.source {
            Source::Inline {
                media_type,
                size,
                dims,
            } => Original {
                sha256: f.sha256.clone(),
                media_type: media_type.clone(),
                size: *size,
                dims: *dims,
            },
            _ => Original {
                sha256: f.sha256.clone(),
                ..Original::default()
            },
        }
    }
}

/// A fit found by its [`quick_key`]: the image sent (`None`: it is left
/// as it came), and the original.
#[derive(Debug, Clone)]
pub struct Quick {
    pub fitted: Option<Fitted>,
    pub original: Original,
}

/// What a fit is found by before its image is decoded: the base64 text as
/// the request writes it, hashed (xxh3-128, seeded per process: a client
/// cannot compute another's keys offline; not a cryptographic hash), and
/// the size and byte bound asked.
pub fn quick_key(base64: &[u8], size: Option<(u32, u32)>, max_base64: Option<u64>) -> u128 {
    let (w, h) = size.unwrap_or((0, 0));
    let mut tail = [0u8; 17];
    tail[..4].copy_from_slice(&w.to_le_bytes());
    tail[4..8].copy_from_slice(&h.to_le_bytes());
    tail[8..16].copy_from_slice(&max_base64.unwrap_or(u64::MAX).to_le_bytes());
    tail[16] = u8::from(size.is_some());
    let mut x = xxhash_rust::xxh3::Xxh3::with_seed(*SEED);
    x.update(base64);
    x.update(&tail);
    x.digest128()
}

/// The seed of visor's keyed hashes, random per process.
static SEED: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x7669_736f_725f_6669);
    h.finish()
});

/// The bytes of a body's beginning [`start_key`] reads.
pub const START: usize = 128;

/// Whose conversations a kept state may continue: requests under `plan`
/// from one client (`tenant`: a keyed hash of its credential, 0 for
/// none), so that one client's requests never take, nor time, another's
/// states. Keyed per process.
pub fn conversation_seed(plan: &Plan, tenant: u64) -> u64 {
    let mut x = xxhash_rust::xxh3::Xxh3::with_seed(*SEED);
    x.update(format!("{plan:?}").as_bytes());
    x.update(&tenant.to_le_bytes());
    x.digest()
}

/// A keyed hash of a client's credential (`tenant` of
/// [`conversation_seed`]): never the credential itself.
pub fn tenant(credential: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(credential, *SEED)
}

/// The key of what was read of a request's messages up to the end of its
/// last one, `prefix` (the body up to there): a keyed hash (xxh3-128) of
/// the [`conversation_seed`] and those bytes ([`prefix_digest`]). The next
/// request of the conversation begins with the same bytes; what follows
/// them (the instructions outside the message list included) is read
/// again.
pub fn prefix_key(seed: u64, prefix: &[u8]) -> u128 {
    prefix_key_of(seed, prefix.len(), prefix_digest(prefix))
}

/// [`prefix_key`] of a prefix of `len` bytes whose [`prefix_digest`] is
/// known (the proxy's check of the body as it came computed it).
pub fn prefix_key_of(seed: u64, len: usize, digest: u128) -> u128 {
    let mut x = xxhash_rust::xxh3::Xxh3::with_seed(*SEED);
    x.update(&seed.to_le_bytes());
    x.update(&len.to_le_bytes());
    x.update(&digest.to_le_bytes());
    x.digest128()
}

/// A keyed hash (xxh3-128, keyed per process) of a body's bytes up to a
/// point: [`prefix_hasher`] fed them.
pub fn prefix_digest(prefix: &[u8]) -> u128 {
    let mut x = prefix_hasher();
    x.update(prefix);
    x.digest128()
}

/// The hasher of [`prefix_digest`], to feed as the bytes come.
pub fn prefix_hasher() -> PrefixHasher {
    PrefixHasher(twox_hash::XxHash3_128::with_seed(
        SEED.rotate_left(17) ^ 0x7072_6566_6978,
    ))
}

/// The hasher of [`prefix_digest`]: xxh3-128, keyed per process, whose
/// stripes (the work on a large body) go 32 bytes at a time where the CPU
/// has AVX2 (`twox-hash` chooses at run time; a build for any x86-64).
#[derive(Clone)]
pub struct PrefixHasher(twox_hash::XxHash3_128);

impl PrefixHasher {
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    /// The digest of the bytes fed so far (the hasher goes on).
    pub fn digest128(&self) -> u128 {
        self.0.finish_128()
    }
}

/// Which conversation a body may continue, from its first [`START`]
/// bytes and the [`conversation_seed`]; `None` for a body shorter than
/// that.
pub fn start_key(seed: u64, body: &[u8]) -> Option<u64> {
    let start = body.get(..START)?;
    let mut x = xxhash_rust::xxh3::Xxh3::with_seed(*SEED);
    x.update(&seed.to_le_bytes());
    x.update(start);
    Some(x.digest())
}

/// The most decoded bytes read to learn an image's size from its head
/// (a JPEG's size may follow tens of kilobytes of metadata).
const HEAD_FOR_SIZE: usize = 64 * 1024;

/// Applies the plan to a body that is valid JSON, with placeholders only.
pub fn rewrite(body: &[u8], plan: &Plan) -> Rewrite {
    match scan(body, plan) {
        Ok(scanned) => scanned.finish(body, &[]),
        Err(nothing) => *nothing,
    }
}

/// [`rewrite`] with kept images fitted to the plan's limits here, on this
/// thread, uncached (the proxy fits them through its cache; this is the
/// dry run's and the benches' way).
pub fn rewrite_fitted(body: &[u8], plan: &Plan) -> Rewrite {
    let mut scanned = match scan(body, plan) {
        Ok(s) => s,
        Err(done) => return *done,
    };
    fit_here(&mut scanned, body);
    scanned.finish(body, &[])
}

/// Fits `scanned`'s kept images on this thread: to the limits, then, when
/// the request is still over its `max_request_bytes`, its largest images
/// to byte budgets.
pub fn fit_here(scanned: &mut Scanned, body: &[u8]) {
    let mut over = 0;
    for _ in 0..2 {
        for job in scanned.fit_jobs(body, over, &|_| None) {
            if let Ok(f) = crate::image_fit::fit(&job.bytes, job.size, job.max_base64) {
                scanned.set_fitted(job.index, f);
            }
        }
        match scanned.plan.fit.max_request_bytes {
            Some(max) if scanned.len_with_fitted(body.len()) > max => {
                over = scanned.len_with_fitted(body.len()) - max + max / 100;
            }
            _ => return,
        }
    }
}

/// The first half of a rewrite: every image found, and which are replaced.
/// Between [`scan`] and [`Scanned::finish`] the caller may look up
/// descriptions for [`Scanned::subjects`].
#[derive(Debug, Clone)]
pub struct Scanned {
    scan: walk::Scan,
    plan: Plan,
    fates: Vec<Fate>,
    /// Kept images fitted to the model (see [`Scanned::fit_jobs`]).
    fitted: Vec<Option<Fitted>>,
    /// Images found as base64 in a text, sent to a model that can see as
    /// image parts beside that text (see [`hoists`]).
    hoisted: Vec<bool>,
    /// Messages a continued walk did not read again (see [`walk_from`]):
    /// their texts are not dedup's work either.
    read_before: usize,
}

/// Finds the images in `body`. `Err` holds the finished rewrite when
/// nothing is to be done (or the body cannot be walked).
pub fn scan(body: &[u8], plan: &Plan) -> Result<Scanned, Box<Rewrite>> {
    let mut scanned = walk(body, plan)?;
    scanned.resolve(body);
    Ok(scanned)
}

/// The cheap half of [`scan`]: the walk and the decisions, no image
/// decoded yet (see [`Scanned::resolve`] and [`Scanned::work`]).
pub fn walk(body: &[u8], plan: &Plan) -> Result<Scanned, Box<Rewrite>> {
    if !needed(plan) {
        return Err(Box::default());
    }
    walked(body, plan, walk::scan(body, plan.shape), 0)
}

/// [`walk`] of a body that begins with the messages `prefix` was scanned
/// from, up to `end` ([`walk::Scan::upto_messages`]): only the rest is
/// read. The same as [`walk`].
pub fn walk_from(
    body: &[u8],
    plan: &Plan,
    prefix: walk::Scan,
    end: usize,
) -> Result<Scanned, Box<Rewrite>> {
    if !needed(plan) {
        return Err(Box::default());
    }
    let before = prefix.items.len();
    walked(
        body,
        plan,
        walk::scan_from(body, plan.shape, prefix, end),
        before,
    )
}

/// A walk's scan decided.
fn walked(
    body: &[u8],
    plan: &Plan,
    scan: std::result::Result<walk::Scan, json::Malformed>,
    read_before: usize,
) -> Result<Scanned, Box<Rewrite>> {
    let scan = match scan {
        Ok(s) => s,
        Err(_) => {
            return Err(Box::new(Rewrite {
                report: Report {
                    skipped: Some("the body is not an object of the expected shape"),
                    ..Report::default()
                },
                ..Rewrite::default()
            }));
        }
    };
    let mut fates = decide(&scan, body, plan);
    let hoisted = hoists(&scan, plan, &mut fates);
    Ok(Scanned {
        fitted: vec![None; scan.images.len()],
        hoisted,
        scan,
        plan: *plan,
        fates,
        read_before,
    })
}

impl Scanned {
    /// The replaced images a description could be given to, with their
    /// index: each distinct image once (in describe mode; none otherwise).
    /// Images a model cannot see may be sent to the describer; aged-out and
    /// capped ones only take a cached description; references none.
    pub fn subjects(&self, body: &[u8]) -> Vec<(usize, Subject)> {
        if !self.plan.describe {
            return Vec::new();
        }
        let mut at: HashMap<(&str, Option<String>), usize> = HashMap::new();
        let mut out: Vec<(usize, Subject)> = Vec::new();
        for (i, f) in self.scan.images.iter().enumerate() {
            if f.medium != Medium::Image {
                continue;
            }
            let lookup_only = match self.fates[i] {
                Fate::Replaced(Reason::NonVision | Reason::AsText) => false,
                Fate::Replaced(Reason::AgedOut | Reason::Capped) => true,
                Fate::Kept | Fate::Replaced(Reason::Deduped | Reason::CannotTake) => continue,
            };
            let Some(mut s) = f.subject() else { continue };
            s.lookup_only = lookup_only;
            s.query = self.query(f.message, body);
            // The same image under two queries is two descriptions.
            match at.get(&(f.sha256.as_str(), s.query.clone())) {
                Some(&k) => out[k].1.lookup_only &= lookup_only,
                None => {
                    at.insert((f.sha256.as_str(), s.query.clone()), out.len());
                    out.push((i, s));
                }
            }
        }
        out
    }

    /// The documents and audio to turn into text: each distinct one the
    /// model does not take, with its bytes (file ids and URLs are never
    /// fetched: they get a reference).
    pub fn media(&self, body: &[u8]) -> Vec<MediaJob> {
        let mut out: Vec<MediaJob> = Vec::new();
        for (f, fate) in self.scan.images.iter().zip(&self.fates) {
            if *fate != Fate::Replaced(Reason::CannotTake) {
                continue;
            }
            let (Source::Inline { media_type, .. }, Some(bytes)) = (&f.source, &f.bytes) else {
                continue;
            };
            if out.iter().any(|j| j.sha256 == f.sha256) {
                continue;
            }
            let query = self.query(f.message, body);
            // Chat `input_audio` says its format beside the data, not as a
            // media type: `wav` → `audio/wav` when the bytes did not say.
            let media_type = match &f.medium {
                Medium::Audio {
                    format: Some(format),
                } if !media_type.starts_with("audio/") => {
                    decode::valid_media_type(&format!("audio/{format}"))
                        .unwrap_or_else(|| media_type.clone())
                }
                _ => media_type.clone(),
            };
            out.push(MediaJob {
                sha256: f.sha256.clone(),
                medium: f.medium.clone(),
                media_type,
                bytes: bytes.clone(),
                query,
            });
        }
        out
    }

    /// The user's own text in message `item` (`describer.query_aware`):
    /// never a later message's, so a description never changes once
    /// written.
    fn query(&self, item: usize, body: &[u8]) -> Option<String> {
        if !self.plan.query_aware {
            return None;
        }
        let user = self
            .scan
            .items
            .get(item)
            .is_some_and(|it| it.role == walk::Role::User);
        if !user {
            return None;
        }
        let mut q = String::new();
        for t in self.scan.texts.iter().filter(|t| t.item == item && !t.tool) {
            if let Some(text) = self.scan.spot_decoded(t.spot, body) {
                if !q.is_empty() {
                    q.push('\n');
                }
                q.push_str(text.trim());
            }
        }
        let q = q.trim();
        (!q.is_empty()).then(|| match q.char_indices().nth(MAX_QUERY_CHARS) {
            Some((at, _)) => q[..at].to_owned(),
            None => q.to_owned(),
        })
    }

    /// The kept images a model that can see would refuse or scale down:
    /// over its edge, pixel or byte bounds (the lower edge bound when the
    /// request holds many images), or over the size it reads images at
    /// (`images.provider_size`), or the opt-in diet. Only images whose
    /// base64 and media type are written plainly in a part are fitted (an
    /// escaped one is left as it came). `over_request`: bytes the request
    /// is over its `max_request_bytes` after the other fits; the largest
    /// images are then given byte budgets that take it back within.
    /// Each job's image is decoded (its bytes are needed to fit it).
    pub fn fit_jobs(
        &mut self,
        body: &[u8],
        over_request: u64,
        known: &dyn Fn(u128) -> Option<Quick>,
    ) -> Vec<FitJob> {
        let limits = self.plan.fit;
        if !self.plan.vision || limits.is_none() {
            return Vec::new();
        }
        let kept: Vec<usize> = (0..self.scan.images.len())
            .filter(|&i| self.fates[i] == Fate::Kept && self.scan.images[i].medium == Medium::Image)
            .collect();
        let mut sized: Vec<(usize, (u32, u32), u64)> = Vec::new();
        for &i in &kept {
            let f = &self.scan.images[i];
            let written = match (&f.encoded_at, &f.bytes) {
                (Some(at), _) => at.base64_len() as u64,
                // Sent as a part visor writes: its base64 as it will be.
                (None, Some(b)) if self.hoisted[i] => crate::image_fit::base64_len(b.len()),
                _ => continue,
            };
            let b64 = match &self.fitted[i] {
                Some(done) => crate::image_fit::base64_len(done.bytes.len()),
                None => written,
            };
            let dims = match (&self.fitted[i], &f.source) {
                (Some(done), _) => Some((done.width, done.height)),
                (
                    None,
                    Source::Inline {
                        dims: Some((w, h)), ..
                    },
                ) => Some((*w as u32, *h as u32)),
                _ => f
                    .pending
                    .as_ref()
                    .filter(|p| p.spot.is_none())
                    .and_then(|p| body.get(p.range.clone()))
                    .and_then(|b64| walk::size_from_head(b64, HEAD_FOR_SIZE)),
            };
            // No size in the head (a JPEG's metadata may be longer), yet
            // over the byte bound: decoded to learn it.
            let dims = match dims {
                None if limits.max_bytes.is_some_and(|m| b64 > m) => {
                    self.scan.resolve(i, body);
                    match &self.scan.images[i].source {
                        Source::Inline {
                            dims: Some((w, h)), ..
                        } => Some((*w as u32, *h as u32)),
                        _ => None,
                    }
                }
                d => d,
            };
            if let Some(d) = dims {
                sized.push((i, d, b64));
            }
        }
        let budgets = request_budgets(&sized, over_request);
        let mut jobs = Vec::new();
        for (k, &(i, (w, h), b64)) in sized.iter().enumerate() {
            let size = limits.target(w, h, kept.len());
            let max = match budgets[k] {
                Some(b) => Some(limits.max_bytes.map_or(b, |m| m.min(b))),
                None => limits.max_bytes,
            };
            let over_bytes = max.is_some_and(|m| b64 > m);
            if size.is_none() && !over_bytes {
                continue;
            }
            let size = size.or(self.fitted[i].as_ref().map(|d| (d.width, d.height)));
            let Err(quick) = self.found_again(i, body, size, max, known) else {
                continue;
            };
            self.scan.resolve(i, body);
            let f = &self.scan.images[i];
            let Some(bytes) = f.bytes.clone() else {
                continue;
            };
            let original = Original::of(f);
            let from = match &f.source {
                Source::Inline {
                    dims: Some((w, h)), ..
                } => (*w as u32, *h as u32),
                _ => (w, h),
            };
            jobs.push(FitJob {
                index: i,
                quick,
                original,
                sha256: f.sha256.clone(),
                bytes,
                from,
                size,
                max_base64: max,
            });
        }
        jobs
    }

    /// Image `i`, fitted before (an earlier turn), found by its text and
    /// not decoded and hashed again: `Ok`. `Err`: not found, with the key
    /// its result is to be kept under (none for an image not encoded).
    fn found_again(
        &mut self,
        i: usize,
        body: &[u8],
        size: Option<(u32, u32)>,
        max: Option<u64>,
        known: &dyn Fn(u128) -> Option<Quick>,
    ) -> Result<(), Option<u128>> {
        let quick = (self.scan.pending_len(i).is_some())
            .then(|| self.scan.identity(i, body))
            .flatten()
            .map(|b64| quick_key(b64, size, max));
        let Some(q) = quick.and_then(known) else {
            return Err(quick);
        };
        self.scan.known(i, &q.original);
        if let Some(f) = q.fitted {
            self.fitted[i] = Some(f);
        }
        Ok(())
    }

    /// The plan it was scanned for.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Image `index` is sent as `fitted` (from [`Scanned::fit_jobs`]).
    pub fn set_fitted(&mut self, index: usize, fitted: Fitted) {
        if let Some(slot) = self.fitted.get_mut(index) {
            *slot = Some(fitted);
        }
    }

    /// The body's length once the fitted images are written in it.
    pub fn len_with_fitted(&self, body_len: usize) -> u64 {
        let mut len = body_len as i64;
        for (f, fitted) in self.scan.images.iter().zip(&self.fitted) {
            if let (Some(at), Some(done)) = (&f.encoded_at, fitted) {
                // The new literals: base64, a media type, quotes, a data
                // URL's head.
                let new = crate::image_fit::base64_len(done.bytes.len())
                    + done.media_type.len() as u64
                    + 20;
                len += new as i64 - at.len() as i64;
            }
        }
        len.max(0) as u64
    }

    /// The walk's findings, as [`walk_from`] continues them.
    pub fn scan(&self) -> &walk::Scan {
        &self.scan
    }

    /// Whether dedup will continue `state` for this request: its texts are
    /// the client's (no image replaced or hoisted) and the state
    /// [`dedup::State::fits`]. When not, the state is of no use and every
    /// text is dedup's work again ([`Scanned::work`]).
    pub fn continues(&mut self, state: &dedup::State, body: &[u8]) -> bool {
        let texts_kept =
            self.fates.iter().all(|f| *f == Fate::Kept) && !self.hoisted.contains(&true);
        let fits = self
            .plan
            .rules
            .dedup
            .is_some_and(|blocks| state.fits(&self.scan, body, blocks));
        if !(texts_kept && fits) {
            self.read_before = 0;
        }
        texts_kept && fits
    }

    /// What becomes of each image.
    pub fn fates(&self) -> &[Fate] {
        &self.fates
    }

    /// Decodes and hashes the images to be replaced (after [`walk`]).
    pub fn resolve(&mut self, body: &[u8]) {
        for (i, fate) in self.fates.iter().enumerate() {
            if *fate != Fate::Kept || self.hoisted[i] {
                self.scan.resolve(i, body);
            }
        }
    }

    /// About how many bytes [`Scanned::resolve`] and [`Scanned::finish`]
    /// will go through: the base64 of the images to decode, and the text
    /// dedup reads. A caller runs them off its thread when this is large.
    pub fn work(&self) -> usize {
        // Kept images are decoded too when they may be fitted or hoisted.
        let kept_decoded = !self.plan.fit.is_none() || self.plan.fit.hoist_text;
        let images: usize = (0..self.fates.len())
            .filter(|&i| self.fates[i] != Fate::Kept || kept_decoded)
            .filter_map(|i| self.scan.pending_len(i))
            .sum();
        let texts: usize = match self.plan.rules.dedup {
            Some(_) => self
                .scan
                .texts
                .iter()
                .filter(|t| t.item >= self.read_before)
                .map(|t| self.scan.spot_literal_len(t.spot))
                .sum(),
            None => 0,
        };
        images + texts
    }

    /// Rewrites `body`: each replaced image becomes its description when
    /// `descriptions` has one for its SHA-256 (pairs of full hex and
    /// text), else the placeholder; each replaced document or audio the
    /// text given for it, else a one-line reference.
    pub fn finish(self, body: &[u8], descriptions: &[(String, Arc<str>)]) -> Rewrite {
        self.finish_from(body, descriptions, None).0
    }

    /// [`Scanned::finish`], continuing dedup from `resume` (the state an
    /// earlier request of the conversation left: this body begins with
    /// its messages, byte for byte — see [`prefix_key`]), and the state
    /// this request leaves. The body is the same as a finish without a
    /// state would write.
    pub fn finish_from(
        self,
        body: &[u8],
        descriptions: &[(String, Arc<str>)],
        resume: Option<dedup::State>,
    ) -> (Rewrite, Option<dedup::State>) {
        let (rewrite, state, _) = self.finish_keeping(body, descriptions, resume);
        (rewrite, state)
    }

    /// [`Scanned::finish_from`], and the walk it read (which a finish
    /// leaves as it was: only [`Scanned::resolve`] and the fits change a
    /// walk, and only at its images).
    pub fn finish_keeping(
        self,
        body: &[u8],
        descriptions: &[(String, Arc<str>)],
        resume: Option<dedup::State>,
    ) -> (Rewrite, Option<dedup::State>, walk::Scan) {
        let keys: Vec<String> = (0..self.scan.images.len())
            .map(|i| {
                let f = &self.scan.images[i];
                match (f.medium == Medium::Image, self.fates[i]) {
                    (true, Fate::Replaced(_)) => {
                        subject_key(&f.sha256, self.query(f.message, body).as_deref())
                    }
                    _ => f.sha256.clone(),
                }
            })
            .collect();
        let Scanned {
            scan,
            plan,
            mut fates,
            fitted,
            hoisted,
            ..
        } = self;
        // A hoisted image visor cannot write as a part (a type the
        // providers do not take, no size read) is replaced instead.
        let hoisted: Vec<Option<HoistedPart>> = (0..scan.images.len())
            .map(|i| {
                let part = hoisted[i]
                    .then(|| HoistedPart::of(&scan.images[i], fitted[i].as_ref()))
                    .flatten();
                if hoisted[i] && part.is_none() {
                    fates[i] = Fate::Replaced(Reason::AsText);
                }
                part
            })
            .collect();
        let by_sha: HashMap<&str, &str> = descriptions
            .iter()
            .map(|(sha, d)| (sha.as_str(), &**d))
            .collect();
        let described = |i: usize| match fates[i] {
            Fate::Replaced(Reason::Deduped) | Fate::Kept => None,
            Fate::Replaced(_) => by_sha.get(keys[i].as_str()).copied(),
        };
        let texts: Vec<Option<String>> = (0..scan.images.len())
            .map(|i| match fates[i] {
                Fate::Kept => hoisted[i].as_ref().map(|p| p.reference.clone()),
                Fate::Replaced(reason) => Some(placeholder(&scan.images[i], described(i), reason)),
            })
            .collect();
        let mut spot_text = scan.spot_texts(&texts);
        let mut joined = scan.joined(body, &texts, &spot_text);
        let (omitted, state, continued) = match plan.rules.dedup {
            Some(blocks) => dedup::run(
                &scan,
                body,
                &texts,
                &mut spot_text,
                &mut joined,
                blocks,
                resume,
            ),
            None => (dedup::Omitted::default(), None, false),
        };
        let mut extra = scan.fitted_edits(&fitted);
        extra.extend(scan.hoisted_parts(body, plan.shape, &hoisted, &mut spot_text));
        let new = scan.assemble(body, plan.shape, &texts, &spot_text, &joined, extra);
        let artifacts = scan.artifacts(|i| fates[i] != Fate::Kept || fitted[i].is_some());
        let done = Done {
            new,
            artifacts,
            omitted,
        };
        let mut rewrite = done.report(body, &scan, &fates, &fitted, &hoisted, described);
        rewrite.report.dedup_continued = continued;
        (rewrite, state, scan)
    }
}

/// What [`Scanned::finish_from`] made, before its report.
struct Done {
    new: Option<Vec<u8>>,
    artifacts: Vec<crate::artifacts::Artifact>,
    omitted: dedup::Omitted,
}

impl Done {
    /// The rewrite with its report: each image's action, what dedup
    /// removed, the bytes saved.
    fn report<'d>(
        self,
        body: &[u8],
        scan: &walk::Scan,
        fates: &[Fate],
        fitted: &[Option<Fitted>],
        hoisted: &[Option<HoistedPart>],
        described: impl Fn(usize) -> Option<&'d str>,
    ) -> Rewrite {
        let Done {
            new,
            artifacts,
            omitted,
        } = self;
        let mut report = Report {
            images_found: scan
                .images
                .iter()
                .filter(|f| f.medium == Medium::Image)
                .count(),
            messages: scan.items.len(),
            lines_omitted: omitted.lines,
            items_omitted: omitted.items,
            bytes_saved_dedup: omitted.bytes,
            ..Report::default()
        };
        for (i, (f, &fate)) in scan.images.iter().zip(fates).enumerate() {
            let action = match (fate, described(i)) {
                (Fate::Kept, _) if hoisted[i].is_some() => Action::Hoisted,
                (Fate::Kept, _) if fitted[i].is_some() => Action::Resized,
                (Fate::Kept, _) => Action::Kept,
                (Fate::Replaced(Reason::NonVision | Reason::AsText), Some(_)) => Action::Described,
                (Fate::Replaced(Reason::NonVision | Reason::AsText), None) => Action::Stripped,
                (Fate::Replaced(Reason::AgedOut), _) => Action::AgedOut,
                (Fate::Replaced(Reason::Capped), _) => Action::Capped,
                (Fate::Replaced(Reason::Deduped), _) => Action::Deduped,
                (Fate::Replaced(Reason::CannotTake), Some(_)) => Action::Converted,
                (Fate::Replaced(Reason::CannotTake), None) => Action::Stripped,
            };
            if f.medium == Medium::Image {
                report.images_resized += usize::from(fitted[i].is_some());
                report.images_hoisted += usize::from(hoisted[i].is_some());
                report.images_replaced += usize::from(fate != Fate::Kept);
                report.images_described += usize::from(described(i).is_some());
            } else {
                report.media_replaced += usize::from(fate != Fate::Kept);
            }
            let mut n = note(f, fate, action);
            if let Some(done) = &fitted[i] {
                n.sent = Some(report::Sent {
                    media_type: done.media_type,
                    bytes: done.bytes.len(),
                    width: done.width,
                    height: done.height,
                });
            }
            report.images.push(n);
        }
        if let Some(b) = &new {
            report.bytes_saved = body.len() as i64 - b.len() as i64;
            // A rewritten body also goes out compact: that saving counts
            // with dedup when no image was replaced or resized, else with
            // images.
            if report.images_replaced + report.media_replaced + report.images_resized == 0 {
                report.bytes_saved_dedup = report.bytes_saved;
            }
        }
        Rewrite {
            body: new,
            report,
            artifacts,
        }
    }
}

#[cfg(test)]
mod tests;
