//! Frame header codec and the incremental (sans-IO) frame decoder.
//!
//! Every frame is a fixed 32-byte little-endian header followed by `payload_len` bytes of payload:
//!
//! | off | size | field |
//! |---|---|---|
//! | 0 | u32 | magic = `u32::from_le_bytes(*b"CRLD")` |
//! | 4 | u16 | version = 1 |
//! | 6 | u16 | kind ([`FrameKind`]) |
//! | 8 | u64 | id (a reply carries its request's id) |
//! | 16 | u64 | offset (bytes; the engine generation in `Hello`, 0 = none; the replica's generation in a `Fenced` `Error` reply) |
//! | 24 | u32 | length (IO bytes; error kind code in an `Error` reply; protocol version in `Hello`; bytes covered in a `BlockStatus` reply) |
//! | 28 | u32 | payload_len |
//!
//! [`FrameHeader::decode`] enforces every per-frame rule that can be checked from the header alone, so
//! that a reader never allocates or waits for a payload it is going to reject anyway.

/// `b"CRLD"` read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"CRLD");
/// The protocol version this crate speaks (header `version` field and the `Hello` length).
pub const VERSION: u16 = 1;
/// Size of the fixed frame header.
pub const HEADER_LEN: usize = 32;
/// Largest read/write length and largest payload of any frame: 16 MiB.
pub const MAX_IO: u32 = 16 << 20;
/// Largest payload of a `Hello` request and of a `Hello` reply's volume name.
pub const MAX_NAME_LEN: u32 = 1024;
/// Largest payload of an `Error` reply (the message); servers truncate longer messages.
pub const MAX_MESSAGE_LEN: u32 = 64 << 10;
/// Size of one allocated range in a `BlockStatus` reply: `start` and `end` as u64 LE.
pub const BLOCK_STATUS_RANGE_LEN: u32 = 16;
/// Most ranges one `BlockStatus` reply carries (its payload is at most [`MAX_IO`]).
pub const MAX_BLOCK_STATUS_RANGES: u32 = MAX_IO / BLOCK_STATUS_RANGE_LEN;

// The header is exactly the sum of its fields: a layout change must be deliberate.
const _: () = assert!(HEADER_LEN == 4 + 2 + 2 + 8 + 8 + 4 + 4);
const _: () = assert!(HEADER_LEN == 32);
// Payload lengths are handled as usize in memory; 16 MiB must fit on every supported target.
const _: () = assert!(MAX_IO as u64 <= usize::MAX as u64);
// A full list of ranges fills a payload exactly.
const _: () = assert!(MAX_BLOCK_STATUS_RANGES * BLOCK_STATUS_RANGE_LEN == MAX_IO);

/// Frame type. Requests are below 0x80, replies have the high bit set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum FrameKind {
    /// Client → server, first frame: `length` = client protocol version, `offset` = the engine's generation
    /// (0: none, an engine that predates generations), payload = client name.
    Hello = 1,
    /// Read `length` bytes at `offset`.
    Read = 2,
    /// Write the payload (`length` bytes) at `offset`.
    Write = 3,
    /// Discard `length` bytes at `offset`.
    Unmap = 4,
    /// Write `length` zero bytes at `offset` without sending them.
    WriteZeroes = 5,
    /// Make every acknowledged write durable.
    Flush = 6,
    /// Liveness probe.
    Ping = 7,
    /// Which parts of `length` bytes at `offset` are allocated (`length` > 0, no payload). The `Ok` reply's
    /// `length` is how many bytes from `offset` the answer covers (at most the request's, less when the
    /// list was cut), its payload the allocated ranges in that span as `(start, end)` u64 LE pairs,
    /// ascending and non-overlapping; the rest of the covered span is holes.
    BlockStatus = 8,
    /// Success; a read's data is the payload. Reply to `Hello`: `offset` = size, `length` = sector size.
    /// Reply to `BlockStatus`: `length` = bytes covered, payload = allocated ranges.
    Ok = 0x81,
    /// Failure: `length` = [`crate::ErrorKind`] code, payload = UTF-8 message; `offset` = the replica's
    /// generation when the kind is `Fenced`, else 0.
    Error = 0x82,
    /// The read reaches past the end of the volume.
    Eof = 0x83,
    /// The replica is out of space.
    NoSpace = 0x84,
}

