//! Receiving a sparse-sync stream into the work file, for the sources whose data is pushed by another daemon: a
//! replica's `VolumeExport` (`export-from-volume`) and a v2 disk daemon's `BackingImageExpose` (`clone` of a v2
//! image). A receiver is bound on `--receiver-ip`, the caller's request makes the sender send to it, progress is
//! the partial file's allocated bytes, and the no-data limit is the receiver's idle timeout (a stalled sender fails
//! the job instead of hanging it). Holes arrive as holes.

use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use sparse_sync::receiver::{Receiver, ReceiverConfig, partial_path};
use sparse_sync::{ReceiveOutcome, ReceiveSummary};

use crate::error::JobError;
use crate::job::{Counters, JobContext};

/// Receives into `work` what `ask` makes a sender push to the receiver's address; `size` is what the sender is
/// expected to send (progress). `ask` answers once the sender has sent everything (or why it could not); `err`
/// turns a reason into the job's error (its message names the source).
pub async fn receive<Fut>(
    ds: &JobContext,
    work: &Path,
    size: u64,
    ask: impl FnOnce(SocketAddr) -> Fut,
    err: impl Fn(String) -> JobError,
) -> Result<ReceiveSummary, JobError>
where
    Fut: Future<Output = Result<(), String>>,
{
    let ip = ds.config().receiver_ip;
    let mut rcfg = ReceiverConfig::new(work);
    rcfg.idle_timeout = ds.config().no_data_timeout;
    let receiver = Receiver::bind(SocketAddr::new(ip, 0), rcfg)
        .await
        .map_err(|e| err(e.to_string()))?;
    let to = receiver.local_addr();
    let rcancel = ds.cancel_token().child_token();
    let _stop = rcancel.clone().drop_guard();
    let mut recv = tokio::spawn(receiver.run(rcancel.clone()));
    let sent = ask(to);
    let partial = partial_path(work);
    let progress = async {
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            // The receiver writes only where the source has data: allocated bytes approximate progress.
            if let Ok(m) = std::fs::metadata(&partial) {
                ds.set_processed((m.blocks() * 512).min(size));
            }
        }
    };
    tokio::pin!(sent);
    tokio::pin!(progress);
    let mut asked = false;
    let summary: ReceiveSummary = loop {
        tokio::select! {
            r = &mut recv => {
                break r
                    .map_err(|e| err(format!("receiver task: {e}")))?
                    .map_err(|e| err(format!("receiver: {e}")))?;
            }
            r = &mut sent, if !asked => {
                if let Err(e) = r {
                    rcancel.cancel();
                    let _ = recv.await;
                    return Err(err(e));
                }
                asked = true;
            }
            () = &mut progress => {}
        }
    };
    Counters::add(&ds.counters.bytes_fetched, summary.bytes_received);
    match summary.outcome {
        ReceiveOutcome::Completed => Ok(summary),
        ReceiveOutcome::Cancelled => Err(JobError::Cancelled("the data source is shutting down")),
        ReceiveOutcome::IdleTimeout => Err(err(format!(
            "no data from the sender for {} s",
            ds.config().no_data_timeout.as_secs()
        ))),
        ReceiveOutcome::Unchanged => Err(err("the sender closed without sending the data".into())),
    }
}
