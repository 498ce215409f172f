//! `corral backup target set|get|ls|rm`, `backup create|ls|get|rm|restore`, `backup volume ls|get|rm`,
//! `backup backing-image|backing-image-ls|backing-image-get|backing-image-cancel|backing-image-rm`: tables or
//! `--json`, progress bars while a backup or restore runs. Credentials are read from the environment
//! (`--credentials-from-env`) or a file (`--credentials-file`), never taken as arguments: an argument shows in
//! `ps` and in shell history.
// The doc comments here are clap's `--help` text: `[TARGET:]NAME` is a usage pattern, not an intra-doc link.
#![allow(rustdoc::broken_intra_doc_links)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Subcommand;

use super::image_backup::{BackingImageBackupRequest, BackingImageBackupView};
use super::model::{BackupState, RestoreState};
use super::routes::{
    BackupDeltaMax, BackupMaxCount, BackupTargetSet, BackupTargetView, BackupView, BackupVolumeView,
    CREDENTIAL_KEYS, RestoreRequest, RestoreView,
};
use super::service::BackupCreate;
use crate::client::{Client, ClientError};

#[derive(Subcommand, Debug)]
pub enum BackupCmd {
    /// Backup targets: where backups go (`default` unless --target names another).
    Target {
        #[command(subcommand)]
        cmd: TargetCmd,
    },
    /// Back up a volume (attached, with or without a frontend); a snapshot is taken when none is named. Waits
    /// with a progress bar unless --no-wait.
    Create(CreateArgs),
    /// Backups (of one backup volume with VOLUME, [TARGET:]NAME).
    Ls {
        volume: Option<String>,
        /// Only the backups of this target.
        #[arg(long)]
        target: Option<String>,
    },
    /// One backup: [TARGET:]NAME.
    Get { backup: String },
    /// Delete a backup: [TARGET:]NAME. Blocks no other backup uses are collected.
    Rm { backup: String },
    /// Restore a backup into a detached volume in place (its data is replaced); waits unless --no-wait.
    Restore {
        volume: String,
        /// [TARGET:]NAME, or the backup's URL as `corral backup ls` shows it.
        backup: String,
        #[arg(long)]
        no_wait: bool,
        #[arg(long, default_value_t = 86400)]
        timeout: u64,
    },
    /// Set a volume's backup-max-count (`none`: the setting's; 0: no limit).
    MaxCount { volume: String, count: String },
    /// Set a volume's backup-delta-max: backups in a chain, its full one included (`none`: the setting's). A
    /// recurring job's --delta-max goes over it.
    DeltaMax { volume: String, count: String },
    /// Back a ready backing image up into a target's backing-image area (blocks deduplicated against its earlier
    /// backups); prints the backup URL that `corral backing-image create NAME --source restore --backup-url URL
    /// --expected-checksum SHA512` restores it from.
    /// Waits with a progress bar unless --no-wait; the backup runs in a manager holding a ready copy, whatever
    /// happens to this command (follow it with `corral backup backing-image-get ID`).
    BackingImage(BackingImageArgs),
    /// Backups of backing images: state, progress, backup URL.
    BackingImageLs,
    /// One backup of a backing image: [TARGET:]NAME.
    BackingImageGet { id: String },
    /// Cancel a pending or running backup of a backing image ([TARGET:]NAME): the manager running it stops at the
    /// next block and records it failed ("cancelled"). Waits until it stopped unless --no-wait.
    BackingImageCancel {
        id: String,
        #[arg(long)]
        no_wait: bool,
        /// Seconds to wait.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
    },
    /// Delete a finished backup of a backing image ([TARGET:]NAME) from its target (blocks no other backup of the
    /// image uses are collected) and its record. A running one must be cancelled first.
    BackingImageRm { id: String },
    /// Backup volumes (a volume's backups on a target).
    Volume {
        #[command(subcommand)]
        cmd: VolumeCmd,
    },
}

