//! Trust: the control plane needs credentials, peers need the cluster's certificate, tokens are
//! signed by a key the cluster makes and rotates itself, and a wiped authority can be set above
//! the fences the stores still hold.

mod support;

use std::time::{Duration, Instant};

use redis::AsyncCommands;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use support::cluster::{free_port, Cluster, Security, BIN};
use support::redis_server::RedisServer;

/// A client that trusts the test cluster's CA and sends `credential` (a role's token file), or
/// nothing.
fn client(cluster: &Cluster, credential: Option<&str>) -> reqwest::Client {
    let ca = std::fs::read(cluster.certs().join("ca.crt")).unwrap();
    let mut builder = reqwest::Client::builder()
        .use_rustls_tls()
        .add_root_certificate(reqwest::Certificate::from_pem(&ca).unwrap());
    if let Some(role) = credential {
        let secret =
            std::fs::read_to_string(cluster.certs().join(format!("{role}.token"))).unwrap();
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(
            reqwest::header::AUTHORIZATION,
            format!("Bearer {}", secret.trim()).parse().unwrap(),
        );
        builder = builder.default_headers(headers);
    }
    builder.build().unwrap()
}

async fn send(
    http: &reqwest::Client,
    method: Method,
    url: String,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut req = http.request(method, url).timeout(Duration::from_secs(30));
    if let Some(body) = body {
        req = req.json(&body);
    }
    let answer = req.send().await.expect("the node answers");
    let status = answer.status();
    (status, answer.json().await.unwrap_or(Value::Null))
}

/// The peer port of node `id`, read from its config.
fn peer_port(cluster: &Cluster, id: u64) -> u16 {
    let text = std::fs::read_to_string(&cluster.nodes[id as usize - 1].config).unwrap();
    let line = text.lines().find(|l| l.starts_with("peer = ")).unwrap();
    line.rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('"')
        .parse()
        .unwrap()
}

