//! Backups end to end: real replicas and engines, data written with qemu-io over NBD, backups to a local
//! directory and to a real S3 server (`rclone serve s3`) on loopback, restores into fresh volumes compared byte
//! for byte with the snapshot they came from. The backup and restore tests run against v1 and v2 (lvstore)
//! replicas (`NAME::v1`, `NAME::v2`), and a v2 backup restores into a v1 volume and back; the v2 daemon
//! SIGKILLed mid-restore leaves a store that passes `corral-lvstore check`, no restored claim, and a retry restores
//! bit-exactly.

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::{DataEngine, Engine, Replica};
use testkit::qemu_io;
use testkit::servers::{S3_ENV, S3Server};
use testkit::wait_for;

const SIZE: u64 = 24 << 20;
const BS: &str = "256K";
const BLOCK: u64 = 256 << 10;

struct Volume {
    replicas: Vec<Replica>,
    engine: Engine,
}

impl Volume {
    fn start(dir: &Path, name: &str, n: usize) -> Self {
        Self::start_on(DataEngine::V1, dir, name, n)
    }

    /// A volume of `n` replicas on `engine`.
    fn start_on(engine: DataEngine, dir: &Path, name: &str, n: usize) -> Self {
        let replicas: Vec<Replica> = (0..n)
            .map(|i| Replica::start_on(engine, &dir.join(format!("{name}-r{i}")), &[]))
            .collect();
        let addrs: Vec<String> = replicas.iter().map(Replica::address).collect();
        let engine = Engine::start(dir, name, SIZE, &addrs, &[]);
        Self { replicas, engine }
    }

    fn write(&self, cmds: &[&str]) {
        let mut all = cmds.to_vec();
        all.push("flush");
        let (ok, out) = qemu_io(&self.engine.unix_uri(), &all);
        assert!(ok, "{out}");
    }

