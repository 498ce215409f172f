//! A v2 image's ready copies as the source of the operations that read a whole image (issue 21 item 7): a v2
//! image has no file once its first v2 copy is ready, so a clone or a backup reads a copy through the disk daemon
//! that holds it, with the call a sync between two stores uses (`BackingImageExpose`: the daemon sends its
//! snapshot lvol read-only, data blocks only, to a sparse-sync receiver).
//!
//! - A **clone** runs as every other source does: the new image's data source is given the daemon's address
//!   (`lvstore-address`) and receives the copy into its work file (`data-source/src/clone.rs`); the v1 and v2
//!   flows go on from that file as for a download.
//! - A **backup** (`crate::backup::image_backup_runner`) receives the copy into a staging file in the copy's
//!   disk directory ([`staging_path`]), backs the file up, and removes it whatever the outcome.

use std::path::{Path, PathBuf};
use std::time::Duration;

use corral_proto::v1;
use tokio_util::sync::CancellationToken;

use super::disks::disks;
use super::model::{BackingImage, state};
use super::strategy::CopyStrategy as _;
use crate::context::Ctx;
use crate::data_engine::Strategy as _;
use crate::model::ProcessState;
use crate::v2::model::{LvstoreDaemon, daemon_name};

/// One ready v2 copy whose disk is ready and whose daemon runs.
#[derive(Debug, Clone)]
pub struct ReadyV2Copy {
    pub node_id: String,
    pub disk_name: String,
    pub disk_uuid: String,
    /// The v2 disk's directory (holds `lvstore.img`).
    pub disk_path: String,
    /// The daemon's `LvstoreService`, `HOST:PORT`.
    pub address: String,
    /// The copy's size in bytes.
    pub size: u64,
}

/// The ready v2 copies of image `bi` (as its status records them) on readable disks whose daemon runs: the sources
/// a clone or a backup of the image reads, so a cordoned disk or node still counts.
pub async fn ready_v2_copies(ctx: &Ctx, bi: &BackingImage) -> anyhow::Result<Vec<ReadyV2Copy>> {
    if !bi.spec.data_engine.copies_are_lvols() {
        return Ok(Vec::new());
    }
    let daemons = ctx.db.list::<LvstoreDaemon>().await?;
    let all = disks(ctx).await?;
    let mut out = Vec::new();
    for (disk_uuid, f) in &bi.status.disk_file_status_map {
        if !f.is_lvol() || f.state != state::READY {
            continue;
        }
        let Some(copy) = f.v2_copy.as_ref().filter(|c| c.uuid == bi.spec.uuid) else {
            continue;
        };
        let Some(d) = all
            .iter()
            .find(|d| &d.disk_uuid == disk_uuid && d.readable && d.engine.in_lvstore())
        else {
            continue;
        };
        let name = daemon_name(&d.node_id, &d.disk_name);
        let Some(address) = daemons
            .iter()
            .find(|o| o.name == name)
            .map(|o| &o.data)
            .filter(|x| x.state == ProcessState::Running && !x.address.is_empty())
            .map(|x| x.address.clone())
        else {
            continue;
        };
        out.push(ReadyV2Copy {
            node_id: d.node_id.clone(),
            disk_name: d.disk_name.clone(),
            disk_uuid: d.disk_uuid.clone(),
            disk_path: d.path.clone(),
            address,
            size: copy.size,
        });
    }
    Ok(out)
}

/// Where a backup of image `image` (backup `backup`) stages the copy it receives: `<disk>/tmp/<image>-<backup>.backup`
/// (`<disk>/tmp` is the disk's scratch directory, as for data sources; the name is unique per backup).
pub fn staging_path(disk_path: &str, image: &str, backup: &str) -> PathBuf {
    Path::new(disk_path)
        .join("tmp")
        .join(format!("{image}-{backup}.backup"))
}

