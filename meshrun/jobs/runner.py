"""`meshrun train`: run one job on every node's agent and stream it back.

The plan (argv + env per node) comes from the pure `meshrun.launch.plan`; this module does
the side effects: wait for agents, ship code, start the shares, relay output, pick the exit
code, and cancel everywhere on Ctrl-C/SIGTERM.
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.core import launch
from meshrun.core.model import Member, Network
from meshrun.errors import LaunchError, MeshrunError, UsageError
from meshrun.mesh import member
from meshrun.mesh.coordinator import admin
from meshrun.system import archive, host, probe, procs, transport
from meshrun.system.store import StateDir

DEFAULT_SYNC_LIMIT_MB = 50
FORWARD_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_")
# After one node's share fails in a fixed-size job, the others are stopped this many seconds
# later: their torchrun would otherwise sit in its exit barrier (300 s, not configurable from
# the command line) waiting for the dead node. The grace lets simultaneous failures report.
FAIL_GRACE_S = 3.0
# An elastic (MIN:MAX) job starts with MIN..MAX ready nodes after this long, instead of
# waiting for a node that may be down.
ELASTIC_GRACE_S = 10.0


@dataclass
class TrainRequest:
    """What the user asked `meshrun train` for (validated by `launch.plan`)."""

    script: str
    script_args: list[str] = field(default_factory=list)
    nnodes: str | None = None
    nproc_per_node: int | None = None
    max_restarts: int = 0
    nodes: list[str] | None = None          # only these node names
    wait_timeout: float = 120.0
    no_sync: bool = False
    sync_limit_mb: int = DEFAULT_SYNC_LIMIT_MB
    dry_run: bool = False
    env: dict[str, str] = field(default_factory=dict)
    job_id: str | None = None
    python: str | None = None              # interpreter on the nodes [the one running their agent]
    module: bool = False                   # script is a module name: python -m script
    rdzv_timeout: int = 900                # seconds the rendezvous waits for every node

    def options(self, script: str, job_id: str, network: Network, python: str) -> launch.TrainOptions:
        """The launch options for this request on `network` (validated later by `launch.plan`)."""
        return launch.TrainOptions(
            script=script, script_args=tuple(self.script_args), nnodes=self.nnodes,
            nproc_per_node=self.nproc_per_node, max_restarts=self.max_restarts, job_id=job_id,
            rdzv_host=network.coordinator_ip, rdzv_port=network.rdzv_port, interface=network.interface,
            python=python, rdzv_timeout=self.rdzv_timeout, module=self.module)


def user_env(extra: dict[str, str]) -> dict[str, str]:
    """The caller's NCCL_*/GLOO_*/TORCH_* variables plus --env pairs: they override meshrun's defaults."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARD_ENV_PREFIXES)}
    env.update(extra)
    return env


def parse_env_pairs(pairs: list[str]) -> dict[str, str]:
    out = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k or not k.replace("_", "a").isalnum():
            raise UsageError(f"--env {p!r} is not KEY=VALUE", "e.g. --env NCCL_DEBUG=INFO")
        out[k] = v
    return out


def new_job_id(script: str) -> str:
    stem = "".join(c if c.isalnum() or c in "-_" else "-" for c in Path(script).stem)[:24] or "job"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


class Console:
    """Serialises output lines from many threads; one live status line on a terminal."""

    def __init__(self, out=None, err=None) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.lock = threading.Lock()
        self.live = self.err.isatty()

    def line(self, text: str, err: bool = False) -> None:
        with self.lock:
            stream = self.err if err else self.out
            stream.write(text + "\n")
            stream.flush()

    def status(self, text: str) -> None:
        with self.lock:
            if self.live:
                self.err.write("\r\033[K" + text)
            else:
                self.err.write(text + "\n")
            self.err.flush()

    def end_status(self) -> None:
        if self.live:
            with self.lock:
                self.err.write("\n")


