//! The sync protocol's wire types: routes, JSON messages, and the binary range-list body (documented in
//! `docs/formats.md` §4). The decoder is the only parser of untrusted bytes in the receiver and never panics.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// Route prefix; every route below lives under it.
pub const PREFIX: &str = "/v1/sync";
/// Magic opening every range-list body ("Corral Sync Ranges", version 1).
pub const RANGES_MAGIC: [u8; 4] = *b"CSR1";
/// Bytes before the first range: magic + little-endian u32 count.
pub const RANGES_HEADER: usize = 8;
/// Bytes per range: begin and end, little-endian u64 each.
pub const RANGE_ENTRY: usize = 16;
/// Upper bound of ranges in one body.
pub const MAX_RANGES: usize = 65536;
/// Upper bound of a data request's payload.
pub const MAX_PAYLOAD: u64 = 16 << 20;
/// Upper bound of a whole request body.
pub const MAX_BODY: usize = RANGES_HEADER + MAX_RANGES * RANGE_ENTRY + 16 * 1024 * 1024;

/// Query of `POST open`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OpenQuery {
    /// Size the receiver's file gets.
    pub size: u64,
    /// Write with `O_DIRECT` where offsets and lengths are 4 KiB-aligned.
    #[serde(default)]
    pub direct_io: bool,
}

/// Reply of `POST open`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct OpenReply {
    /// Identifies this transfer; every later request carries it.
    pub session: u64,
    /// The receiver already held content for this file (an older copy, or a partial transfer to resume): the
    /// sender compares checksums before sending data and sends holes. When false the file is all holes.
    pub existing: bool,
}

/// Query of `holes`, `data`, `checksum` and `close`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionQuery {
    /// From [`OpenReply::session`]; absent only on a `close` without `open` (whole-file skip).
    pub session: Option<u64>,
}

/// Reply of `POST checksum`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ChecksumReply {
    /// xxh3-128 (32 lower-case hex digits) of the concatenated content of the ranges, or `None` when some range
    /// is not entirely data on the receiver (then the sender must send it).
    pub xxh3_128: Option<String>,
}

/// A whole-file checksum as recorded beside a file; compared for whole-file skip, opaque otherwise.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileChecksum {
    /// How it was computed (e.g. `xxh3-128-layout`, `crc64`, `sha512`).
    pub method: String,
    /// The checksum, as its producer renders it.
    pub checksum: String,
}

/// Body of `POST close`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CloseRequest {
    /// The sender's recorded checksum, recorded beside the received file with its new ctime.
    pub checksum: Option<FileChecksum>,
}

/// Reply of `POST close`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CloseReply {
    /// The transfer was committed (false for a `close` without `open`).
    pub committed: bool,
    /// Data bytes received by this server over its lifetime.
    pub bytes_received: u64,
}

/// Error body of every non-2xx reply.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorBody {
    /// Stable kind: `bad-request`, `bad-range`, `no-session`, `stale-session`, `failed`, `no-space`, `io`,
    /// `not-recorded`.
    pub kind: String,
    /// Human-readable detail with offsets and paths.
    pub message: String,
}

/// Why a range-list body was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    /// The body does not start with [`RANGES_MAGIC`].
    #[error("body does not start with the range-list magic CSR1")]
    BadMagic,
    /// The body ends inside the range table.
    #[error("body of {have} bytes is shorter than its range table ({need} bytes)")]
    Truncated { need: u64, have: u64 },
    /// More ranges than [`MAX_RANGES`].
    #[error("{count} ranges in one body, at most {MAX_RANGES} allowed")]
    TooMany { count: u64 },
    /// A range with `end <= begin`.
    #[error("range #{index} {begin}..{end} is empty or reversed")]
    Reversed { index: usize, begin: u64, end: u64 },
    /// A range ends past the file size.
    #[error("range #{index} {begin}..{end} ends past the file size {size}")]
    PastEnd {
        index: usize,
        begin: u64,
        end: u64,
        size: u64,
    },
    /// A range starts before the previous one ends.
    #[error("range #{index} {begin}..{end} overlaps or precedes the previous range ending at {prev_end}")]
    Overlap {
        index: usize,
        begin: u64,
        end: u64,
        prev_end: u64,
    },
    /// The payload after the table is not the sum of the range lengths.
    #[error("payload holds {actual} bytes but the ranges announce {announced}")]
    PayloadLength { announced: u64, actual: u64 },
}

/// Appends the header and table of `ranges` to `out` (the payload, if any, follows).
pub fn encode_ranges(ranges: &[Range<u64>], out: &mut Vec<u8>) {
    out.extend_from_slice(&RANGES_MAGIC);
    let count = u32::try_from(ranges.len()).expect("range count bounded by MAX_RANGES");
    out.extend_from_slice(&count.to_le_bytes());
    for r in ranges {
        out.extend_from_slice(&r.start.to_le_bytes());
        out.extend_from_slice(&r.end.to_le_bytes());
    }
}

