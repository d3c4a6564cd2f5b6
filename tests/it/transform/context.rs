//! Context that does not repeat itself, through the real proxy: repeated
//! lines and JSON items removed before the upstream sees them, the image
//! rules for every model (aged out, deduped, capped) in every API shape, and
//! the headers and metrics that report them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use serde_json::{Value, json};
use support::*;

fn json(b: &[u8]) -> Value {
    serde_json::from_slice(b).unwrap()
}

fn header_num(h: &http::HeaderMap, name: &str) -> i64 {
    h[name].to_str().unwrap().parse().unwrap()
}

fn counter(text: &str, name: &str, label: (&str, &str)) -> f64 {
    metric(text, name, &[label]).unwrap_or(0.0)
}

/// Image parts of every kind in a request, anywhere.
fn image_parts(v: &Value) -> usize {
    match v {
        Value::Object(m) => {
            let own = matches!(
                m.get("type").and_then(Value::as_str),
                Some("image_url" | "image" | "input_image")
            );
            usize::from(own) + m.values().map(image_parts).sum::<usize>()
        }
        Value::Array(a) => a.iter().map(image_parts).sum(),
        _ => 0,
    }
}

/// A config for a provider without prompt caching: images already sent
/// age out as soon as they are due.
const NO_PROMPT_CACHE: &str = "[images]\nprompt_cache = false\n";

#[tokio::test]
async fn a_refetched_history_reaches_the_upstream_once() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    for name in [
        "agent-history-refetch.json",
        "agent-history-refetch-jsonarray.json",
    ] {
        let body = fixture(name);
        let before = visor.metrics().await;
        let (status, headers, _) =
            send(post_json(&visor.url("/v1/chat/completions"), body.clone())).await;
        assert_eq!(status, 200, "{name}");
        let sent = mock.recorded().pop().unwrap().body;
        let saved = header_num(&headers, "x-visor-bytes-saved");
        assert_eq!(saved, body.len() as i64 - sent.len() as i64, "{name}");
        assert!(
            sent.len() * 3 < body.len(),
            "{name}: {} of {}",
            sent.len(),
            body.len()
        );
        assert_eq!(header_num(&headers, "x-visor-images-replaced"), 0);
        assert_eq!(header_num(&headers, "x-visor-history-used"), 0);
        let (orig, out) = (json(&body), json(&sent));
        let (om, sm) = (
            orig["messages"].as_array().unwrap(),
            out["messages"].as_array().unwrap(),
        );
        assert_eq!(om.len(), sm.len(), "no message added or removed");
        for (o, s) in om.iter().zip(sm) {
            assert_eq!(o["role"], s["role"]);
            assert_eq!(o["tool_call_id"], s["tool_call_id"]);
            assert_eq!(o["tool_calls"], s["tool_calls"]);
            if o["role"] != "tool" {
                assert_eq!(o, s, "only tool results repeat here");
            }
        }
        let last_tool = sm.iter().rev().find(|m| m["role"] == "tool").unwrap();
        let text = last_tool["content"].as_str().unwrap();
        let note = if name.contains("jsonarray") {
            "\n[24 items omitted: messages "
        } else {
            "[omitted: "
        };
        assert!(text.contains(note), "{text}");
        if name.contains("jsonarray") {
            let (array, _) = text.rsplit_once('\n').unwrap();
            assert_eq!(json(array.as_bytes()).as_array().unwrap().len(), 1);
        }
        let after = visor.metrics().await;
        let dedup = ("reason", "dedup");
        let grew = counter(&after, "visor_bytes_saved_total", dedup)
            - counter(&before, "visor_bytes_saved_total", dedup);
        assert_eq!(grew, saved as f64, "{name}");
    }
}

