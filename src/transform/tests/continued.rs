//! A request walked and deduped from what the conversation's previous
//! request left ([`prefix_key`], [`walk_from`], [`Scanned::finish_from`])
//! writes the same body, byte for byte, as the request read in full — every turn of
//! generated conversations, with an earlier message edited or dropped, a
//! retry, the instructions changed, images kept and replaced — and does
//! continue where it can.

use proptest::prelude::*;
use serde_json::{Value, json};

use crate::transform::*;

use super::support::*;

/// What each request left (its walk up to its last message's end and
/// dedup's state) by [`prefix_key`], newest last, taken out when used (as
/// the proxy's cache does).
#[derive(Default)]
struct Kept {
    states: Vec<(u128, usize, walk::Scan, dedup::State)>,
    continued: usize,
}

impl Kept {
    /// `body` walked and finished from a kept state when it begins with
    /// that state's messages, and what it read kept.
    fn finish(&mut self, body: &[u8], plan: &Plan) -> Option<Vec<u8>> {
        let found = self.states.iter().rposition(|(key, end, _, _)| {
            *end < body.len() && prefix_key(conversation_seed(plan, 0), &body[..*end]) == *key
        });
        let (walked, state) = match found.map(|i| self.states.remove(i)) {
            Some((_, end, scan, state)) => (walk_from(body, plan, scan, end), Some(state)),
            None => (walk(body, plan), None),
        };
        let mut scanned = match walked {
            Ok(s) => s,
            Err(done) => return done.body,
        };
        let kept = scanned.scan().clone();
        scanned.resolve(body);
        let (rewrite, left) = scanned.finish_from(body, &[], state);
        self.continued += usize::from(rewrite.report.dedup_continued);
        if let (Some(left), Some((scan, end))) = (left, kept.upto_messages()) {
            self.states.push((
                prefix_key(conversation_seed(plan, 0), &body[..end]),
                end,
                scan,
                left,
            ));
        }
        rewrite.body
    }
}

/// Each request finished from the states the earlier ones left, compared
/// with the same request read in full. Returns how many continued.
fn same_as_full(requests: &[Value], plan: &Plan) -> Result<usize, TestCaseError> {
    let mut kept = Kept::default();
    for (t, req) in requests.iter().enumerate() {
        let body = serde_json::to_vec(req).unwrap();
        let full = rewrite(&body, plan).body;
        let continued = kept.finish(&body, plan);
        prop_assert!(
            full == continued,
            "request {} differs:\nfull      {}\ncontinued {}",
            t,
            String::from_utf8_lossy(full.as_deref().unwrap_or(&body)),
            String::from_utf8_lossy(continued.as_deref().unwrap_or(&body))
        );
    }
    Ok(kept.continued)
}

/// The conversation's requests as an agent sends them: its first `t`
/// messages, for every `t`.
fn growing(body: &Value) -> Vec<Value> {
    let msgs = body["messages"].as_array().unwrap();
    (1..=msgs.len())
        .map(|t| {
            let mut req = body.clone();
            req["messages"] = Value::Array(msgs[..t].to_vec());
            req
        })
        .collect()
}

/// What a client may do between two requests besides adding messages.
#[derive(Debug, Clone)]
enum Change {
    /// Edits message `at`'s text (a client that rewrites its history).
    Edit(usize),
    /// Drops message `at` (a client trimming its context).
    Drop(usize),
    /// Sends the same request again (a retry).
    Retry,
}

fn change() -> impl Strategy<Value = (usize, Change)> {
    let what = prop_oneof![
        (0..12usize).prop_map(Change::Edit),
        (0..12usize).prop_map(Change::Drop),
        Just(Change::Retry),
    ];
    (1..12usize, what)
}

/// The growing requests with `changes` applied: after request `turn`, the
/// change holds for every later request too (an edited message stays
/// edited).
fn changed(body: &Value, changes: &[(usize, Change)]) -> Vec<Value> {
    let mut msgs = body["messages"].as_array().unwrap().clone();
    let mut out = Vec::new();
    let mut t = 1;
    while t <= msgs.len() {
        let mut req = body.clone();
        req["messages"] = Value::Array(msgs[..t].to_vec());
        out.push(req);
        for (turn, c) in changes {
            if *turn != out.len() {
                continue;
            }
            match c {
                Change::Edit(at) if *at < t => {
                    msgs[*at]["content"] =
                        json!(format!("edited\n{}", texts(&msgs[*at]).join("\n")));
                }
                Change::Drop(at) if *at < t && t > 1 => {
                    msgs.remove(*at);
                    t -= 1;
                }
                Change::Retry => out.push(out[out.len() - 1].clone()),
                _ => {}
            }
        }
        t += 1;
    }
    out
}

