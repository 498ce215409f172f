//! `upload`: `POST /v1/file?action=upload&size=N` with a multipart body (`curl -F file=@image`), streamed into the
//! work file chunk by chunk (never buffered whole). The upload is refused before anything is written unless the
//! source is an upload source still waiting for its one upload; a body that breaks off or has another size than
//! announced fails the job and removes the file.

use std::sync::Arc;

use axum::extract::Multipart;

use crate::error::{ApiError, JobError};
use crate::info::FileInfo;
use crate::job::{Counters, JobContext};
use crate::service::DataSource;
use crate::sink::FileSink;

/// Parses the announced size.
pub fn parse_size(size: Option<&String>) -> Result<u64, ApiError> {
    let s = size.ok_or_else(|| {
        ApiError::BadRequest("an upload needs its size in bytes: ?action=upload&size=N".into())
    })?;
    match s.parse::<u64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(ApiError::BadRequest(format!(
            "size {s:?} is not a positive number of bytes"
        ))),
    }
}

/// Receives the upload; returns when the data is in (checksumming continues in the background).
pub async fn receive(ds: &Arc<DataSource>, size: u64, mut form: Multipart) -> Result<FileInfo, ApiError> {
    let job = ds.job();
    job.claim_upload()?;
    job.set_size(size);
    tracing::info!(size, "upload started");
    let r = stream(job, size, &mut form).await;
    match r {
        Ok(()) => {
            ds.finish_in_background();
            Ok(job.info())
        }
        Err(e) => {
            let message = e.to_string();
            job.fail(&e);
            Err(ApiError::UploadFailed(message))
        }
    }
}

async fn stream(ds: &JobContext, size: u64, form: &mut Multipart) -> Result<(), JobError> {
    let work = ds.config().work_path();
    let cancel = ds.cancel_token().clone();
    let mut field = loop {
        let next = tokio::select! {
            () = cancel.cancelled() => return Err(JobError::Cancelled("the data source is shutting down")),
            f = form.next_field() => f.map_err(|e| JobError::Upload(e.body_text()))?,
        };
        match next {
            None => return Err(JobError::Upload("the multipart body has no file part".into())),
            // `curl -F file=@img` names the part `file` and gives a file name; take the first such part.
            Some(f) if f.file_name().is_some() || f.name() == Some("file") => break f,
            Some(_) => {}
        }
    };
    let mut sink = FileSink::create(&work)?;
    loop {
        let chunk = tokio::select! {
            () = cancel.cancelled() => return Err(JobError::Cancelled("the data source is shutting down")),
            c = field.chunk() => c.map_err(|e| JobError::Upload(format!("the body broke off after {} bytes: {}", sink.len(), e.body_text())))?,
        };
        let Some(chunk) = chunk else { break };
        Counters::add(&ds.counters.bytes_fetched, chunk.len() as u64);
        if sink.len() + chunk.len() as u64 > size {
            return Err(JobError::SizeMismatch {
                got: sink.len() + chunk.len() as u64,
                expected: size,
            });
        }
        sink.write(&chunk).await?;
        ds.set_processed(sink.len());
    }
    let done = sink.finish().await?;
    if done.size != size {
        return Err(JobError::SizeMismatch {
            got: done.size,
            expected: size,
        });
    }
    ds.set_received_checksum(done.sha512);
    tracing::info!(size, "upload received");
    Ok(())
}
