//! What a data source is asked to do, validated before anything on disk is touched: [`SourceSpec`] from the
//! source type and its `--param k=v` list, and [`DataSourceConfig`] for the whole server.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use backupstore::{BackupStoreError, BackupUrl};
use corral_disk::identity::check_path_component;

use crate::error::ConfigError;
use crate::info::{DataEngine, SourceType};

/// Output format of an export from a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportFileType {
    Raw,
    Qcow2,
}

/// A source type with its parsed parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceSpec {
    Download {
        url: String,
    },
    Upload,
    ExportFromVolume {
        snapshot_name: String,
        sender_address: String,
        volume_size: u64,
        file_type: ExportFileType,
    },
    Restore {
        backup_url: String,
    },
    Clone {
        backing_image: String,
        backing_image_uuid: String,
        /// `lvstore-address`: a v2 image's copy is received from this disk daemon (`LvstoreService`,
        /// `HOST:PORT`) instead of read from a file on this disk.
        from_lvstore: Option<String>,
        /// `backing-image-size`: the image's size (progress, and the received copy is checked against it); 0:
        /// unknown.
        size: u64,
    },
}

fn required<'a>(
    params: &'a BTreeMap<String, String>,
    source_type: SourceType,
    param: &'static str,
) -> Result<&'a str, ConfigError> {
    match params.get(param).map(|v| v.trim()) {
        Some(v) if !v.is_empty() => Ok(v),
        _ => Err(ConfigError::MissingParam {
            source_type: source_type.as_str(),
            param,
        }),
    }
}

fn bad(param: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::BadParam {
        param: param.to_owned(),
        reason: reason.into(),
    }
}

impl SourceSpec {
    /// Parses the parameters of `source_type`. Unknown parameters are kept (they are reported back) but unused.
    pub fn parse(
        source_type: SourceType,
        params: &BTreeMap<String, String>,
    ) -> Result<SourceSpec, ConfigError> {
        Ok(match source_type {
            SourceType::Download => {
                let url = required(params, source_type, "url")?;
                let parsed = reqwest::Url::parse(url).map_err(|e| bad("url", e.to_string()))?;
                if !matches!(parsed.scheme(), "http" | "https") {
                    return Err(bad(
                        "url",
                        format!("scheme {:?} is not http or https", parsed.scheme()),
                    ));
                }
                SourceSpec::Download { url: url.to_owned() }
            }
            SourceType::Upload => SourceSpec::Upload,
            SourceType::ExportFromVolume => {
                let snapshot_name = required(params, source_type, "snapshot-name")?;
                check_path_component("snapshot-name", snapshot_name).map_err(ConfigError::InvalidName)?;
                let sender_address = required(params, source_type, "sender-address")?;
                if !sender_address.contains(':') {
                    return Err(bad(
                        "sender-address",
                        "expected HOST:PORT of a replica's sync agent",
                    ));
                }
                let volume_size = corral_daemon::parse_size(required(params, source_type, "volume-size")?)
                    .map_err(|e| bad("volume-size", e))?;
                if volume_size == 0 {
                    return Err(bad("volume-size", "must be more than 0"));
                }
                let file_type = match params.get("file-type").map(String::as_str) {
                    None | Some("" | "raw") => ExportFileType::Raw,
                    Some("qcow2") => ExportFileType::Qcow2,
                    Some(other) => return Err(bad("file-type", format!("{other:?} is not raw or qcow2"))),
                };
                SourceSpec::ExportFromVolume {
                    snapshot_name: snapshot_name.to_owned(),
                    sender_address: sender_address.to_owned(),
                    volume_size,
                    file_type,
                }
            }
            SourceType::Restore => {
                let backup_url = required(params, source_type, "backup-url")?;
                parse_backup_url(backup_url).map_err(|e| bad("backup-url", e.to_string()))?;
                SourceSpec::Restore {
                    backup_url: backup_url.to_owned(),
                }
            }
            SourceType::Clone => {
                let backing_image = required(params, source_type, "backing-image")?;
                check_path_component("backing-image", backing_image).map_err(ConfigError::InvalidName)?;
                let backing_image_uuid = required(params, source_type, "backing-image-uuid")?;
                check_path_component("backing-image-uuid", backing_image_uuid)
                    .map_err(ConfigError::InvalidName)?;
                match params.get("encryption").map(String::as_str) {
                    None | Some("" | "ignore") => {}
                    Some(other) => {
                        return Err(bad(
                            "encryption",
                            format!("{other:?} is not supported (only a plain copy, \"ignore\")"),
                        ));
                    }
                }
                let from_lvstore = match params.get("lvstore-address").map(|v| v.trim()) {
                    None | Some("") => None,
                    Some(a) if a.contains(':') => Some(a.to_owned()),
                    Some(_) => {
                        return Err(bad(
                            "lvstore-address",
                            "expected HOST:PORT of a v2 disk daemon's LvstoreService",
                        ));
                    }
                };
                let size = match params.get("backing-image-size").map(|v| v.trim()) {
                    None | Some("") => 0,
                    Some(v) => v
                        .parse::<u64>()
                        .map_err(|e| bad("backing-image-size", format!("{v:?}: {e}")))?,
                };
                SourceSpec::Clone {
                    backing_image: backing_image.to_owned(),
                    backing_image_uuid: backing_image_uuid.to_owned(),
                    from_lvstore,
                    size,
                }
            }
        })
    }
}

