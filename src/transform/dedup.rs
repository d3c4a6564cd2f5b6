//! Context dedup by repeated blocks. Each user or tool message (each
//! Anthropic `tool_result` block) is read once, in request order, against
//! the messages before it as they are sent:
//!
//! - a whole tool result (or user message) identical to an earlier one
//!   becomes a reference to it, followed by its status lines:
//!   `[omitted: same as message 7 (call_abc)]`;
//! - a run of consecutive lines that appears, in the same order, in one
//!   earlier message is replaced by a note naming where:
//!   `[omitted: message 7 lines 5-16]` — when the run has at least
//!   `min_lines` lines and `min_bytes` bytes. Lines inside a run may be of
//!   any length (`}` and blank lines go with their block); a single
//!   repeated line stays. A run may chain stretches of several earlier
//!   messages (each at least [`SEGMENT_MIN_BYTES`]); the note names each,
//!   and a row at the same lines of evenly spaced messages once (see
//!   [`run_note`]). A note never points into its own message, but for a
//!   block repeated back to back (a log printing the same lines N times):
//!   one copy stays, and the note gives the count;
//! - a text that is a JSON array loses the elements that appeared in an
//!   earlier array and stays valid JSON, followed by
//!   `[3 items omitted: message 7]`.
//!
//! Every note saves at least [`NOTE_MIN_SAVING`] bytes more than its own
//! length, or is not written.
//!
//! Never changed (a rewrite that changes what the model can act on is a
//! defect, whatever it saves):
//! - system, developer and assistant messages (assistant lines count as
//!   seen), and the first user message: the task, its instructions and
//!   worked examples. Lines of the instructions (system prompt, Anthropic
//!   `system`, Responses `instructions`, first user message) are never the
//!   source of a note, and text that repeats them later (rules an agent
//!   repeats near the end on purpose) stays;
//! - status lines (see [`super::status`]): exit codes, a traceback's first
//!   and last lines, error heads, denials, timings, the harness's remarks.
//!   A run ends before one;
//! - a tool result or observation under [`SMALL_TEXT`] bytes, as a whole;
//! - visor's own notes and image texts (never seen, never removed).
//!
//! A message's rewrite depends only on itself and the messages before it
//! (as rewritten), never on what comes after, so the rewritten messages of
//! one turn are a byte-identical prefix of the next turn's. Notes name the
//! earlier message by its 1-based position in the request's message list
//! and its lines as that message is sent (notes count as one line), so a
//! model can find them. Running dedup on its own output changes nothing.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};

use serde_json::Value;

use super::json::{Cursor, is_json, quote};
use super::status;
use super::walk::{Role, Scan};

/// A tool result or observation shorter than this (its text, in bytes)
/// stays whole: a look-up costs the model more than it saves.
pub const SMALL_TEXT: usize = 256;
/// A note saves at least this many bytes more than its own length.
pub const NOTE_MIN_SAVING: usize = 128;
/// A line of the instructions that a later text repeats is kept when it
/// has at least this many bytes (not blank, not `}`), or sits next to one
/// that is.
const INSTRUCTION_LINE: usize = 16;
/// JSON array elements shorter than this (canonical JSON) are never
/// removed: `1`, `"ok"`, `null` repeat by nature.
const ITEM_MIN_CHARS: usize = 16;
/// Earlier places a line pair is looked up in, newest first: bounds the
/// work on text made of one repeated pair.
const CANDIDATES: usize = 32;
/// A run is a chain of at most this many places (a place repeated back to
/// back counts once: a block a log prints again and again), each from one
/// earlier message…
const MAX_SEGMENTS: usize = 32;
/// …and each at least this many bytes, so a note seldom costs more than
/// what it replaces (one that would is not written).
const SEGMENT_MIN_BYTES: usize = 32;
/// Messages a JSON note names at most.
const NOTE_MESSAGES: usize = 3;

/// When a run of repeated lines is worth a note.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blocks {
    /// Lines a run holds at least (2 or more: a single repeated line stays).
    pub min_lines: usize,
    /// Bytes a run holds at least (its lines and their line breaks).
    pub min_bytes: usize,
}

/// What dedup removed from one request.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Omitted {
    /// Lines removed (in runs and whole repeated results).
    pub lines: usize,
    /// JSON array elements removed.
    pub items: usize,
    /// Messages (or tool results) that carry a note.
    pub messages: usize,
    /// Runs replaced by a note.
    pub runs: usize,
    /// Whole results replaced by a reference.
    pub references: usize,
    /// Request bytes removed (JSON-encoded lengths).
    pub bytes: i64,
}

/// One message (one tool result), as it is sent after dedup.
struct Sent {
    /// 0-based position in the message list.
    message: usize,
    /// Which unit of its message this is, when the message holds several
    /// (an Anthropic message with parallel `tool_result`s, or results and
    /// text of its own): notes name it, as each unit's lines are numbered
    /// from 1 — the call's id, `text`, or `result 2`.
    label: Option<String>,
    /// The call it answers (for references).
    call_id: Option<String>,
    /// Its lines across its texts (in [`Dedup::kept`]); `None` for
    /// visor's own lines.
    lines: Vec<Option<Span>>,
    hashes: Vec<u64>,
}

/// A stretch of lines an earlier message sent: 1-based message and line.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Segment {
    message: usize,
    /// Which unit of that message, when it holds several (see [`Sent`]).
    label: Option<String>,
    line: usize,
    len: usize,
    /// How many times back to back the run repeats it (a block a log
    /// prints again and again): 1 for most.
    times: usize,
}

impl Segment {
    /// The same lines of the same message.
    fn same_place(&self, other: &Segment) -> bool {
        self.message == other.message
            && self.label == other.label
            && self.line == other.line
            && self.len == other.len
    }

    /// Lines of the run it stands for.
    fn lines(&self) -> usize {
        self.len * self.times
    }
}

