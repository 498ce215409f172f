//! StorageClass and VolumeSnapshotClass parameters: parsed and checked before anything is created, so a typo or a
//! bad value is a clear INVALID_ARGUMENT and leaves nothing behind. The table in the crate README lists them.

use std::collections::{BTreeMap, HashMap};

use crate::error::{CsiError, CsiResult};

/// File systems the node plugin makes and grows.
pub const FS_TYPES: &[&str] = &["ext4", "xfs"];

/// What a StorageClass asks of a volume.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeParameters {
    /// None: the manager's default (3).
    pub number_of_replicas: Option<u32>,
    /// None: the manager's `disable-revision-counter` setting.
    pub disable_revision_counter: Option<bool>,
    /// None: ext4 (unless the volume capability names one).
    pub fs_type: Option<String>,
    /// The backing image under the volume's data.
    pub backing_image: Option<String>,
    /// How to make the backing image when the manager has none of that name (seed 000): the manager's
    /// `sourceType` and its parameters.
    pub backing_image_source: Option<BackingImageSource>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackingImageSource {
    pub source_type: String,
    pub parameters: BTreeMap<String, String>,
}

const VOLUME_KEYS: &[&str] = &[
    "numberOfReplicas",
    "disableRevisionCounter",
    "dataEngine",
    "fsType",
    "backingImage",
    "backingImageDataSourceType",
    "backingImageDataSourceParameters",
];

/// Keys Kubernetes' external-provisioner and snapshotter reserve for themselves (secrets, fstype).
fn reserved(key: &str) -> bool {
    key.starts_with("csi.storage.k8s.io/") || key.starts_with("csi.storage.k8s.io_")
}

fn bad(key: &str, value: &str, want: &str) -> CsiError {
    CsiError::InvalidArgument(format!("parameter {key}={value:?} is invalid: {want}"))
}

impl VolumeParameters {
    pub fn parse(params: &HashMap<String, String>) -> CsiResult<VolumeParameters> {
        let mut out = VolumeParameters::default();
        let mut keys: Vec<&String> = params.keys().collect();
        keys.sort();
        for key in keys {
            let value = params[key].as_str();
            match key.as_str() {
                "numberOfReplicas" => {
                    let n: u32 = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=16).contains(n))
                        .ok_or_else(|| bad(key, value, "a whole number from 1 to 16"))?;
                    out.number_of_replicas = Some(n);
                }
                "disableRevisionCounter" => {
                    out.disable_revision_counter = Some(match value {
                        "true" => true,
                        "false" => false,
                        _ => return Err(bad(key, value, "true or false")),
                    });
                }
                "dataEngine" => {
                    if value != "v1" {
                        return Err(bad(key, value, "Corral has one data engine, v1"));
                    }
                }
                "fsType" => {
                    if !FS_TYPES.contains(&value) {
                        return Err(bad(key, value, "ext4 or xfs"));
                    }
                    out.fs_type = Some(value.to_owned());
                }
                "backingImage" => {
                    corral_disk::identity::check_path_component("backingImage", value)
                        .map_err(|e| bad(key, value, &e))?;
                    out.backing_image = Some(value.to_owned());
                }
                "backingImageDataSourceType" => {
                    if value.is_empty() {
                        return Err(bad(key, value, "a source type such as download"));
                    }
                    out.backing_image_source
                        .get_or_insert_with(Default::default)
                        .source_type = value.to_owned();
                }
                "backingImageDataSourceParameters" => {
                    let parameters: BTreeMap<String, String> = serde_json::from_str(value)
                        .map_err(|e| bad(key, value, &format!("a JSON object of strings ({e})")))?;
                    out.backing_image_source
                        .get_or_insert_with(Default::default)
                        .parameters = parameters;
                }
                k if reserved(k) => {}
                k => {
                    return Err(CsiError::InvalidArgument(format!(
                        "unknown parameter {k:?}; known: {}",
                        VOLUME_KEYS.join(", ")
                    )));
                }
            }
        }
        if let Some(src) = &out.backing_image_source {
            if out.backing_image.is_none() {
                return Err(CsiError::InvalidArgument(
                    "backingImageDataSourceType/Parameters need backingImage (the image's name)".into(),
                ));
            }
            if src.source_type.is_empty() {
                return Err(CsiError::InvalidArgument(
                    "backingImageDataSourceParameters needs backingImageDataSourceType".into(),
                ));
            }
        }
        Ok(out)
    }
}

