//! Finding every image in a request, and replacing the chosen ones in place.
//!
//! [`scan`] walks the request once (see [`super::json`]) and returns each
//! image with where it sits: a content part (Chat `image_url`, MCP-native
//! `{"type":"image","data","mimeType"}`, Responses `input_image`, Anthropic
//! `image` blocks — also inside tool results), or hidden in the text of a
//! user or tool message (a `data:image/…;base64,` URL, or JSON-stringified
//! MCP output). Base64 images are decoded and hashed here, once.
//!
//! Base64 images are not decoded by the walk: [`Scan::resolve`] decodes and
//! hashes the ones a caller is going to replace, so an image that passes
//! through (a vision model's) costs the walk over its string and nothing more.
//! The walk also records every message's role and text strings, for the
//! image rules and line dedup.
//!
//! [`Scan::apply`] then replaces the images a caller chose with one text
//! part each, splicing only those byte ranges: no message is added or
//! removed, every other byte (unknown fields included) stays as it was.

use std::borrow::Cow;
use std::ops::Range;

use bytes::Bytes;
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::json::{Cursor, Kind, Malformed, Result, Str, quote, splice, splice_compact};
use super::{Shape, Subject, SubjectImage};
use crate::artifacts::{Artifact, sniff_media_type};

/// Descent into nested tool results stops here (deeper ones are left as
/// they are).
const MAX_NESTING: usize = 8;
/// Depth of the generic walk over JSON found inside a text.
const MAX_TEXT_JSON_DEPTH: usize = 32;

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

/// Where an image sits in the request.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Site {
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
struct Pending {
    /// In a text spot's decoded text (`Some(spot)`), else in the body.
    spot: Option<usize>,
    range: Range<usize>,
}

/// One image found in the request.
#[derive(Debug, Clone)]
pub struct Found {
    /// Full SHA-256 hex of the decoded bytes (of the URL or file id for
    /// references, of the undecodable text for broken data). Empty until
    /// the image is resolved ([`Scan::resolve`]).
    pub sha256: String,
    pub source: Source,
    /// Index of the message (or Responses input item) it is in.
    pub message: usize,
    /// Role of that message (`tool` for Responses function outputs).
    pub role: String,
    /// True inside a tool or function result.
    pub in_tool_result: bool,
    /// A readable location, e.g. `messages[3].content[1]`.
    pub path: String,
    site: Site,
    bytes: Option<Bytes>,
    pending: Option<Pending>,
    /// Prompt-cache markers of the part (`"cache_control": …`,
    /// `"prompt_cache_breakpoint": …` members, their byte ranges in the
    /// body): the text that replaces the part carries them.
    markers: Vec<Range<usize>>,
}

impl Found {
    /// What a describer can be sent for this image: its decoded bytes, or
    /// its http(s) URL (visor never fetches it). `None` for file ids, other
    /// URLs and broken data.
    pub fn subject(&self) -> Option<Subject> {
        let image = match (&self.source, &self.bytes) {
            (Source::Inline { media_type, .. }, Some(bytes)) => SubjectImage::Inline {
                media_type: media_type.clone(),
                bytes: bytes.clone(),
            },
            (Source::Url(url), _) if url.starts_with("https://") || url.starts_with("http://") => {
                SubjectImage::Url(url.clone())
            }
            _ => return None,
        };
        Some(Subject {
            sha256: self.sha256.clone(),
            image,
            lookup_only: false,
        })
    }
}

/// A string in the request whose text may hold images or be rewritten.
#[derive(Debug, Clone)]
struct Spot {
    lit: Str,
    /// Decoded text, kept when something was found in it.
    text: Option<String>,
}

/// A Chat tool message's content array: when every image in it is
/// replaced, it becomes one string (providers that take only a string as
/// tool content stay valid).
#[derive(Debug, Clone)]
struct Collapsible {
    /// The message.
    item: usize,
    range: Range<usize>,
    parts: Vec<PartRef>,
}

