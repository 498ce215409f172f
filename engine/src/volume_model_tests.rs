//! Model test of the volume's IO session: random interleavings of reads, writes (single and concurrent),
//! flushes, a replica failing and a freeze with IO in flight, run against three in-process data-protocol
//! servers (the real server, client and codec over TCP) and checked against an in-memory model:
//! - a read returns the last acknowledged write (zeros where none was);
//! - a write is acknowledged iff a healthy replica took it; with every replica failed, IO errors;
//! - every healthy replica holds exactly the acknowledged writes; only failed replicas go ERR;
//! - a freeze returns only after the IO in flight finished, and no IO reaches a replica until the resume.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use corral_proto::v1::{
    replica_service_client::ReplicaServiceClient, sync_agent_service_client::SyncAgentServiceClient,
};
use data_protocol::{
    BackendError, BlockBackend, ClientConfig, DataClient, ErrorKind, ServerConfig, VolumeInfo,
};
use proptest::prelude::*;
use tokio_util::sync::CancellationToken;

use crate::replica_client::{Connection, Mode, ReplicaEntry, parse_address};
use crate::volume::Volume;

const BLOCK: usize = 4096;
const BLOCKS: usize = 16;
const REPLICAS: usize = 3;

/// An in-memory replica that can be made to fail, or to hold writes until released.
#[derive(Default)]
struct MemReplica {
    data: Mutex<Vec<u8>>,
    failing: AtomicBool,
    held: Mutex<bool>,
    released: Condvar,
    writes: AtomicU64,
    reads: AtomicU64,
}

impl MemReplica {
    fn new() -> Self {
        Self {
            data: Mutex::new(vec![0; BLOCK * BLOCKS]),
            ..Self::default()
        }
    }

    fn fail_if_failing(&self) -> Result<(), BackendError> {
        if self.failing.load(Ordering::Acquire) {
            return Err(BackendError::new(ErrorKind::Io, "injected failure"));
        }
        Ok(())
    }

    fn hold(&self, on: bool) {
        *self.held.lock().unwrap() = on;
        self.released.notify_all();
    }

    fn block(&self, b: usize) -> Vec<u8> {
        self.data.lock().unwrap()[b * BLOCK..(b + 1) * BLOCK].to_vec()
    }
}

impl BlockBackend for MemReplica {
    fn info(&self) -> Result<VolumeInfo, BackendError> {
        Ok(VolumeInfo {
            size: (BLOCK * BLOCKS) as u64,
            sector_size: 512,
            name: "model".into(),
        })
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        self.fail_if_failing()?;
        let o = usize::try_from(offset).unwrap();
        buf.copy_from_slice(&self.data.lock().unwrap()[o..o + buf.len()]);
        self.reads.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), BackendError> {
        self.fail_if_failing()?;
        let mut held = self.held.lock().unwrap();
        while *held {
            held = self.released.wait(held).unwrap();
        }
        drop(held);
        let o = usize::try_from(offset).unwrap();
        self.data.lock().unwrap()[o..o + buf.len()].copy_from_slice(buf);
        self.writes.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        self.write_zeroes(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        self.fail_if_failing()?;
        let (o, n) = (usize::try_from(offset).unwrap(), usize::try_from(len).unwrap());
        self.data.lock().unwrap()[o..o + n].fill(0);
        Ok(())
    }

    fn flush(&self) -> Result<(), BackendError> {
        self.fail_if_failing()
    }
}

#[derive(Debug, Clone)]
enum Op {
    Write {
        block: usize,
        byte: u8,
    },
    Read {
        block: usize,
    },
    Flush,
    /// Writes to distinct blocks, all at once.
    Concurrent(Vec<(usize, u8)>),
    /// The replica's backend fails every request from now on.
    Fail(usize),
    /// Writes to distinct blocks are held inside the replicas, a freeze starts, the writes are released.
    FreezeWithInFlight(Vec<(usize, u8)>),
}

fn distinct_writes() -> impl Strategy<Value = Vec<(usize, u8)>> {
    proptest::collection::btree_map(0..BLOCKS, 1u8..=255, 1..6).prop_map(|m| m.into_iter().collect())
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..BLOCKS, 1u8..=255).prop_map(|(block, byte)| Op::Write { block, byte }),
        4 => (0..BLOCKS).prop_map(|block| Op::Read { block }),
        1 => Just(Op::Flush),
        2 => distinct_writes().prop_map(Op::Concurrent),
        1 => (0..REPLICAS).prop_map(Op::Fail),
        2 => distinct_writes().prop_map(Op::FreezeWithInFlight),
    ]
}

