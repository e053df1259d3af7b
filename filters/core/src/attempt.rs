use crate::{AuditEvent, OperationSummary, RejectReason, Rejection, Store, Token};

/// What a gateway knows of one write before it is judged: enough to audit its refusal.
///
/// Every filter builds one per write and turns it into an [`AuditEvent`] with
/// [`Attempt::refused`] when the write is refused (by the gateway or by the store), so the three
/// stores' audit records are made by one constructor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// The store written.
    pub store: Store,
    /// The client's address as seen by the gateway.
    pub client_addr: String,
    /// The client's authenticated identity, where the protocol has one.
    pub client_identity: Option<String>,
    /// The token the write presented, when it parsed (signature checked or not).
    pub token: Option<Token>,
    /// What was attempted, without data values.
    pub operation: OperationSummary,
    /// An id that ties the record to the gateway's logs.
    pub request_id: String,
}

impl Attempt {
    /// The audit event of this attempt refused for `rejection`.
    pub fn refused(&self, rejection: &Rejection) -> AuditEvent {
        AuditEvent::refusal(self, rejection)
    }
}

impl AuditEvent {
    /// The audit event of `attempt` refused for `rejection`: the one constructor of refusal
    /// records.
    ///
    /// The resource and revision come from the rejection where it names them (the token that was
    /// judged), else from the presented token. The token is recorded without its signature.
    pub fn refusal(attempt: &Attempt, rejection: &Rejection) -> Self {
        let token = attempt.token.as_ref();
        let resource = rejection
            .resource
            .clone()
            .or_else(|| token.map(|t| t.resource().clone()));
        let revision = rejection.revision.or_else(|| token.map(Token::revision));
        let unsigned_form = match (token, &resource, revision) {
            (Some(token), _, _) => Some(token.unsigned_form()),
            (None, Some(resource), Some(revision)) => Some(format!("fg1~{revision}~{resource}")),
            _ => None,
        };
        Self {
            store: attempt.store.as_str().to_owned(),
            client_addr: attempt.client_addr.clone(),
            client_identity: attempt.client_identity.clone(),
            resource: resource.map(|r| r.to_string()),
            token: unsigned_form,
            token_signed: token.is_some_and(Token::is_signed),
            revision: revision.map(|r| r.get()),
            fence: match rejection.reason {
                RejectReason::Stale { fence } => Some(fence),
                _ => None,
            },
            reason: rejection.reason.label().to_owned(),
            detail: rejection.detail.clone(),
            operation: attempt.operation.clone(),
            request_id: attempt.request_id.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Resource, Revision, TokenKey};

    fn attempt(token: Option<Token>) -> Attempt {
        Attempt {
            store: Store::Redis,
            client_addr: "127.0.0.1:5000".into(),
            client_identity: Some("app".into()),
            token,
            operation: OperationSummary {
                command: "SET".into(),
                objects: vec!["billing:1".into()],
                args: 3,
                bytes: 40,
            },
            request_id: "redis-1-1".into(),
        }
    }

    #[test]
    fn a_stale_refusal_records_token_fence_and_no_signature() {
        let key = TokenKey::new(1, &[9; 32]).unwrap();
        let token =
            Token::new(Resource::new("billing").unwrap(), Revision::new(7).unwrap()).signed(&key);
        let rejection = Rejection::new(RejectReason::Stale { fence: 12 }, "below the fence")
            .with_token(token.resource().clone(), token.revision());
        let signature = token.to_string().rsplit('.').next().unwrap().to_owned();
        let event = attempt(Some(token)).refused(&rejection);
        assert_eq!(event.store, "redis");
        assert_eq!(event.token.as_deref(), Some("fg1~7~billing"));
        assert!(event.token_signed);
        assert_eq!(
            (event.revision, event.fence),
            (Some(7), Some(12)),
            "{event:?}"
        );
        assert_eq!(event.reason, "stale");
        assert_eq!(event.operation.command, "SET");
        assert!(!serde_json::to_string(&event).unwrap().contains(&signature));
    }

    #[test]
    fn a_tokenless_refusal_names_no_token() {
        let rejection = Rejection::new(RejectReason::Missing, "needs a token");
        let event = attempt(None).refused(&rejection);
        assert_eq!(
            (event.token, event.resource, event.revision),
            (None, None, None)
        );
        assert_eq!(event.reason, "missing");
        assert_eq!(event.client_identity.as_deref(), Some("app"));
    }

    #[test]
    fn a_forged_token_is_named_from_the_rejection() {
        let rejection = Rejection::new(RejectReason::Forged, "bad signature")
            .with_token(Resource::new("vault").unwrap(), Revision::new(9).unwrap());
        let event = attempt(None).refused(&rejection);
        assert_eq!(event.token.as_deref(), Some("fg1~9~vault"));
        assert!(!event.token_signed);
    }
}
