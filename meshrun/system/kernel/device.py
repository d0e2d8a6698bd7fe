"""The WireGuard device seam: what the mesh layer asks of an interface, and the real implementation.

`Device` is the protocol the coordinator and the agent are written against; `WireGuardDevice`
implements it with kernel WireGuard when `ip link add ... type wireguard` works, else
wireguard-go, configured with `wg` and `ip`; `meshrun.system.kernel.fakedevice.FakeDevice` implements
it in memory for tests that need no root.

Output that can hold a private key (`wg show dump`) is parsed here and never logged.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from meshrun.core import versions
from meshrun.core.peers import PeerDiff, PeerState, wg_set_args
from meshrun.core.wgconf import parse_dump
from meshrun.errors import MeshrunError, NetworkError
from meshrun.system.kernel import firewall, net
from meshrun.system.machine import procs
from meshrun.system.machine.cmd import run

log = logging.getLogger("meshrun.system.kernel.device")

UAPI_DIR = Path("/var/run/wireguard")
# wireguard-go gives its UDP sockets 7 MiB buffers itself since commit f26efb6 (March 2023, after
# release 0.0.20230223); older builds (0.0.20220316 is Debian 12's) keep the kernel default, 208 KiB.
SOCKET_BUFFER = 7 << 20
SYS_PIDFD_GETFD = 438  # one number on every Linux architecture (Linux >= 5.6)
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33
KERNEL, USERSPACE = "kernel", "wireguard-go"
# The userspace implementation to start when the kernel has no WireGuard (a path to pick another build).
WIREGUARD_GO = os.environ.get("MESHRUN_WIREGUARD_GO") or "wireguard-go"


class Device(Protocol):
    """A WireGuard interface, as the coordinator and the agent use it."""

    name: str
    pid: int | None  # wireguard-go's process (None for kernel WireGuard)

    def exists(self) -> bool:
        """True when the interface is present."""

    def backend(self) -> str:
        """'kernel' or 'wireguard-go'."""

    def create(self) -> None:
        """Create the interface (NetworkError if it exists or cannot be made)."""

    def configure(self, key_path: Path, listen_port: int, address: str, mtu: int) -> None:
        """Set private key (from a 0600 file) and port, add `address` (CIDR), set the MTU, bring it up."""

    def set_mtu(self, mtu: int) -> None:
        """Change the interface MTU."""

    def link_mtu(self) -> int | None:
        """The interface's MTU now (None: it is not there)."""

    def current_route_mtus(self) -> dict[str, int]:
        """{overlay IP: MTU} of the /32 routes with an MTU on the interface now (see set_route_mtus)."""

    def set_route_mtus(self, mtus: Mapping[str, int]) -> None:
        """Give exactly these overlay IPs a /32 route with that MTU ({IP: mtu}; see peers.route_mtus)."""

    def peers(self) -> list[PeerState]:
        """The peers as the interface reports them now."""

    def apply(self, diff: PeerDiff) -> None:
        """Apply `diff` in one change (untouched peers keep their sessions)."""

    def nudge(self, overlay_ips: list[str]) -> None:
        """Send one datagram towards each overlay IP, so WireGuard handshakes with its peer now."""

    def guard_forwarding(self) -> None:
        """Drop what arrives on this interface for any other one, even where the host forwards (every
        member, before the interface comes up; meshrun.system.kernel.firewall.install_forward_guard)."""

    def warning(self) -> str | None:
        """What about this interface costs the user (an old wireguard-go), with the fix; None if nothing."""

    def delete(self) -> None:
        """Remove the interface (and stop its wireguard-go); no error if it is gone."""


