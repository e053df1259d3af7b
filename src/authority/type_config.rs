//! openraft's type configuration for the authority.

use std::io::Cursor;

use serde::{Deserialize, Serialize};

use super::state::{Command, Outcome};

pub type NodeId = u64;

/// A member as the Raft membership records it: where peers reach its Raft RPCs and where
/// clients (and forwarding followers) reach its API. Carried in the membership itself, so a
/// node added online is reachable by every member without a config change.
///
/// Stored as `{"addr": <peer>, "api": <api>}`: `addr` is the field of openraft's `BasicNode`,
/// which clusters formed before online membership changes have in their logs and snapshots.
/// Those entries read back with an empty `api`, and the member's API address is then taken
/// from `[[authority.members]]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    /// `host:port` of the Raft (peer) port.
    #[serde(rename = "addr")]
    pub peer: String,
    /// `host:port` of the client API; empty for a member recorded before this field existed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub api: String,
}

openraft::declare_raft_types!(
    /// Raft types: commands and outcomes of the lease state machine, members with both
    /// addresses.
    pub TypeConfig:
        D = Command,
        R = Outcome,
        Node = Node,
);

pub type Raft = openraft::Raft<TypeConfig>;
pub type StorageError = openraft::StorageError<NodeId>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_basic_node_from_an_older_log_reads_back_without_api() {
        let old = serde_json::to_string(&openraft::BasicNode::new("127.0.0.1:7170")).unwrap();
        let node: Node = serde_json::from_str(&old).unwrap();
        assert_eq!(node.peer, "127.0.0.1:7170");
        assert_eq!(node.api, "");
        let new = Node {
            peer: "127.0.0.1:7170".into(),
            api: "127.0.0.1:7070".into(),
        };
        let text = serde_json::to_string(&new).unwrap();
        // An older node reads the peer address it knows as `addr`.
        let basic: openraft::BasicNode = serde_json::from_str(&text).unwrap();
        assert_eq!(basic.addr, "127.0.0.1:7170");
        assert_eq!(serde_json::from_str::<Node>(&text).unwrap(), new);
    }
}
