//! Snapshot export and clone of a v2 replica, over the same gRPC calls and sparse-sync protocol as v1 (so a
//! snapshot clones v1→v2, v2→v1 and v2→v2).
//!
//! - **Export** (`VolumeExport`, source side): snapshot lvol `NAME.snap.SNAP` flattened over its parents
//!   ([`LvolSnapshot::flattened`](super::snapshot_view::LvolSnapshot::flattened): every block its chain holds,
//!   read through the store) streamed to the receiver; the snapshot is held against purges until it is sent.
//!   A v2 replica has no backing image, so `export_backing_image_if_exist` changes nothing.
//! - **Clone** (`SnapshotClone`, target side): the source's export is received into a staging file in the
//!   daemon's scratch directory, written into the store as the rebuild writes a received root snapshot
//!   (`NAME.rcvw.SNAP`, frozen as `NAME.rcv.SNAP`, [`LvolReplica::import_received`]), then committed by
//!   [`LvolReplica::commit_clone`]: a new empty head over it (the revert's crash order; deleting the old head is
//!   the commit point), the replica's older snapshots deleted and the received one renamed `NAME.snap.SNAP`. A
//!   failed or cancelled clone deletes what it received; after a crash, loading the replica undoes an uncommitted
//!   clone or finishes a committed one, exactly as for a rebuild. `LocalFiles` is not offered (a v2 snapshot is
//!   not a file another daemon could open), so the clone always takes the network path.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use corral_proto::v1;
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::lvol::LvolReplica;
use crate::clone::{CloneRequest, CloneTracker, check_source, receive};
use crate::error::{ReplicaError, Result};
use crate::export::{ExportRequest, ExportSummary, send_export, snapshot_file};

/// `VolumeExport` of snapshot `req.snapshot_file_name` of `r`; returns when the receiver has committed it.
pub async fn volume_export(r: Arc<LvolReplica>, req: &ExportRequest) -> Result<ExportSummary> {
    let file = snapshot_file(&req.snapshot_file_name)?;
    let (content, _held) = r.snapshot_for_sending(&file)?;
    if r.status()?.disks.get(&file).is_some_and(|d| d.removed) {
        return Err(ReplicaError::FailedPrecondition(format!(
            "snapshot {file} is marked removed"
        )));
    }
    let origin = format!("{}#{}", r.store().path().display(), r.name());
    send_export(Arc::new(content.flattened()), &file, req, &origin).await
}

/// Where the clone into `replica` stages the received snapshot.
fn stage_dir(scratch: &Path, replica: &str) -> PathBuf {
    scratch.join(format!(".corral-clone-{replica}"))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> std::result::Result<T, String> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}

/// What a clone into a v2 replica needs of the replica's host (`service::V2Replica`), handed over by the service so
/// this module does not depend on it.
pub struct CloneTarget {
    pub replica: Arc<LvolReplica>,
    /// The clone into this replica.
    pub clone: Arc<CloneTracker>,
    /// Whether a rebuild into this replica is running (a clone then waits for it).
    pub rebuild_running: bool,
    /// Address the receiver binds to (the daemon's IP).
    pub listen_ip: std::net::IpAddr,
    /// Directory for the staging file.
    pub scratch: PathBuf,
    /// Cancelled when the replica stops being served.
    pub cancel: CancellationToken,
}

/// `SnapshotClone` into the replica of `host`; returns once the request is validated and the job runs.
pub async fn start(host: CloneTarget, req: CloneRequest) -> Result<()> {
    let r = host.replica.clone();
    let file = snapshot_file(&req.snapshot_file_name)?;
    let status = r.status()?;
    if !r.is_open() {
        return Err(ReplicaError::FailedPrecondition(format!(
            "replica {} is not open",
            r.name()
        )));
    }
    if host.rebuild_running || status.rebuilding {
        return Err(ReplicaError::FailedPrecondition(
            "a rebuild is running on this replica; clone after it finishes".into(),
        ));
    }
    if status.disks.contains_key(&file) {
        return Err(ReplicaError::AlreadyExists(format!(
            "snapshot {file} on this replica"
        )));
    }
    if host.clone.is_running() {
        return Err(ReplicaError::FailedPrecondition(
            "a clone is already running on this replica".into(),
        ));
    }
    let estimate = check_source(&req.from, &file, status.size).await?;
    host.clone.begin(&req.from, &file)?;
    info!(replica = r.name(), snapshot = %file, from = %req.from, "clone started");
    let cancel = host.cancel.child_token();
    tokio::spawn(async move {
        let stage = stage_dir(&host.scratch, r.name());
        let result = run(&host, &stage, &req, &file, estimate, &cancel).await;
        let _ = std::fs::remove_dir_all(&stage);
        if result.is_err() {
            let rr = r.clone();
            if let Err(e) = blocking(move || rr.abandon_received()).await {
                tracing::warn!(replica = r.name(), error = %e, "clone: cleaning up failed (done at the next load)");
            }
        }
        host.clone.end(result, cancel.is_cancelled(), r.name());
    });
    Ok(())
}

async fn run(
    host: &CloneTarget,
    stage: &Path,
    req: &CloneRequest,
    file: &str,
    estimate: u64,
    cancel: &CancellationToken,
) -> std::result::Result<(), String> {
    let r = host.replica.clone();
    let rr = r.clone();
    blocking(move || rr.abandon_received()).await?;
    let _ = std::fs::remove_dir_all(stage);
    std::fs::create_dir_all(stage).map_err(|e| format!("create {}: {e}", stage.display()))?;
    let staged = stage.join(file);
    let tracker: &CloneTracker = &host.clone;
    let size = r.size();
    receive(
        size,
        tracker,
        host.listen_ip,
        req,
        file,
        &staged,
        estimate,
        cancel,
    )
    .await?;
    if cancel.is_cancelled() {
        return Err("cancelled".into());
    }
    let disk = v1::DiskInfo {
        name: file.to_owned(),
        user_created: true,
        created: crate::meta::now_rfc3339(),
        ..Default::default()
    };
    let f = file.to_owned();
    blocking(move || {
        let got = std::fs::metadata(&staged)
            .map_err(|e| ReplicaError::io("stat", &staged, e))?
            .len();
        if got != size {
            return Err(ReplicaError::InvalidArgument(format!(
                "received clone {} is {got} bytes, the volume is {size}",
                staged.display()
            )));
        }
        r.import_received(&staged, &disk, None)?;
        r.commit_clone(&f)
    })
    .await
}