impl FrameKind {
    /// The kind for a wire code, or `None` for an unknown code.
    pub fn from_code(code: u16) -> Option<Self> {
        Some(match code {
            1 => Self::Hello,
            2 => Self::Read,
            3 => Self::Write,
            4 => Self::Unmap,
            5 => Self::WriteZeroes,
            6 => Self::Flush,
            7 => Self::Ping,
            8 => Self::BlockStatus,
            0x81 => Self::Ok,
            0x82 => Self::Error,
            0x83 => Self::Eof,
            0x84 => Self::NoSpace,
            _ => return None,
        })
    }

    /// The wire code.
    pub fn code(self) -> u16 {
        self as u16
    }

    /// True for frames a client sends.
    pub fn is_request(self) -> bool {
        self.code() < 0x80
    }
}

/// Why a header (or a byte stream) is not a valid frame. Every variant is a protocol violation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Fewer than 32 bytes were given to [`FrameHeader::decode_slice`].
    #[error("truncated header: {got} of {HEADER_LEN} bytes")]
    Truncated { got: usize },
    /// The first four bytes are not `CRLD`.
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    /// A header version other than [`VERSION`].
    #[error("unsupported frame version {0} (this side speaks {VERSION})")]
    BadVersion(u16),
    /// A kind code that is not a [`FrameKind`].
    #[error("unknown frame kind {0:#06x}")]
    UnknownKind(u16),
    /// A read or write longer than [`MAX_IO`].
    #[error("{kind:?} length {length} exceeds the {MAX_IO}-byte limit")]
    LengthTooLarge { kind: FrameKind, length: u32 },
    /// A payload longer than this kind allows.
    #[error("{kind:?} payload of {payload_len} bytes exceeds the {limit}-byte limit")]
    PayloadTooLarge {
        kind: FrameKind,
        payload_len: u32,
        limit: u32,
    },
    /// A write whose payload is not exactly `length` bytes.
    #[error("write length {length} does not match payload length {payload_len}")]
    WritePayloadMismatch { length: u32, payload_len: u32 },
}

/// A decoded frame header. Magic and version are implicit: `decode` checks them and `encode` writes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub id: u64,
    pub offset: u64,
    pub length: u32,
    pub payload_len: u32,
}

impl FrameHeader {
    /// A header without payload.
    pub fn new(kind: FrameKind, id: u64, offset: u64, length: u32) -> Self {
        Self {
            kind,
            id,
            offset,
            length,
            payload_len: 0,
        }
    }

