//! Documents and audio in every API shape: found where they sit, replaced
//! in place for a model that cannot take them (by the text the caller
//! made, or a one-line reference), kept for one that can; a later copy a
//! reference; the text visor wrote never touched by dedup.

use std::sync::Arc;

use serde_json::{Value, json};

use super::support::*;
use crate::transform::*;

const PDF: &[u8] =
    b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\ntrailer << /Root 1 0 R >>\n%%EOF\n";
const WAV: &[u8] = b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00\x40\x1f\x00\x00\x80\x3e\x00\x00\x02\x00\x10\x00data\x00\x00\x00\x00";

fn b64(bytes: &[u8]) -> String {
    base64_simd::STANDARD.encode_to_string(bytes)
}

fn no_documents(shape: Shape) -> Plan {
    Plan {
        takes: Takes {
            pdf: false,
            office: false,
            audio: false,
        },
        ..plan(shape, true, DEFAULTS)
    }
}

/// Rewrites `body` giving each document or audio job the text `made(job)`.
fn convert(
    body: &Value,
    plan: &Plan,
    made: impl Fn(&MediaJob) -> String,
) -> (Value, Report, Vec<MediaJob>) {
    let bytes = serde_json::to_vec(body).unwrap();
    let scanned = match scan(&bytes, plan) {
        Ok(s) => s,
        Err(done) => return (body.clone(), done.report, Vec::new()),
    };
    let jobs = scanned.media(&bytes);
    let texts: Vec<(String, Arc<str>)> = jobs
        .iter()
        .map(|j| (j.sha256.clone(), Arc::from(made(j))))
        .collect();
    let r = scanned.finish(&bytes, &texts);
    let sent = r.body.as_deref().unwrap_or(&bytes);
    (serde_json::from_slice(sent).unwrap(), r.report, jobs)
}

fn text_of(job: &MediaJob) -> String {
    format!(
        "[document sha256:{}, {}, 1 page]\n--- page 1 ---\nQuarterly revenue grew by twelve percent.\nThe second line of the page.",
        &job.sha256[..12],
        job.media_type
    )
}

#[test]
fn a_chat_file_part_becomes_its_text_in_place() {
    let body = json!({"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "What does the report say?"},
            {"type": "file", "file": {"file_data": format!("data:application/pdf;base64,{}", b64(PDF)), "filename": "report.pdf"}},
        ]},
    ]});
    let (out, report, jobs) = convert(&body, &no_documents(Shape::Chat), text_of);
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].media_type, "application/pdf");
    assert_eq!(&jobs[0].bytes[..], PDF);
    assert!(
        matches!(&jobs[0].medium, Medium::Document { family: DocFamily::Pdf, name: Some(n) } if n == "report.pdf")
    );
    let parts = out["messages"][1]["content"].as_array().unwrap();
    assert_eq!(parts.len(), 2, "no part added or removed");
    assert_eq!(parts[0]["text"], "What does the report say?");
    assert_eq!(parts[1]["type"], "text");
    assert!(
        parts[1]["text"]
            .as_str()
            .unwrap()
            .contains("twelve percent")
    );
    assert_eq!(report.media_replaced, 1);
    assert_eq!(report.images_replaced, 0);
    assert_eq!(report.images[0].medium, "document");
    assert_eq!(report.images[0].action, "converted");

    // A model that reads PDFs gets the bytes it was sent.
    let bytes = serde_json::to_vec(&body).unwrap();
    let can = Plan {
        rules: Rules::NONE,
        ..plan(Shape::Chat, true, DEFAULTS)
    };
    assert!(rewrite(&bytes, &can).body.is_none());
}

#[test]
fn responses_input_files_by_data_url_and_id_are_replaced() {
    let body = json!({"model": "m", "input": [
        {"role": "user", "content": [
            {"type": "input_text", "text": "Compare them."},
            {"type": "input_file", "filename": "a.pdf", "file_data": format!("data:application/pdf;base64,{}", b64(PDF))},
            {"type": "input_file", "file_id": "file-abc123"},
            {"type": "input_file", "file_url": "https://example.com/b.pdf"},
        ]},
    ]});
    let (out, report, jobs) = convert(&body, &no_documents(Shape::Responses), text_of);
    assert_eq!(
        jobs.len(),
        1,
        "only inline bytes are read; ids and URLs are never fetched"
    );
    let parts = out["input"][0]["content"].as_array().unwrap();
    assert!(parts[1..].iter().all(|p| p["type"] == "input_text"));
    assert!(
        parts[1]["text"]
            .as_str()
            .unwrap()
            .starts_with("[document sha256:")
    );
    let by_id = parts[2]["text"].as_str().unwrap();
    assert!(
        by_id.starts_with("[document file file-abc123 (sha256:")
            && by_id.contains("cannot read documents"),
        "{by_id}"
    );
    let by_url = parts[3]["text"].as_str().unwrap();
    assert!(by_url.contains("https://example.com/b.pdf"), "{by_url}");
    assert_eq!(report.media_replaced, 3);
}

