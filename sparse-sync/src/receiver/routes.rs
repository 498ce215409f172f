//! The receiver's route handlers. File IO runs on the blocking pool; every refused request of an open transfer
//! marks it failed, so it can never be committed.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;

use futures::StreamExt;

use super::payload::{Out, PayloadWriter};
use super::{Dest, ReceiveError, ReceiveOutcome, Session, Shared, TransferState, lock};
use crate::record;
use crate::wire::{
    ChecksumReply, CloseReply, CloseRequest, FileChecksum, OpenQuery, OpenReply, SessionQuery, decode_ranges,
};
use corral_disk::sparse::{data_extents, punch_hole};

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ReceiveError> + Send + 'static,
) -> Result<T, ReceiveError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ReceiveError::Serve(io::Error::other(e)))?
}

pub(super) async fn recorded(State(s): State<Arc<Shared>>) -> Result<Json<FileChecksum>, ReceiveError> {
    let target = s.config.target.clone();
    if s.config.sink.is_some() {
        return Err(ReceiveError::NotRecorded(target));
    }
    blocking(move || match record::read_valid(&target) {
        Ok(Some(sum)) => Ok(Json(sum)),
        Ok(None) => Err(ReceiveError::NotRecorded(target)),
        Err(e) => Err(ReceiveError::io(
            "reading checksum record of",
            &target,
            0,
            io::Error::other(e),
        )),
    })
    .await
}

pub(super) async fn open(
    State(s): State<Arc<Shared>>,
    q: Result<Query<OpenQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<OpenReply>, ReceiveError> {
    let Query(q) = q.map_err(|e| ReceiveError::BadRequest(e.body_text()))?;
    let shared = s.clone();
    blocking(move || {
        let s = shared;
        let mut state = lock(&s.state);
        if matches!(*state, TransferState::Committed(_)) {
            return Err(ReceiveError::Failed("the transfer was already committed".into()));
        }
        *state = TransferState::Idle;
        if let Some(sink) = &s.config.sink {
            if sink.size() != q.size {
                return Err(ReceiveError::BadRequest(format!(
                    "open for {} bytes, but {} holds {}",
                    q.size,
                    s.config.target.display(),
                    sink.size()
                )));
            }
            let id = s.next_session.fetch_add(1, Ordering::Relaxed);
            s.counters.opens.fetch_add(1, Ordering::Relaxed);
            tracing::info!(session = id, size = q.size, target = %s.config.target.display(), "transfer opened into a sink");
            *state = TransferState::Open(Session {
                id,
                dest: Dest::Sink(sink.clone()),
                size: q.size,
                fresh: true,
                failed: None,
            });
            return Ok(Json(OpenReply {
                session: id,
                existing: false,
            }));
        }
        *lock(&s.touched) = true;
        let (target, partial) = (&s.config.target, &s.partial);
        let existing = if partial.exists() {
            true
        } else if target.exists() {
            std::fs::rename(target, partial).map_err(|e| ReceiveError::io("moving aside", target, 0, e))?;
            record::remove_record(target)
                .map_err(|e| ReceiveError::io("removing checksum record of", target, 0, e))?;
            true
        } else {
            false
        };
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(partial)
            .map_err(|e| ReceiveError::io("opening", partial, 0, e))?;
        file.set_len(q.size)
            .map_err(|e| ReceiveError::io("resizing", partial, q.size, e))?;
        let direct = if q.direct_io || s.config.direct_io {
            let f = File::options()
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(partial)
                .map_err(|e| ReceiveError::io("opening with O_DIRECT", partial, 0, e))?;
            Some(Arc::new(f))
        } else {
            None
        };
        let id = s.next_session.fetch_add(1, Ordering::Relaxed);
        s.counters.opens.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            session = id,
            size = q.size,
            existing,
            direct_io = direct.is_some(),
            "transfer opened"
        );
        *state = TransferState::Open(Session {
            id,
            dest: Dest::File {
                file: Arc::new(file),
                direct,
            },
            size: q.size,
            fresh: !existing,
            failed: None,
        });
        Ok(Json(OpenReply {
            session: id,
            existing,
        }))
    })
    .await
}

