//! Server-side sessions (`x-visor-session`): the pure parts — which ids and
//! depths are accepted, how a request's messages merge with the stored
//! history, and how an assistant reply is read from a response (a JSON body,
//! or a stream assembled event by event). The store keeps the messages
//! ([`crate::store::Store::append_session`]); the proxy wires them up.
//!
//! Chat Completions, Responses (`input` items) and Anthropic Messages.

use serde_json::{Map, Value};

/// The longest session id accepted.
pub const MAX_ID_LEN: usize = 128;

/// Why a session header was refused (a 400).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadHeader(pub &'static str);

/// A session id: 1–128 characters of `A–Z a–z 0–9 . _ : -`, other than
/// `.` and `..` (which, as a path segment, `/visor/sessions/<id>` cannot
/// name: an id the header accepts can always be read and deleted).
pub fn valid_id(id: &str) -> Result<&str, BadHeader> {
    let ok = !id.is_empty()
        && id != "."
        && id != ".."
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'));
    ok.then_some(id).ok_or(BadHeader(BAD_ID))
}

/// Why the session id of the `x-visor-session` header was refused.
pub const BAD_ID: &str = "a session id (x-visor-session) must be 1 to 128 characters of A-Z a-z 0-9 . _ : -, and not `.` or `..`";

/// Why the session id in the path of `/visor/sessions/<id>` was refused.
pub const BAD_PATH_ID: &str = "a session id (the <id> of /visor/sessions/<id>) must be 1 to 128 characters of A-Z a-z 0-9 . _ : -, and not `.` or `..`";

/// The history depth for a request: `x-visor-history` (a whole number,
/// capped by `max_depth`), else `default_depth`.
pub fn depth(
    header: Option<&str>,
    default_depth: usize,
    max_depth: usize,
) -> Result<usize, BadHeader> {
    match header {
        None => Ok(default_depth.min(max_depth)),
        Some(h) => h
            .trim()
            .parse::<u64>()
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX).min(max_depth))
            .map_err(|_| BadHeader("x-visor-history must be a whole number of messages")),
    }
}

/// The store key of a session: the id, in the namespace of the proxy key
/// that asked (its id, see `KeySet::key_id`; `-` when visor has no proxy
/// keys), so one key cannot read another's sessions.
pub fn store_key(namespace: Option<&str>, id: &str) -> String {
    format!("{}/{id}", namespace.unwrap_or("-"))
}

/// A request's messages merged with its session's history.
#[derive(Debug, Default, PartialEq)]
pub struct Merged {
    /// Where the history goes among the client's messages: before the
    /// client's message at this index (after its leading system and
    /// developer messages).
    pub at: usize,
    /// The stored messages to insert there: the newest `depth` the client
    /// does not hold itself (often none).
    pub history: Vec<Value>,
    /// Where `history` starts among the stored messages.
    pub history_from: usize,
    /// The client's messages that are not stored yet (to store with the
    /// reply).
    pub new: Vec<Value>,
    /// Their positions among the client's messages.
    pub new_at: Vec<usize>,
    /// Stored messages inserted (`history.len()`).
    pub history_used: usize,
}

impl Merged {
    /// Whether the client's messages hold a tool result for a call the
    /// inserted history already answers: sent so, the provider would get
    /// two results for one call, the second with no call before it (a
    /// client re-sending its last tool result once the reply was stored, or
    /// a second, different result).
    /// Answered: a result after the call's latest making in the history
    /// (an upstream that numbers its calls per answer, `call_0`, makes an
    /// id again, and the client's result answers that one).
    pub fn answers_again(&self, client: &[Value]) -> bool {
        let h = &self.history;
        client
            .iter()
            .skip(self.at)
            .filter(|m| tool_result(m))
            .flat_map(answered_calls)
            .any(|id| {
                let made = h.iter().rposition(|m| made_calls(m).any(|c| c == id));
                // (Results only: a Responses `function_call` carries the
                // `call_id` its output answers.)
                h[made.map_or(0, |i| i + 1)..]
                    .iter()
                    .filter(|m| tool_result(m))
                    .any(|m| answered_calls(m).contains(&id))
            })
    }

