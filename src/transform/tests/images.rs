//! Fixture and property tests of the image transform.

use proptest::prelude::*;
use serde_json::{Value, json};

use crate::transform::decode::sha256_hex;
use crate::transform::*;

fn fixture(name: &str) -> Vec<u8> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/");
    std::fs::read(format!("{path}{name}")).unwrap()
}

fn strip(body: &[u8], shape: Shape) -> Rewrite {
    rewrite(body, &Plan::images_only(shape, false, false))
}

fn parse(b: &[u8]) -> Value {
    serde_json::from_slice(b).unwrap()
}

/// No image part and no base64 data URL left anywhere in the value.
fn assert_no_images(v: &Value) {
    match v {
        Value::Object(m) => {
            if let Some(Value::String(t)) = m.get("type") {
                assert!(
                    !matches!(t.as_str(), "image_url" | "input_image" | "image"),
                    "image part left: {v}"
                );
            }
            m.values().for_each(assert_no_images);
        }
        Value::Array(a) => a.iter().for_each(assert_no_images),
        Value::String(s) => {
            assert!(!s.contains(";base64,"), "data URL left in {s:.80}");
            if let Ok(inner) = serde_json::from_str::<Value>(s)
                && (inner.is_object() || inner.is_array())
            {
                assert_no_images(&inner);
            }
        }
        _ => {}
    }
}

/// Roles, ids and the number of messages / content parts.
fn skeleton(v: &Value, key: &str) -> Vec<(Value, Value, Value, usize)> {
    v[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let parts = match &m["content"] {
                Value::Array(a) => a.len(),
                _ => 1,
            };
            (
                m["role"].clone(),
                m["tool_call_id"].clone(),
                m["call_id"].clone(),
                parts,
            )
        })
        .collect()
}

#[test]
fn chat_images_for_a_text_only_model() {
    let body = fixture("chat-image-nonvision.json");
    let out = strip(&body, Shape::Chat);
    let new = parse(out.body.as_deref().unwrap());
    assert_no_images(&new);
    assert_eq!(
        skeleton(&new, "messages"),
        skeleton(&parse(&body), "messages")
    );
    let chart_sha = sha256_hex(&fixture("chart.png"));
    let parts = new["messages"][1]["content"].as_array().unwrap();
    assert_eq!(parts.len(), 3);
    let t1 = parts[1]["text"].as_str().unwrap();
    assert_eq!(parts[1]["type"], "text");
    assert!(t1.contains(&format!("sha256:{}", &chart_sha[..12])), "{t1}");
    assert!(t1.contains("image/png"), "{t1}");
    let t2 = parts[2]["text"].as_str().unwrap();
    assert!(t2.contains("https://upload.wikimedia.org/wikipedia/commons/4/47/PNG_transparency_demonstration_1.png"), "{t2}");
    let url_sha = sha256_hex(
        b"https://upload.wikimedia.org/wikipedia/commons/4/47/PNG_transparency_demonstration_1.png",
    );
    assert!(t2.contains(&format!("sha256:{}", &url_sha[..12])));
    // The text part and the system message are untouched, byte for byte.
    assert_eq!(parts[0], parse(&body)["messages"][1]["content"][0]);
    assert_eq!(out.report.images_replaced, 2);
    assert!(out.report.bytes_saved > 0);
    assert_eq!(out.artifacts.len(), 1);
    assert_eq!(out.artifacts[0].sha256, chart_sha);
    assert_eq!(out.artifacts[0].bytes, fixture("chart.png"));
}