async fn term(cluster: &Cluster) -> u64 {
    let (_, status) = cluster.get(1, "/v1/cluster").await.unwrap();
    status["term"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_plane_needs_credentials_and_peers_need_the_cluster_certificate() {
    let cluster = Cluster::start_secured(Security::Tls, 3, "", |_| String::new(), &[]).await;
    let url = |path: &str| format!("{}{path}", cluster.url(1));
    let anonymous = client(&cluster, None);
    let app = client(&cluster, Some("client"));
    let admin = client(&cluster, Some("admin"));

    // Without a credential: every lock and operations call is 401; probes stay open.
    let snapshot_body = json!({ "format": "fencegate-snapshot/1", "revision": 0, "state": {} });
    for (method, path, body) in [
        (
            Method::POST,
            "/v1/locks/job",
            Some(json!({ "ttl_ms": 5000 })),
        ),
        (Method::DELETE, "/v1/leases/1", None),
        (Method::POST, "/v1/leases/1/keepalive", None),
        (Method::GET, "/v1/snapshot", None),
        (
            Method::POST,
            "/v1/snapshot/restore",
            Some(snapshot_body.clone()),
        ),
        (Method::POST, "/v1/token-keys", None),
    ] {
        let (status, answer) = send(&anonymous, method.clone(), url(path), body).await;
        assert_eq!(
            status,
            StatusCode::UNAUTHORIZED,
            "{method} {path}: {answer}"
        );
        assert_eq!(answer["error"], "unauthorized");
    }
    let (status, _) = send(&anonymous, Method::GET, url("/healthz"), None).await;
    assert_eq!(status, StatusCode::OK);

    // A client credential locks, but cannot run operations.
    let (status, grant) = send(
        &app,
        Method::POST,
        url("/v1/locks/job"),
        Some(json!({ "ttl_ms": 30000 })),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{grant}");
    for (method, path, body) in [
        (Method::GET, "/v1/snapshot", None),
        (Method::POST, "/v1/snapshot/restore", Some(snapshot_body)),
        (Method::POST, "/v1/revision/bump", Some(json!({ "by": 5 }))),
        (Method::POST, "/v1/token-keys", None),
    ] {
        let (status, answer) = send(&app, method.clone(), url(path), body).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{method} {path}: {answer}");
    }

    // The lease handle is the holder's secret: its number alone, or a guessed secret, releases
    // nothing (the same answer as for a lease that does not exist).
    let handle = grant["lease_id"].as_str().unwrap();
    let (number, secret) = handle.split_once('.').unwrap();
    assert_eq!(secret.len(), 32, "128 random bits: {handle}");
    for guess in [number.to_owned(), format!("{number}.{}", "0".repeat(32))] {
        let (status, answer) = send(
            &admin,
            Method::DELETE,
            url(&format!("/v1/leases/{guess}")),
            None,
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{guess}: {answer}");
        let (status, answer) = send(
            &app,
            Method::POST,
            url(&format!("/v1/leases/{guess}/keepalive")),
            None,
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{guess}: {answer}");
    }
    let (status, lock) = send(&app, Method::GET, url("/v1/locks/job"), None).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "the lock survived the guesses: {lock}"
    );
    assert_eq!(lock["revision"], grant["revision"]);
    let (status, answer) = send(
        &app,
        Method::DELETE,
        url(&format!("/v1/leases/{handle}")),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let (status, _) = send(&admin, Method::GET, url("/v1/snapshot"), None).await;
    assert_eq!(status, StatusCode::OK);

    // Raft is not on the API port at all, and the peer port refuses a caller without a
    // certificate of the cluster CA, or with one from another CA: forged votes move no term.
    let before = term(&cluster).await;
    let vote = json!({ "vote": { "leader_id": { "term": before + 1000, "node_id": 2 }, "committed": false }, "last_log_id": null });
    let (status, _) = send(&admin, Method::POST, url("/raft/vote"), Some(vote.clone())).await;
    assert_eq!(
        status,
        StatusCode::NOT_FOUND,
        "Raft RPCs are not served on the API port"
    );
    let peer = format!("https://127.0.0.1:{}/raft/vote", peer_port(&cluster, 1));
    let other_ca = tempfile::tempdir().unwrap();
    let made = std::process::Command::new(BIN)
        .args(["certs", "init", "--dir"])
        .arg(other_ca.path())
        .args(["--node", "9=127.0.0.1"])
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    let mut identity = std::fs::read(other_ca.path().join("node9.crt")).unwrap();
    identity.extend(std::fs::read(other_ca.path().join("node9.key")).unwrap());
    let stranger = reqwest::Client::builder()
        .use_rustls_tls()
        .add_root_certificate(
            reqwest::Certificate::from_pem(&std::fs::read(cluster.certs().join("ca.crt")).unwrap())
                .unwrap(),
        )
        .identity(reqwest::Identity::from_pem(&identity).unwrap())
        .build()
        .unwrap();
    let started = Instant::now();
    let mut attempts = 0;
    while attempts < 200 && started.elapsed() < Duration::from_secs(10) {
        attempts += 1;
        for caller in [&anonymous, &stranger] {
            let sent = caller
                .post(&peer)
                .json(&vote)
                .timeout(Duration::from_secs(5))
                .send()
                .await;
            assert!(
                sent.is_err(),
                "the peer port answered a caller without the cluster's certificate: {sent:?}"
            );
        }
    }
    assert_eq!(term(&cluster).await, before, "forged votes moved the term");
    // The cluster still works for those who hold credentials.
    let (status, answer) = send(
        &app,
        Method::POST,
        url("/v1/locks/job"),
        Some(json!({ "ttl_ms": 5000 })),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
}

/// Waits until node `id` lists key `kid` in `state` ("signing", "retired").
async fn wait_key(cluster: &Cluster, id: u64, kid: u64, state: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, keys) = cluster.get(id, "/v1/token-keys").await.unwrap();
        let found = keys["keys"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["kid"].as_u64() == Some(kid) && k[state] == true);
        if found {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "node {id}: key {kid} not {state}: {keys}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs FENCE `token` then SET `key` through a gateway; returns the error text or "OK".
async fn fenced_set(gateway: u16, token: &str, key: &str) -> String {
    let mut conn = redis::Client::open(format!("redis://127.0.0.1:{gateway}/"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let fenced: redis::RedisResult<String> =
        redis::cmd("FENCE").arg(token).query_async(&mut conn).await;
    if let Err(e) = fenced {
        return e.to_string();
    }
    match conn.set::<_, _, String>(key, "v").await {
        Ok(ok) => ok,
        Err(e) => e.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_rotate_old_tokens_verify_until_retired() {
    let redis = RedisServer::start();
    let gateways: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let sections = |id: u64| {
        format!(
            "\n[redis]\nlisten = \"127.0.0.1:{}\"\nupstream = \"{}\"\n\n[[redis.protect]]\npattern = \"rot:*\"\nmode = \"enforce\"\nresource = \"rot\"\n",
            gateways[id as usize - 1],
            redis.addr
        )
    };
    let cluster = Cluster::start_secured(Security::Tls, 3, "", sections, &[]).await;
    for port in &gateways {
        support::s3_server::wait_for_port(*port, Duration::from_secs(30));
    }
    let first = cluster.acquire(1, "rot", 60_000).await;
    let old = first["token"].as_str().unwrap().to_owned();
    assert_eq!(
        fencegate_core::Token::parse(&old).unwrap().key_id(),
        Some(1),
        "the cluster made key 1 and signs with it: {old}"
    );
    assert_eq!(fenced_set(gateways[1], &old, "rot:a").await, "OK");

    let (code, out) = cluster.cli(&["token-key", "rotate", "--endpoint", &cluster.endpoints()]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("\"kid\":2"), "{out}");
    for id in 1..=3 {
        wait_key(&cluster, id, 2, "signing").await;
    }
    cluster
        .release(1, first["lease_id"].as_str().unwrap())
        .await;
    let second = cluster.acquire(2, "rot", 60_000).await;
    let new = second["token"].as_str().unwrap().to_owned();
    assert_eq!(
        fencegate_core::Token::parse(&new).unwrap().key_id(),
        Some(2)
    );
    // Every node verifies both while key 1 is active.
    assert_eq!(fenced_set(gateways[2], &new, "rot:b").await, "OK");
    let stale = fenced_set(gateways[2], &old, "rot:c").await;
    assert!(
        stale.contains("FENCED"),
        "the old key still verifies, the fence decides: {stale}"
    );

    let (code, out) = cluster.cli(&[
        "token-key",
        "retire",
        "1",
        "--endpoint",
        &cluster.endpoints(),
    ]);
    assert_eq!(code, 0, "{out}");
    for id in 1..=3 {
        wait_key(&cluster, id, 1, "retired").await;
    }
    let refused = fenced_set(gateways[0], &old, "rot:d").await;
    assert!(
        refused.contains("BADFENCE") && refused.contains("retired"),
        "{refused}"
    );
    assert_eq!(fenced_set(gateways[0], &new, "rot:e").await, "OK");
    // The last signing key cannot be retired.
    let (code, out) = cluster.cli(&[
        "token-key",
        "retire",
        "2",
        "--endpoint",
        &cluster.endpoints(),
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("last active key"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_authority_is_started_above_the_fences_the_stores_hold() {
    let redis = RedisServer::start();
    let gateway = free_port();
    let section = |_: u64| {
        format!(
            "\n[redis]\nlisten = \"127.0.0.1:{gateway}\"\nupstream = \"{}\"\n\n[[redis.protect]]\npattern = \"wipe:*\"\nmode = \"enforce\"\nresource = \"wipe\"\n",
            redis.addr
        )
    };
    let mut direct = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    // The first authority's life: its tokens reach revision 501 and the store's fence follows.
    {
        let cluster = Cluster::start_configured(1, "", section, &[]).await;
        support::s3_server::wait_for_port(gateway, Duration::from_secs(30));
        let (status, bumped) = cluster
            .call(
                1,
                Method::POST,
                "/v1/revision/bump",
                Some(json!({ "by": 500 })),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{bumped}");
        let grant = cluster.acquire(1, "wipe", 60_000).await;
        assert_eq!(grant["revision"], 501);
        assert_eq!(
            fenced_set(gateway, grant["token"].as_str().unwrap(), "wipe:k").await,
            "OK"
        );
    }
    let written: String = direct.get("wipe:k").await.unwrap();

    // Its data is lost; a fresh authority starts at 1. Every write is refused as stale, and the
    // node names the gap instead of blaming the client.
    {
        let cluster = Cluster::start_configured(1, "", section, &[]).await;
        support::s3_server::wait_for_port(gateway, Duration::from_secs(30));
        let grant = cluster.acquire(1, "wipe", 60_000).await;
        assert_eq!(grant["revision"], 1);
        let refused = fenced_set(gateway, grant["token"].as_str().unwrap(), "wipe:k").await;
        // The client is told the authority is below the store, not that it lost its lock.
        assert!(
            refused.contains("FENCED")
                && refused.contains("the fence 501 of resource wipe is above every revision this cluster's authority has issued (1)")
                && refused.contains("fencegate snapshot bump 501"),
            "{refused}"
        );
        let (_, status) = cluster.get(1, "/v1/cluster").await.unwrap();
        assert_eq!(status["fence_above_authority"], 501, "{status}");
        let (_, metrics) = (
            (),
            reqwest::get(format!("{}/metrics", cluster.url(1)))
                .await
                .unwrap()
                .text()
                .await
                .unwrap(),
        );
        assert!(
            metrics.contains("fencegate_fence_above_authority 1"),
            "{metrics}"
        );
        assert_eq!(direct.get::<_, String>("wipe:k").await.unwrap(), written);

        // An operator resets the fence to the holder's token: its write passes, once.
        let (code, out) = cluster.cli(&[
            "fence",
            "reset",
            "wipe",
            "--store",
            "redis",
            "--current",
            "501",
            "--endpoint",
            &cluster.endpoints(),
        ]);
        assert_eq!(code, 0, "{out}");
        assert!(
            out.contains("\"to\":1") || out.contains("\"to\": 1"),
            "{out}"
        );
        let fence: String = direct.get("fencegate:fence:{wipe}").await.unwrap();
        assert_eq!(fence, "1");
        assert_eq!(
            fenced_set(gateway, grant["token"].as_str().unwrap(), "wipe:k").await,
            "OK"
        );
        let (_, status) = cluster.get(1, "/v1/cluster").await.unwrap();
        assert_eq!(status["fence_above_authority"], Value::Null, "{status}");
        let resets = support::audit::records(&cluster.data_dir(1).join("audit"))
            .into_iter()
            .filter(|r| r["reason"] == "fence_reset")
            .count();
        assert_eq!(resets, 1);
        // Put the store back where the wiped authority left it, for the next life.
        let _: () = direct.set("fencegate:fence:{wipe}", "501").await.unwrap();
        let _: () = direct.set("wipe:k", &written).await.unwrap();
    }
    assert_eq!(direct.get::<_, String>("wipe:k").await.unwrap(), written);

    // Started with initial_revision above the fence, its tokens pass.
    {
        let cluster = Cluster::start_configured(1, "initial_revision = 1000", section, &[]).await;
        support::s3_server::wait_for_port(gateway, Duration::from_secs(30));
        let grant = cluster.acquire(1, "wipe", 60_000).await;
        assert_eq!(grant["revision"], 1001, "{grant}");
        assert_eq!(
            fenced_set(gateway, grant["token"].as_str().unwrap(), "wipe:k").await,
            "OK"
        );
    }
}

/// A wiped authority below an S3 manifest fence: both nodes' gateways refuse every write (and
/// cache the fence); an operator's reset with the wrong `--current` changes nothing, the right
/// one appends one reset entry to the manifest log, leaves one audit record, and both gateways
/// accept again, also the one that did not run the reset and still cached the old fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_manifest_fence_is_reset_and_every_node_follows() {
    use support::s3_server::{run_client, wait_for_port, MotoServer};

    let moto = MotoServer::start();
    let log_entry = |position: u64| format!(".fencegate/log/vault/{position:020}");
    // The store's fence as a forged or long-gone authority left it: 999.
    let seeded = moto.direct(json!([
        {"op": "create_bucket", "bucket": "vault"},
        {"op": "put", "bucket": "vault", "key": log_entry(1), "body": r#"{"fence":999,"changes":[]}"#},
    ]));
    assert!(
        seeded.as_array().unwrap().iter().all(|r| r["ok"] == true),
        "{seeded}"
    );
    let ports = [free_port(), free_port()];
    let sections = |id: u64| {
        format!(
            "\n[s3]\nlisten = \"127.0.0.1:{}\"\nupstream = \"{}\"\n\
             upstream_access_key = \"gateway\"\nupstream_secret_env = \"S3_UPSTREAM_SECRET\"\n\
             clients_env = \"S3_CLIENTS\"\n\n\
             [[s3.protect]]\nbucket = \"vault\"\nmode = \"manifest\"\nresource = \"vault\"\n\n\
             [[s3.protect]]\nbucket = \"plain\"\nmode = \"object\"\nresource = \"objects\"\n",
            ports[id as usize - 1],
            moto.endpoint,
        )
    };
    let cluster = Cluster::start_configured(
        2,
        "",
        sections,
        &[
            ("S3_UPSTREAM_SECRET", "gateway-secret"),
            ("S3_CLIENTS", "AKIDVAULT:vault-secret"),
        ],
    )
    .await;
    for port in ports {
        wait_for_port(port, Duration::from_secs(30));
    }
    let s3 = |node: u64, steps: Value| {
        run_client(
            &format!("http://127.0.0.1:{}", ports[node as usize - 1]),
            "AKIDVAULT",
            "vault-secret",
            steps,
        )
    };
    let grant = cluster.acquire(1, "vault", 60_000).await;
    let token = grant["token"].as_str().unwrap().to_owned();
    let revision = grant["revision"].as_u64().unwrap();
    assert!(revision < 999, "{grant}");
    let put = |key: &str, body: &str| json!([{"op": "put", "bucket": "vault", "key": key, "body": body, "token": token}]);
    let get_k = |node: u64| s3(node, json!([{"op": "get", "bucket": "vault", "key": "k"}]));
    let stale = |node: u64| {
        support::audit::records(&cluster.data_dir(node).join("audit"))
            .iter()
            .filter(|r| r["store"] == "s3" && r["reason"] == "stale")
            .count()
    };

    // Both gateways refuse, and from now on hold fence 999 in their cached view.
    for node in [1, 2] {
        let answer = s3(node, put("k", "refused"));
        assert_eq!(answer[0]["status"], 412, "node {node}: {answer}");
        assert_eq!(answer[0]["code"], "FencingTokenStale", "node {node}");
    }
    assert_eq!(get_k(1)[0]["status"], 404, "nothing was written");
    assert_eq!((stale(1), stale(2)), (1, 1));
    let (_, status) = cluster.get(1, "/v1/cluster").await.unwrap();
    assert_eq!(status["fence_above_authority"], 999, "{status}");

    // Object mode has no one fence to reset; the reset says so and what to do instead.
    let (code, out) = cluster.cli(&[
        "fence",
        "reset",
        "objects",
        "--store",
        "s3",
        "--current",
        "999",
        "--endpoint",
        &cluster.endpoints_of(&[1]),
    ]);
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("each object carries its own fence") && out.contains("snapshot bump"),
        "{out}"
    );

    // The reset runs on node 1. The wrong --current changes nothing: no log entry, still refused.
    let reset = |current: &str| {
        fence_reset(
            &cluster,
            "s3",
            current,
            &["--endpoint", &cluster.endpoints_of(&[1])],
        )
    };
    assert_wrong_current_changes_nothing(reset("998"));
    let entry = |position: u64| {
        moto.direct(json!([{"op": "get", "bucket": "vault", "key": log_entry(position)}]))[0]
            .clone()
    };
    assert_eq!(
        entry(2)["ok"],
        false,
        "the wrong --current appended {}",
        entry(2)
    );
    let answer = s3(2, put("k", "refused"));
    assert_eq!(answer[0]["status"], 412, "{answer}");

    // The right one: one reset entry at the next position, fence 999 -> the holder's token.
    assert_reset_from_999_to(reset("999"), revision);
    let appended = entry(2);
    assert_eq!(
        appended["body"],
        format!(r#"{{"fence":{revision},"changes":[],"reset_to":{revision}}}"#),
        "{appended}"
    );

    // Both gateways still cached fence 999. Node 1's PUT re-reads the log before refusing and
    // finds the reset; node 2's DELETE (a commit planned on its cached view) does the same.
    let answer = s3(1, put("k", "first"));
    assert_eq!(answer[0]["ok"], true, "node 1: {answer}");
    let answer = s3(
        2,
        json!([{"op": "delete", "bucket": "vault", "key": "k", "token": token}]),
    );
    assert_eq!(answer[0]["ok"], true, "node 2: {answer}");
    assert_eq!(get_k(1)[0]["status"], 404, "node 2's delete committed");
    let answer = s3(2, put("k", "second"));
    assert_eq!(answer[0]["ok"], true, "node 2: {answer}");
    assert_eq!(get_k(1)[0]["body"], "second");
    assert_eq!(get_k(2)[0]["body"], "second");
    // No refusal after the reset.
    assert_eq!((stale(1), stale(2)), (1, 2));

    // Exactly one audit record of the reset, on the node that ran it; its report is cleared.
    assert_one_fence_reset(&cluster, &[1, 2], "s3", revision);
    let (_, status) = cluster.get(1, "/v1/cluster").await.unwrap();
    assert_eq!(status["fence_above_authority"], Value::Null, "{status}");
}

/// With the default security (TLS, credentials, the cluster's own key), a typed or forged token
/// is refused by all three gateways before any store I/O: no data, no fence, one `forged`
/// audit record each. A genuine token for another resource is refused the same way, as
/// `out_of_scope`, in all three stores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_gateway_refuses_unsigned_forged_and_out_of_scope_tokens_before_the_store() {
    use support::postgres_server::{cli, PgServer};
    use support::s3_server::{run_client, wait_for_port, MotoServer};

    let redis = RedisServer::start();
    let pg = PgServer::start();
    let (code, out, err) = cli(&["postgres", "install", "--dsn", &pg.dsn("postgres")]);
    assert_eq!(code, 0, "fencegate postgres install: {out}{err}");
    pg.psql_as(
        "postgres",
        "CREATE TABLE ledger (id int PRIMARY KEY, note text)",
    );
    let moto = MotoServer::start();
    let created = moto.direct(json!([{"op": "create_bucket", "bucket": "vault"}]));
    assert_eq!(created[0]["ok"], true, "{created}");
    let [redis_port, pg_port, s3_port] = [free_port(), free_port(), free_port()];
    let sections = |_: u64| {
        format!(
            "\n[redis]\nlisten = \"127.0.0.1:{redis_port}\"\nupstream = \"{}\"\n\n\
             [[redis.protect]]\npattern = \"vault:*\"\nmode = \"enforce\"\nresource = \"vault\"\n\n\
             [postgres]\nlisten = \"127.0.0.1:{pg_port}\"\nupstream = \"{}\"\nresource = \"vault\"\n\n\
             [s3]\nlisten = \"127.0.0.1:{s3_port}\"\nupstream = \"{}\"\n\
             upstream_access_key = \"gateway\"\nupstream_secret_env = \"S3_UPSTREAM_SECRET\"\n\
             clients_env = \"S3_CLIENTS\"\n\n\
             [[s3.protect]]\nbucket = \"vault\"\nprefix = \"\"\nresource = \"vault\"\n",
            redis.addr,
            pg.addr(),
            moto.endpoint,
        )
    };
    let cluster = Cluster::start_secured(
        Security::Tls,
        1,
        "",
        sections,
        &[
            ("S3_UPSTREAM_SECRET", "gateway-secret"),
            ("S3_CLIENTS", "AKIDVAULT:vault-secret"),
        ],
    )
    .await;
    for port in [redis_port, pg_port, s3_port] {
        wait_for_port(port, Duration::from_secs(30));
    }
    // The cluster has a key (one real acquire), so "forged" below is a wrong key, not no key.
    let real = cluster.acquire(1, "other", 10_000).await;
    assert!(
        fencegate_core::Token::parse(real["token"].as_str().unwrap())
            .unwrap()
            .is_signed()
    );

    let max = fencegate_core::Revision::MAX;
    let unsigned = format!("fg1~{max}~vault");
    let stranger_key =
        fencegate_core::TokenKey::new(1, b"a key this cluster never made....").unwrap();
    let forged = fencegate_core::Token::new(
        fencegate_core::Resource::new("vault").unwrap(),
        fencegate_core::Revision::new(max).unwrap(),
    )
    .signed(&stranger_key)
    .to_string();

    for token in [&unsigned, &forged] {
        // Redis: FENCE itself refuses the token.
        let answer = fenced_set(redis_port, token, "vault:k").await;
        assert!(answer.starts_with("BADFENCE"), "redis: {answer}");
        // PostgreSQL: the token as the session setting, then a write.
        let dsn = format!(
            "host=127.0.0.1 port={pg_port} user=postgres dbname=postgres options='-c fencegate.token={token}'"
        );
        let answer = match tokio_postgres::connect(&dsn, tokio_postgres::NoTls).await {
            Err(e) => e.to_string(),
            Ok((client, connection)) => {
                tokio::spawn(connection);
                match client
                    .execute("INSERT INTO ledger VALUES (1, 'forged')", &[])
                    .await
                {
                    Ok(n) => format!("inserted {n}"),
                    Err(e) => format!("{e:?}"),
                }
            }
        };
        assert!(
            answer.contains("forged") || answer.contains("unsigned"),
            "postgres: {answer}"
        );
        // S3: a PUT with the token.
        let results = run_client(
            &format!("http://127.0.0.1:{s3_port}"),
            "AKIDVAULT",
            "vault-secret",
            json!([{"op": "put", "bucket": "vault", "key": "k", "body": "forged", "token": token}]),
        );
        assert_eq!(results[0]["status"], 403, "s3: {results}");
    }

    // A real, current, correctly signed token for another resource is refused as out of scope
    // by every store's gateway: holding one lock does not let a client write under another.
    let other = real["token"].as_str().unwrap();
    let answer = fenced_set(redis_port, other, "vault:k").await;
    assert!(
        answer.starts_with("BADFENCE") && answer.contains("scope"),
        "redis: {answer}"
    );
    let dsn = format!(
        "host=127.0.0.1 port={pg_port} user=postgres dbname=postgres options='-c fencegate.token={other}'"
    );
    let (client, connection) = tokio_postgres::connect(&dsn, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let e = client
        .execute("INSERT INTO ledger VALUES (1, 'other')", &[])
        .await
        .unwrap_err();
    assert_eq!(e.code().map(|c| c.code()), Some("FG005"), "postgres: {e:?}");
    let results = run_client(
        &format!("http://127.0.0.1:{s3_port}"),
        "AKIDVAULT",
        "vault-secret",
        json!([{"op": "put", "bucket": "vault", "key": "k", "body": "other", "token": other}]),
    );
    assert_eq!(results[0]["status"], 403, "s3: {results}");
    assert!(
        results[0].to_string().contains("FencingTokenOutOfScope"),
        "s3: {results}"
    );

    // Nothing reached a store: no Redis key or fence key, no row, no fence row, no object.
    let mut direct = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys: Vec<String> = direct.keys("*").await.unwrap();
    assert!(
        keys.iter().all(|k| !k.contains("vault")),
        "redis has {keys:?}"
    );
    let rows = pg.psql_as(
        "postgres",
        "SELECT (SELECT count(*) FROM ledger) || '/' || (SELECT count(*) FROM fencegate.fences)",
    );
    assert_eq!(rows.trim(), "0/0", "postgres rows/fences");
    let got = moto.direct(json!([{"op": "get", "bucket": "vault", "key": "k"}]));
    assert_eq!(got[0]["ok"], false, "s3 object exists: {got}");

    // One audit record per refusal, each `forged`.
    let records = support::audit::records(&cluster.data_dir(1).join("audit"));
    let forged_by_store = |store: &str| {
        records
            .iter()
            .filter(|r| r["store"] == store && r["reason"] == "forged")
            .count()
    };
    for store in ["redis", "postgres", "s3"] {
        assert_eq!(forged_by_store(store), 2, "{store}: {records:?}");
        let out_of_scope: Vec<_> = records
            .iter()
            .filter(|r| r["store"] == store && r["reason"] == "out_of_scope")
            .collect();
        assert_eq!(out_of_scope.len(), 1, "{store}: {records:?}");
        assert_eq!(out_of_scope[0]["resource"], "other", "{store}");
    }
}

/// `fencegate postgres sync-keys` copies the cluster's keys into the store: from then on the
/// guard itself refuses a typed token, also on a connection that bypasses the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_refuses_typed_tokens_once_the_cluster_keys_are_synced() {
    use support::postgres_server::{cli, code as sqlstate};

    let pg = protected_ledger();
    let cluster = Cluster::start(1, "").await;
    let grant = cluster.acquire(1, "vault", 60_000).await;
    let token = grant["token"].as_str().unwrap();

    let (direct, connection) = tokio_postgres::connect(&pg.dsn("postgres"), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let typed =
        "BEGIN; SELECT fencegate.guard('fg1~999~vault'); INSERT INTO ledger VALUES (1); COMMIT";
    // Before the sync the store has no key: it cannot tell a typed token from a real one.
    direct.batch_execute(typed).await.unwrap();
    direct
        .batch_execute("DELETE FROM ledger")
        .await
        .unwrap_err();
    let _ = direct.batch_execute("ROLLBACK").await;

    let (code, out, err) = cli(&[
        "postgres",
        "sync-keys",
        "--dsn",
        &pg.dsn("postgres"),
        "--endpoint",
        &cluster.endpoints(),
    ]);
    assert_eq!(code, 0, "sync-keys: {out}{err}");
    assert!(out.contains("installed 1 token key"), "{out}");
    // A typed token with a higher revision: refused by the guard, nothing written, no fence moved.
    let e = direct
        .batch_execute(&typed.replace("VALUES (1)", "VALUES (2)"))
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "FG004");
    let _ = direct.batch_execute("ROLLBACK").await;
    // Tokenless: refused by the table's trigger.
    let e = direct
        .batch_execute("INSERT INTO ledger VALUES (3)")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "FG002");
    // The cluster's own token passes the guard... but 999 was already let in before the sync:
    // the fence is 999 and a real token below it is stale, as the store must say.
    let e = direct.batch_execute(&guarded(token, 4)).await.unwrap_err();
    assert_eq!(sqlstate(&e), "FG001");
    let _ = direct.batch_execute("ROLLBACK").await;
    let rows = pg.psql_as(
        "postgres",
        "SELECT string_agg(id::text, ',' ORDER BY id) FROM ledger",
    );
    assert_eq!(rows, "1", "only the write from before the sync");

    // Recovery: an operator resets the fence. The reset is a compare-and-set, so naming the
    // wrong current fence changes nothing...
    let fence = || {
        pg.psql_as(
            "postgres",
            "SELECT revision FROM fencegate.fences WHERE resource = 'vault'",
        )
    };
    let reset = |current: &str| {
        fence_reset(
            &cluster,
            "postgres",
            current,
            &[
                "--dsn",
                &pg.dsn("postgres"),
                "--endpoint",
                &cluster.endpoints(),
            ],
        )
    };
    assert_wrong_current_changes_nothing(reset("998"));
    assert_eq!(fence(), "999");
    // ...and the right one lowers it to the holder's token, so exactly that holder writes again.
    let revision = grant["revision"].as_u64().unwrap();
    assert_reset_from_999_to(reset("999"), revision);
    assert_eq!(fence(), revision.to_string());
    direct.batch_execute(&guarded(token, 4)).await.unwrap();
    assert_one_fence_reset(&cluster, &[1], "postgres", revision);
    // Never above the authority's revision: that would brick the resource again.
    let (code, out) = cluster.cli(&[
        "fence",
        "reset",
        "vault",
        "--store",
        "postgres",
        "--current",
        &revision.to_string(),
        "--to",
        "5000",
        "--dsn",
        &pg.dsn("postgres"),
        "--endpoint",
        &cluster.endpoints(),
    ]);
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("above the authority's revision"), "{out}");
}

/// A node whose `[postgres]` names the owner's DSN keeps the store's token keys in step with
/// the cluster's by itself: after the first key, a rotation and a retirement, the guard on a
/// direct connection judges with exactly the cluster's keys, with no `sync-keys` run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_keeps_the_store_keys_in_step_with_the_cluster() {
    use support::postgres_server::code as sqlstate;

    let pg = protected_ledger();
    let pg_port = free_port();
    let owner_dsn = pg.dsn("postgres");
    let section = |_: u64| {
        format!(
            "\n[postgres]\nlisten = \"127.0.0.1:{pg_port}\"\nupstream = \"{}\"\nresource = \"vault\"\ninstall_dsn_env = \"PG_OWNER_DSN\"\n",
            pg.addr()
        )
    };
    let cluster =
        Cluster::start_configured(1, "", section, &[("PG_OWNER_DSN", owner_dsn.as_str())]).await;
    let store_keys = || {
        pg.psql_as(
            "postgres",
            "SELECT coalesce(string_agg(kid || ':' || retired, ',' ORDER BY kid), '') FROM fencegate.token_keys",
        )
    };
    // The store follows the cluster within a few of the node's one-second checks.
    let wait_store = |want: &'static str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let have = store_keys();
            if have == want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "store keys {have:?}, want {want:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let first = cluster.acquire(1, "vault", 60_000).await;
    wait_store("1:false");

    let (direct, connection) = tokio_postgres::connect(&owner_dsn, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    // A typed token is refused by the store itself; the cluster's token writes.
    let e = direct
        .batch_execute(&guarded("fg1~999~vault", 1))
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "FG004");
    let _ = direct.batch_execute("ROLLBACK").await;
    let old_token = first["token"].as_str().unwrap().to_owned();
    direct.batch_execute(&guarded(&old_token, 2)).await.unwrap();

    // Rotate, then retire key 1: the store learns both without anyone running sync-keys.
    let (status, body) = cluster.call(1, Method::POST, "/v1/token-keys", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    wait_key(&cluster, 1, 2, "signing").await;
    wait_store("1:false,2:false");
    let (status, body) = cluster
        .call(1, Method::POST, "/v1/token-keys/1/retire", None)
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    wait_store("1:true,2:false");
    let e = direct
        .batch_execute(&guarded(&old_token, 3))
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "FG004", "a retired key's token");
    let _ = direct.batch_execute("ROLLBACK").await;
    let lease = first["lease_id"].as_str().unwrap();
    cluster.release(1, lease).await;
    let second = cluster.acquire(1, "vault", 60_000).await;
    let new_token = second["token"].as_str().unwrap();
    assert_eq!(
        fencegate_core::Token::parse(new_token).unwrap().key_id(),
        Some(2),
        "{new_token}"
    );
    direct.batch_execute(&guarded(new_token, 4)).await.unwrap();
    let rows = pg.psql_as(
        "postgres",
        "SELECT string_agg(id::text, ',' ORDER BY id) FROM ledger",
    );
    assert_eq!(rows, "2,4");
}

/// An operator-supplied key (id 0, here `token_key_file`) signs the node's tokens, and the
/// cluster then makes no key of its own. The snapshot does not hold key 0, so `postgres
/// sync-keys` alone has nothing to install and says how to proceed (it never empties the
/// store's keys); with `--config` naming the node's config it installs key 0, and the guard
/// accepts the node's tokens and refuses typed ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_keys_with_the_node_config_installs_the_operator_key() {
    use support::postgres_server::{cli, code as sqlstate};

    let pg = protected_ledger();
    let key_dir = tempfile::tempdir().unwrap();
    let key_file = key_dir.path().join("token.key");
    std::fs::write(
        &key_file,
        "an operator's own key, thirty-two bytes or more\n",
    )
    .unwrap();
    let cluster = Cluster::start(1, &format!("token_key_file = \"{}\"", key_file.display())).await;
    let grant = cluster.acquire(1, "vault", 60_000).await;
    let token = grant["token"].as_str().unwrap();
    assert_eq!(
        fencegate_core::Token::parse(token).unwrap().key_id(),
        Some(0),
        "{token}"
    );
    let (direct, connection) = tokio_postgres::connect(&pg.dsn("postgres"), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let sync = |extra: &[&str]| {
        let mut args = vec![
            "postgres",
            "sync-keys",
            "--dsn",
            &pg.dsn("postgres"),
            "--endpoint",
            &cluster.endpoints(),
        ]
        .into_iter()
        .map(str::to_owned)
        .collect::<Vec<_>>();
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        cli(&args)
    };

    let store_keys = || {
        pg.psql_as(
            "postgres",
            "SELECT coalesce(string_agg(kid || ':' || retired, ',' ORDER BY kid), '') FROM fencegate.token_keys",
        )
    };
    // The cluster's snapshot has no key to give: refused, the store's keys untouched.
    let (code, out, err) = sync(&[]);
    assert_ne!(code, 0, "sync-keys: {out}{err}");
    assert!(
        err.contains("no token keys to install, nothing changed") && err.contains("--config"),
        "{err}"
    );
    assert_eq!(store_keys(), "");

    // With the node's config, key 0 goes in and the node's token writes.
    let config = cluster.nodes[0].config.display().to_string();
    let (code, out, err) = sync(&["--config", &config]);
    assert_eq!(code, 0, "sync-keys --config: {out}{err}");
    assert!(
        out.contains("installed 1 token key(s) in the store: 0;"),
        "{out}"
    );
    assert_eq!(store_keys(), "0:false");
    direct.batch_execute(&guarded(token, 2)).await.unwrap();
    // A typed token is still refused by the store.
    let e = direct
        .batch_execute(&guarded("fg1~999~vault", 3))
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "FG004", "{e:?}");
    let _ = direct.batch_execute("ROLLBACK").await;
    let rows = pg.psql_as(
        "postgres",
        "SELECT string_agg(id::text, ',' ORDER BY id) FROM ledger",
    );
    assert_eq!(rows, "2");
}

/// `fencegate fence reset vault --store <store> --current <current>` and `args`: exit code
/// and output.
fn fence_reset(cluster: &Cluster, store: &str, current: &str, args: &[&str]) -> (i32, String) {
    let mut all = vec![
        "fence",
        "reset",
        "vault",
        "--store",
        store,
        "--current",
        current,
    ];
    all.extend_from_slice(args);
    cluster.cli(&all)
}

/// A reset with the wrong `--current` (998, the store holds 999) fails and says it changed
/// nothing.
fn assert_wrong_current_changes_nothing((code, out): (i32, String)) {
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("the store holds fence 999, not 998; nothing changed"),
        "{out}"
    );
}

/// A reset succeeded and reports the fence going from 999 to `revision`.
fn assert_reset_from_999_to((code, out): (i32, String), revision: u64) {
    assert_eq!(code, 0, "{out}");
    let answer: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (answer["from"].as_u64(), answer["to"].as_u64()),
        (Some(999), Some(revision)),
        "{out}"
    );
}

/// Exactly one `fence_reset` audit record among the logs of `nodes`, for `store`, naming the
/// fence it found (999) and the revision it reset to.
fn assert_one_fence_reset(cluster: &Cluster, nodes: &[u64], store: &str, revision: u64) {
    let resets: Vec<Value> = nodes
        .iter()
        .flat_map(|node| support::audit::records(&cluster.data_dir(*node).join("audit")))
        .filter(|r| r["reason"] == "fence_reset")
        .collect();
    assert_eq!(resets.len(), 1, "one audit record per reset: {resets:?}");
    assert_eq!(resets[0]["store"], store);
    assert_eq!(
        (resets[0]["fence"].as_u64(), resets[0]["revision"].as_u64()),
        (Some(999), Some(revision))
    );
}

/// A transaction that inserts `id` into `ledger` under `token`: the store's guard decides.
fn guarded(token: &str, id: u32) -> String {
    format!("BEGIN; SELECT fencegate.guard('{token}'); INSERT INTO ledger VALUES ({id}); COMMIT")
}

/// A PostgreSQL server with the fence schema installed and table `ledger` protected for
/// resource `vault`.
fn protected_ledger() -> support::postgres_server::PgServer {
    use support::postgres_server::{cli, PgServer};

    let pg = PgServer::start();
    let (code, out, err) = cli(&["postgres", "install", "--dsn", &pg.dsn("postgres")]);
    assert_eq!(code, 0, "install: {out}{err}");
    pg.psql_as("postgres", "CREATE TABLE ledger (id int PRIMARY KEY)");
    let (code, out, err) = cli(&[
        "postgres",
        "protect",
        "--dsn",
        &pg.dsn("postgres"),
        "--table",
        "ledger",
        "--resource",
        "vault",
    ]);
    assert_eq!(code, 0, "protect: {out}{err}");
    pg
}
