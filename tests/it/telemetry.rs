//! OpenTelemetry traces through the real proxy, received by an OTLP/HTTP
//! receiver in this process that decodes each export with the official
//! protobuf definitions (`opentelemetry-proto`): every span, its parent,
//! kind, status and attributes checked; the client's `traceparent`
//! continued and the attempt's sent upstream; fallbacks as two attempts; a
//! refusal; contents only with `capture_content`; and a collector that is
//! down never failing a request.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::{Span, span::SpanKind, status::StatusCode};
use prost::Message as _;
use support::*;

/// A span as received, with its resource's `service.name`.
#[derive(Clone, Debug)]
struct Got {
    span: Span,
    service: String,
}

impl Got {
    fn attr(&self, key: &str) -> Option<&any_value::Value> {
        self.span
            .attributes
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| kv.value.as_ref())
            .and_then(|v: &AnyValue| v.value.as_ref())
    }

    fn str(&self, key: &str) -> Option<String> {
        match self.attr(key)? {
            any_value::Value::StringValue(s) => Some(s.clone()),
            other => panic!("{key} is not a string: {other:?}"),
        }
    }

    fn int(&self, key: &str) -> Option<i64> {
        match self.attr(key)? {
            any_value::Value::IntValue(i) => Some(*i),
            other => panic!("{key} is not an int: {other:?}"),
        }
    }

    fn strings(&self, key: &str) -> Vec<String> {
        match self.attr(key) {
            Some(any_value::Value::ArrayValue(a)) => a
                .values
                .iter()
                .map(|v| match &v.value {
                    Some(any_value::Value::StringValue(s)) => s.clone(),
                    other => panic!("{key}: {other:?}"),
                })
                .collect(),
            None => Vec::new(),
            other => panic!("{key} is not an array: {other:?}"),
        }
    }

    fn kind(&self) -> SpanKind {
        SpanKind::try_from(self.span.kind).unwrap()
    }

    fn failed(&self) -> bool {
        self.span
            .status
            .as_ref()
            .is_some_and(|s| s.code == StatusCode::Error as i32)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// The OTLP/HTTP receiver: `POST /v1/traces`, protobuf.
struct Receiver {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<Got>>>,
    /// Requests that were not protobuf `ExportTraceServiceRequest`s.
    bad: Arc<Mutex<Vec<String>>>,
}

/// How the receiver answers.
#[derive(Clone, Copy)]
enum Answer {
    Takes,
    /// 503 with `Retry-After: 30` (a throttling collector).
    Throttles,
}

impl Receiver {
    async fn start() -> Receiver {
        Receiver::answering(Answer::Takes).await
    }

    async fn answering(answer: Answer) -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let bad = Arc::new(Mutex::new(Vec::new()));
        let (s, b) = (spans.clone(), bad.clone());
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (s, b) = (s.clone(), b.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| {
                            let (s, b) = (s.clone(), b.clone());
                            async move {
                                let ct = req.headers().get("content-type").cloned();
                                let path = req.uri().path().to_owned();
                                let body = req.into_body().collect().await.unwrap().to_bytes();
                                if let Answer::Throttles = answer {
                                    return Ok(http::Response::builder()
                                        .status(503)
                                        .header("retry-after", "30")
                                        .body(Full::new(Bytes::new()))
                                        .unwrap());
                                }
                                if path != "/v1/traces"
                                    || ct.as_ref().map(|v| v.as_bytes())
                                        != Some(b"application/x-protobuf")
                                {
                                    b.lock().unwrap().push(format!("{path} {ct:?}"));
                                    return Ok::<_, hyper::Error>(
                                        http::Response::builder()
                                            .status(400)
                                            .body(Full::new(Bytes::new()))
                                            .unwrap(),
                                    );
                                }
                                match ExportTraceServiceRequest::decode(body) {
                                    Ok(export) => {
                                        let mut got = s.lock().unwrap();
                                        for rs in export.resource_spans {
                                            let service = rs
                                                .resource
                                                .iter()
                                                .flat_map(|r| &r.attributes)
                                                .find(|kv| kv.key == "service.name")
                                                .and_then(|kv| {
                                                    match kv.value.as_ref()?.value.as_ref()? {
                                                        any_value::Value::StringValue(s) => {
                                                            Some(s.clone())
                                                        }
                                                        _ => None,
                                                    }
                                                })
                                                .unwrap_or_default();
                                            for ss in rs.scope_spans {
                                                for span in ss.spans {
                                                    got.push(Got {
                                                        span,
                                                        service: service.clone(),
                                                    });
                                                }
                                            }
                                        }
                                    }
                                    Err(e) => b.lock().unwrap().push(format!("decode: {e}")),
                                }
                                Ok(http::Response::builder()
                                    .header("content-type", "application/x-protobuf")
                                    .body(Full::new(Bytes::new()))
                                    .unwrap())
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        Receiver { addr, spans, bad }
    }

    fn toml(&self, extra: &str) -> String {
        format!(
            "[telemetry]\notlp_endpoint = \"http://{}\"\n{extra}\n",
            self.addr
        )
    }

    /// Waits (bounded) until `want` holds for the spans received.
    async fn wait(&self, what: &str, want: impl Fn(&[Got]) -> bool) -> Vec<Got> {
        let until = Instant::now() + Duration::from_secs(15);
        loop {
            let got = self.spans.lock().unwrap().clone();
            if want(&got) {
                assert!(
                    self.bad.lock().unwrap().is_empty(),
                    "{:?}",
                    self.bad.lock().unwrap()
                );
                return got;
            }
            assert!(
                Instant::now() < until,
                "no {what} within 15 s; got {got:#?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn named<'a>(spans: &'a [Got], name: &str) -> Vec<&'a Got> {
    spans.iter().filter(|g| g.span.name == name).collect()
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn traced(url: &str, body: impl Into<Bytes>) -> http::Request<Full<Bytes>> {
    let mut req = post_json(url, body);
    req.headers_mut().insert(
        "traceparent",
        format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
            .parse()
            .unwrap(),
    );
    req
}

#[tokio::test]
async fn a_request_is_one_server_span_with_genai_attributes_an_attempt_and_a_describer_span() {
    let receiver = Receiver::start().await;
    let mock = MockUpstream::start(|r| {
        if is_describer_call(r) {
            describer_answer(r)
        } else {
            Reply::json(
                200,
                r#"{"id":"c1","object":"chat.completion","model":"gpt-oss-120b-2025","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":120,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":64}}}"#,
            )
        }
    })
    .await;
    let visor = Visor::for_mock(&mock, &format!("{DESCRIBE}{}", receiver.toml(""))).await;
    let body = fixture("chat-image-nonvision.json");
    let (status, _, resp) = send(traced(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));

    let spans = receiver
        .wait("request span", |s| {
            !named(s, "POST /v1/chat/completions").is_empty()
        })
        .await;
    let server = named(&spans, "POST /v1/chat/completions")[0].clone();
    assert_eq!(server.service, "visor");
    assert_eq!(server.kind(), SpanKind::Server);
    // The client's trace continued.
    assert_eq!(hex(&server.span.trace_id), CLIENT_TRACE);
    assert_eq!(hex(&server.span.parent_span_id), CLIENT_SPAN);
    assert_eq!(server.str("gen_ai.operation.name").as_deref(), Some("chat"));
    assert_eq!(
        server.str("gen_ai.provider.name").as_deref(),
        Some("openai")
    );
    assert_eq!(
        server.str("gen_ai.request.model").as_deref(),
        Some("gpt-oss-120b")
    );
    assert_eq!(
        server.str("gen_ai.response.model").as_deref(),
        Some("gpt-oss-120b-2025")
    );
    assert_eq!(server.int("gen_ai.usage.input_tokens"), Some(120));
    assert_eq!(server.int("gen_ai.usage.output_tokens"), Some(7));
    assert_eq!(server.int("gen_ai.usage.cache_read.input_tokens"), Some(64));
    assert_eq!(server.strings("gen_ai.response.finish_reasons"), ["stop"]);
    assert_eq!(server.str("server.address").as_deref(), Some("127.0.0.1"));
    assert_eq!(server.int("http.response.status_code"), Some(200));
    assert_eq!(server.str("visor.upstream").as_deref(), Some("mock"));
    assert_eq!(server.str("visor.key").as_deref(), Some("none"));
    assert_eq!(server.int("visor.images.replaced"), Some(2));
    assert!(server.int("visor.bytes_saved").unwrap() > 0);
    assert_eq!(server.str("visor.outcome").as_deref(), Some("complete"));
    assert!(!server.failed());
    // No contents without capture_content.
    assert!(server.attr("gen_ai.input.messages").is_none());
    assert!(server.attr("gen_ai.output.messages").is_none());

    // The attempt: a client span under it, whose traceparent the provider got.
    let attempts = named(&spans, "chat gpt-oss-120b");
    assert_eq!(attempts.len(), 1, "{spans:#?}");
    let attempt = attempts[0];
    assert_eq!(attempt.kind(), SpanKind::Client);
    assert_eq!(attempt.span.parent_span_id, server.span.span_id);
    assert_eq!(attempt.int("http.response.status_code"), Some(200));
    assert_eq!(
        attempt.int("server.port"),
        Some(i64::from(mock.addr.port()))
    );
    let chat = mock
        .recorded()
        .into_iter()
        .find(|r| !is_describer_call(r))
        .unwrap();
    let sent = chat.headers["traceparent"].to_str().unwrap().to_owned();
    assert_eq!(
        sent,
        format!("00-{CLIENT_TRACE}-{}-01", hex(&attempt.span.span_id))
    );

    // The describer's calls: child spans of the request.
    let described = receiver
        .wait("describer spans", |s| {
            named(s, &format!("describe {DESCRIBER}")).len() == 2
        })
        .await;
    for d in named(&described, &format!("describe {DESCRIBER}")) {
        assert_eq!(d.span.parent_span_id, server.span.span_id);
        assert_eq!(hex(&d.span.trace_id), CLIENT_TRACE);
        assert_eq!(d.str("gen_ai.request.model").as_deref(), Some(DESCRIBER));
    }
    // Counted once the collector has taken them.
    let until = Instant::now() + Duration::from_secs(15);
    while metric(
        &visor.metrics().await,
        "visor_telemetry_spans_total",
        &[("result", "exported")],
    )
    .unwrap_or(0.0)
        < 4.0
    {
        assert!(Instant::now() < until, "exported spans not counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_fallback_is_two_attempts_and_a_refusal_an_error_span() {
    let receiver = Receiver::start().await;
    let down =
        MockUpstream::start(|_| Reply::json(503, r#"{"error":{"message":"overloaded"}}"#)).await;
    let up = MockUpstream::start(|_| chat_ok()).await;
    let toml = format!(
        "{}{}models = [\"*\"]\nfallbacks = [\"second\"]\n{}api_key = \"key-second\"\n",
        receiver.toml(""),
        down.upstream_toml("first"),
        up.upstream_toml("second")
    );
    let visor = Visor::start(&toml).await;
    let (status, _, _) = send(post_json(
        &visor.url("/v1/chat/completions"),
        r#"{"model":"m1","messages":[{"role":"user","content":"hi"}]}"#,
    ))
    .await;
    assert_eq!(status, 200);
    let spans = receiver
        .wait("two attempts", |s| {
            named(s, "chat m1").len() == 2 && !named(s, "POST /v1/chat/completions").is_empty()
        })
        .await;
    let server = named(&spans, "POST /v1/chat/completions")[0];
    // No traceparent from the client: a trace of its own, with no parent.
    assert!(server.span.parent_span_id.is_empty());
    let mut attempts = named(&spans, "chat m1");
    attempts.sort_by_key(|a| a.span.start_time_unix_nano);
    assert_eq!(attempts[0].str("visor.upstream").as_deref(), Some("first"));
    assert_eq!(attempts[0].int("http.response.status_code"), Some(503));
    assert!(attempts[0].failed());
    assert_eq!(attempts[1].str("visor.upstream").as_deref(), Some("second"));
    assert!(!attempts[1].failed());
    for a in &attempts {
        assert_eq!(a.span.parent_span_id, server.span.span_id);
    }

    // A request visor refuses itself: its span says why.
    let (status, _, _) = send(post_json(&visor.url("/v1/chat/completions"), "{not json")).await;
    assert_eq!(status, 400);
    let spans = receiver
        .wait("a refused request's span", |s| {
            named(s, "POST /v1/chat/completions").len() == 2
        })
        .await;
    let refused = named(&spans, "POST /v1/chat/completions")
        .into_iter()
        .find(|s| s.int("http.response.status_code") == Some(400))
        .unwrap();
    assert!(refused.failed());
    assert_eq!(refused.str("error.type").as_deref(), Some("invalid_json"));
}

#[tokio::test]
async fn contents_are_exported_only_with_capture_content() {
    let receiver = Receiver::start().await;
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, &receiver.toml("capture_content = true")).await;
    let mut req = post_json(
        &visor.url("/v1/chat/completions"),
        r#"{"model":"m1","messages":[{"role":"user","content":"the secret word is heliotrope"}]}"#,
    );
    req.headers_mut()
        .insert("authorization", "Bearer sk-SECRET-client".parse().unwrap());
    let (status, _, _) = send(req).await;
    assert_eq!(status, 200);
    // The client's key went upstream (it is the client's own), never onto a span.
    assert_eq!(
        mock.recorded()[0].headers["authorization"],
        "Bearer sk-SECRET-client"
    );
    let spans = receiver
        .wait("request span", |s| {
            !named(s, "POST /v1/chat/completions").is_empty()
        })
        .await;
    let server = named(&spans, "POST /v1/chat/completions")[0];
    assert!(
        server
            .str("gen_ai.input.messages")
            .unwrap()
            .contains("heliotrope")
    );
    assert!(
        server
            .str("gen_ai.output.messages")
            .unwrap()
            .contains("\"content\":\"ok\"")
    );
    // Never a credential.
    for got in &spans {
        for kv in &got.span.attributes {
            let v = format!("{:?}", kv.value);
            assert!(!v.contains("SECRET"), "{}: {v}", kv.key);
        }
    }
    // The content is the request's span's, not copied onto the attempt's.
    let attempt = &named(&spans, "chat m1")[0];
    assert!(attempt.attr("gen_ai.output.messages").is_none());
}

#[tokio::test]
async fn a_collector_that_is_down_never_fails_a_request() {
    // A port with nothing listening.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(
        &mock,
        &format!("[telemetry]\notlp_endpoint = \"http://{closed}\"\n"),
    )
    .await;
    for _ in 0..5 {
        let (status, _, _) = post_chat(
            &visor,
            r#"{"model":"m1","messages":[{"role":"user","content":"hi"}]}"#,
        )
        .await;
        assert_eq!(status, 200);
    }
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let m = visor.metrics().await;
        let failed =
            metric(&m, "visor_telemetry_spans_total", &[("result", "failed")]).unwrap_or(0.0);
        if failed >= 10.0 {
            break;
        }
        assert!(Instant::now() < until, "spans not counted as failed:\n{m}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A collector that throttles (503, `Retry-After: 30`): spans are dropped
/// as failed at once, never retried while requests wait (this test's
/// runtime has one thread, which a sleeping exporter would stop).
#[tokio::test]
async fn a_throttling_collector_never_holds_requests() {
    let receiver = Receiver::answering(Answer::Throttles).await;
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, &receiver.toml("")).await;
    let until = Instant::now() + Duration::from_secs(20);
    let mut failed = 0.0;
    while failed < 3.0 {
        let answered = tokio::time::timeout(
            Duration::from_secs(5),
            post_chat(
                &visor,
                r#"{"model":"m1","messages":[{"role":"user","content":"hi"}]}"#,
            ),
        )
        .await
        .expect("a request waited on the collector");
        assert_eq!(answered.0, 200);
        failed = metric(
            &visor.metrics().await,
            "visor_telemetry_spans_total",
            &[("result", "failed")],
        )
        .unwrap_or(0.0);
        assert!(Instant::now() < until, "no export counted as failed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn without_an_endpoint_the_client_traceparent_passes_unchanged() {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    assert!(visor.state.telemetry.is_none());
    let (status, _, _) = send(traced(
        &visor.url("/v1/chat/completions"),
        r#"{"model":"m1","messages":[{"role":"user","content":"hi"}]}"#,
    ))
    .await;
    assert_eq!(status, 200);
    let r = &mock.recorded()[0];
    assert_eq!(
        r.headers["traceparent"],
        format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01").as_str()
    );
}
