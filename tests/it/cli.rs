//! The `visor` binary as a user runs it: `check`, bad configs, and a clean
//! exit on SIGTERM.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::{Serving, temp_config, temp_dir, visor};

#[test]
fn check_accepts_the_shipped_config_and_prints_routes() {
    let out = visor().arg("check").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("openai"), "{stdout}");
    assert!(stdout.contains("https://api.openai.com/v1"), "{stdout}");
    assert!(stdout.contains("client's key forwarded"), "{stdout}");
    assert!(stdout.contains("store: disk"), "{stdout}");
    assert!(
        stdout.contains("describer: model gpt-4o-mini on upstream openai, prompt v1"),
        "{stdout}"
    );
}

/// `visor check | head -3`: a reader that left ends visor quietly (exit 0,
/// no panic, no backtrace).
#[test]
fn a_closed_stdout_pipe_ends_check_quietly() {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = visor()
        .arg("check")
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `visor check --config PATH`.
fn check(path: &Path) -> Command {
    let mut cmd = visor();
    cmd.args(["check", "--config"]).arg(path);
    cmd
}

/// Runs `cmd`, asserts it exits with 1, and returns its stderr.
fn fails(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{err}");
    err
}

#[test]
fn check_names_the_key_the_value_and_why() {
    let path = temp_config(
        "bad",
        "[server]\nlisten = \"localhost\"\n[[upstream]]\nname = \"x\"\nbase_url = \"api.openai.com\"\n",
    );
    let err = fails(&mut check(&path));
    assert!(err.contains("server.listen: \"localhost\""), "{err}");
    assert!(
        err.contains("upstream[0].base_url: \"api.openai.com\""),
        "{err}"
    );
    assert!(err.contains("must start with http"), "{err}");
}

#[test]
fn check_rejects_unknown_keys_and_missing_variables() {
    let path = temp_config(
        "unknown",
        "[server]\nlisten = \"127.0.0.1:1\"\ntimeout = 3\n[[upstream]]\nname=\"x\"\nbase_url=\"http://x\"\n",
    );
    let err = fails(&mut check(&path));
    assert!(err.contains("server") && err.contains("timeout"), "{err}");

    let path = temp_config(
        "envvar",
        "[[upstream]]\nname=\"x\"\nbase_url=\"http://x\"\napi_key=\"${VISOR_TEST_SURELY_UNSET}\"\n",
    );
    let err = fails(check(&path).env_remove("VISOR_TEST_SURELY_UNSET"));
    assert!(err.contains("VISOR_TEST_SURELY_UNSET"), "{err}");

    // The same file is valid once the variable is set; the value never prints.
    let out = check(&path)
        .env("VISOR_TEST_SURELY_UNSET", "sk-do-not-print")
        .output()
        .unwrap();
    assert!(out.status.success());
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!all.contains("sk-do-not-print"), "{all}");
}

#[test]
fn config_from_env_var_and_missing_file() {
    let err = fails(
        visor()
            .arg("check")
            .env("VISOR_CONFIG", "/nonexistent/visor.toml"),
    );
    assert!(err.contains("/nonexistent/visor.toml"), "{err}");
}

#[test]
fn serve_exits_zero_on_sigterm() {
    let serving = Serving::start(&[], &[("RUST_LOG", "info")]);
    let (code, log) = serving.terminate();
    assert_eq!(code, Some(0), "exit after SIGTERM:\n{log}");
    assert!(log.contains("SIGTERM received"), "{log}");
}

