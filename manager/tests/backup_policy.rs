//! Backups through the control plane, the cases `backup.rs` does not cover (issue 18), with real manager, engine,
//! replica and `corral-bim` processes: a volume over a backing image restored into a new volume (the image picked by
//! the name the backup recorded, its SHA-512 checked; an image of that name with other content refused) reads
//! like the source, ranges zeroed over backing data included; `backup-delta-max` 3 (the 4th backup full, a revert
//! ending the chain, each full saying why) and an incremental after its base snapshot was deleted and purged; an
//! unreachable target and a corrupt block in the store fail clearly and change nothing.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use support::*;
use testkit::servers::{S3_ENV, S3Server};
use testkit::{TestRng, nbd_sha256, qemu_io, wait_for};

const MIB: u64 = 1 << 20;

/// `corral backup create` (waits), its JSON.
fn backup(url: &str, volume: &str, extra: &[&str]) -> Value {
    let mut args = vec!["--json", "backup", "create", volume];
    args.extend_from_slice(extra);
    let v: Value = serde_json::from_str(&ok(url, &args)).unwrap();
    assert_eq!(v["state"], "completed", "{v}");
    v
}

fn get(url: &str, path: &str) -> Value {
    let (code, v) = rest("GET", &format!("{url}{path}"), None);
    assert_eq!(code, 200, "GET {path}: {v}");
    v
}

fn write_io(uri: &str, cmds: &[&str]) {
    let mut all = cmds.to_vec();
    all.push("flush");
    let (ok, out) = qemu_io(uri, &all);
    assert!(ok, "{out}");
}

