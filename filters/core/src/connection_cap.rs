//! The bound on the client connections one gateway holds open.
//!
//! Every connection holds file descriptors (PostgreSQL: two, the client's and the server's) in
//! the node's one process, beside the authority's Raft peers, its API and the audit log. Without
//! a bound, a client opening connections in a loop runs the node out of descriptors and takes
//! the lock service down with the gateway (DESIGN rule 10). Over the bound a client gets its
//! store's own "too many clients" answer, as PgBouncer (`max_client_conn`) and Redis
//! (`maxclients`) give, instead of a hang or a reset.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::task::TaskTracker;

use crate::SessionThreads;

/// Admits a gateway's clients up to its `max_client_connections`, and refuses the rest.
#[derive(Debug)]
pub struct ConnectionCap {
    max: usize,
    /// Refused connections still being answered (bounded by [`ConnectionCap::REFUSING`]).
    refusing: TaskTracker,
}

impl ConnectionCap {
    /// Refused connections answered at once: past this, a refused connection is closed without
    /// its answer, so a flood of refused clients holds at most this many descriptors more.
    pub const REFUSING: usize = 64;

    /// The longest a refused connection is kept: time for its answer, and for the client to
    /// read it and close.
    pub const REFUSAL_TIME: Duration = Duration::from_secs(2);

    /// A cap of `max` client connections.
    pub fn new(max: usize) -> Self {
        Self {
            max,
            refusing: TaskTracker::new(),
        }
    }

    /// The most client connections admitted at once.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Whether a new client may be admitted beside the `open` ones.
    pub fn admits(&self, open: usize) -> bool {
        open < self.max
    }

    /// Sends `answer` (the store's own refusal) to a client over the cap and closes the
    /// connection ([`ConnectionCap::answer_and_close`]), on a task of the caller's runtime
    /// bounded as [`ConnectionCap::refuse_on`] says. For answers that cost no more than a write.
    pub fn refuse(&self, socket: TcpStream, answer: Arc<[u8]>) {
        if self.refusing.len() >= Self::REFUSING {
            return;
        }
        self.refusing.spawn(async move {
            let _ =
                tokio::time::timeout(Self::REFUSAL_TIME, Self::answer_and_close(socket, answer))
                    .await;
        });
    }

    /// Runs `refusal` on the refused client's connection, on one of the gateway's session
    /// `threads` (a refusal may cost a TLS handshake: not on the runtime the authority runs
    /// on), cut off after [`Self::REFUSAL_TIME`]. With [`Self::REFUSING`] refusals running, the
    /// connection is closed at once instead, unanswered.
    pub fn refuse_on<F, R>(&self, threads: &SessionThreads, socket: TcpStream, refusal: F)
    where
        F: FnOnce(TcpStream) -> R + Send + 'static,
        R: Future<Output = ()> + Send + 'static,
    {
        if self.refusing.len() >= Self::REFUSING {
            return;
        }
        // The socket leaves this runtime's reactor and joins the thread's.
        let Ok(socket) = socket.into_std() else {
            return;
        };
        threads.spawn(&self.refusing, async move {
            if let Ok(socket) = TcpStream::from_std(socket) {
                let _ = tokio::time::timeout(Self::REFUSAL_TIME, refusal(socket)).await;
            }
        });
    }

    /// Turns TCP keepalive on for an accepted client: a client whose host vanished (no FIN, no
    /// reset: a VM killed, a partition) is found out within about two minutes and its slot
    /// given back, as Redis (`tcp-keepalive`) and PostgreSQL do for theirs.
    pub fn keep_alive(socket: &TcpStream) -> std::io::Result<()> {
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(60))
            .with_interval(Duration::from_secs(15))
            .with_retries(4);
        socket2::SockRef::from(socket).set_tcp_keepalive(&keepalive)
    }

    /// Writes `answer`, then reads (and drops) what the client sends until it closes: a client
    /// that sends before it reads (a PostgreSQL startup packet, a Redis command) would
    /// otherwise have its answer lost to the reset that a close with unread bytes sends.
    pub async fn answer_and_close(mut socket: TcpStream, answer: Arc<[u8]>) {
        let answered = async {
            socket.write_all(&answer).await?;
            socket.shutdown().await?;
            let mut sink = [0u8; 1024];
            while socket.read(&mut sink).await? > 0 {}
            Ok::<(), std::io::Error>(())
        };
        let _ = answered.await;
    }
}

