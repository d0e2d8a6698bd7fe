"""Exits under stress: hangs and crashes per 100 runs of the corpus scripts, for meshrun's warm workers, its cold
workers and plain torchrun, side by side, on one machine under CPU load.

    python benchmarks/exit_stress.py                        # every script, 100 warm runs, 20 cold and torchrun
    python benchmarks/exit_stress.py --runs warm=20,cold=5,torchrun=5 --scripts global_ddp_destroy

Each run is one two-worker job on this machine (no world: how a worker starts and ends is the same on one node
as on many): meshrun's agent (`python -m meshrun.jobs.agent --workers KIND`, its rendezvous at a store this
benchmark hosts on loopback), or `torchrun --standalone`. `--load` busy processes run beside it the whole time
(2: both cores of a CI machine taken, which widens every exit race). Kinds alternate run by run, so drift in
the machine's load hits each alike. A run is `ok` when it exits 0 and every rank printed the same final digest,
a `crash` when it ends otherwise, a `hang` when it is still running after --hang-after seconds (then its whole
process tree is killed). Protocol, fixed before the first run: scripts and counts as above, load 2, hang after
120 s (runs take 4-12 s); the default worker kind must show 0 hangs in its 100 runs per script.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, write_result  # noqa: E402

CORPUS = ROOT / "tests" / "corpus"
# name -> (corpus case, script and arguments): the scripts whose ending the launchers decide.
SCRIPTS = {
    "global_ddp_destroy": ("shapes", ["global_ddp.py", "--steps", "5", "--destroy"]),
    "global_ddp": ("shapes", ["global_ddp.py", "--steps", "5"]),
    "multigpu_torchrun": ("ddp_tutorial_series", ["multigpu_torchrun.py", "1", "1"]),
    "ddp_example": ("ddp_example", ["example.py"]),
    "dataloader_workers": ("shapes", ["dataloader_workers.py"]),
    "background_work": ("shapes", ["background_work.py"]),
}
KINDS = ("warm", "cold", "torchrun")
# Plain torchrun writes both ranks to one stdout, so two lines can run together ("final-digest 3final-digest 3").
DIGEST = re.compile(r"final-digest (\w+?)(?=final-digest|\b)")


def parse_runs(text: str) -> dict[str, int]:
    runs = {"warm": 100, "cold": 20, "torchrun": 20}
    for part in filter(None, text.split(",")):
        kind, _, n = part.partition("=")
        if kind not in KINDS or not n.isdigit():
            raise SystemExit(f"--runs {text!r}: each part is KIND=N with KIND one of {', '.join(KINDS)}")
        runs[kind] = int(n)
    return runs


def store() -> tuple[subprocess.Popen, int]:
    """A rendezvous store on loopback, as a coordinator hosts one (meshrun's backend keeps a room per job id)."""
    code = (
        "import sys, time\nfrom torch.distributed import TCPStore\n"
        "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
        "print(s.port, flush=True)\ntime.sleep(10**9)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    return p, int(p.stdout.readline())


def command(kind: str, script: list[str], port: int, job: str) -> list[str]:
    if kind == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script]
    return [
        sys.executable,
        "-m",
        "meshrun.jobs.agent",
        "--workers",
        kind,
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "meshrun",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        job,
        "--rdzv-conf",
        "is_host=0",
        *script,
    ]


def one_run(kind: str, case: str, script: list[str], port: int, job: str, hang_after: float, work: Path) -> dict:
    """One job in a fresh copy of the case's directory: {"kind", "outcome", "seconds", "rc", "why"}."""
    d = work / job
    shutil.copytree(CORPUS / case, d)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "MESHRUN_", "TORCHELASTIC"))}
    t0 = time.monotonic()
    p = subprocess.Popen(
        command(kind, script, port, job),
        cwd=d,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a hung run goes with every process it started
    )
    try:
        out = p.communicate(timeout=hang_after)[0]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out = p.communicate()[0]
        rec = {"kind": kind, "outcome": "hang", "seconds": round(time.monotonic() - t0, 2), "rc": None}
        return {**rec, "why": out[-600:]}
    finally:
        if p.poll() is None:  # interrupted (Ctrl-C, SIGTERM): the run goes with the benchmark
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        shutil.rmtree(d, ignore_errors=True)
    seconds = round(time.monotonic() - t0, 2)
    digests = DIGEST.findall(out)
    ok = p.returncode == 0 and len(digests) == 2 and len(set(digests)) == 1
    why = "" if ok else out[-600:]
    return {"kind": kind, "outcome": "ok" if ok else "crash", "seconds": seconds, "rc": p.returncode, "why": why}


