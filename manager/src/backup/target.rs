//! Opening a backup target from its documents, and the leader's poller: every target is listed every
//! `pollInterval` seconds and mirrored into [`BackupVolume`] and [`Backup`] documents, so backups made by another
//! cluster (or by `corral-engine backup`) on the same target appear, and ones deleted there go. A target that
//! cannot be listed is `available: false` with the reason; its documents stay as they were.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use backupstore::{BackupConfig, BackupStore, BackupUrl, ErrorKind};
use tokio_util::sync::CancellationToken;

use super::model::{
    Backup, BackupState, BackupTarget, BackupTargetSecret, BackupTargetSpec, BackupVolume, key,
};
use crate::context::Ctx;
use crate::runtime::{Requeue, WorkQueue, feed, run_worker};
use crate::store::StoreError;

/// How long a listing may take before the target counts as unreachable (the object store retries meanwhile).
pub const LIST_TIMEOUT: Duration = Duration::from_secs(15);

/// Why a target cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("backup target {0:?} is not set (corral backup target set)")]
    NotSet(String),
    #[error("backup target {name}: {reason}")]
    Unusable { name: String, reason: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A target opened with its credentials.
pub struct OpenTarget {
    pub name: String,
    pub spec: BackupTargetSpec,
    pub store: BackupStore,
    /// Passed to the replicas in each request (never logged: `Debug` is not derived).
    pub credentials: BTreeMap<String, String>,
}

impl OpenTarget {
    /// The URL of one backup on this target.
    pub fn backup_url(&self, volume: &str, backup: &str) -> String {
        self.store.backup_url(volume, backup)
    }
}

/// Opens a target from a spec and credentials (nothing is read from it yet).
pub fn open_spec(
    name: &str,
    spec: &BackupTargetSpec,
    credentials: BTreeMap<String, String>,
) -> Result<OpenTarget, TargetError> {
    let unusable = |reason: String| TargetError::Unusable {
        name: name.to_owned(),
        reason,
    };
    let url = BackupUrl::parse(&spec.store_url()).map_err(|e| unusable(e.to_string()))?;
    let store = BackupStore::open(&url, &credentials).map_err(|e| unusable(e.to_string()))?;
    Ok(OpenTarget {
        name: name.to_owned(),
        spec: spec.clone(),
        store,
        credentials,
    })
}

/// Opens the target `name` as stored.
pub async fn open(ctx: &Ctx, name: &str) -> Result<OpenTarget, TargetError> {
    let t = ctx
        .db
        .get::<BackupTarget>(name)
        .await?
        .ok_or_else(|| TargetError::NotSet(name.to_owned()))?;
    let credentials = ctx
        .db
        .get::<BackupTargetSecret>(name)
        .await?
        .map(|s| s.data.credentials)
        .unwrap_or_default();
    open_spec(name, &t.data.spec, credentials)
}

/// Lists the target's volumes within [`LIST_TIMEOUT`]: proves it is reachable, the bucket exists and the
/// credentials are accepted.
pub async fn check(t: &OpenTarget) -> Result<Vec<String>, TargetError> {
    let unusable = |reason: String| TargetError::Unusable {
        name: t.name.clone(),
        reason,
    };
    match tokio::time::timeout(LIST_TIMEOUT, t.store.list_volumes()).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(unusable(e.to_string())),
        Err(_) => Err(unusable(format!(
            "no answer within {} s (is the endpoint reachable?)",
            LIST_TIMEOUT.as_secs()
        ))),
    }
}

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    feed::<BackupTarget>(
        ctx.db.clone(),
        q.clone(),
        cancel.clone(),
        Duration::from_secs(300),
        |ev| Some(ev.name().to_owned()),
        |o| Some(o.name.clone()),
    );
    let ctx = ctx.clone();
    let c = cancel.clone();
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("backup-target", q, c, m, |name| poll(ctx.clone(), name)).await;
    });
}

