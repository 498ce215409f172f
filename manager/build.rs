//! Gzips the web UI's files (`src/ui/assets/`) into `OUT_DIR/ui/` at build time, so the manager serves them
//! compressed without compressing anything per request (`src/ui/assets.rs` includes both forms).

use std::io::Write;
use std::path::Path;

fn main() {
    let src = Path::new("src/ui/assets");
    println!("cargo:rerun-if-changed={}", src.display());
    let out = Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("ui");
    gzip_dir(src, &out);
}

fn gzip_dir(src: &Path, out: &Path) {
    std::fs::create_dir_all(out).expect("create OUT_DIR/ui");
    for entry in std::fs::read_dir(src).expect("read src/ui/assets") {
        let path = entry.expect("dir entry").path();
        let name = path.file_name().expect("file name");
        if path.is_dir() {
            println!("cargo:rerun-if-changed={}", path.display());
            gzip_dir(&path, &out.join(name));
            continue;
        }
        println!("cargo:rerun-if-changed={}", path.display());
        let data = std::fs::read(&path).expect("read asset");
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(&data).expect("gzip");
        let mut file_name = name.to_os_string();
        file_name.push(".gz");
        std::fs::write(out.join(file_name), gz.finish().expect("gzip")).expect("write gzipped asset");
    }
}