/// The note that replaces a run: where each of its segments is, with a
/// row of segments that sit at the same lines of evenly spaced messages
/// (a sliding window re-fetched every turn) said once:
/// `[omitted: message 4 lines 4-25; line 2 of messages 8, 12 … 96]`,
/// and a segment repeated back to back (a block a log prints again and
/// again) said once with its count: `message 3 lines 2-4, 39 times`.
fn run_note(segments: &[Segment]) -> String {
    let lines = |s: &Segment| match s.len {
        1 => format!("line {}", s.line),
        n => format!("lines {}-{}", s.line, s.line + n - 1),
    };
    let mut parts: Vec<String> = Vec::new();
    let mut k = 0;
    while k < segments.len() {
        let s = &segments[k];
        if s.times > 1 {
            parts.push(match &s.label {
                Some(id) => format!(
                    "message {} ({id}) {}, {} times",
                    s.message,
                    lines(s),
                    s.times
                ),
                None => format!("message {} {}, {} times", s.message, lines(s), s.times),
            });
            k += 1;
            continue;
        }
        let step = segments
            .get(k + 1)
            .filter(|n| {
                n.line == s.line
                    && n.len == s.len
                    && n.message > s.message
                    && n.times == 1
                    && s.label.is_none()
                    && n.label.is_none()
            })
            .map(|n| n.message - s.message);
        let row = match step {
            Some(d) => {
                1 + segments[k + 1..]
                    .iter()
                    .enumerate()
                    .take_while(|(j, n)| {
                        n.line == s.line
                            && n.len == s.len
                            && n.times == 1
                            && n.label.is_none()
                            && n.message == s.message + d * (j + 1)
                    })
                    .count()
            }
            None => 1,
        };
        if row >= 3 {
            let last = segments[k + row - 1].message;
            let d = step.unwrap_or(1);
            parts.push(match d {
                1 => format!("{} of messages {} to {last}", lines(s), s.message),
                _ => format!(
                    "{} of messages {}, {} … {last}",
                    lines(s),
                    s.message,
                    s.message + d
                ),
            });
            k += row;
        } else {
            parts.push(match &s.label {
                Some(id) => format!("message {} ({id}) {}", s.message, lines(s)),
                None => format!("message {} {}", s.message, lines(s)),
            });
            k += 1;
        }
    }
    format!("[omitted: {}]", parts.join("; "))
}

/// Whether a line may be inside a removed run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Never,
    /// A status line: only inside a block repeated back to back.
    Status,
    /// visor's own lines, text repeating the instructions.
    Always,
}

/// One line of a rewritten text.
enum Piece<'a> {
    /// A line as it is sent.
    Line(&'a str),
    Note(String),
}

/// Maps keyed by hashes that are already keyed and random (a line's
/// SipHash with this request's [`RandomState`]): one multiply spreads them,
/// no second pass over the text.
#[derive(Default)]
struct Mixed(u64);

impl Hasher for Mixed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(23) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type Fast = BuildHasherDefault<Mixed>;

/// Where each key (a line's or a line pair's hash) was sent, newest first:
/// one list per key in one arena (no allocation per distinct line).
#[derive(Default)]
struct Places {
    /// Each key's newest place, an index into `nodes`.
    newest: HashMap<u64, u32, Fast>,
    /// Places: (text, line), and the index of the key's place before it
    /// (`u32::MAX`: none).
    nodes: Vec<(u32, u32, u32)>,
}

impl Places {
    fn push(&mut self, key: u64, text: u32, line: u32) {
        let at = u32::try_from(self.nodes.len()).unwrap_or(u32::MAX);
        let before = self.newest.insert(key, at).unwrap_or(u32::MAX);
        self.nodes.push((text, line, before));
    }

    fn reserve(&mut self, n: usize) {
        self.newest.reserve(n);
        self.nodes.reserve(n);
    }

    fn contains(&self, key: u64) -> bool {
        self.newest.contains_key(&key)
    }

    /// The key's places, newest first (`None`: never sent).
    fn newest(&self, key: u64) -> Option<impl Iterator<Item = (u32, u32)> + '_> {
        let mut next = *self.newest.get(&key)?;
        Some(std::iter::from_fn(move || {
            let &(text, line, before) = self.nodes.get(next as usize)?;
            next = before;
            Some((text, line))
        }))
    }
}

/// One key for a line pair, or for a whole text, from its lines' hashes.
fn combine(hashes: impl IntoIterator<Item = u64>) -> u64 {
    let mut h = Mixed(0x243F_6A88_85A3_08D3);
    for x in hashes {
        h.write_u64(x);
    }
    h.finish()
}

/// A text's lines and their hashes.
struct Split<'a> {
    lines: Vec<&'a str>,
    hashes: Vec<u64>,
}

/// Where a line or text dedup keeps is in [`Dedup::kept`].
#[derive(Debug, Clone, Copy)]
struct Span {
    at: usize,
    len: usize,
}

/// The text at `span` of `kept`.
fn text_of(kept: &str, span: Span) -> &str {
    kept.get(span.at..span.at + span.len).unwrap_or("")
}

/// Copies `text` to the end of `kept`: where it is.
fn keep(kept: &mut String, text: &str) -> Span {
    let at = kept.len();
    kept.push_str(text);
    Span {
        at,
        len: text.len(),
    }
}

/// What dedup knows of what was sent, in order: owned (the lines it
/// compares with are copied into `kept`), so it can be kept after the
/// request and continued by the conversation's next one (see [`State`]).
struct Dedup {
    blocks: Blocks,
    hasher: RandomState,
    /// The lines and texts the maps point into.
    kept: String,
    sent: Vec<Sent>,
    /// Consecutive line pairs of what was sent: where they start.
    pairs: Places,
    /// Lines of what was sent: where they are.
    singles: Places,
    /// Whole texts of user and tool results: which `sent` first had them.
    whole: HashMap<u64, Vec<(Span, usize)>, Fast>,
    /// Canonical JSON array elements: the message that shows them.
    items: HashMap<String, usize>,
    /// Lines of the instructions (system prompt, first user message), and
    /// their consecutive pairs: never sources, and kept where repeated.
    instruction_lines: HashSet<u64, Fast>,
    instruction_pairs: HashSet<u64, Fast>,
    /// Lines judged status or not, by hash (texts repeat: each distinct
    /// line is judged once a request).
    status: HashMap<u64, (Span, bool), Fast>,
}

/// Where a text dedup reads comes from, and where its rewrite goes.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// A text string of the request (`spot_text[s]` when images were
    /// replaced in it).
    Spot(usize),
    /// The string a Chat tool message becomes when its parts are joined
    /// (`joined[c]`): read as it is sent, so a second pass reads the same.
    Joined(usize),
    /// The text part that replaces an image, audio or document part: read,
    /// never rewritten, so that lines after it are numbered as they are
    /// sent — as a second pass, which finds it a text, numbers them.
    Replaced,
}

/// One text dedup reads, in request order.
struct Input<'b> {
    item: usize,
    /// Where it starts in the body: its order in its message.
    at: usize,
    unit: u32,
    tool: bool,
    target: Target,
    text: Option<Cow<'b, str>>,
}