/// Lists one target into the store and records whether that worked.
async fn poll(ctx: Ctx, name: String) -> anyhow::Result<Requeue> {
    let Some(t) = ctx.db.get::<BackupTarget>(&name).await? else {
        return Ok(None);
    };
    let interval = Duration::from_secs(t.data.spec.poll_interval.max(1));
    let result = async {
        let ot = open(&ctx, &name).await?;
        sync(&ctx, &ot).await
    }
    .await;
    let (available, message) = match result {
        Ok(()) => (true, String::new()),
        Err(TargetError::Store(e)) => return Err(e.into()),
        Err(e) => (false, e.to_string()),
    };
    if !available {
        tracing::warn!(target = %name, reason = %message, "backup target unavailable");
    }
    let now = crate::runtime::now();
    match ctx
        .db
        .modify::<BackupTarget>(&name, |t| {
            let before = t.status.clone();
            t.status.available = available;
            t.status.message.clone_from(&message);
            if available {
                t.status.last_synced_at = now;
            }
            t.status != before
        })
        .await
    {
        Ok(_) | Err(StoreError::NotFound { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(Some(interval))
}

/// Fills `b` from the record the target holds.
pub fn fill_from_config(b: &mut Backup, c: &BackupConfig) {
    b.volume.clone_from(&c.volume);
    b.name.clone_from(&c.name);
    b.snapshot.clone_from(&c.snapshot);
    b.labels.clone_from(&c.labels);
    b.size = c.size;
    b.is_incremental = c.is_incremental;
    b.chain_position = c.chain_position;
    b.full_reason = c
        .full_reason
        .as_ref()
        .map(ToString::to_string)
        .unwrap_or_default();
    b.base_backup.clone_from(&c.base_backup);
    b.read_bytes = c.stats.read_bytes;
    b.new_bytes = c.stats.new_bytes;
    b.started.clone_from(&c.started);
    b.completed.clone_from(&c.completed);
    b.backing_image_name.clone_from(&c.backing_image_name);
    b.backing_image_checksum.clone_from(&c.backing_image_checksum);
    match c.state {
        backupstore::BackupState::Complete => {
            b.state = BackupState::Completed;
            b.progress = 100;
            b.error.clear();
        }
        backupstore::BackupState::InProgress => {
            if b.state != BackupState::Failed {
                b.state = BackupState::InProgress;
            }
        }
    }
}

/// Mirrors one target into the store.
async fn sync(ctx: &Ctx, t: &OpenTarget) -> Result<(), TargetError> {
    let err = |e: backupstore::BackupStoreError| TargetError::Unusable {
        name: t.name.clone(),
        reason: e.to_string(),
    };
    let volumes = check(t).await?;
    let mut seen_volumes = BTreeSet::new();
    let mut seen_backups = BTreeSet::new();
    for v in &volumes {
        let cfg = match t.store.volume_config(v).await {
            Ok(c) => c,
            // A volume whose first backup just started, or a name that is not one of ours.
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::InvalidArgument) => continue,
            Err(e) => return Err(err(e)),
        };
        let backups = t.store.list_backups(v).await.map_err(err)?;
        let bv = volume_doc(t, v, &cfg, backups.len());
        let k = key(&t.name, v);
        seen_volumes.insert(k.clone());
        upsert(ctx, &k, bv).await?;
        for c in &backups {
            let k = key(&t.name, &c.name);
            seen_backups.insert(k.clone());
            let existing = ctx.db.get::<Backup>(&k).await?;
            match existing {
                // A job of this cluster: its controller writes it.
                Some(o) if o.data.state.active() && !o.data.source_volume.is_empty() => {}
                Some(mut o) => {
                    if o.data.volume != *v {
                        tracing::warn!(target = %t.name, backup = %c.name, volume = %v, other = %o.data.volume,
                            "two backup volumes hold a backup of this name: listing only the first");
                        continue;
                    }
                    let before = o.data.clone();
                    fill_from_config(&mut o.data, c);
                    if o.data != before {
                        absent_or_conflict_ok(ctx.db.update(&mut o).await)?;
                    }
                }
                None => {
                    let mut b = Backup {
                        target: t.name.clone(),
                        ..Default::default()
                    };
                    fill_from_config(&mut b, c);
                    match ctx.db.create(&k, b).await {
                        Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
    }
    for bv in ctx.db.list::<BackupVolume>().await? {
        if bv.data.target == t.name && !seen_volumes.contains(&bv.name) {
            ctx.db.delete_any::<BackupVolume>(&bv.name).await?;
        }
    }
    for b in ctx.db.list::<Backup>().await? {
        // Jobs of this cluster that have not reached the target yet, or failed before, stay.
        let ours_unfinished = !b.data.source_volume.is_empty() && b.data.state != BackupState::Completed;
        if b.data.target == t.name && !seen_backups.contains(&b.name) && !ours_unfinished {
            ctx.db.delete_any::<Backup>(&b.name).await?;
        }
    }
    Ok(())
}

fn volume_doc(t: &OpenTarget, v: &str, cfg: &backupstore::VolumeConfig, backups: usize) -> BackupVolume {
    BackupVolume {
        target: t.name.clone(),
        name: v.to_owned(),
        size: cfg.size,
        last_backup_name: cfg.last_backup_name.clone(),
        last_backup_at: cfg.last_backup_at.clone(),
        backing_image_name: cfg.backing_image_name.clone(),
        backing_image_checksum: cfg.backing_image_checksum.clone(),
        labels: cfg.labels.clone(),
        created: cfg.created.clone(),
        backup_count: u32::try_from(backups).unwrap_or(u32::MAX),
        block_size: cfg.block_size,
    }
}

/// Records one backup volume as the target holds it now (after a backup of this cluster completed, so it shows
/// before the next listing).
pub async fn record_volume(ctx: &Ctx, t: &OpenTarget, v: &str) -> Result<(), TargetError> {
    let err = |e: backupstore::BackupStoreError| TargetError::Unusable {
        name: t.name.clone(),
        reason: e.to_string(),
    };
    let cfg = t.store.volume_config(v).await.map_err(err)?;
    let n = t.store.backup_names(v).await.map_err(err)?.len();
    upsert(ctx, &key(&t.name, v), volume_doc(t, v, &cfg, n)).await?;
    Ok(())
}

fn absent_or_conflict_ok(r: Result<(), StoreError>) -> Result<(), StoreError> {
    match r {
        Ok(()) | Err(StoreError::NotFound { .. } | StoreError::Conflict { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

async fn upsert(ctx: &Ctx, k: &str, data: BackupVolume) -> Result<(), StoreError> {
    match ctx.db.get::<BackupVolume>(k).await? {
        Some(mut o) if o.data != data => {
            o.data = data;
            absent_or_conflict_ok(ctx.db.update(&mut o).await)
        }
        Some(_) => Ok(()),
        None => match ctx.db.create(k, data).await {
            Ok(_) | Err(StoreError::AlreadyExists { .. }) => Ok(()),
            Err(e) => Err(e),
        },
    }
}
