//! A request as a provider's prompt cache sees it: a list of *elements* —
//! the head (the tools and the system prompt) and then each message — each
//! hashed without the cache markers it carries, with an estimate of its
//! tokens and the content blocks it holds (their byte ranges, for placing
//! breakpoints; their markers, for knowing where the provider may read).
//!
//! Element 0 is the head. In Messages and Responses, whose system prompt
//! stands apart (`system`, `instructions`), element k ≥ 1 is message k − 1;
//! in Chat the system prompt is a message, so the head is the tools with
//! `messages[0]` and element k is `messages[k]`. Either way "message 0" is
//! where the system prompt is.
//!
//! One borrowed pass over the body ([`crate::transform::json`]): nothing is
//! copied but a block that carries a marker (re-serialised without it, to
//! hash).

use std::ops::Range;

use xxhash_rust::xxh3::Xxh3;

use crate::api::Shape;
use crate::transform::json::{Cursor, Kind, Malformed, Result};

/// Text is taken at 4 bytes a token.
pub const BYTES_PER_TOKEN: u64 = 4;
/// An image (its bytes are not text) is taken at 765 tokens.
pub const IMAGE_TOKENS: u64 = 765;
/// A run of base64 characters at least this long is an image's bytes, not
/// text.
const BASE64_RUN: usize = 512;

/// What a content block is, as far as a cache marker cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// Text with something in it.
    Text,
    /// Text that is empty or only whitespace: the provider refuses a
    /// marker on it.
    EmptyText,
    /// `thinking` and `redacted_thinking`: never marked (the provider
    /// refuses it).
    Thinking,
    /// A tool definition, an image, a tool call or result, a document…
    Other,
}

impl BlockKind {
    /// A marker may be placed on it.
    pub fn markable(self) -> bool {
        matches!(self, BlockKind::Text | BlockKind::Other)
    }
}

/// One content block (or a tool definition, in the head).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// Its bytes in the body.
    pub range: Range<usize>,
    /// A JSON string standing for one text block (`"content": "hi"`,
    /// `"system": "…"`).
    pub string: bool,
    pub kind: BlockKind,
    /// It carries `cache_control`.
    pub marked: bool,
    pub tokens: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    User,
    Assistant,
    /// The head, a system or developer message, a tool message, an item
    /// without a role.
    Other,
}

/// The head, or one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Element {
    /// Of its bytes, without cache markers.
    pub hash: u64,
    pub tokens: u64,
    pub role: Role,
    pub blocks: Vec<Block>,
}

/// A request, element by element.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Anatomy {
    pub elements: Vec<Element>,
    /// Some `cache_control` is set anywhere in the body (the client's
    /// own markers: the request is then left as it came).
    pub marked: bool,
    /// The request declares tools.
    pub tools: usize,
    /// A Responses request that continues a stored response
    /// (`previous_response_id`): its messages are not the conversation's.
    pub chained: bool,
    /// The body has a `prompt_cache_key` of its own.
    pub has_cache_key: bool,
    /// The hash of the first user message (with the head when there is no
    /// user message), naming the conversation.
    pub first_user: u64,
    /// Where the body's top-level object starts (`{`), for inserting a
    /// field.
    pub open: usize,
}

impl Anatomy {
    /// The request's elements; `None` for a body that is not the object
    /// its API expects.
    pub fn of(shape: Shape, body: &[u8]) -> Option<Anatomy> {
        read(shape, body).ok()
    }

    pub fn total_tokens(&self) -> u64 {
        self.elements.iter().map(|e| e.tokens).sum()
    }

    /// The elements' hashes, in order.
    pub fn hashes(&self) -> Vec<u64> {
        self.elements.iter().map(|e| e.hash).collect()
    }
}

/// What a request's top level holds besides its elements.
#[derive(Default)]
struct Top {
    tools: Vec<Block>,
    system: Vec<Block>,
    messages: Option<Vec<Element>>,
    marked: bool,
    chained: bool,
    has_cache_key: bool,
}

