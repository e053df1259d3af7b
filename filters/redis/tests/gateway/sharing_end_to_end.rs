//! Sessions sharing an upstream connection (`shared_upstream_connections = 1`), through the
//! gateway in process, against a real redis-server, with every client treated as an adversary:
//! many clients pipelining at once get exactly their own replies over one upstream connection;
//! a client that changes its connection's state (`SELECT`, `MULTI`, `HELLO 3`, `CLIENT
//! SETNAME`, a command renamed on the server) does so on a connection of its own, even in the
//! middle of a pipeline, and nobody else's request notices; a fenced write on a shared
//! connection is refused and audited as on a connection of its own; and a shared connection
//! killed upstream ends the sessions waiting on it, after which a new client works.

use fencegate_testkit::redis_server;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use fencegate_core::MemoryAuditSink;
use fencegate_redis::frame::{parse, Frame, Limits};
use fencegate_redis::{ProtectMode, ProtectRule, RedisConfig};
use redis_server::RedisServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long any one reply may take.
const REPLY_WAIT: Duration = Duration::from_secs(10);

/// Protects `fenced:*` (so the gateway enforces, as in production) and shares one upstream
/// connection; other keys pass without a token.
fn sharing_config(upstream: SocketAddr) -> RedisConfig {
    RedisConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream: upstream.to_string(),
        protect: Some(vec![ProtectRule {
            pattern: "fenced:*".to_owned(),
            mode: ProtectMode::Enforce,
            resource: Some("*".to_owned()),
        }]),
        shared_upstream_connections: 1,
        ..RedisConfig::default()
    }
}

/// Like [`sharing_config`] without an enforce rule: the gateway then relays `SELECT` (while a
/// rule enforces it serves database 0 only, so the database moves below need this).
fn plain_config(upstream: SocketAddr) -> RedisConfig {
    RedisConfig {
        protect: Some(Vec::new()),
        ..sharing_config(upstream)
    }
}

/// A raw RESP client: requests in one write, replies as frames with their exact bytes.
struct Client {
    stream: TcpStream,
    buf: BytesMut,
}

impl Client {
    async fn connect(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        Self {
            stream,
            buf: BytesMut::new(),
        }
    }

    /// Sends every request (space-separated words) in one write.
    async fn send(&mut self, requests: &[&str]) {
        let mut out = BytesMut::new();
        for r in requests {
            Frame::command(r.split(' ').map(|w| Bytes::copy_from_slice(w.as_bytes())))
                .encode(&mut out);
        }
        self.stream.write_all(&out).await.unwrap();
    }

    /// The next reply with its bytes, or `None` when the connection ended first.
    async fn next(&mut self) -> Option<(Frame, Bytes)> {
        loop {
            if let Some((frame, len)) = parse(&self.buf, &Limits::UPSTREAM).unwrap() {
                let raw = self.buf.split_to(len).freeze();
                return Some((frame, raw));
            }
            let n = tokio::time::timeout(REPLY_WAIT, self.stream.read_buf(&mut self.buf))
                .await
                .expect("no reply within the wait")
                .unwrap_or(0);
            if n == 0 {
                return None;
            }
        }
    }

    async fn reply(&mut self) -> Frame {
        self.next().await.expect("the connection ended").0
    }

    /// The next reply's exact bytes, as text.
    async fn raw(&mut self) -> String {
        let (_, raw) = self.next().await.expect("the connection ended");
        String::from_utf8_lossy(&raw).into_owned()
    }

    async fn request(&mut self, request: &str) -> Frame {
        self.send(&[request]).await;
        self.reply().await
    }
}

fn ok() -> Frame {
    Frame::simple("OK")
}

fn bulk(text: &str) -> Frame {
    Frame::Bulk(Bytes::copy_from_slice(text.as_bytes()))
}

/// One connection of `CLIENT LIST`, field -> value.
type Listed = BTreeMap<String, String>;

/// A direct connection to Redis, for looking at what the gateway did.
struct Direct {
    client: Client,
    id: String,
}

/// Commands the gateway's own setup and check connections send (not client traffic).
const CONTROL_COMMANDS: &[&str] = &["command", "function|load", "script|load", "config|get"];

impl Direct {
    async fn connect(server: &RedisServer) -> Self {
        let mut client = Client::connect(server.addr).await;
        let Frame::Integer(id) = client.request("CLIENT ID").await else {
            panic!("CLIENT ID")
        };
        Self {
            client,
            id: id.to_string(),
        }
    }

