//! End to end with the real clients users point at visor: each one runs a
//! short tool loop through an in-process visor against a scripted upstream
//! that speaks its protocol, and the test checks what reached the upstream.
//!
//! | client | wire | tools the model calls |
//! | --- | --- | --- |
//! | `openai` (Node SDK), own loop | Chat Completions SSE | screenshot (image), read_notes ×2 |
//! | Vercel AI SDK + `@ai-sdk/openai` `.chat()` | Chat Completions SSE | same |
//! | Vercel AI SDK + `@ai-sdk/openai` `.responses()` | Responses SSE | same |
//! | Vercel AI SDK + `@ai-sdk/anthropic` | Messages SSE | same |
//! | OpenAI Agents SDK (Python), default model | Responses SSE | same |
//! | OpenAI Agents SDK, Chat Completions model | Chat Completions SSE | same |
//! | `anthropic` (Python SDK), own loop | Messages SSE | same |
//! | LangChain `ChatOpenAI` (`langchain-openai`), own loop | Chat Completions SSE | same |
//! | LangChain `ChatAnthropic` (`langchain-anthropic`), own loop | Messages SSE | same |
//! | Codex CLI, `codex exec`, a custom provider, a session | Responses SSE | view_image, exec_command `cat` ×2 |
//! | Codex CLI, `supports_websockets = true` | Responses WebSocket | same (no dedup, no session there) |
//! | Claude Code, `claude -p`, a session | Messages SSE | Read (a PNG), Bash `cat` ×2 |
//! | `anthropic` (Python SDK), no `cache_control` | Messages JSON | sh ×5 (prompt caching: visor's breakpoints read each turn) |
//!
//! Every test: the model is text-only (`[[model]] vision = false`, `[images]
//! non_vision = "strip"`), so no base64 image may reach the upstream and the
//! image's tool result carries visor's placeholder; every tool result keeps
//! its call (no result without a call, no id twice, results in order); the
//! second, identical notes result is deduped (`[omitted: …`) while the first
//! is sent whole; the client finishes its loop (exit 0, the final text
//! printed). Codex and Claude Code also send `x-visor-session`: the header
//! never reaches the upstream, no request doubles a tool call, and
//! `GET /visor/sessions/ID` holds each turn once.
//!
//! The clients are pinned in `tests/clients/package.json` (+ lock) and
//! `tests/clients/requirements.txt`, installed under `target/tmp` (npm into
//! `node-clients`, pip into the `py-venv` that tests/it/sdk_openai.rs uses) on
//! first use; `.ci/run` installs them up front. Without npm, Python or the
//! registries a test prints `SKIPPED …` and passes, except under `CI=true`,
//! where it fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// tungstenite's handshake callback returns its own large error type.
#![allow(clippy::result_large_err)]

use crate::support;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::Request;
use http_body_util::Full;
use serde_json::{Value, json};
use support::*;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::server::{
    Request as WsRequest, Response as WsResponse,
};

// ------------------------------------------------------------ environment

fn ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// The value, or: print why the test is skipped and return — a panic
/// under `CI=true`, where everything must run.
macro_rules! need {
    ($test:expr, $r:expr) => {
        match $r {
            Ok(v) => v,
            Err(why) if !ci() => {
                println!("SKIPPED {}: {why}", $test);
                return;
            }
            Err(why) => panic!("CI=true and {} cannot run: {why}", $test),
        }
    };
}

fn tmp() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
}

fn clients_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients")
}

/// A command's combined output, or why it could not run or failed.
fn run_ok(cmd: &mut Command, what: &str) -> Result<String, String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{what}: not runnable: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("{what} failed ({}):\n{text}", out.status))
    }
}

/// `target/tmp/node-clients` with `npm ci` done from the committed lock
/// (once per lock: a copy of it marks the install) and the test scripts
/// copied in, so their imports resolve there.
fn node_clients() -> Result<PathBuf, String> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| {
        let _installing = install_lock("node-clients")?;
        let dir = tmp().join("node-clients");
        let lock =
            std::fs::read(clients_dir().join("package-lock.json")).map_err(|e| e.to_string())?;
        let stamp = dir.join(".installed-lock.json");
        if std::fs::read(&stamp).ok().as_deref() != Some(&lock[..]) {
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            for f in ["package.json", "package-lock.json"] {
                std::fs::copy(clients_dir().join(f), dir.join(f)).map_err(|e| e.to_string())?;
            }
            let started = Instant::now();
            run_ok(
                Command::new("npm")
                    .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
                    .env("npm_config_cache", tmp().join("npm-cache"))
                    .current_dir(&dir),
                "npm ci",
            )?;
            println!("npm ci in {:.1} s", started.elapsed().as_secs_f64());
            std::fs::write(&stamp, &lock).map_err(|e| e.to_string())?;
        }
        // Written only when changed: another test's process may be
        // running node on them (a copy empties a file before it writes).
        for f in ["openai_node.mjs", "vercel_ai.mjs"] {
            let text = std::fs::read(clients_dir().join(f)).map_err(|e| e.to_string())?;
            if std::fs::read(dir.join(f)).ok().as_deref() != Some(&text[..]) {
                std::fs::write(dir.join(f), text).map_err(|e| e.to_string())?;
            }
        }
        Ok(dir)
    })
    .clone()
}

/// A CLI installed by npm (`node_modules/.bin/NAME`) that answers `--version`.
fn node_bin(name: &str) -> Result<PathBuf, String> {
    let bin = node_clients()?.join("node_modules/.bin").join(name);
    let v = run_ok(
        Command::new(&bin).arg("--version"),
        &format!("{name} --version"),
    )?;
    println!("{name} {}", v.trim());
    Ok(bin)
}

/// [`node_bin`] off the runtime's threads.
async fn node_cli(name: &'static str) -> Result<PathBuf, String> {
    tokio::task::spawn_blocking(move || node_bin(name))
        .await
        .unwrap()
}

