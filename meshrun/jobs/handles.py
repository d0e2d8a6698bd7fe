"""How the supervisor reaches one member's share of a job: `ShareHandle`, and its two implementations.

`RemoteShare` drives a node's share through the node's job API (meshrun.jobs.nodeapi; every request
MAC'd with that node's job key); `LocalShare` is the coordinator's own share (`--with-coordinator`,
`init --train`), the same share process run here. The supervisor (meshrun.jobs.supervisor), the
dry run and `meshrun pull`/`jobs --prune` (meshrun.jobs.outputs) only ever see a ShareHandle.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Protocol

from meshrun.core import liveness
from meshrun.core.firewall import ProcessGate
from meshrun.core.model import Member, Network
from meshrun.errors import LaunchError
from meshrun.jobs import share as shares
from meshrun.jobs import workdir
from meshrun.system.files import joblogs
from meshrun.system.files.projects import ProjectDir
from meshrun.system.files.statedir import StateDir, remove_tree
from meshrun.system.kernel import firewall
from meshrun.system.machine import host
from meshrun.system.sockets import probe, transport

__all__ = ["ShareHandle", "RemoteShare", "LocalShare", "OUTPUT_WAIT_S"]

OUTPUT_WAIT_S = 4.0  # long-poll for output


class ShareHandle(Protocol):
    """One member's share of a job, as the coordinator drives it. Every method raises MeshrunError (a
    CoordinatorError when the member does not answer)."""

    name: str
    overlay_ip: str

    def health(self) -> dict:
        """Before a job: is the member's agent there, its GPUs and interpreter."""

    def ship(self, job_id: str, project: str, blob: bytes) -> None:
        """Before the pre-flight: lay the packed code over the project's directory there."""

    def preflight(self, job_id: str, python: str | None, cwd: str | None, project: str) -> dict:
        """Its environment report (meshrun.core.preflight.EnvReport fields) and clock."""

    def start(
        self, job_id: str, argv: list[str], env: dict[str, str], cwd: str | None, project: str, allow: list[str]
    ) -> None:
        """Start the share (torchrun) there, its ports answering only the overlay addresses in `allow`."""

    def allow(self, job_id: str, ips: list[str]) -> None:
        """While it runs: a node joined the (elastic) job and may reach its ports too."""

    def restart(self, job_id: str, started_before: float, lost: list[str], members: list[str]) -> None:
        """End its workers started before then: its torchrun restarts them into a new rendezvous round, which
        leaves out the nodes whose overlay addresses are in `lost` at once, and completes as soon as the
        nodes at `members` (the re-formed group, this one among them) have joined."""

    def output(self, job_id: str, offset: int) -> dict:
        """Its output from `offset`: {"lines", "offset", "done", "status"} (a long-poll)."""

    def reachable(self) -> bool:
        """Whether its machine answers a TCP handshake on the agent's port now (meshrun.core.liveness)."""

    def cancel(self, job_id: str) -> None:
        """Stop it (SIGTERM to its tree; it records that it was cancelled)."""

    def pull(self, job_id: str, path: str, max_bytes: int) -> bytes:
        """After (or during) the job: tar.gz of `path` under its working directory."""

    def prune(self, job_id: str) -> None:
        """After the job: delete its job directory there."""

    def remove_project(self, project: str) -> bool:
        """Delete a project's directory there; False if it had none."""


