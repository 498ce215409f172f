//! What the v2 data engine cannot do yet, in one place: the v2 replica answers UNIMPLEMENTED to these today
//! (`replica/src/v2/service.rs`, `not_yet`), so the manager refuses them up front with a clear message instead of
//! letting an engine, a clone or a backup fail half-way. Once the replica supports one, delete its line in
//! `UNSUPPORTED` and the manager lets it through.

use crate::model::DataEngine;

/// An operation a v2 volume may not support.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Adding a replica to a volume that already holds data (a replacement): the engine rebuilds it.
    Rebuild,
    /// A clone from or into a v2 volume (snapshot export over sparse-sync): supported.
    Clone,
    /// A backup of a v2 volume (supported: the v2 daemon serves `ReplicaBackupService`).
    Backup,
    /// A restore into a v2 volume (supported, as `Backup`).
    Restore,
    /// A v2 volume over a backing image (supported: a v2 backing image, its replicas' heads cloned from the
    /// image's snapshot lvol, issue 21).
    BackingImage,
}

impl Op {
    fn what(self) -> &'static str {
        match self {
            Self::Rebuild => {
                "rebuild a replica (replacing a failed one, or adding one to a volume holding data)"
            }
            Self::Clone => "clone a volume from or into a v2 volume",
            Self::Backup => "back up a v2 volume",
            Self::Restore => "restore a backup into a v2 volume",
            Self::BackingImage => "put a v2 volume over a backing image",
        }
    }
}

/// What v2 replicas cannot do yet. Lift an entry when `replica/src/v2` gains it.
const UNSUPPORTED: &[Op] = &[];

/// Refuses `op` on a volume of `engine` when v2 cannot do it yet; the message says why and what to use instead.
pub fn check(engine: DataEngine, op: Op) -> Result<(), String> {
    if engine == DataEngine::V2 && UNSUPPORTED.contains(&op) {
        return Err(format!(
            "the v2 data engine cannot {} yet (its replicas answer UNIMPLEMENTED, issue 20); use a v1 volume for it",
            op.what()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neither_engine_is_refused_an_operation_v2_replicas_support() {
        for op in [Op::Rebuild, Op::Clone, Op::Backup, Op::Restore, Op::BackingImage] {
            assert_eq!(check(DataEngine::V1, op), Ok(()));
        }
        for op in [Op::Rebuild, Op::Clone, Op::Backup, Op::Restore, Op::BackingImage] {
            assert_eq!(check(DataEngine::V2, op), Ok(()));
        }
    }
}
