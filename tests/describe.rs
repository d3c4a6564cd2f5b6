//! `describe` mode through the real proxy, with the mock upstream as the
//! describer (it answers with text derived from the bytes it was sent, and
//! every call is recorded): descriptions injected verbatim, one call per
//! image across requests, restarts and concurrency, and a describer or a
//! store that fails never failing the user's request.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::*;
use tokio::sync::mpsc;

fn describer_calls(mock: &MockUpstream) -> Vec<Recorded> {
    mock.recorded()
        .into_iter()
        .filter(is_describer_call)
        .collect()
}

fn chat_calls(mock: &MockUpstream) -> Vec<Recorded> {
    mock.recorded()
        .into_iter()
        .filter(|r| !is_describer_call(r))
        .collect()
}

/// The text visor puts in place of an inline PNG with a description.
fn described_png(png: &[u8], description: &str) -> String {
    let size = imagesize::blob_size(png).unwrap();
    let sha = sha256_hex(png);
    format!(
        "[image sha256:{}, image/png {}x{}, described: {description}]",
        &sha[..12],
        size.width,
        size.height
    )
}

fn answers_and_describes() -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    |r| {
        if is_describer_call(r) {
            describer_answer(r)
        } else {
            chat_ok()
        }
    }
}

#[tokio::test]
async fn descriptions_are_injected_verbatim_and_made_once() {
    let mock = MockUpstream::start(answers_and_describes()).await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    let url = visor.url("/v1/chat/completions");
    let body = fixture("chat-image-nonvision.json");

    let (status, headers, resp) = send(post_json(&url, body.clone())).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
    assert_eq!(headers["x-visor-images-replaced"], "2");

    // One call per image, each with the prompt and that one image: the
    // inline one as its own bytes, the http(s) one as its URL.
    let calls = describer_calls(&mock);
    assert_eq!(calls.len(), 2);
    let fixture_json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let sent_urls: Vec<String> = fixture_json["messages"][1]["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["image_url"]["url"].as_str().map(str::to_owned))
        .collect();
    let mut described: Vec<String> = calls.iter().map(described_url).collect();
    described.sort();
    let mut expected = sent_urls.clone();
    expected.sort();
    assert_eq!(described, expected);
    for c in &calls {
        let v: serde_json::Value = serde_json::from_slice(&c.body).unwrap();
        assert_eq!(
            v["messages"][0]["content"],
            visor::media_text::describe::PROMPT
        );
        assert_eq!(c.uri.path(), "/v1/chat/completions");
    }

    // The model gets each description verbatim, in place.
    let chats = chat_calls(&mock);
    assert_eq!(chats.len(), 1);
    let texts = user_texts(&chats[0].body);
    let (_, b64) = sent_urls[0].split_once(";base64,").unwrap();
    let png = base64_simd::STANDARD.decode_to_vec(b64).unwrap();
    assert_eq!(
        texts[1],
        described_png(&png, &description_for(&sent_urls[0]))
    );
    let web = &sent_urls[1];
    assert_eq!(
        texts[2],
        format!(
            "[image {web} (sha256:{}), described: {}]",
            &sha256_hex(web.as_bytes())[..12],
            description_for(web)
        )
    );

    // The same images again: no describer call, the same bytes upstream
    // (provider prompt caches keep hitting).
    let (status, headers, _) = send(post_json(&url, body)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "2");
    assert_eq!(describer_calls(&mock).len(), 2);
    let chats = chat_calls(&mock);
    assert_eq!(chats[0].body, chats[1].body);

    let m = visor.metrics().await;
    assert_eq!(
        metric(&m, "visor_describe_total", &[("result", "miss")]),
        Some(2.0)
    );
    assert_eq!(
        metric(&m, "visor_describe_total", &[("result", "hit")]),
        Some(2.0)
    );
    assert_eq!(
        metric(&m, "visor_describe_total", &[("result", "error")]),
        Some(0.0)
    );
    assert_eq!(
        metric(&m, "visor_images_total", &[("action", "described")]),
        Some(4.0)
    );
    assert_eq!(
        metric(&m, "visor_images_total", &[("action", "stripped")]),
        Some(0.0)
    );
    assert_eq!(
        metric(&m, "visor_describe_duration_seconds_count", &[]),
        Some(2.0)
    );
    assert_eq!(metric(&m, "visor_describe_cache_entries", &[]), Some(2.0));
}

#[tokio::test]
async fn a_restart_on_the_disk_store_makes_no_describer_call() {
    let mock = MockUpstream::start(answers_and_describes()).await;
    let data_dir = temp_dir("describe-restart");
    let extra = format!(
        "{DESCRIBE}[server]\ndata_dir = \"{}\"\n",
        data_dir.display()
    );
    let (image, png) = png_data_url("restart");
    let body = chat_with_images("gpt-oss-120b", std::slice::from_ref(&image));

    let mut first = Visor::for_mock(&mock, &extra).await;
    let (status, _, _) = send(post_json(&first.url("/v1/chat/completions"), body.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(describer_calls(&mock).len(), 1);
    first.shutdown();
    let _ = first.task.take().unwrap().await;
    drop(first);

    let second = Visor::for_mock(&mock, &extra).await;
    assert_eq!(second.state.store.problem(), None);
    let (status, headers, _) = send(post_json(&second.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "1");
    assert_eq!(describer_calls(&mock).len(), 1, "no call after the restart");
    let chats = chat_calls(&mock);
    let texts = user_texts(&chats[1].body);
    assert_eq!(texts[1], described_png(&png, &description_for(&image)));
    let m = second.metrics().await;
    assert_eq!(
        metric(&m, "visor_describe_total", &[("result", "hit")]),
        Some(1.0)
    );
    drop(second);
    let _ = std::fs::remove_dir_all(data_dir);
}

/// The senders of held describer answers.
type Held = Arc<Mutex<Vec<mpsc::Sender<Chunk>>>>;

/// Answers chat requests at once; holds each describer answer (its whole
/// body ready) until the returned senders are dropped.
fn held_describer() -> (impl Fn(&Recorded) -> Reply + Send + Sync + 'static, Held) {
    let release: Held = Arc::default();
    let held = release.clone();
    let handler = move |r: &Recorded| {
        if !is_describer_call(r) {
            return chat_ok();
        }
        let Reply::Full { body, .. } = describer_answer(r) else {
            unreachable!()
        };
        let (tx, rx) = mpsc::channel(2);
        tx.try_send(Chunk::Data(body)).unwrap();
        held.lock().unwrap().push(tx);
        Reply::Channel {
            status: 200,
            headers: vec![("content-type", "application/json".to_owned())],
            rx,
        }
    };
    (handler, release)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_requests_for_one_new_image_make_one_call() {
    // The describer's answer is held until all 20 requests are inside
    // visor, so they surely overlap.
    let (handler, release) = held_describer();
    let mock = MockUpstream::start(handler).await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    let (image, png) = png_data_url("twenty");
    let body = chat_with_images("gpt-oss-120b", std::slice::from_ref(&image));
    let url = visor.url("/v1/chat/completions");
    let mut requests = Vec::new();
    for _ in 0..20 {
        let req = post_json(&url, body.clone());
        requests.push(tokio::spawn(send(req)));
    }
    assert!(
        wait_metrics(&visor, Duration::from_secs(10), |m| {
            metric(m, "visor_inflight_requests", &[]) == Some(20.0)
        })
        .await,
        "20 requests in flight"
    );
    assert!(mock.wait_requests(1, Duration::from_secs(5)).await);
    // Dropping the senders ends the held answer(s).
    release.lock().unwrap().clear();
    let expected = described_png(&png, &description_for(&image));
    for r in requests {
        let (status, headers, _) = r.await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(headers["x-visor-images-replaced"], "1");
    }
    assert_eq!(describer_calls(&mock).len(), 1, "single-flight");
    let chats = chat_calls(&mock);
    assert_eq!(chats.len(), 20);
    for c in &chats {
        assert_eq!(user_texts(&c.body)[1], expected);
    }
    let m = visor.metrics().await;
    assert_eq!(
        metric(&m, "visor_describe_total", &[("result", "miss")]),
        Some(1.0)
    );
    assert_eq!(
        metric(&m, "visor_describe_total", &[("result", "hit")]),
        Some(19.0)
    );
}

/// A describer that misbehaves (as `bad` says) until `fixed` is set.
fn failing_until_fixed(
    fixed: Arc<AtomicUsize>,
    bad: fn() -> Reply,
) -> impl Fn(&Recorded) -> Reply + Send + Sync + 'static {
    move |r| {
        if !is_describer_call(r) {
            chat_ok()
        } else if fixed.load(Ordering::SeqCst) == 0 {
            bad()
        } else {
            describer_answer(r)
        }
    }
}

/// Sends `body` until its image comes back described (bounded); returns
/// how many answers had the placeholder on the way.
async fn until_described(visor: &Visor, mock: &MockUpstream, body: &Bytes) -> usize {
    let url = visor.url("/v1/chat/completions");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut placeholders = 0;
    loop {
        let (status, _, _) = send(post_json(&url, body.clone())).await;
        assert_eq!(status, 200);
        let last = chat_calls(mock).pop().unwrap();
        if user_texts(&last.body)[1].contains("described: ") {
            return placeholders;
        }
        placeholders += 1;
        assert!(
            tokio::time::Instant::now() < deadline,
            "never described after the describer recovered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// For paused time: one worker, so all of visor runs on the test's clock.
/// Returns how long the first answer took.
async fn placeholder_then_recovery(bad: fn() -> Reply, extra: &str) -> Duration {
    let fixed = Arc::new(AtomicUsize::new(0));
    let mock = MockUpstream::start(failing_until_fixed(fixed.clone(), bad)).await;
    let visor = Visor::for_mock(&mock, &format!("{DESCRIBE}{extra}[server]\nworkers = 1\n")).await;
    let (image, png) = png_data_url(extra);
    let body = chat_with_images("gpt-oss-120b", &[image]);

    let started = tokio::time::Instant::now();
    let (status, headers, resp) =
        send(post_json(&visor.url("/v1/chat/completions"), body.clone())).await;
    let took = started.elapsed();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
    assert_eq!(headers["x-visor-images-replaced"], "1");
    let size = imagesize::blob_size(&png).unwrap();
    assert_eq!(
        user_texts(&chat_calls(&mock)[0].body)[1],
        format!(
            "[image sha256:{}, image/png {}x{}: not shown, this model cannot see images]",
            &sha256_hex(&png)[..12],
            size.width,
            size.height
        )
    );
    let m = visor.metrics().await;
    assert_eq!(
        metric(&m, "visor_describe_total", &[("result", "error")]),
        Some(1.0)
    );
    assert_eq!(
        metric(&m, "visor_images_total", &[("action", "stripped")]),
        Some(1.0)
    );
    assert_eq!(describer_calls(&mock).len(), 1);

    // The failure was not cached: once the describer works, the image is
    // described — after the back-off (1 s), in which no call is made.
    fixed.store(1, Ordering::SeqCst);
    let placeholders = until_described(&visor, &mock, &body).await;
    assert_eq!(
        describer_calls(&mock).len(),
        2,
        "no call during the back-off"
    );
    assert!(
        placeholders >= 1,
        "a request inside the 1 s back-off got the placeholder"
    );
    took
}

/// Paused time: the placeholder comes at the 10 s describer deadline.
#[tokio::test(start_paused = true)]
async fn a_describer_timeout_gives_the_placeholder_and_caches_nothing() {
    let took = placeholder_then_recovery(|| Reply::Hang, "timeout_secs = 10\n").await;
    assert_at(took, Duration::from_secs(10));
}

/// Paused time: the back-off costs nothing; the error's placeholder is
/// immediate.
#[tokio::test(start_paused = true)]
async fn a_describer_error_gives_the_placeholder_and_caches_nothing() {
    let took = placeholder_then_recovery(
        || {
            Reply::json(
                500,
                r#"{"error":{"message":"overloaded","type":"server_error"}}"#,
            )
        },
        "",
    )
    .await;
    assert!(took < Duration::from_millis(500), "{took:?}");
}

#[tokio::test]
async fn empty_and_shapeless_answers_are_errors_not_descriptions() {
    for answer in [
        r#"{"choices":[{"message":{"role":"assistant","content":"   "}}]}"#,
        r#"{"choices":[{"message":{"role":"assistant","content":null}}]}"#,
        r#"{"object":"list"}"#,
        "not json",
    ] {
        let mock = MockUpstream::start(move |r| {
            if is_describer_call(r) {
                Reply::json(200, answer)
            } else {
                chat_ok()
            }
        })
        .await;
        let visor = Visor::for_mock(&mock, DESCRIBE).await;
        let (image, _) = png_data_url("empty");
        let body = chat_with_images("gpt-oss-120b", &[image]);
        let (status, _, _) = send(post_json(&visor.url("/v1/chat/completions"), body)).await;
        assert_eq!(status, 200);
        assert!(
            user_texts(&chat_calls(&mock)[0].body)[1].contains("not shown"),
            "{answer}"
        );
        let m = visor.metrics().await;
        assert_eq!(
            metric(&m, "visor_describe_total", &[("result", "error")]),
            Some(1.0)
        );
        assert_eq!(metric(&m, "visor_describe_cache_entries", &[]), Some(0.0));
    }
}

#[tokio::test]
async fn on_miss_placeholder_answers_at_once_and_describes_for_next_time() {
    // The describer's answer is held until the first response is back: the
    // request did not wait for it.
    let (handler, release) = held_describer();
    let mock = MockUpstream::start(handler).await;
    let visor = Visor::for_mock(&mock, &format!("{DESCRIBE}on_miss = \"placeholder\"\n")).await;
    let (image, png) = png_data_url("background");
    let body = chat_with_images("gpt-oss-120b", std::slice::from_ref(&image));
    let url = visor.url("/v1/chat/completions");

    let (status, headers, _) = send(post_json(&url, body.clone())).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "1");
    assert!(user_texts(&chat_calls(&mock)[0].body)[1].contains("not shown"));
    assert!(mock.wait_requests(2, Duration::from_secs(5)).await);
    assert_eq!(describer_calls(&mock).len(), 1);
    release.lock().unwrap().clear();
    assert!(
        wait_metrics(&visor, Duration::from_secs(10), |m| {
            metric(m, "visor_describe_total", &[("result", "miss")]) == Some(1.0)
                && metric(m, "visor_describe_background", &[]) == Some(0.0)
        })
        .await
    );

    let (status, _, _) = send(post_json(&url, body)).await;
    assert_eq!(status, 200);
    assert_eq!(
        user_texts(&chat_calls(&mock)[1].body)[1],
        described_png(&png, &description_for(&image))
    );
    assert_eq!(describer_calls(&mock).len(), 1);
}

#[tokio::test]
async fn shutdown_cancels_background_descriptions() {
    let mock = MockUpstream::start(|r| {
        if is_describer_call(r) {
            Reply::Hang
        } else {
            chat_ok()
        }
    })
    .await;
    // One worker: the background task runs on this test's runtime, which
    // outlives visor, so only the cancellation can end it.
    let mut visor = Visor::for_mock(
        &mock,
        &format!("{DESCRIBE}timeout_secs = 60\non_miss = \"placeholder\"\n[server]\nworkers = 1\n"),
    )
    .await;
    let (image, _) = png_data_url("shutdown");
    let body = chat_with_images("gpt-oss-120b", &[image]);
    let (status, _, _) = send(post_json(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200);
    assert!(mock.wait_requests(2, Duration::from_secs(5)).await);
    let closed_before = mock.closed.load(Ordering::SeqCst);
    visor.shutdown();
    let _ = visor.task.take().unwrap().await;
    assert!(
        mock.wait_closed(closed_before + 1, Duration::from_secs(5))
            .await,
        "the describer call was cancelled (its connection closed)"
    );
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_store_that_is_down_degrades_to_memory_and_readyz_says_so() {
    // Nothing listens on this port: the Redis store is down from the start.
    let down = MockUpstream::builder()
        .fault(Fault::RefuseConnect)
        .start()
        .await;
    let port = down.addr.port();
    let mock = MockUpstream::start(answers_and_describes()).await;
    let visor = Visor::for_mock(
        &mock,
        &format!("{DESCRIBE}[store]\nbackend = \"redis://:hunter2@127.0.0.1:{port}/0\"\n"),
    )
    .await;
    let (image, png) = png_data_url("store-down");
    let body = chat_with_images("gpt-oss-120b", std::slice::from_ref(&image));
    let url = visor.url("/v1/chat/completions");
    for _ in 0..2 {
        let (status, _, _) = send(post_json(&url, body.clone())).await;
        assert_eq!(status, 200);
    }
    // Described once, then served from memory.
    assert_eq!(describer_calls(&mock).len(), 1);
    let expected = described_png(&png, &description_for(&image));
    for c in chat_calls(&mock) {
        assert_eq!(user_texts(&c.body)[1], expected);
    }
    let (status, _, ready) = send(
        Request::get(visor.url("/readyz"))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    let ready: serde_json::Value = serde_json::from_slice(&ready).unwrap();
    assert_eq!(ready["status"], "degraded");
    let reason = ready["reasons"][0].as_str().unwrap();
    assert!(reason.contains(&format!("127.0.0.1:{port}")), "{reason}");
    assert!(
        !reason.contains("hunter2"),
        "no password in /readyz: {reason}"
    );
    let m = visor.metrics().await;
    assert_eq!(metric(&m, "visor_store_up", &[]), Some(0.0));
    // Found down at start (reading the learned models); not asked again
    // until the retry is due.
    assert!(metric(&m, "visor_store_errors_total", &[("op", "list")]).unwrap() >= 1.0);
}

#[tokio::test]
async fn the_describer_gets_the_clients_key_only_for_its_own_upstream() {
    let mock = MockUpstream::start(answers_and_describes()).await;
    let auth_of = |mock: &MockUpstream| {
        describer_calls(mock)
            .last()
            .and_then(|r| r.headers.get("authorization").cloned())
    };
    let with_key = |url: &str, body: Bytes| {
        let mut req = post_json(url, body);
        req.headers_mut().insert(
            "authorization",
            http::HeaderValue::from_static("Bearer sk-client"),
        );
        req
    };
    // One upstream, no key of its own: the client's key goes along.
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    let (image, _) = png_data_url("key-1");
    let body = chat_with_images("gpt-oss-120b", &[image]);
    send(with_key(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(auth_of(&mock).unwrap(), "Bearer sk-client");

    // The upstream has a key: the describer uses it.
    let visor = Visor::start(&format!(
        "{DESCRIBE}[[upstream]]\nname = \"mock\"\nbase_url = \"{}/v1\"\nmodels = [\"*\"]\napi_key = \"sk-visor\"\n",
        mock.url()
    ))
    .await;
    let (image, _) = png_data_url("key-2");
    let body = chat_with_images("gpt-oss-120b", &[image]);
    send(with_key(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(auth_of(&mock).unwrap(), "Bearer sk-visor");

    // The request goes to another upstream than the describer's: the
    // client's key is not sent to the describer's provider.
    let visor = Visor::start(&format!(
        "{DESCRIBE}upstream = \"describer\"\n\
         [[upstream]]\nname = \"chat\"\nbase_url = \"{0}/v1\"\nmodels = [\"gpt-oss-*\"]\n\
         [[upstream]]\nname = \"describer\"\nbase_url = \"{0}/v1\"\nmodels = [\"*\"]\n",
        mock.url()
    ))
    .await;
    let before = describer_calls(&mock).len();
    let (image, _) = png_data_url("key-3");
    let body = chat_with_images("gpt-oss-120b", &[image]);
    send(with_key(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(describer_calls(&mock).len(), before + 1);
    assert_eq!(auth_of(&mock), None);
}

#[tokio::test]
async fn strip_mode_never_calls_the_describer() {
    let mock = MockUpstream::start(answers_and_describes()).await;
    let visor = Visor::for_mock(
        &mock,
        "[images]\nnon_vision = \"strip\"\n[describer]\nmodel = \"vision-mini\"\n",
    )
    .await;
    let body = fixture("chat-image-nonvision.json");
    let (status, headers, _) = send(post_json(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "2");
    assert!(describer_calls(&mock).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describer_calls_stay_within_concurrency_and_run_in_parallel() {
    let (handler, release) = held_describer();
    let mock = MockUpstream::start(handler).await;
    let visor = Visor::for_mock(&mock, &format!("{DESCRIBE}concurrency = 2\n")).await;
    let images: Vec<String> = (0..5)
        .map(|i| png_data_url(&format!("bound-{i}")).0)
        .collect();
    let body = chat_with_images("gpt-oss-120b", &images);
    let request = tokio::spawn(send(post_json(&visor.url("/v1/chat/completions"), body)));

    // The one request's images are described two at a time: two calls
    // arrive together (not one by one), and a third only once one of them
    // is answered.
    for released in 0..5 {
        let expected = (released + 2).min(5);
        assert!(
            mock.wait_requests(expected, Duration::from_secs(10)).await,
            "calls run concurrently up to the bound"
        );
        if expected < 5 {
            assert!(
                !mock
                    .wait_requests(expected + 1, Duration::from_millis(300))
                    .await,
                "more than 2 describer calls at once"
            );
        }
        drop(release.lock().unwrap().remove(0));
    }
    let (status, headers, _) = request.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "5");
    let texts = user_texts(&chat_calls(&mock)[0].body);
    assert_eq!(
        texts.iter().filter(|t| t.contains("described: ")).count(),
        5
    );
}

#[tokio::test]
async fn a_dead_describer_never_fails_the_request() {
    let dead = MockUpstream::builder()
        .fault(Fault::RefuseConnect)
        .start()
        .await;
    let mock = MockUpstream::start(answers_and_describes()).await;
    let visor = Visor::start(&format!(
        "{DESCRIBE}upstream = \"dead\"\n\
         [[upstream]]\nname = \"chat\"\nbase_url = \"{}/v1\"\nmodels = [\"gpt-oss-*\"]\n\
         {}models = [\"*\"]\n",
        mock.url(),
        dead.upstream_toml("dead")
    ))
    .await;
    let (image, _) = png_data_url("dead");
    let body = chat_with_images("gpt-oss-120b", &[image]);
    let (status, headers, _) = send(post_json(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-visor-images-replaced"], "1");
    assert!(user_texts(&chat_calls(&mock)[0].body)[1].contains("not shown"));
    let m = visor.metrics().await;
    assert_eq!(
        metric(&m, "visor_describe_total", &[("result", "error")]),
        Some(1.0)
    );
    // The describer's failure is not counted against the chat upstream.
    assert_eq!(
        metric(&m, "visor_upstream_errors_total", &[("upstream", "chat")]),
        None
    );
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_store_that_does_not_answer_times_out_into_memory_only() {
    // Accepts connections and never answers: a hung Redis.
    let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = hung.local_addr().unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    let keep = held.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = hung.accept().await {
            keep.lock().unwrap().push(s);
        }
    });
    let mock = MockUpstream::start(answers_and_describes()).await;
    let visor = Visor::for_mock(
        &mock,
        &format!("{DESCRIBE}[store]\nbackend = \"redis://{addr}/0\"\n"),
    )
    .await;
    let (image, _) = png_data_url("hung-store");
    let body = chat_with_images("gpt-oss-120b", &[image]);
    let (status, _, _) = send(post_json(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200);
    assert!(user_texts(&chat_calls(&mock)[0].body)[1].contains("described: "));
    let (_, _, ready) = send(
        Request::get(visor.url("/readyz"))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    let ready: serde_json::Value = serde_json::from_slice(&ready).unwrap();
    assert_eq!(ready["status"], "degraded", "{ready}");
    assert!(
        ready["reasons"][0]
            .as_str()
            .unwrap()
            .contains(&addr.to_string()),
        "{ready}"
    );
    assert!(!held.lock().unwrap().is_empty(), "visor did try the store");
}

#[tokio::test]
async fn explain_uses_stored_descriptions_and_never_calls_the_describer() {
    let mock = MockUpstream::start(answers_and_describes()).await;
    let data_dir = temp_dir("describe-explain");
    let toml = format!(
        "{DESCRIBE}[server]\ndata_dir = \"{}\"\n[[upstream]]\nname = \"mock\"\nbase_url = \"{}/v1\"\nmodels = [\"*\"]\n",
        data_dir.display(),
        mock.url()
    );
    let (seen, png) = png_data_url("explain-seen");
    let (unseen, _) = png_data_url("explain-unseen");
    let mut served = Visor::start(&toml).await;
    let body = chat_with_images("gpt-oss-120b", std::slice::from_ref(&seen));
    let (status, _, _) = send(post_json(&served.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200);
    served.shutdown();
    let _ = served.task.take().unwrap().await;
    drop(served);
    let calls = mock.count();

    let config = temp_config("describe-explain", &toml);
    let request = temp_config("describe-explain-body", "");
    std::fs::write(
        &request,
        chat_with_images("gpt-oss-120b", &[seen.clone(), unseen]),
    )
    .unwrap();
    let out = tokio::task::spawn_blocking(move || {
        visor()
            .args(["explain", "--model", "gpt-oss-120b", "--config"])
            .arg(&config)
            .arg(&request)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let parts = v["request"]["messages"][0]["content"].as_array().unwrap();
    assert_eq!(
        parts[1]["text"],
        described_png(&png, &description_for(&seen))
    );
    assert!(parts[2]["text"].as_str().unwrap().contains("not shown"));
    assert_eq!(v["report"]["images_described"], 1);
    assert_eq!(v["report"]["images_replaced"], 2);
    assert_eq!(mock.count(), calls, "explain made no call");
    let _ = std::fs::remove_dir_all(data_dir);
}

/// A describer whose upstream refuses its credential (401): the image gets
/// its placeholder, the refusal is counted under its upstream, `/readyz`
/// says degraded naming the upstream, and once the describer answers
/// again it is ready.
#[tokio::test]
async fn a_describer_refused_its_credential_makes_readyz_say_why() {
    let refuse = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let r = refuse.clone();
    let answers = answers_and_describes();
    let mock = MockUpstream::start(move |req| {
        if is_describer_call(req) && r.load(std::sync::atomic::Ordering::SeqCst) {
            return Reply::json(401, r#"{"error":{"message":"Incorrect API key provided"}}"#);
        }
        answers(req)
    })
    .await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    let (image, _) = png_data_url("refused-1");
    let body = chat_with_images("gpt-oss-120b", &[image]);
    let (status, _, _) = send(post_json(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200, "a describer failing never fails the request");
    let sent = String::from_utf8_lossy(&chat_calls(&mock).last().unwrap().body).into_owned();
    assert!(sent.contains("not shown"), "{sent}");
    let m = visor.metrics().await;
    assert_eq!(
        metric(
            &m,
            "visor_credential_refused_total",
            &[("role", "describer"), ("upstream", "mock")]
        ),
        Some(1.0),
        "{m}"
    );
    let readyz = || async {
        let (status, _, body) = send(
            Request::get(visor.url("/readyz"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await;
        assert_eq!(status, 200, "degraded still serves");
        serde_json::from_slice::<serde_json::Value>(&body).unwrap()
    };
    let r = readyz().await;
    assert_eq!(r["status"], "degraded", "{r}");
    let why = r["reasons"][0].as_str().unwrap();
    assert!(why.contains("refused by upstream `mock` (401)"), "{why}");
    // A client's own key refused (forwarded to the describer, visor having
    // none): that client's problem, not counted against visor's.
    let (image, _) = png_data_url("refused-client");
    let mut req = post_json(
        &visor.url("/v1/chat/completions"),
        chat_with_images("gpt-oss-120b", &[image]),
    );
    req.headers_mut().insert(
        "authorization",
        http::HeaderValue::from_static("Bearer sk-wrong"),
    );
    send(req).await;
    let m = visor.metrics().await;
    assert_eq!(
        metric(
            &m,
            "visor_credential_refused_total",
            &[("role", "describer"), ("upstream", "mock")]
        ),
        Some(1.0),
        "a client's key refused was counted: {m}"
    );
    // The key fixed: the next description succeeds, and it is ready.
    refuse.store(false, std::sync::atomic::Ordering::SeqCst);
    let (image, _) = png_data_url("refused-2");
    let body = chat_with_images("gpt-oss-120b", &[image]);
    send(post_json(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(readyz().await["status"], "ready");
}
