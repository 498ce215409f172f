//! The v2 daemon's IO pool (`serve-lvstore --io-threads`): many requests of ONE data connection in flight at
//! once, run on the pool and answered out of order, in both data IO modes (`--data-io direct`: every request
//! waits for the device; `buffered`: cached reads and writes inline, the rest on the pool).
//!
//! - concurrent writes, reads and flushes from many tasks over one connection, compared with a model, before
//!   and after a snapshot taken between two phases (the second runs on the copy-on-write path), then the whole
//!   volume read back;
//! - a writer with many writes in flight and a flusher beside it, the daemon SIGKILLed mid-stream: after a
//!   restart every write acknowledged before a successful flush was sent is there (or a later write of the
//!   same block), nothing else is.

mod common;

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{block_pattern, http};
use corral_proto::v1::{self, replica_service_client::ReplicaServiceClient};
use data_protocol::{ClientConfig, DataClient};
use testkit::{Daemon, DaemonCommand};

const BS: u64 = 4096;
const CLUSTER: u64 = 64 << 10;
const SIZE: u64 = 32 << 20;
const TASKS: u64 = 16;

/// Writes and flushes the model tests sent (per test binary; each test runs in its own process under nextest).
static WRITES_AND_FLUSHES: AtomicU64 = AtomicU64::new(0);

fn disk(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("disk.img");
    let st = Command::new("fallocate")
        .args(["-l", &(256u64 << 20).to_string()])
        .arg(&p)
        .status()
        .unwrap();
    assert!(st.success());
    p
}

fn daemon_command(disk: &std::path::Path, mode: &str) -> DaemonCommand {
    DaemonCommand::new(env!("CARGO_BIN_EXE_corral-replica"))
        .label(format!("corral-replica-lvstore-{mode}"))
        .args(["serve-lvstore", "--format", "--cluster-size", "64K", "--disk"])
        .arg(disk)
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .args([
            "--data-io",
            mode,
            "--io-threads",
            "8",
            "--io-depth",
            "16",
            "--replica",
            "vio",
        ])
}

async fn create(d: &Daemon) {
    let mut ctl = ReplicaServiceClient::connect(d.http_url("vio.control"))
        .await
        .unwrap();
    ctl.replica_create(v1::ReplicaCreateRequest {
        size: SIZE,
        disable_revision_counter: true,
    })
    .await
    .unwrap();
}

/// One data connection with room for every task's requests at once.
async fn one_connection(d: &Daemon) -> Arc<DataClient> {
    let cfg = ClientConfig {
        connections: 1,
        window: 64,
        ..Default::default()
    };
    Arc::new(DataClient::connect(d.addr("vio.data"), cfg).await.unwrap())
}

/// The value of a sample (name with its labels) in a scrape of the daemon's `/metrics`.
async fn metric(d: &Daemon, series: &str) -> f64 {
    let (status, text) = http(d.addr("metrics"), "GET", "/metrics", "").await;
    assert_eq!(status, 200, "{text}");
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {series} in\n{text}"))
}

fn us(n: u64) -> usize {
    usize::try_from(n).unwrap()
}

/// xorshift64: reproducible per task, no dependency.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// The generation a block holds (0: zeros), checked against the pattern of that block.
fn generation_of(block: u64, data: &[u8]) -> u64 {
    if data.iter().all(|&b| b == 0) {
        return 0;
    }
    let g = u64::from_le_bytes(data[8..16].try_into().unwrap());
    assert!(
        data == block_pattern(block, g).as_slice(),
        "block {block} holds neither zeros nor a whole write (generation {g} in its first bytes)"
    );
    g
}

