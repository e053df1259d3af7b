//! The `[s3]` config section.
//!
//! ```toml
//! [s3]
//! listen = "127.0.0.1:9080"              # where S3 clients connect
//! # tls_cert = "/etc/fencegate/s3.crt"    # optional: serve HTTPS (PEM cert chain and key)
//! # tls_key = "/etc/fencegate/s3.key"
//! upstream = "http://127.0.0.1:9000"     # the S3 endpoint (https:// uses rustls)
//! # upstream_ca_file = "/etc/fencegate/s3-upstream-ca.pem"  # extra CA for an https upstream
//! region = "us-east-1"                   # the region clients sign for and the gateway signs with
//! upstream_access_key = "AKIAGATEWAY"    # the gateway's own upstream credentials ...
//! upstream_secret_env = "FENCEGATE_S3_UPSTREAM_SECRET"   # ... secret read from this env var
//! clients_env = "FENCEGATE_S3_CLIENTS"   # client credentials: "AKID1:secret1,AKID2:secret2"
//! # clients_file = "/etc/fencegate/s3-clients"  # or one "access_key secret" pair per line
//! virtual_host_suffix = "s3.local"      # optional: bucket.s3.local/key is virtual-hosted style
//! retry_buffer_bytes = 16777216          # bodies up to this size are kept for conditional retries
//! max_attempts = 8                       # conditional write attempts before answering 503 SlowDown
//! upstream_timeout_ms = 60000            # a store silent this long answers 503 (writes) / 504 (reads)
//! max_open_uploads = 100000              # fenced multipart uploads tracked at once (age-evicted)
//! max_client_connections = 10000         # more clients at once get 503 SlowDown (HTTPS: closed)
//!
//! # Protected buckets/prefixes; the first rule whose bucket and prefix match decides.
//! [[s3.protect]]
//! bucket = "billing"
//! prefix = ""                            # "" = the whole bucket
//! mode = "object"                        # "object" (default), "manifest" or "off"
//! resource = "billing"                   # required unless mode = "off": tokens must name it
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use crate::error::S3Error;

/// The `[s3]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Config {
    /// Address the gateway listens on.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// A PEM certificate chain: with `tls_key`, the listener speaks HTTPS (rustls).
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key for `tls_cert`.
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
    /// The upstream S3 endpoint, `http://host:port` or `https://host[:port]`.
    #[serde(default = "default_upstream")]
    pub upstream: String,
    /// A PEM CA certificate (bundle) trusted for an `https://` upstream, in addition to the
    /// public web roots; for stores with a private CA.
    #[serde(default)]
    pub upstream_ca_file: Option<PathBuf>,
    /// The region clients sign for, and the gateway signs upstream requests with.
    #[serde(default = "default_region")]
    pub region: String,
    /// The gateway's upstream access key id.
    #[serde(default)]
    pub upstream_access_key: String,
    /// Name of the environment variable holding the gateway's upstream secret key.
    #[serde(default = "default_upstream_secret_env")]
    pub upstream_secret_env: String,
    /// Name of an environment variable holding client credentials (`AKID:secret,...`).
    #[serde(default)]
    pub clients_env: Option<String>,
    /// A file holding client credentials, one `access_key secret` pair per line (`#` comments).
    #[serde(default)]
    pub clients_file: Option<PathBuf>,
    /// A host suffix for virtual-hosted-style requests (`bucket.<suffix>`); unset: path style only.
    #[serde(default)]
    pub virtual_host_suffix: Option<String>,
    /// Bodies up to this many bytes are held so a conditional write that lost a race can be
    /// retried; larger bodies stream through once and a lost race answers 503 SlowDown.
    #[serde(default = "default_retry_buffer_bytes")]
    pub retry_buffer_bytes: usize,
    /// Conditional write attempts (a HEAD and a conditional request each) before giving up.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// How long the gateway waits for the store (connecting, or between bytes of an answer)
    /// before answering the client 503/504; a hung store never holds a request forever.
    #[serde(default = "default_upstream_timeout_ms")]
    pub upstream_timeout_ms: u64,
    /// How many fenced multipart uploads the gateway tracks at once; uploads are forgotten only
    /// by age (`upload_max_age_s`), and past this many a new CreateMultipartUpload answers 503,
    /// so nobody can flush a holder's upload out of the map.
    #[serde(default = "default_max_open_uploads")]
    pub max_open_uploads: usize,
    /// Age after which a fenced multipart upload is forgotten (its completion is refused).
    #[serde(default = "default_upload_max_age_s")]
    pub upload_max_age_s: u64,
    /// Worker threads of the gateway's own (pingora) runtime.
    #[serde(default = "default_threads")]
    pub threads: usize,
    /// The most client connections held open at once (DESIGN rule 10): each holds descriptors
    /// in the node's one process, beside the authority's. A client over it gets S3's own
    /// `503 SlowDown`, which SDKs retry with backoff; over HTTPS it is closed unanswered.
    #[serde(default = "default_max_client_connections")]
    pub max_client_connections: usize,
    /// Protection rules; the first match decides. Buckets no rule matches are not protected.
    #[serde(default)]
    pub protect: Vec<ProtectRule>,
}

