//! Context dedup (`dedup.rs`): examples in every shape, the fixtures turn
//! by turn, and properties (no distinct line lost, determinism,
//! idempotence, roles and ids unchanged, prefix stability).

use std::collections::HashSet;

use proptest::prelude::*;
use serde_json::{Value, json};

use crate::transform::*;

use super::support::*;

#[test]
fn a_reread_file_becomes_one_note_naming_where() {
    let f = file(16);
    let mut changed = f.clone();
    changed[6] = "    Ok(parsed * 700) // changed".to_owned();
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "fix step 7"},
        call("call_a"),
        tool("call_a", &f.join("\n")),
        call("call_b"),
        tool("call_b", &changed.join("\n")),
    ]});
    let (out, report) = chat(&body);
    assert_eq!(content(&out, 2), f.join("\n"), "the first read stays");
    assert_eq!(
        content(&out, 4),
        format!(
            "[omitted: message 3 lines 1-6]\n{}\n[omitted: message 3 lines 8-16]",
            changed[6]
        ),
        "short lines such as `}}` go with their block; the changed line stays"
    );
    assert_eq!(report.lines_omitted, 15);
    assert_eq!(report.bytes_saved, report.bytes_saved_dedup);
    assert!(report.bytes_saved > 0);
}

#[test]
fn single_repeated_lines_in_new_output_stay() {
    let status = "Process exited with code 0 after the full build";
    let first = format!("{status}\nbuilding crate alpha v0.1.0 from source\nfinished alpha");
    let second = format!("building crate beta v0.2.0 from source\n{status}\nfinished beta in 3.1s");
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "build"},
        call("c1"), tool("c1", &first),
        call("c2"), tool("c2", &second),
    ]});
    let (out, report) = chat(&body);
    assert_eq!(out, body);
    assert_eq!(report.lines_omitted, 0);
}

#[test]
fn a_codex_exec_command_result_repeated_keeps_its_status_lines() {
    let cat = file(10).join("\n");
    let result = |chunk: &str, wall: &str| {
        format!(
            "Chunk ID: {chunk}\nWall time: {wall} seconds\nProcess exited with code 0\nOriginal token count: 212\nOutput:\n{cat}"
        )
    };
    let body = json!({"model": "gpt-5-codex", "messages": [
        {"role": "user", "content": "show me src/lib.rs twice"},
        call("call_1"), tool("call_1", &result("3b1f2a", "0.0512")),
        call("call_2"), tool("call_2", &result("9c04d1", "0.0481")),
    ]});
    let (out, _) = chat(&body);
    assert_eq!(
        content(&out, 4),
        "Chunk ID: 9c04d1\nWall time: 0.0481 seconds\nProcess exited with code 0\nOriginal token count: 212\nOutput:\n[omitted: message 3 lines 6-15]",
        "the head's status lines stay, the repeated output goes"
    );
}

/// A run repeated whole, with outcomes inside it in forms other runners
/// and tools print: each stays in the newest result, the run around it
/// goes (found by a black-box run: the whole result was one note).
#[test]
fn outcomes_inside_a_repeated_run_stay_whatever_prints_them() {
    let work: Vec<String> = (0..8)
        .map(|i| {
            format!(
                "worker {i}: processed {} records from the nightly import batch",
                i * 13
            )
        })
        .collect();
    let outcomes = [
        "rc=2",
        "0 passing, 3 failing",
        "not ok 3 - parses an empty file",
        "HTTP/1.1 503 Service Unavailable",
        "CRITICAL: disk full",
        "connect ECONNREFUSED 127.0.0.1:5432",
        "Remember to run migrations.",
    ];
    let mut lines: Vec<&str> = Vec::new();
    for o in outcomes {
        lines.extend(work[..3].iter().map(String::as_str));
        lines.push(o);
    }
    lines.extend(work.iter().map(String::as_str));
    let log = lines.join("\n");
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "run it twice"},
        call("c1"), tool("c1", &log),
        call("c2"), tool("c2", &format!("second run:\n{log}")),
    ]});
    let (out, report) = chat(&body);
    let newest = content(&out, 4);
    for o in outcomes {
        assert!(newest.lines().any(|l| l == o), "{o:?} went: {newest}");
    }
    assert!(
        report.lines_omitted > 0,
        "the repeated work still goes: {newest}"
    );
}

#[test]
fn a_claude_code_bash_result_keeps_its_exit_code() {
    let tests: Vec<String> = (0..8)
        .map(|i| {
            format!(
                "tests/test_math.py::test_case_{i} PASSED                        [{:>3}%]",
                12 * i
            )
        })
        .collect();
    let run1 = format!(
        "Exit code 1\n{}\n1 failed, 8 passed in 0.31s",
        tests.join("\n")
    );
    let run2 = format!(
        "Exit code 1\n{}\n1 failed, 8 passed in 0.29s",
        tests.join("\n")
    );
    let body = json!({"model": "claude-opus-4-5", "messages": [
        {"role": "user", "content": "run the tests"},
        call("toolu_01"), tool("toolu_01", &run1),
        call("toolu_02"), tool("toolu_02", &run2),
    ]});
    let (out, _) = chat(&body);
    assert_eq!(
        content(&out, 4),
        "Exit code 1\n[omitted: message 3 lines 2-9]\n1 failed, 8 passed in 0.29s"
    );
}

