//! Context dedup: a line of a user or tool message that already appeared
//! earlier in the request is removed, and one short note per message says
//! how many were omitted. A tool result whose text is a JSON array loses the
//! elements that appeared earlier (compared as canonical JSON) and stays
//! valid JSON, followed by the note.
//!
//! What is never removed: lines of system, developer and assistant messages
//! and of the newest user message (they still count as seen), lines shorter
//! than `min_line_chars` (trailing whitespace ignored), lines inside fenced
//! code blocks (in code a repeated line is usually a different statement:
//! two functions that both `return Ok(());`), visor's own notes, and the
//! text of a JSON document that is not an array (its lines are not
//! independent; removing one would break it).
//!
//! The output is a pure function of the request: a message's text depends
//! only on the messages before it and on whether it is the newest user
//! message, so a conversation's rewritten prefix stays byte-identical from
//! one turn to the next. Running it on its own output changes nothing.

use std::borrow::Cow;
use std::collections::HashSet;

use serde_json::Value;

use super::images::{Role, Scan, TextAt};
use super::json::{Cursor, is_json, quote};

/// Notes are `[24 omitted]` (lines), `[3 items omitted]`, `[24 omitted, 3
/// items]`: short, because an agent that re-fetches its history gets one
/// in every tool result, every turn.
const NOTE_HEAD: &str = "[";
const NOTE_TAIL: &str = "]";
/// What a further text part of a message holds when every line of it was
/// removed (the message's note is in an earlier part): no provider is sent
/// an empty text block.
const EMPTIED: &str = "[omitted]";

/// What dedup removed from one request.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Omitted {
    pub lines: usize,
    pub items: usize,
    /// Messages (or tool results) that carry a note.
    pub messages: usize,
    /// Request bytes removed (JSON-encoded lengths).
    pub bytes: i64,
}

/// What happens to one text.
enum Outcome<'a> {
    Same,
    Lines {
        pieces: Vec<&'a str>,
        removed: usize,
        /// Where the first removed line was (an index into `pieces`).
        first: usize,
    },
    Items {
        json: String,
        /// A note already following the JSON (kept).
        tail: &'a str,
        removed: usize,
    },
}

