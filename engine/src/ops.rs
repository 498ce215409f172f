//! Volume operations that change replica state: snapshot, remove/purge, revert, expand, and replica add/remove.
//! Every operation that changes replica state takes the volume's operations lock (operations run one at a time;
//! IO never takes it). Snapshot, revert, expansion and replica add/remove also freeze IO and wait for it to
//! drain, so no IO is in flight while every replica switches heads at once (one name, one point in the write
//! stream) or while a new replica set (epoch) is installed; IO resumes when the operation ends.

use std::collections::HashMap;
use std::sync::Arc;

use corral_disk::BLOCK_SIZE;
use corral_proto::v1;
use tracing::{info, warn};

use crate::epoch::OpsGuard;
use crate::error::EngineError;
use crate::replica_client::{self, Mode, ReplicaEntry, parse_address};
use crate::volume::Volume;

fn rw(reps: &[Arc<ReplicaEntry>]) -> Vec<Arc<ReplicaEntry>> {
    reps.iter().filter(|r| r.mode() == Mode::Rw).cloned().collect()
}

fn writable(reps: &[Arc<ReplicaEntry>]) -> Vec<Arc<ReplicaEntry>> {
    reps.iter()
        .filter(|r| matches!(r.mode(), Mode::Rw | Mode::Wo))
        .cloned()
        .collect()
}

impl Volume {
    /// Takes a snapshot named `name` (a UUID when empty) on every RW and WO replica. IO pauses for the duration:
    /// in-flight requests complete, every replica flushes, then every replica links its head as the snapshot.
    pub async fn snapshot(
        &self,
        name: &str,
        labels: HashMap<String, String>,
        user: bool,
    ) -> Result<String, EngineError> {
        let mut ops = self.epochs.lock_ops().await;
        self.snapshot_locked(&mut ops, name, labels, user).await
    }

    /// [`snapshot`](Self::snapshot) by the holder of the operations lock (a rebuild takes its snapshot inside
    /// its own critical section).
    pub(crate) async fn snapshot_locked(
        &self,
        ops: &mut OpsGuard<'_>,
        name: &str,
        labels: HashMap<String, String>,
        user: bool,
    ) -> Result<String, EngineError> {
        let name = if name.is_empty() {
            uuid::Uuid::new_v4().to_string()
        } else {
            name.to_owned()
        };
        let frozen = ops.freeze("snapshot").await;
        let reps = frozen.set();
        let targets = writable(&reps);
        if !targets.iter().any(|r| r.mode() == Mode::Rw) {
            return Err(EngineError::FailedPrecondition(format!(
                "volume {} has no RW replica",
                self.name
            )));
        }
        let created = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let calls = targets.iter().map(|r| {
            let req = v1::ReplicaSnapshotRequest {
                name: name.clone(),
                user_created: user,
                created: created.clone(),
                labels: labels.clone(),
            };
            async move {
                let conn = r.connection()?;
                conn.data
                    .flush()
                    .await
                    .map_err(|e| EngineError::Internal(format!("flush before snapshot: {e}")))?;
                conn.control
                    .clone()
                    .replica_snapshot(req)
                    .await
                    .map_err(|e| EngineError::replica(&r.address, &e))?;
                Ok::<(), EngineError>(())
            }
        });
        let results = futures::future::join_all(calls).await;
        let mut ok = 0;
        for (r, res) in targets.iter().zip(results) {
            match res {
                Ok(()) => ok += usize::from(r.mode() == Mode::Rw),
                Err(EngineError::Replica {
                    code: tonic::Code::AlreadyExists | tonic::Code::InvalidArgument,
                    message,
                    ..
                }) => {
                    return Err(EngineError::InvalidArgument(format!(
                        "snapshot {name}: {message}"
                    )));
                }
                Err(e) => {
                    r.set_err(&format!("snapshot {name} failed: {e}"));
                }
            }
        }
        if ok == 0 {
            return Err(EngineError::NoHealthyReplica {
                volume: self.name.clone(),
                detail: format!("snapshot {name} failed everywhere"),
            });
        }
        drop(frozen);
        info!(volume = %self.name, snapshot = %name, epoch = reps.epoch, "snapshot taken");
        Ok(name)
    }

