//! Block location map: which layer of the live chain holds the newest copy of each 4 KiB block.
//!
//! Longhorn keeps one byte per block (256 MiB per TiB per replica, and at most 250 layers). Corral keeps sorted,
//! non-overlapping runs `[start, end) -> layer` in a B-tree, merging neighbours of the same layer, so memory grows
//! with fragmentation (number of runs), not with volume size, and the layer index is 32 bits wide.
//! Blocks covered by no run are in no layer: they read from the backing file, or as zeros.

use std::collections::BTreeMap;

/// Index of a layer in the live chain, 0 = oldest snapshot (the backing file is not a layer).
pub type LayerIndex = u32;

/// A run's value: 8 bytes, so a B-tree entry (key + value) is 16 bytes. Runs longer than `u32::MAX` blocks
/// (16 TiB) are split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    len: u32,
    layer: LayerIndex,
}

const MAX_RUN: u64 = u32::MAX as u64;

impl Run {
    fn new(start: u64, end: u64, layer: LayerIndex) -> Self {
        debug_assert!(end > start && end - start <= MAX_RUN);
        Self {
            len: u32::try_from(end - start).unwrap_or(u32::MAX),
            layer,
        }
    }

    fn end(self, start: u64) -> u64 {
        start + u64::from(self.len)
    }
}

/// Runs of blocks mapped to layers. Block numbers, not bytes.
#[derive(Debug, Default, Clone)]
pub struct ExtentMap {
    runs: BTreeMap<u64, Run>,
}

impl ExtentMap {
    /// An empty map (every block in no layer).
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of runs held (what memory is proportional to).
    pub fn run_count(&self) -> usize {
        self.runs.len()
    }

    /// Maps blocks `[start, end)` to `layer`.
    pub fn set(&mut self, start: u64, end: u64, layer: LayerIndex) {
        if start >= end {
            return;
        }
        self.carve(start, end);
        let (mut s, mut e) = (start, end);
        if let Some((&ps, &pr)) = self.runs.range(..start).next_back()
            && pr.end(ps) == start
            && pr.layer == layer
        {
            self.runs.remove(&ps);
            s = ps;
        }
        if let Some(&nr) = self.runs.get(&end)
            && nr.layer == layer
        {
            self.runs.remove(&end);
            e = nr.end(end);
        }
        self.insert_split(s, e, layer);
    }

    /// Inserts `[s, e) -> layer` (no overlap with existing runs), in pieces of at most `MAX_RUN` blocks.
    fn insert_split(&mut self, mut s: u64, e: u64, layer: LayerIndex) {
        while s < e {
            let piece = (e - s).min(MAX_RUN);
            self.runs.insert(s, Run::new(s, s + piece, layer));
            s += piece;
        }
    }

    /// Unmaps blocks `[start, end)` (they fall back to "no layer").
    pub fn clear(&mut self, start: u64, end: u64) {
        if start < end {
            self.carve(start, end);
        }
    }

    /// Removes every run overlapping `[start, end)`, keeping the parts outside it.
    fn carve(&mut self, start: u64, end: u64) {
        if let Some((&s, &r)) = self.runs.range(..start).next_back()
            && r.end(s) > start
        {
            self.runs.insert(s, Run::new(s, start, r.layer));
            if r.end(s) > end {
                self.runs.insert(end, Run::new(end, r.end(s), r.layer));
                return;
            }
        }
        while let Some((&s, &r)) = self.runs.range(start..end).next() {
            self.runs.remove(&s);
            if r.end(s) > end {
                self.runs.insert(end, Run::new(end, r.end(s), r.layer));
                break;
            }
        }
    }

    /// Calls `f(start, end, layer)` for consecutive pieces that exactly cover `[start, end)`, in order;
    /// `layer` is `None` where no layer holds the blocks. Stops early when `f` returns `false`.
    pub fn visit(&self, start: u64, end: u64, mut f: impl FnMut(u64, u64, Option<LayerIndex>) -> bool) {
        let mut pos = start;
        if let Some((&rs, &r)) = self.runs.range(..start).next_back()
            && r.end(rs) > start
        {
            pos = r.end(rs).min(end);
            if !f(start, pos, Some(r.layer)) {
                return;
            }
        }
        if pos >= end {
            return;
        }
        for (&s, &r) in self.runs.range(pos..end) {
            if s > pos && !f(pos, s, None) {
                return;
            }
            let e = r.end(s).min(end);
            if !f(s, e, Some(r.layer)) {
                return;
            }
            pos = e;
        }
        if pos < end {
            f(pos, end, None);
        }
    }

    /// The layer holding block `b`.
    pub fn layer_of(&self, b: u64) -> Option<LayerIndex> {
        let mut out = None;
        self.visit(b, b + 1, |_, _, l| {
            out = l;
            false
        });
        out
    }

