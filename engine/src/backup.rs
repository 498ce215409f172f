//! `corral-engine backup ...`: backups of the engine's volume to a file or S3 target, and restores into it.
//!
//! Create and restore run on the replicas (their `ReplicaBackupService` on the sync-agent port): a backup is taken
//! by the first RW replica; a restore runs on every RW replica in parallel with the frontend down, each replica
//! writing into its own head. Listing, inspection and deletion talk to the target directly from this process.
//! S3 credentials come from `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (`AWS_SESSION_TOKEN`) and are passed
//! to the replicas with each request.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use anyhow::{Context, bail};
use backupstore::{BackupStore, BackupUrl, GcOptions, target::CREDENTIAL_KEYS};
use clap::Subcommand;
use corral_proto::engine_generation::EngineGeneration;
use corral_proto::v1::{self, replica_backup_service_client::ReplicaBackupServiceClient};
use tonic::codegen::InterceptedService;
use tonic::transport::Channel;

use crate::{client, print, table};

#[derive(Subcommand, Debug)]
#[allow(clippy::large_enum_variant)] // parsed once per process; boxing would only obscure the clap derive
pub enum BackupCmd {
    /// Back up a snapshot of the volume; prints the backup URL (TARGET?backup=NAME&volume=VOLUME).
    Create(CreateArgs),
    /// Restore a backup into the volume (the frontend is stopped meanwhile; every RW replica restores itself).
    Restore {
        /// Backup URL.
        #[arg(value_name = "URL")]
        backup: String,
        /// Apply only the blocks changed since the backup restored last (standby volume).
        #[arg(long)]
        incremental: bool,
        /// Blocks in flight per replica.
        #[arg(long, default_value_t = 8)]
        concurrency: u32,
        /// Shut an attached frontend down for the restore and start it again after (its clients lose the
        /// volume meanwhile and then see the restored data). Without it, a restore into a volume whose frontend
        /// is attached (serving IO) is refused: writes through it would be lost.
        #[arg(long)]
        detach_frontend: bool,
    },
    /// End the volume's backup chain (after a revert or an out-of-band restore): the next backup is full.
    EndChain {
        /// Why (recorded as the next backup's full reason).
        #[arg(long)]
        reason: String,
        /// Also mark the newest backup on this target (with volume=NAME, or the volume's own name).
        #[arg(long, env = "CORRAL_BACKUP_TARGET")]
        target: Option<String>,
    },
    /// List backups of a target (one volume with --volume, or every volume).
    Ls {
        /// Target URL.
        target: String,
        #[arg(long)]
        volume: Option<String>,
    },
    /// One backup: sizes, chain, uploaded bytes; --verify reads and checks every block.
    Inspect {
        /// Backup URL.
        #[arg(value_name = "URL")]
        backup: String,
        #[arg(long)]
        verify: bool,
    },
    /// Delete a backup; blocks no other backup uses are collected.
    Rm {
        /// Backup URL.
        #[arg(value_name = "URL")]
        backup: String,
        /// Blocks written less than this many seconds ago are kept.
        #[arg(long, default_value_t = 300)]
        gc_margin: u64,
        /// Seconds to wait for running backups/restores of the volume.
        #[arg(long, default_value_t = 10)]
        lock_wait: u64,
    },
    /// Backup volumes.
    Volume {
        #[command(subcommand)]
        cmd: VolumeCmd,
    },
}

