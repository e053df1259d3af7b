//! The README's story, replayed with real processes on all three stores.
//!
//! A 3-node authority (one node also runs the Redis, PostgreSQL and S3 gateways), a real
//! redis-server, PostgreSQL and moto's S3 server, and three workers, each `fencegate lock run`
//! around the billing job of `examples/billing`:
//!
//! - A writes chunks 0 and 1, then freezes (SIGSTOP, job and runner) with chunk 2 prepared.
//! - A's lease expires; B acquires with a higher token, raises the fence in every store first.
//! - A's job wakes and sends chunk 2: refused by all three stores, each refusal audited.
//! - B writes chunks 2 to 4, then dies (SIGKILL) holding the lock; the lease expires.
//! - C acquires; while it writes chunks 5 to 9 the authority's leader is killed (SIGKILL).
//!   C's runner finds the new leader before its stop time and C finishes.
//!
//! Every step is awaited on an event (a job's output line, a process's exit, the cluster's
//! answer), never on a sleep. The table it prints is the demo (`examples/billing/run`).

mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use fencegate_s3::upstream::Upstream;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use support::cluster::{agreed_leader, free_port, Cluster, Security, BIN};
use support::postgres_server::{cli, PgServer};
use support::redis_server::RedisServer;
use support::s3_server::{wait_for_port, MotoServer};

const RESOURCE: &str = "billing:2026-09-28";
const DAY: &str = "2026-09-28";
const CHUNKS: u32 = 10;
const INVOICES: u32 = 5;
/// The story's 10 s lease, renewed every 3.3 s with a 2 s margin, scaled to a 6 s lease with a
/// 1 s margin: a renewal every 2 s, so after a leader dies the runner has at least 3 s to find
/// the next one (an election here takes 1 to 2 s).
const TTL: &str = "6s";
const MARGIN: &str = "1s";
/// Longest wait for any single step of the story.
const STEP: Duration = Duration::from_secs(30);

/// The three stores, the cluster and the gateway, plus direct clients to read the stores.
struct World {
    cluster: Cluster,
    _redis: RedisServer,
    _pg: PgServer,
    moto: MotoServer,
    pg_direct: tokio_postgres::Client,
    redis_direct: redis::aio::MultiplexedConnection,
    s3_direct: Upstream,
    http: reqwest::Client,
    /// Each node's gateway ports: Redis, PostgreSQL, S3.
    gateways: BTreeMap<u64, [u16; 3]>,
}