/// The venv's python with the pins of `tests/clients/requirements.txt`
/// (installed when a version differs).
fn venv_python() -> Result<PathBuf, String> {
    static PY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    PY.get_or_init(|| {
        let _venv = PY_VENV.lock().unwrap_or_else(|e| e.into_inner());
        let _installing = install_lock("py-venv")?;
        let venv = tmp().join("py-venv");
        let python = venv.join("bin/python");
        let reqs = clients_dir().join("requirements.txt");
        let pins: Vec<(String, String)> = std::fs::read_to_string(&reqs)
            .map_err(|e| e.to_string())?
            .lines()
            .filter_map(|l| l.split_once("=="))
            .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
            .collect();
        let check = format!(
            "import importlib.metadata as m\nassert [m.version(n) for n in {:?}] == {:?}",
            pins.iter().map(|p| &p.0).collect::<Vec<_>>(),
            pins.iter().map(|p| &p.1).collect::<Vec<_>>()
        );
        if run_ok(Command::new(&python).args(["-c", &check]), "version check").is_ok() {
            return Ok(python);
        }
        if !python.exists() {
            run_ok(
                Command::new("python3").args(["-m", "venv"]).arg(&venv),
                "python3 -m venv",
            )?;
        }
        run_ok(
            Command::new(venv.join("bin/pip"))
                .args(["install", "--quiet", "--disable-pip-version-check", "-r"])
                .arg(&reqs),
            "pip install -r tests/clients/requirements.txt",
        )?;
        run_ok(Command::new(&python).args(["-c", &check]), "version check")?;
        Ok(python)
    })
    .clone()
}

/// What a client run left: exit code (`None` when killed at the bound),
/// stdout, stderr, time taken.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    took: Duration,
}

impl Ran {
    fn assert_ok(&self, what: &str) {
        assert_eq!(
            self.code,
            Some(0),
            "{what} did not finish well (took {:?})\n--- stdout\n{}\n--- stderr\n{}",
            self.took,
            self.stdout,
            self.stderr
        );
    }

    /// The last stdout line, as JSON (the SDK scripts print one).
    fn json(&self) -> Value {
        let line = self.stdout.lines().last().unwrap_or_default();
        serde_json::from_str(line).unwrap_or_else(|e| {
            panic!(
                "last stdout line is not JSON ({e}):\n{}\n--- stderr\n{}",
                self.stdout, self.stderr
            )
        })
    }
}

/// Runs a client to its end, killed after `bound`, off the async workers
/// (visor and the mock run on them).
async fn run_client(mut cmd: Command, bound: Duration) -> Ran {
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let pipe = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut s = Vec::new();
                let _ = r.read_to_end(&mut s);
                String::from_utf8_lossy(&s).into_owned()
            })
        };
        let out = pipe(Box::new(child.stdout.take().unwrap()));
        let err = pipe(Box::new(child.stderr.take().unwrap()));
        let code = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s.code();
            }
            if started.elapsed() > bound {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Ran {
            code,
            stdout: out.join().unwrap_or_default(),
            stderr: err.join().unwrap_or_default(),
            took: started.elapsed(),
        }
    })
    .await
    .unwrap()
}

// ------------------------------------------------------ scripted upstream

#[derive(Clone, Copy, PartialEq, Debug)]
enum Wire {
    Chat,
    Responses,
    Messages,
}

impl Wire {
    fn of(path: &str) -> Option<Wire> {
        if path.ends_with("/chat/completions") {
            Some(Wire::Chat)
        } else if path.ends_with("/responses") {
            Some(Wire::Responses)
        } else if path.ends_with("/messages") {
            Some(Wire::Messages)
        } else {
            None
        }
    }

    /// The id of the model's k-th tool call.
    fn call_id(self, k: usize) -> String {
        match self {
            Wire::Messages => format!("toolu_visor_{k}"),
            _ => format!("call_visor_{k}"),
        }
    }
}

