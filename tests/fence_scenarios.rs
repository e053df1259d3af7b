//! One list of fencing scenarios, run against every store through a small adapter (issue 17;
//! openraft's `Suite::test_all` is the model). Each scenario checks the outcome the client
//! sees, the data the store holds and the exact number of new audit records, so "every store
//! passes the same scenarios" is visible in one place. Adding a store means adding one
//! adapter; per-protocol oddities stay in the per-store test files.
//!
//! Every store runs behind the gateways of a 3-node cluster (testkit's `Cluster`), so that the
//! authority's leader can fail under a writer; writes go through one node's gateway.

mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use fencegate_core::{Resource, Revision, Token, TokenKey};
use fencegate_testkit::postgres_server::PgServer;
use serde_json::json;
use support::cluster::Cluster;
use support::postgres_server::cli;
use support::redis_server::RedisServer;
use support::s3_server::{run_client, wait_for_port, MotoServer};

/// The cluster key every node of this file verifies tokens with (key id 0, from the env).
const SECRET: &str = "the scenario suite's key, 32 bytes or more";
const KEY_ENV: (&str, &str) = ("FG_TEST_KEY", SECRET);
/// Every adapter protects its keys for this resource.
const RESOURCE: &str = "job";

/// What the client saw.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    Applied,
    /// Refused; the store's own words (error code, SQLSTATE, HTTP status), for messages only:
    /// scenarios compare the store-independent reason of the audit record.
    Refused(String),
}

/// A store behind its gateway, as the scenarios see it.
trait Store: Sync {
    fn name(&self) -> &'static str;
    /// Writes `value` at `key` through the gateway in a new session presenting `token` (`None`:
    /// no token at all). A higher token raises the store's fence for the resource.
    fn write(&self, key: &str, value: &str, token: Option<&str>) -> Outcome;
    /// What the store holds at `key`, read without the gateway's help where the store allows.
    fn read(&self, key: &str) -> Option<String>;
    /// The cluster whose gateways the store runs behind.
    fn nodes(&self) -> &Nodes;
    /// Crashes the store and starts it again on its own data; `Err` says why this store's test
    /// server cannot.
    fn restart_store(&self) -> Result<(), &'static str>;
}

/// Per-store state shared by the scenarios: the store's fence is per resource, so every
/// scenario takes revisions above all earlier ones.
struct Ctx {
    key: TokenKey,
    revision: u64,
}

impl Ctx {
    fn new() -> Self {
        Self {
            key: TokenKey::new(0, SECRET.as_bytes()).unwrap(),
            revision: 100,
        }
    }

    /// A revision above every one used before.
    fn next(&mut self) -> u64 {
        self.revision += 10;
        self.revision
    }

    fn token(&self, resource: &str, revision: u64) -> String {
        signed(resource, revision, &self.key)
    }
}

fn signed(resource: &str, revision: u64, key: &TokenKey) -> String {
    Token::new(
        Resource::new(resource).unwrap(),
        Revision::new(revision).unwrap(),
    )
    .signed(key)
    .to_string()
}

type Scenario = fn(&dyn Store, &mut Ctx, &str) -> Audit;

