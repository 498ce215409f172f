//! Serves the CSI services on a unix socket until cancelled.

use std::path::{Path, PathBuf};

use tokio_util::sync::CancellationToken;

use crate::controller::ControllerService;
use crate::error::{CsiError, CsiResult};
use crate::identity::IdentityService;
use crate::in_flight::InFlight;
use crate::manager_api::ManagerApi;
use crate::node::NodeService;
use crate::node::staging::StateDir;
use crate::proto::controller_server::ControllerServer;
use crate::proto::identity_server::IdentityServer;
use crate::proto::node_server::NodeServer;

/// Which services this process serves: a Kubernetes deployment runs the controller in a Deployment and the node
/// plugin in a DaemonSet; tests and single hosts run both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Controller,
    Node,
    All,
}

#[derive(Debug, Clone)]
pub struct PluginConfig {
    /// `unix:///path/csi.sock` or a plain path.
    pub endpoint: String,
    pub manager_url: String,
    /// The file holding the manager API token the plugin presents (a mounted Secret); None: no token.
    pub token_file: Option<PathBuf>,
    pub node_id: String,
    pub state_dir: PathBuf,
    pub mode: Mode,
    /// How long CreateSnapshot of a backup waits for it to end before answering `ready_to_use: false`.
    pub backup_wait: std::time::Duration,
}

/// The socket path of a CSI endpoint.
pub fn socket_path(endpoint: &str) -> CsiResult<PathBuf> {
    let p = endpoint.strip_prefix("unix://").unwrap_or(endpoint);
    if !p.starts_with('/') {
        return Err(CsiError::InvalidArgument(format!(
            "endpoint {endpoint:?} is not unix:///ABSOLUTE/PATH"
        )));
    }
    Ok(PathBuf::from(p))
}

fn bind(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // Access (issue 40): no TLS on the CSI socket; it is 0600 (`bind_private`, whatever the umask), so only the
    // plugin's user (root, as kubelet runs it) can connect; kubelet reaches it through its plugin directory. A
    // socket left by a previous run is replaced; any other file there is refused.
    let listener = corral_daemon::unix::bind_private(path)?;
    listener.set_nonblocking(true)?;
    Ok(tokio::net::UnixListener::from_std(listener)?)
}

pub async fn serve(cfg: PluginConfig, cancel: CancellationToken) -> anyhow::Result<()> {
    let path = socket_path(&cfg.endpoint)?;
    let token = match &cfg.token_file {
        Some(f) => Some(corral_api::token::read_token_file(f)?),
        None => None,
    };
    let manager = ManagerApi::new(&cfg.manager_url, token);
    let controller = matches!(cfg.mode, Mode::Controller | Mode::All);
    let node = matches!(cfg.mode, Mode::Node | Mode::All);
    let identity = IdentityServer::new(IdentityService {
        manager: manager.clone(),
        controller,
    });
    let controller = controller.then(|| {
        ControllerServer::new(ControllerService {
            manager: manager.clone(),
            in_flight: InFlight::default(),
            backup_wait: cfg.backup_wait,
        })
    });
    let node = if node {
        if cfg.node_id.is_empty() {
            anyhow::bail!("--node-id is required for the node service");
        }
        let state = StateDir::open(&cfg.state_dir)?;
        let svc = NodeService::new(cfg.node_id.clone(), manager.clone(), state);
        let n = svc.recover().await?;
        tracing::info!(staged = n, state_dir = %cfg.state_dir.display(), "node state read");
        Some(NodeServer::new(svc))
    } else {
        None
    };
    let listener = bind(&path)?;
    tracing::info!(socket = %path.display(), "serving CSI");
    tonic::transport::Server::builder()
        .add_service(identity)
        .add_optional_service(controller)
        .add_optional_service(node)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            cancel.cancelled_owned(),
        )
        .await?;
    let _ = std::fs::remove_file(&path);
    Ok(())
}
