//! The NBD frontend driven byte by byte: negotiation corner cases, malformed input, invalid requests,
//! pipelining, structured replies and shutdown — what real clients never send or do not let a test observe.
#![allow(clippy::cast_possible_truncation)] // sizes and counts here are small test constants

mod nbd_support;

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use engine::nbd::NbdConfig;
use engine::nbd::wire::{self, STATE_HOLE, STATE_ZERO, cflag, chunk, cmd, errno, opt, rep};
use nbd_support::{EXPORT, MIB, RawClient, TestServer, info_payload, meta_context_payload};
use tokio::io::AsyncWriteExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_handshakes_close_only_that_connection() {
    let server = TestServer::with_size(MIB).await;
    let mut healthy = RawClient::open(server.tcp, false, false).await;
    healthy.write(1, 0, &[7u8; 512]).await;
    assert_eq!(healthy.read_simple_reply().await, (0, 1));

    // Bad option magic.
    let mut c = RawClient::connect(server.tcp).await;
    c.send(&[0xde; 16]).await;
    assert!(c.closed_by_server().await, "bad option magic");
    // Option payload longer than 64 KiB.
    let mut c = RawClient::connect(server.tcp).await;
    let mut h = wire::IHAVEOPT.to_be_bytes().to_vec();
    h.extend_from_slice(&opt::GO.to_be_bytes());
    h.extend_from_slice(&(wire::MAX_OPTION_LEN + 1).to_be_bytes());
    c.send(&h).await;
    assert!(c.closed_by_server().await, "absurd option length");
    // Truncated option: the header promises 100 bytes, the client sends 10 and stops sending.
    let mut c = RawClient::connect(server.tcp).await;
    let mut h = wire::IHAVEOPT.to_be_bytes().to_vec();
    h.extend_from_slice(&opt::GO.to_be_bytes());
    h.extend_from_slice(&100u32.to_be_bytes());
    h.extend_from_slice(&[0; 10]);
    c.send(&h).await;
    c.stream.shutdown().await.expect("half-close");
    assert!(c.closed_by_server().await, "truncated option");
    // Unknown client flags.
    let mut c = RawClient::greet(server.tcp).await;
    c.send(&0x8000_0001u32.to_be_bytes()).await;
    assert!(c.closed_by_server().await, "unknown client flags");
    // NBD_OPT_EXPORT_NAME cannot answer an error: an unknown name closes.
    let mut c = RawClient::connect(server.tcp).await;
    c.send_option(opt::EXPORT_NAME, b"nope").await;
    assert!(
        c.closed_by_server().await,
        "unknown export with NBD_OPT_EXPORT_NAME"
    );

    assert!(server.counters.handshake_failures.load(Ordering::Relaxed) >= 5);
    // The established connection and new ones keep working.
    healthy.request(cmd::READ, 0, 2, 0, 512).await;
    assert_eq!(healthy.read_simple_reply().await, (0, 2));
    let mut data = [0u8; 512];
    healthy.read_exact(&mut data).await;
    assert_eq!(data, [7u8; 512]);
    let mut fresh = RawClient::open(server.tcp, true, true).await;
    fresh.request(cmd::FLUSH, 0, 3, 0, 0).await;
    assert_eq!(fresh.read_chunk().await.cookie, 3);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negotiation_answers_errors_and_continues_until_go() {
    let server = TestServer::with_size(MIB).await;
    let mut c = RawClient::connect(server.tcp).await;
    c.send_option(99, b"whatever").await;
    let r = c.read_option_reply().await;
    assert_eq!((r.option, r.kind), (99, rep::ERR_UNSUP));
    c.send_option(opt::GO, &info_payload("other", &[])).await;
    assert_eq!(c.read_option_reply().await.kind, rep::ERR_UNKNOWN);
    c.send_option(opt::INFO, &[0, 0, 0, 40, b'x']).await;
    assert_eq!(c.read_option_reply().await.kind, rep::ERR_INVALID);
    c.send_option(
        opt::SET_META_CONTEXT,
        &meta_context_payload(EXPORT, &[wire::BASE_ALLOCATION]),
    )
    .await;
    assert_eq!(
        c.read_option_reply().await.kind,
        rep::ERR_INVALID,
        "meta context needs structured replies first"
    );

    c.send_option(opt::LIST, &[]).await;
    let server_entry = c.read_option_reply().await;
    assert_eq!(server_entry.kind, rep::SERVER);
    assert_eq!(&server_entry.data[4..], EXPORT.as_bytes());
    assert_eq!(c.read_option_reply().await.kind, rep::ACK);

    c.send_option(opt::LIST_META_CONTEXT, &meta_context_payload(EXPORT, &[]))
        .await;
    let ctx = c.read_option_reply().await;
    assert_eq!(ctx.kind, rep::META_CONTEXT);
    assert_eq!(&ctx.data[4..], wire::BASE_ALLOCATION.as_bytes());
    assert_eq!(c.read_option_reply().await.kind, rep::ACK);

    // The empty name is the default export; INFO answers EXPORT, NAME, DESCRIPTION (empty: omitted),
    // BLOCK_SIZE.
    c.send_option(
        opt::INFO,
        &info_payload("", &[wire::info::NAME, wire::info::BLOCK_SIZE]),
    )
    .await;
    let mut infos = Vec::new();
    loop {
        let r = c.read_option_reply().await;
        if r.kind == rep::ACK {
            break;
        }
        assert_eq!(r.kind, rep::INFO);
        infos.push(r.data);
    }
    assert_eq!(infos.len(), 3);
    assert_eq!(&infos[0][2..10], &MIB.to_be_bytes());
    assert_eq!(&infos[1][2..], EXPORT.as_bytes());
    assert_eq!(&infos[2][2..], &[0, 0, 0, 1, 0, 0, 16, 0, 1, 0, 0, 0]);

    c.send_option(opt::GO, &info_payload(EXPORT, &[])).await;
    while c.read_option_reply().await.kind != rep::ACK {}
    c.request(cmd::READ, 0, 9, 0, 4096).await;
    assert_eq!(c.read_simple_reply().await, (0, 9));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_name_option_enters_transmission_with_or_without_zero_padding() {
    let server = TestServer::with_size(MIB).await;
    for (client_flags, padding) in [
        (wire::FLAG_C_FIXED_NEWSTYLE | wire::FLAG_C_NO_ZEROES, 0),
        (wire::FLAG_C_FIXED_NEWSTYLE, 124),
    ] {
        let mut c = RawClient::greet(server.tcp).await;
        c.send(&client_flags.to_be_bytes()).await;
        c.send_option(opt::EXPORT_NAME, b"").await;
        let mut reply = vec![0u8; 10 + padding];
        c.read_exact(&mut reply).await;
        assert_eq!(&reply[..8], &MIB.to_be_bytes());
        let flags = u16::from_be_bytes([reply[8], reply[9]]);
        assert_ne!(flags & wire::tflag::CAN_MULTI_CONN, 0);
        assert!(reply[10..].iter().all(|&b| b == 0));
        c.request(cmd::FLUSH, 0, 5, 0, 0).await;
        assert_eq!(c.read_simple_reply().await, (0, 5));
        c.request(cmd::DISC, 0, 6, 0, 0).await;
        assert!(c.closed_by_server().await);
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_get_errors_and_the_connection_stays_in_sync() {
    let config = NbdConfig {
        max_block: 64 << 10,
        ..NbdConfig::default()
    };
    let server = TestServer::start(MIB, config).await;
    let mut c = RawClient::open(server.tcp, false, false).await;
    let cases: &[(u16, u16, u64, u32, u32)] = &[
        (cmd::READ, 0, MIB - 512, 4096, errno::EINVAL),
        (cmd::READ, 0, u64::MAX - 10, 4096, errno::EINVAL),
        (cmd::READ, 0, 0, 0, errno::EINVAL),
        (cmd::READ, 0, 0, 128 << 10, errno::EINVAL),
        (cmd::TRIM, 0, MIB, 1, errno::EINVAL),
        (cmd::WRITE_ZEROES, 0, MIB - 1, 2, errno::ENOSPC),
        (cmd::BLOCK_STATUS, 0, 0, 4096, errno::EINVAL),
        (cmd::READ, cflag::REQ_ONE, 0, 4096, errno::EINVAL),
        (42, 0, 0, 4096, errno::EINVAL),
    ];
    for (i, &(command, flags, offset, length, want)) in cases.iter().enumerate() {
        let cookie = 100 + i as u64;
        c.request(command, flags, cookie, offset, length).await;
        assert_eq!(c.read_simple_reply().await, (want, cookie), "case {i}");
    }
    // Writes past the end and writes above the maximum block size: the payload is drained, then answered.
    c.write(200, MIB - 512, &[1u8; 4096]).await;
    assert_eq!(c.read_simple_reply().await, (errno::ENOSPC, 200));
    c.write(201, 0, &vec![2u8; 256 << 10]).await;
    assert_eq!(c.read_simple_reply().await, (errno::EINVAL, 201));
    assert!(
        server.device.snapshot().iter().all(|&b| b == 0),
        "nothing was written"
    );
    // Still in sync: a valid write and read.
    c.write(202, 4096, &[3u8; 4096]).await;
    assert_eq!(c.read_simple_reply().await, (0, 202));
    c.request(cmd::READ, 0, 203, 4096, 4096).await;
    assert_eq!(c.read_simple_reply().await, (0, 203));
    let mut data = vec![0u8; 4096];
    c.read_exact(&mut data).await;
    assert!(data.iter().all(|&b| b == 3));
    assert!(server.counters.write.errors.load(Ordering::Relaxed) >= 2);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_export_refuses_writes_with_eperm() {
    let server = TestServer::start(
        MIB,
        NbdConfig {
            read_only: true,
            ..NbdConfig::default()
        },
    )
    .await;
    let mut c = RawClient::open(server.tcp, false, false).await;
    c.write(1, 0, &[1u8; 512]).await;
    assert_eq!(c.read_simple_reply().await, (errno::EPERM, 1));
    c.request(cmd::TRIM, 0, 2, 0, 512).await;
    assert_eq!(c.read_simple_reply().await, (errno::EPERM, 2));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_request_magic_closes_only_that_connection() {
    let server = TestServer::with_size(MIB).await;
    let mut c = RawClient::open(server.tcp, false, false).await;
    c.send(&[0x55; 28]).await;
    assert!(c.closed_by_server().await);
    assert_eq!(server.counters.protocol_errors.load(Ordering::Relaxed), 1);
    let mut c = RawClient::open(server.tcp, false, false).await;
    c.request(cmd::FLUSH, 0, 1, 0, 0).await;
    assert_eq!(c.read_simple_reply().await, (0, 1));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_all_answered_by_cookie() {
    let server = TestServer::with_size(4 * MIB).await;
    let mut c = RawClient::open(server.tcp, true, false).await;
    let n = 300u64;
    // Everything is sent before any reply is read: the server must keep reading under backpressure.
    let mut batch = Vec::new();
    for i in 0..n {
        let h = wire::RequestHeader {
            flags: 0,
            command: cmd::WRITE,
            cookie: i,
            offset: i * 8192,
            length: 8192,
        };
        batch.extend_from_slice(&h.encode());
        batch.extend(std::iter::repeat_n(u8::try_from(i % 251).expect("small"), 8192));
    }
    let (mut rd, mut wr) = c.stream.into_split();
    let sender = tokio::spawn(async move {
        wr.write_all(&batch).await.expect("send batch");
        wr
    });
    let mut seen = HashSet::new();
    for _ in 0..n {
        let mut h = [0u8; 20];
        tokio::io::AsyncReadExt::read_exact(&mut rd, &mut h)
            .await
            .expect("reply");
        assert_eq!(u16::from_be_bytes([h[6], h[7]]), chunk::NONE);
        assert_eq!(u16::from_be_bytes([h[4], h[5]]), chunk::FLAG_DONE);
        let cookie = u64::from_be_bytes(h[8..16].try_into().expect("8 bytes"));
        assert!(seen.insert(cookie), "cookie {cookie} answered twice");
    }
    assert_eq!(seen.len() as u64, n);
    c.stream = rd.reunite(sender.await.expect("sender")).expect("same stream");
    let content = server.device.snapshot();
    for i in 0..n as usize {
        assert!(
            content[i * 8192..(i + 1) * 8192]
                .iter()
                .all(|&b| usize::from(b) == i % 251)
        );
    }
    server.stop().await;
}

/// BLOCK_STATUS over the first 64 KiB: the (length, status) descriptors.
async fn block_status(c: &mut RawClient, flags: u16, cookie: u64) -> Vec<(u32, u32)> {
    c.request(cmd::BLOCK_STATUS, flags, cookie, 0, 64 << 10).await;
    let r = c.read_chunk().await;
    assert_eq!(
        (r.kind, r.flags, r.cookie),
        (chunk::BLOCK_STATUS, chunk::FLAG_DONE, cookie)
    );
    assert_eq!(&r.payload[..4], &wire::BASE_ALLOCATION_ID.to_be_bytes());
    let word = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    r.payload[4..]
        .chunks_exact(8)
        .map(|d| (word(&d[..4]), word(&d[4..])))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_replies_carry_data_errors_and_block_status() {
    let server = TestServer::with_size(MIB).await;
    let mut c = RawClient::open(server.tcp, true, true).await;
    c.write(1, 8192, &[9u8; 4096]).await;
    assert_eq!(c.read_chunk().await.cookie, 1);

    c.request(cmd::READ, 0, 2, 8192, 4096).await;
    let data = c.read_chunk().await;
    assert_eq!(
        (data.kind, data.flags, data.cookie),
        (chunk::OFFSET_DATA, chunk::FLAG_DONE, 2)
    );
    assert_eq!(&data.payload[..8], &8192u64.to_be_bytes());
    assert!(data.payload[8..].iter().all(|&b| b == 9));

    let hole = STATE_HOLE | STATE_ZERO;
    assert_eq!(
        block_status(&mut c, 0, 3).await,
        vec![(8192, hole), (4096, 0), (53248, hole)]
    );
    assert_eq!(block_status(&mut c, cflag::REQ_ONE, 4).await, vec![(8192, hole)]);

    // A device failure becomes an ERROR chunk with EIO and a message; the connection goes on.
    server.device.fail_range(Some(0..4096));
    c.request(cmd::READ, 0, 5, 0, 512).await;
    let err = c.read_chunk().await;
    assert_eq!(
        (err.kind, err.flags, err.cookie),
        (chunk::ERROR, chunk::FLAG_DONE, 5)
    );
    assert_eq!(&err.payload[..4], &errno::EIO.to_be_bytes());
    let msg_len = usize::from(u16::from_be_bytes([err.payload[4], err.payload[5]]));
    assert!(String::from_utf8_lossy(&err.payload[6..6 + msg_len]).contains("injected"));
    server.device.fail_range(None);
    c.request(cmd::READ, 0, 6, 0, 512).await;
    assert_eq!(c.read_chunk().await.kind, chunk::OFFSET_DATA);
    assert_eq!(server.counters.read.errors.load(Ordering::Relaxed), 1);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_completes_requests_sent_before_it() {
    let server = TestServer::with_size(MIB).await;
    let mut c = RawClient::open(server.tcp, false, false).await;
    for i in 0..16u64 {
        c.write(i, i * 4096, &[0xee; 4096]).await;
    }
    c.request(cmd::DISC, 0, 99, 0, 0).await;
    let mut cookies = HashSet::new();
    for _ in 0..16 {
        let (e, cookie) = c.read_simple_reply().await;
        assert_eq!(e, 0);
        cookies.insert(cookie);
    }
    assert_eq!(cookies.len(), 16);
    assert!(c.closed_by_server().await);
    assert!(server.device.snapshot()[..16 * 4096].iter().all(|&b| b == 0xee));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_idle_connections_and_stops_listening() {
    let server = TestServer::with_size(MIB).await;
    let mut idle = RawClient::open(server.tcp, false, false).await;
    let mut negotiating = RawClient::connect(server.tcp).await;
    let addr = server.tcp;
    server.stop().await;
    assert!(idle.closed_by_server().await);
    assert!(negotiating.closed_by_server().await);
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "listener is closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_forever_for_a_client_that_stops_reading_replies() {
    let server = TestServer::with_size(4 * MIB).await;
    let mut c = RawClient::open(server.tcp, false, false).await;
    // Far more reply bytes than socket buffers hold, and the client never reads them.
    for i in 0..256u64 {
        c.request(cmd::READ, 0, i, 0, MIB as u32).await;
    }
    // Wait until the server is stuck on this client: more reads executed (1 MiB each) than the socket buffers
    // hold (a few MiB), so replies are owed. The connection runs up to 64 at once and collects every finished
    // reply before writing, so it gets there before its first write blocks.
    let reads = server.counters.clone();
    let deadline = tokio::time::Instant::now() + nbd_support::DEADLINE;
    while reads.read.requests.load(Ordering::Relaxed) < 32 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "server never executed the reads"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let started = std::time::Instant::now();
    server.stop().await; // panics if connections are not gone within the deadline
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(4),
        "replies owed at shutdown get their grace period, took {:?}",
        started.elapsed()
    );
    drop(c);
}
