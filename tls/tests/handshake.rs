//! Real TLS handshakes over loopback TCP between configs built from directories `corral-tls` wrote: who is let in
//! and who is refused, and the errors a bad directory gives.

use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use corral_tls::rustls::pki_types::ServerName;
use corral_tls::rustls::{self, ClientConfig, RootCertStore};
use corral_tls::{CERT, ClusterCa, KEY, LeafRequest, SubjectAltName, TlsDir, TlsError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn node_sans() -> Vec<SubjectAltName> {
    vec![
        SubjectAltName::Ip(LOCALHOST),
        SubjectAltName::Dns("node-1.corral".to_owned()),
    ]
}

/// A CA and a node directory issued by it, both in `root`.
fn cluster(root: &Path, node: &str, sans: Vec<SubjectAltName>) -> (ClusterCa, TlsDir) {
    let ca = ClusterCa::generate("test cluster CA", 30).unwrap();
    ca.write(&root.join("ca")).unwrap();
    let ca = ClusterCa::load(&root.join("ca")).unwrap();
    let dir = issue(&ca, root, node, sans);
    (ca, dir)
}

fn issue(ca: &ClusterCa, root: &Path, node: &str, sans: Vec<SubjectAltName>) -> TlsDir {
    let out = root.join(node);
    ca.issue(&LeafRequest::new(node, sans, 30))
        .unwrap()
        .write(&out)
        .unwrap();
    TlsDir::load(&out).unwrap()
}

/// Outcome of one handshake: the server's accept result, and whether the client got the server's echo.
struct Outcome {
    server: Result<(), String>,
    client_echo: bool,
}

async fn handshake(server: &TlsDir, client: ClientConfig, name: &str) -> Outcome {
    let listener = TcpListener::bind((LOCALHOST, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(server.server_config().unwrap()));
    let server_task = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut tls = acceptor.accept(tcp).await.map_err(|e| e.to_string())?;
        let mut buf = [0u8; 5];
        tls.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
        tls.write_all(&buf).await.map_err(|e| e.to_string())?;
        tls.shutdown().await.map_err(|e| e.to_string())
    });
    let connector = TlsConnector::from(Arc::new(client));
    let name = ServerName::try_from(name.to_owned()).unwrap();
    let client_echo = async {
        let tcp = TcpStream::connect(addr).await.ok()?;
        let mut tls = connector.connect(name, tcp).await.ok()?;
        tls.write_all(b"hello").await.ok()?;
        let mut buf = [0u8; 5];
        tls.read_exact(&mut buf).await.ok()?;
        Some(&buf == b"hello")
    }
    .await
    .unwrap_or(false);
    let server = server_task.await.unwrap();
    Outcome { server, client_echo }
}

/// A client that trusts `ca_pem` and presents the certificate and key of the node directory `identity`.
fn client_presenting(ca_pem: &str, identity: &Path) -> ClientConfig {
    let chain = rustls::pki_types::CertificateDer::pem_file_iter(identity.join(CERT))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(identity.join(KEY)).unwrap();
    ClientConfig::builder_with_provider(corral_tls::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots(ca_pem))
        .with_client_auth_cert(chain, key)
        .unwrap()
}

fn roots(ca_pem: &str) -> RootCertStore {
    let mut roots = RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    roots
}

fn client_without_certificate(ca_pem: &str) -> ClientConfig {
    let mut roots = RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    ClientConfig::builder_with_provider(corral_tls::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth()
}

use rustls::pki_types::pem::PemObject;

#[tokio::test]
async fn nodes_of_one_cluster_complete_a_mutual_handshake() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, server) = cluster(tmp.path(), "server", node_sans());
    let client = issue(
        &ca,
        tmp.path(),
        "client",
        vec![SubjectAltName::Dns("client.corral".to_owned())],
    );
    for name in ["127.0.0.1", "node-1.corral"] {
        let out = handshake(&server, client.client_config().unwrap(), name).await;
        assert_eq!(out.server, Ok(()), "dialled as {name}");
        assert!(out.client_echo, "dialled as {name}");
    }
}

#[tokio::test]
async fn a_client_without_a_certificate_is_refused_at_the_handshake() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, server) = cluster(tmp.path(), "server", node_sans());
    let out = handshake(&server, client_without_certificate(ca.cert_pem()), "127.0.0.1").await;
    let err = out.server.unwrap_err();
    assert!(err.contains("peer sent no certificates"), "{err}");
    assert!(!out.client_echo);
}

