//! Purge: reclaim the space of snapshots marked removed, while the replica keeps serving IO.
//!
//! For each removed snapshot S (system snapshots are marked removed first, as Longhorn does):
//! - **no children** (a side-branch leaf): its files are deleted.
//! - **one child C that is not the head**: *fold*: C's data extents are copied into S's file (S grown to C's
//!   size), S's file is renamed over C's name, and C's meta re-pointed to S's parent. The merged data keeps C's
//!   name; S's name disappears. The copy needs no lock (both are read-only snapshots to IO: readers of blocks in
//!   S are by definition not covered by C); only the rename and the map renumbering block IO briefly.
//! - **one child that is the head**: *prune*: holes are punched in S wherever the head has data. S stays, still
//!   marked removed, smaller.
//! - **several children**: kept (both branches need it).
//!
//! Crash order of a fold: copy + fdatasync S, rename S over C, fsync dir, rewrite C's meta, delete S's meta. A crash
//! between the rename and the meta rewrite leaves S's meta without an image, marked removed, as C's parent:
//! [`crate::layout`] recognises that and finishes the job at open.

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

use tracing::info;

use corral_disk::BLOCK_SIZE;

use crate::chain::Layer;
use crate::error::{IoContext, ReplicaError, Result};
use crate::extent_map::LayerIndex;
use crate::jobs::JobControl;
use crate::layout::DirLayout;
use crate::locks::{lock, read_lock, write_lock};
use crate::meta::{remove_if_exists, sync_dir, write_json_atomic};
use crate::names;
use crate::replica::Replica;

const COPY_CHUNK: usize = 1 << 20;
const PRUNE_RUNS_PER_LOCK: usize = 1024;

enum Step {
    Remove(String),
    Fold { snap: String, child: String },
    Prune(String),
}

