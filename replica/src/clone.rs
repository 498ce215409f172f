//! Snapshot clone, target side (`SnapshotClone`): this replica receives a snapshot of another volume's replica
//! (exported flattened by the source's `VolumeExport`, see [`crate::export`]) into a new snapshot file and makes it
//! its chain: the clone becomes a root snapshot with a new empty head over it, like a revert (the old head's data
//! is discarded; older snapshots of this replica stay as a side branch).
//!
//! A clone is all or nothing. The data arrives in `<snapshot>.img.clone` (the receiver writes
//! `<snapshot>.img.clone.sync-partial` and renames it only after an fsync at the sender's close). The commit then
//! runs in the order of a revert: new head + its meta, the snapshot's meta, the snapshot's image as a hard link of
//! the `.clone` file, and `volume.meta` naming the new head (the commit point); the `.clone` name, the old head and
//! its meta go last. [`crate::layout`] recognises every intermediate state at open: a `.clone` file whose snapshot is
//! not in the live chain is an uncommitted clone, and it goes together with the snapshot image that shares its
//! inode and that image's meta; a committed one loses only its `.clone` name.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use corral_proto::ReplicaAddress;
use corral_proto::grpc::{GrpcTimeouts, connect_endpoint};
use corral_proto::v1::{
    self, replica_service_client::ReplicaServiceClient, sync_agent_service_client::SyncAgentServiceClient,
};
use sparse_sync::receiver::{Receiver, ReceiverConfig, partial_path};
use sparse_sync::{ReceiveOutcome, ReceiveSummary};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::chain::{Layer, build_map, create_layer_file};
use crate::error::{IoContext, ReplicaError, Result};
use crate::export::snapshot_file;
use crate::jobs::JobState;
use crate::locks::{lock, write_lock};
use crate::meta::{DiskMeta, now_rfc3339, remove_if_exists, sync_dir, write_json_atomic};
use crate::names::{self, CLONE_SUFFIX, VOLUME_META};
use crate::replica::Replica;

/// How long the receiver waits for the source's next request before the clone fails.
const RECEIVER_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the export's answer may lag behind the receiver's commit.
const EXPORT_REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// Status of the clone into this replica.
#[derive(Debug, Clone, Default)]
pub struct CloneStatus {
    pub state: JobState,
    pub error: String,
    /// The source replica's address.
    pub from: String,
    /// The snapshot's file name.
    pub snapshot: String,
    pub progress: u32,
    /// Data bytes moved into this replica (over the network, or copied locally).
    pub bytes_sent: u64,
    /// Of those, bytes copied from the source's files on this host (`crate::local_copy`).
    pub bytes_local: u64,
}

impl CloneStatus {
    /// The wire message.
    pub fn to_proto(&self) -> v1::JobStatusResponse {
        v1::JobStatusResponse {
            is_running: self.state == JobState::InProgress,
            state: self.state.as_str().into(),
            progress: if self.state == JobState::Complete {
                100
            } else {
                self.progress
            },
            error: self.error.clone(),
            bytes_transferred: self.bytes_sent,
            from_addresses: if self.from.is_empty() {
                vec![]
            } else {
                vec![self.from.clone()]
            },
            files_done: u32::from(self.state == JobState::Complete),
            files_total: u32::from(self.state != JobState::None),
            snapshot_name: self.snapshot.clone(),
            bytes_copied_locally: self.bytes_local,
            ..Default::default()
        }
    }
}

/// The clone job slot of one replica daemon.
#[derive(Debug, Default)]
pub struct CloneTracker {
    status: Mutex<CloneStatus>,
}

impl CloneTracker {
    /// Is a clone running?
    pub fn is_running(&self) -> bool {
        lock(&self.status).state == JobState::InProgress
    }

    /// The current status.
    pub fn status(&self) -> CloneStatus {
        lock(&self.status).clone()
    }

