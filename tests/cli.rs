//! The `visor` binary as a user runs it: `check`, bad configs, and a clean
//! exit on SIGTERM.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn visor() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_visor"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    c.env_remove("VISOR_CONFIG");
    c
}

fn temp_config(name: &str, text: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join(format!("{name}-{}.toml", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

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
}

#[test]
fn check_names_the_key_the_value_and_why() {
    let path = temp_config(
        "bad",
        "[server]\nlisten = \"localhost\"\n[[upstream]]\nname = \"x\"\nbase_url = \"api.openai.com\"\n",
    );
    let out = visor()
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
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
    let out = visor()
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("server") && err.contains("timeout"), "{err}");

    let path = temp_config(
        "envvar",
        "[[upstream]]\nname=\"x\"\nbase_url=\"http://x\"\napi_key=\"${VISOR_TEST_SURELY_UNSET}\"\n",
    );
    let out = visor()
        .args(["check", "--config"])
        .arg(&path)
        .env_remove("VISOR_TEST_SURELY_UNSET")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("VISOR_TEST_SURELY_UNSET"), "{err}");

    // The same file is valid once the variable is set; the value never prints.
    let out = visor()
        .args(["check", "--config"])
        .arg(&path)
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
    let out = visor()
        .arg("check")
        .env("VISOR_CONFIG", "/nonexistent/visor.toml")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/visor.toml"));
}

#[test]
fn serve_exits_zero_on_sigterm() {
    let mut child = visor()
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut listening = false;
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        if line.contains("visor listening") {
            listening = true;
            break;
        }
    }
    assert!(listening, "visor did not report listening");
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    let exit = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(exit.and_then(|s| s.code()), Some(0), "exit after SIGTERM");
}
