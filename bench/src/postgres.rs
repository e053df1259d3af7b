//! The PostgreSQL suite: pgbench against the server directly and through the gateway, durable
//! commits (fsync and synchronous_commit on).
//!
//! The write is pgbench's "simple update" transaction as a custom script (`BEGIN`; update an
//! account; read it back; insert a history row; `END`). Direct, it runs without a token;
//! through the gateway the same script runs with the token as a session setting in the startup
//! packet (`PGOPTIONS=-c fencegate.token=...`), so the gateway splices the guard in front of the
//! transaction's first write (one guard per transaction). Every writer holds the same token on
//! the same resource, i.e. they all take the same fence row `FOR SHARE`.
//!
//! The pgbench tables are protected by the store's triggers (`fencegate postgres protect`), as
//! a deployment would be; calibration pairs measure what the triggers cost: the fenced write
//! through the gateway and the guarded transaction sent directly, each with the triggers
//! disabled and enabled, interleaved.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};
use fencegate_testkit::enforce_library::enforce_library_conf;

use crate::load::{median, quantile};
use crate::machine;
use crate::process::fencegate_binary;
use crate::report::{Row, Section};
use crate::servers::{
    install_fence_sql, pg_bin, postgres_passthrough_section, postgres_section, Node, Postgres,
};

pub const TOKEN: &str = "fg1~1~bench";

pub const WRITE_SCRIPT: &str = "\\set aid random(1, 100000)
\\set bid random(1, 1)
\\set tid random(1, 10)
\\set delta random(-5000, 5000)
BEGIN;
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, :bid, :aid, :delta, CURRENT_TIMESTAMP);
END;
";

/// The write transaction pipelined (extended protocol; one Sync at `\endpipeline`): the
/// gateway sees every statement of the transaction before any reply, so it has to know
/// without the server's answers that one guard covers them all.
const PIPELINED_SCRIPT: &str = "\\set aid random(1, 100000)
\\set bid random(1, 1)
\\set tid random(1, 10)
\\set delta random(-5000, 5000)
\\startpipeline
BEGIN;
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, :bid, :aid, :delta, CURRENT_TIMESTAMP);
END;
\\endpipeline
";

/// The same transaction with the guard run directly, without the gateway, in the UPDATE's
/// round trip as the gateway sends it (`\;` makes one Query message of both statements): what
/// the fence costs the store itself.
pub(crate) const GUARDED_SCRIPT: &str = "\\set aid random(1, 100000)
\\set bid random(1, 1)
\\set tid random(1, 10)
\\set delta random(-5000, 5000)
BEGIN;
SELECT fencegate.guard('bench', 1) \\; UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, :bid, :aid, :delta, CURRENT_TIMESTAMP);
END;
";

