#!/usr/bin/env bash
# Backing-image reads (issue 5): a qcow2 backing file read through the replica vs qemu-io on the same file.
#
#   bench/image/run.sh [ARGS…]     # ARGS go to replica/examples/bench_backing_image.rs (`--help` lists them),
#                                   # e.g. --size 2147483648, --compressed, --cluster-size 2M, --rounds 5
#
# CARGO_TARGET_DIR defaults to target-bench; BIN_DIR skips the build and uses binaries from that directory.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target-bench}"
command -v qemu-io >/dev/null || { echo "qemu-io missing: apt-get install qemu-utils" >&2; exit 1; }

if [[ -z "${BIN_DIR:-}" ]]; then
  (cd "$ROOT" && CARGO_TARGET_DIR="$TARGET" cargo build --release -q -p replica --example bench_backing_image)
  BIN_DIR="$TARGET/release"
fi

echo "# $(uname -r), $(nproc) cores, $(qemu-io --version | head -1), git $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
exec "$BIN_DIR/examples/bench_backing_image" "$@"
