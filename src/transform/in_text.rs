//! Images hidden in text: a `data:image/…;base64,` URL inside a user or
//! tool message's text, or an image object in JSON written into text
//! (MCP tool output, JSON in JSON strings, up to [`MAX_TEXT_JSON_DEPTH`]
//! levels).

use std::ops::Range;

use super::decode::{Read, eager};
use super::json::{Cursor, Kind, Result, Str};
use super::walk::*;

/// An image found in a text.
pub(super) struct InTextFound {
    /// Its bytes in the text (an object, or a data URL).
    pub(super) range: Range<usize>,
    pub(super) object: bool,
    /// JSON string encodings between the text and the image.
    pub(super) escapes: u8,
    pub(super) raw: TextRaw,
}

/// Where a found image's bytes are: in the text itself (read lazily from
/// it), or inside a JSON string in it (read already, from the decoded
/// string).
pub(super) enum TextRaw {
    Here(Raw),
    Read(Read),
}

/// Images in a text: JSON objects of a stringified tool result (MCP
/// `{"type":"image",…}` and the other image part shapes), also inside JSON
/// strings in that JSON (a result stringified twice, up to
/// [`MAX_TEXT_JSON_DEPTH`] levels), and `data:image/…;base64,…` URLs outside
/// them. Ranges are in `text`.
pub(super) fn find_in_text(text: &str) -> Vec<InTextFound> {
    find_in_text_at(text, 0)
}

pub(super) fn find_in_text_at(text: &str, depth: usize) -> Vec<InTextFound> {
    let mut out = Vec::new();
    let t = text.trim_start();
    if (t.starts_with('{') || t.starts_with('['))
        && memchr::memmem::find(text.as_bytes(), b"image").is_some()
        && super::json::is_json(text.as_bytes())
    {
        let mut c = Cursor::new(text.as_bytes());
        let _ = json_images(&mut c, &mut out, depth);
    }
    let bytes = text.as_bytes();
    let mut at = 0;
    while let Some(k) = memchr::memmem::find(&bytes[at..], b"data:image/") {
        let start = at + k;
        let end = data_url_end(bytes, start);
        at = end.max(start + 1);
        if out.iter().any(|f| f.range.contains(&start)) {
            continue;
        }
        if let Some(end) = end_if_base64(bytes, start, end) {
            out.push(InTextFound {
                range: start..end,
                object: false,
                escapes: 0,
                raw: TextRaw::Here(Raw::DataUrlInText(start..end)),
            });
        }
    }
    out.sort_by_key(|f| f.range.start);
    out
}

/// The images inside a JSON string of a text (the string `lit`, its
/// content JSON itself): found in the decoded string, their ranges mapped
/// back to the text, one encoding deeper, their bytes read now.
pub(super) fn images_in_string(src: &[u8], lit: &Str, depth: usize) -> Vec<InTextFound> {
    let raw = lit.raw(src);
    if !lit.escaped || memchr::memmem::find(raw, b"image").is_none() {
        return Vec::new();
    }
    let Some((decoded, map)) = unescape_mapped(raw, lit.range.start + 1) else {
        return Vec::new();
    };
    let found = find_in_text_at(&decoded, depth + 1);
    found
        .into_iter()
        .filter_map(|f| {
            let range = *map.get(f.range.start)?..*map.get(f.range.end)?;
            let read = match f.raw {
                TextRaw::Here(raw) => eager(decoded.as_bytes(), raw),
                TextRaw::Read(read) => read,
            };
            Some(InTextFound {
                range,
                object: f.object,
                escapes: f.escapes.saturating_add(1),
                raw: TextRaw::Read(read),
            })
        })
        .collect()
}