#[test]
fn a_whole_repeated_tool_result_becomes_a_reference_to_the_call() {
    let text = file(10).join("\n");
    let small = "{\"status\":\"ok\",\"rows\":3,\"table\":\"orders\"}";
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "read it"},
        call("call_abc"), tool("call_abc", &text),
        call("call_def"), tool("call_def", &text),
        call("call_ghi"), tool("call_ghi", small),
        call("call_jkl"), tool("call_jkl", small),
    ]});
    let (out, report) = chat(&body);
    assert_eq!(content(&out, 4), "[omitted: same as message 3 (call_abc)]");
    assert_eq!(
        content(&out, 8),
        small,
        "a result under 256 bytes stays whole: a look-up would cost more than it saves"
    );
    assert_eq!(out["messages"][4]["tool_call_id"], "call_def");
    assert_eq!(report.lines_omitted, 10);
    // Responses and Anthropic name their calls too.
    let responses = json!({"model": "m", "input": [
        {"role": "user", "content": "read it"},
        {"type": "function_call", "call_id": "fc_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "fc_1", "output": text},
        {"type": "function_call", "call_id": "fc_2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "fc_2", "output": text},
    ]});
    let (out, _) = run(&responses, &plan(Shape::Responses, true, DEFAULTS));
    assert_eq!(
        out["input"][4]["output"],
        "[omitted: same as message 3 (fc_1)]"
    );
    let anthropic = json!({"model": "claude", "max_tokens": 10, "messages": [
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": text}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": text}]}]},
    ]});
    let (out, _) = run(&anthropic, &plan(Shape::Messages, true, DEFAULTS));
    assert_eq!(
        out["messages"][4]["content"][0]["content"][0]["text"],
        "[omitted: same as message 3 (toolu_1)]"
    );
    assert_eq!(out["messages"][4]["content"][0]["tool_use_id"], "toolu_2");
}

#[test]
fn the_newest_user_message_is_rewritten_when_it_arrives_and_never_again() {
    let f = file(8).join("\n");
    let view = format!("[File: src/lib.rs (8 lines total)]\n{f}");
    let mut body = json!({"model": "m", "messages": [
        {"role": "system", "content": "You are an autonomous programmer."},
        {"role": "user", "content": "Fix the parser in src/lib.rs."},
        {"role": "assistant", "content": "open src/lib.rs"},
        {"role": "user", "content": view},
        {"role": "assistant", "content": "scroll_down"},
        {"role": "user", "content": format!("{view}\n(Open file: src/lib.rs)")},
    ]});
    let (out, _) = chat(&body);
    assert_eq!(
        content(&out, 5),
        "[File: src/lib.rs (8 lines total)]\n[omitted: message 4 lines 2-9]\n(Open file: src/lib.rs)",
        "an observation sent as a user message is deduped as soon as it arrives; its status lines stay"
    );
    body["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "submit"}),
        json!({"role": "user", "content": "done"}),
    ]);
    let (later, _) = chat(&body);
    assert_eq!(
        later["messages"].as_array().unwrap()[..6],
        out["messages"].as_array().unwrap()[..]
    );
}

#[test]
fn repeated_blocks_inside_code_fences_go_too() {
    let code = format!("```rust\n{}\n```", file(8).join("\n"));
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "Help me with my parser."},
        {"role": "assistant", "content": "Show me the code."},
        {"role": "user", "content": format!("Here is the code:\n{code}")},
        {"role": "assistant", "content": "What should change?"},
        {"role": "user", "content": format!("The same code again:\n{code}\nwhy does step 5 fail?")},
    ]});
    let (out, _) = chat(&body);
    assert_eq!(
        content(&out, 4),
        "The same code again:\n[omitted: message 3 lines 2-11]\nwhy does step 5 fail?"
    );
}

#[test]
fn json_arrays_lose_repeated_elements_and_pretty_objects_dedup_by_blocks() {
    let long = |s: &str| {
        format!(
            "{s}; {}",
            "the thread goes on about retention rules and the audit ".repeat(3)
        )
    };
    let a = json!({"id": "m1", "sender": "bob", "content": long("section 4 keeps personal data")});
    let b = json!({"id": "m2", "sender": "carol", "content": long("GoBD asks for ten years")});
    let c = json!({"id": "m3", "sender": "dave", "content": long("I will redraw the chart")});
    // The same element with its keys in another order and other spacing.
    let b_again = format!(
        r#"{{ "content": {}, "sender": "carol", "id": "m2" }}"#,
        json!(long("GoBD asks for ten years"))
    );
    let second = format!("[\n  {b_again},\n  {c},\n  1,\n  1\n]");
    let object = "{\n  \"customer_id\": \"C1001\",\n  \"full_name\": \"John Smith\",\n  \"email\": \"john.smith@example.com\",\n  \"address\": {\n    \"street\": \"123 Main St\",\n    \"city\": \"Anytown\",\n    \"zip_code\": \"90210\"\n  },\n  \"notes\": \"Prefers email contact; account opened in 2019 after the spring promotion.\",\n  \"plan\": \"P1001\"\n}".to_owned();
    let object2 = object.replace("P1001", "P2002");
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "fetch"},
        tool("c1", &serde_json::to_string(&json!([a, b])).unwrap()),
        tool("c2", &second),
        tool("c3", &serde_json::to_string(&json!([a, c, b])).unwrap()),
        tool("c4", &object),
        tool("c5", &object2),
    ]});
    let (out, report) = chat(&body);
    let (json_text, note) = content(&out, 2).rsplit_once('\n').unwrap();
    assert_eq!(note, "[1 item omitted: message 2]");
    let kept: Value = serde_json::from_str(json_text).unwrap();
    assert_eq!(kept, json!([c, 1, 1]), "short elements stay");
    assert!(json_text.starts_with("[\n  {"), "layout kept: {json_text}");
    let (json_text, note) = content(&out, 3).rsplit_once('\n').unwrap();
    assert_eq!(serde_json::from_str::<Value>(json_text).unwrap(), json!([]));
    assert_eq!(note, "[3 items omitted: messages 2, 3]");
    assert_eq!(report.items_omitted, 4);
    assert_eq!(
        content(&out, 5),
        "[omitted: message 5 lines 1-10]\n  \"plan\": \"P2002\"\n}",
        "a pretty-printed object loses its repeated block"
    );
}

