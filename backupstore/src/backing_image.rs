//! Backing images in a backup target (seed 000; Longhorn keeps them in the target's `backing-images/` area): an
//! image is backed up as the one backup volume of its name under `<target>/backing-images/`, in the same block
//! format, block map, locks and GC as volumes. So the backup of an image is an ordinary backup URL
//! (`<target>/backing-images?backup=B&volume=IMAGE`) that any restore reads (the data source's `restore` source),
//! a second backup of an unchanged image uploads nothing (its blocks deduplicate), and volume listings never see
//! images (they live under their own prefix). The backup records the image's name and SHA-512: a restore checks
//! the file it wrote against it.

use std::path::Path;
use std::sync::Arc;

use crate::config::BackupConfig;
use crate::create::{BackupMode, CreateOptions};
use crate::error::{BackupStoreError, Result};
use crate::file::FileSource;
use crate::target::TargetUrl;
use crate::{BackupStore, Progress, validate_name};

/// The sub-directory (or key prefix) of a target that holds backing images.
pub const BACKING_IMAGES_DIR: &str = "backing-images";

impl TargetUrl {
    /// The target's backing-image area: `file:///DIR/backing-images`, `s3://BUCKET/PREFIX/backing-images`.
    #[must_use]
    pub fn backing_images(&self) -> TargetUrl {
        let mut t = self.clone();
        if t.scheme == "file" {
            t.location = format!("{}/{BACKING_IMAGES_DIR}", t.location.trim_end_matches('/'));
        } else if t.prefix.is_empty() {
            t.prefix = BACKING_IMAGES_DIR.to_owned();
        } else {
            t.prefix = format!("{}/{BACKING_IMAGES_DIR}", t.prefix.trim_end_matches('/'));
        }
        t
    }
}

impl BackupStore {
    /// The store of this target's backing images (same object store, under [`BACKING_IMAGES_DIR`]).
    #[must_use]
    pub fn backing_images(&self) -> BackupStore {
        BackupStore {
            store: self.store.clone(),
            root: self.path(BACKING_IMAGES_DIR),
            target: self.target.backing_images(),
            lock_timing: self.lock_timing,
            local_root: self.local_root.clone(),
        }
    }

    /// Backs the file of backing image `image` up as backup `backup` in the backing-image area, recording `checksum`
    /// (the SHA-512 the control plane verified). Every block is read; only blocks the area lacks are uploaded.
    pub async fn backup_backing_image(
        &self,
        image: &str,
        file: &Path,
        checksum: &str,
        backup: &str,
        max_upload_rate: u64,
        progress: &Progress,
    ) -> Result<BackupConfig> {
        validate_name("backing image", image)?;
        let f = file.to_owned();
        let source = tokio::task::spawn_blocking(move || FileSource::open(&f, "backing"))
            .await
            .map_err(|e| crate::join_error(&e))?
            .map_err(|source| BackupStoreError::SourceRead { offset: 0, source })?;
        let opts = CreateOptions {
            volume: image.to_owned(),
            name: backup.to_owned(),
            // An image's content never changes under its name: the incremental re-reads the file (no change
            // tracking) and uploads nothing the area holds.
            mode: BackupMode::Auto,
            backing_image: Some((image.to_owned(), checksum.to_owned())),
            max_upload_rate,
            ..CreateOptions::default()
        };
        self.backing_images()
            .create_backup(Arc::new(source), &opts, progress)
            .await
    }
}
