//! `deploy/prometheus/` and the dashboard with the real tools: `promtool
//! check rules`; the rules' unit tests (`alerts.test.yml`: every alert seen
//! firing and not firing); and a real `prometheus` scraping an in-process
//! visor on loopback, against which every dashboard query and every alert
//! rule is evaluated. Each skips with a printed reason where the tool is
//! not installed (`apt-get install prometheus` brings both), except under
//! CI=true.

use super::*;

use std::net::SocketAddr;

use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};

/// `promtool ARGS FILE`, or `None` where promtool is not installed.
fn promtool(args: &[&str], file: &Path) -> Option<Output> {
    match run_bounded(
        Command::new("promtool").args(args).arg(file),
        Duration::from_secs(60),
    ) {
        Ok(out) => Some(out),
        Err(e) => missing("promtool", &e, "apt-get install prometheus"),
    }
}

#[test]
fn promtool_accepts_the_rules() {
    let Some(out) = promtool(&["check", "rules"], &deploy().join("prometheus/alerts.yml")) else {
        return;
    };
    assert!(out.status.success(), "{}", said(&out));
}

/// The names of the alerts in `alerts.yml`.
fn alert_names() -> BTreeSet<String> {
    let rules = &yaml("prometheus/alerts.yml")[0];
    rules["groups"]
        .as_vec()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_vec().unwrap())
        .map(|r| r["alert"].as_str().unwrap().to_owned())
        .collect()
}