#[tokio::test]
async fn dedup_in_the_anthropic_and_responses_shapes() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let block = (0..6)
        .map(|i| format!("[10:0{i}] member {i}: the retention policy needs a tax branch first, see section {i}"))
        .collect::<Vec<_>>()
        .join("\n");
    let messages = json!({"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what changed in the channel?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "fetch", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": block}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "fetch", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": format!("{block}\na new line from the tool")}]},
    ]});
    let responses = json!({"model": "gpt-5", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "what changed in the channel?"}]},
        {"type": "function_call", "call_id": "f1", "name": "fetch", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "f1", "output": block},
        {"type": "function_call", "call_id": "f2", "name": "fetch", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "f2", "output": format!("{block}\na new line from the tool")},
    ]});
    for (path, body) in [("/v1/messages", messages), ("/v1/responses", responses)] {
        let (status, headers, _) = send(post_json(
            &visor.url(path),
            serde_json::to_vec(&body).unwrap(),
        ))
        .await;
        assert_eq!(status, 200, "{path}");
        assert!(header_num(&headers, "x-visor-bytes-saved") > 0, "{path}");
        let sent = json(&mock.recorded().pop().unwrap().body);
        let text = match path {
            "/v1/messages" => sent["messages"][4]["content"][0]["content"].clone(),
            _ => sent["input"][4]["output"].clone(),
        };
        assert_eq!(
            text, "[omitted: message 3 lines 1-6]\na new line from the tool",
            "{path}"
        );
    }
}

