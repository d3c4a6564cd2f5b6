//! Prompt caching through the real proxy: breakpoints on Messages requests
//! to an Anthropic-kind upstream (a mock whose cache is simulated, so its
//! `usage` says what it read), the client's own markers left alone, a
//! `prompt_cache_key` only for upstreams that opted in, every miss cause
//! told (`x-visor-cache`) and counted, two replicas on one Redis following
//! one conversation.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::Full;
use serde_json::{Value, json};
use support::anthropic_cache::{CacheSim, blocks};
use support::*;

/// A mock Anthropic API whose answers carry the simulated cache's usage.
async fn anthropic(sim: Arc<CacheSim>) -> MockUpstream {
    MockUpstream::start(move |req: &Recorded| {
        let usage = sim.request(&req.body);
        Reply::json(
            200,
            json!({"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
                   "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
                   "usage": usage.json()})
            .to_string(),
        )
    })
    .await
}

/// visor in front of `mock` as an Anthropic-kind upstream, plus `extra`.
async fn visor_for(mock: &MockUpstream, extra: &str) -> Visor {
    Visor::start(&format!(
        "{extra}\n{}api_key = \"sk-ant-upstream\"\nauth = \"x-api-key\"\nmodels = [\"*\"]\n",
        mock.upstream_toml("claude")
    ))
    .await
}

fn words(n: usize) -> String {
    "lorem ipsum ".repeat(n)
}

/// Turn `k` (from 1) of an agent's tool loop, as the agent sends it: no
/// markers, a long system prompt, one tool.
fn tool_loop(k: usize, system: &str) -> Value {
    let mut messages = vec![json!({"role": "user", "content": "Fix the failing test."})];
    for i in 1..k {
        messages.push(json!({"role": "assistant", "content": [
            {"type": "text", "text": format!("Step {i}.")},
            {"type": "tool_use", "id": format!("toolu_{i}"), "name": "sh", "input": {"cmd": format!("run {i}")}}]}));
        messages.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": format!("toolu_{i}"), "content": format!("output {i}: {}", words(40))}]}));
    }
    json!({"model": "claude-test", "max_tokens": 256, "system": system,
           "tools": [{"name": "sh", "description": "Run a shell command", "input_schema": {"type": "object"}}],
           "messages": messages})
}

async fn post_messages(
    visor: &Visor,
    body: impl Into<Bytes>,
    headers: &[(&str, &str)],
) -> (StatusCode, HeaderMap, Bytes) {
    let mut req = Request::post(visor.url("/v1/messages"))
        .header("content-type", "application/json")
        .header("x-api-key", "sk-ant-client")
        .header("anthropic-version", "2023-06-01");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    send(req.body(Full::new(body.into())).unwrap()).await
}

