//! Sync, the receiving side: a copy of an image from another manager that holds it ready. A sparse-sync receiver on
//! a port of the range writes `backing.tmp` (holes stay holes) while the peer sends; then the copy is verified
//! (`verify`) before it becomes `ready`. A matching file already on the disk is reused instead.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sparse_sync::receiver::{ReceiveError, ReceiveOutcome, Receiver, ReceiverConfig};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info};

use crate::error::BimError;
use crate::files;
use crate::image::{ImageSpec, ImageView};
use crate::manager::{Manager, Registered, blocking};
use crate::peer::{Peer, PeerCopy};
use crate::ports::PortLease;
use crate::state::FileState;
use crate::verify::{Reuse, percent, scale, try_reuse};

/// A sync's progress: receiving counts up to this percentage, verifying the copy the rest.
const SYNC_VERIFY_PROGRESS: u8 = 80;

impl Manager {
    /// Sync: receive the image from the manager at `from` (which must hold it ready), or reuse a matching file.
    pub async fn sync(self: &Arc<Self>, spec: ImageSpec, from: &str) -> Result<ImageView, BimError> {
        if from.is_empty() {
            return Err(BimError::InvalidArgument("from_address is empty".into()));
        }
        self.check_disk()?;
        if let Some(img) = self.existing(&spec)? {
            return Ok(img);
        }
        let paths = self.paths(&spec.name, &spec.uuid);
        let (p, s) = (paths.clone(), spec.clone());
        if let Reuse::Reused(cfg) = blocking(move || try_reuse(&p, &s, None)).await? {
            return self.register_ready(&spec, &cfg);
        }
        let mut peer = Peer::connect(from).await?;
        let st = peer.copy_of(&spec.name, &spec.uuid).await?;
        if st.state != FileState::Ready.as_str() {
            return Err(BimError::FailedPrecondition(format!(
                "{from} holds {} in state {}, not ready",
                spec.name, st.state
            )));
        }
        if spec.size != 0 && st.size != spec.size {
            return Err(BimError::InvalidArgument(format!(
                "the spec says {} bytes, the copy at {from} has {}",
                spec.size, st.size
            )));
        }
        if !spec.checksum.is_empty() && st.current_checksum != spec.checksum {
            return Err(BimError::InvalidArgument(format!(
                "the spec expects SHA-512 {}, the copy at {from} has {}",
                spec.checksum, st.current_checksum
            )));
        }
        let (lease, receiver) = self.bind_receiver(&paths.temp).await?;
        let Registered::New { generation, cancel } = self.register(&spec, FileState::Starting, from)? else {
            return self.get(&spec.name, &spec.uuid);
        };
        let p = paths.clone();
        let prepared = blocking(move || {
            p.remove_all()
                .and_then(|()| p.create_dir())
                .map_err(|e| BimError::io("prepare", &p.dir, e))
        })
        .await;
        if let Err(e) = prepared {
            self.fail(&spec.name, generation, e.to_string()).await;
            return Err(e);
        }
        self.metrics.syncs.inc();
        info!(image = %spec.name, uuid = %spec.uuid, from, port = lease.port(), "sync started");
        let job = SyncJob {
            spec: spec.clone(),
            generation,
            from: from.to_owned(),
            peer,
            source: st,
            lease,
            receiver,
            cancel,
        };
        let m = self.clone();
        self.tasks
            .spawn(async move { m.run_sync(job).await }.instrument(tracing::Span::current()));
        self.get(&spec.name, &spec.uuid)
    }

    /// Leases a port of the range and binds a receiver on it; ports other processes hold are skipped.
    async fn bind_receiver(&self, target: &Path) -> Result<(PortLease, Receiver), BimError> {
        let mut busy = BTreeSet::new();
        loop {
            let Some(lease) = self.ports.lease(&busy) else {
                return Err(BimError::ResourceExhausted(format!(
                    "no free port in the receiver range {}: {} held by syncs of this manager, {} by other processes",
                    self.ports.range(),
                    self.ports.in_use(),
                    busy.len()
                )));
            };
            let mut rc = ReceiverConfig::new(target);
            rc.idle_timeout = self.cfg.sync_idle_timeout;
            match Receiver::bind(SocketAddr::new(self.cfg.receiver_ip, lease.port()), rc).await {
                Ok(r) => return Ok((lease, r)),
                Err(ReceiveError::Bind { source, .. }) if source.kind() == std::io::ErrorKind::AddrInUse => {
                    busy.insert(lease.port());
                }
                Err(e) => return Err(BimError::Internal(format!("sync receiver: {e}"))),
            }
        }
    }

