//! Arbitrary bytes as a qcow2 file: open (header, extensions, L1 and refcount tables, backing name), then reads
//! at fuzzed offsets and the data layout of the first MiBs. Nothing may panic, hang or read outside the file
//! (ASAN); whatever is read must be consistent with the reported layout (zeros outside allocated ranges).
#![no_main]

use std::io::Write;
use std::path::PathBuf;
use std::sync::OnceLock;

use disk_image::{DiskImage, ImageFormat};
use libfuzzer_sys::fuzz_target;

/// One directory per fuzzing process, holding only the image, so backing names resolve to nothing or to the
/// image itself (a loop the reader must refuse).
fn image_path() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            "/dev/shm"
        } else {
            "/tmp"
        };
        let dir = PathBuf::from(base).join(format!("disk-image-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("image.qcow2")
    })
}

fuzz_target!(|data: &[u8]| {
    let mut bytes = data.to_vec();
    if bytes.len() >= 4 {
        bytes[..4].copy_from_slice(b"QFI\xfb");
    }
    let path = image_path();
    std::fs::File::create(path).unwrap().write_all(&bytes).unwrap();
    let Ok(img) = DiskImage::open_as(path, ImageFormat::Qcow2) else {
        return;
    };
    let size = img.size();
    let span = size.min(4 << 20);
    let ranges = img.allocated_ranges(0..span);
    let mut buf = vec![0u8; 128 << 10];
    // Reads at offsets taken from the input's tail, plus the start and the end of the disk.
    let mut offsets = vec![0, size.saturating_sub(1000)];
    for c in data.rchunks(8).take(4) {
        let mut b = [0u8; 8];
        b[..c.len()].copy_from_slice(c);
        offsets.push(u64::from_le_bytes(b) % size.max(1));
    }
    for off in offsets {
        let _ = img.read_exact_at(&mut buf, off);
    }
    // Outside the allocated ranges the disk reads zeros.
    if let Ok(ranges) = ranges {
        let mut prev = 0;
        for r in ranges.iter().take(64) {
            assert!(r.start >= prev && r.start < r.end && r.end <= span, "{ranges:?}");
            let n = (r.start - prev).min(buf.len() as u64) as usize;
            if n > 0 && img.read_exact_at(&mut buf[..n], prev).is_ok() {
                assert!(buf[..n].iter().all(|&b| b == 0), "data in a hole at {prev}");
            }
            prev = r.end;
        }
    }
});
