//! `corral up --detach` and `corral down`: the background manager is found through DATA_DIR/manager.ready, its
//! volumes are detached through the API before it is stopped, and nothing it started keeps running.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use testkit::{ReadyReport, kill_under, wait_for, workspace_bin};

/// The data directory of the manager `up` started: `corral` finds its admin token there (`CORRAL_DATA_DIR`), as a
/// user's shell with that variable set does.
static DATA_DIR: std::sync::Mutex<Option<std::path::PathBuf>> = std::sync::Mutex::new(None);

fn corral(args: &[&str]) -> (bool, String) {
    let mut cmd = Command::new(workspace_bin("corral"));
    if let Some(d) = DATA_DIR.lock().unwrap().as_ref() {
        cmd.env("CORRAL_DATA_DIR", d);
    }
    let out = cmd.args(args).env("NO_COLOR", "1").output().expect("run corral");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Runs and is not a zombie (the detached manager's parent is gone; whoever adopted it may reap it late).
fn alive(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with(['Z', 'X']))
        })
        .is_some_and(|zombie| !zombie)
}

/// Live processes whose command line names `dir` (but the test itself).
fn processes_under(dir: &Path) -> Vec<String> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u64>().ok())
        .filter(|&p| p != u64::from(std::process::id()) && alive(p))
        .filter_map(|p| {
            let c = String::from_utf8_lossy(&std::fs::read(format!("/proc/{p}/cmdline")).ok()?)
                .replace('\0', " ");
            c.contains(&needle).then(|| format!("{p}: {c}"))
        })
        .collect()
}

struct KillAll(std::path::PathBuf);

impl Drop for KillAll {
    fn drop(&mut self) {
        kill_under(&self.0);
    }
}

/// `corral up --detach` on port 0; the manager's URL from its ready file.
fn up(data: &Path) -> (String, u64) {
    *DATA_DIR.lock().unwrap() = Some(data.to_owned());
    let (ok, out) = corral(&[
        "up",
        "--detach",
        "--data-dir",
        data.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ]);
    assert!(ok && out.contains("corral down"), "{out}");
    let r = ReadyReport::read(&data.join("manager.ready")).unwrap();
    (format!("http://{}", r.listen["http"]), u64::from(r.pid))
}

fn volume(url: &str, name: &str) -> Value {
    let (ok, out) = corral(&["--url", url, "volume", "get", name, "--json"]);
    assert!(ok, "{out}");
    serde_json::from_str(&out).unwrap()
}

#[test]
fn down_detaches_the_volumes_then_stops_the_manager_and_everything_it_started() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let _guard = KillAll(data.clone());

    let (ok, out) = corral(&["down", "--data-dir", data.to_str().unwrap()]);
    assert!(ok && out.contains("nothing to stop"), "{out}");

    let (url, manager) = up(&data);
    let (ok, out) = corral(&[
        "--url",
        &url,
        "volume",
        "create",
        "v1",
        "--size",
        "16Mi",
        "--replicas",
        "1",
    ]);
    assert!(ok, "{out}");
    let (ok, out) = corral(&["--url", &url, "volume", "attach", "v1"]);
    assert!(ok && out.contains("nbd"), "{out}");
    let v = volume(&url, "v1");
    assert_eq!(v["state"], "attached", "{v}");
    let engine = v["engine"]["pid"].as_u64().expect("engine pid");
    assert!(alive(engine));
    // A v2 disk outside the data directory and a v2 volume on it: its store's daemon is stopped by down too.
    let v2disk = dir.path().join("v2disk");
    let v2run = |args: &[&str]| {
        let (ok, out) = corral(&[&["--url", url.as_str()], args].concat());
        assert!(ok, "{args:?}: {out}");
    };
    v2run(&[
        "node",
        "disk-add",
        "node-1",
        "v2",
        v2disk.to_str().unwrap(),
        "--disk-engine",
        "v2",
        "--lvstore-size",
        "128M",
    ]);
    // Right after: disk-add returned once the disk could take replicas.
    v2run(&[
        "volume",
        "create",
        "vtwo",
        "--size",
        "16Mi",
        "--replicas",
        "1",
        "--data-engine",
        "v2",
    ]);
    let lvstore = wait_for("the v2 disk's daemon running", Duration::from_secs(60), || {
        let (ok, out) = corral(&["--url", &url, "lvstore", "ls", "--json"]);
        assert!(ok, "{out}");
        let ds: Value = serde_json::from_str(&out).unwrap();
        let d = ds.as_array()?.first()?.clone();
        (d["state"] == "running").then(|| d["pid"].as_u64()).flatten()
    });
    v2run(&["volume", "attach", "vtwo"]);
    assert_eq!(volume(&url, "vtwo")["state"], "attached");
    // A second manager on the same directory is refused, naming the first.
    let (ok, out) = corral(&[
        "up",
        "--detach",
        "--data-dir",
        data.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ]);
    assert!(
        !ok && out.contains("already runs") && out.contains(&manager.to_string()),
        "{out}"
    );

    let (ok, out) = corral(&["down", "--data-dir", data.to_str().unwrap(), "--timeout", "60"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("detaching volume v1") && out.contains("volume v1 detached"),
        "{out}"
    );
    assert!(out.contains("volume vtwo detached"), "{out}");
    assert!(!alive(manager), "the manager still runs after down:\n{out}");
    assert!(!alive(engine), "the engine still runs after down:\n{out}");
    assert!(
        !alive(lvstore),
        "the v2 disk's daemon still runs after down:\n{out}"
    );
    let left = processes_under(&data);
    assert!(
        left.is_empty(),
        "still running under the data directory: {left:#?}\n{out}"
    );
    assert!(!data.join("manager.ready").exists());
    let (ok, out) = corral(&["down", "--data-dir", data.to_str().unwrap()]);
    assert!(ok && out.contains("nothing to stop"), "{out}");

    // The store says detached: a new manager on the directory finds the volume detached and starts no engine.
    let (url, manager) = up(&data);
    let v = volume(&url, "v1");
    assert_eq!(v["state"], "detached", "{v}");
    assert!(v["nodeId"].is_null(), "{v}");
    assert!(v["engine"].is_null() || v["engine"]["state"] != "running", "{v}");

    // A manager that died without `down` leaves a stale report: down says so, removes it, stops the leftovers.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(manager).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_for("the killed manager to be gone", Duration::from_secs(10), || {
        (!alive(manager)).then_some(())
    });
    let (ok, out) = corral(&["down", "--data-dir", data.to_str().unwrap()]);
    assert!(
        ok && out.contains("is not running") && out.contains("stale"),
        "{out}"
    );
    assert!(!data.join("manager.ready").exists());
    let left = processes_under(&data);
    assert!(
        left.is_empty(),
        "still running under the data directory: {left:#?}\n{out}"
    );
}
