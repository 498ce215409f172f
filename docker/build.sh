#!/usr/bin/env bash
# Builds one container image per Corral daemon: docker/<image>/Dockerfile becomes <image>:<cargo version> (and
# <image>:latest). A daemon slots in by adding its directory here once its binary exists in the workspace.
#
#   docker/build.sh [IMAGE...]        default: every docker/*/Dockerfile
#
# Steps: release binaries built on the host (`cargo build --release --bin IMAGE...`, the shared target dir, so a build that
# already happened costs nothing), copied with debug info stripped (symbols kept: panics still name functions) into
# one small build context per image; the base image made locally when no BASE is given and corral-base:bookworm is
# missing (no registry is reachable on the project's machines); then `docker build` per image.
#
# Environment:
#   BASE=IMAGE              Debian-like image for the rootfs-assembly stage (e.g. debian:bookworm-slim from a
#                           registry). Default: corral-base:bookworm, made here with mmdebstrap when missing.
#   CORRAL_PROFILE=PROFILE  which build's binaries: release (default) or debug. A debug build (what the test suite
#                           builds anyway, so its container test compiles nothing more) is tagged
#                           <image>:<version>-debug only, never :latest, and its sizes are printed, not held to the
#                           targets; a release build fails when an image is over its target.
#   CORRAL_SKIP_CARGO=1     use the binaries already in the target dir (fail if one is missing).
#   CORRAL_TAG_SUFFIX=S     append -S to every tag (host-program images too) and never tag :latest: a build of
#                           one's own on a shared docker daemon that nobody else's build can replace (the docker
#                           tests take it from the environment too).
#   CARGO_TARGET_DIR        where the binaries are (default: <repo>/target).
#   CORRAL_CACHE_DIR        where the base rootfs tarball is cached (default: ~/.cache/corral).
#   CORRAL_IMAGE_MAX_MIB    size above which an image is reported as over target (default 60).
set -euo pipefail

docker_dir=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$docker_dir/.." && pwd)
target_dir=${CARGO_TARGET_DIR:-$repo/target}
cache_dir=${CORRAL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/corral}
max_mib=${CORRAL_IMAGE_MAX_MIB:-60}
local_base=corral-base:bookworm
profile=${CORRAL_PROFILE:-release}
case $profile in
  release) cargo_profile=(--release) tag_suffix= ;;
  debug) cargo_profile=() tag_suffix=-debug ;;
  *)
    echo "build.sh: CORRAL_PROFILE must be release or debug, not $profile" >&2
    exit 2
    ;;
esac
bin_dir=$target_dir/$profile
own_suffix=${CORRAL_TAG_SUFFIX:+-$CORRAL_TAG_SUFFIX}
case ${CORRAL_TAG_SUFFIX:-} in
  *[!A-Za-z0-9_.-]*)
    echo "build.sh: CORRAL_TAG_SUFFIX may hold letters, digits, '.', '_', '-' only, not $CORRAL_TAG_SUFFIX" >&2
    exit 2
    ;;
esac

log() { printf '==> %s\n' "$*" >&2; }

