//! The walk: every image in a request, found in one pass over its bytes.
//!
//! [`scan`] walks the request once (see [`super::json`]) and returns each
//! image with where it sits: a content part (Chat `image_url`, MCP-native
//! `{"type":"image","data","mimeType"}`, Responses `input_image`, Anthropic
//! `image` blocks — also inside tool results), or hidden in the text of a
//! user or tool message ([`super::in_text`]: a `data:image/…;base64,` URL,
//! or JSON-stringified MCP output). The walk also records every message's
//! role and text strings, for the image rules and line dedup.
//!
//! Base64 images are not decoded by the walk: [`Scan::resolve`]
//! ([`super::decode`]) decodes and hashes the ones a caller is going to
//! replace, so an image that passes through (a vision model's) costs the
//! walk over its string and nothing more. [`super::assemble`] then writes
//! the request with the chosen images replaced.

use std::ops::Range;

use bytes::Bytes;

use super::decode::read_lazily;
use super::in_text::{InTextFound, TextRaw, find_in_text};
use super::json::{Cursor, Kind, Malformed, Result, Str};
use super::{Payload, Shape, Subject};

/// Descent into nested tool results stops here (deeper ones are left as
/// they are).
pub(super) const MAX_NESTING: usize = 8;
/// Depth of the generic walk over JSON found inside a text.
pub(super) const MAX_TEXT_JSON_DEPTH: usize = 32;

/// What an image is, once read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Base64 data not decoded yet (see [`Scan::resolve`]), with its
    /// declared media type.
    Encoded { media_type: String },
    /// Base64 bytes that decoded to a non-empty image.
    Inline {
        media_type: String,
        size: usize,
        dims: Option<(usize, usize)>,
    },
    /// An http(s) (or other) URL; visor never fetches it.
    Url(String),
    /// A provider file id (Responses `file_id`, Anthropic `source.file_id`).
    File(String),
    /// Could not be read; the reason is said in the placeholder.
    Broken(&'static str),
}

/// What a found part is: an image, a document or audio.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Medium {
    Image,
    /// A document, with its file name when the part gives one.
    Document {
        family: DocFamily,
        name: Option<String>,
    },
    /// Speech or other audio, with its declared format (`wav`, `mp3`…).
    Audio {
        format: Option<String>,
    },
}

impl Medium {
    /// The `kind` label of `visor_media_total`.
    pub fn label(&self) -> &'static str {
        match self {
            Medium::Image => "image",
            Medium::Document { .. } => "document",
            Medium::Audio { .. } => "audio",
        }
    }
}

/// Which model capability a document needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DocFamily {
    /// PDF: the table's `pdf` column.
    Pdf,
    /// DOCX, PPTX, XLSX: the table's `office` column.
    Office,
    /// Anything else (plain text, CSV, Markdown…): taken where PDFs are.
    Other,
}

impl DocFamily {
    /// From a declared media type, else a file name's extension, else the
    /// first bytes of the base64 (`JVBER` is `%PDF`, `UEsDB` a zip).
    pub fn of(media_type: &str, name: Option<&str>, b64_head: &[u8]) -> DocFamily {
        let mt = media_type.to_ascii_lowercase();
        if mt == "application/pdf" {
            return DocFamily::Pdf;
        }
        if mt.starts_with("application/vnd.openxmlformats-officedocument.") {
            return DocFamily::Office;
        }
        let ext = name
            .and_then(|n| n.rsplit_once('.'))
            .map(|(_, e)| e.to_ascii_lowercase());
        match ext.as_deref() {
            Some("pdf") => return DocFamily::Pdf,
            Some(e) if OFFICE_EXTENSIONS.contains(&e) => return DocFamily::Office,
            _ => {}
        }
        if mt.starts_with("application/vnd.ms-word.")
            || mt.starts_with("application/vnd.ms-excel.")
            || mt.starts_with("application/vnd.ms-powerpoint.")
        {
            return DocFamily::Office;
        }
        let head = head_bytes(b64_head, 3072);
        if head.starts_with(b"%PDF-") {
            DocFamily::Pdf
        } else if office_zip(&head) {
            DocFamily::Office
        } else {
            DocFamily::Other
        }
    }
}

/// Extensions of the Office Open XML files visor reads (documents,
/// templates, macro-enabled files, slide shows: one format each).
pub const OFFICE_EXTENSIONS: &[&str] = &[
    "docx", "docm", "dotx", "dotm", "pptx", "pptm", "ppsx", "ppsm", "potx", "potm", "xlsx", "xlsm",
    "xltx", "xltm",
];

/// The first bytes of base64 data as it sits in the JSON text (escapes
/// such as `\/` and line breaks undone), decoded: up to `max` bytes.
fn head_bytes(b64_head: &[u8], max: usize) -> Vec<u8> {
    let want = max.div_ceil(3) * 4;
    let mut chars = Vec::with_capacity(want);
    let mut i = 0;
    while i < b64_head.len() && chars.len() < want {
        match b64_head[i] {
            b'\\' => {
                match b64_head.get(i + 1) {
                    Some(b'/') => chars.push(b'/'),
                    Some(b'u') => i += 4,
                    _ => {}
                }
                i += 2;
            }
            b if b.is_ascii_whitespace() => i += 1,
            b => {
                chars.push(b);
                i += 1;
            }
        }
    }
    chars.truncate(chars.len() / 4 * 4);
    base64_simd::STANDARD
        .decode_to_vec(&chars)
        .or_else(|_| base64_simd::URL_SAFE.decode_to_vec(&chars))
        .or_else(|_| base64_simd::forgiving_decode_to_vec(&chars))
        .unwrap_or_default()
}

/// A zip that is an Office Open XML package, from its local file headers
/// in `head`: an entry under `word/`, `ppt/` or `xl/`, or a first entry
/// that only such packages start with (`[Content_Types].xml`, `_rels/`,
/// `docProps/`, `customXml/`). Other zips are not Office files.
fn office_zip(head: &[u8]) -> bool {
    const FIRST: [&[u8]; 4] = [
        b"[Content_Types].xml",
        b"_rels/",
        b"docProps/",
        b"customXml/",
    ];
    const PARTS: [&[u8]; 3] = [b"word/", b"ppt/", b"xl/"];
    let mut at = 0usize;
    for entry in 0..64 {
        let Some(header) = head.get(at..at + 30) else {
            return false;
        };
        if !header.starts_with(b"PK\x03\x04") {
            return false;
        }
        let word = |i: usize| usize::from(u16::from_le_bytes([header[i], header[i + 1]]));
        let (flags, name_len, extra_len) = (word(6), word(26), word(28));
        let compressed = u32::from_le_bytes([header[18], header[19], header[20], header[21]]);
        let name = head.get(at + 30..).unwrap_or_default();
        let name = name.get(..name_len).unwrap_or(name);
        // The whole name, or as much of it as the head holds.
        let cut = name.len() < name_len;
        let is = |p: &[u8]| name.starts_with(p) || (cut && !name.is_empty() && p.starts_with(name));
        if PARTS.iter().any(|p| is(p)) || (entry == 0 && FIRST.iter().any(|p| is(p))) {
            return true;
        }
        if cut || flags & 0x08 != 0 {
            // Out of head, or sizes follow the data.
            return false;
        }
        at += 30 + name_len + extra_len + compressed as usize;
    }
    false
}

