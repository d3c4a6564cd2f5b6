//! What visor adds to each turn of an agent's conversation: every turn of
//! the longest real conversations (read from `../shared/corpus/real/` by
//! path, or `VISOR_CORPUS`; said when absent) and sampled turns of a
//! generated 1,000-turn tool-calling agent (about 1 MB of history at its
//! end) are sent, one at a time, through visor and straight to the same
//! mock upstream, in turn, 7 times each; the median of visor's minus the
//! median of the direct one is the added time. Both servers run in this
//! process on 127.0.0.1 (visor as `visor serve` runs, with the shipped
//! config's rules), so the figures are the request's path through visor,
//! not a network's.
//!
//! Then the transforms' own CPU time per turn, on this thread: each turn
//! read in full (walk, dedup, assemble) against each turn continued from
//! the state the turn before left (`[dedup] state_bytes`), the best of
//! `TURNS_ROUNDS` each, and the same body checked from both.
//!
//! `cargo bench --bench turns` (the release profile). `TURNS_SAMPLE=N`
//! samples every Nth generated turn (default 100); `TURNS_ROUNDS=N` sends
//! each N times each way (default 7).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench setup

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use visor::proxy::dedup_states::DedupStates;
use visor::transform::{Limits, Plan, Rules, Shape, Takes};

fn corpus_dir() -> PathBuf {
    match std::env::var_os("VISOR_CORPUS") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/corpus/real"),
    }
}

/// A mock upstream answering every request with a short chat completion.
async fn mock() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            tcp.set_nodelay(true).unwrap();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        let _ = req.into_body().collect().await;
                        Ok::<_, hyper::Error>(
                        http::Response::builder()
                            .header("content-type", "application/json")
                            .body(Full::new(Bytes::from_static(
                                br#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":1}}"#,
                            )))
                            .unwrap(),
                    )
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    addr
}

/// visor with the shipped config's rules, forwarding to `upstream`.
async fn visor(upstream: SocketAddr, data: &Path) -> SocketAddr {
    let shipped = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("config/visor.toml"),
    )
    .unwrap();
    // The shipped upstream replaced by the mock; every other section kept.
    let mut toml = String::new();
    let mut skipping = false;
    for line in shipped.lines() {
        if line.starts_with('[') {
            skipping = line.trim() == "[[upstream]]";
        }
        if !skipping {
            toml.push_str(line);
            toml.push('\n');
        }
    }
    toml.push_str(&format!(
        "\n[[upstream]]\nname = \"openai\"\nbase_url = \"http://{upstream}/v1\"\nmodels = [\"*\"]\n"
    ));
    let toml = toml.replace(
        "data_dir = \"var\"",
        &format!("data_dir = {:?}", data.display().to_string()),
    );
    let mut cfg =
        visor::config::Config::from_toml(&toml, Path::new("turns.toml"), &|_| None).unwrap();
    cfg.server.data_dir = data.to_path_buf();
    cfg.server.drain_delay = Duration::ZERO;
    let server = visor::server::Server::bind(cfg, Some("127.0.0.1:0".parse().unwrap()))
        .await
        .unwrap();
    let addr = server.local_addr().unwrap();
    tokio::spawn(server.run(std::future::pending::<()>()));
    addr
}

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

async fn once(client: &Http, addr: SocketAddr, body: &Bytes) -> Duration {
    send(client, addr, body, "on").await
}

/// One request with `x-visor-transform: transform` (`off`: visor holds,
/// checks and forwards the body, and changes nothing).
async fn send(client: &Http, addr: SocketAddr, body: &Bytes, transform: &str) -> Duration {
    let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-bench")
        .header("x-visor-transform", transform)
        .body(Full::new(body.clone()))
        .unwrap();
    let started = Instant::now();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let _ = resp.into_body().collect().await.unwrap();
    started.elapsed()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// The added time for `body`: visor's median minus the direct median, in
/// microseconds.
async fn added(
    client: &Http,
    direct: SocketAddr,
    through: SocketAddr,
    body: &Bytes,
    rounds: usize,
) -> f64 {
    added_with(client, direct, through, body, rounds, "on")
        .await
        .0
}

/// The added time with `x-visor-transform: transform`, and the direct
/// median (µs).
async fn added_with(
    client: &Http,
    direct: SocketAddr,
    through: SocketAddr,
    body: &Bytes,
    rounds: usize,
    transform: &str,
) -> (f64, f64) {
    let (mut d, mut v) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        d.push(once(client, direct, body).await);
        v.push(send(client, through, body, transform).await);
    }
    let direct = median(d).as_secs_f64() * 1e6;
    (median(v).as_secs_f64() * 1e6 - direct, direct)
}