pub(super) async fn holes(
    State(s): State<Arc<Shared>>,
    Query(q): Query<SessionQuery>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ReceiveError> {
    let h = s.session(q.session)?;
    let body = body.map_err(|e| ReceiveError::BadRequest(format!("reading the body: {}", e.body_text())))?;
    let shared = s.clone();
    let handle = h.clone();
    let r = blocking(move || {
        let (ranges, _) = decode_ranges(&body, handle.size, false)?;
        let mut punched = 0;
        if let (false, Dest::File { file, .. }) = (handle.fresh, &handle.dest) {
            for r in &ranges {
                punch_hole(file, r.start, r.end - r.start)
                    .map_err(|e| ReceiveError::io("punching a hole in", &shared.partial, r.start, e))?;
                punched += r.end - r.start;
            }
        }
        shared.counters.punched.fetch_add(punched, Ordering::Relaxed);
        Ok(StatusCode::NO_CONTENT)
    })
    .await;
    if let Err(e) = &r {
        s.fail(h.id, e);
    }
    r
}

pub(super) async fn checksum(
    State(s): State<Arc<Shared>>,
    Query(q): Query<SessionQuery>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<ChecksumReply>, ReceiveError> {
    let h = s.session(q.session)?;
    let body = body.map_err(|e| ReceiveError::BadRequest(format!("reading the body: {}", e.body_text())))?;
    let shared = s.clone();
    let handle = h.clone();
    let r = blocking(move || {
        let (ranges, _) = decode_ranges(&body, handle.size, false)?;
        // A sink holds nothing of the source: every range must be sent.
        let Dest::File { file, .. } = &handle.dest else {
            return Ok(Json(ChecksumReply { xxh3_128: None }));
        };
        let io_err = |off, e| ReceiveError::io("reading", &shared.partial, off, e);
        for r in &ranges {
            // Only a range that is entirely data here can match: a hole where the source has data must be sent.
            let first = data_extents(file, r.clone())
                .next()
                .transpose()
                .map_err(|e| io_err(r.start, e))?;
            if first != Some(r.clone()) {
                return Ok(Json(ChecksumReply { xxh3_128: None }));
            }
        }
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut buf = Vec::new();
        let mut bytes = 0;
        for r in &ranges {
            let len = usize::try_from(r.end - r.start).map_err(|e| io_err(r.start, io::Error::other(e)))?;
            buf.resize(len, 0);
            file.read_exact_at(&mut buf, r.start)
                .map_err(|e| io_err(r.start, e))?;
            hasher.update(&buf);
            bytes += r.end - r.start;
        }
        shared.counters.matched.fetch_add(bytes, Ordering::Relaxed);
        Ok(Json(ChecksumReply {
            xxh3_128: Some(format!("{:032x}", hasher.digest128())),
        }))
    })
    .await;
    if let Err(e) = &r {
        s.fail(h.id, e);
    }
    r
}

pub(super) async fn data(
    State(s): State<Arc<Shared>>,
    Query(q): Query<SessionQuery>,
    body: Body,
) -> Result<StatusCode, ReceiveError> {
    let h = s.session(q.session)?;
    let shared = s.clone();
    let handle = h.clone();
    let runtime = tokio::runtime::Handle::current();
    // One blocking thread per request pulls the body and writes each chunk as it arrives (see `payload`): no
    // copy into a gathered body, no task per chunk.
    let r = blocking(move || {
        let mut chunks = body.into_data_stream();
        let out = match &handle.dest {
            Dest::File { file, direct } => Out::File {
                file,
                direct: direct.as_deref(),
            },
            Dest::Sink(sink) => Out::Sink(sink.as_ref()),
        };
        let mut writer = PayloadWriter::new(out, &shared.partial, handle.size);
        let mut streamed = || {
            while let Some(chunk) = runtime.block_on(chunks.next()) {
                let chunk = chunk.map_err(|e| ReceiveError::BadRequest(format!("reading the body: {e}")))?;
                writer.feed(&chunk)?;
            }
            writer.finish()?;
            writer.start_writeback();
            Ok(())
        };
        let r = streamed();
        let c = &shared.counters;
        c.received.fetch_add(writer.received(), Ordering::Relaxed);
        c.written.fetch_add(writer.written(), Ordering::Relaxed);
        r.map(|()| StatusCode::NO_CONTENT)
    })
    .await;
    // A body cut short in transport (or refused as too large) leaves the transfer open: the sender retries it.
    if let Err(e) = &r
        && !matches!(e, ReceiveError::BadRequest(_))
    {
        s.fail(h.id, e);
    }
    r
}

pub(super) async fn close(
    State(s): State<Arc<Shared>>,
    Query(q): Query<SessionQuery>,
    body: Result<Json<CloseRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<CloseReply>, ReceiveError> {
    let Json(req) = body.map_err(|e| ReceiveError::BadRequest(e.body_text()))?;
    let shared = s.clone();
    let r = blocking(move || {
        let s = shared;
        let mut state = lock(&s.state);
        let session = match &*state {
            TransferState::Idle if q.session.is_none() => {
                drop(state);
                s.finish(ReceiveOutcome::Unchanged);
                return Ok(CloseReply {
                    committed: false,
                    bytes_received: s.counters.received.load(Ordering::Relaxed),
                });
            }
            TransferState::Idle => return Err(ReceiveError::NoSession),
            // A close retried because its reply was lost: the commit happened, say so again.
            TransferState::Committed(id) if q.session == Some(*id) => {
                return Ok(CloseReply {
                    committed: true,
                    bytes_received: s.counters.received.load(Ordering::Relaxed),
                });
            }
            TransferState::Committed(_) => {
                return Err(ReceiveError::Failed("the transfer was already committed".into()));
            }
            TransferState::Open(session) => session,
        };
        if Some(session.id) != q.session {
            return Err(ReceiveError::StaleSession {
                got: q.session,
                current: session.id,
            });
        }
        if let Some(reason) = &session.failed {
            return Err(ReceiveError::Failed(reason.clone()));
        }
        let target = &s.config.target;
        match &session.dest {
            Dest::File { file, .. } => corral_disk::durable::publish(file, &s.partial, target)
                .map_err(|e| ReceiveError::io("publishing", target, 0, e))?,
            Dest::Sink(sink) => sink
                .commit()
                .map_err(|e| ReceiveError::io("committing", target, 0, e))?,
        }
        if let Some(sum) = req.checksum.as_ref().filter(|_| s.config.sink.is_none()) {
            record::write_record(target, sum)
                .map_err(|e| ReceiveError::io("recording the checksum of", target, 0, io::Error::other(e)))?;
        }
        let committed_id = session.id;
        *state = TransferState::Committed(committed_id);
        drop(state);
        tracing::info!(path = %target.display(), "transfer committed");
        s.finish(ReceiveOutcome::Completed);
        Ok(CloseReply {
            committed: true,
            bytes_received: s.counters.received.load(Ordering::Relaxed),
        })
    })
    .await;
    r.map(Json)
}
