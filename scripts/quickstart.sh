#!/usr/bin/env bash
# Corral's main job on one machine with the embedded defaults: a volume with 3 replicas kept in a local directory,
# served over NBD, until Ctrl-C (then every daemon shuts down cleanly). Restarting reuses the same data.
#   CORRAL_DATA (./corral-data)  CORRAL_SIZE (10G)  CORRAL_REPLICAS (3)  CORRAL_VOLUME (vol1)
set -euo pipefail
cd "$(dirname "$0")/.."
data=${CORRAL_DATA:-./corral-data}
size=${CORRAL_SIZE:-10G}
n=${CORRAL_REPLICAS:-3}
volume=${CORRAL_VOLUME:-vol1}
engine_port=9501
nbd_port=10809

cargo build --release --bins -q
bin=target/release
mkdir -p "$data"
data=$(cd "$data" && pwd)
# Daemons run in their own sessions so Ctrl-C reaches only this script, which stops them in order.
pids=()
stop() {
  trap "" INT TERM
  trap - EXIT
  echo "stopping..."
  # Engine first (it flushes every replica on the way out), then the replicas.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM "${pids[$i]}" 2>/dev/null || true
    wait "${pids[$i]}" 2>/dev/null || true
  done
}
trap stop INT TERM EXIT

wait_port() { # port what
  for _ in $(seq 300); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "$2 did not come up on port $1 (logs in $data/*.log)" >&2
  exit 1
}

replicas=()
for i in $(seq 0 $((n - 1))); do
  port=$((9502 + 10 * i))
  setsid "$bin/corral-replica" serve --dir "$data/replica-$i" --listen "127.0.0.1:$port" --size "$size" \
    --volume "$volume" >"$data/replica-$i.log" 2>&1 &
  pids+=($!)
  replicas+=(--replica "tcp://127.0.0.1:$port")
  wait_port "$port" "replica $i"
done
setsid "$bin/corral-engine" serve --volume "$volume" --size "$size" --listen "127.0.0.1:$engine_port" "${replicas[@]}" \
  --nbd-listen "unix:$data/$volume.sock" --nbd-listen "tcp:127.0.0.1:$nbd_port" \
  --metrics-listen 127.0.0.1:9601 >"$data/engine.log" 2>&1 &
pids+=($!)
wait_port "$engine_port" "engine"
wait_port "$nbd_port" "NBD frontend"

"$bin/corral-engine" --url "127.0.0.1:$engine_port" info
"$bin/corral-engine" --url "127.0.0.1:$engine_port" replica ls
cat <<TXT

Volume $volume is served over NBD:
  nbd+unix:///$volume?socket=$data/$volume.sock
  nbd://127.0.0.1:$nbd_port/$volume
Try:   qemu-io -f raw nbd://127.0.0.1:$nbd_port/$volume -c 'write -P 0xab 0 1M' -c 'read -P 0xab 0 1M'
       $bin/corral-engine --url 127.0.0.1:$engine_port snapshot create first
Metrics: http://127.0.0.1:9601/metrics   Logs: $data/*.log   Ctrl-C stops everything.
TXT
wait "${pids[@]}"