/// One protection rule.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProtectRule {
    /// The bucket name (exact).
    pub bucket: String,
    /// A key prefix; empty matches every key of the bucket (and bucket-level operations).
    #[serde(default)]
    pub prefix: String,
    /// How writes under the rule are fenced.
    #[serde(default)]
    pub mode: ProtectMode,
    /// The resource tokens must name; required for every fencing mode (a token for another
    /// resource is refused 403 `FencingTokenOutOfScope`).
    #[serde(default)]
    pub resource: Option<String>,
}

/// How writes matching a rule are fenced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProtectMode {
    /// The fence travels in each object's metadata; writes are conditional on its ETag.
    /// Cannot fence a key it has never seen, nor tell identical bytes apart.
    #[default]
    Object,
    /// Writes go to immutable objects and become visible only when committed into the
    /// resource's manifest, which holds the fence (see [`crate::manifest`]). Fences new keys,
    /// deletes and identical bytes too.
    Manifest,
    /// Writes pass through (verified and re-signed) without a token.
    Off,
}

impl ProtectMode {
    /// Whether writes under the mode need a token.
    pub fn fenced(self) -> bool {
        self != Self::Off
    }
}

fn default_listen() -> SocketAddr {
    "127.0.0.1:9080".parse().expect("literal address")
}
fn default_upstream() -> String {
    "http://127.0.0.1:9000".to_owned()
}
fn default_region() -> String {
    "us-east-1".to_owned()
}
fn default_upstream_secret_env() -> String {
    "FENCEGATE_S3_UPSTREAM_SECRET".to_owned()
}
fn default_retry_buffer_bytes() -> usize {
    16 * 1024 * 1024
}
fn default_max_attempts() -> u32 {
    8
}
fn default_upstream_timeout_ms() -> u64 {
    60_000
}
fn default_max_open_uploads() -> usize {
    100_000
}
fn default_upload_max_age_s() -> u64 {
    7 * 24 * 3600
}
fn default_threads() -> usize {
    2
}
/// As the Redis gateway's default (Redis's own `maxclients`).
fn default_max_client_connections() -> usize {
    10_000
}

impl Default for S3Config {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            tls_cert: None,
            tls_key: None,
            upstream: default_upstream(),
            upstream_ca_file: None,
            region: default_region(),
            upstream_access_key: String::new(),
            upstream_secret_env: default_upstream_secret_env(),
            clients_env: None,
            clients_file: None,
            virtual_host_suffix: None,
            retry_buffer_bytes: default_retry_buffer_bytes(),
            max_attempts: default_max_attempts(),
            upstream_timeout_ms: default_upstream_timeout_ms(),
            max_open_uploads: default_max_open_uploads(),
            upload_max_age_s: default_upload_max_age_s(),
            threads: default_threads(),
            max_client_connections: default_max_client_connections(),
            protect: Vec::new(),
        }
    }
}

