//! Arbitrary bytes as lvstore metadata: a superblock slot, a checkpoint image and a journal record payload, parsed
//! and replayed as open does (`lvstore::parse_metadata`), then the same image and record placed in a small store
//! file behind a valid superblock and opened read-only through the real open path. Nothing may panic, hang or
//! allocate beyond what the input can hold.
//!
//! Input: `[cluster-size selector][u16 image length][image][journal payload]`; the image magic is forced so the
//! fuzzer spends its time past it.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use lvstore::format::{self, Superblock};

fn store_path() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" };
        PathBuf::from(base).join(format!("lvstore-fuzz-{}", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    let _ = Superblock::decode(data);
    if data.len() < 3 {
        return;
    }
    let cluster_size = 32u64 << 10 << (data[0] % 4);
    let split = usize::from(u16::from_le_bytes([data[1], data[2]])).min(data.len() - 3);
    let mut image = data[3..3 + split].to_vec();
    let payload = &data[3 + split..];
    if image.len() >= 8 {
        image[..8].copy_from_slice(&format::IMAGE_MAGIC);
    }
    let _ = lvstore::parse_metadata(&image, payload, cluster_size);

    // The real open path: a valid superblock naming the fuzzed image, the fuzzed record at the journal's head.
    let meta_area = 64u64 << 10;
    if image.len() as u64 > meta_area {
        return;
    }
    let journal_off = format::AREAS_OFF + 2 * meta_area;
    let journal_len = 64u64 << 10;
    let data_off = (journal_off + journal_len).next_multiple_of(cluster_size);
    let device_len = data_off + 4 * cluster_size;
    let sb = Superblock {
        version: format::VERSION,
        store_uuid: [7; 16],
        cluster_size,
        device_len,
        meta_area_len: meta_area,
        journal_off,
        journal_len,
        data_off,
        cluster_count: 4,
        generation: 1,
        image_len: image.len() as u64,
        image_sum: format::checksum(&image),
    };
    let record = format::encode_record(&[7; 16], 1, 0, payload);
    if record.len() as u64 > journal_len {
        return;
    }
    let mut dev = vec![0u8; usize::try_from(journal_off + journal_len).unwrap()];
    dev[4096..8192].copy_from_slice(&sb.encode());
    let io = usize::try_from(sb.image_off()).unwrap();
    dev[io..io + image.len()].copy_from_slice(&image);
    let jo = usize::try_from(journal_off).unwrap();
    dev[jo..jo + record.len()].copy_from_slice(&record);
    let path = store_path();
    std::fs::write(path, &dev).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_len(device_len).unwrap();
    if let Ok(store) = lvstore::LvStore::open(path, lvstore::OpenMode::ReadOnly) {
        let _ = store.check();
        let list = store.list();
        let mut buf = vec![0u8; 4096];
        for l in list {
            if let Ok(id) = store.lookup(&l.name) {
                let _ = store.read_at(id, 0, &mut buf);
                let _ = store.allocated_ranges(id, 0, l.size.min(1 << 20));
            }
        }
    }
});
