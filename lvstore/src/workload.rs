//! The crash-test workload (`corral-lvstore workload`) and the model that checks a store after the workload was
//! killed. Every 4 KiB block the workload writes carries a unique tag, its block number and a pattern derived
//! from both, so a reader can tell which write it holds, and that the block is whole. The workload logs each step
//! to a ledger (append-only, written before the step, and `ok`/`f` lines after it returned); the model replays
//! the ledger and allows, for each block, the tag of the last flushed write or of any write since.

// Indices and pattern bytes here are bounded by the workload's small lvols and lists.
#![allow(clippy::cast_possible_truncation)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use crate::{BlobKind, LvStore};

const BS: usize = corral_disk::BLOCK_BYTES;
/// The size of every lvol the workload creates.
pub const LVOL_SIZE: u64 = 2 << 20;
/// The most lvols and snapshots the workload keeps.
pub const MAX_BLOBS: usize = 24;

/// Block `block` written with `tag` (tag 0 is the zero block).
pub fn tagged_block(tag: u64, block: u64) -> Vec<u8> {
    let mut b = vec![0u8; BS];
    b[..8].copy_from_slice(&tag.to_le_bytes());
    b[8..16].copy_from_slice(&block.to_le_bytes());
    let seed = tag.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ block;
    for (i, x) in b[16..].iter_mut().enumerate() {
        *x = (seed >> ((i % 8) * 8)) as u8 ^ (i as u8);
    }
    b
}

