#!/usr/bin/env python3
"""Reads the block files of backup b1 of volume `vol` in a file:// store in restore order (block-map order) with
N threads, one buffered whole-file pread each: no hashing, no writes. Prints the seconds. What reading the store
alone costs at a given depth, beside reading one file (`bench/backup/store-read-bound.sh`).

    bench/backup/store-read.py STORE_DIR N
"""
import concurrent.futures as cf
import json
import os
import sys
import time

store, n = sys.argv[1], int(sys.argv[2])
cfg = json.load(open(f"{store}/volumes/vol/backups/backup_b1.cfg"))
paths = [f"{store}/volumes/vol/blocks/{h[:2]}/{h[2:4]}/{h}.blk"
         for h in (b["hash"] for b in cfg["blocks"])]


def read_whole(p):
    fd = os.open(p, os.O_RDONLY)
    try:
        return len(os.pread(fd, os.fstat(fd).st_size, 0))
    finally:
        os.close(fd)


t = time.time()
with cf.ThreadPoolExecutor(n) as ex:
    total = sum(ex.map(read_whole, paths))
print(f"store, {n} in flight: {total >> 20} MiB in {time.time() - t:.2f} s")
