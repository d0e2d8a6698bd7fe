"""meshrun.system.kernel.firewall in real network namespaces: a job guard admits only the job's nodes to the job's
sockets (and nothing else on the host changes), the forward guard keeps member traffic off other networks.

Plain namespaces joined by a bridge stand in for the overlay here (the guard keys on an interface name and
overlay addresses); tests/e2e/test_member_attacks_e2e.py runs the same guards under real jobs on WireGuard.
The guard is made twice: as a member whose cgroup v2 hierarchy is at /sys/fs/cgroup, and with this host's
own mounts (on a hybrid v1/v2 host the hierarchy is elsewhere and nft needs the module's bind-mount trick).
Every namespace, cgroup and table made here is removed, and every process killed by its PID, whatever fails.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest
from support import unique_prefix

from meshrun.core import firewall as rules
from meshrun.system.kernel import firewall
from meshrun.system.kernel.firewall import cgroup2_root

LISTEN = """
import socket, sys, threading
sys.stdin.readline()                      # wait until the test has put us in (or left us out of) the cgroup
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", int(sys.argv[1])))
def echo():
    while True:
        data, peer = u.recvfrom(64); u.sendto(data, peer)
threading.Thread(target=echo, daemon=True).start()
print("listening", flush=True)
while True:
    c, _ = s.accept(); c.close()
"""
GUARD = """
import sys
from meshrun.system.kernel.firewall import JobGuard
op, job, node, iface = sys.argv[1:5]
g = JobGuard(job, node, iface)
if op == "create":
    g.create(sys.argv[6:]); g.join(int(sys.argv[5]))
elif op == "allow":
    g.root = None; g.allow(sys.argv[5:])
elif op == "remove":
    g.remove()
