//! Crash safety of the v2 disk daemon itself: one `corral-replica serve-lvstore` on one disk is SIGKILLed again
//! and again while it serves, all at once, writes (many in flight) and flushes to three replicas, snapshots,
//! reverts (a new head cloned from a snapshot, the old head deleted), marks and purges of removed snapshots (a
//! snapshot merged into its child), and replicas created (empty, or as clones of a backing image's snapshot lvol)
//! and deleted. Each kill waits until an operation of a kind drawn for that round is in flight. After every kill:
//!
//! - the store passes the offline check (`LvStore::check`, what `corral-lvstore check` runs): the metadata
//!   valid, no cluster owned twice, none leaked;
//! - the restarted daemon serves every replica whose create was acknowledged and none whose delete was, and every
//!   block of every replica holds its last flushed write or a write sent after it, whole (a revert in flight
//!   leaves either the old head or exactly the snapshot's content);
//! - every acknowledged snapshot is still there, unless it was marked removed (a purge may have taken it); a
//!   later revert to it reads what it held when it was taken.
//!
//! Runs alternate between `--data-io direct` and `buffered`. CI runs 10 kills;
//! `cargo test -p replica --test v2_kill_loop -- --ignored` runs 100 (`CORRAL_TEST_SEED=N` replays a run).

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::block_pattern;
use corral_proto::ReplicaAddress;
use corral_proto::v1::{
    self, backing_image_create_request::Source, lvstore_service_client::LvstoreServiceClient,
    replica_service_client::ReplicaServiceClient, sync_agent_service_client::SyncAgentServiceClient,
};
use data_protocol::{ClientConfig, DataClient};
use lvstore::{LvStore, OpenMode};
use testkit::{Daemon, DaemonCommand, TestRng};
use tonic::transport::Channel;

const BS: u64 = 4096;
const SIZE: u64 = 8 << 20;
const BLOCKS: u64 = SIZE / BS;
/// Blocks of the backing image that hold data (the rest of it reads zeros).
const IMAGE_BLOCKS: u64 = 1024;
/// The generation of the image's blocks (writes count up from 1).
const IMAGE_GEN: u64 = 1 << 40;
const IMAGE: &str = "base";
const WRITERS: [&str; 3] = ["w0", "w1", "w2"];
/// Snapshots a writer keeps unremoved; one more and it marks its oldest removed.
const KEEP_SNAPSHOTS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    Write,
    Flush,
    Snapshot,
    MarkRemoved,
    Purge,
    Revert,
    Create,
    Delete,
}

const NOT_WRITES: [Op; 7] = [
    Op::Flush,
    Op::Snapshot,
    Op::MarkRemoved,
    Op::Purge,
    Op::Revert,
    Op::Create,
    Op::Delete,
];

/// A replica's content: block → generation (blocks not in the map hold the replica's base).
type Content = HashMap<u64, u64>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Life {
    /// Create sent, not answered: it may or may not exist after a kill.
    Creating,
    Live,
    /// Delete sent, not answered.
    Deleting,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    No,
    Sent,
    Acked,
}

#[derive(Debug, Clone)]
struct Snap {
    /// What the replica held when the snapshot was asked for (a snapshot flushes first; nothing was in flight).
    content: Content,
    acked: bool,
    removed: Mark,
}

#[derive(Debug, Clone)]
struct Vol {
    from_image: bool,
    life: Life,
    /// As of the last acknowledged flush, snapshot or revert.
    durable: Content,
    /// What reads return now (every acknowledged write).
    acked: Content,
    /// Generations sent per block since `durable` (acknowledged or not).
    pending: HashMap<u64, Vec<u64>>,
    snaps: BTreeMap<String, Snap>,
    /// The content a revert in flight leaves.
    revert_to: Option<Content>,
}

impl Vol {
    fn new(from_image: bool, life: Life) -> Self {
        Self {
            from_image,
            life,
            durable: Content::new(),
            acked: Content::new(),
            pending: HashMap::new(),
            snaps: BTreeMap::new(),
            revert_to: None,
        }
    }

    fn base(&self, block: u64) -> u64 {
        if self.from_image && block < IMAGE_BLOCKS {
            IMAGE_GEN
        } else {
            0
        }
    }