/// Removes repeated blocks, whole repeated results and JSON array elements
/// from the request's texts. `replaced[i]` is the text that replaces image
/// `i` (none when it stays), `spot_text[s]` is the text of spot `s` when an
/// earlier step changed it (images replaced in it), `joined[c]` the string
/// collapsible tool message `c` becomes (its parts joined, see
/// [`Scan::joined`]); the new texts are written there. A joined message is
/// read as the one string it is sent as, never part by part, so dedup of
/// visor's own output changes nothing.
///
/// `resume`: the [`State`] an earlier request of the conversation left
/// after its first `State::items` messages, which this request begins
/// with byte for byte (the caller's key says so): those messages are not
/// read again, their rewrites are the state's. The state this request
/// leaves is returned when it can be continued: none when an earlier step
/// changed a text (images, documents or audio replaced), as their texts
/// are not part of the state.
pub fn run(
    scan: &Scan,
    body: &[u8],
    replaced: &[Option<String>],
    spot_text: &mut [Option<String>],
    joined: &mut [Option<String>],
    blocks: Blocks,
    resume: Option<State>,
) -> (Omitted, Option<State>, bool) {
    // Only texts as the client sent them are continued: a state never
    // holds a text an earlier step wrote.
    let plain = replaced.iter().all(Option::is_none)
        && joined.iter().all(Option::is_none)
        && spot_text.iter().all(Option::is_none);
    // Instructions outside the message list: Anthropic `system`,
    // Responses `instructions` (a state continues only with the same).
    let top = top_level_instructions(scan, body);
    let instructions = hash_texts(&top);
    let resume = resume.filter(|s| {
        plain
            && s.d.blocks == blocks
            && s.items <= scan.items.len()
            && s.instructions == instructions
    });
    let from = resume.as_ref().map_or(0, |s| s.items);
    let continued = resume.is_some();
    let inputs = inputs(scan, body, replaced, spot_text, joined, from);
    let call_ids: HashMap<(usize, u32), String> = scan
        .call_ids
        .iter()
        .filter_map(|(item, unit, id)| {
            let id = id.decode(body)?;
            plain_id(&id).then(|| ((*item, *unit), id.into_owned()))
        })
        .collect();
    let groups = units(&inputs);
    let request = Request::new(scan, &inputs, spot_text, &call_ids, &groups);
    // Room for about every new line at once (a line is seldom under 40
    // bytes): the maps are not grown again and again.
    let lines = inputs
        .iter()
        .map(|t| t.text.as_ref().map_or(0, |s| s.len()))
        .sum::<usize>()
        / 40;
    // (Bounded: a body of long lines holds fewer than its length says.)
    let lines = lines.min(1 << 18);
    let (mut d, mut out, mut rewrites) = match resume {
        Some(s) => (s.d, s.out, s.rewrites),
        None => {
            let mut d = Dedup::new(blocks);
            for text in &top {
                d.instruct(text);
            }
            (d, Omitted::default(), Vec::new())
        }
    };
    d.singles.reserve(lines);
    d.pairs.reserve(lines);
    d.kept.reserve(lines * 40);
    let mut new_texts: Vec<(Target, String)> = Vec::new();
    for group in &groups {
        request.read_unit(&mut d, group, &mut out, &mut new_texts);
    }
    drop(request);
    drop(inputs);
    for (target, text) in new_texts {
        match target {
            Target::Spot(s) if plain => rewrites.push((s, text)),
            Target::Spot(s) => set(spot_text, s, text),
            Target::Joined(c) => set(joined, c, text),
            Target::Replaced => {}
        }
    }
    if !plain {
        return (out, None, false);
    }
    // The rewrites of this request's texts (the state's first): kept in
    // the state and written to their spots.
    for (s, text) in &rewrites {
        set(spot_text, *s, text.clone());
    }
    let items = scan.items.len();
    (
        out,
        Some(State {
            d,
            items,
            out,
            rewrites,
            instructions,
        }),
        continued,
    )
}

/// A keyed hash of texts, in order.
fn hash_texts(texts: &[String]) -> u128 {
    let mut x = xxhash_rust::xxh3::Xxh3::with_seed(*super::SEED);
    for t in texts {
        x.update(&t.len().to_le_bytes());
        x.update(t.as_bytes());
    }
    x.digest128()
}

fn set(slots: &mut [Option<String>], at: usize, text: String) {
    if let Some(slot) = slots.get_mut(at) {
        *slot = Some(text);
    }
}

/// Dedup's reading of a request's first messages, to continue the
/// conversation's next request from: what was sent (lines, whole texts,
/// array elements, instructions), the rewrites of those messages' texts,
/// and what was removed. See [`run`].
pub struct State {
    d: Dedup,
    /// Messages read.
    items: usize,
    out: Omitted,
    /// The new text of each rewritten text string, by spot.
    rewrites: Vec<(usize, String)>,
    /// A hash of the instructions outside the message list it read.
    instructions: u128,
}

impl State {
    /// Messages it has read: a request continues it when its first
    /// `items` messages are these.
    pub fn items(&self) -> usize {
        self.items
    }

    /// Whether [`run`] will continue it for a request of `scan` read with
    /// `blocks` whose texts are the client's: the same rules and the same
    /// instructions outside the message list.
    pub fn fits(&self, scan: &Scan, body: &[u8], blocks: Blocks) -> bool {
        self.d.blocks == blocks
            && self.items <= scan.items.len()
            && self.instructions == hash_texts(&top_level_instructions(scan, body))
    }

    /// About how much memory it holds, in bytes.
    pub fn size(&self) -> usize {
        let places = |p: &Places| p.nodes.capacity() * 12 + p.newest.capacity() * 16;
        let text = |s: &Option<String>| s.as_ref().map_or(0, String::capacity);
        let sent: usize = self
            .d
            .sent
            .iter()
            .map(|s| {
                s.lines.capacity() * 24
                    + s.hashes.capacity() * 8
                    + text(&s.label)
                    + text(&s.call_id)
                    + 96
            })
            .sum();
        let whole: usize = self.d.whole.values().map(|v| v.capacity() * 24 + 24).sum();
        self.d.kept.capacity()
            + sent
            + places(&self.d.pairs)
            + places(&self.d.singles)
            + self.d.whole.capacity() * 16
            + whole
            + self.d.items.capacity() * 32
            + self.d.items.keys().map(String::capacity).sum::<usize>()
            + (self.d.instruction_lines.capacity() + self.d.instruction_pairs.capacity()) * 8
            + self.d.status.capacity() * 40
            + self
                .rewrites
                .iter()
                .map(|(_, t)| t.len() + 32)
                .sum::<usize>()
    }
}

