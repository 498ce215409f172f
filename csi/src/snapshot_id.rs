//! Snapshot IDs say where the snapshot lives: `snap://VOLUME/SNAPSHOT` is a snapshot inside a volume's chain,
//! `backup://...` a backup in a backup store (reserved until the manager has backups).

/// A parsed snapshot ID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotId {
    InVolume { volume: String, snapshot: String },
    Backup(String),
}

impl SnapshotId {
    /// None for a string that is no Corral snapshot ID (the CSI calls treat it as "does not exist").
    pub fn parse(id: &str) -> Option<SnapshotId> {
        if let Some(rest) = id.strip_prefix("snap://") {
            let (volume, snapshot) = rest.split_once('/')?;
            let valid = |s: &str| corral_daemon::disk::check_path_component("name", s).is_ok();
            if !valid(volume) || !valid(snapshot) {
                return None;
            }
            return Some(SnapshotId::InVolume {
                volume: volume.to_owned(),
                snapshot: snapshot.to_owned(),
            });
        }
        id.strip_prefix("backup://")
            .filter(|r| !r.is_empty())
            .map(|r| SnapshotId::Backup(r.to_owned()))
    }

    pub fn in_volume(volume: &str, snapshot: &str) -> String {
        format!("snap://{volume}/{snapshot}")
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
            SnapshotId::parse("backup://s3/b1"),
            Some(SnapshotId::Backup("s3/b1".into()))
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
        ] {
            assert_eq!(SnapshotId::parse(bad), None, "{bad}");
        }
    }
}
