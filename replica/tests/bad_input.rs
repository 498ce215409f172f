//! Bad input gets a clear error and changes nothing: damaged metadata, broken chains, IO past the end, hostile
//! snapshot names, and hostile bytes on the data port.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;

use common::Daemon;
use corral_proto::v1;
use replica::{ErrorKind, Replica, ReplicaOptions, SnapshotRequest};

const SIZE: u64 = 8 << 20;

/// Every file of a directory with its contents, to prove nothing changed.
fn snapshot_dir(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

fn replica_with_two_snapshots(dir: &Path) {
    let r = Replica::create(dir, SIZE, &ReplicaOptions::default()).unwrap();
    r.write_at(0, &[7u8; 4096]).unwrap();
    for name in ["s1", "s2"] {
        r.snapshot(&SnapshotRequest {
            name: name.into(),
            user_created: true,
            ..Default::default()
        })
        .unwrap();
    }
    r.close().unwrap();
}

fn open_err(dir: &Path) -> replica::ReplicaError {
    Replica::open(dir, &ReplicaOptions::default()).unwrap_err()
}

#[test]
fn corrupt_volume_meta_is_named_and_nothing_changes() {
    let t = tempfile::tempdir().unwrap();
    replica_with_two_snapshots(t.path());
    std::fs::write(t.path().join("volume.meta"), b"{\"Size\": 12, \"Head\":").unwrap();
    let before = snapshot_dir(t.path());
    let e = open_err(t.path());
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(e.to_string().contains("volume.meta"), "{e}");
    assert_eq!(snapshot_dir(t.path()), before);
}

#[test]
fn missing_volume_meta_with_images_present_is_refused() {
    let t = tempfile::tempdir().unwrap();
    replica_with_two_snapshots(t.path());
    std::fs::remove_file(t.path().join("volume.meta")).unwrap();
    let before = snapshot_dir(t.path());
    let e = open_err(t.path());
    assert!(
        e.to_string().contains("volume.meta") && e.to_string().contains("missing"),
        "{e}"
    );
    assert_eq!(snapshot_dir(t.path()), before);
}

#[test]
fn corrupt_snapshot_meta_is_named() {
    let t = tempfile::tempdir().unwrap();
    replica_with_two_snapshots(t.path());
    std::fs::write(t.path().join("volume-snap-s1.img.meta"), b"not json").unwrap();
    let before = snapshot_dir(t.path());
    let e = open_err(t.path());
    assert!(e.to_string().contains("volume-snap-s1.img.meta"), "{e}");
    assert_eq!(snapshot_dir(t.path()), before);
}

#[test]
fn chain_with_a_missing_parent_is_refused() {
    let t = tempfile::tempdir().unwrap();
    replica_with_two_snapshots(t.path());
    // s2's parent s1 vanishes (image and meta).
    std::fs::remove_file(t.path().join("volume-snap-s1.img")).unwrap();
    std::fs::remove_file(t.path().join("volume-snap-s1.img.meta")).unwrap();
    let before = snapshot_dir(t.path());
    let e = open_err(t.path());
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(
        e.to_string().contains("volume-snap-s1.img") && e.to_string().contains("volume-snap-s2.img"),
        "{e}"
    );
    assert_eq!(snapshot_dir(t.path()), before);
}

#[test]
fn parent_image_missing_but_meta_present_is_refused() {
    let t = tempfile::tempdir().unwrap();
    replica_with_two_snapshots(t.path());
    std::fs::remove_file(t.path().join("volume-snap-s1.img")).unwrap();
    let before = snapshot_dir(t.path());
    let e = open_err(t.path());
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert_eq!(snapshot_dir(t.path()), before);
}

#[test]
fn io_past_the_end_is_refused_and_writes_nothing() {
    let t = tempfile::tempdir().unwrap();
    let r = Replica::create(t.path(), SIZE, &ReplicaOptions::default()).unwrap();
    let mut buf = [0u8; 4096];
    for (off, len) in [(SIZE, 1u64), (SIZE - 512, 1024), (u64::MAX - 10, 4096)] {
        let e = r
            .write_at(off, &vec![1u8; usize::try_from(len).unwrap()])
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("exceeds the volume size"), "{e}");
        assert!(r.read_at(off, &mut buf[..usize::try_from(len).unwrap()]).is_err());
        assert!(r.unmap(off, len).is_err());
        assert!(r.write_zeroes(off, len).is_err());
    }
    r.read_at(SIZE - 4096, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    assert_eq!(r.status().unwrap().head_file_size, 0, "nothing may be allocated");
}

#[test]
fn hostile_snapshot_names_are_refused_and_create_no_file() {
    let t = tempfile::tempdir().unwrap();
    let r = Replica::create(t.path(), SIZE, &ReplicaOptions::default()).unwrap();
    let before = snapshot_dir(t.path());
    for name in ["../escape", "a/b", "..", "nul\0byte", "", "/abs"] {
        let e = r
            .snapshot(&SnapshotRequest {
                name: name.into(),
                ..Default::default()
            })
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{name:?}: {e}");
        assert!(r.revert(name, "").is_err());
        assert!(r.mark_removed(name).is_err());
    }
    assert_eq!(snapshot_dir(t.path()), before);
    assert!(!t.path().parent().unwrap().join("escape").exists());
}

#[test]
fn snapshot_name_reuse_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let r = Replica::create(t.path(), SIZE, &ReplicaOptions::default()).unwrap();
    let req = SnapshotRequest {
        name: "s1".into(),
        ..Default::default()
    };
    r.snapshot(&req).unwrap();
    let e = r.snapshot(&req).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
    // The user's name first, the file it maps to after: "snapshot s1 (volume-snap-s1.img) already exists".
    assert!(
        e.to_string().starts_with("snapshot s1 (") && e.to_string().ends_with(") already exists"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_frames_drop_only_their_connection_and_grpc_rejects_bad_names() {
    let t = tempfile::tempdir().unwrap();
    let d = Daemon::start(t.path(), Some(SIZE), &[]);
    let good = d.data().await;
    good.write(0, &[9u8; 4096]).await.unwrap();

    // Wrong magic, then an oversized length: the server closes those connections.
    let mut wrong_magic = [0u8; 32];
    wrong_magic[..4].copy_from_slice(b"XXXX");
    let mut oversized = [0u8; 32];
    oversized[..4].copy_from_slice(b"CRLD");
    oversized[4..6].copy_from_slice(&1u16.to_le_bytes());
    oversized[6..8].copy_from_slice(&1u16.to_le_bytes()); // hello
    oversized[28..32].copy_from_slice(&u32::MAX.to_le_bytes());
    for frame in [wrong_magic, oversized] {
        let addr = d.data_addr();
        tokio::task::spawn_blocking(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
                .unwrap();
            s.write_all(&frame).unwrap();
            let mut rest = Vec::new();
            // EOF (or reset) means the server dropped us; a timeout would fail here.
            let r = s.read_to_end(&mut rest);
            assert!(
                r.is_ok()
                    || r.as_ref()
                        .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
                "{r:?}"
            );
        })
        .await
        .unwrap();
    }
    // The existing client keeps working, and new ones connect.
    let mut buf = [0u8; 4096];
    good.read(0, &mut buf).await.unwrap();
    assert_eq!(buf, [9u8; 4096]);
    d.data().await.read(0, &mut buf).await.unwrap();
    // Reads past the end fail cleanly on the wire too.
    assert!(good.read(SIZE, &mut buf).await.is_err());

    let mut c = d.control().await;
    let st = c
        .replica_snapshot(v1::ReplicaSnapshotRequest {
            name: "../x".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
    let st = c
        .replica_revert(v1::ReplicaRevertRequest {
            name: "nope".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::NotFound, "{st:?}");
    let st = d
        .sync_agent()
        .await
        .volume_export(v1::VolumeExportRequest::default())
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
    assert!(st.message().contains("bad receiver address"), "{st:?}");
    for (snap, code) in [
        ("nope", tonic::Code::NotFound),
        ("volume-head-000.img", tonic::Code::InvalidArgument),
        ("../x", tonic::Code::InvalidArgument),
    ] {
        let st = d
            .sync_agent()
            .await
            .volume_export(v1::VolumeExportRequest {
                snapshot_file_name: snap.into(),
                host: "127.0.0.1".into(),
                port: 9,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(st.code(), code, "{snap}: {st:?}");
    }
}
