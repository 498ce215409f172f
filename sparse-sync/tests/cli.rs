//! The `corral-sync` binary: real processes, killed and restarted.
#![allow(
    clippy::single_range_in_vec_init,
    clippy::reversed_empty_ranges,
    clippy::cast_possible_truncation
)]

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use sparse_sync::receiver::partial_path;

const BIN: &str = env!("CARGO_BIN_EXE_corral-sync");

/// A `corral-sync serve --json` process; killed on drop if still running.
struct Server {
    child: Child,
    addr: String,
    lines: mpsc::Receiver<String>,
}

impl Server {
    fn start(target: &Path, extra: &[&str]) -> Self {
        let mut child = Command::new(BIN)
            .args(["--json", "serve", "--listen", "127.0.0.1:0", "--file"])
            .arg(target)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let first = lines
            .recv_timeout(Duration::from_secs(10))
            .expect("server did not report its address");
        let v: serde_json::Value = serde_json::from_str(&first).unwrap();
        assert_eq!(v["event"], "listening");
        let addr = v["address"].as_str().unwrap().to_string();
        Server { child, addr, lines }
    }

    /// Waits for the process to exit and returns its final summary.
    fn finished(mut self) -> serde_json::Value {
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(30))
            .expect("server printed no summary");
        let status = wait_for("server exit", Duration::from_secs(10), || {
            self.child.try_wait().unwrap()
        });
        assert!(status.success(), "server exited with {status}");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["event"], "finished");
        v["summary"].clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn send_json(src: &Path, addr: &str, extra: &[&str]) -> serde_json::Value {
    let out = Command::new(BIN)
        .args(["--json", "send", "--file"])
        .arg(src)
        .args(["--to", addr])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "send failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn allocated_data(path: &Path) -> u64 {
    if !path.exists() {
        return 0;
    }
    data_bytes(&data_extents(path))
}