#[test]
fn anthropic_documents_base64_and_text_sources() {
    let body = json!({"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": [
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": b64(PDF)}, "title": "Q3", "cache_control": {"type": "ephemeral"}},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "plain words"}},
            {"type": "text", "text": "Summarise."},
        ]},
    ]});
    let (out, _, jobs) = convert(&body, &no_documents(Shape::Messages), |j| {
        format!(
            "[document sha256:{}, {}]\n{}",
            &j.sha256[..12],
            j.media_type,
            String::from_utf8_lossy(&j.bytes)
        )
    });
    assert_eq!(jobs.len(), 2);
    assert_eq!(jobs[1].media_type, "text/plain");
    assert_eq!(&jobs[1].bytes[..], b"plain words");
    let parts = out["messages"][0]["content"].as_array().unwrap();
    assert_eq!(parts.len(), 3);
    assert_eq!(parts[0]["type"], "text");
    assert_eq!(
        parts[0]["cache_control"],
        json!({"type": "ephemeral"}),
        "the marker moves to the text"
    );
    assert!(parts[1]["text"].as_str().unwrap().ends_with("plain words"));
}

#[test]
fn chat_input_audio_and_mcp_audio_in_a_tool_result_are_transcribed_in_place() {
    let body = json!({"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "record", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "audio", "data": b64(WAV), "mimeType": "audio/wav"},
            ]},
        ]},
    ]});
    let heard = |j: &MediaJob| {
        format!(
            "[audio sha256:{}, {}, transcript: hello there]",
            &j.sha256[..12],
            j.media_type
        )
    };
    let (out, report, jobs) = convert(&body, &no_documents(Shape::Messages), heard);
    assert_eq!(jobs.len(), 1);
    assert!(matches!(jobs[0].medium, Medium::Audio { .. }));
    assert_eq!(jobs[0].media_type, "audio/wav");
    let result = &out["messages"][2]["content"][0];
    assert_eq!(result["tool_use_id"], "toolu_1", "pairing intact");
    assert_eq!(result["content"][0]["type"], "text");
    assert!(
        result["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("transcript: hello there")
    );
    assert_eq!(report.media_replaced, 1);

    let chat = json!({"model": "m", "messages": [
        {"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": b64(WAV), "format": "wav"}},
        ]},
    ]});
    let (out, _, jobs) = convert(&chat, &no_documents(Shape::Chat), heard);
    assert!(matches!(&jobs[0].medium, Medium::Audio { format: Some(f) } if f == "wav"));
    assert_eq!(jobs[0].media_type, "audio/wav", "sniffed from the bytes");
    assert_eq!(out["messages"][0]["content"][0]["type"], "text");
}

#[test]
fn office_files_go_for_a_model_that_reads_pdfs_but_not_office() {
    let docx = b"PK\x03\x04 word/document.xml";
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": [
            {"type": "file", "file": {"file_data": format!("data:application/pdf;base64,{}", b64(PDF)), "filename": "a.pdf"}},
            {"type": "file", "file": {"file_data": format!("data:application/vnd.openxmlformats-officedocument.wordprocessingml.document;base64,{}", b64(docx)), "filename": "b.docx"}},
        ]},
    ]});
    let plan = Plan {
        takes: Takes {
            pdf: true,
            office: false,
            audio: true,
        },
        ..plan(Shape::Chat, true, DEFAULTS)
    };
    let (out, _, jobs) = convert(&body, &plan, text_of);
    assert_eq!(jobs.len(), 1);
    assert!(matches!(
        jobs[0].medium,
        Medium::Document {
            family: DocFamily::Office,
            ..
        }
    ));
    let parts = out["messages"][0]["content"].as_array().unwrap();
    assert_eq!(parts[0]["type"], "file", "the PDF passes");
    assert_eq!(parts[1]["type"], "text");
}

