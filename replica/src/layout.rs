//! Reading a replica directory into a consistent picture ([`DirLayout`]) without changing anything, and the
//! repairs that finishing an interrupted operation needs.
//!
//! Every multi-file operation (snapshot, revert, expand, purge) is ordered so that a crash at any point leaves
//! either the old or the new chain reachable from `volume.meta`, plus leftovers this module recognises:
//! - `*.tmp`: an atomic metadata write that did not finish → deleted.
//! - a `volume-head-*.img` that is not `volume.meta`'s `Head`: the new head of an uncommitted snapshot/revert, or
//!   the old head of a committed one whose unlink did not happen → deleted (with its meta).
//! - a snapshot image that is the same inode as the head: a snapshot interrupted before its commit → deleted.
//! - a snapshot meta without an image, marked removed, that is some disk's parent: a purge that renamed the
//!   folded file over its child and crashed before re-pointing the child → the child is re-pointed to the
//!   grandparent and the meta deleted.
//! - a snapshot meta without an image and without children: a snapshot interrupted before its link → deleted.
//! - `*.clone`, `*.clone.sync-partial`: a clone's received data; a snapshot outside the live chain that shares the
//!   inode of its `.clone` file is an uncommitted clone → deleted with its meta (see [`crate::clone`]).
//!
//! Anything else that does not fit (a missing parent, unparsable metadata) is an error naming the file; nothing
//! is touched then.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use corral_disk::BLOCK_SIZE;

use crate::error::{IoContext, ReplicaError, Result};
use crate::meta::{DiskMeta, VolumeInfo, load_json};
use crate::names::{self, CHECKSUM_SUFFIX, CLONE_SUFFIX, META_SUFFIX, TMP_SUFFIX, VOLUME_META};

/// A repair applied by `open` (never by offline inspection).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repair {
    /// Delete a leftover file.
    Remove(String),
    /// Rewrite a disk's meta with the fixed parent.
    Repoint { disk: String, parent: String },
}

/// The replica directory as found on disk.
#[derive(Debug, Clone)]
pub struct DirLayout {
    /// Directory path.
    pub dir: PathBuf,
    /// `volume.meta`.
    pub info: VolumeInfo,
    /// Every disk (head and snapshots, live chain and side branches) by file name, after repairs.
    pub disks: BTreeMap<String, DiskMeta>,
    /// Live chain from the root (index 0) to the head (last).
    pub live: Vec<String>,
    /// Repairs that `open` will apply.
    pub repairs: Vec<Repair>,
}

impl DirLayout {
    /// Loads the directory. `Ok(None)` means no replica was ever created here (no `volume.meta`, no images).
    pub fn load(dir: &Path) -> Result<Option<Self>> {
        let mut files = Vec::new();
        for entry in fs::read_dir(dir).ctx("read directory", dir)? {
            let entry = entry.ctx("read directory", dir)?;
            if let Ok(name) = entry.file_name().into_string() {
                files.push(name);
            }
        }
        let meta_path = dir.join(VOLUME_META);
        let Some(info) = load_json::<VolumeInfo>(&meta_path)? else {
            if files.iter().any(|f| names::is_image(f)) {
                return Err(ReplicaError::MissingMeta {
                    path: meta_path,
                    hint: " but image files exist; refusing to guess which one is the head",
                });
            }
            return Ok(None);
        };
        validate_info(&meta_path, &info)?;

        let mut repairs = Vec::new();
        let mut disks = BTreeMap::new();
        for f in &files {
            if f.ends_with(TMP_SUFFIX) {
                repairs.push(Repair::Remove(f.clone()));
                continue;
            }
            let Some(img) = f.strip_suffix(META_SUFFIX) else {
                continue;
            };
            if !names::is_image(img) {
                continue;
            }
            if names::head_index(img).is_some() && img != info.head {
                continue; // stray head meta, removed below with its image
            }
            let mut m: DiskMeta = load_json(&dir.join(f))?.unwrap_or_default();
            m.name = img.to_owned();
            disks.insert(img.to_owned(), m);
        }

        // Stray heads.
        for f in &files {
            if let Some(img) = f.strip_suffix(META_SUFFIX).or(Some(f.as_str()))
                && names::head_index(img).is_some()
                && img != info.head
            {
                repairs.push(Repair::Remove(f.clone()));
            }
        }
        // Snapshots that are the head's inode: interrupted before commit.
        let head_ino = fs::metadata(dir.join(&info.head))
            .map(|m| (m.dev(), m.ino()))
            .ok();
        if head_ino.is_none() {
            return Err(ReplicaError::MissingParent {
                dir: dir.to_owned(),
                disk: VOLUME_META.into(),
                parent: info.head.clone(),
            });
        }
        for f in &files {
            if names::snapshot_name(f).is_some()
                && fs::metadata(dir.join(f)).map(|m| (m.dev(), m.ino())).ok() == head_ino
            {
                repairs.push(Repair::Remove(f.clone()));
                repairs.push(Repair::Remove(names::meta_file(f)));
                disks.remove(f);
            }
        }
        drop_metas_without_image(dir, &files, &mut disks, &mut repairs)?;
        // Checksum records of images that are gone.
        for f in &files {
            if let Some(img) = f.strip_suffix(CHECKSUM_SUFFIX)
                && !disks.contains_key(img)
            {
                repairs.push(Repair::Remove(f.clone()));
            }
        }

        let mut live = live_chain(dir, &info, &disks)?;
        repairs.extend(clone_leftovers(dir, &files, &live, &mut disks));
        live.reverse();
        Ok(Some(Self {
            dir: dir.to_owned(),
            info,
            disks,
            live,
            repairs,
        }))
    }

