//! Starts `fencegate serve` nodes as real processes on free loopback ports, each with its own
//! data directory, and stops them on drop. Used by the root crate's tests and by
//! `fencegate-chaos`; the binary is the one [`fencegate_bin`] finds.

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use reqwest::StatusCode;
use serde_json::{json, Value};
use tempfile::TempDir;

use crate::fault_proxy::{FaultProxy, LinkFault};
use crate::fencegate_bin::fencegate_bin;

/// Election timeout used by test clusters (upper bound).
pub const ELECTION_MAX: Duration = Duration::from_millis(1000);

pub struct Node {
    pub id: u64,
    pub port: u16,
    /// The peer (Raft) port; `None` when Raft runs on the API port (insecure clusters).
    pub peer: Option<u16>,
    /// The address its peer port is bound on and its Raft calls leave from.
    pub peer_ip: IpAddr,
    pub config: PathBuf,
    child: Option<Child>,
}

/// How a test cluster secures itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Security {
    /// `[security] insecure = true`: plain HTTP, Raft on the API port, no credentials.
    Insecure,
    /// What production runs: `fencegate certs init` certificates, Raft on its own port with
    /// mutual TLS, HTTPS API with credentials. The harness calls the API as admin.
    Tls,
}

/// Where a test cluster's nodes are on the loopback network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// Every node on 127.0.0.1.
    Shared,
    /// Every Raft link through a fault proxy ([`Cluster::start_with_faulty_links`]).
    FaultyLinks,
    /// Each node on an address of its own ([`Cluster::start_tls_on_own_addresses`]).
    OwnAddresses,
}

/// Clusters in one test binary run one at a time: three Raft nodes per test on a 2-core
/// machine is the load these timing-sensitive scenarios are written for.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub struct Cluster {
    _turn: tokio::sync::MutexGuard<'static, ()>,
    pub dir: TempDir,
    pub nodes: Vec<Node>,
    /// Environment given to every node process.
    pub env: Vec<(String, String)>,
    pub http: reqwest::Client,
    pub security: Security,
    /// What the test appended to every node's `[authority]`, for nodes added later.
    extra: String,
    /// With faulty links: node `id`'s inbound proxy at `id - 1`, which its peers reach its Raft
    /// port through (see [`Cluster::start_with_faulty_links`]). Empty otherwise.
    proxies: Vec<FaultProxy>,
}

pub use crate::free_port;

impl Cluster {
    /// Starts `n` nodes forming one cluster; `extra` is appended to each node's `[authority]`.
    pub async fn start(n: usize, extra: &str) -> Self {
        Self::start_with_env(n, extra, &[]).await
    }

    /// Like `start`, with extra environment variables for every node.
    pub async fn start_with_env(n: usize, extra: &str, env: &[(&str, &str)]) -> Self {
        Self::start_configured(n, extra, |_| String::new(), env).await
    }

    /// Like `start_configured`, insecure.
    pub async fn start_configured(
        n: usize,
        extra: &str,
        sections: impl Fn(u64) -> String,
        env: &[(&str, &str)],
    ) -> Self {
        Self::start_secured(Security::Insecure, n, extra, sections, env).await
    }

    /// The certificates and credentials directory of a `Security::Tls` cluster.
    pub fn certs(&self) -> PathBuf {
        self.dir.path().join("certs")
    }

    /// Environment for a CLI process that talks to this cluster as `role` ("client" or
    /// "admin"): its CA and credential. Empty for an insecure cluster.
    pub fn client_env(&self, role: &str) -> Vec<(String, String)> {
        match self.security {
            Security::Insecure => Vec::new(),
            Security::Tls => vec![
                (
                    "FENCEGATE_CA_FILE".into(),
                    self.certs().join("ca.crt").display().to_string(),
                ),
                (
                    "FENCEGATE_CREDENTIAL_FILE".into(),
                    self.certs()
                        .join(format!("{role}.token"))
                        .display()
                        .to_string(),
                ),
            ],
        }
    }

    /// Like `start_with_env`; `sections(id)` is appended to node `id`'s config after
    /// `[authority]` (its own gateway sections, say).
    pub async fn start_secured(
        security: Security,
        n: usize,
        extra: &str,
        sections: impl Fn(u64) -> String,
        env: &[(&str, &str)],
    ) -> Self {
        Self::start_inner(security, Layout::Shared, n, ("", extra), sections, env).await
    }