#[test]
fn a_later_copy_of_a_document_is_a_reference_and_the_first_never_changes() {
    let part = json!({"type": "file", "file": {"file_data": format!("data:application/pdf;base64,{}", b64(PDF)), "filename": "a.pdf"}});
    let turn1 = json!({"model": "m", "messages": [
        {"role": "user", "content": [part.clone(), {"type": "text", "text": "read this"}]},
    ]});
    let mut turn2 = turn1.clone();
    turn2["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "Done."}),
        json!({"role": "user", "content": [part, {"type": "text", "text": "and again"}]}),
    ]);
    let p = no_documents(Shape::Chat);
    let (one, _, _) = convert(&turn1, &p, text_of);
    let (two, report, jobs) = convert(&turn2, &p, text_of);
    assert_eq!(jobs.len(), 1, "one distinct document");
    assert_eq!(one["messages"][0], two["messages"][0], "prefix stable");
    let again = two["messages"][2]["content"][0]["text"].as_str().unwrap();
    assert!(again.contains("the same document as earlier"), "{again}");
    assert!(
        report
            .images
            .iter()
            .any(|n| n.action == "deduped" && n.medium == "document")
    );
}

#[test]
fn dedup_never_touches_the_text_of_a_document_and_a_second_pass_changes_nothing() {
    // Two different documents whose texts share a long run of lines.
    let lines: Vec<String> = (0..12)
        .map(|i| format!("Paragraph {i} of the shared terms and conditions, long enough."))
        .collect();
    let shared = lines.join("\n");
    let doc = |tag: &[u8]| {
        let mut b = PDF.to_vec();
        b.extend_from_slice(tag);
        json!({"type": "file", "file": {"file_data": format!("data:application/pdf;base64,{}", b64(&b)), "filename": "t.pdf"}})
    };
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": [doc(b"one"), {"type": "text", "text": "first"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [doc(b"two"), {"type": "text", "text": "second"}]},
    ]});
    let p = no_documents(Shape::Chat);
    let made = |j: &MediaJob| {
        format!(
            "[document sha256:{}, application/pdf, 1 page]\n--- page 1 ---\n{shared}",
            &j.sha256[..12]
        )
    };
    let (out, report, _) = convert(&body, &p, made);
    assert_eq!(report.lines_omitted, 0);
    let second = out["messages"][2]["content"][0]["text"].as_str().unwrap();
    assert!(second.contains(&lines[11]), "the document's text is whole");
    let (again, report2) = run(&out, &p);
    assert_eq!(again, out, "idempotent");
    assert_eq!(report2.lines_omitted, 0);
}

/// A document's text is lines of its message as it is sent: a note after
/// it names the lines where they are, on the first pass as on a second.
#[test]
fn a_note_after_a_document_names_the_lines_as_sent() {
    let block: String = (0..6)
        .map(|i| format!("step {i}: run the migration and check the output carefully\n"))
        .collect();
    let block = block.trim_end();
    let mut pdf = PDF.to_vec();
    pdf.extend_from_slice(b"notes");
    let doc = json!({"type": "file", "file": {"file_data": format!("data:application/pdf;base64,{}", b64(&pdf)), "filename": "n.pdf"}});
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "read my notes"},
        {"role": "assistant", "content": "send them"},
        {"role": "user", "content": [doc, {"type": "text", "text": format!("intro\n{block}\nmid")}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": format!("again\n{block}")},
    ]});
    let p = no_documents(Shape::Chat);
    let made = |j: &MediaJob| {
        format!(
            "[document sha256:{}, application/pdf, 1 page]\n--- page 1 ---\nMeeting notes",
            &j.sha256[..12]
        )
    };
    let (out, report, _) = convert(&body, &p, made);
    assert_eq!(report.lines_omitted, 6);
    let parts = out["messages"][2]["content"].as_array().unwrap();
    let sent: Vec<&str> = parts
        .iter()
        .filter_map(|p| p["text"].as_str())
        .flat_map(|t| t.split('\n'))
        .collect();
    // 3 lines of the document's text, `intro`, then the block.
    assert_eq!(
        out["messages"][4]["content"],
        "again\n[omitted: message 3 lines 5-10]"
    );
    assert_eq!(sent[4..10].join("\n"), block);
    let (again, report2) = run(&out, &p);
    assert_eq!(again, out, "a second pass numbers them the same");
    assert_eq!(report2.lines_omitted, 0);
}

