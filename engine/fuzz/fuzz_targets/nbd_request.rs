//! Arbitrary bytes as everything a client sends: the whole server side of one connection runs on them
//! (greeting, client flags, option parsing and answers, then request headers, validation, write payloads,
//! execution against a small in-memory device and reply encoding). Nothing may panic, and the connection must
//! end once the input does. The fixed-size parsers are also fed directly, so short inputs still exercise
//! them.
#![no_main]

use std::sync::{Arc, OnceLock};

use engine::nbd::wire::{OPTION_HEADER_LEN, OptionHeader, REQUEST_HEADER_LEN, RequestHeader};
use engine::nbd::{MemoryDevice, NbdConfig, NbdServer};
use libfuzzer_sys::fuzz_target;
use tokio_util::sync::CancellationToken;

struct Harness {
    runtime: tokio::runtime::Runtime,
    server: NbdServer<MemoryDevice>,
}

fn harness() -> &'static Harness {
    static HARNESS: OnceLock<Harness> = OnceLock::new();
    HARNESS.get_or_init(|| Harness {
        runtime: tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime"),
        server: NbdServer::new(
            Arc::new(MemoryDevice::new(1 << 20)),
            NbdConfig { export_name: "fuzz".into(), max_block: 64 << 10, max_in_flight: 4, ..NbdConfig::default() },
        ),
    })
}

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = RequestHeader::parse(data.first_chunk::<REQUEST_HEADER_LEN>().unwrap_or(&[0; REQUEST_HEADER_LEN])) {
        assert_eq!(&h.encode()[..], &data[..REQUEST_HEADER_LEN]);
    }
    let _ = OptionHeader::parse(data.first_chunk::<OPTION_HEADER_LEN>().unwrap_or(&[0; OPTION_HEADER_LEN]));

    let h = harness();
    let client = tokio::io::join(std::io::Cursor::new(data.to_vec()), tokio::io::sink());
    h.runtime.block_on(h.server.serve_stream(client, CancellationToken::new()));
});
