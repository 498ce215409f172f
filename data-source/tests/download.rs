//! `download` against a local HTTP server started by the test: plain, with and without Range support, cut half
//! way, silent; raw and qcow2 images; expected checksums right and wrong.

// Test sizes are a few MiB: casts to usize cannot truncate.
#![allow(clippy::cast_possible_truncation)]

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use data_source::FileState;
use testkit::wait_for;

const MIB: u64 = 1 << 20;

#[test]
fn raw_download_without_checksum_is_ready_sparse_and_complete() {
    let disk = disk();
    let src = tempfile::tempdir().unwrap();
    let data = raw_image(&src.path().join("a.raw"), 24 * MIB);
    let server = FileServer::start(data.clone(), ServeMode::range());
    let ds = DataSourceProc::download(disk.path(), &server.url, &[]);
    let i = ds.expect_ready(&sha512(&data));
    assert_eq!(
        (i.size, i.virtual_size, i.processed_size),
        (24 * MIB, 24 * MIB, 24 * MIB)
    );
    assert!(i.expected_checksum.is_empty());
    assert_eq!(i.parameters.get("url"), Some(&server.url));
    assert_eq!(i.disk_uuid, DISK_UUID);
    // Three quarters of the image are zeros: they must be holes, not written blocks.
    assert!(
        i.real_size < 8 * MIB,
        "zero blocks were written: real size {}",
        i.real_size
    );
    assert_eq!(i.real_size, allocated(Path::new(&i.file_path)));
    assert_eq!(i.file_path, disk.path().join("tmp/img-u1").display().to_string());
}

#[test]
fn raw_download_with_the_right_checksum_and_no_range_support_is_ready() {
    let disk = disk();
    let src = tempfile::tempdir().unwrap();
    let data = raw_image(&src.path().join("a.raw"), 8 * MIB);
    let sum = sha512(&data);
    let server = FileServer::start(data, ServeMode::default());
    let ds = DataSourceProc::download(
        disk.path(),
        &server.url,
        &["--expected-checksum", &sum.to_uppercase()],
    );
    let i = ds.expect_ready(&sum);
    assert_eq!(i.expected_checksum, sum);
}

