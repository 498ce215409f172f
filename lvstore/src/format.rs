//! The on-disk layout (documented in `docs/formats.md`, "lvstore"): two superblock slots, two metadata image
//! areas used alternately (shadow paging), a journal of metadata operations, then the data clusters.
//!
//! ```text
//! 0        4096      8192            8192+M          8192+2M             data_off (cluster aligned)
//! | sb slot 0 | sb slot 1 | image area 0 | image area 1 | journal (J bytes) | cluster 0 | cluster 1 | ...
//! ```
//!
//! Superblock generation `g` lives in slot `g % 2` and names the image area holding the checkpoint of
//! generation `g`; journal records carry `g` and a sequence number, so records of an older generation are never
//! replayed.

pub use crate::codec::checksum;
use crate::codec::{Decoder, Encoder};
use crate::error::FormatError;

/// The superblock magic.
pub const MAGIC: [u8; 8] = *b"CRLVSTOR";
/// The format version this build writes and reads.
pub const VERSION: u32 = 1;
/// One superblock slot; also the alignment of every metadata write (O_DIRECT).
pub const SB_SLOT: u64 = 4096;
/// [`SB_SLOT`] as a buffer length.
pub const SB_SLOT_BYTES: usize = 4096;
/// The metadata IO alignment.
pub const META_ALIGN: u64 = 4096;
/// [`META_ALIGN`] as a buffer length.
pub const META_ALIGN_BYTES: usize = 4096;
/// Where the image areas start.
pub const AREAS_OFF: u64 = 2 * SB_SLOT;
/// Magic of a metadata image.
pub const IMAGE_MAGIC: [u8; 8] = *b"CLVIMAGE";
/// Magic of a journal record.
pub const RECORD_MAGIC: [u8; 4] = *b"CLVJ";
/// Journal record header bytes: magic, generation, sequence, payload length, checksum.
pub const RECORD_HEADER: usize = 4 + 8 + 8 + 4 + 8;
/// The smallest and largest cluster size.
pub const MIN_CLUSTER: u64 = 32 << 10;
/// See [`MIN_CLUSTER`].
pub const MAX_CLUSTER: u64 = 64 << 20;

/// The superblock: where everything is, and which checkpoint is current.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub version: u32,
    pub store_uuid: [u8; 16],
    pub cluster_size: u64,
    /// Device length when formatted; a shorter device is refused at open.
    pub device_len: u64,
    pub meta_area_len: u64,
    pub journal_off: u64,
    pub journal_len: u64,
    pub data_off: u64,
    pub cluster_count: u64,
    pub generation: u64,
    /// Bytes of the checkpoint image in area `generation % 2`.
    pub image_len: u64,
    pub image_sum: u64,
}

impl Superblock {
    /// The offset of image area `generation % 2`.
    pub fn image_off(&self) -> u64 {
        AREAS_OFF + (self.generation % 2) * self.meta_area_len
    }

    /// The slot this generation is written to.
    pub fn slot_off(&self) -> u64 {
        (self.generation % 2) * SB_SLOT
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.raw(&MAGIC);
        e.u32(self.version);
        e.raw(&self.store_uuid);
        for v in [
            self.cluster_size,
            self.device_len,
            self.meta_area_len,
            self.journal_off,
            self.journal_len,
            self.data_off,
            self.cluster_count,
            self.generation,
            self.image_len,
            self.image_sum,
        ] {
            e.u64(v);
        }
        let sum = checksum(&e.buf);
        e.u64(sum);
        let mut b = e.buf;
        b.resize(SB_SLOT_BYTES, 0);
        b
    }

    /// Parses one slot. `Ok(None)`: no magic (never written, or not an lvstore). A version above [`VERSION`]
    /// is reported as such before anything else is looked at: a newer layout need not parse as this one.
    pub fn decode(b: &[u8]) -> Result<Option<Superblock>, SuperblockError> {
        let mut d = Decoder::new(b, "superblock");
        let magic = d.raw(8).map_err(SuperblockError::Format)?;
        if magic != MAGIC {
            return Ok(None);
        }
        let version = d.u32().map_err(SuperblockError::Format)?;
        if version > VERSION {
            return Err(SuperblockError::Newer(version));
        }
        let parse = |d: &mut Decoder| -> Result<Superblock, FormatError> {
            let mut store_uuid = [0u8; 16];
            store_uuid.copy_from_slice(d.raw(16)?);
            let sb = Superblock {
                version,
                store_uuid,
                cluster_size: d.u64()?,
                device_len: d.u64()?,
                meta_area_len: d.u64()?,
                journal_off: d.u64()?,
                journal_len: d.u64()?,
                data_off: d.u64()?,
                cluster_count: d.u64()?,
                generation: d.u64()?,
                image_len: d.u64()?,
                image_sum: d.u64()?,
            };
            let end = d.pos();
            let sum = d.u64()?;
            if sum != checksum(&b[..end]) {
                return Err(FormatError::Invalid("superblock checksum mismatch".into()));
            }
            sb.validate()?;
            Ok(sb)
        };
        parse(&mut d).map(Some).map_err(SuperblockError::Format)
    }

