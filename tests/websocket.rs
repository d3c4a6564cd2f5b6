//! The Responses WebSocket mode through visor, against a WebSocket mock
//! upstream on loopback: handshake headers as for HTTP, each
//! `response.create` transformed (images for a text-only model), server
//! events relayed in order and counted, a client that leaves closes the
//! upstream socket, other upgrades pass untouched, refusals pass through.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// tungstenite's handshake callback returns its own large error type.
#![allow(clippy::result_large_err)]

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use support::*;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

const BOUND: Duration = Duration::from_secs(10);

/// What the mock saw.
#[derive(Default)]
struct Seen {
    paths: Vec<String>,
    headers: Vec<http::HeaderMap>,
    events: Vec<String>,
    /// Binary messages (as they came).
    binaries: Vec<Vec<u8>>,
    /// Pings received.
    pings: usize,
    closed: usize,
}

/// A WebSocket upstream: answers each `response.create` with three events
/// (the last `response.completed` with usage: 11 input tokens, or the
/// create's `metadata.input_tokens`), echoes anything else; a
/// handshake with `authorization: Bearer bad` is refused with 401.
async fn ws_mock() -> (String, Arc<Mutex<Seen>>, mpsc::UnboundedReceiver<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (closed_tx, closed_rx) = mpsc::unbounded_channel();
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (s, closed_tx) = (s.clone(), closed_tx.clone());
            tokio::spawn(async move {
                let s2 = s.clone();
                let callback =
                    move |req: &Request, resp: Response| -> Result<Response, ErrorResponse> {
                        let mut seen = s2.lock().unwrap();
                        seen.paths.push(req.uri().path().to_owned());
                        seen.headers.push(req.headers().clone());
                        if req
                            .headers()
                            .get("authorization")
                            .is_some_and(|v| v == "Bearer bad")
                        {
                            let mut e = ErrorResponse::new(Some(
                                "{\"error\":{\"message\":\"bad key\"}}".to_owned(),
                            ));
                            *e.status_mut() = http::StatusCode::UNAUTHORIZED;
                            return Err(e);
                        }
                        Ok(resp)
                    };
                let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(stream, callback).await else {
                    return;
                };
                // `"metadata": {"mute": true}`: nothing more is answered on
                // this socket (a stalled upstream), events still recorded.
                let mut mute = false;
                while let Some(Ok(m)) = ws.next().await {
                    let t = match m {
                        Message::Text(t) => t,
                        Message::Binary(b) => {
                            s.lock().unwrap().binaries.push(b.to_vec());
                            continue;
                        }
                        Message::Ping(_) => {
                            s.lock().unwrap().pings += 1;
                            continue;
                        }
                        Message::Close(_) => break,
                        _ => continue,
                    };
                    s.lock().unwrap().events.push(t.to_string());
                    let v: Value = serde_json::from_str(&t).unwrap_or_default();
                    mute |= v["metadata"]["mute"] == true;
                    if mute {
                        continue;
                    }
                    // `"metadata": {"flood": true}`: 1 MiB deltas until the
                    // socket breaks (a reader that keeps up gets 1000).
                    if v["metadata"]["flood"] == true {
                        let delta = json!({"type": "response.output_text.delta", "delta": "x".repeat(1 << 20)}).to_string();
                        for _ in 0..1000 {
                            if ws.send(Message::Text(delta.clone().into())).await.is_err() {
                                break;
                            }
                        }
                        break;
                    }
                    // `"metadata": {"stall": true}`: only the first event,
                    // then nothing (a response under way).
                    let stall = v["metadata"]["stall"] == true;
                    // `"metadata": {"input_tokens": N}`: the usage to say.
                    let input_tokens = v["metadata"]["input_tokens"].as_u64().unwrap_or(11);
                    // `"metadata": {"pause": true}`: after `response.created`,
                    // the next client event is answered with an `error`
                    // first, then the response goes on.
                    let pause = v["metadata"]["pause"] == true;
                    // `"metadata": {"text": N}`: `response.created`, one
                    // delta of N bytes, then nothing (no usage comes).
                    if v["type"] == "response.create"
                        && let Some(n) = v["metadata"]["text"].as_u64()
                    {
                        let created = json!({"response": {"id": "resp_t", "status": "in_progress"}, "type": "response.created"});
                        let delta = json!({"type": "response.output_text.delta", "delta": "x".repeat(n as usize)});
                        for e in [created, delta] {
                            if ws.send(Message::Text(e.to_string().into())).await.is_err() {
                                break;
                            }
                        }
                        continue;
                    }
                    if v["type"] == "response.create" {
                        for (k, e) in [
                            // As OpenAI sends it: `error: null` early in the event.
                            json!({"response": {"id": "resp_1", "status": "in_progress", "error": null}, "type": "response.created"}),
                            json!({"type": "response.output_text.delta", "delta": "hi"}),
                            json!({"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "usage": {"input_tokens": input_tokens, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 4}}}}),
                        ]
                        .into_iter()
                        .take(if stall { 1 } else { 3 })
                        .enumerate()
                        {
                            if pause && k == 1 {
                                if let Some(Ok(Message::Text(t))) = ws.next().await {
                                    s.lock().unwrap().events.push(t.to_string());
                                }
                                let error = json!({"type": "error", "error": {"type": "invalid_request_error", "message": "unknown event type"}});
                                if ws.send(Message::Text(error.to_string().into())).await.is_err() {
                                    break;
                                }
                            }
                            if ws.send(Message::Text(e.to_string().into())).await.is_err() {
                                break;
                            }
                        }
                    } else if ws.send(Message::Text(t)).await.is_err() {
                        break;
                    }
                }
                s.lock().unwrap().closed += 1;
                let _ = closed_tx.send(());
            });
        }
    });
    (format!("http://{addr}"), seen, closed_rx)
}

type Ws = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

/// Opens a client WebSocket (the `connect` feature of tokio-tungstenite is
/// not built: a TCP stream and the client handshake).
async fn connect(
    req: impl IntoClientRequest + Unpin,
) -> Result<
    (
        Ws,
        tokio_tungstenite::tungstenite::handshake::client::Response,
    ),
    tokio_tungstenite::tungstenite::Error,