    fn made_durable(&mut self) {
        self.durable = self.acked.clone();
        self.pending.clear();
    }
}

#[derive(Debug, Default)]
struct State {
    vols: BTreeMap<String, Vol>,
    /// Replicas whose delete was acknowledged: they must not come back.
    gone: BTreeSet<String>,
    /// Operations sent and not answered, by kind.
    in_flight: BTreeMap<Op, u64>,
    done: BTreeMap<Op, u64>,
    /// Requests that got no answer because the daemon was killed, by kind, over the whole loop.
    interrupted: BTreeMap<Op, u64>,
    /// A task that failed before the kill (a bug, not the kill).
    failure: Option<String>,
}

type Shared = Arc<Mutex<State>>;

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, State> {
    s.lock().unwrap()
}

fn begin(s: &Shared, op: Op, n: u64) {
    *lock(s).in_flight.entry(op).or_default() += n;
}

fn end(st: &mut State, op: Op, n: u64) {
    *st.in_flight.get_mut(&op).unwrap() -= n;
    *st.done.entry(op).or_default() += n;
}

fn snap_file(name: &str) -> String {
    format!("volume-snap-{name}.img")
}

/// The generation a block holds, checked to be one whole write (or zeros: 0).
fn generation_of(block: u64, data: &[u8]) -> Result<u64, String> {
    if data.iter().all(|&b| b == 0) {
        return Ok(0);
    }
    let g = u64::from_le_bytes(data[8..16].try_into().unwrap());
    if data == block_pattern(block, g).as_slice() {
        Ok(g)
    } else {
        Err(format!(
            "block {block} holds neither zeros nor a whole write (generation {g} in its first bytes)"
        ))
    }
}

fn us(n: u64) -> usize {
    usize::try_from(n).unwrap()
}

/// One task's failure: the operation and its error.
struct Failed(Op, String);

/// The clients of one hosted replica.
struct Replica {
    name: String,
    data: DataClient,
    control: ReplicaServiceClient<Channel>,
    sync: SyncAgentServiceClient<Channel>,
}

impl Replica {
    async fn connect(name: &str, address: &str) -> Result<Self, Failed> {
        let fail = |e: String| Failed(Op::Write, format!("{name}: connect: {e}"));
        let a: ReplicaAddress = address.parse().map_err(|e| fail(format!("{e}")))?;
        let cfg = ClientConfig {
            connections: 1,
            window: 32,
            ..Default::default()
        };
        Ok(Self {
            name: name.to_owned(),
            data: DataClient::connect(&a.data.to_socket_string(), cfg)
                .await
                .map_err(|e| fail(e.to_string()))?,
            control: ReplicaServiceClient::connect(a.control.grpc_uri())
                .await
                .map_err(|e| fail(e.to_string()))?,
            sync: SyncAgentServiceClient::connect(a.sync.grpc_uri())
                .await
                .map_err(|e| fail(e.to_string()))?,
        })
    }

    fn fail(&self, op: Op, e: impl std::fmt::Display) -> Failed {
        Failed(op, format!("{}: {op:?}: {e}", self.name))
    }

    fn with<T>(&self, s: &Shared, f: impl FnOnce(&mut Vol) -> T) -> T {
        f(lock(s).vols.get_mut(&self.name).unwrap())
    }

    /// Up to 16 writes to distinct blocks, all in flight at once.
    async fn writes(&self, s: &Shared, rng: &mut TestRng, next: &AtomicU64) -> Result<(), Failed> {
        let mut blocks = BTreeSet::new();
        for _ in 0..=rng.below(16) {
            blocks.insert(rng.below(BLOCKS));
        }
        let batch: Vec<(u64, u64)> = blocks
            .into_iter()
            .map(|b| (b, next.fetch_add(1, SeqCst)))
            .collect();
        self.with(s, |v| {
            for &(b, g) in &batch {
                v.pending.entry(b).or_default().push(g);
            }
        });
        begin(s, Op::Write, batch.len() as u64);
        let results = futures::future::join_all(
            batch
                .iter()
                .map(|&(b, g)| async move { self.data.write(b * BS, &block_pattern(b, g)).await }),
        )
        .await;
        let mut st = lock(s);
        let v = st.vols.get_mut(&self.name).unwrap();
        let mut ok = 0;
        for (&(b, g), r) in batch.iter().zip(&results) {
            if r.is_ok() {
                v.acked.insert(b, g);
                ok += 1;
            }
        }
        end(&mut st, Op::Write, ok);
        match results.into_iter().find_map(Result::err) {
            Some(e) => Err(self.fail(Op::Write, e)),
            None => Ok(()),
        }
    }

