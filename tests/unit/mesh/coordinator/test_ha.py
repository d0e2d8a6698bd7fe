"""meshrun.mesh.coordinator.ha's pure parts: which addresses a coordinator's etcd guard admits at start, which
etcd member its client tries first, and the refusals that come before anything is changed."""

from __future__ import annotations

import re

import pytest

from meshrun.errors import ControlStateError, UsageError
from meshrun.mesh.coordinator import ha
from meshrun.system.control.etcd import OutcomeUnknown
from meshrun.system.control.fakeetcd import FakeEtcd
from meshrun.system.files.statedir import StateDir


def rec(**over) -> dict:
    base = {
        "role": "coordinator",
        "name": "b",
        "overlay_ip": "10.213.0.9",
        "control": {"kind": "etcd", "endpoints": ["https://10.213.0.1:2379", "https://10.213.0.9:2379"]},
    }
    return {**base, **over}


def test_a_coordinator_is_replicated_only_with_etcd_named_in_its_record():
    assert ha.replicated(rec()) and not ha.replicated(rec(control=None)) and not ha.replicated({})


def test_the_guard_at_start_admits_every_coordinator_named_and_this_one():
    assert ha.control_ips(rec()) == ["10.213.0.1", "10.213.0.9"]
    assert ha.control_ips(rec(control={"kind": "etcd", "endpoints": []})) == ["10.213.0.9"]


def test_the_client_tries_this_coordinators_own_member_first(tmp_path):
    state = StateDir(tmp_path)
    state.create()
    state.write_json("member.json", rec())
    from meshrun.core import keys

    ca_cert, ca_key = keys.new_ca("t")
    key_pem, csr = keys.new_csr("b", "10.213.0.9")
    d = StateDir(tmp_path / "etcd")
    d.create()
    d.write("ca.crt", ca_cert)
    d.write("etcd.crt", keys.sign_csr(ca_cert, ca_key, csr, "10.213.0.9"))
    d.write("etcd.key", key_pem, secret=True)
    client = ha.client_for(state)
    try:
        assert client.endpoints[0] == "https://10.213.0.9:2379"  # its own: gone only with this machine
    finally:
        client.close()
    ha.save_endpoints(state, ["https://10.213.0.9:2379", "https://10.213.0.5:2379", "https://10.213.0.9:2379"])
    assert state.read_json("member.json")["control"]["endpoints"] == [
        "https://10.213.0.5:2379",
        "https://10.213.0.9:2379",
    ]


@pytest.mark.parametrize("endpoint", ["[2001:db8::1]:51820", "not a host!", "198.51.100.7:99999"])
def test_a_bad_endpoint_is_refused_naming_it(endpoint):
    from meshrun.core.model import Network

    net = Network(
        "t", "10.213.0.0/16", "meshrun0", 51820, 1420, "10.213.0.1", "A" * 43 + "=", ("192.0.2.1:51820",), "0" * 64
    )
    with pytest.raises(UsageError, match="--endpoint"):
        ha.check_endpoint(endpoint, net)
    assert ha.check_endpoint("198.51.100.7", net) == "198.51.100.7:51820"


@pytest.mark.parametrize(
    "endpoint, kind",
    [
        ("10.0.0.7", "private (RFC 1918)"),
        ("192.168.1.2:51820", "private"),
        ("127.0.0.1", "loopback"),
        ("100.64.3.4", "carrier-grade NAT"),
        ("169.254.1.1", "link-local"),
        ("lan-box.internal", "private"),
    ],
)
def test_a_coordinator_endpoint_must_be_public(endpoint, kind):
    from meshrun.core.model import Network

    net = Network(
        "t", "10.213.0.0/16", "meshrun0", 51820, 1420, "10.213.0.1", "A" * 43 + "=", ("192.0.2.1:51820",), "0" * 64
    )
    names = {"lan-box.internal": "172.31.40.46", "gpu-b.example.com": "203.0.113.9"}
    resolve = lambda host: names.get(host, host)  # noqa: E731
    with pytest.raises(UsageError, match=f"--endpoint {endpoint.split(':')[0]}.* is a {re.escape(kind)}") as err:
        ha.public_endpoint(endpoint, net, resolve)
    assert "public IP" in err.value.fix
    assert ha.public_endpoint("198.51.100.7", net, resolve) == "198.51.100.7:51820"
    assert ha.public_endpoint("gpu-b.example.com:443", net, resolve) == "gpu-b.example.com:443"

    def unknown(host):
        raise OSError("Name or service not known")

    with pytest.raises(UsageError, match="does not resolve"):
        ha.public_endpoint("nowhere.example", net, unknown)


