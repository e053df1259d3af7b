//! Test harness: real processes and real servers on free loopback ports.
// Each test binary uses only part of the harness.
#![allow(dead_code)]

pub mod audit;
pub mod cluster;
pub mod gateway_node;
pub mod metrics;
pub mod postgres_server;
pub mod redis_gateway;
pub mod s3_gateway;

// Shared with the filters' tests and the benchmarks.
#[allow(unused_imports)] // each test binary uses part of it
pub use fencegate_testkit::{fd_limit, free_port, redis_client, redis_server, s3_server, tmpfs};
