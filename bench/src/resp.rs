//! A minimal RESP client for the Redis load generator: one connection, commands written as
//! arrays of bulk strings, replies read whole (any type) and reported as ok or error.

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub struct Connection {
    stream: TcpStream,
    buf: Vec<u8>,
    start: usize,
}

/// One reply: `Err` holds an error reply's text.
pub type Reply = Result<(), String>;

impl Connection {
    pub async fn connect(port: u16) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(("127.0.0.1", port))
            .await
            .with_context(|| format!("connecting to 127.0.0.1:{port}"))?;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream,
            buf: Vec::with_capacity(16 * 1024),
            start: 0,
        })
    }

    /// Writes already encoded commands with one write.
    pub async fn send(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        self.stream.write_all(bytes).await?;
        Ok(())
    }

    /// Reads the next reply.
    pub async fn reply(&mut self) -> anyhow::Result<Reply> {
        loop {
            if let Some((used, reply)) = parse(&self.buf[self.start..])? {
                self.start += used;
                if self.start == self.buf.len() {
                    self.buf.clear();
                    self.start = 0;
                }
                return Ok(reply);
            }
            if self.start > 0 {
                self.buf.drain(..self.start);
                self.start = 0;
            }
            let mut chunk = [0u8; 16 * 1024];
            let n = self.stream.read(&mut chunk).await?;
            if n == 0 {
                bail!("the server closed the connection");
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Sends one command and expects a non-error reply.
    pub async fn call(&mut self, args: &[&[u8]]) -> anyhow::Result<()> {
        self.send(&encode(args)).await?;
        match self.reply().await? {
            Ok(()) => Ok(()),
            Err(e) => bail!("{}: {e}", String::from_utf8_lossy(args[0])),
        }
    }
}

/// `args` as a RESP array of bulk strings.
pub fn encode(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

fn line(buf: &[u8]) -> Option<(&[u8], usize)> {
    let end = buf.windows(2).position(|w| w == b"\r\n")?;
    Some((&buf[..end], end + 2))
}

/// One complete reply at the start of `buf`: bytes used and the reply, or `None` if incomplete.
fn parse(buf: &[u8]) -> anyhow::Result<Option<(usize, Reply)>> {
    let Some(&kind) = buf.first() else {
        return Ok(None);
    };
    let Some((head, mut used)) = line(&buf[1..]) else {
        return Ok(None);
    };
    used += 1;
    let number = || -> anyhow::Result<i64> { Ok(std::str::from_utf8(head)?.parse::<i64>()?) };
    match kind {
        b'+' | b':' | b'_' | b',' | b'#' | b'(' => Ok(Some((used, Ok(())))),
        b'-' => Ok(Some((
            used,
            Err(String::from_utf8_lossy(head).into_owned()),
        ))),
        b'$' | b'=' | b'!' => {
            let n = number()?;
            if n < 0 {
                return Ok(Some((used, Ok(()))));
            }
            let total = used + n as usize + 2;
            if buf.len() < total {
                return Ok(None);
            }
            let reply = if kind == b'!' {
                Err(String::from_utf8_lossy(&buf[used..total - 2]).into_owned())
            } else {
                Ok(())
            };
            Ok(Some((total, reply)))
        }
        b'*' | b'~' | b'>' | b'%' | b'|' => {
            let n = number()?;
            let items = if kind == b'%' || kind == b'|' {
                n * 2
            } else {
                n
            };
            for _ in 0..items.max(0) {
                match parse(&buf[used..])? {
                    Some((u, _)) => used += u,
                    None => return Ok(None),
                }
            }
            Ok(Some((used, Ok(()))))
        }
        other => bail!("unexpected RESP type byte {other:#x}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_whole_replies_only() {
        assert_eq!(parse(b"+OK\r\n").unwrap(), Some((5, Ok(()))));
        assert_eq!(parse(b"+OK\r").unwrap(), None);
        assert_eq!(
            parse(b"-NOFENCE x\r\n").unwrap(),
            Some((12, Err("NOFENCE x".into())))
        );
        assert_eq!(parse(b"$3\r\nabc\r\n").unwrap(), Some((9, Ok(()))));
        assert_eq!(parse(b"$3\r\nab").unwrap(), None);
        assert_eq!(
            parse(b"*2\r\n$1\r\na\r\n:1\r\n").unwrap(),
            Some((15, Ok(())))
        );
        assert_eq!(parse(b"$-1\r\n").unwrap(), Some((5, Ok(()))));
    }
}
