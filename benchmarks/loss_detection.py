"""How fast a supervisor calls a lost node gone, and how often it calls a busy one gone by mistake.

The supervisor's watch (meshrun.jobs.supervisor.Supervisor._watch, rule in meshrun.core.liveness) sends a TCP
handshake to each node's agent port every PROBE_EVERY_S and calls a node gone after GONE_AFTER_S of
silence over MIN_MISSES probes. This benchmark runs exactly that probe and rule from the coordinator's
namespace (benchmarks/liveness_probe.py) against nodes of a testbed world:

- Load: every probed node is as busy as a training node gets on this machine: 2 x cpus busy loops in its
  namespace and an iperf3 TCP flood through meshrun0 into it (wireguard-go on the node decrypting at its
  ceiling). Phase 1 probes one such node for --load-seconds; every "gone" verdict there is a false
  positive, and every probe's round trip is kept (p50, p99, max, misses).
- Phase 2, --rounds rounds: a loaded node's machine is lost (World.lose: every process killed, its
  namespace deleted) while it is probed; detection = the verdict's time less the loss's.

Protocol, fixed before the run: targets are zero false verdicts under load and detection below
GONE_AFTER_S + 2 s in every round (up to one probe period and a probe timeout beyond it, less the probes'
overlap); 5 rounds. (2026-11-27: with GONE_AFTER_S 4 s and a probe a second 4.6 s (4.5-5.3); with 3 s 4.0 s
(3.7-4.5), target < 5 s; with 2 s, a probe every 0.5 s timing out after 1 s, the target is < 4 s.)

    sudo .venv/bin/python benchmarks/loss_detection.py [--rounds 5] [--load-seconds 180]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBER = ROOT / "benchmarks" / "liveness_probe.py"


def load(world, mesh, node: str, sender: str) -> list[subprocess.Popen]:
    """Busy loops in `node` and an iperf3 flood from `sender` into it over meshrun0; the processes started."""
    n = world.node(node)
    hogs = [n.popen(sys.executable, "-c", "while True: pass") for _ in range(2 * (os.cpu_count() or 2))]
    server = n.popen("iperf3", "-s", "-B", mesh.overlay_ip(node), stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    flood = world.node(sender).popen(
        "iperf3", "-c", mesh.overlay_ip(node), "-t", "86400", "-P", "4", stdout=subprocess.DEVNULL
    )
    time.sleep(1)
    if flood.poll() is not None or server.poll() is not None:
        stop([*hogs, server, flood])
        raise SystemExit(f"the iperf3 flood into {node} did not start (exit {flood.poll()}, server {server.poll()})")
    return [*hogs, server, flood]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def probe(mesh, node: str, seconds: float, until_gone: bool) -> subprocess.Popen:
    """The supervisor's probe and rule, run in the coordinator's namespace against `node` for `seconds`."""
    from meshrun.mesh import member
    from meshrun.system.files.statedir import StateDir

    _, network = member.load(StateDir(mesh.state_dir(mesh.coordinator)))
    argv = [sys.executable, str(PROBER), mesh.overlay_ip(node), str(network.api_port), str(seconds)]
    return mesh.coordinator.popen(
        *argv,
        *(["--until-gone"] if until_gone else []),
        stdout=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(ROOT)},
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--load-seconds", type=float, default=180.0)
    ap.add_argument("--name", default="loss_detection")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import mesh_world, need_root, spread, verdict, write_result

    from meshrun.core import liveness

    need_root()
    t_start = time.monotonic()
    lost_nodes = [f"dc{i}-a" for i in range(3, 3 + a.rounds)]  # dc2-a is loaded in phase 1, the last node floods
    with mesh_world(2 + a.rounds, "los") as (world, mesh, names):
        busy, sender = "dc2-a", names[-1]  # neither is ever lost
        procs = load(world, mesh, busy, sender)
        try:
            time.sleep(3)  # the flood at full rate before the first probe
            out = probe(mesh, busy, a.load_seconds, until_gone=False).communicate(timeout=a.load_seconds + 60)[0]
        finally:
            stop(procs)
        under_load = json.loads(out)
        print(f"under load: {json.dumps({k: v for k, v in under_load.items() if k != 'rtts_ms'})}", flush=True)
        detections: list[float] = []
        for i, node in enumerate(lost_nodes):
            procs = load(world, mesh, node, sender)
            try:
                prober = probe(mesh, node, 60, until_gone=True)
                time.sleep(8)  # probed while busy, then lost
                lost_at = time.time()
                world.lose(node)
                rep = json.loads(prober.communicate(timeout=90)[0])
            finally:
                stop(procs)
            took = rep["gone_at"] - lost_at if rep["gone_at"] else None
            if took is None:
                raise SystemExit(f"round {i + 1}: {node} was lost and never called gone: {rep}")
            detections.append(took)
            print(f"round {i + 1}: {node} called gone {took:.2f} s after its loss ({rep['misses']} misses)", flush=True)
    d = spread(detections)
    false_verdicts = under_load["gone_verdicts"]
    target = liveness.GONE_AFTER_S + 2
    ok = false_verdicts == 0 and d["max"] < target
    summary = (
        f"loss_detection: a lost node called gone {d['median']:.1f} s ({d['min']:.1f}-{d['max']:.1f}) after its loss, "
        f"{d['n']} rounds; {false_verdicts} false verdicts in {a.load_seconds:.0f} s of probing a loaded node "
        f"({under_load['probes']} probes, {under_load['misses']} missed, round trip p50 {under_load['p50_ms']:.1f} "
        f"p99 {under_load['p99_ms']:.1f} max {under_load['max_ms']:.1f} ms); {verdict(ok)} (0 false, < {target:.0f} s) "
        f"[{time.monotonic() - t_start:.0f} s]"
    )
    write_result(
        a.name,
        {
            "rule": {
                "probe_every_s": liveness.PROBE_EVERY_S,
                "probe_timeout_s": liveness.PROBE_TIMEOUT_S,
                "gone_after_s": liveness.GONE_AFTER_S,
                "min_misses": liveness.MIN_MISSES,
            },
            "rounds": a.rounds,
            "load_seconds": a.load_seconds,
            "load": "2 x cpus busy loops in the node and iperf3 -P 4 over meshrun0 into it",
            "under_load": under_load,
            "detection_s": detections,
            "detection": d,
        },
        summary,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
