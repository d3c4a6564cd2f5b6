//! A request as a provider's prompt cache sees it: a list of *elements* —
//! the head (the tools and the system prompt) and then each message — each
//! hashed as the provider reads it (cache markers left out, whitespace
//! between tokens left out, a string content read as its one text block),
//! with an estimate of its tokens and the content blocks it holds (their
//! byte ranges, for placing breakpoints; their markers, for knowing where
//! the provider may read).
//!
//! Element 0 is the head. In Messages and Responses, whose system prompt
//! stands apart (`system`, `instructions`), element k ≥ 1 is message k − 1;
//! in Chat the system prompt is a message, so the head is the tools with
//! `messages[0]` and element k is `messages[k]`. Either way "message 0" is
//! where the system prompt is.
//!
//! One borrowed pass over the body ([`crate::transform::json`]); a block
//! that carries a marker is walked once more to cut it out of the hash. A
//! body with more than [`MAX_ITEMS`] messages and blocks is not read (no
//! request of a real agent comes near; a hostile one would make visor
//! allocate for each).

use std::ops::Range;

use xxhash_rust::xxh3::Xxh3;

use crate::api::Shape;
use crate::transform::json::{Cursor, Kind, Malformed, Result, Str};

/// Text is taken at 4 bytes a token (as the key limits count it).
pub const BYTES_PER_TOKEN: u64 = crate::limits::BYTES_PER_TOKEN;
/// An image (its bytes are not text) is taken at 765 tokens.
pub const IMAGE_TOKENS: u64 = 765;
/// A base64 string (a `data` field, a data URL) at least this long is a
/// file's bytes, not text.
const BASE64_RUN: usize = 512;
/// Messages and blocks one request may have for its cache to be followed.
pub const MAX_ITEMS: usize = 100_000;

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
    /// Not an object (a number, `null`, a bare string in an array): no
    /// marker can go on it.
    Value,
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
    /// Written with whitespace between its tokens.
    pub spaced: bool,
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
    /// Of what the provider reads of it.
    pub hash: u64,
    pub tokens: u64,
    pub role: Role,
    pub blocks: Vec<Block>,
}

/// A request, element by element.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Anatomy {
    pub elements: Vec<Element>,
    /// Some block (or tool, or the request itself) carries `cache_control`:
    /// the client's own markers (the request is then left as it came).
    pub marked: bool,
    /// The request declares tools.
    pub tools: usize,
    /// A Responses request that continues a stored response
    /// (`previous_response_id`): its messages are not the conversation's.
    pub chained: bool,
    /// The body has a `prompt_cache_key` field of its own (even `null`).
    pub has_cache_key: bool,
    /// The hash of the first user message (the head's when there is none),
    /// naming the conversation.
    pub first_user: u64,
    /// Where the body's top-level object starts (`{`), for inserting a
    /// field.
    pub open: usize,
    /// What was read up to the end of the last message (when the messages
    /// are a list of at least one): what [`Anatomy::into_prefix`] keeps.
    at_end: Option<Marks>,
}

/// The reading as it stood at the end of the last message.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Marks {
    shape: Shape,
    end: usize,
    top: Top,
    budget: usize,
    /// Chat's first message, which the head holds.
    first: Option<Element>,
}

/// What reading a body found up to the end of its last message: enough to
/// read a later body of the conversation, which begins with the same bytes
/// up to there, from that point on ([`Anatomy::of_from`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prefix {
    marks: Marks,
    open: usize,
    /// The messages in order; in Messages and Responses, first a place for
    /// the head.
    list: Vec<Element>,
}

impl Prefix {
    /// Where its messages end in the body it was read from.
    pub fn end(&self) -> usize {
        self.marks.end
    }

    /// About how much memory it holds, in bytes.
    pub fn size(&self) -> usize {
        use std::mem::size_of;
        let blocks = |e: &Element| e.blocks.capacity() * size_of::<Block>();
        let top = &self.marks.top;
        size_of::<Prefix>()
            + (top.tools.capacity() + top.system.capacity()) * size_of::<Block>()
            + self.marks.first.as_ref().map_or(0, blocks)
            + self.list.capacity() * size_of::<Element>()
            + self.list.iter().map(blocks).sum::<usize>()
    }
}

impl Anatomy {
    /// The request's elements; `None` for a body that is not the object
    /// its API expects, or one with more than [`MAX_ITEMS`] messages and
    /// blocks.
    pub fn of(shape: Shape, body: &[u8]) -> Option<Anatomy> {
        let mut c = Cursor::new(body);
        if c.kind().ok()? != Kind::Object {
            return None;
        }
        let mut r = Reading::new(shape);
        let whole = c.object(|c, key| r.member(c, &key)).ok()?;
        r.open = whole.start;
        r.anatomy(body).ok()
    }

