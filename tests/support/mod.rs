//! Test harness: real processes and real servers on free loopback ports.
// Each test binary uses only part of the harness.
#![allow(dead_code)]

pub mod audit;
pub mod cluster;
pub mod fd_limit;
pub mod gateway_node;
pub mod postgres_server;
pub mod redis_gateway;
pub mod redis_server;
pub mod s3_gateway;
pub mod s3_server;
pub mod tmpfs;
