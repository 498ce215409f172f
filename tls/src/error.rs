//! What can go wrong with certificates and a TLS directory; every variant names the file it is about.

use std::io;
use std::path::PathBuf;

/// An error of the TLS boundary. The message names the file and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read (missing, unreadable).
    #[error("{}: cannot read: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    /// A file or directory could not be written.
    #[error("{}: cannot write: {source}", path.display())]
    Write { path: PathBuf, source: io::Error },
    /// A file holds no usable PEM of the expected kind.
    #[error("{}: not a PEM {what}: {reason}", path.display())]
    Garbled {
        path: PathBuf,
        what: &'static str,
        reason: String,
    },
    /// The private key is not the one the certificate was issued for.
    #[error("{}: the private key does not match the certificate in {}", key.display(), cert.display())]
    KeyMismatch { key: PathBuf, cert: PathBuf },
    /// A certificate or key parsed but cannot be used (not a CA, unsupported key type, ...).
    #[error("{}: {reason}", path.display())]
    Unusable { path: PathBuf, reason: String },
    /// Refusing to replace an existing cluster CA (every certificate it issued would stop working).
    #[error("{}: a cluster CA is already there; refusing to replace it", path.display())]
    CaExists { path: PathBuf },
    /// A subject alternative name that is neither an IP address nor a valid DNS name.
    #[error("subject alternative name {name:?}: {reason}")]
    BadName { name: String, reason: String },
    /// The system random number generator failed.
    #[error("the system random number generator failed")]
    Random,
    /// Certificate generation failed.
    #[error("certificate generation: {0}")]
    Generate(#[from] rcgen::Error),
}
