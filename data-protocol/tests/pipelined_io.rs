//! Data path behaviour through a real server and client: correctness under concurrency, reply matching,
//! error mapping, backpressure and shutdown.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use common::{MemBackend, SECTOR, TestServer};
use data_protocol::{ClientConfig, ClientError, DataClient, ErrorKind, ServerConfig};
use testkit::{TestRng, wait_for_async};

const MIB: usize = 1 << 20;

fn client_cfg() -> ClientConfig {
    ClientConfig {
        request_timeout: Duration::from_secs(20),
        ..ClientConfig::default()
    }
}

/// Tasks own disjoint regions, so each task's model is exact while all of them share the connections.
async fn concurrent_io_matches_model(server: &TestServer, backend: &MemBackend) {
    concurrent_io_matches_model_with(server, backend, client_cfg()).await;
}

async fn concurrent_io_matches_model_with(server: &TestServer, backend: &MemBackend, cfg: ClientConfig) {
    const TASKS: u64 = 16;
    const REGION: u64 = 256 << 10;
    let client = DataClient::connect(&server.addr, cfg).await.unwrap();
    assert_eq!(client.info().size, 4 * MIB as u64);
    assert_eq!(client.info().sector_size, SECTOR);
    assert_eq!(client.info().name, "vol-test");
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let base = t * REGION;
            let mut model = vec![0u8; usize::try_from(REGION).unwrap()];
            let mut rng = TestRng::new(t + 1);
            for _ in 0..60 {
                let off = rng.below(REGION - 1) & !511;
                let len = (1 + rng.below((REGION - off).min(64 << 10) / 512)) * 512;
                let (o, l) = (usize::try_from(off).unwrap(), usize::try_from(len).unwrap());
                if rng.below(2) == 0 {
                    let fill: Vec<u8> = (0..l).map(|_| u8::try_from(rng.below(256)).unwrap()).collect();
                    client.write(base + off, &fill).await.unwrap();
                    model[o..o + l].copy_from_slice(&fill);
                } else {
                    let mut got = vec![0u8; l];
                    client.read(base + off, &mut got).await.unwrap();
                    assert_eq!(got, model[o..o + l], "task {t} read {off}+{len}");
                }
            }
            model
        }));
    }
    let mut whole = Vec::new();
    for t in tasks {
        whole.extend(t.await.unwrap());
    }
    client.flush().await.unwrap();
    assert_eq!(backend.snapshot()[..whole.len()], whole[..]);
    let m = server.metrics.snapshot();
    assert!(m.requests >= TASKS * 60);
    assert!(m.bytes_written > 0 && m.bytes_read > 0);
    assert_eq!(m.protocol_violations, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reads_and_writes_from_many_tasks_match_a_model_over_tcp() {
    let backend = MemBackend::new(4 * MIB);
    let server = TestServer::tcp(backend.clone(), ServerConfig::default()).await;
    concurrent_io_matches_model(&server, &backend).await;
    server.stop().await;
}

/// Mutual TLS (a real handshake, certificates from `corral-tls`): the reading side and the writers of a connection
/// (batch writer; with an IO pool, the pool's workers) share one TLS session; IO up to 64 KiB from 16 tasks over
/// two connections still matches the model, with and without an IO pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reads_and_writes_from_many_tasks_match_a_model_over_mutual_tls() {
    let tmp = tempfile::tempdir().unwrap();
    let ca = corral_tls::ClusterCa::generate("test", 1).unwrap();
    let sans = vec![corral_tls::SubjectAltName::Ip("127.0.0.1".parse().unwrap())];
    ca.issue(&corral_tls::LeafRequest::new("node", sans, 1))
        .unwrap()
        .write(tmp.path())
        .unwrap();
    let tls = corral_tls::TlsDir::load(tmp.path()).unwrap();
    for io_pool in [None, Some(data_protocol::IoPool::new(4).unwrap())] {
        let backend = MemBackend::new(4 * MIB);
        let cfg = ServerConfig {
            tls: Some(Arc::new(tls.server_config().unwrap())),
            io_pool,
            ..ServerConfig::default()
        };
        let server = TestServer::tcp(backend.clone(), cfg).await;
        let client = ClientConfig {
            tls: Some(Arc::new(tls.client_config().unwrap())),
            ..client_cfg()
        };
        concurrent_io_matches_model_with(&server, &backend, client).await;
        // Without TLS the server lets nothing in.
        assert!(DataClient::connect(&server.addr, client_cfg()).await.is_err());
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reads_and_writes_from_many_tasks_match_a_model_over_a_unix_socket() {
    let backend = MemBackend::new(4 * MIB);
    let server = TestServer::unix(backend.clone(), ServerConfig::default()).await;
    concurrent_io_matches_model(&server, &backend).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_replies_are_matched_to_their_requests() {
    // A flush runs beside the connection's reads and writes (on its flusher): held in the backend, it is
    // answered after the 8 reads sent behind it.
    let backend = MemBackend::with_slow_flush(MIB);
    for i in 0..8u8 {
        backend.preload(u64::from(i) * 4096, &[i + 1; 4096]);
    }
    let server = TestServer::tcp(backend.clone(), ServerConfig::default()).await;
    let cfg = ClientConfig {
        connections: 1,
        ..client_cfg()
    };
    let client = DataClient::connect(&server.addr, cfg).await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let flush = {
        let (client, order) = (client.clone(), order.clone());
        tokio::spawn(async move {
            client.flush().await.unwrap();
            order.lock().unwrap().push(u8::MAX);
        })
    };
    wait_for_async(
        "backend.inside.load(SeqCst) == 1",
        Duration::from_secs(5),
        async || (backend.inside.load(SeqCst) == 1).then_some(()),
    )
    .await;
    let mut tasks = Vec::new();
    for i in 0..8u8 {
        let (client, order) = (client.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            client.read(u64::from(i) * 4096, &mut buf).await.unwrap();
            assert!(
                buf.iter().all(|&b| b == i + 1),
                "read {i} got another request's data"
            );
            order.lock().unwrap().push(i);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(
        !order.lock().unwrap().contains(&u8::MAX),
        "the held-back flush is still pending"
    );
    backend.release_slow_read();
    flush.await.unwrap();
    assert_eq!(
        order.lock().unwrap().last(),
        Some(&u8::MAX),
        "the held-back flush completes last"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_past_the_end_returns_eof() {
    let backend = MemBackend::new(MIB);
    let server = TestServer::tcp(backend, ServerConfig::default()).await;
    let client = DataClient::connect(&server.addr, client_cfg()).await.unwrap();
    let mut buf = vec![0u8; 8192];
    let err = client.read(MIB as u64 - 4096, &mut buf).await.unwrap_err();
    assert!(matches!(err, ClientError::Eof), "{err:?}");
    // A per-request error does not fail the client.
    client.read(0, &mut buf).await.unwrap();
    let err = client.write(MIB as u64, &buf).await.unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Remote {
                kind: ErrorKind::OutOfRange,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(server.metrics.snapshot().errors >= 2);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_space_from_the_backend_reaches_the_client_as_no_space() {
    let backend = MemBackend::new(MIB);
    let server = TestServer::tcp(backend.clone(), ServerConfig::default()).await;
    let client = DataClient::connect(&server.addr, client_cfg()).await.unwrap();
    backend.no_space.store(true, SeqCst);
    let err = client.write(0, &[1; 4096]).await.unwrap_err();
    assert!(matches!(err, ClientError::NoSpace), "{err:?}");
    backend.no_space.store(false, SeqCst);
    client.write(0, &[1; 4096]).await.unwrap();
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmap_write_zeroes_and_flush_reach_the_backend() {
    let backend = MemBackend::new(MIB);
    let server = TestServer::tcp(backend.clone(), ServerConfig::default()).await;
    let client = DataClient::connect(&server.addr, client_cfg()).await.unwrap();
    client.write(0, &[0xab; 16384]).await.unwrap();
    client.unmap(0, 4096).await.unwrap();
    client.write_zeroes(8192, 4096).await.unwrap();
    client.flush().await.unwrap();
    client.ping().await.unwrap();
    let mut buf = vec![0u8; 16384];
    client.read(0, &mut buf).await.unwrap();
    assert!(buf[..4096].iter().all(|&b| b == 0));
    assert!(buf[4096..8192].iter().all(|&b| b == 0xab));
    assert!(buf[8192..12288].iter().all(|&b| b == 0));
    assert!(buf[12288..].iter().all(|&b| b == 0xab));
    assert_eq!(backend.flushes.load(SeqCst), 1);
    let err = client.read(0, &mut vec![0u8; 16 * MIB + 1]).await.unwrap_err();
    assert!(matches!(err, ClientError::Invalid(_)), "{err:?}");
    client.close().await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_runs_its_requests_one_at_a_time_and_connections_run_side_by_side() {
    let backend = MemBackend::new(MIB);
    backend.close_gate();
    let server = TestServer::tcp(backend.clone(), ServerConfig::default()).await;
    let client = DataClient::connect(
        &server.addr,
        ClientConfig {
            connections: 2,
            ..client_cfg()
        },
    )
    .await
    .unwrap();
    let mut tasks = Vec::new();
    for i in 0..16u64 {
        let client = client.clone();
        tasks.push(tokio::spawn(
            async move { client.write(i * 4096, &[7; 4096]).await },
        ));
    }
    // Requests go round-robin over the two connections: one runs on each connection's thread.
    wait_for_async(
        "backend.inside.load(SeqCst) == 2",
        Duration::from_secs(5),
        async || (backend.inside.load(SeqCst) == 2).then_some(()),
    )
    .await;
    // Give the other 14 every chance to sneak past before checking the peak.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(backend.max_inside.load(SeqCst), 2);
    backend.open_gate();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(backend.max_inside.load(SeqCst), 2);
    assert_eq!(backend.snapshot()[..16 * 4096], [7; 16 * 4096]);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_in_flight_requests_finish_then_returns() {
    let backend = MemBackend::new(MIB);
    backend.close_gate();
    let server = TestServer::tcp(backend.clone(), ServerConfig::default()).await;
    // One connection: with two, the idle one closes first and a closed connection fails the client.
    let cfg = ClientConfig {
        connections: 1,
        ..client_cfg()
    };
    let client = DataClient::connect(&server.addr, cfg).await.unwrap();
    let c = client.clone();
    let write = tokio::spawn(async move { c.write(0, &[9; 4096]).await });
    wait_for_async(
        "backend.inside.load(SeqCst) == 1",
        Duration::from_secs(5),
        async || (backend.inside.load(SeqCst) == 1).then_some(()),
    )
    .await;
    server.cancel.cancel();
    backend.open_gate();
    write.await.unwrap().unwrap();
    tokio::time::timeout(Duration::from_secs(10), server.task)
        .await
        .expect("server joined")
        .unwrap();
    assert_eq!(backend.snapshot()[..4096], [9; 4096]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_gives_up_does_not_leak_its_window_slot() {
    let backend = MemBackend::new(MIB);
    let server = TestServer::tcp(backend.clone(), ServerConfig::default()).await;
    // One slot in total: a leaked slot would hang every later request.
    let cfg = ClientConfig {
        connections: 1,
        window: 1,
        ..client_cfg()
    };
    let client = DataClient::connect(&server.addr, cfg).await.unwrap();
    backend.close_gate();
    let mut buf = vec![0u8; 4096];
    let gave_up = tokio::time::timeout(Duration::from_millis(50), client.read(0, &mut buf)).await;
    assert!(gave_up.is_err(), "the read is held in the backend");
    backend.open_gate();
    let next = tokio::time::timeout(Duration::from_secs(5), client.write(0, &[3; 4096])).await;
    next.expect("the slot is freed by the late reply").unwrap();
    assert!(client.failure().is_none());
    server.stop().await;
}

/// With an IO pool, a flush goes to the pool only when the backend asks (`flush_at_pool`): then two flushes of
/// one connection are inside the backend at once; otherwise they run one after another on the connection's
/// flusher, the second waiting in its queue while the first is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_io_pool_flushes_go_to_the_pool_only_when_the_backend_asks() {
    for at_pool in [false, true] {
        let backend = MemBackend::with_slow_flush(MIB);
        backend.flush_at_pool.store(at_pool, SeqCst);
        let cfg = ServerConfig {
            io_pool: Some(data_protocol::IoPool::new(4).unwrap()),
            ..ServerConfig::default()
        };
        let server = TestServer::tcp(backend.clone(), cfg).await;
        let client = DataClient::connect(
            &server.addr,
            ClientConfig {
                connections: 1,
                ..client_cfg()
            },
        )
        .await
        .unwrap();
        let received = server.metrics.requests.load(SeqCst);
        let flushes: Vec<_> = (0..2)
            .map(|_| {
                let client = client.clone();
                tokio::spawn(async move { client.flush().await })
            })
            .collect();
        wait_for_async("both flushes received", Duration::from_secs(5), async || {
            (server.metrics.requests.load(SeqCst) >= received + 2).then_some(())
        })
        .await;
        let want_inside = if at_pool { 2 } else { 1 };
        wait_for_async(
            "the flushes inside the backend",
            Duration::from_secs(5),
            async || (backend.inside.load(SeqCst) == want_inside).then_some(()),
        )
        .await;
        // A read sent now is answered (by the pool) while the flushes are held: whatever was going to enter
        // the backend has had its chance, and the second flush of the flusher case is still queued.
        let mut buf = vec![0u8; 4096];
        client.read(0, &mut buf).await.unwrap();
        assert_eq!(
            backend.inside.load(SeqCst),
            want_inside,
            "at_pool {at_pool}: flushes inside the backend at once"
        );
        backend.release_slow_read();
        for f in flushes {
            f.await.unwrap().unwrap();
        }
        assert_eq!(backend.flushes.load(SeqCst), 2, "at_pool {at_pool}");
        assert_eq!(
            server.metrics.pooled.load(SeqCst),
            if at_pool { 3 } else { 1 },
            "at_pool {at_pool}: requests at the pool (the read, and the flushes when asked)"
        );
        server.stop().await;
    }
}
