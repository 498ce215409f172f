//! Snapshot export, source side: a snapshot flattened over its chain ([`SnapshotView`], a
//! [`corral_disk::sparse::SparseRead`]) streamed to a sparse-sync receiver (`VolumeExport`), while the live volume keeps
//! serving.
//!
//! The view opens its own read-only descriptors of the snapshot and its ancestors and builds its own location map,
//! so later snapshots, writes to the head and even a purge that renames files do not change what it reads: a fold
//! copies a child's data into its removed parent, which the view reads only where the child has none, and the
//! files keep their inodes open. A purge that would *prune* the exported snapshot (punch holes in it) is the one
//! change it could see, so the daemon refuses a purge while an export runs and an export while a purge runs.
//! Blocks no layer holds are holes, or the backing image's data when asked for it
//! (`export_backing_image_if_exist`), read from the backing file's own data extents.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use corral_disk::sparse::{DataRanges, SparseRead};
use sparse_sync::{FileExtents, Progress};
use tokio_util::sync::CancellationToken;
use tracing::info;

use corral_disk::BLOCK_SIZE;

use crate::backing::Backing;
use crate::chain::{Layer, build_map};
use crate::error::{IoContext, ReplicaError, Result};
use crate::extent_map::{ExtentMap, LayerIndex};
use crate::io::pread_full;
use crate::names;
use crate::replica::Replica;

/// A snapshot of an open replica, flattened over its ancestors (and optionally the backing image).
#[derive(Debug)]
pub struct SnapshotView {
    dir: PathBuf,
    snapshot: String,
    /// Root first, the snapshot last.
    layers: Vec<Layer>,
    /// The backing image, when its data is part of the view.
    backing: Option<Backing>,
    map: ExtentMap,
    size: u64,
}

/// Resolves a user-given snapshot (name or file name) that must not be a head.
pub fn snapshot_file(name: &str) -> Result<String> {
    if names::head_index(name).is_some() || name == "volume-head" {
        return Err(ReplicaError::InvalidArgument(format!(
            "{name} is the volume head, not a snapshot: take a snapshot and export that"
        )));
    }
    names::resolve_snapshot(name)
}

impl SnapshotView {
    /// Opens `snapshot` (name or file name) of `replica`; with `with_backing`, blocks no layer holds read from the
    /// backing image (when there is one).
    pub fn open(replica: &Replica, snapshot: &str, with_backing: bool) -> Result<Self> {
        let file = snapshot_file(snapshot)?;
        let chain = replica.chain_read_open()?;
        let dir = replica.dir().to_owned();
        let Some(meta) = chain.disks.get(&file) else {
            return Err(ReplicaError::NotFound(format!(
                "snapshot {file} in {}",
                dir.display()
            )));
        };
        if meta.removed {
            return Err(ReplicaError::FailedPrecondition(format!(
                "snapshot {file} is marked removed"
            )));
        }
        let mut names_up = vec![file.clone()];
        let mut cur = meta.parent.clone();
        while !cur.is_empty() {
            if names_up.contains(&cur) || names_up.len() > chain.disks.len() {
                return Err(ReplicaError::CorruptMeta {
                    path: dir.join(names::meta_file(&cur)),
                    reason: "parent chain loops".into(),
                });
            }
            names_up.push(cur.clone());
            cur = chain
                .disks
                .get(&cur)
                .ok_or_else(|| ReplicaError::MissingParent {
                    dir: dir.clone(),
                    disk: names_up[names_up.len() - 2].clone(),
                    parent: cur.clone(),
                })?
                .parent
                .clone();
        }
        let mut layers = Vec::with_capacity(names_up.len());
        for n in names_up.into_iter().rev() {
            let path = dir.join(&n);
            layers.push(Layer {
                file: File::open(&path).ctx("open", &path)?,
                name: n,
            });
        }
        // Its own handle of the image: the view outlives any reload of the chain.
        let backing_path = chain
            .backing
            .as_ref()
            .filter(|_| with_backing)
            .map(|b| b.path.clone());
        drop(chain);
        let backing = backing_path.map(|p| Backing::open(&p)).transpose()?;
        let size = layers[layers.len() - 1]
            .file
            .metadata()
            .ctx("stat", dir.join(&file))?
            .len();
        let map = build_map(&dir, &layers)?;
        Ok(Self {
            dir,
            snapshot: file,
            layers,
            backing,
            map,
            size,
        })
    }

    /// The snapshot's file name.
    pub fn snapshot(&self) -> &str {
        &self.snapshot
    }

