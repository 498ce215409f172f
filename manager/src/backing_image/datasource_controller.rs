//! Node-local: runs one `corral-datasource` for every data source of this node until a disk manager took its file
//! (`started`), polls its `GET /v1/file` (10 failed polls in a row → the daemon is restarted), restarts a failed
//! job with backoff (30 s doubling to 10 min, from each start) unless it was an upload (the user uploads into a new
//! image instead), and stops the daemon once the file is taken or the document is gone.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::model::{BackingImageDataSource, FileState, SourceType, state};
use crate::backup_target::restore_source;
use crate::context::Ctx;
use crate::model::ProcessRecord;
use crate::process::{Observed, Supervisor};
use crate::runtime::{Requeue, WorkQueue, feed_node_local, run_worker};
use crate::store::absent_ok;

pub const BINARY: &str = "corral-datasource";
const POLL: Duration = Duration::from_secs(1);
/// Failed polls of a running daemon before it is restarted.
const MAX_POLL_FAILURES: u32 = 10;

/// How long after its start a run whose job failed (e.g. a URL whose server is down) is followed by the next run:
/// 30 s doubling to 10 min. A source that stays unreachable is retried for as long as the image exists (the image
/// reads `failed` with the reason meanwhile), at most every 10 minutes; a daemon that crashed is restarted sooner
/// ([`crate::process::restart_backoff`]).
pub(crate) fn job_retry_backoff(attempts: u32) -> Duration {
    Duration::from_secs(30u64 << attempts.saturating_sub(1).min(5)).min(Duration::from_secs(600))
}

pub fn start(ctx: &Ctx, cancel: &CancellationToken) {
    let q = Arc::new(WorkQueue::default());
    feed_node_local::<BackingImageDataSource>(
        ctx,
        q.clone(),
        cancel.clone(),
        Duration::from_secs(3),
        |d: &BackingImageDataSource| d.spec.node_id.as_str(),
    );
    let ctx = ctx.clone();
    let c = cancel.clone();
    let local = Arc::new(Supervisor::new(
        BINARY,
        "datasource",
        &ctx.cfg.processes,
        &ctx.cfg.data_dir,
    ));
    tokio::spawn(async move {
        let m = ctx.metrics.clone();
        run_worker("backing-image-data-source", q, c, m, |name| {
            reconcile(ctx.clone(), local.clone(), name)
        })
        .await;
    });
}

/// The part of the data source's `/v1/file` JSON the manager reads (`docs/formats.md`, "Data source").
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FileInfo {
    #[serde(deserialize_with = "super::model::file_state_serde::deserialize")]
    state: FileState,
    progress: u32,
    size: u64,
    virtual_size: u64,
    current_checksum: String,
    message: String,
}

/// The HTTP client of every data source this manager talks to, built once with the process's TLS configs
/// (`corral_tls::installed`), and the URL of `path` on the data source at `address` (`https://` with them).
pub(crate) fn data_source_http(
    address: &str,
    path: &str,
) -> Result<(&'static reqwest::Client, String), String> {
    static CLIENT: std::sync::OnceLock<Result<reqwest::Client, String>> = std::sync::OnceLock::new();
    let tls = corral_tls::installed().map(|t| &*t.client);
    let client = CLIENT.get_or_init(|| {
        sparse_sync::reqwest_tls(reqwest::Client::builder(), tls)
            .build()
            .map_err(|e| format!("building the data-source HTTP client: {e}"))
    });
    let url = format!("{}{path}", sparse_sync::http_base(address, tls.is_some()));
    client.as_ref().map(|c| (c, url)).map_err(Clone::clone)
}

async fn poll(address: &str) -> anyhow::Result<FileInfo> {
    let (http, url) = data_source_http(address, "/v1/file").map_err(anyhow::Error::msg)?;
    let resp = http
        .get(url)
        .timeout(Duration::from_secs(3))
        .send()
        .await?
        .error_for_status()?;
    Ok(resp.json().await?)
}

/// Stops the recorded daemon and any this manager process started for the image; its credentials file goes.
async fn stop(local: &Supervisor, name: &str, rec: Option<&ProcessRecord>) {
    local.stop(name, rec, Duration::from_secs(10)).await;
    let _ = std::fs::remove_file(credentials_path(local, name));
}

