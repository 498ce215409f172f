//! `corral-lvstore`: the offline tool of a v2 disk's logical-volume store. Parses flags and wires; the work is in
//! the `lvstore` library.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use corral_daemon::cli::RunKind;
use corral_daemon::human_bytes;
use corral_daemon::output::{self, emit, field_table, table};
use lvstore::{FormatOptions, LvStore, OpenMode};

#[derive(Parser, Debug)]
#[command(
    name = "corral-lvstore",
    version,
    about = "Inspect, check and edit a v2 disk's logical-volume store offline (the daemon using it must be stopped)"
)]
struct Cli {
    #[command(flatten)]
    output: output::OutputArgs,
    #[command(flatten)]
    log: corral_daemon::cli::LogArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Create an lvstore over the whole device or preallocated file.
    Format {
        /// Block device or preallocated file.
        device: PathBuf,
        /// Cluster size: a power of two from 32K to 64M.
        #[arg(long, default_value = "1M", value_parser = corral_daemon::parse_size)]
        cluster_size: u64,
        /// Journal size (a multiple of 4K).
        #[arg(long, default_value = "4M", value_parser = corral_daemon::parse_size)]
        journal: u64,
        /// Size of each of the two metadata image areas (default: 4M plus one map entry per cluster).
        #[arg(long, value_parser = corral_daemon::parse_size)]
        metadata_area: Option<u64>,
        /// Replace an existing lvstore (its lvols are lost).
        #[arg(long)]
        force: bool,
    },
    /// The store: geometry, generation, IO mode and space.
    Info { device: PathBuf },
    /// Lvols and snapshots: kind, parent, clones, size, allocated bytes, xattrs.
    Ls { device: PathBuf },
    /// One lvol or snapshot in full, with its xattrs.
    Show { device: PathBuf, name: String },
    /// Check the metadata offline (read-only; exit status 1 when damaged).
    Check { device: PathBuf },
    /// Create a thin lvol.
    Create {
        device: PathBuf,
        name: String,
        #[arg(long, value_parser = corral_daemon::parse_size)]
        size: u64,
    },
    /// Snapshot an lvol (O(1)): its data becomes the read-only SNAPSHOT.
    Snapshot {
        device: PathBuf,
        lvol: String,
        snapshot: String,
    },
    /// A new writable lvol reading through to a snapshot.
    Clone {
        device: PathBuf,
        snapshot: String,
        name: String,
    },
    /// Delete an lvol or snapshot (a snapshot with one clone is merged into it).
    Delete { device: PathBuf, name: String },
    /// Resize an lvol.
    Resize {
        device: PathBuf,
        name: String,
        #[arg(value_parser = corral_daemon::parse_size)]
        size: u64,
    },
    /// Rename an lvol or snapshot.
    Rename {
        device: PathBuf,
        name: String,
        new_name: String,
    },
    /// Copy every block the lvol reads from its snapshot chain into it and detach it from the chain.
    Decouple { device: PathBuf, name: String },
    /// Set an xattr (the value as UTF-8 text).
    SetXattr {
        device: PathBuf,
        name: String,
        key: String,
        value: String,
    },
    /// Test workload for crash tests: random writes, flushes, snapshots, clones, creates and deletes, each step
    /// logged to LEDGER, until killed.
    #[command(hide = true)]
    Workload {
        device: PathBuf,
        #[arg(long)]
        ledger: PathBuf,
        #[arg(long)]
        run: u64,
        #[arg(long)]
        steps: Option<u64>,
        /// Data IO: direct, buffered (the page cache: flushes then make a record and its data durable with one
        /// `fdatasync`) or auto.
        #[arg(long, default_value = "direct")]
        data_io: lvstore::DataIo,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    cli.log.init(RunKind::Command)?;
    let json = cli.output.json;
    let open = |p: &PathBuf, mode| {
        LvStore::open(p, mode).with_context(|| format!("open the lvstore on {}", p.display()))
    };
    match cli.cmd {
        Cmd::Format {
            device,
            cluster_size,
            journal,
            metadata_area,
            force,
        } => {
            let opts = FormatOptions {
                cluster_size,
                meta_area: metadata_area,
                journal_len: journal,
                force,
            };
            let s =
                LvStore::format(&device, &opts).with_context(|| format!("format {}", device.display()))?;
            print_info(&s, json)?;
        }
        Cmd::Info { device } => print_info(&open(&device, OpenMode::ReadOnly)?, json)?,
        Cmd::Ls { device } => print_ls(&open(&device, OpenMode::ReadOnly)?, json)?,
        Cmd::Show { device, name } => print_show(&open(&device, OpenMode::ReadOnly)?, &name, json)?,
        Cmd::Check { device } => check(&device, json)?,
        Cmd::Create { device, name, size } => {
            open(&device, OpenMode::ReadWrite)?.create_lvol(&name, size)?;
            emit(&format!("created {name}"));
        }
        Cmd::Snapshot {
            device,
            lvol,
            snapshot,
        } => {
            open(&device, OpenMode::ReadWrite)?.snapshot(&lvol, &snapshot)?;
            emit(&format!("snapshot {snapshot} of {lvol}"));
        }
        Cmd::Clone {
            device,
            snapshot,
            name,
        } => {
            open(&device, OpenMode::ReadWrite)?.clone_snapshot(&snapshot, &name)?;
            emit(&format!("clone {name} of {snapshot}"));
        }
        Cmd::Delete { device, name } => {
            open(&device, OpenMode::ReadWrite)?.delete(&name)?;
            emit(&format!("deleted {name}"));
        }
        Cmd::Resize { device, name, size } => {
            open(&device, OpenMode::ReadWrite)?.resize(&name, size)?;
            emit(&format!("resized {name} to {}", human_bytes(size)));
        }
        Cmd::Rename {
            device,
            name,
            new_name,
        } => {
            open(&device, OpenMode::ReadWrite)?.rename(&name, &new_name)?;
            emit(&format!("renamed {name} to {new_name}"));
        }
        Cmd::Decouple { device, name } => {
            open(&device, OpenMode::ReadWrite)?.decouple(&name)?;
            emit(&format!("decoupled {name}"));
        }
        Cmd::SetXattr {
            device,
            name,
            key,
            value,
        } => {
            open(&device, OpenMode::ReadWrite)?.set_xattr(&name, &key, value.as_bytes())?;
        }
        Cmd::Workload {
            device,
            ledger,
            run,
            steps,
            data_io,
        } => {
            let s = LvStore::open_with(&device, OpenMode::ReadWrite, data_io)
                .with_context(|| format!("open the lvstore on {}", device.display()))?;
            lvstore::workload::run(&s, &ledger, run, steps).map_err(|e| anyhow::anyhow!("{e}"))?;
            s.flush()?;
        }
    }
    Ok(())
}

/// `ls`: a table of the lvols and snapshots.
fn print_ls(s: &LvStore, json: bool) -> anyhow::Result<()> {
    let list = s.list();
    output::print(json, &list, || {
        let rows = list
            .iter()
            .map(|l| {
                vec![
                    l.name.clone(),
                    output::serialized_name(&l.kind),
                    l.parent.clone().unwrap_or_default(),
                    l.children.join(","),
                    human_bytes(l.size),
                    human_bytes(l.allocated_bytes),
                    l.xattrs.len().to_string(),
                ]
            })
            .collect();
        table(
            &["NAME", "KIND", "PARENT", "CLONES", "SIZE", "ALLOCATED", "XATTRS"],
            rows,
        )
        .to_string()
    })?;
    Ok(())
}

/// `show`: one lvol or snapshot in full.
fn print_show(s: &LvStore, name: &str, json: bool) -> anyhow::Result<()> {
    let l = s.info(name)?;
    output::print(json, &l, || {
        let mut rows: Vec<(&str, String)> = vec![
            ("name", l.name.clone()),
            ("uuid", l.uuid.clone()),
            ("kind", output::serialized_name(&l.kind)),
            ("parent", l.parent.clone().unwrap_or_else(|| "-".into())),
            ("clones", l.children.join(", ")),
            ("size", format!("{} ({})", human_bytes(l.size), l.size)),
            (
                "allocated",
                format!("{} ({})", human_bytes(l.allocated_bytes), l.allocated_bytes),
            ),
            ("clusters", l.clusters.to_string()),
        ];
        let x: Vec<String> = l.xattrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        rows.push(("xattrs", x.join("\n")));
        field_table(rows).to_string()
    })?;
    Ok(())
}

/// `check`: exit status 1 when the store cannot even be opened (damaged beyond the check's reach).
fn check(device: &std::path::Path, json: bool) -> anyhow::Result<()> {
    let s = match LvStore::open(device, OpenMode::ReadOnly) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("corral-lvstore: check {}: {e}", device.display());
            std::process::exit(1);
        }
    };
    let r = s.check().with_context(|| format!("check {}", device.display()))?;
    output::print(json, &r, || {
        format!(
            "{}: ok: generation {}, {} journal records, {} lvols and snapshots, {} clusters owned, {} leaked",
            device.display(),
            r.generation,
            r.journal_records_replayed,
            r.blobs,
            r.owned_clusters,
            r.leaked_clusters
        )
    })?;
    Ok(())
}

