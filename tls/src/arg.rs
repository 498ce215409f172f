//! `--tls-dir`: the flag every daemon with TCP endpoints takes.

use std::path::PathBuf;
use std::sync::Arc;

use crate::{TlsDir, TlsError};

/// `--tls-dir DIR` (`CORRAL_TLS_DIR`), flattened into a binary's top-level clap parser (global: accepted after any
/// subcommand).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsDirArg {
    /// Mutual TLS: DIR holds ca.crt (the cluster CA), tls.crt and tls.key (this node's certificate and key;
    /// `corral-tls issue` makes them). Peers must present a certificate of the same CA, and the name dialled must
    /// be in the server's certificate. It covers every gRPC server and client of the process, the data protocol
    /// over TCP, sparse-sync, corral-bim's HTTP download, the data source's HTTP API and the engine's TCP NBD
    /// listener (STARTTLS). Absent: plaintext. Unix sockets are never wrapped.
    #[arg(long, global = true, env = "CORRAL_TLS_DIR", value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
}

/// The environment variable of `--tls-dir`: how a manager or instance manager hands its node's directory to every
/// daemon it starts.
pub const TLS_DIR_ENV: &str = "CORRAL_TLS_DIR";

/// A daemon's loaded TLS configs, built once at start and shared by every listener and client.
#[derive(Clone)]
pub struct TlsConfigs {
    /// Where they were loaded from.
    pub dir: PathBuf,
    pub server: Arc<rustls::ServerConfig>,
    pub client: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for TlsConfigs {
    // The directory only: a daemon logs its effective config, and the configs hold the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConfigs")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl TlsDirArg {
    /// [`load`](Self::load), and the configs become the process's ([`crate::install`]): what a daemon's `main`
    /// calls once.
    pub fn load_and_install(&self) -> Result<Option<TlsConfigs>, TlsError> {
        let configs = self.load()?;
        if let Some(c) = &configs {
            crate::install(c.clone());
        }
        Ok(configs)
    }

    /// Loads and checks the directory (`None` without `--tls-dir`): a missing, unreadable or garbled file, or a key
    /// that is not the certificate's, fails the daemon's start naming the file.
    pub fn load(&self) -> Result<Option<TlsConfigs>, TlsError> {
        let Some(dir) = &self.tls_dir else {
            return Ok(None);
        };
        let tls = TlsDir::load(dir)?;
        Ok(Some(TlsConfigs {
            dir: dir.clone(),
            server: Arc::new(tls.server_config()?),
            client: Arc::new(tls.client_config()?),
        }))
    }
}