/// The texts dedup reads, in the order they are sent: the request's text
/// strings (as an earlier step changed them), the texts that replaced its
/// parts, and each joined tool message as the one string it becomes.
fn inputs<'b>(
    scan: &'b Scan,
    body: &'b [u8],
    replaced: &'b [Option<String>],
    spot_text: &'b [Option<String>],
    joined: &'b [Option<String>],
    from: usize,
) -> Vec<Input<'b>> {
    let collapsed: HashMap<usize, usize> = joined
        .iter()
        .enumerate()
        .filter(|(_, j)| j.is_some())
        .map(|(c, _)| (scan.joined_item(c), c))
        .collect();
    let mut inputs: Vec<Input<'_>> = scan
        .texts
        .iter()
        .filter(|t| t.item >= from && !collapsed.contains_key(&t.item))
        .map(|t| Input {
            item: t.item,
            at: scan.spot_start(t.spot),
            unit: t.unit,
            tool: t.tool,
            target: Target::Spot(t.spot),
            text: match spot_text.get(t.spot).and_then(Option::as_ref) {
                Some(s) => Some(Cow::Borrowed(s.as_str())),
                None => scan.spot_decoded(t.spot, body),
            },
        })
        .collect();
    // A part replaced by a text part of its own (an image or audio: one
    // line; a document: its text) is lines of the message as it is sent,
    // read in its place so that the lines after it are numbered as a second
    // pass, which finds it a text, numbers them. Never rewritten. In a
    // joined message it is in the joined string.
    for (f, text) in scan.images.iter().zip(replaced) {
        if let (Some(text), Some(at)) = (text, f.part_start())
            && !collapsed.contains_key(&f.message)
        {
            inputs.push(Input {
                item: f.message,
                at,
                unit: f.unit,
                tool: f.in_tool_result,
                target: Target::Replaced,
                text: Some(Cow::Borrowed(text.as_str())),
            });
        }
    }
    for (&item, &c) in &collapsed {
        inputs.push(Input {
            item,
            at: 0,
            unit: 0,
            tool: true,
            target: Target::Joined(c),
            text: joined.get(c).and_then(Option::as_deref).map(Cow::Borrowed),
        });
    }
    // The texts of one message in the order they are sent.
    inputs.sort_by_key(|t| (t.item, t.at));
    inputs
}

/// What dedup reads a request's units against: their texts, who sent each
/// message, and how a note names a unit of a message that holds several.
struct Request<'r> {
    scan: &'r Scan,
    inputs: &'r [Input<'r>],
    /// The texts an earlier step changed (see [`run`]).
    spot_text: &'r [Option<String>],
    /// Plain call ids, by message and unit.
    call_ids: &'r HashMap<(usize, u32), String>,
    /// Units each message holds.
    units_of: HashMap<usize, usize>,
    /// Units of a message that answer each call id.
    id_uses: HashMap<(usize, &'r str), usize>,
    /// The first user message: the task, its instructions, worked examples
    /// (whatever it holds: a message of an image alone is it too).
    first_user: Option<usize>,
}

/// How the texts of one unit are read.
struct Reading {
    /// Its place in [`Dedup::sent`].
    me: usize,
    role: Role,
    /// The system prompt or the first user message: recorded, never
    /// rewritten.
    instruction: bool,
    /// A user or tool text that is not instructions: may be rewritten.
    eligible: bool,
    /// Under [`SMALL_TEXT`] of the client's text: stays whole.
    small: bool,
    /// Holds one text of the client's: may become a reference.
    whole: bool,
}

impl<'r> Request<'r> {
    fn new(
        scan: &'r Scan,
        inputs: &'r [Input<'r>],
        spot_text: &'r [Option<String>],
        call_ids: &'r HashMap<(usize, u32), String>,
        groups: &[Vec<usize>],
    ) -> Self {
        let mut units_of: HashMap<usize, usize> = HashMap::new();
        let mut id_uses: HashMap<(usize, &str), usize> = HashMap::new();
        for g in groups {
            if let Some(&j) = g.first() {
                *units_of.entry(inputs[j].item).or_default() += 1;
                if let Some(id) = call_ids.get(&(inputs[j].item, inputs[j].unit)) {
                    *id_uses.entry((inputs[j].item, id.as_str())).or_default() += 1;
                }
            }
        }
        Self {
            scan,
            inputs,
            spot_text,
            call_ids,
            units_of,
            id_uses,
            first_user: scan.items.iter().position(|i| i.role == Role::User),
        }
    }

    /// Reads the texts of one unit in `d`, and keeps the rewrite of each
    /// that changed (with the bytes it saves in `out`).
    fn read_unit(
        &self,
        d: &mut Dedup,
        group: &[usize],
        out: &mut Omitted,
        new_texts: &mut Vec<(Target, String)>,
    ) {
        let Some(&first) = group.first() else {
            return;
        };
        let reading = self.open(d, group, &self.inputs[first]);
        let mut changed = false;
        for &j in group {
            let input = &self.inputs[j];
            let Some(text) = input.text.as_deref() else {
                continue;
            };
            if let Some(r) = d.read(text, &reading, out)
                && !matches!(input.target, Target::Replaced)
            {
                let before = self.literal_len_before(input.target, text);
                out.bytes += before as i64 - literal_len(&r) as i64;
                changed = true;
                new_texts.push((input.target, r));
            }
        }
        out.messages += usize::from(changed);
    }

    /// Opens the unit that starts at `at` in what was sent: how its texts
    /// are read.
    fn open(&self, d: &mut Dedup, group: &[usize], at: &Input<'r>) -> Reading {
        let role = self.scan.items.get(at.item).map_or(Role::Other, |i| i.role);
        let tool = role == Role::Tool || group.iter().any(|&j| self.inputs[j].tool);
        let instruction = role == Role::System || Some(at.item) == self.first_user;
        let me = d.sent.len();
        let call_id = self.call_ids.get(&(at.item, at.unit)).cloned();
        d.sent.push(Sent {
            message: at.item,
            label: self.label(at, call_id.as_ref()),
            call_id,
            lines: Vec::new(),
            hashes: Vec::new(),
        });
        Reading {
            me,
            role,
            instruction,
            eligible: (tool || role == Role::User) && !instruction,
            small: self.client_bytes(group) < SMALL_TEXT,
            whole: self.client_texts(group) == 1,
        }
    }

    /// In a message of several units (an Anthropic message with several
    /// `tool_result` blocks, or results and text of its own) each is
    /// numbered on its own, so a note names which: the call when its id
    /// is plain and used once there, else `text` (the message's own
    /// content) or `result 2` (its place).
    fn label(&self, at: &Input<'_>, call_id: Option<&String>) -> Option<String> {
        let several = self.units_of.get(&at.item).is_some_and(|&n| n > 1);
        several.then(|| match call_id {
            Some(id) if self.id_uses.get(&(at.item, id.as_str())) == Some(&1) => id.clone(),
            _ if at.unit == 0 => "text".to_owned(),
            _ => format!("result {}", at.unit),
        })
    }

    /// A small result or observation stays whole: the client's text, not
    /// the texts visor wrote for its images, documents or notes (so that a
    /// second pass, which finds them texts, decides the same).
    fn client_bytes(&self, group: &[usize]) -> usize {
        group
            .iter()
            .filter_map(|&j| self.inputs[j].text.as_deref())
            .filter(|t| !is_document_text(t))
            .flat_map(|t| t.split('\n'))
            .filter(|l| !is_own(l))
            .map(|l| l.len() + 1)
            .sum()
    }

    /// A result may become a reference when it holds one text of the
    /// client's: the texts that replaced its images (parts on a second
    /// pass, absent on the first) do not count.
    fn client_texts(&self, group: &[usize]) -> usize {
        group
            .iter()
            .filter(|&&j| {
                self.inputs[j]
                    .text
                    .as_deref()
                    .is_some_and(|t| !is_image_text(t.trim_end()) && !is_document_text(t))
            })
            .count()
    }

    /// The JSON-encoded length of what `target` held before dedup.
    fn literal_len_before(&self, target: Target, text: &str) -> usize {
        match target {
            Target::Spot(s) => match self.spot_text.get(s).and_then(Option::as_ref) {
                Some(t) => literal_len(t),
                None => self.scan.spot_literal_len(s),
            },
            Target::Joined(_) | Target::Replaced => literal_len(text),
        }
    }
}