/// A content array: its range, its parts, and whether every part is text
/// or image.
type ContentArray = (Range<usize>, Vec<PartRef>, bool);

#[derive(Debug, Clone)]
enum PartRef {
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
#[derive(Debug, Default)]
pub struct Scan {
    pub images: Vec<Found>,
    /// One per element of the message array.
    pub items: Vec<Item>,
    /// Every text string of every message, in request order.
    pub texts: Vec<TextAt>,
    /// The call a tool result answers, by (message, unit): Chat
    /// `tool_call_id`, Responses `call_id`, Anthropic `tool_use_id`.
    pub call_ids: Vec<(usize, u32, Str)>,
    spots: Vec<Spot>,
    collapsible: Vec<Collapsible>,
}

/// Reads the request once and finds every image in it.
pub fn scan(body: &[u8], shape: Shape) -> std::result::Result<Scan, Malformed> {
    let items_key = match shape {
        Shape::Chat | Shape::Messages => "messages",
        Shape::Responses => "input",
    };
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
    c.object(|c, key| {
        if key.is(body, items_key) && c.kind()? == Kind::Array {
            c.array(|c, i| w.message(c, i, items_key)).map(drop)
        } else {
            c.skip().map(drop)
        }
    })?;
    Ok(w.out)
}

struct Walker<'a> {
    src: &'a [u8],
    shape: Shape,
    items_key: &'static str,
    out: Scan,
}

/// Per-message context while walking its content.
struct Msg {
    index: usize,
    /// Images and spots found in this message, finished at its end when the
    /// role is known: (spot, in a tool result, unit).
    first_image: usize,
    spots: Vec<(usize, bool, u32)>,
    /// The unit being walked, and the last one given out.
    unit: u32,
    units: u32,
    /// A part of this message carries a prompt-cache marker: its content
    /// array is never collapsed into a string (the marker would go).
    cache_markers: bool,
}

/// The fields of a content part the classifier needs.
#[derive(Default)]
struct PartFields {
    ty: Option<Str>,
    image_url: Option<Str>,
    image_url_bad: bool,
    data: Option<Str>,
    media_type: Option<Str>,
    source_type: Option<Str>,
    source_media_type: Option<Str>,
    source_data: Option<Str>,
    source_url: Option<Str>,
    source_file: Option<Str>,
    source_bad: bool,
    file_id: Option<Str>,
    text: Option<Str>,
    tool_use_id: Option<Str>,
    /// `"cache_control": …` and `"prompt_cache_breakpoint": …` members
    /// (key through value).
    markers: Vec<Range<usize>>,
    /// A bare `url` (LangChain standard blocks, Vercel `image-url`).
    url: Option<Str>,
    /// An Anthropic `document` whose `source` is `{"type":"content",
    /// "content":[…]}`: where that content array is (it may hold images).
    source_content: Option<Range<usize>>,
    /// An MCP embedded resource's `blob` and `mimeType`.
    resource_blob: Option<Str>,
    resource_mime: Option<Str>,
}

