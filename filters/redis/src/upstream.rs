//! Connecting to the upstream Redis: authentication, learning the command table, and loading
//! the fence script.

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::command_table::CommandTable;
use crate::config::RedisConfig;
use crate::durability::{self, Settings};
use crate::error::RedisError;
use crate::frame::{self, Frame, Limits};
use crate::rewrite::{
    batch_function_source, batch_script_source, function_source, script_source, ScriptMode,
};
use crate::stream::Connection;
pub use crate::tls::Upstream;

/// What the gateway learned from the upstream at connect time.
#[derive(Debug, Clone)]
pub struct UpstreamInfo {
    /// Commands, flags and key specs from `COMMAND`.
    pub table: CommandTable,
    /// How to call the fence script.
    pub mode: ScriptMode,
}

/// A connection used for one request at a time (setup and reloads, not client traffic).
pub struct ControlConnection {
    stream: Connection,
    buf: BytesMut,
}

/// Opens a connection to the upstream (TLS when `rediss://`) and authenticates it when the
/// config says so.
pub async fn connect(upstream: &Upstream, config: &RedisConfig) -> Result<Connection, RedisError> {
    let mut stream = upstream.open().await?;
    if let Some(password) = config.password()? {
        let mut args = vec![Bytes::from_static(b"AUTH")];
        if let Some(user) = &config.username {
            args.push(Bytes::from(user.clone()));
        }
        args.push(Bytes::from(password));
        let mut buf = BytesMut::new();
        let reply = request_on(&mut stream, &mut buf, args).await?;
        if let Frame::Error(e) = reply {
            return Err(RedisError::Upstream(format!(
                "refused AUTH: {}",
                String::from_utf8_lossy(&e)
            )));
        }
    }
    Ok(stream)
}

async fn request_on(
    stream: &mut Connection,
    buf: &mut BytesMut,
    args: Vec<Bytes>,
) -> Result<Frame, RedisError> {
    stream
        .write_all(&Frame::command(args).to_bytes())
        .await
        .map_err(RedisError::io("writing to upstream"))?;
    let limits = Limits::default();
    loop {
        if let Some((frame, len)) =
            frame::parse(buf, &limits).map_err(|source| RedisError::Frame {
                context: "upstream reply",
                source,
            })?
        {
            buf.advance(len);
            return Ok(frame);
        }
        if stream
            .read_buf(buf)
            .await
            .map_err(RedisError::io("reading from upstream"))?
            == 0
        {
            return Err(RedisError::Upstream("closed the connection".into()));
        }
    }
}

impl ControlConnection {
    /// Connects and authenticates.
    pub async fn open(upstream: &Upstream, config: &RedisConfig) -> Result<Self, RedisError> {
        Ok(Self {
            stream: connect(upstream, config).await?,
            buf: BytesMut::new(),
        })
    }

    /// Sends one command and returns its reply.
    pub async fn request(&mut self, args: &[&str]) -> Result<Frame, RedisError> {
        let args = args
            .iter()
            .map(|a| Bytes::copy_from_slice(a.as_bytes()))
            .collect();
        request_on(&mut self.stream, &mut self.buf, args).await
    }

    /// Loads the fence script and the batch fence script: as Redis Functions (two libraries)
    /// where the server has them, else as cached scripts. Safe to repeat (functions are loaded
    /// with `REPLACE`; a library of the same name holds the same code).
    pub async fn load_fence(&mut self) -> Result<ScriptMode, RedisError> {
        match self
            .request(&["FUNCTION", "LOAD", "REPLACE", &function_source()])
            .await?
        {
            Frame::Error(e) => {
                let text = String::from_utf8_lossy(&e).to_ascii_lowercase();
                if !text.contains("unknown command") {
                    return Err(RedisError::Upstream(format!(
                        "refused FUNCTION LOAD: {text}"
                    )));
                }
            }
            _ => {
                if let Frame::Error(e) = self
                    .request(&["FUNCTION", "LOAD", "REPLACE", &batch_function_source()])
                    .await?
                {
                    return Err(RedisError::Upstream(format!(
                        "refused FUNCTION LOAD of the batch fence library: {}",
                        String::from_utf8_lossy(&e)
                    )));
                }
                return Ok(ScriptMode::Function);
            }
        }
        let sha = self.script_load(&script_source()).await?;
        let batch_sha = self.script_load(&batch_script_source()).await?;
        Ok(ScriptMode::Script { sha, batch_sha })
    }

