#!/usr/bin/env bash
# Install meshrun from its offline bundle (made by tools/offline_bundle.sh, which ships this file as install.sh)
# on a machine that reaches no package registry. As root, in the unpacked bundle:
#   ./install.sh [--prefix DIR] [--python PY]   install; again: replaces DIR          [/opt/meshrun, python3]
#   ./install.sh --uninstall [--prefix DIR]     remove what install wrote (DIR/uninstall.sh does the same)
# It writes nothing outside DIR but the link /usr/local/bin/meshrun -> DIR/bin/meshrun, and refuses a link (or
# file) there that is not one of its own. In DIR: venv/, a virtual environment over PY's own packages (so the
# machine's torch is the one jobs use) with the bundle's wheels installed by pip --no-index; root/, the bundled
# Debian programs, copied only when this machine lacks one of them; bin/, meshrun and a wrapper for each
# program this machine lacks. Every program and meshrun is run once before the link is made; anything failing
# leaves the machine as it was.
set -euo pipefail
LINK=/usr/local/bin/meshrun
MARK=.meshrun-offline
# Where this machine's own programs count (systemd's PATH for units): a program found only elsewhere is
# bundled, because a daemon started by systemd would not find it.
SYSTEM_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
LIBDIRS=(lib/x86_64-linux-gnu usr/lib/x86_64-linux-gnu)
# Nothing this script runs with Python may write bytecode into the machine's own directories.
export PYTHONDONTWRITEBYTECODE=1

died=0 started=0
# One line: what is wrong and what to do; once the install has begun, also that it was undone.
die() {
  died=1
  echo "install.sh: $*$([ "$started" = 0 ] || echo "; nothing was changed")" >&2
  exit 1
}
say() { echo "install.sh: $*" >&2; }
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }

here=$(cd "$(dirname "$0")" && pwd)
mode=install prefix=/opt/meshrun py=python3
# DIR/uninstall.sh is a copy of this script: under that name it uninstalls the directory it sits in.
if [ "$(basename "$0")" = uninstall.sh ]; then mode=uninstall prefix=$here; fi
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) [ $# -ge 2 ] || die "--prefix needs a directory, e.g. --prefix /opt/meshrun"; prefix=$2; shift 2 ;;
    --prefix=*) prefix=${1#--prefix=}; shift ;;
    --python) [ $# -ge 2 ] || die "--python needs an interpreter, e.g. --python /usr/bin/python3"; py=$2; shift 2 ;;
    --python=*) py=${1#--python=}; shift ;;
    --uninstall) mode=uninstall; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument $1: usage: install.sh [--prefix DIR] [--python PY] | --uninstall [--prefix DIR]" ;;
  esac
done
prefix=${prefix%/}
# Paths go unquoted into wrappers, a .pth line and venv scripts' #! lines: plain characters only.
[[ "$prefix" =~ ^/[A-Za-z0-9._+/-]+$ ]] \
  || die "--prefix '$prefix' is not an absolute path of letters, digits and ._+-/: pass one, e.g. --prefix /opt/meshrun"
[ "$(id -u)" = 0 ] || die "run it as root (sudo $0): it links $LINK, and meshrun runs as root"