#[test]
fn tool_results_keep_their_pairing_and_become_strings() {
    let body = fixture("chat-tool-mcp-image.json");
    let out = strip(&body, Shape::Chat);
    let new = parse(out.body.as_deref().unwrap());
    assert_no_images(&new);
    let old = parse(&body);
    let msgs = new["messages"].as_array().unwrap();
    assert_eq!(msgs.len(), old["messages"].as_array().unwrap().len());
    for (m, o) in msgs.iter().zip(old["messages"].as_array().unwrap()) {
        assert_eq!(m["role"], o["role"]);
        assert_eq!(m["tool_call_id"], o["tool_call_id"]);
        assert_eq!(m["tool_calls"], o["tool_calls"]);
    }
    // Both tool messages: one string, the text first, then the placeholder.
    for i in [2, 4] {
        let c = msgs[i]["content"].as_str().unwrap();
        let first = old["messages"][i]["content"][0]["text"].as_str().unwrap();
        assert!(c.starts_with(first), "{c}");
        assert!(c.contains("sha256:"), "{c}");
    }
    assert_eq!(out.report.images_replaced, 2);
    assert!(out.report.images.iter().all(|n| n.in_tool_result));
}

#[test]
fn responses_input_image_becomes_input_text() {
    let body = fixture("responses-input-image.json");
    let out = strip(&body, Shape::Responses);
    let new = parse(out.body.as_deref().unwrap());
    assert_no_images(&new);
    let parts = new["input"][0]["content"].as_array().unwrap();
    assert_eq!(parts.len(), 2);
    assert_eq!(parts[1]["type"], "input_text");
    assert!(
        parts[1]["text"]
            .as_str()
            .unwrap()
            .starts_with("[image sha256:")
    );
}

#[test]
fn anthropic_image_blocks_also_inside_tool_results() {
    let body = fixture("anthropic-messages-image.json");
    let out = strip(&body, Shape::Messages);
    let new = parse(out.body.as_deref().unwrap());
    assert_no_images(&new);
    assert_eq!(new["messages"][0]["content"][0]["type"], "text");
    let tr = &new["messages"][2]["content"][0];
    assert_eq!(tr["type"], "tool_result");
    assert_eq!(tr["tool_use_id"], "toolu_01");
    assert_eq!(tr["content"].as_array().unwrap().len(), 2);
    assert_eq!(tr["content"][1]["type"], "text");
    assert_eq!(out.report.images_replaced, 2);
    assert_eq!(
        out.report
            .images
            .iter()
            .map(|n| n.in_tool_result)
            .collect::<Vec<_>>(),
        [false, true]
    );
    assert_eq!(new["max_tokens"], 512);
}

#[test]
fn responses_function_output_with_images() {
    let png = fixture("chart.png");
    let b64 = base64_simd::STANDARD.encode_to_string(&png);
    let body = json!({"model": "m", "input": [
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "here"},
            {"type": "input_image", "image_url": format!("data:image/png;base64,{b64}")}
        ]},
        {"type": "function_call_output", "call_id": "c2", "output": format!("see data:image/png;base64,{b64} ok")}
    ]});
    let body = serde_json::to_vec(&body).unwrap();
    let out = strip(&body, Shape::Responses);
    let new = parse(out.body.as_deref().unwrap());
    assert_no_images(&new);
    assert_eq!(new["input"][1]["output"][1]["type"], "input_text");
    let s = new["input"][2]["output"].as_str().unwrap();
    let sha = sha256_hex(&png);
    assert_eq!(
        s,
        format!(
            "see [image sha256:{}, image/png 320x200: not shown, this model cannot see images] ok",
            &sha[..12]
        )
    );
    assert_eq!(new["input"][2]["call_id"], "c2");
    assert_eq!(out.artifacts.len(), 1, "one distinct image, saved once");
}