/// A raw image of `len` bytes of incompressible data from `seed`, and its SHA-512 (hex, as `sha512sum` prints it).
fn raw_image(path: &Path, seed: u64, len: usize) -> String {
    let mut buf = vec![0u8; len];
    TestRng::new(seed).fill(&mut buf);
    std::fs::write(path, &buf).unwrap();
    let out = Command::new("sha512sum").arg(path).output().unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

/// Uploads `file` as backing image `name` through the CLI (which waits until it is ready).
fn upload_image(url: &str, name: &str, file: &Path) -> Value {
    let out = ok(
        url,
        &[
            "--json",
            "backing-image",
            "create",
            name,
            "--from-file",
            file.to_str().unwrap(),
        ],
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["state"], "ready", "{v}");
    v
}

fn set_file_target(url: &str, target: &Path) {
    std::fs::create_dir_all(target).unwrap();
    ok(
        url,
        &[
            "backup",
            "target",
            "set",
            &format!("file://{}", target.display()),
            "--poll-interval",
            "1",
        ],
    );
}

/// Every stored block file under a `file://` target.
fn block_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "blk") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn snapshot_names(url: &str, volume: &str) -> Vec<String> {
    let v = get(url, &format!("/v1/volumes/{volume}/snapshots"));
    let mut names: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_volume_over_a_backing_image_restores_over_the_recorded_image_and_a_mismatched_checksum_is_refused() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let target = dir.path().join("target");
    let base = dir.path().join("base.raw");
    let checksum = raw_image(&base, 1, usize::try_from(8 * MIB).unwrap());
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    set_file_target(&url, &target);
    let bi = upload_image(&url, "base", &base);
    assert_eq!(bi["currentChecksum"], checksum.as_str(), "{bi}");

    // A volume over the image: writes over backing data, a 2 MiB block zeroed over backing data (the backup
    // records a zero marker), a write past the image's end.
    ok(
        &url,
        &[
            "volume",
            "create",
            "src",
            "--size",
            "16Mi",
            "--replicas",
            "1",
            "--backing-image",
            "base",
        ],
    );
    let src = attach(&url, "src");
    write_io(
        &src,
        &[
            "write -P 0x5a 512k 256k",
            "write -z 2M 2M",
            "write -P 0x6b 6M 1M",
            "write -P 0x7c 12M 1M",
        ],
    );
    let (okk, o) = qemu_io(&src, &["read -P 0 2M 2M"]);
    assert!(okk, "the zeroed block reads zeros over the backing data: {o}");
    let sum = nbd_sha256(&src);

    let b = backup(&url, "src", &[]);
    assert_eq!(b["backingImageName"], "base", "{b}");
    assert_eq!(b["backingImageChecksum"], checksum.as_str(), "{b}");
    let id = b["id"].as_str().unwrap().to_owned();
    let shown = ok(&url, &["backup", "get", &id]);
    assert!(
        shown.contains("backing image") && shown.contains("base"),
        "{shown}"
    );

    // Restore into a new volume: no image named, the backup's is taken and checked.
    ok(
        &url,
        &["volume", "create", "r1", "--from-backup", &id, "--replicas", "1"],
    );
    // Equal to src: the ranges src never wrote show the image's random data, so r1 runs over that very image.
    let r1 = attach(&url, "r1");
    assert_eq!(
        nbd_sha256(&r1),
        sum,
        "r1 reads like src, the zeroed block included"
    );
    let (okk, o) = qemu_io(&r1, &["read -P 0 2M 2M"]);
    assert!(
        okk,
        "the zeroed block restored as zeros, not as the backing image: {o}"
    );
    qemu_img_compare(&r1, &src);
    // Another image named explicitly is refused.
    let other = dir.path().join("other.raw");
    let other_sum = raw_image(&other, 2, usize::try_from(8 * MIB).unwrap());
    upload_image(&url, "other", &other);
    let (code, e) = rest(
        "POST",
        &format!("{url}/v1/volumes"),
        Some(
            &json!({"name": "r-other", "size": 16 * MIB, "numberOfReplicas": 1, "fromBackup": id, "backingImage": "other"}),
        ),
    );
    assert!(
        code == 409 && e["message"].as_str().unwrap().contains("not other"),
        "{code} {e}"
    );

    // Another cluster on the same target whose image "base" holds other content: refused, nothing created.
    let m2 = Manager::start(&dir.path().join("n2"), "node-1", "embedded", port_range(1));
    let url2 = m2.url.clone();
    set_file_target(&url2, &target);
    let wrong = dir.path().join("wrong.raw");
    std::fs::copy(&other, &wrong).unwrap();
    let bi2 = upload_image(&url2, "base", &wrong);
    assert_eq!(bi2["currentChecksum"], other_sum.as_str(), "{bi2}");
    wait_for(
        "the other cluster lists the backup",
        Duration::from_secs(60),
        || {
            let (code, v) = rest("GET", &format!("{url2}/v1/backups/{id}"), None);
            (code == 200 && v["state"] == "completed").then_some(())
        },
    );
    let (okk, out, err) = corral(
        &url2,
        &["volume", "create", "r2", "--from-backup", &id, "--replicas", "1"],
    );
    assert!(
        !okk && err.contains("checksum mismatch")
            && err.contains(&checksum[..16])
            && err.contains(&other_sum[..16]),
        "a different image of the same name is refused: {out}{err}"
    );
    let (code, _) = rest("GET", &format!("{url2}/v1/volumes/r2"), None);
    assert_eq!(code, 404, "nothing created");
    let (code, e) = rest(
        "POST",
        &format!("{url2}/v1/volumes"),
        Some(&json!({"name": "r2", "size": 16 * MIB, "numberOfReplicas": 1, "fromBackup": id})),
    );
    assert_eq!(code, 409, "{e}");

    // The right image under that name: the restore there reads like the source too.
    let (code, e) = rest("DELETE", &format!("{url2}/v1/backingimages/base"), None);
    assert_eq!(code, 204, "{e}");
    // The name is free once the deletion has removed every file (GET says 404 a little before that).
    wait_for("the wrong image gone", Duration::from_secs(60), || {
        let (okk, out, err) = corral(
            &url2,
            &[
                "--json",
                "backing-image",
                "create",
                "base",
                "--from-file",
                base.to_str().unwrap(),
            ],
        );
        if okk {
            return Some(out);
        }
        assert!(err.contains("still being deleted"), "{out}{err}");
        None
    });
    ok(
        &url2,
        &["volume", "create", "r2", "--from-backup", &id, "--replicas", "1"],
    );
    let r2 = attach(&url2, "r2");
    assert_eq!(
        nbd_sha256(&r2),
        sum,
        "restored on the other cluster over the right image"
    );
}

/// The engine's gRPC address (`HOST:PORT`) of an attached volume.
fn engine_url(url: &str, volume: &str) -> String {
    let v = get(url, &format!("/v1/volumes/{volume}"));
    let a = v["engine"]["address"].as_str().unwrap_or_default().to_owned();
    assert!(!a.is_empty(), "{v}");
    a
}