    /// Marks a clone of `file` from `from` running; refused while one runs.
    pub(crate) fn begin(&self, from: &ReplicaAddress, file: &str) -> Result<()> {
        let mut s = lock(&self.status);
        if s.state == JobState::InProgress {
            return Err(ReplicaError::FailedPrecondition(
                "a clone is already running on this replica".into(),
            ));
        }
        *s = CloneStatus {
            state: JobState::InProgress,
            from: from.to_string(),
            snapshot: file.to_owned(),
            ..Default::default()
        };
        Ok(())
    }

    /// Records the end of the running clone (`cancelled`: its error is a cancellation).
    pub(crate) fn end(&self, result: std::result::Result<(), String>, cancelled: bool, replica: &str) {
        let mut s = lock(&self.status);
        match result {
            Ok(()) => {
                s.state = JobState::Complete;
                info!(replica, snapshot = %s.snapshot, "clone complete");
            }
            Err(e) => {
                warn!(replica, snapshot = %s.snapshot, error = %e, "clone failed");
                s.state = if cancelled {
                    JobState::Cancelled
                } else {
                    JobState::Error
                };
                s.error = e;
            }
        }
    }
}

/// What a `SnapshotClone` asks for.
#[derive(Debug, Clone)]
pub struct CloneRequest {
    /// The source replica: its control endpoint answers `ReplicaGet`, its sync endpoint serves the export.
    pub from: ReplicaAddress,
    /// The snapshot to clone (name or file name).
    pub snapshot_file_name: String,
    /// Blocks no snapshot layer holds come from the source's backing image.
    pub export_backing_image_if_exist: bool,
    /// Send rate limit of the source's export (0: none).
    pub max_bytes_per_second: u64,
}

impl CloneRequest {
    /// The request of a `SnapshotClone` call; refuses a bad source address.
    pub fn from_proto(req: v1::SnapshotCloneRequest) -> Result<Self> {
        Ok(Self {
            from: req
                .from_address
                .parse()
                .map_err(|e| ReplicaError::InvalidArgument(format!("clone source: {e}")))?,
            snapshot_file_name: req.snapshot_file_name,
            export_backing_image_if_exist: req.export_backing_image_if_exist,
            max_bytes_per_second: req.max_bytes_per_second,
        })
    }
}

/// What the target checks on the source before it starts: the snapshot exists, is not removed, and the volume
/// sizes agree. Returns the sum of the allocated sizes of the snapshot's chain (the progress estimate).
pub(crate) async fn check_source(address: &ReplicaAddress, snapshot: &str, size: u64) -> Result<u64> {
    let ch = connect_endpoint(&address.control, GrpcTimeouts::CONTROL)
        .await
        .map_err(|e| ReplicaError::FailedPrecondition(format!("source replica {address}: {e}")))?;
    let src = ReplicaServiceClient::new(ch)
        .replica_get(v1::Empty {})
        .await
        .map_err(|e| ReplicaError::FailedPrecondition(format!("source replica {address}: {}", e.message())))?
        .into_inner()
        .replica
        .unwrap_or_default();
    let Some(disk) = src.disks.get(snapshot) else {
        return Err(ReplicaError::NotFound(format!(
            "snapshot {snapshot} on source replica {address}"
        )));
    };
    if disk.removed {
        return Err(ReplicaError::FailedPrecondition(format!(
            "snapshot {snapshot} on source replica {address} is marked removed"
        )));
    }
    if src.size != size {
        return Err(ReplicaError::InvalidArgument(format!(
            "source replica {address} is {} bytes but this replica is {size} bytes: a clone needs volumes of the \
             same size",
            src.size
        )));
    }
    let mut estimate = 0;
    let mut cur = snapshot.to_owned();
    for _ in 0..src.disks.len() {
        let Some(d) = src.disks.get(&cur) else { break };
        estimate += d.size;
        if d.parent.is_empty() {
            break;
        }
        cur.clone_from(&d.parent);
    }
    Ok(estimate)
}

