//! Hostile documents through the real proxy (loopback sockets, the mock
//! upstream as the model and the describer): a document that unpacks to
//! far more text than it weighs is cut, per document and per request, and
//! says so; the body sent upstream stays within `server.max_body_bytes`;
//! documents are read under the request's deadline, and what is left
//! unread says why; a PDF nested deeper than the parser reads says so.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

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
