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

/// A replica SIGKILLed right after it answered the handshake of generation 2, before any write: restarted on the
/// same directory, it still refuses generation 1 (the record was durable before the answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_killed_after_accepting_a_generation_still_refuses_a_lower_one_after_restart() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("r");
    let mut r = Replica::start(&dir, &["--size", "16M"]);
    let c1 = connect(&r, 1).await.expect("generation 1 accepted");
    let c2 = connect(&r, 2).await.expect("generation 2 accepted");
    r.kill();
    drop((c1, c2));
    let r = Replica::start(&dir, &[]);
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