/// Decodes a JSON string's raw content, with where each decoded byte came
/// from (`base` + its offset in `raw`; one more entry for the end).
pub(super) fn unescape_mapped(raw: &[u8], base: usize) -> Option<(String, Vec<usize>)> {
    let mut out = Vec::with_capacity(raw.len());
    let mut map = Vec::with_capacity(raw.len() + 1);
    let hex4 = |at: usize| -> Option<u32> {
        let h = raw.get(at..at + 4)?;
        u32::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok()
    };
    let mut i = 0;
    while i < raw.len() {
        if raw[i] != b'\\' {
            out.push(raw[i]);
            map.push(base + i);
            i += 1;
            continue;
        }
        let start = i;
        let (ch, len) = match *raw.get(i + 1)? {
            b'u' => {
                let hi = hex4(i + 2)?;
                if (0xD800..0xDC00).contains(&hi) && raw.get(i + 6..i + 8) == Some(b"\\u") {
                    let lo = hex4(i + 8)?;
                    let c = 0x10000 + ((hi - 0xD800) << 10) + (lo.checked_sub(0xDC00)? & 0x3FF);
                    (char::from_u32(c)?, 12)
                } else {
                    (char::from_u32(hi)?, 6)
                }
            }
            b'"' => ('"', 2),
            b'\\' => ('\\', 2),
            b'/' => ('/', 2),
            b'b' => ('\u{8}', 2),
            b'f' => ('\u{c}', 2),
            b'n' => ('\n', 2),
            b'r' => ('\r', 2),
            b't' => ('\t', 2),
            _ => return None,
        };
        let mut buf = [0u8; 4];
        for &b in ch.encode_utf8(&mut buf).as_bytes() {
            out.push(b);
            map.push(base + start);
        }
        i += len;
    }
    map.push(base + raw.len());
    Some((String::from_utf8(out).ok()?, map))
}

/// The end of a data URL's media type and parameters, up to the comma.
pub(super) fn data_url_end(b: &[u8], start: usize) -> usize {
    let mut i = start + "data:".len();
    while i < b.len() && (b[i].is_ascii_alphanumeric() || b"/+.-;=_".contains(&b[i])) {
        i += 1;
    }
    i
}

/// When the data URL at `start` (head up to `head_end`) is `;base64,`,
/// the end of its base64 payload.
pub(super) fn end_if_base64(b: &[u8], start: usize, head_end: usize) -> Option<usize> {
    if !b[start..head_end].ends_with(b";base64") || b.get(head_end) != Some(&b',') {
        return None;
    }
    let mut i = head_end + 1;
    while i < b.len() && (b[i].is_ascii_alphanumeric() || b"+/=-_".contains(&b[i])) {
        i += 1;
    }
    Some(i)
}

/// The generic walk of JSON inside a text: any object shaped like an image
/// part is an image, wherever it sits.
pub(super) fn json_images(
    c: &mut Cursor<'_>,
    out: &mut Vec<InTextFound>,
    depth: usize,
) -> Result<()> {
    if depth > MAX_TEXT_JSON_DEPTH {
        c.skip()?;
        return Ok(());
    }
    match c.kind()? {
        Kind::String => {
            let lit = c.string()?;
            out.extend(images_in_string(c.src(), &lit, depth));
            Ok(())
        }
        Kind::Array => c.array(|c, _| json_images(c, out, depth + 1)).map(drop),
        Kind::Object => {
            let src = c.src();
            let mut f = PartFields::default();
            let before = out.len();
            let range = c.object(|c, key| {
                if !f.read(c, src, &key)? {
                    json_images(c, out, depth + 1)?;
                }
                Ok(())
            })?;
            // A part's `text` (read as a field) may itself be JSON holding
            // images, stringified once more.
            if let Some(text) = &f.text {
                out.extend(images_in_string(src, text, depth));
            }
            if let Some(ty) = &f.ty
                && let Some(raw) = classify_image(src, ty, &f)
            {
                out.truncate(before);
                out.push(InTextFound {
                    range,
                    object: true,
                    escapes: 0,
                    raw: TextRaw::Here(raw),
                });
            }
            Ok(())
        }
        _ => c.skip().map(drop),
    }
}
