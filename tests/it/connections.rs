//! Client connections: header timeouts, idle HTTP/2 connections, the
//! connection limit and who gets in at it, and the drain delay.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Waits (bounded) until the peer closes `s`; true if it did.
async fn closed_within(s: &mut TcpStream, bound: Duration) -> bool {
    let mut buf = [0u8; 1024];
    tokio::time::timeout(bound, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

async fn healthz_on_new_connection(visor: &Visor, bound: Duration) -> Option<u16> {
    let fut = async {
        let mut s = TcpStream::connect(visor.addr).await.ok()?;
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.ok()?;
        let text = String::from_utf8_lossy(&out).into_owned();
        text.split(' ').nth(1)?.parse().ok()
    };
    tokio::time::timeout(bound, fut).await.ok().flatten()
}

/// The tests that wait for a deadline run in paused time: one worker, so
/// all of visor runs on the test's clock, and the deadlines cost nothing.
const CFG: &str = "[server]\nworkers = 1\nheader_timeout_secs = 1\n";

#[tokio::test(start_paused = true)]
async fn silent_peers_and_a_partial_preface_are_closed_at_the_header_timeout() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, CFG).await;
    let started = Instant::now();
    let mut silent = TcpStream::connect(visor.addr).await.unwrap();
    let mut preface = TcpStream::connect(visor.addr).await.unwrap();
    preface.write_all(b"P").await.unwrap();
    let mut half_head = TcpStream::connect(visor.addr).await.unwrap();
    half_head
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    for (name, s) in [
        ("silent", &mut silent),
        ("P of the preface", &mut preface),
        ("half a head", &mut half_head),
    ] {
        assert!(
            closed_within(s, Duration::from_secs(8)).await,
            "{name}: still open"
        );
    }
    assert_at(started.elapsed(), Duration::from_secs(1));
    let m = visor.metrics().await;
    assert!(
        metric(
            &m,
            "visor_client_connections_closed_total",
            &[("reason", "header_timeout")]
        )
        .unwrap_or(0.0)
            >= 2.0,
        "{m}"
    );
    // Still serving.
    assert_eq!(
        healthz_on_new_connection(&visor, Duration::from_secs(5)).await,
        Some(200)
    );
}

#[tokio::test(start_paused = true)]
async fn an_idle_http2_connection_is_closed_and_a_busy_one_is_not() {
    let (mock, tx) = fed_once().await;
    let visor = Visor::for_mock(&mock, CFG).await;
    let stream = TcpStream::connect(visor.addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    // A stream that stays open longer than the idle limit keeps it open.
    let req = post_json(&visor.url("/v1/chat/completions"), CHAT_STREAM);
    let resp = sender.send_request(req).await.unwrap();
    let mut body = resp.into_body();
    tx.send(Chunk::Data(Bytes::from_static(b"data: {}\n\n")))
        .await
        .unwrap();
    assert!(body.frame().await.is_some());
    // Busy for twice the idle limit: the connection must stay.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(2500) {
        tx.send(Chunk::Data(Bytes::from_static(b"data: {}\n\n")))
            .await
            .unwrap();
        assert!(body.frame().await.is_some(), "the busy stream was cut");
        assert!(!conn.is_finished(), "a busy HTTP/2 connection was closed");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    drop(tx);
    while let Some(Ok(_)) = body.frame().await {}
    drop(body);
    let idle = Instant::now();
    // Now idle: closed (GOAWAY) within the limit and a margin.
    let done = tokio::time::timeout(Duration::from_secs(8), conn).await;
    assert!(done.is_ok(), "the idle HTTP/2 connection is still open");
    assert_at(idle.elapsed(), Duration::from_secs(1));
    let m = visor.metrics().await;
    assert_eq!(
        metric(
            &m,
            "visor_client_connections_closed_total",
            &[("reason", "idle")]
        ),
        Some(1.0),
        "{m}"
    );
}

/// Paused time: the 200 ms windows are virtual; a peer closed by its
/// header timeout instead would not count as shed.
#[tokio::test(start_paused = true)]
async fn at_max_connections_idle_peers_make_room_and_busy_ones_do_not() {
    let (mock, tx) = fed_once().await;
    let visor = Visor::for_mock(
        &mock,
        "[server]\nmax_connections = 3\nheader_timeout_secs = 60\nworkers = 1\n",
    )
    .await;
    // Three silent peers hold every slot (and would for a minute)…
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(TcpStream::connect(visor.addr).await.unwrap());
    }
    // …and /healthz still answers: the longest-idle one makes room.
    assert_eq!(
        healthz_on_new_connection(&visor, Duration::from_secs(5)).await,
        Some(200)
    );
    let mut shed = 0;
    for s in &mut silent {
        if closed_within(s, Duration::from_millis(200)).await {
            shed += 1;
        }
    }
    assert!(shed >= 1, "no idle peer was closed to make room");
    let m = visor.metrics().await;
    assert!(
        metric(
            &m,
            "visor_client_connections_closed_total",
            &[("reason", "shed")]
        )
        .unwrap_or(0.0)
            >= 1.0
    );
    drop(silent);

    // A connection with a request in flight is never closed to make room.
    let mut body = open_stream(&visor).await.into_body();
    for _ in 0..8 {
        assert_eq!(
            healthz_on_new_connection(&visor, Duration::from_secs(5)).await,
            Some(200)
        );
    }
    tx.send(Chunk::Data(Bytes::from_static(b"data: {\"x\":1}\n\n")))
        .await
        .unwrap();
    let frame = tokio::time::timeout(Duration::from_secs(5), body.frame())
        .await
        .unwrap();
    assert!(
        matches!(frame, Some(Ok(_))),
        "the busy stream was cut: {frame:?}"
    );
    drop(tx);
}