#[test]
fn qcow2_download_with_and_without_checksum_keeps_the_qcow2_file() {
    let src = tempfile::tempdir().unwrap();
    let q = qcow2_image(src.path(), 16 * MIB);
    let sum = sha512(&q);
    let server = FileServer::start(q.clone(), ServeMode::range());
    for expected in [None, Some(sum.clone())] {
        let disk = disk();
        let mut args = vec!["--param".to_owned(), format!("url={}", server.url)];
        if let Some(e) = &expected {
            args.extend(["--expected-checksum".to_owned(), e.clone()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let ds = DataSourceProc::start(disk.path(), "download", &args);
        let i = ds.expect_ready(&sum);
        assert_eq!(i.size, q.len() as u64);
        assert_eq!(i.virtual_size, 16 * MIB, "virtual size of the qcow2 image");
    }
}

#[test]
fn connection_cut_half_way_resumes_with_range_and_fetches_little_twice() {
    let disk = disk();
    let src = tempfile::tempdir().unwrap();
    let data = raw_image(&src.path().join("a.raw"), 32 * MIB);
    let sum = sha512(&data);
    let server = FileServer::start(
        data,
        ServeMode {
            range: true,
            cut_after: Some(16 * MIB + 12345),
            ..Default::default()
        },
    );
    let ds = DataSourceProc::download(disk.path(), &server.url, &["--expected-checksum", &sum]);
    ds.expect_ready(&sum);
    let sent = server.sent.load(Ordering::Relaxed);
    assert!(
        sent <= 32 * MIB * 12 / 10,
        "fetched {sent} bytes for a {} byte file",
        32 * MIB
    );
    assert_eq!(server.requests.load(Ordering::Relaxed), 2, "one cut, one resume");
    assert_eq!(ds.metric("corral_datasource_download_attempts_total"), 2);
    assert_eq!(ds.metric("corral_datasource_download_restarts_total"), 0);
}

#[test]
fn connection_that_goes_quiet_half_way_is_replaced_and_the_download_resumes() {
    let disk = disk();
    let src = tempfile::tempdir().unwrap();
    let data = raw_image(&src.path().join("a.raw"), 8 * MIB);
    let sum = sha512(&data);
    let server = FileServer::start(
        data,
        ServeMode {
            range: true,
            cut_after: Some(3 * MIB),
            stall: true,
            ..Default::default()
        },
    );
    // No-data limit 6 s: a connection quiet for 2 s is given up and the download resumes on a new one.
    let t = Instant::now();
    let ds = DataSourceProc::download(disk.path(), &server.url, &["--no-data-timeout", "6"]);
    ds.expect_ready(&sum);
    assert!(t.elapsed() < Duration::from_secs(6), "took {:?}", t.elapsed());
    assert_eq!(
        server.requests.load(Ordering::Relaxed),
        2,
        "one stalled, one resumed"
    );
    assert!(server.sent.load(Ordering::Relaxed) <= 8 * MIB * 12 / 10);
}

#[test]
fn connection_cut_without_range_support_restarts_from_zero_and_finishes() {
    let disk = disk();
    let src = tempfile::tempdir().unwrap();
    let data = raw_image(&src.path().join("a.raw"), 16 * MIB);
    let sum = sha512(&data);
    let server = FileServer::start(
        data,
        ServeMode {
            cut_after: Some(8 * MIB),
            ..Default::default()
        },
    );
    let ds = DataSourceProc::download(disk.path(), &server.url, &["--expected-checksum", &sum]);
    ds.expect_ready(&sum);
    assert_eq!(ds.metric("corral_datasource_download_restarts_total"), 1);
    assert!(server.sent.load(Ordering::Relaxed) >= 24 * MIB);
}

#[test]
fn server_that_never_sends_data_fails_after_the_default_30_s() {
    let disk = disk();
    let server = FileServer::start(vec![1; 4096], ServeMode::silent());
    let t = Instant::now();
    let ds = DataSourceProc::download(disk.path(), &server.url, &[]);
    let i = ds.wait_final(Duration::from_secs(60));
    let took = t.elapsed();
    assert_eq!(i.state, FileState::Failed);
    assert!(
        i.message.contains("no data received") && i.message.contains("30 s"),
        "{}",
        i.message
    );
    assert!(
        took >= Duration::from_secs(29) && took < Duration::from_secs(45),
        "failed after {took:?}"
    );
    assert!(
        tmp_entries(disk.path()).is_empty(),
        "{:?}",
        tmp_entries(disk.path())
    );
}

#[test]
fn a_url_whose_port_refuses_connections_fails_naming_the_refusal() {
    let disk = disk();
    // A port that was just free: nothing listens there, so every connect is refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}/image.raw");
    let ds = DataSourceProc::download(disk.path(), &url, &["--no-data-timeout", "4"]);
    let i = ds.wait_final(Duration::from_secs(30));
    assert_eq!(i.state, FileState::Failed);
    assert!(
        i.message.contains("no data received") && i.message.to_lowercase().contains("connection refused"),
        "the message names the refusal: {}",
        i.message
    );
    assert!(
        tmp_entries(disk.path()).is_empty(),
        "{:?}",
        tmp_entries(disk.path())
    );
}

#[test]
fn wrong_expected_checksum_fails_and_leaves_no_file() {
    let disk = disk();
    let server = FileServer::start(vec![7; 3 * MIB as usize], ServeMode::default());
    let wrong = sha512(b"something else");
    let ds = DataSourceProc::download(disk.path(), &server.url, &["--expected-checksum", &wrong]);
    let i = ds.wait_final(Duration::from_secs(60));
    assert_eq!(i.state, FileState::Failed);
    assert!(i.message.contains("checksum mismatch"), "{}", i.message);
    assert!(i.current_checksum.is_empty());
    assert!(
        tmp_entries(disk.path()).is_empty(),
        "{:?}",
        tmp_entries(disk.path())
    );
}

#[test]
fn http_errors_fail_with_the_status_and_unaligned_raw_is_padded_to_sectors_or_v2_blocks() {
    let disk = disk();
    let server = FileServer::start(vec![5; 1000], ServeMode::default());
    let ds = DataSourceProc::download(disk.path(), &format!("{}x", server.url), &[]);
    let i = ds.wait_final(Duration::from_secs(30));
    assert_eq!(i.state, FileState::Failed);
    assert!(i.message.contains("HTTP 404"), "{}", i.message);
    drop(ds);

    let disk = common::disk();
    let sum = sha512(&[5; 1000]);
    let ds = DataSourceProc::download(disk.path(), &server.url, &["--expected-checksum", &sum]);
    let i = ds.wait_final(Duration::from_secs(30));
    assert_eq!(i.state, FileState::ReadyForTransfer, "{i:?}");
    assert_eq!(i.size, 1024);
    assert!(i.message.contains("padded with 24 zero bytes"), "{}", i.message);
    let mut padded = vec![5u8; 1000];
    padded.resize(1024, 0);
    assert_eq!(i.current_checksum, sha512(&padded));
    assert_eq!(std::fs::read(&i.file_path).unwrap(), padded);
    drop(ds);

    // For the v2 engine, to whole 4 KiB blocks: the file is what the first v2 copy (an lvol) holds byte for byte.
    let disk = common::disk();
    let ds = DataSourceProc::download(
        disk.path(),
        &server.url,
        &["--expected-checksum", &sum, "--data-engine", "v2"],
    );
    let i = ds.wait_final(Duration::from_secs(30));
    assert_eq!(i.state, FileState::ReadyForTransfer, "{i:?}");
    assert_eq!(i.size, 4096);
    assert!(
        i.message.contains("padded with 3096 zero bytes") && i.message.contains("4 KiB"),
        "{}",
        i.message
    );
    padded.resize(4096, 0);
    assert_eq!(i.current_checksum, sha512(&padded));
    assert_eq!(std::fs::read(&i.file_path).unwrap(), padded);
}

#[test]
fn transfer_is_refused_until_ready_then_hands_the_file_over() {
    let disk = disk();
    let server = FileServer::start(vec![3; 2 * MIB as usize], ServeMode::silent());
    let ds = DataSourceProc::download(disk.path(), &server.url, &["--no-data-timeout", "2"]);
    let r = ds.post("action=transfer");
    assert_eq!(r.status(), 409);
    assert!(r.text().unwrap().contains("ready-for-transfer"));
    drop(ds);

    let disk = common::disk();
    let server = FileServer::start(vec![3; 2 * MIB as usize], ServeMode::default());
    let ds = DataSourceProc::download(disk.path(), &server.url, &[]);
    let i = ds.wait_final(Duration::from_secs(30));
    assert_eq!(i.state, FileState::ReadyForTransfer);
    let r = ds.post("action=transfer");
    assert_eq!(r.status(), 200);
    assert_eq!(ds.info().state, FileState::Ready);
    assert_eq!(ds.post("action=transfer").status(), 409, "a second transfer");
    assert!(
        Path::new(&i.file_path).exists(),
        "the file stays for the manager to rename"
    );
}

#[test]
fn sigterm_during_a_download_cancels_it_and_removes_the_partial_file() {
    let disk = disk();
    // A server that never answers keeps the job running until the signal.
    let silent = FileServer::start(vec![], ServeMode::silent());
    let ds = DataSourceProc::download(disk.path(), &silent.url, &[]);
    // The state turns `starting` just before the job task creates the work file: wait for both.
    wait_for(
        "state starting with the work file",
        Duration::from_secs(10),
        || {
            (ds.info().state == FileState::Starting && tmp_entries(disk.path()) == ["img-u1.tmp"])
                .then_some(())
        },
    );
    let mut ds = ds;
    let status = ds.terminate(Duration::from_secs(10));
    assert!(
        status.is_some_and(|s| s.success()),
        "not a clean exit within 10 s of SIGTERM: {status:?}"
    );
    assert!(
        tmp_entries(disk.path()).is_empty(),
        "{:?}",
        tmp_entries(disk.path())
    );
}

/// Unmounts on drop.
struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_full_disk_fails_the_download_with_a_clear_message_and_frees_the_space() {
    // A 6 MiB disk (tmpfs, as the toolbox allows on the project's machines) for a 16 MiB image.
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=6M", "tmpfs"])
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(st.success(), "mounting a small tmpfs needs root");
    let _mount = Mount(dir.path().to_path_buf());
    corral_disk::identity::write_disk_config(dir.path(), DISK_UUID).unwrap();
    let server = FileServer::start(vec![0x6b; 16 * MIB as usize], ServeMode::range());
    let ds = DataSourceProc::download(dir.path(), &server.url, &[]);
    let i = ds.wait_final(Duration::from_secs(60));
    assert_eq!(i.state, FileState::Failed);
    assert!(i.message.contains("No space left"), "{}", i.message);
    assert!(i.message.contains("img-u1.tmp"), "{}", i.message);
    assert!(
        tmp_entries(dir.path()).is_empty(),
        "{:?}",
        tmp_entries(dir.path())
    );
}
