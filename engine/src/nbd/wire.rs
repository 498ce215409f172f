//! NBD wire format: magic numbers, option and command codes, the fixed-size headers and their
//! parsers/encoders.
//!
//! Every value is big-endian ("network byte order"). The parsers take fixed-size arrays, so they cannot read
//! out of bounds, and return typed errors for anything a hostile peer can send; they never panic (fuzzed by
//! `engine/fuzz`, target `nbd_request`).

use thiserror::Error;

/// `NBDMAGIC`, first thing the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle negotiation marker, also the prefix of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Prefix of every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Prefix of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Prefix of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Prefix of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Server handshake flag: fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Server handshake flag: no 124 zero bytes after NBD_OPT_EXPORT_NAME.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: no zeroes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Option codes.
pub mod opt {
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const LIST: u32 = 3;
    pub const STARTTLS: u32 = 5;
    pub const INFO: u32 = 6;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const LIST_META_CONTEXT: u32 = 9;
    pub const SET_META_CONTEXT: u32 = 10;
}

/// Option reply types.
pub mod rep {
    pub const ACK: u32 = 1;
    pub const SERVER: u32 = 2;
    pub const INFO: u32 = 3;
    pub const META_CONTEXT: u32 = 4;
    pub const ERR_UNSUP: u32 = (1 << 31) + 1;
    pub const ERR_POLICY: u32 = (1 << 31) + 2;
    pub const ERR_INVALID: u32 = (1 << 31) + 3;
    pub const ERR_TLS_REQD: u32 = (1 << 31) + 5;
    pub const ERR_UNKNOWN: u32 = (1 << 31) + 6;
    pub const ERR_TOO_BIG: u32 = (1 << 31) + 9;
}

/// NBD_INFO_* items of NBD_OPT_INFO / NBD_OPT_GO.
pub mod info {
    pub const EXPORT: u16 = 0;
    pub const NAME: u16 = 1;
    pub const DESCRIPTION: u16 = 2;
    pub const BLOCK_SIZE: u16 = 3;
}

/// Transmission flags.
pub mod tflag {
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const SEND_FUA: u16 = 1 << 3;
    pub const SEND_TRIM: u16 = 1 << 5;
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
}

/// Command codes.
pub mod cmd {
    pub const READ: u16 = 0;
    pub const WRITE: u16 = 1;
    pub const DISC: u16 = 2;
    pub const FLUSH: u16 = 3;
    pub const TRIM: u16 = 4;
    pub const WRITE_ZEROES: u16 = 6;
    pub const BLOCK_STATUS: u16 = 7;
}

/// Command flags.
pub mod cflag {
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
}

/// Structured reply chunk types and flags.
pub mod chunk {
    pub const FLAG_DONE: u16 = 1 << 0;
    pub const NONE: u16 = 0;
    pub const OFFSET_DATA: u16 = 1;
    pub const BLOCK_STATUS: u16 = 5;
    pub const ERROR: u16 = (1 << 15) + 1;
}

/// Error values carried in replies (the spec fixes them to the Linux errno numbers).
pub mod errno {
    pub const EPERM: u32 = 1;
    pub const EIO: u32 = 5;
    pub const EINVAL: u32 = 22;
    pub const ENOSPC: u32 = 28;
    pub const ESHUTDOWN: u32 = 108;
}

