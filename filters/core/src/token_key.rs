use std::fmt;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::TokenError;

type HmacSha256 = Hmac<Sha256>;

/// One of a cluster's token signing keys (HMAC-SHA256), with its key id.
///
/// The authority signs with its newest key; every gateway verifies offline with whichever key
/// the token names, so a client cannot mint a huge revision and lock everyone else out. The id
/// travels in the token (`<kid>.<signature>`) so a key can be rotated: a new key signs while old
/// ones still verify until they are retired.
#[derive(Clone)]
pub struct TokenKey {
    id: u32,
    secret: Vec<u8>,
}

/// Length of a base64url (unpadded) HMAC-SHA256 tag.
const SIGNATURE_LEN: usize = 43;

impl TokenKey {
    /// The shortest secret accepted, in bytes.
    pub const MIN_LEN: usize = 32;

    /// Key `id` from a secret of at least [`TokenKey::MIN_LEN`] bytes.
    pub fn new(id: u32, secret: &[u8]) -> Option<Self> {
        (secret.len() >= Self::MIN_LEN).then(|| Self {
            id,
            secret: secret.to_vec(),
        })
    }

    /// The key id carried in the tokens this key signs.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The secret, for replicating it (the authority's log) or installing it where a store
    /// verifies tokens itself (PostgreSQL's guard). Never log it.
    pub fn secret(&self) -> &[u8] {
        &self.secret
    }

    pub(crate) fn sign(&self, message: &str) -> String {
        URL_SAFE_NO_PAD.encode(self.mac(message).finalize().into_bytes())
    }

    pub(crate) fn verify(&self, message: &str, signature: &str) -> Result<(), TokenError> {
        let tag = URL_SAFE_NO_PAD
            .decode(signature)
            .map_err(|_| TokenError::BadSignature)?;
        // `verify_slice` compares in constant time.
        self.mac(message)
            .verify_slice(&tag)
            .map_err(|_| TokenError::BadSignature)
    }

    pub(crate) fn is_signature_shaped(text: &str) -> bool {
        text.len() == SIGNATURE_LEN
            && text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    }

    fn mac(&self, message: &str) -> HmacSha256 {
        let mut mac =
            HmacSha256::new_from_slice(&self.secret).expect("HMAC takes keys of any length");
        mac.update(message.as_bytes());
        mac
    }
}

impl fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenKey({}, <redacted>)", self.id)
    }
}
