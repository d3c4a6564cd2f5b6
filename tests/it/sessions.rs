//! Server-side sessions through the real proxy (Chat Completions): history
//! prepended at the chosen depth, re-sent messages not doubled, streamed
//! replies stored whole, 50 concurrent requests losing nothing, restart
//! (disk store), two replicas sharing one Redis, GET/DELETE, bad ids, per-key
//! isolation and 503 when the store cannot be reached.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use serde_json::{Value, json};
use support::*;

/// Answers each chat with `re: <the last user message>`, as JSON or as a
/// stream of three pieces.
fn echo(req: &Recorded) -> Reply {
    let v: Value = serde_json::from_slice(&req.body).unwrap_or_default();
    let responses = req.uri.path().ends_with("/responses");
    let items = if responses {
        &v["input"]
    } else {
        &v["messages"]
    };
    // (A Responses string `input` is the user's message itself.)
    let said: String = items.as_str().map(str::to_owned).unwrap_or_default()
        + &items
            .as_array()
            .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
            .map(|m| match &m["content"] {
                Value::String(s) => s.clone(),
                Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
                _ => "?".to_owned(),
            })
            .unwrap_or_default();
    if responses {
        return Reply::json(
            200,
            json!({"id": "resp_1", "object": "response", "output": [{"id": "msg_1", "type": "message", "status": "completed", "role": "assistant", "content": [{"type": "output_text", "text": format!("re: {said}")}]}]})
                .to_string(),
        );
    }
    if req.uri.path().ends_with("/messages") {
        return Reply::json(
            200,
            json!({"id": "msg_1", "type": "message", "role": "assistant", "content": [{"type": "text", "text": format!("re: {said}")}], "stop_reason": "end_turn"})
                .to_string(),
        );
    }
    if v["stream"] == true {
        let piece = |t: &str, fin: Option<&str>| {
            Bytes::from(format!(
                "data: {}\n\n",
                json!({"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": fin}]})
            ))
        };
        return Reply::sse_chunks(vec![
            Chunk::Data(piece("re: ", None)),
            Chunk::Data(piece(&said, None)),
            Chunk::Data(piece("", Some("stop"))),
            Chunk::Data(Bytes::from_static(b"data: [DONE]\n\n")),
        ]);
    }
    Reply::json(
        200,
        json!({"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("re: {said}")}, "finish_reason": "stop"}]})
            .to_string(),
    )
}

fn user(t: &str) -> Value {
    json!({"role": "user", "content": t})
}

fn assistant(t: &str) -> Value {
    json!({"role": "assistant", "content": t})
}

fn chat(
    visor: &Visor,
    session: &str,
    messages: Value,
    extra: &[(&str, &str)],
) -> Request<Full<Bytes>> {
    let body = json!({"model": "gpt-4o-mini", "messages": messages});
    let mut req = post_json(
        &visor.url("/v1/chat/completions"),
        serde_json::to_vec(&body).unwrap(),
    );
    req.headers_mut()
        .insert("x-visor-session", session.parse().unwrap());
    for (k, v) in extra {
        req.headers_mut().insert(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    req
}

fn sent_messages(mock: &MockUpstream) -> Value {
    let v: Value = serde_json::from_slice(&mock.recorded().pop().unwrap().body).unwrap();
    v["messages"].clone()
}

async fn stored(visor: &Visor, session: &str, extra: &[(&str, &str)]) -> (u16, Value) {
    let mut req = Request::get(visor.url(&format!("/visor/sessions/{session}")))
        .body(Full::new(Bytes::new()))
        .unwrap();
    for (k, v) in extra {
        req.headers_mut().insert(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    let (status, _, body) = send(req).await;
    (
        status.as_u16(),
        serde_json::from_slice(&body).unwrap_or_default(),
    )
}

#[tokio::test]
async fn history_is_prepended_at_the_chosen_depth_and_never_doubled() {
    let mock = MockUpstream::start(echo).await;
    let visor = Visor::for_mock(&mock, "").await;
    let sys = json!({"role": "system", "content": "be brief"});
    let (status, headers, _) = send(chat(&visor, "s1", json!([sys, user("hello")]), &[])).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-history-used"], "0");
    assert_eq!(sent_messages(&mock), json!([sys, user("hello")]));

    let (_, headers, _) = send(chat(&visor, "s1", json!([sys, user("again")]), &[])).await;
    assert_eq!(headers["x-visor-history-used"], "2");
    assert_eq!(
        sent_messages(&mock),
        json!([sys, user("hello"), assistant("re: hello"), user("again")]),
        "system first, then the history, then the new message"
    );

    // Depth 1: only the newest stored message.
    let (_, headers, _) = send(chat(
        &visor,
        "s1",
        json!([user("third")]),
        &[("x-visor-history", "1")],
    ))
    .await;
    assert_eq!(headers["x-visor-history-used"], "1");
    assert_eq!(
        sent_messages(&mock),
        json!([assistant("re: again"), user("third")])
    );

    // A client that re-sends what is stored (the SDK adds fields of its own
    // to the replies it got) does not get it twice: its own copies go, byte
    // for byte, and nothing it holds is inserted.
    let echoed = json!({"role": "assistant", "content": "re: third", "refusal": null});
    let resent = json!([
        user("again"),
        assistant("re: again"),
        user("third"),
        echoed,
        user("fourth")
    ]);
    let (_, headers, _) = send(chat(
        &visor,
        "s1",
        resent.clone(),
        &[("x-visor-history", "4")],
    ))
    .await;
    assert_eq!(headers["x-visor-history-used"], "0");
    assert_eq!(sent_messages(&mock), resent);
    let (status, v) = stored(&visor, "s1", &[]).await;
    assert_eq!(status, 200);
    assert_eq!(v["session"], "s1");
    assert_eq!(
        v["messages"],
        json!([
            user("hello"),
            assistant("re: hello"),
            user("again"),
            assistant("re: again"),
            user("third"),
            assistant("re: third"),
            user("fourth"),
            assistant("re: fourth")
        ]),
        "every turn once, system messages not stored"
    );
    let m = visor.metrics().await;
    assert_eq!(
        metric(&m, "visor_session_turns_total", &[("result", "with_reply")]),
        Some(4.0)
    );
    assert_eq!(
        metric(&m, "visor_session_history_messages_count", &[]),
        Some(4.0)
    );
    assert_eq!(
        metric(&m, "visor_session_history_messages_sum", &[]),
        Some(3.0),
        "0 + 2 + 1 + 0 messages inserted"
    );
}

/// The history a turn prepends is the bytes the client sent the turn
/// before (its key order, its spacing), so the prefix a provider cached is
/// sent again unchanged; a first request that brings a conversation stores
/// all of it, calls with their results.
#[tokio::test]
async fn history_goes_back_as_the_bytes_it_was_sent_as() {
    let mock = MockUpstream::start(echo).await;
    let visor = Visor::for_mock(&mock, "").await;
    // Keys in an order serde would not write (role before content, a
    // name, spaces).
    let first = r#"{"model": "gpt-4o-mini", "messages": [ {"role": "user",  "name": "ann", "content": "hi"} ]}"#;
    let mut req = post_json(
        &visor.url("/v1/chat/completions"),
        first.as_bytes().to_vec(),
    );
    req.headers_mut()
        .insert("x-visor-session", "bytes".parse().unwrap());
    assert_eq!(send(req).await.0, 200);
    let sent_first = String::from_utf8(mock.recorded().pop().unwrap().body.to_vec()).unwrap();
    let message = r#"{"role": "user",  "name": "ann", "content": "hi"}"#;
    assert!(sent_first.contains(message), "{sent_first}");
    let (status, _, _) = send(chat(&visor, "bytes", json!([user("next")]), &[])).await;
    assert_eq!(status, 200);
    let sent = String::from_utf8(mock.recorded().pop().unwrap().body.to_vec()).unwrap();
    assert!(
        sent.contains(&format!("[{message},")),
        "the stored message was rewritten: {sent}"
    );

    // A new session whose first request carries a tool exchange: every
    // message is stored, so no result is stored without its call.
    let call = json!({"role": "assistant", "tool_calls": [{"id": "call_A", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
    let result = json!({"role": "tool", "tool_call_id": "call_A", "content": "A"});
    let (status, _, _) = send(chat(
        &visor,
        "carried",
        json!([user("u1"), call, result]),
        &[],
    ))
    .await;
    assert_eq!(status, 200);
    let (_, body) = stored(&visor, "carried", &[]).await;
    let roles: Vec<&str> = body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"], "{body}");
}

#[tokio::test]
async fn a_streamed_reply_is_stored_whole_before_the_stream_ends() {
    let mock = MockUpstream::start(echo).await;
    let visor = Visor::for_mock(&mock, "").await;
    let body = json!({"model": "gpt-4o-mini", "stream": true, "messages": [user("stream me")]});
    let mut req = post_json(
        &visor.url("/v1/chat/completions"),
        serde_json::to_vec(&body).unwrap(),
    );
    req.headers_mut()
        .insert("x-visor-session", "st".parse().unwrap());
    let (status, _, text) = send(req).await;
    assert_eq!(status, 200);
    assert!(String::from_utf8_lossy(&text).contains("[DONE]"));
    // The stream has ended for the client: the turn is already there.
    let (_, v) = stored(&visor, "st", &[]).await;
    assert_eq!(
        v["messages"],
        json!([user("stream me"), assistant("re: stream me")])
    );
}

#[tokio::test]
async fn fifty_requests_at_once_in_one_session_lose_nothing() {
    let mock = MockUpstream::start(echo).await;
    let visor = Visor::for_mock(&mock, "").await;
    concurrent_turns(&visor, &visor, "many").await;
}

/// 50 requests at once in one session (through `a`), then the history read
/// back (through `b`): 100 messages, each reply right after its own
/// question, none lost or doubled.
async fn concurrent_turns(a: &Visor, b: &Visor, session: &str) {
    let client = client();
    let mut tasks = Vec::new();
    for i in 0..50 {
        let req = chat(
            a,
            session,
            json!([user(&format!("q{i}"))]),
            &[("x-visor-history", "0")],
        );
        let client = client.clone();
        tasks.push(tokio::spawn(async move { send_on(&client, req).await.0 }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let (_, v) = stored(b, session, &[]).await;
    let msgs = v["messages"].as_array().unwrap();
    assert_eq!(msgs.len(), 100);
    let mut seen = std::collections::HashSet::new();
    for pair in msgs.chunks(2) {
        let q = pair[0]["content"].as_str().unwrap();
        assert_eq!(pair[1]["content"], format!("re: {q}"));
        assert!(seen.insert(q.to_owned()));
    }
}

#[tokio::test]
async fn get_delete_bad_ids_and_other_keys() {
    let mock = MockUpstream::start(echo).await;
    let visor = Visor::for_mock(&mock, "[server]\napi_keys = [\"key-one\", \"key-two\"]\n").await;
    let one = [("authorization", "Bearer key-one")];
    let two = [("authorization", "Bearer key-two")];
    let (status, _, _) = send(chat(&visor, "mine", json!([user("secret")]), &one)).await;
    assert_eq!(status, 200);
    assert_eq!(stored(&visor, "mine", &one).await.0, 200);
    assert_eq!(
        stored(&visor, "mine", &two).await.0,
        404,
        "another key's session"
    );
    assert_eq!(
        stored(&visor, "mine", &[]).await.0,
        401,
        "behind the proxy key"
    );
    // The other key starts its own session under the same id.
    send(chat(&visor, "mine", json!([user("other")]), &two)).await;
    assert_eq!(sent_messages(&mock), json!([user("other")]));

    let mut del = Request::delete(visor.url("/visor/sessions/mine"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    del.headers_mut()
        .insert("authorization", "Bearer key-one".parse().unwrap());
    assert_eq!(send(del).await.0, 204);
    let (status, v) = stored(&visor, "mine", &one).await;
    assert_eq!(status, 404);
    assert_eq!(v["error"]["code"], "session_not_found");

    for bad in ["a b", "x/y", &"z".repeat(129)] {
        let req = Request::get(visor.url(&format!("/visor/sessions/{}", bad.replace(' ', "%20"))))
            .header("authorization", "Bearer key-one")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (status, _, body) = send(req).await;
        assert!(status == 400 || status == 404, "{bad}: {status}");
        if status == 400 {
            assert_eq!(error_code(&body), "invalid_request");
        }
    }
    let mut req = chat(&visor, "ok-id", json!([user("x")]), &one);
    req.headers_mut()
        .insert("x-visor-session", "not ok!".parse().unwrap());
    let (status, _, body) = send(req).await;
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("x-visor-session"));
    let (status, _, _) = send(chat(
        &visor,
        "ok-id",
        json!([user("x")]),
        &[one[0], ("x-visor-history", "lots")],
    ))
    .await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn responses_and_anthropic_sessions() {
    let mock = MockUpstream::start(echo).await;
    let visor = Visor::for_mock(&mock, "").await;
    // Messages are stored in the shape they came in: one session per API.
    let post = |path: &str, body: Value| {
        let mut req = post_json(&visor.url(path), serde_json::to_vec(&body).unwrap());
        let id = if path.ends_with("/responses") {
            "resp"
        } else {
            "anth"
        };
        req.headers_mut()
            .insert("x-visor-session", id.parse().unwrap());
        req
    };
    // Responses: a string input is one user message; the reply's output
    // items are stored without their ids. Nothing inserted: sent byte for
    // byte, the string as a string.
    let first = json!({"model": "gpt-5", "instructions": "be brief", "input": "first"});
    let (status, _, _) = send(post("/v1/responses", first.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(
        mock.recorded()[0].body,
        serde_json::to_vec(&first).unwrap(),
        "as the client sent it"
    );
    let (_, headers, _) = send(post(
        "/v1/responses",
        json!({"model": "gpt-5", "input": [user("second")]}),
    ))
    .await;
    assert_eq!(headers["x-visor-history-used"], "2");
    let sent: Value = serde_json::from_slice(&mock.recorded().pop().unwrap().body).unwrap();
    assert_eq!(
        sent["input"],
        json!([user("first"), {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "re: first"}]}, user("second")])
    );
    // Anthropic: the system prompt stays top-level; blocks are kept.
    let (status, _, _) = send(post("/v1/messages", json!({"model": "claude-sonnet-4-5", "max_tokens": 9, "system": "be brief", "messages": [user("a")]}))).await;
    assert_eq!(status, 200);
    let (_, headers, _) = send(post("/v1/messages", json!({"model": "claude-sonnet-4-5", "max_tokens": 9, "messages": [{"role": "user", "content": [{"type": "text", "text": "b"}]}]}))).await;
    assert_eq!(headers["x-visor-history-used"], "2");
    let sent: Value = serde_json::from_slice(&mock.recorded().pop().unwrap().body).unwrap();
    let msgs = sent["messages"].as_array().unwrap();
    assert_eq!(msgs[msgs.len() - 3], user("a"));
    assert_eq!(
        msgs[msgs.len() - 2],
        json!({"role": "assistant", "content": [{"type": "text", "text": "re: a"}]})
    );
    assert!(sent.get("system").is_none());
}

#[tokio::test]
async fn sessions_survive_a_restart_on_the_disk_store() {
    let mock = MockUpstream::start(echo).await;
    let dir = temp_dir("sessions-restart");
    let cfg = format!(
        "[server]\ndata_dir = \"{}\"\n[[upstream]]\nname = \"mock\"\nbase_url = \"{}/v1\"\n",
        dir.display(),
        mock.url()
    );
    {
        let mut first = Visor::start(&cfg).await;
        send(chat(&first, "kept", json!([user("before")]), &[])).await;
        first.shutdown();
        let task = first.task.take().unwrap();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
    let second = Visor::start(&cfg).await;
    let (_, headers, _) = send(chat(&second, "kept", json!([user("after")]), &[])).await;
    assert_eq!(headers["x-visor-history-used"], "2");
    assert_eq!(
        sent_messages(&mock),
        json!([user("before"), assistant("re: before"), user("after")])
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_session_request_gets_503_when_the_store_is_unreachable() {
    let mock = MockUpstream::start(echo).await;
    let dir = temp_dir("sessions-busy");
    let cfg = format!(
        "[server]\ndata_dir = \"{}\"\n[[upstream]]\nname = \"mock\"\nbase_url = \"{}/v1\"\n",
        dir.display(),
        mock.url()
    );
    let first = Visor::start(&cfg).await;
    send(chat(&first, "s", json!([user("x")]), &[])).await;
    // A second visor on the same data_dir finds the file in use.
    let second = Visor::start(&cfg).await;
    let before = mock.count();
    let (status, _, body) = send(chat(&second, "s", json!([user("y")]), &[])).await;
    assert_eq!(status, 503);
    assert_eq!(error_code(&body), "store_unavailable");
    assert_eq!(mock.count(), before, "nothing sent upstream");
    // Without a session the same visor still serves.
    let plain = post_json(
        &second.url("/v1/chat/completions"),
        r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(send(plain).await.0, 200);
    drop(first);
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn two_replicas_share_sessions_through_redis() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let mock = MockUpstream::start(echo).await;
    let cfg = format!(
        "[store]\nbackend = \"{}\"\nprefix = \"visor-sess-{}:\"\n[[upstream]]\nname = \"mock\"\nbase_url = \"{}/v1\"\n",
        redis.url(),
        std::process::id(),
        mock.url()
    );
    let a = Visor::start(&cfg).await;
    let b = Visor::start(&cfg).await;
    send(chat(&a, "shared", json!([user("on a")]), &[])).await;
    let (_, headers, _) = send(chat(&b, "shared", json!([user("on b")]), &[])).await;
    assert_eq!(headers["x-visor-history-used"], "2");
    assert_eq!(
        sent_messages(&mock),
        json!([user("on a"), assistant("re: on a"), user("on b")])
    );
    concurrent_turns(&a, &b, "busy").await;
}

#[tokio::test]
async fn image_rules_apply_to_the_merged_request() {
    let mock = MockUpstream::start(echo).await;
    let visor = Visor::for_mock(&mock, "[images]\nnon_vision = \"strip\"\n").await;
    let (url, _) = png_data_url("in-history");
    let first = serde_json::from_slice::<Value>(&chat_with_images("gpt-oss-120b", &[url])).unwrap();
    let mut req = post_json(
        &visor.url("/v1/chat/completions"),
        serde_json::to_vec(&first).unwrap(),
    );
    req.headers_mut()
        .insert("x-visor-session", "img".parse().unwrap());
    assert_eq!(send(req).await.1["x-visor-images-replaced"], "1");
    // The image is in the stored history (the original, for a model that
    // can see it later); a text-only model still never receives it.
    let body = json!({"model": "gpt-oss-120b", "messages": [user("and now?")]});
    let mut req = post_json(
        &visor.url("/v1/chat/completions"),
        serde_json::to_vec(&body).unwrap(),
    );
    req.headers_mut()
        .insert("x-visor-session", "img".parse().unwrap());
    let (_, headers, _) = send(req).await;
    assert_eq!(headers["x-visor-history-used"], "2");
    assert_eq!(headers["x-visor-images-replaced"], "1");
    let sent = String::from_utf8(mock.recorded().pop().unwrap().body.to_vec()).unwrap();
    assert!(!sent.contains(";base64,"), "{sent}");
    assert!(sent.contains("not shown, this model cannot see images"));
}

/// A scripted agent upstream: each turn answers with one tool call (ids
/// numbered by turn), in the request's API, until turn `turns`, then text.
fn agent_upstream(req: &Recorded) -> Reply {
    let v: Value = serde_json::from_slice(&req.body).unwrap_or_default();
    let path = req.uri.path();
    let items = if path.ends_with("/responses") {
        &v["input"]
    } else {
        &v["messages"]
    };
    let n = items.as_array().map_or(0, Vec::len);
    if path.ends_with("/messages") {
        return Reply::json(
            200,
            json!({"id": format!("msg_{n}"), "type": "message", "role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": format!("sig{n}")},
                {"type": "tool_use", "id": format!("toolu_{n}"), "name": "Bash", "input": {"command": "ls"}}
            ], "stop_reason": "tool_use"})
            .to_string(),
        );
    }
    Reply::json(
        200,
        json!({"id": format!("resp_{n}"), "object": "response", "output": [
            {"id": format!("rs_{n}"), "type": "reasoning", "summary": [], "encrypted_content": format!("enc{n}")},
            {"id": format!("fc_{n}"), "type": "function_call", "status": "completed", "call_id": format!("call_{n}"), "name": "shell", "arguments": "{\"cmd\":\"ls\"}"}
        ]})
        .to_string(),
    )
}

/// Every tool call id in a request body's items, in order.
fn call_ids(items: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for m in items.as_array().unwrap() {
        if m["type"] == "function_call" {
            out.push(m["call_id"].as_str().unwrap().to_owned());
        }
        if let Some(parts) = m["content"].as_array() {
            for p in parts {
                if p["type"] == "tool_use" {
                    out.push(p["id"].as_str().unwrap().to_owned());
                }
            }
        }
    }
    out
}

/// Claude Code and Codex re-send the whole conversation every turn, with
/// what visor does not store (a system message mid-conversation, thinking
/// blocks, reasoning items, ids and statuses, cache_control moving to the
/// newest message): through a session, each request reaches the upstream
/// byte for byte as the client sent it, no tool call id is ever doubled,
/// and the session holds every turn once.
#[tokio::test]
async fn agents_that_resend_their_history_are_never_doubled() {
    let mock = MockUpstream::start(agent_upstream).await;
    let visor = Visor::for_mock(&mock, "").await;
    let post = |path: &str, session: &str, body: &Value| {
        let mut req = post_json(&visor.url(path), serde_json::to_vec(body).unwrap());
        req.headers_mut()
            .insert("x-visor-session", session.parse().unwrap());
        req
    };

    // Claude Code: Anthropic Messages, a system message in the middle.
    let mut messages = vec![
        json!({"role": "user", "content": [{"type": "text", "text": "fix the bug", "cache_control": {"type": "ephemeral"}}]}),
    ];
    for turn in 0..5 {
        let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 100, "system": [{"type": "text", "text": "You are Claude Code."}], "messages": messages});
        let before = mock.count();
        let (status, headers, reply) = send(post("/v1/messages", "claude", &body)).await;
        assert_eq!(status, 200);
        assert_eq!(headers["x-visor-history-used"], "0", "turn {turn}");
        let sent = mock.recorded()[before].clone();
        assert_eq!(
            sent.body,
            serde_json::to_vec(&body).unwrap(),
            "turn {turn}: not the client's bytes"
        );
        let ids = call_ids(&serde_json::from_slice::<Value>(&sent.body).unwrap()["messages"]);
        let mut unique = ids.clone();
        unique.dedup();
        assert_eq!(ids.len(), unique.len(), "turn {turn}: {ids:?}");
        // The client appends the reply and the tool result, moves
        // cache_control, and sometimes adds a system message.
        let reply: Value = serde_json::from_slice(&reply).unwrap();
        let id = reply["content"][1]["id"].as_str().unwrap().to_owned();
        for m in &mut messages {
            if let Some(parts) = m["content"].as_array_mut() {
                for p in parts {
                    p.as_object_mut().unwrap().remove("cache_control");
                }
            }
        }
        messages.push(json!({"role": "assistant", "content": reply["content"]}));
        if turn == 1 {
            messages.push(json!({"role": "system", "content": "<system-reminder>todo list changed</system-reminder>"}));
        }
        messages.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": format!("out {turn}"), "cache_control": {"type": "ephemeral"}}]}));
    }
    let (_, v) = stored(&visor, "claude", &[]).await;
    let kept = v["messages"].as_array().unwrap();
    assert_eq!(kept.len(), 1 + 5 * 2 - 1, "every turn once: {v}");
    assert!(!kept.iter().any(|m| m["role"] == "system"));

    // Codex: Responses, reasoning items and ids sent back.
    let mut input = vec![
        json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]}),
    ];
    for turn in 0..5 {
        let body = json!({"model": "gpt-5-codex", "instructions": "You are Codex.", "input": input, "store": false, "include": ["reasoning.encrypted_content"]});
        let before = mock.count();
        let (status, headers, reply) = send(post("/v1/responses", "codex", &body)).await;
        assert_eq!(status, 200);
        assert_eq!(headers["x-visor-history-used"], "0", "turn {turn}");
        let sent = mock.recorded()[before].clone();
        assert_eq!(sent.body, serde_json::to_vec(&body).unwrap(), "turn {turn}");
        let ids = call_ids(&serde_json::from_slice::<Value>(&sent.body).unwrap()["input"]);
        let mut unique = ids.clone();
        unique.dedup();
        assert_eq!(ids.len(), unique.len(), "turn {turn}: {ids:?}");
        let reply: Value = serde_json::from_slice(&reply).unwrap();
        for item in reply["output"].as_array().unwrap() {
            input.push(item.clone());
        }
        let call = reply["output"][1]["call_id"].as_str().unwrap().to_owned();
        input.push(json!({"type": "function_call_output", "call_id": call, "output": format!("a\nb {turn}")}));
    }
    let (_, v) = stored(&visor, "codex", &[]).await;
    let kept = v["messages"].as_array().unwrap();
    // The user message, then per turn the call (reasoning is not stored)
    // and its output; the last output is stored with the next turn, which
    // never came.
    assert_eq!(kept.len(), 1 + 5 + 4, "{v}");
    assert!(!kept.iter().any(|m| m["type"] == "reasoning"));

    // A client that only sends what is new still gets the history.
    let (_, headers, _) = send(post(
        "/v1/messages",
        "claude",
        &json!({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "late"}]}]}),
    ))
    .await;
    assert_ne!(headers["x-visor-history-used"], "0");
}

/// A session stream still open when shutdown's drain timeout runs out is
/// cut as if its client left: the turn's new message is stored all the
/// same (on the tracked task set shutdown waits for), never lost.
#[tokio::test]
async fn a_turn_cut_by_the_drain_timeout_is_still_stored() {
    let mock = MockUpstream::start(|_| Reply::stall_after(2)).await;
    let dir = temp_dir("sessions-drain-cut");
    let cfg = format!(
        "[server]\ndata_dir = \"{}\"\ndrain_timeout_secs = 0.5\nidle_timeout_secs = 60\n\
         [[upstream]]\nname = \"mock\"\nbase_url = \"{}/v1\"\n",
        dir.display(),
        mock.url()
    );
    {
        let mut first = Visor::start(&cfg).await;
        let req = chat(&first, "cut", json!([user("still here")]), &[]);
        let resp = tokio::time::timeout(Duration::from_secs(10), client().request(req))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        // The two events before the stall (one frame or two).
        let mut got = Vec::new();
        while got.len() < sse_event(0).len() + sse_event(1).len() {
            let data = next_data(&mut body, Duration::from_secs(10)).await.unwrap();
            got.extend_from_slice(&data.unwrap());
        }
        first.shutdown();
        let task = first.task.take().unwrap();
        tokio::time::timeout(Duration::from_secs(15), task)
            .await
            .expect("shutdown ends within the drain bound")
            .unwrap()
            .unwrap();
        assert!(first.state.life.tasks.is_empty());
        assert!(
            next_data(&mut body, Duration::from_secs(10)).await.is_err(),
            "the stream was cut, not ended"
        );
    }
    let second = Visor::start(&cfg).await;
    let (status, history) = stored(&second, "cut", &[]).await;
    assert_eq!(status, 200);
    assert_eq!(
        history["messages"],
        json!([user("still here")]),
        "{history}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// An upstream that cannot be reached (or answers an error) does not lose
/// what the user sent: the request's messages are stored without a reply,
/// before the client gets its 502.
#[tokio::test]
async fn an_unreachable_upstream_does_not_lose_the_users_message() {
    let refusing = MockUpstream::builder()
        .fault(Fault::RefuseConnect)
        .start()
        .await;
    let visor = Visor::for_mock(&refusing, "").await;
    let (status, _, body) = send(chat(&visor, "down", json!([user("are you there?")]), &[])).await;
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
    // Stored before the 502 went out: there at once.
    let (code, body) = stored(&visor, "down", &[]).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["messages"], json!([user("are you there?")]), "{body}");
}

/// The header accepts the ids the path can name: `.` and `..` (dot
/// segments, refused in any path) are 400 in `x-visor-session` too, and
/// nothing is stored or sent; `...` is an ordinary id both ways. A bad id
/// in the path is said to come from the path.
#[tokio::test]
async fn session_ids_are_the_same_in_the_header_and_the_path() {
    let mock = MockUpstream::start(echo).await;
    let visor = Visor::for_mock(&mock, "").await;
    for dots in [".", ".."] {
        let got = send(chat(&visor, dots, json!([user("hi")]), &[])).await;
        let text = assert_error(&got, 400, "invalid_request");
        assert!(text.contains("x-visor-session"), "{text}");
        let path = send(
            Request::get(visor.url(&format!("/visor/sessions/{dots}")))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await;
        assert_eq!(path.0, 400, "{dots}");
    }
    assert_eq!(mock.count(), 0, "a refused session id is not sent upstream");

    let (status, _, _) = send(chat(&visor, "...", json!([user("hi")]), &[])).await;
    assert_eq!(status, 200);
    let (status, v) = stored(&visor, "...", &[]).await;
    assert_eq!(status, 200);
    assert_eq!(v["messages"][0], user("hi"));
    let del = Request::delete(visor.url("/visor/sessions/..."))
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(send(del).await.0, 204);
    assert_eq!(stored(&visor, "...", &[]).await.0, 404);

    let got = send(
        Request::get(visor.url("/visor/sessions/not%20ok"))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    let text = assert_error(&got, 400, "invalid_request");
    assert!(
        text.contains("/visor/sessions/") && !text.contains("x-visor-session"),
        "the message names the path the id came from: {text}"
    );
}

/// `x-visor-history` that is not a whole number is 400 with or without
/// `x-visor-session` (the README's header table), before anything is
/// sent; a whole number without a session is harmless.
#[tokio::test]
async fn a_bad_history_depth_is_400_without_a_session_too() {
    let mock = MockUpstream::start(echo).await;
    let visor = Visor::for_mock(&mock, "").await;
    let plain = |history: &str| {
        let mut req = post_json(
            &visor.url("/v1/chat/completions"),
            serde_json::to_vec(&json!({"model": "m", "messages": [user("hi")]})).unwrap(),
        );
        req.headers_mut()
            .insert("x-visor-history", history.parse().unwrap());
        req
    };
    for bad in ["abc", "-1", "1.5"] {
        let got = send(plain(bad)).await;
        let text = assert_error(&got, 400, "invalid_request");
        assert!(text.contains("x-visor-history"), "{text}");
    }
    assert_eq!(mock.count(), 0, "refused before the upstream");
    let (status, _, _) = send(plain("3")).await;
    assert_eq!(status, 200);
    assert_eq!(mock.count(), 1);
}

/// A tool result for a call the session already answered (the client sends
/// its last result again once the reply is stored, or another one): 400,
/// saying why, and nothing reaches the provider: merged, it would get two
/// results for one call.
#[tokio::test]
async fn a_tool_result_answering_a_call_already_answered_is_refused() {
    let mock = MockUpstream::start(echo).await;
    let visor = Visor::for_mock(&mock, "").await;
    let call = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
    let result = |t: &str| json!({"role": "tool", "tool_call_id": "t1", "content": t});
    let first = json!([user("do it"), call, result("result one")]);
    let (status, _, _) = send(chat(&visor, "dup-result", first, &[])).await;
    assert_eq!(status, 200);
    for again in ["result one", "result one AGAIN"] {
        let got = send(chat(&visor, "dup-result", json!([result(again)]), &[])).await;
        let message = assert_error(&got, 400, "invalid_request");
        assert!(message.contains("x-visor-session"), "{message}");
    }
    assert_eq!(mock.count(), 1, "nothing more was sent");
    // The session goes on with what is new.
    let (status, _, _) = send(chat(&visor, "dup-result", json!([user("next")]), &[])).await;
    assert_eq!(status, 200);
    let sent = sent_messages(&mock);
    let results = sent
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .count();
    assert_eq!(results, 1, "{sent}");
}

/// A Responses tool loop that sends only what is new: the call comes back
/// from the provider and is stored, the client sends its output alone,
/// and the provider gets the call before it (the call's own `call_id` is
/// no earlier answer).
#[tokio::test]
async fn a_responses_tool_loop_sending_only_new_items_goes_on() {
    let mock = MockUpstream::start(|req: &Recorded| {
        let answered = String::from_utf8_lossy(&req.body).contains("function_call_output");
        let output = match answered {
            true => json!([{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]),
            false => json!([{"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "sh", "arguments": "{}", "status": "completed"}]),
        };
        Reply::json(200, json!({"id": "resp_1", "object": "response", "output": output}).to_string())
    })
    .await;
    let visor = Visor::for_mock(&mock, "").await;
    let post = |input: Value| {
        let body = json!({"model": "gpt-5", "input": input});
        let mut req = post_json(&visor.url("/v1/responses"), body.to_string());
        req.headers_mut()
            .insert("x-visor-session", "resp-loop".parse().unwrap());
        req
    };
    let (status, _, _) = send(post(json!([user("run it")]))).await;
    assert_eq!(status, 200);
    let out = json!({"type": "function_call_output", "call_id": "c1", "output": "exit code: 0"});
    let (status, headers, body) = send(post(json!([out]))).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(headers["x-visor-history-used"], "2");
    let sent: Value = serde_json::from_slice(&mock.recorded().pop().unwrap().body).unwrap();
    let types: Vec<&str> = sent["input"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["type"].as_str().unwrap_or("message"))
        .collect();
    assert_eq!(types, ["message", "function_call", "function_call_output"]);
}
