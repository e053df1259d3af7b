//! `fencegate certs init`: a cluster CA, one certificate per node (server and client use, for
//! the API and the peer port's mutual TLS) and API credentials, for a quick start. Production
//! deployments may use their own PKI: the node only reads PEM files.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::{bail, Context};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
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

pub fn init(dir: &Path, nodes: &[String]) -> anyhow::Result<()> {
    let mut parsed = Vec::new();
    for node in nodes {
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
        parsed.push((id, hosts));
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;

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
    let ca_key = KeyPair::generate()?;
    let ca = ca_params.self_signed(&ca_key)?;
    write_new(&dir.join("ca.crt"), &ca.pem(), false)?;
    write_new(&dir.join("ca.key"), &ca_key.serialize_pem(), true)?;

    for (id, hosts) in &parsed {
        let mut params = CertificateParams::new(hosts.clone())
            .with_context(|| format!("node {id}: a host name is not valid in a certificate"))?;
        params
            .distinguished_name
            .push(DnType::CommonName, format!("fencegate node {id}"));
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &ca, &ca_key)?;
        write_new(&dir.join(format!("node{id}.crt")), &cert.pem(), false)?;
        write_new(
            &dir.join(format!("node{id}.key")),
            &key.serialize_pem(),
            true,
        )?;
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