/// Starts a clone into `replica`; returns once the request is validated and the job runs.
pub async fn start(
    replica: Arc<Replica>,
    tracker: Arc<CloneTracker>,
    rebuilding: bool,
    listen_ip: IpAddr,
    local_copy: bool,
    req: CloneRequest,
    cancel: CancellationToken,
) -> Result<()> {
    let file = snapshot_file(&req.snapshot_file_name)?;
    let status = replica.status()?;
    if rebuilding || status.rebuilding {
        return Err(ReplicaError::FailedPrecondition(
            "a rebuild is running on this replica; clone after it finishes".into(),
        ));
    }
    if status.disks.contains_key(&file) {
        return Err(ReplicaError::AlreadyExists(format!(
            "snapshot {file} on this replica"
        )));
    }
    if tracker.is_running() {
        return Err(ReplicaError::FailedPrecondition(
            "a clone is already running on this replica".into(),
        ));
    }
    let estimate = check_source(&req.from, &file, status.size).await?;
    tracker.begin(&req.from, &file)?;
    info!(dir = %replica.dir().display(), snapshot = %file, from = %req.from, "clone started");
    tokio::spawn(async move {
        let result = run(
            &replica,
            &tracker,
            (listen_ip, local_copy),
            &req,
            &file,
            estimate,
            &cancel,
        )
        .await;
        tracker.end(
            result,
            cancel.is_cancelled(),
            &replica.dir().display().to_string(),
        );
    });
    Ok(())
}

async fn run(
    replica: &Arc<Replica>,
    tracker: &CloneTracker,
    (listen_ip, local_copy): (IpAddr, bool),
    req: &CloneRequest,
    file: &str,
    estimate: u64,
    cancel: &CancellationToken,
) -> std::result::Result<(), String> {
    let dir = replica.dir().to_owned();
    let tmp_name = format!("{file}{CLONE_SUFFIX}");
    let tmp = dir.join(&tmp_name);
    remove_if_exists(&tmp).map_err(|e| e.to_string())?;
    remove_if_exists(&partial_path(&tmp)).map_err(|e| e.to_string())?;
    let local = if local_copy {
        let ask = v1::LocalFilesRequest {
            snapshot_file_name: file.to_owned(),
            chain: true,
            expected_size: replica.size(),
            export_backing_image_if_exist: req.export_backing_image_if_exist,
        };
        crate::local_copy::offer(&req.from, ask, 0)
            .await
            .inspect_err(|why| info!(snapshot = %file, reason = %why, "clone: no local copy, pulling over the network"))
            .ok()
    } else {
        None
    };
    let result = match local {
        Some(src) => copy_local(tracker, src, req, &tmp, cancel).await,
        None => {
            receive(
                replica.size(),
                tracker,
                listen_ip,
                req,
                file,
                &tmp,
                estimate,
                cancel,
            )
            .await
        }
    };
    let result = match result {
        Ok(()) => {
            let r = replica.clone();
            let (f, t) = (file.to_owned(), tmp_name.clone());
            tokio::task::spawn_blocking(move || r.adopt_clone(&f, &t))
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string()))
        }
        Err(e) => Err(e),
    };
    if result.is_err() {
        // Nothing of a failed clone stays (the receiver removes its partial file itself).
        let _ = remove_if_exists(&tmp);
        let _ = remove_if_exists(&partial_path(&tmp));
    }
    result
}

