//! A fault-injecting TCP proxy for the links between cluster nodes: it listens on a free
//! loopback port, relays every connection to one upstream address, and applies to each
//! connection the fault set for the connection's source IP address (the link it belongs to:
//! nodes that send their peer traffic from their own loopback address can be told apart).
//!
//! Faults, per source address:
//! - [`LinkFault::Partition`]: the connections open now are closed; new ones are accepted and
//!   swallowed (nothing reaches upstream, nothing comes back), as a black hole does, until the
//!   link heals, when they are closed so the client reconnects.
//! - [`LinkFault::Delay`]: every chunk is held this long before it is passed on, both ways.
//! - [`LinkFault::Drop`]: every n-th chunk read on a connection is dropped and the connection
//!   cut both ways (TCP never loses bytes inside a stream: a stream that loses some is a
//!   stream that breaks).
//!
//! Bounded: at most [`MAX_CONNECTIONS`] relayed at once (more are closed at accept), one read
//! buffer and at most [`QUEUE`] delayed chunks per direction. Dropping the proxy stops it and
//! every connection it relays.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// Connections relayed at once; more are closed as they arrive.
pub const MAX_CONNECTIONS: usize = 256;
/// Chunks held per direction while a delay is applied.
pub const QUEUE: usize = 64;
const CHUNK: usize = 16 * 1024;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// What happens to one link's traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkFault {
    /// Bytes pass.
    Pass,
    /// No byte passes either way; see the module comment.
    Partition,
    /// Every chunk is held this long, each way.
    Delay(Duration),
    /// Every `every`-th chunk of a connection is dropped and the connection cut.
    Drop { every: u32 },
}

type Rules = HashMap<IpAddr, LinkFault>;

pub struct FaultProxy {
    addr: SocketAddr,
    rules: watch::Sender<Rules>,
    task: JoinHandle<()>,
}

impl FaultProxy {
    /// Starts a proxy on a free port of 127.0.0.1 relaying to `upstream`; every link passes.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (rules, watched) = watch::channel(Rules::new());
        let task = tokio::spawn(accept(listener, upstream, watched));
        Ok(Self { addr, rules, task })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Applies `fault` to connections from `from`, those open now included.
    pub fn set(&self, from: IpAddr, fault: LinkFault) {
        self.rules.send_modify(|rules| {
            if fault == LinkFault::Pass {
                rules.remove(&from);
            } else {
                rules.insert(from, fault);
            }
        });
    }

    /// Every link passes again.
    pub fn heal(&self) {
        self.rules.send_modify(|rules| rules.clear());
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // The accept task owns the connections' JoinSet: aborting it aborts them all.
        self.task.abort();
    }
}

fn fault_of(rules: &watch::Receiver<Rules>, from: IpAddr) -> LinkFault {
    rules
        .borrow()
        .get(&from)
        .copied()
        .unwrap_or(LinkFault::Pass)
}

async fn accept(listener: TcpListener, upstream: SocketAddr, rules: watch::Receiver<Rules>) {
    let mut connections = JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let Ok((client, peer)) = listener.accept().await else {
            // EMFILE and the like: a moment's pause rather than a busy loop.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        if connections.len() >= MAX_CONNECTIONS {
            continue;
        }
        connections.spawn(relay(client, peer.ip(), upstream, rules.clone()));
    }
}

async fn relay(
    client: TcpStream,
    from: IpAddr,
    upstream: SocketAddr,
    mut rules: watch::Receiver<Rules>,
) {
    if fault_of(&rules, from) == LinkFault::Partition {
        return swallow(client, from, rules).await;
    }
    let Ok(Ok(server)) = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(upstream)).await
    else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let (up_rules, down_rules) = (rules.clone(), rules.clone());
    let both = async {
        tokio::try_join!(
            pump(client_read, server_write, from, up_rules),
            pump(server_read, client_write, from, down_rules),
        )
    };
    // Returning drops both sockets: the connection is closed both ways.
    tokio::select! {
        _ = both => {}
        _ = rules.wait_for(|r| r.get(&from) == Some(&LinkFault::Partition)) => {}
    }
}

/// Accepts and discards what a client on a partitioned link sends, until it gives up or the
/// link heals.
async fn swallow(mut client: TcpStream, from: IpAddr, mut rules: watch::Receiver<Rules>) {
    let mut buf = [0u8; 4096];
    let drain = async {
        while let Ok(n) = client.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    };
    tokio::select! {
        _ = drain => {}
        _ = rules.wait_for(|r| r.get(&from) != Some(&LinkFault::Partition)) => {}
    }
}

