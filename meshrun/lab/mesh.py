"""meshrun itself running in a testbed World (meshrun.lab.testbed): `meshrun init` on one node, `join` on
others, and the commands tests, benchmarks and the demo run on them (status, ping, jobs, a pair's relay).

The world is the network (namespaces, NAT, links); this is the product driven inside it, as an operator
at each machine's shell would.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from meshrun.errors import NetworkError, StateError
from meshrun.lab.testbed import Node, World
from meshrun.system.control.coordinatordb import CoordinatorDB
from meshrun.system.files import statedir
from meshrun.system.files.statedir import StateDir

if TYPE_CHECKING:  # annotations only: the lab runs its processes through meshrun.system
    import subprocess


class Mesh:
    """Runs meshrun itself on a World's nodes: init on one, join on others (demo and e2e tests).

    Each node's state lives in ``node.workdir / "state"``; commands run in the node's network
    and mount namespaces with the same Python interpreter as this process.
    """

    def __init__(self, world: World, coordinator: str, python: str = sys.executable, time_scale: float = 1.0) -> None:
        """`time_scale` multiplies every command's timeout: a VM under TCG, itself beside a busy CI worker,
        runs Python many times slower than this host."""
        self.world = world
        self.coordinator = world.node(coordinator)
        self.python = python
        self.time_scale = time_scale
        self.token = ""

    def state_dir(self, node: Node) -> Path:
        return node.workdir / "state"

    def meshrun(
        self,
        node: Node | str,
        *args: str,
        check: bool = True,
        timeout: float = 120,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> subprocess.CompletedProcess:
        """Run `meshrun ARGS` in `node` with MESHRUN_STATE_DIR set to the node's state dir.

        (An environment variable, not --state-dir: after `train SCRIPT` every argument is the script's.)
        """
        n = self.world.node(node) if isinstance(node, str) else node
        statedir.make_dir(n.workdir)
        return n.run(
            self.python,
            "-m",
            "meshrun",
            *args,
            check=check,
            timeout=timeout * self.time_scale,
            env={"MESHRUN_STATE_DIR": str(self.state_dir(n)), **(env or {})},
            cwd=cwd,
        )

    def meshrun_popen(self, node: Node | str, *args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        n = self.world.node(node) if isinstance(node, str) else node
        return n.popen(
            self.python, "-m", "meshrun", *args, env={"MESHRUN_STATE_DIR": str(self.state_dir(n)), **(env or {})}, **kw
        )

    def init(self, *extra: str) -> str:
        """`meshrun init` on the coordinator with its public IP as endpoint; returns the token."""
        out = self.meshrun(self.coordinator, "init", "--endpoint", str(self.coordinator.public_ip), *extra).stdout
        self.token = out.strip().splitlines()[-1]
        return self.token

    def join(self, node: Node | str, *extra: str, token: str | None = None) -> subprocess.CompletedProcess:
        n = self.world.node(node) if isinstance(node, str) else node
        return self.meshrun(n, "join", token or self.token, "--name", n.name, *extra)

    def overlay_ip(self, node: Node | str) -> str:
        n = self.world.node(node) if isinstance(node, str) else node
        return StateDir(self.state_dir(n)).read_json("member.json")["overlay_ip"]

    def ping(self, src: Node | str, dst_ip: str, count: int = 1, wait: float = 2) -> bool:
        n = self.world.node(src) if isinstance(src, str) else src
        res = n.run(
            "ping",
            "-c",
            str(count),
            "-W",
            str(wait),
            "-i",
            "0.2",
            dst_ip,
            check=False,
            timeout=(count * wait + 10) * self.time_scale,
        )
        return res.returncode == 0

    def wait_ping(self, src: Node | str, dst_ip: str, timeout: float = 30) -> float:
        """Ping until one answer arrives; returns seconds it took; NetworkError on timeout. A ping that could not
        even run in time (a machine too loaded to start it, as a VM under TCG beside a busy CI worker) is one
        more try, not the verdict."""
        t0 = time.monotonic()
        last = ""
        while time.monotonic() - t0 < timeout:
            try:
                if self.ping(src, dst_ip, wait=1):
                    return time.monotonic() - t0
            except NetworkError as exc:
                last = f" (last try: {exc.message})"
        name = src if isinstance(src, str) else src.name
        raise NetworkError(
            f"{name} cannot ping {dst_ip} over the overlay after {timeout:.0f} s{last}",
            "see the daemon logs in the nodes' state directories",
        )

    def status(self, node: Node | str) -> dict:
        return json.loads(self.meshrun(node, "status", "--json").stdout)

    def relay_of(self, a: str, b: str) -> str | None:
        """The pair's relay as the (single) coordinator's database has it now ("coordinator" for itself; None:
        not relayed), read directly: `meshrun status` also measures every peer, slowly when one is gone."""
        db = CoordinatorDB(self.state_dir(self.coordinator) / "coordinator.db", readonly=True)
        try:
            state = db.pairs().get(tuple(sorted((a, b))))
        finally:
            db.close()
        if state is None or state.mode != "relayed":
            return None
        return state.relay or "coordinator"

    def job_record(self, on: Node | str, job_id: str, check: bool = True) -> dict:
        """The job's record as `meshrun jobs --json` on `on` lists it ({} if it does not)."""
        jobs = json.loads(self.meshrun(on, "jobs", "--json", check=check).stdout or "[]")
        return next((j for j in jobs if j["job_id"] == job_id), {})

    def job_logs(self, on: Node | str, job_id: str) -> str:
        """`meshrun logs JOB` on `on`: what it printed, errors included."""
        res = self.meshrun(on, "logs", job_id, check=False, timeout=60)
        return res.stdout + res.stderr

    def diagnose(self, on: str, job_id: str) -> str:
        """What a job that stalled or failed needs to be explained: its record and logs as `on` sees them,
        and the tails of the daemons' and the job's logs of every node still there."""
        parts = []
        for what, get in (
            ("record", lambda: json.dumps(self.job_record(on, job_id, check=False))),
            ("logs", lambda: self.job_logs(on, job_id)[-3000:]),
        ):
            try:
                parts.append(f"--- {job_id} {what} on {on}:\n{get()}")
            except Exception as exc:  # a diagnosis must not hide the failure it explains
                parts.append(f"--- {job_id} {what} on {on}: {exc}")
        for node in self.world.nodes:
            state = self.state_dir(node)
            for log in sorted(
                [*state.glob("*.log"), *state.glob(f"jobs/{job_id}/**/*.log"), *state.glob(f"jobs/{job_id}/*.out")]
            ):
                name = str(log.relative_to(state))
                try:
                    tail = "\n".join(StateDir(state).read(name).decode(errors="replace").splitlines()[-25:])
                except StateError as exc:  # a lost node's files may go while this reads them
                    tail = str(exc)
                parts.append(f"--- {node.name} {name}:\n{tail}")
        return "\n".join(parts)
