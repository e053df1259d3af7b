use std::fmt;

use crate::{KeyRing, Resource, Revision, TokenError, TokenKey};

/// Every token starts with this, so the format can change without ambiguity.
pub const TOKEN_PREFIX: &str = "fg1";

/// The longest token string accepted, in bytes.
pub const MAX_TOKEN_LEN: usize = 512;

const SEPARATOR: char = '~';

/// A fencing token: `fg1~<revision>~<resource>` with an optional `~<kid>.<signature>`.
///
/// `~` never occurs in a resource name or a revision, so the fields split without escaping, and
/// the whole token is printable ASCII without spaces: it travels unchanged in an HTTP header, a
/// SQL string literal or a Redis argument. The signature is an HMAC-SHA256 of the unsigned form
/// with the key numbered `kid`, base64url without padding; see [`TokenKey`].
#[derive(Clone, PartialEq, Eq)]
pub struct Token {
    resource: Resource,
    revision: Revision,
    signature: Option<(u32, String)>,
}

impl Token {
    /// An unsigned token.
    pub fn new(resource: Resource, revision: Revision) -> Self {
        Self {
            resource,
            revision,
            signature: None,
        }
    }

    /// The resource the lock was taken on.
    pub fn resource(&self) -> &Resource {
        &self.resource
    }

    /// The revision compared at the store.
    pub fn revision(&self) -> Revision {
        self.revision
    }

    /// Whether the token carries a signature (checked or not).
    pub fn is_signed(&self) -> bool {
        self.signature.is_some()
    }

    /// The id of the key that signed the token, if it is signed.
    pub fn key_id(&self) -> Option<u32> {
        self.signature.as_ref().map(|(kid, _)| *kid)
    }

    /// The same token signed with `key`.
    pub fn signed(mut self, key: &TokenKey) -> Self {
        self.signature = Some((key.id(), key.sign(&self.unsigned_form())));
        self
    }

    /// Checks the signature against `key`. An unsigned token fails with [`TokenError::Unsigned`],
    /// one signed with another key id with [`TokenError::BadSignature`].
    pub fn verify(&self, key: &TokenKey) -> Result<(), TokenError> {
        match &self.signature {
            None => Err(TokenError::Unsigned),
            Some((kid, _)) if *kid != key.id() => Err(TokenError::BadSignature),
            Some((_, signature)) => key.verify(&self.unsigned_form(), signature),
        }
    }

    /// Checks the signature against the key of `ring` that the token names.
    pub fn verify_in(&self, ring: &KeyRing) -> Result<(), TokenError> {
        let kid = self.key_id().ok_or(TokenError::Unsigned)?;
        self.verify(ring.verifier(kid)?)
    }

    /// The text that is signed: the token without its signature.
    pub fn unsigned_form(&self) -> String {
        format!(
            "{TOKEN_PREFIX}{SEPARATOR}{}{SEPARATOR}{}",
            self.revision, self.resource
        )
    }

    /// Parses a token string. Any input returns a value or an error; nothing panics.
    /// The signature's shape is checked here, its value only by [`Token::verify`].
    pub fn parse(text: &str) -> Result<Self, TokenError> {
        check_envelope(text)?;
        let mut fields = text.split(SEPARATOR);
        if fields.next() != Some(TOKEN_PREFIX) {
            return Err(TokenError::Malformed("it does not start with fg1~"));
        }
        let revision = fields
            .next()
            .ok_or(TokenError::Malformed("the revision is missing"))?;
        let revision = Revision::parse(revision).ok_or(TokenError::BadRevision)?;
        let resource = fields
            .next()
            .ok_or(TokenError::Malformed("the resource is missing"))?;
        let resource = Resource::new(resource).map_err(TokenError::BadResource)?;
        let signature = match fields.next() {
            None => None,
            Some(field) => Some(parse_signature(field)?),
        };
        if fields.next().is_some() {
            return Err(TokenError::Malformed("it has more than four fields"));
        }
        Ok(Self {
            resource,
            revision,
            signature,
        })
    }
}

/// `<kid>.<43 base64url characters>`; the kid is a decimal without sign or leading zeros.
fn parse_signature(field: &str) -> Result<(u32, String), TokenError> {
    let (kid, signature) = field.split_once('.').ok_or(TokenError::Malformed(
        "the signature is not <key id>.<signature>",
    ))?;
    let kid_ok = !kid.is_empty()
        && kid.len() <= 10
        && kid.bytes().all(|b| b.is_ascii_digit())
        && (kid == "0" || !kid.starts_with('0'));
    let kid = kid
        .parse::<u32>()
        .ok()
        .filter(|_| kid_ok)
        .ok_or(TokenError::Malformed("the key id is not a number"))?;
    if !TokenKey::is_signature_shaped(signature) {
        return Err(TokenError::Malformed(
            "the signature is not 43 base64url characters",
        ));
    }
    Ok((kid, signature.to_owned()))
}

/// Length and alphabet checks shared by every token form.
pub(crate) fn check_envelope(text: &str) -> Result<(), TokenError> {
    if text.is_empty() {
        return Err(TokenError::Empty);
    }
    if text.len() > MAX_TOKEN_LEN {
        return Err(TokenError::TooLong { len: text.len() });
    }
    if let Some(position) = text.bytes().position(|b| !b.is_ascii_graphic()) {
        return Err(TokenError::NotPrintable { position });
    }
    Ok(())
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.unsigned_form())?;
        if let Some((kid, signature)) = &self.signature {
            write!(f, "{SEPARATOR}{kid}.{signature}")?;
        }
        Ok(())
    }
}