/// Refusals a scenario expects in the audit log, by reason.
type Audit = Vec<(&'static str, u64)>;

/// The list every store runs. Scenarios with leases from the node's lease service come first:
/// its revisions start at 1, below the locally signed tokens of the others.
const SCENARIOS: &[(&str, Scenario)] = &[
    ("paused_holder_wakes_stale", paused_holder_wakes_stale),
    (
        "failover_of_the_authority_mid_write",
        failover_of_the_authority_mid_write,
    ),
    ("current_token_applies", current_token_applies),
    ("equal_token_applies", equal_token_applies),
    ("stale_token_is_refused", stale_token_is_refused),
    (
        "missing_malformed_forged_out_of_scope_refused_before_the_store",
        bad_tokens_are_refused_before_the_store,
    ),
    ("racing_writers_n_and_n_plus_1", racing_writers),
    (
        "store_restart_keeps_the_fence",
        store_restart_keeps_the_fence,
    ),
];

/// A holder that stops renewing (a GC pause, a SIGSTOP) loses its lease; the next holder's token
/// comes from the lease service and is higher; the woken holder's next write is refused.
fn paused_holder_wakes_stale(store: &dyn Store, ctx: &mut Ctx, key: &str) -> Audit {
    let leases = Leases::new(store.nodes().api());
    let a = leases.acquire("a", 1_000, 0);
    assert_eq!(store.write(key, "a:1", Some(&a.token)), Outcome::Applied);
    // A is paused: it sends no keepalive. B waits for the lock; the service grants it only
    // once A's lease has expired (the grant is the event waited for).
    let b = leases.acquire("b", 30_000, 20_000);
    assert!(
        b.revision > a.revision,
        "{} after {}",
        b.revision,
        a.revision
    );
    assert_eq!(store.write(key, "b:1", Some(&b.token)), Outcome::Applied);
    // A wakes and writes as if it still held the lock.
    let outcome = store.write(key, "a:2", Some(&a.token));
    assert!(matches!(outcome, Outcome::Refused(_)), "{outcome:?}");
    assert_eq!(store.read(key).as_deref(), Some("b:1"));
    leases.release(&b.lease_id);
    ctx.revision = ctx.revision.max(b.revision);
    vec![("stale", 1)]
}

/// The authority's leader is SIGKILLed while the holder writes. The holder's writes go on
/// applying through another node's gateway (token and fence need no authority), the survivors
/// elect a new leader, the holder's lease survives the failover (a keepalive passes) or has
/// expired; either way the next holder's revision is above the old one, and from its first
/// write on the old token is refused.
fn failover_of_the_authority_mid_write(store: &dyn Store, ctx: &mut Ctx, key: &str) -> Audit {
    let nodes = store.nodes();
    let all = nodes.ids();
    let leader = nodes.leader(&all);
    let via = *all.iter().find(|id| **id != leader).unwrap();
    nodes.set_via(via);
    let survivors: Vec<u64> = all.iter().copied().filter(|id| *id != leader).collect();
    let leases = Leases::new(nodes.api());
    let a = leases.acquire("a", 3_000, 0);
    assert_eq!(store.write(key, "a:0", Some(&a.token)), Outcome::Applied);

    nodes.kill(leader);
    // The holder writes while the survivors elect; the new leader is the event waited for.
    let elected = AtomicBool::new(false);
    let (new_leader, written) = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let started = Instant::now();
            let mut i = 1;
            loop {
                let done = elected.load(Ordering::SeqCst);
                let value = format!("a:{i}");
                assert_eq!(
                    store.write(key, &value, Some(&a.token)),
                    Outcome::Applied,
                    "write {i} of the holder during the failover"
                );
                if done {
                    return i;
                }
                i += 1;
                // Bounds the loop also when the wait for a leader panics (the scope joins it).
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "no leader elected within 60 s"
                );
            }
        });
        let new_leader = nodes.leader(&survivors);
        elected.store(true, Ordering::SeqCst);
        (new_leader, writer.join().unwrap())
    });
    assert_ne!(new_leader, leader);
    assert_eq!(store.read(key), Some(format!("a:{written}")));

    // The lease either came through the failover (then the holder still writes) or expired.
    let kept = leases.keepalive(&a.lease_id);
    if kept {
        let value = format!("a:{}", written + 1);
        assert_eq!(store.write(key, &value, Some(&a.token)), Outcome::Applied);
    }
    println!(
        "{:<10} failover: leader {leader} killed, node {new_leader} elected; {written} write(s) \
         applied meanwhile; lease kept through it: {kept}",
        store.name()
    );
    // The holder stops renewing; the next one is granted once its lease has expired.
    let b = leases.acquire("b", 30_000, 20_000);
    assert!(
        b.revision > a.revision,
        "revision {} granted after the failover, {} before it",
        b.revision,
        a.revision
    );
    assert_eq!(store.write(key, "b:1", Some(&b.token)), Outcome::Applied);
    let outcome = store.write(key, "a:late", Some(&a.token));
    assert!(matches!(outcome, Outcome::Refused(_)), "{outcome:?}");
    assert_eq!(store.read(key).as_deref(), Some("b:1"));
    leases.release(&b.lease_id);
    ctx.revision = ctx.revision.max(b.revision);
    // The old leader comes back for the scenarios after this one.
    nodes.restart(leader);
    vec![("stale", 1)]
}

