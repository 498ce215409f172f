//! The `fault-injection` feature end to end: rules given at start (`--fault`) and changed over HTTP
//! (`/debug/faults`) make the real daemon's data path fail exactly as told, and a data-protocol client sees
//! the error, the delay, the hang and the dropped connection.
//!
//! `CARGO_TARGET_DIR=target-f cargo test -p replica --features fault-injection --test fault_injection`
#![cfg(feature = "fault-injection")]

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, http};
use data_protocol::{ClientConfig, ClientError, DataClient, ErrorKind};
use replica::fault::{FaultAction, FaultOp, FaultRuleStatus};
use testkit::wait_for_async;

const SIZE: u64 = 16 << 20;

async fn rules(metrics: &str) -> Vec<FaultRuleStatus> {
    let (status, body) = http(metrics, "GET", "/debug/faults", "").await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

async fn connect(d: &Daemon) -> DataClient {
    let cfg = ClientConfig {
        request_timeout: Duration::from_secs(30),
        ..ClientConfig::default()
    };
    DataClient::connect(&d.data_addr(), cfg).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_and_no_space_rules_fail_the_request_after_letting_n_pass() {
    let t = tempfile::tempdir().unwrap();
    let d = Daemon::start(
        t.path(),
        Some(SIZE),
        &["--fault", "write=no-space,after=2", "--fault", "flush=error"],
    );
    let data = connect(&d).await;
    data.write(0, &[1; 4096]).await.unwrap();
    data.write(4096, &[2; 4096]).await.unwrap();
    let err = data.write(8192, &[3; 4096]).await.unwrap_err();
    assert!(matches!(err, ClientError::NoSpace), "{err:?}");
    let err = data.flush().await.unwrap_err();
    match &err {
        ClientError::Remote {
            kind: ErrorKind::Io,
            message,
        } => assert!(message.contains("injected fault"), "{message}"),
        other => panic!("expected an injected IO error, got {other:?}"),
    }
    // Per-request errors: the client stays up and other operations are untouched.
    let mut buf = [0u8; 4096];
    data.read(4096, &mut buf).await.unwrap();
    assert_eq!(buf, [2; 4096]);
    assert!(data.failure().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_rule_holds_each_request_that_long() {
    let t = tempfile::tempdir().unwrap();
    let d = Daemon::start(t.path(), Some(SIZE), &["--fault", "read=delay:400"]);
    let data = connect(&d).await;
    let mut buf = [0u8; 4096];
    let started = Instant::now();
    data.read(0, &mut buf).await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "{:?}",
        started.elapsed()
    );
    let started = Instant::now();
    data.write(0, &[1; 4096]).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(400),
        "writes are not delayed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_request_completes_once_the_rule_is_cleared_over_http() {
    let t = tempfile::tempdir().unwrap();
    let d = Daemon::start(t.path(), Some(SIZE), &["--metrics-listen", "127.0.0.1:0"]);
    let metrics = d.metrics_addr();
    let data = connect(&d).await;
    assert_eq!(rules(&metrics).await, vec![]);

    let (status, body) = http(
        &metrics,
        "POST",
        "/debug/faults",
        r#"{"op": "flush", "action": "hang"}"#,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    data.write(0, &[9; 4096]).await.unwrap();
    let c = data.clone();
    let flush = tokio::spawn(async move { c.flush().await });
    wait_for_async(
        "the flush reaching the backend",
        Duration::from_secs(10),
        async || (rules(&metrics).await[0].hits > 0).then_some(()),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!flush.is_finished(), "the flush hangs while the rule is in force");
    data.read(0, &mut [0u8; 4096]).await.unwrap(); // other operations still run

    let (status, body) = http(&metrics, "DELETE", "/debug/faults", "").await;
    assert_eq!((status, body.as_str()), (200, "[]"));
    let result = tokio::time::timeout(Duration::from_secs(10), flush)
        .await
        .expect("the flush completes once released")
        .unwrap();
    assert!(result.is_ok(), "{result:?}");
    assert!(data.failure().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_rule_disconnects_the_client_and_the_daemon_keeps_serving() {
    let t = tempfile::tempdir().unwrap();
    let d = Daemon::start(t.path(), Some(SIZE), &["--fault", "unmap=drop,after=1"]);
    let data = connect(&d).await;
    data.unmap(0, 4096).await.unwrap();
    let started = Instant::now();
    let err = data.unmap(0, 4096).await.unwrap_err();
    assert!(matches!(err, ClientError::Disconnected(_)), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a dropped connection, not a timeout"
    );
    assert!(data.failure().is_some(), "a lost connection fails the client");

    let again = connect(&d).await;
    again.write(0, &[4; 4096]).await.unwrap();
    let mut buf = [0u8; 4096];
    again.read(0, &mut buf).await.unwrap();
    assert_eq!(buf, [4; 4096]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_endpoint_sets_lists_and_clears_rules_and_rejects_bad_ones() {
    let t = tempfile::tempdir().unwrap();
    let d = Daemon::start(
        t.path(),
        Some(SIZE),
        &["--metrics-listen", "127.0.0.1:0", "--fault", "read=error"],
    );
    let metrics = d.metrics_addr();
    let data = connect(&d).await;
    let listed = rules(&metrics).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].rule.op, listed[0].rule.action),
        (FaultOp::Read, FaultAction::Error)
    );

    let (status, _) = http(
        &metrics,
        "POST",
        "/debug/faults",
        r#"[{"op": "write", "action": "error", "after": 1}, {"op": "block-status", "action": "no-space"}]"#,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(rules(&metrics).await.len(), 3);
    data.write(0, &[1; 4096]).await.unwrap();
    assert!(matches!(
        data.write(0, &[1; 4096]).await,
        Err(ClientError::Remote {
            kind: ErrorKind::Io,
            ..
        })
    ));
    assert!(matches!(
        data.block_status(0, 4096).await,
        Err(ClientError::NoSpace)
    ));

    let (status, body) = http(&metrics, "DELETE", "/debug/faults?op=write", "").await;
    assert_eq!(status, 200);
    let left: Vec<FaultRuleStatus> = serde_json::from_str(&body).unwrap();
    assert_eq!(left.len(), 2);
    data.write(0, &[1; 4096]).await.unwrap();
    assert!(data.read(0, &mut [0u8; 512]).await.is_err());

    for bad in [
        r#"{"op": "write", "action": "explode"}"#,
        r#"{"op": "erase", "action": "error"}"#,
        "not json",
    ] {
        let (status, body) = http(&metrics, "POST", "/debug/faults", bad).await;
        assert!((400..500).contains(&status), "{bad}: {status} {body}");
    }
    assert_eq!(rules(&metrics).await.len(), 2, "a rejected body changes nothing");
    assert!(data.failure().is_none());
}