/// The flags of `backup create`.
#[derive(clap::Args, Debug)]
pub struct CreateArgs {
    pub volume: String,
    /// Back up this snapshot instead of taking one.
    #[arg(long)]
    pub snapshot: Option<String>,
    /// A full backup, whatever the chain policy says.
    #[arg(long)]
    pub full: bool,
    /// Label k=v (repeatable).
    #[arg(long = "label")]
    pub labels: Vec<String>,
    #[arg(long)]
    pub target: Option<String>,
    /// This backup's backup-delta-max (backups in a chain, its full one included) over the setting's.
    #[arg(long)]
    pub delta_max: Option<u32>,
    /// Block size of the backup volume if this is its first backup on the target (e.g. `256K`; a power of two
    /// from 4K to 16M; default: the backup-block-size setting). Refused when the backup volume exists with
    /// another block size.
    #[arg(long, value_parser = corral_daemon::parse_size)]
    pub block_size: Option<u64>,
    #[arg(long)]
    pub no_wait: bool,
    /// Seconds to wait.
    #[arg(long, default_value_t = 86400)]
    pub timeout: u64,
}

/// The flags of `backup backing-image`.
#[derive(clap::Args, Debug)]
pub struct BackingImageArgs {
    pub name: String,
    /// Target name (default: `default`).
    #[arg(long)]
    pub target: Option<String>,
    /// Upload at most this many bytes of block data per second (e.g. `50M`; default unlimited).
    #[arg(long, value_parser = corral_daemon::parse_size)]
    pub max_upload_rate: Option<u64>,
    #[arg(long)]
    pub no_wait: bool,
    /// Seconds to wait.
    #[arg(long, default_value_t = 86400)]
    pub timeout: u64,
}

#[derive(Subcommand, Debug)]
pub enum TargetCmd {
    /// Set a target: file:///DIR or s3://BUCKET[/PREFIX] (refused unless it can be listed).
    Set {
        /// Not `url`: that global flag is the manager's address.
        #[arg(value_name = "URL")]
        target_url: String,
        /// Target name.
        #[arg(long, default_value = super::model::DEFAULT_TARGET)]
        name: String,
        /// S3 endpoint, http(s)://HOST:PORT.
        #[arg(long, default_value = "")]
        endpoint: String,
        #[arg(long, default_value = "")]
        region: String,
        /// Seconds between two listings by the leader.
        #[arg(long)]
        poll_interval: Option<u64>,
        /// Take AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) from this command's environment.
        #[arg(long, conflicts_with = "credentials_file")]
        credentials_from_env: bool,
        /// Read KEY=VALUE lines (the same names) from this file.
        #[arg(long)]
        credentials_file: Option<PathBuf>,
    },
    Get {
        #[arg(default_value = super::model::DEFAULT_TARGET)]
        name: String,
    },
    Ls,
    /// Forget a target (what it holds stays).
    Rm {
        name: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum VolumeCmd {
    Ls,
    /// [TARGET:]NAME.
    Get {
        name: String,
    },
    /// Delete a backup volume with every backup and block: [TARGET:]NAME.
    Rm {
        name: String,
    },
}

fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    corral_daemon::output::table(header, rows).to_string()
}

fn print<T: serde::Serialize>(json: bool, v: &T, human: impl FnOnce() -> String) -> anyhow::Result<()> {
    Ok(corral_daemon::output::print(json, v, human)?)
}

fn read_credentials(
    from_env: bool,
    file: Option<&PathBuf>,
) -> anyhow::Result<Option<BTreeMap<String, String>>> {
    if from_env {
        let m: BTreeMap<String, String> = CREDENTIAL_KEYS
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| ((*k).to_owned(), v)))
            .collect();
        if m.is_empty() {
            bail!(
                "--credentials-from-env: none of {} is set",
                CREDENTIAL_KEYS.join(", ")
            );
        }
        return Ok(Some(m));
    }
    let Some(f) = file else { return Ok(None) };
    let text = std::fs::read_to_string(f).with_context(|| format!("read {}", f.display()))?;
    let mut m = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .with_context(|| format!("{} line {}: expected KEY=VALUE", f.display(), i + 1))?;
        m.insert(k.trim().to_owned(), v.trim().to_owned());
    }
    Ok(Some(m))
}

fn target_table(ts: &[BackupTargetView]) -> String {
    table(
        &[
            "TARGET",
            "URL",
            "ENDPOINT",
            "CREDENTIALS",
            "POLL",
            "AVAILABLE",
            "MESSAGE",
        ],
        ts.iter()
            .map(|t| {
                vec![
                    t.name.clone(),
                    t.url.clone(),
                    t.endpoint.clone(),
                    if t.credential_keys.is_empty() {
                        "-".into()
                    } else {
                        format!("set ({})", t.credential_keys.join(", "))
                    },
                    format!("{}s", t.poll_interval),
                    t.status.available.to_string(),
                    t.status.message.clone(),
                ]
            })
            .collect(),
    )
}

