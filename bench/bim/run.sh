#!/usr/bin/env bash
# Backing-image benchmark: time from create to `ready` on three disks (issue 17) against what a user would do by
# hand, in one run, on loopback. Prints two tables.
#
#   1. Create to ready on 3 disks: a `corral-datasource` downloads the image from a local HTTP server
#      (python3 http.server) onto disk A (zero blocks left as holes, SHA-512 while streaming), `corral-bim` A takes
#      the file over and verifies it (whole-file SHA-512), then B and C sync it from A one after the other
#      (sparse-sync, each copy verified before `ready`) -- against `curl -o` onto A + `corral-sync copy` A->B and
#      A->C (no verification at all). Target (issue 17): <= 1.3x.
#   2. One sync A->B (`corral-bim sync`, verified) against one `corral-sync copy` of the same file.
#
#   bench/bim/run.sh                 # 2 GiB image, 50% zeros (2 MiB random data / 2 MiB zeros)
#   SIZE_MIB=512 bench/bim/run.sh    # smaller, quicker
#   PARALLEL=1 bench/bim/run.sh      # B and C sync at once (as the controller does); the copies stay sequential
#
# Every timing includes the destination's fsync (curl's output is synced; both tools flush before they report
# done) and starts from a warm page cache for the source. The load of the machine is printed with the results:
# compare runs made at a similar load. Needs about 4x SIZE_MIB/2 free under BENCH_DIR plus the served image.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DIR="${BENCH_DIR:-/var/tmp/corral-bench-bim}"
SIZE_MIB="${SIZE_MIB:-2048}"
PARALLEL="${PARALLEL:-0}"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"

if [[ -z "${BIN_DIR:-}" ]]; then
  (cd "$ROOT" && cargo build --release -q -p backing-image-manager -p sparse-sync -p data-source --bins)
  BIN_DIR="$TARGET/release"
fi
BIM="$BIN_DIR/corral-bim"
SYNC="$BIN_DIR/corral-sync"
DS="$BIN_DIR/corral-datasource"

PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [[ -n "$p" ]] && kill "$p" 2>/dev/null || true; done
  rm -rf "$DIR/a" "$DIR/b" "$DIR/c" "$DIR/copy"
}
trap cleanup EXIT

new_disks() {
  rm -rf "$DIR/a" "$DIR/b" "$DIR/c" "$DIR/copy"
  mkdir -p "$DIR/copy"
  for d in a b c; do
    mkdir -p "$DIR/$d"
    echo "{\"diskUUID\": \"bench-$d\"}" > "$DIR/$d/corral-disk.cfg"
  done
}

mkdir -p "$DIR/www"
IMG="$DIR/www/image.raw"
SIZE=$((SIZE_MIB << 20))
if [[ ! -f "$IMG" || $(stat -c %s "$IMG") != "$SIZE" ]]; then
  python3 - "$IMG" "$SIZE_MIB" <<'PY'
import os, sys
path, mib = sys.argv[1], int(sys.argv[2])
with open(path, "wb") as f:
    for i in range(0, mib, 4):  # 2 MiB of random data, then 2 MiB of zeros (written: the server sends them)
        f.write(os.urandom(2 << 20))
        f.write(bytes(2 << 20))
PY
fi
SUM=$(sha512sum "$IMG" | cut -d' ' -f1)

# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"
http_serve "$DIR/www"
PIDS+=("$HTTP_PID")
URL="http://127.0.0.1:$HTTP_PORT/image.raw"

start_bim() { # DISK UUID PORT_RANGE -> sets ADDR (gRPC and HTTP on port 0, read from the ready file)
  rm -f "$1.ready"
  "$BIM" --ready-file "$1.ready" serve --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --disk-path "$1" \
    --disk-uuid "$2" --port-range "$3" 2>"$1.log" &
  PIDS+=($!)
  ready_wait "$1.ready" "$!" || { cat "$1.log" >&2; exit 1; }
  ADDR=$(ready_addr "$1.ready" grpc)
}
now() { date +%s.%N; }
since() { echo "$(now) - $1" | bc -l; }
sync_image() { # TO FROM
  "$BIM" --url "$1" sync --name img --uuid u1 --size "$SIZE" --checksum "$SUM" --from "$2" >/dev/null
}
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)

# --- 1. create to ready on three disks -------------------------------------------------------------------------
new_disks
start_bim "$DIR/a" bench-a 34000-34010; A=$ADDR
start_bim "$DIR/b" bench-b 34011-34020; B=$ADDR
start_bim "$DIR/c" bench-c 34021-34030; C=$ADDR
cat "$IMG" >/dev/null

rm -f "$DIR/ds.ready"
t0=$(now)
"$DS" --ready-file "$DIR/ds.ready" serve --listen 127.0.0.1:0 --disk-path "$DIR/a" --disk-uuid bench-a --name img --uuid u1 \
  --source-type download --param "url=$URL" --expected-checksum "$SUM" 2>"$DIR/ds.log" &