/// The flags of `backup create`.
#[derive(clap::Args, Debug)]
pub struct CreateArgs {
    /// Snapshot to back up.
    #[arg(long)]
    pub snapshot: String,
    /// Target: file:///DIR or s3://BUCKET/PREFIX?endpoint=URL&region=R.
    #[arg(long, env = "CORRAL_BACKUP_TARGET")]
    pub target: String,
    /// Backup name (generated when omitted).
    #[arg(long)]
    pub name: Option<String>,
    /// Label k=v (repeatable).
    #[arg(long = "label")]
    pub labels: Vec<String>,
    /// auto: incremental unless the chain policy says full; full: read and upload everything again;
    /// incremental: go past backup-delta-max (fails when the chain ended otherwise).
    #[arg(long, default_value = "auto", value_parser = ["auto", "full", "incremental"])]
    pub mode: String,
    /// Force a full backup (same as --mode full); the previous backup ends its chain.
    #[arg(long, conflicts_with = "mode")]
    pub full: bool,
    /// backup-incremental off: this backup is full and ends its own chain.
    #[arg(long)]
    pub no_incremental: bool,
    /// backup-max-count: refuse when the backup volume already holds this many completed backups (after
    /// --retain's deletions are discounted).
    #[arg(long)]
    pub max_count: Option<u32>,
    /// Backing image name to record (with --backing-image-checksum; default: the replica's backing file name
    /// and its SHA-256).
    #[arg(long, requires = "backing_image_checksum")]
    pub backing_image_name: Option<String>,
    /// Backing image checksum to record: sha512:HEX.
    #[arg(long, requires = "backing_image_name")]
    pub backing_image_checksum: Option<String>,
    /// Keep only the newest N completed backups of the volume.
    #[arg(long)]
    pub retain: Option<u32>,
    /// backup-delta-max: backups per chain, its full one included (5: the 6th backup is full).
    #[arg(long, default_value_t = backupstore::config::DEFAULT_DELTA_MAX)]
    pub delta_max: u32,
    /// Block size of a new backup volume (4K..16M, power of two).
    #[arg(long, value_parser = corral_daemon::parse_size)]
    pub block_size: Option<u64>,
    /// Compression of a new backup volume: lz4, zstd or none.
    #[arg(long)]
    pub compression: Option<String>,
    /// Blocks in flight.
    #[arg(long, default_value_t = 8)]
    pub concurrency: u32,
    /// Upload at most this many bytes per second (e.g. 50M).
    #[arg(long, value_parser = corral_daemon::parse_size)]
    pub rate_limit: Option<u64>,
    /// GC safety margin in seconds for retention deletes.
    #[arg(long, default_value_t = 300)]
    pub gc_margin: u64,
    /// Return once the backup started.
    #[arg(long)]
    pub no_wait: bool,
}

#[derive(Subcommand, Debug)]
pub enum VolumeCmd {
    /// Delete a backup volume with every backup and block (URL with volume=NAME).
    Rm {
        /// Target URL with volume=NAME.
        #[arg(value_name = "URL")]
        backup: String,
        #[arg(long, default_value_t = 10)]
        lock_wait: u64,
    },
}

/// S3 credentials for the replicas, from this process's environment or the file `CORRAL_BACKUP_CREDENTIALS_FILE`
/// names (passed in the request, never on a command line).
fn credentials() -> HashMap<String, String> {
    let file = std::env::var_os(backupstore::target::CREDENTIALS_FILE_ENV)
        .filter(|p| !p.is_empty())
        .and_then(|p| backupstore::target::read_credentials_file(std::path::Path::new(&p)).ok())
        .unwrap_or_default();
    CREDENTIAL_KEYS
        .iter()
        .filter_map(|k| {
            std::env::var(k)
                .ok()
                .filter(|v| !v.is_empty())
                .or_else(|| file.get(*k).cloned())
                .map(|v| ((*k).to_owned(), v))
        })
        .collect()
}

fn open(url: &str) -> anyhow::Result<(BackupUrl, BackupStore)> {
    let u = BackupUrl::parse(url)?;
    let s = BackupStore::open(&u, &BTreeMap::new())?;
    Ok((u, s))
}

/// The backup service of a replica, served on the sync endpoint of its address; every call presents `generation`,
/// the volume's engine's (`VolumeGet`), as the engine's own calls do: a replica that accepted one refuses a
/// restore or chain end without it.
async fn replica_backup_client(address: &str, generation: u64) -> anyhow::Result<ReplicaBackupClient> {
    let a: corral_proto::ReplicaAddress = address.parse()?;
    let ch = corral_proto::grpc::connect_endpoint(&a.sync, corral_proto::grpc::GrpcTimeouts::OPERATOR)
        .await
        .with_context(|| format!("replica backup service of {a}"))?;
    Ok(ReplicaBackupServiceClient::with_interceptor(
        ch,
        EngineGeneration(generation),
    ))
}