    /// The snapshot tree as seen by the first RW replica.
    pub async fn snapshot_list(&self) -> Result<v1::Replica, EngineError> {
        let reps = self.epochs.load();
        let r = rw(&reps)
            .into_iter()
            .next()
            .ok_or_else(|| EngineError::FailedPrecondition("no RW replica".into()))?;
        let mut c = r.connection()?.control.clone();
        Ok(c.replica_get(v1::Empty {})
            .await
            .map_err(|e| EngineError::replica(&r.address, &e))?
            .into_inner()
            .replica
            .unwrap_or_default())
    }

    /// Marks a snapshot removed on every RW replica (refused during a rebuild).
    pub async fn snapshot_remove(&self, name: &str) -> Result<(), EngineError> {
        let ops = self.epochs.lock_ops().await;
        let reps = ops.set();
        if reps.iter().any(|r| r.mode() == Mode::Wo) {
            return Err(EngineError::FailedPrecondition(
                "cannot remove a snapshot while a replica rebuilds".into(),
            ));
        }
        for r in rw(&reps) {
            let mut c = r.connection()?.control.clone();
            c.disk_mark_as_removed(v1::DiskRequest {
                name: name.to_owned(),
            })
            .await
            .map_err(|e| EngineError::replica(&r.address, &e))?;
        }
        Ok(())
    }

    /// Starts a purge on every RW replica.
    pub async fn snapshot_purge(&self) -> Result<(), EngineError> {
        let ops = self.epochs.lock_ops().await;
        let reps = ops.set();
        if reps.iter().any(|r| r.mode() == Mode::Wo) {
            return Err(EngineError::FailedPrecondition(
                "cannot purge while a replica rebuilds".into(),
            ));
        }
        for r in rw(&reps) {
            let mut s = r.connection()?.sync.clone();
            s.snapshot_purge(v1::Empty {})
                .await
                .map_err(|e| EngineError::replica(&r.address, &e))?;
        }
        Ok(())
    }

    /// Purge status of every RW replica, and the combined state.
    pub async fn purge_status(&self) -> Result<v1::PurgeStatusResponse, EngineError> {
        let reps = self.epochs.load();
        let mut out = v1::PurgeStatusResponse::default();
        let mut states = Vec::new();
        for r in rw(&reps) {
            let mut s = r.connection()?.sync.clone();
            let st = s
                .snapshot_purge_status(v1::Empty {})
                .await
                .map_err(|e| EngineError::replica(&r.address, &e))?
                .into_inner();
            states.push(st.clone());
            out.replicas.insert(r.address.to_string(), st);
        }
        out.is_purging = states.iter().any(|s| s.is_purging);
        out.progress = states.iter().map(|s| s.progress).min().unwrap_or(100);
        out.state = if out.is_purging {
            "in-progress".into()
        } else if let Some(e) = states.iter().find(|s| s.state == "error") {
            out.error.clone_from(&e.error);
            "error".into()
        } else if states.iter().all(|s| s.state == "none") {
            "none".into()
        } else {
            "complete".into()
        };
        Ok(out)
    }

    /// Reverts every RW replica to a snapshot. The frontend must be down (clients would see data change under
    /// them) and no replica may be rebuilding.
    pub async fn revert(&self, name: &str) -> Result<(), EngineError> {
        if self.frontend_up.load(std::sync::atomic::Ordering::Acquire) {
            return Err(EngineError::FailedPrecondition(format!(
                "shut the frontend of {} down before reverting",
                self.name
            )));
        }
        let mut ops = self.epochs.lock_ops().await;
        let frozen = ops.freeze("revert").await;
        let reps = frozen.set();
        if reps.iter().any(|r| r.mode() == Mode::Wo) {
            return Err(EngineError::FailedPrecondition(
                "cannot revert while a replica rebuilds".into(),
            ));
        }
        let targets = rw(&reps);
        let created = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let mut ok = 0;
        let mut first_err = None;
        for r in &targets {
            let mut c = r.connection()?.control.clone();
            match c
                .replica_revert(v1::ReplicaRevertRequest {
                    name: name.to_owned(),
                    created: created.clone(),
                })
                .await
            {
                Ok(_) => ok += 1,
                Err(e)
                    if matches!(
                        e.code(),
                        tonic::Code::NotFound
                            | tonic::Code::InvalidArgument
                            | tonic::Code::FailedPrecondition
                    ) && ok == 0 =>
                {
                    return Err(EngineError::replica(&r.address, &e));
                }
                Err(e) => {
                    r.set_err(&format!("revert to {name} failed: {}", e.message()));
                    first_err.get_or_insert(e);
                }
            }
        }
        if ok == 0 {
            return Err(EngineError::NoHealthyReplica {
                volume: self.name.clone(),
                detail: format!("revert failed: {first_err:?}"),
            });
        }
        info!(volume = %self.name, snapshot = %name, "reverted");
        Ok(())
    }

