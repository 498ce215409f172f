//! The store's metadata in memory: the blob table (lvols and snapshots), each blob's cluster map with 4 KiB
//! sub-cluster bits, and the operations that change it. Every change is an [`Op`]; the journal holds ops, a
//! checkpoint holds the whole [`Meta`], and replay applies the ops of the current generation to the checkpoint
//! with the same [`Meta::apply`] the live store uses, so the two can never disagree.

use std::collections::{BTreeMap, BTreeSet};

use crate::codec::{Decoder, Encoder};
use crate::error::FormatError;
use crate::format::IMAGE_MAGIC;

/// Longest lvol name (as [`corral_disk::identity::check_path_component`] allows).
pub const MAX_NAME: usize = 200;
/// Longest xattr key.
pub const MAX_XATTR_KEY: usize = 255;
/// Largest xattr value.
pub const MAX_XATTR_VALUE: usize = 64 << 10;
/// Most xattrs per lvol.
pub const MAX_XATTRS: usize = 64;

/// A blob id (stable for the blob's life, never reused).
pub type BlobId = u64;

/// Writable lvol or read-only snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BlobKind {
    Lvol,
    Snapshot,
}

/// One cluster of a blob: where it lives and which of its 4 KiB blocks this blob has written (the others read
/// through to the parent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterEntry {
    pub phys: u64,
    pub bits: Vec<u8>,
}

impl ClusterEntry {
    pub fn has(&self, block: u64) -> bool {
        let (byte, bit) = (usize::try_from(block / 8).unwrap_or(usize::MAX), block % 8);
        self.bits.get(byte).is_some_and(|b| b & (1 << bit) != 0)
    }
    pub fn set(&mut self, block: u64, on: bool) {
        let (byte, bit) = (usize::try_from(block / 8).unwrap_or(usize::MAX), block % 8);
        if let Some(b) = self.bits.get_mut(byte) {
            if on {
                *b |= 1 << bit;
            } else {
                *b &= !(1 << bit);
            }
        }
    }
    pub fn is_empty(&self) -> bool {
        self.bits.iter().all(|b| *b == 0)
    }
    pub fn count(&self) -> u64 {
        self.bits.iter().map(|b| u64::from(b.count_ones())).sum()
    }
}

/// An lvol or a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    pub id: BlobId,
    pub uuid: [u8; 16],
    pub name: String,
    pub kind: BlobKind,
    pub parent: Option<BlobId>,
    /// Size in bytes (a multiple of 4 KiB).
    pub size: u64,
    /// Reads at or past this offset never descend to the parent: the parent's size when cloned, lowered by a
    /// shrink, so a shrink followed by a grow reads zeros, not the parent's old data.
    pub parent_limit: u64,
    /// Creation time, seconds since the epoch.
    pub created: u64,
    pub xattrs: BTreeMap<String, Vec<u8>>,
    /// Logical cluster index → cluster.
    pub clusters: BTreeMap<u64, ClusterEntry>,
}

impl Blob {
    /// Bytes of the 4 KiB blocks this blob holds itself.
    pub fn allocated_bytes(&self) -> u64 {
        self.clusters.values().map(ClusterEntry::count).sum::<u64>() * corral_disk::BLOCK_SIZE
    }
}

/// The whole metadata.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Meta {
    pub next_id: BlobId,
    pub blobs: BTreeMap<BlobId, Blob>,
}

/// One metadata change. Ops carry every value they set (ids, uuids, times), so applying one is deterministic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Create {
        id: BlobId,
        uuid: [u8; 16],
        name: String,
        size: u64,
        created: u64,
    },
    /// The lvol's clusters move to a new snapshot blob `snap`; the lvol keeps its id, name and xattrs and reads
    /// through to the snapshot. O(1): a map moves, nothing is copied.
    Snapshot {
        lvol: BlobId,
        snap: BlobId,
        uuid: [u8; 16],
        name: String,
        created: u64,
    },
    Clone {
        id: BlobId,
        uuid: [u8; 16],
        name: String,
        snapshot: BlobId,
        created: u64,
    },
    Resize {
        id: BlobId,
        size: u64,
    },
    Rename {
        id: BlobId,
        name: String,
    },
    SetXattr {
        id: BlobId,
        key: String,
        value: Vec<u8>,
    },
    RemoveXattr {
        id: BlobId,
        key: String,
    },
    /// Removes a blob without children; a snapshot with one child is merged into it (the child takes every
    /// cluster it lacks; where both have a cluster the snapshot's blocks were already copied into the child's).
    Delete {
        id: BlobId,
    },
    /// The last step of a decouple: every block the chain provided was copied into the lvol first.
    Detach {
        id: BlobId,
    },
    /// Lvol `id` reads through to snapshot `parent` instead of its current parent (its own clusters stay): how a
    /// rebuilt replica's head, written since the rebuild began, is put over the snapshots received meanwhile.
    Reparent {
        id: BlobId,
        parent: BlobId,
    },
    /// One cluster's state after data IO (`None`: unmapped).
    Cluster {
        id: BlobId,
        lcluster: u64,
        entry: Option<ClusterEntry>,
    },
    /// The checksums of the 4 KiB blocks the record's cluster states newly map, as the flush wrote them: a
    /// record holding it was made durable together with that data (one `fdatasync`), so replay keeps it as the
    /// journal's last record only when every block on the device matches (`docs/formats.md`, crash order).
    /// Changes nothing in memory.
    BlockSums {
        /// (physical block: physical cluster × blocks per cluster + block, xxh3-64 of its 4 KiB).
        sums: Vec<(u64, u64)>,
    },
}