#[tokio::test]
async fn a_client_of_another_clusters_ca_is_refused_at_the_handshake() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, server) = cluster(tmp.path(), "server", node_sans());
    cluster(&tmp.path().join("other"), "stranger", node_sans());
    // The stranger trusts this cluster's CA (so only the server's check can refuse it) but presents its own.
    let client = client_presenting(ca.cert_pem(), &tmp.path().join("other").join("stranger"));
    let out = handshake(&server, client, "127.0.0.1").await;
    // Both CAs have the same name, as two clusters' default CAs do: the signature is what gives it away.
    let err = out.server.unwrap_err();
    assert!(err.contains("invalid peer certificate: BadSignature"), "{err}");
    assert!(!out.client_echo);
}

#[tokio::test]
async fn an_expired_client_certificate_is_refused_at_the_handshake() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, server) = cluster(tmp.path(), "server", node_sans());
    let mut req = LeafRequest::new("expired", node_sans(), 30);
    req.not_before = time::OffsetDateTime::now_utc() - time::Duration::days(10);
    req.not_after = time::OffsetDateTime::now_utc() - time::Duration::days(1);
    ca.issue(&req)
        .unwrap()
        .write(&tmp.path().join("expired"))
        .unwrap();
    let out = handshake(
        &server,
        client_presenting(ca.cert_pem(), &tmp.path().join("expired")),
        "127.0.0.1",
    )
    .await;
    let err = out.server.unwrap_err();
    assert!(err.contains("certificate expired"), "{err}");
    assert!(!out.client_echo);
}

#[tokio::test]
async fn a_server_whose_certificate_does_not_name_the_address_dialled_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // The server's certificate is for another node's address.
    let (ca, server) = cluster(
        tmp.path(),
        "server",
        vec![SubjectAltName::Ip("10.9.9.9".parse().unwrap())],
    );
    let client = issue(&ca, tmp.path(), "client", node_sans());
    let out = handshake(&server, client.client_config().unwrap(), "127.0.0.1").await;
    assert!(!out.client_echo, "the client must refuse the server");
    assert!(out.server.is_err());
}

#[test]
fn a_key_that_is_not_the_certificates_is_refused_naming_both_files() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, _) = cluster(tmp.path(), "a", node_sans());
    let b = ca.issue(&LeafRequest::new("b", node_sans(), 30)).unwrap();
    let a_dir = tmp.path().join("a");
    std::fs::write(a_dir.join(KEY), b.key_pem()).unwrap();
    let err = TlsDir::load(&a_dir).unwrap_err();
    assert!(matches!(err, TlsError::KeyMismatch { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(&a_dir.join(KEY).display().to_string()), "{msg}");
    assert!(msg.contains(&a_dir.join(CERT).display().to_string()), "{msg}");
}

#[test]
fn a_missing_or_garbled_file_is_named_in_the_error() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, _) = cluster(tmp.path(), "node", node_sans());
    let dir = tmp.path().join("node");
    let good = std::fs::read(dir.join(CERT)).unwrap();
    std::fs::write(
        dir.join(CERT),
        "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let msg = TlsDir::load(&dir).unwrap_err().to_string();
    assert!(msg.starts_with(&dir.join(CERT).display().to_string()), "{msg}");
    assert!(msg.contains("not a PEM certificate"), "{msg}");
    std::fs::write(dir.join(CERT), "no pem here").unwrap();
    let msg = TlsDir::load(&dir).unwrap_err().to_string();
    assert!(
        msg.contains("tls.crt: not a PEM certificate: no CERTIFICATE block"),
        "{msg}"
    );
    std::fs::write(dir.join(CERT), good).unwrap();
    std::fs::write(
        dir.join(KEY),
        "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    let msg = TlsDir::load(&dir).unwrap_err().to_string();
    assert!(msg.contains("tls.key"), "{msg}");
    std::fs::remove_file(dir.join(KEY)).unwrap();
    let msg = TlsDir::load(&dir).unwrap_err().to_string();
    assert!(msg.contains("tls.key: cannot read"), "{msg}");
}

#[test]
fn keys_are_written_owner_only_and_a_ca_is_never_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, _) = cluster(tmp.path(), "node", node_sans());
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&tmp.path().join("node").join(KEY)), 0o600);
    assert_eq!(mode(&tmp.path().join("ca").join(corral_tls::CA_KEY)), 0o600);
    assert_eq!(mode(&tmp.path().join("node").join(CERT)), 0o644);
    let before = std::fs::read(tmp.path().join("ca").join(corral_tls::CA_KEY)).unwrap();
    let err = ClusterCa::generate("again", 30)
        .unwrap()
        .write(&tmp.path().join("ca"))
        .unwrap_err();
    assert!(matches!(err, TlsError::CaExists { .. }), "{err}");
    assert_eq!(
        std::fs::read(tmp.path().join("ca").join(corral_tls::CA_KEY)).unwrap(),
        before
    );
    drop(ca);
}