fn current_token_applies(store: &dyn Store, ctx: &mut Ctx, key: &str) -> Audit {
    let revision = ctx.next();
    let token = ctx.token(RESOURCE, revision);
    assert_eq!(store.write(key, "v1", Some(&token)), Outcome::Applied);
    assert_eq!(store.read(key).as_deref(), Some("v1"));
    vec![]
}

fn equal_token_applies(store: &dyn Store, ctx: &mut Ctx, key: &str) -> Audit {
    let revision = ctx.next();
    let token = ctx.token(RESOURCE, revision);
    assert_eq!(store.write(key, "first", Some(&token)), Outcome::Applied);
    // A new session with the same token: equal is not stale.
    assert_eq!(store.write(key, "second", Some(&token)), Outcome::Applied);
    assert_eq!(store.read(key).as_deref(), Some("second"));
    vec![]
}

fn stale_token_is_refused(store: &dyn Store, ctx: &mut Ctx, key: &str) -> Audit {
    let current = ctx.next();
    let stale = ctx.token(RESOURCE, current - 1);
    assert_eq!(
        store.write(key, "current", Some(&ctx.token(RESOURCE, current))),
        Outcome::Applied
    );
    let outcome = store.write(key, "stale", Some(&stale));
    assert!(matches!(outcome, Outcome::Refused(_)), "{outcome:?}");
    assert_eq!(store.read(key).as_deref(), Some("current"));
    vec![("stale", 1)]
}

fn bad_tokens_are_refused_before_the_store(store: &dyn Store, ctx: &mut Ctx, key: &str) -> Audit {
    let revision = ctx.next();
    assert_eq!(
        store.write(key, "kept", Some(&ctx.token(RESOURCE, revision))),
        Outcome::Applied
    );
    // Each bad token names a revision above the fence: only the check before the store stops it.
    let stranger = TokenKey::new(0, b"a key this cluster never made, 32+").unwrap();
    let forged = signed(RESOURCE, revision + 5, &stranger);
    let out_of_scope = ctx.token("another-job", revision + 5);
    let malformed = format!("fg1~not-a-revision~{RESOURCE}");
    for (what, token) in [
        ("missing", None),
        ("malformed", Some(malformed.as_str())),
        ("forged", Some(forged.as_str())),
        ("out_of_scope", Some(out_of_scope.as_str())),
    ] {
        let outcome = store.write(key, what, token);
        assert!(
            matches!(outcome, Outcome::Refused(_)),
            "{what}: {outcome:?}"
        );
        assert_eq!(store.read(key).as_deref(), Some("kept"), "{what}");
    }
    // The fence did not move either: the current holder still writes.
    assert_eq!(
        store.write(key, "still", Some(&ctx.token(RESOURCE, revision))),
        Outcome::Applied
    );
    vec![
        ("missing", 1),
        ("malformed", 1),
        ("forged", 1),
        ("out_of_scope", 1),
    ]
}

/// Writer n writes until writer n+1's first write is acknowledged; every write of n started
/// after that is refused (stale) and the key holds n+1's value from then on.
fn racing_writers(store: &dyn Store, ctx: &mut Ctx, key: &str) -> Audit {
    const BEFORE: usize = 5;
    const AFTER: usize = 5;
    let n = ctx.next();
    let (old, new) = (ctx.token(RESOURCE, n), ctx.token(RESOURCE, n + 1));
    let overtaken = AtomicBool::new(false);
    let (progress, n_applied) = mpsc::channel();
    let refused = std::thread::scope(|s| {
        let writer_n = s.spawn(|| {
            let (mut applied, mut attempts_after, mut refused) = (0, 0, 0);
            let mut i = 0;
            while attempts_after < AFTER {
                // Read the flag before the write: a write started after n+1's ack must fail.
                let after = overtaken.load(Ordering::SeqCst);
                let outcome = store.write(key, &format!("n:{i}"), Some(&old));
                i += 1;
                if outcome != Outcome::Applied {
                    refused += 1;
                }
                if after {
                    attempts_after += 1;
                    assert!(
                        matches!(outcome, Outcome::Refused(_)),
                        "write {i} of n started after n+1's first write: {outcome:?}"
                    );
                } else if outcome == Outcome::Applied {
                    applied += 1;
                    if applied == BEFORE {
                        progress.send(()).unwrap();
                    }
                }
                assert!(i < 10_000, "writer n made no progress");
            }
            refused
        });
        // n+1 starts once n has applied writes, so the two overlap (n's progress is the signal).
        n_applied.recv_timeout(Duration::from_secs(120)).unwrap();
        assert_eq!(store.write(key, "n+1:0", Some(&new)), Outcome::Applied);
        overtaken.store(true, Ordering::SeqCst);
        for _ in 0..AFTER {
            assert_eq!(store.read(key).as_deref(), Some("n+1:0"));
        }
        writer_n.join().unwrap()
    });
    assert_eq!(store.read(key).as_deref(), Some("n+1:0"));
    // Every refusal of n (also those in flight when n+1 applied) is a stale one.
    vec![("stale", refused)]
}

