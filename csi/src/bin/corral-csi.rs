//! `corral-csi`: Corral's CSI v1 plugin on a unix socket.

use std::path::PathBuf;

use clap::Parser;
use corral_csi::server::{Mode, PluginConfig, serve};

/// Corral's CSI plugin: Identity, Controller and Node services (CSI v1) on a unix socket, on top of a Corral
/// manager's REST API.
#[derive(Parser, Debug)]
#[command(name = "corral-csi", version)]
struct Args {
    /// The socket the CO connects to: unix:///ABSOLUTE/PATH.
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    endpoint: String,
    /// The Corral manager's REST address.
    #[arg(long, env = "CORRAL_MANAGER_URL", default_value = "http://127.0.0.1:9500")]
    manager_url: String,
    /// A file holding the manager API token to present (Kubernetes: a mounted Secret; an operator token is
    /// enough). Without it requests carry no token and the manager refuses them.
    #[arg(long, env = "CORRAL_TOKEN_FILE", value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// This node's name in Corral (the manager's --node-id); the node service reports it as its CSI node ID and
    /// as topology corral.io/node. Required unless --mode controller.
    #[arg(long, env = "CORRAL_NODE_ID", default_value = "")]
    node_id: String,
    /// Where the node service records what it staged (kept across restarts).
    #[arg(long, env = "CORRAL_CSI_STATE_DIR", default_value = "/var/lib/corral-csi")]
    state_dir: PathBuf,
    /// Which services to serve: controller (the Deployment), node (the DaemonSet) or all.
    #[arg(long, env = "CORRAL_CSI_MODE", value_enum, default_value = "all")]
    mode: Mode,
    /// Seconds CreateSnapshot of a backup (VolumeSnapshotClass type: backup) waits for the backup to end before
    /// answering ready_to_use=false; the CO repeats the call until it is true. Keep it below the
    /// external-snapshotter's --timeout (1 minute by default).
    #[arg(long, env = "CORRAL_CSI_BACKUP_WAIT", default_value_t = 30)]
    backup_wait: u64,
    #[command(flatten)]
    log: corral_daemon::cli::LogArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    a.log.init(corral_daemon::cli::RunKind::Daemon)?;
    tracing::info!(
        endpoint = %a.endpoint, manager = %a.manager_url, token_file = ?a.token_file, node_id = %a.node_id,
        state_dir = %a.state_dir.display(), mode = ?a.mode, backup_wait_s = a.backup_wait, "corral-csi starting"
    );
    let cancel = corral_daemon::shutdown_on_signal();
    serve(
        PluginConfig {
            endpoint: a.endpoint,
            manager_url: a.manager_url,
            token_file: a.token_file,
            node_id: a.node_id,
            state_dir: a.state_dir,
            mode: a.mode,
            backup_wait: std::time::Duration::from_secs(a.backup_wait),
        },
        cancel,
    )
    .await
}