/// A stalled sender fails the receive after this long without a request.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Backstop of the `BackingImageExpose` call, which lasts as long as the transfer.
const EXPOSE_REQUEST_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// Receives `copy` of image `image` into `path` (created; a leftover is replaced), binding the receiver on
/// `bind_ip`; `received` is told the bytes written so far (the partial file's allocation) every 250 ms. On any
/// failure or `cancel` nothing is left at `path` (the receiver removes its partial file) and the daemon's exposure
/// is ended. Returns the copy's size.
pub async fn receive_copy(
    copy: &ReadyV2Copy,
    image: &str,
    path: &Path,
    bind_ip: std::net::IpAddr,
    cancel: &CancellationToken,
    received: impl Fn(u64),
) -> anyhow::Result<u64> {
    let r = receive(copy, image, path, bind_ip, cancel, received).await;
    if r.is_err() {
        remove_staging(path);
    }
    r
}

async fn receive(
    copy: &ReadyV2Copy,
    image: &str,
    path: &Path,
    bind_ip: std::net::IpAddr,
    cancel: &CancellationToken,
    received: impl Fn(u64),
) -> anyhow::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
    }
    remove_staging(path);
    let mut cfg = sparse_sync::ReceiverConfig::new(path);
    cfg.idle_timeout = IDLE_TIMEOUT;
    let receiver = sparse_sync::Receiver::bind(std::net::SocketAddr::new(bind_ip, 0), cfg).await?;
    let to = receiver.local_addr().to_string();
    let rcancel = cancel.child_token();
    let _stop = rcancel.clone().drop_guard();
    let mut recv = tokio::spawn(receiver.run(rcancel.clone()));
    let address = copy.address.clone();
    let expose = async {
        let ch = corral_proto::grpc::connect(
            &address,
            corral_proto::grpc::GrpcTimeouts::CONTROL.with_request(EXPOSE_REQUEST_TIMEOUT),
        )
        .await?;
        let r = v1::lvstore_service_client::LvstoreServiceClient::new(ch)
            .backing_image_expose(v1::BackingImageExposeRequest {
                name: image.to_owned(),
                to_address: to.clone(),
            })
            .await
            .map_err(|s| {
                anyhow::anyhow!(
                    "BackingImageExpose of {image} on the lvstore daemon of disk {} ({address}): {}",
                    copy.disk_name,
                    s.message()
                )
            })?;
        anyhow::Ok(r.into_inner())
    };
    tokio::pin!(expose);
    let partial = sparse_sync::receiver::partial_path(path);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut announced = None;
    let summary = loop {
        tokio::select! {
            r = &mut recv => break r??,
            r = &mut expose, if announced.is_none() => match r {
                Ok(x) => announced = Some(x.size),
                Err(e) => {
                    rcancel.cancel();
                    let _ = recv.await;
                    return Err(e);
                }
            },
            () = cancel.cancelled() => {
                unexpose(&copy.address, image).await;
                let _ = recv.await;
                anyhow::bail!("cancelled while receiving the v2 copy");
            }
            _ = tick.tick() => {
                if let Ok(m) = std::fs::metadata(&partial) {
                    received(m.blocks() * 512);
                }
            }
        }
    };
    if summary.outcome != sparse_sync::ReceiveOutcome::Completed {
        anyhow::bail!(
            "receiving the v2 copy of {image} from disk {}: {:?}",
            copy.disk_name,
            summary.outcome
        );
    }
    let size = std::fs::metadata(path)?.len();
    if size != announced.unwrap_or(copy.size) {
        anyhow::bail!(
            "the v2 copy of {image} on disk {} holds {} bytes, {size} arrived",
            copy.disk_name,
            announced.unwrap_or(copy.size)
        );
    }
    Ok(size)
}

/// Ends the daemon's exposures of `image` (best effort: a stopped receiver fails the sender anyway).
async fn unexpose(address: &str, image: &str) {
    if let Ok(mut c) = crate::v2::replica::client(address).await {
        let _ = c
            .backing_image_unexpose(v1::BackingImageRef {
                name: image.to_owned(),
            })
            .await;
    }
}

/// Removes a staging file and its partial file; absent is fine.
pub fn remove_staging(path: &Path) {
    for p in [path.to_path_buf(), sparse_sync::receiver::partial_path(path)] {
        match std::fs::remove_file(&p) {
            Ok(()) => tracing::debug!(path = %p.display(), "staging file removed"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(path = %p.display(), error = %e, "staging file not removed"),
        }
    }
}