/// The clone's data copied from the source's files on this host into `tmp` (see [`crate::local_copy`]).
async fn copy_local(
    tracker: &CloneTracker,
    mut src: crate::local_copy::LocalSource,
    req: &CloneRequest,
    tmp: &Path,
    cancel: &CancellationToken,
) -> std::result::Result<(), String> {
    let dir = src.dir.clone();
    let layers: Vec<Layer> = src
        .files
        .iter()
        .map(|(name, f)| {
            f.try_clone().map(|file| Layer {
                name: name.clone(),
                file,
            })
        })
        .collect::<std::io::Result<_>>()
        .map_err(|e| format!("source files: {e}"))?;
    let view = tokio::task::spawn_blocking(move || crate::export::SnapshotView::from_layers(&dir, layers))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    info!(from = %src.dir.display(), layers = src.files.len(), "clone: copying the source's files on this host");
    let progress = Arc::new(sparse_sync::Progress::new());
    let max_rate = (req.max_bytes_per_second > 0).then_some(req.max_bytes_per_second);
    let summary = {
        let copy = src.copy(
            Arc::new(view),
            (tmp.to_owned(), partial_path(tmp)),
            (max_rate, None),
            progress.clone(),
            cancel,
        );
        tokio::pin!(copy);
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                s = &mut copy => break s.map_err(|e| format!("export from {}: {e}", req.from))?,
                _ = tick.tick() => lock(&tracker.status).progress = u32::from(progress.percent()).min(99),
            }
        }
    };
    if let Err(e) = src.confirm() {
        let _ = remove_if_exists(tmp);
        return Err(format!("export from {}: {e}", req.from));
    }
    info!(
        data = summary.local.data_bytes,
        by_kernel = summary.kernel_bytes,
        "clone: local copy done"
    );
    let mut s = lock(&tracker.status);
    s.bytes_sent = summary.local.data_bytes;
    s.bytes_local = summary.local.data_bytes;
    Ok(())
}

/// Receives the export of `req`'s snapshot (`file`, `size` bytes) from the source into `tmp` over the network.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn receive(
    size: u64,
    tracker: &CloneTracker,
    listen_ip: IpAddr,
    req: &CloneRequest,
    file: &str,
    tmp: &Path,
    estimate: u64,
    cancel: &CancellationToken,
) -> std::result::Result<(), String> {
    let mut cfg = ReceiverConfig::new(tmp);
    cfg.idle_timeout = RECEIVER_IDLE_TIMEOUT;
    let receiver = Receiver::bind(SocketAddr::new(listen_ip, 0), cfg)
        .await
        .map_err(|e| e.to_string())?;
    let to = receiver.local_addr();
    let rcancel = cancel.child_token();
    let mut recv = tokio::spawn(receiver.run(rcancel.clone()));

    let export = async {
        let ch = connect_endpoint(&req.from.sync, GrpcTimeouts::CONTROL)
            .await
            .map_err(|e| format!("source replica {}: {e}", req.from))?;
        let mut client = SyncAgentServiceClient::new(ch);
        client
            .volume_export(v1::VolumeExportRequest {
                snapshot_file_name: file.to_owned(),
                host: to.ip().to_string(),
                port: u32::from(to.port()),
                export_backing_image_if_exist: req.export_backing_image_if_exist,
                expected_size: size,
                max_bytes_per_second: req.max_bytes_per_second,
            })
            .await
            .map(tonic::Response::into_inner)
            .map_err(|e| format!("export from {}: {}", req.from, e.message()))
    };
    tokio::pin!(export);
    let partial = partial_path(tmp);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let finish = |summary: ReceiveSummary| match summary.outcome {
        ReceiveOutcome::Completed => Ok(()),
        o => Err(format!("receiver ended without the snapshot: {o:?}")),
    };
    loop {
        tokio::select! {
            sent = &mut export => {
                let sent = match sent {
                    Ok(s) => s,
                    Err(e) => {
                        rcancel.cancel();
                        let _ = recv.await;
                        return Err(e);
                    }
                };
                lock(&tracker.status).bytes_sent = sent.bytes_sent;
                let summary = recv.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
                return finish(summary);
            }
            summary = &mut recv => {
                let summary = summary.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
                finish(summary)?;
                let sent = tokio::time::timeout(EXPORT_REPLY_TIMEOUT, &mut export)
                    .await
                    .map_err(|_| "the source did not confirm the export".to_owned())??;
                lock(&tracker.status).bytes_sent = sent.bytes_sent;
                return Ok(());
            }
            _ = tick.tick() => {
                let have = std::fs::metadata(&partial).map(|m| m.blocks() * 512).unwrap_or(0);
                if let Some(pct) = (have.min(estimate) * 99).checked_div(estimate) {
                    lock(&tracker.status).progress = u32::try_from(pct).unwrap_or(99);
                }
            }
        }
    }
}

