"""End-to-end: three coordinators (state in etcd), and a machine lost mid-job: a node, then the coordinator
that started the job. The elastic DiLoCo job finishes on the nodes left with every rank on one model,
`meshrun logs` on another coordinator shows all of it, a new node joins through that coordinator, and a
relayed pair keeps or regains a live relay.

One world for both tests (they run in this order): dc1-a, dc2-a, dc3-a are public machines (1:1 NAT) and
become the coordinators A, B, C; dc4-a..dc8-a are nodes behind NAT, most of them symmetric, so pairs among
them are relayed. A node is lost as a preempted VM is (meshrun.lab.testbed.World.lose): every process
killed at once and its namespace deleted. The first coordinator goes down as a stopped VM does
(World.power_off: every process killed, its disk kept), and once it was removed for good it boots again.
"""

from __future__ import annotations

import json
import re
import signal
import time

import pytest
from support import CHARLM_SMALL, TrainJob, hang_guard

from meshrun.core import firewall as rules
from meshrun.lab.mesh import Mesh
from meshrun.lab.testbed import DatacenterSpec
from meshrun.mesh import process
from meshrun.mesh.coordinator import ha as ha_mod
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel import firewall
from meshrun.system.machine import procs

A, B, C = "dc1-a", "dc2-a", "dc3-a"
LOST_NODE = "dc5-a"  # the node whose machine the first test loses
A_NAME = "coordinator"  # the first coordinator's member name (`meshrun init`); B and C keep their nodes' names
NATS = {"dc4": "symmetric", "dc5": "symmetric", "dc6": "symmetric", "dc7": "cone", "dc8": "symmetric"}


def elastic(job_id: str, nodes: str) -> tuple[str, ...]:
    """An elastic (1:N) DiLoCo job of charlm on `nodes`, steps padded to 0.1 s: an outer step every 2 s."""
    return (
        "--job-id",
        job_id,
        "--nnodes",
        f"1:{len(nodes.split(','))}",
        "--nodes",
        nodes,
        "--max-restarts",
        "3",
        "--timeout",
        "120",
        "diloco_charlm.py",
        "--mode",
        "diloco",
        "--steps",
        "300",
        "--sync-every",
        "20",
        "--step-time",
        "0.1",
        *CHARLM_SMALL,
    )


@pytest.fixture(scope="module")
def ha(tmp_path_factory):
    from support import joined_mesh

    specs = [DatacenterSpec(f"dc{i}") for i in (1, 2, 3)] + [DatacenterSpec(dc, nat=nat) for dc, nat in NATS.items()]
    with joined_mesh(tmp_path_factory, specs, A, (B, C, "dc4-a", "dc5-a", "dc6-a"), promote=(B, C)) as mesh:
        yield mesh


def coordinators(mesh: Mesh, on: str) -> dict[str, dict]:
    return {r["name"]: r for r in json.loads(mesh.meshrun(on, "coordinator", "list", "--json").stdout)}


