//! The Redis filter in process in front of a real redis-server: one test binary, one module
//! per concern. `accept_emfile.rs` (it lowers the process's file limit) and
//! `trickle_latency.rs` (a latency measurement) stay binaries of their own.

mod gateway {
    mod availability;
    mod bypass_regressions;
    mod connection_cap;
    mod durability;
    mod fenced_pipeline;
    mod glob_differential;
    mod harness;
    mod in_process;
    mod keyspec_differential;
    mod refusal_tarpit;
    mod reply_streams;
    mod sharing_differential;
    mod sharing_end_to_end;
}