/// `server.log_format = "json"`: every line `visor serve` writes is one
/// JSON object with its time, level, message and fields, from the first
/// line (the config is read before the log starts) to the last.
#[test]
fn serve_logs_one_json_object_a_line_with_log_format_json() {
    let path = temp_config(
        "json-log",
        "[server]\nlog_format = \"json\"\n[[upstream]]\nname = \"u\"\nbase_url = \"http://127.0.0.1:9/v1\"\n",
    );
    let config = path.to_string_lossy().into_owned();
    let serving = Serving::start(&["--config", &config], &[("RUST_LOG", "info")]);
    let addr = serving.addr.clone();
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    let (code, log) = serving.terminate();
    assert_eq!(code, Some(0), "{log}");
    let mut messages = Vec::new();
    for line in log.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["timestamp"].is_string(), "{line}");
        assert!(
            matches!(v["level"].as_str(), Some("INFO" | "WARN" | "ERROR")),
            "{line}"
        );
        messages.push(
            v["fields"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
    }
    assert!(
        messages.iter().any(|m| m.contains("visor listening")),
        "{messages:?}"
    );
    assert!(
        messages.iter().any(|m| m.contains("SIGTERM received")),
        "{messages:?}"
    );
    // A bad value is refused with the choices.
    let bad = temp_config("json-log-bad", "[server]\nlog_format = \"xml\"\n");
    let out = visor()
        .args(["check", "--config", &bad.to_string_lossy()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("server.log_format"), "{err}");
}

/// With traces on, a JSON `response finished` line carries its trace's id:
/// the client's, continued (the collector here is down; nothing fails).
#[test]
fn json_log_lines_carry_the_trace_id() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mock = rt.block_on(support::MockUpstream::start(|_| support::chat_ok()));
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let path = temp_config(
        "json-trace",
        &format!(
            "[server]\nlog_format = \"json\"\n[telemetry]\notlp_endpoint = \"http://{closed}\"\n\
             [[upstream]]\nname = \"mock\"\nbase_url = \"http://{}/v1\"\n",
            mock.addr
        ),
    );
    let config = path.to_string_lossy().into_owned();
    let serving = Serving::start(&["--config", &config], &[("RUST_LOG", "info")]);
    let addr = serving.addr.clone();
    let trace = "0af7651916cd43dd8448eb211c80319c";
    rt.block_on(async {
        use http_body_util::{BodyExt, Full};
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<Full<bytes::Bytes>>();
        let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("traceparent", format!("00-{trace}-b7ad6b7169203331-01"))
            .body(Full::new(bytes::Bytes::from_static(
                br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            )))
            .unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(resp.status(), 200);
        let _ = resp.into_body().collect().await;
    });
    let (code, log) = serving.terminate();
    assert_eq!(code, Some(0), "{log}");
    let finished: Vec<serde_json::Value> = log
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap_or_else(|e| panic!("{e}: {l}"))
        })
        .filter(|v| v["fields"]["message"] == "response finished")
        .collect();
    assert_eq!(finished.len(), 1, "{log}");
    assert_eq!(finished[0]["fields"]["trace_id"], trace, "{log}");
}

/// Runs the real binary at `RUST_LOG=trace` against a mock upstream, sends
/// requests carrying keys and a body over HTTP/1.1 and HTTP/2, and checks
/// that no log line holds a key, an Authorization value or the body.
#[test]
fn logs_never_contain_keys_or_bodies() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mock = rt.block_on(support::MockUpstream::start(|_| {
        support::Reply::json(
            200,
            r#"{"ok":true,"usage":{"prompt_tokens":1,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":1}}}"#,
        )
    }));
    let upstream = mock.addr;
    let path = temp_config(
        "secrets",
        &format!(
            "[server]\ndrain_delay_secs = 0\napi_keys = [\"${{VISOR_TEST_PROXY_KEY}}\"]\n\
             [[upstream]]\nname=\"mock\"\nbase_url=\"http://{upstream}/v1\"\napi_key=\"${{VISOR_TEST_UP_KEY}}\"\n"
        ),
    );
    let config = path.to_string_lossy().into_owned();
    let serving = Serving::start(
        &["--config", &config],
        &[
            ("RUST_LOG", "trace"),
            ("VISOR_TEST_PROXY_KEY", "vk-SECRET-proxy"),
            ("VISOR_TEST_UP_KEY", "sk-SECRET-upstream"),
        ],
    );
    let addr = serving.addr.clone();
    let body = r#"{"model":"m","messages":[{"role":"user","content":"BODY-SECRET-text"}]}"#;
    rt.block_on(async {
        use http_body_util::{BodyExt, Full};
        // HTTP/1.1 with a Bearer key, and HTTP/2 with x-api-key.
        let h1 = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http::<Full<bytes::Bytes>>();
        let h2 = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http::<Full<bytes::Bytes>>();
        for (client, name, value) in [
            (&h1, "authorization", "Bearer vk-SECRET-proxy"),
            (&h2, "x-api-key", "vk-SECRET-proxy"),
            (&h1, "authorization", "Bearer sk-SECRET-wrong"),
        ] {
            let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
                .header(name, value)
                .header("content-type", "application/json")
                .body(Full::new(bytes::Bytes::from_static(body.as_bytes())))
                .unwrap();
            let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
                .await
                .unwrap()
                .unwrap();
            let status = resp.status();
            let _ = resp.into_body().collect().await;
            assert!(status == 200 || status == 401, "{status}");
        }
    });
    let (code, all) = serving.terminate();
    assert_eq!(code, Some(0));
    assert_eq!(
        mock.count(),
        2,
        "the two keyed requests reached the upstream"
    );
    for rec in mock.recorded() {
        assert_eq!(rec.headers["authorization"], "Bearer sk-SECRET-upstream");
    }
    assert!(
        all.contains("response finished"),
        "expected request logs:\n{all}"
    );
    // What visor did and the provider's cache figure are on the line
    // (agent CLIs never show the x-visor-* headers).
    let line = all
        .lines()
        .find(|l| l.contains("response finished") && l.contains("status=200"))
        .unwrap();
    for field in ["cache_read=1", "images_replaced=0", "bytes_saved=0"] {
        assert!(line.contains(field), "{field} in {line}");
    }
    // Every key and the body text carry the marker SECRET.
    assert!(!all.contains("SECRET"), "a secret reached the log:\n{all}");
}

