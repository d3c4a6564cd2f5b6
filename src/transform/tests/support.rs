//! What the transform tests share: the SPEC's default rules, plans, a
//! request run through `rewrite`, conversation builders, the bill of a
//! replayed conversation, and the expansion of notes.

use std::collections::HashSet;

use proptest::prelude::*;
use serde_json::{Value, json};

use crate::transform::*;

pub(crate) fn fixture(name: &str) -> Vec<u8> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/");
    std::fs::read(format!("{path}{name}")).unwrap()
}

/// The SPEC's defaults: keep_turns 2, max_per_request 10, dedupe, runs of
/// 2 lines and 64 bytes.
pub(crate) const DEFAULTS: Rules = Rules {
    keep_turns: 2,
    max_images: 10,
    hard_max_images: None,
    dedupe: true,
    prompt_cache: true,
    context_permille: 800,
    context_window: None,
    dedup: Some(dedup::Blocks {
        min_lines: 2,
        min_bytes: 64,
    }),
};

pub(crate) fn plan(shape: Shape, vision: bool, rules: Rules) -> Plan {
    Plan {
        shape,
        vision,
        describe: false,
        rules,
        takes: Takes::ALL,
        query_aware: false,
        fit: crate::transform::Limits::NONE,
    }
}

/// The request as sent (the original when nothing changed) and the report.
pub(crate) fn run(body: &Value, plan: &Plan) -> (Value, Report) {
    let bytes = serde_json::to_vec(body).unwrap();
    let r = rewrite(&bytes, plan);
    let sent = r.body.as_deref().unwrap_or(&bytes);
    (serde_json::from_slice(sent).unwrap(), r.report)
}

pub(crate) fn chat(body: &Value) -> (Value, Report) {
    run(body, &plan(Shape::Chat, true, DEFAULTS))
}

pub(crate) fn content(v: &Value, i: usize) -> &str {
    v["messages"][i]["content"].as_str().unwrap()
}

/// A file of `n` numbered lines, as an editor tool shows it.
pub(crate) fn file(n: usize) -> Vec<String> {
    (1..=n)
        .map(|i| match i % 4 {
            0 => "}".to_owned(),
            1 => format!("fn step_{i}(input: &str) -> Result<usize, Error> {{"),
            2 => format!("    let parsed = input.trim().parse::<usize>()?; // line {i}"),
            _ => format!("    Ok(parsed * {i})"),
        })
        .collect()
}

pub(crate) fn call(id: &str) -> Value {
    json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "exec_command", "arguments": "{}"}}]})
}

pub(crate) fn tool(id: &str, text: &str) -> Value {
    json!({"role": "tool", "tool_call_id": id, "content": text})
}

// ---- the fixtures, turn by turn ----

/// The requests an agent sends for a transcript: after each user message
/// and after each tool result, the messages so far.
pub(crate) fn turns(body: &Value) -> Vec<Value> {
    let msgs = body["messages"].as_array().unwrap();
    let mut out = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        if matches!(m["role"].as_str(), Some("user" | "tool")) {
            let mut req = body.clone();
            req["messages"] = Value::Array(msgs[..=i].to_vec());
            out.push(req);
        }
    }
    out
}

pub(crate) fn assert_prefix_stable(name: &str, vision: bool) -> (usize, usize) {
    let body: Value = serde_json::from_slice(&fixture(name)).unwrap();
    let p = plan(Shape::Chat, vision, DEFAULTS);
    let mut previous: Option<Value> = None;
    let (mut sent, mut original) = (0, 0);
    for (k, req) in turns(&body).iter().enumerate() {
        let (out, _) = run(req, &p);
        let msgs = out["messages"].as_array().unwrap();
        if let Some(prev) = &previous {
            let prev = prev["messages"].as_array().unwrap();
            assert_eq!(
                &msgs[..prev.len()],
                &prev[..],
                "{name}: turn {k} changed an earlier message"
            );
        }
        sent += serde_json::to_vec(&out).unwrap().len();
        original += serde_json::to_vec(req).unwrap().len();
        previous = Some(out);
    }
    (sent, original)
}

// ---- images for every model ----

pub(crate) fn screenshots() -> (Value, Vec<Vec<u8>>) {
    let body: Value = serde_json::from_slice(&fixture("agent-tool-images-6turns.json")).unwrap();
    let pngs = body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["content"].as_array())
        .flat_map(|parts| parts.iter().filter_map(|p| p["image_url"]["url"].as_str()))
        .map(|u| {
            let b64 = u.split_once(',').unwrap().1;
            base64_simd::STANDARD.decode_to_vec(b64).unwrap()
        })
        .collect();
    (body, pngs)
}

