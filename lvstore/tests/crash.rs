//! Crash safety: `corral-lvstore workload` (random writes, flushes, snapshots, clones, creates and deletes, each
//! step logged to a ledger) is killed with SIGKILL at a random point, again and again on the same store. After
//! every kill the store must pass the offline `corral-lvstore check` (no cluster leaked or owned twice), reopen,
//! and hold every flushed write: each block holds the last write flushed before the kill or a later one, whole.
//! Runs alternate between `O_DIRECT` and the page cache (one-`fdatasync` flushes with checksummed records).

#![allow(clippy::cast_possible_truncation)] // test sizes are small

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use lvstore::workload::Model;
use lvstore::{FormatOptions, LvStore, OpenMode};
use testkit::rng::TestRng;

fn kill_loop(kills: u64) {
    let bin = env!("CARGO_BIN_EXE_corral-lvstore");
    let dir = testkit::scratch::disk_tempdir("lvstore-crash");
    let path = dir.path().join("disk");
    std::fs::File::create(&path).unwrap().set_len(96 << 20).unwrap();
    // A small journal, so that kills also land inside checkpoints.
    let opts = FormatOptions {
        cluster_size: 64 << 10,
        meta_area: Some(1 << 20),
        journal_len: 64 << 10,
        force: false,
    };
    drop(LvStore::format(&path, &opts).unwrap());
    let mut rng = TestRng::seeded("lvstore crash", 20);
    let mut baseline = Model::default();
    let mut total_steps = 0;
    for run in 1..=kills {
        let ledger = dir.path().join(format!("ledger.{run}"));
        let mut child = Command::new(bin)
            .args([
                "workload",
                path.to_str().unwrap(),
                "--ledger",
                ledger.to_str().unwrap(),
                "--run",
            ])
            .arg(run.to_string())
            // Every other run through the page cache: its flushes make records and data durable with one
            // `fdatasync`, the records carrying the checksums of the blocks they newly map.
            .args(["--data-io", if run % 2 == 0 { "buffered" } else { "direct" }])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Kill after a random number of logged steps: the workload is mid-way (progress > 0, not finished).
        let target = 20 + rng.below(400) as usize;
        testkit::poll::wait_for("workload progress", Duration::from_secs(60), || {
            if let Ok(Some(st)) = child.try_wait() {
                let mut err = String::new();
                std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
                panic!("run {run}: the workload ended on its own ({st}): {err}");
            }
            let n = std::fs::read_to_string(&ledger)
                .map(|s| s.lines().count())
                .unwrap_or(0);
            (n >= target).then_some(())
        });
        child.kill().unwrap();
        child.wait().unwrap();
        let ledger_text = std::fs::read_to_string(&ledger).unwrap();
        total_steps += ledger_text.lines().count();

        let check = Command::new(bin)
            .args(["check", "--json", path.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            check.status.success(),
            "run {run}: check failed: {}",
            String::from_utf8_lossy(&check.stderr)
        );
        let report: serde_json::Value = serde_json::from_slice(&check.stdout).unwrap();
        assert_eq!(report["leakedClusters"], 0, "run {run}: {report}");

        let store = LvStore::open(&path, OpenMode::ReadWrite).unwrap();
        let names: Vec<String> = store.list().into_iter().map(|l| l.name).collect();
        let mut model = baseline.clone();
        model
            .replay(&ledger_text, &|n| names.iter().any(|x| x == n))
            .unwrap_or_else(|e| panic!("run {run}: {e}"));
        baseline = model
            .verify(&store)
            .unwrap_or_else(|e| panic!("run {run}: {e}\nledger {}", ledger.display()));
        eprintln!(
            "run {run}: killed after {} ledger lines; check ok; every flushed write there",
            ledger_text.lines().count()
        );
        assert_eq!(store.check().unwrap().leaked_clusters, 0);
    }
    eprintln!(
        "{kills} kills, {total_steps} logged steps, {} lvols and snapshots at the end",
        baseline.blobs.len()
    );
    assert!(Path::new(&path).exists());
}

#[test]
fn flushed_writes_survive_ten_sigkills_during_writes_snapshots_clones_and_deletes() {
    kill_loop(10);
}

/// `cargo nextest run -p lvstore --test crash --run-ignored ignored-only`
#[test]
#[ignore = "100 kills: ~1-2 minutes; run on demand"]
fn flushed_writes_survive_a_hundred_sigkills() {
    kill_loop(100);
}
