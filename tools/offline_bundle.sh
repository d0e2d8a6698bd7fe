#!/usr/bin/env bash
# Make meshrun's offline bundle: everything a machine that reaches no package registry needs to install
# meshrun with tools/offline_install.sh (docs/install.md, "Without a package registry").
#   tools/offline_bundle.sh [--python X.Y] [OUT]        (./dev.sh bundle runs it)
# On Debian/Ubuntu x86_64 with apt and pip reaching their registries. OUT: a .tar.gz path, or a directory
# to write meshrun-offline-VERSION-pyX.Y-x86_64.tar.gz into [.offline/]. X.Y: the target's Python [this one's].
# The bundle holds a wheel of this checkout, wheels of meshrun's dependencies for CPython X.Y but not torch
# (the target brings its own build: the one its GPUs and drivers need), the Debian packages of ip, tc, ss,
# bridge, nft, iptables, wg, wireguard-go, ping and sysctl with the libraries they load, unpacked, and
# install.sh, plus MANIFEST (sha256 of every file).
set -euo pipefail
caller=$PWD  # OUT is relative to where this was started (dev.sh starts it in the checkout)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The programs, then the libraries they load that are not glibc's (check_libs below fails naming any other).
# wireguard-go comes from bookworm-backports where that suite exists (batched I/O: 4-6x faster; see dev.sh).
TOOL_DEBS=(iproute2 iptables nftables wireguard-tools iputils-ping procps)
LIB_DEBS=(libbpf1 libbsd0 libcap2 libcom-err2 libedit2 libelf1 libgmp10 libgssapi-krb5-2 libidn2-0 libjansson4
  libk5crypto3 libkeyutils1 libkrb5-3 libkrb5support0 libmd0 libmnl0 libnetfilter-conntrack3 libnfnetlink0
  libnftables1 libnftnl11 libpcre2-8-0 libselinux1 libtinfo6 libtirpc3 libunistring2 libxtables12 zlib1g)
# The commands meshrun (and its lab) runs, each with the program that serves it (iptables: the nf_tables
# multi-call binary, given the command's name as its first argument), how install.sh checks that it runs, and
# its package.
#        command            program            first argument   version check  package
TOOLS="  ip                 ip                 -                -V             iproute2
         tc                 tc                 -                -V             iproute2
         ss                 ss                 -                -V             iproute2
         bridge             bridge             -                -V             iproute2
         nft                nft                -                --version      nftables
         iptables           xtables-nft-multi  iptables         --version      iptables
         iptables-save      xtables-nft-multi  iptables-save    --version      iptables
         iptables-restore   xtables-nft-multi  iptables-restore --version      iptables
         ip6tables          xtables-nft-multi  ip6tables        --version      iptables
         wg                 wg                 -                --version      wireguard-tools
         wireguard-go       wireguard-go       -                --version      wireguard-go
         ping               ping               -                -V             iputils-ping
         sysctl             sysctl             -                --version      procps"
# glibc's own libraries: every glibc machine has them, and a bundle cannot bring its own without its loader.
GLIBC_SONAMES=" linux-vdso.so.1 ld-linux-x86-64.so.2 libc.so.6 libm.so.6 libresolv.so.2 libdl.so.2 libpthread.so.0
  librt.so.1 libanl.so.1 libutil.so.1 "
LDSO=/lib64/ld-linux-x86-64.so.2
# Wheels that need at most glibc 2.28 (RHEL 8 and later): the bundled programs need more (Debian 12's 2.36),
# but a machine with programs of its own uses only the wheels.
MANYLINUX_MAX=28

die() { echo "offline_bundle: $*" >&2; exit 1; }

target=""
out=".offline/"
while [ $# -gt 0 ]; do
  case "$1" in
    --python) [ $# -ge 2 ] || die "--python needs a version, e.g. --python 3.12"; target=$2; shift 2 ;;
    --python=*) target=${1#--python=}; shift ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1: usage: tools/offline_bundle.sh [--python X.Y] [OUT.tar.gz|DIR]" ;;
    *) out=$1; shift ;;
  esac
done

[ "$(dpkg --print-architecture 2>/dev/null || true)" = amd64 ] \
  || die "this machine is not Debian/Ubuntu amd64 (dpkg --print-architecture): bundles are made for x86_64 on one"