fn bad(m: String) -> FormatError {
    FormatError::Invalid(m)
}

impl Meta {
    pub fn blob(&self, id: BlobId) -> Result<&Blob, FormatError> {
        self.blobs.get(&id).ok_or_else(|| bad(format!("no blob {id}")))
    }

    pub fn by_name(&self, name: &str) -> Option<&Blob> {
        self.blobs.values().find(|b| b.name == name)
    }

    pub fn children(&self, id: BlobId) -> impl Iterator<Item = &Blob> {
        self.blobs.values().filter(move |b| b.parent == Some(id))
    }

    fn name_free(&self, name: &str, except: Option<BlobId>) -> Result<(), FormatError> {
        match self.by_name(name) {
            Some(b) if Some(b.id) != except => Err(bad(format!("name {name:?} is taken"))),
            _ => Ok(()),
        }
    }

    fn new_blob(&self, id: BlobId, uuid: [u8; 16], name: &str, created: u64) -> Result<Blob, FormatError> {
        if id < self.next_id || self.blobs.contains_key(&id) {
            return Err(bad(format!("blob id {id} reused")));
        }
        self.name_free(name, None)?;
        Ok(Blob {
            id,
            uuid,
            name: name.to_owned(),
            kind: BlobKind::Lvol,
            parent: None,
            size: 0,
            parent_limit: 0,
            created,
            xattrs: BTreeMap::new(),
            clusters: BTreeMap::new(),
        })
    }

    /// Checks that the transaction `ops` applies, each op on the metadata the ops before it leave, without
    /// changing anything. A structural op (create, snapshot, clone, ...) may be followed by one resize of the lvol
    /// it made (a clone sized for its volume) and then only by xattr sets, of the blob it made or of existing ones:
    /// what the checks of one op against the unchanged metadata and a count of the keys the transaction adds per
    /// blob decide exactly (a transaction that [`Meta::apply`] could fail half-way must never be journaled).
    pub fn validate_all(&self, ops: &[Op], cluster_size: u64) -> Result<(), FormatError> {
        let mut born: Option<BlobId> = None;
        let mut structural = false;
        // The lvol a create or clone made (never a snapshot), until it was resized or an xattr set came.
        let mut resizable: Option<BlobId> = None;
        let mut added: BTreeMap<BlobId, BTreeSet<&str>> = BTreeMap::new();
        for op in ops {
            if let Op::Resize { id, size } = op
                && resizable == Some(*id)
            {
                check_size(*size)?;
                resizable = None;
                continue;
            }
            resizable = None;
            let Op::SetXattr { id, key, value } = op else {
                if structural || !added.is_empty() {
                    return Err(bad(
                        "a transaction holds one structural op (and one resize of the lvol it made), before its \
                         xattr sets"
                            .into(),
                    ));
                }
                self.validate(op, cluster_size)?;
                structural = true;
                born = match op {
                    Op::Create { id, .. } | Op::Clone { id, .. } => Some(*id),
                    Op::Snapshot { snap, .. } => Some(*snap),
                    _ => None,
                };
                resizable = match op {
                    Op::Create { id, .. } | Op::Clone { id, .. } => Some(*id),
                    _ => None,
                };
                continue;
            };
            check_xattr(key, value)?;
            let existing = if born == Some(*id) {
                None
            } else {
                Some(self.blob(*id)?)
            };
            let keys = added.entry(*id).or_default();
            if !existing.is_some_and(|b| b.xattrs.contains_key(key)) && !keys.contains(key.as_str()) {
                if existing.map_or(0, |b| b.xattrs.len()) + keys.len() >= MAX_XATTRS {
                    return Err(bad(format!("at most {MAX_XATTRS} xattrs per lvol")));
                }
                keys.insert(key);
            }
        }
        Ok(())
    }

