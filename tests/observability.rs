//! Issue 15, done-means 4: a real node's `/metrics` passes `promtool check metrics` after
//! traffic, the alert rules pass `promtool check rules`, and every metric the dashboard and the
//! alerts query is one `/metrics` exposes. Also `/healthz` and `/readyz` per gateway, the
//! upstream failure metrics, and `[log] format = "json"`.

mod support;

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::cluster::Cluster;
use support::gateway_node::GatewayNode;
use support::metrics::sample;
use support::redis_client::{cmd, connect};
use support::redis_gateway::RedisGateway;

/// `promtool`, from the Debian/Ubuntu package `prometheus`; a clear failure without it.
fn promtool() -> PathBuf {
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .map(|dir| dir.join("promtool"))
        .find(|p| p.is_file());
    found.unwrap_or_else(|| {
        panic!(
            "promtool is not installed; these tests need it: `apt-get install prometheus` \
             (Debian/Ubuntu; .ci/run installs it), or put promtool from a Prometheus release \
             on PATH"
        )
    })
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `GET path` on the node's API: status, content type, body.
async fn get(node: &GatewayNode, path: &str) -> (u16, String, String) {
    let reply = reqwest::get(format!("http://127.0.0.1:{}{path}", node.api))
        .await
        .unwrap();
    let status = reply.status().as_u16();
    let kind = reply
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, kind, reply.text().await.unwrap())
}

/// Scrapes until `series` satisfies `done` (bounded: 30 s); returns that scrape.
async fn scrape_until(node: &GatewayNode, series: &str, done: impl Fn(f64) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, _, text) = get(node, "/metrics").await;
        if sample(&text, series).is_some_and(&done) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{series} never as expected; last scrape:\n{text}\n{}",
            node.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs `promtool check metrics` on `text`: it must pass with no lint problem.
fn promtool_check_metrics(promtool: &Path, text: &str) {
    let mut check = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    check
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = check.wait_with_output().unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && report.trim().is_empty(),
        "promtool check metrics failed ({}):\n{report}\n--- the scrape:\n{text}",
        out.status
    );
}

/// Every sample name in a classic text exposition.
fn exposed_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_owned())
        .collect()
}

/// The metric names in a PromQL expression (or any text): every identifier that starts with
/// one of this project's prefixes. Grafana variables (`$instance`) and label values are not
/// identifiers of that form; an identifier's first character must not continue another word.
fn metric_names(expr: &str) -> Vec<String> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut names = Vec::new();
    for prefix in ["fencegate_", "process_"] {
        let mut from = 0;
        while let Some(at) = expr[from..].find(prefix) {
            let start = from + at;
            let before = expr[..start].chars().next_back();
            let end = expr[start..]
                .find(|c: char| !ident(c))
                .map_or(expr.len(), |n| start + n);
            if !before.is_some_and(|c| ident(c) || c == '$') {
                names.push(expr[start..end].to_owned());
            }
            from = end;
        }
    }
    names
}

/// Every PromQL string of the dashboard: panel targets' `expr` and variables' queries.
fn dashboard_exprs(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr" | "definition", serde_json::Value::String(s)) => out.push(s.clone()),
                    ("query", serde_json::Value::String(s)) if s.contains('(') => {
                        out.push(s.clone())
                    }
                    _ => dashboard_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| dashboard_exprs(v, out)),
        _ => {}
    }
}

/// The expressions of the alert rules: each `expr:` value, with its indented continuation
/// lines (block scalars).
fn alert_exprs(yaml: &str) -> Vec<String> {
    let mut exprs = Vec::new();
    let lines: Vec<&str> = yaml.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let indent = line.len() - line.trim_start().len();
        if let Some(rest) = line.trim_start().strip_prefix("expr:") {
            let mut expr = rest.trim().trim_start_matches(['|', '>', '-']).to_owned();
            i += 1;
            while i < lines.len() {
                let next = lines[i];
                let next_indent = next.len() - next.trim_start().len();
                if !next.trim().is_empty() && next_indent <= indent {
                    break;
                }
                expr.push(' ');
                expr.push_str(next.trim());
                i += 1;
            }
            exprs.push(expr);
        } else {
            i += 1;
        }
    }
    exprs
}

