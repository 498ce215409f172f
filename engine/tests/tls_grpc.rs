//! Issue 40: mutual TLS on every gRPC endpoint, between real daemons given a `--tls-dir` of one cluster CA: a v1
//! replica (ReplicaService, SyncAgentService), a v2 disk daemon (LvstoreService and its hosted replica's
//! services), an engine (ControllerService; its gRPC and data clients towards the replica), a `corral-bim` and a
//! `corral-im`. qemu-io writes through the engine and the engine's CLI answers over TLS; a client with no TLS, no
//! certificate, another cluster's CA or an expired certificate is refused at every endpoint's handshake (logged
//! once per listener), and what an authorized client lists is the same before and after; a client refuses a
//! daemon whose certificate does not name the address dialled; a stalled, a garbage and a truncated handshake do
//! not keep an authorized client waiting.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Engine, Replica, bin};
use corral_proto::grpc::{GrpcTimeouts, connect_with};
use corral_proto::v1::{
    self, backing_image_manager_service_client::BackingImageManagerServiceClient,
    controller_service_client::ControllerServiceClient, instance_service_client::InstanceServiceClient,
    lvstore_service_client::LvstoreServiceClient, replica_service_client::ReplicaServiceClient,
    sync_agent_service_client::SyncAgentServiceClient,
};
use corral_tls::rustls;
use testkit::{Daemon, DaemonCommand, TestPki, qemu_io, sha256_dir};
use tokio::io::AsyncWriteExt;

const SIZE: u64 = 16 << 20;

/// The gRPC services probed, each by a call that changes nothing and lists its state.
#[derive(Debug, Clone, Copy)]
enum Service {
    Replica,
    SyncAgent,
    Lvstore,
    Controller,
    Bim,
    Instance,
}

