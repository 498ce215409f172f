//! Issue 39: fencing a stale engine by its generation. Real `corral-replica` and `corral-engine` daemons, qemu-io
//! as the NBD client: an engine started with a lower `--generation` than one a replica has since accepted gets IO
//! errors, never a silent success, and the newer engine reads only its own data. The replica's record survives a
//! SIGKILL, and bad records or engines without a generation are refused with a message naming both numbers.

mod common;

use std::time::Duration;

use common::{DataEngine, Engine, Replica};
use corral_proto::v1;
use data_protocol::{ClientConfig, ClientError, DataClient};
use testkit::{qemu_io, wait_for_async};

const SIZE: u64 = 16 << 20;

/// A data-protocol client of `generation` to `r` over TCP, as an engine's.
async fn connect(r: &Replica, generation: u64) -> Result<DataClient, ClientError> {
    let cfg = ClientConfig {
        generation,
        connections: 1,
        ..ClientConfig::default()
    };
    DataClient::connect(&r.replica_address().data.to_socket_string(), cfg).await
}

fn engine_in(t: &std::path::Path, name: &str, addrs: &[String], generation: u64) -> Engine {
    let dir = t.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    Engine::start(
        &dir,
        "vol",
        SIZE,
        addrs,
        &["--generation", &generation.to_string()],
    )
}

on_both_engines!(stale_engine_write_after_a_newer_engine_took_over_fails_and_the_newer_reads_its_own_data);

