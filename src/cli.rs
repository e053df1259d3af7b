//! The command line: `fencegate serve`, `check-config`, and the client commands.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// fencegate: make stores refuse writes from processes that lost their lock.
#[derive(Debug, Parser)]
#[command(name = "fencegate", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a node: the token authority, its HTTP API and the configured gateways.
    Serve(ConfigArg),
    /// Parse and validate a config file, then exit (errors name the line).
    CheckConfig(ConfigArg),
    /// Acquire, renew, release and inspect locks.
    #[command(subcommand)]
    Lock(LockCommand),
    /// Inspect the authority's Raft cluster.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Save the authority's state to a file, or restore it (bumping the revision).
    #[command(subcommand)]
    Snapshot(SnapshotCommand),
    /// Read and check the audit log of refused writes.
    #[command(subcommand)]
    Audit(AuditCommand),
    /// PostgreSQL gateway tools.
    #[command(subcommand)]
    Postgres(PostgresCommand),
    /// S3 manifest-mode maintenance, run against the store with the gateway's upstream
    /// credentials (the config's `[s3]` section and its `upstream_secret_env`).
    #[command(subcommand)]
    S3(S3Command),
    /// The cluster's token signing keys: list, rotate, retire.
    #[command(subcommand)]
    TokenKey(TokenKeyCommand),
    /// Make a cluster CA, node certificates and API credentials for a quick start.
    #[command(subcommand)]
    Certs(CertsCommand),
    /// Operators' recovery of a store's fence (admin, audited).
    #[command(subcommand)]
    Fence(FenceCommand),
}

#[derive(Debug, Subcommand)]
pub enum FenceCommand {
    /// Lower RESOURCE's fence in one store, if it still is --current (a compare-and-set): for
    /// recovery when the fence is above every token the authority can issue. The node that
    /// receives it resets the store behind its own gateway and writes an audit record.
    Reset {
        resource: String,
        /// The store: redis, postgres or s3 (S3: manifest mode only; in object mode each
        /// object carries its own fence).
        #[arg(long)]
        store: String,
        /// The fence the store holds now (0: none), as its refusals report it.
        #[arg(long)]
        current: u64,
        /// The new fence (0 removes it). Default: the current holder's token, else the
        /// authority's revision; never above the authority's revision.
        #[arg(long)]
        to: Option<u64>,
        /// PostgreSQL: a connection string of the fence schema's owner.
        #[arg(long)]
        dsn: Option<String>,
        /// S3: the bucket whose manifest log to reset; needed only when several buckets keep
        /// a manifest of the resource.
        #[arg(long)]
        bucket: Option<String>,
        #[command(flatten)]
        endpoint: EndpointArg,
    },
}

#[derive(Debug, Subcommand)]
pub enum TokenKeyCommand {
    /// Key ids, which one signs, which are retired (never secrets).
    List {
        #[command(flatten)]
        endpoint: EndpointArg,
    },
    /// Add a new key: once replicated it signs new tokens; older keys still verify (admin).
    Rotate {
        #[command(flatten)]
        endpoint: EndpointArg,
    },
    /// Retire key KID: tokens it signed are refused by every gateway from now on (admin).
    Retire {
        kid: u32,
        #[command(flatten)]
        endpoint: EndpointArg,
    },
}

#[derive(Debug, Subcommand)]
pub enum CertsCommand {
    /// Write ca.crt/ca.key, node<N>.crt/.key for each --node, and a credentials file with one
    /// admin and one client secret, into --dir. Refuses to overwrite existing files.
    Init {
        /// Output directory.
        #[arg(long, default_value = "certs")]
        dir: PathBuf,
        /// Nodes as ID=HOST[,HOST...], e.g. 1=127.0.0.1,localhost (host names or IP
        /// addresses the node is reached at; they go into its certificate).
        #[arg(long = "node", required = true)]
        nodes: Vec<String>,
    },
    /// Write node<N>.crt/.key for one more node, signed by the ca.crt/ca.key in --dir (made by
    /// `certs init`): for a node added to a running cluster. Refuses to overwrite files.
    AddNode {
        /// The directory `certs init` wrote.
        #[arg(long, default_value = "certs")]
        dir: PathBuf,
        /// The node as ID=HOST[,HOST...], as for `certs init`.
        #[arg(long = "node", required = true)]
        node: String,
    },
}

/// `postgres install --enforce`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum EnforceArg {
    /// fence.sql's plpgsql `fencegate.enforce()`.
    Plpgsql,
    /// The C `fencegate.enforce()` of filters/postgres/ext.
    C,
}

