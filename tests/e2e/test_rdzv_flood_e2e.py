"""End-to-end, the attacker's side (issue 35, item 4): a job's node floods its job's rendezvous at one of three
coordinators (state in etcd) with the largest values it takes, as fast as its overlay API lets it. It is
refused (429 at its write budget), and meanwhile a node joins, the operator removes another node, a second job
runs to its end, and the operator removes the attacker itself.

dc1-a, dc2-a, dc3-a are public machines that become the coordinators; dc4-a (the attacker), dc5-a (the second
job's node) and dc6-a (joins during the flood, then removed) sit behind NAT.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from meshrun.lab.mesh import Mesh
from meshrun.lab.testbed import DatacenterSpec
from meshrun.mesh.coordinator.rendezvous import MAX_VALUE, WRITE_BURST, WRITE_PER_S

A, B, C = "dc1-a", "dc2-a", "dc3-a"
ATTACKER, WORKER, NEWCOMER = "dc4-a", "dc5-a", "dc6-a"
# The flood's longest run, a cap only: it stops once the attacker is removed. The control plane's steps under it
# (a join, a second job, a removal) took more than 240 s on a slow machine, and the flood ended first.
FLOOD_S = 600

# Run in the attacker's namespace: POST /v1/rdzv/<job> set ops of the largest value the service takes to one
# coordinator (the budget is per coordinator: one is the quickest to exhaust through wireguard-go), on FLOODERS
# connections at once (one alone, beside a busy CI worker, wrote no faster than the budget refills: 11 a second),
# until the time is up or it is removed (403/410, or no answer at all once the coordinators dropped its WireGuard
# peer, for 30 s: a coordinator slowed by the test's other work may miss a few answers); prints "refused" at the
# first 429, then the answers' statuses as JSON ("None": no answer).
FLOODERS = 4
FLOOD = f"""
import base64, collections, json, os, sys, threading, time
from meshrun.errors import MeshrunError
from meshrun.mesh import member
from meshrun.mesh.coordinator.rendezvous import MAX_VALUE
from meshrun.system.files.statedir import StateDir
from meshrun.system.sockets import transport
job, port, seconds, ip = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
key = member.OverlayKeys(StateDir(sys.argv[5])).by_ip(ip)  # root on a job node: it signs as torchrun's agent does
value = base64.b64encode(os.urandom(MAX_VALUE)).decode()
seen, lock, deadline = collections.Counter(), threading.Lock(), time.monotonic() + seconds
state = {{"gone": 0, "answered": time.monotonic()}}  # unanswered in a row; the last 200 or 429

def flood(n):
    sent = 0
    while time.monotonic() < deadline and not (state["gone"] >= 6 and time.monotonic() - state["answered"] > 30):
        body = {{"op": "set", "key": f"flood/{{n}}/{{sent % 4}}", "value": value}}
        try:
            transport.call(ip, port, "POST", f"/v1/rdzv/{{job}}", body, timeout=3, key=key)
            status = "200"
        except MeshrunError as exc:
            status = str(exc.status)
        with lock:
            seen[status] += 1
            if status == "429" and seen["429"] == 1:
                print("refused", flush=True)  # at its budget: the test tries the control plane from now on
            state["gone"] = state["gone"] + 1 if status in ("None", "403", "410") else 0
            if status in ("200", "429"):
                state["answered"] = time.monotonic()
        sent += 1

