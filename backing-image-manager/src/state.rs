//! The state of one backing-image file on this disk (ARCHITECTURE §10): the type shared with the data source and the
//! control plane, `corral_proto::backing_image::FileState`. A manager reports `pending`, `starting`, `in-progress`,
//! `ready`, `failed` and `unknown`, never `ready-for-transfer` (the data source's state for a finished file).

pub use corral_proto::backing_image::FileState;
