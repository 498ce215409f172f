#!/usr/bin/env bash
# v2 backing images (issue 21), the disk daemons alone (no manager), on loopback, against a plain file copy of the
# same data on the same disk, in one run:
#
#   first copy  `corral-replica lvstore backing-image create --from-file` (and `--from-url`, python http.server)
#               into store A: data blocks written into the temp head, SHA-512 of every byte, snapshot + xattrs
#               -- against `cp --sparse=always` of the file (+ `sync`), and `sha512sum` of it for reference;
#   sync        `backing-image create --from-lvstore A` into store B: A exposes its snapshot lvol over
#               sparse-sync, B writes it into its temp head and checks the SHA-512 over it
#               -- against `corral-sync copy` of the file (+ its fsync).
#
# Images: `dense` (SIZE_MIB of random data) and `half` (1 MiB random, 1 MiB zeros, alternating; the zeros are
# holes in the file). Each round runs every tool once, in turn (interleaved); the table gives each tool's median
# seconds and the median over rounds of the per-round ratio v2 / peer. `wchar` is what the target daemon passed
# to write(2)/pwrite(2) during the copy (/proc/PID/io), over the image's data bytes: 1.00 means every byte written
# once and no zero block written.
#
#   BIN_DIR=target/release bench/bim/v2.sh                 # 2 GiB, dense and half, 3 rounds
#   SIZE_MIB=256 ROUNDS=1 IMAGES=half BIN_DIR=... bench/bim/v2.sh
#
# Binaries are copied into the work directory first (a concurrent build cannot swap them). Needs about
# 4 x SIZE_MIB free in BENCH_DIR (default /var/tmp/corral-bench-bi-v2), removed at the end.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
# shellcheck source=../lib.sh
source "$ROOT/bench/lib.sh"
DIR="${BENCH_DIR:-/var/tmp/corral-bench-bi-v2}"
SIZE_MIB="${SIZE_MIB:-2048}"
ROUNDS="${ROUNDS:-3}"
IMAGES="${IMAGES:-dense half}"
[[ -n "${BIN_DIR:-}" ]] || { echo "set BIN_DIR (cargo build --release -p replica -p sparse-sync --bins)" >&2; exit 1; }

PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [[ -n "$p" ]] && kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
rm -rf "$DIR"
mkdir -p "$DIR/bin" "$DIR/www"
cp "$BIN_DIR/corral-replica" "$BIN_DIR/corral-sync" "$DIR/bin/"
REPLICA="$DIR/bin/corral-replica"
SYNC="$DIR/bin/corral-sync"
SIZE=$((SIZE_MIB << 20))

gen() {  # gen NAME -> $DIR/www/NAME.raw
  python3 - "$DIR/www/$1.raw" "$SIZE_MIB" "$1" <<'PY'
import os, sys
path, mib, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.ftruncate(fd, mib << 20)
for i in range(mib):
    if kind == "dense" or i % 2 == 0:
        os.pwrite(fd, os.urandom(1 << 20), i << 20)
os.fsync(fd)
os.close(fd)
PY
}

start_store() {  # start_store NAME -> sets ADDR_NAME, PID_NAME
  local name=$1
  truncate -s "$((SIZE_MIB * 5 / 2 + 256))M" "$DIR/$name.disk"
  rm -f "$DIR/$name.ready"
  "$REPLICA" --ready-file "$DIR/$name.ready" serve-lvstore --format --disk "$DIR/$name.disk" \
    --listen 127.0.0.1:0 > "$DIR/$name.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  ready_wait "$DIR/$name.ready" "$pid"
  printf -v "ADDR_$name" '%s' "$(ready_addr "$DIR/$name.ready" control)"
  printf -v "PID_$name" '%s' "$pid"
}

bi() { local addr=$1; shift; "$REPLICA" lvstore --url "$addr" backing-image "$@"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'; }
wchar() { sed -n 's/^wchar: //p' "/proc/$1/io"; }
warm() { cat "$1" > /dev/null; }

start_store a
start_store b
http_serve "$DIR/www"
PIDS+=("$HTTP_PID")
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)

