//! `[[key]]` limits through the real proxy: a model outside a key's
//! globs is 403, a key over its requests or tokens per minute gets 429 with
//! `Retry-After` and the `x-ratelimit-*` headers, `server.api_keys` stay
//! unlimited, metrics name keys by name, never by key; two visors on one
//! real `redis-server` share a limit, and with Redis gone each limits on its
//! own and says so. Windows are the wall clock's minutes: a test that could
//! straddle the end of one first waits (bounded) for the next to begin.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::*;

const KEY_A: &str = "sk-team-a-SECRET";
const KEY_B: &str = "sk-team-b-SECRET";

/// Waits until at least `need` seconds are left in the current minute.
async fn room_in_this_minute(need: u64) {
    let left = || {
        60 - SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs()
            % 60
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(need + 2);
    while left() < need {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn keyed(url: &str, key: &str, model: &str) -> Request<Full<Bytes>> {
    Request::post(url)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {key}"))
        .body(Full::new(Bytes::from(format!(
            r#"{{"model":"{model}","messages":[{{"role":"user","content":"hello"}}]}}"#
        ))))
        .unwrap()
}

fn keys(extra: &str) -> String {
    format!(
        "[server]\napi_keys = [\"sk-admin\"]\n\
         [[key]]\nname = \"team-a\"\nkey = \"{KEY_A}\"\nrequests_per_minute = 2\nmodels = [\"gpt-*\"]\n{extra}"
    )
}

#[tokio::test]
async fn a_key_over_its_requests_per_minute_gets_429_with_the_headers() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, &keys("")).await;
    let url = visor.url("/v1/chat/completions");
    room_in_this_minute(10).await;
    for left in ["1", "0"] {
        let (status, h, body) = send(keyed(&url, KEY_A, "gpt-4o")).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(h["x-ratelimit-limit-requests"], "2");
        assert_eq!(h["x-ratelimit-remaining-requests"], left);
    }
    let (status, h, body) = send(keyed(&url, KEY_A, "gpt-4o")).await;
    assert_eq!(status, 429);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert_eq!(h["x-ratelimit-limit-requests"], "2");
    assert_eq!(h["x-ratelimit-remaining-requests"], "0");
    let reset: u64 = h["x-ratelimit-reset-requests"]
        .to_str()
        .unwrap()
        .trim_end_matches('s')
        .parse()
        .unwrap();
    assert!((1..=60).contains(&reset));
    let retry: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
    assert_eq!(retry, reset);
    assert_eq!(mock.recorded().len(), 2, "the refused request never left");

    // server.api_keys are not limited.
    for _ in 0..3 {
        let (status, _, _) = send(keyed(&url, "sk-admin", "gpt-4o")).await;
        assert_eq!(status, 200);
    }
    // A model outside the key's globs: 403.
    let (status, _, body) = send(keyed(&url, KEY_A, "claude-sonnet-4")).await;
    assert_eq!(status, 403);
    assert!(String::from_utf8_lossy(&body).contains("model_not_allowed"));
    // Also on an endpoint whose body visor streams (its model read for it).
    let (status, _, _) = send(
        Request::post(visor.url("/v1/embeddings"))
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {KEY_A}"))
            .body(Full::new(Bytes::from_static(
                br#"{"model":"text-embedding-3-small","input":"hi"}"#,
            )))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 403);
    // No key at all: 401 as before.
    let (status, _, _) = send(post_json(&url, CHAT)).await;
    assert_eq!(status, 401);

    let m = visor.metrics().await;
    assert_eq!(
        metric(
            &m,
            "visor_ratelimited_total",
            &[("key", "team-a"), ("limit", "requests")]
        ),
        Some(1.0)
    );
    assert!(!m.contains("SECRET"), "metrics name keys by name");
}

#[tokio::test]
async fn tokens_per_minute_are_estimated_from_the_body() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(
        &mock,
        &format!("[[key]]\nname = \"small\"\nkey = \"{KEY_A}\"\ntokens_per_minute = 300\n"),
    )
    .await;
    let url = visor.url("/v1/chat/completions");
    room_in_this_minute(10).await;
    // 800 bytes of text: about 200 tokens of the 300 a minute — it goes; the
    // next does not fit in the 100 left, and spends none of them.
    let big = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "word ".repeat(160)
    );
    let req = |body: &str| {
        Request::post(&url)
            .header("content-type", "application/json")
            .header("x-api-key", KEY_A)
            .body(Full::new(Bytes::from(body.to_owned())))
            .unwrap()
    };
    let (status, h, _) = send(req(&big)).await;
    assert_eq!(status, 200);
    // Every answer to a limited key says where it stands, not only a 429.
    assert_eq!(h["x-ratelimit-limit-tokens"], "300");
    let after_one: u64 = h["x-ratelimit-remaining-tokens"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((50..=100).contains(&after_one), "{after_one} left");
    assert!(
        h.get("x-ratelimit-limit-requests").is_none(),
        "no request limit"
    );
    let (status, h, body) = send(req(&big)).await;
    assert_eq!(status, 429);
    // The message names the numbers: what the request needs, what is left.
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("this request is about 2")
            && message.contains("tokens per minute are left")
            && message.contains("of its 300"),
        "{message}"
    );
    assert_eq!(h["x-ratelimit-limit-tokens"], "300");
    let left: u64 = h["x-ratelimit-remaining-tokens"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((50..=100).contains(&left), "{left} left");
    // A small one still fits.
    let (status, _, _) = send(req(r#"{"model":"m","messages":[]}"#)).await;
    assert_eq!(status, 200);
    assert_eq!(mock.count(), 2);
}

/// A body sent without its length (chunked) is read whole and counted
/// like any other: it is not a free request.
#[tokio::test]
async fn a_chunked_body_is_counted_against_the_tokens() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(
        &mock,
        &format!("[[key]]\nname = \"small\"\nkey = \"{KEY_A}\"\ntokens_per_minute = 2000\n"),
    )
    .await;
    room_in_this_minute(10).await;
    // A body of `tokens` × 4 bytes sent in chunks of 1 KiB, no length: the
    // status and the tokens left.
    let chunked = |tokens: usize| {
        let addr = visor.addr;
        async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let body = format!(
                r#"{{"model":"e","input":"{}"}}"#,
                "x".repeat(tokens * 4 - 24)
            );
            let mut raw = format!(
                "POST /v1/embeddings HTTP/1.1\r\nHost: v\r\nConnection: close\r\nContent-Type: application/json\r\nAuthorization: Bearer {KEY_A}\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            .into_bytes();
            for c in body.as_bytes().chunks(1024) {
                raw.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
                raw.extend_from_slice(c);
                raw.extend_from_slice(b"\r\n");
            }
            raw.extend_from_slice(b"0\r\n\r\n");
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(&raw).await.unwrap();
            let mut got = Vec::new();
            tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut got))
                .await
                .unwrap()
                .unwrap();
            let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
            let status: u16 = text.split(' ').nth(1).unwrap().parse().unwrap();
            let left = text
                .lines()
                .find_map(|l| l.strip_prefix("x-ratelimit-remaining-tokens: "))
                .map(|v| v.trim().to_owned());
            (status, left)
        }
    };
    // 13 000 tokens: more than the key's whole minute.
    assert_eq!(chunked(13_000).await.0, 429);
    // 900 twice fit in 2000; a third does not.
    assert_eq!(chunked(900).await.0, 200);
    assert_eq!(chunked(900).await.0, 200);
    assert_eq!(chunked(900).await, (429, Some("200".to_owned())));
    assert_eq!(mock.count(), 2);
    assert_eq!(mock.recorded()[0].body.len(), 3600, "sent whole");
}

