//! The `visor serve` binary stopping and starting again as a user does it:
//! SIGINT/SIGTERM with nothing in flight exits at once, a second signal
//! during a drain exits at once (non-zero), a restart binds the same port
//! at once; and what a default start and a stream without usage log.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use support::{Chunk, MockUpstream, Reply, temp_config, temp_dir, visor};

/// What "exits at once" means here (measured: about 0.05 s, debug build).
const AT_ONCE: Duration = Duration::from_secs(1);

/// A `visor serve` child with its stderr lines.
struct Proc {
    child: std::process::Child,
    lines: Receiver<String>,
    log: Vec<String>,
}

impl Proc {
    fn spawn(mut cmd: Command) -> Proc {
        cmd.stderr(Stdio::piped())
            .stdout(Stdio::null())
            .env("RUST_LOG", "info");
        let mut child = cmd.spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Proc {
            child,
            lines,
            log: Vec::new(),
        }
    }

    /// `visor serve --listen LISTEN [--config CONFIG]`.
    fn serve(listen: &str, config: Option<&PathBuf>) -> Proc {
        let mut cmd = visor();
        cmd.args(["serve", "--listen", listen]);
        if let Some(c) = config {
            cmd.arg("--config").arg(c);
        }
        Proc::spawn(cmd)
    }

