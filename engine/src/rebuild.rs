//! Rebuild, engine side: add a replica in WO mode and bring it to RW.
//!
//! 1. Connect the new replica (created with the volume's size if empty) and mark it `Rebuilding` on disk.
//! 2. Under the volume's operations lock (steps 2 and 3): freeze IO and install a replica set with the new
//!    replica in WO, then (IO frozen again) flush and take one system snapshot `rebuild-<id>` on every replica
//!    *and* the new one. From here every write reaches its head; everything older sits in immutable snapshot
//!    files on the sources.
//! 3. Still with snapshots excluded (IO runs), ask the new replica's sync agent to pull every snapshot file of
//!    an RW source (`FilesSync`; sparse-sync with delta and whole-file skip, files spread over all RW sources).
//! 4. Poll its progress. When the files are in: reload the new replica, verify its snapshot tree equals the
//!    source's, and with IO frozen (operations lock, freeze, drain) copy the source's revision counter, set RW
//!    and clear `Rebuilding`.
//!
//! A failure puts the new replica ERR with the reason; adding it again resumes from what it already holds.
//!
//! Several replicas may rebuild at once: each has its own rebuild snapshot, which the others (WO) take too, so
//! every rebuilding head keeps exactly the writes since its own snapshot; the sources are the RW replicas only.
//! Rate: each rebuild carries a [`RebuildRate`] (the request's, or the engine's `--rebuild-max-rate` and
//! `--rebuild-busy-rate`) to the new replica, which applies it to its local copy and to its network sources.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use corral_proto::{ReplicaAddress, v1};
use data_protocol::ClientConfig;
use tokio::sync::Mutex;
use tracing::{info, warn};

use crate::error::EngineError;
use crate::replica_client::{self, Mode, ReplicaEntry, parse_address};
use crate::volume::Volume;

/// How fast a rebuild may move data, in data bytes per second (0: no bound).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RebuildRate {
    /// Upper bound over the whole rebuild, local copy or network.
    pub max_bytes_per_second: u64,
    /// Rate the local copy slows to while the new replica serves foreground IO (0: no backing off).
    pub busy_bytes_per_second: u64,
}

impl RebuildRate {
    /// Each non-zero field of `asked` over this default.
    #[must_use]
    pub fn or_default(asked: Self, default: Self) -> Self {
        let pick = |a: u64, d: u64| if a > 0 { a } else { d };
        Self {
            max_bytes_per_second: pick(asked.max_bytes_per_second, default.max_bytes_per_second),
            busy_bytes_per_second: pick(asked.busy_bytes_per_second, default.busy_bytes_per_second),
        }
    }
}

/// Rebuild jobs of this engine, by replica address.
#[derive(Debug, Default)]
pub struct RebuildTracker {
    jobs: Mutex<HashMap<String, v1::ReplicaRebuildState>>,
    /// The rate of a rebuild whose request names none (`--rebuild-max-rate`, `--rebuild-busy-rate`).
    default_rate: RebuildRate,
}

/// Snapshot files of a replica (every disk but the head), parents before children.
fn snapshot_files(r: &v1::Replica) -> Vec<v1::DiskInfo> {
    let mut out: Vec<v1::DiskInfo> = Vec::new();
    let mut left: Vec<&v1::DiskInfo> = r.disks.values().filter(|d| d.name != r.head).collect();
    while !left.is_empty() {
        let before = left.len();
        left.retain(|d| {
            if d.parent.is_empty() || out.iter().any(|o| o.name == d.parent) {
                out.push((*d).clone());
                false
            } else {
                true
            }
        });
        if left.len() == before {
            // A parent outside the list (cannot happen with a consistent replica): keep the rest in any order.
            out.extend(left.drain(..).cloned());
        }
    }
    out
}

/// The tree without the head, comparable between replicas: name → parent.
fn tree(r: &v1::Replica) -> Vec<(String, String)> {
    let mut t: Vec<(String, String)> = r
        .disks
        .values()
        .filter(|d| d.name != r.head)
        .map(|d| (d.name.clone(), d.parent.clone()))
        .collect();
    t.sort();
    t
}

async fn replica_get(e: &ReplicaEntry) -> Result<v1::Replica, EngineError> {
    let mut c = e.connection()?.control.clone();
    Ok(c.replica_get(v1::Empty {})
        .await
        .map_err(|s| EngineError::replica(&e.address, &s))?
        .into_inner()
        .replica
        .unwrap_or_default())
}

