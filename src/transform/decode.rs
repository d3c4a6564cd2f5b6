//! Decoding and hashing: an image's base64 decoded once, sniffed for its
//! media type and size, and named by its SHA-256 — only for the images a
//! caller is going to replace ([`Scan::resolve`]).

use std::ops::Range;

use bytes::Bytes;
use sha2::{Digest, Sha256};

use super::json::Str;
use super::walk::*;
use crate::artifacts::sniff_media_type;

pub(super) fn hex(digest: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(digest.len() * 2);
    for b in digest {
        let _ = write!(s, "{b:02x}");
    }
    s
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// What the walk knows of one image: base64 text without escapes is left
/// to decode later ([`Scan::resolve`]); everything else is read now.
pub(super) type Read = (String, Source, Option<Vec<u8>>, Option<Pending>);

pub(super) fn read_lazily(src: &[u8], raw: Raw, spot: Option<usize>) -> Read {
    let text = |s: &Str| s.decode(src).map(|c| c.into_owned()).unwrap_or_default();
    let encoded = |media_type: String, range: Range<usize>, at| {
        (
            String::new(),
            Source::Encoded {
                media_type: media_type.to_ascii_lowercase(),
            },
            None,
            Some(Pending { spot, range, at }),
        )
    };
    match raw {
        Raw::Base64(d, mt) if !d.escaped => {
            let at = mt
                .as_ref()
                .filter(|_| spot.is_none())
                .map(|m| EncodedAt::Fields {
                    data: d.range.clone(),
                    media_type: m.range.clone(),
                });
            let mt = mt.map(|m| text(&m)).unwrap_or_default();
            encoded(mt, d.range.start + 1..d.range.end - 1, at)
        }
        Raw::DataUrl(s) if !s.escaped => {
            let start = s.range.start + 1;
            match data_url_payload(s.raw(src)) {
                Some((mt, at)) => {
                    let url = spot.is_none().then(|| EncodedAt::DataUrl(s.range.clone()));
                    encoded(mt, start + at..s.range.end - 1, url)
                }
                None => eager(src, Raw::DataUrl(s)),
            }
        }
        Raw::DataUrlInText(range) => match src.get(range.clone()).and_then(data_url_payload) {
            Some((mt, at)) => encoded(mt, range.start + at..range.end, None),
            None => eager(src, Raw::DataUrlInText(range)),
        },
        raw => eager(src, raw),
    }
}

pub(super) fn eager(src: &[u8], raw: Raw) -> Read {
    let (sha, source, bytes) = read_image(src, raw);
    (sha, source, bytes, None)
}

/// A base64 data URL's media type and where its payload starts.
pub(super) fn data_url_payload(url: &[u8]) -> Option<(String, usize)> {
    let comma = memchr::memchr(b',', url)?;
    let head = std::str::from_utf8(url.get(..comma + 1)?).ok()?;
    let (mt, _) = split_data_url(head)?;
    Some((mt.to_owned(), comma + 1))
}

/// Decodes and hashes one image.
pub(super) fn read_image(src: &[u8], raw: Raw) -> (String, Source, Option<Vec<u8>>) {
    let text = |s: &Str| s.decode(src).map(|c| c.into_owned()).unwrap_or_default();
    match raw {
        Raw::Url(u) => {
            let url = text(&u);
            (sha256_hex(url.as_bytes()), Source::Url(url), None)
        }
        Raw::File(id) => {
            let id = text(&id);
            (sha256_hex(id.as_bytes()), Source::File(id), None)
        }
        Raw::Broken(why) => (sha256_hex(b""), Source::Broken(why), None),
        Raw::Text(t) => {
            let text = text(&t);
            let size = text.len();
            let source = Source::Inline {
                media_type: "text/plain".to_owned(),
                size,
                dims: None,
            };
            (sha256_hex(text.as_bytes()), source, Some(text.into_bytes()))
        }
        Raw::DataUrlInText(range) => {
            let url = src
                .get(range)
                .and_then(|b| std::str::from_utf8(b).ok())
                .unwrap_or_default();
            read_data_url(url)
        }
        Raw::DataUrl(s) => read_data_url(&s.decode(src).unwrap_or_default()),
        Raw::Base64(d, mt) => {
            let mt = mt.and_then(|m| m.decode(src)).unwrap_or_default();
            if d.escaped {
                let data = d.decode(src).unwrap_or_default();
                decode_image(data.as_bytes(), &mt)
            } else {
                decode_image(d.raw(src), &mt)
            }
        }
    }
}

pub(super) fn read_data_url(url: &str) -> (String, Source, Option<Vec<u8>>) {
    match split_data_url(url) {
        Some((mt, b64)) => decode_image(b64.as_bytes(), mt),
        None => (
            sha256_hex(url.as_bytes()),
            Source::Broken("a data URL that is not base64"),
            None,
        ),
    }
}

/// `data:image/png;base64,AAAA` → (`image/png`, `AAAA`).
pub(super) fn split_data_url(url: &str) -> Option<(&str, &str)> {
    let rest = url.strip_prefix("data:")?;
    let comma = rest.find(',')?;
    let (meta, data) = (&rest[..comma], &rest[comma + 1..]);
    let meta = meta.strip_suffix(";base64")?;
    let mt = meta.split(';').next().unwrap_or("");
    Some((mt, data))
}

pub(super) fn decode_image(b64: &[u8], declared: &str) -> (String, Source, Option<Vec<u8>>) {
    let decoded = base64_simd::STANDARD
        .decode_to_vec(b64)
        .or_else(|_| base64_simd::forgiving_decode_to_vec(b64))
        .or_else(|_| base64_simd::URL_SAFE_NO_PAD.decode_to_vec(trim_pad(b64)));
    match decoded {
        Err(_) => (
            sha256_hex(b64),
            Source::Broken("its base64 data is invalid"),
            None,
        ),
        Ok(bytes) if bytes.is_empty() => (sha256_hex(b""), Source::Broken("it is empty"), None),
        Ok(bytes) => {
            let sha = sha256_hex(&bytes);
            let sniffed = sniff_media_type(&bytes);
            // A declared type that is not `type/subtype` in token
            // characters is not trusted (it ends up in placeholders and
            // in the transcriber's multipart headers).
            let media_type = match valid_media_type(declared) {
                Some(mt) => mt,
                None => sniffed.unwrap_or("application/octet-stream").to_owned(),
            };
            let dims = imagesize::blob_size(&bytes)
                .ok()
                .map(|s| (s.width, s.height));
            let size = bytes.len();
            (
                sha,
                Source::Inline {
                    media_type,
                    size,
                    dims,
                },
                Some(bytes),
            )
        }
    }
}

/// `declared` lower-cased when it is a media type (`type/subtype`, token
/// characters only, parameters dropped, at most 100 bytes).
pub(crate) fn valid_media_type(declared: &str) -> Option<String> {
    let essence = declared.split(';').next().unwrap_or("").trim();
    let token = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
    };
    let (ty, sub) = essence.split_once('/')?;
    (essence.len() <= 100 && token(ty) && token(sub)).then(|| essence.to_ascii_lowercase())
}