    /// Checks that `op` applies, without changing anything.
    pub fn validate(&self, op: &Op, cluster_size: u64) -> Result<(), FormatError> {
        match op {
            Op::BlockSums { .. } => Ok(()),
            Op::Create { id, name, size, .. } => {
                self.new_blob(*id, [0; 16], name, 0)?;
                check_size(*size)
            }
            Op::Snapshot { lvol, snap, name, .. } => {
                let l = self.blob(*lvol)?;
                if l.kind != BlobKind::Lvol {
                    return Err(bad(format!("{:?} is a snapshot already", l.name)));
                }
                self.new_blob(*snap, [0; 16], name, 0).map(drop)
            }
            Op::Clone {
                id, name, snapshot, ..
            } => {
                if self.blob(*snapshot)?.kind != BlobKind::Snapshot {
                    return Err(bad("only a snapshot can be cloned".into()));
                }
                self.new_blob(*id, [0; 16], name, 0).map(drop)
            }
            Op::Resize { id, size } => {
                if self.blob(*id)?.kind != BlobKind::Lvol {
                    return Err(bad("a snapshot cannot be resized".into()));
                }
                check_size(*size)
            }
            Op::Rename { id, name } => {
                self.blob(*id)?;
                self.name_free(name, Some(*id))
            }
            Op::SetXattr { id, key, value } => {
                let b = self.blob(*id)?;
                check_xattr(key, value)?;
                if !b.xattrs.contains_key(key) && b.xattrs.len() >= MAX_XATTRS {
                    return Err(bad(format!("at most {MAX_XATTRS} xattrs per lvol")));
                }
                Ok(())
            }
            Op::RemoveXattr { id, .. } | Op::Detach { id } => self.blob(*id).map(drop),
            Op::Reparent { id, parent } => {
                if self.blob(*id)?.kind != BlobKind::Lvol {
                    return Err(bad("only an lvol can be re-parented".into()));
                }
                if self.blob(*parent)?.kind != BlobKind::Snapshot {
                    return Err(bad("an lvol can only read through to a snapshot".into()));
                }
                Ok(())
            }
            Op::Delete { id } => {
                let b = self.blob(*id)?;
                let n = self.children(*id).count();
                if n > 1 || (n == 1 && b.kind != BlobKind::Snapshot) {
                    return Err(bad(format!("{:?} has {n} clones; delete them first", b.name)));
                }
                Ok(())
            }
            Op::Cluster { id, lcluster, entry } => {
                let b = self.blob(*id)?;
                if lcluster.saturating_mul(cluster_size) >= b.size.max(1) && entry.is_some() {
                    return Err(bad(format!("cluster {lcluster} of {:?} is past its end", b.name)));
                }
                if let Some(e) = entry
                    && e.bits.len() as u64 != cluster_size / corral_disk::BLOCK_SIZE / 8
                {
                    return Err(bad("cluster bitmap of the wrong length".into()));
                }
                Ok(())
            }
        }
    }

