//! One request, side by side: each message as the client sent it and as
//! the upstream got it, with every change labelled by the rule that made it
//! and why. Read from the kept bodies and the transform's report, when the
//! request is looked at (never on the request's own path).

use serde::Serialize;
use serde_json::Value;

use crate::api::Shape;
use crate::transform::ImageNote;
use crate::transform::dedup::is_note;

/// A change and the rule behind it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Label {
    /// `images`, `documents`, `audio`, `dedup`, `session`, `cache`.
    pub rule: &'static str,
    /// `described by gpt-4o-mini`, `not shown: this model cannot see
    /// images`, `omitted: message 7 lines 3-14`, `breakpoint added`…
    pub reason: String,
    /// The original's id (12 hex digits) when it was saved as an artifact.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub artifact: Option<String>,
}

/// One message (Responses: input item), both ways.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Pair {
    /// `system` for the top-level head (system, instructions, tools),
    /// else the message's index as sent upstream.
    pub at: String,
    pub role: String,
    /// As the client sent it (`None`: visor added it).
    pub client: Option<Value>,
    /// As the upstream got it.
    pub upstream: Option<Value>,
    pub changed: bool,
    pub labels: Vec<Label>,
}

/// What the detail is read from.
pub struct Sides<'a> {
    pub shape: Shape,
    pub client: &'a Value,
    /// `None`: sent as the client sent it.
    pub upstream: Option<&'a Value>,
    pub notes: &'a [ImageNote],
    /// Stored session messages put among the client's: how many, and
    /// before which of the client's messages (after its leading system
    /// and developer messages).
    pub history_used: usize,
    pub history_at: usize,
    /// The describer's model, for `described by …`.
    pub describer: &'a str,
}

