//! The `restore` source of a backing image: a backup URL (`TARGET?backup=NAME&volume=VOLUME`, as the backup store
//! writes it) checked against what the cluster knows, and the credentials of the configured target it points into,
//! handed to `corral-datasource` in a file readable by this user only (never on a command line, never logged).

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use backupstore::BackupUrl;

use super::model::{Backup, BackupState, BackupTarget, BackupTargetSecret, key};
use crate::context::Ctx;

/// Checks `url` names one backup; when it points into a configured target, returns that target's name and
/// refuses a backup the cluster knows is not completed (the mirror may not list a new backup yet: an unknown one
/// is left to the data source, which fails with the store's message). Errors are messages for the user.
pub async fn resolve(ctx: &Ctx, url: &str) -> Result<String, String> {
    let parsed = BackupUrl::parse(url)
        .and_then(|u| {
            u.require_volume()?;
            u.require_backup()?;
            Ok(u)
        })
        .map_err(|e| format!("backupURL names no backup: {e} (expected TARGET?backup=NAME&volume=VOLUME)"))?;
    let (Some(volume), Some(backup)) = (parsed.volume.as_deref(), parsed.backup.as_deref()) else {
        return Err(format!("backupURL {url:?} names no backup"));
    };
    let targets = ctx.db.list::<BackupTarget>().await.map_err(|e| e.to_string())?;
    let Some(target) = targets
        .into_iter()
        .find(|t| BackupUrl::parse(&t.data.spec.store_url()).is_ok_and(|t| t.target == parsed.target))
    else {
        return Ok(String::new());
    };
    if let Some(b) = ctx
        .db
        .get::<Backup>(&key(&target.name, backup))
        .await
        .map_err(|e| e.to_string())?
    {
        if b.data.volume != volume {
            return Err(format!(
                "backup {backup} on target {} belongs to backup volume {}, not {volume}",
                target.name, b.data.volume
            ));
        }
        if b.data.state != BackupState::Completed {
            return Err(format!(
                "backup {backup} on target {} is {}: only a completed backup can be restored",
                target.name,
                b.data.state.as_str()
            ));
        }
    }
    Ok(target.name)
}

/// Writes the credentials of `target` to `path` for a data source (mode 0600, written to a temporary file, synced,
/// renamed). Returns false when the target keeps none (a `file://` target; S3 keys from the environment).
pub async fn write_credentials(ctx: &Ctx, target: &str, path: &Path) -> anyhow::Result<bool> {
    let credentials: BTreeMap<String, String> = ctx
        .db
        .get::<BackupTargetSecret>(target)
        .await?
        .map(|s| s.data.credentials)
        .unwrap_or_default();
    if credentials.is_empty() {
        return Ok(false);
    }
    let tmp = path.with_extension("credentials.tmp");
    let text: String = credentials.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    let (p, t) = (path.to_owned(), tmp.clone());
    tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        if let Some(dir) = p.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let _ = std::fs::remove_file(&t);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&t)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&t, &p)
    })
    .await?
    .map_err(|e| anyhow::anyhow!("writing {}: {e}", tmp.display()))?;
    Ok(true)
}