    /// Calls `f(start, end)` for every run of `layer` intersecting `[from, to)` until `f` returns false.
    pub fn visit_layer(&self, layer: LayerIndex, from: u64, to: u64, mut f: impl FnMut(u64, u64) -> bool) {
        self.visit(from, to, |s, e, l| if l == Some(layer) { f(s, e) } else { true });
    }

    /// Rewrites every run's layer with `f` (`None` unmaps it), then merges neighbours that became equal.
    /// Used when the chain changes shape under the map (a purge folds two layers into one).
    pub fn remap(&mut self, f: impl Fn(LayerIndex) -> Option<LayerIndex>) {
        let old = std::mem::take(&mut self.runs);
        // (start, end, layer) of the run being merged.
        let mut last: Option<(u64, u64, LayerIndex)> = None;
        for (s, r) in old {
            let Some(layer) = f(r.layer) else { continue };
            match &mut last {
                Some((_, le, ll)) if *le == s && *ll == layer => *le = r.end(s),
                _ => {
                    if let Some((ls, le, ll)) = last.take() {
                        self.insert_split(ls, le, ll);
                    }
                    last = Some((s, r.end(s), layer));
                }
            }
        }
        if let Some((ls, le, ll)) = last {
            self.insert_split(ls, le, ll);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BLOCKS: u64 = 64;

    #[derive(Debug, Clone)]
    enum Op {
        Set(u64, u64, LayerIndex),
        Clear(u64, u64),
        Remap(LayerIndex),
    }

    fn op() -> impl Strategy<Value = Op> {
        let range = (0..BLOCKS, 1..=16u64).prop_map(|(s, l)| (s, (s + l).min(BLOCKS)));
        prop_oneof![
            4 => (range.clone(), 0..6u32).prop_map(|((s, e), l)| Op::Set(s, e, l)),
            2 => range.prop_map(|(s, e)| Op::Clear(s, e)),
            1 => (0..6u32).prop_map(Op::Remap),
        ]
    }

    fn expand(m: &ExtentMap) -> Vec<Option<LayerIndex>> {
        let mut out = Vec::new();
        m.visit(0, BLOCKS, |s, e, l| {
            assert!(s < e, "empty piece {s}..{e}");
            out.extend((s..e).map(|_| l));
            true
        });
        out
    }

    proptest! {
        #[test]
        fn matches_a_flat_per_block_model(ops in proptest::collection::vec(op(), 1..60)) {
            let mut m = ExtentMap::new();
            let mut model = vec![None; usize::try_from(BLOCKS).unwrap()];
            for op in ops {
                match op {
                    Op::Set(s, e, l) => {
                        m.set(s, e, l);
                        for b in s..e { model[usize::try_from(b).unwrap()] = Some(l); }
                    }
                    Op::Clear(s, e) => {
                        m.clear(s, e);
                        for b in s..e { model[usize::try_from(b).unwrap()] = None; }
                    }
                    // Fold layer k into k-1 (k>0) and shift the rest down, as a purge does.
                    Op::Remap(k) => {
                        let f = |l: LayerIndex| if k > 0 && l >= k { Some(l - 1) } else { Some(l) };
                        m.remap(f);
                        for b in &mut model { *b = b.and_then(f); }
                    }
                }
                prop_assert_eq!(expand(&m), model.clone());
                // Runs never overlap and neighbours of one layer are merged.
                let runs: Vec<_> = m.runs.iter().map(|(&s, &r)| (s, r)).collect();
                for w in runs.windows(2) {
                    prop_assert!(w[0].1.end(w[0].0) <= w[1].0);
                    prop_assert!(!(w[0].1.end(w[0].0) == w[1].0 && w[0].1.layer == w[1].1.layer));
                }
            }
        }
    }

    #[test]
    fn runs_longer_than_u32_blocks_are_split_and_still_read_back() {
        let mut m = ExtentMap::new();
        let huge = MAX_RUN * 2 + 10;
        m.set(5, 5 + huge, 1);
        assert_eq!(m.run_count(), 3);
        let mut covered = 0;
        m.visit(0, 5 + huge + 1, |s, e, l| {
            if l == Some(1) {
                covered += e - s;
            }
            true
        });
        assert_eq!(covered, huge);
        m.clear(6, 5 + huge - 1);
        assert_eq!(
            (m.layer_of(5), m.layer_of(6), m.layer_of(5 + huge - 1)),
            (Some(1), None, Some(1))
        );
        assert_eq!(std::mem::size_of::<Run>() + std::mem::size_of::<u64>(), 16);
    }

    #[test]
    fn sequential_writes_collapse_into_one_run() {
        let mut m = ExtentMap::new();
        for b in 0..1000 {
            m.set(b, b + 1, 3);
        }
        assert_eq!(m.run_count(), 1);
        m.set(500, 501, 4);
        assert_eq!(m.run_count(), 3);
        assert_eq!(m.layer_of(500), Some(4));
        assert_eq!(m.layer_of(1000), None);
    }
}
