//! Corral's mutual-TLS boundary, shared by every daemon that listens or dials over TCP.
//!
//! This crate owns the cluster CA (an ECDSA P-256 key and a self-signed certificate, [`ClusterCa`]), the node
//! certificates it issues (one leaf per node or daemon, valid for both server and client authentication, with the
//! node's DNS names and IPs as subject alternative names, [`LeafRequest`]), the files of a `--tls-dir`
//! ([`CA_CERT`], [`CERT`], [`KEY`], written crash-safely with the key at mode 0600) and the rustls configs a daemon
//! builds from them ([`TlsDir`]): a server that requires a client certificate signed by the cluster CA, and a
//! client that presents its leaf and verifies the server's certificate and name against the same CA. Every config
//! names the `ring` provider explicitly (no process-wide default, no C toolchain) and speaks TLS 1.3 only.
//! [`TcpIncoming`] is the one way a server accepts TCP connections under these configs (a handshake per
//! connection in its own task with a deadline, refused peers logged once each).
//! Where the certificates come from (the manager's store, an operator running `corral-tls`) and which endpoints use
//! them (data protocol, gRPC) live elsewhere.

mod accept;
mod arg;
mod ca;
mod dir;
mod error;
mod process;
mod renew;

pub use accept::{HANDSHAKE_TIMEOUT, RefusedPeers, ServerStream, TcpIncoming, TlsServerStream, handshake};
pub use arg::{TLS_DIR_ENV, TlsConfigs, TlsDirArg};
pub use ca::{CA_DAYS, ClusterCa, LEAF_DAYS, LeafRequest, NodeCert, SubjectAltName};
pub use dir::{CA_CERT, CA_KEY, CERT, KEY, NBD_CLIENT_FILES, TlsDir};
pub use error::TlsError;
pub use process::{install, installed};

/// Re-exported so users build and name configs with the same rustls this crate links.
pub use rustls;

/// The crypto provider of every Corral TLS config: `ring`, named explicitly because another provider
/// (aws-lc-rs) is also compiled into the workspace and rustls then has no process default.
pub fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}
