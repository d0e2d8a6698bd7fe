"""Launch overhead of `meshrun train`, warm and cold workers, versus the same job started by hand.

    sudo python benchmarks/launch_overhead.py            # 2 nodes + coordinator, 5 alternating rounds
    sudo python benchmarks/launch_overhead.py --nodes 4 --rounds 5

The job is the least a training script does: import torch, join a gloo group, one barrier, leave. Each round runs
it four ways, in an order that alternates round by round:

- `meshrun_warm`, `meshrun_cold`: `meshrun train --workers warm|cold` on the coordinator (wait for the agents, ship
  the code, pre-flight, start each node's share through its agent, stream output, collect exit codes);
- `torchrun_by_hand`: plain torchrun (`python -m torch.distributed.run`, c10d rendezvous at the coordinator's
  store for `--local` shares, `meshrun local-store start`) started in every node at the same moment, pinned to
  the overlay as meshrun pins it: what a user would type on every node;
- `agent_by_hand`: `meshrun.core.launch.plan`'s per-node command (meshrun's agent, warm workers) started the same
  way: the agent's own cost, without the coordinator's orchestration.

Each round gives paired differences (meshrun_warm - torchrun_by_hand, meshrun_cold - torchrun_by_hand),
reported as min/median/max: when their spread is larger than the median, say so rather than trust the median.
Where the time goes: every `meshrun train` run's phases, from the supervisor's timestamped event lines (nodes
ready, code shipped, pre-flight done, shares started, job ended) and the moment the command returned.
Target: median extra under 2 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SCRIPT = (
    "import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.barrier()\ndist.destroy_process_group()\n"
)
VARIANTS = ["meshrun_warm", "meshrun_cold", "torchrun_by_hand", "agent_by_hand"]
# The supervisor's event lines that mark a phase (meshrun.jobs.supervisor), in the order they come.
PHASES = (
    ("nodes_ready", "nodes ready"),
    ("shipped", "shipping "),
    ("preflight_done", "pre-flight: "),
    ("shares_started", " node(s): "),
)


def phases(events: Path, t0: float) -> dict[str, float]:
    """Seconds from `t0` (unix) to each phase's first event line in the job's events.log."""
    found: dict[str, float] = {}
    lines = events.read_text(errors="replace").splitlines() if events.exists() else []
    for line in lines:
        stamp, _, text = line.partition(" ")
        if not stamp.isdigit():
            continue
        for name, mark in PHASES:
            if name not in found and mark in text:
                found[name] = round(int(stamp) / 1000 - t0, 3)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="launch_overhead")
    args = ap.parse_args()
    from common import alternating, mesh_world, need_root, spread, verdict, write_result

    from meshrun.core import launch
    from meshrun.jobs.supervisor import EVENTS

    need_root()
    t_start = time.monotonic()
    code_dir = Path(tempfile.mkdtemp(prefix="meshrun-launch-"))
    script = code_dir / "launch_job.py"
    script.write_text(SCRIPT)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    breakdown: list[dict] = []
    try:
        with mesh_world(args.nodes, "lo") as (world, mesh, names):
            for n in names:
                mesh.wait_ping("dc1-a", mesh.overlay_ip(n))
            st = mesh.status("dc1-a")
            coord_ip = st["overlay_ip"]
            mesh.meshrun("dc1-a", "local-store", "start")  # what the shares started by hand meet at
            infos = [launch.NodeInfo(n, mesh.overlay_ip(n), 0) for n in names]
            coord_state = mesh.state_dir(world.node("dc1-a"))
            for i, kind in enumerate(alternating(VARIANTS, args.rounds)):
                r = i // len(VARIANTS)
                t0, wall0 = time.monotonic(), time.time()
                if kind.startswith("meshrun_"):
                    job = f"lo-{kind}-{r}"
                    res = mesh.meshrun(
                        "dc1-a",
                        "train",
                        "--job-id",
                        job,
                        "--workers",
                        kind.split("_")[1],
                        "launch_job.py",
                        cwd=code_dir,
                        check=False,
                        timeout=300,
                    )
                    rc = res.returncode
                    took = time.monotonic() - t0
                    marks = phases(coord_state / "jobs" / job / "logs" / f"{EVENTS}.log", wall0)
                    rec = mesh.job_record("dc1-a", job, check=False) or {}
                    if rec.get("ended"):
                        marks["job_ended"] = round(rec["ended"] - wall0, 3)
                    marks["command_returned"] = round(took, 3)
                    breakdown.append({"variant": kind, "round": r, **marks})
                else:
                    opts = launch.TrainOptions(
                        script=str(script),
                        job_id=f"lo-{kind}-{r}",
                        rdzv_host=coord_ip,
                        rdzv_port=29400,
                        interface="meshrun0",
                        python=sys.executable,
                    )
                    plans = launch.plan(infos, opts)
                    if kind == "torchrun_by_hand":  # the same rendezvous and pinning, torch's own launcher
                        plans = [
                            launch.NodeLaunch(
                                p.node,
                                (sys.executable, "-m", "torch.distributed.run", *_torchrun_args(p.argv)),
                                p.env,
                            )
                            for p in plans
                        ]
                    procs = [
                        world.node(p.node).popen(
                            *p.argv,
                            env=p.env,
                            cwd=str(code_dir),
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        )
                        for p in plans
                    ]
                    rc = max(p.wait(timeout=300) for p in procs)
                    took = time.monotonic() - t0
                if rc != 0:
                    raise RuntimeError(f"{kind} exited {rc}")
                times[kind].append(took)
                print(f"round {r + 1} {kind:18s} {took:.2f} s", flush=True)
    finally:
        import shutil

        shutil.rmtree(code_dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    extra = {
        kind: spread([a - b for a, b in zip(times[kind], times["torchrun_by_hand"])])
        for kind in ("meshrun_warm", "meshrun_cold", "agent_by_hand")
    }
    ok = extra["meshrun_warm"]["median"] < 2.0
    noisy = {k: e["max"] - e["min"] > abs(e["median"]) for k, e in extra.items()}
    where = {
        kind: {
            phase: statistics.median(b[phase] for b in breakdown if b["variant"] == kind and phase in b)
            for phase in [p for p, _ in PHASES] + ["job_ended", "command_returned"]
            if any(b["variant"] == kind and phase in b for b in breakdown)
        }
        for kind in ("meshrun_warm", "meshrun_cold")
    }
    summary = (
        f"launch_overhead: {args.nodes} nodes, a job that joins a gloo group and leaves, paired per round against "
        "torchrun by hand: "
        + "; ".join(
            f"{k} {e['median']:+.2f} s (min {e['min']:+.2f}, max {e['max']:+.2f})" + (" noisy" if noisy[k] else "")
            for k, e in extra.items()
        )
        + f", {args.rounds} rounds ({verdict(ok)} < 2 s warm) [{time.monotonic() - t_start:.0f} s]"
    )
    write_result(
        args.name,
        {
            "nodes": args.nodes,
            "rounds": args.rounds,
            "script": SCRIPT,
            "runs_s": times,
            "median_s": med,
            "extra_s": extra["meshrun_warm"],
            "extra_s_by_variant": extra,
            "spread_exceeds_effect": noisy["meshrun_warm"],
            "phases_s": breakdown,
            "phases_median_s": where,
            "target_extra_s": 2.0,
            "met": ok,
        },
        summary,
    )
    return 0


def _torchrun_args(agent_argv: tuple[str, ...]) -> list[str]:
    """torchrun's own arguments out of meshrun's agent command (PY -m meshrun.jobs.agent --workers K ARGS...):
    the same rendezvous, node address and script, with torch's c10d rendezvous backend."""
    args = list(agent_argv[agent_argv.index(launch_module()) + 1 :])
    if args[:1] == ["--workers"]:
        args = args[2:]
    args[args.index("--rdzv-backend") + 1] = "c10d"
    return args


def launch_module() -> str:
    from meshrun.core.launch import AGENT_MODULE

    return AGENT_MODULE


if __name__ == "__main__":
    sys.exit(main())
