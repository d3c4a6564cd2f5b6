//! Context dedup and the image rules for every model: examples in every API
//! shape, the fixtures turn by turn, and properties (no distinct line lost,
//! determinism, idempotence, roles and ids unchanged, prefix stability).

use std::collections::HashSet;

use proptest::prelude::*;
use serde_json::{Value, json};

use super::images::sha256_hex;
use super::*;

fn fixture(name: &str) -> Vec<u8> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/fixtures/");
    std::fs::read(format!("{path}{name}")).unwrap()
}

/// The SPEC's defaults: keep_turns 2, max_per_request 10, dedupe, lines of
/// 16 characters or more.
const DEFAULTS: Rules = Rules {
    keep_turns: 2,
    max_images: 10,
    dedupe: true,
    min_line_chars: Some(16),
};

fn plan(shape: Shape, vision: bool, rules: Rules) -> Plan {
    Plan {
        shape,
        vision,
        describe: false,
        rules,
    }
}

/// The request as sent (the original when nothing changed) and the report.
fn run(body: &Value, plan: &Plan) -> (Value, Report) {
    let bytes = serde_json::to_vec(body).unwrap();
    let r = rewrite(&bytes, plan);
    let sent = r.body.as_deref().unwrap_or(&bytes);
    (serde_json::from_slice(sent).unwrap(), r.report)
}

fn chat(body: &Value) -> (Value, Report) {
    run(body, &plan(Shape::Chat, true, DEFAULTS))
}

fn content(v: &Value, i: usize) -> &str {
    v["messages"][i]["content"].as_str().unwrap()
}

const L1: &str = "[10:00] alice: the retention policy needs a tax branch first";
const L2: &str = "[10:01] bob: section 4 keeps personal data three years";
const L3: &str = "[10:02] carol: GoBD asks for ten years on tax records";
const L4: &str = "Always answer in English, whatever the question.";

#[test]
fn repeated_lines_go_with_one_note_in_their_place() {
    let body = json!({"model": "m", "messages": [
        {"role": "system", "content": L4},
        {"role": "user", "content": format!("{L1}\n{L2}")},
        {"role": "assistant", "content": format!("{L3}\n{L1}")},
        {"role": "user", "content": "short\nshort\nwhat now?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": format!("{L1}\n{L2}   \n{L4}\n{L3}\nshort\nnew line that nobody said before")},
    ]});
    let (out, report) = chat(&body);
    assert_eq!(
        content(&out, 5),
        "[4 omitted]\nshort\nnew line that nobody said before",
        "L1, L2 (trailing space ignored), L4 (seen in the system message) and \
         L3 (seen in an assistant message) are repeats"
    );
    assert_eq!(report.lines_omitted, 4);
    assert!(report.bytes_saved_dedup > 0);
    assert_eq!(report.bytes_saved, report.bytes_saved_dedup);
    // The assistant's repeat of L1 stays; so do the newest user message's
    // short repeated lines and the system message.
    for i in 0..4 {
        assert_eq!(out["messages"][i], body["messages"][i], "message {i}");
    }
}

#[test]
fn the_newest_user_message_keeps_its_lines_until_a_newer_one_arrives() {
    let mut body = json!({"model": "m", "messages": [
        {"role": "user", "content": format!("{L1}\nfirst question here")},
        {"role": "assistant", "content": "answer one"},
        {"role": "user", "content": format!("{L1}\n{L2}\nsecond question")},
    ]});
    let (out, report) = chat(&body);
    assert_eq!(report.lines_omitted, 0);
    assert_eq!(out, body);
    body["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "answer two"}),
        json!({"role": "user", "content": "third"}),
    ]);
    let (out, _) = chat(&body);
    assert_eq!(
        content(&out, 2),
        format!("[1 omitted]\n{L2}\nsecond question")
    );
    assert_eq!(out["messages"][0], body["messages"][0]);
}

