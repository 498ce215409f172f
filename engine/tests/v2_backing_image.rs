//! v2 backing images (issue 21) against real daemons: `corral-replica serve-lvstore` makes a disk's copy of an
//! image from an HTTP URL (`rclone serve http`) or a file, SHA-512 checked, lists it again from the lvols' xattrs
//! after a SIGKILL and restart with the HTTP server gone (no download), refuses bad input leaving nothing behind;
//! and a v2 replica on the image reads its data through an engine (qemu-io) where the volume was not written; a
//! replica rebuilt onto another disk re-points the image to that disk's copy and alone reads the same, and a
//! rebuild onto a disk without a copy is refused before anything is received.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{Engine, bin};
use corral_proto::ReplicaAddress;
use corral_proto::v1::{
    self, backing_image_create_request::Source, lvstore_service_client::LvstoreServiceClient,
};
use testkit::servers::HttpFileServer;
use testkit::{Daemon, DaemonCommand, TestRng, qemu_io, sha512_bytes, wait_for_async};
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;

fn disk(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(512 * MIB).unwrap();
    p
}

fn lvstore_daemon(disk: &std::path::Path) -> Daemon {
    DaemonCommand::new(bin("corral-replica"))
        .label("corral-replica-lvstore")
        .args(["serve-lvstore", "--format", "--cluster-size", "64K", "--disk"])
        .arg(disk)
        .args(["--listen", "127.0.0.1:0"])
        .spawn()
}

async fn service(d: &Daemon) -> LvstoreServiceClient<Channel> {
    LvstoreServiceClient::connect(d.http_url("control"))
        .await
        .unwrap()
}

/// An image of `mib` MiB: random data in every other MiB, zeros (holes in the file) between.
fn image(path: &std::path::Path, mib: u64, seed: u64) -> Vec<u8> {
    let mut rng = TestRng::new(seed);
    let mut data = vec![0u8; usize::try_from(mib * MIB).unwrap()];
    for (i, chunk) in data.chunks_mut(usize::try_from(MIB).unwrap()).enumerate() {
        if i % 2 == 0 {
            rng.fill(chunk);
        }
    }
    std::fs::write(path, &data).unwrap();
    data
}

fn create(name: &str, checksum: &str, source: Source) -> v1::BackingImageCreateRequest {
    v1::BackingImageCreateRequest {
        name: name.into(),
        backing_image_uuid: format!("{name}-uuid"),
        checksum: checksum.into(),
        size: 0,
        source: Some(source),
    }
}

/// Waits until the copy of `name` leaves pending/in-progress, and returns it.
async fn settled(svc: &mut LvstoreServiceClient<Channel>, name: &str) -> v1::BackingImageV2CopyInfo {
    wait_for_async(
        &format!("backing image {name} ready or failed"),
        Duration::from_secs(60),
        async || {
            let i = svc
                .backing_image_get(v1::BackingImageRef { name: name.into() })
                .await
                .unwrap()
                .into_inner();
            (i.state == "ready" || i.state == "failed").then_some(i)
        },
    )
    .await
}

