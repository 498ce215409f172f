//! Volumes over replicas whose backing file is a qemu-made raw or qcow2 image, read over NBD by qemu: the export
//! equals `qemu-img convert -O raw` of the image (zero-padded to the volume size), before and after writes and a
//! snapshot; raw and qcow2 of one image give volumes with identical checksums.

mod common;

use std::path::Path;
use std::process::Command;

use common::{Engine, Replica};
use disk_image::fixtures::{Fixture, build_all};
use testkit::qemu_io;

const SIZE: u64 = 8 << 20;

fn run_ok(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd} {args:?}: {text}");
    text
}

/// The expected volume: the image's raw content, cut to its virtual size and zero-padded to the volume size.
fn expected_volume(f: &Fixture, out: &Path) {
    let mut v = std::fs::read(&f.reference).unwrap();
    let image = usize::try_from(disk_image::probe(&f.path).unwrap().virtual_size).unwrap();
    v.truncate(image);
    v.resize(usize::try_from(SIZE).unwrap(), 0);
    std::fs::write(out, v).unwrap();
}

fn volume_over(dir: &Path, image: &Path) -> (Vec<Replica>, Engine) {
    let size = SIZE.to_string();
    let args = ["--size", &size, "--backing-file", image.to_str().unwrap()];
    let rs: Vec<Replica> = (0..2)
        .map(|i| Replica::start(&dir.join(format!("r{i}")), &args))
        .collect();
    let addrs: Vec<String> = rs.iter().map(Replica::address).collect();
    let e = Engine::start(dir, "vol", SIZE, &addrs, &[]);
    (rs, e)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_over_each_image_read_as_qemu_converts_it_before_and_after_writes_and_snapshots() {
    let t = tempfile::tempdir().unwrap();
    let images = t.path().join("images");
    std::fs::create_dir(&images).unwrap();
    for f in build_all(&images) {
        let dir = t.path().join(f.name);
        std::fs::create_dir(&dir).unwrap();
        let (_rs, e) = volume_over(&dir, &f.path);
        let expected = dir.join("expected.raw");
        expected_volume(&f, &expected);
        let uri = e.unix_uri();
        let exp = expected.to_str().unwrap();
        run_ok("qemu-img", &["compare", "-f", "raw", "-F", "raw", exp, &uri]);

        // The same writes to the volume and to the expected file, a snapshot between them.
        let first = ["write -P 0x91 4k 1k", "write -P 0x92 1000k 100k"];
        let second = ["write -z 0 64k", "write -P 0x93 7M 8k", "write -P 0x94 3M 300"];
        let (ok, out) = qemu_io(&uri, &first);
        assert!(ok, "{}: {out}", f.name);
        let st = e.cli(&["snapshot", "create", "s1"]);
        assert!(
            st.status.success(),
            "{}: {}",
            f.name,
            String::from_utf8_lossy(&st.stderr)
        );
        let (ok, out) = qemu_io(&uri, &second);
        assert!(ok, "{}: {out}", f.name);
        let mut local = vec!["-f", "raw"];
        for c in first.iter().chain(&second) {
            local.extend(["-c", c]);
        }
        local.push(exp);
        run_ok("qemu-io", &local);
        run_ok(
            "qemu-img",
            &["compare", "-f", "raw", "-F", "raw", exp, &e.tcp_uri()],
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_and_qcow2_of_one_image_give_volumes_with_identical_checksums() {
    let t = tempfile::tempdir().unwrap();
    let images = t.path().join("images");
    std::fs::create_dir(&images).unwrap();
    let fx = build_all(&images);
    let overlay = fx.iter().find(|f| f.name == "qcow2-overlay").unwrap();
    let mut sums = Vec::new();
    for (name, image) in [("qcow2", &overlay.path), ("raw", &overlay.reference)] {
        let dir = t.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        let (_rs, e) = volume_over(&dir, image);
        let (ok, out) = qemu_io(&e.unix_uri(), &["write -P 0x3c 2M 64k"]);
        assert!(ok, "{out}");
        let copy = dir.join("volume.raw");
        run_ok(
            "qemu-img",
            &[
                "convert",
                "-f",
                "raw",
                "-O",
                "raw",
                &e.unix_uri(),
                copy.to_str().unwrap(),
            ],
        );
        let sum = run_ok("sha512sum", &[copy.to_str().unwrap()]);
        sums.push(sum.split_whitespace().next().unwrap().to_owned());
    }
    assert_eq!(sums[0], sums[1]);
}