def wait_for_nodes(network: Network, members: list[Member], want: int, timeout: float,
                   console: Console, enough: int | None = None, grace: float = ELASTIC_GRACE_S
                   ) -> list[tuple[Member, dict]]:
    """Poll each node's agent (GET /v1/health over the overlay) until `want` answer.

    For an elastic job (`enough` = its MIN < `want`), `enough` answering agents suffice once
    `grace` seconds have passed: a node that is down must not keep a MIN:MAX job from starting.
    Returns at most `want` ready nodes.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    last = ""
    while True:
        def probe(m: Member) -> dict | None:
            try:
                return transport.call(m.overlay_ip, network.api_port, "GET", "/v1/health", timeout=3)
            except MeshrunError:
                return None

        with ThreadPoolExecutor(max_workers=max(1, len(members))) as pool:
            results = dict(zip((m.name for m in members), pool.map(probe, members)))
        ready = [(m, results[m.name]) for m in members if results.get(m.name)]
        missing = [m.name for m in members if not results.get(m.name)]
        msg = f"{len(ready)}/{want} nodes ready" + (f" (waiting for: {', '.join(missing)})" if missing else "")
        if msg != last:
            console.status(msg)
            last = msg
        if len(ready) >= want or (enough is not None and len(ready) >= enough
                                  and time.monotonic() - t0 >= min(grace, timeout)):
            console.end_status()
            return ready[:want]
        if time.monotonic() >= deadline:
            console.end_status()
            raise LaunchError(f"only {len(ready)} of {want} nodes were ready after {timeout:.0f} s; "
                              f"not answering: {', '.join(missing) or 'none'}",
                              "check `meshrun status` on the coordinator and that those agents run "
                              "(`meshrun join`/`meshrun up` on them), or lower --nnodes")
        time.sleep(1)


class Train:
    """One `meshrun train` run on the coordinator."""

    def __init__(self, network: Network, members: list[Member], req: TrainRequest, console: Console,
                 cwd: Path | None = None) -> None:
        self.network = network
        self.req = req
        self.console = console
        self.cwd = cwd or Path.cwd()
        nodes = [m for m in members if not m.is_coordinator]
        if req.nodes:
            unknown = sorted(set(req.nodes) - {m.name for m in nodes})
            if unknown:
                raise UsageError(f"--nodes names unknown node(s): {', '.join(unknown)}",
                                 f"members are: {', '.join(m.name for m in nodes) or 'none'}")
            nodes = [m for m in nodes if m.name in req.nodes]
        if not nodes:
            raise LaunchError("no node has joined this network yet", "run `meshrun join TOKEN` on the GPU machines")
        self.nodes = nodes
        self.job_id = req.job_id or new_job_id(req.script)
        self.cancel_event = threading.Event()    # the user cancelled (Ctrl-C / SIGTERM)
        self.abort_event = threading.Event()     # a node failed: the rest are being stopped
        self.results: dict[str, dict] = {}

    def wanted(self) -> tuple[int, int]:
        """(nodes to wait for, nodes that suffice after ELASTIC_GRACE_S): MAX and MIN of --nnodes."""
        if self.req.nnodes:
            lo, hi = launch.parse_nnodes(self.req.nnodes)
            return (min(hi, len(self.nodes)), lo) if hi > lo else (hi, hi)
        return len(self.nodes), len(self.nodes)

    def plan(self, ready: list[tuple[Member, dict]]) -> list[launch.NodeLaunch]:
        script = self.req.script
        if not self.req.no_sync and not self.req.module:
            # The script's directory is shipped and becomes the job's working directory.
            script = str(Path(script).name) if (self.cwd / script).is_file() else script
        opts = self.req.options(script, self.job_id, self.network, self.req.python or "python3")
        infos = [launch.NodeInfo(m.name, m.overlay_ip, int(h.get("gpus", 0)) if h else 0) for m, h in ready]
        plans = launch.plan(infos, opts, user_env(self.req.env))
        if self.req.python:
            return plans
        # By default each node uses the interpreter its agent runs under: it has meshrun and torch.
        pythons = {m.name: str(h.get("python") or "python3") for m, h in ready}
        return [launch.NodeLaunch(p.node, (pythons[p.node], *p.argv[1:]), p.env) for p in plans]

    def run(self) -> int:
        """Run the job; returns the exit code `meshrun train` should exit with."""
        if not self.req.dry_run:
            self._check_store()
        want, enough = self.wanted()
        if self.req.dry_run:
            ready = [(m, {"gpus": 0}) for m in self.nodes]
        else:
            ready = wait_for_nodes(self.network, self.nodes, want, self.req.wait_timeout, self.console,
                                   enough=enough if enough < want else None)
        plans = self.plan(ready)
        workdir = None
        if self.req.no_sync:
            workdir = str(self.cwd)
        if self.req.dry_run:
            for p in plans:
                self.console.line(f"# {p.node}")
                self.console.line(f"cd {shlex.quote(workdir or '<job dir>/code')} && {p.shell()}")
            return 0
        by_name = {m.name: m for m, _ in ready}
        if not self.req.no_sync:
            if self.req.module:    # runs from the shipped current directory (python -m puts it on sys.path)
                code_dir = self.cwd
            else:
                script_path = self.cwd / self.req.script
                if not script_path.is_file():
                    raise UsageError(f"script {self.req.script!r} not found in {self.cwd}",
                                     "run `meshrun train` from the directory of your training code, or use --no-sync")
                code_dir = script_path.parent
            blob = archive.pack_code(code_dir, self.req.sync_limit_mb)
            self._each(plans, lambda p: transport.call(by_name[p.node].overlay_ip, self.network.api_port, "POST",
                                                      f"/v1/jobs/{self.job_id}/code", raw=blob, timeout=120))
        self.console.line(f"meshrun: job {self.job_id} on {len(plans)} node(s): "
                          f"{', '.join(p.node for p in plans)}", err=True)
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in old:
            signal.signal(s, lambda *_: self.cancel())
        threads = [threading.Thread(target=self._stream, args=(p, by_name[p.node], workdir), daemon=True)
                   for p in plans]
        try:
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                for t in threads:
                    t.join(0.2)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return self._verdict(plans)

    def _check_store(self) -> None:
        if not probe.listening(self.network.coordinator_ip, self.network.rdzv_port, timeout=3):
            raise LaunchError(f"the rendezvous store is not listening on {self.network.coordinator_ip}:"
                              f"{self.network.rdzv_port}",
                              "run `meshrun train` on the coordinator while its daemon runs (`meshrun up`); "
                              "its log says why the store did not start")

    def _each(self, plans, fn: Callable) -> None:
        with ThreadPoolExecutor(max_workers=max(1, len(plans))) as pool:
            list(pool.map(fn, plans))   # every call finishes; the first error (in plan order) is raised

    def _stream(self, p: launch.NodeLaunch, m: Member, workdir: str | None) -> None:
        body = {"argv": list(p.argv), "env": p.env, "cwd": workdir}
        prefix = f"[{p.node}]"
        try:
            for ev in transport.stream(m.overlay_ip, self.network.api_port, f"/v1/jobs/{self.job_id}/run", body,
                                       timeout=60):
                kind = ev.get("type")
                if kind == "out":
                    line = str(ev.get("line", ""))
                    text = line if line.startswith(f"[{p.node} r") else f"{prefix} {line}"
                    self.console.line(text, err=ev.get("stream") == "stderr")
                elif kind == "exit":
                    self.results[p.node] = ev
                    # A launcher that exits 0 may carry failure records from attempts torch elastic
                    # recovered from; only a failed launcher stops a fixed-size job.
                    if ev.get("code") and not self.elastic():
                        self._fail_fast(p.node)
        except MeshrunError as exc:
            if not self.cancel_event.is_set():
                self.console.line(f"{prefix} meshrun: lost the job stream: {exc}", err=True)
        if p.node not in self.results and not self.cancel_event.is_set():
            self.console.line(f"{prefix} meshrun: lost the node's share (node or agent gone)", err=True)
            self.results[p.node] = {"code": 255, "failures": [], "lost": True}

    def elastic(self) -> bool:
        if not self.req.nnodes:
            return False
        lo, hi = launch.parse_nnodes(self.req.nnodes)
        return lo != hi

    def _fail_fast(self, node: str) -> None:
        if self.abort_event.is_set() or self.cancel_event.is_set():
            return
        self.abort_event.set()
        self.console.line(f"meshrun: the share on {node} failed; stopping the other nodes in {FAIL_GRACE_S:.0f} s",
                          err=True)
        timer = threading.Timer(FAIL_GRACE_S, self._stop_nodes, args=(
            [m for m in self.nodes if m.name not in self.results],))
        timer.daemon = True
        timer.start()

    def cancel(self) -> None:
        """Stop the job on every node (Ctrl-C / SIGTERM)."""
        if self.cancel_event.is_set():
            return
        self.cancel_event.set()
        self.console.line("meshrun: cancelling the job on every node ...", err=True)
        self._stop_nodes(self.nodes)

    def _stop_nodes(self, nodes: list[Member]) -> None:
        def go(m: Member) -> None:
            try:
                transport.call(m.overlay_ip, self.network.api_port, "POST", f"/v1/jobs/{self.job_id}/cancel",
                               {}, timeout=10)
            except MeshrunError as exc:
                self.console.line(f"[{m.name}] meshrun: cancel failed: {exc}", err=True)
        ts = [threading.Thread(target=go, args=(m,), daemon=True) for m in nodes]
        for t in ts:
            t.start()

    def _verdict(self, plans: list[launch.NodeLaunch]) -> int:
        """The exit code: 0 when the job finished (on at least MIN nodes for elastic jobs), else the
        first failing rank's code (by time), else the failing launcher's code."""
        if self.cancel_event.is_set():
            self.console.line("meshrun: job cancelled", err=True)
            return 130
        ok = [p.node for p in plans if self.results.get(p.node, {}).get("code") == 0]
        lost = [p.node for p in plans if self.results.get(p.node, {}).get("lost")]
        failures = [f for r in self.results.values() for f in r.get("failures", [])]
        lo = launch.parse_nnodes(self.req.nnodes)[0] if self.req.nnodes else len(plans)
        if len(ok) == len(plans) or (self.elastic() and len(ok) >= lo):
            notes = []
            if lost:
                notes.append(f"lost {', '.join(lost)} mid-job; torch elastic continued without it")
            if failures:
                notes.append(f"{len(failures)} worker exit(s) recovered by restarts")
            self.console.line(f"meshrun: job {self.job_id} finished on {len(ok)} node(s)"
                              + (f" ({'; '.join(notes)})" if notes else ""), err=True)
            return 0
        if failures:
            first = min(failures, key=lambda f: f.get("time", 0))
            code = int(first.get("exit_code") or 1)
            self.console.line(f"meshrun: job {self.job_id} failed: rank {first.get('rank')} on "
                              f"{first.get('node')} exited with code {code} (first failure)", err=True)
            return code if 0 < code < 256 else 1
        node = next(p.node for p in plans if p.node not in ok)
        code = int(self.results.get(node, {}).get("code") or 1)
        code = code if 0 < code < 256 else 1
        self.console.line(f"meshrun: job {self.job_id} failed: the launcher on {node} exited with code {code}",
                          err=True)
        return code


def train(state: StateDir, req: TrainRequest, console: Console | None = None) -> int:
    """Entry point for `meshrun train` on the coordinator."""
    network, members = admin.members(state)
    return Train(network, members, req, console or Console()).run()


def train_local(state: StateDir, req: TrainRequest) -> int:
    """`meshrun train --local`: run this node's share in the foreground (exec torchrun).

    Every other node runs the same command; they meet at the coordinator's rendezvous store.
    """
    rec, network = member.load(state)
    if not req.nnodes:
        raise UsageError("--local needs --nnodes: how many nodes take part in total",
                         "e.g. meshrun train --local --nnodes 2 --job-id exp7 train.py")
    job_id = req.job_id or os.environ.get("MESHRUN_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise UsageError("--local needs --job-id, the same on every node (or MESHRUN_JOB_ID / SLURM_JOB_ID set)",
                         "e.g. meshrun train --local --nnodes 2 --job-id exp7 train.py")
    opts = req.options(req.script, job_id, network, req.python or sys.executable)
    me = launch.NodeInfo(rec["name"], rec["overlay_ip"], host.visible_gpus())
    (p,) = launch.plan([me], opts, user_env(req.env), local=True)
    if req.dry_run:
        print(p.shell())
        return 0
    sys.stdout.flush()
    procs.exec_replace(p.argv, p.env)  # torchrun owns signals and exit codes from here
