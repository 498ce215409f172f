//! Errors of the backup store, with the object path or offset they concern, and a small stable kind for
//! mapping to gRPC/HTTP statuses.

/// Coarse class of an error, for status mapping and retry decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request itself is wrong (bad URL, bad name, bad setting).
    InvalidArgument,
    /// A volume, backup or block is missing.
    NotFound,
    /// Another process holds a conflicting lock, or the state forbids the operation: retry later.
    FailedPrecondition,
    /// Stored data failed verification (checksum, header, JSON).
    Corrupt,
    /// The store, the source or the sink failed.
    Io,
    /// The job was cancelled.
    Cancelled,
}

/// An error of the backup store.
#[derive(Debug, thiserror::Error)]
pub enum BackupStoreError {
    /// The target or backup URL cannot be used.
    #[error("invalid backup URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A bad argument (name, block size, option).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A volume, backup or block does not exist on the target.
    #[error("{0} not found on the backup target")]
    NotFound(String),
    /// An object-store request failed.
    #[error("backup target: {op} {path}: {source}")]
    Store {
        /// Operation (get, put, list, ...).
        op: &'static str,
        /// Object path.
        path: String,
        /// Cause.
        #[source]
        source: object_store::Error,
    },
    /// A stored object failed verification.
    #[error("corrupt {path}: {reason}")]
    Corrupt {
        /// Object path.
        path: String,
        /// What failed.
        reason: String,
    },
    /// A conflicting lock is held by another process.
    #[error("backup volume {volume} is locked for {holder} (lock {lock}): retry when it finishes")]
    Locked {
        /// Backup volume.
        volume: String,
        /// Kind of the conflicting lock (`backup`, `restore`, `deletion`).
        holder: String,
        /// Lock object name.
        lock: String,
    },
    /// A held lock could not be kept (removed by another process, or not refreshed in time): the operation it
    /// protected was stopped.
    #[error(
        "lost lock {lock} on backup volume {volume} ({reason}): stopped, nothing was committed after that"
    )]
    LockLost {
        /// Backup volume.
        volume: String,
        /// Lock object name.
        lock: String,
        /// Why it was lost.
        reason: String,
    },
    /// The backup source (a snapshot) could not be read.
    #[error("reading the snapshot at offset {offset}: {source}")]
    SourceRead {
        /// Byte offset.
        offset: u64,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The restore sink could not be written.
    #[error("writing the restore target at offset {offset}: {source}")]
    SinkWrite {
        /// Byte offset.
        offset: u64,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The operation is not possible in the current state.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The job was cancelled.
    #[error("cancelled")]
    Cancelled,
}

impl BackupStoreError {
    /// The error's class.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::InvalidUrl { .. } | Self::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Self::NotFound(_) => ErrorKind::NotFound,
            Self::Store {
                source: object_store::Error::NotFound { .. },
                ..
            } => ErrorKind::NotFound,
            Self::Store { .. } | Self::SourceRead { .. } | Self::SinkWrite { .. } => ErrorKind::Io,
            Self::Corrupt { .. } => ErrorKind::Corrupt,
            Self::Locked { .. } | Self::LockLost { .. } | Self::FailedPrecondition(_) => {
                ErrorKind::FailedPrecondition
            }
            Self::Cancelled => ErrorKind::Cancelled,
        }
    }

    pub(crate) fn store(
        op: &'static str,
        path: &object_store::path::Path,
        source: object_store::Error,
    ) -> Self {
        Self::Store {
            op,
            path: path.to_string(),
            source,
        }
    }
}

/// Result of the backup store.
pub type Result<T, E = BackupStoreError> = std::result::Result<T, E>;