#[test]
fn base64_hidden_in_tool_text_is_found() {
    let png = fixture("chart.png");
    let b64 = base64_simd::STANDARD.encode_to_string(&png);
    let mcp = json!({"content": [
        {"type": "text", "text": "captured"},
        {"type": "image", "data": b64, "mimeType": "image/png"}
    ], "isError": false, "extra": {"kept": [1, 2]}});
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "shot please"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "s", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": mcp.to_string()},
        {"role": "tool", "tool_call_id": "t2", "content": [{"type": "text", "text": format!("![x](data:image/png;base64,{b64})")}]},
        {"role": "system", "content": format!("system data:image/png;base64,{b64}")}
    ]});
    let body = serde_json::to_vec(&body).unwrap();
    let out = strip(&body, Shape::Chat);
    let new = parse(out.body.as_deref().unwrap());
    let inner: Value =
        serde_json::from_str(new["messages"][2]["content"].as_str().unwrap()).unwrap();
    assert_eq!(
        inner["content"][0],
        json!({"type": "text", "text": "captured"})
    );
    assert_eq!(inner["content"][1]["type"], "text");
    assert!(
        inner["content"][1]["text"]
            .as_str()
            .unwrap()
            .contains("image/png")
    );
    assert_eq!(inner["extra"], json!({"kept": [1, 2]}));
    let t = new["messages"][3]["content"][0]["text"].as_str().unwrap();
    let sha = sha256_hex(&png);
    let placeholder = format!(
        "[image sha256:{}, image/png 320x200: not shown, this model cannot see images]",
        &sha[..12]
    );
    assert_eq!(t, format!("![x]({placeholder})"));
    // System text is never looked into.
    assert!(
        new["messages"][4]["content"]
            .as_str()
            .unwrap()
            .contains(";base64,")
    );
    assert_eq!(out.report.images_replaced, 2);
}

#[test]
fn a_data_url_spelt_with_unicode_escapes_in_a_text_is_still_found() {
    let png = fixture("chart.png");
    let b64 = base64_simd::STANDARD.encode_to_string(&png);
    // `image` written `\u0069mage`: the text is decoded before it is read.
    let text = format!("see data:image/png;base64,{b64} here");
    let literal = serde_json::to_string(&text)
        .unwrap()
        .replace("image", "\\u0069mage");
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"look"}},{{"role":"assistant","content":null,"tool_calls":[{{"id":"t","type":"function","function":{{"name":"s","arguments":"{{}}"}}}}]}},{{"role":"tool","tool_call_id":"t","content":{literal}}}]}}"#
    );
    assert!(!body.contains("image"), "the test must hide the word");
    let out = strip(body.as_bytes(), Shape::Chat);
    assert_eq!(out.report.images_replaced, 1);
    assert!(!String::from_utf8_lossy(out.body.as_deref().unwrap()).contains(&b64[..64]));
}

#[test]
fn images_in_json_strings_inside_tool_text_and_bare_part_content_are_found() {
    let png = fixture("chart.png");
    let b64 = base64_simd::STANDARD.encode_to_string(&png);
    let mcp = json!({"content": [
        {"type": "text", "text": "a \"quoted\" caption é"},
        {"type": "image", "data": b64, "mimeType": "image/png"}
    ]});
    // A text part whose text is the stringified MCP output.
    let in_text = json!({"content": [{"type": "text", "text": mcp.to_string()}]}).to_string();
    // json.dumps({"result": json.dumps(mcp)}), and once more around that.
    let twice = json!({"result": mcp.to_string(), "n": 1}).to_string();
    let thrice = json!({"outer": twice.clone()}).to_string();
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "shot please"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "s", "arguments": "{}"}},
            {"id": "t2", "type": "function", "function": {"name": "s", "arguments": "{}"}},
            {"id": "t3", "type": "function", "function": {"name": "s", "arguments": "{}"}},
            {"id": "t4", "type": "function", "function": {"name": "s", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": twice},
        {"role": "tool", "tool_call_id": "t2", "content": thrice},
        {"role": "tool", "tool_call_id": "t3", "content": {"type": "image", "data": b64, "mimeType": "image/png"}},
        {"role": "tool", "tool_call_id": "t4", "content": in_text}
    ]});
    let body = serde_json::to_vec(&body).unwrap();
    let out = strip(&body, Shape::Chat);
    assert_eq!(out.report.images_replaced, 4);
    let new = parse(out.body.as_deref().unwrap());
    assert_no_images(&new);
    assert!(!String::from_utf8_lossy(out.body.as_deref().unwrap()).contains(&b64[..64]));
    // Each level is still valid JSON, with the rest of it as it was.
    let level1: Value =
        serde_json::from_str(new["messages"][2]["content"].as_str().unwrap()).unwrap();
    assert_eq!(level1["n"], 1);
    let level2: Value = serde_json::from_str(level1["result"].as_str().unwrap()).unwrap();
    assert_eq!(level2["content"][0], mcp["content"][0]);
    assert_eq!(level2["content"][1]["type"], "text");
    assert!(
        level2["content"][1]["text"]
            .as_str()
            .unwrap()
            .contains("image/png 320x200")
    );
    let deep: Value =
        serde_json::from_str(new["messages"][3]["content"].as_str().unwrap()).unwrap();
    let deep: Value = serde_json::from_str(deep["outer"].as_str().unwrap()).unwrap();
    let deep: Value = serde_json::from_str(deep["result"].as_str().unwrap()).unwrap();
    assert_eq!(deep["content"][1]["type"], "text");
    // A bare part as content: replaced where it is, the pairing kept.
    assert_eq!(new["messages"][4]["tool_call_id"], "t3");
    assert_eq!(new["messages"][4]["content"]["type"], "text");
    // A vision model: nothing changes.
    assert!(
        rewrite(&body, &Plan::images_only(Shape::Chat, true, false))
            .body
            .is_none()
    );
}