type ReplicaBackupClient = ReplicaBackupServiceClient<InterceptedService<Channel, EngineGeneration>>;

async fn rw_replicas(url: &str) -> anyhow::Result<Vec<String>> {
    let r = client(url).await?.replica_list(v1::Empty {}).await?.into_inner();
    let rw: Vec<String> = r
        .replicas
        .into_iter()
        .filter(|x| x.mode == "RW")
        .map(|x| x.address)
        .collect();
    if rw.is_empty() {
        bail!("the volume has no RW replica");
    }
    Ok(rw)
}

fn kind(incremental: bool, pos: u32) -> String {
    if incremental {
        format!("incremental #{pos}")
    } else {
        "full".into()
    }
}

pub async fn run(url: &str, json: bool, cmd: BackupCmd) -> anyhow::Result<()> {
    match cmd {
        BackupCmd::Create(a) => create(url, json, a).await,
        BackupCmd::Restore {
            backup,
            incremental,
            concurrency,
            detach_frontend,
        } => restore(url, json, &backup, incremental, concurrency, detach_frontend).await,
        BackupCmd::EndChain { reason, target } => end_chain(url, json, reason, target).await,
        BackupCmd::Ls { target, volume } => ls(json, &target, volume).await,
        BackupCmd::Inspect { backup: u, verify } => inspect(json, &u, verify).await,
        BackupCmd::Rm {
            backup: u,
            gc_margin,
            lock_wait,
        } => rm(json, &u, gc_margin, lock_wait).await,
        BackupCmd::Volume {
            cmd: VolumeCmd::Rm { backup: u, lock_wait },
        } => {
            let (bu, s) = open(&u)?;
            let gc = GcOptions {
                lock_wait: Duration::from_secs(lock_wait),
                ..GcOptions::default()
            };
            let volume = bu.require_volume()?;
            let n = s.delete_volume(volume, &gc).await?;
            print(
                json,
                &serde_json::json!({"volume": volume, "objectsDeleted": n}),
                || format!("backup volume {volume} deleted ({n} objects)"),
            )
        }
    }
}

/// `backup create`: the first RW replica backs the snapshot up; waits for it unless `no_wait`.
async fn create(url: &str, json: bool, a: CreateArgs) -> anyhow::Result<()> {
    let CreateArgs {
        snapshot,
        target,
        name,
        labels,
        mode,
        full,
        no_incremental,
        max_count,
        backing_image_name,
        backing_image_checksum,
        retain,
        delta_max,
        block_size,
        compression,
        concurrency,
        rate_limit,
        gc_margin,
        no_wait,
    } = a;
    let mode = if full { "full".to_owned() } else { mode };
    let labels = corral_daemon::parse_labels(&labels).map_err(anyhow::Error::msg)?;
    let v1::Volume {
        name: volume,
        generation,
        ..
    } = client(url).await?.volume_get(v1::Empty {}).await?.into_inner();
    let replica = rw_replicas(url).await?.remove(0);
    let mut c = replica_backup_client(&replica, generation).await?;
    let r = c
        .backup_create(v1::BackupCreateRequest {
            snapshot,
            target,
            volume,
            backup_name: name.unwrap_or_default(),
            labels,
            mode,
            delta_max,
            retain: retain.unwrap_or(0),
            concurrency,
            block_size: block_size.unwrap_or(0),
            compression: compression.unwrap_or_default(),
            credentials: credentials(),
            max_upload_rate: rate_limit.unwrap_or(0),
            gc_margin_seconds: gc_margin.max(1),
            incremental_disabled: no_incremental,
            max_count: max_count.unwrap_or(0),
            backing_image_name: backing_image_name.unwrap_or_default(),
            backing_image_checksum: backing_image_checksum.unwrap_or_default(),
        })
        .await?
        .into_inner();
    if no_wait {
        return print(json, &r, || r.url.clone());
    }
    wait_for_backup(&mut c, &r, json).await
}

