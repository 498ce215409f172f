//! Where the workspace's binaries are for a running test, example or benchmark.

use std::path::{Path, PathBuf};

/// Environment variable naming a directory that holds the workspace binaries, overriding the lookup next to the
/// running executable (e.g. for a test archive run elsewhere).
pub const BIN_DIR_ENV: &str = "CORRAL_BIN_DIR";

/// The path of workspace binary `name` (e.g. `corral-replica`).
///
/// Looks in `$CORRAL_BIN_DIR`, else in the profile directory of the running executable (`target/debug/deps/t-…` and
/// `target/debug/examples/x` both give `target/debug`). A crate's own binaries are better named with
/// `env!("CARGO_BIN_EXE_…")`, which cargo guarantees to have built; this is for another crate's binaries.
///
/// # Panics
/// When the binary is missing, with the command that builds it.
pub fn workspace_bin(name: &str) -> PathBuf {
    find_workspace_bin(name).unwrap_or_else(|path| {
        panic!(
            "{} missing: build it first (`cargo build --workspace --bins`, as scripts/test.sh does), or set {BIN_DIR_ENV}",
            path.display()
        )
    })
}

/// [`workspace_bin`] without the panic: `Err` carries the path where the binary was looked for.
pub fn find_workspace_bin(name: &str) -> Result<PathBuf, PathBuf> {
    let dir = match std::env::var_os(BIN_DIR_ENV) {
        Some(d) => PathBuf::from(d),
        None => profile_dir(),
    };
    let path = dir.join(name);
    if path.exists() { Ok(path) } else { Err(path) }
}

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("path of the running executable");
    exe.parent()
        .and_then(Path::parent)
        .unwrap_or_else(|| panic!("{} is not inside a target directory", exe.display()))
        .to_path_buf()
}
