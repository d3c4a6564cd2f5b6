//! A real browser for the tests: headless Chromium driven by `chromedriver`
//! over W3C WebDriver, on 127.0.0.1, with the tests' own HTTP client (no
//! WebDriver crate).
//!
//! [`Browser::start`] starts a `chromedriver` of the test's own on a free
//! port, waits (bounded) until its `/status` says ready, and opens a session
//! with headless Chromium. Without Chromium or chromedriver installed it
//! returns `None` and prints `SKIPPED: <reason>` — except under CI
//! (`CI=true`), where `.ci/run` installed both and a skip would hide
//! untested code: then it panics. `VISOR_TEST_CHROMEDRIVER` and
//! `VISOR_TEST_CHROMIUM` name other binaries than `chromedriver` (on `PATH`)
//! and `/usr/bin/chromium`; nothing needs them.
//!
//! A WebDriver error is a panic naming the command and what the driver said
//! (this is test code). On drop the session is deleted (Chromium quits) and
//! chromedriver is killed and reaped.
//!
//! Screenshots go to `target/inspector-screens/` of the target dir in use:
//! found from `CARGO_TARGET_TMPDIR` (`<target dir>/tmp`), not from
//! `CARGO_MANIFEST_DIR`, since `.ci/run` tests a copy of the repo in a
//! temporary folder (removed afterwards) against the real target dir.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

/// The W3C name of an element reference in JSON.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// Keys for [`Browser::press`] and [`Element::send_keys`] (W3C code points).
pub mod keys {
    pub const TAB: &str = "\u{E004}";
    pub const ENTER: &str = "\u{E007}";
    pub const ESCAPE: &str = "\u{E00C}";
    pub const SPACE: &str = "\u{E00D}";
    pub const BACKSPACE: &str = "\u{E003}";
    pub const SHIFT: &str = "\u{E008}";
    pub const ARROW_DOWN: &str = "\u{E015}";
    pub const ARROW_UP: &str = "\u{E013}";
}

/// Where screenshots go: `<target dir>/inspector-screens/` (made when
/// needed).
pub fn screens_dir() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).join("inspector-screens")
}

fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// `None` with a printed reason, or a panic under CI.
fn skip(reason: &str) -> Option<Browser> {
    if under_ci() {
        panic!("{reason}, and under CI=true browser tests may not skip");
    }
    eprintln!(
        "SKIPPED: {reason} (apt-get install chromium chromium-driver); the browser test did not run"
    );
    None
}

fn runs(binary: &str) -> Result<String, String> {
    match Command::new(binary)
        .arg("--version")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        }
        Ok(out) => Err(format!("`{binary} --version` failed ({})", out.status)),
        Err(e) => Err(format!("`{binary}` could not be run: {e}")),
    }
}

/// A headless Chromium session and the chromedriver of this test.
pub struct Browser {
    driver: Child,
    port: u16,
    session: String,
    client: super::Client,
    log: PathBuf,
    quit: bool,
}

