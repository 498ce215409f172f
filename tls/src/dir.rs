//! The files of a TLS directory and the rustls configs built from them.
//!
//! A node's `--tls-dir` holds [`CA_CERT`] (the cluster CA it trusts), [`CERT`] (its certificate, optionally
//! followed by intermediates) and [`KEY`] (its private key, mode 0600). A CA directory holds [`CA_CERT`] and
//! [`CA_KEY`] (mode 0600).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::error::TlsError;

/// The cluster CA certificate every node trusts.
pub const CA_CERT: &str = "ca.crt";
/// The cluster CA's private key (only in the CA's own directory).
pub const CA_KEY: &str = "ca.key";
/// A node's certificate chain, leaf first.
pub const CERT: &str = "tls.crt";
/// A node's private key.
pub const KEY: &str = "tls.key";

/// The files of an NBD client's certificate directory (GnuTLS naming, what qemu's `tls-creds-x509,endpoint=client`
/// and libnbd's `tls-certificates=DIR` read), each with the `--tls-dir` file it is.
pub const NBD_CLIENT_FILES: [(&str, &str); 3] = [
    ("ca-cert.pem", CA_CERT),
    ("client-cert.pem", CERT),
    ("client-key.pem", KEY),
];

/// Who may read a file written here.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mode {
    /// Certificates: 0644.
    Public,
    /// Private keys: 0600, owner only.
    Secret,
}

pub(crate) fn create(dir: &Path) -> Result<(), TlsError> {
    std::fs::create_dir_all(dir).map_err(|source| TlsError::Write {
        path: dir.to_owned(),
        source,
    })
}

/// Replaces `path` crash-safely with the given mode (set before any byte is written).
pub(crate) fn write(path: &Path, bytes: &[u8], mode: Mode) -> Result<(), TlsError> {
    let mode = match mode {
        Mode::Public => 0o644,
        Mode::Secret => 0o600,
    };
    corral_disk::durable::write_atomic_mode(path, bytes, mode).map_err(|source| TlsError::Write {
        path: path.to_owned(),
        source,
    })
}

pub(crate) fn read_text(path: &Path) -> Result<String, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })?;
    String::from_utf8(bytes).map_err(|_| TlsError::Garbled {
        path: path.to_owned(),
        what: "file",
        reason: "not text".to_owned(),
    })
}

/// Every certificate in a PEM file (at least one).
pub(crate) fn parse_certs(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let garbled = |reason: String| TlsError::Garbled {
        path: path.to_owned(),
        what: "certificate",
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| garbled(e.to_string()))?;
    if certs.is_empty() {
        return Err(garbled("no CERTIFICATE block".to_owned()));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, SEC1 or PKCS#1).
pub(crate) fn parse_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| TlsError::Garbled {
        path: path.to_owned(),
        what: "private key",
        reason: e.to_string(),
    })
}

/// Checks that `key` is the key of the first certificate of `chain`.
pub(crate) fn check_key_matches(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    cert_path: &Path,
    key_path: &Path,
) -> Result<(), TlsError> {
    let provider = crate::provider();
    let signing_key = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| TlsError::Unusable {
            path: key_path.to_owned(),
            reason: format!("unsupported private key: {e}"),
        })?;
    match CertifiedKey::new(chain, signing_key).keys_match() {
        Ok(()) => Ok(()),
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
            Err(TlsError::KeyMismatch {
                key: key_path.to_owned(),
                cert: cert_path.to_owned(),
            })
        }
        Err(e) => Err(TlsError::Unusable {
            path: cert_path.to_owned(),
            reason: e.to_string(),
        }),
    }
}

/// A node's TLS directory, loaded and checked: the CA it trusts, its certificate chain and key.
pub struct TlsDir {
    path: PathBuf,
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl std::fmt::Debug for TlsDir {
    // Never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsDir")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl TlsDir {
    /// Reads `ca.crt`, `tls.crt` and `tls.key` from `dir`: each must be there, readable and PEM, the CA usable
    /// as a trust anchor, and the key the certificate's.
    pub fn load(dir: &Path) -> Result<Self, TlsError> {
        let (ca_path, cert_path, key_path) = (dir.join(CA_CERT), dir.join(CERT), dir.join(KEY));
        let ca = parse_certs(&ca_path, read_text(&ca_path)?.as_bytes())?;
        let chain = parse_certs(&cert_path, read_text(&cert_path)?.as_bytes())?;
        let key = parse_key(&key_path, read_text(&key_path)?.as_bytes())?;
        let mut roots = RootCertStore::empty();
        for cert in ca {
            roots.add(cert).map_err(|e| TlsError::Unusable {
                path: ca_path.clone(),
                reason: format!("not usable as a trust anchor: {e}"),
            })?;
        }
        check_key_matches(chain.clone(), key.clone_key(), &cert_path, &key_path)?;
        Ok(Self {
            path: dir.to_owned(),
            roots: Arc::new(roots),
            chain,
            key,
        })
    }

    /// The directory this was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A server config that presents this node's certificate and REQUIRES a client certificate issued by the
    /// cluster CA (refused at the handshake otherwise). TLS 1.3 only; no session tickets (every connection is
    /// authenticated afresh, and no post-handshake message is sent on the server's own).
    pub fn server_config(&self) -> Result<ServerConfig, TlsError> {
        let provider = crate::provider();
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider.clone())
            .build()
            .map_err(|e| self.unusable(CA_CERT, &e))?;
        let mut cfg = ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| self.unusable(CA_CERT, &e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| self.unusable(CERT, &e))?;
        cfg.send_tls13_tickets = 0;
        Ok(cfg)
    }

    /// A client config that presents this node's certificate and accepts only a server whose certificate the
    /// cluster CA issued for the name dialled. TLS 1.3 only.
    pub fn client_config(&self) -> Result<ClientConfig, TlsError> {
        let provider = crate::provider();
        let verifier = WebPkiServerVerifier::builder_with_provider(self.roots.clone(), provider.clone())
            .build()
            .map_err(|e| self.unusable(CA_CERT, &e))?;
        ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| self.unusable(CA_CERT, &e))?
            .with_webpki_verifier(verifier)
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| self.unusable(CERT, &e))
    }

    /// Makes `out` the certificate directory of an NBD client (qemu, libnbd) presenting this node's certificate:
    /// [`NBD_CLIENT_FILES`] as symlinks to this directory's files (absolute), so a certificate re-issued here is
    /// what the client reads next; the key stays in one file (mode 0600). Each link replaces its name atomically.
    pub fn link_nbd_client_dir(&self, out: &Path) -> Result<(), TlsError> {
        let here = std::fs::canonicalize(&self.path).map_err(|source| TlsError::Read {
            path: self.path.clone(),
            source,
        })?;
        create(out)?;
        let write_err = |path: &Path, source| TlsError::Write {
            path: path.to_owned(),
            source,
        };
        for (name, file) in NBD_CLIENT_FILES {
            let link = out.join(name);
            let tmp = corral_disk::durable::temp_path(&link);
            match std::fs::remove_file(&tmp) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(write_err(&tmp, e)),
            }
            std::os::unix::fs::symlink(here.join(file), &tmp).map_err(|e| write_err(&tmp, e))?;
            std::fs::rename(&tmp, &link).map_err(|e| write_err(&link, e))?;
        }
        corral_disk::durable::sync_dir(out).map_err(|e| write_err(out, e))
    }

    fn unusable(&self, file: &str, e: &dyn std::fmt::Display) -> TlsError {
        TlsError::Unusable {
            path: self.path.join(file),
            reason: e.to_string(),
        }
    }
}
