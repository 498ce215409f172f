//! Volume clone and snapshot export, engine side.
//!
//! **Clone** (`ControllerService.SnapshotClone`): the engine of the *target* volume asks the source volume's
//! engine for its replicas, picks a RW one, and starts `SnapshotClone` on every RW replica of the target; each
//! target replica pulls the snapshot flattened from that source replica (see the replica's `clone` and `export`
//! modules). The engine drives it rather than the CLI because it alone knows, under its replica lock, that no
//! replica is rebuilding, and because the manager will call the same RPC. `SnapshotCloneStatus` combines the
//! replicas' job states.
//!
//! **Export to a file** (`corral-engine snapshot export`): the CLI binds a local sparse-sync receiver and asks a RW
//! replica of the volume to `VolumeExport` the snapshot to it (holes stay holes), then converts the raw result to
//! qcow2 when asked.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use corral_proto::grpc::{GrpcTimeouts, connect_endpoint};
use corral_proto::v1::{
    self, controller_service_client::ControllerServiceClient,
    sync_agent_service_client::SyncAgentServiceClient,
};
use corral_proto::{Endpoint, ReplicaAddress};
use tonic::transport::Channel;
use tracing::info;

use crate::error::EngineError;
use crate::replica_client::{Mode, ReplicaEntry, parse_address};
use crate::volume::Volume;

/// Connects to an engine's `ControllerService` (`HOST:PORT`, `tcp://` or `http://` prefixes accepted).
pub async fn engine_client(url: &str) -> Result<ControllerServiceClient<Channel>, EngineError> {
    corral_proto::grpc::connect(url, corral_proto::grpc::GrpcTimeouts::OPERATOR)
        .await
        .map(ControllerServiceClient::new)
        .map_err(|e| EngineError::FailedPrecondition(format!("engine: {e}")))
}

fn engine_err(url: &str, s: &tonic::Status) -> EngineError {
    EngineError::Replica {
        address: format!("engine {url}"),
        code: s.code(),
        message: s.message().to_owned(),
    }
}

/// A RW replica of the volume served by the engine at `url`.
pub async fn rw_replica_of(url: &str) -> Result<ReplicaAddress, EngineError> {
    let list = engine_client(url)
        .await?
        .replica_list(v1::Empty {})
        .await
        .map_err(|e| engine_err(url, &e))?
        .into_inner();
    list.replicas
        .into_iter()
        .find(|r| r.mode == Mode::Rw.as_str())
        .ok_or_else(|| EngineError::FailedPrecondition(format!("the volume at {url} has no RW replica")))
        .and_then(|r| parse_address(&r.address))
}

fn sync_client(r: &ReplicaEntry) -> Result<SyncAgentServiceClient<Channel>, EngineError> {
    Ok(r.connection()?.sync.clone())
}