> {
    let req = req.into_client_request()?;
    let host = req.uri().host().unwrap().to_owned();
    let port = req.uri().port_u16().unwrap();
    let stream = tokio::net::TcpStream::connect((host.as_str(), port))
        .await
        .unwrap();
    tokio_tungstenite::client_async(req, stream).await
}

async fn visor_for(upstream: &str) -> Visor {
    Visor::start(&format!(
        "[images]\nnon_vision = \"strip\"\n[[upstream]]\nname = \"ws\"\nbase_url = \"{upstream}/v1\"\nmodels = [\"*\"]\n"
    ))
    .await
}

async fn next_text<S>(ws: &mut S) -> Value
where
    S: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    // One bound for the whole wait (messages skipped do not extend it).
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let m = tokio::time::timeout_at(deadline, ws.next())
            .await
            .expect("an event within the bound")
            .expect("the socket is open")
            .unwrap();
        if let Message::Text(t) = m {
            return serde_json::from_str(&t).unwrap();
        }
    }
}

#[tokio::test]
async fn responses_websocket_mode_is_transformed_relayed_and_counted() {
    let (up, seen, mut closed) = ws_mock().await;
    let visor = visor_for(&up).await;
    let mut req = format!("ws://{}/v1/responses", visor.addr)
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("authorization", "Bearer sk-client".parse().unwrap());
    req.headers_mut().insert(
        "openai-beta",
        "responses_websockets=2026-02-06".parse().unwrap(),
    );
    req.headers_mut()
        .insert("x-visor-history", "3".parse().unwrap());
    let (mut ws, resp) = tokio::time::timeout(BOUND, connect(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 101);
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.paths, ["/v1/responses"]);
        let h = &seen.headers[0];
        assert_eq!(h["authorization"], "Bearer sk-client");
        assert_eq!(h["openai-beta"], "responses_websockets=2026-02-06");
        assert!(h.get("x-visor-history").is_none());
        assert!(h.get("x-request-id").is_some());
    }

    // A screenshot to a text-only model: replaced before it goes upstream.
    let (image, _) = png_data_url("ws-shot");
    let create = json!({"type": "response.create", "model": "gpt-oss-120b", "input": [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "what is on screen?"},
            {"type": "input_image", "image_url": image}]}]});
    ws.send(Message::Text(create.to_string().into()))
        .await
        .unwrap();
    let types: Vec<Value> = vec![
        next_text(&mut ws).await["type"].clone(),
        next_text(&mut ws).await["type"].clone(),
        next_text(&mut ws).await["type"].clone(),
    ];
    assert_eq!(
        types,
        [
            "response.created",
            "response.output_text.delta",
            "response.completed"
        ]
    );
    let sent = seen.lock().unwrap().events[0].clone();
    assert!(!sent.contains(";base64,"), "{sent:.300}");
    let v: Value = serde_json::from_str(&sent).unwrap();
    assert_eq!(v["type"], "response.create");
    let part = &v["input"][0]["content"][1];
    assert_eq!(part["type"], "input_text");
    assert!(part["text"].as_str().unwrap().starts_with("[image sha256:"));

    // Other client events pass as they came.
    ws.send(Message::Text("{\"type\":\"ping\",\"n\":1}".into()))
        .await
        .unwrap();
    assert_eq!(next_text(&mut ws).await, json!({"type": "ping", "n": 1}));

    // Counted as one request, with its tokens.
    let m = visor.metrics().await;
    assert_eq!(
        metric(
            &m,
            "visor_requests_total",
            &[("upstream", "ws"), ("status", "200")]
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "visor_tokens_total", &[("kind", "prompt")]),
        Some(11.0)
    );
    assert_eq!(
        metric(&m, "visor_tokens_total", &[("kind", "cached_read")]),
        Some(4.0)
    );

    // The client leaves without a close frame: the upstream socket closes.
    drop(ws);
    let gone = tokio::time::timeout(BOUND, closed.recv()).await;
    assert!(gone.is_ok(), "the upstream socket stayed open");

    // A client that closes properly gets visor's close frame back.
    let (mut ws, _) = connect(format!("ws://{}/v1/responses", visor.addr))
        .await
        .unwrap();
    ws.close(None).await.unwrap();
    let end = tokio::time::timeout(BOUND, ws.next()).await.unwrap();
    assert!(
        matches!(end, Some(Ok(Message::Close(_))) | None),
        "no close handshake: {end:?}"
    );
    assert!(tokio::time::timeout(BOUND, closed.recv()).await.is_ok());
}

#[tokio::test]
async fn other_upgrades_pass_untouched_and_refusals_pass_through() {
    let (up, seen, _closed) = ws_mock().await;
    let visor = visor_for(&up).await;
    let (mut ws, _) = connect(format!("ws://{}/v1/realtime?model=x", visor.addr))
        .await
        .unwrap();
    let (image, _) = png_data_url("realtime");
    let event = json!({"type": "conversation.item.create", "item": {"content": [{"type": "input_image", "image_url": image}]}}).to_string();
    ws.send(Message::Text(event.clone().into())).await.unwrap();
    let echoed = next_text(&mut ws).await;
    assert_eq!(
        echoed.to_string(),
        serde_json::from_str::<Value>(&event).unwrap().to_string()
    );
    assert_eq!(seen.lock().unwrap().events[0], event, "byte for byte");
    assert_eq!(seen.lock().unwrap().paths[0], "/v1/realtime");

    // The upstream refuses the handshake: its 401 reaches the client.
    let mut req = format!("ws://{}/v1/responses", visor.addr)
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("authorization", "Bearer bad".parse().unwrap());
    match connect(req).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => assert_eq!(resp.status(), 401),
        other => panic!("expected a 401, got {:?}", other.map(|(_, r)| r.status())),
    }

    // No upstream listening: 502 in the OpenAI error shape.
    let refusing = MockUpstream::builder()
        .fault(Fault::RefuseConnect)
        .start()
        .await;
    let dead = visor_for(&refusing.url()).await;
    match connect(format!("ws://{}/v1/responses", dead.addr)).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            assert_eq!(resp.status(), 502);
            assert_eq!(
                error_code(resp.body().as_deref().unwrap_or_default()),
                "upstream_unreachable"
            );
        }
        other => panic!("expected a 502, got {:?}", other.map(|(_, r)| r.status())),
    }
}

