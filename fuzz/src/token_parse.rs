//! Fencing tokens (`fencegate_core::Token`): any text parses to a token or an error, never a
//! panic; a parsed token prints back as exactly the text it came from (one spelling per
//! token); and a token signed with a key prints as text that parses and verifies with that key
//! and no other (so whatever the gateway accepts unsigned can also be issued signed).

use fencegate_core::{KeyRing, Token, TokenKey};

/// The fuzz target's body.
pub fn check(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let Ok(token) = Token::parse(&text) else {
        return;
    };
    assert_eq!(token.to_string(), text, "a token has one spelling");
    let unsigned = Token::new(token.resource().clone(), token.revision());
    assert!(!unsigned.is_signed());
    assert_eq!(
        Token::parse(&unsigned.unsigned_form()).expect("the unsigned form parses"),
        unsigned
    );
    let key = TokenKey::new(7, &[42u8; 32]).expect("a long enough secret");
    let other = TokenKey::new(7, &[43u8; 32]).expect("a long enough secret");
    let signed = unsigned.signed(&key);
    let reparsed = Token::parse(&signed.to_string()).expect("a signed token parses");
    assert_eq!(reparsed, signed);
    assert!(reparsed.verify(&key).is_ok());
    assert!(reparsed.verify_in(&KeyRing::single(key)).is_ok());
    assert!(reparsed.verify(&other).is_err());
}