/// A grant from the lease service.
struct Grant {
    token: String,
    revision: u64,
    lease_id: String,
}

/// The node's lease service over its HTTP API (the scenarios are synchronous; each call runs
/// on a small runtime of its own).
struct Leases {
    base: String,
    http: reqwest::Client,
    rt: tokio::runtime::Runtime,
}

impl Leases {
    fn new(api: u16) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        Self {
            base: format!("http://127.0.0.1:{api}"),
            http: reqwest::Client::new(),
            rt,
        }
    }

    /// Acquires the scenarios' resource for `holder`, waiting up to `wait_ms` if it is held.
    fn acquire(&self, holder: &str, ttl_ms: u64, wait_ms: u64) -> Grant {
        let url = format!("{}/v1/locks/{RESOURCE}", self.base);
        let body = json!({ "ttl_ms": ttl_ms, "wait_ms": wait_ms, "holder": holder });
        let (status, grant) = self.rt.block_on(async {
            let reply = self.http.post(&url).json(&body).send().await.unwrap();
            let status = reply.status();
            (status, reply.json::<serde_json::Value>().await.unwrap())
        });
        assert_eq!(
            status,
            reqwest::StatusCode::OK,
            "acquire for {holder}: {grant}"
        );
        Grant {
            token: grant["token"].as_str().unwrap().to_owned(),
            revision: grant["revision"].as_u64().unwrap(),
            lease_id: grant["lease_id"].as_str().unwrap().to_owned(),
        }
    }

    /// A keepalive of `lease_id`: `true` if the lease is still held, `false` if it expired.
    fn keepalive(&self, lease_id: &str) -> bool {
        let url = format!("{}/v1/leases/{lease_id}/keepalive", self.base);
        let (status, body) = self.rt.block_on(async {
            let reply = self.http.post(&url).send().await.unwrap();
            (reply.status(), reply.text().await.unwrap_or_default())
        });
        match status {
            reqwest::StatusCode::OK => true,
            reqwest::StatusCode::NOT_FOUND | reqwest::StatusCode::GONE => false,
            _ => panic!("keepalive {lease_id}: {status} {body}"),
        }
    }

    fn release(&self, lease_id: &str) {
        let url = format!("{}/v1/leases/{lease_id}", self.base);
        let status = self
            .rt
            .block_on(async { self.http.delete(&url).send().await.unwrap().status() });
        assert_eq!(status, reqwest::StatusCode::OK, "release {lease_id}");
    }
}

/// The store crashes and comes back on its own data: the fence came back with the data, so a
/// stale token is still refused, and the holder's session-less next write applies.
fn store_restart_keeps_the_fence(store: &dyn Store, ctx: &mut Ctx, key: &str) -> Audit {
    let current = ctx.next();
    let token = ctx.token(RESOURCE, current);
    assert_eq!(store.write(key, "before", Some(&token)), Outcome::Applied);
    if let Err(why) = store.restart_store() {
        println!(
            "{:<10} store_restart_keeps_the_fence: not run: {why}",
            store.name()
        );
        return vec![];
    }
    assert_eq!(store.read(key).as_deref(), Some("before"));
    let outcome = store.write(key, "stale", Some(&ctx.token(RESOURCE, current - 1)));
    assert!(matches!(outcome, Outcome::Refused(_)), "{outcome:?}");
    assert_eq!(store.read(key).as_deref(), Some("before"));
    assert_eq!(store.write(key, "after", Some(&token)), Outcome::Applied);
    assert_eq!(store.read(key).as_deref(), Some("after"));
    vec![("stale", 1)]
}

