//! The little-endian byte codec of every metadata structure (superblock, image, journal records). Hand-written
//! rather than serde so that the parser of bytes read from a disk is small, bounded and fuzzable: every read is
//! checked against the remaining input, every length against a limit, and nothing is allocated before its length
//! was checked against the bytes actually present.

use crate::error::FormatError;

/// Appends fields to a byte vector.
#[derive(Default)]
pub(crate) struct Encoder {
    pub(crate) buf: Vec<u8>,
}

impl Encoder {
    pub(crate) fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn raw(&mut self, v: &[u8]) {
        self.buf.extend_from_slice(v);
    }
    /// A length-prefixed byte string (u32 length).
    pub(crate) fn bytes(&mut self, v: &[u8]) {
        #[allow(clippy::cast_possible_truncation)] // every encoded byte string is bounded far below 4 GiB
        self.u32(v.len() as u32);
        self.raw(v);
    }
    pub(crate) fn str(&mut self, v: &str) {
        self.bytes(v.as_bytes());
    }
}

/// Reads fields from a byte slice; every read fails cleanly past the end.
pub(crate) struct Decoder<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Decoder<'a> {
    pub(crate) fn new(buf: &'a [u8], what: &'static str) -> Self {
        Self { buf, pos: 0, what }
    }
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }
    pub(crate) fn raw(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        if n > self.remaining() {
            return Err(FormatError::Truncated {
                what: self.what,
                at: self.pos,
                need: n,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, FormatError> {
        Ok(self.raw(1)?[0])
    }
    pub(crate) fn u32(&mut self) -> Result<u32, FormatError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.raw(4)?);
        Ok(u32::from_le_bytes(b))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, FormatError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.raw(8)?);
        Ok(u64::from_le_bytes(b))
    }
    /// A length-prefixed byte string of at most `max` bytes.
    pub(crate) fn bytes(&mut self, max: usize) -> Result<&'a [u8], FormatError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(FormatError::Invalid(format!(
                "{}: a field of {n} bytes at {} exceeds its limit of {max}",
                self.what, self.pos
            )));
        }
        self.raw(n)
    }
    pub(crate) fn str(&mut self, max: usize) -> Result<String, FormatError> {
        let b = self.bytes(max)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| FormatError::Invalid(format!("{}: a name is not UTF-8", self.what)))
    }
    /// A count of items each at least `min_item` bytes long: refused when the input cannot hold that many, so a
    /// hostile count never drives an allocation.
    pub(crate) fn count(&mut self, min_item: usize) -> Result<usize, FormatError> {
        let n = self.u64()?;
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        if n.saturating_mul(min_item.max(1)) > self.remaining() {
            return Err(FormatError::Invalid(format!(
                "{}: count {n} at {} cannot fit in the {} bytes left",
                self.what,
                self.pos,
                self.remaining()
            )));
        }
        Ok(n)
    }
}

/// The checksum of every metadata structure: xxh3-64 (fast; these guard against torn and stale writes, not
/// against an adversary).
pub fn checksum(b: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(b)
}