impl World {
    async fn start() -> Self {
        let redis = RedisServer::start();
        let pg = PgServer::start();
        let (code, out, err) = cli(&["postgres", "install", "--dsn", &pg.dsn("postgres")]);
        assert_eq!(code, 0, "fencegate postgres install: {out}{err}");
        pg.psql_as(
            "postgres",
            "CREATE TABLE invoices (day text, chunk int, line int, customer text, \
             amount_cents bigint, token text, PRIMARY KEY (day, chunk, line))",
        );
        let moto = MotoServer::start();
        let created = moto.direct(json!([{"op": "create_bucket", "bucket": "billing"}]));
        assert_eq!(created[0]["ok"], true, "{created}");

        // Every node runs the three gateways, as a deployment would; a worker writes through
        // one of them, chosen so that it is not the node whose death the story needs.
        let gateways: BTreeMap<u64, [u16; 3]> = (1..=3)
            .map(|id| (id, [free_port(), free_port(), free_port()]))
            .collect();
        let sections = |id: u64| {
            let [redis_port, pg_port, s3_port] = gateways[&id];
            format!(
                "\n[redis]\nlisten = \"127.0.0.1:{redis_port}\"\nupstream = \"{redis_up}\"\n\n\
                 [[redis.protect]]\npattern = \"billing:*\"\nmode = \"enforce\"\nresource = \"{RESOURCE}\"\n\n\
                 [postgres]\nlisten = \"127.0.0.1:{pg_port}\"\nupstream = \"{pg_up}\"\nresource = \"{RESOURCE}\"\n\n\
                 [s3]\nlisten = \"127.0.0.1:{s3_port}\"\nupstream = \"{s3_up}\"\n\
                 upstream_access_key = \"gateway\"\nupstream_secret_env = \"S3_UPSTREAM_SECRET\"\n\
                 clients_env = \"S3_CLIENTS\"\n\n\
                 [[s3.protect]]\nbucket = \"billing\"\nprefix = \"invoices/\"\nmode = \"manifest\"\nresource = \"{RESOURCE}\"\n",
                redis_up = redis.addr,
                pg_up = pg.addr(),
                s3_up = moto.endpoint,
            )
        };
        // Deployed as production runs: signed tokens from the replicated key, mutual TLS between
        // the nodes, HTTPS and credentials on the API.
        let cluster = Cluster::start_secured(
            Security::Tls,
            3,
            "",
            sections,
            &[
                ("S3_UPSTREAM_SECRET", "gateway-secret"),
                ("S3_CLIENTS", "AKIDBILLING:billing-secret"),
            ],
        )
        .await;
        for port in gateways.values().flatten() {
            wait_for_port(*port, STEP);
        }

        let (pg_direct, connection) =
            tokio_postgres::connect(&pg.dsn("postgres"), tokio_postgres::NoTls)
                .await
                .unwrap();
        tokio::spawn(connection);
        let redis_direct = redis::Client::open(redis.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let s3_direct = Upstream::new(&moto.endpoint, "us-east-1", "moto", "moto").unwrap();
        Self {
            cluster,
            _redis: redis,
            _pg: pg,
            moto,
            pg_direct,
            redis_direct,
            s3_direct,
            http: reqwest::Client::new(),
            gateways,
        }
    }

    /// The environment of a worker writing through node `id`'s gateways.
    fn job_env(&self, id: u64) -> Vec<(String, String)> {
        let [redis_port, pg_port, s3_port] = self.gateways[&id];
        [
            (
                "BILLING_PG",
                format!("host=127.0.0.1 port={pg_port} user=postgres dbname=postgres"),
            ),
            ("BILLING_REDIS", format!("redis://127.0.0.1:{redis_port}/")),
            ("BILLING_S3", format!("http://127.0.0.1:{s3_port}")),
            ("AWS_ACCESS_KEY_ID", "AKIDBILLING".into()),
            ("AWS_SECRET_ACCESS_KEY", "billing-secret".into()),
        ]
        .map(|(k, v)| (k.to_owned(), v))
        .to_vec()
    }

    /// Every node's audit records (refusals only), oldest first per node.
    fn refusals(&self) -> Vec<Value> {
        let mut all = Vec::new();
        for id in self.cluster.ids() {
            let mut records = support::audit::records(&self.cluster.data_dir(id).join("audit"));
            records.retain(|r| r.get("store").is_some());
            all.extend(records);
        }
        all
    }

    /// GET (or HEAD) a raw object straight from the S3 server: (status, body).
    async fn s3_raw(&self, key: &str, head: bool) -> (u16, String) {
        let path = Upstream::path_and_query(Some("billing"), Some(key), "");
        let method = if head { "HEAD" } else { "GET" };
        let mut headers = vec![("host".to_owned(), self.s3_direct.host_header())];
        headers.extend(self.s3_direct.sign(method, &path, &headers).unwrap());
        let mut request = self.http.request(
            method.parse().unwrap(),
            format!("{}{path}", self.moto.endpoint),
        );
        for (name, value) in headers.iter().filter(|(n, _)| n != "host") {
            request = request.header(name, value);
        }
        let answer = request.send().await.unwrap();
        (answer.status().as_u16(), answer.text().await.unwrap())
    }

    /// The resource's committed view as stored (S3 manifest mode), read behind the gateway's
    /// back: the checkpoint, if any, then each log entry after it until a free position.
    async fn s3_manifest(&self) -> Option<Value> {
        let (status, body) = self
            .s3_raw(&format!(".fencegate/checkpoint/{RESOURCE}"), false)
            .await;
        let mut view: Value = match status {
            200 => serde_json::from_str(&body).unwrap(),
            _ => serde_json::json!({"fence": 0, "position": 0, "keys": {}}),
        };
        let mut position = view["position"].as_u64().unwrap();
        loop {
            let (status, body) = self
                .s3_raw(
                    &format!(".fencegate/log/{RESOURCE}/{:020}", position + 1),
                    false,
                )
                .await;
            if status != 200 {
                break;
            }
            position += 1;
            let entry: Value = serde_json::from_str(&body).unwrap();
            let fence = entry["fence"].as_u64().unwrap();
            view["fence"] = fence.max(view["fence"].as_u64().unwrap()).into();
            view["position"] = position.into();
            for change in entry["changes"].as_array().unwrap() {
                let key = change["key"].as_str().unwrap().to_owned();
                let keys = view["keys"].as_object_mut().unwrap();
                match change.get("put") {
                    Some(put) => keys.insert(key, put.clone()),
                    None => keys.remove(&key),
                };
            }
        }
        (position > 0).then_some(view)
    }

    /// A logical S3 object resolved through the manifest, straight from the S3 server:
    /// (status, revision that committed it, body).
    async fn s3_object(&self, key: &str) -> (u16, Option<u64>, String) {
        let entry = self
            .s3_manifest()
            .await
            .and_then(|m| m["keys"].get(key).cloned());
        let Some(entry) = entry else {
            return (404, None, String::new());
        };
        let (status, body) = self
            .s3_raw(entry["physical"].as_str().unwrap(), false)
            .await;
        (status, entry["revision"].as_u64(), body)
    }

    /// The fence each store holds now: PostgreSQL's fence row, Redis's fence key, and the
    /// fence of the S3 manifest.
    async fn fences(&mut self) -> [String; 3] {
        let pg: Option<i64> = self
            .pg_direct
            .query_opt(
                "SELECT revision FROM fencegate.fences WHERE resource = $1",
                &[&RESOURCE],
            )
            .await
            .unwrap()
            .map(|row| row.get(0));
        let redis: Option<String> = redis::cmd("GET")
            .arg(format!("fencegate:fence:{{{RESOURCE}}}"))
            .query_async(&mut self.redis_direct)
            .await
            .unwrap();
        let s3 = self.s3_manifest().await.and_then(|m| m["fence"].as_u64());
        let show = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        [
            show(pg.map(|v| v.to_string())),
            show(redis),
            show(s3.map(|v| v.to_string())),
        ]
    }
}

fn chunk_key(n: u32) -> String {
    format!("invoices/{DAY}/chunk-{n:02}.json")
}

/// The billing example, built next to this test by `cargo test` (examples are built with the
/// tests) or `cargo build --example billing`.
fn billing_job() -> PathBuf {
    let me = std::env::current_exe().unwrap();
    let path = me
        .parent()
        .and_then(|deps| deps.parent())
        .unwrap()
        .join("examples/billing");
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build --example billing` (cargo test builds it too)",
        path.display()
    );
    path
}

/// What a worker's processes said: a job event (stdout) or a runner line (stderr), and when
/// it was read from the pipe.
struct Said {
    actor: &'static str,
    event: Value,
    at: Instant,
}

struct Worker {
    /// Taken while the test waits for it to exit.
    runner: Option<Child>,
    job: Option<Pid>,
    token: Option<String>,
}

impl Worker {
    fn runner_pid(&self) -> Pid {
        let runner = self.runner.as_ref().expect("the runner was not reaped");
        Pid::from_raw(runner.id().expect("runner is running") as i32)
    }

    fn revision(&self) -> u64 {
        let token = self.token.as_deref().expect("the worker got a token");
        token.split('~').nth(1).unwrap().parse().unwrap()
    }
}

/// One row of the story's table.
struct Row {
    at: Duration,
    /// For "chunk N already in every store" rows: N (consecutive ones are merged).
    present: Option<u32>,
    actor: String,
    event: String,
    token: String,
    fences: [String; 3],
    result: String,
}

struct Story {
    world: World,
    started: Instant,
    said: mpsc::UnboundedReceiver<Said>,
    tx: mpsc::UnboundedSender<Said>,
    workers: BTreeMap<&'static str, Worker>,
    rows: Vec<Row>,
    /// Every event seen, per actor, in order.
    seen: Vec<(&'static str, Value)>,
}

impl Story {
    fn new(world: World) -> Self {
        let (tx, said) = mpsc::unbounded_channel();
        Self {
            world,
            started: Instant::now(),
            said,
            tx,
            workers: BTreeMap::new(),
            rows: Vec::new(),
            seen: Vec::new(),
        }
    }

    /// Starts `fencegate lock run` around the billing job for worker `actor`.
    fn start_worker(&mut self, actor: &'static str, gateway: u64, job_args: &[&str]) {
        let mut runner = Command::new(BIN)
            .args(["lock", "run", RESOURCE, "--ttl", TTL, "--margin", MARGIN])
            .args(["--wait", "30s", "--holder", actor, "--endpoint"])
            .arg(self.world.cluster.endpoints())
            .arg("--")
            .arg(billing_job())
            .args(["--day", DAY, "--chunks", &CHUNKS.to_string()])
            .args(["--invoices", &INVOICES.to_string()])
            .args(job_args)
            .envs(self.world.job_env(gateway))
            .envs(self.world.cluster.client_env("client"))
            .env_remove("FENCEGATE_ENDPOINT")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start fencegate lock run");
        let stdout = runner.stdout.take().unwrap();
        let stderr = runner.stderr.take().unwrap();
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let event = serde_json::from_str(&line)
                    .unwrap_or_else(|_| json!({ "event": "output", "line": line }));
                let _ = tx.send(Said {
                    actor,
                    event,
                    at: Instant::now(),
                });
            }
        });
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let _ = tx.send(Said {
                    actor,
                    event: json!({ "event": "stderr", "line": line }),
                    at: Instant::now(),
                });
            }
        });
        self.workers.insert(
            actor,
            Worker {
                runner: Some(runner),
                job: None,
                token: None,
            },
        );
        self.note(
            actor,
            &format!("starts `fencegate lock run`, writing through node {gateway}'s gateways"),
            "",
        );
    }

    /// Adds a row, with the fences read from the stores right now.
    async fn row(&mut self, said: &Said, event: &str, result: &str, chunk: Option<u32>) {
        let actor = said.actor;
        let fences = self.world.fences().await;
        let token = self
            .workers
            .get(actor)
            .and_then(|w| w.token.as_deref())
            .map_or(String::new(), |t| t.split('~').nth(1).unwrap().to_owned());
        let present = (said.event["result"] == "present")
            .then_some(chunk)
            .flatten();
        let row = Row {
            present,
            at: said.at - self.started,
            actor: actor.to_owned(),
            event: event.to_owned(),
            token,
            fences,
            result: result.to_owned(),
        };
        println!(
            "{:>6.2}s  {:<9} {:<52} token {:<3} fences pg {} redis {} s3 {}  {}",
            row.at.as_secs_f64(),
            row.actor,
            row.event,
            row.token,
            row.fences[0],
            row.fences[1],
            row.fences[2],
            row.result
        );
        self.rows.push(row);
    }

    /// A row for something the test itself did (no fences read: nothing was written).
    fn note(&mut self, actor: &str, event: &str, result: &str) {
        let fences = self.rows.last().map_or_else(
            || ["-".into(), "-".into(), "-".into()],
            |r| r.fences.clone(),
        );
        println!(
            "{:>6.2}s  {:<9} {event} {result}",
            self.started.elapsed().as_secs_f64(),
            actor
        );
        self.rows.push(Row {
            present: None,
            at: self.started.elapsed(),
            actor: actor.to_owned(),
            event: event.to_owned(),
            token: String::new(),
            fences,
            result: result.to_owned(),
        });
    }

    /// Waits for the next event of `actor` satisfying `wanted`, recording every event seen on
    /// the way (from any actor) as rows.
    async fn until(&mut self, actor: &str, what: &str, wanted: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + STEP;
        loop {
            let said = match tokio::time::timeout_at(deadline, self.said.recv()).await {
                Ok(Some(said)) => said,
                _ => panic!(
                    "{actor}: no `{what}` within {STEP:?}; seen so far:\n{:#?}\nlogs in {}",
                    self.seen,
                    self.world.cluster.path().display()
                ),
            };
            self.record(&said).await;
            if said.actor == actor && wanted(&said.event) {
                return said.event;
            }
        }
    }

    async fn until_event(&mut self, actor: &str, name: &str) -> Value {
        self.until(actor, name, |e| e["event"] == name).await
    }

    /// Keeps a worker's event and turns it into a row.
    async fn record(&mut self, said: &Said) {
        self.seen.push((said.actor, said.event.clone()));
        let e = &said.event;
        let chunk = e["chunk"].as_u64().map(|n| n as u32);
        let results = |e: &Value| {
            let mut parts = Vec::new();
            for store in ["postgres", "redis", "s3"] {
                if let Some(r) = e["results"][store].as_str() {
                    match e["details"][store].as_str() {
                        Some(why) => parts.push(format!("{store} refused ({})", short(why))),
                        None => parts.push(format!("{store} {r}")),
                    }
                }
            }
            parts.join("; ")
        };
        match e["event"].as_str().unwrap_or_default() {
            "start" => {
                let worker = self.workers.get_mut(said.actor).unwrap();
                worker.job = Some(Pid::from_raw(e["pid"].as_i64().unwrap() as i32));
                worker.token = e["token"].as_str().map(str::to_owned);
                self.row(said, "acquired the lock; job starts", "", None)
                    .await;
            }
            "fence" => {
                self.row(said, "raises the fence in every store", &results(e), None)
                    .await
            }
            "chunk" if e["result"] == "present" => {
                let n = chunk.unwrap();
                self.row(
                    said,
                    &format!("chunk {n}: already in every store, skipped"),
                    "",
                    Some(n),
                )
                .await
            }
            "chunk" => {
                let n = chunk.unwrap();
                self.row(said, &format!("writes chunk {n}"), &results(e), Some(n))
                    .await
            }
            "paused" => {
                let n = chunk.unwrap();
                self.row(
                    said,
                    &format!("chunk {n} prepared; job stops (SIGSTOP)"),
                    "",
                    Some(n),
                )
                .await
            }
            "resumed" => {
                let n = chunk.unwrap();
                self.row(
                    said,
                    &format!("job wakes with chunk {n} in its buffers"),
                    "",
                    Some(n),
                )
                .await
            }
            "done" => self.row(said, "job finished", "exit 0", None).await,
            "stderr" => {
                let line = e["line"].as_str().unwrap_or_default();
                if let Some(said_by_runner) = line.strip_prefix("fencegate lock run: ") {
                    self.row(said, &format!("runner: {said_by_runner}"), "", None)
                        .await;
                } else {
                    println!("{} stderr: {line}", said.actor);
                }
            }
            _ => println!("{}: {e}", said.actor),
        }
    }

    /// Waits for worker `actor`'s runner to exit, recording what its processes say meanwhile.
    async fn runner_exit(&mut self, actor: &'static str) -> i32 {
        let mut runner = self.workers.get_mut(actor).unwrap().runner.take().unwrap();
        let exit = tokio::spawn(async move {
            tokio::time::timeout(STEP, runner.wait())
                .await
                .unwrap_or_else(|_| panic!("{actor}'s runner did not exit within {STEP:?}"))
                .unwrap()
        });
        let status = self.recording(exit).await;
        // Whatever it printed last.
        while let Ok(said) = self.said.try_recv() {
            self.record(&said).await;
        }
        status.code().unwrap_or(-1)
    }

    /// Awaits `task`, recording the workers' events meanwhile.
    async fn recording<T>(&mut self, mut task: tokio::task::JoinHandle<T>) -> T {
        loop {
            tokio::select! {
                done = &mut task => return done.unwrap(),
                said = self.said.recv() => {
                    let said = said.unwrap();
                    self.record(&said).await;
                }
            }
        }
    }

    fn job(&self, actor: &str) -> Pid {
        self.workers[actor].job.expect("the job has started")
    }

    /// The table, as markdown.
    fn table(&self) -> String {
        let mut s = String::from(
            "| t (s) | actor | event | token | fence pg | fence redis | fence s3 | result |\n\
             |---:|---|---|---:|---:|---:|---:|---|\n",
        );
        let mut i = 0;
        while i < self.rows.len() {
            let r = &self.rows[i];
            let mut event = r.event.clone();
            // Merge a run of "chunk N already in every store" rows of one actor.
            if let Some(first) = r.present {
                let mut last = first;
                while let Some(next) = self.rows.get(i + 1) {
                    if next.actor != r.actor || next.present != Some(last + 1) {
                        break;
                    }
                    last += 1;
                    i += 1;
                }
                if last > first {
                    event = format!("chunks {first}-{last}: already in every store, skipped");
                }
            }
            let f = &self.rows[i].fences;
            s.push_str(&format!(
                "| {:.1} | {} | {} | {} | {} | {} | {} | {} |\n",
                r.at.as_secs_f64(),
                r.actor,
                event,
                r.token,
                f[0],
                f[1],
                f[2],
                r.result
            ));
            i += 1;
        }
        s
    }
}

/// A store's refusal, shortened for the table to its code (the audit log has the rest).
fn short(why: &str) -> &str {
    why.split(':').next().unwrap_or(why)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_billing_story() {
    let world = World::start().await;
    let mut story = Story::new(world);

    // A: chunks 0 and 1, then frozen with chunk 2 prepared (job and runner: the whole worker).
    // A and B write through the gateways of two different followers: the fence lives in the
    // stores, so gateways need not agree on anything.
    let leader = story.world.cluster.wait_for_leader(&[1, 2, 3]).await;
    let followers: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != leader).collect();
    story.start_worker("worker-a", followers[0], &["--pause-before", "2"]);
    story.until_event("worker-a", "paused").await;
    kill(story.workers["worker-a"].runner_pid(), Signal::SIGSTOP).unwrap();
    story.note(
        "worker-a",
        "whole worker frozen (runner SIGSTOP too): no more renewals",
        "",
    );

    // B waits for the lock, gets it when A's lease expires, raises the fence, stops before
    // chunk 2 so that A's late write comes first.
    story.start_worker(
        "worker-b",
        followers[1],
        &["--pause-before", "2", "--pause-before", "5"],
    );
    story.until_event("worker-b", "start").await;
    let (a, b) = (
        story.workers["worker-a"].revision(),
        story.workers["worker-b"].revision(),
    );
    assert!(a < b, "B's token {b} must be above A's {a}");
    story.until_event("worker-b", "paused").await;

    // A's job wakes first (the worst case: its runner would otherwise stop it) and sends
    // chunk 2 with its old token.
    kill(story.job("worker-a"), Signal::SIGCONT).unwrap();
    story.note("worker-a", "job resumed (SIGCONT), runner still frozen", "");
    let late = story.until_event("worker-a", "chunk").await;
    assert_eq!(late["chunk"], 2, "{late}");
    for store in ["postgres", "redis", "s3"] {
        assert_eq!(late["results"][store], "refused", "{store}: {late}");
    }
    kill(story.workers["worker-a"].runner_pid(), Signal::SIGCONT).unwrap();
    let a_exit = story.runner_exit("worker-a").await;
    story.note(
        "worker-a",
        "runner resumed and exited",
        &format!("exit {a_exit}"),
    );
    // 3: the job's own exit (a store refused it); 124: the runner stopped it first.
    assert!(a_exit == 3 || a_exit == 124, "worker A exited {a_exit}");

    // B writes chunks 2 to 4 and dies holding the lock.
    kill(story.job("worker-b"), Signal::SIGCONT).unwrap();
    story
        .until("worker-b", "paused before chunk 5", |e| {
            e["event"] == "paused" && e["chunk"] == 5
        })
        .await;
    let b_runner = story.workers["worker-b"].runner_pid();
    let b_job = story.job("worker-b");
    kill(b_runner, Signal::SIGKILL).unwrap();
    killpg(b_job, Signal::SIGKILL).unwrap();
    let b_status = story.runner_exit("worker-b").await;
    assert_eq!(b_status, -1, "B's runner died of SIGKILL");
    story.note(
        "worker-b",
        "dies holding the lock (SIGKILL, runner and job)",
        "",
    );

    // C gets the lock when B's lease expires; the leader dies while C works.
    let leader = story.world.cluster.wait_for_leader(&[1, 2, 3]).await;
    let via = [1, 2, 3].into_iter().find(|id| *id != leader).unwrap();
    story.start_worker("worker-c", via, &["--chunk-time", "600ms"]);
    story.until_event("worker-c", "start").await;
    let c = story.workers["worker-c"].revision();
    assert!(b < c, "C's token {c} must be above B's {b}");
    story.until_event("worker-c", "fence").await;
    let leader = story.world.cluster.wait_for_leader(&[1, 2, 3]).await;
    assert_ne!(
        leader, via,
        "leadership moved to node {via}, whose gateways C writes through, before the kill"
    );
    story.world.cluster.kill(leader);
    let killed_at = Instant::now();
    story.note(
        "authority",
        &format!("leader (node {leader}) killed (SIGKILL)"),
        "",
    );
    let rest: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != leader).collect();
    let nodes = rest
        .iter()
        .map(|id| (*id, story.world.cluster.url(*id)))
        .collect();
    let election = tokio::spawn(agreed_leader(
        story.world.cluster.http.clone(),
        nodes,
        story.world.cluster.path().to_owned(),
    ));
    let new_leader = story.recording(election).await;
    story.note(
        "authority",
        &format!("node {new_leader} leads"),
        &format!("{:.1} s after the kill", killed_at.elapsed().as_secs_f64()),
    );
    story.until_event("worker-c", "done").await;
    let c_exit = story.runner_exit("worker-c").await;
    story.note(
        "worker-c",
        "runner released the lock and exited",
        &format!("exit {c_exit}"),
    );
    assert_eq!(c_exit, 0, "C must finish undisturbed by the failover");

    println!("\n{}", story.table());
    verify(&mut story, [a, b, c]).await;
}

/// What every store holds afterwards, and what the audit log says.
async fn verify(story: &mut Story, [a, b, c]: [u64; 3]) {
    let token = |rev: u64| format!("fg1~{rev}~{RESOURCE}");
    // The job stores the token it was given, which the authority signed: compare its unsigned
    // form (the signature differs per key, not per writer).
    let unsigned = |stored: &str| {
        fencegate_core::Token::parse(stored)
            .unwrap_or_else(|e| panic!("stored token {stored:?}: {e}"))
            .unsigned_form()
    };
    let writer = |n: u32| match n {
        0..=1 => a,
        2..=4 => b,
        _ => c,
    };
    let world = &mut story.world;

    // C ran without interruption: every chunk it wrote went through, none refused.
    let c_events: Vec<&Value> = story
        .seen
        .iter()
        .filter(|(actor, e)| {
            *actor == "worker-c" && e["event"] == "chunk" && e["results"].is_object()
        })
        .map(|(_, e)| e)
        .collect();
    assert_eq!(c_events.len(), 5, "C wrote chunks 5 to 9: {c_events:?}");

    // PostgreSQL: each chunk's rows exactly once, carrying its writer's token.
    let rows = world
        .pg_direct
        .query(
            "SELECT chunk, count(*), min(token), max(token) FROM invoices WHERE day = $1 \
             GROUP BY chunk ORDER BY chunk",
            &[&DAY],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), CHUNKS as usize, "every chunk in PostgreSQL");
    for row in rows {
        let n = row.get::<_, i32>(0) as u32;
        assert_eq!(row.get::<_, i64>(1), INVOICES as i64, "chunk {n} rows");
        assert_eq!(
            unsigned(&row.get::<_, String>(2)),
            token(writer(n)),
            "chunk {n} writer"
        );
        assert_eq!(
            unsigned(&row.get::<_, String>(3)),
            token(writer(n)),
            "chunk {n} writer"
        );
    }

    // Redis: one hash per chunk, written by the current holder.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("billing:{DAY}:chunk:*"))
        .query_async(&mut world.redis_direct)
        .await
        .unwrap();
    assert_eq!(keys.len(), CHUNKS as usize, "{keys:?}");
    for n in 0..CHUNKS {
        let hash: BTreeMap<String, String> = redis::cmd("HGETALL")
            .arg(format!("billing:{DAY}:chunk:{n:02}"))
            .query_async(&mut world.redis_direct)
            .await
            .unwrap();
        assert_eq!(
            hash.get("token").map(|t| unsigned(t)),
            Some(token(writer(n))),
            "redis chunk {n}"
        );
        assert_eq!(
            hash.len(),
            1 + INVOICES as usize,
            "redis chunk {n}: {hash:?}"
        );
    }

    // S3: one object per chunk, its body and its fence from the current holder.
    for n in 0..CHUNKS {
        let (status, fence, body) = world.s3_object(&chunk_key(n)).await;
        assert_eq!(status, 200, "s3 chunk {n}");
        assert_eq!(fence, Some(writer(n)), "s3 chunk {n} fence");
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            unsigned(body["token"].as_str().unwrap()),
            token(writer(n)),
            "s3 chunk {n} body"
        );
        assert_eq!(
            body["invoices"].as_array().map(Vec::len),
            Some(INVOICES as usize)
        );
    }

    // The audit log: exactly A's three refusals of chunk 2, one per store, and a sound chain.
    let records = world.refusals();
    println!(
        "\n| node | store | reason | token | fence | operation |\n|---|---|---|---:|---:|---|"
    );
    for r in &records {
        println!(
            "| {} | {} | {} | {} | {} | {} {} |",
            r["node"].as_str().unwrap_or_default(),
            r["store"].as_str().unwrap_or_default(),
            r["reason"].as_str().unwrap_or_default(),
            r["revision"],
            r["fence"],
            r["operation"]["command"].as_str().unwrap_or_default(),
            r["operation"]["objects"][0].as_str().unwrap_or_default(),
        );
    }
    println!();
    for r in &records {
        println!("audit: {r}");
    }
    let mut stores: Vec<&str> = records
        .iter()
        .map(|r| r["store"].as_str().unwrap())
        .collect();
    stores.sort();
    assert_eq!(stores, ["postgres", "redis", "s3"], "{records:#?}");
    for r in &records {
        assert_eq!(r["reason"], "stale", "{r}");
        assert_eq!(r["revision"].as_u64(), Some(a), "{r}");
        assert_eq!(r["fence"].as_u64(), Some(b), "{r}");
    }
    for id in world.cluster.ids() {
        let verify = std::process::Command::new(BIN)
            .args(["audit", "verify", "--dir"])
            .arg(world.cluster.data_dir(id).join("audit"))
            .output()
            .unwrap();
        assert!(
            verify.status.success(),
            "audit verify on node {id}: {}{}",
            String::from_utf8_lossy(&verify.stdout),
            String::from_utf8_lossy(&verify.stderr)
        );
    }
}