#[test]
fn a_client_line_that_looks_like_a_note_stays() {
    let f = file(8).join("\n");
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "Look at the notes."},
        {"role": "assistant", "content": "show me"},
        {"role": "user", "content": format!("[omitted: message 9 lines 1-2]\n{f}")},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": format!("[omitted: message 9 lines 1-2]\n{f}\nmore")},
    ]});
    let (out, _) = chat(&body);
    assert_eq!(
        content(&out, 4),
        "[omitted: message 9 lines 1-2]\n[omitted: message 3 lines 2-9]\nmore"
    );
}

/// A note never points into its own message (but for a block repeated back
/// to back): a log printing a traceback twice, or a demonstration showing a
/// file again, stays as it is; the whole log sent again later is a
/// reference followed by its status lines.
#[test]
fn a_block_repeated_apart_inside_one_message_stays() {
    let trace = file(8).join("\n");
    let log = format!("collecting 3 items\n{trace}\nretrying once\n{trace}\n1 failed");
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "run the tests"},
        call("c1"), tool("c1", &log),
    ]});
    let (out, report) = chat(&body);
    assert_eq!(out, body);
    assert_eq!(report.lines_omitted, 0);
    let mut next = body.clone();
    let more = next["messages"].as_array_mut().unwrap();
    more.push(call("c2"));
    more.push(tool("c2", &log));
    let (later, _) = chat(&next);
    assert_eq!(later["messages"][2], out["messages"][2]);
    assert_eq!(
        content(&later, 4),
        "[omitted: same as message 3 (c1)]\ncollecting 3 items\n1 failed",
        "the outcome is read where it happened"
    );
    // A demonstration in the first user message stays whole.
    let demo = format!("Here is how a run goes:\n{trace}\nok\nok\nand again:\n{trace}\nNow yours.");
    let body = json!({"model": "m", "messages": [{"role": "user", "content": demo}]});
    let (out, _) = chat(&body);
    assert_eq!(out, body);
}

/// A block a log prints again and again, back to back, is one copy and a
/// note with the count — the one note that may point into its own message.
#[test]
fn a_block_repeated_back_to_back_is_said_once_with_its_count() {
    let block = "polling the job queue for worker alpha-7 (queue depth 12)\n  lease renewed for task 4411 on worker alpha-7\n  heartbeat sent to coordinator at 10.0.0.5:7000";
    let log = format!("{}\ndone", vec![block; 40].join("\n"));
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "run it"},
        call("c1"), tool("c1", &log),
    ]});
    let (out, report) = chat(&body);
    assert_eq!(
        content(&out, 2),
        format!("{block}\n[omitted: message 3 lines 1-3, 39 times]\ndone")
    );
    assert_eq!(report.lines_omitted, 117);
    let original: Vec<Vec<String>> = body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(texts)
        .collect();
    assert_eq!(expand(&out), original, "the note expands to the log");
    // With a status line in each copy, the copies go too: the copy before
    // the note holds it, the count says how often.
    let warning = "WARNING: deprecated call to parse_config() in module alpha\n  at line 42 of config.py\n  use load_config() instead";
    let log = format!("{}\ndone", vec![warning; 40].join("\n"));
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "run it"},
        call("c1"), tool("c1", &log),
    ]});
    assert_eq!(
        content(&chat(&body).0, 2),
        format!("{warning}\n[omitted: message 3 lines 1-3, 39 times]\ndone")
    );
    // A status line inside a block repeated from another message stays.
    let (a, b) = (file(8).join("\n"), file(16)[8..].join("\n"));
    let block = format!("{a}\nWARNING: deprecated call to parse_config()\n{b}");
    let later = json!({"model": "m", "messages": [
        {"role": "user", "content": "run it"},
        call("c1"), tool("c1", &block),
        call("c2"), tool("c2", &format!("second run\n{block}")),
    ]});
    assert_eq!(
        content(&chat(&later).0, 4),
        "second run\n[omitted: message 3 lines 1-8]\nWARNING: deprecated call to parse_config()\n[omitted: message 3 lines 10-17]"
    );
}

/// An image part replaced by a text part is a line of its message as it is
/// sent: a note after it names the lines where they are (a second pass
/// reads the image's text as a text and must number them the same).
#[test]
fn a_note_after_a_replaced_image_names_the_lines_as_sent() {
    let (shots, _) = screenshots();
    let image = shots["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["content"].as_array())
        .flat_map(|p| p.iter().filter(|p| p["type"] == "image_url").cloned())
        .next()
        .unwrap();
    let block = file(8).join("\n");
    let chat_body = json!({"model": "m", "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "show me"},
        {"role": "user", "content": [
            {"type": "text", "text": "look at this\nand this"},
            image,
            {"type": "text", "text": format!("intro\n{block}\nmiddle")},
        ]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": format!("again:\n{block}\nbye")},
    ]});
    let b64 = chat_body["messages"][2]["content"][1]["image_url"]["url"]
        .as_str()
        .unwrap()
        .split_once(',')
        .unwrap()
        .1
        .to_owned();
    let messages_body = json!({"model": "m", "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "t", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": [
            {"type": "text", "text": "first part line"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
            {"type": "text", "text": format!("intro\n{block}\nmid")},
        ]}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_b", "name": "t", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_b", "content": format!("again\n{block}")}]},
    ]});
    for (shape, body) in [(Shape::Chat, chat_body), (Shape::Messages, messages_body)] {
        let p = plan(shape, false, DEFAULTS);
        let (out, report) = run(&body, &p);
        assert!(report.lines_omitted >= 8, "{shape:?}: {out}");
        let msgs = out["messages"].as_array().unwrap();
        // A message's lines as sent: its text parts (the first result's,
        // in an Anthropic message of results), in order.
        let sent = |m: &Value| -> Vec<String> {
            let parts: Vec<Value> = match &m["content"] {
                Value::Array(a) if a.iter().any(|p| p["type"] == "tool_result") => {
                    match &a[0]["content"] {
                        Value::Array(parts) => parts.clone(),
                        text => vec![json!({"type": "text", "text": text})],
                    }
                }
                Value::Array(a) => a.clone(),
                other => vec![json!({"type": "text", "text": other})],
            };
            parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .flat_map(|t| t.split('\n'))
                .map(str::to_owned)
                .collect()
        };
        let mut notes = 0;
        for m in msgs {
            for line in sent(m) {
                let Some(rest) = line.strip_prefix("[omitted: message ") else {
                    continue;
                };
                for (n, a, b) in note_places(&format!("message {}", rest.trim_end_matches(']'))) {
                    let source = sent(&msgs[n - 1]);
                    assert_eq!(source[a - 1..b].join("\n"), block, "{shape:?}: {line}");
                    notes += 1;
                }
            }
        }
        assert!(notes >= 1, "{shape:?}: {out}");
        let (again, _) = run(&out, &p);
        assert_eq!(again, out, "{shape:?}: a second pass changes nothing");
    }
}