/// Where a snapshot is kept (VolumeSnapshotClass parameter `type`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotKind {
    /// A snapshot in the volume's own chain (`snap://`), the default.
    InVolume,
    /// A backup on the named backup target (`backup://`).
    Backup { target: String },
}

/// The manager's backup target used when a VolumeSnapshotClass names none.
pub const DEFAULT_BACKUP_TARGET: &str = "default";

/// VolumeSnapshotClass parameters: `type` (`snap` | `backup`) and, for backups, `backupTarget`.
pub fn snapshot_kind(params: &HashMap<String, String>) -> CsiResult<SnapshotKind> {
    let mut backup = false;
    let mut target = None;
    let mut keys: Vec<&String> = params.keys().collect();
    keys.sort();
    for key in keys {
        let value = params[key].as_str();
        match key.as_str() {
            "type" => {
                backup = match value {
                    "snap" => false,
                    "backup" => true,
                    _ => return Err(bad(key, value, "snap or backup")),
                }
            }
            "backupTarget" => {
                corral_disk::identity::check_path_component("backupTarget", value)
                    .map_err(|e| bad(key, value, &e))?;
                target = Some(value.to_owned());
            }
            k if reserved(k) => {}
            k => {
                return Err(CsiError::InvalidArgument(format!(
                    "unknown snapshot parameter {k:?}; known: type, backupTarget"
                )));
            }
        }
    }
    match (backup, target) {
        (true, t) => Ok(SnapshotKind::Backup {
            target: t.unwrap_or_else(|| DEFAULT_BACKUP_TARGET.to_owned()),
        }),
        (false, Some(t)) => Err(bad(
            "backupTarget",
            &t,
            "only a VolumeSnapshotClass with type=backup names a backup target",
        )),
        (false, None) => Ok(SnapshotKind::InVolume),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn known_parameters_parse_and_reserved_ones_are_ignored() {
        let got = VolumeParameters::parse(&p(&[
            ("numberOfReplicas", "2"),
            ("disableRevisionCounter", "true"),
            ("dataEngine", "v1"),
            ("fsType", "xfs"),
            ("csi.storage.k8s.io/fstype", "ext4"),
            ("backingImage", "img-1"),
            ("backingImageDataSourceType", "download"),
            (
                "backingImageDataSourceParameters",
                "{\"url\": \"http://h/i.qcow2\"}",
            ),
        ]))
        .unwrap();
        assert_eq!(
            got,
            VolumeParameters {
                number_of_replicas: Some(2),
                disable_revision_counter: Some(true),
                fs_type: Some("xfs".into()),
                backing_image: Some("img-1".into()),
                backing_image_source: Some(BackingImageSource {
                    source_type: "download".into(),
                    parameters: [("url".to_owned(), "http://h/i.qcow2".to_owned())].into(),
                }),
            }
        );
    }

    #[test]
    fn bad_values_and_unknown_keys_are_invalid_arguments_that_name_the_key() {
        for (k, v) in [
            ("numberOfReplicas", "0"),
            ("numberOfReplicas", "three"),
            ("disableRevisionCounter", "yes"),
            ("dataEngine", "v2"),
            ("fsType", "btrfs"),
            ("numberOfReplica", "3"),
            ("backingImage", "../img"),
            ("backingImageDataSourceParameters", "{\"url\": 3}"),
            ("backingImageDataSourceType", "download"),
        ] {
            let e = VolumeParameters::parse(&p(&[(k, v)])).unwrap_err();
            assert!(
                matches!(&e, CsiError::InvalidArgument(m) if m.contains(k)),
                "{k}={v}: {e}"
            );
        }
        for (kv, key) in [
            (&[("type", "tape")][..], "type"),
            (&[("backupTarget", "s3")][..], "backupTarget"),
            (&[("type", "backup"), ("backupTarget", "a/b")][..], "backupTarget"),
            (&[("type", "backup"), ("target", "s3")][..], "target"),
        ] {
            let e = snapshot_kind(&p(kv)).unwrap_err();
            assert!(
                matches!(&e, CsiError::InvalidArgument(m) if m.contains(key)),
                "{kv:?}: {e}"
            );
        }
        assert_eq!(
            snapshot_kind(&p(&[("type", "backup")])).unwrap(),
            SnapshotKind::Backup {
                target: "default".into()
            }
        );
        assert_eq!(
            snapshot_kind(&p(&[("type", "backup"), ("backupTarget", "s3")])).unwrap(),
            SnapshotKind::Backup { target: "s3".into() }
        );
        assert_eq!(snapshot_kind(&p(&[])).unwrap(), SnapshotKind::InVolume);
    }
}