fn lvols(disk: &std::path::Path) -> String {
    let out = Command::new(bin("corral-lvstore"))
        .args(["ls", "--json"])
        .arg(disk)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// An 8 MiB image at `path`: 0x5a in its first 4 MiB, 0xa5 in the next 4 MiB; answers its bytes.
fn two_pattern_image(path: &std::path::Path) -> Vec<u8> {
    let mut data = vec![0x5au8; usize::try_from(8 * MIB).unwrap()];
    data[usize::try_from(4 * MIB).unwrap()..].fill(0xa5);
    std::fs::write(path, &data).unwrap();
    data
}

/// What the replica at `address` reports (`ReplicaGet`).
async fn replica_status(address: &str) -> v1::Replica {
    let a: ReplicaAddress = address.parse().unwrap();
    let mut ctl = v1::replica_service_client::ReplicaServiceClient::connect(a.control.grpc_uri())
        .await
        .unwrap();
    ctl.replica_get(v1::Empty {})
        .await
        .unwrap()
        .into_inner()
        .replica
        .unwrap()
}

/// Writes over a 32 MiB volume on [`two_pattern_image`] (partial blocks too) before and after a snapshot `s1`;
/// answers the qemu-io reads that check the volume (the image where it was not written), after checking them.
fn write_over_image(e: &Engine) -> [&'static str; 9] {
    let uri = e.unix_uri();
    let (ok, out) = qemu_io(&uri, &["write -P 0x11 1M 64k", "write -P 0x22 6M 512", "flush"]);
    assert!(ok, "{out}");
    assert!(e.cli(&["snapshot", "create", "s1"]).status.success());
    let (ok, out) = qemu_io(&uri, &["write -P 0x33 2M 4k", "flush"]);
    assert!(ok, "{out}");
    let reads = [
        "read -P 0x5a 0 1M",
        "read -P 0x11 1M 64k",
        "read -P 0x5a 1088k 960k",
        "read -P 0x33 2M 4k",
        "read -P 0x5a 2052k 2044k",
        "read -P 0xa5 4M 2M",
        "read -P 0x22 6M 512",
        "read -P 0xa5 6291968 2096640",
        "read -P 0 8M 24M",
    ];
    let (ok, out) = qemu_io(&uri, &reads);
    assert!(ok, "{out}");
    reads
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v2_backing_image_copies_are_made_from_a_url_or_a_file_checksummed_and_found_again_after_a_restart() {
    let t = tempfile::tempdir_in("/tmp").unwrap();
    let src = t.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let data = image(&src.join("img.raw"), 8, 21);
    let sum = sha512_bytes(&data);
    let http = HttpFileServer::start(&src);
    let d = disk(t.path(), "d.img");
    let mut daemon = lvstore_daemon(&d);
    let mut svc = service(&daemon).await;
    let mut watch = svc
        .backing_image_watch(v1::LvstoreEmpty {})
        .await
        .unwrap()
        .into_inner();

    let url = format!("{}/img.raw", http.endpoint);
    let file = src.join("img.raw").display().to_string();
    let first = svc
        .backing_image_create(create("img-url", &sum, Source::FromUrl(url.clone())))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.state, "pending", "{first:?}");
    svc.backing_image_create(create("img-file", &sum, Source::FromFile(file.clone())))
        .await
        .unwrap();
    // A wrong checksum fails after the data arrived and leaves no lvol behind.
    let wrong = "0".repeat(128);
    svc.backing_image_create(create("img-bad", &wrong, Source::FromUrl(url.clone())))
        .await
        .unwrap();

    let disk_uuid = first.disk_uuid.clone();
    assert_eq!(disk_uuid.len(), 36, "{first:?}");
    for name in ["img-url", "img-file"] {
        let i = settled(&mut svc, name).await;
        assert_eq!(i.state, "ready", "{i:?}");
        assert_eq!((i.progress, i.size), (100, 8 * MIB), "{i:?}");
        assert_eq!(i.current_checksum, sum, "{i:?}");
        assert_eq!(i.lvol, format!("bi-{name}-disk-{disk_uuid}"));
        assert_eq!(i.uuid, format!("{name}-uuid"));
    }
    let bad = settled(&mut svc, "img-bad").await;
    assert_eq!(bad.state, "failed", "{bad:?}");
    assert!(bad.message.contains("checksum mismatch"), "{bad:?}");

    // The watch saw img-url go from pending through in-progress to ready.
    let mut states = Vec::new();
    while !states.iter().any(|s: &String| s == "ready") {
        let ev = tokio::time::timeout(Duration::from_secs(30), watch.message())
            .await
            .expect("a watch event")
            .unwrap()
            .expect("the stream goes on");
        if ev.name == "img-url" && states.last() != Some(&ev.state) {
            states.push(ev.state);
        }
    }
    assert_eq!(states, ["pending", "in-progress", "ready"]);

    // Bad input: refused with a clear error, nothing made.
    for (req, code, what) in [
        (
            create("img-url", "", Source::FromFile(file.clone())),
            tonic::Code::AlreadyExists,
            "already exists",
        ),
        (
            create("../x", "", Source::FromFile(file.clone())),
            tonic::Code::InvalidArgument,
            "not a valid name",
        ),
        (
            create("rel", "", Source::FromFile("img.raw".into())),
            tonic::Code::InvalidArgument,
            "absolute file path",
        ),
        (
            create("sum", "ABC", Source::FromFile(file.clone())),
            tonic::Code::InvalidArgument,
            "not a SHA-512",
        ),
        (
            v1::BackingImageCreateRequest {
                size: 4097,
                ..create("odd", "", Source::FromFile(file.clone()))
            },
            tonic::Code::InvalidArgument,
            "multiple of 4096",
        ),
    ] {
        let st = svc.backing_image_create(req).await.unwrap_err();
        assert_eq!(st.code(), code, "{st:?}");
        assert!(st.message().contains(what), "{st:?}");
    }
    // A source shorter than the size asked for fails, nothing left.
    svc.backing_image_create(v1::BackingImageCreateRequest {
        size: 16 * MIB,
        ..create("short", "", Source::FromFile(file.clone()))
    })
    .await
    .unwrap();
    let short = settled(&mut svc, "short").await;
    assert!(
        short.state == "failed" && short.message.contains("holds 8388608 bytes"),
        "{short:?}"
    );
    for name in ["img-bad", "short"] {
        svc.backing_image_delete(v1::BackingImageRef { name: name.into() })
            .await
            .unwrap();
    }

    // SIGKILL, the HTTP source gone: the copies come back ready from their xattrs alone.
    daemon.kill();
    drop(http);
    let ls = lvols(&d);
    assert!(
        !ls.contains("img-bad") && !ls.contains("short") && !ls.contains("temp-head"),
        "{ls}"
    );
    daemon.restart();
    let mut svc = service(&daemon).await;
    let mut listed = svc
        .backing_image_list(v1::LvstoreEmpty {})
        .await
        .unwrap()
        .into_inner()
        .backing_images;
    listed.sort_by(|a, b| a.name.cmp(&b.name));
    let names: Vec<_> = listed.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["img-file", "img-url"], "{listed:?}");
    for i in &listed {
        assert_eq!(
            (
                i.state.as_str(),
                i.current_checksum.as_str(),
                i.size,
                i.disk_uuid.as_str()
            ),
            ("ready", sum.as_str(), 8 * MIB, disk_uuid.as_str()),
            "{i:?}"
        );
        assert_eq!(i.uuid, format!("{}-uuid", i.name));
    }
    // No replica is made of a backing image's lvol.
    let replicas = svc
        .lvstore_replica_list(v1::LvstoreEmpty {})
        .await
        .unwrap()
        .into_inner()
        .replicas;
    assert!(replicas.is_empty(), "{replicas:?}");
    svc.backing_image_delete(v1::BackingImageRef {
        name: "img-file".into(),
    })
    .await
    .unwrap();
    let st = svc
        .backing_image_get(v1::BackingImageRef {
            name: "img-file".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::NotFound);
    drop(svc);
    daemon.terminate(Duration::from_secs(10));
    let ls = lvols(&d);
    assert!(ls.contains(&format!("bi-img-url-disk-{disk_uuid}")), "{ls}");
    assert!(!ls.contains("img-file"), "{ls}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v2_replica_on_a_backing_image_reads_the_image_where_the_volume_was_not_written() {
    let t = tempfile::tempdir_in("/tmp").unwrap();
    let img = t.path().join("img.raw");
    let data = two_pattern_image(&img);
    let d = disk(t.path(), "d.img");
    let mut daemon = lvstore_daemon(&d);
    let mut svc = service(&daemon).await;
    svc.backing_image_create(create(
        "base",
        &sha512_bytes(&data),
        Source::FromFile(img.display().to_string()),
    ))
    .await
    .unwrap();
    let bi = settled(&mut svc, "base").await;
    assert_eq!(bi.state, "ready", "{bi:?}");

    // A volume smaller than its backing image, or on an image the disk lacks: refused, nothing made.
    let st = svc
        .lvstore_replica_add(v1::LvstoreReplicaAddRequest {
            name: "small".into(),
            size: 4 * MIB,
            backing_image: "base".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(st.message().contains("smaller than its backing image"), "{st:?}");
    let st = svc
        .lvstore_replica_add(v1::LvstoreReplicaAddRequest {
            name: "none".into(),
            backing_image: "missing".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::NotFound, "{st:?}");

    let r0 = svc
        .lvstore_replica_add(v1::LvstoreReplicaAddRequest {
            name: "v-r0".into(),
            backing_image: "base".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .address;
    let size = 32 * MIB;
    let e = Engine::start(t.path(), "v", size, std::slice::from_ref(&r0), &[]);
    let uri = e.unix_uri();
    let (ok, out) = qemu_io(
        &uri,
        &["read -P 0x5a 0 4M", "read -P 0xa5 4M 4M", "read -P 0 8M 24M"],
    );
    assert!(ok, "the image's data under an unwritten volume: {out}");
    // Writes land over the image (partial blocks too); the rest still reads the image, also after a snapshot.
    let reads = write_over_image(&e);

    // The replica reports the image as its backing file, below a chain of its own layers.
    let st = replica_status(&r0).await;
    assert_eq!(st.backing_file, bi.lvol, "{st:?}");
    assert_eq!(st.chain.len(), 2, "head and s1: {:?}", st.chain);
    assert!(st.chain.iter().all(|c| !c.is_empty()), "{:?}", st.chain);

    // The image cannot be deleted while the replica sits on it.
    let st = svc
        .backing_image_delete(v1::BackingImageRef { name: "base".into() })
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::FailedPrecondition, "{st:?}");
    assert!(st.message().contains("in use"), "{st:?}");

    // After a daemon SIGKILL and restart the volume reads the same (chain rebuilt from the store).
    drop(e);
    daemon.kill();
    daemon.restart();
    let e = Engine::start(t.path(), "v2", size, std::slice::from_ref(&r0), &[]);
    let (ok, out) = qemu_io(&e.unix_uri(), &reads);
    assert!(ok, "after restart: {out}");
    let mut svc = service(&daemon).await;
    let st = svc
        .backing_image_delete(v1::BackingImageRef { name: "base".into() })
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::FailedPrecondition, "{st:?}");
    // Once the replica is deleted the image can go.
    drop(e);
    svc.lvstore_replica_remove(v1::LvstoreReplicaRemoveRequest {
        name: "v-r0".into(),
        delete_data: true,
    })
    .await
    .unwrap();
    svc.backing_image_delete(v1::BackingImageRef { name: "base".into() })
        .await
        .unwrap();
    drop(svc);
    daemon.terminate(Duration::from_secs(10));
    let ls = lvols(&d);
    assert!(!ls.contains("bi-") && !ls.contains("v-r0"), "{ls}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuilt_v2_replica_on_a_backing_image_reads_the_image_from_its_own_disks_copy() {
    let t = tempfile::tempdir_in("/tmp").unwrap();
    let img = t.path().join("img.raw");
    let data = two_pattern_image(&img);
    let sum = sha512_bytes(&data);
    // Disks a and b hold a copy of the image, c none.
    let (da, db, dc) = (
        disk(t.path(), "a.img"),
        disk(t.path(), "b.img"),
        disk(t.path(), "c.img"),
    );
    let (a, b, c) = (lvstore_daemon(&da), lvstore_daemon(&db), lvstore_daemon(&dc));
    let (mut sa, mut sb, mut sc) = (service(&a).await, service(&b).await, service(&c).await);
    let mut copies = Vec::new();
    for svc in [&mut sa, &mut sb] {
        svc.backing_image_create(create("base", &sum, Source::FromFile(img.display().to_string())))
            .await
            .unwrap();
        let bi = settled(svc, "base").await;
        assert_eq!(bi.state, "ready", "{bi:?}");
        copies.push(bi);
    }
    assert_ne!(
        copies[0].lvol, copies[1].lvol,
        "each store names its copy by its own UUID"
    );

    let add = |name: &str, backing_image: &str| v1::LvstoreReplicaAddRequest {
        name: name.into(),
        backing_image: backing_image.into(),
        ..Default::default()
    };
    let r0 = sa
        .lvstore_replica_add(add("v-r0", "base"))
        .await
        .unwrap()
        .into_inner()
        .address;
    let size = 32 * MIB;
    let e = Engine::start(t.path(), "v", size, std::slice::from_ref(&r0), &[]);
    let uri = e.unix_uri();
    let reads = write_over_image(&e);

    // A rebuild onto disk c, which has no copy of the image: refused before anything is received, clearly.
    let r2 = sc
        .lvstore_replica_add(add("v-r2", ""))
        .await
        .unwrap()
        .into_inner()
        .address;
    let out = e.cli(&["replica", "add", &r2]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a rebuild onto a disk without the image must fail"
    );
    assert!(
        err.contains("no ready copy")
            && err.contains("base")
            && err.contains("make the copy on this disk first"),
        "{err}"
    );
    let _ = e.cli(&["replica", "rm", &r2]);

    // Onto disk b (its head made over b's copy, as the manager makes a replacement): the rebuilt chain's root is
    // re-pointed from a's copy to b's.
    let r1 = sb
        .lvstore_replica_add(add("v-r1", "base"))
        .await
        .unwrap()
        .into_inner()
        .address;
    let out = e.cli(&["replica", "add", &r1]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let st = replica_status(&r1).await;
    assert_eq!(st.backing_file, copies[1].lvol, "{st:?}");
    let (ok, out) = qemu_io(&uri, &reads);
    assert!(ok, "both replicas: {out}");
    drop(e);

    // The rebuilt replica alone reads the image where the volume was not written, and the volume's writes.
    let e = Engine::start(t.path(), "v-alone", size, std::slice::from_ref(&r1), &[]);
    let (ok, out) = qemu_io(&e.unix_uri(), &reads);
    assert!(ok, "the rebuilt replica alone: {out}");
    drop(e);
    // b's copy is in use by the rebuilt chain; nothing the rebuild staged is left.
    let st = sb
        .backing_image_delete(v1::BackingImageRef { name: "base".into() })
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::FailedPrecondition, "{st:?}");
    drop((sa, sb, sc));
    for mut d in [a, b, c] {
        d.terminate(Duration::from_secs(10));
    }
    let ls = lvols(&db);
    assert!(!ls.contains(".rcv") && ls.contains("v-r1.snap.s1"), "{ls}");
    let ls = lvols(&dc);
    assert!(
        !ls.contains(".rcv") && !ls.contains("bi-"),
        "nothing received on c: {ls}"
    );
}

/// The `allocatedBytes` of lvol `name` in the store on `disk` (`corral-lvstore ls --json`).
fn allocated(disk: &std::path::Path, name: &str) -> u64 {
    let ls: serde_json::Value = serde_json::from_str(&lvols(disk)).unwrap();
    let all = ls.as_array().unwrap_or_else(|| panic!("no lvol list in {ls}"));
    all.iter()
        .find(|l| l["name"] == name)
        .and_then(|l| l["allocatedBytes"].as_u64())
        .unwrap_or_else(|| panic!("no lvol {name} in {ls}"))
}

/// Files a sync left in the scratch directory (beside the disk files).
fn staging_files(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".corral-bi-sync-"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v2_copy_syncs_from_another_stores_exposed_copy_keeping_holes_and_a_bad_checksum_leaves_nothing() {
    let t = tempfile::tempdir_in("/tmp").unwrap();
    let img = t.path().join("img.raw");
    let data = image(&img, 8, 33);
    let sum = sha512_bytes(&data);
    let (da, db) = (disk(t.path(), "a.img"), disk(t.path(), "b.img"));
    let a = lvstore_daemon(&da);
    let mut b = lvstore_daemon(&db);
    let mut sa = service(&a).await;
    let mut sb = service(&b).await;
    let from = a.addr("control").to_string();

    // Not on A yet: the sync is refused by the source, and fails with nothing left on B.
    sb.backing_image_create(create("img", &sum, Source::FromLvstore(from.clone())))
        .await
        .unwrap();
    let early = settled(&mut sb, "img").await;
    assert!(
        early.state == "failed"
            && early
                .message
                .contains(&format!("BackingImageGet of img on {from}")),
        "{early:?}"
    );
    sb.backing_image_delete(v1::BackingImageRef { name: "img".into() })
        .await
        .unwrap();

    sa.backing_image_create(create("img", &sum, Source::FromFile(img.display().to_string())))
        .await
        .unwrap();
    let on_a = settled(&mut sa, "img").await;
    assert_eq!(on_a.state, "ready", "{on_a:?}");

    sb.backing_image_create(create("img", &sum, Source::FromLvstore(from.clone())))
        .await
        .unwrap();
    let on_b = settled(&mut sb, "img").await;
    assert_eq!(
        (on_b.state.as_str(), on_b.current_checksum.as_str(), on_b.size),
        ("ready", sum.as_str(), 8 * MIB),
        "{on_b:?}"
    );
    assert_ne!(on_b.disk_uuid, on_a.disk_uuid);
    assert_eq!(on_b.lvol, format!("bi-img-disk-{}", on_b.disk_uuid));
    // Holes stay holes: the copy holds the 4 MiB of data of the 8 MiB image.
    drop(sb);
    b.terminate(Duration::from_secs(10));
    assert_eq!(allocated(&db, &on_b.lvol), 4 * MIB);
    b.restart();
    let mut sb = service(&b).await;

    // A checksum that does not match what the source holds: failed, no lvol and no staging file left on B.
    let wrong = "0".repeat(128);
    sa.backing_image_create(create(
        "img-bad",
        &sum,
        Source::FromFile(img.display().to_string()),
    ))
    .await
    .unwrap();
    assert_eq!(settled(&mut sa, "img-bad").await.state, "ready");
    sb.backing_image_create(create("img-bad", &wrong, Source::FromLvstore(from.clone())))
        .await
        .unwrap();
    let bad = settled(&mut sb, "img-bad").await;
    assert!(
        bad.state == "failed" && bad.message.contains("checksum mismatch"),
        "{bad:?}"
    );
    assert!(
        staging_files(t.path()).is_empty(),
        "{:?}",
        staging_files(t.path())
    );

    // The copy on B came back ready from its xattrs after the restart.
    let i = sb
        .backing_image_get(v1::BackingImageRef { name: "img".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (i.state.as_str(), i.current_checksum.as_str()),
        ("ready", sum.as_str()),
        "{i:?}"
    );
    // Expose of a copy B does not have; unexpose of anything is fine.
    let st = sb
        .backing_image_expose(v1::BackingImageExposeRequest {
            name: "none".into(),
            to_address: "127.0.0.1:1".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::NotFound, "{st:?}");
    sb.backing_image_unexpose(v1::BackingImageRef { name: "img".into() })
        .await
        .unwrap();
    drop(sb);
    b.terminate(Duration::from_secs(10));
    let ls = lvols(&db);
    assert!(!ls.contains("img-bad") && !ls.contains("temp-head"), "{ls}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v2_sync_whose_source_is_killed_midway_leaves_no_lvol_and_a_retry_succeeds() {
    let t = tempfile::tempdir_in("/tmp").unwrap();
    let img = t.path().join("img.raw");
    // 16 MiB of data (every other MiB of 32), sent at 4 MiB/s: about 4 s to be seen in progress and killed.
    let data = image(&img, 32, 34);
    let sum = sha512_bytes(&data);
    let (da, db) = (disk(t.path(), "a.img"), disk(t.path(), "b.img"));
    let mut a = DaemonCommand::new(bin("corral-replica"))
        .label("corral-replica-lvstore-source")
        .args(["serve-lvstore", "--format", "--cluster-size", "64K"])
        .args(["--backing-image-send-rate", "4M", "--disk"])
        .arg(&da)
        .args(["--listen", "127.0.0.1:0"])
        .spawn();
    let mut b = lvstore_daemon(&db);
    let mut sa = service(&a).await;
    let mut sb = service(&b).await;
    sa.backing_image_create(create("img", &sum, Source::FromFile(img.display().to_string())))
        .await
        .unwrap();
    assert_eq!(settled(&mut sa, "img").await.state, "ready");

    let from = a.addr("control").to_string();
    sb.backing_image_create(create("img", &sum, Source::FromLvstore(from)))
        .await
        .unwrap();
    let midway = wait_for_async(
        "the sync on b in progress, partly received",
        Duration::from_secs(30),
        async || {
            let i = sb
                .backing_image_get(v1::BackingImageRef { name: "img".into() })
                .await
                .unwrap()
                .into_inner();
            assert_ne!(
                i.state, "ready",
                "the sync ended before the source was killed: {i:?}"
            );
            (i.state == "in-progress" && i.progress > 0).then_some(i)
        },
    )
    .await;
    assert!(midway.progress < 90, "{midway:?}");
    drop(sa);
    a.kill();

    // B fails the copy, says where from, keeps serving, and holds no lvol of it.
    let failed = settled(&mut sb, "img").await;
    assert!(
        failed.state == "failed" && failed.message.contains("BackingImageExpose"),
        "{failed:?}"
    );
    let info = sb.lvstore_info(v1::LvstoreEmpty {}).await.unwrap().into_inner();
    assert_eq!(info.used_clusters, 0, "{info:?}");
    drop(sb);
    b.terminate(Duration::from_secs(10));
    let ls = lvols(&db);
    assert!(!ls.contains("bi-img"), "{ls}");
    b.restart();
    let mut sb = service(&b).await;
    let listed = sb
        .backing_image_list(v1::LvstoreEmpty {})
        .await
        .unwrap()
        .into_inner();
    assert!(listed.backing_images.is_empty(), "{listed:?}");

    // The source back (its copy found again from its xattrs): the retry makes B's copy.
    a.restart();
    let from = a.addr("control").to_string();
    sb.backing_image_create(create("img", &sum, Source::FromLvstore(from)))
        .await
        .unwrap();
    let on_b = settled(&mut sb, "img").await;
    assert_eq!(
        (on_b.state.as_str(), on_b.current_checksum.as_str(), on_b.size),
        ("ready", sum.as_str(), 32 * MIB),
        "{on_b:?}"
    );
    drop(sb);
    b.terminate(Duration::from_secs(10));
    assert_eq!(allocated(&db, &on_b.lvol), 16 * MIB);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_copy_whose_expose_call_was_dropped_midway_can_still_be_deleted() {
    let t = tempfile::tempdir_in("/tmp").unwrap();
    let img = t.path().join("img.raw");
    // 16 MiB of data sent at 4 MiB/s: the expose is in flight for seconds.
    let data = image(&img, 32, 35);
    let sum = sha512_bytes(&data);
    let db = disk(t.path(), "b.img");
    let da = disk(t.path(), "a.img");
    let a = DaemonCommand::new(bin("corral-replica"))
        .label("corral-replica-lvstore-source")
        .args(["serve-lvstore", "--format", "--cluster-size", "64K"])
        .args(["--backing-image-send-rate", "4M", "--disk"])
        .arg(&da)
        .args(["--listen", "127.0.0.1:0"])
        .spawn();
    let b = lvstore_daemon(&db);
    let mut sa = service(&a).await;
    let mut sb = service(&b).await;
    sa.backing_image_create(create("img", &sum, Source::FromFile(img.display().to_string())))
        .await
        .unwrap();
    assert_eq!(settled(&mut sa, "img").await.state, "ready");

    // B syncs from A; once it is seen receiving, B's copy is deleted: its job drops its BackingImageExpose call
    // to A while A is still sending.
    sb.backing_image_create(create(
        "img",
        &sum,
        Source::FromLvstore(a.addr("control").to_string()),
    ))
    .await
    .unwrap();
    wait_for_async("the sync on b in progress", Duration::from_secs(30), async || {
        let i = sb
            .backing_image_get(v1::BackingImageRef { name: "img".into() })
            .await
            .unwrap()
            .into_inner();
        assert_ne!(i.state, "ready", "the sync ended before it was cancelled: {i:?}");
        (i.state == "in-progress" && i.progress > 0).then_some(())
    })
    .await;
    sb.backing_image_delete(v1::BackingImageRef { name: "img".into() })
        .await
        .unwrap();

    // A's copy is no longer exposed once the call is gone: its deletion goes through (a count of exposures left
    // up by the dropped call refused it for good, "being sent to another disk").
    let mut last = String::new();
    let deleted = wait_for_async("A's copy deleted", Duration::from_secs(30), async || {
        match sa
            .backing_image_delete(v1::BackingImageRef { name: "img".into() })
            .await
        {
            Ok(_) => Some(()),
            Err(s) => {
                last = s.message().to_owned();
                None
            }
        }
    })
    .await;
    let () = deleted;
    let listed = sa
        .backing_image_list(v1::LvstoreEmpty {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        listed.backing_images.is_empty(),
        "{listed:?} (last refusal: {last})"
    );
}
