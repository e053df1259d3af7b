//! The aws CLI (v1, from the repository's `.venv`) works unchanged against a manifest-mode
//! bucket: put (`s3 cp`, `s3api put-object`), get, head, ls with delimiter and pagination,
//! copy, multipart (`s3 cp` above a small `multipart_threshold`), delete and presigned GET.
//! The CLI cannot add a `Fencing-Token` header; it sends the token as the SigV4 session token
//! (`AWS_SESSION_TOKEN`), which the gateway takes as the token when the header is absent.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::harness::{Harness, ACCESS_KEY, SECRET};
use serde_json::Value;

/// The aws CLI of the venv moto runs from; panics with install instructions.
fn aws_binary() -> PathBuf {
    let python = crate::harness::s3_server::venv_python();
    let aws = python.parent().unwrap().join("aws");
    assert!(
        aws.exists(),
        "the aws CLI is not installed in {}; install it with: .venv/bin/pip install awscli",
        python.parent().unwrap().display()
    );
    aws
}

struct Cli {
    aws: PathBuf,
    endpoint: String,
    config: PathBuf,
    dir: tempfile::TempDir,
}

/// What one aws CLI run printed.
struct Run {
    code: i32,
    out: String,
    err: String,
}

impl Run {
    fn ok(self) -> String {
        assert_eq!(self.code, 0, "aws failed: {}{}", self.out, self.err);
        self.out
    }

    fn json(self) -> Value {
        serde_json::from_str(&self.ok()).unwrap()
    }
}

