//! Hostile documents through the real proxy (loopback sockets, the mock
//! upstream as the model and the describer): a document that unpacks to
//! far more text than it weighs is cut, per document and per request, and
//! says so; the body sent upstream stays within `server.max_body_bytes`;
//! documents are read under the request's deadline, and what is left
//! unread says why; a PDF nested deeper than the parser reads says so.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};
use support::*;

fn b64(bytes: &[u8]) -> String {
    base64_simd::STANDARD.encode_to_string(bytes)
}

/// The mock: describer calls described, the rest answered `ok`.
fn everything(r: &Recorded) -> Reply {
    if is_describer_call(r) {
        describer_answer(r)
    } else {
        chat_ok()
    }
}

/// The bodies the model was sent (describer calls left out).
fn model_calls(mock: &MockUpstream) -> Vec<Recorded> {
    mock.recorded()
        .into_iter()
        .filter(|r| !is_describer_call(r))
        .collect()
}

/// A Chat request to a text-only model (gpt-oss: no PDF, no Office)
/// carrying `parts` after a question.
fn chat_with(parts: Vec<Value>) -> Bytes {
    let mut content = vec![json!({"type": "text", "text": "What do these say?"})];
    content.extend(parts);
    Bytes::from(
        serde_json::to_vec(&json!({"model": "gpt-oss-120b", "messages": [
            {"role": "user", "content": content},
        ]}))
        .unwrap(),
    )
}

fn file_part(media_type: &str, bytes: &[u8], name: &str) -> Value {
    json!({"type": "file", "file": {"file_data": format!("data:{media_type};base64,{}", b64(bytes)), "filename": name}})
}

fn pdf_part(bytes: &[u8], name: &str) -> Value {
    file_part("application/pdf", bytes, name)
}

/// The texts of the user message's parts (after the question) in a body
/// sent upstream.
fn replaced(body: &[u8]) -> Vec<String> {
    let v: Value = serde_json::from_slice(body).unwrap();
    v["messages"][0]["content"].as_array().unwrap()[1..]
        .iter()
        .map(|p| p["text"].as_str().unwrap_or_default().to_owned())
        .collect()
}

// ------------------------------------------------------------ item 8

