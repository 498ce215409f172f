#!/usr/bin/env bash
# Replica benchmarks (issue 2). Builds the release daemon and examples, then runs one of:
#
#   bench/replica/run.sh [data-path] [ARGS…]   # data protocol over loopback vs pwrite/pread (default)
#   bench/replica/run.sh large-chain [ARGS…]   # 1 TiB sparse volume, 500 snapshots: open time and RSS
#
# ARGS go to the example (`--help` lists them), e.g. `bench/replica/run.sh --seconds 5`,
# `bench/replica/run.sh large-chain --snapshots 100 --drop-caches`.
# CARGO_TARGET_DIR defaults to target-bench; BIN_DIR skips the build and uses binaries from that directory.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target-bench}"

bench=bench_data_path
case "${1:-}" in
  data-path) shift ;;
  large-chain) bench=bench_large_chain; shift ;;
esac

if [[ -z "${BIN_DIR:-}" ]]; then
  (cd "$ROOT" && CARGO_TARGET_DIR="$TARGET" cargo build --release -q -p replica --examples --bins)
  BIN_DIR="$TARGET/release"
fi

echo "# $(uname -r), $(nproc) cores, $(findmnt -no FSTYPE,SOURCE --target /var/tmp 2>/dev/null || true), git $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
exec "$BIN_DIR/examples/$bench" --bin "$BIN_DIR/corral-replica" "$@"
