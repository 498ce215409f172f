//! `BlockStatus` end to end: allocated ranges over TCP, clipping and merging by the server, a list cut to
//! one reply's worth, and malformed answers from a hostile server.
// Lists of one byte range are what this protocol is about, not a mistyped `Vec<u64>`.
#![allow(clippy::single_range_in_vec_init)]

mod common;

use std::ops::Range;
use std::time::Duration;

use common::{MemBackend, TestServer};
use data_protocol::{
    BackendError, BlockBackend, BlockStatus, ClientConfig, ClientError, DataClient, ErrorKind, FrameHeader,
    FrameKind, HEADER_LEN, MAX_BLOCK_STATUS_RANGES, ServerConfig, VolumeInfo, encode_range,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const GIB: u64 = 1 << 30;

type Answer = dyn Fn(u64, u64) -> Result<Vec<Range<u64>>, BackendError> + Send + Sync;

/// A volume whose allocation map is a function; it holds no data.
struct MapBackend {
    size: u64,
    answer: Box<Answer>,
}

impl MapBackend {
    fn new(
        size: u64,
        answer: impl Fn(u64, u64) -> Result<Vec<Range<u64>>, BackendError> + Send + Sync + 'static,
    ) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self {
            size,
            answer: Box::new(answer),
        })
    }

    /// Allocated: `[k * period, k * period + run)` for every k, up to `size`.
    fn periodic(size: u64, period: u64, run: u64) -> std::sync::Arc<Self> {
        Self::new(size, move |offset, len| {
            Ok(periodic_model(offset, len, period, run))
        })
    }
}

fn periodic_model(offset: u64, len: u64, period: u64, run: u64) -> Vec<Range<u64>> {
    let end = offset + len;
    (offset / period..end.div_ceil(period))
        .map(|k| (k * period).max(offset)..(k * period + run).min(end))
        .filter(|r| r.start < r.end)
        .collect()
}

