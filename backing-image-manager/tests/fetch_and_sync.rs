//! End to end: a data source's file is taken over by BIM A (same inode), synced to BIM B on another disk (holes
//! kept), both ready with the same SHA-512; watchers see every change; downloads serve the verified bytes; a replica
//! on B's disk reads through B's copy as its backing file.

mod common;

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use common::*;
use corral_proto::v1;
use testkit::{DaemonCommand, wait_for_async};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_source_file_is_taken_over_by_rename_then_synced_to_another_disk() {
    let (disk_a, disk_b) = (Disk::new("disk-a"), Disk::new("disk-b"));
    let size = 8 * MIB;
    let src = disk_a.path().join("tmp/ubuntu-u1");
    write_image(&src, size, 7);
    let sum = sha512_hex(&src);
    let inode = std::fs::metadata(&src).unwrap().ino();
    let ds = FakeDataSource::start(FakeDataSource::ready_info(&disk_a, "ubuntu", "u1")).await;

    let a = Bim::start(&disk_a, 4, &[]);
    let b = Bim::start(&disk_b, 4, &[]);

    let img = a
        .client()
        .await
        .fetch(v1::BimFetchRequest {
            spec: spec("ubuntu", "u1", size, &sum),
            data_source_address: ds.addr.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        ["in-progress", "ready"].contains(&state(&img).as_str()),
        "{img:?}"
    );
    let ready_a = a.wait_state("ubuntu", "ready", 30).await;
    assert_eq!(*ds.transfers.lock().unwrap(), 1);
    let backing_a = disk_a.backing("ubuntu", "u1");
    assert!(!src.exists(), "the data source file was not moved");
    assert_eq!(
        std::fs::metadata(&backing_a).unwrap().ino(),
        inode,
        "fetch copied instead of renaming"
    );
    assert_eq!(ready_a.status.clone().unwrap().current_checksum, sum);
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(disk_a.image_dir("ubuntu", "u1").join("backing.cfg")).unwrap())
            .unwrap();
    assert_eq!(cfg["currentChecksum"], sum.as_str());
    assert_eq!(cfg["size"], size);

    // Watch B before the sync: every change arrives as its own event.
    let mut watch = b.client().await.watch(v1::Empty {}).await.unwrap().into_inner();
    let img = b
        .client()
        .await
        .sync(v1::BimSyncRequest {
            spec: spec("ubuntu", "u1", size, &sum),
            from_address: a.addr(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(img.status.unwrap().sender_address, a.addr());
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while seen.last().map(String::as_str) != Some("ready") {
        let ev = tokio::time::timeout_at(deadline, watch.message())
            .await
            .expect("watch events stopped before ready")
            .unwrap()
            .unwrap();
        let st = state(ev.image.as_ref().unwrap());
        assert_ne!(st, "failed", "{ev:?}\n{}", b.log_text());
        if seen.last() != Some(&st) {
            seen.push(st);
        }
    }
    assert_eq!(seen.first().map(String::as_str), Some("starting"), "{seen:?}");
    assert!(seen.contains(&"in-progress".to_owned()), "{seen:?}");

    let backing_b = disk_b.backing("ubuntu", "u1");
    assert_eq!(sha512_hex(&backing_b), sum);
    let ready_b = b.get("ubuntu").await.unwrap();
    assert_eq!(ready_b.status.clone().unwrap().current_checksum, sum);
    assert!(
        allocated(&backing_b) <= size / 2 + MIB,
        "holes were not kept: {} allocated of {size}",
        allocated(&backing_b)
    );
    assert_eq!(
        std::fs::read_dir(disk_b.image_dir("ubuntu", "u1"))
            .unwrap()
            .count(),
        2,
        "temp files left on B"
    );
    assert_eq!(b.metric("corral_bim_receiver_ports_in_use").await, 0.0);
    assert_eq!(
        a.get("ubuntu").await.unwrap().status.unwrap().sending_reference,
        0
    );

    // A second sync of a ready image reuses it: no transfer.
    let again = b
        .client()
        .await
        .sync(v1::BimSyncRequest {
            spec: spec("ubuntu", "u1", size, &sum),
            from_address: a.addr(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(state(&again), "ready");

    // Downloads: raw (whole and ranged, HEAD) and gzip, all the verified bytes.
    let http = common::http();
    let url = format!("{}/v1/files/ubuntu/download", a.http());
    let whole = http.get(&url).send().await.unwrap();
    assert_eq!(whole.status(), 200);
    assert_eq!(whole.content_length(), Some(size));
    assert_eq!(
        whole.bytes().await.unwrap().as_ref(),
        std::fs::read(&backing_a).unwrap().as_slice()
    );
    let part = http
        .get(&url)
        .header("Range", "bytes=4096-8191")
        .send()
        .await
        .unwrap();
    assert_eq!(part.status(), 206);
    assert_eq!(
        part.headers()["content-range"],
        format!("bytes 4096-8191/{size}").as_str()
    );
    assert_eq!(
        part.bytes().await.unwrap().as_ref(),
        &std::fs::read(&backing_a).unwrap()[4096..8192]
    );
    let head = http.head(&url).send().await.unwrap();
    assert_eq!(head.headers()["content-length"], size.to_string().as_str());
    let gz = http
        .get(format!("{url}?compress=gzip"))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let mut unzipped = Vec::new();
    flate2::read::GzDecoder::new(gz.as_ref())
        .read_to_end(&mut unzipped)
        .unwrap();
    assert_eq!(unzipped.len() as u64, size);
    assert!(
        gz.len() < unzipped.len() / 2,
        "gzip did not shrink a half-empty image"
    );
    let bad = http
        .get(&url)
        .header("Range", "bytes=99999999-")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 416);
    let pd = a
        .client()
        .await
        .prepare_download(v1::BimImageRef {
            name: "ubuntu".into(),
            uuid: "u1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(pd.url, url);
    assert_eq!(pd.src_file_path, backing_a.to_str().unwrap());

    // A replica on B's disk uses B's copy as its backing file and serves its data.
    let replica_dir = disk_b.path().join("replicas/vol-r1");
    std::fs::create_dir_all(&replica_dir).unwrap();
    let mut replica = tokio::task::block_in_place(|| {
        DaemonCommand::new(testkit::workspace_bin("corral-replica"))
            .args(["serve", "--dir"])
            .arg(&replica_dir)
            .args(["--listen", "127.0.0.1:0", "--size", &size.to_string()])
            .arg("--backing-file")
            .arg(&backing_b)
            .spawn()
    });
    let data =
        data_protocol::DataClient::connect(replica.addr("data"), data_protocol::ClientConfig::default())
            .await
            .unwrap();
    let mut buf = vec![0u8; usize::try_from(size).unwrap()];
    for (i, chunk) in buf.chunks_mut(usize::try_from(MIB).unwrap()).enumerate() {
        data.read(i as u64 * MIB, chunk).await.unwrap();
    }
    data.close().await;
    replica.kill();
    assert_eq!(
        buf,
        std::fs::read(&backing_b).unwrap(),
        "the replica did not serve the backing image's data"
    );

    // Delete removes the directory and tells watchers.
    b.client()
        .await
        .delete(v1::BimImageRef {
            name: "ubuntu".into(),
            uuid: "u1".into(),
        })
        .await
        .unwrap();
    assert!(!disk_b.image_dir("ubuntu", "u1").exists());
    let ev = loop {
        let ev = watch.message().await.unwrap().unwrap();
        if ev.deleted {
            break ev;
        }
    };
    assert_eq!(ev.image.unwrap().spec.unwrap().name, "ubuntu");
}

/// Serves `bytes` at `/image.raw` (GET and HEAD with Content-Length).
async fn image_server(bytes: Vec<u8>) -> (String, tokio::task::JoinHandle<()>) {
    let bytes = bytes::Bytes::from(bytes);
    let app = axum::Router::new().route(
        "/image.raw",
        axum::routing::get(move || async move { bytes.clone() }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/image.raw", l.local_addr().unwrap());
    let task = tokio::spawn(async move {
        axum::serve(l, app).await.unwrap();
    });
    (url, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_data_source_download_is_fetched_by_one_manager_and_synced_by_another() {
    let (disk_a, disk_b) = (Disk::new("disk-a"), Disk::new("disk-b"));
    let size = 6 * MIB;
    let scratch = tempfile::tempdir().unwrap();
    let original = scratch.path().join("image.raw");
    write_image(&original, size, 42);
    let sum = sha512_hex(&original);
    let (url, _server) = image_server(std::fs::read(&original).unwrap()).await;

    let ds = tokio::task::block_in_place(|| {
        DaemonCommand::new(testkit::workspace_bin("corral-datasource"))
            .args(["serve", "--listen", "127.0.0.1:0", "--disk-path"])
            .arg(disk_a.path())
            .args([
                "--disk-uuid",
                "disk-a",
                "--name",
                "cirros",
                "--uuid",
                "c1",
                "--source-type",
                "download",
            ])
            .args(["--param", &format!("url={url}"), "--expected-checksum", &sum])
            .spawn()
    });
    let ds_addr = ds.addr("http").to_owned();
    let info: serde_json::Value = wait_for_async(
        "data source ready-for-transfer",
        Duration::from_secs(60),
        async || {
            let v: serde_json::Value = common::get(format!("http://{ds_addr}/v1/file"))
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            assert_ne!(v["state"], "failed", "{v}");
            (v["state"] == "ready-for-transfer").then_some(v)
        },
    )
    .await;
    let ds_file = std::path::PathBuf::from(info["filePath"].as_str().unwrap());
    let inode = std::fs::metadata(&ds_file).unwrap().ino();

    let a = Bim::start(&disk_a, 2, &[]);
    let b = Bim::start(&disk_b, 2, &[]);
    let mut watch_a = a.client().await.watch(v1::Empty {}).await.unwrap().into_inner();
    a.client()
        .await
        .fetch(v1::BimFetchRequest {
            spec: spec("cirros", "c1", size, &sum),
            data_source_address: ds_addr.clone(),
        })
        .await
        .unwrap();
    a.wait_state("cirros", "ready", 30).await;
    let backing_a = disk_a.backing("cirros", "c1");
    assert_eq!(
        std::fs::metadata(&backing_a).unwrap().ino(),
        inode,
        "fetch copied the file"
    );
    assert!(!ds_file.exists());
    let after: serde_json::Value = common::get(format!("http://{ds_addr}/v1/file"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        after["state"], "ready",
        "the data source did not record the transfer: {after}"
    );
    let mut states = Vec::new();
    while states.last().map(String::as_str) != Some("ready") {
        let ev = watch_a.message().await.unwrap().unwrap();
        states.push(state(ev.image.as_ref().unwrap()));
    }
    assert_eq!(states.first().map(String::as_str), Some("starting"), "{states:?}");

    b.client()
        .await
        .sync(v1::BimSyncRequest {
            spec: spec("cirros", "c1", size, &sum),
            from_address: a.addr(),
        })
        .await
        .unwrap();
    let ready_b = b.wait_state("cirros", "ready", 30).await;
    assert_eq!(ready_b.status.unwrap().current_checksum, sum);
    assert_eq!(sha512_hex(&disk_b.backing("cirros", "c1")), sum);
    assert_eq!(sha512_hex(&backing_a), sum);
}
