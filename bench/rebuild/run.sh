#!/usr/bin/env bash
# Replica rebuild benchmark (issue 16 item 5): `corral-engine replica add` of a fresh replica into a 4 GiB volume
# holding 2 GiB of data, on the same host as the source replica, against `cp --sparse=always` of the source's
# snapshot file on the same disk, in one run: the local copy path (the target copies the source's files with
# copy_file_range) and the network path (the target started with --no-local-copy pulls them through sparse-sync
# over loopback), for two layouts: dense (2 GiB in one piece) and frag (4 KiB of data, 4 KiB hole, over 4 GiB).
# Then fio IOPS (4 KiB random read/write 50/50, qd16, over NBD) without a rebuild and during a local rebuild.
#
#   bench/rebuild/run.sh                                   # 4 GiB volume, 2 GiB data, both layouts
#   SIZE_MIB=1024 PATTERNS=dense bench/rebuild/run.sh      # quicker
#   BUSY_RATES="64M 32M" bench/rebuild/run.sh             # one rebuild under IO per busy rate (default: the engine's)
#
# Every timing starts from a warm page cache for the source and ends when the copy is durable (the rebuild ends when
# the engine has the new replica RW: its files fsynced and renamed; cp is followed by `sync FILE`; cp runs before and
# after the rebuilds, its best counts). Each rebuilt snapshot file is compared with `cmp`. BIN_DIR=DIR takes prebuilt
# corral-replica and corral-engine from DIR. Needs ~3x the data free in BENCH_DIR (default /var/tmp).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DIR="${BENCH_DIR:-/var/tmp/corral-bench-rebuild}"
SIZE_MIB="${SIZE_MIB:-4096}"
PATTERNS="${PATTERNS:-dense frag}"
FIO_SECONDS="${FIO_SECONDS:-5}"

for tool in fio qemu-img python3 bc; do
  command -v "$tool" >/dev/null || { echo "run.sh: $tool is missing" >&2; exit 1; }
done
if [[ -z "${BIN_DIR:-}" ]]; then
  (cd "$ROOT" && cargo build --release -q -p replica -p engine --bins)
  BIN_DIR="${CARGO_TARGET_DIR:-$ROOT/target}/release"
fi
REPLICA="$BIN_DIR/corral-replica"
ENGINE="$BIN_DIR/corral-engine"

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT

# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"

now() { date +%s.%N; }

start_replica() { # name [flags...] -> sets RADDR (replica address), RPID
  local name=$1 r=$DIR/$1.ready
  shift
  "$REPLICA" --ready-file "$r" serve --dir "$DIR/$name" --listen 127.0.0.1:0 --data-listen 127.0.0.1:0 \
    --sync-listen 127.0.0.1:0 "$@" >"$DIR/$name.log" 2>&1 & PIDS+=($!)
  RPID=$!
  ready_wait "$r" "$RPID"
  RADDR="tcp://$(ready_addr "$r" control)?data=$(ready_addr "$r" data)&sync=$(ready_addr "$r" sync)"
}

# rebuild NAME [flags...]: adds a fresh replica, prints the seconds until it is RW; checks the copied files, then
# removes it again. Writes the job's bytesCopiedLocally to $DIR/local-bytes.
rebuild() {
  local name=$1 t0 t1 job
  shift
  start_replica "$name" "$@"
  local pid=$RPID addr=$RADDR
  t0=$(now)
  job=$("$ENGINE" --url "$EADDR" replica add "$addr" --json)
  t1=$(now)
  python3 -c 'import json,sys; print(json.loads(sys.argv[1]).get("bytesCopiedLocally", 0))' "$job" >"$DIR/local-bytes"
  cmp "$SNAP" "$DIR/$name/volume-snap-s1.img" || { echo "rebuilt s1 differs from the source" >&2; exit 1; }
  "$ENGINE" --url "$EADDR" replica rm "$addr" >/dev/null
  kill "$pid"; wait "$pid" 2>/dev/null || true
  rm -rf "${DIR:?}/$name"
  echo "$t1 - $t0" | bc -l
}

cp_once() {
  local t0 t1
  rm -f "$DIR/cp.img"
  t0=$(now)
  cp --sparse=always "$SNAP" "$DIR/cp.img"
  sync "$DIR/cp.img"
  t1=$(now)
  rm -f "$DIR/cp.img"
  echo "$t1 - $t0" | bc -l
}

# fio_iops SECONDS [LOG]: 4 KiB random read/write over NBD for SECONDS; prints total IOPS.
fio_iops() {
  fio --ioengine=nbd --uri="$URI" --name=io --rw=randrw --bs=4k --iodepth=16 --time_based --runtime="$1" \
    --size="$((SIZE_MIB << 20))" --output-format=json ${2:+--write_iops_log="$2" --log_avg_msec=250} \
    | python3 -c 'import json,sys; t=sys.stdin.read(); j=json.loads(t[t.index("{"):]); jb=j["jobs"][0]; print(round(jb["read"]["iops"]+jb["write"]["iops"]))'
}

printf '%-6s %9s %14s %12s %10s %12s %12s %10s\n' pattern "cp s" "rebuild local" "local/cp" "net s" "net/cp" \
  "fio IOPS" "during/without"
