"""The relay's kernel fast path (meshrun.system.kernel.relaykernel) on real interfaces: a relayed pair's transport
messages are forwarded by the kernel once both ends are latched, intact and checksummed, and nothing else is.

Three namespaces: end A (10.1.0.2, and a stranger at 10.1.0.3 on the same link), the relay R (10.1.0.1 and
10.2.0.1, IP forwarding off) and end B (10.2.0.2). Checksum offloads are off on every link, so the receiving
kernel checks each UDP checksum the relay's rewriting left (a wrong one is dropped and counted). The relay is
meshrun's own UdpRelay with its KernelPath, run in R by tests/scripts/relay_host.py.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import cannot_run, unique_prefix, wg_handshake

from meshrun.core import keys

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
RELAY_A, RELAY_B, A, STRANGER, B = "10.1.0.1", "10.2.0.1", "10.1.0.2", "10.1.0.3", "10.2.0.2"
PORT = 51821
CLONE_NEWNET = 0x40000000
SO_RCVBUFFORCE = 33


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def socket_in(netns: str, host: str, port: int = 0) -> socket.socket:
    """A UDP socket bound to `host`:`port` inside network namespace `netns` (made by a thread that entered it)."""
    made: list = []

    def make() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                made.append(OSError(ctypes.get_errno(), "setns"))
                return
        finally:
            os.close(fd)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 4 << 20)  # the bursts below wait here unread
        s.bind((host, port))
        s.settimeout(2)
        made.append(s)

    t = threading.Thread(target=make)
    t.start()
    t.join()
    if isinstance(made[0], Exception):
        raise made[0]
    return made[0]


def transport(n: int = 1200) -> bytes:
    return b"\x04\0\0\0" + os.urandom(n - 4)


class Relay:
    """relay_host.py in R: set_pairs and stats over its stdin."""

    def __init__(self, netns: str, table: str) -> None:
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, str(SCRIPTS / "relay_host.py"), table],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"relay_host.py ended (rc {self.proc.poll()})"
        return json.loads(line)

    def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask({"close": True})
                self.proc.wait(timeout=10)
            except (AssertionError, BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def world():
    if shutil.which("ethtool") is None:
        cannot_run(
            "the relay kernel test", "ethtool is not installed: apt-get install ethtool (./dev.sh test installs it)"
        )
    p = unique_prefix()
    ns = {"a": f"{p}-ra", "r": f"{p}-rr", "b": f"{p}-rb"}
    made = []
    try:
        for n in ns.values():
            sh("ip", "netns", "add", n)
            made.append(n)
            sh("ip", "-n", n, "link", "set", "lo", "up")
        for side, (mine, theirs) in {"a": (f"{p}a0", f"{p}a1"), "b": (f"{p}b0", f"{p}b1")}.items():
            sh("ip", "link", "add", mine, "netns", ns[side], "type", "veth", "peer", "name", theirs, "netns", ns["r"])
            for n, dev in ((ns[side], mine), (ns["r"], theirs)):
                sh("ip", "netns", "exec", n, "ethtool", "-K", dev, "rx", "off", "tx", "off")
                sh("ip", "-n", n, "link", "set", dev, "up")
        sh("ip", "-n", ns["a"], "addr", "add", f"{A}/24", "dev", f"{p}a0")
        sh("ip", "-n", ns["a"], "addr", "add", f"{STRANGER}/24", "dev", f"{p}a0")
        sh("ip", "-n", ns["b"], "addr", "add", f"{B}/24", "dev", f"{p}b0")
        sh("ip", "-n", ns["r"], "addr", "add", f"{RELAY_A}/24", "dev", f"{p}a1")
        sh("ip", "-n", ns["r"], "addr", "add", f"{RELAY_B}/24", "dev", f"{p}b1")
        sh("ip", "netns", "exec", ns["r"], "sysctl", "-qw", "net.ipv4.ip_forward=0")
        relay = Relay(ns["r"], "meshrun_relay_test")
        try:
            yield ns, relay
        finally:
            relay.close()
    finally:
        for n in made:
            subprocess.run(["ip", "netns", "del", n], check=False)


def udp_checksum_errors(netns: str) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "nstat", "-az", "UdpInCsumErrors"], capture_output=True, text=True
    )
    return sum(int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("UdpInCsumErrors"))


def pair_cmd(port: int = PORT) -> dict:
    ka, kb = (keys.public_key(keys.generate_private_key()) for _ in range(2))
    return {"pairs": [[port, ka, kb, [A], [B]]]}


def pair_keys(cmd: dict) -> tuple[str, str]:
    return cmd["pairs"][0][1], cmd["pairs"][0][2]


def latch(a: socket.socket, b: socket.socket, relay_a: tuple, relay_b: tuple, cmd: dict) -> None:
    """Each end's handshake (through the relay's socket) latches it."""
    ka, kb = pair_keys(cmd)
    a.sendto(wg_handshake(kb), relay_a)
    time.sleep(0.2)
    b.sendto(wg_handshake(ka, kind=2), relay_b)
    assert b.recvfrom(2048)[1] == relay_b
    assert a.recvfrom(2048)[1] == relay_a
    time.sleep(0.5)  # the relay's kernel thread makes its rules


def test_a_latched_pair_is_forwarded_by_the_kernel_intact_and_nothing_else_is(world):
    ns, relay = world
    assert relay.hello["mode"].startswith("kernel"), relay.hello
    cmd = pair_cmd()
    assert relay.ask(cmd) == {"failed": []}
    a, b = socket_in(ns["a"], A), socket_in(ns["b"], B)
    stranger = socket_in(ns["a"], STRANGER)
    to_relay_a, to_relay_b = (RELAY_A, PORT), (RELAY_B, PORT)
    latch(a, b, to_relay_a, to_relay_b, cmd)
    before = relay.ask({"stats": True})

    sent_ab = [transport(1400) for _ in range(200)]
    sent_ba = [transport(1400) for _ in range(200)]
    for x, y in zip(sent_ab, sent_ba):
        a.sendto(x, to_relay_a)
        b.sendto(y, to_relay_b)
        time.sleep(0.001)
    got_b = [b.recvfrom(2048) for _ in range(len(sent_ab))]
    got_a = [a.recvfrom(2048) for _ in range(len(sent_ba))]
    # Intact, in order, and from the relay's address and the pair's port (what the ends' WireGuard expects).
    assert [d for d, _ in got_b] == sent_ab and {s for _, s in got_b} == {to_relay_b}
    assert [d for d, _ in got_a] == sent_ba and {s for _, s in got_a} == {to_relay_a}
    after = relay.ask({"stats": True})
    kernel = after["kernel"].get(str(PORT), 0) - before["kernel"].get(str(PORT), 0)
    by_socket = after["stats"][str(PORT)][0] - before["stats"][str(PORT)][0] - kernel
    assert kernel == 400 and by_socket == 0, (before, after)
    assert udp_checksum_errors(ns["a"]) == 0 and udp_checksum_errors(ns["b"]) == 0

    # A stranger on A's link sending what looks like A's traffic: not the kernel's (not A's latched address), and
    # the socket path drops it.
    for _ in range(20):
        stranger.sendto(transport(), to_relay_a)
    b.settimeout(0.5)
    with pytest.raises(TimeoutError):
        b.recvfrom(2048)
    assert relay.ask({"stats": True})["kernel"].get(str(PORT), 0) == after["kernel"][str(PORT)]

    # The pair leaves the relay: its rules go with it (before its socket), nothing passes.
    assert relay.ask({"pairs": []}) == {"failed": []}
    out = subprocess.run(
        ["ip", "netns", "exec", ns["r"], "nft", "list", "table", "netdev", "meshrun_relay_test"],
        capture_output=True,
        text=True,
    )
    assert "fwd" not in out.stdout
    a.sendto(transport(), to_relay_a)
    with pytest.raises(TimeoutError):
        b.recvfrom(2048)


def test_an_end_that_moves_is_latched_anew_and_the_kernel_follows(world):
    ns, relay = world
    cmd = pair_cmd()
    relay.ask(cmd)
    a, b = socket_in(ns["a"], A), socket_in(ns["b"], B)
    to_relay_a, to_relay_b = (RELAY_A, PORT), (RELAY_B, PORT)
    latch(a, b, to_relay_a, to_relay_b, cmd)
    # A's NAT gives it another port: its transport datagrams from there move nothing; the handshake its WireGuard
    # sends from there does (once LATCH_MIN_S has passed since A was latched: sent again until it is).
    a.close()
    moved = socket_in(ns["a"], A)
    moved.sendto(transport(), to_relay_a)
    b.settimeout(0.3)
    with pytest.raises(TimeoutError):
        b.recvfrom(2048)
    deadline = time.monotonic() + 5
    while True:
        moved.sendto(wg_handshake(pair_keys(cmd)[1]), to_relay_a)
        try:
            assert b.recvfrom(2048)[1] == to_relay_b
            break
        except TimeoutError:
            assert time.monotonic() < deadline, "the moved end's handshake never latched it"
    b.settimeout(2)
    time.sleep(0.5)
    before = relay.ask({"stats": True})["kernel"].get(str(PORT), 0)
    sent = [transport() for _ in range(50)]
    for x in sent:
        b.sendto(x, to_relay_b)
    assert [moved.recvfrom(2048)[0] for _ in sent] == sent
    assert relay.ask({"stats": True})["kernel"].get(str(PORT), 0) - before == 50


def test_closing_the_relay_takes_its_table_away(world):
    ns, relay = world
    cmd = pair_cmd()
    relay.ask(cmd)
    a, b = socket_in(ns["a"], A), socket_in(ns["b"], B)
    latch(a, b, (RELAY_A, PORT), (RELAY_B, PORT), cmd)
    relay.close()
    out = subprocess.run(["ip", "netns", "exec", ns["r"], "nft", "list", "tables"], capture_output=True, text=True)
    assert "meshrun_relay_test" not in out.stdout
