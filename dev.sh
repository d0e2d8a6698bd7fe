#!/usr/bin/env bash
# One entry point for a fresh Debian/Ubuntu machine. Run it as root (a sudo account is re-run
# through sudo; without root the namespace tests are skipped and the demo cannot run):
#   ./dev.sh demo      install what is needed, then run `meshrun demo`
#   ./dev.sh test      install what is needed (incl. test deps), then run the whole test suite
#   ./dev.sh install   only install
#   ./dev.sh gpu-check on a GPU machine: NCCL over meshrun in namespaces (world, site, cross-site groups) and
#                      its all-reduce bandwidth: raw site LAN vs meshrun0, NCCL socket settings (--help);
#                      with no .venv and a bundle in .offline/, installed from it (no registry needed)
#   ./dev.sh bundle [--python X.Y] [OUT]  the offline bundle, for machines with no package registry
#                      (tools/offline_bundle.sh; docs/install.md): into OUT [.offline/]
# Python deps go to ./.venv; torch is pinned first (an unpinned torch pulls GBs of CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")"
# git: `meshrun train` lists what a git work tree ships with it (meshrun.system.files.archive), and the archive
# tests build repositories with submodules.
# etcd-server: the replicated state of several coordinators (`meshrun coordinator add`); Debian starts its own
# etcd service on 127.0.0.1 when the package is installed: meshrun never uses it, and dev.sh stops it.
APT_PKGS=(iproute2 iptables nftables wireguard-tools wireguard-go iputils-ping iperf3 procps util-linux git etcd-server)
# The tests' VM (tests/vm.py): Debian's kernel (WireGuard and netem as modules) under QEMU, booted by
# virtme-ng (a test dependency in pyproject.toml); mke2fs -d (e2fsprogs) builds its Python image; a
# modular kernel needs an initramfs, which virtme-ng builds around a static busybox (busybox-static).
VM_APT_PKGS=(qemu-system-x86 linux-image-amd64 e2fsprogs busybox-static)
# Only the tests: the relay kernel test turns checksum offloads off on its veths (ethtool -K), so the receiving
# kernel checks every checksum the relay rewrote.
TEST_APT_PKGS=(ethtool)
PY=${PYTHON:-python3}
TORCH=${MESHRUN_TORCH:-torch==2.13.0}
# wireguard-go before this release has no batched I/O: 4-6x slower (README, Performance).
FAST_WG_GO=0.0.20230223

if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null && [ "${1:-}" != "" ]; then
  echo "dev.sh: not root: running again through sudo" >&2
  exec sudo --preserve-env=PYTHON,MESHRUN_TORCH,MESHRUN_TEST_WORKERS,CI "$0" "$@"
fi

