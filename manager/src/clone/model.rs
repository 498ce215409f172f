//! A volume made from another: its `dataSource` and the clone's progress, kept as a resource of its own (kind
//! `volume-clone`, named after the target volume) that only the clone controller writes, so the volume
//! controller's status writes and the clone's never race.

use serde::{Deserialize, Serialize};

pub use corral_api::clone::CloneState;

use crate::store::Resource;

/// Where a new volume's data comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// `vol://NAME`: the volume as it is when the clone starts (a snapshot is taken for it).
    Volume(String),
    /// `snap://NAME/SNAPSHOT`: a snapshot the volume already has.
    Snapshot(String, String),
}

impl DataSource {
    /// Parses `vol://NAME` or `snap://NAME/SNAPSHOT`; `check` validates each name.
    pub fn parse(s: &str, check: impl Fn(&str, &str) -> Result<(), String>) -> Result<Self, String> {
        if let Some(v) = s.strip_prefix("vol://") {
            check("source volume", v)?;
            Ok(Self::Volume(v.to_owned()))
        } else if let Some(rest) = s.strip_prefix("snap://") {
            let (v, snap) = rest
                .split_once('/')
                .ok_or_else(|| format!("dataSource {s:?}: snap:// needs VOLUME/SNAPSHOT"))?;
            check("source volume", v)?;
            check("source snapshot", snap)?;
            Ok(Self::Snapshot(v.to_owned(), snap.to_owned()))
        } else {
            Err(format!(
                "dataSource {s:?}: expected vol://VOLUME or snap://VOLUME/SNAPSHOT"
            ))
        }
    }

    pub fn volume(&self) -> &str {
        match self {
            Self::Volume(v) | Self::Snapshot(v, _) => v,
        }
    }
}

impl std::fmt::Display for DataSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Volume(v) => write!(f, "vol://{v}"),
            Self::Snapshot(v, s) => write!(f, "snap://{v}/{s}"),
        }
    }
}

/// One clone, from creation to its end; the steps already done are recorded so a restarted (or new) leader goes
/// on from where the last one stopped, and undoes exactly what it did (detach an auto-attached source, remove the
/// snapshot it took).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeClone {
    /// `vol://NAME` or `snap://NAME/SNAPSHOT`, as given.
    pub data_source: String,
    pub source_volume: String,
    /// The snapshot copied: the one named, or the one taken for `vol://` (`clone-<target>-<8 hex>`).
    pub snapshot: String,
    pub state: CloneState,
    /// Percent of the copy, lowest over the target's replicas.
    pub progress: u32,
    /// Why it failed, or what it waits for.
    pub message: String,
    /// The size asked for; the target starts at the source's size and grows to this once the copy completed.
    pub size: u64,
    /// The source was detached and this clone attached it (without a frontend): detach it at the end.
    #[serde(default)]
    pub auto_attached_source: bool,
    /// This clone took `snapshot` on the source (`vol://`): remove it at the end.
    #[serde(default)]
    pub snapshot_taken: bool,
    /// The target's engine was asked to clone.
    #[serde(default)]
    pub started: bool,
    /// The copy completed (and the target grew): what is left is detaching and removing, after which the clone
    /// is `completed` — so whoever sees `completed` can attach the target at once.
    #[serde(default)]
    pub copied: bool,
    /// Target detached, snapshot removed, source detached: nothing left to undo.
    #[serde(default)]
    pub cleaned_up: bool,
    /// Since when (unix seconds) the clone waits for the source or the target to be attached: it fails after a
    /// limit rather than wait for ever (e.g. for replicas that cannot be placed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_since: Option<u64>,
}

impl Resource for VolumeClone {
    const KIND: &'static str = "volume-clone";
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(_: &str, n: &str) -> Result<(), String> {
        if n.is_empty() || n.contains('/') {
            Err(format!("bad name {n:?}"))
        } else {
            Ok(())
        }
    }

    #[test]
    fn data_sources_parse_and_print_back() {
        for s in ["vol://a", "snap://a/s1"] {
            assert_eq!(DataSource::parse(s, ok).unwrap().to_string(), s);
        }
        assert_eq!(
            DataSource::parse("snap://v/s", ok).unwrap(),
            DataSource::Snapshot("v".into(), "s".into())
        );
    }

    #[test]
    fn malformed_data_sources_say_what_is_expected() {
        for s in [
            "",
            "vol://",
            "snap://v",
            "snap://v/",
            "snap://v/a/b",
            "http://x",
            "vol:/v",
        ] {
            let e = DataSource::parse(s, ok).unwrap_err();
            assert!(e.contains("dataSource") || e.contains("bad name"), "{s}: {e}");
        }
    }
}