    /// A TLS cluster whose nodes each have an address of their own, as on separate hosts:
    /// node `id` binds its peer port on, is advertised at, and sends its Raft calls from
    /// [`source_ip`]`(id)`. `node` is added to every node's `[node]` section.
    pub async fn start_tls_on_own_addresses(n: usize, node: &str) -> Self {
        let layout = Layout::OwnAddresses;
        Self::start_inner(Security::Tls, layout, n, (node, ""), |_| String::new(), &[]).await
    }

    /// Like `start_configured`, with every Raft link between two nodes going through a
    /// [`FaultProxy`] the test controls ([`Cluster::set_link`], [`Cluster::set_links_of`]).
    /// Each node binds its peer port on 127.0.0.1 and is advertised to its peers (its
    /// `[authority] members` entry) at its own inbound proxy; it sends its Raft RPCs from its own
    /// address, [`source_ip`] (`[node] peer_source`), so every proxy knows whose traffic it
    /// relays. Client and forwarded API calls do not go through the proxies.
    pub async fn start_with_faulty_links(
        n: usize,
        extra: &str,
        sections: impl Fn(u64) -> String,
        env: &[(&str, &str)],
    ) -> Self {
        let layout = Layout::FaultyLinks;
        Self::start_inner(Security::Insecure, layout, n, ("", extra), sections, env).await
    }

    /// `(node, extra)`: added to every node's `[node]` and `[authority]` sections.
    async fn start_inner(
        security: Security,
        layout: Layout,
        n: usize,
        (node, extra): (&str, &str),
        sections: impl Fn(u64) -> String,
        env: &[(&str, &str)],
    ) -> Self {
        let turn = ONE_AT_A_TIME.lock().await;
        let faulty_links = layout == Layout::FaultyLinks;
        let own_addresses = layout == Layout::OwnAddresses;
        let peer_ip = |id: u64| {
            if own_addresses {
                source_ip(id)
            } else {
                IpAddr::V4(Ipv4Addr::LOCALHOST)
            }
        };
        let dir = TempDir::new().unwrap();
        let ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let peers: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let certs = dir.path().join("certs");
        let mut http = reqwest::Client::builder();
        if security == Security::Tls {
            let mut args = vec!["certs".to_owned(), "init".into(), "--dir".into()];
            args.push(certs.display().to_string());
            for id in 1..=n as u64 {
                args.extend([
                    "--node".into(),
                    format!("{id}={},127.0.0.1,localhost", peer_ip(id)),
                ]);
            }
            let out = Command::new(fencegate_bin()).args(&args).output().unwrap();
            assert!(out.status.success(), "certs init: {out:?}");
            let ca = std::fs::read(certs.join("ca.crt")).unwrap();
            let admin = std::fs::read_to_string(certs.join("admin.token")).unwrap();
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(
                reqwest::header::AUTHORIZATION,
                format!("Bearer {}", admin.trim()).parse().unwrap(),
            );
            http = http
                .use_rustls_tls()
                .add_root_certificate(reqwest::Certificate::from_pem(&ca).unwrap())
                .default_headers(headers);
        }
        let mut proxies = Vec::new();
        if faulty_links {
            for q in &peers {
                let upstream = SocketAddr::from((Ipv4Addr::LOCALHOST, *q));
                proxies.push(
                    FaultProxy::start(upstream)
                        .await
                        .expect("start a fault proxy"),
                );
            }
        }
        // Where the peers reach each node's Raft port: its inbound proxy, if any.
        let advertised: Vec<u16> = if faulty_links {
            proxies.iter().map(|p| p.addr().port()).collect()
        } else {
            peers.clone()
        };
        let members: Vec<String> = ports
            .iter()
            .zip(&advertised)
            .enumerate()
            .map(|(i, (p, q))| match (security, faulty_links) {
                (Security::Insecure, false) => {
                    format!("{{ id = {}, api = \"127.0.0.1:{p}\" }}", i + 1)
                }
                _ => format!(
                    "{{ id = {}, api = \"127.0.0.1:{p}\", peer = \"{}:{q}\" }}",
                    i + 1,
                    peer_ip(i as u64 + 1)
                ),
            })
            .collect();
        let mut nodes = Vec::new();
        for (i, port) in ports.iter().enumerate() {
            let id = i as u64 + 1;
            let peer = (security == Security::Tls || faulty_links).then_some(peers[i]);
            let authority = format!("members = [{}]\n{extra}", members.join(", "));
            let config = dir.path().join(format!("node{id}.toml"));
            let mut node_extra = node.to_owned();
            if !node_extra.is_empty() && !node_extra.ends_with('\n') {
                node_extra.push('\n');
            }
            if faulty_links || own_addresses {
                node_extra.push_str(&format!("peer_source = \"{}\"\n", source_ip(id)));
            }
            let text = config_text(
                security,
                dir.path(),
                id,
                *port,
                (peer.map(|q| (peer_ip(id), q)), &node_extra),
                &authority,
                &sections(id),
            );
            std::fs::write(&config, text).unwrap();
            nodes.push(Node {
                id,
                port: *port,
                peer,
                peer_ip: peer_ip(id),
                config,
                child: None,
            });
        }
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut cluster = Self {
            _turn: turn,
            dir,
            nodes,
            env,
            http: http.build().unwrap(),
            security,
            extra: extra.to_owned(),
            proxies,
        };
        for id in 1..=n as u64 {
            cluster.spawn(id);
        }
        cluster.wait_for_leader(&cluster.ids()).await;
        cluster
    }

