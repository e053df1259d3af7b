//! The lease service (Raft authority) against a real cluster of `fencegate serve` processes: one
//! test binary, one module per concern.

mod support;

mod authority {
    mod api;
    mod failover;
    mod failover_time;
    mod faults;
    mod lease;
    mod membership;
    mod peer_port;
    mod tokens;
}