impl S3Config {
    /// Checks values serde cannot.
    pub fn validate(&self) -> Result<(), S3Error> {
        if !(self.upstream.starts_with("http://") || self.upstream.starts_with("https://")) {
            return Err(S3Error::Config(format!(
                "upstream {:?} must start with http:// or https://",
                self.upstream
            )));
        }
        if self.upstream_access_key.is_empty() {
            return Err(S3Error::Config(
                "upstream_access_key is empty; the gateway signs upstream requests with its own credentials".to_owned(),
            ));
        }
        if self.clients_env.is_none() && self.clients_file.is_none() {
            return Err(S3Error::Config(
                "set clients_env or clients_file: the gateway verifies every client's signature"
                    .to_owned(),
            ));
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(S3Error::Config(
                "set both tls_cert and tls_key, or neither".to_owned(),
            ));
        }
        if self.max_attempts == 0 || self.max_attempts > 100 {
            return Err(S3Error::Config("max_attempts must be 1 to 100".to_owned()));
        }
        if self.upstream_timeout_ms == 0 {
            return Err(S3Error::Config(
                "upstream_timeout_ms must be at least 1".to_owned(),
            ));
        }
        if self.max_open_uploads == 0 {
            return Err(S3Error::Config(
                "max_open_uploads must be at least 1".to_owned(),
            ));
        }
        if self.threads == 0 {
            return Err(S3Error::Config("threads must be at least 1".to_owned()));
        }
        let most = fencegate_core::ConnectionCap::MOST;
        if !(1..=most).contains(&self.max_client_connections) {
            return Err(S3Error::Config(format!(
                "max_client_connections ({}) must be between 1 and {most}",
                self.max_client_connections
            )));
        }
        for rule in &self.protect {
            if rule.bucket.is_empty() {
                return Err(S3Error::Config(
                    "a protect rule has an empty bucket".to_owned(),
                ));
            }
            match &rule.resource {
                Some(resource) => {
                    fencegate_core::Resource::new(resource).map_err(|e| {
                        S3Error::Config(format!("protect rule for {}: {e}", rule.bucket))
                    })?;
                }
                None if rule.mode.fenced() => {
                    return Err(S3Error::Config(format!(
                        "the protect rule for bucket {:?} prefix {:?} has no resource: name the lock \
                         resource whose tokens may write it (resource = \"...\"), so a token issued \
                         for another job is refused",
                        rule.bucket, rule.prefix
                    )));
                }
                None => {}
            }
        }
        Ok(())
    }

    /// The first rule matching `bucket` and `key` (`None` key: a bucket-level operation, which
    /// any rule for the bucket matches).
    pub fn rule_for(&self, bucket: &str, key: Option<&str>) -> Option<&ProtectRule> {
        self.protect.iter().find(|rule| {
            rule.bucket == bucket
                && match key {
                    Some(key) => key.starts_with(&rule.prefix),
                    None => true,
                }
        })
    }
}

impl S3Config {
    /// Whether any rule of `bucket` fences writes: bucket-level writes (lifecycle, policy,
    /// versioning, ...) can change every key, so they are refused on such a bucket whatever
    /// its first rule says.
    pub fn bucket_protected(&self, bucket: &str) -> bool {
        self.protect
            .iter()
            .any(|rule| rule.bucket == bucket && rule.mode.fenced())
    }
}

impl S3Config {
    /// Whether any rule of `bucket` is in manifest mode (its keys are logical: reads resolve
    /// them through the manifest).
    pub fn bucket_has_manifest(&self, bucket: &str) -> bool {
        self.protect
            .iter()
            .any(|rule| rule.bucket == bucket && rule.mode == ProtectMode::Manifest)
    }
}

impl S3Config {
    /// The bucket whose manifest-mode log holds `resource`'s fence, for an operator's reset
    /// (`bucket`: the operator's choice, needed when several buckets keep a log of it). Object
    /// mode has no one fence to reset, and the error says so and what to do instead.
    pub fn reset_bucket(&self, resource: &str, bucket: Option<&str>) -> Result<String, S3Error> {
        let names = |mode: ProtectMode| {
            let mut buckets: Vec<&str> = Vec::new();
            for rule in &self.protect {
                if rule.mode == mode
                    && rule.resource.as_deref() == Some(resource)
                    && !buckets.contains(&rule.bucket.as_str())
                {
                    buckets.push(&rule.bucket);
                }
            }
            buckets
        };
        let manifests = names(ProtectMode::Manifest);
        match (bucket, manifests.as_slice()) {
            (Some(want), _) if manifests.contains(&want) => Ok(want.to_owned()),
            (None, [only]) => Ok((*only).to_owned()),
            (_, []) if !names(ProtectMode::Object).is_empty() => Err(S3Error::Config(format!(
                "resource {resource} is fenced in S3 object mode, where each object carries its own fence (its {} metadata), so there is no one fence to reset. Start or bump the authority above the highest fence the refusals report (`fencegate snapshot bump N`), or rewrite the affected objects directly in the store",
                crate::rewrite::FENCE_REVISION_HEADER
            ))),
            (_, []) => Err(S3Error::Config(format!(
                "no protect rule of this node's [s3] section names resource {resource}; send the reset to a node whose config fences it in manifest mode"
            ))),
            (Some(want), _) => Err(S3Error::Config(format!(
                "bucket {want} keeps no manifest-mode log of resource {resource}; its manifests are in: {}",
                manifests.join(", ")
            ))),
            (None, _) => Err(S3Error::Config(format!(
                "resource {resource} has a manifest-mode log in several buckets ({}), each with its own fence; name one with --bucket",
                manifests.join(", ")
            ))),
        }
    }
}

