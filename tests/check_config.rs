//! `fencegate check-config` builds every section as `serve` does, without binding, and names
//! the file and line of every error.

mod support;

use support::postgres_server::cli;

/// Writes `text` as a config file and runs check-config on it; returns (code, stdout, stderr).
fn check(text: &str) -> (i32, String, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fencegate.toml");
    std::fs::write(&path, text).unwrap();
    let path = path.display().to_string();
    let (code, out, err) = cli(&["check-config", "--config", &path]);
    (code, out, err, path)
}

/// The 1-based line of the first line of `text` containing `needle`.
fn line_of(text: &str, needle: &str) -> usize {
    text.lines().position(|l| l.contains(needle)).unwrap() + 1
}

fn assert_fails_at(text: &str, needle: &str, key: &str, why: &str) {
    let (code, out, err, path) = check(text);
    let at = format!("{path}:{}: {key}: ", line_of(text, needle));
    assert_ne!(code, 0, "check-config passed:\n{out}");
    assert!(err.contains(&at), "expected {at:?} in: {err}");
    assert!(err.contains(why), "expected {why:?} in: {err}");
    println!("{}", err.trim());
}

const BASE: &str = "[node]\nid = 1\napi = \"127.0.0.1:17070\"\n\n[security]\ninsecure = true\n";

#[test]
fn a_good_config_passes() {
    let (code, out, err, _) = check(BASE);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(": ok (node 1"), "{out}");
}

#[test]
fn an_unset_secret_variable_names_its_line() {
    let text = format!("{BASE}\n[authority]\ntoken_key_env = \"FENCEGATE_TEST_UNSET_SECRET\"\n");
    assert_fails_at(
        &text,
        "token_key_env",
        "authority.token_key_env",
        "FENCEGATE_TEST_UNSET_SECRET is not set",
    );
}

#[test]
fn a_missing_tls_file_names_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.crt");
    std::fs::write(&ca, "not used: the certificate file is missing first").unwrap();
    let text = format!(
        "[node]\nid = 1\napi = \"127.0.0.1:17070\"\npeer = \"127.0.0.1:17170\"\n\n[security]\nca_file = \"{}\"\ncert_file = \"/nonexistent/fencegate/node.crt\"\nkey_file = \"/nonexistent/fencegate/node.key\"\ncredentials_env = \"PATH\"\n",
        ca.display()
    );
    assert_fails_at(
        &text,
        "cert_file",
        "security.cert_file",
        "/nonexistent/fencegate/node.crt",
    );
}

#[test]
fn a_listener_collision_names_its_line() {
    let text = format!(
        "{BASE}\n[redis]\nlisten = \"0.0.0.0:17070\"\nupstream = \"127.0.0.1:6379\"\nprotect = []\n"
    );
    assert_fails_at(&text, "0.0.0.0:17070", "redis.listen", "node.api");
}

#[test]
fn a_protect_rule_without_resource_names_its_line() {
    let text = format!(
        "{BASE}\n[redis]\nlisten = \"127.0.0.1:16380\"\nupstream = \"127.0.0.1:6379\"\n\n[[redis.protect]]\npattern = \"billing:*\"\nresource = \"billing\"\n\n[[redis.protect]]\npattern = \"orders:*\"\nmode = \"enforce\"\n"
    );
    let (_, _, err, path) = check(&text);
    // The second rule's header: the line before its pattern.
    let at = format!(
        "{path}:{}: redis.protect.1: ",
        line_of(&text, "orders:*") - 1
    );
    assert!(err.contains(&at), "expected {at:?} in: {err}");
    assert!(err.contains("needs a resource"), "{err}");
    println!("{}", err.trim());
}
