#!/usr/bin/env bash
# Data-path benchmark of the engine (issue 4): fio over NBD against two peer NBD servers and three engine set-ups,
# all in one run on the same disk, with each Corral figure given as a ratio to the peers measured beside it.
#
#   bench/datapath/run.sh                       # 15 s per job, 2 GiB volume
#   RUNTIME=5 SIZE=1G bench/datapath/run.sh     # quick run
#
# Targets: (a) nbdkit file, (a') qemu-nbd raw, a3: `nbdkit nbd` forwarding over a unix socket to `nbdkit file` (two
# processes in a chain, as (b)), (b) engine + 1 replica, (c) engine + 3 replicas on loopback,
# v2b / v2c: (b) and (c) over v2 replicas (`serve-lvstore`; v2bt: v2b on TCP only), v2bs / bs: 1 replica (v2 / v1) right after a snapshot
# of the fully written volume (the copy-on-write path), v2bd / v2bsd: v2b / v2bs with the lvstore's data IO O_DIRECT,
# v2bw / v2bsw: v2b / v2bs over a store file written out once with zeroes (no unwritten extents, as a raw device),
# (b) and (c) with --disable-revision-counter on the engine and on every replica, (d) as (c) with the counter on.
# Replicas serve the data protocol on a unix socket too (--data-unix, as the manager starts them), which the engine
# on their node uses; bt and ct are b and c with replicas on TCP only (the path to a replica on another node);
# btls and ctls are bt and ct with mutual TLS on the data protocol (every daemon given --tls-dir, issue 40).
# Every row also gives the CPU time per IO of the target's processes (utime + stime from /proc/PID/stat) and their
# context switches per IO (voluntary + involuntary, every thread's /proc/PID/task/TID/status).
# Jobs: 4 KiB randread / randwrite at iodepth 1 and 32, 4 KiB randwrite qd32 with a flush every 32 writes,
# 1 MiB sequential write at iodepth 8; every job runs for
# RUNTIME seconds after the whole device was written once with 1 MiB writes (reads then hit data, not holes).
#
# Environment:
#   RUNTIME   seconds per job (15)           SIZE      volume / file size (2G)
#   TARGETS   subset to run, e.g. "a a2 b"   BENCH_DIR where data lives (/var/tmp; the same disk for every target)
#   BIN_DIR   use corral-* binaries from here and skip the build (default: build into CARGO_TARGET_DIR or target/)
#   BASE_BIN_DIR  binaries for targets b0, c0, d0, v2b0 and v2bs0 (b, c, d, v2b and v2bs run with them): before/after
#             a change in one run
#   PIN_CPU   the CPU targets bp and cp ((b) and (c) with the engine and every replica pinned to one CPU by
#             `taskset`, fio left to the scheduler) run on (default: the last one)
#   ALT_ENV   VAR=VALUE words set in the environment of the engine and replicas of targets bx and cx (b and c otherwise):
#             a tunable's before/after in one run, e.g. ALT_ENV="CORRAL_REPLICA_CONNECTIONS=1"; ALT_ENV2 the same for by, cy
#   JOBS      names of the jobs to run (default: all), e.g. "randwrite-4k-qd32 randwrite-4k-qd32-fsync32"
#   KEEP=1    keep the work directory (fio JSON, daemon logs, top samples)
#   TOP=1     sample `top -b -n1` in the middle of every job into the work directory
#   PERF=1    record `perf record -a -g -e cpu-clock` (whole machine, call graphs) over every job after its ramp into
#             WORK/TARGET/JOB.perf.data (use with KEEP=1), and print the job's per-process CPU split (perf report
#             --sort comm) beside the table; PERF_JOBS narrows it to some job names
#   STRACE=1  trace the replica daemons' syscalls (`strace -f -c -w`: counts and wall time per call) during every job into
#             the work directory (NAME.strace; implies KEEP=1): a diagnosis, not a figure (strace slows every call);
#             STRACE_OPTS replaces `-c -w` (e.g. "-e trace=futex -k": every futex call with its stack, by thread)
#   DROP_CACHES=1  drop the page cache after each target's fill (needs root): the jobs' 4 KiB overwrites then meet
#             4 KiB folios instead of the fill's large ones, whose cost otherwise dominates every file-backed write
#   COUNT=1   also print locks and payload copies per IO of the engine and the replicas (needs binaries built with
#             `--features engine/io-counters,replica/io-counters` in BIN_DIR / BASE_BIN_DIR; scraped from /metrics)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
HERE="$ROOT/bench/datapath"
RUNTIME="${RUNTIME:-15}"
SIZE="${SIZE:-2G}"
TARGETS="${TARGETS:-a a2 b c d}"
BENCH_DIR="${BENCH_DIR:-/var/tmp}"
READY_DEADLINE=30 # seconds a daemon gets to open its port or socket
PIN_CPU="${PIN_CPU:-$(($(nproc) - 1))}"

