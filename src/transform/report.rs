//! What a rewrite did, for the caller: counts, one note per image, and the
//! `action` label of `visor_images_total`.

use serde::Serialize;

use super::placeholder::Reason;
use super::rules::Fate;
use super::walk::{Found, Medium, Source};

/// One image, as reported.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ImageNote {
    pub path: String,
    /// Empty for an image that was kept without being decoded.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub sha256: String,
    pub kind: &'static str,
    /// `image`, `document` or `audio`.
    pub medium: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
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
    /// `kept`, `described` or `stripped` (a model that cannot see), or
    /// `aged_out`, `capped`, `deduped` (the rules for every model);
    /// `converted` (a document or audio turned into text).
    pub action: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    pub in_tool_result: bool,
    /// A kept image fitted to the model (`resized`): what was sent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sent: Option<Sent>,
}

/// An image as it was sent after fitting.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Sent {
    pub media_type: &'static str,
    pub bytes: usize,
    pub width: u32,
    pub height: u32,
}

/// What the transforms did to one request.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Report {
    pub images_found: usize,
    pub images_replaced: usize,
    /// Kept images scaled or re-encoded to fit the model.
    pub images_resized: usize,
    /// Images found as base64 in a text, sent as image parts.
    pub images_hoisted: usize,
    /// Of the replaced images, those replaced by their description.
    pub images_described: usize,
    /// Documents and audio replaced by text (or a reference).
    pub media_replaced: usize,
    /// Request bytes removed (negative when the rewrite grew the body).
    pub bytes_saved: i64,
    /// Of those, removed by line and item dedup.
    pub bytes_saved_dedup: i64,
    /// Repeated lines and JSON array elements removed.
    pub lines_omitted: usize,
    pub items_omitted: usize,
    /// Messages (Responses: input items) in the request.
    pub messages: usize,
    /// Dedup read only the messages new since the conversation's previous
    /// request (continuing the state it left).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub dedup_continued: bool,
    /// Stored session messages prepended (set by the proxy).
    #[serde(skip)]
    pub history_used: usize,
    /// Where they were put: before the client's message at this index.
    #[serde(skip)]
    pub history_at: usize,
    /// Prompt-cache breakpoints added (set by the proxy).
    #[serde(skip)]
    pub breakpoints: usize,
    /// A `prompt_cache_key` added (set by the proxy).
    #[serde(skip)]
    pub cache_key: bool,
    pub images: Vec<ImageNote>,
    /// Set when the body could not be walked and was left unchanged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<&'static str>,
}

impl Report {
    /// The document or audio `sha256` could not be turned into text (it
    /// was replaced by a line saying why): `stripped`, not `converted`.
    pub fn not_converted(&mut self, sha256: &str) {
        for n in self.images.iter_mut() {
            if n.sha256 == sha256 && n.action == Action::Converted.label() {
                n.action = Action::Stripped.label();
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    Kept,
    Described,
    Stripped,
    AgedOut,
    Capped,
    Deduped,
    /// A document or audio turned into text.
    Converted,
    /// A kept image scaled or re-encoded to fit the model.
    Resized,
    /// Base64 in a text sent as an image part beside it.
    Hoisted,
}

impl Action {
    /// The `action` label of `visor_images_total`.
    fn label(self) -> &'static str {
        match self {
            Action::Kept => "kept",
            Action::Described => "described",
            Action::Stripped => "stripped",
            Action::AgedOut => "aged_out",
            Action::Capped => "capped",
            Action::Deduped => "deduped",
            Action::Converted => "converted",
            Action::Resized => "resized",
            Action::Hoisted => "hoisted",
        }
    }
}

pub(super) fn note(f: &Found, fate: Fate, action: Action) -> ImageNote {
    let reason = match fate {
        Fate::Kept => None,
        Fate::Replaced(r) => Some(r),
    };
    let mut n = ImageNote {
        path: f.path.clone(),
        sha256: f.sha256.clone(),
        kind: "",
        medium: f.medium.label(),
        name: match &f.medium {
            Medium::Document { name, .. } => name.clone(),
            _ => None,
        },
        media_type: None,
        bytes: None,
        width: None,
        height: None,
        url: None,
        problem: None,
        action: action.label(),
        reason,
        in_tool_result: f.in_tool_result,
        sent: None,
    };
    match &f.source {
        Source::Encoded { media_type } => {
            n.kind = "base64";
            n.media_type = (!media_type.is_empty()).then(|| media_type.clone());
        }
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