#[test]
fn runs_below_the_thresholds_or_saving_too_little_stay() {
    let pad = "a line of the new output that no earlier message holds, long enough to count";
    let two = "the first line of a block of two, long enough to be worth a look-up on its own here\nand its second line, which is just as long as the first one is, or nearly so, we think";
    let short_two = "the first line of a short block\nand its second line";
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "go"},
        call("c1"), tool("c1", &format!("{two}\n{short_two}\n{pad}")),
        call("c2"), tool("c2", &format!("{pad}x\n{pad}y\n{two}\n{pad}z\n{short_two}")),
    ]});
    let (out, _) = chat(&body);
    assert_eq!(
        content(&out, 4),
        format!("{pad}x\n{pad}y\n[omitted: message 3 lines 1-2]\n{pad}z\n{short_two}"),
        "a run saving 128 bytes more than its note goes; one saving less stays"
    );
    let higher = Rules {
        dedup: Some(dedup::Blocks {
            min_lines: 2,
            min_bytes: 512,
        }),
        ..DEFAULTS
    };
    let (out, _) = run(&body, &plan(Shape::Chat, true, higher));
    assert_eq!(out, body, "under the configured bytes");
}

#[test]
fn dedup_off_or_nothing_repeated_leaves_the_bytes_alone() {
    let bytes = fixture("agent-history-refetch.json");
    let off = Rules {
        dedup: None,
        ..DEFAULTS
    };
    assert!(
        rewrite(&bytes, &plan(Shape::Chat, true, off))
            .body
            .is_none()
    );
    let fresh = serde_json::to_vec(&json!({"model": "m", "messages": [
        {"role": "user", "content": file(4).join("\n")},
        {"role": "tool", "tool_call_id": "c", "content": "a result that repeats nothing\nof what the user sent before it"},
    ]}))
    .unwrap();
    let r = rewrite(&fresh, &plan(Shape::Chat, true, DEFAULTS));
    assert!(r.body.is_none());
    assert_eq!(r.report.bytes_saved, 0);
}

#[test]
fn rewritten_arrays_and_trailing_runs_stay_as_they_are_when_run_again() {
    let a = "AAAAAAAAAAAAAAAAAAAA";
    let b = "BBBBBBBBBBBBBBBBBBBB";
    let line_a = "a line of forty characters, more or les";
    let line_b = "another line of forty characters or so.";
    let bodies = [
        // A run removed from the end uncovers an array: still not an array.
        json!({"model": "m", "messages": [
            {"role": "user", "content": "[\"0123456789abcdefgh\"]"},
            {"role": "assistant", "content": format!("{line_a}\n{line_b}")},
            {"role": "user", "content": format!("[\"0123456789abcdefgh\"]\n{line_a}\n{line_b}")},
        ]}),
        // Two arrays that lose different items read the same: never a
        // reference to each other.
        json!({"model": "m", "messages": [
            {"role": "user", "content": format!("[\"{a}\",\"{b}\"]")},
            {"role": "tool", "tool_call_id": "c1", "content": format!("[\"{a}\",1]")},
            {"role": "tool", "tool_call_id": "c2", "content": format!("[\"{b}\",1]")},
        ]}),
    ];
    for body in bodies {
        let (once, _) = chat(&body);
        let (twice, report) = chat(&once);
        assert_eq!(twice, once, "{once}");
        assert_eq!(report.bytes_saved, 0);
    }
}

#[test]
fn a_note_names_the_call_when_its_message_holds_several_results() {
    let f = file(8).join("\n");
    let g: String = (0..8)
        .map(|i| format!("an unrelated line number {i} of the other file\n"))
        .collect();
    let body = json!({"model": "claude", "max_tokens": 10, "messages": [
        {"role": "user", "content": "read both"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}}, {"type": "tool_use", "id": "toolu_b", "name": "f", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": g},
            {"type": "tool_result", "tool_use_id": "toolu_b", "content": f},
        ]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_c", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_c", "content": format!("header line that is new, long enough to matter\n{f}")}]},
    ]});
    let (out, _) = run(&body, &plan(Shape::Messages, true, DEFAULTS));
    assert_eq!(
        out["messages"][4]["content"][0]["content"],
        "header line that is new, long enough to matter\n[omitted: message 3 (toolu_b) lines 1-8]",
        "each result's lines are numbered from 1: the note says which"
    );
}