/// Polls the replica for the backup `r` started until it completes (prints its summary) or fails.
async fn wait_for_backup(
    c: &mut ReplicaBackupClient,
    r: &v1::BackupCreateResponse,
    json: bool,
) -> anyhow::Result<()> {
    let bar = corral_daemon::percent_bar(&format!("backup {}", r.backup_name));
    loop {
        let s = c
            .backup_status(v1::BackupJobRef {
                backup_name: r.backup_name.clone(),
            })
            .await?
            .into_inner();
        bar.set_position(u64::from(s.progress));
        match s.state.as_str() {
            "in-progress" => tokio::time::sleep(Duration::from_millis(200)).await,
            "complete" => {
                bar.finish_and_clear();
                if !json {
                    eprintln!(
                        "backup {} of snapshot {}: {}{}; read {}, uploaded {} new ({} blocks), {} re-uploaded",
                        s.backup_name,
                        s.snapshot,
                        kind(s.is_incremental, s.chain_position),
                        if s.full_reason.is_empty() {
                            format!(" from snapshot {:?}", s.diff_from_snapshot)
                        } else {
                            format!(" ({})", s.full_reason)
                        },
                        corral_daemon::human_bytes(s.read_bytes),
                        corral_daemon::human_bytes(s.new_bytes),
                        s.new_blocks,
                        corral_daemon::human_bytes(s.reuploaded_bytes),
                    );
                }
                return print(json, &s, || s.url.clone());
            }
            _ => {
                bar.finish_and_clear();
                bail!("backup {} {}: {}", s.backup_name, s.state, s.error);
            }
        }
    }
}

/// `backup end-chain`: every RW replica records the end; the target's newest backup is marked once.
async fn end_chain(url: &str, json: bool, reason: String, target: Option<String>) -> anyhow::Result<()> {
    let v1::Volume {
        name: volume,
        generation,
        ..
    } = client(url).await?.volume_get(v1::Empty {}).await?.into_inner();
    let mut reached = Vec::new();
    let mut marked = String::new();
    for (i, r) in rw_replicas(url).await?.iter().enumerate() {
        let out = replica_backup_client(r, generation)
            .await?
            .backup_chain_end(v1::BackupChainEndRequest {
                reason: reason.clone(),
                // The store is marked once, through the first replica.
                target: if i == 0 {
                    target.clone().unwrap_or_default()
                } else {
                    String::new()
                },
                volume: volume.clone(),
                credentials: credentials(),
            })
            .await
            .with_context(|| format!("ending the chain on replica {r}"))?
            .into_inner();
        if i == 0 {
            marked = out.marked_backup;
        }
        reached.push(r.clone());
    }
    let out = serde_json::json!({"replicas": reached, "markedBackup": marked});
    print(json, &out, || {
        format!(
            "backup chain ended on {} replica(s){}",
            reached.len(),
            if marked.is_empty() {
                String::new()
            } else {
                format!("; backup {marked} marked end of chain")
            }
        )
    })
}