impl Volume {
    /// Starts cloning `req.snapshot_name` of the volume at `req.from_engine_address` into every RW replica.
    pub async fn snapshot_clone(&self, req: &v1::VolumeCloneRequest) -> Result<String, EngineError> {
        if req.snapshot_name.is_empty() {
            return Err(EngineError::InvalidArgument(
                "a clone needs a snapshot name".into(),
            ));
        }
        let from_url = &req.from_engine_address;
        let src_size = engine_client(from_url)
            .await?
            .volume_get(v1::Empty {})
            .await
            .map_err(|e| engine_err(from_url, &e))?
            .into_inner()
            .size;
        if src_size != self.size() {
            return Err(EngineError::InvalidArgument(format!(
                "the source volume is {src_size} bytes but {} is {} bytes: a clone needs volumes of the same size",
                self.name,
                self.size()
            )));
        }
        let from = rw_replica_of(from_url).await?;
        let reps = self.replicas.read().await;
        if reps.iter().any(|r| r.mode() == Mode::Wo) {
            return Err(EngineError::FailedPrecondition(format!(
                "a replica of {} is rebuilding; clone after it finishes",
                self.name
            )));
        }
        let targets: Vec<Arc<ReplicaEntry>> = reps.iter().filter(|r| r.mode() == Mode::Rw).cloned().collect();
        if targets.is_empty() {
            return Err(EngineError::FailedPrecondition(format!(
                "volume {} has no RW replica",
                self.name
            )));
        }
        for r in &targets {
            let s = sync_client(r)?
                .snapshot_clone_status(v1::Empty {})
                .await
                .map_err(|e| EngineError::replica(&r.address, &e))?
                .into_inner();
            if s.is_running {
                return Err(EngineError::FailedPrecondition(format!(
                    "replica {} is already cloning {}",
                    r.address, s.snapshot_name
                )));
            }
        }
        // From the first started clone on, the replicas may end with different data: the watcher puts every
        // replica that did not complete out of the volume once one has completed.
        let mut any_started = false;
        let mut start_error = None;
        for r in &targets {
            let res = match sync_client(r) {
                Ok(mut c) => c
                    .snapshot_clone(v1::SnapshotCloneRequest {
                        from_address: from.to_string(),
                        snapshot_file_name: req.snapshot_name.clone(),
                        export_backing_image_if_exist: req.export_backing_image_if_exist,
                        max_bytes_per_second: req.max_bytes_per_second,
                    })
                    .await
                    .map_err(|e| EngineError::replica(&r.address, &e)),
                Err(e) => Err(e),
            };
            match res {
                Ok(_) => any_started = true,
                Err(e) => {
                    start_error = Some(e);
                    break;
                }
            }
        }
        if any_started {
            watch_clone_outcome(self.name.clone(), targets.clone());
        }
        if let Some(e) = start_error {
            return Err(e);
        }
        info!(
            volume = %self.name, from = %from, snapshot = %req.snapshot_name, replicas = targets.len(),
            "clone started"
        );
        Ok(from.to_string())
    }

    /// The clone state of every replica that can answer, and the combined state (error when any failed).
    pub async fn clone_status(&self) -> Result<v1::VolumeCloneStatusResponse, EngineError> {
        let reps = self.replicas.read().await;
        let mut out = v1::VolumeCloneStatusResponse::default();
        let mut states = Vec::new();
        for r in reps.iter().filter(|r| r.mode() != Mode::Err) {
            let st = sync_client(r)?
                .snapshot_clone_status(v1::Empty {})
                .await
                .map_err(|e| EngineError::replica(&r.address, &e))?
                .into_inner();
            states.push(st.clone());
            out.replicas.insert(r.address.to_string(), st);
        }
        let active: Vec<&v1::JobStatusResponse> = states.iter().filter(|s| s.state != "none").collect();
        if let Some(s) = active.first() {
            out.from_replica_address = s.from_addresses.first().cloned().unwrap_or_default();
            out.snapshot_name.clone_from(&s.snapshot_name);
        }
        out.is_cloning = active.iter().any(|s| s.is_running);
        out.progress = active.iter().map(|s| s.progress).min().unwrap_or(0);
        out.state = if let Some(e) = active
            .iter()
            .find(|s| s.state == "error" || s.state == "cancelled")
        {
            out.error.clone_from(&e.error);
            "error".into()
        } else if out.is_cloning {
            "in-progress".into()
        } else if active.is_empty() {
            "none".into()
        } else {
            "complete".into()
        };
        Ok(out)
    }
}

/// Waits until no replica of `targets` is cloning any more, then, if the clone completed on some of them, puts
/// every other one ERR: those still hold the volume's old data (a failed clone leaves a replica as it was), so
/// serving reads from both would return two different volumes. Rebuild brings them back from a completed one.
/// When no replica completed, every one kept its old data and nothing changes.
fn watch_clone_outcome(volume: String, targets: Vec<Arc<ReplicaEntry>>) {
    tokio::spawn(async move {
        // A replica whose status cannot be read this many times in a row counts as not completed.
        const MAX_STATUS_FAILURES: u32 = 20;
        let mut failures = vec![0u32; targets.len()];
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let mut running = false;
            let mut completed = vec![false; targets.len()];
            for (i, r) in targets.iter().enumerate() {
                if r.mode() == Mode::Err {
                    continue;
                }
                let status = match sync_client(r) {
                    Ok(mut c) => c
                        .snapshot_clone_status(v1::Empty {})
                        .await
                        .map(tonic::Response::into_inner)
                        .ok(),
                    Err(_) => None,
                };
                match status {
                    Some(s) if s.is_running => running = true,
                    Some(s) => completed[i] = s.state == "complete",
                    None => {
                        failures[i] += 1;
                        running |= failures[i] < MAX_STATUS_FAILURES;
                    }
                }
            }
            if running {
                continue;
            }
            if completed.iter().any(|c| *c) {
                for (r, done) in targets.iter().zip(&completed) {
                    if !done && r.set_err("the clone did not complete on this replica while it did on others: its data differs") {
                        tracing::warn!(volume = %volume, replica = %r.address, "clone incomplete on this replica: set ERR");
                    }
                }
            }
            return;
        }
    });
}