#[derive(Debug, Subcommand)]
pub enum PostgresCommand {
    /// Install (or upgrade) the fence schema: fences, keys, guard and enforcement (fence.sql).
    Install {
        /// A libpq-style connection string or URL, e.g. "host=127.0.0.1 port=5432 user=postgres dbname=app".
        /// The password may also come from PGPASSWORD or ~/.pgpass.
        #[arg(long, env = "FENCEGATE_PG_DSN")]
        dsn: String,
        /// How long the guard waits for a fence row locked by an older holder, in milliseconds.
        #[arg(long, default_value_t = 5000)]
        lock_timeout_ms: u64,
        /// The guard and the enforcement trigger function: plpgsql (portable; the first
        /// install's default) or c (faster; needs a superuser and the fencegate_enforce library
        /// on the database server, built with `make -C filters/postgres/ext install`). Without
        /// it, an install keeps the ones installed.
        #[arg(long, value_enum)]
        enforce: Option<EnforceArg>,
    },
    /// Install the triggers that make the store refuse writes without a guard pass.
    Protect {
        /// As for install; run as the role that installed the schema.
        #[arg(long, env = "FENCEGATE_PG_DSN")]
        dsn: String,
        /// Protect every table of this schema, and tables created there later.
        #[arg(long, conflicts_with = "table", required_unless_present = "table")]
        schema: Option<String>,
        /// Protect this table (`name` or `schema.name`) and its partitions.
        #[arg(long)]
        table: Option<String>,
        /// Bind the tables to this resource: writes need a token for it.
        #[arg(long)]
        resource: Option<String>,
    },
    /// List protected tables, their resources and the fences.
    Status {
        /// As for install.
        #[arg(long, env = "FENCEGATE_PG_DSN")]
        dsn: String,
    },
    /// Copy the cluster's token keys into the store, so the guard itself refuses unsigned and
    /// forged tokens (also on connections that bypass the gateway). Needs an admin credential;
    /// run again after `token-key rotate` or `retire`.
    SyncKeys {
        /// As for install; run as the role that installed the schema.
        #[arg(long, env = "FENCEGATE_PG_DSN")]
        dsn: String,
        /// A node's config file: its operator key (authority.token_key_env or token_key_file,
        /// key id 0) is installed too, so tokens it signs pass the store's guard.
        #[arg(long)]
        config: Option<std::path::PathBuf>,
        #[command(flatten)]
        endpoint: EndpointArg,
    },
    /// Print fence.sql, to review it or install it with your own tools.
    PrintSql,
}

#[derive(Debug, Subcommand)]
pub enum S3Command {
    /// Remove physical objects that no manifest names and that are older than --grace.
    Gc {
        #[command(flatten)]
        config: ConfigArg,
        /// Keep unreferenced objects younger than this: it must exceed the longest time a
        /// writer may take between its physical write and its commit (e.g. 24h, 90m).
        #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
        grace: Duration,
        /// Only this bucket's manifests (default: every manifest-mode rule's).
        #[arg(long)]
        bucket: Option<String>,
        /// Count what would be removed; remove nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Copy the committed view of BUCKET's manifest-mode keys under --prefix to plain keys
    /// (`<to-prefix><key without prefix>`), for readers that cannot use the gateway. Keys
    /// already under the destination that the view does not name are left alone.
    Export {
        #[command(flatten)]
        config: ConfigArg,
        /// The manifest-mode bucket to read.
        #[arg(long)]
        bucket: String,
        /// Only logical keys starting with this prefix.
        #[arg(long, default_value = "")]
        prefix: String,
        /// Destination prefix; it must not be under a fencing rule.
        #[arg(long)]
        to_prefix: String,
        /// Destination bucket (default: --bucket).
        #[arg(long)]
        to_bucket: Option<String>,
    },
}

/// Where `fencegate audit` finds the log.
#[derive(Debug, Args)]
pub struct AuditSource {
    /// The audit log directory (default: the config's `[audit] dir`, or `<data_dir>/audit`).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Path of the TOML config file, read when --dir is not given.
    #[arg(long, short, default_value = "config/fencegate.toml")]
    pub config: PathBuf,
}

#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// Show the last records.
    Tail {
        /// How many records.
        #[arg(short = 'n', long = "lines", default_value_t = 10)]
        n: usize,
        /// Print JSON lines instead of one summary line per record.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        source: AuditSource,
    },
    /// Show records by resource, store and age.
    Query {
        /// Only this resource.
        #[arg(long)]
        resource: Option<String>,
        /// Only this store: redis, s3 or postgres.
        #[arg(long)]
        store: Option<String>,
        /// Only records from this long ago until now, e.g. 10m, 2h.
        #[arg(long, value_parser = humantime::parse_duration)]
        since: Option<Duration>,
        /// Print JSON lines instead of one summary line per record.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        source: AuditSource,
    },
    /// Check the hash chain; exits 1 and names the first broken record if it is broken.
    Verify {
        #[command(flatten)]
        source: AuditSource,
    },
    /// Remove the oldest rotated files, keeping the newest N and the active file; the log
    /// then verifies from the oldest kept file's checkpoint. Refuses a log that does not verify.
    Prune {
        /// How many rotated files to keep (besides the active file).
        #[arg(long)]
        keep: usize,
        #[command(flatten)]
        source: AuditSource,
    },
}

#[derive(Debug, Args)]
pub struct ConfigArg {
    /// Path of the TOML config file.
    #[arg(long, short, default_value = "config/fencegate.toml")]
    pub config: PathBuf,
}