/// A generated tool-calling agent: a system prompt, the task, then rounds
/// of an assistant tool call and its result (about 1 KB of varied output
/// each); [`Agent::turn`] adds one and gives the request that sends it.
struct Agent {
    messages: Vec<Value>,
}

impl Agent {
    fn new() -> Agent {
        Agent {
            messages: vec![
                json!({"role": "system", "content": "You are a coding agent. Use the tools to inspect and change the repository; run the tests after each change."}),
                json!({"role": "user", "content": "Fix the failing test in tests/test_parser.py and make sure the whole suite passes."}),
            ],
        }
    }

    fn turn(&mut self) -> Bytes {
        let i = self.messages.len() / 2;
        let messages = &mut self.messages;
        let id = format!("call_{i:05}");
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{
            "id": id, "type": "function",
            "function": {"name": "bash", "arguments": format!("{{\"command\":\"sed -n {},{}p src/module_{}.py\"}}", i * 7 % 300, i * 7 % 300 + 20, i % 37)}
        }]}));
        let output: String = (0..20)
            .map(|l| {
                format!(
                    "{:4}  value_{i}_{l} = compute(item_{}, offset={})\n",
                    i * 7 % 300 + l,
                    (i * 31 + l) % 97,
                    l * i % 13
                )
            })
            .collect();
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
        Bytes::from(
            serde_json::to_vec(&json!({"model": "gpt-4o", "messages": messages, "stream": false}))
                .unwrap(),
        )
    }
}

/// The conversations of the corpus with the most turns, each turn's body.
fn longest(dir: &Path, n: usize) -> Vec<(String, Vec<Bytes>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut all: Vec<(String, Vec<Bytes>)> = entries
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| {
            let mut turns: Vec<PathBuf> = std::fs::read_dir(e.path())
                .unwrap()
                .flatten()
                .map(|t| t.path())
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|f| f.to_string_lossy().starts_with("turn-"))
                })
                .collect();
            turns.sort();
            let bodies = turns
                .iter()
                .map(|p| {
                    // Chat Completions bodies as the agent sent them, sent
                    // whole (a stream asked for is answered whole by the
                    // mock all the same).
                    let mut v: Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
                    v["stream"] = Value::Bool(false);
                    Bytes::from(serde_json::to_vec(&v).unwrap())
                })
                .collect();
            (e.file_name().to_string_lossy().into_owned(), bodies)
        })
        .collect();
    all.sort_by_key(|(_, t)| std::cmp::Reverse(t.len()));
    all.truncate(n);
    all
}

fn main() {
    let rounds: usize = std::env::var("TURNS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    let sample: usize = std::env::var("TURNS_SAMPLE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let data = std::env::temp_dir().join(format!("visor-turns-{}", std::process::id()));
        let up = mock().await;
        let through = visor(up, &data).await;
        let client: Http = Client::builder(TokioExecutor::new()).build_http();
        println!("added latency per turn, median of {rounds} each way (µs; visor minus direct), 127.0.0.1, this process");
        let dir = corpus_dir();
        let corpus = longest(&dir, 3);
        if corpus.is_empty() {
            println!("corpus: {} not found: the real conversations are not measured", dir.display());
        }
        for (name, turns) in &corpus {
            let mut row = Vec::new();
            for body in turns {
                row.push((body.len(), added(&client, up, through, body, rounds).await));
            }
            println!("{name} ({} turns):", turns.len());
            for (i, (len, us)) in row.iter().enumerate() {
                if i % 5 == 0 || i + 1 == row.len() {
                    println!("  turn {:>4} {:>9} bytes  {:>8.1} µs", i + 1, len, us);
                }
            }
        }
        // Every turn goes through visor once, as the agent sends it; every
        // `sample`th is measured.
        // Beside each: the request straight to the mock (what one more
        // hop that holds the body must at least pay again: it is received
        // whole, then sent) and visor's added time with its transforms off.
        println!("generated agent (1,000 turns, every {sample}th measured; direct, and added with x-visor-transform: off):");
        let mut agent = Agent::new();
        for n in 1..=1000 {
            let body = agent.turn();
            if n == 1 || n % sample.max(1) == 0 {
                let us = added(&client, up, through, &body, rounds).await;
                let (off, direct) = added_with(&client, up, through, &body, rounds, "off").await;
                println!(
                    "  turn {:>4} {:>9} bytes  {:>8.1} µs   direct {:>8.1} µs   off {:>8.1} µs",
                    n,
                    body.len(),
                    us,
                    direct,
                    off
                );
            } else {
                once(&client, through, &body).await;
            }
        }
        let _ = std::fs::remove_dir_all(&data);
    });
    transform_cpu(&longest(&corpus_dir(), 3), sample, rounds);
}

