//! `deploy/` kept true: every YAML and JSON file parses; every metric the
//! alert rules and the Grafana dashboard use exists on a live `/metrics`
//! after traffic that moves them; the Kubernetes manifests probe the right
//! endpoints, run as non-root on a read-only root with a writable data
//! volume, and outlast the drain; every visor config shipped in `deploy/`
//! loads. With the real tools (each skipped with a printed reason where it
//! is not installed, except under CI=true, where `.ci/run` installed it):
//! `promtool` checks the rules and runs their unit tests
//! (`deploy/prometheus/alerts.test.yml`), a real Prometheus scrapes a visor
//! and evaluates every dashboard query and alert rule
//! ([`prometheus`]), and `kubectl kustomize` renders both kustomizations
//! ([`kubernetes`]).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod kubernetes;
mod prometheus;

use crate::support;

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::Value;
use support::*;
use yaml_rust2::{Yaml, YamlLoader};

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(deploy().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn yaml(rel: &str) -> Vec<Yaml> {
    YamlLoader::load_from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else {
            out.push(p);
        }
    }
}

#[test]
fn every_yaml_and_json_file_parses() {
    let mut all = Vec::new();
    files(&deploy(), &mut all);
    let mut checked = 0;
    for p in all {
        let text = std::fs::read_to_string(&p).unwrap();
        match p.extension().and_then(|e| e.to_str()) {
            Some("yml" | "yaml") => {
                let docs = YamlLoader::load_from_str(&text)
                    .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                assert!(!docs.is_empty(), "{}", p.display());
            }
            Some("json") => {
                serde_json::from_str::<Value>(&text)
                    .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            }
            _ => continue,
        }
        checked += 1;
    }
    assert!(checked >= 14, "{checked} files");
}

/// Every `visor_*` name in a PromQL expression.
fn metric_names(expr: &str, out: &mut BTreeSet<String>) {
    let b = expr.as_bytes();
    let mut i = 0;
    while let Some(k) = expr[i..].find("visor_") {
        let start = i + k;
        let boundary =
            start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
        let mut end = start;
        while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'_') {
            end += 1;
        }
        if boundary {
            out.insert(expr[start..end].to_owned());
        }
        i = end;
    }
}

/// The dashboard's panels, those inside a row included (a collapsed row
/// holds its panels; an open one is followed by them). Rows themselves,
/// which query nothing, are left out.
fn dashboard_panels() -> Vec<Value> {
    fn walk(panels: &[Value], out: &mut Vec<Value>) {
        for p in panels {
            if p["type"] == "row" {
                if let Some(inner) = p["panels"].as_array() {
                    walk(inner, out);
                }
            } else {
                out.push(p.clone());
            }
        }
    }
    let dash: Value = serde_json::from_str(&read("grafana/visor.json")).unwrap();
    let mut out = Vec::new();
    walk(dash["panels"].as_array().unwrap(), &mut out);
    out
}

/// The expressions of the alert rules and of the dashboard.
fn used_metrics() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let rules = &yaml("prometheus/alerts.yml")[0];
    let mut alerts = 0;
    for group in rules["groups"].as_vec().unwrap() {
        for rule in group["rules"].as_vec().unwrap() {
            metric_names(rule["expr"].as_str().unwrap(), &mut names);
            alerts += 1;
        }
    }
    assert!(alerts >= 6);
    let dash: Value = serde_json::from_str(&read("grafana/visor.json")).unwrap();
    let mut exprs = 0;
    for panel in dashboard_panels() {
        for t in panel["targets"].as_array().unwrap() {
            metric_names(t["expr"].as_str().unwrap(), &mut names);
            exprs += 1;
        }
    }
    for v in dash["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"].as_str() {
            metric_names(q, &mut names);
        }
    }
    assert!(exprs >= 14);
    names
}

