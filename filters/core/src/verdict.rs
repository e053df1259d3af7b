use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{Resource, Revision, Token, TokenError};

/// What a filter decided about one write. A refusal is a value, not an `Err`: it is answered in
/// the store's native error form, audited, and counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The write goes to the store (in its conditional form).
    Apply,
    /// The write is refused; nothing of it is applied.
    Refuse(Rejection),
}

/// Why a write was refused, with what the filter knew at the time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// The reason, stable across releases.
    pub reason: RejectReason,
    /// The resource the presented token names, when it could be parsed.
    pub resource: Option<Resource>,
    /// The presented token's revision, when it could be parsed.
    pub revision: Option<Revision>,
    /// A human-readable detail safe to send back and to log (never a token's signature, never a
    /// data value).
    pub detail: String,
}

/// The stable reasons for a refusal. Each store maps them to its own error form (a Redis error
/// word, an S3 status, a SQLSTATE).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum RejectReason {
    /// A protected write carried no token.
    Missing,
    /// The token is below the fence kept in the store.
    Stale {
        /// The fence revision the store holds.
        fence: u64,
    },
    /// The token could not be parsed (or is a plain token where those are not allowed).
    Malformed,
    /// The token's signature does not match this cluster's key, or it is unsigned where only
    /// signed tokens are accepted.
    Forged,
    /// The token is valid but for another resource than the one written.
    OutOfScope,
    /// The command could not be classified, may write keys it does not name, or cannot run under
    /// a fence (fail closed).
    Unsupported,
}

impl RejectReason {
    /// The reason as a short label, used in metrics and audit queries.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Stale { .. } => "stale",
            Self::Malformed => "malformed",
            Self::Forged => "forged",
            Self::OutOfScope => "out_of_scope",
            Self::Unsupported => "unsupported",
        }
    }

    /// Classifies a token verification error.
    pub fn from_token_error(error: &TokenError) -> Self {
        match error {
            TokenError::BadSignature
            | TokenError::Unsigned
            | TokenError::UnknownKey(_)
            | TokenError::RetiredKey(_) => Self::Forged,
            TokenError::WrongResource => Self::OutOfScope,
            TokenError::Empty => Self::Missing,
            _ => Self::Malformed,
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

impl Rejection {
    /// A refusal for `reason` with `detail` and no token information.
    pub fn new(reason: RejectReason, detail: impl Into<String>) -> Self {
        Self {
            reason,
            resource: None,
            revision: None,
            detail: detail.into(),
        }
    }

    /// The refusal of `token`'s write because the store holds `fence` above it; `target` names
    /// what was written (`key k`, `resource r`, `the manifest of b/p`). The one place the stale
    /// hint is worded.
    ///
    /// `issued` is the highest revision the node's authority has applied, when known. A fence
    /// above it is not the client's lost lock but an authority reset below the store, and the
    /// hint says so instead of telling the client to acquire again.
    pub fn stale(token: &Token, fence: u64, target: &str, issued: Option<u64>) -> Self {
        let revision = token.revision();
        let detail = match issued {
            Some(issued) if fence > issued => format!(
                "the fence {fence} of {target} is above every revision this cluster's authority has issued ({issued}), so no token can pass: the authority's data was reset or restored below the store. This is not a lost lock; an operator must run `fencegate snapshot bump {fence}` (or reset the fence)"
            ),
            _ => format!(
                "fencing token revision {revision} is below the fence {fence} of {target}: a newer holder has taken the lock; stop writing and acquire it again"
            ),
        };
        Self::new(RejectReason::Stale { fence }, detail)
            .with_token(token.resource().clone(), revision)
    }

    /// The same refusal, naming the token's resource and revision.
    pub fn with_token(mut self, resource: Resource, revision: Revision) -> Self {
        self.resource = Some(resource);
        self.revision = Some(revision);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_errors_map_to_reasons() {
        assert_eq!(
            RejectReason::from_token_error(&TokenError::BadSignature),
            RejectReason::Forged
        );
        assert_eq!(
            RejectReason::from_token_error(&TokenError::Unsigned),
            RejectReason::Forged
        );
        assert_eq!(
            RejectReason::from_token_error(&TokenError::WrongResource),
            RejectReason::OutOfScope
        );
        assert_eq!(
            RejectReason::from_token_error(&TokenError::BadRevision),
            RejectReason::Malformed
        );
        assert_eq!(RejectReason::Stale { fence: 3 }.label(), "stale");
    }
}
