//! `export-from-volume`: asks a replica's sync agent (`sender-address`, a v1 replica or a v2 disk daemon's) to
//! stream a snapshot, flattened over its chain and including its backing image, to a sparse-sync receiver of the
//! work file ([`crate::receive`], `VolumeExport`). Holes arrive as holes. A `qcow2` file type is converted after the receive (see `finish`).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use corral_proto::grpc::GrpcTimeouts;
use corral_proto::v1;
use corral_proto::v1::sync_agent_service_client::SyncAgentServiceClient;

use crate::error::JobError;
use crate::job::JobContext;
use crate::receive::receive;
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
    let ask = |to: SocketAddr| async move {
        tracing::info!(%sender_address, snapshot_name, receiver = %to, ?file_type, "asking the replica to export");
        let request = v1::VolumeExportRequest {
            snapshot_file_name: snapshot_name.to_owned(),
            host: to.ip().to_string(),
            port: u32::from(to.port()),
            export_backing_image_if_exist: true,
            ..Default::default()
        };
        // VolumeExport answers when the replica has sent the whole snapshot: the request lasts as long as the
        // transfer, and a stalled one is caught by the receiver's idle timeout, not by a request timer.
        let timeouts = GrpcTimeouts {
            connect: ds.config().no_data_timeout,
            ..GrpcTimeouts::CONTROL.with_request(EXPORT_REQUEST_TIMEOUT)
        };
        let channel = corral_proto::grpc::connect(sender_address, timeouts)
            .await
            .map_err(|e| e.to_string())?;
        SyncAgentServiceClient::new(channel)
            .volume_export(request)
            .await
            .map(|_| ())
            .map_err(|s| format!("VolumeExport on {sender_address}: {}", s.message()))
    };
    let summary = receive(ds, work, volume_size, ask, JobError::Export).await?;
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
