//! `upload` with real `curl -F file=@image`, and uploads that go wrong: another size than announced, a client
//! that disconnects half way, a second upload while one runs, uploads the source does not take.

// Test sizes are a few MiB: casts to usize cannot truncate.
#![allow(clippy::cast_possible_truncation)]

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use data_source::FileState;

const MIB: u64 = 1 << 20;

/// `curl -F file=@path` to `/v1/file?{query}`; returns (HTTP status, body).
fn curl_upload(ds: &DataSourceProc, path: &Path, query: &str) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-sS", "-o", "-", "-w", "\n%{http_code}", "-F"])
        .arg(format!("file=@{}", path.display()))
        .arg(format!("{}/v1/file?{query}", ds.base))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// Peak resident memory of a process (VmHWM), bytes.
/// `VmHWM` (peak) or `VmRSS` (now) of a process, in bytes.
fn rss(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .unwrap()
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    kb * 1024
}

/// A sparse image: `size` bytes, 1 MiB of pattern every 64 MiB.
fn sparse_image(path: &Path, size: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    let block: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8 + 1).collect();
    let mut off = 0;
    while off < size {
        f.write_all_at(&block[..usize::try_from(MIB.min(size - off)).unwrap()], off)
            .unwrap();
        off += 64 * MIB;
    }
}

fn upload_streams_to_disk_in_bounded_memory(size: u64) {
    let disk = disk();
    let src = tempfile::tempdir_in("/var/tmp").unwrap();
    let img = src.path().join("big.raw");
    sparse_image(&img, size);
    let sum = sha512_file(&img);
    let ds = DataSourceProc::start(disk.path(), "upload", &["--expected-checksum", &sum]);
    let i = ds.info();
    assert_eq!(
        i.state,
        FileState::Pending,
        "an upload source waits for its upload"
    );
    // The daemon's own footprint (binary pages, runtime) before any data: the upload may add a bounded amount.
    let idle = rss(ds.pid(), "VmRSS:");
    let t = Instant::now();
    let (code, body) = curl_upload(&ds, &img, &format!("action=upload&size={size}"));
    assert_eq!(code, 200, "{body}");
    let i = ds.expect_ready(&sum);
    eprintln!("uploaded {size} bytes in {:?}", t.elapsed());
    assert_eq!(i.size, size);
    assert!(
        i.real_size < size / 8,
        "zero blocks were written: {}",
        i.real_size
    );
    // Buffering the upload would grow the peak by at least the image's size; streaming grows it by the runtime, the
    // binary's pages first touched and a few pieces (25-52 MiB measured on the debug build). Half the image's size
    // tells the two apart; an absolute 64 MiB bound on the peak failed once at exactly 64.
    let peak = rss(ds.pid(), "VmHWM:");
    let growth = peak.saturating_sub(idle);
    assert!(
        growth < size / 2,
        "peak RSS {} MiB, {} MiB over the idle {} MiB, while uploading {} MiB",
        peak / MIB,
        growth / MIB,
        idle / MIB,
        size / MIB
    );
    eprintln!("peak RSS of the data source: {} MiB", peak / MIB);
}

#[test]
fn curl_upload_of_a_sparse_image_is_ready_in_bounded_memory() {
    // 384 MiB: buffering would grow the peak by 384, streaming grows it by 25-64 (64 measured once under CI load,
    // which failed the 128 MiB upload's half-size bound of 64); the bound of 192 tells them apart with room.
    upload_streams_to_disk_in_bounded_memory(384 * MIB);
}

#[test]
#[ignore = "1 GiB upload: run with --run-ignored"]
fn curl_upload_of_a_1_gib_sparse_image_stays_under_64_mib_rss() {
    upload_streams_to_disk_in_bounded_memory(1 << 30);
}

#[test]
fn upload_of_another_size_than_announced_fails_and_removes_the_file() {
    let disk = disk();
    let src = tempfile::tempdir().unwrap();
    let img = src.path().join("a.raw");
    std::fs::write(&img, vec![1u8; 3 * MIB as usize]).unwrap();
    for size in [2 * MIB, 4 * MIB] {
        let ds = DataSourceProc::start(disk.path(), "upload", &[]);
        let (code, body) = curl_upload(&ds, &img, &format!("action=upload&size={size}"));
        assert_eq!(code, 400, "{body}");
        assert!(body.contains("size mismatch"), "{body}");
        let i = ds.info();
        assert_eq!(i.state, FileState::Failed);
        assert!(i.message.contains("size mismatch"), "{}", i.message);
        assert!(
            tmp_entries(disk.path()).is_empty(),
            "{:?}",
            tmp_entries(disk.path())
        );
    }
}

