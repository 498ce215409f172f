//! The crate's error type. Every variant names the image file it is about; [`ImageError::kind`] is the small stable
//! classification callers use for control flow (HTTP/gRPC status mapping, retry decisions).

use std::io;
use std::path::PathBuf;

/// Stable classification of an [`ImageError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The file is an image format or uses a feature this crate does not read.
    Unsupported,
    /// The file claims to be an image but its metadata is impossible (hostile or damaged).
    Corrupt,
    /// A backing file is missing, escapes the image's directory or the chain loops.
    BackingChain,
    /// The caller asked for something malformed.
    InvalidArgument,
    /// The operation was cancelled.
    Cancelled,
    /// Any other IO failure.
    Io,
}

/// Errors of probing, opening and converting disk images.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// An IO call on an image file failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// The file is in an image format other than raw or qcow2.
    #[error("{}: {format} images are not supported (only raw and qcow2); convert it first, e.g. `qemu-img convert -O qcow2 IN OUT`", path.display())]
    UnsupportedFormat { path: PathBuf, format: &'static str },
    /// A qcow2 image uses a feature this reader refuses (encryption, zstd, external data file, ...).
    #[error("{}: unsupported qcow2 feature: {feature}", path.display())]
    UnsupportedFeature { path: PathBuf, feature: String },
    /// The image's metadata is impossible: refused rather than guessed at.
    #[error("{}: corrupt image: {reason}", path.display())]
    Corrupt { path: PathBuf, reason: String },
    /// A backing file cannot be used.
    #[error("{}: backing chain refused: {reason}", path.display())]
    BackingChain { path: PathBuf, reason: String },
    /// Malformed request.
    #[error("{0}")]
    InvalidArgument(String),
    /// The operation was cancelled; nothing was left at the destination.
    #[error("cancelled")]
    Cancelled,
}

impl ImageError {
    /// The stable classification of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Io { .. } => ErrorKind::Io,
            Self::UnsupportedFormat { .. } | Self::UnsupportedFeature { .. } => ErrorKind::Unsupported,
            Self::Corrupt { .. } => ErrorKind::Corrupt,
            Self::BackingChain { .. } => ErrorKind::BackingChain,
            Self::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Self::Cancelled => ErrorKind::Cancelled,
        }
    }
}

/// Attaches an operation and a path to an `io::Result`.
pub(crate) trait IoContext<T> {
    fn ctx(self, op: &'static str, path: impl Into<PathBuf>) -> Result<T, ImageError>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn ctx(self, op: &'static str, path: impl Into<PathBuf>) -> Result<T, ImageError> {
        self.map_err(|source| ImageError::Io {
            op,
            path: path.into(),
            source,
        })
    }
}
