//! The pingora service: every request's signature is verified here; reads (`GET`/`HEAD`)
//! stream through pingora's proxy, re-signed with the gateway's credentials; every other
//! request is answered from `request_filter` by [`crate::session`] (like pingora's
//! `rate_limiter` example answers from `request_filter`), because a fenced write takes several
//! upstream round trips (HEAD, conditional write, retries) that one proxied request cannot.
//!
//! Runtime: pingora runs its own `Server` with its own runtimes. [`S3Gateway::start`] runs it
//! on a dedicated OS thread with a shutdown watch that the node triggers, so the node's tokio
//! runtime and signal handling stay the node's. To drain, the node asks for pingora's graceful
//! terminate ([`GatewayHandle::stop_accepting`]: the listener closes, keep-alive ends after
//! the current request) and waits on [`GatewayHandle::requests`], which counts the requests in
//! flight (pingora itself only sleeps out a fixed grace period).

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;

use async_trait::async_trait;
use fencegate_core::{
    AuditSink, ConnectionCap, OpenConnection, ServerCert, Store, TokenPolicy, UpstreamFailure,
};
use pingora_core::listeners::tls::TlsSettings;
use pingora_core::listeners::TcpSocketOptions;
use pingora_core::protocols::l4::ext::TcpKeepalive;
use pingora_core::server::configuration::ServerConf;
use pingora_core::server::{RunArgs, Server, ShutdownSignal, ShutdownSignalWatch};
use pingora_core::services::listening::Service;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_http::RequestHeader;
use pingora_proxy::{ProxyHttp, Session};
use tokio::sync::watch;
use tokio_util::task::task_tracker::TaskTrackerToken;
use tokio_util::task::TaskTracker;

use crate::config::{parse_credentials, S3Config};
use crate::connection_bound::BoundedApp;
use crate::error::S3Error;
use crate::gateway::{S3Clients, Shared};
use crate::respond::respond_error;
use crate::rewrite::{Operation, Target};
use crate::session::WriteSession;
use crate::sigv4_verify::{self, SignedRequest};
use crate::upstream::{Upstream, DROPPED_HEADERS};

/// The client credentials `config` names (`clients_env`, then `clients_file`).
pub(crate) fn load_clients(config: &S3Config) -> Result<HashMap<String, String>, S3Error> {
    let mut clients = HashMap::new();
    if let Some(var) = &config.clients_env {
        let text = std::env::var(var).map_err(|_| {
            S3Error::Config(format!(
                "the environment variable {var} (clients_env) is not set"
            ))
        })?;
        clients.extend(parse_credentials(&text)?);
    }
    if let Some(path) = &config.clients_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| S3Error::Config(format!("clients_file {}: {e}", path.display())))?;
        clients.extend(parse_credentials(&text)?);
    }
    Ok(clients)
}

/// A configured S3 gateway, ready to start.
pub struct S3Gateway {
    shared: Arc<Shared>,
    /// The certificate the HTTPS listener presents (`tls_cert`/`tls_key`); SIGHUP replaces it.
    server_cert: Option<Arc<ServerCert>>,
    /// How long pingora keeps its runtimes after a graceful terminate.
    grace: std::time::Duration,
}

/// A running gateway; [`GatewayHandle::shutdown`] stops it.
pub struct GatewayHandle {
    stop: watch::Sender<Stop>,
    thread: Option<JoinHandle<()>>,
    running: Arc<std::sync::atomic::AtomicBool>,
    requests: TaskTracker,
    /// Requests begun so far (a connection accepted before the listener closed may send its
    /// request after: the drain counts it too).
    begun: Arc<std::sync::atomic::AtomicU64>,
    clients: S3Clients,
    server_cert: Option<Arc<ServerCert>>,
}

/// What the node asked of the pingora server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Run,
    /// Close the listener, finish the requests in flight.
    Graceful,
    /// Stop now.
    Fast,
}

impl S3Gateway {
    /// A gateway for `config`, reading its secrets from the environment (and `clients_file`).
    pub fn new(
        config: S3Config,
        policy: TokenPolicy,
        audit: Arc<dyn AuditSink>,
    ) -> Result<Self, S3Error> {
        config.validate()?;
        let secret = std::env::var(&config.upstream_secret_env).map_err(|_| {
            S3Error::Config(format!(
                "the environment variable {} (upstream_secret_env) is not set",
                config.upstream_secret_env
            ))
        })?;
        let clients = load_clients(&config)?;
        let server_cert = match (&config.tls_cert, &config.tls_key) {
            (Some(cert), Some(key)) => {
                Some(ServerCert::load(cert, key).map_err(|e| S3Error::Config(e.to_string()))?)
            }
            _ => None,
        };
        let upstream = Upstream::new(
            &config.upstream,
            &config.region,
            &config.upstream_access_key,
            &secret,
        )?;
        Ok(Self {
            shared: Arc::new(Shared::new(config, clients, upstream, policy, audit)?),
            server_cert,
            grace: std::time::Duration::ZERO,
        })
    }