pub(crate) fn actions(report: &Report) -> Vec<&'static str> {
    report.images.iter().map(|n| n.action).collect()
}

/// A screenshot agent of `n` turns made from the 6-turn fixture: the
/// user's mockup, then per turn a call and a tool result holding a text and
/// a screenshot of its own (the fixture's first, with the turn appended to
/// its bytes, so no two are the same image).
pub(crate) fn screenshot_agent(n: usize) -> Value {
    let (body, pngs) = screenshots();
    let mut msgs = vec![body["messages"][0].clone()];
    for t in 0..n {
        let id = format!("call_render_{t}");
        let mut png = pngs[1].clone();
        png.extend_from_slice(format!("turn {t}").as_bytes());
        let url = format!(
            "data:image/png;base64,{}",
            base64_simd::STANDARD.encode_to_string(&png)
        );
        msgs.push(json!({"role": "assistant", "content": format!("Rendering attempt {t}."), "tool_calls": [{"id": id, "type": "function", "function": {"name": "render_page", "arguments": "{}"}}]}));
        msgs.push(json!({"role": "tool", "tool_call_id": id, "content": [{"type": "text", "text": format!("Rendered attempt {t}.")}, {"type": "image_url", "image_url": {"url": url}}]}));
    }
    json!({"model": "gpt-4o", "messages": msgs})
}

/// A request's billed tokens given the messages the previous request sent:
/// the leading run identical to them at a tenth, text at 4 bytes a token,
/// an image at 765.
pub(crate) fn billed(msgs: &[Value], previous: &[Value], cache: bool) -> f64 {
    let cached = match cache {
        true => previous
            .iter()
            .zip(msgs)
            .take_while(|(a, b)| a == b)
            .count(),
        false => 0,
    };
    msgs.iter()
        .enumerate()
        .map(|(i, m)| {
            let mut m = m.clone();
            let mut images = 0.0;
            if let Some(parts) = m["content"].as_array_mut() {
                let before = parts.len();
                parts.retain(|p| p["type"] != "image_url");
                images = (before - parts.len()) as f64;
            }
            let tokens = serde_json::to_vec(&m).unwrap().len() as f64 / 4.0 + images * 765.0;
            if i < cached { tokens / 10.0 } else { tokens }
        })
        .sum()
}

/// Every request of a conversation through `rules`: for each, the first
/// message that differs from the previous request's rewrite (`None`: the
/// previous request is a prefix), and the billed cost so far with visor and
/// without (with a prompt cache when `rules.prompt_cache`).
/// What [`replay`] saw: where each request broke the previous one's
/// prefix, the billed cost so far (with visor, without), every rewrite.
pub(crate) type Replayed = (Vec<Option<usize>>, Vec<(f64, f64)>, Vec<Value>);

pub(crate) fn replay(body: &Value, rules: Rules) -> Replayed {
    let p = plan(Shape::Chat, true, rules);
    let (mut prev_in, mut prev_out): (Vec<Value>, Vec<Value>) = (Vec::new(), Vec::new());
    let (mut breaks, mut costs, mut outs) = (Vec::new(), Vec::new(), Vec::new());
    let (mut with, mut without) = (0.0, 0.0);
    for req in turns(body) {
        let (sent, _) = run(&req, &p);
        let msgs = sent["messages"].as_array().unwrap().clone();
        let orig = req["messages"].as_array().unwrap().clone();
        if !prev_out.is_empty() {
            breaks.push(prev_out.iter().zip(&msgs).position(|(a, b)| a != b));
        }
        with += billed(&msgs, &prev_out, rules.prompt_cache);
        without += billed(&orig, &prev_in, rules.prompt_cache);
        costs.push((with, without));
        prev_in = orig;
        prev_out = msgs;
        outs.push(sent);
    }
    (breaks, costs, outs)
}

// ---- properties ----

/// Status lines of several agents' forms (see `status.rs` for all).
pub(crate) const STATUS_FORMS: [&str; 4] = [
    "<returncode>1</returncode>",
    "[Command finished with exit code 0]",
    "Traceback (most recent call last):",
    "Permission denied",
];

