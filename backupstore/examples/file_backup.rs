//! Backs up a plain file to a target, or restores a backup into a plain file; prints one JSON line with the
//! record's counters and the elapsed time. Used by `bench/backup/run.sh`.
//!
//! ```text
//! file_backup backup  FILE TARGET VOLUME NAME [BLOCK_SIZE] [CONCURRENCY]
//! file_backup restore FILE TARGET VOLUME NAME [CONCURRENCY]
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use backupstore::file::{FileSink, FileSource};
use backupstore::{BackupStore, BackupUrl, CreateOptions, Progress, RestoreOptions};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 6 {
        return Err(
            "usage: file_backup backup|restore FILE TARGET VOLUME NAME [BLOCK_SIZE] [CONCURRENCY]".into(),
        );
    }
    let (file, target, volume, name) = (Path::new(&a[2]), &a[3], &a[4], &a[5]);
    let store = BackupStore::open(&BackupUrl::parse(target)?, &BTreeMap::new())?;
    let start = Instant::now();
    match a[1].as_str() {
        "backup" => {
            let opts = CreateOptions {
                volume: volume.clone(),
                name: name.clone(),
                block_size: a.get(6).map(|s| s.parse()).transpose()?,
                concurrency: a.get(7).map_or(Ok(8), |s| s.parse())?,
                ..CreateOptions::default()
            };
            let src = Arc::new(FileSource::open(file, name)?);
            let c = store.create_backup(src, &opts, &Progress::default()).await?;
            println!(
                "{}",
                serde_json::json!({"op": "backup", "seconds": start.elapsed().as_secs_f64(), "size": c.size,
                    "incremental": c.is_incremental, "stats": c.stats})
            );
        }
        "restore" => {
            let cfg = store.backup_config(volume, name).await?;
            let sink = Arc::new(FileSink::create(file, cfg.size)?);
            let opts = RestoreOptions {
                concurrency: a.get(6).map_or(Ok(8), |s| s.parse())?,
                ..RestoreOptions::default()
            };
            let o = store
                .restore(volume, name, sink.clone(), &opts, &Progress::default())
                .await?;
            sink.sync()?;
            println!(
                "{}",
                serde_json::json!({"op": "restore", "seconds": start.elapsed().as_secs_f64(), "size": cfg.size,
                    "bytesWritten": o.bytes_written})
            );
        }
        other => return Err(format!("unknown command {other}").into()),
    }
    Ok(())
}