    /// Writes the config of one more node, numbered after the others, in join mode (it forms
    /// no cluster and waits for `cluster add-node`), and starts it. With TLS its certificate
    /// comes from `certs add-node`, signed by the cluster's CA. Returns its id.
    pub fn spawn_joining(&mut self) -> u64 {
        let id = self.nodes.len() as u64 + 1;
        let port = free_port();
        let peer = (self.security == Security::Tls).then(free_port);
        if self.security == Security::Tls {
            let out = Command::new(fencegate_bin())
                .args(["certs", "add-node", "--dir"])
                .arg(self.certs())
                .args(["--node", &format!("{id}=127.0.0.1,localhost")])
                .output()
                .unwrap();
            assert!(out.status.success(), "certs add-node: {out:?}");
        }
        let authority = format!("join = true\n{}", self.extra);
        let config = self.dir.path().join(format!("node{id}.toml"));
        let text = config_text(
            self.security,
            self.dir.path(),
            id,
            port,
            (peer.map(|q| (IpAddr::V4(Ipv4Addr::LOCALHOST), q)), ""),
            &authority,
            "",
        );
        std::fs::write(&config, text).unwrap();
        self.nodes.push(Node {
            id,
            port,
            peer,
            peer_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            config,
            child: None,
        });
        self.spawn(id);
        id
    }

    /// Applies `fault` to the Raft link from node `from` to node `to`: the connections `from`
    /// opens to `to` (its requests and `to`'s answers). Panics unless the cluster was started
    /// with faulty links.
    pub fn set_link(&self, from: u64, to: u64, fault: LinkFault) {
        assert!(
            !self.proxies.is_empty(),
            "set_link needs Cluster::start_with_faulty_links"
        );
        self.proxies[to as usize - 1].set(source_ip(from), fault);
    }

    /// Applies `fault` to every Raft link to and from node `id`: with `LinkFault::Partition`,
    /// the node is cut off from the others both ways.
    pub fn set_links_of(&self, id: u64, fault: LinkFault) {
        for other in self.ids_but(id) {
            self.set_link(id, other, fault);
            self.set_link(other, id, fault);
        }
    }

    /// Every Raft link passes again.
    pub fn heal_links(&self) {
        for proxy in &self.proxies {
            proxy.heal();
        }
    }

    /// `host:port` of node `id`'s Raft RPCs, as `cluster add-node --peer` takes it.
    pub fn peer_addr(&self, id: u64) -> String {
        let node = self.node(id);
        match node.peer {
            Some(peer) => SocketAddr::from((node.peer_ip, peer)).to_string(),
            None => format!("127.0.0.1:{}", node.port),
        }
    }

    /// `host:port` of node `id`'s API, as `cluster add-node --api` takes it.
    pub fn api_addr(&self, id: u64) -> String {
        format!("127.0.0.1:{}", self.node(id).port)
    }

