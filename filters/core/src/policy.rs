use crate::token::check_envelope;
use crate::{
    IssuedRevision, KeyRing, RejectReason, Rejection, Resource, Revision, SharedKeyRing, Token,
    TokenError, TokenKey,
};

/// Which presented tokens a gateway accepts.
///
/// Signed tokens pass when the key they name is in the node's [`KeyRing`] and not retired.
/// Unsigned tokens pass only with `accept_unsigned` (development; the node warns at start).
/// Plain numeric tokens from an external authority (an etcd revision, say) pass only when
/// `accept_plain` is set, and take their resource from the route being written.
#[derive(Debug, Clone)]
pub struct TokenPolicy {
    /// The keys that verify tokens; shared with the authority, which adds and retires them.
    pub keys: SharedKeyRing,
    /// Whether a token without a signature is accepted (never the default).
    pub accept_unsigned: bool,
    /// Whether a bare decimal revision is a token.
    pub accept_plain: bool,
    /// The highest revision the node's authority has applied; words stale refusals.
    pub issued: IssuedRevision,
}

impl TokenPolicy {
    /// Accepts tokens signed with a key of `keys`, and nothing else.
    pub fn signed(keys: SharedKeyRing) -> Self {
        Self {
            keys,
            accept_unsigned: false,
            accept_plain: false,
            issued: IssuedRevision::default(),
        }
    }

    /// Accepts tokens signed with `key` alone.
    pub fn with_key(key: TokenKey) -> Self {
        Self::signed(SharedKeyRing::new(KeyRing::single(key)))
    }

