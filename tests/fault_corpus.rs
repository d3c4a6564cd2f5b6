//! The bad-input and fault corpus: each case is a raw HTTP/1.1 exchange with
//! the real proxy (loopback sockets, mock upstreams) and the answer it must
//! get — status, error code, and which upstream (if any) saw it. Bodies,
//! images, HTTP framing and smuggling, paths, routing, upstream faults. The
//! faults that need a setup of their own (client, describer, store, Redis,
//! a full disk, shutdown) are the scenario table at the end.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BOUND: Duration = Duration::from_secs(10);

/// Which upstream must have received the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    Nobody,
    A,
    B,
}

/// What a case must get.
#[derive(Debug, Clone, Copy)]
enum Want {
    /// This status (and, for visor's own errors, this `error.code`).
    Status(u16, Option<&'static str>),
    /// A 200 head whose body is then cut (no clean end).
    Cut,
    /// The connection closed without any response.
    Closed,
}

struct Case {
    name: &'static str,
    raw: Vec<u8>,
    want: Want,
    reach: Reach,
    /// No base64 image data may reach the upstream.
    no_images_upstream: bool,
}

fn case(name: &'static str, raw: Vec<u8>, want: Want, reach: Reach) -> Case {
    Case {
        name,
        raw,
        want,
        reach,
        no_images_upstream: false,
    }
}

fn status(code: u16) -> Want {
    Want::Status(code, None)
}

fn error(code: u16, label: &'static str) -> Want {
    Want::Status(code, Some(label))
}

/// A POST with `Content-Length`, `Connection: close`.
fn post(path: &str, content_type: Option<&str>, body: &[u8]) -> Vec<u8> {
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: visor\r\nAuthorization: Bearer sk-client\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(ct) = content_type {
        head.push_str(&format!("Content-Type: {ct}\r\n"));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body);
    out
}

fn json_post(path: &str, body: &[u8]) -> Vec<u8> {
    post(path, Some("application/json"), body)
}

fn chat(body: &str) -> Vec<u8> {
    json_post("/v1/chat/completions", body.as_bytes())
}

fn get(target: &str) -> Vec<u8> {
    format!("GET {target} HTTP/1.1\r\nHost: visor\r\nConnection: close\r\n\r\n").into_bytes()
}

fn raw(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

/// A chat request for the text-only `gpt-oss-120b` with `content` as the
/// user message's (or a tool message's) content.
fn oss_chat(messages: serde_json::Value) -> Vec<u8> {
    let body = serde_json::json!({"model": "gpt-oss-120b", "messages": messages});
    chat(&body.to_string())
}

/// A chat body for the text-only `gpt-oss-120b` with one image.
fn oss_image_chat(data_url: &str) -> Vec<u8> {
    serde_json::json!({"model": "gpt-oss-120b", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": data_url}}]}]})
    .to_string()
    .into_bytes()
}

fn b64(n: usize) -> String {
    let png = fixture("chart.png");
    let s = base64_simd::STANDARD.encode_to_string(&png);
    s[..n.min(s.len())].to_owned()
}

fn whole_b64() -> String {
    base64_simd::STANDARD.encode_to_string(fixture("chart.png"))
}

fn cases() -> Vec<Case> {
    use Reach::*;
    let png = whole_b64();
    let data_url = format!("data:image/png;base64,{png}");
    let mcp =
        serde_json::json!({"content": [{"type": "image", "data": png, "mimeType": "image/png"}]});
    let mut v = vec![
        // ---- bodies of transformed endpoints
        case("chat: truncated JSON", chat(r#"{"model":"m","messages":["#), error(400, "invalid_json"), Nobody),
        case("chat: empty body", chat(""), error(400, "invalid_json"), Nobody),
        case("chat: an array, not an object", chat("[1,2]"), error(400, "invalid_json"), Nobody),
        case("chat: model null", chat(r#"{"model":null,"messages":[]}"#), error(400, "invalid_json"), Nobody),
        case("chat: model a number", chat(r#"{"model":5,"messages":[]}"#), error(400, "invalid_json"), Nobody),
        case("chat: model twice", chat(r#"{"model":"m","model":"gpt-4o","messages":[]}"#), error(400, "invalid_json"), Nobody),
        case("chat: model of 2000 bytes", chat(&format!(r#"{{"model":"{}","messages":[]}}"#, "m".repeat(2000))), error(400, "invalid_json"), Nobody),
        case("chat: trailing bytes", chat(r#"{"model":"m","messages":[]} x"#), error(400, "invalid_json"), Nobody),
        case("chat: invalid UTF-8", json_post("/v1/chat/completions", b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}"), error(400, "invalid_json"), Nobody),
        case("chat: overlong UTF-8", json_post("/v1/chat/completions", b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xc0\xae\"}]}"), error(400, "invalid_json"), Nobody),
        case("chat: raw control character in a string", chat("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\u{1}b\"}]}"), error(400, "invalid_json"), Nobody),
        case("chat: lone surrogate escape is JSON", chat(r#"{"model":"m","messages":[{"role":"user","content":"\ud800"}]}"#), status(200), A),
        case("chat: 25 000 levels of nesting", chat(&format!(r#"{{"model":"m","x":{}1{}}}"#, "[".repeat(25_000), "]".repeat(25_000))), status(200), A),
        case("chat: Content-Length over max_body_bytes", raw("POST /v1/chat/completions HTTP/1.1\r\nHost: v\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: 70000\r\n\r\n{"), error(413, "body_too_large"), Nobody),
        case("chat: chunked body over max_body_bytes", {
            let mut r = raw("POST /v1/chat/completions HTTP/1.1\r\nHost: v\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n");
            let chunk = "x".repeat(40_000);
            for _ in 0..2 {
                r.extend_from_slice(format!("{:x}\r\n{chunk}\r\n", chunk.len()).as_bytes());
            }
            r.extend_from_slice(b"0\r\n\r\n");
            r
        }, error(413, "body_too_large"), Nobody),
        case("messages: not JSON", json_post("/v1/messages", b"model=claude"), error(400, "invalid_json"), Nobody),
        case("responses: a string", json_post("/v1/responses", b"\"hi\""), error(400, "invalid_json"), Nobody),
        case("chat: bad x-visor-session id", raw("POST /v1/chat/completions HTTP/1.1\r\nHost: v\r\nConnection: close\r\nx-visor-session: bad id!\r\nContent-Length: 27\r\n\r\n{\"model\":\"m\",\"messages\":[]}"), error(400, "invalid_request"), Nobody),
        case("chat: bad x-visor-vision value", raw("POST /v1/chat/completions HTTP/1.1\r\nHost: v\r\nConnection: close\r\nx-visor-vision: maybe\r\nContent-Length: 27\r\n\r\n{\"model\":\"m\",\"messages\":[]}"), error(400, "invalid_request"), Nobody),
        // ---- routing by the body's model, whatever the Content-Type
        case("embeddings: form content type routes by the JSON model", post("/v1/embeddings", Some("application/x-www-form-urlencoded"), br#"{"model":"echo-r","input":"a"}"#), status(200), B),
        case("embeddings: upper-case content type", post("/v1/embeddings", Some("APPLICATION/JSON"), br#"{"model":"echo-r","input":"a"}"#), status(200), B),
        case("embeddings: text/plain", post("/v1/embeddings", Some("text/plain"), br#"{"model":"echo-r","input":"a"}"#), status(200), B),
        case("embeddings: no content type", post("/v1/embeddings", None, br#"{"model":"echo-r","input":"a"}"#), status(200), B),
        case("embeddings: first upstream's model", post("/v1/embeddings", None, br#"{"input":"a","model":"gpt-e"}"#), status(200), A),
        case("embeddings: not JSON is refused, not guessed", post("/v1/embeddings", Some("text/plain"), b"model=echo-r&input=a"), error(400, "model_unreadable"), Nobody),
        case("embeddings: model null is refused", post("/v1/embeddings", None, br#"{"model":null}"#), error(400, "model_unreadable"), Nobody),
        case("embeddings: model an array", post("/v1/embeddings", None, br#"{"model":["echo-r"]}"#), error(400, "model_unreadable"), Nobody),
        case("embeddings: truncated before the model", post("/v1/embeddings", None, br#"{"input":"a","#), error(400, "model_unreadable"), Nobody),
        case("embeddings: empty body has no model: first upstream", post("/v1/embeddings", None, b""), status(200), A),
        case("transcriptions: multipart model field", post("/v1/audio/transcriptions", Some("multipart/form-data; boundary=xx"), b"--xx\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--xx\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\necho-whisper\r\n--xx--\r\n"), status(200), B),
        case("files: multipart without a model: first upstream", post("/v1/files", Some("multipart/form-data; boundary=xx"), b"--xx\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--xx--\r\n"), status(200), A),
        case("an unknown model", chat(r#"{"model":"zzz-9","messages":[]}"#), error(404, "model_not_found"), Nobody),
        case("GET /v1/models: first upstream", get("/v1/models"), status(200), A),
        // ---- images for a text-only model: never any base64 upstream
        case("image: base64 that does not decode", oss_chat(serde_json::json!([{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,!!!notbase64"}}]}])), status(200), A),
        case("image: truncated PNG", oss_chat(serde_json::json!([{"role":"user","content":[{"type":"image_url","image_url":{"url":format!("data:image/png;base64,{}", b64(400))}}]}])), status(200), A),
        case("image: image_url without a url", oss_chat(serde_json::json!([{"role":"user","content":[{"type":"image_url","image_url":{}}]}])), status(200), A),
        case("image: data URL in user text", oss_chat(serde_json::json!([{"role":"user","content":format!("look ![x]({data_url})")}])), status(200), A),
        case("image: MCP output stringified twice in tool text", oss_chat(serde_json::json!([{"role":"assistant","content":null,"tool_calls":[{"id":"t","type":"function","function":{"name":"s","arguments":"{}"}}]},{"role":"tool","tool_call_id":"t","content":serde_json::json!({"result": mcp.to_string()}).to_string()}])), status(200), A),
        case("image: tool content one bare image part", oss_chat(serde_json::json!([{"role":"assistant","content":null,"tool_calls":[{"id":"t","type":"function","function":{"name":"s","arguments":"{}"}}]},{"role":"tool","tool_call_id":"t","content":{"type":"image","data":png,"mimeType":"image/png"}}])), status(200), A),
        case("image: 500 tiny images", oss_chat(serde_json::json!([{"role":"user","content":(0..500).map(|_| serde_json::json!({"type":"image_url","image_url":{"url":"data:image/gif;base64,R0lGODlhAQABAAAAACw="}})).collect::<Vec<_>>()}])), status(200), A),
        case("image: anthropic block with garbage base64", json_post("/v1/messages", serde_json::json!({"model":"gpt-oss-120b","max_tokens":5,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":"%%%%"}}]}]}).to_string().as_bytes()), status(200), A),
        case("image: responses input_image by file_id", json_post("/v1/responses", serde_json::json!({"model":"gpt-oss-120b","input":[{"role":"user","content":[{"type":"input_image","file_id":"file-123"}]}]}).to_string().as_bytes()), status(200), A),
        case("image: SVG with a script", oss_chat(serde_json::json!([{"role":"user","content":[{"type":"image_url","image_url":{"url":format!("data:image/svg+xml;base64,{}", base64_simd::STANDARD.encode_to_string(b"<svg xmlns='http://www.w3.org/2000/svg'><script>alert(1)</script></svg>"))}}]}])), status(200), A),
        // ---- HTTP framing and smuggling
        // RFC 9112 §6.3: chunked wins and Content-Length is dropped before
        // forwarding (checked below); the smuggled GET is never served.
        case("Content-Length and Transfer-Encoding both", raw("POST /v1/embeddings HTTP/1.1\r\nHost: v\r\nConnection: close\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: v\r\n\r\n"), status(200), A),
        case("two different Content-Lengths", raw("POST /v1/embeddings HTTP/1.1\r\nHost: v\r\nConnection: close\r\nContent-Length: 3\r\nContent-Length: 30\r\n\r\n{}x"), status(400), Nobody),
        case("negative Content-Length", raw("POST /v1/embeddings HTTP/1.1\r\nHost: v\r\nConnection: close\r\nContent-Length: -1\r\n\r\n"), status(400), Nobody),
        case("Transfer-Encoding gzip, chunked not last", raw("POST /v1/embeddings HTTP/1.1\r\nHost: v\r\nConnection: close\r\nTransfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n"), status(400), Nobody),
        case("a chunk size that is not hex", raw("POST /v1/chat/completions HTTP/1.1\r\nHost: v\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"), error(400, "invalid_request"), Nobody),
        case("obs-fold header line", raw("GET /healthz HTTP/1.1\r\nHost: v\r\nX-A: 1\r\n  folded\r\nConnection: close\r\n\r\n"), status(400), Nobody),
        case("space before the colon", raw("GET /healthz HTTP/1.1\r\nHost : v\r\nConnection: close\r\n\r\n"), status(400), Nobody),
        case("NUL in a header value", raw("GET /healthz HTTP/1.1\r\nHost: v\r\nX-A: a\0b\r\nConnection: close\r\n\r\n"), status(400), Nobody),
        case("a 100 KB header", raw(&format!("GET /healthz HTTP/1.1\r\nHost: v\r\nX-Big: {}\r\nConnection: close\r\n\r\n", "a".repeat(100_000))), status(431), Nobody),
        case("absolute-form target", raw("GET http://evil.example/v1/models HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"), error(400, "invalid_request"), Nobody),
        case("CONNECT", raw("CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\nConnection: close\r\n\r\n"), status(400), Nobody),
        case("HTTP/1.0 without Host", raw("GET /healthz HTTP/1.0\r\n\r\n"), status(200), Nobody),
        case("a garbage request line", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 tls hello\r\n\r\n".to_vec(), status(400), Nobody),
        case("HTTP/2 preface then garbage", raw("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\nnot a frame at all, not at all"), Want::Closed, Nobody),
        // ---- paths
        case("dot-dot segment", get("/v1/../admin"), error(400, "invalid_request"), Nobody),
        case("percent-encoded dot-dot", get("/v1/%2e%2e/admin"), error(400, "invalid_request"), Nobody),
        case("double-encoded dot-dot", get("/v1/%252e%252e/admin"), error(400, "invalid_request"), Nobody),
        case("dot-dot with a ;param", get("/v1/models/..;/x"), error(400, "invalid_request"), Nobody),
        case("backslash dot-dot", get("/v1/..%5cadmin"), error(400, "invalid_request"), Nobody),
        case("overlong UTF-8 dots", get("/v1/%c0%ae%c0%ae/x"), error(400, "invalid_request"), Nobody),
        case("NUL in the path", get("/v1/models%00"), error(400, "invalid_request"), Nobody),
        case("CR LF in the path", get("/v1/a%0d%0aX-Injected:%201"), error(400, "invalid_request"), Nobody),
        case("an unknown prefix", get("/admin"), error(404, "unknown_url"), Nobody),
        case("artifact id not hex", get("/visor/artifacts/..%2f..%2fetc"), error(400, "invalid_request"), Nobody),
        case("artifact unknown", get(&format!("/visor/artifacts/{}", "0".repeat(64))), error(404, "artifact_not_found"), Nobody),
        case("session id with a slash", get("/visor/sessions/a%2fb"), error(400, "invalid_request"), Nobody),
        case("healthz", get("/healthz"), status(200), Nobody),
        // Aliases of the transformed paths are the paths themselves (servers
        // that decode the path route them there): transformed, and sent
        // upstream in their one spelling (checked below).
        case("image: alias chat/completion%73", json_post("/v1/chat/completion%73", &oss_image_chat(&data_url)), status(200), A),
        case("image: alias /v1//chat/completions", json_post("/v1//chat/completions", &oss_image_chat(&data_url)), status(200), A),
        case("image: alias chat/completions/", json_post("/v1/chat/completions/", &oss_image_chat(&data_url)), status(200), A),
        case("image: alias /v1//responses", json_post("/v1//responses", serde_json::json!({"model":"gpt-oss-120b","input":[{"role":"user","content":[{"type":"input_image","image_url":data_url}]}]}).to_string().as_bytes()), status(200), A),
        case("image: alias m%65ssages", json_post("/v1/m%65ssages", serde_json::json!({"model":"gpt-oss-120b","max_tokens":5,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":png}}]}]}).to_string().as_bytes()), status(200), A),
        case("escaped slash in a POST path", json_post("/v1/chat%2Fcompletions", &oss_image_chat(&data_url)), error(400, "invalid_request"), Nobody),
        case("escaped percent in a POST path", json_post("/v1/chat/completion%2573", &oss_image_chat(&data_url)), error(400, "invalid_request"), Nobody),
        // ---- upstream faults
        case("upstream refuses connections", chat(r#"{"model":"dead-1","messages":[]}"#), error(502, "upstream_unreachable"), Nobody),
        case("upstream never answers", chat(r#"{"model":"slow-1","messages":[]}"#), error(504, "upstream_timeout"), Nobody),
        case("upstream cuts the stream", chat(r#"{"model":"cut-1","stream":true,"messages":[]}"#), Want::Cut, Nobody),
        case("upstream 500 passes through", chat(r#"{"model":"gpt-500","messages":[]}"#), status(500), A),
        case("upstream 429 passes through", chat(r#"{"model":"gpt-429","messages":[]}"#), status(429), A),
    ];
    for c in &mut v {
        c.no_images_upstream = c.name.starts_with("image:");
    }
    v
}

/// What came back on a raw connection.
#[derive(Debug)]
enum Got {
    Response {
        status: u16,
        body: String,
        whole: bool,
    },
    Closed,
}

async fn exchange(addr: SocketAddr, req: &[u8]) -> Got {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(req).await;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    let _ = tokio::time::timeout(BOUND, async {
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    if !buf.starts_with(b"HTTP/") {
        // Nothing, or not an HTTP/1 answer (an HTTP/2 GOAWAY).
        return Got::Closed;
    }
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body_at = text.find("\r\n\r\n").map_or(text.len(), |i| i + 4);
    let head = text[..body_at].to_ascii_lowercase();
    let body = text[body_at..].to_owned();
    let whole = if head.contains("transfer-encoding: chunked") {
        body.ends_with("0\r\n\r\n")
    } else {
        http_message_len(&buf).is_some_and(|n| n <= buf.len())
    };
    Got::Response {
        status,
        body,
        whole,
    }
}

fn upstream_handler(r: &Recorded) -> Reply {
    let body = String::from_utf8_lossy(&r.body);
    if body.contains("\"gpt-500\"") {
        return Reply::json(500, r#"{"error":{"message":"boom","type":"server_error"}}"#);
    }
    if body.contains("\"gpt-429\"") {
        return Reply::json(
            429,
            r#"{"error":{"message":"slow down","type":"requests"}}"#,
        );
    }
    chat_ok()
}

/// Paused time (one worker: all of visor on the test's clock): the cases
/// that wait for a deadline (no answer, a connection left open) cost
/// nothing.
#[tokio::test(start_paused = true)]
async fn every_case_in_the_corpus_gets_its_answer() {
    let a = MockUpstream::start(upstream_handler).await;
    let b = MockUpstream::start(|_| chat_ok()).await;
    let dead = MockUpstream::builder()
        .fault(Fault::RefuseConnect)
        .start()
        .await;
    let slow = MockUpstream::builder()
        .fault(Fault::NeverAnswer)
        .start()
        .await;
    let cut = MockUpstream::builder()
        .fault(Fault::CutAfterChunks(1))
        .start()
        .await;
    let visor = Visor::start(&format!(
        "[server]\nworkers = 1\nmax_body_bytes = 65536\nfirst_byte_timeout_secs = 1\nheader_timeout_secs = 3\n\
         [images]\nnon_vision = \"strip\"\n\
         [[upstream]]\nname=\"a\"\nbase_url=\"{}/v1\"\nmodels=[\"gpt-*\",\"m\"]\n\
         [[upstream]]\nname=\"b\"\nbase_url=\"{}/v1\"\nmodels=[\"echo-*\"]\n\
         [[upstream]]\nname=\"dead\"\nbase_url=\"{}/v1\"\nmodels=[\"dead-*\"]\n\
         [[upstream]]\nname=\"slow\"\nbase_url=\"{}/v1\"\nmodels=[\"slow-*\"]\n\
         [[upstream]]\nname=\"cut\"\nbase_url=\"{}/v1\"\nmodels=[\"cut-*\"]\n",
        a.url(),
        b.url(),
        dead.url(),
        slow.url(),
        cut.url()
    ))
    .await;
    let cases = cases();
    assert!(cases.len() >= 60, "{} cases", cases.len());
    let mut failures = Vec::new();
    for c in &cases {
        let (na, nb) = (a.count(), b.count());
        let got = exchange(visor.addr, &c.raw).await;
        let reached = match (a.count() - na, b.count() - nb) {
            (0, 0) => Reach::Nobody,
            (1, 0) => Reach::A,
            (0, 1) => Reach::B,
            other => {
                failures.push(format!("{}: reached both/many upstreams {other:?}", c.name));
                continue;
            }
        };
        let ok = match (&c.want, &got) {
            (
                Want::Status(s, code),
                Got::Response {
                    status,
                    body,
                    whole,
                },
            ) => {
                *status == *s
                    && *whole
                    && code.is_none_or(|code| error_code(body.as_bytes()) == code)
            }
            (Want::Cut, Got::Response { status, whole, .. }) => *status == 200 && !*whole,
            (Want::Closed, Got::Closed) => true,
            _ => false,
        };
        if !ok {
            let shown = match &got {
                Got::Response {
                    status,
                    body,
                    whole,
                } => {
                    format!("{status} whole={whole} {:.160}", body)
                }
                Got::Closed => "closed".to_owned(),
            };
            failures.push(format!("{}: want {:?}, got {shown}", c.name, c.want));
        }
        if reached != c.reach {
            failures.push(format!(
                "{}: reached {reached:?}, must reach {:?}",
                c.name, c.reach
            ));
        }
        if c.name.starts_with("Content-Length and Transfer-Encoding") && reached == Reach::A {
            let sent = a.recorded().pop().unwrap();
            if sent.headers.get("content-length").is_some_and(|v| v != "0") || !sent.body.is_empty()
            {
                failures.push(format!(
                    "{}: forwarded with {:?} and {} body bytes",
                    c.name,
                    sent.headers.get("content-length"),
                    sent.body.len()
                ));
            }
        }
        if c.name.contains(": alias ") && reached == Reach::A {
            let sent = a.recorded().pop().unwrap();
            let path = sent.uri.path().to_owned();
            if !["/v1/chat/completions", "/v1/responses", "/v1/messages"].contains(&path.as_str()) {
                failures.push(format!("{}: sent upstream as {path}", c.name));
            }
        }
        if c.no_images_upstream && reached == Reach::A {
            let sent = a.recorded().pop().unwrap();
            let text = String::from_utf8_lossy(&sent.body);
            let leaked = text.contains(";base64,")
                || text.contains(&whole_b64()[..40])
                || text.contains("\"type\":\"image")
                || text.contains("input_image");
            if leaked {
                failures.push(format!("{}: image bytes reached the upstream", c.name));
            }
        }
    }
    // Still serving after all of it.
    let (status, _, _) = send(
        Request::get(visor.url("/healthz"))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

// ------------------------------------------------------------- scenarios

type Scenario = fn() -> Pin<Box<dyn Future<Output = Result<(), String>>>>;

fn check(cond: bool, what: impl Into<String>) -> Result<(), String> {
    if cond { Ok(()) } else { Err(what.into()) }
}

/// A streamed Chat request on a new client: the response head.
async fn request_stream(visor: &Visor) -> Result<http::Response<hyper::body::Incoming>, String> {
    client()
        .request(post_json(&visor.url("/v1/chat/completions"), CHAT_STREAM))
        .await
        .map_err(|e| e.to_string())
}

/// A client that sends half its body and leaves: nothing reaches the
/// upstream, visor goes on serving.
async fn client_leaves_mid_upload() -> Result<(), String> {
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::for_mock(&mock, "").await;
    let mut s = TcpStream::connect(visor.addr).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: v\r\nContent-Length: 1000\r\n\r\n{\"model\":\"m\"")
        .await
        .unwrap();
    drop(s);
    let (status, _, _) = post_chat(&visor, CHAT).await;
    check(status == 200, format!("next request: {status}"))?;
    check(
        mock.count() == 1,
        format!("upstream saw {} requests", mock.count()),
    )
}

/// A client that leaves mid-stream: the upstream request is cancelled
/// (its connection closed).
async fn client_leaves_mid_stream() -> Result<(), String> {
    let (mock, tx) = fed_once().await;
    let visor = Visor::for_mock(&mock, "").await;
    let resp = request_stream(&visor).await?;
    let mut body = resp.into_body();
    tx.send(Chunk::Data(Bytes::from_static(b"data: {}\n\n")))
        .await
        .unwrap();
    let _ = next_data(&mut body, BOUND).await;
    drop(body);
    check(
        mock.wait_closed(1, BOUND).await,
        "upstream connection not closed",
    )
}

/// A mock that answers describer calls as `describer` says (and the rest
/// with [`chat_ok`]), and visor with it as describer; `extra` are more
/// `[describer]` keys.
async fn describing(
    describer: impl Fn(&Recorded) -> Reply + Send + Sync + 'static,
    extra: &str,
) -> (MockUpstream, Visor) {
    let mock = MockUpstream::start(move |r| {
        if is_describer_call(r) {
            describer(r)
        } else {
            chat_ok()
        }
    })
    .await;
    let visor = Visor::for_mock(
        &mock,
        &format!("[describer]\nupstream = \"mock\"\nmodel = \"{DESCRIBER}\"\n{extra}"),
    )
    .await;
    (mock, visor)
}

/// The describer was asked (so its fault is what the scenario met).
fn asked_describer(mock: &MockUpstream) -> Result<(), String> {
    check(
        mock.recorded().iter().any(is_describer_call),
        "the describer was never called",
    )
}

/// A describer that is down: the image gets a placeholder, the request 200.
async fn describer_down() -> Result<(), String> {
    let (mock, visor) =
        describing(|_| Reply::json(500, r#"{"error":{"message":"down"}}"#), "").await;
    let body = chat_with_images("gpt-oss-120b", &[png_data_url("describer-down").0]);
    let (status, h, _) = post_chat(&visor, body).await;
    check(status == 200, format!("status {status}"))?;
    asked_describer(&mock)?;
    check(h["x-visor-images-replaced"] == "1", "image not replaced")
}

/// A describer slower than its timeout: a placeholder in time.
async fn describer_slow() -> Result<(), String> {
    let (mock, visor) = describing(
        |r| Reply::After(Duration::from_secs(30), Box::new(describer_answer(r))),
        "timeout_secs = 1\n",
    )
    .await;
    let body = chat_with_images("gpt-oss-120b", &[png_data_url("describer-slow").0]);
    let started = tokio::time::Instant::now();
    let (status, _, _) = post_chat(&visor, body).await;
    check(status == 200, format!("status {status}"))?;
    asked_describer(&mock)?;
    check(
        started.elapsed() < Duration::from_secs(8),
        "waited for the slow describer",
    )
}

/// A describer answering garbage: a placeholder.
async fn describer_garbage() -> Result<(), String> {
    let (mock, visor) = describing(|_| Reply::json(200, "{not json"), "").await;
    let body = chat_with_images("gpt-oss-120b", &[png_data_url("describer-garbage").0]);
    let (status, _, _) = post_chat(&visor, body).await;
    check(status == 200, format!("status {status}"))?;
    asked_describer(&mock)?;
    let sent = mock
        .recorded()
        .into_iter()
        .rev()
        .find(|r| !is_describer_call(r))
        .unwrap();
    check(
        !String::from_utf8_lossy(&sent.body).contains(";base64,"),
        "image reached the model",
    )
}

fn redis_config(mock: &MockUpstream, redis: &RedisServer) -> String {
    format!(
        "[server]\ndata_dir = \"{}\"\n[store]\nbackend = \"{}\"\nprefix = \"corpus-{}:\"\n\
         [[upstream]]\nname = \"mock\"\nbase_url = \"{}/v1\"\nmodels = [\"*\"]\n",
        temp_dir("corpus-redis").display(),
        redis.url(),
        std::process::id(),
        mock.url()
    )
}

fn session_post(visor: &Visor, id: &str) -> Request<Full<Bytes>> {
    Request::post(visor.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-visor-session", id)
        .body(Full::new(Bytes::from_static(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        )))
        .unwrap()
}

/// Redis down: a session request is 503 (its history cannot be read), a
/// plain request 200.
async fn redis_down() -> Result<(), String> {
    if !cfg!(feature = "redis") {
        return Ok(()); // a build without the Redis store
    }
    let Some(mut redis) = RedisServer::start() else {
        return Ok(()); // the skip is printed (and refused under CI)
    };
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::start(&redis_config(&mock, &redis)).await;
    redis.stop();
    let (status, _, body) = send(session_post(&visor, "down")).await;
    check(
        status == 503 && error_code(&body) == "store_unavailable",
        format!("session: {status}"),
    )?;
    let (status, _, _) = post_chat(&visor, CHAT).await;
    check(status == 200, format!("plain: {status}"))
}

/// Redis restarted between two session requests: the second is served.
async fn redis_restart() -> Result<(), String> {
    if !cfg!(feature = "redis") {
        return Ok(());
    }
    let Some(mut redis) = RedisServer::start() else {
        return Ok(());
    };
    let mock = MockUpstream::start(|_| chat_ok()).await;
    let visor = Visor::start(&redis_config(&mock, &redis)).await;
    let (status, _, _) = send(session_post(&visor, "restart")).await;
    check(status == 200, format!("before: {status}"))?;
    redis.stop();
    redis.restart();
    let (status, _, _) = send(session_post(&visor, "restart")).await;
    check(status == 200, format!("after the restart: {status}"))
}

/// Shutdown with a stream open: the stream finishes whole, new connections
/// are refused after the drain delay, visor returns.
async fn shutdown_mid_stream() -> Result<(), String> {
    let (mock, tx) = fed_once().await;
    let mut visor = Visor::for_mock(&mock, "").await;
    let resp = request_stream(&visor).await?;
    visor.shutdown();
    tx.send(Chunk::Data(Bytes::from_static(b"data: {\"a\":1}\n\n")))
        .await
        .unwrap();
    tx.send(Chunk::Data(Bytes::from_static(b"data: [DONE]\n\n")))
        .await
        .unwrap();
    drop(tx);
    let collected = tokio::time::timeout(BOUND, resp.into_body().collect())
        .await
        .map_err(|_| "stream did not finish".to_owned())?
        .map_err(|e| format!("stream cut at shutdown: {e}"))?;
    check(
        String::from_utf8_lossy(&collected.to_bytes()).contains("[DONE]"),
        "stream incomplete",
    )?;
    let task = visor.task.take().unwrap();
    check(
        tokio::time::timeout(BOUND, task).await.is_ok(),
        "visor did not return",
    )?;
    check(
        TcpStream::connect(visor.addr).await.is_err(),
        "still accepting after shutdown",
    )
}

#[tokio::test]
async fn every_fault_scenario_gets_its_answer() {
    // The full disk and the deleted store file are in tests/store_faults.rs
    // (a tmpfs of their own), connection faults in tests/connections.rs.
    let scenarios: Vec<(&str, Scenario)> = vec![
        ("client leaves mid-upload", || {
            Box::pin(client_leaves_mid_upload())
        }),
        ("client leaves mid-stream", || {
            Box::pin(client_leaves_mid_stream())
        }),
        ("describer down", || Box::pin(describer_down())),
        ("describer slower than its timeout", || {
            Box::pin(describer_slow())
        }),
        (
            "describer answers garbage",
            || Box::pin(describer_garbage()),
        ),
        ("Redis down", || Box::pin(redis_down())),
        ("Redis restarted", || Box::pin(redis_restart())),
        ("shutdown with a stream open", || {
            Box::pin(shutdown_mid_stream())
        }),
    ];
    let mut failures = Vec::new();
    for (name, run) in &scenarios {
        if let Err(e) = run().await {
            failures.push(format!("{name}: {e}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ------------------------------------------------------- WebSocket paths

/// A WebSocket upstream that accepts every upgrade, records its path and
/// each text event, and answers nothing.
async fn ws_recorder() -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = seen.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let s = s.clone();
            tokio::spawn(async move {
                let s2 = s.clone();
                #[allow(clippy::result_large_err)]
                let callback =
                    move |req: &Request, resp: Response| -> Result<Response, ErrorResponse> {
                        s2.lock()
                            .unwrap()
                            .push(format!("path {}", req.uri().path()));
                        Ok(resp)
                    };
                let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(stream, callback).await else {
                    return;
                };
                while let Some(Ok(m)) = ws.next().await {
                    if let tokio_tungstenite::tungstenite::Message::Text(t) = m {
                        s.lock().unwrap().push(t.to_string());
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), seen)
}

/// `GET /v1/respons%65s` and `/v1//responses` upgrades are the Responses
/// WebSocket mode: each `response.create` is held to the caller's key and
/// transformed for its model, and the upstream is asked for
/// `/v1/responses`.
#[tokio::test]
async fn websocket_path_aliases_are_the_responses_mode() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let (up, seen) = ws_recorder().await;
    let visor = Visor::start(&format!(
        "[images]\nnon_vision = \"strip\"\n\
         [[upstream]]\nname = \"ws\"\nbase_url = \"{up}/v1\"\nmodels = [\"*\"]\n\
         [[key]]\nname = \"oss-only\"\nkey = \"sk-oss\"\nmodels = [\"gpt-oss-*\"]\n"
    ))
    .await;
    let png = whole_b64();
    for alias in [
        "/v1/respons%65s?model=vis-model",
        "/v1//responses?model=vis-model",
    ] {
        seen.lock().unwrap().clear();
        let mut req = format!("ws://{}{alias}", visor.addr)
            .into_client_request()
            .unwrap();
        req.headers_mut()
            .insert("authorization", "Bearer sk-oss".parse().unwrap());
        let stream = TcpStream::connect(visor.addr).await.unwrap();
        let (mut ws, _) = tokio::time::timeout(BOUND, tokio_tungstenite::client_async(req, stream))
            .await
            .unwrap()
            .unwrap();
        let create = |model: &str| {
            let e = serde_json::json!({"type": "response.create", "model": model, "input": [
                {"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "what is this?"},
                    {"type": "input_image", "image_url": format!("data:image/png;base64,{png}")}]}]});
            Message::Text(e.to_string().into())
        };
        // A model the key may not use: refused on the socket.
        ws.send(create("vis-model")).await.unwrap();
        let refusal = loop {
            let m = tokio::time::timeout(BOUND, ws.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            if let Message::Text(t) = m {
                break serde_json::from_str::<serde_json::Value>(&t).unwrap();
            }
        };
        assert_eq!(
            refusal["error"]["code"], "model_not_allowed",
            "{alias}: {refusal}"
        );
        // One it may use, text-only: sent on without the image.
        ws.send(create("gpt-oss-120b")).await.unwrap();
        let event = tokio::time::timeout(BOUND, async {
            loop {
                let got = seen
                    .lock()
                    .unwrap()
                    .iter()
                    .find(|e| e.contains("response.create"))
                    .cloned();
                if let Some(e) = got {
                    return e;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the allowed create reached the upstream");
        assert!(
            !event.contains("vis-model"),
            "{alias}: the refused create went up"
        );
        assert!(
            !event.contains(&png[..40]) && !event.contains(";base64,"),
            "{alias}: image bytes went up"
        );
        assert_eq!(seen.lock().unwrap()[0], "path /v1/responses", "{alias}");
        let _ = ws.close(None).await;
    }
}

// ------------------------------------------- the inline pool's one retry

/// What [`half_reader`] saw, shared with the test.
type Seen = std::sync::Arc<std::sync::Mutex<Vec<usize>>>;

/// An HTTP/1.1 upstream on a raw socket: each connection answers small
/// requests (200, kept alive); a request whose body is over 1 MiB has 64
/// KiB of it read, then the connection is closed without an answer. Per
/// connection: the body bytes it read; and every request head's
/// `Content-Length`, in order.
async fn half_reader() -> (SocketAddr, Seen, Seen) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let c = conns.clone();
    let h = heads.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let c = c.clone();
            let h = h.clone();
            let at = {
                let mut v = c.lock().unwrap();
                v.push(0);
                v.len() - 1
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = vec![0u8; 65536];
                loop {
                    // One request head.
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length: "))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    buf.drain(..head_end);
                    h.lock().unwrap().push(len);
                    let want = if len > (1 << 20) { 65536 } else { len };
                    while buf.len() < want {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    c.lock().unwrap()[at] += want.min(buf.len());
                    if want < len {
                        // Taken in part: the connection goes, unanswered.
                        return;
                    }
                    buf.drain(..len);
                    let body = r#"{"object":"list","data":[]}"#;
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if s.write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, conns, heads)
}

/// A request whose bytes reached the upstream is never sent again: the
/// pooled connection that took part of a 4 MB body and closed is a 502,
/// and no other connection is opened for it (a duplicated POST is a
/// duplicated bill). A request on a pooled connection still goes when it
/// is small.
#[tokio::test]
async fn a_request_the_upstream_took_in_part_is_never_sent_again() {
    let (up, conns, heads) = half_reader().await;
    // One worker: one thread's pool, so the big request goes on the pooled
    // connection the small one left.
    let visor = Visor::start(&format!(
        "[server]\nworkers = 1\n[[upstream]]\nname = \"u\"\nbase_url = \"http://{up}/v1\"\nmodels = [\"*\"]\n"
    ))
    .await;
    let post = |body: Vec<u8>| {
        let req = post_json(&visor.url("/v1/embeddings"), body);
        send(req)
    };
    let small = br#"{"model":"e","input":"hello"}"#.to_vec();
    assert_eq!(post(small.clone()).await.0, 200);
    let before = conns.lock().unwrap().len();
    assert_eq!(before, 1);
    let big = format!(r#"{{"model":"e","input":"{}"}}"#, "x".repeat(4 << 20)).into_bytes();
    let (status, _, body) = post(big).await;
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
    // Its head reached the upstream once, whatever connection it took.
    let sent: Vec<usize> = heads.lock().unwrap().clone();
    let big_sends = sent.iter().filter(|&&n| n > 1 << 20).count();
    assert_eq!(big_sends, 1, "the request was sent again: {sent:?}");
    let seen = conns.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "it went on the pooled connection: {seen:?}");
    assert!(seen[0] <= small.len() + 65536, "{seen:?}");
    // The connection that went is not reused: the next request is served.
    assert_eq!(post(small).await.0, 200);
}