/// Starts a multipart upload by hand and sends `bytes` of file data, leaving the body unfinished.
fn partial_upload(ds: &DataSourceProc, size: u64, bytes: usize) -> TcpStream {
    let mut s = TcpStream::connect(ds.addr).unwrap();
    let boundary = "XyZboundary";
    let part_head = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.raw\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n"
    );
    let total = part_head.len() as u64 + size + format!("\r\n--{boundary}--\r\n").len() as u64;
    write!(
        s,
        "POST /v1/file?action=upload&size={size} HTTP/1.1\r\nHost: {}\r\n\
         Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {total}\r\n\r\n{part_head}",
        ds.addr
    )
    .unwrap();
    s.write_all(&vec![0x5au8; bytes]).unwrap();
    s.flush().unwrap();
    s
}

#[test]
fn client_disconnect_mid_upload_fails_and_removes_the_file() {
    let disk = disk();
    let ds = DataSourceProc::start(disk.path(), "upload", &[]);
    let conn = partial_upload(&ds, 16 * MIB, 3 * MIB as usize);
    ds.wait_state(FileState::InProgress);
    assert_eq!(tmp_entries(disk.path()), vec!["img-u1.tmp".to_owned()]);
    drop(conn);
    let i = ds.wait_final(Duration::from_secs(20));
    assert_eq!(i.state, FileState::Failed);
    assert!(i.message.contains("upload"), "{}", i.message);
    assert!(
        tmp_entries(disk.path()).is_empty(),
        "{:?}",
        tmp_entries(disk.path())
    );
}

#[test]
fn second_upload_while_one_runs_is_refused_and_changes_nothing() {
    let disk = disk();
    let src = tempfile::tempdir().unwrap();
    let img = src.path().join("a.raw");
    std::fs::write(&img, vec![1u8; MIB as usize]).unwrap();
    let ds = DataSourceProc::start(disk.path(), "upload", &[]);
    let conn = partial_upload(&ds, 8 * MIB, 2 * MIB as usize);
    ds.wait_state(FileState::InProgress);
    let before = ds.info();
    let (code, body) = curl_upload(&ds, &img, &format!("action=upload&size={MIB}"));
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("in-progress"), "{body}");
    let after = ds.info();
    assert_eq!((after.state, after.size), (before.state, before.size));
    assert_eq!(tmp_entries(disk.path()), vec!["img-u1.tmp".to_owned()]);
    drop(conn);
}

#[test]
fn uploads_the_source_cannot_take_are_refused_with_4xx_and_change_nothing() {
    let disk = disk();
    let src = tempfile::tempdir().unwrap();
    let img = src.path().join("a.raw");
    std::fs::write(&img, vec![1u8; 4096]).unwrap();

    // An upload source: no size, a bad size, no multipart body, an unknown action.
    let ds = DataSourceProc::start(disk.path(), "upload", &[]);
    for (query, want) in [
        ("action=upload", "size"),
        ("action=upload&size=abc", "size"),
        ("action=upload&size=0", "size"),
        ("action=fly", "unknown action"),
        ("", "action"),
    ] {
        let (code, body) = curl_upload(&ds, &img, query);
        assert_eq!(code, 400, "{query}: {body}");
        assert!(body.contains(want), "{query}: {body}");
    }
    let r = ds.post("action=upload&size=4096");
    assert_eq!(r.status(), 400, "not multipart");
    assert_eq!(
        ds.info().state,
        FileState::Pending,
        "still waiting for its upload"
    );
    assert!(tmp_entries(disk.path()).is_empty());
    // It still takes a proper upload after all that.
    let (code, body) = curl_upload(&ds, &img, "action=upload&size=4096");
    assert_eq!(code, 200, "{body}");
    ds.expect_ready(&sha512(&[1u8; 4096]));
    drop(ds);

    // A download source takes no upload, while it runs or before it has any data.
    let disk = common::disk();
    let silent = FileServer::start(vec![], ServeMode::silent());
    let ds = DataSourceProc::download(disk.path(), &silent.url, &[]);
    let (code, body) = curl_upload(&ds, &img, "action=upload&size=4096");
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("download"), "{body}");
    assert_eq!(ds.info().state, FileState::Starting);
    // The download makes its temp file once it starts; under load that can come after the refusal above.
    testkit::wait_for("the download's temp file", Duration::from_secs(30), || {
        let entries = tmp_entries(disk.path());
        (!entries.is_empty()).then_some(entries)
    });
    assert_eq!(tmp_entries(disk.path()), vec!["img-u1.tmp".to_owned()]);
    assert_eq!(ds.info().state, FileState::Starting, "still waiting for data");
}
