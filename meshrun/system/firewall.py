"""The kernel's side of meshrun.core.firewall: job cgroups and nftables tables, created and removed.

`JobGuard` is what a job's share (on a node) and its supervisor (on the coordinator) hold while they
run: `create(allowed)` makes the job's cgroup and its nftables table before anything listens, `join()`
moves the calling process into the cgroup (its children, torchrun and the workers, inherit it),
`allow(ips)` admits a node that joins later, `remove()` takes both away after the job. `sweep()` removes
what a process killed before its `remove()` left behind. `install_forward_guard` / `remove_forward_guard`
keep a forwarding member's overlay traffic on the overlay.

nft resolves `socket cgroupv2` paths under /sys/fs/cgroup. On a host whose cgroup v2 hierarchy is
mounted elsewhere (a hybrid v1/v2 host mounts it at /sys/fs/cgroup/unified), nft runs in a private
mount namespace where that hierarchy is bound over /sys/fs/cgroup; nothing outside it changes.

Needs root, nftables (`nft`, kernel >= 5.13 for `socket cgroupv2`) and a cgroup v2 hierarchy; HostError
naming what is missing otherwise. `FakeFirewall` (meshrun.system.fakefirewall) records calls instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from meshrun.core import firewall as rules
from meshrun.errors import CommandError, HostError
from meshrun.system.cmd import run

__all__ = ["cgroup2_root", "JobGuard", "sweep", "install_forward_guard", "remove_forward_guard", "available"]

log = logging.getLogger("meshrun.system.firewall")

CGROUP_FS = Path("/sys/fs/cgroup")
FRESH_S = 60.0          # sweep leaves a guard this young alone: its share may not have joined it yet


def cgroup2_root(mountinfo: str | None = None) -> Path | None:
    """Where this mount namespace has the cgroup v2 hierarchy's root mounted (None: nowhere)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and right.split()[:1] == ["cgroup2"] and len(fields) >= 5 and fields[3] == "/":
            return Path(fields[4])
    return None


def _require() -> Path:
    if shutil.which("nft") is None:
        raise HostError("`nft` is not installed: meshrun limits every port a job opens to the job's own nodes with "
                        "nftables", "install it: apt-get install nftables")
    root = cgroup2_root()
    if root is None:
        raise HostError("no cgroup v2 hierarchy is mounted: meshrun tells a job's sockets apart by their cgroup",
                        "boot with the unified cgroup hierarchy (systemd.unified_cgroup_hierarchy=1), or mount it: "
                        "mount -t cgroup2 none /sys/fs/cgroup/unified")
    return root


def available() -> str | None:
    """None when job guards can be made here, else why not (for `meshrun doctor`)."""
    try:
        _require()
    except HostError as exc:
        return str(exc)
    return None


def _nft(script: str, root: Path | None = None) -> None:
    """Run an nft script; with a cgroup v2 root other than /sys/fs/cgroup, where nft looks for it."""
    if not script:
        return
    if root is None or root == CGROUP_FS:
        run(["nft", "-f", "-"], input=script)
        return
    run(["unshare", "-m", "sh", "-c", 'mount --bind "$0" /sys/fs/cgroup && exec nft -f -', str(root)], input=script)


def _tables() -> list[str]:
    out = run(["nft", "list", "tables"], check=False, quiet=True).stdout
    return [parts[2] for parts in (line.split() for line in out.splitlines())
            if len(parts) == 3 and parts[0] == "table" and parts[1] == "inet"]


def _delete_table(name: str) -> None:
    run(["nft", "delete", "table", "inet", name], check=False, quiet=True)


