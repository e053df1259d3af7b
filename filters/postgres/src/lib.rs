//! fencegate's PostgreSQL filter: a v3 wire-protocol gateway in front of one PostgreSQL server
//! that runs the fence guard `fencegate.guard(resource, revision)` (see `fence.sql`) in the same
//! transaction as every write, before it, and where the protocol allows in the same round trip.
//!
//! - [`message`]: framing and the few messages the gateway reads or synthesizes, on top of the
//!   `postgres-protocol` codec. [`classify`]: read/write classification with `pg_query`
//!   (PostgreSQL's own parser), failing closed; [`classify_cache`]: its results reused for
//!   statements that differ only in literal values. [`carrier`]: where tokens come from.
//!   [`rewrite`]: the pure rewrite of a statement and token into the messages sent upstream.
//!   `session`: the only I/O module, one client connection to one upstream connection.
//! - The store enforces the fence, not the parser: `fence.sql`'s `fencegate.guard(token)` verifies
//!   the token in PostgreSQL and leaves a transaction-scoped pass, and statement-level triggers
//!   installed by [`protect()`] refuse writes to protected tables without one, even on connections
//!   that bypass the gateway. [`install_token_keys`] gives the store the cluster's token keys;
//!   [`status()`] lists what is protected.
//! - Refusals are `ErrorResponse`s with the SQLSTATEs in [`sqlstate`]; each is reported to the
//!   [`fencegate_core::AuditSink`] before the client sees it.
//!
//! Why these libraries:
//! - **`postgres-protocol`** (the codec under tokio-postgres, maintained with it) rather than
//!   pgwire: the gateway *relays* a session, byte-for-byte wherever it does not rewrite, and
//!   only needs to frame messages, decode a few (ErrorResponse, ReadyForQuery) and encode the
//!   guard's own. pgwire is a server framework that terminates the protocol; relaying through
//!   it would mean decoding and re-encoding every message and re-implementing each login
//!   method. postgres-protocol is small and pure Rust.
//! - **`pg_query`** (libpg_query: PostgreSQL's own grammar built as a library) rather than
//!   sqlparser-rs: fencing must split multi-statement strings exactly where the server will
//!   (the guard is spliced at those offsets) and tell reads from writes for every construct
//!   the server accepts; an approximate grammar would either refuse valid reads or, worse, let
//!   a write through as a read. The cost is a C build (needs `libclang-dev` for bindgen).

#![deny(missing_docs)]

pub mod carrier;
pub mod classify;
pub mod classify_cache;
pub mod config;
pub mod connect;
pub mod dsn_tls;
pub mod enforce;
pub mod error;
mod fence_reset;
mod gateway;
pub mod install;
pub mod key_sync;
mod lazy_writer;
pub mod lexing;
pub mod message;
pub mod protect;
pub mod rewrite;
mod session;
pub mod sqlstate;
pub mod status;
pub mod tls;
pub mod token_keys;
pub mod upstream;

pub use config::{PostgresConfig, UpstreamTls};
pub use enforce::Enforce;
pub use error::PostgresError;
pub use fence_reset::reset_fence;
pub use gateway::Gateway;
pub use install::{install, install_with, InstallOptions, InstallReport, FENCE_SQL};
pub use protect::{protect, ProtectReport, Target};
pub use status::{status, Status};
pub use token_keys::install_token_keys;