#[cfg(test)]
mod tests {
    use tokio::net::TcpListener;

    use super::*;

    #[test]
    fn admits_below_the_cap_only() {
        let cap = ConnectionCap::new(2);
        assert!(cap.admits(0));
        assert!(cap.admits(1));
        assert!(!cap.admits(2));
        assert!(!cap.admits(3));
        assert!(!ConnectionCap::new(0).admits(0));
    }

    #[tokio::test]
    async fn accepted_clients_get_tcp_keepalive() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = listener.local_addr().expect("its address");
        let _client = TcpStream::connect(addr).await.expect("connected");
        let (socket, _) = listener.accept().await.expect("accepted");
        ConnectionCap::keep_alive(&socket).expect("set");
        let sock = socket2::SockRef::from(&socket);
        assert!(sock.keepalive().expect("SO_KEEPALIVE"));
        assert_eq!(
            sock.tcp_keepalive_time().expect("TCP_KEEPIDLE"),
            Duration::from_secs(60)
        );
        assert_eq!(
            sock.tcp_keepalive_interval().expect("TCP_KEEPINTVL"),
            Duration::from_secs(15)
        );
        assert_eq!(sock.tcp_keepalive_retries().expect("TCP_KEEPCNT"), 4);
    }

    /// A refused client that writes before it reads still gets its answer, then end of stream.
    #[tokio::test]
    async fn a_refused_client_reads_its_answer_even_after_writing() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = listener.local_addr().expect("its address");
        let cap = ConnectionCap::new(0);
        let client = tokio::spawn(async move {
            let mut client = TcpStream::connect(addr).await.expect("connected");
            client.write_all(&[7u8; 4096]).await.expect("sent");
            let mut answer = Vec::new();
            client.read_to_end(&mut answer).await.expect("read");
            answer
        });
        let (socket, _) = listener.accept().await.expect("accepted");
        cap.refuse(socket, Arc::from(&b"-ERR full\r\n"[..]));
        let answer = tokio::time::timeout(Duration::from_secs(10), client)
            .await
            .expect("answered within 10 s")
            .expect("the client task");
        assert_eq!(answer, b"-ERR full\r\n");
        cap.refusing.close();
        tokio::time::timeout(Duration::from_secs(10), cap.refusing.wait())
            .await
            .expect("the refusal ends once the client closed");
    }

    /// Past `REFUSING` answers in progress, a refused connection is closed at once.
    #[tokio::test]
    async fn refusals_in_progress_are_bounded() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = listener.local_addr().expect("its address");
        let cap = ConnectionCap::new(0);
        // Clients that never close keep their refusals lingering.
        let mut clients = Vec::new();
        for _ in 0..ConnectionCap::REFUSING {
            clients.push(TcpStream::connect(addr).await.expect("connected"));
            let (socket, _) = listener.accept().await.expect("accepted");
            cap.refuse(socket, Arc::from(&b"x"[..]));
        }
        assert_eq!(cap.refusing.len(), ConnectionCap::REFUSING);
        let mut last = TcpStream::connect(addr).await.expect("connected");
        let (socket, _) = listener.accept().await.expect("accepted");
        cap.refuse(socket, Arc::from(&b"x"[..]));
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), last.read_to_end(&mut answer))
            .await
            .expect("closed within 10 s")
            .expect("a clean close");
        assert!(answer.is_empty(), "closed without an answer");
        assert_eq!(cap.refusing.len(), ConnectionCap::REFUSING);
        drop(clients);
    }
}
