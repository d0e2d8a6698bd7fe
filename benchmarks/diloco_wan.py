#!/usr/bin/env python
"""DiLoCo variants vs DDP over a shaped WAN: 3 workers in 3 NAT'd datacenters, every internet link 200 Mbit/s.

Builds the namespace world of ``meshrun.lab.testbed`` (a coordinator datacenter that does not train,
plus one datacenter per worker, each gateway's internet link shaped with tbf in both directions),
runs ``meshrun init`` / ``meshrun join`` for real (wireguard-go overlay), then trains the same model
on the same token budget once per variant, side by side in one run, each with ``meshrun train``
launched on the coordinator (examples/diloco_charlm.py):

- ``ddp``:           --mode ddp (fp32 gradient all-reduce every step): the bytes and loss reference
- ``local``:         --mode local: the same workers with no communication at all: the wall-time floor
- ``diloco_fp16``:   DiLoCo H=50, fp16 pseudo-gradients (what meshrun shipped before)
- ``diloco_fp4``:    DiLoCo H=50, FP4 E2M1 with error feedback
- ``streaming_fp4``: Streaming DiLoCo H=50, 2 fragments (one syncs every 25 steps), overlap 1 step, FP4
- ``diloco_int2``:   DiLoCo H=50, 2-bit with error feedback

Per variant it reports the wall-clock time of the ``meshrun train`` command (end to end, what a user
waits for: rendezvous, start-up and validation included) and of the training loop alone, the bytes
each worker sent (the payload counter the script prints, and the bytes its datacenter's gateway
actually forwarded to the internet during the run: WireGuard framing, rendezvous, heartbeats
included), and the final validation loss. Targets for each DiLoCo variant (issue 16): >= 400x fewer
bytes than DDP (judged on the smaller of the wire and payload ratios), wall time <= 1.1x the
no-communication run's (judged end to end and, stricter, on the training loop alone), val loss
<= 1.03x DDP's. A missed target is printed as MISSED with its
numbers and how far off it is; nothing is retried or filtered.

Needs root (network namespaces), wireguard-go, iproute2, iptables and torch. Usage:

    sudo python benchmarks/diloco_wan.py                      # all variants, 3 rounds: about 30 minutes on 2 cores
    sudo python benchmarks/diloco_wan.py --rounds 1           # once: about 7 minutes
    sudo python benchmarks/diloco_wan.py --variants ddp,local,diloco_int2 -v   # stream every rank's output
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing meshrun

from common import environment  # noqa: E402  (benchmarks/ is on sys.path when a script there runs)

from meshrun.lab.testbed import DatacenterSpec, Mesh, World  # noqa: E402

EXAMPLES = REPO / "examples"
SCRIPT = "diloco_charlm.py"
DEFAULT_JSON = REPO / "benchmarks" / "results" / "diloco_wan.json"
COORD_DC = "coord"
TARGET_BYTES_RATIO = 400.0  # fewer bytes than DDP, at least
TARGET_WALL_RATIO = 1.10  # end-to-end wall time vs the no-communication run, at most
TARGET_LOSS_RATIO = 1.03  # val loss vs DDP's, at most
FINAL_RE = re.compile(r"\bfinal (val_loss=.*)$")
# Script arguments per variant (on top of the shared ones); DiLoCo variants also get the outer optimizer.
VARIANTS = {
    "ddp": ["--mode", "ddp"],
    "local": ["--mode", "local"],
    "diloco_fp16": ["--mode", "diloco", "--compression", "fp16"],
    "diloco_fp4": ["--mode", "diloco", "--compression", "fp4"],
    "streaming_fp4": ["--mode", "diloco", "--compression", "fp4", "--fragments", "2"],
    "diloco_int2": ["--mode", "diloco", "--compression", "int2"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=3, help="worker datacenters (one node each)")
    p.add_argument("--rate-mbit", type=int, default=200, help="every datacenter's internet link, both directions")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per worker (a multiple of --sync-every)")
    p.add_argument("--sync-every", type=int, default=50, help="DiLoCo H (per fragment for streaming)")
    p.add_argument("--hidden", type=int, default=256, help="GRU width (256: 0.66 M parameters, 2.6 MB fp32)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per worker per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument(
        "--lr",
        type=float,
        default=5e-3,
        help="AdamW lr, DDP and DiLoCo inner alike (5e-3: DDP's best of 2e-3/3e-3/5e-3/7e-3)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per worker: the 3 simulated nodes share this machine's cores",
    )
    p.add_argument("--outer-lr", type=float, default=0.8, help="see benchmarks/README.md for what was tried")
    p.add_argument("--outer-momentum", type=float, default=0.5, help="Nesterov")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, run in this order [{','.join(VARIANTS)}]"
    )
    p.add_argument("--prefix", default=None, help="testbed namespace prefix [dlw + 4 random hex digits]")
    p.add_argument("--timeout", type=float, default=900, help="seconds per training run before it is cancelled")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"result file [{DEFAULT_JSON.relative_to(REPO)}]")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="run every variant this many times, alternating the order; medians are compared",
    )
    p.add_argument(
        "--local",
        action="store_true",
        help="no meshrun: torchrun in one namespace per worker on a shaped bridge (see LinkTarget)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="stream every rank's output")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds} must be at least 1")
    if args.steps % args.sync_every:
        p.error(f"--steps {args.steps} is not a multiple of --sync-every {args.sync_every}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if not variants or unknown:
        p.error(f"--variants {args.variants!r}: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    args.variants = variants
    args.prefix = args.prefix or f"dlw{secrets.token_hex(2)}"  # concurrent runs must not share one
    return args


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def script_args(args: argparse.Namespace, variant: str) -> list[str]:
    out = [
        *VARIANTS[variant],
        "--steps",
        str(args.steps),
        "--sync-every",
        str(args.sync_every),
        "--hidden",
        str(args.hidden),
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--lr",
        str(args.lr),
        "--threads",
        str(args.threads),
    ]
    if "diloco" in VARIANTS[variant]:
        out += ["--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum)]
    return out


def parse_final(line: str) -> dict:
    """``final val_loss=1.98 bytes_sent=123 ...`` -> {"val_loss": 1.98, "bytes_sent": 123, ...}."""
    m = FINAL_RE.search(line)
    if not m:
        raise ValueError(f"not a final line: {line!r}")
    out: dict = {}
    for pair in m.group(1).split():
        k, _, v = pair.partition("=")
        for conv in (int, float):
            try:
                out[k] = conv(v)
                break
            except ValueError:
                continue
        else:
            out[k] = v
    return out


class MeshrunTarget:
    """The real thing: `meshrun train` on the coordinator of a testbed mesh; bytes at each DC's gateway."""

    def __init__(self, world: World, mesh: Mesh, worker_dcs: list[str]) -> None:
        self.world, self.mesh, self.worker_dcs = world, mesh, worker_dcs

    def counters(self) -> dict[str, int]:
        """Bytes each datacenter's gateway forwarded LAN -> internet so far (what the worker sent)."""
        return {dc: self.world.gateway_counters(dc)["forward_out_bytes"] for dc in self.worker_dcs}

    def start(self, script_argv: list[str]) -> list[subprocess.Popen]:
        argv = ["train", "--no-sync", "--timeout", "120", SCRIPT, *script_argv]
        say(f"meshrun {' '.join(argv)}  (cwd {EXAMPLES})")
        # Not Mesh.meshrun_popen: it appends --state-dir after ARGS, where `meshrun train` hands it to the script.
        coord = self.mesh.coordinator
        return [
            coord.popen(
                self.mesh.python,
                "-m",
                "meshrun",
                argv[0],
                "--state-dir",
                str(self.mesh.state_dir(coord)),
                *argv[1:],
                cwd=str(EXAMPLES),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        ]


class LinkTarget:
    """--local: no meshrun; one network namespace per worker, each linked to a bridge in a hub namespace
    by a veth pair shaped with tbf in both directions (the testbed's settings), torchrun in each.

    No WireGuard, no NAT, no rendezvous server: it checks the training side (losses, payload bytes,
    bytes on a shaped link, wall times) when the mesh cannot be built. Bytes: what each worker's
    veth transmitted (IP and TCP headers included, WireGuard's 60 bytes per packet not).
    """

    def __init__(self, prefix: str, workers: int, rate_mbit: int, run_dir: Path) -> None:
        self.hub = f"{prefix}hub"
        self.ns = [f"{prefix}w{i}" for i in range(workers)]
        self.rate_mbit = rate_mbit
        self.run_dir = run_dir  # under it, a fresh MESHRUN_JOB_DIR per run and worker, as meshrun gives one per job
        self.runs = 0

    @staticmethod
    def sh(*argv: str) -> str:
        return subprocess.run(argv, check=True, capture_output=True, text=True).stdout

    def __enter__(self) -> LinkTarget:
        try:
            self.sh("ip", "netns", "add", self.hub)
            self.sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            self.sh("ip", "-n", self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.ns):
                self.sh("ip", "netns", "add", ns)
                self.sh(
                    "ip",
                    "link",
                    "add",
                    "veth0",
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    f"p{i}",
                    "netns",
                    self.hub,
                )
                self.sh("ip", "-n", self.hub, "link", "set", f"p{i}", "master", "br0", "up")
                self.sh("ip", "-n", ns, "addr", "add", f"10.77.0.{i + 1}/24", "dev", "veth0")
                self.sh("ip", "-n", ns, "link", "set", "veth0", "up")
                self.sh("ip", "-n", ns, "link", "set", "lo", "up")
                for where, dev in ((ns, "veth0"), (self.hub, f"p{i}")):  # upload, download
                    self.sh(
                        "ip",
                        "netns",
                        "exec",
                        where,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        f"{self.rate_mbit}mbit",
                        "burst",
                        "256kb",
                        "latency",
                        "50ms",
                    )
        except BaseException:
            self.__exit__(None, None, None)
            raise
        say(f"--local: {len(self.ns)} worker namespaces on a bridge, every link {self.rate_mbit} Mbit/s both ways")
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in [*self.ns, self.hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def counters(self) -> dict[str, int]:
        out = {}
        for ns in self.ns:
            info = json.loads(self.sh("ip", "-n", ns, "-j", "-s", "link", "show", "dev", "veth0"))
            out[ns] = int(info[0]["stats64"]["tx"]["bytes"])
        return out

    def start(self, script_argv: list[str]) -> list[subprocess.Popen]:
        procs = []
        self.runs += 1  # a fresh port (no TIME_WAIT clash) and fresh job directories per run
        for i, ns in enumerate(self.ns):
            job_dir = self.run_dir / f"run{self.runs}" / ns
            job_dir.mkdir(parents=True)
            env = {
                **os.environ,
                "GLOO_SOCKET_IFNAME": "veth0",
                "MESHRUN_JOB_DIR": str(job_dir),
                "PYTHONPATH": str(REPO),
            }
            argv = [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(len(self.ns)),
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(i),
                "--master-addr",
                "10.77.0.1",
                "--master-port",
                str(29500 + self.runs),
                SCRIPT,
                *script_argv,
            ]
            if i == 0:
                say(" ".join(argv[4:]) + f"  (one per namespace, cwd {EXAMPLES})")
            procs.append(
                subprocess.Popen(
                    argv,
                    cwd=str(EXAMPLES),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        return procs


def run_variant(target: MeshrunTarget | LinkTarget, args: argparse.Namespace, variant: str) -> dict:
    """One training run of `variant` on `target`; returns its measurements."""
    say(f"{variant}:")
    before = target.counters()
    lines: list[str] = []
    t0 = time.monotonic()
    procs = target.start(script_args(args, variant))

    def pump(proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            lines.append(line)
            if args.verbose or " final " in line or "failed" in line:
                print(f"  {line}", file=sys.stderr, flush=True)

    readers = [threading.Thread(target=pump, args=(p,), daemon=True) for p in procs]
    for r in readers:
        r.start()
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, args.timeout - (time.monotonic() - t0))))
        except subprocess.TimeoutExpired:
            say(f"{variant}: still running after {args.timeout:.0f} s: cancelling (SIGTERM to pid {proc.pid})")
            proc.terminate()  # meshrun train cancels the job on every node; torchrun stops its worker
            try:
                codes.append(proc.wait(timeout=30))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
    code = next((c for c in codes if c != 0), 0)
    wall = time.monotonic() - t0
    for r in readers:
        r.join(timeout=10)
    after = target.counters()
    finals = [parse_final(line) for line in lines if FINAL_RE.search(line)]
    result = {
        "variant": variant,
        "exit_code": code,
        "wall_s": round(wall, 2),
        "wire_bytes_per_worker": {k: after[k] - before[k] for k in after},
        "script_args": script_args(args, variant),
        "outer_steps_logged": sum(1 for line in lines if " outer_step " in line),
        "param_checksums": sorted(
            {m.group(1) for m in re.finditer(r"param_checksum rank=\d+ sync=\d+ digest=(\w+)", "\n".join(lines))}
        ),
    }
    wire = list(result["wire_bytes_per_worker"].values())
    result["wire_bytes_mean"] = int(sum(wire) / len(wire))
    if code != 0 or not finals:
        result["error"] = f"exit code {code}, {len(finals)} final line(s)"
        result["output_tail"] = lines[-40:]
        say(f"{variant}: FAILED ({result['error']}); last lines:\n" + "\n".join(lines[-40:]))
        return result
    f = finals[-1]
    result.update(
        {
            "train_loop_s": f.get("wall_s"),
            "val_loss": f.get("val_loss"),
            "payload_bytes_per_worker": f.get("bytes_sent"),
            "world_size": f.get("world_size"),
            "syncs": f.get("syncs"),
            "final_line": next(line for line in reversed(lines) if FINAL_RE.search(line)),
        }
    )
    m = re.search(r"\bparams=(\d+)", "\n".join(lines))
    if m:
        result["params"] = int(m.group(1))
    say(f"{variant}: done in {wall:.1f} s, val_loss {result['val_loss']}")
    return result


def mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def aggregate(runs: list[dict]) -> dict:
    """One variant's rounds as one result: the median of each measurement, every round kept under "rounds"."""
    if len(runs) == 1:
        return runs[0]
    failed = [r for r in runs if "error" in r]
    if failed:
        return {**failed[0], "rounds": runs}
    out = dict(runs[-1])
    for key in ("wall_s", "train_loop_s", "wire_bytes_mean", "payload_bytes_per_worker", "val_loss"):
        out[key] = statistics.median(r[key] for r in runs)
    out["rounds"] = runs
    return out


def run_rounds(target: MeshrunTarget | LinkTarget, args: argparse.Namespace) -> dict[str, dict]:
    """Every variant once per round, the order reversed every other round (the machine's load drifts)."""
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for i in range(args.rounds):
        for variant in args.variants if i % 2 == 0 else args.variants[::-1]:
            runs[variant].append(run_variant(target, args, variant))
    return {v: aggregate(r) for v, r in runs.items()}


def compare(ddp: dict, local: dict, r: dict) -> dict:
    """One variant against DDP (bytes, loss) and the no-communication run (wall): ratios and verdicts."""
    if any("error" in x for x in (ddp, local, r)):
        return {"error": "a run this comparison needs failed; no ratios"}
    out = {
        "payload_bytes_ratio": ddp["payload_bytes_per_worker"] / max(1, r["payload_bytes_per_worker"]),
        "wire_bytes_ratio": ddp["wire_bytes_mean"] / max(1, r["wire_bytes_mean"]),
        "wall_ratio_vs_local": r["wall_s"] / local["wall_s"],
        "train_loop_ratio_vs_local": r["train_loop_s"] / local["train_loop_s"],
        "wall_ratio_vs_ddp": r["wall_s"] / ddp["wall_s"],
        "loss_ratio": r["val_loss"] / ddp["val_loss"],
    }
    # Bytes are judged on the smaller of the two ratios: the wire counts the fixed overhead (WireGuard
    # framing, rendezvous, agent traffic) that no compression removes.
    bytes_ratio = min(out["payload_bytes_ratio"], out["wire_bytes_ratio"])
    out["targets"] = {
        "bytes": {
            "target": f">= {TARGET_BYTES_RATIO:g}x fewer bytes than DDP",
            "value": bytes_ratio,
            "met": bytes_ratio >= TARGET_BYTES_RATIO,
            "off_by": TARGET_BYTES_RATIO / bytes_ratio,
        },
        "wall": {
            "target": f"<= {TARGET_WALL_RATIO:g}x the no-communication wall time (end to end)",
            "value": out["wall_ratio_vs_local"],
            "met": out["wall_ratio_vs_local"] <= TARGET_WALL_RATIO,
            "off_by": out["wall_ratio_vs_local"] / TARGET_WALL_RATIO,
        },
        # The end-to-end time includes start-up that both runs share; the training loop alone is stricter.
        "wall_loop": {
            "target": f"<= {TARGET_WALL_RATIO:g}x the no-communication training loop",
            "value": out["train_loop_ratio_vs_local"],
            "met": out["train_loop_ratio_vs_local"] <= TARGET_WALL_RATIO,
            "off_by": out["train_loop_ratio_vs_local"] / TARGET_WALL_RATIO,
        },
        "loss": {
            "target": f"<= {TARGET_LOSS_RATIO:g}x DDP's val loss",
            "value": out["loss_ratio"],
            "met": out["loss_ratio"] <= TARGET_LOSS_RATIO,
            "off_by": out["loss_ratio"] / TARGET_LOSS_RATIO,
        },
    }
    out["all_met"] = all(t["met"] for t in out["targets"].values())
    return out


def verdict_text(t: dict) -> str:
    """ "met" or "MISSED (off by 1.23x)": how far the value is from the target, as a factor."""
    return "met" if t["met"] else f"MISSED (off by {t['off_by']:.2f}x)"


def summary(cfg: dict, res: dict[str, dict], comps: dict[str, dict]) -> tuple[str, str]:
    """(readable multi-line summary, one-line summary)."""
    params = next((r["params"] for r in res.values() if "params" in r), "?")
    where = (
        f"--local: torchrun in {cfg['workers']} namespaces on a bridge, every link {cfg['rate_mbit']} Mbit/s "
        "(no meshrun, no WireGuard)"
        if cfg["local"]
        else f"over meshrun: {cfg['workers']} workers in {cfg['workers']} datacenters + coordinator, every internet "
        f"link {cfg['rate_mbit']} Mbit/s, wireguard-go overlay"
    )
    lines = [
        f"DiLoCo variants vs DDP {where}",
        f"model: char GRU hidden {cfg['hidden']} ({params} params), {cfg['steps']} steps x "
        f"{cfg['batch_size']}x{cfg['seq_len']} tokens per worker ({cfg['tokens_total']:,} tokens in all), inner "
        f"AdamW lr {cfg['lr']}; DiLoCo H={cfg['sync_every']}, outer lr {cfg['outer_lr']} momentum "
        f"{cfg['outer_momentum']}",
        f"{'variant':<15}{'wall (e2e)':>11}{'train loop':>11}{'payload/worker':>16}{'wire/worker':>14}"
        f"{'val_loss':>10}{'syncs':>6}",
    ]
    for name, r in res.items():
        if "error" in r:
            lines.append(f"{name:<15} FAILED: {r['error']}")
            continue
        lines.append(
            f"{name:<15}{r['wall_s']:>10.1f}s{r['train_loop_s']:>10.1f}s"
            f"{mb(r['payload_bytes_per_worker']):>16}"
            f"{mb(r['wire_bytes_mean']):>14}{r['val_loss']:>10.4f}{r.get('syncs') or '':>6}"
        )
    ones = []
    for name, c in comps.items():
        if "error" in c:
            lines.append(f"{name}: {c['error']}")
            ones.append(f"{name} no comparison")
            continue
        t = c["targets"]
        lines.append(
            f"{name}: bytes {c['wire_bytes_ratio']:.0f}x fewer on the wire, {c['payload_bytes_ratio']:.0f}x payload "
            f"(target >= {TARGET_BYTES_RATIO:g}x): {verdict_text(t['bytes'])} | wall vs no-comm (target <= "
            f"{TARGET_WALL_RATIO:g}x) {c['wall_ratio_vs_local']:.3f}x end to end: {verdict_text(t['wall'])}, "
            f"{c['train_loop_ratio_vs_local']:.3f}x train loop: {verdict_text(t['wall_loop'])}; "
            f"{c['wall_ratio_vs_ddp']:.2f}x DDP | loss {c['loss_ratio']:.4f}x DDP "
            f"({res[name]['val_loss']:.4f} vs {res['ddp']['val_loss']:.4f}; target <= {TARGET_LOSS_RATIO:g}x): "
            f"{verdict_text(t['loss'])}"
        )
        mark = "ALL MET" if c["all_met"] else "missed " + ",".join(k for k, v in t.items() if not v["met"])
        ones.append(
            f"{name} {c['wire_bytes_ratio']:.0f}x/{c['wall_ratio_vs_local']:.2f}x/"
            f"{c['train_loop_ratio_vs_local']:.2f}x/{c['loss_ratio']:.3f}x {mark}"
        )
    one = "diloco_wan (wire bytes vs DDP / wall e2e, train loop vs no-comm / loss vs DDP): " + (
        " | ".join(ones) if ones else "no comparison (ddp or local missing)"
    )
    return "\n".join(lines), one


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("diloco_wan: needs root to build network namespaces (run it with sudo)", file=sys.stderr)
        return 2
    worker_dcs = [f"dc{i}" for i in range(1, args.workers + 1)]
    specs = [DatacenterSpec(COORD_DC, rate_mbit=args.rate_mbit)] + [
        DatacenterSpec(dc, rate_mbit=args.rate_mbit) for dc in worker_dcs
    ]
    cfg = {
        k: getattr(args, k)
        for k in (
            "workers",
            "rate_mbit",
            "steps",
            "sync_every",
            "hidden",
            "batch_size",
            "seq_len",
            "lr",
            "threads",
            "outer_lr",
            "outer_momentum",
            "variants",
            "local",
            "rounds",
        )
    }
    cfg["tokens_total"] = args.steps * args.batch_size * args.seq_len * args.workers
    load_at_start = os.getloadavg()[0]
    t_start = time.monotonic()
    if args.local:
        with (
            tempfile.TemporaryDirectory(prefix="diloco_wan.") as tmp,
            LinkTarget(args.prefix, args.workers, args.rate_mbit, Path(tmp)) as target,
        ):
            results = run_rounds(target, args)
    else:
        with World(specs, prefix=args.prefix, log=say) as world:
            mesh = Mesh(world, f"{COORD_DC}-a")
            mesh.init()
            for dc in worker_dcs:
                mesh.join(f"{dc}-a")
            for dc in worker_dcs:  # every worker reaches the coordinator and every other worker
                for other in worker_dcs + [COORD_DC]:
                    if other != dc:
                        mesh.wait_ping(f"{dc}-a", mesh.overlay_ip(f"{other}-a"), timeout=60)
            say(f"mesh up: coordinator + {', '.join(worker_dcs)} ({time.monotonic() - t_start:.0f} s)")
            target = MeshrunTarget(world, mesh, worker_dcs)
            results = run_rounds(target, args)
    comps = {}
    if {"ddp", "local"} <= set(results):
        comps = {v: compare(results["ddp"], results["local"], results[v]) for v in results if v not in ("ddp", "local")}
    text, one = summary(cfg, results, comps)
    report = {
        "benchmark": "diloco_wan",
        "command": " ".join(["sudo python benchmarks/diloco_wan.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_at_start": load_at_start,
        },
        "environment": environment(),
        "config": cfg,
        "targets": {
            "bytes_ratio_min": TARGET_BYTES_RATIO,
            "wall_ratio_vs_local_max": TARGET_WALL_RATIO,
            "loss_ratio_max": TARGET_LOSS_RATIO,
        },
        "results": results,
        "comparison": comps,
        "summary": one,
        "total_s": round(time.monotonic() - t_start, 1),
    }
    try:
        import torch

        report["machine"]["torch"] = torch.__version__
    except ImportError:
        pass
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(text)
    print(one)
    say(f"wrote {args.json} (total {report['total_s']:.0f} s)")
    failed = any("error" in r for r in results.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
