//! v2 backing images on one disk (issue 21, seed 001): a disk's copy of backing image `NAME` is the read-only
//! snapshot lvol `bi-NAME-disk-LVSUUID` in the disk's lvstore, which a v2 replica's head is cloned from.
//!
//! A create fills a temp head `bi-NAME-disk-LVSUUID-temp-head` from the source (an HTTP URL — the backing-image
//! manager's uncompressed download —, a file, or another disk's ready copy), hashing every byte with SHA-512 as it goes and writing only the
//! 4 KiB blocks that hold data (holes stay holes; the hash still covers the zeros). Then, in this order (the crash
//! order, `docs/formats.md`, "v2 backing image"): store flush (the data is durable), snapshot of the temp head as
//! `bi-NAME-disk-LVSUUID`, xattrs `backingImageUUID`, `checksum` and last `state` = `ready`, delete of the temp
//! head. A failure (source error, size or checksum mismatch, cancel) deletes what the create made; a crash is
//! cleaned up at the next start ([`BackingImages::recover`]): temp heads, and snapshots without `state` = `ready`,
//! are deleted. The copies themselves are listed from the snapshot lvols' xattrs — nothing is downloaded again.
//!
//! A sync between two stores (seed 001's `BackingImageExpose`): the target asks the source daemon for its copy's
//! size and SHA-512 (`BackingImageGet`), creates the temp head, binds a sparse-sync receiver (the protocol and
//! receiver a rebuild uses) whose [`ReceiveSink`](sparse_sync::ReceiveSink) is that temp head, and asks the source
//! to expose its copy to it; the source sends its snapshot lvol read-only as [`LvolSnapshot`] (data blocks only, so
//! holes stay holes), exactly as a rebuild's `FileSend` sends a replica's snapshot lvol. Every byte is written
//! once, straight into the temp head; as batches arrive out of order, the SHA-512 is computed over the temp head
//! once it is complete (reading its data blocks, hashing zeros for its holes) and checked before the snapshot is
//! made, as for any create. A failure (source gone, checksum mismatch, cancel) deletes the temp head; a daemon
//! killed mid-sync leaves a temp head that the next start deletes.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use corral_proto::backing_image::FileState;
use corral_proto::v1;
use lvstore::{BlobId, BlobKind, LvStore};
use sha2::{Digest, Sha512};
use tokio::io::AsyncReadExt;
use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::snapshot_view::LvolSnapshot;
use crate::error::{ReplicaError, Result, lv_err};
use crate::locks::lock;

/// Snapshot xattr: the backing image's UUID.
pub const XATTR_BACKING_IMAGE_UUID: &str = "backingImageUUID";
/// Snapshot xattr: `ready` once the copy is complete and verified (written last).
pub const XATTR_STATE: &str = "state";
/// Snapshot xattr: SHA-512 (hex) of the copy's data.
pub const XATTR_CHECKSUM: &str = "checksum";
/// Prefix of every backing-image lvol name.
const PREFIX: &str = "bi-";
/// Infix before the lvstore UUID.
const DISK_INFIX: &str = "-disk-";
/// Suffix of the lvol a create fills.
const TEMP_HEAD_SUFFIX: &str = "-temp-head";
const BLOCK: usize = 4096;
/// Bytes read from the source, hashed and written per step.
const CHUNK: usize = 1 << 20;
const CANCELLED: &str = "cancelled (deleted, or the daemon is stopping)";
/// Status changes buffered for each watcher.
const WATCH_BACKLOG: usize = 256;
/// Prefix of the staging files syncs of earlier versions made in the scratch directory (removed at start).
const STAGING_PREFIX: &str = ".corral-bi-sync-";
/// Share of a sync's progress given to receiving (the rest is the checksum pass over the temp head).
const RECEIVE_SHARE: u64 = 90;

/// The snapshot lvol holding backing image `name` in the store `lvs_uuid`.
pub fn copy_lvol(name: &str, lvs_uuid: &str) -> String {
    format!("{PREFIX}{name}{DISK_INFIX}{lvs_uuid}")
}

fn temp_head(lvol: &str) -> String {
    format!("{lvol}{TEMP_HEAD_SUFFIX}")
}

/// Whether `lvol` is a backing image's snapshot or temp head (never a replica's lvol).
pub fn is_backing_image_lvol(lvol: &str) -> bool {
    lvol.starts_with(PREFIX) && lvol.contains(DISK_INFIX)
}

/// The image name of `lvol` when it is a copy in store `lvs_uuid` (`bi-NAME-disk-LVSUUID`).
fn image_name<'a>(lvol: &'a str, lvs_uuid: &str) -> Option<&'a str> {
    lvol.strip_prefix(PREFIX)?
        .strip_suffix(lvs_uuid)?
        .strip_suffix(DISK_INFIX)
        .filter(|n| !n.is_empty())
}

/// The image name of a copy's lvol in any store (`bi-NAME-disk-LVSUUID`).
pub fn image_of(lvol: &str) -> Option<&str> {
    lvol.strip_prefix(PREFIX)?
        .rsplit_once(DISK_INFIX)
        .map(|(name, _)| name)
        .filter(|n| !n.is_empty() && !lvol.ends_with(TEMP_HEAD_SUFFIX))
}