/// One pass over the body: the tools, the system prompt and the messages
/// walked where they are; everything else skipped.
fn read(shape: Shape, body: &[u8]) -> Result<Anatomy> {
    let mut c = Cursor::new(body);
    if c.kind()? != Kind::Object {
        return Err(Malformed);
    }
    let items = match shape {
        Shape::Responses => "input",
        Shape::Chat | Shape::Messages => "messages",
    };
    let mut top = Top::default();
    let whole = c.object(|c, key| {
        let src = c.src();
        if key.is(src, "tools") && c.kind()? == Kind::Array {
            c.array(|c, _| {
                top.tools.push(block_at(c)?);
                Ok(())
            })?;
        } else if key.is(src, "system") && shape == Shape::Messages
            || key.is(src, "instructions") && shape == Shape::Responses
        {
            top.system = content(c)?;
        } else if key.is(src, items) {
            top.messages = Some(messages(c)?);
        } else {
            let at = c.skip()?;
            if key.is(src, "cache_control") {
                top.marked = true;
            } else if key.is(src, "previous_response_id") {
                top.chained = &src[at] != b"null";
            } else if key.is(src, "prompt_cache_key") {
                top.has_cache_key = &src[at] != b"null";
            }
        }
        Ok(())
    })?;
    let mut a = Anatomy {
        marked: top.marked,
        chained: top.chained,
        has_cache_key: top.has_cache_key,
        tools: top.tools.len(),
        open: whole.start,
        ..Anatomy::default()
    };
    let mut head = Element {
        hash: 0,
        tokens: 0,
        role: Role::Other,
        blocks: top.tools,
    };
    head.blocks.extend(top.system);
    let mut h = Xxh3::new();
    for b in &head.blocks {
        hash_block(&mut h, body, b);
        head.tokens += b.tokens;
    }
    let mut messages = top.messages.unwrap_or_default();
    if shape == Shape::Chat && !messages.is_empty() {
        // Chat's system prompt is its first message: the head holds it.
        let first = messages.remove(0);
        h.update(&first.hash.to_le_bytes());
        head.tokens += first.tokens;
        head.blocks.extend(first.blocks);
    }
    head.hash = h.digest();
    a.marked |= head.blocks.iter().any(|b| b.marked);
    a.marked |= messages.iter().any(|m| m.blocks.iter().any(|b| b.marked));
    a.first_user = messages
        .iter()
        .find(|m| m.role == Role::User)
        .map_or(head.hash, |m| m.hash);
    a.elements.push(head);
    a.elements.extend(messages);
    Ok(a)
}

/// The messages (or Responses input): an array of them, or a string that
/// is one user message.
fn messages(c: &mut Cursor<'_>) -> Result<Vec<Element>> {
    let body = c.src();
    let mut out = Vec::new();
    match c.kind()? {
        Kind::String => {
            let s = c.string()?;
            let block = text_block(body, s.range.clone());
            out.push(Element {
                hash: xxhash_rust::xxh3::xxh3_64(&body[s.range]),
                tokens: block.tokens,
                role: Role::User,
                blocks: vec![block],
            });
        }
        Kind::Array => {
            c.array(|c, _| {
                out.push(message(c)?);
                Ok(())
            })?;
        }
        _ => {
            c.skip()?;
        }
    }
    Ok(out)
}

/// One message (or Responses item): its role, its content's blocks, its
/// tokens, and its hash without markers.
fn message(c: &mut Cursor<'_>) -> Result<Element> {
    let body = c.src();
    if c.kind()? != Kind::Object {
        let r = c.skip()?;
        return Ok(Element {
            hash: xxhash_rust::xxh3::xxh3_64(&body[r.clone()]),
            tokens: r.len() as u64 / BYTES_PER_TOKEN,
            role: Role::Other,
            blocks: Vec::new(),
        });
    }
    let mut role = Role::Other;
    let mut blocks = Vec::new();
    // Media and markers outside the content (a Responses item's own image
    // fields, a tool call's arguments).
    let mut rest = Found::default();
    let range = c.object(|c, key| {
        let src = c.src();
        if key.is(src, "role") && c.kind()? == Kind::String {
            let s = c.string()?;
            role = match s.raw(src) {
                b"user" => Role::User,
                b"assistant" => Role::Assistant,
                _ => Role::Other,
            };
        } else if key.is(src, "content") {
            blocks = content(c)?;
        } else if key.is(src, "cache_control") {
            rest.marked = true;
            c.skip()?;
        } else {
            walk(c, is_data_key(src, &key), 1, &mut rest)?;
        }
        Ok(())
    })?;
    let raw = &body[range.clone()];
    let in_blocks: usize = blocks.iter().map(|b| b.range.len()).sum();
    let tokens = blocks.iter().map(|b| b.tokens).sum::<u64>()
        + rest.tokens(raw.len().saturating_sub(in_blocks));
    let marked = rest.marked || blocks.iter().any(|b| b.marked);
    let hash = match marked {
        false => xxhash_rust::xxh3::xxh3_64(raw),
        true => unmarked_hash(raw),
    };
    Ok(Element {
        hash,
        tokens,
        role,
        blocks: mark_all(blocks, rest.marked),
    })
}