/// Image format of an exported snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ExportFormat {
    /// A sparse raw file.
    Raw,
    /// qcow2 (converted from the raw export).
    Qcow2,
}

/// What an export to a file did.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FileExport {
    /// The replica that sent the data.
    pub replica: String,
    /// The snapshot.
    pub snapshot: String,
    /// The file written.
    pub path: String,
    /// Its format.
    pub format: ExportFormat,
    /// Volume size.
    pub size: u64,
    /// Data bytes sent.
    pub bytes_sent: u64,
}

/// Local address from which `host` is reached: what the replica can connect back to.
/// The local IP a replica's sync endpoint reaches this host on (loopback for a unix socket: same host).
fn local_ip_towards(sync: &Endpoint) -> Result<std::net::IpAddr, EngineError> {
    let Endpoint::Tcp { host, port } = sync else {
        return Ok(std::net::Ipv4Addr::LOCALHOST.into());
    };
    let s = std::net::UdpSocket::bind(("0.0.0.0", 0))
        .and_then(|s| s.connect((host.as_str(), *port)).map(|()| s))
        .and_then(|s| s.local_addr())
        .map_err(|e| EngineError::FailedPrecondition(format!("no route to replica {sync}: {e}")))?;
    Ok(s.ip())
}

/// Exports `snapshot` of the volume at `url` into the new file `to`. `progress` is called with bytes received
/// so far (allocated size of the partial file) and an estimate of the total.
pub async fn export_to_file(
    url: &str,
    snapshot: &str,
    to: &Path,
    format: ExportFormat,
    with_backing: bool,
    progress: impl Fn(u64, u64),
) -> Result<FileExport, EngineError> {
    use std::os::unix::fs::MetadataExt;

    if to.exists() {
        return Err(EngineError::AlreadyExists(format!(
            "{} exists; remove it or choose another path",
            to.display()
        )));
    }
    let replica = rw_replica_of(url).await?;
    let list = engine_client(url)
        .await?
        .snapshot_list(v1::Empty {})
        .await
        .map_err(|e| engine_err(url, &e))?
        .into_inner();
    let estimate = chain_allocated(&list.disks, snapshot);
    let ip = local_ip_towards(&replica.sync)?;
    let raw_path = match format {
        ExportFormat::Raw => to.to_owned(),
        ExportFormat::Qcow2 => {
            let mut p = to.as_os_str().to_owned();
            p.push(".export-raw");
            PathBuf::from(p)
        }
    };
    let mut cfg = sparse_sync::ReceiverConfig::new(&raw_path);
    cfg.idle_timeout = Duration::from_secs(60);
    let receiver = sparse_sync::Receiver::bind(std::net::SocketAddr::new(ip, 0), cfg)
        .await
        .map_err(|e| EngineError::Internal(format!("receiver: {e}")))?;
    let addr = receiver.local_addr();
    let cancel = sparse_sync::CancellationToken::new();
    let mut recv = tokio::spawn(receiver.run(cancel.clone()));
    let source = replica.clone();
    let export = async {
        let mut c = connect_endpoint(&source.sync, GrpcTimeouts::OPERATOR)
            .await
            .map(SyncAgentServiceClient::new)
            .map_err(|e| {
                EngineError::FailedPrecondition(format!("sync endpoint of replica {source}: {e}"))
            })?;
        c.volume_export(v1::VolumeExportRequest {
            snapshot_file_name: snapshot.to_owned(),
            host: addr.ip().to_string(),
            port: u32::from(addr.port()),
            export_backing_image_if_exist: with_backing,
            expected_size: 0,
            max_bytes_per_second: 0,
        })
        .await
        .map(tonic::Response::into_inner)
        .map_err(|e| EngineError::replica(&source, &e))
    };
    tokio::pin!(export);
    let partial = sparse_sync::receiver::partial_path(&raw_path);
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let sent = loop {
        tokio::select! {
            r = &mut export => match r {
                Ok(s) => break s,
                Err(e) => {
                    cancel.cancel();
                    let _ = (&mut recv).await;
                    return Err(e);
                }
            },
            () = async { tick.tick().await; } => {
                let have = std::fs::metadata(&partial).map(|m| m.blocks() * 512).unwrap_or(0);
                progress(have, estimate);
            }
        }
    };
    let summary = recv
        .await
        .map_err(|e| EngineError::Internal(e.to_string()))?
        .map_err(|e| EngineError::Internal(format!("receiver: {e}")))?;
    if summary.outcome != sparse_sync::ReceiveOutcome::Completed {
        return Err(EngineError::Internal(format!(
            "receiver ended without the snapshot: {:?}",
            summary.outcome
        )));
    }
    progress(estimate, estimate);
    if format == ExportFormat::Qcow2 {
        let converted = to_qcow2(&raw_path, to).await;
        let _ = std::fs::remove_file(&raw_path);
        converted?;
    }
    info!(replica = %replica, snapshot, path = %to.display(), sent = sent.bytes_sent, "snapshot exported");
    Ok(FileExport {
        replica: replica.to_string(),
        snapshot: snapshot.to_owned(),
        path: to.display().to_string(),
        format,
        size: sent.size,
        bytes_sent: sent.bytes_sent,
    })
}