    /// The messages sent upstream: the client's, with the history at `at`.
    pub fn messages(&self, client: &[Value]) -> Vec<Value> {
        let at = self.at.min(client.len());
        let mut out = client[..at].to_vec();
        out.extend(self.history.iter().cloned());
        out.extend(client[at..].iter().cloned());
        out
    }
}

/// Merges the client's `messages` with `stored` (oldest first). The
/// client's own messages are always sent as they came; visor only inserts
/// the stored messages the client does not hold, after its leading system
/// and developer messages.
///
/// Messages are compared by content ([`fingerprint`]), leaving out what
/// clients add or visor does not store: system and developer messages
/// anywhere (Claude Code puts some mid-conversation), reasoning items
/// (Codex), ids, statuses, key order, thinking blocks.
///
/// - A client that sends only new messages (no assistant turn of its own):
///   the newest `depth` stored messages go first, never starting on a tool
///   result whose call was cut off; client messages that repeat the stored
///   tail are not sent twice or stored again.
/// - A client that re-sends the conversation itself (it holds assistant
///   turns: agent CLIs, SDK loops): when its first messages are the stored
///   tail from some point, only the stored messages before that point are
///   inserted (none when it holds them all); when the stored tail sits
///   further in, or nowhere (the client compacted or edited its history),
///   nothing is inserted. New are the messages after its copy of the stored
///   tail, else those after its last assistant turn.
pub fn merge(messages: &[Value], stored: &[Value], depth: usize) -> Merged {
    let system = messages
        .iter()
        .take_while(|m| matches!(role(m), "system" | "developer"))
        .count();
    let rest = &messages[system..];
    // A trailing assistant message is a prefill (the start of the answer
    // the client wants), not history it carries: left out of the matching
    // and not stored (the reply continues it).
    let rest = match rest.split_last() {
        Some((last, before)) if role(last) == "assistant" => before,
        _ => rest,
    };
    let (history_end, new_from) = boundaries(rest, stored);
    let (history_from, history): (usize, Vec<Value>) = match history_end {
        Some(end) => {
            let from = history_start(stored, depth, end);
            (from, stored[from..end].to_vec())
        }
        None => (stored.len(), Vec::new()),
    };
    let new_at: Vec<usize> = (new_from.min(rest.len())..rest.len())
        .filter(|&i| !not_compared(&rest[i]))
        .collect();
    let new = new_at.iter().map(|&i| rest[i].clone()).collect();
    Merged {
        at: system,
        history_used: history.len(),
        history,
        history_from,
        new,
        new_at: new_at.into_iter().map(|i| i + system).collect(),
    }
}

/// The messages of a list that are compared: their positions, and their
/// fingerprints.
struct Compared {
    at: Vec<usize>,
    prints: Vec<String>,
}

impl Compared {
    fn of(ms: &[Value]) -> Compared {
        let (at, prints) = ms
            .iter()
            .enumerate()
            .filter(|(_, m)| !not_compared(m))
            .map(|(i, m)| (i, fingerprint(m)))
            .unzip();
        Compared { at, prints }
    }

    /// Where the list goes on after its compared message number `n - 1`.
    fn after(&self, n: usize) -> usize {
        if n == 0 { 0 } else { self.at[n - 1] + 1 }
    }
}

