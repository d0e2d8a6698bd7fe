"""`meshrun service install`: run the coordinator or a node's agent under systemd.

The unit runs ``meshrun up --foreground --state-dir DIR``; the daemon reads the state
directory's role, so one command line serves both roles (the unit names differ so a machine
can be both, with two state directories). Pure rendering (`render_unit`) is separate from
the side effects (`install`): writing the unit file, `systemctl daemon-reload`, and
`systemctl enable --now`, which only run when systemd is the running init and the unit lands
in a directory systemd reads. Otherwise the commands are printed for the operator.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.errors import HostError, StateError, UsageError
from meshrun.mesh import process
from meshrun.system.files import statedir
from meshrun.system.files.statedir import StateDir
from meshrun.system.machine import procs

ROLES = ("coordinator", "agent")
SYSTEM_UNIT_DIR = Path("/etc/systemd/system")
# Directories systemd reads system units from; a unit written elsewhere cannot be enabled.
SYSTEMD_UNIT_DIRS = (
    Path("/etc/systemd/system"),
    Path("/run/systemd/system"),
    Path("/usr/lib/systemd/system"),
    Path("/lib/systemd/system"),
)

_DESCRIPTION = {
    "coordinator": "meshrun coordinator (enrolment, overlay API, job control)",
    "agent": "meshrun agent (peer sync and job API of this node)",
}


def unit_name(role: str) -> str:
    return f"meshrun-{role}.service"


def meshrun_command() -> list[str]:
    """How the unit starts meshrun: the `meshrun` script next to this interpreter, else `python -m meshrun`."""
    script = Path(sys.executable).with_name("meshrun")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "meshrun"]


def render_unit(role: str, state_dir: Path | str, command: list[str]) -> str:
    """The unit file text for `role` (pure)."""
    if role not in ROLES:
        raise UsageError(f"--role {role!r} is not one of {', '.join(ROLES)}", "pass --role coordinator or --role agent")
    exec_start = " ".join([*command, "up", "--foreground", "--state-dir", str(state_dir)])
    return f"""\
# {unit_name(role)}: written by `meshrun service install`; edit with `systemctl edit {unit_name(role)}`.
[Unit]
Description={_DESCRIPTION[role]}
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
# The daemon reads the state directory's role; the WireGuard interface and its peers are
# rebuilt from state on start, so a reboot or crash brings the member back as it was.
ExecStart={exec_start}
Restart=on-failure
RestartSec=5s
# A stop or restart ends the daemon only: wireguard-go (the tunnels), the jobs' supervisors and
# shares run in their own sessions and outlive it (a restart; an upgrade waits for the jobs to end:
# docs/howto/upgrade-with-running-jobs.md). `meshrun leave`/`down` removes the interface,
# `meshrun cancel` stops a job.
KillMode=process
TimeoutStopSec=20s
LimitNOFILE=65536
UMask=0077

[Install]
WantedBy=multi-user.target
"""


def systemd_running() -> bool:
    """True when systemd is this machine's init (sd_booted()'s test)."""
    return Path("/run/systemd/system").is_dir()


@dataclass
class InstallPlan:
    role: str
    unit_path: Path
    text: str
    commands: list[list[str]] = field(default_factory=list)
    run_commands: bool = False  # False: print them for the operator instead
    reason: str = ""  # why the commands are not run


def _role_of(state: StateDir) -> str | None:
    if not state.exists:
        return None
    role = state.read_json("member.json").get("role")
    return {"coordinator": "coordinator", "node": "agent"}.get(role)


def plan_install(
    state: StateDir,
    role: str | None = None,
    unit_dir: Path | None = None,
    command: list[str] | None = None,
    systemd: bool | None = None,
) -> InstallPlan:
    """Decide what `service install` does (reads the state's role; changes nothing)."""
    found = _role_of(state)
    if role is None:
        if found is None:
            raise UsageError(
                f"no meshrun state in {state.path} to take the role from",
                "run `meshrun init`/`meshrun join` first, or pass --role coordinator|agent",
            )
        role = found
    if role not in ROLES:
        raise UsageError(f"--role {role!r} is not one of {', '.join(ROLES)}", "pass --role coordinator or --role agent")
    if found is not None and found != role:
        raise UsageError(
            f"{state.path} holds a {'node' if found == 'agent' else found}, not a "
            f"{'node' if role == 'agent' else role}",
            f"pass --role {found}, or point --state-dir at the other state directory",
        )
    unit_dir = Path(unit_dir) if unit_dir is not None else SYSTEM_UNIT_DIR
    name = unit_name(role)
    plan = InstallPlan(role, unit_dir / name, render_unit(role, state.path, command or meshrun_command()))
    plan.commands = [["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", name]]
    systemd = systemd_running() if systemd is None else systemd
    if not systemd:
        plan.reason = "systemd is not running on this machine"
    elif unit_dir.absolute() not in SYSTEMD_UNIT_DIRS:
        plan.reason = f"{unit_dir} is not a directory systemd reads units from"
    else:
        plan.run_commands = True
    return plan


def install(
    plan: InstallPlan,
    state: StateDir,
    echo: Callable[[str], None],
    dry_run: bool = False,
    runner: Callable[..., procs.CompletedProcess] = procs.run,
) -> None:
    """Carry out `plan` (or, with dry_run, only say what would happen)."""
    if dry_run:
        echo(f"would write {plan.unit_path}:")
        echo(plan.text.rstrip("\n"))
        verb = "would run" if plan.run_commands else f"would not run ({plan.reason}); to do by hand"
        echo(f"{verb}: " + " && ".join(" ".join(c) for c in plan.commands))
        return
    if plan.run_commands and os.geteuid() != 0:
        raise HostError("installing a systemd unit needs root", "run it with sudo")
    try:
        statedir.make_dir(plan.unit_path.parent)
        statedir.atomic_write(plan.unit_path, plan.text, 0o644)
    except StateError as exc:
        raise StateError(exc.message, "run as root, or pick a writable --unit-dir") from None
    echo(f"wrote {plan.unit_path}")
    if not plan.run_commands:
        echo(f"{plan.reason}; to enable it: " + " && ".join(" ".join(c) for c in plan.commands))
        return
    if shutil.which("systemctl") is None:
        raise HostError("`systemctl` is not installed", "install systemd, or start `meshrun up` another way")
    # A daemon started by init/join/up holds the state directory's lock: hand over to systemd.
    # Stopping it leaves the interface (and every tunnel) up.
    if process.stop(state):
        echo("stopped the background daemon; systemd takes over")
    for argv in plan.commands:
        res = runner(argv, capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            raise HostError(
                f"`{' '.join(argv)}` failed: {(res.stderr or res.stdout).strip()}",
                f"see `systemctl status {unit_name(plan.role)}` and `journalctl -u {unit_name(plan.role)}`",
            )
    echo(f"enabled and started {unit_name(plan.role)}; logs: journalctl -u {unit_name(plan.role)}")