apt_install() {  # apt_install [-t SUITE] PKG...
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# Debian 12 ships wireguard-go 0.0.20220316; bookworm-backports has 0.0.20231211 (what trixie and
# Ubuntu 24.04 ship). Other distributions: their own package (meshrun warns when it is old).
on_bookworm() { [ "$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")" = bookworm ]; }
backports_source() {  # on Debian 12: bookworm-backports among apt's sources (Debian's own archive)
  if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      > /etc/apt/sources.list.d/meshrun-bookworm-backports.sources
  fi
}
fast_wireguard_go() {
  local have
  have=$(dpkg-query -W -f='${Version}' wireguard-go 2>/dev/null || echo 0)
  dpkg --compare-versions "$have" ge "$FAST_WG_GO" && return
  on_bookworm || return 0
  backports_source
  echo "dev.sh: apt-get install -t bookworm-backports wireguard-go (batched I/O)" >&2
  apt-get update -qq
  apt_install -t bookworm-backports wireguard-go
}

# A machine with no .venv and an offline bundle in .offline/ (./dev.sh bundle, carried with the checkout): meshrun
# and the programs it lacks installed from the newest bundle into OFFLINE_PREFIX, like any offline install.
OFFLINE_PREFIX=/opt/meshrun
offline_bundle() { ls -t .offline/meshrun-offline-*.tar.gz 2>/dev/null | head -1 || true; }
install_offline() {
  local tmp installer rc=0
  tmp=$(mktemp -d)
  tar -xzf "$1" -C "$tmp"
  installer=("$tmp"/meshrun-offline-*/install.sh)
  "${installer[0]}" --prefix "$OFFLINE_PREFIX" --python "$PY" || rc=$?
  rm -rf "$tmp"
  return "$rc"
}

# The etcd-server package enables and starts etcd.service (client port 2379 on 127.0.0.1). meshrun runs its own
# members, on overlay addresses only; a second etcd nobody uses is one more listener: stopped and disabled.
quiet_distro_etcd() {
  if command -v systemctl >/dev/null && systemctl is-enabled etcd >/dev/null 2>&1; then
    echo "dev.sh: disabling the distribution's etcd.service (meshrun runs its own etcd members)" >&2
    systemctl disable --now etcd >/dev/null 2>&1 || true
  fi
}

# A package removed but for its config files ("rc") counts as missing: `dpkg -s` says yes to it.
missing_pkgs() {
  local p
  for p in "$@"; do
    [[ "$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null)" == ii* ]] || echo "$p"
  done
}

install_system() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "dev.sh: not root or no apt-get: skipping system packages (${APT_PKGS[*]})" >&2
    return
  fi
  local missing
  mapfile -t missing < <(missing_pkgs "${APT_PKGS[@]}")
  if ! "$PY" -m venv --help >/dev/null 2>&1; then missing+=(python3-venv python3-pip); fi
  if [ ${#missing[@]} -gt 0 ]; then
    echo "dev.sh: apt-get install ${missing[*]}" >&2
    apt-get update -qq
    apt_install "${missing[@]}"
    quiet_distro_etcd
  fi
  fast_wireguard_go
}

# install_extra WHAT STRICT PKG...: the missing ones of PKG, which WHAT needs (as root with apt-get). STRICT=0 is
# best effort: elsewhere than Debian the VM's kernel package has another name, and the VM test then says what is
# missing (skipped outside CI, failed in CI).
install_extra() {
  local what=$1 strict=$2 missing
  shift 2
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 0
  mapfile -t missing < <(missing_pkgs "$@")
  [ ${#missing[@]} -gt 0 ] || return 0
  echo "dev.sh: apt-get install ${missing[*]} ($what)" >&2
  if [ "$strict" = 1 ]; then
    apt-get update -qq
    apt_install "${missing[@]}"
  else
    apt-get update -qq || true
    apt_install "${missing[@]}" || echo "dev.sh: could not install ${missing[*]}: $what will not run" >&2
  fi
}

install_python() {
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
}

case "${1:-}" in
  install) install_system; install_python ;;
  demo) install_system; install_python; shift; exec .venv/bin/meshrun demo "$@" ;;
  test) install_system
        install_extra "the relay kernel test" 1 "${TEST_APT_PKGS[@]}"
        install_extra "the kernel WireGuard + netem VM test" 0 "${VM_APT_PKGS[@]}"
        install_python; shift
        # Lint and format first (ruff, configured in pyproject.toml): seconds, and a red CI says why at once.
        .venv/bin/ruff check .
        .venv/bin/ruff format --check .
        # Three test processes (pytest-xdist), a test file each at a time: two left 2 cores about 30% idle over a
        # run (the end-to-end tests wait on timers, handshakes and jobs) and took 36 min, three keep them about 80%
        # busy and take 30 (tests/DURATIONS.md). Tests that measure time take a lock that keeps the loads away
        # (tests/conftest.py). MESHRUN_TEST_WORKERS=N for another count, 0 runs them one by one.
        # Files start in the order tests/conftest.py collects them (the VM test first, then the longest).
        exec .venv/bin/python -m pytest -q -ra -n "${MESHRUN_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder \
          tests "$@" ;;
  # With no .venv and a bundle: the check runs this checkout's code (PYTHONPATH) with the installed dependencies.
  gpu-check) shift
             if [ ! -x .venv/bin/python ] && [ -n "$(offline_bundle)" ]; then
               install_offline "$(offline_bundle)"
               PATH="$PATH:$OFFLINE_PREFIX/bin" PYTHONPATH="$PWD" \
                 exec "$OFFLINE_PREFIX/venv/bin/python" -m meshrun.lab.gpucheck "$@"
             fi
             install_system; install_python; exec .venv/bin/python -m meshrun.lab.gpucheck "$@" ;;
  bundle) shift; if [ "$(id -u)" = 0 ] && on_bookworm; then backports_source; fi; exec tools/offline_bundle.sh "$@" ;;
  *) echo "usage: ./dev.sh demo|test|install|gpu-check|bundle" >&2; exit 2 ;;
esac
