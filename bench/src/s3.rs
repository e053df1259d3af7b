//! The S3 suite: signed PUTs to moto's S3 server directly against fenced PUTs through the
//! gateway in object mode (bucket `bench`) and manifest mode (bucket `ledger`), with 1 and 8
//! concurrent writers holding one token of one resource, and how many upstream requests each
//! fenced PUT costs, counted from moto's request log.

use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;

use crate::load::{closed_loop, median};
use crate::machine;
use crate::report::{Row, Section};
use crate::servers::{venv_python, Moto, Node, S3_ACCESS_KEY, S3_SECRET};
use crate::sigv4;

pub const TOKEN: &str = "fg1~1~bench";
const BODY: usize = 4096;

/// The node's `[s3]` section: bucket `bench` in object mode, `ledger` in manifest mode, both
/// for resource `bench`.
fn section(listen: u16, upstream: u16) -> String {
    format!(
        "[s3]\nlisten = \"127.0.0.1:{listen}\"\nupstream = \"http://127.0.0.1:{upstream}\"\nupstream_access_key = \"moto\"\n\
         upstream_secret_env = \"FENCEGATE_S3_UPSTREAM_SECRET\"\nclients_env = \"FENCEGATE_S3_CLIENTS\"\n\n\
         [[s3.protect]]\nbucket = \"bench\"\nmode = \"object\"\nresource = \"bench\"\n\n\
         [[s3.protect]]\nbucket = \"ledger\"\nmode = \"manifest\"\nresource = \"bench\"\n\n"
    )
}

/// A signed `PUT /bench/<key>` (or `PUT /bench` with no key) to `port`.
pub async fn put(
    http: &reqwest::Client,
    port: u16,
    key: Option<&str>,
    body: Vec<u8>,
    token: Option<&str>,
) -> anyhow::Result<()> {
    put_object(http, port, "bench", key, body, token).await
}

/// A signed `PUT /<bucket>/<key>` (or `PUT /<bucket>` with no key) to `port`.
pub async fn put_object(
    http: &reqwest::Client,
    port: u16,
    bucket: &str,
    key: Option<&str>,
    body: Vec<u8>,
    token: Option<&str>,
) -> anyhow::Result<()> {
    let host = format!("127.0.0.1:{port}");
    let path = match key {
        Some(key) => format!("/{bucket}/{key}"),
        None => format!("/{bucket}"),
    };
    let mut request = http.put(format!("http://{host}{path}")).body(body);
    for (name, value) in sigv4::sign("PUT", &host, &path, S3_ACCESS_KEY, S3_SECRET, "us-east-1") {
        request = request.header(name, value);
    }
    if let Some(token) = token {
        request = request.header("fencing-token", token);
    }
    let answer = request.send().await?;
    if !answer.status().is_success() {
        bail!(
            "PUT {path}: {} {}",
            answer.status(),
            answer.text().await.unwrap_or_default()
        );
    }
    Ok(())
}

struct Measured {
    puts_per_sec: f64,
    p50_us: u64,
    upstream_per_put: f64,
}

