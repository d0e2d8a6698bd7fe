#!/usr/bin/env bash
# One entry point for a fresh Debian/Ubuntu machine (run as root for the namespace world):
#   ./dev.sh demo      install what is needed, then run `meshrun demo`
#   ./dev.sh test      install what is needed (incl. test deps), then run the whole test suite
#   ./dev.sh install   only install
# Python deps go to ./.venv; torch is pinned first (an unpinned torch pulls GBs of CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")"
APT_PKGS=(iproute2 iptables wireguard-tools wireguard-go iputils-ping iperf3 procps util-linux)
PY=${PYTHON:-python3}
TORCH=${MESHRUN_TORCH:-torch==2.13.0}

install_system() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "dev.sh: not root or no apt-get: skipping system packages (${APT_PKGS[*]})" >&2
    return
  fi
  local missing=()
  for p in "${APT_PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if ! "$PY" -m venv --help >/dev/null 2>&1; then missing+=(python3-venv python3-pip); fi
  if [ ${#missing[@]} -gt 0 ]; then
    echo "dev.sh: apt-get install ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
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
  test) install_system; install_python; shift; exec .venv/bin/python -m pytest -q -ra tests "$@" ;;
  *) echo "usage: ./dev.sh demo|test|install" >&2; exit 2 ;;
esac
