//! Streaming: chunk by chunk, disconnects, mid-stream failures, deadlines,
//! backpressure and draining at shutdown.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use support::*;
use tokio::time::Instant;

const BOUND: Duration = Duration::from_secs(5);

/// An upstream that sends two events and then breaks the connection.
async fn breaking_mock() -> MockUpstream {
    MockUpstream::builder()
        .fault(Fault::CutAfterChunks(2))
        .start()
        .await
}

/// An upstream that sends one event and then nothing, holding the stream
/// open.
async fn stalling_mock() -> MockUpstream {
    MockUpstream::builder()
        .fault(Fault::StallAfterChunks(1))
        .start()
        .await
}

#[tokio::test]
async fn each_chunk_reaches_the_client_before_the_next_is_sent() {
    let (mock, tx) = fed_once().await;
    let visor = Visor::for_mock(&mock, "").await;
    let resp = open_stream(&visor).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.into_body();
    for i in 0..5 {
        tx.send(Chunk::Data(sse_event(i))).await.unwrap();
        // The mock sends nothing more until the client has this one.
        let got = next_data(&mut body, BOUND).await.unwrap().unwrap();
        assert_eq!(got, sse_event(i));
    }
    tx.send(Chunk::Data(Bytes::from_static(b"data: [DONE]\n\n")))
        .await
        .unwrap();
    assert_eq!(
        next_data(&mut body, BOUND).await.unwrap().unwrap(),
        Bytes::from_static(b"data: [DONE]\n\n")
    );
    drop(tx);
    assert_eq!(next_data(&mut body, BOUND).await, Ok(None), "clean end");
}

#[tokio::test]
async fn client_disconnect_cancels_the_upstream_request() {
    let mock = stalling_mock().await;
    let visor = Visor::for_mock(&mock, "").await;
    let mut body = open_stream(&visor).await.into_body();
    next_data(&mut body, BOUND).await.unwrap().unwrap();
    let closed_before = mock.closed.load(std::sync::atomic::Ordering::SeqCst);
    drop(body); // the client goes away mid-stream
    assert!(
        mock.wait_closed(closed_before + 1, BOUND).await,
        "the upstream connection was not closed after the client left"
    );
    let text = visor.metrics().await;
    assert_eq!(metric(&text, "visor_inflight_requests", &[]), Some(0.0));
}

#[tokio::test]
async fn upstream_failing_mid_stream_cuts_the_client_stream_without_done() {
    let mock = breaking_mock().await;
    let visor = Visor::for_mock(&mock, "").await;
    let mut body = open_stream(&visor).await.into_body();
    let (text, end) = read_stream(&mut body, BOUND).await;
    assert!(end.is_err(), "the stream must end abnormally, got {end:?}");
    assert!(text.contains("t0") && text.contains("t1"), "{text}");
    assert!(!text.contains("[DONE]"));
    assert_eq!(upstream_errors(&visor, "reset").await, Some(1.0));
}

/// Paused time (one worker, so all of visor runs on the test's clock): the
/// 30 s gap costs nothing, and the cut comes at the deadline.
#[tokio::test(start_paused = true)]
async fn idle_gap_deadline_cuts_a_stalled_stream() {
    let mock = stalling_mock().await;
    let visor = Visor::for_mock(&mock, "[server]\nworkers = 1\nidle_timeout_secs = 30\n").await;
    let mut body = open_stream(&visor).await.into_body();
    assert_eq!(
        next_data(&mut body, BOUND).await.unwrap().unwrap(),
        sse_event(0)
    );
    let since = Instant::now();
    // Nothing more is sent: visor must cut the stream itself.
    let end = next_data(&mut body, PAUSED_BOUND).await;
    assert_cut(&end);
    assert_at(since.elapsed(), Duration::from_secs(30));
    assert_eq!(upstream_errors(&visor, "idle_timeout").await, Some(1.0));
}

