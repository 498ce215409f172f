//! `corral-bim serve`: opens the manager on its disk, then serves gRPC and HTTP until cancelled.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use corral_proto::v1::backing_image_manager_service_server::BackingImageManagerServiceServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::error::BimError;
use crate::grpc::BimService;
use crate::manager::{Manager, ManagerConfig};
use crate::ports::PortRange;

/// Settings of `serve`.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub listen: SocketAddr,
    pub http_listen: SocketAddr,
    pub disk_path: PathBuf,
    pub disk_uuid: String,
    pub port_range: PortRange,
    /// Host others reach this manager at; default: the listen IP (127.0.0.1 when that is unspecified).
    pub advertise_host: Option<String>,
    pub check_interval: Duration,
    pub sync_idle_timeout: Duration,
    pub send_max_rate: Option<u64>,
    /// Where to write the ready report (`corral_daemon::ready`).
    pub ready_file: Option<PathBuf>,
    /// Mutual TLS (`--tls-dir`; `None`: plaintext): the gRPC server here, the gRPC clients through the process's
    /// configs (`corral_tls::install`).
    pub tls: Option<corral_tls::TlsConfigs>,
}

/// Serves until `cancel`; fails at start when the disk is not the expected one or an address is taken.
pub async fn serve(cfg: ServeConfig, cancel: CancellationToken) -> Result<(), BimError> {
    let grpc = TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| BimError::Internal(format!("binding gRPC {}: {e}", cfg.listen)))?;
    let http = TcpListener::bind(cfg.http_listen)
        .await
        .map_err(|e| BimError::Internal(format!("binding HTTP {}: {e}", cfg.http_listen)))?;
    // Mutual TLS with the process's configs (`--tls-dir`): a peer without a cluster certificate never reaches a route.
    let http = corral_tls::TcpIncoming::new(http, corral_tls::installed().map(|t| t.server.clone()))
        .map_err(|e| BimError::Internal(format!("HTTP {}: {e}", cfg.http_listen)))?;
    let http_addr = http.local_addr();
    let grpc_addr = grpc.local_addr().map_err(|e| BimError::Internal(e.to_string()))?;
    let advertise_host = cfg.advertise_host.clone().unwrap_or_else(|| {
        let ip = if cfg.listen.ip().is_unspecified() {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        } else {
            cfg.listen.ip()
        };
        ip.to_string()
    });
    let mcfg = ManagerConfig {
        disk_path: cfg.disk_path.clone(),
        disk_uuid: cfg.disk_uuid.clone(),
        port_range: cfg.port_range,
        receiver_ip: cfg.listen.ip(),
        http_address: format!("{advertise_host}:{}", http_addr.port()),
        advertise_host,
        check_interval: cfg.check_interval,
        sync_idle_timeout: cfg.sync_idle_timeout,
        send_max_rate: cfg.send_max_rate,
    };
    let manager = Manager::open(mcfg, cancel.clone()).await?;
    // The first check runs before anything is served: a file modified while the daemon was down is unknown
    // (and being re-verified) by the time anyone asks.
    manager.check_once().await;
    info!(
        grpc = %grpc_addr,
        http = %http_addr,
        disk = %cfg.disk_path.display(),
        disk_uuid = %cfg.disk_uuid,
        port_range = %cfg.port_range,
        send_max_rate = ?cfg.send_max_rate,
        advertise = %manager.config().advertise_host,
        check_interval_ms = u64::try_from(cfg.check_interval.as_millis()).unwrap_or(u64::MAX),
        images = manager.list().images.len(),
        "corral-bim serving"
    );
    let checks = tokio::spawn(manager.clone().run_checks());
    let http_task = {
        let (app, c) = (crate::http::router(manager.clone()), cancel.clone());
        tokio::spawn(async move {
            axum::serve(http, app)
                .with_graceful_shutdown(async move { c.cancelled().await })
                .await
        })
    };
    // /metrics is served on the HTTP listener.
    corral_daemon::ready::ReadyReport::new()
        .tcp("grpc", grpc_addr)
        .tcp("http", http_addr)
        .tcp("metrics", http_addr)
        .announce(cfg.ready_file.as_deref())
        .map_err(|e| BimError::Internal(e.to_string()))?;
    let served = tonic::transport::Server::builder()
        .add_service(BackingImageManagerServiceServer::new(BimService::new(
            manager.clone(),
        )))
        .serve_with_incoming_shutdown(
            corral_proto::grpc::incoming(grpc, cfg.tls.as_ref().map(|t| t.server.clone()))
                .map_err(|e| BimError::Internal(e.to_string()))?,
            cancel.cancelled(),
        )
        .await;
    cancel.cancel();
    manager.tasks.close();
    manager.tasks.wait().await;
    let _ = checks.await;
    let _ = http_task.await;
    info!("corral-bim stopped");
    served.map_err(|e| BimError::Internal(format!("gRPC server: {e}")))
}