fn cache_header(h: &HeaderMap) -> String {
    h.get("x-visor-cache")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

/// `readable=N` of an `x-visor-cache` value.
fn readable(v: &str) -> u64 {
    v.split(';')
        .find_map(|p| p.trim().strip_prefix("readable="))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no readable in {v:?}"))
}

/// The markers of a body sent upstream: (block index in cache order).
fn markers(body: &[u8]) -> Vec<usize> {
    let v: Value = serde_json::from_slice(body).unwrap();
    blocks(&v)
        .iter()
        .enumerate()
        .filter(|(_, (_, m))| *m)
        .map(|(i, _)| i)
        .collect()
}

/// Waits (bounded) until the counter reaches `want`; its last value.
async fn wait_metric(visor: &Visor, name: &str, labels: &[(&str, &str)], want: f64) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = metric(&visor.metrics().await, name, labels).unwrap_or(0.0);
        if got >= want || Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_tool_loop_without_markers_gets_breakpoints_and_reads_its_prefix_each_turn() {
    let sim = Arc::new(CacheSim::default());
    let mock = anthropic(sim.clone()).await;
    let visor = visor_for(&mock, "").await;
    let system = words(800);
    for k in 1..=6 {
        let (status, h, body) = post_messages(&visor, tool_loop(k, &system).to_string(), &[]).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let header = cache_header(&h);
        match k {
            1 => assert_eq!(header, "readable=0; miss=first"),
            _ => {
                assert!(!header.contains("miss"), "turn {k}: {header}");
                assert!(readable(&header) > 2000, "turn {k}: {header}");
            }
        }
    }
    let sent = mock.recorded();
    assert_eq!(sent.len(), 6);
    let mut previous: Option<Vec<Value>> = None;
    for (i, r) in sent.iter().enumerate() {
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        let b = blocks(&v);
        // The head (tool, system) and the request's last block.
        assert_eq!(markers(&r.body), vec![1, b.len() - 1], "turn {}", i + 1);
        assert_eq!(v["system"][0]["cache_control"]["type"], "ephemeral");
        // Each request's prefix is the previous request, block for block.
        let now: Vec<Value> = b.into_iter().map(|(b, _)| b).collect();
        if let Some(p) = &previous {
            assert_eq!(&now[..p.len()], &p[..], "turn {} rewrote the prefix", i + 1);
        }
        previous = Some(now);
    }
    // Five turns each read their previous request (above 2000 tokens).
    let read = wait_metric(
        &visor,
        "visor_cache_tokens_total",
        &[("kind", "read")],
        10_000.0,
    )
    .await;
    assert!(
        read > 10_000.0,
        "the provider read the prefix each turn: {read}"
    );
    let m = visor.metrics().await;
    assert_eq!(
        metric(&m, "visor_cache_misses_total", &[("cause", "first")]),
        Some(1.0)
    );
    for cause in ["client", "visor", "expired", "provider"] {
        assert_eq!(
            metric(&m, "visor_cache_misses_total", &[("cause", cause)]),
            Some(0.0),
            "{cause}"
        );
    }
    let readable = metric(&m, "visor_cache_tokens_total", &[("kind", "readable")]).unwrap();
    assert!(
        read >= readable * 0.8 && read <= readable * 1.25,
        "read {read} of readable {readable}"
    );
}

#[tokio::test]
async fn the_clients_own_markers_arrive_byte_for_byte_and_are_still_judged() {
    let sim = Arc::new(CacheSim::default());
    let mock = anthropic(sim).await;
    let visor = visor_for(&mock, "").await;
    let mut body = tool_loop(3, &words(800));
    body["system"] =
        json!([{"type": "text", "text": words(800), "cache_control": {"type": "ephemeral"}}]);
    // Pretty-printed, as no rewrite would leave it.
    let text = serde_json::to_string_pretty(&body).unwrap();
    for _ in 0..2 {
        let (status, h, _) = post_messages(&visor, text.clone(), &[]).await;
        assert_eq!(status, 200);
        assert!(h.contains_key("x-visor-cache"));
    }
    for r in mock.recorded() {
        assert_eq!(
            r.body,
            text.as_bytes(),
            "the client's markers: forwarded as they came"
        );
    }
    // Read at the client's own breakpoint the second time.
    let read = wait_metric(&visor, "visor_cache_tokens_total", &[("kind", "read")], 1.0).await;
    assert!(read > 2000.0, "{read}");
}

#[tokio::test]
async fn a_short_prompt_gets_no_breakpoint_and_off_leaves_them_all_out() {
    let mock = anthropic(Arc::new(CacheSim::default())).await;
    let visor = visor_for(&mock, "").await;
    let short = tool_loop(3, "Be brief.").to_string();
    let (status, h, _) = post_messages(&visor, short.clone(), &[]).await;
    assert_eq!(status, 200);
    assert_eq!(cache_header(&h), "readable=0; miss=first");
    assert_eq!(mock.recorded()[0].body, short.as_bytes());
    // breakpoints = "off", and x-visor-transform: off, leave a long one alone.
    let long = tool_loop(3, &words(800)).to_string();
    let off = anthropic(Arc::new(CacheSim::default())).await;
    let visor_off = visor_for(&off, "[cache]\nbreakpoints = \"off\"\n").await;
    post_messages(&visor_off, long.clone(), &[]).await;
    post_messages(&visor, long.clone(), &[("x-visor-transform", "off")]).await;
    assert_eq!(off.recorded()[0].body, long.as_bytes());
    assert_eq!(mock.recorded()[1].body, long.as_bytes());
}

#[tokio::test]
async fn a_turn_of_25_tool_results_gets_the_look_back_breakpoint_and_reads() {
    let sim = Arc::new(CacheSim::default());
    let mock = anthropic(sim.clone()).await;
    let visor = visor_for(&mock, "[cache]\nttl = \"1h\"\n").await;
    let system = words(800);
    let question = json!({"role": "user", "content": format!("Check every file. {}", words(100))});
    let tools = json!([{"name": "cat", "input_schema": {"type": "object"}}]);
    let first = json!({"model": "claude-test", "max_tokens": 64, "system": system, "tools": tools, "messages": [question]});
    post_messages(&visor, first.to_string(), &[]).await;
    let calls: Vec<Value> = (0..25)
        .map(|i| json!({"type": "tool_use", "id": format!("toolu_{i}"), "name": "cat", "input": {"f": i}}))
        .collect();
    let results: Vec<Value> = (0..25)
        .map(|i| json!({"type": "tool_result", "tool_use_id": format!("toolu_{i}"), "content": format!("file {i}")}))
        .collect();
    let second = json!({"model": "claude-test", "max_tokens": 64, "system": system, "tools": tools,
        "messages": [question, {"role": "assistant", "content": calls}, {"role": "user", "content": results}]});
    let (_, h, _) = post_messages(&visor, second.to_string(), &[]).await;
    assert!(!cache_header(&h).contains("miss"), "{h:?}");
    let sent = mock.recorded();
    let v: Value = serde_json::from_slice(&sent[1].body).unwrap();
    // Head, where the first request ended (51 blocks back), the end.
    assert_eq!(markers(&sent[1].body), vec![1, 2, 52]);
    assert_eq!(
        v["messages"][0]["content"][0]["cache_control"],
        json!({"type": "ephemeral", "ttl": "1h"})
    );
    let read = wait_metric(&visor, "visor_cache_tokens_total", &[("kind", "read")], 1.0).await;
    let head_and_question = (words(800).len() + words(100).len()) as f64 / 4.0;
    assert!(read > head_and_question * 0.9, "read past the head: {read}");
}

/// A Chat upstream that answers every request.
async fn openai() -> MockUpstream {
    MockUpstream::start(|_: &Recorded| chat_ok()).await
}

fn chat_turns(first: &str, turns: usize) -> Value {
    let mut messages = vec![
        json!({"role": "system", "content": "sys"}),
        json!({"role": "user", "content": first}),
    ];
    for i in 1..turns {
        messages.push(json!({"role": "assistant", "content": format!("a{i}")}));
        messages.push(json!({"role": "user", "content": format!("u{i}")}));
    }
    json!({"model": "gpt-test", "messages": messages})
}

#[tokio::test]
async fn openai_kind_gets_a_stable_prompt_cache_key_only_when_it_opted_in() {
    let keyed = openai().await;
    let plain = openai().await;
    let visor = Visor::start(&format!(
        "{}prompt_cache_key = true\nmodels = [\"keyed-*\"]\n{}models = [\"*\"]\n",
        keyed.upstream_toml("keyed"),
        plain.upstream_toml("plain")
    ))
    .await;
    let send_as = |model: &str, body: &Value| {
        let mut b = body.clone();
        b["model"] = json!(model);
        post_json(&visor.url("/v1/chat/completions"), b.to_string())
    };
    for turns in 1..=3 {
        for model in ["keyed-1", "plain-1"] {
            let (status, h, _) = send(send_as(model, &chat_turns("hello", turns))).await;
            assert_eq!(status, 200);
            assert!(h.contains_key("x-visor-cache"));
        }
    }
    send(send_as("keyed-1", &chat_turns("another conversation", 1))).await;
    let mut own = chat_turns("hello", 1);
    own["prompt_cache_key"] = json!("mine");
    send(send_as("keyed-1", &own)).await;
    let keys: Vec<Value> = keyed
        .recorded()
        .iter()
        .map(|r| serde_json::from_slice::<Value>(&r.body).unwrap()["prompt_cache_key"].clone())
        .collect();
    assert_eq!(keys.len(), 5);
    let k = keys[0].as_str().unwrap();
    assert!(k.starts_with("visor-"), "{k}");
    assert_eq!(keys[1], keys[0]);
    assert_eq!(keys[2], keys[0]);
    assert_ne!(keys[3], keys[0], "another conversation, another key");
    assert_eq!(keys[4], "mine");
    for r in plain.recorded() {
        assert!(
            !String::from_utf8_lossy(&r.body).contains("prompt_cache_key"),
            "never to an upstream that did not opt in"
        );
    }
}

#[tokio::test]
async fn each_miss_is_told_with_its_cause_and_counted() {
    let sim = Arc::new(CacheSim::default());
    let mock = anthropic(sim.clone()).await;
    let visor = visor_for(&mock, "[cache]\nexpire_after_secs = 0.2\n").await;
    let system = words(800);
    let turn = |k: usize, system: &str| tool_loop(k, system).to_string();
    let header = |h: &HeaderMap| cache_header(h);
    // The client changes its system prompt: `client` at message 0.
    let (_, h, _) = post_messages(&visor, turn(1, &system), &[]).await;
    assert_eq!(header(&h), "readable=0; miss=first");
    let changed = format!("{system} Today is Tuesday.");
    let (_, h, _) = post_messages(&visor, turn(2, &changed), &[]).await;
    assert_eq!(header(&h), "readable=0; miss=client");
    // Past the cache's lifetime (0.2 s here), and the provider's cache is
    // gone: `expired` (had it read all the same, no miss would be counted).
    tokio::time::sleep(Duration::from_millis(300)).await;
    sim.forget.store(true, Ordering::SeqCst);
    let (_, h, _) = post_messages(&visor, turn(3, &changed), &[]).await;
    let told = header(&h);
    assert!(
        told.ends_with("; miss=expired") && readable(&told) > 2000,
        "{told}"
    );
    // In time and stable, and the provider reads nothing: `provider`,
    // known only once the answer said its usage.
    let (_, h, _) = post_messages(&visor, turn(4, &changed), &[]).await;
    assert!(!header(&h).contains("miss"), "{h:?}");
    assert_eq!(
        wait_metric(
            &visor,
            "visor_cache_misses_total",
            &[("cause", "provider")],
            1.0
        )
        .await,
        1.0
    );
    let m = visor.metrics().await;
    for cause in ["first", "client", "expired"] {
        assert_eq!(
            metric(&m, "visor_cache_misses_total", &[("cause", cause)]),
            Some(1.0),
            "{cause}"
        );
    }
    assert_eq!(
        metric(&m, "visor_cache_misses_total", &[("cause", "visor")]),
        Some(0.0)
    );
}

#[tokio::test]
async fn two_replicas_on_one_redis_follow_one_conversation() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let store = format!(
        "[store]\nbackend = \"{}\"\nprefix = \"visor-cache-test:\"\n",
        redis.url()
    );
    let sim = Arc::new(CacheSim::default());
    let mock = anthropic(sim).await;
    let a = visor_for(&mock, &store).await;
    let b = visor_for(&mock, &store).await;
    let system = words(800);
    let (_, h, _) = post_messages(&a, tool_loop(1, &system).to_string(), &[]).await;
    assert_eq!(cache_header(&h), "readable=0; miss=first");
    let (_, h, _) = post_messages(&b, tool_loop(2, &system).to_string(), &[]).await;
    let told = cache_header(&h);
    assert!(
        !told.contains("miss") && readable(&told) > 2000,
        "replica b follows what a sent: {told}"
    );
    // And back: a sees b's request as the previous one.
    let (_, h, _) = post_messages(&a, tool_loop(3, &system).to_string(), &[]).await;
    let again = cache_header(&h);
    assert!(readable(&again) > readable(&told), "{again} after {told}");
    // Redis gone: the request is answered, judged against what this
    // replica kept itself.
    redis.stop();
    let (status, h, _) = post_messages(&a, tool_loop(4, &system).to_string(), &[]).await;
    assert_eq!(status, 200);
    let alone = cache_header(&h);
    assert!(
        !alone.contains("miss") && readable(&alone) > readable(&told),
        "{alone}"
    );
}

