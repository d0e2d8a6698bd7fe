"""meshrun.mesh.node.jumbo: which same-site tunnels get the LAN's MTU, proven by a DF echo through each.

JumboPairs runs with a scripted echo and LAN MTU on a state directory in tmp_path: no root, no kernel. The real
echo through wireguard-go on a 9000-byte LAN is tests/e2e/test_nat_e2e.py's."""

from __future__ import annotations

import dataclasses

from support import JOB_NETWORK

from meshrun.core.model import Member
from meshrun.mesh.node import jumbo
from meshrun.mesh.node.jumbo import JumboPairs
from meshrun.system.files.statedir import StateDir


def key(i: int) -> str:
    return f"{i:042d}A="


def member(i: int, path: str = "private") -> Member:
    """Node i of one site: overlay 10.213.0.(i+2), LAN 172.31.40.(i+10)."""
    return Member(f"n{i}", key(i), f"10.213.0.{i + 2}", "198.51.100.9:40000", (f"172.31.40.{i + 10}:51820",), path=path)


ME, N1, N2, FAR = member(0, ""), member(1), member(2), member(3, "public")
EVERYONE = [ME, N1, N2, FAR]


class Echo:
    """The DF echo through a tunnel: `carries[overlay IP]` is the largest size that arrives (0: none)."""

    def __init__(self, carries: dict[str, int]) -> None:
        self.carries = carries
        self.calls: list[tuple[str, int]] = []

    def __call__(self, ip: str, size: int) -> bool:
        self.calls.append((ip, size))
        return size <= self.carries.get(ip, 0)


def pairs(tmp_path, echo: Echo, lan_mtu: int | None = 9000) -> JumboPairs:
    rec = {"public_key": ME.public_key, "mtu": 1420}
    return JumboPairs(StateDir(tmp_path), JOB_NETWORK, rec, echo, lambda ip: lan_mtu if ip == "172.31.40.10" else None)


def test_private_pairs_are_probed_at_the_lan_mtu_and_only_proven_ones_get_it(tmp_path):
    echo = Echo({"10.213.0.3": 9000, "10.213.0.4": 1500})  # n2's LAN drops big frames
    j = pairs(tmp_path, echo)
    assert j.plan(EVERYONE) == (8940, {})  # raised while probed, nothing proven yet
    assert j.check()
    assert j.plan(EVERYONE) == (8940, {"10.213.0.3": 8940})
    state = StateDir(tmp_path).read_json("jumbo.json")
    assert state["lan_mtu"] == 8940 and state["proven"] == {"10.213.0.3": 8940} and state["probing"] == []
    assert list(state["failed"]) == ["10.213.0.4"] and 0 < state["failed"]["10.213.0.4"] <= jumbo.RETRY_S
    assert ("10.213.0.5", 8940) not in echo.calls  # a peer across the internet is never tried
    assert not j.check()  # nothing left on trial


def test_a_peer_that_does_not_answer_at_all_is_not_judged(tmp_path):
    echo = Echo({})
    j = pairs(tmp_path, echo)
    j.plan(EVERYONE)
    assert not j.check() and j.trial == {"10.213.0.3", "10.213.0.4"}
    assert all(size == 1408 for _, size in echo.calls)  # only the small echo, which failed
    echo.carries["10.213.0.3"] = 9000  # its tunnel is up now
    assert j.check() and j.plan(EVERYONE) == (8940, {"10.213.0.3": 8940})


def test_no_jumbo_without_a_larger_lan_or_a_private_peer_and_a_pair_that_leaves_starts_over(tmp_path):
    assert pairs(tmp_path, Echo({}), lan_mtu=1500).plan(EVERYONE) == (0, {})
    assert pairs(tmp_path, Echo({}), lan_mtu=None).plan(EVERYONE) == (0, {})
    j = pairs(tmp_path, Echo({"10.213.0.3": 9000, "10.213.0.4": 9000}))
    assert j.plan([ME, FAR]) == (0, {})
    j.plan(EVERYONE)
    j.check()
    assert j.plan(EVERYONE) == (8940, {"10.213.0.3": 8940, "10.213.0.4": 8940})
    relayed = [ME, dataclasses.replace(N1, path="relayed"), N2, FAR]
    assert j.plan(relayed) == (8940, {"10.213.0.4": 8940})
    assert j.plan(EVERYONE) == (8940, {"10.213.0.4": 8940}) and j.trial == {"10.213.0.3"}  # probed again


def test_a_failed_pair_is_tried_again_after_retry_s(tmp_path, monkeypatch):
    echo = Echo({"10.213.0.3": 1500, "10.213.0.4": 1500})
    j = pairs(tmp_path, echo)
    j.plan(EVERYONE)
    j.check()
    assert j.plan(EVERYONE) == (0, {}) and not j.trial  # both failed: the interface goes back down
    now = jumbo.time.monotonic()
    monkeypatch.setattr(jumbo.time, "monotonic", lambda: now + jumbo.RETRY_S + 1)
    echo.carries["10.213.0.3"] = 9000  # the switch was mended
    assert j.plan(EVERYONE) == (8940, {})
    j.check()
    assert j.plan(EVERYONE) == (8940, {"10.213.0.3": 8940})
