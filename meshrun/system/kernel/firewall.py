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

A host with cgroup v1 only (RHEL 8, many Slurm clusters) still has the v2 hierarchy in its kernel, just not
mounted: the first job guard mounts it at PRIVATE_CGROUP2 (as Cilium mounts /run/cilium/cgroupv2). The v1
controllers stay where they are (a v2 hierarchy without controllers still records each process's cgroup,
which is all socket matching needs), so the host's own cgroup setup is untouched. `hierarchy()` says which
one is in use, for `meshrun doctor`.

Needs root, nftables (`nft`, kernel >= 5.13 for `socket cgroupv2`) and a kernel whose v2 socket matching is
not switched off by v1's net_cls/net_prio (meshrun.core.firewall.socket_match_caveat); HostError naming what
is missing otherwise. `FakeFirewall` (meshrun.system.kernel.fakefirewall) records calls instead.

nftables tables belong to a network namespace, cgroups to the whole host: every call acts on the calling
process's network namespace, and cgroup names are unique per job and member so that simulated members
(namespaces on one host) do not share one.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from meshrun.core import firewall as rules
from meshrun.core.model import STORE_PORTS, Network
from meshrun.errors import CommandError, HostError
from meshrun.system.machine import host
from meshrun.system.machine.cmd import run

__all__ = [
    "JobGuard",
    "allow",
    "available",
    "cgroup2_root",
    "install_forward_guard",
    "job_gate",
    "job_tables",
    "local_port_range",
    "remove_forward_guard",
    "remove_job_cgroups",
    "sweep",
]

log = logging.getLogger("meshrun.system.kernel.firewall")

CGROUP_FS = Path("/sys/fs/cgroup")
LOCAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_LOCAL_PORTS = (32768, 60999)  # Linux's default ip_local_port_range
PRIVATE_CGROUP2 = Path("/run/meshrun/cgroup2")  # where meshrun mounts cgroup v2 on a host that has v1 only
FRESH_S = 60.0  # sweep leaves a guard this young alone: its share may not have joined it yet
RMDIR_WAIT_S = 2.0  # a killed process leaves its cgroup a moment after the kill: rmdir waits this long
# What to do about an nft failure, by a phrase of its stderr (first match wins).
NFT_FIXES = (
    (
        "cgroupv2 path fails",
        (
            "nft could not find the job's cgroup under /sys/fs/cgroup: it was removed meanwhile, "
            "or this mount namespace shows the cgroup v2 hierarchy elsewhere; mount it at "
            "/sys/fs/cgroup (mount -t cgroup2 none /sys/fs/cgroup) or run meshrun on the host"
        ),
    ),
    (
        "not supported",
        (
            "this kernel lacks nftables' `socket cgroupv2` match: use Linux >= 5.13 with "
            "CONFIG_NFT_SOCKET (modprobe nft_socket)"
        ),
    ),
    ("operation not permitted", "run meshrun as root (CAP_NET_ADMIN is needed for nftables)"),
)


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


def _require(mount: bool = True) -> Path:
    """The cgroup v2 root, once root, nft and cgroup v2 are known to be there (HostError naming the missing one);
    with `mount`, a host that mounts none gets one at PRIVATE_CGROUP2."""
    if os.geteuid() != 0:
        raise HostError(
            "job guards need root: meshrun makes a cgroup and nftables rules for every job",
            "run the meshrun agent as root (e.g. with sudo)",
        )
    if shutil.which("nft") is None:
        raise HostError(
            "`nft` is not installed: meshrun limits every port a job opens to the job's own nodes with nftables",
            "install it: apt-get install nftables",
        )
    caveat = rules.socket_match_caveat(os.uname().release, host.proc_cgroups())
    if caveat:
        raise HostError(caveat, rules.SOCKET_MATCH_FIX)
    root = cgroup2_root()
    if root is None and mount:
        root = _mount_private()
    if root is None:
        raise HostError(
            "no cgroup v2 hierarchy is mounted: meshrun tells a job's sockets apart by their cgroup",
            f"meshrun mounts one at {PRIVATE_CGROUP2} when a job starts (as root)",
        )
    return root


def _mount_private() -> Path:
    """Mount the kernel's cgroup v2 hierarchy at PRIVATE_CGROUP2 (this mount namespace shows none); HostError
    when the kernel refuses."""
    try:
        PRIVATE_CGROUP2.mkdir(parents=True, exist_ok=True, mode=0o755)
        run(["mount", "-t", "cgroup2", "cgroup2", str(PRIVATE_CGROUP2)])
    except (OSError, CommandError) as exc:
        raise HostError(
            f"no cgroup v2 hierarchy is mounted, and mounting one at {PRIVATE_CGROUP2} failed: {exc}",
            "mount it yourself (mount -t cgroup2 none /sys/fs/cgroup/unified) or boot with "
            "systemd.unified_cgroup_hierarchy=1; meshrun tells a job's sockets apart by their cgroup",
        ) from None
    log.info("this host mounts no cgroup v2 hierarchy: mounted one at %s for the job guards", PRIVATE_CGROUP2)
    return PRIVATE_CGROUP2