    /// The APIs of `ids`, in that order, comma-separated, as the CLI takes them.
    pub fn endpoints_of(&self, ids: &[u64]) -> String {
        ids.iter()
            .map(|id| self.url(*id))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn ids(&self) -> Vec<u64> {
        self.nodes.iter().map(|n| n.id).collect()
    }

    /// Every node's id but `id`'s (a leader's followers, say).
    pub fn ids_but(&self, id: u64) -> Vec<u64> {
        self.ids()
            .into_iter()
            .filter(|other| *other != id)
            .collect()
    }

    fn node(&self, id: u64) -> &Node {
        &self.nodes[id as usize - 1]
    }

    pub fn url(&self, id: u64) -> String {
        let scheme = match self.security {
            Security::Insecure => "http",
            Security::Tls => "https",
        };
        format!("{scheme}://127.0.0.1:{}", self.node(id).port)
    }

    /// Every node's API, comma-separated, as the CLI takes them.
    pub fn endpoints(&self) -> String {
        self.endpoints_of(&self.ids())
    }

    pub fn log_path(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("node{id}.log"))
    }

    pub fn data_dir(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("data{id}"))
    }

    pub fn spawn(&mut self, id: u64) {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path(id))
            .unwrap();
        let env = self.env.clone();
        let node = &mut self.nodes[id as usize - 1];
        assert!(node.child.is_none(), "node {id} is already running");
        let child = Command::new(fencegate_bin())
            .args(["serve", "--config"])
            .arg(&node.config)
            .env("FENCEGATE_LOG", "info,openraft=warn")
            .envs(env)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start fencegate serve");
        node.child = Some(child);
    }

    pub fn pid(&self, id: u64) -> Pid {
        Pid::from_raw(self.node(id).child.as_ref().expect("node is running").id() as i32)
    }

    pub fn signal(&self, id: u64, signal: Signal) {
        kill(self.pid(id), signal).unwrap();
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self, id: u64) {
        let node = &mut self.nodes[id as usize - 1];
        if let Some(mut child) = node.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits up to `within` for node `id`'s process to exit by itself (after SIGTERM, say) and
    /// reaps it; `None` if it is still running then.
    pub async fn wait_exit(
        &mut self,
        id: u64,
        within: Duration,
    ) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            let node = &mut self.nodes[id as usize - 1];
            let child = node.child.as_mut().expect("node is running");
            if let Some(status) = child.try_wait().unwrap() {
                node.child = None;
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Node `id`'s `/v1/cluster` answer, `None` when it does not answer.
    pub async fn cluster_view(&self, id: u64) -> Option<Value> {
        match self.get(id, "/v1/cluster").await {
            Some((StatusCode::OK, view)) => Some(view),
            _ => None,
        }
    }

    /// Node `id`'s `/metrics` text.
    pub async fn metrics(&self, id: u64) -> String {
        self.http
            .get(format!("{}/metrics", self.url(id)))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .unwrap_or_else(|e| panic!("node {id} did not answer /metrics: {e}"))
            .text()
            .await
            .unwrap_or_else(|e| panic!("node {id}'s /metrics: {e}"))
    }

    /// GET `path` on node `id`; `None` when the node does not answer.
    pub async fn get(&self, id: u64, path: &str) -> Option<(StatusCode, Value)> {
        let answer = self
            .http
            .get(format!("{}{path}", self.url(id)))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .ok()?;
        let status = answer.status();
        Some((status, answer.json().await.unwrap_or(Value::Null)))
    }

    /// POST/DELETE helpers return status and JSON body.
    pub async fn call(
        &self,
        id: u64,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.url(id)))
            .timeout(Duration::from_secs(30));
        if let Some(body) = body {
            req = req.json(&body);
        }
        let answer = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("node {id} did not answer {path}: {e}"));
        let status = answer.status();
        (status, answer.json().await.unwrap_or(Value::Null))
    }

    /// Waits until every node in `among` names the same leader, itself one of `among`.
    pub async fn wait_for_leader(&self, among: &[u64]) -> u64 {
        let nodes: Vec<(u64, String)> = among.iter().map(|id| (*id, self.url(*id))).collect();
        agreed_leader(self.http.clone(), nodes, self.dir.path().to_owned()).await
    }

    /// Acquires `resource` through node `id` and returns the grant's JSON (see
    /// [`Cluster::call_with_a_leader`]).
    pub async fn acquire(&self, id: u64, resource: &str, ttl_ms: u64) -> Value {
        let (status, body) = self
            .call_with_a_leader(
                id,
                reqwest::Method::POST,
                &format!("/v1/locks/{resource}"),
                Some(json!({ "ttl_ms": ttl_ms })),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "acquire {resource}: {body}");
        body
    }

    /// Releases a lease through node `id` (see [`Cluster::call_with_a_leader`]).
    pub async fn release(&self, id: u64, lease_id: &str) {
        let (status, body) = self
            .call_with_a_leader(
                id,
                reqwest::Method::DELETE,
                &format!("/v1/leases/{lease_id}"),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::OK, "release {lease_id}: {body}");
    }

    /// [`Cluster::call`], retried while node `id` answers 503 `no_leader`. That answer asks to
    /// retry, and on a loaded machine an election can start mid-test (CI saw one), so it is
    /// retried for up to 10 s, as a client following the API would; the request was not
    /// applied. Returns the first other answer.
    pub async fn call_with_a_leader(
        &self,
        id: u64,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let (status, answer) = self.call(id, method.clone(), path, body.clone()).await;
            let leaderless =
                status == StatusCode::SERVICE_UNAVAILABLE && answer["error"] == "no_leader";
            if leaderless && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            return (status, answer);
        }
    }

    /// Runs the CLI with `args` and returns (exit code, stdout as JSON or text).
    pub fn cli(&self, args: &[&str]) -> (i32, String) {
        let out = Command::new(fencegate_bin())
            .args(args)
            .env_remove("FENCEGATE_ENDPOINT")
            .envs(self.client_env("admin"))
            .output()
            .expect("run fencegate");
        let code = out.status.code().unwrap_or(-1);
        let mut text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if code != 0 {
            text.push_str(&format!(
                "\nstderr: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        (code, text)
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                // A stopped process ignores SIGKILL until resumed on some kernels' accounting;
                // resume first so it dies now.
                let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGCONT);
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// The address node `id` sends its Raft RPCs from in a cluster with faulty links:
/// 127.0.1.`id` (all of 127.0.0.0/8 is loopback on Linux).
pub fn source_ip(id: u64) -> IpAddr {
    let id = u8::try_from(id).expect("at most 255 nodes");
    IpAddr::V4(Ipv4Addr::new(127, 0, 1, id))
}

/// Node `id`'s config: `[node]` on `port` (and `peer`, followed by more `[node]` keys),
/// `authority` as its `[authority]` section, then `sections`, then `[security]` for `security`
/// (certificates in `dir/certs`).
fn config_text(
    security: Security,
    dir: &Path,
    id: u64,
    port: u16,
    (peer, node_extra): (Option<(IpAddr, u16)>, &str),
    authority: &str,
    sections: &str,
) -> String {
    let certs = dir.join("certs");
    format!(
        "[node]\nid = {id}\napi = \"127.0.0.1:{port}\"\n{peer}{node_extra}data_dir = \"{}\"\n\n[authority]\n{authority}\n{sections}\n\n[security]\n{}",
        dir.join(format!("data{id}")).display(),
        match security {
            Security::Insecure => "insecure = true\n".to_owned(),
            Security::Tls => format!(
                "ca_file = \"{c}/ca.crt\"\ncert_file = \"{c}/node{id}.crt\"\nkey_file = \"{c}/node{id}.key\"\ncredentials_file = \"{c}/credentials\"\n",
                c = certs.display()
            ),
        },
        peer = peer.map_or(String::new(), |(ip, p)| format!("peer = \"{}\"\n", SocketAddr::from((ip, p)))),
    )
}

/// Waits until every node of `nodes` (id, API URL) names the same leader, itself one of them.
/// Owns its arguments, so a test can run it as a task while it handles other events.
pub async fn agreed_leader(http: reqwest::Client, nodes: Vec<(u64, String)>, logs: PathBuf) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    let among: Vec<u64> = nodes.iter().map(|(id, _)| *id).collect();
    loop {
        let mut seen = Vec::new();
        for (_, url) in &nodes {
            let answer = http
                .get(format!("{url}/v1/cluster"))
                .timeout(Duration::from_secs(5))
                .send()
                .await;
            if let Ok(answer) = answer {
                if answer.status() == StatusCode::OK {
                    let v: Value = answer.json().await.unwrap_or(Value::Null);
                    seen.push(v["leader_id"].as_u64());
                }
            }
        }
        if seen.len() == nodes.len() {
            if let Some(Some(leader)) = seen.first() {
                if seen.iter().all(|s| *s == Some(*leader)) && among.contains(leader) {
                    return *leader;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "no agreed leader among {among:?} after 30 s; saw {seen:?}; logs in {}",
            logs.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