#[test]
fn short_lines_and_fenced_code_stay() {
    let code = "```rust\nfn a() -> Result<(), E> {\n    return Ok(());\n}\n```";
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": format!("{code}\n    return Ok(());")},
        {"role": "tool", "tool_call_id": "c", "content": format!("{code}\nok\nok\n    return Ok(());")},
        {"role": "user", "content": "go on"},
    ]});
    let (out, report) = chat(&body);
    assert_eq!(report.lines_omitted, 2, "{out}");
    assert_eq!(
        content(&out, 0),
        format!("{code}\n[1 omitted]"),
        "a line outside the fence repeating one inside it goes"
    );
    assert_eq!(
        content(&out, 1),
        format!("{code}\nok\nok\n[1 omitted]"),
        "inside fences nothing goes; short lines stay"
    );
}

#[test]
fn json_array_tool_results_lose_repeated_elements_and_stay_json() {
    let a = json!({"id": "m1", "sender": "bob", "content": "section 4 keeps personal data"});
    let b = json!({"id": "m2", "sender": "carol", "content": "GoBD asks for ten years"});
    let c = json!({"id": "m3", "sender": "dave", "content": "I will redraw the chart"});
    // The same element with its keys in another order and other spacing.
    let b_again = r#"{ "content": "GoBD asks for ten years", "sender": "carol", "id": "m2" }"#;
    let second = format!("[\n  {b_again},\n  {c},\n  1,\n  1\n]");
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "fetch"},
        {"role": "tool", "tool_call_id": "c1", "content": serde_json::to_string(&json!([a, b])).unwrap()},
        {"role": "tool", "tool_call_id": "c2", "content": second},
        {"role": "tool", "tool_call_id": "c3", "content": serde_json::to_string(&json!({"rows": [a, b]})).unwrap()},
        {"role": "tool", "tool_call_id": "c4", "content": serde_json::to_string(&json!([a, b])).unwrap()},
        {"role": "user", "content": "and?"},
    ]});
    let (out, report) = chat(&body);
    let (json_text, note) = content(&out, 2).rsplit_once('\n').unwrap();
    assert_eq!(note, "[1 item omitted]");
    let kept: Value = serde_json::from_str(json_text).unwrap();
    assert_eq!(kept, json!([c, 1, 1]), "short elements stay");
    assert!(json_text.starts_with("[\n  {"), "layout kept: {json_text}");
    assert_eq!(
        content(&out, 3),
        content(&body, 3),
        "a JSON object is left whole"
    );
    let (json_text, note) = content(&out, 4).rsplit_once('\n').unwrap();
    assert_eq!(serde_json::from_str::<Value>(json_text).unwrap(), json!([]));
    assert_eq!(note, "[2 items omitted]");
    assert_eq!(report.items_omitted, 3);
}

#[test]
fn no_part_is_left_empty_and_each_message_has_one_note() {
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": format!("{L1}\n{L2}\n{L3}")},
        {"role": "tool", "tool_call_id": "c", "content": [
            {"type": "text", "text": format!("{L1}\nfresh line number one here")},
            {"type": "text", "text": format!("{L2}\n{L3}")},
        ]},
        {"role": "user", "content": "next"},
    ]});
    let (out, report) = chat(&body);
    let parts = out["messages"][1]["content"].as_array().unwrap();
    assert_eq!(parts.len(), 2);
    assert_eq!(parts[0]["text"], "[3 omitted]\nfresh line number one here");
    assert_eq!(parts[1]["text"], dedup_emptied());
    assert_eq!(report.lines_omitted, 3);
}

fn dedup_emptied() -> &'static str {
    "[omitted]"
}

