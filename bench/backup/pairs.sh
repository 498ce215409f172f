#!/usr/bin/env bash
# The three backup targets of issue 18, measured so that the disk's swings (2-3x within an hour here) cancel out:
# every timed operation runs in a round beside `cp` of the same data, the page cache dropped before each, and the
# ratios are taken per round, then their median.
#
#   sudo bench/backup/pairs.sh [SIZE_MIB] [ROUNDS]     (default 2048 MiB, 5 rounds; root: drops the page cache)
#
# - restore: cp+sync of the uncached source, and restores (+sync) of a backup of it from an uncached file:// store
#   on the same disk, for each block size in BLOCK_SIZES (bytes; default "2097152 524288": backupstore's default
#   and the manager's `backup-block-size` default). Ratio: cp seconds / restore seconds (>= 1.0: restore as fast).
# - backup: cp+sync of the uncached source, and full backups of it (uncached source, a new store each time, the
#   store's syncfs included) per block size. Ratio: cp seconds / backup seconds (target >= 0.8).
# - 1 % change: ROUNDS different change patterns (seeds 1..ROUNDS: SIZE/100 extents of 1 MiB of random data at
#   random 4 KiB-aligned offsets), each an incremental against the full backup; bytes uploaded / volume size.
#
# The order inside a round rotates (round r starts with the r-th operation), so no operation always runs first
# after the drop of the cache. QUIET=/work/quiet runs the timed rounds (only them: not the setup or the 1 % change,
# which time nothing) under that command, exclusive of builds. BIN=path/to/file_backup runs that build (default: built in release);
# BIN_B=another build adds its restores and backups to each round (before/after). CONCURRENCY=N: blocks in flight
# (default: the example's, 8). Data in $BENCH_DIR (default /var/tmp). Prints one line per operation per round
# (`round kind op seconds ratio`), then the medians and ranges.
set -euo pipefail
cd "$(dirname "$0")/../.."
SIZE_MIB=${1:-2048}
ROUNDS=${2:-5}
BLOCK_SIZES=${BLOCK_SIZES:-2097152 524288}
QUIET=${QUIET:-}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
[ "$(id -u)" = 0 ] || { echo "needs root (drops the page cache)" >&2; exit 1; }
if [ -z "${BIN:-}" ]; then
    cargo build --release -q -p backupstore --examples
    BIN=${CARGO_TARGET_DIR:-target}/release/examples/file_backup
fi
BIN=$(realpath "$BIN")
[ -n "${BIN_B:-}" ] && BIN_B=$(realpath "$BIN_B")
W=$(mktemp -d "$BENCH_DIR/corral-backup-pairs.XXXXXX")
trap 'rm -rf "$W"' EXIT
export W BIN SIZE_MIB

drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
t() { local s e; s=$(date +%s.%N); "$@" > /dev/null; sync; e=$(date +%s.%N); python3 -c "print(f'{$e - $s:.3f}')"; }
builds() { echo "A:$BIN"; [ -n "${BIN_B:-}" ] && echo "B:$BIN_B"; true; }

echo "generating ${SIZE_MIB} MiB of random data in $W ..." >&2
head -c "$((SIZE_MIB << 20))" /dev/urandom > "$W/random.img"
# The stores restored from, one per build and block size, written as a backup leaves them.
for b in $(builds); do
    for bs in $BLOCK_SIZES; do
        "${b#*:}" backup "$W/random.img" "file://$W/store-${b%%:*}-$bs" vol b1 "$bs" ${CONCURRENCY:-} > /dev/null
        # The restores are compared with the source once, here; every later restore verifies each block's SHA-256.
        "${b#*:}" restore "$W/r.img" "file://$W/store-${b%%:*}-$bs" vol b1 ${CONCURRENCY:-} > /dev/null
        cmp "$W/random.img" "$W/r.img" || { echo "restore by ${b#*:} at $bs differs" >&2; exit 1; }
        rm -f "$W/r.img"
    done
done
sync

