"""The Device contract (meshrun.system.kernel.device.Device): what every implementation must do, written once.

`CASES` run against a fresh device each; `run_all(factory)` returns {case: "ok" or what went wrong}.
tests/unit/system/test_fakedevice.py runs them on FakeDevice (no root); tests/e2e/test_wireguard_device.py
on WireGuardDevice with wireguard-go in a network namespace of its own (`python tests/device_contract.py
real IFACE DIR` prints the JSON). So the fake is held to what real WireGuard does: the coordinator's
relay relies on an allowed IP moving to the peer it is given to, the agent on `update` creating an
unknown peer, status on endpoints printed the way `wg` prints them.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from meshrun.core import keys
from meshrun.core.peers import PeerDiff, PeerSpec
from meshrun.errors import NetworkError

KEY_A, KEY_B = (keys.public_key(keys.generate_private_key()) for _ in range(2))


def _up(dev, workdir: Path) -> None:
    dev.create()
    key = workdir / "private.key"
    key.write_text(keys.generate_private_key() + "\n")
    key.chmod(0o600)
    dev.configure(key, 51999, "10.77.0.1/24", 1420)


def _peer(dev, key: str):
    return {p.public_key: p for p in dev.peers()}.get(key)


def case_create_twice_fails(dev, workdir):
    _up(dev, workdir)
    assert dev.exists()
    try:
        dev.create()
    except NetworkError:
        return
    raise AssertionError("a second create() did not fail")


def case_added_peer_reads_back_as_configured(dev, workdir):
    _up(dev, workdir)
    dev.apply(PeerDiff(add=(PeerSpec(KEY_A, ("10.77.0.2/32",), "198.51.100.7:51820", 25),)))
    p = _peer(dev, KEY_A)
    assert p is not None, dev.peers()
    assert (p.endpoint, p.allowed_ips, p.latest_handshake, p.keepalive) == (
        "198.51.100.7:51820",
        ("10.77.0.2/32",),
        0,
        25,
    ), p


def case_an_allowed_ip_given_to_a_second_peer_moves_to_it(dev, workdir):
    _up(dev, workdir)
    dev.apply(PeerDiff(add=(PeerSpec(KEY_A, ("10.77.0.2/32", "10.77.0.9/32"), None, 0),)))
    dev.apply(PeerDiff(add=(PeerSpec(KEY_B, ("10.77.0.9/32",), None, 0),)))
    assert _peer(dev, KEY_A).allowed_ips == ("10.77.0.2/32",), _peer(dev, KEY_A)
    assert _peer(dev, KEY_B).allowed_ips == ("10.77.0.9/32",), _peer(dev, KEY_B)


def case_update_of_an_unknown_key_creates_the_peer(dev, workdir):
    _up(dev, workdir)
    dev.apply(PeerDiff(update=(PeerSpec(KEY_A, ("10.77.0.3/32",), "198.51.100.8:4000", 0),)))
    p = _peer(dev, KEY_A)
    assert p is not None and p.allowed_ips == ("10.77.0.3/32",) and p.endpoint == "198.51.100.8:4000", p


def case_update_keeps_what_it_does_not_name(dev, workdir):
    _up(dev, workdir)
    dev.apply(PeerDiff(add=(PeerSpec(KEY_A, ("10.77.0.2/32",), "198.51.100.7:51820", 25),)))
    dev.apply(PeerDiff(update=(PeerSpec(KEY_A, ("10.77.0.2/32", "10.77.0.5/32"), None, 25),)))
    p = _peer(dev, KEY_A)
    assert p.endpoint == "198.51.100.7:51820" and p.allowed_ips == ("10.77.0.2/32", "10.77.0.5/32"), p


def case_endpoints_come_back_as_wg_prints_them(dev, workdir):
    _up(dev, workdir)
    dev.apply(PeerDiff(add=(PeerSpec(KEY_A, ("10.77.0.2/32",), "[2001:db8:0:0::1]:51820", 0),)))
    assert _peer(dev, KEY_A).endpoint == "[2001:db8::1]:51820", _peer(dev, KEY_A)


def case_keepalive_off_reads_as_zero(dev, workdir):
    _up(dev, workdir)
    dev.apply(PeerDiff(add=(PeerSpec(KEY_A, ("10.77.0.2/32",), None, 0),)))
    assert _peer(dev, KEY_A).keepalive == 0


def case_removing_a_peer_and_an_unknown_key(dev, workdir):
    _up(dev, workdir)
    dev.apply(PeerDiff(add=(PeerSpec(KEY_A, ("10.77.0.2/32",), None, 0),)))
    dev.apply(PeerDiff(remove=(KEY_A, KEY_B)))  # KEY_B was never there: no error
    assert dev.peers() == []


def case_operations_on_a_missing_interface_fail(dev, workdir):
    assert not dev.exists()
    for op in (dev.peers, lambda: dev.apply(PeerDiff(add=(PeerSpec(KEY_A, ("10.77.0.2/32",)),)))):
        try:
            op()
        except NetworkError:
            continue
        raise AssertionError(f"{op} on a missing interface did not fail")


def case_delete_removes_it_and_twice_is_fine(dev, workdir):
    _up(dev, workdir)
    dev.apply(PeerDiff(add=(PeerSpec(KEY_A, ("10.77.0.2/32",), None, 0),)))
    dev.delete()
    assert not dev.exists()
    dev.delete()


CASES: dict[str, Callable] = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def run_all(factory: Callable[[], object], workdir: Path) -> dict[str, str]:
    """Every case on a fresh device from `factory`; {case: "ok" or the failure}."""
    out = {}
    for name, case in CASES.items():
        dev = factory()
        try:
            case(dev, workdir)
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 -- reported per case
            out[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
        finally:
            try:
                dev.delete()
            except Exception:  # noqa: BLE001
                pass
    return out


if __name__ == "__main__":  # python tests/device_contract.py real IFACE WORKDIR (root, own netns)
    from meshrun.system.kernel.device import WireGuardDevice

    _, _, iface, wd = sys.argv
    print(json.dumps(run_all(lambda: WireGuardDevice(iface, Path(wd) / "wg.log"), Path(wd))))
