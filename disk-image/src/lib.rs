//! Corral disk images: raw and qcow2 readers, format detection, conversion (skeleton; see issue 5)
