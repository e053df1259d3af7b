use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ResourceError;

/// A lockable name such as `billing:2026-09-28`: 1 to 256 bytes from `[A-Za-z0-9._:/-]`.
///
/// The alphabet leaves out `~` (the token's separator), spaces, quotes and anything that would
/// need escaping in a header, a SQL string or a Redis argument.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Resource(String);

impl Resource {
    /// The longest name accepted, in bytes.
    pub const MAX_LEN: usize = 256;

    /// Validates `name`.
    pub fn new(name: impl Into<String>) -> Result<Self, ResourceError> {
        let name = name.into();
        if name.is_empty() {
            return Err(ResourceError::Empty);
        }
        if name.len() > Self::MAX_LEN {
            return Err(ResourceError::TooLong { len: name.len() });
        }
        if let Some(position) = name.bytes().position(|b| !Self::allowed(b)) {
            return Err(ResourceError::BadCharacter { position });
        }
        Ok(Self(name))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    fn allowed(b: u8) -> bool {
        b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'/' | b'-')
    }
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for Resource {
    type Error = ResourceError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl From<Resource> for String {
    fn from(value: Resource) -> Self {
        value.0
    }
}

impl AsRef<str> for Resource {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_alphabet() {
        assert!(Resource::new("billing:2026-09-28").is_ok());
        assert!(Resource::new("a/b.c_d-e:F9").is_ok());
        assert!(Resource::new("x".repeat(256)).is_ok());
    }

    #[test]
    fn refuses_everything_else_with_a_reason() {
        assert_eq!(Resource::new(""), Err(ResourceError::Empty));
        assert_eq!(
            Resource::new("x".repeat(257)),
            Err(ResourceError::TooLong { len: 257 })
        );
        assert_eq!(
            Resource::new("a b"),
            Err(ResourceError::BadCharacter { position: 1 })
        );
        assert_eq!(
            Resource::new("a~b"),
            Err(ResourceError::BadCharacter { position: 1 })
        );
        assert_eq!(
            Resource::new("é"),
            Err(ResourceError::BadCharacter { position: 0 })
        );
    }
}