/// The texts of each message, unit by unit (an Anthropic message's own
/// content, then each `tool_result` block), in request order.
fn units(inputs: &[Input<'_>]) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    let mut k = 0;
    while k < inputs.len() {
        let item = inputs[k].item;
        let end = k + inputs[k..].iter().take_while(|t| t.item == item).count();
        let mut at: HashMap<u32, usize> = HashMap::new();
        for (j, input) in inputs.iter().enumerate().take(end).skip(k) {
            let slot = *at.entry(input.unit).or_insert_with(|| {
                out.push(Vec::new());
                out.len() - 1
            });
            if let Some(group) = out.get_mut(slot) {
                group.push(j);
            }
        }
        k = end;
    }
    out
}

impl Dedup {
    fn new(blocks: Blocks) -> Self {
        Dedup {
            blocks,
            hasher: RandomState::new(),
            kept: String::new(),
            sent: Vec::new(),
            pairs: Places::default(),
            singles: Places::default(),
            whole: HashMap::default(),
            items: HashMap::new(),
            instruction_lines: HashSet::default(),
            instruction_pairs: HashSet::default(),
            status: HashMap::default(),
        }
    }

    /// Reads one text of a unit: its rewrite, when dedup changes it.
    fn read(&mut self, text: &str, unit: &Reading, out: &mut Omitted) -> Option<String> {
        let me = unit.me;
        if is_document_text(text) {
            // The text visor wrote for a document is its own: counted,
            // never matched, never rewritten.
            for _ in text.split('\n') {
                self.push_note(me);
            }
            None
        } else if unit.instruction {
            self.record_instruction(me, text);
            None
        } else if !unit.eligible && unit.role != Role::Tool && unit.role != Role::User {
            // The model's own words (a proposed edit, a plan) are never
            // the source of a note: what a tool or the user says is read
            // where they said it, never rebuilt from what the model
            // proposed.
            for _ in text.split('\n') {
                self.push_note(me);
            }
            None
        } else if is_array(text) && unit.eligible {
            // A JSON array is compared by element whatever its size (a
            // small one is not rewritten), so a second pass, which may
            // find it shrunk under the small size, reads it the same.
            let (head, tail) = split_trailing_note(text);
            self.array(head, tail, me, !unit.small, out)
        } else if !unit.eligible || unit.small || is_reference(text) {
            // Sent as it is; a reference visor wrote (followed by its
            // status lines) is final.
            self.record(me, text);
            None
        } else {
            let split = self.split(text);
            match unit.whole {
                true => self.reference(text, &split, me, out),
                false => None,
            }
            .or_else(|| self.rewrite(text, split, me, out))
        }
    }

    /// A whole text identical to an earlier user or tool text: the
    /// reference that replaces it (when shorter than the text).
    fn reference(
        &mut self,
        text: &str,
        split: &Split<'_>,
        me: usize,
        out: &mut Omitted,
    ) -> Option<String> {
        // Visor's own text (a reference it wrote, followed by status
        // lines), or an array it rewrote (two arrays can lose different
        // items and read the same): never a reference.
        if is_own(text.trim_end())
            || split.lines.first().is_some_and(|l| is_note(l))
            || !split_trailing_note(text).1.is_empty()
        {
            return None;
        }
        // A text holding one of visor's image texts (a joined tool message)
        // is never a reference: the image text would go with it.
        if split.lines.iter().any(|l| is_image_text(l)) {
            return None;
        }
        let key = combine(split.hashes.iter().copied());
        let kept = &self.kept;
        let earlier = self.whole.get(&key).and_then(|same| {
            same.iter()
                .find(|(t, _)| text_of(kept, *t) == text)
                .map(|&(_, e)| e)
        });
        let Some(earlier) = earlier else {
            let span = keep(&mut self.kept, text);
            self.whole.entry(key).or_default().push((span, me));
            return None;
        };
        // Nor one that repeats the instructions: they stay where they are.
        if self
            .repeats_instructions(&split.lines, &split.hashes)
            .contains(&true)
        {
            return None;
        }
        let first = self.sent.get(earlier)?;
        let message = first.message + 1;
        let mut note = match first.label.as_ref().or(first.call_id.as_ref()) {
            Some(id) => format!("[omitted: same as message {message} ({id})]"),
            None => format!("[omitted: same as message {message}]"),
        };
        // Its status lines follow the reference: the outcome is read where
        // it happened.
        let marks = self.status_marks(&split.lines, &split.hashes, false);
        let kept: Vec<(&str, u64)> = split
            .lines
            .iter()
            .zip(&split.hashes)
            .zip(&marks)
            .filter(|(_, m)| **m)
            .map(|((l, h), _)| (*l, *h))
            .collect();
        for (l, _) in &kept {
            note.push('\n');
            note.push_str(l);
        }
        if note.len() + NOTE_MIN_SAVING > text.len() {
            return None;
        }
        out.lines += split.lines.len() - kept.len();
        out.references += 1;
        self.push_note(me);
        for (l, h) in kept {
            self.push_line(me, l, h);
        }
        Some(note)
    }

    fn split<'t>(&self, text: &'t str) -> Split<'t> {
        let lines: Vec<&'t str> = text.split('\n').collect();
        let hashes = lines.iter().map(|l| self.hasher.hash_one(*l)).collect();
        Split { lines, hashes }
    }

    /// Which of a text's lines are status lines. With `lazy`, only lines
    /// that can be in a run are judged: those an earlier text sent, or that
    /// stand earlier in this one (a block repeated back to back); each
    /// distinct line once a request.
    fn status_marks(&mut self, lines: &[&str], hashes: &[u64], lazy: bool) -> Vec<bool> {
        let mut here: HashSet<u64, Fast> = HashSet::default();
        let (singles, memo, kept) = (&self.singles, &mut self.status, &mut self.kept);
        status::mark_with(
            lines,
            |q, line| {
                let h = hashes[q];
                match memo.get(&h) {
                    Some(&(l, s)) if text_of(kept, l) == line => return s,
                    Some(_) => return status::is_status(line),
                    None => {}
                }
                let repeats = !lazy || singles.contains(h) || !here.insert(h);
                if !repeats {
                    return false;
                }
                let s = status::is_status(line);
                let span = keep(kept, lines[q]);
                memo.insert(h, (span, s));
                s
            },
            is_note,
        )
    }

    /// Indexes a text of the instructions: its lines are kept where a
    /// later text repeats them.
    fn instruct(&mut self, text: &str) {
        let mut previous: Option<u64> = None;
        for line in text.split('\n') {
            let h = self.hasher.hash_one(line);
            self.instruction_lines.insert(h);
            if let Some(p) = previous {
                self.instruction_pairs.insert(combine([p, h]));
            }
            previous = Some(h);
        }
    }

    /// Records a text of the instructions (the system prompt, the first
    /// user message): sent as it is, counted, never a source.
    fn record_instruction(&mut self, me: usize, text: &str) {
        self.instruct(text);
        for _ in text.split('\n') {
            self.push_note(me);
        }
    }

    /// Which lines of a text repeat the instructions: a line of them at
    /// least [`INSTRUCTION_LINE`] bytes long, and the short lines (blank,
    /// `}`) that sit beside such a line there too.
    fn repeats_instructions(&self, lines: &[&str], hashes: &[u64]) -> Vec<bool> {
        let mut keep: Vec<bool> = lines
            .iter()
            .zip(hashes)
            .map(|(l, h)| l.trim().len() >= INSTRUCTION_LINE && self.instruction_lines.contains(h))
            .collect();
        if !keep.contains(&true) {
            return keep;
        }
        let pair = |a: usize, b: usize| {
            self.instruction_pairs
                .contains(&combine([hashes[a], hashes[b]]))
        };
        for q in 1..lines.len() {
            if !keep[q] && keep[q - 1] && pair(q - 1, q) {
                keep[q] = true;
            }
        }
        for q in (0..lines.len().saturating_sub(1)).rev() {
            if !keep[q] && keep[q + 1] && pair(q, q + 1) {
                keep[q] = true;
            }
        }
        keep
    }

    /// Records a text that is sent as it is.
    fn record(&mut self, me: usize, text: &str) {
        let split = self.split(text);
        for (line, hash) in split.lines.into_iter().zip(split.hashes) {
            self.push_line(me, line, hash);
        }
    }

    /// Appends a line to what message `me` sent, and offers it (and the
    /// pair it ends) to every run read after it — the rest of this message
    /// included.
    fn push_line(&mut self, me: usize, line: &str, hash: u64) {
        let own = is_own(line);
        let sent = &mut self.sent[me];
        sent.lines.push((!own).then(|| keep(&mut self.kept, line)));
        sent.hashes.push(if own { 0 } else { hash });
        if own {
            return;
        }
        let at = sent.lines.len() - 1;
        let previous = at
            .checked_sub(1)
            .filter(|&p| sent.lines[p].is_some())
            .map(|p| sent.hashes[p]);
        self.singles.push(hash, me as u32, at as u32);
        if let Some(h) = previous {
            self.pairs
                .push(combine([h, hash]), me as u32, (at - 1) as u32);
        }
    }

    fn push_note(&mut self, me: usize) {
        self.sent[me].lines.push(None);
        self.sent[me].hashes.push(0);
    }

    /// Rewrites one text of a user or tool message; `None` when nothing in
    /// it repeats.
    fn rewrite(
        &mut self,
        text: &str,
        split: Split<'_>,
        me: usize,
        out: &mut Omitted,
    ) -> Option<String> {
        self.lines(text, split, me, out)
    }

    fn lines<'t>(
        &mut self,
        text: &'t str,
        split: Split<'t>,
        me: usize,
        out: &mut Omitted,
    ) -> Option<String> {
        let Split { lines, hashes } = split;
        // Lines that never join a run: visor's own and text that repeats
        // the instructions; status lines, but for a block repeated back to
        // back (the copy before the note holds them).
        let status = self.status_marks(&lines, &hashes, true);
        let instructions = self.repeats_instructions(&lines, &hashes);
        let barrier: Vec<Stop> = lines
            .iter()
            .enumerate()
            .map(|(q, l)| match (instructions[q] || is_own(l), status[q]) {
                (true, _) => Stop::Always,
                (false, true) => Stop::Status,
                (false, false) => Stop::Never,
            })
            .collect();
        let mut pieces: Vec<Piece<'t>> = Vec::with_capacity(lines.len());
        let mut i = 0;
        while i < lines.len() {
            let segments = self.chain(&lines, &hashes, &barrier, i, me);
            let len: usize = segments.iter().map(Segment::lines).sum();
            let bytes: usize = lines[i..i + len].iter().map(|l| l.len() + 1).sum();
            // The note, when the run is worth one and the note saves
            // enough (a label on each of many short stretches does not).
            let note = (len >= self.blocks.min_lines && bytes >= self.blocks.min_bytes)
                .then(|| run_note(&segments))
                .filter(|n| n.len() + 1 + NOTE_MIN_SAVING <= bytes);
            if let Some(note) = note {
                pieces.push(Piece::Note(note));
                self.push_note(me);
                out.lines += len;
                out.runs += 1;
                i += len;
                continue;
            }
            // Sent as it is: from here on a source for the rest of this
            // text too (a block repeated inside one result).
            pieces.push(Piece::Line(lines[i]));
            self.push_line(me, lines[i], hashes[i]);
            i += 1;
        }
        let changed = pieces.iter().any(|p| matches!(p, Piece::Note(_)));
        if !changed {
            return None;
        }
        let mut s = String::with_capacity(text.len());
        for (k, p) in pieces.iter().enumerate() {
            if k > 0 {
                s.push('\n');
            }
            s.push_str(match p {
                Piece::Line(l) => l,
                Piece::Note(n) => n,
            });
        }
        Some(s)
    }

    /// The repeated run starting at line `i`: a chain of segments, each the
    /// longest stretch one earlier message sent in the same order (at least
    /// [`SEGMENT_MIN_BYTES`] long), [`MAX_SEGMENTS`] places at most; a
    /// place repeated back to back is one segment with its count.
    fn chain(
        &self,
        lines: &[&str],
        hashes: &[u64],
        barrier: &[Stop],
        i: usize,
        me: usize,
    ) -> Vec<Segment> {
        let mut segments: Vec<Segment> = Vec::new();
        let mut q = i;
        while let Some(seg) = self.longest(lines, hashes, barrier, q, me, segments.last()) {
            let bytes: usize = lines[q..q + seg.len].iter().map(|l| l.len() + 1).sum();
            if bytes < SEGMENT_MIN_BYTES {
                break;
            }
            let (step, full) = (seg.len, segments.len() == MAX_SEGMENTS);
            match segments.last_mut() {
                Some(last) if last.same_place(&seg) => last.times += 1,
                _ if full => break,
                _ => segments.push(seg),
            }
            q += step;
        }
        segments
    }

    /// The longest stretch starting at line `i` that one earlier message
    /// sent in the same order. Ties go to the newest. The text's own
    /// message is a source only for a block repeated back to back: the
    /// lines just before the run (`previous`: the chain so far), and the
    /// same place again.
    fn longest(
        &self,
        lines: &[&str],
        hashes: &[u64],
        barrier: &[Stop],
        i: usize,
        me: usize,
        previous: Option<&Segment>,
    ) -> Option<Segment> {
        if i >= lines.len() || barrier[i] == Stop::Always {
            return None;
        }
        let pair = (i + 1 < lines.len() && barrier[i + 1] != Stop::Always)
            .then(|| self.pairs.newest(combine([hashes[i], hashes[i + 1]])))
            .flatten();
        let starts = match pair {
            Some(p) => p,
            None => self.singles.newest(hashes[i])?,
        };
        let mut best: Option<Segment> = None;
        for (src, at) in starts.take(CANDIDATES) {
            let (src, at) = (src as usize, at as usize);
            let sent = &self.sent[src];
            let own = sent.message == self.sent[me].message;
            if own && src != me {
                // Another unit of the same message.
                continue;
            }
            // Its own lines only as a block repeated back to back: the
            // same place as the chain's last segment, or a block ending
            // just before the run (its last line then stands again
            // `period` lines into the run). Checked before the scan, so a
            // block repeated apart costs no scan per line.
            if own {
                let ok = match previous {
                    Some(p) => at + 1 == p.line && p.label == sent.label,
                    None => {
                        let period = sent.lines.len() - at;
                        sent.hashes
                            .last()
                            .is_some_and(|&h| hashes.get(i + period - 1) == Some(&h))
                    }
                };
                if !ok {
                    continue;
                }
            }
            // A status line ends a run, but for a block this message
            // repeats back to back.
            let stops = |q: usize| match barrier[q] {
                Stop::Always => true,
                Stop::Status => !own,
                Stop::Never => false,
            };
            let mut len = 0;
            while i + len < lines.len()
                && !stops(i + len)
                && sent.hashes.get(at + len) == Some(&hashes[i + len])
                && sent
                    .lines
                    .get(at + len)
                    .copied()
                    .flatten()
                    .map(|s| text_of(&self.kept, s))
                    == Some(lines[i + len])
            {
                len += 1;
            }
            if len <= best.as_ref().map_or(0, |b| b.len) {
                continue;
            }
            let seg = Segment {
                message: sent.message + 1,
                label: sent.label.clone(),
                line: at + 1,
                len,
                times: 1,
            };
            let back_to_back = match previous {
                None => at + len == sent.lines.len(),
                Some(p) => p.same_place(&seg),
            };
            if own && !back_to_back {
                continue;
            }
            best = Some(seg);
        }
        best
    }

    /// A JSON array: elements seen in an earlier array removed, the rest
    /// kept in their layout, the note after. Arrays are compared by
    /// element, never by line: their lines are not offered to later runs.
    fn array(
        &mut self,
        json: &str,
        tail: &str,
        me: usize,
        rewrite: bool,
        out: &mut Omitted,
    ) -> Option<String> {
        let rewritten = self.items(json, tail, me, rewrite, out);
        let lines = match &rewritten {
            Some(s) => s.split('\n').count(),
            None => json.split('\n').count() + tail.split('\n').count() - 1,
        };
        for _ in 0..lines {
            self.push_note(me);
        }
        rewritten
    }

    /// The array without the elements an earlier array had, and its note;
    /// `None` when nothing goes.
    fn items(
        &mut self,
        json: &str,
        tail: &str,
        me: usize,
        rewrite: bool,
        out: &mut Omitted,
    ) -> Option<String> {
        let src = json.as_bytes();
        let mut elements = Vec::new();
        let mut c = Cursor::new(src);
        c.array(|c, _| c.skip().map(|r| elements.push(r))).ok()?;
        let message = self.sent[me].message;
        let mut kept = Vec::with_capacity(elements.len());
        let mut seen_in: Vec<usize> = Vec::new();
        for r in &elements {
            let Some(key) = json.get(r.clone()).and_then(canonical) else {
                kept.push(r.clone());
                continue;
            };
            if key.len() < ITEM_MIN_CHARS {
                kept.push(r.clone());
                continue;
            }
            match self.items.get(&key) {
                Some(&m) if m != message => {
                    if !seen_in.contains(&m) {
                        seen_in.push(m);
                    }
                }
                Some(_) => kept.push(r.clone()),
                None => {
                    self.items.insert(key, message);
                    kept.push(r.clone());
                }
            }
        }
        let removed = elements.len() - kept.len();
        let (Some(first), Some(last)) = (elements.first(), elements.last()) else {
            return None;
        };
        // A small array is read (its elements offered to later arrays),
        // never rewritten.
        if removed == 0 || !rewrite {
            return None;
        }
        let sep = match elements.get(1) {
            Some(second) => json.get(first.end..second.start).unwrap_or(", "),
            None => ", ",
        };
        let mut s = String::with_capacity(json.len());
        s.push_str(json.get(..first.start).unwrap_or("["));
        for (i, r) in kept.iter().enumerate() {
            if i > 0 {
                s.push_str(sep);
            }
            s.push_str(json.get(r.clone()).unwrap_or("null"));
        }
        s.push_str(json.get(last.end..).unwrap_or("]"));
        s.push_str(tail);
        seen_in.sort_unstable();
        s.push('\n');
        s.push_str(&items_note(removed, &seen_in));
        if s.len() + NOTE_MIN_SAVING > json.len() + tail.len() {
            return None;
        }
        out.items += removed;
        Some(s)
    }
}

