//! Volume clone, engine side (`ControllerService.SnapshotClone`): the engine of the *target* volume asks the source
//! volume's engine for its replicas, picks a RW one, and starts `SnapshotClone` on every RW replica of the target;
//! each target replica pulls the snapshot flattened from that source replica (see the replica's `clone` and
//! `export` modules). The engine drives it rather than the CLI because it alone knows, under its replica lock, that
//! no replica is rebuilding, and because the manager calls the same RPC. `SnapshotCloneStatus` combines the
//! replicas' job states. The operator commands are in [`crate::cli::clone`], the export of a snapshot to a file in
//! [`crate::export`].

use std::sync::Arc;
use std::time::Duration;

use corral_proto::v1::{self, sync_agent_service_client::SyncAgentServiceClient};
use tracing::info;

use crate::error::EngineError;
use crate::remote_engine::{engine_client, engine_err, rw_replica_of};
use crate::replica_client::{Mode, ReplicaChannel, ReplicaEntry};
use crate::volume::Volume;

fn sync_client(r: &ReplicaEntry) -> Result<SyncAgentServiceClient<ReplicaChannel>, EngineError> {
    Ok(r.connection()?.sync.clone())
}

impl Volume {
    /// Starts cloning `req.snapshot_name` of the volume at `req.from_engine_address` into every RW replica.
    pub async fn snapshot_clone(&self, req: &v1::VolumeCloneRequest) -> Result<String, EngineError> {
        if req.snapshot_name.is_empty() {
            return Err(EngineError::InvalidArgument(
                "a clone needs a snapshot name".into(),
            ));
        }
        // The clone writes every replica's chain underneath the frontend: writes through it would be lost.
        if self.frontend_up.load(std::sync::atomic::Ordering::Acquire) {
            return Err(EngineError::FailedPrecondition(format!(
                "the frontend of {} is attached (serving IO): writes through it would be lost under the clone; \
                 shut it down first (or run the target without a frontend)",
                self.name
            )));
        }
        let from_url = &req.from_engine_address;
        let src_size = engine_client(from_url)
            .await?
            .volume_get(v1::Empty {})
            .await
            .map_err(|e| engine_err(from_url, &e))?
            .into_inner()
            .size;
        if src_size != self.size() {
            return Err(EngineError::InvalidArgument(format!(
                "the source volume is {src_size} bytes but {} is {} bytes: a clone needs volumes of the same size",
                self.name,
                self.size()
            )));
        }
        let from = rw_replica_of(from_url).await?;
        // The operations lock keeps a rebuild from starting while the clones start.
        let ops = self.epochs.lock_ops().await;
        let reps = ops.set();
        if reps.iter().any(|r| r.mode() == Mode::Wo) {
            return Err(EngineError::FailedPrecondition(format!(
                "a replica of {} is rebuilding; clone after it finishes",
                self.name
            )));
        }
        let targets: Vec<Arc<ReplicaEntry>> = reps.iter().filter(|r| r.mode() == Mode::Rw).cloned().collect();
        if targets.is_empty() {
            return Err(EngineError::FailedPrecondition(format!(
                "volume {} has no RW replica",
                self.name
            )));
        }
        for r in &targets {
            let s = sync_client(r)?
                .snapshot_clone_status(v1::Empty {})
                .await
                .map_err(|e| EngineError::replica(&r.address, &e))?
                .into_inner();
            if s.is_running {
                return Err(EngineError::FailedPrecondition(format!(
                    "replica {} is already cloning {}",
                    r.address, s.snapshot_name
                )));
            }
        }
        // From the first started clone on, the replicas may end with different data: the watcher puts every
        // replica that did not complete out of the volume once one has completed.
        let mut any_started = false;
        let mut start_error = None;
        for r in &targets {
            let res = match sync_client(r) {
                Ok(mut c) => c
                    .snapshot_clone(v1::SnapshotCloneRequest {
                        from_address: from.to_string(),
                        snapshot_file_name: req.snapshot_name.clone(),
                        export_backing_image_if_exist: req.export_backing_image_if_exist,
                        max_bytes_per_second: req.max_bytes_per_second,
                    })
                    .await
                    .map_err(|e| EngineError::replica(&r.address, &e)),
                Err(e) => Err(e),
            };
            match res {
                Ok(_) => any_started = true,
                Err(e) => {
                    start_error = Some(e);
                    break;
                }
            }
        }
        if any_started {
            watch_clone_outcome(self.name.clone(), targets.clone());
        }
        if let Some(e) = start_error {
            return Err(e);
        }
        info!(
            volume = %self.name, from = %from, snapshot = %req.snapshot_name, replicas = targets.len(),
            "clone started"
        );
        Ok(from.to_string())
    }

