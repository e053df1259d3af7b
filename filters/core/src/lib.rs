//! The contract every fencegate filter shares.
//!
//! A fencing token names a resource and the revision at which its lock was created. A store
//! accepts a write only if the fence it keeps for the resource is not above the token's revision
//! (`fence <= token`), and raises the fence to that revision in the same atomic step. This crate
//! holds the pieces every filter needs to do that the same way: resource names, the token string
//! (parsing, encoding, signing) and the policy that decides which presented tokens are accepted.
//! Its network code is what every gateway's sessions share: the plain-or-TLS stream, TLS
//! settings built from files, and the cap on client connections.

#![deny(missing_docs)]

mod attempt;
mod audit_record;
mod audit_sink;
mod connection_cap;
mod error;
mod fence_reset;
mod idle_timer;
mod issued_revision;
mod key_ring;
mod observer;
mod policy;
mod poll_on_wake;
mod refusal_budget;
mod resource;
mod revision;
mod run_queue_yield;
mod server_cert;
mod session_thread;
mod signal;
mod store;
pub mod stream;
mod tarpit;
pub mod tls;
mod token;
mod token_key;
mod verdict;

pub use attempt::Attempt;
pub use audit_record::{
    now_millis, rfc3339_millis, AuditEvent, AuditRecord, OperationSummary, GENESIS_HASH,
};
pub use audit_sink::{AuditSink, AuditSinkError, MemoryAuditSink, SinkFuture};
pub use connection_cap::{Admission, ConnectionCap};
pub use error::{ResourceError, TokenError, UnknownStore};
pub use fence_reset::FenceReset;
pub use idle_timer::IdleTimer;
pub use issued_revision::IssuedRevision;
pub use key_ring::{KeyRing, KeyState, SharedKeyRing};
pub use observer::{Observer, OpenConnection, UpstreamFailure};
pub use policy::TokenPolicy;
pub use poll_on_wake::PollOnWake;
pub use refusal_budget::{Charge, RefusalBudget};
pub use resource::Resource;
pub use revision::Revision;
pub use run_queue_yield::RunQueueYield;
pub use server_cert::ServerCert;
pub use session_thread::SessionThreads;
pub use signal::Signal;
pub use store::Store;
pub use tarpit::Tarpit;
pub use token::{Token, MAX_TOKEN_LEN, TOKEN_PREFIX};
pub use token_key::TokenKey;
pub use verdict::{RejectReason, Rejection, Verdict};