impl PartFields {
    /// Reads the value of `key` when it is one of the fields an image part
    /// is recognised by; false (nothing consumed) for any other key.
    fn read(&mut self, c: &mut Cursor<'_>, src: &[u8], key: &Str) -> Result<bool> {
        let k = |name: &str| key.is(src, name);
        let kind = c.kind()?;
        let string = kind == Kind::String;
        if string && k("type") {
            self.ty = Some(c.string()?);
        } else if k("cache_control") || k("prompt_cache_breakpoint") {
            let value = c.skip()?;
            self.markers.push(key.range.start..value.end);
        } else if k("image_url") {
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
        } else if string && (k("data") || k("base64")) {
            self.data = Some(c.string()?);
        } else if kind == Kind::Object && k("data") {
            // Vercel AI SDK v7 `file` parts: `"data": {"type": "data",
            // "data": "…"}` or `{"type": "url", "url": "…"}`.
            c.object(|c, key| {
                if c.kind()? == Kind::String && key.is(src, "data") {
                    self.data = Some(c.string()?);
                } else if c.kind()? == Kind::String && key.is(src, "url") {
                    self.url = Some(c.string()?);
                } else {
                    c.skip()?;
                }
                Ok(())
            })?;
        } else if string && k("url") {
            self.url = Some(c.string()?);
        } else if kind == Kind::Object && k("resource") {
            c.object(|c, key| {
                if c.kind()? == Kind::String && key.is(src, "blob") {
                    self.resource_blob = Some(c.string()?);
                } else if c.kind()? == Kind::String && key.is(src, "mimeType") {
                    self.resource_mime = Some(c.string()?);
                } else {
                    c.skip()?;
                }
                Ok(())
            })?;
        } else if string && (k("mimeType") || k("mime_type") || k("media_type") || k("mediaType")) {
            self.media_type = Some(c.string()?);
        } else if string && k("file_id") {
            self.file_id = Some(c.string()?);
        } else if string && k("text") {
            self.text = Some(c.string()?);
        } else if string && k("tool_use_id") {
            self.tool_use_id = Some(c.string()?);
        } else if k("source") {
            if kind != Kind::Object {
                self.source_bad = true;
                c.skip()?;
                return Ok(true);
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
        } else {
            return Ok(false);
        }
        Ok(true)
    }
}

impl Walker<'_> {
    fn message(&mut self, c: &mut Cursor<'_>, index: usize, items_key: &str) -> Result<()> {
        self.out.items.push(Item {
            role: Role::Other,
            authored: false,
            bytes: 0,
        });
        if c.kind()? != Kind::Object {
            let range = c.skip()?;
            self.out.items[index].bytes = range.len();
            return Ok(());
        }
        let src = self.src;
        let mut role: Option<Str> = None;
        let mut ty: Option<Str> = None;
        let mut msg = Msg {
            index,
            first_image: self.out.images.len(),
            spots: Vec::new(),
            unit: 0,
            units: 0,
            cache_markers: false,
        };
        let mut content: Option<ContentArray> = None;
        let mut call_id: Option<Str> = None;
        let range = c.object(|c, key| {
            if key.is(src, "role") && c.kind()? == Kind::String {
                role = Some(c.string()?);
            } else if key.is(src, "type") && c.kind()? == Kind::String {
                ty = Some(c.string()?);
            } else if (key.is(src, "tool_call_id") || key.is(src, "call_id"))
                && c.kind()? == Kind::String
            {
                call_id = Some(c.string()?);
            } else if key.is(src, "content") || key.is(src, "output") {
                let which = if key.is(src, "content") {
                    "content"
                } else {
                    "output"
                };
                let path = format!("{items_key}[{index}].{which}");
                let tool = key.is(src, "output");
                content = self.content(c, &mut msg, &path, tool, 0)?;
            } else {
                c.skip()?;
            }
            Ok(())
        })?;
        let role = role.and_then(|r| r.decode(src)).map(|r| r.into_owned());
        let is_output = ty.as_ref().is_some_and(|t| {
            t.is(src, "function_call_output")
                || t.is(src, "custom_tool_call_output")
                || t.is(src, "computer_call_output")
        });
        let kind = role_of(
            role.as_deref(),
            ty.as_ref().and_then(|t| t.decode(src)).as_deref(),
            is_output,
        );
        let role = match (role, is_output) {
            (_, true) => "tool".to_owned(),
            (Some(r), false) => r,
            (None, false) => "user".to_owned(),
        };
        let tool_message = role == "tool" || role == "function";
        if let Some(id) = call_id
            && (tool_message || kind == Role::Tool)
        {
            self.out.call_ids.push((index, 0, id));
        }
        for img in &mut self.out.images[msg.first_image..] {
            img.role.clone_from(&role);
            img.in_tool_result |= tool_message;
        }
        let own = |in_tool: bool| !in_tool && !tool_message;
        self.out.items[index] = Item {
            role: kind,
            authored: kind == Role::User
                && (msg.spots.iter().any(|&(_, t, _)| own(t))
                    || self.out.images[msg.first_image..]
                        .iter()
                        .any(|f| own(f.in_tool_result))),
            bytes: range.len(),
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
        if !matches!(role.as_str(), "system" | "developer" | "assistant") {
            for (spot, in_tool, _) in std::mem::take(&mut msg.spots) {
                self.look_in_text(spot, &msg, &role, in_tool || tool_message);
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
        Ok(())
    }

    /// Walks a `content` (or `output`) value. Returns, for an array, its
    /// range, its parts and whether every part is text or image.
    fn content(
        &mut self,
        c: &mut Cursor<'_>,
        msg: &mut Msg,
        path: &str,
        in_tool: bool,
        depth: usize,
    ) -> Result<Option<ContentArray>> {
        match c.kind()? {
            Kind::String => {
                let lit = c.string()?;
                self.text_spot(lit, msg, in_tool);
                Ok(None)
            }
            Kind::Array if depth < MAX_NESTING => {
                let mut parts = Vec::new();
                let mut simple = true;
                let range = c.array(|c, j| {
                    let p = format!("{path}[{j}]");
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
                self.part(c, msg, path, in_tool, depth)?;
                Ok(None)
            }
            _ => {
                c.skip()?;
                Ok(None)
            }
        }
    }

    /// Records a text string of the message being walked.
    fn text_spot(&mut self, lit: Str, msg: &mut Msg, in_tool: bool) -> usize {
        self.out.spots.push(Spot { lit, text: None });
        let spot = self.out.spots.len() - 1;
        msg.spots.push((spot, in_tool, msg.unit));
        spot
    }

    /// Walks one content part. Returns what it is for a possible collapse:
    /// a text part, an image, or `None` for anything else.
    fn part(
        &mut self,
        c: &mut Cursor<'_>,
        msg: &mut Msg,
        path: &str,
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
        let range = c.object(|c, key| {
            if f.read(c, src, &key)? {
                return Ok(());
            }
            if key.is(src, "content") {
                // An Anthropic tool_result (or anything shaped like one):
                // its content is a tool result of its own.
                let p = format!("{path}.content");
                let outer = msg.unit;
                msg.units += 1;
                msg.unit = msg.units;
                own_unit = Some(msg.unit);
                self.content(c, msg, &p, true, depth + 1)?;
                msg.unit = outer;
            } else {
                c.skip()?;
            }
            Ok(())
        })?;
        msg.cache_markers |= !f.markers.is_empty();
        // An Anthropic document (or search result) whose source is content
        // blocks: images among them are images like any other.
        if let Some(inner) = f.source_content.take()
            && f.ty.as_ref().is_some_and(|t| t.is(src, "document"))
        {
            let mut sub = Cursor::at(src, inner.start);
            let p = format!("{path}.source.content");
            self.content(&mut sub, msg, &p, in_tool, depth + 1)?;
        }
        let tool_result = f.ty.as_ref().is_some_and(|t| t.is(src, "tool_result"));
        let Some(ty) = f.ty.as_ref() else {
            return Ok(None);
        };
        if let Some(source) = classify(src, ty, &f) {
            // The whole part is replaced: anything found inside it goes.
            self.out.images.truncate(images_before);
            msg.spots.truncate(spots_before);
            let (sha256, source, bytes, pending) = read_lazily(src, source, None);
            msg.cache_markers |= !f.markers.is_empty();
            self.out.images.push(Found {
                sha256,
                source,
                message: msg.index,
                role: String::new(),
                in_tool_result: in_tool,
                path: path.to_owned(),
                site: Site::Part(range),
                bytes: bytes.map(Bytes::from),
                pending,
                markers: std::mem::take(&mut f.markers),
            });
            return Ok(Some(PartRef::Image(self.out.images.len() - 1)));
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
            let spot = self.text_spot(text, msg, in_tool);
            return Ok(Some(PartRef::Text(spot)));
        }
        Ok(None)
    }

    /// Finds images hidden in the text of spot `spot`.
    fn look_in_text(&mut self, spot: usize, msg: &Msg, role: &str, in_tool: bool) {
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
                message: msg.index,
                role: role.to_owned(),
                in_tool_result: in_tool,
                path: format!("{}[{}] (in text)", self.items_key, msg.index),
                site: Site::InText {
                    spot,
                    range,
                    object,
                    escapes,
                },
                bytes: bytes.map(Bytes::from),
                pending,
                markers: Vec::new(),
            });
        }
        self.out.spots[spot].text = Some(text);
    }
}

/// Where an image's bytes are, before decoding.
#[derive(Debug)]
enum Raw {
    /// A `data:` URL string literal.
    DataUrl(Str),
    /// A `data:` URL inside a decoded text (a byte range, no quotes).
    DataUrlInText(Range<usize>),
    /// Base64 data and its declared media type.
    Base64(Str, Option<Str>),
    Url(Str),
    File(Str),
    Broken(&'static str),
}

/// Decides whether a part is an image, and where its bytes are.
fn classify(src: &[u8], ty: &Str, f: &PartFields) -> Option<Raw> {
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
    if ty.is(src, "input_image") {
        return Some(match (&f.image_url, &f.file_id) {
            (Some(u), _) => url_like(u),
            (None, Some(id)) => Raw::File(id.clone()),
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
    // Responses computer use: `computer_call_output.output`.
    if ty.is(src, "computer_screenshot") {
        return Some(match (&f.image_url, &f.file_id) {
            (Some(u), _) => url_like(u),
            (None, Some(id)) => Raw::File(id.clone()),
            (None, None) => Raw::Broken("computer_screenshot without image_url or file_id"),
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
fn role_of(role: Option<&str>, ty: Option<&str>, is_output: bool) -> Role {
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

fn hex(digest: &[u8]) -> String {
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
type Read = (String, Source, Option<Vec<u8>>, Option<Pending>);

fn read_lazily(src: &[u8], raw: Raw, spot: Option<usize>) -> Read {
    let text = |s: &Str| s.decode(src).map(|c| c.into_owned()).unwrap_or_default();
    let encoded = |media_type: String, range: Range<usize>| {
        (
            String::new(),
            Source::Encoded {
                media_type: media_type.to_ascii_lowercase(),
            },
            None,
            Some(Pending { spot, range }),
        )
    };
    match raw {
        Raw::Base64(d, mt) if !d.escaped => {
            let mt = mt.map(|m| text(&m)).unwrap_or_default();
            encoded(mt, d.range.start + 1..d.range.end - 1)
        }
        Raw::DataUrl(s) if !s.escaped => {
            let start = s.range.start + 1;
            match data_url_payload(s.raw(src)) {
                Some((mt, at)) => encoded(mt, start + at..s.range.end - 1),
                None => eager(src, Raw::DataUrl(s)),
            }
        }
        Raw::DataUrlInText(range) => match src.get(range.clone()).and_then(data_url_payload) {
            Some((mt, at)) => encoded(mt, range.start + at..range.end),
            None => eager(src, Raw::DataUrlInText(range)),
        },
        raw => eager(src, raw),
    }
}

fn eager(src: &[u8], raw: Raw) -> Read {
    let (sha, source, bytes) = read_image(src, raw);
    (sha, source, bytes, None)
}

/// A base64 data URL's media type and where its payload starts.
fn data_url_payload(url: &[u8]) -> Option<(String, usize)> {
    let comma = memchr::memchr(b',', url)?;
    let head = std::str::from_utf8(url.get(..comma + 1)?).ok()?;
    let (mt, _) = split_data_url(head)?;
    Some((mt.to_owned(), comma + 1))
}

/// Decodes and hashes one image.
fn read_image(src: &[u8], raw: Raw) -> (String, Source, Option<Vec<u8>>) {
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

fn read_data_url(url: &str) -> (String, Source, Option<Vec<u8>>) {
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
fn split_data_url(url: &str) -> Option<(&str, &str)> {
    let rest = url.strip_prefix("data:")?;
    let comma = rest.find(',')?;
    let (meta, data) = (&rest[..comma], &rest[comma + 1..]);
    let meta = meta.strip_suffix(";base64")?;
    let mt = meta.split(';').next().unwrap_or("");
    Some((mt, data))
}

fn decode_image(b64: &[u8], declared: &str) -> (String, Source, Option<Vec<u8>>) {
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
            let media_type = if declared.is_empty() {
                sniffed.unwrap_or("application/octet-stream").to_owned()
            } else {
                declared.to_ascii_lowercase()
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

fn trim_pad(b: &[u8]) -> &[u8] {
    let mut end = b.len();
    while end > 0 && b[end - 1] == b'=' {
        end -= 1;
    }
    &b[..end]
}

/// An image found in a text.
struct InTextFound {
    /// Its bytes in the text (an object, or a data URL).
    range: Range<usize>,
    object: bool,
    /// JSON string encodings between the text and the image.
    escapes: u8,
    raw: TextRaw,
}

/// Where a found image's bytes are: in the text itself (read lazily from
/// it), or inside a JSON string in it (read already, from the decoded
/// string).
enum TextRaw {
    Here(Raw),
    Read(Read),
}

/// Images in a text: JSON objects of a stringified tool result (MCP
/// `{"type":"image",…}` and the other image part shapes), also inside JSON
/// strings in that JSON (a result stringified twice, up to
/// [`MAX_TEXT_JSON_DEPTH`] levels), and `data:image/…;base64,…` URLs outside
/// them. Ranges are in `text`.
fn find_in_text(text: &str) -> Vec<InTextFound> {
    find_in_text_at(text, 0)
}

fn find_in_text_at(text: &str, depth: usize) -> Vec<InTextFound> {
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
fn images_in_string(src: &[u8], lit: &Str, depth: usize) -> Vec<InTextFound> {
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
fn unescape_mapped(raw: &[u8], base: usize) -> Option<(String, Vec<usize>)> {
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
fn data_url_end(b: &[u8], start: usize) -> usize {
    let mut i = start + "data:".len();
    while i < b.len() && (b[i].is_ascii_alphanumeric() || b"/+.-;=_".contains(&b[i])) {
        i += 1;
    }
    i
}

/// When the data URL at `start` (head up to `head_end`) is `;base64,`,
/// the end of its base64 payload.
fn end_if_base64(b: &[u8], start: usize, head_end: usize) -> Option<usize> {
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
fn json_images(c: &mut Cursor<'_>, out: &mut Vec<InTextFound>, depth: usize) -> Result<()> {
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
                && let Some(raw) = classify(src, ty, &f)
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

/// Why an image is replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The model cannot see images.
    NonVision,
    /// In a tool result more than `keep_turns` assistant turns old.
    AgedOut,
    /// Beyond the newest `max_per_request` images (or the model's
    /// `max_images`).
    Capped,
    /// A later copy of an image that appears earlier in the request.
    Deduped,
}

impl Reason {
    fn words(self) -> &'static str {
        match self {
            Reason::NonVision => "this model cannot see images",
            Reason::AgedOut => "an older tool result",
            Reason::Capped => "over this request's image limit",
            Reason::Deduped => "the same image as earlier in this conversation",
        }
    }
}

/// The text that takes an image's place: `sha256:` and 12 hex digits, what
/// the image was, and either its description or why it is not shown. The
/// same image always gives the same text (provider prompt caches keep
/// hitting).
pub fn placeholder(img: &Found, description: Option<&str>, reason: Reason) -> String {
    let short = img.sha256.get(..12).unwrap_or(&img.sha256);
    if reason == Reason::Deduped {
        return format!("[image sha256:{short}: {}]", reason.words());
    }
    let what = match &img.source {
        Source::Encoded { media_type } => format!("image sha256:{short}, {media_type}"),
        Source::Inline {
            media_type, dims, ..
        } => match dims {
            Some((w, h)) => format!("image sha256:{short}, {media_type} {w}x{h}"),
            None => format!("image sha256:{short}, {media_type}"),
        },
        Source::Url(url) if keepable(url) => format!("image {url} (sha256:{short})"),
        Source::Url(url) => format!("image sha256:{short}, a {}-character URL", url.len()),
        Source::File(id) => format!("image file {id} (sha256:{short})"),
        Source::Broken(why) => {
            return format!("[image sha256:{short} removed: {why}]");
        }
    };
    match description {
        // One line, so it stays visor's own on a second pass.
        Some(d) if d.contains(['\n', '\r']) => {
            let d: String = d
                .chars()
                .map(|c| if c == '\n' || c == '\r' { ' ' } else { c })
                .collect();
            format!("[{what}, described: {d}]")
        }
        Some(d) => format!("[{what}, described: {d}]"),
        None => format!("[{what}: not shown, {}]", reason.words()),
    }
}

/// Whether a URL is kept in the text that replaces its image: not when it
/// is long or carries inline data (the text would then hold the image it
/// replaces, or be found again as one), nor when it holds a control
/// character (a line break would split visor's one-line text).
fn keepable(url: &str) -> bool {
    url.len() <= 2048
        && !url.contains("data:")
        && !url.contains("base64,")
        && !url.contains(char::is_control)
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

    /// The text of spot `s` as the request has it.
    pub fn spot_decoded<'a>(&'a self, s: usize, body: &'a [u8]) -> Option<Cow<'a, str>> {
        let spot = self.spots.get(s)?;
        match &spot.text {
            Some(t) => Some(Cow::Borrowed(t.as_str())),
            None => spot.lit.decode(body),
        }
    }

    /// The length of the base64 text of image `i` when it is not decoded yet.
    pub fn pending_len(&self, i: usize) -> Option<usize> {
        self.images.get(i)?.pending.as_ref().map(|p| p.range.len())
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

    /// Rewrites `body`: image `i` replaced by `texts[i]` when set, spot `s`
    /// by `spot_text[s]` when set, collapsible Chat tool message `c` by
    /// `joined[c]` when set (see [`Scan::joined`]). `None` when nothing is
    /// to change.
    pub fn assemble(
        &self,
        body: &[u8],
        shape: Shape,
        texts: &[Option<String>],
        spot_text: &[Option<String>],
        joined: &[Option<String>],
    ) -> Option<Vec<u8>> {
        if texts.iter().all(Option::is_none) && spot_text.iter().all(Option::is_none) {
            return None;
        }
        let mut edits: Vec<(Range<usize>, Vec<u8>)> = Vec::new();
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

/// One text part in the request's own shape.
fn text_part(shape: Shape, text: &str) -> Vec<u8> {
    let ty = match shape {
        Shape::Chat | Shape::Messages => "text",
        Shape::Responses => "input_text",
    };
    let mut out = Vec::with_capacity(text.len() + 32);
    out.extend_from_slice(b"{\"type\":\"");
    out.extend_from_slice(ty.as_bytes());
    out.extend_from_slice(b"\",\"text\":");
    out.extend_from_slice(&quote(text));
    out.push(b'}');
    out
}