    /// Runs the CLI against this volume's engine with `env`; asserts success; returns stdout.
    fn cli(&self, env: &[(&str, &str)], args: &[&str]) -> String {
        let out = self.cli_raw(env, args);
        assert!(
            out.status.success(),
            "corral-engine {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn cli_raw(&self, env: &[(&str, &str)], args: &[&str]) -> Output {
        Command::new(common::bin("corral-engine"))
            .args(["--url", self.engine.url()])
            .args(args)
            .envs(env.iter().copied())
            .output()
            .unwrap()
    }

    fn snapshot(&self, name: &str) {
        self.cli(&[], &["snapshot", "create", name]);
    }

    /// The volume's data, read through every replica; asserts they agree.
    async fn data(&self) -> Vec<u8> {
        let first = self.replicas[0].flattened(SIZE).await;
        for r in &self.replicas[1..] {
            assert!(
                r.flattened(SIZE).await == first,
                "replica {} differs",
                r.address()
            );
        }
        first
    }

    /// `backup create --json` → the job status.
    fn backup(
        &self,
        env: &[(&str, &str)],
        target: &str,
        snapshot: &str,
        extra: &[&str],
    ) -> serde_json::Value {
        let mut args = vec![
            "--json",
            "backup",
            "create",
            "--snapshot",
            snapshot,
            "--target",
            target,
        ];
        args.extend(["--block-size", BS]);
        args.extend(extra);
        serde_json::from_str(&self.cli(env, &args)).unwrap()
    }
}

/// The backup `replica` records as last restored completely into it, read after a SIGKILL and a restart of its
/// daemon (so from what is durable: a v1 replica's file, a v2 head lvol's xattr).
async fn recorded_restore(replica: &mut Replica, engine: DataEngine) -> String {
    replica.kill();
    let dir = replica.dir.clone();
    *replica = Replica::start_on(engine, &dir, &[]);
    let s = replica
        .backup_service()
        .await
        .restore_status(corral_proto::v1::RestoreStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.state, "none", "{s:?}");
    s.last_restored
}

fn url(status: &serde_json::Value) -> String {
    status["url"].as_str().unwrap().to_owned()
}

/// `rclone serve s3` on loopback with the bucket `bk`.
fn s3_server(dir: &Path) -> S3Server {
    std::fs::create_dir_all(dir.join("bk")).unwrap();
    S3Server::start(dir, &[])
}

/// `stored` is the directory the target's objects land in on disk (for S3: the server's own directory), where
/// the test counts block objects itself instead of trusting Corral's counters.
async fn round_trip(engine: DataEngine, t: &Path, target: &str, env: &[(&str, &str)], stored: &Path) {
    let src = Volume::start_on(engine, t, "src", 1);
    src.write(&[
        "write -P 0x11 0 3M",
        "write -P 0x22 10M 1M",
        "write -P 0x23 23M 64k",
    ]);
    src.snapshot("s1");
    let s1 = src.data().await;
    let b1 = src.backup(env, target, "s1", &[]);
    assert_eq!(b1["isIncremental"], false);
    assert_eq!(b1["fullReason"], "first backup of the volume");

    src.write(&[
        "write -P 0x33 1M 256k",
        "write -P 0x34 1280k 256k",
        "write -P 0x44 20M 64k",
        "write -z 10M 1M",
    ]);
    src.snapshot("s2");
    let s2 = src.data().await;
    let objects_before = blk_files(stored);
    let b2 = src.backup(env, target, "s2", &[]);
    assert_eq!(
        blk_files(stored) - objects_before,
        3,
        "the incremental stored other than the 3 changed non-zero blocks (counted in the target's directory)"
    );
    assert_eq!(b2["isIncremental"], true);
    assert_eq!(b2["diffFromSnapshot"], "s1");
    // Changed: 2 blocks at 1M, 1 at 20M, 4 zeroed at 10M; only the 3 with data are new.
    assert_eq!(b2["readBytes"].as_u64().unwrap(), 7 * BLOCK, "{b2}");
    assert_eq!(b2["newBlocks"].as_u64().unwrap(), 3, "{b2}");

    // Each backup restores into a fresh two-replica volume; the first then follows incrementally (standby).
    let dst = Volume::start_on(engine, t, "dst", 2);
    dst.cli(env, &["backup", "restore", "--detach-frontend", &url(&b1)]);
    assert!(
        dst.data().await == s1,
        "restore of the full backup differs from s1"
    );
    let fresh = Volume::start_on(engine, t, "fresh", 1);
    fresh.cli(env, &["backup", "restore", "--detach-frontend", &url(&b2)]);
    assert!(
        fresh.data().await == s2,
        "restore of the incremental differs from s2"
    );
    let out = dst.cli(
        env,
        &[
            "--json",
            "backup",
            "restore",
            "--detach-frontend",
            "--incremental",
            &url(&b2),
        ],
    );
    let st: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(st[0]["status"]["incremental"], true, "{st}");
    assert_eq!(st[0]["status"]["blocksWritten"].as_u64().unwrap(), 3, "{st}");
    assert!(dst.data().await == s2, "incremental restore differs from s2");
    // Holes stay holes: the restored volume allocates about what the snapshot holds.
    let info = Command::new("nbdinfo")
        .args(["--map", &fresh.engine.unix_uri()])
        .output()
        .unwrap();
    let map = String::from_utf8_lossy(&info.stdout);
    assert!(map.contains("hole"), "{map}");

    let ls = dst.cli(env, &["--json", "backup", "ls", target]);
    let ls: serde_json::Value = serde_json::from_str(&ls).unwrap();
    assert_eq!(ls.as_array().unwrap().len(), 2, "{ls}");
}

// The same tests against v1 and v2 (lvstore) replicas: `NAME::v1`, `NAME::v2`.
on_both_engines!(
    round_trip_to_a_directory_full_and_incremental_restore_equal_their_snapshots,
    incremental_after_the_base_snapshot_was_deleted_uploads_only_changed_blocks,
    a_backup_killed_mid_upload_claims_nothing_blocks_deletion_meanwhile_and_a_rerun_completes,
    a_revert_ends_the_chain_and_the_next_backup_is_full_with_the_reason,
    a_purge_is_refused_while_a_backup_reads_the_snapshot_and_the_backup_equals_it,
    a_failed_restore_forgets_the_last_restored_backup_so_no_incremental_builds_on_a_mix,
);

async fn round_trip_to_a_directory_full_and_incremental_restore_equal_their_snapshots(engine: DataEngine) {
    let t = tempfile::tempdir().unwrap();
    let target = format!("file://{}", t.path().join("store").display());
    round_trip(engine, t.path(), &target, &[], &t.path().join("store")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_to_an_s3_server_full_and_incremental_restore_equal_their_snapshots() {
    let t = tempfile::tempdir().unwrap();
    let s3 = s3_server(&t.path().join("s3"));
    let target = format!("s3://bk/backups?endpoint={}&region=us-east-1", s3.endpoint);
    round_trip(
        DataEngine::V1,
        t.path(),
        &target,
        &S3_ENV,
        &t.path().join("s3/bk"),
    )
    .await;
    // Credentials from a file named in the environment (a mounted secret) work as well.
    let creds = t.path().join("s3-credentials");
    std::fs::write(
        &creds,
        S3_ENV
            .iter()
            .map(|(k, v)| format!("{k}={v}\n"))
            .collect::<String>(),
    )
    .unwrap();
    let probe = Volume::start(t.path(), "probe", 1);
    let ls = probe.cli(
        &[("CORRAL_BACKUP_CREDENTIALS_FILE", creds.to_str().unwrap())],
        &["--json", "backup", "ls", &target],
    );
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&ls)
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        2
    );
    // Without credentials the target is refused with the reason.
    let v = Volume::start(t.path(), "nocred", 1);
    let out = v.cli_raw(&[], &["backup", "ls", &target]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("credentials"));
}

async fn incremental_after_the_base_snapshot_was_deleted_uploads_only_changed_blocks(engine: DataEngine) {
    let t = tempfile::tempdir().unwrap();
    let target = format!("file://{}", t.path().join("store").display());
    let v = Volume::start_on(engine, t.path(), "vol", 1);
    // Eight distinct blocks, so deduplication cannot hide a re-upload.
    let w: Vec<String> = (0..8)
        .map(|i| format!("write -P {} {}k 256k", 0x40 + i, i * 256))
        .collect();
    v.write(&w.iter().map(String::as_str).collect::<Vec<_>>());
    v.snapshot("s1");
    let b1 = v.backup(&[], &target, "s1", &[]);
    assert_eq!(b1["newBlocks"].as_u64().unwrap(), 8);

    v.write(&["write -P 0x71 512k 256k", "write -P 0x72 5M 4k"]);
    v.snapshot("s2");
    let s2 = v.data().await;
    v.cli(&[], &["snapshot", "rm", "s1"]);
    v.cli(&[], &["snapshot", "purge"]);
    let ls = v.cli(&[], &["--json", "snapshot", "ls"]);
    assert!(!ls.contains("volume-snap-s1.img"), "s1 still present: {ls}");

    let b2 = v.backup(&[], &target, "s2", &[]);
    assert_eq!(
        b2["isIncremental"], true,
        "deleting the base snapshot must not force a full: {b2}"
    );
    assert_eq!(b2["newBlocks"].as_u64().unwrap(), 2, "{b2}");
    assert_eq!(b2["newBytes"].as_u64().unwrap(), 2 * BLOCK, "{b2}");
    assert_eq!(b2["deduplicatedBlocks"].as_u64().unwrap(), 7, "{b2}");
    let insp: serde_json::Value =
        serde_json::from_str(&v.cli(&[], &["--json", "backup", "inspect", &url(&b2)])).unwrap();
    assert_eq!(insp["backup"]["stats"]["newBytes"].as_u64().unwrap(), 2 * BLOCK);
    assert_eq!(insp["chain"].as_array().unwrap().len(), 2);

    let fresh = Volume::start_on(engine, t.path(), "fresh", 1);
    fresh.cli(&[], &["backup", "restore", "--detach-frontend", &url(&b2)]);
    assert!(fresh.data().await == s2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_max_three_chains_survive_deletes_and_a_corrupt_block_is_reported_then_healed_by_the_next_full()
{
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let target = format!("file://{}", store.display());
    let v = Volume::start(t.path(), "vol", 1);
    v.write(&["write -P 0x10 0 2M"]);
    let mut backups = Vec::new();
    let mut data = Vec::new();
    for i in 1..=6u32 {
        v.write(&[&format!("write -P {} {}M 256k", 0x20 + i, 2 + i)]);
        v.snapshot(&format!("s{i}"));
        data.push(v.data().await);
        let b = v.backup(&[], &target, &format!("s{i}"), &["--delta-max", "3"]);
        backups.push(b);
    }
    let kinds: Vec<bool> = backups
        .iter()
        .map(|b| b["isIncremental"].as_bool().unwrap())
        .collect();
    assert_eq!(kinds, [false, true, true, false, true, true]);
    assert!(
        backups[3]["fullReason"]
            .as_str()
            .unwrap()
            .contains("backup-delta-max")
    );

    for b in &backups[..2] {
        v.cli(&[], &["backup", "rm", "--gc-margin", "0", &url(b)]);
    }
    let fresh = Volume::start(t.path(), "fresh", 1);
    fresh.cli(
        &[],
        &["backup", "restore", "--detach-frontend", &url(&backups[2])],
    );
    assert!(fresh.data().await == data[2], "backup 3 after deleting 1 and 2");

    // Damage one stored block that backup 6 uses: verify and restore report it, nothing is silently restored.
    let insp: serde_json::Value =
        serde_json::from_str(&v.cli(&[], &["--json", "backup", "inspect", &url(&backups[5])])).unwrap();
    assert!(
        insp["backup"]["blocks"].as_array().unwrap().is_empty(),
        "inspect omits the map"
    );
    let cfg = std::fs::read_to_string(store.join("volumes/vol/backups").join(format!(
        "backup_{}.cfg",
        backups[5]["backupName"].as_str().unwrap()
    )))
    .unwrap();
    let cfg: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    let victim = &cfg["blocks"][0];
    let hash = victim["hash"].as_str().unwrap();
    let blk = store.join(format!(
        "volumes/vol/blocks/{}/{}/{hash}.blk",
        &hash[..2],
        &hash[2..4]
    ));
    let mut bytes = std::fs::read(&blk).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0xff;
    std::fs::write(&blk, bytes).unwrap();
    let out = v.cli_raw(&[], &["backup", "inspect", "--verify", &url(&backups[5])]);
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("offset {}", victim["offset"])), "{text}");
    let bad = Volume::start(t.path(), "bad", 1);
    let out = bad.cli_raw(
        &[],
        &["backup", "restore", "--detach-frontend", &url(&backups[5])],
    );
    assert!(!out.status.success(), "a corrupt block must fail the restore");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("checksum"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Backup 7 is full (delta-max) and uploads every block again: backup 6 verifies and restores again.
    v.snapshot("s7");
    let b7 = v.backup(&[], &target, "s7", &["--delta-max", "3"]);
    assert_eq!(b7["isIncremental"], false);
    assert!(b7["reuploadedBytes"].as_u64().unwrap() > 0);
    v.cli(&[], &["backup", "inspect", "--verify", &url(&backups[5])]);
    let healed = Volume::start(t.path(), "healed", 1);
    healed.cli(
        &[],
        &["backup", "restore", "--detach-frontend", &url(&backups[5])],
    );
    assert!(healed.data().await == data[5]);
}

fn blk_files(dir: &Path) -> usize {
    fn walk(d: &Path, n: &mut usize) {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, n);
            } else if p.extension().is_some_and(|x| x == "blk") {
                *n += 1;
            }
        }
    }
    let mut n = 0;
    walk(dir, &mut n);
    n
}