/// An element of the current page (a W3C element reference).
pub struct Element<'b> {
    browser: &'b Browser,
    id: String,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium session (see the module
    /// doc): `None` (printed why) when they are not installed, a panic
    /// under `CI=true`.
    pub async fn start() -> Option<Browser> {
        let driver_bin =
            std::env::var("VISOR_TEST_CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".to_owned());
        let chromium =
            std::env::var("VISOR_TEST_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".to_owned());
        if let Err(e) = runs(&driver_bin) {
            return skip(&format!("chromedriver is not installed: {e}"));
        }
        if let Err(e) = runs(&chromium) {
            return skip(&format!("chromium is not installed: {e}"));
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = super::temp_dir("chromedriver").join("chromedriver.log");
        let driver = Command::new(&driver_bin)
            .arg(format!("--port={port}"))
            .arg(format!("--log-path={}", log.display()))
            .arg("--allowed-ips=127.0.0.1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{driver_bin}: {e}"));
        let mut browser = Browser {
            driver,
            port,
            session: String::new(),
            client: super::client(),
            log,
            quit: false,
        };
        browser.wait_ready(Duration::from_secs(20)).await;
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1400,1000",
                         "--no-first-run", "--no-default-browser-check"],
            },
        }}});
        let v = browser.raw("POST", "/session", Some(caps)).await;
        browser.session = v["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("new session: no sessionId in {v}"))
            .to_owned();
        Some(browser)
    }

    /// Polls chromedriver's `/status` until it says ready, up to `bound`.
    async fn wait_ready(&mut self, bound: Duration) {
        let deadline = Instant::now() + bound;
        loop {
            if let Some(status) = self.driver.try_wait().unwrap() {
                panic!(
                    "chromedriver exited ({status}) before it was ready; its log: {}",
                    self.log.display()
                );
            }
            let req = Request::get(format!("http://127.0.0.1:{}/status", self.port))
                .body(Full::new(Bytes::new()))
                .unwrap();
            let answer = tokio::time::timeout(Duration::from_secs(2), self.client.request(req));
            if let Ok(Ok(resp)) = answer.await
                && let Ok(body) = resp.into_body().collect().await
                && serde_json::from_slice::<Value>(&body.to_bytes())
                    .is_ok_and(|v| v["value"]["ready"] == true)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "chromedriver was not ready within {bound:?}; its log: {}",
                self.log.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// One WebDriver command at `path` (from the driver's root); its
    /// `value`, or a panic with the driver's error.
    async fn raw(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let body = match (method, body) {
            (_, Some(b)) => Bytes::from(b.to_string()),
            ("POST", None) => Bytes::from_static(b"{}"),
            _ => Bytes::new(),
        };
        let req = Request::builder()
            .method(method)
            .uri(format!("http://127.0.0.1:{}{path}", self.port))
            .header("content-type", "application/json; charset=utf-8")
            .body(Full::new(body))
            .unwrap();
        // Starting Chromium on a busy machine may take a while.
        let bound = Duration::from_secs(60);
        let resp = tokio::time::timeout(bound, self.client.request(req))
            .await
            .unwrap_or_else(|_| panic!("WebDriver {method} {path}: no answer within {bound:?}"))
            .unwrap_or_else(|e| panic!("WebDriver {method} {path}: {e}"));
        let status = resp.status();
        let bytes = tokio::time::timeout(bound, resp.into_body().collect())
            .await
            .unwrap_or_else(|_| panic!("WebDriver {method} {path}: body not within {bound:?}"))
            .unwrap_or_else(|e| panic!("WebDriver {method} {path}: {e}"))
            .to_bytes();
        let v: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!(
                "WebDriver {method} {path}: {status}, not JSON ({e}): {}",
                String::from_utf8_lossy(&bytes)
            )
        });
        let value = v.get("value").cloned().unwrap_or(Value::Null);
        if !status.is_success() || value.get("error").is_some_and(Value::is_string) {
            panic!(
                "WebDriver {method} {path}: {status} {}: {}",
                value["error"].as_str().unwrap_or("?"),
                value["message"].as_str().unwrap_or(&v.to_string())
            );
        }
        value
    }

    /// A command on this session: `path` follows `/session/<id>`.
    async fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        self.raw(method, &format!("/session/{}{path}", self.session), body)
            .await
    }

    /// Like [`Browser::cmd`], but a WebDriver error `error` (e.g. `no such
    /// element`) is `None` rather than a panic.
    async fn cmd_unless(
        &self,
        error: &str,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Option<Value> {
        let req = Request::builder()
            .method(method)
            .uri(format!(
                "http://127.0.0.1:{}/session/{}{path}",
                self.port, self.session
            ))
            .header("content-type", "application/json; charset=utf-8")
            .body(Full::new(match (method, body) {
                (_, Some(b)) => Bytes::from(b.to_string()),
                ("POST", None) => Bytes::from_static(b"{}"),
                _ => Bytes::new(),
            }))
            .unwrap();
        let (_, _, bytes) = super::send_on(&self.client, req).await;
        let v: Value = serde_json::from_slice(&bytes).unwrap_or_default();
        match v["value"]["error"].as_str() {
            Some(e) if e == error => None,
            Some(e) => panic!(
                "WebDriver {method} {path}: {e}: {}",
                v["value"]["message"].as_str().unwrap_or("")
            ),
            None => Some(v["value"].clone()),
        }
    }

    fn element(&self, v: &Value) -> Element<'_> {
        let id = v[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("not an element reference: {v}"));
        Element {
            browser: self,
            id: id.to_owned(),
        }
    }

    /// Opens `url` and waits until it has loaded (WebDriver's page load).
    pub async fn goto(&self, url: &str) {
        self.cmd("POST", "/url", Some(json!({"url": url}))).await;
    }

    pub async fn current_url(&self) -> String {
        self.cmd("GET", "/url", None)
            .await
            .as_str()
            .unwrap()
            .to_owned()
    }

    pub async fn title(&self) -> String {
        self.cmd("GET", "/title", None)
            .await
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// The first element matching the CSS selector; a panic if none does.
    pub async fn find(&self, css: &str) -> Element<'_> {
        let v = self
            .cmd(
                "POST",
                "/element",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        self.element(&v)
    }

    /// The first element matching, or `None`.
    pub async fn try_find(&self, css: &str) -> Option<Element<'_>> {
        let v = self
            .cmd_unless(
                "no such element",
                "POST",
                "/element",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await?;
        Some(self.element(&v))
    }

    /// Every element matching the CSS selector (maybe none).
    pub async fn find_all(&self, css: &str) -> Vec<Element<'_>> {
        let v = self
            .cmd(
                "POST",
                "/elements",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        v.as_array()
            .unwrap()
            .iter()
            .map(|e| self.element(e))
            .collect()
    }

    /// Polls (bounded) until an element matches `css`; a panic naming the
    /// selector and the URL when none did within `bound`.
    pub async fn wait_for(&self, css: &str, bound: Duration) -> Element<'_> {
        let deadline = Instant::now() + bound;
        loop {
            if let Some(e) = self.try_find(css).await {
                return e;
            }
            if Instant::now() >= deadline {
                panic!(
                    "no element matched {css:?} within {bound:?} on {}",
                    self.current_url().await
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Polls (bounded) until the page's visible text contains `text`.
    pub async fn wait_for_text(&self, text: &str, bound: Duration) {
        let deadline = Instant::now() + bound;
        loop {
            let body = self.body_text().await;
            if body.contains(text) {
                return;
            }
            if Instant::now() >= deadline {
                panic!("{text:?} did not appear within {bound:?}; the page says: {body}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Polls (bounded) until the current URL contains `part`; the URL.
    pub async fn wait_for_url(&self, part: &str, bound: Duration) -> String {
        let deadline = Instant::now() + bound;
        loop {
            let url = self.current_url().await;
            if url.contains(part) {
                return url;
            }
            if Instant::now() >= deadline {
                panic!("the URL did not come to contain {part:?} within {bound:?}: {url}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The page's visible text (`document.body.innerText`).
    pub async fn body_text(&self) -> String {
        self.execute(
            "return document.body ? document.body.innerText : ''",
            vec![],
        )
        .await
        .as_str()
        .unwrap_or_default()
        .to_owned()
    }

    /// Runs `script` (a function body: `return ...`; its arguments are
    /// `arguments[i]`, an [`Element::json`] among them is the element) and
    /// returns what it returned.
    pub async fn execute(&self, script: &str, args: Vec<Value>) -> Value {
        self.cmd(
            "POST",
            "/execute/sync",
            Some(json!({"script": script, "args": args})),
        )
        .await
    }

    /// The element that has the focus (the body when none has).
    pub async fn active_element(&self) -> Element<'_> {
        let v = self.cmd("GET", "/element/active", None).await;
        self.element(&v)
    }

    /// Presses and releases each key of `keys` in turn, as a keyboard does,
    /// on whatever has the focus: text, or [`keys`] such as [`keys::TAB`].
    pub async fn press(&self, keys: &str) {
        let mut actions = Vec::new();
        for c in keys.chars() {
            actions.push(json!({"type": "keyDown", "value": c.to_string()}));
            actions.push(json!({"type": "keyUp", "value": c.to_string()}));
        }
        self.cmd(
            "POST",
            "/actions",
            Some(json!({"actions": [{"type": "key", "id": "keyboard", "actions": actions}]})),
        )
        .await;
        self.cmd("DELETE", "/actions", None).await;
    }

    /// Presses Tab until the focused element matches `css` (bounded to
    /// `max_tabs` presses); a panic, naming what got the focus, when it
    /// never does. For keyboard navigation tests.
    pub async fn tab_to(&self, css: &str, max_tabs: usize) -> Element<'_> {
        let mut seen = Vec::new();
        for _ in 0..max_tabs {
            self.press(keys::TAB).await;
            let active = self.active_element().await;
            let matches = self
                .execute(
                    "return arguments[0].matches(arguments[1])",
                    vec![active.json(), json!(css)],
                )
                .await;
            if matches == true {
                return active;
            }
            seen.push(active.describe().await);
        }
        panic!("{max_tabs} Tabs did not reach {css:?}; the focus went to: {seen:?}");
    }

    /// Saves a PNG of the viewport as `screens_dir()/name` (e.g.
    /// `requests.png`) and returns its path.
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let v = self.cmd("GET", "/screenshot", None).await;
        save_png(v.as_str().unwrap(), name)
    }

    /// Every cookie the page's document sees, HttpOnly ones included (each
    /// a W3C cookie object: `name`, `value`, `httpOnly`, `path`, ...).
    pub async fn cookies(&self) -> Vec<Value> {
        self.cmd("GET", "/cookie", None)
            .await
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The cookie `name`, if there is one.
    pub async fn cookie(&self, name: &str) -> Option<Value> {
        self.cmd_unless("no such cookie", "GET", &format!("/cookie/{name}"), None)
            .await
    }

    /// Sets a cookie on the current page's domain (a page must be open):
    /// `cookie` is a W3C cookie object, at least `{"name": .., "value": ..}`.
    pub async fn add_cookie(&self, cookie: Value) {
        self.cmd("POST", "/cookie", Some(json!({"cookie": cookie})))
            .await;
    }

    pub async fn delete_cookies(&self) {
        self.cmd("DELETE", "/cookie", None).await;
    }

    /// Ends the session now (Chromium quits); otherwise drop does it.
    pub async fn quit(mut self) {
        self.raw("DELETE", &format!("/session/{}", self.session), None)
            .await;
        self.quit = true;
    }

    /// chromedriver's log, for a failure message.
    pub fn log_path(&self) -> &Path {
        &self.log
    }
}

/// Writes base64 `b64` (a PNG) as `screens_dir()/name`.
fn save_png(b64: &str, name: &str) -> PathBuf {
    let png = base64_simd::STANDARD
        .decode_to_vec(b64)
        .unwrap_or_else(|e| panic!("screenshot {name}: not base64: {e}"));
    assert!(png.starts_with(b"\x89PNG"), "screenshot {name}: not a PNG");
    let path = screens_dir().join(name);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, png).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    path
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Delete the session so Chromium quits (killing chromedriver alone
        // would leave it running). Drop cannot wait on the async client, so
        // this is one plain HTTP/1.1 request, bounded.
        if !self.quit && !self.session.is_empty() {
            let _ = delete_session(self.port, &self.session);
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn delete_session(port: u16, session: &str) -> std::io::Result<()> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    write!(
        s,
        "DELETE /session/{session} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    Ok(())
}

impl<'b> Element<'b> {
    /// This element as a script argument of [`Browser::execute`].
    pub fn json(&self) -> Value {
        json!({ ELEMENT: self.id })
    }

    fn path(&self, rest: &str) -> String {
        format!("/element/{}{rest}", self.id)
    }

    /// Its rendered text.
    pub async fn text(&self) -> String {
        self.browser
            .cmd("GET", &self.path("/text"), None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Its attribute `name` as written in the HTML, if present.
    pub async fn attr(&self, name: &str) -> Option<String> {
        self.browser
            .cmd("GET", &self.path(&format!("/attribute/{name}")), None)
            .await
            .as_str()
            .map(str::to_owned)
    }

    /// Its DOM property `name` (e.g. `value` of an input as typed).
    pub async fn prop(&self, name: &str) -> Value {
        self.browser
            .cmd("GET", &self.path(&format!("/property/{name}")), None)
            .await
    }

    pub async fn tag(&self) -> String {
        self.browser
            .cmd("GET", &self.path("/name"), None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    pub async fn click(&self) {
        self.browser.cmd("POST", &self.path("/click"), None).await;
    }

    /// Empties an input.
    pub async fn clear(&self) {
        self.browser.cmd("POST", &self.path("/clear"), None).await;
    }

    /// Focuses it and types `text` (may hold [`keys`], e.g. [`keys::ENTER`]).
    pub async fn send_keys(&self, text: &str) {
        self.browser
            .cmd("POST", &self.path("/value"), Some(json!({"text": text})))
            .await;
    }

    /// The first element inside this one matching `css`.
    pub async fn find(&self, css: &str) -> Element<'b> {
        let v = self
            .browser
            .cmd(
                "POST",
                &self.path("/element"),
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        self.browser.element(&v)
    }

    /// Every element inside this one matching `css`.
    pub async fn find_all(&self, css: &str) -> Vec<Element<'b>> {
        let v = self
            .browser
            .cmd(
                "POST",
                &self.path("/elements"),
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        v.as_array()
            .unwrap()
            .iter()
            .map(|e| self.browser.element(e))
            .collect()
    }

    /// A PNG of just this element, as `screens_dir()/name`.
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let v = self
            .browser
            .cmd("GET", &self.path("/screenshot"), None)
            .await;
        save_png(v.as_str().unwrap(), name)
    }

    /// `tag#id.class[name=..]`, for messages.
    pub async fn describe(&self) -> String {
        self.browser
            .execute(
                "const e = arguments[0]; let s = e.tagName.toLowerCase();\
                 if (e.id) s += '#' + e.id; if (e.className) s += '.' + e.className;\
                 const n = e.getAttribute('name'); if (n) s += '[name=' + n + ']';\
                 if (e.tagName === 'A') s += '[href=' + e.getAttribute('href') + ']'; return s;",
                vec![self.json()],
            )
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}
