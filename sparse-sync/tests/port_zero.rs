//! Many receivers at once on port 0: each binds a port of its own and reports it in its ready file, so parallel
//! tests never probe for free ports (and never race for one).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use testkit::{Daemon, DaemonCommand};

const DAEMONS: usize = 50;

/// One HTTP request to the receiver's API; returns the status line.
fn status_line(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "GET /v1/sync/recorded HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    reply.lines().next().unwrap_or_default().to_owned()
}

#[test]
fn fifty_receivers_on_port_zero_each_report_and_serve_their_own_port() {
    let dir = tempfile::tempdir().unwrap();
    // Started all at once (spawned in parallel threads), each told to bind 127.0.0.1:0.
    let daemons: Vec<Daemon> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..DAEMONS)
            .map(|i| {
                let file = dir.path().join(format!("target-{i}"));
                s.spawn(move || {
                    DaemonCommand::new(env!("CARGO_BIN_EXE_corral-sync"))
                        .label(format!("corral-sync-{i}"))
                        .args([
                            "serve",
                            "--listen",
                            "127.0.0.1:0",
                            "--idle-timeout",
                            "120",
                            "--file",
                        ])
                        .arg(file)
                        .spawn()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });

    let addrs: Vec<SocketAddr> = daemons.iter().map(|d| d.socket_addr("http")).collect();
    let ports: BTreeSet<u16> = addrs.iter().map(SocketAddr::port).collect();
    assert!(!ports.contains(&0), "a daemon reported port 0: {addrs:?}");
    assert_eq!(
        ports.len(),
        DAEMONS,
        "two daemons reported the same port: {addrs:?}"
    );
    let pids: BTreeSet<u32> = daemons.iter().map(Daemon::pid).collect();
    assert_eq!(
        pids.len(),
        DAEMONS,
        "ready files name {} distinct pids",
        pids.len()
    );

    // Each reported address is that daemon's live receiver: its HTTP API answers there.
    for (d, addr) in daemons.iter().zip(&addrs) {
        let line = status_line(*addr);
        assert!(
            line.starts_with("HTTP/1.1 "),
            "{addr}: {line:?}\n{}",
            d.log_text()
        );
    }
}
