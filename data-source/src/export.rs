//! `export-from-volume`: runs a sparse-sync receiver for the work file and asks a replica's sync agent
//! (`sender-address`) to stream a snapshot, flattened over its chain and including its backing image, to it
//! (`VolumeExport`). Holes arrive as holes. A `qcow2` file type is converted after the receive (see `finish`).

use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use corral_proto::grpc::GrpcTimeouts;
use corral_proto::v1;
use corral_proto::v1::sync_agent_service_client::SyncAgentServiceClient;
use sparse_sync::receiver::{Receiver, ReceiverConfig, partial_path};
use sparse_sync::{ReceiveOutcome, ReceiveSummary};

use crate::error::JobError;
use crate::job::{Counters, JobContext};
use crate::spec::ExportFileType;

/// Backstop of the VolumeExport request, which lasts as long as the transfer (the receiver's idle timeout is what
/// catches a stall).
const EXPORT_REQUEST_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// Receives the snapshot into `work`.
pub async fn run(
    ds: &JobContext,
    snapshot_name: &str,
    sender_address: &str,
    volume_size: u64,
    file_type: ExportFileType,
    work: &Path,
) -> Result<(), JobError> {
    ds.set_size(volume_size);
    let ip = ds.config().receiver_ip;
    let mut rcfg = ReceiverConfig::new(work);
    rcfg.idle_timeout = ds.config().no_data_timeout;
    let receiver = Receiver::bind(SocketAddr::new(ip, 0), rcfg)
        .await
        .map_err(|e| JobError::Export(e.to_string()))?;
    let port = receiver.local_addr().port();
    let rcancel = ds.cancel_token().child_token();
    let _stop = rcancel.clone().drop_guard();
    let mut recv = tokio::spawn(receiver.run(rcancel.clone()));
    tracing::info!(%sender_address, snapshot_name, receiver = %SocketAddr::new(ip, port), ?file_type, "asking the replica to export");

    let request = v1::VolumeExportRequest {
        snapshot_file_name: snapshot_name.to_owned(),
        host: ip.to_string(),
        port: u32::from(port),
        export_backing_image_if_exist: true,
        ..Default::default()
    };
    let export = async {
        // VolumeExport answers when the replica has sent the whole snapshot: the request lasts as long as the
        // transfer, and a stalled one is caught by the receiver's idle timeout, not by a request timer.
        let timeouts = GrpcTimeouts {
            connect: ds.config().no_data_timeout,
            ..GrpcTimeouts::CONTROL.with_request(EXPORT_REQUEST_TIMEOUT)
        };
        let channel = corral_proto::grpc::connect(sender_address, timeouts)
            .await
            .map_err(|e| JobError::Export(e.to_string()))?;
        let mut client = SyncAgentServiceClient::new(channel);
        client
            .volume_export(request)
            .await
            .map(|_| ())
            .map_err(|s| JobError::Export(format!("VolumeExport on {sender_address}: {}", s.message())))
    };
    let partial = partial_path(work);
    let progress = async {
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            // The receiver writes data only where the snapshot has data: allocated bytes approximate progress.
            if let Ok(m) = std::fs::metadata(&partial) {
                ds.set_processed((m.blocks() * 512).min(volume_size));
            }
        }
    };
    tokio::pin!(export);
    tokio::pin!(progress);
    let mut exported = false;
    let summary: ReceiveSummary = loop {
        tokio::select! {
            r = &mut recv => {
                break r
                    .map_err(|e| JobError::Export(format!("receiver task: {e}")))?
                    .map_err(|e| JobError::Export(format!("receiver: {e}")))?;
            }
            r = &mut export, if !exported => {
                if let Err(e) = r {
                    rcancel.cancel();
                    let _ = recv.await;
                    return Err(e);
                }
                exported = true;
            }
            () = &mut progress => {}
        }
    };
    Counters::add(&ds.counters.bytes_fetched, summary.bytes_received);
    match summary.outcome {
        ReceiveOutcome::Completed => {}
        ReceiveOutcome::Cancelled => return Err(JobError::Cancelled("the data source is shutting down")),
        ReceiveOutcome::IdleTimeout => {
            return Err(JobError::Export(format!(
                "no data from the replica for {} s",
                ds.config().no_data_timeout.as_secs()
            )));
        }
        ReceiveOutcome::Unchanged => {
            return Err(JobError::Export(
                "the sender closed without sending the snapshot".into(),
            ));
        }
    }
    let size = std::fs::metadata(work)
        .map_err(|e| JobError::io("reading the size of", work, e))?
        .len();
    if size != volume_size {
        return Err(JobError::SizeMismatch {
            got: size,
            expected: volume_size,
        });
    }
    ds.set_processed(size);
    tracing::info!(
        size,
        received = summary.bytes_received,
        written = summary.bytes_written,
        holes = summary.hole_bytes_punched,
        "snapshot received"
    );
    Ok(())
}
