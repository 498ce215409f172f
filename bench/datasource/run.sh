#!/usr/bin/env bash
# Download throughput of corral-datasource against `curl -o` of the same file from the same loopback HTTP server
# (python3 -m http.server), in one run. Prints a table of times, MiB/s and the ratio to curl.
#
#   bench/datasource/run.sh                 # 1 GiB: half random data, half zeros (zeros stay holes)
#   DATA_MIB=256 bench/datasource/run.sh    # quicker
#
# curl's time includes `sync` of its output; the data source's "transfer" time is until every byte is on disk
# (processedSize = size, it flushes before checksumming) and its "ready" time adds the SHA-512 of the file,
# which curl does not do: `sha512sum` of the same file is shown beside it for reference.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DIR="${BENCH_DIR:-/var/tmp/corral-bench-datasource}"
DATA_MIB="${DATA_MIB:-1024}"
REPEAT="${REPEAT:-1}"

if [[ -z "${BIN:-}" ]]; then
  (cd "$ROOT" && CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target-bench}" cargo build --release -q -p data-source)
  BIN="${CARGO_TARGET_DIR:-$ROOT/target-bench}/release/corral-datasource"
fi

mkdir -p "$DIR/www" "$DIR/disk"
HTTP_PID="" DS_PID=""
cleanup() {
  [[ -n "$HTTP_PID" ]] && kill "$HTTP_PID" 2>/dev/null
  [[ -n "$DS_PID" ]] && kill "$DS_PID" 2>/dev/null
  rm -rf "$DIR/disk" "$DIR/curl.out"
}
trap cleanup EXIT

IMG="$DIR/www/image.raw"
if [[ ! -f "$IMG" || $(stat -c %s "$IMG") != $((DATA_MIB << 20)) ]]; then
  python3 - "$IMG" "$DATA_MIB" <<'PY'
import os, sys
path, mib = sys.argv[1], int(sys.argv[2])
rnd = os.urandom(1 << 20)
with open(path, "wb") as f:
    for i in range(mib):  # alternating 1 MiB of data and 1 MiB of zeros
        f.write(rnd if i % 2 == 0 else bytes(1 << 20))
PY
fi
SIZE=$(stat -c %s "$IMG")
cat "$IMG" > /dev/null  # warm the page cache: both clients read from memory

# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"
http_serve "$DIR/www"
for _ in $(seq 100); do curl -sf -o /dev/null -r 0-0 "http://127.0.0.1:$HTTP_PORT/image.raw" && break; sleep 0.1; done
URL="http://127.0.0.1:$HTTP_PORT/image.raw"

now() { date +%s.%N; }
mibs() { python3 -c "print(f'{$SIZE / 1048576 / $1:.0f}')"; }

best_curl=""
for _ in $(seq "$REPEAT"); do
  rm -f "$DIR/curl.out"; sync
  t0=$(now); curl -sS -o "$DIR/curl.out" "$URL"; sync "$DIR/curl.out"; t1=$(now)
  t=$(python3 -c "print($t1 - $t0)")
  [[ -z "$best_curl" ]] || python3 -c "import sys; sys.exit(0 if $t < $best_curl else 1)" && best_curl=$t
done
t0=$(now); sha512sum "$DIR/curl.out" >/dev/null; t1=$(now)
sha=$(python3 -c "print($t1 - $t0)")

best_xfer="" best_ready=""
for _ in $(seq "$REPEAT"); do
  rm -rf "$DIR/disk"; mkdir -p "$DIR/disk"; echo '{"diskUUID":"bench"}' > "$DIR/disk/corral-disk.cfg"; sync
  rm -f "$DIR/ds.ready"
  t0=$(now)
  "$BIN" --ready-file "$DIR/ds.ready" serve --listen 127.0.0.1:0 --disk-path "$DIR/disk" --disk-uuid bench --name img --uuid u1 \
    --source-type download --param "url=$URL" 2>"$DIR/ds.log" &
  DS_PID=$!
  ready_wait "$DIR/ds.ready" "$DS_PID"
  DS_ADDR=$(ready_addr "$DIR/ds.ready" http)
  xfer=""
  while :; do
    j=$(curl -sf "http://$DS_ADDR/v1/file" || true)
    [[ -z "$j" ]] && { sleep 0.02; continue; }
    state=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(d["state"], d["processedSize"])' "$j")
    set -- $state
    if [[ -z "$xfer" && "$2" == "$SIZE" ]]; then xfer=$(python3 -c "print($(now) - $t0)"); fi
    [[ "$1" == ready-for-transfer ]] && break
    [[ "$1" == failed ]] && { echo "download failed: $j" >&2; exit 1; }
    sleep 0.02
  done
  ready=$(python3 -c "print($(now) - $t0)")
  kill "$DS_PID"; wait "$DS_PID" 2>/dev/null || true; DS_PID=""
  [[ -z "$best_xfer" ]] || python3 -c "import sys; sys.exit(0 if $xfer < $best_xfer else 1)" && best_xfer=$xfer
  [[ -z "$best_ready" ]] || python3 -c "import sys; sys.exit(0 if $ready < $best_ready else 1)" && best_ready=$ready
done
real=$(du -B1 "$DIR/disk/tmp/img-u1" 2>/dev/null | cut -f1 || echo "?")

printf '\nDownload of %d MiB (half data, half zeros) from python3 http.server on loopback, best of %s\n\n' \
  $((SIZE >> 20)) "$REPEAT"
printf '%-48s %9s %8s %9s\n' "client" "seconds" "MiB/s" "vs curl"
printf '%-48s %9.2f %8s %9s\n' "curl -o FILE + sync" "$best_curl" "$(mibs "$best_curl")" "1.00"
printf '%-48s %9.2f %8s %9.2f\n' "corral-datasource: data on disk" "$best_xfer" "$(mibs "$best_xfer")" \
  "$(python3 -c "print($best_curl / $best_xfer)")"
printf '%-48s %9.2f %8s %9.2f\n' "corral-datasource: ready-for-transfer (+SHA-512)" "$best_ready" \
  "$(mibs "$best_ready")" "$(python3 -c "print($best_curl / $best_ready)")"
printf '%-48s %9.2f %8s %9s\n' "(reference: sha512sum of the file)" "$sha" "$(mibs "$sha")" "-"
both=$(python3 -c "print($best_curl + $sha)")
printf '%-48s %9.2f %8s %9.2f\n' "curl -o + sync, then sha512sum (verified copy)" "$both" "$(mibs "$both")" \
  "$(python3 -c "print($best_curl / $both)")"
printf '%-48s %9s %8s %9.2f\n' "  data source ready-for-transfer vs that" "" "" "$(python3 -c "print($both / $best_ready)")"
printf '\nallocated: curl output %s bytes, data-source file %s bytes (zeros kept as holes)\n' \
  "$(du -B1 "$DIR/curl.out" | cut -f1)" "$real"
