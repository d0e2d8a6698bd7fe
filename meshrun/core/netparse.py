"""Parsers for what `ip` prints (pure: the text comes in, data goes out).

meshrun.system.kernel.net runs the commands; keeping the parsing here makes it testable on captured
output without root.
"""

from __future__ import annotations

import json

_NOT_A_DESTINATION = ("default", "broadcast", "multicast", "unreachable", "prohibit", "blackhole")


def routes(text: str) -> list[tuple[str, str]]:
    """(destination CIDR, device) per line of `ip -4 -o route show table all`, defaults left out."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "local":
            parts = parts[1:]
        if not parts or parts[0] in _NOT_A_DESTINATION:
            continue
        dev = parts[parts.index("dev") + 1] if "dev" in parts[:-1] else "?"
        out.append((parts[0] if "/" in parts[0] else parts[0] + "/32", dev))
    return out


def addresses(text: str, exclude: str | None = None) -> list[tuple[str, str]]:
    """(device, address) per IPv4 line of `ip -4 -o addr show`, devices named `exclude` left out."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1] != exclude and parts[2] == "inet":
            out.append((parts[1], parts[3].split("/")[0]))
    return out


def default_device(text: str) -> str | None:
    """The device of the first route in `ip -4 -o route show default`, or None."""
    parts = text.split()
    return parts[parts.index("dev") + 1] if "dev" in parts[:-1] else None


def link(text: str) -> dict:
    """`ip -j link show dev X` -> {"exists", "up", "mtu"} ("up": the administrative UP flag)."""
    try:
        items = json.loads(text or "[]")
    except ValueError:
        items = []
    if not items:
        return {"exists": False, "up": False, "mtu": None}
    d = items[0]
    return {"exists": True, "up": "UP" in d.get("flags", []), "mtu": d.get("mtu")}


def route_mtus(text: str) -> dict[str, int]:
    """`ip -j -4 route show dev X` -> {destination IP: mtu} of the /32 routes that carry an MTU."""
    try:
        items = json.loads(text or "[]")
    except ValueError:
        return {}
    out = {}
    for r in items:
        dst, mtu = r.get("dst", ""), (r.get("metrics") or [{}])
        value = next((m["mtu"] for m in mtu if isinstance(m, dict) and "mtu" in m), None)
        if value is not None and "/" not in dst and dst not in _NOT_A_DESTINATION:
            out[dst] = int(value)
    return out


def rule_packets(text: str, tag: str) -> int:
    """Packets counted by the rule commented `tag` in `iptables -L CHAIN -v -x -n` output (0 if absent)."""
    for line in text.splitlines():
        if f"/* {tag} */" in line:
            try:
                return int(line.split()[0])
            except (ValueError, IndexError):
                return 0
    return 0


def route_get(text: str) -> tuple[str, str, str] | None:
    """`ip -j -4 route get IP` -> (device, next hop, source address) of a unicast route: the next hop is the
    gateway, or the address itself when it is on-link. None for a local, blackhole or unparseable answer."""
    try:
        items = json.loads(text or "[]")
    except ValueError:
        return None
    if not items or not isinstance(items[0], dict):
        return None
    r = items[0]
    if r.get("type", "unicast") != "unicast" or not r.get("dev") or not r.get("prefsrc") or not r.get("dst"):
        return None
    return r["dev"], r.get("gateway") or r["dst"], r["prefsrc"]