impl RebuildTracker {
    /// A tracker whose rebuilds default to `rate`.
    #[must_use]
    pub fn new(default_rate: RebuildRate) -> Self {
        Self {
            jobs: Mutex::default(),
            default_rate,
        }
    }

    /// Status of every rebuild this engine ran.
    pub async fn status(&self) -> Vec<v1::ReplicaRebuildState> {
        let mut v: Vec<_> = self.jobs.lock().await.values().cloned().collect();
        v.sort_by(|a, b| a.address.cmp(&b.address));
        v
    }

    async fn update(&self, address: &ReplicaAddress, f: impl FnOnce(&mut v1::ReplicaRebuildState)) {
        let mut jobs = self.jobs.lock().await;
        let j = jobs
            .entry(address.to_string())
            .or_insert_with(|| v1::ReplicaRebuildState {
                address: address.to_string(),
                ..Default::default()
            });
        f(j);
    }

    /// Adds `address` to the volume and starts rebuilding it at `rate` (its zero fields: the engine's default);
    /// returns the new (WO) replica. Other replicas may be rebuilding meanwhile.
    pub async fn start(
        self: &Arc<Self>,
        volume: Arc<Volume>,
        address: &str,
        client: &ClientConfig,
        rate: RebuildRate,
    ) -> Result<Arc<ReplicaEntry>, EngineError> {
        let address = parse_address(address)?;
        let rate = RebuildRate::or_default(rate, self.default_rate);
        // Held until the file sync is started: no other operation changes the set or takes a snapshot between.
        let mut ops = volume.epochs.lock_ops().await;
        {
            let reps = ops.set();
            if reps.iter().any(|r| r.address == address) {
                return Err(EngineError::AlreadyExists(format!(
                    "replica {address} is already part of {} (remove it first to rebuild it)",
                    volume.name
                )));
            }
        }
        let (conn, status) = replica_client::connect(
            &address,
            client,
            Some((volume.size(), volume.revision_counter_disabled)),
        )
        .await?;
        if status.size != volume.size() {
            return Err(EngineError::InvalidArgument(format!(
                "replica {address} has size {}, volume {} has {}",
                status.size,
                volume.name,
                volume.size()
            )));
        }
        if status.revision_counter_disabled != volume.revision_counter_disabled {
            return Err(EngineError::InvalidArgument(format!(
                "replica {address}: revision counter setting differs from the volume's"
            )));
        }
        conn.control
            .clone()
            .rebuilding_set(v1::RebuildingSetRequest { rebuilding: true })
            .await
            .map_err(|e| EngineError::replica(&address, &e))?;
        let entry = Arc::new(ReplicaEntry::new(address.clone(), conn, Mode::Wo));

        let snap = format!("rebuild-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let sources: Vec<Arc<ReplicaEntry>> = {
            let mut frozen = ops.freeze("rebuild: add WO replica").await;
            let mut next = frozen.set().to_vec();
            let sources: Vec<Arc<ReplicaEntry>> =
                next.iter().filter(|r| r.mode() == Mode::Rw).cloned().collect();
            if sources.is_empty() {
                return Err(EngineError::FailedPrecondition(format!(
                    "volume {} has no RW replica to rebuild from",
                    volume.name
                )));
            }
            next.push(entry.clone());
            frozen.install(next);
            sources
        };
        // The WO entry is in the set, so it gets the snapshot too (IO frozen again for it).
        if let Err(e) = volume
            .snapshot_locked(&mut ops, &snap, HashMap::new(), false)
            .await
        {
            entry.set_err(&format!("rebuild snapshot failed: {e}"));
            return Err(e);
        }
        if entry.mode() != Mode::Wo {
            return Err(EngineError::FailedPrecondition(format!(
                "replica {address} failed during the rebuild snapshot: {}",
                entry.error()
            )));
        }
        let source_status = replica_get(&sources[0]).await?;
        let files = snapshot_files(&source_status);
        let from: Vec<String> = sources.iter().map(|s| s.address.to_string()).collect();
        let mut sync = entry.connection()?.sync.clone();
        sync.files_sync(v1::FilesSyncRequest {
            from_addresses: from.clone(),
            files,
            fast_sync: true,
            max_bytes_per_second: rate.max_bytes_per_second,
            busy_bytes_per_second: rate.busy_bytes_per_second,
            backing_image: source_status.backing_file.clone(),
        })
        .await
        .map_err(|e| EngineError::replica(&address, &e))?;
        drop(ops);
        self.update(&address, |j| {
            *j = v1::ReplicaRebuildState {
                address: address.to_string(),
                is_rebuilding: true,
                state: "in-progress".into(),
                from_addresses: from,
                ..Default::default()
            };
        })
        .await;
        info!(
            volume = %volume.name,
            replica = %address,
            snapshot = %snap,
            max_bytes_per_second = rate.max_bytes_per_second,
            busy_bytes_per_second = rate.busy_bytes_per_second,
            "rebuild started"
        );
        let (me, v, e) = (self.clone(), volume, entry.clone());
        tokio::spawn(async move { me.finish(v, e, sources[0].clone()).await });
        Ok(entry)
    }