/// A mock Anthropic API that streams, its cache usage in `message_start`.
async fn anthropic_streaming(sim: Arc<CacheSim>) -> MockUpstream {
    MockUpstream::start(move |req: &Recorded| {
        let u = sim.request(&req.body);
        let events = [
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                   "model": "claude-test", "content": [], "usage": {"input_tokens": u.input, "output_tokens": 1,
                   "cache_read_input_tokens": u.read, "cache_creation_input_tokens": u.written}}}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ok"}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}}),
            json!({"type": "message_stop"}),
        ];
        Reply::sse_chunks(
            events
                .iter()
                .map(|e| Chunk::Data(Bytes::from(format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap()))))
                .collect(),
        )
    })
    .await
}

#[tokio::test]
async fn a_streamed_answer_says_what_the_provider_read_and_wrote() {
    let mock = anthropic_streaming(Arc::new(CacheSim::default())).await;
    let visor = visor_for(&mock, "").await;
    let system = words(800);
    for k in 1..=2 {
        let mut body = tool_loop(k, &system);
        body["stream"] = json!(true);
        let (status, _, text) = post_messages(&visor, body.to_string(), &[]).await;
        assert_eq!(status, 200);
        assert!(String::from_utf8_lossy(&text).contains("message_stop"));
    }
    let written = wait_metric(
        &visor,
        "visor_cache_tokens_total",
        &[("kind", "written")],
        2000.0,
    )
    .await;
    let read = wait_metric(
        &visor,
        "visor_cache_tokens_total",
        &[("kind", "read")],
        2000.0,
    )
    .await;
    assert!(
        written >= 2000.0 && read >= 2000.0,
        "written {written}, read {read}"
    );
    let m = visor.metrics().await;
    assert_eq!(
        metric(&m, "visor_cache_misses_total", &[("cause", "provider")]),
        Some(0.0)
    );
    assert_eq!(
        metric(&m, "visor_tokens_total", &[("kind", "cached_read")]),
        Some(read)
    );
}