/// A message of several units numbers each on its own, so a note always
/// says which: the call, `text` for the message's own content, `result N`
/// when the id cannot tell (used twice, or not plain).
#[test]
fn a_note_names_the_unit_when_the_call_cannot() {
    let block = file(8).join("\n");
    let anthropic = |results: Value| {
        json!({"model": "claude", "max_tokens": 10, "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "t", "input": {}}]},
            {"role": "user", "content": results},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_b", "name": "t", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_b", "content": format!("again\n{block}\nend of it")}]},
        ]})
    };
    let p = plan(Shape::Messages, true, DEFAULTS);
    let body = anthropic(json!([
        {"type": "tool_result", "tool_use_id": "toolu_a", "content": "Exit code 0\nshort"},
        {"type": "text", "text": format!("my notes:\n{block}\nend")},
    ]));
    let (out, _) = run(&body, &p);
    assert_eq!(
        out["messages"][4]["content"][0]["content"],
        "again\n[omitted: message 3 (text) lines 2-9]\nend of it"
    );
    let body = anthropic(json!([
        {"type": "tool_result", "tool_use_id": "toolu_a", "content": "Exit code 0\nshort"},
        {"type": "tool_result", "tool_use_id": "toolu_a", "content": format!("start\n{block}")},
    ]));
    let (out, _) = run(&body, &p);
    assert_eq!(
        out["messages"][4]["content"][0]["content"],
        "again\n[omitted: message 3 (result 2) lines 2-9]\nend of it"
    );
}

/// A note is never longer than the lines it replaces: a long call id on
/// each of many short stretches would make it so.
#[test]
fn a_note_longer_than_its_run_is_not_written() {
    let id = format!("toolu_{}", "x".repeat(58));
    let lines: Vec<String> = (0..8)
        .map(|i| format!("line {i:02} of forty bytes, give or take a few"))
        .collect();
    let first: String = lines.iter().map(|l| format!("{l}\nsep{l}\n")).collect();
    // The same lines, each alone, in another order: 8 stretches of one line.
    let mut shuffled = lines.clone();
    shuffled.reverse();
    let second = shuffled.join("\n");
    let body = json!({"model": "claude", "max_tokens": 10, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": id, "name": "t", "input": {}}, {"type": "tool_use", "id": "toolu_b", "name": "t", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": id, "content": format!("a first line long enough not to be a head of status\n{first}")},
            {"type": "tool_result", "tool_use_id": "toolu_b", "content": format!("a first line long enough not to be a head of status\n{second}")},
        ]},
    ]});
    let (out, report) = run(&body, &plan(Shape::Messages, true, DEFAULTS));
    assert_eq!(out, body, "{}", out["messages"][2]);
    assert_eq!(report.lines_omitted, 0);
}

/// Cases a review found where a second pass over visor's own output
/// changed it: a reference's status lines that read as a block repeated
/// back to back, an array shrunk under the small size, a traceback whose
/// frames became a note.
#[test]
fn a_second_pass_over_references_arrays_and_tracebacks_changes_nothing() {
    let e1 = "error: failed to compile crate `alpha` because of previous errors in module beta, see the log above";
    let e2 = "error: failed to compile crate `gamma` because of previous errors in module delta, see the log above";
    let f = |n: usize| {
        format!(
            "   compiling dependency number {n} of the workspace, with features default and std enabled"
        )
    };
    let t = format!(
        "{e1}\n{e2}\n{}\n{}\n{e1}\n{e2}\n{}\n{}",
        f(1),
        f(2),
        f(3),
        f(4)
    );
    let references = json!({"model": "m", "messages": [
        {"role": "user", "content": "build it"},
        call("c1"), tool("c1", &t),
        call("c2"), tool("c2", &t),
    ]});
    let e1j = json!({"id": 1, "body": "the first element is long enough to be removed when it repeats in a later array of results"});
    let e2j = json!({"id": 2, "body": "the second element is long enough to be removed when it repeats in a later array of results"});
    let k = "    \"k\": \"a value of the third element that runs on for quite a while so the line is long\",";
    let j = "    \"j\": \"another value of the third element that also runs on so the line is long too\"";
    let e0 = json!({"id": 0, "body": "the zeroth element only pads the first array over the size under which a result stays whole"});
    let arrays = json!({"model": "m", "messages": [
        {"role": "user", "content": "go"},
        call("c1"), tool("c1", &format!("[{e0}, {e1j}, {e2j}]")),
        call("c2"), tool("c2", &format!("[\n  {e1j},\n  {e2j},\n  {{\n{k}\n{j}\n  }}\n]")),
        call("c3"), tool("c3", &format!("a header line of new output that no earlier message has shown to the model yet\n{k}\n{j}\na trailer line of new output that no earlier message has shown to the model yet")),
    ]});
    let frames = (1..6)
        .map(|i| format!("  File \"/app/pipeline/stage_{i}.py\", line {i}0, in run_stage_{i}\n    result = run_stage_{}(config, inputs)", i + 1))
        .collect::<Vec<_>>()
        .join("\n");
    let exc = "BadCount: the value given for the count option is not a positive whole number like three or twelve";
    let tail = "the scheduler then printed its queue summary for the operators on call tonight and stopped";
    let traceback = json!({"model": "m", "messages": [
        {"role": "user", "content": "go"},
        call("c1"), tool("c1", &format!("Traceback (most recent call last):\n{frames}\n{exc}\n{tail}")),
        call("c2"), tool("c2", &format!("second attempt starting now with the same configuration as before\nTraceback (most recent call last):\n{frames}\n{exc}\n{tail}\nsomething new")),
    ]});
    for body in [references, arrays, traceback] {
        let (once, _) = chat(&body);
        assert_ne!(once, body, "the case rewrites something");
        let (twice, _) = chat(&once);
        assert_eq!(twice, once);
    }
}

