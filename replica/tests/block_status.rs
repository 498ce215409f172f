//! `BlockStatus` through the real daemon: what the location map reports as allocated across snapshots, unmap,
//! a backing file, and requests that cover only part of the volume.
// Lists of one byte range are what BlockStatus answers, not a mistyped `Vec<u64>`.
#![allow(clippy::single_range_in_vec_init)]

mod common;

use std::ops::Range;

use common::Daemon;
use corral_proto::v1;
use data_protocol::{ClientError, DataClient, ErrorKind};

const SIZE: u64 = 16 << 20;
const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

async fn allocated(data: &DataClient, offset: u64, len: u64) -> Vec<Range<u64>> {
    let len = u32::try_from(len).unwrap();
    let status = data.block_status(offset, len).await.unwrap();
    assert_eq!(status.covered, u64::from(len), "a short list is answered whole");
    status.allocated
}

async fn snapshot(d: &Daemon, name: &str) {
    d.control()
        .await
        .replica_snapshot(v1::ReplicaSnapshotRequest {
            name: name.to_owned(),
            user_created: true,
            created: String::new(),
            labels: Default::default(),
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_held_by_any_layer_are_allocated_and_merge_across_layers() {
    let t = tempfile::tempdir().unwrap();
    let d = Daemon::start(t.path(), Some(SIZE), &[]);
    let data = d.data().await;
    assert_eq!(
        allocated(&data, 0, SIZE).await,
        vec![],
        "a new replica is all holes"
    );

    data.write(0, &[1; 8192]).await.unwrap();
    data.write(64 * KIB, &[2; 4096]).await.unwrap();
    data.write(100_000, &[3; 100]).await.unwrap(); // inside block 24: the whole block is allocated
    snapshot(&d, "s1").await;
    data.write(8 * KIB, &[4; 4096]).await.unwrap(); // next to a snapshot's run: one range
    data.write(MIB, &[5; 4096]).await.unwrap();
    data.unmap(64 * KIB, 4096).await.unwrap(); // the head never held it: the snapshot's copy shows through
    data.write(2 * MIB, &[6; 8192]).await.unwrap();
    data.unmap(2 * MIB, 4096).await.unwrap(); // punched from the head, no lower copy: a hole again

    let all = vec![
        0..12 * KIB,
        64 * KIB..68 * KIB,
        96 * KIB..100 * KIB,
        MIB..MIB + 4 * KIB,
        2 * MIB + 4 * KIB..2 * MIB + 8 * KIB,
    ];
    assert_eq!(allocated(&data, 0, SIZE).await, all);
    // Clipped to an unaligned request.
    assert_eq!(
        allocated(&data, 4096 + 10, 64 * KIB + 100 - 4096 - 10).await,
        vec![4096 + 10..12 * KIB, 64 * KIB..64 * KIB + 100]
    );
    assert_eq!(
        allocated(&data, 12 * KIB, 52 * KIB).await,
        vec![],
        "a hole between runs"
    );
    assert_eq!(allocated(&data, SIZE - 512, 512).await, vec![]);

    let err = data.block_status(SIZE - 4096, 8192).await.unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Remote {
                kind: ErrorKind::OutOfRange,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(data.failure().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_in_no_layer_are_allocated_within_the_backing_file() {
    let t = tempfile::tempdir().unwrap();
    let backing = t.path().join("base.raw");
    // Not a whole number of blocks: its last, partial block counts as allocated.
    std::fs::write(&backing, vec![7u8; usize::try_from(MIB + 512).unwrap()]).unwrap();
    let dir = t.path().join("replica");
    let d = Daemon::start(&dir, Some(SIZE), &["--backing-file", backing.to_str().unwrap()]);
    let data = d.data().await;
    data.write(4 * MIB, &[1; 4096]).await.unwrap();
    assert_eq!(
        allocated(&data, 0, SIZE).await,
        vec![0..MIB + 4 * KIB, 4 * MIB..4 * MIB + 4 * KIB]
    );
    snapshot(&d, "s1").await;
    data.write(MIB + 4 * KIB, &[2; 4096]).await.unwrap(); // extends the backing file's range
    assert_eq!(
        allocated(&data, 512 * KIB, 4 * MIB).await,
        vec![512 * KIB..MIB + 8 * KIB, 4 * MIB..4 * MIB + 4 * KIB]
    );
}
