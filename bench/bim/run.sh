#!/usr/bin/env bash
# Backing-image sync benchmark: `corral-bim sync` of one image between two disk directories over loopback (two
# managers, sparse-sync receiver on B, sender on A, SHA-512 verification on B before `ready`) against
# `corral-sync copy` of the same file (local sparse copy, no HTTP, no verification). Prints a table.
#
#   bench/bim/run.sh                 # 2 GiB image, 50% holes (2 MiB data / 2 MiB hole, random data)
#   SIZE_MIB=512 bench/bim/run.sh    # smaller, quicker
#
# Every timing includes the destination's fsync (both tools flush before they report done) and starts from a warm
# page cache for the source. Needs about 3x SIZE_MIB/2 free under BENCH_DIR.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DIR="${BENCH_DIR:-/var/tmp/corral-bench-bim}"
SIZE_MIB="${SIZE_MIB:-2048}"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"

if [[ -z "${BIN_DIR:-}" ]]; then
  (cd "$ROOT" && cargo build --release -q -p backing-image-manager -p sparse-sync --bins)
  BIN_DIR="$TARGET/release"
fi
BIM="$BIN_DIR/corral-bim"
SYNC="$BIN_DIR/corral-sync"

PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [[ -n "$p" ]] && kill "$p" 2>/dev/null || true; done
  rm -rf "$DIR/a" "$DIR/b" "$DIR/copy"
}
trap cleanup EXIT

mkdir -p "$DIR"
rm -rf "$DIR/a" "$DIR/b" "$DIR/copy"
mkdir -p "$DIR/a/backing-images/img-u1" "$DIR/b"
echo '{"diskUUID": "bench-a"}' > "$DIR/a/corral-disk.cfg"
echo '{"diskUUID": "bench-b"}' > "$DIR/b/corral-disk.cfg"

SRC="$DIR/a/backing-images/img-u1/backing"
python3 - "$SRC" "$SIZE_MIB" <<'PY'
import os, sys
path, mib = sys.argv[1], int(sys.argv[2])
size = mib << 20
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.ftruncate(fd, size)
for off in range(0, size, 4 << 20):  # 2 MiB of data, then a 2 MiB hole
    os.pwrite(fd, os.urandom(2 << 20), off)
os.fsync(fd); os.close(fd)
PY
SUM=$(sha512sum "$SRC" | cut -d' ' -f1)
SIZE=$((SIZE_MIB << 20))

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
start_bim() { # DISK UUID -> sets ADDR
  local port http
  port=$(free_port); http=$(free_port)
  "$BIM" serve --listen "127.0.0.1:$port" --http-listen "127.0.0.1:$http" --disk-path "$1" --disk-uuid "$2" \
    --port-range 34000-34010 2>"$1.log" &
  PIDS+=($!)
  ADDR="127.0.0.1:$port"
  for _ in $(seq 1 500); do "$BIM" --url "$ADDR" version >/dev/null 2>&1 && return; sleep 0.02; done
  echo "corral-bim on $1 did not start" >&2; cat "$1.log" >&2; exit 1
}
now() { date +%s.%N; }

start_bim "$DIR/a" bench-a; A=$ADDR
start_bim "$DIR/b" bench-b; B=$ADDR
# A adopts the file in place (hashes it once).
"$BIM" --url "$A" fetch --name img --uuid u1 --size "$SIZE" --checksum "$SUM" >/dev/null

cat "$SRC" >/dev/null
t0=$(now)
"$BIM" --url "$B" sync --name img --uuid u1 --size "$SIZE" --checksum "$SUM" --from "$A" >/dev/null
t1=$(now)
BIM_S=$(echo "$t1 - $t0" | bc -l)
[[ $(sha512sum "$DIR/b/backing-images/img-u1/backing" | cut -d' ' -f1) == "$SUM" ]] || { echo "copy differs" >&2; exit 1; }
B_ALLOC=$(( $(stat -c %b "$DIR/b/backing-images/img-u1/backing") * 512 ))

cat "$SRC" >/dev/null
t0=$(now)
"$SYNC" copy "$SRC" "$DIR/copy" 2>/dev/null
t1=$(now)
COPY_S=$(echo "$t1 - $t0" | bc -l)

# The verification share: the SHA-512 B computes before `ready` (the same file, warm cache).
t0=$(now); sha512sum "$DIR/b/backing-images/img-u1/backing" >/dev/null; t1=$(now)
HASH_S=$(echo "$t1 - $t0" | bc -l)

printf '\n%s MiB image, 50%% holes (data %s MiB); B allocated %s MiB after the sync\n\n' \
  "$SIZE_MIB" "$((SIZE_MIB / 2))" "$((B_ALLOC >> 20))"
printf '%-44s %9s %11s %8s\n' "method" "seconds" "MiB/s(img)" "ratio"
row() { printf '%-44s %9.2f %11.0f %8.2f\n' "$1" "$2" "$(echo "$SIZE_MIB / $2" | bc -l)" "$(echo "$2 / $COPY_S" | bc -l)"; }
row "corral-sync copy (local, no verification)" "$COPY_S"
row "corral-bim sync A->B (loopback, verified)" "$BIM_S"
row "  of which: sha512sum of the copy (approx.)" "$HASH_S"