def summarise(runs: list[dict]) -> dict:
    n = len(runs)
    secs = [r["seconds"] for r in runs if r["outcome"] != "hang"]
    count = {o: sum(r["outcome"] == o for r in runs) for o in ("ok", "crash", "hang")}
    return {
        "runs": n,
        **count,
        "hangs_per_100": round(100 * count["hang"] / n, 2) if n else None,
        "crashes_per_100": round(100 * count["crash"] / n, 2) if n else None,
        "seconds": {"min": min(secs), "median": statistics.median(secs), "max": max(secs)} if secs else None,
        "failures": [{k: r[k] for k in ("outcome", "rc", "why")} for r in runs if r["outcome"] != "ok"][:5],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="", help="KIND=N,... per script [warm=100,cold=20,torchrun=20]")
    ap.add_argument("--scripts", default=",".join(SCRIPTS), help=f"comma-separated, of {', '.join(SCRIPTS)}")
    ap.add_argument("--load", type=int, default=2, help="busy processes beside the runs [2]")
    ap.add_argument("--hang-after", type=float, default=120.0)
    ap.add_argument("--name", default="exit_stress")
    args = ap.parse_args()
    runs = parse_runs(args.runs)
    names = [s for s in args.scripts.split(",") if s]
    unknown = [s for s in names if s not in SCRIPTS]
    if unknown:
        raise SystemExit(f"--scripts: unknown {', '.join(unknown)}; choose from {', '.join(SCRIPTS)}")
    t_start = time.monotonic()
    # SIGTERM ends the benchmark as Ctrl-C does, through the cleanup below: the load and the store are in
    # sessions of their own, so nothing else would stop them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(args.load)
    ]
    store_proc, port = store()
    work = Path(tempfile.mkdtemp(prefix="meshrun-exit-stress-"))
    results: dict[str, dict[str, list[dict]]] = {s: {k: [] for k in KINDS} for s in names}
    try:
        for name in names:
            case, script = SCRIPTS[name]
            # Kinds alternate run by run (warm, cold, torchrun, warm, ...) until each has its count.
            left = dict(runs)
            i = 0
            while any(left.values()):
                for kind in KINDS if i % 2 == 0 else tuple(reversed(KINDS)):
                    if left[kind]:
                        rec = one_run(kind, case, script, port, f"{name}-{kind}-{i}", args.hang_after, work)
                        results[name][kind].append(rec)
                        left[kind] -= 1
                        print(f"{name} {kind} #{len(results[name][kind])}: {rec['outcome']} {rec['seconds']} s")
                i += 1
    finally:
        for p in (*load, store_proc):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        shutil.rmtree(work, ignore_errors=True)
    table = {name: {kind: summarise(rs) for kind, rs in by_kind.items() if rs} for name, by_kind in results.items()}
    hangs = {k: sum(t[k]["hang"] for t in table.values() if k in t) for k in KINDS}
    crashes = {k: sum(t[k]["crash"] for t in table.values() if k in t) for k in KINDS}
    total = {k: sum(t[k]["runs"] for t in table.values() if k in t) for k in KINDS}
    summary = (
        f"exit_stress: {len(names)} script(s) under {args.load} busy process(es): "
        + "; ".join(f"{k} {hangs[k]} hang(s), {crashes[k]} crash(es) in {total[k]} runs" for k in KINDS if total[k])
        + f" [{time.monotonic() - t_start:.0f} s]"
    )
    data = {
        # Kinds alternate run by run: a round is one run of each kind that still runs, so there are as many rounds
        # with every kind in them as the smallest count.
        "rounds": min((n for n in runs.values() if n), default=0),
        "protocol": {
            "runs_per_script": runs,
            "load": args.load,
            "hang_after_s": args.hang_after,
            "scripts": {n: " ".join(SCRIPTS[n][1]) for n in names},
        },
        "scripts": table,
        "totals": {k: {"runs": total[k], "hangs": hangs[k], "crashes": crashes[k]} for k in KINDS},
    }
    write_result(args.name, data, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
