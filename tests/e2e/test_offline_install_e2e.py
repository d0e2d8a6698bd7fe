"""The offline install end to end: `./dev.sh bundle` here (it needs apt's and pip's registries), then the bundle's
install.sh on a simulated fresh machine that reaches no registry and lacks meshrun's programs, as the GPU machine of
the design brief (section 5) did.

That machine is an overlayfs over this one's root (the upper layer on a tmpfs of its own: overlayfs refuses an upper
inside its lower), mounted in a new mount namespace and a network namespace with nothing but a loopback that is down
(no route: pip and apt reach nothing), entered with chroot. Deleted there first: every file of iproute2, iptables,
nftables, wireguard-tools, wireguard-go and iputils-ping, and the netfilter libraries only they load (whiteouts in the
upper layer). Its Python is /usr/bin/python3, Debian's, which has no meshrun, typer, numpy or torch. /proc, /sys,
/dev, and a fresh tmpfs on /tmp and /run (as after a boot: the bundle is unpacked in /tmp, wireguard-go's socket goes
to /run) are mounted in; every other write lands in the upper layer, which is how the test sees what install.sh
wrote: nothing outside /opt/meshrun but the link /usr/local/bin/meshrun.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
from support import REPO_ROOT

from meshrun import __version__
from meshrun.system.files import provenance

PREFIX = "/opt/meshrun"
FRESH_PYTHON = "/usr/bin/python3"  # Debian's, as on a machine that has only its distribution's Python
LINK = "usr/local/bin/meshrun"  # relative to / (as in the upper layer)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # systemd's, and a fresh root shell's
GONE_PACKAGES = ("iproute2", "iptables", "nftables", "wireguard-tools", "wireguard-go", "iputils-ping")
GONE_LIBRARIES = ("libnftables1", "libxtables12", "libnftnl11")  # nothing else on this machine loads them
GONE_ALTERNATIVES = "iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore".split()
BUNDLED = "ip tc ss bridge nft iptables iptables-save iptables-restore ip6tables wg wireguard-go ping".split()
VERSION_CHECKS = {
    "ip -V": "iproute2-6",
    "wg --version": "wireguard-tools v",
    "wireguard-go --version": "wireguard-go v0.0.2023",  # bookworm-backports' (batched I/O), not bookworm's
    "nft --version": "nftables v",
    "iptables --version": "(nf_tables)",
    "iptables -S": "-P INPUT ACCEPT",  # its extensions and libraries load, and it talks to the kernel
    "ping -V": "ping from iputils",
}


def _unavailable() -> str | None:
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        return "no apt-get/dpkg: the bundle is made on Debian or Ubuntu"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "this kernel has no overlayfs (the simulated fresh machine is an overlay of this one)"
    if not Path(FRESH_PYTHON).exists():
        return f"no {FRESH_PYTHON} (the fresh machine's Python)"
    if os.path.lexists(PREFIX) or os.path.lexists("/" + LINK):
        return f"{PREFIX} or /{LINK} exists on this machine (the test installs there in its overlay)"
    return None


def _fresh_python_version() -> str:
    return subprocess.check_output(
        [FRESH_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], text=True
    ).strip()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    why = _unavailable()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the offline install test: {why}")
        pytest.skip(why)
    out = tmp_path_factory.mktemp("bundle")
    t0 = time.monotonic()
    argv = ["./dev.sh", "bundle", "--python", _fresh_python_version(), f"{out}/"]
    res = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    (tarball,) = out.glob(f"meshrun-offline-{__version__}-py{_fresh_python_version()}-x86_64.tar.gz")
    # Its one line on stdout, with its size, for whoever carries it.
    assert res.stdout.startswith(f"offline_bundle: wrote {tarball} ("), res.stdout
    print(f"bundle made in {time.monotonic() - t0:.0f} s: {res.stdout.strip()}")
    return tarball


class Machine:
    """The simulated fresh machine: a namespace holder (`unshare -m -n sleep`), mounts made in it, commands run
    there with nsenter + chroot, an empty environment but a root login's PATH, HOME and LANG."""

    def __init__(self, scratch: Path):
        self.scratch = scratch
        self.merged = scratch / "merged"
        self.merged.mkdir()
        (scratch / "layers").mkdir()
        self.holder = subprocess.Popen(["unshare", "-m", "-n", "--propagation", "private", "sleep", "3600"])
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{self.holder.pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt"):
            assert time.monotonic() < deadline, "unshare did not make its namespaces"
            time.sleep(0.05)
        # Its mounts exist in the holder's namespace only: read from here through the holder's root.
        self.upper = self.outside(scratch / "layers" / "upper")

    def outside(self, path: Path | str) -> Path:
        """Where a path of the holder's mount namespace is seen from here."""
        return Path(f"/proc/{self.holder.pid}/root") / Path(path).relative_to("/")

    def view(self, path: str) -> Path:
        """Where a path of the fresh machine is seen from here."""
        return self.outside(self.merged / path.lstrip("/"))

    def enter(self, *argv: str, timeout: float = 60, input: str | None = None) -> subprocess.CompletedProcess:
        argv = ("nsenter", "-t", str(self.holder.pid), "-m", "-n", *argv)
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input)

    def mount(self) -> None:
        s, m = self.scratch, self.merged
        script = f"""set -e
        mount -t tmpfs -o mode=0755 layers {s}/layers
        mkdir {s}/layers/upper {s}/layers/work
        mount -t overlay fresh -o lowerdir=/,upperdir={s}/layers/upper,workdir={s}/layers/work {m}
        mount -t proc proc {m}/proc
        mount -t sysfs sysfs {m}/sys
        mount --rbind /dev {m}/dev
        mount -t tmpfs -o mode=1777 tmp {m}/tmp
        mount -t tmpfs -o mode=0755 run {m}/run
        """
        res = self.enter("sh", "-c", script)
        assert res.returncode == 0, res.stderr

    def sh(self, script: str, timeout: float = 180, env: dict[str, str] | None = None, input: str | None = None):
        """`script` in bash in the machine, as root."""
        envs = [f"{k}={v}" for k, v in {"PATH": SYSTEM_PATH, "HOME": "/root", "LANG": "C.UTF-8", **(env or {})}.items()]
        argv = ("chroot", str(self.merged), "/usr/bin/env", "-i", *envs, "bash", "-c", script)
        return self.enter(*argv, timeout=timeout, input=input)

    def ok(self, script: str, **kw) -> str:
        """`script`'s stdout and stderr, asserting it succeeded."""
        res = self.sh(script, **kw)
        assert res.returncode == 0, f"{script}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}"
        return res.stdout + res.stderr

    def upper_entries(self) -> dict[str, tuple]:
        """Every path in the upper layer (relative to /): (kind,) for a whiteout, dir or opaque-dir (a directory
        that replaced one of the lower layer), (kind, size, mtime) for a file or link."""
        out = {}
        for root, dirs, files in os.walk(self.upper):
            for name in dirs + files:
                p = Path(root) / name
                st = p.lstat()
                rel = str(p.relative_to(self.upper))
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                    out[rel] = ("whiteout",)
                elif stat.S_ISDIR(st.st_mode):
                    out[rel] = ("opaque-dir",) if _xattr(p, "trusted.overlay.opaque") == b"y" else ("dir",)
                else:
                    out[rel] = ("link" if stat.S_ISLNK(st.st_mode) else "file", st.st_size, st.st_mtime_ns)
        return out

    def close(self) -> None:
        # What a failed test left running there (a daemon, wireguard-go: sessions of their own) would keep the
        # network namespace alive, and the next test's uninstall would see it running from PREFIX.
        for proc in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                if os.readlink(proc / "root") == str(self.merged):
                    os.kill(int(proc.name), signal.SIGKILL)
        try:
            self.enter("umount", "-R", str(self.merged), timeout=30)
            self.enter("umount", str(self.scratch / "layers"), timeout=30)
        finally:
            self.holder.kill()  # its namespaces, with any mount left in them, end with their last process
            self.holder.wait(timeout=10)