    async fn flush(&self, s: &Shared) -> Result<(), Failed> {
        begin(s, Op::Flush, 1);
        self.data.flush().await.map_err(|e| self.fail(Op::Flush, e))?;
        let mut st = lock(s);
        st.vols.get_mut(&self.name).unwrap().made_durable();
        end(&mut st, Op::Flush, 1);
        Ok(())
    }

    async fn snapshot(&mut self, s: &Shared, name: String) -> Result<(), Failed> {
        self.with(s, |v| {
            let snap = Snap {
                content: v.acked.clone(),
                acked: false,
                removed: Mark::No,
            };
            v.snaps.insert(name.clone(), snap);
        });
        begin(s, Op::Snapshot, 1);
        self.control
            .replica_snapshot(v1::ReplicaSnapshotRequest {
                name: name.clone(),
                user_created: true,
                ..Default::default()
            })
            .await
            .map_err(|e| self.fail(Op::Snapshot, e))?;
        let mut st = lock(s);
        let v = st.vols.get_mut(&self.name).unwrap();
        v.snaps.get_mut(&name).unwrap().acked = true;
        v.made_durable();
        end(&mut st, Op::Snapshot, 1);
        Ok(())
    }

    async fn mark_removed(&mut self, s: &Shared, name: &str) -> Result<(), Failed> {
        self.with(s, |v| v.snaps.get_mut(name).unwrap().removed = Mark::Sent);
        begin(s, Op::MarkRemoved, 1);
        self.control
            .disk_mark_as_removed(v1::DiskRequest { name: name.into() })
            .await
            .map_err(|e| self.fail(Op::MarkRemoved, e))?;
        let mut st = lock(s);
        st.vols
            .get_mut(&self.name)
            .unwrap()
            .snaps
            .get_mut(name)
            .unwrap()
            .removed = Mark::Acked;
        end(&mut st, Op::MarkRemoved, 1);
        Ok(())
    }