/// `backup ls`: the backups of one volume of the target, or of every volume.
async fn ls(json: bool, target: &str, volume: Option<String>) -> anyhow::Result<()> {
    let (u, s) = open(target)?;
    let vols = match volume.or(u.volume) {
        Some(v) => vec![v],
        None => s.list_volumes().await?,
    };
    let mut all = Vec::new();
    for v in vols {
        all.extend(s.summaries(&v).await?);
    }
    print(json, &all, || {
        table(
            &[
                "volume",
                "backup",
                "snapshot",
                "state",
                "kind",
                "full reason",
                "end of chain",
                "size",
                "data",
                "new",
                "completed",
            ],
            all.iter()
                .map(|b| {
                    let c = &b.config;
                    vec![
                        c.volume.clone(),
                        c.name.clone(),
                        c.snapshot.clone(),
                        serde_json::to_value(c.state)
                            .ok()
                            .and_then(|v| v.as_str().map(str::to_owned))
                            .unwrap_or_default(),
                        kind(c.is_incremental, c.chain_position),
                        c.full_reason
                            .as_ref()
                            .map(|r| r.kind().to_owned())
                            .unwrap_or_default(),
                        if c.end_of_chain { "yes" } else { "" }.to_owned(),
                        corral_daemon::human_bytes(c.size),
                        corral_daemon::human_bytes(b.data_bytes),
                        corral_daemon::human_bytes(c.stats.new_bytes),
                        c.completed.clone(),
                    ]
                })
                .collect(),
        )
        .to_string()
    })
}

/// `backup inspect`: one backup's record, chain and sizes; `--verify` reads every block.
async fn inspect(json: bool, u: &str, verify: bool) -> anyhow::Result<()> {
    let (bu, s) = open(u)?;
    let (volume, name) = (bu.require_volume()?, bu.require_backup()?);
    let mut cfg = s.backup_config(volume, name).await?;
    let chain = s.chain_of(volume, name).await?;
    let vol = s.volume_config(volume).await?;
    let verified = if verify {
        Some(s.verify(volume, name, 8).await?)
    } else {
        None
    };
    let data_bytes = cfg.data_bytes();
    let block_count = cfg.blocks.len();
    cfg.blocks = Vec::new();
    let out = serde_json::json!({
        "url": s.backup_url(volume, name),
        "backup": cfg,
        "blockCount": block_count,
        "dataBytes": data_bytes,
        "chain": chain,
        "volume": vol,
        "verify": verified,
    });
    print(json, &out, || {
        let mut rows = vec![
            vec!["url".into(), s.backup_url(volume, name)],
            vec!["snapshot".into(), cfg.snapshot.clone()],
            vec![
                "state".into(),
                out["backup"]["state"].as_str().unwrap_or_default().to_owned(),
            ],
            vec!["kind".into(), kind(cfg.is_incremental, cfg.chain_position)],
            vec![
                "full reason".into(),
                cfg.full_reason
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default(),
            ],
            vec!["end of chain".into(), cfg.end_of_chain.to_string()],
            vec!["base backup".into(), cfg.base_backup.clone()],
            vec!["diffed from snapshot".into(), cfg.diff_from_snapshot.clone()],
            vec!["chain".into(), chain.join(" → ")],
            vec!["volume size".into(), corral_daemon::human_bytes(cfg.size)],
            vec!["block size".into(), corral_daemon::human_bytes(cfg.block_size)],
            vec!["blocks".into(), block_count.to_string()],
            vec!["data".into(), corral_daemon::human_bytes(data_bytes)],
            vec!["read".into(), corral_daemon::human_bytes(cfg.stats.read_bytes)],
            vec![
                "newly uploaded".into(),
                format!(
                    "{} in {} blocks ({} stored)",
                    corral_daemon::human_bytes(cfg.stats.new_bytes),
                    cfg.stats.new_blocks,
                    corral_daemon::human_bytes(cfg.stats.new_stored_bytes)
                ),
            ],
            vec![
                "re-uploaded".into(),
                corral_daemon::human_bytes(cfg.stats.reuploaded_bytes),
            ],
            vec![
                "compression".into(),
                format!("{:?}", cfg.compression).to_lowercase(),
            ],
            vec![
                "backing image".into(),
                format!("{} {}", cfg.backing_image_name, cfg.backing_image_checksum)
                    .trim()
                    .to_owned(),
            ],
            vec!["completed".into(), cfg.completed.clone()],
        ];
        if let Some(v) = &verified {
            rows.push(vec![
                "verify".into(),
                if v.bad.is_empty() {
                    format!("{} blocks ok", v.blocks_checked)
                } else {
                    format!(
                        "{} of {} blocks bad: {}",
                        v.bad.len(),
                        v.blocks_checked,
                        v.bad
                            .iter()
                            .map(|b| format!("offset {} ({})", b.offset, b.reason))
                            .collect::<Vec<_>>()
                            .join("; ")
                    )
                },
            ]);
        }
        table(&["field", "value"], rows).to_string()
    })?;
    if verified.is_some_and(|v| !v.bad.is_empty()) {
        bail!("backup {name} has damaged blocks");
    }
    Ok(())
}