def _xattr(p: Path, name: str) -> bytes | None:
    try:
        return os.getxattr(p, name, follow_symlinks=False)
    except OSError:
        return None


@pytest.fixture
def machine(tmp_path, bundle) -> Machine:
    m = Machine(tmp_path)
    try:
        m.mount()
        # The minimal image: the packages' files deleted in the chroot (so that /sbin -> usr/sbin resolves in it),
        # and iptables' alternatives links.
        listing = subprocess.run(["dpkg", "-L", *GONE_PACKAGES, *GONE_LIBRARIES], capture_output=True, text=True)
        files = [f for f in listing.stdout.split() if f.startswith("/") and not os.path.isdir(f)]
        files += [f"/usr/sbin/{t}" for t in GONE_ALTERNATIVES]
        m.ok('xargs -d "\\n" rm -f', input="\n".join(files) + "\n")
        assert m.sh(f"for t in {' '.join(BUNDLED)}; do command -v $t; done").stdout == ""
        assert m.sh(f"{FRESH_PYTHON} -c 'import meshrun'").returncode != 0, "meshrun must not be importable there"
        # pip reaches no registry there (the netns has no route).
        pip = f"{FRESH_PYTHON} -m pip download -q --no-deps -d /tmp/x --timeout 2 --retries 0 wgconfig"
        assert m.sh(pip, env={"PIP_CONFIG_FILE": "/dev/null"}).returncode != 0
        # The tarball where `./dev.sh gpu-check` looks (a checkout's .offline/; dev.sh is all it needs of one),
        # and unpacked in /tmp.
        m.ok("mkdir -p /tmp/checkout/.offline")
        shutil.copy(REPO_ROOT / "dev.sh", m.view("/tmp/checkout/dev.sh"))
        shutil.copy(bundle, m.view(f"/tmp/checkout/.offline/{bundle.name}"))
        m.ok(f"tar -xzf /tmp/checkout/.offline/{bundle.name} -C /tmp")
        yield m
    finally:
        m.close()