/// Where the stored messages to insert end (`None`: none are inserted),
/// and where the client's new messages start in `rest`: by whether the
/// client sends only new messages or re-sends the conversation, and where
/// its copy of the stored tail is (see [`merge`]).
fn boundaries(rest: &[Value], stored: &[Value]) -> (Option<usize>, usize) {
    let client = Compared::of(rest);
    let kept = Compared::of(stored);
    let (cf, sf) = (&client.prints, &kept.prints);
    if !rest.iter().any(model_produced) {
        // Only new messages (perhaps repeating the stored tail).
        let most = cf.len().min(sf.len());
        let k = (1..=most)
            .rev()
            .find(|&k| sf[sf.len() - k..] == cf[..k])
            .unwrap_or(0);
        let end = if k == 0 {
            stored.len()
        } else {
            kept.at[sf.len() - k]
        };
        (Some(end), client.after(k))
    } else if let Some(q) =
        (0..sf.len()).find(|&q| sf.len() - q <= cf.len() && sf[q..] == cf[..sf.len() - q])
    {
        // The client's first messages are the stored tail from `q`.
        (Some(kept.at[q]), client.after(sf.len() - q))
    } else if let Some(p) = (0..cf.len()).rev().find(|&p| {
        !sf.is_empty() && {
            let n = (p + 1).min(sf.len());
            (0..n).all(|i| cf[p - i] == sf[sf.len() - 1 - i])
        }
    }) {
        // The stored tail sits further in: the client holds more.
        (None, client.after(p + 1))
    } else if stored.is_empty() {
        // A new session: the conversation the client brings is its start.
        (None, 0)
    } else {
        (None, diverged(rest, stored))
    }
}

/// A conversation that diverged from what is stored (compacted, edited):
/// what follows its last turn is new — with that turn, when the tool
/// results after it answer calls the store does not hold (so no stored
/// result lacks its call).
fn diverged(rest: &[Value], stored: &[Value]) -> usize {
    let last = rest.iter().rposition(model_produced);
    let from = last.map_or(0, |i| i + 1);
    let orphan = rest[from..]
        .iter()
        .take_while(|m| tool_result(m))
        .flat_map(|m| answered_calls(m))
        .any(|id| !stored.iter().any(|s| made_calls(s).any(|c| c == id)));
    match last {
        // The whole turn: a Responses turn is a run of items (each call
        // its own), all before the results.
        Some(i) if orphan => rest[..i]
            .iter()
            .rposition(|m| !model_produced(m))
            .map_or(0, |j| j + 1),
        _ => from,
    }
}

/// Where the history inserted before `end` starts: the newest `depth`
/// stored messages at most (counted from the end of what is stored), never
/// opening on a tool result without its call.
fn history_start(stored: &[Value], depth: usize, end: usize) -> usize {
    let mut from = stored.len().saturating_sub(depth);
    while from < end && tool_result(&stored[from]) {
        from += 1;
    }
    from.min(end)
}

/// The call ids a tool result answers: a Chat `tool` message's
/// `tool_call_id`, a Responses output item's `call_id`, an Anthropic
/// message's `tool_result` blocks' `tool_use_id`s.
fn answered_calls(m: &Value) -> Vec<&str> {
    let mut out: Vec<&str> = ["tool_call_id", "call_id"]
        .iter()
        .filter_map(|k| m.get(*k).and_then(Value::as_str))
        .collect();
    if let Some(parts) = m.get("content").and_then(Value::as_array) {
        out.extend(
            parts
                .iter()
                .filter(|p| p["type"] == "tool_result")
                .filter_map(|p| p.get("tool_use_id").and_then(Value::as_str)),
        );
    }
    out
}

/// The call ids a message makes: Chat `tool_calls`, a Responses call
/// item's `call_id`, Anthropic `tool_use` blocks.
fn made_calls(m: &Value) -> impl Iterator<Item = &str> {
    let chat = m
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("id").and_then(Value::as_str));
    let item = m
        .get("call_id")
        .filter(|_| !tool_result(m))
        .and_then(Value::as_str);
    let blocks = m
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|p| p["type"] == "tool_use")
        .filter_map(|p| p.get("id").and_then(Value::as_str));
    chat.chain(item).chain(blocks)
}