    /// How long requests in flight may run after [`GatewayHandle::stop_accepting`] (the node's
    /// `shutdown_grace_ms`); pingora's runtimes are kept that long. Default: none.
    pub fn with_grace(mut self, grace: std::time::Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Starts the listener on its own thread and pingora runtime.
    pub fn start(self) -> Result<GatewayHandle, S3Error> {
        let config = &self.shared.config;
        // Two rustls crypto providers are linked (pingora's aws-lc-rs, reqwest's ring); rustls
        // needs one chosen for the process. An error means one is already installed: fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
        // Fail early with a clear error if the address is taken (pingora would panic later).
        drop(
            std::net::TcpListener::bind(config.listen)
                .map_err(|e| S3Error::Listen(format!("{}: {e}", config.listen)))?,
        );
        let conf = ServerConf {
            // The CA the read path (pingora's rustls connector) trusts for an https upstream.
            ca_file: config
                .upstream_ca_file
                .as_ref()
                .map(|p| p.to_string_lossy().into_owned()),
            threads: config.threads,
            grace_period_seconds: Some(self.grace.as_secs_f64().ceil() as u64),
            graceful_shutdown_timeout_seconds: Some(1),
            ..ServerConf::default()
        };
        let mut server = Server::new_with_opt_and_conf(None, conf);
        server.bootstrap();
        let requests = TaskTracker::new();
        let begun = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let proxy = pingora_proxy::http_proxy(
            &server.configuration,
            S3Proxy {
                shared: self.shared.clone(),
                requests: requests.clone(),
                begun: begun.clone(),
            },
        );
        let tls = match &self.server_cert {
            Some(cert) => {
                // A resolver rather than the file paths: pingora would read them once, and a
                // renewed certificate would need a restart.
                let mut tls = TlsSettings::intermediate("", "").map_err(|e| {
                    S3Error::Listen(format!("TLS listener on {}: {e}", config.listen))
                })?;
                tls.set_cert_resolver(cert.clone());
                Some(tls.build())
            }
            None => None,
        };
        // The listener is plain TCP: the app admits each connection under the bound before
        // its TLS handshake (crate::connection_bound).
        let app = BoundedApp::new(
            proxy,
            config.max_client_connections,
            tls,
            self.shared.audit.clone(),
        );
        let mut service = Service::new("fencegate-s3".to_owned(), app);
        service.add_tcp_with_settings(&config.listen.to_string(), keepalive());
        server.add_service(service);
        let (stop, stop_rx) = watch::channel(Stop::Run);
        tracing::info!(listen = %config.listen, upstream = %self.shared.upstream.base, "S3 gateway started");
        let running = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let still = running.clone();
        let thread = std::thread::Builder::new()
            .name("fencegate-s3".into())
            .spawn(move || {
                server.run(RunArgs {
                    shutdown_signal: Box::new(StopWatch(stop_rx)),
                });
                still.store(false, std::sync::atomic::Ordering::Relaxed);
            })
            .map_err(|e| S3Error::Listen(e.to_string()))?;
        Ok(GatewayHandle {
            stop,
            thread: Some(thread),
            running,
            requests,
            begun,
            clients: S3Clients {
                shared: self.shared.clone(),
            },
            server_cert: self.server_cert.clone(),
        })
    }
}

impl GatewayHandle {
    /// Set while the listener's server runs (for a health check).
    pub fn running(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.running.clone()
    }

    /// Stops the listener and waits for the pingora runtimes to exit.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    /// Closes the listener (new clients are refused); requests in flight run on, and each
    /// connection closes after its current request.
    pub fn stop_accepting(&self) {
        self.requests.close();
        let _ = self.stop.send(Stop::Graceful);
    }

    /// The requests in flight: `len()` counts them, `wait()` (after
    /// [`GatewayHandle::stop_accepting`]) returns when the last one was answered.
    pub fn requests(&self) -> TaskTracker {
        self.requests.clone()
    }