#[tokio::test(start_paused = true)]
async fn at_shutdown_readyz_says_draining_for_the_drain_delay_while_serving() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let mut visor = Visor::for_mock(&mock, "[server]\nworkers = 1\ndrain_delay_secs = 2\n").await;
    let client = client();
    let started = Instant::now();
    visor.shutdown();
    // 503 on /readyz, yet requests still served, on new connections too.
    let ready = tokio::time::timeout(Duration::from_secs(1), async {
        loop {
            let (status, _, _) = send_on(
                &client,
                Request::get(visor.url("/readyz"))
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
            .await;
            if status == 503 {
                return;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(ready.is_ok(), "/readyz never said draining");
    let (status, _, _) = post_chat(&visor, CHAT).await;
    assert_eq!(status, 200, "not serving during the drain delay");
    let task = visor.task.take().unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), task).await;
    assert!(ended.is_ok(), "did not stop after the drain delay");
    assert_at(started.elapsed(), Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn an_idle_keep_alive_http1_connection_is_closed_at_the_header_timeout() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, CFG).await;
    let mut s = TcpStream::connect(visor.addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    while http_message_len(&got).is_none() {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed before the response");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(got.starts_with(b"HTTP/1.1 200"));
    let idle = Instant::now();
    // Kept alive, then idle: closed after about a second.
    assert!(
        closed_within(&mut s, Duration::from_secs(8)).await,
        "an idle keep-alive connection stayed open"
    );
    assert_at(idle.elapsed(), Duration::from_secs(1));
}

/// Two connections under a limit of two: nobody is waiting, so neither is
/// closed to make room (a slot is taken only for a peer that came).
/// Paused time: the wait past the grace costs nothing.
#[tokio::test(start_paused = true)]
async fn no_connection_is_shed_while_nobody_waits() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(
        &mock,
        "[server]\nmax_connections = 2\nworkers = 1\nheader_timeout_secs = 30\n",
    )
    .await;
    let (a, b) = (client(), client());
    let get = || {
        Request::get(visor.url("/healthz"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    assert_eq!(send_on(&a, get()).await.0, 200);
    assert_eq!(send_on(&b, get()).await.0, 200);
    // Well past the 200 ms grace: still nobody shed.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(send_on(&a, get()).await.0, 200);
    // Read on `a`'s own connection: a third one would be a peer waiting.
    let (_, _, body) = send_on(
        &a,
        Request::get(visor.url("/metrics"))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    let m = String::from_utf8(body.to_vec()).unwrap();
    assert_eq!(
        metric(
            &m,
            "visor_client_connections_closed_total",
            &[("reason", "shed")]
        ),
        None,
        "{m}"
    );
}

/// The workers share their port (SO_REUSEPORT), which another process could
/// join: a second visor on a port that is served refuses to start instead
/// of taking part of the first one's traffic.
#[tokio::test]
async fn a_second_visor_on_a_served_port_refuses_to_start() {
    let mock = MockUpstream::start(|_| Reply::json(200, "{}")).await;
    let toml = format!(
        "[server]\nworkers = 2\n[[upstream]]\nname = \"mock\"\nbase_url = \"{}/v1\"\n",
        mock.url()
    );
    let first = Visor::start(&toml).await;
    let mut cfg =
        visor::config::Config::from_toml(&toml, std::path::Path::new("t.toml"), &|_| None).unwrap();
    cfg.server.data_dir = temp_dir("second-visor");
    let second = visor::server::Server::bind(cfg, Some(first.addr)).await;
    let Err(e) = second else {
        panic!("a second visor started on {}", first.addr)
    };
    assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
    assert!(e.to_string().contains("already served"), "{e}");
    // The first one still answers all requests.
    for _ in 0..4 {
        let (status, _, _) = send(
            Request::get(first.url("/healthz"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await;
        assert_eq!(status, 200);
    }
}
