//! Test support: start the real `corral-replica` binary on free loopback ports and wait for it to serve.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use corral_proto::v1::{
    replica_service_client::ReplicaServiceClient, sync_agent_service_client::SyncAgentServiceClient,
};
use data_protocol::{ClientConfig, DataClient};
use tonic::transport::Channel;

/// A running replica daemon; killed (SIGKILL) on drop unless stopped.
pub struct Daemon {
    pub child: Child,
    pub port: u16,
    pub dir: PathBuf,
}

/// Three consecutive free ports P, P+1, P+2 (best effort: nothing else on this machine races for them).
pub fn free_port_triple() -> u16 {
    for _ in 0..200 {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        drop(l);
        if p > 65000 {
            continue;
        }
        if (0..3).all(|i| TcpListener::bind(("127.0.0.1", p + i)).is_ok()) {
            return p;
        }
    }
    panic!("no three consecutive free ports");
}

impl Daemon {
    /// Starts `corral-replica serve` and waits (with a deadline) until its data port answers a hello.
    pub fn start(dir: &Path, size: Option<u64>, extra: &[&str]) -> Self {
        let port = free_port_triple();
        Self::start_on(dir, size, extra, port)
    }

    pub fn start_on(dir: &Path, size: Option<u64>, extra: &[&str], port: u16) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_corral-replica"));
        cmd.args(["serve", "--dir"])
            .arg(dir)
            .args(["--listen", &format!("127.0.0.1:{port}")]);
        if let Some(s) = size {
            cmd.args(["--size", &s.to_string()]);
        }
        cmd.args(extra).stdout(Stdio::null()).stderr(Stdio::piped());
        let child = cmd.spawn().expect("spawn corral-replica");
        let d = Self {
            child,
            port,
            dir: dir.to_owned(),
        };
        d.wait_ready();
        d
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", self.port + 2)).is_ok()
                && std::net::TcpStream::connect(("127.0.0.1", self.port + 1)).is_ok()
                && std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("corral-replica on port {} not ready within 30 s", self.port);
    }

    pub fn url(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn data_addr(&self) -> String {
        format!("127.0.0.1:{}", self.port + 1)
    }

    pub async fn data(&self) -> DataClient {
        DataClient::connect(&self.data_addr(), ClientConfig::default())
            .await
            .expect("data connect")
    }

    pub async fn control(&self) -> ReplicaServiceClient<Channel> {
        ReplicaServiceClient::connect(format!("http://127.0.0.1:{}", self.port))
            .await
            .expect("grpc connect")
    }

    pub async fn sync_agent(&self) -> SyncAgentServiceClient<Channel> {
        SyncAgentServiceClient::connect(format!("http://127.0.0.1:{}", self.port + 2))
            .await
            .expect("grpc connect")
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait (with a deadline) for a clean exit; returns the exit status success.
    pub fn terminate(&mut self) -> bool {
        let pid = rustix::process::Pid::from_raw(i32::try_from(self.child.id()).unwrap()).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.success();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        false
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
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