/// Refusals in the audit logs of `dirs` by reason; one record counts one refusal unless it is
/// an aggregate.
fn refusals(dirs: &[PathBuf]) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for dir in dirs {
        for (reason, n) in support::audit::refusals_by_reason(dir) {
            *counts.entry(reason).or_insert(0) += n;
        }
    }
    counts
}

fn refusal_records(dirs: &[PathBuf]) -> usize {
    dirs.iter()
        .flat_map(|dir| support::audit::records(dir))
        .filter(|r| r.get("reason").is_some())
        .count()
}

/// Runs every scenario against `store`, one line each.
fn run_all(store: &dyn Store) {
    let mut ctx = Ctx::new();
    let dir = store.nodes().audit_dirs();
    for (i, (name, scenario)) in SCENARIOS.iter().enumerate() {
        let before = refusals(&dir);
        let records_before = refusal_records(&dir);
        let started = Instant::now();
        let key = format!("scenario-{i}");
        let expected = scenario(store, &mut ctx, &key);
        let mut want = before.clone();
        for (reason, n) in &expected {
            *want.entry(reason.to_string()).or_insert(0) += n;
        }
        want.retain(|_, n| *n > 0);
        // Records may be written just after the reply; poll (bounded) for the expected count.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut seen = refusals(&dir);
        while seen != want && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            seen = refusals(&dir);
        }
        assert_eq!(seen, want, "{} {name}: audit", store.name());
        let new_records = refusal_records(&dir) - records_before;
        let expected_records: u64 = expected.iter().map(|(_, n)| n).sum();
        assert_eq!(
            new_records as u64,
            expected_records,
            "{} {name}: new audit records",
            store.name()
        );
        println!(
            "{:<10} {name:<64} ok  {new_records} new audit record(s)  {:?}",
            store.name(),
            started.elapsed()
        );
    }
}

// ---- The cluster every adapter runs on.

/// A 3-node cluster, each node running the store's gateway; writes go through node `via`'s
/// gateway (the failover scenario moves it off the leader it kills).
struct Nodes {
    rt: tokio::runtime::Runtime,
    /// In a mutex only so scenarios can kill and restart nodes through `&self`.
    cluster: Mutex<Cluster>,
    /// Each node's gateway port.
    gateways: BTreeMap<u64, u16>,
    via: AtomicU64,
}

impl Nodes {
    /// Starts the cluster; `section(id, port)` is node `id`'s gateway section listening on
    /// `port`. Every node verifies tokens with the suite's key.
    fn start(section: impl Fn(u64, u16) -> String, env: &[(&str, &str)]) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let gateways: BTreeMap<u64, u16> = (1..=3).map(|id| (id, support::free_port())).collect();
        let mut env = env.to_vec();
        env.push(KEY_ENV);
        let key = format!("token_key_env = \"{}\"\n", KEY_ENV.0);
        let cluster = rt.block_on(Cluster::start_configured(
            3,
            &key,
            |id| section(id, gateways[&id]),
            &env,
        ));
        for port in gateways.values() {
            wait_for_port(*port, Duration::from_secs(30));
        }
        Self {
            rt,
            cluster: Mutex::new(cluster),
            gateways,
            via: AtomicU64::new(1),
        }
    }

    fn ids(&self) -> Vec<u64> {
        self.cluster.lock().unwrap().ids()
    }

    fn set_via(&self, id: u64) {
        self.via.store(id, Ordering::SeqCst);
    }

    /// The port of the gateway writes go through.
    fn gateway(&self) -> u16 {
        self.gateways[&self.via.load(Ordering::SeqCst)]
    }

    /// The HTTP API port of the node writes go through (followers pass lease calls on to the
    /// leader).
    fn api(&self) -> u16 {
        let via = self.via.load(Ordering::SeqCst);
        self.cluster.lock().unwrap().nodes[via as usize - 1].port
    }

    /// Every node's audit log directory.
    fn audit_dirs(&self) -> Vec<PathBuf> {
        let cluster = self.cluster.lock().unwrap();
        cluster
            .ids()
            .into_iter()
            .map(|id| cluster.data_dir(id).join("audit"))
            .collect()
    }

    /// The leader every node of `among` names, once they agree (bounded by the harness).
    fn leader(&self, among: &[u64]) -> u64 {
        let cluster = self.cluster.lock().unwrap();
        self.rt.block_on(cluster.wait_for_leader(among))
    }

    /// SIGKILL of node `id` (its gateway dies with it).
    fn kill(&self, id: u64) {
        self.cluster.lock().unwrap().kill(id);
    }

    /// Starts node `id` again and waits until the whole cluster agrees on a leader and its
    /// gateway accepts connections.
    fn restart(&self, id: u64) {
        self.cluster.lock().unwrap().spawn(id);
        self.leader(&self.ids());
        wait_for_port(self.gateways[&id], Duration::from_secs(30));
    }
}