    async fn run_sync(self: Arc<Self>, job: SyncJob) {
        let SyncJob {
            spec,
            generation,
            from,
            mut peer,
            source,
            lease,
            receiver,
            cancel,
        } = job;
        let name = spec.name.clone();
        let to = format!("{}:{}", self.cfg.advertise_host, lease.port());
        let rcancel = cancel.child_token();
        let mut recv = tokio::spawn(receiver.run(rcancel.clone()));
        self.update(&name, generation, |i| i.state = FileState::InProgress);

        // Progress: allocated bytes of the partial file against the source's allocated bytes.
        let ticker_stop = CancellationToken::new();
        let ticker = {
            let (m, stop, partial) = (
                self.clone(),
                ticker_stop.clone(),
                self.paths(&spec.name, &spec.uuid).partial,
            );
            let (total, name) = (source.real_size.max(1), name.clone());
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(300)) => {}
                    }
                    let p = partial.clone();
                    if let Ok(Ok(Some(f))) = tokio::task::spawn_blocking(move || files::facts(&p)).await {
                        m.set_progress(
                            &name,
                            generation,
                            scale(percent(f.real_size, total), 0, SYNC_VERIFY_PROGRESS),
                        );
                    }
                }
            })
        };

        let send = peer.send(spec.name.clone(), spec.uuid.clone(), to);
        tokio::pin!(send);
        let received =
            |r: Result<Result<sparse_sync::ReceiveSummary, ReceiveError>, tokio::task::JoinError>| match r {
                Ok(Ok(s)) if s.outcome == ReceiveOutcome::Completed => Ok(s),
                Ok(Ok(s)) => Err(format!(
                    "the receiver ended without a complete transfer ({:?})",
                    s.outcome
                )),
                Ok(Err(e)) => Err(format!("receiver: {e}")),
                Err(e) => Err(format!("receiver task: {e}")),
            };
        let outcome: Result<sparse_sync::ReceiveSummary, String> = tokio::select! {
            r = &mut send => match r {
                Ok(_) => received((&mut recv).await),
                Err(e) => {
                    rcancel.cancel();
                    let _ = (&mut recv).await;
                    Err(format!("the sender {from} failed: {e}"))
                }
            },
            r = &mut recv => match received(r) {
                // The data is in; the sender's answer should follow at once. A peer that never answers must not
                // keep the image in-progress (and its port leased) for ever, nor outlive a Delete or shutdown.
                Ok(summary) => tokio::select! {
                    r = &mut send => match r {
                        Ok(_) => Ok(summary),
                        Err(e) => Err(format!("the sender {from} failed: {e}")),
                    },
                    () = tokio::time::sleep(self.cfg.sync_idle_timeout) => Err(format!(
                        "the sender {from} did not confirm the transfer within {:?}",
                        self.cfg.sync_idle_timeout
                    )),
                    () = cancel.cancelled() => Err("cancelled".to_owned()),
                },
                // Name the peer: a receiver that ends early usually means the sender went away.
                Err(e) => Err(format!("the transfer from the sender {from} broke off: {e}")),
            },
            () = cancel.cancelled() => {
                rcancel.cancel();
                let _ = (&mut recv).await;
                Err("cancelled".to_owned())
            }
        };
        ticker_stop.cancel();
        let _ = ticker.await;
        // The receiver's server is gone in every branch: its port can go back to the range.
        drop(lease);
        match outcome {
            Ok(summary) => {
                self.metrics.received_bytes.inc_by(summary.bytes_written);
                info!(image = %name, written = summary.bytes_written, holes = summary.hole_bytes_punched, "received; verifying");
                self.spawn_commit(
                    spec,
                    generation,
                    source.current_checksum,
                    cancel,
                    SYNC_VERIFY_PROGRESS,
                );
            }
            Err(e) => self.fail(&name, generation, e).await,
        }
    }
}

struct SyncJob {
    spec: ImageSpec,
    generation: u64,
    from: String,
    peer: Peer,
    source: PeerCopy,
    lease: PortLease,
    receiver: Receiver,
    cancel: CancellationToken,
}
