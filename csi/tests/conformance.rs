//! CSI conformance and the Kubernetes-style flow (`csi_conformance.py`), against a real `corral-manager` on a temp
//! dir, with an independent client: Python gRPC stubs generated from `proto/csi/v1/csi.proto` at test time.
//!
//! Needs root (mount, losetup), `nbdfuse`, `fusermount3`, `mkfs.ext4`, `mkfs.xfs`, `python3` with `grpcio` and
//! `grpcio-tools` (scripts/test.sh installs them), and the daemons built next to this test's binaries:
//! `cargo build -p manager -p replica -p engine --bins`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `corral-manager` on a temp dir; SIGKILLed with its daemons on drop.
struct Manager {
    child: Child,
    data_dir: PathBuf,
}

impl Drop for Manager {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        kill_under(&self.data_dir);
    }
}

/// SIGKILL every process whose command line mentions `dir` (the daemons the manager started for this test).
fn kill_under(dir: &Path) {
    let needle = dir.to_string_lossy().into_owned();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if pid == i32::try_from(std::process::id()).unwrap_or(0) {
            continue;
        }
        if std::fs::read(e.path().join("cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
        {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind a loopback port")
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
    let port = free_port();
    let data_dir = dir.join("manager");
    std::fs::create_dir_all(&data_dir).unwrap();
    let log = std::fs::File::create(dir.join("manager.log")).unwrap();
    // Each test process takes its own slice of daemon ports.
    let base = 30000 + u16::try_from(std::process::id() % 100).unwrap_or(0) * 100;
    let child = Command::new(bins.join("corral-manager"))
        .arg("--data-dir")
        .arg(&data_dir)
        .args(["--listen", &format!("127.0.0.1:{port}"), "--node-id", node])
        .arg("--bin-dir")
        .arg(&bins)
        .args(["--port-range", &format!("{base}-{}", base + 99)])
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start corral-manager");
    let m = Manager { child, data_dir };
    let url = format!("http://127.0.0.1:{port}");
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let ok = Command::new("curl")
            .args(["-sf", &format!("{url}/v1/nodes/{node}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            break;
        }
        assert!(
            Instant::now() < end,
            "manager did not register node {node} within 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
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