/// `alerts.test.yml` expects every alert of `alerts.yml` to fire at some
/// time and to stay quiet at another, and promtool agrees.
#[test]
fn every_alert_is_unit_tested_firing_and_not() {
    let names = alert_names();
    assert!(names.len() >= 16, "{names:?}");
    let tests = &yaml("prometheus/alerts.test.yml")[0];
    assert_eq!(tests["rule_files"][0].as_str(), Some("alerts.yml"));
    let (mut firing, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    for case in tests["tests"].as_vec().unwrap() {
        for t in case["alert_rule_test"].as_vec().unwrap() {
            let name = t["alertname"].as_str().unwrap().to_owned();
            assert!(names.contains(&name), "alerts.yml has no {name}");
            if t["exp_alerts"].as_vec().unwrap().is_empty() {
                quiet.insert(name);
            } else {
                firing.insert(name);
            }
        }
    }
    let never_fired: Vec<&String> = names.difference(&firing).collect();
    let never_quiet: Vec<&String> = names.difference(&quiet).collect();
    assert!(
        never_fired.is_empty() && never_quiet.is_empty(),
        "alerts.test.yml never sees these fire: {never_fired:?}; never quiet: {never_quiet:?}"
    );
    let Some(out) = promtool(
        &["test", "rules"],
        &deploy().join("prometheus/alerts.test.yml"),
    ) else {
        return;
    };
    assert!(out.status.success(), "{}", said(&out));
}

/// A `prometheus` of this test's own: 127.0.0.1 on a free port, a storage
/// folder of its own, scraping one visor every second with the alert
/// rules loaded. Killed, and its folder removed, on drop (a failed
/// assertion included).
struct Prometheus {
    child: std::process::Child,
    dir: PathBuf,
    url: String,
}

impl Prometheus {
    /// `None` (with the reason printed) where prometheus is not installed.
    fn start(visor: SocketAddr) -> Option<Prometheus> {
        if let Err(e) = run_bounded(
            Command::new("prometheus").arg("--version"),
            Duration::from_secs(30),
        ) {
            return missing("prometheus", &e, "apt-get install prometheus");
        }
        let dir = temp_dir("prometheus");
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {}\n\
                 scrape_configs:\n  - job_name: visor\n    static_configs:\n      - targets: [\"{visor}\"]\n",
                deploy().join("prometheus/alerts.yml").display()
            ),
        )
        .unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = std::fs::File::create(dir.join("log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Some(Prometheus {
            child,
            dir,
            url: format!("http://127.0.0.1:{port}"),
        })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// GET `path`: its status and body, or `None` while nothing answers.
    async fn get(&mut self, path: &str) -> Option<(StatusCode, Bytes)> {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("prometheus exited ({status}):\n{}", self.log());
        }
        let req = Request::get(format!("{}{path}", self.url))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(10), client().request(req))
            .await
            .ok()?
            .ok()?;
        let status = resp.status();
        let body = tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
            .await
            .ok()?
            .ok()?
            .to_bytes();
        Some((status, body))
    }

    /// The API's `data` for `path`, or its error.
    async fn api(&mut self, path: &str) -> Result<Value, String> {
        let (status, body) = self
            .get(path)
            .await
            .ok_or_else(|| format!("no answer to {path}"))?;
        let v: Value = serde_json::from_slice(&body)
            .map_err(|e| format!("{status} {e}: {}", String::from_utf8_lossy(&body)))?;
        match v["status"].as_str() {
            Some("success") => Ok(v["data"].clone()),
            _ => Err(format!("{status}: {} {}", v["errorType"], v["error"])),
        }
    }

    /// An instant query's result (its series), or Prometheus's error.
    async fn query(&mut self, expr: &str) -> Result<Vec<Value>, String> {
        let data = self
            .api(&format!("/api/v1/query?query={}", percent_encode(expr)))
            .await?;
        match data["resultType"].as_str() {
            Some("vector" | "matrix") => Ok(data["result"].as_array().unwrap().clone()),
            other => Err(format!("result type {other:?}")),
        }
    }

    /// Waits (at most `bound`) until `cond` holds on `expr`'s result.
    async fn wait_for(&mut self, expr: &str, bound: Duration, cond: impl Fn(&[Value]) -> bool) {
        let deadline = Instant::now() + bound;
        let mut last = Err(String::new());
        while Instant::now() < deadline {
            last = self.query(expr).await;
            if last.as_deref().is_ok_and(&cond) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "{expr}: not as wanted within {bound:?}: {last:?}\n{}",
            self.log()
        );
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `s` as a URL query value.
fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Some series of `result` has a finite value above 0.
fn positive(result: &[Value]) -> bool {
    result.iter().any(|s| {
        s["value"][1]
            .as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(|v| v.is_finite() && v > 0.0)
    })
}

/// A panel's expression as Grafana sends it with every variable at
/// "All": `$__rate_interval` as Grafana makes it for a 15 s scrape (four
/// scrapes: 1m), the dashboard's own variables as their `allValue`.
fn as_grafana_sends(expr: &str, dash: &Value) -> Result<String, String> {
    let mut e = expr.replace("$__rate_interval", "1m");
    let mut vars: Vec<(String, String)> = dash["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["type"] == "query")
        .map(|v| {
            let all = v["allValue"].as_str().unwrap_or_else(|| {
                panic!("variable {} has no allValue", v["name"]);
            });
            (v["name"].as_str().unwrap().to_owned(), all.to_owned())
        })
        .collect();
    // `$key` after `$keys`, were there both.
    vars.sort_by_key(|(name, _)| std::cmp::Reverse(name.len()));
    for (name, all) in &vars {
        e = e
            .replace(&format!("${{{name}}}"), all)
            .replace(&format!("${name}"), all);
    }
    match e.contains('$') {
        true => Err(format!("{expr}: a variable the dashboard does not define")),
        false => Ok(e),
    }
}

/// Panels whose first query must show traffic (a value above 0) after the
/// test's requests: what an operator opens the dashboard for.
const SHOW_TRAFFIC: &[&str] = &[
    "Requests by status",
    "Requests per model (top 10)",
    "Requests per key",
    "Tokens by kind (from upstream usage)",
    "Tokens per key (prompt + completion)",
    "Request duration p50 / p90 / p99",
    "Upstream first byte p50 / p90 / p99",
    "Upstream errors by kind",
    "Fallbacks by failed upstream and reason",
    "Requests limited (429) by key and limit",
    "Images by action (kept, described, stripped, aged out, capped, deduped, resized, hoisted)",
    "Describer: results, duration p90, background",
    "Trace spans by result",
    "Versions running",
    "Replicas scraped up",
];

/// Panels whose first query must show these values of a label.
const SHOW_LABELS: &[(&str, &str, &[&str])] = &[
    ("Requests per key", "key", &["agent", "tight"]),
    ("Tokens per key (prompt + completion)", "key", &["agent"]),
    (
        "Requests per model (top 10)",
        "model",
        &["gpt-4o-mini", "gpt-oss-120b", "fail-1"],
    ),
    ("Requests limited (429) by key and limit", "key", &["tight"]),
    (
        "Fallbacks by failed upstream and reason",
        "upstream",
        &["primary"],
    ),
];

/// Panels whose first query must return series (0 is a value) from the
/// start: gauges and counters visor shows before anything happens.
const SHOW_SERIES: &[&str] = &[
    "In-flight requests",
    "Circuit breakers",
    "Limits shared or per replica",
    "Store health",
    "Client connections",
    "Documents and audio by action",
];

/// A real Prometheus scrapes an in-process visor: every query of the
/// dashboard parses and evaluates (with its variables as Grafana sends
/// them), the traffic panels show the requests sent, and every alert rule
/// evaluates without error — the upstream error rate alert pending after
/// the 500s sent.
#[tokio::test]
async fn dashboard_and_alerts_on_a_real_prometheus() {
    let mock = MockUpstream::start(upstream).await;
    let visor = visor_with_everything(&mock, "").await;
    traffic(&visor, "before the first scrape").await;
    let Some(mut prom) = Prometheus::start(visor.addr) else {
        return;
    };
    let bound = Duration::from_secs(30);
    let deadline = Instant::now() + bound;
    while !matches!(prom.get("/-/ready").await, Some((StatusCode::OK, _))) {
        assert!(
            Instant::now() < deadline,
            "prometheus not ready within {bound:?}:\n{}",
            prom.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    prom.wait_for(r#"up{job="visor"} == 1"#, bound, |r| !r.is_empty())
        .await;
    // Counters move between two scrapes: rates above 0.
    traffic(&visor, "between scrapes").await;
    let sent = metric(&visor.metrics().await, "visor_requests_total", &[]).unwrap();
    prom.wait_for(r#"sum(visor_requests_total{job="visor"})"#, bound, |r| {
        r.first()
            .and_then(|s| s["value"][1].as_str()?.parse::<f64>().ok())
            .is_some_and(|v| v == sent)
    })
    .await;
    // And the spans of those requests, sent to the collector at least once
    // a second.
    prom.wait_for(
        r#"sum(rate(visor_telemetry_spans_total{result="exported"}[1m])) > 0"#,
        bound,
        |r| !r.is_empty(),
    )
    .await;

    let dash: Value = serde_json::from_str(&read("grafana/visor.json")).unwrap();
    let panels = dashboard_panels();
    let titles: Vec<&str> = panels
        .iter()
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    for t in SHOW_TRAFFIC
        .iter()
        .chain(SHOW_SERIES)
        .chain(SHOW_LABELS.iter().map(|(t, _, _)| t))
    {
        assert!(titles.contains(t), "no panel titled {t:?}: {titles:#?}");
    }
    let mut failed = Vec::new();
    let mut queries = 0;
    for panel in &panels {
        let title = panel["title"].as_str().unwrap();
        for (i, target) in panel["targets"].as_array().unwrap().iter().enumerate() {
            queries += 1;
            let expr = match as_grafana_sends(target["expr"].as_str().unwrap(), &dash) {
                Ok(expr) => expr,
                Err(e) => {
                    failed.push(format!("{title}: {e}"));
                    continue;
                }
            };
            match prom.query(&expr).await {
                Err(e) => failed.push(format!("{title}: {expr}: {e}")),
                Ok(r) if i == 0 && SHOW_TRAFFIC.contains(&title) && !positive(&r) => {
                    failed.push(format!("{title}: {expr}: no traffic shown: {r:?}"));
                }
                Ok(r) if i == 0 && SHOW_SERIES.contains(&title) && r.is_empty() => {
                    failed.push(format!("{title}: {expr}: no series"));
                }
                Ok(r) if i == 0 => {
                    for (_, label, want) in SHOW_LABELS.iter().filter(|(t, _, _)| *t == title) {
                        let got: BTreeSet<&str> = r
                            .iter()
                            .filter_map(|s| s["metric"][label].as_str())
                            .collect();
                        if !want.iter().all(|w| got.contains(w)) {
                            failed.push(format!(
                                "{title}: {expr}: {label} {got:?}, not all of {want:?}"
                            ));
                        }
                    }
                }
                Ok(_) => {}
            }
        }
    }
    assert!(queries >= 50, "{queries} queries");
    assert!(failed.is_empty(), "{}", failed.join("\n"));

    // The rules: all loaded, each evaluated without error.
    let names = alert_names();
    let deadline = Instant::now() + bound;
    loop {
        let groups = prom.api("/api/v1/rules").await.unwrap();
        let rules: Vec<&Value> = groups["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap())
            .collect();
        let loaded: BTreeSet<String> = rules
            .iter()
            .map(|r| r["name"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(loaded, names);
        let errors: Vec<String> = rules
            .iter()
            .filter(|r| r["health"] == "err")
            .map(|r| format!("{}: {}", r["name"], r["lastError"]))
            .collect();
        assert!(errors.is_empty(), "{}", errors.join("\n"));
        if rules.iter().all(|r| r["health"] == "ok") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "rules not all evaluated within {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A third of the requests to the mock failed (500): well above 5%.
    let deadline = Instant::now() + bound;
    loop {
        let alerts = prom.api("/api/v1/alerts").await.unwrap();
        let active: Vec<&str> = alerts["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["labels"]["alertname"].as_str().unwrap())
            .collect();
        assert!(
            !active.contains(&"VisorDown") && !active.contains(&"VisorTargetMissing"),
            "{active:?}"
        );
        if active.contains(&"VisorUpstreamErrorRate") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "VisorUpstreamErrorRate not pending within {bound:?}: {active:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
