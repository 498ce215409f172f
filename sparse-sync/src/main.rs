//! `corral-sync`: serve or send one sparse file over the sync protocol, and local sparse copy/fold/prune.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use corral_daemon::cli::RunKind;
use corral_daemon::output::emit;
use corral_disk::sparse::{FileContent, LayoutMode, SparseRead};
use serde::Serialize;
use sparse_sync::{
    CancellationToken, LocalSummary, Progress, ReceiveOutcome, Receiver, ReceiverConfig, SendOptions, record,
};

#[derive(Parser)]
#[command(
    name = "corral-sync",
    version,
    about = "Move sparse files: HTTP sync between hosts, local copy/fold/prune"
)]
struct Cli {
    #[command(flatten)]
    output: corral_daemon::output::OutputArgs,
    #[command(flatten)]
    common: corral_daemon::cli::CommonArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Receive one file: serve the sync protocol until the sender closes or the idle timeout.
    Serve {
        /// Address to listen on (port 0 picks a free port, printed on stdout).
        #[arg(long, env = "CORRAL_SYNC_LISTEN")]
        listen: SocketAddr,
        /// File to receive into (written as FILE.sync-partial, renamed into place on success).
        #[arg(long)]
        file: PathBuf,
        /// Write 4 KiB-aligned data with O_DIRECT.
        #[arg(long)]
        direct_io: bool,
        /// Seconds without a request before giving up (and removing the partial file).
        #[arg(long, default_value_t = 300)]
        idle_timeout: u64,
        /// Keep the partial file of a failed transfer so a later receiver can resume it.
        #[arg(long)]
        keep_partial: bool,
        #[command(flatten)]
        tls: corral_tls::TlsDirArg,
    },
    /// Send one file to a receiver started with `serve`.
    Send {
        /// File to send.
        #[arg(long)]
        file: PathBuf,
        /// Receiver address, HOST:PORT (with --tls-dir, the name or IP its certificate holds).
        #[arg(long)]
        to: String,
        /// Skip the transfer when both sides hold a valid recorded checksum (FILE.checksum) and they match.
        #[arg(long)]
        fast: bool,
        /// Requests in flight.
        #[arg(long, default_value_t = 4)]
        workers: usize,
        /// Ask the receiver to write with O_DIRECT.
        #[arg(long)]
        direct_io: bool,
        /// Count unwritten (preallocated) extents as data (FIEMAP).
        #[arg(long)]
        fiemap: bool,
        /// Upper bound of data sent per second, bytes (suffixes K, M, G).
        #[arg(long, value_parser = corral_daemon::parse_size)]
        max_rate: Option<u64>,
        /// Retries of a request on transient errors.
        #[arg(long, default_value_t = 8)]
        retries: usize,
        #[command(flatten)]
        tls: corral_tls::TlsDirArg,
    },
    /// Print the data ranges of a file.
    Layout {
        path: PathBuf,
        /// Count unwritten (preallocated) extents as data (FIEMAP).
        #[arg(long)]
        fiemap: bool,
    },
    /// Sparse copy: data copied, holes kept as holes.
    Copy {
        src: PathBuf,
        dst: PathBuf,
        #[arg(long)]
        fiemap: bool,
    },
    /// Fold a child's data into its parent (parent grown if the child is larger).
    Fold { child: PathBuf, parent: PathBuf },
    /// Punch holes in the parent wherever the child has data.
    Prune { parent: PathBuf, child: PathBuf },
    /// Checksum of a file's content and layout; with --record, write FILE.checksum for --fast sends.
    Checksum {
        path: PathBuf,
        #[arg(long)]
        record: bool,
    },
}

fn mode(fiemap: bool) -> LayoutMode {
    if fiemap {
        LayoutMode::Fiemap
    } else {
        LayoutMode::SeekData
    }
}

fn print_json(v: &impl Serialize) -> anyhow::Result<()> {
    Ok(corral_daemon::output::print_json_line(v)?)
}

