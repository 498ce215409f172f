//! File names of a replica directory (Longhorn v1 compatible) and validation of user-given snapshot names.

use crate::error::{ReplicaError, Result};

/// Volume metadata file.
pub const VOLUME_META: &str = "volume.meta";
/// The highest engine generation accepted ([`crate::generation`]).
pub const ENGINE_GENERATION: &str = "engine.generation";
/// Revision counter file.
pub const REVISION_COUNTER: &str = "revision.counter";
/// Suffix of a disk's metadata file.
pub const META_SUFFIX: &str = ".meta";
/// Suffix of a snapshot's checksum record.
pub const CHECKSUM_SUFFIX: &str = ".checksum";
/// Suffix of temporary files of atomic writes.
pub const TMP_SUFFIX: &str = corral_disk::durable::TEMP_SUFFIX;
/// Suffix of the file a snapshot clone receives into (`<snapshot>.img.clone`).
pub const CLONE_SUFFIX: &str = ".clone";

const HEAD_PREFIX: &str = "volume-head-";
const SNAP_PREFIX: &str = "volume-snap-";
const IMG_SUFFIX: &str = ".img";
const MAX_NAME_LEN: usize = 200;

/// `volume-head-NNN.img`.
pub fn head_file(index: u32) -> String {
    format!("{HEAD_PREFIX}{index:03}{IMG_SUFFIX}")
}

/// Index of a head file name, if it is one.
pub fn head_index(file: &str) -> Option<u32> {
    file.strip_prefix(HEAD_PREFIX)?
        .strip_suffix(IMG_SUFFIX)?
        .parse()
        .ok()
}

/// `volume-snap-<name>.img`.
pub fn snapshot_file(name: &str) -> String {
    format!("{SNAP_PREFIX}{name}{IMG_SUFFIX}")
}

/// The snapshot name inside a snapshot file name, if it is one.
pub fn snapshot_name(file: &str) -> Option<&str> {
    file.strip_prefix(SNAP_PREFIX)?.strip_suffix(IMG_SUFFIX)
}

/// Is this a layer image file name (head or snapshot)?
pub fn is_image(file: &str) -> bool {
    head_index(file).is_some() || snapshot_name(file).is_some()
}

/// `<file>.meta`.
pub fn meta_file(img: &str) -> String {
    format!("{img}{META_SUFFIX}")
}

/// `<file>.checksum`.
pub fn checksum_file(img: &str) -> String {
    format!("{img}{CHECKSUM_SUFFIX}")
}

/// Accepts a snapshot given either as its name or as its file name; returns the file name.
pub fn resolve_snapshot(name_or_file: &str) -> Result<String> {
    if snapshot_name(name_or_file).is_some() {
        let name = snapshot_name(name_or_file).unwrap_or_default();
        validate_snapshot_name(name)?;
        return Ok(name_or_file.to_owned());
    }
    validate_snapshot_name(name_or_file)?;
    Ok(snapshot_file(name_or_file))
}

/// A snapshot name becomes part of a file name: refuse anything that could escape the directory or confuse tools.
pub fn validate_snapshot_name(name: &str) -> Result<()> {
    let bad = |reason| {
        Err(ReplicaError::InvalidName {
            name: name.to_owned(),
            reason,
        })
    };
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > MAX_NAME_LEN {
        return bad("longer than 200 bytes");
    }
    if name.contains('\0') {
        return bad("contains NUL");
    }
    if name.contains('/') || name.contains('\\') {
        return bad("contains a path separator");
    }
    if name == "." || name == ".." || name.contains("..") {
        return bad("contains '..'");
    }
    if name.starts_with('-') || name.starts_with('.') {
        return bad("starts with '-' or '.'");
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '+' | ':' | '@'))
    {
        return bad("only ASCII letters, digits and - _ . + : @ are allowed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_and_snapshot_names_round_trip() {
        assert_eq!(head_file(7), "volume-head-007.img");
        assert_eq!(head_index("volume-head-1234.img"), Some(1234));
        assert_eq!(snapshot_name(&snapshot_file("s1")), Some("s1"));
        assert_eq!(resolve_snapshot("s1").unwrap(), "volume-snap-s1.img");
        assert_eq!(
            resolve_snapshot("volume-snap-s1.img").unwrap(),
            "volume-snap-s1.img"
        );
    }

    #[test]
    fn path_tricks_in_snapshot_names_are_refused() {
        for bad in [
            "",
            "a/b",
            "..",
            "../x",
            "a\0b",
            ".hidden",
            "-rf",
            "a b",
            &"x".repeat(201),
        ] {
            assert!(validate_snapshot_name(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["s1", "backup-2026-01-01T00:00:00", "expand-4096", "c0ffee_1.2"] {
            validate_snapshot_name(good).unwrap();
        }
    }
}
