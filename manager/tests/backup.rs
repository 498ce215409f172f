//! Backups through the control plane (issue 18) with real manager, engine and replica processes, a `file://`
//! target and an S3 target (`rclone serve s3` on loopback): full then incremental backups restored into new
//! volumes that read like the source did (`qemu-img compare`, SHA-256 over NBD); a restored volume cannot be
//! attached before its restore completed; the manager SIGKILLed during a backup and during a restore (each shown
//! in progress) resumes both, and so does the engine SIGKILLed during each; bad input (unreachable endpoint,
//! wrong credentials, no such bucket, path tricks, a volume smaller than the backup) is refused with nothing
//! changed; credentials never show in `backup target get` nor in any log.
//!
//! The ≥ 1 GiB variant of the SIGKILL test is ignored in CI:
//! `cargo nextest run -p manager --test backup --run-ignored ignored-only`.

mod support;

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use support::*;
use testkit::servers::{S3_ENV, S3Server};
use testkit::{TestRng, nbd_sha256, qemu_io, wait_for};

const MIB: u64 = 1 << 20;
const SECRET: &str = S3_ENV[1].1;

/// `corral` with the S3 key pair in its environment (for `--credentials-from-env`).
fn corral_with_keys(url: &str, args: &[&str]) -> (bool, String, String) {
    let out = cli_command_for(url)
        .args(["--url", url])
        .args(args)
        .envs(S3_ENV)
        .output()
        .expect("corral");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn detach(url: &str, name: &str) {
    ok(url, &["volume", "detach", name]);
}

/// `corral backup create` (waits), its JSON.
fn backup(url: &str, volume: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["--json", "backup", "create", volume];
    args.extend_from_slice(extra);
    serde_json::from_str(&ok(url, &args)).unwrap()
}

fn get(m: &Manager, path: &str) -> serde_json::Value {
    let (code, v) = rest("GET", &format!("{}{path}", m.url), None);
    assert_eq!(code, 200, "GET {path}: {v}");
    v
}

/// Writes `len` bytes of incompressible data at `offset` through NBD (nbdcopy from a generated file).
fn write_random(uri: &str, dir: &Path, seed: u64, offset: u64, len: u64) {
    let f = dir.join(format!("random-{seed}"));
    let mut rng = TestRng::new(seed);
    let mut buf = vec![0u8; usize::try_from(len).unwrap()];
    rng.fill(&mut buf);
    std::fs::write(&f, &buf).unwrap();
    let (ok, o) = qemu_io(
        uri,
        &[&format!("write -s {} {offset} {len}", f.display()), "flush"],
    );
    assert!(ok, "{o}");
    std::fs::remove_file(&f).unwrap();
}

/// Bytes of every object the S3 server holds under `dir` (its files), measured on the server's side.
fn stored_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            let md = e.metadata().unwrap();
            if md.is_dir() {
                stack.push(p);
            } else {
                total += md.len();
            }
        }
    }
    total
}

fn no_secret_in_logs(data_dir: &Path) {
    let mut stack = vec![data_dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "log") {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                assert!(!text.contains(SECRET), "{} holds the S3 secret", p.display());
            }
        }
    }
}