/// The plan the shipped config gives a model that can see, for Chat.
fn plan() -> Plan {
    let cfg = visor::config::Config::from_toml(
        include_str!("../config/visor.toml"),
        Path::new("config/visor.toml"),
        &|_| None,
    )
    .unwrap();
    Plan {
        shape: Shape::Chat,
        vision: true,
        describe: false,
        rules: Rules::new(&cfg.images, &cfg.dedup, None, None),
        takes: Takes::ALL,
        query_aware: false,
        fit: Limits::NONE,
    }
}

/// One turn's transform CPU, read in full and continued (µs, best of
/// `rounds`); panics when the two bodies differ.
fn both(body: &[u8], plan: &Plan, states: &DedupStates, rounds: usize) -> (f64, f64) {
    let full_read = || match visor::transform::walk(body, plan) {
        Ok(mut s) => {
            s.resolve(body);
            s.finish(body, &[]).body
        }
        Err(done) => done.body,
    };
    let mut full = f64::MAX;
    let mut expected = None;
    for _ in 0..rounds {
        let t = Instant::now();
        expected = Some(full_read());
        full = full.min(t.elapsed().as_secs_f64() * 1e6);
    }
    // Continued: the state the turn before left is taken, and this turn's
    // put back; a round after the first continues this turn's own state
    // (a retry: no new message), so the first round is the figure.
    let t = Instant::now();
    let got = states.rewrite(body, plan, 0).0.body;
    let continued = t.elapsed().as_secs_f64() * 1e6;
    assert!(
        got == expected.unwrap(),
        "a continued turn differs from its full read"
    );
    (full, continued)
}

fn transform_cpu(corpus: &[(String, Vec<Bytes>)], sample: usize, rounds: usize) {
    let plan = plan();
    println!(
        "transform CPU per turn on one thread (µs): read in full, continued from the turn before's state"
    );
    for (name, turns) in corpus {
        let states = DedupStates::new(128 << 20).unwrap();
        let row: Vec<(usize, f64, f64)> = turns
            .iter()
            .map(|b| {
                let (f, c) = both(b, &plan, &states, rounds);
                (b.len(), f, c)
            })
            .collect();
        println!("{name}:");
        for (i, (len, f, c)) in row.iter().enumerate() {
            if i % 10 == 0 || i + 1 == row.len() {
                println!(
                    "  turn {:>4} {:>9} bytes  full {:>8.1}  continued {:>8.1}  ({:.1}x)",
                    i + 1,
                    len,
                    f,
                    c,
                    f / c
                );
            }
        }
    }
    let states = DedupStates::new(128 << 20).unwrap();
    let mut agent = Agent::new();
    println!("generated agent:");
    for n in 1..=1000 {
        let body = agent.turn();
        if n == 1 || n % sample.max(1) == 0 {
            let (f, c) = both(&body, &plan, &states, rounds);
            println!(
                "  turn {:>4} {:>9} bytes  full {:>8.1}  continued {:>8.1}  ({:.1}x)",
                n,
                body.len(),
                f,
                c,
                f / c
            );
        } else {
            states.rewrite(&body, &plan, 0);
        }
    }
}
