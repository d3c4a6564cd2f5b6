//! The inspector page in a real browser (headless Chromium over WebDriver,
//! `support::webdriver`): a request visor changed is listed, the filter
//! form works from the keyboard, and the page loads nothing from elsewhere;
//! one request side by side with its image's thumbnail (the original's
//! bytes) and its dedup note, its conversation, the savings; the sign-in
//! form where a key is needed.
//! Screenshots for a person to look at: `target/inspector-screens/`.
//! Without Chromium installed these skip (printed), except under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use serde_json::json;
use support::webdriver::{Browser, keys};
use support::*;

/// Images to a `text-only` model are stripped (replaced by a note).
pub const TEXT_ONLY: &str =
    "[images]\nnon_vision = \"strip\"\n[[model]]\nmatch = \"text-only\"\nvision = false\n";

/// How long the browser may take to show what is asked.
const BOUND: Duration = Duration::from_secs(10);

/// A mock upstream answering every chat with usage, and a visor before it
/// with `config` (extra TOML, e.g. [`TEXT_ONLY`]). Keep the mock alive as
/// long as the visor.
pub async fn visor_with(config: &str) -> (MockUpstream, Visor) {
    let mock = MockUpstream::start(|_: &Recorded| {
        Reply::json(
            200,
            json!({"id": "c1", "object": "chat.completion",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 120, "completion_tokens": 7}})
            .to_string(),
        )
    })
    .await;
    let visor = Visor::for_mock(&mock, config).await;
    (mock, visor)
}

