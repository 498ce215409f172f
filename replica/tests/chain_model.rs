//! Property test: random sequences of write / unmap / write-zeroes / snapshot / revert / mark-removed + purge /
//! expand / reopen on a real replica directory, checked after every step against a deliberately naive model
//! (a tree of layers, each a map of 4 KiB blocks, read by walking down to the root and the backing file).

#![allow(clippy::cast_possible_truncation)] // test model: sizes are small and hosts are 64-bit

use std::collections::HashMap;
use std::path::Path;

use proptest::prelude::*;
use replica::jobs::JobControl;
use replica::{Replica, ReplicaOptions, SnapshotRequest};

const BS: u64 = 4096;
const INITIAL_BLOCKS: u64 = 24;
const HEAD: &str = "<head>";

#[derive(Debug, Clone)]
enum Op {
    Write { off: u64, len: u64, seed: u8 },
    Unmap { off: u64, len: u64 },
    Zero { off: u64, len: u64 },
    Snapshot,
    Revert(usize),
    RemoveAndPurge(usize),
    Expand(u64),
    Reopen { clean: bool },
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    let max = INITIAL_BLOCKS * BS;
    let range = (0..max, 1..3 * BS).prop_map(move |(o, l)| (o, l.min(max - o)));
    prop_oneof![
        8 => (range.clone(), any::<u8>()).prop_map(|((off, len), seed)| Op::Write { off, len, seed }),
        2 => range.clone().prop_map(|(off, len)| Op::Unmap { off, len }),
        2 => range.prop_map(|(off, len)| Op::Zero { off, len }),
        3 => Just(Op::Snapshot),
        1 => any::<usize>().prop_map(Op::Revert),
        2 => any::<usize>().prop_map(Op::RemoveAndPurge),
        1 => (1..4u64).prop_map(Op::Expand),
        1 => any::<bool>().prop_map(|clean| Op::Reopen { clean }),
        1 => Just(Op::Flush),
    ]
}

#[derive(Debug, Clone, Default)]
struct Layer {
    parent: Option<String>,
    blocks: HashMap<u64, Vec<u8>>,
    removed: bool,
    user: bool,
}

struct Model {
    size: u64,
    layers: HashMap<String, Layer>,
    backing: Vec<u8>,
    next_snap: usize,
}

impl Model {
    fn block(&self, from: &str, b: u64) -> Vec<u8> {
        let mut cur = Some(from.to_owned());
        while let Some(name) = cur {
            let l = &self.layers[&name];
            if let Some(d) = l.blocks.get(&b) {
                return d.clone();
            }
            cur = l.parent.clone();
        }
        let mut out = vec![0u8; BS as usize];
        let start = (b * BS) as usize;
        if start < self.backing.len() {
            let n = (self.backing.len() - start).min(BS as usize);
            out[..n].copy_from_slice(&self.backing[start..start + n]);
        }
        out
    }

    fn read_all(&self, from: &str) -> Vec<u8> {
        (0..self.size / BS).flat_map(|b| self.block(from, b)).collect()
    }

    fn write(&mut self, off: u64, data: &[u8]) {
        let mut pos = off;
        while pos < off + data.len() as u64 {
            let b = pos / BS;
            let mut block = self.block(HEAD, b);
            let s = (pos - b * BS) as usize;
            let n = ((b + 1) * BS - pos).min(off + data.len() as u64 - pos) as usize;
            let from = (pos - off) as usize;
            block[s..s + n].copy_from_slice(&data[from..from + n]);
            self.layers.get_mut(HEAD).unwrap().blocks.insert(b, block);
            pos += n as u64;
        }
    }

    fn unmap(&mut self, off: u64, len: u64) {
        let head = self.layers.get_mut(HEAD).unwrap();
        for b in off.div_ceil(BS)..(off + len) / BS {
            head.blocks.remove(&b);
        }
    }

    /// What a purge does, in the replica's order (snapshot file names ascending, first actionable first):
    /// system snapshots are marked removed; a removed leaf is deleted; a removed snapshot with one child that is
    /// not the head is folded into it (the child keeps its name and gets the union, its own blocks winning); one
    /// whose only child is the head is pruned (its blocks that the head also holds are dropped).
    fn purge(&mut self) {
        for (n, l) in &mut self.layers {
            if n != HEAD && !l.user {
                l.removed = true;
            }
        }
        let mut pruned = std::collections::BTreeSet::new();
        loop {
            let mut names: Vec<String> = self
                .layers
                .iter()
                .filter(|(n, l)| *n != HEAD && l.removed && !pruned.contains(*n))
                .map(|(n, _)| n.clone())
                .collect();
            names.sort();
            let step = names.into_iter().find_map(|n| {
                let children: Vec<String> = self
                    .layers
                    .iter()
                    .filter(|(_, l)| l.parent.as_deref() == Some(n.as_str()))
                    .map(|(c, _)| c.clone())
                    .collect();
                match children.len() {
                    0 | 1 => Some((n, children.into_iter().next())),
                    _ => None,
                }
            });
            let Some((name, child)) = step else { break };
            match child {
                None => {
                    self.layers.remove(&name);
                }
                Some(c) if c == HEAD => {
                    let head_blocks: Vec<u64> = self.layers[HEAD].blocks.keys().copied().collect();
                    let s = self.layers.get_mut(&name).unwrap();
                    for b in head_blocks {
                        s.blocks.remove(&b);
                    }
                    pruned.insert(name);
                }
                Some(c) => {
                    let s = self.layers.remove(&name).unwrap();
                    let child = self.layers.get_mut(&c).unwrap();
                    for (b, d) in s.blocks {
                        child.blocks.entry(b).or_insert(d);
                    }
                    child.parent = s.parent;
                }
            }
        }
    }