/// The file a restore's data source reads its target's credentials from, beside its ready file.
fn credentials_path(local: &Supervisor, name: &str) -> std::path::PathBuf {
    local.ready_path(name).with_extension("credentials")
}

async fn reconcile(ctx: Ctx, local: Arc<Supervisor>, name: String) -> anyhow::Result<Requeue> {
    let Some(obj) = ctx.db.get::<BackingImageDataSource>(&name).await? else {
        stop(&local, &name, None).await;
        return Ok(None);
    };
    let ds = &obj.data;
    if ds.spec.node_id != ctx.cfg.node_id {
        return Ok(None);
    }
    let rec = ds.status.process.clone();
    let observed = local.observe(&name, rec.as_ref()).await;
    let alive = observed != Observed::Down;
    if ds.spec.started {
        if alive || rec.is_some() {
            stop(&local, &name, rec.as_ref()).await;
            absent_ok(
                ctx.db
                    .modify::<BackingImageDataSource>(&name, |d| {
                        d.status.process = None;
                        d.status.address.clear();
                        true
                    })
                    .await,
            )?;
        }
        return Ok(None);
    }
    if ds.status.generation != ds.spec.generation {
        // Asked to run the source again (every copy failed): a fresh daemon, a fresh count of attempts.
        stop(&local, &name, rec.as_ref()).await;
        let generation = ds.spec.generation;
        absent_ok(
            ctx.db
                .modify::<BackingImageDataSource>(&name, |d| {
                    d.status = super::model::DataSourceStatus {
                        generation,
                        ..Default::default()
                    };
                    true
                })
                .await,
        )?;
        return Ok(Some(Duration::ZERO));
    }
    match observed {
        Observed::Running => return monitor(&ctx, &local, &name, ds).await,
        Observed::Starting => return Ok(Some(Duration::from_millis(200))),
        Observed::Ready(listen) => {
            let http = listen
                .get("http")
                .with_context(|| format!("data source {name} reported no http listener: {listen:?}"))?
                .clone();
            tracing::info!(image = name, http, "data source ready");
            absent_ok(
                ctx.db
                    .modify::<BackingImageDataSource>(&name, |d| {
                        d.status.address.clone_from(&http);
                        if let Some(p) = &mut d.status.process {
                            p.listen.clone_from(&listen);
                        }
                        true
                    })
                    .await,
            )?;
            return Ok(Some(Duration::ZERO));
        }
        Observed::Down => {}
    }
    // Not running and not taken.
    let failed = ds.status.state == Some(state::FAILED);
    if rec.is_some() && !failed {
        let message = "the data source daemon exited before a disk manager took the file".to_owned();
        tracing::warn!(image = name, "{message}");
        set_failed(&ctx, &name, &message).await?;
        return Ok(Some(Duration::ZERO));
    }
    if failed && ds.spec.source_type == SourceType::Upload {
        // An upload cannot be repeated by the manager: the user deletes the image and uploads again.
        return Ok(None);
    }
    if failed
        && let Some(rec) = rec.as_ref()
        && let Some(wait) = Supervisor::wait_since_start(rec, job_retry_backoff(ds.status.attempts))
    {
        return Ok(Some(wait));
    }
    if ds.status.attempts > 0
        && let Some(wait) = Supervisor::restart_wait(rec.as_ref(), ds.status.attempts)
    {
        return Ok(Some(wait));
    }
    spawn(&ctx, &local, &name, ds).await?;
    Ok(Some(POLL))
}

async fn set_failed(ctx: &Ctx, name: &str, message: &str) -> anyhow::Result<()> {
    absent_ok(
        ctx.db
            .modify::<BackingImageDataSource>(name, |d| {
                d.status.state = Some(state::FAILED);
                d.status.message = message.to_owned();
                d.status.address.clear();
                true
            })
            .await,
    )?;
    Ok(())
}

