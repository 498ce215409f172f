//! `corral-replica serve-lvstore`: the v2 data engine's per-disk daemon. Opens the disk's lvstore (formats it
//! with `--format` when the device holds none), hosts every replica found in it and serves gRPC
//! `LvstoreService` on `--listen` to add, list and remove replicas. Each hosted replica gets its own control,
//! data and sync listeners on the daemon's host — its replica address, as a v1 replica's — and their ports are
//! recorded in the head lvol, so a restarted daemon serves each replica at the same address.
//! SIGTERM/SIGINT: stop accepting, finish in-flight IO, flush every replica.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use corral_daemon::ready::ReadyReport;
use corral_proto::ReplicaAddress;
use corral_proto::v1::{
    self, lvstore_service_server::LvstoreService, lvstore_service_server::LvstoreServiceServer,
    replica_backup_service_server::ReplicaBackupServiceServer, replica_service_server::ReplicaServiceServer,
    sync_agent_service_server::SyncAgentServiceServer,
};
use data_protocol::{BlockBackend, DataServer, ServerConfig};
use lvstore::{DataIo, FormatOptions, LvStore, OpenMode};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use super::backing_image::{BackingImages, SyncStaging};
use super::backup::V2Backup;
use super::lvol::{LvolReplica, check_replica_name, replicas_in};
use super::metrics::{MetricsTable, ReplicaIoLatency, ReplicaMetrics, TimedBackend};
use super::service::V2Replica;
use crate::backup_service::ReplicaBackupGrpc;
use crate::error::ReplicaError;
use crate::jobs::JobTable;
use crate::locks::lock;
use crate::model::ServedEndpoints;
use crate::service::grpc::ReplicaGrpc;

/// Configuration of `serve-lvstore`.
#[derive(Debug, Clone)]
pub struct LvstoreServeConfig {
    /// The disk: a block device or a preallocated file.
    pub disk: PathBuf,
    /// gRPC `LvstoreService` address; hosted replicas listen on its IP.
    pub listen: SocketAddr,
    /// Format the device when it holds no lvstore (never over an existing one).
    pub format: bool,
    /// Cluster size for `--format`.
    pub cluster_size: u64,
    pub ready_file: Option<PathBuf>,
    /// Data-protocol server settings of every hosted replica (`io_pool` is set from `io_threads`).
    pub data: ServerConfig,
    /// How the store's data IO reaches the disk (`O_DIRECT` or the page cache).
    pub data_io: DataIo,
    /// Threads of the disk's IO pool, shared by every hosted replica's data connections (0: none; each
    /// connection then runs its requests one at a time on its own thread).
    pub io_threads: usize,
    /// Replicas to host from the start (besides those the store holds), created on the engine's ReplicaCreate.
    pub replicas: Vec<String>,
    /// Prometheus `/metrics`, `/healthz` and `/readyz` address.
    pub metrics_listen: Option<SocketAddr>,
    /// Directory of the hosted replicas' data-protocol unix sockets (`NAME.data.sock`), beside their TCP data
    /// listeners; an engine on this node learns its replica's from `ReplicaGet` and connects there.
    pub data_unix_dir: Option<PathBuf>,
    /// Data bytes per second a backing-image exposure (a sync to another disk) sends at most.
    pub backing_image_send_rate: Option<u64>,
}

struct Hosted {
    host: Arc<V2Replica>,
    address: ReplicaAddress,
    cancel: CancellationToken,
    tasks: tokio::task::JoinSet<anyhow::Result<()>>,
}

/// The daemon's state: the store and the replicas it serves.
pub struct LvstoreDaemon {
    store: Arc<LvStore>,
    ip: IpAddr,
    /// Where a rebuild stages each received snapshot before writing it into the store.
    scratch: PathBuf,
    data: ServerConfig,
    cancel: CancellationToken,
    hosted: tokio::sync::Mutex<BTreeMap<String, Hosted>>,
    /// Replicas being stopped or started: refuses a concurrent add/remove of the same name.
    busy: Mutex<std::collections::BTreeSet<String>>,
    /// What `/metrics` reads of each hosted replica.
    metrics: MetricsTable,
    /// This disk's copies of v2 backing images.
    backing_images: Arc<BackingImages>,
    /// `--data-unix-dir`.
    data_unix_dir: Option<PathBuf>,
}