/// One task's ops on the clusters it owns (cluster % TASKS == task): writes of 1–4 blocks, reads of 1–8 blocks
/// checked against its model (`gen` per block, 0: never written), and flushes. Tasks never touch each other's
/// blocks, so the model is exact whatever order the server runs concurrent requests in.
async fn task_ops(
    c: Arc<DataClient>,
    task: u64,
    ops: usize,
    model: Arc<Mutex<HashMap<u64, u64>>>,
    next: Arc<AtomicU64>,
) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((task + 1) * 0x1000_0001));
    let clusters = SIZE / CLUSTER;
    let per_cluster = CLUSTER / BS;
    for _ in 0..ops {
        let cluster = rng.below(clusters / TASKS) * TASKS + task;
        let first = cluster * per_cluster + rng.below(per_cluster);
        let op = rng.below(10);
        if op < 5 {
            let n = (1 + rng.below(4)).min(cluster * per_cluster + per_cluster - first);
            let mut data = Vec::with_capacity(us(n * BS));
            let mut gens = Vec::new();
            for b in first..first + n {
                let g = next.fetch_add(1, SeqCst);
                data.extend_from_slice(&block_pattern(b, g));
                gens.push((b, g));
            }
            c.write(first * BS, &data).await.unwrap();
            model.lock().unwrap().extend(gens);
            WRITES_AND_FLUSHES.fetch_add(1, SeqCst);
        } else if op < 9 {
            let n = (1 + rng.below(8)).min(cluster * per_cluster + per_cluster - first);
            let mut buf = vec![0u8; us(n * BS)];
            c.read(first * BS, &mut buf).await.unwrap();
            let m = model.lock().unwrap();
            for (i, b) in (first..first + n).enumerate() {
                let got = generation_of(b, &buf[i * us(BS)..(i + 1) * us(BS)]);
                assert_eq!(got, m.get(&b).copied().unwrap_or(0), "task {task}: block {b}");
            }
        } else {
            c.flush().await.unwrap();
            WRITES_AND_FLUSHES.fetch_add(1, SeqCst);
        }
    }
}

async fn phase(
    c: &Arc<DataClient>,
    ops: usize,
    model: &Arc<Mutex<HashMap<u64, u64>>>,
    next: &Arc<AtomicU64>,
) {
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| tokio::spawn(task_ops(c.clone(), t, ops, model.clone(), next.clone())))
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