#[test]
fn file_target_full_and_incremental_backups_restore_to_new_volumes_and_bad_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    let target = dir.path().join("target");

    // No target yet: a clear refusal.
    let (code, e) = rest(
        "POST",
        &format!("{url}/v1/backups"),
        Some(&json!({"volume": "src"})),
    );
    assert_eq!(code, 404, "{e}");
    ok(
        &url,
        &["volume", "create", "src", "--size", "64Mi", "--replicas", "2"],
    );
    let (code, e) = rest(
        "POST",
        &format!("{url}/v1/backups"),
        Some(&json!({"volume": "src"})),
    );
    assert!(
        code == 409 && e["message"].as_str().unwrap().contains("not set"),
        "{code} {e}"
    );

    // A directory that does not exist is refused; then set.
    let (okk, out, err) = corral(
        &url,
        &["backup", "target", "set", &format!("file://{}", target.display())],
    );
    assert!(!okk && err.contains("does not exist"), "{out}{err}");
    std::fs::create_dir(&target).unwrap();
    ok(
        &url,
        &[
            "backup",
            "target",
            "set",
            &format!("file://{}", target.display()),
            "--poll-interval",
            "2",
        ],
    );
    let t = get(&m, "/v1/backuptargets/default");
    assert_eq!(t["available"], true, "{t}");

    let src = attach(&url, "src");
    let (okk, o) = qemu_io(&src, &["write -P 0x5a 0 4M", "write -P 0x6b 40M 2M", "flush"]);
    assert!(okk, "{o}");
    let sum1 = nbd_sha256(&src);

    // 1. Full (the first backup), a snapshot taken for it.
    let b1 = backup(&url, "src", &["--label", "k=v"]);
    assert_eq!(b1["state"], "completed", "{b1}");
    assert_eq!(b1["isIncremental"], false, "{b1}");
    assert!(b1["fullReason"].as_str().unwrap().contains("first"), "{b1}");
    assert_eq!(b1["labels"]["k"], "v", "{b1}");
    assert_eq!(b1["snapshotTaken"], true, "{b1}");
    let b1_id = b1["id"].as_str().unwrap().to_owned();

    // 2. Writes, then an incremental.
    let (okk, o) = qemu_io(&src, &["write -P 0x77 8M 1M", "write -z 40M 1M", "flush"]);
    assert!(okk, "{o}");
    let sum2 = nbd_sha256(&src);
    let b2 = backup(&url, "src", &[]);
    assert_eq!(b2["state"], "completed", "{b2}");
    assert_eq!(b2["isIncremental"], true, "{b2}");
    assert_eq!(b2["chainPosition"], 1, "{b2}");
    assert!(
        b2["readBytes"].as_u64().unwrap() < b1["readBytes"].as_u64().unwrap(),
        "the incremental reads only the changed blocks: {b1} {b2}"
    );
    let b2_id = b2["id"].as_str().unwrap().to_owned();
    // --full forces one.
    let b3 = backup(&url, "src", &["--full"]);
    assert!(
        b3["isIncremental"] == false && b3["fullReason"].as_str().unwrap().contains("requested"),
        "{b3}"
    );

    let ls = ok(&url, &["backup", "ls", "src"]);
    assert!(
        ls.contains(&b1_id) && ls.contains(&b2_id) && ls.contains("incremental #1"),
        "{ls}"
    );
    let bv = get(&m, "/v1/backupvolumes/src");
    assert_eq!(bv["size"], 64 * MIB, "{bv}");

    // 3. Restore each into a new volume (the CLI waits with its progress bar).
    ok(
        &url,
        &[
            "volume",
            "create",
            "r1",
            "--from-backup",
            &b1_id,
            "--replicas",
            "2",
        ],
    );
    let r = get(&m, "/v1/volumes/r1/restore");
    assert!(r["state"] == "completed" && r["progress"] == 100, "{r}");
    let out = ok(&url, &["volume", "get", "r1"]);
    assert!(
        out.contains(&format!("restore of {b1_id}: completed 100%")),
        "{out}"
    );
    assert_eq!(get(&m, "/v1/volumes/r1")["state"], "detached");
    let r1 = attach(&url, "r1");
    assert_eq!(nbd_sha256(&r1), sum1, "r1 reads like src at the first backup");
    ok(
        &url,
        &[
            "volume",
            "create",
            "r2",
            "--from-backup",
            &b2_id,
            "--replicas",
            "1",
            "--size",
            "96Mi",
        ],
    );
    let r2 = attach(&url, "r2");
    let (okk, o) = qemu_io(&r2, &["read -P 0 64M 32M"]);
    assert!(okk, "past the backup's end reads zeros: {o}");
    detach(&url, "r2");
    // The backup named by its URL, as `backup ls --json` shows it.
    let b2_url = b2["url"].as_str().unwrap().to_owned();
    assert!(b2_url.starts_with("file://"), "{b2}");
    ok(
        &url,
        &[
            "volume",
            "create",
            "r2b",
            "--from-backup",
            &b2_url,
            "--replicas",
            "1",
        ],
    );
    let r2b = attach(&url, "r2b");
    assert_eq!(nbd_sha256(&r2b), sum2);
    qemu_img_compare(&r2b, &src);

    // 4. Never attached before the restore completed.
    ok(
        &url,
        &[
            "volume",
            "create",
            "r3",
            "--from-backup",
            &b2_id,
            "--replicas",
            "1",
            "--no-wait",
        ],
    );
    let (code, e) = rest("POST", &format!("{url}/v1/volumes/r3/attach"), None);
    if code == 200 {
        assert_eq!(
            get(&m, "/v1/volumes/r3/restore")["state"],
            "completed",
            "attached before completion: {e}"
        );
    } else {
        assert!(
            code == 409 && e["message"].as_str().unwrap().contains("restore"),
            "{code} {e}"
        );
    }
    wait_for("r3 restored", Duration::from_secs(120), || {
        (get(&m, "/v1/volumes/r3/restore")["state"] == "completed").then_some(())
    });

    // 5. Restore in place into a detached volume.
    detach(&url, "r1");
    wait_for("r1 detached", Duration::from_secs(60), || {
        (volume(&m, "r1")["state"] == "detached").then_some(())
    });
    ok(&url, &["backup", "restore", "r1", &b2_url]); // by URL, as volume create above
    let r1 = attach(&url, "r1");
    assert_eq!(nbd_sha256(&r1), sum2, "r1 restored in place to the second backup");

    // 6. Bad input: clear errors, nothing created.
    let (okk, out, err) = corral(
        &url,
        &[
            "volume",
            "create",
            "small",
            "--from-backup",
            &b1_id,
            "--size",
            "32Mi",
        ],
    );
    assert!(!okk && err.contains("cannot be smaller"), "{out}{err}");
    let missing = b2_url.replace(&b2_id[b2_id.find(':').unwrap() + 1..], "no-such-backup");
    let (okk, out, err) = corral(&url, &["volume", "create", "small", "--from-backup", &missing]);
    assert!(
        !okk && err.contains("no backup no-such-backup"),
        "{missing}: {out}{err}"
    );
    let (code, _) = rest("GET", &format!("{url}/v1/volumes/small"), None);
    assert_eq!(code, 404, "nothing created");
    for bad in ["../b", "default:..", "a/b", "%2e%2e"] {
        let (code, e) = rest(
            "POST",
            &format!("{url}/v1/volumes"),
            Some(&json!({"name": "x", "size": 64 * MIB, "fromBackup": bad})),
        );
        assert!(code == 400 || code == 404, "{bad}: {code} {e}");
        let (code, e) = rest("GET", &format!("{url}/v1/backups/{bad}"), None);
        assert!(code == 400 || code == 404, "{bad}: {code} {e}");
    }
    let (code, e) = rest(
        "POST",
        &format!("{url}/v1/backups"),
        Some(&json!({"volume": "../src"})),
    );
    assert_eq!(code, 400, "{e}");
    let (code, e) = rest(
        "POST",
        &format!("{url}/v1/backups"),
        Some(&json!({"volume": "src", "snapshot": "nope"})),
    );
    assert_eq!(code, 404, "{e}");
    let (code, _) = rest("GET", &format!("{url}/v1/volumes/x"), None);
    assert_eq!(code, 404, "nothing created");

    // 7. backup-max-count: the volume's own, then the setting.
    ok(&url, &["backup", "max-count", "src", "3"]);
    let (okk, out, err) = corral(&url, &["backup", "create", "src"]);
    assert!(!okk && err.contains("backup-max-count"), "{out}{err}");
    ok(&url, &["backup", "max-count", "src", "none"]);
    ok(&url, &["setting", "set", "backup-max-count", "3"]);
    let (okk, out, err) = corral(&url, &["backup", "create", "src"]);
    assert!(!okk && err.contains("backup-max-count"), "{out}{err}");
    ok(&url, &["backup", "max-count", "src", "0"]);
    let b4 = backup(&url, "src", &[]);
    assert_eq!(b4["state"], "completed", "0 on the volume means no limit: {b4}");
    ok(&url, &["backup", "rm", b4["id"].as_str().unwrap()]);
    ok(&url, &["setting", "set", "backup-max-count", "0"]);

    // 8. A backup made elsewhere (another cluster writing the same target) appears; deleted ones go.
    ok(&url, &["backup", "rm", b3["id"].as_str().unwrap()]);
    let (code, _) = rest(
        "GET",
        &format!("{url}/v1/backups/{}", b3["id"].as_str().unwrap()),
        None,
    );
    assert_eq!(code, 404);
    let m2_dir = dir.path().join("n2");
    let m2 = Manager::start(&m2_dir, "node-1", "embedded", port_range(1));
    ok(
        &m2.url,
        &[
            "backup",
            "target",
            "set",
            &format!("file://{}", target.display()),
            "--poll-interval",
            "1",
        ],
    );
    let seen = wait_for(
        "the other cluster lists the backups",
        Duration::from_secs(30),
        || {
            let v = get(&m2, "/v1/backups");
            (v.as_array().unwrap().len() == 2).then_some(v)
        },
    );
    assert!(
        seen.as_array().unwrap().iter().all(|b| b["state"] == "completed"),
        "{seen}"
    );
    ok(&m2.url, &["backup", "rm", &b1_id]);
    wait_for(
        "the deletion elsewhere shows here",
        Duration::from_secs(30),
        || {
            let (code, _) = rest("GET", &format!("{url}/v1/backups/{b1_id}"), None);
            (code == 404).then_some(())
        },
    );
    // The later backup still restores bit-exactly.
    ok(
        &url,
        &[
            "volume",
            "create",
            "r4",
            "--from-backup",
            &b2_id,
            "--replicas",
            "1",
        ],
    );
    let r4 = attach(&url, "r4");
    assert_eq!(nbd_sha256(&r4), sum2);
}