command -v apt-get >/dev/null || die "apt-get is missing: make the bundle on Debian or Ubuntu"
"$PY" -m pip --version >/dev/null 2>&1 || die "$PY has no pip: install python3-pip, or set PYTHON to a Python with pip"
[ -n "$target" ] || target=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ "$target" =~ ^3\.([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" -ge 10 ] \
  || die "--python $target is not a Python version meshrun supports: pass 3.10 or later as X.Y"
cpy="cp${target/./}"
codename=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}" || true)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/src" "$tmp/wheels" "$tmp/debs" "$tmp/root"

# meshrun's wheel, built from the checkout's files (tracked, and untracked ones git does not ignore) copied
# elsewhere: a build in place would pick up a stale build/ directory.
echo "offline_bundle: building meshrun's wheel" >&2
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z -co --exclude-standard | while IFS= read -r -d '' f; do
    if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi  # not a tracked file deleted here
  done | tar --null --no-recursion -T - -cf - | tar -xf - -C "$tmp/src"  # tar: cpio is not on a minimal host
  commit=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo "+changes")
else
  cp -a . "$tmp/src/" && rm -rf "$tmp/src"/.venv* "$tmp/src/build" "$tmp/src/.offline"
  commit=unknown
fi
# The copy is no checkout: the commit goes into the wheel here (`meshrun --version`; tools/build_backend.py).
if [ "$commit" != unknown ]; then echo "$commit" >"$tmp/src/meshrun/_commit"; fi
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$tmp/wheels" "$tmp/src" >&2
wheel=$(cd "$tmp/wheels" && echo meshrun-*.whl)
[ -f "$tmp/wheels/$wheel" ] || die "pip built no meshrun wheel in $tmp/wheels: see pip's output above"
version=$(echo "$wheel" | cut -d- -f2)
name="meshrun-offline-$version-py$target-x86_64"
stage="$tmp/$name"
mkdir -p "$stage/wheels"

# Its dependencies as the wheel declares them, but torch, markers kept (pip on the target evaluates them too).
"$PY" - "$tmp/wheels/$wheel" >"$stage/requirements.txt" <<'EOF'
import re, sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
for req in meta.get_all("Requires-Dist") or []:
    name = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower()
    if name != "torch" and "extra ==" not in req.replace("extra==", "extra =="):
        print(req)
EOF
mv "$tmp/wheels/$wheel" "$stage/wheels/"
echo "offline_bundle: downloading wheels for CPython $target: $(tr '\n' ' ' <"$stage/requirements.txt")pip" >&2
platforms=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for ((v = 17; v <= MANYLINUX_MAX; v++)); do platforms+=(--platform "manylinux_2_${v}_x86_64"); done
# pip download --python-version picks wheels for X.Y but evaluates markers (`tomli; python_version < "3.11"`, and
# the dependencies' own) for the Python it runs on (pypa/pip#11010): for another X.Y, pip runs with X.Y's.
pip_for_target=("$PY" -m pip)
if [ "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" != "$target" ]; then
  pip_for_target=("$PY" -c '
import sys
from pip._vendor.packaging import markers
if not callable(getattr(markers, "default_environment", None)):
    sys.exit("offline_bundle: this pip evaluates markers elsewhere: run with PYTHON set to a Python " + sys.argv[1])
base = markers.default_environment
target = {"python_version": sys.argv[1], "python_full_version": sys.argv[1] + ".0"}
markers.default_environment = lambda: {**base(), **target}
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))' "$target")
fi
"${pip_for_target[@]}" download -q --disable-pip-version-check --only-binary=:all: --implementation cp \
  --python-version "$target" "${platforms[@]}" -d "$stage/wheels" -r "$stage/requirements.txt" pip >&2

# The Debian packages, then unpacked: install.sh copies the tree, so the target needs no dpkg. As root, apt
# downloads as root (its sandbox user _apt may not write into this private temporary directory).
echo "offline_bundle: downloading Debian packages" >&2
download=(apt-get download -q=2)
if [ "$(id -u)" = 0 ]; then
  apt-get update -qq
  download+=(-o APT::Sandbox::User=root)
else
  echo "offline_bundle: not root: apt's package lists as they are (apt-get update needs root)" >&2