/// The byte range of each element of `body`'s top-level array `key`;
/// `None` when it has none.
pub fn item_ranges(body: &[u8], key: &str) -> Option<Vec<std::ops::Range<usize>>> {
    use crate::transform::json::{Cursor, Kind};
    let mut c = Cursor::new(body);
    let mut out: Option<Vec<std::ops::Range<usize>>> = None;
    c.object(|c, k| {
        if out.is_none() && k.is(body, key) && c.kind()? == Kind::Array {
            let mut ranges = Vec::new();
            c.array(|c, _| {
                ranges.push(c.skip()?);
                Ok(())
            })?;
            out = Some(ranges);
            Ok(())
        } else {
            c.skip().map(drop)
        }
    })
    .ok()?;
    out
}

/// `body` with `items` (each one JSON value's bytes) inserted into its
/// top-level array `key` before the element at `at` (at its end when `at`
/// is past it); every other byte as it was. `None` when `body` has no such
/// array.
pub fn insert_items(body: &[u8], key: &str, at: usize, items: &[&[u8]]) -> Option<Vec<u8>> {
    use crate::transform::json::{Cursor, Kind};
    let mut c = Cursor::new(body);
    let mut spot: Option<(usize, bool)> = None; // (byte offset, comma after)
    c.object(|c, k| {
        if spot.is_none() && k.is(body, key) && c.kind()? == Kind::Array {
            let mut starts = Vec::new();
            let range = c.array(|c, _| {
                let r = c.skip()?;
                starts.push(r);
                Ok(())
            })?;
            spot = Some(match starts.get(at) {
                Some(r) => (r.start, true),
                None => match starts.last() {
                    Some(r) => (r.end, false),
                    None => (range.start + 1, true),
                },
            });
            Ok(())
        } else {
            c.skip().map(drop)
        }
    })
    .ok()?;
    let (offset, comma_after) = spot?;
    let empty = items.is_empty();
    let mut joined = Vec::new();
    for (i, m) in items.iter().enumerate() {
        if i > 0 {
            joined.push(b',');
        }
        joined.extend_from_slice(m);
    }
    let mut out = Vec::with_capacity(body.len() + joined.len() + 2);
    out.extend_from_slice(&body[..offset]);
    if !empty {
        // Before an element: `h1,h2,` ; after the last one: `,h1,h2`; into an
        // empty array: `h1,h2`.
        let array_empty =
            comma_after && body[offset..].iter().find(|b| !b.is_ascii_whitespace()) == Some(&b']');
        if !comma_after {
            out.push(b',');
        }
        out.extend_from_slice(&joined);
        if comma_after && !array_empty {
            out.push(b',');
        }
    }
    out.extend_from_slice(&body[offset..]);
    Some(out)
}

/// A stored message's bytes as they are inserted again: without the prompt
/// cache markers (`cache_control`) the client put on it, on the message,
/// its content blocks or the blocks inside a `tool_result` — a marker
/// belongs to the request that placed it (a client marks its newest
/// message each turn; kept in the history, the markers would pile up past
/// the provider's limit of four). `None` when it has none, or is not a
/// JSON object.
pub fn without_cache_markers(raw: &[u8]) -> Option<Vec<u8>> {
    use crate::transform::json::{Cursor, Kind, Result as JsonResult};
    use std::ops::Range;

    /// The markers of the object at the cursor (and of the objects in its
    /// `content` array, `depth` levels down): the ranges to cut, each with
    /// the comma that separates it from a neighbour.
    fn markers(
        c: &mut Cursor<'_>,
        src: &[u8],
        depth: u8,
        cut: &mut Vec<Range<usize>>,
    ) -> JsonResult<()> {
        let mut members: Vec<(Range<usize>, bool)> = Vec::new();
        c.object(|c, key| {
            let marker = key.is(src, "cache_control");
            let end = if depth > 0 && key.is(src, "content") && c.kind()? == Kind::Array {
                c.array(|c, _| match c.kind()? {
                    Kind::Object => markers(c, src, depth - 1, cut),
                    _ => c.skip().map(drop),
                })?
                .end
            } else {
                c.skip()?.end
            };
            members.push((key.range.start..end, marker));
            Ok(())
        })?;
        for (j, (r, marker)) in members.iter().enumerate() {
            if !marker {
                continue;
            }
            cut.push(match (j.checked_sub(1), members.get(j + 1)) {
                (_, Some((next, _))) => r.start..next.start,
                (Some(before), None) => members[before].0.end..r.end,
                (None, None) => r.clone(),
            });
        }
        Ok(())
    }

    // Most messages carry none: no walk for them.
    memchr::memmem::find(raw, b"\"cache_control\"")?;
    let mut cut = Vec::new();
    let mut c = Cursor::new(raw);
    if c.kind().ok()? != Kind::Object {
        return None;
    }
    markers(&mut c, raw, 2, &mut cut).ok()?;
    if cut.is_empty() {
        return None;
    }
    cut.sort_by_key(|r| r.start);
    // Cuts that touch (a marker named twice in one object) would leave a
    // stray comma: then the message goes as it was stored.
    if cut.windows(2).any(|w| w[1].start < w[0].end) {
        return None;
    }
    let edits: Vec<(Range<usize>, Vec<u8>)> = cut.into_iter().map(|r| (r, Vec::new())).collect();
    let out = crate::transform::json::splice(raw, &edits);
    serde_json::from_slice::<serde::de::IgnoredAny>(&out)
        .is_ok()
        .then_some(out)
}

