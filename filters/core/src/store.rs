use std::fmt;
use std::str::FromStr;

use crate::UnknownStore;

/// The kind of store a gateway fronts. Its name is the `store` field of audit records, the
/// `store` label of metrics and the `--store` argument of the CLI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Store {
    /// Redis, fenced by an atomic function call.
    Redis,
    /// PostgreSQL, fenced by `fencegate.guard` in the write's transaction.
    Postgres,
    /// S3, fenced by conditional requests (object mode) or a manifest commit.
    S3,
}

impl Store {
    /// Every store, in a stable order.
    pub const ALL: [Store; 3] = [Store::Redis, Store::Postgres, Store::S3];

    /// The store's name: `redis`, `postgres` or `s3`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Redis => "redis",
            Self::Postgres => "postgres",
            Self::S3 => "s3",
        }
    }
}

impl fmt::Display for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Store {
    type Err = UnknownStore;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|store| store.as_str() == s)
            .ok_or_else(|| UnknownStore(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for store in Store::ALL {
            assert_eq!(store.as_str().parse::<Store>(), Ok(store));
        }
        assert_eq!(
            "mysql".parse::<Store>().unwrap_err().to_string(),
            "unknown store \"mysql\": expected redis, postgres or s3"
        );
    }
}
