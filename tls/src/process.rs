//! The process's own TLS configs, installed once by `main` from its `--tls-dir`, so every endpoint the process
//! opens later (a sync receiver for a rebuild, a sender for an export, an HTTP download) takes them without each
//! call site carrying them: a new listener or client cannot be plaintext by forgetting to pass a config.

use std::sync::OnceLock;

use crate::TlsConfigs;

static PROCESS: OnceLock<TlsConfigs> = OnceLock::new();

/// Makes `configs` the process's TLS configs (see [`installed`]). Called once from `main`; a second call keeps the
/// first configs and returns `false`.
pub fn install(configs: TlsConfigs) -> bool {
    PROCESS.set(configs).is_ok()
}

/// The configs `main` installed, `None` in a process started without `--tls-dir` (plaintext).
pub fn installed() -> Option<&'static TlsConfigs> {
    PROCESS.get()
}
