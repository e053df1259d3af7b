use serde::{Deserialize, Serialize};

/// What an operator's fence reset (`fencegate fence reset`) did in one store.
///
/// A reset is a compare-and-set: the operator names the fence they saw (`current`), and the
/// store changes it only if it still holds that value, in one atomic step. A write racing the
/// reset is judged against either the old fence or the new one, never a mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum FenceReset {
    /// The fence was `from` and is now `to` (0: the fence was removed).
    Done {
        /// The fence before the reset.
        from: u64,
        /// The fence after it.
        to: u64,
    },
    /// The store holds another fence than the operator named; nothing changed.
    Mismatch {
        /// The fence the store holds (0: none).
        actual: u64,
    },
}