/// Messages the overlap leaves out: system and developer messages (not
/// stored), reasoning items (not stored: they belong to the provider).
fn not_compared(m: &Value) -> bool {
    matches!(role(m), "system" | "developer")
        || m.get("type").and_then(Value::as_str) == Some("reasoning")
}

/// What the model produced: an assistant message, or a Responses output
/// item (a function call, a reasoning item…), as a client sends it back.
fn model_produced(m: &Value) -> bool {
    match (
        m.get("role").and_then(Value::as_str),
        m.get("type").and_then(Value::as_str),
    ) {
        (Some(r), _) => r == "assistant",
        (None, Some(t)) => !t.ends_with("_output") && t != "message" && t != "item_reference",
        (None, None) => false,
    }
}

fn role(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

/// A tool's answer, which must not open a history without its call: a Chat
/// `tool` message, a Responses `*_output` item, an Anthropic user message
/// holding `tool_result` blocks.
fn tool_result(m: &Value) -> bool {
    let ty = m.get("type").and_then(Value::as_str).unwrap_or("");
    role(m) == "tool"
        || role(m) == "function"
        || ty.ends_with("_output")
        || m.get("content")
            .and_then(Value::as_array)
            .is_some_and(|parts| parts.iter().any(|p| p["type"] == "tool_result"))
}

/// What makes two messages the same for the overlap: role and type, text
/// (text parts of any shape joined; null, empty and absent alike), tool
/// calls (id, name, arguments), call ids and tool outputs, other content
/// parts without their null fields. Fields an SDK adds when it sends a reply
/// back (`refusal: null`, `annotations: []`, a call's `index`, an item's
/// `id` and `status`) do not count.
pub fn fingerprint(m: &Value) -> String {
    let mut f = Map::new();
    for key in [
        "role",
        "type",
        "tool_call_id",
        "name",
        "call_id",
        "arguments",
        "output",
    ] {
        if let Some(v) = m.get(key).filter(|v| !v.is_null()) {
            f.insert(key.to_owned(), v.clone());
        }
    }
    if f.get("type").and_then(Value::as_str) == Some("message") {
        f.remove("type");
    }
    let content = match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts.iter().map(part_text).collect(),
        Some(other) if !other.is_null() => other.to_string(),
        _ => String::new(),
    };
    if !content.is_empty() {
        f.insert("content".to_owned(), Value::String(content));
    }
    if let Some(Value::Array(calls)) = m.get("tool_calls")
        && !calls.is_empty()
    {
        let calls: Vec<Value> = calls
            .iter()
            .map(|c| {
                serde_json::json!([c["id"], c["function"]["name"], c["function"]["arguments"]])
            })
            .collect();
        f.insert("tool_calls".to_owned(), Value::Array(calls));
    }
    Value::Object(f).to_string()
}

