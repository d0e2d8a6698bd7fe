"""From the attacker's side: what answers from the internet, who can control jobs, a flooded enrolment port.

A 3-datacenter 1:1-NAT world (dc1-a coordinator; dc2-a, dc3-a nodes) with the real meshrun,
wireguard-go and torch. The "internet" is the world's inet namespace; 1:1 NAT forwards every port
of a member's public address to it, so whatever listens on a wildcard address is reachable.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support import REPO_ROOT, hang_guard, joined_mesh

from meshrun.core import auth
from meshrun.lab.mesh import Mesh
from meshrun.lab.testbed import sh
from meshrun.mesh import member
from meshrun.system.files.statedir import StateDir
from meshrun.system.machine.procs import alive

EXAMPLES = REPO_ROOT / "examples"
MEMBERS = ("dc1-a", "dc2-a", "dc3-a")

# Run in the internet namespace: try every host:port given, print the ones that accept a connection.
SCAN = r"""
import socket, sys, json
open_ = []
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1.5).close()
        open_.append(target)
    except OSError:
        pass
print(json.dumps(open_))
"""

# Run in the internet namespace: hold N idle connections and spray garbage "TLS" until killed.
FLOOD = r"""
import os, socket, sys, threading, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
idle = []
def hold():
    while True:
        try:
            idle.append(socket.create_connection((host, port), timeout=2))
        except OSError:
            time.sleep(0.01)
        if len(idle) >= n:
            for s in idle[: n // 4]:        # recycle a quarter: the slots they held free up, we take them again
                s.close()
            del idle[: n // 4]
            time.sleep(0.5)
def spray():
    while True:
        try:
            with socket.create_connection((host, port), timeout=2) as s:
                s.sendall(b"\x16\x03\x01\x02\x00\x01" + os.urandom(500))
                s.settimeout(1)
                s.recv(100)
        except OSError:
            pass
for f in [hold] + [spray] * 4:
    threading.Thread(target=f, daemon=True).start()
print("flooding", flush=True)
time.sleep(3600)
"""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with joined_mesh(tmp_path_factory, 4, "dc1-a", ("dc2-a", "dc3-a")) as m:
        yield m


def listeners(mesh: Mesh, name: str, proto: str = "t") -> list[tuple[str, int]]:
    """(local address, port) of every socket listening (TCP) or bound (UDP) in the member's namespace."""
    out = mesh.world.node(name).run("ss", f"-{proto}lnH").stdout
    found = []
    for line in out.splitlines():
        local = line.split()[3]
        host, _, port = local.rpartition(":")
        found.append((host.split("%")[0].strip("[]"), int(port)))
    return found


def scan(mesh: Mesh) -> dict[str, list[str]]:
    """Every TCP port any member listens on, tried at that member's public address from the internet."""
    targets = [f"{mesh.world.node(n).public_ip}:{port}" for n in MEMBERS for _, port in listeners(mesh, n)]
    res = sh(["ip", "netns", "exec", mesh.world.inet, mesh.python, "-c", SCAN, *sorted(set(targets))], timeout=300)
    return {"tried": sorted(set(targets)), "open": json.loads(res.stdout)}


def assert_only_enrolment_answers(mesh: Mesh, when: str) -> None:
    result = scan(mesh)
    coord = f"{mesh.world.node('dc1-a').public_ip}:51820"
    assert result["open"] == [coord], f"{when}: tried {result['tried']}, answered {result['open']}"
    for n in MEMBERS:  # UDP: only WireGuard is bound to anything but the overlay or loopback
        for host, port in listeners(mesh, n, "u"):
            assert port == 51820 or host.startswith(("10.213.", "127.")), f"{when}: {n} has UDP {host}:{port}"


LONG = (
    "ddp_train.py",
    "--epochs",
    "100",
    "--steps-per-epoch",
    "20",
    "--sleep-per-step",
    "0.1",
    "--log-steps",
    "--checkpoint",
    "",
)


def start_job(mesh: Mesh) -> tuple[str, subprocess.Popen]:
    res = mesh.meshrun(mesh.coordinator, "train", "--detach", *LONG, cwd=EXAMPLES)
    job = res.stdout.strip().splitlines()[-1]
    follow = mesh.meshrun_popen(
        mesh.coordinator, "logs", "-f", job, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 120
    for line in follow.stdout:
        if re.search(r"\] step 3\b", line):
            break
        assert time.monotonic() < deadline, "the job did not reach step 3"
    return job, follow


def test_the_scan_sees_a_wildcard_listener(mesh):
    """Negative control: what torch's own TCPStore does (bind the wildcard) is found from the internet."""
    node = mesh.world.node("dc2-a")
    probe = node.popen(
        mesh.python,
        "-c",
        "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', 39999)); "
        "s.listen(); print('up', flush=True); time.sleep(60)",
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert probe.stdout.readline().strip() == "up"
        assert f"{node.public_ip}:39999" in scan(mesh)["open"]
    finally:
        probe.kill()
        probe.wait()


def test_only_wireguard_and_enrolment_answer_from_the_internet_during_and_after_jobs(mesh):
    assert_only_enrolment_answers(mesh, "before any job")
    job, follow = start_job(mesh)
    try:
        listening = {n: listeners(mesh, n) for n in MEMBERS}
        # the job's own listeners exist, and are on overlay addresses: its store, the agent store, gloo
        assert any(port > 29400 and host == "10.213.0.1" for host, port in listening["dc1-a"]), listening
        assert sum(1 for n in ("dc2-a", "dc3-a") for h, p in listening[n] if h.startswith("10.213.")) >= 4, listening
        assert_only_enrolment_answers(mesh, "while a job runs")
        assert "cancelled" in mesh.meshrun(mesh.coordinator, "cancel", job).stdout
    finally:
        follow.kill()
        follow.wait()
    assert_only_enrolment_answers(mesh, "after the job ended")
    # A job whose processes all die by SIGKILL leaves nothing behind either (nothing to clean up).
    job, follow = start_job(mesh)
    try:
        import os

        for n in MEMBERS:
            for pid in (int(p) for p in sh(["ip", "netns", "pids", mesh.world.node(n).netns]).stdout.split()):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if any(k in cmd for k in (b"meshrun.jobs.", b"multiprocessing", b"ddp_train")):
                    os.kill(pid, signal.SIGKILL)
    finally:
        follow.kill()
        follow.wait()
    time.sleep(2)
    assert_only_enrolment_answers(mesh, "after a job was SIGKILLed")


def _job_api_request(method: str, path: str, body: bytes, auth_header: str | None) -> bytes:
    head = [f"{method} {path} HTTP/1.0", "Content-Type: application/json", f"Content-Length: {len(body)}"]
    if auth_header:
        head.append(f"Authorization: {auth_header}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _send_raw(mesh: Mesh, host: str, data: bytes, user: str = "root") -> str:
    """Send `data` to host:51821 from the coordinator's namespaces with bash's /dev/tcp (as `user`)."""
    payload = base64.b64encode(data).decode()
    script = f"exec 3<>/dev/tcp/{host}/51821 && echo {payload} | base64 -d >&3 && cat <&3"
    argv = ["bash", "-c", script]
    if user != "root":
        argv = ["setpriv", f"--reuid={user}", "--regid=nogroup", "--clear-groups", *argv]
    return mesh.world.node("dc1-a").run(*argv, check=False, timeout=30).stdout


def test_a_local_user_on_the_coordinator_cannot_control_jobs_and_replays_are_refused(mesh):
    node_ip = mesh.overlay_ip("dc2-a")
    coord_state = mesh.state_dir(mesh.coordinator)
    marker = Path(f"/tmp/meshrun-forged-{secrets.token_hex(4)}")
    body = json.dumps({"argv": ["touch", str(marker)], "env": {}}).encode()
    path = "/v1/jobs/forged/start"
    # The unprivileged user can connect from the coordinator's overlay address, but cannot read the private
    # key the job keys are derived from ...
    denied = mesh.world.node("dc1-a").run(
        "setpriv",
        "--reuid=nobody",
        "--regid=nogroup",
        "--clear-groups",
        "cat",
        str(coord_state / "private.key"),
        check=False,
    )
    assert denied.returncode != 0 and "denied" in denied.stderr.lower()
    # ... so an unsigned request, or one signed with a guessed key, is refused and starts nothing.
    for header in (None, auth.sign(bytes(32), "POST", path, body, time.time())):
        reply = _send_raw(mesh, node_ip, _job_api_request("POST", path, body, header), user="nobody")
        assert reply.startswith("HTTP/1.0 401"), reply
    time.sleep(1)
    assert not marker.exists()
    assert not (mesh.state_dir(mesh.world.node("dc2-a")) / "jobs" / "forged").exists()
    # Root signs a request as `meshrun train` would: accepted once, refused when replayed byte for byte.
    node_pub = json.loads((mesh.state_dir(mesh.world.node("dc2-a")) / "member.json").read_text())["public_key"]
    key = member.job_key(StateDir(coord_state), node_pub)
    health = _job_api_request("GET", "/v1/health", b"", auth.sign(key, "GET", "/v1/health", b"", time.time()))
    assert _send_raw(mesh, node_ip, health).startswith("HTTP/1.0 200")
    replay = _send_raw(mesh, node_ip, health)
    assert replay.startswith("HTTP/1.0 401") and "already used once" in replay, replay
    log = (mesh.state_dir(mesh.world.node("dc2-a")) / "daemon.log").read_text()
    assert re.search(
        r"WARNING meshrun.jobs.nodeapi: refused job request POST /v1/jobs/forged/start from "
        r"10\.213\.0\.1: the request is not signed",
        log,
    ), log[-2000:]


@pytest.mark.load
def test_a_join_succeeds_while_the_enrolment_port_is_flooded(mesh, tmp_path):
    coord = mesh.world.node("dc1-a")
    daemon = mesh.status(coord)["daemon_pid"]
    flood = subprocess.Popen(
        ["ip", "netns", "exec", mesh.world.inet, mesh.python, "-c", FLOOD, str(coord.public_ip), "51820", "500"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert flood.stdout.readline().strip() == "flooding"
        time.sleep(3)  # 500 idle connections and the spray are in place
        threads = _threads(daemon)
        token = mesh.meshrun(coord, "token", "create", "--uses", "1").stdout.strip()
        node = mesh.world.node("dc4-a")
        t0 = time.monotonic()
        res = mesh.join(node, token=token)
        took = time.monotonic() - t0
        threads_after = _threads(daemon)
        # A join takes 1-3 s here unflooded; the flood must not starve it (which would be its 35 s timeouts in
        # a row): a hang guard, not the join-time target (benchmarks/time_to_mesh.py).
        assert "joined" in res.stdout and took < hang_guard(10), (
            f"join took {took:.1f} s under the flood; coordinator threads {threads} -> {threads_after}"
        )
        assert threads_after <= 40, f"the coordinator grew to {threads_after} threads (join took {took:.1f} s)"
        assert alive(daemon)
    finally:
        flood.send_signal(signal.SIGKILL)
        flood.wait()
    mesh.wait_ping("dc4-a", mesh.overlay_ip("dc2-a"), timeout=30)


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))


def test_daemon_logs_have_timestamped_joins_and_jobs_and_no_secret(mesh):
    res = mesh.meshrun(
        mesh.coordinator,
        "train",
        "ddp_train.py",
        "--epochs",
        "1",
        "--steps-per-epoch",
        "3",
        cwd=EXAMPLES,
        check=False,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    job = re.search(r"meshrun: job (\S+) submitted", res.stderr).group(1)
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO "
    coord_log = (mesh.state_dir(mesh.coordinator) / "daemon.log").read_text()
    assert re.search(
        stamp + r"meshrun\.mesh\.coordinator\.enrolment: enrolled dc2-a at 10\.213\.0\.\d+", coord_log, re.M
    ), coord_log[-3000:]
    assert re.search(stamp + rf"meshrun\.jobs\.control: job {re.escape(job)} submitted", coord_log, re.M)
    deadline = time.monotonic() + 10
    while not re.search(rf"job {re.escape(job)} succeeded", coord_log) and time.monotonic() < deadline:
        time.sleep(0.5)
        coord_log = (mesh.state_dir(mesh.coordinator) / "daemon.log").read_text()
    assert re.search(stamp + rf"meshrun\.jobs\.control: job {re.escape(job)} succeeded", coord_log, re.M)
    node_log = (mesh.state_dir(mesh.world.node("dc2-a")) / "daemon.log").read_text()
    assert re.search(stamp + rf"meshrun\.jobs\.nodeapi: job {re.escape(job)} started", node_log, re.M), node_log[-2000:]
    secrets_ = [(mesh.state_dir(mesh.world.node(n)) / "private.key").read_text().strip() for n in MEMBERS]
    coord_state = StateDir(mesh.state_dir(mesh.coordinator))
    secrets_ += [
        base64.b64encode(
            member.job_key(
                coord_state, json.loads((mesh.state_dir(mesh.world.node(n)) / "member.json").read_text())["public_key"]
            )
        ).decode()
        for n in MEMBERS
        if n != "dc1-a"
    ] + [mesh.token]
    for n in MEMBERS:
        for log in mesh.state_dir(mesh.world.node(n)).glob("daemon.*"):
            text = log.read_text(errors="replace")
            for s in secrets_:
                assert s not in text, f"a secret in {log}"


def test_a_coordinator_add_whose_endpoint_is_not_the_node_changes_nothing_and_its_check_closes(mesh):
    """`coordinator add dc2-a --endpoint ADDR` where ADDR is not dc2-a (a public address nobody has): refused
    before anything changes, so the lone coordinator keeps its SQLite state and its daemon (before, it moved
    its state into etcd, restarted its daemon twice, left `coordinator.db.moved-to-etcd-*` and took ~40 s).
    The token dc2-a offers for the check on its future enrolment port is gone after its window: the
    internet finds nothing new listening there."""
    state = mesh.state_dir(mesh.world.node("dc1-a"))
    pid = mesh.status("dc1-a")["daemon_pid"]
    files = sorted(p.name for p in state.iterdir())
    res = mesh.meshrun("dc1-a", "coordinator", "add", "dc2-a", "--endpoint", "203.0.113.250", check=False, timeout=120)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "TCP 203.0.113.250:51820 does not reach dc2-a" in res.stderr and "nothing was changed" in res.stderr, (
        res.stderr
    )
    assert mesh.status("dc1-a")["daemon_pid"] == pid
    assert sorted(p.name for p in state.iterdir()) == files
    assert "control" not in json.loads((state / "member.json").read_text())
    node_log = (mesh.state_dir(mesh.world.node("dc2-a")) / "daemon.log").read_text()
    assert "offering the add's reachability token on TCP 51820" in node_log, node_log[-2000:]
    deadline = time.monotonic() + hang_guard(15 + 2)  # the node's window (ha.REACH_WINDOW_S) and a tick
    while ("0.0.0.0", 51820) in listeners(mesh, "dc2-a") and time.monotonic() < deadline:
        time.sleep(1)
    assert ("0.0.0.0", 51820) not in listeners(mesh, "dc2-a")
