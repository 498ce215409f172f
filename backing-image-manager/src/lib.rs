//! Corral backing-image manager: the per-disk service owning backing-image files (skeleton; see issue 7)