    /// The layout rules every superblock obeys: a superblock that breaks one is damaged, and nothing it points
    /// to is read.
    pub fn validate(&self) -> Result<(), FormatError> {
        let bad = |m: String| Err(FormatError::Invalid(m));
        if !self.cluster_size.is_power_of_two() || !(MIN_CLUSTER..=MAX_CLUSTER).contains(&self.cluster_size) {
            return bad(format!(
                "cluster size {} is not a power of two in 32 KiB..64 MiB",
                self.cluster_size
            ));
        }
        if self.meta_area_len == 0 || !self.meta_area_len.is_multiple_of(META_ALIGN) {
            return bad(format!(
                "metadata area length {} is not a positive multiple of 4096",
                self.meta_area_len
            ));
        }
        let journal_off = self
            .meta_area_len
            .checked_mul(2)
            .and_then(|m| m.checked_add(AREAS_OFF));
        if journal_off != Some(self.journal_off) {
            return bad("journal offset does not follow the image areas".into());
        }
        if self.journal_len < 2 * META_ALIGN || !self.journal_len.is_multiple_of(META_ALIGN) {
            return bad(format!(
                "journal length {} is not a multiple of 4096 of at least 8192",
                self.journal_len
            ));
        }
        let data = self
            .journal_off
            .checked_add(self.journal_len)
            .map(|end| end.next_multiple_of(self.cluster_size));
        if data != Some(self.data_off) {
            return bad("data offset does not follow the journal".into());
        }
        let end = self
            .cluster_count
            .checked_mul(self.cluster_size)
            .and_then(|b| b.checked_add(self.data_off));
        match end {
            Some(end) if end <= self.device_len => {}
            _ => return bad("clusters extend past the device length".into()),
        }
        if self.image_len > self.meta_area_len {
            return bad(format!("image length {} exceeds its area", self.image_len));
        }
        Ok(())
    }

    /// 4 KiB blocks per cluster.
    pub fn blocks_per_cluster(&self) -> u64 {
        self.cluster_size / corral_disk::BLOCK_SIZE
    }
}

/// Why a superblock slot was refused.
#[derive(Debug)]
pub enum SuperblockError {
    Newer(u32),
    Format(FormatError),
}

/// The payload of the journal record at the start of `b` and the record's padded length, when it is record `seq`
/// of `generation` of the store `store_uuid`; `None` ends the journal.
pub fn decode_record<'a>(
    b: &'a [u8],
    store_uuid: &[u8; 16],
    generation: u64,
    seq: u64,
) -> Option<(&'a [u8], usize)> {
    let mut d = Decoder::new(b, "journal record");
    if d.raw(4).ok()? != RECORD_MAGIC {
        return None;
    }
    let g = d.u64().ok()?;
    let s = d.u64().ok()?;
    let len = d.u32().ok()? as usize;
    let sum = d.u64().ok()?;
    if g != generation || s != seq {
        return None;
    }
    let payload = d.raw(len).ok()?;
    let mut h = Encoder::default();
    h.raw(store_uuid);
    h.u64(g);
    h.u64(s);
    h.bytes(payload);
    if checksum(&h.buf) != sum {
        return None;
    }
    let total = (RECORD_HEADER + len).next_multiple_of(META_ALIGN_BYTES);
    Some((payload, total))
}

/// A journal record holding `payload`, padded to 4 KiB. The checksum covers the store's uuid, so records left
/// by an earlier store on the same device (a forced format restarts the generations) are never replayed.
pub fn encode_record(store_uuid: &[u8; 16], generation: u64, seq: u64, payload: &[u8]) -> Vec<u8> {
    let mut h = Encoder::default();
    h.raw(store_uuid);
    h.u64(generation);
    h.u64(seq);
    h.bytes(payload);
    let sum = checksum(&h.buf);
    let mut e = Encoder::default();
    e.raw(&RECORD_MAGIC);
    e.u64(generation);
    e.u64(seq);
    #[allow(clippy::cast_possible_truncation)] // bounded by the journal length
    e.u32(payload.len() as u32);
    e.u64(sum);
    e.raw(payload);
    let mut b = e.buf;
    b.resize(b.len().next_multiple_of(META_ALIGN_BYTES), 0);
    b
}

/// Bytes a metadata area needs: a base for lvols, names and xattrs plus one cluster-map entry per cluster.
pub fn default_meta_area(cluster_count: u64, cluster_size: u64) -> u64 {
    ((4 << 20) + cluster_count * entry_bytes(cluster_size)).next_multiple_of(META_ALIGN)
}

/// Bytes of one cluster-map entry in the image: logical and physical cluster, and the block bitmap.
pub fn entry_bytes(cluster_size: u64) -> u64 {
    16 + cluster_size / corral_disk::BLOCK_SIZE / 8
}