"""


def sh(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=30, **kw)


def in_ns(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh("ip", "netns", "exec", ns, *argv, check=check)


def as_member(ns: str, *argv: str) -> subprocess.CompletedProcess:
    """`argv` in namespace `ns` as on a real machine: `ip netns exec` mounts a fresh /sys, without the cgroup
    hierarchy, so it is mounted at /sys/fs/cgroup again (the testbed's nodes do the same)."""
    return sh(
        "ip",
        "netns",
        "exec",
        ns,
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount -t cgroup2 cgroup2 /sys/fs/cgroup && exec "$@"',
        "-",
        *argv,
    )


def with_host_mounts(ns: str, *argv: str) -> subprocess.CompletedProcess:
    """`argv` in namespace `ns`'s network but this host's mounts (its cgroup v2 hierarchy where the host has it)."""
    return sh("nsenter", f"--net=/run/netns/{ns}", *argv)


VIEWS = {"v2-at-sys-fs-cgroup": as_member, "host-mounts": with_host_mounts}


def connects(ns: str, ip: str, port: int) -> bool:
    code = (
        f"import socket\ntry:\n socket.create_connection(('{ip}', {port}), 1.5).close(); print('ok')\n"
        "except OSError:\n print('no')"
    )
    return in_ns(ns, sys.executable, "-c", code).stdout.strip() == "ok"


def echoes(ns: str, ip: str, port: int) -> bool:
    """Whether a UDP datagram to ip:port comes back (the listener echoes it)."""
    code = (
        "import socket\nu = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(1.0)\n"
        f"u.sendto(b'hi', ('{ip}', {port}))\ntry:\n print('ok' if u.recv(64) == b'hi' else 'no')\n"
        "except OSError:\n print('no')"
    )
    return in_ns(ns, sys.executable, "-c", code).stdout.strip() == "ok"


def tables(ns: str) -> str:
    return in_ns(ns, "nft", "list", "tables").stdout


def cleanup(ns: str, job: list[str], table: str) -> None:
    """Remove a guard as the module does, then make sure its cgroup is gone (host-wide: the namespace's
    deletion would take only the table). Quiet: it runs after failures too."""
    subprocess.run(
        ["nsenter", f"--net=/run/netns/{ns}", sys.executable, "-c", GUARD, "remove", *job],
        check=False,
        capture_output=True,
        timeout=30,
    )
    firewall.remove_job_cgroups([table])


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture
def lan():
    """Namespaces N (the member: bridge ov0 with 10.99.0.1 and 10.97.0.1), A (10.99.0.2), B (10.99.0.3, and
    10.97.0.3 for routed overlay-to-overlay traffic through N), and, behind N on lan0, L (10.98.0.2); N
    forwards, without ICMP redirects (a redirected A would bypass N). Removed afterwards whatever happened."""
    p = unique_prefix()
    names = {k: f"{p}-{k}" for k in ("n", "a", "b", "l")}
    try:
        for ns in names.values():
            sh("ip", "netns", "add", ns)
        n = names["n"]
        in_ns(n, "ip", "link", "add", "ov0", "type", "bridge")
        for i, peer in ((2, "a"), (3, "b")):
            sh(
                "ip",
                "link",
                "add",
                f"{p}{peer}0",
                "netns",
                n,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                names[peer],
            )
            in_ns(n, "ip", "link", "set", f"{p}{peer}0", "master", "ov0", "up")
            in_ns(names[peer], "ip", "addr", "add", f"10.99.0.{i}/24", "dev", "eth0")
            in_ns(names[peer], "ip", "link", "set", "eth0", "up")
            in_ns(names[peer], "ip", "route", "add", "10.98.0.0/24", "via", "10.99.0.1")
            in_ns(names[peer], "sysctl", "-q", "-w", "net.ipv4.conf.all.accept_redirects=0")
        in_ns(names["b"], "ip", "addr", "add", "10.97.0.3/24", "dev", "eth0")
        in_ns(names["a"], "ip", "route", "add", "10.97.0.0/24", "via", "10.99.0.1")
        in_ns(n, "ip", "addr", "add", "10.99.0.1/24", "dev", "ov0")
        in_ns(n, "ip", "addr", "add", "10.97.0.1/24", "dev", "ov0")
        in_ns(n, "ip", "link", "set", "ov0", "up")
        sh("ip", "link", "add", "lan0", "netns", n, "type", "veth", "peer", "name", "eth0", "netns", names["l"])
        in_ns(n, "ip", "addr", "add", "10.98.0.1/24", "dev", "lan0")
        in_ns(n, "ip", "link", "set", "lan0", "up")
        in_ns(names["l"], "ip", "addr", "add", "10.98.0.2/24", "dev", "eth0")
        in_ns(names["l"], "ip", "link", "set", "eth0", "up")
        in_ns(names["l"], "ip", "route", "add", "10.99.0.0/24", "via", "10.98.0.1")
        for ns in names.values():
            in_ns(ns, "ip", "link", "set", "lo", "up")
        for key in ("all.send_redirects=0", "ov0.send_redirects=0"):
            in_ns(n, "sysctl", "-q", "-w", f"net.ipv4.conf.{key}")
        in_ns(n, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        yield names
    finally:
        for ns in names.values():
            sh("ip", "netns", "del", ns, check=False)


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_a_job_guard_admits_only_the_jobs_nodes_and_leaves_everything_else(lan, view):
    run_in = VIEWS[view]
    n, a, b = lan["n"], lan["a"], lan["b"]
    job = [f"guard-test-{view}", "n1", "ov0"]
    table = rules.job_table(job[0], "n1")
    root = cgroup2_root()
    assert root is not None
    inside = subprocess.Popen(
        ["ip", "netns", "exec", n, sys.executable, "-c", LISTEN, "7000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    outside = subprocess.Popen(
        ["ip", "netns", "exec", n, sys.executable, "-c", LISTEN, "7001"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        run_in(n, sys.executable, "-c", GUARD, "create", *job, str(inside.pid), "10.99.0.2")
        for p in (inside, outside):  # the listeners open their sockets only now
            p.stdin.write("go\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "listening"
        assert (root / "meshrun" / table / "cgroup.procs").read_text().split() == [str(inside.pid)]
        assert table in tables(n)
        assert connects(a, "10.99.0.1", 7000) and echoes(a, "10.99.0.1", 7000)  # a node of the job
        assert not connects(b, "10.99.0.1", 7000) and not echoes(b, "10.99.0.1", 7000)  # not in the job
        assert connects(b, "10.99.0.1", 7001) and echoes(b, "10.99.0.1", 7001)  # the host's other services
        assert connects(n, "127.0.0.1", 7000)  # loopback: not the overlay
        run_in(n, sys.executable, "-c", GUARD, "allow", *job, "10.99.0.3")
        assert connects(b, "10.99.0.1", 7000) and echoes(b, "10.99.0.1", 7000)  # admitted once in the job
        stop(inside, outside)
        run_in(n, sys.executable, "-c", GUARD, "remove", *job)
        assert table not in tables(n)
        assert not (root / "meshrun" / table).exists()
    finally:
        stop(inside, outside)
        cleanup(n, job, table)


def test_sweep_removes_what_a_killed_job_left(lan):
    n = lan["n"]
    job = ["killed-job", "n1", "ov0"]
    table = rules.job_table("killed-job", "n1")
    sleeper = subprocess.Popen(["ip", "netns", "exec", n, "sleep", "60"])
    try:
        as_member(n, sys.executable, "-c", GUARD, "create", *job, str(sleeper.pid), "10.99.0.2")
        swept = as_member(
            n, sys.executable, "-c", "from meshrun.system.kernel.firewall import sweep; print(sweep())"
        ).stdout
        assert table not in swept  # its process still runs: kept
        stop(sleeper)
        time.sleep(0.2)
        swept = as_member(
            n, sys.executable, "-c", "from meshrun.system.kernel.firewall import sweep; print(sweep())"
        ).stdout
        assert table not in swept  # made a moment ago: its share may be about to join
        cg = cgroup2_root() / "meshrun" / table
        old = time.time() - firewall.FRESH_S - 5
        os.utime(cg, (old, old))  # as if made a while ago
        swept = as_member(
            n, sys.executable, "-c", "from meshrun.system.kernel.firewall import sweep; print(sweep())"
        ).stdout
        assert table in swept
        assert table not in tables(n)
        assert not (cgroup2_root() / "meshrun" / table).exists()
    finally:
        stop(sleeper)
        cleanup(n, job, table)


def test_the_forward_guard_keeps_member_traffic_on_the_overlay(lan):
    n, a, l_ns = lan["n"], lan["a"], lan["l"]

    def reaches(ip: str) -> bool:
        return in_ns(a, "ping", "-c", "1", "-W", "1", ip, check=False).returncode == 0

    try:
        # Negative controls: both paths really go through N's forwarding, and a plain router forwards both.
        in_ns(n, "sysctl", "-q", "-w", "net.ipv4.ip_forward=0")
        assert not reaches("10.98.0.2") and not reaches("10.97.0.3")
        in_ns(n, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        assert reaches("10.98.0.2") and reaches("10.97.0.3")

        def guard(*pairs: tuple[str, str]) -> None:
            code = f"from meshrun.system.kernel.firewall import install_forward_guard as g; g('ov0', {list(pairs)!r})"
            in_ns(n, sys.executable, "-c", code)

        guard()  # a member that relays nothing forwards nothing
        assert rules.FORWARD_TABLE in tables(n)
        assert not reaches("10.98.0.2")  # overlay -> the host's LAN: dropped
        assert not reaches("10.97.0.3")  # overlay -> overlay, for a pair it was not given: dropped
        guard(("10.99.0.3", "10.97.0.3"))  # another pair
        assert not reaches("10.97.0.3")
        guard(("10.97.0.3", "10.99.0.2"))  # A's pair with B: relayed here, both ways
        assert reaches("10.97.0.3")  # overlay -> overlay (a relayed pair): forwarded
        assert not reaches("10.98.0.2")
        assert in_ns(l_ns, "ping", "-c", "1", "-W", "1", "10.98.0.1").returncode == 0  # the host's own LAN works
        in_ns(n, sys.executable, "-c", "from meshrun.system.kernel.firewall import remove_forward_guard as g; g()")
        assert "meshrun" not in tables(n)
        assert reaches("10.98.0.2")
    finally:
        in_ns(n, "nft", "delete", "table", "inet", rules.FORWARD_TABLE, check=False)


def test_a_job_guard_holds_inside_a_container_with_its_own_cgroup_namespace(lan):
    """As in a privileged container on a cgroup v2 host (Docker's default: a private cgroup namespace rooted
    below the host's root): the job's cgroup is deeper than it looks from inside, and the guard still holds."""
    n, a, b = lan["n"], lan["a"], lan["b"]
    root = cgroup2_root()
    assert root is not None
    container = root / f"{unique_prefix()}-ctr"  # the container's cgroup, as the host sees it
    job = ["guard-test-container", "n1", "ov0"]
    table = rules.job_table(job[0], "n1")
    inside_job = container / "meshrun" / table

    def in_container(*argv: str) -> subprocess.CompletedProcess:
        """`argv` in N's network, moved into `container`, then in a cgroup namespace rooted there with the
        hierarchy mounted at /sys/fs/cgroup (what a container sees)."""
        script = (
            'echo $$ > "$0/cgroup.procs" && exec unshare -C -m --propagation private '
            'sh -c \'mount -t cgroup2 cgroup2 /sys/fs/cgroup && exec "$@"\' - "$@"'
        )
        return sh("nsenter", f"--net=/run/netns/{n}", "sh", "-c", script, str(container), *argv)

    listener = subprocess.Popen(
        ["ip", "netns", "exec", n, sys.executable, "-c", LISTEN, "7000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        container.mkdir()
        (container / "cgroup.procs").write_text(str(listener.pid))  # the job's process runs in the container
        v2_line = in_container("cat", "/proc/self/cgroup").stdout.splitlines()[-1]
        assert v2_line == "0::/"  # the namespace hides the depth
        in_container(sys.executable, "-c", GUARD, "create", *job, str(listener.pid), "10.99.0.2")
        listener.stdin.write("go\n")
        listener.stdin.flush()
        assert listener.stdout.readline().strip() == "listening"
        # Negative control: from the host the job's cgroup is at level 3, not the level 2 it is at in the container.
        assert (inside_job / "cgroup.procs").read_text().split() == [str(listener.pid)]
        assert len(inside_job.relative_to(root).parts) == 3
        assert connects(a, "10.99.0.1", 7000) and echoes(a, "10.99.0.1", 7000)  # a node of the job
        assert not connects(b, "10.99.0.1", 7000) and not echoes(b, "10.99.0.1", 7000)  # not in the job
        stop(listener)
        in_container(sys.executable, "-c", GUARD, "remove", *job)
        assert table not in tables(n) and not inside_job.exists()
    finally:
        stop(listener)
        in_ns(n, "nft", "delete", "table", "inet", table, check=False)
        for cg in (inside_job, inside_job.parent, container):
            with contextlib.suppress(OSError):
                cg.rmdir()
