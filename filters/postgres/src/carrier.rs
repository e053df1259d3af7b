//! Where a client puts its fencing token, and how the gateway finds it:
//!
//! - a sqlcommenter-style comment in the statement: `/* fencing_token='fg1~7~job' */`
//!   (values may be percent-encoded, as sqlcommenter libraries do); it applies to that
//!   statement only and wins over the session token;
//! - `SET fencegate.token = '...'` / `RESET fencegate.token` for the session (intercepted by the
//!   gateway; see [`crate::classify::Kind::SetToken`]). As for any setting, `RESET` (and
//!   `RESET ALL`, `DISCARD ALL`) go back to the startup option's value, if there was one;
//! - the startup option `options=-c fencegate.token=...` (removed before the startup packet is
//!   relayed, so the token does not reach the server's logs).

/// The sqlcommenter key the gateway reads.
pub const COMMENT_KEY: &str = "fencing_token";
/// The setting name used by `SET` and the startup option.
pub const SETTING: &str = "fencegate.token";

/// The token in a `/* ... */` comment's text, if it has a `fencing_token='...'` pair.
pub fn comment_token(comment: &str) -> Option<String> {
    let inner = comment
        .strip_prefix("/*")
        .and_then(|c| c.strip_suffix("*/"))
        .unwrap_or(comment);
    for pair in inner.split(',') {
        let Some((key, value)) = pair.split_once('=') else {
            continue;
        };
        if key.trim() != COMMENT_KEY {
            continue;
        }
        let value = value.trim();
        let value = value
            .strip_prefix('\'')
            .and_then(|v| v.strip_suffix('\''))
            .unwrap_or(value);
        return Some(percent_decode(value));
    }
    None
}

/// Decodes `%XX` escapes; a malformed escape is kept as written.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            if let Some(b) = hex {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Splits the token out of a startup `options` value (`-c fencegate.token=...`,
/// `-cfencegate.token=...` or `--fencegate.token=...`). Returns the token, if any, and the
/// options without it (other options are kept as written, backslash escapes included).
pub fn startup_token(options: &str) -> (Option<String>, String) {
    let words = split_options(options);
    let mut token = None;
    let mut kept: Vec<&str> = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let (raw, value) = &words[i];
        let setting = if value == "-c" {
            words.get(i + 1).map(|(_, v)| (v.as_str(), 2))
        } else if let Some(rest) = value.strip_prefix("-c") {
            Some((rest, 1))
        } else {
            value.strip_prefix("--").map(|rest| (rest, 1))
        };
        if let Some((setting, used)) = setting {
            // Setting names are case-insensitive to the server: so here (issue 12).
            if let Some(v) = setting
                .get(..SETTING.len())
                .filter(|p| p.eq_ignore_ascii_case(SETTING))
                .and_then(|_| setting[SETTING.len()..].strip_prefix('='))
            {
                token = Some(v.to_owned());
                i += used;
                continue;
            }
        }
        kept.push(raw);
        i += 1;
    }
    (token, kept.join(" "))
}

/// Splits on unescaped whitespace, as the server does: each word raw and unescaped.
fn split_options(options: &str) -> Vec<(&str, String)> {
    let mut words = Vec::new();
    let mut start = None;
    let mut value = String::new();
    let mut escaped = false;
    for (i, c) in options.char_indices() {
        if escaped {
            value.push(c);
            escaped = false;
            continue;
        }
        if c.is_ascii_whitespace() {
            if let Some(s) = start.take() {
                words.push((&options[s..i], std::mem::take(&mut value)));
            }
            continue;
        }
        start.get_or_insert(i);
        if c == '\\' {
            escaped = true;
        } else {
            value.push(c);
        }
    }
    if let Some(s) = start {
        words.push((&options[s..], value));
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comment_carrier_golden() {
        assert_eq!(
            comment_token("/* fencing_token='fg1~7~job' */").as_deref(),
            Some("fg1~7~job")
        );
        assert_eq!(
            comment_token("/*application='x',fencing_token='fg1~7~billing%3A2026-09-28'*/")
                .as_deref(),
            Some("fg1~7~billing:2026-09-28")
        );
        assert_eq!(comment_token("/* nothing here */"), None);
        assert_eq!(comment_token("/* fencing_tokenx='1' */"), None);
    }

    #[test]
    fn startup_option_forms() {
        assert_eq!(
            startup_token("-c fencegate.token=fg1~7~job"),
            (Some("fg1~7~job".to_owned()), String::new())
        );
        assert_eq!(
            startup_token("-c search_path=a -cfencegate.token=fg1~7~job --work_mem=4MB"),
            (
                Some("fg1~7~job".to_owned()),
                "-c search_path=a --work_mem=4MB".to_owned()
            )
        );
        assert_eq!(
            startup_token("-c application_name=a\\ b"),
            (None, "-c application_name=a\\ b".to_owned())
        );
    }

    #[test]
    fn percent_decoding_keeps_malformed_escapes() {
        assert_eq!(percent_decode("a%3Ab%zz%4"), "a:b%zz%4");
    }
}
