#!/bin/sh
# Makes the seed corpus for the qcow2_read target with qemu-img/qemu-io (small images: 512-byte clusters).
set -eu
dir=${1:-corpus/qcow2_read}
mkdir -p "$dir" && cd "$dir"
qemu-img create -q -f qcow2 -o cluster_size=512 plain.qcow2 256k
qemu-io -f qcow2 -c 'write -P 0x61 0 4k' -c 'write -P 0x62 100k 1k' -c 'write -z 200k 4k' plain.qcow2 >/dev/null
qemu-img convert -c -O qcow2 -o cluster_size=512 plain.qcow2 compressed.qcow2
qemu-img create -q -f qcow2 -o cluster_size=512,compat=0.10 v2.qcow2 64k
qemu-io -f qcow2 -c 'write -P 1 0 1k' v2.qcow2 >/dev/null
qemu-img create -q -f qcow2 -o cluster_size=512 -u -b image.qcow2 -F qcow2 selfref.qcow2 64k
