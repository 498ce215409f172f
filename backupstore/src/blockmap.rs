//! Pure block-map operations: merging an incremental's changes into its base map, and diffing two maps for an
//! incremental restore. Property-tested against a `BTreeMap` model.

use std::collections::BTreeMap;

use crate::config::BlockRef;

/// The base map with `changes` applied: `Some(hash)` sets the block at that offset, `None` makes it a zero block
/// (dropped from the map). Offsets at or past `size` are dropped (a shrunk volume). The result is sorted.
pub fn merge(base: &[BlockRef], changes: &BTreeMap<u64, Option<String>>, size: u64) -> Vec<BlockRef> {
    let mut m: BTreeMap<u64, String> = base.iter().map(|b| (b.offset, b.hash.clone())).collect();
    for (&off, h) in changes {
        match h {
            Some(h) => m.insert(off, h.clone()),
            None => m.remove(&off),
        };
    }
    m.into_iter()
        .filter(|(o, _)| *o < size)
        .map(|(offset, hash)| BlockRef { offset, hash })
        .collect()
}

/// What an incremental restore from `from` to `to` must do.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct MapDiff {
    /// Blocks to write (new or changed).
    pub write: Vec<BlockRef>,
    /// Offsets of blocks that became zeros.
    pub zero: Vec<u64>,
}

/// The blocks that differ between two maps of the same block size.
pub fn diff(from: &[BlockRef], to: &[BlockRef]) -> MapDiff {
    let old: BTreeMap<u64, &str> = from.iter().map(|b| (b.offset, b.hash.as_str())).collect();
    let new: BTreeMap<u64, &str> = to.iter().map(|b| (b.offset, b.hash.as_str())).collect();
    MapDiff {
        write: to
            .iter()
            .filter(|b| old.get(&b.offset) != Some(&b.hash.as_str()))
            .cloned()
            .collect(),
        zero: from
            .iter()
            .filter(|b| !new.contains_key(&b.offset))
            .map(|b| b.offset)
            .collect(),
    }
}

/// Byte ranges of `[0, size)` not covered by any block of `map` (block size `bs`), merged.
pub fn holes(map: &[BlockRef], bs: u64, size: u64) -> Vec<std::ops::Range<u64>> {
    let mut out: Vec<std::ops::Range<u64>> = Vec::new();
    let mut pos = 0;
    for b in map {
        if b.offset > pos {
            out.push(pos..b.offset.min(size));
        }
        pos = pos.max(b.offset + bs);
    }
    if pos < size {
        out.push(pos..size);
    }
    out.retain(|r| r.start < r.end);
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn map(m: &BTreeMap<u64, u8>) -> Vec<BlockRef> {
        m.iter()
            .map(|(o, h)| BlockRef {
                offset: o * 8,
                hash: format!("h{h}"),
            })
            .collect()
    }

    proptest! {
        #[test]
        fn merge_then_diff_agrees_with_a_model(
            base in prop::collection::btree_map(0u64..32, 0u8..4, 0..20),
            changes in prop::collection::btree_map(0u64..32, prop::option::of(0u8..4), 0..20),
        ) {
            let b = map(&base);
            let ch: BTreeMap<u64, Option<String>> =
                changes.iter().map(|(o, h)| (o * 8, h.map(|h| format!("h{h}")))).collect();
            let merged = merge(&b, &ch, 32 * 8);
            let mut model = base.clone();
            for (o, h) in &changes {
                match h { Some(h) => { model.insert(*o, *h); } None => { model.remove(o); } }
            }
            prop_assert_eq!(&merged, &map(&model));
            // Applying the diff to the old map yields the new one.
            let d = diff(&b, &merged);
            let mut applied: BTreeMap<u64, String> = b.iter().map(|x| (x.offset, x.hash.clone())).collect();
            for z in &d.zero { applied.remove(z); }
            for w in &d.write { applied.insert(w.offset, w.hash.clone()); }
            let applied: Vec<BlockRef> = applied.into_iter().map(|(offset, hash)| BlockRef { offset, hash }).collect();
            prop_assert_eq!(&applied, &merged);
            // Holes and blocks tile the volume exactly.
            let hs = holes(&merged, 8, 32 * 8);
            let covered: u64 = hs.iter().map(|r| r.end - r.start).sum::<u64>() + merged.len() as u64 * 8;
            prop_assert_eq!(covered, 32 * 8);
        }
    }
}