    /// Applies a validated op. Returns the physical clusters it released.
    pub fn apply(&mut self, op: Op, cluster_size: u64) -> Result<Vec<u64>, FormatError> {
        self.validate(&op, cluster_size)?;
        let mut freed = Vec::new();
        match op {
            Op::BlockSums { .. } => {}
            Op::Create {
                id,
                uuid,
                name,
                size,
                created,
            } => {
                let mut b = self.new_blob(id, uuid, &name, created)?;
                b.size = size;
                self.blobs.insert(id, b);
                self.next_id = id + 1;
            }
            Op::Snapshot {
                lvol,
                snap,
                uuid,
                name,
                created,
            } => {
                let mut s = self.new_blob(snap, uuid, &name, created)?;
                let l = self
                    .blobs
                    .get_mut(&lvol)
                    .ok_or_else(|| bad("lvol vanished".into()))?;
                s.kind = BlobKind::Snapshot;
                s.parent = l.parent;
                s.parent_limit = l.parent_limit;
                s.size = l.size;
                s.clusters = std::mem::take(&mut l.clusters);
                l.parent = Some(snap);
                l.parent_limit = l.size;
                self.blobs.insert(snap, s);
                self.next_id = snap + 1;
            }
            Op::Clone {
                id,
                uuid,
                name,
                snapshot,
                created,
            } => {
                let mut b = self.new_blob(id, uuid, &name, created)?;
                let s = self.blob(snapshot)?;
                b.parent = Some(snapshot);
                b.size = s.size;
                b.parent_limit = s.size;
                self.blobs.insert(id, b);
                self.next_id = id + 1;
            }
            Op::Resize { id, size } => self.apply_resize(id, size, cluster_size, &mut freed)?,
            Op::Rename { id, name } => {
                if let Some(b) = self.blobs.get_mut(&id) {
                    b.name = name;
                }
            }
            Op::SetXattr { id, key, value } => {
                if let Some(b) = self.blobs.get_mut(&id) {
                    b.xattrs.insert(key, value);
                }
            }
            Op::RemoveXattr { id, key } => {
                if let Some(b) = self.blobs.get_mut(&id) {
                    b.xattrs.remove(&key);
                }
            }
            Op::Delete { id } => self.apply_delete(id, cluster_size, &mut freed)?,
            Op::Detach { id } => {
                if let Some(b) = self.blobs.get_mut(&id) {
                    b.parent = None;
                    b.parent_limit = 0;
                }
            }
            Op::Reparent { id, parent } => {
                let limit = self.blob(parent)?.size;
                if let Some(b) = self.blobs.get_mut(&id) {
                    b.parent = Some(parent);
                    b.parent_limit = limit.min(b.size);
                }
            }
            Op::Cluster { id, lcluster, entry } => {
                let b = self.blobs.get_mut(&id).ok_or_else(|| bad("vanished".into()))?;
                let old = match entry {
                    Some(e) => b.clusters.insert(lcluster, e),
                    None => b.clusters.remove(&lcluster),
                };
                if let Some(old) = old
                    && b.clusters.get(&lcluster).is_none_or(|n| n.phys != old.phys)
                {
                    freed.push(old.phys);
                }
            }
        }
        Ok(freed)
    }

    /// [`Op::Resize`]: a shrink unmaps the clusters past the new end (their physical clusters go to `freed`) and
    /// clears the blocks past it in the last, partly kept cluster.
    fn apply_resize(
        &mut self,
        id: BlobId,
        size: u64,
        cluster_size: u64,
        freed: &mut Vec<u64>,
    ) -> Result<(), FormatError> {
        let b = self.blobs.get_mut(&id).ok_or_else(|| bad("vanished".into()))?;
        if size < b.size {
            let first_gone = size.div_ceil(cluster_size);
            let gone: Vec<u64> = b.clusters.range(first_gone..).map(|(l, _)| *l).collect();
            for l in gone {
                if let Some(e) = b.clusters.remove(&l) {
                    freed.push(e.phys);
                }
            }
            // The blocks of the last, partly kept cluster past the new end.
            if !size.is_multiple_of(cluster_size)
                && let Some(e) = b.clusters.get_mut(&(size / cluster_size))
            {
                let bpc = cluster_size / corral_disk::BLOCK_SIZE;
                for blk in (size % cluster_size) / corral_disk::BLOCK_SIZE..bpc {
                    e.set(blk, false);
                }
            }
            b.parent_limit = b.parent_limit.min(size);
        }
        b.size = size;
        Ok(())
    }

    /// [`Op::Delete`]: a blob with no child frees its clusters; a snapshot's clusters merge into its child where
    /// the child has none of its own (blocks the child has not overwritten move down), the rest go to `freed`.
    fn apply_delete(
        &mut self,
        id: BlobId,
        cluster_size: u64,
        freed: &mut Vec<u64>,
    ) -> Result<(), FormatError> {
        let b = self.blobs.remove(&id).ok_or_else(|| bad("vanished".into()))?;
        let child = self.blobs.values_mut().find(|c| c.parent == Some(id));
        match child {
            None => freed.extend(b.clusters.values().map(|e| e.phys)),
            Some(c) => {
                for (l, e) in b.clusters {
                    let inside = l.saturating_mul(cluster_size) < c.parent_limit;
                    match c.clusters.get_mut(&l) {
                        _ if !inside => freed.push(e.phys),
                        None => {
                            let mut e = e;
                            clip_bits(&mut e, l, cluster_size, c.parent_limit);
                            c.clusters.insert(l, e);
                        }
                        Some(mine) => {
                            let bpc = cluster_size / corral_disk::BLOCK_SIZE;
                            for blk in 0..bpc {
                                let off = l * cluster_size + blk * corral_disk::BLOCK_SIZE;
                                if e.has(blk) && off < c.parent_limit {
                                    mine.set(blk, true);
                                }
                            }
                            freed.push(e.phys);
                        }
                    }
                }
                c.parent = b.parent;
                c.parent_limit = c.parent_limit.min(b.parent_limit);
            }
        }
        Ok(())
    }