/// An image's size read from the head of its base64 (at most `max`
/// decoded bytes), when its header says it there.
pub(super) fn size_from_head(b64: &[u8], max: usize) -> Option<(u32, u32)> {
    // Most headers are in the first kilobyte; a JPEG's may follow its
    // metadata.
    for n in [1024, max] {
        let head = head_bytes(b64, n);
        if let Ok(s) = imagesize::blob_size(&head) {
            return Some((u32::try_from(s.width).ok()?, u32::try_from(s.height).ok()?));
        }
        if b64.len() / 4 * 3 <= n {
            break;
        }
    }
    None
}

/// Whether the first bytes of base64 data are an image's (PNG, JPEG, GIF,
/// WebP): a `file` part that holds a picture is an image.
fn image_head(b64_head: &[u8]) -> bool {
    let head = head_bytes(b64_head, 16);
    head.starts_with(b"\x89PNG")
        || head.starts_with(b"\xff\xd8\xff")
        || head.starts_with(b"GIF8")
        || (head.starts_with(b"RIFF") && head.get(8..12) == Some(b"WEBP"))
}

/// Where an image sits in the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Site {
    /// A whole content part (its object's byte range).
    Part(Range<usize>),
    /// Inside the decoded text of text spot `spot`: a JSON object of a
    /// stringified tool result, or a data URL.
    InText {
        spot: usize,
        range: Range<usize>,
        object: bool,
        /// How many JSON string encodings deep the image sits in the text
        /// (0: in the text itself; 1: inside a JSON string in it, as in
        /// `{"result": "{\"content\": [{\"type\": \"image\", …}]}"}`).
        escapes: u8,
    },
}

/// Where the base64 text of an image not decoded yet is.
#[derive(Debug, Clone)]
pub(super) struct Pending {
    /// In a text spot's decoded text (`Some(spot)`), else in the body.
    pub(super) spot: Option<usize>,
    pub(super) range: Range<usize>,
    /// The string literals its base64 and media type are written in, when
    /// they are written plainly.
    pub(super) at: Option<EncodedAt>,
}

/// The string literals (quotes included) an image's base64 and media type
/// are written in: kept after it is decoded, so a fitted image is written
/// in their place (whole literals: the rest of the body is copied as it
/// was).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum EncodedAt {
    /// `"data": "…"` beside `"media_type": "…"` (or `mimeType`).
    Fields {
        data: Range<usize>,
        media_type: Range<usize>,
    },
    /// A `data:` URL.
    DataUrl(Range<usize>),
}

impl EncodedAt {
    /// The bytes of the body these literals take.
    pub(super) fn len(&self) -> usize {
        match self {
            EncodedAt::Fields { data, media_type } => data.len() + media_type.len(),
            EncodedAt::DataUrl(r) => r.len(),
        }
    }

    /// The length of its base64.
    pub(super) fn base64_len(&self) -> usize {
        match self {
            EncodedAt::Fields { data, .. } => data.len().saturating_sub(2),
            EncodedAt::DataUrl(r) => r.len().saturating_sub(2),
        }
    }
}

/// One image found in the request.
#[derive(Debug, Clone)]
pub struct Found {
    /// Full SHA-256 hex of the decoded bytes (of the URL or file id for
    /// references, of the undecodable text for broken data). Empty until
    /// the image is resolved ([`Scan::resolve`]).
    pub sha256: String,
    pub source: Source,
    /// An image, a document or audio.
    pub medium: Medium,
    /// Index of the message (or Responses input item) it is in.
    pub message: usize,
    /// Role of that message (`tool` for Responses function outputs).
    pub role: String,
    /// True inside a tool or function result.
    pub in_tool_result: bool,
    /// Found in a text where the API takes an image part beside it (see
    /// `transform::hoists`).
    pub(super) hoistable: bool,
    /// A readable location, e.g. `messages[3].content[1]`.
    pub path: String,
    pub(super) site: Site,
    /// The unit of its message it is a part of (see [`TextAt::unit`]);
    /// 0 for an image inside a text.
    pub(super) unit: u32,
    pub(super) bytes: Option<Bytes>,
    pub(super) pending: Option<Pending>,
    /// Where its base64 is in the body (a part whose data and media type
    /// are written plainly).
    pub(super) encoded_at: Option<EncodedAt>,
    /// Prompt-cache markers of the part (`"cache_control": …`,
    /// `"prompt_cache_breakpoint": …` members, their byte ranges in the
    /// body): the text that replaces the part carries them.
    pub(super) markers: Vec<Range<usize>>,
}

impl Found {
    /// Found inside a text (not a part of its own).
    pub(super) fn in_text(&self) -> bool {
        matches!(self.site, Site::InText { .. })
    }

    /// Where the part it is starts in the body; `None` inside a text.
    pub(super) fn part_start(&self) -> Option<usize> {
        match &self.site {
            Site::Part(r) => Some(r.start),
            Site::InText { .. } => None,
        }
    }

    /// What a describer can be sent for this image: its decoded bytes, or
    /// its http(s) URL (visor never fetches it). `None` for file ids, other
    /// URLs and broken data.
    pub fn subject(&self) -> Option<Subject> {
        let image = match (&self.source, &self.bytes) {
            // Bytes no image reader knows (text, a PDF, a DOCX declared
            // `image/png`) are not sent to a describer: no size was read.
            (Source::Inline { dims: None, .. }, _) if self.medium == Medium::Image => return None,
            (Source::Inline { media_type, .. }, Some(bytes)) => Payload::Inline {
                media_type: media_type.clone(),
                bytes: bytes.clone(),
            },
            (Source::Url(url), _) if url.starts_with("https://") || url.starts_with("http://") => {
                Payload::Url(url.clone())
            }
            _ => return None,
        };
        Some(Subject {
            sha256: self.sha256.clone(),
            payload: image,
            lookup_only: false,
            query: None,
        })
    }
}

/// A string in the request whose text may hold images or be rewritten.
#[derive(Debug, Clone)]
pub(super) struct Spot {
    pub(super) lit: Str,
    /// Decoded text, kept when something was found in it.
    pub(super) text: Option<String>,
    /// What holds the string: where parts could be put beside it.
    pub(super) holder: Holder,
    /// What the string is the text of.
    pub(super) container: Container,
}

/// What a text string belongs to: the message itself, an Anthropic
/// `tool_result`'s content, or the content of some other part (a
/// `search_result`, a document's source), which takes only text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Container {
    #[default]
    Message,
    ToolResult,
    Other,
    /// Inside a part whose type is not read yet (members come in any
    /// order): settled when the part ends.
    Pending,
}

/// What a text string is in its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Holder {
    /// The whole `content` (or `output`): it can become an array of parts.
    Content,
    /// The text of a part (this object's range): parts can follow it.
    Part(Range<usize>),
    /// The text of a part that is the whole content (`"content": {…}`, no
    /// array): nothing can go beside it.
    Alone,
}

/// A Chat tool message's content array: when every image in it is
/// replaced, it becomes one string (providers that take only a string as
/// tool content stay valid).
#[derive(Debug, Clone)]
pub(super) struct Collapsible {
    /// The message.
    pub(super) item: usize,
    pub(super) range: Range<usize>,
    pub(super) parts: Vec<PartRef>,
}

/// A content array: its range, its parts, and whether every part is text
/// or image.
pub(super) type ContentArray = (Range<usize>, Vec<PartRef>, bool);

#[derive(Debug, Clone)]
pub(super) enum PartRef {
    Text(usize),
    Image(usize),
}

