//! Seed 003 test plan: revision counter disabled, three replicas, a write load with flushes, SIGKILL the engine
//! mid-write, restart with `--salvage-requested`: the volume serves again and every write acknowledged before the
//! last acknowledged flush is intact. Repeated ten times; between rounds the replicas salvage did not pick are
//! rebuilt from the chosen one, so every round starts with three RW replicas. Parameterised over the data engine
//! (`::v1`, `::v2`: a v2 replica's salvage fields, last-modified time and allocated bytes, live in its head lvol's
//! xattrs, and its rebuild transfers snapshot lvols, then the head).
//! The rule itself on replicas that diverge (v1: head sizes from separate writes, mtimes set on the head files):
//! a stale largest head loses, the largest recent head wins, the others are ERR and are then rebuilt.

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

/// The head file of `r` (v1: a file named by its status's head, somewhere under its directory).
async fn head_file(r: &Replica) -> std::path::PathBuf {
    let head = r.status().await.head;
    let mut dirs = vec![r.dir.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if e.file_name().to_string_lossy() == head {
                return p;
            }
        }
    }
    panic!("no head file {head} under {}", r.dir.display());
}

/// Sets the head file mtime of each replica to now minus the given seconds.
async fn set_head_ages(rs: &[Replica], ages_s: [u64; 3]) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    for (r, age) in rs.iter().zip(ages_s) {
        let f = head_file(r).await;
        let st = std::process::Command::new("touch")
            .args(["-m", "-d", &format!("@{}", now - age)])
            .arg(&f)
            .status()
            .unwrap();
        assert!(st.success(), "touch {}", f.display());
    }
}

/// Starts a salvage over `addrs` and checks it kept exactly `want` RW, every other replica ERR, and that the
/// volume reads `want`'s data (pattern `pattern`) at offset 0.
async fn salvage_keeps(dir: &std::path::Path, addrs: &[String], want: usize, pattern: u8) -> Engine {
    let e = Engine::start(
        dir,
        "vol",
        SIZE,
        addrs,
        &["--disable-revision-counter", "--salvage-requested"],
    );
    let modes = e.modes().await;
    assert_eq!(modes.len(), addrs.len(), "{modes:?}");
    for (a, m) in &modes {
        let expect = if *a == addrs[want] { "RW" } else { "ERR" };
        assert_eq!(
            m, expect,
            "salvage should keep replica {want} ({}) only: {modes:?}",
            addrs[want]
        );
    }
    let (ok, out) = qemu_io(&e.unix_uri(), &[&format!("read -P 0x{pattern:02x} 0 1M")]);
    assert!(ok, "the volume reads replica {want}'s data: {out}");
    e
}

/// Seed 003's rule on replicas that diverge: each written alone (replica i: `MIBS[i]` MiB of pattern `PAT[i]`, so
/// its head holds that many allocated bytes), then head mtimes set: the largest head loses when it is stale (older
/// than 5 s before the newest), the largest head among the recent ones wins, and the chosen one is the only RW;
/// the others are ERR and are then rebuilt from it.
#[tokio::test(flavor = "multi_thread")]
async fn salvage_picks_the_largest_recent_head_and_marks_the_others_err() {
    const MIBS: [u64; 3] = [8, 4, 2];
    const PAT: [u8; 3] = [0xa0, 0xb1, 0xc2];
    let t = tempfile::tempdir().unwrap();
    let rs: Vec<Replica> = (0..3)
        .map(|i| Replica::start(&t.path().join(format!("r{i}")), &["--disable-revision-counter"]))
        .collect();
    let addrs: Vec<String> = rs.iter().map(Replica::address).collect();
    for i in 0..3 {
        let mut e = Engine::start(
            t.path(),
            "vol",
            SIZE,
            &addrs[i..=i],
            &["--disable-revision-counter"],
        );
        let cmd = format!("write -P 0x{:02x} 0 {}M", PAT[i], MIBS[i]);
        let (ok, out) = qemu_io(&e.unix_uri(), &[&cmd, "flush"]);
        assert!(ok, "{out}");
        e.kill();
    }
    for i in 0..2 {
        assert!(
            rs[i].status().await.head_file_size > rs[i + 1].status().await.head_file_size,
            "heads of different sizes"
        );
    }

    // Replica 0 (largest) is stale; 1 and 2 are within 5 s of each other: 1, the larger of those, wins.
    set_head_ages(&rs, [20, 3, 0]).await;
    let mut e = salvage_keeps(t.path(), &addrs, 1, PAT[1]).await;
    e.kill();

    // All three recent (0 the oldest, by 4 s): 0, the largest, wins over newer smaller heads.
    set_head_ages(&rs, [4, 2, 0]).await;
    let e = salvage_keeps(t.path(), &addrs, 0, PAT[0]).await;

    // The others are rebuilt from it: three RW replicas reading replica 0's data.
    for a in &addrs[1..] {
        assert!(e.cli(&["replica", "rm", a]).status.success());
        let out = e.cli(&["replica", "add", a]);
        assert!(
            out.status.success(),
            "rebuild of {a}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let modes = e.modes().await;
    assert!(
        modes.len() == 3 && modes.iter().all(|(_, m)| m == "RW"),
        "{modes:?}"
    );
    for r in &rs {
        let data = r.flattened(SIZE).await;
        assert!(
            data[..8 << 20].iter().all(|b| *b == PAT[0]),
            "replica {} not rebuilt from 0",
            r.dir.display()
        );
    }
}
