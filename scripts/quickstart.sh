#!/usr/bin/env bash
# Corral's main job on one machine: a single-node manager on the embedded store with a local data directory, a
# volume with 3 replicas, attached and served over NBD, written and read back (through the node's unix socket); then
# it keeps running until Ctrl-C (every attached volume is detached — engines and replicas stop cleanly — then the
# manager and every daemon it started stop: `corral down`). Restarting reuses the data. Mutual TLS between the
# daemons is on; the node's certificates are in $CORRAL_DATA/tls.
#
#   scripts/quickstart.sh [--once]
#
#   --once (or CORRAL_ONCE=1)  stop cleanly after the NBD round trip (as Ctrl-C does, then exit 0): CI runs this
#   CORRAL_DATA (./corral-data)  CORRAL_SIZE (10G)  CORRAL_REPLICAS (3)  CORRAL_VOLUME (vol1)
#   CORRAL_PORT (9500; 0 = a free port, printed)  CORRAL_PROFILE (release; `debug` reuses the test suite's debug build)
#
# Needs a Rust toolchain, qemu-io (Debian qemu-utils) and python3; installs the last two when run as root and says
# what to install otherwise. No protoc: every .proto is compiled by protox.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/install-deps.sh
. scripts/install-deps.sh

once=${CORRAL_ONCE:-0}
for arg in "$@"; do
  case $arg in
    --once) once=1 ;;
    -h | --help)
      sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "quickstart.sh: unknown argument $arg (try --help)" >&2
      exit 2
      ;;
  esac
done
data=${CORRAL_DATA:-./corral-data}
size=${CORRAL_SIZE:-10G}
n=${CORRAL_REPLICAS:-3}
volume=${CORRAL_VOLUME:-vol1}
port=${CORRAL_PORT:-9500}
profile=${CORRAL_PROFILE:-release}

command -v cargo >/dev/null 2>&1 || {
  echo "cargo is missing: install a Rust toolchain (https://rustup.rs), then run this again" >&2
  exit 1
}
need_tools qemu-io python3 setsid flock || exit 1

# cargo's own progress is shown (a bar on a terminal, one line per crate otherwise): a first build is long.
echo "Building Corral ($profile profile): corral-manager, corral-replica, corral-engine, the daemons they start, the"
echo "corral CLI and corral-tls. The first build takes about 10-15 minutes on 2 cores; later runs rebuild only what changed."
build_start=$SECONDS
if [ "$profile" = release ]; then
  cargo build --release --locked -p manager -p replica -p engine -p corral-tls --bins
else
  # The exact build scripts/test.sh makes, so after the suite this compiles nothing.
  cargo build --locked --workspace --bins --features replica/fault-injection
fi
echo "Built in $((SECONDS - build_start)) s."
bin=target/$profile
mkdir -p "$data/logs"
data=$(cd "$data" && pwd)
export CORRAL_URL=http://127.0.0.1:$port
# `corral` presents the admin token the manager writes to $data/admin.token on its first start (mode 0600).
export CORRAL_DATA_DIR=$data
corral() { "$bin/corral" "$@"; }
pidfile=$data/manager.pid

# --- already running? port taken? ----------------------------------------------------------------------------------
# A manager holds a lock on its store file for as long as it runs: that finds one however it was started.
if [ -f "$data/store.redb" ] && ! flock -n "$data/store.redb" true 2>/dev/null; then
  read -r old_pid old_port old_script 2>/dev/null <"$pidfile" || true
  echo "A Corral manager is already running on $data${old_pid:+ (pid $old_pid, http://127.0.0.1:$old_port)}." >&2
  if [ -n "${old_pid:-}" ]; then
    echo "  reach it:  export CORRAL_URL=http://127.0.0.1:$old_port CORRAL_DATA_DIR=$data; $bin/corral volume ls" >&2
    echo "  stop it:   Ctrl-C where quickstart.sh runs, or kill $old_script (it detaches every volume, then stops the manager and its daemons)" >&2
  fi
  echo "  or start a separate one: CORRAL_DATA=another-dir CORRAL_PORT=another-port $0" >&2
  exit 1
fi
if [ "$port" != 0 ] && ! python3 -c 'import socket, sys; socket.socket().bind(("127.0.0.1", int(sys.argv[1])))' "$port" 2>/dev/null; then
  if corral node ls >/dev/null 2>&1; then
    echo "Port $port already has a Corral manager (another data directory than $data):" >&2
    echo "  reach it:  export CORRAL_URL=$CORRAL_URL; $bin/corral volume ls" >&2
  else
    echo "Port $port (127.0.0.1) is taken by another program." >&2
  fi
  echo "  choose another port:  CORRAL_PORT=9600 $0" >&2
  exit 1