/// The image shapes real SDKs send, each found and replaced for a
/// text-only model: Vercel AI SDK tool output (v6 `image-data`,
/// `image-url`, `file-data`; v5 `media`) as JSON text, Responses
/// `computer_call_output` screenshots, MCP embedded resources, LangChain
/// standard blocks, an Anthropic document made of content blocks.
#[test]
fn image_shapes_of_real_sdks_are_found() {
    let png = base64_simd::STANDARD.encode_to_string(fixture("chart.png"));
    let url = format!("data:image/png;base64,{png}");
    let vercel = json!([
        {"type": "text", "text": "took it"},
        {"type": "image-data", "data": png, "mediaType": "image/png"},
        {"type": "media", "data": png, "mediaType": "image/png"},
        {"type": "file-data", "data": png, "mediaType": "image/png"},
        {"type": "image-url", "url": "https://example.com/a.png"},
        {"type": "file-data", "data": "JVBERi0=", "mediaType": "application/pdf"},
        {"type": "file", "mediaType": "image/png", "data": {"type": "data", "data": png}},
        {"type": "file", "mediaType": "image/png", "data": {"type": "url", "url": "https://example.com/f.png"}}
    ]);
    let mcp = json!({"content": [
        {"type": "resource", "resource": {"uri": "file:///s.png", "mimeType": "image/png", "blob": png}},
        {"type": "resource", "resource": {"uri": "file:///a.txt", "mimeType": "text/plain", "text": "hello"}},
        {"type": "resource_link", "uri": "file:///b.png", "name": "b"}
    ]});
    let chat = json!({"model": "m", "messages": [
        {"role": "user", "content": [
            {"type": "image", "source_type": "base64", "data": png, "mime_type": "image/png"},
            {"type": "image", "url": "https://example.com/l.png"},
            {"type": "image", "base64": png, "mime_type": "image/png"}]},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "v", "type": "function", "function": {"name": "s", "arguments": "{}"}},
            {"id": "m", "type": "function", "function": {"name": "s", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "v", "content": vercel.to_string()},
        {"role": "tool", "tool_call_id": "m", "content": mcp.to_string()}
    ]});
    let out = strip(&serde_json::to_vec(&chat).unwrap(), Shape::Chat);
    assert_eq!(out.report.images_replaced, 3 + 6 + 1, "{:?}", out.report);
    let new = parse(out.body.as_deref().unwrap());
    assert_no_images(&new);
    assert!(!String::from_utf8_lossy(out.body.as_deref().unwrap()).contains(&png[100..160]));
    let v: Value = serde_json::from_str(new["messages"][2]["content"].as_str().unwrap()).unwrap();
    assert_eq!(v[0], json!({"type": "text", "text": "took it"}));
    assert_eq!(v[5]["mediaType"], "application/pdf", "not an image: kept");
    let m: Value = serde_json::from_str(new["messages"][3]["content"].as_str().unwrap()).unwrap();
    assert_eq!(m["content"][1]["resource"]["text"], "hello");
    assert_eq!(m["content"][2]["type"], "resource_link");

    let responses = json!({"model": "m", "input": [
        {"type": "computer_call", "call_id": "c1", "action": {"type": "screenshot"}},
        {"type": "computer_call_output", "call_id": "c1", "output": {"type": "computer_screenshot", "image_url": url}}
    ]});
    let out = strip(&serde_json::to_vec(&responses).unwrap(), Shape::Responses);
    assert_eq!(out.report.images_replaced, 1);
    let new = parse(out.body.as_deref().unwrap());
    assert_no_images(&new);
    assert!(!String::from_utf8_lossy(out.body.as_deref().unwrap()).contains(&png[100..160]));
    assert_eq!(new["input"][1]["call_id"], "c1");
    assert_eq!(new["input"][1]["output"]["type"], "input_text");

    let messages = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "content", "content": [
            {"type": "text", "text": "page 1"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]}},
        {"type": "text", "text": "summarise"}]}]});
    let out = strip(&serde_json::to_vec(&messages).unwrap(), Shape::Messages);
    assert_eq!(out.report.images_replaced, 1);
    let new = parse(out.body.as_deref().unwrap());
    assert_no_images(&new);
    assert!(!String::from_utf8_lossy(out.body.as_deref().unwrap()).contains(&png[100..160]));
    assert_eq!(
        new["messages"][0]["content"][0]["source"]["content"][1]["type"],
        "text"
    );
}

