//! The live chain of an open replica: its layer files (root first, head last) and the metadata the structure lock
//! guards with them, how a layer file is created and opened, and the location map built over the layers.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::path::Path;

use corral_disk::BLOCK_SIZE;

use crate::backing::Backing;
use crate::error::{IoContext, ReplicaError, Result};
use crate::extent_map::{ExtentMap, LayerIndex};
use crate::meta::{DiskMeta, VolumeInfo};

/// One layer of the live chain.
#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) name: String,
    pub(crate) file: File,
}

/// Chain state guarded by the structure lock: IO holds it shared, shape changes hold it exclusively.
#[derive(Debug)]
pub(crate) struct Chain {
    pub(crate) info: VolumeInfo,
    pub(crate) disks: BTreeMap<String, DiskMeta>,
    /// Live chain, root first, head last.
    pub(crate) layers: Vec<Layer>,
    pub(crate) backing: Option<Backing>,
    pub(crate) closed: bool,
}

impl Chain {
    pub(crate) fn head(&self) -> &Layer {
        // Invariant: an open chain always has a head.
        &self.layers[self.layers.len() - 1]
    }

    pub(crate) fn head_index(&self) -> LayerIndex {
        LayerIndex::try_from(self.layers.len() - 1).unwrap_or(LayerIndex::MAX)
    }
}

pub(crate) fn open_rw(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .ctx("open", path)
}

pub(crate) fn open_ro(path: &Path) -> Result<File> {
    File::open(path).ctx("open", path)
}

/// Creates an empty sparse layer file of `size` bytes and makes it durable.
pub(crate) fn create_layer_file(path: &Path, size: u64) -> Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .ctx("create", path)?;
    f.set_len(size).ctx("truncate", path)?;
    f.sync_all().ctx("fsync", path)?;
    Ok(f)
}

/// Builds the location map from each layer's data extents, oldest first so newer layers win.
pub(crate) fn build_map(dir: &Path, layers: &[Layer]) -> Result<ExtentMap> {
    let mut map = ExtentMap::new();
    for (i, l) in layers.iter().enumerate() {
        let idx =
            LayerIndex::try_from(i).map_err(|_| ReplicaError::InvalidArgument("too many layers".into()))?;
        let len = l.file.metadata().ctx("stat", dir.join(&l.name))?.len();
        for r in corral_disk::sparse::data_extents(&l.file, 0..len) {
            let r = r.ctx("seek data", dir.join(&l.name))?;
            map.set(r.start / BLOCK_SIZE, r.end.div_ceil(BLOCK_SIZE), idx);
        }
    }
    Ok(map)
}
