#!/usr/bin/env bash
# Sparse sync benchmark: corral-sync over loopback (and its local copy) against `cp --sparse=always` and
# `rsync --sparse` of the same file on the same disk, in one run. Prints a table of times and ratios to cp.
#
#   bench/sync/run.sh                       # dense 2 GiB + 1 GiB of 4 KiB data / 4 KiB hole
#   DENSE_MIB=512 FRAG_MIB=256 REPEAT=1 bench/sync/run.sh   # smaller, quicker
#
# Every timing includes flushing the destination to disk (`sync FILE`; corral-sync's receiver fsyncs itself),
# starts from a warm page cache for the source, and writes a fresh destination. Needs ~3x the file sizes free.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DIR="${BENCH_DIR:-/var/tmp/corral-bench-sync}"
DENSE_MIB="${DENSE_MIB:-2048}"
FRAG_MIB="${FRAG_MIB:-1024}"
WORKERS="${WORKERS:-4}"
REPEAT="${REPEAT:-2}"   # rounds; each figure is the best of REPEAT runs: the machine is shared and noisy

command -v rsync >/dev/null || { apt-get install -y rsync >/dev/null 2>&1 || true; }
command -v rsync >/dev/null || { echo "rsync is missing (apt-get install -y rsync)" >&2; exit 1; }

if [[ -z "${BIN:-}" ]]; then
  (cd "$ROOT" && CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target-ss}" cargo build --release -q -p sparse-sync)
  BIN="${CARGO_TARGET_DIR:-$ROOT/target-ss}/release/corral-sync"
fi

# Per run: the background delete of an earlier run's trash must not remove this run's.
TRASH="$DIR/trash.$$"
mkdir -p "$TRASH"
# Deleting a fragmented file is slow on a filesystem mounted with `discard` (one discard per extent, minutes for
# 1 GiB of 4 KiB pieces): destinations are moved aside between runs and deleted in the background at the end.
cleanup() {
  # `|| true`: under errexit a failing step here would skip the delete and leave gigabytes behind.
  if [[ -n "${SERVE_PID:-}" ]]; then kill "$SERVE_PID" 2>/dev/null || true; fi
  mv "$DIR/dst" "$TRASH/dst.end" 2>/dev/null || true
  nohup rm -rf "$TRASH" >/dev/null 2>&1 &
}
trap cleanup EXIT

gen_dense() { [[ -f "$DIR/dense" && $(stat -c %s "$DIR/dense") == $((DENSE_MIB << 20)) ]] && return
  head -c "$((DENSE_MIB << 20))" /dev/urandom > "$DIR/dense"; }
gen_frag() { [[ -f "$DIR/frag" && $(stat -c %s "$DIR/frag") == $((FRAG_MIB << 20)) ]] && return
  python3 - "$DIR/frag" "$FRAG_MIB" <<'PY'
import os, sys
path, mib = sys.argv[1], int(sys.argv[2])
size = mib << 20
rnd = os.urandom(1 << 20)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.ftruncate(fd, size)
for off in range(0, size, 8192):  # 4 KiB data, 4 KiB hole
    i = (off // 8192 * 4096) % (len(rnd) - 4096)
    os.pwrite(fd, rnd[i:i + 4096], off)
os.fsync(fd); os.close(fd)
PY
}

now() { date +%s.%N; }
warm() { cat "$1" > /dev/null; }
N=0
fresh() {
  N=$((N + 1))
  if [[ -e "$DIR/dst" ]]; then mv "$DIR/dst" "$TRASH/dst.$N"; fi
  rm -f "$DIR"/dst.* ; sync
  # A destination left over would turn the next run into a delta sync.
  [[ ! -e "$DIR/dst" ]] || { echo "cannot clear $DIR/dst" >&2; exit 1; }
}

run_cp()    { cp --sparse=always "$1" "$DIR/dst" && sync "$DIR/dst"; }
run_rsync() { rsync --sparse "$1" "$DIR/dst" && sync "$DIR/dst"; }
run_local() { "$BIN" copy "$1" "$DIR/dst" 2>/dev/null; }
run_http() {
  local out="$DIR/serve.out"
  rm -f "$out"  # else the address of the previous receiver can be read before this one truncates the file
  "$BIN" --json serve --listen 127.0.0.1:0 --file "$DIR/dst" --idle-timeout 60 > "$out" &
  SERVE_PID=$!
  local addr=""
  for _ in $(seq 1 500); do
    addr=$(head -1 "$out" 2>/dev/null | sed -n 's/.*"address":"\([^"]*\)".*/\1/p')
    [[ -n "$addr" ]] && break; sleep 0.01
  done
  [[ -n "$addr" ]] || { echo "receiver did not start" >&2; exit 1; }
  "$BIN" --json send --file "$1" --to "$addr" --workers "$WORKERS" > "$DIR/send.out"
  wait "$SERVE_PID"; SERVE_PID=""
}

# time_once NAME FILE -> sets SECS to the seconds of one run of tool NAME on FILE, from a fresh destination
# (not a $(…) subshell: `fresh` counts destinations in N)
time_once() {
  local fn=$1 file=$2 t0 t1
  fresh; warm "$file"
  t0=$(now); "$fn" "$file"; t1=$(now)
  SECS=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')
}

verify() {  # destination must equal the source in content and data layout
  cmp -s "$1" "$DIR/dst" || { echo "MISMATCH: content of $1 differs after $2" >&2; exit 1; }
  local a b
  a=$("$BIN" --json layout "$1" | sed -n 's/.*"data_bytes":\([0-9]*\).*/\1/p')
  b=$("$BIN" --json layout "$DIR/dst" | sed -n 's/.*"data_bytes":\([0-9]*\).*/\1/p')
  [[ "$a" == "$b" ]] || { echo "MISMATCH: layout of $1 ($a data bytes) vs copy ($b) after $2" >&2; exit 1; }
}

gen_dense; gen_frag
TOOLS=(cp rsync local http)
printf '%-24s %-26s %9s %10s %9s\n' "file" "tool" "seconds" "data MiB/s" "cp/tool"
for f in dense frag; do
  file="$DIR/$f"
  data_mib=$(( $("$BIN" --json layout "$file" | sed -n 's/.*"data_bytes":\([0-9]*\).*/\1/p') >> 20 ))
  label="$f ($(( $(stat -c %s "$file") >> 20 )) MiB, $data_mib data)"
  # Tools take turns within each round, so a burst of load from other processes hits all of them alike; each
  # figure is the tool's best round.
  declare -A best=()
  for _ in $(seq 1 "$REPEAT"); do
    for tool in "${TOOLS[@]}"; do
      time_once "run_$tool" "$file"; s=$SECS
      [[ $tool == local || $tool == http ]] && verify "$file" "$tool"
      best[$tool]=$(awk -v a="$s" -v b="${best[$tool]:-}" 'BEGIN { if (b == "" || a < b) print a; else print b }')
    done
  done
  cp_s=${best[cp]}
  for tool in "${TOOLS[@]}"; do
    s=${best[$tool]}
    case $tool in
      cp) name="cp --sparse=always";;
      rsync) name="rsync --sparse (local)";;
      local) name="corral-sync copy";;
      http) name="corral-sync loopback x$WORKERS";;
    esac
    printf '%-24s %-26s %9.2f %10.0f %9.2f\n' "$label" "$name" "$s" "$(awk -v d="$data_mib" -v s="$s" 'BEGIN { print d / s }')" \
      "$(awk -v c="$cp_s" -v s="$s" 'BEGIN { print c / s }')"
  done
  unset best
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