/// What a message (or Responses input item) is, for the image rules and
/// line dedup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    /// `system` or `developer`
    System,
    /// `user` (the default for a Responses item without a role)
    #[default]
    User,
    /// `assistant`, and Responses items the model produced
    /// (`function_call`, `reasoning`, …)
    Assistant,
    /// `tool`/`function` messages and Responses `*_output` items
    Tool,
    /// Anything else (not an object, an unknown role)
    Other,
}

/// One message of the request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Item {
    pub role: Role,
    /// A user message with content of the user's own (text or images
    /// outside tool results; an Anthropic message holding only
    /// `tool_result` blocks is not).
    pub authored: bool,
    /// Its length in the body, in bytes.
    pub bytes: usize,
    /// Where it ends in the body (the byte after it).
    pub end: usize,
}

/// A text string of a message (its content string, a text part, the text
/// of a tool result part).
#[derive(Debug, Clone, Copy)]
pub struct TextAt {
    pub spot: usize,
    /// Index of the message.
    pub item: usize,
    /// 0 for the message's own content; each Anthropic `tool_result`
    /// block (any part with a `content` of its own) is a unit of its own.
    pub unit: u32,
    /// Inside a tool or function result.
    pub tool: bool,
}

/// Every image of one request.
#[derive(Debug, Default, Clone)]
pub struct Scan {
    pub images: Vec<Found>,
    /// One per element of the message array.
    pub items: Vec<Item>,
    /// Every text string of every message, in request order.
    pub texts: Vec<TextAt>,
    /// The call a tool result answers, by (message, unit): Chat
    /// `tool_call_id`, Responses `call_id`, Anthropic `tool_use_id`.
    pub call_ids: Vec<(usize, u32, Str)>,
    pub(super) spots: Vec<Spot>,
    pub(super) collapsible: Vec<Collapsible>,
    /// Where the instructions outside the message list are: Anthropic
    /// `system`, Responses `instructions` (their JSON values).
    pub instructions: Vec<std::ops::Range<usize>>,
}

/// Reads the request once and finds every image in it.
pub fn scan(body: &[u8], shape: Shape) -> std::result::Result<Scan, Malformed> {
    let items_key = shape.items_key();
    let mut w = Walker {
        src: body,
        shape,
        items_key,
        out: Scan::default(),
    };
    let mut c = Cursor::new(body);
    if c.kind()? != Kind::Object {
        return Err(Malformed);
    }
    c.object(|c, key| w.member(c, &key))?;
    Ok(w.out)
}

/// [`scan`] of a body that begins, byte for byte, with the body `prefix`
/// was scanned from, up to `end`: the end of its last message (see
/// [`Scan::upto`]). Only what follows is walked; the result is the same
/// as [`scan`]'s.
pub fn scan_from(
    body: &[u8],
    shape: Shape,
    prefix: Scan,
    end: usize,
) -> std::result::Result<Scan, Malformed> {
    let items_key = shape.items_key();
    let next = prefix.items.len();
    if next == 0 || prefix.items.last().map(|i| i.end) != Some(end) || end > body.len() {
        return Err(Malformed);
    }
    let mut w = Walker {
        src: body,
        shape,
        items_key,
        out: prefix,
    };
    let mut c = Cursor::at(body, end);
    c.array_rest(next, |c, i| w.message(c, i, items_key))?;
    c.object_rest(|c, key| w.member(c, &key))?;
    Ok(w.out)
}

impl Scan {
    /// About how much memory it holds, in bytes.
    pub fn size(&self) -> usize {
        use std::mem::size_of;
        let source = |s: &Source| match s {
            Source::Encoded { media_type } | Source::Inline { media_type, .. } => {
                media_type.capacity()
            }
            Source::Url(s) | Source::File(s) => s.capacity(),
            Source::Broken(_) => 0,
        };
        let medium = |m: &Medium| match m {
            Medium::Image => 0,
            Medium::Document { name, .. } => name.as_ref().map_or(0, String::capacity),
            Medium::Audio { format } => format.as_ref().map_or(0, String::capacity),
        };
        let images: usize = self
            .images
            .iter()
            .map(|f| {
                size_of::<Found>()
                    + f.sha256.capacity()
                    + f.role.capacity()
                    + f.path.capacity()
                    + source(&f.source)
                    + medium(&f.medium)
                    + f.markers.capacity() * size_of::<Range<usize>>()
                    + f.bytes.as_ref().map_or(0, |b| b.len())
            })
            .sum();
        let spots: usize = self
            .spots
            .iter()
            .map(|s| size_of::<Spot>() + s.text.as_ref().map_or(0, String::capacity))
            .sum();
        images
            + spots
            + self.items.capacity() * size_of::<Item>()
            + self.texts.capacity() * size_of::<TextAt>()
            + self.call_ids.capacity() * size_of::<(usize, u32, Str)>()
            + self
                .collapsible
                .iter()
                .map(|c| size_of::<Collapsible>() + c.parts.len() * size_of::<PartRef>())
                .sum::<usize>()
            + self.instructions.len() * size_of::<Range<usize>>()
    }

    /// What a scan found up to the end of its last message: a prefix
    /// [`scan_from`] continues (what follows the message list, the
    /// instructions after it, is read again there).
    pub fn upto_messages(mut self) -> Option<(Scan, usize)> {
        let end = self.items.last()?.end;
        self.instructions.retain(|r| r.end <= end);
        Some((self, end))
    }
}

pub(super) struct Walker<'a> {
    pub(super) src: &'a [u8],
    pub(super) shape: Shape,
    pub(super) items_key: &'static str,
    pub(super) out: Scan,
}

/// Per-message context while walking its content.
pub(super) struct Msg {
    pub(super) index: usize,
    /// Images and spots found in this message, finished at its end when the
    /// role is known: (spot, in a tool result, unit).
    pub(super) first_image: usize,
    pub(super) spots: Vec<(usize, bool, u32)>,
    /// The unit being walked, and the last one given out.
    pub(super) unit: u32,
    pub(super) units: u32,
    /// A part of this message carries a prompt-cache marker: its content
    /// array is never collapsed into a string (the marker would go).
    pub(super) cache_markers: bool,
    /// What the content being walked belongs to.
    pub(super) container: Container,
}

/// The fields of a content part the classifier needs.
#[derive(Default)]
pub(super) struct PartFields {
    pub(super) ty: Option<Str>,
    pub(super) image_url: Option<Str>,
    pub(super) image_url_bad: bool,
    pub(super) data: Option<Str>,
    pub(super) media_type: Option<Str>,
    pub(super) source_type: Option<Str>,
    pub(super) source_media_type: Option<Str>,
    pub(super) source_data: Option<Str>,
    pub(super) source_url: Option<Str>,
    pub(super) source_file: Option<Str>,
    pub(super) source_bad: bool,
    pub(super) file_id: Option<Str>,
    pub(super) text: Option<Str>,
    pub(super) tool_use_id: Option<Str>,
    /// `"cache_control": …` and `"prompt_cache_breakpoint": …` members
    /// (key through value).
    pub(super) markers: Vec<Range<usize>>,
    /// A bare `url` (LangChain standard blocks, Vercel `image-url`).
    pub(super) url: Option<Str>,
    /// An Anthropic `document` whose `source` is `{"type":"content",
    /// "content":[…]}`: where that content array is (it may hold images).
    pub(super) source_content: Option<Range<usize>>,
    /// An MCP embedded resource's `blob` and `mimeType`.
    pub(super) resource_blob: Option<Str>,
    pub(super) resource_mime: Option<Str>,
    pub(super) resource_uri: Option<Str>,
    /// A document's data (Chat `file.file_data`, Responses `file_data`: a
    /// data URL), URL (`file_url`) and name (`filename`, Anthropic
    /// `title`).
    pub(super) file_data: Option<Str>,
    pub(super) file_url: Option<Str>,
    pub(super) filename: Option<Str>,
    /// Chat `input_audio`: `data` and `format`.
    pub(super) audio_data: Option<Str>,
    pub(super) audio_format: Option<Str>,
    /// A `file` object member (Chat `file` parts), whatever it holds.
    pub(super) chat_file: bool,
}