#[test]
fn s3_target_keeps_credentials_secret_and_refuses_unusable_targets() {
    let dir = tempfile::tempdir().unwrap();
    let s3_dir = dir.path().join("s3");
    std::fs::create_dir_all(s3_dir.join("bucket")).unwrap();
    let s3 = S3Server::start(&s3_dir, &[]);
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    let set = |bucket: &str, endpoint: &str| {
        corral_with_keys(
            &url,
            &[
                "backup",
                "target",
                "set",
                &format!("s3://{bucket}/pre"),
                "--endpoint",
                endpoint,
                "--credentials-from-env",
            ],
        )
    };

    let (okk, out, err) = set("bucket", &s3.endpoint);
    assert!(okk, "{out}{err}");
    for args in [
        &["backup", "target", "get"][..],
        &["--json", "backup", "target", "get"],
        &["--json", "backup", "target", "ls"],
    ] {
        let out = ok(&url, args);
        assert!(!out.contains(SECRET), "{args:?} shows the secret: {out}");
        assert!(
            out.contains("AWS_SECRET_ACCESS_KEY"),
            "{args:?} names the credentials it keeps: {out}"
        );
    }
    let before = get(&m, "/v1/backuptargets/default");

    // Unusable targets: refused, the target as it was.
    let refused = testkit::ports::RefusedAddr::new();
    let (okk, out, err) = set("bucket", &format!("http://{}", refused.addr));
    assert!(
        !okk && err.contains("backup target"),
        "unreachable endpoint: {out}{err}"
    );
    let (okk, out, err) = set("no-such-bucket", &s3.endpoint);
    assert!(
        !okk && err.contains("backup target"),
        "no such bucket: {out}{err}"
    );
    let (okk, out, err) = corral(
        &url,
        &[
            "backup",
            "target",
            "set",
            "s3://bucket/pre",
            "--name",
            "other",
            "--endpoint",
            &s3.endpoint,
        ],
    );
    assert!(!okk && err.contains("credentials"), "no credentials: {out}{err}");
    let (code, _) = rest("GET", &format!("{url}/v1/backuptargets/other"), None);
    assert_eq!(code, 404, "nothing set");
    let wrong = dir.path().join("wrong-keys");
    std::fs::write(&wrong, "AWS_ACCESS_KEY_ID=corral\nAWS_SECRET_ACCESS_KEY=wrong\n").unwrap();
    let (okk, out, err) = corral(
        &url,
        &[
            "backup",
            "target",
            "set",
            "s3://bucket/pre",
            "--endpoint",
            &s3.endpoint,
            "--credentials-file",
            wrong.to_str().unwrap(),
        ],
    );
    assert!(
        !okk && err.contains("backup target"),
        "wrong credentials: {out}{err}"
    );
    let (okk, out, err) = corral(
        &url,
        &["backup", "target", "set", "s3://bucket/pre?endpoint=http://x"],
    );
    assert!(!okk && err.contains("expected"), "a query in the URL: {out}{err}");
    let after = get(&m, "/v1/backuptargets/default");
    assert_eq!(after["url"], before["url"]);
    assert_eq!(after["endpoint"], before["endpoint"]);

    // A backup and a restore through S3.
    ok(
        &url,
        &["volume", "create", "src", "--size", "32Mi", "--replicas", "1"],
    );
    let src = attach(&url, "src");
    write_random(&src, dir.path(), 7, 0, 4 * MIB);
    let b = backup(&url, "src", &[]);
    assert_eq!(b["state"], "completed", "{b}");
    ok(
        &url,
        &[
            "volume",
            "create",
            "r",
            "--from-backup",
            b["id"].as_str().unwrap(),
            "--replicas",
            "1",
        ],
    );
    let r = attach(&url, "r");
    qemu_img_compare(&r, &src);

    // An incremental after 1 MiB of incompressible data written at a 1 MiB-aligned offset stores the blocks it
    // covers (two of the default 512 KiB) and small records: measured as the growth of the server's files, not
    // as Corral reports it. The first backup stored 4 MiB.
    let before = stored_bytes(&s3_dir.join("bucket"));
    write_random(&src, dir.path(), 8, 16 * MIB, MIB);
    let b2 = backup(&url, "src", &[]);
    assert_eq!(b2["isIncremental"], true, "{b2}");
    let grown = stored_bytes(&s3_dir.join("bucket")) - before;
    assert!(
        (MIB..MIB + 256 * 1024).contains(&grown),
        "the incremental stored {grown} bytes on the server: the changed block (~1 MiB compressed) and small records expected"
    );
    ok(
        &url,
        &[
            "volume",
            "create",
            "r2",
            "--from-backup",
            b2["id"].as_str().unwrap(),
            "--replicas",
            "1",
        ],
    );
    let r2 = attach(&url, "r2");
    qemu_img_compare(&r2, &src);

    no_secret_in_logs(&m.data_dir);
}