/// Paused time: an event every 100 ms for 20 s, cut at the 5 s deadline.
#[tokio::test(start_paused = true)]
async fn total_deadline_cuts_a_stream_that_keeps_talking() {
    let (mock, tx) = fed_once().await;
    let visor = Visor::for_mock(&mock, "[server]\nworkers = 1\nrequest_timeout_secs = 5\n").await;
    let started = Instant::now();
    let resp = open_stream(&visor).await;
    let feeder = tokio::spawn(async move {
        for i in 0..200 {
            if tx.send(Chunk::Data(sse_event(i))).await.is_err() {
                return i;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        200
    });
    let mut body = resp.into_body();
    let (_, end) = read_stream(&mut body, BOUND).await;
    assert_cut(&end);
    assert_at(started.elapsed(), Duration::from_secs(5));
    let sent = feeder.await.unwrap();
    assert!(sent < 200, "the upstream stream should have been cancelled");
    assert_eq!(upstream_errors(&visor, "request_timeout").await, Some(1.0));
}

/// Paused time: "stalled for 2 s" is two virtual seconds with nothing
/// left to run.
#[tokio::test(start_paused = true)]
async fn a_client_that_does_not_read_holds_back_the_upstream() {
    let (mock, tx) = fed_once().await;
    let visor = Visor::for_mock(&mock, "[server]\nworkers = 1\n").await;
    let resp = open_stream(&visor).await;
    const CHUNKS: usize = 1024;
    const SIZE: usize = 64 * 1024; // 64 MiB in all: far more than socket buffers hold
    let mut feeder = tokio::spawn(async move {
        let chunk = Bytes::from(vec![b'x'; SIZE]);
        for _ in 0..CHUNKS {
            tx.send(Chunk::Data(chunk.clone())).await.unwrap();
        }
    });
    // Without backpressure the feeder would finish at once; it must stall
    // while the client reads nothing.
    let stalled = tokio::time::timeout(Duration::from_secs(2), &mut feeder)
        .await
        .is_err();
    assert!(stalled, "the upstream was read ahead of the client");
    let total = tokio::time::timeout(Duration::from_secs(30), async {
        let mut body = resp.into_body();
        let mut n = 0;
        while let Some(f) = body.frame().await {
            if let Ok(d) = f.unwrap().into_data() {
                n += d.len();
            }
            if n == CHUNKS * SIZE {
                break;
            }
        }
        n
    })
    .await
    .unwrap();
    assert_eq!(total, CHUNKS * SIZE);
    feeder.await.unwrap();
}

#[tokio::test]
async fn shutdown_lets_an_open_stream_finish_then_returns() {
    let (mock, tx) = fed_once().await;
    let mut visor = Visor::for_mock(&mock, "[server]\ndrain_timeout_secs = 10\n").await;
    let resp = open_stream(&visor).await;
    tx.send(Chunk::Data(sse_event(0))).await.unwrap();
    let mut body = resp.into_body();
    next_data(&mut body, BOUND).await.unwrap().unwrap();

    visor.shutdown();
    // Draining: readiness turns off and new connections are refused…
    let draining = tokio::time::timeout(BOUND, async {
        while !visor
            .state
            .life
            .draining
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(draining.is_ok());
    let refused = tokio::time::timeout(BOUND, async {
        // Each worker closes its listener as it sees the stop.
        while tokio::net::TcpStream::connect(visor.addr).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(
        refused.is_ok(),
        "new connections must be refused while draining"
    );
    // …while the open stream goes on to its end.
    tx.send(Chunk::Data(sse_event(1))).await.unwrap();
    assert_eq!(
        next_data(&mut body, BOUND).await.unwrap().unwrap(),
        sse_event(1)
    );
    tx.send(Chunk::Data(Bytes::from_static(b"data: [DONE]\n\n")))
        .await
        .unwrap();
    next_data(&mut body, BOUND).await.unwrap().unwrap();
    drop(tx);
    assert_eq!(next_data(&mut body, BOUND).await, Ok(None));
    let task = visor.task.take().unwrap();
    let done = tokio::time::timeout(BOUND, task).await;
    assert!(
        matches!(done, Ok(Ok(Ok(())))),
        "run() must return Ok after draining"
    );
}

#[tokio::test]
async fn over_http2_chunks_stream_and_a_mid_stream_failure_resets_the_stream() {
    let mock = breaking_mock().await;
    let visor = Visor::for_mock(&mock, "").await;
    let h2 = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<http_body_util::Full<Bytes>>();
    let req = post_json(
        &visor.url("/v1/chat/completions"),
        r#"{"model":"m","stream":true,"messages":[]}"#,
    );
    let resp = tokio::time::timeout(BOUND, h2.request(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let (text, end) = read_stream(&mut body, BOUND).await;
    assert!(text.contains("t0") && text.contains("t1"), "{text}");
    let err = end.expect_err("the HTTP/2 stream must end with an error");
    assert!(!err.contains("bound"), "{err}");
}

/// Paused time: the head at 6 s, the cut 3 s after its one event.
#[tokio::test(start_paused = true)]
async fn a_slow_head_within_the_first_byte_deadline_still_gets_the_idle_check() {
    // The head takes longer than one idle gap (allowed: it is under the
    // first-byte deadline); then the body stalls after one event.
    let mock = MockUpstream::start(|_| {
        Reply::After(Duration::from_secs(6), Box::new(Reply::stall_after(1)))
    })
    .await;
    let visor = Visor::for_mock(
        &mock,
        "[server]\nworkers = 1\nidle_timeout_secs = 3\nfirst_byte_timeout_secs = 50\n",
    )
    .await;
    let started = Instant::now();
    let resp = open_stream(&visor).await;
    assert_eq!(
        resp.status(),
        200,
        "a head under the first-byte deadline is not a timeout"
    );
    assert_at(started.elapsed(), Duration::from_secs(6));
    let since = Instant::now();
    let mut body = resp.into_body();
    let (text, end) = read_stream(&mut body, BOUND).await;
    assert!(text.contains("t0"), "{text}");
    assert_cut(&end);
    assert_at(since.elapsed(), Duration::from_secs(3));
    assert_eq!(upstream_errors(&visor, "idle_timeout").await, Some(1.0));
}