def _cgroup_procs(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _remove_cgroup(path: Path) -> None:
    """rmdir a job cgroup, first moving anything still in it (a straggler) to the parent."""
    for pid in _cgroup_procs(path):
        with contextlib.suppress(OSError):
            (path.parent / "cgroup.procs").write_text(str(pid))
    with contextlib.suppress(OSError):
        path.rmdir()


class JobGuard:
    """One job's guard on one member (see the module docstring)."""

    def __init__(self, job_id: str, node: str, interface: str) -> None:
        self.table = rules.job_table(job_id, node)
        self.comment = f"meshrun job {job_id} on {node}"
        self.interface = rules.check_interface(interface)
        self.root: Path | None = None

    @property
    def cgroup(self) -> Path:
        assert self.root is not None
        return self.root / rules.CGROUP_PARENT / self.table

    def create(self, allowed: Iterable[str]) -> "JobGuard":
        """Make the cgroup and the table (HostError without nft or cgroup v2; nothing left on failure)."""
        self.root = _require()
        script = rules.job_guard(self.table, self.comment, self.interface, allowed)
        parent = self.root / rules.CGROUP_PARENT
        try:
            parent.mkdir(mode=0o755, exist_ok=True)
            self.cgroup.mkdir(mode=0o755, exist_ok=True)
        except OSError as exc:
            raise HostError(f"cannot create the job's cgroup {self.cgroup}: {exc.strerror}",
                            "run meshrun as root on a host with a writable cgroup v2 hierarchy") from None
        try:
            _nft(script, self.root)
        except (CommandError, HostError):
            _remove_cgroup(self.cgroup)
            raise
        return self

    def join(self, pid: int = 0) -> None:
        """Move process `pid` (0: this process) into the job's cgroup; its future children stay there."""
        (self.cgroup / "cgroup.procs").write_text(str(pid or os.getpid()))

    def allow(self, ips: Iterable[str]) -> None:
        """Admit more nodes (an elastic job grew)."""
        _nft(rules.add_allowed(self.table, ips))

    def remove(self) -> None:
        """Delete the table and the cgroup; no error if they are gone."""
        _delete_table(self.table)
        if self.root is None:
            self.root = cgroup2_root()
        if self.root is not None:
            _remove_cgroup(self.cgroup)


def allow(job_id: str, node: str, ips: Iterable[str]) -> None:
    """Admit more nodes into the guard of `job_id` on `node`, held by another process (the share)."""
    _nft(rules.add_allowed(rules.job_table(job_id, node), ips))


def sweep() -> list[str]:
    """Remove the job guards of this network namespace whose cgroup has no process left (their job was
    killed before it could clean up); the tables removed."""
    if shutil.which("nft") is None:
        return []
    root = cgroup2_root()
    gone = []
    for table in _tables():
        if not table.startswith(rules.JOB_TABLE_PREFIX):
            continue
        cg = root / rules.CGROUP_PARENT / table if root is not None else None
        # Kept: a guard whose job still has a process, or one made a moment ago (its share is about to join).
        if cg is not None and cg.is_dir() and (_cgroup_procs(cg) or time.time() - cg.stat().st_mtime < FRESH_S):
            continue
        _delete_table(table)
        if cg is not None:
            _remove_cgroup(cg)
        gone.append(table)
    if gone:
        log.info("removed %d job guard(s) left by jobs that ended without cleaning up", len(gone))
    return gone


def remove_job_cgroups(tables: Iterable[str]) -> None:
    """Remove the (empty) cgroups of these job guards' tables: what stays of a guard on the host once the
    network namespace holding its table is gone (the testbed tears namespaces down with their jobs)."""
    root = cgroup2_root()
    if root is None:
        return
    for table in tables:
        if table.startswith(rules.JOB_TABLE_PREFIX):
            _remove_cgroup(root / rules.CGROUP_PARENT / table)


def install_forward_guard(interface: str) -> None:
    """Drop whatever a member sends through this host to a non-overlay interface (HostError without nft)."""
    if shutil.which("nft") is None:
        raise HostError("`nft` is not installed: meshrun keeps relayed member traffic off this host's other "
                        "networks with nftables", "install it: apt-get install nftables")
    _nft(rules.forward_guard(interface))


def remove_forward_guard() -> None:
    if shutil.which("nft") is not None:
        _delete_table(rules.FORWARD_TABLE)
