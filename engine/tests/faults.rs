//! Replica failures injected on purpose (the replica's `fault-injection` feature), not left to timing luck: a
//! replica that errors, hangs, runs out of space or drops its connection.

mod common;

use std::process::Command;

use common::{Engine, Replica, bin};
use corral_proto::v1;
use testkit::qemu_io;

const SIZE: u64 = 64 << 20;

fn require_fault_injection() {
    let help = Command::new(bin("corral-replica"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&help.stdout).contains("--fault"),
        "corral-replica lacks fault injection: build it with `--features replica/fault-injection` (scripts/test.sh does)"
    );
}

async fn replica_list(e: &Engine) -> Vec<v1::ControllerReplica> {
    e.client()
        .await
        .replica_list(v1::Empty {})
        .await
        .unwrap()
        .into_inner()
        .replicas
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_writes_fail_goes_err_while_io_continues_on_the_others() {
    require_fault_injection();
    let t = tempfile::tempdir().unwrap();
    let good: Vec<Replica> = (0..2)
        .map(|i| Replica::start(&t.path().join(format!("g{i}")), &[]))
        .collect();
    let bad = Replica::start(&t.path().join("bad"), &["--fault", "write=error,after=3"]);
    let all = [good[0].address(), good[1].address(), bad.address()];
    let e = Engine::start(t.path(), "vol", SIZE, &all, &[]);
    for i in 0..10u64 {
        let (ok, out) = qemu_io(
            &e.unix_uri(),
            &[&format!("write -P 0x{:02x} {} 64k", i + 1, i << 20)],
        );
        assert!(ok, "write {i} failed although two replicas are healthy: {out}");
    }
    let list = replica_list(&e).await;
    let b = list.iter().find(|r| r.address == bad.address()).unwrap();
    assert_eq!(b.mode, "ERR");
    assert!(b.error.contains("injected fault"), "{}", b.error);
    assert!(list.iter().filter(|r| r.mode == "RW").count() == 2, "{list:?}");
    for i in 0..10u64 {
        assert!(
            qemu_io(
                &e.unix_uri(),
                &[&format!("read -P 0x{:02x} {} 64k", i + 1, i << 20)]
            )
            .0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_replica_times_out_to_err_and_the_write_completes_on_the_others() {
    require_fault_injection();
    let t = tempfile::tempdir().unwrap();
    let good = Replica::start(&t.path().join("good"), &[]);
    let hung = Replica::start(&t.path().join("hung"), &["--fault", "write=hang,after=2"]);
    let e = Engine::start(t.path(), "vol", SIZE, &[good.address(), hung.address()], &[]);
    let started = std::time::Instant::now();
    for i in 0..4u64 {
        let (ok, out) = qemu_io(&e.unix_uri(), &[&format!("write -P 0x5a {} 4k", i << 20)]);
        assert!(ok, "write {i}: {out}");
    }
    // The engine's replica timeout is 4 s (harness): the hang cost about that once, then the replica was out.
    let took = started.elapsed();
    assert!(took.as_secs() < 20, "writes took {took:?}");
    let list = replica_list(&e).await;
    let h = list.iter().find(|r| r.address == hung.address()).unwrap();
    assert_eq!(h.mode, "ERR", "{list:?}");
    assert!(qemu_io(&e.unix_uri(), &["read -P 0x5a 3M 4k"]).0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_out_of_space_gives_enospc_to_the_client_and_keeps_them_rw() {
    require_fault_injection();
    let t = tempfile::tempdir().unwrap();
    let rs: Vec<Replica> = (0..2)
        .map(|i| {
            Replica::start(
                &t.path().join(format!("r{i}")),
                &["--fault", "write=no-space,after=2"],
            )
        })
        .collect();
    let e = Engine::start(t.path(), "vol", SIZE, &[rs[0].address(), rs[1].address()], &[]);
    assert!(qemu_io(&e.unix_uri(), &["write -P 0x01 0 4k"]).0);
    let (ok, out) = qemu_io(&e.unix_uri(), &["write -P 0x02 1M 4k", "write -P 0x03 2M 4k"]);
    assert!(!ok && out.contains("No space left on device"), "{out}");
    let list = replica_list(&e).await;
    assert!(
        list.iter().all(|r| r.mode == "RW"),
        "a full disk must not fail every replica: {list:?}"
    );
    assert!(
        qemu_io(&e.unix_uri(), &["read -P 0x01 0 4k"]).0,
        "reads keep working"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_drops_its_connection_goes_err() {
    require_fault_injection();
    let t = tempfile::tempdir().unwrap();
    let good = Replica::start(&t.path().join("good"), &[]);
    let dropper = Replica::start(&t.path().join("drop"), &["--fault", "flush=drop"]);
    let e = Engine::start(t.path(), "vol", SIZE, &[good.address(), dropper.address()], &[]);
    let (ok, out) = qemu_io(
        &e.unix_uri(),
        &["write -P 0x33 0 64k", "flush", "read -P 0x33 0 64k"],
    );
    assert!(ok, "{out}");
    let list = replica_list(&e).await;
    let d = list.iter().find(|r| r.address == dropper.address()).unwrap();
    assert_eq!(d.mode, "ERR", "{list:?}");
}

/// A replica that stops reading (SIGSTOP: a peer behind a partition behaves alike) while writes are queued to it:
/// the engine's socket to it fills, the IO timeout puts it in ERR and the writes complete on the other replica.
/// Removing it then returns at once: closing the connection does not wait for a socket that can never drain (it
/// waited for the kernel's TCP timeout, ~60 s and more, and forever on a unix socket).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_stopped_reading_with_a_full_socket_is_removed_at_once() {
    let t = tempfile::tempdir().unwrap();
    let good = Replica::start(&t.path().join("good"), &[]);
    let stopped = Replica::start(&t.path().join("stopped"), &[]);
    let e = Engine::start(t.path(), "vol", SIZE, &[good.address(), stopped.address()], &[]);
    stopped.signal("-STOP");
    // 32 MiB in 1 MiB writes: far more than the socket buffers hold, so the engine's writer blocks in a send.
    let (ok, out) = qemu_io(&e.unix_uri(), &["write -P 0x44 0 32M"]);
    assert!(ok, "the writes complete on the good replica: {out}");
    let list = replica_list(&e).await;
    let s = list.iter().find(|r| r.address == stopped.address()).unwrap();
    assert_eq!(s.mode, "ERR", "{list:?}");
    let mut client = e.client().await;
    let remove = client.replica_remove(v1::ReplicaAddress {
        address: stopped.address(),
    });
    let r = tokio::time::timeout(std::time::Duration::from_secs(15), remove).await;
    stopped.signal("-CONT");
    let r = r.expect("ReplicaRemove of a replica that stopped reading returns within 15 s");
    r.unwrap();
    let list = replica_list(&e).await;
    assert_eq!(list.len(), 1, "{list:?}");
    assert!(qemu_io(&e.unix_uri(), &["read -P 0x44 0 32M"]).0);
}