/// The key is charged for the body visor sends (the session's history
/// inserted), not the client's few bytes.
#[tokio::test]
async fn the_body_sent_is_what_the_key_is_charged() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(
        &mock,
        &format!("[[key]]\nname = \"small\"\nkey = \"{KEY_A}\"\ntokens_per_minute = 2000\n"),
    )
    .await;
    room_in_this_minute(10).await;
    let req = |content: &str| {
        let body =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": content}]});
        Request::post(visor.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {KEY_A}"))
            .header("x-visor-session", "charged")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap()
    };
    // About 1200 tokens, stored in the session.
    let (status, _, _) = send(req(&"word ".repeat(960))).await;
    assert_eq!(status, 200);
    // A few bytes from the client, but the history goes with them: 1200
    // more tokens do not fit in the 800 left.
    let (status, h, body) = send(req("and then?")).await;
    assert_eq!(status, 429, "{}", String::from_utf8_lossy(&body));
    assert_eq!(error_code(&body), "rate_limit_exceeded");
    let left: u64 = h["x-ratelimit-remaining-tokens"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (700..=800).contains(&left),
        "nothing of the refused one spent: {left}"
    );
    assert_eq!(mock.count(), 1, "the refused request was not sent");
}

#[tokio::test]
async fn a_default_key_limits_requests_that_send_none() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(
        &mock,
        "[[key]]\nname = \"anyone\"\nrequests_per_minute = 1\n",
    )
    .await;
    let url = visor.url("/v1/chat/completions");
    room_in_this_minute(10).await;
    assert_eq!(send(post_json(&url, CHAT)).await.0, 200);
    assert_eq!(send(post_json(&url, CHAT)).await.0, 429);
}