#[test]
fn query_aware_subjects_carry_their_own_message_text_only() {
    let png = fixture("chart.png");
    let image = json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&png))}});
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is the peak value?"}, image.clone()]},
        {"role": "assistant", "content": "It is 42."},
        {"role": "user", "content": [{"type": "text", "text": "And the colour of the bars?"}, image]},
    ]});
    let bytes = serde_json::to_vec(&body).unwrap();
    // (With `images.dedupe` the second copy is a reference instead.)
    let rules = Rules {
        dedupe: false,
        ..DEFAULTS
    };
    let p = Plan {
        describe: true,
        query_aware: true,
        ..plan(Shape::Chat, false, rules)
    };
    let scanned = scan(&bytes, &p).unwrap();
    let subjects = scanned.subjects(&bytes);
    let queries: Vec<_> = subjects.iter().map(|(_, s)| s.query.clone()).collect();
    // The same image under two questions: two descriptions, each shaped by
    // the message that carries it.
    assert_eq!(
        queries,
        [
            Some("What is the peak value?".to_owned()),
            Some("And the colour of the bars?".to_owned())
        ]
    );
    let texts: Vec<(String, Arc<str>)> = subjects
        .iter()
        .map(|(_, s)| {
            (
                subject_key(&s.sha256, s.query.as_deref()),
                Arc::from(format!("about {}", s.query.as_deref().unwrap_or(""))),
            )
        })
        .collect();
    let out = scanned.finish(&bytes, &texts);
    let v: Value = serde_json::from_slice(out.body.as_deref().unwrap()).unwrap();
    assert!(
        v["messages"][0]["content"][1]["text"]
            .as_str()
            .unwrap()
            .contains("about What is the peak value?")
    );
    assert!(
        v["messages"][2]["content"][1]["text"]
            .as_str()
            .unwrap()
            .contains("about And the colour")
    );
    // The first turn, sent alone before: its message reads the same in
    // the later request (the later question never reshapes it), and the
    // two keys differ.
    let turn1 = json!({"model": "m", "messages": [body["messages"][0].clone()]});
    let bytes1 = serde_json::to_vec(&turn1).unwrap();
    let scanned1 = scan(&bytes1, &p).unwrap();
    let subjects1 = scanned1.subjects(&bytes1);
    assert_eq!(subjects1.len(), 1);
    let texts1: Vec<(String, Arc<str>)> = subjects1
        .iter()
        .map(|(_, s)| {
            let key = subject_key(&s.sha256, s.query.as_deref());
            let text = texts.iter().find(|(k, _)| *k == key).unwrap().1.clone();
            (key, text)
        })
        .collect();
    let keys: Vec<&String> = texts.iter().map(|(k, _)| k).collect();
    assert_ne!(keys[0], keys[1], "one key per question");
    let out1 = scanned1.finish(&bytes1, &texts1);
    let v1: Value = serde_json::from_slice(out1.body.as_deref().unwrap()).unwrap();
    assert_eq!(v1["messages"][0], v["messages"][0], "prefix stable");

    // Without query_aware: one subject, no query.
    let plain = Plan {
        query_aware: false,
        ..p
    };
    let subjects = scan(&bytes, &plain).unwrap().subjects(&bytes);
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].1.query, None);
}

#[test]
fn bare_base64_file_data_is_read_as_the_file_itself() {
    let body = json!({"model": "m", "input": [
        {"role": "user", "content": [
            {"type": "input_file", "filename": "a.pdf", "file_data": b64(PDF)},
        ]},
    ]});
    let (out, _, jobs) = convert(&body, &no_documents(Shape::Responses), text_of);
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].media_type, "application/pdf", "sniffed");
    assert_eq!(&jobs[0].bytes[..], PDF);
    assert!(
        out["input"][0]["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("twelve percent")
    );
}

