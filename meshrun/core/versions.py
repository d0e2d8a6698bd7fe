"""Which wireguard-go a member runs, and what an old one costs (pure: the caller runs `wireguard-go --version`)."""

from __future__ import annotations

import re

# The first release with batched I/O (and the 7 MiB socket buffers): 4-6x the throughput of the
# releases before it on the same machine. Debian 12's package is 0.0.20220316; bookworm-backports,
# trixie and Ubuntu 24.04 ship 0.0.20231211 (whose binary prints v0.0.20230223).
FAST_WIREGUARD_GO = (0, 0, 20230223)
_VERSION = re.compile(r"\bv?(\d+)\.(\d+)\.(\d+)\b")


def parse(text: str) -> tuple[int, int, int] | None:
    """The version in `wireguard-go --version`'s output ("wireguard-go v0.0.20230223 ..."), or None."""
    m = _VERSION.search(text or "")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def shown(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


def wireguard_go_warning(version: tuple[int, int, int] | None) -> str | None:
    """A one-line warning with the measured cost and the fix when `version` is an old wireguard-go, else None."""
    if version is None or version >= FAST_WIREGUARD_GO:
        return None
    return (
        f"wireguard-go {shown(version)} has no batched I/O: on this project's 2-core machines it moved 184-291 "
        f"Mbit/s one way where {shown(FAST_WIREGUARD_GO)} moved 1034-1329 (4-6x), enough to cap a WAN link; "
        "install a newer wireguard-go (Debian 12: apt-get install -t bookworm-backports wireguard-go; "
        "Ubuntu 24.04 and Debian 13 ship one) or use kernel WireGuard, then restart the interface (`meshrun leave` or "
        "`meshrun down`, then `meshrun up`)"
    )