    async fn script_load(&mut self, source: &str) -> Result<String, RedisError> {
        match self.request(&["SCRIPT", "LOAD", source]).await? {
            Frame::Bulk(sha) => Ok(String::from_utf8_lossy(&sha).into_owned()),
            other => Err(RedisError::Upstream(format!(
                "answered SCRIPT LOAD with {other:?}"
            ))),
        }
    }

    /// One `CONFIG GET` value; `None` when the server would not say.
    async fn config_get(&mut self, name: &str) -> Result<Option<String>, RedisError> {
        Ok(match self.request(&["CONFIG", "GET", name]).await? {
            Frame::Array(items) => match items.get(1) {
                Some(Frame::Bulk(v)) | Some(Frame::Simple(v)) => {
                    Some(String::from_utf8_lossy(v).to_ascii_lowercase())
                }
                _ => None,
            },
            Frame::Map(pairs) => pairs.first().and_then(|(_, v)| match v {
                Frame::Bulk(v) | Frame::Simple(v) => {
                    Some(String::from_utf8_lossy(v).to_ascii_lowercase())
                }
                _ => None,
            }),
            _ => None,
        })
    }

    /// Checks that fence keys survive eviction and restarts here (see [`durability`]); with
    /// no enforce rule there are no fences to lose.
    pub async fn check_durability(&mut self, config: &RedisConfig) -> Result<(), RedisError> {
        if !config.enforces_any() {
            return Ok(());
        }
        let settings = Settings {
            maxmemory_policy: self.config_get("maxmemory-policy").await?,
            appendonly: self.config_get("appendonly").await?,
            appendfsync: self.config_get("appendfsync").await?,
        };
        let problems = durability::problems(&settings, config);
        if problems.is_empty() {
            return Ok(());
        }
        Err(RedisError::FencesAtRisk {
            upstream: config.upstream.clone(),
            problems: problems.join("; "),
        })
    }

    /// Why sharing upstream connections would put sessions at risk here, if it would: a limit
    /// on normal clients' output buffers, or `maxmemory-clients`, lets Redis close a
    /// connection for what one client left unread or asked for, and on a shared connection
    /// that ends every session on it. `None` when neither is set (or the server would not say:
    /// the risk is then to availability only, never to which reply goes where).
    pub async fn sharing_hazard(&mut self) -> Result<Option<String>, RedisError> {
        let mut hazards = Vec::new();
        if let Some(limits) = self.config_get("client-output-buffer-limit").await? {
            let words: Vec<&str> = limits.split_whitespace().collect();
            if let Some(i) = words.iter().position(|w| *w == "normal") {
                let normal = words.get(i + 1..i + 4).unwrap_or_default();
                if normal.iter().take(2).any(|limit| *limit != "0") {
                    hazards.push(format!(
                        "client-output-buffer-limit normal {}",
                        normal.join(" ")
                    ));
                }
            }
        }
        if let Some(limit) = self.config_get("maxmemory-clients").await? {
            if limit != "0" {
                hazards.push(format!("maxmemory-clients {limit}"));
            }
        }
        Ok((!hazards.is_empty()).then(|| hazards.join(", ")))
    }

    /// Learns the command table and loads the fence script.
    pub async fn learn(&mut self) -> Result<UpstreamInfo, RedisError> {
        let reply = self.request(&["COMMAND"]).await?;
        let table = CommandTable::from_reply(&reply)?;
        let mode = self.load_fence().await?;
        Ok(UpstreamInfo { table, mode })
    }
}
