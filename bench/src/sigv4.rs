//! SigV4 header signing for the S3 load generator: the AWS SDK's own signer (aws-sigv4), through
//! the S3 filter's `Upstream::sign` (`UNSIGNED-PAYLOAD`, path-style), so the bench signs exactly
//! as the gateway does upstream and carries no signer of its own.

use fencegate_s3::upstream::Upstream;

/// The headers to add to `method host path` (`path` already URI-encoded, no query):
/// `x-amz-date`, `x-amz-content-sha256` and `authorization`.
pub fn sign(
    method: &str,
    host: &str,
    path: &str,
    access_key: &str,
    secret: &str,
    region: &str,
) -> Vec<(String, String)> {
    let signer = Upstream::new(&format!("http://{host}"), region, access_key, secret)
        .expect("a loopback endpoint");
    signer
        .sign(method, path, &[("host".to_owned(), host.to_owned())])
        .expect("SigV4 signing")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_with_the_three_sigv4_headers() {
        let headers = sign(
            "PUT",
            "127.0.0.1:9000",
            "/bench/k",
            "AKID",
            "secret",
            "us-east-1",
        );
        let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
        for name in ["authorization", "x-amz-date", "x-amz-content-sha256"] {
            assert!(names.contains(&name), "{names:?}");
        }
        let auth = &headers
            .iter()
            .find(|(n, _)| n == "authorization")
            .unwrap()
            .1;
        assert!(
            auth.starts_with("AWS4-HMAC-SHA256 Credential=AKID/"),
            "{auth}"
        );
    }
}
