"""meshrun.jobs.nodeapi.Coordinators: with several coordinators, a node takes job requests from each of them,
each signed with the job key it shares with that coordinator, and from no one else (the member list the
agent keeps says who they are)."""

from __future__ import annotations

import json
import time

from meshrun.core import auth, keys
from meshrun.core.model import Member, Network
from meshrun.jobs.nodeapi import Coordinators, JobAPI
from meshrun.mesh import member
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel.fakefirewall import FakeFirewall
from meshrun.system.sockets.transport import Request


def make(tmp_path):
    node_priv = keys.generate_private_key()
    coord = {name: keys.generate_private_key() for name in ("first", "second")}
    net = Network(
        "t", "10.213.0.0/16", "meshrun0", 51820, 1420, "10.213.0.1", keys.public_key(coord["first"]),
        ("192.0.2.1:51820",), "0" * 64,
    )  # fmt: skip
    state = StateDir(tmp_path / "node")
    state.create()
    state.write("private.key", node_priv + "\n", secret=True)
    state.write_json(
        "member.json", {"role": "node", "name": "n1", "network": net.to_dict(), "overlay_ip": "10.213.0.5"}
    )
    members = [
        Member("first", keys.public_key(coord["first"]), "10.213.0.1", is_coordinator=True),
        Member("second", keys.public_key(coord["second"]), "10.213.0.9", is_coordinator=True),
        Member("n1", keys.public_key(node_priv), "10.213.0.5"),
        Member("n2", keys.public_key(keys.generate_private_key()), "10.213.0.6"),
    ]
    member.save_members(state, 3, members)
    api = JobAPI(state, net, "n1", Coordinators(state, net), guards=FakeFirewall())
    node_pub = keys.public_key(node_priv)

    def key_of(name: str) -> bytes:  # what coordinator `name` derives on its side
        priv = coord[name]
        return auth.job_key(keys.shared_secret(priv, node_pub), keys.public_key(priv), node_pub)

    return api, key_of, state, members


def health(api, caller: str, key: bytes) -> int:
    h = {"Authorization": auth.sign(key, "GET", "/v1/health", b"", time.time())}
    return api.handle(Request("GET", "/v1/health", caller, None, b"", h)).status


def test_every_coordinator_drives_jobs_with_its_own_key_and_nobody_else(tmp_path):
    api, key_of, _, _ = make(tmp_path)
    assert health(api, "10.213.0.1", key_of("first")) == 200
    assert health(api, "10.213.0.9", key_of("second")) == 200  # the job's new owner after a takeover
    assert health(api, "10.213.0.9", key_of("first")) == 401  # one coordinator's key from another's address
    assert health(api, "10.213.0.6", key_of("first")) == 403  # a member that is no coordinator
    assert api.coordinators.allowed("10.213.0.9") and not api.coordinators.allowed("10.213.0.6")


def test_a_coordinator_taken_out_is_refused_once_the_member_list_says_so(tmp_path):
    api, key_of, state, members = make(tmp_path)
    assert health(api, "10.213.0.9", key_of("second")) == 200
    demoted = [Member(m.name, m.public_key, m.overlay_ip) if m.name == "second" else m for m in members]
    member.save_members(state, 4, demoted)
    assert health(api, "10.213.0.9", key_of("second")) == 403
    assert json.loads((state / "peers.json").read_text())["version"] == 4