/// What `service` at `addr` lists, through a client with `tls`; the error text when refused.
async fn list(
    service: Service,
    addr: &str,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<String, String> {
    let ch = connect_with(addr, GrpcTimeouts::CONTROL, tls)
        .await
        .map_err(|e| e.to_string())?;
    let e = v1::Empty {};
    let listed = match service {
        Service::Replica => ReplicaServiceClient::new(ch)
            .replica_get(e)
            .await
            .map(|r| format!("{:?}", r.into_inner())),
        Service::SyncAgent => SyncAgentServiceClient::new(ch)
            .replica_rebuild_status(e)
            .await
            .map(|r| format!("{:?}", r.into_inner())),
        Service::Lvstore => LvstoreServiceClient::new(ch)
            .lvstore_replica_list(v1::LvstoreEmpty {})
            .await
            .map(|r| format!("{:?}", r.into_inner())),
        Service::Controller => ControllerServiceClient::new(ch)
            .replica_list(e)
            .await
            .map(|r| format!("{:?}", r.into_inner())),
        Service::Bim => BackingImageManagerServiceClient::new(ch)
            .list(e)
            .await
            .map(|r| format!("{:?}", r.into_inner())),
        Service::Instance => InstanceServiceClient::new(ch)
            .process_list(v1::ProcessListRequest {})
            .await
            .map(|r| format!("{:?}", r.into_inner())),
    };
    listed.map_err(|s| s.to_string())
}

fn tls_flag(dir: &Path) -> [String; 2] {
    ["--tls-dir".to_owned(), dir.display().to_string()]
}

fn start_lvstore(dir: &Path, tls: &Path) -> Daemon {
    std::fs::create_dir_all(dir).unwrap();
    let disk = dir.join("disk.img");
    let st = Command::new("fallocate")
        .args(["-l", &common::V2_DISK_BYTES.to_string()])
        .arg(&disk)
        .status()
        .unwrap();
    assert!(st.success());
    DaemonCommand::new(bin("corral-replica"))
        .label("corral-replica-lvstore")
        .args(["serve-lvstore", "--format", "--cluster-size", "64K", "--disk"])
        .arg(&disk)
        .args(["--listen", "127.0.0.1:0", "--replica", "r"])
        .args(tls_flag(tls))
        .spawn()
}

fn start_bim(dir: &Path, tls: &Path) -> Daemon {
    std::fs::create_dir_all(dir).unwrap();
    corral_disk::identity::write_disk_config(dir, "bim-disk").unwrap();
    let range = testkit::ports::unbound_port_run(4);
    DaemonCommand::new(bin("corral-bim"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--disk-path",
        ])
        .arg(dir)
        .args([
            "--disk-uuid",
            "bim-disk",
            "--port-range",
            &format!("{range}-{}", range + 3),
        ])
        .args(tls_flag(tls))
        .spawn()
}

fn start_im(dir: &Path, tls: &Path) -> Daemon {
    DaemonCommand::new(bin("corral-im"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir)
        .args(tls_flag(tls))
        .spawn()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::too_many_lines)] // one scenario over shared daemons, to keep the suite fast
async fn every_grpc_endpoint_serves_its_cluster_over_mutual_tls_and_refuses_strangers_at_the_handshake() {
    let t = tempfile::tempdir().unwrap();
    let pki = TestPki::new(t.path());
    let node = pki.node("node");
    let flag = tls_flag(&node);
    let flag = flag.each_ref().map(String::as_str);

    let r = Replica::start_tcp_only(&t.path().join("r"), &flag);
    let lv = tokio::task::block_in_place(|| start_lvstore(&t.path().join("lv"), &node));
    let bim = tokio::task::block_in_place(|| start_bim(&t.path().join("bim"), &node));
    let im = tokio::task::block_in_place(|| start_im(&t.path().join("im"), &node));
    let e_dir = t.path().join("e");
    std::fs::create_dir_all(&e_dir).unwrap();
    // The engine reaches the replica over gRPC (ReplicaGet, ReplicaAdd…) and the data protocol, both over TLS.
    let e = Engine::start(&e_dir, "vol", SIZE, &[r.address()], &flag);
    let (ok, out) = qemu_io(
        &e.unix_uri(),
        &[
            "write -P 0x5a 0 64k",
            "write -P 0xa5 1M 4M",
            "flush",
            "read -P 0x5a 0 64k",
            "read -P 0xa5 1M 4M",
        ],
    );
    assert!(ok, "IO through the engine over TLS: {out}");
    // The engine's CLI dials gRPC with the node's certificates, and is refused without them.
    let info = e.cli(&["--tls-dir", node.to_str().unwrap(), "info"]);
    assert!(info.status.success(), "{}", String::from_utf8_lossy(&info.stderr));
    let plain = e.cli(&["info"]);
    assert!(!plain.status.success(), "a plaintext CLI was answered");

    let node_client = TestPki::client(&node);
    let endpoints: Vec<(Service, String, &Daemon)> = vec![
        (Service::Replica, r.daemon.addr("control").to_owned(), &r.daemon),
        (Service::SyncAgent, r.daemon.addr("sync").to_owned(), &r.daemon),
        (Service::Lvstore, lv.addr("control").to_owned(), &lv),
        (Service::Replica, lv.addr("r.control").to_owned(), &lv),
        (Service::SyncAgent, lv.addr("r.sync").to_owned(), &lv),
        (Service::Controller, e.url().to_owned(), &e.daemon),
        (Service::Bim, bim.addr("grpc").to_owned(), &bim),
        (Service::Instance, im.addr("grpc").to_owned(), &im),
    ];
    let mut before = Vec::new();
    for (service, addr, _) in &endpoints {
        let listed = list(*service, addr, Some(&node_client)).await;
        before.push(listed.unwrap_or_else(|err| panic!("{service:?} at {addr}: {err}")));
    }
    let files_before = sha256_dir(&r.dir);

    let refused = pki.strangers();
    for (what, tls) in &refused {
        for (service, addr, _) in &endpoints {
            let answer = list(*service, addr, tls.as_ref()).await;
            assert!(
                answer.is_err(),
                "{service:?} at {addr} answered a client with {what}: {answer:?}"
            );
        }
    }
    for ((service, addr, _), before) in endpoints.iter().zip(&before) {
        let after = list(*service, addr, Some(&node_client)).await.unwrap();
        assert_eq!(
            &after, before,
            "{service:?} at {addr} changed under refused clients"
        );
    }
    assert_eq!(
        sha256_dir(&r.dir),
        files_before,
        "a refused client changed the replica's files"
    );
    // One warning per listener for the one address every refused client came from.
    for daemon in [&r.daemon, &lv, &e.daemon, &bim, &im] {
        let listeners = endpoints
            .iter()
            .filter(|(_, _, d)| std::ptr::eq(*d, daemon))
            .count();
        let log = daemon.log_text();
        assert_eq!(
            log.matches("TLS handshake refused; no data touched").count(),
            listeners,
            "refusals from one address are logged once per listener: {log}"
        );
    }

    // A stalled peer, a garbage one and a truncated ClientHello on every endpoint at once: each holds only its own
    // handshake task, so an authorized client is answered at once meanwhile.
    let mut held = Vec::new();
    for (_, addr, _) in &endpoints {
        held.push(tokio::net::TcpStream::connect(addr.as_str()).await.unwrap());
        let mut garbage = tokio::net::TcpStream::connect(addr.as_str()).await.unwrap();
        garbage.write_all(&[0xde; 512]).await.unwrap();
        held.push(garbage);
        let mut truncated = tokio::net::TcpStream::connect(addr.as_str()).await.unwrap();
        // A TLS record header announcing a 512-byte handshake message, and only its first bytes.
        truncated
            .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01])
            .await
            .unwrap();
        held.push(truncated);
    }
    for ((service, addr, _), before) in endpoints.iter().zip(&before) {
        let started = Instant::now();
        let after = list(*service, addr, Some(&node_client)).await.unwrap();
        assert_eq!(&after, before);
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{service:?} at {addr} kept an authorized client waiting {:?} behind stalled handshakes",
            started.elapsed()
        );
    }
    drop(held);

    // A daemon whose certificate names another address: the client refuses it.
    let elsewhere = pki.misnamed();
    let misnamed = tokio::task::block_in_place(|| start_im(&t.path().join("im2"), &elsewhere));
    let err = list(Service::Instance, misnamed.addr("grpc"), Some(&node_client))
        .await
        .unwrap_err();
    assert!(err.contains("not valid for name"), "{err}");
}