/// One direction: reads chunks, applies the link's fault as each is read, writes them out
/// when due. Ends with the source's end of stream (passed on), or an error that cuts the
/// connection.
async fn pump(
    mut source: OwnedReadHalf,
    mut sink: OwnedWriteHalf,
    from: IpAddr,
    rules: watch::Receiver<Rules>,
) -> io::Result<()> {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(QUEUE);
    let read = async move {
        let mut buf = vec![0u8; CHUNK];
        let mut chunks = 0u64;
        loop {
            let n = source.read(&mut buf).await?;
            if n == 0 {
                return Ok(());
            }
            chunks += 1;
            let delay = match fault_of(&rules, from) {
                LinkFault::Delay(delay) => delay,
                LinkFault::Drop { every } if chunks % u64::from(every.max(1)) == 0 => {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "chunk dropped by the fault proxy",
                    ));
                }
                _ => Duration::ZERO,
            };
            if tx
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .await
                .is_err()
            {
                return Ok(());
            }
        }
    };
    let write = async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            sink.write_all(&bytes).await?;
        }
        sink.shutdown().await
    };
    tokio::try_join!(read, write).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpSocket;

    /// An upstream that echoes every connection.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = stream.into_split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn connect_from(source: &str, to: SocketAddr) -> TcpStream {
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
        socket.connect(to).await.unwrap()
    }

    /// Sends `ping` and reads the echo; `None` when the connection ends or nothing comes back
    /// within `within`.
    async fn round_trip(stream: &mut TcpStream, within: Duration) -> Option<Duration> {
        let started = Instant::now();
        stream.write_all(b"ping").await.ok()?;
        let mut buf = [0u8; 4];
        match tokio::time::timeout(within, stream.read_exact(&mut buf)).await {
            Ok(Ok(_)) if &buf == b"ping" => Some(started.elapsed()),
            _ => None,
        }
    }

    /// Waits until the proxy closes `stream` (end of stream or reset), at most `within`.
    async fn closed(stream: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 16];
        matches!(
            tokio::time::timeout(within, stream.read(&mut buf)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }

    #[tokio::test]
    async fn each_fault_hits_its_own_link_only() {
        let proxy = FaultProxy::start(echo().await).await.unwrap();
        let cut: IpAddr = "127.0.1.2".parse().unwrap();
        let second = Duration::from_secs(1);
        let mut other = connect_from("127.0.0.1", proxy.addr()).await;
        let mut link = connect_from("127.0.1.2", proxy.addr()).await;
        assert!(round_trip(&mut link, second).await.is_some());

        // Partition: the open connection is closed, a new one is swallowed, other links pass.
        proxy.set(cut, LinkFault::Partition);
        assert!(closed(&mut link, second).await, "open connection not cut");
        let mut swallowed = connect_from("127.0.1.2", proxy.addr()).await;
        assert_eq!(
            round_trip(&mut swallowed, Duration::from_millis(300)).await,
            None
        );
        assert!(round_trip(&mut other, second).await.is_some());

        // Healed: the swallowed connection is closed so the client reconnects, and a new one
        // passes.
        proxy.heal();
        assert!(
            closed(&mut swallowed, second).await,
            "swallowed connection kept"
        );
        let mut link = connect_from("127.0.1.2", proxy.addr()).await;
        assert!(round_trip(&mut link, second).await.is_some());

        // Delay: both ways, on open connections too; the other link stays fast.
        proxy.set(cut, LinkFault::Delay(Duration::from_millis(150)));
        let slow = round_trip(&mut link, second).await.expect("delayed echo");
        assert!(slow >= Duration::from_millis(300), "{slow:?}");
        let fast = round_trip(&mut other, second).await.expect("echo");
        assert!(fast < Duration::from_millis(150), "{fast:?}");

        // Drop every 2nd chunk: the first round trip passes, the second cuts the connection.
        proxy.set(cut, LinkFault::Drop { every: 2 });
        let mut lossy = connect_from("127.0.1.2", proxy.addr()).await;
        assert!(round_trip(&mut lossy, second).await.is_some());
        assert_eq!(round_trip(&mut lossy, second).await, None);
        assert!(closed(&mut lossy, second).await);
        assert!(round_trip(&mut other, second).await.is_some());
    }
}
