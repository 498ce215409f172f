#!/usr/bin/env bash
# v2 data engine figures of issue 20 that bench/datapath does not give, each beside v1 in the same run:
#
#   snapshot  snapshot creation time through the engine (`corral-engine snapshot create`, median of 5) of a volume
#             of SMALL and of LARGE bytes, both fully written first (fio, 1 MiB sequential writes + fsync), on one
#             v1 replica and on one v2 replica; next to it the same CLI's round trip for `info` (the process and
#             gRPC cost every figure carries). LARGE is cut to what the disk holds while leaving MIN_FREE_GIB free.
#   rss       the v2 disk daemon's RSS with REPLICAS replicas hosted and served (each with its three listeners),
#             SNAPSHOTS snapshots each, on one lvstore, against the summed RSS of REPLICAS v1 replica processes
#             with as many snapshots each. Snapshots are taken through each replica's ReplicaService
#             (`corral-replica snapshot create`); the heads hold no data (metadata only). Read right after the
#             last snapshot and once settled (polled until it holds still, 10 s at most); the target is checked
#             on the settled figure.
#
#   bench/v2/run.sh                                 # both parts: SMALL=1G LARGE=32G REPLICAS=200 SNAPSHOTS=20
#   PARTS=rss REPLICAS=50 bench/v2/run.sh           # a subset, smaller
#
# Environment: PARTS ("snapshot rss"), SMALL (1G), LARGE (32G), MIN_FREE_GIB (25), REPLICAS (200), SNAPSHOTS (20),
# REPLICA_SIZE (64M), PARALLEL (4: CLI calls in flight), BENCH_DIR (/var/tmp), BIN_DIR (skip the release build and
# take corral-* from there), KEEP=1 (keep the work directory's logs).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PARTS="${PARTS:-snapshot rss}"
SMALL="${SMALL:-1G}"
LARGE="${LARGE:-32G}"
MIN_FREE_GIB="${MIN_FREE_GIB:-25}"
REPLICAS="${REPLICAS:-200}"
SNAPSHOTS="${SNAPSHOTS:-20}"
REPLICA_SIZE="${REPLICA_SIZE:-64M}"
PARALLEL="${PARALLEL:-4}"
BENCH_DIR="${BENCH_DIR:-/var/tmp}"
READY_DEADLINE=30

for tool in fio python3 fallocate numfmt; do
  command -v "$tool" >/dev/null || { echo "run.sh: $tool is missing" >&2; exit 1; }
done
if [[ -z "${BIN_DIR:-}" ]]; then
  (cd "$ROOT" && cargo build --release -q -p replica -p engine --bins)
  BIN_DIR="${CARGO_TARGET_DIR:-$ROOT/target}/release"
fi
WORK="$(mktemp -d "$BENCH_DIR/corral-v2bench.XXXXXX")"
mkdir -p "$WORK/bin"
cp "$BIN_DIR/corral-replica" "$BIN_DIR/corral-engine" "$WORK/bin/"
REPLICA="$WORK/bin/corral-replica"
ENGINE="$WORK/bin/corral-engine"
PIDS=()

# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"