#[tokio::test]
async fn metrics_after_traffic_pass_promtool_and_expose_every_name_the_dashboard_and_alerts_use() {
    let promtool = promtool();
    let gw = RedisGateway::start("", &[]);
    let (mut old, _new) = gw.old_and_new().await;
    let mut none = connect(&gw.url()).await;
    for _ in 0..2 {
        let e = cmd::<()>(&mut old, &["SET", "balance", "99"])
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some("FENCED"));
    }
    assert!(cmd::<()>(&mut none, &["DEL", "balance"]).await.is_err());

    // Three clients hold connections (the harness's PING probe has closed its own).
    let text = scrape_until(
        &gw.node,
        "fencegate_gateway_connections{store=\"redis\"}",
        |v| v == 3.0,
    )
    .await;
    let (status, kind, _) = get(&gw.node, "/metrics").await;
    assert_eq!(status, 200);
    assert!(kind.starts_with("text/plain; version=0.0.4"), "{kind}");

    promtool_check_metrics(&promtool, &text);
    println!("$ curl gateway-node/metrics | promtool check metrics\n(no problems; exit 0)");

    // What the traffic must have counted.
    let value = |series: &str| {
        sample(&text, series).unwrap_or_else(|| panic!("{series} not exposed:\n{text}"))
    };
    let requests = value("fencegate_gateway_request_duration_seconds_count{store=\"redis\"}");
    assert!(requests >= 6.0, "{requests} requests counted:\n{text}");
    assert_eq!(
        value("fencegate_fenced_writes_refused_total{store=\"redis\",reason=\"stale\"}"),
        2.0
    );
    assert_eq!(
        value("fencegate_fenced_writes_refused_total{store=\"redis\",reason=\"missing\"}"),
        1.0
    );
    assert_eq!(
        value("fencegate_fenced_writes_applied_total{store=\"redis\"}"),
        1.0
    );
    assert_eq!(value("fencegate_build_info{version=\"0.1.0\"}"), 1.0);
    assert_eq!(value("fencegate_raft_has_leader"), 1.0);
    assert!(value("fencegate_raft_leader_changes_total") >= 1.0);
    assert_eq!(value("fencegate_gateway_upstream_up{store=\"redis\"}"), 1.0);
    assert!(value("fencegate_audit_fsync_seconds_count") >= 1.0);
    assert!(value("process_resident_memory_bytes") > 0.0);
    assert!(value("process_open_fds") > 0.0);
    for line in text.lines().filter(|l| {
        l.starts_with("fencegate_gateway_connections")
            || l.starts_with("fencegate_gateway_request_duration_seconds_count")
            || l.starts_with("fencegate_fenced_writes")
            || l.starts_with("fencegate_raft_")
            || l.starts_with("fencegate_build_info")
            || l.starts_with("fencegate_audit_fsync_seconds_count")
            || l.starts_with("process_resident")
    }) {
        println!("{line}");
    }

    // A leader with followers exposes what a one-node cluster cannot (replication lag).
    let cluster = Cluster::start(3, "").await;
    let leader = cluster.wait_for_leader(&cluster.ids()).await;
    cluster.acquire(leader, "ledger", 10_000).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let leader_text = loop {
        let text = reqwest::get(format!("{}/metrics", cluster.url(leader)))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let peers = text
            .lines()
            .filter(|l| l.starts_with("fencegate_raft_replication_lag{"))
            .count();
        if peers == 2 {
            break text;
        }
        assert!(Instant::now() < deadline, "no lag for 2 peers:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    promtool_check_metrics(&promtool, &leader_text);
    println!("$ curl leader/metrics | promtool check metrics\n(no problems; exit 0)");
    for line in leader_text.lines().filter(|l| {
        l.starts_with("fencegate_raft_") || l.starts_with("fencegate_authority_acquires")
    }) {
        println!("{line}");
    }

    // Every name the dashboard and the alerts query is exposed (by the gateway node or by the
    // cluster's leader).
    let mut exposed = exposed_names(&text);
    exposed.extend(exposed_names(&leader_text));
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("deploy/grafana/fencegate.json")).unwrap(),
    )
    .unwrap();
    let mut exprs = Vec::new();
    dashboard_exprs(&dashboard, &mut exprs);
    let alerts =
        alert_exprs(&std::fs::read_to_string(repo().join("deploy/prometheus/alerts.yml")).unwrap());
    assert!(exprs.len() >= 15, "dashboard expressions: {exprs:?}");
    assert!(alerts.len() >= 5, "alert expressions: {alerts:?}");
    let mut used = BTreeSet::new();
    for (origin, expr) in exprs
        .iter()
        .map(|e| ("deploy/grafana/fencegate.json", e))
        .chain(alerts.iter().map(|e| ("deploy/prometheus/alerts.yml", e)))
    {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{origin}: no metric in `{expr}`");
        for name in names {
            assert!(
                exposed.contains(&name),
                "{origin}: `{expr}` uses {name}, which /metrics does not expose; exposed: {exposed:?}"
            );
            used.insert(name);
        }
    }
    println!(
        "{} dashboard and {} alert expressions use {} metric names, all exposed: {used:?}",
        exprs.len(),
        alerts.len(),
        used.len()
    );
}

