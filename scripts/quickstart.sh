#!/usr/bin/env bash
# Corral's main job on one machine: a single-node manager on the embedded store with a local data directory, a
# volume with 3 replicas, attached and served over NBD, written and read back; then it keeps running until Ctrl-C
# (the volume is detached — engine and replicas stop cleanly — and the manager stops). Restarting reuses the data.
#   CORRAL_DATA (./corral-data)  CORRAL_SIZE (10G)  CORRAL_REPLICAS (3)  CORRAL_VOLUME (vol1)
#   CORRAL_PORT (9500)  CORRAL_PROFILE (release; `debug` reuses a debug build)
set -euo pipefail
cd "$(dirname "$0")/.."
data=${CORRAL_DATA:-./corral-data}
size=${CORRAL_SIZE:-10G}
n=${CORRAL_REPLICAS:-3}
volume=${CORRAL_VOLUME:-vol1}
port=${CORRAL_PORT:-9500}
profile=${CORRAL_PROFILE:-release}

if [ "$profile" = release ]; then
  cargo build --release -q -p manager -p replica -p engine --bins
else
  cargo build -q -p manager -p replica -p engine --bins --features replica/fault-injection
fi
bin=target/$profile
mkdir -p "$data/logs"
data=$(cd "$data" && pwd)
export CORRAL_URL=http://127.0.0.1:$port
corral() { "$bin/corral" "$@"; }

# The manager runs in its own session so Ctrl-C reaches only this script, which detaches and stops it in order.
setsid "$bin/corral-manager" --data-dir "$data" --listen "127.0.0.1:$port" --node-id node-1 \
  >>"$data/logs/manager.log" 2>&1 &
manager=$!
stop() {
  trap "" INT TERM
  trap - EXIT
  echo "stopping: detaching $volume (engine, then replicas), then the manager..."
  corral volume detach "$volume" >/dev/null 2>&1 || true
  kill -TERM "$manager" 2>/dev/null || true
  wait "$manager" 2>/dev/null || true
}
trap stop INT TERM EXIT
for _ in $(seq 300); do
  if corral node ls >/dev/null 2>&1; then break; fi
  if ! kill -0 "$manager" 2>/dev/null; then
    echo "the manager exited; see $data/logs/manager.log" >&2
    exit 1
  fi
  sleep 0.1
done

corral node ls
corral volume get "$volume" >/dev/null 2>&1 || corral volume create "$volume" --size "$size" --replicas "$n"
corral volume attach "$volume" >/dev/null
corral volume get "$volume"
uri=$(corral volume get "$volume" --json | python3 -c 'import json,sys; print([e for e in json.load(sys.stdin)["endpoints"] if e.startswith("nbd+unix")][0])')
tcp=$(corral volume get "$volume" --json | python3 -c 'import json,sys; print([e for e in json.load(sys.stdin)["endpoints"] if e.startswith("nbd://")][0])')

echo "writing and reading 1 MiB through NBD..."
qemu-io -f raw "$uri" -c 'write -P 0xab 0 1M' -c 'flush' -c 'read -P 0xab 0 1M'

cat <<TXT

Volume $volume ($n replicas) is served over NBD:
  $uri
  $tcp
Next:  export CORRAL_URL=$CORRAL_URL
       $bin/corral volume ls            $bin/corral snapshot create $volume first
       $bin/corral volume get $volume --json   $bin/corral setting ls
       qemu-img convert -O raw $tcp copy.raw
API:   $CORRAL_URL/v1/openapi.json   Metrics: $CORRAL_URL/metrics   Logs: $data/logs/
Ctrl-C detaches the volume and stops everything.
TXT
wait "$manager"