    /// Waits (bounded) for a line containing `what`; the whole log on failure.
    fn wait_for(&mut self, what: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            match self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(line) => {
                    self.log.push(line.clone());
                    if line.contains(what) {
                        return line;
                    }
                }
                Err(_) => panic!("no line with {what:?} in:\n{}", self.log.join("\n")),
            }
        }
    }

    /// Waits for "visor listening" and returns its address.
    fn listening(&mut self) -> String {
        let line = self.wait_for("visor listening", Duration::from_secs(20));
        line.split_whitespace()
            .find_map(|w| w.strip_prefix("addr="))
            .unwrap()
            .to_owned()
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig}");
    }

    /// Waits up to `bound` for the exit: its status and how long it took,
    /// or `None` if it is still running then.
    fn exit_within(&mut self, bound: Duration) -> Option<(ExitStatus, Duration)> {
        let start = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some((s, start.elapsed()));
            }
            if start.elapsed() > bound {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Sends `sig` and asserts the exit within [`AT_ONCE`]; returns the
    /// status and the whole log.
    fn stop_at_once(mut self, sig: &str) -> (ExitStatus, Duration, String) {
        let sent = Instant::now();
        self.signal(sig);
        let Some((status, _)) = self.exit_within(AT_ONCE) else {
            let _ = self.child.kill();
            let _ = self.child.wait();
            panic!(
                "still running {AT_ONCE:?} after SIG{sig}:\n{}",
                self.rest_of_log()
            );
        };
        let took = sent.elapsed();
        (status, took, self.rest_of_log())
    }

    /// Every line, once stderr has closed (bounded).
    fn rest_of_log(&mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Ok(line) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            self.log.push(line);
        }
        self.log.join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A config of this test's own (its own data dir), `extra` under
/// `[server]`, forwarding to `upstream`.
fn config(name: &str, extra: &str, upstream: &str) -> PathBuf {
    let data = temp_dir(name);
    temp_config(
        name,
        &format!(
            "[server]\ndata_dir = \"{}\"\n{extra}\n[[upstream]]\nname = \"mock\"\nbase_url = \"{upstream}/v1\"\nmodels = [\"*\"]\n",
            data.display()
        ),
    )
}

/// `GET /healthz` on a kept-alive HTTP/1.1 connection, left open.
fn keep_alive_healthz(addr: &str) -> std::net::TcpStream {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: visor\r\n\r\n")
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = s.read(&mut buf).unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    s
}

#[test]
fn sigterm_with_nothing_in_flight_exits_within_a_second() {
    // The defaults (no drain_delay_secs), a kept-alive idle connection open.
    let path = config("stop-term", "", "http://127.0.0.1:9");
    let mut v = Proc::serve("127.0.0.1:0", Some(&path));
    let addr = v.listening();
    let _idle = keep_alive_healthz(&addr);
    let (status, took, log) = v.stop_at_once("TERM");
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(log.contains("SIGTERM received"), "{log}");
    assert!(
        !log.contains("still serving"),
        "no delay by default:\n{log}"
    );
    eprintln!("exit {took:?} after SIGTERM");
}

#[test]
fn sigint_skips_a_configured_drain_delay() {
    // drain_delay_secs is for load balancers, which send SIGTERM.
    let path = config("stop-int", "drain_delay_secs = 5", "http://127.0.0.1:9");
    let mut v = Proc::serve("127.0.0.1:0", Some(&path));
    let addr = v.listening();
    let _idle = keep_alive_healthz(&addr);
    let (status, took, log) = v.stop_at_once("INT");
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(log.contains("SIGINT received"), "{log}");
    assert!(log.contains("not waiting server.drain_delay_secs"), "{log}");
    eprintln!("exit {took:?} after SIGINT");
}

#[test]
fn a_second_sigint_during_a_drain_exits_at_once() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // One event, then the stream stays open: the drain waits for it.
    let mock = rt.block_on(MockUpstream::start(|_| Reply::stall_after(1)));
    let path = config("stop-twice", "drain_timeout_secs = 30", &mock.url());
    let mut v = Proc::serve("127.0.0.1:0", Some(&path));
    let addr = v.listening();
    let (first_tx, first_rx) = std::sync::mpsc::channel();
    let stream = rt.spawn(async move {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: visor\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(req.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&got).contains("data:") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before the first event");
            got.extend_from_slice(&buf[..n]);
        }
        let _ = first_tx.send(());
        // Held open (the upstream never ends it) until visor goes.
        while s.read(&mut buf).await.is_ok_and(|n| n > 0) {}
    });
    first_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the stream's first event");
    v.signal("INT");
    v.wait_for("draining connections", Duration::from_secs(10));
    // The stream in flight holds the drain…
    assert!(
        v.exit_within(Duration::from_millis(300)).is_none(),
        "exited with a stream in flight:\n{}",
        v.log.join("\n")
    );
    // …until the second signal.
    let (status, took, log) = v.stop_at_once("INT");
    assert_eq!(
        status.code(),
        Some(visor::server::FORCED_EXIT_CODE),
        "{log}"
    );
    assert_ne!(status.code(), Some(0));
    assert!(
        log.contains("second signal during shutdown: exiting at once"),
        "{log}"
    );
    eprintln!("exit {took:?} after the second SIGINT");
    stream.abort();
}

#[test]
fn a_restart_binds_the_same_port_at_once() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    // Two workers: the listeners share the port (SO_REUSEPORT).
    let path = config("restart", "workers = 2", "http://127.0.0.1:9");
    let mut old = Proc::serve(&listen, Some(&path));
    assert_eq!(old.listening(), listen);
    // A kept-alive connection visor closes at shutdown: the server side of
    // it is left in TIME_WAIT on the port.
    let _idle = keep_alive_healthz(&listen);

    // A second visor while the first serves is refused, as before.
    let mut second = Proc::serve(&listen, Some(&path));
    let (status, _) = second
        .exit_within(Duration::from_secs(20))
        .expect("a second visor on a served port exits");
    assert_eq!(status.code(), Some(1));
    assert!(
        second.rest_of_log().contains("already served"),
        "{}",
        second.log.join("\n")
    );

    let (status, _, log) = old.stop_at_once("INT");
    assert_eq!(status.code(), Some(0), "{log}");
    let started = Instant::now();
    let mut new = Proc::serve(&listen, Some(&path));
    assert_eq!(new.listening(), listen, "{}", new.log.join("\n"));
    eprintln!("restarted on {listen} in {:?}", started.elapsed());
    let _ = keep_alive_healthz(&listen);
    let (status, _, log) = new.stop_at_once("INT");
    assert_eq!(status.code(), Some(0), "{log}");
}