/// Chat answers with usage; a 500 for `fail-*` models; the describer's
/// answers for describer calls, but 401 for an image that ends with
/// [`REFUSED`]; and as an OTLP collector, an empty 200 to an export of
/// trace spans.
fn upstream(req: &Recorded) -> Reply {
    if req.uri.path() == "/v1/traces" {
        return Reply::Full {
            status: 200,
            headers: vec![("content-type", "application/x-protobuf".to_owned())],
            body: Bytes::new(),
        };
    }
    if is_describer_call(req) {
        let url = described_url(req);
        let (_, b64) = url.split_once(";base64,").unwrap();
        let image = base64_simd::STANDARD.decode_to_vec(b64).unwrap();
        if image.ends_with(REFUSED.as_bytes()) {
            return Reply::json(401, r#"{"error":{"message":"bad key"}}"#);
        }
        return describer_answer(req);
    }
    if String::from_utf8_lossy(&req.body).contains("\"fail-") {
        return Reply::json(500, r#"{"error":{"message":"boom"}}"#);
    }
    Reply::json(
        200,
        r#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}"#,
    )
}

/// Appended to an image (`png_data_url`) whose description the mock
/// refuses, as an upstream refuses a wrong credential.
const REFUSED: &str = "the describer's credential is refused";

/// The proxy key `agent` (no limit) and `tight` (one request a minute).
const AGENT_KEY: &str = "sk-deploy-agent";
const TIGHT_KEY: &str = "sk-deploy-tight";

/// A visor whose metrics all move: the describer, two named keys,
/// `fail-*` models routed to `primary` (the mock again, which answers them
/// 500) with the mock as its fallback, and traces sent to the mock as
/// their collector; `server`: its `[server]` keys.
async fn visor_with_everything(mock: &MockUpstream, server: &str) -> Visor {
    Visor::for_mock(
        mock,
        &format!(
            "[server]\n{server}\n[telemetry]\notlp_endpoint = \"{}\"\n{DESCRIBE}\n[[key]]\nname = \"agent\"\nkey = \"{AGENT_KEY}\"\n\
             [[key]]\nname = \"tight\"\nkey = \"{TIGHT_KEY}\"\nrequests_per_minute = 1\n\
             {}models = [\"fail-*\"]\nfallbacks = [\"mock\"]\n",
            mock.url(),
            mock.upstream_toml("primary")
        ),
    )
    .await
}

/// Traffic that moves the metrics the alerts and the dashboard read: an
/// answered chat (tokens, latency, first byte, context bytes), one in a
/// session, an image for a text-only model (described, replaced, saved;
/// `salt` makes it new), an upstream 500 after a fallback (errors,
/// retries, breakers), and a key over its limit (429).
async fn traffic(visor: &Visor, salt: &str) {
    let chat = |body: Bytes, key: &str| {
        let mut req = post_json(&visor.url("/v1/chat/completions"), body);
        req.headers_mut()
            .insert("authorization", format!("Bearer {key}").parse().unwrap());
        req
    };
    let (url, _) = png_data_url(salt);
    let (status, _, body) = send(chat(chat_with_images("gpt-oss-120b", &[url]), AGENT_KEY)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let hi = |model: &str| {
        Bytes::from(format!(
            r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#
        ))
    };
    let mut req = chat(hi("gpt-4o-mini"), AGENT_KEY);
    req.headers_mut()
        .insert("x-visor-session", "deploy".parse().unwrap());
    assert_eq!(send(req).await.0, 200);
    assert_eq!(send(chat(hi("fail-1"), AGENT_KEY)).await.0, 500);
    // The first of a minute may pass: two, so one is refused.
    let first = send(chat(hi("gpt-4o-mini"), TIGHT_KEY)).await.0;
    let second = send(chat(hi("gpt-4o-mini"), TIGHT_KEY)).await.0;
    assert!(
        first == 429 || second == 429,
        "over the limit: {first} {second}"
    );
}

/// The names on a `/metrics` text.
fn exposed(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn every_metric_in_the_alerts_and_the_dashboard_exists() {
    let used = used_metrics();
    let mock = MockUpstream::start(upstream).await;
    let visor = visor_with_everything(&mock, "header_timeout_secs = 0.2").await;
    traffic(&visor, "deploy").await;
    // The describer's credential refused (`visor_credential_refused_total`).
    let (url, _) = png_data_url(REFUSED);
    let mut req = post_json(
        &visor.url("/v1/chat/completions"),
        chat_with_images("gpt-oss-120b", &[url]),
    );
    req.headers_mut().insert(
        "authorization",
        format!("Bearer {AGENT_KEY}").parse().unwrap(),
    );
    assert_eq!(send(req).await.0, 200);
    // A connection that sends nothing, closed at the header timeout
    // (`visor_client_connections_closed_total`).
    let _silent = tokio::net::TcpStream::connect(visor.addr).await.unwrap();
    assert!(
        wait_metrics(&visor, Duration::from_secs(10), |m| {
            metric(m, "visor_client_connections_closed_total", &[]).is_some()
        })
        .await,
        "the silent connection was not closed"
    );
    // The spans of these requests sent to the collector (at least once a
    // second): `visor_telemetry_spans_total`.
    assert!(
        wait_metrics(&visor, Duration::from_secs(10), |m| {
            metric(m, "visor_telemetry_spans_total", &[("result", "exported")]).is_some()
        })
        .await,
        "no span exported"
    );
    let exposed = exposed(&visor.metrics().await);
    let missing: Vec<&String> = used.iter().filter(|n| !exposed.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "used by deploy/ but not on /metrics: {missing:?}"
    );
    // And the dashboard covers what an operator asks first.
    for needed in [
        "visor_requests_total",
        "visor_request_duration_seconds_bucket",
        "visor_upstream_first_byte_seconds_bucket",
        "visor_upstream_errors_total",
        "visor_images_total",
        "visor_bytes_saved_total",
        "visor_tokens_total",
        "visor_describe_total",
        "visor_store_up",
        "visor_session_history_messages_bucket",
        "visor_cache_tokens_total",
        "visor_cache_misses_total",
        "visor_retries_total",
        "visor_upstream_state",
        "visor_ratelimited_total",
        "visor_ratelimit_shared",
        "visor_ratelimit_local_checks_total",
        "visor_media_total",
        "visor_context_resent_bytes_total",
        "visor_client_connections",
        "visor_inspector_dropped_total",
        "visor_telemetry_spans_total",
        "visor_build_info",
    ] {
        assert!(used.contains(needed), "{needed} not used in deploy/");
    }
}

/// The alert rule named `name`.
fn alert(name: &str) -> Yaml {
    let rules = &yaml("prometheus/alerts.yml")[0];
    rules["groups"]
        .as_vec()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_vec().unwrap().iter())
        .find(|r| r["alert"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no alert {name} in prometheus/alerts.yml"))
        .clone()
}

/// PromQL without its whitespace, to compare expressions as written.
fn squeeze(expr: &str) -> String {
    expr.split_whitespace().collect()
}

/// The prompt-caching row: visor's read / readable ratio, its cache tokens
/// by kind, its misses by cause; the alert when visor itself broke a
/// cached prefix. And the series they select exist from the start (at 0):
/// `increase()` over a series that first appears at 1 would miss the
/// first broken prefix.
#[tokio::test]
async fn prompt_cache_panels_and_alert() {
    let dash: Value = serde_json::from_str(&read("grafana/visor.json")).unwrap();
    let top = dash["panels"].as_array().unwrap();
    let row = top
        .iter()
        .position(|p| p["type"] == "row" && p["title"] == "Prompt caching")
        .expect("a \"Prompt caching\" row");
    // The panels that follow the row, up to the next one.
    let under: Vec<&Value> = top[row + 1..]
        .iter()
        .take_while(|p| p["type"] != "row")
        .collect();
    let exprs: Vec<String> = under
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap())
        .map(|t| squeeze(t["expr"].as_str().unwrap()))
        .collect();
    let inst = r#"instance=~"$instance""#;
    for want in [
        format!(
            r#"sum(rate(visor_cache_tokens_total{{kind="read",{inst}}}[$__rate_interval]))/clamp_min(sum(rate(visor_cache_tokens_total{{kind="readable",{inst}}}[$__rate_interval])),1e-9)"#
        ),
        format!(r#"sumby(kind)(rate(visor_cache_tokens_total{{{inst}}}[$__rate_interval]))"#),
        format!(r#"sumby(cause)(rate(visor_cache_misses_total{{{inst}}}[$__rate_interval]))"#),
    ] {
        assert!(
            exprs.contains(&want),
            "no panel under the row queries {want}: {exprs:#?}"
        );
    }
    let ratio = under
        .iter()
        .find(|p| {
            p["targets"][0]["expr"]
                .as_str()
                .unwrap()
                .contains("kind=\"readable\"")
        })
        .unwrap();
    assert_eq!(ratio["fieldConfig"]["defaults"]["unit"], "percentunit");

    let rule = alert("VisorCacheBrokenByVisor");
    assert_eq!(
        squeeze(rule["expr"].as_str().unwrap()),
        r#"increase(visor_cache_misses_total{cause="visor"}[10m])>0"#
    );
    assert!(rule["for"].is_badvalue(), "fires on the first one");
    let description = rule["annotations"]["description"].as_str().unwrap();
    assert!(
        description.contains("never break") && description.contains("docs/caching.md"),
        "{description}"
    );

    let mock = MockUpstream::start(upstream).await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    let text = visor.metrics().await;
    let series: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' ').map(|(s, _)| s))
        .collect();
    for kind in ["readable", "read", "written"] {
        let s = format!(r#"visor_cache_tokens_total{{kind="{kind}"}}"#);
        assert!(
            series.contains(&s.as_str()),
            "{s} not on /metrics before traffic"
        );
    }
    for cause in ["first", "client", "visor", "expired", "provider"] {
        let s = format!(r#"visor_cache_misses_total{{cause="{cause}"}}"#);
        assert!(
            series.contains(&s.as_str()),
            "{s} not on /metrics before traffic"
        );
    }
}

fn config_loads(what: &str, toml: &str) -> visor::config::Config {
    visor::config::Config::from_toml(toml, Path::new(what), &|_| Some("set-in-test".to_owned()))
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// The `visor.toml` of the ConfigMap in `doc`.
fn configmap_toml(doc: &Yaml) -> &str {
    assert_eq!(doc["kind"].as_str(), Some("ConfigMap"));
    doc["data"]["visor.toml"].as_str().unwrap()
}

#[test]
fn kubernetes_manifests_probe_secure_and_drain() {
    let cfg = config_loads(
        "k8s configmap",
        configmap_toml(&yaml("k8s/configmap.yaml")[0]),
    );
    assert!(
        matches!(&cfg.store.backend, visor::config::StoreBackend::Redis(u) if u.starts_with("redis://")),
        "replicas share the store through Redis"
    );
    let dep = &yaml("k8s/deployment.yaml")[0];
    assert_eq!(dep["kind"].as_str(), Some("Deployment"));
    let pod = &dep["spec"]["template"]["spec"];
    let grace = pod["terminationGracePeriodSeconds"].as_i64().unwrap() as f64;
    assert!(
        grace > (cfg.server.drain_delay + cfg.server.drain_timeout).as_secs_f64(),
        "grace {grace} s must outlast the drain delay and the drain"
    );
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    let c = &pod["containers"][0];
    assert_eq!(
        c["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    assert_eq!(
        c["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/readyz")
    );
    assert_eq!(
        c["securityContext"]["readOnlyRootFilesystem"].as_bool(),
        Some(true)
    );
    assert!(!c["resources"]["requests"].is_badvalue());
    assert!(!c["resources"]["limits"]["memory"].is_badvalue());
    let mounts: Vec<&str> = c["volumeMounts"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|m| m["mountPath"].as_str().unwrap())
        .collect();
    assert!(
        mounts.contains(&cfg.server.data_dir.to_str().unwrap()),
        "data_dir {} is a writable volume: {mounts:?}",
        cfg.server.data_dir.display()
    );
    let secrets: Vec<&str> = c["env"]
        .as_vec()
        .unwrap()
        .iter()
        .filter_map(|e| e["valueFrom"]["secretKeyRef"]["name"].as_str())
        .collect();
    assert!(secrets.contains(&"visor-upstream-keys"), "{secrets:?}");
    for (file, kind) in [
        ("k8s/service.yaml", "Service"),
        ("k8s/hpa.yaml", "HorizontalPodAutoscaler"),
        ("k8s/pdb.yaml", "PodDisruptionBudget"),
        (
            "k8s/components/servicemonitor/servicemonitor.yaml",
            "ServiceMonitor",
        ),
        ("k8s/secret.example.yaml", "Secret"),
    ] {
        assert_eq!(yaml(file)[0]["kind"].as_str(), Some(kind), "{file}");
    }
    // The base applies on a cluster without the Prometheus Operator: its
    // ServiceMonitor is a component, added by an overlay.
    let base = &yaml("k8s/kustomization.yaml")[0];
    let listed: Vec<&str> = base["resources"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    for r in &listed {
        assert!(deploy().join("k8s").join(r).exists(), "{r}");
        assert_ne!(
            yaml(&format!("k8s/{r}"))[0]["kind"].as_str(),
            Some("ServiceMonitor"),
            "{r}"
        );
    }
    let component = &yaml("k8s/components/servicemonitor/kustomization.yaml")[0];
    assert_eq!(component["kind"].as_str(), Some("Component"));
    let overlay = &yaml("k8s-prometheus-operator/kustomization.yaml")[0];
    assert_eq!(overlay["resources"][0].as_str(), Some("../k8s"));
    assert_eq!(
        overlay["components"][0].as_str(),
        Some("../k8s/components/servicemonitor")
    );
    // Redis keeps its data across restarts: a claim, append-only.
    let redis = yaml("k8s/redis.yaml");
    let claim = redis
        .iter()
        .find(|d| d["kind"].as_str() == Some("PersistentVolumeClaim"))
        .expect("a PersistentVolumeClaim for Redis");
    let redis_dep = redis
        .iter()
        .find(|d| d["kind"].as_str() == Some("Deployment"))
        .unwrap();
    let spec = &redis_dep["spec"]["template"]["spec"];
    assert_eq!(
        spec["volumes"][0]["persistentVolumeClaim"]["claimName"].as_str(),
        claim["metadata"]["name"].as_str()
    );
    let args: Vec<&str> = spec["containers"][0]["args"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.windows(2).any(|w| w == ["--appendonly", "yes"]),
        "{args:?}"
    );
    assert_eq!(
        redis_dep["spec"]["strategy"]["type"].as_str(),
        Some("Recreate")
    );
    // The sidecar: the app's base URL on localhost, visor listening there.
    let sidecar = yaml("k8s/sidecar-example.yaml");
    let containers = sidecar[0]["spec"]["template"]["spec"]["containers"]
        .as_vec()
        .unwrap();
    let app_env = containers[0]["env"].as_vec().unwrap();
    assert!(
        app_env
            .iter()
            .any(|e| e["name"].as_str() == Some("OPENAI_BASE_URL")
                && e["value"].as_str() == Some("http://127.0.0.1:8787/v1"))
    );
    let side = config_loads("sidecar configmap", configmap_toml(&sidecar[1]));
    assert_eq!(side.server.listen.to_string(), "127.0.0.1:8787");
}

#[test]
fn compose_and_dockerfile() {
    let compose = &yaml("docker-compose.yml")[0];
    for service in ["visor", "redis", "prometheus", "grafana"] {
        assert!(!compose["services"][service].is_badvalue(), "{service}");
    }
    let cfg = config_loads("deploy/visor.compose.toml", &read("visor.compose.toml"));
    assert!(
        matches!(&cfg.store.backend, visor::config::StoreBackend::Redis(u) if u.starts_with("redis://"))
    );
    let grace = compose["services"]["visor"]["stop_grace_period"]
        .as_str()
        .unwrap();
    let grace: f64 = grace.trim_end_matches('s').parse().unwrap();
    assert!(grace > (cfg.server.drain_delay + cfg.server.drain_timeout).as_secs_f64());
    let docker = read("Dockerfile");
    for needed in [
        "USER visor",
        "EXPOSE 8787",
        "HEALTHCHECK",
        "/healthz",
        "COPY config/visor.toml",
    ] {
        assert!(docker.contains(needed), "Dockerfile lacks {needed}");
    }
    assert!(docker.matches("FROM ").count() >= 2, "multi-stage");
    // The build stage's Rust is the crate's own minimum (a newer crate in
    // the lock would not build on an older image).
    let manifest =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")).unwrap();
    let rust_version = manifest
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .map(|v| v.trim().trim_matches('"').to_owned())
        .expect("Cargo.toml names its rust-version");
    let from = docker
        .lines()
        .find(|l| l.starts_with("FROM rust:"))
        .expect("a rust build stage");
    assert!(
        from.starts_with(&format!("FROM rust:{rust_version}-")),
        "{from} — Cargo.toml needs Rust {rust_version}"
    );
    // The health check follows the port visor is told to listen on.
    let health = docker
        .lines()
        .find(|l| l.starts_with("HEALTHCHECK"))
        .unwrap();
    assert!(
        health.contains("${VISOR_PORT}") && !health.contains("8787"),
        "{health}"
    );
    let cmd = docker.lines().find(|l| l.starts_with("CMD")).unwrap();
    assert!(
        cmd.contains("exec visor serve") && cmd.contains("${VISOR_PORT}"),
        "{cmd}"
    );
    // The build context is the repository root: target/ and .git stay out.
    let ignore = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/.dockerignore"))
        .expect(".dockerignore at the repository root");
    for needed in ["target/", ".git/"] {
        assert!(
            ignore.lines().any(|l| l.trim() == needed),
            ".dockerignore lacks {needed}"
        );
    }
}

/// Whether this run must have every tool (`.ci/run` installs them).
fn under_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// `None`, with a printed reason, where `tool` is not installed (`how`
/// installs it); under CI that is a failure.
fn missing<T>(tool: &str, why: &std::io::Error, how: &str) -> Option<T> {
    assert!(
        !under_ci(),
        "{tool} is required under CI (.ci/run installs it): {why}"
    );
    println!("SKIPPED: {tool} not installed ({why}); {how}");
    None
}

/// Runs `cmd` to its end, within `bound` (killed and failed past it),
/// with its output collected. `Err` when it cannot be started.
fn run_bounded(cmd: &mut Command, bound: Duration) -> std::io::Result<Output> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let collect = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let stdout = collect(Box::new(child.stdout.take().unwrap()));
    let stderr = collect(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + bound;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} did not finish within {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Ok(Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    })
}

/// Its stdout and stderr, for a failure message.
fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