/// SIGKILL of the manager while a backup runs and while a restore runs: both are shown in progress when killed,
/// nothing half done is listed completed or served, and the restarted manager finishes both.
fn manager_killed_mid_backup_and_mid_restore(size: u64, bwlimit: &[&str]) {
    let dir = testkit::disk_tempdir("corral-backup-kill");
    let s3_dir = dir.path().join("s3");
    std::fs::create_dir_all(s3_dir.join("bucket")).unwrap();
    let s3 = S3Server::start(&s3_dir, bwlimit);
    let mut m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    let (okk, out, err) = corral_with_keys(
        &url,
        &[
            "backup",
            "target",
            "set",
            "s3://bucket",
            "--endpoint",
            &s3.endpoint,
            "--credentials-from-env",
        ],
    );
    assert!(okk, "{out}{err}");
    ok(
        &url,
        &[
            "volume",
            "create",
            "src",
            "--size",
            &size.to_string(),
            "--replicas",
            "1",
        ],
    );
    let src = attach(&url, "src");
    let mut off = 0;
    while off < size {
        let n = (64 * MIB).min(size - off);
        write_random(&src, dir.path(), off, off, n);
        off += n;
    }
    let sum = nbd_sha256(&src);

    let (okk, out, err) = corral(&url, &["--json", "backup", "create", "src", "--no-wait"]);
    assert!(okk, "{out}{err}");
    let b: serde_json::Value = serde_json::from_str(&out).unwrap();
    let id = b["id"].as_str().unwrap().to_owned();
    let snap = b["snapshot"].as_str().unwrap().to_owned();
    let running = wait_for("backup in progress", Duration::from_secs(120), || {
        let b = get(&m, &format!("/v1/backups/{id}"));
        (b["state"] == "in-progress" && b["progress"].as_u64() > Some(0)).then_some(b)
    });
    assert!(running["progress"].as_u64().unwrap() < 100, "{running}");
    // The snapshot it reads can be neither removed nor reverted to.
    let (code, e) = rest("DELETE", &format!("{url}/v1/volumes/src/snapshots/{snap}"), None);
    assert!(
        code == 409
            && e["message"]
                .as_str()
                .unwrap()
                .contains(b["name"].as_str().unwrap()),
        "{code} {e}"
    );
    let (code, e) = rest(
        "POST",
        &format!("{url}/v1/volumes/src/snapshots/{snap}/revert"),
        None,
    );
    assert_eq!(code, 409, "{e}");
    m.kill();
    m.restart();
    let url = m.url.clone();
    let done = wait_for(
        "backup completed after the restart",
        Duration::from_secs(600),
        || {
            let b = get(&m, &format!("/v1/backups/{id}"));
            assert_ne!(b["state"], "failed", "{b}");
            (b["state"] == "completed").then_some(b)
        },
    );
    assert_eq!(done["progress"], 100);
    let all = get(&m, "/v1/backups");
    assert_eq!(all.as_array().unwrap().len(), 1, "one backup, listed once: {all}");

    // Restore, killed mid-way.
    let (okk, out, err) = corral(
        &url,
        &[
            "volume",
            "create",
            "r",
            "--from-backup",
            &id,
            "--replicas",
            "1",
            "--no-wait",
        ],
    );
    assert!(okk, "{out}{err}");
    let r = wait_for("restore in progress", Duration::from_secs(120), || {
        let (code, r) = rest("GET", &format!("{url}/v1/volumes/r/restore"), None);
        (code == 200 && r["state"] == "restoring" && r["progress"].as_u64() > Some(0)).then_some(r)
    });
    assert!(r["progress"].as_u64().unwrap() < 100, "{r}");
    let (code, e) = rest("POST", &format!("{url}/v1/volumes/r/attach"), None);
    assert!(
        code == 409 && e["message"].as_str().unwrap().contains("being restored"),
        "{code} {e}"
    );
    m.kill();
    m.restart();
    let url = m.url.clone();
    wait_for(
        "restore completed after the restart",
        Duration::from_secs(600),
        || {
            let r = get(&m, "/v1/volumes/r/restore");
            assert_ne!(r["state"], "failed", "{r}");
            (r["state"] == "completed").then_some(())
        },
    );
    let r = attach(&url, "r");
    assert_eq!(nbd_sha256(&r), sum, "the restored volume reads like the source");
}

