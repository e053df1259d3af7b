//! Session settings that change how the server splits SQL text, as the server reports them
//! (ParameterStatus). With `standard_conforming_strings = off` a backslash escapes a quote in a
//! plain string literal, and in a client encoding whose multibyte characters may contain ASCII
//! bytes (SJIS, BIG5, GBK, ...) a quote or backslash can be half of a character: in both the
//! server reads text differently from the gateway's parser, so a protected session refuses
//! statements while either holds (issue 12, bypass 4).

/// Client encodings whose multibyte characters can contain bytes below 0x80.
const UNSAFE_ENCODINGS: &[&str] = &[
    "sjis",
    "shift_jis_2004",
    "big5",
    "gbk",
    "gb18030",
    "uhc",
    "johab",
];

/// Whether a `standard_conforming_strings` value leaves it on.
pub fn conforming(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "on" | "true" | "yes" | "1" | "t" | "y"
    )
}

/// Whether `encoding` is one the gateway cannot lex safely.
pub fn unsafe_encoding(encoding: &str) -> bool {
    let e = encoding.trim().to_ascii_lowercase().replace('-', "_");
    UNSAFE_ENCODINGS.contains(&e.as_str())
        || e == "shift_jis"
        || e == "windows_932"
        || e == "windows_936"
        || e == "windows_950"
}

/// The lexing-relevant settings the server last reported.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lexing {
    non_conforming: bool,
    encoding: Option<String>,
    /// A hazard was reported at some point (at startup: a role or database default, a startup
    /// option). The server can go back to such a value without a statement that sets it: `RESET`
    /// and `SET ... TO DEFAULT` go back to the session's start, `ROLLBACK` (or an error in an
    /// implicit transaction) undoes the `SET` that left it, a function may set it. Its report
    /// comes before the ReadyForQuery that answers the statement, so the gateway knows the
    /// setting again once that answer is in, and not before.
    was_hazardous: bool,
}

impl Lexing {
    /// Takes one ParameterStatus body (`name\0value\0`).
    pub fn observe(&mut self, body: &[u8]) {
        let mut fields = body.split(|b| *b == 0);
        let (Some(name), Some(value)) = (fields.next(), fields.next()) else {
            return;
        };
        let value = String::from_utf8_lossy(value);
        match name {
            b"standard_conforming_strings" => self.non_conforming = !conforming(&value),
            b"client_encoding" => {
                self.encoding = unsafe_encoding(&value).then(|| value.into_owned());
            }
            _ => {}
        }
        self.was_hazardous |= self.non_conforming || self.encoding.is_some();
    }

    /// Why a statement sent now cannot be classified safely, if it cannot. `answered`: every
    /// request sent before it has its answer (no earlier statement may still change a setting
    /// unseen).
    pub fn hazard_now(&self, answered: bool) -> Option<String> {
        self.hazard().or_else(|| {
            (self.was_hazardous && !answered).then(|| {
                "this session has had settings that make the server read SQL differently from the gateway, and the \
                 statements before this one may bring them back: wait for each answer before sending the next statement"
                    .to_owned()
            })
        })
    }

    /// Why statements cannot be classified safely now, if they cannot.
    pub fn hazard(&self) -> Option<String> {
        if self.non_conforming {
            return Some(
                "standard_conforming_strings is off: the gateway cannot split this session's SQL as the server does; \
                 turn it on (SET standard_conforming_strings = on, or fix the role/database default)"
                    .to_owned(),
            );
        }
        self.encoding.as_ref().map(|e| {
            format!(
                "client_encoding {e} can hide quotes inside multibyte characters: use UTF8 on a protected database"
            )
        })
    }
}

/// The few exact texts accepted while a hazard holds: the ways back to safe settings.
pub fn is_way_back(sql: &str) -> bool {
    let text = sql.trim().trim_end_matches(';').trim().to_ascii_lowercase();
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    [
        "set standard_conforming_strings = on",
        "set standard_conforming_strings to on",
        "reset standard_conforming_strings",
        "set client_encoding = 'utf8'",
        "set client_encoding to 'utf8'",
        "reset client_encoding",
        "set names 'utf8'",
    ]
    .contains(&text.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hazards_follow_the_reported_settings() {
        let mut l = Lexing::default();
        assert_eq!(l.hazard(), None);
        l.observe(b"standard_conforming_strings\0off\0");
        assert!(l.hazard().unwrap().contains("standard_conforming_strings"));
        l.observe(b"standard_conforming_strings\0on\0");
        l.observe(b"client_encoding\0SJIS\0");
        assert!(l.hazard().unwrap().contains("SJIS"));
        l.observe(b"client_encoding\0UTF8\0");
        assert_eq!(l.hazard(), None);
        assert!(is_way_back("SET  standard_conforming_strings TO on;"));
        assert!(!is_way_back(
            "SET standard_conforming_strings TO on; DELETE FROM t"
        ));
        l.observe(b"garbage");
        assert_eq!(l.hazard(), None);
    }

    #[test]
    fn a_session_that_had_a_hazard_is_judged_only_between_answers() {
        let mut l = Lexing::default();
        assert_eq!(
            l.hazard_now(false),
            None,
            "never hazardous: pipelining is fine"
        );
        l.observe(b"client_encoding\0SJIS\0");
        assert!(l.hazard_now(true).unwrap().contains("SJIS"));
        l.observe(b"client_encoding\0UTF8\0");
        assert_eq!(
            l.hazard_now(true),
            None,
            "every answer in: the setting is known"
        );
        assert!(l
            .hazard_now(false)
            .unwrap()
            .contains("wait for each answer"));
    }
}
