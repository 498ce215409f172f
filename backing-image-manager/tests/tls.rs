//! Issue 40: `corral-bim`'s HTTP download and the data source's HTTP API under mutual TLS, real processes given
//! `CORRAL_TLS_DIR`. A data source serves its file only to clients with a certificate of the cluster; a
//! `corral-bim` fetches it over HTTPS and serves the image's download the same way. Every stranger (plaintext, no
//! certificate, another cluster's CA, expired) is refused at the handshake by both, as are garbage bytes, while a
//! client that connects and stalls holds nobody up; each daemon logs the refusals once for the address, and
//! nothing they hold changes. An authorized download arrives identical.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use corral_proto::v1;
use sha2::{Digest, Sha512};
use testkit::{DaemonCommand, TestPki, wait_for_async};

type ClientConfig = Arc<corral_tls::rustls::ClientConfig>;

/// `GET path` on `addr` as a client with `tls` (plaintext without).
async fn get(addr: &str, path: &str, tls: Option<&ClientConfig>) -> reqwest::Result<reqwest::Response> {
    let http = sparse_sync::reqwest_tls(reqwest::Client::builder(), tls.map(|c| &**c))
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let url = format!("{}{path}", sparse_sync::http_base(addr, tls.is_some()));
    http.get(url).send().await?.error_for_status()
}

/// Every stranger is refused `GET path` on `addr`; garbage is closed unanswered.
async fn refuse_strangers(pki: &TestPki, addr: &str, path: &str) {
    for (what, tls) in pki.strangers() {
        let r = get(addr, path, tls.as_ref()).await;
        assert!(r.is_err(), "a client with {what} was answered: {r:?}");
    }
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00]).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    assert!(
        !String::from_utf8_lossy(&reply).contains("HTTP/"),
        "a truncated handshake was answered"
    );
}

fn refusals(log: &str) -> usize {
    log.matches("TLS handshake refused").count()
}

fn sha512_of(bytes: &[u8]) -> String {
    hex::encode(Sha512::digest(bytes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_source_and_bim_download_serve_only_the_cluster_over_mutual_tls() {
    let disk = Disk::new("disk-a");
    let scratch = tempfile::tempdir().unwrap();
    let pki = TestPki::new(scratch.path());
    let me = TestPki::client(&pki.node("client"));
    let size = 6 * MIB;
    let original = scratch.path().join("image.raw");
    write_image(&original, size, 40);
    let sum = sha512_hex(&original);
    // The image's origin is outside the cluster: a plain HTTP server.
    let bytes = bytes::Bytes::from(std::fs::read(&original).unwrap());
    let app = axum::Router::new().route(
        "/image.raw",
        axum::routing::get(move || async move { bytes.clone() }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/image.raw", l.local_addr().unwrap());
    let _origin = tokio::spawn(async move { axum::serve(l, app).await.unwrap() });

    let ds_tls = pki.node("datasource");
    let ds = tokio::task::block_in_place(|| {
        DaemonCommand::new(testkit::workspace_bin("corral-datasource"))
            .env("CORRAL_TLS_DIR", &ds_tls)
            .args(["serve", "--listen", "127.0.0.1:0", "--disk-path"])
            .arg(disk.path())
            .args(["--disk-uuid", "disk-a", "--name", "cirros", "--uuid", "c1"])
            .args(["--source-type", "download", "--param", &format!("url={url}")])
            .args(["--expected-checksum", &sum])
            .spawn()
    });
    let ds_addr = ds.addr("http").to_owned();
    let info: serde_json::Value = wait_for_async(
        "data source ready-for-transfer",
        Duration::from_secs(60),
        async || {
            let v: serde_json::Value = get(&ds_addr, "/v1/file", Some(&me))
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            assert_ne!(v["state"], "failed", "{v}");
            (v["state"] == "ready-for-transfer").then_some(v)
        },
    )
    .await;
    let ds_file = std::path::PathBuf::from(info["filePath"].as_str().unwrap());

    refuse_strangers(&pki, &ds_addr, "/v1/file").await;
    let _stalled = TcpStream::connect(&ds_addr).unwrap();
    let again: serde_json::Value = get(&ds_addr, "/v1/file", Some(&me))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(again, info, "a refused client changed the data source's state");
    assert_eq!(
        sha512_hex(&ds_file),
        sum,
        "a refused client changed the data source's file"
    );
    assert_eq!(
        refusals(&ds.log_text()),
        1,
        "refusals are logged once per address: {}",
        ds.log_text()
    );

    // corral-bim takes the file over HTTPS with its own certificate.
    let bim_tls = pki.node("bim");
    let bim = Bim::start_with_env(&disk, 2, &[], &[("CORRAL_TLS_DIR", bim_tls.as_path())]);
    bim.client()
        .await
        .fetch(v1::BimFetchRequest {
            spec: spec("cirros", "c1", size, &sum),
            data_source_address: ds_addr.clone(),
        })
        .await
        .unwrap();
    bim.wait_state("cirros", "ready", 30).await;
    let backing = disk.backing("cirros", "c1");
    assert_eq!(sha512_hex(&backing), sum);

    let bim_http = bim.http().trim_start_matches("http://").to_owned();
    let download = "/v1/files/cirros/download";
    refuse_strangers(&pki, &bim_http, download).await;
    let _stalled = TcpStream::connect(&bim_http).unwrap();
    assert_eq!(sha512_hex(&backing), sum, "a refused client changed the image");
    assert_eq!(
        refusals(&bim.log_text()),
        1,
        "refusals are logged once per address: {}",
        bim.log_text()
    );
    let body = get(&bim_http, download, Some(&me))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(sha512_of(&body), sum, "the authorized download is not the image");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_refuses_a_bim_whose_certificate_names_another_host() {
    let disk = Disk::new("disk-m");
    let scratch = tempfile::tempdir().unwrap();
    let pki = TestPki::new(scratch.path());
    let misnamed = pki.misnamed();
    let bim = Bim::start_with_env(&disk, 2, &[], &[("CORRAL_TLS_DIR", misnamed.as_path())]);
    let me = TestPki::client(&pki.node("client"));
    let bim_http = bim.http().trim_start_matches("http://").to_owned();
    let err = get(&bim_http, "/metrics", Some(&me)).await.unwrap_err();
    let mut chain = err.to_string();
    let mut cur = std::error::Error::source(&err);
    while let Some(e) = cur {
        chain.push_str(&format!(": {e}"));
        cur = e.source();
    }
    assert!(chain.contains("not valid for name"), "{chain}");
}