for tool in fio nbdkit qemu-nbd python3; do
  command -v "$tool" >/dev/null || { echo "run.sh: $tool is missing (apt-get install -y fio nbdkit qemu-utils)" >&2; exit 1; }
done

if [[ -z "${BIN_DIR:-}" ]]; then
  (cd "$ROOT" && cargo build --release --bins -q)
  BIN_DIR="${CARGO_TARGET_DIR:-$ROOT/target}/release"
fi
WORK="$(mktemp -d "$BENCH_DIR/corral-datapath.XXXXXX")"
# Run private copies: a concurrent build into the shared target directory must not swap binaries mid-run.
mkdir -p "$WORK/bin"
cp "$BIN_DIR/corral-replica" "$BIN_DIR/corral-engine" "$WORK/bin/"
REPLICA_BIN="$WORK/bin/corral-replica"
ENGINE_BIN="$WORK/bin/corral-engine"
if [[ " $TARGETS " == *tls* ]]; then
  # One CA and one node certificate (127.0.0.1) that the engine and every replica of btls / ctls present.
  cp "$BIN_DIR/corral-tls" "$WORK/bin/"
  "$WORK/bin/corral-tls" ca init "$WORK/ca" >/dev/null
  "$WORK/bin/corral-tls" issue --ca "$WORK/ca" --name bench --san 127.0.0.1 "$WORK/tls" >/dev/null
fi
if [[ -n "${BASE_BIN_DIR:-}" ]]; then
  # Targets b0 c0 d0 (b, c and d with the binaries of BASE_BIN_DIR): before and after a change in one run.
  mkdir -p "$WORK/bin0"
  cp "$BASE_BIN_DIR/corral-replica" "$BASE_BIN_DIR/corral-engine" "$WORK/bin0/"
fi
RESULTS="$WORK/results.tsv"
: >"$RESULTS"
PIDS=()