/// Seed 001's rebuild rename: the copy in `store` of the image whose copy in another store is `source_lvol`
/// (`bi-NAME-disk-SOURCELVS` becomes `bi-NAME-disk-THISLVS`). Refused unless this store holds a ready copy, so
/// a rebuilt replica never reads zeros where its source reads the image.
pub fn repoint(store: &LvStore, source_lvol: &str) -> Result<String> {
    let Some(name) = image_of(source_lvol) else {
        return Err(ReplicaError::FailedPrecondition(format!(
            "the source replica sits on backing file {source_lvol:?}, not a v2 backing image: a v2 replica \
             cannot be rebuilt from it"
        )));
    };
    let lvol = copy_lvol(name, &store.uuid());
    let ready = store.info(&lvol).ok().is_some_and(|l| {
        l.kind == BlobKind::Snapshot
            && l.xattrs.get(XATTR_STATE).map(String::as_str) == Some(FileState::Ready.as_str())
    });
    if !ready {
        return Err(ReplicaError::FailedPrecondition(format!(
            "the source replica sits on v2 backing image {name} and this disk has no ready copy of it ({lvol}): \
             make the copy on this disk first"
        )));
    }
    Ok(lvol)
}

fn check_checksum(checksum: &str) -> Result<()> {
    let ok = checksum.is_empty()
        || (checksum.len() == 128
            && checksum
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
    if ok {
        Ok(())
    } else {
        Err(ReplicaError::InvalidArgument(format!(
            "checksum {checksum:?} is not a SHA-512: expected 128 lower-case hex digits"
        )))
    }
}

/// Where a create reads the image from.
#[derive(Debug, Clone)]
enum Source {
    Url(String),
    File(PathBuf),
    /// The `LvstoreService` address of a daemon holding a ready copy.
    Lvstore(String),
}

struct Copy {
    info: v1::BackingImageV2CopyInfo,
    cancel: CancellationToken,
    job: Option<JoinHandle<()>>,
    /// Exposures (sends to another disk) in progress; the copy is not deleted while any runs.
    exposed: usize,
    /// Cancels the exposures in progress (`BackingImageUnexpose`); replaced by a fresh token after.
    unexpose: CancellationToken,
}

/// The IP a sync's receiver binds to, the scratch directory where syncs of earlier versions staged what they
/// received (their leftovers are removed at start), and the bound on what an exposure sends per second.
#[derive(Debug, Clone)]
pub struct SyncStaging {
    pub listen_ip: IpAddr,
    pub scratch: PathBuf,
    /// Data bytes per second one exposure sends at most (`None`: as fast as it goes).
    pub max_send_rate: Option<u64>,
}

/// A sync's temp head as the sparse-sync receiver's sink: data blocks written where they arrive (all-zero
/// blocks skipped, so holes stay holes), progress reported by the highest offset written.
struct TempHeadSink {
    images: Arc<BackingImages>,
    name: String,
    id: BlobId,
    size: u64,
    /// End of the highest range written so far (batches arrive about in order, several at a time).
    high: std::sync::atomic::AtomicU64,
}

impl sparse_sync::ReceiveSink for TempHeadSink {
    fn size(&self) -> u64 {
        self.size
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        write_data_blocks(&self.images.store, self.id, offset, buf)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        let end = offset + buf.len() as u64;
        let before = self.high.fetch_max(end, std::sync::atomic::Ordering::Relaxed);
        if end > before {
            let progress = u32::try_from(end * RECEIVE_SHARE / self.size.max(1)).unwrap_or(0);
            self.images
                .update(&self.name, |i| i.progress = i.progress.max(progress));
        }
        Ok(())
    }

    fn commit(&self) -> std::io::Result<()> {
        self.images
            .store
            .flush()
            .map_err(|e| std::io::Error::other(e.to_string()))
    }
}

/// The backing-image copies of one disk's store.
pub struct BackingImages {
    store: Arc<LvStore>,
    lvs_uuid: String,
    staging: SyncStaging,
    copies: Mutex<BTreeMap<String, Copy>>,
    events: broadcast::Sender<v1::BackingImageV2CopyInfo>,
    cancel: CancellationToken,
}

impl std::fmt::Debug for BackingImages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackingImages")
            .field("lvs_uuid", &self.lvs_uuid)
            .finish_non_exhaustive()
    }
}