    /// Structural checks of a whole metadata (after decode and replay): parents exist, are snapshots and form no
    /// cycle, names are unique and valid, every cluster lies inside the device and its blob, and no cluster is
    /// owned twice. Returns the owner of every used cluster.
    pub fn check(&self, cluster_size: u64, cluster_count: u64) -> Result<BTreeMap<u64, BlobId>, FormatError> {
        let mut names = std::collections::HashSet::new();
        let mut owner: BTreeMap<u64, BlobId> = BTreeMap::new();
        let bitmap_len = cluster_size / corral_disk::BLOCK_SIZE / 8;
        for b in self.blobs.values() {
            if b.id >= self.next_id {
                return Err(bad(format!(
                    "blob {} is not below the next id {}",
                    b.id, self.next_id
                )));
            }
            if !names.insert(b.name.as_str()) {
                return Err(bad(format!("two blobs are named {:?}", b.name)));
            }
            if corral_disk::identity::check_path_component("name", &b.name).is_err() {
                return Err(bad(format!("blob {} has an invalid name {:?}", b.id, b.name)));
            }
            check_size(b.size)?;
            let mut seen = 0;
            let mut p = b.parent;
            while let Some(pid) = p {
                let parent = self.blob(pid)?;
                if parent.kind != BlobKind::Snapshot {
                    return Err(bad(format!("the parent of {:?} is not a snapshot", b.name)));
                }
                seen += 1;
                if seen > self.blobs.len() {
                    return Err(bad(format!("the chain of {:?} has a cycle", b.name)));
                }
                p = parent.parent;
            }
            for (l, e) in &b.clusters {
                if e.phys >= cluster_count {
                    return Err(bad(format!(
                        "{:?} maps cluster {} past the device's {cluster_count}",
                        b.name, e.phys
                    )));
                }
                if l.saturating_mul(cluster_size) >= b.size {
                    return Err(bad(format!(
                        "{:?} maps logical cluster {l} past its size",
                        b.name
                    )));
                }
                if e.bits.len() as u64 != bitmap_len {
                    return Err(bad(format!(
                        "{:?}: a cluster bitmap has the wrong length",
                        b.name
                    )));
                }
                if let Some(other) = owner.insert(e.phys, b.id) {
                    return Err(bad(format!(
                        "cluster {} is owned by blobs {other} and {}",
                        e.phys, b.id
                    )));
                }
            }
        }
        Ok(owner)
    }
}

fn clip_bits(e: &mut ClusterEntry, l: u64, cluster_size: u64, limit: u64) {
    let bpc = cluster_size / corral_disk::BLOCK_SIZE;
    for blk in 0..bpc {
        if l * cluster_size + blk * corral_disk::BLOCK_SIZE >= limit {
            e.set(blk, false);
        }
    }
}

fn check_size(size: u64) -> Result<(), FormatError> {
    if size == 0 || !size.is_multiple_of(corral_disk::BLOCK_SIZE) || size > (1 << 50) {
        return Err(bad(format!(
            "size {size} is not a positive multiple of 4096 up to 1 PiB"
        )));
    }
    Ok(())
}

// ---- encoding ----

fn enc_entry(e: &mut Encoder, entry: &ClusterEntry) {
    e.u64(entry.phys);
    e.raw(&entry.bits);
}

fn dec_entry(d: &mut Decoder, bitmap_len: usize) -> Result<ClusterEntry, FormatError> {
    Ok(ClusterEntry {
        phys: d.u64()?,
        bits: d.raw(bitmap_len)?.to_vec(),
    })
}

fn dec_uuid(d: &mut Decoder) -> Result<[u8; 16], FormatError> {
    let mut u = [0u8; 16];
    u.copy_from_slice(d.raw(16)?);
    Ok(u)
}

fn bitmap_len(cluster_size: u64) -> usize {
    usize::try_from(cluster_size / corral_disk::BLOCK_SIZE / 8).unwrap_or(usize::MAX)
}

