//! The receiver's only parser of untrusted bytes: the `CSR1` range-list body. It must never panic, and whatever it
//! accepts must satisfy the documented rules.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sparse_sync::wire::decode_ranges;

fuzz_target!(|input: (u64, bool, &[u8])| {
    let (size, with_payload, body) = input;
    if let Ok((ranges, payload)) = decode_ranges(body, size, with_payload) {
        let mut prev_end = 0;
        let mut total = 0u64;
        for r in &ranges {
            assert!(r.start < r.end && r.end <= size && r.start >= prev_end);
            prev_end = r.end;
            total += r.end - r.start;
        }
        assert_eq!(payload.len() as u64, if with_payload { total } else { 0 });
    }
});