#[test]
fn many_results_and_many_blocks_in_one_request_stay_fast_enough_to_finish() {
    // Shapes a review found quadratic: thousands of repeated results with
    // no call id, and one message of thousands of tool_result blocks.
    let text = "a result line that repeats, long enough to be a reference ".repeat(5);
    let mut msgs = vec![json!({"role": "user", "content": "go"})];
    for _ in 0..20_000 {
        msgs.push(json!({"role": "tool", "tool_call_id": "c", "content": text}));
    }
    let (out, report) = chat(&json!({"model": "m", "messages": msgs}));
    assert_eq!(report.lines_omitted, 19_999);
    assert_eq!(content(&out, 20_000), "[omitted: same as message 2 (c)]");
    let blocks: Vec<Value> = (0..20_000)
        .map(|i| json!({"type": "tool_result", "tool_use_id": format!("t{i}"), "content": "x"}))
        .collect();
    let anthropic = json!({"model": "claude", "max_tokens": 1, "messages": [{"role": "user", "content": blocks}]});
    let (out, _) = run(&anthropic, &plan(Shape::Messages, true, DEFAULTS));
    assert_eq!(out, anthropic);
    // A block of 20,000 lines printed twice, apart (`cat a a`): its own
    // lines are no source, and finding that costs no scan per line.
    let block: Vec<String> = (0..20_000)
        .map(|i| format!("line {i} of the generated output, padded to a realistic width"))
        .collect();
    let block = block.join("\n");
    let twice = json!({"model": "m", "messages": [
        {"role": "user", "content": "go"},
        call("c1"), tool("c1", &format!("{block}\nseparator\n{block}")),
    ]});
    assert_eq!(chat(&twice).0, twice);
}

#[test]
fn refetch_fixtures_keep_their_prefix_turn_by_turn() {
    for name in [
        "agent-history-refetch.json",
        "agent-history-refetch-jsonarray.json",
        "agent-tool-images-6turns.json",
    ] {
        let (sent, original) = assert_prefix_stable(name, false);
        assert!(
            name.contains("images") || sent * 3 < original,
            "{name}: {sent} of {original} bytes over all turns"
        );
    }
}