/// Sends one chat with a PNG to `model` (as `x-request-id: id`) and asserts
/// a 200; then waits (bounded) until the inspector lists it.
pub async fn send_image_request(visor: &Visor, model: &str, id: &str) {
    let (url, _) = png_data_url(id);
    let req = Request::post(visor.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", id)
        .body(Full::new(chat_with_images(model, &[url])))
        .unwrap();
    let (status, _, body) = send(req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    wait_listed(visor, id).await;
}

/// Waits (bounded) until `/visor/api/requests/<id>` answers 200.
pub async fn wait_listed(visor: &Visor, id: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let req = Request::get(visor.url(&format!("/visor/api/requests/{id}")))
            .body(Full::new(Bytes::new()))
            .unwrap();
        if send(req).await.0 == 200 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{id} was not listed within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Asserts the open page fetched nothing but from `visor` (resource timing:
/// every entry's URL under visor's own base URL).
pub async fn assert_only_own_requests(browser: &Browser, visor: &Visor) {
    let own = visor.url("/");
    let names = browser
        .execute(
            "return performance.getEntriesByType('resource').map(e => e.name)",
            vec![],
        )
        .await;
    for name in names.as_array().unwrap() {
        let name = name.as_str().unwrap();
        assert!(
            name.starts_with(&own),
            "the page fetched {name}, not from {own}"
        );
    }
    // The page itself too.
    let page = browser
        .execute(
            "return performance.getEntriesByType('navigation').map(e => e.name)",
            vec![],
        )
        .await;
    for name in page.as_array().unwrap() {
        assert!(name.as_str().unwrap().starts_with(&own), "{name}");
    }
}

#[tokio::test]
async fn the_page_lists_a_changed_request_and_filters_by_keyboard() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let (_mock, visor) = visor_with(TEXT_ONLY).await;
    send_image_request(&visor, "text-only", "req-browser-1").await;

    browser.goto(&visor.url("/visor/ui")).await;
    assert!(browser.title().await.contains("Requests"));
    let rows = browser.find_all("table tbody tr").await;
    assert_eq!(rows.len(), 1);
    let cells = rows[0].find_all("td").await;
    assert_eq!(cells[3].text().await, "text-only → mock");
    assert_eq!(cells[4].text().await, "200");
    assert!(
        cells[8].text().await.contains("images replaced"),
        "{}",
        cells[8].text().await
    );
    let link = cells[0].find("a").await;
    assert_eq!(
        link.attr("href").await.as_deref(),
        Some("/visor/ui/requests/req-browser-1")
    );
    assert_only_own_requests(&browser, &visor).await;
    browser.screenshot("requests.png").await;

    // Live: a request that ends while the page is open is added to it.
    browser.wait_for_text("Live.", BOUND).await;
    send_image_request(&visor, "text-only", "req-browser-live").await;
    browser
        .wait_for("a[href='/visor/ui/requests/req-browser-live']", BOUND)
        .await;
    assert_eq!(browser.find_all("table tbody tr").await.len(), 2);
    browser.goto(&visor.url("/visor/ui")).await;

    // The filter from the keyboard: Tab to the model field, type, Enter.
    let model = browser.tab_to("input[name=model]", 10).await;
    assert_eq!(model.attr("name").await.as_deref(), Some("model"));
    browser.press(&format!("text-only{}", keys::ENTER)).await;
    let url = browser.wait_for_url("model=text-only", BOUND).await;
    assert!(url.starts_with(&visor.url("/visor/ui?")), "{url}");
    browser.wait_for("table tbody tr", BOUND).await;
    let rows = browser.find_all("table tbody tr").await;
    assert_eq!(rows.len(), 2);
    assert!(rows[0].text().await.contains("text-only → mock"));
    // The field keeps what was filtered by.
    let model = browser.find("input[name=model]").await;
    assert_eq!(model.prop("value").await, "text-only");
    assert_only_own_requests(&browser, &visor).await;
    browser.screenshot("filtered.png").await;

    // A model nobody asked for: nothing listed.
    model.clear().await;
    model
        .send_keys(&format!("no-such-model{}", keys::ENTER))
        .await;
    browser.wait_for_url("model=no-such-model", BOUND).await;
    browser.wait_for_text("No request yet.", BOUND).await;
    assert!(browser.find_all("table tbody tr").await.is_empty());
    browser.screenshot("filtered-empty.png").await;

    // The harness's cookies and clicks (for the tests to come).
    browser
        .add_cookie(json!({"name": "visor-test", "value": "1"}))
        .await;
    let cookie = browser.cookie("visor-test").await.unwrap();
    assert_eq!(
        (&cookie["value"], &cookie["httpOnly"]),
        (&json!("1"), &json!(false))
    );
    assert!(browser.cookie("absent").await.is_none());
    assert_eq!(browser.cookies().await.len(), 1);
    browser
        .find("nav a[href='/visor/api/requests']")
        .await
        .click()
        .await;
    browser.wait_for_url("/visor/api/requests", BOUND).await;
    browser.wait_for_text("req-browser-1", BOUND).await;
    browser.quit().await;
}

/// A chat whose screenshot a text-only model gets described, and whose
/// second tool result repeats the first (a dedup note).
fn described_and_deduped(url: &str) -> String {
    let block = (0..6)
        .map(|i| format!("[10:0{i}] member {i}: the retention policy needs a tax branch first, see section {i}"))
        .collect::<Vec<_>>()
        .join("\n");
    let call = |id: &str| {
        json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": id, "type": "function", "function": {"name": "fetch", "arguments": "{}"}}]})
    };
    json!({"model": "text-only", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what changed?"},
            {"type": "image_url", "image_url": {"url": url}}]},
        call("t1"),
        {"role": "tool", "tool_call_id": "t1", "content": block},
        call("t2"),
        {"role": "tool", "tool_call_id": "t2", "content": format!("{block}\na new line from the tool")},
    ]})
    .to_string()
}

