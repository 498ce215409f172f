#!/usr/bin/env bash
# Manager figures on one node (embedded store): time to create + attach N volumes (until every one is attached and
# healthy), and the manager's RSS with 200 volumes in the store (idle, detached) next to its RSS with none.
#   CORRAL_PROFILE (release | debug)  BENCH_NO_BUILD (set: use the binaries as built)  BENCH_VOLUMES (20)  BENCH_REPLICAS (3)  BENCH_STORED (200)
set -euo pipefail
cd "$(dirname "$0")/../.."
profile=${CORRAL_PROFILE:-release}
if [ -n "${BENCH_NO_BUILD:-}" ]; then
  :
elif [ "$profile" = release ]; then
  cargo build --release -q -p manager -p replica -p engine --bins
else
  cargo build -q -p manager -p replica -p engine --bins --features replica/fault-injection
fi
exec python3 - "$PWD/target/$profile" "${BENCH_VOLUMES:-20}" "${BENCH_REPLICAS:-3}" "${BENCH_STORED:-200}" <<'PY'
import json, os, shutil, signal, socket, subprocess, sys, tempfile, time, urllib.request

bindir, nvol, nrep, nstored = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
data = tempfile.mkdtemp(prefix="corral-bench-")
log = open(os.path.join(data, "manager.log"), "w")
ready = os.path.join(data, "bench-manager.ready")
# Port 0: the manager reports the port it bound in its ready file (docs/formats.md).
mgr = subprocess.Popen([f"{bindir}/corral-manager", "--data-dir", data, "--listen", "127.0.0.1:0",
                        "--ready-file", ready, "--node-id", "bench", "--port-range", "21000-29000"],
                       stdout=log, stderr=log)
end = time.time() + 30
while not os.path.exists(ready):
    if mgr.poll() is not None or time.time() > end:
        raise SystemExit(f"corral-manager did not start (log {data}/manager.log)")
    time.sleep(0.05)
url = "http://" + json.load(open(ready))["listen"]["http"]

def call(method, path, body=None):
    req = urllib.request.Request(url + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        b = r.read()
        return json.loads(b) if b else None

def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

def wait(pred, what, timeout):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.2)
    raise SystemExit(f"timed out: {what} (log {data}/manager.log)")

def daemons():
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if data.encode() in open(f"/proc/{p}/cmdline", "rb").read() and int(p) != mgr.pid:
                    out.append(int(p))
            except OSError:
                pass
    return out

try:
    wait(lambda: subprocess.run(["curl", "-sf", url + "/healthz"], capture_output=True).returncode == 0, "manager up", 30)
    time.sleep(1)
    rss_empty = rss_kib(mgr.pid)
    t0 = time.time()
    for i in range(nvol):
        call("POST", "/v1/volumes", {"name": f"b{i}", "size": 16 << 20, "numberOfReplicas": nrep})
        call("POST", f"/v1/volumes/b{i}/attach", {})
    t_requests = time.time() - t0
    def all_healthy():
        vs = call("GET", "/v1/volumes")
        return sum(v["state"] == "attached" and v["robustness"] == "healthy" for v in vs) == nvol
    wait(all_healthy, "every volume attached", 600)
    t_attached = time.time() - t0
    rss_attached = rss_kib(mgr.pid)
    for i in range(nvol):
        call("POST", f"/v1/volumes/b{i}/detach")
    wait(lambda: all(v["state"] == "detached" for v in call("GET", "/v1/volumes")), "every volume detached", 300)
    for i in range(nvol):
        call("DELETE", f"/v1/volumes/b{i}")
    wait(lambda: not call("GET", "/v1/replicas"), "replicas removed", 120)
    t1 = time.time()
    for i in range(nstored):
        call("POST", "/v1/volumes", {"name": f"s{i}", "size": 1 << 30, "numberOfReplicas": 3})
    t_stored = time.time() - t1
    time.sleep(8)  # a few resync rounds over the stored volumes
    rss_stored = rss_kib(mgr.pid)
    t2 = time.time(); call("GET", "/v1/volumes"); t_list = time.time() - t2
    rows = [
        (f"create + attach {nvol} volumes ({nrep} replicas, 16 MiB): requests", f"{t_requests:.2f} s"),
        (f"create + attach {nvol} volumes: until all attached and healthy", f"{t_attached:.2f} s ({t_attached / nvol:.2f} s/volume)"),
        (f"create {nstored} volumes (detached)", f"{t_stored:.2f} s ({1000 * t_stored / nstored:.1f} ms/volume)"),
        (f"GET /v1/volumes with {nstored} volumes", f"{1000 * t_list:.0f} ms"),
        ("manager RSS, empty store", f"{rss_empty / 1024:.1f} MiB"),
        (f"manager RSS, {nvol} attached volumes", f"{rss_attached / 1024:.1f} MiB"),
        (f"manager RSS, {nstored} volumes in the store", f"{rss_stored / 1024:.1f} MiB ({(rss_stored - rss_empty) / nstored:.1f} KiB/volume over empty)"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{'figure'.ljust(w)}  value")
    for k, v in rows:
        print(f"{k.ljust(w)}  {v}")
finally:
    mgr.send_signal(signal.SIGKILL); mgr.wait()
    for p in daemons():
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(data, ignore_errors=True)
PY