#[test]
fn backup_delta_max_three_makes_the_fourth_full_a_revert_ends_the_chain_and_a_purged_base_keeps_incrementals()
{
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    set_file_target(&url, &dir.path().join("target"));
    ok(&url, &["setting", "set", "backup-delta-max", "3"]);
    ok(
        &url,
        &["volume", "create", "src", "--size", "32Mi", "--replicas", "1"],
    );
    let src = attach(&url, "src");

    // delta-max 3 counts the full: full, #1, #2, then a full again.
    let mut bs = Vec::new();
    for i in 0..5u64 {
        write_io(&src, &[&format!("write -P {:#x} {} 1M", 0x11 + i, i * 4 * MIB)]);
        bs.push(backup(&url, "src", &[]));
    }
    let kinds: Vec<(bool, u64)> = bs
        .iter()
        .map(|b| (b["isIncremental"] == true, b["chainPosition"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        kinds,
        [(false, 0), (true, 1), (true, 2), (false, 0), (true, 1)],
        "{bs:#?}"
    );
    assert!(
        bs[0]["fullReason"].as_str().unwrap().contains("first backup"),
        "{}",
        bs[0]
    );
    assert!(
        bs[3]["fullReason"]
            .as_str()
            .unwrap()
            .contains("backup-delta-max (3"),
        "the 4th says why it is full: {}",
        bs[3]
    );
    for b in [&bs[1], &bs[2], &bs[4]] {
        assert_eq!(b["fullReason"], "", "{b}");
    }
    assert_eq!(bs[4]["baseBackup"], bs[3]["name"], "{}", bs[4]);

    // A revert between two backups: the next one is full and says the volume was reverted.
    let snap4 = bs[3]["snapshot"].as_str().unwrap().to_owned();
    ok(&url, &["snapshot", "revert", "src", &snap4]);
    let v = wait_for("src serves IO after the revert", Duration::from_secs(60), || {
        let v = get(&url, "/v1/volumes/src");
        (v["state"] == "attached" && v["frontendDisabled"] == false && !v["endpoints"].as_array()?.is_empty())
            .then_some(v)
    });
    let src = unix_endpoint(&v);
    write_io(&src, &["write -P 0x31 20M 1M"]);
    let b6 = backup(&url, "src", &[]);
    assert_eq!(b6["isIncremental"], false, "{b6}");
    assert!(
        b6["fullReason"].as_str().unwrap().contains("reverted"),
        "a revert ended the chain: {b6}"
    );

    // The snapshot of the newest backup removed and purged: the next backup still extends the chain (from the
    // surviving ancestor), reads and uploads only what changed, and restores bit-exactly.
    write_io(&src, &["write -P 0x41 24M 1M"]);
    let b7 = backup(&url, "src", &[]);
    assert_eq!(b7["isIncremental"], true, "{b7}");
    let snap7 = b7["snapshot"].as_str().unwrap().to_owned();
    write_io(&src, &["write -P 0x42 28M 1M"]);
    // A snapshot above it (the head never absorbs a removed snapshot), so the purge merges b7's snapshot away.
    ok(&url, &["snapshot", "create", "src", "above"]);
    // The removal purges (no purge is asked for here).
    let (code, e) = rest("DELETE", &format!("{url}/v1/volumes/src/snapshots/{snap7}"), None);
    assert_eq!(code, 204, "{e}");
    let engine = engine_url(&url, "src");
    wait_for("the base snapshot purged", Duration::from_secs(60), || {
        let out = Command::new(cli_bin().with_file_name("corral-engine"))
            .env("CORRAL_TLS_DIR", m.tls_dir())
            .args(["--url", &engine, "--json", "snapshot", "ls"])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.success() && !text.contains(&snap7)).then_some(())
    });
    let sum = nbd_sha256(&src);
    let b8 = backup(&url, "src", &[]);
    assert!(
        b8["isIncremental"] == true && b8["fullReason"] == "" && b8["baseBackup"] == b7["name"],
        "the base snapshot's deletion does not end the chain: {b8}"
    );
    assert_eq!(b8["chainPosition"], 2, "{b8}");
    assert!(
        b8["newBytes"].as_u64().unwrap() <= 4 * MIB,
        "only the changed blocks are uploaded: {b8}"
    );
    ok(
        &url,
        &[
            "volume",
            "create",
            "r8",
            "--from-backup",
            b8["id"].as_str().unwrap(),
            "--replicas",
            "1",
        ],
    );
    let r8 = attach(&url, "r8");
    assert_eq!(
        nbd_sha256(&r8),
        sum,
        "the incremental over a purged base restores bit-exactly"
    );
}

#[test]
fn an_unreachable_target_and_a_corrupt_block_fail_clearly_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();

    // A corrupt block in a file:// target: the restore fails naming the block; the volume is never attachable.
    let target = dir.path().join("target");
    set_file_target(&url, &target);
    ok(
        &url,
        &["volume", "create", "src", "--size", "16Mi", "--replicas", "1"],
    );
    let src = attach(&url, "src");
    write_io(&src, &["write -P 0x5a 0 2M", "write -P 0x6b 8M 2M"]);
    let b = backup(&url, "src", &[]);
    let id = b["id"].as_str().unwrap().to_owned();
    let blocks = block_files(&target);
    assert_eq!(blocks.len(), 2, "{blocks:?}");
    let bad = &blocks[1];
    let mut data = std::fs::read(bad).unwrap();
    let last = data.len() - 1;
    data[last] ^= 0x55;
    std::fs::write(bad, &data).unwrap();
    let hash = bad.file_stem().unwrap().to_string_lossy().into_owned();
    let (okk, out, err) = corral(
        &url,
        &["volume", "create", "rc", "--from-backup", &id, "--replicas", "1"],
    );
    assert!(!okk, "a restore over a corrupt block succeeded: {out}{err}");
    let r = wait_for("the restore failed", Duration::from_secs(90), || {
        let r = get(&url, "/v1/volumes/rc/restore");
        (r["state"] == "failed").then_some(r)
    });
    let msg = r["message"].as_str().unwrap();
    assert!(
        msg.contains(&hash) && msg.contains("volume offset"),
        "the error names the block: {r}"
    );
    let (code, e) = rest("POST", &format!("{url}/v1/volumes/rc/attach"), Some(&json!({})));
    assert!(
        code == 409 && e["message"].as_str().unwrap().contains("failed"),
        "a failed restore is never served: {code} {e}"
    );

    // An S3 target that stops answering: a backup and a restore are refused before anything changes.
    let s3_dir = dir.path().join("s3");
    std::fs::create_dir_all(s3_dir.join("bucket")).unwrap();
    let s3 = S3Server::start(&s3_dir, &[]);
    let out = cli_command_for(&url)
        .args([
            "--url",
            &url,
            "backup",
            "target",
            "set",
            "s3://bucket/pre",
            "--name",
            "s3",
        ])
        .args(["--endpoint", &s3.endpoint, "--credentials-from-env"])
        .envs(S3_ENV)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (code, e) = rest(
        "POST",
        &format!("{url}/v1/backups"),
        Some(&json!({"volume": "src", "target": "s3"})),
    );
    assert_eq!(code, 201, "{e}");
    let s3_backup = e["id"].as_str().unwrap().to_owned();
    assert!(s3_backup.starts_with("s3:"), "{e}");
    wait_for("the S3 backup completed", Duration::from_secs(90), || {
        (get(&url, &format!("/v1/backups/{s3_backup}"))["state"] == "completed").then_some(())
    });
    drop(s3);
    let snaps = snapshot_names(&url, "src");
    let backups = get(&url, "/v1/backups").as_array().unwrap().len();
    let (code, e) = rest(
        "POST",
        &format!("{url}/v1/backups"),
        Some(&json!({"volume": "src", "target": "s3"})),
    );
    let msg = e["message"].as_str().unwrap_or_default();
    assert!(
        code == 503 && msg.contains("backup target s3") && msg.contains("nothing was changed"),
        "{code} {e}"
    );
    let (okk, out, err) = corral(
        &url,
        &[
            "volume",
            "create",
            "rs3",
            "--from-backup",
            &s3_backup,
            "--replicas",
            "1",
        ],
    );
    assert!(
        !okk && err.contains("backup target s3"),
        "a restore from an unreachable target: {out}{err}"
    );
    let (code, _) = rest("GET", &format!("{url}/v1/volumes/rs3"), None);
    assert_eq!(code, 404, "no volume created");
    assert_eq!(snapshot_names(&url, "src"), snaps, "no snapshot taken");
    assert_eq!(
        get(&url, "/v1/backups").as_array().unwrap().len(),
        backups,
        "no backup listed"
    );
}

