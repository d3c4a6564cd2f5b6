//! Fallbacks: a route's next upstream on a failure before the response
//! head, within the retry budget and the per-upstream breakers; over real
//! loopback sockets to mock upstreams.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use support::*;
use tokio::time::Instant;

const BOUND: Duration = Duration::from_secs(10);

/// `primary` (with `fallbacks = ["backup"]` and `more` keys) then `backup`
/// (with a key of its own: the client's is never sent to a fallback on
/// another host), after `extra` (server or retries sections).
fn chain(primary: &MockUpstream, backup: &MockUpstream, extra: &str, more: &str) -> String {
    format!(
        "{extra}\n{}fallbacks = [\"backup\"]\n{more}\n{}api_key = \"key-backup\"\n",
        primary.upstream_toml("primary"),
        backup.upstream_toml("backup")
    )
}

async fn retries(visor: &Visor, upstream: &str, reason: &str) -> Option<f64> {
    metric(
        &visor.metrics().await,
        "visor_retries_total",
        &[("upstream", upstream), ("reason", reason)],
    )
}

async fn state(visor: &Visor, upstream: &str) -> Option<f64> {
    metric(
        &visor.metrics().await,
        "visor_upstream_state",
        &[("upstream", upstream)],
    )
}

async fn answered(visor: &Visor, upstream: &str, status: &str) -> Option<f64> {
    metric(
        &visor.metrics().await,
        "visor_requests_total",
        &[("upstream", upstream), ("status", status)],
    )
}

/// Sends one chat through a visor whose primary plays `fault`; the backup
/// answers. Returns what the metrics say of it.
async fn falls_back_on(fault: Fault, extra: &str, reason: &str) {
    let primary = MockUpstream::builder().fault(fault).start().await;
    let backup = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::start(&chain(&primary, &backup, extra, "")).await;
    let (status, _, body) = post_chat(&visor, CHAT).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(backup.count(), 1);
    assert_eq!(retries(&visor, "primary", reason).await, Some(1.0));
    assert_eq!(answered(&visor, "backup", "200").await, Some(1.0));
    assert_eq!(answered(&visor, "primary", "200").await, None);
    // One failure is far from opening the breaker.
    assert_eq!(state(&visor, "primary").await, Some(0.0));
    assert_eq!(state(&visor, "backup").await, Some(0.0));
}

#[tokio::test]
async fn a_refused_connect_falls_back() {
    falls_back_on(Fault::RefuseConnect, "", "connect").await;
}

#[tokio::test]
async fn a_close_before_the_head_falls_back() {
    falls_back_on(Fault::CloseBeforeHead, "", "reset").await;
}

