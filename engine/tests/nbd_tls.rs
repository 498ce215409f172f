//! Issue 40: the engine's NBD frontend over TCP answers only clients with a certificate of the cluster CA. A real
//! `corral-engine` and `corral-replica` under one `TestPki`: qemu-io (GnuTLS, `tls-creds-x509`) and nbdinfo
//! (libnbd, `nbds://`) with a node certificate, given through `corral-tls nbd-client-dir`, write and read; a
//! plaintext qemu-io is told TLS is required; a client with no certificate, another cluster's certificate or an
//! expired one is refused at the TLS handshake, each logged once for its address, and the volume's content is
//! unchanged. Garbage after STARTTLS and a client that never finishes its handshake do not stop anyone else.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::{Engine, Replica};
use corral_tls::rustls;
use testkit::{TestPki, nbd_sha256, qemu_io, qemu_io_tls};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const SIZE: u64 = 16 << 20;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPT_GO: u32 = 7;
const OPT_STARTTLS: u32 = 5;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;

fn tls_flag(dir: &Path) -> [String; 2] {
    ["--tls-dir".to_owned(), dir.display().to_string()]
}

fn nbds_uri(addr: SocketAddr, volume: &str, dir: &Path) -> String {
    format!("nbds://{addr}/{volume}?tls-certificates={}", dir.display())
}

/// A TCP connection to `server` from the loopback address `from` (127.0.0.x), so each client has its own address
/// in the server's log.
async fn connect_from(from: &str, server: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    socket.connect(server).await.unwrap()
}

/// Reads the server greeting and sends the client flags (fixed newstyle, no zeroes).
async fn greet(s: &mut TcpStream) {
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).await.unwrap();
    assert_eq!(&greeting[8..16], &IHAVEOPT.to_be_bytes());
    s.write_all(&3u32.to_be_bytes()).await.unwrap();
}

async fn send_option<S: AsyncWrite + Unpin>(s: &mut S, option: u32, payload: &[u8]) -> std::io::Result<()> {
    let mut msg = Vec::new();
    msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
    msg.extend_from_slice(&option.to_be_bytes());
    msg.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
    msg.extend_from_slice(payload);
    s.write_all(&msg).await?;
    s.flush().await
}

/// The type of the next option reply (its data is skipped).
async fn reply_type<S: AsyncRead + Unpin>(s: &mut S) -> std::io::Result<u32> {
    let mut header = [0u8; 20];
    s.read_exact(&mut header).await?;
    let len = u32::from_be_bytes(header[16..20].try_into().unwrap());
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data).await?;
    Ok(u32::from_be_bytes(header[12..16].try_into().unwrap()))
}

fn go_payload(volume: &str) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&u32::try_from(volume.len()).unwrap().to_be_bytes());
    p.extend_from_slice(volume.as_bytes());
    p.extend_from_slice(&0u16.to_be_bytes());
    p
}

/// A raw NBD client from `from`: with `tls`, STARTTLS and a TLS handshake, then NBD_OPT_GO; without, NBD_OPT_GO
/// in plaintext. Returns the reply to GO, or why none came.
async fn raw_go(
    from: &str,
    server: SocketAddr,
    volume: &str,
    tls: Option<Arc<rustls::ClientConfig>>,
) -> Result<u32, String> {
    let mut tcp = connect_from(from, server).await;
    greet(&mut tcp).await;
    let Some(tls) = tls else {
        send_option(&mut tcp, OPT_GO, &go_payload(volume)).await.unwrap();
        return reply_type(&mut tcp).await.map_err(|e| e.to_string());
    };
    send_option(&mut tcp, OPT_STARTTLS, &[]).await.unwrap();
    assert_eq!(reply_type(&mut tcp).await.unwrap(), REP_ACK, "STARTTLS answered");
    let name = rustls::pki_types::ServerName::try_from(server.ip().to_string()).unwrap();
    let mut s = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    // In TLS 1.3 the client's side of the handshake ends before the server checked its certificate: a refusal
    // shows on the first read.
    send_option(&mut s, OPT_GO, &go_payload(volume))
        .await
        .map_err(|e| format!("GO: {e}"))?;
    reply_type(&mut s).await.map_err(|e| format!("GO reply: {e}"))
}

struct Setup {
    _t: tempfile::TempDir,
    _replica: Replica,
    engine: Engine,
    pki: TestPki,
    nbd: SocketAddr,
    /// The client directory of a node certificate.
    client: PathBuf,
}

impl Setup {
    fn start() -> Self {
        let t = tempfile::tempdir().unwrap();
        let pki = TestPki::new(t.path());
        let replica_tls = pki.node("replica");
        let engine_tls = pki.node("engine");
        let replica = Replica::start_tcp_only(
            &t.path().join("r"),
            &tls_flag(&replica_tls).each_ref().map(String::as_str),
        );
        let e_dir = t.path().join("e");
        std::fs::create_dir_all(&e_dir).unwrap();
        let engine = Engine::start(
            &e_dir,
            "vol",
            SIZE,
            &[replica.address()],
            &tls_flag(&engine_tls).each_ref().map(String::as_str),
        );
        let client = testkit::tls::nbd_client_dir(&pki.node("client"), &t.path().join("nbd-client"));
        let nbd = engine.daemon.socket_addr("nbd");
        Setup {
            _t: t,
            _replica: replica,
            engine,
            pki,
            nbd,
            client,
        }
    }