/// Where replica `name` serves the data protocol on a unix socket under `dir`; `None` (TCP only, with a warning)
/// when the path would not fit a socket address.
fn data_socket(dir: &std::path::Path, name: &str) -> Option<PathBuf> {
    // sockaddr_un.sun_path holds 108 bytes with the terminating NUL.
    const MAX_SOCKET_PATH: usize = 107;
    let sock = dir.join(format!("{name}.data.sock"));
    if sock.as_os_str().len() > MAX_SOCKET_PATH {
        warn!(replica = name, path = %sock.display(), "socket path too long: data protocol over TCP only");
        return None;
    }
    Some(sock)
}

async fn bind(ip: IpAddr, port: u16, name: &str, what: &str) -> anyhow::Result<TcpListener> {
    match TcpListener::bind(SocketAddr::new(ip, port)).await {
        Ok(l) => Ok(l),
        Err(e) if port != 0 => {
            warn!(replica = name, port, error = %e, "{what} port recorded for the replica is taken; picking a free one");
            Ok(TcpListener::bind(SocketAddr::new(ip, 0)).await?)
        }
        Err(e) => Err(e).with_context(|| format!("bind {what} listener of {name}")),
    }
}

impl LvstoreDaemon {
    /// Starts serving `name` (loading it from the store) on `ports` (0: free; the recorded ones when the
    /// replica exists).
    async fn host(&self, name: &str, ports: [u16; 3]) -> anyhow::Result<ReplicaAddress> {
        let mut hosted = self.hosted.lock().await;
        if let Some(h) = hosted.get(name) {
            return Ok(h.address.clone());
        }
        let store = self.store.clone();
        let n = name.to_owned();
        let replica = Arc::new(tokio::task::spawn_blocking(move || LvolReplica::load(store, &n)).await??);
        let recorded = replica.recorded_ports();
        let want = if recorded == [0; 3] { ports } else { recorded };
        let control = bind(self.ip, want[0], name, "control").await?;
        let data = bind(self.ip, want[1], name, "data").await?;
        let sync = bind(self.ip, want[2], name, "sync").await?;
        let data_unix = match self.data_unix_dir.as_deref().and_then(|d| data_socket(d, name)) {
            Some(path) => Some((crate::daemon::bind_unix(&path)?, path)),
            None => None,
        };
        let served = ServedEndpoints {
            data: data.local_addr()?,
            sync: sync.local_addr()?,
            data_unix: data_unix.as_ref().map(|(_, p)| p.clone()),
        };
        let bound = [
            control.local_addr()?.port(),
            served.data.port(),
            served.sync.port(),
        ];
        if replica.is_open() && bound != recorded {
            let r = replica.clone();
            tokio::task::spawn_blocking(move || r.set_ports(bound)).await??;
        }
        let cancel = self.cancel.child_token();
        let host = Arc::new(V2Replica {
            replica,
            jobs: JobTable::default(),
            ports: bound,
            rebuild: Arc::default(),
            clone: Arc::default(),
            listen_ip: self.ip,
            scratch: self.scratch.clone(),
            cancel: cancel.clone(),
        });
        let grpc = ReplicaGrpc::new(host.clone(), served);
        let mut tasks = tokio::task::JoinSet::new();
        let c = cancel.clone();
        // Every call is checked against the engine generation this replica accepted, as on a v1 replica.
        let h = host.clone();
        let fence = corral_proto::engine_generation::FenceLayer::new(move || {
            BlockBackend::generation(h.as_ref()).map_err(|e| e.message)
        });
        let (svc, sync_svc) = (
            ReplicaServiceServer::new(grpc.clone()),
            SyncAgentServiceServer::new(grpc),
        );
        let backup_svc = ReplicaBackupServiceServer::new(ReplicaBackupGrpc::over(Arc::new(V2Backup(
            host.replica.clone(),
        ))));
        let (tls, layer) = (self.data.tls.clone(), fence.clone());
        tasks.spawn(async move {
            tonic::transport::Server::builder()
                .layer(layer)
                .add_service(svc)
                .serve_with_incoming_shutdown(corral_proto::grpc::incoming(control, tls)?, c.cancelled())
                .await
                .context("ReplicaService")
        });
        let (c, tls) = (cancel.clone(), self.data.tls.clone());
        tasks.spawn(async move {
            tonic::transport::Server::builder()
                .layer(fence)
                .add_service(sync_svc)
                .add_service(backup_svc)
                .serve_with_incoming_shutdown(corral_proto::grpc::incoming(sync, tls)?, c.cancelled())
                .await
                .context("SyncAgentService")
        });
        let latency = Arc::new(ReplicaIoLatency::default());
        let backend = TimedBackend {
            replica: host.clone(),
            latency: latency.clone(),
        };
        let server = DataServer::new(Arc::new(backend) as Arc<dyn BlockBackend>, self.data.clone())?;
        lock(&self.metrics).insert(
            name.to_owned(),
            ReplicaMetrics {
                replica: host.clone(),
                data: server.metrics(),
                latency,
            },
        );
        let c = cancel.clone();
        tasks.spawn(async move {
            match data_unix {
                Some((unix, path)) => {
                    tokio::join!(server.serve_tcp(data, c.clone()), server.serve_unix(unix, c));
                    // Nothing listens there any more: a client must not find a socket that refuses it.
                    let _ = std::fs::remove_file(&path);
                }
                None => server.serve_tcp(data, c).await,
            }
            server.shutdown().await;
            Ok(())
        });
        let mut address = ReplicaAddress::tcp(&self.ip.to_string(), bound[0], bound[1], bound[2]);
        address.replica = Some(name.to_owned());
        info!(replica = name, %address, "serving replica");
        hosted.insert(
            name.to_owned(),
            Hosted {
                host,
                address: address.clone(),
                cancel,
                tasks,
            },
        );
        Ok(address)
    }

