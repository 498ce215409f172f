//! Stored block format: a fixed 52-byte header, then the payload (raw, lz4 or zstd).
//!
//! ```text
//! 0   8  magic "CRLBLK\0\x01"
//! 8   1  format version (1)
//! 9   1  compression: 0 none, 1 lz4, 2 zstd
//! 10  2  reserved (0)
//! 12  4  uncompressed length, LE
//! 16  4  payload length, LE
//! 20 32  SHA-256 of the uncompressed data (also the object's name)
//! ```
//!
//! A block is compressed only when that makes it smaller; every read decompresses and verifies the SHA-256.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Magic at the start of every stored block.
pub const BLOCK_MAGIC: [u8; 8] = *b"CRLBLK\0\x01";
/// Version of the stored block format.
pub const BLOCK_FORMAT_VERSION: u8 = 1;
/// Header length in bytes.
pub const BLOCK_HEADER_LEN: usize = 52;
const _: () = assert!(BLOCK_HEADER_LEN == 8 + 1 + 1 + 2 + 4 + 4 + 32);
/// Default block size of a backup volume (2 MiB).
pub const DEFAULT_BLOCK_SIZE: u64 = 2 << 20;
/// Largest block size a backup volume may use (16 MiB); also the bound on a stored block's uncompressed length.
pub const MAX_BLOCK_SIZE: u64 = 16 << 20;
/// Smallest block size (the replica's 4 KiB block).
pub const MIN_BLOCK_SIZE: u64 = corral_disk::BLOCK_SIZE;

/// Compression of a backup volume's blocks (a block is stored raw when compression does not shrink it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// Stored as is.
    None,
    /// LZ4 block format (fast; the default).
    #[default]
    Lz4,
    /// Zstandard level 3 (smaller, slower).
    Zstd,
}

impl Compression {
    fn code(self) -> u8 {
        match self {
            Self::None => 0,
            Self::Lz4 => 1,
            Self::Zstd => 2,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            0 => Self::None,
            1 => Self::Lz4,
            2 => Self::Zstd,
            _ => return None,
        })
    }
}

impl std::str::FromStr for Compression {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Self::None),
            "lz4" => Ok(Self::Lz4),
            "zstd" => Ok(Self::Zstd),
            _ => Err(format!("unknown compression {s:?} (none, lz4, zstd)")),
        }
    }
}