#[tokio::test]
async fn transform_off_forwards_the_history_byte_for_byte() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let body = fixture("agent-history-refetch.json");
    let mut req = post_json(&visor.url("/v1/chat/completions"), body.clone());
    req.headers_mut()
        .insert("x-visor-transform", http::HeaderValue::from_static("off"));
    let (status, _, _) = send(req).await;
    assert_eq!(status, 200);
    assert_eq!(mock.recorded().pop().unwrap().body, body);
    // And with dedup disabled in the config.
    let off = Visor::for_mock(&mock, "[dedup]\nenabled = false\n").await;
    let (status, headers, _) =
        send(post_json(&off.url("/v1/chat/completions"), body.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(mock.recorded().pop().unwrap().body, body);
    assert_eq!(header_num(&headers, "x-visor-bytes-saved"), 0);
}

#[tokio::test]
async fn old_screenshots_age_out_and_are_saved() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    // Without a provider prompt cache ageing always pays; with one (the
    // default) it waits until it does (src/transform/tests_context.rs).
    let visor = Visor::for_mock(&mock, NO_PROMPT_CACHE).await;
    let body = fixture("agent-tool-images-6turns.json");
    let (status, headers, _) =
        send(post_json(&visor.url("/v1/chat/completions"), body.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(header_num(&headers, "x-visor-images-replaced"), 3);
    let sent = json(&mock.recorded().pop().unwrap().body);
    assert_eq!(
        image_parts(&sent),
        4,
        "the mockup and the last three screenshots"
    );
    let orig = json(&body);
    assert_eq!(sent["messages"][0], orig["messages"][0]);
    assert_eq!(sent["messages"][12], orig["messages"][12]);
    let aged = sent["messages"][2]["content"].as_str().unwrap();
    assert!(aged.contains("an older tool result"), "{aged}");
    // The original of an aged-out screenshot is served back by its hash.
    let url = orig["messages"][2]["content"][1]["image_url"]["url"]
        .as_str()
        .unwrap();
    let png = base64_simd::STANDARD
        .decode_to_vec(url.split_once(',').unwrap().1)
        .unwrap();
    let sha = sha256_hex(&png);
    assert!(aged.contains(&format!("sha256:{}", &sha[..12])), "{aged}");
    let (status, _, served) = send(
        Request::get(visor.url(&format!("/visor/artifacts/{sha}")))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(served, png);
    let m = visor.metrics().await;
    assert_eq!(
        counter(&m, "visor_images_total", ("action", "aged_out")),
        3.0
    );
    assert_eq!(counter(&m, "visor_images_total", ("action", "kept")), 4.0);
    assert!(counter(&m, "visor_bytes_saved_total", ("reason", "images")) > 0.0);
}

#[tokio::test]
async fn copies_become_references_and_the_cap_keeps_the_newest() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "[images]\nmax_per_request = 2\n").await;
    let urls: Vec<String> = ["a", "b", "c", "d"]
        .iter()
        .map(|s| png_data_url(s).0)
        .collect();
    let mut all = urls.clone();
    all.push(urls[0].clone());
    let body = chat_with_images("gpt-4o", &all);
    let (status, headers, _) = send(post_json(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200);
    assert_eq!(header_num(&headers, "x-visor-images-replaced"), 3);
    let sent = json(&mock.recorded().pop().unwrap().body);
    let parts = sent["messages"][0]["content"].as_array().unwrap().clone();
    let images: Vec<&str> = parts
        .iter()
        .filter_map(|p| p["image_url"]["url"].as_str())
        .collect();
    assert_eq!(
        images,
        [urls[2].as_str(), urls[3].as_str()],
        "the newest two stay"
    );
    let texts: Vec<&str> = parts.iter().filter_map(|p| p["text"].as_str()).collect();
    assert!(
        texts
            .iter()
            .any(|t| t.contains("the same image as earlier")),
        "{texts:?}"
    );
    assert_eq!(
        texts
            .iter()
            .filter(|t| t.contains("over this request's image limit"))
            .count(),
        2
    );
    let m = visor.metrics().await;
    assert_eq!(
        counter(&m, "visor_images_total", ("action", "deduped")),
        1.0
    );
    assert_eq!(counter(&m, "visor_images_total", ("action", "capped")), 2.0);
    assert_eq!(counter(&m, "visor_images_total", ("action", "kept")), 2.0);
}

#[tokio::test]
async fn a_models_max_images_caps_below_the_config() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(
        &mock,
        "[[model]]\nmatch = \"tiny-vlm*\"\nvision = true\nmax_images = 1\n",
    )
    .await;
    let urls: Vec<String> = ["x", "y", "z"].iter().map(|s| png_data_url(s).0).collect();
    let (status, headers, _) = send(post_json(
        &visor.url("/v1/chat/completions"),
        chat_with_images("tiny-vlm-2b", &urls),
    ))
    .await;
    assert_eq!(status, 200);
    assert_eq!(header_num(&headers, "x-visor-images-replaced"), 2);
    let sent = json(&mock.recorded().pop().unwrap().body);
    assert_eq!(image_parts(&sent), 1);
    assert!(String::from_utf8_lossy(&serde_json::to_vec(&sent).unwrap()).contains(&urls[2]));
}

#[tokio::test]
async fn a_text_only_model_describes_every_image_once_and_never_rewrites_it() {
    let mock = MockUpstream::start(|req| match is_describer_call(req) {
        true => describer_answer(req),
        false => chat_ok(),
    })
    .await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    let mut body = json(&fixture("agent-tool-images-6turns.json"));
    body["model"] = json!("gpt-oss-120b");
    let msgs = body["messages"].as_array().unwrap().clone();
    // Turn 5 without its last screenshot, then the full transcript.
    let mut earlier = body.clone();
    earlier["messages"] = Value::Array(msgs[..11].to_vec());
    let mut sent = Vec::new();
    for req in [&earlier, &body] {
        let calls_before = mock
            .recorded()
            .iter()
            .filter(|r| is_describer_call(r))
            .count();
        let (status, headers, _) = send(post_json(
            &visor.url("/v1/chat/completions"),
            serde_json::to_vec(req).unwrap(),
        ))
        .await;
        assert_eq!(status, 200);
        assert_eq!(
            header_num(&headers, "x-visor-images-replaced") as usize,
            req["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(image_parts)
                .sum::<usize>()
        );
        let recorded = mock.recorded();
        let calls = recorded.iter().filter(|r| is_describer_call(r)).count() - calls_before;
        let forwarded = recorded
            .iter()
            .rev()
            .find(|r| !is_describer_call(r))
            .unwrap();
        sent.push((calls, json(&forwarded.body)));
    }
    // First request: the mockup and the five screenshots are described
    // (6 calls): for a model that cannot see, ageing an image saves
    // nothing and would change its text, so none ages.
    assert_eq!(sent[0].0, 6);
    let first = sent[0].1["messages"].as_array().unwrap();
    for i in [2, 6] {
        assert!(
            first[i]["content"]
                .as_str()
                .unwrap()
                .contains("described: A test image"),
            "message {i}"
        );
    }
    // Second request: one new screenshot described; every earlier message
    // is sent exactly as before (the provider's prefix holds).
    assert_eq!(sent[1].0, 1);
    let second = sent[1].1["messages"].as_array().unwrap();
    assert_eq!(&second[..first.len()], &first[..]);
    let m = visor.metrics().await;
    assert_eq!(counter(&m, "visor_describe_total", ("result", "miss")), 7.0);
}

/// A Chat transcript for `model`: one tool screenshot per turn, each
/// `pad` bytes larger than the chart (so the body can be made large).
fn screenshots(model: &str, turns: usize, pad: usize) -> (Value, Vec<Vec<u8>>) {
    let mut messages = vec![json!({"role": "user", "content": "iterate until it matches"})];
    let mut pngs = Vec::new();
    for t in 0..turns {
        let (url, png) = png_data_url(&format!("{t}{}", "x".repeat(pad)));
        let id = format!("call_{t}");
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "shot", "arguments": "{}"}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": [{"type": "image_url", "image_url": {"url": url}}]}));
        pngs.push(png);
    }
    (json!({"model": model, "messages": messages}), pngs)
}

#[tokio::test]
async fn large_bodies_for_a_model_that_can_see_age_out_the_same_way() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, NO_PROMPT_CACHE).await;
    // 4 turns: one screenshot ages out (decoded on the worker); 7 turns:
    // four of 150 KB age out (decoded on the blocking pool).
    for (turns, aged) in [(4, 1), (7, 4)] {
        let (body, pngs) = screenshots("gpt-4o", turns, 150_000);
        let bytes = serde_json::to_vec(&body).unwrap();
        assert!(bytes.len() > 256 * 1024);
        let (status, headers, _) = send(post_json(&visor.url("/v1/chat/completions"), bytes)).await;
        assert_eq!(status, 200);
        assert_eq!(header_num(&headers, "x-visor-images-replaced"), aged as i64);
        let sent = json(&mock.recorded().pop().unwrap().body);
        assert_eq!(image_parts(&sent), turns - aged);
        for (t, png) in pngs.iter().enumerate().take(aged) {
            let text = sent["messages"][2 + 2 * t]["content"].as_str().unwrap();
            assert!(text.contains(&sha256_hex(png)[..12]), "{text}");
        }
        for t in aged..turns {
            assert_eq!(sent["messages"][2 + 2 * t], body["messages"][2 + 2 * t]);
        }
    }
}