    /// Stops serving `name` (in-flight IO finishes), flushes it, and with `delete` deletes its lvols.
    async fn unhost(&self, name: &str, delete: bool) -> Result<(), ReplicaError> {
        let h = self.hosted.lock().await.remove(name);
        lock(&self.metrics).remove(name);
        let Some(mut h) = h else {
            // Not served (its volume detached) but its lvols may be here: a delete removes them all the same, or
            // a deleted detached volume would leave its lvols (and the backing image they sit on) behind.
            let store = self.store.clone();
            let n = name.to_owned();
            let deleted = tokio::task::spawn_blocking(move || {
                if !delete || store.lookup(&n).is_err() {
                    return Ok(false);
                }
                LvolReplica::load(store, &n)?.delete().map(|()| true)
            })
            .await
            .map_err(|e| ReplicaError::FailedPrecondition(e.to_string()))??;
            if deleted {
                tracing::info!(
                    replica = name,
                    "deleted the lvols of a replica that was not served"
                );
                return Ok(());
            }
            return Err(ReplicaError::NotFound(format!(
                "replica {name} is not hosted here"
            )));
        };
        h.cancel.cancel();
        while h.tasks.join_next().await.is_some() {}
        let r = h.host.replica.clone();
        tokio::task::spawn_blocking(move || if delete { r.delete() } else { r.close() })
            .await
            .map_err(|e| ReplicaError::FailedPrecondition(e.to_string()))?
    }

    async fn describe(&self, name: &str) -> Option<v1::LvstoreReplica> {
        let hosted = self.hosted.lock().await;
        let h = hosted.get(name)?;
        let r = &h.host.replica;
        let state = match (r.is_open(), r.status().map(|s| s.state)) {
            (true, _) => "open".to_owned(),
            (false, Ok(s)) => s,
            (false, Err(_)) => "error".to_owned(),
        };
        Some(v1::LvstoreReplica {
            name: name.to_owned(),
            address: h.address.to_string(),
            state,
            size: r.size(),
        })
    }
}

/// `LvstoreService` over the daemon.
#[derive(Clone)]
pub struct LvstoreGrpc(Arc<LvstoreDaemon>);

fn port(p: u32) -> Result<u16, Status> {
    u16::try_from(p).map_err(|_| Status::invalid_argument(format!("port {p} out of range")))
}