/// The messages side by side, the head first when there is one.
pub fn pairs(s: &Sides<'_>) -> Vec<Pair> {
    let upstream = s.upstream.unwrap_or(s.client);
    let key = items_key(s.shape);
    let mut out = Vec::new();
    if let Some(head) = head(s.shape, s.client, upstream) {
        out.push(head);
    }
    let list = |v: &Value| -> Vec<Value> {
        match v.get(key) {
            Some(Value::Array(a)) => a.clone(),
            Some(Value::String(text)) => {
                vec![serde_json::json!({"role": "user", "content": text})]
            }
            _ => Vec::new(),
        }
    };
    let (client, sent) = (list(s.client), list(upstream));
    let n = sent.len().max(client.len() + s.history_used);
    for i in 0..n {
        let up = sent.get(i).cloned();
        let (at, h) = (s.history_at, s.history_used);
        let added = (at..at + h).contains(&i);
        let cl = match i < at {
            true => client.get(i).cloned(),
            false if added => None,
            false => client.get(i - h).cloned(),
        };
        let mut labels = Vec::new();
        if added {
            labels.push(label("session", "stored history added (x-visor-session)"));
        }
        for note in s
            .notes
            .iter()
            .filter(|n| note_index(&n.path, key) == Some(i))
        {
            labels.extend(image_label(note, s.describer));
        }
        if let (Some(c), Some(u)) = (&cl, &up) {
            labels.extend(dedup_labels(c, u));
            if markers(u) > markers(c) {
                labels.push(label("cache", "breakpoint added"));
            }
        }
        let role = up
            .as_ref()
            .or(cl.as_ref())
            .and_then(|m| m.get("role").or_else(|| m.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        out.push(Pair {
            at: i.to_string(),
            role,
            changed: cl != up,
            client: cl,
            upstream: up,
            labels,
        });
    }
    if let Some(k) = upstream.get("prompt_cache_key")
        && s.client.get("prompt_cache_key").is_none()
        && let Some(first) = out.first_mut()
    {
        first.labels.push(Label {
            rule: "cache",
            reason: format!("prompt_cache_key {k} added"),
            artifact: None,
        });
    }
    out
}

fn items_key(shape: Shape) -> &'static str {
    match shape {
        Shape::Responses => "input",
        Shape::Chat | Shape::Messages => "messages",
    }
}

fn label(rule: &'static str, reason: impl Into<String>) -> Label {
    Label {
        rule,
        reason: reason.into(),
        artifact: None,
    }
}

/// The top level before the messages: Anthropic `system` and `tools`,
/// Responses `instructions` and `tools`, Chat `tools`.
fn head(shape: Shape, client: &Value, upstream: &Value) -> Option<Pair> {
    let fields: &[&str] = match shape {
        Shape::Messages => &["system", "tools"],
        Shape::Responses => &["instructions", "tools"],
        Shape::Chat => &["tools"],
    };
    let pick = |v: &Value| {
        let mut o = serde_json::Map::new();
        for f in fields {
            if let Some(x) = v.get(*f) {
                o.insert((*f).to_owned(), x.clone());
            }
        }
        (!o.is_empty()).then_some(Value::Object(o))
    };
    let (c, u) = (pick(client), pick(upstream));
    if c.is_none() && u.is_none() {
        return None;
    }
    let mut labels = Vec::new();
    if let (Some(c), Some(u)) = (&c, &u)
        && markers(u) > markers(c)
    {
        labels.push(label("cache", "breakpoint added"));
    }
    Some(Pair {
        at: "system".to_owned(),
        role: "system".to_owned(),
        changed: c != u,
        client: c,
        upstream: u,
        labels,
    })
}

/// The message index a note's path names (`messages[3].content[1]`).
fn note_index(path: &str, key: &str) -> Option<usize> {
    let rest = path.strip_prefix(key)?.strip_prefix('[')?;
    let end = rest.find(']')?;
    rest[..end].parse().ok()
}

fn image_label(n: &ImageNote, describer: &str) -> Option<Label> {
    let why = n.reason.map(|r| r.words()).unwrap_or("");
    let what = match n.medium {
        "document" => "documents",
        "audio" => "audio",
        _ => "images",
    };
    let reason = match n.action {
        "kept" => return None,
        "described" => format!("described by {describer} ({why})"),
        "stripped" => format!("not shown: {why}"),
        "aged_out" => format!("aged out: {why}"),
        "capped" => format!("capped: {why}"),
        "deduped" => format!("deduped: {why}"),
        "resized" => match (n.width, n.height, n.sent) {
            (Some(w), Some(h), Some(s)) => format!(
                "resized to fit the model: {w}x{h} → {}x{} {} ({} bytes)",
                s.width, s.height, s.media_type, s.bytes
            ),
            (_, _, Some(s)) => format!(
                "resized to fit the model: {}x{} {}",
                s.width, s.height, s.media_type
            ),
            _ => "resized to fit the model".to_owned(),
        },
        "hoisted" => "sent as an image part: it was base64 written in the text".to_owned(),
        "converted" => match (&n.name, &n.media_type) {
            (Some(name), _) => format!("read as text: {name}"),
            (None, Some(t)) => format!("read as text: {t}"),
            (None, None) => "read as text".to_owned(),
        },
        other => other.to_owned(),
    };
    Some(Label {
        rule: what,
        reason,
        artifact: (n.sha256.len() >= 12).then(|| n.sha256[..12].to_owned()),
    })
}

/// Dedup's notes in the upstream message that the client's did not have.
fn dedup_labels(client: &Value, upstream: &Value) -> Vec<Label> {
    let mut seen = Vec::new();
    texts(client, &mut seen, 0);
    let mut sent = Vec::new();
    texts(upstream, &mut sent, 0);
    let had = |line: &str| seen.iter().any(|t| t.lines().any(|l| l == line));
    let mut out = Vec::new();
    for t in &sent {
        for line in t.lines().filter(|l| is_note(l) && !had(l)) {
            let inner = line.trim().trim_start_matches('[').trim_end_matches(']');
            out.push(label("dedup", inner));
        }
    }
    out
}

/// Every string in `v`.
fn texts<'a>(v: &'a Value, out: &mut Vec<&'a str>, depth: usize) {
    if depth > 64 {
        return;
    }
    match v {
        Value::String(s) => out.push(s),
        Value::Array(a) => a.iter().for_each(|x| texts(x, out, depth + 1)),
        Value::Object(o) => o.values().for_each(|x| texts(x, out, depth + 1)),
        _ => {}
    }
}

/// `cache_control` markers in `v`.
fn markers(v: &Value) -> usize {
    fn walk(v: &Value, depth: usize) -> usize {
        if depth > 64 {
            return 0;
        }
        match v {
            Value::Array(a) => a.iter().map(|x| walk(x, depth + 1)).sum(),
            Value::Object(o) => {
                usize::from(o.contains_key("cache_control"))
                    + o.values().map(|x| walk(x, depth + 1)).sum::<usize>()
            }
            _ => 0,
        }
    }
    walk(v, 0)
}

/// An image note for the tests of this module and its neighbours.
#[cfg(test)]
pub(super) fn tests_note(action: &'static str) -> ImageNote {
    note("messages[0].content", action, None)
}