class RemoteShare:
    """A node's share, driven through its job API (every request MAC'd with the node's job key)."""

    def __init__(self, network: Network, m: Member, key: bytes) -> None:
        self.name, self.overlay_ip = m.name, m.overlay_ip
        self.network, self.key = network, key

    def _call(self, method: str, path: str, body: object = None, raw: bytes | None = None, timeout: float = 15) -> dict:
        return transport.call(
            self.overlay_ip, self.network.api_port, method, path, body, raw=raw, key=self.key, timeout=timeout
        )

    def health(self) -> dict:
        return self._call("GET", "/v1/health", timeout=3)

    def reachable(self) -> bool:
        # A refused connection is an answer too: the machine is there, whatever its agent is doing.
        return probe.tcp_rtt(self.overlay_ip, self.network.api_port, timeout=liveness.PROBE_TIMEOUT_S) is not None

    def ship(self, job_id: str, project: str, blob: bytes) -> None:
        self._call("POST", f"/v1/jobs/{job_id}/code?project={project}", raw=blob, timeout=120)

    def preflight(self, job_id: str, python: str | None, cwd: str | None, project: str) -> dict:
        return self._call(
            "POST", f"/v1/jobs/{job_id}/preflight", {"python": python, "cwd": cwd, "project": project}, timeout=90
        )

    def start(
        self, job_id: str, argv: list[str], env: dict[str, str], cwd: str | None, project: str, allow: list[str]
    ) -> None:
        self._call(
            "POST",
            f"/v1/jobs/{job_id}/start",
            {"argv": argv, "env": env, "cwd": cwd, "project": project, "allow": allow},
            timeout=60,
        )

    def allow(self, job_id: str, ips: list[str]) -> None:
        self._call("POST", f"/v1/jobs/{job_id}/allow", {"ips": ips}, timeout=15)

    def restart(self, job_id: str, started_before: float, lost: list[str], members: list[str]) -> None:
        body = {"before": started_before, "lost": lost, "members": members}
        self._call("POST", f"/v1/jobs/{job_id}/restart", body, timeout=15)

    def output(self, job_id: str, offset: int) -> dict:
        return self._call(
            "POST", f"/v1/jobs/{job_id}/output", {"offset": offset, "wait": OUTPUT_WAIT_S}, timeout=OUTPUT_WAIT_S + 6
        )

    def cancel(self, job_id: str) -> None:
        self._call("POST", f"/v1/jobs/{job_id}/cancel", {}, timeout=40)

    def pull(self, job_id: str, path: str, max_bytes: int) -> bytes:
        return transport.call_binary(
            self.overlay_ip,
            self.network.api_port,
            "POST",
            f"/v1/jobs/{job_id}/pull",
            {"path": path, "max_bytes": max_bytes},
            key=self.key,
            timeout=300,
            max_bytes=max_bytes + (1 << 20),
        )

    def prune(self, job_id: str) -> None:
        self._call("POST", f"/v1/jobs/{job_id}/prune", {}, timeout=60)

    def remove_project(self, project: str) -> bool:
        return bool(self._call("POST", f"/v1/projects/{project}/remove", {}, timeout=60).get("removed"))


class LocalShare:
    """The coordinator's own share (`--with-coordinator`, `init --train`): the same share process, run here."""

    def __init__(
        self,
        state: StateDir,
        job_id: str,
        name: str,
        overlay_ip: str,
        interface: str = "meshrun0",
        gate: ProcessGate | None = None,
    ) -> None:
        self.name, self.overlay_ip = name, overlay_ip
        self.state = state
        self.interface = interface
        self.gate = gate  # its guard's: the job's processes alone reach its ports from here
        self.dir = StateDir(joblogs.job_dir(state, job_id) / "share")

    def health(self) -> dict:
        return {"name": self.name, "gpus": host.visible_gpus(), "python": sys.executable}

    def ship(self, job_id: str, project: str, blob: bytes) -> None:
        self.dir.create()
        workdir.receive_code(self.state, job_id, project, blob, self.name)

    def preflight(self, job_id: str, python: str | None, cwd: str | None, project: str) -> dict:
        self.dir.create()
        return workdir.preflight(self.state, self.dir, python or sys.executable, project, cwd)

    def start(
        self, job_id: str, argv: list[str], env: dict[str, str], cwd: str | None, project: str, allow: list[str]
    ) -> None:
        self.dir.create()
        shares.start_share(
            self.dir,
            self.name,
            argv,
            env,
            str(workdir.workdir(self.state, project, cwd)),
            self.state,
            project,
            {"interface": self.interface, "allow": allow, "gate": self.gate.record() if self.gate else None},
        )

    def allow(self, job_id: str, ips: list[str]) -> None:
        firewall.allow(job_id, self.name, ips)

    def restart(self, job_id: str, started_before: float, lost: list[str], members: list[str]) -> None:
        shares.restart_workers(self.dir, started_before, lost, members)

    def output(self, job_id: str, offset: int) -> dict:
        return shares.share_output(self.dir, offset, OUTPUT_WAIT_S)

    def reachable(self) -> bool:
        return True  # this machine: the supervisor runs on it

    def cancel(self, job_id: str) -> None:
        shares.cancel_share(self.dir)

    def pull(self, job_id: str, path: str, max_bytes: int) -> bytes:
        spec = self.dir.read_json("share.json")
        return workdir.pull(Path(str(spec.get("cwd") or "")), path, max_bytes)[0]

    def prune(self, job_id: str) -> None:
        if shares.share_running(self.dir):
            raise LaunchError(f"job {job_id} still runs on {self.name}", "cancel it first")
        remove_tree(self.dir.path)

    def remove_project(self, project: str) -> bool:
        return ProjectDir(self.state, project).remove()