impl Replica {
    /// Makes the received file `tmp` (in this directory) the snapshot `file` at the root of a new chain, with a new
    /// empty head over it. IO is blocked for the duration (a few fsyncs).
    pub(crate) fn adopt_clone(&self, file: &str, tmp: &str) -> Result<()> {
        let _shape = lock(&self.shape);
        if self.purging.load(Ordering::Acquire) {
            return Err(ReplicaError::FailedPrecondition(
                "cannot adopt a clone while a purge runs".into(),
            ));
        }
        let mut chain = self.chain_write_open()?;
        let dir = self.dir.clone();
        if chain.disks.contains_key(file) || dir.join(file).exists() {
            return Err(ReplicaError::AlreadyExists(format!(
                "snapshot {file} on this replica"
            )));
        }
        let size = chain.info.size;
        let got = std::fs::metadata(dir.join(tmp)).ctx("stat", dir.join(tmp))?.len();
        if got != size {
            return Err(ReplicaError::InvalidArgument(format!(
                "received clone {tmp} is {got} bytes, the volume is {size}"
            )));
        }
        let old_head = chain.info.head.clone();
        let new_head = names::head_file(names::head_index(&old_head).unwrap_or(0) + 1);
        remove_if_exists(&dir.join(&new_head))?;
        let head_file = create_layer_file(&dir.join(&new_head), size)?;
        let head_meta = DiskMeta {
            name: new_head.clone(),
            parent: file.to_owned(),
            created: now_rfc3339(),
            ..Default::default()
        };
        write_json_atomic(&dir, &names::meta_file(&new_head), &head_meta)?;
        let snap_meta = DiskMeta {
            name: file.to_owned(),
            parent: String::new(),
            removed: false,
            user_created: true,
            created: now_rfc3339(),
            labels: BTreeMap::new(),
        };
        write_json_atomic(&dir, &names::meta_file(file), &snap_meta)?;
        std::fs::hard_link(dir.join(tmp), dir.join(file)).ctx("link", dir.join(file))?;
        sync_dir(&dir)?;
        let mut info = chain.info.clone();
        info.head.clone_from(&new_head);
        info.parent = file.to_owned();
        info.dirty = true;
        write_json_atomic(&dir, VOLUME_META, &info)?; // commit point
        remove_if_exists(&dir.join(tmp))?;
        remove_if_exists(&dir.join(&old_head))?;
        remove_if_exists(&dir.join(names::meta_file(&old_head)))?;
        sync_dir(&dir)?;

        let snap_file = std::fs::File::open(dir.join(file)).ctx("open", dir.join(file))?;
        let layers = vec![
            Layer {
                name: file.to_owned(),
                file: snap_file,
            },
            Layer {
                name: new_head.clone(),
                file: head_file,
            },
        ];
        let map = build_map(&dir, &layers)?;
        chain.info = info;
        chain.disks.remove(&old_head);
        chain.disks.insert(file.to_owned(), snap_meta);
        chain.disks.insert(new_head, head_meta);
        chain.layers = layers;
        *write_lock(&self.map) = map;
        info!(dir = %dir.display(), snapshot = %file, "clone adopted as the chain");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::ReplicaOptions;

    const SIZE: u64 = 1 << 20;

    /// A closed replica holding 0x11 in its first block, and a received clone file holding 0x22 there.
    fn fixture() -> (tempfile::TempDir, PathBuf) {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().to_owned();
        let r = Replica::create(&dir, SIZE, &ReplicaOptions::default()).unwrap();
        r.write_at(0, &[0x11; 4096]).unwrap();
        r.close().unwrap();
        received(&dir);
        (t, dir)
    }

    fn received(dir: &Path) {
        let f = std::fs::File::create(dir.join("volume-snap-c.img.clone")).unwrap();
        f.set_len(SIZE).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[0x22; 4096], 0).unwrap();
    }