#[test]
fn refetch_fixture_keeps_every_distinct_line_and_a_tenth_of_the_tool_bytes() {
    let bytes = fixture("agent-history-refetch.json");
    let r = rewrite(&bytes, &plan(Shape::Chat, false, DEFAULTS));
    let out = r.body.unwrap();
    let tool_bytes = |b: &[u8]| -> usize {
        let v: Value = serde_json::from_slice(b).unwrap();
        v["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "tool")
            .map(|m| m["content"].as_str().unwrap().len())
            .sum()
    };
    assert!(
        tool_bytes(&out) * 10 < tool_bytes(&bytes),
        "{} of {}",
        tool_bytes(&out),
        tool_bytes(&bytes)
    );
    let lines = |b: &[u8]| -> HashSet<String> {
        let v: Value = serde_json::from_slice(b).unwrap();
        v["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["content"].as_str())
            .flat_map(|c| c.lines().map(str::to_owned).collect::<Vec<_>>())
            .collect()
    };
    let kept = lines(&out);
    let missing: Vec<String> = lines(&bytes).difference(&kept).cloned().collect();
    assert!(missing.is_empty(), "{missing:?}");
    // Each re-fetch keeps its one new line and one note for the 24 it
    // shares with the fetch before.
    assert_eq!(r.report.lines_omitted, 29 * 24);
}

#[test]
fn a_refetched_window_is_one_note_naming_each_place() {
    // Every tool result re-fetches the last 25 chat lines: past the first
    // few, each line is shown once, where it was new.
    let body: Value = serde_json::from_slice(&fixture("agent-history-refetch.json")).unwrap();
    let (out, _) = run(&body, &plan(Shape::Chat, false, DEFAULTS));
    let last = out["messages"].as_array().unwrap().len() - 1;
    let text = content(&out, last);
    let (note, new) = text.split_once('\n').unwrap();
    assert!(note.contains(" of messages 24, 28 … 116"), "{note}");
    assert!(new.contains("(msg 69)"), "{new}");
    assert!(note.len() < 120, "{note}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn nothing_is_lost_notes_say_truly_where_roles_and_ids_stay(body in conversation()) {
        let (out, _) = chat(&body);
        let missing: Vec<String> = all_lines(&body).difference(&all_lines(&out)).cloned().collect();
        prop_assert!(missing.is_empty(), "lost {:?}", missing);
        prop_assert_eq!(skeleton(&out), skeleton(&body));
        let original: Vec<Vec<String>> = body["messages"].as_array().unwrap().iter().map(texts).collect();
        prop_assert_eq!(expand(&out), original);
    }

    #[test]
    fn notes_say_truly_where_around_replaced_images(body in conversation(), at in 0..3usize) {
        // A picture in each user message of parts, for a model that cannot
        // see: its text part is a line of the message as sent.
        let png = fixture("chart.png");
        let image = json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", base64_simd::STANDARD.encode_to_string(&png))}});
        let mut body = body;
        for m in body["messages"].as_array_mut().unwrap() {
            if m["role"] == "user" && let Some(parts) = m["content"].as_array_mut() {
                parts.insert(at.min(parts.len()), image.clone());
            }
        }
        let p = plan(Shape::Chat, false, DEFAULTS);
        let (out, _) = run(&body, &p);
        let expanded: Vec<Vec<String>> = expand(&out)
            .into_iter()
            .map(|m| m.into_iter().filter(|t| !t.starts_with("[image ")).collect())
            .collect();
        let original: Vec<Vec<String>> = body["messages"].as_array().unwrap().iter().map(texts).collect();
        prop_assert_eq!(expanded, original);
        let (again, _) = run(&out, &p);
        prop_assert_eq!(again, out);
    }

    #[test]
    fn deterministic_and_idempotent(body in conversation(), bytes in prop::sample::select(vec![0usize, 16, 64])) {
        // At 0 bytes visor's own notes would be long enough to repeat.
        let p = plan(Shape::Chat, true, Rules { dedup: Some(dedup::Blocks { min_lines: 2, min_bytes: bytes }), ..DEFAULTS });
        let (once, _) = run(&body, &p);
        let (again, _) = run(&body, &p);
        prop_assert_eq!(&once, &again);
        let (twice, report) = run(&once, &p);
        prop_assert_eq!(&twice, &once);
        prop_assert_eq!(report.lines_omitted, 0);
    }

    #[test]
    fn an_image_once_replaced_stays_replaced_the_same_way(
        shots in prop::collection::vec((0..4usize, any::<bool>()), 1..14),
        keep_turns in 0..4usize,
        max_images in 1..6usize,
        hard in prop::option::of(1..6usize),
        prompt_cache in any::<bool>(),
    ) {
        // A screenshot agent whose tool results carry one of four images
        // (so copies happen), with the user attaching one now and then.
        let (body, _) = screenshots();
        let urls: Vec<Value> = body["messages"].as_array().unwrap().iter()
            .filter_map(|m| m["content"].as_array())
            .flat_map(|p| p.iter().filter(|p| p["type"] == "image_url").cloned())
            .collect();
        let mut msgs = vec![json!({"role": "user", "content": "go"})];
        for (t, (which, user)) in shots.iter().enumerate() {
            let id = format!("call_{t}");
            msgs.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "shot", "arguments": "{}"}}]}));
            msgs.push(json!({"role": "tool", "tool_call_id": id, "content": [{"type": "text", "text": format!("shot {t}")}, urls[*which].clone()]}));
            if *user {
                msgs.push(json!({"role": "user", "content": [{"type": "text", "text": "look"}, urls[(which + 1) % 4].clone()]}));
            }
        }
        // As Rules::new makes them: the cap is never above the hard limit.
        let max_images = hard.map_or(max_images, |h| max_images.min(h));
        let rules = Rules { keep_turns, max_images, hard_max_images: hard, prompt_cache, ..DEFAULTS };
        // The requests the agent sent: before each assistant message, and
        // the whole (a request ends where the model's turn starts).
        let mut requests: Vec<Value> = (1..msgs.len())
            .filter(|&k| msgs[k]["role"] == "assistant")
            .map(|k| json!({"model": "gpt-4o", "messages": msgs[..k].to_vec()}))
            .collect();
        requests.push(json!({"model": "gpt-4o", "messages": msgs.clone()}));
        let mut previous: Option<Vec<ImageNote>> = None;
        for req in requests {
            let bytes = serde_json::to_vec(&req).unwrap();
            let notes = rewrite(&bytes, &plan(Shape::Chat, true, rules)).report.images;
            if let Some(prev) = &previous {
                for (a, b) in prev.iter().zip(&notes) {
                    if a.action != "kept" {
                        prop_assert_eq!(a.action, b.action, "{} changed", a.path);
                    }
                }
            }
            if let Some(h) = hard {
                let kept = notes.iter().filter(|n| n.action == "kept").count();
                prop_assert!(kept <= h, "{} kept over the hard limit {}", kept, h);
            }
            previous = Some(notes);
        }
    }

    #[test]
    fn every_note_pays_and_points_only_at_earlier_messages(body in conversation()) {
        let (out, _) = chat(&body);
        let before = body["messages"].as_array().unwrap();
        let after = out["messages"].as_array().unwrap();
        let lines_of = |m: &Value| -> Vec<String> {
            texts(m).join("\n").split('\n').map(str::to_owned).collect()
        };
        for (i, m) in after.iter().enumerate() {
            for (pos, line) in lines_of(m).iter().enumerate() {
                match dedup::Note::parse(line) {
                    Some(dedup::Note::Run(places)) => {
                        let mut bytes = 0;
                        for p in &places {
                            let source = lines_of(&after[p.message - 1]);
                            bytes += source[p.first - 1..p.last].iter().map(|l| l.len() + 1).sum::<usize>();
                            if p.message == i + 1 {
                                // Only a block repeated back to back: the
                                // lines just before the note.
                                prop_assert_eq!(p.last, pos, "{} points into its own message", line);
                            }
                            prop_assert!(p.message <= i + 1, "{} points ahead", line);
                        }
                        prop_assert!(
                            bytes >= line.len() + 1 + dedup::NOTE_MIN_SAVING,
                            "{} saves {} bytes", line, bytes as i64 - line.len() as i64
                        );
                    }
                    Some(dedup::Note::Same { message, .. }) => {
                        prop_assert!(message <= i);
                        let text: usize = texts(&before[i]).iter().map(String::len).sum();
                        prop_assert!(text >= dedup::SMALL_TEXT, "a {}-byte result became {}", text, line);
                    }
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn status_lines_and_the_first_user_message_are_never_removed(body in conversation()) {
        let (out, _) = chat(&body);
        let before = body["messages"].as_array().unwrap();
        let after = out["messages"].as_array().unwrap();
        for (m, (a, b)) in before.iter().zip(after).enumerate() {
            let kept: HashSet<String> = texts(b).iter().flat_map(|t| t.split('\n').map(str::to_owned)).collect();
            for t in texts(a) {
                for l in t.split('\n').filter(|l| STATUS_FORMS.contains(l)) {
                    prop_assert!(kept.contains(l), "message {}: {} removed", m + 1, l);
                }
            }
        }
        if let Some(first) = before.iter().position(|m| m["role"] == "user") {
            prop_assert_eq!(&after[first], &before[first], "the first user message is never rewritten");
        }
    }

    #[test]
    fn every_rewritten_message_stays_as_the_conversation_grows(body in conversation(), more in conversation()) {
        let (before, _) = chat(&body);
        let mut longer = body.clone();
        let added = more["messages"].as_array().unwrap().clone();
        longer["messages"].as_array_mut().unwrap().extend(added.iter().cloned());
        let (after, _) = chat(&longer);
        let a = before["messages"].as_array().unwrap();
        let b = after["messages"].as_array().unwrap();
        prop_assert_eq!(&b[..a.len()], &a[..], "no exception: every earlier message stays byte for byte");
    }
}

/// Each case a fuzzer found where a second pass changed the rewrite of a
/// conversation with images replaced in it (`fuzz/seeds/`): a Chat tool
/// message's parts joined after dedup read them one by one, a tool result's
/// head counted from visor's image texts, image texts over several lines.
#[test]
fn a_second_pass_over_replaced_images_changes_nothing() {
    let png = base64_simd::STANDARD.encode_to_string(fixture("chart.png"));
    let data = format!("data:image/png;base64,{png}");
    let image = json!({"type": "image_url", "image_url": {"url": data}});
    let array = "[\"0123456789abcdefgh\", \"0123456789abcdefgh\"]";
    let step = "fn step_1(input: &str) -> Result<usize, Error> {";
    let short5 = ["ünïcödé line, long enough to matter here"; 5].join("\n");
    let chat_cases = [
        // A tool text part that is a JSON array, joined with an image.
        json!([
            {"role": "assistant", "content": null, "tool_calls": [call("call_0")]},
            {"role": "tool", "tool_call_id": "call_0", "content": [
                {"type": "text", "text": format!("\n{array}")}, image]},
            {"role": "user", "content": format!("\n{array}\n![shot]({data}) end")},
        ]),
        // A tool text part whose lines repeat, joined with an image.
        json!([
            {"role": "user", "content": format!("{step}\n")},
            {"role": "assistant", "content": null, "tool_calls": [call("call_2")]},
            {"role": "tool", "tool_call_id": "call_2", "content": [
                {"type": "text", "text": format!("\n{step}\n{step}\n")}, image]},
        ]),
        // Two tool results, each a text part and the same image.
        json!([
            {"role": "assistant", "content": null, "tool_calls": [call("a"), call("b")]},
            {"role": "tool", "tool_call_id": "a", "content": [
                {"type": "text", "text": "Rendered attempt 2."}, image]},
            {"role": "tool", "tool_call_id": "b", "content": [
                {"type": "text", "text": "Rendered attempt 2."}, image]},
        ]),
        // A result of two text parts, the second all a note: never a
        // reference on a second pass (it was not on the first).
        json!([
            {"role": "user", "content": [{"type": "text", "text": short5}, image]},
            {"role": "assistant", "content": null, "tool_calls": [call("c3")]},
            {"role": "tool", "tool_call_id": "c3", "content": [
                {"type": "text", "text": short5}, {"type": "text", "text": format!("{step}\n{step}")}]},
            {"role": "tool", "tool_call_id": "c3", "content": [
                {"type": "text", "text": short5}, {"type": "text", "text": format!("{step}\n{step}")}]},
        ]),
    ];
    let long = "[10:01] bob: section 4 keeps personal data for three years";
    let anthropic = json!([
        {"role": "user", "content": format!("{long}\n![shot]({data}) end")},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "t", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
            {"type": "text", "text": format!("\n\n\n\n{long}\n![shot]({data}) end")},
        ]}]},
    ]);
    let responses = json!([
        {"role": "user", "content": [
            {"type": "input_image", "image_url": format!("https://example.com/a.png?\n{long}\n{long}")},
            {"type": "input_text", "text": format!("{long}\n{long}")},
        ]},
    ]);
    let mut cases: Vec<(Shape, Value)> = chat_cases
        .into_iter()
        .map(|m| (Shape::Chat, json!({"model": "m", "messages": m})))
        .collect();
    cases.push((
        Shape::Messages,
        json!({"model": "m", "max_tokens": 9, "messages": anthropic}),
    ));
    cases.push((Shape::Responses, json!({"model": "m", "input": responses})));
    for min_bytes in [0, 16, 64] {
        let rules = Rules {
            dedup: Some(dedup::Blocks {
                min_lines: 2,
                min_bytes,
            }),
            ..DEFAULTS
        };
        for (k, (shape, body)) in cases.iter().enumerate() {
            let p = plan(*shape, false, rules);
            let (once, report) = run(body, &p);
            assert!(report.images_replaced > 0, "case {k}");
            let (twice, _) = run(&once, &p);
            assert_eq!(twice, once, "case {k} at {min_bytes} bytes");
        }
    }
}

