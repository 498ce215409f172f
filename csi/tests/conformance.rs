//! CSI conformance and the Kubernetes-style flow (`csi_conformance.py`), against a real `corral-manager` on a temp
//! dir, with an independent client: Python gRPC stubs generated from `proto/csi/v1/csi.proto` at test time.
//!
//! Needs root (mount, losetup), `nbdfuse`, `fusermount3`, `mkfs.ext4`, `mkfs.xfs`, `python3` with `grpcio` and
//! `grpcio-tools` (scripts/test.sh installs them), and the daemons built next to this test's binaries:
//! `cargo build -p manager -p replica -p engine --bins`.

use std::path::{Path, PathBuf};
use std::process::Command;

use testkit::{Daemon, DaemonCommand, kill_under};

/// A `corral-manager` on a temp dir; SIGKILLed with its daemons on drop.
struct Manager {
    daemon: Daemon,
    data_dir: PathBuf,
}

impl Drop for Manager {
    fn drop(&mut self) {
        self.daemon.kill();
        kill_under(&self.data_dir);
    }
}

/// Whatever a failed run left on the host under `dir` (mounts, loop devices, FUSE mounts) is taken down, so a
/// failure does not leak into the next run. A passing run leaves nothing: the conformance script checks that.
struct HostCleanup(PathBuf);

impl Drop for HostCleanup {
    fn drop(&mut self) {
        let dir = self.0.to_string_lossy().into_owned();
        let mut points: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(4).map(str::to_owned))
            .filter(|m| m.starts_with(&dir))
            .collect();
        // Deepest first; the FUSE mounts after the loop devices over them are gone.
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points.iter().filter(|p| !p.contains("/fuse/")) {
            let _ = Command::new("umount").args(["-l", p]).status();
        }
        let loops = Command::new("losetup")
            .arg("-a")
            .output()
            .map(|o| o.stdout)
            .unwrap_or_default();
        for l in String::from_utf8_lossy(&loops)
            .lines()
            .filter(|l| l.contains(&dir))
        {
            if let Some(dev) = l.split(':').next() {
                let _ = Command::new("losetup").args(["-d", dev]).status();
            }
        }
        for p in points.iter().filter(|p| p.contains("/fuse/")) {
            let _ = Command::new("fusermount3").args(["-u", "-z", p]).status();
        }
        kill_under(&self.0);
    }
}

fn bin_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_corral-csi"))
        .parent()
        .expect("binary dir")
        .to_owned()
}

fn start_manager(dir: &Path, node: &str) -> (Manager, String) {
    let bins = bin_dir();
    for b in ["corral-manager", "corral-replica", "corral-engine"] {
        assert!(
            bins.join(b).exists(),
            "{} missing: cargo build -p manager -p replica -p engine --bins",
            bins.join(b).display()
        );
    }
    let data_dir = dir.join("manager");
    std::fs::create_dir_all(&data_dir).unwrap();
    // Each test process takes its own slice of ports for corral-bim sync receivers (daemons bind port 0).
    let base = 30000 + u16::try_from(std::process::id() % 100).unwrap_or(0) * 100;
    // Ready (its ready file written) once the API serves and this node is registered.
    let daemon = DaemonCommand::new(bins.join("corral-manager"))
        .arg("--data-dir")
        .arg(&data_dir)
        .args(["--listen", "127.0.0.1:0", "--node-id", node])
        .arg("--bin-dir")
        .arg(&bins)
        .args(["--port-range", &format!("{base}-{}", base + 99)])
        .log_to(dir.join("manager.log"))
        .spawn();
    let url = daemon.http_url("http");
    let m = Manager { daemon, data_dir };
    (m, url)
}

#[test]
fn csi_conformance_and_the_kubernetes_flow_with_an_independent_python_client() {
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = HostCleanup(dir.path().to_owned());
    let node = "csi-node-1";
    let (manager, url) = start_manager(dir.path(), node);
    let work = dir.path().join("csi");
    std::fs::create_dir_all(&work).unwrap();
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("python3")
        .arg(here.join("tests/csi_conformance.py"))
        .args(["--manager", &url, "--node-id", node])
        .arg("--manager-data")
        .arg(&manager.data_dir)
        .arg("--csi-bin")
        .arg(env!("CARGO_BIN_EXE_corral-csi"))
        .arg("--proto-root")
        .arg(here.join("proto"))
        .arg("--workdir")
        .arg(&work)
        .output()
        .expect("run python3 csi_conformance.py");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    if !out.status.success() {
        let plugin_log = std::fs::read_to_string(work.join("corral-csi.log")).unwrap_or_default();
        let tail: Vec<&str> = plugin_log.lines().rev().take(40).collect();
        eprintln!(
            "--- corral-csi.log (last 40 lines, newest first)\n{}",
            tail.join("\n")
        );
    }
    assert!(out.status.success(), "CSI conformance failed (output above)");
    assert!(
        text.contains("PASS kubernetes_flow_leaves_nothing_behind"),
        "{text}"
    );
    drop(manager);
}
