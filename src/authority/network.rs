//! Raft RPCs between nodes: JSON over HTTPS with mutual TLS on the peer port (plain HTTP only
//! in insecure mode).

use openraft::error::{
    InstallSnapshotError, NetworkError, PayloadTooLarge, RPCError, RaftError, RemoteError,
    Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::type_config::{Node, NodeId, TypeConfig};

pub const APPEND_PATH: &str = "/raft/append";
pub const VOTE_PATH: &str = "/raft/vote";
pub const SNAPSHOT_PATH: &str = "/raft/snapshot";
/// A member's committed membership, asked by a node that stopped hearing from the leader
/// (see `authority::membership`).
pub const MEMBERSHIP_PATH: &str = "/raft/membership";
/// A draining leader names its successor (see `authority::hand_over`).
pub const HAND_OVER_PATH: &str = "/raft/hand-over";

/// The largest AppendEntries body sent with more than one entry. openraft gives an
/// AppendEntries RPC one heartbeat interval (100 ms by default) to be sent, read and appended
/// (fsync included); a batch of large entries that cannot make it in time is retried whole,
/// and the follower, hearing nothing, campaigns. The log store reads batches up to this size
/// (`LogStore::limited_get_log_entries`); should one still pass it, the network asks openraft
/// to send fewer entries. No one entry comes near it (a restore is proposed in parts of
/// about `state::RESTORE_PART_BYTES`, or one lease).
pub const MAX_APPEND_BYTES: usize = 512 * 1024;

/// Pause between attempts at a peer that refused the connection.
const UNREACHABLE_RETRY: std::time::Duration = std::time::Duration::from_millis(100);

#[derive(Clone)]
pub struct Network {
    http: reqwest::Client,
    scheme: &'static str,
}

impl Network {
    /// `http` presents this node's client certificate when `tls` (see `crate::tls`).
    pub fn new(http: reqwest::Client, tls: bool) -> Self {
        let scheme = if tls { "https" } else { "http" };
        Self { http, scheme }
    }
}

impl Network {
    /// GETs `path` from the peer port at `addr`, bounded by `timeout`.
    pub async fn get<T: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        timeout: std::time::Duration,
    ) -> Result<T, reqwest::Error> {
        let url = format!("{}://{addr}{path}", self.scheme);
        self.http
            .get(url)
            .timeout(timeout)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await
    }
}

impl Network {
    /// POSTs `body` as JSON to `path` on the peer port at `addr`, bounded by `timeout`.
    pub async fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        body: &B,
        timeout: std::time::Duration,
    ) -> Result<T, reqwest::Error> {
        let url = format!("{}://{addr}{path}", self.scheme);
        self.http
            .post(url)
            .json(body)
            .timeout(timeout)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await
    }
}

pub struct Connection {
    http: reqwest::Client,
    scheme: &'static str,
    target: NodeId,
    addr: String,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Connection;

    async fn new_client(&mut self, target: NodeId, node: &Node) -> Connection {
        Connection {
            http: self.http.clone(),
            scheme: self.scheme,
            target,
            addr: node.peer.clone(),
        }
    }
}

impl Connection {
    async fn call<Req, Resp, E>(
        &self,
        path: &str,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<NodeId, Node, RaftError<NodeId, E>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let body = json_body(req).map_err(RPCError::Network)?;
        self.send(path, body, option).await
    }

    /// Sends a request body already serialized to JSON.
    async fn send<Resp, E>(
        &self,
        path: &str,
        body: Vec<u8>,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<NodeId, Node, RaftError<NodeId, E>>>
    where
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let url = format!("{}://{}{}", self.scheme, self.addr, path);
        let sent = self
            .http
            .post(url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .timeout(option.hard_ttl())
            .send()
            .await
            .map_err(|e| {
                // A refused connection marks the peer unreachable, so openraft backs off instead of
                // retrying at once.
                if e.is_connect() {
                    RPCError::Unreachable(Unreachable::new(&e))
                } else {
                    RPCError::Network(NetworkError::new(&e))
                }
            })?;
        let result: Result<Resp, RaftError<NodeId, E>> = sent
            .json()
            .await
            .map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for Connection {
    async fn append_entries(
        &mut self,
        req: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, Node, RaftError<NodeId>>> {
        let body = json_body(&req).map_err(RPCError::Network)?;
        if let Some(fewer) = fewer_entries(req.entries.len(), body.len()) {
            return Err(RPCError::PayloadTooLarge(
                PayloadTooLarge::new_entries_hint(fewer),
            ));
        }
        self.send(APPEND_PATH, body, &option).await
    }

    async fn install_snapshot(
        &mut self,
        req: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, Node, RaftError<NodeId, InstallSnapshotError>>,
    > {
        self.call(SNAPSHOT_PATH, &req, &option).await
    }

    /// openraft waits 500 ms between attempts at a node it cannot reach; a node restarting
    /// would then hear from the leader only after its own election timeout could pass, and
    /// campaign. Retrying every heartbeat or two costs a refused connection on a dead node.
    fn backoff(&self) -> openraft::network::Backoff {
        openraft::network::Backoff::new(std::iter::repeat(UNREACHABLE_RETRY))
    }

    async fn vote(
        &mut self,
        req: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, Node, RaftError<NodeId>>> {
        self.call(VOTE_PATH, &req, &option).await
    }
}

/// `req` as the JSON body of a Raft RPC.
fn json_body<Req: Serialize>(req: &Req) -> Result<Vec<u8>, NetworkError> {
    serde_json::to_vec(req).map_err(|e| NetworkError::new(&e))
}

/// How many entries to send instead, when `entries` entries made a body of `bytes`: about as
/// many as fit in [`MAX_APPEND_BYTES`], at least one. `None` when the batch may go as it is.
fn fewer_entries(entries: usize, bytes: usize) -> Option<u64> {
    if entries <= 1 || bytes <= MAX_APPEND_BYTES {
        return None;
    }
    let fit = (entries as u128 * MAX_APPEND_BYTES as u128 / bytes as u128) as u64;
    Some(fit.clamp(1, entries as u64 - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_over_the_size_is_cut_to_what_fits() {
        assert_eq!(fewer_entries(300, MAX_APPEND_BYTES), None);
        assert_eq!(
            fewer_entries(1, 50 * MAX_APPEND_BYTES),
            None,
            "one entry goes alone"
        );
        assert_eq!(fewer_entries(300, 3 * MAX_APPEND_BYTES), Some(100));
        assert_eq!(fewer_entries(2, 100 * MAX_APPEND_BYTES), Some(1));
        assert_eq!(
            fewer_entries(10, MAX_APPEND_BYTES + 1),
            Some(9),
            "always fewer"
        );
    }
}