/// SHA-256 of `data`, lower-case hex: a block's identity.
pub fn block_hash(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// Sampled before compressing a block of more than [`SAMPLES`] × [`SAMPLE_LEN`] bytes.
const SAMPLES: usize = 8;
const SAMPLE_LEN: usize = 8 << 10;

/// Whether compressing `data` with `method` is worth trying: `SAMPLES` pieces of `SAMPLE_LEN` bytes spread
/// over the block are compressed first, and the whole block only when they shrink to less than 95 %. Random
/// (encrypted, already compressed) data then costs 64 KiB of compression per block instead of the whole block's;
/// a block compressible only between the samples is stored raw (larger, never wrong).
pub fn worth_compressing(data: &[u8], method: Compression) -> bool {
    if method == Compression::None {
        return false;
    }
    if data.len() <= SAMPLES * SAMPLE_LEN * 2 {
        return true;
    }
    let step = (data.len() - SAMPLE_LEN) / (SAMPLES - 1);
    let mut out = [0u8; SAMPLE_LEN + 1024];
    let compressed: usize = (0..SAMPLES)
        .map(|i| {
            let sample = &data[i * step..i * step + SAMPLE_LEN];
            match method {
                Compression::Lz4 => lz4_flex::block::compress_into(sample, &mut out).unwrap_or(SAMPLE_LEN),
                _ => zstd::bulk::compress_to_buffer(sample, &mut out[..], 3).unwrap_or(SAMPLE_LEN),
            }
        })
        .sum();
    compressed * 100 < SAMPLES * SAMPLE_LEN * 95
}

/// Room [`compress_into`] needs for `len` bytes of data (lz4's bound, above zstd's).
pub fn max_compressed_len(len: usize) -> usize {
    lz4_flex::block::get_maximum_output_size(len)
}

/// Compresses `data` into `out` (at least [`max_compressed_len`] bytes) and returns the payload's length when
/// that is smaller than `data`.
pub fn compress_into(data: &[u8], method: Compression, out: &mut [u8]) -> Option<usize> {
    match method {
        Compression::None => None,
        Compression::Lz4 => lz4_flex::block::compress_into(data, out).ok(),
        Compression::Zstd => zstd::bulk::compress_to_buffer(data, out, 3).ok(),
    }
    .filter(|&n| n < data.len())
}

/// The header of a stored block: `used` compression, `raw_len` bytes of data, `payload_len` stored after it.
pub fn block_header(
    used: Compression,
    raw_len: usize,
    payload_len: usize,
    hash: &str,
) -> [u8; BLOCK_HEADER_LEN] {
    let mut h = [0u8; BLOCK_HEADER_LEN];
    h[..8].copy_from_slice(&BLOCK_MAGIC);
    h[8] = BLOCK_FORMAT_VERSION;
    h[9] = used.code();
    h[12..16].copy_from_slice(&u32::try_from(raw_len).unwrap_or(u32::MAX).to_le_bytes());
    h[16..20].copy_from_slice(&u32::try_from(payload_len).unwrap_or(u32::MAX).to_le_bytes());
    // A hash that is not 64 hex digits cannot come from block_hash; keep zeros and let decode refuse it.
    let _ = hex::decode_to_slice(hash, &mut h[20..52]);
    h
}

/// The header of `data`'s stored block and its compressed payload, `None` when compression does not shrink it
/// (or [`worth_compressing`] says it would not; the payload is then `data` itself): a caller that writes header
/// and payload separately needs no encoded copy.
pub fn encode_parts(
    data: &[u8],
    hash: &str,
    method: Compression,
) -> ([u8; BLOCK_HEADER_LEN], Option<Vec<u8>>) {
    let compressed = if worth_compressing(data, method) {
        match method {
            Compression::None => None,
            Compression::Lz4 => Some(lz4_flex::block::compress(data)),
            Compression::Zstd => zstd::bulk::compress(data, 3).ok(),
        }
        .filter(|c| c.len() < data.len())
    } else {
        None
    };
    let (used, payload_len) = match &compressed {
        Some(c) => (method, c.len()),
        None => (Compression::None, data.len()),
    };
    (block_header(used, data.len(), payload_len, hash), compressed)
}

/// Encodes `data` (hash already computed) with `method`, falling back to raw when compression does not shrink it.
pub fn encode_block(data: &[u8], hash: &str, method: Compression) -> Vec<u8> {
    let (header, compressed) = encode_parts(data, hash, method);
    let payload = compressed.as_deref().unwrap_or(data);
    let mut out = Vec::with_capacity(BLOCK_HEADER_LEN + payload.len());
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    out
}

/// Checks a stored block's header against `hash` and the stored length: (compression, uncompressed length).
fn check_header(stored: &[u8], hash: &str) -> Result<(Compression, usize), String> {
    let h = stored
        .get(..BLOCK_HEADER_LEN)
        .ok_or_else(|| format!("{} bytes: shorter than the header", stored.len()))?;
    if h[..8] != BLOCK_MAGIC {
        return Err("bad magic".into());
    }
    if h[8] != BLOCK_FORMAT_VERSION {
        return Err(format!("unsupported block format version {}", h[8]));
    }
    let method = Compression::from_code(h[9]).ok_or_else(|| format!("unknown compression code {}", h[9]))?;
    let le32 = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let (raw_len, payload_len) = (le32(&h[12..16]), le32(&h[16..20]));
    // Bounded before anything is allocated for it: a hostile header must not make a restore allocate 4 GiB per block.
    if raw_len as u64 > MAX_BLOCK_SIZE {
        return Err(format!(
            "header says {raw_len} bytes, more than the largest block size {MAX_BLOCK_SIZE}"
        ));
    }
    let payload = stored.len() - BLOCK_HEADER_LEN;
    if payload != payload_len {
        return Err(format!("payload is {payload} bytes, header says {payload_len}"));
    }
    if hex::encode(&h[20..52]) != hash {
        return Err("header checksum differs from the block's name".into());
    }
    Ok((method, raw_len))
}

fn check_data(data: Vec<u8>, raw_len: usize, hash: &str) -> Result<Vec<u8>, String> {
    if data.len() != raw_len {
        return Err(format!(
            "{} bytes after decompression, header says {raw_len}",
            data.len()
        ));
    }
    let actual = block_hash(&data);
    if actual != hash {
        return Err(format!("checksum mismatch: data hashes to {actual}"));
    }
    Ok(data)
}

fn decompress(method: Compression, payload: &[u8], raw_len: usize) -> Result<Vec<u8>, String> {
    match method {
        Compression::None => Ok(payload.to_vec()),
        Compression::Lz4 => lz4_flex::block::decompress(payload, raw_len).map_err(|e| format!("lz4: {e}")),
        Compression::Zstd => zstd::bulk::decompress(payload, raw_len).map_err(|e| format!("zstd: {e}")),
    }
}

/// Decodes a stored block and verifies it against `hash`; the error text says what failed.
pub fn decode_block(stored: &[u8], hash: &str) -> Result<Vec<u8>, String> {
    let (method, raw_len) = check_header(stored, hash)?;
    check_data(
        decompress(method, &stored[BLOCK_HEADER_LEN..], raw_len)?,
        raw_len,
        hash,
    )
}

/// Whether a stored block's header says its payload is the data itself (not compressed); a block too short for a
/// header counts as raw (its decode fails anyway).
pub fn is_stored_raw(stored: &[u8]) -> bool {
    stored.get(9).is_none_or(|&c| c == Compression::None.code())
}

/// Verifies a stored block (`stored`: header and payload) against `hash` and returns its data: the payload itself
/// when it is stored raw (no copy), else decompressed into `scratch` (at least the block's length).
pub fn decode_into<'a>(stored: &'a [u8], hash: &str, scratch: &'a mut [u8]) -> Result<&'a [u8], String> {
    let (method, raw_len) = check_header(stored, hash)?;
    let payload = &stored[BLOCK_HEADER_LEN..];
    let data: &[u8] = match method {
        Compression::None => payload,
        m => {
            let out = scratch
                .get_mut(..raw_len)
                .ok_or_else(|| format!("header says {raw_len} bytes, more than the volume's block size"))?;
            let n = match m {
                Compression::Lz4 => {
                    lz4_flex::block::decompress_into(payload, out).map_err(|e| format!("lz4: {e}"))?
                }
                _ => zstd::bulk::decompress_to_buffer(payload, out).map_err(|e| format!("zstd: {e}"))?,
            };
            &out[..n]
        }
    };
    if data.len() != raw_len {
        return Err(format!(
            "{} bytes after decompression, header says {raw_len}",
            data.len()
        ));
    }
    let actual = block_hash(data);
    if actual != hash {
        return Err(format!("checksum mismatch: data hashes to {actual}"));
    }
    Ok(data)
}

/// [`decode_block`] of an owned buffer: a raw payload is moved to the front in place instead of copied into a
/// new allocation.
pub fn decode_block_owned(mut stored: Vec<u8>, hash: &str) -> Result<Vec<u8>, String> {
    let (method, raw_len) = check_header(&stored, hash)?;
    let data = match method {
        Compression::None => {
            stored.drain(..BLOCK_HEADER_LEN);
            stored
        }
        m => decompress(m, &stored[BLOCK_HEADER_LEN..], raw_len)?,
    };
    check_data(data, raw_len, hash)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_trip_and_compress_only_when_smaller() {
        let text = b"corral ".repeat(10_000);
        let noise: Vec<u8> = (0..70_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13).to_le_bytes()[0])
            .collect();
        for m in [Compression::None, Compression::Lz4, Compression::Zstd] {
            for data in [&text[..], &noise[..]] {
                let h = block_hash(data);
                let enc = encode_block(data, &h, m);
                assert!(enc.len() <= data.len() + BLOCK_HEADER_LEN);
                if m != Compression::None && data == &text[..] {
                    assert!(enc.len() < data.len() / 10, "{m:?} did not compress text");
                }
                assert_eq!(decode_block(&enc, &h).unwrap(), data);
                assert_eq!(decode_block_owned(enc.clone(), &h).unwrap(), data);
                let mut scratch = vec![0u8; data.len()];
                assert_eq!(decode_into(&enc, &h, &mut scratch).unwrap(), data);
            }
        }
    }

    #[test]
    fn random_blocks_skip_compression_and_compressible_ones_do_not() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let random: Vec<u8> = (0..2 << 20)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_le_bytes()[0]
            })
            .collect();
        let mut half = random.clone();
        half[1 << 20..].fill(0);
        let text = b"corral ".repeat(300_000);
        for m in [Compression::Lz4, Compression::Zstd] {
            assert!(!worth_compressing(&random, m), "{m:?}: random data");
            assert!(worth_compressing(&half, m), "{m:?}: half zeros");
            assert!(worth_compressing(&text, m), "{m:?}: text");
            let mut out = vec![0u8; max_compressed_len(half.len())];
            let n = compress_into(&half, m, &mut out).expect("half zeros compress");
            let h = block_hash(&half);
            let stored = [&block_header(m, half.len(), n, &h)[..], &out[..n]].concat();
            let mut scratch = vec![0u8; half.len()];
            assert_eq!(decode_into(&stored, &h, &mut scratch).unwrap(), &half[..]);
            assert!(compress_into(&random, m, &mut out).is_none(), "{m:?}");
        }
        assert!(!worth_compressing(&text, Compression::None));
        // A raw block decodes to its own payload, without the scratch buffer.
        let h = block_hash(&random);
        let stored = encode_block(&random, &h, Compression::Lz4);
        assert!(is_stored_raw(&stored));
        let data = decode_into(&stored, &h, &mut []).unwrap();
        assert_eq!(data, &random[..]);
        assert_eq!(data.as_ptr(), stored[BLOCK_HEADER_LEN..].as_ptr());
    }

    #[test]
    fn a_flipped_byte_anywhere_is_detected() {
        let data = b"abc".repeat(5000);
        let h = block_hash(&data);
        let enc = encode_block(&data, &h, Compression::Lz4);
        for pos in [0, 9, 13, 25, BLOCK_HEADER_LEN + 3, enc.len() - 1] {
            let mut bad = enc.clone();
            bad[pos] ^= 0x40;
            assert!(decode_block(&bad, &h).is_err(), "flip at {pos} not detected");
            assert!(
                decode_into(&bad, &h, &mut vec![0u8; data.len()]).is_err(),
                "flip at {pos} not detected (into)"
            );
            assert!(
                decode_block_owned(bad, &h).is_err(),
                "flip at {pos} not detected (owned)"
            );
        }
        assert!(decode_block(&enc[..10], &h).is_err());
    }

    #[test]
    fn a_hostile_uncompressed_length_is_refused_before_allocating() {
        let data = b"abc".repeat(5000);
        let h = block_hash(&data);
        let mut enc = encode_block(&data, &h, Compression::Lz4);
        enc[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        let e = decode_block(&enc, &h).unwrap_err();
        assert!(e.contains("largest block size"), "{e}");
    }
}
