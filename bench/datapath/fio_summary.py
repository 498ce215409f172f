#!/usr/bin/env python3
"""Turns fio JSON into the data-path table of bench/datapath/run.sh.

  fio_summary.py row JOB TARGET FIO.json [CPU_S SECONDS [CTX_SWITCHES]]
      -> one TSV row: job target iops mib_s p50_us p99_us cpu_us_per_io ctx_per_io, where CPU_S is the CPU time
         and CTX_SWITCHES the context switches (voluntary + involuntary) of the target's processes over SECONDS
         of the job (ramp included; its IOs are counted at the job's rate)
  fio_summary.py scrape ROLE=URL...
      -> JSON {role: {metric: value}} of the corral_io_counter_* metrics at each URL (an io-counters build),
         summed per role (the replicas of a target share the role "replicas")
  fio_summary.py countrow JOB TARGET FIO.json BEFORE.json AFTER.json SECONDS
      -> one TSV row of counts per IO for each role: job target role locks copies copied_x kernel_x, where
         copied_x / kernel_x are the bytes copied in user space / by the kernel as multiples of the IO size
  fio_summary.py counts COUNTS.tsv
      -> the table of those rows
  fio_summary.py table RESULTS.tsv
      -> the table with ratios to nbdkit (a) and qemu-nbd (a'), then issue 16's targets and issue 20's (v2 against
         v1), each marked met / MISSED (benchmarked, not asserted)
"""
import json
import sys

TARGET_LABELS = {
    "a": "(a) nbdkit file",
    "a2": "(a') qemu-nbd",
    "a3": "nbdkit nbd->file",
    "b": "(b) engine 1r",
    "c": "(c) engine 3r",
    "d": "(d) engine 3r+rev",
    "bt": "(b) 1r, TCP",
    "bp": "(b) 1r, one CPU",
    "cp": "(c) 3r, one CPU",
    "ct": "(c) 3r, TCP",
    "btls": "(b) 1r, TCP+mTLS",
    "ctls": "(c) 3r, TCP+mTLS",
    "b0": "(b) 1r, before",
    "c0": "(c) 3r, before",
    "d0": "(d) 3r+rev, before",
    "bx": "(b) 1r, ALT_ENV",
    "cx": "(c) 3r, ALT_ENV",
    "by": "(b) 1r, ALT_ENV2",
    "cy": "(c) 3r, ALT_ENV2",
    "v2b": "v2 engine 1r",
    "v2bt": "v2 1r, TCP",
    "v2c": "v2 engine 3r",
    "bs": "(b) after snap",
    "v2bs": "v2 1r after snap",
    "v2bd": "v2 1r O_DIRECT",
    "v2bsd": "v2 1r O_DIRECT snap",
    "v2b0": "v2 engine 1r, before",
    "v2bs0": "v2 1r after snap, before",
    "v2bw": "v2 1r, store written",
    "v2bsw": "v2 1r snap, store written",
}

# Issue 20: each v2 target against the v1 target of the same shape, measured in the same run (both on their unix
# sockets, as the manager runs them; v2bt / bt both on TCP).
V2_PEERS = [("v2b", "b"), ("v2bt", "bt"), ("v2c", "c"), ("v2bs", "bs"), ("v2bd", "b"), ("v2bsd", "bs"),
            ("v2b0", "b"), ("v2bs0", "bs"), ("v2bw", "b"), ("v2bsw", "bs")]


def row(job, target, path, cpu_s=None, seconds=None, ctx=None):
    with open(path) as f:
        text = f.read()
    # fio may print text lines before the JSON; run.sh strips them, this is a second guard.
    data = json.loads(text[text.index("{"):])
    j = data["jobs"][0]
    if j.get("error"):
        sys.exit(f"{path}: fio job error {j['error']}")
    side = j["write"] if j["write"]["io_bytes"] > j["read"]["io_bytes"] else j["read"]
    pct = side["clat_ns"].get("percentile", {})
    p50 = pct.get("50.000000", 0) / 1000
    p99 = pct.get("99.000000", 0) / 1000
    cpu_per_io = "-"
    if cpu_s is not None and side["iops"] > 0:
        cpu_per_io = f"{float(cpu_s) * 1e6 / (side['iops'] * float(seconds)):.1f}"
    ctx_per_io = "-"
    if ctx is not None and side["iops"] > 0:
        ctx_per_io = f"{float(ctx) / (side['iops'] * float(seconds)):.2f}"
    print(f"{job}\t{target}\t{side['iops']:.0f}\t{side['bw_bytes'] / 2**20:.1f}\t{p50:.0f}\t{p99:.0f}\t{cpu_per_io}"
          f"\t{ctx_per_io}")