fn kind(b: &super::model::Backup) -> String {
    if b.state != BackupState::Completed && b.full_reason.is_empty() && !b.is_incremental {
        return String::new();
    }
    if b.is_incremental {
        format!("incremental #{}", b.chain_position)
    } else if b.full_reason.is_empty() {
        "full".into()
    } else {
        format!("full ({})", b.full_reason)
    }
}

fn backup_table(bs: &[BackupView]) -> String {
    table(
        &[
            "BACKUP",
            "VOLUME",
            "SNAPSHOT",
            "STATE",
            "KIND",
            "SIZE",
            "NEW",
            "COMPLETED",
        ],
        bs.iter()
            .map(|v| {
                let b = &v.backup;
                vec![
                    v.id.clone(),
                    b.volume.clone(),
                    b.snapshot.clone(),
                    match b.state {
                        BackupState::InProgress | BackupState::Pending => {
                            format!("{} {}%", b.state.as_str(), b.progress)
                        }
                        BackupState::Failed => format!("failed: {}", b.error),
                        BackupState::Completed => "completed".into(),
                    },
                    kind(b),
                    corral_daemon::human_bytes(b.size),
                    corral_daemon::human_bytes(b.new_bytes),
                    b.completed.clone(),
                ]
            })
            .collect(),
    )
}

fn volume_table(vs: &[BackupVolumeView]) -> String {
    table(
        &[
            "BACKUP VOLUME",
            "SIZE",
            "BACKUPS",
            "LAST BACKUP",
            "AT",
            "BLOCK SIZE",
            "BACKING IMAGE",
        ],
        vs.iter()
            .map(|v| {
                vec![
                    v.id.clone(),
                    corral_daemon::human_bytes(v.volume.size),
                    v.volume.backup_count.to_string(),
                    v.volume.last_backup_name.clone(),
                    v.volume.last_backup_at.clone(),
                    corral_daemon::human_bytes(v.volume.block_size),
                    v.volume.backing_image_name.clone(),
                ]
            })
            .collect(),
    )
}

