//! The qcow2 header (versions 2 and 3) and its extensions, parsed from the image's first cluster and validated
//! against the file's length before anything else is read. Every offset the reader later follows is either
//! checked here (L1 table, refcount table, backing file name) or when its table is loaded.

/// `QFI\xfb`.
pub(crate) const MAGIC: [u8; 4] = *b"QFI\xfb";
/// Bytes of the version 2 header; version 3 headers are at least [`V3_HEADER_LEN`].
pub(crate) const V2_HEADER_LEN: usize = 72;
pub(crate) const V3_HEADER_LEN: usize = 104;
/// Smallest and largest cluster sizes qemu creates (512 B, 2 MiB).
pub(crate) const MIN_CLUSTER_BITS: u32 = 9;
pub(crate) const MAX_CLUSTER_BITS: u32 = 21;
/// qemu's limits: 32 MiB of L1 table, 8 MiB of refcount table, 1023-byte backing file names.
const MAX_L1_BYTES: u64 = 32 << 20;
const MAX_REFTABLE_BYTES: u64 = 8 << 20;
const MAX_BACKING_NAME: u32 = 1023;
/// Virtual sizes above 2^61 bytes cannot be addressed by qcow2's 56-bit host offsets in practice (qemu's limit).
const MAX_VIRTUAL_SIZE: u64 = 1 << 61;

pub(crate) const INCOMPAT_DIRTY: u64 = 1 << 0;
pub(crate) const INCOMPAT_CORRUPT: u64 = 1 << 1;
pub(crate) const INCOMPAT_DATA_FILE: u64 = 1 << 2;
pub(crate) const INCOMPAT_COMPRESSION: u64 = 1 << 3;
pub(crate) const INCOMPAT_EXTL2: u64 = 1 << 4;

const EXT_END: u32 = 0;
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;

/// Why a header is refused: damaged, or valid but using something we do not read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    Corrupt(String),
    Unsupported(String),
}

fn corrupt<T>(reason: impl Into<String>) -> Result<T, Refusal> {
    Err(Refusal::Corrupt(reason.into()))
}

fn unsupported<T>(feature: impl Into<String>) -> Result<T, Refusal> {
    Err(Refusal::Unsupported(feature.into()))
}

/// A validated qcow2 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) version: u32,
    pub(crate) cluster_bits: u32,
    pub(crate) size: u64,
    pub(crate) l1_size: u32,
    pub(crate) l1_table_offset: u64,
    pub(crate) refcount_table_offset: u64,
    pub(crate) refcount_table_clusters: u32,
    pub(crate) refcount_order: u32,
    /// Incompatible feature bits (only `dirty` can be set on an accepted image).
    pub(crate) incompatible: u64,
    /// Backing file name as recorded (relative names are relative to the image's directory).
    pub(crate) backing_file: Option<String>,
    /// Backing file format from the header extension (`raw`, `qcow2`), if recorded.
    pub(crate) backing_format: Option<String>,
}

impl Header {
    pub(crate) fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// L2 entries per table (a table is one cluster of 8-byte entries).
    pub(crate) fn l2_bits(&self) -> u32 {
        self.cluster_bits - 3
    }
}

struct Be<'a>(&'a [u8]);

impl Be<'_> {
    fn u32(&self, at: usize) -> Result<u32, Refusal> {
        match self.0.get(at..at + 4) {
            Some(s) => Ok(u32::from_be_bytes([s[0], s[1], s[2], s[3]])),
            None => corrupt(format!("header truncated at byte {at}")),
        }
    }
    fn u64(&self, at: usize) -> Result<u64, Refusal> {
        match self.0.get(at..at + 8) {
            Some(s) => {
                let mut b = [0u8; 8];
                b.copy_from_slice(s);
                Ok(u64::from_be_bytes(b))
            }
            None => corrupt(format!("header truncated at byte {at}")),
        }
    }
}

/// Reads just enough of the header to know how many bytes [`parse`] needs: the first cluster, at most 2 MiB.
pub(crate) fn cluster_bits_of(start: &[u8]) -> Result<u32, Refusal> {
    let b = Be(start);
    if start.get(..4) != Some(&MAGIC[..]) {
        return corrupt("no qcow2 magic");
    }
    let bits = b.u32(20)?;
    if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&bits) {
        return corrupt(format!(
            "cluster_bits {bits} outside {MIN_CLUSTER_BITS}..={MAX_CLUSTER_BITS}"
        ));
    }
    Ok(bits)
}