def wait(what: str, check, timeout: float, every: float = 1.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # a command that fails while the mesh settles: try again
            last = exc
        time.sleep(every)
    raise AssertionError(f"{what} not within {timeout:.0f} s (last: {last!r})")


def all_three_answering(mesh: Mesh, timeout: float = 60) -> None:
    """Wait until A's `coordinator list` has A, B and C, each with its etcd member answering."""
    rows = wait(
        "all three coordinators answering",
        lambda: (r := coordinators(mesh, A)) and all(x["etcd"] == "ok" for x in r.values()) and r,
        timeout,
    )
    assert set(rows) == {A_NAME, B, C}, rows


def pairs(mesh: Mesh, on: str) -> dict[frozenset, dict]:
    return {frozenset((p["a"], p["b"])): p for p in mesh.status(on)["pairs"]}


def digests(text: str, sync: int) -> dict[str, str]:
    return dict(re.findall(rf"\[(dc\d-a) r\d\] param_checksum rank=\d+ sync={sync} digest=(\w+)", text))


def outer_steps(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\] outer_step (\d+) ", text)]


def join_through(mesh: Mesh, coordinator: str, node: str) -> None:
    """A new node joins with a token made on `coordinator` (it names every coordinator, that one first)."""
    token = mesh.meshrun(coordinator, "token", "create", "--ttl", "10m").stdout.strip().splitlines()[-1]
    mesh.join(node, token=token)
    wait(
        f"{node} in {coordinator}'s member list",
        lambda: node in {p["name"] for p in mesh.status(coordinator)["peers"]},
        30,
    )


def job_guards(mesh: Mesh, node: str) -> list[str]:
    """The job guards' nftables tables in `node`'s namespace (each names the job's cgroup)."""
    out = mesh.world.node(node).run("nft", "list", "tables").stdout
    return rules.job_tables_in(out)


def test_three_coordinators_replicate_the_state_and_a_lost_node_leaves_the_job_finishing_on_the_rest(ha):
    mesh = ha
    rows = coordinators(mesh, B)
    assert set(rows) == {A_NAME, B, C} and all(r["etcd"] == "ok" for r in rows.values()), rows
    assert sum(r["role"] == "leader" for r in rows.values()) == 1, rows
    # The symmetric-NAT nodes cannot reach each other: their pairs are relayed, by a live member.
    relayed = wait(
        "dc4-a <-> dc5-a relayed",
        lambda: (p := pairs(mesh, B).get(frozenset(("dc4-a", "dc5-a")))) and p["path"] == "relayed" and p,
        90,
    )
    job = TrainJob(mesh, *elastic("ha-node", "dc4-a,dc5-a,dc6-a"))
    try:
        job.wait_for(r"\] outer_step 3 ", 240)
        guards = job_guards(mesh, LOST_NODE)
        assert guards, "the job runs on the node under no guard"
        mesh.world.lose(LOST_NODE)
        # Cgroups are host-wide: the lost machine's must not outlive its namespace on the test host.
        left = [t for t in guards if (firewall.cgroup2_root() / rules.CGROUP_PARENT / t).exists()]
        assert not left, left
        code = job.finish(420)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    text = job.text
    assert code == 0, text[-4000:]
    assert re.search(r"meshrun: job ha-node finished on 2 node\(s\) \(lost dc5-a mid-job", text), text[-3000:]
    d = digests(text, 15)
    assert set(d) == {"dc4-a", "dc6-a"} and len(set(d.values())) == 1, d
    # B kept its own copy of the job, which A ran: the whole output, A's own lines included.
    on_b = wait(
        "the job's end in B's logs", lambda: "finished on 2 node(s)" in (t := mesh.job_logs(B, "ha-node")) and t, 30
    )
    assert sorted(set(outer_steps(on_b))) == list(range(1, 16)), on_b[-3000:]
    assert digests(on_b, 15) == d
    assert "ha-node on 3 node(s)" in on_b  # A's launch line, through etcd
    assert mesh.job_record(B, "ha-node")["state"] == "succeeded"
    # A new node joins through B; the relayed pair that is left keeps a live relay.
    join_through(mesh, B, "dc7-a")
    assert relayed["relay"]
    after = wait(
        "dc4-a <-> dc6-a relayed",
        lambda: (p := pairs(mesh, B).get(frozenset(("dc4-a", "dc6-a")))) and p["path"] == "relayed" and p,
        60,
    )
    assert after["relay"] in {A_NAME, B, C, "dc7-a"}, after


# Try TCP connections from inside a namespace; print {target: "open" | "refused" | "silent"} as JSON.
TRY = r"""
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        out[target] = "open"
    except ConnectionRefusedError:
        out[target] = "refused"
    except OSError:
        out[target] = "silent"
print(json.dumps(out))
"""
ETCD_PORTS = (2379, 2380)


def try_connect(mesh: Mesh, where: str | None, targets: list[str]) -> dict[str, str]:
    """`TRY` run in node `where`, or in the internet namespace (None)."""
    from meshrun.lab.testbed import sh

    if where is None:
        out = sh(["ip", "netns", "exec", mesh.world.inet, mesh.python, "-c", TRY, *targets], timeout=120).stdout
    else:
        out = mesh.world.node(where).run(mesh.python, "-c", TRY, *targets, timeout=120).stdout
    return json.loads(out)


def test_a_coordinator_whose_enrolment_port_does_not_answer_is_not_added_and_nothing_changes(ha):
    """The operator names an endpoint where nothing answers (a public address nobody has): before anything
    changes, dc6-a offers a token on its future enrolment port and it is not found at that endpoint: refused,
    the same coordinators, dc6-a a node with no etcd running. A private address is refused before anything."""
    mesh = ha
    before = coordinators(mesh, B)
    private = mesh.meshrun(B, "coordinator", "add", "dc6-a", "--endpoint", "172.31.40.46", check=False)
    assert private.returncode != 0 and "--endpoint 172.31.40.46 is a private (RFC 1918) address" in private.stderr
    res = mesh.meshrun(B, "coordinator", "add", "dc6-a", "--endpoint", "203.0.113.250", check=False, timeout=300)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "TCP 203.0.113.250:51820 does not reach dc6-a" in res.stderr, res.stderr
    assert "nothing was changed" in res.stderr, res.stderr
    assert set(coordinators(mesh, B)) == set(before)
    wait(
        "dc6-a a node again", lambda: mesh.status("dc6-a")["role"] == "node" and mesh.status("dc6-a")["daemon_pid"], 60
    )
    assert '"etcd"' not in mesh.world.node("dc6-a").run("ss", "-tlnpH").stdout  # no etcd member left behind
    peers = {p["name"]: p for p in mesh.status("dc4-a")["peers"]}
    assert "dc6-a" in peers and not peers["dc6-a"]["coordinator"], peers  # dc4-a sees dc6-a as a node


def test_etcd_answers_the_coordinators_only_never_a_member_nor_the_internet(ha):
    """The attacker's side: etcd's client and peer ports on every coordinator, tried from the internet at the
    coordinators' public addresses, and from a member (a node, inside WireGuard) at their overlay addresses;
    the negative control is another coordinator, which gets through. Its listeners are bound to the overlay."""
    mesh = ha
    coords = [A, B, C]
    overlay = {n: mesh.overlay_ip(n) for n in coords}
    for n in coords:
        bound = mesh.world.node(n).run("ss", "-tlnpH").stdout
        etcd_lines = [line for line in bound.splitlines() if '"etcd"' in line]
        assert etcd_lines and all(f"{overlay[n]}:" in line.split()[3] for line in etcd_lines), bound
    internet = try_connect(mesh, None, [f"{mesh.world.node(n).public_ip}:{p}" for n in coords for p in ETCD_PORTS])
    assert set(internet.values()) <= {"refused", "silent"}, internet
    member = try_connect(mesh, "dc4-a", [f"{overlay[n]}:{p}" for n in coords for p in ETCD_PORTS])
    assert set(member.values()) == {"silent"}, member  # the guard drops a member's SYN: not even a refusal
    peer = try_connect(mesh, C, [f"{overlay[n]}:{p}" for n in (A, B) for p in ETCD_PORTS])
    assert set(peer.values()) == {"open"}, peer  # negative control: a coordinator reaches them
    # ... and a coordinator's overlay API is still open to members (its sync), the guard is etcd's alone.
    assert try_connect(mesh, "dc4-a", [f"{overlay[B]}:51821"]) == {f"{overlay[B]}:51821": "open"}


def test_a_coordinator_whose_machine_stops_and_starts_again_comes_back_with_meshrun_up(ha):
    """C's machine goes down (every process killed, /run emptied, its disk kept) and comes back: `meshrun up`
    there brings its interface up with the peers it last knew before its etcd member needs them, and all three
    coordinators answer again. (Before, the interface came up with no peer and etcd waited for the others
    through it: `up` failed after 60 s and C stayed unreachable.)"""
    mesh = ha
    # A job started before the reboot (submitted on B, on two nodes) finishes across it.
    job = TrainJob(
        mesh,
        *("--job-id", "ha-reboot", "--nnodes", "2", "--nodes", "dc4-a,dc6-a", "--timeout", "120"),
        *("diloco_charlm.py", "--mode", "diloco", "--steps", "160", "--sync-every", "20", "--step-time", "0.1"),
        *CHARLM_SMALL,
        on=B,
    )
    job.wait_for(r"\] outer_step 1 ", 240)
    mesh.world.power_off(C)
    wait("C seen as unreachable", lambda: coordinators(mesh, A)[C]["etcd"] == "unreachable", 60)
    # A node's doctor asks the coordinators, as its status does (by handshake age it said all 3 were heard
    # from for three minutes).
    seen = only_check(mesh, "dc4-a", "coordinators")
    assert seen["level"] == "warn" and f"coordinator {C} not heard from" in seen["detail"], seen
    mesh.world.power_on(C)
    on = time.monotonic()
    back = mesh.meshrun(C, "up", check=False, timeout=120)
    assert back.returncode == 0, back.stdout + back.stderr
    all_three_answering(mesh)
    print(f"{C} back in `coordinator list` {time.monotonic() - on:.1f} s after it powered on")
    mesh.wait_ping("dc4-a", mesh.overlay_ip(C), timeout=60)
    code = job.finish(240)
    assert code == 0 and sorted(set(outer_steps(job.text))) == list(range(1, 9)), job.text[-4000:]


def test_a_whole_site_power_cut_comes_back_with_meshrun_up_on_each_coordinator_in_turn(ha):
    """All three coordinators' machines go down at once and come back; the operator runs `meshrun up` on one,
    then the next. The first has no etcd majority: its `up` returns at once saying what it waits for and on
    whom, its daemon and etcd member left running (before, `up` failed after 60 s and stopped its member, so
    every later `up` found no majority either: the control plane was gone for good). The second `up` makes a
    majority and both serve; then the third, and a node reaches them all again."""
    mesh = ha
    for c in (A, B, C):
        mesh.world.power_off(c)
    for c in (A, B, C):
        mesh.world.power_on(c)
    t0 = time.monotonic()
    first = mesh.meshrun(A, "up", check=False, timeout=120)
    took = time.monotonic() - t0
    assert first.returncode == 0, first.stdout + first.stderr
    assert "not serving yet" in first.stdout, first.stdout
    assert "a majority (2 of 3)" in first.stderr and f"`meshrun up` on {B} (" in first.stderr, first.stderr
    assert took < ha_mod.HEALTHY_TIMEOUT_S, took  # told, not timed out
    again = mesh.meshrun(A, "up")  # a second `up` finds the waiting daemon, and says it still waits (not "up at")
    assert "already running" in again.stdout and "not serving yet" in again.stdout, again.stdout
    assert "a majority (2 of 3)" in again.stderr, again.stderr
    for c in (B, C):
        back = mesh.meshrun(c, "up", check=False, timeout=120)
        assert back.returncode == 0 and " up at " in back.stdout, back.stdout + back.stderr
    all_three_answering(mesh)
    print(f"the first `up` returned in {took:.1f} s; all three back {time.monotonic() - t0:.1f} s after it began")
    for c in (A, B, C):
        mesh.wait_ping("dc4-a", mesh.overlay_ip(c), timeout=60)


def test_the_coordinator_that_started_an_elastic_job_is_lost_and_the_job_finishes_from_another(ha):
    mesh = ha
    state_b = StateDir(mesh.state_dir(mesh.world.node(B)))
    job = TrainJob(mesh, *elastic("ha-coord", "dc4-a,dc6-a"))
    wait(
        "the pair dc4-a <-> dc6-a relayed",
        lambda: (p := pairs(mesh, B).get(frozenset(("dc4-a", "dc6-a")))) and p["path"] == "relayed" and p,
        60,
    )
    job.wait_for(r"\] outer_step 4 ", 240)
    steps_before = max(outer_steps(job.text))
    led = coordinators(mesh, B)[A_NAME]["role"] == "leader"
    lost_at = time.time()
    mesh.world.power_off(A)  # the machine the job was submitted on, with its `meshrun train`
    if led:  # its leader key outlives it for a few seconds: `coordinator list` called it "leader" meanwhile
        role = coordinators(mesh, B)[A_NAME]["role"]
        print(f"the lost leader {A_NAME} listed as {role!r} {time.time() - lost_at:.1f} s after its power-off")
        assert role.startswith("lost leader") or role == "follower", role
    job.finish(30)

    def progress() -> float | None:
        """When B first saw an outer step after the loss beyond the last one before it (mirror timestamps)."""
        out = []
        for path in (state_b.path / "jobs" / "ha-coord" / "logs").glob("dc*.log"):
            for line in path.read_text(errors="replace").splitlines():
                m = re.match(r"^(\d+) .*\] outer_step (\d+) ", line)
                if m and int(m.group(2)) > steps_before and int(m.group(1)) / 1000 > lost_at:
                    out.append(int(m.group(1)) / 1000 - lost_at)
        return min(out) if out else None

    try:
        # A is the leader and often the pair's relay. The timing is measured by benchmarks/ha_failover.py
        # (2026-11-27: 1.9-3.8 s in 10 rounds), not asserted here: a loaded CI machine once took more than
        # 180 s, when a relay moved only once a new leader heard of it.
        recovered = wait("progress after the loss", progress, 300)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{mesh.diagnose(B, 'ha-coord')}") from None
    print(f"progress again {recovered:.1f} s after the loss of {A}")
    rec = wait("the job's end, seen on B", lambda: (r := mesh.job_record(B, "ha-coord")).get("state") in (
        "succeeded", "failed") and r, 420, every=3)  # fmt: skip
    text = mesh.job_logs(B, "ha-coord")
    assert rec["state"] == "succeeded", text[-4000:]
    assert re.search(r"coordinator dc[23]-a took the job over", text), text[-3000:]
    assert sorted(set(outer_steps(text))) == list(range(1, 16)), text[-3000:]
    d = digests(text, 15)
    assert set(d) == {"dc4-a", "dc6-a"} and len(set(d.values())) == 1, d
    # B and C carry on: one leads, A is unreachable, a majority of etcd answers.
    rows = wait(
        "a new leader",
        lambda: (r := coordinators(mesh, B)) and any(x["role"] == "leader" for x in r.values()) and r,
        30,
    )
    assert rows[A_NAME]["etcd"] == "unreachable" and rows[B]["etcd"] == rows[C]["etcd"] == "ok", rows
    # Every member sees the loss: a coordinator's status and a node's name the lost coordinator.
    for on in (B, "dc4-a"):
        warnings = mesh.status(on)["warnings"]
        assert any(f"coordinator {A_NAME} not heard from" in w and "2 of 3" in w for w in warnings), (on, warnings)
    # The relayed pair has a live relay again (not A), and a new node joins through B.
    # (Waited for, not read once: the pair may be in a scheduled try of direct at that moment, which two
    # symmetric NATs fail within seconds; run F on 2026-11-30 read it as "direct (public)" mid-try.)
    wait(
        "dc4-a <-> dc6-a relayed by a live member",
        lambda: (p := pairs(mesh, B).get(frozenset(("dc4-a", "dc6-a"))))
        and p["path"] == "relayed"
        and p["relay"] not in (None, A_NAME)
        and p,
        60,
    )
    join_through(mesh, B, "dc8-a")
    mesh.wait_ping("dc8-a", mesh.overlay_ip("dc4-a"), timeout=60)  # raises if no answer comes within 60 s
    # B's doctor names the lost coordinator and the way out. Then C's etcd member dies too, with C's daemon
    # held (SIGSTOP) so that it cannot start it again yet: no majority, and B's doctor says so; C's daemon,
    # let go, starts its member again and the majority is back. (Every PID is one C's coordinator recorded.)
    assert "meshrun coordinator remove coordinator" in control_check(mesh, B)["fix"]
    state_c = StateDir(mesh.state_dir(mesh.world.node(C)))
    daemon_c = mesh.status(C)["daemon_pid"]
    assert procs.signal_pid(daemon_c, signal.SIGSTOP)
    try:
        assert procs.signal_pid(int((state_c / "etcd" / "etcd.pid").read_text()), signal.SIGKILL)
        lost_quorum = wait(
            "B's doctor to see no majority", lambda: (c := control_check(mesh, B))["level"] == "FAIL" and c, 60
        )
        assert "no majority" in lost_quorum["detail"] and "--force-new-cluster" in lost_quorum["fix"], lost_quorum
    finally:
        procs.signal_pid(daemon_c, signal.SIGCONT)
    wait("a majority again", lambda: control_check(mesh, B)["level"] == "warn", 90)


def only_check(mesh: Mesh, on: str, name: str) -> dict:
    """`meshrun doctor --json`'s check `name` on `on`."""
    res = mesh.meshrun(on, "doctor", "--json", check=False, timeout=120)
    return next(c for c in json.loads(res.stdout)["checks"] if c["name"] == name)


def control_check(mesh: Mesh, on: str) -> dict:
    return only_check(mesh, on, "control")


def test_back_to_one_coordinator_with_every_member_kept(ha):
    """After the loss: the lost coordinator taken out (it no longer answers: it leaves the network), then C (a
    node again); B is the one coordinator left, its state back in SQLite, and no member was lost."""
    mesh = ha
    before = {p["name"] for p in mesh.status(B)["peers"]}
    # A coordinator that does not answer may be rebooting: without --force (and no terminal to ask at) it stays.
    refused = mesh.meshrun(B, "coordinator", "remove", A_NAME, timeout=120, check=False)
    assert refused.returncode != 0 and f"meshrun coordinator remove {A_NAME} --force" in refused.stderr, refused
    assert set(coordinators(mesh, B)) == {A_NAME, B, C}
    out = mesh.meshrun(B, "coordinator", "remove", A_NAME, "--force", timeout=120).stdout
    assert "did not answer: removed from the network" in out, out
    assert "two coordinators" in out, out  # B and C are left: etcd needs both
    # A's machine boots again, its disk as it was: the others tell it (on their public ports: no member's
    # WireGuard knows it any more) that it was removed, and it starts no etcd member, no interface, no daemon.
    mesh.world.power_on(A)
    back = mesh.meshrun(A, "up", check=False, timeout=120)
    assert back.returncode != 0, back.stdout + back.stderr
    assert "was removed from the network for good while it was away" in back.stderr, back.stderr
    assert "meshrun down --purge" in back.stderr, back.stderr
    state_a = StateDir(mesh.state_dir(mesh.world.node(A)))
    assert '"etcd"' not in mesh.world.node(A).run("ss", "-tlnpH").stdout  # no etcd member came back
    assert "meshrun0" not in mesh.world.node(A).run("ip", "-o", "link").stdout
    assert ha_mod.etcd_pid(state_a) is None and process.pid(state_a) is None
    # There, status, doctor and `coordinator list` say so at once (they asked an etcd that had left it, 26 s, and
    # suggested `meshrun up`, which refuses, or removing a live coordinator) and suggest only what works there.
    t = time.monotonic()
    st = mesh.status(A)
    assert st["removed"] and st["peers"] == [] and st["pairs"] == [] and st["coordinators"] == [], st
    assert len(st["warnings"]) == 1 and f"{B} says this coordinator ({A_NAME}) was removed" in st["warnings"][0], st
    doc = json.loads(mesh.meshrun(A, "doctor", "--json", check=False, timeout=120).stdout)
    assert [(c["name"], c["level"]) for c in doc["checks"]] == [("membership", "FAIL")], doc
    listed = mesh.meshrun(A, "coordinator", "list", check=False, timeout=120)
    assert listed.returncode != 0 and "was removed from the network for good" in listed.stderr, listed
    for said in (st["warnings"][0], doc["checks"][0]["fix"], listed.stderr):
        assert "meshrun down --purge" in said and "meshrun up" not in said and "coordinator remove" not in said, said
    assert time.monotonic() - t < hang_guard(5), "a removed coordinator's own commands waited on the network"
    mesh.meshrun(A, "down", "--purge", timeout=60)
    out = mesh.meshrun(B, "coordinator", "remove", C, timeout=180).stdout
    assert f"{C} is a node again" in out and "back in SQLite" in out, out
    rows = json.loads(mesh.meshrun(B, "coordinator", "list", "--json").stdout)
    assert [(r["name"], r["role"]) for r in rows] == [(B, "only (state in SQLite)")], rows
    state_b = StateDir(mesh.state_dir(mesh.world.node(B)))
    assert (state_b / "coordinator.db").exists() and not (state_b / "etcd").exists()
    wait(f"{C}'s agent", lambda: mesh.status(C)["role"] == "node" and mesh.status(C)["daemon_pid"], 60)
    wait(
        "B's peers: every member but the lost one",
        lambda: {p["name"] for p in mesh.status(B)["peers"]} == before - {A_NAME},
        30,
    )
    for n in sorted(before - {A_NAME, B, LOST_NODE}):  # every member still there reaches B over the overlay
        mesh.wait_ping(n, mesh.overlay_ip(B), timeout=60)  # raises if no answer comes within 60 s
    # A new token (made now) names B alone, and a node joins with it.
    token = mesh.meshrun(B, "token", "create").stdout.strip().splitlines()[-1]
    from meshrun.core.token import parse_token

    assert parse_token(token).others == ()