def _written(before: dict[str, tuple], after: dict[str, tuple]) -> dict[str, tuple]:
    """What the upper layer gained or changed between two snapshots."""
    return {p: e for p, e in after.items() if before.get(p) != e}


def _in_prefix(path: str) -> bool:
    return path == PREFIX[1:] or path.startswith(PREFIX[1:] + "/")


def _outside_prefix(written: dict[str, tuple]) -> list[str]:
    """Paths written outside PREFIX but the link, less the directories of this machine that overlayfs copies up
    when something is made inside them (its bookkeeping: the directory itself is as it was)."""
    return sorted(
        p
        for p, e in written.items()
        if not (_in_prefix(p) or p == LINK) and not (e == ("dir",) and os.path.isdir("/" + p))
    )


def test_the_bundle_installs_offline_meshrun_runs_on_its_programs_and_uninstall_leaves_nothing(machine):
    m = machine
    baseline = m.upper_entries()
    t0 = time.monotonic()
    out = m.ok("/tmp/meshrun-offline-*/install.sh")  # the default --prefix, /opt/meshrun
    print(f"install: {time.monotonic() - t0:.1f} s\n{out}")
    assert f"programs bundled: {' '.join(BUNDLED)}; this machine's own: sysctl" in out
    # Debian's Python here has no torch: said, not refused (a coordinator that does not train needs none).
    assert f"install.sh: warning: torch is not importable by {FRESH_PYTHON}" in out
    written = _written(baseline, m.upper_entries())
    assert _outside_prefix(written) == [], "written outside the prefix"
    assert written[LINK][0] == "link" and os.readlink(m.upper / LINK) == f"{PREFIX}/bin/meshrun"
    assert not any(p.startswith(PREFIX[1:] + ".") for p in written), "the set-aside copy of a previous install"

    for check, want in VERSION_CHECKS.items():
        assert want in m.ok(f"{PREFIX}/bin/{check}"), check
    # Through the link, on a root shell's PATH; the commit the bundle was built from, stamped into its wheel.
    commit = provenance.checkout_commit(REPO_ROOT)
    assert commit and m.ok("meshrun --version").strip() == f"meshrun {__version__} (commit {commit})"
    # What a results file records as the WireGuard binary: the bundled one behind the wrapper, with its package.
    probe = "import json; from meshrun.system.machine.wgbinary import wireguard_binary as w; print(json.dumps(w()))"
    wg = json.loads(m.ok(f"{PREFIX}/venv/bin/python -c '{probe}'"))
    assert wg["wrapper"] == f"{PREFIX}/bin/wireguard-go" and wg["path"] == f"{PREFIX}/root/usr/bin/wireguard-go", wg
    assert (
        wg["package"].startswith("0.0.2023")
        and wg["sha256"] == hashlib.sha256(m.view(wg["path"]).read_bytes()).hexdigest()
    ), wg
    # A systemd unit runs the venv's meshrun with systemd's PATH, which lacks PREFIX/bin.
    unit = m.ok("meshrun service install --dry-run --role coordinator")
    assert f"ExecStart={PREFIX}/venv/bin/meshrun up --foreground" in unit

    # Something real, the unit's way (the venv's meshrun, systemd's PATH): a coordinator on wireguard-go (this
    # kernel has no WireGuard module), its daemon in the background, its nftables rules. Its state goes to /tmp:
    # meshrun's own, not the install's.
    ip = f"{PREFIX}/bin/ip"
    m.ok(
        f"{ip} link set lo up && {ip} link add eth0 type veth peer name eth1 && {ip} link set eth1 up "
        f"&& {ip} addr add 192.0.2.10/24 dev eth0 && {ip} link set eth0 up"
    )
    state = {"MESHRUN_STATE_DIR": "/tmp/meshrun-state"}
    m.ok(f"{PREFIX}/venv/bin/meshrun init --endpoint 192.0.2.10", env=state)
    res = m.sh("meshrun status --json", env=state)
    st = json.loads(res.stdout)
    # No warning: the version of the wireguard-go serving meshrun0 is read from its own binary.
    assert st["interface_up"] and st["backend"] == "wireguard-go" and st["warnings"] == [], res
    environ = Path(f"/proc/{st['daemon_pid']}/environ").read_bytes().split(b"\0")
    assert f"PATH={SYSTEM_PATH}:{PREFIX}/bin".encode() in environ  # the venv's .pth appended it
    assert m.ok(f"{PREFIX}/bin/wg show meshrun0 listen-port").strip() == "51820"
    serving = (
        f'for p in /proc/[0-9]*; do [ "$(readlink $p/exe)" = {PREFIX}/root/usr/bin/wireguard-go ] && echo $p; done'
    )
    assert m.sh(serving).stdout.strip(), "the bundled wireguard-go serves meshrun0"
    assert "table inet meshrun" in m.ok(f"{PREFIX}/bin/nft list tables")
    refused = m.sh(f"{PREFIX}/uninstall.sh")
    assert refused.returncode == 1 and "install.sh: meshrun still runs from /opt/meshrun (PIDs " in refused.stderr
    assert m.view(PREFIX).is_dir()
    m.ok("meshrun down --purge", env=state)

    # Again, as `./dev.sh gpu-check` does in a checkout without .venv: an upgrade in place, ending as the first
    # did, and the check runs from it.
    before = m.upper_entries()
    out = m.ok("/tmp/checkout/dev.sh gpu-check --help")
    installed = f"installed meshrun {__version__} (commit {provenance.checkout_commit(REPO_ROOT)}) into {PREFIX}"
    assert installed in out and "usage: python -m meshrun.lab.gpucheck" in out
    after = m.upper_entries()
    assert _outside_prefix(_written(baseline, after)) == []
    # The same files (bytecode aside: Python writes it on first import, and meshrun ran in between).
    assert {p for p in after if "__pycache__" not in p} == {p for p in before if "__pycache__" not in p}

    # As on the GPU machine of the design brief: the `python3` on PATH is a virtual environment's, and torch is
    # installed only in it. The install sees that environment's packages (a venv made from a venv's Python does
    # not), so the jobs' meshrun imports the torch the machine trains with.
    torch_env = "/tmp/torch-env"  # /tmp: a tmpfs of the simulated machine, not a place install.sh writes
    m.ok(
        f"{FRESH_PYTHON} -m venv --without-pip {torch_env} && site=$({torch_env}/bin/python -c "
        "'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])') && mkdir $site/torch "
        "&& echo \"__version__ = 'the-venv-torch'\" > $site/torch/__init__.py"
    )
    out = m.ok("/tmp/checkout/dev.sh gpu-check --help", env={"PATH": f"{torch_env}/bin:{SYSTEM_PATH}"})
    assert f"into {PREFIX} for {torch_env}/bin/python3" in out and "torch is not importable" not in out, out
    assert m.ok(f"{PREFIX}/venv/bin/python -c 'import torch; print(torch.__version__)'").strip() == "the-venv-torch"
    assert m.ok(f"{PREFIX}/venv/bin/python -c 'import typer; print(typer.__file__)'").startswith(f"{PREFIX}/venv/")

    # A bundled program that does not run here (as on a machine whose glibc is older than Debian 12's): one line
    # naming it and the fix, and the install it was to replace back as it was.
    installed = m.upper_entries()
    m.ok(
        "cd /tmp/meshrun-offline-* && printf 'not a program' > root/usr/sbin/nft "
        "&& grep -v ' root/usr/sbin/nft$' MANIFEST > M && sha256sum root/usr/sbin/nft >> M && mv M MANIFEST"
    )
    res = m.sh("/tmp/meshrun-offline-*/install.sh")
    assert res.returncode == 1 and len(res.stderr.splitlines()) == 1, res.stderr
    assert res.stderr.startswith("install.sh: the bundled nft (Debian nftables ")
    assert "install nftables with this machine's package manager" in res.stderr
    assert res.stderr.rstrip().endswith("; nothing was changed")
    now = m.upper_entries()
    files = lambda entries: {p: e for p, e in entries.items() if e[0] in ("file", "link", "whiteout")}  # noqa: E731
    # Every file as it was (a directory's overlayfs flags aside: it was moved away and back).
    assert set(now) == set(installed) and files(now) == files(installed)
    assert (
        m.ok("meshrun --version").strip() == f"meshrun {__version__} (commit {provenance.checkout_commit(REPO_ROOT)})"
    )

    assert m.ok(f"{PREFIX}/uninstall.sh").strip() == f"install.sh: removed {PREFIX} and /{LINK}"
    left = _written(baseline, m.upper_entries())
    assert _outside_prefix(left) == [] and not any(_in_prefix(p) or p == LINK for p in left), left
    for d in ("/opt", "/usr/local/bin"):
        assert sorted(os.listdir(m.view(d))) == sorted(os.listdir(d))


