//! `deploy/` kept true: every YAML and JSON file parses; every metric the
//! alert rules and the Grafana dashboard use exists on a live `/metrics`
//! after traffic that moves them; the Kubernetes manifests probe the right
//! endpoints, run as non-root on a read-only root with a writable data
//! volume, and outlast the drain; every visor config shipped in `deploy/`
//! loads; `promtool check rules` passes (skipped with a printed reason where
//! promtool is not installed, except under CI=true).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

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
/// answers for describer calls.
fn upstream(req: &Recorded) -> Reply {
    if is_describer_call(req) {
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

#[tokio::test]
async fn every_metric_in_the_alerts_and_the_dashboard_exists() {
    let used = used_metrics();
    let mock = MockUpstream::start(upstream).await;
    let visor = Visor::for_mock(&mock, DESCRIBE).await;
    // Traffic that moves them: an answered chat (tokens, latency, first
    // byte), one in a session, an image for a text-only model (described,
    // replaced, saved), an upstream 500 (errors).
    let (url, _) = png_data_url("deploy");
    let (status, _, _) = send(post_json(
        &visor.url("/v1/chat/completions"),
        chat_with_images("gpt-oss-120b", &[url]),
    ))
    .await;
    assert_eq!(status, 200);
    let mut req = post_json(
        &visor.url("/v1/chat/completions"),
        r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#,
    );
    req.headers_mut()
        .insert("x-visor-session", "deploy".parse().unwrap());
    assert_eq!(send(req).await.0, 200);
    let (status, _, _) = send(post_json(
        &visor.url("/v1/chat/completions"),
        r#"{"model":"fail-1","messages":[{"role":"user","content":"hi"}]}"#,
    ))
    .await;
    assert_eq!(status, 500);
    let text = visor.metrics().await;
    let exposed: BTreeSet<String> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_owned())
        .collect();
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

#[test]
fn promtool_accepts_the_rules() {
    let rules = deploy().join("prometheus/alerts.yml");
    match std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(&rules)
        .output()
    {
        Ok(out) => assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("promtool is required under CI (.ci/run installs it): {e}")
        }
        Err(e) => println!("SKIPPED: promtool not installed ({e}); apt-get install prometheus"),
    }
}
