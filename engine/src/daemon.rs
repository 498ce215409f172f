//! `corral-engine serve`: start the volume over its replicas, bring the NBD frontend up, serve
//! `ControllerService` and Prometheus metrics, watch replica connections, and shut down cleanly on SIGTERM
//! (frontend first, so no client sees an error for IO it sent before).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use corral_proto::v1::controller_service_server::ControllerServiceServer;
use data_protocol::ClientConfig;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::info;

use corral_daemon::ready::ReadyReport;

use crate::frontend::{Frontend, NbdListen};
use crate::nbd::NbdConfig;
use crate::rebuild::RebuildTracker;
use crate::service::EngineGrpc;
use crate::start::{StartOptions, start};

/// Effective configuration of `corral-engine serve`.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Volume name.
    pub volume: String,
    /// Volume size.
    pub size: u64,
    /// gRPC address.
    pub listen: SocketAddr,
    /// The replicas (`tcp://HOST:PORT?data=PORT&sync=PORT`).
    pub replicas: Vec<corral_proto::ReplicaAddress>,
    /// NBD listeners.
    pub nbd: Vec<NbdListen>,
    /// Revision counter disabled.
    pub disable_revision_counter: bool,
    /// Salvage at start (counter disabled).
    pub salvage_requested: bool,
    /// Per-request deadline towards replicas.
    pub replica_timeout: Duration,
    /// Data connections to each replica.
    pub replica_connections: usize,
    /// This engine start's generation (0: none), presented in every data connection's Hello.
    pub generation: u64,
    /// Prometheus `/metrics` and `/healthz`.
    pub metrics_listen: Option<SocketAddr>,
    /// Where to write the ready report (`corral_daemon::ready`).
    pub ready_file: Option<std::path::PathBuf>,
    /// Rate of rebuilds whose request names none.
    pub rebuild_rate: crate::rebuild::RebuildRate,
    /// Mutual TLS (`--tls-dir`; `None`: plaintext): the ControllerService's server, the client towards replicas
    /// (data protocol; gRPC and sparse-sync through the process's configs, `corral_tls::install`).
    pub tls: Option<corral_tls::TlsConfigs>,
}

/// Runs the engine until `cancel`.
pub async fn serve(cfg: ServeConfig, cancel: CancellationToken) -> anyhow::Result<()> {
    info!(?cfg, "corral-engine starting");
    // Replica data connections and NBD sessions share one thread (crate::io_runtime); control stays here.
    let io_runtime = crate::io_runtime::handle().context("start the data path's thread")?;
    let client = ClientConfig {
        request_timeout: cfg.replica_timeout,
        connections: cfg.replica_connections,
        generation: cfg.generation,
        runtime: Some(io_runtime.clone()),
        tls: cfg.tls.as_ref().map(|t| t.client.clone()),
        ..ClientConfig::default()
    };
    let opts = StartOptions {
        name: cfg.volume.clone(),
        size: cfg.size,
        disable_revision_counter: cfg.disable_revision_counter,
        salvage_requested: cfg.salvage_requested,
        client: client.clone(),
    };
    let volume = Arc::new(start(&cfg.replicas, &opts).await.context("start volume")?);
    let frontend = Arc::new(
        Frontend::new(
            volume.clone(),
            cfg.nbd.clone(),
            NbdConfig {
                export_name: cfg.volume.clone(),
                description: format!("Corral volume {}", cfg.volume),
                // With --tls-dir the TCP NBD listener is TLS-only, under the process's one server config.
                tls: cfg.tls.as_ref().map(|t| t.server.clone()),
                ..NbdConfig::default()
            },
        )
        .on_runtime(io_runtime),
    );
    let listener = TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("bind {}", cfg.listen))?;
    let mut ready = ReadyReport::new().tcp("control", listener.local_addr()?);
    if !cfg.nbd.is_empty() {
        frontend.start().await.context("start NBD frontend")?;
    }
    for l in frontend.listeners() {
        ready = match l {
            NbdListen::Tcp(a) => ready.tcp("nbd", a.parse().context("bound NBD address")?),
            NbdListen::Unix(p) => ready.unix("nbd-unix", &p),
        };
    }
    let grpc = EngineGrpc {
        volume: volume.clone(),
        frontend: frontend.clone(),
        client,
        rebuilds: Arc::new(RebuildTracker::new(cfg.rebuild_rate)),
    };

    let mut tasks = tokio::task::JoinSet::new();
    let (c, tls) = (cancel.clone(), cfg.tls.as_ref().map(|t| t.server.clone()));
    tasks.spawn(async move {
        tonic::transport::Server::builder()
            .add_service(ControllerServiceServer::new(grpc))
            .serve_with_incoming_shutdown(corral_proto::grpc::incoming(listener, tls)?, c.cancelled())
            .await
            .context("ControllerService")
    });
    if let Some(addr) = cfg.metrics_listen {
        let l = TcpListener::bind(addr)
            .await
            .with_context(|| format!("bind metrics {addr}"))?;
        ready = ready.tcp("metrics", l.local_addr()?);
        let (v, c) = (volume.clone(), cancel.clone());
        tasks.spawn(async move { crate::metrics_http::serve(l, v, c).await });
    }
    let (v, c) = (volume.clone(), cancel.clone());
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                () = c.cancelled() => return Ok(()),
                _ = tick.tick() => v.check_connections().await,
            }
        }
    });
    info!(volume = %cfg.volume, "corral-engine serving");
    ready.announce(cfg.ready_file.as_deref())?;
    cancel.cancelled().await;
    frontend.stop().await;
    let _ = volume.flush().await;
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    info!(volume = %cfg.volume, "corral-engine stopped");
    Ok(())
}
