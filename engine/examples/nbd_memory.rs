//! Serves an in-memory export over NBD, for trying clients and measuring the frontend alone.
//!
//! `cargo run -p engine --example nbd_memory -- SIZE_MIB unix:PATH|tcp:HOST:PORT|tls:HOST:PORT...`
//!
//! `tls:` listeners serve the same device TLS-only (NBD_OPT_STARTTLS) with the server config of the `--tls-dir` in
//! `CORRAL_TLS_DIR`, as the engine does: TLS and plaintext NBD side by side, for measuring what TLS costs.

use std::sync::Arc;

use engine::nbd::{MemoryDevice, NbdConfig, NbdServer};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let mut args = std::env::args().skip(1);
    let size_mib: u64 = args.next().unwrap_or_else(|| "64".into()).parse()?;
    let device = Arc::new(MemoryDevice::new(size_mib << 20));
    let config = NbdConfig {
        export_name: "mem".into(),
        description: "in-memory export".into(),
        ..NbdConfig::default()
    };
    let tls = corral_tls::TlsDirArg {
        tls_dir: std::env::var_os(corral_tls::TLS_DIR_ENV).map(Into::into),
    }
    .load()?;
    let tls_server = tls.map(|t| {
        let config = NbdConfig {
            tls: Some(t.server),
            ..config.clone()
        };
        NbdServer::new(device.clone(), config)
    });
    let server = NbdServer::new(device, config);
    let cancel = CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    for listen in args {
        let (s, c) = (server.clone(), cancel.clone());
        if let Some(path) = listen.strip_prefix("unix:") {
            let _ = std::fs::remove_file(path);
            let l = UnixListener::bind(path)?;
            tasks.spawn(async move { s.serve_unix(l, c).await });
        } else if let Some(addr) = listen.strip_prefix("tcp:") {
            let l = TcpListener::bind(addr).await?;
            tasks.spawn(async move { s.serve_tcp(l, c).await });
        } else if let Some(addr) = listen.strip_prefix("tls:") {
            let Some(s) = tls_server.clone() else {
                anyhow::bail!("{listen}: set {} to a --tls-dir", corral_tls::TLS_DIR_ENV);
            };
            let l = TcpListener::bind(addr).await?;
            tasks.spawn(async move { s.serve_tcp(l, c).await });
        } else {
            anyhow::bail!("listen address must be unix:PATH, tcp:HOST:PORT or tls:HOST:PORT, got {listen}");
        }
    }
    tokio::signal::ctrl_c().await?;
    cancel.cancel();
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}