impl PartFields {
    /// Reads the value of `key` when it is one of the fields an image part
    /// is recognised by; false (nothing consumed) for any other key.
    pub(super) fn read(&mut self, c: &mut Cursor<'_>, src: &[u8], key: &Str) -> Result<bool> {
        let k = |name: &str| key.is(src, name);
        let kind = c.kind()?;
        let string = kind == Kind::String;
        if string && k("type") {
            self.ty = Some(c.string()?);
        } else if k("cache_control") || k("prompt_cache_breakpoint") {
            let value = c.skip()?;
            self.markers.push(key.range.start..value.end);
        } else if k("image_url") {
            self.read_image_url(c, src, kind)?;
        } else if string && (k("data") || k("base64")) {
            self.data = Some(c.string()?);
        } else if kind == Kind::Object && k("data") {
            // Vercel AI SDK v7 `file` parts: `"data": {"type": "data",
            // "data": "…"}` or `{"type": "url", "url": "…"}`.
            let (data, url) = string_members(c, src, "data", "url")?;
            self.data = data.or(self.data.take());
            self.url = url.or(self.url.take());
        } else if string && k("url") {
            self.url = Some(c.string()?);
        } else if kind == Kind::Object && k("resource") {
            string_slots(
                c,
                src,
                &mut [
                    ("blob", &mut self.resource_blob),
                    ("mimeType", &mut self.resource_mime),
                    ("uri", &mut self.resource_uri),
                ],
            )?;
        } else if kind == Kind::Object && k("file") {
            // Chat `file` part: `{"file": {"file_data", "file_id",
            // "filename"}}`.
            self.chat_file = true;
            string_slots(
                c,
                src,
                &mut [
                    ("file_data", &mut self.file_data),
                    ("file_id", &mut self.file_id),
                    ("filename", &mut self.filename),
                ],
            )?;
        } else if kind == Kind::Object && k("input_audio") {
            let (data, format) = string_members(c, src, "data", "format")?;
            self.audio_data = data.or(self.audio_data.take());
            self.audio_format = format.or(self.audio_format.take());
        } else if string && k("file_data") {
            self.file_data = Some(c.string()?);
        } else if string && k("file_url") {
            self.file_url = Some(c.string()?);
        } else if string && (k("filename") || k("title")) {
            self.filename = Some(c.string()?);
        } else if string && (k("mimeType") || k("mime_type") || k("media_type") || k("mediaType")) {
            self.media_type = Some(c.string()?);
        } else if string && k("file_id") {
            self.file_id = Some(c.string()?);
        } else if string && k("text") {
            self.text = Some(c.string()?);
        } else if string && k("tool_use_id") {
            self.tool_use_id = Some(c.string()?);
        } else if k("source") {
            self.read_source(c, src, kind)?;
        } else {
            return Ok(false);
        }
        Ok(true)
    }

    /// `image_url`: a URL string, or an object with a `url` (bad without
    /// one).
    fn read_image_url(&mut self, c: &mut Cursor<'_>, src: &[u8], kind: Kind) -> Result<()> {
        match kind {
            Kind::String => self.image_url = Some(c.string()?),
            Kind::Object => {
                let mut url = None;
                c.object(|c, key| {
                    if key.is(src, "url") && c.kind()? == Kind::String {
                        url = Some(c.string()?);
                    } else {
                        c.skip()?;
                    }
                    Ok(())
                })?;
                self.image_url_bad = url.is_none();
                self.image_url = url;
            }
            _ => {
                self.image_url_bad = true;
                c.skip()?;
            }
        }
        Ok(())
    }

    /// An Anthropic `source` object: its type, media type, data, URL or
    /// file id, or content blocks (bad when not an object).
    fn read_source(&mut self, c: &mut Cursor<'_>, src: &[u8], kind: Kind) -> Result<()> {
        if kind != Kind::Object {
            self.source_bad = true;
            c.skip()?;
            return Ok(());
        }
        c.object(|c, key| {
            let sk = |name: &str| key.is(src, name);
            if sk("content") && c.kind()? == Kind::Array {
                self.source_content = Some(c.skip()?);
                return Ok(());
            }
            let slot = if c.kind()? != Kind::String {
                None
            } else if sk("type") {
                Some(&mut self.source_type)
            } else if sk("media_type") {
                Some(&mut self.source_media_type)
            } else if sk("data") {
                Some(&mut self.source_data)
            } else if sk("url") {
                Some(&mut self.source_url)
            } else if sk("file_id") {
                Some(&mut self.source_file)
            } else {
                None
            };
            match slot {
                Some(slot) => *slot = Some(c.string()?),
                None => {
                    c.skip()?;
                }
            }
            Ok(())
        })?;
        Ok(())
    }
}

/// The members of a message the walk keeps (its content is walked as it
/// is read).
#[derive(Default)]
struct MessageFields {
    role: Option<Str>,
    ty: Option<Str>,
    call_id: Option<Str>,
    content: Option<ContentArray>,
}

/// Who sent a message: its role as the image rules see it (`tool` for a
/// Responses `*_output` item, `user` when none is given), what kind of
/// message that is, and whether it is a Chat tool (or function) message.
struct Speaker {
    role: String,
    kind: Role,
    tool_message: bool,
    /// The API takes image parts in this message's own content: a user
    /// message (Chat, Anthropic, a Responses `message`), a Responses
    /// `function_call_output`.
    takes_images: bool,
}

impl Speaker {
    fn of(src: &[u8], fields: &MessageFields, shape: Shape) -> Speaker {
        let role = fields
            .role
            .as_ref()
            .and_then(|r| r.decode(src))
            .map(|r| r.into_owned());
        let ty = fields.ty.as_ref();
        let is_output = ty.is_some_and(|t| {
            t.is(src, "function_call_output")
                || t.is(src, "custom_tool_call_output")
                || t.is(src, "computer_call_output")
        });
        let kind = role_of(
            role.as_deref(),
            ty.and_then(|t| t.decode(src)).as_deref(),
            is_output,
        );
        let role = match (role, is_output) {
            (_, true) => "tool".to_owned(),
            (Some(r), false) => r,
            (None, false) => "user".to_owned(),
        };
        let tool_message = role == "tool" || role == "function";
        let message = ty.is_none_or(|t| t.is(src, "message"));
        let takes_images = match shape {
            Shape::Chat | Shape::Messages => role == "user",
            Shape::Responses => {
                (message && role == "user") || ty.is_some_and(|t| t.is(src, "function_call_output"))
            }
        };
        Speaker {
            role,
            kind,
            tool_message,
            takes_images,
        }
    }
}