#[test]
fn cache_markers_stay_on_the_text_that_replaces_an_image() {
    let png = base64_simd::STANDARD.encode_to_string(fixture("chart.png"));
    let cc = json!({"type": "ephemeral", "ttl": "1h"});
    let body = json!({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}, "cache_control": cc},
            {"type": "text", "text": "what is it?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "tu", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu", "cache_control": {"type": "ephemeral"}, "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}, "cache_control": {"type": "ephemeral"}}]}]}
    ]});
    let out = strip(&serde_json::to_vec(&body).unwrap(), Shape::Messages);
    let new = parse(out.body.as_deref().unwrap());
    assert_no_images(&new);
    let first = &new["messages"][0]["content"][0];
    assert_eq!(first["type"], "text");
    assert_eq!(first["cache_control"], cc, "{first}");
    let result = &new["messages"][2]["content"][0];
    assert_eq!(result["cache_control"], json!({"type": "ephemeral"}));
    assert_eq!(
        result["content"][0]["cache_control"],
        json!({"type": "ephemeral"})
    );
    // Chat: a part's prompt_cache_breakpoint stays; a tool message whose
    // parts carry markers keeps its array (a string would lose them).
    let chat = json!({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{png}")}, "prompt_cache_breakpoint": {"mode": "explicit"}}]},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "t", "type": "function", "function": {"name": "s", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t", "content": [
            {"type": "text", "text": "shot", "cache_control": {"type": "ephemeral"}},
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{png}")}}]}
    ]});
    let out = strip(&serde_json::to_vec(&chat).unwrap(), Shape::Chat);
    let new = parse(out.body.as_deref().unwrap());
    assert_no_images(&new);
    assert_eq!(
        new["messages"][0]["content"][0]["prompt_cache_breakpoint"],
        json!({"mode": "explicit"})
    );
    let tool = &new["messages"][2]["content"];
    assert!(tool.is_array(), "{tool}");
    assert_eq!(tool[0]["cache_control"], json!({"type": "ephemeral"}));
    // Counting every marker: as many arrive as were sent.
    let sent = serde_json::to_string(&body)
        .unwrap()
        .matches("cache_control")
        .count();
    let out = strip(&serde_json::to_vec(&body).unwrap(), Shape::Messages);
    let arrived = String::from_utf8_lossy(out.body.as_deref().unwrap())
        .matches("cache_control")
        .count();
    assert_eq!(sent, arrived);
}

