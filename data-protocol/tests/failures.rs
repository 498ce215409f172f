//! Hostile peers and dying peers: what the server drops, what the client reports, and how fast.

mod common;

use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use common::{KillableServer, MemBackend, TestServer};
use data_protocol::{
    ClientConfig, ClientError, DataClient, ErrorKind, FrameHeader, FrameKind, HEADER_LEN, MAX_IO,
    ServerConfig, VERSION,
};
use testkit::wait_for_async;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MIB: usize = 1 << 20;

fn hello(version: u32) -> [u8; HEADER_LEN] {
    FrameHeader::new(FrameKind::Hello, 1, 0, version).encode()
}

/// Reads until the server closes the connection; returns the bytes it sent first.
async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("server should close the connection")
            .unwrap_or(0);
        if n == 0 {
            return got;
        }
        got.extend_from_slice(&buf[..n]);
    }
}

/// Sends `frames` on a raw connection, checks the server drops it, and that a client connected to the
/// same server before and after keeps working.
async fn assert_dropped_while_others_keep_working(frames: &[u8]) {
    let backend = MemBackend::new(MIB);
    let server = TestServer::tcp(backend, ServerConfig::default()).await;
    let client = DataClient::connect(&server.addr, ClientConfig::default())
        .await
        .unwrap();
    client.write(0, &[5; 4096]).await.unwrap();

    let mut raw = TcpStream::connect(&server.addr).await.unwrap();
    raw.write_all(frames).await.unwrap();
    read_until_closed(&mut raw).await;
    wait_for_async(
        "one protocol violation counted",
        Duration::from_secs(5),
        async || (server.metrics.snapshot().protocol_violations == 1).then_some(()),
    )
    .await;

    let mut buf = [0u8; 4096];
    client.read(0, &mut buf).await.unwrap();
    assert_eq!(buf, [5; 4096]);
    let late = DataClient::connect(&server.addr, ClientConfig::default())
        .await
        .unwrap();
    late.ping().await.unwrap();
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drops_connection_on_wrong_magic_and_keeps_serving_others() {
    let mut frame = hello(u32::from(VERSION));
    frame[..4].copy_from_slice(b"NOPE");
    assert_dropped_while_others_keep_working(&frame).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drops_connection_on_oversized_length_and_keeps_serving_others() {
    let mut frames = hello(u32::from(VERSION)).to_vec();
    frames.extend(FrameHeader::new(FrameKind::Read, 2, 0, MAX_IO + 1).encode());
    assert_dropped_while_others_keep_working(&frames).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drops_connection_on_other_violations_and_keeps_serving_others() {
    let ok_hello = hello(u32::from(VERSION));
    let with_hello = |tail: [u8; HEADER_LEN]| [ok_hello, tail].concat();
    let mut bad_version = ok_hello;
    bad_version[4] = 9;
    let mut unknown_kind = FrameHeader::new(FrameKind::Ping, 2, 0, 0).encode();
    unknown_kind[6] = 0x7f;
    let mismatched_write = FrameHeader {
        kind: FrameKind::Write,
        id: 2,
        offset: 0,
        length: 8,
        payload_len: 4,
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("wrong header version", bad_version.to_vec()),
        ("unknown kind", with_hello(unknown_kind)),
        ("write payload mismatch", with_hello(mismatched_write.encode())),
        (
            "io before hello",
            FrameHeader::new(FrameKind::Read, 1, 0, 512).encode().to_vec(),
        ),
        (
            "reply kind from a client",
            with_hello(FrameHeader::new(FrameKind::Ok, 2, 0, 0).encode()),
        ),
        ("second hello", with_hello(hello(u32::from(VERSION)))),
        ("truncated header then close", ok_hello[..20].to_vec()),
    ];
    for (name, frames) in cases {
        eprintln!("case: {name}");
        if name.starts_with("truncated") {
            // Closing mid-header is a dead peer, not a violation; just make sure the server copes.
            let backend = MemBackend::new(MIB);
            let server = TestServer::tcp(backend, ServerConfig::default()).await;
            let mut raw = TcpStream::connect(&server.addr).await.unwrap();
            raw.write_all(&frames).await.unwrap();
            drop(raw);
            let client = DataClient::connect(&server.addr, ClientConfig::default())
                .await
                .unwrap();
            client.ping().await.unwrap();
            server.stop().await;
            continue;
        }
        assert_dropped_while_others_keep_working(&frames).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_hello_with_another_protocol_version_with_an_error_then_closes() {
    let backend = MemBackend::new(MIB);
    let server = TestServer::tcp(backend, ServerConfig::default()).await;
    let mut raw = TcpStream::connect(&server.addr).await.unwrap();
    raw.write_all(&hello(u32::from(VERSION) + 1)).await.unwrap();
    let reply = read_until_closed(&mut raw).await;
    let header = FrameHeader::decode_slice(&reply).unwrap();
    assert_eq!(header.kind, FrameKind::Error);
    assert_eq!(header.length, ErrorKind::Invalid.code());
    let message = String::from_utf8_lossy(&reply[HEADER_LEN..]);
    assert!(message.contains("version"), "{message}");
    assert_eq!(reply.len(), HEADER_LEN + header.payload_usize());
    server.stop().await;
}

#[test]
fn server_killed_mid_request_fails_pending_and_later_requests_with_disconnected() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let backend = MemBackend::new(MIB);
    let mut server = KillableServer::tcp(backend.clone(), ServerConfig::default());
    rt.block_on(async {
        // A long timeout proves the failure comes from the lost connection, not the deadline.
        let cfg = ClientConfig {
            request_timeout: Duration::from_secs(60),
            ..ClientConfig::default()
        };
        let client = DataClient::connect(&server.addr, cfg).await.unwrap();
        backend.close_gate();
        let c = client.clone();
        let pending = tokio::spawn(async move { c.write(0, &[1; 4096]).await });
        wait_for_async(
            "backend.inside.load(SeqCst) == 1",
            Duration::from_secs(5),
            async || (backend.inside.load(SeqCst) == 1).then_some(()),
        )
        .await;
        let started = Instant::now();
        server.kill();
        let err = tokio::time::timeout(Duration::from_secs(5), pending)
            .await
            .expect("no hang")
            .unwrap();
        assert!(matches!(err, Err(ClientError::Disconnected(_))), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
        let later = client.read(0, &mut [0u8; 512]).await;
        assert!(matches!(later, Err(ClientError::Disconnected(_))), "{later:?}");
        assert!(client.failure().is_some());
    });
    backend.open_gate();
}

#[test]
fn idle_client_notices_a_dead_server_through_pings() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let backend = MemBackend::new(MIB);
    let mut server = KillableServer::tcp(backend, ServerConfig::default());
    rt.block_on(async {
        let cfg = ClientConfig {
            ping_interval: Duration::from_millis(50),
            ..ClientConfig::default()
        };
        let client = DataClient::connect(&server.addr, cfg).await.unwrap();
        assert!(client.failure().is_none());
        server.kill();
        wait_for_async("client.failure().is_some()", Duration::from_secs(5), async || {
            (client.failure().is_some()).then_some(())
        })
        .await;
        let err = client.ping().await.unwrap_err();
        assert!(matches!(err, ClientError::Disconnected(_)), "{err:?}");
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeout_fires_and_fails_the_client() {
    let backend = MemBackend::new(MIB);
    let server = TestServer::tcp(backend.clone(), ServerConfig::default()).await;
    let cfg = ClientConfig {
        request_timeout: Duration::from_millis(300),
        ..ClientConfig::default()
    };
    let client = DataClient::connect(&server.addr, cfg).await.unwrap();
    backend.close_gate();
    let started = Instant::now();
    let (a, b) = tokio::join!(client.write(0, &[1; 512]), client.flush());
    assert!(matches!(a, Err(ClientError::Timeout)), "{a:?}");
    assert!(matches!(b, Err(ClientError::Timeout)), "{b:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    let later = Instant::now();
    assert!(matches!(client.ping().await, Err(ClientError::Timeout)));
    assert!(
        later.elapsed() < Duration::from_millis(100),
        "a failed client answers at once"
    );
    backend.open_gate();
    client.close().await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_a_closed_port_is_an_io_error() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    drop(listener);
    let err = DataClient::connect(&addr, ClientConfig::default())
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Io(_)), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_asking_to_drop_the_connection_fails_the_client_with_disconnected_and_others_keep_working() {
    let backend = MemBackend::new(MIB);
    let server = TestServer::tcp(backend.clone(), ServerConfig::default()).await;
    let cfg = ClientConfig {
        connections: 1,
        ..ClientConfig::default()
    };
    let victim = DataClient::connect(&server.addr, cfg.clone()).await.unwrap();
    let bystander = DataClient::connect(&server.addr, cfg).await.unwrap();
    backend.drop_connection_on_write.store(true, SeqCst);
    let started = Instant::now();
    let err = victim.write(0, &[1; 4096]).await.unwrap_err();
    assert!(matches!(err, ClientError::Disconnected(_)), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "not a timeout");
    assert!(victim.failure().is_some());
    bystander.read(0, &mut [0u8; 4096]).await.unwrap();
    backend.drop_connection_on_write.store(false, SeqCst);
    bystander.write(0, &[2; 4096]).await.unwrap();
    assert_eq!(server.metrics.snapshot().protocol_violations, 0);
    server.stop().await;
}
