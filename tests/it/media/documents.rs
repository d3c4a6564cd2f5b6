//! Documents and audio through the real proxy, to models that cannot take
//! them: real PDFs, Office files and speech (tests/fixtures/media), the
//! mock upstream as the model, the describer (Chat) and the transcriber
//! (`/audio/transcriptions`), every call recorded. Each file is replaced in
//! place by its text, page by page, with descriptions of the pages and
//! images that need them, or by its transcript; made once and cached; a
//! file that cannot be read, or a describer or transcriber that fails,
//! never fails the request.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use bytes::Bytes;
use serde_json::{Value, json};
use support::*;

/// What the mock transcriber hears in every audio file.
const HEARD: &str = "The quarterly revenue grew by twelve percent.";

fn media(name: &str) -> Bytes {
    fixture(&format!("media/{name}"))
}

fn b64(bytes: &[u8]) -> String {
    base64_simd::STANDARD.encode_to_string(bytes)
}

fn is_transcriber_call(r: &Recorded) -> bool {
    r.uri.path().ends_with("/audio/transcriptions")
}

/// The mock: describer calls described, transcriber calls heard, the rest
/// answered `ok`.
fn everything(r: &Recorded) -> Reply {
    if is_transcriber_call(r) {
        Reply::json(200, json!({"text": HEARD}).to_string())
    } else if is_describer_call(r) {
        describer_answer(r)
    } else {
        chat_ok()
    }
}

fn model_calls(mock: &MockUpstream) -> Vec<Value> {
    mock.recorded()
        .into_iter()
        .filter(|r| !is_describer_call(r) && !is_transcriber_call(r))
        .map(|r| serde_json::from_slice(&r.body).unwrap())
        .collect()
}

/// A Chat request to a text-only model (gpt-oss: the built-in table says
/// no vision, so no PDF and no audio) carrying `part` after a question.
fn chat_with(part: Value) -> Bytes {
    Bytes::from(
        serde_json::to_vec(&json!({"model": "gpt-oss-120b", "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "What does this say about revenue?"}, part]},
        ]}))
        .unwrap(),
    )
}

fn pdf_part(name: &str) -> Value {
    json!({"type": "file", "file": {"file_data": format!("data:application/pdf;base64,{}", b64(&media(name))), "filename": name}})
}

/// The text the model was sent in place of the user message's part 1.
fn replaced_text(call: &Value) -> String {
    let part = &call["messages"][1]["content"][1];
    assert_eq!(part["type"], "text", "{part}");
    part["text"].as_str().unwrap().to_owned()
}