fi

# --- start ---------------------------------------------------------------------------------------------------------
# The manager runs in its own session so Ctrl-C reaches only this script, which detaches and stops it in order.
# CORRAL_PORT=0: the manager takes a free port and reports it in its ready file (what the test suite uses).
ready=$data/manager.ready
rm -f "$ready"
setsid "$bin/corral-manager" --data-dir "$data" --listen "127.0.0.1:$port" --node-id node-1 --ready-file "$ready" \
  >>"$data/logs/manager.log" 2>&1 &
manager=$!
# Manager pid, port, and this script's pid (a TERM to it stops everything in order).
echo "$manager $port $$" >"$pidfile"
# Stop everything in order (`corral down`: every volume attached on this node is detached through the API, the
# manager gets SIGTERM, then whatever daemon it leaves under $data does: v2 disk daemons, backing-image managers).
# Status 1 when that failed or the manager did not exit 0.
stop() {
  trap "" INT TERM
  trap - EXIT
  local status=0
  echo "stopping: detaching the attached volumes (engines, then replicas), then the manager and its daemons..."
  corral down --data-dir "$data" || {
    echo "corral down failed; see $data/logs/" >&2
    status=1
  }
  wait "$manager" 2>/dev/null || {
    echo "the manager did not exit cleanly; see $data/logs/manager.log" >&2
    status=1
  }
  rm -f "$pidfile"
  return $status
}
trap 'stop; exit 130' INT TERM
trap 'stop || true' EXIT
for _ in $(seq 300); do
  if [ -s "$ready" ]; then
    # {"pid":..,"listen":{"http":"127.0.0.1:PORT"}}, written once the manager listens.
    port=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["listen"]["http"].rsplit(":", 1)[1])' "$ready")
    export CORRAL_URL=http://127.0.0.1:$port
    echo "$manager $port $$" >"$pidfile"
    if corral node ls >/dev/null 2>&1; then break; fi
  fi
  if ! kill -0 "$manager" 2>/dev/null; then
    trap - EXIT
    rm -f "$pidfile"
    echo "the manager exited; see $data/logs/manager.log" >&2
    tail -5 "$data/logs/manager.log" >&2
    exit 1
  fi
  sleep 0.1
done

corral node ls
corral volume get "$volume" >/dev/null 2>&1 || corral volume create "$volume" --size "$size" --replicas "$n"
corral volume attach "$volume" >/dev/null
corral volume get "$volume"
endpoint() {
  corral volume get "$volume" --json |
    python3 -c 'import json,sys; print([e for e in json.load(sys.stdin)["endpoints"] if e.startswith(sys.argv[1])][0])' "$1"
}
uri=$(endpoint nbd+unix)
# Mutual TLS is on (the manager's default, --tls auto): the engine's TCP listener takes only clients presenting a
# certificate of the cluster CA, as the node's directory $data/tls holds (made by the manager on its first start).
tcp=$(endpoint nbds://)

echo "writing and reading 1 MiB through NBD..."
qemu-io -f raw "$uri" -c 'write -P 0xab 0 1M' -c 'flush' -c 'read -P 0xab 0 1M'

if [ "$once" = 1 ]; then
  trap - EXIT
  stop
  echo "done: the 1 MiB round trip verified, $volume detached, the manager stopped (data kept in $data)"
  exit 0
fi

# qemu and libnbd take the node's certificate as a directory of their own file names (links into $data/tls).
"$bin/corral-tls" nbd-client-dir --tls-dir "$data/tls" --out "$data/nbd-client" >/dev/null
hostport=${tcp#nbds://}
hostport=${hostport%%/*}
cat <<TXT

Volume $volume ($n replicas) is served over NBD (TCP: mutual TLS, certificates in $data/tls):
  $uri
  $tcp
Next:  export CORRAL_URL=$CORRAL_URL CORRAL_DATA_DIR=$data    # corral finds its API token in $data/admin.token
       $bin/corral volume ls            $bin/corral snapshot create $volume first
       $bin/corral volume get $volume --json   $bin/corral setting ls
       qemu-img convert --object tls-creds-x509,id=tls0,endpoint=client,dir=$data/nbd-client -O raw \\
         --image-opts driver=nbd,host=${hostport%:*},port=${hostport##*:},export=$volume,tls-creds=tls0 copy.raw
API:   $CORRAL_URL/v1/openapi.json (Authorization: Bearer \$(cat $data/admin.token))   Metrics: $CORRAL_URL/metrics   Logs: $data/logs/
Ctrl-C detaches every attached volume and stops the manager and every daemon it started.
TXT
wait "$manager"