fn to_usize(v: u64) -> Result<usize, Refusal> {
    usize::try_from(v).or_else(|_| corrupt(format!("{v} does not fit in memory")))
}

fn check_range(what: &str, offset: u64, len: u64, file_len: u64) -> Result<(), Refusal> {
    match offset.checked_add(len) {
        Some(end) if end <= file_len => Ok(()),
        _ => corrupt(format!(
            "{what} at offset {offset} ({len} bytes) extends past the end of the file ({file_len} bytes)"
        )),
    }
}

/// Parses and validates a header. `first` holds the file's first cluster (or the whole file if shorter);
/// `file_len` is the file's length. Nothing outside `first` is touched.
pub(crate) fn parse(first: &[u8], file_len: u64) -> Result<Header, Refusal> {
    let b = Be(first);
    if first.len() < V2_HEADER_LEN {
        return corrupt(format!(
            "file is {} bytes, shorter than a qcow2 header",
            first.len()
        ));
    }
    let cluster_bits = cluster_bits_of(first)?;
    let cluster_size = 1u64 << cluster_bits;
    let version = b.u32(4)?;
    if version != 2 && version != 3 {
        return unsupported(format!("qcow2 version {version} (2 and 3 are read)"));
    }
    let backing_file_offset = b.u64(8)?;
    let backing_file_size = b.u32(16)?;
    let size = b.u64(24)?;
    let crypt_method = b.u32(32)?;
    let l1_size = b.u32(36)?;
    let l1_table_offset = b.u64(40)?;
    let refcount_table_offset = b.u64(48)?;
    let refcount_table_clusters = b.u32(56)?;

    let (incompatible, refcount_order, header_length, compression_type) = if version == 3 {
        let header_length = b.u32(100)?;
        if (header_length as usize) < V3_HEADER_LEN || u64::from(header_length) > cluster_size {
            return corrupt(format!(
                "header_length {header_length} outside {V3_HEADER_LEN}..={cluster_size}"
            ));
        }
        let compression_type = if header_length > 104 {
            *first
                .get(104)
                .ok_or_else(|| Refusal::Corrupt("header truncated at byte 104".into()))?
        } else {
            0
        };
        (b.u64(72)?, b.u32(96)?, header_length as usize, compression_type)
    } else {
        (0, 4, V2_HEADER_LEN, 0)
    };

    check_features(crypt_method, incompatible, compression_type)?;
    if refcount_order > 6 {
        return corrupt(format!("refcount_order {refcount_order} above 6"));
    }
    if size > MAX_VIRTUAL_SIZE {
        return corrupt(format!("virtual size {size} above 2^61"));
    }

    check_tables(
        &Tables {
            cluster_bits,
            size,
            l1_size,
            l1_table_offset,
            refcount_table_offset,
            refcount_table_clusters,
        },
        file_len,
    )?;

    let backing_file = backing_file_name(first, backing_file_offset, backing_file_size, cluster_size)?;

    let backing_format = parse_extensions(first, header_length, cluster_size)?;

    Ok(Header {
        version,
        cluster_bits,
        size,
        l1_size,
        l1_table_offset,
        refcount_table_offset,
        refcount_table_clusters,
        refcount_order,
        incompatible,
        backing_file,
        backing_format,
    })
}

/// Encryption, the corrupt bit, and the incompatible features: what the reader cannot read is refused by name.
fn check_features(crypt_method: u32, incompatible: u64, compression_type: u8) -> Result<(), Refusal> {
    match crypt_method {
        0 => {}
        1 => return unsupported("AES encryption (crypt_method 1)"),
        2 => return unsupported("LUKS encryption (crypt_method 2)"),
        m => return unsupported(format!("encryption method {m}")),
    }
    if incompatible & INCOMPAT_CORRUPT != 0 {
        return corrupt("the image is marked corrupt by qemu (repair it with `qemu-img check -r all`)");
    }
    if incompatible & INCOMPAT_DATA_FILE != 0 {
        return unsupported("external data file (data-file=...)");
    }
    if incompatible & INCOMPAT_EXTL2 != 0 {
        return unsupported("extended L2 entries (subclusters, extended_l2=on)");
    }
    match (incompatible & INCOMPAT_COMPRESSION != 0, compression_type) {
        (_, 0) => {}
        (true, 1) => {
            return unsupported(
                "zstd compression (compression_type=zstd); convert with `qemu-img convert -O qcow2`",
            );
        }
        (true, t) => return unsupported(format!("compression type {t}")),
        (false, t) => {
            return corrupt(format!(
                "compression type {t} without its incompatible feature bit"
            ));
        }
    }
    let known =
        INCOMPAT_DIRTY | INCOMPAT_CORRUPT | INCOMPAT_DATA_FILE | INCOMPAT_COMPRESSION | INCOMPAT_EXTL2;
    if incompatible & !known != 0 {
        return unsupported(format!(
            "unknown incompatible feature bits {:#x}",
            incompatible & !known
        ));
    }
    Ok(())
}

