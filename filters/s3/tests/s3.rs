//! The S3 gateway in process in front of moto: one test binary, one module per concern
//! (`s3_tls.rs` and `s3_upstream_tls.rs` stay binaries of their own: they set a process-wide
//! environment variable, `S3_CA_BUNDLE`).

mod harness;

mod s3 {
    mod awscli;
    mod basic;
    mod connection_bound;
    mod malformed;
    mod manifest;
    mod paused;
    mod race;
    mod refusals;
    mod streaming;
    mod timeouts;
    mod walkarounds;
}