/// A random conversation from a small vocabulary, so lines and blocks
/// repeat.
pub(crate) fn conversation() -> impl Strategy<Value = Value> {
    let line = prop::sample::select(vec![
        "[10:00] alice: the retention policy needs a tax branch first, before section 4",
        "[10:01] bob: section 4 keeps personal data three years after the account closes",
        "[10:02] carol: GoBD asks for ten years on tax records, which conflicts with that",
        "Always answer in English, whatever the question, and cite the section you used.",
        "ok",
        "",
        "}",
        "  indented repeated line of text, as a file view or a log would show it to us",
        "```",
        "{\"a\": 1}",
        "[3 omitted]",
        "ünïcödé line, long enough to matter here, and then some more of it to be sure",
        // status lines: never inside a removed run
        STATUS_FORMS[0],
        STATUS_FORMS[1],
        STATUS_FORMS[2],
        STATUS_FORMS[3],
    ]);
    let block = prop::collection::vec(line, 1..7);
    let text = prop::collection::vec(block, 0..5).prop_map(|bs| {
        // Blocks repeat as wholes: each is used twice in a row sometimes.
        let mut out: Vec<&str> = Vec::new();
        for b in &bs {
            out.extend(b.iter().copied());
            if b.len() % 2 == 0 {
                out.extend(b.iter().copied());
            }
        }
        out.join("\n")
    });
    let message = (0..4usize, text, any::<bool>(), 0..3usize).prop_map(|(role, text, parts, id)| {
        let content = if parts {
            json!([{"type": "text", "text": text}, {"type": "text", "text": "x"}])
        } else {
            json!(text)
        };
        match role {
            0 => json!({"role": "user", "content": content}),
            1 => json!({"role": "assistant", "content": content}),
            2 => json!({"role": "tool", "tool_call_id": format!("call_{id}"), "content": content}),
            _ => json!({"role": "system", "content": content}),
        }
    });
    // Some messages repeat an earlier one's content whole (a re-read file,
    // a rerun command): references.
    let copies = prop::collection::vec((0..12usize, 0..12usize), 0..3);
    (prop::collection::vec(message, 1..12), copies).prop_map(|(mut m, copies)| {
        for (from, to) in copies {
            if from < to && to < m.len() {
                let content = m[from]["content"].clone();
                m[to]["content"] = content;
            }
        }
        json!({"model": "m", "messages": m})
    })
}

pub(crate) fn texts(m: &Value) -> Vec<String> {
    match &m["content"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a
            .iter()
            .filter_map(|p| p["text"].as_str().map(str::to_owned))
            .collect(),
        _ => vec![],
    }
}

pub(crate) fn all_lines(v: &Value) -> HashSet<String> {
    let mut out = HashSet::new();
    for m in v["messages"].as_array().unwrap() {
        for t in texts(m) {
            out.extend(t.split('\n').map(str::to_owned));
        }
    }
    out
}

pub(crate) fn skeleton(v: &Value) -> Vec<(Value, Value, usize)> {
    v["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let parts = m["content"].as_array().map_or(0, Vec::len);
            (m["role"].clone(), m["tool_call_id"].clone(), parts)
        })
        .collect()
}

/// The request's texts with every note replaced by what it names: a run
/// note by those lines of the message it names (as sent), a reference by
/// that message's text, expanded (the status lines after a reference
/// restate its own). Gives the original back when every note says truly
/// where its lines are.
pub(crate) fn expand(out: &Value) -> Vec<Vec<String>> {
    let msgs = out["messages"].as_array().unwrap();
    let mut expanded: Vec<Vec<String>> = Vec::new();
    for m in msgs {
        let sent: Vec<String> = texts(m);
        let mut mine = Vec::new();
        for t in &sent {
            let mut lines: Vec<String> = Vec::new();
            for l in t.split('\n') {
                match dedup::Note::parse(l) {
                    Some(dedup::Note::Same { message, .. }) => {
                        lines = vec![expanded[message - 1].join("\n")];
                        break;
                    }
                    Some(dedup::Note::Run(places)) => {
                        for p in places {
                            let source: Vec<String> = texts(&msgs[p.message - 1])
                                .join("\n")
                                .split('\n')
                                .map(str::to_owned)
                                .collect();
                            lines.extend(source[p.first - 1..p.last].iter().cloned());
                        }
                    }
                    _ => lines.push(l.to_owned()),
                }
            }
            mine.push(lines.join("\n"));
        }
        expanded.push(mine);
    }
    expanded
}

/// The places a run note names, in order: (message, first line, last line).
pub(crate) fn note_places(note: &str) -> Vec<(usize, usize, usize)> {
    match dedup::Note::parse(&format!("[omitted: {note}]")) {
        Some(dedup::Note::Run(places)) => places
            .into_iter()
            .map(|p| (p.message, p.first, p.last))
            .collect(),
        other => panic!("not a run note: {note} ({other:?})"),
    }
}
