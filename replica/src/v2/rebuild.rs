//! Rebuild of a v2 replica, both ends, over the same gRPC calls and sparse-sync protocol as v1 (so v1 and v2
//! replicas rebuild from each other).
//!
//! - **Source** (`FileSend`): a snapshot lvol is sent read-only as
//!   [`LvolSnapshot`](super::snapshot_view::LvolSnapshot), a [`SparseRead`](corral_disk::sparse::SparseRead) whose data
//!   ranges are the blocks the snapshot holds itself (what a v1 snapshot file holds), read from the lvstore.
//! - **Target** (`FilesSync`): each snapshot, parents first, is received by the sparse-sync receiver into a
//!   staging file in the daemon's scratch directory, then written into the store as `NAME.rcvw.SNAP` (a clone of
//!   the received parent, or a new lvol for a root), frozen as snapshot `NAME.rcv.SNAP` with its metadata xattr,
//!   and the staging file removed. When all are in, the head (written since the engine's rebuild snapshot) is put
//!   over the received copy of its parent by one journaled `reparent` — the commit point — then the old snapshots
//!   are deleted and the received ones renamed to `NAME.snap.SNAP` ([`LvolReplica::commit_received`]). A failed
//!   rebuild deletes what it received; after a crash, loading the replica does the same, or finishes a committed
//!   one (`docs/formats.md`, "v2 replica").

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use corral_proto::v1;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::lvol::LvolReplica;
use crate::error::ReplicaError;
use crate::rebuild::{
    ATTEMPTS, RebuildTracker, parse_sources, send_snapshot, sync_one, validate_file, validate_files,
};

/// Source side: sends snapshot `req.file_name` of `r` to a receiver.
pub async fn file_send(
    r: Arc<LvolReplica>,
    req: &v1::FileSendRequest,
) -> Result<v1::FileSendResponse, ReplicaError> {
    validate_file(&req.file_name)?;
    let (content, _reading) = r.snapshot_for_sending(&req.file_name)?;
    let sent = send_snapshot(Arc::new(content), None, req).await?;
    info!(replica = r.name(), file = %req.file_name, sent = sent.bytes_sent, "rebuild: snapshot lvol sent");
    Ok(sent)
}

/// Where the staging files of `replica`'s rebuild go.
fn stage_dir(scratch: &Path, replica: &str) -> PathBuf {
    scratch.join(format!(".corral-rebuild-{replica}"))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ReplicaError> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}

/// Target side: starts a rebuild (`FilesSync`) into `r`; returns once the job runs.
pub async fn start(
    r: Arc<LvolReplica>,
    tracker: Arc<RebuildTracker>,
    (listen_ip, scratch): (IpAddr, PathBuf),
    (req, generation): (v1::FilesSyncRequest, u64),
    cancel: CancellationToken,
) -> Result<(), ReplicaError> {
    let sources = parse_sources(&req.from_addresses)?;
    validate_files(&req.files)?;
    if !r.is_open() {
        return Err(ReplicaError::FailedPrecondition(format!(
            "replica {} is not open",
            r.name()
        )));
    }
    // Refused before it starts (and before anything is received) when this disk lacks the source's image.
    let backing_image = if req.backing_image.is_empty() {
        None
    } else {
        Some(super::backing_image::repoint(r.store(), &req.backing_image)?)
    };
    tracker.begin(&sources, &req.files, generation)?;
    let stage = stage_dir(&scratch, r.name());
    tokio::spawn(async move {
        let target = (&r, backing_image.as_deref());
        let result = run(target, &stage, &tracker, listen_ip, &sources, &req, &cancel).await;
        let _ = std::fs::remove_dir_all(&stage);
        match &result {
            Ok(()) => info!(
                replica = r.name(),
                files = req.files.len(),
                "rebuild: snapshot lvols received"
            ),
            Err(e) => {
                warn!(replica = r.name(), error = %e, "rebuild failed; deleting what it received");
                let rr = r.clone();
                if let Err(e) = blocking(move || rr.abandon_received()).await {
                    warn!(replica = r.name(), error = %e, "rebuild: cleaning up failed (done at the next load)");
                }
            }
        }
        tracker.end(result, cancel.is_cancelled());
    });
    Ok(())
}

/// `target`: the replica and this store's copy of the source's backing image, if it has one.
async fn run(
    (r, backing_image): (&Arc<LvolReplica>, Option<&str>),
    stage: &Path,
    tracker: &RebuildTracker,
    listen_ip: IpAddr,
    sources: &[corral_proto::ReplicaAddress],
    req: &v1::FilesSyncRequest,
    cancel: &CancellationToken,
) -> Result<(), String> {
    let rr = r.clone();
    blocking(move || rr.abandon_received()).await?;
    let _ = std::fs::remove_dir_all(stage);
    std::fs::create_dir_all(stage).map_err(|e| format!("create {}: {e}", stage.display()))?;
    for (i, f) in req.files.iter().enumerate() {
        let mut last = String::new();
        let mut ok = false;
        for attempt in 0..ATTEMPTS {
            if cancel.is_cancelled() {
                return Err("cancelled".into());
            }
            let source = &sources[(i + attempt) % sources.len()];
            // No whole-file skip: the staging file is new, nothing recorded to compare with.
            let max_rate = Some(req.max_bytes_per_second).filter(|r| *r > 0);
            match sync_one((stage, listen_ip), source, f, (false, max_rate), tracker, cancel).await {
                Ok(()) => {
                    ok = true;
                    break;
                }
                Err(e) => {
                    warn!(file = %f.name, source = %source, attempt, error = %e, "rebuild: snapshot sync failed");
                    last = format!("{} from {source}: {e}", f.name);
                    tokio::time::sleep(Duration::from_millis(500 << attempt)).await;
                }
            }
        }
        if !ok {
            return Err(last);
        }
        let (rr, staged, disk) = (r.clone(), stage.join(&f.name), f.clone());
        let bi = backing_image.map(str::to_owned);
        blocking(move || rr.import_received(&staged, &disk, bi.as_deref())).await?;
        tracker.file_done(f.size);
    }
    let (rr, files) = (r.clone(), req.files.clone());
    blocking(move || rr.commit_received(&files)).await
}
