//! Backup targets and backup URLs.
//!
//! A target is `file:///abs/dir` or `s3://bucket[/prefix]?endpoint=URL&region=R` (path-style requests; plain
//! `http://` endpoints allowed). S3 credentials come from the credential map given by the caller
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, optional `AWS_SESSION_TOKEN`), else from the same variables in
//! the environment, else from the file named by [`CREDENTIALS_FILE_ENV`] (`KEY=VALUE` lines): never from a
//! command line. A backup is addressed by `TARGET?backup=NAME&volume=VOLUME` (the target's own query
//! parameters stay in place).

use std::collections::BTreeMap;
use std::sync::Arc;

use object_store::ObjectStore;
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;

use crate::error::{BackupStoreError, Result};

/// Credential keys read from the map or the environment.
pub const CREDENTIAL_KEYS: [&str; 3] = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"];
/// Environment variable naming a credentials file (`KEY=VALUE` lines, `#` comments) read when neither the
/// caller's map nor the environment holds a key: a daemon gets credentials from a file (a mounted secret) without
/// them appearing in its environment listing or command line.
pub const CREDENTIALS_FILE_ENV: &str = "CORRAL_BACKUP_CREDENTIALS_FILE";

/// Reads a credentials file: `KEY=VALUE` lines; blank lines and `#` comments skipped; surrounding whitespace and
/// one pair of matching quotes around a value removed.
pub fn read_credentials_file(path: &std::path::Path) -> Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        BackupStoreError::InvalidArgument(format!("credentials file {}: {e}", path.display()))
    })?;
    let mut out = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (k, v) = line.split_once('=').ok_or_else(|| {
            BackupStoreError::InvalidArgument(format!(
                "credentials file {} line {}: expected KEY=VALUE",
                path.display(),
                i + 1
            ))
        })?;
        let v = v.trim();
        let v = ['"', '\'']
            .iter()
            .find_map(|q| v.strip_prefix(*q).and_then(|x| x.strip_suffix(*q)))
            .unwrap_or(v);
        out.insert(k.trim().to_owned(), v.to_owned());
    }
    Ok(out)
}

/// A parsed target URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetUrl {
    /// `file` or `s3`.
    pub scheme: String,
    /// Directory (file) or bucket (s3).
    pub location: String,
    /// Key prefix inside the bucket (s3 only).
    pub prefix: String,
    /// Query parameters other than `backup` and `volume`, in order.
    pub params: Vec<(String, String)>,
}

/// A backup URL: a target plus the backup volume and (optionally) one backup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupUrl {
    /// The target.
    pub target: TargetUrl,
    /// Backup volume name (`volume=`).
    pub volume: Option<String>,
    /// Backup name (`backup=`).
    pub backup: Option<String>,
}

fn bad(url: &str, reason: impl Into<String>) -> BackupStoreError {
    BackupStoreError::InvalidUrl {
        url: url.to_owned(),
        reason: reason.into(),
    }
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(h, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.bytes() {
        if c.is_ascii_alphanumeric() || b"-._~:/".contains(&c) {
            out.push(char::from(c));
        } else {
            out.push_str(&format!("%{c:02X}"));
        }
    }
    out
}

impl BackupUrl {
    /// Parses a target or backup URL.
    pub fn parse(url: &str) -> Result<Self> {
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad(url, "expected file:///DIR or s3://BUCKET/PREFIX"))?;
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut params = Vec::new();
        let (mut volume, mut backup) = (None, None);
        for kv in query.split('&').filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            let v = percent_decode(v).ok_or_else(|| bad(url, format!("bad escape in {k}")))?;
            match k {
                "volume" => volume = Some(crate::validate_name("volume", &v)?),
                "backup" => backup = Some(crate::validate_name("backup", &v)?),
                _ => params.push((k.to_owned(), v)),
            }
        }
        let target = match scheme {
            "file" => {
                if !path.starts_with('/') {
                    return Err(bad(url, "a file target needs an absolute path: file:///DIR"));
                }
                let dir = percent_decode(path).ok_or_else(|| bad(url, "bad escape in path"))?;
                let dir = dir.trim_end_matches('/');
                TargetUrl {
                    scheme: "file".into(),
                    location: if dir.is_empty() {
                        "/".into()
                    } else {
                        dir.to_owned()
                    },
                    prefix: String::new(),
                    params,
                }
            }
            "s3" => {
                let (bucket, prefix) = path.split_once('/').unwrap_or((path, ""));
                if bucket.is_empty() {
                    return Err(bad(url, "missing bucket: s3://BUCKET/PREFIX"));
                }
                for (k, _) in &params {
                    if !["endpoint", "region"].contains(&k.as_str()) {
                        return Err(bad(url, format!("unknown parameter {k:?} (endpoint, region)")));
                    }
                }
                TargetUrl {
                    scheme: "s3".into(),
                    location: bucket.to_owned(),
                    prefix: prefix.trim_matches('/').to_owned(),
                    params,
                }
            }
            other => return Err(bad(url, format!("unsupported scheme {other:?} (file, s3)"))),
        };
        Ok(Self {
            target,
            volume,
            backup,
        })
    }

    /// The backup volume, or an error naming what is missing.
    pub fn require_volume(&self) -> Result<&str> {
        self.volume
            .as_deref()
            .ok_or_else(|| bad(&self.to_string(), "missing volume=NAME"))
    }

    /// The backup name, or an error naming what is missing.
    pub fn require_backup(&self) -> Result<&str> {
        self.backup
            .as_deref()
            .ok_or_else(|| bad(&self.to_string(), "missing backup=NAME"))
    }
}