threads = [threading.Thread(target=flood, args=(n,)) for n in range({FLOODERS})]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(seen), flush=True)
"""

SLEEPER = "import time\nprint('flood job up', flush=True)\ntime.sleep(600)\n"
HELLO = "print('second job ran', flush=True)\n"


@pytest.fixture(scope="module")
def ha(tmp_path_factory):
    from support import joined_mesh

    specs = [DatacenterSpec(f"dc{i}") for i in range(1, 4)] + [DatacenterSpec(f"dc{i}", nat="cone") for i in (4, 5, 6)]
    with joined_mesh(tmp_path_factory, specs, A, (B, C, ATTACKER, WORKER), promote=(B, C)) as mesh:
        yield mesh


def project(mesh: Mesh, name: str, script: str) -> str:
    d = mesh.world.workdir / name
    d.mkdir(exist_ok=True)
    (d / "main.py").write_text(script)
    return str(d)


def train(mesh: Mesh, job_id: str, node: str, script: str) -> subprocess.Popen:
    return mesh.meshrun_popen(
        A,
        "train",
        "--job-id",
        job_id,
        "--nnodes",
        "1",
        "--nodes",
        node,
        "--timeout",
        "180",
        "main.py",
        cwd=project(mesh, job_id, script),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


# An unprivileged user's request to an overlay API, sent from a member (its overlay address): "STATUS BODY".
NOBODY_POST = """
import http.client, sys
host, port, path, body = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].encode()
c = http.client.HTTPConnection(host, port, timeout=20)
c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
r = c.getresponse()
print(r.status, r.read().decode(errors="replace")[:400])
"""


def nobody_post(mesh: Mesh, node: str, ip: str, port: int, path: str, body: dict) -> tuple[int, str]:
    argv = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3", "-c", NOBODY_POST]
    out = mesh.world.node(node).run(*argv, ip, str(port), path, json.dumps(body), timeout=60).stdout
    status, _, text = out.strip().partition(" ")
    return int(status), text


def test_a_members_other_users_are_refused_by_the_coordinators(ha):
    """Issue 58: an unprivileged user on a member sends with the member's overlay address, which named the caller.
    Now the requests that change something need a MAC only root can make: `nobody` on a coordinator cannot demote
    another (before: 200, and it stopped its etcd member and deleted its data) nor forward reports to the leader,
    and `nobody` on a node can neither sync, report a relay down, nor write a job's rendezvous (which torchrun's
    root agents unpickle); each gets 403 and nothing changes."""
    mesh = ha
    net = json.loads((mesh.state_dir(mesh.world.node(A)) / "member.json").read_text())["network"]
    b_ip, a_ip = mesh.overlay_ip(B), mesh.overlay_ip(A)
    refused = [
        (A, b_ip, "/v1/coordinators/demote", {}),
        (A, b_ip, "/v1/forward", {"reports": []}),
        (ATTACKER, a_ip, "/v1/sync", {"version": 0, "peers": {}, "full": True}),
        (ATTACKER, a_ip, "/v1/relay-down", {"peers": [], "via": ""}),
        (ATTACKER, b_ip, "/v1/rdzv/flood", {"op": "set", "key": "torch.rendezvous.flood.0/x", "value": "eA=="}),
    ]
    for node, ip, path, body in refused:
        status, text = nobody_post(mesh, node, ip, net["api_port"], path, body)
        assert status == 403 and "not signed" in text, (node, path, status, text)
    assert json.loads((mesh.state_dir(mesh.world.node(B)) / "member.json").read_text())["role"] == "coordinator"
    names = {c["name"] for c in json.loads(mesh.meshrun(A, "coordinator", "list", "--json").stdout)}
    assert len(names) == 3 and {B, C} <= names, names  # the first is named "coordinator"


@pytest.mark.load
def test_a_flooding_job_node_is_refused_and_the_control_plane_goes_on(ha):
    mesh = ha
    api_port = json.loads((mesh.state_dir(mesh.world.node(A)) / "member.json").read_text())["network"]["api_port"]
    job = train(mesh, "flood", ATTACKER, SLEEPER)
    try:
        deadline = time.monotonic() + 120
        first = ""
        while "flood job up" not in first:  # the job's rendezvous is done and its script runs
            assert job.poll() is None and time.monotonic() < deadline, first
            first += job.stdout.readline()
        flood = mesh.world.node(ATTACKER).popen(
            mesh.python,
            "-c",
            FLOOD,
            "flood",
            str(api_port),
            str(FLOOD_S),
            mesh.overlay_ip(B),  # a coordinator other than the one that started the job
            str(mesh.state_dir(mesh.world.node(ATTACKER))),
            stdout=subprocess.PIPE,
            text=True,
        )
        started = time.monotonic()
        # The flood runs into its budget at that coordinator (WRITE_BURST, then WRITE_PER_S) ...
        assert flood.stdout.readline().strip() == "refused", "the flood was never refused"
        # ... and goes on while the control plane is tried.
        # A node joins, a second job runs to its end, the operator removes a node: all during the flood.
        token = mesh.meshrun(A, "token", "create", "--ttl", "10m").stdout.strip().splitlines()[-1]
        mesh.join(NEWCOMER, token=token)
        second = train(mesh, "second", WORKER, HELLO)
        out, _ = second.communicate(timeout=180)
        assert second.returncode == 0 and "second job ran" in out, out
        assert f"removed {NEWCOMER}" in mesh.meshrun(A, "remove", NEWCOMER).stdout
        assert flood.poll() is None, "the flood ended before the control plane was tried under it"
        # The operator removes the attacker, mid-flood; its requests are refused from then on.
        assert f"removed {ATTACKER}" in mesh.meshrun(A, "remove", ATTACKER).stdout
        seen = json.loads(flood.communicate(timeout=120)[0].strip().splitlines()[-1])
        took = time.monotonic() - started
    finally:
        job.kill()
        job.wait()
    # The negative control: the flood was on, and the budget refused it (429) after what it may write.
    assert seen.get("429", 0) > 0 and seen.get("200", 0) > 0, seen
    assert seen.get("403", 0) + seen.get("410", 0) + seen.get("None", 0) >= 6, seen  # cut off once removed
    # What got through is what the budget allows: WRITE_BURST, then WRITE_PER_S.
    assert seen.get("200", 0) * MAX_VALUE <= WRITE_BURST + WRITE_PER_S * took + FLOODERS * MAX_VALUE, (seen, took)