// ---- Redis: a `[redis]` gateway in front of redis-server; the token goes in with FENCE.

struct RedisStore {
    nodes: Nodes,
    /// In a mutex only so `restart_store` can restart it through `&self`.
    redis: Mutex<RedisServer>,
    direct_url: String,
}

impl RedisStore {
    fn start() -> Self {
        let redis = RedisServer::start();
        let nodes = Nodes::start(
            |_, port| {
                format!(
                    "\n[redis]\nlisten = \"127.0.0.1:{port}\"\nupstream = \"{}\"\n\n\
                     [[redis.protect]]\npattern = \"*\"\nresource = \"{RESOURCE}\"\n",
                    redis.addr
                )
            },
            &[],
        );
        Self {
            nodes,
            direct_url: redis.url(),
            redis: Mutex::new(redis),
        }
    }
}

impl Store for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn write(&self, key: &str, value: &str, token: Option<&str>) -> Outcome {
        let url = format!("redis://127.0.0.1:{}/", self.nodes.gateway());
        let mut con = redis::Client::open(url).unwrap().get_connection().unwrap();
        if let Some(token) = token {
            if let Err(e) = redis::cmd("FENCE").arg(token).query::<()>(&mut con) {
                return Outcome::Refused(e.to_string());
            }
        }
        match redis::cmd("SET").arg(key).arg(value).query::<()>(&mut con) {
            Ok(()) => Outcome::Applied,
            Err(e) => Outcome::Refused(e.to_string()),
        }
    }

    fn read(&self, key: &str) -> Option<String> {
        let mut con = redis::Client::open(self.direct_url.as_str())
            .unwrap()
            .get_connection()
            .unwrap();
        redis::cmd("GET").arg(key).query(&mut con).unwrap()
    }

    fn nodes(&self) -> &Nodes {
        &self.nodes
    }

    /// SIGKILL, then the same server on its append-only file (`appendfsync everysec`: a process
    /// crash loses nothing Redis has answered, only a machine crash can).
    fn restart_store(&self) -> Result<(), &'static str> {
        self.redis.lock().unwrap().restart();
        Ok(())
    }
}

// ---- PostgreSQL: a `[postgres]` gateway in front of PostgreSQL; the token is a startup option.

struct PostgresStore {
    nodes: Nodes,
    pg: PgServer,
}

impl PostgresStore {
    fn start() -> Self {
        let pg = PgServer::start();
        let (code, out, err) = cli(&["postgres", "install", "--dsn", &pg.dsn("postgres")]);
        assert_eq!(code, 0, "fencegate postgres install failed:\n{out}\n{err}");
        pg.psql_as(
            "postgres",
            "CREATE TABLE kv (k text PRIMARY KEY, v text NOT NULL)",
        );
        let nodes = Nodes::start(
            |_, port| {
                format!(
                    "\n[postgres]\nlisten = \"127.0.0.1:{port}\"\nupstream = \"{}\"\n\
                     databases = [\"postgres\"]\nresource = \"{RESOURCE}\"\n",
                    pg.addr()
                )
            },
            &[],
        );
        Self { nodes, pg }
    }
}