/// `visor serve` under `ulimit -n 1024`, where 10000 connections do not fit.
fn serve_with_few_files(config: Option<&PathBuf>) -> Proc {
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        "ulimit -S -n 1024 && exec \"$0\" \"$@\"",
        env!("CARGO_BIN_EXE_visor"),
        "serve",
        "--listen",
        "127.0.0.1:0",
    ]);
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("VISOR_CONFIG");
    Proc::spawn(cmd)
}

#[test]
fn a_default_start_does_not_warn_about_max_connections() {
    // The shipped config (its max_connections is the default's value),
    // then one that does not say it: lowered quietly, said at info.
    let own = config("default-conns", "", "http://127.0.0.1:9");
    for cfg in [None, Some(&own)] {
        let mut v = serve_with_few_files(cfg);
        v.listening();
        let (status, _, log) = v.stop_at_once("INT");
        assert_eq!(status.code(), Some(0), "{log}");
        assert!(
            log.contains("max_connections (the default) fitted to the open-file limit"),
            "lowered, and said so at info:\n{log}"
        );
        assert!(
            !log.lines()
                .any(|l| l.contains("WARN") && l.contains("max_connections")),
            "a warning about a value the user did not set:\n{log}"
        );
    }
    // The user's own value is lowered with a warning.
    let mine = config("own-conns", "max_connections = 5000", "http://127.0.0.1:9");
    let mut v = serve_with_few_files(Some(&mine));
    let line = v.wait_for("max_connections lowered", Duration::from_secs(20));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("max_connections=5000"), "{line}");
}

#[test]
fn a_stream_without_usage_logs_no_token_fields() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mock = rt.block_on(MockUpstream::start(|r| {
        if String::from_utf8_lossy(&r.body).contains("\"stream\":true") {
            // No usage chunk: the provider says nothing about tokens.
            Reply::sse_chunks(vec![
                Chunk::Data(support::sse_event(0)),
                Chunk::Data(support::sse_event(1)),
                Chunk::Data(bytes::Bytes::from_static(b"data: [DONE]\n\n")),
            ])
        } else {
            Reply::json(
                200,
                r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}"#,
            )
        }
    }));
    let path = config("no-usage", "", &mock.url());
    let mut v = Proc::serve("127.0.0.1:0", Some(&path));
    let addr = v.listening();
    rt.block_on(async {
        use http_body_util::{BodyExt, Full};
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<Full<bytes::Bytes>>();
        for (model, stream) in [("m-stream", true), ("m-json", false)] {
            let body = format!(
                r#"{{"model":"{model}","stream":{stream},"messages":[{{"role":"user","content":"hi"}}]}}"#
            );
            let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(Full::new(bytes::Bytes::from(body)))
                .unwrap();
            let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(resp.status(), 200);
            let _ = resp.into_body().collect().await.unwrap();
        }
    });
    let streamed = loop {
        let l = v.wait_for("response finished", Duration::from_secs(10));
        if l.contains("model=m-stream") {
            break l;
        }
    };
    assert!(streamed.contains("outcome=\"complete\""), "{streamed}");
    for field in [
        "prompt_tokens",
        "completion_tokens",
        "cache_read",
        "cache_written",
    ] {
        assert!(
            !streamed.contains(field),
            "{field} unknown, not 0: {streamed}"
        );
    }
    let (status, _, log) = v.stop_at_once("INT");
    assert_eq!(status.code(), Some(0), "{log}");
    // What a provider says is still logged.
    let json = log
        .lines()
        .find(|l| l.contains("response finished") && l.contains("model=m-json"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        json.contains("prompt_tokens=7") && json.contains("completion_tokens=3"),
        "{json}"
    );
}
