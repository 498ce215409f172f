//! An open replica: the live chain's files, the block location map and the revision counter, and the operations
//! that change the chain's shape (create, open, close, snapshot, revert, expand, mark removed).
//! Block IO is in `crate::io`, purge in `crate::purge`, hashing in [`crate::hash`].

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use corral_disk::BLOCK_SIZE;
use tracing::{info, warn};

use crate::backing::Backing;
use crate::chain::{Chain, Layer, build_map, create_layer_file, open_ro, open_rw};
use crate::error::{IoContext, ReplicaError, Result};
use crate::extent_map::ExtentMap;
use crate::layout::{DirLayout, Repair};
use crate::locks::{lock, read_lock, write_lock};
use crate::meta::{DiskMeta, VolumeInfo, now_rfc3339, remove_if_exists, sync_dir, write_json_atomic};
use crate::model::{DiskStatus, ReplicaStatus, SECTOR_SIZE, SnapshotRequest};
use crate::names::{self, VOLUME_META};
use crate::revision::RevisionCounter;

/// Number of stripes of the lock serialising read-modify-write of partially written blocks.
pub(crate) const RMW_STRIPES: usize = 64;

/// Options for create/open.
#[derive(Debug, Clone, Default)]
pub struct ReplicaOptions {
    /// Read-only bottom layer: a raw or qcow2 image file, or a directory holding exactly one (see
    /// [`crate::backing::resolve_image_path`]). Recorded in `volume.meta` and refreshed on every open.
    pub backing_file: Option<PathBuf>,
    /// Do not keep the revision counter (faster; salvage uses head mtime and allocated size instead).
    /// `None` keeps what `volume.meta` says.
    pub disable_revision_counter: Option<bool>,
    /// The backing image's name and SHA-512 as the control plane knows them (with `backing_file`); backups record
    /// them. Not kept in `volume.meta`: the manager gives them at every start, with the re-resolved path.
    pub backing_image: Option<crate::backing::BackingImageId>,
}

/// An open replica directory.
#[derive(Debug)]
pub struct Replica {
    pub(crate) dir: PathBuf,
    pub(crate) chain: RwLock<Chain>,
    pub(crate) map: RwLock<ExtentMap>,
    pub(crate) rmw: [Mutex<()>; RMW_STRIPES],
    pub(crate) counter: Option<RevisionCounter>,
    /// Serialises shape changes (snapshot, revert, expand, purge steps, close) with each other.
    pub(crate) shape: Mutex<()>,
    pub(crate) purging: AtomicBool,
}

impl Replica {
    /// Creates a new replica of `size` bytes in `dir` (which must hold no replica yet) and opens it.
    pub fn create(dir: &Path, size: u64, opts: &ReplicaOptions) -> Result<Self> {
        if size == 0 || !size.is_multiple_of(BLOCK_SIZE) {
            return Err(ReplicaError::InvalidArgument(format!(
                "volume size {size} must be a positive multiple of {BLOCK_SIZE}"
            )));
        }
        if let Some(p) = &opts.backing_file {
            Backing::open(p)?.fits(size)?; // refuse a bad image before anything is created
        }
        fs::create_dir_all(dir).ctx("create directory", dir)?;
        if DirLayout::load(dir)?.is_some() {
            return Err(ReplicaError::AlreadyExists(format!(
                "replica in {}",
                dir.display()
            )));
        }
        let head = names::head_file(0);
        create_layer_file(&dir.join(&head), size)?;
        write_json_atomic(
            dir,
            &names::meta_file(&head),
            &DiskMeta {
                name: head.clone(),
                created: now_rfc3339(),
                ..Default::default()
            },
        )?;
        let info = VolumeInfo {
            size,
            head,
            sector_size: SECTOR_SIZE,
            revision_counter_disabled: opts.disable_revision_counter.unwrap_or(false),
            ..Default::default()
        };
        write_json_atomic(dir, VOLUME_META, &info)?;
        info!(dir = %dir.display(), size, "replica created");
        Self::open(dir, opts)
    }

