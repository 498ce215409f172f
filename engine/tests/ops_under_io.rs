//! Operations that freeze IO (snapshot, expand, replica add with its rebuild) while fio writes 4 KiB at queue
//! depth 32 through NBD and verifies what it wrote: no IO fails, no acknowledged write is lost, and every replica
//! (the rebuilt one included) ends up holding what the volume reads.

mod common;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{DataEngine, Engine, Replica};
use corral_proto::v1;
use testkit::{qemu_io, wait_for_async};

const SIZE: u64 = 64 << 20;
const GROWN: u64 = 96 << 20;

/// One fio round: 4 KiB random writes at qd32 over the first 16 MiB, then fio reads every block back and checks
/// its crc32c and header (offset, seed: a block left from an older round fails). Returns fio's output.
fn fio_round(uri: &str, round: u64) -> (bool, String) {
    let out = Command::new("fio")
        .args([
            "--name=ops-under-io",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
            "--size=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
            &format!("--randseed={}", 1000 + round),
        ])
        .output()
        .expect("fio runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success() && text.contains("err= 0"), text)
}

async fn write_ops(e: &Engine) -> u64 {
    e.client()
        .await
        .metrics_get(v1::Empty {})
        .await
        .unwrap()
        .into_inner()
        .write_ops
}

// Against v1 replicas and v2 (lvstore) replicas: `NAME::v1`, `NAME::v2`.
on_both_engines!(snapshot_expand_and_rebuild_under_fio_randwrite_qd32_fail_no_io_and_lose_no_write);

async fn snapshot_expand_and_rebuild_under_fio_randwrite_qd32_fail_no_io_and_lose_no_write(
    engine: DataEngine,
) {
    let t = tempfile::tempdir().unwrap();
    let rs: Vec<Replica> = (0..2)
        .map(|i| Replica::start_on(engine, &t.path().join(format!("r{i}")), &[]))
        .collect();
    let addrs: Vec<String> = rs.iter().map(Replica::address).collect();
    let e = Engine::start(t.path(), "vol", SIZE, &addrs, &[]);
    // Data beyond fio's range, written before: the rebuild must bring it along.
    assert!(qemu_io(&e.unix_uri(), &["write -P 0x5c 40M 4M", "flush"]).0);

    // fio rounds back to back until the operations are done, then one more.
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let (uri, stop_f, rounds_f) = (e.unix_uri(), stop.clone(), rounds.clone());
    let load = std::thread::spawn(move || {
        let mut failures = Vec::new();
        let mut round = 0;
        loop {
            let last = stop_f.load(Ordering::Acquire);
            let (ok, text) = fio_round(&uri, round);
            if !ok {
                failures.push(text);
            }
            round += 1;
            rounds_f.store(round, Ordering::Release);
            if last {
                return failures;
            }
        }
    });
    let before = write_ops(&e).await;
    wait_for_async("fio to be writing", Duration::from_secs(30), async || {
        (write_ops(&e).await >= before + 512).then_some(())
    })
    .await;
    let ops_start = Instant::now();

    let out = e.cli(&["snapshot", "create", "under-io"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = e.cli(&["expand", "--size", &GROWN.to_string()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let fresh = Replica::start_on(engine, &t.path().join("r-new"), &[]);
    let out = e.cli(&["replica", "add", &fresh.address()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ops_took = ops_start.elapsed();
    let ops_done_in_round = rounds.load(Ordering::Acquire);
    // The operations ran while fio kept writing: at least one round is still to finish after them.
    assert!(!load.is_finished(), "fio stopped before the operations ended");
    let writes_during = write_ops(&e).await;
    stop.store(true, Ordering::Release);
    let failures = tokio::task::spawn_blocking(move || load.join().unwrap())
        .await
        .unwrap();
    assert!(failures.is_empty(), "fio failed or found bad data: {failures:?}");
    eprintln!(
        "operations took {ops_took:?} during fio round {ops_done_in_round}; {} rounds, {} volume writes by then",
        rounds.load(Ordering::Acquire),
        writes_during - before
    );

    let modes = e.modes().await;
    assert_eq!(modes.len(), 3, "{modes:?}");
    assert!(modes.iter().all(|(_, m)| m == "RW"), "{modes:?}");
    let vol = e
        .client()
        .await
        .volume_get(v1::Empty {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(vol.size, GROWN);
    // The grown range takes IO.
    assert!(
        qemu_io(
            &e.unix_uri(),
            &["write -P 0x7e 80M 1M", "read -P 0x7e 80M 1M", "flush"]
        )
        .0
    );

    // Every replica, the rebuilt one too, holds the same snapshot and the same data as the volume reads.
    let exported = t.path().join("export.raw");
    assert!(
        Command::new("qemu-img")
            .args(["convert", "-O", "raw", &e.unix_uri()])
            .arg(&exported)
            .status()
            .unwrap()
            .success()
    );
    let via_nbd = std::fs::read(&exported).unwrap();
    assert_eq!(via_nbd.len() as u64, GROWN);
    assert!(via_nbd[40 << 20..44 << 20].iter().all(|&b| b == 0x5c));
    for r in [&rs[0], &rs[1], &fresh] {
        assert!(
            r.status()
                .await
                .disks
                .values()
                .any(|d| d.name.contains("under-io")),
            "snapshot missing on {}",
            r.address()
        );
        assert!(
            r.flattened(GROWN).await == via_nbd,
            "replica {} differs from the volume",
            r.address()
        );
    }
}
