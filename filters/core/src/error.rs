use thiserror::Error;

/// Why a resource name was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ResourceError {
    /// The name was empty.
    #[error("resource name is empty; use 1 to 256 characters from [A-Za-z0-9._:/-]")]
    Empty,
    /// The name was longer than [`crate::Resource::MAX_LEN`] bytes.
    #[error("resource name is {len} bytes long; the limit is 256")]
    TooLong {
        /// The length that was presented.
        len: usize,
    },
    /// The name held a byte outside `[A-Za-z0-9._:/-]`.
    #[error("resource name has a character outside [A-Za-z0-9._:/-] at byte {position}")]
    BadCharacter {
        /// Byte offset of the first offending byte.
        position: usize,
    },
}

/// Why a presented fencing token was refused. Messages never repeat the token itself, so they
/// are safe to log and to send back to a client.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TokenError {
    /// No token, or an empty one.
    #[error("fencing token is empty")]
    Empty,
    /// Longer than [`crate::MAX_TOKEN_LEN`].
    #[error("fencing token is {len} bytes long; the limit is 512")]
    TooLong {
        /// The length that was presented.
        len: usize,
    },
    /// Held a byte that is not printable ASCII (or a space).
    #[error("fencing token has a non-printable byte or a space at byte {position}")]
    NotPrintable {
        /// Byte offset of the first offending byte.
        position: usize,
    },
    /// Not of the form `fg1~<revision>~<resource>[~<kid>.<signature>]`.
    #[error(
        "fencing token is malformed: {0}; expected fg1~<revision>~<resource>[~<kid>.<signature>]"
    )]
    Malformed(&'static str),
    /// The revision was zero, not a number, or above the largest revision a store can keep.
    #[error("fencing token revision is not a number from 1 to 9223372036854775807")]
    BadRevision,
    /// The resource part was not a valid resource name.
    #[error("fencing token resource is invalid: {0}")]
    BadResource(ResourceError),
    /// The signature does not match: the token was forged or signed with another cluster's key.
    #[error("fencing token signature does not match this cluster's key (forged, or issued by another cluster)")]
    BadSignature,
    /// The policy requires signed tokens and this one carries no signature.
    #[error("fencing token is unsigned but this gateway accepts only signed tokens (take tokens from the authority, or set authority.accept_unsigned for development)")]
    Unsigned,
    /// The token names a key id this node does not know (forged, another cluster's, or a key
    /// this node has not replicated yet).
    #[error("fencing token is signed with key {0}, which this cluster does not have")]
    UnknownKey(u32),
    /// The token's key was retired: tokens it signed are no longer accepted.
    #[error("fencing token is signed with key {0}, which was retired; acquire a new token")]
    RetiredKey(u32),
    /// A plain numeric token was presented where the policy does not allow one.
    #[error(
        "plain numeric fencing tokens are not accepted here; set accept_plain_tokens to allow them"
    )]
    PlainNotAllowed,
    /// The token names another resource than the one the write touches.
    #[error("fencing token is for another resource than the one written")]
    WrongResource,
}

/// A store name that is not one of ours; the message names the accepted ones.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown store {0:?}: expected redis, postgres or s3")]
pub struct UnknownStore(pub String);
