//! openraft's type configuration for the authority.

use std::io::Cursor;

use super::state::{Command, Outcome};

pub type NodeId = u64;

openraft::declare_raft_types!(
    /// Raft types: commands and outcomes of the lease state machine.
    pub TypeConfig:
        D = Command,
        R = Outcome,
);

pub type Raft = openraft::Raft<TypeConfig>;
pub type StorageError = openraft::StorageError<NodeId>;