/// The model's side of the loop: the tool calls to make, one per turn, in
/// order (turn k answers the request that holds k tool results), then the
/// final text.
#[derive(Clone)]
struct Script {
    wire: Wire,
    calls: Vec<(&'static str, Value)>,
    text: &'static str,
}

const FINAL: &str = "Done: the app shows a chart and the notes were read twice.";

/// The SDK scripts' tools: a screenshot, then the notes twice.
fn sdk_script(wire: Wire) -> Script {
    Script {
        wire,
        calls: vec![
            ("screenshot", json!({})),
            ("read_notes", json!({})),
            ("read_notes", json!({})),
        ],
        text: FINAL,
    }
}

/// A result long enough to be deduped when it comes again (256 bytes or
/// more, a reference saving 128 bytes more than its length).
const NOTES: &str = "Release notes for the visor client test\n\
- the proxy replaces images for text-only models\n\
- repeated tool output is sent once\n\
- sessions keep each turn once\n\
- every tool result keeps its call\n\
- documents and audio are read for models that cannot take them\n\
- prompt caches keep hitting: earlier messages never change\n\
- keys, limits and fallbacks hold over HTTP and WebSocket alike\n";

fn sse(event: Option<&str>, data: &Value) -> Chunk {
    Chunk::Data(Bytes::from(match event {
        Some(e) => format!("event: {e}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    }))
}

/// The scripted model as a mock handler. Other endpoints: `GET …/models`
/// lists the model, `…/count_tokens` counts 42, anything else is 404.
fn upstream(script: Script, model: &'static str) -> impl Fn(&Recorded) -> Reply + Send + Sync {
    move |req: &Recorded| {
        let path = req.uri.path();
        if path.ends_with("/models") {
            return Reply::json(
                200,
                json!({"object": "list", "data": [{"id": model, "object": "model", "created": 1, "owned_by": "mock", "type": "model", "display_name": model, "created_at": "2025-01-01T00:00:00Z"}]}).to_string(),
            );
        }
        if path.ends_with("/count_tokens") {
            return Reply::json(200, r#"{"input_tokens":42}"#);
        }
        let body: Value = serde_json::from_slice(&req.body).unwrap_or_default();
        if Wire::of(path) != Some(script.wire) {
            return Reply::json(
                404,
                json!({"error": {"type": "not_found_error", "message": format!("mock: no {path}")}})
                    .to_string(),
            );
        }
        let k = tool_results(script.wire, &body).len();
        let has_tools = body["tools"].as_array().is_some_and(|t| !t.is_empty());
        let call = (has_tools && k < script.calls.len()).then(|| {
            (
                script.wire.call_id(k),
                script.calls[k].0,
                &script.calls[k].1,
            )
        });
        let stream = body["stream"] == true;
        match script.wire {
            Wire::Chat => chat_answer(model, call, script.text, stream),
            Wire::Responses => responses_answer(model, k, call, script.text, stream),
            Wire::Messages => messages_answer(model, k, call, script.text, stream),
        }
    }
}

type Call<'a> = Option<(String, &'a str, &'a Value)>;

fn chat_answer(model: &str, call: Call, text: &str, stream: bool) -> Reply {
    let usage = json!({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15});
    let finish = if call.is_some() { "tool_calls" } else { "stop" };
    if !stream {
        let message = match &call {
            Some((id, name, args)) => json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}}]}),
            None => json!({"role": "assistant", "content": text}),
        };
        return Reply::json(
            200,
            json!({"id": "chatcmpl-visor", "object": "chat.completion", "created": 1_700_000_000, "model": model,
                   "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}], "usage": usage})
            .to_string(),
        );
    }
    let chunk = |delta: Value, finish: Value| {
        sse(
            None,
            &json!({"id": "chatcmpl-visor", "object": "chat.completion.chunk", "created": 1_700_000_000,
                    "model": model, "system_fingerprint": null,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]}),
        )
    };
    let mut chunks = Vec::new();
    match &call {
        Some((id, name, args)) => {
            chunks.push(chunk(
                json!({"role": "assistant", "content": null, "tool_calls": [
                    {"index": 0, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
                Value::Null,
            ));
            chunks.push(chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": args.to_string()}}]}),
                Value::Null,
            ));
        }
        None => {
            chunks.push(chunk(
                json!({"role": "assistant", "content": ""}),
                Value::Null,
            ));
            chunks.push(chunk(json!({"content": text}), Value::Null));
        }
    }
    chunks.push(chunk(json!({}), json!(finish)));
    chunks.push(sse(
        None,
        &json!({"id": "chatcmpl-visor", "object": "chat.completion.chunk", "created": 1_700_000_000,
                "model": model, "choices": [], "usage": usage}),
    ));
    chunks.push(Chunk::Data(Bytes::from_static(b"data: [DONE]\n\n")));
    Reply::sse_chunks(chunks)
}

fn responses_answer(model: &str, k: usize, call: Call, text: &str, stream: bool) -> Reply {
    let events = responses_events(model, k, call, text);
    if !stream {
        let done = &events.last().unwrap()["response"];
        return Reply::json(200, done.to_string());
    }
    let chunks = events.iter().map(|e| sse(e["type"].as_str(), e)).collect();
    Reply::sse_chunks(chunks)
}

/// The Responses stream events of one answer (`type` and
/// `sequence_number` set), the last one `response.completed`.
fn responses_events(model: &str, k: usize, call: Call, text: &str) -> Vec<Value> {
    let response = |status: &str, output: Value, usage: Value| {
        json!({"id": format!("resp_visor_{k}"), "object": "response", "created_at": 1_700_000_000,
               "status": status, "error": null, "incomplete_details": null, "instructions": null,
               "max_output_tokens": null, "model": model, "output": output,
               "parallel_tool_calls": true, "previous_response_id": null,
               "reasoning": {"effort": null, "summary": null}, "store": false, "temperature": 1.0,
               "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [], "top_p": 1.0,
               "truncation": "disabled", "usage": usage, "user": null, "metadata": {}})
    };
    let usage = json!({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                       "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                       "total_tokens": 15});
    let item_id = match &call {
        Some(_) => format!("fc_visor_{k}"),
        None => format!("msg_visor_{k}"),
    };
    let done_item = match &call {
        Some((id, name, args)) => json!({"type": "function_call", "id": item_id, "call_id": id,
            "name": name, "arguments": args.to_string(), "status": "completed"}),
        None => {
            json!({"type": "message", "id": item_id, "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
        }
    };
    let mut events: Vec<(&str, Value)> = vec![
        (
            "response.created",
            json!({"response": response("in_progress", json!([]), Value::Null)}),
        ),
        (
            "response.in_progress",
            json!({"response": response("in_progress", json!([]), Value::Null)}),
        ),
    ];
    match &call {
        Some((id, name, args)) => {
            let args = args.to_string();
            events.push(("response.output_item.added", json!({"output_index": 0, "item":
                {"type": "function_call", "id": item_id, "call_id": id, "name": name, "arguments": "", "status": "in_progress"}})));
            events.push((
                "response.function_call_arguments.delta",
                json!({"item_id": item_id, "output_index": 0, "delta": args}),
            ));
            events.push((
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": 0, "arguments": args}),
            ));
        }
        None => {
            events.push(("response.output_item.added", json!({"output_index": 0, "item":
                {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}})));
            events.push(("response.content_part.added", json!({"item_id": item_id, "output_index": 0,
                "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})));
            events.push((
                "response.output_text.delta",
                json!({"item_id": item_id, "output_index": 0,
                "content_index": 0, "delta": text, "logprobs": []}),
            ));
            events.push((
                "response.output_text.done",
                json!({"item_id": item_id, "output_index": 0,
                "content_index": 0, "text": text, "logprobs": []}),
            ));
            events.push(("response.content_part.done", json!({"item_id": item_id, "output_index": 0,
                "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": [], "logprobs": []}})));
        }
    }
    events.push((
        "response.output_item.done",
        json!({"output_index": 0, "item": done_item}),
    ));
    events.push((
        "response.completed",
        json!({"response": response("completed", json!([done_item]), usage)}),
    ));
    events
        .into_iter()
        .enumerate()
        .map(|(n, (name, mut data))| {
            data["type"] = json!(name);
            data["sequence_number"] = json!(n);
            data
        })
        .collect()
}

fn messages_answer(model: &str, k: usize, call: Call, text: &str, stream: bool) -> Reply {
    let usage = json!({"input_tokens": 10, "output_tokens": 5, "cache_creation_input_tokens": 0,
                       "cache_read_input_tokens": 0});
    let stop = if call.is_some() {
        "tool_use"
    } else {
        "end_turn"
    };
    let id = format!("msg_visor_{k}");
    if !stream {
        let content = match &call {
            Some((cid, name, args)) => {
                json!([{"type": "tool_use", "id": cid, "name": name, "input": args}])
            }
            None => json!([{"type": "text", "text": text}]),
        };
        return Reply::json(
            200,
            json!({"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
                   "stop_reason": stop, "stop_sequence": null, "usage": usage})
            .to_string(),
        );
    }
    let mut events: Vec<(&str, Value)> = vec![
        (
            "message_start",
            json!({"message": {"id": id, "type": "message", "role": "assistant",
            "model": model, "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 10, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}}),
        ),
        ("ping", json!({})),
    ];
    match &call {
        Some((cid, name, args)) => {
            events.push((
                "content_block_start",
                json!({"index": 0, "content_block":
                {"type": "tool_use", "id": cid, "name": name, "input": {}}}),
            ));
            events.push((
                "content_block_delta",
                json!({"index": 0, "delta":
                {"type": "input_json_delta", "partial_json": args.to_string()}}),
            ));
        }
        None => {
            events.push((
                "content_block_start",
                json!({"index": 0, "content_block": {"type": "text", "text": ""}}),
            ));
            events.push((
                "content_block_delta",
                json!({"index": 0, "delta": {"type": "text_delta", "text": text}}),
            ));
        }
    }
    events.push(("content_block_stop", json!({"index": 0})));
    events.push((
        "message_delta",
        json!({"delta": {"stop_reason": stop, "stop_sequence": null},
        "usage": {"output_tokens": 5}}),
    ));
    events.push(("message_stop", json!({})));
    let chunks = events
        .into_iter()
        .map(|(name, mut data)| {
            data["type"] = json!(name);
            sse(Some(name), &data)
        })
        .collect();
    Reply::sse_chunks(chunks)
}

// ------------------------------------------------- reading what was sent

/// A tool call or result in a request body: its id, its position (message
/// or item index), and for results the content as JSON text.
#[derive(Debug)]
struct Part {
    id: String,
    at: usize,
    content: String,
}

fn items(wire: Wire, body: &Value) -> Vec<Value> {
    let list = match wire {
        Wire::Responses => &body["input"],
        _ => &body["messages"],
    };
    list.as_array().cloned().unwrap_or_default()
}

fn tool_calls(wire: Wire, body: &Value) -> Vec<Part> {
    let mut out = Vec::new();
    for (at, m) in items(wire, body).iter().enumerate() {
        match wire {
            Wire::Chat => {
                for c in m["tool_calls"].as_array().into_iter().flatten() {
                    out.push(Part {
                        id: c["id"].as_str().unwrap_or("?").into(),
                        at,
                        content: String::new(),
                    });
                }
            }
            Wire::Responses => {
                let t = m["type"].as_str().unwrap_or_default();
                if t.ends_with("_call") && !t.ends_with("_output") {
                    out.push(Part {
                        id: m["call_id"].as_str().unwrap_or("?").into(),
                        at,
                        content: String::new(),
                    });
                }
            }
            Wire::Messages => {
                if m["role"] == "assistant" {
                    for b in m["content"].as_array().into_iter().flatten() {
                        if b["type"] == "tool_use" {
                            out.push(Part {
                                id: b["id"].as_str().unwrap_or("?").into(),
                                at,
                                content: String::new(),
                            });
                        }
                    }
                }
            }
        }
    }
    out
}

fn tool_results(wire: Wire, body: &Value) -> Vec<Part> {
    let mut out = Vec::new();
    for (at, m) in items(wire, body).iter().enumerate() {
        match wire {
            Wire::Chat => {
                if m["role"] == "tool" {
                    out.push(Part {
                        id: m["tool_call_id"].as_str().unwrap_or("?").into(),
                        at,
                        content: m["content"].to_string(),
                    });
                }
            }
            Wire::Responses => {
                if m["type"]
                    .as_str()
                    .is_some_and(|t| t.ends_with("_call_output"))
                {
                    out.push(Part {
                        id: m["call_id"].as_str().unwrap_or("?").into(),
                        at,
                        content: m["output"].to_string(),
                    });
                }
            }
            Wire::Messages => {
                if m["role"] == "user" {
                    for b in m["content"].as_array().into_iter().flatten() {
                        if b["type"] == "tool_result" {
                            out.push(Part {
                                id: b["tool_use_id"].as_str().unwrap_or("?").into(),
                                at,
                                content: b["content"].to_string(),
                            });
                        }
                    }
                }
            }
        }
    }
    out
}

/// Every tool result follows its own call; no call id and no result id
/// appears twice.
fn assert_paired(wire: Wire, body: &Value, what: &str) {
    let calls = tool_calls(wire, body);
    let results = tool_results(wire, body);
    for (i, c) in calls.iter().enumerate() {
        assert!(
            calls[..i].iter().all(|d| d.id != c.id),
            "{what}: tool call {} twice: {calls:?}",
            c.id
        );
    }
    for (i, r) in results.iter().enumerate() {
        assert!(
            results[..i].iter().all(|d| d.id != r.id),
            "{what}: tool result {} twice",
            r.id
        );
        assert!(
            calls.iter().any(|c| c.id == r.id && c.at < r.at),
            "{what}: tool result {} has no call before it (calls {calls:?})",
            r.id
        );
    }
}

/// The PNG the tools return, and its base64.
fn png() -> (PathBuf, String) {
    let path = fixtures().join("chart.png");
    let b64 = base64_simd::STANDARD.encode_to_string(std::fs::read(&path).unwrap());
    (path, b64)
}

/// What becomes of the image a tool returns.
enum Image {
    /// It reaches visor and is replaced by visor's placeholder.
    Replaced,
    /// The client itself sends this instead of the image: no image reaches
    /// visor at all.
    DroppedByClient(&'static str),
}

/// What a test expects of the loop.
struct Expect {
    /// The call whose result is the image, and what becomes of it.
    image: (usize, Image),
    /// Two calls whose results are the same text: the second is deduped.
    repeat: (usize, usize),
}

impl Expect {
    /// Every loop here: the image's call first, then the notes twice.
    fn image_then_notes_twice(image: Image) -> Expect {
        Expect {
            image: (0, image),
            repeat: (1, 2),
        }
    }
}

/// Checks what the mock received: the main requests (the script's wire,
/// with tools), one per turn, each holding one more tool result than the
/// one before, ids paired and in order; no image data anywhere; the image's
/// result replaced by a placeholder; the repeated result deduped. Returns
/// the main request bodies.
fn check_upstream(test: &str, mock: &MockUpstream, script: &Script, expect: &Expect) -> Vec<Value> {
    let recs = mock.recorded();
    if let Ok(dir) = std::env::var("VISOR_CLIENTS_DUMP") {
        // What the upstream got, one file per request, to look at.
        let _ = std::fs::create_dir_all(&dir);
        for (n, r) in recs.iter().enumerate() {
            let head = format!("{} {}\n{:?}\n", r.method, r.uri, r.headers);
            let _ = std::fs::write(
                format!("{dir}/{test}-{n}.txt"),
                [head.as_bytes(), &r.body].concat(),
            );
        }
    }
    let (_, b64) = png();
    for r in &recs {
        let text = String::from_utf8_lossy(&r.body);
        for needle in [&b64[..40], "iVBORw0KGgo", ";base64,", "\"type\":\"base64\""] {
            assert!(
                !text.contains(needle),
                "image data ({needle}) reached the upstream in {} {}:\n{}",
                r.method,
                r.uri,
                &text[..text.len().min(4000)]
            );
        }
        for (name, _) in r.headers.iter() {
            assert!(
                !name.as_str().starts_with("x-visor-"),
                "{name} was forwarded"
            );
        }
    }
    let main: Vec<Value> = recs
        .iter()
        .filter(|r| Wire::of(r.uri.path()) == Some(script.wire))
        .map(|r| serde_json::from_slice::<Value>(&r.body).unwrap())
        .filter(|b| b["tools"].as_array().is_some_and(|t| !t.is_empty()))
        .collect();
    let paths: Vec<String> = recs
        .iter()
        .map(|r| format!("{} {}", r.method, r.uri))
        .collect();
    assert_eq!(
        main.len(),
        script.calls.len() + 1,
        "one request per turn; the mock saw {paths:?}"
    );
    for (j, body) in main.iter().enumerate() {
        let what = format!("request {} of {}", j + 1, main.len());
        assert_paired(script.wire, body, &what);
        let ids: Vec<String> = tool_results(script.wire, body)
            .into_iter()
            .map(|p| p.id)
            .collect();
        let want: Vec<String> = (0..j).map(|k| script.wire.call_id(k)).collect();
        assert_eq!(ids, want, "{what}: the tool results, in order");
    }
    let last = tool_results(script.wire, main.last().unwrap());
    let image = &last[expect.image.0].content;
    match &expect.image.1 {
        Image::DroppedByClient(instead) => {
            assert!(image.contains(instead), "the image's result: {image}");
        }
        Image::Replaced => assert!(
            image.contains("[image sha256:"),
            "the image's result: {image}"
        ),
    }
    let (first, second) = (
        &last[expect.repeat.0].content,
        &last[expect.repeat.1].content,
    );
    assert!(
        first.contains("repeated tool output is sent once") && !first.contains("[omitted:"),
        "the first notes result goes whole: {first}"
    );
    assert!(
        second.contains("[omitted:") && !second.contains("repeated tool output is sent once"),
        "the repeated notes result is deduped: {second}"
    );
    main
}

/// `GET /visor/sessions/ID`: each turn once (as many assistant turns as
/// requests, each call and result once, the first user message once).
async fn check_session(visor: &Visor, id: &str, wire: Wire, main: &[Value], prompt: &str) {
    let (status, _, body) = send(
        Request::get(visor.url(&format!("/visor/sessions/{id}")))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).unwrap();
    if let Ok(dir) = std::env::var("VISOR_CLIENTS_DUMP") {
        let _ = std::fs::write(format!("{dir}/session-{id}.json"), &body);
    }
    let stored = json!({"messages": v["messages"], "input": v["messages"]});
    let calls = tool_calls(wire, &stored);
    let results = tool_results(wire, &stored);
    assert_paired(wire, &stored, "the session");
    assert_eq!(calls.len(), main.len() - 1, "each call once: {v:#}");
    assert_eq!(results.len(), main.len() - 1, "each result once: {v:#}");
    let msgs = v["messages"].as_array().unwrap();
    let text = |m: &Value| m.to_string();
    assert_eq!(
        msgs.iter().filter(|m| text(m).contains(prompt)).count(),
        1,
        "the prompt once: {v:#}"
    );
    assert_eq!(
        msgs.iter().filter(|m| text(m).contains(FINAL)).count(),
        1,
        "the final answer once: {v:#}"
    );
    if wire == Wire::Messages {
        let assistants = msgs.iter().filter(|m| m["role"] == "assistant").count();
        assert_eq!(
            assistants,
            main.len(),
            "one assistant message per turn: {v:#}"
        );
    }
}

/// visor for a text-only `model` in front of the scripted upstream.
async fn visor_for(mock: &MockUpstream, model: &str) -> Visor {
    visor_at(&mock.url(), model).await
}

/// visor for a text-only `model` in front of the upstream at `url`.
async fn visor_at(url: &str, model: &str) -> Visor {
    Visor::start(&format!(
        "[images]\nnon_vision = \"strip\"\n[[model]]\nmatch = \"{model}\"\nvision = false\n\
         [[upstream]]\nname = \"mock\"\nbase_url = \"{url}/v1\"\nmodels = [\"*\"]\n"
    ))
    .await
}

/// A work folder with the notes file (and the PNG beside it).
fn workdir(what: &str) -> PathBuf {
    let dir = temp_dir(what);
    std::fs::write(dir.join("notes.txt"), NOTES).unwrap();
    std::fs::copy(png().0, dir.join("chart.png")).unwrap();
    dir
}

const BOUND: Duration = Duration::from_secs(120);

// ------------------------------------------------------------ SDK tests

/// What runs an SDK script.
enum Runtime {
    /// node, in the npm-installed `node-clients` folder.
    Node,
    /// The venv's python, on the script in tests/clients.
    Python,
}

/// Runs an SDK script (node or python, with `args` after it) against visor
/// for `wire`, and checks the loop. Without the runtime: skipped (a
/// failure under CI).
async fn sdk_loop(
    test: &str,
    (runtime, file, args): (Runtime, &str, &[&str]),
    wire: Wire,
    model: &'static str,
    image: Image,
) {
    let (program, file) = match runtime {
        Runtime::Node => {
            let dir = need!(
                test,
                tokio::task::spawn_blocking(node_clients).await.unwrap()
            );
            (PathBuf::from("node"), dir.join(file))
        }
        Runtime::Python => {
            let python = need!(
                test,
                tokio::task::spawn_blocking(venv_python).await.unwrap()
            );
            (python, clients_dir().join(file))
        }
    };
    let script = sdk_script(wire);
    let mock = MockUpstream::start(upstream(script.clone(), model)).await;
    let visor = visor_for(&mock, model).await;
    let work = workdir(test);
    let mut cmd = Command::new(program);
    cmd.arg(file)
        .args(args)
        .current_dir(&work)
        .env("VISOR_BASE", visor.url("/v1"))
        .env("VISOR_ROOT", visor.url(""))
        .env("VISOR_MODEL", model)
        .env("VISOR_PNG", work.join("chart.png"))
        .env("VISOR_NOTES", work.join("notes.txt"))
        .env("NO_COLOR", "1");
    for k in [
        "OPENAI_API_KEY",
        "OPENAI_BASE_URL",
        "ANTHROPIC_API_KEY",
        "ANTHROPIC_BASE_URL",
        // LangChain would send traces to LangSmith.
        "LANGSMITH_TRACING",
        "LANGCHAIN_TRACING_V2",
    ] {
        cmd.env_remove(k);
    }
    let ran = run_client(cmd, BOUND).await;
    println!("{test}: client ran in {:.1} s", ran.took.as_secs_f64());
    ran.assert_ok(test);
    let out = ran.json();
    assert_eq!(out["final"], FINAL, "{out}");
    check_upstream(test, &mock, &script, &Expect::image_then_notes_twice(image));
    let _ = std::fs::remove_dir_all(work);
}

/// One test per SDK: `name: (runtime, script file, args), wire, model, image`.
macro_rules! sdk_tests {
    ($($(#[$doc:meta])* $name:ident: $sdk:expr, $wire:expr, $model:literal, $image:expr;)*) => {
        $(
            $(#[$doc])*
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                sdk_loop(stringify!($name), $sdk, $wire, $model, $image).await;
            }
        )*
    };
}

sdk_tests! {
    openai_node_sdk_chat_tool_loop:
        (Runtime::Node, "openai_node.mjs", &[]), Wire::Chat, "visor-test-node", Image::Replaced;
    /// A v7 `file` part in the JSON text of the tool message.
    vercel_ai_sdk_openai_chat_tool_loop:
        (Runtime::Node, "vercel_ai.mjs", &["openai-chat"]), Wire::Chat, "visor-test-vercel-chat",
        Image::Replaced;
    vercel_ai_sdk_openai_responses_tool_loop:
        (Runtime::Node, "vercel_ai.mjs", &["openai-responses"]), Wire::Responses,
        "visor-test-vercel-responses", Image::Replaced;
    vercel_ai_sdk_anthropic_tool_loop:
        (Runtime::Node, "vercel_ai.mjs", &["anthropic"]), Wire::Messages,
        "claude-visor-test-vercel", Image::Replaced;
    openai_agents_sdk_responses_tool_loop:
        (Runtime::Python, "agents_sdk.py", &["responses"]), Wire::Responses,
        "visor-test-agents-responses", Image::Replaced;
    /// The SDK's Chat Completions model sends no image in a tool message:
    /// it puts its own placeholder there (openai-agents 0.24,
    /// chatcmpl_converter, unless preserve_tool_output_all_content).
    openai_agents_sdk_chat_tool_loop:
        (Runtime::Python, "agents_sdk.py", &["chat"]), Wire::Chat, "visor-test-agents-chat",
        Image::DroppedByClient("[tool output omitted]");
    anthropic_python_sdk_tool_loop:
        (Runtime::Python, "anthropic_sdk.py", &[]), Wire::Messages, "claude-visor-test-python",
        Image::Replaced;
    /// The tool answers a standard `image` block (`base64`, `mime_type`):
    /// langchain-openai sends it as an `image_url` data URL in the tool
    /// message's content list.
    langchain_openai_chat_tool_loop:
        (Runtime::Python, "langchain_agent.py", &["openai"]), Wire::Chat,
        "visor-test-langchain-openai", Image::Replaced;
    /// The same image block: langchain-anthropic sends it as a base64
    /// `image` block inside the `tool_result`.
    langchain_anthropic_tool_loop:
        (Runtime::Python, "langchain_agent.py", &["anthropic"]), Wire::Messages,
        "claude-visor-test-langchain", Image::Replaced;
}

// ------------------------------------------------------ the coding agents

const AGENT_PROMPT: &str = "Look at chart.png, then print notes.txt twice.";

/// Runs a coding agent's CLI (`what` it is, for the messages) to its end
/// and checks it finished: exit 0 and the final text printed.
async fn run_agent(test: &str, what: &str, cmd: Command) -> Ran {
    let ran = run_client(cmd, BOUND).await;
    println!("{test}: {what} ran in {:.1} s", ran.took.as_secs_f64());
    ran.assert_ok(test);
    assert!(
        ran.stdout.contains(FINAL),
        "{what} printed:\n{}\n{}",
        ran.stdout,
        ran.stderr
    );
    ran
}

/// A work folder for `test`, and Codex's side of the loop there: view the
/// PNG, then `cat` the notes twice.
fn codex_work(test: &str) -> (PathBuf, Script) {
    let work = workdir(test);
    let script = Script {
        wire: Wire::Responses,
        calls: vec![
            ("view_image", json!({"path": work.join("chart.png")})),
            ("exec_command", json!({"cmd": "cat notes.txt"})),
            ("exec_command", json!({"cmd": "cat notes.txt"})),
        ],
        text: FINAL,
    };
    (work, script)
}

/// Runs `codex exec` in `work` with a `CODEX_HOME` of its own whose
/// config.toml has visor (`base`, …/v1) as a custom Responses provider —
/// the README's block — over HTTP/SSE or the Responses WebSocket, with an
/// `x-visor-session` header or none. Checks it finished with the final
/// text and that Codex knew every key of the config.
async fn run_codex(
    test: &str,
    codex: PathBuf,
    work: &Path,
    model: &str,
    base: &str,
    websockets: bool,
    session: Option<&str>,
) {
    let home = work.join("codex-home");
    std::fs::create_dir_all(&home).unwrap();
    let headers = session
        .map(|id| format!("http_headers = {{ \"x-visor-session\" = \"{id}\" }}\n"))
        .unwrap_or_default();
    std::fs::write(
        home.join("config.toml"),
        format!(
            r#"model = "{model}"
model_provider = "visor"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.visor]
name = "visor"
base_url = "{base}"
env_key = "OPENAI_API_KEY"
wire_api = "responses"
supports_websockets = {websockets}
request_max_retries = 0
stream_max_retries = 0
{headers}"#
        ),
    )
    .unwrap();
    let mut cmd = Command::new(codex);
    cmd.args(["exec", "--skip-git-repo-check", AGENT_PROMPT])
        .current_dir(work)
        .env("CODEX_HOME", &home)
        .env("GIT_CEILING_DIRECTORIES", work.parent().unwrap())
        .env("OPENAI_API_KEY", "sk-client-test")
        .env("NO_COLOR", "1")
        .env_remove("OPENAI_BASE_URL");
    let ran = run_agent(test, "codex exec", cmd).await;
    // Every key of the config above is one Codex knows (the README's
    // block is this one).
    assert!(
        !ran.stderr.contains("unrecognized configuration"),
        "{}",
        ran.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_cli_exec_with_session() {
    const T: &str = "codex_cli_exec_with_session";
    let codex = need!(T, node_cli("codex").await);
    const MODEL: &str = "visor-test-codex";
    let (work, script) = codex_work(T);
    let mock = MockUpstream::start(upstream(script.clone(), MODEL)).await;
    let visor = visor_for(&mock, MODEL).await;
    let base = visor.url("/v1");
    run_codex(T, codex, &work, MODEL, &base, false, Some("codex-1")).await;
    let main = check_upstream(
        T,
        &mock,
        &script,
        &Expect::image_then_notes_twice(Image::Replaced),
    );
    check_session(&visor, "codex-1", Wire::Responses, &main, AGENT_PROMPT).await;
    let _ = std::fs::remove_dir_all(work);
}

/// What the WebSocket upstream saw: the handshake paths and every client
/// event, in order.
#[derive(Default)]
struct WsSeen {
    handshakes: Vec<String>,
    events: Vec<Value>,
}

/// A Responses WebSocket upstream playing `script`. Each `response.create`
/// is answered with the events of the next turn, counted by the tool
/// outputs this socket has carried so far (after its first request Codex
/// sends only new items, with `previous_response_id`); one with
/// `generate: false` (Codex's warm-up) gets an empty completed response.
async fn ws_upstream(script: Script, model: &'static str) -> (String, Arc<Mutex<WsSeen>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(WsSeen::default()));
    let s = seen.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (s, script) = (s.clone(), script.clone());
            tokio::spawn(async move {
                let s2 = s.clone();
                let callback = move |req: &WsRequest, resp: WsResponse| {
                    s2.lock()
                        .unwrap()
                        .handshakes
                        .push(req.uri().path().to_owned());
                    Ok(resp)
                };
                let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(stream, callback).await else {
                    return;
                };
                let mut outputs = 0;
                while let Some(Ok(m)) = ws.next().await {
                    let Message::Text(t) = m else {
                        if matches!(m, Message::Close(_)) {
                            break;
                        }
                        continue;
                    };
                    let ev: Value = serde_json::from_str(&t).unwrap_or_default();
                    s.lock().unwrap().events.push(ev.clone());
                    if ev["type"] != "response.create" {
                        continue;
                    }
                    let events = if ev["generate"] == false {
                        let r = json!({"id": "resp_visor_warmup", "object": "response",
                            "created_at": 1_700_000_000, "status": "completed", "model": model,
                            "output": [], "usage": {"input_tokens": 0, "output_tokens": 0,
                            "total_tokens": 0}});
                        vec![
                            json!({"type": "response.created", "sequence_number": 0, "response": r}),
                            json!({"type": "response.completed", "sequence_number": 1, "response": r}),
                        ]
                    } else {
                        outputs += tool_results(Wire::Responses, &ev).len();
                        let call = (outputs < script.calls.len()).then(|| {
                            let (name, args) = &script.calls[outputs];
                            (Wire::Responses.call_id(outputs), *name, args)
                        });
                        responses_events(model, outputs, call, script.text)
                    };
                    for e in events {
                        if ws.send(Message::text(e.to_string())).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (url, seen)
}

/// Codex over the Responses WebSocket (`supports_websockets = true`):
/// visor's WebSocket mode replaces the image in the event that carries it,
/// no image data reaches the upstream, each tool output arrives once, after
/// its call, and the loop finishes. (Each event carries only the new
/// output, so the repeated `cat` is not deduped here, and sessions do not
/// apply on a WebSocket.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_cli_exec_over_websocket() {
    const T: &str = "codex_cli_exec_over_websocket";
    let codex = need!(T, node_cli("codex").await);
    const MODEL: &str = "visor-test-codex-ws";
    let (work, script) = codex_work(T);
    let (url, seen) = ws_upstream(script.clone(), MODEL).await;
    let visor = visor_at(&url, MODEL).await;
    let base = visor.url("/v1");
    run_codex(T, codex, &work, MODEL, &base, true, None).await;

    let seen = seen.lock().unwrap();
    if let Ok(dir) = std::env::var("VISOR_CLIENTS_DUMP") {
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::write(
            format!("{dir}/{T}-events.json"),
            json!(seen.events).to_string(),
        );
    }
    assert!(!seen.handshakes.is_empty(), "Codex opened no WebSocket");
    assert!(
        seen.handshakes.iter().all(|p| p == "/v1/responses"),
        "{:?}",
        seen.handshakes
    );
    let (_, b64) = png();
    for ev in &seen.events {
        let text = ev.to_string();
        for needle in [&b64[..40], "iVBORw0KGgo", ";base64,"] {
            assert!(
                !text.contains(needle),
                "image data ({needle}) reached the upstream: {text}"
            );
        }
    }
    let turns: Vec<&Value> = seen
        .events
        .iter()
        .filter(|e| e["type"] == "response.create" && e["generate"] != false)
        .collect();
    assert_eq!(
        turns.len(),
        script.calls.len() + 1,
        "one response.create per turn"
    );
    let outputs: Vec<Part> = turns
        .iter()
        .flat_map(|e| tool_results(Wire::Responses, e))
        .collect();
    let ids: Vec<&str> = outputs.iter().map(|p| p.id.as_str()).collect();
    let want: Vec<String> = (0..script.calls.len())
        .map(|k| Wire::Responses.call_id(k))
        .collect();
    assert_eq!(ids, want, "each tool output once, in order");
    for (j, e) in turns.iter().enumerate() {
        // Turn j's event carries outputs only for calls already made.
        for p in tool_results(Wire::Responses, e) {
            let k: usize = p.id.trim_start_matches("call_visor_").parse().unwrap();
            assert!(
                k < j,
                "turn {j} carries the output of call {k}, not made yet"
            );
        }
    }
    assert!(
        outputs[0].content.contains("[image sha256:"),
        "the image's output: {}",
        outputs[0].content
    );
    drop(seen);
    let _ = std::fs::remove_dir_all(work);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_print_with_session() {
    const T: &str = "claude_code_print_with_session";
    let claude = need!(T, node_cli("claude").await);
    const MODEL: &str = "claude-visor-test-code";
    let work = workdir(T);
    let script = Script {
        wire: Wire::Messages,
        calls: vec![
            ("Read", json!({"file_path": work.join("chart.png")})),
            (
                "Bash",
                json!({"command": "cat notes.txt", "description": "Print the notes"}),
            ),
            (
                "Bash",
                json!({"command": "cat notes.txt", "description": "Print the notes again"}),
            ),
        ],
        text: FINAL,
    };
    let mock = MockUpstream::start(upstream(script.clone(), MODEL)).await;
    let visor = visor_for(&mock, MODEL).await;
    let home = work.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let mut cmd = Command::new(claude);
    cmd.args([
        "-p",
        AGENT_PROMPT,
        "--model",
        MODEL,
        "--allowedTools",
        "Read",
        "Bash(cat:*)",
    ])
    .current_dir(&work)
    .env("HOME", &home)
    .env("CLAUDE_CONFIG_DIR", home.join(".claude"))
    .env("GIT_CEILING_DIRECTORIES", work.parent().unwrap())
    .env("ANTHROPIC_BASE_URL", visor.url(""))
    .env("ANTHROPIC_API_KEY", "sk-ant-client-test")
    .env("ANTHROPIC_CUSTOM_HEADERS", "x-visor-session: claude-1")
    .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
    .env("DISABLE_TELEMETRY", "1")
    .env("DISABLE_ERROR_REPORTING", "1")
    .env("DISABLE_AUTOUPDATER", "1")
    .env("NO_COLOR", "1")
    .env_remove("ANTHROPIC_AUTH_TOKEN");
    run_agent(T, "claude -p", cmd).await;
    let main = check_upstream(
        T,
        &mock,
        &script,
        &Expect::image_then_notes_twice(Image::Replaced),
    );
    check_session(&visor, "claude-1", Wire::Messages, &main, AGENT_PROMPT).await;
    let _ = std::fs::remove_dir_all(work);
}

// ------------------------------------------------------- prompt caching

/// The `anthropic` SDK's tool loop sets no `cache_control`; through visor to
/// an Anthropic-kind upstream (a mock whose cache is simulated), every turn
/// gets visor's breakpoints, the same prefix as the turn before, and is
/// read from the cache from the second turn on; `x-visor-cache` tells the
/// client so.
#[tokio::test]
async fn anthropic_python_sdk_tool_loop_is_cached_at_visors_breakpoints() {
    const T: &str = "anthropic_python_sdk_tool_loop_is_cached_at_visors_breakpoints";
    let python = need!(T, tokio::task::spawn_blocking(venv_python).await.unwrap());
    let sim = Arc::new(support::anthropic_cache::CacheSim::default());
    let cache = sim.clone();
    // Six turns: five tool calls, then the answer.
    let mock = MockUpstream::start(move |req: &Recorded| {
        let usage = cache.request(&req.body).json();
        let v: Value = serde_json::from_slice(&req.body).unwrap_or_default();
        let turn = v["messages"].as_array().map_or(0, |m| m.len() / 2 + 1);
        let (content, stop) = match turn {
            1..=5 => (
                json!([{"type": "tool_use", "id": format!("toolu_{turn}"), "name": "sh", "input": {"cmd": "make test"}}]),
                "tool_use",
            ),
            _ => (json!([{"type": "text", "text": FINAL}]), "end_turn"),
        };
        Reply::json(
            200,
            json!({"id": format!("msg_{turn}"), "type": "message", "role": "assistant", "model": "claude-test",
                   "content": content, "stop_reason": stop, "stop_sequence": null, "usage": usage})
            .to_string(),
        )
    })
    .await;
    let visor = Visor::start(&format!(
        "{}api_key = \"sk-ant-upstream\"\nauth = \"x-api-key\"\nmodels = [\"*\"]\n",
        mock.upstream_toml("claude")
    ))
    .await;
    let mut cmd = Command::new(python);
    cmd.arg(clients_dir().join("anthropic_cache.py"))
        .env("VISOR_ROOT", visor.url(""))
        .env("VISOR_MODEL", "claude-test")
        .env_remove("ANTHROPIC_API_KEY")
        .env_remove("ANTHROPIC_BASE_URL");
    let ran = run_client(cmd, BOUND).await;
    ran.assert_ok(T);
    let out = ran.json();
    assert_eq!(out["turns"], 6, "{out}");
    let told: Vec<&str> = out["cache"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(told[0], "readable=0; miss=first");
    for t in &told[1..] {
        assert!(
            t.starts_with("readable=") && !t.contains("miss"),
            "{told:?}"
        );
    }
    let read: Vec<u64> = out["read"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(read[0], 0);
    assert!(
        read[1..].iter().all(|&r| r > 1000),
        "read from the second turn on: {read:?}"
    );
    // Breakpoints in the right places, the prefix kept turn to turn.
    let sent = mock.recorded();
    let mut previous: Option<Vec<Value>> = None;
    for (i, r) in sent.iter().enumerate() {
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        let blocks = support::anthropic_cache::blocks(&v);
        let marked: Vec<usize> = (0..blocks.len()).filter(|&b| blocks[b].1).collect();
        assert_eq!(
            marked,
            vec![1, blocks.len() - 1],
            "turn {}: the system prompt and the last block",
            i + 1
        );
        let now: Vec<Value> = blocks.into_iter().map(|b| b.0).collect();
        if let Some(p) = &previous {
            assert_eq!(&now[..p.len()], &p[..], "turn {} changed the prefix", i + 1);
        }
        previous = Some(now);
    }
}