# One operation: page cache dropped, timed with a final sync, its output removed (untimed).
op() {
    local name=$1 s
    case $name in
        cp) drop; s=$(t cp "$W/random.img" "$W/copy.img"); rm -f "$W/copy.img" ;;
        restore-*) local b=${name#restore-}; b=${b%%-*}; local bs=${name##*-} bin=$BIN
            [ "$b" = B ] && bin=$BIN_B
            drop; s=$(t "$bin" restore "$W/r.img" "file://$W/store-$b-$bs" vol b1 ${CONCURRENCY:-}); rm -f "$W/r.img" ;;
        backup-*) local b=${name#backup-}; b=${b%%-*}; local bs=${name##*-} bin=$BIN
            [ "$b" = B ] && bin=$BIN_B
            drop; s=$(t "$bin" backup "$W/random.img" "file://$W/new-store" vol b1 "$bs" ${CONCURRENCY:-})
            rm -rf "$W/new-store" ;;
    esac
    sync
    echo "$s"
}

# One round of KIND (restore or backup): cp and every build x block size, the order rotated by the round number.
round() {
    local kind=$1 r=$2 ops=(cp) n i name
    for b in $(builds); do for bs in $BLOCK_SIZES; do ops+=("$kind-${b%%:*}-$bs"); done; done
    n=${#ops[@]}
    declare -A secs
    for i in $(seq 0 $((n - 1))); do
        name=${ops[$(((i + r) % n))]}
        secs[$name]=$(op "$name")
    done
    for name in "${ops[@]}"; do
        python3 -c "print(f'$r $kind $name {${secs[$name]}:.2f} {${secs[cp]} / ${secs[$name]}:.2f} $(cut -d' ' -f1 /proc/loadavg)')"
    done
}

echo "# $(date -u +%F): ${SIZE_MIB} MiB random, $ROUNDS rounds, block sizes $BLOCK_SIZES"
echo "# round kind op seconds ratio(cp/op) load1"
export -f drop t op round builds
export BIN_B CONCURRENCY BLOCK_SIZES
results=$W/results
export ROUNDS results
$QUIET bash -c 'echo "# $(date -u +%T) UTC, load average $(cut -d" " -f1-3 /proc/loadavg)"
    for kind in restore backup; do for r in $(seq "$ROUNDS"); do round $kind $r; done; done
    echo "# $(date -u +%T) UTC, load average $(cut -d" " -f1-3 /proc/loadavg)"' | tee -a "$results"

# 1 % change: per seed, a changed copy of the data backed up as an incremental on top of the full backups above.
echo "# 1 % change: seed block_size uploaded_bytes percent_of_volume"
for bs in $BLOCK_SIZES; do
    for seed in $(seq "$ROUNDS"); do
        cp "$W/random.img" "$W/changed.img"
        python3 - "$W/changed.img" "$SIZE_MIB" "$seed" <<'PY'
import os, random, sys
path, size_mib, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
with open(path, 'r+b') as f:
    for _ in range(max(1, size_mib // 100)):
        f.seek(rng.randrange(0, ((size_mib << 20) - (1 << 20)) // 4096) * 4096)
        f.write(os.urandom(1 << 20))
PY
        "$BIN" backup "$W/changed.img" "file://$W/store-A-$bs" vol "c$seed" "$bs" ${CONCURRENCY:-} \
            | python3 -c "
import json, sys
r = json.loads(sys.stdin.readline()); assert r['incremental'], r
print(f\"change $seed $bs {r['stats']['newBytes']} {100 * r['stats']['newBytes'] / ($SIZE_MIB << 20):.2f}\")" \
            | tee -a "$results"
        rm -f "$W/changed.img"
    done
done

python3 - "$results" <<'PY'
import statistics, sys
from collections import defaultdict
ratios, secs, change = defaultdict(list), defaultdict(list), defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()
    if not f or f[0] == '#':
        continue
    if f[0] == 'change':
        change[int(f[2])].append(float(f[4]))
    elif f[2] != 'cp':
        ratios[(f[1], f[2])].append(float(f[4]))
        secs[(f[1], f[2])].append(float(f[3]))
    else:
        secs[(f[1], 'cp')].append(float(f[3]))
print("\n# summary: median [min-max] over the rounds")
for k in sorted(secs):
    s = secs[k]
    line = f"{k[0]:8} {k[1]:18} {statistics.median(s):6.2f} s [{min(s):.2f}-{max(s):.2f}]"
    if k in ratios:
        r = ratios[k]
        line += f"   cp/op {statistics.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]"
    print(line)
for bs, v in sorted(change.items()):
    print(f"1% change at {bs >> 10} KiB blocks: uploads {statistics.median(v):.2f} % of the volume [{min(v):.2f}-{max(v):.2f}]")
PY
