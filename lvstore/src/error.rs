//! The store's errors: a small [`ErrorKind`] for control flow (a replica backend maps it to its protocol's error
//! codes) and the context (path, name, offset) in the message.

use std::path::PathBuf;

/// What is wrong with bytes read from the device: the metadata parser's error.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum FormatError {
    /// {what} is truncated: {need} bytes needed at offset {at}
    #[error("{what} is truncated: {need} bytes needed at offset {at}")]
    Truncated {
        what: &'static str,
        at: usize,
        need: usize,
    },
    /// Anything else that does not parse or does not hold together.
    #[error("{0}")]
    Invalid(String),
}

/// The kind of an [`Error`], for callers that branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorKind {
    /// The device does not hold an lvstore, or a newer or damaged one.
    BadStore,
    /// No lvol or snapshot of that name or id.
    NotFound,
    /// The name is taken.
    Exists,
    /// Bad argument: name, size, alignment, range, an operation the lvol's kind does not allow.
    Invalid,
    /// No free cluster or no room in the metadata area.
    NoSpace,
    /// The device failed an IO.
    Io,
    /// A previous metadata write failed: the store refuses changes until it is reopened.
    Poisoned,
}

/// An lvstore error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// {path}: not an lvstore (no superblock magic)
    #[error("{path}: not an lvstore (no superblock magic at offset 0 or 4096)")]
    NotAnLvstore { path: PathBuf },
    /// {path}: lvstore format version {found} is newer than this build's {supported}
    #[error(
        "{path}: lvstore format version {found} is newer than the {supported} this build reads; use a newer corral-lvstore"
    )]
    NewerVersion {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    /// The superblock or metadata does not parse or is inconsistent.
    #[error("{path}: damaged lvstore metadata: {source}")]
    Corrupt {
        path: PathBuf,
        #[source]
        source: FormatError,
    },
    /// No lvol named so.
    #[error("no lvol or snapshot {0:?}")]
    NotFound(String),
    /// The name is taken.
    #[error("an lvol or snapshot named {0:?} already exists")]
    Exists(String),
    /// A bad argument.
    #[error("{0}")]
    Invalid(String),
    /// Out of clusters.
    #[error("{path}: no free cluster left ({clusters} clusters of {cluster_size} bytes, all in use)")]
    NoSpace {
        path: PathBuf,
        clusters: u64,
        cluster_size: u64,
    },
    /// The metadata image would not fit its area.
    #[error(
        "{path}: the metadata area ({area} bytes) cannot hold the metadata ({need} bytes): too many lvols, snapshots or xattrs"
    )]
    MetadataFull { path: PathBuf, area: u64, need: u64 },
    /// An IO error with what was being done.
    #[error("{path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A metadata write failed earlier.
    #[error("{path}: a metadata write failed earlier; reopen the store to recover")]
    Poisoned { path: PathBuf },
}

impl Error {
    /// The kind, for control flow.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::NotAnLvstore { .. } | Error::NewerVersion { .. } | Error::Corrupt { .. } => {
                ErrorKind::BadStore
            }
            Error::NotFound(_) => ErrorKind::NotFound,
            Error::Exists(_) => ErrorKind::Exists,
            Error::Invalid(_) => ErrorKind::Invalid,
            Error::NoSpace { .. } | Error::MetadataFull { .. } => ErrorKind::NoSpace,
            Error::Io { .. } => ErrorKind::Io,
            Error::Poisoned { .. } => ErrorKind::Poisoned,
        }
    }
}

/// The crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