/// Parses client credentials: `AKID:secret` pairs separated by commas or newlines, or
/// `AKID secret` lines; `#` starts a comment line.
pub fn parse_credentials(text: &str) -> Result<Vec<(String, String)>, S3Error> {
    let mut out = Vec::new();
    for (n, item) in text
        .split([',', '\n'])
        .map(str::trim)
        .enumerate()
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
    {
        let (id, secret) = item
            .split_once(':')
            .or_else(|| item.split_once(char::is_whitespace))
            .ok_or_else(|| {
                S3Error::Config(format!(
                    "client credential entry {} is not `access_key:secret`",
                    n + 1
                ))
            })?;
        let (id, secret) = (id.trim(), secret.trim());
        if id.is_empty() || secret.is_empty() {
            return Err(S3Error::Config(format!(
                "client credential entry {} has an empty access key or secret",
                n + 1
            )));
        }
        out.push((id.to_owned(), secret.to_owned()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_parse_both_forms() {
        let got = parse_credentials("A:x, B:y\n# comment\nC z\n").unwrap();
        assert_eq!(
            got,
            vec![
                ("A".into(), "x".into()),
                ("B".into(), "y".into()),
                ("C".into(), "z".into())
            ]
        );
        assert!(parse_credentials("nosecret").is_err());
    }

    #[test]
    fn first_matching_rule_decides() {
        let config = S3Config {
            protect: vec![
                ProtectRule {
                    bucket: "b".into(),
                    prefix: "tmp/".into(),
                    mode: ProtectMode::Off,
                    resource: None,
                },
                ProtectRule {
                    bucket: "b".into(),
                    prefix: String::new(),
                    mode: ProtectMode::Object,
                    resource: Some("job".into()),
                },
            ],
            ..S3Config::default()
        };
        assert_eq!(
            config.rule_for("b", Some("tmp/x")).unwrap().mode,
            ProtectMode::Off
        );
        assert_eq!(
            config.rule_for("b", Some("data/x")).unwrap().mode,
            ProtectMode::Object
        );
        assert!(config.rule_for("other", Some("x")).is_none());
        assert!(config.bucket_protected("b"));
        assert!(!config.bucket_protected("other"));
    }

    #[test]
    fn fencing_rules_must_name_their_resource() {
        let mut config = S3Config {
            upstream_access_key: "gw".into(),
            clients_env: Some("X".into()),
            protect: vec![ProtectRule {
                bucket: "b".into(),
                prefix: String::new(),
                mode: ProtectMode::Object,
                resource: None,
            }],
            ..S3Config::default()
        };
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("has no resource"), "{err}");
        config.protect[0].mode = ProtectMode::Off;
        config.validate().unwrap();
    }

    #[test]
    fn max_client_connections_is_bounded_both_ways() {
        let with = |n| S3Config {
            upstream_access_key: "gw".into(),
            clients_env: Some("X".into()),
            max_client_connections: n,
            ..S3Config::default()
        };
        assert!(with(1).validate().is_ok());
        assert!(with(fencegate_core::ConnectionCap::MOST).validate().is_ok());
        for bad in [0, fencegate_core::ConnectionCap::MOST + 1] {
            let e = with(bad).validate().expect_err("refused").to_string();
            assert!(e.contains("max_client_connections"), "{e}");
        }
    }
}