#[test]
fn a_pdf_in_an_mcp_resource_is_known_by_its_bytes() {
    let body = json!({"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "resource", "resource": {"uri": "file:///x/report", "mimeType": "application/octet-stream", "blob": b64(PDF)}},
        ]}]},
    ]});
    let (_, _, jobs) = convert(&body, &no_documents(Shape::Messages), text_of);
    assert_eq!(jobs.len(), 1);
    assert!(matches!(
        jobs[0].medium,
        Medium::Document {
            family: DocFamily::Pdf,
            ..
        }
    ));
}

#[test]
fn a_declared_media_type_is_trusted_only_when_it_is_one() {
    // A client's mimeType goes into placeholders and the transcriber's
    // form headers: line breaks, quotes and parameters never do.
    let body = json!({"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": [
            {"type": "audio", "data": b64(WAV), "mimeType": "audio/wav\r\nX-Evil: 1"},
            {"type": "audio", "data": b64(b"\xff\xfb\x90\x00more mp3 frames"), "mimeType": "Audio/MPEG; rate=44100"},
        ]},
    ]});
    let heard = |j: &MediaJob| format!("[audio {}]", j.media_type);
    let (out, _, jobs) = convert(&body, &no_documents(Shape::Messages), heard);
    assert_eq!(jobs.len(), 2);
    assert_eq!(jobs[0].media_type, "audio/wav", "sniffed, not the header");
    assert_eq!(jobs[1].media_type, "audio/mpeg", "parameters dropped");
    let text = out.to_string();
    assert!(!text.contains("X-Evil"), "{text}");

    // Chat `input_audio` of bytes that say nothing: the format names it.
    let chat = json!({"model": "m", "messages": [
        {"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": b64(b"not sniffable audio"), "format": "m4a"}},
            {"type": "input_audio", "input_audio": {"data": b64(b"other unknown audio"), "format": "x\"y"}},
        ]},
    ]});
    let (_, _, jobs) = convert(&chat, &no_documents(Shape::Chat), heard);
    assert_eq!(jobs[0].media_type, "audio/m4a");
    assert_eq!(jobs[1].media_type, "application/octet-stream");
}

#[test]
fn a_copy_under_another_file_name_is_the_same_document() {
    let part = |name: &str| json!({"type": "file", "file": {"file_data": format!("data:application/pdf;base64,{}", b64(PDF)), "filename": name}});
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": [part("report.pdf"), {"type": "text", "text": "read this"}]},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": [part("report (1).pdf"), {"type": "text", "text": "and this"}]},
    ]});
    let (out, report, jobs) = convert(&body, &no_documents(Shape::Chat), text_of);
    assert_eq!(jobs.len(), 1);
    let again = out["messages"][2]["content"][0]["text"].as_str().unwrap();
    assert!(again.contains("the same document as earlier"), "{again}");
    assert_eq!(
        report
            .images
            .iter()
            .filter(|n| n.action == "deduped")
            .count(),
        1
    );
}

#[test]
fn file_parts_by_url_without_data_or_holding_a_picture() {
    const PNG: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x01\0\0\0\x01\x08\x02\0\0\0\x90wS\xde";
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "Look at these."},
            // LangChain: a file by URL.
            {"type": "file", "mime_type": "application/pdf", "url": "https://example.com/lc.pdf"},
            // Vercel AI SDK: a URL where the data goes.
            {"type": "file", "data": "https://example.com/vercel.pdf", "mediaType": "application/pdf"},
            // Chat: a file part with nothing to read.
            {"type": "file", "file": {"filename": "empty.pdf"}},
            // Chat: a file part that is a picture.
            {"type": "file", "file": {"file_data": format!("data:image/png;base64,{}", b64(PNG)), "filename": "shot.png"}},
            {"type": "file", "file": {"file_data": b64(PNG)}},
        ]},
    ]});
    let plan = Plan {
        vision: false,
        ..no_documents(Shape::Chat)
    };
    let (out, report, jobs) = convert(&body, &plan, text_of);
    assert!(jobs.is_empty(), "URLs are never fetched: {jobs:?}");
    let parts = out["messages"][0]["content"].as_array().unwrap();
    assert!(parts.iter().all(|p| p["type"] == "text"), "{parts:?}");
    let text = |i: usize| parts[i]["text"].as_str().unwrap().to_owned();
    assert!(
        text(1).contains("https://example.com/lc.pdf"),
        "{}",
        text(1)
    );
    assert!(
        text(2).contains("https://example.com/vercel.pdf"),
        "{}",
        text(2)
    );
    assert!(!text(2).contains("base64"), "{}", text(2));
    assert!(
        text(3).contains("without file_data or file_id"),
        "{}",
        text(3)
    );
    let media: Vec<&str> = report.images.iter().map(|n| n.medium).collect();
    assert_eq!(
        media,
        ["document", "document", "document", "image", "image"],
        "{report:?}"
    );
}