    /// Runs a purge to its end, then drops from the model the snapshots it deleted (each must have been marked).
    async fn purge(&mut self, s: &Shared) -> Result<(), Failed> {
        begin(s, Op::Purge, 1);
        self.sync
            .snapshot_purge(v1::Empty {})
            .await
            .map_err(|e| self.fail(Op::Purge, e))?;
        loop {
            let st = self
                .sync
                .snapshot_purge_status(v1::Empty {})
                .await
                .map_err(|e| self.fail(Op::Purge, e))?
                .into_inner();
            if !st.is_purging {
                if !st.error.is_empty() {
                    return Err(self.fail(Op::Purge, format!("purge failed: {}", st.error)));
                }
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let disks = self.disks().await.map_err(|e| self.fail(Op::Purge, e))?;
        let mut st = lock(s);
        let v = st.vols.get_mut(&self.name).unwrap();
        let mut taken = Vec::new();
        for (name, snap) in &v.snaps {
            if !disks.contains_key(&snap_file(name)) {
                if snap.removed != Mark::Acked {
                    let e = format!("snapshot {name} vanished in a purge without being marked removed");
                    return Err(self.fail(Op::Purge, e));
                }
                taken.push(name.clone());
            }
        }
        for name in taken {
            v.snaps.remove(&name);
        }
        end(&mut st, Op::Purge, 1);
        Ok(())
    }

    async fn revert(&mut self, s: &Shared, name: &str) -> Result<(), Failed> {
        self.with(s, |v| v.revert_to = Some(v.snaps[name].content.clone()));
        begin(s, Op::Revert, 1);
        self.control
            .replica_revert(v1::ReplicaRevertRequest {
                name: name.into(),
                ..Default::default()
            })
            .await
            .map_err(|e| self.fail(Op::Revert, e))?;
        let mut st = lock(s);
        let v = st.vols.get_mut(&self.name).unwrap();
        v.acked = v.revert_to.take().unwrap();
        v.made_durable();
        end(&mut st, Op::Revert, 1);
        Ok(())
    }

    async fn disks(&mut self) -> Result<HashMap<String, v1::DiskInfo>, tonic::Status> {
        let r = self.control.replica_get(v1::Empty {}).await?.into_inner();
        Ok(r.replica.unwrap_or_default().disks.into_iter().collect())
    }
}

/// A writer replica's stream of operations until `stop`: mostly write batches, then flushes, snapshots, marks,
/// purges and reverts, one at a time (so the model knows exactly what each snapshot and revert holds).
async fn writer(
    s: Shared,
    mut r: Replica,
    mut rng: TestRng,
    next: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) -> Result<(), Failed> {
    while !stop.load(SeqCst) {
        let (kept, removable, revertible): (Vec<String>, bool, Vec<String>) = r.with(&s, |v| {
            let kept = v
                .snaps
                .iter()
                .filter(|(_, x)| x.removed == Mark::No)
                .map(|(n, _)| n.clone())
                .collect();
            let removable = v.snaps.values().any(|x| x.removed == Mark::Acked);
            let revertible = v
                .snaps
                .iter()
                .filter(|(_, x)| x.acked && x.removed == Mark::No)
                .map(|(n, _)| n.clone())
                .collect();
            (kept, removable, revertible)
        });
        match rng.below(100) {
            0..70 => r.writes(&s, &mut rng, &next).await?,
            70..82 => r.flush(&s).await?,
            82..90 if kept.len() < KEEP_SNAPSHOTS => {
                let name = format!("s{}", next.fetch_add(1, SeqCst));
                r.snapshot(&s, name).await?;
            }
            82..90 => r.mark_removed(&s, &kept[0]).await?,
            90..96 if removable => r.purge(&s).await?,
            96..100 if !revertible.is_empty() => {
                let to = &revertible[us(rng.below(revertible.len() as u64))];
                r.revert(&s, to).await?;
            }
            _ => r.writes(&s, &mut rng, &next).await?,
        }
    }
    Ok(())
}

/// Replicas created (half of them clones of the backing image's snapshot lvol), written, flushed and deleted,
/// one after another, until `stop`.
async fn churn(
    s: Shared,
    mut svc: LvstoreServiceClient<Channel>,
    round: u64,
    mut rng: TestRng,
    next: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) -> Result<(), Failed> {
    let mut n = 0;
    while !stop.load(SeqCst) {
        n += 1;
        let name = format!("c{round}x{n}");
        let from_image = rng.below(2) == 0;
        lock(&s)
            .vols
            .insert(name.clone(), Vol::new(from_image, Life::Creating));
        begin(&s, Op::Create, 1);
        let fail = |op: Op, e: String| Failed(op, format!("{name}: {op:?}: {e}"));
        let added = svc
            .lvstore_replica_add(v1::LvstoreReplicaAddRequest {
                name: name.clone(),
                size: SIZE,
                disable_revision_counter: true,
                backing_image: if from_image { IMAGE.into() } else { String::new() },
                ..Default::default()
            })
            .await
            .map_err(|e| fail(Op::Create, e.to_string()))?
            .into_inner();
        {
            let mut st = lock(&s);
            st.vols.get_mut(&name).unwrap().life = Life::Live;
            end(&mut st, Op::Create, 1);
        }
        let r = Replica::connect(&name, &added.address).await?;
        for _ in 0..rng.below(3) {
            r.writes(&s, &mut rng, &next).await?;
        }
        r.flush(&s).await?;
        r.data.close().await;
        drop(r);
        lock(&s).vols.get_mut(&name).unwrap().life = Life::Deleting;
        begin(&s, Op::Delete, 1);
        svc.lvstore_replica_remove(v1::LvstoreReplicaRemoveRequest {
            name: name.clone(),
            delete_data: true,
        })
        .await
        .map_err(|e| fail(Op::Delete, e.to_string()))?;
        let mut st = lock(&s);
        st.vols.remove(&name);
        st.gone.insert(name);
        end(&mut st, Op::Delete, 1);
    }
    Ok(())
}

fn daemon(disk: &Path, round: u64) -> Daemon {
    DaemonCommand::new(env!("CARGO_BIN_EXE_corral-replica"))
        .label("corral-replica-lvstore")
        .args(["serve-lvstore", "--format", "--cluster-size", "64K", "--disk"])
        .arg(disk)
        .args(["--listen", "127.0.0.1:0"])
        .args([
            "--data-io",
            if round.is_multiple_of(2) {
                "buffered"
            } else {
                "direct"
            },
        ])
        .spawn()
}

/// The offline check of a killed daemon's store.
fn check(disk: &Path, round: u64) -> lvstore::CheckReport {
    let report = LvStore::open(disk, OpenMode::ReadOnly)
        .and_then(|s| s.check())
        .unwrap_or_else(|e| panic!("round {round}: the store fails its check after the kill: {e}"));
    assert_eq!(report.leaked_clusters, 0, "round {round}: {report:?}");
    assert!(report.owned_clusters > 0, "round {round}: {report:?}");
    report
}

/// Checks what the restarted daemon serves against the model, then makes what it serves the model.
async fn verify(s: &Shared, svc: &mut LvstoreServiceClient<Channel>, round: u64) {
    let listed: BTreeMap<String, String> = svc
        .lvstore_replica_list(v1::LvstoreEmpty {})
        .await
        .unwrap()
        .into_inner()
        .replicas
        .into_iter()
        .map(|r| (r.name, r.address))
        .collect();
    let vols: Vec<(String, Vol)> = {
        let st = lock(s);
        for name in &st.gone {
            assert!(
                !listed.contains_key(name),
                "round {round}: deleted replica {name} is back"
            );
        }
        for name in listed.keys() {
            assert!(
                st.vols.contains_key(name),
                "round {round}: replica {name} was never created"
            );
        }
        st.vols.iter().map(|(n, v)| (n.clone(), v.clone())).collect()
    };
    for (name, mut v) in vols {
        let Some(address) = listed.get(&name) else {
            assert_ne!(
                v.life,
                Life::Live,
                "round {round}: replica {name} (created) is gone"
            );
            lock(s).vols.remove(&name);
            continue;
        };
        let mut r = Replica::connect(&name, address)
            .await
            .unwrap_or_else(|Failed(_, e)| panic!("{e}"));
        let mut buf = vec![0u8; us(SIZE)];
        r.data.read(0, &mut buf).await.unwrap();
        let mut got = Content::new();
        for b in 0..BLOCKS {
            let g = generation_of(b, &buf[us(b * BS)..us((b + 1) * BS)])
                .unwrap_or_else(|e| panic!("round {round}: {name}: {e}"));
            if g != v.base(b) {
                got.insert(b, g);
            }
        }
        let old_or_later = (0..BLOCKS).find(|&b| {
            let g = got.get(&b).copied().unwrap_or(v.base(b));
            g != v.durable.get(&b).copied().unwrap_or(v.base(b))
                && !v.pending.get(&b).is_some_and(|p| p.contains(&g))
        });
        let reverted = v.revert_to.as_ref().is_some_and(|c| {
            (0..BLOCKS)
                .all(|b| got.get(&b).copied().unwrap_or(v.base(b)) == c.get(&b).copied().unwrap_or(v.base(b)))
        });
        if let Some(b) = old_or_later
            && !reverted
        {
            panic!(
                "round {round}: {name} block {b} holds generation {:?}: flushed {:?}, sent since {:?}{}",
                got.get(&b),
                v.durable.get(&b),
                v.pending.get(&b),
                if v.revert_to.is_some() {
                    " (nor is it the snapshot a revert in flight went to)"
                } else {
                    ""
                }
            );
        }
        // Snapshots: acknowledged ones unless marked removed; one in flight is kept when it made it.
        let disks = r.disks().await.unwrap();
        v.snaps.retain(|sname, snap| {
            let present = disks.get(&snap_file(sname));
            match (present, snap.acked, snap.removed) {
                (None, true, Mark::No) => {
                    panic!("round {round}: {name}: snapshot {sname} (acknowledged) is gone")
                }
                (None, _, _) => false,
                (Some(d), _, mark) => {
                    assert!(
                        d.removed || mark != Mark::Acked,
                        "round {round}: {name}: snapshot {sname} lost its removed mark"
                    );
                    snap.acked = true;
                    snap.removed = if d.removed { Mark::Acked } else { Mark::No };
                    true
                }
            }
        });
        r.data.close().await;
        v.acked = got;
        v.revert_to = None;
        v.made_durable();
        if v.life == Life::Live {
            lock(s).vols.insert(name, v);
        } else {
            // A create or delete the kill interrupted and that made it: deleted now (a delete on restart).
            svc.lvstore_replica_remove(v1::LvstoreReplicaRemoveRequest {
                name: name.clone(),
                delete_data: true,
            })
            .await
            .unwrap();
            let mut st = lock(s);
            st.vols.remove(&name);
            st.gone.insert(name);
        }
    }
}

async fn kill_loop(kills: u64) {
    let t = testkit::scratch::disk_tempdir("v2-kill-loop");
    let disk = t.path().join("disk.img");
    std::fs::File::create(&disk).unwrap().set_len(512 << 20).unwrap();
    let image = t.path().join("image.raw");
    let mut bytes = vec![0u8; us(SIZE)];
    for b in 0..IMAGE_BLOCKS {
        bytes[us(b * BS)..us((b + 1) * BS)].copy_from_slice(&block_pattern(b, IMAGE_GEN));
    }
    std::fs::write(&image, &bytes).unwrap();
    drop(bytes);

    let mut rng = TestRng::seeded("v2 daemon kill loop", 2020);
    let s: Shared = Arc::default();
    let next = Arc::new(AtomicU64::new(1));
    let mut interrupting_kills = 0;
    let started = Instant::now();
    for round in 1..=kills + 1 {
        let mut d = daemon(&disk, round);
        let mut svc = LvstoreServiceClient::connect(d.http_url("control"))
            .await
            .unwrap();
        if round == 1 {
            svc.backing_image_create(v1::BackingImageCreateRequest {
                name: IMAGE.into(),
                backing_image_uuid: format!("{IMAGE}-uuid"),
                source: Some(Source::FromFile(image.display().to_string())),
                ..Default::default()
            })
            .await
            .unwrap();
            testkit::wait_for_async("the backing image ready", Duration::from_secs(60), async || {
                let i = svc
                    .backing_image_get(v1::BackingImageRef { name: IMAGE.into() })
                    .await
                    .unwrap()
                    .into_inner();
                assert_ne!(i.state, "failed", "{i:?}");
                (i.state == "ready").then_some(())
            })
            .await;
            for w in WRITERS {
                svc.lvstore_replica_add(v1::LvstoreReplicaAddRequest {
                    name: w.into(),
                    size: SIZE,
                    ..Default::default()
                })
                .await
                .unwrap();
                lock(&s).vols.insert(w.into(), Vol::new(false, Life::Live));
            }
        } else {
            verify(&s, &mut svc, round).await;
        }
        if round == kills + 1 {
            assert!(
                d.terminate(Duration::from_secs(15))
                    .is_some_and(|st| st.success()),
                "clean stop"
            );
            check(&disk, round);
            // No operation the kills cut short left an lvol behind: the store holds the image's copy and each
            // replica's head and snapshots the model knows, nothing else.
            let mut expected: BTreeSet<String> = BTreeSet::new();
            for (name, v) in &lock(&s).vols {
                expected.insert(name.clone());
                expected.extend(v.snaps.keys().map(|snap| format!("{name}.snap.{snap}")));
            }
            let found: BTreeSet<String> = LvStore::open(&disk, OpenMode::ReadOnly)
                .unwrap()
                .list()
                .into_iter()
                .map(|l| l.name)
                .filter(|n| !n.starts_with(&format!("bi-{IMAGE}-disk-")))
                .collect();
            assert_eq!(
                found.difference(&expected).collect::<Vec<_>>(),
                Vec::<&String>::new(),
                "lvols left behind"
            );
            assert_eq!(found, expected, "lvols missing");
            eprintln!(
                "the store holds {} lvols beside the image, as expected",
                found.len()
            );
            break;
        }

        let stop = Arc::new(AtomicBool::new(false));
        let killed = Arc::new(AtomicBool::new(false));
        // A task that fails before the kill names a bug: the watcher below stops the test with it.
        let watch = |task: tokio::task::JoinHandle<Result<(), Failed>>| {
            let (s, killed) = (s.clone(), killed.clone());
            tokio::spawn(async move {
                let r = task.await.unwrap();
                if let Err(Failed(_, e)) = &r
                    && !killed.load(SeqCst)
                {
                    lock(&s).failure.get_or_insert_with(|| e.clone());
                }
                r
            })
        };
        let mut tasks = Vec::new();
        let listed = svc
            .lvstore_replica_list(v1::LvstoreEmpty {})
            .await
            .unwrap()
            .into_inner()
            .replicas;
        for w in WRITERS {
            let address = &listed.iter().find(|r| r.name == w).unwrap().address;
            let r = Replica::connect(w, address)
                .await
                .unwrap_or_else(|Failed(_, e)| panic!("{e}"));
            let task_rng = TestRng::new(rng.next_u64());
            tasks.push(watch(tokio::spawn(writer(
                s.clone(),
                r,
                task_rng,
                next.clone(),
                stop.clone(),
            ))));
        }
        let task_rng = TestRng::new(rng.next_u64());
        tasks.push(watch(tokio::spawn(churn(
            s.clone(),
            svc.clone(),
            round,
            task_rng,
            next.clone(),
            stop.clone(),
        ))));

        // Kill once enough writes went through and an operation of the drawn kind is in flight (any other than a
        // write after 10 s); every task still running.
        let want = NOT_WRITES[us(rng.below(NOT_WRITES.len() as u64))];
        let writes_before = lock(&s).done.get(&Op::Write).copied().unwrap_or(0);
        let target = writes_before + 50 + rng.below(500);
        let (watched, killing) = (s.clone(), killed.clone());
        let (d, in_flight) = tokio::task::spawn_blocking(move || {
            let t0 = Instant::now();
            loop {
                {
                    let st = lock(&watched);
                    if let Some(f) = &st.failure {
                        panic!("round {round}: {f}");
                    }
                    let busy = |op: &Op| st.in_flight.get(op).copied().unwrap_or(0) > 0;
                    let wanted = busy(&want)
                        || (t0.elapsed() > Duration::from_secs(10) && NOT_WRITES.iter().any(busy));
                    if st.done.get(&Op::Write).copied().unwrap_or(0) >= target && wanted {
                        killing.store(true, SeqCst);
                        d.kill();
                        let in_flight: Vec<Op> = st
                            .in_flight
                            .iter()
                            .filter(|(_, n)| **n > 0)
                            .map(|(op, _)| *op)
                            .collect();
                        return (d, in_flight);
                    }
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(60),
                    "round {round}: no {want:?} in flight in 60 s"
                );
                std::thread::sleep(Duration::from_micros(50));
            }
        })
        .await
        .unwrap();
        drop(d);
        stop.store(true, SeqCst);
        let mut failed_ops = BTreeSet::new();
        for task in tasks {
            match task.await.unwrap() {
                Ok(()) => {}
                Err(Failed(op, _)) => {
                    failed_ops.insert(op);
                }
            }
        }
        {
            let mut st = lock(&s);
            for op in &failed_ops {
                *st.interrupted.entry(*op).or_default() += 1;
            }
            st.in_flight.clear();
        }
        if failed_ops.iter().any(|op| *op != Op::Write) {
            interrupting_kills += 1;
        }
        let report = check(&disk, round);
        eprintln!(
            "round {round}: wanted {want:?}, in flight at the kill {in_flight:?}, unanswered {failed_ops:?}; store: {} blobs, {} clusters owned",
            report.blobs, report.owned_clusters
        );
    }
    let st = lock(&s);
    eprintln!(
        "{kills} kills in {:.1} s; answered {:?}; unanswered at a kill {:?}; {interrupting_kills} kills cut an operation other than a write short",
        started.elapsed().as_secs_f64(),
        st.done,
        st.interrupted
    );
    assert!(
        interrupting_kills * 2 >= kills,
        "only {interrupting_kills} of {kills} kills landed on an operation other than a write"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_v2_daemon_sigkilled_ten_times_under_io_snapshots_reverts_purges_creates_and_deletes_loses_nothing()
 {
    kill_loop(10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak: 100 kills; cargo test -p replica --test v2_kill_loop -- --ignored"]
async fn the_v2_daemon_sigkilled_a_hundred_times_loses_nothing() {
    kill_loop(100).await;
}
