//! A test cluster's certificates (issue 40): one CA and the `--tls-dir`s a test hands its daemons, plus the
//! clients a mutual-TLS endpoint must refuse (none at all, no certificate, another cluster's CA, expired) and a
//! server certificate for another address, which a client must refuse.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use corral_tls::rustls::pki_types::pem::PemObject;
use corral_tls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use corral_tls::rustls::{self, RootCertStore};
use corral_tls::{ClusterCa, LeafRequest, SubjectAltName, TlsDir};

/// Certificates under a test's directory, every leaf for 127.0.0.1 unless said otherwise.
pub struct TestPki {
    pub ca: ClusterCa,
    root: PathBuf,
}

impl TestPki {
    /// A fresh cluster CA; its `--tls-dir`s go under `root`.
    pub fn new(root: &Path) -> Self {
        TestPki {
            ca: ClusterCa::generate("cluster", 30).expect("generating a CA"),
            root: root.to_path_buf(),
        }
    }

    /// A valid `--tls-dir` named `name`, for 127.0.0.1.
    pub fn node(&self, name: &str) -> PathBuf {
        self.issue(&self.ca, name, &LeafRequest::new(name, ip("127.0.0.1"), 30))
    }

    /// A `--tls-dir` of this CA whose certificate names 10.9.9.9 only: a server with it dialled at 127.0.0.1 is
    /// not the one the client asked for.
    pub fn misnamed(&self) -> PathBuf {
        self.issue(
            &self.ca,
            "misnamed",
            &LeafRequest::new("misnamed", ip("10.9.9.9"), 30),
        )
    }

    /// A `--tls-dir` for 127.0.0.1 issued by another cluster's CA.
    pub fn stranger(&self) -> PathBuf {
        let other = ClusterCa::generate("another cluster", 30).expect("generating a CA");
        self.issue(
            &other,
            "stranger",
            &LeafRequest::new("stranger", ip("127.0.0.1"), 30),
        )
    }

    /// A `--tls-dir` of this CA whose certificate expired yesterday.
    pub fn expired(&self) -> PathBuf {
        let mut req = LeafRequest::new("expired", ip("127.0.0.1"), 30);
        req.not_before = time::OffsetDateTime::now_utc() - time::Duration::days(10);
        req.not_after = time::OffsetDateTime::now_utc() - time::Duration::days(1);
        self.issue(&self.ca, "expired", &req)
    }

    /// The client config of a `--tls-dir`.
    pub fn client(dir: &Path) -> Arc<rustls::ClientConfig> {
        Arc::new(
            TlsDir::load(dir)
                .and_then(|d| d.client_config())
                .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display())),
        )
    }

    /// A client that trusts this CA but presents no certificate.
    pub fn client_without_certificate(&self) -> Arc<rustls::ClientConfig> {
        let cfg = rustls::ClientConfig::builder_with_provider(corral_tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("TLS 1.3")
            .with_root_certificates(self.roots())
            .with_no_client_auth();
        Arc::new(cfg)
    }

    /// A client that trusts this CA (so it goes on with the handshake) but presents a certificate of another
    /// cluster's CA: the server's verifier must refuse it. (The `strangers()` entry with another CA's directory also
    /// trusts that CA, so its own verifier may give up on the server first.)
    pub fn client_of_another_cluster(&self) -> Arc<rustls::ClientConfig> {
        let dir = self.stranger();
        let read = |name: &str| std::fs::read(dir.join(name)).expect("the stranger's files");
        let chain = CertificateDer::pem_slice_iter(&read(corral_tls::CERT))
            .collect::<Result<Vec<_>, _>>()
            .expect("the stranger's certificate");
        let key = PrivateKeyDer::from_pem_slice(&read(corral_tls::KEY)).expect("the stranger's key");
        let cfg = rustls::ClientConfig::builder_with_provider(corral_tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("TLS 1.3")
            .with_root_certificates(self.roots())
            .with_client_auth_cert(chain, key)
            .expect("a client certificate");
        Arc::new(cfg)
    }

    fn roots(&self) -> RootCertStore {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(self.ca.cert_pem().as_bytes()) {
            roots.add(cert.expect("the CA's PEM")).expect("a CA certificate");
        }
        roots
    }

    /// Every client a mutual-TLS endpoint of this cluster must refuse at the handshake, named; `None` is plaintext.
    pub fn strangers(&self) -> Vec<(&'static str, Option<Arc<rustls::ClientConfig>>)> {
        vec![
            ("no TLS", None),
            ("no certificate", Some(self.client_without_certificate())),
            ("another cluster's CA", Some(Self::client(&self.stranger()))),
            ("an expired certificate", Some(Self::client(&self.expired()))),
        ]
    }

    fn issue(&self, ca: &ClusterCa, name: &str, req: &LeafRequest) -> PathBuf {
        let dir = self.root.join(name);
        ca.issue(req)
            .and_then(|c| c.write(&dir))
            .unwrap_or_else(|e| panic!("issuing {name}: {e}"));
        dir
    }
}

fn ip(addr: &str) -> Vec<SubjectAltName> {
    vec![SubjectAltName::Ip(addr.parse::<IpAddr>().expect("an IP"))]
}

/// `corral-tls nbd-client-dir --tls-dir NODE --out OUT`, as a user makes the certificate directory qemu
/// (`tls-creds-x509,dir=OUT`) and libnbd (`tls-certificates=OUT`) take; returns `out`.
///
/// # Panics
/// When `corral-tls` is missing or fails.
pub fn nbd_client_dir(node: &Path, out: &Path) -> PathBuf {
    let status = std::process::Command::new(crate::workspace_bin("corral-tls"))
        .args(["nbd-client-dir", "--tls-dir"])
        .arg(node)
        .arg("--out")
        .arg(out)
        .status()
        .expect("running corral-tls");
    assert!(status.success(), "corral-tls nbd-client-dir failed");
    out.to_owned()
}