/// Parses one `--param k=v`.
pub fn parse_param(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected KEY=VALUE"))?;
    if k.is_empty() {
        return Err(format!("{s:?}: empty key"));
    }
    Ok((k.to_owned(), v.to_owned()))
}

/// Everything a data-source server needs.
#[derive(Debug, Clone)]
pub struct DataSourceConfig {
    /// The disk directory (holds `corral-disk.cfg`).
    pub disk_path: PathBuf,
    pub disk_uuid: String,
    /// Backing image name and uuid.
    pub name: String,
    pub uuid: String,
    pub source_type: SourceType,
    pub parameters: BTreeMap<String, String>,
    /// SHA-512 hex the file must have (lower-cased), if any.
    pub expected_checksum: Option<String>,
    pub data_engine: DataEngine,
    /// A download (or an export) fails when no data arrives for this long.
    pub no_data_timeout: Duration,
    /// Retries of a broken download before giving up (each resumes where it stopped when the server allows).
    pub download_retries: usize,
    /// Address an export's sparse-sync receiver binds and gives the replica to connect to.
    pub receiver_ip: IpAddr,
    /// A restore's S3 credentials (`KEY=VALUE` lines), read when the restore starts; none: the environment's.
    /// The path only: the credentials are never part of the logged config.
    pub backup_credentials_file: Option<PathBuf>,
}

impl DataSourceConfig {
    /// Checks names, parameters and the checksum; returns the parsed source. Touches nothing.
    pub fn validate(&self) -> Result<SourceSpec, ConfigError> {
        check_path_component("name", &self.name).map_err(ConfigError::InvalidName)?;
        check_path_component("uuid", &self.uuid).map_err(ConfigError::InvalidName)?;
        if let Some(c) = &self.expected_checksum
            && (c.len() != 128 || !c.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            return Err(ConfigError::BadChecksum(c.clone()));
        }
        SourceSpec::parse(self.source_type, &self.parameters)
    }

    /// `<disk>/tmp`.
    pub fn tmp_dir(&self) -> PathBuf {
        self.disk_path.join("tmp")
    }

    /// `<disk>/tmp/<name>-<uuid>`: where the finished file is handed over.
    pub fn file_path(&self) -> PathBuf {
        self.tmp_dir().join(format!("{}-{}", self.name, self.uuid))
    }

    /// `<disk>/tmp/<name>-<uuid>.tmp`: the file while it is being prepared.
    pub fn work_path(&self) -> PathBuf {
        self.tmp_dir().join(format!("{}-{}.tmp", self.name, self.uuid))
    }

    /// Every file of this image in `<disk>/tmp`: the final file, the work file, a conversion's output and the
    /// temporary files of the tools writing them (an export's `.sync-partial`, a converter's `.<name>.tmp-PID`).
    pub fn owned_files(&self) -> std::io::Result<Vec<PathBuf>> {
        let stem = format!("{}-{}", self.name, self.uuid);
        let convert_tmp = format!(".{stem}.convert.tmp.tmp-");
        let known = [".tmp", ".convert.tmp", ".tmp.sync-partial", ".tmp.checksum"];
        let mut out = Vec::new();
        let rd = match std::fs::read_dir(self.tmp_dir()) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(e),
        };
        for entry in rd {
            let entry = entry?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let ours = name == stem
                || name.strip_prefix(&stem).is_some_and(|rest| known.contains(&rest))
                || name.starts_with(&convert_tmp);
            if ours {
                out.push(entry.path());
            }
        }
        Ok(out)
    }

    /// `<disk>/tmp/<name>-<uuid>.convert.tmp`: the output of a format conversion.
    pub fn convert_path(&self) -> PathBuf {
        self.tmp_dir()
            .join(format!("{}-{}.convert.tmp", self.name, self.uuid))
    }
}

