//! Shared by the NBD integration tests: an in-process server over a [`MemoryDevice`] on a unix socket and on
//! TCP, external client runners with deadlines, and a raw protocol client for what real clients never send.
#![allow(dead_code)] // each test binary uses a different part

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use engine::nbd::wire::{self, RequestHeader};
use engine::nbd::{MemoryDevice, NbdConfig, NbdCounters, NbdServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

pub const EXPORT: &str = "vol0";
pub const MIB: u64 = 1 << 20;
/// Upper bound for anything a test waits on.
pub const DEADLINE: Duration = Duration::from_secs(60);

pub struct TestServer {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub tcp: SocketAddr,
    pub device: Arc<MemoryDevice>,
    pub counters: Arc<NbdCounters>,
    cancel: CancellationToken,
    tasks: JoinSet<()>,
}

impl TestServer {
    /// Binds both listeners before returning, so clients can connect at once.
    pub async fn start(size: u64, config: NbdConfig) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("nbd.sock");
        let device = Arc::new(MemoryDevice::new(size));
        let server = NbdServer::new(
            device.clone(),
            NbdConfig {
                export_name: EXPORT.into(),
                ..config
            },
        );
        let unix = UnixListener::bind(&socket).expect("bind unix socket");
        let tcp_listener = TcpListener::bind("127.0.0.1:0").await.expect("bind tcp");
        let tcp = tcp_listener.local_addr().expect("tcp addr");
        let cancel = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let (s, c) = (server.clone(), cancel.clone());
        tasks.spawn(async move { s.serve_unix(unix, c).await.expect("serve unix") });
        let (s, c) = (server.clone(), cancel.clone());
        tasks.spawn(async move { s.serve_tcp(tcp_listener, c).await.expect("serve tcp") });
        Self {
            dir,
            socket,
            tcp,
            device,
            counters: server.counters(),
            cancel,
            tasks,
        }
    }

    pub async fn with_size(size: u64) -> Self {
        Self::start(size, NbdConfig::default()).await
    }

    pub fn unix_uri(&self) -> String {
        format!("nbd+unix:///{EXPORT}?socket={}", self.socket.display())
    }

    pub fn tcp_uri(&self) -> String {
        format!("nbd://{}/{EXPORT}", self.tcp)
    }

    /// Cancels the listeners and waits (bounded) until every connection has ended.
    pub async fn stop(mut self) {
        self.cancel.cancel();
        tokio::time::timeout(DEADLINE, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await
        .expect("server stops within the deadline");
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Runs a client program to completion (killed at the deadline), system python first on PATH for nbdsh.
pub async fn run(program: &str, args: &[&str]) -> Output {
    let path = format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default());
    let child = tokio::process::Command::new(program)
        .args(args)
        .env("PATH", path)
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(DEADLINE, child).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => {
            panic!("cannot run {program} (install libnbd-bin python3-libnbd fio nbdkit qemu-utils): {e}")
        }
        Err(_) => panic!("{program} {args:?} did not finish within {DEADLINE:?}"),
    }
}

/// Like [`run`] but the program must succeed; returns stdout.
pub async fn run_ok(program: &str, args: &[&str]) -> String {
    let out = run(program, args).await;
    assert!(
        out.status.success(),
        "{program} {args:?} failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A hand-driven NBD client speaking raw bytes over TCP.
pub struct RawClient {
    pub stream: TcpStream,
}

pub struct OptionReply {
    pub option: u32,
    pub kind: u32,
    pub data: Vec<u8>,
}

pub struct Chunk {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub payload: Vec<u8>,
}

impl RawClient {
    /// Connects and checks the server greeting; the client flags are not sent yet.
    pub async fn greet(addr: SocketAddr) -> Self {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).await.expect("greeting");
        assert_eq!(&greeting[0..8], &wire::NBD_MAGIC.to_be_bytes());
        assert_eq!(&greeting[8..16], &wire::IHAVEOPT.to_be_bytes());
        assert_eq!(
            u16::from_be_bytes([greeting[16], greeting[17]]),
            wire::FLAG_FIXED_NEWSTYLE | wire::FLAG_NO_ZEROES
        );
        Self { stream }
    }

    /// Greets and sends fixed-newstyle + no-zeroes client flags.
    pub async fn connect(addr: SocketAddr) -> Self {
        let mut c = Self::greet(addr).await;
        c.send(&(wire::FLAG_C_FIXED_NEWSTYLE | wire::FLAG_C_NO_ZEROES).to_be_bytes())
            .await;
        c
    }

    /// Negotiates to the transmission phase with NBD_OPT_GO.
    pub async fn open(addr: SocketAddr, structured: bool, base_allocation: bool) -> Self {
        let mut c = Self::connect(addr).await;
        if structured {
            c.send_option(wire::opt::STRUCTURED_REPLY, &[]).await;
            assert_eq!(c.read_option_reply().await.kind, wire::rep::ACK);
        }
        if base_allocation {
            c.send_option(
                wire::opt::SET_META_CONTEXT,
                &meta_context_payload(EXPORT, &[wire::BASE_ALLOCATION]),
            )
            .await;
            let r = c.read_option_reply().await;
            assert_eq!(r.kind, wire::rep::META_CONTEXT);
            assert_eq!(&r.data[0..4], &wire::BASE_ALLOCATION_ID.to_be_bytes());
            assert_eq!(c.read_option_reply().await.kind, wire::rep::ACK);
        }
        c.send_option(wire::opt::GO, &info_payload(EXPORT, &[])).await;
        loop {
            let r = c.read_option_reply().await;
            match r.kind {
                wire::rep::INFO => continue,
                wire::rep::ACK => break,
                other => panic!(
                    "NBD_OPT_GO answered with {other:#x}: {}",
                    String::from_utf8_lossy(&r.data)
                ),
            }
        }
        c
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("send");
    }

    pub async fn send_option(&mut self, option: u32, payload: &[u8]) {
        let mut b = Vec::with_capacity(16 + payload.len());
        b.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&u32::try_from(payload.len()).expect("small payload").to_be_bytes());
        b.extend_from_slice(payload);
        self.send(&b).await;
    }

    pub async fn read_option_reply(&mut self) -> OptionReply {
        let mut h = [0u8; 20];
        self.read_exact(&mut h).await;
        assert_eq!(&h[0..8], &wire::OPTION_REPLY_MAGIC.to_be_bytes());
        let word = |at: usize| u32::from_be_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]);
        let mut data = vec![0u8; word(16) as usize];
        self.read_exact(&mut data).await;
        OptionReply {
            option: word(8),
            kind: word(12),
            data,
        }
    }

    pub async fn request(&mut self, command: u16, flags: u16, cookie: u64, offset: u64, length: u32) {
        let h = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        self.send(&h.encode()).await;
    }

    pub async fn write(&mut self, cookie: u64, offset: u64, data: &[u8]) {
        let len = u32::try_from(data.len()).expect("small write");
        self.request(wire::cmd::WRITE, 0, cookie, offset, len).await;
        self.send(data).await;
    }

    /// A simple reply: (errno, cookie).
    pub async fn read_simple_reply(&mut self) -> (u32, u64) {
        let mut h = [0u8; 16];
        self.read_exact(&mut h).await;
        assert_eq!(&h[0..4], &wire::SIMPLE_REPLY_MAGIC.to_be_bytes());
        let errno = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
        let mut cookie = [0u8; 8];
        cookie.copy_from_slice(&h[8..16]);
        (errno, u64::from_be_bytes(cookie))
    }

    pub async fn read_chunk(&mut self) -> Chunk {
        let mut h = [0u8; 20];
        self.read_exact(&mut h).await;
        assert_eq!(&h[0..4], &wire::STRUCTURED_REPLY_MAGIC.to_be_bytes());
        let mut cookie = [0u8; 8];
        cookie.copy_from_slice(&h[8..16]);
        let len = u32::from_be_bytes([h[16], h[17], h[18], h[19]]);
        let mut payload = vec![0u8; len as usize];
        self.read_exact(&mut payload).await;
        Chunk {
            flags: u16::from_be_bytes([h[4], h[5]]),
            kind: u16::from_be_bytes([h[6], h[7]]),
            cookie: u64::from_be_bytes(cookie),
            payload,
        }
    }

    pub async fn read_exact(&mut self, buf: &mut [u8]) {
        tokio::time::timeout(DEADLINE, self.stream.read_exact(buf))
            .await
            .expect("server answers within the deadline")
            .expect("server answers");
    }

    /// True when the server closed the connection (EOF or reset) before the deadline, false if it sent bytes.
    pub async fn closed_by_server(&mut self) -> bool {
        let mut b = [0u8; 1];
        match tokio::time::timeout(DEADLINE, self.stream.read(&mut b)).await {
            Ok(Ok(0)) | Ok(Err(_)) => true,
            Ok(Ok(_)) => false,
            Err(_) => panic!("server neither answered nor closed within {DEADLINE:?}"),
        }
    }
}

pub fn info_payload(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&u32::try_from(name.len()).expect("short name").to_be_bytes());
    p.extend_from_slice(name.as_bytes());
    p.extend_from_slice(&u16::try_from(infos.len()).expect("few infos").to_be_bytes());
    for i in infos {
        p.extend_from_slice(&i.to_be_bytes());
    }
    p
}

pub fn meta_context_payload(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&u32::try_from(name.len()).expect("short name").to_be_bytes());
    p.extend_from_slice(name.as_bytes());
    p.extend_from_slice(&u32::try_from(queries.len()).expect("few queries").to_be_bytes());
    for q in queries {
        p.extend_from_slice(&u32::try_from(q.len()).expect("short query").to_be_bytes());
        p.extend_from_slice(q.as_bytes());
    }
    p
}
