#!/usr/bin/env bash
# Backup and restore of SIZE_MIB of random data through S3: `rclone serve s3` on loopback (as the backupstore tests
# start it), 2 MiB blocks; two builds of the file_backup example side by side (a before/after check of the S3 path).
#
#   BIN=path/to/file_backup [BIN_B=another build] bench/backup/s3.sh [SIZE_MIB] [ROUNDS]   (default 1024, 1)
#
# Data and the bucket in $BENCH_DIR (default /var/tmp); rclone on 127.0.0.1:$PORT (default 18987).
set -euo pipefail
SIZE=${1:-1024}
ROUNDS=${2:-1}
PORT=${PORT:-18987}
W=$(mktemp -d "${BENCH_DIR:-/var/tmp}/corral-s3-bench.XXXXXX")
mkdir -p "$W/s3/bk"
rclone serve s3 "$W/s3" --addr "127.0.0.1:$PORT" --auth-key corral,corral-secret > "$W/rclone.log" 2>&1 &
RCLONE=$!
trap 'kill $RCLONE; rm -rf "$W"' EXIT
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$PORT/" && break; sleep 0.1; done
export AWS_ACCESS_KEY_ID=corral AWS_SECRET_ACCESS_KEY=corral-secret
head -c "$((SIZE << 20))" /dev/urandom > "$W/src.img"
secs() { python3 -c 'import json,sys; print(round(json.loads(sys.stdin.readline())["seconds"], 2))'; }
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "round | build | backup s | restore s"
for r in $(seq "$ROUNDS"); do
    for b in "$BIN" ${BIN_B:-}; do
        u="s3://bk/$(basename "$b")$r?endpoint=http://127.0.0.1:$PORT&region=us-east-1"
        tb=$("$b" backup "$W/src.img" "$u" vol b1 | secs)
        tr=$("$b" restore "$W/r.img" "$u" vol b1 | secs)
        cmp "$W/src.img" "$W/r.img" || { echo "restore differs" >&2; exit 1; }
        rm -f "$W/r.img"; sync
        echo "$r | $(basename "$b") | $tb | $tr"
    done
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
