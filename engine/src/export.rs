//! Export of a snapshot to a file (`corral-engine snapshot export`): the CLI binds a local sparse-sync receiver and
//! asks a RW replica of the volume to `VolumeExport` the snapshot to it (holes stay holes), then converts the raw
//! result to qcow2 when asked.

use std::path::{Path, PathBuf};
use std::time::Duration;

use corral_proto::Endpoint;
use corral_proto::engine_generation::EngineGeneration;
use corral_proto::grpc::{GrpcTimeouts, connect_endpoint};
use corral_proto::v1::{self, sync_agent_service_client::SyncAgentServiceClient};
use tracing::info;

use crate::error::EngineError;
use crate::remote_engine::{engine_client, engine_err, rw_replica_of};

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
    let mut engine = engine_client(url).await?;
    let list = engine
        .snapshot_list(v1::Empty {})
        .await
        .map_err(|e| engine_err(url, &e))?
        .into_inner();
    // The export presents the engine's generation to the replica, as the engine's own calls do.
    let generation = engine
        .volume_get(v1::Empty {})
        .await
        .map_err(|e| engine_err(url, &e))?
        .into_inner()
        .generation;
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
            .map(|ch| SyncAgentServiceClient::with_interceptor(ch, EngineGeneration(generation)))
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