#[tokio::test]
async fn the_providers_prompt_cache_figures_are_counted_from_json_and_streams() {
    let mock = MockUpstream::start(|req| match req.uri.path() {
        "/v1/messages" => Reply::sse_chunks(vec![
            Chunk::Data(Bytes::from_static(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":12,\"cache_creation_input_tokens\":2048,\"cache_read_input_tokens\":4096,\"output_tokens\":1}}}\n\n")),
            Chunk::Data(Bytes::from_static(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":40}}\n\n")),
        ]),
        _ => Reply::json(
            200,
            r#"{"id":"c1","object":"chat.completion","choices":[],"usage":{"prompt_tokens":2006,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":1920}}}"#,
        ),
    })
    .await;
    let visor = Visor::for_mock(&mock, "").await;
    let before = visor.metrics().await;
    let chat = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, _) = send(post_json(
        &visor.url("/v1/chat/completions"),
        serde_json::to_vec(&chat).unwrap(),
    ))
    .await;
    assert_eq!(status, 200);
    let messages = json!({"model": "claude-sonnet-4-5", "max_tokens": 64, "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, _) = send(post_json(
        &visor.url("/v1/messages"),
        serde_json::to_vec(&messages).unwrap(),
    ))
    .await;
    assert_eq!(status, 200);
    let grew = |after: &str, kind: &str| {
        counter(after, "visor_tokens_total", ("kind", kind))
            - counter(&before, "visor_tokens_total", ("kind", kind))
    };
    // The counters move when the response ends: wait for them, bounded.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let after = loop {
        let after = visor.metrics().await;
        if grew(&after, "cache_write") > 0.0 || std::time::Instant::now() > deadline {
            break after;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(grew(&after, "cached_read"), 1920.0 + 4096.0);
    assert_eq!(grew(&after, "cache_write"), 2048.0);
    assert_eq!(grew(&after, "prompt"), 2006.0 + 12.0);
}