fi
wg_go=(wireguard-go)
if [ "$codename" = bookworm ]; then
  [[ "$(apt-cache policy wireguard-go)" == *bookworm-backports* ]] \
    || die "bookworm-backports is not among apt's sources (Debian 12's wireguard-go is 4-6x slower):" \
      "run ./dev.sh bundle, which adds it"
  wg_go=(-t bookworm-backports wireguard-go)
fi
(cd "$tmp/debs" && "${download[@]}" "${TOOL_DEBS[@]}" "${LIB_DEBS[@]}" && "${download[@]}" "${wg_go[@]}") >&2
for deb in "$tmp"/debs/*.deb; do
  dpkg-deb -x "$deb" "$tmp/root"
  sum=$(sha256sum <"$deb")
  printf '%s %s %s\n' "$(dpkg-deb -f "$deb" Package)" "$(dpkg-deb -f "$deb" Version)" "${sum%% *}"
done >"$stage/debs.txt"

# Which libraries a program loads, looked up in the unpacked packages first (as install.sh's wrappers have glibc's
# loader do, with --library-path): prints 1 when one comes from the bundle, else 0; fails naming a library that is
# neither bundled nor glibc's.
libpath="$tmp/root/lib/x86_64-linux-gnu:$tmp/root/usr/lib/x86_64-linux-gnu"
check_libs() {
  local file=$1 line soname path bundled=0
  while IFS= read -r line; do
    line=${line#"${line%%[![:space:]]*}"}
    [ -n "$line" ] || continue
    if [[ "$line" == *" => "* ]]; then soname=${line%% => *}; path=${line#* => }; path=${path%% (*}
    else soname=${line%% (*}; path=$soname; fi
    if [[ "$path" == "$tmp/root/"* ]]; then bundled=1
    elif [[ "$GLIBC_SONAMES" != *" ${soname##*/} "* ]]; then
      die "${file#"$tmp/root/"} loads $soname, which no bundled package has:" \
        "add its Debian package (dpkg -S $soname) to LIB_DEBS in $0"
    fi
  done < <("$LDSO" --list --library-path "$libpath" "$file" 2>&1 || true)
  echo "$bundled"
}
while read -r cmd prog arg check pkg; do
  path=""
  for d in usr/sbin usr/bin sbin bin; do
    if [ -f "$tmp/root/$d/$prog" ] && [ ! -L "$tmp/root/$d/$prog" ]; then path=$d/$prog; break; fi
  done
  [ -n "$path" ] || die "no program $prog in the downloaded packages (for $cmd): add its package to TOOL_DEBS in $0"
  libs=$(check_libs "$tmp/root/$path")
  if [ "$prog" = xtables-nft-multi ]; then  # its extensions are loaded from XTABLES_LIBDIR at run time
    for so in "$tmp"/root/usr/lib/x86_64-linux-gnu/xtables/*.so; do check_libs "$so" >/dev/null; done
  fi
  printf '%s %s %s %s %s %s\n' "$cmd" "$path" "$libs" "$arg" "$check" "$pkg"
done <<<"$TOOLS" >"$stage/tools.txt"
mv "$tmp/root" "$stage/root"

cp tools/offline_install.sh "$stage/install.sh"
chmod 755 "$stage/install.sh"
cat >"$stage/BUNDLE-INFO" <<EOF
name=$name
meshrun=$version
commit=$commit
python=$target
abi=$cpy
arch=x86_64
made=$(date -u +%Y-%m-%dT%H:%M:%SZ)
made_on=$(. /etc/os-release 2>/dev/null && echo "${PRETTY_NAME:-unknown}" || echo unknown)
EOF
# Regular files only: the packages' symbolic links point at paths of the machine they are installed on.
(cd "$stage" && find . -type f ! -name MANIFEST -printf '%P\0' | sort -z | xargs -0 sha256sum >MANIFEST)

case "$out" in
  /*) ;;
  *) out=$caller/$out ;;
esac
case "$out" in
  *.tar.gz) tarball=$out ;;
  *) tarball=${out%/}/$name.tar.gz ;;
esac
mkdir -p "$(dirname "$tarball")"
tar -czf "$tarball.part" --owner=0 --group=0 -C "$tmp" "$name"
mv "$tarball.part" "$tarball"
echo "offline_bundle: wrote $tarball ($(du -h "$tarball" | cut -f1); $(wc -l <"$stage/MANIFEST") files," \
  "$(ls "$stage/wheels" | wc -l) wheels, $(wc -l <"$stage/debs.txt") Debian packages)"
