#!/bin/bash
# runtime-rootfs.sh ROOTFS FILE...: assemble the root filesystem of a runtime image inside a Dockerfile's build
# stage. ROOTFS receives each FILE (installed in /usr/local/bin), every shared library the dynamic linker needs for
# it (found with ldd, so the list follows the binary as dependencies change), bash with its libraries (the
# HEALTHCHECK's HTTP probe is a bash script: /dev/tcp, no curl), the CA bundle when the base has one, and the few
# files of /etc a process expects: passwd/group with the unprivileged `corral` user (uid/gid 10001), nsswitch.conf.
# Nothing else: no package manager, no coreutils, no perl. Works on any Debian-like base (the local mmdebstrap one
# or debian:bookworm-slim from a registry).
set -euo pipefail

root=$1
shift
mkdir -p "$root"

# Merged /usr: keep the base's top-level symlinks (/bin -> usr/bin, /lib64 -> usr/lib64 ...) so that the paths ldd
# prints and the ELF interpreter path (/lib64/ld-linux-x86-64.so.2) resolve the same way in the image.
for d in bin sbin lib lib64; do
  if [ -L "/$d" ]; then
    mkdir -p "$root/$(readlink "/$d")"
    ln -sfn "$(readlink "/$d")" "$root/$d"
  fi
done

copy() { # copy PATH into the rootfs at the same path, following symlinks to the real file
  mkdir -p "$root$(dirname "$1")"
  cp -L "$1" "$root$1"
}

libs_of() { # copy every library ldd resolves for the ELF file PATH (PATH may be outside the rootfs)
  if ldd "$1" | grep -q 'not found'; then
    echo "runtime-rootfs: $1 needs a library the base does not have:" >&2
    ldd "$1" >&2
    exit 1
  fi
  local lib
  # "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)", "/lib64/ld-linux-x86-64.so.2 (0x...)", "linux-vdso.so.1"
  for lib in $(ldd "$1" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'); do
    [ -e "$root$lib" ] || copy "$lib"
  done
}

mkdir -p "$root/usr/local/bin"
for f in "$@"; do
  install -m 0755 "$f" "$root/usr/local/bin/"
  # ELF binaries bring their libraries; scripts (corral-healthz) need only bash, copied below.
  if [ "$(head -c 4 "$f")" = $'\x7fELF' ]; then
    libs_of "$f"
  fi
done
# bash, for the health probe.
bash_path=$(command -v bash)
copy "$bash_path"
libs_of "$bash_path"
[ -e "$root/bin/bash" ] || { mkdir -p "$root/bin" && ln -s "$bash_path" "$root/bin/bash"; }

if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  copy /etc/ssl/certs/ca-certificates.crt
fi

mkdir -p "$root/etc" "$root/tmp" "$root/run"
chmod 1777 "$root/tmp"
cat >"$root/etc/passwd" <<'PASSWD'
root:x:0:0:root:/root:/usr/sbin/nologin
corral:x:10001:10001:corral:/nonexistent:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
PASSWD
cat >"$root/etc/group" <<'GROUP'
root:x:0:
corral:x:10001:
nogroup:x:65534:
GROUP
# glibc >= 2.34 has the files and dns NSS modules built in: no libnss_* to copy for name resolution (compose service
# names, Kubernetes service names).
printf 'passwd: files\ngroup: files\nhosts: files dns\n' >"$root/etc/nsswitch.conf"
