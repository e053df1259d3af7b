//! Test scaffolding shared by the root crate's tests, the filters' tests and the benchmarks:
//! free loopback ports, real store servers (redis-server, PostgreSQL, moto's S3 server) started on them,
//! clusters of real `fencegate serve` processes, and the C `fencegate.enforce()` built for them.
//! One copy, so that a fix to how a server is started reaches every test.

mod build_artifact;
pub mod cluster;
pub mod enforce_library;
pub mod fault_proxy;
pub mod fd_limit;
pub mod fencegate_bin;
pub mod port;
pub mod postgres_server;
pub mod redis_client;
pub mod redis_module;
pub mod redis_server;
pub mod s3_server;
pub mod tmpfs;

pub use fencegate_bin::fencegate_bin;
pub use port::free_port;