/// An open WebSocket holds its connection's slot under max_connections
/// until it ends (it is not an idle connection that can make room).
/// Paused time (one worker: all of visor on the test's clock): "not
/// answered within a second" is a second with nothing else left to run.
#[tokio::test(start_paused = true)]
async fn an_open_websocket_counts_against_max_connections() {
    let (up, _seen, _closed) = ws_mock().await;
    let visor = Visor::start(&format!(
        "[server]\nmax_connections = 1\nworkers = 1\n[[upstream]]\nname = \"ws\"\nbase_url = \"{up}/v1\"\nmodels = [\"*\"]\n"
    ))
    .await;
    let addr = visor.addr;
    let healthz = move || async move {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(
            &mut s,
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await
        .unwrap();
        let mut out = Vec::new();
        let _ = tokio::io::AsyncReadExt::read_to_end(&mut s, &mut out).await;
        out
    };

    // A socket with a response under way holds its slot: a new connection
    // waits (here: not answered within a second).
    let (mut ws, _) = connect(format!("ws://{}/v1/responses", visor.addr))
        .await
        .unwrap();
    let stalled = json!({"type": "response.create", "model": "gpt-5.1", "metadata": {"stall": true}, "input": []});
    ws.send(Message::Text(stalled.to_string().into()))
        .await
        .unwrap();
    assert_eq!(next_text(&mut ws).await["type"], "response.created");
    let waiting = tokio::spawn(healthz());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !waiting.is_finished(),
        "a new connection got in past the limit"
    );
    // The socket ends: the waiting connection is served.
    ws.close(None).await.unwrap();
    let out = tokio::time::timeout(BOUND, waiting).await.unwrap().unwrap();
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&out)
    );

    // An idle socket (nothing under way; pings are not activity) is asked
    // to make room, as an idle connection is: the health check gets in,
    // the socket hears 1001.
    let (mut idle, _) = connect(format!("ws://{}/v1/responses", visor.addr))
        .await
        .unwrap();
    idle.send(Message::Ping(vec![1].into())).await.unwrap();
    let out = tokio::time::timeout(BOUND, healthz())
        .await
        .expect("the health check got in");
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    let code = tokio::time::timeout(BOUND, async {
        loop {
            match idle.next().await {
                Some(Ok(Message::Close(frame))) => return frame.map(|f| f.code),
                Some(Ok(_)) => continue,
                _ => return None,
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(code, Some(CloseCode::Away));
}

#[tokio::test]
async fn shutdown_closes_an_open_websocket_going_away_and_waits_for_it() {
    let (up, seen, mut closed) = ws_mock().await;
    let mut visor = visor_for(&up).await;
    let url = format!("ws://{}/v1/responses", visor.addr);
    let (mut ws, resp) = tokio::time::timeout(BOUND, connect(url))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 101);
    // The socket works, then visor is told to stop.
    ws.send(Message::Text("{\"type\":\"ping\"}".into()))
        .await
        .unwrap();
    assert_eq!(next_text(&mut ws).await["type"], "ping");
    visor.shutdown();
    let frame = loop {
        match tokio::time::timeout(BOUND, ws.next())
            .await
            .expect("a close frame within the bound")
        {
            Some(Ok(Message::Close(f))) => break f,
            Some(Ok(_)) => continue,
            other => panic!("the socket ended without a close frame: {other:?}"),
        }
    };
    let frame = frame.expect("a close code");
    assert_eq!(frame.code, CloseCode::Away);
    assert_eq!(frame.reason, "server shutting down");
    tokio::time::timeout(BOUND, closed.recv())
        .await
        .expect("the upstream socket is closed too");
    assert_eq!(seen.lock().unwrap().closed, 1);
    // visor's serve returns once the socket is done (it is on the tracked
    // task set shutdown waits for).
    let served = tokio::time::timeout(BOUND, visor.task.take().unwrap())
        .await
        .expect("shutdown finishes within the bound");
    served.unwrap().unwrap();
    assert!(visor.state.life.tasks.is_empty());
}

/// A response under way when shutdown starts gets the drain timeout to
/// finish, no longer: then both sides are closed (1001) and shutdown ends.
#[tokio::test]
async fn shutdown_gives_a_response_under_way_the_drain_timeout() {
    let (up, _seen, mut closed) = ws_mock().await;
    let mut visor = Visor::start(&format!(
        "[server]\ndrain_timeout_secs = 0.5\n[[upstream]]\nname = \"ws\"\nbase_url = \"{up}/v1\"\nmodels = [\"*\"]\n"
    ))
    .await;
    let url = format!("ws://{}/v1/responses", visor.addr);
    let (mut ws, _) = tokio::time::timeout(BOUND, connect(url))
        .await
        .unwrap()
        .unwrap();
    let create = json!({"type": "response.create", "model": "gpt-4o", "metadata": {"stall": true},
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]});
    ws.send(Message::Text(create.to_string().into()))
        .await
        .unwrap();
    assert_eq!(next_text(&mut ws).await["type"], "response.created");
    let asked = std::time::Instant::now();
    visor.shutdown();
    let frame = loop {
        match tokio::time::timeout(BOUND, ws.next())
            .await
            .expect("a close frame within the bound")
        {
            Some(Ok(Message::Close(f))) => break f.expect("a close code"),
            Some(Ok(_)) => continue,
            other => panic!("the socket ended without a close frame: {other:?}"),
        }
    };
    assert_eq!(frame.code, CloseCode::Away);
    assert_eq!(frame.reason, "server shutting down");
    // Not before the response had its drain timeout.
    assert!(
        asked.elapsed() >= Duration::from_millis(400),
        "{:?}",
        asked.elapsed()
    );
    tokio::time::timeout(BOUND, closed.recv())
        .await
        .expect("the upstream socket is closed too");
    let served = tokio::time::timeout(BOUND, visor.task.take().unwrap())
        .await
        .expect("shutdown finishes within the bound");
    served.unwrap().unwrap();
}

/// A `[[key]]` holds the WebSocket mode as it holds HTTP: each
/// `response.create` is a request of the key — a model outside its
/// `models` or a request over its limit is answered with an `error` event
/// (the HTTP status, code and headers) and never reaches the upstream, the
/// socket stays open; a Realtime upgrade names its model in the URL.
#[tokio::test]
async fn a_key_holds_each_response_create_to_its_models_and_limits() {
    let (up, seen, _closed) = ws_mock().await;
    let visor = Visor::start(&format!(
        "[[upstream]]\nname = \"ws\"\nbase_url = \"{up}/v1\"\nmodels = [\"*\"]\n\
         [[key]]\nname = \"team-a\"\nkey = \"sk-team-a\"\nrequests_per_minute = 2\nmodels = [\"gpt-5*\"]\n"
    ))
    .await;
    let open = |path: &str| {
        let mut req = format!("ws://{}{path}", visor.addr)
            .into_client_request()
            .unwrap();
        req.headers_mut()
            .insert("authorization", "Bearer sk-team-a".parse().unwrap());
        req
    };
    let (mut ws, _) = tokio::time::timeout(BOUND, connect(open("/v1/responses")))
        .await
        .unwrap()
        .unwrap();
    let create = |model: &str| {
        Message::Text(
            json!({"type": "response.create", "model": model, "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]})
            .to_string()
            .into(),
        )
    };
    // A model the key may not use.
    ws.send(create("o3-pro")).await.unwrap();
    let e = next_text(&mut ws).await;
    assert_eq!(e["type"], "error", "{e}");
    assert_eq!(e["status"], 403);
    assert_eq!(e["error"]["code"], "model_not_allowed");
    assert!(
        seen.lock().unwrap().events.is_empty(),
        "it reached the upstream"
    );
    // One without a model, for a key limited to some.
    ws.send(Message::Text(
        json!({"type": "response.create", "input": []})
            .to_string()
            .into(),
    ))
    .await
    .unwrap();
    let e = next_text(&mut ws).await;
    assert_eq!(
        (e["status"].clone(), e["error"]["code"].clone()),
        (json!(400), json!("invalid_request")),
        "{e}"
    );
    // Events a more lenient upstream could read as naming another model
    // are refused as HTTP refuses a body it cannot read (400
    // `invalid_json`): a lone surrogate, nesting past serde's depth,
    // `model` twice.
    let deep = format!(
        r#"{{"type":"response.create","model":"o3-pro","input":[],"metadata":{}{}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    for event in [
        Message::Text(
            r#"{"type":"response.create","model":"o3-pro","input":[],"metadata":{"n":"\ud800"}}"#
                .into(),
        ),
        Message::Text(deep.into()),
        Message::Text(
            r#"{"type":"response.create","model":"o3-pro","input":[],"model":"gpt-5.1"}"#.into(),
        ),
        // Not an object.
        Message::Text(r#"[{"type":"response.create","model":"o3-pro","input":[]}]"#.into()),
        // `type` twice: not a create for the last-wins reader visor is.
        Message::Text(
            r#"{"type":"response.create","model":"o3-pro","input":[],"Type":"x"}"#.into(),
        ),
    ] {
        ws.send(event).await.unwrap();
        let e = next_text(&mut ws).await;
        assert_eq!(e["status"], 400, "{e}");
        assert_eq!(e["error"]["code"], "invalid_json");
    }
    // A binary frame in UTF-8 is read as the same event in text: held to
    // the key's models.
    ws.send(Message::Binary(
        br#"{"type":"response.create","model":"o3-pro","input":[]}"#
            .to_vec()
            .into(),
    ))
    .await
    .unwrap();
    let e = next_text(&mut ws).await;
    assert_eq!(e["status"], 403, "{e}");
    assert_eq!(e["error"]["code"], "model_not_allowed");
    assert!(
        seen.lock().unwrap().events.is_empty(),
        "it reached the upstream"
    );
    // Allowed: relayed and answered, on the same socket.
    ws.send(create("gpt-5.1")).await.unwrap();
    assert_eq!(next_text(&mut ws).await["type"], "response.created");
    assert_eq!(
        next_text(&mut ws).await["type"],
        "response.output_text.delta"
    );
    assert_eq!(next_text(&mut ws).await["type"], "response.completed");
    // The limit is 2 a minute (a model refused is not counted, as over
    // HTTP): the second goes, the third is over.
    ws.send(create("gpt-5.1")).await.unwrap();
    for ty in [
        "response.created",
        "response.output_text.delta",
        "response.completed",
    ] {
        assert_eq!(next_text(&mut ws).await["type"], ty);
    }
    ws.send(create("gpt-5.1")).await.unwrap();
    let e = next_text(&mut ws).await;
    assert_eq!(e["status"], 429, "{e}");
    assert_eq!(e["error"]["code"], "rate_limit_exceeded");
    assert_eq!(e["headers"]["x-ratelimit-limit-requests"], "2");
    assert_eq!(e["headers"]["x-ratelimit-remaining-requests"], "0");
    assert!(
        e["headers"]["retry-after"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= 1
    );
    let sent: Vec<String> = seen.lock().unwrap().events.clone();
    assert_eq!(
        sent.len(),
        2,
        "only the allowed, in-limit ones went: {sent:?}"
    );
    assert!(sent.iter().all(|e| e.contains("gpt-5.1")));
    let m = visor.metrics().await;
    assert_eq!(
        metric(
            &m,
            "visor_requests_total",
            &[("upstream", "none"), ("model", "o3-pro"), ("status", "403")]
        ),
        Some(2.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "visor_requests_total",
            &[("upstream", "none"), ("status", "429")]
        ),
        Some(1.0),
        "{m}"
    );

    // Tokens: charged by the estimate, corrected by the usage before the
    // client hears `response.completed`, so the next create sees it.
    let visor = Visor::start(&format!(
        "[[upstream]]\nname = \"ws\"\nbase_url = \"{up}/v1\"\nmodels = [\"*\"]\n\
         [[key]]\nname = \"small\"\nkey = \"sk-team-a\"\ntokens_per_minute = 1000\n"
    ))
    .await;
    let mut req = format!("ws://{}/v1/responses", visor.addr)
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("authorization", "Bearer sk-team-a".parse().unwrap());
    let (mut small, _) = connect(req).await.unwrap();
    // Another client event is answered with an `error` while the response
    // is under way: that error does not end the response, whose usage is
    // still charged when it completes.
    let big = json!({"type": "response.create", "model": "gpt-5.1", "metadata": {"input_tokens": 5000, "pause": true}, "input": []});
    small
        .send(Message::Text(big.to_string().into()))
        .await
        .unwrap();
    assert_eq!(next_text(&mut small).await["type"], "response.created");
    small
        .send(Message::Text(r#"{"type":"nope"}"#.into()))
        .await
        .unwrap();
    for ty in ["error", "response.output_text.delta", "response.completed"] {
        assert_eq!(next_text(&mut small).await["type"], ty);
    }
    small.send(create("gpt-5.1")).await.unwrap();
    let e = next_text(&mut small).await;
    assert_eq!(e["status"], 429, "the usage was not counted: {e}");
    assert_eq!(e["headers"]["x-ratelimit-remaining-tokens"], "0");
    // Input that extends a response is held to the key too.
    let before = seen.lock().unwrap().events.len();
    small
        .send(Message::Text(
            r#"{"type":"response.steer","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"more"}]}]}"#.into(),
        ))
        .await
        .unwrap();
    let e = next_text(&mut small).await;
    assert_eq!(e["status"], 429, "{e}");
    assert_eq!(
        seen.lock().unwrap().events.len(),
        before,
        "the steer went upstream"
    );

    // A Realtime upgrade: its model is in the URL, refused before any
    // upstream is contacted; none named, for this key, is a 400.
    for (path, status, code) in [
        ("/v1/realtime?model=gpt-realtime", 403, "model_not_allowed"),
        ("/v1/realtime", 400, "invalid_request"),
        // Named twice (the second with its name encoded): refused, as
        // readers differ on which counts.
        (
            "/v1/realtime?model=gpt-5.1&mod%65l=gpt-realtime",
            400,
            "invalid_request",
        ),
        (
            "/v1/realtime?model=gpt-5.1&MODEL=gpt-realtime",
            400,
            "invalid_request",
        ),
    ] {
        match connect(open(path)).await {
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
                assert_eq!(resp.status(), status, "{path}");
                assert_eq!(error_code(resp.body().as_deref().unwrap_or_default()), code);
            }
            other => panic!(
                "{path}: expected {status}, got {:?}",
                other.map(|(_, r)| r.status())
            ),
        }
    }
    // The two Responses sockets reached the upstream; no Realtime one did.
    assert_eq!(
        seen.lock().unwrap().paths,
        ["/v1/responses", "/v1/responses"]
    );
}

/// RFC 6455 4.2.2: an upgrade asking for a version other than 13 (or none)
/// is 426 with `Sec-WebSocket-Version: 13`, in the OpenAI error shape,
/// and no upstream is contacted; version 13 is accepted.
#[tokio::test]
async fn an_unsupported_websocket_version_is_426_before_any_upstream() {
    let (up, seen, _closed) = ws_mock().await;
    let visor = visor_for(&up).await;
    for path in ["/v1/responses", "/v1/realtime?model=x"] {
        for version in [Some("8"), Some("14"), Some(""), None] {
            let mut req = http::Request::get(visor.url(path))
                .header("connection", "Upgrade")
                .header("upgrade", "websocket")
                .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==");
            if let Some(v) = version {
                req = req.header("sec-websocket-version", v);
            }
            let got = send(
                req.body(http_body_util::Full::new(bytes::Bytes::new()))
                    .unwrap(),
            )
            .await;
            assert_error(&got, 426, "unsupported_websocket_version");
            assert_eq!(got.1["sec-websocket-version"], "13", "{path} {version:?}");
        }
    }
    assert!(
        seen.lock().unwrap().paths.is_empty(),
        "no upstream handshake for a refused version"
    );
    // The version every client sends is accepted.
    let (mut ws, resp) = connect(format!("ws://{}/v1/responses", visor.addr))
        .await
        .unwrap();
    assert_eq!(resp.status(), 101);
    ws.close(None).await.unwrap();
}

/// The close frame the socket ends with (other messages before it are
/// skipped); a socket that ends without one fails the test.
async fn next_close<S>(ws: &mut S) -> CloseFrame
where
    S: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    // One bound for the whole wait (messages skipped do not extend it).
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        match tokio::time::timeout_at(deadline, ws.next())
            .await
            .expect("a close frame within the bound")
        {
            Some(Ok(Message::Close(Some(f)))) => return f,
            Some(Ok(Message::Close(None))) => panic!("a close frame without a code"),
            Some(Ok(_)) => continue,
            other => panic!("the socket ended without a close frame: {other:?}"),
        }
    }
}

/// A `response.create` with a screenshot, for `model` (none: the key is
/// left out).
fn create_with_image(model: Option<&str>, salt: &str) -> Value {
    let (image, _) = png_data_url(salt);
    let mut create = json!({"type": "response.create", "input": [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "what is on screen?"},
            {"type": "input_image", "image_url": image}]}]});
    if let Some(m) = model {
        create["model"] = json!(m);
    }
    create
}

async fn assert_answered<S>(ws: &mut S)
where
    S: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    for ty in [
        "response.created",
        "response.output_text.delta",
        "response.completed",
    ] {
        assert_eq!(next_text(ws).await["type"], ty);
    }
}