def _io(path):
    with open(path) as f:
        text = f.read()
    j = json.loads(text[text.index("{"):])["jobs"][0]
    side = j["write"] if j["write"]["io_bytes"] > j["read"]["io_bytes"] else j["read"]
    return side["iops"], side["io_bytes"] / max(side["total_ios"], 1)


def scrape(*pairs):
    import urllib.request
    out = {}
    for pair in pairs:
        role, url = pair.split("=", 1)
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        acc = out.setdefault(role, {})
        for line in text.splitlines():
            # The engine's own read and write counts are the exact IO count of the job (fio's is per second).
            if line.startswith(("corral_io_counter_", "corral_engine_reads_total", "corral_engine_writes_total")):
                name, value = line.split()[:2]
                name = name.split("{")[0].removesuffix("_total").removeprefix("corral_io_counter_")
                acc[name] = acc.get(name, 0) + float(value)
    print(json.dumps(out))


def countrow(job, target, path, before, after, seconds):
    iops, bs = _io(path)
    with open(before) as f:
        b = json.load(f)
    with open(after) as f:
        a = json.load(f)

    def delta(role, name):
        return a.get(role, {}).get(name, 0) - b.get(role, {}).get(name, 0)

    # IOs the engine completed between the scrapes (ramp included); fio's rate times the time otherwise.
    ios = delta("engine", "corral_engine_reads") + delta("engine", "corral_engine_writes")
    if ios <= 0:
        ios = iops * float(seconds)
    for role in a:
        a[role] = {k: v for k, v in a[role].items() if not k.startswith("corral_engine_")}
        d = {k: a[role].get(k, 0) - b.get(role, {}).get(k, 0) for k in a[role]}
        if not d or ios <= 0:
            continue
        print(f"{job}\t{target}\t{role}\t{d.get('locks', 0) / ios:.2f}\t{d.get('copies', 0) / ios:.2f}"
              f"\t{d.get('copied_bytes', 0) / ios / bs:.2f}\t{d.get('kernel_bytes', 0) / ios / bs:.2f}")


def counts(path):
    header = ["job", "target", "process", "locks/IO", "memcpy calls/IO", "user copies of the payload",
              "kernel copies of the payload"]
    rows = [header]
    with open(path) as f:
        for line in f:
            job, target, role, *vals = line.rstrip("\n").split("\t")
            rows.append([job, TARGET_LABELS.get(target, target), role, *vals])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for i, r in enumerate(rows):
        print("| " + " | ".join(c.ljust(w) if k < 3 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths)))
              + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) if k < 3 else "-" * (w + 1) + ":" for k, w in enumerate(widths))
                  + "|")


def ratio(x, base):
    return f"{x / base:.2f}" if base else "-"


