//! Test support: start the real `corral-replica` binary through the test kit (port 0 everywhere, the endpoints read
//! back from its ready file) and reach it on the endpoints it reported.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use corral_proto::ReplicaAddress;
use corral_proto::v1::{
    replica_service_client::ReplicaServiceClient, sync_agent_service_client::SyncAgentServiceClient,
};
use data_protocol::{ClientConfig, DataClient};
use testkit::DaemonCommand;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;

/// A running replica daemon; killed (SIGKILL) on drop unless stopped.
pub struct Daemon {
    pub proc: testkit::Daemon,
    pub dir: PathBuf,
}

impl Daemon {
    /// Starts `corral-replica serve` on free loopback ports and returns once it reported them.
    pub fn start(dir: &Path, size: Option<u64>, extra: &[&str]) -> Self {
        let mut cmd = DaemonCommand::new(env!("CARGO_BIN_EXE_corral-replica"))
            .label("corral-replica")
            .args(["serve", "--dir"])
            .arg(dir)
            .args(["--listen", "127.0.0.1:0"]);
        if let Some(s) = size {
            cmd = cmd.args(["--size", &s.to_string()]);
        }
        Self {
            proc: cmd.args(extra).spawn(),
            dir: dir.to_owned(),
        }
    }

    /// The replica's address, from the endpoints it reported.
    pub fn address(&self) -> ReplicaAddress {
        ReplicaAddress::tcp(
            "127.0.0.1",
            self.proc.port("control"),
            self.proc.port("data"),
            self.proc.port("sync"),
        )
    }

    /// `HOST:PORT` of the control endpoint.
    pub fn url(&self) -> String {
        self.proc.addr("control").to_owned()
    }

    /// `HOST:PORT` of the data endpoint.
    pub fn data_addr(&self) -> String {
        self.proc.addr("data").to_owned()
    }

    /// `HOST:PORT` of the metrics listener (started with `--metrics-listen 127.0.0.1:0`).
    pub fn metrics_addr(&self) -> String {
        self.proc.addr("metrics").to_owned()
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    pub async fn data(&self) -> DataClient {
        DataClient::connect(&self.data_addr(), ClientConfig::default())
            .await
            .expect("data connect")
    }

    pub async fn control(&self) -> ReplicaServiceClient<Channel> {
        ReplicaServiceClient::connect(self.proc.http_url("control"))
            .await
            .expect("grpc connect")
    }

    pub async fn sync_agent(&self) -> SyncAgentServiceClient<Channel> {
        SyncAgentServiceClient::connect(self.proc.http_url("sync"))
            .await
            .expect("grpc connect")
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// SIGTERM and wait (with a deadline) for a clean exit; returns the exit status success.
    pub fn terminate(&mut self) -> bool {
        self.proc
            .terminate(Duration::from_secs(15))
            .is_some_and(|st| st.success())
    }
}

/// A 4 KiB block whose bytes encode (block, generation).
pub fn block_pattern(block: u64, generation: u64) -> Vec<u8> {
    let mut v = vec![0u8; 4096];
    for (i, chunk) in v.chunks_mut(16).enumerate() {
        chunk[..8].copy_from_slice(&block.to_le_bytes());
        chunk[8..16].copy_from_slice(&(generation ^ (i as u64) << 48).to_le_bytes());
    }
    v
}

/// One HTTP/1.1 request on a fresh connection; returns the status code and body. The metrics server is bound
/// before the daemon writes its ready file, so it accepts at once.
pub async fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("metrics server at {addr}: {e}"));
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut response))
        .await
        .expect("HTTP response in time")
        .unwrap();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad HTTP response {response:?}"));
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}
