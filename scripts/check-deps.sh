#!/usr/bin/env bash
# The bottom of the crate graph stays a bottom: the format and store libraries depend on `corral-disk` for the
# sparse-file primitives and disk rules, never on a transport (`sparse-sync`, which brings axum and reqwest) or the
# daemon conventions (`corral-daemon`). `cargo tree` over normal dependencies; run from scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

status=0
# forbid PACKAGE FLAGS... -- FORBIDDEN...: fails when PACKAGE's normal dependency tree holds any of FORBIDDEN.
forbid() {
  local pkg=$1
  shift
  local flags=()
  while [ "$1" != "--" ]; do
    flags+=("$1")
    shift
  done
  shift
  local tree
  tree=$(cargo tree -p "$pkg" "${flags[@]}" -e normal --prefix none --format '{p}')
  for bad in "$@"; do
    if grep -qE "^$bad v" <<<"$tree"; then
      echo "check-deps: $pkg ${flags[*]} depends on $bad (see: cargo tree -p $pkg ${flags[*]} -e normal -i $bad)" >&2
      status=1
    fi
  done
}

forbid disk-image -- sparse-sync corral-daemon axum reqwest
forbid backupstore -- sparse-sync corral-daemon axum
forbid lvstore --no-default-features -- sparse-sync corral-daemon axum reqwest clap
forbid corral-disk -- sparse-sync corral-daemon tokio
# The CSI plugin talks to the manager over REST through corral-api: it links neither the manager nor its store (redb,
# or the etcd v3 client, which is corral-proto's `etcd` module; there is no etcd-client crate).
forbid corral-csi -- manager redb corral-proto
# The REST views and client: serde and reqwest, no server side.
forbid corral-api -- manager redb corral-proto axum tonic

if [ $status -eq 0 ]; then
  echo "check-deps: the bottom crates depend on no transport or daemon crate; corral-csi links no manager"
fi
exit $status
