use crate::token::check_envelope;
use crate::{Resource, Revision, Token, TokenError, TokenKey};

/// Which presented tokens a gateway accepts.
///
/// With a key, only tokens signed with it pass. Without one, any well-formed token passes (a
/// deployment that trusts its clients). Plain numeric tokens from an external authority (an
/// etcd revision, say) pass only when `accept_plain` is set, and take their resource from the
/// route being written.
#[derive(Debug, Clone, Default)]
pub struct TokenPolicy {
    /// The cluster key; `None` accepts unsigned tokens.
    pub key: Option<TokenKey>,
    /// Whether a bare decimal revision is a token.
    pub accept_plain: bool,
}

impl TokenPolicy {
    /// Parses and checks `presented` for a write to `route`, the resource the write maps to.
    ///
    /// A token for another resource than `route` is refused with [`TokenError::WrongResource`]:
    /// holding one lock must not let a client write under another.
    pub fn check(&self, presented: &str, route: Option<&Resource>) -> Result<Token, TokenError> {
        check_envelope(presented)?;
        if presented.bytes().all(|b| b.is_ascii_digit()) {
            if !self.accept_plain {
                return Err(TokenError::PlainNotAllowed);
            }
            let revision = Revision::parse(presented).ok_or(TokenError::BadRevision)?;
            let resource = route.ok_or(TokenError::Malformed(
                "a plain token needs a route that names the resource",
            ))?;
            return Ok(Token::new(resource.clone(), revision));
        }
        let token = Token::parse(presented)?;
        if let Some(key) = &self.key {
            token.verify(key)?;
        }
        if route.is_some_and(|route| route != token.resource()) {
            return Err(TokenError::WrongResource);
        }
        Ok(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> TokenKey {
        TokenKey::new(&[7u8; 32]).unwrap()
    }

    fn job() -> Resource {
        Resource::new("job").unwrap()
    }

    #[test]
    fn signed_policy_accepts_only_signed_tokens_for_the_route() {
        let policy = TokenPolicy {
            key: Some(key()),
            accept_plain: false,
        };
        let good = Token::new(job(), Revision::new(5).unwrap())
            .signed(&key())
            .to_string();
        assert_eq!(
            policy.check(&good, Some(&job())).unwrap().revision().get(),
            5
        );
        assert_eq!(
            policy.check("fg1~5~job", Some(&job())),
            Err(TokenError::Unsigned)
        );
        let other = Resource::new("other").unwrap();
        assert_eq!(
            policy.check(&good, Some(&other)),
            Err(TokenError::WrongResource)
        );
    }

    #[test]
    fn plain_tokens_need_permission_and_a_route() {
        let strict = TokenPolicy::default();
        assert_eq!(
            strict.check("42", Some(&job())),
            Err(TokenError::PlainNotAllowed)
        );
        let lenient = TokenPolicy {
            key: None,
            accept_plain: true,
        };
        let t = lenient.check("42", Some(&job())).unwrap();
        assert_eq!((t.resource().as_str(), t.revision().get()), ("job", 42));
        assert!(lenient.check("42", None).is_err());
        assert_eq!(
            lenient.check("0", Some(&job())),
            Err(TokenError::BadRevision)
        );
    }
}