/// The first bytes a client with `tls` sends: its ClientHello record.
fn client_hello(tls: Arc<rustls::ClientConfig>) -> Vec<u8> {
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut conn = rustls::ClientConnection::new(tls, name).unwrap();
    let mut hello = Vec::new();
    conn.write_tls(&mut hello).unwrap();
    hello
}

/// A slowloris: connects to `addr` and sends `hello` one byte a second; returns how long the server let it stay.
async fn dribble(addr: String, hello: Vec<u8>) -> Duration {
    use tokio::io::AsyncReadExt;
    let started = Instant::now();
    let mut s = tokio::net::TcpStream::connect(addr.as_str()).await.unwrap();
    let mut bytes = hello.iter();
    let mut buf = [0u8; 256];
    loop {
        assert!(
            started.elapsed() < corral_tls::HANDSHAKE_TIMEOUT * 3,
            "{addr} still holds a slowloris after {:?}",
            started.elapsed()
        );
        tokio::select! {
            read = s.read(&mut buf) => match read {
                Ok(0) | Err(_) => return started.elapsed(),
                Ok(_) => {}
            },
            // The slowloris' pace, not a wait for readiness.
            () = tokio::time::sleep(Duration::from_secs(1)) => {
                let byte = *bytes.next().expect("a ClientHello longer than the test");
                if s.write_all(&[byte]).await.is_err() {
                    return started.elapsed();
                }
            }
        }
    }
}