pub(super) fn trim_pad(b: &[u8]) -> &[u8] {
    let mut end = b.len();
    while end > 0 && b[end - 1] == b'=' {
        end -= 1;
    }
    &b[..end]
}

impl Scan {
    /// How many bytes image `i` takes where it sits (its part, or its
    /// object or URL inside a text).
    pub fn image_len(&self, i: usize) -> usize {
        match self.images.get(i).map(|f| &f.site) {
            Some(Site::Part(r)) => r.len(),
            Some(Site::InText { range, .. }) => range.len(),
            None => 0,
        }
    }

    /// Decodes and hashes image `i` when the walk left it encoded (its
    /// SHA-256, media type, size and dimensions are then known).
    pub fn resolve(&mut self, i: usize, body: &[u8]) {
        let Some(img) = self.images.get(i) else {
            return;
        };
        let Some(p) = &img.pending else { return };
        let declared = match &img.source {
            Source::Encoded { media_type } => media_type.as_str(),
            _ => "",
        };
        let src = match p.spot {
            None => body,
            Some(s) => self
                .spots
                .get(s)
                .and_then(|s| s.text.as_deref())
                .unwrap_or_default()
                .as_bytes(),
        };
        let (sha256, source, bytes) =
            decode_image(src.get(p.range.clone()).unwrap_or_default(), declared);
        if let Some(img) = self.images.get_mut(i) {
            img.sha256 = sha256;
            img.source = source;
            img.bytes = bytes.map(Bytes::from);
            img.pending = None;
        }
    }

    /// Image `i` as a fit found by its text says it came: its SHA-256,
    /// media type, size and dimensions, without decoding it (its bytes
    /// stay unread: the original was saved when it was first fitted). Its
    /// text stays where it is, so a later pass that needs its bytes (a
    /// request still over its byte bound) decodes it then.
    pub fn known(&mut self, i: usize, original: &super::Original) {
        if let Some(img) = self.images.get_mut(i) {
            img.sha256.clone_from(&original.sha256);
            img.source = Source::Inline {
                media_type: original.media_type.clone(),
                size: original.size,
                dims: original.dims,
            };
        }
    }

    /// What tells image `i` apart from others without decoding it: its
    /// base64 text while encoded, else its SHA-256 hex. `None` for broken
    /// data (never the same image as another).
    pub fn identity<'a>(&'a self, i: usize, body: &'a [u8]) -> Option<&'a [u8]> {
        let img = self.images.get(i)?;
        if let Source::Broken(_) = img.source {
            return None;
        }
        match &img.pending {
            None => Some(img.sha256.as_bytes()),
            Some(p) => {
                let src = match p.spot {
                    None => body,
                    Some(s) => self.spots.get(s)?.text.as_deref()?.as_bytes(),
                };
                src.get(p.range.clone())
            }
        }
    }

    /// The length of the base64 text of image `i` when it is not decoded yet.
    pub fn pending_len(&self, i: usize) -> Option<usize> {
        self.images.get(i)?.pending.as_ref().map(|p| p.range.len())
    }
}
