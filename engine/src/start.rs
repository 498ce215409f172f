//! Engine start: connect every replica, refuse the ones that do not fit (unreachable, wrong size or sector size,
//! other revision-counter setting, an unfinished rebuild), then either keep only the replicas with the highest
//! revision counter, or — counter disabled and salvage requested — pick the one replica most likely to hold
//! every acknowledged write: among those whose head was modified within 5 s of the newest, the one with the most
//! allocated head bytes (ties: newer mtime).

use std::sync::Arc;

use corral_disk::BLOCK_SIZE;
use corral_proto::{ReplicaAddress, v1};
use data_protocol::ClientConfig;
use tracing::{info, warn};

use crate::error::EngineError;
use crate::replica_client::{self, Connection, Mode, ReplicaEntry};
use crate::volume::Volume;

/// Window within which head mtimes count as "equally recent" for salvage (Longhorn's `lastModifyCheckPeriod`).
pub const SALVAGE_MTIME_WINDOW_NS: i64 = 5_000_000_000;

/// How to start a volume.
#[derive(Debug, Clone)]
pub struct StartOptions {
    /// Volume name.
    pub name: String,
    /// Volume size in bytes; replicas of another size are refused.
    pub size: u64,
    /// Revision counter disabled for the volume (replicas must agree).
    pub disable_revision_counter: bool,
    /// With the counter disabled: salvage the best replica instead of trusting all.
    pub salvage_requested: bool,
    /// Data-protocol client settings (timeouts).
    pub client: ClientConfig,
}

struct Candidate {
    address: ReplicaAddress,
    conn: Connection,
    status: v1::Replica,
    sector_size: u32,
}

/// Connects and checks the replicas and returns the volume. Fails when no replica is usable.
pub async fn start(addresses: &[ReplicaAddress], opts: &StartOptions) -> Result<Volume, EngineError> {
    if opts.size == 0 || !opts.size.is_multiple_of(BLOCK_SIZE) {
        return Err(EngineError::InvalidArgument(format!(
            "volume size {} must be a positive multiple of {BLOCK_SIZE}",
            opts.size
        )));
    }
    let mut entries: Vec<Arc<ReplicaEntry>> = Vec::new();
    let mut candidates = Vec::new();
    let connects = addresses.iter().map(|address| async move {
        let r = replica_client::connect(
            address,
            &opts.client,
            Some((opts.size, opts.disable_revision_counter)),
        )
        .await;
        Ok::<_, EngineError>((address.clone(), r))
    });
    for r in futures::future::join_all(connects).await {
        let (address, r) = r?;
        match r {
            Ok((conn, status)) => {
                let sector_size = conn.data.info().sector_size;
                candidates.push(Candidate {
                    address,
                    conn,
                    status,
                    sector_size,
                });
            }
            Err(e) => {
                warn!(volume = %opts.name, replica = %address, error = %e, "replica unusable at start");
                entries.push(Arc::new(ReplicaEntry::failed(address, None, e.to_string())));
            }
        }
    }
    let mut good = Vec::new();
    let sector = candidates.first().map(|c| c.sector_size);
    let others_ok = candidates.iter().filter(|c| !c.status.rebuilding).count() > 0;
    for c in candidates {
        let reason = refusal(&c.status, c.sector_size, opts, sector, others_ok);
        match reason {
            Some(r) => {
                warn!(volume = %opts.name, replica = %c.address, reason = %r, "replica refused at start");
                entries.push(Arc::new(ReplicaEntry::failed(c.address, Some(c.conn), r)));
            }
            None => good.push(c),
        }
    }

    if opts.disable_revision_counter {
        if opts.salvage_requested && !good.is_empty() {
            let statuses: Vec<&v1::Replica> = good.iter().map(|c| &c.status).collect();
            let best = salvage_pick(&statuses);
            let chosen = good.swap_remove(best);
            info!(
                volume = %opts.name, replica = %chosen.address, head_bytes = chosen.status.head_file_size,
                "salvage: keeping the replica with the most recent and largest head"
            );
            for c in good.drain(..) {
                let r = format!(
                    "salvage chose {} (head {} bytes, mtime {}) over this one (head {} bytes, mtime {})",
                    chosen.address,
                    chosen.status.head_file_size,
                    chosen.status.last_modify_time,
                    c.status.head_file_size,
                    c.status.last_modify_time
                );
                entries.push(Arc::new(ReplicaEntry::failed(c.address, Some(c.conn), r)));
            }
            good.push(chosen);
        }
    } else {
        let max = good.iter().map(|c| c.status.revision_counter).max().unwrap_or(0);
        let (keep, lagging): (Vec<_>, Vec<_>) =
            good.into_iter().partition(|c| c.status.revision_counter == max);
        for c in lagging {
            let r = format!(
                "revision counter {} is behind the highest, {max}: it missed writes",
                c.status.revision_counter
            );
            warn!(volume = %opts.name, replica = %c.address, reason = %r, "replica refused at start");
            entries.push(Arc::new(ReplicaEntry::failed(c.address, Some(c.conn), r)));
        }
        good = keep;
    }
    if good.is_empty() {
        let detail = entries
            .iter()
            .map(|e| format!("{}: {}", e.address, e.error()))
            .collect::<Vec<_>>()
            .join("; ");
        return Err(EngineError::NoHealthyReplica {
            volume: opts.name.clone(),
            detail,
        });
    }
    let sector_size = good[0].sector_size;
    let mut all: Vec<Arc<ReplicaEntry>> = good
        .into_iter()
        .map(|c| Arc::new(ReplicaEntry::new(c.address, c.conn, Mode::Rw)))
        .collect();
    // ERR entries stay listed (with their reason) until removed.
    all.extend(entries);
    for e in &all {
        if e.mode() == Mode::Err
            && let Some(c) = &e.conn
        {
            c.data.close().await;
        }
    }
    info!(
        volume = %opts.name, size = opts.size,
        rw = all.iter().filter(|e| e.mode() == Mode::Rw).count(), total = all.len(), "volume started"
    );
    Ok(Volume::new(
        opts.name.clone(),
        opts.size,
        sector_size,
        all,
        opts.disable_revision_counter,
    ))
}