async fn post(visor: &Visor, body: Bytes) -> http::HeaderMap {
    let (status, headers, resp) = send(post_json(&visor.url("/v1/chat/completions"), body)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
    headers
}

#[tokio::test]
async fn a_pdf_becomes_its_text_page_by_page_in_place() {
    let mock = MockUpstream::start(everything).await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    let headers = post(&visor, chat_with(pdf_part("text.pdf"))).await;
    assert_eq!(headers["x-visor-media-replaced"], "1");
    assert_eq!(headers["x-visor-images-replaced"], "0");

    let calls = model_calls(&mock);
    assert_eq!(calls.len(), 1);
    let text = replaced_text(&calls[0]);
    let sha = sha256_hex(&media("text.pdf"));
    assert!(
        text.starts_with(&format!(
            "[document sha256:{}, application/pdf, 3 pages, text.pdf]",
            &sha[..12]
        )),
        "{text}"
    );
    let page = |n: usize| text.find(&format!("--- page {n} ---")).unwrap();
    let sentence = text
        .find("The quarterly revenue grew by twelve percent.")
        .unwrap();
    assert!(
        page(1) < page(2) && page(2) < sentence && sentence < page(3),
        "the sentence is on page 2: {text}"
    );
    // Roles and the rest of the message as they were.
    assert_eq!(
        calls[0]["messages"][1]["content"][0]["text"],
        "What does this say about revenue?"
    );
    assert_eq!(calls[0]["messages"][0]["content"], "Answer briefly.");
    // A text-only PDF needs no describer.
    assert!(mock.recorded().iter().all(|r| !is_describer_call(r)));

    // The original is an artifact.
    let (status, h, bytes) = send(
        http::Request::get(visor.url(&format!("/visor/artifacts/{sha}")))
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(h["content-type"], "application/pdf");
    assert_eq!(bytes, media("text.pdf"));

    let m = visor.metrics().await;
    assert_eq!(
        metric(
            &m,
            "visor_media_total",
            &[("kind", "document"), ("action", "described")]
        ),
        Some(1.0)
    );

    // The same bytes under another name, in another conversation: its
    // header names its own file (the cached text is not another's).
    let renamed = json!({"type": "file", "file": {"file_data": format!("data:application/pdf;base64,{}", b64(&media("text.pdf"))), "filename": "copy.pdf"}});
    post(&visor, chat_with(renamed)).await;
    let text = replaced_text(&model_calls(&mock)[1]);
    assert!(
        text.starts_with(&format!(
            "[document sha256:{}, application/pdf, 3 pages, copy.pdf]",
            &sha[..12]
        )),
        "{text}"
    );
}

#[tokio::test]
async fn with_isolate_false_documents_are_read_on_a_thread_the_same_way() {
    let mock = MockUpstream::start(everything).await;
    let config = format!("{DESCRIBE}[documents]\nisolate = false\n");
    let visor = Visor::for_mock(&mock, &config).await;
    post(&visor, chat_with(pdf_part("chart.pdf"))).await;
    let text = replaced_text(&model_calls(&mock)[0]);
    assert!(text.contains("--- page 2 ---"), "{text}");
    assert!(text.contains("[page 2 described: "), "{text}");
}

#[tokio::test]
async fn figures_and_scans_are_rendered_and_described_once_then_cached() {
    let mock = MockUpstream::start(everything).await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    post(&visor, chat_with(pdf_part("chart.pdf"))).await;
    post(&visor, chat_with(pdf_part("scanned.pdf"))).await;

    let described: Vec<String> = mock
        .recorded()
        .iter()
        .filter(|r| is_describer_call(r))
        .map(described_url)
        .collect();
    assert_eq!(
        described.len(),
        2,
        "the chart page and the scanned page, nothing else"
    );
    assert!(
        described
            .iter()
            .all(|u| u.starts_with("data:image/png;base64,"))
    );

    let calls = model_calls(&mock);
    let chart = replaced_text(&calls[0]);
    assert!(chart.contains("--- page 2 ---\n"), "{chart}");
    let after_page2 = &chart[chart.find("--- page 2 ---").unwrap()..];
    assert!(
        after_page2.contains("[page 2 described: A test image (image/png"),
        "{chart}"
    );
    assert!(
        !chart[..chart.find("--- page 2 ---").unwrap()].contains("described:"),
        "page 1 is text only"
    );
    let scan = replaced_text(&calls[1]);
    assert!(scan.contains("1 page, scanned.pdf]"), "{scan}");
    assert!(
        scan.contains("[page 1 described: A test image (image/png"),
        "{scan}"
    );

    // The same documents again: no describer call, the same text.
    post(&visor, chat_with(pdf_part("chart.pdf"))).await;
    assert_eq!(
        mock.recorded()
            .iter()
            .filter(|r| is_describer_call(r))
            .count(),
        2
    );
    let calls = model_calls(&mock);
    assert_eq!(replaced_text(&calls[2]), chart);
}

#[tokio::test]
async fn the_pages_described_are_capped_and_the_rest_say_so() {
    let mock = MockUpstream::start(everything).await;
    let visor = Visor::for_mock(
        &mock,
        &format!("{DESCRIBE}[documents]\nmax_pages_described = 0\n"),
    )
    .await;
    post(&visor, chat_with(pdf_part("chart.pdf"))).await;
    assert!(mock.recorded().iter().all(|r| !is_describer_call(r)));
    let text = replaced_text(&model_calls(&mock)[0]);
    assert!(
        text.contains("[page 2: figures, not described: over documents.max_pages_described]"),
        "{text}"
    );
}

#[tokio::test]
async fn a_document_that_cannot_be_read_or_a_dead_describer_never_fails_the_request() {
    let mock = MockUpstream::start(|r| {
        if is_describer_call(r) {
            Reply::json(500, r#"{"error":{"message":"down"}}"#)
        } else {
            chat_ok()
        }
    })
    .await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    post(&visor, chat_with(pdf_part("corrupt.pdf"))).await;
    post(&visor, chat_with(pdf_part("encrypted.pdf"))).await;
    post(&visor, chat_with(pdf_part("chart.pdf"))).await;
    let calls = model_calls(&mock);
    let corrupt = replaced_text(&calls[0]);
    assert!(
        corrupt.starts_with("[document sha256:")
            && corrupt.contains("corrupt.pdf: could not be read"),
        "{corrupt}"
    );
    assert!(!corrupt.contains('\n'), "one line");
    let encrypted = replaced_text(&calls[1]);
    assert!(encrypted.contains("could not be read"), "{encrypted}");
    let chart = replaced_text(&calls[2]);
    assert!(
        chart.contains("[page 2: not described, describer unavailable]"),
        "{chart}"
    );
    assert!(
        chart.contains("--- page 1 ---"),
        "the text is still there: {chart}"
    );
    let m = visor.metrics().await;
    assert_eq!(
        metric(
            &m,
            "visor_media_total",
            &[("kind", "document"), ("action", "stripped")]
        ),
        Some(2.0)
    );
}

#[tokio::test]
async fn office_files_in_reading_order_with_their_images_described() {
    let mock = MockUpstream::start(everything).await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    let office = |name: &str, mt: &str| json!({"type": "file", "file": {"file_data": format!("data:{mt};base64,{}", b64(&media(name))), "filename": name}});
    post(
        &visor,
        chat_with(office(
            "report.docx",
            "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
        )),
    )
    .await;
    post(
        &visor,
        chat_with(office(
            "slides.pptx",
            "application/vnd.openxmlformats-officedocument.presentationml.presentation",
        )),
    )
    .await;
    post(
        &visor,
        chat_with(office(
            "sheet.xlsx",
            "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
        )),
    )
    .await;
    let calls = model_calls(&mock);
    let docx = replaced_text(&calls[0]);
    assert!(docx.contains(" | "), "the table as rows: {docx}");
    assert!(
        docx.contains("described: A test image (image/png"),
        "its picture described: {docx}"
    );
    let pptx = replaced_text(&calls[1]);
    let slide = |n: usize| pptx.find(&format!("--- slide {n} ---")).unwrap();
    assert!(slide(1) < slide(2) && slide(2) < slide(3), "{pptx}");
    let picture = pptx.find("described: A test image").unwrap();
    assert!(
        slide(2) < picture && picture < slide(3),
        "the picture is on slide 2: {pptx}"
    );
    let xlsx = replaced_text(&calls[2]);
    assert!(
        xlsx.contains("Sales") || xlsx.contains("--- sheet 1 ---"),
        "{xlsx}"
    );
    assert_eq!(
        mock.recorded()
            .iter()
            .filter(|r| is_describer_call(r))
            .count(),
        2
    );
}

#[tokio::test]
async fn speech_becomes_its_transcript_once_and_a_dead_transcriber_says_so() {
    let mock = MockUpstream::start(everything).await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    let wav = media("speech.wav");
    let audio = json!({"type": "input_audio", "input_audio": {"data": b64(&wav), "format": "wav"}});
    post(&visor, chat_with(audio.clone())).await;
    post(&visor, chat_with(audio)).await;
    let heard: Vec<Recorded> = mock
        .recorded()
        .into_iter()
        .filter(is_transcriber_call)
        .collect();
    assert_eq!(heard.len(), 1, "made once, then cached");
    let ct = heard[0].headers["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(ct.starts_with("multipart/form-data; boundary="), "{ct}");
    let body = &heard[0].body;
    let has = |w: &[u8]| memchr::memmem::find(body, w).is_some();
    assert!(has(b"name=\"model\"\r\n\r\nwhisper-1\r\n"));
    assert!(has(
        b"filename=\"audio.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
    ));
    assert!(
        memchr::memmem::find(body, &wav).is_some(),
        "the audio's own bytes"
    );
    let calls = model_calls(&mock);
    let sha = sha256_hex(&wav);
    assert_eq!(
        replaced_text(&calls[0]),
        format!(
            "[audio sha256:{}, audio/wav, transcript: {HEARD}]",
            &sha[..12]
        )
    );
    assert_eq!(replaced_text(&calls[1]), replaced_text(&calls[0]));

    // MP3, and a transcriber that fails: the request goes on.
    let down = MockUpstream::start(|r| {
        if is_transcriber_call(r) {
            Reply::json(503, r#"{"error":{"message":"busy"}}"#)
        } else {
            chat_ok()
        }
    })
    .await;
    let visor = Visor::for_mock(&down, DESCRIBE).await;
    let mp3 = json!({"type": "input_audio", "input_audio": {"data": b64(&media("speech.mp3")), "format": "mp3"}});
    post(&visor, chat_with(mp3)).await;
    let text = replaced_text(&model_calls(&down)[0]);
    assert!(
        text.starts_with("[audio sha256:")
            && text.ends_with("audio/mpeg: transcriber unavailable]"),
        "{text}"
    );
    let m = visor.metrics().await;
    assert_eq!(
        metric(
            &m,
            "visor_media_total",
            &[("kind", "audio"), ("action", "stripped")]
        ),
        Some(1.0)
    );
}

#[tokio::test]
async fn a_refusal_of_documents_teaches_the_model_and_the_request_is_retried_once() {
    // A model no row knows: its PDF goes as it is; the upstream refuses it.
    let mock = MockUpstream::start(|r| {
        let body = String::from_utf8_lossy(&r.body);
        if is_describer_call(r) {
            describer_answer(r)
        } else if body.contains("\"type\":\"file\"") {
            Reply::json(400, r#"{"error":{"message":"File input is not supported for this model.","type":"invalid_request_error"}}"#)
        } else {
            chat_ok()
        }
    })
    .await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    let body = |model: &str| {
        Bytes::from(
            serde_json::to_vec(&json!({"model": model, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "read"}, pdf_part("text.pdf")]},
            ]}))
            .unwrap(),
        )
    };
    post(&visor, body("mystery-model-7")).await;
    let calls = model_calls(&mock);
    assert_eq!(calls.len(), 2, "refused once, retried once");
    assert_eq!(calls[0]["messages"][0]["content"][1]["type"], "file");
    assert!(
        calls[1]["messages"][0]["content"][1]["text"]
            .as_str()
            .unwrap()
            .starts_with("[document sha256:")
    );

    // Learned: the next request is replaced before it goes.
    post(&visor, body("mystery-model-7")).await;
    let calls = model_calls(&mock);
    assert_eq!(calls.len(), 3);
    assert_eq!(calls[2]["messages"][0]["content"][1]["type"], "text");
    let m = visor.metrics().await;
    assert_eq!(metric(&m, "visor_capability_learned_total", &[]), Some(1.0));
}

#[tokio::test]
async fn only_a_refusal_of_documents_that_a_retry_proves_teaches_the_model() {
    // Each model refuses the PDF its own way; `flaky-*` fails the retry too.
    let mock = MockUpstream::start(|r| {
        let body = String::from_utf8_lossy(&r.body);
        let model = serde_json::from_slice::<Value>(&r.body).unwrap()["model"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if is_describer_call(r) {
            describer_answer(r)
        } else if model.starts_with("search-") && body.contains("\"type\":\"file\"") {
            Reply::json(400, r#"{"error":{"message":"This model does not support file_search tools.","type":"invalid_request_error"}}"#)
        } else if model.starts_with("flaky-") && !body.contains("\"type\":\"file\"") {
            Reply::json(500, r#"{"error":{"message":"overloaded","type":"server_error"}}"#)
        } else if body.contains("\"type\":\"file\"") {
            Reply::json(400, r#"{"error":{"message":"This model does not support file inputs.","type":"invalid_request_error"}}"#)
        } else {
            chat_ok()
        }
    })
    .await;
    let config = format!("{DESCRIBE}[[model]]\nmatch = \"stated-*\"\npdf = true\n");
    let visor = Visor::for_mock(&mock, &config).await;
    let body = |model: &str| {
        Bytes::from(
            serde_json::to_vec(&json!({"model": model, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "read"}, pdf_part("text.pdf")]},
            ]}))
            .unwrap(),
        )
    };
    let status = |model: &'static str| {
        let visor = &visor;
        async move {
            let (status, _, _) =
                send(post_json(&visor.url("/v1/chat/completions"), body(model))).await;
            status
        }
    };
    let file_sent = |call: &Value| call["messages"][0]["content"][1]["type"] == "file";

    // "file_search" is not "file input": the refusal goes back as it was.
    assert_eq!(status("search-model").await, 400);
    assert_eq!(model_calls(&mock).len(), 1, "no retry");

    // A row that says the model reads PDFs is never overruled.
    assert_eq!(status("stated-pdf-model").await, 400);
    assert_eq!(model_calls(&mock).len(), 2, "no retry");

    // Retried without the PDF, and the retry failed: nothing learned, the
    // next request sends the PDF again.
    assert_eq!(status("flaky-model").await, 500);
    let calls = model_calls(&mock);
    assert_eq!(calls.len(), 4, "refused, retried");
    assert!(file_sent(&calls[2]) && !file_sent(&calls[3]));
    assert_eq!(status("flaky-model").await, 500);
    let calls = model_calls(&mock);
    assert_eq!(calls.len(), 6);
    assert!(file_sent(&calls[4]), "not learned from a retry that failed");

    let m = visor.metrics().await;
    assert_eq!(metric(&m, "visor_capability_learned_total", &[]), Some(0.0));
}

#[tokio::test]
async fn query_aware_descriptions_take_the_question_of_their_own_message() {
    let mock = MockUpstream::start(everything).await;
    let visor = Visor::for_mock(&mock, &format!("{DESCRIBE}query_aware = true\n")).await;
    post(&visor, chat_with(pdf_part("chart.pdf"))).await;
    let asked: Vec<Value> = mock
        .recorded()
        .iter()
        .filter(|r| is_describer_call(r))
        .map(|r| serde_json::from_slice(&r.body).unwrap())
        .collect();
    assert_eq!(asked.len(), 1);
    let prompt = asked[0]["messages"][1]["content"][0]["text"]
        .as_str()
        .unwrap();
    assert!(
        prompt.contains("What does this say about revenue?"),
        "{prompt}"
    );
}

/// A one-page PDF whose page draws `content` with `resources`, on a
/// `size` pt square.
fn one_page_pdf(content: &[u8], resources: &str, size: u32) -> Vec<u8> {
    pdf_build::pdf(1, size, resources, &[pdf_build::stream("", content)])
}

#[tokio::test]
async fn a_pdf_that_would_take_minutes_to_render_costs_its_reader_not_the_request() {
    // 20,000 half-transparent fills over most of a 3000 pt page: a few hundred KB of
    // work for the interpreter, minutes of compositing and gigabytes for
    // the renderer (which no budget inside the process can interrupt). The
    // child reader hits its limits; the text is read again without
    // rendering.
    let mut content =
        b"BT /F1 24 Tf 100 2800 Td (Invoice 4471 total due) Tj ET\n/A gs 0 0 1 rg\n".to_vec();
    for _ in 0..20_000 {
        content.extend_from_slice(b"100 100 2500 2500 re f\n");
    }
    let pdf = one_page_pdf(
        &content,
        "/ExtGState << /A << /ca 0.5 >> >> /Font << /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >>",
        3000,
    );
    let mock = MockUpstream::start(everything).await;
    // One CPU second: the wall-clock limit is 5 s more, so the child
    // reaches its own limit first even on cores shared with other work.
    let visor = Visor::for_mock(
        &mock,
        &format!("{DESCRIBE}[documents]\nreader_cpu_secs = 1\n"),
    )
    .await;
    let part = json!({"type": "file", "file": {"file_data": format!("data:application/pdf;base64,{}", b64(&pdf)), "filename": "fills.pdf"}});
    post(&visor, chat_with(part)).await;
    let text = replaced_text(&model_calls(&mock)[0]);
    assert!(
        text.contains("Invoice 4471 total due"),
        "the text is read: {text}"
    );
    // (Gigabytes of compositing buffers, or minutes: whichever limit of
    // the child comes first.)
    let not_rendered = "[page 1: figures, not described: could not be rendered: over the";
    assert!(
        text.contains(&format!("{not_rendered} time budget]"))
            || text.contains(&format!("{not_rendered} memory budget]")),
        "{text}"
    );
    assert!(
        mock.recorded().iter().all(|r| !is_describer_call(r)),
        "nothing rendered, nothing described"
    );
}

#[tokio::test]
async fn a_text_page_with_a_picture_is_described_and_one_with_a_bullet_icon_is_not() {
    // A line of text and a 16x16 px image: drawn at 400x300 pt (a
    // picture, 19% of the page) or at 5x5 pt (a bullet).
    let page = |cm: &str| {
        let content =
            format!("BT /F1 12 Tf 50 750 Td (Invoice 4471 total due) Tj ET\nq {cm} cm /Im1 Do Q");
        pdf_build::pdf(
            1,
            800,
            "/Font << /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >> /XObject << /Im1 4 0 R >>",
            &[
                pdf_build::stream("", content.as_bytes()),
                pdf_build::stream(
                    "/Type /XObject /Subtype /Image /Width 16 /Height 16 /ColorSpace /DeviceGray /BitsPerComponent 8",
                    &[0x80; 256],
                ),
            ],
        )
    };
    let part = |pdf: &[u8], name: &str| json!({"type": "file", "file": {"file_data": format!("data:application/pdf;base64,{}", b64(pdf)), "filename": name}});
    let describer_calls = |mock: &MockUpstream| {
        mock.recorded()
            .iter()
            .filter(|r| is_describer_call(r))
            .count()
    };
    let mock = MockUpstream::start(everything).await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;

    post(
        &visor,
        chat_with(part(&page("400 0 0 300 100 100"), "picture.pdf")),
    )
    .await;
    assert_eq!(describer_calls(&mock), 1, "the page with the picture");
    let text = replaced_text(&model_calls(&mock)[0]);
    assert!(text.contains("Invoice 4471 total due"), "{text}");
    assert!(
        text.contains("[page 1 described: A test image (image/png"),
        "{text}"
    );

    post(
        &visor,
        chat_with(part(&page("5 0 0 5 40 700"), "bullet.pdf")),
    )
    .await;
    assert_eq!(describer_calls(&mock), 1, "a bullet is not a figure");
    let text = replaced_text(&model_calls(&mock)[1]);
    assert!(text.contains("Invoice 4471 total due"), "{text}");
    assert!(!text.contains("described"), "{text}");
}
