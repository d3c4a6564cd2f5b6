//! The Redis store against a real `redis-server` started by the test:
//! replicas share descriptions and learned models, and a Redis that goes
//! away and comes back degrades visor to memory and back, never failing a
//! request. Without redis-server these skip with a printed reason, except
//! under CI=true (where `.ci/run` installs it), where they fail instead.
#![cfg(feature = "redis")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::*;

fn describer_calls(mock: &MockUpstream) -> usize {
    mock.recorded()
        .iter()
        .filter(|r| is_describer_call(r))
        .count()
}

fn last_chat(mock: &MockUpstream) -> Recorded {
    mock.recorded()
        .into_iter()
        .rev()
        .find(|r| !is_describer_call(r))
        .unwrap()
}

/// Describes images; refuses images for models named `mystery-*`.
fn mock_handler(r: &Recorded) -> Reply {
    if is_describer_call(r) {
        return describer_answer(r);
    }
    let body = String::from_utf8_lossy(&r.body);
    if body.contains("\"mystery-") && body.contains("image_url") {
        return Reply::json(
            400,
            r#"{"error":{"message":"This model does not support image input.","type":"invalid_request_error"}}"#,
        );
    }
    chat_ok()
}

fn config(mock: &MockUpstream, redis: &RedisServer, data_dir: &std::path::Path) -> String {
    format!(
        "{DESCRIBE}[server]\nworkers = 1\ndrain_delay_secs = 0\ndata_dir = \"{}\"\n[store]\nbackend = \"{}\"\nprefix = \"visor-test-{}:\"\n\
         [[upstream]]\nname = \"mock\"\nbase_url = \"{}/v1\"\nmodels = [\"*\"]\n",
        data_dir.display(),
        redis.url(),
        std::process::id(),
        mock.url()
    )
}