    /// Accepts unsigned tokens (and signed ones of no key at all: there is none). For
    /// development and tests only: any client can then type a token.
    pub fn unsigned() -> Self {
        Self {
            keys: SharedKeyRing::default(),
            accept_unsigned: true,
            accept_plain: false,
            issued: IssuedRevision::default(),
        }
    }

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
        if token.is_signed() {
            self.keys.read(|ring| token.verify_in(ring))?;
        } else if !self.accept_unsigned {
            return Err(TokenError::Unsigned);
        }
        if route.is_some_and(|route| route != token.resource()) {
            return Err(TokenError::WrongResource);
        }
        Ok(token)
    }

    /// Judges the token a write presented (`None`: it carried none) against the resource the
    /// protect rule names: the one verb every filter uses before any store I/O.
    ///
    /// The refusal names the token's resource and revision whenever the token parsed, so the
    /// audit record shows what was presented (never its signature).
    pub fn judge(
        &self,
        presented: Option<&str>,
        route: Option<&Resource>,
    ) -> Result<Token, Rejection> {
        let Some(presented) = presented.filter(|p| !p.is_empty()) else {
            return Err(Rejection::new(
                RejectReason::Missing,
                "this write needs a fencing token; take one from the authority (fencegate lock acquire) and send it with the write",
            ));
        };
        self.check(presented, route).map_err(|error| {
            let rejection =
                Rejection::new(RejectReason::from_token_error(&error), error.to_string());
            match Token::parse(presented) {
                Ok(token) => rejection.with_token(token.resource().clone(), token.revision()),
                Err(_) => rejection,
            }
        })
    }

    /// The refusal of `token`'s write because the store holds `fence` above it, worded with
    /// what this node's authority has issued (see [`Rejection::stale`]).
    pub fn stale(&self, token: &Token, fence: u64, target: &str) -> Rejection {
        Rejection::stale(token, fence, target, self.issued.get())
    }

    /// Whether `fence` is above every revision the node's authority has applied: a store's
    /// fence no token of this cluster can pass (the authority was reset below the store).
    pub fn fence_above_issued(&self, fence: u64) -> bool {
        self.issued.get().is_some_and(|issued| fence > issued)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KeyState;

    fn key(id: u32) -> TokenKey {
        TokenKey::new(id, &[7u8 + id as u8; 32]).unwrap()
    }

    fn job() -> Resource {
        Resource::new("job").unwrap()
    }

    fn signed(resource: &Resource, revision: u64, key: &TokenKey) -> String {
        Token::new(resource.clone(), Revision::new(revision).unwrap())
            .signed(key)
            .to_string()
    }

    #[test]
    fn signed_policy_accepts_only_signed_tokens_for_the_route() {
        let policy = TokenPolicy::with_key(key(1));
        let good = signed(&job(), 5, &key(1));
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
        let foreign = signed(&job(), 5, &key(2));
        assert_eq!(
            policy.check(&foreign, Some(&job())),
            Err(TokenError::UnknownKey(2))
        );
    }

    #[test]
    fn rotation_keeps_old_tokens_until_the_old_key_is_retired() {
        let ring = SharedKeyRing::new(KeyRing::single(key(1)));
        let policy = TokenPolicy::signed(ring.clone());
        let old = signed(&job(), 5, &key(1));
        let mut rotated = KeyRing::single(key(1));
        rotated.insert(key(2), KeyState::Signing);
        ring.replace(rotated.clone());
        assert_eq!(ring.read(|r| r.signer().unwrap().id()), 2);
        assert!(policy.check(&old, Some(&job())).is_ok());
        rotated.insert(key(1), KeyState::Retired);
        ring.replace(rotated);
        assert_eq!(
            policy.check(&old, Some(&job())),
            Err(TokenError::RetiredKey(1))
        );
        assert!(policy
            .check(&signed(&job(), 6, &key(2)), Some(&job()))
            .is_ok());
    }

    #[test]
    fn unsigned_needs_permission_and_never_excuses_a_bad_signature() {
        let policy = TokenPolicy::unsigned();
        assert!(policy.check("fg1~5~job", Some(&job())).is_ok());
        let forged = signed(&job(), 5, &key(1));
        assert_eq!(
            policy.check(&forged, Some(&job())),
            Err(TokenError::UnknownKey(1))
        );
    }

    #[test]
    fn judge_names_reason_and_token() {
        let policy = TokenPolicy::with_key(key(1));
        let missing = policy.judge(None, Some(&job())).unwrap_err();
        assert_eq!(missing.reason, RejectReason::Missing);
        let forged = policy
            .judge(Some("fg1~9223372036854775807~job"), Some(&job()))
            .unwrap_err();
        assert_eq!(forged.reason, RejectReason::Forged);
        assert_eq!(forged.revision.map(|r| r.get()), Some(Revision::MAX));
        let other = Resource::new("other").unwrap();
        let scope = policy
            .judge(Some(&signed(&job(), 5, &key(1))), Some(&other))
            .unwrap_err();
        assert_eq!(scope.reason, RejectReason::OutOfScope);
        assert_eq!(
            policy.judge(Some("fg1~x"), None).unwrap_err().reason,
            RejectReason::Malformed
        );
    }

    #[test]
    fn plain_tokens_need_permission_and_a_route() {
        let strict = TokenPolicy::with_key(key(1));
        assert_eq!(
            strict.check("42", Some(&job())),
            Err(TokenError::PlainNotAllowed)
        );
        let lenient = TokenPolicy {
            accept_plain: true,
            ..TokenPolicy::with_key(key(1))
        };
        let t = lenient.check("42", Some(&job())).unwrap();
        assert_eq!((t.resource().as_str(), t.revision().get()), ("job", 42));
        assert!(lenient.check("42", None).is_err());
        assert_eq!(
            lenient.check("0", Some(&job())),
            Err(TokenError::BadRevision)
        );
    }

    #[test]
    fn the_stale_hint_does_not_blame_the_client_for_a_reset_authority() {
        let policy = TokenPolicy::with_key(key(1));
        let token = Token::new(job(), Revision::new(7).unwrap());
        let lost = policy.stale(&token, 12, "key k");
        assert_eq!(lost.reason, RejectReason::Stale { fence: 12 });
        assert_eq!(
            (lost.resource, lost.revision),
            (Some(job()), token.revision().into())
        );
        assert_eq!(
            lost.detail,
            "fencing token revision 7 is below the fence 12 of key k: a newer holder has taken the lock; stop writing and acquire it again"
        );
        policy.issued.observe(20);
        assert!(policy
            .stale(&token, 12, "key k")
            .detail
            .contains("newer holder"));
        let reset = policy.stale(&token, 501, "key k");
        assert_eq!(reset.reason, RejectReason::Stale { fence: 501 });
        assert!(
            reset.detail.starts_with("the fence 501 of key k is above every revision this cluster's authority has issued (20)")
                && reset.detail.contains("fencegate snapshot bump 501"),
            "{}",
            reset.detail
        );
    }
}
