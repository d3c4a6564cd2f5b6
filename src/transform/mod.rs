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
    /// `kept` or `stripped` (later: described, aged_out, capped, deduped).
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

/// Applies the plan to a body that is valid JSON.
pub fn rewrite(body: &[u8], plan: &Plan) -> Rewrite {
    if !needed(plan) {
        return Rewrite::default();
    }
    let mut scan = match images::scan(body, plan.shape) {
        Ok(s) => s,
        Err(_) => {
            return Rewrite {
                report: Report {
                    skipped: Some("the body is not an object of the expected shape"),
                    ..Report::default()
                },
                ..Rewrite::default()
            };
        }
    };
    let replace = |_: usize, _: &Found| !plan.vision;
    let new = scan.apply(body, plan.shape, |i, f| {
        replace(i, f).then(|| placeholder(f, None, Reason::NonVision))
    });
    let chosen: Vec<bool> = scan
        .images
        .iter()
        .enumerate()
        .map(|(i, f)| replace(i, f))
        .collect();
    let artifacts = scan.artifacts(|i| chosen[i]);
    let mut report = Report {
        images_found: scan.images.len(),
        ..Report::default()
    };
    for (i, f) in scan.images.iter().enumerate() {
        let replaced = replace(i, f);
        report.images_replaced += usize::from(replaced);
        report
            .images
            .push(note(f, replaced.then_some(Reason::NonVision)));
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

fn note(f: &Found, reason: Option<Reason>) -> ImageNote {
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
        action: if reason.is_some() { "stripped" } else { "kept" },
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