async fn serve(config_path: &std::path::Path) -> Serving {
    let path = config_path.display().to_string();
    tokio::task::spawn_blocking(move || {
        Serving::start(&["--config", &path], &[("RUST_LOG", "info")])
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_visor_processes_sharing_redis_make_one_describer_call() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let mock = MockUpstream::start(mock_handler).await;
    let (dir_a, dir_b) = (temp_dir("redis-a"), temp_dir("redis-b"));
    let path_a = temp_config("redis-a", &config(&mock, &redis, &dir_a));
    let path_b = temp_config("redis-b", &config(&mock, &redis, &dir_b));
    let a = serve(&path_a).await;
    let b = serve(&path_b).await;

    let (image, png) = png_data_url("two-replicas");
    let body = chat_with_images("gpt-oss-120b", std::slice::from_ref(&image));
    let url_a = format!("http://{}/v1/chat/completions", a.addr);
    let url_b = format!("http://{}/v1/chat/completions", b.addr);
    let (status, headers, _) = send(post_json(&url_a, body.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "1");
    assert_eq!(describer_calls(&mock), 1);

    // The other replica finds it in Redis: no call, the same text.
    let (status, _, _) = send(post_json(&url_b, body)).await;
    assert_eq!(status, 200);
    assert_eq!(describer_calls(&mock), 1, "the second replica made no call");
    let size = imagesize::blob_size(&png).unwrap();
    let expected = format!(
        "[image sha256:{}, image/png {}x{}, described: {}]",
        &sha256_hex(&png)[..12],
        size.width,
        size.height,
        description_for(&image)
    );
    assert_eq!(user_texts(&last_chat(&mock).body)[1], expected);
    let (status, _, metrics) = send(
        Request::get(format!("http://{}/metrics", b.addr))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    let m = String::from_utf8_lossy(&metrics);
    assert_eq!(
        metric(&m, "visor_describe_total", &[("result", "hit")]),
        Some(1.0)
    );
    assert_eq!(metric(&m, "visor_store_up", &[]), Some(1.0));

    // A model replica A learns to refuse images is in Redis for everyone:
    // `visor check` on B's config lists it.
    let refused = chat_with_images("mystery-7b", &[png_data_url("learn").0]);
    let (status, _, _) = send(post_json(&url_a, refused)).await;
    assert_eq!(status, 200);
    let out = visor()
        .args(["check", "--config"])
        .arg(&path_b)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("learned  \"mystery-7b\""), "{stdout}");

    let (code_a, log_a) = a.terminate();
    let (code_b, _) = b.terminate();
    assert_eq!((code_a, code_b), (Some(0), Some(0)), "{log_a}");
    assert!(!log_a.contains("iVBORw0KGgo"), "no image bytes in the log");
    for d in [dir_a, dir_b] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[tokio::test]
async fn a_replica_started_later_knows_what_others_learned() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let mock = MockUpstream::start(mock_handler).await;
    let body = chat_with_images("mystery-13b", &[png_data_url("later").0]);
    let first = Visor::start(&config(&mock, &redis, &temp_dir("redis-learn-1"))).await;
    let (status, _, _) = send(post_json(&first.url("/v1/chat/completions"), body.clone())).await;
    assert_eq!(status, 200);
    let refusals = mock.count();

    let second = Visor::start(&config(&mock, &redis, &temp_dir("redis-learn-2"))).await;
    assert!(
        second
            .state
            .rewrite
            .models
            .learned
            .names()
            .contains(&"mystery-13b".to_owned())
    );
    let (status, headers, _) = send(post_json(&second.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "1");
    // One chat call, images replaced up front: no refusal, no retry (the
    // image's description was already in Redis, too).
    assert_eq!(mock.count(), refusals + 1);
}

#[tokio::test]
async fn redis_going_away_degrades_to_memory_and_coming_back_recovers() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let mock = MockUpstream::start(mock_handler).await;
    let visor = Visor::start(&config(&mock, &redis, &temp_dir("redis-away"))).await;
    let url = visor.url("/v1/chat/completions");
    let readyz = || async {
        let (status, _, body) = send(
            Request::get(visor.url("/readyz"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await;
        assert_eq!(status, 200);
        serde_json::from_slice::<serde_json::Value>(&body).unwrap()
    };
    assert_eq!(readyz().await["status"], "ready");

    redis.stop();
    let (image, _) = png_data_url("while-away");
    let body = chat_with_images("gpt-oss-120b", &[image]);
    let (status, _, _) = send(post_json(&url, body.clone())).await;
    assert_eq!(status, 200, "a store that is down never fails a request");
    assert!(user_texts(&last_chat(&mock).body)[1].contains("described: "));
    let r = readyz().await;
    assert_eq!(r["status"], "degraded", "{r}");
    assert!(
        r["reasons"][0]
            .as_str()
            .unwrap()
            .contains("redis://127.0.0.1"),
        "{r}"
    );

    // Back on the same port: /readyz probes it once the retry is due.
    redis.restart();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if readyz().await["status"] == "ready" {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "store never came back"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let m = visor.metrics().await;
    assert_eq!(metric(&m, "visor_store_up", &[]), Some(1.0));
    assert!(metric(&m, "visor_store_errors_total", &[("op", "get")]).unwrap() >= 1.0);

    // Stored again: a new image's description reaches Redis, where a new
    // replica finds it.
    let (image, _) = png_data_url("after-return");
    let body = chat_with_images("gpt-oss-120b", &[image]);
    send(post_json(&url, body.clone())).await;
    let calls = describer_calls(&mock);
    let other = Visor::start(&config(&mock, &redis, &temp_dir("redis-away-2"))).await;
    let (status, _, _) = send(post_json(&other.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200);
    assert_eq!(describer_calls(&mock), calls);
    assert!(user_texts(&last_chat(&mock).body)[1].contains("described: "));
}

fn session_chat(url: &str, id: &str, text: &str) -> Request<Full<Bytes>> {
    Request::post(url)
        .header("content-type", "application/json")
        .header("x-visor-session", id)
        .body(Full::new(Bytes::from(format!(
            r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{text}"}}]}}"#
        ))))
        .unwrap()
}

/// A Redis restart: the first session request after it is served (the dead
/// connection is retried once on a new one), also when a request found it
/// down before (not a 503 until the next probe or retry).
#[tokio::test]
async fn a_redis_restart_costs_no_503_once_redis_is_back() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let mock = MockUpstream::start(mock_handler).await;
    let visor = Visor::start(&config(&mock, &redis, &temp_dir("redis-restart"))).await;
    let url = visor.url("/v1/chat/completions");
    let (status, _, _) = send(session_chat(&url, "r1", "one")).await;
    assert_eq!(status, 200);

    // Restarted between two requests: the next one finds a dead connection.
    redis.stop();
    redis.restart();
    let (status, _, body) = send(session_chat(&url, "r1", "two")).await;
    assert_eq!(
        status,
        200,
        "first request after a restart: {}",
        String::from_utf8_lossy(&body)
    );

    // Down while a request comes (503 for a session: its history cannot be
    // read), then back: the very next session request is served — a
    // session's store operation is tried whatever the retry time says.
    redis.stop();
    let (status, _, _) = send(session_chat(&url, "r2", "while down")).await;
    assert_eq!(status, 503);
    redis.restart();
    let (status, _, body) = send(session_chat(&url, "r2", "after")).await;
    assert_eq!(
        status,
        200,
        "the first session request after Redis came back: {}",
        String::from_utf8_lossy(&body)
    );
}

/// A model one replica learns is used by another at its next image request,
/// not after its 30 s refresh: no second refusal round trip.
#[tokio::test]
async fn a_model_learned_by_one_replica_is_known_to_another_at_once() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let mock = MockUpstream::start(mock_handler).await;
    let a = Visor::start(&config(&mock, &redis, &temp_dir("redis-now-a"))).await;
    let b = Visor::start(&config(&mock, &redis, &temp_dir("redis-now-b"))).await;
    let body = chat_with_images("mystery-7b-now", &[png_data_url("learn-now").0]);
    let (status, _, _) = send(post_json(&a.url("/v1/chat/completions"), body.clone())).await;
    assert_eq!(status, 200);
    let before = mock.recorded().len();
    let (status, headers, _) = send(post_json(&b.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "1");
    let chats = mock.recorded()[before..]
        .iter()
        .filter(|r| !is_describer_call(r))
        .count();
    assert_eq!(chats, 1, "the second replica paid a refusal round trip");
}