/// An id safe to show in a note: short, letters, digits and `_-.:`.
fn plain_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
}

/// `[3 items omitted: message 7]`, `[1 item omitted: messages 4, 7]`.
fn items_note(removed: usize, seen_in: &[usize]) -> String {
    let items = match removed {
        1 => "1 item".to_owned(),
        n => format!("{n} items"),
    };
    let mut names: Vec<String> = seen_in
        .iter()
        .take(NOTE_MESSAGES)
        .map(|m| (m + 1).to_string())
        .collect();
    if seen_in.len() > NOTE_MESSAGES {
        names.push("…".to_owned());
    }
    let which = match seen_in.len() {
        1 => "message",
        _ => "messages",
    };
    format!("[{items} omitted: {which} {}]", names.join(", "))
}

/// A line visor wrote: a note, or the text that replaced an image (two
/// copies of one image are the image rules' business, see
/// `images.dedupe`). Never removed, never counted as seen, so dedup of
/// visor's own output changes nothing.
pub fn is_own(line: &str) -> bool {
    is_image_text(line) || is_note(line)
}

/// A line visor wrote in place of an image or audio (always one line: see
/// `placeholder::placeholder`).
fn is_image_text(line: &str) -> bool {
    line.starts_with("[image ") || line.starts_with("[audio ")
}

