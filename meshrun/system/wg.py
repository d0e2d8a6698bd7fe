"""The only module that runs `ip`, `wg` and `wireguard-go`.

Every command goes through `cmd()`, which logs the command line and, on failure, raises a
typed error carrying the command's stderr. Output that can hold a private key
(`wg show dump`) is parsed here and never logged.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from meshrun.errors import NetworkError, SystemError_
from meshrun.core.peers import PeerDiff, PeerState, wg_set_args
from meshrun.core.wgconf import parse_dump

log = logging.getLogger("meshrun.system.wg")

PACKAGES = {"ip": "iproute2", "wg": "wireguard-tools", "wireguard-go": "wireguard-go", "iptables": "iptables",
            "sysctl": "procps"}
UAPI_DIR = Path("/var/run/wireguard")
CAP_NET_ADMIN = 12
# wireguard-go gives its UDP sockets 7 MiB buffers itself since commit f26efb6 (March 2023, after
# release 0.0.20230223); older builds (0.0.20220316 is packaged here) keep the kernel default, 208 KiB.
SOCKET_BUFFER = 7 << 20
SYS_PIDFD_GETFD = 438            # one number on every Linux architecture (Linux >= 5.6)
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33


def cmd(argv: list[str], *, input: str | None = None, timeout: float = 30, check: bool = True,
        quiet: bool = False) -> subprocess.CompletedProcess:
    """Run a system command; raise SystemError_ if it is missing, NetworkError if it fails."""
    if not quiet:
        log.debug("run: %s", " ".join(argv))
    try:
        res = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        tool = argv[0]
        raise SystemError_(f"`{tool}` is not installed",
                           f"install it: apt-get install {PACKAGES.get(tool, tool)}") from None
    except subprocess.TimeoutExpired:
        raise NetworkError(f"`{' '.join(argv[:4])}` did not finish within {timeout:.0f} s",
                           "check the system's network configuration") from None
    if check and res.returncode != 0:
        err = (res.stderr or res.stdout).strip().splitlines()
        detail = err[-1] if err else f"exit code {res.returncode}"
        raise NetworkError(f"`{' '.join(argv[:6])}` failed: {detail}", _fix_for(detail))
    return res


def _fix_for(detail: str) -> str:
    low = detail.lower()
    if "operation not permitted" in low or "permission denied" in low:
        return "run meshrun as root (or with CAP_NET_ADMIN)"
    if "file exists" in low:
        return "remove the conflicting interface or address, or pick another --interface"
    return "see the message above; `meshrun status` shows the current state"


def require_admin() -> None:
    """Raise SystemError_ unless this process holds CAP_NET_ADMIN.

    Root normally does, but root in a container started without NET_ADMIN does not: checking the
    capability, not the uid, turns that case into a clear error instead of a failed `ip link add`.
    """
    try:
        status = Path("/proc/self/status").read_text().splitlines()
        caps = next(int(line.split()[1], 16) for line in status if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError, IndexError):
        caps = None                  # cannot tell: trust the uid
    if caps is None and os.geteuid() == 0 or caps is not None and caps >> CAP_NET_ADMIN & 1:
        return
    if os.geteuid() == 0:
        raise SystemError_("this process runs as root but without CAP_NET_ADMIN, which WireGuard interfaces "
                           "need (a container?)",
                           "start the container with --cap-add NET_ADMIN --device /dev/net/tun, or run meshrun "
                           "on the host")
    raise SystemError_("meshrun needs root (or CAP_NET_ADMIN) to manage WireGuard interfaces",
                       "run it with sudo")


def require_tools(*tools: str) -> None:
    """Raise SystemError_ naming the apt package of the first missing tool."""
    for t in tools:
        if shutil.which(t) is None:
            raise SystemError_(f"`{t}` is not installed", f"install it: apt-get install {PACKAGES.get(t, t)}")


def local_routes() -> list[tuple[str, str]]:
    """(destination, device) for every IPv4 route in every table, defaults excluded."""
    out = cmd(["ip", "-4", "-o", "route", "show", "table", "all"], quiet=True).stdout
    routes = []
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] == "local":
            parts = parts[1:]
        if not parts or parts[0] in ("default", "broadcast", "multicast", "unreachable", "prohibit", "blackhole"):
            continue
        dest = parts[0]
        dev = parts[parts.index("dev") + 1] if "dev" in parts else "?"
        routes.append((dest if "/" in dest else dest + "/32", dev))
    return routes


def local_addresses(exclude: str | None = None) -> list[str]:
    """This machine's global-scope IPv4 addresses (candidates for same-site paths)."""
    out = cmd(["ip", "-4", "-o", "addr", "show", "scope", "global"], quiet=True).stdout
    addrs = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1] != exclude and parts[2] == "inet":
            addrs.append(parts[3].split("/")[0])
    return addrs