/// A model of unknown vision whose provider refuses its image: the retry,
/// the image replaced, is another body, and is sent with the breakpoints
/// a body sent so at first would have had (and judged as sent).
#[tokio::test]
async fn a_refusals_retry_is_sent_with_its_breakpoints() {
    let sim = Arc::new(CacheSim::default());
    let s = sim.clone();
    let mock = MockUpstream::start(move |req: &Recorded| {
        if String::from_utf8_lossy(&req.body).contains(r#""type":"image""#) {
            return Reply::json(
                400,
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"This model does not support image input."}}"#,
            );
        }
        let usage = s.request(&req.body);
        Reply::json(200, json!({"id": "m", "type": "message", "role": "assistant", "content": [], "usage": usage.json()}).to_string())
    })
    .await;
    let visor = visor_for(&mock, "[images]\nnon_vision = \"strip\"\n").await;
    let (url, _) = png_data_url("retry");
    let data = url.split_once(',').unwrap().1.to_owned();
    let mut body = tool_loop(3, &words(800));
    body["model"] = json!("mystery-claude");
    body["messages"][0]["content"] = json!([
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "Fix the failing test shown here."}]);
    let (status, h, text) = post_messages(&visor, body.to_string(), &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&text));
    let recs = mock.recorded();
    assert_eq!(recs.len(), 2, "one refusal, one retry");
    let (first, retry) = (markers(&recs[0].body), markers(&recs[1].body));
    assert!(!first.is_empty(), "the first attempt had breakpoints");
    assert!(!String::from_utf8_lossy(&recs[1].body).contains(r#""type":"image""#));
    assert_eq!(
        retry.len(),
        first.len(),
        "the retry too: {retry:?} / {first:?}"
    );
    assert!(cache_header(&h).starts_with("readable="), "{h:?}");
    // One request, one reading counted (the retry's body is asked too).
    let m = visor.metrics().await;
    let reads: f64 = ["full", "continued"]
        .iter()
        .filter_map(|r| {
            metric(
                &m,
                "visor_prefix_reads_total",
                &[("part", "prompt_cache"), ("read", r)],
            )
        })
        .sum();
    assert_eq!(reads, 1.0);
    // Kept as sent: the same request again (its image replaced up front
    // now) reads what the retry wrote, with no miss.
    let (status, h, _) = post_messages(&visor, body.to_string(), &[]).await;
    assert_eq!(status, 200);
    assert_eq!(mock.count(), 3);
    let told = cache_header(&h);
    assert!(readable(&told) > 0 && !told.contains("miss"), "{told}");
}

#[tokio::test]
async fn a_refused_request_is_not_what_the_next_is_judged_against() {
    let sim = Arc::new(CacheSim::default());
    let refuse = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s, r) = (sim.clone(), refuse.clone());
    let mock = MockUpstream::start(move |req: &Recorded| {
        if r.swap(false, Ordering::SeqCst) {
            return Reply::json(529, r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#);
        }
        let usage = s.request(&req.body);
        Reply::json(200, json!({"id": "m", "type": "message", "role": "assistant", "content": [], "usage": usage.json()}).to_string())
    })
    .await;
    let visor = visor_for(&mock, "").await;
    let system = words(800);
    post_messages(&visor, tool_loop(1, &system).to_string(), &[]).await;
    refuse.store(true, Ordering::SeqCst);
    let (status, _, _) = post_messages(&visor, tool_loop(4, &system).to_string(), &[]).await;
    assert_eq!(status, 529);
    // The agent sends it again: what is readable is what turn 1 wrote.
    let (status, h, _) = post_messages(&visor, tool_loop(4, &system).to_string(), &[]).await;
    assert_eq!(status, 200);
    let told = cache_header(&h);
    let turn1 = (words(800).len() as u64) / 4;
    assert!(
        readable(&told) < turn1 + 200,
        "judged against turn 1, not the refused one: {told}"
    );
    let read = wait_metric(&visor, "visor_cache_tokens_total", &[("kind", "read")], 1.0).await;
    assert!(read > 0.0, "the retry read what turn 1 wrote: {read}");
    let m = visor.metrics().await;
    assert_eq!(
        metric(&m, "visor_cache_misses_total", &[("cause", "provider")]),
        Some(0.0)
    );
}

#[tokio::test]
async fn a_pretty_client_whose_request_visor_rewrites_is_no_visor_miss() {
    let mock = anthropic(Arc::new(CacheSim::default())).await;
    let visor = visor_for(&mock, "").await;
    let system = words(800);
    // The same long tool output twice from turn 3 on: dedup rewrites it.
    let output = (0..12)
        .map(|i| format!("line {i} of the same listing, long enough to count"))
        .collect::<Vec<_>>()
        .join("\n");
    let turn = |k: usize| {
        let mut v = tool_loop(k, &system);
        for (i, m) in v["messages"].as_array_mut().unwrap().iter_mut().enumerate() {
            if i >= 2 && m["role"] == "user" {
                m["content"][0]["content"] = json!(output);
            }
        }
        serde_json::to_string_pretty(&v).unwrap()
    };
    for k in 1..=4 {
        let (status, h, _) = post_messages(&visor, turn(k), &[]).await;
        assert_eq!(status, 200);
        if k > 1 {
            assert!(!cache_header(&h).contains("miss"), "turn {k}: {h:?}");
        }
    }
    let sent = mock.recorded();
    assert!(
        String::from_utf8_lossy(&sent[3].body).contains("[omitted"),
        "dedup rewrote turn 4"
    );
    let m = visor.metrics().await;
    assert_eq!(
        metric(&m, "visor_cache_misses_total", &[("cause", "visor")]),
        Some(0.0)
    );
}

#[tokio::test]
async fn odd_bodies_are_forwarded_and_never_a_panic() {
    let mock = anthropic(Arc::new(CacheSim::default())).await;
    let visor = visor_for(&mock, "").await;
    let system = words(800);
    for body in [
        json!({"model": "claude-test", "system": system, "tools": [{"name": "t"}], "messages": [{"role": "user", "content": [1, null, "x"]}]}).to_string(),
        format!(r#"{{"model":"claude-test","system":"{system}","messages":[{{"cache_control":{{}},"cache_control":{{}},"role":"user","content":"hi"}}]}}"#),
        json!({"model": "claude-test", "system": 7, "messages": "not a list"}).to_string(),
        json!({"model": "claude-test", "system": system, "messages": [{"role": "user", "content": null}, {"role": "assistant", "content": {"odd": true}}, {"role": "user", "content": [{"type": "text", "text": "\n"}]}]}).to_string(),
    ] {
        let (status, h, _) = post_messages(&visor, body.clone(), &[]).await;
        assert_eq!(status, 200, "{body}");
        assert!(h.contains_key("x-visor-cache"), "{body}");
        let sent = mock.recorded().pop().unwrap();
        let v: Value = serde_json::from_slice(&sent.body).expect("still JSON");
        assert_eq!(v["model"], "claude-test");
    }
    let chat = openai().await;
    let visor = Visor::start(&format!(
        "{}prompt_cache_key = true\nmodels = [\"*\"]\n",
        chat.upstream_toml("keyed")
    ))
    .await;
    for body in [
        r#"{ }"#,
        r#"{"model":"m","prompt_cache_key":null,"messages":[]}"#,
        r#"  {"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    ] {
        send(post_json(&visor.url("/v1/chat/completions"), body)).await;
        let sent = chat.recorded().pop().unwrap();
        let v: Value = serde_json::from_slice(&sent.body).expect("still JSON");
        assert_eq!(
            sent.body
                .windows(16)
                .filter(|w| w == b"prompt_cache_key")
                .count(),
            1,
            "{v}"
        );
    }
}

/// Turn `k` of an agent that reads the same file again and again (dedup
/// rewrites its later reads), in Messages (`chat`: false) or Chat; each
/// request over the 8 KiB from which visor keeps a conversation's state.
fn rereading(k: usize, chat: bool) -> Value {
    let file: Vec<String> = (1..=40)
        .map(|i| format!("{i:>4}:    total_{i} = add(parts[{i}], weight={i}.25)  # line {i}"))
        .collect();
    let read = |i: usize| {
        let at = (i * 7) % 20;
        format!(
            "$ cat sum.py\n{}\nexit code 0",
            file[at..at + 20].join("\n")
        )
    };
    let task = "Make the totals add up.";
    let mut messages = match chat {
        true => vec![
            json!({"role": "system", "content": words(800)}),
            json!({"role": "user", "content": task}),
        ],
        false => vec![json!({"role": "user", "content": task})],
    };
    for i in 1..k {
        let id = format!("call_{i}");
        match chat {
            true => {
                messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "sh", "arguments": "{\"cmd\":\"cat sum.py\"}"}}]}));
                messages.push(json!({"role": "tool", "tool_call_id": id, "content": read(i)}));
            }
            false => {
                messages.push(json!({"role": "assistant", "content": [
                    {"type": "tool_use", "id": id, "name": "sh", "input": {"cmd": "cat sum.py"}}]}));
                messages.push(json!({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": id, "content": read(i)}]}));
            }
        }
    }
    match chat {
        true => json!({"model": "gpt-test", "messages": messages}),
        false => json!({"model": "claude-test", "max_tokens": 256, "system": words(800),
                        "tools": [{"name": "sh", "description": "Run a shell command", "input_schema": {"type": "object"}}],
                        "messages": messages}),
    }
}