def available() -> tuple[str, str] | None:
    """None when job guards can be made here (mounting cgroup v2 if need be, which this does not), else why not
    and the fix (for `meshrun doctor`)."""
    try:
        _require(mount=False)
    except HostError as exc:
        if cgroup2_root() is None and not rules.socket_match_caveat(os.uname().release, host.proc_cgroups()):
            return None  # only the mount is missing: the first job makes it
        return exc.message, exc.fix
    return None


def hierarchy() -> str:
    """Which cgroup v2 hierarchy the job guards use here, in words (for `meshrun doctor`)."""
    root = cgroup2_root()
    if root is None:
        return f"none mounted (cgroup v1 only): meshrun mounts one at {PRIVATE_CGROUP2} when a job starts"
    if root == CGROUP_FS:
        return f"cgroup v2 at {root}"
    if root == PRIVATE_CGROUP2:
        return f"cgroup v2 at {root}, mounted by meshrun (this host mounts cgroup v1 only)"
    return f"cgroup v2 at {root} (a hybrid v1/v2 host)"


def _nft(script: str, root: Path | None = None) -> None:
    """Run an nft script (CommandError with a fix from NFT_FIXES when nft refuses it).

    nft resolves `socket cgroupv2` paths under /sys/fs/cgroup only; with the cgroup v2 root mounted elsewhere
    (`root`, a hybrid host) nft runs in a private mount namespace with `root` bound there: unshare makes its
    mounts private, so the host's mounts never change.
    """
    if not script:
        return
    if root is None or root == CGROUP_FS:
        run(["nft", "-f", "-"], input=script, fixes=NFT_FIXES)
        return
    run(
        ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /sys/fs/cgroup && exec nft -f -', str(root)],
        input=script,
        fixes=NFT_FIXES,
    )


def local_port_range(path: Path = LOCAL_PORT_RANGE) -> tuple[int, int]:
    """This network namespace's ephemeral ports (net.ipv4.ip_local_port_range), Linux's default when unreadable."""
    try:
        lo, hi = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_LOCAL_PORTS
    return (lo, hi) if 1 <= lo <= hi <= 65535 else DEFAULT_LOCAL_PORTS


def job_gate(job_id: str, network: Network) -> rules.ProcessGate:
    """The gate of `job_id`'s guards on this member (meshrun.core.firewall.ProcessGate): its processes alone
    reach its ports from here, the stores' range and this host's ephemeral range."""
    return rules.job_gate(job_id, network.rdzv_port, STORE_PORTS, network.api_port, local_port_range())


def job_tables() -> list[str]:
    """The job guards' tables in this network namespace ([] without nft)."""
    if shutil.which("nft") is None:
        return []
    out = run(["nft", "list", "tables"], check=False, quiet=True).stdout
    return rules.job_tables_in(out)


def _delete_table(name: str) -> None:
    run(["nft", "delete", "table", "inet", name], check=False, quiet=True)