#[test]
fn check_prints_the_model_table_and_resolves_a_model() {
    let cfg = temp_config(
        "models",
        "[[upstream]]\nname = \"local\"\nbase_url = \"http://127.0.0.1:9/v1\"\nmodels = [\"*\"]\n\
         [[model]]\nmatch = \"house-*\"\nvision = false\nmax_images = 2\n\
         [[model]]\nmatch = \"gpt-4o-mini\"\ninput = 0.1\n",
    );
    let check_model = |model: &str| {
        let out = check(&cfg).args(["--model", model]).output().unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    let text = check_model("openrouter/acme/house-7b");
    assert!(text.contains("model table: 2 user rows, "), "{text}");
    assert!(
        text.contains("  user     \"house-*\"  vision=false"),
        "{text}"
    );
    assert!(
        text.contains("model \"openrouter/acme/house-7b\": vision=false"),
        "{text}"
    );
    assert!(text.contains("max_images=2"), "{text}");
    assert!(text.contains("decided by user row model[0]"), "{text}");

    // No row prices a house model: no prices shown (the user row listed
    // above it states one for another model).
    assert!(
        text.contains("  user     \"gpt-4o-mini\"  vision=? ")
            && text.contains(" price/M: input=0.1 cached_input=? cache_write=? output=?\n"),
        "{text}"
    );
    let line = text
        .lines()
        .find(|l| l.starts_with("model \"openrouter/acme/house-7b\""))
        .unwrap();
    assert!(!line.contains("price/M"), "{line}");

    let text = check_model("deepseek-chat");
    assert!(
        text.contains("images replaced — decided by built-in row"),
        "{text}"
    );
    // Prices per million tokens, from the built-in rows; a user row's
    // field first.
    assert!(
        text.contains("price/M: input=0.28 cached_input=0.028 cache_write=? output=0.42\n"),
        "{text}"
    );
    let text = check_model("openai/gpt-4o-mini-2024-07-18");
    assert!(
        text.contains("price/M: input=0.1 cached_input=0.075 cache_write=? output=0.6\n"),
        "{text}"
    );
    // The provider's documented limits, from the built-in rows.
    assert!(
        text.contains(
            " limits: max_image_bytes=20000000 max_image_edge=? max_image_pixels=? \
             max_request_bytes=50000000 many_images=? many_images_edge=? \
             image_tokens=openai_tiles price/M:"
        ),
        "{text}"
    );
    let text = check_model("my-unknown-model");
    assert!(
        text.contains("images sent as they are — decided by no row (unknown"),
        "{text}"
    );
    // Documents and audio: a text-only model gets their text; Office files
    // go as they are nowhere without a row.
    let text = check_model("openrouter/acme/house-7b");
    assert!(
        text.contains(
            "PDFs and other documents replaced by their text — decided by no row: follows images"
        ),
        "{text}"
    );
    assert!(text.contains("audio replaced by its transcript"), "{text}");
    let text = check_model("my-unknown-model");
    assert!(
        text.contains("PDFs and other documents sent as they are"),
        "{text}"
    );
    assert!(
        text.contains("DOCX, PPTX, XLSX replaced by their text"),
        "{text}"
    );
}

#[test]
fn check_lists_what_each_learned_model_refused() {
    let dir = support::temp_dir("learned");
    // Learned names as a store keeps them (here the legacy file).
    std::fs::write(
        dir.join("learned-models.json"),
        r#"{"non_vision": ["blind-model", "[pdf] paperless-model", "[audio] deaf-model"]}"#,
    )
    .unwrap();
    let cfg = temp_config(
        "learned",
        &format!(
            "[server]\ndata_dir = {:?}\n[[upstream]]\nname = \"local\"\nbase_url = \"http://127.0.0.1:9/v1\"\nmodels = [\"*\"]\n",
            dir.display().to_string()
        ),
    );
    let out = check(&cfg)
        .args(["--model", "paperless-model"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("3 learned rows (1 for images, 1 for PDFs, 1 for audio"),
        "{text}"
    );
    assert!(
        text.contains("  learned  \"blind-model\"  vision=false (refused images)"),
        "{text}"
    );
    assert!(
        text.contains("  learned  \"paperless-model\"  pdf=false (refused documents)"),
        "{text}"
    );
    assert!(
        text.contains("  learned  \"deaf-model\"  audio=false (refused audio)"),
        "{text}"
    );
    assert!(!text.contains("\"[pdf]"), "{text}");
    assert!(
        text.contains("PDFs and other documents replaced by their text"),
        "{text}"
    );
}

#[test]
fn explain_shows_a_documents_text_without_calling_a_model() {
    let pdf = std::fs::read(support::fixtures().join("media/text.pdf")).unwrap();
    let body = serde_json::json!({"model": "gpt-oss-120b", "messages": [
        {"role": "user", "content": [
            {"type": "file", "file": {"file_data": format!("data:application/pdf;base64,{}", base64_simd::STANDARD.encode_to_string(&pdf)), "filename": "text.pdf"}},
            {"type": "file", "file": {"file_data": format!("data:application/pdf;base64,{}", base64_simd::STANDARD.encode_to_string(b"%PDF-1.7 cut")), "filename": "cut.pdf"}},
            {"type": "input_audio", "input_audio": {"data": base64_simd::STANDARD.encode_to_string(b"RIFF\0\0\0\0WAVEnot really"), "format": "wav"}},
        ]},
    ]});
    let dir = support::temp_dir("explain-pdf");
    let path = dir.join("body.json");
    std::fs::write(&path, serde_json::to_vec(&body).unwrap()).unwrap();
    let out = visor()
        .args(["explain", "--model", "gpt-oss-120b"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["report"]["pdf"], false);
    assert_eq!(v["report"]["media_replaced"], 3);
    let notes = v["report"]["images"].as_array().unwrap();
    let said: Vec<(&str, &str)> = notes
        .iter()
        .map(|n| (n["medium"].as_str().unwrap(), n["action"].as_str().unwrap()))
        .collect();
    // Only what was turned into text is `converted`.
    assert_eq!(
        said,
        [
            ("document", "converted"),
            ("document", "stripped"),
            ("audio", "stripped")
        ]
    );
    let text = v["request"]["messages"][0]["content"][0]["text"]
        .as_str()
        .unwrap();
    assert!(
        text.contains("--- page 2 ---") && text.contains("twelve percent"),
        "{text}"
    );
}

#[test]
fn explain_prints_the_rewritten_request_and_the_report() {
    let fixture = support::fixtures().join("anthropic-messages-image.json");
    let out = visor()
        .args(["explain", "--model", "glm-4.6", "--endpoint", "messages"])
        .arg(&fixture)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["report"]["images_replaced"], 2);
    assert_eq!(v["report"]["vision"], false);
    assert_eq!(v["request"]["messages"][0]["content"][0]["type"], "text");
    assert!(!String::from_utf8_lossy(&out.stdout).contains(";base64"));

    // From stdin, a vision model: unchanged, images kept.
    let mut child = visor()
        .args(["explain", "--model", "gpt-4o", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let body = std::fs::read(support::fixtures().join("chat-image-nonvision.json")).unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), &body).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["report"]["changed"], false);
    assert_eq!(
        v["request"],
        serde_json::from_slice::<serde_json::Value>(&body).unwrap()
    );

    // Nested deeper than a JSON reader goes (visor streams through it):
    // explained, the request printed as it is sent.
    let deep = format!(
        r#"{{"model":"gpt-oss-120b","messages":[{{"role":"user","content":"hi"}}],"x":{}{}}}"#,
        "[".repeat(5000),
        "]".repeat(5000)
    );
    let mut child = visor()
        .args(["explain", "--model", "gpt-oss-120b", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), deep.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.trim_end()
            .ends_with(&format!("\"request\": {deep}\n}}")),
        "{:.300}",
        &text
    );
    assert!(text.contains("\"changed\": false"), "{text:.300}");

    // An agent's re-fetched history: the repeated lines are reported.
    let out = visor()
        .args(["explain", "--model", "gpt-oss-120b"])
        .arg(support::fixtures().join("agent-history-refetch.json"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["report"]["lines_omitted"], 696);
    assert!(v["report"]["bytes_saved_dedup"].as_i64().unwrap() > 80_000);
    let last_tool = v["request"]["messages"][119]["content"].as_str().unwrap();
    let (note, new) = last_tool.split_once('\n').unwrap();
    assert!(
        note.starts_with("[omitted: ") && note.contains(" of messages ") && note.contains(" … "),
        "one note naming where the 24 re-fetched lines are: {note}"
    );
    assert!(new.contains("(msg 69)"), "the new line stays: {new}");

    // Not JSON: a clear error, exit 1.
    let bad = temp_config("bad-body", "{\"model\": ");
    let err = fails(visor().args(["explain", "--model", "m"]).arg(&bad));
    assert!(err.contains("not valid JSON"), "{err}");
}

/// The environment every recipe reads, set to placeholders.
fn recipe_env(cmd: &mut Command) -> &mut Command {
    for var in [
        "DEEPSEEK_API_KEY",
        "OPENAI_API_KEY",
        "AZURE_OPENAI_KEY",
        "TEAM_A_KEY",
        "TEAM_B_KEY",
    ] {
        cmd.env(var, format!("placeholder-{var}"));
    }
    cmd
}

/// `visor init` lists the recipes; `visor init NAME` writes one, which
/// `visor check --strict` accepts without a warning; it never overwrites
/// a file without `--force`.
#[test]
fn init_writes_each_recipe_and_check_accepts_it_strictly() {
    let out = visor().arg("init").output().unwrap();
    assert!(out.status.success());
    let listed = String::from_utf8_lossy(&out.stdout).into_owned();
    let dir = support::temp_dir("init");
    for name in ["claude-code", "codex", "local", "team"] {
        assert!(listed.contains(name), "{listed}");
        let path = dir.join(format!("{name}.toml"));
        let out = visor()
            .args(["init", name, "--output"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(said.contains("next: `visor check --config"), "{said}");
        // The file written is the one in config/examples.
        let shipped = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("config/examples/{name}.toml")),
        )
        .unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), shipped);
        let out = recipe_env(visor().args(["check", "--strict", "--config"]).arg(&path))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success() && !text.contains("warning:"),
            "{name}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Written again: refused, unless --force.
        let err = fails(visor().args(["init", name, "--output"]).arg(&path));
        assert!(err.contains("--force"), "{err}");
        assert!(
            visor()
                .args(["init", name, "--force", "--output"])
                .arg(&path)
                .status()
                .unwrap()
                .success()
        );
    }
    let err = fails(visor().args(["init", "nope"]));
    assert!(err.contains("claude-code, codex, local, team"), "{err}");
}