#[tokio::test]
async fn one_request_its_thumbnail_its_note_its_conversation_and_savings() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let config = "[images]\nnon_vision = \"describe\"\n[describer]\nmodel = \"vision-mini\"\n\
                  [[model]]\nmatch = \"text-only\"\nvision = false\ninput = 1.0\noutput = 2.0\n";
    let (_mock, visor) = visor_with(config).await;
    let (url, png) = png_data_url("journey");
    let req = Request::post(visor.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", "req-journey")
        .body(Full::new(Bytes::from(described_and_deduped(&url))))
        .unwrap();
    assert_eq!(send(req).await.0, 200);
    wait_listed(&visor, "req-journey").await;

    browser.goto(&visor.url("/visor/ui")).await;
    browser
        .find("a[href='/visor/ui/requests/req-journey']")
        .await
        .click()
        .await;
    browser
        .wait_for_url("/visor/ui/requests/req-journey", BOUND)
        .await;
    let text = browser.body_text().await;
    assert!(
        text.contains("images: described by vision-mini (this model cannot see images)"),
        "{text}"
    );
    assert!(
        text.contains("dedup: omitted: message 3 lines 1-6"),
        "{text}"
    );
    // The description the provider got is on the upstream side.
    assert!(text.contains("upstream"), "{text}");
    // The thumbnail loaded from the artifacts, with the original's bytes.
    let img = browser.wait_for("figure img", BOUND).await;
    let src = img.prop("src").await.as_str().unwrap().to_owned();
    assert!(src.starts_with(&visor.url("/visor/artifacts/")), "{src}");
    let loaded = browser
        .execute(
            "const i = arguments[0]; const e = performance.getEntriesByName(i.src)[0];\
             return [i.complete, i.naturalWidth, e ? e.responseStatus : 0, e ? e.decodedBodySize : 0];",
            vec![img.json()],
        )
        .await;
    assert_eq!(loaded[0], true, "{loaded}");
    assert!(loaded[1].as_u64().unwrap() > 0, "{loaded}");
    assert_eq!(loaded[2], 200, "{loaded}");
    assert_eq!(loaded[3].as_u64().unwrap() as usize, png.len(), "{loaded}");
    assert_only_own_requests(&browser, &visor).await;
    browser.screenshot("request.png").await;

    // Its conversation, with the chart.
    browser
        .find("dd a[href^='/visor/ui/conversations/']")
        .await
        .click()
        .await;
    browser
        .wait_for_url("/visor/ui/conversations/", BOUND)
        .await;
    browser.wait_for("svg.chart", BOUND).await;
    assert!(browser.find_all("table tbody tr").await.len() == 1);
    browser.screenshot("conversation.png").await;

    // The savings, reached from the navigation by keyboard.
    browser.tab_to("nav a[href='/visor/ui/savings']", 5).await;
    browser.press(keys::ENTER).await;
    browser.wait_for_url("/visor/ui/savings", BOUND).await;
    browser.wait_for_text("Per model", BOUND).await;
    assert!(browser.body_text().await.contains("text-only"));
    browser.screenshot("savings.png").await;
}

#[tokio::test]
async fn where_a_key_is_needed_the_page_asks_for_one() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let (_mock, visor) = visor_with(
        "[server]\napi_keys = [\"vk-proxy\"]\n[inspector]\nadmin_keys = [\"adm-browser\"]\n",
    )
    .await;
    browser.goto(&visor.url("/visor/ui")).await;
    browser.wait_for("input[name=key]", BOUND).await;
    assert!(
        browser.try_find("table").await.is_none(),
        "nothing shown without a key"
    );
    browser.screenshot("sign-in.png").await;
    // A proxy key is refused.
    let key = browser.find("input[name=key]").await;
    key.send_keys(&format!("vk-proxy{}", keys::ENTER)).await;
    browser
        .wait_for_text("not an inspector admin key", BOUND)
        .await;
    assert!(browser.cookie("visor_inspector").await.is_none());
    // The admin key signs in: back to the list, with an HttpOnly cookie.
    let key = browser.find("input[name=key]").await;
    key.send_keys(&format!("adm-browser{}", keys::ENTER)).await;
    browser.wait_for("table#requests", BOUND).await;
    assert!(browser.current_url().await.ends_with("/visor/ui"));
    let cookie = browser.cookie("visor_inspector").await.unwrap();
    assert_eq!(cookie["httpOnly"], true);
    assert!(!cookie["value"].as_str().unwrap().contains("adm-browser"));
    browser.screenshot("signed-in.png").await;
}
