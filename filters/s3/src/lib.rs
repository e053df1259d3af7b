//! fencegate's S3 filter: a pingora gateway in front of one S3 endpoint that verifies every
//! client's SigV4 signature, turns every write to a protected key into a conditional request
//! (object mode: the fence in the object's metadata; manifest mode: an immutable object plus a
//! conditional commit into the resource's manifest), and re-signs it with the gateway's own
//! credentials.
//!
//! - Pure: [`sigv4_verify`] and [`chunked`] (checking what the client sent), [`rewrite`]
//!   (which operation, which object, object mode's conditional write), [`manifest`] (manifest
//!   mode's view, log entry, batch planning and listing), [`error_xml`], [`multi_delete`].
//! - I/O: `proxy` (the pingora service; reads stream through), `connection_bound` (the
//!   listener's bound on client connections, and its TLS handshake), `gateway` (shared state and the
//!   upstream client), `respond`, `body` (verifying bodies as they stream), `session` (one
//!   write request: rule, token, refusal, audit), `replace`, `delete` and `upload_stamp` (object mode),
//!   `manifest_store`, `manifest_write` and `manifest_read` (manifest mode).

#![deny(missing_docs)]

mod body;
pub mod chunked;
pub mod config;
mod connection_bound;
mod delete;
pub mod error;
pub mod error_xml;
mod gateway;
mod group_commit;
pub mod maintenance;
pub mod manifest;
mod manifest_read;
mod manifest_store;
mod manifest_write;
pub mod multi_delete;
mod proxy;
mod replace;
mod respond;
pub mod rewrite;
mod session;
pub mod sigv4_verify;
pub mod upload_stamp;
pub mod upstream;

pub use config::{ProtectMode, ProtectRule, S3Config};
pub use error::S3Error;
pub use gateway::S3Clients;
pub use maintenance::{GcReport, Maintenance};
pub use proxy::{GatewayHandle, S3Gateway};