/// Each turn of a conversation through a visor that reads it on from
/// where its previous request's messages ended (the prompt cache's reading
/// kept with the conversation's dedup state) and through one that reads
/// every request in full (`[dedup] state_bytes = 0`): the upstream gets
/// the same bytes — visor's breakpoints in the same places, the same
/// `prompt_cache_key` — and the client the same `x-visor-cache`, for
/// Messages to an Anthropic-kind upstream and Chat to one that opted in to
/// the key; the bodies dedup rewrote as well as those it left.
#[tokio::test]
async fn a_conversation_read_on_from_its_previous_request_is_cached_as_read_in_full() {
    let upstreams = |sims: &[Arc<CacheSim>; 2]| {
        let (a, b) = (sims[0].clone(), sims[1].clone());
        async move { (anthropic(a).await, anthropic(b).await) }
    };
    let sims = [Arc::new(CacheSim::default()), Arc::new(CacheSim::default())];
    let (m1, m2) = upstreams(&sims).await;
    let (k1, k2) = (openai().await, openai().await);
    let keyed = |m: &MockUpstream, k: &MockUpstream, extra: &str| {
        format!(
            "{extra}\n{}api_key = \"sk-ant-upstream\"\nauth = \"x-api-key\"\nmodels = [\"claude-*\"]\n{}prompt_cache_key = true\nmodels = [\"gpt-*\"]\n",
            m.upstream_toml("claude"),
            k.upstream_toml("keyed")
        )
    };
    let on = Visor::start(&keyed(&m1, &k1, "")).await;
    let full = Visor::start(&keyed(&m2, &k2, "[dedup]\nstate_bytes = 0\n")).await;
    let mut rewritten = 0;
    for chat in [false, true] {
        let (m1, m2) = match chat {
            false => (&m1, &m2),
            true => (&k1, &k2),
        };
        for k in 1..=12 {
            let body = rereading(k, chat).to_string();
            let mut seen = Vec::new();
            for (visor, mock) in [(&on, m1), (&full, m2)] {
                let (status, h, answer) = match chat {
                    false => post_messages(visor, body.clone(), &[]).await,
                    true => send(post_json(&visor.url("/v1/chat/completions"), body.clone())).await,
                };
                assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
                let sent = mock.recorded().pop().unwrap().body;
                let saved = h
                    .get("x-visor-bytes-saved")
                    .map_or(0, |v| v.to_str().unwrap().parse::<u64>().unwrap());
                seen.push((sent, cache_header(&h), saved));
            }
            assert_eq!(
                seen[0].0, seen[1].0,
                "chat {chat}, turn {k}: the upstream's bytes"
            );
            assert_eq!(seen[0].1, seen[1].1, "chat {chat}, turn {k}: x-visor-cache");
            assert!(!seen[0].1.is_empty(), "chat {chat}, turn {k}: judged");
            rewritten += usize::from(seen[0].2 > 0);
        }
    }
    // Both kinds of body were compared: some dedup rewrote, some it left.
    assert!((4..24).contains(&rewritten), "{rewritten} of 24 rewritten");
    let continued = metric(
        &on.metrics().await,
        "visor_dedup_reads_total",
        &[("read", "continued")],
    );
    assert!(continued.unwrap_or(0.0) >= 20.0, "{continued:?}");
    // The prompt cache read each of those on from the turn before too.
    let (continued, _) = prefix_reads(&on, "prompt_cache").await;
    assert!(continued >= 20.0, "{continued}");
    let sent = m1.recorded();
    assert!(markers(&sent.last().unwrap().body).len() >= 2);
}