async fn to_qcow2(raw: &Path, to: &Path) -> Result<(), EngineError> {
    let (raw, to) = (raw.to_owned(), to.to_owned());
    tokio::task::spawn_blocking(move || {
        let cancel = std::sync::atomic::AtomicBool::new(false);
        disk_image::convert(&raw, &to, disk_image::ImageFormat::Qcow2, &|_, _| {}, &cancel).map_err(|e| {
            EngineError::Internal(format!(
                "convert {} to qcow2 {}: {e}",
                raw.display(),
                to.display()
            ))
        })
    })
    .await
    .map_err(|e| EngineError::Internal(format!("conversion task: {e}")))?
}

/// Allocated bytes of `snapshot`'s chain (snapshot name or file name): an upper bound of its flattened data.
fn chain_allocated(disks: &std::collections::HashMap<String, v1::DiskInfo>, snapshot: &str) -> u64 {
    let file = if disks.contains_key(snapshot) {
        snapshot.to_owned()
    } else {
        format!("volume-snap-{snapshot}.img")
    };
    let mut total = 0;
    let mut cur = file;
    for _ in 0..disks.len() {
        let Some(d) = disks.get(&cur) else { break };
        total += d.size;
        if d.parent.is_empty() {
            break;
        }
        cur.clone_from(&d.parent);
    }
    total
}

/// The operator commands (`snapshot clone`, `clone-status`, `export`), with progress bars.
pub mod cli {
    use std::path::Path;
    use std::time::Duration;

    use anyhow::bail;
    use corral_proto::v1;

    use super::{ExportFormat, engine_client, export_to_file};

    /// The `snapshot` subcommands of this module.
    #[derive(clap::Subcommand, Debug)]
    pub enum CloneCmd {
        /// Clone a snapshot of another volume into this (same-sized) volume, with progress.
        Clone {
            /// gRPC address of the source volume's engine.
            #[arg(long)]
            from_engine: String,
            /// Snapshot of the source volume.
            #[arg(long)]
            snapshot: String,
            /// Include the source's backing image data (for a target without that backing image).
            #[arg(long)]
            export_backing_image: bool,
            /// Upper bound of data sent per second by the source (bytes, or with K/M/G); unlimited when omitted.
            #[arg(long, value_parser = corral_daemon::parse_size)]
            max_rate: Option<u64>,
            /// Do not wait for the clone to finish.
            #[arg(long)]
            no_wait: bool,
        },
        /// State of the clone into this volume, per replica.
        CloneStatus,
        /// Write a snapshot to a new image file (holes stay holes).
        Export {
            /// Snapshot name.
            name: String,
            /// File to create.
            #[arg(long)]
            to: std::path::PathBuf,
            #[arg(long, value_enum, default_value = "raw")]
            format: ExportFormat,
            /// Leave out the backing image's data (blocks only it holds read as zeros).
            #[arg(long)]
            no_backing_image: bool,
        },
    }