#[test]
fn the_name_parser_finds_names_in_promql() {
    assert_eq!(
        metric_names(
            "histogram_quantile(0.99, sum by (le) (rate(fencegate_audit_fsync_seconds_bucket{instance=~\"$instance\"}[5m]))) > 0.1 or fencegate_audit_queue_depth > 100"
        ),
        ["fencegate_audit_fsync_seconds_bucket", "fencegate_audit_queue_depth"]
    );
    assert_eq!(
        metric_names("rate(process_cpu_seconds_total[1m]) + x_fencegate_y + $fencegate_var"),
        ["process_cpu_seconds_total"]
    );
    let yaml = "  - alert: A\n    expr: |\n      sum(rate(fencegate_a_total[5m]))\n      > 1\n    for: 1m\n  - alert: B\n    expr: fencegate_b == 0\n";
    assert_eq!(
        alert_exprs(yaml),
        [" sum(rate(fencegate_a_total[5m])) > 1", "fencegate_b == 0"]
    );
}

#[test]
fn alert_rules_pass_promtool_check_and_test_rules() {
    let out = Command::new(promtool())
        .args(["check", "rules"])
        .arg(repo().join("deploy/prometheus/alerts.yml"))
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "promtool check rules failed:\n{report}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("$ promtool check rules deploy/prometheus/alerts.yml\n{report}");

    // And they fire on the series they are meant for (and not before): alerts_test.yml.
    let out = Command::new(promtool())
        .args(["test", "rules"])
        .arg(repo().join("deploy/prometheus/alerts_test.yml"))
        .output()
        .unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "promtool test rules failed:\n{report}"
    );
    println!("$ promtool test rules deploy/prometheus/alerts_test.yml\n{report}");
}