/// Shows a progress bar on a terminal until `done` is cancelled.
fn progress_bar(
    progress: Arc<Progress>,
    json: bool,
    done: CancellationToken,
) -> Option<std::thread::JoinHandle<()>> {
    if json || !std::io::stderr().is_terminal() {
        return None;
    }
    Some(std::thread::spawn(move || {
        let bar = indicatif::ProgressBar::new(progress.total());
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        while !done.is_cancelled() {
            bar.set_length(progress.total());
            bar.set_position(progress.done());
            std::thread::sleep(Duration::from_millis(100));
        }
        bar.set_position(progress.done());
        bar.finish();
    }))
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // `serve` is a one-transfer receiver started by scripts: it logs at warn like the other commands.
    let process = cli.common.init(RunKind::Command)?;
    let json = cli.output.json;
    match cli.cmd {
        Cmd::Serve {
            listen,
            file,
            direct_io,
            idle_timeout,
            keep_partial,
            tls,
        } => {
            let config = ReceiverConfig {
                target: file,
                idle_timeout: Duration::from_secs(idle_timeout),
                direct_io,
                keep_partial,
                sink: None,
                tls: tls.load()?.map(|t| t.server),
            };
            tracing::info!(?config, %listen, "corral-sync serve starting");
            runtime()?.block_on(serve(listen, config, json, process.ready_file.as_deref()))
        }
        Cmd::Send {
            file,
            to,
            fast,
            workers,
            direct_io,
            fiemap,
            max_rate,
            retries,
            tls,
        } => {
            let content = FileContent::open(&file, mode(fiemap))
                .with_context(|| format!("opening {}", file.display()))?;
            let recorded = record::read_valid(&file)?;
            let opts = SendOptions {
                workers,
                direct_io,
                fast,
                recorded,
                retries,
                max_rate,
                tls: tls.load()?.map(|t| t.client),
                ..SendOptions::default()
            };
            let progress = Arc::new(Progress::new());
            let done = CancellationToken::new();
            let bar = progress_bar(progress.clone(), json, done.clone());
            let cancel = CancellationToken::new();
            let result = runtime()?.block_on(sparse_sync::send(
                Arc::new(content),
                &to,
                &opts,
                &progress,
                &cancel,
            ));
            done.cancel();
            if let Some(b) = bar {
                let _ = b.join();
            }
            let summary = result.with_context(|| format!("sending {} to {to}", file.display()))?;
            if json {
                print_json(&summary)?;
            } else if summary.file_skipped {
                eprintln!("skipped: the receiver already holds this file (recorded checksums match)");
            } else {
                eprintln!(
                    "sent {} of {} data bytes ({} matched on the receiver), {} hole bytes, in {} ms",
                    summary.bytes_sent,
                    summary.data_bytes,
                    summary.bytes_skipped,
                    summary.hole_bytes,
                    summary.duration_ms
                );
            }
            Ok(())
        }
        Cmd::Layout { path, fiemap } => layout(&path, mode(fiemap), json),
        Cmd::Copy { src, dst, fiemap } => {
            let content = FileContent::open(&src, mode(fiemap))
                .with_context(|| format!("opening {}", src.display()))?;
            let out = std::fs::File::options()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&dst)
                .with_context(|| format!("opening {}", dst.display()))?;
            local(json, |p, c| sparse_sync::copy(&content, &out, p, c))
                .with_context(|| format!("copying {} to {}", src.display(), dst.display()))
        }
        Cmd::Fold { child, parent } => {
            let content = FileContent::open(&child, LayoutMode::SeekData)
                .with_context(|| format!("opening {}", child.display()))?;
            let out = open_rw(&parent)?;
            local(json, |p, c| sparse_sync::fold(&content, &out, p, c))
                .with_context(|| format!("folding {} into {}", child.display(), parent.display()))
        }
        Cmd::Prune { parent, child } => {
            let content = FileContent::open(&child, LayoutMode::SeekData)
                .with_context(|| format!("opening {}", child.display()))?;
            let out = open_rw(&parent)?;
            local(json, |p, c| sparse_sync::prune(&out, &content, p, c))
                .with_context(|| format!("pruning {} behind {}", parent.display(), child.display()))
        }
        Cmd::Checksum { path, record: write } => {
            let content = FileContent::open(&path, LayoutMode::SeekData)
                .with_context(|| format!("opening {}", path.display()))?;
            let sum = record::content_checksum(&content, &CancellationToken::new())
                .with_context(|| format!("checksumming {}", path.display()))?;
            if write {
                record::write_record(&path, &sum)?;
            }
            if json {
                print_json(&sum)
            } else {
                emit(&format!("{} {}", sum.method, sum.checksum));
                Ok(())
            }
        }
    }
}

