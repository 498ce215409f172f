//! Seed 003 test plan: revision counter disabled, three replicas, a write load with flushes, SIGKILL the engine
//! mid-write, restart with `--salvage-requested`: the volume serves again and every write acknowledged before the
//! last acknowledged flush is intact. Repeated ten times; between rounds the replicas salvage did not pick are
//! rebuilt from the chosen one, so every round starts with three RW replicas. Parameterised over the data engine
//! (`::v1`, `::v2`: a v2 replica's salvage fields, last-modified time and allocated bytes, live in its head lvol's
//! xattrs, and its rebuild transfers snapshot lvols, then the head).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{DataEngine, Engine, Replica};
use testkit::qemu_io;

const SIZE: u64 = 64 << 20;
const ROUNDS: u64 = 10;
const BLOCK: u64 = 64 << 10;

on_both_engines!(salvage_after_engine_sigkill_keeps_every_flushed_write_ten_times);

async fn salvage_after_engine_sigkill_keeps_every_flushed_write_ten_times(engine: DataEngine) {
    let t = tempfile::tempdir().unwrap();
    let rs: Vec<Replica> = (0..3)
        .map(|i| {
            Replica::start_on(
                engine,
                &t.path().join(format!("r{i}")),
                &["--disable-revision-counter"],
            )
        })
        .collect();
    let addrs: Vec<String> = rs.iter().map(Replica::address).collect();
    let mut durable: Vec<(u64, u8)> = Vec::new();
    let mut seed = 0x2545_F491_u64;
    for round in 0..ROUNDS {
        let extra: &[&str] = if round == 0 {
            &["--disable-revision-counter"]
        } else {
            &["--disable-revision-counter", "--salvage-requested"]
        };
        let mut e = Engine::start(t.path(), "vol", SIZE, &addrs, extra);
        if round > 0 {
            // Salvage kept one replica: the volume serves, with every flushed write.
            for &(off, p) in &durable {
                let (ok, out) = qemu_io(&e.unix_uri(), &[&format!("read -P 0x{p:02x} {off} {BLOCK}")]);
                assert!(ok, "round {round}: flushed write at {off} lost: {out}");
            }
            // Bring the others back: remove and rebuild them from the salvaged one.
            for (a, m) in e.modes().await {
                if m == "ERR" {
                    assert!(e.cli(&["replica", "rm", &a]).status.success());
                    let out = e.cli(&["replica", "add", &a]);
                    assert!(
                        out.status.success(),
                        "round {round}: rebuild of {a}: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
            }
            let modes = e.modes().await;
            assert!(
                modes.len() == 3 && modes.iter().all(|(_, m)| m == "RW"),
                "round {round}: {modes:?}"
            );
        }
        // Writer: distinct 64 KiB blocks, each write followed by a flush; a pair that succeeded is durable.
        let acked = Arc::new(Mutex::new(Vec::new()));
        let (uri, acked_w) = (e.unix_uri(), acked.clone());
        let writer = std::thread::spawn(move || {
            for i in 0..64u64 {
                let off = (round * 64 + i) * BLOCK % SIZE;
                let p = u8::try_from((round * 64 + i) % 250 + 1).unwrap();
                let (ok, _) = qemu_io(&uri, &[&format!("write -P 0x{p:02x} {off} {BLOCK}"), "flush"]);
                if !ok {
                    return;
                }
                acked_w.lock().unwrap().push((off, p));
            }
        });
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        // Round 0 must get at least one flush through on a slow machine; later rounds may be killed at once.
        let floor = if round == 0 { 800 } else { 100 };
        std::thread::sleep(Duration::from_millis(floor + seed % 400));
        e.kill();
        writer.join().unwrap();
        let new = acked.lock().unwrap().clone();
        assert!(
            !new.is_empty() || round > 0,
            "the writer never got a flush through"
        );
        durable.extend(new);
    }
    let e = Engine::start(
        t.path(),
        "vol",
        SIZE,
        &addrs,
        &["--disable-revision-counter", "--salvage-requested"],
    );
    for &(off, p) in &durable {
        let (ok, out) = qemu_io(&e.unix_uri(), &[&format!("read -P 0x{p:02x} {off} {BLOCK}")]);
        assert!(ok, "final: flushed write at {off} lost: {out}");
    }
    eprintln!("{ROUNDS} engine kills, {} flushed writes verified", durable.len());
}