/// `base:allocation` status bits.
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation`: reads as zeros.
pub const STATE_ZERO: u32 = 1 << 1;
/// Name of the only metadata context served.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Context id given to `base:allocation` when it is selected.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// Longest option payload the server reads. Real options are a name (≤ 4096 bytes) plus a few fields;
/// anything larger is a broken or hostile client and the connection is closed.
pub const MAX_OPTION_LEN: u32 = 64 * 1024;

/// Size of a transmission request header.
pub const REQUEST_HEADER_LEN: usize = 28;
/// Size of an option header (IHAVEOPT, option, length).
pub const OPTION_HEADER_LEN: usize = 16;

/// A wire-level protocol violation that cannot be answered with an error reply.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum WireError {
    /// An option did not start with IHAVEOPT.
    #[error("bad option magic {0:#018x}")]
    BadOptionMagic(u64),
    /// An option payload longer than [`MAX_OPTION_LEN`].
    #[error("option {option} payload of {len} bytes exceeds the {MAX_OPTION_LEN}-byte limit")]
    OptionTooLong {
        /// The option code.
        option: u32,
        /// The announced payload length.
        len: u32,
    },
    /// A request did not start with the request magic.
    #[error("bad request magic {0:#010x}")]
    BadRequestMagic(u32),
}

/// The fixed 16-byte header of a client option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// NBD_OPT_* code.
    pub option: u32,
    /// Payload length that follows.
    pub len: u32,
}

impl OptionHeader {
    /// Parses and bounds-checks an option header.
    pub fn parse(bytes: &[u8; OPTION_HEADER_LEN]) -> Result<Self, WireError> {
        let magic = be_u64(bytes, 0);
        if magic != IHAVEOPT {
            return Err(WireError::BadOptionMagic(magic));
        }
        let option = be_u32(bytes, 8);
        let len = be_u32(bytes, 12);
        if len > MAX_OPTION_LEN {
            return Err(WireError::OptionTooLong { option, len });
        }
        Ok(Self { option, len })
    }
}

/// The fixed 28-byte header of a transmission request (the write payload, if any, follows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// NBD_CMD_FLAG_* bits.
    pub flags: u16,
    /// NBD_CMD_* code.
    pub command: u16,
    /// Opaque handle echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Byte length (and payload length for writes).
    pub length: u32,
}

impl RequestHeader {
    /// Parses a request header; only the magic is checked here, the rest is validated against the export.
    pub fn parse(bytes: &[u8; REQUEST_HEADER_LEN]) -> Result<Self, WireError> {
        let magic = be_u32(bytes, 0);
        if magic != REQUEST_MAGIC {
            return Err(WireError::BadRequestMagic(magic));
        }
        Ok(Self {
            flags: be_u16(bytes, 4),
            command: be_u16(bytes, 6),
            cookie: be_u64(bytes, 8),
            offset: be_u64(bytes, 16),
            length: be_u32(bytes, 24),
        })
    }

    /// Encodes the header (used by tests and raw clients).
    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        let mut b = [0u8; REQUEST_HEADER_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// Appends an option reply header (magic, option, type, payload length) to `out`.
pub fn put_option_reply_header(out: &mut Vec<u8>, option: u32, reply: u32, len: u32) {
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

/// A simple reply header: magic, error, cookie.
pub fn simple_reply(error: u32, cookie: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// A structured reply chunk header: magic, flags, type, cookie, payload length.
pub fn chunk_header(flags: u16, kind: u16, cookie: u64, len: u32) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// Reads a big-endian u16 at `at`; callers pass offsets inside fixed-size arrays.
pub(crate) fn be_u16(b: &[u8], at: usize) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[at..at + 2]);
    u16::from_be_bytes(a)
}

/// Reads a big-endian u32 at `at`.
pub(crate) fn be_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_be_bytes(a)
}

/// Reads a big-endian u64 at `at`.
pub(crate) fn be_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_header_round_trips() {
        let h = RequestHeader {
            flags: cflag::FUA,
            command: cmd::WRITE,
            cookie: 7,
            offset: 4096,
            length: 512,
        };
        assert_eq!(RequestHeader::parse(&h.encode()), Ok(h));
    }

    #[test]
    fn request_with_wrong_magic_is_rejected() {
        let mut b = RequestHeader {
            flags: 0,
            command: 0,
            cookie: 0,
            offset: 0,
            length: 0,
        }
        .encode();
        b[0] ^= 1;
        assert!(matches!(
            RequestHeader::parse(&b),
            Err(WireError::BadRequestMagic(_))
        ));
    }

    #[test]
    fn option_longer_than_the_limit_is_rejected() {
        let mut b = [0u8; OPTION_HEADER_LEN];
        b[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        b[8..12].copy_from_slice(&opt::GO.to_be_bytes());
        b[12..16].copy_from_slice(&(MAX_OPTION_LEN + 1).to_be_bytes());
        assert_eq!(
            OptionHeader::parse(&b),
            Err(WireError::OptionTooLong {
                option: opt::GO,
                len: MAX_OPTION_LEN + 1
            })
        );
    }
}