# Stops the given PIDs (only ones this script started): TERM, up to 10 s grace, then KILL.
stop_pids() {
  local pid
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "$@"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  PIDS=()
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if ((${#PIDS[@]})); then stop_pids "${PIDS[@]}"; fi
  find "$WORK" \( -name '*.img' -o -path '*/replica-*/*' \) -type f -delete 2>/dev/null || true
  if [[ "${KEEP:-0}" == 1 || $rc -ne 0 ]]; then echo "work directory kept: $WORK" >&2; else rm -rf "$WORK"; fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# start LOG CMD...: CMD in the background; its PID in LAST_PID and PIDS.
start() {
  local log=$1; shift
  "$@" >"$log" 2>&1 &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
}

bytes() { numfmt --from=iec "$1"; }
free_bytes() { df -B1 --output=avail "$BENCH_DIR" | tail -1; }
ms_since() { python3 -c 'import sys,time; print(f"{(time.time_ns() - int(sys.argv[1])) / 1e6:.2f}")' "$1"; }
median() { sort -n | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }
# The summed VmRSS of PIDs once it holds still: polled every 0.5 s until two readings differ by less than 256 KiB
# (the v2 daemon gives freed heap back within its trim period, 0.5 s), 10 s at most.
settled_rss_kib() {
  local prev=-1 cur p i
  for ((i = 0; i < 20; i++)); do
    cur=0
    for p in "$@"; do cur=$((cur + $(rss_kib "$p"))); done
    ((prev >= 0 && cur - prev < 256 && prev - cur < 256)) && break
    prev=$cur
    sleep 0.5
  done
  echo "$cur"
}
wait_socket() {
  local pid=$1 sock=$2 i
  for ((i = 0; i < READY_DEADLINE * 20; i++)); do
    [[ -S $sock ]] && return 0
    kill -0 "$pid" 2>/dev/null || { echo "run.sh: process $pid exited before $sock appeared" >&2; return 1; }
    sleep 0.05
  done
  echo "run.sh: no $sock after ${READY_DEADLINE}s" >&2
  return 1
}

# ---- snapshot creation time against volume size ----

# snapshot_case ENGINE(v1|v2) SIZE: one replica + engine, the volume written fully, then 5 timed snapshots.
snapshot_case() {
  local kind=$1 size=$2 dir="$WORK/snap-$1-$2" ready replica addr sz
  sz=$(bytes "$size")
  mkdir -p "$dir"
  ready="$dir/replica.ready"
  if [[ $kind == v1 ]]; then
    start "$dir/replica.log" "$REPLICA" --ready-file "$ready" serve --dir "$dir/replica-0" --listen 127.0.0.1:0 \
      --data-listen 127.0.0.1:0 --sync-listen 127.0.0.1:0 --size "$sz" --volume snap --disable-revision-counter
    ready_wait "$ready" "$LAST_PID" "$READY_DEADLINE"
    addr="tcp://$(ready_addr "$ready" control)?data=$(ready_addr "$ready" data)&sync=$(ready_addr "$ready" sync)"
  else
    # The lvstore: the volume, plus room for its metadata.
    fallocate -l "$((sz + (256 << 20)))" "$dir/lvstore.img"
    start "$dir/replica.log" "$REPLICA" --ready-file "$ready" serve-lvstore --disk "$dir/lvstore.img" --format \
      --listen 127.0.0.1:0 --replica snap-r0
    ready_wait "$ready" "$LAST_PID" "$READY_DEADLINE"
    addr="tcp://$(ready_addr "$ready" snap-r0.control)?data=$(ready_addr "$ready" snap-r0.data)&sync=$(ready_addr "$ready" snap-r0.sync)&replica=snap-r0"
  fi
  start "$dir/engine.log" "$ENGINE" --ready-file "$dir/engine.ready" serve --volume snap --size "$sz" \
    --listen 127.0.0.1:0 --replica "$addr" --nbd-listen "unix:$dir/nbd.sock" --disable-revision-counter
  wait_socket "$LAST_PID" "$dir/nbd.sock"
  local url t0 write_s i snaps=() infos=()
  url=$(ready_addr "$dir/engine.ready" control)
  t0=$(date +%s%N)
  fio --name=fill --ioengine=nbd --uri="nbd+unix:///snap?socket=$dir/nbd.sock" --rw=write --bs=1m --iodepth=8 \
    --end_fsync=1 --output="$dir/fill.txt" >/dev/null
  write_s=$(python3 -c 'import sys; print(f"{float(sys.argv[1]) / 1000:.1f}")' "$(ms_since "$t0")")
  local used="-"
  if [[ $kind == v2 ]]; then
    used=$("$REPLICA" lvstore --url "$(ready_addr "$ready" control)" info --json |
      python3 -c 'import json,sys; r=json.load(sys.stdin); print(str(r["usedClusters"]) + "/" + str(r["totalClusters"]) + " clusters")')
  fi
  for i in 1 2 3 4 5; do
    t0=$(date +%s%N)
    "$ENGINE" --url "$url" info >/dev/null
    infos+=("$(ms_since "$t0")")
    t0=$(date +%s%N)
    "$ENGINE" --url "$url" snapshot create "s$i" >/dev/null
    snaps+=("$(ms_since "$t0")")
  done
  printf '| %s | %s | %s s | %s | %s | %s | %s |\n' "$kind" "$size" "$write_s" "$used" \
    "$(printf '%s\n' "${snaps[@]}" | median)" "$(printf '%s ' "${snaps[@]}")" "$(printf '%s\n' "${infos[@]}" | median)"
  stop_pids "${PIDS[@]}"
  rm -rf "$dir"
}

snapshot_part() {
  local large=$LARGE need avail
  # The largest of LARGE, 32G, 16G, 8G, 4G that leaves MIN_FREE_GIB free (one volume on the disk at a time).
  for cand in "$LARGE" 32G 16G 8G 4G; do
    need=$(($(bytes "$cand") + (1 << 30)))
    avail=$(free_bytes)
    if ((avail - need >= MIN_FREE_GIB << 30)) && (($(bytes "$cand") <= $(bytes "$LARGE"))); then
      large=$cand
      break
    fi
    large=
  done
  echo "## Snapshot creation through the engine, volume fully written first (free: $(($(free_bytes) >> 30)) GiB; large = ${large:-none}, LARGE=$LARGE)"
  echo
  echo "| engine | volume | fill (fio 1 MiB seq) | lvstore used | snapshot ms (median of 5) | each | CLI info round trip ms |"
  echo "|---|---|---:|---|---:|---|---:|"
  for kind in v1 v2; do
    snapshot_case "$kind" "$SMALL"
    [[ -n $large ]] && snapshot_case "$kind" "$large"
  done
  echo
}

# ---- RSS with many replicas and snapshots ----

# snapshot_all URL...: SNAPSHOTS snapshots of every replica, PARALLEL CLI calls at a time.
snapshot_all() {
  local i
  for ((i = 1; i <= SNAPSHOTS; i++)); do
    printf '%s\n' "$@" | xargs -P "$PARALLEL" -I{} "$REPLICA" snapshot create --url {} "s$i" >/dev/null
  done
}

rss_part() {
  local dir="$WORK/rss" ready pid i t0 urls=() names=()
  mkdir -p "$dir"
  echo "## RSS: $REPLICAS replicas of $REPLICA_SIZE, $SNAPSHOTS snapshots each"
  echo

  # v2: one daemon, one lvstore.
  fallocate -l 4G "$dir/lvstore.img"
  ready="$dir/lvstore.ready"
  start "$dir/lvstore.log" "$REPLICA" --ready-file "$ready" serve-lvstore --disk "$dir/lvstore.img" --format \
    --listen 127.0.0.1:0
  ready_wait "$ready" "$LAST_PID" "$READY_DEADLINE"
  pid=$LAST_PID
  local v2_start v2_url
  v2_start=$(rss_kib "$pid")
  v2_url=$(ready_addr "$ready" control)
  for ((i = 0; i < REPLICAS; i++)); do names+=("rss-$i"); done
  t0=$(date +%s%N)
  printf '%s\n' "${names[@]}" | xargs -P "$PARALLEL" -I{} "$REPLICA" lvstore --url "$v2_url" add {} \
    --size "$REPLICA_SIZE" --disable-revision-counter >/dev/null
  mapfile -t urls < <("$REPLICA" lvstore --url "$v2_url" ls --json |
    python3 -c 'import json,sys; [print(r["address"]) for r in json.load(sys.stdin).get("replicas", [])]')
  ((${#urls[@]} == REPLICAS)) || { echo "run.sh: the v2 daemon hosts ${#urls[@]} replicas, not $REPLICAS" >&2; exit 1; }
  local v2_open v2_open_s
  v2_open=$(rss_kib "$pid")
  v2_open_s=$(ms_since "$t0")
  t0=$(date +%s%N)
  snapshot_all "${urls[@]}"
  local v2_snap_s v2_rss v2_settled v2_hwm snaps
  v2_snap_s=$(ms_since "$t0")
  v2_rss=$(rss_kib "$pid")
  v2_settled=$(settled_rss_kib "$pid")
  v2_hwm=$(awk '/^VmHWM:/ {print $2}' "/proc/$pid/status")
  snaps=$("$REPLICA" lvstore --url "$v2_url" info --json | python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["usedClusters"])')
  stop_pids "${PIDS[@]}"
  rm -f "$dir/lvstore.img"

  # v1: one process per replica.
  local v1_pids=() v1_urls=() v1_start=0 v1_rss=0 v1_settled v1_snap_s
  t0=$(date +%s%N)
  for ((i = 0; i < REPLICAS; i++)); do
    ready="$dir/v1-$i.ready"
    start "$dir/v1-$i.log" "$REPLICA" --ready-file "$ready" serve --dir "$dir/replica-$i" --listen 127.0.0.1:0 \
      --data-listen 127.0.0.1:0 --sync-listen 127.0.0.1:0 --size "$REPLICA_SIZE" --volume "rss-$i" \
      --disable-revision-counter
    v1_pids+=("$LAST_PID")
  done
  for ((i = 0; i < REPLICAS; i++)); do
    ready_wait "$dir/v1-$i.ready" "${v1_pids[$i]}" "$READY_DEADLINE"
    v1_urls+=("$(ready_addr "$dir/v1-$i.ready" control)")
  done
  local v1_open_s
  v1_open_s=$(ms_since "$t0")
  for p in "${v1_pids[@]}"; do v1_start=$((v1_start + $(rss_kib "$p"))); done
  t0=$(date +%s%N)
  snapshot_all "${v1_urls[@]}"
  v1_snap_s=$(ms_since "$t0")
  for p in "${v1_pids[@]}"; do v1_rss=$((v1_rss + $(rss_kib "$p"))); done
  v1_settled=$(settled_rss_kib "${v1_pids[@]}")
  stop_pids "${PIDS[@]}"
  rm -rf "$dir"

  local mib='{printf "%.1f", $1 / 1024}'
  echo "| measure | v2: one serve-lvstore daemon | v1: $REPLICAS corral-replica processes (sum) | v2 / v1 |"
  echo "|---|---:|---:|---:|"
  echo "| RSS before any replica | $(echo "$v2_start" | awk "$mib") MiB | - | - |"
  echo "| RSS, $REPLICAS replicas open and served | $(echo "$v2_open" | awk "$mib") MiB | $(echo "$v1_start" | awk "$mib") MiB | $(python3 -c "print(f'{$v2_open / $v1_start:.3f}')") |"
  echo "| RSS, + $SNAPSHOTS snapshots each, right after the last | $(echo "$v2_rss" | awk "$mib") MiB (peak $(echo "$v2_hwm" | awk "$mib") MiB) | $(echo "$v1_rss" | awk "$mib") MiB | $(python3 -c "print(f'{$v2_rss / $v1_rss:.3f}')") |"
  echo "| RSS, + $SNAPSHOTS snapshots each, settled | $(echo "$v2_settled" | awk "$mib") MiB | $(echo "$v1_settled" | awk "$mib") MiB | $(python3 -c "print(f'{$v2_settled / $v1_settled:.3f}')") |"
  echo "| time to open $REPLICAS replicas | $(python3 -c "print(f'{$v2_open_s / 1000:.1f}')") s | $(python3 -c "print(f'{$v1_open_s / 1000:.1f}')") s | |"
  echo "| time for $((REPLICAS * SNAPSHOTS)) snapshots ($PARALLEL CLI calls at a time) | $(python3 -c "print(f'{$v2_snap_s / 1000:.1f}')") s | $(python3 -c "print(f'{$v1_snap_s / 1000:.1f}')") s | |"
  echo
  echo "v2 target: RSS <= 64 MiB with $REPLICAS replicas x $SNAPSHOTS snapshots (settled): $( ((v2_settled <= 65536)) && echo met || echo MISSED) ($(echo "$v2_settled" | awk "$mib") MiB; lvstore clusters used after: $snaps)"
  echo
}

echo "# corral v2 bench: $(date -u +%Y-%m-%dT%H:%MZ), $(uname -r), $(nproc) cores, $(findmnt -no FSTYPE,SOURCE --target "$BENCH_DIR" 2>/dev/null || true), git $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), load average at start: $(cut -d" " -f1-3 /proc/loadavg)"
echo
for part in $PARTS; do
  case $part in
    snapshot) snapshot_part ;;
    rss) rss_part ;;
    *) echo "run.sh: unknown part $part" >&2; exit 2 ;;
  esac
done
