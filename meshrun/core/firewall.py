"""nftables rules meshrun needs, rendered as text for `nft -f -`. Pure: names and addresses in, script out.

Two kinds:

- A **job guard**: every port a job's processes listen on (torch's rendezvous stores, Gloo and NCCL
  listeners, whatever ports they pick) answers only the job's own nodes on the overlay interface.
  The job's processes run in a cgroup of their own; nftables' `socket cgroupv2` finds the socket a
  packet is for (listening sockets included) and its cgroup, so a new connection (TCP SYN, or any UDP)
  to that cgroup's sockets from an overlay address outside the set `nodes` is dropped before it
  reaches the socket. One table per job and node (`job_table`), so removing it is one command and the
  host's own tables are never touched.
- The **forward guard**: a member that forwards overlay traffic (the coordinator relays pairs) forwards
  only overlay-to-overlay; a packet from a member for any other interface (the coordinator's LAN or
  VPC) is dropped, whatever the host's FORWARD policy.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable

from meshrun.errors import UsageError

__all__ = ["JOB_TABLE_PREFIX", "FORWARD_TABLE", "CGROUP_PARENT", "job_table", "job_guard", "add_allowed",
           "forward_guard", "check_interface"]

JOB_TABLE_PREFIX = "meshrun_job_"
FORWARD_TABLE = "meshrun_forward"
CGROUP_PARENT = "meshrun"          # jobs' cgroups live in <cgroup2 root>/meshrun/<table name>
_IFACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,15}\Z")
_TABLE_RE = re.compile(rf"^{JOB_TABLE_PREFIX}[0-9a-f]{{16}}\Z")


def job_table(job_id: str, node: str) -> str:
    """The table (and cgroup) name of `job_id`'s guard on member `node` (unique per job and member: simulated
    members share one host's cgroups)."""
    return JOB_TABLE_PREFIX + hashlib.sha256(f"{job_id}/{node}".encode()).hexdigest()[:16]


def check_interface(name: str) -> str:
    if not _IFACE_RE.match(name or ""):
        raise UsageError(f"interface name {name!r} is not 1-15 characters of A-Z a-z 0-9 _ . -",
                         "use the overlay interface's name, e.g. meshrun0")
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
    return re.sub(r'[^A-Za-z0-9 _.:/-]', "-", text)[:120]


def job_guard(table: str, comment: str, interface: str, allowed: Iterable[str]) -> str:
    """The script that (re)creates a job guard: table `table` whose cgroup is CGROUP_PARENT/`table`
    (level 2 below the cgroup2 root), admitting new connections on `interface` only from `allowed`."""
    table, iface = _check_table(table), check_interface(interface)
    ips = _addresses(allowed)
    cg = f'socket cgroupv2 level 2 "{CGROUP_PARENT}/{table}"'
    elements = f" elements = {{ {', '.join(ips)} }};" if ips else ""
    return "\n".join([
        f"table inet {table} {{}}",
        f"delete table inet {table}",
        f"table inet {table} {{",
        f'  comment "{_comment(comment)}"',
        f"  set nodes {{ type ipv4_addr;{elements} }}",
        "  chain input {",
        "    type filter hook input priority filter - 1; policy accept;",
        f'    iifname "{iface}" tcp flags & (syn | ack) == syn {cg} ip saddr != @nodes drop',
        f'    iifname "{iface}" meta l4proto udp {cg} ip saddr != @nodes drop',
        f'    iifname "{iface}" meta nfproto ipv6 {cg} drop',
        "  }",
        "}",
        "",
    ])


def add_allowed(table: str, ips: Iterable[str]) -> str:
    """The script that admits more nodes into a job guard (a node that joins an elastic job)."""
    table = _check_table(table)
    addrs = _addresses(ips)
    return f"add element inet {table} nodes {{ {', '.join(addrs)} }}\n" if addrs else ""


def forward_guard(interface: str) -> str:
    """The script that (re)creates the forward guard for `interface`."""
    iface = check_interface(interface)
    return "\n".join([
        f"table inet {FORWARD_TABLE} {{}}",
        f"delete table inet {FORWARD_TABLE}",
        f"table inet {FORWARD_TABLE} {{",
        '  comment "meshrun: members reach other members only, never other networks of this host"',
        "  chain forward {",
        "    type filter hook forward priority filter - 1; policy accept;",
        f'    iifname "{iface}" oifname != "{iface}" drop',
        "  }",
        "}",
        "",
    ])