impl Walker<'_> {
    /// One member of the request object.
    fn member(&mut self, c: &mut Cursor<'_>, key: &Str) -> Result<()> {
        let body = self.src;
        if key.is(body, self.items_key) && c.kind()? == Kind::Array {
            let items_key = self.items_key;
            let next = self.out.items.len();
            c.array(|c, i| self.message(c, next + i, items_key))
                .map(drop)
        } else if key.is(body, "system") || key.is(body, "instructions") {
            let range = c.skip()?;
            self.out.instructions.push(range);
            Ok(())
        } else {
            c.skip().map(drop)
        }
    }

    fn message(&mut self, c: &mut Cursor<'_>, index: usize, items_key: &str) -> Result<()> {
        self.out.items.push(Item {
            role: Role::Other,
            authored: false,
            bytes: 0,
            end: 0,
        });
        if c.kind()? != Kind::Object {
            let range = c.skip()?;
            self.out.items[index].bytes = range.len();
            self.out.items[index].end = range.end;
            return Ok(());
        }
        let mut msg = Msg {
            index,
            first_image: self.out.images.len(),
            spots: Vec::new(),
            unit: 0,
            units: 0,
            cache_markers: false,
            container: Container::Message,
        };
        let mut fields = MessageFields::default();
        let range =
            c.object(|c, key| self.message_member(c, &key, &mut msg, &mut fields, items_key))?;
        let who = Speaker::of(self.src, &fields, self.shape);
        if let Some(id) = fields.call_id
            && (who.tool_message || who.kind == Role::Tool)
        {
            self.out.call_ids.push((index, 0, id));
        }
        self.finish_message(msg, &who, fields.content, range);
        Ok(())
    }

    /// Reads one member of a message, walking its content.
    fn message_member(
        &mut self,
        c: &mut Cursor<'_>,
        key: &Str,
        msg: &mut Msg,
        fields: &mut MessageFields,
        items_key: &str,
    ) -> Result<()> {
        let src = self.src;
        if key.is(src, "role") && c.kind()? == Kind::String {
            fields.role = Some(c.string()?);
        } else if key.is(src, "type") && c.kind()? == Kind::String {
            fields.ty = Some(c.string()?);
        } else if (key.is(src, "tool_call_id") || key.is(src, "call_id"))
            && c.kind()? == Kind::String
        {
            fields.call_id = Some(c.string()?);
        } else if key.is(src, "content") || key.is(src, "output") {
            let which = if key.is(src, "content") {
                "content"
            } else {
                "output"
            };
            let path = PathAt::Item {
                items: items_key,
                index: msg.index,
                field: which,
            };
            let tool = key.is(src, "output");
            fields.content = self.content(c, msg, &path, tool, 0)?;
        } else {
            c.skip()?;
        }
        Ok(())
    }

    /// Once its role is known: the message's images, its item, its texts,
    /// the images hidden in them, and whether it may collapse to a string.
    fn finish_message(
        &mut self,
        mut msg: Msg,
        who: &Speaker,
        content: Option<ContentArray>,
        range: Range<usize>,
    ) {
        let index = msg.index;
        let tool_message = who.tool_message;
        for img in &mut self.out.images[msg.first_image..] {
            img.role.clone_from(&who.role);
            img.in_tool_result |= tool_message;
        }
        let own = |in_tool: bool| !in_tool && !tool_message;
        self.out.items[index] = Item {
            role: who.kind,
            authored: who.kind == Role::User
                && (msg.spots.iter().any(|&(_, t, _)| own(t))
                    || self.out.images[msg.first_image..]
                        .iter()
                        .any(|f| own(f.in_tool_result))),
            bytes: range.len(),
            end: range.end,
        };
        for &(spot, in_tool, unit) in &msg.spots {
            self.out.texts.push(TextAt {
                spot,
                item: index,
                unit,
                tool: in_tool || tool_message,
            });
        }
        // Text of user and tool messages may hide images; system, developer
        // and assistant text is never looked into.
        if !matches!(who.role.as_str(), "system" | "developer" | "assistant") {
            for (spot, in_tool, _) in std::mem::take(&mut msg.spots) {
                self.look_in_text(spot, &msg, who, in_tool || tool_message);
            }
        }
        if self.shape == Shape::Chat
            && tool_message
            && !msg.cache_markers
            && let Some((range, parts, true)) = content
            && parts.iter().any(|p| matches!(p, PartRef::Image(_)))
        {
            self.out.collapsible.push(Collapsible {
                item: index,
                range,
                parts,
            });
        }
    }

    /// Walks a `content` (or `output`) value. Returns, for an array, its
    /// range, its parts and whether every part is text or image.
    fn content(
        &mut self,
        c: &mut Cursor<'_>,
        msg: &mut Msg,
        path: &PathAt<'_>,
        in_tool: bool,
        depth: usize,
    ) -> Result<Option<ContentArray>> {
        match c.kind()? {
            Kind::String => {
                let lit = c.string()?;
                self.text_spot(lit, msg, in_tool, Holder::Content);
                Ok(None)
            }
            Kind::Array if depth < MAX_NESTING => {
                let mut parts = Vec::new();
                let mut simple = true;
                let range = c.array(|c, j| {
                    let p = PathAt::Index(path, j);
                    match self.part(c, msg, &p, in_tool, depth)? {
                        Some(r) => parts.push(r),
                        None => simple = false,
                    }
                    Ok(())
                })?;
                Ok(Some((range, parts, simple)))
            }
            // One part instead of an array (`"content": {"type": "image",
            // …}`): walked as the part it is.
            Kind::Object if depth < MAX_NESTING => {
                if let Some(PartRef::Text(s)) = self.part(c, msg, path, in_tool, depth)? {
                    self.out.spots[s].holder = Holder::Alone;
                }
                Ok(None)
            }
            _ => {
                c.skip()?;
                Ok(None)
            }
        }
    }

    /// Records a text string of the message being walked.
    fn text_spot(&mut self, lit: Str, msg: &mut Msg, in_tool: bool, holder: Holder) -> usize {
        self.out.spots.push(Spot {
            lit,
            text: None,
            holder,
            container: msg.container,
        });
        let spot = self.out.spots.len() - 1;
        msg.spots.push((spot, in_tool, msg.unit));
        spot
    }

    /// A part's own content's texts, once its type is known: a
    /// `tool_result` takes image blocks beside them; any other part with
    /// content of its own takes text.
    fn settle(&mut self, own_spots: Range<usize>, f: &PartFields) {
        let kind = match f.ty.as_ref().is_some_and(|t| t.is(self.src, "tool_result")) {
            true => Container::ToolResult,
            false => Container::Other,
        };
        for spot in &mut self.out.spots[own_spots] {
            if spot.container == Container::Pending {
                spot.container = kind;
            }
        }
    }

    /// An Anthropic document (or search result) whose source is content
    /// blocks: images among them are images like any other.
    fn document_content(
        &mut self,
        f: &mut PartFields,
        msg: &mut Msg,
        path: &PathAt<'_>,
        in_tool: bool,
        depth: usize,
    ) -> Result<()> {
        let src = self.src;
        if let Some(inner) = f.source_content.take()
            && f.ty.as_ref().is_some_and(|t| t.is(src, "document"))
        {
            let mut sub = Cursor::at(src, inner.start);
            let p = PathAt::Field(path, "source.content");
            let outer_container = std::mem::replace(&mut msg.container, Container::Other);
            self.content(&mut sub, msg, &p, in_tool, depth + 1)?;
            msg.container = outer_container;
        }
        Ok(())
    }

    /// Walks one content part. Returns what it is for a possible collapse:
    /// a text part, an image, or `None` for anything else.
    fn part(
        &mut self,
        c: &mut Cursor<'_>,
        msg: &mut Msg,
        path: &PathAt<'_>,
        in_tool: bool,
        depth: usize,
    ) -> Result<Option<PartRef>> {
        if c.kind()? != Kind::Object {
            c.skip()?;
            return Ok(None);
        }
        let src = self.src;
        let mut f = PartFields::default();
        let images_before = self.out.images.len();
        let spots_before = msg.spots.len();
        let mut own_unit = None;
        let mut own_spots = 0..0;
        let range = c.object(|c, key| {
            if f.read(c, src, &key)? {
                return Ok(());
            }
            if key.is(src, "content") {
                // An Anthropic tool_result (or anything shaped like one):
                // its content is a tool result of its own.
                let p = PathAt::Field(path, "content");
                let outer = msg.unit;
                let outer_container = msg.container;
                msg.units += 1;
                msg.unit = msg.units;
                own_unit = Some(msg.unit);
                // Settled when the part's type is known (below).
                msg.container = Container::Pending;
                let first = self.out.spots.len();
                self.content(c, msg, &p, true, depth + 1)?;
                own_spots = first..self.out.spots.len();
                msg.unit = outer;
                msg.container = outer_container;
            } else {
                c.skip()?;
            }
            Ok(())
        })?;
        self.settle(own_spots, &f);
        msg.cache_markers |= !f.markers.is_empty();
        self.document_content(&mut f, msg, path, in_tool, depth)?;
        let tool_result = f.ty.as_ref().is_some_and(|t| t.is(src, "tool_result"));
        let Some(ty) = f.ty.as_ref() else {
            return Ok(None);
        };
        if let Some((medium, source)) = classify(src, ty, &f) {
            // The whole part is replaced: anything found inside it goes.
            self.out.images.truncate(images_before);
            msg.spots.truncate(spots_before);
            let (sha256, source, bytes, pending) = read_lazily(src, source, None);
            msg.cache_markers |= !f.markers.is_empty();
            let image = medium == Medium::Image;
            let encoded_at = pending.as_ref().and_then(|p| p.at.clone());
            self.out.images.push(Found {
                sha256,
                source,
                medium,
                message: msg.index,
                role: String::new(),
                in_tool_result: in_tool,
                hoistable: false,
                path: path.to_string(),
                site: Site::Part(range),
                unit: msg.unit,
                bytes: bytes.map(Bytes::from),
                pending,
                encoded_at,
                markers: std::mem::take(&mut f.markers),
            });
            // A document or audio part keeps a Chat tool message an array
            // (its text is many lines, not one).
            return Ok(image.then(|| PartRef::Image(self.out.images.len() - 1)));
        }
        if tool_result {
            if let (Some(unit), Some(id)) = (own_unit, f.tool_use_id) {
                self.out.call_ids.push((msg.index, unit, id));
            }
            return Ok(None);
        }
        if (ty.is(src, "text") || ty.is(src, "input_text") || ty.is(src, "output_text"))
            && let Some(text) = f.text
        {
            let spot = self.text_spot(text, msg, in_tool, Holder::Part(range));
            return Ok(Some(PartRef::Text(spot)));
        }
        Ok(None)
    }

    /// Finds images hidden in the text of spot `spot`.
    fn look_in_text(&mut self, spot: usize, msg: &Msg, who: &Speaker, in_tool: bool) {
        let role = who.role.as_str();
        let here = &self.out.spots[spot];
        // Where an image found in this text could be sent as a part.
        let hoistable = who.takes_images
            && here.holder != Holder::Alone
            && matches!(
                (self.shape, here.container),
                (_, Container::Message) | (Shape::Messages, Container::ToolResult)
            );
        // Every image in a text says `image` (a data URL's media type, a
        // JSON part's type): a text without it, unless `\u` escapes could
        // spell it, is not decoded.
        static IMAGE: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
            std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"image"));
        let lit = &self.out.spots[spot].lit;
        let raw = lit.raw(self.src);
        if IMAGE.find(raw).is_none()
            && !(lit.escaped && memchr::memmem::find(raw, b"\\u").is_some())
        {
            return;
        }
        let Some(text) = self.out.spots[spot].lit.decode(self.src) else {
            return;
        };
        let found = find_in_text(&text);
        if found.is_empty() {
            return;
        }
        let text = text.into_owned();
        for InTextFound {
            range,
            object,
            escapes,
            raw,
        } in found
        {
            let (sha256, source, bytes, pending) = match raw {
                TextRaw::Here(raw) => read_lazily(text.as_bytes(), raw, Some(spot)),
                TextRaw::Read(read) => read,
            };
            self.out.images.push(Found {
                sha256,
                source,
                medium: Medium::Image,
                message: msg.index,
                role: role.to_owned(),
                in_tool_result: in_tool,
                hoistable,
                path: format!("{}[{}] (in text)", self.items_key, msg.index),
                site: Site::InText {
                    spot,
                    range,
                    object,
                    escapes,
                },
                unit: 0,
                bytes: bytes.map(Bytes::from),
                pending,
                encoded_at: None,
                markers: Vec::new(),
            });
        }
        self.out.spots[spot].text = Some(text);
    }
}

