//! Local sparse copy, fold and prune on real files.
#![allow(
    clippy::single_range_in_vec_init,
    clippy::reversed_empty_ranges,
    clippy::cast_possible_truncation
)]

mod common;

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;

use common::*;
use corral_disk::sparse::{FileContent, LayoutMode};
use proptest::prelude::*;
use sparse_sync::{CancellationToken, LocalError, Progress, copy, fold, prune};

fn open_rw(path: &std::path::Path) -> File {
    File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap()
}

#[test]
fn copy_reproduces_content_and_keeps_holes_as_holes() {
    let dir = scratch_dir();
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    // Size deliberately not a multiple of 4 KiB.
    let ranges = random_sparse_file(&src, (24 << 20) + 1234, 256 << 10, 7);
    std::fs::write(&dst, b"old content that must disappear").unwrap();
    let progress = Progress::new();
    let content = FileContent::open(&src, LayoutMode::SeekData).unwrap();
    let summary = copy(&content, &open_rw(&dst), &progress, &CancellationToken::new()).unwrap();
    assert_eq!(sha256_file(&dst), sha256_file(&src));
    assert_eq!(data_extents(&dst), data_extents(&src));
    assert_eq!(summary.data_bytes, data_bytes(&ranges));
    assert_eq!(progress.percent(), 100);
    assert_eq!(progress.done(), (24 << 20) + 1234);
}

#[test]
fn cancelled_copy_stops_with_cancelled_error() {
    let dir = scratch_dir();
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    random_sparse_file(&src, 8 << 20, 64 << 10, 3);
    let cancel = CancellationToken::new();
    cancel.cancel();
    let content = FileContent::open(&src, LayoutMode::SeekData).unwrap();
    let err = copy(&content, &open_rw(&dst), &Progress::new(), &cancel).unwrap_err();
    assert!(matches!(err, LocalError::Cancelled), "{err}");
}

#[test]
fn fold_grows_the_parent_and_keeps_parent_data_under_child_holes() {
    let dir = scratch_dir();
    let (parent, child) = (dir.path().join("parent"), dir.path().join("child"));
    let p = open_rw(&parent);
    p.set_len(1 << 20).unwrap();
    p.write_all_at(&[1u8; 8192], 0).unwrap();
    p.write_all_at(&[1u8; 4096], 65536).unwrap();
    let c = open_rw(&child);
    c.set_len(2 << 20).unwrap();
    c.write_all_at(&[2u8; 4096], 4096).unwrap();
    c.write_all_at(&[2u8; 4096], (2 << 20) - 4096).unwrap();
    let child_content = FileContent::open(&child, LayoutMode::SeekData).unwrap();
    fold(&child_content, &p, &Progress::new(), &CancellationToken::new()).unwrap();
    assert_eq!(p.metadata().unwrap().len(), 2 << 20);
    let mut buf = vec![0u8; 8192];
    p.read_exact_at(&mut buf, 0).unwrap();
    assert!(buf[..4096].iter().all(|&b| b == 1) && buf[4096..].iter().all(|&b| b == 2));
    assert_eq!(
        data_extents(&parent),
        vec![0..8192, 65536..65536 + 4096, (2 << 20) - 4096..2 << 20]
    );
}

/// Model: a file as a vector of optional blocks (None = hole).
fn write_model(path: &std::path::Path, blocks: &[Option<u8>]) {
    let f = open_rw(path);
    f.set_len(0).unwrap();
    f.set_len(blocks.len() as u64 * 4096).unwrap();
    for (i, b) in blocks.iter().enumerate() {
        if let Some(v) = b {
            f.write_all_at(&[*v; 4096], i as u64 * 4096).unwrap();
        }
    }
}

fn read_model(path: &std::path::Path) -> Vec<Option<u8>> {
    let f = File::open(path).unwrap();
    let n = f.metadata().unwrap().len() / 4096;
    let layout: Vec<Range<u64>> = data_extents(path);
    (0..n)
        .map(|i| {
            let off = i * 4096;
            if layout.iter().any(|r| r.start <= off && off < r.end) {
                let mut b = [0u8; 1];
                f.read_exact_at(&mut b, off).unwrap();
                Some(b[0])
            } else {
                None
            }
        })
        .collect()
}

fn blocks(max: usize) -> impl Strategy<Value = Vec<Option<u8>>> {
    proptest::collection::vec(proptest::option::of(1u8..=255), 0..max)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn fold_and_prune_match_the_block_model(parent in blocks(40), child in blocks(48)) {
        let dir = scratch_dir();
        let (pp, cp) = (dir.path().join("p"), dir.path().join("c"));
        write_model(&cp, &child);
        let child_content = FileContent::open(&cp, LayoutMode::SeekData).unwrap();

        write_model(&pp, &parent);
        fold(&child_content, &open_rw(&pp), &Progress::new(), &CancellationToken::new()).unwrap();
        let n = parent.len().max(child.len());
        let folded: Vec<Option<u8>> =
            (0..n).map(|i| child.get(i).copied().flatten().or(parent.get(i).copied().flatten())).collect();
        prop_assert_eq!(read_model(&pp), folded);

        write_model(&pp, &parent);
        prune(&open_rw(&pp), &child_content, &Progress::new(), &CancellationToken::new()).unwrap();
        let pruned: Vec<Option<u8>> = (0..n)
            .map(|i| if child.get(i).copied().flatten().is_some() { None } else { parent.get(i).copied().flatten() })
            .collect();
        prop_assert_eq!(read_model(&pp), pruned);
    }
}