#[test]
fn office_files_known_by_name_type_or_first_zip_entry() {
    fn zip_head(first_entry: &str) -> Vec<u8> {
        // A local file header (30 bytes) and the entry's name.
        let mut z = vec![0u8; 30];
        z[..4].copy_from_slice(b"PK\x03\x04");
        z[26..28].copy_from_slice(&(first_entry.len() as u16).to_le_bytes());
        z.extend_from_slice(first_entry.as_bytes());
        z.extend_from_slice(&[0; 40]);
        z
    }
    let head = |entry: &str| b64(&zip_head(entry));
    // Two stored entries: `first` (empty), then `second`.
    let two = |first: &str, second: &str| {
        let mut z = zip_head(first);
        z.truncate(30 + first.len());
        z.extend_from_slice(&zip_head(second));
        b64(&z)
    };
    let of = |mt: &str, name: Option<&str>, data: &str| DocFamily::of(mt, name, data.as_bytes());
    assert_eq!(
        of("", None, &head("[Content_Types].xml")),
        DocFamily::Office
    );
    assert_eq!(of("", None, &head("word/document.xml")), DocFamily::Office);
    assert_eq!(
        of("", None, &head("src/main.rs")),
        DocFamily::Other,
        "a zip of code"
    );
    assert_eq!(of("", None, &head("x")), DocFamily::Other);
    assert_eq!(
        of("", None, &two("mimetype", "content.xml")),
        DocFamily::Other,
        "OpenDocument"
    );
    assert_eq!(
        of("", None, &two("mimetype", "word/document.xml")),
        DocFamily::Office
    );
    // Base64 as JSON may carry it: `\/` escapes, line breaks.
    let wrapped: String = b64(PDF)
        .as_bytes()
        .chunks(4)
        .map(|c| format!("{}\\n", std::str::from_utf8(c).unwrap()))
        .collect();
    assert_eq!(of("", None, &wrapped), DocFamily::Pdf);
    assert_eq!(of("", None, &b64(PDF)), DocFamily::Pdf);
    assert_eq!(of("", Some("show.PPSX"), ""), DocFamily::Office);
    assert_eq!(of("", Some("letter.dotx"), ""), DocFamily::Office);
    assert_eq!(
        of("application/vnd.ms-excel.sheet.macroEnabled.12", None, ""),
        DocFamily::Office
    );
}

#[test]
fn a_jpeg_in_a_file_part_is_an_image_even_with_escaped_slashes() {
    let jpeg = b"\xff\xd8\xff\xe0\0\x10JFIF\0\x01\x01\0\0\x01\0\x01\0\0\xff\xd9";
    let data = b64(jpeg).replace('/', "\\/");
    assert!(data.starts_with("\\/9j\\/"), "{data}");
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"file","file":{{"file_data":"{data}"}}}}]}}]}}"#
    );
    let plan = Plan {
        vision: false,
        ..no_documents(Shape::Chat)
    };
    let scanned = scan(body.as_bytes(), &plan).unwrap();
    let r = scanned.finish(body.as_bytes(), &[]);
    assert_eq!(r.report.images.len(), 1);
    assert_eq!(r.report.images[0].medium, "image", "{:?}", r.report);
}

#[test]
fn a_vision_model_gets_a_picture_in_a_file_part_byte_for_byte() {
    const PNG: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x01\0\0\0\x01\x08\x02\0\0\0\x90wS\xde";
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "file", "file": {"file_data": format!("data:image/png;base64,{}", b64(PNG)), "filename": "shot.png"}},
        ]},
    ]});
    let bytes = serde_json::to_vec(&body).unwrap();
    let plan = plan(Shape::Chat, true, DEFAULTS);
    let r = match scan(&bytes, &plan) {
        Ok(s) => s.finish(&bytes, &[]),
        Err(done) => *done,
    };
    assert!(r.body.is_none(), "forwarded as it came");
    assert_eq!(r.report.images_found, 1);
    assert_eq!(r.report.images_replaced, 0);
}
