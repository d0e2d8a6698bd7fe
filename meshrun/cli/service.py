"""Running a member as a service: `service install`, and the hidden `daemon` command it and init/join/up start."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from meshrun.cli.app import Application, StateOpt, handled, root

service_app = typer.Typer(no_args_is_help=True, help="Run this member under systemd.")
root.add_typer(service_app, name="service")


@service_app.command("install")
@handled
def service_install(
    role: Annotated[Optional[str], typer.Option(help="coordinator or agent [from the state directory].")] = None,
    unit_dir: Annotated[Optional[Path], typer.Option(help="Where to write the unit [/etc/systemd/system].")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the unit and the commands, change nothing.")
    ] = False,
    state_dir: StateOpt = None,
) -> None:
    """Write a systemd unit running `meshrun up --foreground` and enable it (restarts on failure and at boot).

    \b
    Examples:
      meshrun service install --dry-run
      meshrun service install --role agent --state-dir /srv/meshrun
    Without a running systemd (containers) it writes the unit and prints the commands to run.
    """
    from meshrun.mesh import systemd

    app = Application.for_command(state_dir)
    plan = systemd.plan_install(app.state, role=role, unit_dir=unit_dir)
    systemd.install(plan, app.state, app.echo, dry_run=dry_run)


@root.command(hidden=True)
@handled
def daemon(state_dir: StateOpt = None) -> None:
    """Run the coordinator or agent daemon for a state directory (started by init/join/up)."""
    Application.for_command(state_dir).serve(foreground=False)