    /// How many requests have begun since the gateway started.
    pub fn requests_begun(&self) -> u64 {
        self.begun.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The gateway's client credentials, to reload them.
    pub fn clients(&self) -> S3Clients {
        self.clients.clone()
    }

    /// The certificate the HTTPS listener presents, when `tls_cert` is set: SIGHUP reloads it.
    pub fn server_cert(&self) -> Option<Arc<ServerCert>> {
        self.server_cert.clone()
    }

    /// Leaves the pingora thread to the process's exit, after a drain: pingora sleeps out its
    /// whole grace period before it stops its runtimes, and the node need not wait for that.
    pub fn detach(mut self) {
        self.thread.take();
    }

    fn stop_and_join(&mut self) {
        let _ = self.stop.send(Stop::Fast);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for GatewayHandle {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

struct StopWatch(watch::Receiver<Stop>);

#[async_trait]
impl ShutdownSignalWatch for StopWatch {
    async fn recv(&self) -> ShutdownSignal {
        let mut rx = self.0.clone();
        match rx.wait_for(|stop| *stop != Stop::Run).await.map(|s| *s) {
            Ok(Stop::Graceful) => ShutdownSignal::GracefulTerminate,
            _ => ShutdownSignal::FastShutdown,
        }
    }
}

/// TCP keepalive on every client, as the other gateways set it: a client whose host vanished
/// gives its slot back within about two minutes.
fn keepalive() -> TcpSocketOptions {
    let mut options = TcpSocketOptions::default();
    options.tcp_keepalive = Some(TcpKeepalive {
        idle: ConnectionCap::KEEPALIVE_IDLE,
        interval: ConnectionCap::KEEPALIVE_INTERVAL,
        count: ConnectionCap::KEEPALIVE_PROBES as usize,
        #[cfg(target_os = "linux")]
        user_timeout: std::time::Duration::ZERO,
    });
    options
}

/// Per-request state.
pub struct RequestCtx {
    target: Option<Target>,
    /// Counts this request as in flight until it is answered (the context is dropped then).
    _in_flight: Option<TaskTrackerToken>,
    /// Counts the request as open (the `connections` gauge) until the context is dropped.
    _open: OpenConnection,
    started: std::time::Instant,
}

/// Whether a request's failure was connecting to the upstream.
fn connect_failure(e: &pingora_core::Error) -> bool {
    use pingora_core::ErrorType::*;
    matches!(
        e.etype(),
        ConnectTimedout
            | ConnectRefused
            | ConnectNoRoute
            | TLSHandshakeFailure
            | TLSHandshakeTimedout
            | InvalidCert
            | HandshakeError
            | ConnectError
    )
}

struct S3Proxy {
    shared: Arc<Shared>,
    requests: TaskTracker,
    begun: Arc<std::sync::atomic::AtomicU64>,
}

/// The request's headers with lower-case names; `None` if one is not UTF-8.
fn collect_headers(req: &RequestHeader) -> Option<Vec<(String, String)>> {
    req.headers
        .iter()
        .map(|(n, v)| {
            v.to_str()
                .ok()
                .map(|v| (n.as_str().to_ascii_lowercase(), v.to_owned()))
        })
        .collect()
}

#[async_trait]
impl ProxyHttp for S3Proxy {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        self.begun
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        RequestCtx {
            target: None,
            _in_flight: Some(self.requests.token()),
            _open: OpenConnection::new(self.shared.audit.clone(), Store::S3),
            started: std::time::Instant::now(),
        }
    }

    async fn logging(
        &self,
        session: &mut Session,
        e: Option<&pingora_core::Error>,
        ctx: &mut RequestCtx,
    ) {
        let sink = &self.shared.audit;
        sink.request_done(Store::S3, ctx.started.elapsed());
        let status = session.response_written().map(|r| r.status.as_u16());
        match e {
            Some(e) if connect_failure(e) => {
                sink.upstream_failed(Store::S3, UpstreamFailure::Connect)
            }
            Some(e) if *e.esource() == pingora_core::ErrorSource::Upstream => {
                sink.upstream_failed(Store::S3, UpstreamFailure::Error)
            }
            // The gateway's own upstream calls (writes, manifests) answer 502/504 when the store
            // failed or did not answer.
            _ if matches!(status, Some(502 | 504)) => {
                sink.upstream_failed(Store::S3, UpstreamFailure::Error)
            }
            _ => {}
        }
    }

    async fn request_filter(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> pingora_core::Result<bool> {
        let request_id = uuid::Uuid::new_v4().simple().to_string();
        let req = session.req_header();
        let method = req.method.as_str().to_owned();
        let raw_path = req.uri.path().to_owned();
        let raw_query = req.uri.query().unwrap_or("").to_owned();
        let Some(headers) = collect_headers(req) else {
            respond_error(
                session,
                400,
                "InvalidArgument",
                "a header value is not valid UTF-8",
                &raw_path,
                &request_id,
            )
            .await;
            return Ok(true);
        };
        let signed = SignedRequest {
            method: &method,
            raw_path: &raw_path,
            raw_query: &raw_query,
            headers: &headers,
        };
        let verified = match sigv4_verify::verify(
            &signed,
            &self.shared.clients(),
            &self.shared.config.region,
            time::OffsetDateTime::now_utc(),
        ) {
            Ok(v) => v,
            Err(e) => {
                let (status, code) = e.status_and_code();
                tracing::info!(request_id, code, "client authentication refused");
                respond_error(session, status, code, &e.message(), &raw_path, &request_id).await;
                return Ok(true);
            }
        };
        let host = headers
            .iter()
            .find(|(n, _)| n == "host")
            .map(|(_, v)| v.as_str())
            .unwrap_or("");
        let target = Target::parse(
            host,
            &raw_path,
            self.shared.config.virtual_host_suffix.as_deref(),
        );
        let query = crate::gateway::query_pairs(&raw_query);
        let copy_source = headers.iter().any(|(n, _)| n == "x-amz-copy-source");
        let operation = Operation::classify(&method, &query, target.key.is_some(), copy_source);
        let judged = Upstream::path_and_query(target.bucket.as_deref(), target.key.as_deref(), "");
        let normalized = !self.shared.upstream.sent_as_judged(&judged);
        let manifest_bucket = target
            .bucket
            .as_deref()
            .is_some_and(|b| self.shared.config.bucket_has_manifest(b));
        if operation == Operation::Read && !normalized && !manifest_bucket {
            ctx.target = Some(target);
            return Ok(false);
        }
        let mut write = WriteSession {
            shared: &self.shared,
            session,
            request_id,
            method,
            raw_query,
            headers,
            verified,
            target,
            operation,
        };
        if normalized {
            write.refuse_normalized_path().await;
        } else if write.operation == Operation::Read {
            // Manifest mode: a logical key resolves to its physical object, or is answered here.
            if let Some(physical) = write.manifest_read().await {
                ctx.target = Some(physical);
                return Ok(false);
            }
        } else {
            write.run().await;
        }
        Ok(true)
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut RequestCtx,
    ) -> pingora_core::Result<Box<HttpPeer>> {
        let up = &self.shared.upstream;
        let mut peer = HttpPeer::new((up.host.as_str(), up.port), up.tls, up.host.clone());
        // A hung store answers the reader 502/504 within the bound instead of never.
        let timeout = std::time::Duration::from_millis(self.shared.config.upstream_timeout_ms);
        peer.options.connection_timeout = Some(timeout);
        peer.options.total_connection_timeout = Some(timeout);
        peer.options.read_timeout = Some(timeout);
        Ok(Box::new(peer))
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> pingora_core::Result<()> {
        let target = ctx.target.clone().unwrap_or(Target {
            bucket: None,
            key: None,
        });
        let raw_query = session.req_header().uri.query().unwrap_or("").to_owned();
        let path =
            Upstream::path_and_query(target.bucket.as_deref(), target.key.as_deref(), &raw_query);
        let mut headers: Vec<(String, String)> = collect_headers(upstream_request)
            .unwrap_or_default()
            .into_iter()
            .filter(|(n, _)| !DROPPED_HEADERS.contains(&n.as_str()))
            .collect();
        headers.push(("host".to_owned(), self.shared.upstream.host_header()));
        let signature = self
            .shared
            .upstream
            .sign(upstream_request.method.as_str(), &path, &headers)
            .map_err(|e| {
                pingora_core::Error::because(
                    pingora_core::ErrorType::InternalError,
                    "signing the upstream request",
                    e,
                )
            })?;
        let uri: http::Uri = path.parse().map_err(|e| {
            pingora_core::Error::because(pingora_core::ErrorType::InternalError, "upstream uri", e)
        })?;
        for name in DROPPED_HEADERS {
            upstream_request.remove_header(*name);
        }
        upstream_request.set_uri(uri);
        for (name, value) in headers.into_iter().chain(signature) {
            upstream_request.insert_header(name, value)?;
        }
        Ok(())
    }
}
