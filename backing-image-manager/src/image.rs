//! What one image on this disk is: the spec a caller asks for, the record the manager keeps while it works on it,
//! and the view and change events callers get. Domain types only; the gRPC edge (`grpc`) converts them.

use corral_disk::identity::check_path_component;
use tokio_util::sync::CancellationToken;

use crate::checksum::check_checksum_syntax;
use crate::error::BimError;
use crate::files::BackingConfig;
use crate::state::FileState;

/// What a caller asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSpec {
    pub name: String,
    pub uuid: String,
    /// 0 = unknown.
    pub size: u64,
    /// Expected SHA-512; empty = none.
    pub checksum: String,
}

impl ImageSpec {
    /// Checks a spec from a caller: names that stay one path component, a well-formed checksum.
    pub fn checked(name: String, uuid: String, size: u64, checksum: String) -> Result<Self, BimError> {
        check_ref(&name, &uuid)?;
        check_checksum_syntax(&checksum).map_err(BimError::InvalidArgument)?;
        Ok(ImageSpec {
            name,
            uuid,
            size,
            checksum,
        })
    }
}

/// Checks a name and uuid that become a directory name.
pub fn check_ref(name: &str, uuid: &str) -> Result<(), BimError> {
    check_path_component("image name", name).map_err(BimError::InvalidArgument)?;
    check_path_component("image uuid", uuid).map_err(BimError::InvalidArgument)
}

/// An image as callers see it: its state as the disk makes it look (every image is `unknown` while the disk
/// identity cannot be verified).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageView {
    pub spec: ImageSpec,
    pub state: FileState,
    pub message: String,
    /// Percent, 0–100.
    pub progress: u8,
    /// SHA-512 of the verified file; empty until verified.
    pub current_checksum: String,
    /// Sends running from this copy.
    pub sending: u32,
    /// The data source or manager the file comes from.
    pub sender_address: String,
    pub size: u64,
    pub virtual_size: u64,
    pub real_size: u64,
    /// The disk the image is on.
    pub disk_uuid: String,
    /// Path of `backing`.
    pub path: String,
}

/// Every image of the disk, with the disk's problem if its identity cannot be verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskImages {
    pub images: Vec<ImageView>,
    pub disk_uuid: String,
    /// Empty when the disk identity is verified.
    pub disk_message: String,
}

/// A change watchers are told about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageEvent {
    /// The image was registered or changed: its new view.
    Changed(ImageView),
    /// The image was deleted: its last view.
    Deleted(ImageView),
}

/// One image in memory.
#[derive(Debug)]
pub(crate) struct Image {
    pub(crate) spec: ImageSpec,
    /// Distinguishes registrations of the same name, so a job of a deleted or replaced image changes nothing.
    pub(crate) generation: u64,
    pub(crate) state: FileState,
    pub(crate) message: String,
    pub(crate) progress: u8,
    pub(crate) current_checksum: String,
    pub(crate) sending: u32,
    pub(crate) sender_address: String,
    pub(crate) size: u64,
    pub(crate) virtual_size: u64,
    pub(crate) real_size: u64,
    /// mtime of `backing` when it was verified.
    pub(crate) modification_time: String,
    /// A fetch, sync or verification runs on the image.
    pub(crate) busy: bool,
    pub(crate) cancel: CancellationToken,
}

impl Image {
    pub(crate) fn new(
        spec: ImageSpec,
        generation: u64,
        state: FileState,
        parent: &CancellationToken,
    ) -> Self {
        Image {
            spec,
            generation,
            state,
            message: String::new(),
            progress: 0,
            current_checksum: String::new(),
            sending: 0,
            sender_address: String::new(),
            size: 0,
            virtual_size: 0,
            real_size: 0,
            modification_time: String::new(),
            busy: false,
            cancel: parent.child_token(),
        }
    }

    pub(crate) fn set_ready(&mut self, cfg: &BackingConfig) {
        self.state = FileState::Ready;
        self.message.clear();
        self.progress = 100;
        self.current_checksum.clone_from(&cfg.current_checksum);
        self.size = cfg.size;
        self.virtual_size = cfg.virtual_size;
        self.real_size = cfg.real_size;
        self.modification_time.clone_from(&cfg.modification_time);
        self.busy = false;
    }
}
