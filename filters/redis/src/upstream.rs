//! Connecting to the upstream Redis: authentication, learning the command table, and loading
//! the fence script.

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::command_table::CommandTable;
use crate::config::{FenceModule, RedisConfig};
use crate::durability::{self, Settings};
use crate::error::RedisError;
use crate::frame::{self, Frame, Limits};
use crate::rewrite::{
    batch_function_source, batch_script_source, function_source, script_source, ScriptMode,
    MODULE_NAME, MODULE_VERSION,
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
    /// with `REPLACE`; a library of the same name holds the same code). Then, unless `config`
    /// says `fence_module = "off"`, calls go to fencegate's module where the server loaded it
    /// (the functions stay loaded: gateways that do not use the module may share the server).
    pub async fn load_fence(&mut self, config: &RedisConfig) -> Result<ScriptMode, RedisError> {
        let lua = self.load_lua().await?;
        if config.fence_module == FenceModule::Off {
            return Ok(lua);
        }
        match self.module_version().await? {
            Some(version) if version >= MODULE_VERSION => Ok(ScriptMode::Module),
            found if config.fence_module == FenceModule::Require => {
                let found = match found {
                    Some(v) => format!("version {v}, older than {MODULE_VERSION}"),
                    None => "not loaded (or MODULE LIST is not allowed to this user)".into(),
                };
                Err(RedisError::Upstream(format!(
                    "fence_module = \"require\", but fencegate's Redis module is {found}: load libfencegate_redis_module.so with `loadmodule` in redis.conf (docs/REDIS_MODULE.md), or set fence_module = \"auto\""
                )))
            }
            _ => Ok(lua),
        }
    }

    /// The version of fencegate's module in `MODULE LIST`, if loaded. A server that refuses the
    /// command (renamed away, or not allowed to this ACL user) has no module for us.
    async fn module_version(&mut self) -> Result<Option<i64>, RedisError> {
        let Frame::Array(modules) = self.request(&["MODULE", "LIST"]).await? else {
            return Ok(None);
        };
        Ok(modules.iter().find_map(|module| {
            // RESP2 (the control connection never says HELLO 3): name, value, name, value...
            let Frame::Array(fields) = module else {
                return None;
            };
            let field = |name: &str| {
                fields
                    .chunks(2)
                    .find(|kv| matches!(&kv[0], Frame::Bulk(k) | Frame::Simple(k) if k.eq_ignore_ascii_case(name.as_bytes())))
                    .and_then(|kv| kv.get(1))
            };
            let named = matches!(field("name"), Some(Frame::Bulk(n) | Frame::Simple(n)) if n.as_ref() == MODULE_NAME.as_bytes());
            match (named, field("ver")) {
                (true, Some(Frame::Integer(v))) => Some(*v),
                _ => None,
            }
        }))
    }

    async fn load_lua(&mut self) -> Result<ScriptMode, RedisError> {
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
    pub async fn learn(&mut self, config: &RedisConfig) -> Result<UpstreamInfo, RedisError> {
        let reply = self.request(&["COMMAND"]).await?;
        let table = CommandTable::from_reply(&reply)?;
        let mode = self.load_fence(config).await?;
        Ok(UpstreamInfo { table, mode })
    }
}
