//! Bad input is refused with 400 and a reason; the CLI finds a live endpoint; config errors
//! name the line.

use crate::support::cluster::{free_port, Cluster, BIN};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

async fn raw(cluster: &Cluster, method: Method, path: &str, body: &str) -> (StatusCode, Value) {
    let answer = cluster
        .http
        .request(method, format!("{}{path}", cluster.url(1)))
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    let status = answer.status();
    (status, answer.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_400_with_a_reason_and_the_node_keeps_serving() {
    let cluster = Cluster::start(1, "max_ttl_ms = 60000").await;
    let long = format!("/v1/locks/{}", "x".repeat(257));
    let cases: Vec<(Method, String, &str, &str)> = vec![
        (
            Method::POST,
            "/v1/locks/bad%20name".into(),
            r#"{"ttl_ms":1000}"#,
            "character outside",
        ),
        (
            Method::POST,
            "/v1/locks/bad~name".into(),
            r#"{"ttl_ms":1000}"#,
            "character outside",
        ),
        (Method::POST, long, r#"{"ttl_ms":1000}"#, "257 bytes long"),
        (
            Method::POST,
            "/v1/locks/job".into(),
            r#"{"ttl_ms":0}"#,
            "ttl_ms must be from 1 to 60000",
        ),
        (
            Method::POST,
            "/v1/locks/job".into(),
            r#"{"ttl_ms":60001}"#,
            "ttl_ms must be from 1 to 60000",
        ),
        (
            Method::POST,
            "/v1/locks/job".into(),
            r#"{"ttl_ms":1000"#,
            "invalid JSON body",
        ),
        (
            Method::POST,
            "/v1/locks/job".into(),
            "",
            "invalid JSON body",
        ),
        (
            Method::POST,
            "/v1/locks/job".into(),
            r#"{"ttl":1000}"#,
            "unknown field `ttl`",
        ),
        (
            Method::POST,
            "/v1/locks/job".into(),
            r#"{"ttl_ms":"10s"}"#,
            "invalid type",
        ),
        (
            Method::POST,
            "/v1/locks/job".into(),
            r#"{"ttl_ms":1000,"holder":"a b"}"#,
            "holder must be",
        ),
        (
            Method::POST,
            "/v1/leases/abc/keepalive".into(),
            "",
            "not a lease handle",
        ),
        (
            Method::DELETE,
            "/v1/leases/-1".into(),
            "",
            "not a lease handle",
        ),
        (
            Method::GET,
            "/v1/locks/a%20b".into(),
            "",
            "character outside",
        ),
        (
            Method::POST,
            "/v1/snapshot/restore".into(),
            r#"{"format":"x","revision":1,"state":{}}"#,
            "invalid JSON body",
        ),
    ];
    for (method, path, body, reason) in cases {
        let (status, answer) = raw(&cluster, method.clone(), &path, body).await;
        assert_eq!(
            status,
            StatusCode::BAD_REQUEST,
            "{method} {path} {body}: {answer}"
        );
        assert_eq!(answer["error"], "bad_request");
        let message = answer["message"].as_str().unwrap();
        assert!(
            message.contains(reason),
            "{method} {path} {body}: {message:?} lacks {reason:?}"
        );
    }
    // An inconsistent snapshot never reaches the log (a log entry that cannot be applied would
    // stop the node).
    let orphan = json!({
        "format": "fencegate-snapshot/1", "revision": 5,
        "state": { "revision": 5, "last_lease_id": 1, "locks": { "a": { "lease_id": 9, "token": 3, "holder": null } },
                   "leases": {}, "requests": {} }
    });
    let (status, answer) = raw(
        &cluster,
        Method::POST,
        "/v1/snapshot/restore",
        &orphan.to_string(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert!(
        answer["message"]
            .as_str()
            .unwrap()
            .contains("lease 9 is missing"),
        "{answer}"
    );

    let (status, answer) = raw(&cluster, Method::POST, "/v1/leases/424242/keepalive", "").await;
    assert_eq!(
        (status, answer["error"].as_str()),
        (StatusCode::NOT_FOUND, Some("expired"))
    );
    let grant = cluster.acquire(1, "job", 1000).await;
    assert_eq!(grant["revision"], 1, "nothing above moved the revision");
    let (status, _) = cluster.get(1, "/healthz").await.unwrap();
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_tries_the_next_endpoint_and_follows_the_leader() {
    let cluster = Cluster::start(3, "").await;
    let dead = format!("http://127.0.0.1:{}", free_port());
    let endpoints = format!("{dead},{}", cluster.endpoints());
    let (code, out) = cluster.cli(&[
        "lock",
        "acquire",
        "cli:job",
        "--ttl",
        "5s",
        "--holder",
        "me",
        "--endpoint",
        &endpoints,
    ]);
    assert_eq!(code, 0, "{out}");
    let grant: Value = serde_json::from_str(&out).unwrap();
    let lease = grant["lease_id"].as_str().unwrap().to_owned();
    let (code, out) = cluster.cli(&["lock", "acquire", "cli:job", "--endpoint", &endpoints]);
    assert_eq!(code, 1, "a held lock exits 1: {out}");
    assert_eq!(
        serde_json::from_str::<Value>(out.lines().next().unwrap()).unwrap()["error"],
        "held"
    );
    let (code, out) = cluster.cli(&["lock", "status", "cli:job", "--endpoint", &endpoints]);
    assert_eq!(code, 0, "{out}");
    let status: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (status["holder"].as_str(), &status["revision"]),
        (Some("me"), &grant["revision"])
    );
    assert!(
        status.get("token").is_none(),
        "status must not reveal the holder's token"
    );
    let (code, out) = cluster.cli(&["lock", "keepalive", &lease, "--endpoint", &endpoints]);
    assert_eq!(
        (
            code,
            serde_json::from_str::<Value>(&out).unwrap()["ttl_ms"].as_u64()
        ),
        (0, Some(5000)),
        "{out}"
    );
    let (code, out) = cluster.cli(&["lock", "release", &lease, "--endpoint", &endpoints]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = cluster.cli(&["lock", "keepalive", &lease, "--endpoint", &endpoints]);
    assert_eq!(code, 1, "{out}");
    let (code, out) = cluster.cli(&["cluster", "status", "--endpoint", &endpoints]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["members"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
}

#[test]
fn check_config_names_the_line_of_an_error() {
    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "[node]\nid = 1\n\n[authority]\nheartbeat_ms = 100\nelection_timeout_mn_ms = 5\n",
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args(["check-config", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("line 6") && stderr.contains("unknown field `election_timeout_mn_ms`"),
        "{stderr}"
    );

    // The TLS files the shipped configs name, made the way their comments say.
    let certs = dir.path().join("certs");
    let made = std::process::Command::new(BIN)
        .args(["certs", "init", "--dir"])
        .arg(&certs)
        .args([
            "--node",
            "1=127.0.0.1",
            "--node",
            "2=127.0.0.1",
            "--node",
            "3=127.0.0.1",
        ])
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    for shipped in [
        "config/fencegate.toml",
        "config/gateway.toml",
        "config/fencegate.example.toml",
        "config/cluster/node1.toml",
        "config/cluster/node2.toml",
        "config/cluster/node3.toml",
    ] {
        // Relative paths (certs/...) are taken from the working directory; the secrets the
        // configs name by environment variable are set, as check-config requires.
        let out = std::process::Command::new(BIN)
            .args(["check-config", "--config"])
            .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(shipped))
            .current_dir(dir.path())
            .env("FENCEGATE_S3_UPSTREAM_SECRET", "an upstream secret")
            .env("FENCEGATE_S3_CLIENTS", "AKIDEXAMPLE:a-client-secret")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{shipped}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // Deployment configs: Compose nodes, and the Kubernetes template as each pod renders it.
    // The secrets they name by environment variable, as check-config requires.
    let key = [
        ("FENCEGATE_TOKEN_KEY", "a test secret of 32 or more bytes"),
        (
            "FENCEGATE_PG_DSN",
            "host=postgres user=postgres dbname=postgres",
        ),
        ("FENCEGATE_S3_UPSTREAM_SECRET", "upstream-secret"),
        ("FENCEGATE_S3_CLIENTS", "AKIABILLING:client-secret"),
    ];
    let manifest = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/kubernetes/fencegate.yaml"
    ))
    .unwrap();
    let template: String = manifest
        .split("node.toml.in: |\n")
        .nth(1)
        .unwrap()
        .split("---")
        .next()
        .unwrap()
        .lines()
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    // The containers mount the certificates at /etc/fencegate/tls.
    let mounted = |text: &str| text.replace("/etc/fencegate/tls", &certs.display().to_string());
    let mut configs = vec![];
    for ordinal in 0..3 {
        let rendered = dir.path().join(format!("pod{ordinal}.toml"));
        std::fs::write(
            &rendered,
            mounted(&template.replace("NODE_ID", &(ordinal + 1).to_string())),
        )
        .unwrap();
        configs.push(rendered);
    }
    for n in 1..=3 {
        let text = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join(format!("deploy/docker/node{n}.toml")),
        )
        .unwrap();
        let rendered = dir.path().join(format!("compose{n}.toml"));
        std::fs::write(&rendered, mounted(&text)).unwrap();
        configs.push(rendered);
    }
    for config in configs {
        let out = std::process::Command::new(BIN)
            .args(["check-config", "--config"])
            .arg(&config)
            .envs(key)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            config.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_signed_with_the_cluster_key() {
    let secret = "a cluster secret of at least 32 bytes";
    let cluster = Cluster::start_with_env(
        3,
        "token_key_env = \"FG_TEST_KEY\"",
        &[("FG_TEST_KEY", secret)],
    )
    .await;
    let grant = cluster.acquire(2, "signed:job", 5000).await;
    let token = fencegate_core::Token::parse(grant["token"].as_str().unwrap()).unwrap();
    assert_eq!(token.revision().get(), grant["revision"].as_u64().unwrap());
    let key = fencegate_core::TokenKey::new(0, secret.as_bytes()).unwrap();
    assert_eq!(token.verify(&key), Ok(()));
    let other = fencegate_core::TokenKey::new(0, b"some other cluster's secret, 32b").unwrap();
    assert!(token.verify(&other).is_err());
}

#[test]
fn a_node_refuses_to_start_without_its_configured_key() {
    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join("node.toml");
    let port = free_port();
    std::fs::write(
        &path,
        format!("[node]\napi = \"127.0.0.1:{port}\"\ndata_dir = \"{}\"\n[authority]\ntoken_key_env = \"FG_UNSET_KEY\"\n[security]\ninsecure = true\n", dir.path().join("d").display()),
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args(["serve", "--config"])
        .arg(&path)
        .env_remove("FG_UNSET_KEY")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("FG_UNSET_KEY is not set"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_acquire_returns_the_same_lease_and_token() {
    let cluster = Cluster::start(3, "").await;
    let body = json!({ "ttl_ms": 5000, "request_id": "retry-1" });
    // The retry may land on another node than the first attempt (forwarded to the leader).
    let (s1, first) = cluster
        .call(1, Method::POST, "/v1/locks/idem", Some(body.clone()))
        .await;
    let (s2, again) = cluster
        .call(2, Method::POST, "/v1/locks/idem", Some(body))
        .await;
    assert_eq!(
        (s1, s2),
        (StatusCode::OK, StatusCode::OK),
        "{first} {again}"
    );
    assert_eq!(
        first, again,
        "a retry must not take a second lease or token"
    );
    let other = json!({ "ttl_ms": 5000, "request_id": "retry-2" });
    let (status, held) = cluster
        .call(3, Method::POST, "/v1/locks/idem", Some(other))
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{held}");
    assert_eq!(held["revision"], first["revision"]);
    // The same request id for another resource is refused: it would take the index from the
    // first lease (whose retries would then get a second lease and token) and leave a state
    // that no longer restores.
    let (status, reused) = cluster
        .call(
            2,
            Method::POST,
            "/v1/locks/elsewhere",
            Some(json!({ "ttl_ms": 5000, "request_id": "retry-1" })),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{reused}");
    assert_eq!(reused["error"], "request_id_in_use");
    let (status, again) = cluster
        .call(
            3,
            Method::POST,
            "/v1/locks/idem",
            Some(json!({ "ttl_ms": 5000, "request_id": "retry-1" })),
        )
        .await;
    assert_eq!((status, &again), (StatusCode::OK, &first));
    let (_, saved) = cluster.get(1, "/v1/snapshot").await.unwrap();
    let (status, body) = cluster
        .call(1, Method::POST, "/v1/snapshot/restore", Some(saved))
        .await;
    assert_eq!(status, StatusCode::OK, "the state still restores: {body}");
}

/// `lock list` shows every held lock with its revision, lease number, holder and ttl left, and
/// never a lease handle (the holder's credential); a released lock leaves the list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_list_shows_held_locks_without_lease_handles() {
    let cluster = Cluster::start(3, "").await;
    let leader = cluster.wait_for_leader(&[1, 2, 3]).await;
    let mut grants = Vec::new();
    for (resource, holder) in [("list:a", "worker-1"), ("list:b", "worker-2")] {
        let (status, grant) = cluster
            .call(
                leader,
                Method::POST,
                &format!("/v1/locks/{resource}"),
                Some(json!({ "ttl_ms": 30_000, "holder": holder })),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{grant}");
        grants.push(grant);
    }
    let endpoints = cluster.endpoints();
    let (code, out) = cluster.cli(&["lock", "list", "--endpoint", &endpoints]);
    assert_eq!(code, 0, "{out}");
    let listed: Value = serde_json::from_str(&out).unwrap();
    let locks = listed["locks"].as_array().expect("a locks array");
    assert_eq!(locks.len(), 2, "{listed}");
    for ((lock, grant), (resource, holder)) in locks
        .iter()
        .zip(&grants)
        .zip([("list:a", "worker-1"), ("list:b", "worker-2")])
    {
        assert_eq!(lock["resource"], resource, "{listed}");
        assert_eq!(lock["holder"], holder, "{listed}");
        assert_eq!(lock["revision"], grant["revision"], "{listed}");
        let handle = grant["lease_id"].as_str().unwrap();
        let number: u64 = handle.split('.').next().unwrap().parse().unwrap();
        assert_eq!(lock["lease"], number, "{listed}");
        assert!(!out.contains(handle), "lease handle leaked: {out}");
        let left = lock["ttl_ms"].as_u64().unwrap();
        assert!(left > 0 && left <= 30_000, "{listed}");
    }

    cluster
        .release(leader, grants[0]["lease_id"].as_str().unwrap())
        .await;
    let (code, out) = cluster.cli(&["lock", "list", "--endpoint", &endpoints]);
    assert_eq!(code, 0, "{out}");
    let listed: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(listed["locks"].as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed["locks"][0]["resource"], "list:b", "{listed}");
}

/// Past `max_leases` live leases an acquire gets 429 with what to do, the state does not
/// grow, and a released lease makes room again; a retried acquire of a held lease still gets
/// its lease back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_past_max_leases_are_refused_until_one_is_released() {
    let cluster = Cluster::start(3, "max_leases = 2").await;
    let a = cluster.acquire(1, "a", 60_000).await;
    let retried = json!({ "ttl_ms": 60_000, "request_id": "b-1" });
    let (status, b) = cluster
        .call(2, Method::POST, "/v1/locks/b", Some(retried.clone()))
        .await;
    assert_eq!(status, StatusCode::OK, "{b}");

    // Through a follower too: it forwards to the leader, which refuses.
    for via in [1, 2, 3] {
        let (status, refused) = cluster
            .call(
                via,
                Method::POST,
                "/v1/locks/c",
                Some(json!({ "ttl_ms": 60_000 })),
            )
            .await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{refused}");
        assert_eq!(refused["error"], "too_many_leases");
        assert!(
            refused["message"]
                .as_str()
                .is_some_and(|m| m.contains("max_leases (2)") && m.contains("release")),
            "{refused}"
        );
    }
    let (_, snapshot) = cluster.get(1, "/v1/snapshot").await.unwrap();
    assert_eq!(
        snapshot["state"]["leases"].as_object().map(|l| l.len()),
        Some(2)
    );
    assert!(snapshot["state"]["locks"].get("c").is_none());
    // The retry of an acquire already granted is not a new lease.
    let (status, again) = cluster
        .call(3, Method::POST, "/v1/locks/b", Some(retried))
        .await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(again, b);

    cluster.release(1, a["lease_id"].as_str().unwrap()).await;
    let c = cluster.acquire(3, "c", 60_000).await;
    assert!(c["revision"].as_u64() > b["revision"].as_u64());
    // The leader refused all three.
    let leader = cluster.wait_for_leader(&cluster.ids()).await;
    let metrics = cluster.metrics(leader).await;
    assert_eq!(
        crate::support::metrics::sample(&metrics, "fencegate_authority_leases_refused_total"),
        Some(3.0),
        "{metrics}"
    );
}