/// A marker outside the blocks (on the message itself) marks its last.
fn mark_all(mut blocks: Vec<Block>, marked: bool) -> Vec<Block> {
    if marked
        && !blocks.iter().any(|b| b.marked)
        && let Some(last) = blocks.last_mut()
    {
        last.marked = true;
    }
    blocks
}

/// `content` (or `system`, `instructions`): a string is one text block; an
/// array, its elements.
fn content(c: &mut Cursor<'_>) -> Result<Vec<Block>> {
    let body = c.src();
    match c.kind()? {
        Kind::String => {
            let s = c.string()?;
            Ok(vec![text_block(body, s.range)])
        }
        Kind::Array => {
            let mut blocks = Vec::new();
            c.array(|c, _| {
                blocks.push(block_at(c)?);
                Ok(())
            })?;
            Ok(blocks)
        }
        _ => {
            c.skip()?;
            Ok(Vec::new())
        }
    }
}

fn text_block(body: &[u8], r: Range<usize>) -> Block {
    let inner = &body[r.start + 1..r.end - 1];
    let kind = match inner.iter().all(|b| b.is_ascii_whitespace()) {
        true => BlockKind::EmptyText,
        false => BlockKind::Text,
    };
    Block {
        tokens: inner.len() as u64 / BYTES_PER_TOKEN,
        range: r,
        string: true,
        kind,
        marked: false,
    }
}

/// What a walk of a value found: media bytes (an image's, a document's,
/// audio's base64) and cache markers.
#[derive(Default)]
struct Found {
    media: usize,
    images: u64,
    marked: bool,
}

impl Found {
    /// The tokens of `len` bytes holding what was found.
    fn tokens(&self, len: usize) -> u64 {
        len.saturating_sub(self.media) as u64 / BYTES_PER_TOKEN + self.images * IMAGE_TOKENS
    }
}

/// How deep [`walk`] looks for media and markers (deeper is skipped).
const WALK_DEPTH: usize = 16;

/// A key whose string value may be a file's bytes.
fn is_data_key(src: &[u8], key: &crate::transform::json::Str) -> bool {
    key.is(src, "data") || key.is(src, "file_data")
}

/// Walks the value at the cursor: long base64 strings (a `data` field, or a
/// data URL) are media; a `cache_control` key anywhere marks it.
fn walk(c: &mut Cursor<'_>, data: bool, depth: usize, f: &mut Found) -> Result<Range<usize>> {
    if depth > WALK_DEPTH {
        return c.skip();
    }
    match c.kind()? {
        Kind::Object => c.object(|c, key| {
            let src = c.src();
            if key.is(src, "cache_control") {
                f.marked = true;
                c.skip()?;
                return Ok(());
            }
            walk(c, is_data_key(src, &key), depth + 1, f).map(drop)
        }),
        Kind::Array => c.array(|c, _| walk(c, false, depth + 1, f).map(drop)),
        Kind::String => {
            let s = c.string()?;
            let len = s.range.len();
            if len >= BASE64_RUN && (data || c.src()[s.range.start + 1..].starts_with(b"data:")) {
                f.media += len;
                f.images += 1;
            }
            Ok(s.range)
        }
        Kind::Other => c.skip(),
    }
}

/// A block object (or any other value) at the cursor.
fn block_at(c: &mut Cursor<'_>) -> Result<Block> {
    if c.kind()? != Kind::Object {
        let mut found = Found::default();
        let r = walk(c, false, 1, &mut found)?;
        return Ok(Block {
            tokens: found.tokens(r.len()),
            range: r,
            string: false,
            kind: BlockKind::Other,
            marked: found.marked,
        });
    }
    let mut kind = BlockKind::Other;
    let mut found = Found::default();
    let mut text_empty = None;
    let r = c.object(|c, key| {
        let src = c.src();
        if key.is(src, "type") && c.kind()? == Kind::String {
            let s = c.string()?;
            kind = match s.raw(src) {
                b"thinking" | b"redacted_thinking" => BlockKind::Thinking,
                b"text" | b"input_text" | b"output_text" => BlockKind::Text,
                _ => BlockKind::Other,
            };
        } else if key.is(src, "cache_control") {
            found.marked = true;
            c.skip()?;
        } else if key.is(src, "text") && c.kind()? == Kind::String {
            let s = c.string()?;
            text_empty = Some(s.raw(src).iter().all(|b| b.is_ascii_whitespace()));
        } else {
            walk(c, is_data_key(src, &key), 1, &mut found)?;
        }
        Ok(())
    })?;
    if kind == BlockKind::Text && text_empty != Some(false) {
        kind = BlockKind::EmptyText;
    }
    Ok(Block {
        tokens: found.tokens(r.len()),
        range: r,
        string: false,
        kind,
        marked: found.marked,
    })
}

