//! S3-style XML error bodies, and the stable status/code of each fencing refusal.
//!
//! | refusal       | status | code                        |
//! |---------------|--------|-----------------------------|
//! | missing token | 428    | `FencingTokenRequired`      |
//! | stale token   | 412    | `FencingTokenStale`         |
//! | malformed     | 400    | `FencingTokenMalformed`     |
//! | forged        | 403    | `FencingTokenForged`        |
//! | out of scope  | 403    | `FencingTokenOutOfScope`    |
//! | unsupported   | 403    | `FencingUnsupportedOperation` |

use fencegate_core::{RejectReason, Rejection};
use quick_xml::escape::escape;

/// An S3 error response: status, code, message, and the request path it concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3ErrorBody {
    /// HTTP status.
    pub status: u16,
    /// S3 error code (`NoSuchKey`, `FencingTokenStale`, ...).
    pub code: &'static str,
    /// Human-readable message (safe to show: no secrets, signatures or data).
    pub message: String,
    /// The bucket/key the request named.
    pub resource: String,
    /// The request id (also in the audit record).
    pub request_id: String,
    /// Extra elements (`PresentedRevision`, `CurrentRevision`).
    pub extra: Vec<(&'static str, String)>,
}

impl S3ErrorBody {
    /// An error with no extra elements.
    pub fn new(
        status: u16,
        code: &'static str,
        message: impl Into<String>,
        resource: &str,
        request_id: &str,
    ) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            resource: resource.to_owned(),
            request_id: request_id.to_owned(),
            extra: Vec::new(),
        }
    }

    /// The error answering a fencing refusal.
    pub fn from_rejection(rejection: &Rejection, resource: &str, request_id: &str) -> Self {
        let (status, code) = status_and_code(&rejection.reason);
        let mut body = Self::new(status, code, rejection.detail.clone(), resource, request_id);
        if let Some(revision) = rejection.revision {
            body.extra.push(("PresentedRevision", revision.to_string()));
        }
        if let RejectReason::Stale { fence } = rejection.reason {
            body.extra.push(("CurrentRevision", fence.to_string()));
        }
        body
    }

    /// The XML document.
    pub fn to_xml(&self) -> String {
        let mut xml = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error>");
        push(&mut xml, "Code", self.code);
        push(&mut xml, "Message", &self.message);
        push(&mut xml, "Resource", &self.resource);
        push(&mut xml, "RequestId", &self.request_id);
        for (name, value) in &self.extra {
            push(&mut xml, name, value);
        }
        xml.push_str("</Error>");
        xml
    }
}

fn push(xml: &mut String, name: &str, value: &str) {
    xml.push('<');
    xml.push_str(name);
    xml.push('>');
    xml.push_str(&escape(value));
    xml.push_str("</");
    xml.push_str(name);
    xml.push('>');
}

/// The HTTP status and S3 error code of a refusal reason.
pub fn status_and_code(reason: &RejectReason) -> (u16, &'static str) {
    match reason {
        RejectReason::Missing => (428, "FencingTokenRequired"),
        RejectReason::Stale { .. } => (412, "FencingTokenStale"),
        RejectReason::Malformed => (400, "FencingTokenMalformed"),
        RejectReason::Forged => (403, "FencingTokenForged"),
        RejectReason::OutOfScope => (403, "FencingTokenOutOfScope"),
        RejectReason::Unsupported => (403, "FencingUnsupportedOperation"),
    }
}

#[cfg(test)]
mod tests {
    use fencegate_core::{Resource, Revision};

    use super::*;

    #[test]
    fn golden_stale() {
        let rejection = Rejection::new(
            RejectReason::Stale { fence: 12 },
            "token 7 is below fence 12 on billing/out.csv",
        )
        .with_token(Resource::new("job").unwrap(), Revision::new(7).unwrap());
        let body = S3ErrorBody::from_rejection(&rejection, "/billing/out.csv", "r1");
        assert_eq!(body.status, 412);
        assert_eq!(
            body.to_xml(),
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>FencingTokenStale</Code><Message>token 7 is below fence 12 on billing/out.csv</Message><Resource>/billing/out.csv</Resource><RequestId>r1</RequestId><PresentedRevision>7</PresentedRevision><CurrentRevision>12</CurrentRevision></Error>"
        );
    }

    #[test]
    fn text_is_escaped() {
        let body = S3ErrorBody::new(400, "InvalidArgument", "a <b> & c", "/b/<k>", "r");
        assert!(body.to_xml().contains("a &lt;b&gt; &amp; c"));
        assert!(body.to_xml().contains("/b/&lt;k&gt;"));
    }
}