#[test]
fn anthropic_tool_results_are_tool_results_with_a_note_each() {
    let body = json!({"model": "claude", "max_tokens": 10, "messages": [
        {"role": "user", "content": [{"type": "text", "text": format!("{L1}\n{L2}")}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}, {"type": "tool_use", "id": "t2", "name": "f", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": format!("{L1}\nresult one is new")},
            {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": format!("{L2}\nresult two is new")}]},
        ]},
    ]});
    let (out, report) = run(&body, &plan(Shape::Messages, true, DEFAULTS));
    let blocks = out["messages"][2]["content"].as_array().unwrap();
    assert_eq!(
        blocks[0]["content"], "[1 omitted]\nresult one is new",
        "the newest user message holds only tool results: they are deduped"
    );
    assert_eq!(
        blocks[1]["content"][0]["text"],
        "[1 omitted]\nresult two is new"
    );
    assert_eq!(blocks[1]["tool_use_id"], "t2");
    assert_eq!(report.lines_omitted, 2);
    assert_eq!(
        out["messages"][0], body["messages"][0],
        "the user's own text, newest"
    );
}

#[test]
fn responses_function_outputs_are_deduped() {
    let body = json!({"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": format!("{L1}\nplease look")}]},
        {"type": "function_call", "call_id": "f1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "f1", "output": format!("{L1}\n{L2}")},
        {"type": "function_call", "call_id": "f2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "f2", "output": format!("{L2}\n{L3}")},
    ]});
    let (out, report) = run(&body, &plan(Shape::Responses, true, DEFAULTS));
    assert_eq!(out["input"][2]["output"], format!("[1 omitted]\n{L2}"));
    assert_eq!(out["input"][4]["output"], format!("[1 omitted]\n{L3}"));
    assert_eq!(out["input"][4]["call_id"], "f2");
    assert_eq!(report.lines_omitted, 2);
}

#[test]
fn dedup_off_or_nothing_repeated_leaves_the_bytes_alone() {
    let bytes = fixture("agent-history-refetch.json");
    let off = Rules {
        min_line_chars: None,
        ..DEFAULTS
    };
    assert!(
        rewrite(&bytes, &plan(Shape::Chat, true, off))
            .body
            .is_none()
    );
    let fresh = serde_json::to_vec(&json!({"model": "m", "messages": [
        {"role": "user", "content": format!("{L1}\n{L2}")},
        {"role": "tool", "tool_call_id": "c", "content": L3},
    ]}))
    .unwrap();
    let r = rewrite(&fresh, &plan(Shape::Chat, true, DEFAULTS));
    assert!(r.body.is_none());
    assert_eq!(r.report.bytes_saved, 0);
}

// ---- the fixtures, turn by turn ----