/// Protects the pgbench tables with the store's triggers, bound to the bench token's resource.
pub(crate) fn protect(pg: &Postgres) -> anyhow::Result<()> {
    let out = Command::new(crate::process::fencegate_binary()?)
        .args(["postgres", "protect", "--dsn", &pg.dsn()])
        .args(["--schema", "public", "--resource", "bench"])
        .output()?;
    if !out.status.success() {
        bail!(
            "fencegate postgres protect failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Installs the named implementation of `fencegate.guard(text)` and `fencegate.enforce()`
/// (`plpgsql` or `c`), keeping the triggers as they are.
pub(crate) fn install_enforce(pg: &Postgres, mode: &str) -> anyhow::Result<()> {
    let out = Command::new(fencegate_binary()?)
        .args(["postgres", "install", "--dsn", &pg.dsn(), "--enforce", mode])
        .output()?;
    if !out.status.success() {
        bail!(
            "fencegate postgres install --enforce {mode} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Enables (always) or disables the enforcement triggers on the pgbench tables written.
pub(crate) fn set_triggers(pg: &Postgres, enabled: bool) -> anyhow::Result<()> {
    let how = if enabled { "ENABLE ALWAYS" } else { "DISABLE" };
    pg.psql(&format!(
        "ALTER TABLE pgbench_accounts {how} TRIGGER fencegate_enforce; \
         ALTER TABLE pgbench_history {how} TRIGGER fencegate_enforce"
    ))?;
    Ok(())
}

/// Throughputs of the guard run directly and of the fenced write through the gateway.
type TpsPair = (Vec<f64>, Vec<f64>);

#[derive(Clone, Copy)]
pub enum Workload {
    /// `pgbench -S`, simple query protocol.
    SelectOnly,
    /// `pgbench -S -M prepared`: extended protocol, statements prepared once per connection.
    SelectPrepared,
    /// The script given.
    Write,
    /// The script given, `-M extended` (its pipelines need the extended protocol).
    WriteExtended,
}

impl Workload {
    fn writes(self) -> bool {
        matches!(self, Self::Write | Self::WriteExtended)
    }
}

/// How many times the server ran the guard (`fencegate.guard_proc`, which the gateway calls, and
/// `fencegate.guard`, both signatures) so far, once every other session ended (a backend
/// reports its function counts when it exits; `track_functions` is `all`).
fn guard_calls(pg: &Postgres) -> anyhow::Result<u64> {
    let others = "SELECT count(*) FROM pg_stat_activity \
                  WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()";
    for _ in 0..100 {
        if pg.psql(others)? == "0" {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let calls = pg.psql(
        "SELECT coalesce(sum(calls), 0) FROM pg_stat_user_functions \
         WHERE schemaname = 'fencegate' AND funcname IN ('guard', 'guard_proc')",
    )?;
    calls
        .parse()
        .with_context(|| format!("guard calls: {calls:?}"))
}

pub struct Run {
    pub tps: f64,
    /// Transactions completed (pgbench's "number of transactions actually processed").
    pub transactions: u64,
    /// From the per-transaction log; 0 without one.
    pub p50_us: f64,
    pub p99_us: f64,
}

pub fn pgbench_path() -> String {
    if let Ok(bin) = pg_bin() {
        let p = bin.join("pgbench");
        if p.exists() {
            return p.display().to_string();
        }
    }
    "pgbench".into()
}

/// One pgbench run; with `log`, the per-transaction log gives the p50 latency.
#[allow(clippy::too_many_arguments)]
pub fn pgbench(
    port: u16,
    workload: Workload,
    clients: usize,
    seconds: u64,
    token: Option<&str>,
    script: &Path,
    log: Option<&Path>,
) -> anyhow::Result<Run> {
    let mut command = Command::new(pgbench_path());
    command
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
        .args(["-n", "-c", &clients.to_string()])
        .args([
            "-j",
            &clients.min(2).to_string(),
            "-T",
            &seconds.to_string(),
        ]);
    match workload {
        Workload::SelectOnly => command.args(["-M", "simple", "-S"]),
        Workload::SelectPrepared => command.args(["-M", "prepared", "-S"]),
        Workload::Write => command.args(["-M", "simple", "-f"]).arg(script),
        Workload::WriteExtended => command.args(["-M", "extended", "-f"]).arg(script),
    };
    if let Some(dir) = log {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir)?;
        command
            .arg("-l")
            .arg(format!("--log-prefix={}", dir.join("pgb").display()));
    }
    if let Some(token) = token {
        command.env("PGOPTIONS", format!("-c fencegate.token={token}"));
    }
    let out = command
        .arg("postgres")
        .output()
        .context("running pgbench")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "pgbench failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let tps = stdout
        .lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no tps in pgbench's output:\n{stdout}"))?;
    let transactions = stdout
        .lines()
        .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
        .and_then(|l| l.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no transaction count in pgbench's output:\n{stdout}"))?;
    let (p50_us, p99_us) = match log {
        Some(dir) => {
            let mut latencies = Vec::new();
            for entry in std::fs::read_dir(dir)? {
                let text = std::fs::read_to_string(entry?.path())?;
                latencies.extend(
                    text.lines()
                        .filter_map(|l| l.split_whitespace().nth(2))
                        .filter_map(|v| v.parse::<f64>().ok()),
                );
            }
            if latencies.is_empty() {
                bail!("pgbench wrote no transaction log");
            }
            (median(&mut latencies), quantile(&latencies, 0.99))
        }
        None => (0.0, 0.0),
    };
    Ok(Run {
        tps,
        transactions,
        p50_us,
        p99_us,
    })
}

/// `pgbench -i -s 1` directly on `pg`: the tables every pgbench run reads and writes.
pub fn pgbench_init(pg: &Postgres) -> anyhow::Result<()> {
    let init = Command::new(pgbench_path())
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &pg.port.to_string(),
            "-U",
            "postgres",
        ])
        .args(["-i", "-s", "1", "-q", "postgres"])
        .output()?;
    if !init.status.success() {
        bail!(
            "pgbench -i failed: {}",
            String::from_utf8_lossy(&init.stderr)
        );
    }
    Ok(())
}

pub async fn run(run: Duration, reps: usize) -> anyhow::Result<Section> {
    let dir = tempfile::Builder::new()
        .prefix("fencegate-bench-pgb")
        .tempdir()?;
    let script = dir.path().join("write.sql");
    std::fs::write(&script, WRITE_SCRIPT)?;
    let guarded = dir.path().join("guarded.sql");
    std::fs::write(&guarded, GUARDED_SCRIPT)?;
    let pipelined = dir.path().join("pipelined.sql");
    std::fs::write(&pipelined, PIPELINED_SCRIPT)?;
    // Loads the C guard and enforce() for the rows that install them.
    let pg = Postgres::start_with_conf(100, &enforce_library_conf())?;
    pgbench_init(&pg)?;
    install_fence_sql(&pg)?;
    protect(&pg)?;
    pg.psql("VACUUM ANALYZE")?;
    // Counts the guard calls (guards per fenced transaction).
    pg.psql("ALTER SYSTEM SET track_functions = 'all'")?;
    pg.psql("SELECT pg_reload_conf()")?;
    let listen = crate::process::free_port();
    let section = postgres_section(listen, pg.port);
    let node = Node::start(&section, &[listen])?;
    // The hop alone: a second node whose gateway protects no database, for the plain write.
    let hop_listen = crate::process::free_port();
    let hop = Node::start(
        &postgres_passthrough_section(hop_listen, pg.port),
        &[hop_listen],
    )?;
    let seconds = run.as_secs_f64().ceil().max(1.0) as u64;

    // (workload, clients, label, target, the guard and enforce() installed for the run through
    // the gateway)
    let cases: Vec<(Workload, usize, &str, &str, &str)> = vec![
        (
            Workload::SelectOnly,
            8,
            "`pgbench -S`, 8 clients, tps",
            ">= 0.85x",
            "plpgsql",
        ),
        (
            Workload::Write,
            1,
            "write transaction, 1 client: plain direct vs fenced, tps",
            ">= 0.85x",
            "plpgsql",
        ),
        (
            Workload::Write,
            8,
            "8 writers, same token, same resource: plain direct vs fenced, tps",
            ">= 0.75x",
            "plpgsql",
        ),
        (Workload::SelectOnly, 1, "`pgbench -S`, 1 client, tps", "-", "plpgsql"),
        (
            Workload::WriteExtended,
            8,
            "8 writers, pipelined write transaction (`-M extended`, `\\startpipeline`): plain direct vs fenced, tps",
            ">= 0.75x",
            "plpgsql",
        ),
        (
            Workload::Write,
            1,
            "write transaction, 1 client, guard and `enforce()` in C: plain direct vs fenced, tps",
            ">= 0.85x",
            "c",
        ),
        (
            Workload::Write,
            8,
            "8 writers, same resource, guard and `enforce()` in C: plain direct vs fenced, tps",
            ">= 0.75x",
            "c",
        ),
    ];
    // Per write case: guard calls and transactions through the gateway.
    let mut guards = vec![(0u64, 0u64); cases.len()];
    let mut tps = vec![(Vec::new(), Vec::new()); cases.len()];
    let mut p50 = vec![(Vec::new(), Vec::new()); cases.len()];
    let mut guard_direct = [Vec::new(), Vec::new()];
    // The plain write through the pass-through node, at 1 and 8 clients.
    let mut plain_hop = [Vec::new(), Vec::new()];
    // For 1 and 8 clients: (triggers disabled, enabled), each (guard run directly, fenced
    // through the gateway).
    let mut triggers: [(TpsPair, TpsPair); 2] = Default::default();
    let mut installed = "plpgsql";
    for rep in 0..reps {
        for (c, (workload, clients, what, _, enforce)) in cases.iter().enumerate() {
            let log = (*clients == 1).then(|| dir.path().join("log"));
            let write = workload.writes();
            let script = match workload {
                Workload::WriteExtended => &pipelined,
                _ => &script,
            };
            // The plain baseline writes without a token: only with the triggers off.
            if write {
                set_triggers(&pg, false)?;
            }
            let direct = pgbench(
                pg.port,
                *workload,
                *clients,
                seconds,
                None,
                script,
                log.as_deref(),
            )?;
            if write {
                set_triggers(&pg, true)?;
            }
            if *enforce != installed {
                install_enforce(&pg, enforce)?;
                installed = enforce;
            }
            let token = write.then_some(TOKEN);
            let calls = if write { guard_calls(&pg)? } else { 0 };
            let gateway = pgbench(
                listen,
                *workload,
                *clients,
                seconds,
                token,
                script,
                log.as_deref(),
            )
            .with_context(|| format!("through the gateway; its log:\n{}", node.log_text()))?;
            if write {
                guards[c].0 += guard_calls(&pg)? - calls;
                guards[c].1 += gateway.transactions;
            }
            eprintln!(
                "postgres rep {rep}: {what}: direct {:.0} tps (p50 {:.0} µs), gateway {:.0} tps (p50 {:.0} µs)",
                direct.tps, direct.p50_us, gateway.tps, gateway.p50_us
            );
            tps[c].0.push(direct.tps);
            tps[c].1.push(gateway.tps);
            p50[c].0.push(direct.p50_us);
            p50[c].1.push(gateway.p50_us);
        }
        // The calibrations below are of fence.sql's plpgsql functions.
        if installed != "plpgsql" {
            install_enforce(&pg, "plpgsql")?;
            installed = "plpgsql";
        }
        // Calibration, direct only: the guard run by the store itself, no gateway.
        for (i, clients) in [1usize, 8].into_iter().enumerate() {
            let run = pgbench(
                pg.port,
                Workload::Write,
                clients,
                seconds,
                None,
                &guarded,
                None,
            )?;
            eprintln!(
                "postgres rep {rep}: guard run directly, {clients} clients: {:.0} tps",
                run.tps
            );
            guard_direct[i].push(run.tps);
        }
        // The hop alone: the plain write (no token, the triggers off) through the node that
        // protects no database, to tell the hop's cost from the fence's in one run.
        set_triggers(&pg, false)?;
        for (i, clients) in [1usize, 8].into_iter().enumerate() {
            let run = pgbench(
                hop_listen,
                Workload::Write,
                clients,
                seconds,
                None,
                &script,
                None,
            )
            .with_context(|| {
                format!(
                    "through the pass-through node; its log:\n{}",
                    hop.log_text()
                )
            })?;
            eprintln!(
                "postgres rep {rep}: plain write through the pass-through node, {clients} clients: {:.0} tps",
                run.tps
            );
            plain_hop[i].push(run.tps);
        }
        set_triggers(&pg, true)?;
        // What the store's triggers cost: the same guarded transaction sent directly, and the
        // fenced write through the gateway, each with the triggers off then on.
        for (i, clients) in [1usize, 8].into_iter().enumerate() {
            for enabled in [false, true] {
                set_triggers(&pg, enabled)?;
                let run = pgbench(
                    pg.port,
                    Workload::Write,
                    clients,
                    seconds,
                    None,
                    &guarded,
                    None,
                )?;
                let fenced = pgbench(
                    listen,
                    Workload::Write,
                    clients,
                    seconds,
                    Some(TOKEN),
                    &script,
                    None,
                )
                .with_context(|| format!("through the gateway; its log:\n{}", node.log_text()))?;
                let state = if enabled { "on" } else { "off" };
                eprintln!(
                    "postgres rep {rep}: triggers {state}, {clients} clients: guard run directly {:.0} tps, fenced through the gateway {:.0} tps",
                    run.tps, fenced.tps
                );
                let pair = if enabled {
                    &mut triggers[i].1
                } else {
                    &mut triggers[i].0
                };
                pair.0.push(run.tps);
                pair.1.push(fenced.tps);
            }
        }
    }
    let applied = pg
        .psql("SELECT coalesce(max(revision), 0) FROM fencegate.fences WHERE resource = 'bench'")?;
    let (guard_1, guard_8) = (median(&mut guard_direct[0]), median(&mut guard_direct[1]));
    let trigger_note = {
        let mut m = |i: usize, on: bool, gateway: bool| {
            let pair = if on {
                &mut triggers[i].1
            } else {
                &mut triggers[i].0
            };
            median(if gateway { &mut pair.1 } else { &mut pair.0 })
        };
        let (d_off_1, d_on_1, d_off_8, d_on_8) = (
            m(0, false, false),
            m(0, true, false),
            m(1, false, false),
            m(1, true, false),
        );
        let (g_off_1, g_on_1, g_off_8, g_on_8) = (
            m(0, false, true),
            m(0, true, true),
            m(1, false, true),
            m(1, true, true),
        );
        format!(
            "Store enforcement (triggers on `pgbench_accounts` and `pgbench_history`, each statement checks the guard's pass), triggers disabled vs enabled, interleaved, medians: the fenced write through the gateway {g_off_1:.0} vs {g_on_1:.0} tps at 1 client ({:.3}x), {g_off_8:.0} vs {g_on_8:.0} tps with 8 writers ({:.3}x); the guarded write transaction sent directly {d_off_1:.0} vs {d_on_1:.0} tps at 1 client ({:.3}x), {d_off_8:.0} vs {d_on_8:.0} tps with 8 writers ({:.3}x); target: the triggers cost under 5 % (>= 0.95x).",
            g_on_1 / g_off_1,
            g_on_8 / g_off_8,
            d_on_1 / d_off_1,
            d_on_8 / d_off_8
        )
    };
    let guard_note = format!(
        "Guards per fenced transaction through the gateway (`fencegate.guard_proc` and `fencegate.guard` calls counted by the server, `track_functions = all`, over transactions completed): {}.",
        cases
            .iter()
            .zip(&guards)
            .filter(|((w, ..), _)| w.writes())
            .map(|((workload, clients, _, _, enforce), (calls, txs))| {
                let kind = match (workload, *enforce) {
                    (Workload::WriteExtended, _) => "pipelined write",
                    (_, "c") => "write, guard in C",
                    _ => "write",
                };
                format!(
                    "{kind}, {clients} client(s) {:.2} ({calls} / {txs})",
                    *calls as f64 / (*txs).max(1) as f64
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    );
    let (plain_1, plain_8) = (median(&mut tps[1].0), median(&mut tps[2].0));
    let (hop_1, hop_8) = (median(&mut plain_hop[0]), median(&mut plain_hop[1]));
    let hop_note = format!(
        "The hop alone: the same plain write transaction through a second fencegate node whose gateway protects no database (same server, the triggers off, no token), interleaved with the rows above, medians: {hop_1:.0} tps at 1 client, {hop_8:.0} with 8 writers ({:.2}x and {:.2}x of plain direct). Against it, the fenced write through the gateway reaches {:.2}x and {:.2}x (plpgsql), {:.2}x and {:.2}x (guard and `enforce()` in C): what the fence itself costs a write that crosses the hop anyway.",
        hop_1 / plain_1,
        hop_8 / plain_8,
        median(&mut tps[1].1) / hop_1,
        median(&mut tps[2].1) / hop_8,
        median(&mut tps[5].1) / hop_1,
        median(&mut tps[6].1) / hop_8,
    );
    let mut rows: Vec<Row> = cases
        .iter()
        .zip(tps.iter_mut())
        .map(|((_, _, what, target, _), (d, g))| Row::ratio(*what, median(d), median(g), target))
        .collect();
    for (c, label) in [
        (1usize, "write transaction"),
        (5, "write transaction, guard and `enforce()` in C"),
        (3, "`pgbench -S`"),
    ] {
        let (d, g) = (median(&mut p50[c].0), median(&mut p50[c].1));
        rows.push(Row::added(
            format!("p50 latency, {label}, 1 client, µs"),
            d,
            g,
            "-",
        ));
    }
    Ok(Section {
        name: "postgres".into(),
        title: "PostgreSQL: pgbench direct against through the gateway".into(),
        setup: vec![
            format!("Machine: {}", machine::describe()),
            versions()?,
            format!("PostgreSQL on loopback, data in {}, fsync=on, synchronous_commit=on (durable commits); `pgbench -i -s 1`; every pgbench run is `-n -M simple -T {seconds}` with `-j` = min(clients, 2); the gateway protects every database, and the store's triggers protect the pgbench tables (`fencegate postgres protect --schema public --resource bench`; disabled only for the plain direct write baseline); `fencegate.guard(text)` and `fencegate.enforce()` are fence.sql's plpgsql ones except in the rows that say C (`fencegate postgres install --enforce c`, the library of filters/postgres/ext, switched before the gateway's run of the row)", std::env::temp_dir().display()),
            format!("{reps} repetitions, direct and gateway interleaved; medians. Latency rows: median of pgbench's per-transaction log (`-l`), gateway cell = p50 (+ added µs)"),
            format!("Write transaction (pgbench's simple-update, as a `-f` script): `BEGIN; UPDATE pgbench_accounts ...; SELECT abalance ...; INSERT INTO pgbench_history ...; END;`. Direct: no token. Gateway: `PGOPTIONS=\"-c fencegate.token={TOKEN}\"` (session token; the guard runs before the UPDATE in the same Query message, the INSERT is covered by it). All writers share the token and resource `bench` (fence row taken `FOR SHARE`); fence after the run: {applied}"),
        ],
        headers: ["direct".into(), "gateway".into()],
        rows,
        tables: Vec::new(),
        notes: vec![hop_note, trigger_note, guard_note, format!(
            "Calibration, direct only: the same write transaction with `SELECT fencegate.guard('bench', 1)` sent by the client itself in the UPDATE's Query message (no gateway; what the fence costs the store): {:.0} tps at 1 client, {:.0} tps with 8 writers ({:.2}x and {:.2}x of the plain write's medians above).",
            guard_1, guard_8, guard_1 / plain_1, guard_8 / plain_8
        )],
    })
}

/// The setup line naming PostgreSQL's, pgbench's and fencegate's versions.
pub fn versions() -> anyhow::Result<String> {
    Ok(format!(
        "{}; {}; fencegate {} ({})",
        machine::version(&[
            &pg_bin()?.join("postgres").display().to_string(),
            "--version"
        ]),
        machine::version(&[&pgbench_path(), "--version"]),
        env!("CARGO_PKG_VERSION"),
        machine::git_head()
    ))
}