    /// Children of a disk, by file name.
    pub fn children(disks: &BTreeMap<String, DiskMeta>, name: &str) -> Vec<String> {
        disks
            .values()
            .filter(|d| d.parent == name)
            .map(|d| d.name.clone())
            .collect()
    }
}

/// Metadata files whose image is gone: removed when nothing names them as parent; a removed snapshot's with one
/// child is bypassed (the child repointed to its parent: a purge interrupted after the image went); any other is
/// a missing parent, refused.
fn drop_metas_without_image(
    dir: &Path,
    files: &[String],
    disks: &mut BTreeMap<String, DiskMeta>,
    repairs: &mut Vec<Repair>,
) -> Result<()> {
    let has = |n: &str| files.iter().any(|f| f == n);
    let without_image: Vec<String> = disks.keys().filter(|d| !has(d)).cloned().collect();
    for d in without_image {
        let m = disks[&d].clone();
        let children: Vec<String> = disks
            .values()
            .filter(|c| c.parent == d)
            .map(|c| c.name.clone())
            .collect();
        if children.is_empty() {
            repairs.push(Repair::Remove(names::meta_file(&d)));
            disks.remove(&d);
        } else if m.removed && children.len() == 1 && names::snapshot_name(&d).is_some() {
            let child = &children[0];
            if let Some(c) = disks.get_mut(child) {
                c.parent.clone_from(&m.parent);
            }
            repairs.push(Repair::Repoint {
                disk: child.clone(),
                parent: m.parent.clone(),
            });
            repairs.push(Repair::Remove(names::meta_file(&d)));
            disks.remove(&d);
        } else {
            return Err(ReplicaError::MissingParent {
                dir: dir.to_owned(),
                disk: children[0].clone(),
                parent: d,
            });
        }
    }
    Ok(())
}

/// The live chain from the head named in `volume.meta` up to the root (head first), refusing a missing parent,
/// a loop, or a head as a parent; and every disk's parent must exist.
fn live_chain(dir: &Path, info: &VolumeInfo, disks: &BTreeMap<String, DiskMeta>) -> Result<Vec<String>> {
    let head_meta = disks.get(&info.head).ok_or_else(|| ReplicaError::MissingMeta {
        path: dir.join(names::meta_file(&info.head)),
        hint: " (metadata of the head named in volume.meta)",
    })?;
    let mut live = vec![head_meta.name.clone()];
    let mut cur = head_meta.parent.clone();
    while !cur.is_empty() {
        let Some(m) = disks.get(&cur) else {
            return Err(ReplicaError::MissingParent {
                dir: dir.to_owned(),
                disk: live.last().cloned().unwrap_or_default(),
                parent: cur,
            });
        };
        if live.contains(&cur) || live.len() > disks.len() {
            return Err(ReplicaError::CorruptMeta {
                path: dir.join(names::meta_file(&cur)),
                reason: "parent chain loops".into(),
            });
        }
        if names::head_index(&cur).is_some() {
            return Err(ReplicaError::CorruptMeta {
                path: dir.join(names::meta_file(live.last().map_or("", String::as_str))),
                reason: format!("parent {cur} is a head, not a snapshot"),
            });
        }
        live.push(cur.clone());
        cur.clone_from(&m.parent);
    }
    for d in disks.values() {
        if !d.parent.is_empty() && !disks.contains_key(&d.parent) {
            return Err(ReplicaError::MissingParent {
                dir: dir.to_owned(),
                disk: d.name.clone(),
                parent: d.parent.clone(),
            });
        }
    }
    Ok(live)
}

fn validate_info(path: &Path, info: &VolumeInfo) -> Result<()> {
    let bad = |reason: String| {
        Err(ReplicaError::CorruptMeta {
            path: path.to_owned(),
            reason,
        })
    };
    if names::head_index(&info.head).is_none() {
        return bad(format!("Head {:?} is not a volume-head-NNN.img name", info.head));
    }
    if info.size == 0 || !info.size.is_multiple_of(BLOCK_SIZE) {
        return bad(format!(
            "Size {} is not a positive multiple of {BLOCK_SIZE}",
            info.size
        ));
    }
    if info.encrypted {
        return bad("Encrypted replicas are not supported".into());
    }
    Ok(())
}
/// Leftovers of snapshot clones ([`crate::clone`]): partial receives, `.clone` names of committed
/// clones, and uncommitted clones (the `.clone` file, the snapshot image that shares its inode, and its meta).
/// Removes the uncommitted snapshots from `disks`.
fn clone_leftovers(
    dir: &Path,
    files: &[String],
    live: &[String],
    disks: &mut BTreeMap<String, DiskMeta>,
) -> Vec<Repair> {
    let mut repairs = Vec::new();
    let inode = |p: PathBuf| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    for f in files {
        if f.ends_with(&format!("{CLONE_SUFFIX}.sync-partial")) {
            repairs.push(Repair::Remove(f.clone()));
            continue;
        }
        let Some(snap) = f.strip_suffix(CLONE_SUFFIX) else {
            continue;
        };
        if names::snapshot_name(snap).is_none() {
            continue;
        }
        repairs.push(Repair::Remove(f.clone()));
        if !live.iter().any(|l| l == snap)
            && inode(dir.join(snap)).is_some()
            && inode(dir.join(snap)) == inode(dir.join(f))
        {
            repairs.push(Repair::Remove(snap.to_owned()));
            repairs.push(Repair::Remove(names::meta_file(snap)));
            repairs.push(Repair::Remove(names::checksum_file(snap)));
            disks.remove(snap);
        }
    }
    repairs
}
