"""`meshrun status` as a new user reads it: a latency that matches the real round trip, every node pair
listed right after the joins, and job output without c10d's reverse-DNS noise.

A coordinator and three nodes behind 1:1 NAT in namespaces (real meshrun, wireguard-go, torch).
"""

from __future__ import annotations

import json
import re
import statistics

import pytest
from support import REPO_ROOT, joined_mesh

EXAMPLES = REPO_ROOT / "examples"

# Runs in a node: `meshrun status`'s own measurement (status.gather, the code behind the command)
# alternated with a reference, a median of 9 TCP connects made one after the other, both in this one
# process so that neither pays for the other's start-up. Prints {peer: {"shown": [...], "ref": [...],
# "delta": [...]}}, a delta being a round's shown value less the mean of the references around it.
COMPARE = r"""
import json, socket, statistics, sys, time
from meshrun.mesh.status import gather
from meshrun.system.files.statedir import StateDir
state, port, rounds = StateDir(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
peers = dict(a.split("=") for a in sys.argv[4:])
def reference(ip):
    rtts = []
    for _ in range(10):
        t0 = time.perf_counter()
        socket.create_connection((ip, port), timeout=2).close()
        rtts.append((time.perf_counter() - t0) * 1000)
    return statistics.median(rtts[1:])
out = {name: {"shown": [], "ref": [], "delta": []} for name in peers}
for _ in range(rounds):
    before = {name: reference(ip) for name, ip in peers.items()}
    st = gather(state)
    after = {name: reference(ip) for name, ip in peers.items()}
    for name in peers:
        shown = next(r["latency_ms"] for r in st["peers"] if r["name"] == name)
        out[name]["shown"].append(shown)
        out[name]["ref"] += [before[name], after[name]]
        out[name]["delta"].append(shown - (before[name] + after[name]) / 2)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with joined_mesh(tmp_path_factory, 4, "dc1-a", ("dc2-a", "dc3-a", "dc4-a")) as m:
        yield m


def test_every_node_pair_is_listed_on_the_coordinator_right_after_the_joins(mesh):
    st = mesh.status("dc1-a")
    pairs = {(p["a"], p["b"]) for p in st["pairs"]}
    assert pairs == {("dc2-a", "dc3-a"), ("dc2-a", "dc4-a"), ("dc3-a", "dc4-a")}, st["pairs"]
    assert all(p["path"] in ("probing", "direct (public)") for p in st["pairs"]), st["pairs"]
    text = mesh.meshrun("dc1-a", "status").stdout
    # Only the pairs section: the peer table's NAME and SITE columns also start "dc2-a  dc2-a".
    pairs_section = text.split("node pairs:", 1)[1]
    assert len(re.findall(r"^dc\d-a\s+dc\d-a\s", pairs_section, re.M)) == 3, text


@pytest.mark.timing
def test_status_latency_matches_a_median_of_tcp_connects(mesh):
    """Each peer's RTT as `status` measures it against a median of TCP connects to the same peer, taken
    right before and after it. This 2-core machine's scheduling moves a batch's median by a few tenths
    of a millisecond from one second to the next, so 25 rounds are taken and their median difference
    must be within 0.2 ms or 10%; at most two rounds may be off by 3x (the old thread-pool measurement
    showed 5-8 ms for 0.5-0.8 ms peers, in every round). How far off such a lone round is is not judged
    beyond a sanity bound: a scheduling stall of a few ms (the hypervisor takes CPU from this machine) moves
    one round's median of 9 connects by that much, and a bound of 3x + 2 ms failed a clean-clone run of the
    suite on one round."""
    node = mesh.world.node("dc2-a")
    peers = {
        "coordinator": mesh.overlay_ip("dc1-a"),
        "dc3-a": mesh.overlay_ip("dc3-a"),
        "dc4-a": mesh.overlay_ip("dc4-a"),
    }
    for ip in peers.values():
        mesh.wait_ping("dc2-a", ip)
    port = mesh.status(node)["api_port"]
    res = json.loads(
        node.run(
            mesh.python,
            "-c",
            COMPARE,
            str(mesh.state_dir(node)),
            str(port),
            "25",
            *[f"{n}={ip}" for n, ip in peers.items()],
            timeout=120,
        ).stdout
    )
    for name, r in res.items():
        want = statistics.median(r["ref"])
        assert abs(statistics.median(r["delta"])) <= max(0.2, 0.1 * want), (name, r)
        # Each round a measurement, not a missing answer, a timeout or a unit slip.
        assert all(v is not None and 0 < v < 100 for v in r["shown"]), (name, r)
        # A lone round may meet the other test process's burst (the suite runs two at once), never many:
        # the old measurement was off by 5-8 ms in every round.
        assert sum(v > 3 * want for v in r["shown"]) <= 2, (name, r)
    assert "RTT: median of up to 9 TCP connects over the overlay" in mesh.meshrun(node, "status").stdout


WARN = """import sys
sys.stderr.write("[W1122 23:00:53.052383232 socket.cpp:207] [c10d] The hostname of the client socket cannot be "
                 "retrieved. err=-3\\n")