fn open_rw(path: &Path) -> anyhow::Result<std::fs::File> {
    std::fs::File::options()
        .read(true)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

async fn serve(
    listen: SocketAddr,
    config: ReceiverConfig,
    json: bool,
    ready_file: Option<&Path>,
) -> anyhow::Result<()> {
    let receiver = Receiver::bind(listen, config).await?;
    let addr = receiver.local_addr();
    corral_daemon::ready::ReadyReport::new()
        .tcp("http", addr)
        .announce(ready_file)?;
    if json {
        print_json(&serde_json::json!({ "event": "listening", "address": addr.to_string() }))?;
    } else {
        emit(&format!("listening on {addr}"));
    }
    let cancel = CancellationToken::new();
    let on_signal = cancel.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            Some(()) = async { match term.as_mut() { Some(t) => t.recv().await, None => std::future::pending().await } } => {}
        }
        on_signal.cancel();
    });
    let summary = receiver.run(cancel).await?;
    if json {
        print_json(&serde_json::json!({ "event": "finished", "summary": summary }))?;
    } else {
        eprintln!("{summary:?}");
    }
    match summary.outcome {
        ReceiveOutcome::Completed | ReceiveOutcome::Unchanged => Ok(()),
        other => bail!("receiver stopped without a completed transfer: {other:?}"),
    }
}

fn layout(path: &Path, mode: LayoutMode, json: bool) -> anyhow::Result<()> {
    let content = FileContent::open(path, mode).with_context(|| format!("opening {}", path.display()))?;
    let mut ranges = Vec::new();
    for r in content.data_ranges(0..content.size()) {
        ranges.push(r.with_context(|| format!("listing data ranges of {}", path.display()))?);
    }
    let data: u64 = ranges.iter().map(|r| r.end - r.start).sum();
    if json {
        #[derive(Serialize)]
        struct Layout {
            size: u64,
            data_bytes: u64,
            data: Vec<[u64; 2]>,
        }
        print_json(&Layout {
            size: content.size(),
            data_bytes: data,
            data: ranges.iter().map(|r| [r.start, r.end]).collect(),
        })
    } else {
        let mut out: String = ranges
            .iter()
            .map(|r| format!("data {}..{} ({} bytes)\n", r.start, r.end, r.end - r.start))
            .collect();
        out.push_str(&format!(
            "size {} data {} in {} ranges",
            content.size(),
            data,
            ranges.len()
        ));
        emit(&out);
        Ok(())
    }
}

fn local(
    json: bool,
    op: impl FnOnce(&Progress, &CancellationToken) -> Result<LocalSummary, sparse_sync::LocalError>,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let progress = Arc::new(Progress::new());
    let done = CancellationToken::new();
    let bar = progress_bar(progress.clone(), json, done.clone());
    let result = op(&progress, &CancellationToken::new());
    done.cancel();
    if let Some(b) = bar {
        let _ = b.join();
    }
    let summary = result?;
    let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    if json {
        print_json(&serde_json::json!({ "summary": summary, "duration_ms": ms }))
    } else {
        eprintln!(
            "{} data bytes in {} ranges, {} hole bytes, {ms} ms",
            summary.data_bytes, summary.data_ranges, summary.hole_bytes
        );
        Ok(())
    }
}