struct Harness {
    volume: Arc<Volume>,
    replicas: Vec<Arc<MemReplica>>,
    cancel: CancellationToken,
}

/// Three replicas; `local` is the one marked as on this node (as if reached over its unix socket).
async fn harness(local: Option<usize>) -> Harness {
    let cancel = CancellationToken::new();
    let mut entries = Vec::new();
    let mut replicas = Vec::new();
    for i in 0..REPLICAS {
        let mem = Arc::new(MemReplica::new());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cfg = ServerConfig {
            shutdown_grace: Duration::from_secs(1),
            ..ServerConfig::default()
        };
        tokio::spawn(data_protocol::serve_tcp(
            listener,
            mem.clone(),
            cfg,
            cancel.clone(),
        ));
        let data = DataClient::connect(&format!("127.0.0.1:{port}"), ClientConfig::default())
            .await
            .unwrap();
        // The control and sync clients are never called by IO; they point nowhere.
        let channel = tonic::transport::Channel::from_static("http://127.0.0.1:9").connect_lazy();
        let conn = Connection {
            control: ReplicaServiceClient::with_interceptor(channel.clone(), Default::default()),
            sync: SyncAgentServiceClient::with_interceptor(channel, Default::default()),
            data,
            local: local == Some(i),
        };
        let address = parse_address(&format!("tcp://127.0.0.1:9?data={port}&sync=9")).unwrap();
        entries.push(Arc::new(ReplicaEntry::new(address, conn, Mode::Rw)));
        replicas.push(mem);
    }
    let volume = Arc::new(Volume::new(
        "model".into(),
        (BLOCK * BLOCKS) as u64,
        512,
        entries,
        true,
    ));
    Harness {
        volume,
        replicas,
        cancel,
    }
}

/// Polls `f` every millisecond until it holds; panics after 10 s.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

struct Model {
    blocks: [u8; BLOCKS],
    healthy: [bool; REPLICAS],
}

impl Model {
    fn any_healthy(&self) -> bool {
        self.healthy.iter().any(|h| *h)
    }
}

async fn spawn_writes(v: &Arc<Volume>, writes: &[(usize, u8)]) -> Vec<tokio::task::JoinHandle<bool>> {
    writes
        .iter()
        .map(|&(b, byte)| {
            let v = v.clone();
            tokio::spawn(async move { v.write((b * BLOCK) as u64, &[byte; BLOCK], false).await.is_ok() })
        })
        .collect()
}