impl BackingImages {
    /// The copies `store` holds, from the snapshot lvols' xattrs, after deleting what an interrupted create left
    /// (temp heads; snapshots whose `state` is not `ready`; a sync's staging files). Blocking.
    pub fn recover(store: Arc<LvStore>, staging: SyncStaging, cancel: CancellationToken) -> Result<Self> {
        let lvs_uuid = store.uuid();
        let mut copies = BTreeMap::new();
        let lvols = store.list();
        for l in lvols.iter().filter(|l| is_backing_image_lvol(&l.name)) {
            if l.kind == BlobKind::Lvol && l.name.ends_with(TEMP_HEAD_SUFFIX) {
                warn!(lvol = %l.name, "deleting the temp head of an interrupted backing-image create");
                store.delete(&l.name).map_err(|e| lv_err(&store, e))?;
            }
        }
        // Staging files of this store's syncs only (their names end with the store's UUID, before any suffix).
        if let Ok(entries) = std::fs::read_dir(&staging.scratch) {
            for e in entries.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with(STAGING_PREFIX) && n.contains(&lvs_uuid) {
                    warn!(file = %n, "removing the staging file of an interrupted backing-image sync");
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        for l in store.list() {
            let Some(name) = image_name(&l.name, &lvs_uuid) else {
                continue;
            };
            if l.kind != BlobKind::Snapshot {
                continue;
            }
            let ready = l.xattrs.get(XATTR_STATE).map(String::as_str) == Some(FileState::Ready.as_str());
            if !ready && l.children.is_empty() {
                warn!(lvol = %l.name, "deleting the snapshot of an interrupted backing-image create");
                store.delete(&l.name).map_err(|e| lv_err(&store, e))?;
                continue;
            }
            let mut info = v1::BackingImageV2CopyInfo {
                name: name.to_owned(),
                uuid: l
                    .xattrs
                    .get(XATTR_BACKING_IMAGE_UUID)
                    .cloned()
                    .unwrap_or_default(),
                disk_uuid: lvs_uuid.clone(),
                size: l.size,
                progress: 100,
                state: FileState::Ready.as_str().to_owned(),
                current_checksum: l.xattrs.get(XATTR_CHECKSUM).cloned().unwrap_or_default(),
                message: String::new(),
                lvol: l.name.clone(),
            };
            if !ready {
                info.progress = 0;
                info.state = FileState::Failed.as_str().to_owned();
                info.message = format!("{} is not marked ready but replicas use it", l.name);
            }
            info!(image = name, lvol = %l.name, state = %info.state, "v2 backing image found in the store");
            copies.insert(
                name.to_owned(),
                Copy {
                    info,
                    cancel: cancel.child_token(),
                    job: None,
                    exposed: 0,
                    unexpose: cancel.child_token(),
                },
            );
        }
        let (events, _) = broadcast::channel(WATCH_BACKLOG);
        Ok(Self {
            store,
            lvs_uuid,
            staging,
            copies: Mutex::new(copies),
            events,
            cancel,
        })
    }

    /// The store's UUID (the copies' `diskUUID`).
    pub fn lvs_uuid(&self) -> &str {
        &self.lvs_uuid
    }

    /// Status changes from now on.
    pub fn watch(&self) -> broadcast::Receiver<v1::BackingImageV2CopyInfo> {
        self.events.subscribe()
    }

    /// Updates the record of `name` (if still there) and tells watchers.
    fn update(&self, name: &str, f: impl FnOnce(&mut v1::BackingImageV2CopyInfo)) {
        let mut copies = lock(&self.copies);
        if let Some(c) = copies.get_mut(name) {
            let before = c.info.clone();
            f(&mut c.info);
            if c.info != before {
                let _ = self.events.send(c.info.clone());
            }
        }
    }

    /// One copy's status; a ready copy whose lvol is gone reads `failed`.
    pub fn get(&self, name: &str) -> Result<v1::BackingImageV2CopyInfo> {
        let info = lock(&self.copies)
            .get(name)
            .map(|c| c.info.clone())
            .ok_or_else(|| ReplicaError::NotFound(format!("v2 backing image {name} on this disk")))?;
        Ok(self.verified(info))
    }

    /// Every copy's status.
    pub fn list(&self) -> Vec<v1::BackingImageV2CopyInfo> {
        let infos: Vec<_> = lock(&self.copies).values().map(|c| c.info.clone()).collect();
        infos.into_iter().map(|i| self.verified(i)).collect()
    }

    /// Seed 001's verify: a ready copy whose snapshot lvol is missing is `failed`, so the control plane makes it
    /// again.
    fn verified(&self, info: v1::BackingImageV2CopyInfo) -> v1::BackingImageV2CopyInfo {
        if info.state != FileState::Ready.as_str() || self.store.lookup(&info.lvol).is_ok() {
            return info;
        }
        let message = format!("the snapshot lvol {} is gone", info.lvol);
        self.update(&info.name, |i| {
            i.state = FileState::Failed.as_str().to_owned();
            i.progress = 0;
            i.message = message;
        });
        lock(&self.copies)
            .get(&info.name)
            .map(|c| c.info.clone())
            .unwrap_or(info)
    }

    /// Starts making this disk's copy of an image (answers at once, `pending`).
    pub fn create(
        self: &Arc<Self>,
        req: v1::BackingImageCreateRequest,
    ) -> Result<v1::BackingImageV2CopyInfo> {
        corral_disk::identity::check_path_component("backing image name", &req.name)
            .map_err(ReplicaError::InvalidArgument)?;
        corral_disk::identity::check_path_component("backing image uuid", &req.backing_image_uuid)
            .map_err(ReplicaError::InvalidArgument)?;
        check_checksum(&req.checksum)?;
        if !req.size.is_multiple_of(BLOCK as u64) {
            return Err(ReplicaError::InvalidArgument(format!(
                "backing image size {} is not a multiple of {BLOCK}: a v2 copy is an lvol",
                req.size
            )));
        }
        let source = match req.source {
            Some(v1::backing_image_create_request::Source::FromUrl(u))
                if u.starts_with("http://") || u.starts_with("https://") =>
            {
                Source::Url(u)
            }
            Some(v1::backing_image_create_request::Source::FromFile(p)) if p.starts_with('/') => {
                Source::File(PathBuf::from(p))
            }
            Some(v1::backing_image_create_request::Source::FromLvstore(a))
                if a.parse::<SocketAddr>().is_ok()
                    || a.rsplit_once(':')
                        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()) =>
            {
                Source::Lvstore(a)
            }
            other => {
                return Err(ReplicaError::InvalidArgument(format!(
                    "backing image source {other:?}: give an http(s) URL, an absolute file path or the HOST:PORT \
                     of the lvstore daemon holding a ready copy"
                )));
            }
        };
        let lvol = copy_lvol(&req.name, &self.lvs_uuid);
        corral_disk::identity::check_path_component("backing image lvol name", &temp_head(&lvol))
            .map_err(|e| ReplicaError::InvalidArgument(format!("backing image name too long: {e}")))?;
        let mut copies = lock(&self.copies);
        if copies.contains_key(&req.name) || self.store.lookup(&lvol).is_ok() {
            return Err(ReplicaError::AlreadyExists(format!("backing image copy {lvol}")));
        }
        let info = v1::BackingImageV2CopyInfo {
            name: req.name.clone(),
            uuid: req.backing_image_uuid.clone(),
            disk_uuid: self.lvs_uuid.clone(),
            size: req.size,
            progress: 0,
            state: FileState::Pending.as_str().to_owned(),
            current_checksum: String::new(),
            message: String::new(),
            lvol: lvol.clone(),
        };
        let cancel = self.cancel.child_token();
        let job = Job {
            images: self.clone(),
            name: req.name.clone(),
            uuid: req.backing_image_uuid,
            checksum: req.checksum,
            size: req.size,
            lvol,
            cancel: cancel.clone(),
        };
        let handle = tokio::spawn(job.run(source));
        copies.insert(
            req.name,
            Copy {
                info: info.clone(),
                cancel,
                job: Some(handle),
                exposed: 0,
                unexpose: self.cancel.child_token(),
            },
        );
        let _ = self.events.send(info.clone());
        Ok(info)
    }

    /// Deletes this disk's copy of `name`: a create in progress is cancelled (it deletes what it made), a copy
    /// a replica's chain sits on is refused.
    pub async fn delete(&self, name: &str) -> Result<()> {
        let (lvol, cancel, job) = {
            let mut copies = lock(&self.copies);
            let c = copies
                .get_mut(name)
                .ok_or_else(|| ReplicaError::NotFound(format!("v2 backing image {name} on this disk")))?;
            if c.exposed > 0 {
                return Err(ReplicaError::FailedPrecondition(format!(
                    "v2 backing image {name} is being sent to another disk: unexpose it first"
                )));
            }
            if let Ok(info) = self.store.info(&c.info.lvol)
                && !info.children.is_empty()
            {
                return Err(ReplicaError::FailedPrecondition(format!(
                    "v2 backing image {name} is in use by {} (lvol {})",
                    info.children.join(", "),
                    c.info.lvol
                )));
            }
            (c.info.lvol.clone(), c.cancel.clone(), c.job.take())
        };
        cancel.cancel();
        if let Some(job) = job {
            let _ = job.await;
        }
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || remove_lvols(&store, &lvol))
            .await
            .map_err(|e| ReplicaError::FailedPrecondition(e.to_string()))??;
        let removed = lock(&self.copies).remove(name);
        if let Some(c) = removed {
            let mut info = c.info;
            info.state = "deleted".to_owned();
            let _ = self.events.send(info);
        }
        info!(image = name, "v2 backing image deleted from this disk");
        Ok(())
    }

