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
    !plan.vision || plan.rules.any() || plan.takes != Takes::ALL
}

/// Applies the plan to a body that is valid JSON, with placeholders only.
pub fn rewrite(body: &[u8], plan: &Plan) -> Rewrite {
    match scan(body, plan) {
        Ok(scanned) => scanned.finish(body, &[]),
        Err(nothing) => *nothing,
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
    let scan = match walk::scan(body, plan.shape) {
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
    let fates = decide(&scan, body, plan);
    Ok(Scanned {
        scan,
        plan: *plan,
        fates,
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
                Fate::Replaced(Reason::NonVision) => false,
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

    /// What becomes of each image.
    pub fn fates(&self) -> &[Fate] {
        &self.fates
    }

    /// Decodes and hashes the images to be replaced (after [`walk`]).
    pub fn resolve(&mut self, body: &[u8]) {
        for (i, fate) in self.fates.iter().enumerate() {
            if *fate != Fate::Kept {
                self.scan.resolve(i, body);
            }
        }
    }

    /// About how many bytes [`Scanned::resolve`] and [`Scanned::finish`]
    /// will go through: the base64 of the images to decode, and the text
    /// dedup reads. A caller runs them off its thread when this is large.
    pub fn work(&self) -> usize {
        let images: usize = (0..self.fates.len())
            .filter(|&i| self.fates[i] != Fate::Kept)
            .filter_map(|i| self.scan.pending_len(i))
            .sum();
        let texts: usize = match self.plan.rules.dedup {
            Some(_) => self
                .scan
                .texts
                .iter()
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
        let Scanned { scan, plan, fates } = self;
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
                Fate::Kept => None,
                Fate::Replaced(reason) => Some(placeholder(&scan.images[i], described(i), reason)),
            })
            .collect();
        let mut spot_text = scan.spot_texts(&texts);
        let mut joined = scan.joined(body, &texts, &spot_text);
        let omitted = match plan.rules.dedup {
            Some(blocks) => dedup::run(&scan, body, &texts, &mut spot_text, &mut joined, blocks),
            None => dedup::Omitted::default(),
        };
        let new = scan.assemble(body, plan.shape, &texts, &spot_text, &joined);
        let artifacts = scan.artifacts(|i| fates[i] != Fate::Kept);
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
        for (i, (f, &fate)) in scan.images.iter().zip(&fates).enumerate() {
            let action = match (fate, described(i)) {
                (Fate::Kept, _) => Action::Kept,
                (Fate::Replaced(Reason::NonVision), Some(_)) => Action::Described,
                (Fate::Replaced(Reason::NonVision), None) => Action::Stripped,
                (Fate::Replaced(Reason::AgedOut), _) => Action::AgedOut,
                (Fate::Replaced(Reason::Capped), _) => Action::Capped,
                (Fate::Replaced(Reason::Deduped), _) => Action::Deduped,
                (Fate::Replaced(Reason::CannotTake), Some(_)) => Action::Converted,
                (Fate::Replaced(Reason::CannotTake), None) => Action::Stripped,
            };
            if f.medium == Medium::Image {
                report.images_replaced += usize::from(fate != Fate::Kept);
                report.images_described += usize::from(described(i).is_some());
            } else {
                report.media_replaced += usize::from(fate != Fate::Kept);
            }
            report.images.push(note(f, fate, action));
        }
        if let Some(b) = &new {
            report.bytes_saved = body.len() as i64 - b.len() as i64;
            // A rewritten body also goes out compact: that saving counts
            // with dedup when no image was replaced, else with images.
            if report.images_replaced + report.media_replaced == 0 {
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
