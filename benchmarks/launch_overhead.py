"""Launch overhead of `meshrun train`: versus the same torchrun commands started by hand.

    sudo python benchmarks/launch_overhead.py            # 2 nodes + coordinator, 3 alternating rounds
    sudo python benchmarks/launch_overhead.py --nodes 4 --rounds 5

A script that exits at once is run (a) with `meshrun train` on the coordinator (wait for the
agents, ship the code, start each node's share through its agent, stream output, collect
exit codes) and (b) by hand: `meshrun.core.launch.plan`'s per-node torchrun argv + environment,
started in every node at the same moment with node.popen, at the coordinator's store for `--local`
shares (`meshrun local-store start`). Rounds alternate (a)/(b); each round gives one paired difference
(a) - (b), reported as min/median/max: when their spread is larger than the median, say so rather than
trust the median. Target: median extra under 2 s.
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

SCRIPT = "import sys\nsys.exit(0)\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="launch_overhead")
    args = ap.parse_args()
    from common import mesh_world, need_root, spread, verdict, write_result

    from meshrun.core import launch

    need_root()
    t_start = time.monotonic()
    code_dir = Path(tempfile.mkdtemp(prefix="meshrun-launch-"))
    script = code_dir / "exit_now.py"
    script.write_text(SCRIPT)
    times = {"meshrun_train": [], "by_hand": []}
    try:
        with mesh_world(args.nodes, "lo") as (world, mesh, names):
            for n in names:
                mesh.wait_ping("dc1-a", mesh.overlay_ip(n))
            st = mesh.status("dc1-a")
            coord_ip = st["overlay_ip"]
            mesh.meshrun("dc1-a", "local-store", "start")  # what torchrun by hand meets at
            infos = [launch.NodeInfo(n, mesh.overlay_ip(n), 0) for n in names]
            for r in range(args.rounds):
                order = ["meshrun_train", "by_hand"] if r % 2 == 0 else ["by_hand", "meshrun_train"]
                for kind in order:
                    t0 = time.monotonic()
                    if kind == "meshrun_train":
                        res = mesh.meshrun(
                            "dc1-a",
                            "train",
                            "--job-id",
                            f"lo-m{r}",
                            "exit_now.py",
                            cwd=code_dir,
                            check=False,
                            timeout=300,
                        )
                        rc = res.returncode
                    else:
                        opts = launch.TrainOptions(
                            script=str(script),
                            job_id=f"lo-h{r}",
                            rdzv_host=coord_ip,
                            rdzv_port=29400,
                            interface="meshrun0",
                            python=sys.executable,
                        )
                        plans = launch.plan(infos, opts)
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
                    secs = time.monotonic() - t0
                    if rc != 0:
                        raise RuntimeError(f"{kind} exited {rc}")
                    times[kind].append(secs)
                    print(f"round {r + 1} {kind:14s} {secs:.2f} s", flush=True)
    finally:
        import shutil

        shutil.rmtree(code_dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    diffs = [a - b for a, b in zip(times["meshrun_train"], times["by_hand"])]
    extra = spread(diffs)
    ok = extra["median"] < 2.0
    noisy = extra["max"] - extra["min"] > abs(extra["median"])
    summary = (
        f"launch_overhead: {args.nodes} nodes, script exits at once: meshrun train minus torchrun by hand, "
        f"paired per round, median {extra['median']:+.2f} s (min {extra['min']:+.2f}, max {extra['max']:+.2f}, "
        f"{args.rounds} rounds)"
        + (" - the spread is larger than the effect" if noisy else "")
        + f" ({verdict(ok)} < 2 s) [{time.monotonic() - t_start:.0f} s]"
    )
    write_result(
        args.name,
        {
            "nodes": args.nodes,
            "rounds": args.rounds,
            "runs_s": times,
            "median_s": med,
            "extra_s": extra,
            "spread_exceeds_effect": noisy,
            "target_extra_s": 2.0,
            "met": ok,
        },
        summary,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