    /// Snapshot names that may be reverted to.
    fn revertable(&self) -> Vec<String> {
        let mut v: Vec<_> = self
            .layers
            .iter()
            .filter(|(n, l)| *n != HEAD && !l.removed)
            .map(|(n, _)| n.clone())
            .collect();
        v.sort();
        v
    }
}

fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1)
        .collect()
}

fn snapshot(r: &Replica, m: &mut Model, name: &str, user: bool) {
    let head = m.layers.remove(HEAD).unwrap();
    m.layers.insert(name.to_owned(), Layer { user, ..head });
    m.layers.insert(
        HEAD.into(),
        Layer {
            parent: Some(name.to_owned()),
            ..Default::default()
        },
    );
    if user {
        r.snapshot(&SnapshotRequest {
            name: name.into(),
            user_created: true,
            ..Default::default()
        })
        .unwrap();
    }
}

fn check(r: &Replica, m: &Model) {
    assert_eq!(r.size(), m.size);
    let mut got = vec![0u8; m.size as usize];
    r.read_at(0, &mut got).unwrap();
    let want = m.read_all(HEAD);
    if got != want {
        let first = got.iter().zip(&want).position(|(a, b)| a != b).unwrap();
        panic!(
            "volume differs from the model first at byte {first} (block {})",
            first as u64 / BS
        );
    }
}

fn run(ops: Vec<Op>, with_backing: bool) {
    let dir = tempfile::tempdir().unwrap();
    let rdir = dir.path().join("replica");
    let backing: Vec<u8> = if with_backing {
        pattern(10 * BS + 1000, 0x5a)
    } else {
        Vec::new()
    };
    let bpath = dir.path().join("backing.raw");
    let opts = ReplicaOptions {
        backing_file: with_backing.then(|| {
            std::fs::write(&bpath, &backing).unwrap();
            bpath.clone()
        }),
        disable_revision_counter: None,
        backing_image: None,
    };
    let mut r = Replica::create(&rdir, INITIAL_BLOCKS * BS, &opts).unwrap();
    let mut m = Model {
        size: INITIAL_BLOCKS * BS,
        layers: HashMap::new(),
        backing,
        next_snap: 0,
    };
    m.layers.insert(HEAD.into(), Layer::default());
    for op in ops {
        apply(&mut r, &mut m, &rdir, &op);
        check(&r, &m);
    }
    // Every surviving, non-removed snapshot still holds exactly its content.
    for name in m.revertable() {
        r.revert(&name, "").unwrap();
        m.layers.remove(HEAD);
        m.layers.insert(
            HEAD.into(),
            Layer {
                parent: Some(name.clone()),
                ..Default::default()
            },
        );
        check(&r, &m);
    }
}

fn apply(r: &mut Replica, m: &mut Model, dir: &Path, op: &Op) {
    match *op {
        Op::Write { off, len, seed } => {
            let len = len.min(m.size - off);
            let data = pattern(len, seed);
            r.write_at(off, &data).unwrap();
            m.write(off, &data);
        }
        Op::Unmap { off, len } => {
            r.unmap(off, len).unwrap();
            m.unmap(off, len);
        }
        Op::Zero { off, len } => {
            r.write_zeroes(off, len).unwrap();
            m.write(off, &vec![0u8; len as usize]);
        }
        Op::Snapshot => {
            m.next_snap += 1;
            let name = format!("s{}", m.next_snap);
            snapshot(r, m, &name, true);
        }
        Op::Revert(i) => {
            let names = m.revertable();
            if names.is_empty() {
                return;
            }
            let name = names[i % names.len()].clone();
            r.revert(&name, "").unwrap();
            m.layers.remove(HEAD);
            m.layers.insert(
                HEAD.into(),
                Layer {
                    parent: Some(name),
                    ..Default::default()
                },
            );
        }
        Op::RemoveAndPurge(i) => {
            let names = m.revertable();
            if !names.is_empty() {
                let name = names[i % names.len()].clone();
                r.mark_removed(&name).unwrap();
                m.layers.get_mut(&name).unwrap().removed = true;
            }
            r.purge(&JobControl::default()).unwrap();
            m.purge();
        }
        Op::Expand(extra) => {
            let new = m.size + extra * BS;
            r.expand(new).unwrap();
            snapshot(r, m, &format!("expand-{new}"), false);
            m.size = new;
        }
        Op::Reopen { clean } => {
            if clean {
                r.close().unwrap();
            }
            *r = Replica::open(dir, &ReplicaOptions::default()).unwrap();
        }
        Op::Flush => r.flush().unwrap(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn replica_matches_the_model(ops in proptest::collection::vec(op(), 1..40)) {
        run(ops, false);
    }

    #[test]
    fn replica_over_a_backing_file_matches_the_model(ops in proptest::collection::vec(op(), 1..40)) {
        run(ops, true);
    }
}
