//! Corral backup store: incremental block backups to a filesystem or S3 target (skeleton; see issue 9)