    /// [`Anatomy::of`] `body`, which begins with the bytes `prefix` was
    /// read from, up to its end: only what follows is read (read in full
    /// when the prefix is another API's, ends beyond the body, or what
    /// follows cannot be read on from there: a message list whose last
    /// element was a number the next body goes on writing, `12` then
    /// `123`).
    pub fn of_from(shape: Shape, body: &[u8], prefix: Prefix) -> Option<Anatomy> {
        Anatomy::read_on(shape, body, prefix).map(|(a, _)| a)
    }

    /// [`Anatomy::of_from`], and whether it did read on from the prefix
    /// (`false`: read in full).
    pub fn read_on(shape: Shape, body: &[u8], prefix: Prefix) -> Option<(Anatomy, bool)> {
        let full = || Anatomy::of(shape, body).map(|a| (a, false));
        if prefix.marks.shape != shape || prefix.marks.end > body.len() {
            return full();
        }
        let end = prefix.marks.end;
        let mut r = Reading::resumed(prefix);
        let mut c = Cursor::at(body, end);
        let read = c
            .array_rest(0, |c, _| r.message(c))
            .and_then(|()| {
                r.mark_end(r.last_end.unwrap_or(end));
                c.object_rest(|c, key| r.member(c, &key))
            })
            .and_then(|()| r.anatomy(body));
        read.ok().map(|a| (a, true)).or_else(full)
    }

    /// What this reading keeps for the conversation's next request
    /// (`None` when its messages were not a list of at least one).
    pub fn into_prefix(self) -> Option<Prefix> {
        let mut marks = self.at_end?;
        let mut list = self.elements;
        if let Some(first) = marks.first.take() {
            // Chat: the head goes back to being its first message.
            *list.first_mut()? = first;
        }
        Some(Prefix {
            marks,
            open: self.open,
            list,
        })
    }

    pub fn total_tokens(&self) -> u64 {
        self.elements.iter().map(|e| e.tokens).sum()
    }

    /// The elements' hashes, in order.
    pub fn hashes(&self) -> Vec<u64> {
        self.elements.iter().map(|e| e.hash).collect()
    }
}

/// The bound on what one walk makes.
struct Budget(usize);

impl Budget {
    fn take(&mut self) -> Result<()> {
        self.0 = self.0.checked_sub(1).ok_or(Malformed)?;
        Ok(())
    }
}

/// What a request's top level holds besides its messages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Top {
    tools: Vec<Block>,
    system: Vec<Block>,
    marked: bool,
    chained: bool,
    has_cache_key: bool,
}

/// A place for the head, before the messages of Messages and Responses.
fn no_head() -> Element {
    Element {
        hash: 0,
        tokens: 0,
        role: Role::Other,
        blocks: Vec::new(),
    }
}

/// One pass over the body's top level: the tools, the system prompt and
/// the messages walked where they are; everything else skipped.
struct Reading {
    shape: Shape,
    items: &'static str,
    budget: Budget,
    top: Top,
    /// The messages; in Messages and Responses, after a place for the head.
    list: Vec<Element>,
    /// Where the last message read ends.
    last_end: Option<usize>,
    at_end: Option<Marks>,
    open: usize,
}

impl Reading {
    fn new(shape: Shape) -> Reading {
        Reading {
            shape,
            items: match shape {
                Shape::Responses => "input",
                Shape::Chat | Shape::Messages => "messages",
            },
            budget: Budget(MAX_ITEMS),
            top: Top::default(),
            list: Reading::empty(shape),
            last_end: None,
            at_end: None,
            open: 0,
        }
    }

    fn empty(shape: Shape) -> Vec<Element> {
        match shape {
            Shape::Chat => Vec::new(),
            Shape::Messages | Shape::Responses => vec![no_head()],
        }
    }

    /// Where `prefix` stopped, its messages read.
    fn resumed(prefix: Prefix) -> Reading {
        let Prefix { marks, open, list } = prefix;
        let mut r = Reading::new(marks.shape);
        r.budget = Budget(marks.budget);
        r.top = marks.top;
        r.list = list;
        r.last_end = Some(marks.end);
        r.open = open;
        r
    }

