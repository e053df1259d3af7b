//! Startup: the startup packet (SSLRequest, GSSENCRequest and CancelRequest first), the token
//! taken out of it, and the authentication relayed message by message until the server is
//! ready. Repeated startup parameters are refused (issue 12, bypass 8).

use std::net::SocketAddr;

use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::MAX_BACKEND_MESSAGE;
use crate::carrier;
use crate::error::PostgresError;
use crate::gateway::Gateway;
use crate::lexing::Lexing;
use crate::message::{self, ErrorFields, FrameReader, Startup};
use crate::sqlstate;
use crate::tls::ClientStream;
use crate::upstream::{UpstreamRead, UpstreamWrite};

/// A session the server accepted: both connections, and what the session starts with.
pub(super) struct Established {
    pub(super) client_read: FrameReader<ClientStream>,
    pub(super) upstream_read: FrameReader<UpstreamRead>,
    pub(super) upstream_write: UpstreamWrite,
    /// The first ReadyForQuery status.
    pub(super) status: u8,
    /// The token from the startup packet, if any.
    pub(super) session_token: Option<String>,
    /// The lexing settings the server reported during the login.
    pub(super) lexing: Lexing,
    pub(super) user: String,
    /// Whether the session's database is protected.
    pub(super) protected: bool,
}

/// Relays a CancelRequest (`raw`, as the client sent it) to the server on a connection of its
/// own, as the protocol asks.
async fn relay_cancel(gateway: &Gateway, raw: &[u8]) -> Result<(), PostgresError> {
    let mut upstream = gateway.upstream.connect().await?;
    upstream
        .write_all(raw)
        .await
        .map_err(PostgresError::io("relaying a cancel request"))?;
    let _ = upstream.shutdown().await;
    Ok(())
}

/// The startup packet's parameters, once encryption was negotiated: an SSLRequest is accepted
/// when a certificate is configured (TLS terminated here) and refused with 'N' otherwise, a
/// GSSENCRequest is refused, and a cancel is relayed (then `None`, as at end of stream).
async fn negotiate(
    gateway: &Gateway,
    client: TcpStream,
) -> Result<Option<(FrameReader<ClientStream>, Vec<(String, String)>)>, PostgresError> {
    let max = gateway.config.max_message_bytes;
    let mut client_read = FrameReader::new(ClientStream::Plain(client), max);
    let params = loop {
        let startup = match client_read.read_startup().await {
            Ok(Some(s)) => s,
            Ok(None) => return Ok(None),
            Err(e) => {
                fatal(
                    client_read.get_mut(),
                    sqlstate::PROTOCOL_VIOLATION,
                    &e.to_string(),
                )
                .await;
                return Err(e);
            }
        };
        match startup {
            Startup::Ssl | Startup::Gss => {
                if client_read.has_buffered() {
                    let msg = "data received after an encryption request before its answer";
                    fatal(client_read.get_mut(), sqlstate::PROTOCOL_VIOLATION, msg).await;
                    return Err(PostgresError::Protocol(msg.to_owned()));
                }
                let acceptor = match (&startup, &gateway.tls, client_read.get_mut()) {
                    (Startup::Ssl, Some(acceptor), ClientStream::Plain(_)) => Some(acceptor),
                    _ => None,
                };
                let answer: &[u8] = if acceptor.is_some() { b"S" } else { b"N" };
                client_read
                    .get_mut()
                    .write_all(answer)
                    .await
                    .map_err(PostgresError::io("answering an encryption request"))?;
                if let Some(acceptor) = acceptor {
                    let (stream, _) = client_read.into_parts();
                    let ClientStream::Plain(tcp) = stream else {
                        return Err(PostgresError::Protocol(
                            "SSLRequest on a connection that is already TLS".to_owned(),
                        ));
                    };
                    let tls = acceptor
                        .accept(tcp)
                        .await
                        .map_err(PostgresError::io("TLS handshake with the client"))?;
                    client_read = FrameReader::new(ClientStream::Tls(Box::new(tls)), max);
                }
            }
            Startup::Cancel(raw) => {
                relay_cancel(gateway, &raw).await?;
                return Ok(None);
            }
            Startup::Message(params) => break params,
        }
    };
    Ok(Some((client_read, params)))
}

/// A client over `max_client_connections`, answered as PostgreSQL answers one over its
/// `max_connections`: encryption negotiated and the startup packet read first (libpq shows no
/// error sent in answer to its SSLRequest), then SQLSTATE 53300. A cancel is still relayed,
/// as PostgreSQL serves cancels over its bound.
pub(crate) async fn refuse_over_cap(gateway: &Gateway, client: TcpStream, message: &str) {
    match negotiate(gateway, client).await {
        Ok(Some((mut client_read, _))) => {
            fatal(
                client_read.get_mut(),
                sqlstate::TOO_MANY_CONNECTIONS,
                message,
            )
            .await;
            let _ = client_read.get_mut().shutdown().await;
        }
        Ok(None) => {}
        Err(e) => tracing::debug!(error = %e, "a client over max_client_connections"),
    }
}