/// Shows resource and revision only: a signed token is a credential and stays out of logs.
impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Token")
            .field("resource", &self.resource)
            .field("revision", &self.revision)
            .field("signed", &self.is_signed())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn token(resource: &str, revision: u64) -> Token {
        Token::new(
            Resource::new(resource).unwrap(),
            Revision::new(revision).unwrap(),
        )
    }

    #[test]
    fn golden_unsigned() {
        let t = token("billing:2026-09-28", 7);
        assert_eq!(t.to_string(), "fg1~7~billing:2026-09-28");
        assert_eq!(Token::parse("fg1~7~billing:2026-09-28"), Ok(t));
    }

    #[test]
    fn golden_signed() {
        let key = TokenKey::new(3, b"0123456789abcdef0123456789abcdef").unwrap();
        let t = token("billing:2026-09-28", 7).signed(&key);
        let text = t.to_string();
        // Cross-checked with Python: hmac.new(key, b"fg1~7~billing:2026-09-28", sha256), base64url.
        assert_eq!(
            text,
            "fg1~7~billing:2026-09-28~3.hTkKSRG6F8spDmnQBt8gQ5hkLmepHi4xkNI9iqQtRtc"
        );
        let parsed = Token::parse(&text).unwrap();
        assert_eq!(parsed.verify(&key), Ok(()));
    }

    #[test]
    fn forged_revision_fails_verification() {
        let key = TokenKey::new(1, b"0123456789abcdef0123456789abcdef").unwrap();
        let text = token("job", 7).signed(&key).to_string();
        let forged = text.replacen("~7~", "~9000000000~", 1);
        assert_eq!(
            Token::parse(&forged).unwrap().verify(&key),
            Err(TokenError::BadSignature)
        );
        let other = TokenKey::new(1, b"another cluster's key, 32 bytes!").unwrap();
        assert_eq!(
            Token::parse(&text).unwrap().verify(&other),
            Err(TokenError::BadSignature)
        );
        assert_eq!(token("job", 7).verify(&key), Err(TokenError::Unsigned));
    }

    #[test]
    fn malformed_tokens_name_the_problem() {
        let cases: &[(&str, TokenError)] = &[
            ("", TokenError::Empty),
            ("fg1~7~a b", TokenError::NotPrintable { position: 7 }),
            (
                "fg2~7~job",
                TokenError::Malformed("it does not start with fg1~"),
            ),
            ("fg1", TokenError::Malformed("the revision is missing")),
            ("fg1~7", TokenError::Malformed("the resource is missing")),
            ("fg1~0~job", TokenError::BadRevision),
            ("fg1~-1~job", TokenError::BadRevision),
            (
                "fg1~7~",
                TokenError::BadResource(crate::ResourceError::Empty),
            ),
            (
                "fg1~7~job~short",
                TokenError::Malformed("the signature is not <key id>.<signature>"),
            ),
            (
                "fg1~7~job~1.short",
                TokenError::Malformed("the signature is not 43 base64url characters"),
            ),
            (
                "fg1~7~job~01.hTkKSRG6F8spDmnQBt8gQ5hkLmepHi4xkNI9iqQtRtc",
                TokenError::Malformed("the key id is not a number"),
            ),
            (
                "fg1~7~job~99999999999.hTkKSRG6F8spDmnQBt8gQ5hkLmepHi4xkNI9iqQtRtc",
                TokenError::Malformed("the key id is not a number"),
            ),
        ];
        for (text, want) in cases {
            assert_eq!(Token::parse(text).as_ref().err(), Some(want), "{text:?}");
        }
        let long = format!("fg1~7~{}", "x".repeat(600));
        assert_eq!(Token::parse(&long), Err(TokenError::TooLong { len: 606 }));
    }

    #[test]
    fn debug_hides_the_signature() {
        let key = TokenKey::new(1, b"0123456789abcdef0123456789abcdef").unwrap();
        let t = token("job", 7).signed(&key);
        let shown = format!("{t:?}");
        assert!(!shown.contains(&t.to_string()[10..]), "{shown}");
    }

    proptest! {
        #[test]
        fn any_bytes_parse_without_panic(bytes in proptest::collection::vec(any::<u8>(), 0..700)) {
            let text = String::from_utf8_lossy(&bytes);
            let _ = Token::parse(&text);
        }

        #[test]
        fn tokenish_strings_parse_without_panic(text in "(fg1)?(~[0-9a-zA-Z:._/-]{0,30}){0,5}") {
            let _ = Token::parse(&text);
        }

        #[test]
        fn encode_then_parse_round_trips(resource in "[A-Za-z0-9._:/-]{1,256}", revision in 1..=Revision::MAX, signed: bool) {
            let key = TokenKey::new(1, b"0123456789abcdef0123456789abcdef").unwrap();
            let mut t = token(&resource, revision);
            if signed {
                t = t.signed(&key);
            }
            let text = t.to_string();
            prop_assert!(text.len() <= MAX_TOKEN_LEN);
            let parsed = Token::parse(&text).unwrap();
            prop_assert_eq!(&parsed, &t);
            prop_assert_eq!(parsed.verify(&key).is_ok(), signed);
        }
    }
}