    /// The clone state of every replica that can answer, and the combined state (error when any failed).
    pub async fn clone_status(&self) -> Result<v1::VolumeCloneStatusResponse, EngineError> {
        let reps = self.epochs.load();
        let mut out = v1::VolumeCloneStatusResponse::default();
        let mut states = Vec::new();
        for r in reps.iter().filter(|r| r.mode() != Mode::Err) {
            let st = sync_client(r)?
                .snapshot_clone_status(v1::Empty {})
                .await
                .map_err(|e| EngineError::replica(&r.address, &e))?
                .into_inner();
            states.push(st.clone());
            out.replicas.insert(r.address.to_string(), st);
        }
        let active: Vec<&v1::JobStatusResponse> = states.iter().filter(|s| s.state != "none").collect();
        if let Some(s) = active.first() {
            out.from_replica_address = s.from_addresses.first().cloned().unwrap_or_default();
            out.snapshot_name.clone_from(&s.snapshot_name);
        }
        out.is_cloning = active.iter().any(|s| s.is_running);
        out.progress = active.iter().map(|s| s.progress).min().unwrap_or(0);
        out.state = if let Some(e) = active
            .iter()
            .find(|s| s.state == "error" || s.state == "cancelled")
        {
            out.error.clone_from(&e.error);
            "error".into()
        } else if out.is_cloning {
            "in-progress".into()
        } else if active.is_empty() {
            "none".into()
        } else {
            "complete".into()
        };
        Ok(out)
    }
}

/// Waits until no replica of `targets` is cloning any more, then, if the clone completed on some of them, puts
/// every other one ERR: those still hold the volume's old data (a failed clone leaves a replica as it was), so
/// serving reads from both would return two different volumes. Rebuild brings them back from a completed one.
/// When no replica completed, every one kept its old data and nothing changes.
fn watch_clone_outcome(volume: String, targets: Vec<Arc<ReplicaEntry>>) {
    tokio::spawn(async move {
        // A replica whose status cannot be read this many times in a row counts as not completed.
        const MAX_STATUS_FAILURES: u32 = 20;
        let mut failures = vec![0u32; targets.len()];
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let mut running = false;
            let mut completed = vec![false; targets.len()];
            for (i, r) in targets.iter().enumerate() {
                if r.mode() == Mode::Err {
                    continue;
                }
                let status = match sync_client(r) {
                    Ok(mut c) => c
                        .snapshot_clone_status(v1::Empty {})
                        .await
                        .map(tonic::Response::into_inner)
                        .ok(),
                    Err(_) => None,
                };
                match status {
                    Some(s) if s.is_running => running = true,
                    Some(s) => completed[i] = s.state == "complete",
                    None => {
                        failures[i] += 1;
                        running |= failures[i] < MAX_STATUS_FAILURES;
                    }
                }
            }
            if running {
                continue;
            }
            if completed.iter().any(|c| *c) {
                for (r, done) in targets.iter().zip(&completed) {
                    if !done && r.set_err("the clone did not complete on this replica while it did on others: its data differs") {
                        tracing::warn!(volume = %volume, replica = %r.address, "clone incomplete on this replica: set ERR");
                    }
                }
            }
            return;
        }
    });
}