    /// Sends this disk's ready copy of `name` read-only to the sparse-sync receiver at `to` (another disk's sync
    /// of the image); answers once it is sent, or when [`Self::unexpose`] or shutdown stops it.
    pub async fn expose(&self, name: &str, to: &str) -> Result<v1::BackingImageExposeResponse> {
        let (lvol, size, stop) = {
            let mut copies = lock(&self.copies);
            let c = copies
                .get_mut(name)
                .ok_or_else(|| ReplicaError::NotFound(format!("v2 backing image {name} on this disk")))?;
            if c.info.state != FileState::Ready.as_str() {
                return Err(ReplicaError::FailedPrecondition(format!(
                    "v2 backing image {name} on this disk is {}, not ready: it cannot be synced from",
                    c.info.state
                )));
            }
            c.exposed += 1;
            (c.info.lvol.clone(), c.info.size, c.unexpose.clone())
        };
        // Counted down however this ends: also when the caller drops the call (its receiver finished first and
        // the client went away), which drops this future mid-send; a count left up would refuse the copy's
        // deletion for good.
        struct Exposed<'a>(&'a Mutex<BTreeMap<String, Copy>>, &'a str);
        impl Drop for Exposed<'_> {
            fn drop(&mut self) {
                if let Some(c) = lock(self.0).get_mut(self.1) {
                    c.exposed = c.exposed.saturating_sub(1);
                }
            }
        }
        let _exposed = Exposed(&self.copies, name);
        let sent = async {
            let id = self.store.lookup(&lvol).map_err(|e| lv_err(&self.store, e))?;
            let content = Arc::new(LvolSnapshot::new(self.store.clone(), id, size));
            let opts = sparse_sync::SendOptions {
                max_rate: self.staging.max_send_rate,
                ..Default::default()
            };
            sparse_sync::send(content, to, &opts, &sparse_sync::Progress::new(), &stop)
                .await
                .map_err(|e| {
                    ReplicaError::FailedPrecondition(format!(
                        "send v2 backing image {name} ({lvol}) to {to}: {e}"
                    ))
                })
        }
        .await;
        let s = sent?;
        info!(
            image = name,
            to,
            sent = s.bytes_sent,
            "v2 backing image exposed and sent"
        );
        Ok(v1::BackingImageExposeResponse {
            bytes_sent: s.bytes_sent,
            size,
        })
    }

    /// Stops every exposure of `name` in progress.
    pub fn unexpose(&self, name: &str) {
        if let Some(c) = lock(&self.copies).get_mut(name) {
            c.unexpose.cancel();
            c.unexpose = self.cancel.child_token();
        }
    }

    /// Cancels every create in progress and waits for them (each deletes what it made).
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        let jobs: Vec<_> = lock(&self.copies)
            .values_mut()
            .filter_map(|c| c.job.take())
            .collect();
        for j in jobs {
            let _ = j.await;
        }
    }
}

