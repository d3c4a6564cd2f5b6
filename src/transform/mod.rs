//! Request transforms: pure functions from a request body (and the data
//! they need, looked up by the async edges) to a rewritten body and a
//! [`Report`]. No I/O here.
//!
//! - [`images`]: finds every image and replaces the chosen ones in place.
//!
//! A body nothing applies to is left alone: the caller forwards the
//! original bytes.

pub mod images;
pub mod json;

use std::sync::Arc;

use serde::Serialize;

use crate::artifacts::Artifact;
use images::{Found, Reason, Source, placeholder};

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
}

/// An image a describer can be sent: the full SHA-256 hex it is known by
/// (of its bytes, or of its URL) and the image itself.
#[derive(Debug, Clone)]
pub struct Subject {
    pub sha256: String,
    pub image: SubjectImage,
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

/// One image, as reported.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ImageNote {
    pub path: String,
    pub sha256: String,
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub width: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub height: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<&'static str>,
    /// `kept`, `described` or `stripped` (later: aged_out, capped, deduped).
    pub action: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    pub in_tool_result: bool,
}

/// What the transforms did to one request.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Report {
    pub images_found: usize,
    pub images_replaced: usize,
    /// Of the replaced images, those replaced by their description.
    pub images_described: usize,
    /// Request bytes removed (negative when the rewrite grew the body).
    pub bytes_saved: i64,
    pub images: Vec<ImageNote>,
    /// Set when the body could not be walked and was left unchanged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<&'static str>,
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
}

/// Applies the plan to a body that is valid JSON, with placeholders only.
pub fn rewrite(body: &[u8], plan: &Plan) -> Rewrite {
    match scan(body, plan) {
        Ok(scanned) => scanned.finish(body, &[]),
        Err(nothing) => nothing,
    }
}

/// The first half of a rewrite: every image found, and which are replaced.
/// Between [`scan`] and [`Scanned::finish`] the caller may look up
/// descriptions for [`Scanned::subjects`].
#[derive(Debug)]
pub struct Scanned {
    scan: images::Scan,
    plan: Plan,
    replace: Vec<bool>,
}

/// Finds the images in `body`. `Err` holds the finished rewrite when
/// nothing is to be done (or the body cannot be walked).
pub fn scan(body: &[u8], plan: &Plan) -> Result<Scanned, Rewrite> {
    if !needed(plan) {
        return Err(Rewrite::default());
    }
    let scan = match images::scan(body, plan.shape) {
        Ok(s) => s,
        Err(_) => {
            return Err(Rewrite {
                report: Report {
                    skipped: Some("the body is not an object of the expected shape"),
                    ..Report::default()
                },
                ..Rewrite::default()
            });
        }
    };
    let replace = scan.images.iter().map(|_| !plan.vision).collect();
    Ok(Scanned {
        scan,
        plan: *plan,
        replace,
    })
}

impl Scanned {
    /// The replaced images a describer could describe, with their index:
    /// each distinct image once (in describe mode; none otherwise).
    pub fn subjects(&self) -> Vec<(usize, Subject)> {
        if !self.plan.describe {
            return Vec::new();
        }
        let mut seen = std::collections::HashSet::new();
        let mut out: Vec<(usize, Subject)> = Vec::new();
        for (i, f) in self.scan.images.iter().enumerate() {
            if self.replace[i]
                && let Some(s) = f.subject()
                && seen.insert(f.sha256.as_str())
            {
                out.push((i, s));
            }
        }
        out
    }

    /// Rewrites `body`: each replaced image becomes its description when
    /// `descriptions` has one for its SHA-256 (pairs of full hex and
    /// text), else the placeholder.
    pub fn finish(self, body: &[u8], descriptions: &[(String, Arc<str>)]) -> Rewrite {
        let Scanned {
            scan,
            plan,
            replace,
        } = self;
        let by_sha: std::collections::HashMap<&str, &str> = descriptions
            .iter()
            .map(|(sha, d)| (sha.as_str(), &**d))
            .collect();
        let described = |f: &Found| by_sha.get(f.sha256.as_str()).copied();
        let new = scan.apply(body, plan.shape, |i, f| {
            replace[i].then(|| placeholder(f, described(f), Reason::NonVision))
        });
        let artifacts = scan.artifacts(|i| replace[i]);
        let mut report = Report {
            images_found: scan.images.len(),
            ..Report::default()
        };
        for (i, f) in scan.images.iter().enumerate() {
            let action = match (replace[i], described(f)) {
                (false, _) => Action::Kept,
                (true, Some(_)) => Action::Described,
                (true, None) => Action::Stripped,
            };
            report.images_replaced += usize::from(replace[i]);
            report.images_described += usize::from(action == Action::Described);
            report.images.push(note(f, action));
        }
        if let Some(b) = &new {
            report.bytes_saved = body.len() as i64 - b.len() as i64;
        }
        Rewrite {
            body: new,
            report,
            artifacts,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Kept,
    Described,
    Stripped,
}

fn note(f: &Found, action: Action) -> ImageNote {
    let reason = (action != Action::Kept).then_some(Reason::NonVision);
    let mut n = ImageNote {
        path: f.path.clone(),
        sha256: f.sha256.clone(),
        kind: "",
        media_type: None,
        bytes: None,
        width: None,
        height: None,
        url: None,
        problem: None,
        action: match action {
            Action::Kept => "kept",
            Action::Described => "described",
            Action::Stripped => "stripped",
        },
        reason,
        in_tool_result: f.in_tool_result,
    };
    match &f.source {
        Source::Inline {
            media_type,
            size,
            dims,
        } => {
            n.kind = "base64";
            n.media_type = Some(media_type.clone());
            n.bytes = Some(*size);
            n.width = dims.map(|d| d.0);
            n.height = dims.map(|d| d.1);
        }
        Source::Url(u) => {
            n.kind = "url";
            n.url = Some(u.clone());
        }
        Source::File(id) => {
            n.kind = "file";
            n.url = Some(id.clone());
        }
        Source::Broken(why) => {
            n.kind = "broken";
            n.problem = Some(why);
        }
    }
    n
}

#[cfg(test)]
mod tests;
