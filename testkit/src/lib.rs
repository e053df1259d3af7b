//! Test scaffolding shared by the root crate's tests, the filters' tests and the benchmarks:
//! free loopback ports and real store servers (redis-server, moto's S3 server) started on them.
//! One copy, so that a fix to how a server is started reaches every test.

pub mod fd_limit;
pub mod port;
pub mod redis_client;
pub mod redis_server;
pub mod s3_server;
pub mod tmpfs;

pub use port::free_port;