#[tokio::test]
async fn a_5xx_falls_back() {
    falls_back_on(
        Fault::Status(503, r#"{"error":"overloaded"}"#),
        "",
        "status_5xx",
    )
    .await;
}

/// Paused time (one worker): the fallback goes out at the first-byte
/// deadline of the primary, at no cost.
#[tokio::test(start_paused = true)]
async fn a_first_byte_timeout_falls_back_at_the_deadline() {
    let primary = MockUpstream::builder()
        .fault(Fault::NeverAnswer)
        .start()
        .await;
    let backup = MockUpstream::start(|_| chat_ok()).await;
    let extra = "[server]\nworkers = 1\nfirst_byte_timeout_secs = 7\n";
    let visor = Visor::start(&chain(&primary, &backup, extra, "")).await;
    let started = Instant::now();
    let (status, _, _) = post_chat(&visor, CHAT).await;
    assert_eq!(status, 200);
    assert_at(started.elapsed(), Duration::from_secs(7));
    assert!(primary.wait_closed(1, PAUSED_BOUND).await, "abandoned");
    assert_eq!(
        retries(&visor, "primary", "first_byte_timeout").await,
        Some(1.0)
    );
    assert_eq!(
        upstream_errors(&visor, "first_byte_timeout").await,
        Some(1.0)
    );
}

/// A 429 falls back at once; its `Retry-After` (an hour) keeps the primary
/// skipped for 10 s at most, then one request tries it again.
#[tokio::test(start_paused = true)]
async fn a_429_falls_back_and_its_retry_after_is_honoured_up_to_the_bound() {
    let primary = MockUpstream::start(|_| Reply::Full {
        status: 429,
        headers: vec![
            ("content-type", "application/json".to_owned()),
            ("retry-after", "3600".to_owned()),
        ],
        body: r#"{"error":{"code":"rate_limit_exceeded"}}"#.into(),
    })
    .await;
    let backup = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::start(&chain(&primary, &backup, "[server]\nworkers = 1\n", "")).await;
    assert_eq!(post_chat(&visor, CHAT).await.0, 200);
    assert_eq!((primary.count(), backup.count()), (1, 1));
    assert_eq!(retries(&visor, "primary", "status_429").await, Some(1.0));
    // Held: the next request goes straight to the backup.
    assert_eq!(post_chat(&visor, CHAT).await.0, 200);
    assert_eq!((primary.count(), backup.count()), (1, 2));
    assert_eq!(state(&visor, "primary").await, Some(1.0));
    tokio::time::advance(Duration::from_secs(9)).await;
    assert_eq!(post_chat(&visor, CHAT).await.0, 200);
    assert_eq!(primary.count(), 1, "still held at 9 s");
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(post_chat(&visor, CHAT).await.0, 200);
    assert_eq!(primary.count(), 2, "probed after the 10 s bound");
    assert_eq!(backup.count(), 4);
}

/// The last upstream of a chain answers as it does: its 5xx reaches the
/// client (no retry beyond the chain).
#[tokio::test]
async fn when_every_upstream_fails_the_last_answer_is_passed_back() {
    let primary = MockUpstream::builder()
        .fault(Fault::RefuseConnect)
        .start()
        .await;
    let backup = MockUpstream::builder()
        .fault(Fault::Status(500, r#"{"error":"backup down"}"#))
        .start()
        .await;
    let visor = Visor::start(&chain(&primary, &backup, "", "")).await;
    let (status, _, body) = post_chat(&visor, CHAT).await;
    assert_eq!(status, 500);
    assert_eq!(body, r#"{"error":"backup down"}"#);
    assert_eq!(answered(&visor, "backup", "500").await, Some(1.0));
    assert_eq!(retries(&visor, "backup", "status_5xx").await, None);
}

/// Once a response head came back, nothing is retried: a stream cut
/// mid-way reaches the client cut.
#[tokio::test]
async fn a_stream_cut_after_its_first_bytes_is_not_retried() {
    let primary = MockUpstream::builder()
        .fault(Fault::CutAfterChunks(2))
        .start()
        .await;
    let backup = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::start(&chain(&primary, &backup, "", "")).await;
    let resp = open_stream(&visor).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let (text, end) = read_stream(&mut body, BOUND).await;
    assert!(text.contains("t1"), "{text}");
    assert_cut(&end);
    assert_eq!(backup.count(), 0);
    let m = visor.metrics().await;
    assert_eq!(metric(&m, "visor_retries_total", &[]), None);
}

/// The backup gets the transformed body byte for byte, and its own key,
/// never the primary's.
#[tokio::test]
async fn the_fallback_gets_the_same_body_and_its_own_credential() {
    let primary = MockUpstream::builder()
        .fault(Fault::Status(502, "{}"))
        .start()
        .await;
    let backup = MockUpstream::start(|_| chat_ok()).await;
    let toml = format!(
        "{}api_key = \"key-primary\"\nfallbacks = [\"backup\"]\n{}api_key = \"key-backup\"\n",
        primary.upstream_toml("primary"),
        backup.upstream_toml("backup")
    );
    let visor = Visor::start(&toml).await;
    // Chat with an observation sent again whole: dedup rewrites it.
    let long: String = (0..8)
        .map(|i| format!("line {i} of a tool's output, long enough to be worth a note\n"))
        .collect();
    let body = serde_json::json!({
        "model": "m",
        "messages": [
            {"role": "user", "content": "run the tool twice"},
            {"role": "user", "content": long},
            {"role": "user", "content": long},
        ],
    })
    .to_string();
    let mut req = post_json(&visor.url("/v1/chat/completions"), body.clone());
    req.headers_mut()
        .insert("authorization", "Bearer client-key".parse().unwrap());
    let (status, _, _) = send(req).await;
    assert_eq!(status, 200);
    let (p, b) = (&primary.recorded()[0], &backup.recorded()[0]);
    assert_eq!(p.body, b.body, "the same transformed body");
    assert_ne!(p.body, body.as_bytes(), "dedup rewrote it");
    assert_eq!(p.headers["authorization"], "Bearer key-primary");
    assert_eq!(b.headers["authorization"], "Bearer key-backup");
    assert_eq!(p.headers["x-request-id"], b.headers["x-request-id"]);
    // A body visor streams (not transformed) is held for the replay.
    let emb = r#"{"model":"e","input":"hello"}"#;
    let (status, _, _) = send(post_json(&visor.url("/v1/embeddings"), emb)).await;
    assert_eq!(status, 200);
    assert_eq!(primary.recorded()[1].body, emb.as_bytes());
    assert_eq!(backup.recorded()[1].body, emb.as_bytes());
    assert_eq!(backup.recorded()[1].uri.path(), "/v1/embeddings");
}

/// With no share and a floor of one retry a minute, the second failing
/// request gets the primary's answer.
#[tokio::test]
async fn the_budget_stops_retries_once_spent() {
    let primary = MockUpstream::builder()
        .fault(Fault::Status(500, r#"{"error":"primary down"}"#))
        .start()
        .await;
    let backup = MockUpstream::start(|_| chat_ok()).await;
    let extra =
        "[retries]\nbudget_percent = 0\nmin_retries_per_minute = 1\nbreaker_failures = 100\n";
    let visor = Visor::start(&chain(&primary, &backup, extra, "")).await;
    assert_eq!(post_chat(&visor, CHAT).await.0, 200);
    let (status, _, body) = post_chat(&visor, CHAT).await;
    assert_eq!(status, 500);
    assert_eq!(body, r#"{"error":"primary down"}"#);
    assert_eq!((primary.count(), backup.count()), (2, 1));
    assert_eq!(retries(&visor, "primary", "status_5xx").await, Some(1.0));
    assert_eq!(answered(&visor, "primary", "500").await, Some(1.0));
}

/// Two failures open the primary's breaker (requests skip it); after the
/// cooldown one probe goes to it, and a good answer closes it.
#[tokio::test(start_paused = true)]
async fn the_breaker_opens_skips_probes_and_closes() {
    let failing = Arc::new(AtomicBool::new(true));
    let f = failing.clone();
    let primary = MockUpstream::start(move |_| match f.load(Ordering::SeqCst) {
        true => Reply::json(500, "{}"),
        false => chat_ok(),
    })
    .await;
    let backup = MockUpstream::start(|_| chat_ok()).await;
    let extra =
        "[server]\nworkers = 1\n[retries]\nbreaker_failures = 2\nbreaker_cooldown_secs = 30\n";
    let visor = Visor::start(&chain(&primary, &backup, extra, "")).await;
    for _ in 0..2 {
        assert_eq!(post_chat(&visor, CHAT).await.0, 200);
    }
    assert_eq!(primary.count(), 2);
    assert_eq!(state(&visor, "primary").await, Some(1.0), "open");
    // Open: skipped.
    for _ in 0..3 {
        assert_eq!(post_chat(&visor, CHAT).await.0, 200);
    }
    assert_eq!((primary.count(), backup.count()), (2, 5));
    assert_eq!(retries(&visor, "primary", "status_5xx").await, Some(2.0));
    // After the cooldown, one probe; it fails: open again.
    tokio::time::advance(Duration::from_secs(30)).await;
    assert_eq!(post_chat(&visor, CHAT).await.0, 200);
    assert_eq!(primary.count(), 3);
    assert_eq!(state(&visor, "primary").await, Some(1.0));
    assert_eq!(post_chat(&visor, CHAT).await.0, 200);
    assert_eq!(primary.count(), 3, "open again after a failed probe");
    // The next probe succeeds: closed, and the primary takes the traffic.
    failing.store(false, Ordering::SeqCst);
    tokio::time::advance(Duration::from_secs(30)).await;
    assert_eq!(post_chat(&visor, CHAT).await.0, 200);
    assert_eq!(primary.count(), 4);
    assert_eq!(state(&visor, "primary").await, Some(0.0), "closed");
    assert_eq!(post_chat(&visor, CHAT).await.0, 200);
    assert_eq!((primary.count(), backup.count()), (5, 7));
}

/// Half-open shows while the probe is out; a probe that times out opens
/// the breaker again (and its request still falls back).
#[tokio::test(start_paused = true)]
async fn the_breaker_is_half_open_while_its_probe_is_out() {
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let c = calls.clone();
    let primary = MockUpstream::start(move |_| match c.fetch_add(1, Ordering::SeqCst) {
        0 => Reply::json(500, "{}"),
        _ => Reply::Hang,
    })
    .await;
    let backup = MockUpstream::start(|_| chat_ok()).await;
    let extra = "[server]\nworkers = 1\nfirst_byte_timeout_secs = 10\n[retries]\nbreaker_failures = 1\nbreaker_cooldown_secs = 5\n";
    let visor = Arc::new(Visor::start(&chain(&primary, &backup, extra, "")).await);
    assert_eq!(post_chat(&visor, CHAT).await.0, 200);
    assert_eq!(state(&visor, "primary").await, Some(1.0));
    tokio::time::advance(Duration::from_secs(5)).await;
    let v = visor.clone();
    let probe = tokio::spawn(async move { post_chat(&v, CHAT).await.0 });
    assert!(primary.wait_requests(2, PAUSED_BOUND).await);
    assert_eq!(state(&visor, "primary").await, Some(2.0), "half-open");
    // Another request meanwhile skips it.
    assert_eq!(post_chat(&visor, CHAT).await.0, 200);
    assert_eq!(primary.count(), 2);
    assert_eq!(probe.await.unwrap(), 200, "the probe's request fell back");
    assert_eq!(state(&visor, "primary").await, Some(1.0), "open again");
    assert_eq!(backup.count(), 3);
    assert_eq!(
        retries(&visor, "primary", "first_byte_timeout").await,
        Some(1.0)
    );
}

#[tokio::test]
async fn without_fallbacks_nothing_changes() {
    let mock = MockUpstream::builder()
        .fault(Fault::RefuseConnect)
        .start()
        .await;
    let visor = Visor::for_mock(&mock, "").await;
    assert_error(&post_chat(&visor, CHAT).await, 502, "upstream_unreachable");
    let m = visor.metrics().await;
    assert!(!m.contains("visor_upstream_state{"), "{m}");
    assert!(!m.contains("visor_retries_total{"), "{m}");
    assert_eq!(
        metric(
            &m,
            "visor_upstream_errors_total",
            &[("upstream", "mock"), ("kind", "connect")]
        ),
        Some(1.0)
    );
}

// ------------------------------------------------------------- visor check

fn check_output(name: &str, text: &str) -> (bool, String, String) {
    let path = temp_config(name, text);
    let out = visor()
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn upstream(name: &str, more: &str) -> String {
    format!("[[upstream]]\nname = \"{name}\"\nbase_url = \"https://{name}.example/v1\"\n{more}\n")
}

#[test]
fn check_prints_each_routes_chain() {
    let text = format!(
        "{}{}{}",
        upstream(
            "main",
            "models = [\"gpt-*\"]\nfallbacks = [\"azure\", \"local\"]"
        ),
        upstream("azure", "fallbacks = [\"local\"]\napi_key = \"k-azure\""),
        upstream("local", "api_key = \"k-local\"")
    );
    let (ok, out, err) = check_output("fallback-chain", &text);
    assert!(ok, "{err}");
    assert!(out.contains("chain: main → azure → local"), "{out}");
    assert!(out.contains("chain: azure → local"), "{out}");
    assert!(!out.contains("chain: local"), "{out}");
    assert!(
        out.contains("retries: at most 20% of the last minute's requests"),
        "{out}"
    );
    assert!(
        out.contains("opens after 5 consecutive failures for 30s"),
        "{out}"
    );
}

#[test]
fn check_refuses_bad_fallbacks() {
    let cases = [
        (
            upstream("a", "fallbacks = [\"ghost\"]"),
            "upstream[0].fallbacks[0]: \"ghost\" — no [[upstream]] has this name",
        ),
        (
            upstream("a", "fallbacks = [\"a\"]"),
            "upstream[0].fallbacks[0]: \"a\" — an upstream cannot fall back to itself",
        ),
        (
            format!(
                "{}{}",
                upstream("a", "fallbacks = [\"b\"]"),
                upstream("b", "fallbacks = [\"a\"]")
            ),
            "fallbacks form a cycle: a → b → a",
        ),
        (
            format!(
                "{}{}",
                upstream("openai", "fallbacks = [\"anthropic\"]"),
                upstream("anthropic", "auth = \"x-api-key\"")
            ),
            "speaks Anthropic (auth = \"x-api-key\"), but \"openai\" speaks OpenAI (auth = \"bearer\"); visor never translates between API shapes",
        ),
        (
            format!(
                "{}{}",
                upstream("openai", "fallbacks = [\"other\"]"),
                upstream("other", "")
            ),
            "upstream[0].fallbacks[0]: \"other\" has no api_key, so it would be sent the client's own key, which the client sent for \"openai\"",
        ),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let (ok, _, err) = check_output(&format!("bad-fallback-{i}"), text);
        assert!(!ok, "{text}");
        assert!(err.contains(want), "{err}");
    }
}

/// A streamed body over the replay limit (4 MiB) is not held: it goes to
/// the routed upstream alone, whose answer the client gets.
#[tokio::test]
async fn a_streamed_body_over_the_replay_limit_does_not_fall_back() {
    let primary = MockUpstream::builder()
        .fault(Fault::Status(500, r#"{"error":"primary down"}"#))
        .start()
        .await;
    let backup = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::start(&chain(&primary, &backup, "", "")).await;
    let big = format!(
        r#"{{"model":"e","input":"{}"}}"#,
        "x".repeat(4 * 1024 * 1024 + 1)
    );
    let (status, _, body) = send(post_json(&visor.url("/v1/embeddings"), big.clone())).await;
    assert_eq!(status, 500);
    assert_eq!(body, r#"{"error":"primary down"}"#);
    assert_eq!(backup.count(), 0);
    assert_eq!(primary.recorded()[0].body.len(), big.len());
}

/// `visor check` with `[[key]]`s and no `server.api_keys`: the keys are
/// proxy keys, and a client's own provider key is not forwarded.
#[test]
fn check_counts_key_entries_as_proxy_keys() {
    let text = format!(
        "{}[[key]]\nname = \"team-a\"\nkey = \"sk-team-a\"\n",
        upstream("openai", "")
    );
    let (ok, out, err) = check_output("key-entries-only", &text);
    assert!(ok, "{err}");
    assert!(
        out.contains("proxy keys: 1 configured (0 in server.api_keys, 1 in [[key]])"),
        "{out}"
    );
    assert!(
        out.contains("a client's own provider key is refused with 401"),
        "{out}"
    );
    assert!(out.contains("(no credential)"), "{out}");
    assert!(
        !out.contains("sk-team-a"),
        "the key itself is never printed"
    );
    // Without any: clients' keys are forwarded, and said so.
    let (ok, out, _) = check_output("no-keys", &upstream("openai", ""));
    assert!(ok);
    assert!(out.contains("proxy keys: none (clients' own"), "{out}");
    assert!(out.contains("(client's key forwarded)"), "{out}");
}
