//! The `corral-replica serve` daemon: opens (or creates) the replica, serves gRPC `ReplicaService`, the data
//! protocol and gRPC `SyncAgentService` each on its own address and, optionally, Prometheus metrics and `/healthz`
//! on theirs; once all are bound it writes the ready report (port 0 anywhere picks a free port) and reports the
//! data and sync listeners in every `ReplicaResponse`. On cancellation (SIGTERM) it stops accepting, finishes
//! in-flight IO, and closes the replica cleanly (`Dirty=false`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use corral_daemon::ready::ReadyReport;
use corral_proto::v1::{
    replica_backup_service_server::ReplicaBackupServiceServer, replica_service_server::ReplicaServiceServer,
    sync_agent_service_server::SyncAgentServiceServer,
};
use data_protocol::{BlockBackend, DataServer, ServerConfig};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::backup_service::ReplicaBackupGrpc;
use crate::host::ReplicaHost;
use crate::layout::DirLayout;
use crate::metrics::serve_metrics;
use crate::model::ServedEndpoints;
use crate::replica::{Replica, ReplicaOptions};
use crate::service::file_chain::FileChainReplica;
use crate::service::grpc::ReplicaGrpc;

/// Effective daemon configuration.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Replica directory.
    pub dir: PathBuf,
    /// gRPC `ReplicaService` address.
    pub listen: SocketAddr,
    /// Data-protocol address.
    pub data_listen: SocketAddr,
    /// Data protocol on a unix socket as well, for an engine on this node.
    pub data_unix: Option<PathBuf>,
    /// gRPC `SyncAgentService` (and backup) address.
    pub sync_listen: SocketAddr,
    /// Where to write the ready report (`corral_daemon::ready`).
    pub ready_file: Option<PathBuf>,
    /// Create the replica with this size when the directory holds none.
    pub size: Option<u64>,
    /// Backing file (raw image).
    pub backing_file: Option<PathBuf>,
    /// The backing image's name and SHA-512 as the control plane knows them.
    pub backing_image: Option<crate::backing::BackingImageId>,
    /// Disable the revision counter.
    pub disable_revision_counter: bool,
    /// Volume name (reported to clients).
    pub volume: String,
    /// Prometheus `/metrics` and `/healthz` address.
    pub metrics_listen: Option<SocketAddr>,
    /// Data-protocol server tuning.
    pub data: ServerConfig,
    /// Copy a clone's or rebuild's source files directly when the source replica is on this host.
    pub local_copy: bool,
    /// Fault-injection rules in force from the start.
    #[cfg(feature = "fault-injection")]
    pub faults: Vec<crate::fault::FaultRule>,
}

/// Raises the soft open-file limit to the hard limit: a replica keeps one descriptor per layer.
fn raise_nofile_limit() {
    if let Ok(l) = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .ok_or(())
        .and(Ok(rustix::process::getrlimit(rustix::process::Resource::Nofile)))
    {
        let new = rustix::process::Rlimit {
            current: l.maximum,
            maximum: l.maximum,
        };
        let _ = rustix::process::setrlimit(rustix::process::Resource::Nofile, new);
    }
}

/// Binds the data protocol's unix socket at `path`, replacing a socket file left by a process that died (a
/// SIGKILLed replica cannot remove its own); any other kind of file there is refused, not removed.
///
/// Access (issue 40): the data protocol on a unix socket is never wrapped in TLS. The socket is 0600
/// (`corral_daemon::unix::bind_private`, whatever the umask): only the replica's user (and root) can connect; the
/// directory it lives in (the manager's run directory) is the second fence. v1 `--data-unix` and v2
/// `--data-unix-dir` both bind here.
pub(crate) fn bind_unix(path: &std::path::Path) -> anyhow::Result<tokio::net::UnixListener> {
    let listener = corral_daemon::unix::bind_private(path).context("data socket")?;
    listener.set_nonblocking(true).context("data socket")?;
    Ok(tokio::net::UnixListener::from_std(listener)?)
}