/// A `response.create` sent as a binary frame is read as the same event in
/// text (lenient servers parse a binary frame's bytes as JSON): its image
/// is replaced and it goes upstream as text. One that is not UTF-8 is
/// refused with an `error` event and goes nowhere.
#[tokio::test]
async fn a_binary_event_is_read_as_text_and_one_not_in_utf8_is_refused() {
    let (up, seen, _closed) = ws_mock().await;
    let visor = visor_for(&up).await;
    let (mut ws, _) =
        tokio::time::timeout(BOUND, connect(format!("ws://{}/v1/responses", visor.addr)))
            .await
            .unwrap()
            .unwrap();
    let create = create_with_image(Some("gpt-oss-120b"), "ws-binary");
    ws.send(Message::Binary(create.to_string().into_bytes().into()))
        .await
        .unwrap();
    assert_answered(&mut ws).await;
    {
        let seen = seen.lock().unwrap();
        assert!(seen.binaries.is_empty(), "a binary frame went upstream");
        assert_eq!(seen.events.len(), 1);
        assert!(
            !seen.events[0].contains(";base64,"),
            "{:.300}",
            seen.events[0]
        );
    }
    ws.send(Message::Binary(b"{\"type\":\"x\xff\xfe\"}".to_vec().into()))
        .await
        .unwrap();
    let e = next_text(&mut ws).await;
    assert_eq!(e["type"], "error", "{e}");
    assert_eq!(e["status"], 400, "{e}");
    assert_eq!(e["error"]["code"], "invalid_json", "{e}");
    // Nothing of it went upstream: the next event is the only one after the
    // create there.
    ws.send(Message::Text("{\"type\":\"ping\"}".into()))
        .await
        .unwrap();
    assert_eq!(next_text(&mut ws).await["type"], "ping");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.events.len(), 2, "{:?}", seen.events);
    assert!(seen.binaries.is_empty());
}