impl Replica {
    /// Runs a purge to completion (blocking). Progress and cancellation through `ctl`.
    pub fn purge(&self, ctl: &JobControl) -> Result<()> {
        if self.purging.swap(true, Ordering::AcqRel) {
            return Err(ReplicaError::FailedPrecondition(
                "a purge is already running".into(),
            ));
        }
        struct Reset<'a>(&'a Replica);
        impl Drop for Reset<'_> {
            fn drop(&mut self) {
                self.0.purging.store(false, Ordering::Release);
            }
        }
        let _reset = Reset(self);
        let total = {
            let _shape = lock(&self.shape);
            let mut chain = self.chain_write_open()?;
            if chain.info.rebuilding {
                return Err(ReplicaError::FailedPrecondition(
                    "cannot purge while rebuilding".into(),
                ));
            }
            let head = chain.info.head.clone();
            let system: Vec<String> = chain
                .disks
                .values()
                .filter(|d| d.name != head && !d.user_created && !d.removed)
                .map(|d| d.name.clone())
                .collect();
            for name in system {
                if let Some(d) = chain.disks.get_mut(&name) {
                    d.removed = true;
                    write_json_atomic(&self.dir, &names::meta_file(&name), d)?;
                }
            }
            chain.disks.values().filter(|d| d.removed).count()
        };
        let mut done = 0usize;
        let mut pruned = BTreeSet::new();
        while let Some(step) = self.next_step(&pruned)? {
            if ctl.is_cancelled() {
                return Err(ReplicaError::Cancelled);
            }
            match step {
                Step::Remove(s) => self.remove_leaf(&s)?,
                Step::Fold { snap, child } => self.fold(&snap, &child, ctl)?,
                Step::Prune(s) => {
                    self.prune(&s, ctl)?;
                    pruned.insert(s);
                }
            }
            done += 1;
            ctl.set_progress(u32::try_from(done * 100 / total.max(done)).unwrap_or(100));
        }
        info!(dir = %self.dir.display(), processed = done, "purge complete");
        Ok(())
    }

    fn next_step(&self, pruned: &BTreeSet<String>) -> Result<Option<Step>> {
        let chain = self.chain_read_open()?;
        for d in chain
            .disks
            .values()
            .filter(|d| d.removed && !pruned.contains(&d.name))
        {
            let children = DirLayout::children(&chain.disks, &d.name);
            match children.as_slice() {
                [] => return Ok(Some(Step::Remove(d.name.clone()))),
                [c] if *c == chain.info.head => return Ok(Some(Step::Prune(d.name.clone()))),
                [c] => {
                    return Ok(Some(Step::Fold {
                        snap: d.name.clone(),
                        child: c.clone(),
                    }));
                }
                _ => {}
            }
        }
        Ok(None)
    }

    fn remove_leaf(&self, snap: &str) -> Result<()> {
        let _shape = lock(&self.shape);
        let mut chain = self.chain_write_open()?;
        if !DirLayout::children(&chain.disks, snap).is_empty() || chain.layers.iter().any(|l| l.name == snap)
        {
            return Ok(()); // the tree changed meanwhile; the next step re-plans
        }
        remove_if_exists(&self.dir.join(names::meta_file(snap)))?;
        remove_if_exists(&self.dir.join(snap))?;
        remove_if_exists(&self.dir.join(names::checksum_file(snap)))?;
        sync_dir(&self.dir)?;
        chain.disks.remove(snap);
        info!(dir = %self.dir.display(), snapshot = %snap, "removed snapshot deleted");
        Ok(())
    }

    fn fold(&self, snap: &str, child: &str, ctl: &JobControl) -> Result<()> {
        let (sp, cp) = (self.dir.join(snap), self.dir.join(child));
        let target = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&sp)
            .ctx("open", &sp)?;
        let source = File::open(&cp).ctx("open", &cp)?;
        let src_len = source.metadata().ctx("stat", &cp)?.len();
        if target.metadata().ctx("stat", &sp)?.len() < src_len {
            target.set_len(src_len).ctx("truncate", &sp)?;
        }
        let mut buf = vec![0u8; COPY_CHUNK];
        for r in corral_disk::sparse::data_extents(&source, 0..src_len) {
            let r = r.ctx("seek data", &cp)?;
            let mut pos = r.start;
            while pos < r.end {
                if ctl.is_cancelled() {
                    return Err(ReplicaError::Cancelled);
                }
                let n = usize::try_from((r.end - pos).min(COPY_CHUNK as u64)).unwrap_or(COPY_CHUNK);
                source.read_exact_at(&mut buf[..n], pos).ctx("read", &cp)?;
                target.write_all_at(&buf[..n], pos).ctx("write", &sp)?;
                pos += n as u64;
            }
        }
        target.sync_all().ctx("fsync", &sp)?;

        let _shape = lock(&self.shape);
        let mut chain = self.chain_write_open()?;
        if DirLayout::children(&chain.disks, snap) != [child.to_owned()] {
            return Err(ReplicaError::FailedPrecondition(format!(
                "{snap} changed during purge"
            )));
        }
        fs::rename(&sp, &cp).ctx("rename", &cp)?;
        sync_dir(&self.dir)?;
        let parent = chain.disks[snap].parent.clone();
        let mut cm = chain.disks[child].clone();
        cm.parent.clone_from(&parent);
        write_json_atomic(&self.dir, &names::meta_file(child), &cm)?;
        remove_if_exists(&self.dir.join(names::meta_file(snap)))?;
        remove_if_exists(&self.dir.join(names::checksum_file(snap)))?;
        remove_if_exists(&self.dir.join(names::checksum_file(child)))?;
        sync_dir(&self.dir)?;
        chain.disks.remove(snap);
        chain.disks.insert(child.to_owned(), cm);

        if let Some(i) = chain.layers.iter().position(|l| l.name == snap) {
            // The live chain holds S at i and C at i+1: they become one layer at i, opened by C's name.
            let file = File::open(&cp).ctx("open", &cp)?;
            chain.layers[i] = Layer {
                name: child.to_owned(),
                file,
            };
            chain.layers.remove(i + 1);
            // Blocks of C (i+1) now live in layer i; everything above moves down by one.
            let ci = LayerIndex::try_from(i + 1).unwrap_or(LayerIndex::MAX);
            write_lock(&self.map).remap(|l| Some(if l >= ci { l - 1 } else { l }));
        }
        info!(dir = %self.dir.display(), snapshot = %snap, into = %child, "removed snapshot folded");
        Ok(())
    }

    fn prune(&self, snap: &str, ctl: &JobControl) -> Result<()> {
        let sp = self.dir.join(snap);
        let target = OpenOptions::new().write(true).open(&sp).ctx("open", &sp)?;
        let snap_len = target.metadata().ctx("stat", &sp)?.len();
        let mut cursor = 0u64;
        let mut runs = Vec::with_capacity(PRUNE_RUNS_PER_LOCK);
        loop {
            if ctl.is_cancelled() {
                return Err(ReplicaError::Cancelled);
            }
            runs.clear();
            let chain = self.chain_read_open()?;
            let Some(i) = chain.layers.iter().position(|l| l.name == snap) else {
                break;
            };
            if i + 2 != chain.layers.len() {
                break; // a snapshot was taken: the old head now shadows S as a snapshot; stop here
            }
            let head = chain.head_index();
            let end = snap_len.div_ceil(BLOCK_SIZE);
            read_lock(&self.map).visit_layer(head, cursor, end, |s, e| {
                runs.push((s, e));
                runs.len() < PRUNE_RUNS_PER_LOCK
            });
            for &(s, e) in &runs {
                let (bs, be) = (s * BLOCK_SIZE, (e * BLOCK_SIZE).min(snap_len));
                corral_disk::sparse::punch_hole(&target, bs, be - bs).ctx("punch hole", &sp)?;
            }
            drop(chain);
            match runs.last() {
                Some(&(_, e)) if runs.len() == PRUNE_RUNS_PER_LOCK => cursor = e,
                _ => break,
            }
        }
        target.sync_all().ctx("fsync", &sp)?;
        remove_if_exists(&self.dir.join(names::checksum_file(snap)))?;
        info!(dir = %self.dir.display(), snapshot = %snap, "removed snapshot pruned under the head");
        Ok(())
    }
}