/// Waits (progress bar) until the tracked operation at `path` (a volume's or a backing image's backup, both with
/// a [`BackupState`]) completed; failed is an error with the reason. `of` reads its state, progress and error.
async fn wait_done<T: serde::de::DeserializeOwned>(
    c: &Client,
    path: &str,
    what: &str,
    timeout: Duration,
    of: impl Fn(&T) -> (BackupState, u32, String),
) -> anyhow::Result<T> {
    let bar = corral_daemon::percent_bar(what);
    let end = Instant::now() + timeout;
    loop {
        let v: T = c.get(path).await?;
        let (state, progress, error) = of(&v);
        bar.set_position(u64::from(progress));
        match state {
            BackupState::Completed => {
                bar.finish_and_clear();
                return Ok(v);
            }
            BackupState::Failed => {
                bar.abandon();
                bail!("{what} failed: {error}");
            }
            BackupState::Pending | BackupState::InProgress => {}
        }
        if Instant::now() > end {
            bar.abandon();
            bail!("{what} is still running ({progress}%) after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Waits (progress bar) until the backup `id` completed; failed is an error with the reason.
pub async fn wait_backup(c: &Client, id: &str, timeout: Duration) -> anyhow::Result<BackupView> {
    wait_done(
        c,
        &format!("/v1/backups/{id}"),
        &format!("backup {id}"),
        timeout,
        |b: &BackupView| (b.backup.state, b.backup.progress, b.backup.error.clone()),
    )
    .await
}

fn image_backup_table(bs: &[BackingImageBackupView]) -> String {
    table(
        &[
            "BACKUP",
            "IMAGE",
            "NODE",
            "STATE",
            "SIZE",
            "NEW",
            "COMPLETED",
            "URL",
        ],
        bs.iter()
            .map(|v| {
                let b = &v.backup;
                vec![
                    v.id.clone(),
                    b.image.clone(),
                    b.node_id.clone(),
                    match b.state {
                        BackupState::InProgress | BackupState::Pending => {
                            format!("{} {}%", b.state.as_str(), b.progress)
                        }
                        BackupState::Failed => format!("failed: {}", b.error),
                        BackupState::Completed => "completed".into(),
                    },
                    corral_daemon::human_bytes(b.size),
                    corral_daemon::human_bytes(b.new_bytes),
                    b.completed.clone(),
                    b.backup_url.clone(),
                ]
            })
            .collect(),
    )
}

/// Waits (progress bar) until the restore into `volume` completed; failed is an error with the reason.
pub async fn wait_restore(c: &Client, volume: &str, timeout: Duration) -> anyhow::Result<RestoreView> {
    let bar = corral_daemon::percent_bar("restoring");
    let end = Instant::now() + timeout;
    loop {
        let r: RestoreView = c.get(&format!("/v1/volumes/{volume}/restore")).await?;
        bar.set_position(u64::from(r.restore.progress));
        match r.restore.state {
            RestoreState::Completed => {
                bar.finish_and_clear();
                return Ok(r);
            }
            RestoreState::Failed => {
                bar.abandon();
                bail!(
                    "the restore of {} into {volume} failed: {}; restore again (corral backup restore {volume} {}) or delete the volume",
                    r.restore.backup,
                    r.restore.message,
                    r.restore.backup
                );
            }
            RestoreState::Initiated | RestoreState::Restoring => {}
        }
        if Instant::now() > end {
            bar.abandon();
            bail!(
                "the restore into {volume} is still running ({}%) after {timeout:?}",
                r.restore.progress
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// `\nrestore of BACKUP: STATE N% (message)` for `corral volume get`, empty when the volume has no restore.
pub async fn restore_line(c: &Client, volume: &str) -> String {
    match c
        .get::<RestoreView>(&format!("/v1/volumes/{volume}/restore"))
        .await
    {
        Ok(r) => format!(
            "\nrestore of {}:{}: {} {}%{}",
            r.restore.target,
            r.restore.backup,
            corral_daemon::output::serialized_name(&r.restore.state),
            r.restore.progress,
            if r.restore.message.is_empty() {
                String::new()
            } else {
                format!(" ({})", r.restore.message)
            }
        ),
        Err(_) => String::new(),
    }
}

/// The id (`TARGET:NAME`) of the backup `r` names: `[TARGET:]NAME` as given, or a backup's URL as `corral backup
/// ls` shows it (`TARGET_URL?backup=NAME&volume=VOLUME`), looked up among the backups listed.
pub async fn backup_id(c: &Client, r: &str) -> anyhow::Result<String> {
    if !r.contains("://") {
        return Ok(r.to_owned());
    }
    let want = backupstore::BackupUrl::parse(r).map_err(|e| anyhow::anyhow!("backup URL {r:?}: {e}"))?;
    let (Some(name), Some(volume)) = (&want.backup, &want.volume) else {
        bail!(
            "backup URL {r:?} names no backup: it needs ?backup=NAME&volume=VOLUME, as `corral backup ls` shows"
        );
    };
    let bs: Vec<BackupView> = c.get("/v1/backups").await?;
    bs.into_iter()
        .find(|b| {
            b.backup.name == *name
                && b.backup.volume == *volume
                && backupstore::BackupUrl::parse(&b.url).is_ok_and(|u| u.target == want.target)
        })
        .map(|b| b.id)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "no backup {name} of volume {volume} on a backup target at {} (`corral backup ls` lists each backup's id and URL)",
                want.target
            )
        })
}

/// `TARGET:NAME` of the newest backup of a backup volume `[TARGET:]VOLUME`.
pub async fn newest_backup_of(c: &Client, bv: &str) -> anyhow::Result<String> {
    let v: BackupVolumeView = c.get(&format!("/v1/backupvolumes/{bv}")).await?;
    if v.volume.last_backup_name.is_empty() {
        bail!("backup volume {bv} has no completed backup");
    }
    Ok(format!("{}:{}", v.volume.target, v.volume.last_backup_name))
}

/// Waits (progress bar) until a standby volume restored its first backup.
pub async fn wait_standby(c: &Client, volume: &str, timeout: Duration) -> anyhow::Result<RestoreView> {
    let bar = corral_daemon::percent_bar("restoring");
    let end = Instant::now() + timeout;
    loop {
        let r: RestoreView = c.get(&format!("/v1/volumes/{volume}/restore")).await?;
        bar.set_position(u64::from(r.restore.progress));
        if r.restore.restored {
            bar.finish_and_clear();
            return Ok(r);
        }
        if r.restore.state == RestoreState::Failed {
            bar.abandon();
            bail!("the restore into {volume} failed: {}", r.restore.message);
        }
        if Instant::now() > end {
            bar.abandon();
            bail!("the restore into {volume} is still running after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The size of backup `[TARGET:]NAME` (a restored volume's default size).
pub async fn backup_size(c: &Client, backup: &str) -> Result<u64, ClientError> {
    let b: BackupView = c.get(&format!("/v1/backups/{backup}")).await?;
    Ok(b.backup.size)
}

pub async fn run(c: &Client, json: bool, cmd: BackupCmd) -> anyhow::Result<()> {
    match cmd {
        BackupCmd::Target { cmd } => target(c, json, cmd).await,
        BackupCmd::Create(a) => create(c, json, a).await,
        BackupCmd::Ls { volume, target } => ls(c, json, volume, target).await,
        BackupCmd::Get { backup } => get(c, json, &backup).await,
        BackupCmd::Rm { backup } => {
            c.delete(&format!("/v1/backups/{backup}")).await?;
            Ok(())
        }
        BackupCmd::Restore {
            volume,
            backup,
            no_wait,
            timeout,
        } => restore(c, json, &volume, &backup, no_wait, timeout).await,
        BackupCmd::BackingImage(a) => backing_image(c, json, a).await,
        BackupCmd::BackingImageLs => {
            let bs: Vec<BackingImageBackupView> = c.get("/v1/backingimagebackups").await?;
            print(json, &bs, || image_backup_table(&bs))
        }
        BackupCmd::BackingImageGet { id } => backing_image_get(c, json, &id).await,
        BackupCmd::BackingImageCancel { id, no_wait, timeout } => {
            backing_image_cancel(c, json, &id, no_wait, timeout).await
        }
        BackupCmd::BackingImageRm { id } => {
            c.delete(&format!("/v1/backingimagebackups/{id}")).await?;
            Ok(())
        }
        BackupCmd::MaxCount { volume, count } => max_count(c, json, &volume, &count).await,
        BackupCmd::DeltaMax { volume, count } => delta_max(c, json, &volume, &count).await,
        BackupCmd::Volume { cmd } => volume(c, json, cmd).await,
    }
}

/// `backup target set|get|ls|rm`.
async fn target(c: &Client, json: bool, cmd: TargetCmd) -> anyhow::Result<()> {
    match cmd {
        TargetCmd::Set {
            target_url,
            name,
            endpoint,
            region,
            poll_interval,
            credentials_from_env,
            credentials_file,
        } => {
            let body = BackupTargetSet {
                url: target_url,
                endpoint,
                region,
                poll_interval,
                credentials: read_credentials(credentials_from_env, credentials_file.as_ref())?,
            };
            let t: BackupTargetView = c.put(&format!("/v1/backuptargets/{name}"), &body).await?;
            print(json, &t, || target_table(std::slice::from_ref(&t)))
        }
        TargetCmd::Get { name } => {
            let t: BackupTargetView = c.get(&format!("/v1/backuptargets/{name}")).await?;
            print(json, &t, || target_table(std::slice::from_ref(&t)))
        }
        TargetCmd::Ls => {
            let ts: Vec<BackupTargetView> = c.get("/v1/backuptargets").await?;
            print(json, &ts, || target_table(&ts))
        }
        TargetCmd::Rm { name } => {
            c.delete(&format!("/v1/backuptargets/{name}")).await?;
            Ok(())
        }
    }
}

/// `backup create`: waits for the backup with a progress bar unless `--no-wait`.
async fn create(c: &Client, json: bool, a: CreateArgs) -> anyhow::Result<()> {
    let CreateArgs {
        volume,
        snapshot,
        full,
        labels,
        target,
        delta_max,
        block_size,
        no_wait,
        timeout,
    } = a;
    let labels = corral_daemon::parse_labels(&labels).map_err(anyhow::Error::msg)?;
    let body = BackupCreate {
        volume,
        snapshot,
        full,
        labels,
        target,
        delta_max,
        block_size,
    };
    let mut b: BackupView = c.post("/v1/backups", &body).await?;
    if !no_wait {
        b = wait_backup(c, &b.id, Duration::from_secs(timeout)).await?;
    }
    print(json, &b, || {
        let x = &b.backup;
        if x.state == BackupState::Completed {
            format!(
                "{}: {} of snapshot {}; read {}, uploaded {} new",
                b.id,
                kind(x),
                x.snapshot,
                corral_daemon::human_bytes(x.read_bytes),
                corral_daemon::human_bytes(x.new_bytes)
            )
        } else {
            format!("{}: {} (snapshot {})", b.id, x.state.as_str(), x.snapshot)
        }
    })
}

/// `backup ls`: `volume` is `[TARGET:]NAME`; a target in it and `--target` must agree.
async fn ls(c: &Client, json: bool, volume: Option<String>, target: Option<String>) -> anyhow::Result<()> {
    let mut query = Vec::new();
    if let Some(v) = &volume {
        let (t, n) = super::restore::parse_ref(v);
        if v.contains(':') {
            if target.as_ref().is_some_and(|x| *x != t) {
                bail!("{v} names target {t}, --target another");
            }
            query.push(format!("target={t}"));
        }
        query.push(format!("volume={n}"));
    }
    if let Some(t) = &target
        && !volume.as_ref().is_some_and(|v| v.contains(':'))
    {
        query.push(format!("target={t}"));
    }
    let path = if query.is_empty() {
        "/v1/backups".to_owned()
    } else {
        format!("/v1/backups?{}", query.join("&"))
    };
    let bs: Vec<BackupView> = c.get(&path).await?;
    print(json, &bs, || backup_table(&bs))
}

/// `backup get`: one backup as a field table.
async fn get(c: &Client, json: bool, backup: &str) -> anyhow::Result<()> {
    let b: BackupView = c.get(&format!("/v1/backups/{backup}")).await?;
    print(json, &b, || {
        let x = &b.backup;
        let mut rows = vec![
            vec!["id".into(), b.id.clone()],
            vec!["volume".into(), x.volume.clone()],
            vec!["snapshot".into(), x.snapshot.clone()],
            vec!["state".into(), format!("{} {}%", x.state.as_str(), x.progress)],
            vec!["kind".into(), kind(x)],
            vec!["base backup".into(), x.base_backup.clone()],
            vec!["size".into(), corral_daemon::human_bytes(x.size)],
            vec!["read".into(), corral_daemon::human_bytes(x.read_bytes)],
            vec!["uploaded new".into(), corral_daemon::human_bytes(x.new_bytes)],
            vec!["started".into(), x.started.clone()],
            vec!["completed".into(), x.completed.clone()],
            vec!["url".into(), b.url.clone()],
        ];
        if !x.labels.is_empty() {
            rows.push(vec![
                "labels".into(),
                x.labels
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            ]);
        }
        if !x.backing_image_name.is_empty() {
            rows.push(vec![
                "backing image".into(),
                format!("{} (SHA-512 {})", x.backing_image_name, x.backing_image_checksum),
            ]);
        }
        if !x.error.is_empty() {
            rows.push(vec!["error".into(), x.error.clone()]);
        }
        table(&["FIELD", "VALUE"], rows)
    })
}

/// `backup restore`: waits up to `timeout` seconds unless `no_wait`.
async fn restore(
    c: &Client,
    json: bool,
    volume: &str,
    backup: &str,
    no_wait: bool,
    timeout: u64,
) -> anyhow::Result<()> {
    let mut r: RestoreView = c
        .post(
            &format!("/v1/volumes/{volume}/restore"),
            &RestoreRequest {
                backup: backup_id(c, backup).await?,
            },
        )
        .await?;
    if !no_wait {
        r = wait_restore(c, volume, Duration::from_secs(timeout)).await?;
    }
    print(json, &r, || {
        format!(
            "volume {volume}: restore of {} {}",
            r.restore.backup,
            corral_daemon::output::serialized_name(&r.restore.state)
        )
    })
}

/// `backup backing-image`: waits for the image's backup unless `--no-wait`.
async fn backing_image(c: &Client, json: bool, a: BackingImageArgs) -> anyhow::Result<()> {
    let BackingImageArgs {
        name,
        target,
        max_upload_rate,
        no_wait,
        timeout,
    } = a;
    let mut v: BackingImageBackupView = c
        .post(
            &format!("/v1/backingimages/{name}/backup"),
            &BackingImageBackupRequest {
                target,
                max_upload_rate,
            },
        )
        .await?;
    if !no_wait {
        v = wait_done(
            c,
            &format!("/v1/backingimagebackups/{}", v.id),
            &format!("backup {} of backing image {name}", v.id),
            Duration::from_secs(timeout),
            |b: &BackingImageBackupView| (b.backup.state, b.backup.progress, b.backup.error.clone()),
        )
        .await?;
    }
    print(json, &v, || {
        let b = &v.backup;
        if b.state == BackupState::Completed {
            format!(
                "backing image {} backed up as {} ({} uploaded, {} blocks deduplicated)\nbackup URL: {}\nSHA-512: {}\n",
                b.image,
                v.id,
                corral_daemon::human_bytes(b.new_bytes),
                b.deduplicated_blocks,
                b.backup_url,
                b.checksum
            )
        } else {
            format!(
                "backup {} of backing image {}: {} on node {} (corral backup backing-image-get {})\n",
                v.id,
                b.image,
                b.state.as_str(),
                b.node_id,
                v.id
            )
        }
    })
}

/// `backup backing-image-get`.
async fn backing_image_get(c: &Client, json: bool, id: &str) -> anyhow::Result<()> {
    let b: BackingImageBackupView = c.get(&format!("/v1/backingimagebackups/{id}")).await?;
    print(json, &b, || {
        let mut s = image_backup_table(std::slice::from_ref(&b));
        if !s.ends_with('\n') {
            s.push('\n');
        }
        s.push_str(&format!("SHA-512: {}\n", b.backup.checksum));
        s
    })
}

/// `backup backing-image-cancel`: waits up to `timeout` seconds for the backup to stop unless `no_wait`.
async fn backing_image_cancel(
    c: &Client,
    json: bool,
    id: &str,
    no_wait: bool,
    timeout: u64,
) -> anyhow::Result<()> {
    let path = format!("/v1/backingimagebackups/{id}");
    let mut b: BackingImageBackupView = c.post(&format!("{path}/cancel"), &serde_json::json!({})).await?;
    let end = Instant::now() + Duration::from_secs(timeout);
    while !no_wait && b.backup.state.active() {
        if Instant::now() > end {
            bail!("backup {id} still {} after {timeout} s", b.backup.state.as_str());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        b = c.get(&path).await?;
    }
    print(json, &b, || {
        format!(
            "backup {} of backing image {}: {}{}\n",
            b.id,
            b.backup.image,
            b.backup.state.as_str(),
            if b.backup.error.is_empty() {
                String::new()
            } else {
                format!(" ({})", b.backup.error)
            }
        )
    })
}

/// A per-volume count flag: a whole number, or `none` for the setting's.
fn count_or_none(count: &str) -> anyhow::Result<Option<u32>> {
    match count {
        "none" => Ok(None),
        n => n
            .parse()
            .map(Some)
            .with_context(|| format!("count {n:?}: a whole number or none")),
    }
}

/// `backup max-count VOLUME COUNT`.
async fn max_count(c: &Client, json: bool, volume: &str, count: &str) -> anyhow::Result<()> {
    let backup_max_count = count_or_none(count)?;
    let r: BackupMaxCount = c
        .put(
            &format!("/v1/volumes/{volume}/backupmaxcount"),
            &BackupMaxCount { backup_max_count },
        )
        .await?;
    print(json, &r, || match r.backup_max_count {
        Some(n) => format!("volume {volume}: backup-max-count {n}"),
        None => format!("volume {volume}: backup-max-count from the setting"),
    })
}

/// `backup delta-max VOLUME COUNT`.
async fn delta_max(c: &Client, json: bool, volume: &str, count: &str) -> anyhow::Result<()> {
    let backup_delta_max = count_or_none(count)?;
    let r: BackupDeltaMax = c
        .put(
            &format!("/v1/volumes/{volume}/backupdeltamax"),
            &BackupDeltaMax { backup_delta_max },
        )
        .await?;
    print(json, &r, || match r.backup_delta_max {
        Some(n) => format!("volume {volume}: backup-delta-max {n}"),
        None => format!("volume {volume}: backup-delta-max from the setting"),
    })
}

/// `backup volume ls|get|rm`.
async fn volume(c: &Client, json: bool, cmd: VolumeCmd) -> anyhow::Result<()> {
    match cmd {
        VolumeCmd::Ls => {
            let vs: Vec<BackupVolumeView> = c.get("/v1/backupvolumes").await?;
            print(json, &vs, || volume_table(&vs))
        }
        VolumeCmd::Get { name } => {
            let v: BackupVolumeView = c.get(&format!("/v1/backupvolumes/{name}")).await?;
            print(json, &v, || volume_table(std::slice::from_ref(&v)))
        }
        VolumeCmd::Rm { name } => {
            c.delete(&format!("/v1/backupvolumes/{name}")).await?;
            Ok(())
        }
    }
}
