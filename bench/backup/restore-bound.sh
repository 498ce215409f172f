#!/usr/bin/env bash
# What bounds a restore: restores of SIZE_MIB of random data (2 MiB blocks, file:// on the same disk) from a store
# not in the page cache and from a cached one, against cp of a cached and an uncached source, and against only
# moving the restore's bytes (cat of the uncached store while cp copies the cached source: no hashing at all).
#
#   sudo bench/backup/restore-bound.sh [SIZE_MIB] [ROUNDS]     (default 2048 MiB, 3 rounds; data in $BENCH_DIR)
#
# Needs root (drops the page cache with /proc/sys/vm/drop_caches). BIN=path/to/file_backup runs that build (default:
# built in release); BIN_B=another build adds its restores to each round (a before/after comparison), from a store
# that build's backup wrote (a change of how blocks are written shows in its restores). CONCURRENCY=N: blocks in
# flight of every restore (default: the example's, 8). Prints the store's block files and their extents (filefrag):
# a block file in more than one extent costs more than one read.
set -euo pipefail
cd "$(dirname "$0")/../.."
SIZE_MIB=${1:-2048}
ROUNDS=${2:-3}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
W=$(mktemp -d "$BENCH_DIR/corral-restore-bound.XXXXXX")
trap 'rm -rf "$W"' EXIT
if [ -z "${BIN:-}" ]; then
    cargo build --release -q -p backupstore --examples
    BIN=${CARGO_TARGET_DIR:-target}/release/examples/file_backup
fi
head -c "$((SIZE_MIB << 20))" /dev/urandom > "$W/random.img"
"$BIN" backup "$W/random.img" "file://$W/store" vol b1 > /dev/null
[ -n "${BIN_B:-}" ] && "$BIN_B" backup "$W/random.img" "file://$W/store-b" vol b1 > /dev/null
sync
extents() {
    find "$1" -name '*.blk' -print0 | xargs -0 filefrag | awk '{n++; e += $(NF-2)} END {print n " block files, " e " extents"}'
}
echo "store: $(extents "$W/store")"
[ -n "${BIN_B:-}" ] && echo "store B: $(extents "$W/store-b")"

t() { local s e; s=$(date +%s.%N); "$@"; sync; e=$(date +%s.%N); python3 -c "print(f'{$e - $s:.2f}')"; }
secs() { python3 -c 'import json,sys; print(round(json.loads(sys.stdin.readline())["seconds"], 2))'; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
cat_store() { find "${1:-$W/store}" -name '*.blk' -print0 | xargs -0 cat > /dev/null; }
both() { cat_store & cp "$W/random.img" "$W/copy.img"; wait; }
restore() {
    "$1" restore "$W/r.img" "file://${2:-$W/store}" vol b1 ${CONCURRENCY:-} | secs
    cmp "$W/random.img" "$W/r.img" || { echo "restore differs" >&2; exit 1; }
    rm -f "$W/r.img"; sync
}

echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
printf 'round | cp cached | cp uncached | cat uncached store + cp cached | restore uncached | restore cached'
[ -n "${BIN_B:-}" ] && printf ' | B uncached | B cached'
echo
for r in $(seq "$ROUNDS"); do
    drop; cat "$W/random.img" > /dev/null; a=$(t cp "$W/random.img" "$W/copy.img"); rm -f "$W/copy.img"; sync
    drop; b=$(t cp "$W/random.img" "$W/copy.img"); rm -f "$W/copy.img"; sync
    drop; cat "$W/random.img" > /dev/null; c=$(t both); rm -f "$W/copy.img"; sync
    drop; d=$(restore "$BIN")
    cat_store; e=$(restore "$BIN")
    line="$r | $a | $b | $c | $d | $e"
    if [ -n "${BIN_B:-}" ]; then
        drop; f=$(restore "$BIN_B" "$W/store-b")
        cat_store "$W/store-b"; g=$(restore "$BIN_B" "$W/store-b")
        line="$line | $f | $g"
    fi
    echo "$line"
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