async fn concurrent_io_matches_a_model(mode: &str) {
    let t = tempfile::tempdir_in("/var/tmp").unwrap();
    let disk = disk(t.path());
    let d = daemon_command(&disk, mode).spawn();
    create(&d).await;
    let c = one_connection(&d).await;
    let model = Arc::new(Mutex::new(HashMap::new()));
    let next = Arc::new(AtomicU64::new(1));

    phase(&c, 300, &model, &next).await;
    c.flush().await.unwrap();
    let mut ctl = ReplicaServiceClient::connect(d.http_url("vio.control"))
        .await
        .unwrap();
    ctl.replica_snapshot(v1::ReplicaSnapshotRequest {
        name: "s1".into(),
        user_created: true,
        ..Default::default()
    })
    .await
    .unwrap();
    // Copy-on-write: first writes to a cluster allocate one in the new head; unwritten blocks read through.
    phase(&c, 300, &model, &next).await;
    c.flush().await.unwrap();

    let m = model.lock().unwrap().clone();
    assert!(m.len() > 1000, "only {} blocks written", m.len());
    let mut buf = vec![0u8; 1 << 20];
    for chunk in 0..SIZE / (1 << 20) {
        c.read(chunk << 20, &mut buf).await.unwrap();
        for (i, data) in buf.chunks(us(BS)).enumerate() {
            let b = (chunk << 20) / BS + i as u64;
            assert_eq!(
                generation_of(b, data),
                m.get(&b).copied().unwrap_or(0),
                "block {b} at the end"
            );
        }
    }
    let pooled = metric(&d, "corral_replica_data_pooled_requests_total{replica=\"vio\"}").await;
    let requests = metric(&d, "corral_replica_data_requests_total{replica=\"vio\"}").await;
    let wf = WRITES_AND_FLUSHES.load(SeqCst) as f64 + 2.0; // and the two flushes between the phases
    if mode == "direct" {
        // Every write, flush and read of written data waits for the device: all went to the pool (reads of holes
        // need no device and were answered inline).
        assert!(
            pooled >= wf && pooled <= requests,
            "{pooled} of {requests} requests pooled, {wf} writes and flushes"
        );
    } else {
        // Cached reads and writes ran inline; flushes (and reads of what was not cached) went to the pool.
        assert!(
            pooled > 0.0 && pooled < requests,
            "{pooled} of {requests} requests pooled"
        );
    }
    c.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_io_on_one_connection_matches_a_model_direct() {
    concurrent_io_matches_a_model("direct").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_io_on_one_connection_matches_a_model_buffered() {
    concurrent_io_matches_a_model("buffered").await;
}

/// What the writers and the flusher record.
#[derive(Default)]
struct Ledger {
    /// Highest generation sent per block.
    sent: HashMap<u64, u64>,
    /// Generation last acknowledged per block.
    acked: HashMap<u64, u64>,
    /// `acked` as it was when the last successful flush was sent.
    flushed: HashMap<u64, u64>,
    acks: u64,
    flushes: u64,
}

async fn sigkill_keeps_every_flushed_write(mode: &str) {
    const BLOCKS: u64 = 2048;
    let t = tempfile::tempdir_in("/var/tmp").unwrap();
    let disk = disk(t.path());
    let mut d = daemon_command(&disk, mode).spawn();
    create(&d).await;
    let c = one_connection(&d).await;
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let next = Arc::new(AtomicU64::new(1));
    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicU64::new(0));

    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (c, ledger, next, stop, failed) = (
            c.clone(),
            ledger.clone(),
            next.clone(),
            stop.clone(),
            failed.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0xD1B5_4A32_D192_ED03 ^ ((task + 7) * 0x2545_F491));
            while !stop.load(SeqCst) {
                let b = rng.below(BLOCKS / TASKS) * TASKS + task;
                let g = next.fetch_add(1, SeqCst);
                ledger.lock().unwrap().sent.insert(b, g);
                if c.write(b * BS, &block_pattern(b, g)).await.is_err() {
                    failed.fetch_add(1, SeqCst);
                    return;
                }
                let mut l = ledger.lock().unwrap();
                l.acked.insert(b, g);
                l.acks += 1;
            }
        }));
    }
    {
        let (c, ledger, stop) = (c.clone(), ledger.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(SeqCst) {
                let covered = ledger.lock().unwrap().acked.clone();
                if c.flush().await.is_err() {
                    return;
                }
                {
                    let mut l = ledger.lock().unwrap();
                    l.flushed = covered;
                    l.flushes += 1;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (acks, flushes) = {
            let l = ledger.lock().unwrap();
            (l.acks, l.flushes)
        };
        if acks >= 3000 && flushes >= 5 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {acks} writes and {flushes} flushes in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Writes still being acknowledged right up to the kill: the signal lands mid-stream.
    let a0 = ledger.lock().unwrap().acks;
    while ledger.lock().unwrap().acks < a0 + 50 {
        assert!(Instant::now() < deadline, "the writers stalled");
        tokio::task::yield_now().await;
    }
    let acks_at_kill = ledger.lock().unwrap().acks;
    d.kill(); // SIGKILL with the writers going
    for t in tasks.drain(..us(TASKS)) {
        t.await.unwrap();
    }
    stop.store(true, SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    let l = std::mem::take(&mut *ledger.lock().unwrap());
    assert_eq!(
        failed.load(SeqCst),
        TASKS,
        "every writer stopped on a failed write (the daemon died under it)"
    );
    assert!(l.acks >= acks_at_kill);
    let flushed_blocks = l.flushed.len();
    assert!(
        flushed_blocks > 500,
        "only {flushed_blocks} blocks covered by a flush"
    );
    c.close().await;

    // The same disk again (never formatted over: it holds an lvstore); the replica is found in the store.
    let d2 = daemon_command(&disk, mode).spawn();
    let c2 = one_connection(&d2).await;
    let mut buf = vec![0u8; us(BLOCKS * BS)];
    c2.read(0, &mut buf).await.unwrap();
    let mut newer = 0;
    for b in 0..BLOCKS {
        let got = generation_of(b, &buf[us(b * BS)..us((b + 1) * BS)]);
        let sent = l.sent.get(&b).copied().unwrap_or(0);
        assert!(
            got <= sent,
            "block {b}: generation {got} was never sent (last sent {sent})"
        );
        if let Some(&f) = l.flushed.get(&b) {
            assert!(
                got >= f,
                "block {b}: flushed generation {f} lost, the block holds {got}"
            );
            newer += usize::from(got > f);
        }
    }
    eprintln!(
        "{mode}: {} writes acknowledged, {} flushes, {flushed_blocks} blocks flushed, {newer} of them hold a later write",
        l.acks, l.flushes
    );
    c2.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_concurrent_writes_keeps_every_flushed_write_direct() {
    sigkill_keeps_every_flushed_write("direct").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_concurrent_writes_keeps_every_flushed_write_buffered() {
    sigkill_keeps_every_flushed_write("buffered").await;
}