/// `backup rm`: deletes a backup and collects the blocks no other backup uses.
async fn rm(json: bool, u: &str, gc_margin: u64, lock_wait: u64) -> anyhow::Result<()> {
    let (bu, s) = open(u)?;
    let gc = GcOptions {
        margin: Duration::from_secs(gc_margin),
        lock_wait: Duration::from_secs(lock_wait),
    };
    let out = s
        .delete_backup(bu.require_volume()?, bu.require_backup()?, &gc)
        .await?;
    print(json, &out, || {
        let mut m = format!(
            "backup {} deleted; {} blocks collected",
            bu.require_backup().unwrap_or_default(),
            out.deleted_blocks
        );
        if !out.skipped.is_empty() {
            m.push_str(&format!(" (garbage collection skipped: {})", out.skipped));
        }
        m
    })
}

async fn restore(
    url: &str,
    json: bool,
    backup: &str,
    incremental: bool,
    concurrency: u32,
    detach_frontend: bool,
) -> anyhow::Result<()> {
    BackupUrl::parse(backup)?.require_backup()?;
    let mut c = client(url).await?;
    let vol = c.volume_get(v1::Empty {}).await?.into_inner();
    let was_up = vol.frontend_state == "attached";
    if was_up && !detach_frontend {
        bail!(
            "volume {}'s frontend is attached (serving IO at {}): writes through it would be lost under the \
             restore; detach it first, or pass --detach-frontend to shut it down for the restore",
            vol.name,
            vol.endpoints.join(", ")
        );
    }
    let replicas = rw_replicas(url).await?;
    c.frontend_shutdown(v1::Empty {}).await?;
    let result = async {
        let mut clients = Vec::new();
        for r in &replicas {
            let mut rc = replica_backup_client(r, vol.generation).await?;
            rc.backup_restore(v1::BackupRestoreRequest {
                url: backup.to_owned(),
                credentials: credentials(),
                concurrency,
                incremental,
            })
            .await
            .with_context(|| format!("restore on replica {r}"))?;
            clients.push((r.clone(), rc));
        }
        let bar = corral_daemon::percent_bar("restoring");
        loop {
            let mut done = Vec::new();
            let mut min = 100;
            for (r, rc) in &mut clients {
                let s = rc.restore_status(v1::RestoreStatusRequest {}).await?.into_inner();
                match s.state.as_str() {
                    "in-progress" => min = min.min(s.progress),
                    "complete" => done.push((r.clone(), s)),
                    _ => {
                        bar.finish_and_clear();
                        bail!("restore on replica {r} {}: {}", s.state, s.error);
                    }
                }
            }
            bar.set_position(u64::from(min));
            if done.len() == clients.len() {
                bar.finish_and_clear();
                return Ok(done);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    .await;
    if was_up {
        c.frontend_start(v1::Empty {}).await?;
    }
    let done = result?;
    let rows: Vec<serde_json::Value> = done
        .iter()
        .map(|(r, s)| serde_json::json!({"replica": r, "status": s}))
        .collect();
    print(json, &rows, || {
        done.iter()
            .map(|(r, s)| {
                format!(
                    "{r}: restored {} ({}: {} written in {} blocks, {} zeroed)",
                    s.last_restored,
                    if s.incremental { "incremental" } else { "full" },
                    corral_daemon::human_bytes(s.bytes_written),
                    s.blocks_written,
                    corral_daemon::human_bytes(s.zeroed_bytes)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    })
}
