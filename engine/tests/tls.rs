//! Issue 40: mutual TLS on the data protocol between real daemons. A replica (v1 `corral-replica serve`, or a v2
//! `serve-lvstore` daemon's hosted replica) and a `corral-engine`, each
//! given a `--tls-dir` issued by one cluster CA, serve IO from qemu-io over TCP with TLS; a data client with no
//! certificate, no TLS at all, a certificate of another CA or an expired one is refused at the handshake (logged
//! once for the peer's address), and one that reaches a replica whose certificate does not name the address it
//! dialled refuses it; the replica's files are unchanged by all of them.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{DataEngine, Engine, Replica};
use corral_tls::rustls;
use corral_tls::{LeafRequest, SubjectAltName};
use data_protocol::{ClientConfig, ClientError, DataClient};
use testkit::{TestPki, qemu_io, sha256_dir};

const SIZE: u64 = 16 << 20;

fn localhost() -> Vec<SubjectAltName> {
    vec![SubjectAltName::Ip("127.0.0.1".parse().unwrap())]
}

async fn connect(r: &Replica, tls: Option<Arc<rustls::ClientConfig>>) -> Result<DataClient, ClientError> {
    let cfg = ClientConfig {
        connections: 1,
        tls,
        ..ClientConfig::default()
    };
    DataClient::connect(&r.replica_address().data.to_socket_string(), cfg).await
}

/// A replica on `engine` serving its data protocol on TCP only, under mutual TLS with `tls_dir`.
fn start_replica(engine: DataEngine, dir: &Path, tls_dir: &Path) -> Replica {
    let tls = tls_dir.to_str().unwrap();
    match engine {
        DataEngine::V1 => Replica::start_tcp_only(dir, &["--tls-dir", tls]),
        DataEngine::V2 => Replica::start_on(DataEngine::V2, dir, &["--tls-dir", tls]),
    }
}

on_both_engines!(io_reaches_a_replica_over_mutual_tls_and_strangers_are_refused_at_the_handshake);

async fn io_reaches_a_replica_over_mutual_tls_and_strangers_are_refused_at_the_handshake(engine: DataEngine) {
    let t = tempfile::tempdir().unwrap();
    let pki = TestPki::new(t.path());
    let replica_tls = pki.node("replica");
    let engine_tls = pki.node("engine");
    let tls_flag = |dir: &Path| ["--tls-dir".to_owned(), dir.display().to_string()];

    let r = start_replica(engine, &t.path().join("r"), &replica_tls);
    let e_dir = t.path().join("e");
    std::fs::create_dir_all(&e_dir).unwrap();
    let mut e = Engine::start(
        &e_dir,
        "vol",
        SIZE,
        &[r.address()],
        &tls_flag(&engine_tls).each_ref().map(String::as_str),
    );
    // Small IO and IO larger than a TLS record and than the replica's input buffer, read back through the engine.
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
    e.kill();

    let before = sha256_dir(&r.dir);
    let refused = pki.strangers();
    for (what, tls) in refused {
        let err = connect(&r, tls).await.err();
        assert!(err.is_some(), "a client with {what} was let in");
    }
    // The valid engine certificate still connects: what refused the others was their certificates.
    connect(&r, Some(TestPki::client(&engine_tls)))
        .await
        .unwrap()
        .close()
        .await;
    assert_eq!(
        sha256_dir(&r.dir),
        before,
        "a refused client changed the replica's files"
    );
    let log = r.daemon.log_text();
    assert_eq!(
        log.matches("TLS handshake refused").count(),
        1,
        "refusals from one address are logged once: {log}"
    );

    // A replica whose certificate is for another address: the engine's client refuses it.
    let elsewhere = pki.misnamed();
    let r2 = start_replica(engine, &t.path().join("r2"), &elsewhere);
    let Err(err) = connect(&r2, Some(TestPki::client(&engine_tls))).await else {
        panic!("a misnamed replica was trusted");
    };
    assert!(err.to_string().contains("not valid for name"), "{err}");
}

#[test]
fn a_replica_given_a_key_that_is_not_its_certificates_does_not_start_and_names_the_file() {
    let t = tempfile::tempdir().unwrap();
    let pki = TestPki::new(t.path());
    let a = pki.node("a");
    let b = pki.ca.issue(&LeafRequest::new("b", localhost(), 30)).unwrap();
    std::fs::write(a.join(corral_tls::KEY), b.key_pem()).unwrap();
    let out = std::process::Command::new(common::bin("corral-replica"))
        .args(["serve", "--listen", "127.0.0.1:0", "--dir"])
        .arg(t.path().join("r"))
        .arg("--tls-dir")
        .arg(&a)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("does not match the certificate")
            && stderr.contains(&a.join("tls.key").display().to_string()),
        "{stderr}"
    );
    assert!(
        !t.path().join("r").exists(),
        "the replica touched its directory before refusing to start"
    );
}