/// An object's string members named in `slots`, each into its slot (the
/// last, when a key repeats); anything else in it is skipped.
fn string_slots(
    c: &mut Cursor<'_>,
    src: &[u8],
    slots: &mut [(&str, &mut Option<Str>)],
) -> Result<()> {
    c.object(|c, key| {
        let slot = match c.kind()? {
            Kind::String => slots.iter_mut().find(|(name, _)| key.is(src, name)),
            _ => None,
        };
        match slot {
            Some((_, slot)) => **slot = Some(c.string()?),
            None => {
                c.skip()?;
            }
        }
        Ok(())
    })?;
    Ok(())
}

/// An object's string members `a` and `b` (the last of each, when a key
/// repeats); anything else in it is skipped.
fn string_members(
    c: &mut Cursor<'_>,
    src: &[u8],
    a: &str,
    b: &str,
) -> Result<(Option<Str>, Option<Str>)> {
    let (mut first, mut second) = (None, None);
    c.object(|c, key| {
        if c.kind()? == Kind::String && key.is(src, a) {
            first = Some(c.string()?);
        } else if c.kind()? == Kind::String && key.is(src, b) {
            second = Some(c.string()?);
        } else {
            c.skip()?;
        }
        Ok(())
    })?;
    Ok((first, second))
}