    /// The gateway's client-traffic connections (every connection but this one and the
    /// gateway's control connections).
    async fn gateway_connections(&mut self) -> Vec<Listed> {
        let Frame::Bulk(text) = self.client.request("CLIENT LIST").await else {
            panic!("CLIENT LIST")
        };
        String::from_utf8_lossy(&text)
            .lines()
            .map(|line| {
                line.split(' ')
                    .filter_map(|kv| kv.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect::<Listed>()
            })
            .filter(|c| c["id"] != self.id && !CONTROL_COMMANDS.contains(&c["cmd"].as_str()))
            .collect()
    }

    /// The one connection the gateway has upstream (panics otherwise).
    async fn only_connection(&mut self) -> Listed {
        let mut all = self.gateway_connections().await;
        assert_eq!(all.len(), 1, "expected one upstream connection: {all:#?}");
        all.pop().unwrap()
    }

    async fn get(&mut self, db: u32, key: &str) -> Frame {
        self.client
            .send(&[&format!("SELECT {db}"), &format!("GET {key}"), "SELECT 0"])
            .await;
        assert_eq!(self.client.reply().await, ok());
        let value = self.client.reply().await;
        assert_eq!(self.client.reply().await, ok());
        value
    }
}

async fn gateway(config: RedisConfig) -> (SocketAddr, Arc<MemoryAuditSink>) {
    super::harness::serve(config).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharing_many_clients_get_their_own_replies_over_one_connection() {
    const CLIENTS: usize = 20;
    const ROUNDS: usize = 25;
    const PAIRS: usize = 4;
    let server = RedisServer::start();
    let (addr, _) = gateway(sharing_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        tasks.push(tokio::spawn(async move {
            let mut client = Client::connect(addr).await;
            for round in 0..ROUNDS {
                let requests: Vec<String> = (0..PAIRS)
                    .flat_map(|p| {
                        let key = format!("c{c}:{round}:{p}");
                        [format!("SET {key} v-{c}-{round}-{p}"), format!("GET {key}")]
                    })
                    .collect();
                let requests: Vec<&str> = requests.iter().map(String::as_str).collect();
                client.send(&requests).await;
                for p in 0..PAIRS {
                    assert_eq!(client.reply().await, ok(), "client {c} round {round}");
                    assert_eq!(
                        client.reply().await,
                        bulk(&format!("v-{c}-{round}-{p}")),
                        "client {c} round {round} got another's reply"
                    );
                }
            }
            // Kept open until the connections are counted.
            client
        }));
    }
    // Clients that send and leave without reading: their replies go nowhere, nobody else's
    // are shifted.
    let mut rude = Vec::new();
    for r in 0..5 {
        rude.push(tokio::spawn(async move {
            let mut client = Client::connect(addr).await;
            let requests: Vec<String> = (0..50).map(|i| format!("GET rude:{r}:{i}")).collect();
            let requests: Vec<&str> = requests.iter().map(String::as_str).collect();
            client.send(&requests).await;
        }));
    }
    let mut clients = Vec::new();
    for task in tasks {
        clients.push(task.await.unwrap());
    }
    for task in rude {
        task.await.unwrap();
    }
    let shared = direct.only_connection().await;
    assert_eq!(shared["db"], "0", "{shared:?}");
    assert_eq!(shared["flags"], "N", "{shared:?}");
    // And every session still works on it.
    for (c, client) in clients.iter_mut().enumerate() {
        assert_eq!(
            client.request(&format!("GET c{c}:0:0")).await,
            bulk(&format!("v-{c}-0-0"))
        );
    }
    assert_eq!(direct.only_connection().await["id"], shared["id"]);
}

#[tokio::test]
async fn sharing_select_moves_only_that_session_to_another_db() {
    let server = RedisServer::start();
    let (addr, _) = gateway(plain_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    let mut plain = Client::connect(addr).await;
    assert_eq!(plain.request("SET plain:first b").await, ok());
    let shared = direct.only_connection().await;

    // The plain session pipelines while the other one selects db 1 and writes.
    let noise = tokio::spawn(async move {
        let requests: Vec<String> = (0..200).map(|i| format!("SET plain:{i} b")).collect();
        let requests: Vec<&str> = requests.iter().map(String::as_str).collect();
        plain.send(&requests).await;
        for _ in 0..200 {
            assert_eq!(plain.reply().await, ok());
        }
        plain
    });
    let mut mover = Client::connect(addr).await;
    mover
        .send(&[
            "SET moved:before m",
            "SELECT 1",
            "SET moved:k m",
            "GET moved:k",
        ])
        .await;
    assert_eq!(mover.reply().await, ok());
    assert_eq!(mover.reply().await, ok());
    assert_eq!(mover.reply().await, ok());
    assert_eq!(mover.reply().await, bulk("m"));
    let mut plain = noise.await.unwrap();
    assert_eq!(plain.request("SET plain:after b").await, ok());
    assert_eq!(mover.request("SET moved:after m").await, ok());

    for key in ["plain:first", "plain:0", "plain:199", "plain:after"] {
        assert_eq!(direct.get(0, key).await, bulk("b"), "{key} in db 0");
        assert_eq!(direct.get(1, key).await, Frame::Null, "{key} not in db 1");
    }
    assert_eq!(direct.get(0, "moved:before").await, bulk("m"));
    for key in ["moved:k", "moved:after"] {
        assert_eq!(direct.get(1, key).await, bulk("m"), "{key} in db 1");
        assert_eq!(direct.get(0, key).await, Frame::Null, "{key} not in db 0");
    }
    let connections = direct.gateway_connections().await;
    let still = connections.iter().find(|c| c["id"] == shared["id"]);
    assert_eq!(
        still.map(|c| c["db"].as_str()),
        Some("0"),
        "the shared connection stays in db 0: {connections:#?}"
    );
    assert_eq!(connections.len(), 2, "{connections:#?}");
    assert!(
        connections.iter().any(|c| c["db"] == "1"),
        "{connections:#?}"
    );
}

#[tokio::test]
async fn sharing_multi_does_not_queue_other_sessions_commands() {
    let server = RedisServer::start();
    let (addr, _) = gateway(sharing_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    let mut plain = Client::connect(addr).await;
    assert_eq!(plain.request("GET tx:none").await, Frame::Null);
    let shared = direct.only_connection().await;

    let mut tx = Client::connect(addr).await;
    assert_eq!(tx.request("MULTI").await, ok());
    assert_eq!(tx.request("SET tx:a 1").await, Frame::simple("QUEUED"));
    // The other session's write applies now, not at EXEC.
    assert_eq!(plain.request("SET tx:b 1").await, ok());
    assert_eq!(plain.request("GET tx:b").await, bulk("1"));
    assert_eq!(direct.get(0, "tx:b").await, bulk("1"));
    assert_eq!(direct.get(0, "tx:a").await, Frame::Null);
    let connections = direct.gateway_connections().await;
    let on_shared = connections
        .iter()
        .find(|c| c["id"] == shared["id"])
        .unwrap();
    assert_eq!(on_shared["multi"], "-1", "{connections:#?}");
    assert!(
        connections.iter().any(|c| c["multi"] == "1"),
        "{connections:#?}"
    );
    assert_eq!(tx.request("EXEC").await, Frame::Array(vec![ok()]));
    assert_eq!(direct.get(0, "tx:a").await, bulk("1"));

    // WATCH is the watching session's alone: a plain session's write aborts its EXEC, as
    // between two connections.
    let mut watcher = Client::connect(addr).await;
    assert_eq!(watcher.request("WATCH tx:w").await, ok());
    assert_eq!(plain.request("SET tx:w 2").await, ok());
    watcher.send(&["MULTI", "SET tx:w 3", "EXEC"]).await;
    assert_eq!(watcher.reply().await, ok());
    assert_eq!(watcher.reply().await, Frame::simple("QUEUED"));
    assert_eq!(watcher.reply().await, Frame::Null);
    assert_eq!(direct.get(0, "tx:w").await, bulk("2"));
    // And the plain session never watched anything: its own MULTI/EXEC applies.
    plain.send(&["MULTI", "SET tx:w 4", "EXEC"]).await;
    assert_eq!(plain.reply().await, ok());
    assert_eq!(plain.reply().await, Frame::simple("QUEUED"));
    assert_eq!(plain.reply().await, Frame::Array(vec![ok()]));
}

#[tokio::test]
async fn sharing_hello_3_leaves_other_sessions_on_resp2() {
    let server = RedisServer::start();
    let (addr, _) = gateway(sharing_config(server.addr)).await;
    let mut plain = Client::connect(addr).await;
    plain.send(&["HSET h:1 f v", "GET missing"]).await;
    assert_eq!(plain.reply().await, Frame::Integer(1));
    assert_eq!(plain.raw().await, "$-1\r\n");

    let mut resp3 = Client::connect(addr).await;
    resp3.send(&["HELLO 3", "GET missing", "HGETALL h:1"]).await;
    assert!(resp3.raw().await.starts_with('%'), "HELLO 3 answers a map");
    assert_eq!(resp3.raw().await, "_\r\n");
    assert!(resp3.raw().await.starts_with("%1\r\n"));

    plain.send(&["GET missing", "HGETALL h:1"]).await;
    assert_eq!(plain.raw().await, "$-1\r\n");
    assert_eq!(plain.raw().await, "*2\r\n$1\r\nf\r\n$1\r\nv\r\n");
    // A new session starts on the shared connection in RESP2 as well.
    let mut later = Client::connect(addr).await;
    assert_eq!(
        later.request("HGETALL h:1").await,
        Frame::Array(vec![bulk("f"), bulk("v")])
    );
}

#[tokio::test]
async fn sharing_client_setname_is_not_on_the_shared_connection() {
    let server = RedisServer::start();
    let (addr, _) = gateway(sharing_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    let mut plain = Client::connect(addr).await;
    assert_eq!(plain.request("GET k").await, Frame::Null);
    let shared = direct.only_connection().await;

    let mut named = Client::connect(addr).await;
    assert_eq!(named.request("CLIENT SETNAME adversary").await, ok());
    assert_eq!(named.request("CLIENT GETNAME").await, bulk("adversary"));
    assert_eq!(plain.request("GET k").await, Frame::Null);
    let connections = direct.gateway_connections().await;
    let on_shared = connections
        .iter()
        .find(|c| c["id"] == shared["id"])
        .unwrap();
    assert_eq!(on_shared["name"], "", "{connections:#?}");
    let adversary: Vec<_> = connections
        .iter()
        .filter(|c| c["name"] == "adversary")
        .collect();
    assert_eq!(adversary.len(), 1, "{connections:#?}");
    assert_ne!(adversary[0]["id"], shared["id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharing_pipeline_across_the_move_keeps_order() {
    const MOVERS: usize = 10;
    const NOISE: usize = 5;
    let server = RedisServer::start();
    let (addr, _) = gateway(plain_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    // Sessions that stay on the shared connection, pipelining while the others move.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut noise = Vec::new();
    for n in 0..NOISE {
        let stop = stop.clone();
        noise.push(tokio::spawn(async move {
            let mut client = Client::connect(addr).await;
            let mut round = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) || round < 3 {
                let key = format!("noise:{n}:{round}");
                client
                    .send(&[&format!("SET {key} {round}"), &format!("GET {key}"), "PING"])
                    .await;
                assert_eq!(client.reply().await, ok());
                assert_eq!(client.reply().await, bulk(&round.to_string()));
                assert_eq!(client.reply().await, Frame::simple("PONG"));
                round += 1;
            }
            round
        }));
    }
    let mut movers = Vec::new();
    for m in 0..MOVERS {
        movers.push(tokio::spawn(async move {
            let mut client = Client::connect(addr).await;
            let (a, b, c) = (format!("a:{m}"), format!("b:{m}"), format!("c:{m}"));
            client
                .send(&[
                    &format!("SET {a} 1"),
                    &format!("SET {b} 2"),
                    "SELECT 1",
                    &format!("SET {c} 3"),
                    &format!("GET {a}"),
                ])
                .await;
            let mut replies = Vec::new();
            for _ in 0..5 {
                replies.push(client.raw().await);
            }
            assert_eq!(
                replies,
                ["+OK\r\n", "+OK\r\n", "+OK\r\n", "+OK\r\n", "$-1\r\n"],
                "mover {m}"
            );
        }));
    }
    for task in movers {
        task.await.unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut rounds = 0;
    for task in noise {
        rounds += task.await.unwrap();
    }
    for m in 0..MOVERS {
        assert_eq!(direct.get(0, &format!("a:{m}")).await, bulk("1"));
        assert_eq!(direct.get(0, &format!("b:{m}")).await, bulk("2"));
        assert_eq!(direct.get(1, &format!("c:{m}")).await, bulk("3"));
        assert_eq!(direct.get(0, &format!("c:{m}")).await, Frame::Null);
        assert_eq!(direct.get(1, &format!("a:{m}")).await, Frame::Null);
    }
    for n in 0..NOISE {
        assert_eq!(direct.get(1, &format!("noise:{n}:0")).await, Frame::Null);
        assert_eq!(direct.get(0, &format!("noise:{n}:0")).await, bulk("0"));
    }
    assert!(rounds >= NOISE * 3);
}

#[tokio::test]
async fn sharing_fenced_write_is_refused_and_audited_once() {
    let server = RedisServer::start();
    let (addr, sink) = gateway(sharing_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    let mut current = Client::connect(addr).await;
    let mut stale = Client::connect(addr).await;
    assert_eq!(current.request("FENCE fg1~9~job").await, ok());
    assert_eq!(current.request("SET fenced:k v9").await, ok());
    assert_eq!(stale.request("FENCE fg1~5~job").await, ok());
    let Frame::Error(e) = stale.request("SET fenced:k late").await else {
        panic!("the stale write was not refused")
    };
    let e = String::from_utf8_lossy(&e).into_owned();
    assert!(e.starts_with("FENCED"), "{e}");
    assert!(e.contains("job token 5 is below fence 9"), "{e}");
    // A pipeline of stale writes between plain requests: each refused, the rest unchanged.
    stale
        .send(&[
            "GET plain",
            "SET fenced:k late2",
            "SET plain x",
            "GET fenced:k",
        ])
        .await;
    assert_eq!(stale.reply().await, Frame::Null);
    assert!(matches!(stale.reply().await, Frame::Error(_)));
    assert_eq!(stale.reply().await, ok());
    assert_eq!(stale.reply().await, bulk("v9"));
    assert_eq!(direct.get(0, "fenced:k").await, bulk("v9"));
    assert_eq!(direct.get(0, "fencegate:fence:{job}").await, bulk("9"));
    let events = sink.events();
    assert_eq!(events.len(), 2, "{events:#?}");
    for (event, command) in events.iter().zip(["SET", "SET"]) {
        assert_eq!(
            (event.reason.as_str(), event.fence, event.revision),
            ("stale", Some(9), Some(5))
        );
        assert_eq!(event.operation.command, command);
    }
    // Fencing did not need a connection of its own.
    let shared = direct.only_connection().await;
    assert_eq!(shared["db"], "0");
}

#[tokio::test]
async fn sharing_killed_connection_ends_waiting_sessions_and_is_replaced() {
    let server = RedisServer::start();
    let (addr, _) = gateway(sharing_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    let mut writer = Client::connect(addr).await;
    let mut reader = Client::connect(addr).await;
    let mut idle = Client::connect(addr).await;
    assert_eq!(idle.request("SET x 1").await, ok());
    let shared = direct.only_connection().await;

    // Writes pause upstream: the writer's SET waits in Redis, the reader's GET behind it.
    assert_eq!(
        direct.client.request("CLIENT PAUSE 30000 WRITE").await,
        ok()
    );
    writer.send(&["SET w 1"]).await;
    reader.send(&["GET x"]).await;
    let deadline = tokio::time::Instant::now() + REPLY_WAIT;
    loop {
        let connections = direct.gateway_connections().await;
        let c = connections
            .iter()
            .find(|c| c["id"] == shared["id"])
            .unwrap();
        if c["flags"].contains('b') && c["cmd"] == "set" {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the SET never waited upstream: {connections:#?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let killed = direct
        .client
        .request(&format!("CLIENT KILL ID {}", shared["id"]))
        .await;
    assert_eq!(killed, Frame::Integer(1));
    assert_eq!(direct.client.request("CLIENT UNPAUSE").await, ok());

    // The waiting sessions end (an error at most, never a reply that is not theirs).
    for (name, client) in [("writer", &mut writer), ("reader", &mut reader)] {
        match client.next().await {
            None => {}
            Some((Frame::Error(_), _)) => assert!(client.next().await.is_none(), "{name}"),
            Some((other, _)) => panic!("{name} got {other:?} from a killed connection"),
        }
    }
    assert_eq!(direct.get(0, "w").await, Frame::Null);
    // A session with nothing in flight on the dead connection goes on, on the pool's next
    // one: nothing of it can be reordered.
    idle.send(&["SET x 1", "GET x"]).await;
    assert_eq!(idle.reply().await, ok());
    assert_eq!(idle.reply().await, bulk("1"));

    // A new client gets the new shared connection.
    let mut fresh = Client::connect(addr).await;
    assert_eq!(fresh.request("SET after 1").await, ok());
    assert_eq!(fresh.request("GET after").await, bulk("1"));
    let replaced = direct.only_connection().await;
    assert_ne!(replaced["id"], shared["id"]);
    let mut another = Client::connect(addr).await;
    assert_eq!(another.request("GET after").await, bulk("1"));
    assert_eq!(direct.only_connection().await["id"], replaced["id"]);
}

/// Redis lists a renamed command under its original name (`COMMAND` shows `select`, the
/// server runs `xselect`): the gateway's table does not know the new name. Without an enforce
/// rule such a request is relayed; it must not run on the shared connection.
#[tokio::test]
async fn sharing_renamed_command_does_not_run_on_the_shared_connection() {
    let server = RedisServer::start_with(&["--rename-command", "SELECT", "xselect"]);
    let (addr, _) = gateway(plain_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    let mut plain = Client::connect(addr).await;
    assert_eq!(plain.request("SET r:before b").await, ok());
    let shared = direct.only_connection().await;

    let mut renamer = Client::connect(addr).await;
    assert_eq!(renamer.request("XSELECT 1").await, ok());
    assert_eq!(renamer.request("SET r:renamer a").await, ok());
    assert_eq!(plain.request("SET r:after b").await, ok());

    for (db, key, want) in [
        (0, "r:before", bulk("b")),
        (0, "r:after", bulk("b")),
        (1, "r:after", Frame::Null),
        (1, "r:renamer", bulk("a")),
        (0, "r:renamer", Frame::Null),
    ] {
        direct
            .client
            .send(&[&format!("XSELECT {db}"), &format!("GET {key}"), "XSELECT 0"])
            .await;
        assert_eq!(direct.client.reply().await, ok());
        assert_eq!(direct.client.reply().await, want, "{key} in db {db}");
        assert_eq!(direct.client.reply().await, ok());
    }
    let connections = direct.gateway_connections().await;
    let on_shared = connections
        .iter()
        .find(|c| c["id"] == shared["id"])
        .unwrap();
    assert_eq!(on_shared["db"], "0", "{connections:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharing_fenced_pipelines_of_many_clients_stay_apart() {
    const CLIENTS: usize = 8;
    const WRITES: usize = 10;
    let server = RedisServer::start();
    let (addr, sink) = gateway(sharing_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        tasks.push(tokio::spawn(async move {
            let mut client = Client::connect(addr).await;
            let fence = format!("FENCE fg1~{}~job{c}", c + 1);
            let mut requests = vec![fence];
            for i in 0..WRITES {
                requests.push(format!("SET fenced:{c}:{i} v{c}-{i}"));
                requests.push(format!("GET plain:{c}:{i}"));
            }
            requests.push(format!("GET fenced:{c}:0"));
            let requests: Vec<&str> = requests.iter().map(String::as_str).collect();
            client.send(&requests).await;
            assert_eq!(client.reply().await, ok(), "client {c} FENCE");
            for i in 0..WRITES {
                assert_eq!(client.reply().await, ok(), "client {c} write {i}");
                assert_eq!(client.reply().await, Frame::Null, "client {c} read {i}");
            }
            assert_eq!(client.reply().await, bulk(&format!("v{c}-0")));
            client
        }));
    }
    let mut clients = Vec::new();
    for task in tasks {
        clients.push(task.await.unwrap());
    }
    for c in 0..CLIENTS {
        for i in 0..WRITES {
            assert_eq!(
                direct.get(0, &format!("fenced:{c}:{i}")).await,
                bulk(&format!("v{c}-{i}"))
            );
        }
        assert_eq!(
            direct.get(0, &format!("fencegate:fence:{{job{c}}}")).await,
            bulk(&(c + 1).to_string())
        );
    }
    assert!(sink.events().is_empty(), "{:#?}", sink.events());
    direct.only_connection().await;
}

#[tokio::test]
async fn sharing_pool_size_bounds_the_upstream_connections() {
    let server = RedisServer::start();
    let mut direct = Direct::connect(&server).await;
    for (size, clients, expected) in [(0, 4, 4), (3, 9, 3)] {
        let config = RedisConfig {
            shared_upstream_connections: size,
            ..plain_config(server.addr)
        };
        let (addr, _) = gateway(config).await;
        let mut open = Vec::new();
        for c in 0..clients {
            let mut client = Client::connect(addr).await;
            assert_eq!(
                client.request(&format!("SET pool:{size}:{c} 1")).await,
                ok()
            );
            open.push(client);
        }
        let connections = direct.gateway_connections().await;
        assert_eq!(
            connections.len(),
            expected,
            "shared_upstream_connections = {size}: {connections:#?}"
        );
        drop(open);
        // The next round counts only its own gateway's connections.
        let deadline = tokio::time::Instant::now() + REPLY_WAIT;
        while size == 0 && !direct.gateway_connections().await.is_empty() {
            assert!(tokio::time::Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Redis closes a connection on a request over its `proto-max-bulk-len` (1 MB at the least):
/// one client's large value must not end the shared connection of every other session.
#[tokio::test]
async fn sharing_request_redis_refuses_for_its_size_ends_no_other_session() {
    let server = RedisServer::start_with(&["--proto-max-bulk-len", "1mb"]);
    let (addr, _) = gateway(plain_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    let mut plain = Client::connect(addr).await;
    assert_eq!(plain.request("SET k 1").await, ok());
    let shared = direct.only_connection().await;

    let mut large = Client::connect(addr).await;
    let value = "x".repeat(1_500_000);
    // Redis answers the bulk header and closes its end while the value is still arriving:
    // the gateway's write may then meet the reset before its read meets the error, as a
    // client writing to Redis directly may. Either way the value is not taken.
    large.send(&[&format!("SET large {value}")]).await;
    match large.next().await {
        None => {}
        Some((Frame::Error(e), _)) => assert!(
            String::from_utf8_lossy(&e).contains("invalid bulk length"),
            "{e:?}"
        ),
        Some((other, _)) => panic!("Redis took a value over proto-max-bulk-len: {other:?}"),
    }
    assert_eq!(plain.request("GET k").await, bulk("1"));
    assert_eq!(direct.only_connection().await["id"], shared["id"]);
    // A large value Redis accepts still works (on the session's own connection).
    let mut accepted = Client::connect(addr).await;
    let value = "y".repeat(1_000_000);
    assert_eq!(accepted.request(&format!("SET fits {value}")).await, ok());
    assert_eq!(
        accepted.request("STRLEN fits").await,
        Frame::Integer(1_000_000)
    );
    assert_eq!(plain.request("GET k").await, bulk("1"));
}

/// The fence function flushed upstream while sessions share the connection: the fenced write
/// that meets the missing function is reloaded and sent again (or answered TRYAGAIN when a
/// request of its session is behind it), and the other sessions' replies stay theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharing_fence_reload_keeps_every_session_in_order() {
    let server = RedisServer::start();
    let (addr, sink) = gateway(sharing_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    let mut fenced = Client::connect(addr).await;
    assert_eq!(fenced.request("FENCE fg1~3~job").await, ok());
    assert_eq!(fenced.request("SET fenced:a 1").await, ok());

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut noise = Vec::new();
    for n in 0..3 {
        let stop = stop.clone();
        noise.push(tokio::spawn(async move {
            let mut client = Client::connect(addr).await;
            let mut round = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) || round < 3 {
                let key = format!("noise:{n}:{round}");
                client
                    .send(&[&format!("SET {key} {round}"), &format!("GET {key}")])
                    .await;
                assert_eq!(client.reply().await, ok());
                assert_eq!(client.reply().await, bulk(&round.to_string()));
                round += 1;
            }
        }));
    }

    assert_eq!(direct.client.request("FUNCTION FLUSH").await, ok());
    assert_eq!(fenced.request("SET fenced:a 2").await, ok());
    assert_eq!(direct.get(0, "fenced:a").await, bulk("2"));

    assert_eq!(direct.client.request("FUNCTION FLUSH").await, ok());
    assert_eq!(direct.client.request("SET plain:x x").await, ok());
    fenced.send(&["SET fenced:a 3", "GET plain:x"]).await;
    let first = fenced.reply().await;
    assert_eq!(fenced.reply().await, bulk("x"));
    let want = match &first {
        Frame::Simple(_) => "3",
        Frame::Error(e) if e.starts_with(b"TRYAGAIN") => "2",
        other => panic!("the fenced write got {other:?}"),
    };
    assert_eq!(direct.get(0, "fenced:a").await, bulk(want));
    assert_eq!(fenced.request("SET fenced:a 4").await, ok());

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for task in noise {
        task.await.unwrap();
    }
    assert!(sink.events().is_empty(), "{:#?}", sink.events());
    direct.only_connection().await;
}

/// The process's resident memory, in bytes (`VmRSS`).
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// A client that pipelines large reads and never reads their replies: on a connection of its
/// own, Redis would hold them (under its `client-output-buffer-limit`); on a shared connection
/// the gateway reads them at once for the other sessions' sake, so it must bound what it keeps
/// for one session (DESIGN rule 10) instead of holding every reply the client asked for.
#[tokio::test]
async fn sharing_client_that_never_reads_holds_bounded_memory() {
    const VALUE: usize = 4 * 1024 * 1024;
    const READS: usize = 150;
    let server = RedisServer::start();
    let (addr, _) = gateway(plain_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    let value = "v".repeat(VALUE);
    assert_eq!(
        direct.client.request(&format!("SET big {value}")).await,
        ok()
    );
    drop(value);
    let mut other = Client::connect(addr).await;
    assert_eq!(other.request("GET missing").await, Frame::Null);
    let before = resident_bytes();

    let mut hog = Client::connect(addr).await;
    let reads = vec!["GET big"; READS];
    hog.send(&reads).await;
    // Replies come back in order on the shared connection: once the other session's PING is
    // answered, the gateway has read every reply of the hog's.
    loop {
        let Frame::Bulk(stats) = direct.client.request("INFO commandstats").await else {
            panic!("INFO")
        };
        let stats = String::from_utf8_lossy(&stats).into_owned();
        let gets = stats
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_get:calls="))
            .and_then(|l| l.split(',').next())
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or(0);
        if gets > READS {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(other.request("PING").await, Frame::simple("PONG"));
    // The bound is 64 MiB of replies beyond one, each held parsed and raw; the margin is for
    // the tests running beside this one in the process.
    let grown = resident_bytes().saturating_sub(before);
    eprintln!("resident memory grew {} MiB", grown >> 20);
    assert!(
        grown < 400 * 1024 * 1024,
        "the gateway holds {} MiB for a client that reads nothing ({} MiB of replies asked)",
        grown >> 20,
        (VALUE * READS) >> 20
    );
    // Its session ends after the replies it was given; none is anybody else's.
    let mut got = 0;
    while let Some((frame, _)) = hog.next().await {
        match frame {
            Frame::Bulk(b) if b.len() == VALUE => got += 1,
            Frame::Error(_) => {}
            other => panic!("the hog got {other:?}"),
        }
    }
    assert!(got <= READS);
    assert_eq!(other.request("GET missing").await, Frame::Null);
}

/// While Redis does not read (a slow command of anybody's), a client's pipelined requests
/// wait: on a connection of its own in the socket's buffers, its reader blocked; on a shared
/// connection in the gateway's queue, which must stay bounded as well (DESIGN rule 10) rather
/// than take every request the slot queue admits (4096 of up to 1 MiB per session).
#[tokio::test]
async fn sharing_requests_queued_while_redis_stalls_are_bounded() {
    const VALUE: usize = 512 * 1024;
    const WRITES: usize = 1500;
    let server = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    let (addr, _) = gateway(plain_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    let mut other = Client::connect(addr).await;
    assert_eq!(other.request("GET missing").await, Frame::Null);
    let before = resident_bytes();

    direct.client.send(&["DEBUG SLEEP 3"]).await;
    let mut flood = Client::connect(addr).await;
    let value = "f".repeat(VALUE);
    let request = format!("SET flood {value}");
    let sender = tokio::spawn(async move {
        for _ in 0..WRITES {
            flood.send(&[&request]).await;
        }
        flood
    });
    // The most the gateway held at any time while Redis slept.
    let mut grown = 0;
    let awake = direct.client.reply();
    tokio::pin!(awake);
    loop {
        tokio::select! {
            reply = &mut awake => {
                assert_eq!(reply, ok());
                break;
            }
            () = tokio::time::sleep(Duration::from_millis(10)) => {
                grown = grown.max(resident_bytes().saturating_sub(before));
            }
        }
    }
    eprintln!("resident memory grew {} MiB", grown >> 20);
    let mut flood = sender.await.unwrap();
    for _ in 0..WRITES {
        assert_eq!(flood.reply().await, ok());
    }
    assert_eq!(other.request("GET missing").await, Frame::Null);
    assert!(
        grown < 256 * 1024 * 1024,
        "the gateway queued {} MiB for a stalled Redis ({} MiB sent)",
        grown >> 20,
        (VALUE * WRITES) >> 20
    );
}

/// Waits until the gateway connection `id` upstream satisfies `done`.
async fn until_connection(direct: &mut Direct, id: &str, what: &str, done: fn(&Listed) -> bool) {
    let deadline = tokio::time::Instant::now() + REPLY_WAIT;
    loop {
        let connections = direct.gateway_connections().await;
        let c = connections
            .iter()
            .find(|c| c["id"] == id)
            .expect("the connection is gone");
        if done(c) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: {c:#?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Redis echoes a key name in some errors (`-NOGROUP No such key '<key>' ...`), so a client
/// picks an error line's length: one longer than the gateway reads as a header line (64 KiB)
/// must reach that client, and must not end the shared connection with the requests of
/// other sessions behind it.
#[tokio::test]
async fn sharing_long_error_line_ends_no_other_session() {
    let server = RedisServer::start();
    let (addr, _) = gateway(plain_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    let mut writer = Client::connect(addr).await;
    let mut adversary = Client::connect(addr).await;
    let mut behind = Client::connect(addr).await;
    assert_eq!(writer.request("SET x 1").await, ok());
    assert_eq!(adversary.request("GET x").await, bulk("1"));
    assert_eq!(behind.request("GET x").await, bulk("1"));
    let shared = direct.only_connection().await["id"].clone();

    // Writes pause upstream, so the shared connection waits at the writer's SET and Redis
    // takes what comes behind it into its query buffer, in order.
    assert_eq!(
        direct.client.request("CLIENT PAUSE 30000 WRITE").await,
        ok()
    );
    writer.send(&["SET w 1"]).await;
    until_connection(&mut direct, &shared, "the SET never waited upstream", |c| {
        c["flags"].contains('b') && c["cmd"] == "set"
    })
    .await;
    let key = "k".repeat(900_000);
    adversary.send(&[&format!("XPENDING {key} group")]).await;
    until_connection(
        &mut direct,
        &shared,
        "the XPENDING never reached Redis",
        |c| c["qbuf"].parse::<usize>().unwrap() > 900_000,
    )
    .await;
    behind.send(&["GET x"]).await;
    assert_eq!(direct.client.request("CLIENT UNPAUSE").await, ok());

    assert_eq!(writer.reply().await, ok());
    let reply = adversary.next().await.map(|(frame, _)| frame);
    let Some(Frame::Error(e)) = reply else {
        panic!(
            "XPENDING on a missing key got {:?}",
            reply.map(|f| format!("{f:?}").chars().take(80).collect::<String>())
        )
    };
    assert!(e.starts_with(b"NOGROUP"), "{:?}", &e[..40]);
    assert!(e.len() > 900_000);
    assert_eq!(behind.next().await.map(|(frame, _)| frame), Some(bulk("1")));
    assert_eq!(direct.only_connection().await["id"], shared);
}

/// With a limit on normal clients' output buffers Redis may close a connection for what one
/// client left unread; on a shared connection that would end every session on it, so sessions
/// get connections of their own.
#[tokio::test]
async fn sharing_is_off_when_redis_limits_normal_clients_output() {
    let server = RedisServer::start_with(&["--client-output-buffer-limit", "normal 1mb 1mb 0"]);
    let (addr, _) = gateway(plain_config(server.addr)).await;
    let mut direct = Direct::connect(&server).await;
    let mut one = Client::connect(addr).await;
    let mut two = Client::connect(addr).await;
    assert_eq!(one.request("SET k 1").await, ok());
    assert_eq!(two.request("GET k").await, bulk("1"));
    let connections = direct.gateway_connections().await;
    assert_eq!(connections.len(), 2, "{connections:#?}");
}
