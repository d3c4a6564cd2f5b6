//! Helpers for `benches/load.sh`:
//!
//! - `loadkit mock ADDR [PACE_MS]` — a fast mock upstream. A body containing
//!   `"stream":true` gets an SSE stream of 16 content chunks, a usage chunk
//!   and `[DONE]` (PACE_MS apart when given); anything else a small
//!   chat.completion JSON. Request bodies are read whole first.
//! - `loadkit proxy ADDR UPSTREAM` — the least a reverse proxy built on
//!   hyper does: each request is passed, head and streaming body, to
//!   `http://UPSTREAM` over a pooled keep-alive connection, and the answer
//!   back the same way. No reading, no checks, no metrics: the floor that
//!   visor's own work is measured above.
//! - `loadkit first-byte URL BODY_FILE N` — sends N sequential requests on
//!   one keep-alive connection and prints the p50 and p99 time from sending
//!   to the first response body byte, in microseconds.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};

const CHAT: &str = r#"{"id":"chatcmpl-load","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"The quick brown fox jumps over the lazy dog."},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":10,"total_tokens":22}}"#;

/// An SSE body: `events` sent one per `pace`.
struct Sse {
    events: std::vec::IntoIter<Bytes>,
    pace: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl http_body::Body for Sse {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(t) = self.timer.as_mut() {
            if t.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.timer = None;
        }
        match self.events.next() {
            Some(e) => {
                if !self.pace.is_zero() {
                    self.timer = Some(Box::pin(tokio::time::sleep(self.pace)));
                }
                Poll::Ready(Some(Ok(Frame::data(e))))
            }
            None => Poll::Ready(None),
        }
    }
}

fn sse_events() -> Vec<Bytes> {
    let mut v = Vec::with_capacity(18);
    for i in 0..16 {
        v.push(Bytes::from(format!(
            "data: {{\"id\":\"chatcmpl-load\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"token{i} \"}},\"finish_reason\":null}}]}}\n\n"
        )));
    }
    v.push(Bytes::from_static(b"data: {\"id\":\"chatcmpl-load\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":16,\"total_tokens\":28}}\n\n"));
    v.push(Bytes::from_static(b"data: [DONE]\n\n"));
    v
}

type MockBody = http_body_util::Either<Full<Bytes>, Sse>;

async fn answer(req: Request<Incoming>, pace: Duration) -> Result<Response<MockBody>, Infallible> {
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let head = &body[..body.len().min(256)];
    let stream = memchr::memmem::find(head, b"\"stream\":true").is_some()
        || memchr::memmem::find(head, b"\"stream\": true").is_some();
    let resp = if stream {
        let mut r = Response::new(http_body_util::Either::Right(Sse {
            events: sse_events().into_iter(),
            pace,
            timer: None,
        }));
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/event-stream"),
        );
        r
    } else {
        let mut r = Response::new(http_body_util::Either::Left(Full::new(Bytes::from_static(
            CHAT.as_bytes(),
        ))));
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        r
    };
    Ok(resp)
}

async fn mock(addr: &str, pace: Duration) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    eprintln!("mock listening on {}", listener.local_addr()?);
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |r| answer(r, pace));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

async fn proxy(addr: &str, upstream: &str) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    eprintln!(
        "proxy listening on {} for {upstream}",
        listener.local_addr()?
    );
    let client =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http::<Incoming>();
    let authority: http::uri::Authority = upstream
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let (client, authority) = (client.clone(), authority.clone());
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let (client, authority) = (client.clone(), authority.clone());
                async move {
                    let (mut parts, body) = req.into_parts();
                    let mut uri = http::uri::Parts::from(parts.uri);
                    uri.scheme = Some(http::uri::Scheme::HTTP);
                    uri.authority = Some(authority);
                    let sent = match http::Uri::from_parts(uri) {
                        Ok(u) => {
                            parts.uri = u;
                            parts.headers.remove(http::header::HOST);
                            client.request(Request::from_parts(parts, body)).await.ok()
                        }
                        Err(_) => None,
                    };
                    match sent {
                        Some(resp) => Ok::<_, Infallible>(resp.map(|b| b.boxed())),
                        None => {
                            let mut r = Response::new(
                                Full::new(Bytes::new()).map_err(|e| match e {}).boxed(),
                            );
                            *r.status_mut() = http::StatusCode::BAD_GATEWAY;
                            Ok(r)
                        }
                    }
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

async fn first_byte(url: &str, body: Bytes, n: usize) -> Result<(), Box<dyn std::error::Error>> {
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1)
        .build_http::<Full<Bytes>>();
    let mut samples = Vec::with_capacity(n);
    for i in 0..n + 20 {
        let req = Request::post(url)
            .header("content-type", "application/json")
            .body(Full::new(body.clone()))?;
        let t = Instant::now();
        let resp = client.request(req).await?;
        let mut b = resp.into_body();
        let mut first = None;
        while let Some(f) = b.frame().await {
            if f?.is_data() && first.is_none() {
                first = Some(t.elapsed());
            }
        }
        if i >= 20 {
            // the first 20 warm the connection and caches
            samples.push(first.unwrap_or_else(|| t.elapsed()));
        }
    }
    samples.sort();
    let p = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    println!(
        "first_byte_us p50={} p99={}",
        p(0.50).as_micros(),
        p(0.99).as_micros()
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match args.get(1).map(String::as_str) {
        Some("mock") => {
            let addr = args.get(2).map(String::as_str).unwrap_or("127.0.0.1:9100");
            let pace = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(0u64);
            rt.block_on(mock(addr, Duration::from_millis(pace)))?;
        }
        Some("proxy") => {
            let (Some(addr), Some(upstream)) = (args.get(2), args.get(3)) else {
                return Err("usage: loadkit proxy ADDR UPSTREAM_HOST:PORT".into());
            };
            rt.block_on(proxy(addr, upstream))?;
        }
        Some("first-byte") => {
            let (Some(url), Some(file)) = (args.get(2), args.get(3)) else {
                return Err("usage: loadkit first-byte URL BODY_FILE N".into());
            };
            let n = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(200);
            let body = Bytes::from(std::fs::read(file)?);
            rt.block_on(first_byte(url, body, n))?;
        }
        _ => {
            return Err(
                "usage: loadkit mock ADDR [PACE_MS] | loadkit proxy ADDR UPSTREAM | loadkit first-byte URL BODY_FILE N".into(),
            );
        }
    }
    Ok(())
}