#[tonic::async_trait]
impl LvstoreService for LvstoreGrpc {
    async fn lvstore_replica_add(
        &self,
        req: Request<v1::LvstoreReplicaAddRequest>,
    ) -> Result<Response<v1::LvstoreReplica>, Status> {
        let req = req.into_inner();
        check_replica_name(&req.name)?;
        let ports = [
            port(req.control_port)?,
            port(req.data_port)?,
            port(req.sync_port)?,
        ];
        // Checked before hosting, so a refused request leaves nothing hosted.
        let over = if req.backing_image.is_empty() {
            None
        } else {
            let info = self.0.backing_images.get(&req.backing_image)?;
            if info.state != corral_proto::backing_image::FileState::Ready.as_str() {
                return Err(Status::failed_precondition(format!(
                    "v2 backing image {} is {} on this disk, not ready",
                    req.backing_image, info.state
                )));
            }
            Some(info.lvol)
        };
        if !lock(&self.0.busy).insert(req.name.clone()) {
            return Err(Status::aborted(format!("replica {} is being changed", req.name)));
        }
        let res = self.0.host(&req.name, ports).await;
        lock(&self.0.busy).remove(&req.name);
        res.map_err(|e| Status::internal(format!("{e:#}")))?;
        if let Some(lvol) = over {
            let h = self.0.hosted.lock().await.get(&req.name).map(|h| h.host.clone());
            if let Some(h) = h {
                h.replica.create_over_backing_image(Some(lvol));
            }
        }
        if req.size > 0 {
            let h = self.0.hosted.lock().await.get(&req.name).map(|h| h.host.clone());
            if let Some(h) = h
                && !h.replica.is_open()
            {
                let p = h.ports;
                tokio::task::spawn_blocking(move || {
                    h.replica.create(req.size, req.disable_revision_counter, p)
                })
                .await
                .map_err(|e| Status::internal(e.to_string()))??;
            }
        }
        self.0
            .describe(&req.name)
            .await
            .map(Response::new)
            .ok_or_else(|| Status::aborted("replica removed meanwhile"))
    }

    async fn lvstore_replica_remove(
        &self,
        req: Request<v1::LvstoreReplicaRemoveRequest>,
    ) -> Result<Response<v1::LvstoreEmpty>, Status> {
        let req = req.into_inner();
        check_replica_name(&req.name)?;
        if !lock(&self.0.busy).insert(req.name.clone()) {
            return Err(Status::aborted(format!("replica {} is being changed", req.name)));
        }
        let res = self.0.unhost(&req.name, req.delete_data).await;
        lock(&self.0.busy).remove(&req.name);
        res?;
        Ok(Response::new(v1::LvstoreEmpty {}))
    }

    async fn lvstore_replica_list(
        &self,
        _: Request<v1::LvstoreEmpty>,
    ) -> Result<Response<v1::LvstoreReplicaListResponse>, Status> {
        let names: Vec<String> = self.0.hosted.lock().await.keys().cloned().collect();
        let mut replicas = Vec::new();
        for n in names {
            if let Some(r) = self.0.describe(&n).await {
                replicas.push(r);
            }
        }
        Ok(Response::new(v1::LvstoreReplicaListResponse { replicas }))
    }

    async fn lvstore_info(
        &self,
        _: Request<v1::LvstoreEmpty>,
    ) -> Result<Response<v1::LvstoreInfoResponse>, Status> {
        let s = self.0.store.space();
        Ok(Response::new(v1::LvstoreInfoResponse {
            path: self.0.store.path().display().to_string(),
            direct_io: self.0.store.direct_io(),
            device_bytes: s.device_bytes,
            cluster_size: s.cluster_size,
            total_clusters: s.total_clusters,
            used_clusters: s.used_clusters,
            free_clusters: s.free_clusters,
        }))
    }

    async fn backing_image_create(
        &self,
        req: Request<v1::BackingImageCreateRequest>,
    ) -> Result<Response<v1::BackingImageV2CopyInfo>, Status> {
        Ok(Response::new(self.0.backing_images.create(req.into_inner())?))
    }

    async fn backing_image_delete(
        &self,
        req: Request<v1::BackingImageRef>,
    ) -> Result<Response<v1::LvstoreEmpty>, Status> {
        self.0.backing_images.delete(&req.into_inner().name).await?;
        Ok(Response::new(v1::LvstoreEmpty {}))
    }

    async fn backing_image_get(
        &self,
        req: Request<v1::BackingImageRef>,
    ) -> Result<Response<v1::BackingImageV2CopyInfo>, Status> {
        Ok(Response::new(self.0.backing_images.get(&req.into_inner().name)?))
    }

