"""The NAT'd multi-datacenter world in network namespaces, on one machine (demo + e2e tests).

Layout (see docs/ARCHITECTURE.md, "Testbed addressing"), for datacenter i (1-based):

    node ns <prefix>-<dc>-a (eth0 172.31.40.46/20)             ... one per node, each with an anchor process
        |  (datacenters with several nodes: a bridge in <prefix>-lan-<dc>, a same-VPC path)
    gateway ns <prefix>-gw-<dc>: lan0 172.31.32.1/20, wan0 198.51.100.(4i-3)/30, NAT in iptables
        |
    internet ns <prefix>-inet: to-<dc> 198.51.100.(4i-2)/30, routes 203.0.113.(10i+j)/32 via gateway i

Every veth is created directly inside its namespaces (never in the root namespace), so concurrent
worlds only need distinct prefixes. Each node has a long-lived *anchor* process holding a private mount
namespace with a tmpfs on /run/wireguard: wireguard-go's control socket lives there and /run is not
per network namespace. Every command for a node runs through ``nsenter -t ANCHOR -m -n``.

Every command this module runs goes through :func:`sh`, which logs it at debug level and raises
:class:`~meshrun.errors.NetworkError` naming the command and its stderr.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the lab runs its processes through meshrun.system
    import subprocess

from meshrun.core import firewall as rules
from meshrun.errors import MeshrunError, NetworkError, UsageError
from meshrun.system.files import statedir
from meshrun.system.kernel import firewall
from meshrun.system.machine import host, procs
from meshrun.system.machine.cmd import run as run_command
from meshrun.system.machine.cmd import tail

logger = logging.getLogger("meshrun.lab.testbed")

NAT_KINDS = ("one-to-one", "cone", "symmetric")
CGROUP_KINDS = ("v2", "v1")
PRIVATE_CIDR = "172.31.32.0/20"
PRIVATE_PREFIXLEN = 20
GATEWAY_PRIVATE_IP = "172.31.32.1"
FIRST_NODE_HOST = 46  # nodes are 172.31.40.46, .47, ... (as on AWS)
MAX_NODES_PER_DC = 9  # 203.0.113.(10i+j), j in 1..9
MAX_DCS = 24  # 203.0.113.(10i+j) <= 249
NODE_LETTERS = "abcdefghi"
RUN_WIREGUARD = Path("/run/wireguard")
_DC_NAME = re.compile(r"^[a-z][a-z0-9]{0,9}$")
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_RESERVED_DC_NAMES = {"gw", "lan", "inet"}
# What to do when a lab command fails, for the reader of the lab's errors (first match wins).
LAB_FIXES = (
    ("operation not permitted", "the testbed needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"),
    ("permission denied", "the testbed needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"),
    (
        "file exists",
        "a namespace or interface with that name exists; run `python -m meshrun.lab.testbed down --prefix P`",
    ),
)


def sh(
    argv: list[str],
    *,
    input: str | None = None,
    timeout: float = 30,
    check: bool = True,
    env: dict[str, str] | None = None,
    where: str = "",
) -> subprocess.CompletedProcess:
    """Run one lab command through meshrun.system.machine.cmd.run, with the lab's fixes.

    Raises NetworkError (CommandError) naming the command, where it ran, its exit code and stderr.
    """
    return run_command(argv, input=input, timeout=timeout, check=check, env=env, where=where, fixes=LAB_FIXES)


@dataclass(frozen=True)
class DatacenterSpec:
    """One datacenter: a gateway doing ``nat`` in front of ``nodes`` machines on 172.31.32.0/20."""

    name: str  # short: it goes into namespace and interface names
    nat: str = "one-to-one"  # "one-to-one" | "cone" | "symmetric"
    nodes: int = 1
    mtu: int = 1500  # MTU of the gateway's internet link (a small-MTU underlay hop)
    lan_mtu: int = 1500  # MTU of the datacenter's private network (9000: a LAN with jumbo frames)
    rate_mbit: int | None = None  # shaping of the gateway's internet link, both directions
    delay_ms: float = 0.0  # netem delay on the internet link, each direction (a WAN's latency)
    loss_pct: float = 0.0  # netem loss on the internet link, each direction
    node_rate_mbit: int | None = None  # each node's own share of the internet link, both directions (a cloud
    # VM's allowance); one-to-one NAT only (a node is told apart by its public address)
    cgroup: str = "v2"  # "v1": the nodes see cgroup v1 only (RHEL 8, many Slurm clusters; see _cgroup_mounts)

    @property
    def netem(self) -> bool:
        """Delay or loss asked for: the link needs netem (a kernel with sch_netem, e.g. the test VM)."""
        return self.delay_ms > 0 or self.loss_pct > 0

    def validate(self) -> None:
        """Raise UsageError for a name, NAT kind, node count, MTU or rate the testbed cannot build."""
        if not _DC_NAME.match(self.name) or self.name in _RESERVED_DC_NAMES:
            raise UsageError(
                f"datacenter name {self.name!r} is not usable in the testbed",
                "use 1-10 lowercase letters/digits starting with a letter, not gw/lan/inet",
            )
        if self.nat not in NAT_KINDS:
            raise UsageError(
                f"datacenter {self.name}: NAT kind {self.nat!r} is unknown", f"use one of {', '.join(NAT_KINDS)}"
            )
        if not 1 <= self.nodes <= MAX_NODES_PER_DC:
            raise UsageError(
                f"datacenter {self.name}: {self.nodes} nodes is out of range",
                f"use 1 to {MAX_NODES_PER_DC} nodes per datacenter",
            )
        if not 576 <= self.mtu <= 9000:
            raise UsageError(f"datacenter {self.name}: MTU {self.mtu} is out of range", "use 576 to 9000")
        if not 576 <= self.lan_mtu <= 9000:
            raise UsageError(f"datacenter {self.name}: LAN MTU {self.lan_mtu} is out of range", "use 576 to 9000")
        if self.cgroup not in CGROUP_KINDS:
            raise UsageError(f"datacenter {self.name}: cgroup {self.cgroup!r} is unknown", "use 'v2' or 'v1'")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise UsageError(
                f"datacenter {self.name}: rate {self.rate_mbit} Mbit/s must be positive",
                "give a positive rate or None for no shaping",
            )
        if self.node_rate_mbit is not None:
            if self.node_rate_mbit <= 0:
                raise UsageError(
                    f"datacenter {self.name}: node rate {self.node_rate_mbit} Mbit/s must be positive",
                    "give a positive rate or None for no per-node shaping",
                )
            if self.nat != "one-to-one" or self.rate_mbit is not None or self.netem:
                raise UsageError(
                    f"datacenter {self.name}: per-node shaping needs one-to-one NAT and no link rate, delay or loss",
                    "use nat='one-to-one' and leave rate_mbit, delay_ms and loss_pct unset",
                )
        if not 0 <= self.delay_ms <= 10_000:
            raise UsageError(f"datacenter {self.name}: delay {self.delay_ms} ms is out of range", "use 0 to 10000 ms")
        if not 0 <= self.loss_pct < 100:
            raise UsageError(
                f"datacenter {self.name}: loss {self.loss_pct}% is out of range", "use 0 to below 100 percent"
            )


def _wan_qdisc(dc: DatacenterSpec) -> list[str]:
    """The tc qdisc (kind and parameters) of a datacenter's internet link, each direction; [] for none.

    Delay or loss need netem, which then also does the rate limiting; rate alone is a tbf, which every
    kernel has (this project's hosts have no netem: only the test VM's Debian kernel does).
    """
    if dc.netem:
        qdisc = [
            "netem",
            "delay",
            f"{dc.delay_ms:g}ms",
            "loss",
            f"{dc.loss_pct:g}%",
            "limit",
            "10000",
        ]  # a WAN queue: netem's default of 1000 packets drops bursts at 100 ms
        return qdisc + (["rate", f"{dc.rate_mbit}mbit"] if dc.rate_mbit else [])
    if dc.rate_mbit:
        return ["tbf", "rate", f"{dc.rate_mbit}mbit", "burst", "256kb", "latency", "50ms"]
    return []


def _node_uplinks(dev: str, rate_mbit: int, public_ips: list[str], way: str) -> list[list[str]]:
    """`tc` commands giving each node `rate_mbit` of `dev` (an HTB class per node, matched by its public
    address as `way`: "src" leaving the datacenter, "dst" entering it); other traffic is not shaped.

    Each class queues at most 50 ms at its rate (a bfifo), as the whole-link tbf does.
    """
    limit = max(rate_mbit * 1_000_000 // 8 // 20, 16 * 1500)
    cmds = [
        ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"],
        ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit"],
    ]
    for i, ip in enumerate(public_ips, start=16):  # class ids are hex: 1:10, 1:11, ...
        cls = f"1:{i:x}"
        cmds += [
            ["class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb", "rate", f"{rate_mbit}mbit"],
            ["qdisc", "add", "dev", dev, "parent", cls, "bfifo", "limit", str(limit)],
            ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "u32", "match", "ip", way, f"{ip}/32"]
            + ["flowid", cls],
        ]
    return cmds


@dataclass
class Node:
    """A simulated machine: its own network namespace plus a mount namespace held by ``anchor_pid``."""

    name: str
    dc: str
    netns: str
    private_ip: str
    public_ip: str | None
    anchor_pid: int
    workdir: Path
    nat: str = "one-to-one"

    def argv(self, *cmd: str, cwd: str | os.PathLike | None = None) -> list[str]:
        """The argv running ``cmd`` inside this node (network and mount namespace of its anchor).

        nsenter resets the working directory to / when it enters the mount namespace; ``cwd`` keeps one.
        """
        wd = [f"--wd={os.fspath(cwd)}"] if cwd is not None else []
        return ["nsenter", "-t", str(self.anchor_pid), "-m", "-n", *wd, "--", *map(str, cmd)]

    def run(
        self,
        *cmd: str,
        check: bool = True,
        timeout: float = 60,
        env: dict[str, str] | None = None,
        input: str | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> subprocess.CompletedProcess:
        """Run ``cmd`` in this node and wait (text mode, output captured).

        ``env`` holds extra variables, merged over os.environ. With ``check``, a non-zero exit raises
        CommandError (a NetworkError) whose message includes stderr and stdout.
        """
        return sh(
            self.argv(*cmd, cwd=cwd), input=input, timeout=timeout, check=check, env=_merge_env(env), where=self.name
        )

    def popen(self, *cmd: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start ``cmd`` in this node; ``kw`` goes to subprocess.Popen, ``env`` is merged over os.environ.

        The process is found and killed by World.down() even if the caller forgets it.
        """
        argv = self.argv(*cmd, cwd=kw.get("cwd"))
        logger.debug("start [%s]: %s", self.name, " ".join(argv))
        return procs.popen(argv, env=_merge_env(env), **kw)

    def cut_uplink(self, restore: bool = False) -> None:
        """This machine loses its uplink (everything in and out of its one interface dropped), or gets it back.

        Not `ip link set down`: that also takes the default route, which `up` does not bring back. Arrivals are
        dropped in the interface's ingress hook, ahead of everything: a relay's kernel fast path forwards from
        there, never reaching INPUT."""
        if restore:
            self.run("nft", "delete", "table", "netdev", "testcut", check=False)
            self.run("iptables", "-D", "OUTPUT", "-o", "eth0", "-j", "DROP", check=False)
            return
        self.run(
            "nft",
            "add table netdev testcut; add chain netdev testcut in "
            "{ type filter hook ingress device eth0 priority -500; policy drop; }",
        )
        self.run("iptables", "-I", "OUTPUT", "-o", "eth0", "-j", "DROP")