/// Why a connected replica cannot serve the volume (`None`: it can): another size or sector size (`sector`: the
/// first replica's), the other revision-counter setting, an unfinished rebuild while others are whole, or an
/// error it reports.
fn refusal(
    status: &v1::Replica,
    sector_size: u32,
    opts: &StartOptions,
    sector: Option<u32>,
    others_ok: bool,
) -> Option<String> {
    if status.size != opts.size {
        Some(format!(
            "size {} differs from the volume size {}",
            status.size, opts.size
        ))
    } else if Some(sector_size) != sector {
        Some(format!(
            "sector size {} differs from {}",
            sector_size,
            sector.unwrap_or_default()
        ))
    } else if status.revision_counter_disabled != opts.disable_revision_counter {
        Some(format!(
            "revision counter {} on the replica but {} for the volume",
            if status.revision_counter_disabled {
                "disabled"
            } else {
                "enabled"
            },
            if opts.disable_revision_counter {
                "disabled"
            } else {
                "enabled"
            },
        ))
    } else if status.rebuilding && others_ok {
        Some("an earlier rebuild into this replica did not finish".into())
    } else if !status.error.is_empty() {
        Some(format!("replica reports error: {}", status.error))
    } else {
        None
    }
}

/// The salvage rule: among the replicas whose head was modified within [`SALVAGE_MTIME_WINDOW_NS`] of the newest,
/// the one with the most allocated head bytes (ties: the newer mtime; `statuses` must not be empty: 0 then).
fn salvage_pick(statuses: &[&v1::Replica]) -> usize {
    let newest = statuses.iter().map(|s| s.last_modify_time).max().unwrap_or(0);
    statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| newest - s.last_modify_time <= SALVAGE_MTIME_WINDOW_NS)
        .max_by_key(|(_, s)| (s.head_file_size, s.last_modify_time))
        .map_or(0, |(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(mtime_s: i64, head: u64) -> v1::Replica {
        v1::Replica {
            last_modify_time: mtime_s * 1_000_000_000,
            head_file_size: head,
            ..v1::Replica::default()
        }
    }

    #[test]
    fn salvage_keeps_the_largest_head_among_the_recent_and_never_a_stale_one() {
        // A stale replica (10 s older) with the largest head loses to the recent ones.
        let (stale, a, b) = (replica(90, 900), replica(100, 300), replica(98, 500));
        assert_eq!(salvage_pick(&[&stale, &a, &b]), 2);
        // Equal heads within the window: the newer mtime.
        let (c, d) = (replica(100, 500), replica(97, 500));
        assert_eq!(salvage_pick(&[&d, &c]), 1);
        // Just outside the window (5 s and 1 ns) is stale.
        let mut e = replica(95, 1000);
        e.last_modify_time -= 1;
        assert_eq!(salvage_pick(&[&e, &a]), 1);
        assert_eq!(salvage_pick(&[&a]), 0);
    }

    #[test]
    fn a_replica_that_does_not_fit_the_volume_is_refused_with_the_reason() {
        let opts = StartOptions {
            name: "v".into(),
            size: 1 << 20,
            disable_revision_counter: false,
            salvage_requested: false,
            client: ClientConfig::default(),
        };
        let ok = v1::Replica {
            size: 1 << 20,
            ..v1::Replica::default()
        };
        assert_eq!(refusal(&ok, 512, &opts, Some(512), true), None);
        let small = v1::Replica {
            size: 4096,
            ..ok.clone()
        };
        assert!(refusal(&small, 512, &opts, Some(512), true).is_some_and(|r| r.contains("size 4096")));
        assert!(refusal(&ok, 4096, &opts, Some(512), true).is_some_and(|r| r.contains("sector size 4096")));
        let rebuilding = v1::Replica {
            rebuilding: true,
            ..ok.clone()
        };
        assert!(refusal(&rebuilding, 512, &opts, Some(512), true).is_some());
        assert_eq!(refusal(&rebuilding, 512, &opts, Some(512), false), None);
    }
}
