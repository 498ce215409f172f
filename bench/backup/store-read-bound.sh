#!/usr/bin/env bash
# Whether reading a file:// store's block files bounds a restore: SIZE_MIB of random data backed up (2 MiB blocks),
# then, page cache dropped before each, the source read whole (`cat`, and `fio` direct 2 MiB at queue depth 8), the
# store's block files read in restore order with 1, 8 and 32 in flight (store-read.py: no hashing, no writes), cp
# of the uncached source (+sync), and the restore from the uncached store.
#
#   sudo bench/backup/store-read-bound.sh [SIZE_MIB] [ROUNDS]     (default 2048, 2; root: drops the page cache)
#
# BIN=path/to/file_backup runs that build (default: built in release). Data in $BENCH_DIR (default /var/tmp).
set -euo pipefail
cd "$(dirname "$0")/../.."
SIZE_MIB=${1:-2048}
ROUNDS=${2:-2}
W=$(mktemp -d "${BENCH_DIR:-/var/tmp}/corral-store-read.XXXXXX")
trap 'rm -rf "$W"' EXIT
if [ -z "${BIN:-}" ]; then
    cargo build --release -q -p backupstore --examples
    BIN=${CARGO_TARGET_DIR:-target}/release/examples/file_backup
fi
head -c "$((SIZE_MIB << 20))" /dev/urandom > "$W/random.img"
"$BIN" backup "$W/random.img" "file://$W/store" vol b1 > /dev/null
sync
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
t() { local s e; s=$(date +%s.%N); "$@"; e=$(date +%s.%N); python3 -c "print(f'{$e - $s:.2f}')"; }
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$ROUNDS"); do
    echo "round $r"
    drop; echo "cat of the source (uncached): $(t sh -c "cat '$W/random.img' > /dev/null") s"
    drop; echo "fio of the source, direct 2 MiB, QD 8: $(fio --name=s --filename="$W/random.img" --rw=read --bs=2M \
        --direct=1 --ioengine=libaio --iodepth=8 2>/dev/null | grep -o 'run=[0-9]*-[0-9]*msec' | head -1)"
    for n in 1 8 32; do drop; python3 bench/backup/store-read.py "$W/store" "$n"; done
    drop; echo "cp+sync (source uncached): $(t sh -c "cp '$W/random.img' '$W/copy.img'; sync") s"
    rm -f "$W/copy.img"; sync
    drop; echo "restore (store uncached): $("$BIN" restore "$W/r.img" "file://$W/store" vol b1)"
    cmp "$W/random.img" "$W/r.img" || { echo "restore differs" >&2; exit 1; }
    rm -f "$W/r.img"; sync
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
