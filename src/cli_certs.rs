//! `fencegate certs init`: a cluster CA, one certificate per node (server and client use, for
//! the API and the peer port's mutual TLS) and API credentials, for a quick start;
//! `certs add-node`: one more node's certificate from the same CA. Production deployments may
//! use their own PKI: the node only reads PEM files.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::{bail, Context};
use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// Writes `contents` to a new file (never overwriting one); private files get mode 0600.
fn write_new(path: &Path, contents: &str, private: bool) -> anyhow::Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(path)
        .with_context(|| {
            format!(
                "creating {} (remove it first to make a new one)",
                path.display()
            )
        })?;
    file.write_all(contents.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// 32 random bytes as hex: an API credential secret.
fn secret() -> String {
    use rand::Rng;
    let bytes: [u8; 32] = rand::thread_rng().gen();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses `ID=HOST[,HOST...]`.
fn parse_node(node: &str) -> anyhow::Result<(u64, Vec<String>)> {
    let Some((id, hosts)) = node.split_once('=') else {
        bail!("--node {node:?}: expected ID=HOST[,HOST...], e.g. 1=127.0.0.1,localhost");
    };
    let id: u64 = id
        .parse()
        .ok()
        .filter(|id| *id > 0)
        .with_context(|| format!("--node {node:?}: the id must be a positive number"))?;
    let hosts: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(str::to_owned)
        .collect();
    if hosts.is_empty() {
        bail!("--node {node:?}: name at least one host or IP address");
    }
    Ok((id, hosts))
}

/// The CA certificate's fields. `add_node` rebuilds the CA from these and the saved key: the
/// same subject and key give node certificates that chain to the saved `ca.crt`.
fn ca_params() -> anyhow::Result<CertificateParams> {
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "fencegate cluster CA");
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(ca_params)
}

/// Writes node<id>.crt/.key, signed by the CA.
fn write_node_cert(
    dir: &Path,
    id: u64,
    hosts: &[String],
    ca: &Certificate,
    ca_key: &KeyPair,
) -> anyhow::Result<()> {
    let mut params = CertificateParams::new(hosts.to_vec())
        .with_context(|| format!("node {id}: a host name is not valid in a certificate"))?;
    params
        .distinguished_name
        .push(DnType::CommonName, format!("fencegate node {id}"));
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, ca, ca_key)?;
    write_new(&dir.join(format!("node{id}.crt")), &cert.pem(), false)?;
    write_new(
        &dir.join(format!("node{id}.key")),
        &key.serialize_pem(),
        true,
    )
}

pub fn init(dir: &Path, nodes: &[String]) -> anyhow::Result<()> {
    let parsed = nodes
        .iter()
        .map(|node| parse_node(node))
        .collect::<anyhow::Result<Vec<_>>>()?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;

    let ca_key = KeyPair::generate()?;
    let ca = ca_params()?.self_signed(&ca_key)?;
    write_new(&dir.join("ca.crt"), &ca.pem(), false)?;
    write_new(&dir.join("ca.key"), &ca_key.serialize_pem(), true)?;

    for (id, hosts) in &parsed {
        write_node_cert(dir, *id, hosts, &ca, &ca_key)?;
    }

    let (admin, client) = (secret(), secret());
    write_new(
        &dir.join("credentials"),
        &format!(
            "# name role secret: [security] credentials_file of every node\nadmin admin {admin}\napp client {client}\n"
        ),
        true,
    )?;
    write_new(&dir.join("admin.token"), &format!("{admin}\n"), true)?;
    write_new(&dir.join("client.token"), &format!("{client}\n"), true)?;
    println!(
        "wrote {dir}/ca.crt, ca.key, {nodes}, credentials, admin.token, client.token\n\
         node config:   [security] ca_file = \"{dir}/ca.crt\", cert_file = \"{dir}/node<N>.crt\", key_file = \"{dir}/node<N>.key\", credentials_file = \"{dir}/credentials\"\n\
         CLI:           FENCEGATE_CA_FILE={dir}/ca.crt FENCEGATE_CREDENTIAL_FILE={dir}/client.token (admin.token for admin calls)",
        dir = dir.display(),
        nodes = parsed
            .iter()
            .map(|(id, _)| format!("node{id}.crt/.key"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    Ok(())
}

/// `certs add-node`: one more node's certificate from the CA in `dir`.
pub fn add_node(dir: &Path, node: &str) -> anyhow::Result<()> {
    let (id, hosts) = parse_node(node)?;
    let key_path = dir.join("ca.key");
    let pem = std::fs::read_to_string(&key_path).with_context(|| {
        format!(
            "reading {} (the CA key `certs init` wrote; add-node needs it)",
            key_path.display()
        )
    })?;
    let ca_key = KeyPair::from_pem(&pem)
        .with_context(|| format!("{} is not a PEM private key", key_path.display()))?;
    let ca = ca_params()?.self_signed(&ca_key)?;
    write_node_cert(dir, id, &hosts, &ca, &ca_key)?;
    println!(
        "wrote {dir}/node{id}.crt, node{id}.key (signed by {dir}/ca.key)\n\
         node config:   [security] ca_file = \"{dir}/ca.crt\", cert_file = \"{dir}/node{id}.crt\", key_file = \"{dir}/node{id}.key\", credentials_file = \"{dir}/credentials\"",
        dir = dir.display(),
    );
    Ok(())
}