/// Decodes a range-list body for a file of `size` bytes: ranges must be non-empty, ascending, non-overlapping
/// and end within `size`; the payload must be exactly `expect_payload(sum of lengths)` bytes.
pub fn decode_ranges(
    body: &[u8],
    size: u64,
    with_payload: bool,
) -> Result<(Vec<Range<u64>>, &[u8]), RangeError> {
    let table_end = table_len(body)?;
    let (ranges, announced) = decode_table(&body[..table_end.min(body.len())], size)?;
    let payload = &body[table_end..];
    let expected = if with_payload { announced } else { 0 };
    if payload.len() as u64 != expected {
        return Err(RangeError::PayloadLength {
            announced: expected,
            actual: payload.len() as u64,
        });
    }
    Ok((ranges, payload))
}

/// Length of the header and range table a body starts with, read from its first [`RANGES_HEADER`] bytes; a
/// streaming reader calls it as soon as it holds them. Fails when `start` is too short to tell (`Truncated`),
/// lacks the magic, or announces more than [`MAX_RANGES`].
pub fn table_len(start: &[u8]) -> Result<usize, RangeError> {
    if start.len() < RANGES_HEADER {
        if start.len() >= 4 && start[..4] != RANGES_MAGIC {
            return Err(RangeError::BadMagic);
        }
        return Err(RangeError::Truncated {
            need: RANGES_HEADER as u64,
            have: start.len() as u64,
        });
    }
    if start[..4] != RANGES_MAGIC {
        return Err(RangeError::BadMagic);
    }
    let count = u32::from_le_bytes([start[4], start[5], start[6], start[7]]);
    let count = usize::try_from(count).map_err(|_| RangeError::TooMany {
        count: u64::from(count),
    })?;
    if count > MAX_RANGES {
        return Err(RangeError::TooMany { count: count as u64 });
    }
    Ok(RANGES_HEADER + count * RANGE_ENTRY)
}

/// Decodes the header and range table `table` (the first [`table_len`] bytes of a body, nothing after) for a
/// file of `size` bytes; returns the ranges and the payload bytes they announce.
pub fn decode_table(table: &[u8], size: u64) -> Result<(Vec<Range<u64>>, u64), RangeError> {
    let have = table.len() as u64;
    let table_end = table_len(table)?;
    if table.len() < table_end {
        return Err(RangeError::Truncated {
            need: table_end as u64,
            have,
        });
    }
    let count = (table_end - RANGES_HEADER) / RANGE_ENTRY;
    let mut ranges = Vec::with_capacity(count);
    let mut prev_end = 0u64;
    let mut announced = 0u64;
    for (index, entry) in table[RANGES_HEADER..table_end]
        .chunks_exact(RANGE_ENTRY)
        .enumerate()
    {
        let (b, e) = entry.split_at(8);
        let begin = u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
        let end = u64::from_le_bytes(e.try_into().unwrap_or([0; 8]));
        if end <= begin {
            return Err(RangeError::Reversed { index, begin, end });
        }
        if end > size {
            return Err(RangeError::PastEnd {
                index,
                begin,
                end,
                size,
            });
        }
        if index > 0 && begin < prev_end {
            return Err(RangeError::Overlap {
                index,
                begin,
                end,
                prev_end,
            });
        }
        prev_end = end;
        announced = announced.saturating_add(end - begin);
        ranges.push(begin..end);
    }
    Ok((ranges, announced))
}

#[cfg(test)]
// Fixtures spell ranges literally (single or reversed on purpose) and index small in-memory buffers.
#[allow(
    clippy::single_range_in_vec_init,
    clippy::reversed_empty_ranges,
    clippy::cast_possible_truncation
)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn body(ranges: &[Range<u64>], payload: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        encode_ranges(ranges, &mut b);
        b.extend_from_slice(payload);
        b
    }

    #[test]
    fn valid_body_round_trips() {
        let b = body(&[0..4, 10..12], b"abcdxy");
        let (r, p) = decode_ranges(&b, 12, true).unwrap();
        assert_eq!(r, vec![0..4, 10..12]);
        assert_eq!(p, b"abcdxy");
    }

    #[test]
    fn bad_ranges_are_refused_with_their_reason() {
        assert!(matches!(
            decode_ranges(&body(&[5..3], b""), 10, false),
            Err(RangeError::Reversed { .. })
        ));
        assert!(matches!(
            decode_ranges(&body(&[0..11], b""), 10, false),
            Err(RangeError::PastEnd { .. })
        ));
        assert!(matches!(
            decode_ranges(&body(&[0..5, 4..6], b""), 10, false),
            Err(RangeError::Overlap { .. })
        ));
        assert!(matches!(
            decode_ranges(&body(&[6..8, 0..2], b""), 10, false),
            Err(RangeError::Overlap { .. })
        ));
        assert!(matches!(
            decode_ranges(&body(&[0..4], b"abc"), 10, true),
            Err(RangeError::PayloadLength {
                announced: 4,
                actual: 3
            })
        ));
        assert!(matches!(
            decode_ranges(b"XXXX\0\0\0\0", 10, false),
            Err(RangeError::BadMagic)
        ));
        let mut truncated = body(&[0..4, 6..8], b"");
        truncated.truncate(20);
        assert!(matches!(
            decode_ranges(&truncated, 10, false),
            Err(RangeError::Truncated { .. })
        ));
    }

    proptest! {
        #[test]
        fn decoder_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..200), size: u64) {
            let _ = decode_ranges(&bytes, size, true);
            let mut with_magic = RANGES_MAGIC.to_vec();
            with_magic.extend_from_slice(&bytes);
            let _ = decode_ranges(&with_magic, size, false);
        }
    }
}