class WireGuardDevice:
    """A real WireGuard interface: kernel module if it works, else wireguard-go.

    `log_path` receives wireguard-go's output; `pid` is the wireguard-go process recorded in the
    member's state (so `delete` can wait for it).
    """

    def __init__(self, name: str, log_path: Path, pid: int | None = None) -> None:
        self.name = name
        self.log_path = Path(log_path)
        self.pid = pid

    def exists(self) -> bool:
        return run(["ip", "link", "show", "dev", self.name], check=False, quiet=True).returncode == 0

    def backend(self) -> str:
        return USERSPACE if (UAPI_DIR / f"{self.name}.sock").exists() else KERNEL

    def create(self) -> None:
        """Kernel WireGuard if `ip link add` works, else wireguard-go in its own session (it and the
        tunnels outlive the meshrun daemon; deleting the link stops it)."""
        if self.exists():
            raise NetworkError(
                f"network interface {self.name} already exists",
                "run `meshrun leave`/`meshrun down` if it is meshrun's, or pick another --interface",
            )
        res = run(["ip", "link", "add", "dev", self.name, "type", "wireguard"], check=False)
        if res.returncode == 0:
            self.pid = None
            return
        if "not permitted" in res.stderr.lower():
            net.require_admin()
        if WIREGUARD_GO == "wireguard-go":
            net.require_tools("wireguard-go")
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            env = dict(os.environ, WG_PROCESS_FOREGROUND="1", LOG_LEVEL="error")
            proc = procs.popen(
                [WIREGUARD_GO, "-f", self.name],
                stdin=procs.DEVNULL,
                stdout=fd,
                stderr=procs.STDOUT,
                env=env,
                start_new_session=True,
            )
        finally:
            os.close(fd)
        sock = UAPI_DIR / f"{self.name}.sock"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise NetworkError(
                    f"wireguard-go exited with code {proc.returncode} creating {self.name}: {tail[0]}",
                    f"check /dev/net/tun exists and that no other process uses {sock}",
                )
            if sock.exists() and self.exists():
                self.pid = proc.pid
                return
            time.sleep(0.05)
        proc.kill()
        raise NetworkError(f"wireguard-go did not create {self.name} within 10 s", f"see {self.log_path}")

    def configure(self, key_path: Path, listen_port: int, address: str, mtu: int) -> None:
        run(["wg", "set", self.name, "listen-port", str(listen_port), "private-key", str(key_path)])
        run(["ip", "-4", "address", "replace", address, "dev", self.name])
        self.set_mtu(mtu, up=True)
        if self.pid:
            try:
                log.debug("wireguard-go socket buffers (rcv, snd): %s", widen_socket_buffers(self.pid))
            except OSError as exc:
                log.warning(
                    "could not widen wireguard-go's UDP socket buffers (%s): at high rates it may "
                    "drop datagrams (inner TCP retransmits); kernel WireGuard and wireguard-go after "
                    "0.0.20230223 do not need this",
                    exc,
                )

    def set_mtu(self, mtu: int, up: bool = False) -> None:
        run(["ip", "link", "set", "dev", self.name, "mtu", str(mtu), *(["up"] if up else [])])

    def link_mtu(self) -> int | None:
        return net.link(self.name).get("mtu")

    def current_route_mtus(self) -> dict[str, int]:
        return net.route_mtus(self.name)

    def set_route_mtus(self, mtus: Mapping[str, int]) -> None:
        if net.set_route_mtus(self.name, mtus):
            log.info(
                "route MTUs on %s: %s", self.name, ", ".join(f"{ip} {m}" for ip, m in sorted(mtus.items())) or "none"
            )

    def peers(self) -> list[PeerState]:
        out = run(["wg", "show", self.name, "dump"], quiet=True).stdout.splitlines()
        return parse_dump("\n".join(out[1:]))[1] if out else []

    def apply(self, diff: PeerDiff) -> None:
        args = wg_set_args(diff)
        if args:
            run(["wg", "set", self.name, *args])

    def nudge(self, overlay_ips: list[str]) -> None:
        # The discard port: nothing answers, but the datagram makes WireGuard start a handshake.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for ip in overlay_ips:
                with contextlib.suppress(OSError):
                    s.sendto(b"", (ip, 9))

    def guard_forwarding(self) -> None:
        firewall.install_forward_guard(self.name)

    def warning(self) -> str | None:
        return versions.wireguard_go_warning(self.userspace_version())

    def userspace_version(self) -> tuple[int, int, int] | None:
        """The version of the wireguard-go serving this interface; None for kernel WireGuard or if unknown."""
        if self.backend() != USERSPACE:
            return None
        binary = WIREGUARD_GO
        if self.pid and procs.alive(self.pid):
            with contextlib.suppress(OSError):
                binary = os.readlink(f"/proc/{self.pid}/exe")  # the build that serves this interface
        try:
            res = run([binary, "--version"], check=False, quiet=True, timeout=10)
        except MeshrunError:  # not installed under that name any more
            return None
        return versions.parse(res.stdout)

    def delete(self) -> None:
        if self.exists():
            run(["ip", "link", "del", "dev", self.name])
        if self.pid:
            self._stop_wireguard_go(self.pid)
        firewall.remove_forward_guard(self.name)  # the interface's guard goes with it

    def _stop_wireguard_go(self, pid: int) -> None:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return
        if not cmdline or not cmdline[0].endswith(b"wireguard-go") or self.name.encode() not in cmdline:
            return  # the PID was reused by something else: leave it alone
        if not procs.wait_gone(pid, 3):  # deleting the link normally ends it
            procs.signal_pid(pid, signal.SIGTERM)


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
    buffer, and every dropped datagram costs an inner TCP retransmit (benchmarks/wan_tuning.py with
    wireguard-go 0.0.20220316, benchmarks/results/archive/wan_tuning.json: 180-783 drops per two 256 MiB
    all-reduces at 200 Mbit/s, none with 7 MiB). A descriptor copied
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
                out.append(
                    (
                        s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
                        s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
                    )
                )
    finally:
        os.close(pidfd)
    return out