/// Removes repeated lines and JSON array elements from the request's text
/// strings. `spot_text[s]` is the text of spot `s` when an earlier step
/// changed it (images replaced in it); the new texts are written there.
pub fn run(
    scan: &Scan,
    body: &[u8],
    spot_text: &mut [Option<String>],
    min_chars: usize,
) -> Omitted {
    let texts: Vec<Option<Cow<'_, str>>> = scan
        .texts
        .iter()
        .map(|t| match spot_text.get(t.spot).and_then(Option::as_ref) {
            Some(s) => Some(Cow::Borrowed(s.as_str())),
            None => scan.spot_decoded(t.spot, body),
        })
        .collect();
    let newest_user = scan
        .items
        .iter()
        .rposition(|i| i.role == Role::User && i.authored);
    let mut seen = Seen {
        lines: HashSet::new(),
        items: HashSet::new(),
        min_chars,
    };
    let mut outcomes: Vec<Outcome<'_>> = Vec::with_capacity(texts.len());
    for (t, text) in scan.texts.iter().zip(&texts) {
        let Some(text) = text.as_deref() else {
            outcomes.push(Outcome::Same);
            continue;
        };
        let role = scan.items.get(t.item).map_or(Role::Other, |i| i.role);
        let tool = t.tool || role == Role::Tool;
        let eligible = tool || (role == Role::User && Some(t.item) != newest_user);
        let json_too = tool || role == Role::User;
        outcomes.push(seen.text(text, eligible, json_too));
    }
    let mut out = Omitted::default();
    let mut new_texts: Vec<(usize, String)> = Vec::new();
    // One note per message (per tool result): texts are grouped by
    // message and unit; the note goes into the first one that lost lines.
    let mut k = 0;
    while k < scan.texts.len() {
        let item = scan.texts[k].item;
        let end = k + scan.texts[k..]
            .iter()
            .take_while(|t| t.item == item)
            .count();
        let message = &scan.texts[k..end];
        let mut units: Vec<u32> = message.iter().map(|t| t.unit).collect();
        units.sort_unstable();
        units.dedup();
        for unit in units {
            let group: Vec<usize> = (k..end).filter(|&j| scan.texts[j].unit == unit).collect();
            let lines: usize = group.iter().map(|&j| removed_lines(&outcomes[j])).sum();
            let items: usize = group.iter().map(|&j| removed_items(&outcomes[j])).sum();
            if lines + items == 0 {
                continue;
            }
            out.lines += lines;
            out.items += items;
            out.messages += 1;
            let note = note(lines, items);
            let mut noted = false;
            for &j in &group {
                let t: &TextAt = &scan.texts[j];
                let rendered = match &outcomes[j] {
                    Outcome::Same => continue,
                    Outcome::Lines { pieces, first, .. } => {
                        let mut pieces = pieces.clone();
                        if !noted {
                            pieces.insert((*first).min(pieces.len()), &note);
                            noted = true;
                        }
                        let s = pieces.join("\n");
                        if s.trim().is_empty() {
                            EMPTIED.to_owned()
                        } else {
                            s
                        }
                    }
                    Outcome::Items { json, tail, .. } => {
                        let mut s = format!("{json}{tail}");
                        if !noted {
                            s.push('\n');
                            s.push_str(&note);
                            noted = true;
                        }
                        s
                    }
                };
                let before = match spot_text.get(t.spot).and_then(Option::as_ref) {
                    Some(s) => literal_len(s),
                    None => scan.spot_literal_len(t.spot),
                };
                out.bytes += before as i64 - literal_len(&rendered) as i64;
                new_texts.push((t.spot, rendered));
            }
        }
        k = end;
    }
    drop(outcomes);
    drop(texts);
    for (spot, text) in new_texts {
        if let Some(slot) = spot_text.get_mut(spot) {
            *slot = Some(text);
        }
    }
    out
}

fn removed_lines(o: &Outcome<'_>) -> usize {
    match o {
        Outcome::Lines { removed, .. } => *removed,
        _ => 0,
    }
}

fn removed_items(o: &Outcome<'_>) -> usize {
    match o {
        Outcome::Items { removed, .. } => *removed,
        _ => 0,
    }
}

/// The note that takes the removed lines' place.
fn note(lines: usize, items: usize) -> String {
    let items_text = match items {
        1 => "1 item".to_owned(),
        n => format!("{n} items"),
    };
    match (lines, items) {
        (l, 0) => format!("{NOTE_HEAD}{l} omitted{NOTE_TAIL}"),
        (0, _) => format!("{NOTE_HEAD}{items_text} omitted{NOTE_TAIL}"),
        (l, _) => format!("{NOTE_HEAD}{l} omitted, {items_text}{NOTE_TAIL}"),
    }
}

/// A line visor wrote: a note, or the text that replaced an image (two
/// copies of one image give the same text; they are the images' business,
/// see `images.dedupe`). Never removed, never counted as seen, so dedup of
/// visor's own output changes nothing.
fn is_own(line: &str) -> bool {
    line.starts_with("[image ") || is_note(line)
}

/// One of the notes [`note`] writes.
fn is_note(line: &str) -> bool {
    let Some(inner) = line
        .strip_prefix(NOTE_HEAD)
        .and_then(|l| l.strip_suffix(NOTE_TAIL))
    else {
        return false;
    };
    if inner == "omitted" {
        return true;
    }
    let Some(rest) = count(inner) else {
        return false;
    };
    match rest {
        " omitted" | " item omitted" | " items omitted" => true,
        _ => rest
            .strip_prefix(" omitted, ")
            .and_then(count)
            .is_some_and(|r| r == " item" || r == " items"),
    }
}

/// `s` after its leading decimal number; `None` without one.
fn count(s: &str) -> Option<&str> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    (digits > 0).then(|| &s[digits..])
}