#[test]
fn a_malformed_dns_name_is_refused_before_issuing() {
    let ca = ClusterCa::generate("ca", 1).unwrap();
    let err = ca
        .issue(&LeafRequest::new(
            "n",
            vec![SubjectAltName::Dns("bad name!".to_owned())],
            1,
        ))
        .unwrap_err();
    assert!(matches!(err, TlsError::BadName { .. }), "{err}");
}

/// Parameters of an intermediate CA named `name` (no path length limit of its own).
fn intermediate(name: &str) -> rcgen::CertificateParams {
    let mut p = rcgen::CertificateParams::default();
    p.distinguished_name.push(rcgen::DnType::CommonName, name);
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    p
}

/// A client that trusts `ca_pem` and presents a fresh leaf for 127.0.0.1 signed by `issuer`, followed by `chain`.
fn client_with_chain(
    ca_pem: &str,
    issuer: &rcgen::Issuer<'_, impl rcgen::SigningKey>,
    chain: Vec<rustls::pki_types::CertificateDer<'static>>,
) -> ClientConfig {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut p = rcgen::CertificateParams::default();
    p.distinguished_name.push(rcgen::DnType::CommonName, "chained");
    p.subject_alt_names = vec![rcgen::SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST))];
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let leaf = p.signed_by(&key, issuer).unwrap();
    let mut certs = vec![leaf.der().clone()];
    certs.extend(chain);
    let key = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap();
    ClientConfig::builder_with_provider(corral_tls::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots(ca_pem))
        .with_client_auth_cert(certs, key)
        .unwrap()
}

#[tokio::test]
async fn a_client_chain_of_twenty_intermediates_or_a_loop_is_refused_at_the_handshake() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, server) = cluster(tmp.path(), "server", node_sans());

    // The cluster CA signs I1, I1 signs I2 … I20 signs the leaf: a real path to the CA, 20 deep.
    let mut issuer =
        rcgen::Issuer::from_ca_cert_pem(ca.cert_pem(), rcgen::KeyPair::from_pem(ca.key_pem()).unwrap())
            .unwrap();
    let mut chain = Vec::new();
    for i in 1..=20 {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = intermediate(&format!("intermediate {i}"));
        chain.insert(0, params.signed_by(&key, &issuer).unwrap().der().clone());
        issuer = rcgen::Issuer::new(params, key);
    }
    let long = client_with_chain(ca.cert_pem(), &issuer, chain);
    let out = handshake(&server, long, "127.0.0.1").await;
    let err = out.server.expect_err("a 20-deep chain was let in");
    assert!(!out.client_echo);
    eprintln!("refused: {err}");
    assert!(err.contains("MaximumPathDepthExceeded"), "{err}");

    // A signs B and B signs A (neither is the CA); the leaf is A's.
    let (key_a, key_b) = (
        rcgen::KeyPair::generate().unwrap(),
        rcgen::KeyPair::generate().unwrap(),
    );
    let (params_a, params_b) = (intermediate("A"), intermediate("B"));
    let cert_a = params_a
        .signed_by(&key_a, &rcgen::Issuer::from_params(&params_b, &key_b))
        .unwrap();
    let issuer_a = rcgen::Issuer::from_params(&params_a, &key_a);
    let cert_b = params_b.signed_by(&key_b, &issuer_a).unwrap();
    let looped = client_with_chain(
        ca.cert_pem(),
        &issuer_a,
        vec![cert_a.der().clone(), cert_b.der().clone()],
    );
    let out = handshake(&server, looped, "127.0.0.1").await;
    let err = out.server.expect_err("a looped chain was let in");
    assert!(!out.client_echo);
    eprintln!("refused: {err}");
    assert!(err.contains("UnknownIssuer"), "{err}");
}
