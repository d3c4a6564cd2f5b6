//! Assembling the rewritten request: the chosen images replaced by their
//! texts, texts rewritten by dedup, a Chat tool message whose images are
//! all replaced collapsed to one string — splicing only those byte ranges,
//! every other byte (unknown fields included) as it was.

use std::borrow::Cow;
use std::ops::Range;

use super::json::{quote, splice, splice_compact};
use super::walk::*;
use super::{Fitted, HoistedPart, Shape};
use crate::artifacts::Artifact;

impl Scan {
    /// The text of spot `s` as the request has it.
    pub fn spot_decoded<'a>(&'a self, s: usize, body: &'a [u8]) -> Option<Cow<'a, str>> {
        let spot = self.spots.get(s)?;
        match &spot.text {
            Some(t) => Some(Cow::Borrowed(t.as_str())),
            None => spot.lit.decode(body),
        }
    }

    /// Where spot `s`'s string literal starts in the body.
    pub fn spot_start(&self, s: usize) -> usize {
        self.spots.get(s).map_or(0, |spot| spot.lit.range.start)
    }

    /// The length of spot `s`'s string literal in the body, quotes included.
    pub fn spot_literal_len(&self, s: usize) -> usize {
        self.spots.get(s).map_or(0, |spot| spot.lit.range.len())
    }

    /// The new text of each spot that holds a replaced image (`texts[i]`:
    /// the text that replaces image `i`, `None` to keep it).
    pub fn spot_texts(&self, texts: &[Option<String>]) -> Vec<Option<String>> {
        let mut spot_text: Vec<Option<String>> = vec![None; self.spots.len()];
        for (s, spot) in self.spots.iter().enumerate() {
            let Some(text) = &spot.text else { continue };
            let mut edits = Vec::new();
            for (i, img) in self.images.iter().enumerate() {
                if let (
                    Site::InText {
                        spot,
                        range,
                        object,
                        escapes,
                    },
                    Some(t),
                ) = (&img.site, &texts[i])
                    && *spot == s
                {
                    let mut new = if *object {
                        text_part(Shape::Chat, t)
                    } else {
                        t.clone().into_bytes()
                    };
                    // Inside JSON strings: encoded as deep as the image was.
                    for _ in 0..*escapes {
                        let q = quote(&String::from_utf8_lossy(&new));
                        new = q[1..q.len() - 1].to_vec();
                    }
                    edits.push((range.clone(), new));
                }
            }
            if !edits.is_empty() {
                let out = splice(text.as_bytes(), &edits);
                spot_text[s] = Some(String::from_utf8_lossy(&out).into_owned());
            }
        }
        spot_text
    }

    /// The string each collapsible Chat tool message becomes when all its
    /// images are replaced (`texts[i]` set): its parts, images as their
    /// texts, joined by line breaks. `None` for one that keeps its parts.
    pub fn joined(
        &self,
        body: &[u8],
        texts: &[Option<String>],
        spot_text: &[Option<String>],
    ) -> Vec<Option<String>> {
        self.collapsible
            .iter()
            .map(|col| {
                let mut parts = Vec::with_capacity(col.parts.len());
                for p in &col.parts {
                    parts.push(match p {
                        PartRef::Image(i) => texts.get(*i)?.clone()?,
                        PartRef::Text(s) => match spot_text.get(*s).and_then(Option::as_ref) {
                            Some(t) => t.clone(),
                            None => self
                                .spot_decoded(*s, body)
                                .map(Cow::into_owned)
                                .unwrap_or_default(),
                        },
                    });
                }
                Some(parts.join("\n"))
            })
            .collect()
    }

    /// The message collapsible `c` (an index into [`Scan::joined`]'s
    /// answer) is.
    pub fn joined_item(&self, c: usize) -> usize {
        self.collapsible.get(c).map_or(usize::MAX, |col| col.item)
    }

    /// The edits that write each fitted image's base64 and media type
    /// anew, every other byte of its part as it was.
    pub(super) fn fitted_edits(&self, fitted: &[Option<Fitted>]) -> Vec<(Range<usize>, Vec<u8>)> {
        let mut edits = Vec::new();
        for (img, done) in self.images.iter().zip(fitted) {
            let (Some(at), Some(done)) = (&img.encoded_at, done) else {
                continue;
            };
            let b64 = base64_simd::STANDARD.encode_type::<String>(&done.bytes);
            match at {
                EncodedAt::Fields { data, media_type } => {
                    edits.push((media_type.clone(), quote(done.media_type)));
                    edits.push((data.clone(), quote(&b64)));
                }
                EncodedAt::DataUrl(url) => {
                    let url_text = format!("data:{};base64,{b64}", done.media_type);
                    edits.push((url.clone(), quote(&url_text)));
                }
            }
        }
        edits
    }