#[tokio::test]
async fn a_pdf_nested_deeper_than_the_parser_reads_says_why_it_has_no_pages() {
    // A page whose resources nest 1,000 arrays deep: the parser (512
    // levels) reads no page of it. It used to become "0 pages", no reason.
    let content = b"BT /F1 12 Tf 20 100 Td (Deep inside) Tj ET";
    let resources = format!(
        "{}/Font << /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >>{}",
        "/X [".repeat(1000),
        "]".repeat(1000)
    );
    let deep = pdf_build::pdf(1, 200, &resources, &[pdf_build::stream("", content)]);
    let tree = pdf_build::inline_nested_pdf(1000, content);
    let mock = MockUpstream::start(everything).await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    let (status, _, body) = post_chat(
        &visor,
        chat_with(vec![
            pdf_part(&deep, "deep.pdf"),
            pdf_part(&tree, "tree.pdf"),
        ]),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let texts = replaced(&model_calls(&mock)[0].body);
    for (text, name) in texts.iter().zip(["deep.pdf", "tree.pdf"]) {
        assert!(
            text.contains(&format!(
                "{name}: could not be read: too deeply nested (objects nested over 512 levels deep)]"
            )),
            "{text}"
        );
        assert!(!text.contains("0 pages"), "{text}");
    }
}

// ------------------------------------------------------------ item 6

const XLSX: &str = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet";

/// Ten 4 KB spreadsheets, each one 10,000-character shared string shown
/// in 20,000 cells: 200 million characters if read out whole.
fn ten_amplified() -> Vec<Value> {
    (0..10)
        .map(|i| {
            let xlsx = pdf_build::amplified_xlsx(10_000, 20_000, &format!("sheet{i}-"));
            file_part(XLSX, &xlsx, &format!("amplified{i}.xlsx"))
        })
        .collect()
}

#[tokio::test]
async fn an_amplifying_spreadsheet_is_cut_per_document_and_per_request_and_says_so() {
    // Defaults but for the body limit: 2 MiB, so the per-request total is
    // derived from it (2 MiB / 8 = 262,144 characters).
    let mock = MockUpstream::start(everything).await;
    let max_body = 2 << 20;
    let visor = Visor::for_mock(
        &mock,
        &format!("[server]\nmax_body_bytes = {max_body}\n{DESCRIBE}"),
    )
    .await;
    let request = chat_with(ten_amplified());
    assert!(request.len() < 100 << 10, "{}", request.len());
    let (status, headers, body) = post_chat(&visor, request).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(headers["x-visor-media-replaced"], "10");
    let calls = model_calls(&mock);
    assert_eq!(calls.len(), 1);
    assert!(
        calls[0].body.len() <= max_body,
        "{} bytes went upstream",
        calls[0].body.len()
    );
    let texts = replaced(&calls[0].body);
    assert_eq!(texts.len(), 10);
    // The first is cut at 150,000 characters (documents.max_document_chars),
    // the reader having stopped there.
    let first = &texts[0];
    assert!(first.starts_with("[document sha256:"), "{}", &first[..200]);
    assert!(
        first.ends_with("\n[visor: document text cut at 150000 characters (documents.max_document_chars); the rest of the document was not read]"),
        "{}",
        &first[first.len() - 300..]
    );
    assert!(first.contains("sheet0-xxxx"));
    // The second is cut to what is left of the request's 262,144.
    assert!(
        texts[1].ends_with(&format!(
            "\n[visor: document text cut at {} characters of 150000 (documents.max_request_chars); before that, document text cut at 150000 characters (documents.max_document_chars); the rest of the document was not read]",
            262_144 - first.chars().count(),
        )),
        "{}",
        &texts[1][texts[1].len().saturating_sub(300)..]
    );
    // The rest are not read at all.
    for (i, text) in texts.iter().enumerate().skip(2) {
        assert!(
            text.ends_with(&format!(
                "amplified{i}.xlsx: not read: over this request's document text budget (documents.max_request_chars)]"
            )),
            "{text}"
        );
    }
    let shown: usize = texts.iter().map(|t| t.chars().count()).sum();
    assert!(shown < 262_144 + 2_000, "{shown}");
}

/// One document sent many times is read once, and its text goes in once:
/// the later copies are references to it, so copies do not multiply a
/// request's text past its budget.
#[tokio::test]
async fn copies_of_one_document_are_one_text_and_references() {
    let mock = MockUpstream::start(everything).await;
    let visor = Visor::for_mock(
        &mock,
        &format!("[server]\nmax_body_bytes = 67108864\n[documents]\nmax_request_chars = 400000\n{DESCRIBE}"),
    )
    .await;
    let xlsx = pdf_build::amplified_xlsx(10_000, 20_000, "copied-");
    let copies: Vec<Value> = (0..20)
        .map(|_| file_part(XLSX, &xlsx, "same.xlsx"))
        .collect();
    let (status, _, body) = post_chat(&visor, chat_with(copies)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let calls = model_calls(&mock);
    let texts = replaced(&calls[0].body);
    assert_eq!(texts.len(), 20);
    let lens: Vec<usize> = texts.iter().map(|t| t.chars().count()).collect();
    assert!(lens[0] > 150_000, "{lens:?}");
    for t in &texts[1..] {
        assert!(t.contains("the same document as earlier"), "{t}");
        assert!(t.chars().count() < 200, "{t}");
    }
}

#[tokio::test]
async fn document_text_that_would_take_the_body_past_max_body_bytes_is_cut_to_fit() {
    // Budgets far above the body limit: the body limit itself cuts.
    let mock = MockUpstream::start(everything).await;
    let max_body = 1 << 20;
    let visor = Visor::for_mock(
        &mock,
        &format!(
            "[server]\nmax_body_bytes = {max_body}\n{DESCRIBE}[documents]\nmax_document_chars = 1000000\nmax_request_chars = 100000000\n"
        ),
    )
    .await;
    let parts: Vec<Value> = ten_amplified().into_iter().take(3).collect();
    let (status, _, body) = post_chat(&visor, chat_with(parts)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let calls = model_calls(&mock);
    assert_eq!(calls.len(), 1);
    assert!(
        calls[0].body.len() <= max_body,
        "{} bytes went upstream",
        calls[0].body.len()
    );
    let texts = replaced(&calls[0].body);
    for (i, text) in texts.iter().enumerate() {
        assert!(text.contains(&format!("sheet{i}-xxxx")), "{i}");
        assert!(
            text.ends_with(
                " characters of 1000000 (server.max_body_bytes); before that, document text cut at 1000000 characters (documents.max_document_chars); the rest of the document was not read]"
            ),
            "{}",
            &text[text.len().saturating_sub(400)..]
        );
    }
    // Cut to fit, not to nothing: most of the megabyte is document text.
    let shown: usize = texts.iter().map(String::len).sum();
    assert!(shown > max_body / 2, "{shown}");
}

// ------------------------------------------------------------ item 7

/// The chart fixture (page 2 holds a figure) made distinct by a comment
/// after its end.
fn chart_pdf(salt: &str) -> Vec<u8> {
    let mut pdf = fixture("media/chart.pdf").to_vec();
    pdf.extend_from_slice(format!("%{salt}\n").as_bytes());
    pdf
}

#[tokio::test]
async fn documents_are_read_under_the_request_deadline_and_what_is_left_says_out_of_time() {
    // A describer that never answers (its own timeout a minute): the
    // first document's figure waits on it, the others wait their turn.
    // With a 4 s request timeout, reading stops at 3 s (a quarter is left
    // for the upstream), and the request goes upstream before its
    // deadline, saying what was not done.
    let arrived = std::sync::Arc::new(std::sync::Mutex::new(None));
    let seen = arrived.clone();
    let mock = MockUpstream::start(move |r| {
        if is_describer_call(r) {
            Reply::Hang
        } else {
            *seen.lock().unwrap() = Some(std::time::Instant::now());
            chat_ok()
        }
    })
    .await;
    let visor = Visor::for_mock(
        &mock,
        &format!("[server]\nrequest_timeout_secs = 4\n{DESCRIBE}timeout_secs = 60\n"),
    )
    .await;
    let parts = (0..3)
        .map(|i| pdf_part(&chart_pdf(&format!("copy{i}")), &format!("chart{i}.pdf")))
        .collect();
    let started = std::time::Instant::now();
    let (status, _, body) = post_chat(&visor, chat_with(parts)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let arrived = arrived.lock().unwrap().expect("the model was called");
    assert!(
        arrived.duration_since(started) < Duration::from_secs(4),
        "sent upstream {:?} after the request began, past its 4 s deadline",
        arrived.duration_since(started)
    );
    let calls = model_calls(&mock);
    assert_eq!(calls.len(), 1);
    let texts = replaced(&calls[0].body);
    // The first was read; its figure was not described in time.
    assert!(texts[0].contains("--- page 2 ---"), "{}", texts[0]);
    assert!(
        texts[0].contains("[page 2: not described, out of time]"),
        "{}",
        texts[0]
    );
    // The others were never read.
    for (i, text) in texts.iter().enumerate().skip(1) {
        assert!(text.starts_with("[document sha256:"), "{text}");
        assert!(
            text.ends_with(&format!(
                "application/pdf, chart{i}.pdf: not read: out of time]"
            )),
            "{text}"
        );
    }
    // Nothing of it was kept: the next request reads and describes again.
    assert_eq!(
        visor.state.rewrite.media.describer().cache_entries().await,
        0,
        "an incomplete text is not cached"
    );
}
