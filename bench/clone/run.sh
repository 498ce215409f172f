#!/usr/bin/env bash
# Volume clone benchmark: `corral-engine snapshot clone` of a 4 GiB volume holding 1 GiB of data, source and target
# replica on this host: the local copy path (the target copies the source's snapshot files with copy_file_range) and
# the network path (a target replica started with --no-local-copy: VolumeExport/SnapshotClone and sparse-sync over
# loopback), against
# `cp --sparse=always` of the source snapshot file on the same disk, in one run, and `corral-sync` serve + send of the
# same file over loopback (the clone's transport alone: the difference to it is what the clone path adds). Prints the
# three and the ratios.
#
#   bench/clone/run.sh                              # 4 GiB volume, 1 GiB data
#   SIZE_MIB=1024 DATA_MIB=256 bench/clone/run.sh   # smaller, quicker
#
# All timings start from a warm page cache for the source and include making the copy durable (the receivers fsync
# before their commit; cp is followed by `sync FILE`; cp runs twice, its best counts). Needs ~2.5x DATA_MIB free in
# BENCH_DIR. BIN_DIR=DIR takes prebuilt corral-replica, corral-engine and corral-sync from DIR instead of building.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DIR="${BENCH_DIR:-/var/tmp/corral-bench-clone}"
SIZE_MIB="${SIZE_MIB:-4096}"
DATA_MIB="${DATA_MIB:-1024}"

if [[ -z "${BIN_DIR:-}" ]]; then
  (cd "$ROOT" && cargo build --release -q -p replica -p engine -p sparse-sync --bins)
  BIN_DIR="${CARGO_TARGET_DIR:-$ROOT/target}/release"
fi
REPLICA="$BIN_DIR/corral-replica"
ENGINE="$BIN_DIR/corral-engine"
SYNC="$BIN_DIR/corral-sync"

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
rm -rf "$DIR"; mkdir -p "$DIR"

# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"

start_volume() { # name [frontend [replica flags...]] -> sets ADDR_<name> (engine gRPC); listeners on port 0
  local name=$1 frontend=${2:-}
  shift; shift || true
  local r=$DIR/$name-r.ready e=$DIR/$name-e.ready replica
  "$REPLICA" --ready-file "$r" serve --dir "$DIR/$name-r" --listen 127.0.0.1:0 --data-listen 127.0.0.1:0 \
    --sync-listen 127.0.0.1:0 "$@" >"$DIR/$name-r.log" 2>&1 & PIDS+=($!)
  ready_wait "$r" "$!"
  replica="tcp://$(ready_addr "$r" control)?data=$(ready_addr "$r" data)&sync=$(ready_addr "$r" sync)"
  "$ENGINE" --ready-file "$e" serve --volume "$name" --size "$((SIZE_MIB << 20))" --listen 127.0.0.1:0 \
    --replica "$replica" ${frontend:+--nbd-listen "unix:$DIR/$name.sock"} >"$DIR/$name-e.log" 2>&1 & PIDS+=($!)
  ready_wait "$e" "$!"
  printf -v "ADDR_$name" '%s' "$(ready_addr "$e" control)"
}

now() { date +%s.%N; }

start_volume src frontend
start_volume tgt   # no frontend: a clone refuses a target whose frontend serves IO
start_volume tgtnet "" --no-local-copy
half=$((DATA_MIB / 2))
echo "writing ${DATA_MIB} MiB into the ${SIZE_MIB} MiB source volume through NBD..." >&2
qemu-io -f raw "nbd+unix:///src?socket=$DIR/src.sock" \
  -c "write -P 0x5a 0 ${half}M" -c "write -P 0x6b $((SIZE_MIB / 2))M $((DATA_MIB - half))M" -c flush >/dev/null
"$ENGINE" --url "$ADDR_src" snapshot create s1 >/dev/null
SNAP="$DIR/src-r/volume-snap-s1.img"
cat "$SNAP" >/dev/null   # warm cache for both runs
sync   # the fill's writeback must not land inside the first timing

