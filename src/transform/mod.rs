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
pub mod walk;

use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;

use crate::artifacts::Artifact;
use crate::config::{RawDedup, RawImages};
use placeholder::{Reason, placeholder};
use report::{Action, note};
pub use report::{ImageNote, Report};
pub use rules::{Fate, decide};
use walk::Found;

/// The API shape of a transformed endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Shape {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/responses`
    Responses,
    /// `POST /v1/messages` (Anthropic)
    Messages,
}

impl Shape {
    /// The shape of a path after `/v1`, for `POST`.
    pub fn of_path(rest: &str) -> Option<Shape> {
        match rest {
            "/chat/completions" => Some(Shape::Chat),
            "/responses" => Some(Shape::Responses),
            "/messages" => Some(Shape::Messages),
            _ => None,
        }
    }
}

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
    /// The provider caches prompt prefixes (cached input at a tenth): an
    /// image already sent is replaced only when that pays (see [`decide`]).
    pub prompt_cache: bool,
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
        dedup: None,
    };

    /// The rules of the `[images]` and `[dedup]` sections, for a model
    /// whose table row says `max_images` (the smaller cap wins).
    pub fn new(images: &RawImages, dedup: &RawDedup, model_max_images: Option<u32>) -> Rules {
        let cap = images.max_per_request as usize;
        Rules {
            keep_turns: images.keep_turns as usize,
            max_images: model_max_images.map_or(cap, |m| cap.min(m as usize)),
            hard_max_images: model_max_images.map(|m| m as usize),
            dedupe: images.dedupe,
            prompt_cache: images.prompt_cache,
            dedup: dedup.enabled.then_some(dedup::Blocks {
                min_lines: dedup.min_run_lines as usize,
                min_bytes: dedup.min_run_bytes as usize,
            }),
        }
    }

    fn any(&self) -> bool {
        *self != Rules::NONE
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
        }
    }
}

/// An image a describer can be sent: the full SHA-256 hex it is known by
/// (of its bytes, or of its URL) and the image itself.
#[derive(Debug, Clone)]
pub struct Subject {
    pub sha256: String,
    pub image: SubjectImage,
    /// Only a cached description may be used (an aged-out or capped
    /// image): the describer is not called for it.
    pub lookup_only: bool,
}

#[derive(Debug, Clone)]
pub enum SubjectImage {
    /// Decoded bytes and their media type.
    Inline {
        media_type: String,
        bytes: bytes::Bytes,
    },
    /// An http(s) URL, passed on as it is.
    Url(String),
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
    !plan.vision || plan.rules.any()
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
#[derive(Debug)]
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
    pub fn subjects(&self) -> Vec<(usize, Subject)> {
        if !self.plan.describe {
            return Vec::new();
        }
        let mut at: HashMap<&str, usize> = HashMap::new();
        let mut out: Vec<(usize, Subject)> = Vec::new();
        for (i, f) in self.scan.images.iter().enumerate() {
            let lookup_only = match self.fates[i] {
                Fate::Replaced(Reason::NonVision) => false,
                Fate::Replaced(Reason::AgedOut | Reason::Capped) => true,
                Fate::Kept | Fate::Replaced(Reason::Deduped) => continue,
            };
            let Some(mut s) = f.subject() else { continue };
            s.lookup_only = lookup_only;
            match at.get(f.sha256.as_str()) {
                Some(&k) => out[k].1.lookup_only &= lookup_only,
                None => {
                    at.insert(f.sha256.as_str(), out.len());
                    out.push((i, s));
                }
            }
        }
        out
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
    /// text), else the placeholder.
    pub fn finish(self, body: &[u8], descriptions: &[(String, Arc<str>)]) -> Rewrite {
        let Scanned { scan, plan, fates } = self;
        let by_sha: HashMap<&str, &str> = descriptions
            .iter()
            .map(|(sha, d)| (sha.as_str(), &**d))
            .collect();
        let described = |f: &Found, fate: Fate| match fate {
            Fate::Replaced(Reason::Deduped) | Fate::Kept => None,
            Fate::Replaced(_) => by_sha.get(f.sha256.as_str()).copied(),
        };
        let texts: Vec<Option<String>> = scan
            .images
            .iter()
            .zip(&fates)
            .map(|(f, &fate)| match fate {
                Fate::Kept => None,
                Fate::Replaced(reason) => Some(placeholder(f, described(f, fate), reason)),
            })
            .collect();
        let mut spot_text = scan.spot_texts(&texts);
        let mut joined = scan.joined(body, &texts, &spot_text);
        let omitted = match plan.rules.dedup {
            Some(blocks) => dedup::run(&scan, body, &mut spot_text, &mut joined, blocks),
            None => dedup::Omitted::default(),
        };
        let new = scan.assemble(body, plan.shape, &texts, &spot_text, &joined);
        let artifacts = scan.artifacts(|i| fates[i] != Fate::Kept);
        let mut report = Report {
            images_found: scan.images.len(),
            lines_omitted: omitted.lines,
            items_omitted: omitted.items,
            bytes_saved_dedup: omitted.bytes,
            ..Report::default()
        };
        for (f, &fate) in scan.images.iter().zip(&fates) {
            let action = match (fate, described(f, fate)) {
                (Fate::Kept, _) => Action::Kept,
                (Fate::Replaced(Reason::NonVision), Some(_)) => Action::Described,
                (Fate::Replaced(Reason::NonVision), None) => Action::Stripped,
                (Fate::Replaced(Reason::AgedOut), _) => Action::AgedOut,
                (Fate::Replaced(Reason::Capped), _) => Action::Capped,
                (Fate::Replaced(Reason::Deduped), _) => Action::Deduped,
            };
            report.images_replaced += usize::from(fate != Fate::Kept);
            report.images_described += usize::from(described(f, fate).is_some());
            report.images.push(note(f, fate, action));
        }
        if let Some(b) = &new {
            report.bytes_saved = body.len() as i64 - b.len() as i64;
            // A rewritten body also goes out compact: that saving counts
            // with dedup when no image was replaced, else with images.
            if report.images_replaced == 0 {
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
