#!/bin/bash
# 4 KiB random overwrites (psync, 1 thread, 5 s) of a 1 GiB file filled with 1 MiB writes: page cache kept from the
# fill (invalidate=0: large folios) against dropped first (fio's default invalidate=1: each write makes a 4 KiB folio).
set -e
# Usage: bench/datapath/folio_micro.sh (needs fio; BENCH_DIR, default /var/tmp, on the file system to test).
DIR="$(mktemp -d "${BENCH_DIR:-/var/tmp}/folio-micro.XXXXXX")"
trap 'rm -rf "$DIR"' EXIT
cd "$DIR"
for round in 1 2; do for inv in 0 1; do
rm -f f; fio --name=fill --filename=f --size=1G --rw=write --bs=1m --ioengine=psync --end_fsync=1 --output=/dev/null; sync -f .
fio --name=rw --filename=f --size=1G --rw=randwrite --invalidate=$inv --bs=4k --ioengine=psync --time_based --runtime=5 --norandommap --randrepeat=0 --output-format=json --output=rw.json
python3 -c "import json;d=json.load(open('rw.json'));j=d['jobs'][0];print('round $round invalidate=$inv: randwrite 4k IOPS', round(j['write']['iops']))"
done; done