def _cgroup_procs(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _mtime(path: Path) -> float:
    """When `create` stamped the cgroup `path` (0: it is gone)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _remove_cgroup(path: Path) -> None:
    """rmdir a job cgroup, first moving anything still in it (a straggler) to the parent; quiet if it is gone.

    A process killed a moment ago may still hold the cgroup (rmdir: EBUSY) until it has exited: retried for
    RMDIR_WAIT_S, then left behind with a warning (an empty cgroup guards nothing and costs little).
    """
    for pid in _cgroup_procs(path):
        with contextlib.suppress(OSError):  # it exited meanwhile
            (path.parent / "cgroup.procs").write_text(str(pid))
    deadline = time.monotonic() + RMDIR_WAIT_S
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                log.warning("could not remove the job cgroup %s: %s", path, exc.strerror)
                return
        time.sleep(0.05)


class JobGuard:
    """One job's guard on one member (see the module docstring).

    Constructing it touches nothing (UsageError for a bad job id, node name or interface); the life is
    `create` -> `join` -> (`allow`)* -> `remove`, `remove` also after a failure anywhere on the way.
    """

    def __init__(self, job_id: str, node: str, interface: str, gate: rules.ProcessGate | None = None) -> None:
        self.table = rules.job_table(job_id, node)
        self.comment = f"meshrun job {job_id} on {node}"
        self.interface = rules.check_interface(interface)
        self.gate = gate  # None: local processes are not judged (etcd's guard: its clients hold certificates)
        self.root: Path | None = None

    @property
    def cgroup(self) -> Path:
        """The job's cgroup directory (known once `create` or `remove` found the cgroup v2 root)."""
        assert self.root is not None
        return self.root / rules.CGROUP_PARENT / self.table

    def create(self, allowed: Iterable[str]) -> JobGuard:
        """Make the cgroup and the table admitting `allowed` (the job's nodes' overlay addresses); returns self.

        Call it before anything of the job listens, then `join`. Calling it again replaces the table (the
        set starts over from `allowed`). HostError when not root, without nft or without cgroup v2;
        UsageError for a bad address; CommandError when nft refuses the script. Nothing is left on failure.
        """
        self.root = _require()
        script = rules.job_guard(self.table, self.comment, self.interface, allowed, self.gate)
        parent = self.root / rules.CGROUP_PARENT
        try:
            parent.mkdir(mode=0o755, exist_ok=True)
            self.cgroup.mkdir(mode=0o755, exist_ok=True)
            # cgroupfs gives a directory the time its inode was first looked at, not made (and again after
            # the inode is evicted): stamped explicitly, the time lives with the cgroup and `sweep` can trust it.
            os.utime(self.cgroup)
        except OSError as exc:
            _remove_cgroup(self.cgroup)  # made before the failure, or gone already: quiet
            raise HostError(
                f"cannot create the job's cgroup {self.cgroup}: {exc.strerror}",
                "run meshrun as root on a host with a writable cgroup v2 hierarchy",
            ) from None
        try:
            _nft(script, self.root)
        except (CommandError, HostError):
            _remove_cgroup(self.cgroup)
            raise
        return self

    def join(self, pid: int = 0) -> None:
        """Move process `pid` (0: this process) into the job's cgroup; its future children stay there.

        Call it after `create` and before the process (or its children) opens a listener: a socket is judged
        by the cgroup of the process that created it. OSError (kept for callers that catch it) when the
        process is gone, the cgroup was removed or this process may not move it.
        """
        (self.cgroup / "cgroup.procs").write_text(str(pid or os.getpid()))

    def allow(self, ips: Iterable[str]) -> None:
        """Admit more nodes (an elastic job grew); CommandError if the table is gone, UsageError for a bad address."""
        _nft(rules.add_allowed(self.table, ips))

    def remove(self) -> None:
        """Delete the table, then the cgroup (stragglers moved to its parent); no error if they are gone.

        Call it once the job's processes have ended, also after a failed start; safe to call twice.
        """
        _delete_table(self.table)
        if self.root is None:
            self.root = cgroup2_root()
        if self.root is not None:
            _remove_cgroup(self.cgroup)


def allow(job_id: str, node: str, ips: Iterable[str]) -> None:
    """Admit more nodes into the guard of `job_id` on `node`, held by another process (the share).

    The agent calls it when an elastic job admits a node. CommandError when that guard does not exist.
    """
    _nft(rules.add_allowed(rules.job_table(job_id, node), ips))


def sweep() -> list[str]:
    """Remove the job guards of this network namespace whose cgroup has no process left (their job was
    killed before it could clean up); the tables removed.

    The agent calls it when it starts and now and then. Guards made in the last FRESH_S seconds are kept
    (their share may not have joined yet). No error without nft (there is nothing to sweep then). Where this
    process sees no cgroup v2 hierarchy it cannot tell live jobs from dead ones and removes nothing: deleting
    a live job's guard would open its ports to every member.
    """
    tables = job_tables()
    root = cgroup2_root()
    if root is None:
        if tables:
            log.warning("not sweeping %d job guard(s): no cgroup v2 hierarchy is mounted here", len(tables))
        return []
    gone = []
    for table in tables:
        cg = root / rules.CGROUP_PARENT / table
        # Kept: a guard whose job still has a process, or one made a moment ago (its share is about to join;
        # `create` stamps the cgroup's mtime).
        if _cgroup_procs(cg) or time.time() - _mtime(cg) < FRESH_S:
            continue
        _delete_table(table)
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
        if rules.is_job_table(table):
            _remove_cgroup(root / rules.CGROUP_PARENT / table)


def install_forward_guard(interface: str, relayed: Sequence[tuple[str, str]] = ()) -> None:
    """Drop whatever a member sends through this host to a non-overlay interface, and overlay-to-overlay
    forwarding but for the pairs in `relayed` (overlay IP pairs; meshrun passes none: its relays forward
    WireGuard's datagrams on the underlay, meshrun.system.sockets.udprelay, never overlay packets).

    Every member calls it before its interface comes up (meshrun.mesh.iface.bring_up); calling it again
    replaces the guard for `interface` and leaves other interfaces' guards alone. HostError without nft,
    CommandError when nft refuses.
    """
    if shutil.which("nft") is None:
        raise HostError(
            "`nft` is not installed: meshrun keeps members' traffic off this host's other networks with nftables",
            "install it: apt-get install nftables",
        )
    _nft(rules.forward_guard(interface, relayed))


def remove_forward_guard(interface: str | None = None) -> None:
    """Delete `interface`'s forward guard (None: every interface's), and the table once no guard is left in
    it (when the member leaves); no error if it is gone."""
    if shutil.which("nft") is None:
        return
    if interface is not None:
        run(["nft", "-f", "-"], input=rules.forward_unguard(interface), check=False, quiet=True)
        listing = run(["nft", "list", "table", "inet", rules.FORWARD_TABLE], check=False, quiet=True)
        if listing.returncode != 0 or rules.forward_chains(listing.stdout):
            return
    _delete_table(rules.FORWARD_TABLE)
