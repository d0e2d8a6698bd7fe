"""meshrun.system.firewall in real network namespaces: a job guard admits only the job's nodes to the job's
sockets (and nothing else on the host changes), the forward guard keeps member traffic off other networks.

Plain namespaces joined by a bridge stand in for the overlay here (the guard keys on an interface name and
overlay addresses); tests/test_member_attacks_e2e.py runs the same guards under real jobs on WireGuard.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import unique_prefix
from meshrun.core import firewall as rules
from meshrun.system.firewall import cgroup2_root

pytestmark = [pytest.mark.netns]

LISTEN = """
import socket, sys
sys.stdin.readline()                      # wait until the test has put us in (or left us out of) the cgroup
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16)
print("listening", flush=True)
while True:
    c, _ = s.accept(); c.close()
"""
GUARD = """
import sys
from meshrun.system.firewall import JobGuard
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
    return sh("ip", "netns", "exec", ns, "unshare", "-m", "--propagation", "private", "sh", "-c",
              'mount -t cgroup2 cgroup2 /sys/fs/cgroup && exec "$@"', "-", *argv)


def connects(ns: str, ip: str, port: int) -> bool:
    code = f"import socket\ntry:\n socket.create_connection(('{ip}', {port}), 1.5).close(); print('ok')\nexcept OSError:\n print('no')"
    return in_ns(ns, sys.executable, "-c", code).stdout.strip() == "ok"


@pytest.fixture
def lan():
    """Namespaces N (the member, bridge ov0 10.99.0.1), A (10.99.0.2), B (10.99.0.3) and, behind N on lan0,
    L (10.98.0.2); removed afterwards whatever happened."""
    p = unique_prefix()
    names = {k: f"{p}-{k}" for k in ("n", "a", "b", "l")}
    try:
        for ns in names.values():
            sh("ip", "netns", "add", ns)
        n = names["n"]
        in_ns(n, "ip", "link", "add", "ov0", "type", "bridge")
        for i, peer in ((2, "a"), (3, "b")):
            sh("ip", "link", "add", f"{p}{peer}0", "netns", n, "type", "veth", "peer", "name", "eth0", "netns",
               names[peer])
            in_ns(n, "ip", "link", "set", f"{p}{peer}0", "master", "ov0", "up")
            in_ns(names[peer], "ip", "addr", "add", f"10.99.0.{i}/24", "dev", "eth0")
            in_ns(names[peer], "ip", "link", "set", "eth0", "up")
            in_ns(names[peer], "ip", "route", "add", "10.98.0.0/24", "via", "10.99.0.1")
        in_ns(n, "ip", "addr", "add", "10.99.0.1/24", "dev", "ov0")
        in_ns(n, "ip", "link", "set", "ov0", "up")
        sh("ip", "link", "add", "lan0", "netns", n, "type", "veth", "peer", "name", "eth0", "netns", names["l"])
        in_ns(n, "ip", "addr", "add", "10.98.0.1/24", "dev", "lan0")
        in_ns(n, "ip", "link", "set", "lan0", "up")
        in_ns(names["l"], "ip", "addr", "add", "10.98.0.2/24", "dev", "eth0")
        in_ns(names["l"], "ip", "link", "set", "eth0", "up")
        in_ns(names["l"], "ip", "route", "add", "10.99.0.0/24", "via", "10.98.0.1")
        for ns in names.values():
            in_ns(ns, "ip", "link", "set", "lo", "up")
        in_ns(n, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        yield names
    finally:
        for ns in names.values():
            sh("ip", "netns", "del", ns, check=False)


def test_a_job_guard_admits_only_the_jobs_nodes_and_leaves_everything_else(lan):
    n, a, b = lan["n"], lan["a"], lan["b"]
    job = ["guard-test", "n1", "ov0"]
    table = rules.job_table("guard-test", "n1")
    root = cgroup2_root()
    assert root is not None
    inside = subprocess.Popen(["ip", "netns", "exec", n, sys.executable, "-c", LISTEN, "7000"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    outside = subprocess.Popen(["ip", "netns", "exec", n, sys.executable, "-c", LISTEN, "7001"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        as_member(n, sys.executable, "-c", GUARD, "create", *job, str(inside.pid), "10.99.0.2")
        for p in (inside, outside):
            p.stdin.write("go\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "listening"
        assert (root / "meshrun" / table / "cgroup.procs").read_text().split() == [str(inside.pid)]
        assert connects(a, "10.99.0.1", 7000)               # a node of the job
        assert not connects(b, "10.99.0.1", 7000)           # a member that is not in the job
        assert connects(b, "10.99.0.1", 7001)               # the host's other services: untouched
        assert connects(n, "127.0.0.1", 7000)               # loopback: not the overlay
        as_member(n, sys.executable, "-c", GUARD, "allow", *job, "10.99.0.3")
        assert connects(b, "10.99.0.1", 7000)               # admitted once it joined the job
    finally:
        for p in (inside, outside):
            p.kill()
            p.wait()
    as_member(n, sys.executable, "-c", GUARD, "remove", *job)
    assert table not in in_ns(n, "nft", "list", "tables").stdout
    assert not (root / "meshrun" / table).exists()


def test_sweep_removes_what_a_killed_job_left(lan):
    n = lan["n"]
    sleeper = subprocess.Popen(["ip", "netns", "exec", n, "sleep", "60"])
    try:
        as_member(n, sys.executable, "-c", GUARD, "create", "killed-job", "n1", "ov0", str(sleeper.pid), "10.99.0.2")
        table = rules.job_table("killed-job", "n1")
        swept = as_member(n, sys.executable, "-c", "from meshrun.system.firewall import sweep; print(sweep())").stdout
        assert table not in swept                             # its process still runs: kept
    finally:
        sleeper.kill()
        sleeper.wait()
    time.sleep(0.2)
    swept = as_member(n, sys.executable, "-c", "from meshrun.system.firewall import sweep; print(sweep())").stdout
    assert table in swept
    assert table not in in_ns(n, "nft", "list", "tables").stdout
    assert not (cgroup2_root() / "meshrun" / table).exists()


def test_the_forward_guard_keeps_member_traffic_off_the_hosts_other_networks(lan):
    n, a, l_ns = lan["n"], lan["a"], lan["l"]

    def reaches() -> bool:
        return in_ns(a, "ping", "-c", "1", "-W", "1", "10.98.0.2", check=False).returncode == 0

    assert reaches()                                          # a plain router forwards it (the negative control)
    in_ns(n, sys.executable, "-c", "from meshrun.system.firewall import install_forward_guard as g; g('ov0')")
    assert not reaches()
    assert in_ns(l_ns, "ping", "-c", "1", "-W", "1", "10.98.0.1").returncode == 0   # the host's own LAN works
    in_ns(n, sys.executable, "-c", "from meshrun.system.firewall import remove_forward_guard as g; g()")
    assert rules.FORWARD_TABLE not in in_ns(n, "nft", "list", "tables").stdout
    assert reaches()