async fn monitor(
    ctx: &Ctx,
    local: &Supervisor,
    name: &str,
    ds: &BackingImageDataSource,
) -> anyhow::Result<Requeue> {
    match poll(&ds.status.address).await {
        Ok(info) => {
            if info.state == state::FAILED && ds.spec.source_type.refetchable() {
                tracing::warn!(
                    image = name,
                    message = info.message,
                    "data source failed: restarting it"
                );
                // The record stays: the restart's backoff counts from its start.
                stop(local, name, ds.status.process.as_ref()).await;
            }
            absent_ok(
                ctx.db
                    .modify::<BackingImageDataSource>(name, |d| {
                        let before = d.status.clone();
                        d.status.state = Some(info.state);
                        d.status.progress = info.progress;
                        d.status.size = info.size;
                        d.status.virtual_size = info.virtual_size;
                        d.status.current_checksum.clone_from(&info.current_checksum);
                        d.status.message.clone_from(&info.message);
                        d.status.poll_failures = 0;
                        d.status != before
                    })
                    .await,
            )?;
        }
        Err(e) => {
            let failures = ds.status.poll_failures + 1;
            tracing::debug!(image = name, failures, error = %e, "data source poll failed");
            if failures >= MAX_POLL_FAILURES {
                tracing::warn!(image = name, "data source does not answer: restarting it");
                stop(local, name, ds.status.process.as_ref()).await;
            }
            absent_ok(
                ctx.db
                    .modify::<BackingImageDataSource>(name, |d| {
                        d.status.poll_failures = if failures >= MAX_POLL_FAILURES {
                            0
                        } else {
                            failures
                        };
                        if failures >= MAX_POLL_FAILURES {
                            d.status.process = None;
                            d.status.message =
                                format!("data source did not answer {MAX_POLL_FAILURES} polls: {e}");
                        }
                        true
                    })
                    .await,
            )?;
        }
    }
    Ok(Some(POLL))
}

async fn spawn(ctx: &Ctx, local: &Supervisor, name: &str, ds: &BackingImageDataSource) -> anyhow::Result<()> {
    corral_disk::identity::verify_disk(std::path::Path::new(&ds.spec.disk_path), &ds.spec.disk_uuid)?;
    let mut args = vec![
        "serve".to_owned(),
        "--listen".to_owned(),
        format!("{}:0", ctx.cfg.host),
        "--disk-path".to_owned(),
        ds.spec.disk_path.clone(),
        "--disk-uuid".to_owned(),
        ds.spec.disk_uuid.clone(),
        "--name".to_owned(),
        name.to_owned(),
        "--uuid".to_owned(),
        ds.spec.uuid.clone(),
        "--source-type".to_owned(),
        ds.spec.source_type.as_str().to_owned(),
        "--receiver-ip".to_owned(),
        ctx.cfg.host.clone(),
        "--data-engine".to_owned(),
        ds.spec.data_engine.as_str().to_owned(),
    ];
    for (k, v) in &ds.spec.parameters {
        args.push("--param".to_owned());
        args.push(format!("{k}={v}"));
    }
    if !ds.spec.expected_checksum.is_empty() {
        args.push("--expected-checksum".to_owned());
        args.push(ds.spec.expected_checksum.clone());
    }
    if ds.spec.source_type == SourceType::Restore && !ds.spec.backup_target.is_empty() {
        let f = credentials_path(local, name);
        if restore_source::write_credentials(ctx, &ds.spec.backup_target, &f).await? {
            args.push("--backup-credentials-file".to_owned());
            args.push(f.display().to_string());
        }
    }
    let rec = local.start(name, args, ds.status.attempts).await?;
    ctx.metrics.daemon_started();
    tracing::info!(image = name, pid = rec.pid, "started data source");
    absent_ok(
        ctx.db
            .modify::<BackingImageDataSource>(name, |d| {
                d.status.process = Some(rec.clone());
                // Known once it reports ready.
                d.status.address.clear();
                d.status.state = Some(state::STARTING);
                d.status.message.clear();
                d.status.poll_failures = 0;
                d.status.attempts += 1;
                true
            })
            .await,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_job_is_retried_ever_more_slowly_up_to_ten_minutes() {
        let secs: Vec<u64> = (0..9).map(|a| job_retry_backoff(a).as_secs()).collect();
        assert_eq!(secs, [30, 30, 60, 120, 240, 480, 600, 600, 600]);
    }
}