impl BlockBackend for MapBackend {
    fn info(&self) -> Result<VolumeInfo, BackendError> {
        Ok(VolumeInfo {
            size: self.size,
            sector_size: 512,
            name: "sparse".to_owned(),
        })
    }
    fn read_at(&self, _offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        buf.fill(0);
        Ok(())
    }
    fn write_at(&self, _offset: u64, _buf: &[u8]) -> Result<(), BackendError> {
        Ok(())
    }
    fn unmap(&self, _offset: u64, _len: u64) -> Result<(), BackendError> {
        Ok(())
    }
    fn write_zeroes(&self, _offset: u64, _len: u64) -> Result<(), BackendError> {
        Ok(())
    }
    fn flush(&self) -> Result<(), BackendError> {
        Ok(())
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Range<u64>>, BackendError> {
        if offset + len > self.size {
            return Err(BackendError::new(ErrorKind::OutOfRange, "past the end"));
        }
        (self.answer)(offset, len)
    }
}

async fn client(addr: &str) -> DataClient {
    let cfg = ClientConfig {
        request_timeout: Duration::from_secs(30),
        ..ClientConfig::default()
    };
    DataClient::connect(addr, cfg).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocated_ranges_round_trip_clipped_to_the_request() {
    let backend = MapBackend::periodic(GIB, 1 << 20, 64 << 10);
    let server = TestServer::tcp(backend, ServerConfig::default()).await;
    let c = client(&server.addr).await;
    for (offset, len) in [
        (0u64, 4u32 << 20),
        (100 << 10, 3 << 20),
        (32 << 10, 16 << 10),   // inside one allocated run
        (128 << 10, 512 << 10), // inside one hole
        (GIB - (1 << 20), 1 << 20),
    ] {
        let got = c.block_status(offset, len).await.unwrap();
        let expected = periodic_model(offset, u64::from(len), 1 << 20, 64 << 10);
        assert_eq!(
            got,
            BlockStatus {
                covered: u64::from(len),
                allocated: expected
            },
            "{offset}+{len}"
        );
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_clips_to_the_span_and_merges_touching_ranges() {
    let backend = MapBackend::new(GIB, |_, _| Ok(vec![0..4096, 4096..8192, 8192..9000, 20_000..GIB]));
    let server = TestServer::tcp(backend, ServerConfig::default()).await;
    let c = client(&server.addr).await;
    let got = c.block_status(1000, 30_000).await.unwrap();
    assert_eq!(got.covered, 30_000);
    assert_eq!(got.allocated, vec![1000..9000, 20_000..31_000]);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_backend_reports_everything_allocated() {
    let server = TestServer::tcp(MemBackend::new(1 << 20), ServerConfig::default()).await;
    let c = client(&server.addr).await;
    let got = c.block_status(4096, 8192).await.unwrap();
    assert_eq!(got.allocated, vec![4096..12_288]);
    assert_eq!(got.covered, 8192);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_list_is_cut_at_a_range_boundary_and_the_rest_follows_on_request() {
    // 1 KiB period, 512 allocated: more ranges than one reply carries.
    let backend = MapBackend::periodic(4 * GIB, 1024, 512);
    let server = TestServer::tcp(backend, ServerConfig::default()).await;
    let c = client(&server.addr).await;
    let max = u64::from(MAX_BLOCK_STATUS_RANGES);
    let len = u32::try_from((max + 100) * 1024).unwrap();
    let first = c.block_status(0, len).await.unwrap();
    assert_eq!(first.allocated.len() as u64, max);
    assert_eq!(
        first.covered,
        (max - 1) * 1024 + 512,
        "covers up to the end of the last range sent"
    );
    assert_eq!(
        first.allocated.last(),
        Some(&((max - 1) * 1024..(max - 1) * 1024 + 512))
    );
    let rest_len = u32::try_from(u64::from(len) - first.covered).unwrap();
    let rest = c.block_status(first.covered, rest_len).await.unwrap();
    assert_eq!(rest.covered, u64::from(rest_len));
    assert_eq!(rest.allocated.len(), 100);
    assert_eq!(rest.allocated[0], max * 1024..max * 1024 + 512);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_per_request_and_zero_length_is_refused() {
    let backend = MapBackend::new(GIB, |offset, _| {
        if offset == 0 {
            Ok(vec![8192..9000, 0..4096]) // a backend bug: unsorted
        } else {
            Ok(vec![])
        }
    });
    let server = TestServer::tcp(backend, ServerConfig::default()).await;
    let c = client(&server.addr).await;
    let err = c.block_status(0, 1 << 20).await.unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Remote {
                kind: ErrorKind::Io,
                ..
            }
        ),
        "{err:?}"
    );
    let err = c.block_status(GIB - 4096, 8192).await.unwrap_err();
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
    let err = c.block_status(4096, 0).await.unwrap_err();
    assert!(matches!(err, ClientError::Invalid(_)), "{err:?}");
    let empty = c.block_status(4096, 4096).await.unwrap();
    assert_eq!(empty.allocated, Vec::<Range<u64>>::new());
    assert!(c.failure().is_none(), "per-request errors keep the client");

    // A zero-length request that gets onto the wire is answered Invalid, not dropped.
    let mut raw = TcpStream::connect(&server.addr).await.unwrap();
    raw.write_all(&FrameHeader::new(FrameKind::Hello, 1, 0, 1).encode())
        .await
        .unwrap();
    raw.write_all(&FrameHeader::new(FrameKind::BlockStatus, 2, 0, 0).encode())
        .await
        .unwrap();
    let hello = read_frame(&mut raw).await;
    assert_eq!(hello.0.kind, FrameKind::Ok);
    let (reply, _) = read_frame(&mut raw).await;
    assert_eq!(
        (reply.kind, reply.length),
        (FrameKind::Error, ErrorKind::Invalid.code())
    );
    server.stop().await;
}

async fn read_frame(stream: &mut TcpStream) -> (FrameHeader, Vec<u8>) {
    let mut header = [0u8; HEADER_LEN];
    stream.read_exact(&mut header).await.unwrap();
    let header = FrameHeader::decode(&header).unwrap();
    let mut payload = vec![0u8; header.payload_usize()];
    stream.read_exact(&mut payload).await.unwrap();
    (header, payload)
}

/// A fake replica that answers Hello, then answers the first BlockStatus with `length` = `covered` and
/// `payload`, then keeps the connection open.
async fn fake_server(covered: u32, payload: Vec<u8>) -> (String, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let (hello, _) = read_frame(&mut s).await;
        let mut ok = FrameHeader::new(FrameKind::Ok, hello.id, 1 << 30, 512);
        ok.payload_len = 0;
        s.write_all(&ok.encode()).await.unwrap();
        loop {
            let (req, _) = read_frame(&mut s).await;
            if req.kind == FrameKind::Ping {
                s.write_all(&FrameHeader::new(FrameKind::Ok, req.id, 0, 0).encode())
                    .await
                    .unwrap();
                continue;
            }
            assert_eq!(req.kind, FrameKind::BlockStatus);
            let mut reply = FrameHeader::new(FrameKind::Ok, req.id, 0, covered);
            reply.payload_len = u32::try_from(payload.len()).unwrap();
            s.write_all(&reply.encode()).await.unwrap();
            s.write_all(&payload).await.unwrap();
            // Hold the connection until the client drops it.
            let mut sink = [0u8; 64];
            while s.read(&mut sink).await.unwrap_or(0) > 0 {}
            return;
        }
    });
    (addr, task)
}

fn ranges(rs: &[Range<u64>]) -> Vec<u8> {
    rs.iter().flat_map(encode_range).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_block_status_replies_are_protocol_errors_that_fail_the_client() {
    let cases: Vec<(&str, u32, Vec<u8>)> = vec![
        ("overlapping ranges", 1 << 20, ranges(&[0..8192, 4096..12_288])),
        ("unsorted ranges", 1 << 20, ranges(&[8192..12_288, 0..4096])),
        ("empty range", 1 << 20, ranges(&[4096..4096])),
        ("range outside the request", 1 << 20, ranges(&[0..(2 << 20)])),
        (
            "range beyond the covered span",
            8192,
            ranges(&[0..4096, 8192..12_288]),
        ),
        ("partial range", 1 << 20, ranges(&[0..4096])[..12].to_vec()),
        ("covers more than asked", (1 << 20) + 1, ranges(&[])),
        ("covers nothing", 0, ranges(&[])),
    ];
    for (name, covered, payload) in cases {
        let (addr, task) = fake_server(covered, payload).await;
        let c = DataClient::connect(
            &addr,
            ClientConfig {
                connections: 1,
                ..ClientConfig::default()
            },
        )
        .await
        .unwrap();
        let err = c.block_status(0, 1 << 20).await.unwrap_err();
        assert!(matches!(err, ClientError::Protocol(_)), "{name}: {err:?}");
        assert!(c.failure().is_some(), "{name}: the client is failed");
        c.close().await;
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("fake server done")
            .unwrap();
    }
}