/// The header fields that place the L1 and refcount tables.
#[derive(Clone, Copy)]
struct Tables {
    cluster_bits: u32,
    size: u64,
    l1_size: u32,
    l1_table_offset: u64,
    refcount_table_offset: u64,
    refcount_table_clusters: u32,
}

/// The L1 table maps the virtual size within qemu's limits, and both tables are cluster aligned inside the file.
fn check_tables(t: &Tables, file_len: u64) -> Result<(), Refusal> {
    // L1: large enough for the virtual size, within qemu's limit, cluster aligned, inside the file.
    let Tables {
        cluster_bits,
        size,
        l1_size,
        l1_table_offset,
        refcount_table_offset,
        refcount_table_clusters,
    } = *t;
    let cluster_size = 1u64 << cluster_bits;
    let l2_bits = cluster_bits - 3;
    let bytes_per_l1_entry = 1u64 << (cluster_bits + l2_bits);
    let needed = size.div_ceil(bytes_per_l1_entry);
    if u64::from(l1_size) < needed {
        return corrupt(format!(
            "L1 table of {l1_size} entries cannot map the virtual size {size} ({needed} needed)"
        ));
    }
    let l1_bytes = u64::from(l1_size) * 8;
    if l1_bytes > MAX_L1_BYTES {
        return corrupt(format!("L1 table of {l1_bytes} bytes above qemu's 32 MiB limit"));
    }
    if l1_size > 0 {
        if !l1_table_offset.is_multiple_of(cluster_size) || l1_table_offset == 0 {
            return corrupt(format!(
                "L1 table offset {l1_table_offset} is not a non-zero multiple of the cluster size"
            ));
        }
        check_range("L1 table", l1_table_offset, l1_bytes, file_len)?;
    }

    // Refcount table: unused for reading, but a damaged one is a damaged image. Entries are checked on open.
    let reftable_bytes = u64::from(refcount_table_clusters) * cluster_size;
    if reftable_bytes > MAX_REFTABLE_BYTES {
        return corrupt(format!(
            "refcount table of {reftable_bytes} bytes above qemu's 8 MiB limit"
        ));
    }
    if refcount_table_clusters > 0 {
        if !refcount_table_offset.is_multiple_of(cluster_size) || refcount_table_offset == 0 {
            return corrupt(format!(
                "refcount table offset {refcount_table_offset} is not a non-zero multiple of the cluster size"
            ));
        }
        check_range("refcount table", refcount_table_offset, reftable_bytes, file_len)?;
    }
    Ok(())
}

/// The backing file name (`offset` 0: none): 1..=1023 bytes of UTF-8 inside the first cluster.
fn backing_file_name(
    first: &[u8],
    offset: u64,
    len: u32,
    cluster_size: u64,
) -> Result<Option<String>, Refusal> {
    if offset == 0 {
        return Ok(None);
    }
    let (backing_file_offset, backing_file_size) = (offset, len);
    if backing_file_size == 0 || backing_file_size > MAX_BACKING_NAME {
        return corrupt(format!(
            "backing file name length {backing_file_size} outside 1..={MAX_BACKING_NAME}"
        ));
    }
    let end = backing_file_offset.saturating_add(u64::from(backing_file_size));
    if end > cluster_size || end > first.len() as u64 {
        return corrupt(format!(
            "backing file name at {backing_file_offset} ({backing_file_size} bytes) is outside the first cluster"
        ));
    }
    let raw = &first[to_usize(backing_file_offset)?..to_usize(end)?];
    match std::str::from_utf8(raw) {
        Ok(s) if !s.contains('\0') => Ok(Some(s.to_owned())),
        _ => unsupported("backing file name that is not UTF-8 text"),
    }
}