    async fn finish(&self, volume: Arc<Volume>, entry: Arc<ReplicaEntry>, source: Arc<ReplicaEntry>) {
        let address = entry.address.clone();
        let result = self.wait_and_verify(&volume, &entry, &source).await;
        match result {
            Ok(()) => {
                info!(volume = %volume.name, replica = %address, "rebuild complete: replica is RW");
                self.update(&address, |j| {
                    j.is_rebuilding = false;
                    j.state = "complete".into();
                    j.progress = 100;
                })
                .await;
            }
            Err(e) => {
                warn!(volume = %volume.name, replica = %address, error = %e, "rebuild failed");
                entry.set_err(&format!("rebuild failed: {e}"));
                self.update(&address, |j| {
                    j.is_rebuilding = false;
                    j.state = "error".into();
                    j.error = e.to_string();
                })
                .await;
            }
        }
    }

    async fn wait_and_verify(
        &self,
        volume: &Volume,
        entry: &ReplicaEntry,
        source: &ReplicaEntry,
    ) -> Result<(), EngineError> {
        let address = &entry.address;
        let conn = entry.connection()?.clone();
        loop {
            if entry.mode() != Mode::Wo {
                return Err(EngineError::FailedPrecondition(format!(
                    "replica went {} during the rebuild: {}",
                    entry.mode().as_str(),
                    entry.error()
                )));
            }
            let s = conn
                .sync
                .clone()
                .replica_rebuild_status(v1::Empty {})
                .await
                .map_err(|e| EngineError::replica(address, &e))?
                .into_inner();
            self.update(address, |j| {
                j.progress = s.progress;
                j.bytes_transferred = s.bytes_transferred;
                j.bytes_skipped = s.bytes_skipped;
                j.bytes_copied_locally = s.bytes_copied_locally;
            })
            .await;
            match s.state.as_str() {
                "complete" => break,
                "in-progress" => tokio::time::sleep(Duration::from_millis(200)).await,
                other => return Err(EngineError::Internal(format!("file sync {other}: {}", s.error))),
            }
        }
        let mut control = conn.control.clone();
        control
            .replica_reload(v1::Empty {})
            .await
            .map_err(|e| EngineError::replica(address, &e))?;
        let mut ops = volume.epochs.lock_ops().await;
        let frozen = ops.freeze("rebuild: WO to RW").await; // counters are stable
        let (src, dst) = (replica_get(source).await?, replica_get(entry).await?);
        if !src.backing_file.is_empty() && dst.backing_file.is_empty() {
            return Err(EngineError::Internal(format!(
                "the source sits on backing image {}, the rebuilt replica on none",
                src.backing_file
            )));
        }
        if tree(&src) != tree(&dst) {
            return Err(EngineError::Internal(format!(
                "snapshot tree differs after sync: source {:?}, rebuilt {:?}",
                tree(&src),
                tree(&dst)
            )));
        }
        if !volume.revision_counter_disabled {
            control
                .revision_counter_set(v1::RevisionCounterSetRequest {
                    counter: src.revision_counter,
                })
                .await
                .map_err(|e| EngineError::replica(address, &e))?;
        }
        control
            .rebuilding_set(v1::RebuildingSetRequest { rebuilding: false })
            .await
            .map_err(|e| EngineError::replica(address, &e))?;
        entry.set_mode(Mode::Rw);
        drop(frozen);
        Ok(())
    }
}