    /// Rewrites `body`: image `i` replaced by `texts[i]` when set, spot `s`
    /// by `spot_text[s]` when set, collapsible Chat tool message `c` by
    /// `joined[c]` when set (see [`Scan::joined`]), and the `extra` edits
    /// (fitted images, hoisted parts). `None` when nothing is to change.
    pub fn assemble(
        &self,
        body: &[u8],
        shape: Shape,
        texts: &[Option<String>],
        spot_text: &[Option<String>],
        joined: &[Option<String>],
        extra: Vec<(Range<usize>, Vec<u8>)>,
    ) -> Option<Vec<u8>> {
        if texts.iter().all(Option::is_none)
            && spot_text.iter().all(Option::is_none)
            && extra.is_empty()
        {
            return None;
        }
        let mut edits: Vec<(Range<usize>, Vec<u8>)> = extra;
        for (i, img) in self.images.iter().enumerate() {
            if let (Site::Part(range), Some(t)) = (&img.site, &texts[i]) {
                let mut part = text_part(shape, t);
                // The part's prompt-cache markers stay where they were.
                for m in &img.markers {
                    if let Some(member) = body.get(m.clone()) {
                        part.pop();
                        part.push(b',');
                        part.extend_from_slice(member);
                        part.push(b'}');
                    }
                }
                edits.push((range.clone(), part));
            }
        }
        for (s, t) in spot_text.iter().enumerate() {
            if let Some(t) = t {
                edits.push((self.spots[s].lit.range.clone(), quote(t)));
            }
        }
        // A Chat tool message whose images are all replaced becomes a string.
        for (col, text) in self.collapsible.iter().zip(joined) {
            if let Some(text) = text {
                edits.retain(|(r, _)| !(col.range.start <= r.start && r.end <= col.range.end));
                edits.push((col.range.clone(), quote(text)));
            }
        }
        edits.sort_by_key(|(r, _)| r.start);
        Some(splice_compact(body, &edits))
    }

    /// The edits that send hoisted images as parts beside their text: a
    /// whole content string becomes an array (its text, then the images;
    /// its text then is not edited apart), a text part is followed by the
    /// images.
    pub(super) fn hoisted_parts(
        &self,
        body: &[u8],
        shape: Shape,
        hoisted: &[Option<HoistedPart>],
        spot_text: &mut [Option<String>],
    ) -> Vec<(Range<usize>, Vec<u8>)> {
        let mut out = Vec::new();
        for (s, spot) in self.spots.iter().enumerate() {
            let mut images = Vec::new();
            for (img, part) in self.images.iter().zip(hoisted) {
                if let (Site::InText { spot, .. }, Some(p)) = (&img.site, part)
                    && *spot == s
                {
                    images.push(b',');
                    images.extend(image_part(shape, p));
                }
            }
            if images.is_empty() {
                continue;
            }
            match &spot.holder {
                Holder::Content => {
                    let text = match spot_text[s].take() {
                        Some(t) => t,
                        None => self
                            .spot_decoded(s, body)
                            .map(Cow::into_owned)
                            .unwrap_or_default(),
                    };
                    let mut v = b"[".to_vec();
                    v.extend(text_part(shape, &text));
                    v.extend(images);
                    v.push(b']');
                    out.push((spot.lit.range.clone(), v));
                }
                Holder::Part(r) => out.push((r.end..r.end, images)),
                // Never hoisted from (see `walk::look_in_text`).
                Holder::Alone => {}
            }
        }
        out
    }

    /// The decoded bytes of images to save as artifacts, once per image.
    /// Takes the decoded bytes out of the scan (no copy).
    pub fn artifacts(&self, chosen: impl Fn(usize) -> bool) -> Vec<Artifact> {
        let mut out: Vec<Artifact> = Vec::new();
        for (i, img) in self.images.iter().enumerate() {
            if chosen(i)
                && !out.iter().any(|a| a.sha256 == img.sha256)
                && let Some(bytes) = img.bytes.clone()
            {
                out.push(Artifact {
                    sha256: img.sha256.clone(),
                    bytes,
                });
            }
        }
        out
    }
}

/// One image part in the request's own shape.
fn image_part(shape: Shape, p: &HoistedPart) -> Vec<u8> {
    let b64 = base64_simd::STANDARD.encode_type::<String>(&p.bytes);
    let url = || quote(&format!("data:{};base64,{b64}", p.media_type));
    let mut out = Vec::with_capacity(b64.len() + 96);
    match shape {
        Shape::Chat => {
            out.extend_from_slice(br#"{"type":"image_url","image_url":{"url":"#);
            out.extend(url());
            out.extend_from_slice(b"}}");
        }
        Shape::Messages => {
            out.extend_from_slice(br#"{"type":"image","source":{"type":"base64","media_type":"#);
            out.extend(quote(&p.media_type));
            out.extend_from_slice(br#","data":"#);
            out.extend(quote(&b64));
            out.extend_from_slice(b"}}");
        }
        Shape::Responses => {
            out.extend_from_slice(br#"{"type":"input_image","image_url":"#);
            out.extend(url());
            out.push(b'}');
        }
    }
    out
}

/// One text part in the request's own shape.
pub(super) fn text_part(shape: Shape, text: &str) -> Vec<u8> {
    let ty = shape.text_part_type();
    let mut out = Vec::with_capacity(text.len() + 32);
    out.extend_from_slice(b"{\"type\":\"");
    out.extend_from_slice(ty.as_bytes());
    out.extend_from_slice(b"\",\"text\":");
    out.extend_from_slice(&quote(text));
    out.push(b'}');
    out
}
