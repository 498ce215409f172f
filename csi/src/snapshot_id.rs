//! Snapshot IDs say where the snapshot lives: `snap://VOLUME/SNAPSHOT` is a snapshot inside a volume's chain,
//! `backup://TARGET/VOLUME/BACKUP` a backup on one of the manager's backup targets: the target's name, the backup
//! volume (the name of the volume it was made from) and the backup's name. Every part is a path component (no
//! `/`; a manager name never holds a `:` either), so an ID names one object, whichever target it is on.

/// A parsed snapshot ID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotId {
    InVolume {
        volume: String,
        snapshot: String,
    },
    Backup {
        target: String,
        volume: String,
        backup: String,
    },
}

fn valid(s: &str) -> bool {
    corral_disk::identity::check_path_component("name", s).is_ok()
}

impl SnapshotId {
    /// None for a string that is no Corral snapshot ID (the CSI calls treat it as "does not exist").
    pub fn parse(id: &str) -> Option<SnapshotId> {
        if let Some(rest) = id.strip_prefix("snap://") {
            let (volume, snapshot) = rest.split_once('/')?;
            if !valid(volume) || !valid(snapshot) {
                return None;
            }
            return Some(SnapshotId::InVolume {
                volume: volume.to_owned(),
                snapshot: snapshot.to_owned(),
            });
        }
        let rest = id.strip_prefix("backup://")?;
        let mut parts = rest.split('/');
        let (target, volume, backup) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || ![target, volume, backup].into_iter().all(valid) {
            return None;
        }
        Some(SnapshotId::Backup {
            target: target.to_owned(),
            volume: volume.to_owned(),
            backup: backup.to_owned(),
        })
    }

    pub fn in_volume(volume: &str, snapshot: &str) -> String {
        format!("snap://{volume}/{snapshot}")
    }

    pub fn backup(target: &str, volume: &str, backup: &str) -> String {
        format!("backup://{target}/{volume}/{backup}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_malformed_ones_are_refused() {
        assert_eq!(
            SnapshotId::parse(&SnapshotId::in_volume("pvc-1", "snapshot-2")),
            Some(SnapshotId::InVolume {
                volume: "pvc-1".into(),
                snapshot: "snapshot-2".into()
            })
        );
        assert_eq!(
            SnapshotId::parse(&SnapshotId::backup("default", "pvc-1", "backup-0123456789abcdef")),
            Some(SnapshotId::Backup {
                target: "default".into(),
                volume: "pvc-1".into(),
                backup: "backup-0123456789abcdef".into()
            })
        );
        for bad in [
            "",
            "snap://",
            "snap://v",
            "snap://v/",
            "snap://../x",
            "snap://v/a/b",
            "vol://v",
            "backup://",
            "backup://s3/b1",
            "backup://t/v/",
            "backup:///v/b",
            "backup://t/v/b/extra",
            "backup://t/../b",
            "backup://t:x/v/b",
        ] {
            assert_eq!(SnapshotId::parse(bad), None, "{bad}");
        }
    }
}