/// Walks the header extensions (they end at an end marker or at the end of the first cluster) and returns the
/// backing format, the only one the reader needs.
fn parse_extensions(first: &[u8], start: usize, cluster_size: u64) -> Result<Option<String>, Refusal> {
    let b = Be(first);
    let end = first.len().min(to_usize(cluster_size)?);
    let mut at = start;
    let mut backing_format = None;
    while at + 8 <= end {
        let ty = b.u32(at)?;
        let len = b.u32(at + 4)? as usize;
        if ty == EXT_END {
            break;
        }
        let data_start = at + 8;
        let Some(data_end) = data_start.checked_add(len).filter(|e| *e <= end) else {
            return corrupt(format!(
                "header extension {ty:#x} at {at} ({len} bytes) runs past the first cluster"
            ));
        };
        if ty == EXT_BACKING_FORMAT {
            match std::str::from_utf8(&first[data_start..data_end]) {
                Ok(s) => backing_format = Some(s.trim_end_matches('\0').to_owned()),
                Err(_) => return corrupt("backing format extension is not UTF-8"),
            }
        }
        at = data_start + len.div_ceil(8) * 8;
    }
    Ok(backing_format)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal valid v3 header for a 1 MiB image with 64 KiB clusters: L1 at cluster 3, refcount table at 1.
    pub(crate) fn v3_header() -> Vec<u8> {
        let mut h = vec![0u8; 65536];
        h[..4].copy_from_slice(&MAGIC);
        h[4..8].copy_from_slice(&3u32.to_be_bytes());
        h[20..24].copy_from_slice(&16u32.to_be_bytes());
        h[24..32].copy_from_slice(&(1u64 << 20).to_be_bytes());
        h[36..40].copy_from_slice(&1u32.to_be_bytes());
        h[40..48].copy_from_slice(&(3u64 << 16).to_be_bytes());
        h[48..56].copy_from_slice(&(1u64 << 16).to_be_bytes());
        h[56..60].copy_from_slice(&1u32.to_be_bytes());
        h[96..100].copy_from_slice(&4u32.to_be_bytes());
        h[100..104].copy_from_slice(&104u32.to_be_bytes());
        h
    }

    #[test]
    fn a_valid_header_parses() {
        let h = parse(&v3_header(), 4 << 16).unwrap();
        assert_eq!(
            (h.version, h.cluster_bits, h.size, h.l1_size),
            (3, 16, 1 << 20, 1)
        );
    }

    #[test]
    fn l1_table_past_the_end_of_the_file_is_corrupt() {
        let e = parse(&v3_header(), 3 << 16).unwrap_err();
        assert!(
            matches!(&e, Refusal::Corrupt(r) if r.contains("L1 table")),
            "{e:?}"
        );
    }

    #[test]
    fn features_are_refused_by_name() {
        let mut h = v3_header();
        h[32..36].copy_from_slice(&2u32.to_be_bytes());
        assert!(matches!(parse(&h, 4 << 16), Err(Refusal::Unsupported(f)) if f.contains("LUKS")));
        let mut h = v3_header();
        h[79] = 1 << 3;
        h[100..104].copy_from_slice(&112u32.to_be_bytes());
        h[104] = 1;
        assert!(matches!(parse(&h, 4 << 16), Err(Refusal::Unsupported(f)) if f.contains("zstd")));
        let mut h = v3_header();
        h[79] = 1 << 2;
        assert!(
            matches!(parse(&h, 4 << 16), Err(Refusal::Unsupported(f)) if f.contains("external data file"))
        );
        let mut h = v3_header();
        h[72] = 0x80;
        assert!(matches!(parse(&h, 4 << 16), Err(Refusal::Unsupported(f)) if f.contains("unknown")));
    }

    #[test]
    fn truncated_or_absurd_headers_are_refused() {
        assert!(parse(&v3_header()[..50], 50).is_err());
        let mut h = v3_header();
        h[20..24].copy_from_slice(&40u32.to_be_bytes());
        assert!(matches!(parse(&h, 4 << 16), Err(Refusal::Corrupt(_))));
        let mut h = v3_header();
        h[24..32].copy_from_slice(&u64::MAX.to_be_bytes());
        assert!(matches!(parse(&h, 4 << 16), Err(Refusal::Corrupt(_))));
        let mut h = v3_header();
        h[8..16].copy_from_slice(&65530u64.to_be_bytes());
        h[16..20].copy_from_slice(&100u32.to_be_bytes());
        assert!(matches!(parse(&h, 4 << 16), Err(Refusal::Corrupt(r)) if r.contains("backing file name")));
    }
}