    fn member(&mut self, c: &mut Cursor<'_>, key: &Str) -> Result<()> {
        let src = c.src();
        let shape = self.shape;
        if key.is(src, "tools") && c.kind()? == Kind::Array {
            c.array(|c, _| {
                self.budget.take()?;
                self.top.tools.push(block_at(c)?);
                Ok(())
            })?;
        } else if key.is(src, "system") && shape == Shape::Messages
            || key.is(src, "instructions") && shape == Shape::Responses
        {
            self.top.system = content(c, &mut self.budget)?;
        } else if key.is(src, self.items) {
            self.messages(c)?;
        } else {
            let at = c.skip()?;
            if key.is(src, "cache_control") {
                self.top.marked = true;
            } else if key.is(src, "previous_response_id") {
                self.top.chained = &src[at] != b"null";
            } else if key.is(src, "prompt_cache_key") {
                self.top.has_cache_key = true;
            }
        }
        Ok(())
    }

    /// The messages (or Responses input): an array of them, or a string
    /// that is one user message.
    fn messages(&mut self, c: &mut Cursor<'_>) -> Result<()> {
        let body = c.src();
        self.list = Reading::empty(self.shape);
        self.last_end = None;
        self.at_end = None;
        match c.kind()? {
            Kind::String => {
                let s = c.string()?;
                let block = text_block(body, &s);
                let mut h = Xxh3::new();
                hash_block(&mut h, body, &block)?;
                self.list.push(Element {
                    hash: h.digest(),
                    tokens: block.tokens,
                    role: Role::User,
                    blocks: vec![block],
                });
            }
            Kind::Array => {
                c.array(|c, _| self.message(c))?;
                if let Some(end) = self.last_end {
                    self.mark_end(end);
                }
            }
            _ => {
                c.skip()?;
            }
        }
        Ok(())
    }

    fn message(&mut self, c: &mut Cursor<'_>) -> Result<()> {
        self.budget.take()?;
        let (element, end) = message(c, &mut self.budget)?;
        self.list.push(element);
        self.last_end = Some(end);
        Ok(())
    }

    /// The reading as it stands at the end of the last message, `end`.
    fn mark_end(&mut self, end: usize) {
        self.at_end = Some(Marks {
            shape: self.shape,
            end,
            top: self.top.clone(),
            budget: self.budget.0,
            first: None,
        });
    }

    /// The head made (Chat's with its first message), and the elements.
    fn anatomy(self, body: &[u8]) -> Result<Anatomy> {
        let Reading {
            shape,
            top,
            mut list,
            mut at_end,
            open,
            ..
        } = self;
        let messages = match shape {
            Shape::Chat => &list[..],
            Shape::Messages | Shape::Responses => list.get(1..).unwrap_or_default(),
        };
        let mut a = Anatomy {
            marked: top.marked
                || top.tools.iter().chain(&top.system).any(|b| b.marked)
                || messages.iter().any(|m| m.blocks.iter().any(|b| b.marked)),
            chained: top.chained,
            has_cache_key: top.has_cache_key,
            tools: top.tools.len(),
            open,
            // Before Chat's first message joins the head.
            first_user: messages
                .iter()
                .find(|m| m.role == Role::User)
                .map_or(0, |m| m.hash),
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
            hash_block(&mut h, body, b)?;
            head.tokens += b.tokens;
        }
        match (shape, list.first_mut()) {
            // Chat's system prompt is its first message: the head holds it.
            (Shape::Chat, Some(first)) => {
                h.update(&first.hash.to_le_bytes());
                head.tokens += first.tokens;
                match at_end {
                    // Kept whole for the next request.
                    Some(_) => head.blocks.extend(first.blocks.iter().cloned()),
                    None => head.blocks.append(&mut first.blocks),
                }
                head.hash = h.digest();
                let first = std::mem::replace(first, head);
                if let Some(m) = at_end.as_mut() {
                    m.first = Some(first);
                }
            }
            (Shape::Chat, None) => {
                head.hash = h.digest();
                list.push(head);
            }
            (_, first) => {
                head.hash = h.digest();
                match first {
                    Some(place) => *place = head,
                    None => list.push(head),
                }
            }
        }
        if a.first_user == 0 {
            a.first_user = list[0].hash;
        }
        a.elements = list;
        a.at_end = at_end;
        Ok(a)
    }
}