/// An event visor cannot read as it reads an HTTP body is refused on every
/// Responses socket, held to a key or not, with the code HTTP answers
/// (400 `invalid_json`), and never goes upstream with its image: a lone
/// surrogate, nesting past 128 levels, `model` twice.
#[tokio::test]
async fn an_event_visor_cannot_read_is_refused_on_every_responses_socket() {
    let (up, seen, _closed) = ws_mock().await;
    let visor = visor_for(&up).await;
    let (mut ws, _) =
        tokio::time::timeout(BOUND, connect(format!("ws://{}/v1/responses", visor.addr)))
            .await
            .unwrap()
            .unwrap();
    let with_image = create_with_image(Some("gpt-oss-120b"), "ws-unreadable").to_string();
    let body = with_image.trim_end_matches('}');
    let events = [
        format!(r#"{body},"metadata":{{"n":"\ud800"}}}}"#),
        format!(
            r#"{body},"metadata":{{"d":{}0{}}}}}"#,
            "[".repeat(130),
            "]".repeat(130)
        ),
        format!(r#"{body},"model":"gpt-4o"}}"#),
    ];
    for event in &events {
        ws.send(Message::Text(event.clone().into())).await.unwrap();
        let e = next_text(&mut ws).await;
        assert_eq!(e["type"], "error", "{e}");
        assert_eq!(e["status"], 400, "{e}");
        assert_eq!(e["error"]["code"], "invalid_json", "{e}");
    }
    ws.send(Message::Text("{\"type\":\"ping\"}".into()))
        .await
        .unwrap();
    assert_eq!(next_text(&mut ws).await["type"], "ping");
    assert_eq!(
        seen.lock().unwrap().events,
        ["{\"type\":\"ping\"}"],
        "an unreadable event went upstream"
    );
    // The same body over HTTP: the same code.
    let got = send(post_json(&visor.url("/v1/responses"), events[2].clone())).await;
    assert_error(&got, 400, "invalid_json");
}

/// Only `response.create` and `response.steer` say the model what follows
/// is for: a `session.update` naming a vision model does not let the next
/// create's image through to the text-only model it goes to.
#[tokio::test]
async fn only_a_create_or_a_steer_names_the_model_of_what_follows() {
    let (up, seen, _closed) = ws_mock().await;
    let visor = visor_for(&up).await;
    let (mut ws, _) =
        tokio::time::timeout(BOUND, connect(format!("ws://{}/v1/responses", visor.addr)))
            .await
            .unwrap()
            .unwrap();
    let first = json!({"type": "response.create", "model": "gpt-oss-120b", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]});
    ws.send(Message::Text(first.to_string().into()))
        .await
        .unwrap();
    assert_answered(&mut ws).await;
    let update = json!({"type": "session.update", "model": "gpt-4o"});
    ws.send(Message::Text(update.to_string().into()))
        .await
        .unwrap();
    assert_eq!(next_text(&mut ws).await["type"], "session.update");
    ws.send(Message::Text(
        create_with_image(None, "ws-carried").to_string().into(),
    ))
    .await
    .unwrap();
    assert_answered(&mut ws).await;
    let sent = seen.lock().unwrap().events[2].clone();
    assert!(
        !sent.contains(";base64,"),
        "the image went to a text-only model: {sent:.300}"
    );
}

/// What the client sends wrong ends its socket with a close frame that
/// says why, and the upstream socket is closed, nothing sent: 1007 text
/// that is not UTF-8, 1002 a protocol error (a reserved bit), 1009 an
/// event over `server.max_body_bytes`.
#[tokio::test]
async fn what_breaks_the_protocol_is_closed_with_its_code() {
    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
    let (up, seen, mut closed) = ws_mock().await;
    let visor = Visor::start(&format!(
        "[server]\nmax_body_bytes = 4096\n[[upstream]]\nname = \"ws\"\nbase_url = \"{up}/v1\"\nmodels = [\"*\"]\n"
    ))
    .await;
    let not_utf8 = Frame::message(vec![b'{', 0xff, 0xfe, b'}'], OpCode::Data(Data::Text), true);
    let mut reserved = Frame::message(b"{}".to_vec(), OpCode::Data(Data::Text), true);
    reserved.header_mut().rsv1 = true;
    let big = json!({"type": "response.create", "model": "gpt-4o", "input": [], "metadata": {"pad": "x".repeat(5000)}});
    for (message, code) in [
        (Message::Frame(not_utf8), CloseCode::Invalid),
        (Message::Frame(reserved), CloseCode::Protocol),
        (Message::Text(big.to_string().into()), CloseCode::Size),
        (
            Message::Binary(big.to_string().into_bytes().into()),
            CloseCode::Size,
        ),
    ] {
        let (mut ws, _) =
            tokio::time::timeout(BOUND, connect(format!("ws://{}/v1/responses", visor.addr)))
                .await
                .unwrap()
                .unwrap();
        ws.send(message).await.unwrap();
        let frame = next_close(&mut ws).await;
        assert_eq!(frame.code, code, "{frame:?}");
        tokio::time::timeout(BOUND, closed.recv())
            .await
            .expect("the upstream socket is closed");
    }
    let seen = seen.lock().unwrap();
    assert!(seen.events.is_empty(), "{:?}", seen.events);
    assert!(seen.binaries.is_empty());
}

/// While a response is under way only the upstream's messages restart its
/// idle deadline: a client that keeps sending does not hide a stalled
/// upstream (closed 1011 after idle_timeout_secs, counted as an idle
/// timeout).
#[tokio::test]
async fn client_events_do_not_restart_the_upstream_idle_deadline() {
    let (up, _seen, _closed) = ws_mock().await;
    let visor = Visor::start(&format!(
        "[server]\nidle_timeout_secs = 1\n[[upstream]]\nname = \"ws\"\nbase_url = \"{up}/v1\"\nmodels = [\"*\"]\n"
    ))
    .await;
    let (ws, _) = tokio::time::timeout(BOUND, connect(format!("ws://{}/v1/responses", visor.addr)))
        .await
        .unwrap()
        .unwrap();
    let (mut tx, mut rx) = ws.split();
    let create = json!({"type": "response.create", "model": "gpt-4o", "metadata": {"mute": true}, "input": []}).to_string();
    // A create every 250 ms, until the socket is closed.
    let sender = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            if tx.send(Message::Text(create.clone().into())).await.is_err() {
                break;
            }
        }
    });
    let frame = next_close(&mut rx).await;
    sender.abort();
    assert_eq!(frame.code, CloseCode::Error, "{frame:?}");
    assert_eq!(frame.reason, "upstream idle timeout");
    // Counted as the socket ends (just after the close frame went).
    assert!(
        wait_metrics(&visor, BOUND, |m| metric(
            m,
            "visor_upstream_errors_total",
            &[("kind", "idle_timeout")]
        )
        .is_some_and(|n| n >= 1.0))
        .await,
        "{}",
        visor.metrics().await
    );
}