    /// A view over layer files opened elsewhere (a local copy's source, [`crate::local_copy`]), root first, the
    /// snapshot last; without a backing image.
    pub(crate) fn from_layers(dir: &Path, layers: Vec<Layer>) -> Result<Self> {
        let Some(top) = layers.last() else {
            return Err(ReplicaError::InvalidArgument(
                "a snapshot view needs a layer".into(),
            ));
        };
        let snapshot = top.name.clone();
        let size = top.file.metadata().ctx("stat", dir.join(&snapshot))?.len();
        let map = build_map(dir, &layers)?;
        Ok(Self {
            dir: dir.to_owned(),
            snapshot,
            layers,
            backing: None,
            map,
            size,
        })
    }

    /// The snapshot's size in bytes.
    pub(crate) fn size_bytes(&self) -> u64 {
        self.size
    }

    /// Does the view read blocks from the backing image?
    pub(crate) fn has_backing(&self) -> bool {
        self.backing.is_some()
    }

    /// The layers' file names and open files, root first.
    pub(crate) fn layer_files(&self) -> impl Iterator<Item = (&str, &File)> {
        self.layers.iter().map(|l| (l.name.as_str(), &l.file))
    }

    fn collect_ranges(&self, range: Range<u64>) -> Vec<Range<u64>> {
        fn push(out: &mut Vec<Range<u64>>, r: Range<u64>) {
            if r.start >= r.end {
                return;
            }
            match out.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => out.push(r),
            }
        }
        let range = range.start.min(self.size)..range.end.min(self.size);
        let clip = |s: u64, e: u64| (s * BLOCK_SIZE).max(range.start)..(e * BLOCK_SIZE).min(range.end);
        let mut out = Vec::new();
        self.map.visit(
            range.start / BLOCK_SIZE,
            range.end.div_ceil(BLOCK_SIZE),
            |s, e, l| {
                match (l, &self.backing) {
                    (Some(_), _) => push(&mut out, clip(s, e)),
                    // Blocks no layer holds: where the backing image holds data.
                    (None, Some(b)) => b.data_blocks(s, e, |bs, be| push(&mut out, clip(bs, be))),
                    (None, None) => {}
                }
                true
            },
        );
        out
    }

    fn read_piece(&self, layer: Option<LayerIndex>, offset: u64, dst: &mut [u8]) -> io::Result<()> {
        match layer {
            Some(i) => {
                let l = &self.layers[usize::try_from(i).unwrap_or(usize::MAX)];
                pread_full(&l.file, dst, offset)
            }
            None => match &self.backing {
                Some(b) => b.read(dst, offset).map_err(io::Error::other),
                None => {
                    dst.fill(0);
                    Ok(())
                }
            },
        }
    }
}

impl SparseRead for SnapshotView {
    fn size(&self) -> u64 {
        self.size
    }

    fn data_ranges(&self, range: Range<u64>) -> DataRanges<'_> {
        Box::new(self.collect_ranges(range).into_iter().map(Ok))
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|e| *e <= self.size)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "read of {} bytes at {offset} is past the size {} of {}",
                        buf.len(),
                        self.size,
                        self.dir.join(&self.snapshot).display()
                    ),
                )
            })?;
        let mut pieces = Vec::new();
        self.map
            .visit(offset / BLOCK_SIZE, end.div_ceil(BLOCK_SIZE), |s, e, l| {
                pieces.push(((s * BLOCK_SIZE).max(offset), (e * BLOCK_SIZE).min(end), l));
                true
            });
        for (s, e, l) in pieces {
            let a = usize::try_from(s - offset).map_err(io::Error::other)?;
            let b = usize::try_from(e - offset).map_err(io::Error::other)?;
            self.read_piece(l, s, &mut buf[a..b])?;
        }
        Ok(())
    }
}

impl FileExtents for SnapshotView {
    fn files_of<'a>(&'a self, range: Range<u64>, out: &mut Vec<(Range<u64>, Option<&'a File>)>) {
        let (start, end) = (range.start, range.end);
        self.map
            .visit(start / BLOCK_SIZE, end.div_ceil(BLOCK_SIZE), |s, e, l| {
                let r = (s * BLOCK_SIZE).max(start)..(e * BLOCK_SIZE).min(end);
                let file = l
                    .and_then(|i| self.layers.get(usize::try_from(i).ok()?))
                    .map(|l| &l.file);
                match out.last_mut() {
                    Some((last, f))
                        if last.end == r.start
                            && f.map(std::ptr::from_ref) == file.map(std::ptr::from_ref) =>
                    {
                        last.end = r.end;
                    }
                    _ => out.push((r, file)),
                }
                true
            });
    }
}

/// Exports running on one replica daemon; a purge waits for none to run.
#[derive(Debug, Default)]
pub struct ExportTracker {
    running: AtomicUsize,
}

impl ExportTracker {
    /// Exports running now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Acquire)
    }
}

/// A running export that outlives a request (a `LocalFiles` listing): counted until dropped.
#[derive(Debug)]
pub(crate) struct ExportLease(Arc<ExportTracker>);