def test_remove_refuses_this_coordinator_and_a_lone_one(tmp_path):
    state = StateDir(tmp_path)
    state.create()
    from meshrun.core.model import Network

    net = Network(
        "t", "10.213.0.0/16", "meshrun0", 51820, 1420, "10.213.0.1", "A" * 43 + "=", ("192.0.2.1:51820",), "0" * 64
    )
    state.write_json("member.json", rec(network=net.to_dict()))
    with pytest.raises(UsageError, match="b is this coordinator"):
        ha.remove(state, "b")
    state.write_json("member.json", rec(network=net.to_dict(), control=None))
    with pytest.raises(UsageError, match="this network has one coordinator"):
        ha.remove(state, "c")


class SlowToConfirm(FakeEtcd):
    """etcd under load: the first removal is applied but its answer times out; another is refused at first
    ("unhealthy cluster": a member came back moments ago) and applied when tried again."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self.tries = mode, 0

    def member_remove(self, member_id: int) -> None:
        self.tries += 1
        if self.mode == "unanswered" and self.tries == 1:
            super().member_remove(member_id)
            raise OutcomeUnknown("etcd at https://10.77.0.2:2379 did not answer the member remove (timed out)", "-")
        if self.mode == "unhealthy" and self.tries == 1 or self.mode == "never":
            raise ControlStateError("etcd at https://10.77.0.2:2379 refused the member remove: unhealthy cluster", "-")
        super().member_remove(member_id)


@pytest.mark.parametrize("mode", ["unanswered", "unhealthy"])
def test_an_etcd_member_removal_etcd_is_slow_to_confirm_is_made_sure_of(mode):
    etcd = SlowToConfirm(mode)
    gone = etcd.member_add(["https://10.77.0.9:2380"])
    ha.remove_etcd_member(etcd, "https://10.77.0.9:2380", timeout=10)
    assert gone.id not in {m.id for m in etcd.members()} and len(etcd.members()) == 1
    assert etcd.tries == (1 if mode == "unanswered" else 2)  # an applied removal is not sent again


def test_an_etcd_member_that_cannot_be_removed_is_an_error_after_the_timeout():
    etcd = SlowToConfirm("never")
    etcd.member_add(["https://10.77.0.9:2380"])
    with pytest.raises(ControlStateError, match="unhealthy cluster"):
        ha.remove_etcd_member(etcd, "https://10.77.0.9:2380", timeout=1.5)
    assert etcd.tries >= 2


def test_a_coordinator_without_a_majority_names_the_others_and_how_many_it_needs():
    others = [{"name": "dc2-a", "endpoint": "203.0.113.2:51820"}, {"name": "dc3-a", "endpoint": "203.0.113.3:51820"}]
    message, fix = ha.majority_wait(rec(control={"kind": "etcd", "endpoints": [], "others": others}))
    assert "a majority (2 of 3)" in message
    assert "`meshrun up` on dc2-a (203.0.113.2:51820), dc3-a (203.0.113.3:51820)" in fix
    assert "as soon as 1 of them answer" in fix
    five = [{"name": f"c{i}", "endpoint": f"203.0.113.{i}:51820"} for i in range(4)]
    assert "(3 of 5)" in ha.majority_wait(rec(control={"kind": "etcd", "others": five}))[0]


class Node:
    """A node's job API as `coordinator add` calls it: /v1/coordinator/reach offers the token on `port` (a real
    TokenListener on loopback), `foreign` another machine's listener there instead, `old` a meshrun without it."""

    def __init__(self, port: int, foreign: bool = False, old: bool = False) -> None:
        self.port, self.foreign, self.old, self.listeners = port, foreign, old, []

    def call(self, path: str, body: dict, timeout: float) -> dict:
        from meshrun.errors import CoordinatorError
        from meshrun.system.sockets import probe

        if self.old:
            raise CoordinatorError(f"no such endpoint POST {path}", "", status=404)
        token = b"x" * ha.REACH_TOKEN_BYTES if self.foreign else bytes.fromhex(body["token"])
        self.listeners.append(probe.TokenListener(self.port, token, 30))
        return {"port": self.port}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_endpoint_is_checked_against_the_node_before_anything_changes(monkeypatch):
    monkeypatch.setattr(ha, "ENROL_CHECK_S", 1.0)
    port = _free_port()
    node = Node(port)
    try:
        assert ha.check_reach(node.call, "dc6-a", f"127.0.0.1:{port}") is None
    finally:
        [x.close() for x in node.listeners]
    # Another machine answers at that address (the endpoint names the wrong one): refused, naming it.
    stranger = Node(port, foreign=True)
    try:
        assert ha.check_reach(stranger.call, "dc6-a", f"127.0.0.1:{port}") == "something other than dc6-a answers there"
    finally:
        [x.close() for x in stranger.listeners]
    # Nothing answers at the endpoint: the connection's own failure.
    elsewhere = Node(_free_port())
    try:
        assert "refused" in ha.check_reach(elsewhere.call, "dc6-a", f"127.0.0.1:{_free_port()}").lower()
    finally:
        [x.close() for x in elsewhere.listeners]
    said = []
    assert ha.check_reach(Node(port, old=True).call, "dc6-a", f"127.0.0.1:{port}", said.append) is None
    assert said and "older meshrun" in said[0]
