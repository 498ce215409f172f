//! The ready report: once every listener of a daemon is bound and it serves, it tells whoever started it which
//! addresses it got, so a caller can ask for port 0 everywhere instead of probing for free ports (which races with
//! every other process on the machine). The report is one `ready` log line and, with `--ready-file PATH`, a JSON
//! file written atomically (temp + rename), so a reader polling for the file never sees half of it:
//!
//! ```json
//! {"pid": 4242, "listen": {"control": "127.0.0.1:40123", "data": "127.0.0.1:40124"}}
//! ```
//!
//! An address is `HOST:PORT` for TCP and `unix:/PATH` for a unix socket; names are lower-case (see
//! `docs/formats.md` for each daemon's names).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

/// `--ready-file PATH`: the flag every daemon takes (no environment fallback on purpose: the manager's children
/// inherit its environment and must not overwrite its report).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ReadyFileArg {
    /// Once every listener is bound and the daemon serves, write {"pid":…,"listen":{NAME:ADDR,…}} to this file
    /// (atomically: temp + rename). Ask for port 0 and read the bound ports here.
    #[arg(long, global = true, value_name = "PATH")]
    pub ready_file: Option<PathBuf>,
}

/// Set once this process announced itself ready (`/readyz` answers 200 from then on).
static ANNOUNCED: AtomicBool = AtomicBool::new(false);

/// Whether this process announced itself ready ([`ReadyReport::announce`]).
pub fn announced() -> bool {
    ANNOUNCED.load(Ordering::Acquire)
}

/// What a daemon reports when it is ready: its pid and the address of each named listener.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadyReport {
    pub pid: u32,
    pub listen: BTreeMap<String, String>,
}

/// A failure to write the ready file.
#[derive(Debug, thiserror::Error)]
#[error("writing the ready file {}: {source}", path.display())]
pub struct ReadyError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

impl Default for ReadyReport {
    fn default() -> Self {
        Self::new()
    }
}

impl ReadyReport {
    /// A report of this process with no listener yet.
    pub fn new() -> Self {
        Self {
            pid: std::process::id(),
            listen: BTreeMap::new(),
        }
    }

    /// Adds a TCP listener (`HOST:PORT`, the address actually bound).
    pub fn tcp(mut self, name: &str, addr: SocketAddr) -> Self {
        self.listen.insert(name.to_owned(), addr.to_string());
        self
    }

    /// Adds a unix-socket listener (`unix:/PATH`).
    pub fn unix(mut self, name: &str, path: &Path) -> Self {
        self.listen
            .insert(name.to_owned(), format!("unix:{}", path.display()));
        self
    }

    /// The TCP address of listener `name`, when it is one.
    pub fn tcp_addr(&self, name: &str) -> Option<SocketAddr> {
        self.listen.get(name)?.parse().ok()
    }

    /// Logs the `ready` line and, when `file` is given, writes the report there atomically.
    pub fn announce(&self, file: Option<&Path>) -> Result<(), ReadyError> {
        let listen = serde_json::to_string(&self.listen).unwrap_or_default();
        tracing::info!(pid = self.pid, listen = %listen, "ready");
        let Some(path) = file else {
            ANNOUNCED.store(true, Ordering::Release);
            return Ok(());
        };
        let bytes = serde_json::to_vec(self).map_err(|e| ReadyError {
            path: path.to_owned(),
            source: std::io::Error::other(e),
        })?;
        corral_disk::durable::write_atomic(path, &bytes).map_err(|source| ReadyError {
            path: path.to_owned(),
            source,
        })?;
        ANNOUNCED.store(true, Ordering::Release);
        Ok(())
    }

    /// Reads a ready file (for whoever started the daemon).
    pub fn read(path: &Path) -> std::io::Result<Self> {
        let bytes = std::fs::read(path)?;
        serde_json::from_slice(&bytes).map_err(std::io::Error::other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_file_holds_pid_and_named_addresses() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ready.json");
        ReadyReport::new()
            .tcp("control", "127.0.0.1:40123".parse().unwrap())
            .unix("nbd-unix", Path::new("/run/v.sock"))
            .announce(Some(&path))
            .unwrap();
        let raw: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(raw["pid"], std::process::id());
        assert_eq!(raw["listen"]["control"], "127.0.0.1:40123");
        assert_eq!(raw["listen"]["nbd-unix"], "unix:/run/v.sock");
        let back = ReadyReport::read(&path).unwrap();
        assert_eq!(back.tcp_addr("control"), Some("127.0.0.1:40123".parse().unwrap()));
        assert_eq!(back.tcp_addr("nbd-unix"), None);
        assert!(!dir.path().join("ready.json.tmp").exists());
    }

    #[test]
    fn unwritable_ready_file_is_an_error_naming_it() {
        let err = ReadyReport::new()
            .announce(Some(Path::new("/nonexistent-dir/ready.json")))
            .unwrap_err();
        assert!(err.to_string().contains("/nonexistent-dir/ready.json"), "{err}");
    }
}