/// A content part as the overlap compares it: its text for text parts, else
/// the part without null fields.
fn part_text(p: &Value) -> String {
    match p.get("type").and_then(Value::as_str) {
        // Thinking is the provider's (and visor stores none).
        Some("thinking" | "redacted_thinking" | "reasoning") => String::new(),
        Some("text" | "input_text" | "output_text") => p
            .get("text")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned(),
        _ => match p {
            Value::Object(o) => {
                let kept: Map<String, Value> = o
                    .iter()
                    .filter(|(k, v)| !v.is_null() && k.as_str() != "cache_control")
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                Value::Object(kept).to_string()
            }
            other => other.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    #[test]
    fn ids_and_depths() {
        assert!(valid_id("chat-42_a.b:c").is_ok());
        assert!(valid_id("...").is_ok());
        for bad in ["", ".", "..", "a b", "a/b", "é", &"x".repeat(129)] {
            assert!(valid_id(bad).is_err(), "{bad:?}");
        }
        assert_eq!(depth(None, 25, 200), Ok(25));
        assert_eq!(depth(Some("7"), 25, 200), Ok(7));
        assert_eq!(depth(Some("5000"), 25, 200), Ok(200));
        assert!(depth(Some("-1"), 25, 200).is_err());
        assert!(depth(Some("ten"), 25, 200).is_err());
        assert_ne!(store_key(Some("0a1b"), "s"), store_key(Some("2c3d"), "s"));
        assert_eq!(store_key(None, "s"), "-/s");
    }

    fn user(t: &str) -> Value {
        json!({"role": "user", "content": t})
    }
    fn assistant(t: &str) -> Value {
        json!({"role": "assistant", "content": t})
    }

    #[test]
    fn a_tool_result_the_history_already_answers_is_a_conflict() {
        let call = json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
        let result = |t: &str| json!({"role": "tool", "tool_call_id": "t1", "content": t});
        let stored = vec![
            user("do it"),
            call.clone(),
            result("one"),
            assistant("done"),
        ];
        // Sent again after the reply was stored, the same or another.
        for again in [result("one"), result("one AGAIN")] {
            let client = vec![again];
            let m = merge(&client, &stored, 25);
            assert!(m.answers_again(&client), "{:?}", m.messages(&client));
        }
        // The next turn of the same session, and a call of its own: none.
        let client = vec![user("next")];
        assert!(!merge(&client, &stored, 25).answers_again(&client));
        let stored = vec![user("do it"), call.clone()];
        let client = vec![result("one")];
        let m = merge(&client, &stored, 25);
        assert!(!m.answers_again(&client));
        assert_eq!(
            m.messages(&client),
            vec![user("do it"), call.clone(), result("one")]
        );
        // Responses: the call is an item of its own with the `call_id` its
        // output answers; the output sent after it is no second answer.
        let fc = json!({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"});
        let out = |t: &str| json!({"type": "function_call_output", "call_id": "c1", "output": t});
        let stored = vec![user("do it"), fc.clone()];
        let client = vec![out("one")];
        let m = merge(&client, &stored, 25);
        assert!(!m.answers_again(&client), "{:?}", m.messages(&client));
        let stored = vec![user("do it"), fc, out("one"), assistant("done")];
        let client = vec![out("one again")];
        assert!(merge(&client, &stored, 25).answers_again(&client));
        // An upstream that makes the same id again (`call_0` each answer):
        // the client's result answers the newest call.
        let stored = vec![
            user("do it"),
            call.clone(),
            result("one"),
            assistant("done"),
            user("again"),
            call,
        ];
        let client = vec![result("two")];
        assert!(!merge(&client, &stored, 25).answers_again(&client));
    }

    #[test]
    fn history_goes_between_the_system_prompt_and_the_new_messages() {
        let stored = vec![user("a"), assistant("A"), user("b"), assistant("B")];
        let sys = json!({"role": "system", "content": "be brief"});
        let client = vec![sys.clone(), user("c")];
        let m = merge(&client, &stored, 25);
        assert_eq!(
            m.messages(&client),
            vec![
                sys.clone(),
                user("a"),
                assistant("A"),
                user("b"),
                assistant("B"),
                user("c")
            ]
        );
        assert_eq!(m.new, vec![user("c")]);
        assert_eq!(m.history_used, 4);
        let m = merge(&[user("c")], &stored, 2);
        assert_eq!(
            m.messages(&[user("c")]),
            vec![user("b"), assistant("B"), user("c")],
            "depth"
        );
    }

    #[test]
    fn a_prefill_is_not_history() {
        let stored = [user("a"), assistant("A")];
        let client = [user("b"), assistant("Sure, ")];
        let m = merge(&client, &stored, 25);
        assert_eq!(m.history, stored.to_vec(), "the history goes in");
        assert_eq!(m.new, vec![user("b")], "the question is stored");
        assert_eq!(
            m.messages(&client),
            vec![user("a"), assistant("A"), user("b"), assistant("Sure, ")]
        );
    }

    #[test]
    fn a_new_session_stores_the_conversation_its_first_request_brings() {
        let call = json!({"role": "assistant", "tool_calls": [{"id": "call_A", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
        let result = json!({"role": "tool", "tool_call_id": "call_A", "content": "A"});
        let client = vec![
            json!({"role": "system", "content": "s"}),
            user("u1"),
            call.clone(),
            result.clone(),
        ];
        let m = merge(&client, &[], 25);
        assert_eq!(m.new, vec![user("u1"), call.clone(), result.clone()]);
        assert_eq!(m.new_at, vec![1, 2, 3], "positions in the client's list");
        assert!(m.history.is_empty());
        // A stored session the client's history does not match (compacted):
        // the result's call is not stored, so its turn is stored with it…
        let m = merge(&client, &[user("other"), assistant("O")], 25);
        assert_eq!(m.new, vec![call.clone(), result.clone()]);
        // …while a result answering the stored reply's call comes alone.
        let m = merge(&client, &[user("other"), call.clone()], 25);
        assert_eq!(m.new, vec![result]);
        // Responses: a turn of parallel calls is several items, stored
        // whole with their results.
        let fc = |id: &str| json!({"type": "function_call", "call_id": id, "name": "f", "arguments": "{}"});
        let out = |id: &str| json!({"type": "function_call_output", "call_id": id, "output": "r"});
        let client = vec![user("u1"), fc("A"), fc("B"), out("A"), out("B")];
        let m = merge(&client, &[user("other"), assistant("O")], 25);
        assert_eq!(m.new, vec![fc("A"), fc("B"), out("A"), out("B")]);
    }

    #[test]
    fn cache_markers_are_cut_from_inserted_history_and_nothing_else() {
        let raw = br#"{"role": "user", "cache_control": {"type": "ephemeral"}, "content": [ {"type":"text","text":"q","cache_control":{"type":"ephemeral","ttl":"5m"}}, {"cache_control":{"type":"ephemeral"},"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"r","cache_control":{"type":"ephemeral"}}]}, {"type":"tool_use","id":"u","name":"f","input":{"cache_control":"a tool's own field"}} ]}"#;
        let out = without_cache_markers(raw).unwrap();
        let text = String::from_utf8(out.clone()).unwrap();
        assert_eq!(text.matches("cache_control").count(), 1, "{text}");
        let v: Value = serde_json::from_slice(&out).unwrap();
        let mut want: Value = serde_json::from_slice(raw).unwrap();
        want.as_object_mut().unwrap().remove("cache_control");
        for (i, path) in [(0, None), (1, None), (1, Some(0))] {
            let block = &mut want["content"][i];
            let block = match path {
                Some(k) => &mut block["content"][k],
                None => block,
            };
            block.as_object_mut().unwrap().remove("cache_control");
        }
        assert_eq!(v, want, "only the markers went");
        // The other bytes as they were.
        assert!(
            text.starts_with(
                r#"{"role": "user", "content": [ {"type":"text","text":"q"}, {"type":"tool_result""#
            ),
            "{text}"
        );
        assert_eq!(
            without_cache_markers(br#"{"role":"user","content":"no marker"}"#),
            None
        );
        assert_eq!(
            without_cache_markers(br#"{"cache_control":{}}"#).unwrap(),
            b"{}"
        );
        // Named twice: left as it was rather than cut into invalid JSON.
        for twice in [
            &br#"{"role":"user","content":"x","cache_control":{},"cache_control":{}}"#[..],
            br#"{"cache_control":{},"cache_control":{}}"#,
            br#"{"cache_control":{},"cache_control":{},"role":"user"}"#,
        ] {
            if let Some(out) = without_cache_markers(twice) {
                serde_json::from_slice::<Value>(&out).unwrap();
            }
        }
    }

    #[test]
    fn history_is_spliced_into_the_client_bytes() {
        let h: Vec<Vec<u8>> = [user("h1"), assistant("H")]
            .iter()
            .map(|m| serde_json::to_vec(m).unwrap())
            .collect();
        let h: Vec<&[u8]> = h.iter().map(Vec::as_slice).collect();
        let body = br#"{ "model" : "m", "messages" : [ {"role":"system","content":"s"} , {"role":"user","content":"new"} ], "x":1}"#;
        let out = insert_items(body, "messages", 1, &h).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v["messages"],
            json!([{"role":"system","content":"s"}, user("h1"), assistant("H"), user("new")])
        );
        // Every other byte as it was.
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.starts_with(
                r#"{ "model" : "m", "messages" : [ {"role":"system","content":"s"} , "#
            )
        );
        assert!(text.ends_with(r#"{"role":"user","content":"new"} ], "x":1}"#));
        // At the end, into an empty array, nothing to insert, no array.
        let v: Value =
            serde_json::from_slice(&insert_items(body, "messages", 9, &h).unwrap()).unwrap();
        assert_eq!(v["messages"][3], assistant("H"));
        let v: Value = serde_json::from_slice(
            &insert_items(br#"{"messages":[ ]}"#, "messages", 0, &h).unwrap(),
        )
        .unwrap();
        assert_eq!(v["messages"], json!([user("h1"), assistant("H")]));
        assert_eq!(
            insert_items(body, "messages", 0, &[]).unwrap(),
            body.to_vec()
        );
        assert!(insert_items(br#"{"input":"text"}"#, "input", 0, &h).is_none());
    }

    #[test]
    fn re_sent_messages_are_not_doubled() {
        let stored = vec![user("a"), assistant("A")];
        // The SDK sends the reply back with fields of its own.
        let echoed =
            json!({"role": "assistant", "content": "A", "refusal": null, "annotations": []});
        let client = vec![user("a"), echoed, user("b")];
        let m = merge(&client, &stored, 25);
        // The client's own copies go, nothing is inserted.
        assert_eq!(m.messages(&client), client);
        assert_eq!(m.history_used, 0);
        assert_eq!(m.new, vec![user("b")]);
        // A client repeating only the stored tail's user message: not doubled.
        let m = merge(&[user("a"), user("b")], &[user("a")], 25);
        assert_eq!(
            m.messages(&[user("a"), user("b")]),
            vec![user("a"), user("b")]
        );
        assert_eq!(m.new, vec![user("b")]);
    }

    #[test]
    fn history_never_starts_on_an_orphaned_tool_result() {
        let call = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
        let result = json!({"role": "tool", "tool_call_id": "c1", "content": "42"});
        let stored = vec![
            user("a"),
            call.clone(),
            result.clone(),
            assistant("it is 42"),
        ];
        let m = merge(&[user("b")], &stored, 2);
        assert_eq!(
            m.messages(&[user("b")]),
            vec![assistant("it is 42"), user("b")]
        );
        let m = merge(&[user("b")], &stored, 3);
        assert_eq!(
            m.messages(&[user("b")]),
            vec![call, result, assistant("it is 42"), user("b")]
        );
    }
}
