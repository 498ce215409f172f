//! Send: this disk's ready copy feeds another manager's sparse-sync receiver (holes stay holes), at most
//! [`SEND_LIMIT`] at once per image; a file changed since it was verified is never sent.

use std::sync::Arc;

use corral_disk::sparse::{FileContent, LayoutMode};
use sparse_sync::{Progress, SendOptions, SendSummary};
use tracing::info;

use crate::error::BimError;
use crate::files::{self, ImagePaths};
use crate::image::check_ref;
use crate::manager::{Manager, blocking};
use crate::state::FileState;

/// Sends of one image running at once (each ready copy feeds at most this many syncs).
pub const SEND_LIMIT: u32 = 3;

/// Ends one send of an image, whatever happened to it.
struct SendingGuard {
    manager: Arc<Manager>,
    name: String,
    generation: u64,
}

impl Drop for SendingGuard {
    fn drop(&mut self) {
        self.manager.update(&self.name, self.generation, |i| {
            i.sending = i.sending.saturating_sub(1);
        });
    }
}

impl Manager {
    /// Send: feeds a ready image to a sparse-sync receiver; at most [`SEND_LIMIT`] at once per image.
    pub async fn send(self: &Arc<Self>, name: &str, uuid: &str, to: &str) -> Result<SendSummary, BimError> {
        check_ref(name, uuid)?;
        if to.is_empty() {
            return Err(BimError::InvalidArgument("to_address is empty".into()));
        }
        let (generation, paths, mtime, cancel) = {
            let mut reg = self.lock();
            if let Some(p) = &reg.disk_problem {
                return Err(BimError::DiskUnavailable(p.clone()));
            }
            let img = reg
                .images
                .get_mut(name)
                .filter(|i| i.spec.uuid == uuid)
                .ok_or_else(|| {
                    BimError::NotFound(format!("image {name} with uuid {uuid} is not on this disk"))
                })?;
            if img.state != FileState::Ready {
                return Err(BimError::FailedPrecondition(format!(
                    "image {name} is {}, not ready",
                    img.state
                )));
            }
            if img.sending >= SEND_LIMIT {
                return Err(BimError::ResourceExhausted(format!(
                    "image {name} already feeds {SEND_LIMIT} syncs; retry when one ends"
                )));
            }
            img.sending += 1;
            let r = (
                img.generation,
                ImagePaths::new(&self.cfg.disk_path, name, uuid),
                img.modification_time.clone(),
                img.cancel.child_token(),
            );
            self.emit(&reg, name);
            r
        };
        let _guard = SendingGuard {
            manager: self.clone(),
            name: name.to_owned(),
            generation,
        };
        let p = paths.clone();
        let content = blocking(move || {
            let content = FileContent::open(&p.backing, LayoutMode::SeekData)
                .map_err(|e| BimError::io("open", &p.backing, e))?;
            let now = files::facts(&p.backing).map_err(|e| BimError::io("stat", &p.backing, e))?;
            if now.map(|f| f.modification_time) != Some(mtime) {
                return Err(BimError::FailedPrecondition(format!(
                    "{} changed on disk since it was verified",
                    p.backing.display()
                )));
            }
            Ok(content)
        })
        .await?;
        let opts = SendOptions {
            max_rate: self.cfg.send_max_rate,
            ..SendOptions::default()
        };
        let s = sparse_sync::send(Arc::new(content), to, &opts, &Progress::new(), &cancel)
            .await
            .map_err(|e| BimError::Peer(format!("sending {name} to {to}: {e}")))?;
        self.metrics.sends.inc();
        self.metrics.send_bytes.inc_by(s.bytes_sent);
        info!(
            image = name,
            to,
            bytes_sent = s.bytes_sent,
            holes = s.hole_bytes,
            "sent"
        );
        Ok(s)
    }
}