def table(path):
    rows = []
    with open(path) as f:
        for line in f:
            job, target, iops, mib, p50, p99, *extra = line.rstrip("\n").split("\t")
            cpu, ctx = (float(x) if x != "-" else None for x in (extra + ["-", "-"])[:2])
            rows.append((job, target, float(iops), float(mib), float(p50), float(p99), cpu, ctx))
    iops = {(r[0], r[1]): r[2] for r in rows}
    cpu = {(r[0], r[1]): r[6] for r in rows}
    ctx = {(r[0], r[1]): r[7] for r in rows}
    jobs = list(dict.fromkeys(r[0] for r in rows))

    header = ["job", "target", "IOPS", "MiB/s", "p50 µs", "p99 µs", "×(a)", "×(a')", "CPU µs/IO", "CPU ×(a)", "ctx/IO",
              "ctx ×(a)"]
    out = [header]
    for job in jobs:
        for r in rows:
            if r[0] != job:
                continue
            a, a2 = iops.get((job, "a")), iops.get((job, "a2"))
            cpu_a, ctx_a = cpu.get((job, "a")), ctx.get((job, "a"))
            out.append([job, TARGET_LABELS.get(r[1], r[1]), f"{r[2]:.0f}", f"{r[3]:.1f}", f"{r[4]:.0f}",
                        f"{r[5]:.0f}", ratio(r[2], a), ratio(r[2], a2),
                        "-" if r[6] is None else f"{r[6]:.1f}",
                        ratio(r[6], cpu_a) if r[6] is not None and cpu_a else "-",
                        "-" if r[7] is None else f"{r[7]:.2f}",
                        ratio(r[7], ctx_a) if r[7] is not None and ctx_a else "-"])
    widths = [max(len(x[i]) for x in out) for i in range(len(header))]
    left = {0, 1}

    def fmt(cells):
        return "| " + " | ".join(c.ljust(w) if i in left else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    print(fmt(out[0]))
    print("|" + "|".join("-" * (w + 1) + (":" if i not in left else "-") for i, w in enumerate(widths)) + "|")
    for cells in out[1:]:
        print(fmt(cells))

    print()
    print("Targets of issue 16 (benchmarked, not asserted):")

    def check(desc, pairs, want, higher=True):
        got = [(job, x / base) for job, x, base in pairs if x is not None and base]
        if not got:
            print(f"  {desc}: not measured")
            return
        worst_job, worst = (min if higher else max)(got, key=lambda g: g[1])
        ok = "met" if (worst >= want if higher else worst <= want) else "MISSED"
        detail = ", ".join(f"{job} {r:.2f}" for job, r in got)
        print(f"  {desc}: {ok} (worst {worst:.2f} on {worst_job}; {detail})")

    def vs_a(target, js):
        return [(j, iops.get((j, target)), iops.get((j, "a"))) for j in js]

    reads = [j for j in jobs if "read" in j]
    check("(b) >= 0.8x nbdkit, every job", vs_a("b", jobs), 0.8)
    check("(c) reads >= 0.8x nbdkit", vs_a("c", reads), 0.8)
    check("(c) randwrite 4k qd32 >= 0.5x nbdkit", vs_a("c", [j for j in jobs if j == "randwrite-4k-qd32"]), 0.5)
    check("(c) randwrite 4k qd32 + flush every 32 >= 0.5x nbdkit",
          vs_a("c", [j for j in jobs if j == "randwrite-4k-qd32-fsync32"]), 0.5)
    check("(c) randwrite 4k qd1 >= 0.4x nbdkit", vs_a("c", [j for j in jobs if j == "randwrite-4k-qd1"]), 0.4)
    check("(c) seqwrite 1M >= 0.3x nbdkit", vs_a("c", [j for j in jobs if j.startswith("seqwrite")]), 0.3)
    check("(b) CPU per IO <= 1.5x nbdkit's, every job",
          [(j, cpu.get((j, "b")), cpu.get((j, "a"))) for j in jobs], 1.5, higher=False)
    check("(d) >= 0.9x (c), every job", [(j, iops.get((j, "d")), iops.get((j, "c"))) for j in jobs], 0.9)
    if any(t == "d0" for _, t in iops):
        check("(d) >= 0.9x (c), before (d0 against c0)",
              [(j, iops.get((j, "d0")), iops.get((j, "c0"))) for j in jobs], 0.9)

    print()
    print("Targets of issue 40, mutual TLS against plaintext TCP (benchmarked, not asserted):")
    qd32 = [j for j in jobs if "-qd32" in j]
    for tls, plain in (("btls", "bt"), ("ctls", "ct")):
        check(f"{TARGET_LABELS[tls]} qd32 >= 0.8x {TARGET_LABELS[plain]} (in-flight encryption)",
              [(j, iops.get((j, tls)), iops.get((j, plain))) for j in qd32], 0.8)

    print()
    print("Targets of issue 20, v2 against v1 (benchmarked, not asserted):")
    random4k = [j for j in jobs if j.startswith("rand") and "-4k-" in j]
    for v2, v1 in V2_PEERS:
        check(f"{TARGET_LABELS[v2]} 4 KiB random IOPS >= {TARGET_LABELS[v1]}",
              [(j, iops.get((j, v2)), iops.get((j, v1))) for j in random4k], 1.0)
    for v2 in dict.fromkeys(v2 for v2, _ in V2_PEERS):
        got = [f"{j} {x / base:.2f}" for j, x, base in vs_a(v2, jobs) if x is not None and base]
        if got:
            print(f"  {TARGET_LABELS[v2]} x nbdkit (a): {', '.join(got)}")


if __name__ == "__main__":
    if len(sys.argv) in (5, 7, 8) and sys.argv[1] == "row":
        row(*sys.argv[2:])
    elif len(sys.argv) >= 3 and sys.argv[1] == "scrape":
        scrape(*sys.argv[2:])
    elif len(sys.argv) == 8 and sys.argv[1] == "countrow":
        countrow(*sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "counts":
        counts(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "table":
        table(sys.argv[2])
    else:
        sys.exit(__doc__)