/// A client that stops reading does not hold both sockets: a write to it
/// that has not gone out within idle_timeout_secs ends the socket, the
/// upstream's is closed, and the response is counted as cancelled (499).
#[tokio::test]
async fn a_client_that_stops_reading_is_let_go_after_the_write_deadline() {
    let (up, _seen, mut closed) = ws_mock().await;
    let visor = Visor::start(&format!(
        "[server]\nidle_timeout_secs = 1\nrequest_timeout_secs = 600\n[[upstream]]\nname = \"ws\"\nbase_url = \"{up}/v1\"\nmodels = [\"*\"]\n"
    ))
    .await;
    let (mut ws, _) =
        tokio::time::timeout(BOUND, connect(format!("ws://{}/v1/responses", visor.addr)))
            .await
            .unwrap()
            .unwrap();
    let create = json!({"type": "response.create", "model": "gpt-4o", "metadata": {"flood": true}, "input": []});
    ws.send(Message::Text(create.to_string().into()))
        .await
        .unwrap();
    // The client reads nothing more.
    tokio::time::timeout(BOUND, closed.recv())
        .await
        .expect("the upstream socket is closed within the bound");
    assert!(
        wait_metrics(&visor, BOUND, |m| metric(
            m,
            "visor_requests_total",
            &[("upstream", "ws"), ("status", "499")]
        ) == Some(1.0))
        .await,
        "{}",
        visor.metrics().await
    );
    drop(ws);
}

