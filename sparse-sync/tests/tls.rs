//! Issue 40: the sync protocol under mutual TLS, between real `corral-sync` processes and the library's sender.
//! A receiver given `--tls-dir` refuses at the handshake every client without a certificate of its cluster (none
//! at all, plaintext, another cluster's CA, expired), garbage and truncated handshakes, and outlasts a client that
//! connects and stalls; it logs the refusals once for the address and its target file is unchanged by all of them.
//! A sender with the cluster's certificate then transfers a sparse file that arrives identical, holes kept; a
//! receiver whose certificate names another host is refused by the sender.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use corral_disk::sparse::{FileContent, LayoutMode};
use sparse_sync::{CancellationToken, Progress, SendError, SendOptions};
use testkit::{Daemon, DaemonCommand, TestPki};

const BIN: &str = env!("CARGO_BIN_EXE_corral-sync");
const SIZE: u64 = 8 << 20;

fn receiver(target: &Path, tls_dir: &Path) -> Daemon {
    DaemonCommand::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--idle-timeout",
            "120",
            "--file",
        ])
        .arg(target)
        .arg("--tls-dir")
        .arg(tls_dir)
        .spawn()
}

/// Sends `src` with the library's sender, no retries.
async fn send(
    src: &Path,
    to: SocketAddr,
    tls: Option<Arc<corral_tls::rustls::ClientConfig>>,
) -> Result<(), SendError> {
    let content = FileContent::open(src, LayoutMode::SeekData).unwrap();
    let opts = SendOptions {
        retries: 0,
        tls,
        ..SendOptions::default()
    };
    sparse_sync::send(
        Arc::new(content),
        &to.to_string(),
        &opts,
        &Progress::new(),
        &CancellationToken::new(),
    )
    .await
    .map(|_| ())
}

/// Writes `bytes` on a fresh connection, ends it there, and waits (bounded) until the receiver closes it without
/// a reply.
fn closed_without_reply(addr: SocketAddr, bytes: &[u8]) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(bytes).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let mut reply = Vec::new();
    // A reset is a close too; what must not come is an HTTP answer.
    let _ = s.read_to_end(&mut reply);
    assert!(
        !String::from_utf8_lossy(&reply).contains("HTTP/"),
        "the receiver answered {} bytes in plaintext",
        reply.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_are_refused_at_the_handshake_and_an_authorized_sparse_transfer_arrives_identical() {
    let dir = scratch_dir();
    let pki = TestPki::new(dir.path());
    let src = dir.path().join("src");
    let target = dir.path().join("target");
    let ranges = random_sparse_file(&src, SIZE, 256 << 10, 40);
    random_sparse_file(&target, SIZE / 2, 64 << 10, 41);
    let target_before = sha256_file(&target);

    let r = receiver(&target, &pki.node("receiver"));
    let addr = r.socket_addr("http");
    for (what, tls) in pki.strangers() {
        let err = send(&src, addr, tls).await.err();
        assert!(err.is_some(), "a sender with {what} was let in");
    }
    // A plaintext request, garbage, and the first bytes of a ClientHello cut short: closed, never answered.
    closed_without_reply(
        addr,
        b"POST /v1/sync/open HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    );
    closed_without_reply(addr, &[0x5a; 4096]);
    closed_without_reply(addr, &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00]);
    // A client that connects and says nothing holds its handshake task only; everyone else is served meanwhile.
    let _stalled = TcpStream::connect(addr).unwrap();

    assert_eq!(
        sha256_file(&target),
        target_before,
        "a refused sender changed the target"
    );
    assert!(
        !path_with_suffix(&target, ".sync-partial").exists(),
        "a refused sender opened a transfer"
    );
    wait_for(
        "the refusal in the receiver's log",
        Duration::from_secs(10),
        || r.log_text().contains("TLS handshake refused").then_some(()),
    );

    let out = Command::new(BIN)
        .args(["--json", "send", "--file"])
        .arg(&src)
        .args(["--to", &addr.to_string(), "--tls-dir"])
        .arg(pki.node("sender"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "authorized send: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        sha256_file(&target),
        sha256_file(&src),
        "the target is not the source"
    );
    assert_eq!(data_extents(&target), data_extents(&src), "holes were not kept");
    assert!(data_bytes(&ranges) < SIZE, "the source has no holes");

    let log = r.log_text();
    assert_eq!(
        log.matches("TLS handshake refused").count(),
        1,
        "refusals from one address are logged once: {log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_refuses_a_receiver_whose_certificate_names_another_host() {
    let dir = scratch_dir();
    let pki = TestPki::new(dir.path());
    let src = dir.path().join("src");
    let target = dir.path().join("target");
    random_sparse_file(&src, SIZE, 256 << 10, 42);
    std::fs::write(&target, b"kept").unwrap();

    let r = receiver(&target, &pki.misnamed());
    let client = TestPki::client(&pki.node("sender"));
    let err = send(&src, r.socket_addr("http"), Some(client)).await.unwrap_err();
    // The error and its sources, one line.
    let err = format!("{:#}", anyhow::Error::from(err));
    assert!(err.contains("not valid for name"), "{err}");
    assert_eq!(std::fs::read(&target).unwrap(), b"kept");
}