    fn sha256(&self) -> String {
        nbd_sha256(&nbds_uri(self.nbd, "vol", &self.client))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbd_over_tcp_serves_only_certificates_of_the_cluster_ca() {
    let s = Setup::start();
    // qemu (GnuTLS) with a node certificate: IO smaller and larger than a TLS record, read back.
    let (ok, out) = qemu_io_tls(
        s.nbd,
        "vol",
        &s.client,
        &[
            "write -P 0x5a 0 64k",
            "write -P 0xa5 1M 4M",
            "flush",
            "read -P 0x5a 0 64k",
            "read -P 0xa5 1M 4M",
        ],
    );
    assert!(ok, "qemu-io over TLS: {out}");
    // libnbd's nbds:// with the same directory.
    let info = Command::new("nbdinfo")
        .arg(nbds_uri(s.nbd, "vol", &s.client))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(
        info.status.success() && text.contains(&format!("size: {SIZE}")),
        "nbdinfo nbds://: {text}{}",
        String::from_utf8_lossy(&info.stderr)
    );
    let before = s.sha256();

    // A plaintext qemu: told TLS is required, nothing served.
    let (ok, out) = qemu_io(&format!("nbd://{}/vol", s.nbd), &["write -P 0xee 0 64k"]);
    assert!(!ok && out.contains("TLS required"), "plaintext qemu-io: {out}");
    // Raw clients, each from its own address: plaintext GO, then the three certificates the CA did not issue or
    // that are no longer valid.
    assert_eq!(
        raw_go("127.0.0.2", s.nbd, "vol", None).await,
        Ok(REP_ERR_TLS_REQD)
    );
    let strangers = [
        (
            "127.0.0.3",
            "no certificate",
            s.pki.client_without_certificate(),
            "peer sent no certificates",
        ),
        (
            "127.0.0.4",
            "another cluster's CA",
            s.pki.client_of_another_cluster(),
            "UnknownIssuer",
        ),
        (
            "127.0.0.5",
            "an expired certificate",
            TestPki::client(&s.pki.expired()),
            "expired",
        ),
    ];
    for (from, what, tls, _) in &strangers {
        let got = raw_go(from, s.nbd, "vol", Some(tls.clone())).await;
        assert!(got.is_err(), "a client with {what} was answered {got:?}");
    }
    // The same client with a node certificate is answered: what refused the others was their certificates.
    let good = TestPki::client(&s.pki.node("good"));
    assert_eq!(raw_go("127.0.0.6", s.nbd, "vol", Some(good)).await, Ok(REP_INFO));
    // A second plaintext attempt from a refused address is not logged again.
    assert_eq!(
        raw_go("127.0.0.2", s.nbd, "vol", None).await,
        Ok(REP_ERR_TLS_REQD)
    );

    assert_eq!(s.sha256(), before, "a refused client changed the volume");
    let log = s.engine.daemon.log_text();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("TLS handshake refused"))
        .collect();
    for from in ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"] {
        assert_eq!(
            refusals
                .iter()
                .filter(|l| l.contains(&format!("{from}:")))
                .count(),
            1,
            "one refusal logged for {from}: {refusals:#?}"
        );
    }
    assert_eq!(refusals.len(), 5, "{refusals:#?}");
    // Each refused by the server, for its reason.
    let plaintext = "negotiated without TLS";
    let reasons = [("127.0.0.1", plaintext), ("127.0.0.2", plaintext)]
        .into_iter()
        .chain(strangers.iter().map(|(from, _, _, why)| (*from, *why)));
    for (from, why) in reasons {
        assert!(
            refusals
                .iter()
                .any(|l| l.contains(&format!("{from}:")) && l.contains(why)),
            "{from} refused for {why:?}: {refusals:#?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_after_starttls_and_a_stalled_handshake_do_not_stop_other_clients() {
    let s = Setup::start();
    // Each client below is answered without waiting for the ones before it.
    let started = std::time::Instant::now();
    // Stalled: one client that never sends its flags, one that never starts its TLS handshake after STARTTLS.
    let mute = connect_from("127.0.0.2", s.nbd).await;
    let mut stalled = connect_from("127.0.0.3", s.nbd).await;
    greet(&mut stalled).await;
    send_option(&mut stalled, OPT_STARTTLS, &[]).await.unwrap();
    assert_eq!(reply_type(&mut stalled).await.unwrap(), REP_ACK);
    // Garbage where the ClientHello belongs.
    let mut garbage = connect_from("127.0.0.4", s.nbd).await;
    greet(&mut garbage).await;
    send_option(&mut garbage, OPT_STARTTLS, &[]).await.unwrap();
    assert_eq!(reply_type(&mut garbage).await.unwrap(), REP_ACK);
    garbage.write_all(&[0x5a; 4096]).await.unwrap();

    // While they hold their connections, a good client is served at once.
    let (ok, out) = qemu_io_tls(
        s.nbd,
        "vol",
        &s.client,
        &["write -P 0x33 0 1M", "read -P 0x33 0 1M"],
    );
    assert!(ok, "qemu-io beside stalled clients: {out}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a good client waited {:?} behind stalled ones",
        started.elapsed()
    );

    // The garbage is refused at once; the stalled handshake when its deadline passes (corral_tls'
    // HANDSHAKE_TIMEOUT): the server closes both.
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), garbage.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the server kept a garbage-speaking client");
    let deadline = corral_tls::HANDSHAKE_TIMEOUT + Duration::from_secs(5);
    let closed = tokio::time::timeout(deadline, stalled.read_to_end(&mut rest)).await;
    assert!(
        closed.is_ok(),
        "the server kept a stalled TLS handshake past its deadline"
    );
    let log = s.engine.daemon.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("TLS handshake refused") && l.contains("127.0.0.4:")),
        "garbage refused with a log line: {log}"
    );
    // The mute client is still within the negotiation deadline; the server still answers everyone.
    let (ok, out) = qemu_io_tls(s.nbd, "vol", &s.client, &["read -P 0x33 0 1M"]);
    assert!(ok, "qemu-io after the stalled clients: {out}");
    drop(mute);
}