impl ExportTracker {
    /// Counts an export until the lease is dropped; refused while `purging` (checked after counting, so a purge
    /// starting now sees it).
    pub(crate) fn lease(self: &Arc<Self>, purging: bool) -> Result<ExportLease> {
        self.running.fetch_add(1, Ordering::AcqRel);
        let lease = ExportLease(self.clone());
        if purging {
            return Err(ReplicaError::FailedPrecondition(
                "a purge is running; export after it finishes".into(),
            ));
        }
        Ok(lease)
    }
}

impl Drop for ExportLease {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::AcqRel);
    }
}

struct Running<'a>(&'a ExportTracker);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a `VolumeExport` asks for.
#[derive(Debug, Clone, Default)]
pub struct ExportRequest {
    /// The snapshot to export (name or file name).
    pub snapshot_file_name: String,
    /// The sparse-sync receiver, `host:port`.
    pub to: String,
    /// Blocks no snapshot layer holds are read from the backing image (when there is one).
    pub export_backing_image_if_exist: bool,
    /// The receiving volume's size; the export is refused when the snapshot's differs (0: not checked).
    pub expected_size: u64,
    /// Send rate limit (0: none).
    pub max_bytes_per_second: u64,
}

impl ExportRequest {
    /// The request of a `VolumeExport` call; refuses a bad receiver address.
    pub fn from_proto(req: corral_proto::v1::VolumeExportRequest) -> Result<Self> {
        if req.host.is_empty() || req.port == 0 || req.port > u32::from(u16::MAX) {
            return Err(ReplicaError::InvalidArgument(format!(
                "bad receiver address {}:{}",
                req.host, req.port
            )));
        }
        Ok(Self {
            snapshot_file_name: req.snapshot_file_name,
            to: format!("{}:{}", req.host, req.port),
            export_backing_image_if_exist: req.export_backing_image_if_exist,
            expected_size: req.expected_size,
            max_bytes_per_second: req.max_bytes_per_second,
        })
    }
}

/// What an export sent.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExportSummary {
    /// Bytes on the wire.
    pub bytes_sent: u64,
    /// Data bytes of the snapshot (holes excluded).
    pub data_bytes: u64,
    /// The snapshot's size.
    pub size: u64,
}

/// `VolumeExport`: streams a snapshot of `replica` to the receiver at `req.to`; returns when the receiver has
/// committed the file.
pub async fn volume_export(
    replica: Arc<Replica>,
    tracker: &ExportTracker,
    purging: impl Fn() -> bool,
    req: &ExportRequest,
) -> Result<ExportSummary> {
    tracker.running.fetch_add(1, Ordering::AcqRel);
    let _running = Running(tracker);
    // Counted as running first, so a purge starting now sees the export.
    if purging() {
        return Err(ReplicaError::FailedPrecondition(
            "a purge is running; export after it finishes".into(),
        ));
    }
    let dir = replica.dir().to_owned();
    let (snap, with_backing) = (req.snapshot_file_name.clone(), req.export_backing_image_if_exist);
    let view = tokio::task::spawn_blocking(move || SnapshotView::open(&replica, &snap, with_backing))
        .await
        .map_err(|e| ReplicaError::InvalidArgument(format!("export task: {e}")))??;
    let snapshot_name = view.snapshot.clone();
    send_export(Arc::new(view), &snapshot_name, req, &dir.display().to_string()).await
}

/// Streams `content` (snapshot `snapshot` flattened, of a v1 or a v2 replica of `origin`) to the receiver of
/// `req` after checking its size against the target's.
pub(crate) async fn send_export(
    content: Arc<dyn SparseRead>,
    snapshot: &str,
    req: &ExportRequest,
    origin: &str,
) -> Result<ExportSummary> {
    let size = content.size();
    if req.expected_size != 0 && req.expected_size != size {
        return Err(ReplicaError::InvalidArgument(format!(
            "snapshot {snapshot} is {size} bytes but the target volume is {} bytes: a clone needs volumes of the \
             same size",
            req.expected_size
        )));
    }
    let to = &req.to;
    let s = sparse_sync::send(
        content,
        to,
        &sparse_sync::SendOptions {
            max_rate: (req.max_bytes_per_second > 0).then_some(req.max_bytes_per_second),
            ..Default::default()
        },
        &Progress::new(),
        &CancellationToken::new(),
    )
    .await
    .map_err(|e| ReplicaError::FailedPrecondition(format!("export {snapshot} to {to}: {e}")))?;
    info!(
        replica = %origin, snapshot = %snapshot, to = %to, sent = s.bytes_sent,
        data = s.data_bytes, backing = req.export_backing_image_if_exist, "snapshot exported"
    );
    Ok(ExportSummary {
        bytes_sent: s.bytes_sent,
        data_bytes: s.data_bytes,
        size,
    })
}