/// Each request's walk continued from the walk of the request before
/// (when it begins with that one's messages) finds what a whole walk
/// finds. Returns how many continued.
fn walks_continue(requests: &[Value], shape: Shape) -> Result<usize, TestCaseError> {
    let mut before: Option<(Vec<u8>, walk::Scan)> = None;
    let mut continued = 0;
    for (t, req) in requests.iter().enumerate() {
        let body = serde_json::to_vec(req).unwrap();
        let whole = walk::scan(&body, shape).unwrap();
        if let Some((prev, scan)) = before.take()
            && let Some((prefix, end)) = scan.upto_messages()
            && body.starts_with(&prev[..end])
        {
            let again = walk::scan_from(&body, shape, prefix, end).unwrap();
            prop_assert_eq!(format!("{again:?}"), format!("{whole:?}"), "request {}", t);
            continued += 1;
        }
        before = Some((body, whole));
    }
    Ok(continued)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn a_walk_continued_finds_what_a_whole_walk_finds(body in conversation()) {
        let requests = growing(&body);
        prop_assert_eq!(walks_continue(&requests, Shape::Chat)?, requests.len() - 1);
    }

    #[test]
    fn every_turn_continued_is_the_full_read(body in conversation()) {
        let requests = growing(&body);
        let continued = same_as_full(&requests, &plan(Shape::Chat, true, DEFAULTS))?;
        // Every request after the first continues the one before.
        prop_assert_eq!(continued, requests.len() - 1);
    }

    #[test]
    fn edits_drops_and_retries_read_the_same(
        body in conversation(),
        changes in prop::collection::vec(change(), 0..4),
    ) {
        let requests = changed(&body, &changes);
        same_as_full(&requests, &plan(Shape::Chat, true, DEFAULTS))?;
    }
}

/// A tool-calling agent whose results repeat blocks of earlier ones (a
/// file read again, a test run again), so dedup rewrites most of them.
fn repeating_agent(turns: usize) -> Value {
    let file = file(40);
    let mut msgs = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Fix the parser."}),
    ];
    for t in 0..turns {
        let id = format!("call_{t}");
        msgs.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "bash", "arguments": "{}"}}]}));
        let at = (t * 7) % 20;
        let text = format!(
            "run {t}\n{}\nexit code {}",
            file[at..at + 15].join("\n"),
            t % 2
        );
        msgs.push(tool(&id, &text));
    }
    json!({"model": "gpt-4o", "messages": msgs})
}

#[test]
fn a_rewritten_history_continues_byte_for_byte() {
    let body = repeating_agent(30);
    let requests = growing(&body);
    let p = plan(Shape::Chat, true, DEFAULTS);
    let continued = same_as_full(&requests, &p).unwrap();
    assert_eq!(continued, requests.len() - 1);
    // Dedup did rewrite: the test compares rewrites, not untouched bodies.
    let last = serde_json::to_vec(requests.last().unwrap()).unwrap();
    assert!(rewrite(&last, &p).report.lines_omitted > 100);
}

