//! What happens to files around the daemon: restarts (live upgrade), a sender killed mid-sync, files modified on
//! disk, and a disk whose identity file goes away.

mod common;

use std::os::unix::fs::{FileExt, MetadataExt};
use std::time::{Duration, SystemTime};

use common::*;
use corral_proto::v1;
use testkit::wait_for_async;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_readopts_ready_images_without_rewriting_them() {
    let disk = Disk::new("disk-a");
    let mut a = Bim::start(&disk, 2, &[]);
    let mut sums = Vec::new();
    for (i, name) in ["img0", "img1", "img2"].into_iter().enumerate() {
        sums.push(place_and_fetch(&a, &disk, name, 4 * MIB, u8::try_from(i).unwrap()).await);
    }
    let before: Vec<_> = ["img0", "img1", "img2"]
        .iter()
        .map(|n| {
            let m = std::fs::metadata(disk.backing(n, "u1")).unwrap();
            (m.ino(), m.mtime(), m.mtime_nsec(), m.ctime_nsec())
        })
        .collect();
    let cfg_before = std::fs::read(disk.image_dir("img0", "u1").join("backing.cfg")).unwrap();
    // A crash leaves a temp file of unfinished work behind: the restart removes it.
    std::fs::write(disk.image_dir("img1", "u1").join("backing.tmp"), b"partial").unwrap();
    std::fs::create_dir_all(disk.image_dir("half", "u9")).unwrap();
    std::fs::write(
        disk.image_dir("half", "u9").join("backing.tmp.sync-partial"),
        b"x",
    )
    .unwrap();

    for how in ["SIGKILL", "SIGTERM"] {
        if how == "SIGTERM" {
            a.terminate();
        }
        let t = std::time::Instant::now();
        a.restart();
        for (i, name) in ["img0", "img1", "img2"].iter().enumerate() {
            let img = a.wait_state(name, "ready", 10).await;
            assert_eq!(img.status.unwrap().current_checksum, sums[i], "{how}");
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{how}: re-adoption took {:?}",
            t.elapsed()
        );
        let after: Vec<_> = ["img0", "img1", "img2"]
            .iter()
            .map(|n| {
                let m = std::fs::metadata(disk.backing(n, "u1")).unwrap();
                (m.ino(), m.mtime(), m.mtime_nsec(), m.ctime_nsec())
            })
            .collect();
        assert_eq!(before, after, "{how}: a file was rewritten or touched");
        assert_eq!(
            std::fs::read(disk.image_dir("img0", "u1").join("backing.cfg")).unwrap(),
            cfg_before,
            "{how}: backing.cfg rewritten"
        );
        assert!(
            !disk.image_dir("img1", "u1").join("backing.tmp").exists(),
            "temp file survived the restart"
        );
        assert!(
            !disk.image_dir("half", "u9").exists(),
            "directory of unfinished work survived the restart"
        );
        assert_eq!(
            a.metric("corral_bim_reverifications_total").await,
            0.0,
            "{how}: files were re-hashed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_killed_mid_sync_fails_the_copy_and_a_retry_succeeds() {
    let (disk_a, disk_b) = (Disk::new("disk-a"), Disk::new("disk-b"));
    let size = 24 * MIB;
    // 12 MiB of data at 4 MiB/s: the transfer runs for about 3 s.
    let mut a = Bim::start(&disk_a, 2, &["--send-max-rate", "4M"]);
    let b = Bim::start(&disk_b, 2, &[]);
    let sum = place_and_fetch(&a, &disk_a, "big", size, 3).await;

    let a_addr = a.addr();
    let sync = || async {
        b.client()
            .await
            .sync(v1::BimSyncRequest {
                spec: spec("big", "u1", size, &sum),
                from_address: a_addr.clone(),
            })
            .await
    };
    sync().await.unwrap();
    wait_for_async("data arriving on B", Duration::from_secs(20), async || {
        let img = b.get("big").await.ok()?;
        let s = img.status.unwrap();
        (s.state == "in-progress" && s.progress > 0).then_some(())
    })
    .await;
    a.kill();
    let failed = b.wait_state("big", "failed", 20).await;
    let msg = failed.status.unwrap().message;
    assert!(msg.contains("sender"), "unclear failure: {msg}");
    assert!(
        disk_b.image_dirs().is_empty(),
        "temp files left on B: {:?}",
        disk_b.image_dirs()
    );
    wait_for_async("port released", Duration::from_secs(10), async || {
        (b.metric("corral_bim_receiver_ports_in_use").await == 0.0).then_some(())
    })
    .await;

    a.restart();
    a.wait_state("big", "ready", 5).await;
    sync().await.unwrap();
    b.wait_state("big", "ready", 30).await;
    assert_eq!(sha512_hex(&disk_b.backing("big", "u1")), sum);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modified_file_is_reverified_and_a_corrupted_one_fails_and_is_never_served() {
    let disk = Disk::new("disk-a");
    let a = Bim::start(&disk, 2, &["--check-interval", "0.3"]);
    let sum = place_and_fetch(&a, &disk, "img", 4 * MIB, 1).await;
    let path = disk.backing("img", "u1");
    let url = format!("{}/v1/files/img/download", a.http());

    // Only the mtime changes: unknown while hashing, then ready again with the new mtime recorded.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(3600))
        .unwrap();
    wait_for_async("touched file re-verified", Duration::from_secs(10), async || {
        let m = a.metric("corral_bim_reverifications_total").await;
        let st = state(&a.get("img").await.unwrap());
        (m == 1.0 && st == "ready").then_some(())
    })
    .await;
    assert_eq!(common::get(&url).await.unwrap().status(), 200);

    // A flipped byte: failed within the check interval, files gone, never served.
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, 100).unwrap();
    f.write_all_at(&[b[0] ^ 0xff], 100).unwrap();
    f.set_modified(SystemTime::now()).unwrap();
    drop(f);
    let resp = common::get(&url).await.unwrap();
    assert_eq!(resp.status(), 409, "a modified file was served");
    let failed = a.wait_state("img", "failed", 5).await;
    let msg = failed.status.unwrap().message;
    assert!(msg.contains("corrupted"), "{msg}");
    assert_ne!(sha512_hex_or_empty(&path), sum);
    assert_eq!(common::get(&url).await.unwrap().status(), 409);

    // A missing file fails too.
    let _ = place_and_fetch(&a, &disk, "gone", 2 * MIB, 2).await;
    std::fs::remove_file(disk.backing("gone", "u1")).unwrap();
    let failed = a.wait_state("gone", "failed", 5).await;
    assert!(failed.status.unwrap().message.contains("disappeared"));
}

fn sha512_hex_or_empty(p: &std::path::Path) -> String {
    if p.exists() { sha512_hex(p) } else { String::new() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_disk_identity_reports_unknown_and_touches_nothing() {
    let disk = Disk::new("disk-a");
    // Another disk's directory: refused at start.
    let other = Disk::new("disk-z");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_corral-bim"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--disk-path",
        ])
        .arg(other.path())
        .args(["--disk-uuid", "disk-a"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("disk-z") && err.contains("disk-a"), "{err}");

    let a = Bim::start(&disk, 2, &["--check-interval", "0.3"]);
    let sum = place_and_fetch(&a, &disk, "img", 2 * MIB, 1).await;
    let cfg = disk.path().join("corral-disk.cfg");
    std::fs::rename(&cfg, disk.path().join("moved.cfg")).unwrap();
    wait_for_async("image unknown", Duration::from_secs(5), async || {
        (state(&a.get("img").await.unwrap()) == "unknown").then_some(())
    })
    .await;
    let list = a.client().await.list(v1::Empty {}).await.unwrap().into_inner();
    assert!(list.disk_message.contains("corral-disk.cfg"), "{list:?}");
    let err = a
        .client()
        .await
        .fetch(v1::BimFetchRequest {
            spec: spec("new", "u1", 0, ""),
            data_source_address: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    let err = a
        .client()
        .await
        .delete(v1::BimImageRef {
            name: "img".into(),
            uuid: "u1".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert_eq!(sha512_hex(&disk.backing("img", "u1")), sum, "a file was touched");

    // Another disk's identity is just as bad; the right one brings the images back.
    corral_disk::identity::write_disk_config(disk.path(), "disk-q").unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(state(&a.get("img").await.unwrap()), "unknown");
    std::fs::remove_file(&cfg).unwrap();
    std::fs::rename(disk.path().join("moved.cfg"), &cfg).unwrap();
    a.wait_state("img", "ready", 5).await;
}
