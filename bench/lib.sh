# Sourced by bench/*/run.sh: starting daemons and peer servers on port 0 and learning the ports they bound, so no
# benchmark probes a port and hopes it is still free when the daemon binds it.
#
#   ready_wait FILE PID [SECONDS]   waits (default 30 s) until the daemon PID has written its --ready-file FILE
#                                   (JSON {pid, listen:{name:addr}}, docs/formats.md); fails when PID exits first
#   ready_addr FILE NAME            prints the HOST:PORT (or unix:PATH) the daemon reports for listener NAME
#   http_serve DIR                  python3 -m http.server for DIR on 127.0.0.1 port 0; sets HTTP_PID, HTTP_PORT

ready_wait() {
  local file=$1 pid=$2 secs=${3:-30} i
  for ((i = 0; i < secs * 50; i++)); do
    [[ -s "$file" ]] && return 0
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "daemon $pid exited before it was ready (no $file)" >&2
      return 1
    fi
    sleep 0.02
  done
  echo "daemon $pid not ready after ${secs}s (no $file)" >&2
  return 1
}

ready_addr() {
  python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["listen"][sys.argv[2]])' "$1" "$2"
}

http_serve() {
  local dir=$1 log i
  log=$(mktemp)
  # Unbuffered: its first line names the port it bound ("Serving HTTP on 127.0.0.1 port N ...").
  python3 -u -m http.server 0 --bind 127.0.0.1 --directory "$dir" >"$log" 2>&1 &
  HTTP_PID=$!
  HTTP_PORT=
  for ((i = 0; i < 500; i++)); do
    HTTP_PORT=$(sed -n 's/^Serving HTTP on [^ ]* port \([0-9]*\).*/\1/p' "$log")
    [[ -n "$HTTP_PORT" ]] && break
    sleep 0.02
  done
  rm -f "$log"
  [[ -n "$HTTP_PORT" ]] || {
    echo "python3 -m http.server did not start" >&2
    return 1
  }
}