#[test]
fn vision_models_and_imageless_requests_are_untouched() {
    let body = fixture("chat-image-vision-stream.json");
    let out = rewrite(&body, &Plan::images_only(Shape::Chat, true, false));
    assert!(out.body.is_none() && out.report.images_found == 0);
    let plain = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let out = strip(plain, Shape::Chat);
    assert!(out.body.is_none());
    assert_eq!(out.report.images_found, 0);
}

#[test]
fn unknown_fields_survive_byte_for_byte() {
    let body = br#"{"model":"m", "zeta": {"x": [1,2.50,"\u00e9"]},
      "messages":[{"role":"user","name":"al","weird":  true,
        "content":[{"type":"image_url","image_url":{"url":"https://x.test/a.png","detail":"low"},"cache_control":{"type":"ephemeral"}},
                   {"type":"text","text":"hi","other":1}]}],
      "temperature": 0.70}"#;
    let out = strip(body, Shape::Chat);
    let new = String::from_utf8(out.body.unwrap()).unwrap();
    // Every token stays as it was written (number forms, escapes); a
    // rewritten body goes out without whitespace between tokens.
    for kept in [
        r#""zeta":{"x":[1,2.50,"\u00e9"]}"#,
        r#""name":"al","weird":true"#,
        r#"{"type":"text","text":"hi","other":1}"#,
        r#""temperature":0.70}"#,
    ] {
        assert!(new.contains(kept), "{kept} lost in {new}");
    }
}

#[test]
fn bad_images_get_a_placeholder_that_says_what_was_wrong() {
    let png_head = base64_simd::STANDARD.encode_to_string(&fixture("chart.png")[..64]);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!not base64!!!"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
        {"type": "image_url", "image_url": {"url": format!("data:;base64,{png_head}")}},
        {"type": "image_url", "image_url": 42},
        {"type": "image_url"},
        {"type": "image", "source": {"type": "weird"}},
        {"type": "image_url", "image_url": {"url": "data:image/svg+xml;utf8,<svg/>"}},
        {"type": "input_image", "file_id": "file-123"},
        {"type": "input_image", "image_url": format!("(data:image/png;base64,{png_head}")},
        "a bare string part",
        {"no": "type"}
    ]}, {"role": "user", "content": 7}, "not an object"]});
    let body = serde_json::to_vec(&body).unwrap();
    let out = strip(&body, Shape::Chat);
    let new = parse(out.body.as_deref().unwrap());
    let parts = new["messages"][0]["content"].as_array().unwrap();
    assert_eq!(parts.len(), 11);
    let text = |i: usize| parts[i]["text"].as_str().unwrap().to_owned();
    assert!(text(0).contains("invalid"), "{}", text(0));
    assert!(text(1).contains("empty"), "{}", text(1));
    assert!(text(2).contains("image/png"), "sniffed: {}", text(2));
    assert!(text(3).contains("unexpected shape"), "{}", text(3));
    assert!(text(4).contains("without a URL"), "{}", text(4));
    assert!(text(5).contains("unknown type"), "{}", text(5));
    assert!(text(6).contains("not base64"), "{}", text(6));
    assert!(text(7).contains("file-123"), "{}", text(7));
    assert!(
        text(8).contains("-character URL") && !text(8).contains("base64"),
        "{}",
        text(8)
    );
    assert_eq!(parts[9], "a bare string part");
    assert_eq!(parts[10], json!({"no": "type"}));
    assert_eq!(new["messages"][1]["content"], 7);
    for i in 0..9 {
        assert!(text(i).contains("sha256:"), "{}", text(i));
    }
    assert!(
        strip(out.body.as_deref().unwrap(), Shape::Chat)
            .body
            .is_none()
    );
}

