//! fencegate's S3 filter: a pingora gateway in front of one S3 endpoint that verifies every
//! client's SigV4 signature, turns every write to a protected bucket into a conditional request
//! that carries the writer's fence in the object's metadata, and re-signs it with the gateway's
//! own credentials.
//!
//! - [`sigv4_verify`] and [`chunked`]: checking what the client sent (signature, payload hash,
//!   `aws-chunked` chunk signatures). [`rewrite`]: the pure decisions (which operation, which
//!   object, how a fenced write becomes a conditional one). [`error_xml`]: S3 error bodies.
//! - `proxy` (the pingora service, reads stream through) and `session` (fenced writes, the
//!   only module that talks to the store for writes) hold the I/O.

#![deny(missing_docs)]

pub mod chunked;
pub mod config;
pub mod error;
pub mod error_xml;
pub mod manifest;
mod manifest_read;
mod manifest_store;
mod manifest_write;
pub mod multi_delete;
mod proxy;
pub mod rewrite;
mod session;
pub mod sigv4_verify;
pub mod upstream;

pub use config::{ProtectMode, ProtectRule, S3Config};
pub use error::S3Error;
pub use proxy::{GatewayHandle, S3Gateway};
