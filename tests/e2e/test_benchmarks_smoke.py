"""Every benchmark runs end to end at a tiny size and writes a result file the README generator can read.

Numbers at these sizes mean nothing; what is checked is that the benchmark code still works against
the current meshrun (a rename or a changed CLI breaks a benchmark long before anyone re-runs it), and
that its result carries the environment and the rounds the README's figures are built from. Each
writes `benchmarks/results/smoke_*.json`, removed afterwards. (diloco_wan.py's smoke test is
tests/e2e/test_diloco_wan_smoke.py: its --smoke mode runs every variant, so it stands alone.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
from support import REPO_ROOT

RESULTS = REPO_ROOT / "benchmarks" / "results"

# benchmark script -> tiny arguments (the results name is added by the test)
CASES = {
    "time_to_mesh": ["--sizes", "2", "--rounds", "1"],
    "launch_overhead": ["--nodes", "1", "--rounds", "1"],
    "relay_vs_direct": ["--mib", "1", "--iters", "1", "--rounds", "1"],
    "relay_failover": ["--rounds", "1"],
    "wan_efficiency": ["--sizes", "1M", "--rounds", "1", "--iperf-seconds", "1"],
    "wan_tuning": ["--variants", "default", "--size", "1M", "--rounds", "1"],
    "preflight_time": ["--nodes", "2", "--rounds", "1"],
    "sites": ["--intra-mib", "1", "--cross-mib", "2", "--rounds", "1"],
    "ha_failover": ["--rounds", "1", "--lose", "relay", "--window", "3", "--steps", "400"],
    "loss_detection": ["--rounds", "1", "--load-seconds", "3"],
    "datapath": ["--rounds", "1", "--seconds", "1", "--mib", "1", "--iters", "1", "--warmup", "1"]
    + ["--wan-seconds", "2", "--wan-rounds", "1"],
    "wg_ceiling": ["--rounds", "1", "--seconds", "1", "--streams", "2", "--variants", "raw,wg,wg_x2"],
}
# On loopback and mostly asleep (it waits for long-polls to settle, a join storm to pass): it runs beside the others.
LOAD_ARGS = ["--sizes", "10", "--window", "3", "--probes", "2", "--rounds", "1", "--name", "smoke_coordinator_load"]


@pytest.fixture(scope="module", autouse=True)
def coordinator_load_run(tmp_path_factory):
    """`coordinator_load.py` at a tiny size, started with the first test of this file; (process, output file)."""
    out = tmp_path_factory.mktemp("load") / "out.txt"
    path = RESULTS / "smoke_coordinator_load.json"
    path.unlink(missing_ok=True)
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, str(REPO_ROOT / "benchmarks" / "coordinator_load.py"), *LOAD_ARGS],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            start_new_session=True,  # its own process group: the run inside its namespace goes with it
        )
    yield proc, out
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        # wireguard-go daemonizes out of the process group: whatever still runs in the run's namespace goes too.
        netns = f"mrload{proc.pid}"
        left = subprocess.run(["ip", "netns", "pids", netns], check=False, capture_output=True, text=True).stdout
        for pid in left.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", netns], check=False, capture_output=True)
    path.unlink(missing_ok=True)


@pytest.fixture
def result_file(request):
    name = f"smoke_{request.node.callspec.id}"
    path = RESULTS / f"{name}.json"
    path.unlink(missing_ok=True)
    yield name, path
    path.unlink(missing_ok=True)


def run_benchmark(script: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / f"{script}.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


# Busy loops, iperf3 at a link's ceiling: never beside a test marked `timing` (tests/conftest.py).
LOADS = {"loss_detection", "wan_efficiency", "datapath", "wg_ceiling"}


@pytest.mark.parametrize(
    "script", [pytest.param(s, marks=pytest.mark.load) if s in LOADS else s for s in CASES], ids=list(CASES)
)
def test_benchmark_runs_at_a_tiny_size(script, result_file):
    name, path = result_file
    proc = run_benchmark(script, [*CASES[script], "--name", name], timeout=400)
    data = json.loads(path.read_text())
    assert data["benchmark"] == name
    assert data["summary"] and data["summary"] in proc.stdout
    env = data["environment"]
    assert env["cpus"] >= 1 and env["kernel"] and env["date"]
    assert env["wireguard"]["sha256"], env["wireguard"]


def test_coordinator_load_runs_at_a_tiny_size(coordinator_load_run):
    proc, out = coordinator_load_run
    rc = proc.wait(timeout=400)
    assert rc == 0, out.read_text()[-3000:]
    data = json.loads((RESULTS / "smoke_coordinator_load.json").read_text())
    assert data["summary"] in out.read_text() and data["sizes"][0]["members"] == 10
    assert data["sizes"][0]["errors"] == 0  # no agent refused: a join storm stays under the sync rate limit
    run = data["sizes"][0]["runs"][0]
    # The coordinator ran on a real interface holding a peer per member, and came back after its restart.
    assert run["device"] in ("wireguard-go", "kernel") and run["peers_on_device"] == 10, run
    assert run["storm_joins"] == 100 and run["restart_steady_s"] is not None, run
    # Every join was answered to every original agent, as the coordinator saw it, and the driver's own
    # CPU (near a core, the agents' figures carry its lag) was measured.
    assert run["join_answered_p99_s"] is not None and 0 <= run["join_answered_p50_s"] <= run["join_visible_p99_s"]
    assert 0 < run["driver_cpu_share"] and 0 < run["driver_storm_cpu_share"], run
