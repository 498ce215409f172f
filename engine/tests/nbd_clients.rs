//! The NBD frontend driven by real clients: qemu-io, qemu-img, nbdinfo, nbdcopy, fio and libnbd (python).
#![allow(clippy::cast_possible_truncation)] // sizes and counts here are small test constants

mod nbd_support;

use nbd_support::{MIB, TestServer, run, run_ok};

fn qemu_io_args<'a>(uri: &'a str, cmds: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["-f", "raw", uri];
    for c in cmds {
        args.extend(["-c", c]);
    }
    args
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_io_reads_back_patterns_it_wrote_over_unix_and_tcp() {
    let server = TestServer::with_size(32 * MIB).await;
    for (uri, offset) in [(server.unix_uri(), "0"), (server.tcp_uri(), "4M")] {
        let write = format!("write -P 0xab {offset} 1M");
        let read = format!("read -P 0xab {offset} 1M");
        run_ok("qemu-io", &qemu_io_args(&uri, &[&write, &read])).await;

        let wrong = format!("read -P 0xcd {offset} 1M");
        let out = run("qemu-io", &qemu_io_args(&uri, &[&wrong])).await;
        assert!(!out.status.success(), "a mismatching pattern must fail");
        assert!(String::from_utf8_lossy(&out.stdout).contains("Pattern verification failed"));
    }
    let content = server.device.snapshot();
    assert!(content[..MIB as usize].iter().all(|&b| b == 0xab));
    assert!(
        content[4 * MIB as usize..5 * MIB as usize]
            .iter()
            .all(|&b| b == 0xab)
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_img_convert_of_the_export_equals_the_written_content() {
    let server = TestServer::with_size(16 * MIB).await;
    let uri = server.unix_uri();
    run_ok(
        "qemu-io",
        &qemu_io_args(
            &uri,
            &[
                "write -P 0x11 0 64k",
                "write -P 0x22 3M 1M",
                "write -P 0x33 16320k 64k",
            ],
        ),
    )
    .await;
    let out = server.dir.path().join("export.raw");
    let out_s = out.to_str().expect("utf-8 path");
    run_ok(
        "qemu-img",
        &["convert", "-f", "raw", "-O", "raw", &server.tcp_uri(), out_s],
    )
    .await;

    let copied = std::fs::read(&out).expect("read converted image");
    let mut expected = vec![0u8; 16 * MIB as usize];
    expected[..64 << 10].fill(0x11);
    expected[3 * MIB as usize..4 * MIB as usize].fill(0x22);
    expected[(16 * MIB - (64 << 10)) as usize..].fill(0x33);
    assert!(
        copied == expected,
        "converted image differs from what was written"
    );
    assert!(server.device.snapshot() == expected);
    run_ok("qemu-img", &["compare", "-f", "raw", "-F", "raw", out_s, &uri]).await;
    server.stop().await;
}

/// `nbdinfo --map` lines: (offset, length, base:allocation type).
fn parse_map(text: &str) -> Vec<(u64, u64, u32)> {
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (
                f[0].parse().expect("offset"),
                f[1].parse().expect("length"),
                f[2].parse().expect("type"),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_map_shows_holes_where_nothing_was_written_and_data_where_written() {
    let server = TestServer::with_size(16 * MIB).await;
    let uri = server.unix_uri();
    run_ok(
        "qemu-io",
        &qemu_io_args(
            &uri,
            &[
                "write -P 0x5a 0 1M",
                "write -P 0x5a 8M 64k",
                "write -z 12M 1M",
                "write -z -u 13M 64k",
                "discard 0 64k",
            ],
        ),
    )
    .await;
    // `write -z` sends WRITE_ZEROES with NO_HOLE (allocated zeros); `-u` lets the device punch a hole;
    // `discard` is TRIM.
    let map = parse_map(&run_ok("nbdinfo", &["--map", &uri]).await);
    let kib = 1024;
    assert_eq!(
        map,
        vec![
            (0, 64 * kib, 3),
            (64 * kib, MIB - 64 * kib, 0),
            (MIB, 7 * MIB, 3),
            (8 * MIB, 64 * kib, 0),
            (8 * MIB + 64 * kib, 4 * MIB - 64 * kib, 3),
            (12 * MIB, MIB, 2),
            (13 * MIB, 3 * MIB, 3),
        ]
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_lists_the_export_and_describes_it_as_json() {
    let server = TestServer::with_size(8 * MIB).await;
    let default_export = format!("nbd+unix:///?socket={}", server.socket.display());
    let list = run_ok("nbdinfo", &["--list", &default_export]).await;
    assert!(list.contains("export=\"vol0\""), "{list}");

    let json = run_ok("nbdinfo", &["--json", &server.tcp_uri()]).await;
    let v: serde_json::Value = serde_json::from_str(&json).expect("nbdinfo --json output");
    let export = &v["exports"][0];
    assert_eq!(v["protocol"], "newstyle-fixed");
    assert_eq!(v["structured"], true);
    assert_eq!(export["export-name"], "vol0");
    assert_eq!(export["export-size"], 8 * MIB);
    assert_eq!(export["can_multi_conn"], true);
    assert_eq!(export["can_flush"], true);
    assert_eq!(export["can_fua"], true);
    assert_eq!(export["can_trim"], true);
    assert_eq!(export["can_zero"], true);
    assert_eq!(export["is_read_only"], false);
    assert_eq!(export["block_size_minimum"], 1);
    assert_eq!(export["block_size_preferred"], 4096);
    assert_eq!(export["block_size_maximum"], 16 * MIB);
    assert_eq!(export["contexts"][0], "base:allocation");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fio_random_read_write_with_crc32c_verification_passes() {
    let server = TestServer::with_size(16 * MIB).await;
    for uri in [server.unix_uri(), server.tcp_uri()] {
        let uri_arg = format!("--uri={uri}");
        let out = run_ok(
            "fio",
            &[
                "--name=verify",
                "--ioengine=nbd",
                &uri_arg,
                "--rw=randrw",
                "--bs=4k",
                "--size=8M",
                "--iodepth=16",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_state_save=0",
            ],
        )
        .await;
        assert!(out.contains("err= 0"), "{out}");
    }
    let c = &server.counters;
    assert!(c.write.requests.load(std::sync::atomic::Ordering::Relaxed) > 0);
    assert_eq!(c.read.errors.load(std::sync::atomic::Ordering::Relaxed), 0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_and_multi_connection_copies_all_land() {
    let server = TestServer::with_size(32 * MIB).await;
    // Four qemu-io processes at once, on both transports, each on its own region.
    let uris = [server.unix_uri(), server.tcp_uri()];
    let mut writers = Vec::new();
    for i in 0..4u64 {
        let uri = uris[(i % 2) as usize].clone();
        writers.push(tokio::spawn(async move {
            let w = format!("write -P {} {}M 2M", 0x40 + i, 16 + 2 * i);
            let r = format!("read -P {} {}M 2M", 0x40 + i, 16 + 2 * i);
            run_ok("qemu-io", &qemu_io_args(&uri, &[&w, &r])).await
        }));
    }
    for w in writers {
        w.await.expect("qemu-io task");
    }

    // nbdcopy uses several connections only because the server advertises CAN_MULTI_CONN (and no more
    // connections than threads).
    let src = server.dir.path().join("src.raw");
    let data: Vec<u8> = (0..8 * MIB as usize).map(|i| (i * 7 + i / 4096) as u8).collect();
    std::fs::write(&src, &data).expect("write source");
    let before = server
        .counters
        .connections_accepted
        .load(std::sync::atomic::Ordering::Relaxed);
    run_ok(
        "nbdcopy",
        &[
            "--connections=4",
            "--threads=4",
            "--requests=8",
            src.to_str().expect("utf-8"),
            &server.unix_uri(),
        ],
    )
    .await;
    let copies = server
        .counters
        .connections_accepted
        .load(std::sync::atomic::Ordering::Relaxed)
        - before;
    assert!(copies >= 4, "nbdcopy opened {copies} connections");

    let content = server.device.snapshot();
    assert!(content[..8 * MIB as usize] == data[..], "nbdcopy content differs");
    for i in 0..4u64 {
        let start = ((16 + 2 * i) * MIB) as usize;
        assert!(
            content[start..start + 2 * MIB as usize]
                .iter()
                .all(|&b| u64::from(b) == 0x40 + i)
        );
    }
    server.stop().await;
}

const PAST_END_SCRIPT: &str = r#"
import errno, sys, nbd
h = nbd.NBD()
h.set_strict_mode(0)  # let invalid requests reach the server
h.connect_uri(sys.argv[1])
size = h.get_size()
for what, call, want in [
    ("read past end", lambda: h.pread(4096, size - 512), errno.EINVAL),
    ("write past end", lambda: h.pwrite(b"x" * 4096, size - 512), errno.ENOSPC),
    ("trim past end", lambda: h.trim(4096, size), errno.EINVAL),
    ("zero past end", lambda: h.zero(4096, size), errno.ENOSPC),
    ("zero-length read", lambda: h.pread(0, 0), errno.EINVAL),
]:
    try:
        call()
        sys.exit(f"{what}: no error")
    except nbd.Error as e:
        if e.errno not in (want, errno.errorcode[want]):
            sys.exit(f"{what}: got {e.errno}, want {errno.errorcode[want]}: {e}")
h.pwrite(b"\x5a" * 4096, 8192)
assert h.pread(4096, 8192) == b"\x5a" * 4096
h.flush()
h.shutdown()
print("connection still works")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libnbd_requests_past_the_end_fail_and_the_connection_keeps_working() {
    let server = TestServer::with_size(4 * MIB).await;
    for uri in [server.unix_uri(), server.tcp_uri()] {
        let out = run_ok("/usr/bin/python3", &["-c", PAST_END_SCRIPT, &uri]).await;
        assert!(out.contains("connection still works"), "{out}");
    }
    assert!(server.device.flush_count() >= 2);
    server.stop().await;
}
