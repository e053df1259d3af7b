//! The bound on the client connections one gateway holds open.
//!
//! Every connection holds file descriptors (PostgreSQL: two, the client's and the server's) in
//! the node's one process, beside the authority's Raft peers, its API and the audit log. Without
//! a bound, a client opening connections in a loop runs the node out of descriptors and takes
//! the lock service down with the gateway (DESIGN rule 10). Over the bound a client gets its
//! store's own "too many clients" answer, as PgBouncer (`max_client_conn`) and Redis
//! (`maxclients`) give, instead of a hang or a reset.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::task::TaskTracker;

use crate::SessionThreads;

/// Admits a listener's clients up to its bound (a gateway's `max_client_connections`, the
/// API's `max_api_connections`), and refuses the rest.
#[derive(Debug)]
pub struct ConnectionCap {
    max: usize,
    /// Clients refused since the cap was last reached; 0 while clients are admitted.
    refused: AtomicU64,
    /// Refused connections still being answered (bounded by [`ConnectionCap::REFUSING`]).
    refusing: TaskTracker,
}

/// What [`ConnectionCap::admit`] decided for one new client, with what the listener's log
/// needs: one line when the cap is reached and one when it is left, not one per client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Admitted, as the client before.
    Admitted,
    /// Admitted, the first since the cap was reached; `refused` clients were refused meanwhile.
    Reopened {
        /// Clients refused while the cap was reached.
        refused: u64,
    },
    /// Refused: the listener holds its bound. `first` when the client before was admitted.
    Refused {
        /// Whether this refusal is the first since the cap was reached.
        first: bool,
    },
}

impl ConnectionCap {
    /// Refused connections answered at once: past this, a refused connection is closed without
    /// its answer, so a flood of refused clients holds at most this many descriptors more.
    pub const REFUSING: usize = 64;

    /// The longest a refused connection is kept: time for its answer, and for the client to
    /// read it and close.
    pub const REFUSAL_TIME: Duration = Duration::from_secs(2);

    /// The largest bound a listener accepts in its config: past it the bound bounds nothing a
    /// process could hold (a million descriptors is the Linux default of `fs.nr_open`).
    pub const MOST: usize = 1_000_000;

    /// A cap of `max` client connections.
    pub fn new(max: usize) -> Self {
        Self {
            max,
            refused: AtomicU64::new(0),
            refusing: TaskTracker::new(),
        }
    }

    /// The most client connections admitted at once.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Admits a new client beside the `open` ones, or refuses it. `open` must not pass the
    /// bound: one accept loop per cap calls this and only that loop adds connections, or (the
    /// S3 listener, whose connections are admitted on tasks of their own) each caller counts
    /// itself in before it asks, so no two see the same count.
    pub fn admit(&self, open: usize) -> Admission {
        if open < self.max {
            match self.refused.swap(0, Ordering::Relaxed) {
                0 => Admission::Admitted,
                refused => Admission::Reopened { refused },
            }
        } else {
            let before = self.refused.fetch_add(1, Ordering::Relaxed);
            Admission::Refused { first: before == 0 }
        }
    }

    /// Whether a refusal may still be answered (fewer than [`Self::REFUSING`] in progress).
    fn has_room(&self) -> bool {
        self.refusing.len() < Self::REFUSING
    }

    /// Sends `answer` (the store's own refusal) to a client over the cap and closes the
    /// connection ([`ConnectionCap::answer_and_close`]), on a task of the caller's runtime
    /// bounded as [`ConnectionCap::refuse_on`] says. For answers that cost no more than a write.
    pub fn refuse(&self, socket: TcpStream, answer: Arc<[u8]>) {
        if !self.has_room() {
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
        if !self.has_room() {
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

    /// Runs `refusal` on the caller's own task, for a listener that hands each accepted
    /// connection to a task of its own (pingora's): counted with the other refusals, cut off
    /// after [`Self::REFUSAL_TIME`], and skipped (the connection closed unanswered) while
    /// [`Self::REFUSING`] are running.
    pub async fn refuse_here<F: Future<Output = ()>>(&self, refusal: F) {
        if !self.has_room() {
            return;
        }
        let _ = tokio::time::timeout(Self::REFUSAL_TIME, self.refusing.track_future(refusal)).await;
    }

    /// A whole `503 Service Unavailable` answer with `body` of `content_type`, `Retry-After: 1`
    /// and `Connection: close`: what an HTTP listener writes to a client over its bound.
    pub fn http_503(content_type: &str, body: &str) -> Arc<[u8]> {
        let head = format!(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
            body.len()
        );
        Arc::from((head + body).into_bytes())
    }

    /// Whether a failed accept only says that a client gave up while queued (its connection
    /// aborted or reset before it was accepted): nothing is short, unlike EMFILE, so the
    /// listener accepts again at once rather than backing off, and does not log it.
    pub fn client_gave_up(error: &std::io::Error) -> bool {
        matches!(
            error.kind(),
            std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset
        )
    }

    /// Idle time before the first TCP keepalive probe ([`ConnectionCap::keep_alive`]).
    pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
    /// Time between TCP keepalive probes.
    pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(15);
    /// Unanswered probes after which the connection is dropped.
    pub const KEEPALIVE_PROBES: u32 = 4;

    /// Turns TCP keepalive on for an accepted client: a client whose host vanished (no FIN, no
    /// reset: a VM killed, a partition) is found out within about two minutes and its slot
    /// given back, as Redis (`tcp-keepalive`) and PostgreSQL do for theirs.
    pub fn keep_alive(socket: &TcpStream) -> std::io::Result<()> {
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(Self::KEEPALIVE_IDLE)
            .with_interval(Self::KEEPALIVE_INTERVAL)
            .with_retries(Self::KEEPALIVE_PROBES);
        socket2::SockRef::from(socket).set_tcp_keepalive(&keepalive)
    }

    /// Writes `answer`, then reads (and drops) what the client sends until it closes: a client
    /// that sends before it reads (a PostgreSQL startup packet, a Redis command) would
    /// otherwise have its answer lost to the reset that a close with unread bytes sends.
    pub async fn answer_and_close<S>(mut socket: S, answer: Arc<[u8]>)
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
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
    fn admits_below_the_cap_only_and_says_when_it_is_reached_and_left() {
        let cap = ConnectionCap::new(2);
        assert_eq!(cap.admit(0), Admission::Admitted);
        assert_eq!(cap.admit(1), Admission::Admitted);
        assert_eq!(cap.admit(2), Admission::Refused { first: true });
        assert_eq!(cap.admit(2), Admission::Refused { first: false });
        assert_eq!(cap.admit(3), Admission::Refused { first: false });
        assert_eq!(cap.admit(1), Admission::Reopened { refused: 3 });
        assert_eq!(cap.admit(1), Admission::Admitted);
        assert_eq!(cap.admit(2), Admission::Refused { first: true });
        assert_eq!(cap.admit(0), Admission::Reopened { refused: 1 });
        assert_eq!(
            ConnectionCap::new(0).admit(0),
            Admission::Refused { first: true }
        );
    }

    #[test]
    fn a_client_that_gave_up_is_not_a_shortage() {
        use std::io::{Error, ErrorKind};
        assert!(ConnectionCap::client_gave_up(&Error::from(
            ErrorKind::ConnectionAborted
        )));
        assert!(ConnectionCap::client_gave_up(&Error::from_raw_os_error(
            104 // ECONNRESET
        )));
        assert!(!ConnectionCap::client_gave_up(&Error::from_raw_os_error(
            24 // EMFILE
        )));
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
