"""Three coordinators (state in etcd): how long a job stalls when a machine is lost, and what the replicated
store costs while nothing happens.

Each round builds a fresh world: three public coordinators and three nodes behind symmetric NAT (every node
pair relayed, by a coordinator). An elastic DiLoCo job (charlm, 1:3 nodes, an outer step every 20 steps of
0.1 s, so about every 2 s) starts from the coordinator that is then lost (meshrun.lab.testbed.World.lose:
every process killed, its namespace deleted), in rounds of two kinds, alternating: `relay`, the coordinator
that relays the nodes' pairs (the job's supervisor, its relay and an etcd member go at once); `leader`, the
coordinator that leads (pairs, relays and the leader lease move too). A while later a node's machine is
lost as well. For each loss: the seconds from the loss to the arrival, in a surviving coordinator's copy of
the job's logs, of the second outer step beyond the last one that arrived before it (the first may have
been on its way at the loss). A job that never stalled shows about one outer interval here, which is
recorded next to it. The job must finish, every rank on one model.

Steady state, before the job and (a second window) while it runs: CPU of the three etcd members and of the
three coordinator daemons (/proc, utime + stime) and the bytes etcd moves on the overlay (client and peer
ports, counted by iptables on every coordinator's overlay interface as packets arrive: each byte once).

    sudo .venv/bin/python benchmarks/ha_failover.py [--rounds 3] [--window 60] [--lose relay,leader]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from common import need_root, prefix, spread, write_result  # noqa: E402

from meshrun.lab.mesh import Mesh  # noqa: E402
from meshrun.lab.testbed import DatacenterSpec, World  # noqa: E402
from meshrun.mesh import process  # noqa: E402
from meshrun.system.files.statedir import StateDir  # noqa: E402

COORDS = ["dc1-a", "dc2-a", "dc3-a"]
FIRST = "coordinator"  # dc1-a's member name (`meshrun init`); the others keep their nodes' names
KINDS = ("relay", "leader")
NODES = ["dc4-a", "dc5-a", "dc6-a"]
ETCD_PORTS = "2379,2380"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int | None) -> float:
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def pids(mesh: Mesh) -> dict[str, dict[str, int | None]]:
    out = {}
    for n in COORDS:
        state = StateDir(mesh.state_dir(mesh.world.node(n)))
        etcd = (state / "etcd" / "etcd.pid").read_text().strip() if (state / "etcd" / "etcd.pid").exists() else ""
        out[n] = {"etcd": int(etcd) if etcd.isdigit() else None, "daemon": process.pid(state)}
    return out


def count_etcd_bytes(mesh: Mesh) -> None:
    for n in COORDS:
        node = mesh.world.node(n)
        for rule in (["--dports", ETCD_PORTS], ["--sports", ETCD_PORTS]):
            node.run("iptables", "-I", "INPUT", "-i", "meshrun0", "-p", "tcp", "-m", "multiport", *rule)


def etcd_bytes(mesh: Mesh) -> int:
    total = 0
    for n in COORDS:
        out = mesh.world.node(n).run("iptables", "-L", "INPUT", "-v", "-x", "-n").stdout
        total += sum(int(line.split()[1]) for line in out.splitlines() if "multiport" in line and ETCD_PORTS in line)
    return total


def coordinator_rows(mesh: Mesh, on: str) -> list[dict]:
    return json.loads(mesh.meshrun(on, "coordinator", "list", "--json").stdout)


def window(mesh: Mesh, seconds: float) -> dict:
    """CPU (share of one core) of the etcd members and the coordinator daemons, and etcd's bytes a second."""
    p = pids(mesh)
    c0 = {n: {k: cpu_s(v) for k, v in d.items()} for n, d in p.items()}
    b0, t0 = etcd_bytes(mesh), time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    c1 = {n: {k: cpu_s(v) for k, v in d.items()} for n, d in p.items()}
    b1 = etcd_bytes(mesh)
    return {
        "seconds": round(dt, 1),
        "etcd_cpu_share": sum(c1[n]["etcd"] - c0[n]["etcd"] for n in COORDS) / dt,
        "daemon_cpu_share": sum(c1[n]["daemon"] - c0[n]["daemon"] for n in COORDS) / dt,
        "etcd_bytes_per_s": (b1 - b0) / dt,
    }