/// One message (or Responses item): its role, its content's blocks, its
/// tokens, and its hash as the provider reads it; and where it ends.
fn message(c: &mut Cursor<'_>, budget: &mut Budget) -> Result<(Element, usize)> {
    let body = c.src();
    if c.kind()? != Kind::Object {
        let before = c.spaces();
        let r = c.skip()?;
        let mut h = Xxh3::new();
        feed(&mut h, body, r.clone(), &[], c.spaces() != before);
        let element = Element {
            hash: h.digest(),
            tokens: r.len() as u64 / BYTES_PER_TOKEN,
            role: Role::Other,
            blocks: Vec::new(),
        };
        return Ok((element, r.end));
    }
    let mut role = Role::Other;
    let mut blocks = Vec::new();
    // Media and markers outside the content (a Responses item's own image
    // fields, a tool call's arguments).
    let mut rest = Found::default();
    let spaces = c.spaces();
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
            blocks = content(c, budget)?;
        } else if key.is(src, "cache_control") {
            rest.marked = true;
            c.skip()?;
        } else {
            walk(c, is_data_key(src, &key), 1, &mut rest, false)?;
        }
        Ok(())
    })?;
    let in_blocks: usize = blocks.iter().map(|b| b.range.len()).sum();
    let tokens = blocks.iter().map(|b| b.tokens).sum::<u64>()
        + rest.tokens(range.len().saturating_sub(in_blocks));
    let marked = rest.marked || blocks.iter().any(|b| b.marked);
    let cuts = match marked {
        true => markers(body, range.clone())?,
        false => Vec::new(),
    };
    let spaced = c.spaces() != spaces;
    let mut h = Xxh3::new();
    match blocks.first() {
        // The content was a string (its one block).
        Some(b) if b.string => {
            let at = b.range.clone();
            feed(&mut h, body, range.start..at.start, &cuts, spaced);
            h.update(b"[");
            h.update(TEXT_OPEN);
            feed(&mut h, body, at.clone(), &cuts, false);
            h.update(TEXT_CLOSE);
            h.update(b"]");
            feed(&mut h, body, at.end..range.end, &cuts, spaced);
        }
        _ => feed(&mut h, body, range.clone(), &cuts, spaced),
    }
    let element = Element {
        hash: h.digest(),
        tokens,
        role,
        blocks: mark_last(blocks, rest.marked),
    };
    Ok((element, range.end))
}

/// A string content is hashed as the one text block it stands for.
const TEXT_OPEN: &[u8] = br#"{"type":"text","text":"#;
const TEXT_CLOSE: &[u8] = b"}";