    /// Opens an existing replica, finishing any interrupted operation (see [`crate::layout`]), and marks it dirty.
    pub fn open(dir: &Path, opts: &ReplicaOptions) -> Result<Self> {
        let layout = DirLayout::load(dir)?.ok_or_else(|| ReplicaError::MissingMeta {
            path: dir.join(VOLUME_META),
            hint: " (no replica here: create one with a size)",
        })?;
        let DirLayout {
            info: mut vinfo,
            disks,
            live,
            repairs,
            ..
        } = layout;
        for r in &repairs {
            match r {
                Repair::Remove(f) => {
                    warn!(dir = %dir.display(), file = %f, "removing leftover of an interrupted operation");
                    remove_if_exists(&dir.join(f))?;
                }
                Repair::Repoint { disk, parent } => {
                    warn!(dir = %dir.display(), disk = %disk, parent = %parent, "finishing an interrupted purge");
                    write_json_atomic(dir, &names::meta_file(disk), &disks[disk])?;
                }
            }
        }
        if !repairs.is_empty() {
            sync_dir(dir)?;
        }

        let mut layers = Vec::with_capacity(live.len());
        for (i, name) in live.iter().enumerate() {
            let path = dir.join(name);
            let file = if i + 1 == live.len() {
                open_rw(&path)?
            } else {
                open_ro(&path)?
            };
            layers.push(Layer {
                name: name.clone(),
                file,
            });
        }
        let head_len = layers[layers.len() - 1]
            .file
            .metadata()
            .ctx("stat", dir.join(&vinfo.head))?
            .len();
        if head_len != vinfo.size {
            return Err(ReplicaError::CorruptMeta {
                path: dir.join(VOLUME_META),
                reason: format!("Size {} but head {} is {head_len} bytes", vinfo.size, vinfo.head),
            });
        }

        let backing_path = match &opts.backing_file {
            Some(p) => Some(p.clone()),
            None if !vinfo.backing_file_path.is_empty() => Some(PathBuf::from(&vinfo.backing_file_path)),
            None => None,
        };
        let backing = match backing_path {
            Some(p) => Some(
                Backing::open(&p)?
                    .with_id(opts.backing_image.clone())
                    .fits(vinfo.size)?,
            ),
            None => None,
        };

        let map = build_map(dir, &layers)?;
        if let Some(d) = opts.disable_revision_counter {
            vinfo.revision_counter_disabled = d;
        }
        let counter = if vinfo.revision_counter_disabled {
            None
        } else {
            Some(RevisionCounter::open(dir)?)
        };

        vinfo.parent = disks[&vinfo.head].parent.clone();
        vinfo.dirty = true;
        vinfo.sector_size = SECTOR_SIZE;
        vinfo.backing_file_path = backing
            .as_ref()
            .map(|b| b.path.display().to_string())
            .unwrap_or_default();
        write_json_atomic(dir, VOLUME_META, &vinfo)?;
        info!(
            dir = %dir.display(), size = vinfo.size, head = %vinfo.head, layers = layers.len(),
            map_runs = map.run_count(), "replica opened"
        );
        Ok(Self {
            dir: dir.to_owned(),
            chain: RwLock::new(Chain {
                info: vinfo,
                disks,
                layers,
                backing,
                closed: false,
            }),
            map: RwLock::new(map),
            rmw: std::array::from_fn(|_| Mutex::new(())),
            counter,
            shape: Mutex::new(()),
            purging: AtomicBool::new(false),
        })
    }

    /// Directory of this replica.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Flushes and marks the replica clean (`Dirty=false`). Further IO fails.
    pub fn close(&self) -> Result<()> {
        let _shape = lock(&self.shape);
        let mut chain = write_lock(&self.chain);
        if chain.closed {
            return Ok(());
        }
        self.flush_locked(&chain)?;
        chain.info.dirty = false;
        write_json_atomic(&self.dir, VOLUME_META, &chain.info)?;
        chain.closed = true;
        info!(dir = %self.dir.display(), "replica closed cleanly");
        Ok(())
    }

    /// Is the replica closed?
    pub fn is_closed(&self) -> bool {
        read_lock(&self.chain).closed
    }

    /// Volume size in bytes.
    pub fn size(&self) -> u64 {
        read_lock(&self.chain).info.size
    }

    /// Revision counter (0 when disabled).
    pub fn revision_counter(&self) -> u64 {
        self.counter.as_ref().map_or(0, RevisionCounter::get)
    }

    /// Sets the revision counter (rebuild copies the source's).
    pub fn set_revision_counter(&self, v: u64) -> Result<()> {
        match &self.counter {
            Some(c) => c.set(v),
            None => Err(ReplicaError::FailedPrecondition(
                "revision counter is disabled on this replica".into(),
            )),
        }
    }