#[test]
fn a_backing_image_backed_up_deleted_and_restored_from_the_target_reads_the_same() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let target = dir.path().join("target");
    let raw = dir.path().join("img.raw");
    let checksum = raw_image(&raw, 3, usize::try_from(6 * MIB).unwrap());
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    set_file_target(&url, &target);
    upload_image(&url, "img", &raw);

    let b: Value = serde_json::from_str(&ok(&url, &["--json", "backup", "backing-image", "img"])).unwrap();
    assert_eq!(b["state"], "completed", "{b}");
    assert_eq!(b["checksum"], checksum.as_str(), "{b}");
    assert!(b["newBytes"].as_u64().unwrap() >= 6 * MIB, "{b}");
    let backup_url = b["backupUrl"].as_str().unwrap().to_owned();
    assert!(backup_url.contains("backing-images"), "{b}");
    // Deduplicated: a second backup of the same image uploads nothing.
    let b2: Value = serde_json::from_str(&ok(&url, &["--json", "backup", "backing-image", "img"])).unwrap();
    assert_eq!(b2["newBytes"], 0, "{b2}");
    assert!(
        get(&url, "/v1/backupvolumes").as_array().unwrap().is_empty(),
        "an image is not listed as a backup volume"
    );

    // Deleted, then restored from the target under its name, checked against its SHA-512.
    let (code, e) = rest("DELETE", &format!("{url}/v1/backingimages/img"), None);
    assert_eq!(code, 204, "{e}");
    // At once: the create waits for the deleted image's files to go.
    let v: Value = serde_json::from_str(&ok(
        &url,
        &[
            "--json",
            "backing-image",
            "create",
            "img",
            "--source",
            "restore",
            "--backup-url",
            &backup_url,
            "--expected-checksum",
            &checksum,
        ],
    ))
    .unwrap();
    assert!(
        v["state"] == "ready" && v["currentChecksum"] == checksum.as_str(),
        "{v}"
    );
    assert_eq!(v["sourceType"], "restore", "{v}");
    ok(
        &url,
        &[
            "volume",
            "create",
            "vm",
            "--size",
            "8Mi",
            "--replicas",
            "1",
            "--backing-image",
            "img",
        ],
    );
    let uri = attach(&url, "vm");
    qemu_img_compare(raw.to_str().unwrap(), &uri);

    // Bad input: an image that does not exist, an unknown target.
    let (code, e) = rest("POST", &format!("{url}/v1/backingimages/nope/backup"), None);
    assert_eq!(code, 404, "{e}");
    let (code, e) = rest(
        "POST",
        &format!("{url}/v1/backingimages/img/backup"),
        Some(&json!({"target": "nope"})),
    );
    assert!(
        code == 409 && e["message"].as_str().unwrap().contains("not set"),
        "{code} {e}"
    );
}