/// The usual mistakes are warnings (exit 0), errors with `--strict`.
#[test]
fn check_warns_of_the_usual_mistakes() {
    let cases = [
        (
            "[[upstream]]\nname = \"a\"\nbase_url = \"https://api.example.com/v1/chat/completions\"\n",
            "ends in /chat/completions",
        ),
        (
            "[[upstream]]\nname = \"a\"\nbase_url = \"https://api.example.com\"\n",
            "has no version segment such as /v1",
        ),
        (
            "[[upstream]]\nname = \"a\"\nbase_url = \"https://a.example.com/v1\"\napi_key = \"k\"\n\
             [[upstream]]\nname = \"b\"\nbase_url = \"https://b.example.com/v1\"\napi_key = \"k\"\nmodels = [\"claude-*\"]\n",
            "upstream[1] \"b\": no request is ever routed to it",
        ),
        (
            "[[upstream]]\nname = \"a\"\nbase_url = \"https://a.example.com/v1\"\nmodels = [\"gpt-*\"]\napi_key = \"k\"\n\
             [[key]]\nname = \"t\"\nkey = \"sk-t\"\nmodels = [\"claude-*\"]\n",
            "key \"t\" models[0] \"claude-*\": no [[upstream]] serves a model it names",
        ),
        (
            "[[upstream]]\nname = \"a\"\nbase_url = \"https://a.example.com/v1\"\nmodels = [\"gpt-*\"]\n\
             [[upstream]]\nname = \"b\"\nbase_url = \"https://b.example.com/v1\"\nmodels = [\"*\"]\napi_key = \"k\"\n\
             [describer]\nupstream = \"a\"\n",
            "describer.upstream \"a\" has no api_key: it gets the client's key only for requests routed to \"a\"",
        ),
        (
            "[server]\napi_keys = [\"sk-p\"]\n[[upstream]]\nname = \"a\"\nbase_url = \"https://a.example.com/v1\"\n",
            "with proxy keys clients' keys are never forwarded",
        ),
        (
            "[[upstream]]\nname = \"anthropic\"\nbase_url = \"https://api.anthropic.com/v1\"\nauth = \"x-api-key\"\napi_key = \"k\"\n",
            "describer.upstream is not set, so it is the first upstream, \"anthropic\", is of the Anthropic kind",
        ),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let path = temp_config(&format!("mistake-{i}"), text);
        let out = visor()
            .args(["check", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "case {i}: {said}");
        assert!(
            said.contains("warning: ") && said.contains(want),
            "case {i}: {said}"
        );
        let err = fails(visor().args(["check", "--strict", "--config"]).arg(&path));
        assert!(err.contains("--strict"), "case {i}: {err}");
    }
    // Sensible configs get none: a key's glob wider than its upstream's, a
    // describer whose upstream takes every route (the other one only a
    // fallback), the usual base URLs, a comment after an unquoted value.
    for (i, text) in [
        "[[upstream]]\nname = \"a\"\nbase_url = \"https://a.example.com/v1\"\nmodels = [\"gpt-4o*\"]\napi_key = \"k\"\n\
         [[key]]\nname = \"t\"\nkey = \"sk-t\"\nmodels = [\"gpt-*\"]\n",
        "[[upstream]]\nname = \"oa\"\nbase_url = \"https://a.example.com/v1\"\nfallbacks = [\"b\"]\n\
         [[upstream]]\nname = \"b\"\nbase_url = \"https://b.example.com/v1\"\napi_key = \"k\"\n\
         [describer]\nupstream = \"oa\"\n",
        "[[upstream]]\nname = \"azure\"\nbase_url = \"https://r.openai.azure.com/openai/v1\"\nmodels = [\"gpt-*\"]\napi_key = \"k\"\n\
         [[upstream]]\nname = \"gemini\"\nbase_url = \"https://generativelanguage.googleapis.com/v1beta/openai\"\nmodels = [\"gemini-*\"]\napi_key = \"k\"\n\
         [[upstream]]\nname = \"openrouter\"\nbase_url = \"https://openrouter.ai/api/v1\"\nmodels = [\"*\"]\napi_key = \"k\"\n",
    ]
    .iter()
    .enumerate()
    {
        let path = temp_config(&format!("sensible-{i}"), text);
        let out = visor().args(["check", "--strict", "--config"]).arg(&path).output().unwrap();
        assert!(
            out.status.success(),
            "sensible {i}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let path = temp_config(
        "comment-hint",
        "[[upstream]]\nname = team-a   # the team\nbase_url = \"https://a.example.com/v1\"\n",
    );
    let err = fails(visor().args(["check", "--config"]).arg(&path));
    assert!(
        err.contains("name = \"team-a\"") && !err.contains("# the team\""),
        "{err}"
    );
    // The shipped default has none.
    let out = visor().args(["check", "--strict"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Outside the repository, with no config anywhere, visor uses its
/// built-in default and says so; `./visor.toml` is found without a flag.
#[test]
fn without_a_config_file_the_built_in_default_is_used_and_named() {
    let dir = support::temp_dir("no-config");
    let home = dir.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let run = || {
        let mut c = visor();
        c.current_dir(&dir)
            .env("HOME", &home)
            .env_remove("XDG_CONFIG_HOME")
            .arg("check");
        c
    };
    if Path::new("/etc/visor/visor.toml").exists() {
        eprintln!("SKIPPED: /etc/visor/visor.toml exists on this machine");
        return;
    }
    let out = run().output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        said.contains("no config file found") && said.contains("the built-in default: ok"),
        "{said}"
    );
    // $XDG_CONFIG_HOME/visor/visor.toml, then ./visor.toml before it.
    let xdg = dir.join("xdg");
    std::fs::create_dir_all(xdg.join("visor")).unwrap();
    std::fs::write(
        xdg.join("visor/visor.toml"),
        "[[upstream]]\nname = \"from-xdg\"\nbase_url = \"https://x.example.com/v1\"\n",
    )
    .unwrap();
    let out = run().env("XDG_CONFIG_HOME", &xdg).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("from-xdg"));
    std::fs::write(
        dir.join("visor.toml"),
        "[[upstream]]\nname = \"from-cwd\"\nbase_url = \"https://c.example.com/v1\"\n",
    )
    .unwrap();
    let out = run().env("XDG_CONFIG_HOME", &xdg).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        said.starts_with("visor.toml: ok") && said.contains("from-cwd"),
        "{said}"
    );
}

/// `visor explain` takes the model from the body when `--model` is absent;
/// `--raw` prints the exact bytes it would send.
#[test]
fn explain_reads_the_model_from_the_body_and_prints_raw_bytes() {
    let fixture = support::fixtures().join("chat-image-nonvision.json");
    let body = std::fs::read(&fixture).unwrap();
    let named: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let out = visor().arg("explain").arg(&fixture).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["report"]["model"], named["model"]);
    // Raw: the bytes as sent, not re-serialised (keys keep their order).
    let out = visor()
        .args(["explain", "--raw"])
        .arg(&fixture)
        .output()
        .unwrap();
    assert!(out.status.success());
    let raw = out.stdout;
    assert!(serde_json::from_slice::<serde_json::Value>(&raw).is_ok());
    assert!(
        !String::from_utf8_lossy(&raw).contains(";base64,"),
        "the image was replaced"
    );
    let first_key = |b: &[u8]| {
        let t = String::from_utf8_lossy(b).into_owned();
        t.find('"')
            .map(|i| t[i + 1..].split('"').next().unwrap_or("").to_owned())
    };
    assert_eq!(
        first_key(&raw),
        first_key(&body),
        "raw keeps the body's own order"
    );
    // A body that names no model, without --model: refused, saying so.
    let mut child = visor()
        .arg("explain")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), br#"{"messages":[]}"#).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--model"));
}

#[tokio::test]
async fn explain_says_where_to_ask_while_a_running_visor_holds_the_store() {
    let dir = temp_dir("explain-in-use");
    let cfg = dir.join("visor.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\ndata_dir = \"{}\"\n[store]\nbackend = \"disk\"\n[[upstream]]\nname = \"x\"\nbase_url = \"http://127.0.0.1:9/v1\"\n",
            dir.display()
        ),
    )
    .unwrap();
    // Another process's store, open (as `serve` holds it).
    let metrics = std::sync::Arc::new(visor::metrics::Metrics::new().unwrap());
    let store =
        visor::store::Store::open(&visor::config::StoreBackend::Disk, "visor:", &dir, metrics)
            .unwrap();
    store.learn("some-model").await.unwrap();
    let fixture = support::fixtures().join("chat-image-nonvision.json");
    let out = visor()
        .arg("explain")
        .arg("--config")
        .arg(&cfg)
        .args(["--model", "text-only-model"])
        .arg(&fixture)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let said = v["report"]["store"].as_str().unwrap();
    assert!(said.contains("/visor/api/explain"), "{said}");
    drop(store);
}