/// How long an authorized client at `addr` takes to complete its TLS handshake (panics past `limit`).
async fn handshake_time(addr: &str, tls: &Arc<rustls::ClientConfig>, limit: Duration) -> Duration {
    let started = Instant::now();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let done = tokio::time::timeout(limit, async {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, tcp)
            .await
    })
    .await;
    match done {
        Ok(Ok(_)) => started.elapsed(),
        Ok(Err(err)) => panic!("an authorized client refused by {addr}: {err}"),
        Err(_) => panic!("an authorized client not let in by {addr} within {limit:?}"),
    }
}

/// The log line of the first refused peer of `daemon`: it names the peer and the reason.
fn assert_refusal_names_peer_and_reason(daemon: &Daemon, reason: &str) {
    let log = daemon.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("TLS handshake refused; no data touched"))
        .unwrap_or_else(|| panic!("no refusal logged: {log}"));
    assert!(
        line.contains("127.0.0.1:") && line.contains(reason),
        "the refusal names neither the peer nor `{reason}`: {line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowloris_is_dropped_after_the_handshake_timeout_and_stalled_peers_past_the_cap_delay_a_client_boundedly()
 {
    let t = tempfile::tempdir().unwrap();
    let pki = TestPki::new(t.path());
    let node = pki.node("node");
    let flag = tls_flag(&node);
    let flag = flag.each_ref().map(String::as_str);
    let r = Replica::start_tcp_only(&t.path().join("r"), &flag);
    let im = tokio::task::block_in_place(|| start_im(&t.path().join("im"), &node));
    let client = TestPki::client(&node);
    let hello = client_hello(client.clone());
    // gRPC through `TcpIncoming` (replica control, corral-im) and the data protocol's own accept loop.
    let slow_targets = [
        r.daemon.addr("control").to_owned(),
        r.daemon.addr("data").to_owned(),
        im.addr("grpc").to_owned(),
    ];
    let slowloris: Vec<_> = slow_targets
        .iter()
        .map(|addr| tokio::spawn(dribble(addr.clone(), hello.clone())))
        .collect();

    // Past the cap of 256 handshakes at once on the replica's sync listener: 300 peers that connect and say nothing.
    let sync = r.daemon.addr("sync").to_owned();
    let mut stalled = Vec::new();
    for _ in 0..300 {
        stalled.push(tokio::net::TcpStream::connect(sync.as_str()).await.unwrap());
    }
    let limit = corral_tls::HANDSHAKE_TIMEOUT + Duration::from_secs(5);
    // Meanwhile the slowloris delays no one on the other listeners.
    for addr in &slow_targets {
        let took = handshake_time(addr, &client, limit).await;
        assert!(
            took < Duration::from_secs(2),
            "{addr} kept a client waiting {took:?} behind a slowloris"
        );
    }
    // A client behind the stalled ones waits in the backlog until their handshakes time out: bounded, and logged.
    let behind_cap = handshake_time(&sync, &client, limit).await;
    eprintln!("an authorized client behind 300 stalled peers was let in after {behind_cap:?}");
    assert!(
        r.daemon
            .log_text()
            .contains("TLS handshakes in progress at the cap"),
        "reaching the cap was not logged: {}",
        r.daemon.log_text()
    );
    drop(stalled);

    for (addr, dropped) in slow_targets.iter().zip(slowloris) {
        let after = dropped.await.unwrap();
        eprintln!("slowloris on {addr} dropped after {after:?}");
        assert!(
            after >= corral_tls::HANDSHAKE_TIMEOUT - Duration::from_secs(1)
                && after <= corral_tls::HANDSHAKE_TIMEOUT + Duration::from_secs(3),
            "a slowloris on {addr} was dropped after {after:?}, not after the handshake timeout"
        );
    }
    // Each daemon's first refusal names the peer and why.
    assert_refusal_names_peer_and_reason(&r.daemon, "not done in time");
    assert_refusal_names_peer_and_reason(&im, "not done in time");
}