/// The upstream's refusal of the handshake reaches the client with its
/// body, also when the body comes after the head.
#[tokio::test]
async fn an_upstream_refusal_reaches_the_client_with_its_body() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let body = r#"{"error":{"message":"Incorrect API key provided","type":"invalid_request_error","code":"invalid_api_key"}}"#;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let answer = format!(
                    "HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                );
                s.write_all(answer.as_bytes()).await.unwrap();
                s.flush().await.unwrap();
                // The body in a later segment, as many servers send it.
                tokio::time::sleep(Duration::from_millis(200)).await;
                let _ = s.write_all(body.as_bytes()).await;
                let _ = s.read(&mut buf).await;
            });
        }
    });
    let visor = visor_for(&format!("http://{addr}")).await;
    match tokio::time::timeout(BOUND, connect(format!("ws://{}/v1/responses", visor.addr)))
        .await
        .unwrap()
    {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            assert_eq!(resp.status(), 401);
            assert_eq!(resp.headers()["content-type"], "application/json");
            assert_eq!(
                String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default()),
                body
            );
        }
        other => panic!("expected a 401, got {:?}", other.map(|(_, r)| r.status())),
    }
}

/// A client's ping is answered once (by visor), not also by the upstream
/// through it: pings and pongs are not relayed.
#[tokio::test]
async fn a_client_ping_is_answered_once() {
    let (up, seen, _closed) = ws_mock().await;
    let visor = visor_for(&up).await;
    let (mut ws, _) =
        tokio::time::timeout(BOUND, connect(format!("ws://{}/v1/responses", visor.addr)))
            .await
            .unwrap()
            .unwrap();
    ws.send(Message::Ping(b"p1".to_vec().into())).await.unwrap();
    ws.send(Message::Text("{\"type\":\"ping\"}".into()))
        .await
        .unwrap();
    let mut pongs = 0;
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let m = tokio::time::timeout_at(deadline, ws.next())
            .await
            .expect("the echo within the bound")
            .expect("the socket is open")
            .unwrap();
        match m {
            Message::Pong(p) => {
                assert_eq!(&p[..], b"p1");
                pongs += 1;
            }
            Message::Text(_) => break,
            _ => {}
        }
    }
    assert_eq!(pongs, 1, "the ping was answered {pongs} times");
    assert_eq!(seen.lock().unwrap().pings, 0, "the ping went upstream");
}

/// Pings are no activity: a socket with nothing else is closed after
/// request_timeout_secs all the same (1001), and its `max_connections`
/// slot is free again.
#[tokio::test]
async fn pings_do_not_keep_a_quiet_socket_open() {
    let (up, _seen, _closed) = ws_mock().await;
    let visor = Visor::start(&format!(
        "[server]\nrequest_timeout_secs = 1\nmax_connections = 1\n[[upstream]]\nname = \"ws\"\nbase_url = \"{up}/v1\"\nmodels = [\"*\"]\n"
    ))
    .await;
    let (ws, _) = tokio::time::timeout(BOUND, connect(format!("ws://{}/v1/responses", visor.addr)))
        .await
        .unwrap()
        .unwrap();
    let (mut tx, mut rx) = ws.split();
    let pinger = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        loop {
            tick.tick().await;
            if tx
                .send(Message::Ping(b"alive".to_vec().into()))
                .await
                .is_err()
            {
                break;
            }
        }
    });
    let frame = next_close(&mut rx).await;
    pinger.abort();
    assert_eq!(frame.code, CloseCode::Away, "{frame:?}");
    assert_eq!(frame.reason, "idle socket closed");
    drop(rx);
    // The slot is free: a new connection is served.
    let got = tokio::time::timeout(
        BOUND,
        send(
            http::Request::get(visor.url("/healthz"))
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap(),
        ),
    )
    .await
    .expect("served within the bound");
    assert_eq!(got.0, 200);
}