/// A file view of `n` numbered lines, as an editor tool prints one.
fn view(n: usize) -> String {
    (1..=n)
        .map(|i| format!("{i:>4}:    value_{i} = compute(inputs[{i}], scale={i}.5)  # step {i} of the pipeline"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// What the upstream got for `messages` sent through visor.
async fn through(visor: &Visor, mock: &MockUpstream, model: &str, messages: Value) -> Vec<Value> {
    let body = serde_json::to_vec(&json!({"model": model, "messages": messages})).unwrap();
    let (status, _, _) = send(post_json(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200);
    let sent = json(&mock.recorded().pop().unwrap().body);
    sent["messages"].as_array().unwrap().clone()
}

/// Each harm the dedup of an earlier version did to real agents, through
/// the proxy: what the model needs to act reaches it.
#[tokio::test]
async fn dedup_never_costs_the_agent_what_it_needs_to_act() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let task = json!({"role": "user", "content": "Fix the failing test in pipeline.py."});
    let said = |s: &str| json!({"role": "assistant", "content": s});
    let obs = |s: &str| json!({"role": "user", "content": s});

    // mini-swe-agent: an empty result with its return code, repeated (45
    // bytes), and a result repeated whole keeps its return code.
    let empty = "<returncode>1</returncode>\n<output>\n</output>";
    let full = format!(
        "<returncode>0</returncode>\n<output>\n{}\n</output>",
        view(8)
    );
    let sent = through(
        &visor,
        &mock,
        "m",
        json!([
            task,
            said("grep -n x"),
            obs(empty),
            said("cat pipeline.py"),
            obs(&full),
            said("grep -n y"),
            obs(empty),
            said("cat pipeline.py"),
            obs(&full),
        ]),
    )
    .await;
    assert_eq!(sent[6]["content"], empty, "a small result stays whole");
    assert_eq!(
        sent[8]["content"], "[omitted: same as message 5]\n<returncode>0</returncode>",
        "a repeated result keeps its status lines"
    );

    // OpenHands: the exit line and the working directory inside a
    // repeated run stay; the run ends before them.
    let tail = "[Command finished with exit code 0]\n[Current working directory: /workspace]";
    let sent = through(
        &visor,
        &mock,
        "m",
        json!([
            task,
            said("run"),
            obs(&format!("$ python pipeline.py\n{}\n{tail}", view(10))),
            said("run again"),
            obs(&format!(
                "$ python pipeline.py --again\n{}\n{tail}",
                view(10)
            )),
        ]),
    )
    .await;
    assert_eq!(
        sent[4]["content"],
        format!("$ python pipeline.py --again\n[omitted: message 3 lines 2-11]\n{tail}")
    );

    // A new traceback whose frames repeat an older one: its first and last
    // lines stay.
    let frames = (1..=6)
        .map(|i| format!("  File \"/repo/pipeline.py\", line {}, in stage_{i}\n    return stage_{}(data, options, retries=3)", 10 * i, i + 1))
        .collect::<Vec<_>>()
        .join("\n");
    let header = "Traceback (most recent call last):";
    let sent = through(
        &visor,
        &mock,
        "m",
        json!([
            task,
            said("run"),
            obs(&format!("{header}\n{frames}\nKeyError: 'scale'")),
            said("run again"),
            obs(&format!(
                "{header}\n{frames}\nValueError: scale must be positive"
            )),
        ]),
    )
    .await;
    assert_eq!(
        sent[4]["content"],
        format!("{header}\n[omitted: message 3 lines 2-13]\nValueError: scale must be positive")
    );

    // SWE-agent: a demonstration that shows the same file view twice, in
    // the first user message, stays whole.
    let demo = format!(
        "Here is a demonstration.\n[File: /demo/a.py (8 lines total)]\n{}\nedit 3:3\n[File: /demo/a.py (8 lines total)]\n{}\nNow your task: fix pipeline.py.",
        view(8),
        view(8)
    );
    let sent = through(
        &visor,
        &mock,
        "m",
        json!([obs(&demo), said("open pipeline.py")]),
    )
    .await;
    assert_eq!(sent[0]["content"], demo);

    // Aider: rules from the system prompt repeated at the end of the
    // newest message, on purpose, stay.
    let rules = "Edit blocks follow these rules:\n1. Put the path of the file alone on its own line.\n2. Open a fence with the name of the language.\n3. Write the lines to find, then a divider, then the lines that replace them.\n4. Keep each block small: the lines that change and a few around them.";
    let system = json!({"role": "system", "content": format!("Act as an expert software developer.\n{rules}")});
    let sent = through(
        &visor,
        &mock,
        "m",
        json!([
            system,
            task,
            said("ok"),
            obs(&format!("Now change the scale.\n\n{rules}")),
            said("done"),
            obs(&format!("Now change the retries.\n\n{rules}")),
        ]),
    )
    .await;
    assert_eq!(
        sent[5]["content"],
        format!("Now change the retries.\n\n{rules}")
    );

    // WebVoyager: the short observation text beside each screenshot stays.
    let png = fixture("chart.png").to_vec();
    let shot = |n: u8| {
        let mut p = png.clone();
        p.push(n);
        json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", base64_simd::STANDARD.encode_to_string(&p))}})
    };
    let text =
        "Observation: please analyze the attached screenshot and give the Thought and Action.";
    let sent = through(
        &visor,
        &mock,
        "gpt-4o",
        json!([
            task, said("Thought: look. Action: Click [3]"),
            {"role": "user", "content": [{"type": "text", "text": text}, shot(1)]},
            said("Thought: scroll. Action: Scroll [WINDOW]; down"),
            {"role": "user", "content": [{"type": "text", "text": text}, shot(2)]},
        ]),
    )
    .await;
    assert_eq!(sent[4]["content"][0]["text"], text);
}

/// A tool-calling agent of `turns` rounds whose results show stretches of
/// one file again and again (a file read in parts, a test rerun): dedup
/// rewrites most of them.
fn rereading_agent(turns: usize) -> Vec<Value> {
    let file = view(60);
    let lines: Vec<&str> = file.lines().collect();
    // A long system prompt (tool descriptions, rules): every request is
    // over the 16 KiB under which visor reads in full and keeps nothing.
    let rules: String = (0..340)
        .map(|i| format!("Rule {i}: keep the change small and run the tests.\n"))
        .collect();
    let mut msgs = vec![
        json!({"role": "system", "content": format!("You are a coding agent.\n{rules}")}),
        json!({"role": "user", "content": "Fix the failing test in pipeline.py."}),
    ];
    for t in 0..turns {
        let id = format!("call_{t}");
        msgs.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "bash", "arguments": format!("{{\"command\":\"sed -n {t}p\"}}")}}]}));
        let at = (t * 11) % 40;
        let text = format!(
            "$ sed\n{}\nexit code {}",
            lines[at..at + 18].join("\n"),
            t % 3
        );
        msgs.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
    }
    msgs
}

