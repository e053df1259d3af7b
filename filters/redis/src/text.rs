//! Text for logs, audit records and error replies: never more than a bounded prefix of a
//! client's bytes.

/// Lossy UTF-8 of at most `max` bytes of `bytes`, with `…` when cut.
pub fn lossy(bytes: &[u8], max: usize) -> String {
    let mut text = String::from_utf8_lossy(&bytes[..bytes.len().min(max)]).into_owned();
    if bytes.len() > max {
        text.push('…');
    }
    text
}
