"""A project's persistent directory on a member: where its jobs run, and what they leave behind.

<state>/projects/<name>/ holds
  work/          the job's working directory ($MESHRUN_OUTPUT_DIR): the shipped code, laid over what
                 earlier jobs of the project left there (checkpoints, logs, DiLoCo snapshots), so the
                 next run of the same project finds them;
  shipped.json   the names the last shipment held (a file dropped from the project is removed from
                 work/ at the next shipment; nothing else there is touched);
  lock, job      held by the share that runs in work/ (one job at a time per project and node), and
                 that job's id.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from meshrun.core.codeset import PROJECT_RE
from meshrun.errors import LaunchError, UsageError
from meshrun.system.files.statedir import StateDir, atomic_write
from meshrun.system.machine import procs

__all__ = ["ProjectDir", "check_project"]


def check_project(name: str) -> str:
    """`name` if it is a valid project name; UsageError naming it otherwise."""
    if not isinstance(name, str) or not PROJECT_RE.match(name):
        raise UsageError(
            f"project name {name!r} is not 1-64 characters of A-Z a-z 0-9 _ . - (not starting with . or -)",
            "e.g. --project charlm",
        )
    return name


class ProjectDir:
    """The directory of project `name` in a member's state (see the module docstring)."""

    def __init__(self, state: StateDir, name: str) -> None:
        self.name = check_project(name)
        self.root = state / "projects" / name
        self.work = self.root / "work"

    def create(self) -> Path:
        """Make work/ (0755: the job may run under another user's tools) under a 0700 projects directory."""
        StateDir(self.root.parent).create()
        self.work.mkdir(parents=True, exist_ok=True, mode=0o755)
        return self.work

    def shipped(self) -> list[str]:
        """The names of the last shipment ([] before the first)."""
        try:
            data = json.loads((self.root / "shipped.json").read_text())
            return [str(n) for n in data.get("names", [])]
        except (OSError, ValueError, AttributeError):
            return []

    def record_shipment(self, names: list[str], job_id: str) -> None:
        atomic_write(self.root / "shipped.json", json.dumps({"job": job_id, "names": names}), 0o600)

    def _lock(self) -> procs.DaemonLock:
        return procs.DaemonLock(self.root / "lock")

    def user(self) -> str | None:
        """The id of the job running in this project here, or None."""
        if not (self.root / "lock").exists() or not self._lock().held():
            return None
        try:
            return (self.root / "job").read_text().strip() or "?"
        except OSError:
            return "?"

    def refuse_if_busy(self, job_id: str, node: str) -> None:
        """LaunchError when another job of this project runs here (its files are being written)."""
        other = self.user()
        if other is not None and other != job_id:
            raise LaunchError(
                f"project {self.name!r} is in use by job {other} on {node}",
                f"wait for it to end, cancel it (`meshrun cancel {other}`), or run this job in "
                "another project (--project NAME)",
            )

    def take(self, job_id: str, node: str) -> procs.DaemonLock:
        """Hold the project for `job_id` for this process's life (LaunchError when another job has it)."""
        self.create()
        self.refuse_if_busy(job_id, node)
        try:
            lock = self._lock().acquire(f"job {self.user()} of project {self.name}")
        except Exception as exc:  # noqa: BLE001 -- lost the race to another job: say so in the project's words
            raise LaunchError(
                f"project {self.name!r} is in use by another job on {node}",
                "wait for it to end, or run this job with --project NAME",
            ) from exc
        atomic_write(self.root / "job", job_id + "\n", 0o600)
        return lock

    def remove(self) -> bool:
        """Delete the project's directory (LaunchError while a job runs in it); False if there was none."""
        other = self.user()
        if other is not None:
            raise LaunchError(f"project {self.name!r} is in use by job {other}", "cancel it first")
        if not self.root.exists():
            return False
        shutil.rmtree(self.root)
        return True
