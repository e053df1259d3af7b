//! Answers written back to the client from `request_filter` (S3 XML errors, relayed store
//! answers).

use bytes::Bytes;
use pingora_http::ResponseHeader;
use pingora_proxy::Session;

use crate::error_xml::S3ErrorBody;

/// Answers the client with an S3 XML error.
pub async fn respond_error(
    session: &mut Session,
    status: u16,
    code: &'static str,
    message: &str,
    resource: &str,
    request_id: &str,
) {
    let body = S3ErrorBody::new(status, code, message, resource, request_id);
    respond_body(session, &body).await;
}

pub(crate) async fn respond_body(session: &mut Session, error: &S3ErrorBody) {
    let xml = Bytes::from(error.to_xml());
    respond(
        session,
        error.status,
        vec![("content-type".into(), "application/xml".into())],
        xml,
        &error.request_id,
    )
    .await;
}

pub(crate) async fn respond(
    session: &mut Session,
    status: u16,
    headers: Vec<(String, String)>,
    body: Bytes,
    request_id: &str,
) {
    let Ok(mut response) = ResponseHeader::build(status, Some(headers.len() + 3)) else {
        return;
    };
    for (name, value) in headers {
        if [
            "content-length",
            "transfer-encoding",
            "connection",
            "keep-alive",
        ]
        .contains(&name.to_ascii_lowercase().as_str())
        {
            continue;
        }
        let _ = response.append_header(name, value);
    }
    let _ = response.insert_header("content-length", body.len().to_string());
    let _ = response.insert_header("x-amz-request-id", request_id.to_owned());
    let head_only = session.req_header().method == http::Method::HEAD;
    let end = body.is_empty() || head_only;
    if let Err(e) = session.write_response_header(Box::new(response), end).await {
        tracing::debug!(error = %e, "writing a response header to the client failed");
        return;
    }
    if !end {
        if let Err(e) = session.write_response_body(Some(body), true).await {
            tracing::debug!(error = %e, "writing a response body to the client failed");
        }
    }
}