sys.stderr.write("[c10d] The hostname of the client socket cannot be retrieved. err=-3, and then some\\n")
sys.stderr.write("UserWarning: keep me\\n")
"""


def test_job_output_has_no_reverse_dns_warnings_but_keeps_the_others(mesh, tmp_path):
    res = mesh.meshrun(
        "dc1-a",
        "train",
        "ddp_train.py",
        "--epochs",
        "1",
        "--steps-per-epoch",
        "2",
        cwd=EXAMPLES,
        check=False,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    job = re.search(r"meshrun: job (\S+) submitted", res.stderr).group(1)
    for text in (res.stdout + res.stderr, mesh.meshrun("dc1-a", "logs", job).stdout):
        assert "hostname of the client socket cannot be retrieved" not in text
        assert "param_checksum" in text
    # Only that exact line goes: a script's own lines, however alike, stay.
    (tmp_path / "warn.py").write_text(WARN)
    res = mesh.meshrun("dc1-a", "train", "--nodes", "dc2-a", "warn.py", cwd=tmp_path, check=False, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[dc2-a r0] UserWarning: keep me" in res.stdout
    assert "err=-3, and then some" in res.stdout
    assert "socket.cpp:207" not in res.stdout


def test_metrics_say_what_status_and_jobs_say_in_prometheus_format(mesh, tmp_path):
    """`meshrun metrics` on the coordinator after a job that reported its steps, and on a node into a textfile
    collector's directory: read back with Prometheus' own parser, each agrees with status and jobs."""
    from prometheus_client.parser import text_string_to_metric_families

    def families(text: str) -> dict:
        return {f.name: f.samples for f in text_string_to_metric_families(text)}

    res = mesh.meshrun("dc1-a", "train", "--nodes", "dc2-a,dc3-a", "ddp_train.py", "--epochs", "2",
                       "--steps-per-epoch", "2", cwd=EXAMPLES, check=False, timeout=240)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    job = re.search(r"meshrun: job (\S+) submitted", res.stderr).group(1)
    record = next(r for r in json.loads(mesh.meshrun("dc1-a", "jobs", "--json").stdout) if r["job_id"] == job)
    fams = families(mesh.meshrun("dc1-a", "metrics").stdout)
    info = {s.labels["job"]: s.labels for s in fams["meshrun_job_info"]}
    assert info[job]["state"] == record["state"] == "succeeded" and info[job]["rank0"] == record["rank0"]
    steps = {s.labels["job"]: s.value for s in fams["meshrun_job_step"]}
    assert record["progress"]["step"] is not None and steps[job] == record["progress"]["step"]
    assert [s.value for s in fams["meshrun_job_exit_code"] if s.labels["job"] == job] == [0]
    pairs = {(s.labels["a"], s.labels["b"]) for s in fams["meshrun_pair_info"]}
    assert pairs == {(p["a"], p["b"]) for p in mesh.status("dc1-a")["pairs"]}
    # A node, into node_exporter's textfile directory: one rename, readable by the collector's user.
    collector = tmp_path / "textfile_collector"
    collector.mkdir()
    out = collector / "mesh.prom"
    mesh.meshrun("dc2-a", "metrics", "--textfile", str(out))
    assert out.stat().st_mode & 0o777 == 0o644 and [p.name for p in collector.iterdir()] == ["mesh.prom"]
    fams = families(out.read_text())
    assert "meshrun_job_info" not in fams  # jobs are the coordinator's
    status = {p["name"]: p for p in mesh.status("dc2-a")["peers"]}
    rx = {s.labels["peer"]: s.value for s in fams["meshrun_peer_receive_bytes"]}
    assert set(rx) == set(status) and rx["dc3-a"] > 0, (rx, sorted(status))  # dc3-a: the job's traffic
    assert [s.value for s in fams["meshrun_daemon_running"]] == [1]
    # A path that is not a .prom file: one line naming it and the fix, nothing written.
    bad = mesh.meshrun("dc2-a", "metrics", "--textfile", str(collector / "mesh.txt"), check=False)
    assert bad.returncode != 0 and "does not end in .prom" in bad.stderr and len(bad.stderr.strip().splitlines()) <= 2
    assert [p.name for p in collector.iterdir()] == ["mesh.prom"]