/// Runs the daemon until `cancel`.
pub async fn serve(cfg: ServeConfig, cancel: CancellationToken) -> anyhow::Result<()> {
    raise_nofile_limit();
    info!(?cfg, "corral-replica starting");
    let opts = ReplicaOptions {
        backing_file: cfg.backing_file.clone(),
        disable_revision_counter: Some(cfg.disable_revision_counter),
        backing_image: cfg.backing_image.clone(),
    };
    let (dir, size, o) = (cfg.dir.clone(), cfg.size, opts.clone());
    let replica = tokio::task::spawn_blocking(move || -> anyhow::Result<Option<Replica>> {
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        match (DirLayout::load(&dir)?, size) {
            (None, Some(size)) => Ok(Some(Replica::create(&dir, size, &o)?)),
            (None, None) => Ok(None),
            (Some(l), Some(size)) if l.info.size != size => bail!(
                "{} holds a replica of {} bytes, not {size}: expand it through the engine instead",
                dir.display(),
                l.info.size
            ),
            (Some(_), _) => Ok(Some(Replica::open(&dir, &o)?)),
        }
    })
    .await??;
    if replica.is_none() {
        info!(dir = %cfg.dir.display(), "no replica in the directory yet: waiting for ReplicaCreate");
    }
    let host = Arc::new(ReplicaHost::new(
        cfg.dir.clone(),
        cfg.volume.clone(),
        opts,
        replica,
    ));
    #[cfg(feature = "fault-injection")]
    for rule in &cfg.faults {
        host.faults().set(*rule);
    }

    let control = TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("bind {}", cfg.listen))?;
    let data = TcpListener::bind(cfg.data_listen)
        .await
        .with_context(|| format!("bind data address {}", cfg.data_listen))?;
    let sync = TcpListener::bind(cfg.sync_listen)
        .await
        .with_context(|| format!("bind sync-agent address {}", cfg.sync_listen))?;
    let data_unix = match &cfg.data_unix {
        Some(path) => Some((bind_unix(path)?, path.clone())),
        None => None,
    };
    let served = ServedEndpoints {
        data: data.local_addr()?,
        sync: sync.local_addr()?,
        data_unix: data_unix.as_ref().map(|(_, p)| p.clone()),
    };
    let mut ready = ReadyReport::new()
        .tcp("control", control.local_addr()?)
        .tcp("data", served.data)
        .tcp("sync", served.sync);
    if let Some((_, path)) = &data_unix {
        ready = ready.unix("data-unix", path);
    }

    let data_server = DataServer::new(host.clone() as Arc<dyn BlockBackend>, cfg.data.clone())?;
    let data_metrics = data_server.metrics();
    let served_replica = FileChainReplica::new(host.clone(), cfg.listen.ip(), cancel.clone())
        .with_local_copy(cfg.local_copy)
        .with_foreground_io(data_metrics.clone());
    let grpc = ReplicaGrpc::new(Arc::new(served_replica), served);
    let data_server = Arc::new(data_server);

    let mut tasks = tokio::task::JoinSet::new();
    let c = cancel.clone();
    // Every call is checked against the engine generation this replica accepted (docs/formats.md, "Engine
    // generation"): a lower one is refused, and a mutating call without one once there is one.
    let h = host.clone();
    let fence = corral_proto::engine_generation::FenceLayer::new(move || {
        BlockBackend::generation(h.as_ref()).map_err(|e| e.message)
    });
    let svc = ReplicaServiceServer::new(grpc.clone());
    let tls = cfg.data.tls.clone();
    let layer = fence.clone();
    tasks.spawn(async move {
        tonic::transport::Server::builder()
            .layer(layer)
            .add_service(svc)
            .serve_with_incoming_shutdown(corral_proto::grpc::incoming(control, tls)?, c.cancelled())
            .await
            .context("ReplicaService")
    });
    let c = cancel.clone();
    let svc = SyncAgentServiceServer::new(grpc);
    let backup_svc = ReplicaBackupServiceServer::new(ReplicaBackupGrpc::new(host.clone()));
    let tls = cfg.data.tls.clone();
    tasks.spawn(async move {
        tonic::transport::Server::builder()
            .layer(fence)
            .add_service(svc)
            .add_service(backup_svc)
            .serve_with_incoming_shutdown(corral_proto::grpc::incoming(sync, tls)?, c.cancelled())
            .await
            .context("SyncAgentService")
    });
    if let Some(addr) = cfg.metrics_listen {
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("bind metrics {addr}"))?;
        ready = ready.tcp("metrics", listener.local_addr()?);
        let (h, m, c) = (host.clone(), data_metrics, cancel.clone());
        tasks.spawn(async move { serve_metrics(listener, h, m, c).await });
    }
    ready.announce(cfg.ready_file.as_deref())?;
    if let Some((listener, path)) = data_unix {
        let (s, c) = (data_server.clone(), cancel.clone());
        tasks.spawn(async move {
            s.serve_unix(listener, c).await;
            // Nothing listens there any more: a client must not find a socket that refuses it.
            let _ = std::fs::remove_file(&path);
            Ok(())
        });
    }
    data_server.serve_tcp(data, cancel.clone()).await;
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    if let Ok(s) = Arc::try_unwrap(data_server) {
        s.shutdown().await;
    }
    let h = host.clone();
    tokio::task::spawn_blocking(move || h.close()).await??;
    info!(dir = %cfg.dir.display(), "corral-replica stopped; replica closed cleanly");
    Ok(())
}