/// Every turn of a conversation through a visor that continues each
/// conversation's dedup from its previous request and through one that
/// reads every request in full (`state_bytes = 0`), and through one whose
/// states are evicted at once: the upstream gets the same bytes from all
/// three; the first continued every turn after the first, and says so.
#[tokio::test]
async fn a_conversation_continued_reaches_the_upstream_as_read_in_full() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let continuing = Visor::for_mock(&mock, "").await;
    let full = Visor::for_mock(&mock, "[dedup]\nstate_bytes = 0\n").await;
    let evicting = Visor::for_mock(&mock, "[dedup]\nstate_bytes = 1\n").await;
    let msgs = rereading_agent(24);
    let before = continuing.metrics().await;
    let mut turns = 0;
    for t in (3..=msgs.len()).step_by(2) {
        let body = serde_json::to_vec(&json!({"model": "gpt-4o", "messages": msgs[..t]})).unwrap();
        let mut got = Vec::new();
        for visor in [&continuing, &full, &evicting] {
            let (status, _, _) =
                send(post_json(&visor.url("/v1/chat/completions"), body.clone())).await;
            assert_eq!(status, 200);
            got.push(mock.recorded().pop().unwrap().body);
        }
        assert_eq!(
            got[0], got[1],
            "turn {t}: continued differs from the full read"
        );
        assert_eq!(
            got[2], got[1],
            "turn {t}: evicted differs from the full read"
        );
        turns += 1;
    }
    let after = continuing.metrics().await;
    let read = |text: &str, how: &str| counter(text, "visor_dedup_reads_total", ("read", how));
    assert_eq!(
        read(&after, "continued") - read(&before, "continued"),
        f64::from(turns - 1)
    );
    assert_eq!(read(&after, "full") - read(&before, "full"), 1.0);
    // Dedup did rewrite these turns: the comparison is of rewrites.
    let (_, headers, _) = send(post_json(
        &full.url("/v1/chat/completions"),
        serde_json::to_vec(&json!({"model": "gpt-4o", "messages": msgs})).unwrap(),
    ))
    .await;
    assert!(header_num(&headers, "x-visor-bytes-saved") > 2000);
    let evicted = evicting.metrics().await;
    assert_eq!(
        read(&evicted, "continued"),
        0.0,
        "a state over the bound was kept"
    );
    assert_eq!(read(&evicted, "full"), f64::from(turns));
}