async fn measure(
    http: &reqwest::Client,
    moto: &Moto,
    (port, bucket): (u16, &'static str),
    clients: usize,
    token: Option<&'static str>,
    run: Duration,
    round: String,
) -> anyhow::Result<Measured> {
    let before = moto.requests_logged();
    let http = http.clone();
    let round: Arc<str> = round.into();
    let outcome = closed_loop(clients, run, move |worker, i| {
        let (http, round) = (http.clone(), round.clone());
        async move {
            let mut body = format!("{round} {worker} {i} ").into_bytes();
            body.resize(BODY, b'x');
            match put_object(
                &http,
                port,
                bucket,
                Some(&format!("obj-{worker}")),
                body,
                token,
            )
            .await
            {
                Ok(()) => true,
                Err(e) => {
                    eprintln!("{e}");
                    false
                }
            }
        }
    })
    .await;
    if outcome.errors > 0 {
        bail!("{} PUTs failed", outcome.errors);
    }
    // moto writes its log line after answering: give the last ones a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let puts = outcome.ops_per_sec * run.as_secs_f64();
    let upstream = moto.requests_logged() - before;
    Ok(Measured {
        puts_per_sec: outcome.ops_per_sec,
        p50_us: outcome.p50_us,
        upstream_per_put: upstream as f64 / puts.round().max(1.0),
    })
}

/// The gateway paths measured against direct PUTs.
const MODES: [(&str, &str); 2] = [("bench", "object mode"), ("ledger", "manifest mode")];

pub async fn run(run: Duration, reps: usize) -> anyhow::Result<Section> {
    let dir = tempfile::Builder::new()
        .prefix("fencegate-bench-s3")
        .tempdir()?;
    let moto = Moto::start(dir.path())?;
    let listen = crate::process::free_port();
    let node = Node::start(&section(listen, moto.port), &[listen])?;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()?;
    for (bucket, _) in MODES {
        put_object(&http, moto.port, bucket, None, Vec::new(), None).await?;
    }

    let cases: Vec<(usize, &str)> = vec![(1, "1 writer"), (8, "8 writers")];
    // [case][mode] -> (direct samples, gateway samples)
    let mut puts = vec![vec![(Vec::new(), Vec::new()); MODES.len()]; cases.len()];
    let mut p50 = vec![vec![(Vec::new(), Vec::new()); MODES.len()]; cases.len()];
    let mut per_put = vec![vec![(Vec::new(), Vec::new()); MODES.len()]; cases.len()];
    for rep in 0..reps {
        for (c, (clients, what)) in cases.iter().enumerate() {
            for (m, (bucket, mode)) in MODES.iter().enumerate() {
                let direct = measure(
                    &http,
                    &moto,
                    (moto.port, "bench"),
                    *clients,
                    None,
                    run,
                    format!("d{rep}"),
                )
                .await?;
                let gateway = measure(
                    &http,
                    &moto,
                    (listen, bucket),
                    *clients,
                    Some(TOKEN),
                    run,
                    format!("g{rep}"),
                )
                .await
                .map_err(|e| {
                    e.context(format!(
                        "through the gateway; its log:\n{}",
                        node.log_text()
                    ))
                })?;
                eprintln!(
                    "s3 rep {rep}: {what}, {mode}: direct {:.0} PUT/s ({:.2} upstream/PUT), gateway {:.0} PUT/s ({:.2} upstream/PUT)",
                    direct.puts_per_sec, direct.upstream_per_put, gateway.puts_per_sec, gateway.upstream_per_put
                );
                puts[c][m].0.push(direct.puts_per_sec);
                puts[c][m].1.push(gateway.puts_per_sec);
                p50[c][m].0.push(direct.p50_us as f64);
                p50[c][m].1.push(gateway.p50_us as f64);
                per_put[c][m].0.push(direct.upstream_per_put);
                per_put[c][m].1.push(gateway.upstream_per_put);
            }
        }
    }
    let mut rows = Vec::new();
    for (c, (_, what)) in cases.iter().enumerate() {
        for (m, (_, mode)) in MODES.iter().enumerate() {
            let (d, g) = (median(&mut puts[c][m].0), median(&mut puts[c][m].1));
            rows.push(Row::ratio(
                format!("PUT 4 KiB, {what}, {mode}: direct vs fenced, PUT/s"),
                d,
                g,
                "-",
            ));
        }
    }
    for (c, (clients, what)) in cases.iter().enumerate() {
        for (m, (_, mode)) in MODES.iter().enumerate() {
            let (d, g) = (median(&mut per_put[c][m].0), median(&mut per_put[c][m].1));
            let target = match (m, clients) {
                (0, _) => "-",
                (_, 1) => "<= 2.2",
                _ => "<= 1.3",
            };
            rows.push(Row {
                what: format!("upstream requests per client PUT, {what}, {mode}"),
                direct: format!("{d:.2}"),
                gateway: format!("{g:.2}"),
                ratio: None,
                target: target.into(),
            });
        }
    }
    for (m, (_, mode)) in MODES.iter().enumerate() {
        let (d, g) = (median(&mut p50[0][m].0), median(&mut p50[0][m].1));
        rows.push(Row::added(
            format!("p50 latency, PUT, 1 writer, {mode}, µs"),
            d,
            g,
            "-",
        ));
    }
    let moto_version = machine::version(&[
        &venv_python()?.display().to_string(),
        "-c",
        "import moto; print('moto', moto.__version__)",
    ]);
    Ok(Section {
        name: "s3".into(),
        title: "S3: moto direct against through the gateway".into(),
        setup: vec![
            format!("Machine: {}", machine::describe()),
            format!("{moto_version} (`moto.server`, Python, one process); fencegate {} ({})", env!("CARGO_PKG_VERSION"), machine::git_head()),
            "Client: SigV4 by the S3 filter's aws-sigv4 signer (`UNSIGNED-PAYLOAD`, header auth) over reqwest keep-alive connections, the same on both paths; the gateway verifies each signature and re-signs upstream".into(),
            format!("Each writer rewrites its own object (`obj-<n>`, 4 KiB, new bytes each time) for {:.0} s; all writers hold one token (`Fencing-Token: {TOKEN}`) of one resource; object mode: bucket `bench`; manifest mode: bucket `ledger`, all writers committing into one resource's commit log (one log entry per group commit, a checkpoint every 64 entries; `docs/S3_MANIFEST.md`)", run.as_secs_f64()),
            format!("{reps} repetitions, direct and gateway interleaved; medians. Upstream requests = lines in moto's request log during the run / PUTs completed"),
        ],
        headers: ["direct".into(), "gateway".into()],
        rows,
        tables: Vec::new(),
        notes: if cfg!(debug_assertions) {
            vec!["Debug build: PUT/s and latency are not comparable with release runs; upstream requests per PUT do not depend on the build.".into()]
        } else {
            Vec::new()
        },
    })
}