#[test]
fn instructions_outside_the_messages_are_part_of_the_key() {
    // Anthropic `system` after the messages, changed at the fourth turn:
    // its lines are never the source of a note, so what is rewritten
    // depends on it.
    let file = file(30);
    let system_a = file[..10].join("\n");
    let system_b = "Be brief.".to_owned();
    let mut requests = Vec::new();
    let mut msgs: Vec<Value> = vec![json!({"role": "user", "content": "Read the file."})];
    for t in 0..8 {
        msgs.push(json!({"role": "assistant", "content": [{"type": "tool_use", "id": format!("t{t}"), "name": "read", "input": {}}]}));
        msgs.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": format!("t{t}"), "content": format!("{}\npass {t}", file[..20].join("\n"))}]}));
        let system = if t < 3 { &system_a } else { &system_b };
        requests.push(json!({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": msgs, "system": system}));
    }
    let p = plan(Shape::Messages, true, DEFAULTS);
    // The walk continues too: the system after the messages is read again.
    assert_eq!(
        walks_continue(&requests, Shape::Messages).unwrap(),
        requests.len() - 1
    );
    let continued = same_as_full(&requests, &p).unwrap();
    // All but the first and the one whose system changed.
    assert_eq!(continued, requests.len() - 2);
}

#[test]
fn images_replaced_are_read_in_full_and_kept_ones_continue() {
    let body = screenshot_agent(6);
    let requests = growing(&body);
    assert_eq!(
        walks_continue(&requests, Shape::Chat).unwrap(),
        requests.len() - 1
    );
    // A model that cannot see: texts replace the screenshots, nothing is
    // continued (a state holds the client's texts only).
    let blind = same_as_full(&requests, &plan(Shape::Chat, false, DEFAULTS)).unwrap();
    assert_eq!(blind, 0);
    // One that can: the screenshots stay, the texts continue, until the
    // image rules age the old screenshots out.
    let seeing = same_as_full(&requests, &plan(Shape::Chat, true, DEFAULTS)).unwrap();
    assert!(seeing > 0, "nothing continued");
}

#[test]
fn a_different_plan_never_continues_another_plans_state() {
    let body = repeating_agent(6);
    let requests = growing(&body);
    let mut kept = Kept::default();
    let a = plan(Shape::Chat, true, DEFAULTS);
    let mut other = DEFAULTS;
    other.dedup = Some(dedup::Blocks {
        min_lines: 3,
        min_bytes: 200,
    });
    let b = plan(Shape::Chat, true, other);
    // Turns alternate between the plans: each continues its own plan's
    // state of two requests before, never the other's.
    for (t, req) in requests.iter().enumerate() {
        let body = serde_json::to_vec(req).unwrap();
        let p = if t % 2 == 0 { &a } else { &b };
        assert_eq!(kept.finish(&body, p), rewrite(&body, p).body, "request {t}");
    }
    assert_eq!(kept.continued, requests.len() - 2);
    // A state of one plan only: the same request under the other plan is
    // read in full; under its own it continues.
    let last = serde_json::to_vec(requests.last().unwrap()).unwrap();
    let mut only_a = Kept::default();
    only_a.finish(&last, &a);
    assert_eq!(only_a.finish(&last, &b), rewrite(&last, &b).body);
    assert_eq!(only_a.continued, 0, "continued another plan's state");
    assert_eq!(only_a.finish(&last, &a), rewrite(&last, &a).body);
    assert_eq!(only_a.continued, 1);
}

/// `v` written with its `first` member first (serde_json writes keys
/// sorted), pretty-printed or compact.
fn written(v: &Value, first: &str, pretty: bool) -> Vec<u8> {
    let obj = v.as_object().unwrap();
    let write = |x: &Value| match pretty {
        true => serde_json::to_string_pretty(x).unwrap(),
        false => serde_json::to_string(x).unwrap(),
    };
    let mut parts = vec![format!("{:?}:{}", first, write(&obj[first]))];
    for (k, x) in obj {
        if k != first {
            parts.push(format!("{k:?}:{}", write(x)));
        }
    }
    let sep = if pretty { ",\n  " } else { "," };
    format!("{{{}}}", parts.join(sep)).into_bytes()
}

/// Requests as bytes: each continued from the states the earlier ones
/// left, compared with its full read; how many continued.
fn same_as_full_bytes(requests: &[Vec<u8>], plan: &Plan) -> usize {
    let mut kept = Kept::default();
    for (t, body) in requests.iter().enumerate() {
        let full = rewrite(body, plan).body;
        assert!(full == kept.finish(body, plan), "request {t} differs");
    }
    kept.continued
}

#[test]
fn system_first_pretty_bodies_and_responses_input_continue_the_same() {
    let file = file(30);
    let mut anthropic = Vec::new();
    let mut chat = Vec::new();
    let mut responses = Vec::new();
    let (mut a_msgs, mut c_msgs, mut r_items) = (
        vec![json!({"role": "user", "content": "Read it."})],
        vec![json!({"role": "user", "content": "Read it."})],
        vec![json!({"role": "user", "content": "Read it."})],
    );
    for t in 0..8 {
        let out = format!("{}\npass {t}", file[..20].join("\n"));
        a_msgs.push(json!({"role": "assistant", "content": [{"type": "tool_use", "id": format!("t{t}"), "name": "read", "input": {}}]}));
        a_msgs.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": format!("t{t}"), "content": out}]}));
        c_msgs.push(call(&format!("c{t}")));
        c_msgs.push(tool(&format!("c{t}"), &out));
        r_items.push(json!({"type": "function_call", "call_id": format!("r{t}"), "name": "read", "arguments": "{}"}));
        r_items.push(
            json!({"type": "function_call_output", "call_id": format!("r{t}"), "output": out}),
        );
        let a = json!({"model": "claude-sonnet-4-5", "max_tokens": 100, "system": file[..10].join("\n"), "messages": a_msgs});
        anthropic.push(written(&a, "system", false));
        chat.push(written(
            &json!({"model": "gpt-4o", "messages": c_msgs}),
            "model",
            true,
        ));
        let r = json!({"model": "gpt-4o", "instructions": file[..10].join("\n"), "input": r_items});
        responses.push(written(&r, "instructions", false));
    }
    assert!(String::from_utf8_lossy(&anthropic[0]).starts_with("{\"system\""));
    assert!(String::from_utf8_lossy(&chat[0]).contains(",\n  \"messages\""));
    for (requests, shape) in [
        (&anthropic, Shape::Messages),
        (&chat, Shape::Chat),
        (&responses, Shape::Responses),
    ] {
        let p = plan(shape, true, DEFAULTS);
        let continued = same_as_full_bytes(requests, &p);
        assert_eq!(continued, requests.len() - 1, "{shape:?}");
        // Dedup did rewrite them: what is compared is a rewrite.
        assert!(
            rewrite(requests.last().unwrap(), &p).report.lines_omitted > 50,
            "{shape:?}"
        );
    }
}

#[test]
fn a_continued_walks_work_is_its_new_texts_unless_dedup_reads_all_again() {
    // Anthropic `system` after the messages: the walk continues whether
    // or not it changed; dedup only when it did not.
    let file = file(40);
    let turn = |n: usize, system: &str| {
        let mut msgs = vec![json!({"role": "user", "content": "Read it."})];
        for t in 0..n {
            msgs.push(json!({"role": "assistant", "content": [{"type": "tool_use", "id": format!("t{t}"), "name": "read", "input": {}}]}));
            msgs.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": format!("t{t}"), "content": format!("{}\npass {t}", file.join("\n"))}]}));
        }
        serde_json::to_vec(&json!({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": msgs, "system": system})).unwrap()
    };
    let p = plan(Shape::Messages, true, DEFAULTS);
    let (first, next) = (turn(6, "Be brief."), turn(7, "Be brief."));
    let mut scanned = walk(&first, &p).unwrap();
    let walked = scanned.scan().clone();
    scanned.resolve(&first);
    let whole_work = walk(&next, &p).unwrap().work();
    let (_, state) = scanned.finish_from(&first, &[], None);
    let state = state.unwrap();
    let (prefix, end) = walked.upto_messages().unwrap();
    // The same instructions: continued, its work the last result's text.
    let mut same = walk_from(&next, &p, prefix.clone(), end).unwrap();
    assert!(same.continues(&state, &next));
    assert!(
        same.work() * 5 < whole_work,
        "{} of {whole_work}",
        same.work()
    );
    // Changed instructions: the walk continued, dedup reads all again,
    // and says so in its work.
    let changed = turn(7, "Be thorough.");
    let mut other = walk_from(&changed, &p, prefix, end).unwrap();
    assert!(!other.continues(&state, &changed));
    assert_eq!(other.work(), whole_work);
}

proptest! {
    /// The prefix hasher fed a body in any pieces, its digest taken at any
    /// points on the way, gives at each point [`prefix_digest`] of the
    /// bytes up to there: the check of a body as it comes and the dedup
    /// state's key agree however the body was cut.
    #[test]
    fn the_prefix_hasher_in_pieces_digests_as_at_once(
        body in proptest::collection::vec(any::<u8>(), 0..3000),
        cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..12),
    ) {
        let mut at: Vec<usize> = cuts.iter().map(|c| c.index(body.len() + 1)).collect();
        at.push(body.len());
        at.sort_unstable();
        let mut h = prefix_hasher();
        let mut from = 0;
        for to in at {
            h.update(&body[from..to]);
            prop_assert_eq!(h.digest128(), prefix_digest(&body[..to]), "at {}", to);
            from = to;
        }
    }
}