# The install a link belongs to: LINK -> P/bin/meshrun with P/.meshrun-offline; fails for anything else.
link_prefix() {
  [ -L "$LINK" ] || return 1
  local target p
  target=$(readlink "$LINK")
  [[ "$target" == /*/bin/meshrun ]] || return 1
  p=${target%/bin/meshrun}
  [ -f "$p/$MARK" ] || return 1
  echo "$p"
}

# PIDs of processes running a program of DIR: wireguard-go from DIR/root, the daemon and jobs from DIR/venv.
running_from() {
  local d pid exe cmd0 pids=()
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    exe=$(readlink "$d/exe" 2>/dev/null) || exe=""
    cmd0=""
    { IFS= read -r -d '' cmd0 <"$d/cmdline"; } 2>/dev/null || true
    if [[ "$exe" == "$1/"* || "$cmd0" == "$1/"* ]]; then pids+=("$pid"); fi
  done
  echo "${pids[*]}"
}

# The machine's own program for a command, in SYSTEM_PATH; fails when it has none.
host_tool() {
  local d IFS=:
  for d in $SYSTEM_PATH; do
    if [ -x "$d/$1" ] && [ ! -d "$d/$1" ]; then echo "$d/$1"; return 0; fi
  done
  return 1
}

uninstall() {
  [ -f "$prefix/$MARK" ] \
    || die "$prefix is not an offline install of meshrun (no $prefix/$MARK): pass the --prefix it went to"
  local pids unit link=""
  pids=$(running_from "$prefix")
  [ -z "$pids" ] || die "meshrun still runs from $prefix (PIDs $pids): stop it first" \
    "(meshrun down on a coordinator, meshrun leave on a node), then uninstall"
  for unit in /etc/systemd/system/meshrun-*.service; do
    if [ -f "$unit" ] && [[ "$(<"$unit")" == *"$prefix/"* ]]; then
      say "note: $unit runs meshrun from $prefix: remove it too (docs/howto/uninstall.md)"
    fi
  done
  if [ "$(link_prefix || true)" = "$prefix" ]; then rm -f "$LINK"; link=" and $LINK"; fi
  rm -rf "$prefix"
  say "removed $prefix$link"
}

if [ "$mode" = uninstall ]; then uninstall; exit 0; fi

# --- install: every check before anything is written ---------------------------------------------------------
info() {  # info KEY: a value of the bundle's BUNDLE-INFO
  local k v
  while IFS='=' read -r k v; do if [ "$k" = "$1" ]; then echo "$v"; return 0; fi; done <"$here/BUNDLE-INFO"
  die "the bundle's BUNDLE-INFO has no $1: unpack the tarball again"
}
[ -f "$here/BUNDLE-INFO" ] && [ -f "$here/MANIFEST" ] \
  || die "no bundle beside $0 (BUNDLE-INFO, MANIFEST): run the install.sh of an unpacked meshrun-offline tarball"
name=$(info name) want=$(info python)
[ "$(uname -m)" = x86_64 ] \
  || die "this machine is $(uname -m) and the bundle $name is for x86_64: install meshrun from a registry"
pypath=$(command -v "$py") \
  || die "no Python '$py' here: pass --python /path/to/python$want (the one torch is installed for)"
have=$("$pypath" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
  || die "$pypath does not run: pass --python /path/to/python$want"
[ "$have" = "$want" ] \
  || die "the bundle is for Python $want and $pypath is $have: pass --python /path/to/python$want," \
    "or make a bundle for it (./dev.sh bundle --python $have)"
"$pypath" -c 'import venv' 2>/dev/null \
  || die "$pypath has no venv module: install it (Debian: libpython$want-stdlib), or pass another --python"
if [ -e "$prefix" ] && [ ! -f "$prefix/$MARK" ] && [ -n "$(ls -A "$prefix" 2>/dev/null || echo file)" ]; then
  die "$prefix exists and is not an offline install of meshrun: pass another --prefix, or empty it first"
fi
parent=$(dirname "$prefix")
[ -d "$parent" ] || die "$parent does not exist: create it (mkdir -p $parent), or pass another --prefix"
[ -d "${LINK%/*}" ] || die "${LINK%/*} does not exist: create it (mkdir -p ${LINK%/*}), then run install.sh again"
if [ -e "$LINK" ] || [ -L "$LINK" ]; then
  owner=$(link_prefix) \
    || die "$LINK exists and is not an offline install's link: remove it (rm $LINK), then run install.sh again"
  [ "$owner" = "$prefix" ] \
    || die "$LINK belongs to the offline install in $owner: uninstall it ($owner/uninstall.sh) or pass --prefix $owner"
fi
bad=$(cd "$here" && sha256sum --quiet --strict -c MANIFEST 2>&1) \
  || die "the bundle's files do not match its MANIFEST (${bad%%$'\n'*}): copy and unpack the tarball again"
pipwhl=$(echo "$here"/wheels/pip-*.whl)
[ -f "$pipwhl" ] || die "the bundle has no pip wheel: make it again with tools/offline_bundle.sh"

# --- install into PREFIX (the previous install set aside until this one works) --------------------------------
pids=$(running_from "$prefix")
old="" committed=0
log=$(mktemp /tmp/meshrun-offline-install.XXXXXX)
rollback() {
  [ "$committed" = 0 ] || return 0
  if [ "$started" = 1 ]; then rm -rf "$prefix"; fi
  if [ -n "$old" ] && [ -e "$old" ] && [ ! -e "$prefix" ]; then mv "$old" "$prefix"; fi
  [ "$died" = 1 ] || say "failed (see above; the output of venv and pip: $log); nothing was changed"
}
on_exit() {
  local rc=$?
  if [ "$rc" != 0 ]; then rollback; else rm -f "$log"; fi
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM
if [ -e "$prefix" ]; then
  old="$prefix.old.$$"
  mv "$prefix" "$old"
fi
started=1
mkdir -p "$prefix/bin"
vpy="$prefix/venv/bin/python"

# The machine's Python with its own packages visible (torch); pip from the bundle's wheel, so Python needs no
# ensurepip (Debian's python3-venv), and with no index, no cache and no configuration of the machine's. No
# bytecode either (4-5x faster here): Python writes it on first import, into the environment.
"$pypath" -m venv --system-site-packages --without-pip "$prefix/venv" >>"$log" 2>&1 \
  || die "$pypath -m venv could not make $prefix/venv ($(tail -1 "$log")): see $log"
run_pip() (
  for v in $(compgen -e); do if [[ "$v" == PIP_* ]]; then unset "$v"; fi; done
  export PIP_CONFIG_FILE=/dev/null PYTHONNOUSERSITE=1
  "$vpy" "$pipwhl/pip" "$@" --no-index --no-cache-dir --no-compile --disable-pip-version-check --no-input \
    >>"$log" 2>&1
)
run_pip install --find-links "$here/wheels" -r "$here/requirements.txt" "$pipwhl" \
  || die "pip could not install the bundle's wheels for $pypath ($(tail -1 "$log")): see $log"
run_pip install --no-deps "$here"/wheels/meshrun-*.whl \
  || die "pip could not install meshrun's wheel ($(tail -1 "$log")): see $log"
# DIR/bin at the end of PATH for every process of this Python, the systemd unit's daemon (`meshrun service
# install` runs venv/bin/meshrun with systemd's PATH) and the jobs it starts included: the machine's own
# programs stay first, the bundled ones fill in.
site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# A --python inside a virtual environment (torch is often installed so): a venv made from it sees only the base
# Python's packages, so its own site directories go into ours, after our wheels (a .pth adds them at the end).
"$pypath" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null \
  && "$pypath" -c 'import site, sys; print("\n".join(p for p in site.getsitepackages() if p.startswith(sys.prefix)))' \
    >"$site/meshrun_offline_venv.pth"
# (A .pth file runs a line that starts with `import`: one line.)
printf '%s%s\n' "import os; p = os.environ.get('PATH') or '$SYSTEM_PATH'; " \
  "os.environ['PATH'] = p if '$prefix/bin' in p.split(os.pathsep) else p + os.pathsep + '$prefix/bin'" \
  >"$site/meshrun_offline_path.pth"

# A program this machine has is used as it is; for each one it lacks, a wrapper runs the bundled one. One that
# loads bundled libraries is started by glibc's loader with --library-path, which holds for that process only:
# LD_LIBRARY_PATH would reach every program `ip netns exec` starts (meshrun's lab runs Python and sysctl so),
# forcing Debian 12's libz, libcap, libselinux ... on them.
LDSO=/lib64/ld-linux-x86-64.so.2
libpath=$(printf "$prefix/root/%s:" "${LIBDIRS[@]}")
libpath=${libpath%:}
bundled=() own=()
while read -r cmd path libs arg check pkg; do
  if host_tool "$cmd" >/dev/null; then own+=("$cmd"); continue; fi
  [ -x "$LDSO" ] \
    || die "this machine has no $cmd, nor glibc's loader ($LDSO) for the bundled one: install $pkg from its distribution"
  [ -d "$prefix/root" ] || cp -a "$here/root" "$prefix/root"
  {
    echo '#!/bin/sh'
    echo "# meshrun-offline: $cmd from Debian's $pkg, bundled because this machine has none; written by install.sh."
    if [[ "$path" == *xtables* ]]; then
      echo "XTABLES_LIBDIR=$prefix/root/usr/lib/x86_64-linux-gnu/xtables; export XTABLES_LIBDIR"
    fi
    loader=$([ "$libs" = 0 ] || echo "$LDSO --library-path $libpath ")
    echo "exec $loader$prefix/root/$path $([ "$arg" = - ] || echo "$arg ")\"\$@\""
  } >"$prefix/bin/$cmd"
  chmod 755 "$prefix/bin/$cmd"
  bundled+=("$cmd")
done <"$here/tools.txt"
cat >"$prefix/bin/meshrun" <<EOF
#!/bin/sh
# meshrun-offline: the meshrun of the offline install in $prefix (its uninstall.sh removes it); $LINK links here.
case ":\${PATH:-}:" in *":$prefix/bin:"*) ;; *) PATH="\${PATH:-$SYSTEM_PATH}:$prefix/bin"; export PATH ;; esac
exec $prefix/venv/bin/meshrun "\$@"
EOF
chmod 755 "$prefix/bin/meshrun"
cp "$here/$(basename "$0")" "$prefix/uninstall.sh"
chmod 755 "$prefix/uninstall.sh"
printf 'bundle=%s\npython=%s\nlink=%s\nbundled=%s\n' "$name" "$pypath" "$LINK" "${bundled[*]}" >"$prefix/$MARK"

# --- every bundled program and meshrun must run here --------------------------------------------------------
while read -r cmd path libs arg check pkg; do
  [ -f "$prefix/bin/$cmd" ] || continue
  if ! out=$("$prefix/bin/$cmd" "$check" 2>&1 </dev/null); then
    version=$(while read -r p v _; do if [ "$p" = "$pkg" ]; then echo "$v"; fi; done <"$here/debs.txt")
    die "the bundled $cmd (Debian $pkg $version) does not run on this machine (${out%%$'\n'*}):" \
      "install $pkg with this machine's package manager (then install.sh uses it), or make the bundle" \
      "on a Debian release no newer than this machine's"
  fi
done <"$here/tools.txt"
version=$("$prefix/bin/meshrun" --version 2>&1 </dev/null) \
  || die "meshrun does not start from $prefix/venv (${version##*$'\n'}):" \
    "make the bundle again, for this machine's Python ($have)"
# Not fatal: a coordinator that does not train needs no torch.
if ! err=$("$vpy" -c 'import torch' 2>&1 </dev/null); then
  say "warning: torch is not importable by $pypath (${err##*$'\n'}): install it for that Python where this" \
    "machine trains, or pass --python a Python that has it"
fi

if [ "$(readlink "$LINK" 2>/dev/null || true)" != "$prefix/bin/meshrun" ]; then
  ln -sfn "$prefix/bin/meshrun" "$LINK"
fi
committed=1
[ -z "$old" ] || rm -rf "$old"
say "installed $version into $prefix for $pypath; $LINK runs it"
say "programs bundled: ${bundled[*]:-none}; this machine's own: ${own[*]:-none}"
[ -z "$pids" ] \
  || say "meshrun was running from $prefix (PIDs $pids): restart its daemon (docs/howto/upgrade-with-running-jobs.md)"
say "uninstall: $prefix/uninstall.sh"
