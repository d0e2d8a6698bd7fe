"""The one way meshrun runs a system command (`ip`, `wg`, `iptables`, `tc`, `sysctl`, ...).

`run` logs the command line at debug level (unless `quiet`: output that may hold a private key
is never logged), and turns every failure into a typed error a user can act on: a missing tool
names its Debian package, a timeout names the command, a non-zero exit carries the command, where
it ran, its exit code and stderr, plus a fix picked from the error text.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Mapping, Sequence

from meshrun.errors import CommandError, HostError

log = logging.getLogger("meshrun.system.machine.cmd")

# Debian/Ubuntu package of every tool meshrun (and its lab) runs.
PACKAGES = {
    "ip": "iproute2",
    "tc": "iproute2",
    "ss": "iproute2",
    "wg": "wireguard-tools",
    "wireguard-go": "wireguard-go",
    "iptables": "iptables",
    "sysctl": "procps",
    "nsenter": "util-linux",
    "mount": "mount",
    "unshare": "util-linux",
    "nft": "nftables",
    "ping": "iputils-ping",
    "iperf3": "iperf3",
    "etcd": "etcd-server",
}
# What to do about a failure, by a phrase of its stderr (first match wins).
FIXES = (
    ("operation not permitted", "run meshrun as root (or with CAP_NET_ADMIN)"),
    ("permission denied", "run meshrun as root (or with CAP_NET_ADMIN)"),
    ("file exists", "remove the conflicting interface, address or namespace first"),
)
DEFAULT_FIX = "see the command's error above"


def tail(text: str | None, limit: int = 2000) -> str:
    text = (text or "").strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def fix_for(stderr: str, fixes: Sequence[tuple[str, str]] = FIXES) -> str:
    """The fix for a failed command, from the first phrase of `fixes` found in its stderr."""
    low = stderr.lower()
    return next((fix for phrase, fix in fixes if phrase in low), DEFAULT_FIX)


def run(
    argv: Sequence[str],
    *,
    input: str | None = None,
    timeout: float = 30,
    check: bool = True,
    quiet: bool = False,
    env: Mapping[str, str] | None = None,
    where: str = "",
    fixes: Sequence[tuple[str, str]] = FIXES,
) -> subprocess.CompletedProcess:
    """Run `argv` (text mode, output captured) and return the finished process.

    Raises HostError when the tool is missing (naming its package), CommandError (a
    NetworkError) when it runs past `timeout` or, with `check`, exits non-zero; the message
    names the command, `where` it ran, the exit code and stderr. `fixes` maps stderr phrases to
    the fix the caller's reader needs (the lab and meshrun say different things).
    """
    argv = [str(a) for a in argv]
    line = " ".join(argv)
    at = f" in {where}" if where else ""
    if not quiet:
        log.debug("run%s: %s", f" [{where}]" if where else "", line)
    try:
        res = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, env=None if env is None else dict(env)
        )
    except FileNotFoundError:
        tool = argv[0]
        raise HostError(
            f"`{tool}` is not installed (needed for `{line if not quiet else tool}`)",
            f"install it: apt-get install {PACKAGES.get(tool, tool)}",
        ) from None
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        raise CommandError(
            f"`{line}`{at} did not finish within {timeout:g} s (stderr: {tail(err) or '-'})",
            "the command hung; check the system's network configuration",
        ) from None
    if check and res.returncode != 0:
        detail = tail(res.stderr) or (tail(res.stdout) if not quiet else "") or "-"
        raise CommandError(
            f"`{line}`{at} failed with exit code {res.returncode}: {detail}", fix_for(res.stderr or "", fixes), res
        )
    return res