def steps_seen(state: StateDir, job: str) -> list[tuple[float, str, int]]:
    """(arrival unix s, node, outer step) of every outer step line in this coordinator's copy of the job's logs."""
    out = []
    for path in (state.path / "jobs" / job / "logs").glob("dc*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = re.match(r"^(\d+) .*\] outer_step (\d+) ", line)
            if m:
                out.append((int(m.group(1)) / 1000, path.stem, int(m.group(2))))
    return sorted(out)


def timeline(mesh: Mesh, on: str, job: str, lost_at: float, after: float, limit: int = 120) -> list[str]:
    """The job's lines (every node's and the supervisor's) that arrived at `on` from the loss to `after` s past it,
    as "+S.SS source: line": where the seconds between a loss and progress went."""
    state = StateDir(mesh.state_dir(mesh.world.node(on)))
    out = []
    for path in (state.path / "jobs" / job / "logs").glob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            stamp, _, text = line.partition(" ")
            if stamp.isdigit() and 0 <= int(stamp) / 1000 - lost_at <= after:
                out.append((int(stamp) / 1000 - lost_at, path.stem, text[:160]))
    return [f"+{t:.2f} {src}: {text}" for t, src, text in sorted(out)[:limit]]


def recovery(mesh: Mesh, on: str, job: str, lost_at: float, timeout: float = 300) -> float:
    """Seconds from `lost_at` to the arrival of the second outer step beyond the last that arrived before it."""
    state = StateDir(mesh.state_dir(mesh.world.node(on)))
    before = max((s for t, _, s in steps_seen(state, job) if t <= lost_at), default=0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        after = [t for t, _, s in steps_seen(state, job) if s >= before + 2 and t > lost_at]
        if after:
            return min(after) - lost_at
        time.sleep(0.5)
    raise SystemExit(f"no progress within {timeout:.0f} s of the loss\n{mesh.diagnose(on, job)}")


def outer_interval(state: StateDir, job: str) -> float:
    """The median seconds between outer steps' arrivals so far (rank 0's lines: one per step)."""
    first: dict[int, float] = {}
    for t, _, s in steps_seen(state, job):
        first.setdefault(s, t)
    times = [first[s] for s in sorted(first)]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return gaps[len(gaps) // 2] if gaps else 0.0


def node_of(member: str | None) -> str | None:
    return COORDS[0] if member in (FIRST, "") else member


def relaying_coordinator(mesh: Mesh) -> str | None:
    """The coordinator (its node's name) that relays every node pair, or None (not one coordinator)."""
    pairs = mesh.status(COORDS[0])["pairs"]
    relays = {node_of(p.get("relay")) for p in pairs if {p["a"], p["b"]} <= set(NODES)}
    return relays.pop() if len(relays) == 1 and relays <= set(COORDS) else None


def leading_coordinator(mesh: Mesh) -> str | None:
    return next((node_of(r["name"]) for r in coordinator_rows(mesh, COORDS[0]) if r["role"] == "leader"), None)


def settle(mesh: Mesh, timeout: float = 180) -> float:
    """Wait until the promotions have settled: every coordinator lists all three, one leader, every etcd member
    healthy, and every node reaches every other over the overlay (through its relay). Returns the seconds."""
    t0 = time.monotonic()
    while True:
        try:
            rows = [coordinator_rows(mesh, c) for c in COORDS]
            ready = all(
                sorted(r["role"] for r in rs) == ["follower", "follower", "leader"]
                and {r["etcd"] for r in rs} == {"ok"}
                for rs in rows
            )
        except (json.JSONDecodeError, OSError, subprocess.SubprocessError) as exc:  # a daemon restarting
            rows, ready = exc, False
        if ready:
            break
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"the coordinators did not settle within {timeout:.0f} s: {rows}")
        time.sleep(1)
    for a in NODES:
        for b in NODES:
            if a != b:
                mesh.wait_ping(a, mesh.overlay_ip(b), timeout=max(10, timeout - (time.monotonic() - t0)))
    return time.monotonic() - t0


def wait_record(mesh: Mesh, on: str, job: str, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = mesh.job_record(on, job, check=False)
        if rec.get("state") in ("succeeded", "failed", "cancelled", "lost"):
            return rec
        time.sleep(3)
    raise SystemExit(f"job {job} did not end within {timeout:.0f} s\n{mesh.diagnose(on, job)}")


def one_round(r: int, kind: str, seconds: float, steps: int, name: str) -> dict:
    specs = [DatacenterSpec(f"dc{i}") for i in (1, 2, 3)] + [
        DatacenterSpec(f"dc{i}", nat="symmetric") for i in (4, 5, 6)
    ]
    job = f"{name.replace('_', '-')}-{r}"
    with World(specs, prefix=prefix("ha")) as world:
        world.up()
        mesh = Mesh(world, "dc1-a")
        mesh.init()
        for n in COORDS[1:] + NODES:
            mesh.join(n)
        for n in COORDS[1:]:
            mesh.meshrun("dc1-a", "coordinator", "add", n, "--endpoint", str(world.node(n).public_ip), timeout=300)
        count_etcd_bytes(mesh)
        settled = settle(mesh)
        print(f"round {r}: the three coordinators settled in {settled:.0f} s", flush=True)
        idle = window(mesh, seconds)
        lose = (relaying_coordinator(mesh) if kind == "relay" else leading_coordinator(mesh)) or COORDS[0]
        watch = next(n for n in COORDS if n != lose)
        args = ["--job-id", job, "--nnodes", "1:3", "--nodes", ",".join(NODES), "--max-restarts", "5"]
        args += ["--timeout", "120", "--detach", "diloco_charlm.py", "--mode", "diloco", "--steps", str(steps)]
        args += ["--sync-every", "20", "--step-time", "0.1", "--compression", "fp4", "--hidden", "32"]
        args += ["--batch-size", "8", "--seq-len", "32", "--val-batches", "2", "--threads", "1"]
        mesh.meshrun(lose, "train", "--project", job, *args, cwd=ROOT / "examples", timeout=300)
        state_w = StateDir(mesh.state_dir(world.node(watch)))
        started = time.monotonic()
        while max((s for _, _, s in steps_seen(state_w, job)), default=0) < 3:
            if time.monotonic() > started + 240:
                raise SystemExit(f"the job made no progress in 240 s\n{mesh.diagnose(watch, job)}")
            time.sleep(1)
        print(f"round {r}: outer step 3 seen {time.monotonic() - started:.0f} s after the start", flush=True)
        busy = window(mesh, seconds / 2)
        pairs = {frozenset((p["a"], p["b"])): p for p in mesh.status(watch)["pairs"]}
        relays_before = sorted({node_of(p.get("relay")) or "-" for p in pairs.values()})
        led = leading_coordinator(mesh)
        interval = outer_interval(state_w, job)
        lost = time.time()
        world.lose(lose)
        coordinator_s = recovery(mesh, watch, job, lost)
        print(
            f"round {r} ({kind}): progress {coordinator_s:.1f} s after {lose}'s loss "
            f"(outer step every {interval:.1f} s)",
            flush=True,
        )
        time.sleep(10)
        lost = time.time()
        world.lose(NODES[-1])
        node_s = recovery(mesh, watch, job, lost)
        node_timeline = timeline(mesh, watch, job, lost, node_s + 0.5)
        print(f"round {r}: progress {node_s:.1f} s after a node's loss", flush=True)
        rec = wait_record(mesh, watch, job)
        res = mesh.meshrun(watch, "logs", job, check=False, timeout=120)
        logs = res.stdout + res.stderr
        digests = set(re.findall(rf"param_checksum rank=\d+ sync={steps // 20} digest=(\w+)", logs))
        took_over = re.search(r"coordinator (\S+) took the job over", logs)  # the first is named "coordinator"
    return {
        "kind": kind,
        "lost_coordinator": {
            "name": lose,
            "started_the_job": True,
            "relayed": lose in relays_before,
            "led": lose == led,
        },
        "outer_interval_s": interval,
        "coordinator_loss_s": coordinator_s,
        "node_loss_s": node_s,
        "node_loss_timeline": node_timeline,
        "job": rec.get("state"),
        "one_model": len(digests) == 1,
        "took_over_by": took_over.group(1) if took_over else None,
        "relays_before": relays_before,
        "idle": idle,
        "job_running": busy,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each kind of coordinator loss")
    ap.add_argument("--lose", default=",".join(KINDS), help="the coordinator lost: relay, leader (alternating)")
    ap.add_argument("--window", type=float, default=60.0, help="seconds of the idle window (half while the job runs)")
    ap.add_argument("--steps", type=int, default=900, help="the job's steps (0.1 s each; an outer step every 20)")
    ap.add_argument("--name", default="ha_failover")
    a = ap.parse_args()
    kinds = [k for k in a.lose.split(",") if k]
    if not kinds or set(kinds) - set(KINDS):
        raise SystemExit(f"--lose {a.lose!r}: name relay, leader or both (comma between)")
    need_root()
    t0 = time.monotonic()
    order = [kinds[i % len(kinds)] for i in range(a.rounds * len(kinds))]
    rounds = [one_round(r, kind, a.window, a.steps, a.name) for r, kind in enumerate(order, 1)]
    for r in rounds:
        if r["job"] != "succeeded" or not r["one_model"]:
            raise SystemExit(f"a round's job did not end on one model: {r}")
    c = {k: spread([r["coordinator_loss_s"] for r in rounds if r["kind"] == k]) for k in kinds}
    n = spread([r["node_loss_s"] for r in rounds])
    iv = spread([r["outer_interval_s"] for r in rounds])
    keys = ("etcd_cpu_share", "daemon_cpu_share", "etcd_bytes_per_s")
    idle = {k: spread([r["idle"][k] for r in rounds]) for k in keys}
    busy = {k: spread([r["job_running"][k] for r in rounds]) for k in keys}

    def roles(kind: str) -> str:
        runs = [r["lost_coordinator"] for r in rounds if r["kind"] == kind]
        relayed, led = sum(x["relayed"] for x in runs), sum(x["led"] for x in runs)
        return f"relayed in {relayed}/{len(runs)}, led in {led}/{len(runs)}"

    losses = "; ".join(
        f"{c[k]['median']:.1f} s ({c[k]['min']:.1f}-{c[k]['max']:.1f}) after the {k} coordinator's loss ({roles(k)})"
        for k in kinds
    )
    summary = (
        f"ha_failover: progress again {losses}; {n['median']:.1f} s ({n['min']:.1f}-{n['max']:.1f}) after a "
        f"node's; an outer step every {iv['median']:.1f} s when nothing is lost (the lost coordinator started the "
        f"job); replicated store at rest: etcd {100 * idle['etcd_cpu_share']['median']:.1f}% of a core for three "
        f"members, {idle['etcd_bytes_per_s']['median'] / 1024:.1f} KiB/s on the overlay; with a job running "
        f"{100 * busy['etcd_cpu_share']['median']:.1f}%, {busy['etcd_bytes_per_s']['median'] / 1024:.1f} KiB/s; "
        f"{len(rounds)} rounds [{time.monotonic() - t0:.0f} s]"
    )
    write_result(
        a.name,
        {
            "rounds": a.rounds,
            "order": order,
            "window_s": a.window,
            "runs": rounds,
            "coordinator_loss_s": c,
            "node_loss_s": n,
            "outer_interval_s": iv,
            "idle": idle,
            "job_running": busy,
        },
        summary,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