#[test]
fn ten_thousand_images_and_deep_nesting() {
    let png = fixture("chart.png");
    let b64 = base64_simd::STANDARD.encode_to_string(&png[..200]);
    let part =
        format!(r#"{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{b64}"}}}}"#);
    let parts = vec![part; 10_000].join(",");
    let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":[{parts}]}}]}}"#);
    let out = strip(body.as_bytes(), Shape::Chat);
    assert_eq!(out.report.images_replaced, 10_000);
    assert_eq!(out.artifacts.len(), 1);
    assert_no_images(&parse(out.body.as_deref().unwrap()));

    let deep = format!(
        r#"{{"model":"m","x":{}1{},"messages":[{{"role":"user","content":[{{"type":"text","text":"hi","y":{}{}}}]}}]}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000),
        "{\"a\":".repeat(50_000),
        "}".repeat(50_000)
    );
    let out = strip(deep.as_bytes(), Shape::Chat);
    assert!(out.body.is_none());
    assert_eq!(out.report.images_found, 0);
    // Tool results nested past the bound are left alone, not a crash.
    let nested = format!(
        r#"{{"messages":[{{"role":"user","content":{}"x"{}}}]}}"#,
        r#"[{"type":"tool_result","content":"#.repeat(5_000),
        "}]".repeat(5_000)
    );
    let out = strip(nested.as_bytes(), Shape::Messages);
    assert!(out.report.skipped.is_none());
}

#[test]
fn describe_mode_puts_each_description_in_place() {
    let png = fixture("chart.png");
    let data = format!(
        "data:image/png;base64,{}",
        base64_simd::STANDARD.encode_to_string(&png)
    );
    let body = serde_json::to_vec(&json!({
        "model": "gpt-oss-120b",
        "messages": [
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data}},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            ]},
            {"role": "assistant", "content": "seen"},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data}},
                {"type": "input_image", "file_id": "file-1"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}},
                // Text declared a PNG: no image reader knows it.
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8gd29ybGQsIG5vdCBhbiBpbWFnZQ=="}},
            ]},
        ],
    }))
    .unwrap();
    let plan = Plan::images_only(Shape::Chat, false, true);
    let scanned = scan(&body, &plan).unwrap();
    // The repeated image once; the file id, the broken one and the text
    // that says it is a PNG cannot be described.
    let subjects = scanned.subjects(&body);
    let shas: Vec<&str> = subjects.iter().map(|(_, s)| s.sha256.as_str()).collect();
    let png_sha = sha256_hex(&png);
    let url_sha = sha256_hex(b"https://example.com/a.png");
    assert_eq!(shas, vec![png_sha.as_str(), url_sha.as_str()]);
    assert!(matches!(
        &subjects[0].1.payload,
        Payload::Inline { media_type, bytes } if media_type == "image/png" && bytes[..] == png[..]
    ));
    // Only the chart has a description (the URL's lookup failed).
    let out = scanned.finish(&body, &[(png_sha.clone(), Arc::from("A chart: 42%."))]);
    let v = parse(out.body.as_ref().unwrap());
    let size = imagesize::blob_size(&png).unwrap();
    let described = format!(
        "[image sha256:{}, image/png {}x{}, described: A chart: 42%.]",
        &png_sha[..12],
        size.width,
        size.height
    );
    assert_eq!(v["messages"][0]["content"][0]["text"], described.as_str());
    assert_eq!(v["messages"][2]["content"][0]["text"], described.as_str());
    let url_text = v["messages"][0]["content"][1]["text"].as_str().unwrap();
    assert!(
        url_text.ends_with("not shown, this model cannot see images]"),
        "{url_text}"
    );
    assert_eq!(out.report.images_replaced, 6);
    assert_eq!(out.report.images_described, 2);
    let actions: Vec<&str> = out.report.images.iter().map(|n| n.action).collect();
    assert_eq!(
        actions,
        vec![
            "described",
            "stripped",
            "described",
            "stripped",
            "stripped",
            "stripped"
        ]
    );
    // Without descriptions, the same as strip mode.
    let again = scan(&body, &plan).unwrap().finish(&body, &[]);
    assert_eq!(again.body, strip(&body, Shape::Chat).body);
}

#[test]
fn not_an_object_is_skipped() {
    for body in [
        &b"[1,2]"[..],
        b"\"s\"",
        b"{\"messages\": {\"role\": \"user\"}}",
    ] {
        let out = strip(body, Shape::Chat);
        assert!(out.body.is_none());
    }
}

