"""nftables rules meshrun needs, rendered as text for `nft -f -`. Pure: names and addresses in, script out.

Two kinds:

- A **job guard**: every port a job's processes listen on (torch's rendezvous stores, Gloo and NCCL
  listeners, whatever ports they pick) answers only the job's own nodes on the overlay interface.
  The job's processes run in a cgroup of their own; nftables' `socket cgroupv2` finds the socket a
  packet is for (listening sockets included) and its cgroup, so a new connection (TCP SYN, or any UDP)
  to that cgroup's sockets from an overlay address outside the set `nodes` is dropped before it
  reaches the socket (arriving on the WireGuard interface or on the site LAN path's device, core/lanpath).
  One table per job and node (`job_table`), so removing it is one command and the
  host's own tables are never touched.
  On the job's nodes a job's ports answer the job's own processes only (`ProcessGate`): every other process on
  a node sends with the node's overlay address, which the address check admits. So each table also tags the
  new connections its job's processes open (bits MARK_MASK of the connection's conntrack mark, set to the job's
  `job_mark`, by the sending socket's cgroup) and stamps those that leave for the overlay (DSCP `JOB_DSCP` on
  the inner packet, which WireGuard carries sealed; a stamp no job's process set is wiped). A new connection
  to the job's sockets is dropped when it arrives on loopback without its job's tag, or over the overlay from a
  job's node without the stamp. Where neither can be read, one that a process of no job opens is refused on its
  way out: over loopback to the stores' range (`ProcessGate.loopback`: nft's lookup of the socket a loopback
  packet is for misses one bound to the overlay device, as meshrun's stores are), and across a routed site LAN
  path to the job's nodes' job ports (`ProcessGate.ports`: the stores' range and the ephemeral ports torch's
  stores, Gloo and NCCL bind; the overlay API's port is exempt).
- The **forward guard**, on every member: a member that forwards overlay traffic (the coordinator relays
  pairs; a node whose host forwards, as Docker and Kubernetes hosts do) forwards only overlay-to-overlay;
  a packet from a member for any other interface (that host's LAN or VPC) is dropped, whatever the host's
  FORWARD policy.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from meshrun.core import lanpath, tunnels
from meshrun.errors import UsageError

__all__ = [
    "CGROUP_PARENT",
    "FORWARD_TABLE",
    "GUARD_LEVELS",
    "JOB_DSCP",
    "JOB_TABLE_PREFIX",
    "MARK_MASK",
    "ProcessGate",
    "add_allowed",
    "check_interface",
    "delete_guard",
    "forward_chain",
    "forward_chains",
    "forward_guard",
    "forward_unguard",
    "inet_tables",
    "is_job_table",
    "job_tables_in",
    "job_gate",
    "job_guard",
    "job_mark",
    "job_table",
]

JOB_TABLE_PREFIX = "meshrun_job_"
# The levels a job's cgroup may sit at, counted from the hierarchy's real root. It is level 2 where nft
# sees that root at /sys/fs/cgroup; in a container with a private cgroup namespace (Docker's default on
# cgroup v2) it is deeper, and kernels without "netfilter: nft_socket: make cgroupsv2 matching work with
# namespaces" (Linux 6.12, backported to stable kernels in 2024) compare the level as if from the real root:
# a level-2 rule alone would never match there and the guard would silently admit everyone. Cgroup IDs are
# unique, so a rule per level matches the job's cgroup at exactly one level and nothing else.
GUARD_LEVELS = range(2, 17)
FORWARD_TABLE = "meshrun_forward"
CGROUP_PARENT = "meshrun"  # jobs' cgroups live in <cgroup2 root>/meshrun/<table name>
# The conntrack mark's bits a job guard uses to tag its job's connections (the rest are left to others: Docker,
# Kubernetes and Tailscale use the packet mark, firewalld and Cilium low conntrack bits). 4095 values: two
# jobs on one member share a tag with odds 1 in 4095, which lets each reach the other's ports, nothing more.
MARK_MASK = 0xFFF00000
_MARK_SHIFT = 20
# The DSCP a job guard stamps on the new connections a job's process opens to the overlay, which the other nodes'
# guards read (one of RFC 2474's "experimental or local use" codepoints, xxxx11: no network gives it a meaning).
JOB_DSCP = 0x2B
_IFACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,15}\Z")
_TABLE_RE = re.compile(rf"^{JOB_TABLE_PREFIX}[0-9a-f]{{16}}\Z")
# Job ids as meshrun.core.jobspec accepts them; a node is a member name, or "<member>/store" for the supervisor's
# rendezvous store. Both only reach a script hashed or in a comment, checked all the same.
_JOB_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}\Z")
_NODE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}(/[A-Za-z0-9_.-]{1,32})?\Z")


def job_table(job_id: str, node: str) -> str:
    """The table (and cgroup) name of `job_id`'s guard on member `node`.

    Unique per job and member (simulated members share one host's cgroups), and the same in every process
    that asks, so the share that made a guard and the agent that extends or sweeps it agree. UsageError for
    a job id or node name meshrun would not make.
    """
    if not _JOB_RE.match(job_id or ""):
        raise UsageError(
            f"job id {job_id!r} is not 1-64 characters of A-Z a-z 0-9 _ . -", "use the job id meshrun gave the job"
        )
    if not _NODE_RE.match(node or ""):
        raise UsageError(
            f"node name {node!r} is not a member name (optionally /<role>)", "use the member's name, e.g. dc1-a"
        )
    return JOB_TABLE_PREFIX + hashlib.sha256(f"{job_id}/{node}".encode()).hexdigest()[:16]


def is_job_table(name: str) -> bool:
    """Whether `name` is a table `job_table` makes (what a sweep may delete; nothing else is ours)."""
    return bool(_TABLE_RE.match(name))


def inet_tables(listing: str) -> list[str]:
    """The names of the `inet` tables in what `nft list tables` prints (other families are left out)."""
    return [
        parts[2]
        for parts in (line.split() for line in listing.splitlines())
        if len(parts) == 3 and parts[0] == "table" and parts[1] == "inet"
    ]


def job_tables_in(listing: str) -> list[str]:
    """The job guards' tables in what `nft list tables` prints (in whichever network namespace it ran)."""
    return [t for t in inet_tables(listing) if is_job_table(t)]


def check_interface(name: str) -> str:
    """`name` if it is a possible interface name, else UsageError (it is quoted into scripts)."""
    if not _IFACE_RE.match(name or ""):
        raise UsageError(
            f"interface name {name!r} is not 1-15 characters of A-Z a-z 0-9 _ . -",
            "use the overlay interface's name, e.g. meshrun0",
        )
    return name


def _addresses(ips: Iterable[str]) -> list[str]:
    out = []
    for ip in ips:
        try:
            addr = ipaddress.IPv4Address(str(ip))
        except ValueError:
            raise UsageError(f"{ip!r} is not an IPv4 address", "give the nodes' overlay addresses") from None
        out.append(str(addr))
    return sorted(set(out), key=lambda a: ipaddress.IPv4Address(a))


def _check_table(table: str) -> str:
    if not _TABLE_RE.match(table):
        raise UsageError(f"{table!r} is not a meshrun job table name", "make it with meshrun.core.firewall.job_table")
    return table


def _comment(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9 _.:/-]", "-", text)[:120]


SOCKET_MATCH_FIX = (
    "unmount the cgroup v1 net_cls and net_prio hierarchies and reboot (they switch v2 socket matching off until "
    "then), or run Linux >= 5.15, where both work side by side"
)


def _kernel(release: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def socket_match_caveat(release: str, proc_cgroups: str) -> str | None:
    """Why `socket cgroupv2` cannot be trusted on this kernel (`uname -r`, the text of /proc/cgroups), or None.

    Before Linux 5.15 a socket records either its cgroup v2 or its v1 net_cls/net_prio ids, not both: once
    net_cls or net_prio is in use in a v1 hierarchy the kernel stops recording v2 cgroups for new sockets
    ("disabling cgroup2 socket matching due to net_prio or net_cls activation"), and a job guard matches
    none of the job's sockets, so its ports would be open to every member. /proc/cgroups lists each
    controller's hierarchy id (0: v2 or unmounted), which is what is checked."""
    if _kernel(release) >= (5, 15):
        return None
    bound = []
    for line in proc_cgroups.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] in ("net_cls", "net_prio") and parts[1] != "0" and parts[3] == "1":
            bound.append(parts[0])
    if not bound:
        return None
    return (
        f"Linux {release} with cgroup v1 {' and '.join(bound)} mounted: before 5.15 that switches off the cgroup v2 "
        "socket matching meshrun's job guards rely on, so a job's ports could not be kept from other members"
    )


def job_guard(table: str, comment: str, interface: str, allowed: Iterable[str], gate: ProcessGate | None = None) -> str:
    """The script that (re)creates a job guard: table `table` whose cgroup is CGROUP_PARENT/`table`
    (level 2 below the cgroup2 root nft sees), admitting new connections on `interface` only from `allowed`,
    and with `gate`, on this member only from the job's own processes (`ProcessGate`). Without one (etcd's
    guard: its clients prove themselves with certificates) local processes are not judged.

    `allowed` are the overlay addresses of the job's nodes (the coordinator's too when it hosts the job's
    store). Only new connections are judged (TCP SYN without ACK, any UDP datagram): connections the job
    opened itself get their answers; the host's other interfaces are not the overlay's business, and loopback
    is judged by the gate alone. IPv6 on the overlay to the job's sockets is dropped (the overlay is IPv4). The
    script first creates and deletes the table, so applying it replaces an older guard of the same name in one
    transaction. UsageError naming a bad table name, interface or address.
    """
    table, iface = _check_table(table), check_interface(interface)
    ips = _addresses(allowed)
    # The overlay arrives on the WireGuard interface, and from a trusted site's members on the LAN path's device.
    ifaces = _names([iface, lanpath.interface_name(iface)])
    elements = f" elements = {{ {', '.join(ips)} }};" if ips else ""
    path = f"{CGROUP_PARENT}/{table}"
    # Where the overlay travels sealed (WireGuard, its extra tunnels, VXLAN): a stamp put there arrives as it was.
    sealed = [iface, lanpath.interface_name(iface), *tunnels.device_names(iface)]
    gated, local = _gate_rules(gate, path, sealed) if gate is not None else ([], [])
    return "\n".join(
        [
            f"table inet {table} {{}}",
            f"delete table inet {table}",
            f"table inet {table} {{",
            f'  comment "{_comment(comment)}"',
            f"  set nodes {{ type ipv4_addr;{elements} }}",
            "  chain input {",
            "    type filter hook input priority filter - 1; policy accept;",
            f"    iifname {ifaces} tcp flags & (syn | ack) == syn ip saddr != @nodes jump outsider",
            f"    iifname {ifaces} meta l4proto udp ip saddr != @nodes jump outsider",
            f"    iifname {ifaces} meta nfproto ipv6 jump outsider",
            # A routed site LAN path (core/lanpath) delivers the overlay on the LAN interface itself: what is
            # addressed to a job node's overlay address is judged wherever it arrives.
            '    iifname != "lo" ip daddr @nodes tcp flags & (syn | ack) == syn ip saddr != @nodes jump outsider',
            '    iifname != "lo" ip daddr @nodes meta l4proto udp ip saddr != @nodes jump outsider',
            *local,
            "  }",
            "  chain outsider {",
            *(f'    socket cgroupv2 level {level} "{path}" drop' for level in GUARD_LEVELS),
            "  }",
            *gated,
            "}",
            "",
        ]
    )


@dataclass(frozen=True)
class ProcessGate:
    """Which of a member's own processes may open connections to a job's ports (see the module docstring).

    `mark`: the job's tag (`job_mark`). `ports`: inclusive TCP port ranges that are the job's on its nodes
    (their listeners pick them at bind time); `exempt`: ports inside those ranges that are not (the overlay API);
    `loopback`: the ranges among them that are refused over loopback too (the stores', bound to the overlay
    device: nft's loopback lookup misses them; every other job socket is judged by its cgroup there). Empty:
    all of `ports` (a spec written before)."""

    mark: int
    ports: tuple[tuple[int, int], ...] = ()
    exempt: tuple[int, ...] = ()
    loopback: tuple[tuple[int, int], ...] = ()

    def record(self) -> dict:
        """The gate as a share's spec keeps it (JSON)."""
        return {
            "mark": self.mark,
            "ports": [list(r) for r in self.ports],
            "exempt": list(self.exempt),
            "loopback": [list(r) for r in self.loopback],
        }

    @classmethod
    def from_record(cls, d: dict | None) -> ProcessGate | None:
        """`record`'s inverse; None for none (a spec written before gates: the guard judges addresses only)."""
        if not d:
            return None
        return cls(
            int(d["mark"]),
            tuple((int(a), int(b)) for a, b in d["ports"]),
            tuple(int(p) for p in d["exempt"]),
            tuple((int(a), int(b)) for a, b in d.get("loopback", ())),
        )


def job_mark(job_id: str) -> int:
    """The tag (bits MARK_MASK, never 0) of `job_id`'s connections: the same on every member and in every
    process that asks."""
    n = int.from_bytes(hashlib.sha256(f"meshrun-job-mark/{job_id}".encode()).digest()[:4], "big")
    return (n % (MARK_MASK >> _MARK_SHIFT) + 1) << _MARK_SHIFT


def job_gate(job_id: str, rdzv_port: int, store_ports: int, api_port: int, local_ports: tuple[int, int]) -> ProcessGate:
    """The gate of a job's guard: its tag, the rendezvous stores' range (rdzv_port + 1 up, `store_ports` - 1
    ports) and the ephemeral range (`local_ports`, this host's ip_local_port_range: other members are assumed to
    use the same, Linux's default 32768-60999 unless changed), the overlay API's port exempt."""
    stores = (rdzv_port + 1, rdzv_port + store_ports - 1)
    ranges = (stores, local_ports)
    for lo, hi in ranges:
        if not 1 <= lo <= hi <= 65535:
            raise UsageError(f"port range {lo}-{hi} is not within 1-65535", "check the network's rdzv_port")
    return ProcessGate(job_mark(job_id), ranges, (api_port,), (stores,))


def _gate_rules(gate: ProcessGate, path: str, sealed: Sequence[str]) -> tuple[list[str], list[str]]:
    """The gate's lines: (its chains, the input chain's rules). `sealed`: the devices that carry the overlay
    sealed."""
    ifaces = _names(sealed)
    mark, mask = gate.mark, MARK_MASK
    if not mark or mark & ~mask:
        raise UsageError(f"job mark {mark:#x} is not within {mask:#x}", "use firewall.job_mark(job_id)")
    untagged = f"ct mark & {mask:#010x} != {mark:#010x}"
    keep = f"ct mark & {~mask & 0xFFFFFFFF:#010x}"  # the bits outside MARK_MASK are others'
    stamp = f"ip dscp != {JOB_DSCP:#04x}"
    chains = [
        # Before the output judge (filter - 1) of every table: a job's processes on this member may hold
        # sockets in more than one of its cgroups (the coordinator's store and its share), each tags its own.
        "  chain tag {",
        "    type filter hook output priority filter - 2; policy accept;",
        "    tcp flags & (syn | ack) == syn jump tag_own",
        "    meta l4proto udp ct state new jump tag_own",
        "  }",
        "  chain tag_own {",
        *(f'    socket cgroupv2 level {level} "{path}" ct mark set {keep} | {mark:#010x}' for level in GUARD_LEVELS),
        "  }",
        # What leaves for the overlay says whether a job's process opened it: the stamp travels inside WireGuard
        # (or VXLAN) to the other node, whose guard reads it. Any job's tag stamps (a node cannot tell which job a
        # remote port is); a stamp that no job's process set (a user's IP_TOS, a container's forwarded packet) is
        # wiped. Forwarded overlay-to-overlay packets (a relaying member) keep the stamp their sender gave them.
        "  chain stamp {",
        "    type filter hook postrouting priority filter; policy accept;",
        f"    oifname {ifaces} tcp flags & (syn | ack) == syn jump stamp_new",
        f"    oifname {ifaces} meta l4proto udp ct state new jump stamp_new",
        "  }",
        "  chain stamp_new {",
        f"    iifname {ifaces} return",
        f"    ct mark & {mask:#010x} != 0 ip dscp set {JOB_DSCP:#04x} return",
        f"    ip dscp {JOB_DSCP:#04x} ip dscp set cs0",
        "  }",
    ]
    local = [
        f'    iifname "lo" tcp flags & (syn | ack) == syn {untagged} jump outsider',
        f'    iifname "lo" meta l4proto udp ct state new {untagged} jump outsider',
        # From the job's nodes over the overlay: only what a job's process there opened (its stamp).
        f"    iifname {ifaces} tcp flags & (syn | ack) == syn ip saddr @nodes {stamp} jump outsider",
        f"    iifname {ifaces} meta l4proto udp ct state new ip saddr @nodes {stamp} jump outsider",
    ]
    out: list[str] = []
    if gate.ports:
        exempt = f"tcp dport != {{ {', '.join(str(p) for p in gate.exempt)} }} " if gate.exempt else ""
        refuse = f"ip daddr @nodes tcp flags & (syn | ack) == syn ct mark & {mask:#010x} == 0 {exempt}tcp dport"
        out = [
            "  chain output {",
            "    type filter hook output priority filter - 1; policy accept;",
            # Where no stamp is read, on its way out. This member's own overlay address, over loopback: nft's
            # lookup of the socket a loopback packet is for misses one bound to the overlay device, as meshrun's
            # stores are (the kernel delivers to it all the same). A routed site LAN path: the LAN may rewrite
            # DSCP. Refused at once (a reset), not dropped: a user's own tool learns it is not allowed, not a hang.
            # Any job's tag passes: a stale table, or another job on the same nodes, must not stop its processes.
            f'    oifname "lo" {refuse} {{ {_ranges(gate.loopback or gate.ports)} }} reject with tcp reset',
            f"    oifname != {_names([*sealed, 'lo'])} {refuse} {{ {_ranges(gate.ports)} }} reject with tcp reset",
            "  }",
        ]
    return chains + out, local


def _names(names: Iterable[str]) -> str:
    return "{ " + ", ".join(f'"{n}"' for n in names) + " }"


def _ranges(ranges: Iterable[tuple[int, int]]) -> str:
    return ", ".join(f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in ranges)


def add_allowed(table: str, ips: Iterable[str]) -> str:
    """The script that admits more nodes into a job guard (a node that joins an elastic job); "" for none.

    Adding an address already in the set is no error. UsageError naming a bad table name or address.
    """
    table = _check_table(table)
    addrs = _addresses(ips)
    return f"add element inet {table} nodes {{ {', '.join(addrs)} }}\n" if addrs else ""


def delete_guard(table: str) -> str:
    """The script that deletes a job guard (the whole table: its set and chain go with it)."""
    return f"delete table inet {_check_table(table)}\n"


def forward_chain(interface: str) -> str:
    """The forward guard's chain for `interface` (one per guarded interface, all in FORWARD_TABLE)."""
    return f"guard_{check_interface(interface)}"


def forward_guard(interface: str, relayed: Sequence[tuple[str, str]] = ()) -> str:
    """The script that (re)creates the forward guard for `interface`: packets that arrive on it and would
    leave on any other interface are dropped, and of overlay-to-overlay forwarding only the pairs this member
    relays (`relayed`: (overlay IP, overlay IP), both directions) pass; everything else the host forwards is
    left alone. Every member installs it for its overlay interface: a node whose host forwards (a Docker or
    Kubernetes host) must not route a member into its LAN, nor relay for members it was not asked to. The
    guards of several interfaces (members of several networks on one host) live side by side, a chain each.
    UsageError for a bad interface name or address."""
    iface = check_interface(interface)
    chain = forward_chain(iface)
    pairs = sorted({tuple(_addresses((a,)) + _addresses((b,))) for a, b in relayed})
    allowed = sorted({f"{a} . {b}" for a, b in pairs} | {f"{b} . {a}" for a, b in pairs})
    lines = [
        f"table inet {FORWARD_TABLE} {{}}",
        # The one chain an older meshrun made for the whole host: replaced by the chain per interface.
        f"add chain inet {FORWARD_TABLE} forward",
        f"flush chain inet {FORWARD_TABLE} forward",
        f"delete chain inet {FORWARD_TABLE} forward",
        f"add chain inet {FORWARD_TABLE} {chain} {{ type filter hook forward priority filter - 1; "
        f'policy accept; comment "meshrun: what arrives on {iface} leaves only on {iface}, for pairs it relays"; }}',
        f"flush chain inet {FORWARD_TABLE} {chain}",
        f'add rule inet {FORWARD_TABLE} {chain} iifname "{iface}" oifname != "{iface}" drop',
    ]
    if allowed:
        lines.append(
            f'add rule inet {FORWARD_TABLE} {chain} iifname "{iface}" oifname "{iface}" '
            f"ip saddr . ip daddr {{ {', '.join(allowed)} }} accept"
        )
    lines += [f'add rule inet {FORWARD_TABLE} {chain} iifname "{iface}" oifname "{iface}" drop', ""]
    return "\n".join(lines)


def forward_unguard(interface: str) -> str:
    """The script that deletes `interface`'s forward guard (no error when there is none); the table stays,
    see forward_chains."""
    chain = forward_chain(interface)
    return "\n".join(
        [
            f"table inet {FORWARD_TABLE} {{}}",
            f"add chain inet {FORWARD_TABLE} {chain}",
            f"flush chain inet {FORWARD_TABLE} {chain}",
            f"delete chain inet {FORWARD_TABLE} {chain}",
            "",
        ]
    )


def forward_chains(listing: str) -> list[str]:
    """The chains in `nft list table inet FORWARD_TABLE`'s output (none left: the table can go)."""
    return [m.group(1) for m in re.finditer(r"^\s*chain (\S+) \{", listing, re.M)]
