//! Engine generations (issue 39; the replica side is `docs/formats.md`, "Engine generation"): every start of a
//! volume's engine — attach, re-attach on another node, salvage, restart after a crash or a fence — takes a new
//! generation from the store with a compare-and-set on the volume's `engine-generation` document, so two managers
//! (or one manager racing itself) never hand out the same number, and passes it to `corral-engine serve
//! --generation`. A replica refuses every engine below the highest generation it accepted, so an engine left
//! running on the wrong side of a partition can no longer write into the volume.
//!
//! The document outlives the engine document (detach deletes that one; the next attach must still be higher) and
//! goes with the volume.

use serde::{Deserialize, Serialize};

use crate::store::{Db, Resource, StoreError};

/// The last generation handed out for a volume's engine; the document is named by the volume.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EngineGeneration {
    pub generation: u64,
}

impl Resource for EngineGeneration {
    const KIND: &'static str = "engine-generation";
}

/// Takes the next generation of `volume`'s engine: one more than the last one handed out (1 for the first), written
/// with a compare-and-set (create when absent, update at the version read), retried on a lost race.
pub async fn next(db: &Db, volume: &str) -> Result<u64, StoreError> {
    loop {
        let Some(mut obj) = db.get::<EngineGeneration>(volume).await? else {
            match db.create(volume, EngineGeneration { generation: 1 }).await {
                Ok(_) => return Ok(1),
                Err(StoreError::AlreadyExists { .. }) => continue,
                Err(e) => return Err(e),
            }
        };
        let generation = obj.data.generation.checked_add(1).ok_or_else(|| {
            StoreError::Backend(format!(
                "engine generation of volume {volume:?} is at its maximum"
            ))
        })?;
        obj.data.generation = generation;
        match db.update(&mut obj).await {
            Ok(()) => return Ok(generation),
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Raises the last generation handed out for `volume` to at least `seen`, a generation a replica of the volume
/// accepted (an engine started by hand, or a store restored from an older backup): the next start must be above it,
/// or the replicas would refuse the engine the store asks for. Never lowers it.
pub async fn raise_to(db: &Db, volume: &str, seen: u64) -> Result<(), StoreError> {
    loop {
        let Some(mut obj) = db.get::<EngineGeneration>(volume).await? else {
            match db.create(volume, EngineGeneration { generation: seen }).await {
                Ok(_) => return Ok(()),
                Err(StoreError::AlreadyExists { .. }) => continue,
                Err(e) => return Err(e),
            }
        };
        if obj.data.generation >= seen {
            return Ok(());
        }
        obj.data.generation = seen;
        match db.update(&mut obj).await {
            Ok(()) => return Ok(()),
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// The newer generation named by an engine's `fenced` status ("fenced by generation N > M ..."), if it parses.
pub fn fencing_generation(fenced: &str) -> Option<u64> {
    fenced
        .strip_prefix("fenced by generation ")?
        .split(' ')
        .next()?
        .parse()
        .ok()
}

/// The last generation handed out for `volume`'s engine (0: none yet).
pub async fn current(db: &Db, volume: &str) -> Result<u64, StoreError> {
    Ok(db
        .get::<EngineGeneration>(volume)
        .await?
        .map_or(0, |o| o.data.generation))
}

/// Forgets `volume`'s generations, once the volume and its replicas are gone.
pub async fn forget(db: &Db, volume: &str) -> Result<(), StoreError> {
    db.delete_any::<EngineGeneration>(volume).await
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[tokio::test]
    async fn concurrent_starts_never_get_the_same_generation() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::embedded::EmbeddedStore::open(&dir.path().join("store.redb"))
            .await
            .unwrap();
        let db = Db::new(Arc::new(store));
        let tasks: Vec<_> = (0..16)
            .map(|_| {
                let db = db.clone();
                tokio::spawn(async move { next(&db, "vol").await.unwrap() })
            })
            .collect();
        let mut got = Vec::new();
        for t in tasks {
            got.push(t.await.unwrap());
        }
        got.sort_unstable();
        assert_eq!(got, (1..=16).collect::<Vec<u64>>());
        assert_eq!(current(&db, "vol").await.unwrap(), 16);
        forget(&db, "vol").await.unwrap();
        assert_eq!(current(&db, "vol").await.unwrap(), 0);
        assert_eq!(next(&db, "vol").await.unwrap(), 1);
        raise_to(&db, "vol", 7).await.unwrap();
        raise_to(&db, "vol", 3).await.unwrap();
        assert_eq!(next(&db, "vol").await.unwrap(), 8, "raised, never lowered");
    }

    #[test]
    fn the_fencing_generation_is_read_from_the_engine_status() {
        assert_eq!(
            fencing_generation("fenced by generation 12 > 9 (replica 10.0.0.1:1000)"),
            Some(12)
        );
        assert_eq!(fencing_generation(""), None);
        assert_eq!(fencing_generation("fenced by generation x > 9"), None);
    }
}