async fn stale_engine_write_after_a_newer_engine_took_over_fails_and_the_newer_reads_its_own_data(
    engine: DataEngine,
) {
    let t = tempfile::tempdir().unwrap();
    let r = Replica::start_on(engine, &t.path().join("r"), &[]);
    let addrs = [r.address()];
    let e1 = engine_in(t.path(), "e1", &addrs, 1);
    let (ok, out) = qemu_io(&e1.unix_uri(), &["write -P 0x11 0 64k", "flush"]);
    assert!(ok, "e1 write 0x11: {out}");

    let e2 = engine_in(t.path(), "e2", &addrs, 2);
    let (ok, out) = qemu_io(&e2.unix_uri(), &["write -P 0x22 0 64k", "flush"]);
    assert!(ok, "e2 write 0x22: {out}");

    // The stale engine's write reaches its NBD client as an error, never as a success.
    let (ok, out) = qemu_io(&e1.unix_uri(), &["write -P 0x33 0 64k", "flush"]);
    assert!(!ok, "the stale engine's write was acknowledged: {out}");

    let (ok, out) = qemu_io(&e2.unix_uri(), &["read -P 0x22 0 64k"]);
    assert!(ok, "e2 does not read its own 0x22: {out}");

    // e1 knows it is fenced: status and metrics say so.
    let status = e1
        .client()
        .await
        .volume_get(v1::Empty {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        status.fenced.starts_with("fenced by generation 2 > 1"),
        "e1 status: {status:?}"
    );
    let status = e2
        .client()
        .await
        .volume_get(v1::Empty {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.fenced, "", "e2 is not fenced");
}

on_both_engines!(replica_killed_after_accepting_a_generation_still_refuses_a_lower_one_after_restart);

/// A replica SIGKILLed right after it answered the handshake of generation 2, before any write (v1: `corral-replica
/// serve`; v2: the whole `serve-lvstore` daemon): restarted on the same directory or lvstore, it still refuses
/// generation 1 (the record was durable before the answer).
async fn replica_killed_after_accepting_a_generation_still_refuses_a_lower_one_after_restart(
    engine: DataEngine,
) {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("r");
    let mut r = Replica::start_on(engine, &dir, &["--size", "16M"]);
    let c1 = connect(&r, 1).await.expect("generation 1 accepted");
    let c2 = connect(&r, 2).await.expect("generation 2 accepted");
    r.kill();
    drop((c1, c2));
    let r = Replica::start_on(engine, &dir, &[]);
    match connect(&r, 1).await {
        Err(ClientError::Fenced {
            replica: 2,
            generation: 1,
            message,
        }) => assert!(message.contains("2 > 1"), "{message}"),
        other => panic!("generation 1 after the restart: {other:?}"),
    }
    connect(&r, 2).await.expect("generation 2 still accepted");
}

/// Bad input: a lower generation, none (an old engine), one from the future written by hand into the record, and a
/// corrupt record; each refused with a clear error, and the replica serves its current engine meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_refuses_lower_missing_and_unreadable_generations_with_clear_errors() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("r");
    let mut r = Replica::start(&dir, &["--size", "16M"]);
    // A replica that has never seen a generation takes an engine without one (generation 0).
    connect(&r, 0).await.expect("no generation on a fresh replica");
    let current = connect(&r, 5).await.expect("generation 5 accepted");
    match connect(&r, 4).await {
        Err(ClientError::Fenced {
            replica: 5,
            generation: 4,
            message,
        }) => {
            assert!(message.contains("fenced by generation 5 > 4"), "{message}");
        }
        other => panic!("generation 4 after 5: {other:?}"),
    }
    match connect(&r, 0).await {
        Err(ClientError::Fenced {
            replica: 5,
            generation: 0,
            message,
        }) => {
            assert!(message.contains("upgrade the engine"), "{message}");
        }
        other => panic!("no generation after 5: {other:?}"),
    }
    // The current engine keeps being served.
    current
        .write(0, &[0xab; 4096])
        .await
        .expect("generation 5 still writes");
    drop(current);
    r.kill();

    // A generation from the future written by hand: honoured as the highest accepted.
    std::fs::write(dir.join("engine.generation"), br#"{"generation":100}"#).unwrap();
    let mut r = Replica::start(&dir, &[]);
    match connect(&r, 6).await {
        Err(ClientError::Fenced {
            replica: 100,
            generation: 6,
            ..
        }) => {}
        other => panic!("generation 6 under a record of 100: {other:?}"),
    }
    r.kill();

    // A corrupt record: every connection refused, naming the record, and nothing written.
    std::fs::write(dir.join("engine.generation"), b"{\"generation\":").unwrap();
    let r = Replica::start(&dir, &[]);
    for g in [0, 7, 1000] {
        match connect(&r, g).await {
            Err(ClientError::Remote { message, .. }) => {
                assert!(
                    message.contains("engine generation record is unreadable"),
                    "{message}"
                );
                assert!(message.contains("engine.generation"), "{message}");
            }
            other => panic!("generation {g} under a corrupt record: {other:?}"),
        }
    }
    assert_eq!(
        std::fs::read(dir.join("engine.generation")).unwrap(),
        b"{\"generation\":",
        "the corrupt record was rewritten"
    );
    // Repaired by hand (docs/formats.md), the replica serves again.
    std::fs::write(dir.join("engine.generation"), br#"{"generation":100}"#).unwrap();
    let c = wait_for_async(
        "the repaired record to be read",
        Duration::from_secs(10),
        async || connect(&r, 101).await.ok(),
    )
    .await;
    c.write(0, &[0xcd; 4096]).await.expect("generation 101 writes");
}

/// `msg` as a gRPC request of an engine of `generation` (the metadata every engine call to a replica carries).
fn of_generation<T>(msg: T, generation: u64) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.metadata_mut().insert(
        corral_proto::engine_generation::METADATA_KEY,
        tonic::metadata::MetadataValue::from(generation),
    );
    req
}

/// The refusal of a call by a replica that accepted generation 2: FAILED_PRECONDITION whose message holds every
/// one of `says` (a stale engine's: both numbers; a call without a generation: 2 and "upgrade").
fn assert_refused<T: std::fmt::Debug>(
    what: &str,
    says: &[&str],
    res: Result<tonic::Response<T>, tonic::Status>,
) {
    match res {
        Err(s) => {
            assert_eq!(s.code(), tonic::Code::FailedPrecondition, "{what}: {s:?}");
            assert!(
                says.iter().all(|w| s.message().contains(w)),
                "{what}: {}",
                s.message()
            );
        }
        Ok(r) => panic!("{what} accepted after generation 2: {r:?}"),
    }
}

/// A stale engine's call (generation 1) refused naming both numbers.
fn assert_fenced<T: std::fmt::Debug>(what: &str, res: Result<tonic::Response<T>, tonic::Status>) {
    assert_refused(what, &["fenced by generation 2 > 1"], res);
}

on_both_engines!(mutating_grpc_calls_of_a_stale_engine_are_refused_naming_both_numbers_and_change_nothing);

/// Issue 39, the gRPC side: once a replica accepted generation 2, the calls of generation 1 that change the chain
/// or the data (snapshot, revert, expand, snapshot removal, purge, rebuild, clone, backup restore) are refused with
/// both numbers, and the replica's chain, size and files stay as they were; generation 2's calls go through.
async fn mutating_grpc_calls_of_a_stale_engine_are_refused_naming_both_numbers_and_change_nothing(
    engine: DataEngine,
) {
    let t = tempfile::tempdir().unwrap();
    let r = Replica::start_on(engine, &t.path().join("r"), &["--size", "16M"]);
    let mut ctl = r.control().await;
    let snapshot = |name: &str| v1::ReplicaSnapshotRequest {
        name: name.to_owned(),
        user_created: true,
        ..Default::default()
    };
    ctl.replica_snapshot(of_generation(snapshot("s1"), 1))
        .await
        .expect("generation 1 takes a snapshot while it is the newest");
    let c2 = connect(&r, 2).await.expect("generation 2 accepted");
    c2.write(0, &[0x22; 4096]).await.expect("generation 2 writes");
    let before = r.status().await;
    let layout = r.layout().await;

    assert_fenced(
        "snapshot",
        ctl.replica_snapshot(of_generation(snapshot("s2"), 1)).await,
    );
    assert_fenced(
        "revert",
        ctl.replica_revert(of_generation(
            v1::ReplicaRevertRequest {
                name: "s1".into(),
                ..Default::default()
            },
            1,
        ))
        .await,
    );
    assert_fenced(
        "expand",
        ctl.replica_expand(of_generation(v1::ReplicaExpandRequest { size: 32 << 20 }, 1))
            .await,
    );
    assert_fenced(
        "snapshot removal",
        ctl.disk_mark_as_removed(of_generation(v1::DiskRequest { name: "s1".into() }, 1))
            .await,
    );
    let mut sync = r.sync_agent().await;
    assert_fenced("purge", sync.snapshot_purge(of_generation(v1::Empty {}, 1)).await);
    assert_fenced(
        "rebuild",
        sync.files_sync(of_generation(
            v1::FilesSyncRequest {
                from_addresses: vec![r.address()],
                ..Default::default()
            },
            1,
        ))
        .await,
    );
    assert_fenced(
        "clone",
        sync.snapshot_clone(of_generation(
            v1::SnapshotCloneRequest {
                from_address: r.address(),
                snapshot_file_name: "s1".into(),
                ..Default::default()
            },
            1,
        ))
        .await,
    );
    assert_fenced(
        "backup restore",
        r.backup_service()
            .await
            .backup_restore(of_generation(v1::BackupRestoreRequest::default(), 1))
            .await,
    );

    let after = r.status().await;
    assert_eq!(after.chain, before.chain, "the chain changed under refused calls");
    assert_eq!(after.size, before.size);
    let files = |r: &v1::Replica| r.disks.keys().cloned().collect::<std::collections::BTreeSet<_>>();
    assert_eq!(
        files(&after),
        files(&before),
        "the snapshots changed under refused calls"
    );
    assert_eq!(
        r.layout().await,
        layout,
        "the replica's files changed under refused calls"
    );
    let mut read = [0u8; 4096];
    c2.read(0, &mut read).await.expect("generation 2 reads");
    assert!(
        read.iter().all(|b| *b == 0x22),
        "generation 2's data is not read back"
    );

    ctl.replica_snapshot(of_generation(snapshot("s2"), 2))
        .await
        .expect("generation 2 takes a snapshot");
}

/// A call without a generation refused naming 2 and saying to upgrade.
fn assert_needs_generation<T: std::fmt::Debug>(what: &str, res: Result<tonic::Response<T>, tonic::Status>) {
    assert_refused(what, &["accepted engine generation 2", "upgrade"], res);
}

on_both_engines!(calls_that_change_a_replica_without_a_generation_are_refused_once_one_was_accepted);

/// Issue 39, bad input "a connection without a generation (an old engine binary or tool)", on gRPC: a fresh replica
/// takes a snapshot from a caller without one; once it accepted generation 2, a snapshot, an expand, a purge and a
/// backup restore without one are refused (naming 2, saying to upgrade) and change nothing, while reads (ReplicaGet,
/// the purge status) still pass. The debugging CLI is refused without `--generation` and served with it; the
/// engine's own `backup end-chain` (a tool calling the replicas directly) presents the engine's generation.
async fn calls_that_change_a_replica_without_a_generation_are_refused_once_one_was_accepted(
    engine: DataEngine,
) {
    let t = tempfile::tempdir().unwrap();
    let r = Replica::start_on(engine, &t.path().join("r"), &["--size", "16M"]);
    let mut ctl = r.control().await;
    let snapshot = |name: &str| v1::ReplicaSnapshotRequest {
        name: name.to_owned(),
        user_created: true,
        ..Default::default()
    };
    ctl.replica_snapshot(snapshot("s1"))
        .await
        .expect("a fresh replica takes a snapshot without a generation");
    let c2 = connect(&r, 2).await.expect("generation 2 accepted");
    c2.write(0, &[0x22; 4096]).await.expect("generation 2 writes");
    let before = r.status().await;
    let layout = r.layout().await;

    assert_needs_generation("snapshot", ctl.replica_snapshot(snapshot("s2")).await);
    assert_needs_generation(
        "expand",
        ctl.replica_expand(v1::ReplicaExpandRequest { size: 32 << 20 })
            .await,
    );
    let mut sync = r.sync_agent().await;
    assert_needs_generation("purge", sync.snapshot_purge(v1::Empty {}).await);
    assert_needs_generation(
        "backup restore",
        r.backup_service()
            .await
            .backup_restore(v1::BackupRestoreRequest::default())
            .await,
    );
    ctl.replica_get(v1::Empty {})
        .await
        .expect("a read without a generation passes");
    sync.snapshot_purge_status(v1::Empty {})
        .await
        .expect("a status call without a generation passes");
    let after = r.status().await;
    assert_eq!(after.chain, before.chain, "the chain changed under refused calls");
    assert_eq!(after.size, before.size, "the size changed under a refused expand");
    assert_eq!(
        r.layout().await,
        layout,
        "the replica's files changed under refused calls"
    );
    let mut read = [0u8; 4096];
    c2.read(0, &mut read).await.expect("generation 2 reads");
    assert!(
        read.iter().all(|b| *b == 0x22),
        "generation 2's data is not read back"
    );

    // The debugging CLI: refused without --generation, with the message; served with the volume's generation.
    let cli = |extra: &[&str]| {
        std::process::Command::new(common::bin("corral-replica"))
            .args(["snapshot", "create", "--url", &r.address()])
            .args(extra)
            .arg("s3")
            .output()
            .unwrap()
    };
    let out = cli(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("accepted engine generation 2") && err.contains("upgrade"),
        "corral-replica snapshot create without --generation: {out:?}"
    );
    let out = cli(&["--generation", "2"]);
    assert!(
        out.status.success(),
        "corral-replica snapshot create --generation 2: {out:?}"
    );
    let has_s3 = |r: &v1::Replica| r.disks.keys().any(|k| k.contains("s3"));
    assert!(has_s3(&r.status().await), "the CLI's snapshot s3 is missing");
    drop(c2);

    // A tool of the engine's that calls the replicas directly presents the engine's generation.
    let e2 = engine_in(t.path(), "e2", &[r.address()], 2);
    let out = e2.cli(&["backup", "end-chain", "--reason", "fencing-test"]);
    assert!(
        out.status.success(),
        "corral-engine backup end-chain of generation 2: {out:?}"
    );
}

on_both_engines!(a_fresh_replica_accepts_calls_without_a_generation);

/// A replica that never accepted a generation (record 0: a volume only ever served by engines without one) serves
/// every call without one, as before fencing.
async fn a_fresh_replica_accepts_calls_without_a_generation(engine: DataEngine) {
    let t = tempfile::tempdir().unwrap();
    let r = Replica::start_on(engine, &t.path().join("r"), &["--size", "16M"]);
    let c0 = connect(&r, 0)
        .await
        .expect("a data connection without a generation");
    c0.write(0, &[0x11; 4096])
        .await
        .expect("write without a generation");
    let mut ctl = r.control().await;
    ctl.replica_snapshot(v1::ReplicaSnapshotRequest {
        name: "s1".into(),
        user_created: true,
        ..Default::default()
    })
    .await
    .expect("snapshot without a generation on a fresh replica");
    ctl.replica_expand(v1::ReplicaExpandRequest { size: 32 << 20 })
        .await
        .expect("expand without a generation on a fresh replica");
    assert_eq!(r.status().await.size, 32 << 20);
}

on_both_engines!(a_rebuild_asked_by_a_stale_engine_is_refused_by_its_source);

/// Issue 39, rebuild pulls: the generation a `FilesSync` carries goes on to its sources. A fresh replica (no record
/// of its own to refuse with) asked by an engine of generation 1 to rebuild from a source that accepted generation 2:
/// the source refuses every pull, the rebuild fails naming both numbers and the fresh replica received nothing; the
/// same rebuild for generation 2 copies the snapshot.
async fn a_rebuild_asked_by_a_stale_engine_is_refused_by_its_source(engine: DataEngine) {
    let t = tempfile::tempdir().unwrap();
    let src = Replica::start_on(engine, &t.path().join("src"), &["--size", "16M"]);
    let dst = Replica::start_on(engine, &t.path().join("dst"), &["--size", "16M"]);
    let c2 = connect(&src, 2)
        .await
        .expect("generation 2 accepted by the source");
    c2.write(0, &[0x22; 4096]).await.expect("generation 2 writes");
    c2.flush().await.expect("generation 2 flushes");
    src.control()
        .await
        .replica_snapshot(of_generation(
            v1::ReplicaSnapshotRequest {
                name: "s1".into(),
                user_created: true,
                ..Default::default()
            },
            2,
        ))
        .await
        .expect("the source takes a snapshot for generation 2");
    // The target gets the snapshot too, as an engine's rebuild snapshot reaches its WO replica.
    dst.control()
        .await
        .replica_snapshot(of_generation(
            v1::ReplicaSnapshotRequest {
                name: "s1".into(),
                ..Default::default()
            },
            2,
        ))
        .await
        .expect("the target takes the snapshot");
    let status = src.status().await;
    let files: Vec<v1::DiskInfo> = status
        .disks
        .values()
        .filter(|d| d.name != status.head)
        .cloned()
        .collect();
    assert_eq!(files.len(), 1, "one snapshot on the source: {status:?}");
    let rebuild = |generation| {
        of_generation(
            v1::FilesSyncRequest {
                from_addresses: vec![src.address()],
                files: files.clone(),
                ..Default::default()
            },
            generation,
        )
    };
    let mut sync = dst.sync_agent().await;
    let (layout, disks) = (dst.layout().await, dst.status().await.disks);

    sync.files_sync(rebuild(1))
        .await
        .expect("the fresh replica has no record to refuse generation 1 with");
    let s = rebuild_ended(&dst).await;
    assert_eq!(s.state, "error", "{s:?}");
    assert!(s.error.contains("fenced by generation 2 > 1"), "{s:?}");
    assert_eq!(
        dst.layout().await,
        layout,
        "the refused rebuild left files behind"
    );
    assert_eq!(
        dst.status().await.disks,
        disks,
        "the refused rebuild changed the chain"
    );

    sync.files_sync(rebuild(2))
        .await
        .expect("generation 2's rebuild starts");
    let s = rebuild_ended(&dst).await;
    assert_eq!(s.state, "complete", "{s:?}");
}

/// The status of the rebuild into `r` once it is no longer running.
async fn rebuild_ended(r: &Replica) -> v1::JobStatusResponse {
    let mut sync = r.sync_agent().await;
    wait_for_async("the rebuild ended", Duration::from_secs(60), async || {
        let s = sync
            .replica_rebuild_status(v1::Empty {})
            .await
            .unwrap()
            .into_inner();
        (!s.is_running).then_some(s)
    })
    .await
}

/// Sets xattr `key` of lvol `name` on the stopped lvstore of the v2 test replica in `dir` (`corral-lvstore
/// set-xattr`, as an operator would).
fn lvstore_set_xattr(dir: &std::path::Path, name: &str, key: &str, value: &str) {
    let out = std::process::Command::new(common::bin("corral-lvstore"))
        .arg("set-xattr")
        .arg(dir.join("disk.img"))
        .args([name, key, value])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "corral-lvstore set-xattr {name} {key} {value}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

const V2_GENERATION_XATTR: &str = "corral.engine-generation";

/// Bad input on a v2 replica: a lower generation, none (an old engine), one from the future written by hand into
/// the head's xattr with `corral-lvstore`, and a corrupt xattr; each refused with a clear error, the current engine
/// served meanwhile, and the corrupt record left for the operator to repair.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v2_replica_refuses_lower_missing_and_unreadable_generations_with_clear_errors() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("r");
    let mut r = Replica::start_on(DataEngine::V2, &dir, &["--size", "16M"]);
    connect(&r, 0).await.expect("no generation on a fresh replica");
    let current = connect(&r, 5).await.expect("generation 5 accepted");
    match connect(&r, 4).await {
        Err(ClientError::Fenced {
            replica: 5,
            generation: 4,
            message,
        }) => assert!(message.contains("fenced by generation 5 > 4"), "{message}"),
        other => panic!("generation 4 after 5: {other:?}"),
    }
    match connect(&r, 0).await {
        Err(ClientError::Fenced {
            replica: 5,
            generation: 0,
            message,
        }) => assert!(message.contains("upgrade the engine"), "{message}"),
        other => panic!("no generation after 5: {other:?}"),
    }
    current
        .write(0, &[0xab; 4096])
        .await
        .expect("generation 5 still writes");
    current.flush().await.expect("generation 5 flushes");
    drop(current);
    r.kill();

    // A generation from the future written by hand: honoured as the highest accepted.
    lvstore_set_xattr(&dir, "r", V2_GENERATION_XATTR, "100");
    let mut r = Replica::start_on(DataEngine::V2, &dir, &[]);
    match connect(&r, 6).await {
        Err(ClientError::Fenced {
            replica: 100,
            generation: 6,
            ..
        }) => {}
        other => panic!("generation 6 under a record of 100: {other:?}"),
    }
    r.kill();

    // A corrupt record: every connection refused, naming the record; the data stays.
    lvstore_set_xattr(&dir, "r", V2_GENERATION_XATTR, "not a number");
    let mut r = Replica::start_on(DataEngine::V2, &dir, &[]);
    for g in [0, 7, 1000] {
        match connect(&r, g).await {
            Err(ClientError::Remote { message, .. }) => {
                assert!(
                    message.contains("engine generation record is unreadable"),
                    "{message}"
                );
                assert!(message.contains(V2_GENERATION_XATTR), "{message}");
            }
            other => panic!("generation {g} under a corrupt record: {other:?}"),
        }
    }
    r.kill();
    // Repaired by hand (docs/formats.md), the replica serves again, with the data written before.
    lvstore_set_xattr(&dir, "r", V2_GENERATION_XATTR, "100");
    let r = Replica::start_on(DataEngine::V2, &dir, &[]);
    let c = connect(&r, 101).await.expect("generation 101 after the repair");
    let mut read = [0u8; 4096];
    c.read(0, &mut read).await.expect("read after the repair");
    assert!(
        read.iter().all(|b| *b == 0xab),
        "the data written before the bad records is not read back"
    );
}