/// `visor explain --raw` (with the proxy's config) prints the bytes the
/// proxy sends, prompt cache included: the breakpoints on a Messages
/// request to an Anthropic-kind upstream, and the `prompt_cache_key` for
/// an upstream that opted in (the key of a request with no proxy key,
/// counted under the `[[key]]` that has none); its report counts them.
#[tokio::test]
async fn explain_prints_what_the_prompt_cache_adds() {
    let mock = anthropic(Arc::new(CacheSim::default())).await;
    let keyed = openai().await;
    let config = format!(
        "[[key]]\nname = \"anyone\"\nrequests_per_minute = 1000\n{}api_key = \"sk-ant-upstream\"\nauth = \"x-api-key\"\nmodels = [\"claude-*\"]\n{}prompt_cache_key = true\nmodels = [\"*\"]\n",
        mock.upstream_toml("claude"),
        keyed.upstream_toml("keyed")
    );
    let proxy = Visor::start(&config).await;
    let path = temp_config("explain-cache", &config);
    let explain = |args: &[&str], body: &str| {
        let mut child = visor()
            .arg("explain")
            .arg("--config")
            .arg(&path)
            .args(args)
            .arg("-")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), body.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };

    let messages = tool_loop(3, &words(800)).to_string();
    let (status, _, _) = post_messages(&proxy, messages.clone(), &[]).await;
    assert_eq!(status, 200);
    let sent = mock.recorded().pop().unwrap().body;
    let placed = markers(&sent).len();
    assert!(placed > 0);
    let raw = explain(&["--endpoint", "messages", "--raw"], &messages);
    assert_eq!(
        String::from_utf8_lossy(&raw),
        String::from_utf8_lossy(&sent)
    );
    let report: Value =
        serde_json::from_slice(&explain(&["--endpoint", "messages"], &messages)).unwrap();
    assert_eq!(report["report"]["cache_breakpoints"], placed);
    // The same dry run inside the proxy.
    let url = proxy.url("/visor/api/explain?endpoint=messages");
    let (status, _, out) = send(post_json(&url, messages.clone())).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        v["request"],
        serde_json::from_slice::<Value>(&sent).unwrap()
    );
    assert_eq!(v["report"]["cache_breakpoints"], placed);

    let mut chat = chat_turns("hello", 2);
    chat["model"] = json!("gpt-test");
    let chat = chat.to_string();
    let (status, _, _) = send(post_json(&proxy.url("/v1/chat/completions"), chat.clone())).await;
    assert_eq!(status, 200);
    let sent = keyed.recorded().pop().unwrap().body;
    assert!(String::from_utf8_lossy(&sent).contains("\"prompt_cache_key\":\"visor-"));
    assert_eq!(explain(&["--raw"], &chat), sent);
    let report: Value = serde_json::from_slice(&explain(&[], &chat)).unwrap();
    assert_eq!(report["report"]["cache_key"], true);
}