impl std::fmt::Display for TargetUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.scheme.as_str() {
            "file" => write!(f, "file://{}", percent_encode(&self.location))?,
            _ if self.prefix.is_empty() => write!(f, "{}://{}", self.scheme, self.location)?,
            _ => write!(f, "{}://{}/{}", self.scheme, self.location, self.prefix)?,
        }
        for (i, (k, v)) in self.params.iter().enumerate() {
            write!(f, "{}{k}={}", if i == 0 { '?' } else { '&' }, percent_encode(v))?;
        }
        Ok(())
    }
}

impl std::fmt::Display for BackupUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.target)?;
        let mut sep = if self.target.params.is_empty() { '?' } else { '&' };
        if let Some(b) = &self.backup {
            write!(f, "{sep}backup={b}")?;
            sep = '&';
        }
        if let Some(v) = &self.volume {
            write!(f, "{sep}volume={v}")?;
        }
        Ok(())
    }
}

impl TargetUrl {
    fn param(&self, k: &str) -> Option<&str> {
        self.params.iter().find(|(x, _)| x == k).map(|(_, v)| v.as_str())
    }

    /// Opens the object store of this target and the key prefix everything lives under.
    pub fn open(&self, credentials: &BTreeMap<String, String>) -> Result<(Arc<dyn ObjectStore>, Path)> {
        let url = self.to_string();
        match self.scheme.as_str() {
            "file" => {
                std::fs::create_dir_all(&self.location)
                    .map_err(|e| bad(&url, format!("create {}: {e}", self.location)))?;
                let fs = LocalFileSystem::new_with_prefix(&self.location)
                    .map_err(|e| bad(&url, e.to_string()))?
                    .with_fsync(true)
                    .with_automatic_cleanup(true);
                Ok((Arc::new(fs), Path::from("")))
            }
            _ => {
                let from_file = match std::env::var_os(CREDENTIALS_FILE_ENV) {
                    Some(p) if !p.is_empty() => read_credentials_file(std::path::Path::new(&p))?,
                    _ => BTreeMap::new(),
                };
                let cred = |k: &str| {
                    credentials
                        .get(k)
                        .cloned()
                        .filter(|v| !v.is_empty())
                        .or_else(|| std::env::var(k).ok().filter(|v| !v.is_empty()))
                        .or_else(|| from_file.get(k).cloned())
                        .filter(|v| !v.is_empty())
                };
                let mut b = AmazonS3Builder::new()
                    .with_bucket_name(&self.location)
                    .with_region(self.param("region").unwrap_or("us-east-1"))
                    .with_virtual_hosted_style_request(false);
                if let Some(ep) = self.param("endpoint") {
                    b = b.with_endpoint(ep).with_allow_http(ep.starts_with("http://"));
                }
                match (cred(CREDENTIAL_KEYS[0]), cred(CREDENTIAL_KEYS[1])) {
                    (Some(k), Some(s)) => {
                        b = b.with_access_key_id(k).with_secret_access_key(s);
                        if let Some(t) = cred(CREDENTIAL_KEYS[2]) {
                            b = b.with_token(t);
                        }
                    }
                    _ => {
                        return Err(bad(
                            &url,
                            "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or name a \
                             file holding them in CORRAL_BACKUP_CREDENTIALS_FILE",
                        ));
                    }
                }
                let s3 = b.build().map_err(|e| bad(&url, e.to_string()))?;
                Ok((Arc::new(s3), Path::from(self.prefix.as_str())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backup_urls_round_trip_and_keep_the_targets_own_parameters() {
        let u = "s3://bk/pre/fix?endpoint=http://127.0.0.1:9000&region=eu-1&backup=b1&volume=v1";
        let p = BackupUrl::parse(u).unwrap();
        assert_eq!(p.target.location, "bk");
        assert_eq!(p.target.prefix, "pre/fix");
        assert_eq!(p.backup.as_deref(), Some("b1"));
        assert_eq!(p.volume.as_deref(), Some("v1"));
        assert_eq!(p.to_string(), u);
        let f = BackupUrl::parse("file:///tmp/x?backup=b&volume=v").unwrap();
        assert_eq!(f.target.location, "/tmp/x");
        assert_eq!(f.target.to_string(), "file:///tmp/x");
    }

    #[test]
    fn a_credentials_file_is_read_as_key_value_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("creds");
        std::fs::write(
            &p,
            "# S3\nAWS_ACCESS_KEY_ID=corral\n\n AWS_SECRET_ACCESS_KEY = \"s=cret\" \n",
        )
        .unwrap();
        let m = read_credentials_file(&p).unwrap();
        assert_eq!(m["AWS_ACCESS_KEY_ID"], "corral");
        assert_eq!(m["AWS_SECRET_ACCESS_KEY"], "s=cret");
        std::fs::write(&p, "AWS_ACCESS_KEY_ID corral\n").unwrap();
        let e = read_credentials_file(&p).unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
        let e = read_credentials_file(&dir.path().join("none")).unwrap_err();
        assert!(e.to_string().contains("credentials file"), "{e}");
    }

    #[test]
    fn bad_urls_are_refused_with_the_reason() {
        for u in [
            "/tmp/x",
            "file://rel/path",
            "ftp://x",
            "s3:///p",
            "s3://b?foo=1",
            "file:///x?volume=../y",
        ] {
            let e = BackupUrl::parse(u).unwrap_err();
            assert!(e.to_string().contains("invalid"), "{u}: {e}");
        }
    }
}