    /// Sets the persisted `Rebuilding` flag.
    pub fn set_rebuilding(&self, rebuilding: bool) -> Result<()> {
        let _shape = lock(&self.shape);
        let mut chain = self.chain_write_open()?;
        chain.info.rebuilding = rebuilding;
        write_json_atomic(&self.dir, VOLUME_META, &chain.info)
    }

    pub(crate) fn chain_read_open(&self) -> Result<RwLockReadGuard<'_, Chain>> {
        let c = read_lock(&self.chain);
        if c.closed {
            return Err(ReplicaError::FailedPrecondition(format!(
                "replica {} is closed",
                self.dir.display()
            )));
        }
        Ok(c)
    }

    pub(crate) fn chain_write_open(&self) -> Result<RwLockWriteGuard<'_, Chain>> {
        let c = write_lock(&self.chain);
        if c.closed {
            return Err(ReplicaError::FailedPrecondition(format!(
                "replica {} is closed",
                self.dir.display()
            )));
        }
        Ok(c)
    }

    /// Takes a snapshot: the head becomes `volume-snap-<name>.img` (a hard link, no data copied) and a new empty
    /// head is put on top. IO is blocked for the duration (a few fsyncs).
    ///
    /// Crash order: snapshot meta, link, new head + its meta, then `volume.meta` (the commit point), then the old
    /// head's names are unlinked. See [`crate::layout`] for how each intermediate state is recovered.
    pub fn snapshot(&self, req: &SnapshotRequest) -> Result<()> {
        let _shape = lock(&self.shape);
        let mut chain = self.chain_write_open()?;
        let size = chain.info.size;
        self.snapshot_locked(&mut chain, req, size)
    }

    fn snapshot_locked(&self, chain: &mut Chain, req: &SnapshotRequest, new_size: u64) -> Result<()> {
        let snap = names::resolve_snapshot(&req.name)?;
        if chain.disks.contains_key(&snap) || self.dir.join(&snap).exists() {
            return Err(ReplicaError::AlreadyExists(format!(
                "snapshot {} ({snap})",
                req.name
            )));
        }
        let old_head = chain.info.head.clone();
        let old_index = names::head_index(&old_head).unwrap_or(0);
        let new_head = names::head_file(old_index + 1);
        let dir = &self.dir;
        self.flush_locked(chain)?;

        let snap_meta = DiskMeta {
            name: snap.clone(),
            parent: chain.disks[&old_head].parent.clone(),
            removed: false,
            user_created: req.user_created,
            created: if req.created.is_empty() {
                now_rfc3339()
            } else {
                req.created.clone()
            },
            labels: req.labels.clone(),
        };
        write_json_atomic(dir, &names::meta_file(&snap), &snap_meta)?;
        fs::hard_link(dir.join(&old_head), dir.join(&snap)).ctx("link", dir.join(&snap))?;
        remove_if_exists(&dir.join(&new_head))?;
        let head_file = create_layer_file(&dir.join(&new_head), new_size)?;
        let head_meta = DiskMeta {
            name: new_head.clone(),
            parent: snap.clone(),
            created: now_rfc3339(),
            ..Default::default()
        };
        write_json_atomic(dir, &names::meta_file(&new_head), &head_meta)?;

        let mut info = chain.info.clone();
        info.head.clone_from(&new_head);
        info.parent.clone_from(&snap);
        info.size = new_size;
        info.dirty = true;
        write_json_atomic(dir, VOLUME_META, &info)?; // commit point

        remove_if_exists(&dir.join(&old_head))?;
        remove_if_exists(&dir.join(names::meta_file(&old_head)))?;
        sync_dir(dir)?;

        chain.info = info;
        chain.disks.remove(&old_head);
        chain.disks.insert(snap.clone(), snap_meta);
        chain.disks.insert(new_head.clone(), head_meta);
        let last = chain.layers.len() - 1;
        chain.layers[last].name.clone_from(&snap);
        // The old head's file handle now refers to the snapshot; writes only ever go to the new head.
        chain.layers.push(Layer {
            name: new_head,
            file: head_file,
        });
        info!(dir = %dir.display(), snapshot = %snap, "snapshot taken");
        Ok(())
    }

    /// Grows the volume: a system snapshot `expand-<size>` and a larger head. Older layers stay short and read as
    /// zeros past their end.
    pub fn expand(&self, size: u64) -> Result<()> {
        let _shape = lock(&self.shape);
        let mut chain = self.chain_write_open()?;
        let cur = chain.info.size;
        if size == cur {
            return Ok(());
        }
        if size < cur || !size.is_multiple_of(BLOCK_SIZE) {
            return Err(ReplicaError::InvalidArgument(format!(
                "cannot expand from {cur} to {size}: the new size must be larger and a multiple of {BLOCK_SIZE}"
            )));
        }
        let req = SnapshotRequest {
            name: format!("expand-{size}"),
            user_created: false,
            created: String::new(),
            labels: BTreeMap::from([("replica-expansion".to_owned(), size.to_string())]),
        };
        self.snapshot_locked(&mut chain, &req, size)
    }

    /// Reverts to a snapshot: a new empty head over it. Newer snapshots stay as a side branch; the old head's
    /// data is discarded.
    pub fn revert(&self, name: &str, created: &str) -> Result<()> {
        let _shape = lock(&self.shape);
        if self.purging.load(Ordering::Acquire) {
            return Err(ReplicaError::FailedPrecondition(
                "cannot revert while a purge runs".into(),
            ));
        }
        let mut chain = self.chain_write_open()?;
        let target = names::resolve_snapshot(name)?;
        let Some(meta) = chain.disks.get(&target) else {
            return Err(ReplicaError::NotFound(format!("snapshot {target}")));
        };
        if meta.removed {
            return Err(ReplicaError::FailedPrecondition(format!(
                "snapshot {target} is marked removed"
            )));
        }
        let dir = self.dir.clone();
        let old_head = chain.info.head.clone();
        let new_head = names::head_file(names::head_index(&old_head).unwrap_or(0) + 1);
        remove_if_exists(&dir.join(&new_head))?;
        let head_file = create_layer_file(&dir.join(&new_head), chain.info.size)?;
        let head_meta = DiskMeta {
            name: new_head.clone(),
            parent: target.clone(),
            created: if created.is_empty() {
                now_rfc3339()
            } else {
                created.to_owned()
            },
            ..Default::default()
        };
        write_json_atomic(&dir, &names::meta_file(&new_head), &head_meta)?;
        let mut info = chain.info.clone();
        info.head.clone_from(&new_head);
        info.parent.clone_from(&target);
        info.dirty = true;
        write_json_atomic(&dir, VOLUME_META, &info)?; // commit point
        remove_if_exists(&dir.join(&old_head))?;
        remove_if_exists(&dir.join(names::meta_file(&old_head)))?;
        sync_dir(&dir)?;

        chain.info = info;
        chain.disks.remove(&old_head);
        chain.disks.insert(new_head.clone(), head_meta);
        let mut live = vec![new_head.clone()];
        let mut cur = target;
        while !cur.is_empty() {
            live.push(cur.clone());
            cur = chain
                .disks
                .get(&cur)
                .map(|d| d.parent.clone())
                .unwrap_or_default();
        }
        live.reverse();
        let mut layers = Vec::with_capacity(live.len());
        for n in live {
            let file = if n == new_head {
                head_file.try_clone().ctx("dup", dir.join(&n))?
            } else {
                open_ro(&dir.join(&n))?
            };
            layers.push(Layer { name: n, file });
        }
        let map = build_map(&dir, &layers)?;
        chain.layers = layers;
        *write_lock(&self.map) = map;
        info!(dir = %dir.display(), snapshot = %name, "reverted");
        Ok(())
    }

    /// Marks a snapshot removed; the next purge folds or prunes it.
    pub fn mark_removed(&self, name: &str) -> Result<()> {
        let _shape = lock(&self.shape);
        let mut chain = self.chain_write_open()?;
        let snap = names::resolve_snapshot(name)?;
        let Some(meta) = chain.disks.get_mut(&snap) else {
            return Err(ReplicaError::NotFound(format!("snapshot {snap}")));
        };
        if meta.removed {
            return Ok(());
        }
        let mut m = meta.clone();
        m.removed = true;
        write_json_atomic(&self.dir, &names::meta_file(&snap), &m)?;
        *meta = m;
        Ok(())
    }

    /// Re-reads the directory (after files were synced in) and rebuilds the chain and the map.
    pub fn reload(&self) -> Result<()> {
        let _shape = lock(&self.shape);
        let mut chain = self.chain_write_open()?;
        self.flush_locked(&chain)?;
        let opts = ReplicaOptions {
            backing_file: chain.backing.as_ref().map(|b| b.path.clone()),
            disable_revision_counter: Some(chain.info.revision_counter_disabled),
            backing_image: chain.backing.as_ref().and_then(|b| b.id.clone()),
        };
        let fresh = Self::open(&self.dir, &opts)?;
        let fresh_chain = std::mem::replace(
            &mut *write_lock(&fresh.chain),
            Chain {
                info: VolumeInfo::default(),
                disks: BTreeMap::new(),
                layers: Vec::new(),
                backing: None,
                closed: true,
            },
        );
        *chain = fresh_chain;
        *write_lock(&self.map) = std::mem::take(&mut *write_lock(&fresh.map));
        Ok(())
    }

    /// State and metadata.
    pub fn status(&self) -> Result<ReplicaStatus> {
        let chain = read_lock(&self.chain);
        let runs = read_lock(&self.map).run_count();
        let state = if chain.closed {
            "closed"
        } else if !chain.info.error.is_empty() {
            "error"
        } else if chain.info.rebuilding {
            "rebuilding"
        } else {
            "open"
        };
        let mut s = status_of(
            &self.dir,
            &chain.info,
            &chain.disks,
            chain.layers.iter().map(|l| l.name.clone()).collect(),
            state,
        )?;
        s.revision_counter = self.revision_counter();
        s.extent_map_runs = runs;
        Ok(s)
    }
}