/// A client that turns visor's changes off for one request and on again
/// (`x-visor-transform: off`): the bodies sent differ where dedup rewrote,
/// and that is the client's change, never a `visor` miss.
#[tokio::test]
async fn turning_the_transforms_off_and_on_is_the_clients_change() {
    let mock = anthropic(Arc::new(CacheSim::default())).await;
    let proxy = visor_for(&mock, "").await;
    let file: String = (0..12)
        .map(|i| format!("    line {i} of the module under test, long enough to count\n"))
        .collect();
    let mut body = tool_loop(3, &words(800));
    for k in [2, 4] {
        body["messages"][k]["content"][0]["content"] = json!(file.clone());
    }
    let body = body.to_string();
    let (status, h, _) = post_messages(&proxy, body.clone(), &[("x-visor-transform", "off")]).await;
    assert_eq!(status, 200);
    assert!(cache_header(&h).contains("miss=first"), "{h:?}");
    let (status, h, _) = post_messages(&proxy, body.clone(), &[]).await;
    assert_eq!(status, 200);
    let sent = mock.recorded();
    assert_ne!(sent[0].body, sent[1].body, "dedup changed the second");
    assert!(cache_header(&h).contains("miss=client"), "{h:?}");
    let (status, h, _) = post_messages(&proxy, body.clone(), &[("x-visor-transform", "off")]).await;
    assert_eq!(status, 200);
    assert!(cache_header(&h).contains("miss=client"), "{h:?}");
    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, "visor_cache_misses_total", &[("cause", "visor")]),
        Some(0.0)
    );
}