/// Where an image's bytes are, before decoding.
#[derive(Debug)]
pub(super) enum Raw {
    /// A `data:` URL string literal.
    DataUrl(Str),
    /// A `data:` URL inside a decoded text (a byte range, no quotes).
    DataUrlInText(Range<usize>),
    /// Base64 data and its declared media type.
    Base64(Str, Option<Str>),
    Url(Str),
    File(Str),
    /// Plain text (an Anthropic `text` document source).
    Text(Str),
    Broken(&'static str),
}

/// Decides whether a part is an image, a document or audio, and where its
/// bytes are.
pub(super) fn classify(src: &[u8], ty: &Str, f: &PartFields) -> Option<(Medium, Raw)> {
    if let Some(raw) = classify_image(src, ty, f) {
        return Some((Medium::Image, raw));
    }
    classify_media(src, ty, f)
}

/// Documents and audio: Chat `file` and `input_audio` parts, Responses
/// `input_file`, Anthropic `document` blocks, MCP `audio` content and
/// embedded resources holding a document or audio, and SDK file parts of a
/// document or audio type.
fn classify_media(src: &[u8], ty: &Str, f: &PartFields) -> Option<(Medium, Raw)> {
    let is = |name: &str| ty.is(src, name);
    let part = MediaPart { src, f };
    if is("file")
        && (f.chat_file
            || f.file_data.is_some()
            || (f.file_id.is_some() && f.data.is_none() && f.url.is_none()))
    {
        return Some(part.chat_file());
    }
    if is("input_file") {
        return Some(part.input_file());
    }
    if is("document") && (f.source_type.is_some() || f.source_bad) && f.source_content.is_none() {
        return part.anthropic_document();
    }
    if is("input_audio") {
        let format = part.text(&f.audio_format).map(|s| s.to_ascii_lowercase());
        let raw = match &f.audio_data {
            Some(d) => Raw::Base64(d.clone(), None),
            None => Raw::Broken("input_audio without data"),
        };
        return Some((Medium::Audio { format }, raw));
    }
    // MCP `audio` content.
    if is("audio") {
        let mt = part.media_of(&f.media_type);
        let raw = match &f.data {
            Some(d) => Raw::Base64(d.clone(), f.media_type.clone()),
            None => Raw::Broken("audio part without data"),
        };
        return Some((
            Medium::Audio {
                format: audio_format(&mt),
            },
            raw,
        ));
    }
    // MCP embedded resource holding a document or audio (text resources
    // are text already and stay).
    if is("resource")
        && let Some(blob) = &f.resource_blob
    {
        return part.mcp_resource(blob);
    }
    // SDK file parts of a document or audio type (Vercel `file-data`,
    // `media`, v7 `file`; LangChain `file`), their data inline, a data URL
    // or an http(s) URL (in `data` or `url`).
    if is("file-data") || is("media") || is("file") {
        return part.sdk_file();
    }
    None
}

/// An audio format from an `audio/…` media type.
fn audio_format(mt: &str) -> Option<String> {
    mt.strip_prefix("audio/").map(|f| f.to_owned())
}

/// A content part being classified as a document or audio.
struct MediaPart<'p> {
    src: &'p [u8],
    f: &'p PartFields,
}

impl MediaPart<'_> {
    fn text(&self, s: &Option<Str>) -> Option<String> {
        s.as_ref()
            .and_then(|s| s.decode(self.src))
            .map(|c| c.into_owned())
    }

    /// A media type, lower case (empty when none).
    fn media_of(&self, m: &Option<Str>) -> String {
        self.text(m)
            .map(|m| m.to_ascii_lowercase())
            .unwrap_or_default()
    }

    fn url_like(&self, s: &Str) -> Raw {
        if s.raw(self.src).starts_with(b"data:") {
            Raw::DataUrl(s.clone())
        } else {
            Raw::Url(s.clone())
        }
    }

    /// A document of this media type or name, else of the type its data URL
    /// declares, else of the type its first bytes tell.
    fn document(&self, mt: &Option<Str>, name: &Option<Str>, data: Option<&Str>) -> Medium {
        let src = self.src;
        let mt = self.text(mt).unwrap_or_default();
        let name = self.text(name);
        let head = data.map(|d| data_head(d.raw(src)));
        let mt = match (mt.is_empty(), data) {
            (true, Some(d)) if d.raw(src).starts_with(b"data:") => {
                super::decode::data_url_payload(d.raw(src))
                    .map(|(m, _)| m)
                    .unwrap_or_default()
            }
            _ => mt,
        };
        Medium::Document {
            family: DocFamily::of(&mt, name.as_deref(), head.unwrap_or_default()),
            name,
        }
    }

    /// `file_data` is a data URL; some clients send the bare base64, and
    /// SDK parts put a URL where the data goes.
    fn file_data(&self, d: &Str, mt: &Option<Str>) -> Raw {
        let raw = d.raw(self.src);
        if raw.starts_with(b"data:") || raw.starts_with(b"http://") || raw.starts_with(b"https://")
        {
            self.url_like(d)
        } else {
            Raw::Base64(d.clone(), mt.clone())
        }
    }

    /// A `file` part whose data is a picture is an image, whatever carries
    /// it.
    fn picture(&self, d: Option<&Str>) -> bool {
        d.is_some_and(|d| {
            let raw = d.raw(self.src);
            raw.starts_with(b"data:image/") || image_head(data_head(raw))
        })
    }

    /// Chat `file` part.
    fn chat_file(&self) -> (Medium, Raw) {
        let f = self.f;
        let raw = match (&f.file_data, &f.file_id) {
            (Some(d), _) => self.file_data(d, &None),
            (None, Some(id)) => Raw::File(id.clone()),
            (None, None) => Raw::Broken("file part without file_data or file_id"),
        };
        if self.picture(f.file_data.as_ref()) {
            return (Medium::Image, raw);
        }
        (self.document(&None, &f.filename, f.file_data.as_ref()), raw)
    }

    /// Responses `input_file`.
    fn input_file(&self) -> (Medium, Raw) {
        let f = self.f;
        let raw = match (&f.file_data, &f.file_url, &f.file_id) {
            (Some(d), _, _) => self.file_data(d, &None),
            (None, Some(u), _) => Raw::Url(u.clone()),
            (None, None, Some(id)) => Raw::File(id.clone()),
            (None, None, None) => Raw::Broken("input_file without file_data, file_url or file_id"),
        };
        if self.picture(f.file_data.as_ref()) {
            return (Medium::Image, raw);
        }
        (self.document(&None, &f.filename, f.file_data.as_ref()), raw)
    }

    /// Anthropic `document` block with a base64, text, URL or file source
    /// (`None` for another source type).
    fn anthropic_document(&self) -> Option<(Medium, Raw)> {
        let f = self.f;
        let st = f.source_type.as_ref();
        let sis = |name| st.is_some_and(|t| t.is(self.src, name));
        let medium = self.document(&f.source_media_type, &f.filename, f.source_data.as_ref());
        let raw = if sis("base64") {
            match &f.source_data {
                Some(d) => Raw::Base64(d.clone(), f.source_media_type.clone()),
                None => Raw::Broken("base64 document source without data"),
            }
        } else if sis("text") {
            match &f.source_data {
                Some(d) => Raw::Text(d.clone()),
                None => Raw::Broken("text document source without data"),
            }
        } else if sis("url") {
            match &f.source_url {
                Some(u) => self.url_like(u),
                None => Raw::Broken("url document source without a url"),
            }
        } else if sis("file") {
            match &f.source_file {
                Some(id) => Raw::File(id.clone()),
                None => Raw::Broken("file document source without a file_id"),
            }
        } else {
            return None;
        };
        Some((medium, raw))
    }

    /// MCP embedded resource with a `blob`: audio or a document (`None`
    /// for another type).
    fn mcp_resource(&self, blob: &Str) -> Option<(Medium, Raw)> {
        let f = self.f;
        let mt = self.media_of(&f.resource_mime);
        let raw = Raw::Base64(blob.clone(), f.resource_mime.clone());
        if let Some(format) = audio_format(&mt) {
            return Some((
                Medium::Audio {
                    format: Some(format),
                },
                raw,
            ));
        }
        let name = self
            .text(&f.resource_uri)
            .map(|u| u.rsplit('/').next().unwrap_or(&u).to_owned());
        let family = DocFamily::of(&mt, name.as_deref(), blob.raw(self.src));
        if family != DocFamily::Other || mt.starts_with("text/") {
            return Some((Medium::Document { family, name }, raw));
        }
        None
    }

    /// SDK file part: audio or a document (`None` for another type, or
    /// without data or URL).
    fn sdk_file(&self) -> Option<(Medium, Raw)> {
        let f = self.f;
        let mt = self.media_of(&f.media_type);
        let (raw, data) = match (&f.data, &f.url) {
            (Some(d), _) => (self.file_data(d, &f.media_type), Some(d)),
            (None, Some(u)) => (self.url_like(u), None),
            (None, None) => return None,
        };
        if let Some(format) = audio_format(&mt) {
            return Some((
                Medium::Audio {
                    format: Some(format),
                },
                raw,
            ));
        }
        let head = data.map(|d| data_head(d.raw(self.src))).unwrap_or_default();
        let family = DocFamily::of(&mt, self.text(&f.filename).as_deref(), head);
        if family != DocFamily::Other || mt.starts_with("text/") {
            return Some((self.document(&f.media_type, &f.filename, data), raw));
        }
        None
    }
}