/// A `response.create` is charged for the event visor sends, not the one it
/// got: a small spreadsheet read into ~150,000 characters of text is over
/// a 10,000-token key, refused with a 429 `error` event, and not sent.
#[tokio::test]
async fn a_create_is_charged_for_the_text_its_documents_became() {
    let (up, seen, _closed) = ws_mock().await;
    let visor = Visor::start(&format!(
        "[[upstream]]\nname = \"ws\"\nbase_url = \"{up}/v1\"\nmodels = [\"*\"]\n\
         [[key]]\nname = \"small\"\nkey = \"sk-small\"\ntokens_per_minute = 10000\n"
    ))
    .await;
    let mut req = format!("ws://{}/v1/responses", visor.addr)
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("authorization", "Bearer sk-small".parse().unwrap());
    let (mut ws, _) = connect(req).await.unwrap();
    let xlsx = pdf_build::amplified_xlsx(10_000, 20_000, "ws-");
    let data = base64_simd::STANDARD.encode_to_string(&xlsx);
    let create = json!({"type": "response.create", "model": "gpt-oss-120b", "input": [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "sum the sheet"},
            {"type": "input_file", "filename": "big.xlsx",
             "file_data": format!("data:application/vnd.openxmlformats-officedocument.spreadsheetml.sheet;base64,{data}")}]}]});
    let sent = create.to_string();
    assert!(
        sent.len() < 40_000,
        "the client's event is small: {}",
        sent.len()
    );
    ws.send(Message::Text(sent.into())).await.unwrap();
    let e = next_text(&mut ws).await;
    assert_eq!(e["type"], "error", "{e}");
    assert_eq!(e["status"], 429, "{e}");
    assert_eq!(e["error"]["code"], "rate_limit_exceeded", "{e}");
    assert!(
        seen.lock().unwrap().events.is_empty(),
        "the refused create reached the upstream"
    );
    // A create that fits still goes.
    ws.send(Message::Text(
        json!({"type": "response.create", "model": "gpt-oss-120b", "input": []})
            .to_string()
            .into(),
    ))
    .await
    .unwrap();
    assert_eq!(next_text(&mut ws).await["type"], "response.created");
}

/// A socket that ends before a response's usage comes charges the caller's
/// key the text the response carried (4 bytes a token): leaving early is no
/// way around a token limit.
#[tokio::test]
async fn a_socket_left_before_the_usage_is_charged_the_text_it_carried() {
    let (up, _seen, _closed) = ws_mock().await;
    let visor = Visor::start(&format!(
        "[[upstream]]\nname = \"ws\"\nbase_url = \"{up}/v1\"\nmodels = [\"*\"]\n\
         [[key]]\nname = \"small\"\nkey = \"sk-small\"\ntokens_per_minute = 1000\n"
    ))
    .await;
    let open = || {
        let mut req = format!("ws://{}/v1/responses", visor.addr)
            .into_client_request()
            .unwrap();
        req.headers_mut()
            .insert("authorization", "Bearer sk-small".parse().unwrap());
        connect(req)
    };
    let (mut ws, _) = open().await.unwrap();
    // 8,000 bytes of answer: about 2,000 tokens, twice the key's minute.
    let create = json!({"type": "response.create", "model": "gpt-5.1", "metadata": {"text": 8000}, "input": []});
    ws.send(Message::Text(create.to_string().into()))
        .await
        .unwrap();
    assert_eq!(next_text(&mut ws).await["type"], "response.created");
    assert_eq!(
        next_text(&mut ws).await["type"],
        "response.output_text.delta"
    );
    ws.close(None).await.unwrap();
    drop(ws);
    // Charged as the socket ends (a task of its own): a few tries.
    let small = json!({"type": "response.create", "model": "gpt-5.1", "input": []});
    let mut refused = false;
    for _ in 0..20 {
        let (mut ws, _) = open().await.unwrap();
        ws.send(Message::Text(small.to_string().into()))
            .await
            .unwrap();
        let e = next_text(&mut ws).await;
        if e["status"] == 429 {
            refused = true;
            break;
        }
        let _ = ws.close(None).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(refused, "the text of a response left early was not charged");
}

/// A `response.create` the key refuses names nothing: the steer after it
/// is for the model of the response under way (found by a review: a
/// refused create for a vision model let the next steer's image through
/// to the text-only one).
#[tokio::test]
async fn a_refused_create_does_not_name_the_model_of_what_follows() {
    let (up, seen, _closed) = ws_mock().await;
    let visor = Visor::start(&format!(
        "[images]\nnon_vision = \"strip\"\n\
         [[upstream]]\nname = \"ws\"\nbase_url = \"{up}/v1\"\nmodels = [\"*\"]\n\
         [[key]]\nname = \"oss\"\nkey = \"sk-oss\"\nmodels = [\"gpt-oss-*\"]\n"
    ))
    .await;
    let mut req = format!("ws://{}/v1/responses", visor.addr)
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("authorization", "Bearer sk-oss".parse().unwrap());
    let (mut ws, _) = connect(req).await.unwrap();
    let under_way = json!({"type": "response.create", "model": "gpt-oss-120b", "metadata": {"stall": true}, "input": []});
    ws.send(Message::Text(under_way.to_string().into()))
        .await
        .unwrap();
    assert_eq!(next_text(&mut ws).await["type"], "response.created");
    let vision = json!({"type": "response.create", "model": "gpt-4o", "input": []});
    ws.send(Message::Text(vision.to_string().into()))
        .await
        .unwrap();
    assert_eq!(
        next_text(&mut ws).await["error"]["code"],
        "model_not_allowed"
    );
    let png = base64_simd::STANDARD.encode_to_string(fixture("chart.png"));
    let steer = json!({"type": "response.steer", "input": [{"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": format!("data:image/png;base64,{png}")}]}]});
    ws.send(Message::Text(steer.to_string().into()))
        .await
        .unwrap();
    // The mock echoes what is not a create: the steer as it went up.
    let echoed = next_text(&mut ws).await;
    assert_eq!(echoed["type"], "response.steer", "{echoed}");
    let up_text = seen.lock().unwrap().events.last().cloned().unwrap();
    assert!(
        !up_text.contains(&png[..40]) && !up_text.contains("input_image"),
        "the image went to the text-only model"
    );
}