    /// Encodes into the fixed wire layout.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6..8].copy_from_slice(&self.kind.code().to_le_bytes());
        out[8..16].copy_from_slice(&self.id.to_le_bytes());
        out[16..24].copy_from_slice(&self.offset.to_le_bytes());
        out[24..28].copy_from_slice(&self.length.to_le_bytes());
        out[28..32].copy_from_slice(&self.payload_len.to_le_bytes());
        out
    }

    /// Decodes and validates a header. Never panics.
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Self, DecodeError> {
        let magic = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        if magic != MAGIC {
            return Err(DecodeError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != VERSION {
            return Err(DecodeError::BadVersion(version));
        }
        let code = u16::from_le_bytes([bytes[6], bytes[7]]);
        let kind = FrameKind::from_code(code).ok_or(DecodeError::UnknownKind(code))?;
        let mut u64_at = [0u8; 8];
        u64_at.copy_from_slice(&bytes[8..16]);
        let id = u64::from_le_bytes(u64_at);
        u64_at.copy_from_slice(&bytes[16..24]);
        let offset = u64::from_le_bytes(u64_at);
        let length = u32::from_le_bytes([bytes[24], bytes[25], bytes[26], bytes[27]]);
        let payload_len = u32::from_le_bytes([bytes[28], bytes[29], bytes[30], bytes[31]]);
        let header = Self {
            kind,
            id,
            offset,
            length,
            payload_len,
        };
        header.validate()?;
        Ok(header)
    }

    /// Like [`decode`](Self::decode) for a slice of any length; only the first 32 bytes are read.
    pub fn decode_slice(bytes: &[u8]) -> Result<Self, DecodeError> {
        let fixed: &[u8; HEADER_LEN] = bytes
            .get(..HEADER_LEN)
            .and_then(|b| b.try_into().ok())
            .ok_or(DecodeError::Truncated { got: bytes.len() })?;
        Self::decode(fixed)
    }

    /// The largest payload a frame of this kind may carry.
    pub fn payload_limit(kind: FrameKind) -> u32 {
        match kind {
            FrameKind::Write | FrameKind::Ok => MAX_IO,
            FrameKind::Hello => MAX_NAME_LEN,
            FrameKind::Error => MAX_MESSAGE_LEN,
            FrameKind::Read
            | FrameKind::Unmap
            | FrameKind::WriteZeroes
            | FrameKind::Flush
            | FrameKind::Ping
            | FrameKind::BlockStatus
            | FrameKind::Eof
            | FrameKind::NoSpace => 0,
        }
    }

    fn validate(&self) -> Result<(), DecodeError> {
        let limit = Self::payload_limit(self.kind);
        if self.payload_len > limit {
            return Err(DecodeError::PayloadTooLarge {
                kind: self.kind,
                payload_len: self.payload_len,
                limit,
            });
        }
        if matches!(self.kind, FrameKind::Read | FrameKind::Write) && self.length > MAX_IO {
            return Err(DecodeError::LengthTooLarge {
                kind: self.kind,
                length: self.length,
            });
        }
        if self.kind == FrameKind::Write && self.payload_len != self.length {
            return Err(DecodeError::WritePayloadMismatch {
                length: self.length,
                payload_len: self.payload_len,
            });
        }
        Ok(())
    }

    /// Payload length as a usize (lossless: it is at most [`MAX_IO`] after `decode`).
    pub fn payload_usize(&self) -> usize {
        usize::try_from(self.payload_len).unwrap_or(usize::MAX)
    }

    /// `length` as a usize (lossless on every target with at least 32-bit pointers).
    pub fn length_usize(&self) -> usize {
        usize::try_from(self.length).unwrap_or(usize::MAX)
    }
}

/// Why the range list of a `BlockStatus` reply is malformed. Every variant is a protocol violation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeListError {
    /// The payload is not a whole number of 16-byte ranges.
    #[error("range list of {0} bytes is not a whole number of {BLOCK_STATUS_RANGE_LEN}-byte ranges")]
    Length(usize),
    /// A range with `end <= start`.
    #[error("range {start}..{end} is empty or reversed")]
    Empty { start: u64, end: u64 },
    /// A range starting before the previous one ended.
    #[error("range {start}..{end} starts before the previous range's end {previous_end}")]
    Unordered { start: u64, end: u64, previous_end: u64 },
    /// A range reaching outside the span the reply covers.
    #[error("range {start}..{end} lies outside the covered span {span_start}..{span_end}")]
    OutsideSpan {
        start: u64,
        end: u64,
        span_start: u64,
        span_end: u64,
    },
}

/// The wire form of one allocated range of a `BlockStatus` reply.
pub fn encode_range(range: &std::ops::Range<u64>) -> [u8; BLOCK_STATUS_RANGE_LEN as usize] {
    let mut out = [0u8; BLOCK_STATUS_RANGE_LEN as usize];
    out[..8].copy_from_slice(&range.start.to_le_bytes());
    out[8..].copy_from_slice(&range.end.to_le_bytes());
    out
}

/// Decodes and checks the range list of a `BlockStatus` reply covering `span`: whole 16-byte ranges,
/// each non-empty, ascending, not overlapping its predecessor (touching is allowed) and inside `span`.
/// Never panics.
pub fn decode_ranges(
    span: std::ops::Range<u64>,
    payload: &[u8],
) -> Result<Vec<std::ops::Range<u64>>, RangeListError> {
    let width = BLOCK_STATUS_RANGE_LEN as usize;
    if !payload.len().is_multiple_of(width) {
        return Err(RangeListError::Length(payload.len()));
    }
    let mut out = Vec::with_capacity(payload.len() / width);
    let mut previous_end = span.start;
    for pair in payload.chunks_exact(width) {
        let mut word = [0u8; 8];
        word.copy_from_slice(&pair[..8]);
        let start = u64::from_le_bytes(word);
        word.copy_from_slice(&pair[8..]);
        let end = u64::from_le_bytes(word);
        if end <= start {
            return Err(RangeListError::Empty { start, end });
        }
        if start < span.start || end > span.end {
            return Err(RangeListError::OutsideSpan {
                start,
                end,
                span_start: span.start,
                span_end: span.end,
            });
        }
        if start < previous_end {
            return Err(RangeListError::Unordered {
                start,
                end,
                previous_end,
            });
        }
        previous_end = end;
        out.push(start..end);
    }
    Ok(out)
}

/// What [`FrameDecoder::decode`] found in the input it was given.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// Every byte was consumed and the current header is still incomplete.
    NeedMore,
    /// A complete, valid header. Its `payload_len` bytes follow as [`Decoded::Payload`] chunks (or are read
    /// by the caller directly and reported with [`FrameDecoder::payload_read`]).
    Header(FrameHeader),
    /// A chunk of the current frame's payload.
    Payload(&'a [u8]),
}

