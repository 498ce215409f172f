#!/usr/bin/env bash
# lvstore micro-benchmark (issue 20): 4 KiB random write IOPS on a thin lvol vs a plain preallocated file (same
# loop, O_DIRECT pwrite), on a fully written lvol, right after a snapshot of it (copy-on-write path), and the
# snapshot time of a fully written lvol vs a 64 GiB thin one. Builds the release example, then runs it.
#
#   bench/lvstore/run.sh [--dir DIR (/var/tmp)] [--seconds N (5)] [--size-gib N (1)]
#
# Needs about 2 × size-gib of free space in DIR on a file system that takes O_DIRECT.
# CARGO_TARGET_DIR defaults to target-bench; BIN_DIR skips the build and uses the example from that directory.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target-bench}"

if [[ -z "${BIN_DIR:-}" ]]; then
  (cd "$ROOT" && CARGO_TARGET_DIR="$TARGET" cargo build --release -q -p lvstore --examples)
  BIN_DIR="$TARGET/release"
fi

echo "# $(uname -r), $(nproc) cores, $(findmnt -no FSTYPE,SOURCE --target "${BENCH_DIR:-/var/tmp}" 2>/dev/null || true), git $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
exec "$BIN_DIR/examples/bench_lvstore" "$@"