/// A marker on the message itself marks its last block.
fn mark_last(mut blocks: Vec<Block>, marked: bool) -> Vec<Block> {
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
fn content(c: &mut Cursor<'_>, budget: &mut Budget) -> Result<Vec<Block>> {
    let body = c.src();
    match c.kind()? {
        Kind::String => {
            let s = c.string()?;
            Ok(vec![text_block(body, &s)])
        }
        Kind::Array => {
            let mut blocks = Vec::new();
            c.array(|c, _| {
                budget.take()?;
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

fn text_block(body: &[u8], s: &Str) -> Block {
    let kind = match blank(s.raw(body)) {
        true => BlockKind::EmptyText,
        false => BlockKind::Text,
    };
    Block {
        tokens: s.raw(body).len() as u64 / BYTES_PER_TOKEN,
        range: s.range.clone(),
        string: true,
        kind,
        marked: false,
        spaced: false,
    }
}

/// A string's raw contents hold only whitespace (written or escaped).
fn blank(raw: &[u8]) -> bool {
    let mut i = 0;
    while i < raw.len() {
        match raw[i] {
            b' ' | b'\t' | b'\n' | b'\r' => i += 1,
            b'\\' if matches!(raw.get(i + 1), Some(b'n' | b't' | b'r')) => i += 2,
            _ => return false,
        }
    }
    true
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
fn is_data_key(src: &[u8], key: &Str) -> bool {
    key.is(src, "data") || key.is(src, "file_data")
}

/// Walks the value at the cursor: long base64 strings (a `data` field, or a
/// data URL) are media. `blocks`: an object here is a content block (or an
/// array here holds them), whose `cache_control` is a marker; a key of that
/// name anywhere else (a tool's schema, a tool call's input) is not.
fn walk(
    c: &mut Cursor<'_>,
    data: bool,
    depth: usize,
    f: &mut Found,
    blocks: bool,
) -> Result<Range<usize>> {
    if depth > WALK_DEPTH {
        return c.skip();
    }
    match c.kind()? {
        Kind::Object => c.object(|c, key| {
            let src = c.src();
            if blocks && key.is(src, "cache_control") {
                f.marked = true;
                c.skip()?;
                return Ok(());
            }
            let nested = blocks && key.is(src, "content");
            walk(c, is_data_key(src, &key), depth + 1, f, nested).map(drop)
        }),
        Kind::Array => c.array(|c, _| walk(c, false, depth + 1, f, blocks).map(drop)),
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
        let spaces = c.spaces();
        let r = walk(c, false, 1, &mut found, false)?;
        return Ok(Block {
            tokens: found.tokens(r.len()),
            range: r,
            string: false,
            kind: BlockKind::Value,
            marked: false,
            spaced: c.spaces() != spaces,
        });
    }
    let mut kind = BlockKind::Other;
    let mut found = Found::default();
    let mut text_empty = None;
    let spaces = c.spaces();
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
            text_empty = Some(blank(s.raw(src)));
        } else {
            // A tool result's own blocks may carry markers.
            let nested = key.is(src, "content");
            walk(c, is_data_key(src, &key), 1, &mut found, nested)?;
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
        spaced: c.spaces() != spaces,
    })
}

/// Feeds a head block to `h`: a string as the text block it stands for,
/// an object without its markers.
fn hash_block(h: &mut Xxh3, body: &[u8], b: &Block) -> Result<()> {
    match (b.string, b.marked) {
        (true, _) => {
            h.update(TEXT_OPEN);
            feed(h, body, b.range.clone(), &[], false);
            h.update(TEXT_CLOSE);
        }
        (false, false) => feed(h, body, b.range.clone(), &[], b.spaced),
        (false, true) => {
            let cuts = markers(body, b.range.clone())?;
            feed(h, body, b.range.clone(), &cuts, b.spaced);
        }
    }
    Ok(())
}

/// Feeds `src[range]` to `h` as the provider reads it: the whitespace
/// between tokens left out (a body visor rewrites goes out compact; the
/// client may have sent it pretty), each cut (a marker with its comma)
/// skipped. String literals go whole. `spaced`: false when the walk saw
/// no whitespace between tokens there (then no byte is looked at).
fn feed(h: &mut Xxh3, src: &[u8], range: Range<usize>, cuts: &[Range<usize>], spaced: bool) {
    if !spaced {
        // Compact already: the bytes between the cuts, as they are.
        let mut at = range.start;
        for c in cuts {
            if c.end <= at || c.start >= range.end {
                continue;
            }
            h.update(&src[at..c.start.max(at)]);
            at = c.end;
        }
        h.update(&src[at.min(range.end)..range.end]);
        return;
    }
    let end = range.end;
    let mut pos = range.start;
    let mut run = pos;
    let mut cuts = cuts.iter().peekable();
    while pos < end {
        if let Some(cut) = cuts.peek()
            && pos >= cut.start
        {
            h.update(&src[run..pos]);
            pos = pos.max(cut.end);
            run = pos;
            cuts.next();
            continue;
        }
        match src[pos] {
            b'"' => {
                let mut i = pos + 1;
                pos = loop {
                    match memchr::memchr2(b'"', b'\\', &src[i.min(end)..end]) {
                        None => break end,
                        Some(k) if src[i + k] == b'\\' => i += k + 2,
                        Some(k) => break i + k + 1,
                    }
                };
            }
            b' ' | b'\t' | b'\n' | b'\r' => {
                h.update(&src[run..pos]);
                pos += 1;
                run = pos;
            }
            _ => pos += 1,
        }
    }
    h.update(&src[run..end.max(run)]);
}

/// The ranges to cut from the value at `range` to leave out its markers:
/// each block-level `"cache_control": …` member with one comma beside it,
/// in order, never overlapping.
fn markers(body: &[u8], range: Range<usize>) -> Result<Vec<Range<usize>>> {
    let mut cut = Vec::new();
    markers_in(&mut Cursor::at(body, range.start), &mut cut, 0, true)?;
    // A key repeated: its cuts may touch; keep each after the one before.
    let mut at = 0;
    cut.retain_mut(|r| {
        r.start = r.start.max(at);
        at = r.end.max(at);
        r.start < r.end
    });
    Ok(cut)
}

/// How deep [`markers_in`] looks.
const MARKER_DEPTH: usize = 32;

fn markers_in(
    c: &mut Cursor<'_>,
    cut: &mut Vec<Range<usize>>,
    depth: usize,
    blocks: bool,
) -> Result<()> {
    if depth > MARKER_DEPTH {
        c.skip()?;
        return Ok(());
    }
    match c.kind()? {
        Kind::Object => {
            c.object(|c, key| {
                let src = c.src();
                if !(blocks && key.is(src, "cache_control")) {
                    let nested = blocks && key.is(src, "content");
                    return markers_in(c, cut, depth + 1, nested);
                }
                let value = c.skip()?;
                cut.push(member(src, key.range.start, value.end));
                Ok(())
            })?;
        }
        Kind::Array => {
            c.array(|c, _| markers_in(c, cut, depth + 1, blocks))?;
        }
        Kind::String | Kind::Other => {
            c.skip()?;
        }
    }
    Ok(())
}

/// The member from `key` to `end` with the comma before it (or, for an
/// object's first member, the one after it).
fn member(src: &[u8], key: usize, end: usize) -> Range<usize> {
    let before = src[..key].iter().rposition(|b| !b.is_ascii_whitespace());
    if let Some(i) = before
        && src[i] == b','
    {
        return i..end;
    }
    let next = src[end..]
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .map(|k| end + k);
    match next {
        Some(k) if src[k] == b',' => key..k + 1,
        _ => key..end,
    }
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

    fn unmarked_hash(raw: &[u8]) -> u64 {
        let cuts = markers(raw, 0..raw.len()).unwrap();
        let mut h = Xxh3::new();
        feed(&mut h, raw, 0..raw.len(), &cuts, true);
        h.digest()
    }

    #[test]
    fn a_marker_of_a_block_is_cut_with_one_comma() {
        let plain = unmarked_hash(br#"{"a":1,"content":[{"c":2}]}"#);
        for marked in [
            r#"{"cache_control":{"type":"ephemeral"},"a":1,"content":[{"c":2}]}"#,
            r#"{"a":1, "cache_control" : {"type":"ephemeral","ttl":"1h"},"content":[{"c":2}]}"#,
            r#"{"a":1,"content":[{"c":2,"cache_control":{}}]}"#,
            r#"{"a":1,"content":[{"cache_control":{},"c":2}],"cache_control":{}}"#,
            r#"{ "a": 1,
                 "content": [ { "c": 2 } ] }"#,
        ] {
            assert_eq!(unmarked_hash(marked.as_bytes()), plain, "{marked}");
        }
        assert_eq!(
            unmarked_hash(br#"{"cache_control":{}}"#),
            xxhash_rust::xxh3::xxh3_64(b"{}")
        );
        // A key of that name in a tool's schema is the schema's.
        assert_ne!(
            unmarked_hash(br#"{"input":{"cache_control":1}}"#),
            unmarked_hash(br#"{"input":{}}"#)
        );
    }

    #[test]
    fn a_repeated_marker_key_is_no_panic() {
        for body in [
            r#"{"messages":[{"cache_control":{},"cache_control":{},"role":"user","content":"hi"}]}"#,
            r#"{"messages":[{"role":"user","content":[{"cache_control":{},"cache_control":{},"type":"text","text":"x"}]}]}"#,
        ] {
            let a = anatomy(Shape::Chat, body);
            assert!(a.marked);
        }
    }

    #[test]
    fn what_the_provider_reads_the_same_hashes_the_same() {
        let compact = anatomy(
            Shape::Messages,
            r#"{"system":"s","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"text","text":"yo"}]}]}"#,
        );
        let other = anatomy(
            Shape::Messages,
            r#"{ "system": [ {"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}} ],
                 "messages": [ {"role": "user", "content": [{"type":"text","text":"hi","cache_control":{"type":"ephemeral"}}]},
                               {"role": "assistant", "content": "yo"} ] }"#,
        );
        assert_eq!(compact.hashes(), other.hashes());
        // Inside strings, spaces count.
        let spaced = anatomy(
            Shape::Messages,
            r#"{"system":"s","messages":[{"role":"user","content":"h i"}]}"#,
        );
        assert_ne!(spaced.elements[1].hash, compact.elements[1].hash);
    }

    #[test]
    fn a_chat_without_a_system_message_keeps_its_first_user_message() {
        let one = anatomy(
            Shape::Chat,
            r#"{"messages":[{"role":"user","content":"u1"}]}"#,
        );
        let three = anatomy(
            Shape::Chat,
            r#"{"messages":[{"role":"user","content":"u1"},{"role":"assistant","content":"a"},{"role":"user","content":"u2"}]}"#,
        );
        assert_eq!(one.first_user, three.first_user);
        assert_eq!(one.elements[0].hash, three.elements[0].hash);
    }

    #[test]
    fn blocks_that_are_not_objects_take_no_marker() {
        let a = anatomy(
            Shape::Messages,
            r#"{"system":["text"],"messages":[{"role":"user","content":[1,null,"x",[]]}]}"#,
        );
        assert!(
            a.elements
                .iter()
                .flat_map(|e| &e.blocks)
                .all(|b| !b.kind.markable())
        );
    }

    #[test]
    fn a_null_key_is_the_clients_and_escaped_blanks_are_blank() {
        let a = anatomy(Shape::Chat, r#"{"prompt_cache_key":null,"messages":[]}"#);
        assert!(a.has_cache_key);
        let b = anatomy(
            Shape::Messages,
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"\n \t"}]}]}"#,
        );
        assert_eq!(b.elements[1].blocks[0].kind, BlockKind::EmptyText);
    }

    #[test]
    fn too_many_messages_are_not_followed() {
        let many = format!(r#"{{"messages":[{}0]}}"#, "0,".repeat(MAX_ITEMS));
        assert!(Anatomy::of(Shape::Chat, many.as_bytes()).is_none());
        let enough = format!(r#"{{"messages":[{}0]}}"#, "0,".repeat(1000));
        assert!(Anatomy::of(Shape::Chat, enough.as_bytes()).is_some());
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

    /// A message of a generated conversation: `k` picks its kind.
    fn message_text(shape: Shape, k: u8, i: usize) -> String {
        let spaced = if k.is_multiple_of(7) { " " } else { "" };
        match (shape, k % 6) {
            (_, 0) => format!(r#"{{"role":"user","content":"task {i}: \"fix\" it\n"}}"#),
            (Shape::Responses, 1) => {
                format!(
                    r#"{{"type":"function_call","call_id":"c{i}","name":"sh","arguments":"{{}}"}}"#
                )
            }
            (Shape::Responses, 2) => {
                format!(r#"{{"type":"function_call_output","call_id":"c{i}","output":"out {i}"}}"#)
            }
            (Shape::Chat, 1) => format!(
                r#"{{"role":"assistant","content":null,"tool_calls":[{{"id":"c{i}","type":"function","function":{{"name":"sh","arguments":"{{}}"}}}}]}}"#
            ),
            (Shape::Chat, 2) => {
                format!(r#"{{"role":"tool","tool_call_id":"c{i}","content":"line {i}\n"}}"#)
            }
            (_, 1) => format!(
                r#"{{"role":"assistant","content":[{{"type":"thinking","thinking":"t"}},{{"type":"text","text":"calling"}},{{"type":"tool_use","id":"c{i}","name":"sh","input":{{}}}}]}}"#
            ),
            (_, 2) => format!(
                r#"{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"c{i}","content":[{{"type":"text","text":"out {i}"}}]}}]}}"#
            ),
            (_, 3) => format!(
                r#"{{"role":"user",{spaced}"content":[{{"type":"text","text":"marked {i}","cache_control":{{"type":"ephemeral"}}}}]}}"#
            ),
            (_, 4) => r#"{"role":"assistant","content":"   "}"#.to_owned(),
            _ => {
                format!(r#"{{ "role": "system", "content": [ {{"type":"text","text":"s{i}"}} ] }}"#)
            }
        }
    }

    /// A body of `shape` with `messages`, other members before and after.
    fn conversation_body(shape: Shape, messages: &[String], before: u8, after: u8) -> String {
        let tools = r#""tools":[{"name":"sh","input_schema":{"cache_control":1}}]"#;
        let system = match shape {
            Shape::Messages => r#""system":[{"type":"text","text":"be brief"}]"#,
            Shape::Responses => r#""instructions":"be brief""#,
            Shape::Chat => r#""temperature":0"#,
        };
        let key = match shape {
            Shape::Responses => "input",
            _ => "messages",
        };
        let mut head = vec![r#""model":"m""#.to_owned()];
        if before & 1 == 1 {
            head.push(tools.to_owned());
        }
        if before & 2 == 2 {
            head.push(system.to_owned());
        }
        let mut tail = Vec::new();
        if before & 1 == 0 {
            tail.push(tools.to_owned());
        }
        if before & 2 == 0 {
            tail.push(system.to_owned());
        }
        match after % 4 {
            0 => tail.push(r#""prompt_cache_key":"k""#.to_owned()),
            1 => tail.push(r#""cache_control":{"type":"ephemeral"}"#.to_owned()),
            2 => tail.push(r#""previous_response_id":null"#.to_owned()),
            _ => {}
        }
        head.push(format!("\"{key}\": [\n{}\n]", messages.join(",\n")));
        head.extend(tail);
        format!("{{{}}}", head.join(", "))
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]
        /// Each turn read from where the turn before's messages ended (its
        /// prefix from a continued reading too) is the turn read in full,
        /// whatever follows the messages, in each API.
        #[test]
        fn a_reading_continued_is_the_reading_in_full(
            shape in proptest::sample::select(vec![Shape::Chat, Shape::Messages, Shape::Responses]),
            kinds in proptest::collection::vec(0u8..42, 1..14),
            before in 0u8..4,
            turns in proptest::collection::vec((1usize..4, 0u8..8), 1..6),
        ) {
            let mut messages: Vec<String> = Vec::new();
            let mut prefix: Option<Prefix> = None;
            let mut k = kinds.iter().cycle();
            for (i, &(added, after)) in turns.iter().enumerate() {
                for _ in 0..added {
                    let n = messages.len();
                    messages.push(message_text(shape, *k.next().unwrap(), n));
                }
                // The members before the messages stay; those after change.
                let body = conversation_body(shape, &messages, before, after);
                let full = Anatomy::of(shape, body.as_bytes());
                let continued = match prefix.take() {
                    Some(p) => Anatomy::of_from(shape, body.as_bytes(), p),
                    None => Anatomy::of(shape, body.as_bytes()),
                };
                proptest::prop_assert_eq!(&continued, &full, "turn {}: {}", i, body);
                let full = full.unwrap();
                proptest::prop_assert_eq!(
                    full.at_end.as_ref().map(|m| m.end),
                    body.rfind("}\n]").map(|e| e + 1)
                );
                prefix = continued.and_then(Anatomy::into_prefix);
            }
        }
    }

    #[test]
    fn a_prefix_of_another_api_or_past_the_body_reads_in_full() {
        let messages = vec![message_text(Shape::Chat, 0, 0)];
        let body = conversation_body(Shape::Chat, &messages, 3, 0);
        let prefix = Anatomy::of(Shape::Chat, body.as_bytes())
            .unwrap()
            .into_prefix()
            .unwrap();
        let other = conversation_body(Shape::Messages, &messages, 3, 0);
        assert_eq!(
            Anatomy::of_from(Shape::Messages, other.as_bytes(), prefix.clone()),
            Anatomy::of(Shape::Messages, other.as_bytes())
        );
        assert_eq!(
            Anatomy::of_from(
                Shape::Chat,
                &body.as_bytes()[..prefix.end() - 1],
                prefix.clone()
            ),
            None
        );
        assert!(prefix.size() > std::mem::size_of::<Prefix>());
        // No list of messages: nothing to continue from.
        let string = r#"{"input":"hi"}"#;
        assert!(
            Anatomy::of(Shape::Responses, string.as_bytes())
                .unwrap()
                .into_prefix()
                .is_none()
        );
    }

    /// What a Chat body's reading keeps for the next request.
    fn chat_prefix(body: &str) -> Prefix {
        Anatomy::of(Shape::Chat, body.as_bytes())
            .unwrap()
            .into_prefix()
            .unwrap()
    }

    #[test]
    fn a_prefix_that_cannot_be_read_on_reads_in_full() {
        // The list's last element a number the next body writes on: the
        // bytes up to the prefix's end are the same, and only a full
        // reading sees the message list as it is.
        let first = r#"{"model":"m","messages":[{"role":"user","content":"hi"},12]}"#;
        let prefix = chat_prefix(first);
        let next = r#"{"model":"m","messages":[{"role":"user","content":"hi"},123,{"role":"user","content":"x"}]}"#;
        assert_eq!(
            &next.as_bytes()[..prefix.end()],
            &first.as_bytes()[..prefix.end()]
        );
        let full = Anatomy::of(Shape::Chat, next.as_bytes());
        assert!(full.is_some());
        assert_eq!(
            Anatomy::of_from(Shape::Chat, next.as_bytes(), prefix.clone()),
            full
        );
        // Said as read in full (counted so), where a body that goes on
        // after an object is read on.
        let read = Anatomy::read_on(Shape::Chat, next.as_bytes(), prefix);
        assert_eq!(read.map(|(_, on)| on), Some(false));
        let prefix = chat_prefix(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#);
        let on = r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"user","content":"x"}]}"#;
        let read = Anatomy::read_on(Shape::Chat, on.as_bytes(), prefix);
        assert_eq!(read.map(|(_, on)| on), Some(true));
    }

    #[test]
    fn the_bound_holds_across_a_continued_reading() {
        let body = |n: usize| format!(r#"{{"messages":[{}0]}}"#, "0,".repeat(n));
        let half = body(MAX_ITEMS / 2);
        let prefix = Anatomy::of(Shape::Chat, half.as_bytes())
            .unwrap()
            .into_prefix()
            .unwrap();
        let over = body(MAX_ITEMS);
        assert!(Anatomy::of_from(Shape::Chat, over.as_bytes(), prefix).is_none());
    }
}
