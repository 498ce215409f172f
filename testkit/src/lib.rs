//! Corral's test kit: the one place tests, examples and benchmarks get the helpers they used to copy.
//!
//! - [`daemon`]: start a workspace daemon with `--ready-file`, read back the addresses it bound (port 0 everywhere,
//!   so parallel tests never race for ports), capture its log to a file and print it when the test fails, kill it on
//!   drop.
//! - [`ports`]: the only probe-for-a-free-port left, for third-party servers (etcd, rclone) that cannot report the
//!   port they bound; it retries the spawn when the port was taken in between.
//! - [`poll`]: wait for a condition with a deadline (sync and async), never a bare sleep.
//! - [`binary`]: the path of a workspace binary built next to the running test.
//! - [`rng`]: a seeded generator that prints its seed and takes `CORRAL_TEST_SEED` to replay a failure.
//! - [`digest`] and [`extents`]: SHA-256/512 of bytes, files and NBD exports; a file's data extents
//!   (`SEEK_DATA`/`SEEK_HOLE`) and allocation.
//! - [`servers`]: real third-party servers: S3 (`rclone serve s3`) and etcd.
//! - [`nbd`]: `qemu-io` against an NBD export, failures read from its output.
//! - [`scratch`]: temporary directories on a disk filesystem.
//! - [`tls`]: a test cluster's CA, node `--tls-dir`s, and the clients a mutual-TLS endpoint must refuse.
//! - [`docker`]: whether a Docker daemon answers, `docker/build.sh` from the suite's build, compose projects that
//!   are always taken down.
//!
//! Everything here panics with a message that says what it was waiting for or reading: it serves tests.

pub mod binary;
pub mod daemon;
pub mod digest;
pub mod docker;
pub mod extents;
pub mod nbd;
pub mod poll;
pub mod ports;
pub mod rng;
pub mod scratch;
pub mod servers;
pub mod tls;

pub use binary::workspace_bin;
pub use daemon::{Daemon, DaemonCommand, ReadyReport, kill_under};
pub use digest::{nbd_sha256, sha256_bytes, sha256_dir, sha256_file, sha512_bytes, sha512_file};
pub use extents::{allocated_bytes, data_extents};
pub use nbd::{qemu_io, qemu_io_tls};
pub use poll::{wait_for, wait_for_async};
pub use rng::TestRng;
pub use scratch::disk_tempdir;
pub use tls::TestPki;