// ---- property tests ----

fn image_part(shape: Shape, data: &str, kind: u8) -> Value {
    match (shape, kind % 3) {
        (Shape::Chat, 0) => {
            json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{data}")}})
        }
        (Shape::Chat, 1) => json!({"type": "image", "data": data, "mimeType": "image/png"}),
        (Shape::Responses, _) => {
            json!({"type": "input_image", "image_url": format!("data:image/jpeg;base64,{data}")})
        }
        (Shape::Messages, _) => {
            json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}})
        }
        (_, _) => json!({"type": "image_url", "image_url": {"url": "https://example.com/i.png"}}),
    }
}

fn text_part_v(shape: Shape, t: &str) -> Value {
    match shape {
        Shape::Responses => json!({"type": "input_text", "text": t}),
        _ => json!({"type": "text", "text": t}),
    }
}

prop_compose! {
    fn request()(
        shape in prop_oneof![Just(Shape::Chat), Just(Shape::Responses), Just(Shape::Messages)],
        msgs in prop::collection::vec(
            (0u8..4, prop::collection::vec((any::<bool>(), prop::collection::vec(any::<u8>(), 0..40), 0u8..6, "[a-z ]{0,12}"), 0..4)),
            1..6),
    ) -> (Shape, Vec<u8>) {
        let mut out = Vec::new();
        for (i, (role, parts)) in msgs.into_iter().enumerate() {
            let mut content = Vec::new();
            for (is_image, bytes, kind, text) in parts {
                if is_image {
                    let b64 = base64_simd::STANDARD.encode_to_string(&bytes);
                    if kind == 5 {
                        content.push(text_part_v(shape, &format!("{text} data:image/gif;base64,{b64} end")));
                    } else {
                        content.push(image_part(shape, &b64, kind));
                    }
                } else {
                    content.push(text_part_v(shape, &text));
                }
            }
            let m = match (shape, role) {
                (Shape::Chat, 3) => json!({"role": "tool", "tool_call_id": format!("call_{i}"), "content": content, "x-extra": i}),
                (Shape::Responses, 3) => json!({"type": "function_call_output", "call_id": format!("call_{i}"), "output": content}),
                (Shape::Messages, 3) => json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": format!("toolu_{i}"), "content": content}]}),
                (_, 1) => json!({"role": "assistant", "content": "ok"}),
                (_, 2) => json!({"role": "user", "content": format!("see data:image/png;base64,{}", base64_simd::STANDARD.encode_to_string([i as u8; 9]))}),
                _ => json!({"role": "user", "content": content}),
            };
            out.push(m);
        }
        let key = if shape == Shape::Responses { "input" } else { "messages" };
        (shape, serde_json::to_vec(&json!({"model": "text-only", key: out, "unknown": {"k": [1, "v"]}})).unwrap())
    }
}

fn ids(v: &Value, key: &str) -> Vec<String> {
    v[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let tr = &m["content"][0]["tool_use_id"];
            format!(
                "{}|{}|{}|{}|{tr}",
                m["role"], m["type"], m["tool_call_id"], m["call_id"]
            )
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn no_image_survives_and_the_skeleton_holds((shape, body) in request()) {
        let key = if shape == Shape::Responses { "input" } else { "messages" };
        let out = strip(&body, shape);
        let new_bytes = out.body.clone().unwrap_or_else(|| body.clone());
        let new = parse(&new_bytes);
        let old = parse(&body);
        assert_no_images(&new);
        prop_assert_eq!(new[key].as_array().unwrap().len(), old[key].as_array().unwrap().len());
        prop_assert_eq!(ids(&new, key), ids(&old, key));
        prop_assert_eq!(&new["unknown"], &old["unknown"]);
        // Deterministic and idempotent.
        let again = strip(&body, shape);
        prop_assert_eq!(&again.body, &out.body);
        let twice = strip(&new_bytes, shape);
        prop_assert!(twice.body.is_none(), "second pass changed {}", String::from_utf8_lossy(&new_bytes));
    }
}