/// Incremental frame decoder over a byte stream, independent of any IO.
///
/// The connection readers on both sides drive it from their buffered socket; it keeps only the partial
/// header (32 bytes) and the count of payload bytes still due, so it never allocates. After an error it
/// stays failed: a stream that violated the protocol once has no trustworthy frame boundary any more.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    header: [u8; HEADER_LEN],
    header_filled: usize,
    payload_left: usize,
    failed: Option<DecodeError>,
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Consumes a prefix of `input` and returns how many bytes it consumed with what they completed.
    /// A header is returned as soon as it is complete, so the caller can prepare for its payload.
    pub fn decode<'a>(&mut self, input: &'a [u8]) -> Result<(usize, Decoded<'a>), DecodeError> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        if self.payload_left > 0 {
            let n = self.payload_left.min(input.len());
            if n == 0 {
                return Ok((0, Decoded::NeedMore));
            }
            self.payload_left -= n;
            return Ok((n, Decoded::Payload(&input[..n])));
        }
        let want = HEADER_LEN - self.header_filled;
        let n = want.min(input.len());
        self.header[self.header_filled..self.header_filled + n].copy_from_slice(&input[..n]);
        self.header_filled += n;
        if self.header_filled < HEADER_LEN {
            return Ok((n, Decoded::NeedMore));
        }
        self.header_filled = 0;
        match FrameHeader::decode(&self.header) {
            Ok(header) => {
                self.payload_left = header.payload_usize();
                Ok((n, Decoded::Header(header)))
            }
            Err(err) => {
                self.failed = Some(err.clone());
                Err(err)
            }
        }
    }

    /// Payload bytes of the current frame not yet consumed.
    pub fn payload_remaining(&self) -> usize {
        self.payload_left
    }

    /// Records that the caller read `n` payload bytes straight from the transport (bypassing `decode`).
    /// `n` is clamped to the remaining payload.
    pub fn payload_read(&mut self, n: usize) {
        self.payload_left -= n.min(self.payload_left);
    }

    /// True when no frame is partially decoded: the stream may end here cleanly.
    pub fn at_frame_boundary(&self) -> bool {
        self.header_filled == 0 && self.payload_left == 0 && self.failed.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_kind() -> impl Strategy<Value = FrameKind> {
        prop::sample::select(vec![
            FrameKind::Hello,
            FrameKind::Read,
            FrameKind::Write,
            FrameKind::Unmap,
            FrameKind::WriteZeroes,
            FrameKind::Flush,
            FrameKind::Ping,
            FrameKind::BlockStatus,
            FrameKind::Ok,
            FrameKind::Error,
            FrameKind::Eof,
            FrameKind::NoSpace,
        ])
    }

    fn valid_header() -> impl Strategy<Value = FrameHeader> {
        (any_kind(), any::<u64>(), any::<u64>(), any::<u32>(), any::<u32>()).prop_map(
            |(kind, id, offset, length, payload)| {
                let limit = FrameHeader::payload_limit(kind);
                let mut h = FrameHeader {
                    kind,
                    id,
                    offset,
                    length,
                    payload_len: 0,
                };
                if matches!(kind, FrameKind::Read | FrameKind::Write) {
                    h.length = length % (MAX_IO + 1);
                }
                h.payload_len = if kind == FrameKind::Write {
                    h.length
                } else {
                    payload % (limit + 1)
                };
                h
            },
        )
    }

    proptest! {
        #[test]
        fn header_round_trips_through_encode_and_decode(h in valid_header()) {
            prop_assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics_and_reencodes_exactly(bytes in prop::collection::vec(any::<u8>(), 0..80)) {
            if let Ok(h) = FrameHeader::decode_slice(&bytes) {
                prop_assert_eq!(&h.encode()[..], &bytes[..HEADER_LEN]);
            }
        }

        #[test]
        fn streaming_decoder_yields_the_same_frames_for_any_chunking(
            frames in prop::collection::vec(valid_header().prop_map(|mut h| { h.payload_len %= 300; if h.kind == FrameKind::Write { h.length = h.payload_len } h }), 1..8),
            chunk in 1usize..70,
        ) {
            let mut stream = Vec::new();
            for (i, h) in frames.iter().enumerate() {
                stream.extend_from_slice(&h.encode());
                stream.extend(std::iter::repeat_n(u8::try_from(i).unwrap(), h.payload_usize()));
            }
            let mut dec = FrameDecoder::new();
            let mut got = Vec::new();
            let mut payload_bytes = 0usize;
            for piece in stream.chunks(chunk) {
                let mut rest = piece;
                while !rest.is_empty() {
                    let (n, ev) = dec.decode(rest).unwrap();
                    prop_assert!(n > 0);
                    match ev {
                        Decoded::Header(h) => got.push(h),
                        Decoded::Payload(p) => payload_bytes += p.len(),
                        Decoded::NeedMore => {}
                    }
                    rest = &rest[n..];
                }
            }
            prop_assert!(dec.at_frame_boundary());
            prop_assert_eq!(&got, &frames);
            prop_assert_eq!(payload_bytes, frames.iter().map(FrameHeader::payload_usize).sum::<usize>());
        }
    }

    #[test]
    fn rejects_each_kind_of_violation_with_a_typed_error() {
        let good = FrameHeader {
            kind: FrameKind::Write,
            id: 1,
            offset: 0,
            length: 8,
            payload_len: 8,
        };
        let mut b = good.encode();
        b[0] ^= 1;
        assert!(matches!(FrameHeader::decode(&b), Err(DecodeError::BadMagic(_))));
        let mut b = good.encode();
        b[4] = 2;
        assert_eq!(FrameHeader::decode(&b), Err(DecodeError::BadVersion(2)));
        let mut b = good.encode();
        b[6] = 0x42;
        assert_eq!(FrameHeader::decode(&b), Err(DecodeError::UnknownKind(0x42)));
        let big = FrameHeader {
            length: MAX_IO + 1,
            payload_len: MAX_IO + 1,
            ..good
        };
        assert!(matches!(
            FrameHeader::decode(&big.encode()),
            Err(DecodeError::PayloadTooLarge { .. })
        ));
        let read = FrameHeader::new(FrameKind::Read, 1, 0, MAX_IO + 1);
        assert!(matches!(
            FrameHeader::decode(&read.encode()),
            Err(DecodeError::LengthTooLarge { .. })
        ));
        let mismatch = FrameHeader {
            payload_len: 7,
            ..good
        };
        assert!(matches!(
            FrameHeader::decode(&mismatch.encode()),
            Err(DecodeError::WritePayloadMismatch { .. })
        ));
        assert_eq!(
            FrameHeader::decode_slice(&[0; 5]),
            Err(DecodeError::Truncated { got: 5 })
        );
    }

    #[test]
    fn range_lists_round_trip_and_malformed_ones_are_rejected() {
        let enc =
            |rs: &[(u64, u64)]| -> Vec<u8> { rs.iter().flat_map(|&(s, e)| encode_range(&(s..e))).collect() };
        let ok = enc(&[(100, 200), (200, 300), (500, 4096)]);
        assert_eq!(
            decode_ranges(100..4096, &ok),
            Ok(vec![100..200, 200..300, 500..4096])
        );
        assert_eq!(decode_ranges(0..10, &[]), Ok(vec![]));
        assert_eq!(decode_ranges(0..4096, &ok[..17]), Err(RangeListError::Length(17)));
        assert!(matches!(
            decode_ranges(0..4096, &enc(&[(5, 5)])),
            Err(RangeListError::Empty { .. })
        ));
        assert!(matches!(
            decode_ranges(0..4096, &enc(&[(9, 3)])),
            Err(RangeListError::Empty { .. })
        ));
        assert!(matches!(
            decode_ranges(0..4096, &enc(&[(0, 100), (50, 200)])),
            Err(RangeListError::Unordered { .. })
        ));
        assert!(matches!(
            decode_ranges(0..4096, &enc(&[(300, 400), (0, 100)])),
            Err(RangeListError::Unordered { .. })
        ));
        assert!(matches!(
            decode_ranges(100..200, &enc(&[(50, 150)])),
            Err(RangeListError::OutsideSpan { .. })
        ));
        assert!(matches!(
            decode_ranges(100..200, &enc(&[(150, 201)])),
            Err(RangeListError::OutsideSpan { .. })
        ));
    }

    #[test]
    fn decoder_stays_failed_after_a_violation() {
        let mut dec = FrameDecoder::new();
        assert!(dec.decode(&[0xff; HEADER_LEN]).is_err());
        let ok = FrameHeader::new(FrameKind::Ping, 1, 0, 0).encode();
        assert!(dec.decode(&ok).is_err());
        assert!(!dec.at_frame_boundary());
    }
}