for pattern in $PATTERNS; do
  rm -rf "$DIR"; mkdir -p "$DIR"
  start_replica src
  SRC_ADDR=$RADDR
  "$ENGINE" --ready-file "$DIR/e.ready" serve --volume vol --size "$((SIZE_MIB << 20))" --listen 127.0.0.1:0 \
    --replica "$SRC_ADDR" --nbd-listen "unix:$DIR/vol.sock" >"$DIR/engine.log" 2>&1 & PIDS+=($!)
  ready_wait "$DIR/e.ready" "$!"
  EADDR=$(ready_addr "$DIR/e.ready" control)
  URI="nbd+unix:///vol?socket=$DIR/vol.sock"
  half=$((SIZE_MIB / 2))
  case $pattern in
    dense) fio --ioengine=nbd --uri="$URI" --name=fill --rw=write --bs=1m --iodepth=8 --size="${half}M" \
             --end_fsync=1 >/dev/null ;;
    frag)  fio --ioengine=nbd --uri="$URI" --name=fill --rw=write:4k --bs=4k --iodepth=32 \
             --size="${SIZE_MIB}M" --end_fsync=1 >/dev/null ;;
    *) echo "unknown pattern $pattern" >&2; exit 1 ;;
  esac
  "$ENGINE" --url "$EADDR" snapshot create s1 >/dev/null
  SNAP="$DIR/src/volume-snap-s1.img"
  cat "$SNAP" >/dev/null
  sync   # the fill's writeback must not land inside the first timing

  cp_s=$(cp_once)
  local_s=$(rebuild local)
  [[ "$(cat "$DIR/local-bytes")" -gt 0 ]] || { echo "the local rebuild did not take the local path" >&2; exit 1; }
  net_s=$(rebuild net --no-local-copy)
  [[ "$(cat "$DIR/local-bytes")" -eq 0 ]] || { echo "the --no-local-copy rebuild copied locally" >&2; exit 1; }
  c=$(cp_once); cp_s=$(echo "if ($c < $cp_s) $c else $cp_s" | bc -l)

  # IO without a rebuild, then during one per busy rate: fio logs IOPS every 250 ms; the rebuild's window is cut
  # out of the log. After the first rebuild, IO with both replicas RW: the ceiling of IO during a rebuild, since
  # the rebuilding (WO) replica receives every write too.
  without=$(fio_iops "$FIO_SECONDS")
  first=1 extra=""
  for rate in ${BUSY_RATES:-default}; do
    rate_args=()
    [[ $rate == default ]] || rate_args=(--busy-rate "$rate")
    start_replica during
    dpid=$RPID daddr=$RADDR
    rm -f "$DIR"/iops_iops.*.log
    fio_t0=$(now)
    fio_iops 180 "$DIR/iops" >/dev/null & fpid=$!
    sleep 1
    r0=$(now)
    "$ENGINE" --url "$EADDR" replica add "$daddr" "${rate_args[@]}" >/dev/null
    r1=$(now)
    kill -INT "$fpid"; wait "$fpid" 2>/dev/null || true
    d=$(python3 - "$DIR"/iops_iops.*.log "$(echo "($r0 - $fio_t0) * 1000" | bc -l)" "$(echo "($r1 - $fio_t0) * 1000" | bc -l)" <<'EOF'
import sys
*logs, a, b = sys.argv[1:]
a, b = float(a), float(b)
per = {}
for log in logs:
    for line in open(log):
        f = [x.strip() for x in line.split(",")]
        t, v = int(f[0]), int(f[1])
        if a <= t <= b + 250:
            per[t] = per.get(t, 0) + v  # read and write lines of one interval add up
print(round(sum(per.values()) / len(per)) if per else 0)
EOF
)
    rb=$(echo "$r1 - $r0" | bc -l)
    if [[ -n $first ]]; then
      during=$d rebuild_during=$rb first=""
      two=$(fio_iops "$FIO_SECONDS")
      extra+=$(printf '\n       with 2 replicas RW (no rebuild): %s IOPS, %.2fx of without' "$two" "$(echo "$two / $without" | bc -l)")
    fi
    extra+=$(printf '\n       busy rate %s: %s IOPS during, %.2fx of without; rebuild under IO %.2f s' "$rate" "$d" \
      "$(echo "$d / $without" | bc -l)" "$rb")
    "$ENGINE" --url "$EADDR" replica rm "$daddr" >/dev/null
    kill "$dpid"; wait "$dpid" 2>/dev/null || true
    rm -rf "${DIR:?}/during"
  done
  printf '%-6s %9.2f %14.2f %11.2fx %10.2f %11.2fx %12s %9.2fx  (rebuild under IO %.2f s; fio %s -> %s IOPS)%s\n' \
    "$pattern" "$cp_s" "$local_s" "$(echo "$cp_s / $local_s" | bc -l)" "$net_s" "$(echo "$cp_s / $net_s" | bc -l)" \
    "$without" "$(echo "$during / $without" | bc -l)" "$rebuild_during" "$without" "$during" "$extra"
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  PIDS=()
done
echo "(volume ${SIZE_MIB} MiB; local/cp and net/cp are speed ratios: cp seconds / rebuild seconds; one run)"
