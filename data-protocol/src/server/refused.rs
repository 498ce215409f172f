//! Peers refused at the TLS handshake, so each address is logged once: a stranger retrying in a loop must not
//! flood the log, and the first refusal is what an operator needs to see.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::{Mutex, PoisonError};

/// Addresses remembered at most; past that a refusal is logged at debug level only (bounded memory against a
/// scan from many addresses).
const MAX_REMEMBERED: usize = 4096;

#[derive(Default)]
pub(crate) struct RefusedPeers {
    seen: Mutex<HashSet<IpAddr>>,
}

impl RefusedPeers {
    /// Logs a refused handshake: a warning the first time for `ip`, debug after.
    pub(crate) fn log(&self, ip: Option<IpAddr>, peer: &str, err: &std::io::Error) {
        let first = ip.is_some_and(|ip| {
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            seen.len() < MAX_REMEMBERED && seen.insert(ip)
        });
        if first {
            tracing::warn!(peer, error = %err, "TLS handshake refused; no data touched (logged once per peer address)");
        } else {
            tracing::debug!(peer, error = %err, "TLS handshake refused");
        }
    }
}