fn print_info(s: &LvStore, json: bool) -> anyhow::Result<()> {
    #[derive(serde::Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Info {
        path: PathBuf,
        direct_io: bool,
        lvols: usize,
        snapshots: usize,
        space: lvstore::SpaceReport,
        check: lvstore::CheckReport,
    }
    let list = s.list();
    let snapshots = list
        .iter()
        .filter(|l| l.kind == lvstore::BlobKind::Snapshot)
        .count();
    let info = Info {
        path: s.path().to_owned(),
        direct_io: s.direct_io(),
        lvols: list.len() - snapshots,
        snapshots,
        space: s.space(),
        check: s.check()?,
    };
    output::print(json, &info, || {
        let sp = &info.space;
        let b = |v: u64| format!("{} ({v})", human_bytes(v));
        field_table([
            ("path", info.path.display().to_string()),
            (
                "io",
                if info.direct_io {
                    "O_DIRECT".into()
                } else {
                    "buffered (O_DIRECT refused)".to_owned()
                },
            ),
            ("generation", info.check.generation.to_string()),
            ("device", b(sp.device_bytes)),
            ("cluster size", b(sp.cluster_size)),
            (
                "clusters",
                format!(
                    "{} used, {} free, {} total",
                    sp.used_clusters, sp.free_clusters, sp.total_clusters
                ),
            ),
            ("data free", b(sp.free_clusters * sp.cluster_size)),
            ("provisioned", b(sp.provisioned_bytes)),
            ("blobs", format!("{} lvols, {} snapshots", sp.lvols, sp.snapshots)),
            (
                "metadata",
                format!(
                    "{} before the first cluster; image {} of {}",
                    human_bytes(sp.metadata_bytes),
                    human_bytes(sp.metadata_image_bytes),
                    human_bytes(sp.metadata_area_bytes)
                ),
            ),
            (
                "journal",
                format!(
                    "{} of {} used",
                    human_bytes(sp.journal_used_bytes),
                    human_bytes(sp.journal_bytes)
                ),
            ),
            ("lvols", info.lvols.to_string()),
            ("snapshots", info.snapshots.to_string()),
        ])
        .to_string()
    })?;
    Ok(())
}