async fn run(ops: Vec<Op>, local: Option<usize>) {
    let h = harness(local).await;
    let v = &h.volume;
    let mut m = Model {
        blocks: [0; BLOCKS],
        healthy: [true; REPLICAS],
    };
    for (step, op) in ops.into_iter().enumerate() {
        match &op {
            Op::Write { block, byte } => {
                let r = v.write((block * BLOCK) as u64, &[*byte; BLOCK], false).await;
                assert_eq!(r.is_ok(), m.any_healthy(), "step {step} {op:?}: {r:?}");
                if r.is_ok() {
                    m.blocks[*block] = *byte;
                }
            }
            Op::Read { block } => {
                let mut buf = vec![0u8; BLOCK];
                let r = v.read((block * BLOCK) as u64, &mut buf).await;
                assert_eq!(r.is_ok(), m.any_healthy(), "step {step} {op:?}: {r:?}");
                if r.is_ok() {
                    assert!(
                        buf.iter().all(|&b| b == m.blocks[*block]),
                        "step {step}: block {block} read {:#x}, last acknowledged write {:#x}",
                        buf[0],
                        m.blocks[*block]
                    );
                }
            }
            Op::Flush => {
                let r = v.flush().await;
                assert_eq!(r.is_ok(), m.any_healthy(), "step {step} {op:?}: {r:?}");
            }
            Op::Concurrent(writes) => {
                for (t, &(b, byte)) in spawn_writes(v, writes).await.into_iter().zip(writes) {
                    let ok = t.await.unwrap();
                    assert_eq!(ok, m.any_healthy(), "step {step} {op:?}");
                    if ok {
                        m.blocks[b] = byte;
                    }
                }
            }
            Op::Fail(i) => {
                h.replicas[*i].failing.store(true, Ordering::Release);
                m.healthy[*i] = false;
            }
            Op::FreezeWithInFlight(writes) => {
                for r in &h.replicas {
                    r.hold(true);
                }
                let tasks = spawn_writes(v, writes).await;
                if m.any_healthy() {
                    until("the writes to be held in the replicas", || {
                        v.epochs.in_flight() == writes.len() as u64
                    })
                    .await;
                }
                let mut ops = v.epochs.lock_ops().await;
                {
                    let freeze = ops.freeze("model test");
                    tokio::pin!(freeze);
                    if m.any_healthy() {
                        // A healthy replica holds the writes: the freeze cannot finish draining.
                        assert!(
                            tokio::time::timeout(Duration::from_millis(20), freeze.as_mut())
                                .await
                                .is_err(),
                            "step {step}: freeze returned with writes held in a replica"
                        );
                    }
                    for r in &h.replicas {
                        r.hold(false);
                    }
                    let frozen = freeze.await;
                    assert_eq!(
                        v.epochs.in_flight(),
                        0,
                        "step {step}: freeze returned with IO in flight"
                    );
                    // Drained: the writes are in every healthy replica before anything resumes.
                    for (i, r) in h.replicas.iter().enumerate().filter(|(i, _)| m.healthy[*i]) {
                        for &(b, byte) in writes {
                            assert!(
                                r.block(b).iter().all(|&x| x == byte),
                                "step {step}: replica {i} block {b}"
                            );
                        }
                    }
                    // IO issued while frozen waits at the gate and reaches no replica.
                    let counts: Vec<u64> = h
                        .replicas
                        .iter()
                        .map(|r| r.writes.load(Ordering::Acquire))
                        .collect();
                    let late = spawn_writes(v, &[writes[0]]).await;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    assert!(!late[0].is_finished(), "step {step}: a write ran while frozen");
                    let after: Vec<u64> = h
                        .replicas
                        .iter()
                        .map(|r| r.writes.load(Ordering::Acquire))
                        .collect();
                    assert_eq!(counts, after, "step {step}: a replica was written while frozen");
                    drop(frozen);
                    for (t, &(b, byte)) in tasks
                        .into_iter()
                        .chain(late)
                        .zip(writes.iter().chain(&writes[..1]))
                    {
                        let ok = t.await.unwrap();
                        assert_eq!(ok, m.any_healthy(), "step {step} {op:?}");
                        if ok {
                            m.blocks[b] = byte;
                        }
                    }
                }
            }
        }
        // Only failed replicas go ERR; every healthy one holds exactly what was acknowledged.
        for (i, e) in v.replica_set().iter().enumerate() {
            if m.healthy[i] {
                assert_eq!(
                    e.mode(),
                    Mode::Rw,
                    "step {step}: healthy replica {i} is {:?}",
                    e.error()
                );
                for b in 0..BLOCKS {
                    assert!(
                        h.replicas[i].block(b).iter().all(|&x| x == m.blocks[b]),
                        "step {step}: replica {i} block {b} differs from the model"
                    );
                }
            }
        }
    }
    h.cancel.cancel();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_volume_session_matches_the_model(
        ops in proptest::collection::vec(op(), 1..40),
        local in proptest::option::of(0..REPLICAS),
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(run(ops, local));
    }
}

/// Reads go to the replica on this node while it is RW, and to the others (round-robin) once it fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_go_to_the_local_replica_and_to_the_others_when_it_fails() {
    let h = harness(Some(2)).await;
    let v = &h.volume;
    let reads = || -> Vec<u64> {
        h.replicas
            .iter()
            .map(|r| r.reads.load(Ordering::Acquire))
            .collect()
    };
    v.write(0, &[9; BLOCK], false).await.unwrap();
    let mut buf = vec![0u8; BLOCK];
    for _ in 0..30 {
        v.read(0, &mut buf).await.unwrap();
        assert_eq!(buf, [9; BLOCK]);
    }
    assert_eq!(reads(), [0, 0, 30], "every read on the local replica");
    h.replicas[2].failing.store(true, Ordering::Release);
    for _ in 0..30 {
        v.read(0, &mut buf).await.unwrap();
        assert_eq!(buf, [9; BLOCK]);
    }
    let reads = reads();
    assert!(
        reads[0] >= 10 && reads[1] >= 10 && reads[0] + reads[1] == 30,
        "after the local replica failed, the others share the reads: {reads:?}"
    );
    h.cancel.cancel();
}