#[test]
fn sender_killed_half_way_resumes_sending_only_what_the_receiver_lacks() {
    let dir = scratch_dir();
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    let ranges = random_sparse_file(&src, (64 << 20) + 3000, 1 << 20, 31);
    let data = data_bytes(&ranges);
    let server = Server::start(&dst, &["--idle-timeout", "60"]);

    // Throttled so the kill lands mid-transfer.
    let mut sender = Command::new(BIN)
        .args(["--json", "send", "--file"])
        .arg(&src)
        .args(["--to", &server.addr, "--max-rate", "24M"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let partial = partial_path(&dst);
    wait_for("half the data on the receiver", Duration::from_secs(30), || {
        (allocated_data(&partial) >= data * 4 / 10).then_some(())
    });
    sender.kill().unwrap(); // SIGKILL
    sender.wait().unwrap();
    let before = allocated_data(&partial);
    assert!(before < data, "transfer finished before the kill");
    assert!(!dst.exists());

    let second = send_json(&src, &server.addr, &[]);
    assert_eq!(second["receiver_had_content"], true);
    assert!(second["bytes_skipped"].as_u64().unwrap() > 0);
    let summary = server.finished();
    let received = summary["bytes_received"].as_u64().unwrap();
    assert!(
        received * 10 <= data * 12,
        "received {received} bytes over both runs for {data} bytes of data"
    );
    assert_eq!(summary["opens"], 2);
    assert_eq!(sha256_file(&src), sha256_file(&dst));
    assert_eq!(data_extents(&src), data_extents(&dst));
    assert!(!partial.exists());
}

#[test]
fn receiver_killed_mid_transfer_fails_the_sender_clearly_and_a_new_receiver_resumes() {
    let dir = scratch_dir();
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    let ranges = random_sparse_file(&src, (64 << 20) + 3000, 1 << 20, 37);
    let data = data_bytes(&ranges);
    let src_sum = sha256_file(&src);
    let mut server = Server::start(&dst, &["--idle-timeout", "60"]);

    // Throttled so the kill lands mid-transfer; few retries so the sender gives up soon after.
    let sender = Command::new(BIN)
        .args(["send", "--file"])
        .arg(&src)
        .args(["--to", &server.addr, "--max-rate", "24M", "--retries", "2"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let partial = partial_path(&dst);
    wait_for(
        "part of the data on the receiver",
        Duration::from_secs(30),
        || (allocated_data(&partial) >= data * 3 / 10).then_some(()),
    );
    server.child.kill().unwrap(); // SIGKILL: no close, no cleanup
    server.child.wait().unwrap();
    let out = sender.wait_with_output().unwrap();
    assert!(
        !out.status.success(),
        "the sender reported success to a dead receiver"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&server.addr),
        "error does not name the receiver: {stderr}"
    );
    assert!(
        !dst.exists(),
        "a half-written file appeared under the target name"
    );
    assert!(
        allocated_data(&partial) < data,
        "transfer finished before the kill"
    );
    assert_eq!(sha256_file(&src), src_sum, "the source changed");

    let server = Server::start(&dst, &["--idle-timeout", "60"]);
    let second = send_json(&src, &server.addr, &[]);
    assert_eq!(second["receiver_had_content"], true);
    assert!(second["bytes_skipped"].as_u64().unwrap() > 0);
    server.finished();
    assert_eq!(sha256_file(&src), sha256_file(&dst));
    assert_eq!(data_extents(&src), data_extents(&dst));
    assert!(!partial.exists());
}

#[test]
fn send_reports_a_json_summary_and_fast_skips_with_recorded_checksums() {
    let dir = scratch_dir();
    let (src, dst) = (dir.path().join("src.img"), dir.path().join("dst.img"));
    let ranges = random_sparse_file(&src, (8 << 20) + 5, 256 << 10, 41);
    let st = Command::new(BIN)
        .args(["checksum", "--record"])
        .arg(&src)
        .status()
        .unwrap();
    assert!(st.success());
    let server = Server::start(&dst, &[]);
    let first = send_json(&src, &server.addr, &["--fast"]);
    assert_eq!(first["bytes_sent"].as_u64().unwrap(), data_bytes(&ranges));
    assert_eq!(first["file_skipped"], false);
    for key in ["bytes_skipped", "hole_bytes", "holes", "duration_ms"] {
        assert!(first[key].is_u64(), "summary lacks {key}: {first}");
    }
    server.finished();
    let server = Server::start(&dst, &[]);
    let second = send_json(&src, &server.addr, &["--fast"]);
    assert_eq!(second["file_skipped"], true);
    assert_eq!(second["bytes_sent"], 0);
    assert_eq!(server.finished()["outcome"], "unchanged");
}

#[test]
fn copy_fold_and_prune_commands_keep_holes() {
    let dir = scratch_dir();
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    random_sparse_file(&src, (4 << 20) + 77, 128 << 10, 51);
    let out = Command::new(BIN)
        .args(["--json", "copy"])
        .arg(&src)
        .arg(&dst)
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["summary"]["data_bytes"].as_u64().unwrap(),
        data_bytes(&data_extents(&src))
    );
    assert_eq!(sha256_file(&src), sha256_file(&dst));
    assert_eq!(data_extents(&src), data_extents(&dst));

    // Prune the copy behind the source: every block the source has is punched out of it.
    let st = Command::new(BIN)
        .args(["prune"])
        .arg(&dst)
        .arg(&src)
        .status()
        .unwrap();
    assert!(st.success());
    // Every whole block is freed. A data piece in the partial last block stays allocated (a filesystem frees whole
    // blocks only) but must read as zeros.
    let size = (4 << 20) + 77;
    let tail = size / 4096 * 4096;
    let left = data_extents(&dst);
    assert!(left.iter().all(|r| r.start >= tail), "{left:?}");
    let content = std::fs::read(&dst).unwrap();
    assert!(content.iter().all(|&b| b == 0), "pruned copy holds data");
    // Fold the source back in: identical again.
    let st = Command::new(BIN)
        .args(["fold"])
        .arg(&src)
        .arg(&dst)
        .status()
        .unwrap();
    assert!(st.success());
    assert_eq!(sha256_file(&src), sha256_file(&dst));

    let out = Command::new(BIN)
        .args(["--json", "layout"])
        .arg(&dst)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["data_bytes"].as_u64().unwrap(), data_bytes(&data_extents(&src)));
}

#[test]
fn send_to_a_missing_file_or_receiver_fails_with_a_clear_message() {
    let dir = scratch_dir();
    let out = Command::new(BIN)
        .args(["send", "--file"])
        .arg(dir.path().join("nope"))
        .args(["--to", "127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope"));
}