#[test]
fn manager_sigkilled_during_a_backup_and_a_restore_finishes_both() {
    // 24 MiB through an S3 server limited to 2 MiB/s: each phase runs for seconds.
    manager_killed_mid_backup_and_mid_restore(24 * MIB, &["--bwlimit", "2M"]);
}

#[test]
#[ignore = "1 GiB of data: cargo nextest run -p manager --test backup --run-ignored ignored-only"]
fn manager_sigkilled_during_a_1gib_backup_and_restore_finishes_both() {
    manager_killed_mid_backup_and_mid_restore(1024 * MIB, &[]);
}

/// SIGKILL of the volume's engine while a backup runs and while a restore runs: both jobs run on the replicas and
/// complete; the restarted engine of the volume being restored serves no frontend and attach stays refused until
/// the restore completed.
#[test]
fn engine_sigkilled_during_a_backup_and_a_restore_never_serves_half_done_data() {
    let dir = testkit::disk_tempdir("corral-backup-engine-kill");
    let s3_dir = dir.path().join("s3");
    std::fs::create_dir_all(s3_dir.join("bucket")).unwrap();
    let s3 = S3Server::start(&s3_dir, &["--bwlimit", "2M"]);
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    let (okk, out, err) = corral_with_keys(
        &url,
        &[
            "backup",
            "target",
            "set",
            "s3://bucket",
            "--endpoint",
            &s3.endpoint,
            "--credentials-from-env",
        ],
    );
    assert!(okk, "{out}{err}");
    ok(
        &url,
        &["volume", "create", "src", "--size", "32Mi", "--replicas", "1"],
    );
    let src = attach(&url, "src");
    write_random(&src, dir.path(), 11, 0, 16 * MIB);
    let sum = nbd_sha256(&src);
    let engine_pid = |name: &str| volume(&m, name)["engine"]["pid"].as_i64();

    let (okk, out, err) = corral(&url, &["--json", "backup", "create", "src", "--no-wait"]);
    assert!(okk, "{out}{err}");
    let id = serde_json::from_str::<serde_json::Value>(&out).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    wait_for("backup in progress", Duration::from_secs(120), || {
        let b = get(&m, &format!("/v1/backups/{id}"));
        (b["state"] == "in-progress"
            && b["progress"].as_u64() > Some(0)
            && b["progress"].as_u64() < Some(100))
        .then_some(())
    });
    sigkill(engine_pid("src").expect("engine pid"));
    let b = wait_for("backup ended", Duration::from_secs(300), || {
        let b = get(&m, &format!("/v1/backups/{id}"));
        (b["state"] == "completed" || b["state"] == "failed").then_some(b)
    });
    assert_eq!(
        b["state"], "completed",
        "the replica's job outlives the engine: {b}"
    );

    let (okk, out, err) = corral(
        &url,
        &[
            "volume",
            "create",
            "r",
            "--from-backup",
            &id,
            "--replicas",
            "1",
            "--no-wait",
        ],
    );
    assert!(okk, "{out}{err}");
    wait_for("restore in progress", Duration::from_secs(120), || {
        let r = get(&m, "/v1/volumes/r/restore");
        (r["state"] == "restoring" && r["progress"].as_u64() > Some(0) && r["progress"].as_u64() < Some(100))
            .then_some(())
    });
    sigkill(engine_pid("r").expect("engine pid of the restored volume"));
    let (code, e) = rest("POST", &format!("{url}/v1/volumes/r/attach"), None);
    assert_eq!(code, 409, "{e}");
    let r = wait_for("restore ended", Duration::from_secs(300), || {
        let r = get(&m, "/v1/volumes/r/restore");
        (r["state"] == "completed" || r["state"] == "failed").then_some(r)
    });
    assert_eq!(
        r["state"], "completed",
        "the replicas' jobs outlive the engine: {r}"
    );
    let r = attach(&url, "r");
    assert_eq!(nbd_sha256(&r), sum, "the restored volume reads like the source");
}

