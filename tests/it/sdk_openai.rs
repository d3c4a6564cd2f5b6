//! End to end with the official `openai` Python SDK, as users drive visor:
//! non-stream, stream with usage, the request id header, visor's own
//! errors decoded by the SDK's error types, and an image for a text-only
//! model described on the way.
//!
//! The SDK lives in a venv under `target/tmp/py-venv`, made on first use
//! (`.ci/run` makes it up front). Without Python or network the test skips
//! with a printed reason, except under `CI=true`, where it must run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use support::*;

fn venv_python() -> Result<PathBuf, String> {
    let _venv = PY_VENV.lock().unwrap_or_else(|e| e.into_inner());
    let _installing = install_lock("py-venv")?;
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("py-venv");
    let python = venv.join("bin/python");
    let has_openai = |py: &PathBuf| {
        Command::new(py)
            .args(["-c", "import openai"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if python.exists() && has_openai(&python) {
        return Ok(python);
    }
    let made = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .output()
        .map_err(|e| format!("python3 not runnable: {e}"))?;
    if !made.status.success() {
        return Err(format!(
            "python3 -m venv failed: {}",
            String::from_utf8_lossy(&made.stderr)
        ));
    }
    let pip = Command::new(venv.join("bin/pip"))
        .args([
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "openai",
        ])
        .output()
        .map_err(|e| format!("pip not runnable: {e}"))?;
    if !pip.status.success() || !has_openai(&python) {
        return Err(format!(
            "pip install openai failed: {}",
            String::from_utf8_lossy(&pip.stderr)
        ));
    }
    Ok(python)
}

const SCRIPT: &str = r#"
import json, os
from openai import OpenAI, APIConnectionError, AuthenticationError, NotFoundError

base = os.environ["VISOR_BASE"]
client = OpenAI(base_url=base, api_key="vk-test", max_retries=0, timeout=20)
out = {}

msgs = [{"role": "user", "content": "ping"}]
raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=msgs)
r = raw.parse()
out["text"] = r.choices[0].message.content
out["total_tokens"] = r.usage.total_tokens
out["request_id"] = raw.headers.get("x-request-id")

stream = client.chat.completions.create(
    model="gpt-4o-mini", messages=msgs, stream=True, stream_options={"include_usage": True}
)
parts, usage = [], None
for chunk in stream:
    if chunk.choices:
        parts.append(chunk.choices[0].delta.content or "")
    if chunk.usage:
        usage = chunk.usage.total_tokens
out["stream_text"] = "".join(parts)
out["stream_total_tokens"] = usage

out["models"] = [m.id for m in client.models.list()]

bad = OpenAI(base_url=base, api_key="wrong-key", max_retries=0, timeout=20)
try:
    bad.chat.completions.create(model="gpt-4o-mini", messages=msgs)
except AuthenticationError as e:
    out["auth_status"] = e.status_code
    out["auth_code"] = e.code

try:
    client.chat.completions.create(model="no-such-model", messages=msgs)
except NotFoundError as e:
    out["notfound_status"] = e.status_code
    out["notfound_code"] = e.code
    out["notfound_message"] = e.message

# An upstream that breaks mid-stream: the SDK must see an error, not a
# short answer that looks complete.
got = []
try:
    for chunk in client.chat.completions.create(model="gpt-cut", messages=msgs, stream=True):
        if chunk.choices:
            got.append(chunk.choices[0].delta.content or "")
    out["cut"] = "completed"
except APIConnectionError:
    out["cut"] = "APIConnectionError"
out["cut_text"] = "".join(got)

# An image for a text-only model: described by the describer (the mock
# here), the SDK sees an ordinary answer and visor's count header.
img = "data:image/png;base64," + os.environ["VISOR_PNG_B64"]
content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": img}}]
raw = client.chat.completions.with_raw_response.create(
    model="gpt-oss-120b", messages=[{"role": "user", "content": content}]
)
out["image_replaced"] = raw.headers.get("x-visor-images-replaced")
out["image_answer"] = raw.parse().choices[0].message.content

# An agent that re-fetches the same chat lines every turn: the second tool
# result reaches the upstream without the lines it repeats.
lines = "\n".join(f"[10:0{i}] bob: line number {i} of the shared chat history" for i in range(5))
def call(i):
    return {"id": f"c{i}", "type": "function", "function": {"name": "fetch", "arguments": "{}"}}
history = [
    {"role": "user", "content": "summarize"},
    {"role": "assistant", "content": None, "tool_calls": [call(1)]},
    {"role": "tool", "tool_call_id": "c1", "content": lines},
    {"role": "assistant", "content": None, "tool_calls": [call(2)]},
    {"role": "tool", "tool_call_id": "c2", "content": lines + "\n[10:05] carol: one new line"},
]
raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=history)
out["dedup_saved"] = int(raw.headers.get("x-visor-bytes-saved"))
out["dedup_answer"] = raw.parse().choices[0].message.content

print(json.dumps(out))
"#;

fn chat_reply(req: &Recorded) -> Reply {
    let body: serde_json::Value = serde_json::from_slice(&req.body).unwrap_or_default();
    if req.uri.path().ends_with("/models") {
        return Reply::json(
            200,
            r#"{"object":"list","data":[{"id":"gpt-4o-mini","object":"model","created":1,"owned_by":"mock"}]}"#,
        );
    }
    let said = body["messages"][0]["content"]
        .as_str()
        .unwrap_or("?")
        .to_owned();
    if body["model"] == "gpt-cut" {
        let c = serde_json::json!({
            "id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 1,
            "model": "gpt-cut",
            "choices": [{"index": 0, "delta": {"content": "partial"}, "finish_reason": null}]
        });
        return Reply::sse_chunks(vec![
            Chunk::Data(Bytes::from(format!("data: {c}\n\n"))),
            Chunk::Fail,
        ]);
    }
    if body["stream"] == true {
        let mut chunks = Vec::new();
        for word in ["pong", " to ", &said] {
            let c = serde_json::json!({
                "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                "model": "gpt-4o-mini",
                "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": null}],
                "usage": null
            });
            chunks.push(Chunk::Data(Bytes::from(format!("data: {c}\n\n"))));
        }
        let u = serde_json::json!({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
            "model": "gpt-4o-mini", "choices": [],
            "usage": {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}
        });
        chunks.push(Chunk::Data(Bytes::from(format!("data: {u}\n\n"))));
        chunks.push(Chunk::Data(Bytes::from_static(b"data: [DONE]\n\n")));
        return Reply::sse_chunks(chunks);
    }
    let r = serde_json::json!({
        "id": "chatcmpl-0", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("pong to {said}")},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}
    });
    Reply::json(200, r.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_sdk_through_visor() {
    let python = match tokio::task::spawn_blocking(venv_python).await.unwrap() {
        Ok(p) => p,
        Err(why) if std::env::var("CI").as_deref() != Ok("true") => {
            println!("SKIPPED openai_python_sdk_through_visor: {why}");
            return;
        }
        Err(why) => panic!("CI=true and the openai SDK is not available: {why}"),
    };
    let mock = MockUpstream::start(chat_reply).await;
    let visor = Visor::start(&format!(
        "[server]\napi_keys = [\"vk-test\"]\n[[upstream]]\nname=\"mock\"\nbase_url=\"{}/v1\"\nmodels=[\"gpt-*\"]\n",
        mock.url()
    ))
    .await;
    let base = visor.url("/v1");
    let png = std::fs::read(fixtures().join("chart.png")).unwrap();
    let png_b64 = base64_simd::STANDARD.encode_to_string(&png);
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::task::spawn_blocking(move || {
            Command::new(python)
                .args(["-c", SCRIPT])
                .env("VISOR_BASE", base)
                .env("VISOR_PNG_B64", png_b64)
                .env_remove("OPENAI_API_KEY")
                .env_remove("OPENAI_BASE_URL")
                .output()
        }),
    )
    .await
    .expect("the SDK script finished within 60 s")
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "script failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["text"], "pong to ping");
    assert_eq!(v["total_tokens"], 11);
    assert!(v["request_id"].as_str().unwrap().starts_with("req_"), "{v}");
    assert_eq!(v["stream_text"], "pong to ping");
    assert_eq!(v["stream_total_tokens"], 11);
    assert_eq!(v["models"], serde_json::json!(["gpt-4o-mini"]));
    assert_eq!(v["auth_status"], 401);
    assert_eq!(v["auth_code"], "invalid_api_key");
    assert_eq!(v["notfound_status"], 404);
    assert_eq!(v["notfound_code"], "model_not_found");
    assert!(
        v["notfound_message"]
            .as_str()
            .unwrap()
            .contains("no-such-model")
    );
    assert_eq!(v["cut"], "APIConnectionError", "{v}");
    assert_eq!(
        v["cut_text"], "partial",
        "events before the break are delivered"
    );

    assert_eq!(v["image_replaced"], "1", "{v}");
    assert_eq!(v["image_answer"], "pong to ?");

    // What reached the upstream: the SDK's own body, no proxy key; for the
    // image, a describer call (visor's) and the chat with the description.
    let recs = mock.recorded();
    let (described, recs): (Vec<_>, Vec<_>) = recs.into_iter().partition(|r| {
        serde_json::from_slice::<serde_json::Value>(&r.body)
            .is_ok_and(|v| v["messages"][0]["content"] == visor::media_text::describe::PROMPT)
    });
    assert_eq!(described.len(), 1, "one describer call");
    assert!(described[0].headers.get("authorization").is_none());
    let image_chat = &recs[recs.len() - 2];
    let sent = String::from_utf8_lossy(&image_chat.body);
    assert!(
        sent.contains("described: pong to You describe images"),
        "{sent}"
    );
    assert!(!sent.contains("base64"), "{sent}");
    let history: serde_json::Value = serde_json::from_slice(&recs.last().unwrap().body).unwrap();
    assert_eq!(
        history["messages"][4]["content"],
        "[omitted: message 3 lines 1-5]\n[10:05] carol: one new line"
    );
    assert_eq!(history["messages"][4]["tool_call_id"], "c2");
    assert_eq!(
        history["messages"][2],
        serde_json::json!({"role": "tool", "tool_call_id": "c1", "content": (0..5).map(|i| format!("[10:0{i}] bob: line number {i} of the shared chat history")).collect::<Vec<_>>().join("\n")})
    );
    assert!(v["dedup_saved"].as_i64().unwrap() > 200, "{v}");
    assert_eq!(v["dedup_answer"], "pong to summarize");
    assert_eq!(
        recs.len(),
        6,
        "five chats and a model list; refused ones never arrive"
    );
    for r in &recs {
        assert!(r.headers.get("authorization").is_none());
        assert!(
            r.headers["user-agent"]
                .to_str()
                .unwrap()
                .starts_with("OpenAI/Python")
        );
    }
    let text = visor.metrics().await;
    // 8 prompt tokens in the usage of each of the four answers that report
    // it (the history chat is the fourth).
    assert_eq!(
        metric(&text, "visor_tokens_total", &[("kind", "prompt")]),
        Some(32.0)
    );
    assert_eq!(
        metric(&text, "visor_images_total", &[("action", "described")]),
        Some(1.0)
    );
}