/// Two requests of one conversation sent at once (whether they overlap is
/// the scheduler's: when they do, the second finds the state taken by the
/// first and reads in full): both reach the upstream as one read in full
/// would send them, and the conversation goes on.
#[tokio::test]
async fn one_conversations_requests_at_once_each_read_right() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let full = Visor::for_mock(&mock, "[dedup]\nstate_bytes = 0\n").await;
    let msgs = rereading_agent(20);
    let request =
        |t: usize| serde_json::to_vec(&json!({"model": "gpt-4o", "messages": msgs[..t]})).unwrap();
    let url = visor.url("/v1/chat/completions");
    let before = visor.metrics().await;
    let (status, _, _) = send(post_json(&url, request(21))).await;
    assert_eq!(status, 200);
    // The next turn and a retry of it, at once, eight times over.
    for round in 0..8 {
        let seen = mock.count();
        let body = request(23 + 2 * round);
        let sent: Vec<_> =
            futures_util::future::join_all((0..2).map(|_| send(post_json(&url, body.clone()))))
                .await;
        assert!(sent.iter().all(|(s, _, _)| *s == 200));
        let (status, _, _) = send(post_json(&full.url("/v1/chat/completions"), body.clone())).await;
        assert_eq!(status, 200);
        let mut got: Vec<Bytes> = mock.recorded()[seen..]
            .iter()
            .map(|r| r.body.clone())
            .collect();
        let expected = got.pop().unwrap();
        assert_eq!(got.len(), 2);
        assert!(got.iter().all(|b| *b == expected), "round {round}");
    }
    // One of each pair continued the state the round before left.
    let after = visor.metrics().await;
    let continued = |t: &str| counter(t, "visor_dedup_reads_total", ("read", "continued"));
    assert!(continued(&after) - continued(&before) >= 8.0);
}