    /// Grows the volume on every RW and WO replica (each takes an `expand-<size>` system snapshot).
    pub async fn expand(&self, size: u64) -> Result<(), EngineError> {
        let cur = self.size();
        if size <= cur || !size.is_multiple_of(BLOCK_SIZE) {
            return Err(EngineError::InvalidArgument(format!(
                "new size {size} must be larger than {cur} and a multiple of {BLOCK_SIZE}"
            )));
        }
        let mut ops = self.epochs.lock_ops().await;
        let frozen = ops.freeze("expand").await;
        let reps = frozen.set();
        let mut ok = 0;
        for r in writable(&reps) {
            let mut c = r.connection()?.control.clone();
            match c.replica_expand(v1::ReplicaExpandRequest { size }).await {
                Ok(_) => ok += usize::from(r.mode() == Mode::Rw),
                Err(e) => {
                    r.set_err(&format!("expand to {size} failed: {}", e.message()));
                }
            }
        }
        if ok == 0 {
            return Err(EngineError::NoHealthyReplica {
                volume: self.name.clone(),
                detail: "expansion failed everywhere".into(),
            });
        }
        self.set_size(size);
        drop(frozen);
        info!(volume = %self.name, size, "expanded");
        Ok(())
    }

    /// Removes a replica from the volume (it keeps its data; the daemon keeps running).
    pub async fn replica_remove(&self, address: &str) -> Result<(), EngineError> {
        let address = parse_address(address)?;
        let mut ops = self.epochs.lock_ops().await;
        let mut frozen = ops.freeze("replica remove").await;
        let mut reps = frozen.set().to_vec();
        let Some(i) = reps.iter().position(|r| r.address == address) else {
            return Err(EngineError::NotFound(format!(
                "replica {address} is not part of volume {}",
                self.name
            )));
        };
        if reps[i].mode() == Mode::Rw && reps.iter().filter(|r| r.mode() == Mode::Rw).count() == 1 {
            return Err(EngineError::FailedPrecondition(format!(
                "{address} is the last RW replica of {}",
                self.name
            )));
        }
        let r = reps.remove(i);
        let epoch = frozen.install(reps);
        drop(frozen);
        // IO resumed on the new set: nothing sends to the removed replica any more.
        if let Some(c) = &r.conn {
            c.data.close().await;
        }
        warn!(volume = %self.name, replica = %address, epoch, "replica removed");
        Ok(())
    }

    /// Adds a replica without copying data: allowed only when the volume has no usable replica data to copy
    /// (no RW replica), as when a volume is first assembled. Otherwise use a rebuild.
    pub async fn replica_add_empty(
        &self,
        address: &str,
        client: &data_protocol::ClientConfig,
    ) -> Result<Arc<ReplicaEntry>, EngineError> {
        let address = parse_address(address)?;
        let mut ops = self.epochs.lock_ops().await;
        let reps = ops.set();
        if reps.iter().any(|r| r.address == address) {
            return Err(EngineError::AlreadyExists(format!(
                "replica {address} is already part of {}",
                self.name
            )));
        }
        if reps.iter().any(|r| r.mode() == Mode::Rw) {
            return Err(EngineError::FailedPrecondition(format!(
                "volume {} has data: add {address} with a rebuild",
                self.name
            )));
        }
        let (conn, status) = replica_client::connect(
            &address,
            client,
            Some((self.size(), self.revision_counter_disabled)),
        )
        .await?;
        if status.size != self.size() {
            return Err(EngineError::InvalidArgument(format!(
                "replica {address} has size {}, volume {} has {}",
                status.size,
                self.name,
                self.size()
            )));
        }
        let e = Arc::new(ReplicaEntry::new(address, conn, Mode::Rw));
        let mut frozen = ops.freeze("replica add").await;
        let mut next = frozen.set().to_vec();
        next.push(e.clone());
        frozen.install(next);
        Ok(e)
    }
}