# --- which images --------------------------------------------------------------------------------------------------
if [ $# -gt 0 ]; then
  images=("$@")
else
  images=()
  for f in "$docker_dir"/*/Dockerfile; do
    images+=("$(basename "$(dirname "$f")")")
  done
fi
for image in "${images[@]}"; do
  [ -f "$docker_dir/$image/Dockerfile" ] || {
    echo "build.sh: no docker/$image/Dockerfile" >&2
    exit 2
  }
done

# --- version, revision ---------------------------------------------------------------------------------------------
metadata=$(cd "$repo" && cargo metadata --no-deps --format-version 1)
# image name == binary name; the version is that of the package that owns the binary. An image of a program from
# the host (docker/<image>/host-binaries, e.g. etcd for the compose cluster) carries that program's version: the
# first X.Y.Z its first binary's `--version` prints.
version_of() {
  if [ -f "$docker_dir/$1/host-binaries" ]; then
    "$(host_binaries_of "$1" | head -1)" --version | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -1
    return
  fi
  python3 -c '
import json, sys
meta = json.load(sys.stdin)
for p in meta["packages"]:
    for t in p["targets"]:
        if "bin" in t["kind"] and t["name"] == sys.argv[1]:
            print(p["version"]); sys.exit(0)
sys.exit(1)' "$1" <<<"$metadata"
}
# The repository URL: [workspace.package] repository in the root Cargo.toml.
source_url=$(python3 -c '
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print(tomllib.load(f).get("workspace", {}).get("package", {}).get("repository", ""))' "$repo/Cargo.toml")
revision=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$revision" != unknown ] && ! git -C "$repo" diff --quiet HEAD 2>/dev/null; then
  revision="$revision-dirty"
fi
created=$(date -u +%Y-%m-%dT%H:%M:%SZ)

# --- binaries ------------------------------------------------------------------------------------------------------
# An image holds the binary it is named after, plus those listed in docker/<image>/binaries (one per line, # for
# comments): the manager's image carries the engine and replica it starts.
binaries_of() {
  [ -f "$docker_dir/$1/host-binaries" ] && return
  echo "$1"
  if [ -f "$docker_dir/$1/binaries" ]; then
    sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$docker_dir/$1/binaries"
  fi
}
# An image of a program that is not Corral's (etcd, for the compose cluster: no registry to pull it from) lists the
# host's files to copy in docker/<image>/host-binaries (absolute paths, the first one answers --version).
host_binaries_of() {
  sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$docker_dir/$1/host-binaries"
}
for image in "${images[@]}"; do
  [ -f "$docker_dir/$image/host-binaries" ] || continue
  while read -r path; do
    [ -x "$path" ] || {
      echo "build.sh: $image needs $path from this host (docker/$image/host-binaries), which is missing" >&2
      exit 1
    }
  done < <(host_binaries_of "$image")
done
all_bins=()
for image in "${images[@]}"; do
  mapfile -t -O "${#all_bins[@]}" all_bins < <(binaries_of "$image")
done
[ ${#all_bins[@]} -eq 0 ] || mapfile -t all_bins < <(printf '%s\n' "${all_bins[@]}" | sort -u)
if [ "${CORRAL_SKIP_CARGO:-0}" != 1 ] && [ ${#all_bins[@]} -gt 0 ]; then
  bin_flags=()
  for bin in "${all_bins[@]}"; do bin_flags+=(--bin "$bin"); done
  log "cargo build ${cargo_profile[*]} ${bin_flags[*]} (target dir $target_dir)"
  (cd "$repo" && CARGO_TARGET_DIR="$target_dir" cargo build "${cargo_profile[@]}" --locked "${bin_flags[@]}")
fi
for bin in ${all_bins[@]+"${all_bins[@]}"}; do
  [ -x "$bin_dir/$bin" ] || {
    echo "build.sh: $bin_dir/$bin is missing (is $bin a binary of the workspace? built with cargo build --bins?)" >&2
    exit 1
  }
done

# --- base ----------------------------------------------------------------------------------------------------------
# The base is only the toolbox of the rootfs-assembly stage (ldd, cp, the libraries to copy): it is not in the
# runtime images, so its size does not matter. mmdebstrap downloads from the Debian mirror apt is configured with.
make_local_base() {
  local tar=$cache_dir/base-bookworm.tar lock
  mkdir -p "$cache_dir"
  # Builds running at once (the test suite runs two container tests side by side) make the base one at a time:
  # the second waits here, then finds mmdebstrap installed and the tarball made (two apt-get runs at once fail on
  # dpkg's lock, two mmdebstraps would write the same .partial).
  exec {lock}>"$cache_dir/base-bookworm.lock"
  flock "$lock"
  # A regular, non-empty file: anything else (an interrupted run, a directory) is made again.
  if [ ! -f "$tar" ] || [ ! -s "$tar" ]; then
    rm -rf "$tar" "$tar.partial"
    if ! command -v mmdebstrap >/dev/null; then
      log "installing mmdebstrap"
      if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null
      else
        echo "build.sh: mmdebstrap is missing and this is not root: install it, or set BASE" >&2
        exit 1
      fi
    fi
    mkdir -p "$cache_dir"
    log "mmdebstrap bookworm -> $tar (a few minutes, once)"
    # --format: the output name ends in .partial, from which mmdebstrap would guess a directory.
    mmdebstrap --quiet --format=tar --variant=minbase --include=ca-certificates bookworm "$tar.partial"
    mv "$tar.partial" "$tar"
  fi
  log "docker import $tar $local_base"
  docker import --message "mmdebstrap --variant=minbase --include=ca-certificates bookworm" "$tar" "$local_base" >/dev/null
  exec {lock}>&-
}
if [ -z "${BASE:-}" ]; then
  BASE=$local_base
  docker image inspect "$BASE" >/dev/null 2>&1 || make_local_base
fi

# --- images --------------------------------------------------------------------------------------------------------
context_root=$target_dir/docker-context
built=()
for image in "${images[@]}"; do
  version=$(version_of "$image") || {
    echo "build.sh: no package in the workspace has a binary named $image" >&2
    exit 1
  }
  ctx=$context_root/$image
  rm -rf "$ctx" "$ctx.log"
  mkdir -p "$ctx"
  while read -r bin; do
    objcopy --strip-debug "$bin_dir/$bin" "$ctx/$bin"
  done < <(binaries_of "$image")
  if [ -f "$docker_dir/$image/host-binaries" ]; then
    while read -r path; do cp -L "$path" "$ctx/"; done < <(host_binaries_of "$image")
  fi
  cp "$docker_dir/lib/runtime-rootfs.sh" "$docker_dir/lib/corral-healthz" "$ctx/"
  # A host program's image is the same whichever profile Corral's binaries come from: no -debug suffix.
  suffix=$tag_suffix
  [ -f "$docker_dir/$image/host-binaries" ] && suffix=
  suffix=$suffix$own_suffix
  tags=(--tag "$image:$version$suffix")
  [ -z "$suffix" ] && tags+=(--tag "$image:latest")
  # A host program's image of one's own build: also `latest-S`, which a compose file's default tag can name.
  [ -f "$docker_dir/$image/host-binaries" ] && [ -n "$own_suffix" ] && tags+=(--tag "$image:latest$own_suffix")
  log "docker build $image:$version$suffix (base $BASE)"
  build_log=$ctx.log
  if ! docker build \
    --file "$docker_dir/$image/Dockerfile" \
    --build-arg "BASE=$BASE" \
    --build-arg "VERSION=$version" \
    --build-arg "REVISION=$revision" \
    --build-arg "CREATED=$created" \
    --build-arg "SOURCE=$source_url" \
    "${tags[@]}" \
    "$ctx" >"$build_log" 2>&1; then
    cat "$build_log" >&2
    echo "build.sh: docker build of $image failed" >&2
    exit 1
  fi
  built+=("$image:$version$suffix")
done

# --- sizes ---------------------------------------------------------------------------------------------------------
over=0
printf '%-28s %10s\n' image MiB
for ref in "${built[@]}"; do
  bytes=$(docker image inspect --format '{{.Size}}' "$ref")
  mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
  # An image that carries several binaries states its own target in docker/<image>/max-mib.
  limit=$max_mib
  if [ -f "$docker_dir/${ref%%:*}/max-mib" ]; then limit=$(tr -d '[:space:]' <"$docker_dir/${ref%%:*}/max-mib"); fi
  note=
  if [ "$profile" != release ]; then
    note="  ($profile build: the ${limit} MiB target applies to release builds)"
  elif awk -v b="$bytes" -v m="$limit" 'BEGIN { exit !(b > m * 1048576) }'; then
    note="  over the ${limit} MiB target"
    over=1
  fi
  printf '%-28s %10s%s\n' "$ref" "$mib" "$note"
done
if [ "$over" != 0 ]; then
  echo "build.sh: an image is over its size target (docker/README.md: sizes)" >&2
  exit 1
fi
