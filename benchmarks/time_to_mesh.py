"""Time to mesh: N nodes run `meshrun join` at the same moment; seconds until every pair has a handshake.

    sudo python benchmarks/time_to_mesh.py                 # N = 2, 4, 8, 16; 3 rounds
    sudo python benchmarks/time_to_mesh.py --sizes 2,8 --rounds 5

One world per N: a coordinator datacenter plus N node datacenters (1:1 NAT each). The clock
starts just before the first `meshrun join` starts; all joins start together (threads). Each
node's `wg show meshrun0 latest-handshakes` is then polled (in the node's own mount
namespace) until every member pair, the coordinator included, shows a handshake on both
sides. Each size runs `--rounds` times, the sizes in alternating order from round to round; the
result per size is min/median/max. Target: median under 5 s for 8 nodes.

Added on 2026-11-29, before the run it governs (issue 59: "a full mesh of N joining at once in seconds"):
targets now median < 2 s for 8 nodes and < 4 s for 16. Every world starts without the machine's shared report of
the job interpreter (meshrun.system.machine.host.SHARED_CACHE, removed first): each joining node's agent probes
its interpreter (imports torch) as on a new machine, so the N probes, which on N real machines would each have
a machine of their own, all compete here for this machine's cores (they run niced since this change). The sizes
alternate as before; 3 rounds.

Corrected 2026-11-30, before any run under these targets: the probes run at the agent's own priority (the
niced probe was reverted in 0abbb47), not niced as the paragraph above says.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


TARGETS_S = {8: 2.0, 16: 4.0}  # nodes -> the median's target (issue 59)


def handshakes(node) -> dict[str, int]:
    res = node.run("wg", "show", "meshrun0", "latest-handshakes", check=False, timeout=20)
    out = {}
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def public_key(node) -> str:
    return node.run("wg", "show", "meshrun0", "public-key").stdout.strip()


def one(n: int, timeout: float) -> dict:
    from common import join_all, mesh_world

    from meshrun.system.machine.host import SHARED_CACHE

    shutil.rmtree(SHARED_CACHE, ignore_errors=True)  # every node probes its interpreter, as on a new machine
    with mesh_world(n, "ttm", join=False) as (world, mesh, names):
        members = ["dc1-a", *names]
        nodes = [world.node(x) for x in members]
        keys: dict[str, str] = {"dc1-a": public_key(nodes[0])}
        join_times: list[float] = []
        join_err: list[BaseException] = []

        def joiner():
            try:
                join_times.extend(join_all(mesh, names))
            except BaseException as exc:  # noqa: BLE001
                join_err.append(exc)

        t0 = time.monotonic()
        th = threading.Thread(target=joiner)
        th.start()
        done_at = None
        missing = len(members) * (len(members) - 1)
        while time.monotonic() - t0 < timeout:
            if join_err:
                raise join_err[0]
            for x, node in zip(members, nodes):
                if x not in keys:
                    r = node.run("wg", "show", "meshrun0", "public-key", check=False)
                    # "(none)" until `meshrun join` has set the private key
                    if r.returncode == 0 and len(r.stdout.strip()) == 44:
                        keys[x] = r.stdout.strip()
            if len(keys) == len(members):
                # Poll every node in parallel: one round should cost about one nsenter, not N.
                seen: dict[str, dict] = {}
                ts = [
                    threading.Thread(target=lambda x=x, node=node: seen.__setitem__(x, handshakes(node)))
                    for x, node in zip(members, nodes)
                ]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                missing = sum(1 for x in members for y in members if x != y and not seen.get(x, {}).get(keys[y]))
                if missing == 0:
                    done_at = time.monotonic() - t0
                    break
            time.sleep(0.05)
        th.join()
        return {
            "nodes": n,
            "seconds": done_at,
            "pairs_missing_at_timeout": 0 if done_at else missing,
            "join_wall_s_max": max(join_times) if join_times else None,
            "join_wall_s_median": sorted(join_times)[len(join_times) // 2] if join_times else None,
        }


def _secs(s: float | None) -> str:
    return "TIMEOUT" if s is None else f"{s:.2f} s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--name", default="time_to_mesh")
    args = ap.parse_args()
    from common import alternating, need_root, spread, verdict, write_result

    need_root()
    t_start = time.monotonic()
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for n in map(int, alternating([str(x) for x in sizes], args.rounds)):
        r = one(n, args.timeout)
        runs[n].append(r)
        print(
            f"{n:>3} nodes: every pair handshaken after "
            f"{_secs(r['seconds'])} "
            f"(slowest `meshrun join` {r['join_wall_s_max']:.2f} s)",
            flush=True,
        )
    rows = []
    for n in sizes:
        done = [r["seconds"] for r in runs[n] if r["seconds"] is not None]
        rows.append(
            {
                "nodes": n,
                "runs": runs[n],
                "timeouts": len(runs[n]) - len(done),
                "seconds": spread(done) if done else None,
            }
        )

    def met(n: int) -> bool | None:
        row = next((r for r in rows if r["nodes"] == n), None)
        if row is None:
            return None
        return row["seconds"] is not None and not row["timeouts"] and row["seconds"]["median"] < TARGETS_S[n]

    judged = {n: ok_n for n in TARGETS_S if (ok_n := met(n)) is not None}
    ok = all(judged.values()) if judged else None
    parts = ", ".join(
        f"{r['nodes']} nodes {r['seconds']['median']:.1f} s ({r['seconds']['min']:.1f}-{r['seconds']['max']:.1f})"
        if r["seconds"]
        else f"{r['nodes']} nodes TIMEOUT"
        for r in rows
    )
    summary = (
        f"time_to_mesh: all pairs handshaken after, median (min-max) of {args.rounds}: {parts} "
        + (
            "(" + ", ".join(f"{verdict(judged[n])} < {TARGETS_S[n]:g} s for {n} nodes" for n in judged) + ")"
            if judged
            else "(8 and 16 nodes not measured)"
        )
        + f" [{time.monotonic() - t_start:.0f} s]"
    )
    targets = {str(n): t for n, t in TARGETS_S.items()}
    write_result(args.name, {"rounds": args.rounds, "rows": rows, "targets_s": targets, "met": ok}, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