DS_PID=$!
PIDS+=($DS_PID)
ready_wait "$DIR/ds.ready" "$DS_PID" || { cat "$DIR/ds.log" >&2; exit 1; }
DS_ADDR=$(ready_addr "$DIR/ds.ready" http)
while :; do
  state=$(curl -sf "http://$DS_ADDR/v1/file" | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])' 2>/dev/null || true)
  [[ "$state" == ready-for-transfer ]] && break
  [[ "$state" == failed ]] && { echo "download failed" >&2; cat "$DIR/ds.log" >&2; exit 1; }
  sleep 0.02
done
T_DOWNLOAD=$(since "$t0")
t1=$(now)
"$BIM" --url "$A" fetch --name img --uuid u1 --size "$SIZE" --checksum "$SUM" --data-source "$DS_ADDR" >/dev/null
T_FETCH=$(since "$t1")
kill "$DS_PID" 2>/dev/null || true
t1=$(now)
if [[ "$PARALLEL" == 1 ]]; then
  sync_image "$B" "$A" & sb=$!
  sync_image "$C" "$A" & sc=$!
  wait "$sb"; wait "$sc"
else
  sync_image "$B" "$A"
  sync_image "$C" "$A"
fi
T_SYNCS=$(since "$t1")
T_BIM=$(since "$t0")
for d in a b c; do
  f="$DIR/$d/backing-images/img-u1/backing"
  [[ $(sha512sum "$f" | cut -d' ' -f1) == "$SUM" ]] || { echo "copy on $d differs" >&2; exit 1; }
done
ALLOC_A=$(( $(stat -c %b "$DIR/a/backing-images/img-u1/backing") * 512 ))

cat "$IMG" >/dev/null
t0=$(now)
curl -sS -o "$DIR/a/copy" "$URL"; sync "$DIR/a/copy"
T_CURL=$(since "$t0")
t1=$(now)
"$SYNC" copy "$DIR/a/copy" "$DIR/b/copy" 2>/dev/null
"$SYNC" copy "$DIR/a/copy" "$DIR/c/copy" 2>/dev/null
T_COPIES=$(since "$t1")
T_BASE=$(since "$t0")

# --- 2. one sync against one copy ------------------------------------------------------------------------------
"$BIM" --url "$B" rm img --uuid u1 >/dev/null
cat "$DIR/a/backing-images/img-u1/backing" >/dev/null
t0=$(now); sync_image "$B" "$A"; T_SYNC1=$(since "$t0")
rm -f "$DIR/copy/one"
t0=$(now); "$SYNC" copy "$DIR/a/backing-images/img-u1/backing" "$DIR/copy/one" 2>/dev/null; T_COPY1=$(since "$t0")
t0=$(now); sha512sum "$DIR/b/backing-images/img-u1/backing" >/dev/null; T_SHA=$(since "$t0")
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

printf '\n%s MiB image, 50%% zeros (kept as holes: %s MiB allocated on A); load average %s before, %s after\n' \
  "$SIZE_MIB" "$((ALLOC_A >> 20))" "$LOAD_BEFORE" "$LOAD_AFTER"
printf '\n1. create to ready on 3 disks (syncs %s)\n\n' "$([[ $PARALLEL == 1 ]] && echo parallel || echo sequential)"
printf '%-58s %9s %8s\n' "step" "seconds" "ratio"
row() { printf '%-58s %9.2f %8s\n' "$1" "$2" "${3:-}"; }
ratio() { printf '%.2f' "$(echo "$1 / $2" | bc -l)"; }
row "curl -o A + sync, corral-sync copy A->B, A->C (baseline)" "$T_BASE" "1.00"
row "  curl -o + sync" "$T_CURL"
row "  2x corral-sync copy" "$T_COPIES"
row "corral: data source -> A (fetch) -> B, C (sync), all ready" "$T_BIM" "$(ratio "$T_BIM" "$T_BASE")"
row "  data source download to ready-for-transfer (+SHA-512)" "$T_DOWNLOAD" "$(ratio "$T_DOWNLOAD" "$T_CURL")"
row "  A: take over by rename + verify (SHA-512)" "$T_FETCH"
row "  B, C: sync + verify" "$T_SYNCS" "$(ratio "$T_SYNCS" "$T_COPIES")"
printf '\n2. one copy between disks\n\n'
printf '%-58s %9s %8s\n' "method" "seconds" "ratio"
row "corral-sync copy (local, no verification)" "$T_COPY1" "1.00"
row "corral-bim sync A->B (loopback, verified)" "$T_SYNC1" "$(ratio "$T_SYNC1" "$T_COPY1")"
row "  (reference: sha512sum of the copy, reads the holes)" "$T_SHA"