fn hash_block(h: &mut Xxh3, body: &[u8], b: &Block) {
    let raw = &body[b.range.clone()];
    match b.marked {
        false => h.update(&xxhash_rust::xxh3::xxh3_64(raw).to_le_bytes()),
        true => h.update(&unmarked_hash(raw).to_le_bytes()),
    }
}

/// The hash of a value with every `cache_control` in it removed (the
/// bytes between spliced out): moving a marker does not change what the
/// provider caches.
fn unmarked_hash(raw: &[u8]) -> u64 {
    let mut cut = Vec::new();
    if markers_in(&mut Cursor::new(raw), &mut cut, 0).is_err() {
        return xxhash_rust::xxh3::xxh3_64(raw);
    }
    let mut h = Xxh3::new();
    let mut at = 0;
    for r in cut {
        h.update(&raw[at..r.start]);
        at = r.end;
    }
    h.update(&raw[at..]);
    h.digest()
}

/// How deep [`markers_in`] looks.
const MARKER_DEPTH: usize = 32;

/// The ranges to cut to remove each `"cache_control": …` member of the
/// value at the cursor, with one comma beside it.
fn markers_in(c: &mut Cursor<'_>, cut: &mut Vec<Range<usize>>, depth: usize) -> Result<()> {
    if depth > MARKER_DEPTH {
        c.skip()?;
        return Ok(());
    }
    match c.kind()? {
        Kind::Object => {
            c.object(|c, key| {
                let src = c.src();
                if !key.is(src, "cache_control") {
                    return markers_in(c, cut, depth + 1);
                }
                let value = c.skip()?;
                let before = src[..key.range.start]
                    .iter()
                    .rposition(|b| !b.is_ascii_whitespace());
                let r = match before {
                    Some(i) if src[i] == b',' => i..value.end,
                    _ => {
                        let next = src[value.end..]
                            .iter()
                            .position(|b| !b.is_ascii_whitespace())
                            .map(|k| value.end + k);
                        match next {
                            Some(k) if src[k] == b',' => key.range.start..k + 1,
                            _ => key.range.start..value.end,
                        }
                    }
                };
                cut.push(r);
                Ok(())
            })?;
        }
        Kind::Array => {
            c.array(|c, _| markers_in(c, cut, depth + 1))?;
        }
        Kind::String | Kind::Other => {
            c.skip()?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn anatomy(shape: Shape, body: &str) -> Anatomy {
        Anatomy::of(shape, body.as_bytes()).expect("an anatomy")
    }

    #[test]
    fn messages_have_a_head_then_one_element_a_message() {
        let a = anatomy(
            Shape::Messages,
            r#"{"model":"m","system":"be brief","tools":[{"name":"t"}],
                "messages":[{"role":"user","content":"hi"},
                            {"role":"assistant","content":[{"type":"thinking","thinking":"x"},{"type":"text","text":"yo"}]}]}"#,
        );
        assert_eq!(a.elements.len(), 3);
        assert_eq!(a.tools, 1);
        let head = &a.elements[0];
        assert_eq!(head.blocks.len(), 2, "the tool, then the system string");
        assert!(head.blocks[1].string);
        assert_eq!(a.elements[1].role, Role::User);
        let kinds: Vec<_> = a.elements[2].blocks.iter().map(|b| b.kind).collect();
        assert_eq!(kinds, [BlockKind::Thinking, BlockKind::Text]);
        assert!(!a.marked);
        assert_eq!(a.first_user, a.elements[1].hash);
    }

    #[test]
    fn markers_do_not_change_a_hash_but_are_seen() {
        let plain = anatomy(
            Shape::Messages,
            r#"{"system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
        );
        let marked = anatomy(
            Shape::Messages,
            r#"{"system":[{"type":"text","text":"s","cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":[{"type":"text","text":"hi","cache_control":{"type":"ephemeral"}}]}]}"#,
        );
        assert!(!plain.marked && marked.marked);
        assert_eq!(plain.hashes(), marked.hashes());
        assert!(marked.elements[0].blocks[0].marked && marked.elements[1].blocks[0].marked);
    }

    #[test]
    fn a_marker_anywhere_in_an_object_is_cut_with_one_comma() {
        let plain = unmarked_hash(br#"{"a":1,"b":{"c":2}}"#);
        for marked in [
            r#"{"cache_control":{"type":"ephemeral"},"a":1,"b":{"c":2}}"#,
            r#"{"a":1, "cache_control" : {"type":"ephemeral","ttl":"1h"},"b":{"c":2}}"#,
            r#"{"a":1,"b":{"c":2,"cache_control":{}}}"#,
            r#"{"a":1,"b":{"cache_control":{},"c":2},"cache_control":{}}"#,
        ] {
            assert_eq!(unmarked_hash(marked.as_bytes()), plain, "{marked}");
        }
        assert_eq!(
            unmarked_hash(br#"{"cache_control":{}}"#),
            xxhash_rust::xxh3::xxh3_64(b"{}")
        );
    }

    #[test]
    fn a_text_that_mentions_the_marker_is_not_one() {
        let a = anatomy(
            Shape::Messages,
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"set \"cache_control\": on"}]}]}"#,
        );
        assert!(!a.marked);
    }

    #[test]
    fn chat_holds_its_system_message_in_the_head() {
        let a = anatomy(
            Shape::Chat,
            r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u"}],"prompt_cache_key":"k"}"#,
        );
        assert_eq!(a.elements.len(), 2);
        assert_eq!(a.elements[1].role, Role::User);
        assert!(a.has_cache_key);
        let other = anatomy(
            Shape::Chat,
            r#"{"messages":[{"role":"system","content":"s2"},{"role":"user","content":"u"}]}"#,
        );
        assert_ne!(a.elements[0].hash, other.elements[0].hash);
        assert_eq!(a.elements[1].hash, other.elements[1].hash);
    }

    #[test]
    fn responses_string_input_and_chains() {
        let a = anatomy(
            Shape::Responses,
            r#"{"instructions":"i","input":"hello","previous_response_id":"r1"}"#,
        );
        assert_eq!(a.elements.len(), 2);
        assert!(a.chained);
        let b = anatomy(
            Shape::Responses,
            r#"{"input":[{"role":"user","content":[{"type":"input_text","text":"hello"}]}],"previous_response_id":null}"#,
        );
        assert!(!b.chained);
        assert_eq!(b.elements[1].blocks[0].kind, BlockKind::Text);
    }

    #[test]
    fn base64_counts_as_an_image_not_as_text() {
        let b64 = "A".repeat(100_000);
        for block in [
            format!(r#"{{"type":"image","source":{{"type":"base64","data":"{b64}"}}}}"#),
            format!(r#"{{"type":"image","source":{{"data" : "{b64}"}}}}"#),
            format!(
                r#"{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{b64}"}}}}"#
            ),
        ] {
            let body = format!(r#"{{"messages":[{{"role":"user","content":[{block}]}}]}}"#);
            let t = anatomy(Shape::Chat, &body).elements[0].tokens;
            assert!(
                (IMAGE_TOKENS..IMAGE_TOKENS + 30).contains(&t),
                "{t}: {}",
                &block[..40]
            );
        }
        // A short one is text; so is a long text that is not a file.
        let short = anatomy(
            Shape::Messages,
            r#"{"messages":[{"role":"user","content":[{"type":"image","source":{"data":"abcd"}}]}]}"#,
        );
        assert!(short.elements[1].tokens < 20);
        let text = format!(
            r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
            "a".repeat(4000)
        );
        assert!((1000..1020).contains(&anatomy(Shape::Messages, &text).elements[1].tokens));
    }

    #[test]
    fn empty_text_cannot_be_marked() {
        let a = anatomy(
            Shape::Messages,
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":" "},{"type":"text"}]},{"role":"user","content":""}]}"#,
        );
        assert!(
            a.elements[1]
                .blocks
                .iter()
                .all(|b| b.kind == BlockKind::EmptyText)
        );
        assert_eq!(a.elements[2].blocks[0].kind, BlockKind::EmptyText);
    }

    #[test]
    fn not_an_object_is_none() {
        assert!(Anatomy::of(Shape::Chat, b"[1]").is_none());
        assert!(Anatomy::of(Shape::Chat, b"{\"messages\":").is_none());
    }
}