def test_install_refuses_a_meshrun_on_path_that_is_not_its_own_or_another_python_writing_nothing(machine):
    m = machine
    # Someone else's meshrun (a pip install, say) where the link goes.
    m.ok(f"printf '#!/bin/sh\\necho theirs\\n' > /{LINK} && chmod 755 /{LINK}")
    baseline = m.upper_entries()
    res = m.sh("/tmp/meshrun-offline-*/install.sh")
    assert (res.returncode, res.stdout) == (1, "")
    assert res.stderr == (
        f"install.sh: /{LINK} exists and is not an offline install's link: remove it (rm /{LINK}), "
        "then run install.sh again\n"
    )
    assert m.upper_entries() == baseline and not m.view(PREFIX).exists()
    assert m.ok(f"/{LINK}").strip() == "theirs"
    m.ok(f"rm /{LINK}")
    # A Python other than the bundle's.
    py = _fresh_python_version()
    m.ok("printf '#!/bin/sh\\necho 3.9\\n' > /tmp/python3.9 && chmod 755 /tmp/python3.9")
    res = m.sh("/tmp/meshrun-offline-*/install.sh --python /tmp/python3.9")
    assert (res.returncode, res.stdout) == (1, "")
    assert res.stderr == (
        f"install.sh: the bundle is for Python {py} and /tmp/python3.9 is 3.9: pass --python /path/to/python{py}, "
        "or make a bundle for it (./dev.sh bundle --python 3.9)\n"
    )
    assert not m.view(PREFIX).exists()