# Stops the given PIDs: TERM, up to 5 s grace, then KILL. Only processes this script started are ever passed in.
stop_pids() {
  local pid
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "$@"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if ((${#PIDS[@]})); then stop_pids "${PIDS[@]}"; fi
  if [[ "${KEEP:-0}" == 1 || "${STRACE:-0}" == 1 || $rc -ne 0 ]]; then
    # Drop the bulky data, keep the evidence.
    find "$WORK" \( -name '*.img' -o -path '*/replica-*/*' \) -type f -delete 2>/dev/null || true
    echo "work directory kept: $WORK" >&2
  else
    rm -rf "$WORK"
  fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"

# wait_until DESC PID CMD...: polls CMD every 50 ms until it succeeds, PID dies, or the deadline passes.
wait_until() {
  local desc=$1 pid=$2; shift 2
  local deadline=$((SECONDS + READY_DEADLINE))
  until "$@" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "run.sh: $desc exited before it was ready" >&2; return 1; }
    ((SECONDS < deadline)) || { echo "run.sh: $desc not ready after ${READY_DEADLINE}s" >&2; return 1; }
    sleep 0.05
  done
}
socket_ready() { [[ -S "$1" ]] && python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.settimeout(0.2); s.connect(sys.argv[1]); s.close()' "$1"; }

# start LOG CMD...: runs CMD in the background, logging to LOG; its PID is in $LAST_PID and in PIDS for the trap.
start() {
  local log=$1; shift
  "$@" >"$log" 2>&1 &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
}

# ---- v2 data engine targets (issue 20) ----
# v2b: engine + 1 v2 replica; v2c: engine + 3 v2 replicas, each in its own `corral-replica serve-lvstore` daemon (one
# per node, as the manager runs them) over an lvstore on a preallocated file of 2 x SIZE + 256 MiB in the work directory;
# v2bs: v2b whose volume is snapshotted (through the engine) right after the precondition wrote it fully, so
# every job runs on the copy-on-write path; bs is the same for v1 (target b plus the snapshot). The revision counter
# is off everywhere, as in (b) and (c). The daemons run with their default `--data-io auto` (the page cache, the store
# being a file); v2bd and v2bsd are v2b and v2bs with `--data-io direct` (O_DIRECT: every IO at the device). Each daemon
# serves its replica's data protocol on a unix socket too (`--data-unix-dir`, as the manager starts it), which the
# engine beside it uses; v2bt is v2b on TCP only (the peer of bt).
start_v2_target() {
  local t=$1 tdir="$WORK/$1" n=1 i ready replicas=() io=auto local_data=(--data-unix-dir "$WORK/$1/sockets")
  local replica_bin=$REPLICA_BIN
  if [[ $t == v2b0 || $t == v2bs0 ]]; then
    [[ -d "$WORK/bin0" ]] || { echo "run.sh: target $t needs BASE_BIN_DIR" >&2; exit 2; }
    replica_bin=$WORK/bin0/corral-replica
  fi
  [[ $t == v2c ]] && n=3
  [[ $t == v2bt ]] && local_data=()
  [[ $t == v2bd || $t == v2bsd ]] && io=direct # the lvstore on a file with O_DIRECT (auto: the page cache)
  local store_bytes=$(($(numfmt --from=iec "$SIZE") * 2 + (256 << 20))) # room for a full COW copy
  for ((i = 0; i < n; i++)); do
    ready="$tdir/lvstore-$i.ready"
    if [[ $t == v2bw || $t == v2bsw ]]; then
      # Written out once (zeroes), as a raw block device is: no unwritten extents for a first write to convert.
      dd if=/dev/zero of="$tdir/lvstore-$i.img" bs=1M count=$((store_bytes >> 20)) oflag=direct conv=fsync status=none
    else
      fallocate -l "$store_bytes" "$tdir/lvstore-$i.img"
    fi
    start "$tdir/lvstore-$i.log" "$replica_bin" --ready-file "$ready" serve-lvstore --disk "$tdir/lvstore-$i.img" \
      --format --listen 127.0.0.1:0 --replica "bench-r$i" --data-io "$io" "${local_data[@]}"
    TARGET_PIDS+=("$LAST_PID")
    ready_wait "$ready" "$LAST_PID" "$READY_DEADLINE"
    replicas+=(--replica "tcp://$(ready_addr "$ready" "bench-r$i.control")?data=$(ready_addr "$ready" "bench-r$i.data")&sync=$(ready_addr "$ready" "bench-r$i.sync")&replica=bench-r$i")
  done
  start "$tdir/engine.log" "$ENGINE_BIN" --ready-file "$tdir/engine.ready" serve --volume bench --size "$SIZE" \
    --listen 127.0.0.1:0 "${replicas[@]}" --nbd-listen "unix:$tdir/nbd.sock" --disable-revision-counter
  TARGET_PIDS+=("$LAST_PID")
  wait_until engine "$LAST_PID" socket_ready "$tdir/nbd.sock"
  URI="nbd+unix:///bench?socket=$tdir/nbd.sock"
}

# Targets bs and v2bs: a snapshot of the fully written volume through the engine (after the precondition).
snapshot_after_precondition() {
  local t=$1
  [[ $t == bs || $t == v2bs || $t == v2bsd || $t == v2bs0 || $t == v2bsw ]] || return 0
  echo "# target $t: snapshot of the fully written volume" >&2
  "$ENGINE_BIN" --url "$(ready_addr "$WORK/$t/engine.ready" control)" snapshot create bench-snap >/dev/null
}
# ---- end of the v2 targets ----

# Starts the servers of target $1; sets URI and TARGET_PIDS.
start_target() {
  local t=$1 tdir="$WORK/$1"
  mkdir -p "$tdir"
  TARGET_PIDS=() COUNT_URLS=()
  case $t in
    a)
      truncate -s "$SIZE" "$tdir/disk.img"
      start "$tdir/nbdkit.log" nbdkit -f -U "$tdir/nbd.sock" file "$tdir/disk.img"
      TARGET_PIDS+=("$LAST_PID")
      wait_until nbdkit "$LAST_PID" socket_ready "$tdir/nbd.sock"
      URI="nbd+unix:///?socket=$tdir/nbd.sock" ;;
    a3)
      # Two nbdkits in a chain, the process topology of (b): a front server forwarding every request over a unix
      # socket to a second process that owns the file (engine -> local replica), built from the fastest peer.
      truncate -s "$SIZE" "$tdir/disk.img"
      start "$tdir/nbdkit-file.log" nbdkit -f -U "$tdir/back.sock" file "$tdir/disk.img"
      TARGET_PIDS+=("$LAST_PID")
      wait_until nbdkit "$LAST_PID" socket_ready "$tdir/back.sock"
      start "$tdir/nbdkit-nbd.log" nbdkit -f -U "$tdir/nbd.sock" nbd socket="$tdir/back.sock"
      TARGET_PIDS+=("$LAST_PID")
      wait_until nbdkit "$LAST_PID" socket_ready "$tdir/nbd.sock"
      URI="nbd+unix:///?socket=$tdir/nbd.sock" ;;
    a2)
      truncate -s "$SIZE" "$tdir/disk.img"
      start "$tdir/qemu-nbd.log" qemu-nbd -f raw -k "$tdir/nbd.sock" -t "$tdir/disk.img"
      TARGET_PIDS+=("$LAST_PID")
      wait_until qemu-nbd "$LAST_PID" socket_ready "$tdir/nbd.sock"
      URI="nbd+unix:///?socket=$tdir/nbd.sock" ;;
    b | c | d | bt | ct | btls | ctls | b0 | c0 | d0 | bs | bx | cx | by | cy | bp | cp)
      local n=3 rc=() unix=1 replica_bin=$REPLICA_BIN engine_bin=$ENGINE_BIN alt=() pin=() tls=()
      [[ $t == b* ]] && n=1
      [[ $t == ?t || $t == ?tls ]] && unix=0
      [[ $t == ?tls ]] && tls=(--tls-dir "$WORK/tls")
      [[ $t != d* ]] && rc=(--disable-revision-counter)
      # bp, cp: the engine and its replicas share one CPU (fio is not pinned).
      [[ $t == ?p ]] && pin=(taskset -c "$PIN_CPU")
      # shellcheck disable=SC2206 # ALT_ENV and ALT_ENV2 are lists of VAR=VALUE words
      if [[ $t == ?x ]]; then
        alt=(${ALT_ENV:-})
      elif [[ $t == ?y ]]; then
        alt=(${ALT_ENV2:-})
      fi
      if [[ $t == ?0 ]]; then
        [[ -d "$WORK/bin0" ]] || { echo "run.sh: target $t needs BASE_BIN_DIR" >&2; exit 2; }
        replica_bin=$WORK/bin0/corral-replica engine_bin=$WORK/bin0/corral-engine
      fi
      local replicas=() i ready local_data metrics=()
      COUNT_URLS=()
      [[ "${COUNT:-0}" == 1 ]] && metrics=(--metrics-listen 127.0.0.1:0)
      for ((i = 0; i < n; i++)); do
        # Every listener on port 0; the ready file names the three endpoints the engine is given.
        mkdir -p "$tdir/replica-$i"
        ready="$tdir/replica-$i.ready"
        local_data=()
        ((unix)) && local_data=(--data-unix "$tdir/replica-$i.data.sock")
        start "$tdir/replica-$i.log" "${pin[@]}" env "${alt[@]}" "$replica_bin" --ready-file "$ready" serve --dir "$tdir/replica-$i" \
          --listen 127.0.0.1:0 --data-listen 127.0.0.1:0 --sync-listen 127.0.0.1:0 "${local_data[@]}" \
          --size "$SIZE" --volume bench "${rc[@]}" "${metrics[@]}" "${tls[@]}"
        TARGET_PIDS+=("$LAST_PID")
        ready_wait "$ready" "$LAST_PID" "$READY_DEADLINE"
        ((${#metrics[@]})) && COUNT_URLS+=("replicas=http://$(ready_addr "$ready" metrics)/metrics")
        replicas+=(--replica "tcp://$(ready_addr "$ready" control)?data=$(ready_addr "$ready" data)&sync=$(ready_addr "$ready" sync)")
      done
      start "$tdir/engine.log" "${pin[@]}" env "${alt[@]}" "$engine_bin" --ready-file "$tdir/engine.ready" serve --volume bench --size "$SIZE" \
        --listen 127.0.0.1:0 "${replicas[@]}" --nbd-listen "unix:$tdir/nbd.sock" "${rc[@]}" "${metrics[@]}" "${tls[@]}"
      TARGET_PIDS+=("$LAST_PID")
      wait_until engine "$LAST_PID" socket_ready "$tdir/nbd.sock"
      ((${#metrics[@]})) && ready_wait "$tdir/engine.ready" "$LAST_PID" "$READY_DEADLINE" &&
        COUNT_URLS+=("engine=http://$(ready_addr "$tdir/engine.ready" metrics)/metrics")
      URI="nbd+unix:///bench?socket=$tdir/nbd.sock" ;;
    v2b | v2bt | v2c | v2bs | v2bd | v2bsd | v2b0 | v2bs0 | v2bw | v2bsw) start_v2_target "$t" ;;
    *) echo "run.sh: unknown target $t" >&2; exit 2 ;;
  esac
}

stop_target() {
  stop_pids "${TARGET_PIDS[@]}"
  local keep=() pid dead
  for pid in "${PIDS[@]}"; do
    dead=0
    for d in "${TARGET_PIDS[@]}"; do [[ $pid == "$d" ]] && dead=1; done
    ((dead)) || keep+=("$pid")
  done
  PIDS=("${keep[@]+"${keep[@]}"}")
  # Free the disk before the next target (3 replicas of SIZE each).
  find "$WORK/$1" \( -name '*.img' -o -path '*/replica-*/*' \) -type f -delete 2>/dev/null || true
}

# fio_json OUT ARGS...: runs fio with JSON output, strips the text line(s) fio prints before the JSON.
fio_json() {
  local out=$1; shift
  fio --ioengine=nbd --uri="$URI" --output-format=json --name=job "$@" >"$out.raw"
  sed -n '/^{/,$p' "$out.raw" >"$out"
}

# cpu_ticks PID...: utime + stime of the PIDs, in clock ticks (fields 14 and 15 of /proc/PID/stat; every thread).
cpu_ticks() {
  local pid sum=0
  for pid in "$@"; do
    # The command name (field 2) may hold spaces: cut after its closing parenthesis.
    sum=$((sum + $(sed 's/^.*) //' "/proc/$pid/stat" | awk '{print $12 + $13}')))
  done
  echo "$sum"
}
CLK_TCK=$(getconf CLK_TCK)

# ctx_switches PID...: voluntary + involuntary context switches of every thread of the PIDs (each thread's
# /proc/PID/task/TID/status; the process's own status line counts its main thread only). A thread that exits
# takes its count with it (nbdkit's and qemu-nbd's connection threads end with fio's connection), so the job
# samples it while fio is connected: 0.5 s into the ramp and RUNTIME seconds later.
ctx_switches() {
  local pid
  for pid in "$@"; do cat "/proc/$pid/task/"*/status 2>/dev/null; done |
    awk '/^(voluntary|nonvoluntary)_ctxt_switches:/ {s += $2} END {print s + 0}'
}

# name:rw:bs:iodepth[:fsync]; fsync=N sends a flush (NBD_CMD_FLUSH) after every N writes, the job where the
# revision counter's fdatasync at flush shows ((d) against (c)).
ALL_JOBS=(
  "randread-4k-qd1:randread:4k:1"
  "randread-4k-qd32:randread:4k:32"
  "randwrite-4k-qd1:randwrite:4k:1"
  "randwrite-4k-qd32:randwrite:4k:32"
  "randwrite-4k-qd32-fsync32:randwrite:4k:32:32"
  "seqwrite-1m-qd8:write:1m:8"
)
# JOBS (environment): a subset of the job names above.
SELECTED=()
for j in "${ALL_JOBS[@]}"; do
  if [[ -z "${JOBS:-}" || " $JOBS " == *" ${j%%:*} "* ]]; then SELECTED+=("$j"); fi
done
((${#SELECTED[@]})) || { echo "run.sh: no job named in JOBS='$JOBS'" >&2; exit 2; }

echo "# corral datapath bench: $(date -u +%Y-%m-%dT%H:%MZ), $(uname -r), $(nproc) cores, $(findmnt -no FSTYPE,SOURCE --target "$BENCH_DIR" 2>/dev/null || true)," \
  "git $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" diff --quiet HEAD -- engine replica data-protocol proto 2>/dev/null || echo '+dirty')," \
  "$(fio --version), nbdkit $(nbdkit --version | awk '{print $2}'), $(qemu-nbd --version | head -1 | awk '{print $2}')"
echo "# SIZE=$SIZE RUNTIME=${RUNTIME}s TARGETS='$TARGETS' load average at start: $(cut -d" " -f1-3 /proc/loadavg)"

for t in $TARGETS; do
  # A target named twice runs twice (interleaved repeats of a noisy job); the second run starts from a clean directory.
  rm -rf "${WORK:?}/$t"
  start_target "$t"
  echo "# target $t: precondition (1 MiB writes over the whole device)" >&2
  fio_json "$WORK/$t/precondition.json" --rw=write --bs=1m --iodepth=8 --end_fsync=1
  snapshot_after_precondition "$t"
  if [[ "${DROP_CACHES:-0}" == 1 ]]; then
    # The fill left the data files in ext4's large folios, over which every 4 KiB overwrite pays for the whole
    # folio (folio_micro.sh); dropped, the jobs' overwrites get 4 KiB folios, as on a volume written by small IO.
    sync -f "$WORK"
    echo 1 >/proc/sys/vm/drop_caches || { echo "run.sh: DROP_CACHES=1 needs root (writes /proc/sys/vm/drop_caches)" >&2; exit 2; }
  fi
  for j in "${SELECTED[@]}"; do
    IFS=: read -r name rw bs qd fsync <<<"$j"
    echo "# target $t: $name (${RUNTIME}s)" >&2
    # Start every job with no dirty pages of the previous one pending (writeback would land inside this job).
    sync -f "$WORK"
    top_pid=
    if [[ "${TOP:-0}" == 1 ]]; then
      (sleep "$((RUNTIME / 2 + 1))"; top -b -n1 -w 200 | head -25 >"$WORK/$t/top-$name.txt") &
      top_pid=$!
    fi
    ((${#COUNT_URLS[@]})) && python3 "$HERE/fio_summary.py" scrape "${COUNT_URLS[@]}" >"$WORK/$t/$name.count0.json"
    perf_pid=
    if [[ "${PERF:-0}" == 1 && ( -z "${PERF_JOBS:-}" || " $PERF_JOBS " == *" $name "* ) ]]; then
      # After the 1 s ramp, for the measured seconds; software clock (no hardware counters in a VM).
      (sleep 1; exec perf record -q -a -g -e cpu-clock -o "$WORK/$t/$name.perf.data" -- sleep "$RUNTIME") \
        >"$WORK/$t/$name.perf.log" 2>&1 &
      perf_pid=$!
    fi
    cpu0=$(cpu_ticks "${TARGET_PIDS[@]}")
    (sleep 0.5; ctx_switches "${TARGET_PIDS[@]}"; sleep "$RUNTIME"; ctx_switches "${TARGET_PIDS[@]}") >"$WORK/$t/$name.ctx" &
    ctx_pid=$!
    strace_pid=
    if [[ "${STRACE:-0}" == 1 ]]; then
      # The replica daemons: every target PID but the engine, started last.
      strace_args=()
      for pid in "${TARGET_PIDS[@]:0:${#TARGET_PIDS[@]}-1}"; do strace_args+=(-p "$pid"); done
      read -r -a strace_opts <<<"${STRACE_OPTS:--c -w}"
      timeout -s INT "$((RUNTIME + 1))" strace -f "${strace_opts[@]}" -o "$WORK/$t/$name.strace" "${strace_args[@]}" 2>/dev/null &
      strace_pid=$!
    fi
    fio_json "$WORK/$t/$name.json" --rw="$rw" --bs="$bs" --iodepth="$qd" --fsync="${fsync:-0}" --time_based \
      --runtime="$RUNTIME" --ramp_time=1 --norandommap --randrepeat=0
    cpu1=$(cpu_ticks "${TARGET_PIDS[@]}")
    wait "$ctx_pid"
    # Switches over RUNTIME seconds, scaled to the RUNTIME + 1 seconds fio_summary.py divides by.
    ctx=$(awk -v r="$RUNTIME" 'NR == 1 {a = $1} NR == 2 {b = $1} END {printf "%d", (b - a) * (r + 1) / r}' "$WORK/$t/$name.ctx")
    if ((${#COUNT_URLS[@]})); then
      python3 "$HERE/fio_summary.py" scrape "${COUNT_URLS[@]}" >"$WORK/$t/$name.count1.json"
      python3 "$HERE/fio_summary.py" countrow "$name" "$t" "$WORK/$t/$name.json" "$WORK/$t/$name.count0.json" \
        "$WORK/$t/$name.count1.json" "$((RUNTIME + 1))" >>"$WORK/counts.tsv"
    fi
    if [[ -n $top_pid ]]; then wait "$top_pid"; fi
    if [[ -n $perf_pid ]]; then
      wait "$perf_pid" || true
      perf report -i "$WORK/$t/$name.perf.data" --no-children -g none --sort comm --stdio 2>/dev/null |
        grep -v '^#' | grep -v '^$' | head -12 >"$WORK/$t/$name.perf-comm.txt" || true
      echo "# target $t: $name: CPU samples by command (perf, whole machine):" >&2
      sed 's/^/#   /' "$WORK/$t/$name.perf-comm.txt" >&2
    fi
    if [[ -n $strace_pid ]]; then wait "$strace_pid" || true; fi
    # CPU seconds of the target's processes over the job (ramp included; fio_summary.py counts the ramp's IOs at
    # the job's rate).
    cpu_s=$(python3 -c 'import sys; print((int(sys.argv[2]) - int(sys.argv[1])) / int(sys.argv[3]))' "$cpu0" "$cpu1" "$CLK_TCK")
    python3 "$HERE/fio_summary.py" row "$name" "$t" "$WORK/$t/$name.json" "$cpu_s" "$((RUNTIME + 1))" \
      "$ctx" >>"$RESULTS"
  done
  stop_target "$t"
done

python3 "$HERE/fio_summary.py" table "$RESULTS"
if [[ -s "$WORK/counts.tsv" ]]; then
  echo
  echo "Locks and payload copies per IO (io-counters build; copies as multiples of the IO size):"
  python3 "$HERE/fio_summary.py" counts "$WORK/counts.tsv"
fi