/// A text visor wrote in place of a document: its header line, then its
/// text (see `placeholder::media_text`).
pub fn is_document_text(text: &str) -> bool {
    text.starts_with("[document ")
}

/// One of the notes this module writes.
pub fn is_note(line: &str) -> bool {
    let Some(inner) = line
        .trim_end()
        .strip_prefix('[')
        .and_then(|l| l.strip_suffix(']'))
    else {
        return false;
    };
    if inner.starts_with("omitted: ") {
        return true;
    }
    count(inner)
        .is_some_and(|r| r.starts_with(" items omitted: ") || r.starts_with(" item omitted: "))
}

/// `s` after its leading decimal number; `None` without one.
fn count(s: &str) -> Option<&str> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    (digits > 0).then(|| &s[digits..])
}

enum JsonKind {
    Array,
    Other,
}

/// Whether a text is one JSON document, and an array or not.
fn json_kind(text: &str) -> Option<JsonKind> {
    let t = text.trim();
    let kind = match t.as_bytes().first()? {
        b'[' => JsonKind::Array,
        b'{' => JsonKind::Other,
        _ => return None,
    };
    is_json(t.as_bytes()).then_some(kind)
}

/// A text that is one JSON array (a rewritten one: followed by its note).
fn is_array(text: &str) -> bool {
    matches!(
        json_kind(split_trailing_note(text).0),
        Some(JsonKind::Array)
    )
}