    /// Runs one of the commands against the engine at `url`.
    pub async fn run(url: &str, json: bool, cmd: CloneCmd) -> anyhow::Result<()> {
        match cmd {
            CloneCmd::Clone {
                from_engine,
                snapshot,
                export_backing_image,
                max_rate,
                no_wait,
            } => {
                let req = v1::VolumeCloneRequest {
                    from_engine_address: from_engine,
                    snapshot_name: snapshot,
                    export_backing_image_if_exist: export_backing_image,
                    max_bytes_per_second: max_rate.unwrap_or(0),
                };
                clone(url, json, req, no_wait).await
            }
            CloneCmd::CloneStatus => status(url, json).await,
            CloneCmd::Export {
                name,
                to,
                format,
                no_backing_image,
            } => export(url, json, &name, &to, format, !no_backing_image).await,
        }
    }

    fn print<T: serde::Serialize>(json: bool, v: &T, human: impl FnOnce() -> String) -> anyhow::Result<()> {
        if json {
            println!("{}", serde_json::to_string_pretty(v)?);
        } else {
            println!("{}", human());
        }
        Ok(())
    }

    /// `snapshot clone`: starts the clone on the target engine at `url` and waits for it (unless `no_wait`).
    pub async fn clone(
        url: &str,
        json: bool,
        req: v1::VolumeCloneRequest,
        no_wait: bool,
    ) -> anyhow::Result<()> {
        let mut c = engine_client(url).await?;
        let snapshot = req.snapshot_name.clone();
        let from_engine = req.from_engine_address.clone();
        c.snapshot_clone(req).await?;
        if no_wait {
            println!("clone of {snapshot} from {from_engine} started");
            return Ok(());
        }
        let b = corral_daemon::percent_bar(&format!("cloning {snapshot}"));
        loop {
            let s = c.snapshot_clone_status(v1::Empty {}).await?.into_inner();
            b.set_position(u64::from(s.progress));
            match s.state.as_str() {
                "complete" => {
                    b.finish_and_clear();
                    return print(json, &s, || {
                        let sent: u64 = s.replicas.values().map(|r| r.bytes_transferred).sum();
                        format!(
                            "cloned {} from {} into {} replica(s) ({} sent)",
                            s.snapshot_name,
                            s.from_replica_address,
                            s.replicas.len(),
                            corral_daemon::human_bytes(sent)
                        )
                    });
                }
                "error" => {
                    b.finish_and_clear();
                    bail!("clone of {snapshot} failed: {}", s.error);
                }
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// `snapshot clone-status`.
    pub async fn status(url: &str, json: bool) -> anyhow::Result<()> {
        let s = engine_client(url)
            .await?
            .snapshot_clone_status(v1::Empty {})
            .await?
            .into_inner();
        print(json, &s, || {
            let mut t = comfy_table::Table::new();
            t.load_style(comfy_table::presets::UTF8_FULL_CONDENSED);
            t.set_header(vec![
                "replica", "state", "progress", "snapshot", "from", "sent", "error",
            ]);
            for (addr, r) in &s.replicas {
                t.add_row(vec![
                    addr.clone(),
                    r.state.clone(),
                    format!("{}%", r.progress),
                    r.snapshot_name.clone(),
                    r.from_addresses.join(" "),
                    r.bytes_transferred.to_string(),
                    r.error.clone(),
                ]);
            }
            format!("clone: {} ({}%)\n{t}", s.state, s.progress)
        })
    }

    /// `snapshot export`.
    pub async fn export(
        url: &str,
        json: bool,
        snapshot: &str,
        to: &Path,
        format: ExportFormat,
        with_backing: bool,
    ) -> anyhow::Result<()> {
        let b = corral_daemon::percent_bar(&format!("exporting {snapshot}"));
        let r = export_to_file(url, snapshot, to, format, with_backing, |have, total| {
            if let Some(pct) = (have.min(total) * 100).checked_div(total) {
                b.set_position(pct.min(99));
            }
        })
        .await;
        b.finish_and_clear();
        let r = r?;
        print(json, &r, || {
            format!(
                "snapshot {} exported to {} ({:?}, {} data sent by {})",
                r.snapshot,
                r.path,
                r.format,
                corral_daemon::human_bytes(r.bytes_sent),
                r.replica
            )
        })
    }
}