async fn a_backup_killed_mid_upload_claims_nothing_blocks_deletion_meanwhile_and_a_rerun_completes(
    engine: DataEngine,
) {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let target = format!("file://{}", store.display());
    let mut v = Volume::start_on(engine, t.path(), "vol", 1);
    v.write(&["write -P 0x01 0 256k"]);
    v.snapshot("s0");
    let b0 = v.backup(&[], &target, "s0", &[]);
    let w: Vec<String> = (0..40)
        .map(|i| format!("write -P {} {}k 256k", 0x80 + i, 256 + i * 256))
        .collect();
    v.write(&w.iter().map(String::as_str).collect::<Vec<_>>());
    v.snapshot("s1");
    let s1 = v.data().await;

    // 40 new blocks at ~1 MiB/s: about 10 s of uploading.
    let out = v.cli(
        &[],
        &[
            "backup",
            "create",
            "--snapshot",
            "s1",
            "--target",
            &target,
            "--block-size",
            BS,
            "--rate-limit",
            "1M",
            "--concurrency",
            "2",
            "--no-wait",
        ],
    );
    let killed_url = out.trim().to_owned();
    let progressed = 1 + 4; // b0's block, then four of this backup
    wait_for("upload progress", Duration::from_secs(30), || {
        (blk_files(&store) >= progressed).then_some(())
    });
    // Deletion (and its GC) cannot run while the backup holds its lock.
    let out = v.cli_raw(
        &[],
        &["backup", "rm", "--gc-margin", "0", "--lock-wait", "1", &url(&b0)],
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("locked"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let uploaded = blk_files(&store);
    v.replicas[0].kill();
    v.engine.kill();
    let ls: serde_json::Value = serde_json::from_str(
        &v.cli_raw(&[], &["--json", "backup", "ls", &target])
            .stdout
            .iter()
            .map(|&b| b as char)
            .collect::<String>(),
    )
    .unwrap();
    let killed = ls
        .as_array()
        .unwrap()
        .iter()
        .find(|b| killed_url.contains(b["name"].as_str().unwrap()))
        .unwrap();
    assert_eq!(
        killed["state"], "in-progress",
        "a killed backup must not claim completion: {killed}"
    );
    assert!(killed["completed"].as_str().unwrap().is_empty());
    assert!(
        blk_files(&store) >= uploaded,
        "blocks of the interrupted backup are kept"
    );
    let out = v.cli_raw(&[], &["backup", "restore", "--detach-frontend", &killed_url]);
    assert!(!out.status.success(), "an interrupted backup cannot be restored");

    // Restart replica and engine; the rerun completes and reuses what was uploaded.
    v.replicas[0].kill();
    v.replicas[0] = Replica::start_on(engine, &t.path().join("vol-r0"), &[]);
    v.engine = Engine::start(t.path(), "vol", SIZE, &[v.replicas[0].address()], &[]);
    let b1 = v.backup(&[], &target, "s1", &[]);
    assert_eq!(b1["isIncremental"], true);
    assert!(
        b1["deduplicatedBlocks"].as_u64().unwrap() >= (uploaded - 1) as u64,
        "{b1}"
    );
    let fresh = Volume::start_on(engine, t.path(), "fresh", 1);
    fresh.cli(&[], &["backup", "restore", "--detach-frontend", &url(&b1)]);
    assert!(fresh.data().await == s1);
}

async fn a_revert_ends_the_chain_and_the_next_backup_is_full_with_the_reason(engine: DataEngine) {
    let t = tempfile::tempdir().unwrap();
    let target = format!("file://{}", t.path().join("store").display());
    let v = Volume::start_on(engine, t.path(), "vol", 1);
    v.write(&["write -P 0x61 0 1M"]);
    v.snapshot("s1");
    v.backup(&[], &target, "s1", &[]);
    v.write(&["write -P 0x62 2M 256k"]);
    v.snapshot("s2");
    assert_eq!(v.backup(&[], &target, "s2", &[])["isIncremental"], true);
    v.cli(&[], &["snapshot", "revert", "s1"]);
    v.write(&["write -P 0x63 4M 256k"]);
    v.snapshot("s3");
    let s3 = v.data().await;
    let out = v.cli_raw(
        &[],
        &[
            "backup",
            "create",
            "--snapshot",
            "s3",
            "--target",
            &target,
            "--mode",
            "incremental",
        ],
    );
    assert!(
        !out.status.success(),
        "an incremental across a revert must be refused"
    );
    let b3 = v.backup(&[], &target, "s3", &[]);
    assert_eq!(b3["isIncremental"], false, "{b3}");
    assert!(b3["fullReason"].as_str().unwrap().contains("reverted"), "{b3}");
    let fresh = Volume::start_on(engine, t.path(), "fresh", 1);
    fresh.cli(&[], &["backup", "restore", "--detach-frontend", &url(&b3)]);
    assert!(fresh.data().await == s3);
}

async fn a_purge_is_refused_while_a_backup_reads_the_snapshot_and_the_backup_equals_it(engine: DataEngine) {
    // Without the guard, purging the removed s1 prunes it (holes punched where the head has data) under the
    // running backup, which then stores zeros for those blocks.
    let t = tempfile::tempdir().unwrap();
    let target = format!("file://{}", t.path().join("store").display());
    let v = Volume::start_on(engine, t.path(), "vol", 1);
    let w: Vec<String> = (0..8)
        .map(|i| format!("write -P {} {}k 256k", 0x30 + i, i * 256))
        .collect();
    v.write(&w.iter().map(String::as_str).collect::<Vec<_>>());
    v.snapshot("s1");
    let s1 = v.data().await;
    v.write(&["write -P 0x99 0 2M"]);
    // 8 blocks at ~512 KiB/s: about 4 s of uploading.
    let out = v.cli(
        &[],
        &[
            "backup",
            "create",
            "--snapshot",
            "s1",
            "--target",
            &target,
            "--block-size",
            BS,
            "--rate-limit",
            "512K",
            "--concurrency",
            "1",
            "--no-wait",
        ],
    );
    let backup_url = out.trim().to_owned();
    v.cli(&[], &["snapshot", "rm", "s1"]);
    let out = v.cli_raw(&[], &["snapshot", "purge"]);
    assert!(!out.status.success(), "purge ran under a backup");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("backup is running"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for("the backup completing", Duration::from_secs(60), || {
        let ls: serde_json::Value =
            serde_json::from_str(&v.cli(&[], &["--json", "backup", "ls", &target])).unwrap();
        ls.as_array()
            .unwrap()
            .iter()
            .any(|b| b["state"] == "complete")
            .then_some(())
    });
    let fresh = Volume::start_on(engine, t.path(), "fresh", 1);
    fresh.cli(&[], &["backup", "restore", "--detach-frontend", &backup_url]);
    assert!(fresh.data().await == s1, "the restored backup differs from s1");
}

async fn a_failed_restore_forgets_the_last_restored_backup_so_no_incremental_builds_on_a_mix(
    engine: DataEngine,
) {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let target = format!("file://{}", store.display());
    let v = Volume::start_on(engine, t.path(), "vol", 1);
    v.write(&["write -P 0x10 0 256k", "write -P 0x11 1M 256k"]);
    v.snapshot("s1");
    let b1 = v.backup(&[], &target, "s1", &[]);
    v.write(&["write -P 0x20 0 256k", "write -P 0x21 1M 256k"]);
    v.snapshot("s2");
    let b2 = v.backup(&[], &target, "s2", &[]);
    let mut dst = Volume::start_on(engine, t.path(), "dst", 1);
    dst.cli(&[], &["backup", "restore", "--detach-frontend", &url(&b1)]);
    assert_eq!(
        recorded_restore(&mut dst.replicas[0], engine).await,
        b1["backupName"].as_str().unwrap()
    );
    dst.engine.kill();
    dst.engine = Engine::start(t.path(), "dst", SIZE, &[dst.replicas[0].address()], &[]);

    // Damage the block b2 stored at 1M: the incremental restore fails part-way.
    let name = b2["backupName"].as_str().unwrap();
    let cfg: serde_json::Value = serde_json::from_slice(
        &std::fs::read(store.join(format!("volumes/vol/backups/backup_{name}.cfg"))).unwrap(),
    )
    .unwrap();
    let victim = cfg["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["offset"] == 1 << 20)
        .unwrap();
    let hash = victim["hash"].as_str().unwrap();
    let blk = store.join(format!(
        "volumes/vol/blocks/{}/{}/{hash}.blk",
        &hash[..2],
        &hash[2..4]
    ));
    let mut bytes = std::fs::read(&blk).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0xff;
    std::fs::write(&blk, bytes).unwrap();
    let out = dst.cli_raw(
        &[],
        &[
            "backup",
            "restore",
            "--detach-frontend",
            "--incremental",
            &url(&b2),
        ],
    );
    assert!(!out.status.success(), "a corrupt block must fail the restore");
    assert_eq!(
        recorded_restore(&mut dst.replicas[0], engine).await,
        "",
        "the volume no longer equals b1, yet an incremental would build on it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clone_and_restore_refuse_a_target_whose_frontend_is_attached_and_a_restore_ends_its_backup_chain() {
    let t = tempfile::tempdir().unwrap();
    let target = format!("file://{}", t.path().join("store").display());
    let src = Volume::start(t.path(), "src", 1);
    src.write(&["write -P 0x11 0 1M", "write -P 0x12 5M 256k"]);
    src.snapshot("s1");
    let s1 = src.data().await;
    let b1 = src.backup(&[], &target, "s1", &[]);

    // The target serves IO (its frontend is attached) and already has a backup of its own.
    let dst = Volume::start(t.path(), "dst", 1);
    dst.write(&["write -P 0x77 0 2M"]);
    dst.snapshot("d1");
    let d0 = dst.backup(&[], &target, "d1", &[]);
    assert_eq!(d0["fullReasonKind"], "first-backup", "{d0}");
    let before = dst.data().await;
    let stderr = |o: &Output| String::from_utf8_lossy(&o.stderr).into_owned();

    let out = dst.cli_raw(&[], &["backup", "restore", &url(&b1)]);
    assert!(!out.status.success(), "a restore under an attached frontend");
    assert!(stderr(&out).contains("serving IO"), "{}", stderr(&out));
    let out = dst.cli_raw(
        &[],
        &[
            "snapshot",
            "clone",
            "--from-engine",
            src.engine.url(),
            "--snapshot",
            "s1",
        ],
    );
    assert!(!out.status.success(), "a clone under an attached frontend");
    assert!(stderr(&out).contains("serving IO"), "{}", stderr(&out));
    assert!(
        dst.data().await == before,
        "a refused restore or clone changed the volume"
    );
    dst.write(&["read -P 0x77 0 2M"]); // still served

    // Asked to, the CLI detaches the frontend for the restore and attaches it again.
    dst.cli(&[], &["backup", "restore", "--detach-frontend", &url(&b1)]);
    assert!(dst.data().await == s1, "restored data differs from s1");
    dst.write(&["read -P 0x11 0 1M"]);

    // The restore ended dst's backup chain: the next backup is full and says why.
    dst.snapshot("d2");
    let d2 = dst.backup(&[], &target, "d2", &[]);
    assert_eq!(d2["isIncremental"], false, "{d2}");
    assert_eq!(d2["fullReasonKind"], "chain-ended", "{d2}");
    assert!(d2["fullReason"].as_str().unwrap().contains("restored"), "{d2}");
    let d3 = {
        dst.write(&["write -P 0x78 8M 256k"]);
        dst.snapshot("d3");
        dst.backup(&[], &target, "d3", &[])
    };
    assert_eq!(
        d3["isIncremental"], true,
        "the marker is cleared by the full: {d3}"
    );
    let ls: serde_json::Value =
        serde_json::from_str(&dst.cli(&[], &["--json", "backup", "ls", &target, "--volume", "dst"])).unwrap();
    let first = ls
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == d0["backupName"])
        .unwrap();
    assert_eq!(first["endOfChain"], true, "{first}");
}

fn all_files(dir: &Path) -> Vec<(std::path::PathBuf, u64)> {
    fn walk(d: &Path, out: &mut Vec<(std::path::PathBuf, u64)>) {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else {
                out.push((p.clone(), e.metadata().map(|m| m.len()).unwrap_or(0)));
            }
        }
    }
    let mut v = Vec::new();
    walk(dir, &mut v);
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_wrong_credentials_a_missing_bucket_and_a_tricky_backup_name_fail_clearly_and_change_nothing() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("s3");
    let s3 = s3_server(&root);
    let target = format!("s3://bk/backups?endpoint={}&region=us-east-1", s3.endpoint);
    let v = Volume::start(t.path(), "vol", 1);
    v.write(&["write -P 0x11 0 512k"]);
    v.snapshot("s1");
    let b1 = v.backup(&S3_ENV, &target, "s1", &[]);
    let before = all_files(&root);
    let create = |env: &[(&str, &str)], target: &str, extra: &[&str]| {
        let mut args = vec!["backup", "create", "--snapshot", "s1", "--target", target];
        args.extend(extra);
        let out = v.cli_raw(env, &args);
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let wrong = [
        ("AWS_ACCESS_KEY_ID", "corral"),
        ("AWS_SECRET_ACCESS_KEY", "not-the-secret"),
    ];
    let err = create(&wrong, &target, &[]);
    assert!(err.contains("backup target"), "wrong credentials: {err}");
    let err = v.cli_raw(&wrong, &["backup", "ls", &target]);
    assert!(!err.status.success());
    let missing = format!("s3://no-such-bucket/x?endpoint={}&region=us-east-1", s3.endpoint);
    let err = create(&S3_ENV, &missing, &[]);
    assert!(err.contains("backup target"), "missing bucket: {err}");
    for name in ["../escape", "a/b", ".hidden", "x%2F..%2Fy"] {
        let err = create(&S3_ENV, &target, &["--name", name]);
        assert!(err.contains("backup name"), "{name}: {err}");
    }
    let tricky = format!("{target}&backup=..%2Fx&volume=vol");
    let out = v.cli_raw(&S3_ENV, &["backup", "rm", &tricky]);
    assert!(!out.status.success());
    assert_eq!(all_files(&root), before, "a refused request changed the store");
    // The good backup is untouched and still restores.
    let fresh = Volume::start(t.path(), "fresh", 1);
    fresh.cli(&S3_ENV, &["backup", "restore", "--detach-frontend", &url(&b1)]);
    assert!(fresh.data().await == v.data().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_chain_marks_the_newest_backup_and_the_next_backup_is_full_with_the_given_reason() {
    let t = tempfile::tempdir().unwrap();
    let target = format!("file://{}", t.path().join("store").display());
    let v = Volume::start(t.path(), "vol", 1);
    v.write(&["write -P 0x21 0 512k"]);
    v.snapshot("s1");
    let b1 = v.backup(&[], &target, "s1", &[]);
    let out: serde_json::Value = serde_json::from_str(&v.cli(
        &[],
        &[
            "--json",
            "backup",
            "end-chain",
            "--reason",
            "operator reverted the volume",
            "--target",
            &target,
        ],
    ))
    .unwrap();
    assert_eq!(out["markedBackup"], b1["backupName"], "{out}");
    v.write(&["write -P 0x22 1M 256k"]);
    v.snapshot("s2");
    let b2 = v.backup(&[], &target, "s2", &[]);
    assert_eq!(b2["isIncremental"], false, "{b2}");
    assert_eq!(b2["fullReasonKind"], "chain-ended", "{b2}");
    assert!(
        b2["fullReason"].as_str().unwrap().contains("operator reverted"),
        "{b2}"
    );
    v.snapshot("s3");
    assert_eq!(v.backup(&[], &target, "s3", &[])["isIncremental"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_zeroed_over_the_backing_image_restores_as_zeros_and_the_backup_records_the_image() {
    let t = tempfile::tempdir().unwrap();
    let target = format!("file://{}", t.path().join("store").display());
    // A raw backing image: 4 MiB of 0xbb, then zeros.
    let image = t.path().join("base.raw");
    let mut bytes = vec![0xbbu8; 4 << 20];
    bytes.resize(usize::try_from(SIZE).unwrap(), 0);
    std::fs::write(&image, &bytes).unwrap();
    let over = |name: &str| {
        let size = SIZE.to_string();
        let args = ["--size", &size, "--backing-file", image.to_str().unwrap()];
        let replicas = vec![Replica::start(&t.path().join(format!("{name}-r0")), &args)];
        let engine = Engine::start(t.path(), name, SIZE, &[replicas[0].address()], &[]);
        Volume { replicas, engine }
    };
    let v = over("vol");
    v.write(&["write -z 0 1M", "write -P 0x11 2M 256k"]);
    v.snapshot("s1");
    let sum = "ab".repeat(64);
    let b1 = v.backup(
        &[],
        &target,
        "s1",
        &[
            "--backing-image-name",
            "base",
            "--backing-image-checksum",
            &format!("sha512:{sum}"),
        ],
    );
    assert_eq!(b1["backingImageName"], "base", "{b1}");
    // Given as `sha512:HEX`, recorded as the bare hex a replica started with the image records.
    assert_eq!(b1["backingImageChecksum"], sum, "{b1}");

    let fresh = over("fresh");
    fresh.cli(&[], &["backup", "restore", "--detach-frontend", &url(&b1)]);
    let (ok, out) = qemu_io(
        &fresh.engine.unix_uri(),
        &[
            "read -P 0 0 1M",
            "read -P 0xbb 1M 1M",
            "read -P 0x11 2M 256k",
            "read -P 0xbb 2304k 1792k",
            "read -P 0 4M 1M",
        ],
    );
    assert!(
        ok,
        "the restored volume differs (zeroed range must not show the backing image): {out}"
    );
}

/// `qemu-img compare` of two volumes through their engines' NBD sockets: bit-exact, holes compared as zeros.
fn qemu_img_compare(a: &Volume, b: &Volume) {
    let out = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .args([a.engine.unix_uri(), b.engine.unix_uri()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "qemu-img compare: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v2_backup_restores_into_a_v1_volume_and_back_bit_exact() {
    let t = tempfile::tempdir().unwrap();
    let target = format!("file://{}", t.path().join("store").display());
    let src = Volume::start_on(DataEngine::V2, t.path(), "v2src", 1);
    src.write(&[
        "write -P 0x5a 0 2M",
        "write -P 0x5b 7M 4k",
        "write -P 0x5c 23M 1M",
    ]);
    src.snapshot("s1");
    src.write(&["write -P 0x5d 1M 256k", "write -z 23M 512k"]);
    src.snapshot("s2");
    let want = src.data().await;
    src.backup(&[], &target, "s1", &[]);
    let b2 = src.backup(&[], &target, "s2", &[]);
    assert_eq!(b2["isIncremental"], true, "{b2}");

    // v2 -> v1.
    let v1 = Volume::start_on(DataEngine::V1, t.path(), "v1dst", 1);
    v1.write(&["write -P 0x99 0 24M"]); // old data the restore must replace, also where the backup has holes
    v1.cli(&[], &["backup", "restore", "--detach-frontend", &url(&b2)]);
    assert!(
        v1.data().await == want,
        "the v1 volume differs from the v2 snapshot"
    );
    qemu_img_compare(&src, &v1);

    // v1 -> v2, into a volume that held other data.
    v1.snapshot("r1");
    let b3 = v1.backup(&[], &target, "r1", &[]);
    let back = Volume::start_on(DataEngine::V2, t.path(), "v2back", 1);
    back.write(&["write -P 0x77 0 24M"]);
    back.snapshot("old");
    back.cli(&[], &["backup", "restore", "--detach-frontend", &url(&b3)]);
    assert!(
        back.data().await == want,
        "the v2 volume differs after v2 -> v1 -> v2"
    );
    qemu_img_compare(&src, &back);
    // Holes stay holes in the v2 restore over an empty head: what was never written is unallocated.
    let fresh = Volume::start_on(DataEngine::V2, t.path(), "v2fresh", 1);
    fresh.cli(&[], &["backup", "restore", "--detach-frontend", &url(&b3)]);
    qemu_img_compare(&src, &fresh);
    let map = Command::new("nbdinfo")
        .args(["--map", &fresh.engine.unix_uri()])
        .output()
        .unwrap();
    let map = String::from_utf8_lossy(&map.stdout);
    assert!(map.contains("hole"), "{map}");
}

/// `corral-lvstore check DISK` (offline): asserts it passes.
fn lvstore_check(disk: &Path) {
    let out = Command::new(common::bin("corral-lvstore"))
        .arg("check")
        .arg(disk)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "corral-lvstore check {}: {}{}",
        disk.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 20's crash safety and issue 18's "SIGKILL during restore" for v2: the `serve-lvstore` daemon is SIGKILLed
/// while its replica restores 17 MiB of incompressible data from an S3 server limited to 2 MiB/s (shown in
/// progress, blocks already written, when the signal hits). The store passes `corral-lvstore check` offline, the
/// restarted daemon does not record the half-written head as restored (so neither a `--incremental` restore nor
/// the manager builds on it), and a second restore over the half-written head reads bit-exactly like the
/// snapshot backed up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v2_daemon_sigkilled_mid_restore_leaves_a_checked_store_no_restored_claim_and_a_retry_restores_bit_exact()
 {
    let t = tempfile::tempdir().unwrap();
    let s3_dir = t.path().join("s3");
    std::fs::create_dir_all(s3_dir.join("bk")).unwrap();
    let s3 = S3Server::start(&s3_dir, &["--bwlimit", "2M"]);
    let target = format!("s3://bk/backups?endpoint={}&region=us-east-1", s3.endpoint);

    let src = Volume::start_on(DataEngine::V2, t.path(), "src", 1);
    let random = t.path().join("random");
    let mut bytes = vec![0u8; 16 << 20];
    testkit::TestRng::new(20).fill(&mut bytes);
    std::fs::write(&random, &bytes).unwrap();
    src.write(&[
        &format!("write -s {} 0 16M", random.display()),
        "write -P 0x5e 20M 1M",
    ]);
    src.snapshot("s1");
    let want = src.data().await;
    let b1 = src.backup(&S3_ENV, &target, "s1", &[]);

    // The destination held other data: a half restore is a mix of old and new, which the retry must not leave.
    let mut dst = Volume::start_on(DataEngine::V2, t.path(), "dst", 1);
    dst.write(&["write -P 0x77 0 24M"]);
    let restore = Command::new(common::bin("corral-engine"))
        .args(["--url", dst.engine.url()])
        .args(["backup", "restore", "--detach-frontend", &url(&b1)])
        .envs(S3_ENV)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut svc = dst.replicas[0].backup_service().await;
    let running = testkit::wait_for_async("restore in progress", Duration::from_secs(60), async || {
        let s = svc
            .restore_status(corral_proto::v1::RestoreStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        // Blocks count in the progress once written: past 5 %, several of the 68 blocks are in the head.
        (s.state == "in-progress" && s.progress >= 5 && s.progress < 90).then_some(s)
    })
    .await;
    dst.replicas[0].kill();
    let out = restore.wait_with_output().unwrap();
    assert!(
        !out.status.success(),
        "the restore CLI reported success for a restore its replica did not finish ({running:?}): {}",
        String::from_utf8_lossy(&out.stdout)
    );

    // Offline, the store the daemon died on is consistent.
    let disk = dst.replicas[0].dir.join("disk.img");
    lvstore_check(&disk);

    // Restarted: the half-written head is not recorded as restored, and it does not read like the backup.
    let dir = dst.replicas[0].dir.clone();
    dst.replicas[0] = Replica::start_on(DataEngine::V2, &dir, &[]);
    let s = dst.replicas[0]
        .backup_service()
        .await
        .restore_status(corral_proto::v1::RestoreStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        s.last_restored, "",
        "a half restore is recorded as restored: {s:?}"
    );
    assert_ne!(s.state, "complete", "{s:?}");
    assert!(
        dst.data().await != want,
        "the restore finished before the SIGKILL ({running:?}): nothing was interrupted"
    );

    // The retry, over the half-written head, restores bit-exactly and is recorded.
    dst.engine.kill();
    dst.engine = Engine::start(t.path(), "dst", SIZE, &[dst.replicas[0].address()], &[]);
    dst.cli(&S3_ENV, &["backup", "restore", "--detach-frontend", &url(&b1)]);
    assert!(dst.data().await == want, "the retried restore differs from s1");
    assert_eq!(
        recorded_restore(&mut dst.replicas[0], DataEngine::V2).await,
        b1["backupName"].as_str().unwrap()
    );
    dst.replicas[0].kill();
    lvstore_check(&disk);
}