/// The requests an agent sends for a transcript: after each user message
/// and after each tool result, the messages so far.
fn turns(body: &Value) -> Vec<Value> {
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

fn assert_prefix_stable(name: &str, vision: bool) -> (usize, usize) {
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

#[test]
fn refetch_fixtures_keep_their_prefix_turn_by_turn() {
    for name in [
        "agent-history-refetch.json",
        "agent-history-refetch-jsonarray.json",
    ] {
        let (sent, original) = assert_prefix_stable(name, false);
        assert!(
            sent * 3 < original,
            "{name}: {sent} of {original} bytes over all turns"
        );
    }
}

#[test]
fn refetch_fixture_keeps_every_distinct_line_and_a_fifth_of_the_bytes() {
    let bytes = fixture("agent-history-refetch.json");
    let r = rewrite(&bytes, &plan(Shape::Chat, false, DEFAULTS));
    let out = r.body.unwrap();
    assert!(
        out.len() * 100 < bytes.len() * 25,
        "{} of {}",
        out.len(),
        bytes.len()
    );
    let lines = |b: &[u8]| -> HashSet<String> {
        let v: Value = serde_json::from_slice(b).unwrap();
        v["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["content"].as_str())
            .flat_map(|c| {
                c.lines()
                    .map(|l| l.trim_end().to_owned())
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let kept = lines(&out);
    let missing: Vec<String> = lines(&bytes).difference(&kept).cloned().collect();
    assert!(missing.is_empty(), "{missing:?}");
    assert_eq!(r.report.lines_omitted, 696);
}

// ---- images for every model ----

fn screenshots() -> (Value, Vec<Vec<u8>>) {
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

fn actions(report: &Report) -> Vec<&'static str> {
    report.images.iter().map(|n| n.action).collect()
}

#[test]
fn tool_images_older_than_keep_turns_age_out() {
    let (body, pngs) = screenshots();
    assert_eq!(pngs.len(), 7);
    let bytes = serde_json::to_vec(&body).unwrap();
    let r = rewrite(&bytes, &plan(Shape::Chat, true, DEFAULTS));
    assert_eq!(
        actions(&r.report),
        [
            "kept", "aged_out", "aged_out", "aged_out", "kept", "kept", "kept"
        ],
        "the user's image stays; screenshots with more than 2 assistant messages after them go"
    );
    assert_eq!(r.report.images_replaced, 3);
    let out: Value = serde_json::from_slice(r.body.as_deref().unwrap()).unwrap();
    for (t, png) in pngs.iter().enumerate().skip(1).take(3) {
        let i = 2 * t;
        let text = out["messages"][i]["content"].as_str().unwrap();
        let sha = sha256_hex(png);
        assert!(
            text.starts_with(&format!(
                "Rendered attempt {}.\n[image sha256:{}",
                t - 1,
                &sha[..12]
            )),
            "{text}"
        );
        assert!(text.contains("an older tool result"), "{text}");
        assert_eq!(
            out["messages"][i]["tool_call_id"],
            body["messages"][i]["tool_call_id"]
        );
    }
    for i in [8, 10, 12, 0] {
        assert_eq!(
            out["messages"][i], body["messages"][i],
            "message {i} untouched"
        );
    }
    let saved: Vec<&str> = r.artifacts.iter().map(|a| a.sha256.as_str()).collect();
    let want: Vec<String> = pngs[1..4].iter().map(|p| sha256_hex(p)).collect();
    assert_eq!(saved, want, "aged-out originals are saved");
    // Kept images of a vision model are never decoded.
    assert!(
        r.report
            .images
            .iter()
            .filter(|n| n.action == "kept")
            .all(|n| n.sha256.is_empty())
    );
}

#[test]
fn the_cap_takes_older_tool_images_first_then_user_images() {
    let (body, _) = screenshots();
    let bytes = serde_json::to_vec(&body).unwrap();
    let with = |rules: Rules| actions(&rewrite(&bytes, &plan(Shape::Chat, true, rules)).report);
    let capped = |max| {
        with(Rules {
            keep_turns: usize::MAX,
            max_images: max,
            ..DEFAULTS
        })
    };
    assert_eq!(capped(10), ["kept"; 7]);
    assert_eq!(
        capped(3),
        [
            "kept", "capped", "capped", "capped", "capped", "kept", "kept"
        ]
    );
    assert_eq!(
        capped(1),
        [
            "kept", "capped", "capped", "capped", "capped", "capped", "capped"
        ],
        "tool images go before the user's own, however new"
    );
    // Aging first, then the cap over what is left.
    assert_eq!(
        with(Rules {
            max_images: 2,
            ..DEFAULTS
        }),
        [
            "kept", "aged_out", "aged_out", "aged_out", "capped", "capped", "kept"
        ]
    );
}

#[test]
fn the_models_max_images_wins_when_smaller() {
    let cfg = crate::config::Config::from_toml(
        "[[upstream]]\nname = \"u\"\nbase_url = \"http://127.0.0.1:9/v1\"\n[images]\nmax_per_request = 6\n[dedup]\nenabled = false\n",
        std::path::Path::new("test.toml"),
        &|_| None,
    )
    .unwrap();
    assert_eq!(Rules::from_config(&cfg, None).max_images, 6);
    assert_eq!(Rules::from_config(&cfg, Some(2)).max_images, 2);
    assert_eq!(Rules::from_config(&cfg, Some(50)).max_images, 6);
    assert_eq!(Rules::from_config(&cfg, None).min_line_chars, None);
}

#[test]
fn a_later_copy_of_an_image_becomes_a_reference() {
    let (body, pngs) = screenshots();
    let url = body["messages"][0]["content"][1]["image_url"]["url"].clone();
    let mut b = body.clone();
    // Two more turns whose screenshots are the user's mockup again.
    for t in 6..8 {
        let id = format!("call_render_{t}");
        b["messages"].as_array_mut().unwrap().extend([
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "render_page", "arguments": "{}"}}]}),
            json!({"role": "tool", "tool_call_id": id, "content": [{"type": "text", "text": "Rendered."}, {"type": "image_url", "image_url": {"url": url}}]}),
        ]);
    }
    let bytes = serde_json::to_vec(&b).unwrap();
    let r = rewrite(&bytes, &plan(Shape::Chat, true, DEFAULTS));
    let acts = actions(&r.report);
    assert_eq!(&acts[7..], ["deduped", "deduped"]);
    let out: Value = serde_json::from_slice(r.body.as_deref().unwrap()).unwrap();
    let sha = sha256_hex(&pngs[0]);
    assert_eq!(
        out["messages"][14]["content"],
        format!(
            "Rendered.\n[image sha256:{}: the same image as earlier in this conversation]",
            &sha[..12]
        )
    );
    assert_eq!(out["messages"][0], b["messages"][0], "the first copy stays");
    assert!(r.artifacts.iter().any(|a| a.sha256 == sha));
    let off = rewrite(
        &bytes,
        &plan(
            Shape::Chat,
            true,
            Rules {
                dedupe: false,
                ..DEFAULTS
            },
        ),
    );
    assert_eq!(&actions(&off.report)[7..], ["kept", "kept"]);
}

#[test]
fn a_text_only_model_gets_the_rules_first_and_describes_only_the_rest() {
    let (body, _) = screenshots();
    let bytes = serde_json::to_vec(&body).unwrap();
    let p = Plan {
        describe: true,
        ..plan(Shape::Chat, false, DEFAULTS)
    };
    let scanned = scan(&bytes, &p).unwrap();
    let fates = scanned.fates().to_vec();
    assert_eq!(fates[1], Fate::Replaced(Reason::AgedOut));
    assert_eq!(fates[6], Fate::Replaced(Reason::NonVision));
    let subjects = scanned.subjects();
    let lookup: Vec<bool> = subjects.iter().map(|(_, s)| s.lookup_only).collect();
    assert_eq!(
        lookup,
        [false, true, true, true, false, false, false],
        "aged-out images may only take a cached description"
    );
    let r = scanned.finish(&bytes, &[]);
    assert_eq!(r.report.images_replaced, 7);
    assert_eq!(
        actions(&r.report),
        [
            "stripped", "aged_out", "aged_out", "aged_out", "stripped", "stripped", "stripped"
        ]
    );
}

/// How the window moves a provider's cacheable prefix: for each request of
/// the 6-turn fixture, the first message that differs from the previous
/// request's rewrite (`None`: the previous request is a prefix).
fn prefix_breaks(rules: Rules, vision: bool) -> Vec<Option<usize>> {
    let (body, _) = screenshots();
    let p = plan(Shape::Chat, vision, rules);
    let mut previous: Option<Vec<Value>> = None;
    let mut out = Vec::new();
    for req in turns(&body) {
        let (sent, _) = run(&req, &p);
        let msgs = sent["messages"].as_array().unwrap().clone();
        if let Some(prev) = &previous {
            out.push(prev.iter().zip(&msgs).position(|(a, b)| a != b));
        }
        previous = Some(msgs);
    }
    out
}

#[test]
fn aging_rewrites_each_tool_message_once_when_it_leaves_the_window() {
    let breaks = prefix_breaks(DEFAULTS, true);
    // Requests after tool results 0..5 (each compared with the one before):
    // tool result t (message 2t + 2) ages out with the request after tool
    // result t + 3, and that request is the only one it changes.
    assert_eq!(breaks, [None, None, None, Some(2), Some(4), Some(6)]);
    let none = prefix_breaks(
        Rules {
            keep_turns: usize::MAX,
            ..DEFAULTS
        },
        true,
    );
    assert!(none.iter().all(Option::is_none));
}

// ---- properties ----

/// A random conversation from a small vocabulary, so lines repeat.
fn conversation() -> impl Strategy<Value = Value> {
    let line = prop::sample::select(vec![
        L1,
        L2,
        L3,
        L4,
        "ok",
        "",
        "  indented repeated line of text",
        "```",
        "{\"a\": 1}",
        "[3 omitted]",
        "ünïcödé line, long enough",
    ]);
    let text = prop::collection::vec(line, 0..6).prop_map(|ls| ls.join("\n"));
    let message = (0..4usize, text, any::<bool>()).prop_map(|(role, text, parts)| {
        let content = if parts {
            json!([{"type": "text", "text": text}, {"type": "text", "text": "x"}])
        } else {
            json!(text)
        };
        match role {
            0 => json!({"role": "user", "content": content}),
            1 => json!({"role": "assistant", "content": content}),
            2 => json!({"role": "tool", "tool_call_id": "c", "content": content}),
            _ => json!({"role": "system", "content": content}),
        }
    });
    prop::collection::vec(message, 1..12).prop_map(|m| json!({"model": "m", "messages": m}))
}

fn all_lines(v: &Value) -> HashSet<String> {
    let mut out = HashSet::new();
    for m in v["messages"].as_array().unwrap() {
        let texts: Vec<&str> = match &m["content"] {
            Value::String(s) => vec![s],
            Value::Array(a) => a.iter().filter_map(|p| p["text"].as_str()).collect(),
            _ => vec![],
        };
        for t in texts {
            out.extend(t.split('\n').map(|l| l.trim_end().to_owned()));
        }
    }
    out
}

fn skeleton(v: &Value) -> Vec<(Value, Value, usize)> {
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn no_distinct_line_is_lost_and_roles_and_ids_stay(body in conversation()) {
        let (out, _) = chat(&body);
        let missing: Vec<String> = all_lines(&body).difference(&all_lines(&out)).cloned().collect();
        prop_assert!(missing.is_empty(), "lost {:?}", missing);
        prop_assert_eq!(skeleton(&out), skeleton(&body));
        // One note per message at most (beyond those the client sent).
        let notes = |m: &Value| -> usize {
            let texts: Vec<&str> = match &m["content"] {
                Value::String(s) => vec![s.as_str()],
                Value::Array(a) => a.iter().filter_map(|p| p["text"].as_str()).collect(),
                _ => vec![],
            };
            texts.iter().flat_map(|t| t.lines()).filter(|l| l.starts_with('[') && l.ends_with(" omitted]")).count()
        };
        let msgs = body["messages"].as_array().unwrap();
        for (m, o) in msgs.iter().zip(out["messages"].as_array().unwrap()) {
            prop_assert!(notes(o) <= notes(m) + 1, "{}", o);
        }
    }

    #[test]
    fn deterministic_and_idempotent(body in conversation(), min in prop::sample::select(vec![4usize, 16])) {
        // At 4 characters visor's own notes are long enough to repeat.
        let p = plan(Shape::Chat, true, Rules { min_line_chars: Some(min), ..DEFAULTS });
        let (once, _) = run(&body, &p);
        let (again, _) = run(&body, &p);
        prop_assert_eq!(&once, &again);
        let (twice, report) = run(&once, &p);
        prop_assert_eq!(&twice, &once);
        prop_assert_eq!(report.lines_omitted, 0);
    }

    #[test]
    fn earlier_messages_stay_as_the_conversation_grows(body in conversation(), more in conversation()) {
        let (before, _) = chat(&body);
        let mut longer = body.clone();
        let added = more["messages"].as_array().unwrap().clone();
        longer["messages"].as_array_mut().unwrap().extend(added.iter().cloned());
        let (after, _) = chat(&longer);
        let a = before["messages"].as_array().unwrap();
        let b = after["messages"].as_array().unwrap();
        // Everything before the newest user message stays; it may change
        // once a newer user message arrives (the SPEC's one exception).
        let newest_user = a.iter().rposition(|m| m["role"] == "user");
        let newer_user = added.iter().any(|m| m["role"] == "user");
        let stable = match (newest_user, newer_user) {
            (Some(u), true) => u,
            _ => a.len(),
        };
        prop_assert_eq!(&b[..stable], &a[..stable]);
    }
}
