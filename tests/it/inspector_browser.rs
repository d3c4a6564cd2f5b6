//! The inspector page in a real browser (headless Chromium over WebDriver,
//! `support::webdriver`): a request visor changed is listed, the filter
//! form works from the keyboard, and the page loads nothing from elsewhere.
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
    assert!(browser.title().await.contains("requests"));
    let rows = browser.find_all("table tbody tr").await;
    assert_eq!(rows.len(), 1);
    let cells = rows[0].find_all("td").await;
    assert_eq!(cells[2].text().await, "text-only → mock");
    assert_eq!(cells[3].text().await, "200");
    assert!(
        cells[7].text().await.contains("images replaced"),
        "{}",
        cells[7].text().await
    );
    let link = cells[0].find("a").await;
    assert_eq!(
        link.attr("href").await.as_deref(),
        Some("/visor/api/requests/req-browser-1")
    );
    assert_only_own_requests(&browser, &visor).await;
    browser.screenshot("requests.png").await;

    // The filter from the keyboard: Tab to the model field, type, Enter.
    let model = browser.tab_to("input[name=model]", 10).await;
    assert_eq!(model.attr("name").await.as_deref(), Some("model"));
    browser.press(&format!("text-only{}", keys::ENTER)).await;
    let url = browser.wait_for_url("model=text-only", BOUND).await;
    assert!(url.starts_with(&visor.url("/visor/ui?")), "{url}");
    browser.wait_for("table tbody tr", BOUND).await;
    let rows = browser.find_all("table tbody tr").await;
    assert_eq!(rows.len(), 1);
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
    assert!(browser.try_find("table").await.is_none());
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
        .find("a[href='/visor/api/requests']")
        .await
        .click()
        .await;
    browser.wait_for_url("/visor/api/requests", BOUND).await;
    browser.wait_for_text("req-browser-1", BOUND).await;
    browser.quit().await;
}