/// The volume and backup a `backup-url` names (checked at start, used again by the restore job).
pub fn parse_backup_url(url: &str) -> Result<(BackupUrl, String, String), BackupStoreError> {
    let parsed = BackupUrl::parse(url)?;
    let volume = parsed.require_volume()?.to_owned();
    let backup = parsed.require_backup()?.to_owned();
    Ok((parsed, volume, backup))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn each_source_type_names_its_missing_parameter() {
        for (t, p) in [
            (SourceType::Download, "url"),
            (SourceType::ExportFromVolume, "snapshot-name"),
            (SourceType::Restore, "backup-url"),
            (SourceType::Clone, "backing-image"),
        ] {
            let err = SourceSpec::parse(t, &BTreeMap::new()).unwrap_err().to_string();
            assert!(err.contains(p), "{err}");
        }
        assert_eq!(
            SourceSpec::parse(SourceType::Upload, &BTreeMap::new()).unwrap(),
            SourceSpec::Upload
        );
    }

    #[test]
    fn bad_parameter_values_are_refused() {
        let cases = [
            (SourceType::Download, params(&[("url", "file:///etc/passwd")])),
            (SourceType::Download, params(&[("url", "not a url")])),
            (
                SourceType::Clone,
                params(&[("backing-image", "../x"), ("backing-image-uuid", "u")]),
            ),
            (
                SourceType::Restore,
                params(&[("backup-url", "ftp://host/x?backup=b&volume=v")]),
            ),
            (
                SourceType::Restore,
                params(&[("backup-url", "file:///srv/backups?volume=v")]),
            ),
            (
                SourceType::Restore,
                params(&[("backup-url", "s3://bucket/p?backup=b")]),
            ),
            (
                SourceType::Restore,
                params(&[("backup-url", "file:///srv?backup=../b&volume=v")]),
            ),
            (
                SourceType::ExportFromVolume,
                params(&[
                    ("snapshot-name", "s"),
                    ("sender-address", "h:1"),
                    ("volume-size", "1G"),
                    ("file-type", "vmdk"),
                ]),
            ),
        ];
        for (t, p) in cases {
            assert!(SourceSpec::parse(t, &p).is_err(), "{t} {p:?} accepted");
        }
        let ok = SourceSpec::parse(
            SourceType::ExportFromVolume,
            &params(&[
                ("snapshot-name", "s1"),
                ("sender-address", "127.0.0.1:9504"),
                ("volume-size", "64M"),
                ("file-type", "qcow2"),
            ]),
        )
        .unwrap();
        assert!(matches!(
            ok,
            SourceSpec::ExportFromVolume {
                volume_size: 67_108_864,
                file_type: ExportFileType::Qcow2,
                ..
            }
        ));
    }

    #[test]
    fn a_clone_from_a_v2_disk_daemon_takes_its_address_and_the_size() {
        let base = [("backing-image", "img"), ("backing-image-uuid", "u1")];
        let plain = SourceSpec::parse(SourceType::Clone, &params(&base)).unwrap();
        assert!(matches!(
            plain,
            SourceSpec::Clone {
                from_lvstore: None,
                size: 0,
                ..
            }
        ));
        let mut kv = base.to_vec();
        kv.extend([
            ("lvstore-address", "127.0.0.1:9600"),
            ("backing-image-size", "12582912"),
        ]);
        let v2 = SourceSpec::parse(SourceType::Clone, &params(&kv)).unwrap();
        assert_eq!(
            v2,
            SourceSpec::Clone {
                backing_image: "img".into(),
                backing_image_uuid: "u1".into(),
                from_lvstore: Some("127.0.0.1:9600".into()),
                size: 12 << 20,
            }
        );
        for (k, v) in [("lvstore-address", "nohostport"), ("backing-image-size", "12M")] {
            let mut kv = base.to_vec();
            kv.push((k, v));
            let err = SourceSpec::parse(SourceType::Clone, &params(&kv))
                .unwrap_err()
                .to_string();
            assert!(err.contains(k), "{err}");
        }
    }

    #[test]
    fn unknown_source_type_lists_the_known_ones() {
        let err = "ftp".parse::<SourceType>().unwrap_err();
        assert!(err.contains("download") && err.contains("clone"), "{err}");
        for t in SourceType::ALL {
            assert_eq!(t.as_str().parse::<SourceType>().unwrap(), t);
        }
    }
}