/// A backing image's backup is a tracked operation: it runs in the manager, not in the request, so the waiting
/// CLI can be SIGKILLed while it is in progress (progress seen between 0 and 100) and the backup still completes;
/// and one whose target breaks mid-way (the target directory replaced by a file) ends `failed` with the store's
/// error, shown by REST and `corral backup backing-image-get`. Both are rate-limited (16 MiB/s, ~4 s for 64 MiB) so
/// that they are seen running: unlimited, a 64 MiB backup can finish within one progress write.
#[test]
fn a_backing_image_backup_runs_past_its_killed_client_with_progress_and_a_failure_shows_why() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let target = dir.path().join("target");
    let raw = dir.path().join("img.raw");
    let len = 64 * MIB;
    let checksum = raw_image(&raw, 11, usize::try_from(len).unwrap());
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    set_file_target(&url, &target);
    upload_image(&url, "img", &raw);
    let only = |url: &str| -> Value {
        let all = get(url, "/v1/backingimagebackups");
        let mut all = all.as_array().unwrap().clone();
        all.sort_by_key(|b| b["started"].as_str().unwrap_or_default().to_owned());
        all.pop().expect("a backup is listed")
    };

    // 1. The backup of another image (every block uploaded): the target breaks while it runs. (Its own image, so
    // that the blocks it uploaded do not shorten the next backup.)
    let raw2 = dir.path().join("img2.raw");
    raw_image(&raw2, 12, usize::try_from(len).unwrap());
    upload_image(&url, "img2", &raw2);
    let b: Value = serde_json::from_str(&ok(
        &url,
        &[
            "--json",
            "backup",
            "backing-image",
            "img2",
            "--no-wait",
            "--max-upload-rate",
            "16M",
        ],
    ))
    .unwrap();
    assert!(
        matches!(b["state"].as_str(), Some("pending" | "in-progress")),
        "{b}"
    );
    let id = b["id"].as_str().unwrap().to_owned();
    let running = wait_for("the first backup in progress", Duration::from_secs(60), || {
        let v = get(&url, &format!("/v1/backingimagebackups/{id}"));
        assert_ne!(
            v["state"], "completed",
            "the backup ended before the target could be broken: {v}"
        );
        (v["state"] == "in-progress" && v["progress"].as_u64().unwrap() > 0).then_some(v)
    });
    let moved = dir.path().join("target.moved");
    std::fs::rename(&target, &moved).unwrap();
    std::fs::write(&target, b"not a directory").unwrap();
    let failed = wait_for("the first backup failed", Duration::from_secs(60), || {
        let v = get(&url, &format!("/v1/backingimagebackups/{id}"));
        assert_ne!(v["state"], "completed", "{v}");
        (v["state"] == "failed").then_some(v)
    });
    assert!(!failed["error"].as_str().unwrap().is_empty(), "{failed}");
    assert!(
        failed["progress"].as_u64() < Some(100),
        "was at {running}: {failed}"
    );
    let shown = ok(&url, &["backup", "backing-image-get", &id]);
    assert!(shown.contains("failed: "), "{shown}");
    std::fs::remove_file(&target).unwrap();
    std::fs::rename(&moved, &target).unwrap();

    // 2. A backup whose waiting client is SIGKILLed mid-way completes anyway.
    let mut cli = cli_command_for(&url)
        .args([
            "--url",
            &url,
            "backup",
            "backing-image",
            "img",
            "--max-upload-rate",
            "16M",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut seen = Vec::new();
    let running = wait_for("the second backup in progress", Duration::from_secs(60), || {
        let v = only(&url);
        if v["id"] == id.as_str() {
            return None;
        }
        seen.push((v["state"].clone(), v["progress"].clone()));
        assert_ne!(
            v["state"], "completed",
            "the backup ended before its client was killed: {seen:?}"
        );
        let p = v["progress"].as_u64().unwrap();
        (v["state"] == "in-progress" && p > 0 && p < 100).then_some(v)
    });
    cli.kill().unwrap();
    cli.wait().unwrap();
    let id2 = running["id"].as_str().unwrap().to_owned();
    let done = wait_for("the second backup completed", Duration::from_secs(120), || {
        let v = get(&url, &format!("/v1/backingimagebackups/{id2}"));
        assert_ne!(v["state"], "failed", "{v}");
        (v["state"] == "completed").then_some(v)
    });
    assert_eq!(done["progress"], 100, "{done}");
    assert_eq!(done["checksum"], checksum.as_str(), "{done}");
    assert_eq!(done["size"], len, "{done}");
    assert_eq!(done["nodeId"], "node-1", "{done}");
    assert!(
        done["backupUrl"].as_str().unwrap().contains("backing-images"),
        "{done}"
    );
    let listed = ok(&url, &["backup", "backing-image-ls"]);
    assert!(
        listed.contains(&id2) && listed.contains("completed") && listed.contains(&id),
        "{listed}"
    );
    let j: Value = serde_json::from_str(&ok(&url, &["--json", "backup", "backing-image-get", &id2])).unwrap();
    assert_eq!(j, done);
    // Unknown ids are 404, path tricks 400.
    let (code, e) = rest(
        "GET",
        &format!("{url}/v1/backingimagebackups/default:bi-nope"),
        None,
    );
    assert_eq!(code, 404, "{e}");
    let (code, e) = rest(
        "GET",
        &format!("{url}/v1/backingimagebackups/default:..%2Fx"),
        None,
    );
    assert_eq!(code, 400, "{e}");
}

/// The volume config of backup volume `volume` under a `file://` target directory.
fn volume_cfg(target: &Path, volume: &str) -> Value {
    let p = target.join("volumes").join(volume).join("volume.cfg");
    serde_json::from_slice(&std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

fn ids(v: &Value) -> Vec<String> {
    let mut out: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["id"].as_str().unwrap().to_owned())
        .collect();
    out.sort();
    out
}

/// `backup-block-size` (refused unless a power of two from 4 KiB to 16 MiB) gives a new backup volume its block
/// size, `--block-size` overrides it for a volume's first backup on a target, and an existing backup volume keeps
/// its own: a `--block-size` that differs is refused before any snapshot is taken. `backup ls --target` and
/// `GET /v1/backups?target=&volume=` list one target's backups; an unknown target is 404, not an empty list.
#[test]
fn a_backup_volume_keeps_the_block_size_its_first_backup_chose_and_backups_are_listed_per_target() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let (ta, tb) = (dir.path().join("a"), dir.path().join("b"));
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    set_file_target(&url, &ta);
    std::fs::create_dir_all(&tb).unwrap();
    ok(
        &url,
        &[
            "backup",
            "target",
            "set",
            &format!("file://{}", tb.display()),
            "--name",
            "other",
        ],
    );

    // The setting takes powers of two from 4 KiB to 16 MiB only.
    for bad in ["3000", "2048", "33554432", "1048577", "x"] {
        let (code, e) = rest(
            "PUT",
            &format!("{url}/v1/settings/backup-block-size"),
            Some(&json!({"value": bad})),
        );
        assert!(
            code == 400 && e["message"].as_str().unwrap().contains("power of two"),
            "{bad}: {code} {e}"
        );
    }
    assert_eq!(get(&url, "/v1/settings/backup-block-size")["value"], "524288");
    ok(&url, &["setting", "set", "backup-block-size", "262144"]);

    ok(
        &url,
        &["volume", "create", "v", "--size", "16Mi", "--replicas", "1"],
    );
    let uri = attach(&url, "v");
    write_io(&uri, &["write -P 0x11 0 3M", "write -P 0x22 9M 1M"]);

    // --block-size on the first backup of the volume on target `other`; the setting on `default`.
    let b1 = backup(&url, "v", &["--target", "other", "--block-size", "512K"]);
    assert_eq!(volume_cfg(&tb, "v")["blockSize"], 512 << 10, "{b1}");
    let b2 = backup(&url, "v", &[]);
    assert_eq!(volume_cfg(&ta, "v")["blockSize"], 256 << 10, "{b2}");
    // The block size shows in the backup volume (the target's listing).
    wait_for("backup volume other:v listed", Duration::from_secs(30), || {
        let (code, v) = rest("GET", &format!("{url}/v1/backupvolumes/other:v"), None);
        (code == 200 && v["blockSize"] == 512 << 10).then_some(())
    });
    let shown = ok(&url, &["backup", "volume", "get", "other:v"]);
    assert!(shown.contains("512"), "{shown}");

    // A block size that differs from the existing backup volume's is refused, and nothing changes: no snapshot
    // taken, no backup recorded. The volume's own block size (or none) is taken.
    let snaps_before = get(&url, "/v1/volumes/v/snapshots");
    let backups_before = ids(&get(&url, "/v1/backups"));
    let (okk, out, err) = corral(&url, &["backup", "create", "v", "--block-size", "1M"]);
    assert!(
        !okk && err.contains("block size 262144") && err.contains("not 1048576"),
        "{out}{err}"
    );
    let (code, e) = rest(
        "POST",
        &format!("{url}/v1/backups"),
        Some(&json!({"volume": "v", "target": "other", "blockSize": 262144})),
    );
    assert!(
        code == 409 && e["message"].as_str().unwrap().contains("524288"),
        "{code} {e}"
    );
    for bad in [3000, 2048, 32 << 20] {
        let (code, e) = rest(
            "POST",
            &format!("{url}/v1/backups"),
            Some(&json!({"volume": "v", "blockSize": bad})),
        );
        assert!(
            code == 400 && e["message"].as_str().unwrap().contains("power of two"),
            "{bad}: {code} {e}"
        );
    }
    assert_eq!(get(&url, "/v1/volumes/v/snapshots"), snaps_before);
    assert_eq!(ids(&get(&url, "/v1/backups")), backups_before);
    let b3 = backup(&url, "v", &["--target", "other", "--block-size", "512K"]);
    assert_eq!(b3["isIncremental"], true, "{b3}");
    // The setting changed later applies to new backup volumes only.
    ok(&url, &["setting", "set", "backup-block-size", "1048576"]);
    let b4 = backup(&url, "v", &[]);
    assert_eq!(b4["isIncremental"], true, "{b4}");
    assert_eq!(volume_cfg(&ta, "v")["blockSize"], 256 << 10);

    // Listing per target: CLI and REST.
    let id = |b: &Value| b["id"].as_str().unwrap().to_owned();
    let mut on_other = vec![id(&b1), id(&b3)];
    on_other.sort();
    let mut on_default = vec![id(&b2), id(&b4)];
    on_default.sort();
    let all = ids(&get(&url, "/v1/backups"));
    assert_eq!(all.len(), 4, "{all:?}");
    assert_eq!(ids(&get(&url, "/v1/backups?target=other")), on_other);
    assert_eq!(ids(&get(&url, "/v1/backups?target=default&volume=v")), on_default);
    assert!(ids(&get(&url, "/v1/backups?volume=w")).is_empty());
    let j: Value = serde_json::from_str(&ok(&url, &["--json", "backup", "ls", "--target", "other"])).unwrap();
    assert_eq!(ids(&j), on_other);
    let j: Value =
        serde_json::from_str(&ok(&url, &["--json", "backup", "ls", "v", "--target", "default"])).unwrap();
    assert_eq!(ids(&j), on_default);
    let j: Value = serde_json::from_str(&ok(&url, &["--json", "backup", "ls", "other:v"])).unwrap();
    assert_eq!(ids(&j), on_other);
    let table = ok(&url, &["backup", "ls", "--target", "other"]);
    assert!(
        on_other.iter().all(|b| table.contains(b)) && on_default.iter().all(|b| !table.contains(b)),
        "{table}"
    );
    // An unknown target is an error, not an empty list; bad names and unknown parameters are 400.
    let (code, e) = rest("GET", &format!("{url}/v1/backups?target=nope"), None);
    assert!(
        code == 404 && e["message"].as_str().unwrap().contains("nope"),
        "{code} {e}"
    );
    let (okk, out, err) = corral(&url, &["backup", "ls", "--target", "nope"]);
    assert!(!okk && err.contains("nope"), "{out}{err}");
    for q in ["target=..%2Fx", "volume=..%2Fx", "colour=red"] {
        let (code, e) = rest("GET", &format!("{url}/v1/backups?{q}"), None);
        assert_eq!(code, 400, "{q}: {e}");
    }
}

/// Finds `backup_NAME.cfg` of backing image `image` under a `file://` target directory.
fn image_backup_cfg(target: &Path, image: &str, backup: &str) -> PathBuf {
    target
        .join("backing-images/volumes")
        .join(image)
        .join("backups")
        .join(format!("backup_{backup}.cfg"))
}

/// A running backup of a backing image is cancelled (`corral backup backing-image-cancel`, seen in progress before,
/// rate-limited to 16 MiB/s so that it is): it stops and is recorded failed, "cancelled"; it cannot be deleted while
/// it runs nor cancelled once ended. `corral backup backing-image-rm` deletes the cancelled one's in-progress marker
/// and a completed backup from the target and their records; an unknown id is 404.
#[test]
fn a_running_backing_image_backup_is_cancelled_and_finished_ones_are_deleted_from_the_target() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let target = dir.path().join("target");
    let raw = dir.path().join("img.raw");
    let len = 64 * MIB;
    raw_image(&raw, 21, usize::try_from(len).unwrap());
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    set_file_target(&url, &target);
    upload_image(&url, "img", &raw);

    let b: Value = serde_json::from_str(&ok(
        &url,
        &[
            "--json",
            "backup",
            "backing-image",
            "img",
            "--no-wait",
            "--max-upload-rate",
            "16M",
        ],
    ))
    .unwrap();
    let id = b["id"].as_str().unwrap().to_owned();
    let name = b["backup"].as_str().unwrap().to_owned();
    let path = format!("{url}/v1/backingimagebackups/{id}");
    wait_for("the backup in progress", Duration::from_secs(60), || {
        let v = get(&url, &format!("/v1/backingimagebackups/{id}"));
        assert_ne!(
            v["state"], "completed",
            "the backup ended before it could be cancelled: {v}"
        );
        (v["state"] == "in-progress" && v["progress"].as_u64().unwrap() > 0).then_some(())
    });
    // Running: not deleted.
    let (code, e) = rest("DELETE", &path, None);
    assert!(
        code == 409 && e["message"].as_str().unwrap().contains("cancel"),
        "{code} {e}"
    );
    assert!(image_backup_cfg(&target, "img", &name).exists());

    let out = ok(&url, &["backup", "backing-image-cancel", &id]);
    assert!(out.contains("failed") && out.contains("cancelled"), "{out}");
    let v = get(&url, &format!("/v1/backingimagebackups/{id}"));
    assert!(
        v["state"] == "failed"
            && v["error"].as_str().unwrap().contains("cancelled")
            && v["progress"].as_u64().unwrap() < 100
            && v["cancelRequested"] == true,
        "{v}"
    );
    // Recorded failed only once its upload returned; it left its in-progress marker on the target.
    let marker = std::fs::read(image_backup_cfg(&target, "img", &name)).unwrap();
    let (code, e) = rest("POST", &format!("{path}/cancel"), None);
    assert!(
        code == 409 && e["message"].as_str().unwrap().contains("nothing to cancel"),
        "{code} {e}"
    );
    let cfg: Value = serde_json::from_slice(&marker).unwrap();
    assert_eq!(
        cfg["state"], "in-progress",
        "the cancelled backup's marker: {cfg}"
    );

    // rm: the marker it left on the target and its record go.
    ok(&url, &["backup", "backing-image-rm", &id]);
    assert!(!image_backup_cfg(&target, "img", &name).exists());
    let (code, e) = rest("GET", &path, None);
    assert_eq!(code, 404, "{e}");

    // A completed backup: deleted from the target, not listed any more.
    let done: Value = serde_json::from_str(&ok(&url, &["--json", "backup", "backing-image", "img"])).unwrap();
    assert_eq!(done["state"], "completed", "{done}");
    let (id2, name2) = (
        done["id"].as_str().unwrap().to_owned(),
        done["backup"].as_str().unwrap().to_owned(),
    );
    assert!(image_backup_cfg(&target, "img", &name2).exists());
    let (code, e) = rest(
        "POST",
        &format!("{url}/v1/backingimagebackups/{id2}/cancel"),
        None,
    );
    assert_eq!(code, 409, "{e}");
    ok(&url, &["backup", "backing-image-rm", &id2]);
    assert!(!image_backup_cfg(&target, "img", &name2).exists());
    assert!(
        get(&url, "/v1/backingimagebackups")
            .as_array()
            .unwrap()
            .is_empty()
    );
    let (okk, out, err) = corral(&url, &["backup", "backing-image-rm", &id2]);
    assert!(!okk && err.contains("not found"), "{out}{err}");
    let (code, e) = rest(
        "DELETE",
        &format!("{url}/v1/backingimagebackups/default:..%2Fx"),
        None,
    );
    assert_eq!(code, 400, "{e}");
}