/// Deletes a copy's temp head and snapshot, whichever exist; a snapshot with clones stays (refused).
fn remove_lvols(store: &LvStore, lvol: &str) -> Result<()> {
    for n in [temp_head(lvol), lvol.to_owned()] {
        match store.delete(&n) {
            Ok(()) => {}
            Err(e) if e.kind() == lvstore::ErrorKind::NotFound => {}
            Err(e) => return Err(lv_err(store, e)),
        }
    }
    store.flush().map_err(|e| lv_err(store, e))
}

/// One create: fills the temp head, verifies, snapshots.
struct Job {
    images: Arc<BackingImages>,
    name: String,
    uuid: String,
    checksum: String,
    size: u64,
    lvol: String,
    cancel: CancellationToken,
}

/// Bytes from a source, chunk by chunk.
enum Reader {
    /// A response and the part of its last chunk not yet taken.
    Http {
        resp: reqwest::Response,
        left: Vec<u8>,
        off: usize,
    },
    File(tokio::fs::File),
}

impl Reader {
    async fn open(source: &Source) -> std::result::Result<(Self, Option<u64>), String> {
        match source {
            Source::Url(url) => {
                // With the process's TLS configs the URL is a cluster endpoint (a corral-bim's download) dialled
                // over mutual TLS; without them, any URL, verified against the system's roots as before.
                let (url, builder) = match corral_tls::installed() {
                    Some(t) => (
                        sparse_sync::http_base(url, true),
                        sparse_sync::reqwest_tls(reqwest::Client::builder(), Some(&t.client)),
                    ),
                    None => (url.clone(), reqwest::Client::builder()),
                };
                let http = builder.build().map_err(|e| format!("HTTP client: {e}"))?;
                let resp = http
                    .get(&url)
                    .send()
                    .await
                    .map_err(|e| format!("GET {url}: {e}"))?;
                if !resp.status().is_success() {
                    return Err(format!("GET {url}: HTTP {}", resp.status()));
                }
                let len = resp.content_length();
                let r = Reader::Http {
                    resp,
                    left: Vec::new(),
                    off: 0,
                };
                Ok((r, len))
            }
            Source::File(path) => {
                let f = tokio::fs::File::open(path)
                    .await
                    .map_err(|e| format!("open {}: {e}", path.display()))?;
                let m = f
                    .metadata()
                    .await
                    .map_err(|e| format!("stat {}: {e}", path.display()))?;
                if !m.is_file() {
                    return Err(format!("{} is not a regular file", path.display()));
                }
                Ok((Reader::File(f), Some(m.len())))
            }
            // Received straight into the temp head ([`Job::sync_from`]).
            Source::Lvstore(from) => Err(format!("the copy on {from} is synced, not read")),
        }
    }