# One timed step: sets SECS; for a v2 copy also WRATIO (target daemon's wchar / data bytes).
step() {
  local tool=$1 img=$2 file="$DIR/www/$2.raw" t0 w0 pid=""
  rm -f "$DIR/dst"; sync
  case $tool in
    v2-file | v2-url) bi "$ADDR_a" rm "$img" >/dev/null 2>&1 || true; pid=$PID_a ;;
    v2-sync) bi "$ADDR_b" rm "$img" >/dev/null 2>&1 || true; pid=$PID_b ;;
  esac
  warm "$file"
  [[ -n "$pid" ]] && w0=$(wchar "$pid")
  t0=$(now)
  case $tool in
    cp) cp --sparse=always "$file" "$DIR/dst" && sync "$DIR/dst" ;;
    sha512sum) sha512sum "$file" > /dev/null ;;
    corral-sync) "$SYNC" copy "$file" "$DIR/dst" > /dev/null 2>&1 ;;
    v2-file) bi "$ADDR_a" create "$img" --from-file "$file" --checksum "$SUM" > /dev/null ;;
    v2-url) bi "$ADDR_a" create "$img" --from-url "http://127.0.0.1:$HTTP_PORT/$img.raw" --checksum "$SUM" > /dev/null ;;
    v2-sync) bi "$ADDR_b" create "$img" --from-lvstore "$ADDR_a" --checksum "$SUM" > /dev/null ;;
  esac
  SECS=$(since "$t0")
  WRATIO=""
  [[ -n "$pid" ]] && WRATIO=$(awk -v a="$w0" -v b="$(wchar "$pid")" -v d="$DATA" 'BEGIN { printf "%.2f", (b - a) / d }')
  return 0
}

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

TOOLS=(cp sha512sum v2-file v2-url corral-sync v2-sync)
declare -A PEER=([v2-file]=cp [v2-url]=cp [v2-sync]=corral-sync)
printf '%-30s %-12s %10s %12s %16s %8s\n' "image" "tool" "median s" "data MiB/s" "v2/peer (median)" "wchar"
for img in $IMAGES; do
  gen "$img"
  SUM=$(sha512sum "$DIR/www/$img.raw" | cut -d' ' -f1)
  DATA=$("$SYNC" --json layout "$DIR/www/$img.raw" | sed -n 's/.*"data_bytes":\([0-9]*\).*/\1/p')
  declare -A T=() W=() R=()
  for _ in $(seq 1 "$ROUNDS"); do
    declare -A round=()
    for tool in "${TOOLS[@]}"; do
      step "$tool" "$img"
      round[$tool]=$SECS
      T[$tool]+="$SECS "
      [[ -n "$WRATIO" ]] && W[$tool]+="$WRATIO "
    done
    for tool in "${!PEER[@]}"; do
      R[$tool]+="$(awk -v a="${round[$tool]}" -v b="${round[${PEER[$tool]}]}" 'BEGIN { printf "%.3f", a / b }') "
    done
    unset round
  done
  # The copies must be what was asked for: ready with the image's checksum, holes kept (used space = data).
  for addr in "$ADDR_a" "$ADDR_b"; do
    got=$(bi "$addr" --json get "$img" | python3 -c 'import json,sys; i=json.load(sys.stdin); print(i["state"], i.get("currentChecksum", i.get("current_checksum","")))')
    [[ "$got" == "ready $SUM" ]] || { echo "MISMATCH on $addr: $got" >&2; exit 1; }
  done
  label="$img ($SIZE_MIB MiB, $((DATA >> 20)) data)"
  for tool in "${TOOLS[@]}"; do
    m=$(tr ' ' '\n' <<< "${T[$tool]}" | grep . | median)
    ratio=""; [[ -n "${R[$tool]:-}" ]] && ratio="$(tr ' ' '\n' <<< "${R[$tool]}" | grep . | median) vs ${PEER[$tool]}"
    w=""; [[ -n "${W[$tool]:-}" ]] && w=$(tr ' ' '\n' <<< "${W[$tool]}" | grep . | median)
    printf '%-30s %-12s %10.2f %12.0f %16s %8s\n' "$label" "$tool" "$m" \
      "$(awk -v d="$DATA" -v s="$m" 'BEGIN { print d / 1048576 / s }')" "$ratio" "$w"
  done
  echo "  per-round seconds: $(for t in "${TOOLS[@]}"; do printf '%s=[%s] ' "$t" "${T[$t]% }"; done)"
  unset T W R
  bi "$ADDR_a" rm "$img" > /dev/null
  bi "$ADDR_b" rm "$img" > /dev/null
  rm -f "$DIR/www/$img.raw"
done
echo "load average before: $LOAD_BEFORE, after: $(cut -d' ' -f1-3 /proc/loadavg)"
