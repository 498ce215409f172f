#!/usr/bin/env bash
# Corral's whole test suite, runnable on a fresh Debian machine: installs the system tools the tests use (when run
# as root and they are missing), checks formatting and lints, builds, and runs every test. `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/install-deps.sh
. scripts/install-deps.sh
need_tools qemu-img qemu-io qemu-nbd nbdinfo nbdfuse nbdsh fio nbdkit fusermount3 rsync mkfs.ext4 losetup mkfs.xfs etcd \
  curl python3 setsid flock chromium chromedriver || echo "warning: tests that need the missing tools will fail" >&2
need_rclone || echo "warning: rclone not installed; S3 backup tests will fail" >&2

# Building needs no protoc (protox compiles every .proto, etcd's included): make any build script that would call
# one fail, so a dependency that brings the need back is caught here and not on a user's fresh machine.
export PROTOC=/bin/false

# The CSI conformance test's independent client: Python gRPC stubs generated from csi/proto at test time.
need_pip grpc_tools grpcio grpcio-tools || echo "warning: grpcio not installed; the CSI conformance test will fail" >&2
# The REST API against its OpenAPI document (manager/tests/api_schema.rs): schemathesis' 4.x CLI.
need_pip schemathesis 'schemathesis>=4,<5' || echo "warning: schemathesis not installed; the API schema test will fail" >&2

# A one-shot build (CI) gains nothing from incremental compilation, which would double the target dir's size.
if [ -n "${CI:-}" ]; then
  export CARGO_INCREMENTAL=0
fi

# The replica's fault injection is compiled in for the tests only (engine failure tests drive it).
features=(--features replica/fault-injection)
cargo fmt --all -- --check
# Every relative Markdown link and #anchor in the repository resolves (no network).
python3 scripts/check-links.py
cargo clippy --workspace --all-targets --locked "${features[@]}" -- -D warnings
cargo clippy --workspace --all-targets --locked -- -D warnings
# No production function over 150 lines (clippy.toml's threshold; tests may tell one scenario at length). The few
# older ones still over it carry an allow naming the split they wait for: the list only shrinks.
cargo clippy --workspace --lib --bins --locked "${features[@]}" -- -D warnings -D clippy::too_many_lines
# The bottom of the crate graph depends on no transport or daemon crate (cargo tree).
scripts/check-deps.sh
# Doc comments: broken intra-doc links and other rustdoc warnings fail the run.
RUSTDOCFLAGS='-D warnings' cargo doc --workspace --no-deps --locked
# Integration tests start the daemons as processes: build every binary first.
cargo build --workspace --bins --locked "${features[@]}"
# The README's quick start, non-interactively, on that same debug build (its debug branch builds exactly the above,
# so nothing is compiled again): a fresh data dir, port 0 (the manager picks one and reports it), the 1 MiB NBD
# round trip, a clean stop.
quickstart_data=$(mktemp -d)
CORRAL_PROFILE=debug CORRAL_DATA=$quickstart_data CORRAL_PORT=0 CORRAL_SIZE=64M \
  scripts/quickstart.sh --once
# Its stop leaves nothing running (every daemon the manager started names the data dir on its command line).
if left=$(pgrep -af -- "$quickstart_data"); then
  echo "the quick start's stop left processes running:" >&2
  echo "$left" >&2
  exit 1
fi
rm -rf "$quickstart_data"
if cargo nextest --version >/dev/null 2>&1; then
  status=0
  cargo nextest run --workspace --locked --no-fail-fast "${features[@]}" "$@" || status=$?
  # The slowest tests of this run (CONTRIBUTING.md keeps the list; anything past ~2 minutes is #[ignore]d).
  python3 scripts/slowest-tests.py 15 || true
  exit $status
else
  cargo test --workspace --locked --no-fail-fast "${features[@]}" "$@"
fi