def _merge_env(env: dict[str, str] | None) -> dict[str, str] | None:
    return None if env is None else {**os.environ, **{k: str(v) for k, v in env.items()}}


@dataclass
class _Gateway:
    dc: DatacenterSpec
    index: int
    netns: str
    lan_netns: str | None
    public_ip: str  # gateway side of the /30
    inet_ip: str  # internet side of the /30
    inet_ifname: str
    nodes: list[Node] = field(default_factory=list)


_live_worlds: weakref.WeakSet[World] = weakref.WeakSet()


@atexit.register
def _down_live_worlds() -> None:  # a crashed script still tears its worlds down
    for world in list(_live_worlds):
        world.down()


class World:
    """A set of NAT'd datacenters joined by an "internet" namespace; use as a context manager.

    ``with World.standard(3) as w:`` builds dc1..dc3 (one node each, 1:1 NAT) and tears everything down
    on exit, also on exceptions and Ctrl-C.
    """

    def __init__(
        self,
        dcs: list[DatacenterSpec],
        prefix: str = "mr",
        workdir: Path | None = None,
        log: logging.Logger | Callable[[str], None] | None = None,
    ) -> None:
        if not _PREFIX.match(prefix):
            raise UsageError(
                f"testbed prefix {prefix!r} is not usable", "use 1-8 lowercase letters/digits starting with a letter"
            )
        if not dcs:
            raise UsageError("a testbed needs at least one datacenter", "pass one DatacenterSpec or more")
        if len(dcs) > MAX_DCS:
            raise UsageError(f"{len(dcs)} datacenters is too many", f"use at most {MAX_DCS}")
        for dc in dcs:
            dc.validate()
        names = [dc.name for dc in dcs]
        if len(set(names)) != len(names):
            raise UsageError(f"datacenter names repeat: {', '.join(names)}", "give each datacenter its own name")
        self.dcs = list(dcs)
        self.prefix = prefix
        self.inet = f"{prefix}-inet"
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else None
        self._log = log
        self._gateways: dict[str, _Gateway] = {}
        self.nodes: list[Node] = []
        self._anchors: dict[int, subprocess.Popen] = {}
        self._created: list[str] = []  # namespaces, in creation order
        self._up = False
        self._plan()

    @classmethod
    def standard(cls, n: int, prefix: str = "mr", **kw) -> World:
        """n datacenters dc1..dcN, each one node behind 1:1 NAT."""
        return cls([DatacenterSpec(f"dc{i}") for i in range(1, n + 1)], prefix=prefix, **kw)

    # ----- names and addresses (pure) -----

    def _plan(self) -> None:
        base = self.workdir or Path("/nonexistent")
        for i, dc in enumerate(self.dcs, start=1):
            gw = _Gateway(
                dc=dc,
                index=i,
                netns=f"{self.prefix}-gw-{dc.name}",
                lan_netns=f"{self.prefix}-lan-{dc.name}" if dc.nodes > 1 else None,
                public_ip=f"198.51.100.{4 * i - 3}",
                inet_ip=f"198.51.100.{4 * i - 2}",
                inet_ifname=f"to-{dc.name}",
            )
            for j in range(1, dc.nodes + 1):
                name = f"{dc.name}-{NODE_LETTERS[j - 1]}"
                public = f"203.0.113.{10 * i + j}" if dc.nat == "one-to-one" else gw.public_ip
                gw.nodes.append(
                    Node(
                        name=name,
                        dc=dc.name,
                        netns=f"{self.prefix}-{name}",
                        private_ip=f"172.31.40.{FIRST_NODE_HOST + j - 1}",
                        public_ip=public,
                        anchor_pid=0,
                        workdir=base / name,
                        nat=dc.nat,
                    )
                )
            self._gateways[dc.name] = gw
            self.nodes.extend(gw.nodes)

    @property
    def gateways(self) -> dict[str, str]:
        """Gateway namespace per datacenter name."""
        return {name: gw.netns for name, gw in self._gateways.items()}

    @property
    def lans(self) -> dict[str, str]:
        """Bridge ("same VPC") namespace per datacenter that has several nodes."""
        return {name: gw.lan_netns for name, gw in self._gateways.items() if gw.lan_netns}

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this world, internet first."""
        out = [self.inet]
        for gw in self._gateways.values():
            out.append(gw.netns)
            if gw.lan_netns:
                out.append(gw.lan_netns)
            out.extend(n.netns for n in gw.nodes)
        return out

    def node(self, name: str) -> Node:
        """The node called ``name`` (e.g. "dc2-a")."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise UsageError(f"the testbed has no node {name!r}", f"use one of {', '.join(n.name for n in self.nodes)}")

    def gateway_public_ip(self, dc: str) -> str:
        """The gateway's own public address (shared by the nodes of a cone/symmetric datacenter)."""
        return self._gw(dc).public_ip

    def _gw(self, dc: str) -> _Gateway:
        try:
            return self._gateways[dc]
        except KeyError:
            raise UsageError(
                f"the testbed has no datacenter {dc!r}", f"use one of {', '.join(self._gateways)}"
            ) from None

    def describe(self) -> str:
        """A multi-line human-readable summary: per datacenter its gateway, per node its addresses."""
        lines = [f"testbed {self.prefix!r}: {len(self.dcs)} datacenter(s), internet namespace {self.inet}"]
        for gw in self._gateways.values():
            dc = gw.dc
            extra = [f"mtu {dc.mtu}"] + ([f"{dc.rate_mbit} Mbit/s"] if dc.rate_mbit else [])
            extra += [f"{dc.node_rate_mbit} Mbit/s per node"] if dc.node_rate_mbit else []
            lines.append(f"  {dc.name}: {dc.nat} NAT, gateway {gw.netns} public {gw.public_ip}, {', '.join(extra)}")
            for n in gw.nodes:
                lines.append(
                    f"    {n.name:<10} private {n.private_ip:<14} public {n.public_ip:<14} "
                    f"nat {n.nat:<10} netns {n.netns}"
                )
        return "\n".join(lines)

    # ----- building -----

    def _say(self, msg: str) -> None:
        if isinstance(self._log, logging.Logger):
            self._log.info(msg)
        elif callable(self._log):
            self._log(msg)
        else:
            logger.info(msg)

    def up(self) -> World:
        """Build the world; on any failure tear down what was built and raise NetworkError."""
        if self._up:
            return self
        t0 = time.monotonic()
        _live_worlds.add(self)
        try:
            remove_stale(self.prefix)
            if self._own_workdir:
                self.workdir = statedir.make_temp_dir(f"meshrun-testbed-{self.prefix}-")
            assert self.workdir is not None
            for n in self.nodes:
                n.workdir = self.workdir / n.name
                statedir.make_dir(n.workdir)
            self._build()
        except BaseException as exc:
            self.down()
            if isinstance(exc, NetworkError) or not isinstance(exc, Exception):
                raise
            raise NetworkError(
                f"building testbed {self.prefix!r} failed: {exc!r}",
                "see the debug log (logger meshrun.lab.testbed) for the commands run",
            ) from exc
        self._up = True
        self._say(f"testbed {self.prefix!r} up in {time.monotonic() - t0:.1f} s")
        return self

    def _netns_add(self, name: str) -> None:
        sh(["ip", "netns", "add", name])
        self._created.append(name)
        # No IPv6 on the links we add (lo keeps ::1): no router solicitations or MLD noise in counters.
        sh(["ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"])
        sh(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        statedir.make_dir(RUN_WIREGUARD)
        inet = self.inet
        self._netns_add(inet)
        sh(["ip", "netns", "exec", inet, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        for gw in self._gateways.values():
            self._build_dc(gw)
        # Anchors: start them all, then wait for all (they are independent).
        pending = []
        for n in self.nodes:
            pending.append((n, self._start_anchor(n)))
        for n, proc in pending:
            self._wait_anchor(n, proc)

    def _build_dc(self, gw: _Gateway) -> None:
        dc, g, inet = gw.dc, gw.netns, self.inet
        self._say(f"building {dc.name} ({dc.nat} NAT, {dc.nodes} node(s))")
        self._netns_add(g)
        for key in (
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.send_redirects=0",
            "net.ipv4.conf.default.send_redirects=0",
        ):
            sh(["ip", "netns", "exec", g, "sysctl", "-qw", key])
        # Internet link: wan0 (gateway) <-> to-<dc> (internet), created in place.
        sh(
            [
                "ip",
                "-n",
                g,
                "link",
                "add",
                "wan0",
                "mtu",
                str(dc.mtu),
                "type",
                "veth",
                "peer",
                "name",
                gw.inet_ifname,
                "mtu",
                str(dc.mtu),
                "netns",
                inet,
            ]
        )
        sh(["ip", "-n", g, "addr", "add", f"{gw.public_ip}/30", "dev", "wan0"])
        sh(["ip", "-n", inet, "addr", "add", f"{gw.inet_ip}/30", "dev", gw.inet_ifname])
        sh(["ip", "-n", g, "link", "set", "wan0", "up"])
        sh(["ip", "-n", inet, "link", "set", gw.inet_ifname, "up"])
        sh(["ip", "-n", g, "route", "add", "default", "via", gw.inet_ip])
        for ns, dev in ((g, "wan0"), (inet, gw.inet_ifname)):
            qdisc = _wan_qdisc(dc)
            if qdisc:
                sh(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *qdisc])
        if dc.node_rate_mbit:
            ips = [str(n.public_ip) for n in gw.nodes]
            for ns, dev, way in ((g, "wan0", "src"), (inet, gw.inet_ifname, "dst")):
                for cmd in _node_uplinks(dev, dc.node_rate_mbit, ips, way):
                    sh(["ip", "netns", "exec", ns, "tc", *cmd])
        # Private side: lan0 172.31.32.1/20, straight to the node or to a bridge in the lan namespace.
        if gw.lan_netns:
            lan = gw.lan_netns
            self._netns_add(lan)
            sh(["ip", "-n", lan, "link", "add", "br0", "type", "bridge"])
            sh(["ip", "-n", g, "link", "add", "lan0", "type", "veth", "peer", "name", "gw0", "netns", lan])
            sh(["ip", "-n", lan, "link", "set", "gw0", "master", "br0"])
            sh(["ip", "-n", lan, "link", "set", "gw0", "up"])
            sh(["ip", "-n", lan, "link", "set", "br0", "up"])
        for n in gw.nodes:
            self._netns_add(n.netns)
            if gw.lan_netns:
                port = f"p-{n.name}"
                sh(
                    [
                        "ip",
                        "-n",
                        gw.lan_netns,
                        "link",
                        "add",
                        port,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        "eth0",
                        "netns",
                        n.netns,
                    ]
                )
                sh(["ip", "-n", gw.lan_netns, "link", "set", port, "master", "br0"])
                sh(["ip", "-n", gw.lan_netns, "link", "set", port, "up"])
            else:
                sh(["ip", "-n", g, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", n.netns])
            sh(["ip", "-n", n.netns, "addr", "add", f"{n.private_ip}/{PRIVATE_PREFIXLEN}", "dev", "eth0"])
            sh(["ip", "-n", n.netns, "link", "set", "eth0", "up"])
            sh(["ip", "-n", n.netns, "route", "add", "default", "via", GATEWAY_PRIVATE_IP])
        if dc.lan_mtu != 1500:  # every link of the private network (a bridge takes its ports' smallest)
            links = [(g, "lan0")] + [(n.netns, "eth0") for n in gw.nodes]
            if gw.lan_netns:
                links += [(gw.lan_netns, "gw0")] + [(gw.lan_netns, f"p-{n.name}") for n in gw.nodes]
            for ns, dev in links:
                sh(["ip", "-n", ns, "link", "set", dev, "mtu", str(dc.lan_mtu)])
        sh(["ip", "-n", g, "addr", "add", f"{GATEWAY_PRIVATE_IP}/{PRIVATE_PREFIXLEN}", "dev", "lan0"])
        sh(["ip", "-n", g, "link", "set", "lan0", "up"])
        # Counting rules (no target): forwarded packets leaving and entering the datacenter.
        ipt = ["ip", "netns", "exec", g, "iptables", "-w"]
        sh(ipt + ["-A", "FORWARD", "-i", "lan0", "-m", "comment", "--comment", "meshrun-out"])
        sh(ipt + ["-A", "FORWARD", "-o", "lan0", "-m", "comment", "--comment", "meshrun-in"])
        if dc.nat == "one-to-one":
            inet_ip = gw.public_ip
            for n in gw.nodes:
                assert n.public_ip is not None
                sh(
                    ipt
                    + [
                        "-t",
                        "nat",
                        "-A",
                        "PREROUTING",
                        "-d",
                        n.public_ip,
                        "-j",
                        "DNAT",
                        "--to-destination",
                        n.private_ip,
                    ]
                )
                # Source port kept (no --random): what a cloud's elastic IP does.
                sh(
                    ipt
                    + [
                        "-t",
                        "nat",
                        "-A",
                        "POSTROUTING",
                        "-s",
                        n.private_ip,
                        "-o",
                        "wan0",
                        "-j",
                        "SNAT",
                        "--to-source",
                        n.public_ip,
                    ]
                )
                # Hairpin: a node reaching a same-DC node's public IP is seen from its own public IP.
                sh(
                    ipt
                    + [
                        "-t",
                        "nat",
                        "-A",
                        "POSTROUTING",
                        "-s",
                        n.private_ip,
                        "-o",
                        "lan0",
                        "-m",
                        "conntrack",
                        "--ctstate",
                        "DNAT",
                        "-j",
                        "SNAT",
                        "--to-source",
                        n.public_ip,
                    ]
                )
                sh(["ip", "-n", inet, "route", "add", f"{n.public_ip}/32", "via", inet_ip])
        else:
            masq = ["-t", "nat", "-A", "POSTROUTING", "-s", PRIVATE_CIDR, "-o", "wan0", "-j", "MASQUERADE"]
            sh(ipt + masq + (["--random-fully"] if dc.nat == "symmetric" else []))

    def _start_anchor(self, n: Node) -> subprocess.Popen:
        # `ip netns exec`, `unshare` (no --fork) and `sh -c 'exec ...'` all exec: the pid is the anchor's.
        # `ip netns exec` mounts a fresh /sys without the cgroup hierarchy: the node gets the (one, shared)
        # cgroup v2 hierarchy at /sys/fs/cgroup again, as a real machine has it (meshrun's job guards use it),
        # or, in a cgroup-v1 datacenter, the v1 hierarchies only (_cgroup_mounts).
        cgroups = (
            _cgroup_mounts()
            if next(d for d in self.dcs if d.name == n.dc).cgroup == "v1"
            else ("{ mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null || true; }")
        )
        # A node's DNS: the host's resolv.conf names a server the world's internet cannot reach, so every
        # lookup waited out the resolver's 5 s timeout, and torch's c10d reverse-resolves each store connection's
        # own address (a warning, after 5 s: +5 s on every rank's start, most of a small job's 10 s). A node
        # gets the resolver of a machine with no DNS server instead (127.0.0.1, refused at once), as fast as a
        # cloud resolver's NXDOMAIN; docs/troubleshooting.md names the slow case for real machines. A host
        # whose /etc/resolv.conf cannot be covered (none, a dangling link) keeps it: slower, not broken.
        resolv = n.workdir / "resolv.conf"
        dns = f"{{ printf 'nameserver 127.0.0.1\\n' > {resolv} && mount --bind {resolv} /etc/resolv.conf || true; }}"
        argv = [
            "ip",
            "netns",
            "exec",
            n.netns,
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"mount -t tmpfs tmpfs {RUN_WIREGUARD} && {dns} && {cgroups} && exec sleep infinity",
        ]
        logger.debug("start anchor [%s]: %s", n.name, " ".join(argv))
        try:
            # Own session: a Ctrl-C in the terminal must not kill the anchors before down() runs.
            proc = procs.popen(
                argv, stdin=procs.DEVNULL, stdout=procs.DEVNULL, stderr=procs.PIPE, text=True, start_new_session=True
            )
        except FileNotFoundError:
            raise NetworkError("`ip` is not installed", "install it: apt-get install iproute2") from None
        self._anchors[proc.pid] = proc
        n.anchor_pid = proc.pid
        return proc

    def _wait_anchor(self, n: Node, proc: subprocess.Popen, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = proc.stderr.read() if proc.stderr else ""
                raise NetworkError(
                    f"the anchor process of node {n.name} (`{' '.join(proc.args)}`) exited with "
                    f"code {proc.returncode} (stderr: {tail(err) or '-'})",
                    "the testbed needs root and a kernel with mount namespaces and tmpfs",
                )
            # comm turns to "sleep" only after the tmpfs mount succeeded (`&&`).
            if procs.comm(proc.pid) == "sleep":
                return
            time.sleep(0.01)
        raise NetworkError(
            f"the anchor process of node {n.name} did not start within {timeout:g} s",
            "check the machine's load and `ip netns list`",
        )

    # ----- observing -----

    def gateway_counters(self, dc: str) -> dict[str, int]:
        """Traffic forwarded by ``dc``'s gateway, to show that traffic did or did not cross it.

        Keys: forward_out_packets/bytes (LAN -> internet), forward_in_packets/bytes (internet -> LAN),
        forward_packets/bytes (both), and lan_{rx,tx}_{packets,bytes} of the gateway's private-side veth.
        """
        gw = self._gw(dc)
        out = sh(["ip", "netns", "exec", gw.netns, "iptables", "-w", "-nvxL", "FORWARD"]).stdout
        counts: dict[str, int] = {}
        for line in out.splitlines():
            m = re.match(r"\s*(\d+)\s+(\d+)\s.*/\* meshrun-(out|in) \*/", line)
            if m:
                counts[f"forward_{m.group(3)}_packets"] = int(m.group(1))
                counts[f"forward_{m.group(3)}_bytes"] = int(m.group(2))
        if len(counts) != 4:
            raise NetworkError(f"the counting rules in {gw.netns}'s FORWARD chain are missing", "rebuild the testbed")
        counts["forward_packets"] = counts["forward_out_packets"] + counts["forward_in_packets"]
        counts["forward_bytes"] = counts["forward_out_bytes"] + counts["forward_in_bytes"]
        link = json.loads(sh(["ip", "-n", gw.netns, "-s", "-j", "link", "show", "lan0"]).stdout)[0]
        stats = link.get("stats64") or link.get("stats") or {}
        for way in ("rx", "tx"):
            counts[f"lan_{way}_packets"] = int(stats.get(way, {}).get("packets", 0))
            counts[f"lan_{way}_bytes"] = int(stats.get(way, {}).get("bytes", 0))
        return counts

    # ----- losing a machine -----

    def lose(self, name: str) -> float:
        """Node `name`'s machine is gone, as a preempted VM or a dead host is: every process in it is killed at
        once (SIGKILL, no chance to say goodbye) and its namespace deleted, so its gateway's LAN has nobody
        there. Returns the monotonic time of the loss. The node stays in `nodes`; nothing of it answers."""
        n = self.node(name)
        pids, at = _kill_now([p for p in _pids_in(n.netns) if p != os.getpid()])
        proc = self._anchors.pop(n.anchor_pid, None)
        if proc is not None:
            _reap(proc)
        _remove_job_cgroups([n.netns])  # host-wide: they would outlive the namespace that names them
        sh(["ip", "netns", "del", n.netns], check=False)
        self._say(f"lost {name}: {len(pids)} process(es) killed, namespace {n.netns} deleted")
        return at

    def power_off(self, name: str) -> float:
        """Node `name`'s machine goes down with its disk kept, as a VM stopped by its provider: every process in
        it but its anchor is killed at once (SIGKILL), /run/wireguard emptied (a reboot empties /run) and its
        uplink cut until `power_on`. Returns the monotonic time it went down. Its state directory stays."""
        n = self.node(name)
        n.cut_uplink()
        pids, at = _kill_now([p for p in _pids_in(n.netns) if p not in (os.getpid(), n.anchor_pid)])
        n.run("find", str(RUN_WIREGUARD), "-mindepth", "1", "-delete", check=False)
        self._say(f"powered off {name}: {len(pids)} process(es) killed, uplink cut")
        return at

    def power_on(self, name: str) -> None:
        """Node `name`'s machine is up again after `power_off`, its uplink back, nothing of meshrun started (the
        caller starts what a boot would)."""
        self.node(name).cut_uplink(restore=True)
        self._say(f"powered on {name}")

    # ----- tearing down -----

    def detach(self) -> None:
        """Leave the world running when this process exits (for `python -m meshrun.lab.testbed up`)."""
        _live_worlds.discard(self)
        for proc in self._anchors.values():
            if proc.stderr:
                proc.stderr.close()
        self._anchors.clear()

    def down(self) -> None:
        """Tear everything down: processes in our namespaces, anchors, namespaces, our workdir. Idempotent.

        A Ctrl-C during teardown is held back until the teardown is complete, then re-raised.
        """
        interrupted = []
        restore = None
        if threading.current_thread() is threading.main_thread():
            try:
                restore = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
            except ValueError:
                restore = None
        try:
            names = list(dict.fromkeys(self._created[::-1] + _stale_names(self.prefix)))
            _teardown(names, extra_pids=list(self._anchors))
            for proc in self._anchors.values():
                _reap(proc)
            self._anchors.clear()
            self._created.clear()
            if self._own_workdir and self.workdir is not None:
                statedir.remove_tree(self.workdir)
                self.workdir = None
            self._up = False
            _live_worlds.discard(self)
        finally:
            if restore is not None:
                signal.signal(signal.SIGINT, restore)
        if interrupted:
            raise KeyboardInterrupt

    def __enter__(self) -> World:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=2)
    except procs.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=2)
    if proc.stderr:
        proc.stderr.close()


V1_CONTROLLERS = ("cpu", "memory", "pids")
V1_NAMED = "meshrun-lab"  # a controller-less v1 hierarchy, so a node has one even where no controller is free


def _cgroup_mounts(proc_cgroups: str | None = None) -> str:
    """The shell that gives a cgroup-v1 node what such a host has: a tmpfs at /sys/fs/cgroup with v1 hierarchies
    in it, and no cgroup v2 anywhere. Only controllers the host already has in a v1 hierarchy are mounted
    (/proc/cgroups: hierarchy id > 0; mounting a controller that is on the v2 hierarchy would move it there
    for the whole machine), plus a named one without controllers."""
    if proc_cgroups is None:
        proc_cgroups = host.proc_cgroups()
    in_v1 = {
        p[0]
        for p in (line.split() for line in proc_cgroups.splitlines())
        if len(p) >= 4 and p[1].isdigit() and p[1] != "0"
    }
    steps = ["mount -t tmpfs cgroup /sys/fs/cgroup"]
    for c in [c for c in V1_CONTROLLERS if c in in_v1]:
        steps.append(f"mkdir /sys/fs/cgroup/{c} && mount -t cgroup -o {c} cgroup /sys/fs/cgroup/{c}")
    steps.append(f"mkdir /sys/fs/cgroup/lab && mount -t cgroup -o none,name={V1_NAMED} cgroup /sys/fs/cgroup/lab")
    return " && ".join(steps)


def _list_netns() -> list[str]:
    res = sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _stale_names(prefix: str) -> list[str]:
    """Our namespaces for ``prefix`` that exist now: only names that fit our exact naming scheme."""
    pat = re.compile(
        rf"^{re.escape(prefix)}-(inet|gw-[a-z][a-z0-9]{{0,9}}|lan-[a-z][a-z0-9]{{0,9}}"
        rf"|[a-z][a-z0-9]{{0,9}}-[{NODE_LETTERS}])$"
    )
    return [name for name in _list_netns() if pat.match(name)]


def _kill_now(pids: list[int]) -> tuple[list[int], float]:
    """SIGKILL every one of `pids` at once, as a machine that dies; (the pids, the monotonic time of the
    kill), after waiting up to 5 s for them to be gone."""
    for p in pids:
        procs.signal_pid(p, signal.SIGKILL)
    at = time.monotonic()
    deadline = at + 5
    while time.monotonic() < deadline and any(procs.alive(p) for p in pids):
        time.sleep(0.02)
    return pids, at


def _pids_in(netns: str) -> list[int]:
    res = sh(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def _teardown(names: Iterable[str], extra_pids: Iterable[int] = (), grace: float = 2.0) -> None:
    """Kill every process in ``names`` (SIGTERM, then SIGKILL), plus ``extra_pids``; delete the namespaces."""
    names = list(names)
    existing = set(_list_netns())
    names = [n for n in names if n in existing]
    extra = [p for p in extra_pids if procs.alive(p)]
    for round_ in range(3):  # processes may fork while we kill: look again
        pids = sorted({p for n in names for p in _pids_in(n)} | set(extra))
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            break
        logger.debug("teardown: SIGTERM %s", pids)
        for p in pids:
            procs.signal_pid(p, signal.SIGTERM)
        deadline = time.monotonic() + (grace if round_ == 0 else 0.5)
        while time.monotonic() < deadline and any(procs.alive(p) for p in pids):
            time.sleep(0.02)
        left = [p for p in pids if procs.alive(p)]
        if left:
            logger.debug("teardown: SIGKILL %s", left)
            for p in left:
                procs.signal_pid(p, signal.SIGKILL)
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and any(procs.alive(p) for p in left):
                time.sleep(0.02)
        extra = []
    _remove_job_cgroups(names)
    errors = []
    for n in names:
        res = sh(["ip", "netns", "del", n], check=False)
        if res.returncode != 0 and n in _list_netns():
            errors.append(f"{n}: {res.stderr.strip()}")
    if errors:
        raise NetworkError(
            f"could not delete namespace(s) {'; '.join(errors)}", "delete them by hand with `ip netns del NAME`"
        )


def _remove_job_cgroups(names: Iterable[str]) -> None:
    """The cgroups of the job guards in these namespaces (host-wide, unlike the namespaces' nftables):
    their processes are gone now, so they go too."""
    tables = []
    for n in names:
        try:
            out = sh(["ip", "netns", "exec", n, "nft", "list", "tables"], check=False).stdout
        except MeshrunError:  # no nft here: no guards either
            return
        tables += rules.job_tables_in(out)
    firewall.remove_job_cgroups(tables)


def remove_stale(prefix: str) -> list[str]:
    """Tear down namespaces left under ``prefix`` by an earlier crashed run; return their names."""
    names = _stale_names(prefix)
    if names:
        logger.info("removing stale testbed namespaces: %s", ", ".join(names))
        _teardown(names)
    return names


def _cli_workdir(prefix: str) -> Path:
    return statedir.temp_root() / f"meshrun-testbed-{prefix}"


def main(argv: list[str] | None = None) -> int:
    """`python -m meshrun.lab.testbed up --dcs 3 [--nat cone] [--prefix mr]` / `down --prefix mr`."""
    ap = argparse.ArgumentParser(
        prog="python -m meshrun.lab.testbed", description="Build or remove a NAT'd multi-datacenter testbed (root)."
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="log every command")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="build a world and leave it running")
    p_up.add_argument("--dcs", type=int, default=2)
    p_up.add_argument("--nodes", type=int, default=1, help="nodes per datacenter")
    p_up.add_argument("--nat", choices=NAT_KINDS, default="one-to-one")
    p_up.add_argument("--prefix", default="mr")
    p_down = sub.add_parser("down", help="remove a world's namespaces and processes")
    p_down.add_argument("--prefix", default="mr")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    try:
        if args.cmd == "up":
            specs = [DatacenterSpec(f"dc{i}", nat=args.nat, nodes=args.nodes) for i in range(1, args.dcs + 1)]
            wd = _cli_workdir(args.prefix)
            world = World(specs, prefix=args.prefix, workdir=wd).up()
            world.detach()
            print(world.describe())
            print(
                "run a command in a node: nsenter -t ANCHOR -m -n -- CMD  (anchors: "
                + ", ".join(f"{n.name}={n.anchor_pid}" for n in world.nodes)
                + ")"
            )
            print(f"remove it: python -m meshrun.lab.testbed down --prefix {args.prefix}")
        else:
            if not _PREFIX.match(args.prefix):
                raise UsageError(f"testbed prefix {args.prefix!r} is not usable", "give the prefix used for `up`")
            names = remove_stale(args.prefix)
            statedir.remove_tree(_cli_workdir(args.prefix))
            print(f"removed {len(names)} namespace(s)" + (f": {', '.join(names)}" if names else ""))
    except (NetworkError, UsageError) as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