/// Where a data string's payload starts: past a data URL's header.
fn data_head(raw: &[u8]) -> &[u8] {
    match memchr::memchr(b',', &raw[..raw.len().min(200)]) {
        Some(at) if raw.starts_with(b"data:") => &raw[at + 1..],
        _ => raw,
    }
}

/// Decides whether a part is an image, and where its bytes are.
pub(super) fn classify_image(src: &[u8], ty: &Str, f: &PartFields) -> Option<Raw> {
    let url_like = |s: &Str| {
        if s.raw(src).starts_with(b"data:") {
            Raw::DataUrl(s.clone())
        } else {
            Raw::Url(s.clone())
        }
    };
    if ty.is(src, "image_url") {
        return Some(match &f.image_url {
            Some(u) => url_like(u),
            None if f.image_url_bad => Raw::Broken("image_url has an unexpected shape"),
            None => Raw::Broken("image_url part without a URL"),
        });
    }
    // Responses `input_image`, and computer use's `computer_screenshot`
    // (`computer_call_output.output`): the same fields.
    let screenshot = ty.is(src, "computer_screenshot");
    if screenshot || ty.is(src, "input_image") {
        return Some(match (&f.image_url, &f.file_id) {
            (Some(u), _) => url_like(u),
            (None, Some(id)) => Raw::File(id.clone()),
            (None, None) if screenshot => {
                Raw::Broken("computer_screenshot without image_url or file_id")
            }
            (None, None) => Raw::Broken("input_image without image_url or file_id"),
        });
    }
    if ty.is(src, "image") {
        if f.source_type.is_some() || f.source_bad {
            let st = f.source_type.as_ref();
            let is = |name| st.is_some_and(|t| t.is(src, name));
            return Some(if is("base64") {
                match &f.source_data {
                    Some(d) => Raw::Base64(d.clone(), f.source_media_type.clone()),
                    None => Raw::Broken("base64 image source without data"),
                }
            } else if is("url") {
                match &f.source_url {
                    Some(u) => url_like(u),
                    None => Raw::Broken("url image source without a url"),
                }
            } else if is("file") {
                match &f.source_file {
                    Some(id) => Raw::File(id.clone()),
                    None => Raw::Broken("file image source without a file_id"),
                }
            } else {
                Raw::Broken("image source of an unknown type")
            });
        }
        // MCP `image`, LangChain standard blocks (`data`/`base64`, `url`,
        // `file_id`).
        return Some(
            match (&f.data, f.image_url.as_ref().or(f.url.as_ref()), &f.file_id) {
                (Some(d), _, _) => Raw::Base64(d.clone(), f.media_type.clone()),
                (None, Some(u), _) => url_like(u),
                (None, None, Some(id)) => Raw::File(id.clone()),
                (None, None, None) => Raw::Broken("image part without data or source"),
            },
        );
    }
    let image_media = |m: &Option<Str>| {
        m.as_ref()
            .and_then(|m| m.decode(src))
            .is_some_and(|m| m.to_ascii_lowercase().starts_with("image/"))
    };
    // Vercel AI SDK tool output parts (v6 `image-data` / `image-url`,
    // `file-data` of an image type; v5 `media`).
    if ty.is(src, "image-data")
        || ((ty.is(src, "media") || ty.is(src, "file-data")) && image_media(&f.media_type))
    {
        return Some(match &f.data {
            Some(d) => Raw::Base64(d.clone(), f.media_type.clone()),
            None => Raw::Broken("image data part without data"),
        });
    }
    // v7 `file` parts of an image type: data inline or by URL.
    if ty.is(src, "file") && image_media(&f.media_type) {
        return Some(match (&f.data, &f.url) {
            (Some(d), _) => Raw::Base64(d.clone(), f.media_type.clone()),
            (None, Some(u)) => url_like(u),
            (None, None) => Raw::Broken("image file part without data or url"),
        });
    }
    if ty.is(src, "image-url") {
        return Some(match f.url.as_ref().or(f.image_url.as_ref()) {
            Some(u) => url_like(u),
            None => Raw::Broken("image-url part without a url"),
        });
    }
    // MCP embedded resource holding an image.
    if ty.is(src, "resource") && image_media(&f.resource_mime) {
        return Some(match &f.resource_blob {
            Some(b) => Raw::Base64(b.clone(), f.resource_mime.clone()),
            None => Raw::Broken("image resource without a blob"),
        });
    }
    None
}

/// What a message is, from its `role` and its `type` (Responses items).
pub(super) fn role_of(role: Option<&str>, ty: Option<&str>, is_output: bool) -> Role {
    if is_output {
        return Role::Tool;
    }
    match (role, ty) {
        (Some("system" | "developer"), _) => Role::System,
        (Some("user"), _) => Role::User,
        (Some("assistant"), _) => Role::Assistant,
        (Some("tool" | "function"), _) => Role::Tool,
        (Some(_), _) => Role::Other,
        (None, None | Some("message")) => Role::User,
        (None, Some(t)) if t.ends_with("_output") => Role::Tool,
        (None, Some("item_reference")) => Role::Other,
        // function_call, reasoning, custom_tool_call, web_search_call, …:
        // what the model produced.
        (None, Some(_)) => Role::Assistant,
    }
}

/// Where a walked value is (`messages[3].content[1]`), written out only
/// when something is found there: most content holds nothing to report,
/// and a path written for every message and part cost a `format!` each.
#[derive(Clone, Copy)]
enum PathAt<'p> {
    /// `{items}[{index}].{field}`: a message's `content` or `output`.
    Item {
        items: &'p str,
        index: usize,
        field: &'static str,
    },
    /// `{parent}[{j}]`: a part of a content array.
    Index(&'p PathAt<'p>, usize),
    /// `{parent}.{field}`: content inside a part.
    Field(&'p PathAt<'p>, &'static str),
}

impl std::fmt::Display for PathAt<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PathAt::Item {
                items,
                index,
                field,
            } => write!(f, "{items}[{index}].{field}"),
            PathAt::Index(parent, j) => write!(f, "{parent}[{j}]"),
            PathAt::Field(parent, field) => write!(f, "{parent}.{field}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_found_image_is_named_by_its_whole_path() {
        let png = "iVBORw0KGgo=";
        let body = format!(
            r#"{{"model":"m","messages":[
            {{"role":"user","content":"hi"}},
            {{"role":"user","content":[{{"type":"text","text":"a"}},{{"type":"tool_result","tool_use_id":"t","content":[
                {{"type":"text","text":"b"}},
                {{"type":"image","source":{{"type":"base64","media_type":"image/png","data":"{png}"}}}}]}}]}},
            {{"role":"user","content":[{{"type":"document","source":{{"type":"content","content":[
                {{"type":"image","source":{{"type":"base64","media_type":"image/png","data":"{png}"}}}}]}}}}]}}]}}"#
        );
        let scan = scan(body.as_bytes(), Shape::Messages).unwrap();
        let paths: Vec<&str> = scan.images.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "messages[1].content[1].content[1]",
                "messages[2].content[0].source.content[0]"
            ]
        );
    }
}
