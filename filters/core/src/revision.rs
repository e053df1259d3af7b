use std::fmt;

use serde::{Deserialize, Serialize};

/// The number compared at the store: the revision at which a lock was created.
///
/// Revisions are positive and at most `i64::MAX`, so that every store can keep them in a signed
/// 64-bit column (PostgreSQL `bigint`, Redis integers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "u64", into = "u64")]
pub struct Revision(u64);

impl Revision {
    /// The largest revision a store can keep.
    pub const MAX: u64 = i64::MAX as u64;

    /// A revision, if `value` is in `1..=Revision::MAX`.
    pub fn new(value: u64) -> Option<Self> {
        (1..=Self::MAX).contains(&value).then_some(Self(value))
    }

    /// The number itself.
    pub fn get(self) -> u64 {
        self.0
    }

    /// Parses decimal digits only (no sign, no spaces, no leading zeros).
    pub fn parse(text: &str) -> Option<Self> {
        let bytes = text.as_bytes();
        if bytes.is_empty() || bytes.len() > 19 || !bytes.iter().all(u8::is_ascii_digit) {
            return None;
        }
        if bytes[0] == b'0' {
            return None;
        }
        text.parse::<u64>().ok().and_then(Self::new)
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl TryFrom<u64> for Revision {
    type Error = String;
    fn try_from(value: u64) -> Result<Self, Self::Error> {
        Self::new(value).ok_or_else(|| format!("revision {value} is outside 1..={}", Self::MAX))
    }
}

impl From<Revision> for u64 {
    fn from(value: Revision) -> Self {
        value.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_only_canonical_decimals() {
        assert_eq!(Revision::parse("7").map(Revision::get), Some(7));
        assert_eq!(
            Revision::parse("9223372036854775807").map(Revision::get),
            Some(i64::MAX as u64)
        );
        for bad in [
            "",
            "0",
            "07",
            "-1",
            "+1",
            " 1",
            "1 ",
            "9223372036854775808",
            "18446744073709551616",
            "1e3",
        ] {
            assert_eq!(Revision::parse(bad), None, "{bad:?}");
        }
    }
}
