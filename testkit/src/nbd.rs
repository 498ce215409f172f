//! Driving an NBD export with `qemu-io`, the client QEMU itself uses.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

/// Runs `qemu-io -f raw URI -c CMD…` (e.g. `write -P 0xab 0 4M`, `read -P 0xab 0 4M`, `flush`) and returns whether
/// every command succeeded, with stdout and stderr.
///
/// qemu-io exits 0 even when a command fails or a pattern does not match, so its output is read too: a failed
/// command prints `… failed: …` and a mismatch `Pattern verification failed`.
///
/// # Panics
/// When qemu-io is missing (Debian package `qemu-utils`).
pub fn qemu_io(uri: &str, cmds: &[&str]) -> (bool, String) {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw", uri]);
    run(c, cmds)
}

/// [`qemu_io`] over TLS, as a user attaches to an engine's TLS-only TCP listener: `--object
/// tls-creds-x509,endpoint=client,dir=DIR` (DIR from `corral-tls nbd-client-dir`) and `--image-opts
/// driver=nbd,host=…,port=…,export=…,tls-creds=…`.
///
/// # Panics
/// When qemu-io is missing.
pub fn qemu_io_tls(addr: SocketAddr, export: &str, dir: &Path, cmds: &[&str]) -> (bool, String) {
    let mut c = Command::new("qemu-io");
    c.arg("--object")
        .arg(format!(
            "tls-creds-x509,id=tls0,endpoint=client,dir={}",
            dir.display()
        ))
        .arg("--image-opts")
        .arg(format!(
            "driver=nbd,host={},port={},export={export},tls-creds=tls0",
            addr.ip(),
            addr.port()
        ));
    run(c, cmds)
}

fn run(mut c: Command, cmds: &[&str]) -> (bool, String) {
    for x in cmds {
        c.args(["-c", x]);
    }
    let out = c.output().expect("qemu-io (apt-get install qemu-utils)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let ok =
        out.status.success() && !text.contains("Pattern verification failed") && !text.contains("failed:");
    (ok, text)
}