impl Cli {
    fn new(h: &Harness) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("aws-config");
        // A 5 MB threshold (S3's smallest part size) makes a 12 MiB `s3 cp` a 3-part upload.
        // aws CLI v1 presigns with SigV2 unless told s3v4; the gateway verifies SigV4 only.
        std::fs::write(
            &config,
            "[default]\nregion = us-east-1\ns3 =\n    addressing_style = path\n    signature_version = s3v4\n    multipart_threshold = 5MB\n    multipart_chunksize = 5MB\n",
        )
        .unwrap();
        Self {
            aws: aws_binary(),
            endpoint: h.endpoint.clone(),
            config,
            dir,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `aws --endpoint-url <gateway> <args>` as holder `revision` (none: no token).
    fn run(&self, revision: Option<u64>, args: &[&str]) -> Run {
        let mut command = Command::new(&self.aws);
        command
            .arg("--endpoint-url")
            .arg(&self.endpoint)
            .args(args)
            .env("AWS_CONFIG_FILE", &self.config)
            .env("AWS_SHARED_CREDENTIALS_FILE", self.path("no-credentials"))
            .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", SECRET)
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .env("AWS_PAGER", "")
            .env_remove("AWS_PROFILE")
            .env_remove("AWS_SESSION_TOKEN");
        if let Some(revision) = revision {
            command.env("AWS_SESSION_TOKEN", format!("fg1~{revision}~job"));
        }
        let out = command.output().expect("run aws");
        Run {
            code: out.status.code().unwrap_or(-1),
            out: String::from_utf8_lossy(&out.stdout).into_owned(),
            err: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

fn write(path: &Path, bytes: &[u8]) -> String {
    std::fs::write(path, bytes).unwrap();
    path.display().to_string()
}

#[test]
fn aws_cli_works_unchanged_against_a_manifest_bucket() {
    let h = Harness::start();
    let cli = Cli::new(&h);
    let small = write(&cli.path("small.txt"), b"written by the aws cli");
    let other = write(&cli.path("other.txt"), b"put-object body");

    // Put: s3 cp (PutObject) and s3api put-object, as holder 5.
    cli.run(Some(5), &["s3", "cp", &small, "s3://ledger/data/a.txt"])
        .ok();
    let put = cli
        .run(
            Some(5),
            &[
                "s3api",
                "put-object",
                "--bucket",
                "ledger",
                "--key",
                "data/b.txt",
                "--body",
                &other,
            ],
        )
        .json();
    assert!(put["ETag"].as_str().is_some(), "{put}");
    for key in ["data/dir1/x", "data/dir1/y", "data/dir2/z"] {
        cli.run(
            Some(5),
            &["s3", "cp", &small, &format!("s3://ledger/{key}")],
        )
        .ok();
    }

    // Get and head.
    let body = cli
        .run(None, &["s3", "cp", "s3://ledger/data/a.txt", "-"])
        .ok();
    assert_eq!(body, "written by the aws cli");
    let fetched = cli.path("fetched");
    cli.run(
        None,
        &[
            "s3api",
            "get-object",
            "--bucket",
            "ledger",
            "--key",
            "data/b.txt",
            &fetched.display().to_string(),
        ],
    )
    .ok();
    assert_eq!(std::fs::read(&fetched).unwrap(), b"put-object body");
    let head = cli
        .run(
            None,
            &[
                "s3api",
                "head-object",
                "--bucket",
                "ledger",
                "--key",
                "data/b.txt",
            ],
        )
        .json();
    assert_eq!(head["ContentLength"], 15, "{head}");
    assert_eq!(head["ETag"], put["ETag"], "{head}");

    // ls with delimiter (s3 ls is delimiter "/"), and listings two keys per page.
    let ls = cli.run(None, &["s3", "ls", "s3://ledger/data/"]).ok();
    println!("{ls}");
    assert!(ls.contains("PRE dir1/") && ls.contains("PRE dir2/"), "{ls}");
    assert!(ls.contains(" a.txt") && ls.contains(" b.txt"), "{ls}");
    assert!(
        !ls.contains(" x"),
        "keys below a delimiter are grouped: {ls}"
    );
    let paged = cli
        .run(
            None,
            &[
                "s3",
                "ls",
                "--recursive",
                "--page-size",
                "2",
                "s3://ledger/data/",
            ],
        )
        .ok();
    let keys: Vec<&str> = paged
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .collect();
    assert_eq!(
        keys,
        [
            "data/a.txt",
            "data/b.txt",
            "data/dir1/x",
            "data/dir1/y",
            "data/dir2/z"
        ],
        "{paged}"
    );
    let prefixes = cli
        .run(
            None,
            &[
                "s3api",
                "list-objects-v2",
                "--bucket",
                "ledger",
                "--prefix",
                "data/",
                "--delimiter",
                "/",
                "--page-size",
                "1",
            ],
        )
        .json();
    assert_eq!(
        prefixes["CommonPrefixes"],
        serde_json::json!([{"Prefix": "data/dir1/"}, {"Prefix": "data/dir2/"}]),
        "{prefixes}"
    );

    // Copy.
    cli.run(
        Some(5),
        &[
            "s3",
            "cp",
            "s3://ledger/data/a.txt",
            "s3://ledger/data/copy.txt",
        ],
    )
    .ok();
    let copied = cli
        .run(None, &["s3", "cp", "s3://ledger/data/copy.txt", "-"])
        .ok();
    assert_eq!(copied, "written by the aws cli");

    // Multipart: 12 MiB above a 5 MB threshold.
    let big: Vec<u8> = (0..12u32 << 20).map(|i| (i % 251) as u8).collect();
    let big_file = write(&cli.path("big.bin"), &big);
    cli.run(
        Some(5),
        &["s3", "cp", &big_file, "s3://ledger/data/big.bin"],
    )
    .ok();
    let head = cli
        .run(
            None,
            &[
                "s3api",
                "head-object",
                "--bucket",
                "ledger",
                "--key",
                "data/big.bin",
            ],
        )
        .json();
    assert!(
        head["ETag"].as_str().unwrap().ends_with("-3\""),
        "a 3-part upload: {head}"
    );
    let back = cli.path("big.back");
    cli.run(
        None,
        &[
            "s3",
            "cp",
            "s3://ledger/data/big.bin",
            &back.display().to_string(),
        ],
    )
    .ok();
    assert!(
        std::fs::read(&back).unwrap() == big,
        "multipart bytes differ"
    );

    // Presigned GET, fetched by curl.
    let url = cli
        .run(
            None,
            &[
                "s3",
                "presign",
                "s3://ledger/data/a.txt",
                "--expires-in",
                "300",
            ],
        )
        .ok();
    let curl = Command::new("curl")
        .args(["-sS", "--fail-with-body", url.trim()])
        .output()
        .expect("curl is needed for the presigned GET (apt-get install curl)");
    assert!(
        curl.status.success(),
        "{}",
        String::from_utf8_lossy(&curl.stdout)
    );
    assert_eq!(curl.stdout, b"written by the aws cli");

    // Delete.
    cli.run(Some(5), &["s3", "rm", "s3://ledger/data/b.txt"])
        .ok();
    let gone = cli.run(
        None,
        &[
            "s3api",
            "head-object",
            "--bucket",
            "ledger",
            "--key",
            "data/b.txt",
        ],
    );
    assert_ne!(gone.code, 0);
    assert!(gone.err.contains("404"), "{}", gone.err);

    // Fencing through the CLI: a newer holder writes; the old one's put, delete and
    // multipart upload are refused and audited, and change nothing; no token at all is 428.
    cli.run(Some(7), &["s3", "cp", &other, "s3://ledger/data/a.txt"])
        .ok();
    let events_before = h.audit.events().len();
    for args in [
        vec!["s3", "cp", small.as_str(), "s3://ledger/data/a.txt"],
        vec!["s3", "rm", "s3://ledger/data/a.txt"],
        vec!["s3", "cp", big_file.as_str(), "s3://ledger/data/a.txt"],
        vec!["s3", "cp", small.as_str(), "s3://ledger/data/new.txt"],
    ] {
        let stale = cli.run(Some(5), &args);
        println!("{args:?}: {}", stale.err.trim());
        assert_ne!(stale.code, 0);
        assert!(stale.err.contains("FencingTokenStale"), "{}", stale.err);
    }
    let missing = cli.run(None, &["s3", "cp", &small, "s3://ledger/data/a.txt"]);
    assert!(
        missing.err.contains("FencingTokenRequired"),
        "{}",
        missing.err
    );
    let body = cli
        .run(None, &["s3", "cp", "s3://ledger/data/a.txt", "-"])
        .ok();
    assert_eq!(body, "put-object body");
    let absent = cli.run(
        None,
        &[
            "s3api",
            "head-object",
            "--bucket",
            "ledger",
            "--key",
            "data/new.txt",
        ],
    );
    assert_ne!(absent.code, 0);
    let events = h.audit.events();
    let reasons: Vec<&str> = events[events_before..]
        .iter()
        .map(|e| e.reason.as_str())
        .collect();
    println!("audited after the raise: {reasons:?}");
    assert_eq!(reasons, ["stale", "stale", "stale", "stale", "missing"]);
}
