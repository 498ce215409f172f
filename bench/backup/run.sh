#!/usr/bin/env bash
# Backup store throughput vs tar and cp on the same disk, and bytes uploaded by a 1 % change incremental.
#
#   bench/backup/run.sh [SIZE_MIB]        (default 2048; data goes to $BENCH_DIR, default /var/tmp)
#
# Builds `backupstore`'s file_backup example in release. Sources: 2 GiB of random data (incompressible) and
# 2 GiB of alternating random / zero-filled 4 MiB chunks (zeros written, not holes: the backup must read them).
# Target: a local directory on the same disk (file://, every object fsynced). tar and cp are followed by sync.
# Not part of the test suite.
set -euo pipefail
cd "$(dirname "$0")/../.."
SIZE_MIB=${1:-2048}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
W=$(mktemp -d "$BENCH_DIR/corral-backup-bench.XXXXXX")
trap 'rm -rf "$W"' EXIT
# BIN=/path/to/file_backup runs another build of the example (a before/after comparison) without building.
if [ -z "${BIN:-}" ]; then
    cargo build --release -q -p backupstore --examples
    BIN=${CARGO_TARGET_DIR:-target}/release/examples/file_backup
fi

echo "generating ${SIZE_MIB} MiB sources in $W ..." >&2
head -c "$((SIZE_MIB << 20))" /dev/urandom > "$W/random.img"
python3 - "$W/random.img" "$W/halfzero.img" <<'PY'
import sys
src, dst = open(sys.argv[1], 'rb'), open(sys.argv[2], 'wb')
zero = bytes(4 << 20)
i = 0
while True:
    b = src.read(4 << 20)
    if not b:
        break
    dst.write(b if i % 2 == 0 else zero[:len(b)])
    i += 1
PY
sync

secs() { python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["seconds"])'; }
timed() { local s e; s=$(date +%s.%N); "$@"; sync; e=$(date +%s.%N); python3 -c "print($e - $s)"; }
mbs() { python3 -c "print(f'{$SIZE_MIB / $1:8.0f}')"; }

# Page cache: cp's source is cached (just written), while the blocks a backup stored are not (written with
# O_DIRECT), so the first restore reads the store from the disk as well as writing the volume. Each restore is
# therefore also compared with its like: a restore from a cached store (its block files read once with cat) against
# cp of a cached source, and a restore from the store as the backup left it against cp of a source evicted from
# the page cache (`dd iflag=nocache count=0`: posix_fadvise DONTNEED of the whole file, no root needed).
uncache() { dd if="$1" iflag=nocache count=0 status=none; }
cache_store() { find "$1" -name '*.blk' -print0 | xargs -0 cat > /dev/null; }
printf '%-10s | %-44s | %8s | %9s | %12s | %s\n' "data" "operation" "seconds" "MiB/s" "vs cp cached" "vs cp uncached"
printf -- '-----------|----------------------------------------------|----------|-----------|--------------|---------------\n'
for kind in random halfzero; do
    f="$W/$kind.img"
    t_cp=$(timed cp "$f" "$W/copy.img"); rm -f "$W/copy.img"
    uncache "$f"
    t_cpu=$(timed cp "$f" "$W/copy.img"); rm -f "$W/copy.img"
    cat "$f" > /dev/null
    t_tar=$(timed tar -cf "$W/copy.tar" -C "$W" "$kind.img"); rm -f "$W/copy.tar"
    t_bk=$("$BIN" backup "$f" "file://$W/store-$kind" vol b1 | tee "$W/$kind.backup.json" | secs)
    t_rs=$("$BIN" restore "$W/restored.img" "file://$W/store-$kind" vol b1 | secs)
    cmp "$f" "$W/restored.img" || { echo "restore of $kind differs" >&2; exit 1; }
    rm -f "$W/restored.img"
    cache_store "$W/store-$kind"
    t_rsc=$("$BIN" restore "$W/restored.img" "file://$W/store-$kind" vol b1 | secs)
    cmp "$f" "$W/restored.img" || { echo "restore of $kind differs" >&2; exit 1; }
    rm -f "$W/restored.img"
    for row in "cp+sync (source cached):$t_cp" "cp+sync (source not cached):$t_cpu" "tar -cf+sync:$t_tar" \
        "backup (lz4, 2 MiB, 8 in flight):$t_bk" "restore (store not cached, 8 in flight):$t_rs" \
        "restore (store cached, 8 in flight):$t_rsc"; do
        op=${row%%:*}; t=${row##*:}
        printf '%-10s | %-44s | %8.2f | %9s | %11.2fx | %13.2fx\n' "$kind" "$op" "$t" "$(mbs "$t")" \
            "$(python3 -c "print($t_cp / $t)")" "$(python3 -c "print($t_cpu / $t)")"
    done
    stored=$(du -sb "$W/store-$kind" | cut -f1)
    echo "$kind: stored $((stored >> 20)) MiB for ${SIZE_MIB} MiB" >&2
done

# 1 % change: extents of 1 MiB at random 4 KiB-aligned offsets (seeded; aligned to nothing larger, as a guest
# filesystem's writes are), SIZE/100 of them, written into a copy; the incremental of the copy uploads
# ~ (1 MiB + B) per extent for block size B (each extent dirties about 1 MiB / B + 1 blocks).
cp "$W/random.img" "$W/changed.img"
n=$(python3 - "$W/changed.img" "$SIZE_MIB" <<'PY'
import os, random, sys
path, size_mib = sys.argv[1], int(sys.argv[2])
rng = random.Random(18)
n = max(1, size_mib // 100)
with open(path, 'r+b') as f:
    for _ in range(n):
        off = rng.randrange(0, ((size_mib << 20) - (1 << 20)) // 4096) * 4096
        f.seek(off)
        f.write(os.urandom(1 << 20))
print(n)
PY
)
# Per block size (BLOCK_SIZES, bytes; default 2 MiB, 512 KiB, 256 KiB): a full backup of the random data into a new
# store (seconds, objects = S3 PUTs), its restore (seconds, objects read = S3 GETs), then the incremental of the
# changed copy. The default block size's full and restore are the ones above, timed again here beside the others.
printf '\n%-10s | %9s | %8s | %9s | %13s | %s\n' "block size" "full s" "objects" "restore s" "1% change s" "1% change uploads"
printf -- '-----------|-----------|----------|-----------|---------------|------------------\n'
for bs in ${BLOCK_SIZES:-2097152 524288 262144}; do
    store="file://$W/store-bs$bs"
    "$BIN" backup "$W/random.img" "$store" vol b1 "$bs" > "$W/full.json"
    sync
    t_rs=$("$BIN" restore "$W/restored.img" "$store" vol b1 | secs)
    rm -f "$W/restored.img"
    "$BIN" backup "$W/changed.img" "$store" vol b2 "$bs" > "$W/inc.json"
    python3 - "$W/full.json" "$W/inc.json" "$n" "$SIZE_MIB" "$bs" "$t_rs" <<'PY'
import json, sys
f = json.load(open(sys.argv[1])); r = json.load(open(sys.argv[2])); s = r["stats"]
n, size, bs, t_rs = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
assert r["incremental"], r
print(f"{bs >> 10:>6} KiB | {f['seconds']:9.2f} | {f['stats']['newBlocks']:8d} | {t_rs:9.2f} | {r['seconds']:13.2f} | "
      f"{s['newBlocks']} blocks = {s['newBytes'] / 2**20:.1f} MiB = {100 * s['newBytes'] / 2**20 / size:.2f} % "
      f"of the volume ({n} MiB = {100 * n / size:.2f} % written)")
PY
done