impl Meta {
    /// The checkpoint image.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.raw(&IMAGE_MAGIC);
        e.u64(self.next_id);
        e.u64(self.blobs.len() as u64);
        for b in self.blobs.values() {
            e.u64(b.id);
            e.raw(&b.uuid);
            e.str(&b.name);
            e.u8(match b.kind {
                BlobKind::Lvol => 0,
                BlobKind::Snapshot => 1,
            });
            e.u64(b.parent.unwrap_or(0));
            e.u64(b.size);
            e.u64(b.parent_limit);
            e.u64(b.created);
            e.u64(b.xattrs.len() as u64);
            for (k, v) in &b.xattrs {
                e.str(k);
                e.bytes(v);
            }
            e.u64(b.clusters.len() as u64);
            for (l, c) in &b.clusters {
                e.u64(*l);
                enc_entry(&mut e, c);
            }
        }
        e.buf
    }

    /// Parses a checkpoint image (untrusted bytes: bounded, never panics).
    pub fn decode(buf: &[u8], cluster_size: u64) -> Result<Meta, FormatError> {
        let bl = bitmap_len(cluster_size);
        let mut d = Decoder::new(buf, "metadata image");
        if d.raw(8)? != IMAGE_MAGIC {
            return Err(bad("metadata image: bad magic".into()));
        }
        let next_id = d.u64()?;
        let n = d.count(8 + 16 + 4 + 1 + 8 * 6)?;
        let mut blobs = BTreeMap::new();
        for _ in 0..n {
            let id = d.u64()?;
            let uuid = dec_uuid(&mut d)?;
            let name = d.str(MAX_NAME)?;
            let kind = match d.u8()? {
                0 => BlobKind::Lvol,
                1 => BlobKind::Snapshot,
                k => return Err(bad(format!("blob {id}: unknown kind {k}"))),
            };
            let parent = Some(d.u64()?).filter(|p| *p != 0);
            let size = d.u64()?;
            let parent_limit = d.u64()?;
            let created = d.u64()?;
            let nx = d.count(8)?;
            let mut xattrs = BTreeMap::new();
            for _ in 0..nx {
                let k = d.str(MAX_XATTR_KEY)?;
                let v = d.bytes(MAX_XATTR_VALUE)?.to_vec();
                xattrs.insert(k, v);
            }
            let nc = d.count(16 + bl)?;
            let mut clusters = BTreeMap::new();
            for _ in 0..nc {
                let l = d.u64()?;
                if clusters.insert(l, dec_entry(&mut d, bl)?).is_some() {
                    return Err(bad(format!("blob {id} maps logical cluster {l} twice")));
                }
            }
            if id == 0 || parent == Some(id) {
                return Err(bad(format!("blob {id}: bad id or self-parent")));
            }
            let blob = Blob {
                id,
                uuid,
                name,
                kind,
                parent,
                size,
                parent_limit,
                created,
                xattrs,
                clusters,
            };
            if blobs.insert(id, blob).is_some() {
                return Err(bad(format!("blob id {id} appears twice")));
            }
        }
        if d.remaining() != 0 {
            return Err(bad("metadata image: trailing bytes".into()));
        }
        Ok(Meta { next_id, blobs })
    }
}

/// Bytes of a blob's encoding without its cluster map.
fn blob_fixed_bytes(name: &str) -> u64 {
    8 + 16 + 4 + name.len() as u64 + 1 + 8 * 5 + 8 + 8
}

impl Meta {
    /// Bytes the image takes apart from cluster-map entries (header, blobs, names, xattrs): with one entry per
    /// physical cluster at most, this plus `cluster_count` entries bounds the image.
    pub fn fixed_bytes(&self) -> u64 {
        16 + 8
            + self
                .blobs
                .values()
                .map(|b| {
                    blob_fixed_bytes(&b.name)
                        + b.xattrs
                            .iter()
                            .map(|(k, v)| 8 + k.len() as u64 + v.len() as u64)
                            .sum::<u64>()
                })
                .sum::<u64>()
    }

    /// What `op` adds to [`Meta::fixed_bytes`] at most.
    pub fn growth(op: &Op) -> u64 {
        match op {
            Op::Create { name, .. } | Op::Snapshot { name, .. } | Op::Clone { name, .. } => {
                blob_fixed_bytes(name)
            }
            Op::Rename { name, .. } => name.len() as u64,
            Op::SetXattr { key, value, .. } => 8 + key.len() as u64 + value.len() as u64,
            _ => 0,
        }
    }
}

/// An xattr's key and value are within their limits.
fn check_xattr(key: &str, value: &[u8]) -> Result<(), FormatError> {
    if key.is_empty() || key.len() > MAX_XATTR_KEY || value.len() > MAX_XATTR_VALUE {
        return Err(bad(format!(
            "xattr {key:?}: key of 1..={MAX_XATTR_KEY} bytes, value up to {MAX_XATTR_VALUE}"
        )));
    }
    Ok(())
}

