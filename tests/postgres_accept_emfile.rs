//! Issue 12, bypass 8: one EMFILE on accept used to end the PostgreSQL gateway's listener for
//! good while the process lived on (and /healthz said 200). In its own test binary: it lowers
//! the whole process's open-file limit for a moment, and captures the process's log.

mod support;

use std::io::Write;
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencegate_core::{MemoryAuditSink, TokenPolicy};
use fencegate_postgres::{Gateway, PostgresConfig};
use support::fd_limit::FdSqueeze;
use support::postgres_server::PgServer;

/// The log lines written so far, shared with the subscriber.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `SELECT 1` through the gateway on a new connection, within `within`.
async fn select_one(dsn: &str, within: Duration) -> Result<(), String> {
    let attempt = async {
        let (client, connection) = tokio_postgres::connect(dsn, tokio_postgres::NoTls)
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        let row = client
            .query_one("SELECT 1", &[])
            .await
            .map_err(|e| e.to_string())?;
        (row.get::<_, i32>(0) == 1)
            .then_some(())
            .ok_or_else(|| "wrong answer".to_owned())
    };
    tokio::time::timeout(within, attempt)
        .await
        .map_err(|_| format!("no answer within {within:?}"))?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_file_descriptors_does_not_stop_the_gateway() {
    let log = Captured::default();
    let writer = log.clone();
    tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();
    let pg = PgServer::start();
    let config = PostgresConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream: pg.addr().to_string(),
        resource: Some("job".into()),
        ..PostgresConfig::default()
    };
    let gateway = Gateway::new(
        config,
        TokenPolicy::unsigned(),
        Arc::new(MemoryAuditSink::default()),
    )
    .unwrap();
    let listener = gateway.bind().await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = tokio::spawn(gateway.serve(listener));
    let dsn = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        addr.port()
    );
    // Warm up: one session through the gateway works.
    select_one(&dsn, Duration::from_secs(10)).await.unwrap();

    // Leave room for a few descriptors and take them all with client sockets: the gateway's
    // accept() then fails with EMFILE (the clients wait in the listen backlog). A session the
    // gateway did accept fails upstream and frees its socket: that one is taken again.
    let squeeze = FdSqueeze::leave_room(4);
    let mut held = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !serving.is_finished()
        && !log
            .text()
            .contains("accepting a PostgreSQL client failed; retrying")
    {
        assert!(
            Instant::now() < deadline && held.len() < 256,
            "no failed accept was logged ({} client sockets held); the log:\n{}",
            held.len(),
            log.text()
        );
        if let Ok(c) = TcpStream::connect(addr) {
            held.push(c);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if serving.is_finished() {
        panic!("the listener stopped: {:?}", serving.await);
    }
    assert!(log.text().contains("Too many open files"), "{}", log.text());
    drop(held);
    drop(squeeze);

    // The listener lives on: a new client is served.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match select_one(&dsn, Duration::from_secs(2)).await {
            Ok(()) => break,
            Err(e) => assert!(
                Instant::now() < deadline,
                "the gateway stopped accepting after EMFILE: {e}; the log:\n{}",
                log.text()
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