/// A standby (DR) volume restores the newest backup of a backup volume, then each newer one incrementally (only
/// the changed blocks are written), cannot be attached meanwhile, and once activated reads like the source at its
/// last backup.
#[test]
fn a_standby_volume_follows_three_incremental_backups_and_activates_to_the_last() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("target");
    std::fs::create_dir(&target).unwrap();
    let m = Manager::start(&dir.path().join("n1"), "node-1", "embedded", port_range(0));
    let url = m.url.clone();
    ok(
        &url,
        &["backup", "target", "set", &format!("file://{}", target.display())],
    );
    ok(
        &url,
        &["volume", "create", "src", "--size", "32Mi", "--replicas", "1"],
    );
    let src = attach(&url, "src");
    write_random(&src, dir.path(), 21, 0, 8 * MIB);
    backup(&url, "src", &[]);

    ok(
        &url,
        &[
            "volume",
            "create",
            "dr",
            "--standby",
            "--from-backup-volume",
            "src",
            "--replicas",
            "1",
        ],
    );
    let first = get(&m, "/v1/volumes/dr/restore");
    assert!(first["restored"] == true && first["standby"] == true, "{first}");
    assert!(first["bytesWritten"].as_u64().unwrap() >= 8 * MIB, "{first}");
    let (code, e) = rest("POST", &format!("{url}/v1/volumes/dr/attach"), None);
    assert_eq!(code, 409, "a standby volume is not attached for IO: {e}");

    for i in 0..3u64 {
        write_random(&src, dir.path(), 30 + i, (12 + 4 * i) * MIB, MIB);
        let b = backup(&url, "src", &[]);
        assert_eq!(b["isIncremental"], true, "{b}");
        let name = b["name"].as_str().unwrap().to_owned();
        let r = wait_for("the standby volume follows", Duration::from_secs(120), || {
            let r = get(&m, "/v1/volumes/dr/restore");
            (r["backup"] == name.as_str() && r["restored"] == true).then_some(r)
        });
        assert_eq!(r["incremental"], true, "{r}");
        let written = r["bytesWritten"].as_u64().unwrap();
        assert!(
            (MIB..=2 * MIB).contains(&written),
            "step {i}: an incremental restore writes the changed block only ({written} bytes): {r}"
        );
    }
    let sum = nbd_sha256(&src);
    ok(&url, &["volume", "activate", "dr"]);
    let r = get(&m, "/v1/volumes/dr/restore");
    assert!(r["state"] == "completed" && r["standby"] == false, "{r}");
    let dr = attach(&url, "dr");
    assert_eq!(
        nbd_sha256(&dr),
        sum,
        "the activated volume reads like the source at its last backup"
    );
}
