//! The replica's error type. Every variant names what it is about (file, offset, snapshot) so an operator can act
//! on the message alone; [`ReplicaError::kind`] is the small stable classification used for control flow and for
//! mapping to gRPC codes and data-protocol error kinds.

use std::io;
use std::path::PathBuf;

/// Result alias for replica operations.
pub type Result<T, E = ReplicaError> = std::result::Result<T, E>;

/// Stable classification of a [`ReplicaError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The caller asked for something malformed (bad name, bad size, IO out of range).
    InvalidArgument,
    /// The named snapshot or file does not exist.
    NotFound,
    /// The snapshot already exists.
    AlreadyExists,
    /// The replica is not in a state that allows the operation (closed, purging, rebuilding).
    FailedPrecondition,
    /// On-disk data or metadata is damaged; the replica refuses to guess.
    Corrupt,
    /// The disk is full.
    NoSpace,
    /// Any other IO failure.
    Io,
}

/// Errors of replica storage operations.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    /// An IO call on a file of the replica failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// A metadata file could not be parsed or holds impossible values.
    #[error("corrupt metadata file {}: {reason}", path.display())]
    CorruptMeta { path: PathBuf, reason: String },
    /// A metadata file that must exist is missing.
    #[error("metadata file {} is missing{hint}", path.display())]
    MissingMeta { path: PathBuf, hint: &'static str },
    /// A disk names a parent that is not in the directory.
    #[error("broken chain in {}: {disk} names parent {parent}, which does not exist", dir.display())]
    MissingParent {
        dir: PathBuf,
        disk: String,
        parent: String,
    },
    /// A snapshot name that cannot be used as (part of) a file name.
    #[error("invalid snapshot name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },
    /// IO outside the volume.
    #[error("IO out of range: offset {offset} + length {len} exceeds the volume size {size}")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    /// Something of that name exists (the text says what: "snapshot s1 (volume-snap-s1.img)", "replica in DIR").
    #[error("{0} already exists")]
    AlreadyExists(String),
    /// No such snapshot or disk.
    #[error("{0} not found")]
    NotFound(String),
    /// A malformed request (size, flag combination).
    #[error("{0}")]
    InvalidArgument(String),
    /// The replica cannot do this now.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The disk holding the replica is full.
    #[error("no space left on device while {op} {}", path.display())]
    NoSpace { op: &'static str, path: PathBuf },
    /// A job was cancelled.
    #[error("cancelled")]
    Cancelled,
    /// The backing image cannot be used (unsupported format or feature, corrupt, hostile backing chain).
    #[error("backing image: {0}")]
    BackingImage(#[from] disk_image::ImageError),
}

impl ReplicaError {
    /// Wraps an IO error with the operation and path, classifying ENOSPC as [`ReplicaError::NoSpace`].
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        let path = path.into();
        if source.raw_os_error() == Some(libc::ENOSPC) {
            Self::NoSpace { op, path }
        } else {
            Self::Io { op, path, source }
        }
    }

    /// The stable kind of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Io { .. } | Self::Cancelled => ErrorKind::Io,
            Self::CorruptMeta { .. } | Self::MissingMeta { .. } | Self::MissingParent { .. } => {
                ErrorKind::Corrupt
            }
            Self::InvalidName { .. } | Self::OutOfRange { .. } | Self::InvalidArgument(_) => {
                ErrorKind::InvalidArgument
            }
            Self::AlreadyExists(_) => ErrorKind::AlreadyExists,
            Self::NotFound(_) => ErrorKind::NotFound,
            Self::FailedPrecondition(_) => ErrorKind::FailedPrecondition,
            Self::NoSpace { .. } => ErrorKind::NoSpace,
            Self::BackingImage(e) => match e.kind() {
                disk_image::ErrorKind::Io => ErrorKind::Io,
                disk_image::ErrorKind::Corrupt => ErrorKind::Corrupt,
                _ => ErrorKind::InvalidArgument,
            },
        }
    }
}

/// Adds path context to `io::Result`s.
pub(crate) trait IoContext<T> {
    fn ctx(self, op: &'static str, path: impl Into<PathBuf>) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn ctx(self, op: &'static str, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|e| ReplicaError::io(op, path, e))
    }
}

/// Maps a store error to the replica's.
pub(crate) fn lv_err(store: &lvstore::LvStore, e: lvstore::Error) -> ReplicaError {
    use lvstore::{Error as E, ErrorKind as K};
    let path = store.path().to_owned();
    match e {
        E::Io { path, source, .. } => ReplicaError::io("lvstore IO", path, source),
        e => {
            let msg = e.to_string();
            match e.kind() {
                K::NotFound => ReplicaError::NotFound(msg),
                K::Exists => ReplicaError::AlreadyExists(msg),
                K::Invalid => ReplicaError::InvalidArgument(msg),
                K::NoSpace => ReplicaError::NoSpace { op: "lvstore", path },
                K::BadStore => ReplicaError::CorruptMeta { path, reason: msg },
                K::Poisoned | K::Io => ReplicaError::FailedPrecondition(msg),
            }
        }
    }
}
