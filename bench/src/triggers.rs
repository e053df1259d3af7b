//! What the store's enforcement triggers cost in throughput, per implementation of
//! `fencegate.enforce()`: the guarded write transaction sent directly (no gateway), 8 writers,
//! with the triggers off, plpgsql (fence.sql, the default) and C (`install --enforce c`, the
//! library built from filters/postgres/ext by the testkit), interleaved. The instruction counts,
//! which do not depend on the machine's load, come from bench/triggers-callgrind.sh.

use std::time::Duration;

use fencegate_testkit::enforce_library::enforce_library_conf;

use crate::load::median;
use crate::machine;
use crate::postgres::{
    install_enforce, pgbench, pgbench_init, protect, set_triggers, Workload, GUARDED_SCRIPT,
};
use crate::report::{Section, Table};
use crate::servers::{install_fence_sql, Postgres};

const WRITERS: usize = 8;
const MODES: [&str; 3] = ["off", "plpgsql", "c"];

/// Leaves the triggers off, or on with the named `fencegate.enforce()` installed.
fn set_mode(pg: &Postgres, mode: &str) -> anyhow::Result<()> {
    if mode == "off" {
        return set_triggers(pg, false);
    }
    install_enforce(pg, mode)?;
    set_triggers(pg, true)
}

pub async fn run(run: Duration, reps: usize) -> anyhow::Result<Section> {
    let dir = tempfile::Builder::new()
        .prefix("fencegate-bench-trg")
        .tempdir()?;
    let guarded = dir.path().join("guarded.sql");
    std::fs::write(&guarded, GUARDED_SCRIPT)?;
    let pg = Postgres::start_with_conf(100, &enforce_library_conf())?;
    pgbench_init(&pg)?;
    install_fence_sql(&pg)?;
    protect(&pg)?;
    pg.psql("VACUUM ANALYZE")?;
    let seconds = run.as_secs_f64().ceil().max(1.0) as u64;
    let mut tps: [Vec<f64>; 3] = Default::default();
    for rep in 0..reps {
        // The order turns with each repetition, so no mode always runs first or last.
        for k in 0..MODES.len() {
            let m = (k + rep) % MODES.len();
            set_mode(&pg, MODES[m])?;
            let r = pgbench(
                pg.port,
                Workload::Write,
                WRITERS,
                seconds,
                None,
                &guarded,
                None,
            )?;
            eprintln!(
                "triggers rep {rep}: {}, {WRITERS} writers: {:.0} tps",
                MODES[m], r.tps
            );
            tps[m].push(r.tps);
        }
    }
    let per_rep = |m: usize| {
        tps[m]
            .iter()
            .zip(&tps[0])
            .map(|(t, off)| format!("{:.2}", t / off))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let ratios = [per_rep(1), per_rep(2)];
    let medians: Vec<f64> = tps.iter_mut().map(|v| median(v)).collect();
    let rows = MODES
        .iter()
        .enumerate()
        .map(|(m, mode)| {
            vec![
                match *mode {
                    "off" => "triggers off".to_owned(),
                    "plpgsql" => "plpgsql `enforce()` (default)".to_owned(),
                    _ => "C `enforce()` (`install --enforce c`)".to_owned(),
                },
                format!("{:.0}", medians[m]),
                format!("{:.3}x", medians[m] / medians[0]),
                if m == 0 {
                    "-".to_owned()
                } else {
                    ratios[m - 1].clone()
                },
            ]
        })
        .collect();
    Ok(Section {
        name: "triggers".into(),
        title: "Store enforcement: the triggers' throughput, plpgsql against C".into(),
        setup: vec![
            format!("Machine: {}", machine::describe()),
            crate::postgres::versions()?,
            format!("PostgreSQL on loopback, fsync=on, synchronous_commit=on; `pgbench -i -s 1`, the pgbench tables protected for resource `bench`; each run `pgbench -n -M simple -c {WRITERS} -j 2 -T {seconds}` of the guarded write transaction sent directly (no gateway): `BEGIN; SELECT fencegate.guard('bench', 1) \\; UPDATE pgbench_accounts ...; SELECT abalance ...; INSERT INTO pgbench_history ...; END;` (2 protected statements)"),
            format!("{reps} repetitions; in each, the three modes one after another, the order turning with each repetition; medians. The mode is switched with `fencegate postgres install --enforce plpgsql|c` and `ALTER TABLE ... DISABLE|ENABLE ALWAYS TRIGGER`"),
        ],
        headers: [String::new(), String::new()],
        rows: Vec::new(),
        tables: vec![Table {
            headers: vec![
                format!("{WRITERS} writers, guarded write transaction"),
                "tps".into(),
                "vs triggers off".into(),
                "per repetition".into(),
            ],
            rows,
        }],
        notes: vec!["Target: the triggers cost under 5 % (>= 0.95x). Instructions per transaction, which do not depend on the machine's load: `bench/triggers-callgrind.sh` (section \"Store enforcement: the triggers' cost\").".into()],
    })
}
