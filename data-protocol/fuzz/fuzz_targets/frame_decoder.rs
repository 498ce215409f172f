//! Feeds arbitrary bytes to the frame header decoder and to the streaming decoder the connection readers
//! use, cut into chunks at arbitrary points. Neither may panic, and the streaming decoder must agree
//! with the one-shot decoder frame by frame. The same bytes are also decoded as a `BlockStatus` range list,
//! which must either be rejected or come out ascending, non-overlapping and inside its span.
#![no_main]

use data_protocol::{Decoded, FrameDecoder, FrameHeader, HEADER_LEN, decode_ranges};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // One-shot header decode: a valid header re-encodes to exactly the bytes it came from.
    if let Ok(h) = FrameHeader::decode_slice(data) {
        assert_eq!(&h.encode()[..], &data[..HEADER_LEN]);
    }

    // Range list of a BlockStatus reply, over a span taken from the first 16 bytes.
    if data.len() >= 16 {
        let a = u64::from_le_bytes(data[..8].try_into().unwrap());
        let b = u64::from_le_bytes(data[8..16].try_into().unwrap());
        let span = a.min(b)..a.max(b);
        if let Ok(ranges) = decode_ranges(span.clone(), &data[16..]) {
            let mut previous_end = span.start;
            for r in &ranges {
                assert!(r.start < r.end && r.start >= previous_end && r.end <= span.end);
                previous_end = r.end;
            }
        }
    }

    // Streaming decode: the first byte picks the chunk size, the rest is the stream.
    let Some((&chunk_seed, stream)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(chunk_seed % 64) + 1;
    let mut dec = FrameDecoder::new();
    let mut pos = 0usize; // stream offset of the next unconsumed byte
    let mut frame_start = 0usize;
    let mut payload_due = 0usize;
    'outer: for piece in stream.chunks(chunk) {
        let mut rest = piece;
        while !rest.is_empty() {
            match dec.decode(rest) {
                Ok((n, decoded)) => {
                    assert!(
                        n > 0 && n <= rest.len(),
                        "decoder must make progress within its input"
                    );
                    match decoded {
                        Decoded::Header(h) => {
                            assert_eq!(payload_due, 0);
                            assert_eq!(pos + n - frame_start, HEADER_LEN);
                            let one_shot = FrameHeader::decode_slice(&stream[frame_start..]);
                            assert_eq!(one_shot, Ok(h));
                            payload_due = h.payload_usize();
                            assert_eq!(dec.payload_remaining(), payload_due);
                        }
                        Decoded::Payload(p) => {
                            assert_eq!(p.len(), n);
                            assert_eq!(p, &rest[..n]);
                            payload_due -= n;
                        }
                        Decoded::NeedMore => assert_eq!(n, rest.len()),
                    }
                    pos += n;
                    rest = &rest[n..];
                    if payload_due == 0 && dec.at_frame_boundary() {
                        frame_start = pos;
                    }
                }
                Err(err) => {
                    // The one-shot decoder rejects the same header, and the decoder stays failed.
                    assert_eq!(
                        FrameHeader::decode_slice(&stream[frame_start..]),
                        Err(err.clone())
                    );
                    assert!(dec.decode(b"more").is_err());
                    break 'outer;
                }
            }
        }
    }
});