#[cfg(test)]
fn note(
    path: &str,
    action: &'static str,
    reason: Option<crate::transform::placeholder::Reason>,
) -> ImageNote {
    ImageNote {
        path: path.to_owned(),
        sha256: "7ae32ec79dcb0123456789".to_owned(),
        kind: "base64",
        medium: "image",
        name: None,
        media_type: Some("image/png".to_owned()),
        bytes: None,
        width: None,
        height: None,
        url: None,
        problem: None,
        action,
        reason,
        in_tool_result: false,
        sent: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transform::placeholder::Reason;
    use serde_json::json;

    #[test]
    fn each_change_is_labelled_where_it_was_made() {
        let client = json!({"model": "m", "system": "be brief", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image", "source": {}}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "a\nb\nc"}]});
        let upstream = json!({"model": "m", "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}], "messages": [
            {"role": "user", "content": "earlier"},
            {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "text", "text": "[image sha256:7ae32ec79dcb: a chart]"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "a\n[omitted: message 1 lines 2-3]"}]});
        let notes = [
            note(
                "messages[1].content[1]",
                "described",
                Some(Reason::NonVision),
            ),
            note("messages[2].content", "kept", None),
        ];
        let p = pairs(&Sides {
            shape: Shape::Messages,
            client: &client,
            upstream: Some(&upstream),
            notes: &notes,
            history_used: 1,
            history_at: 0,
            describer: "gpt-4o-mini",
        });
        assert_eq!(p.len(), 5);
        assert_eq!((p[0].at.as_str(), p[0].changed), ("system", true));
        assert_eq!(p[0].labels, [label("cache", "breakpoint added")]);
        assert!(p[1].client.is_none() && p[1].labels[0].rule == "session");
        assert_eq!(p[2].client.as_ref(), Some(&client["messages"][0]));
        assert_eq!(
            p[2].labels,
            [Label {
                rule: "images",
                reason: "described by gpt-4o-mini (this model cannot see images)".into(),
                artifact: Some("7ae32ec79dcb".into()),
            }]
        );
        assert!(!p[3].changed && p[3].labels.is_empty());
        assert_eq!(
            p[4].labels,
            [label("dedup", "omitted: message 1 lines 2-3")]
        );
    }

    #[test]
    fn a_resized_image_says_from_what_to_what() {
        let mut n = note("messages[0].content[1]", "resized", None);
        n.width = Some(9000);
        n.height = Some(6000);
        n.sent = Some(crate::transform::report::Sent {
            media_type: "image/png",
            bytes: 631_057,
            width: 8000,
            height: 5333,
        });
        let l = image_label(&n, "gpt-4o-mini").unwrap();
        assert_eq!(l.rule, "images");
        assert_eq!(
            l.reason,
            "resized to fit the model: 9000x6000 → 8000x5333 image/png (631057 bytes)"
        );
        // The original is linked.
        assert_eq!(l.artifact.as_deref(), Some("7ae32ec79dcb"));
        let h = image_label(&note("messages[1]", "hoisted", None), "m").unwrap();
        assert!(h.reason.starts_with("sent as an image part"));
    }

    #[test]
    fn history_goes_after_the_leading_system_message() {
        let client = json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "and now?"}]});
        let upstream = json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "before"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "and now?"}]});
        let p = pairs(&Sides {
            shape: Shape::Chat,
            client: &client,
            upstream: Some(&upstream),
            notes: &[],
            history_used: 2,
            history_at: 1,
            describer: "d",
        });
        let shown: Vec<(bool, bool, usize)> = p
            .iter()
            .map(|x| (x.client.is_some(), x.changed, x.labels.len()))
            .collect();
        assert_eq!(
            shown,
            [
                (true, false, 0),
                (false, true, 1),
                (false, true, 1),
                (true, false, 0)
            ]
        );
        assert_eq!(p[3].client.as_ref(), Some(&client["messages"][1]));
    }

    #[test]
    fn unchanged_and_odd_bodies() {
        let client = json!({"input": "hello", "instructions": "x"});
        let p = pairs(&Sides {
            shape: Shape::Responses,
            client: &client,
            upstream: None,
            notes: &[],
            history_used: 0,
            history_at: 0,
            describer: "d",
        });
        assert_eq!(p.len(), 2);
        assert!(p.iter().all(|x| !x.changed && x.labels.is_empty()));
        let p = pairs(&Sides {
            shape: Shape::Chat,
            client: &json!([1, 2]),
            upstream: Some(&json!({"messages": 3})),
            notes: &[],
            history_used: 0,
            history_at: 0,
            describer: "d",
        });
        assert!(p.is_empty());
    }
}