#[test]
fn the_dashboard_loads_as_a_grafana_dashboard() {
    let text = std::fs::read_to_string(repo().join("deploy/grafana/fencegate.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).unwrap();
    // What Grafana needs to import it: a title and uid, a schema version, panels with unique
    // ids, a type and a grid position; queries on the data source chosen at import.
    assert_eq!(dashboard["uid"], "fencegate");
    assert!(dashboard["title"].is_string());
    assert!(dashboard["schemaVersion"].as_u64().unwrap() >= 36);
    let panels = dashboard["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    let mut titles = Vec::new();
    for panel in panels {
        assert!(
            ids.insert(panel["id"].as_u64().unwrap()),
            "duplicate id {panel}"
        );
        assert!(panel["type"].is_string(), "{panel}");
        for key in ["h", "w", "x", "y"] {
            assert!(panel["gridPos"][key].is_u64(), "{panel}");
        }
        assert!(
            panel["gridPos"]["x"].as_u64().unwrap() + panel["gridPos"]["w"].as_u64().unwrap() <= 24
        );
        if panel["type"] != "row" {
            assert_eq!(panel["datasource"]["uid"], "${datasource}", "{panel}");
            assert!(!panel["targets"].as_array().unwrap().is_empty(), "{panel}");
        }
        titles.push(panel["title"].as_str().unwrap().to_owned());
    }
    for wanted in ["Raft health", "Leases and fences", "Refusals", "Gateways"] {
        assert!(
            titles.iter().any(|t| t == wanted),
            "no {wanted} row: {titles:?}"
        );
    }
}

#[tokio::test]
async fn an_unreachable_upstream_is_counted_and_reported_but_the_node_stays_ready() {
    let closed = support::cluster::free_port();
    let mut node = GatewayNode::start(
        &format!(
            "[redis]\nlisten = \"127.0.0.1:0\"\nupstream = \"127.0.0.1:{closed}\"\n[[redis.protect]]\npattern = \"*\"\nresource = \"*\"\n"
        ),
        &[],
    );
    let port = node.bound_port("redis gateway listening");
    let deadline = Instant::now() + Duration::from_secs(30);
    let ready = loop {
        let answer = get(&node, "/readyz").await;
        if answer.0 == 200 || Instant::now() > deadline {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(ready.0, 200, "{ready:?}\n{}", node.log_text());
    println!("/readyz {} {}", ready.0, ready.2);

    let (status, _, body) = get(&node, "/healthz").await;
    assert_eq!(status, 503, "{body}");
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    let redis = &body["gateways"]["redis"];
    assert_eq!(redis["listen"], format!("127.0.0.1:{port}"), "{body}");
    assert_eq!(redis["listening"], true, "{body}");
    assert_eq!(
        redis["upstream"]["addr"],
        format!("127.0.0.1:{closed}"),
        "{body}"
    );
    assert_eq!(redis["upstream"]["reachable"], false, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("redis upstream unreachable"),
        "{body}"
    );
    println!("/healthz {status} {body}");

    // A client's connection fails upstream: counted as a connect failure.
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    let mut con = client.get_multiplexed_async_connection().await;
    if let Ok(con) = &mut con {
        assert!(cmd::<()>(con, &["PING"]).await.is_err());
    }
    let text = scrape_until(
        &node,
        "fencegate_gateway_upstream_failures_total{store=\"redis\",kind=\"connect\"}",
        |v| v >= 1.0,
    )
    .await;
    assert_eq!(
        sample(&text, "fencegate_gateway_upstream_up{store=\"redis\"}"),
        Some(0.0)
    );
    let node_log = node.log_text();
    assert!(node_log.contains("upstream unavailable"), "{node_log}");
}

#[tokio::test]
async fn a_node_without_a_leader_is_not_ready() {
    // Join mode: the node waits to be added and knows no leader.
    let node = GatewayNode::start("[authority]\njoin = true\n", &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let answer = loop {
        let answer = reqwest::get(format!("http://127.0.0.1:{}/readyz", node.api)).await;
        if let Ok(reply) = answer {
            break (reply.status().as_u16(), reply.text().await.unwrap());
        }
        assert!(Instant::now() < deadline, "{}", node.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(answer.0, 503, "{answer:?}");
    assert!(answer.1.contains("no leader known yet"), "{answer:?}");
    println!("/readyz {} {}", answer.0, answer.1);
}

#[tokio::test]
async fn json_logs_are_one_object_per_line() {
    let mut node = GatewayNode::start("[log]\nformat = \"json\"\n", &[]);
    let log = node.log.clone();
    node.wait_ready("node started", Duration::from_secs(30), || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("node started")
    });
    let text = node.log_text();
    let mut started = None;
    for line in text.lines() {
        let event: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON object ({e}): {line}"));
        assert!(
            event["level"].is_string() && event["timestamp"].is_string(),
            "{line}"
        );
        if event["message"] == "node started" {
            started = Some(event);
        }
    }
    let started = started.unwrap();
    assert_eq!(started["node_id"], 1, "{started}");
    println!("{started}");
}

#[tokio::test]
async fn postgres_and_s3_gateways_count_connections_and_requests() {
    // PostgreSQL: one client connection, queries answered through the gateway.
    let requests = "fencegate_gateway_request_duration_seconds_count{store=\"postgres\"}";
    let pg = support::postgres_server::PgGateway::start("", &[]);
    let client = support::postgres_server::connect(&pg.dsn("postgres")).await;
    for _ in 0..3 {
        client.simple_query("SELECT 1").await.unwrap();
    }
    let text = scrape_until(&pg.node, requests, |v| v >= 3.0).await;
    assert_eq!(
        sample(&text, "fencegate_gateway_connections{store=\"postgres\"}"),
        Some(1.0),
        "{text}"
    );
    drop(client);
    scrape_until(
        &pg.node,
        "fencegate_gateway_connections{store=\"postgres\"}",
        |v| v == 0.0,
    )
    .await;
    println!("postgres: 3 queries counted, the connection gauge back to 0 once the client left");

    // A pipeline of a Query, a fast-path FunctionCall (`version()`, OID 89) and a Query: three
    // requests, each answered by its own ReadyForQuery.
    let mut call = 89i32.to_be_bytes().to_vec();
    call.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    let mut bytes = support::postgres_server::message(b'Q', b"SELECT 1\0");
    bytes.extend(support::postgres_server::message(b'F', &call));
    bytes.extend(support::postgres_server::message(b'Q', b"SELECT 2\0"));
    let replies = support::postgres_server::pipeline_replies(pg.port, "", &bytes);
    assert_eq!(replies.matches('Z').count(), 3, "{replies}");
    let text = scrape_until(&pg.node, requests, |v| v >= 6.0).await;
    assert_eq!(sample(&text, requests), Some(6.0), "{text}");
    println!(
        "postgres: a pipelined Query, FunctionCall and Query counted as three requests ({replies})"
    );

    // S3: each HTTP request is one request; none stays open.
    let s3 = support::s3_gateway::S3Node::start();
    let results = s3.run(serde_json::json!([
        {"op": "put", "bucket": "ledger", "key": "plain/a", "body": "x"},
        {"op": "get", "bucket": "ledger", "key": "plain/a"},
    ]));
    assert!(results.iter().all(|r| r["ok"] == true), "{results:?}");
    let text = scrape_until(
        &s3.node,
        "fencegate_gateway_request_duration_seconds_count{store=\"s3\"}",
        |v| v >= 2.0,
    )
    .await;
    assert_eq!(
        sample(&text, "fencegate_gateway_connections{store=\"s3\"}"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "fencegate_gateway_upstream_up{store=\"s3\"}"),
        Some(1.0),
        "{text}"
    );
    println!("s3: requests counted, none in flight after");
}
