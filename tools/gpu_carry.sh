#!/usr/bin/env bash
# Carry meshrun's system packages and Python wheels to a machine with no package registry (design brief
# section 5: a GPU machine with Python and torch but no ip, tc, nft, iptables, wg, wireguard-go, ping).
#   tools/gpu_carry.sh fetch [DIR]    here, on Debian 12 (bookworm) with apt and pip: download into DIR
#   tools/gpu_carry.sh install [DIR]  there, as root: unpack the .debs into /usr without overwriting any
#                                     file the machine has, install the wheels, meshrun from this checkout
# DIR defaults to .gpucarry (ignore it through .git/info/exclude and carry it). About 30 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${2:-.gpucarry}
# Programs, then the libraries they load that a minimal image lacks (wireguard-go from bookworm-backports:
# batched I/O, see dev.sh).
DEBS=(iproute2 iptables nftables wireguard-tools iputils-ping procps
  libbpf1 libelf1 libmnl0 libcap2 libxtables12 libnftables1 libnftnl11 libjansson4 libip4tc2 libip6tc2
  libnetfilter-conntrack3 libnfnetlink0 libedit2 libbsd0 libmd0 libtirpc3 libgssapi-krb5-2 libkrb5-3
  libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libgmp10 libzstd1 zlib1g libproc2-0)
WHEELS=(cryptography cffi pycparser wgconfig)

fetch() {
  mkdir -p "$DIR/debs" "$DIR/wheels"
  apt-get update -qq
  (cd "$DIR/debs" && apt-get download "${DEBS[@]}" && apt-get download -t bookworm-backports wireguard-go)
  "${PYTHON:-python3}" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_34_x86_64 -d "$DIR/wheels" "${WHEELS[@]}"
  du -sh "$DIR"
}

install() {
  local scratch=/tmp/gpucarry-root py=${PYTHON:-python3}
  rm -rf "$scratch" && mkdir -p "$scratch"
  for f in "$DIR"/debs/*.deb; do dpkg-deb -x "$f" "$scratch"; done
  # /bin, /lib and /sbin may be links into /usr: copy every part under /usr, never over a file that exists.
  for d in bin sbin lib lib64; do
    [ -d "$scratch/$d" ] || continue
    mkdir -p "$scratch/usr/$d" && cp -an "$scratch/$d/." "$scratch/usr/$d/" && rm -rf "${scratch:?}/$d"
  done
  cp -an "$scratch/usr/." /usr/
  [ -d "$scratch/etc" ] && cp -an "$scratch/etc/." /etc/
  for t in iptables iptables-save iptables-restore ip6tables; do
    [ -e "/usr/sbin/$t" ] || ln -s xtables-nft-multi "/usr/sbin/$t"
  done
  ldconfig
  "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps "$DIR"/wheels/*.whl
  "$py" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . \
    || echo "gpu_carry: meshrun not installed (run with PYTHONPATH=$PWD)" >&2
  for c in ip tc nft iptables wg wireguard-go ping; do command -v "$c" >/dev/null || echo "gpu_carry: $c missing" >&2; done
}

case "${1:-}" in
  fetch) fetch ;;
  install) install ;;
  *) echo "usage: tools/gpu_carry.sh fetch|install [DIR]" >&2; exit 2 ;;
esac
