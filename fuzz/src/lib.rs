//! The checks behind each fuzz target. Each `check` takes arbitrary bytes and panics only when
//! a parser breaks a property it promises (never panics, split-invariant, round-trips, or a
//! differential against another implementation). The targets in `fuzz_targets/` call them, and
//! `tests/corpus.rs` runs the committed seed corpora through them as ordinary tests.

pub mod postgres_message;
pub mod postgres_shape_cache;
pub mod redis_frame;
pub mod s3_chunked;
pub mod s3_sigv4;
pub mod token_parse;

/// Splits `data` into pieces whose sizes cycle through `sizes` (each 1 to 16 bytes), as a
/// socket might deliver it.
pub fn pieces<'a>(data: &'a [u8], seed: u8) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let mut rest = data;
    let mut step = seed;
    while !rest.is_empty() {
        let n = (usize::from(step % 16) + 1).min(rest.len());
        out.push(&rest[..n]);
        rest = &rest[n..];
        step = step.wrapping_mul(31).wrapping_add(7);
    }
    out
}