    fn first_byte(r: &Replica) -> u8 {
        let mut b = [0u8; 1];
        r.read_at(0, &mut b).unwrap();
        b[0]
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// The steps of [`Replica::adopt_clone`] before its commit point, `n` of them done.
    fn uncommitted(dir: &Path, n: usize) {
        if n >= 1 {
            create_layer_file(&dir.join("volume-head-001.img"), SIZE).unwrap();
            let m = DiskMeta {
                name: "volume-head-001.img".into(),
                parent: "volume-snap-c.img".into(),
                ..Default::default()
            };
            write_json_atomic(dir, "volume-head-001.img.meta", &m).unwrap();
        }
        if n >= 2 {
            let m = DiskMeta {
                name: "volume-snap-c.img".into(),
                ..Default::default()
            };
            write_json_atomic(dir, "volume-snap-c.img.meta", &m).unwrap();
        }
        if n >= 3 {
            std::fs::hard_link(dir.join("volume-snap-c.img.clone"), dir.join("volume-snap-c.img")).unwrap();
        }
    }

    #[test]
    fn an_uncommitted_clone_disappears_at_open_at_every_step() {
        for n in 0..=3 {
            let (_t, dir) = fixture();
            let before = names(&dir);
            std::fs::write(dir.join("volume-snap-c.img.clone.sync-partial"), b"x").unwrap();
            uncommitted(&dir, n);
            let r = Replica::open(&dir, &ReplicaOptions::default()).unwrap();
            let s = r.status().unwrap();
            assert_eq!(s.chain, vec!["volume-head-000.img"], "step {n}");
            assert!(!s.disks.contains_key("volume-snap-c.img"), "step {n}");
            assert_eq!(first_byte(&r), 0x11, "step {n}");
            let mut want = before.clone();
            want.retain(|f| f != "volume-snap-c.img.clone");
            assert_eq!(names(&dir), want, "step {n}: leftovers remain");
        }
    }

    #[test]
    fn a_committed_clone_keeps_its_snapshot_and_loses_the_clone_name_at_open() {
        let (_t, dir) = fixture();
        uncommitted(&dir, 3);
        let mut info: crate::meta::VolumeInfo =
            crate::meta::load_json(&dir.join(VOLUME_META)).unwrap().unwrap();
        info.head = "volume-head-001.img".into();
        info.parent = "volume-snap-c.img".into();
        write_json_atomic(&dir, VOLUME_META, &info).unwrap();
        let r = Replica::open(&dir, &ReplicaOptions::default()).unwrap();
        assert_eq!(
            r.status().unwrap().chain,
            vec!["volume-head-001.img", "volume-snap-c.img"]
        );
        assert_eq!(first_byte(&r), 0x22);
        let files = names(&dir);
        assert!(!files.iter().any(|f| f.ends_with(CLONE_SUFFIX)), "{files:?}");
        assert!(
            !files.iter().any(|f| f.starts_with("volume-head-000")),
            "{files:?}"
        );
    }

    #[test]
    fn adopting_a_clone_makes_it_the_chain_and_refuses_a_wrong_size() {
        let (_t, dir) = fixture();
        let r = Replica::open(&dir, &ReplicaOptions::default()).unwrap();
        received(&dir); // open removed the one of the fixture as a leftover
        std::fs::write(dir.join("volume-snap-short.img.clone"), b"short").unwrap();
        let e = r
            .adopt_clone("volume-snap-short.img", "volume-snap-short.img.clone")
            .unwrap_err();
        assert!(e.to_string().contains("is 5 bytes"), "{e}");
        assert_eq!(r.status().unwrap().chain, vec!["volume-head-000.img"]);
        r.adopt_clone("volume-snap-c.img", "volume-snap-c.img.clone")
            .unwrap();
        assert_eq!(first_byte(&r), 0x22);
        assert_eq!(
            r.status().unwrap().chain,
            vec!["volume-head-001.img", "volume-snap-c.img"]
        );
        assert!(!dir.join("volume-snap-c.img.clone").exists());
        r.write_at(0, &[0x33; 512]).unwrap();
        drop(r);
        let r = Replica::open(&dir, &ReplicaOptions::default()).unwrap();
        assert_eq!(first_byte(&r), 0x33);
    }
}