    /// Appends what arrives next to `buf`, up to `CHUNK` bytes in it; 0 at the end.
    async fn read_into(&mut self, buf: &mut Vec<u8>) -> std::result::Result<usize, String> {
        let room = CHUNK - buf.len();
        match self {
            Reader::File(f) => {
                let start = buf.len();
                buf.resize(CHUNK, 0);
                let n = f.read(&mut buf[start..]).await;
                buf.truncate(start + *n.as_ref().unwrap_or(&0));
                n.map_err(|e| format!("read: {e}"))
            }
            Reader::Http { resp, left, off } => {
                if *off >= left.len() {
                    match resp.chunk().await.map_err(|e| format!("download: {e}"))? {
                        Some(b) => {
                            left.clear();
                            left.extend_from_slice(&b);
                            *off = 0;
                        }
                        None => return Ok(0),
                    }
                }
                let n = room.min(left.len() - *off);
                buf.extend_from_slice(&left[*off..*off + n]);
                *off += n;
                Ok(n)
            }
        }
    }
}

/// Hashes `buf` and writes its runs of non-zero 4 KiB blocks at `off` of lvol `id`.
fn write_chunk(store: &LvStore, id: BlobId, off: u64, buf: &[u8], hash: &mut Sha512) -> lvstore::Result<()> {
    hash.update(buf);
    write_data_blocks(store, id, off, buf)
}

/// Writes the runs of `buf`'s 4 KiB blocks that hold a non-zero byte at `off` of lvol `id` (`off` 4 KiB-aligned;
/// a short last block counts as a block).
fn write_data_blocks(store: &LvStore, id: BlobId, off: u64, buf: &[u8]) -> lvstore::Result<()> {
    let mut run: Option<usize> = None;
    let mut at = 0;
    while at <= buf.len() {
        let end = (at + BLOCK).min(buf.len());
        let data = at < buf.len() && buf[at..end].iter().any(|&b| b != 0);
        match (data, run) {
            (true, None) => run = Some(at),
            (false, Some(start)) => {
                store.write_at(id, off + start as u64, &buf[start..at])?;
                run = None;
            }
            _ => {}
        }
        at += BLOCK;
    }
    Ok(())
}

impl Job {
    async fn run(self, source: Source) {
        // Cancel is checked between steps, never by dropping a blocking step midway (it would run on alone).
        let filled = match &source {
            Source::Lvstore(from) => self.sync_from(from).await,
            _ => self.fill(&source).await,
        };
        match filled {
            Ok((checksum, size)) => {
                info!(image = %self.name, lvol = %self.lvol, size, "v2 backing image ready");
                self.images.update(&self.name, |i| {
                    i.state = FileState::Ready.as_str().to_owned();
                    i.progress = 100;
                    i.size = size;
                    i.current_checksum = checksum;
                    i.message.clear();
                });
            }
            Err(msg) => {
                warn!(image = %self.name, error = %msg, "v2 backing image create failed; deleting what it made");
                let (store, lvol) = (self.images.store.clone(), self.lvol.clone());
                let cleaned = tokio::task::spawn_blocking(move || remove_lvols(&store, &lvol)).await;
                let msg = match cleaned {
                    Ok(Ok(())) => msg,
                    Ok(Err(e)) => format!("{msg}; cleanup failed: {e}"),
                    Err(e) => format!("{msg}; cleanup failed: {e}"),
                };
                self.images.update(&self.name, |i| {
                    i.state = FileState::Failed.as_str().to_owned();
                    i.progress = 0;
                    i.message = msg;
                });
            }
        }
    }

    fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&LvStore) -> lvstore::Result<T> + Send + 'static,
    ) -> impl std::future::Future<Output = std::result::Result<T, String>> {
        let store = self.images.store.clone();
        async move {
            tokio::task::spawn_blocking(move || f(&store).map_err(|e| e.to_string()))
                .await
                .map_err(|e| e.to_string())?
        }
    }

    /// Syncs another disk's copy straight into the temp head: the source daemon at `from` is asked for the
    /// copy's size and checksum, then to expose it to a sparse-sync receiver writing into the temp head; the
    /// checksum is computed over the temp head once it is complete. Answers the checksum and size.
    async fn sync_from(&self, from: &str) -> std::result::Result<(String, u64), String> {
        use corral_proto::v1::lvstore_service_client::LvstoreServiceClient;
        let connect = async {
            // Through the process's TLS configs (mutual TLS when the daemon has --tls-dir, as its peers do).
            let ch = corral_proto::grpc::connect(from, corral_proto::grpc::GrpcTimeouts::CONTROL)
                .await
                .map_err(|e| format!("connect to the lvstore daemon at {from}: {e}"))?;
            let mut c = LvstoreServiceClient::new(ch);
            let src = c
                .backing_image_get(v1::BackingImageRef {
                    name: self.name.clone(),
                })
                .await
                .map_err(|s| format!("BackingImageGet of {} on {from}: {}", self.name, s.message()))?
                .into_inner();
            Ok::<_, String>((c, src))
        };
        let (mut client, src) = tokio::select! {
            r = connect => r?,
            () = self.cancel.cancelled() => return Err(CANCELLED.to_owned()),
        };
        if src.state != FileState::Ready.as_str() {
            return Err(format!(
                "the copy of {} on {from} is {}, not ready: it cannot be synced from",
                self.name, src.state
            ));
        }
        let size = match self.size {
            0 => src.size,
            s if s != src.size => {
                return Err(format!(
                    "the copy on {from} holds {} bytes, the image {s}",
                    src.size
                ));
            }
            s => s,
        };
        if size == 0 || !size.is_multiple_of(BLOCK as u64) {
            return Err(format!(
                "the copy on {from} holds {size} bytes, not a positive multiple of {BLOCK}: a v2 copy is an lvol"
            ));
        }
        // Checked before anything is received: a source that does not hold the image asked for is refused.
        if !self.checksum.is_empty()
            && !src.current_checksum.is_empty()
            && src.current_checksum != self.checksum
        {
            return Err(format!(
                "checksum mismatch: the copy on {from} has SHA-512 {}, expected {}",
                src.current_checksum, self.checksum
            ));
        }
        let expected = if self.checksum.is_empty() {
            src.current_checksum.clone()
        } else {
            self.checksum.clone()
        };
        self.images.update(&self.name, |i| {
            i.state = FileState::InProgress.as_str().to_owned();
            i.size = size;
        });
        let head = temp_head(&self.lvol);
        let h = head.clone();
        let id = self.blocking(move |s| s.create_lvol(&h, size)).await?;
        let sink = Arc::new(TempHeadSink {
            images: self.images.clone(),
            name: self.name.clone(),
            id,
            size,
            high: std::sync::atomic::AtomicU64::new(0),
        });
        let receiver = sparse_sync::Receiver::bind(
            SocketAddr::new(self.images.staging.listen_ip, 0),
            sparse_sync::ReceiverConfig::with_sink(&head, sink),
        )
        .await
        .map_err(|e| e.to_string())?;
        let to = receiver.local_addr().to_string();
        let rcancel = self.cancel.child_token();
        let recv = tokio::spawn(receiver.run(rcancel.clone()));
        let req = v1::BackingImageExposeRequest {
            name: self.name.clone(),
            to_address: to,
        };
        let exposed = tokio::select! {
            r = client.backing_image_expose(req) => r
                .map(tonic::Response::into_inner)
                .map_err(|s| format!("BackingImageExpose of {} on {from}: {}", self.name, s.message())),
            () = self.cancel.cancelled() => {
                let _ = client.backing_image_unexpose(v1::BackingImageRef { name: self.name.clone() }).await;
                Err(CANCELLED.to_owned())
            }
        };
        let sent = match exposed {
            Ok(s) => s,
            Err(e) => {
                rcancel.cancel();
                let _ = recv.await;
                return Err(e);
            }
        };
        let summary = recv
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("receive from {from}: {e}"))?;
        if summary.outcome != sparse_sync::ReceiveOutcome::Completed {
            return Err(format!(
                "receive from {from} ended {:?} without a completed transfer",
                summary.outcome
            ));
        }
        info!(image = %self.name, from, sent = sent.bytes_sent, written = summary.bytes_written,
            "v2 backing image received from another disk into its temp head");
        let checksum = self.checksum_of(id, size).await?;
        self.seal(&checksum, &expected).await?;
        Ok((checksum, size))
    }

    /// SHA-512 of lvol `id`'s `size` bytes, read in order (its holes read as zeros); progress from
    /// `RECEIVE_SHARE` to 99.
    async fn checksum_of(&self, id: BlobId, size: u64) -> std::result::Result<String, String> {
        let (images, name, cancel) = (self.images.clone(), self.name.clone(), self.cancel.clone());
        tokio::task::spawn_blocking(move || {
            let mut hash = Sha512::new();
            let mut buf = vec![0u8; CHUNK];
            let mut off = 0u64;
            while off < size {
                if cancel.is_cancelled() {
                    return Err(CANCELLED.to_owned());
                }
                let n = usize::try_from(size - off).map_or(CHUNK, |left| left.min(CHUNK));
                images
                    .store
                    .read_at(id, off, &mut buf[..n])
                    .map_err(|e| format!("reading the temp head at {off}: {e}"))?;
                hash.update(&buf[..n]);
                off += n as u64;
                let progress = RECEIVE_SHARE + off * (99 - RECEIVE_SHARE) / size;
                images.update(&name, |i| i.progress = u32::try_from(progress).unwrap_or(99));
            }
            Ok(hex::encode(hash.finalize()))
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// Checks `checksum` against `expected` (empty: anything goes), then makes the filled temp head the copy's
    /// snapshot with its xattrs, `state` last, in the crash order of the module doc.
    async fn seal(&self, checksum: &str, expected: &str) -> std::result::Result<(), String> {
        if !expected.is_empty() && checksum != expected {
            return Err(format!(
                "checksum mismatch: the data's SHA-512 is {checksum}, expected {expected}"
            ));
        }
        if self.cancel.is_cancelled() {
            return Err(CANCELLED.to_owned());
        }
        let (head, lvol, uuid, sum) = (
            temp_head(&self.lvol),
            self.lvol.clone(),
            self.uuid.clone(),
            checksum.to_owned(),
        );
        self.blocking(move |s| {
            s.flush()?;
            s.snapshot(&head, &lvol)?;
            s.set_xattr(&lvol, XATTR_BACKING_IMAGE_UUID, uuid.as_bytes())?;
            s.set_xattr(&lvol, XATTR_CHECKSUM, sum.as_bytes())?;
            s.set_xattr(&lvol, XATTR_STATE, FileState::Ready.as_str().as_bytes())?;
            s.delete(&head)?;
            s.flush()
        })
        .await
    }

    /// Fills the temp head and turns it into the copy's snapshot; answers the checksum and size.
    async fn fill(&self, source: &Source) -> std::result::Result<(String, u64), String> {
        let (mut reader, len) = tokio::select! {
            r = Reader::open(source) => r?,
            () = self.cancel.cancelled() => return Err(CANCELLED.to_owned()),
        };
        let size = match (self.size, len) {
            (0, Some(l)) => l,
            (0, None) => return Err("the source does not tell its length: give the size".to_owned()),
            (s, Some(l)) if s != l => return Err(format!("the source holds {l} bytes, the image {s}")),
            (s, _) => s,
        };
        if size == 0 || !size.is_multiple_of(BLOCK as u64) {
            return Err(format!(
                "the source holds {size} bytes, not a positive multiple of {BLOCK}: a v2 copy is an lvol"
            ));
        }
        self.images.update(&self.name, |i| {
            i.state = FileState::InProgress.as_str().to_owned();
            i.size = size;
        });
        let head = temp_head(&self.lvol);
        let h = head.clone();
        let id = self.blocking(move |s| s.create_lvol(&h, size)).await?;
        let mut hash = Some(Sha512::new());
        let mut buf = Some(Vec::with_capacity(CHUNK));
        let mut off = 0u64;
        loop {
            let mut b = buf.take().unwrap_or_default();
            b.clear();
            let mut eof = false;
            while b.len() < CHUNK {
                let n = tokio::select! {
                    r = reader.read_into(&mut b) => r?,
                    () = self.cancel.cancelled() => return Err(CANCELLED.to_owned()),
                };
                if n == 0 {
                    eof = true;
                    break;
                }
            }
            let n = b.len() as u64;
            if off + n > size {
                return Err(format!("the source holds more than the image's {size} bytes"));
            }
            if n > 0 {
                let mut h = hash.take().unwrap_or_default();
                let b2 = self
                    .blocking(move |s| write_chunk(s, id, off, &b, &mut h).map(|()| (b, h)))
                    .await?;
                buf = Some(b2.0);
                hash = Some(b2.1);
                off += n;
                let progress = u32::try_from(off * 100 / size).unwrap_or(100);
                self.images.update(&self.name, |i| i.progress = progress.min(99));
            }
            if eof {
                break;
            }
        }
        if off != size {
            return Err(format!("the source ended after {off} of {size} bytes"));
        }
        let checksum = hex::encode(hash.take().unwrap_or_default().finalize());
        self.seal(&checksum, &self.checksum).await?;
        Ok((checksum, size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lvol_names_parse_back_to_the_image_name() {
        let u = "0b4f7c9e-1111-2222-3333-444455556666";
        let l = copy_lvol("parrot-v2.raw", u);
        assert_eq!(l, format!("bi-parrot-v2.raw-disk-{u}"));
        assert_eq!(image_name(&l, u), Some("parrot-v2.raw"));
        assert!(is_backing_image_lvol(&l) && is_backing_image_lvol(&temp_head(&l)));
        assert_eq!(image_name(&temp_head(&l), u), None);
        assert_eq!(image_name(&l, "other"), None);
        assert!(!is_backing_image_lvol("bird-r0"));
        assert_eq!(image_of(&l), Some("parrot-v2.raw"));
        assert_eq!(image_of(&copy_lvol("a-disk-b", u)), Some("a-disk-b"));
        assert_eq!(image_of(&temp_head(&l)), None);
        assert_eq!(image_of("bird-r0"), None);
    }

    #[test]
    fn only_non_zero_blocks_are_written_but_every_byte_is_hashed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d");
        std::fs::File::create(&path).unwrap().set_len(64 << 20).unwrap();
        let s = LvStore::format(&path, &lvstore::FormatOptions::default()).unwrap();
        let id = s.create_lvol("l", 1 << 20).unwrap();
        let mut buf = vec![0u8; 1 << 20];
        buf[5 * BLOCK + 7] = 1;
        buf[(1 << 20) - 1] = 2;
        let mut h = Sha512::new();
        write_chunk(&s, id, 0, &buf, &mut h).unwrap();
        assert_eq!(h.finalize().as_slice(), Sha512::digest(&buf).as_slice());
        let blocks: u64 = s
            .own_ranges(id, 0, 1 << 20)
            .unwrap()
            .iter()
            .map(|r| (r.end - r.start) / BLOCK as u64)
            .sum();
        assert_eq!(blocks, 2);
        let mut back = vec![0u8; 1 << 20];
        s.read_at(id, 0, &mut back).unwrap();
        assert_eq!(back, buf);
    }
}