    async fn backing_image_list(
        &self,
        _: Request<v1::LvstoreEmpty>,
    ) -> Result<Response<v1::BackingImageListResponse>, Status> {
        Ok(Response::new(v1::BackingImageListResponse {
            backing_images: self.0.backing_images.list(),
        }))
    }

    async fn backing_image_expose(
        &self,
        req: Request<v1::BackingImageExposeRequest>,
    ) -> Result<Response<v1::BackingImageExposeResponse>, Status> {
        let req = req.into_inner();
        Ok(Response::new(
            self.0.backing_images.expose(&req.name, &req.to_address).await?,
        ))
    }

    async fn backing_image_unexpose(
        &self,
        req: Request<v1::BackingImageRef>,
    ) -> Result<Response<v1::LvstoreEmpty>, Status> {
        self.0.backing_images.unexpose(&req.into_inner().name);
        Ok(Response::new(v1::LvstoreEmpty {}))
    }

    type BackingImageWatchStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<v1::BackingImageV2CopyInfo, Status>> + Send + 'static>,
    >;

    async fn backing_image_watch(
        &self,
        _: Request<v1::LvstoreEmpty>,
    ) -> Result<Response<Self::BackingImageWatchStream>, Status> {
        use tokio::sync::broadcast::error::RecvError;
        let rx = self.0.backing_images.watch();
        let cancel = self.0.cancel.clone();
        let stream = futures::stream::unfold((rx, cancel), |(mut rx, cancel)| async move {
            loop {
                let next = tokio::select! {
                    r = rx.recv() => r,
                    () = cancel.cancelled() => return None,
                };
                match next {
                    Ok(info) => return Some((Ok(info), (rx, cancel))),
                    // Missed changes: the watcher lists again; the stream goes on with the next one.
                    Err(RecvError::Lagged(n)) => warn!(missed = n, "backing-image watcher lagged"),
                    Err(RecvError::Closed) => return None,
                }
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// Opens the store, formatting it with `format` only when the device holds no lvstore.
fn open_store(cfg: &LvstoreServeConfig) -> anyhow::Result<LvStore> {
    match LvStore::open_with(&cfg.disk, OpenMode::ReadWrite, cfg.data_io) {
        Ok(s) => Ok(s),
        Err(lvstore::Error::NotAnLvstore { .. }) if cfg.format => {
            info!(disk = %cfg.disk.display(), "no lvstore on the disk: formatting it (--format)");
            drop(LvStore::format(
                &cfg.disk,
                &FormatOptions {
                    cluster_size: cfg.cluster_size,
                    ..Default::default()
                },
            )?);
            Ok(LvStore::open_with(&cfg.disk, OpenMode::ReadWrite, cfg.data_io)?)
        }
        Err(e @ lvstore::Error::NotAnLvstore { .. }) => Err(anyhow::anyhow!(
            "{e}; format it with `corral-lvstore format` or start with --format"
        )),
        Err(e) => Err(e.into()),
    }
}

/// A rebuild's staging directory: beside the disk when it is a file, else the system's temporary directory.
fn scratch_dir(disk: &std::path::Path) -> PathBuf {
    match (std::fs::metadata(disk), disk.parent()) {
        (Ok(m), Some(p)) if m.is_file() && !p.as_os_str().is_empty() => p.to_owned(),
        _ => std::env::temp_dir(),
    }
}

/// How often the daemon looks at its resident set, and by how much it must have grown since the last trim for
/// freed heap to be given back ([`corral_daemon::heap`]).
const HEAP_TRIM_PERIOD: std::time::Duration = std::time::Duration::from_millis(500);
const HEAP_TRIM_GROWTH: u64 = 4 << 20;

/// Runs the daemon until `cancel`.
pub async fn serve_lvstore(cfg: LvstoreServeConfig, cancel: CancellationToken) -> anyhow::Result<()> {
    info!(?cfg, "corral-replica serve-lvstore starting");
    let c = cfg.clone();
    let store = Arc::new(tokio::task::spawn_blocking(move || open_store(&c)).await??);
    info!(direct_io = store.direct_io(), data_io = ?cfg.data_io, io_threads = cfg.io_threads, "store open");
    // One daemon serves every replica of the disk: what its control calls free would otherwise stay resident in
    // malloc's arenas (30 of 68 MiB with 200 replicas x 20 snapshots, `bench/v2/README.md`).
    corral_daemon::heap::spawn_trimmer(HEAP_TRIM_PERIOD, HEAP_TRIM_GROWTH, cancel.child_token())
        .context("start the heap trimmer")?;
    let mut data = cfg.data.clone();
    if cfg.io_threads > 0 {
        data.io_pool = Some(data_protocol::IoPool::new(cfg.io_threads).context("start the IO pool")?);
    }
    // Before the replicas: an interrupted backing-image create's temp head is deleted, never hosted.
    let (s, c) = (store.clone(), cancel.child_token());
    let staging = SyncStaging {
        listen_ip: cfg.listen.ip(),
        scratch: scratch_dir(&cfg.disk),
        max_send_rate: cfg.backing_image_send_rate,
    };
    let backing_images =
        Arc::new(tokio::task::spawn_blocking(move || BackingImages::recover(s, staging, c)).await??);
    let daemon = Arc::new(LvstoreDaemon {
        store: store.clone(),
        ip: cfg.listen.ip(),
        scratch: scratch_dir(&cfg.disk),
        data,
        cancel: cancel.clone(),
        hosted: tokio::sync::Mutex::default(),
        busy: Mutex::default(),
        metrics: MetricsTable::default(),
        backing_images,
        data_unix_dir: cfg.data_unix_dir.clone(),
    });
    if let Some(dir) = &cfg.data_unix_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("create --data-unix-dir {}", dir.display()))?;
    }
    for name in &cfg.replicas {
        check_replica_name(name)?;
    }
    let mut ready = ReadyReport::new();
    let mut names = replicas_in(&store);
    names.extend(cfg.replicas.iter().cloned());
    names.sort();
    names.dedup();
    for name in names {
        let a = daemon
            .host(&name, [0; 3])
            .await
            .with_context(|| format!("serve replica {name}"))?;
        // `NAME.control`, `NAME.data`, `NAME.sync`, `NAME.data-unix` (replica names hold no dots).
        for (what, ep) in [("control", &a.control), ("data", &a.data), ("sync", &a.sync)] {
            if let corral_proto::Endpoint::Tcp { port, .. } = ep {
                ready = ready.tcp(&format!("{name}.{what}"), SocketAddr::new(daemon.ip, *port));
            }
        }
        if let Some(sock) = daemon
            .data_unix_dir
            .as_deref()
            .and_then(|d| data_socket(d, &name))
        {
            ready = ready.unix(&format!("{name}.data-unix"), &sock);
        }
    }
    let listener = TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("bind {}", cfg.listen))?;
    ready = ready.tcp("control", listener.local_addr()?);
    let mut metrics_task = None;
    if let Some(addr) = cfg.metrics_listen {
        let l = TcpListener::bind(addr)
            .await
            .with_context(|| format!("bind metrics {addr}"))?;
        ready = ready.tcp("metrics", l.local_addr()?);
        let app = super::metrics::metrics(store.clone(), daemon.metrics.clone()).routes();
        metrics_task = Some(tokio::spawn(corral_daemon::metrics::serve(
            l,
            app,
            cancel.clone(),
        )));
    }
    ready.announce(cfg.ready_file.as_deref())?;
    tonic::transport::Server::builder()
        .add_service(LvstoreServiceServer::new(LvstoreGrpc(daemon.clone())))
        .serve_with_incoming_shutdown(
            corral_proto::grpc::incoming(listener, daemon.data.tls.clone())?,
            cancel.cancelled(),
        )
        .await
        .context("LvstoreService")?;
    daemon.backing_images.shutdown().await;
    let names: Vec<String> = daemon.hosted.lock().await.keys().cloned().collect();
    for n in names {
        if let Err(e) = daemon.unhost(&n, false).await {
            warn!(replica = %n, error = %e, "closing replica failed");
        }
    }
    if let Some(t) = metrics_task {
        t.await?.context("metrics server")?;
    }
    tokio::task::spawn_blocking(move || store.flush()).await??;
    info!(disk = %cfg.disk.display(), "corral-replica serve-lvstore stopped; replicas flushed");
    Ok(())
}
