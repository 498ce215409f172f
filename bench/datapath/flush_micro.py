#!/usr/bin/env python3
# 3 "replicas" flushing at once, as the engine's fan-out does: each dirties 32 random 4 KiB blocks of its head, then
# flushes: head only / head then counter / head with counter in parallel / counter by sync_file_range + head.
# Run it from a scratch directory on the disk under test: it leaves head0-2.img (3 x 128 MiB) and counter0-2 there.
import os, time, random, threading, ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
S = 128 << 20
N = int(os.environ.get("N", "150"))
blk = os.urandom(4096)
reps = []
for r in range(3):
    h = os.open(f"head{r}.img", os.O_RDWR | os.O_CREAT); os.ftruncate(h, S)
    for off in range(0, S, 1 << 20): os.pwrite(h, os.urandom(1 << 20), off)
    os.fdatasync(h)
    c = os.open(f"counter{r}", os.O_RDWR | os.O_CREAT); os.pwrite(c, b"0" * 4096, 0); os.fdatasync(c)
    reps.append((h, c))
def flush(mode, h, c, i):
    if mode == "head": os.fdatasync(h)
    elif mode == "seq": os.fdatasync(h); os.pwrite(c, str(i).encode().ljust(4096, b"\0"), 0); os.fdatasync(c)
    elif mode == "par":
        os.pwrite(c, str(i).encode().ljust(4096, b"\0"), 0)
        t = threading.Thread(target=os.fdatasync, args=(c,)); t.start(); os.fdatasync(h); t.join()
    elif mode == "sfr":
        os.pwrite(c, str(i).encode().ljust(4096, b"\0"), 0)
        libc.sync_file_range(c, ctypes.c_int64(0), ctypes.c_int64(4096), 7); os.fdatasync(h)
def run(mode):
    ts = []
    for i in range(N):
        for h, c in reps:
            for _ in range(32): os.pwrite(h, blk, random.randrange(S // 4096) * 4096)
        t0 = time.perf_counter()
        th = [threading.Thread(target=flush, args=(mode, h, c, i)) for h, c in reps]
        for t in th: t.start()
        for t in th: t.join()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return round(sum(ts) / N * 1e6), round(ts[N // 2] * 1e6)
for m in ["head", "seq", "par", "sfr"] * 3: print(m, "mean/p50 us of a 3-replica flush", run(m), flush=True)