/// Runs the startup; `None` when the session ended in it (a cancel, a refused login).
pub(super) async fn establish(
    gateway: &Gateway,
    client: TcpStream,
    peer: SocketAddr,
    conn: u64,
) -> Result<Option<Established>, PostgresError> {
    let Some((mut client_read, params)) = negotiate(gateway, client).await? else {
        return Ok(None);
    };

    // The startup token, if any, is taken out of `options` before the packet is relayed.
    // A name given twice is read first-wins by some and last-wins by others (the server takes
    // the last): refused, so the gateway judges the database and user the server uses
    // (issue 12, bypass 8). A top-level `fencegate.token` is taken, never relayed.
    let mut seen = std::collections::HashSet::new();
    if let Some((name, _)) = params
        .iter()
        .find(|(n, _)| !seen.insert(n.to_ascii_lowercase()))
    {
        let msg = format!("fencegate: startup parameter {name:?} is given more than once");
        fatal(client_read.get_mut(), sqlstate::PROTOCOL_VIOLATION, &msg).await;
        return Err(PostgresError::Protocol(msg));
    }
    let mut session_token = None;
    let mut relayed = Vec::with_capacity(params.len());
    for (name, value) in params {
        if name.eq_ignore_ascii_case(carrier::SETTING) {
            session_token = Some(value);
        } else if name == "options" {
            let (token, rest) = carrier::startup_token(&value);
            session_token = token.or(session_token);
            if !rest.is_empty() {
                relayed.push((name, rest));
            }
        } else {
            relayed.push((name, value));
        }
    }
    let user = param(&relayed, "user").unwrap_or_default();
    let database = param(&relayed, "database").unwrap_or_else(|| user.clone());
    let protected = gateway.config.protects_database(&database);

    let upstream = match gateway.upstream.connect().await {
        Ok(s) => s,
        Err(e) => {
            use fencegate_core::{Store, UpstreamFailure};
            gateway
                .sink
                .upstream_failed(Store::Postgres, UpstreamFailure::Connect);
            let msg = format!("fencegate: cannot reach the upstream server: {e}");
            fatal(client_read.get_mut(), "08006", &msg).await;
            return Err(e);
        }
    };
    let (upstream_read, mut upstream_write) = fencegate_core::stream::split(upstream);
    let mut upstream_read = FrameReader::new(upstream_read, MAX_BACKEND_MESSAGE);
    upstream_write
        .write_all(&message::startup_message(&relayed))
        .await
        .map_err(PostgresError::io("sending the startup packet upstream"))?;

    // Authentication: relayed message by message until the server is ready (or refuses).
    let mut lexing = Lexing::default();
    let status = loop {
        let Some(frame) = upstream_read.read_frame().await? else {
            return Ok(None);
        };
        client_read
            .get_mut()
            .write_all(&frame.raw)
            .await
            .map_err(PostgresError::io("writing to the client"))?;
        match frame.tag {
            b'Z' => break frame.body().first().copied().unwrap_or(b'I'),
            b'E' => return Ok(None),
            b'S' => lexing.observe(frame.body()),
            b'R' => {
                let code = frame
                    .body()
                    .get(..4)
                    .map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
                // Cleartext, MD5, SASL start and SASL continue want an answer.
                if matches!(code, 3 | 5 | 10 | 11) {
                    let Some(answer) = client_read.read_frame().await? else {
                        return Ok(None);
                    };
                    if answer.tag != b'p' {
                        let msg = "expected a password message";
                        fatal(client_read.get_mut(), sqlstate::PROTOCOL_VIOLATION, msg).await;
                        return Err(PostgresError::Protocol(msg.to_owned()));
                    }
                    upstream_write
                        .write_all(&answer.raw)
                        .await
                        .map_err(PostgresError::io("relaying authentication"))?;
                }
            }
            _ => {}
        }
    };
    tracing::debug!(conn, %peer, user = %user, database = %database, protected, "postgres session ready");
    Ok(Some(Established {
        client_read,
        upstream_read,
        upstream_write,
        status,
        session_token,
        lexing,
        user,
        protected,
    }))
}

fn param(params: &[(String, String)], name: &str) -> Option<String> {
    params
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
}

/// Sends a FATAL error to a client that is about to be disconnected.
pub(super) async fn fatal<W: AsyncWrite + Unpin>(client: &mut W, code: &str, message: &str) {
    let bytes = message::error_response(&ErrorFields {
        severity: "FATAL",
        code: code.to_owned(),
        message: message.to_owned(),
        detail: None,
    });
    let _ = client.write_all(&bytes).await;
    let _ = client.flush().await;
}
