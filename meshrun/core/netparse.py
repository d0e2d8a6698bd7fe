"""Parsers for what `ip` prints (pure: the text comes in, data goes out).

meshrun.system.net runs the commands; keeping the parsing here makes it testable on captured
output without root.
"""

from __future__ import annotations

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