impl Store for PostgresStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn write(&self, key: &str, value: &str, token: Option<&str>) -> Outcome {
        let sql = format!(
            "INSERT INTO kv VALUES ('{key}', '{value}') ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v"
        );
        let mut psql = Command::new("psql");
        psql.args(["-h", "127.0.0.1", "-p", &self.nodes.gateway().to_string()])
            .args([
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-X",
                "-v",
                "ON_ERROR_STOP=1",
            ])
            .args(["-Atq", "-c", &sql]);
        if let Some(token) = token {
            psql.env("PGOPTIONS", format!("-c fencegate.token={token}"));
        }
        let out = psql.output().expect("run psql");
        if out.status.success() {
            Outcome::Applied
        } else {
            Outcome::Refused(String::from_utf8_lossy(&out.stderr).trim().to_owned())
        }
    }

    fn read(&self, key: &str) -> Option<String> {
        let v = self
            .pg
            .psql_as("postgres", &format!("SELECT v FROM kv WHERE k = '{key}'"));
        (!v.is_empty()).then_some(v)
    }

    fn nodes(&self) -> &Nodes {
        &self.nodes
    }

    /// `pg_ctl stop -m immediate` (a crash: recovery replays the WAL), then start.
    fn restart_store(&self) -> Result<(), &'static str> {
        self.pg.restart();
        Ok(())
    }
}

// ---- S3, manifest mode: an `[s3]` gateway in front of moto; the token is a request header.

const S3_ACCESS_KEY: &str = "AKIDSCENARIO";
const S3_SECRET: &str = "scenario-client-secret";

struct S3Store {
    nodes: Nodes,
    _moto: MotoServer,
}

impl S3Store {
    fn start() -> Self {
        let moto = MotoServer::start();
        let created = moto.direct(json!([{"op": "create_bucket", "bucket": "ledger"}]));
        assert_eq!(created[0]["ok"], true, "{created}");
        let clients = format!("{S3_ACCESS_KEY}:{S3_SECRET}");
        let nodes = Nodes::start(
            |_, port| {
                format!(
                    "\n[s3]\nlisten = \"127.0.0.1:{port}\"\nupstream = \"{}\"\nupstream_access_key = \"gateway\"\n\
                     upstream_secret_env = \"S3_UPSTREAM_SECRET\"\nclients_env = \"S3_CLIENTS\"\n\n\
                     [[s3.protect]]\nbucket = \"ledger\"\nprefix = \"data/\"\nmode = \"manifest\"\nresource = \"{RESOURCE}\"\n",
                    moto.endpoint
                )
            },
            &[
                ("S3_UPSTREAM_SECRET", "gateway-secret"),
                ("S3_CLIENTS", &clients),
            ],
        );
        Self { nodes, _moto: moto }
    }

    fn run(&self, step: serde_json::Value) -> serde_json::Value {
        let endpoint = format!("http://127.0.0.1:{}", self.nodes.gateway());
        run_client(&endpoint, S3_ACCESS_KEY, S3_SECRET, json!([step]))[0].clone()
    }
}

impl Store for S3Store {
    fn name(&self) -> &'static str {
        "s3"
    }

    fn write(&self, key: &str, value: &str, token: Option<&str>) -> Outcome {
        let mut step =
            json!({"op": "put", "bucket": "ledger", "key": format!("data/{key}"), "body": value});
        if let Some(token) = token {
            step["token"] = json!(token);
        }
        let r = self.run(step);
        if r["ok"] == true {
            Outcome::Applied
        } else {
            Outcome::Refused(format!("{} {}", r["status"], r["code"]))
        }
    }

    /// Manifest mode: the committed view is the manifest's, so it is read through the gateway
    /// (a read needs no token).
    fn read(&self, key: &str) -> Option<String> {
        let r = self.run(json!({"op": "get", "bucket": "ledger", "key": format!("data/{key}")}));
        if r["ok"] == true {
            Some(r["body"].as_str().unwrap().to_owned())
        } else {
            assert_eq!(r["status"], 404, "read {key}: {r}");
            None
        }
    }

    fn nodes(&self) -> &Nodes {
        &self.nodes
    }

    fn restart_store(&self) -> Result<(), &'static str> {
        Err("moto keeps its objects in memory: a restart loses the bucket, fence and data alike")
    }
}

#[test]
fn redis_passes_every_scenario() {
    run_all(&RedisStore::start());
}

#[test]
fn postgres_passes_every_scenario() {
    run_all(&PostgresStore::start());
}

#[test]
fn s3_manifest_passes_every_scenario() {
    run_all(&S3Store::start());
}