/// Encodes a transaction (a list of ops) as a journal payload.
pub fn encode_ops(ops: &[Op]) -> Vec<u8> {
    let mut e = Encoder::default();
    e.u64(ops.len() as u64);
    for op in ops {
        match op {
            Op::Create {
                id,
                uuid,
                name,
                size,
                created,
            } => {
                e.u8(1);
                e.u64(*id);
                e.raw(uuid);
                e.str(name);
                e.u64(*size);
                e.u64(*created);
            }
            Op::Snapshot {
                lvol,
                snap,
                uuid,
                name,
                created,
            } => {
                e.u8(2);
                e.u64(*lvol);
                e.u64(*snap);
                e.raw(uuid);
                e.str(name);
                e.u64(*created);
            }
            Op::Clone {
                id,
                uuid,
                name,
                snapshot,
                created,
            } => {
                e.u8(3);
                e.u64(*id);
                e.raw(uuid);
                e.str(name);
                e.u64(*snapshot);
                e.u64(*created);
            }
            Op::Resize { id, size } => {
                e.u8(4);
                e.u64(*id);
                e.u64(*size);
            }
            Op::Rename { id, name } => {
                e.u8(5);
                e.u64(*id);
                e.str(name);
            }
            Op::SetXattr { id, key, value } => {
                e.u8(6);
                e.u64(*id);
                e.str(key);
                e.bytes(value);
            }
            Op::RemoveXattr { id, key } => {
                e.u8(7);
                e.u64(*id);
                e.str(key);
            }
            Op::Delete { id } => {
                e.u8(8);
                e.u64(*id);
            }
            Op::Detach { id } => {
                e.u8(9);
                e.u64(*id);
            }
            Op::Reparent { id, parent } => {
                e.u8(11);
                e.u64(*id);
                e.u64(*parent);
            }
            Op::BlockSums { sums } => {
                e.u8(12);
                e.u64(sums.len() as u64);
                for (block, sum) in sums {
                    e.u64(*block);
                    e.u64(*sum);
                }
            }
            Op::Cluster { id, lcluster, entry } => {
                e.u8(10);
                e.u64(*id);
                e.u64(*lcluster);
                match entry {
                    None => e.u8(0),
                    Some(en) => {
                        e.u8(1);
                        enc_entry(&mut e, en);
                    }
                }
            }
        }
    }
    e.buf
}