/// A tool result whose image comes before its text keeps its status lines
/// when its parts are joined.
#[test]
fn a_joined_tool_result_keeps_its_status_lines_after_an_image_text() {
    let png = base64_simd::STANDARD.encode_to_string(fixture("chart.png"));
    let image =
        json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{png}")}});
    let out: Vec<String> = file(12);
    let text = format!("Exit code 0\nWall time: 2s\n{}", out.join("\n"));
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "run it twice"},
        {"role": "assistant", "content": null, "tool_calls": [call("c0")]},
        {"role": "tool", "tool_call_id": "c0", "content": text},
        {"role": "assistant", "content": null, "tool_calls": [call("c1")]},
        {"role": "tool", "tool_call_id": "c1", "content": [image, {"type": "text", "text": text}]},
    ]});
    let p = plan(Shape::Chat, false, DEFAULTS);
    let (once, _) = run(&body, &p);
    let sent = content(&once, 4);
    let lines: Vec<&str> = sent.split('\n').collect();
    assert!(lines[0].starts_with("[image sha256:"), "{sent}");
    assert_eq!(lines[1..3], ["Exit code 0", "Wall time: 2s"], "{sent}");
    assert_eq!(lines[3], "[omitted: message 3 lines 3-14]", "{sent}");
    assert_eq!(run(&once, &p).0, once);
}