#[derive(Debug, Args, Clone)]
pub struct EndpointArg {
    /// Authority API endpoints, comma-separated; the next is tried when one is down.
    #[arg(
        long,
        env = "FENCEGATE_ENDPOINT",
        default_value = "http://127.0.0.1:7070",
        value_delimiter = ','
    )]
    pub endpoint: Vec<String>,
    /// A file holding this client's API credential (the secret of a `[security]` credential).
    /// FENCEGATE_API_TOKEN, when set, holds the secret itself and takes precedence.
    #[arg(long, env = "FENCEGATE_CREDENTIAL_FILE")]
    pub credential_file: Option<PathBuf>,
    /// The cluster CA (PEM) to trust for https:// endpoints (`fencegate certs init` writes it).
    #[arg(long, env = "FENCEGATE_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// How to print the answer: json (the API's own, for scripts) or table (for people).
    #[arg(short = 'o', long = "output", value_enum, default_value = "json")]
    pub output: crate::table::Output,
}

#[derive(Debug, Subcommand)]
pub enum LockCommand {
    /// Acquire a lock; prints the API's JSON (token, lease id, ttl).
    Acquire {
        /// Resource name, 1-256 characters from [A-Za-z0-9._:/-].
        resource: String,
        /// Lease length.
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        ttl: Duration,
        /// How long to wait for a held lock (0s: fail at once).
        #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
        wait: Duration,
        /// A label for the holder, shown by `lock status`.
        #[arg(long)]
        holder: Option<String>,
        #[command(flatten)]
        endpoint: EndpointArg,
    },
    /// Hold RESOURCE exactly while a command runs. The command gets FENCING_TOKEN,
    /// FENCING_RESOURCE, FENCING_LEASE_ID and FENCING_REVISION in its environment; the lease is
    /// renewed every ttl/3 and, if renewals fail, the command is sent SIGTERM at the stop time
    /// (last renewal's send time + ttl - margin), then SIGKILL after --grace. Exits with the
    /// command's code, 75 if the lock stayed held past --wait, 124 if the lease was lost.
    Run {
        /// Resource name, 1-256 characters from [A-Za-z0-9._:/-].
        resource: String,
        /// Lease length.
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        ttl: Duration,
        /// Safety margin: stop the command this long before the lease could end.
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        margin: Duration,
        /// How long to wait for a held lock (0s: fail at once).
        #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
        wait: Duration,
        /// Time between SIGTERM and SIGKILL when the command must stop.
        #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
        grace: Duration,
        /// A label for the holder, shown by `lock status`.
        #[arg(long)]
        holder: Option<String>,
        #[command(flatten)]
        endpoint: EndpointArg,
        /// Keep the stop time in this file (one JSON line, CLOCK_MONOTONIC ns, replaced at
        /// every renewal; named to the command as FENCING_STOP_FILE), for a command that
        /// wants to stop by itself in time. Never deleted: the caller owns it.
        #[arg(long)]
        stop_file: Option<std::path::PathBuf>,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Renew a lease; prints the remaining ttl. LEASE is the handle acquire printed.
    Keepalive {
        lease_id: String,
        #[command(flatten)]
        endpoint: EndpointArg,
    },
    /// Release a lease and every lock it holds. LEASE is the handle acquire printed.
    Release {
        lease_id: String,
        #[command(flatten)]
        endpoint: EndpointArg,
    },
    /// Show who holds a lock.
    Status {
        resource: String,
        #[command(flatten)]
        endpoint: EndpointArg,
    },
    /// List held locks: resource, revision, lease number, holder, ttl left (JSON).
    List {
        #[command(flatten)]
        endpoint: EndpointArg,
    },
}

#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Node id, leader, term, members, last applied, revision (JSON).
    Status {
        #[command(flatten)]
        endpoint: EndpointArg,
    },
    /// Add a node to the running cluster (admin): it joins as a learner, catches up with the
    /// log, then votes. Start the node first, in join mode (`[authority] join = true`).
    AddNode {
        /// The new node's id (its `[node] id`); not used by any member.
        #[arg(long)]
        id: u64,
        /// host:port where clients and other members reach its API.
        #[arg(long)]
        api: String,
        /// host:port of its peer (Raft) port; with TLS the host must be in its certificate.
        #[arg(long)]
        peer: String,
        #[command(flatten)]
        endpoint: EndpointArg,
    },
    /// Remove node ID from the cluster (admin). The removed node notices and exits; a dead
    /// node can be removed too.
    RemoveNode {
        id: u64,
        #[command(flatten)]
        endpoint: EndpointArg,
    },
}

#[derive(Debug, Subcommand)]
pub enum SnapshotCommand {
    /// Write the authority's current state (a linearizable read) to FILE.
    Save {
        file: PathBuf,
        #[command(flatten)]
        endpoint: EndpointArg,
    },
    /// Replace the authority's state with FILE; the revision is bumped by the configured
    /// `authority.restore_bump` so that no token is ever handed out twice.
    Restore {
        file: PathBuf,
        #[command(flatten)]
        endpoint: EndpointArg,
    },
    /// Raise the revision by N (admin): after the stores were restored from a backup, or to get
    /// above fences that a wiped authority no longer knows of.
    Bump {
        by: u64,
        #[command(flatten)]
        endpoint: EndpointArg,
    },
}
