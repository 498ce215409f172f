//! A real block device over the volume: nbdfuse exposes the NBD export as a file, losetup turns it into a loop
//! device, and ext4 lives on it: mkfs, mount, write files, sync, unmount, e2fsck clean, remount, read back.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{Engine, Replica};

const SIZE: u64 = 256 << 20;

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Undoes each step even when the test fails half way.
struct Cleanup {
    mount: Option<std::path::PathBuf>,
    loopdev: Option<String>,
    fuse_dir: Option<std::path::PathBuf>,
    fuse: Option<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(m) = self.mount.take() {
            let _ = Command::new("umount").arg(&m).status();
        }
        if let Some(l) = self.loopdev.take() {
            let _ = Command::new("losetup").args(["-d", &l]).status();
        }
        if let Some(d) = self.fuse_dir.take() {
            let _ = Command::new("fusermount3").arg("-u").arg(&d).status();
        }
        if let Some(mut c) = self.fuse.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn mount(dev: &str, at: &Path) {
    run(Command::new("mount").arg(dev).arg(at));
}

#[test]
fn ext4_on_a_loop_device_over_nbdfuse_survives_unmount_fsck_and_remount() {
    assert!(
        rustix::process::geteuid().is_root(),
        "needs root for losetup and mount (CI runs as root)"
    );
    let t = tempfile::tempdir().unwrap();
    let rs: Vec<Replica> = (0..2)
        .map(|i| Replica::start(&t.path().join(format!("r{i}")), &[]))
        .collect();
    let e = Engine::start(
        t.path(),
        "vol",
        SIZE,
        &rs.iter().map(Replica::address).collect::<Vec<_>>(),
        &[],
    );
    let fuse_dir = t.path().join("fuse");
    let mnt = t.path().join("mnt");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    let mut c = Cleanup {
        mount: None,
        loopdev: None,
        fuse_dir: None,
        fuse: None,
    };
    c.fuse = Some(
        Command::new("nbdfuse")
            .arg(&fuse_dir)
            .arg(e.unix_uri())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    c.fuse_dir = Some(fuse_dir.clone());
    let file = fuse_dir.join("nbd");
    testkit::wait_for("nbdfuse to expose the export", Duration::from_secs(20), || {
        (std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0) == SIZE).then_some(())
    });
    let dev = run(Command::new("losetup")
        .args(["-f", "--show", "--direct-io=on"])
        .arg(&file))
    .trim()
    .to_owned();
    c.loopdev = Some(dev.clone());
    run(Command::new("mkfs.ext4").args(["-q", "-F", &dev]));
    mount(&dev, &mnt);
    c.mount = Some(mnt.clone());
    let payload: Vec<u8> = (0..3u32 << 20).map(|i| u8::try_from(i % 251).unwrap()).collect();
    for i in 0..8 {
        std::fs::write(mnt.join(format!("file{i}")), &payload[..payload.len() - i * 1000]).unwrap();
    }
    std::fs::create_dir(mnt.join("dir")).unwrap();
    std::fs::write(mnt.join("dir/small"), b"corral").unwrap();
    run(&mut Command::new("sync"));
    run(Command::new("umount").arg(&mnt));
    c.mount = None;
    let fsck = Command::new("e2fsck").args(["-f", "-n", &dev]).output().unwrap();
    assert!(
        fsck.status.success(),
        "e2fsck: {}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    mount(&dev, &mnt);
    c.mount = Some(mnt.clone());
    for i in 0..8 {
        assert_eq!(
            std::fs::read(mnt.join(format!("file{i}"))).unwrap(),
            payload[..payload.len() - i * 1000],
            "file{i}"
        );
    }
    assert_eq!(std::fs::read(mnt.join("dir/small")).unwrap(), b"corral");
    drop(c);
}