/// A reference visor wrote in place of a whole result (followed by the
/// result's status lines).
fn is_reference(text: &str) -> bool {
    text.split('\n')
        .next()
        .is_some_and(|l| matches!(Note::parse(l), Some(Note::Same { .. })))
}

/// A text and the visor note that ends it, if one does (a text this module
/// wrote before).
fn split_trailing_note(text: &str) -> (&str, &str) {
    let trimmed = text.trim_end();
    match trimmed.rfind('\n') {
        Some(nl) if is_items_note(&trimmed[nl + 1..]) => text.split_at(nl),
        _ => (text, ""),
    }
}

/// The note a rewritten JSON array ends with.
fn is_items_note(line: &str) -> bool {
    line.trim_end()
        .strip_prefix('[')
        .and_then(count)
        .is_some_and(|r| r.starts_with(" items omitted: ") || r.starts_with(" item omitted: "))
}

/// An element as canonical JSON: keys sorted, no whitespace.
fn canonical(element: &str) -> Option<String> {
    let v: Value = serde_json::from_str(element).ok()?;
    let mut out = String::with_capacity(element.len());
    write_canonical(&v, &mut out);
    Some(out)
}

fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&String::from_utf8_lossy(&quote(k)));
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(v, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// The length of `s` as a JSON string literal, quotes included (as
/// [`quote`] writes it).
pub fn literal_len(s: &str) -> usize {
    2 + s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum::<usize>()
}

/// The instructions a request carries outside its message list (Anthropic
/// `system`, a string or text blocks; Responses `instructions`), from the
/// places the scan found them.
fn top_level_instructions(scan: &Scan, body: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    for range in &scan.instructions {
        match serde_json::from_slice::<Value>(body.get(range.clone()).unwrap_or_default()) {
            Ok(Value::String(s)) => out.push(s),
            Ok(Value::Array(blocks)) => out.extend(
                blocks
                    .iter()
                    .filter_map(|b| b.get("text").and_then(Value::as_str))
                    .map(str::to_owned),
            ),
            _ => {}
        }
    }
    out
}

/// A stretch of lines a note names: 1-based message, the unit of that
/// message when it holds several, and its first and last lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub message: usize,
    pub label: Option<String>,
    pub first: usize,
    pub last: usize,
}

/// A note this module writes, read back: what the model is told to look
/// up. (The reader of visor's own notes for tests, benches and tools.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// `[omitted: same as message 7 (call_abc)]`: the whole text of that
    /// message (or unit); the status lines after it restate its own.
    Same {
        message: usize,
        label: Option<String>,
    },
    /// `[omitted: message 7 lines 5-16; …]`: these places, in order (a
    /// place repeated N times is listed N times).
    Run(Vec<Place>),
    /// `[3 items omitted: messages 4, 7]`.
    Items { removed: usize },
}

impl Note {
    /// The note `line` is, if it is one of this module's.
    pub fn parse(line: &str) -> Option<Note> {
        let inner = line.trim_end().strip_prefix('[')?.strip_suffix(']')?;
        if let Some(rest) = count(inner)
            && (rest.starts_with(" items omitted: ") || rest.starts_with(" item omitted: "))
        {
            return Some(Note::Items {
                removed: inner[..inner.len() - rest.len()].parse().ok()?,
            });
        }
        let body = inner.strip_prefix("omitted: ")?;
        if let Some(rest) = body.strip_prefix("same as message ") {
            let (n, label) = match rest.split_once(' ') {
                Some((n, l)) => (n, Some(l.strip_prefix('(')?.strip_suffix(')')?.to_owned())),
                None => (rest, None),
            };
            return Some(Note::Same {
                message: n.parse().ok()?,
                label,
            });
        }
        let mut out = Vec::new();
        for part in body.split("; ") {
            parse_part(part, &mut out)?;
        }
        Some(Note::Run(out))
    }
}

/// `lines 5-16` or `line 5`.
fn parse_lines(spec: &str) -> Option<(usize, usize)> {
    match spec.strip_prefix("lines ") {
        Some(r) => {
            let (a, b) = r.split_once('-')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        }
        None => {
            let a = spec.strip_prefix("line ")?.parse().ok()?;
            Some((a, a))
        }
    }
}

/// One part of a run note (see [`run_note`]), its places appended.
fn parse_part(part: &str, out: &mut Vec<Place>) -> Option<()> {
    let (part, times) = match part.rsplit_once(", ") {
        Some((p, t)) if t.ends_with(" times") => (p, t.strip_suffix(" times")?.parse().ok()?),
        _ => (part, 1usize),
    };
    if let Some(rest) = part.strip_prefix("message ") {
        let (m, spec) = rest.split_once(' ')?;
        let (label, spec) = match spec.strip_prefix('(') {
            Some(l) => {
                let (label, spec) = l.split_once(") ")?;
                (Some(label.to_owned()), spec)
            }
            None => (None, spec),
        };
        let (first, last) = parse_lines(spec)?;
        let place = Place {
            message: m.parse().ok()?,
            label,
            first,
            last,
        };
        out.extend(std::iter::repeat_n(place, times));
        return Some(());
    }
    // `lines 2-3 of messages 8 to 40`, `line 2 of messages 8, 12 … 96`.
    let (spec, rest) = part.split_once(" of messages ")?;
    let (first, last) = parse_lines(spec)?;
    let (m1, m2, step): (usize, usize, usize) = match rest.split_once(" … ") {
        Some((two, m2)) => {
            let (a, b) = two.split_once(", ")?;
            let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
            (a, m2.parse().ok()?, b.checked_sub(a)?)
        }
        None => {
            let (a, b) = rest.split_once(" to ")?;
            (a.parse().ok()?, b.parse().ok()?, 1)
        }
    };
    if step == 0 || m2 < m1 {
        return None;
    }
    out.extend((m1..=m2).step_by(step).map(|message| Place {
        message,
        label: None,
        first,
        last,
    }));
    Some(())
}