#[cfg(feature = "redis")]
fn redis_config(redis: &RedisServer) -> String {
    format!(
        "{}\n[store]\nbackend = \"{}\"\nprefix = \"visor-limits-{}:\"\n",
        keys(""),
        redis.url(),
        std::process::id()
    )
}

/// Redis frozen and let go within the minute: a replica that lost it goes
/// on from the counts it last had from it (not from zero), and what it
/// counted alone is added to the shared counters when Redis answers again,
/// so the other replica sees it.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_lost_redis_for_a_while_neither_forgets_nor_hides_its_counts() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let config = redis_config(&redis).replace("requests_per_minute = 2", "requests_per_minute = 6");
    let a = Visor::for_mock(&mock, &config).await;
    let b = Visor::for_mock(&mock, &config).await;
    room_in_this_minute(25).await;
    let (ua, ub) = (a.url("/v1/chat/completions"), b.url("/v1/chat/completions"));
    for _ in 0..3 {
        assert_eq!(send(keyed(&ua, KEY_A, "gpt-4o")).await.0, 200);
    }
    redis.freeze();
    // Three of six spent when Redis went quiet: three more, not six.
    let mut ok = 0;
    for _ in 0..5 {
        if send(keyed(&ua, KEY_A, "gpt-4o")).await.0 == 200 {
            ok += 1;
        }
    }
    assert_eq!(ok, 3, "a replica without its store went on from zero");
    redis.resume();
    // Once replica a has Redis again, its next request carries what it
    // counted alone: the window is spent for both replicas.
    let ready = |v: &Visor| {
        Request::get(v.url("/readyz"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let (_, _, body) = send(ready(&a)).await;
        if serde_json::from_slice::<serde_json::Value>(&body).unwrap()["status"] == "ready" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "store not back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(send(keyed(&ua, KEY_A, "gpt-4o")).await.0, 429);
    assert_eq!(
        send(keyed(&ub, KEY_A, "gpt-4o")).await.0,
        429,
        "replica b did not see a's counts"
    );
    assert_eq!(mock.count(), 6);
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_on_one_redis_share_a_limit_and_limit_alone_without_it() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let config = redis_config(&redis);
    let a = Visor::for_mock(&mock, &config).await;
    let b = Visor::for_mock(&mock, &config).await;
    room_in_this_minute(15).await;
    let (ua, ub) = (a.url("/v1/chat/completions"), b.url("/v1/chat/completions"));
    assert_eq!(send(keyed(&ua, KEY_A, "gpt-4o")).await.0, 200);
    assert_eq!(send(keyed(&ub, KEY_A, "gpt-4o")).await.0, 200);
    // Two of two spent, across the replicas.
    assert_eq!(send(keyed(&ua, KEY_A, "gpt-4o")).await.0, 429);
    assert_eq!(send(keyed(&ub, KEY_A, "gpt-4o")).await.0, 429);
    let m = a.metrics().await;
    assert_eq!(metric(&m, "visor_ratelimit_shared", &[]), Some(1.0));

    // Redis gone: each replica limits on its own (never open), and says so.
    redis.stop();
    let c = Visor::for_mock(&mock, &config).await;
    let uc = c.url("/v1/chat/completions");
    room_in_this_minute(10).await;
    assert_eq!(send(keyed(&uc, KEY_A, "gpt-4o")).await.0, 200);
    assert_eq!(send(keyed(&uc, KEY_A, "gpt-4o")).await.0, 200);
    assert_eq!(send(keyed(&uc, KEY_A, "gpt-4o")).await.0, 429);
    let m = c.metrics().await;
    assert_eq!(metric(&m, "visor_ratelimit_shared", &[]), Some(0.0));
    assert!(metric(&m, "visor_ratelimit_local_checks_total", &[]).unwrap() >= 1.0);
    let (_, _, body) = send(
        Request::get(c.url("/readyz"))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    let r: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(r["status"], "degraded", "{r}");

    // The gauge follows the store, not only a key's next check: replica a,
    // which checked no key since, says 0 once its store is found down (its
    // /readyz asks), and 1 again when Redis is back.
    let readyz = |v: &Visor| {
        Request::get(v.url("/readyz"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    send(readyz(&a)).await;
    let m = a.metrics().await;
    assert_eq!(metric(&m, "visor_ratelimit_shared", &[]), Some(0.0), "{m}");
    redis.restart();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let (_, _, body) = send(readyz(&a)).await;
        let r: serde_json::Value = serde_json::from_slice(&body).unwrap();
        if r["status"] == "ready" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "store not back: {r}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = a.metrics().await;
    assert_eq!(metric(&m, "visor_ratelimit_shared", &[]), Some(1.0), "{m}");
}

#[tokio::test]
async fn the_context_a_key_sends_again_is_counted_by_its_name() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(
        &mock,
        &format!("[[key]]\nname = \"team-a\"\nkey = \"{KEY_A}\"\n"),
    )
    .await;
    // The same 12-line file read twice, and 201 messages in all.
    let file: String = (0..12)
        .map(|i| format!("line {i} of a file the agent reads again and again\n"))
        .collect();
    // (The first user message is the task: never a source of a note.)
    let mut messages = vec![
        serde_json::json!({"role": "user", "content": "read the file, then again at the end"}),
        serde_json::json!({"role": "user", "content": file}),
    ];
    for i in 0..198 {
        messages.push(serde_json::json!({"role": if i % 2 == 0 { "assistant" } else { "user" }, "content": format!("turn {i}")}));
    }
    messages.push(serde_json::json!({"role": "user", "content": file}));
    let body =
        serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).unwrap();
    let req = Request::post(visor.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {KEY_A}"))
        .body(Full::new(Bytes::from(body.clone())))
        .unwrap();
    assert_eq!(send(req).await.0, 200);
    let m = visor.metrics().await;
    let received = metric(
        &m,
        "visor_context_received_bytes_total",
        &[("key", "team-a")],
    )
    .unwrap();
    assert!(received >= body.len() as f64 - 4.0, "{received}");
    let resent = metric(&m, "visor_context_resent_bytes_total", &[("key", "team-a")]).unwrap();
    assert!(resent > 400.0, "the second copy of the file: {resent}");
    assert_eq!(
        metric(
            &m,
            "visor_context_long_requests_total",
            &[("key", "team-a")]
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(&m, "visor_context_resent_bytes_total", &[("key", "none")]),
        Some(0.0),
        "series for the other names exist from the start"
    );
}

fn with_key(url: &str, body: impl Into<Bytes>, key: &str) -> Request<Full<Bytes>> {
    let mut req = post_json(url, body);
    req.headers_mut()
        .insert("authorization", format!("Bearer {key}").parse().unwrap());
    req
}

fn chat(model: &str, pad: usize) -> String {
    format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(pad)
    )
}

const DESCRIPTION: &str = "Over 30% of the request bytes of this key were repeated history dedup removed, twice its share of the six hours before: an agent may be stuck re-fetching its history (visor_context_resent_bytes_total / visor_context_received_bytes_total).";

/// The re-sent context alert, evaluated by `promtool test rules` on the
/// figures a running visor produced: a key whose requests are normal for
/// six hours, then re-send their history (the refetch fixture) for half an
/// hour, fires `VisorContextResentJump`; a key that stays normal does not.
#[tokio::test]
async fn the_resent_context_alert_fires_for_a_key_stuck_re_sending_its_history() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let toml = "[[key]]\nname = \"agent\"\nkey = \"sk-agent\"\n[[key]]\nname = \"steady\"\nkey = \"sk-steady\"\n";
    let visor = Visor::for_mock(&mock, toml).await;
    let url = visor.url("/v1/chat/completions");
    let figures = |m: &str, key: &str| {
        (
            metric(m, "visor_context_received_bytes_total", &[("key", key)]).unwrap_or(0.0),
            metric(m, "visor_context_resent_bytes_total", &[("key", key)]).unwrap_or(0.0),
        )
    };
    // A normal request, then a stuck one.
    let normal = chat("m", 2000);
    assert_eq!(
        send(with_key(&url, normal.clone(), "sk-agent")).await.0,
        200
    );
    assert_eq!(send(with_key(&url, normal, "sk-steady")).await.0, 200);
    let m1 = visor.metrics().await;
    let (norm_recv, norm_resent) = figures(&m1, "agent");
    assert!(norm_recv > 2000.0);
    let stuck = fixture("agent-history-refetch.json");
    assert_eq!(send(with_key(&url, stuck, "sk-agent")).await.0, 200);
    let m2 = visor.metrics().await;
    let (recv2, resent2) = figures(&m2, "agent");
    let (stuck_recv, stuck_resent) = (recv2 - norm_recv, resent2 - norm_resent);
    assert!(
        stuck_resent > 0.3 * stuck_recv,
        "the fixture is mostly re-sent: {stuck_resent} of {stuck_recv}"
    );
    let (steady_recv, steady_resent) = figures(&m2, "steady");
    assert_eq!(steady_resent, 0.0);

    // Per minute: 10 normal requests; the stuck agent 10 stuck ones.
    let per_min = |x: f64| (x * 10.0).round() as u64;
    let series = |recv: u64, resent: u64, then: Option<(u64, u64)>| -> (String, String) {
        let (r2, s2) = then.unwrap_or((recv, resent));
        let end_r = recv * 360;
        let end_s = resent * 360;
        (
            format!("0+{recv}x360 {}+{r2}x60", end_r + r2),
            format!("0+{resent}x360 {}+{s2}x60", end_s + s2),
        )
    };
    let (agent_r, agent_s) = series(
        per_min(norm_recv),
        per_min(norm_resent),
        Some((per_min(stuck_recv), per_min(stuck_resent))),
    );
    let (steady_r, steady_s) = series(per_min(steady_recv), per_min(steady_resent), None);
    let rules = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/prometheus/alerts.yml");
    let test = format!(
        "rule_files:\n  - {rules}\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n\
         \x20     - series: 'visor_context_received_bytes_total{{key=\"agent\"}}'\n        values: '{agent_r}'\n\
         \x20     - series: 'visor_context_resent_bytes_total{{key=\"agent\"}}'\n        values: '{agent_s}'\n\
         \x20     - series: 'visor_context_received_bytes_total{{key=\"steady\"}}'\n        values: '{steady_r}'\n\
         \x20     - series: 'visor_context_resent_bytes_total{{key=\"steady\"}}'\n        values: '{steady_s}'\n\
         \x20   alert_rule_test:\n\
         \x20     - eval_time: 5h50m\n        alertname: VisorContextResentJump\n        exp_alerts: []\n\
         \x20     - eval_time: 6h45m\n        alertname: VisorContextResentJump\n        exp_alerts:\n\
         \x20         - exp_labels:\n              severity: warning\n              key: agent\n\
         \x20           exp_annotations:\n              summary: 'Key agent re-sends much more of its context than usual'\n\
         \x20             description: '{DESCRIPTION}'\n"
    );
    let path = temp_config("alert-test", &test);
    match std::process::Command::new("promtool")
        .args(["test", "rules"])
        .arg(&path)
        .output()
    {
        Ok(out) => assert!(
            out.status.success(),
            "{test}\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("promtool is required under CI: {e}")
        }
        Err(e) => println!("SKIPPED: promtool not installed ({e})"),
    }
}

#[tokio::test]
async fn usage_over_the_estimate_is_charged_to_the_key() {
    // The upstream says each request used 2000 tokens; the body is about 20.
    let mock = MockUpstream::start(|_| {
        Reply::json(
            200,
            r#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1990,"completion_tokens":10,"total_tokens":2000}}"#,
        )
    })
    .await;
    let visor = Visor::for_mock(
        &mock,
        &format!("[[key]]\nname = \"small\"\nkey = \"{KEY_A}\"\ntokens_per_minute = 1000\n"),
    )
    .await;
    let url = visor.url("/v1/chat/completions");
    room_in_this_minute(15).await;
    assert_eq!(send(keyed(&url, KEY_A, "m")).await.0, 200);
    // The correction is made as the response ends; by estimates alone six
    // more requests (about 120 tokens) would all go.
    let mut refused = false;
    for _ in 0..6 {
        if send(keyed(&url, KEY_A, "m")).await.0 == 429 {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        refused,
        "usage of 2000 tokens was charged to a 1000-a-minute key"
    );
}

/// A key limited to some models: a body visor streams is read whole before
/// it goes, so one that names a second model after the allowed one (most
/// JSON parsers and form readers take the last) is refused, never sent.
#[tokio::test]
async fn a_body_naming_a_second_model_cannot_slip_past_a_keys_models() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, &keys("")).await;
    let post = |body: Vec<u8>, content_type: &str| {
        Request::post(visor.url("/v1/embeddings"))
            .header("content-type", content_type)
            .header("authorization", format!("Bearer {KEY_A}"))
            .body(Full::new(Bytes::from(body)))
            .unwrap()
    };
    let json = "application/json";
    for body in [
        r#"{"model":"gpt-4o","input":"x","model":"claude-opus"}"#,
        r#"{"model":"gpt-4o","input":"x","mod\u0065l":"claude-opus"}"#,
        // A case-blind reader (Go's encoding/json) takes the last.
        r#"{"model":"gpt-4o","input":"x","Model":"claude-opus"}"#,
        // No model visor can read: a key limited to some must name one.
        r#"{"input":"x"}"#,
        // `MODEL` alone is no `model` (serde and Python read none; Go
        // would read it): refused for a key limited to some models.
        r#"{"MODEL":"claude-opus","input":"x"}"#,
    ] {
        let (status, _, answer) = send(post(body.as_bytes().to_vec(), json)).await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(error_code(&answer), "model_unreadable");
    }
    let form = |fields: &[(&str, &str)]| {
        let mut b = Vec::new();
        for (k, v) in fields {
            b.extend_from_slice(
                format!("--XyZ\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n")
                    .as_bytes(),
            );
        }
        b.extend_from_slice(b"--XyZ--\r\n");
        b
    };
    let multipart = "multipart/form-data; boundary=XyZ";
    let (status, _, answer) = send(post(
        form(&[
            ("model", "gpt-4o-transcribe"),
            ("file", "…"),
            ("model", "claude-opus"),
        ]),
        multipart,
    ))
    .await;
    assert_eq!(status, 400);
    assert_eq!(error_code(&answer), "model_unreadable");
    // A second model part written the ways lenient readers take too: the
    // name unquoted, the part's head ended by a bare blank line.
    for second in [
        "--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\nclaude-opus\r\n",
        "--XyZ\r\nContent-Disposition: form-data; name=\"model\"\n\nclaude-opus\r\n",
    ] {
        let mut body = form(&[("model", "gpt-4o-transcribe")]);
        body.truncate(body.len() - b"--XyZ--\r\n".len());
        body.extend_from_slice(second.as_bytes());
        body.extend_from_slice(b"--XyZ--\r\n");
        let (status, _, answer) = send(post(body, multipart)).await;
        assert_eq!(status, 400, "{second:?}");
        assert_eq!(error_code(&answer), "model_unreadable");
    }
    // Two boundaries: readers differ on which counts; not read as a form.
    let (status, _, _) = send(post(
        form(&[("model", "gpt-4o-transcribe")]),
        "multipart/form-data; boundary=XyZ; boundary=Other",
    ))
    .await;
    assert_eq!(status, 400);
    assert_eq!(mock.count(), 0, "nothing reached the upstream");
    // A listing has no body and no model: it goes.
    let (status, _, _) = send(
        Request::get(visor.url("/v1/models"))
            .header("authorization", format!("Bearer {KEY_A}"))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(mock.count(), 1);
    // One model, allowed: sent, whole and unchanged.
    let body = form(&[("model", "gpt-4o-transcribe"), ("file", "…")]);
    let (status, _, _) = send(post(body.clone(), multipart)).await;
    assert_eq!(status, 200);
    assert_eq!(mock.recorded().pop().unwrap().body, body);
}

/// A client that leaves a stream once its answer is done, before the usage
/// event, is charged the text it was sent (estimated at 4 bytes a token):
/// leaving early is not a way around a token limit.
#[tokio::test]
async fn a_stream_left_before_its_usage_is_charged_its_text() {
    use http_body_util::BodyExt;
    let (mock, tx) = fed_once().await;
    let visor = Visor::for_mock(
        &mock,
        &format!("[[key]]\nname = \"small\"\nkey = \"{KEY_A}\"\ntokens_per_minute = 1000\n"),
    )
    .await;
    let url = visor.url("/v1/chat/completions");
    room_in_this_minute(15).await;
    let resp = client().request(keyed(&url, KEY_A, "m")).await.unwrap();
    assert_eq!(resp.status(), 200);
    // 6 000 bytes of answer (about 1 500 tokens), each chunk with
    // `"usage":null` as OpenAI sends them when the client asks for usage,
    // then its finish_reason; the usage event would come next.
    let piece = "x".repeat(1000);
    for _ in 0..6 {
        let event = format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{piece}\"}},\"finish_reason\":null}}],\"usage\":null}}\n\n"
        );
        tx.send(Chunk::Data(Bytes::from(event))).await.unwrap();
    }
    tx.send(Chunk::Data(Bytes::from_static(
        b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
    )))
    .await
    .unwrap();
    let mut body = resp.into_body();
    let mut seen = String::new();
    while !seen.contains("\"finish_reason\":\"stop\"") {
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .expect("the answer within 10 s")
            .unwrap()
            .unwrap();
        if let Ok(data) = frame.into_data() {
            seen.push_str(&String::from_utf8_lossy(&data));
        }
    }
    // The client leaves; the upstream's stream is still open.
    drop(body);
    // The charge is made as visor sees the client gone: a few tries.
    let mut refused = false;
    for _ in 0..20 {
        if send(keyed(&url, KEY_A, "m")).await.0 == 429 {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        refused,
        "1 500 tokens of answer were not charged to a 1 000-a-minute key"
    );
    drop(tx);
}

/// Without a shared store each replica counts its own limits, and the
/// gauge says so from the start (it read 1 with a disk store); the build
/// says what it is.
#[tokio::test]
async fn limits_are_not_shared_without_redis_and_the_build_is_named() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let m = visor.metrics().await;
    assert_eq!(metric(&m, "visor_ratelimit_shared", &[]), Some(0.0), "{m}");
    let build = m
        .lines()
        .find(|l| l.starts_with("visor_build_info{"))
        .unwrap_or_else(|| panic!("no visor_build_info:\n{m}"));
    assert!(
        build.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))),
        "{build}"
    );
    assert!(build.contains("commit=\""), "{build}");
    assert!(build.ends_with(" 1"), "{build}");
}

