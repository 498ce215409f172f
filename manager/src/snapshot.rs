//! Snapshots as observed through a volume's engine: converted from the engine's snapshot tree and kept in the
//! store (kind `snapshot`, name `<volume>.<snapshot>`) so they can be listed while the volume is detached.

use std::collections::BTreeMap;

use corral_proto::v1::SnapshotListResponse;

use crate::model::Snapshot;
use crate::store::{Db, StoreError, absent_ok};

/// `volume-snap-NAME.img` → `NAME` (other files keep their name).
pub fn snapshot_name(file: &str) -> String {
    file.strip_prefix("volume-snap-")
        .and_then(|s| s.strip_suffix(".img"))
        .unwrap_or(file)
        .to_owned()
}

/// The user-visible snapshots of an engine's tree, oldest first.
pub fn from_engine(volume: &str, list: &SnapshotListResponse) -> Vec<Snapshot> {
    let mut out: Vec<Snapshot> = list
        .disks
        .values()
        .filter(|d| d.name.starts_with("volume-snap-"))
        .map(|d| Snapshot {
            volume: volume.to_owned(),
            name: snapshot_name(&d.name),
            parent: snapshot_name(&d.parent),
            children: d.children.iter().map(|c| snapshot_name(c)).collect(),
            created: d.created.clone(),
            size: d.size,
            removed: d.removed,
            user_created: d.user_created,
            labels: d.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        })
        .collect();
    out.sort_by(|a, b| a.created.cmp(&b.created).then_with(|| a.name.cmp(&b.name)));
    out
}

fn doc_name(volume: &str, snapshot: &str) -> String {
    format!("{volume}.{snapshot}")
}

/// The recorded snapshots of `volume`, oldest first.
pub async fn recorded(db: &Db, volume: &str) -> Result<Vec<Snapshot>, StoreError> {
    let mut out: Vec<Snapshot> = db
        .list::<Snapshot>()
        .await?
        .into_iter()
        .map(|o| o.data)
        .filter(|s| s.volume == volume)
        .collect();
    out.sort_by(|a, b| a.created.cmp(&b.created).then_with(|| a.name.cmp(&b.name)));
    Ok(out)
}

/// Makes the store hold exactly `observed` for `volume`; writes only what changed. The engine controller and the
/// API both record: a write that lost to the other is retried from a fresh read.
pub async fn record(db: &Db, volume: &str, observed: &[Snapshot]) -> Result<(), StoreError> {
    let mut attempts = 0;
    loop {
        match record_once(db, volume, observed).await {
            Err(StoreError::Conflict { .. }) if attempts < 5 => attempts += 1,
            r => return r,
        }
    }
}

async fn record_once(db: &Db, volume: &str, observed: &[Snapshot]) -> Result<(), StoreError> {
    let current: BTreeMap<String, crate::store::Object<Snapshot>> = db
        .list::<Snapshot>()
        .await?
        .into_iter()
        .filter(|o| o.data.volume == volume)
        .map(|o| (o.data.name.clone(), o))
        .collect();
    for s in observed {
        match current.get(&s.name) {
            Some(o) if o.data == *s => {}
            Some(o) => {
                let mut o = o.clone();
                o.data = s.clone();
                absent_ok(db.update(&mut o).await)?;
            }
            None => match db.create(&doc_name(volume, &s.name), s.clone()).await {
                Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
                Err(e) => return Err(e),
            },
        }
    }
    for (name, o) in &current {
        if !observed.iter().any(|s| s.name == *name) {
            absent_ok(db.delete::<Snapshot>(&o.name, o.version).await)?;
        }
    }
    Ok(())
}