t0=$(now)
"$ENGINE" --url "$ADDR_tgt" snapshot clone --from-engine "$ADDR_src" --snapshot s1 >/dev/null
t1=$(now)
clone_s=$(echo "$t1 - $t0" | bc -l)
cloned="$DIR/tgt-r/volume-snap-s1.img"
cmp "$SNAP" "$cloned" || { echo "clone differs from the source snapshot" >&2; exit 1; }
grep -q "clone: local copy done" "$DIR/tgt-r.log" || { echo "the clone did not take the local path" >&2; exit 1; }

t0=$(now)
"$ENGINE" --url "$ADDR_tgtnet" snapshot clone --from-engine "$ADDR_src" --snapshot s1 >/dev/null
t1=$(now)
net_s=$(echo "$t1 - $t0" | bc -l)
cmp "$SNAP" "$DIR/tgtnet-r/volume-snap-s1.img" || { echo "network clone differs from the source snapshot" >&2; exit 1; }
! grep -q "clone: local copy done" "$DIR/tgtnet-r.log" || { echo "--no-local-copy copied locally" >&2; exit 1; }

t0=$(now)
cp --sparse=always "$SNAP" "$DIR/cp.img"
sync "$DIR/cp.img"
t1=$(now)
cp_s=$(echo "$t1 - $t0" | bc -l)

rm -f "$DIR/cp.img"
t0=$(now)
"$SYNC" --json serve --listen 127.0.0.1:0 --file "$DIR/sync.img" --idle-timeout 60 >"$DIR/serve.out" & PIDS+=($!)
addr=""
for _ in $(seq 1 500); do
  addr=$(head -1 "$DIR/serve.out" 2>/dev/null | sed -n 's/.*"address":"\([^"]*\)".*/\1/p')
  [[ -n "$addr" ]] && break; sleep 0.01
done
[[ -n "$addr" ]] || { echo "corral-sync serve did not start" >&2; exit 1; }
"$SYNC" --json send --file "$SNAP" --to "$addr" --workers 4 >/dev/null
wait "${PIDS[-1]}"
t1=$(now)
sync_s=$(echo "$t1 - $t0" | bc -l)
cmp "$SNAP" "$DIR/sync.img" || { echo "corral-sync copy differs from the source snapshot" >&2; exit 1; }
rm -f "$DIR/sync.img"

t0=$(now)   # cp again, after the others: the best of its two runs is the reference
cp --sparse=always "$SNAP" "$DIR/cp.img"
sync "$DIR/cp.img"
t1=$(now)
cp_s=$(echo "if ($t1 - $t0 < $cp_s) $t1 - $t0 else $cp_s" | bc -l)

alloc() { echo $(( $(stat -c %b "$1") * 512 >> 20 )); }
printf '%-38s %10s %12s %14s\n' "method" "seconds" "MiB/s data" "allocated MiB"
printf '%-38s %10.2f %12.0f %14s\n' "snapshot clone (local copy)" "$clone_s" "$(echo "$DATA_MIB / $clone_s" | bc -l)" "$(alloc "$cloned")"
printf '%-38s %10.2f %12.0f %14s\n' "snapshot clone (network, loopback)" "$net_s" "$(echo "$DATA_MIB / $net_s" | bc -l)" "$(alloc "$DIR/tgtnet-r/volume-snap-s1.img")"
printf '%-38s %10.2f %12.0f %14s\n' "cp --sparse=always (same disk)" "$cp_s" "$(echo "$DATA_MIB / $cp_s" | bc -l)" "$(alloc "$DIR/cp.img")"
printf '%-38s %10.2f %12.0f %14s\n' "corral-sync serve + send (loopback)" "$sync_s" "$(echo "$DATA_MIB / $sync_s" | bc -l)" "-"
printf 'clone / cp time ratio: local %.2f, network %.2f   network clone / corral-sync: %.2f   (volume %s MiB, data %s MiB, one run)\n' \
  "$(echo "$clone_s / $cp_s" | bc -l)" "$(echo "$net_s / $cp_s" | bc -l)" "$(echo "$net_s / $sync_s" | bc -l)" "$SIZE_MIB" "$DATA_MIB"
