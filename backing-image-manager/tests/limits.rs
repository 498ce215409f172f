//! Limits and bad input: the receiver port range, the per-image send limit, names with path tricks, specs that
//! disagree with the files, and peers that are not what they claim.

mod common;

use common::*;
use std::time::Duration;

use corral_proto::v1;
use testkit::wait_for_async;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_limit_and_port_range_exhaustion_are_resource_exhausted_and_failed_syncs_release_ports() {
    let (disk_a, disk_b) = (Disk::new("disk-a"), Disk::new("disk-b"));
    let a = Bim::start(&disk_a, 2, &["--send-max-rate", "2M"]);
    // One receiver port only.
    let b = Bim::start(&disk_b, 1, &[]);
    let size = 2 * MIB;
    let busy_sum = place_and_fetch(&a, &disk_a, "busy", size, 5).await;
    let slow_sum = place_and_fetch(&a, &disk_a, "slow", 16 * MIB, 5).await;
    let other_sum = place_and_fetch(&a, &disk_a, "other", size, 5).await;

    // Three sends of "busy" to receivers that never answer hold its send slots.
    let holes: Vec<_> = (0..3).map(|_| black_hole()).collect();
    let mut stuck = Vec::new();
    for (_, addr) in &holes {
        let mut c = a.client().await;
        let req = v1::BimSendRequest {
            name: "busy".into(),
            uuid: "u1".into(),
            to_address: addr.clone(),
        };
        stuck.push(tokio::spawn(async move { c.send(req).await }));
    }
    wait_for_async("3 sends running", Duration::from_secs(10), async || {
        (a.get("busy").await.unwrap().status.unwrap().sending_reference == 3).then_some(())
    })
    .await;
    let err = a
        .client()
        .await
        .send(v1::BimSendRequest {
            name: "busy".into(),
            uuid: "u1".into(),
            to_address: holes[0].1.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");

    // Syncs of "busy" to B fail (the sender refuses), each after taking B's only port: a loop of them shows the
    // port comes back every time.
    for i in 0..15 {
        b.client()
            .await
            .sync(v1::BimSyncRequest {
                spec: spec("busy", "u1", size, &busy_sum),
                from_address: a.addr(),
            })
            .await
            .unwrap_or_else(|e| panic!("sync {i}: {e}"));
        let failed = b.wait_state("busy", "failed", 10).await;
        let msg = failed.status.unwrap().message;
        assert!(msg.contains("already feeds 3"), "{msg}");
    }
    assert_eq!(b.metric("corral_bim_receiver_ports_in_use").await, 0.0);
    assert!(disk_b.image_dirs().is_empty(), "{:?}", disk_b.image_dirs());

    // A slow sync holds the port: the next one is refused with RESOURCE_EXHAUSTED and registers nothing.
    b.client()
        .await
        .sync(v1::BimSyncRequest {
            spec: spec("slow", "u1", 16 * MIB, &slow_sum),
            from_address: a.addr(),
        })
        .await
        .unwrap();
    let err = b
        .client()
        .await
        .sync(v1::BimSyncRequest {
            spec: spec("other", "u1", size, &other_sum),
            from_address: a.addr(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
    assert!(err.message().contains("no free port"), "{err}");
    assert_eq!(b.get("other").await.unwrap_err().code(), tonic::Code::NotFound);
    b.wait_state("slow", "ready", 30).await;
    // Once it is done the port serves the next sync.
    b.client()
        .await
        .sync(v1::BimSyncRequest {
            spec: spec("other", "u1", size, &other_sum),
            from_address: a.addr(),
        })
        .await
        .unwrap();
    b.wait_state("other", "ready", 30).await;
    for t in stuck {
        t.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_errors_and_leaves_no_files() {
    let (disk_a, disk_b) = (Disk::new("disk-a"), Disk::new("disk-b"));
    let a = Bim::start(&disk_a, 2, &[]);
    let b = Bim::start(&disk_b, 2, &[]);
    let mut c = a.client().await;

    // Names and uuids with path tricks, malformed checksums.
    for (name, uuid, sum) in [
        ("../etc", "u1", ""),
        ("a/b", "u1", ""),
        ("img", "..", ""),
        ("", "u1", ""),
        ("img", "u1", "abc"),
    ] {
        let err = c
            .fetch(v1::BimFetchRequest {
                spec: spec(name, uuid, 0, sum),
                data_source_address: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            tonic::Code::InvalidArgument,
            "{name:?}/{uuid:?}: {err}"
        );
        if !sum.is_empty() {
            continue;
        }
        let err = c
            .delete(v1::BimImageRef {
                name: name.into(),
                uuid: uuid.into(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    }
    let err = c
        .fetch(v1::BimFetchRequest {
            spec: None,
            data_source_address: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    // Reuse with nothing on the disk.
    let err = c
        .fetch(v1::BimFetchRequest {
            spec: spec("img", "u1", 0, ""),
            data_source_address: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");

    // A data source file whose size disagrees with the spec: refused before anything is taken.
    let src = disk_a.path().join("tmp/img-u1");
    write_image(&src, 4 * MIB, 1);
    let ds = FakeDataSource::start(FakeDataSource::ready_info(&disk_a, "img", "u1")).await;
    let err = c
        .fetch(v1::BimFetchRequest {
            spec: spec("img", "u1", 8 * MIB, ""),
            data_source_address: ds.addr.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert!(
        err.message().contains("8388608") && err.message().contains("4194304"),
        "{err}"
    );
    assert_eq!(*ds.transfers.lock().unwrap(), 0);
    assert!(src.exists());

    // A data source pointing at a file outside this disk's tmp directory.
    let outside = disk_a.path().join("elsewhere");
    write_image(&outside, 4 * MIB, 1);
    let mut info = FakeDataSource::ready_info(&disk_a, "img", "u1");
    info["filePath"] = format!("{}/tmp/../elsewhere", disk_a.path().display()).into();
    let evil = FakeDataSource::start(info).await;
    let err = c
        .fetch(v1::BimFetchRequest {
            spec: spec("img", "u1", 4 * MIB, ""),
            data_source_address: evil.addr.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert!(outside.exists());

    // A data source on another disk, and one not finished.
    let mut info = FakeDataSource::ready_info(&disk_a, "img", "u1");
    info["diskUUID"] = "disk-b".into();
    let wrong_disk = FakeDataSource::start(info).await;
    let mut info = FakeDataSource::ready_info(&disk_a, "img", "u1");
    info["state"] = "in-progress".into();
    let unfinished = FakeDataSource::start(info).await;
    for (ds, code) in [
        (&wrong_disk, tonic::Code::InvalidArgument),
        (&unfinished, tonic::Code::FailedPrecondition),
    ] {
        let err = c
            .fetch(v1::BimFetchRequest {
                spec: spec("img", "u1", 4 * MIB, ""),
                data_source_address: ds.addr.clone(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), code, "{err}");
    }
    assert!(disk_a.image_dirs().is_empty(), "{:?}", disk_a.image_dirs());

    // Sync from things that are not a manager: a data source (HTTP, not gRPC), a closed port, a hanging listener.
    let (_hole, hole_addr) = black_hole();
    let refused = testkit::ports::RefusedAddr::new();
    for from in [ds.addr.clone(), refused.addr.to_string(), hole_addr] {
        let t = std::time::Instant::now();
        let err = b
            .client()
            .await
            .sync(v1::BimSyncRequest {
                spec: spec("img", "u1", 4 * MIB, ""),
                from_address: from.clone(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable, "{from}: {err}");
        assert!(err.message().contains(&from), "{err}");
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "{from}: took {:?}",
            t.elapsed()
        );
    }
    // A manager that does not hold the image.
    let err = b
        .client()
        .await
        .sync(v1::BimSyncRequest {
            spec: spec("img", "u1", 4 * MIB, ""),
            from_address: a.addr(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    assert!(disk_b.image_dirs().is_empty(), "{:?}", disk_b.image_dirs());
    assert_eq!(b.metric("corral_bim_receiver_ports_in_use").await, 0.0);

    // A size disagreeing with a file already on the disk: refused, the file left alone.
    let sum = place_and_fetch(&a, &disk_a, "kept", 2 * MIB, 5).await;
    let err = c
        .sync(v1::BimSyncRequest {
            spec: spec("kept", "u1", 3 * MIB, ""),
            from_address: b.addr(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    let err = c
        .fetch(v1::BimFetchRequest {
            spec: spec("kept", "u2", 2 * MIB, &sum),
            data_source_address: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists, "{err}");
    assert_eq!(sha512_hex(&disk_a.backing("kept", "u1")), sum);
    // Downloads of unknown names or names with tricks.
    for name in ["nothing", "..%2F..%2Fetc"] {
        let st = common::get(format!("{}/v1/files/{name}/download", a.http()))
            .await
            .unwrap()
            .status();
        assert!(st == 404 || st == 400, "{name}: {st}");
    }
}

/// A data source's file that shares its content with another file (a hard link made by a data source that went
/// wrong) is not taken: the manager would hash it, serve that other file over HTTP and remove it with the image.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_source_file_linked_to_another_file_is_not_taken() {
    let disk = Disk::new("disk-a");
    let bim = Bim::start(&disk, 1, &[]);
    let secret = disk.path().join("secret");
    write_image(&secret, MIB, 3);
    let src = disk.path().join("tmp/img-u1");
    std::fs::create_dir_all(src.parent().unwrap()).unwrap();
    std::fs::hard_link(&secret, &src).unwrap();
    let ds = FakeDataSource::start(FakeDataSource::ready_info(&disk, "img", "u1")).await;
    let err = bim
        .client()
        .await
        .fetch(v1::BimFetchRequest {
            spec: spec("img", "u1", 0, ""),
            data_source_address: ds.addr.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert!(err.message().contains("hard links"), "{err}");
    assert_eq!(*ds.transfers.lock().unwrap(), 0);
    assert!(disk.image_dirs().is_empty(), "{:?}", disk.image_dirs());
    let resp = common::get(format!("{}/v1/files/img/download", bim.http()))
        .await
        .unwrap();
    assert_eq!(resp.status(), reqwest::StatusCode::NOT_FOUND);
    assert!(secret.exists() && src.exists());
}

/// A download resumed with `If-Range` after the image behind the name was replaced (deleted, fetched again with
/// other content of the same size) gets the whole new file, not the new file's tail after the old file's head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_download_of_a_replaced_image_starts_over() {
    let disk = Disk::new("disk-a");
    let bim = Bim::start(&disk, 1, &[]);
    let url = format!("{}/v1/files/img/download", bim.http());
    let http = common::http();
    let old_sum = place_and_fetch(&bim, &disk, "img", 2 * MIB, 1).await;
    let first = http.get(&url).send().await.unwrap();
    let etag = first.headers()["etag"].clone();
    assert_eq!(etag, format!("\"{old_sum}\"").as_str());
    let resumed = http
        .get(&url)
        .header("Range", "bytes=4096-")
        .header("If-Range", etag.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resumed.status(), 206);

    bim.client()
        .await
        .delete(v1::BimImageRef {
            name: "img".into(),
            uuid: "u1".into(),
        })
        .await
        .unwrap();
    let new_sum = place_and_fetch(&bim, &disk, "img", 2 * MIB, 2).await;
    assert_ne!(new_sum, old_sum);
    let resumed = http
        .get(&url)
        .header("Range", "bytes=4096-")
        .header("If-Range", etag)
        .send()
        .await
        .unwrap();
    assert_eq!(resumed.status(), 200);
    assert_eq!(resumed.content_length(), Some(2 * MIB));
    assert_eq!(
        resumed.bytes().await.unwrap().as_ref(),
        std::fs::read(disk.backing("img", "u1")).unwrap().as_slice()
    );
}