def default_route_address() -> str | None:
    """The primary address of the default route's device, if there is one."""
    out = cmd(["ip", "-4", "-o", "route", "show", "default"], check=False, quiet=True).stdout.split()
    if "dev" not in out:
        return None
    dev = out[out.index("dev") + 1]
    res = cmd(["ip", "-4", "-o", "addr", "show", "dev", dev, "scope", "global"], check=False, quiet=True).stdout.split()
    return res[3].split("/")[0] if len(res) >= 4 else None


def interface_exists(name: str) -> bool:
    return cmd(["ip", "link", "show", "dev", name], check=False, quiet=True).returncode == 0


def create_interface(name: str, log_path: Path) -> tuple[str, int | None]:
    """Create WireGuard interface `name`: kernel module if it works, else wireguard-go.

    Returns (backend, pid of wireguard-go or None). wireguard-go runs in its own session,
    so it (and the tunnels) outlive the meshrun daemon; deleting the link stops it.
    """
    if interface_exists(name):
        raise NetworkError(f"network interface {name} already exists",
                           "run `meshrun leave`/`meshrun down` if it is meshrun's, or pick another --interface")
    res = cmd(["ip", "link", "add", "dev", name, "type", "wireguard"], check=False)
    if res.returncode == 0:
        return "kernel", None
    if "not permitted" in res.stderr.lower():
        require_admin()
    require_tools("wireguard-go")
    with open(log_path, "ab") as logf:
        env = dict(os.environ, WG_PROCESS_FOREGROUND="1", LOG_LEVEL="error")
        # Fewer OS threads than cores keeps a 2-core box responsive; Go picks GOMAXPROCS itself.
        proc = subprocess.Popen(["wireguard-go", "-f", name], stdin=subprocess.DEVNULL, stdout=logf,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    sock = UAPI_DIR / f"{name}.sock"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise NetworkError(f"wireguard-go exited with code {proc.returncode} creating {name}: {tail[0]}",
                               "check /dev/net/tun exists and that no other process uses "
                               f"{sock}")
        if sock.exists() and interface_exists(name):
            return "wireguard-go", proc.pid
        time.sleep(0.05)
    proc.kill()
    raise NetworkError(f"wireguard-go did not create {name} within 10 s", "see " + str(log_path))


def configure(name: str, key_path: Path, listen_port: int, address: str, mtu: int) -> None:
    """Set key and port, add the overlay address and bring the interface up."""
    cmd(["wg", "set", name, "listen-port", str(listen_port), "private-key", str(key_path)])
    cmd(["ip", "-4", "address", "replace", address, "dev", name])
    cmd(["ip", "link", "set", "dev", name, "mtu", str(mtu), "up"])


def enable_forwarding(name: str) -> None:
    """Let the coordinator forward overlay packets between peers (relayed pairs).

    Only packets that arrive on `name` are forwarded (per-interface switch, not the global
    ip_forward); redirects are off because in and out interface are the same. If the FORWARD
    chain drops by default (Docker hosts), one rule accepts wg-to-wg traffic.
    """
    for key, value in (("forwarding", "1"), ("send_redirects", "0")):
        cmd(["sysctl", "-q", "-w", f"net.ipv4.conf.{name}.{key}={value}"])
    if shutil.which("iptables") is None:
        return
    policy = cmd(["iptables", "-S", "FORWARD"], check=False, quiet=True).stdout
    rule = ["FORWARD", "-i", name, "-o", name, "-j", "ACCEPT"]
    if "-P FORWARD DROP" in policy and cmd(["iptables", "-C", *rule], check=False, quiet=True).returncode != 0:
        cmd(["iptables", "-I", *rule])


def _udp_socket_fds(pid: int) -> list[int]:
    """Descriptor numbers of the UDP sockets process `pid` holds, seen from its network namespace."""
    inodes = set()
    for table in ("udp", "udp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                inodes.add(line.split()[9])
    fds = []
    for link in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError, ValueError):
            target = os.readlink(link)
            if target.startswith("socket:[") and target[8:-1] in inodes:
                fds.append(int(link.name))
    return fds


def widen_socket_buffers(pid: int, size: int = SOCKET_BUFFER, only_grow: bool = True) -> list[tuple[int, int]]:
    """Give wireguard-go's UDP sockets `size`-byte buffers, as newer wireguard-go does itself.

    With the 208 KiB default a scheduling hiccup at a few hundred Mbit/s overflows the receive
    buffer, and every dropped datagram costs an inner TCP retransmit (benchmarks/wan_tuning.py:
    180-783 drops per two 256 MiB all-reduces at 200 Mbit/s, none with 7 MiB). A descriptor copied
    with pidfd_getfd is the same socket, so setsockopt on the copy changes wireguard-go's socket.
    Call it after the listen port is set and the link is up (wireguard-go binds new sockets then).
    Returns (rcvbuf, sndbuf) per socket as the kernel reports them (twice the size asked for);
    `only_grow=False` also shrinks (benchmarks use it to measure the default). Raises OSError where
    the kernel (< 5.6) or permissions do not allow it: callers log it, it costs throughput only.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    out = []
    try:
        for target in _udp_socket_fds(pid):
            fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
            if fd < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"pidfd_getfd(wireguard-go pid {pid}, fd {target}): {os.strerror(err)}")
            with socket.socket(fileno=fd) as s:
                for force, opt in ((SO_RCVBUFFORCE, socket.SO_RCVBUF), (SO_SNDBUFFORCE, socket.SO_SNDBUF)):
                    if not only_grow or s.getsockopt(socket.SOL_SOCKET, opt) < size:
                        s.setsockopt(socket.SOL_SOCKET, force, size)
                out.append((s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
                            s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)))
    finally:
        os.close(pidfd)
    return out


def set_mtu(name: str, mtu: int) -> None:
    cmd(["ip", "link", "set", "dev", name, "mtu", str(mtu)])


def apply(name: str, d: PeerDiff) -> None:
    """Apply a PeerDiff in one `wg set` call (untouched peers keep their sessions)."""
    args = wg_set_args(d)
    if args:
        cmd(["wg", "set", name, *args])


def show(name: str) -> tuple[int, list[PeerState]]:
    """(listen port, peers) of a running interface. The private key column is dropped unread."""
    res = cmd(["wg", "show", name, "dump"], quiet=True)
    lines = res.stdout.splitlines()
    return parse_dump("\n".join(lines[1:])) if lines else (0, [])


def listen_port(name: str) -> int:
    return int(cmd(["wg", "show", name, "listen-port"], quiet=True).stdout.strip() or 0)


def backend_of(name: str) -> str:
    """'wireguard-go' if a userspace control socket exists for `name`, else 'kernel'."""
    return "wireguard-go" if (UAPI_DIR / f"{name}.sock").exists() else "kernel"


def delete_interface(name: str, pid: int | None = None) -> None:
    """Remove the interface; wait for (and if needed stop) its wireguard-go process."""
    if interface_exists(name):
        cmd(["ip", "link", "del", "dev", name])
    if pid:
        _stop_wireguard_go(pid, name)


def _stop_wireguard_go(pid: int, name: str) -> None:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return
    if not cmdline or not cmdline[0].endswith(b"wireguard-go") or name.encode() not in cmdline:
        return  # the PID was reused by something else: leave it alone
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGTERM)