#[tokio::test]
async fn requests_and_tokens_are_counted_by_key_name() {
    let mock = MockUpstream::start(|_| {
        Reply::json(
            200,
            r#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":11,"completion_tokens":3}}"#,
        )
    })
    .await;
    let visor = Visor::for_mock(
        &mock,
        &format!("[[key]]\nname = \"team-a\"\nkey = \"{KEY_A}\"\n[[key]]\nname = \"team-b\"\nkey = \"{KEY_B}\"\n"),
    )
    .await;
    let url = visor.url("/v1/chat/completions");
    for key in [KEY_A, KEY_A, KEY_B] {
        let (status, _, body) = send(keyed(&url, key, "gpt-4o")).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    // No key at all: refused, and counted under `none`.
    let (status, _, _) = post_chat(&visor, r#"{"model":"gpt-4o","messages":[]}"#).await;
    assert_eq!(status, 401);
    let m = visor.metrics().await;
    let requests = |key: &str, status: &str| {
        metric(
            &m,
            "visor_requests_total",
            &[("key", key), ("status", status)],
        )
    };
    assert_eq!(requests("team-a", "200"), Some(2.0));
    assert_eq!(requests("team-b", "200"), Some(1.0));
    assert_eq!(requests("none", "401"), Some(1.0));
    let tokens =
        |key: &str, kind: &str| metric(&m, "visor_tokens_total", &[("key", key), ("kind", kind)]);
    assert_eq!(tokens("team-a", "prompt"), Some(22.0));
    assert_eq!(tokens("team-b", "completion"), Some(3.0));
}