/// A fence line of a Markdown code block (up to three spaces, then three
/// backticks or tildes).
fn is_fence(line: &str) -> bool {
    let t = line.trim_start_matches(' ');
    line.len() - t.len() <= 3 && (t.starts_with("```") || t.starts_with("~~~"))
}

/// What has appeared so far in the request.
struct Seen<'a> {
    lines: HashSet<&'a str>,
    items: HashSet<String>,
    min_chars: usize,
}

impl<'a> Seen<'a> {
    fn long(&self, s: &str) -> bool {
        s.len() >= self.min_chars && (s.is_ascii() || s.chars().count() >= self.min_chars)
    }

    /// Reads one text: records what it holds, and, when `eligible`, what
    /// of it repeats something earlier. `json_too`: a JSON array's
    /// elements are recorded (user and tool texts).
    fn text(&mut self, text: &'a str, eligible: bool, json_too: bool) -> Outcome<'a> {
        let (head, tail) = split_trailing_note(text);
        if json_too && let Some(kind) = json_kind(head) {
            self.record_lines(text);
            return match kind {
                JsonKind::Array => self.array(head, tail, eligible),
                JsonKind::Other => Outcome::Same,
            };
        }
        self.lines(text, eligible)
    }

    fn record_lines(&mut self, text: &'a str) {
        for line in text.split('\n') {
            let key = line.trim_end();
            if self.long(key) && !is_own(key) {
                self.lines.insert(key);
            }
        }
    }

    fn lines(&mut self, text: &'a str, eligible: bool) -> Outcome<'a> {
        let mut pieces: Vec<&'a str> = Vec::new();
        let mut removed = 0;
        let mut first = 0;
        let mut fenced = false;
        for line in text.split('\n') {
            let key = line.trim_end();
            if is_fence(key) {
                fenced = !fenced;
            } else if self.long(key) && !is_own(key) {
                if eligible && !fenced && self.lines.contains(key) {
                    if removed == 0 {
                        first = pieces.len();
                    }
                    removed += 1;
                    continue;
                }
                self.lines.insert(key);
            }
            pieces.push(line);
        }
        match removed {
            0 => Outcome::Same,
            _ => Outcome::Lines {
                pieces,
                removed,
                first,
            },
        }
    }

    fn array(&mut self, json: &'a str, tail: &'a str, eligible: bool) -> Outcome<'a> {
        let src = json.as_bytes();
        let mut elements = Vec::new();
        let mut c = Cursor::new(src);
        if c.array(|c, _| c.skip().map(|r| elements.push(r))).is_err() {
            return Outcome::Same;
        }
        let mut kept = Vec::with_capacity(elements.len());
        let mut removed = 0;
        for r in &elements {
            let Some(key) = json.get(r.clone()).and_then(canonical) else {
                kept.push(r.clone());
                continue;
            };
            if !self.long(&key) {
                kept.push(r.clone());
            } else if eligible && self.items.contains(&key) {
                removed += 1;
            } else {
                self.items.insert(key);
                kept.push(r.clone());
            }
        }
        if removed == 0 {
            return Outcome::Same;
        }
        let (Some(first), Some(last)) = (elements.first(), elements.last()) else {
            return Outcome::Same;
        };
        let sep = match elements.get(1) {
            Some(second) => json.get(first.end..second.start).unwrap_or(", "),
            None => ", ",
        };
        let mut out = String::with_capacity(json.len());
        out.push_str(json.get(..first.start).unwrap_or("["));
        for (i, r) in kept.iter().enumerate() {
            if i > 0 {
                out.push_str(sep);
            }
            out.push_str(json.get(r.clone()).unwrap_or("null"));
        }
        out.push_str(json.get(last.end..).unwrap_or("]"));
        Outcome::Items {
            json: out,
            tail,
            removed,
        }
    }
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

/// A text and the visor note that ends it, if one does (a text this module
/// wrote before).
fn split_trailing_note(text: &str) -> (&str, &str) {
    let trimmed = text.trim_end();
    match trimmed.rfind('\n') {
        Some(nl) if is_note(&trimmed[nl + 1..]) => text.split_at(nl),
        _ => (text, ""),
    }
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