/// States are kept per client: a client that sends another's conversation
/// (its exact bytes) reads it in full, never continuing — nor timing —
/// the other's state; each client's own next turn continues.
#[tokio::test]
async fn one_clients_state_is_never_anothers() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let msgs = rereading_agent(6);
    let url = visor.url("/v1/chat/completions");
    let send_as = |key: &'static str, t: usize| {
        let body = serde_json::to_vec(&json!({"model": "gpt-4o", "messages": msgs[..t]})).unwrap();
        let mut req = post_json(&url, body);
        req.headers_mut()
            .insert("authorization", format!("Bearer {key}").parse().unwrap());
        send(req)
    };
    let read = |text: &str, how: &str| counter(text, "visor_dedup_reads_total", ("read", how));
    let m0 = visor.metrics().await;
    assert_eq!(send_as("sk-alice", 5).await.0, 200);
    // Bob sends Alice's next turn: nothing of Alice's is his.
    assert_eq!(send_as("sk-bob", 7).await.0, 200);
    let m1 = visor.metrics().await;
    assert_eq!(read(&m1, "continued") - read(&m0, "continued"), 0.0);
    assert_eq!(read(&m1, "full") - read(&m0, "full"), 2.0);
    // Alice's next turn continues hers, Bob's his.
    assert_eq!(send_as("sk-alice", 7).await.0, 200);
    assert_eq!(send_as("sk-bob", 9).await.0, 200);
    let m2 = visor.metrics().await;
    assert_eq!(read(&m2, "continued") - read(&m1, "continued"), 2.0);
}

/// A conversation's next request is checked only after the bytes it
/// shares with the request before (known the same by their hash): a body
/// whose messages go on but that breaks after them, or that changed a
/// byte before, is refused with what a visor keeping no conversation
/// states says; the turn itself goes through.
#[tokio::test]
async fn a_continued_body_is_refused_and_routed_as_one_read_whole() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let on = Visor::for_mock(&mock, "").await;
    let full = Visor::for_mock(&mock, "[dedup]\nstate_bytes = 0\n").await;
    let msgs = rereading_agent(12);
    let body = |t: usize, tail: &str| {
        let m = serde_json::to_string(&msgs[..t]).unwrap();
        format!(r#"{{"model":"gpt-4o","messages":{m}{tail}}}"#).into_bytes()
    };
    let answer = |visor: &Visor, b: Vec<u8>| {
        let url = visor.url("/v1/chat/completions");
        async move {
            let (status, _, text) = send(post_json(&url, b)).await;
            (status, String::from_utf8_lossy(&text).into_owned())
        }
    };
    // The turn before, checked whole and kept.
    for visor in [&on, &full] {
        assert_eq!(answer(visor, body(15, "")).await.0, 200);
    }
    let broken = [
        body(17, r#","temperature":tru"#),
        body(17, r#","Model":"other""#),
        body(17, ",\"user\":\"\u{1}\""),
        // A control byte in the third message: before the bytes' end.
        String::from_utf8(body(17, ""))
            .unwrap()
            .replacen("Fix", "Fi\u{1}", 1)
            .into_bytes(),
    ];
    for (i, b) in broken.into_iter().enumerate() {
        let (got, want) = (answer(&on, b.clone()).await, answer(&full, b).await);
        assert_eq!(got.0, 400, "case {i}: {}", got.1);
        assert_eq!(got, want, "case {i}");
    }
    let recorded = mock.count();
    assert_eq!(answer(&on, body(17, "")).await.0, 200);
    assert_eq!(mock.count(), recorded + 1);
    // The turn was checked on from the turn before (the bodies refused
    // are not counted).
    assert_eq!(prefix_reads(&on, "json").await, (1.0, 0.0));
}