/// The tag a block read back holds; `Err` when it is neither zeros nor a whole tagged block of this number.
pub fn tag_of(buf: &[u8], block: u64) -> Result<u64, String> {
    if buf.iter().all(|b| *b == 0) {
        return Ok(0);
    }
    let mut t = [0u8; 8];
    t.copy_from_slice(&buf[..8]);
    let tag = u64::from_le_bytes(t);
    if tagged_block(tag, block) != buf {
        return Err(format!("block {block} is torn or foreign (claims tag {tag})"));
    }
    Ok(tag)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Runs writes, flushes, snapshots, clones, creates and deletes on `store` until killed (or for `steps`
/// steps), logging to `ledger`. Tags are `run << 32 | n`, unique across runs.
pub fn run(
    store: &LvStore,
    ledger: &Path,
    run: u64,
    steps: Option<u64>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(ledger)?;
    let mut line = |s: String| log.write_all(format!("{s}\n").as_bytes());
    let mut rng = Rng(run.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1);
    let mut n = 0u64;
    let blocks = LVOL_SIZE / corral_disk::BLOCK_SIZE;
    loop {
        if steps.is_some_and(|s| n >= s) {
            return Ok(());
        }
        n += 1;
        let list = store.list();
        let lvols: Vec<_> = list.iter().filter(|b| b.kind == BlobKind::Lvol).collect();
        let snaps: Vec<_> = list.iter().filter(|b| b.kind == BlobKind::Snapshot).collect();
        let dice = rng.below(100);
        if lvols.is_empty() || (dice < 3 && list.len() < MAX_BLOBS) {
            let name = format!("lv-{run}-{n}");
            line(format!("n {name}"))?;
            store.create_lvol(&name, LVOL_SIZE)?;
            line("ok".into())?;
        } else if dice < 75 {
            let l = lvols[rng.below(lvols.len() as u64) as usize];
            let count = 1 + rng.below(4);
            let first = rng.below(blocks - count + 1);
            let mut data = Vec::with_capacity(BS * count as usize);
            let tag0 = (run << 32) | (n << 3);
            for i in 0..count {
                line(format!("w {} {} {}", l.name, first + i, tag0 + i))?;
                data.extend_from_slice(&tagged_block(tag0 + i, first + i));
            }
            let id = store.lookup(&l.name)?;
            store.write_at(id, first * corral_disk::BLOCK_SIZE, &data)?;
        } else if dice < 85 {
            store.flush()?;
            line("f".into())?;
        } else if dice < 91 && list.len() < MAX_BLOBS {
            let l = lvols[rng.below(lvols.len() as u64) as usize];
            let snap = format!("sn-{run}-{n}");
            line(format!("s {} {snap}", l.name))?;
            store.snapshot(&l.name, &snap)?;
            line("ok".into())?;
        } else if dice < 95 && list.len() < MAX_BLOBS && !snaps.is_empty() {
            let s = snaps[rng.below(snaps.len() as u64) as usize];
            let name = format!("cl-{run}-{n}");
            line(format!("c {} {name}", s.name))?;
            store.clone_snapshot(&s.name, &name)?;
            line("ok".into())?;
        } else {
            let cands: Vec<_> = list
                .iter()
                .filter(|b| {
                    (b.kind == BlobKind::Lvol && b.children.is_empty() && lvols.len() > 1)
                        || (b.kind == BlobKind::Snapshot && b.children.len() <= 1)
                })
                .collect();
            if cands.is_empty() {
                continue;
            }
            let b = cands[rng.below(cands.len() as u64) as usize];
            line(format!("d {}", b.name))?;
            store.delete(&b.name)?;
            line("ok".into())?;
        }
    }
}

/// What every block of every lvol may hold: the tags allowed (the last being the newest write).
#[derive(Debug, Clone, Default)]
pub struct Model {
    pub blobs: BTreeMap<String, BTreeMap<u64, Vec<u64>>>,
}

impl Model {
    fn collapse(&mut self) {
        for blocks in self.blobs.values_mut() {
            for tags in blocks.values_mut() {
                let last = *tags.last().unwrap_or(&0);
                *tags = vec![last];
            }
        }
    }

    /// Applies a ledger to this baseline. `exists` says whether a name is in the store, to settle the last step
    /// when it was cut off by the kill.
    pub fn replay(&mut self, ledger: &str, exists: &dyn Fn(&str) -> bool) -> Result<(), String> {
        let lines: Vec<&str> = ledger.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let f: Vec<&str> = lines[i].split(' ').collect();
            let done = lines.get(i + 1) == Some(&"ok");
            let last = i + 1 >= lines.len();
            let parse = |s: &str| s.parse::<u64>().map_err(|e| format!("ledger line {i}: {e}"));
            match f.as_slice() {
                ["w", name, blk, tag] => {
                    let tags = self
                        .blobs
                        .get_mut(*name)
                        .ok_or_else(|| format!("ledger line {i}: write to unknown {name}"))?
                        .entry(parse(blk)?)
                        .or_insert_with(|| vec![0]);
                    tags.push(parse(tag)?);
                }
                ["f"] => self.collapse(),
                ["n", name] => {
                    if done || exists(name) {
                        self.collapse();
                        self.blobs.insert((*name).to_owned(), BTreeMap::new());
                    }
                }
                ["s", lvol, snap] => {
                    if done || exists(snap) {
                        self.collapse();
                        let state = self
                            .blobs
                            .get(*lvol)
                            .cloned()
                            .ok_or_else(|| format!("snapshot of unknown {lvol}"))?;
                        self.blobs.insert((*snap).to_owned(), state);
                    }
                }
                ["c", snap, name] => {
                    if done || exists(name) {
                        self.collapse();
                        let state = self
                            .blobs
                            .get(*snap)
                            .cloned()
                            .ok_or_else(|| format!("clone of unknown {snap}"))?;
                        self.blobs.insert((*name).to_owned(), state);
                    }
                }
                ["d", name] => {
                    if done || !exists(name) {
                        self.collapse();
                        self.blobs.remove(*name);
                    }
                }
                ["ok"] => {}
                [""] if last => {}
                _ if last => {} // a line cut short by the kill
                _ => return Err(format!("ledger line {i}: {:?}", lines[i])),
            }
            i += 1;
        }
        Ok(())
    }

    /// Checks `store` against the model: the same lvols, every block holding an allowed tag. Returns what the
    /// store holds (the baseline of the next run).
    pub fn verify(&self, store: &LvStore) -> Result<Model, String> {
        let mut seen = Model::default();
        let names: Vec<String> = store.list().into_iter().map(|b| b.name).collect();
        let want: Vec<String> = self.blobs.keys().cloned().collect();
        if names != want {
            return Err(format!("lvols differ: store {names:?}, model {want:?}"));
        }
        let mut buf = vec![0u8; BS];
        for (name, blocks) in &self.blobs {
            let id = store.lookup(name).map_err(|e| e.to_string())?;
            let size = store.size_of(id).map_err(|e| e.to_string())?;
            for blk in 0..size / corral_disk::BLOCK_SIZE {
                store
                    .read_at(id, blk * corral_disk::BLOCK_SIZE, &mut buf)
                    .map_err(|e| e.to_string())?;
                let t = tag_of(&buf, blk).map_err(|e| format!("{name}: {e}"))?;
                let allowed = blocks.get(&blk).map_or(&[0u64][..], Vec::as_slice);
                if !allowed.contains(&t) {
                    return Err(format!(
                        "{name} block {blk}: holds tag {t}, allowed {allowed:?} (a flushed write was lost)"
                    ));
                }
                if t != 0 {
                    seen.blobs.entry(name.clone()).or_default().insert(blk, vec![t]);
                }
            }
            seen.blobs.entry(name.clone()).or_default();
        }
        Ok(seen)
    }
}