/// Offline status of a replica directory: reads only, repairs nothing.
pub fn inspect(dir: &Path) -> Result<ReplicaStatus> {
    let Some(l) = DirLayout::load(dir)? else {
        return Ok(ReplicaStatus {
            state: "initial".into(),
            dir: dir.display().to_string(),
            size: 0,
            sector_size: SECTOR_SIZE,
            head: String::new(),
            parent: String::new(),
            dirty: false,
            rebuilding: false,
            error: String::new(),
            backing_file: String::new(),
            chain: Vec::new(),
            disks: BTreeMap::new(),
            revision_counter: 0,
            revision_counter_disabled: false,
            last_modify_time: 0,
            head_file_size: 0,
            extent_map_runs: 0,
        });
    };
    let state = if !l.info.error.is_empty() {
        "error"
    } else if l.info.rebuilding {
        "rebuilding"
    } else if l.info.dirty {
        "dirty"
    } else {
        "closed"
    };
    let mut s = status_of(dir, &l.info, &l.disks, l.live.clone(), state)?;
    s.revision_counter = if l.info.revision_counter_disabled {
        0
    } else {
        RevisionCounter::read(dir)?.unwrap_or(0)
    };
    Ok(s)
}

fn status_of(
    dir: &Path,
    info: &VolumeInfo,
    disks: &BTreeMap<String, DiskMeta>,
    mut live: Vec<String>,
    state: &str,
) -> Result<ReplicaStatus> {
    let mut out = BTreeMap::new();
    let (mut mtime, mut head_alloc) = (0, 0);
    for (name, d) in disks {
        let md = fs::metadata(dir.join(name)).ctx("stat", dir.join(name))?;
        let alloc = md.blocks() * 512;
        if *name == info.head {
            mtime = md.mtime() * 1_000_000_000 + md.mtime_nsec();
            head_alloc = alloc;
        }
        out.insert(
            name.clone(),
            DiskStatus {
                name: name.clone(),
                parent: d.parent.clone(),
                children: DirLayout::children(disks, name),
                removed: d.removed,
                user_created: d.user_created,
                created: d.created.clone(),
                size: alloc,
                labels: d.labels.clone(),
            },
        );
    }
    live.reverse();
    Ok(ReplicaStatus {
        state: state.into(),
        dir: dir.display().to_string(),
        size: info.size,
        sector_size: SECTOR_SIZE,
        head: info.head.clone(),
        parent: info.parent.clone(),
        dirty: info.dirty,
        rebuilding: info.rebuilding,
        error: info.error.clone(),
        backing_file: info.backing_file_path.clone(),
        chain: live,
        disks: out,
        revision_counter: 0,
        revision_counter_disabled: info.revision_counter_disabled,
        last_modify_time: mtime,
        head_file_size: head_alloc,
        extent_map_runs: 0,
    })
}