/// Parses a journal payload (untrusted bytes).
pub fn decode_ops(buf: &[u8], cluster_size: u64) -> Result<Vec<Op>, FormatError> {
    let bl = bitmap_len(cluster_size);
    let mut d = Decoder::new(buf, "journal record");
    let n = d.count(9)?;
    let mut ops = Vec::with_capacity(n);
    for _ in 0..n {
        let op = match d.u8()? {
            1 => Op::Create {
                id: d.u64()?,
                uuid: dec_uuid(&mut d)?,
                name: d.str(MAX_NAME)?,
                size: d.u64()?,
                created: d.u64()?,
            },
            2 => Op::Snapshot {
                lvol: d.u64()?,
                snap: d.u64()?,
                uuid: dec_uuid(&mut d)?,
                name: d.str(MAX_NAME)?,
                created: d.u64()?,
            },
            3 => Op::Clone {
                id: d.u64()?,
                uuid: dec_uuid(&mut d)?,
                name: d.str(MAX_NAME)?,
                snapshot: d.u64()?,
                created: d.u64()?,
            },
            4 => Op::Resize {
                id: d.u64()?,
                size: d.u64()?,
            },
            5 => Op::Rename {
                id: d.u64()?,
                name: d.str(MAX_NAME)?,
            },
            6 => Op::SetXattr {
                id: d.u64()?,
                key: d.str(MAX_XATTR_KEY)?,
                value: d.bytes(MAX_XATTR_VALUE)?.to_vec(),
            },
            7 => Op::RemoveXattr {
                id: d.u64()?,
                key: d.str(MAX_XATTR_KEY)?,
            },
            8 => Op::Delete { id: d.u64()? },
            9 => Op::Detach { id: d.u64()? },
            11 => Op::Reparent {
                id: d.u64()?,
                parent: d.u64()?,
            },
            12 => {
                let n = d.count(16)?;
                let mut sums = Vec::with_capacity(n);
                for _ in 0..n {
                    sums.push((d.u64()?, d.u64()?));
                }
                Op::BlockSums { sums }
            }
            10 => {
                let id = d.u64()?;
                let lcluster = d.u64()?;
                let entry = match d.u8()? {
                    0 => None,
                    1 => Some(dec_entry(&mut d, bl)?),
                    t => return Err(bad(format!("cluster op: bad presence byte {t}"))),
                };
                Op::Cluster { id, lcluster, entry }
            }
            t => return Err(bad(format!("unknown journal op {t}"))),
        };
        ops.push(op);
    }
    if d.remaining() != 0 {
        return Err(bad("journal record: trailing bytes".into()));
    }
    Ok(ops)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CS: u64 = 64 << 10;

    fn sample() -> (Meta, Vec<Op>) {
        let mut m = Meta {
            next_id: 1,
            blobs: BTreeMap::new(),
        };
        let ops = vec![
            Op::Create {
                id: 1,
                uuid: [1; 16],
                name: "vol".into(),
                size: 1 << 20,
                created: 5,
            },
            Op::Cluster {
                id: 1,
                lcluster: 3,
                entry: Some(ClusterEntry {
                    phys: 7,
                    bits: vec![0b1010, 0],
                }),
            },
            Op::SetXattr {
                id: 1,
                key: "k".into(),
                value: vec![0, 1, 2],
            },
            Op::Snapshot {
                lvol: 1,
                snap: 2,
                uuid: [2; 16],
                name: "s".into(),
                created: 6,
            },
            Op::Clone {
                id: 3,
                uuid: [3; 16],
                name: "c".into(),
                snapshot: 2,
                created: 7,
            },
            Op::Resize {
                id: 3,
                size: 64 << 10,
            },
            Op::Rename {
                id: 3,
                name: "c2".into(),
            },
            Op::Reparent { id: 3, parent: 2 },
        ];
        for op in ops.clone() {
            m.apply(op, CS).unwrap();
        }
        (m, ops)
    }

    #[test]
    fn a_transaction_may_resize_the_lvol_it_made_once_and_nothing_else() {
        let (m, _) = sample();
        let clone = |id| Op::Clone {
            id,
            uuid: [9; 16],
            name: "new".into(),
            snapshot: 2,
            created: 8,
        };
        let resize = |id, size| Op::Resize { id, size };
        let set = |id| Op::SetXattr {
            id,
            key: "volume".into(),
            value: vec![1],
        };
        let snapshot = Op::Snapshot {
            lvol: 1,
            snap: 4,
            uuid: [4; 16],
            name: "s2".into(),
            created: 8,
        };
        assert!(
            m.validate_all(&[clone(4), resize(4, 2 << 20), set(4)], CS)
                .is_ok()
        );
        for bad in [
            vec![clone(4), resize(4, 2 << 20), resize(4, 4 << 20)], // twice
            vec![clone(4), resize(3, 2 << 20)],                     // another lvol
            vec![clone(4), set(4), resize(4, 2 << 20)],             // after an xattr set
            vec![clone(4), resize(4, 4097)],                        // a bad size
            vec![snapshot, resize(4, 2 << 20)],                     // the snapshot it made
        ] {
            assert!(m.validate_all(&bad, CS).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn images_and_journal_payloads_round_trip() {
        let (m, ops) = sample();
        assert_eq!(Meta::decode(&m.encode(), CS).unwrap(), m);
        assert_eq!(decode_ops(&encode_ops(&ops), CS).unwrap(), ops);
        let owners = m.check(CS, 16).unwrap();
        assert_eq!(owners.get(&7), Some(&2), "the snapshot took the lvol's cluster");
        assert_eq!(m.blobs[&1].parent, Some(2));
    }

    #[test]
    fn every_truncation_of_an_image_or_payload_is_an_error_not_a_panic() {
        let (m, ops) = sample();
        let image = m.encode();
        for n in 0..image.len() {
            assert!(Meta::decode(&image[..n], CS).is_err(), "prefix {n}");
        }
        let payload = encode_ops(&ops);
        for n in 0..payload.len() {
            assert!(decode_ops(&payload[..n], CS).is_err(), "prefix {n}");
        }
    }

    #[test]
    fn check_refuses_a_cluster_owned_twice_and_a_cluster_past_the_device() {
        let (mut m, _) = sample();
        m.blobs.get_mut(&3).unwrap().clusters.insert(
            0,
            ClusterEntry {
                phys: 7,
                bits: vec![1, 0],
            },
        );
        assert!(
            m.check(CS, 16)
                .unwrap_err()
                .to_string()
                .contains("owned by blobs")
        );
        let (m, _) = sample();
        assert!(
            m.check(CS, 4)
                .unwrap_err()
                .to_string()
                .contains("past the device")
        );
    }
}
