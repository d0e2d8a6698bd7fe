"""What every command shares: the typer root, the Application it hands each command, the one abort path.

A command parses its options, builds an `Application` (state directory, output, verbosity), makes
one library call and renders the result with `app.echo`. Every error surfaces as one line
`meshrun: error: MESSAGE; FIX` on stderr and the error's exit code (hatch's single abort path).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer

from meshrun import __version__
from meshrun.errors import MeshrunError
from meshrun.system.files.statedir import StateDir, default_state_dir

root = typer.Typer(
    add_completion=True,  # --install-completion and --show-completion, as typer offers them
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Train one PyTorch model across NAT'd datacenters over a WireGuard overlay.",
)

StateOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--state-dir",
        envvar="MESHRUN_STATE_DIR",
        show_default=False,
        help="State directory [default: /var/lib/meshrun as root, else ~/.local/state/meshrun].",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
_settings = {"verbose": False}  # set by the root callback, before any command runs


@dataclass
class Application:
    """What a command works with: the member's state directory, the terminal, the verbosity."""

    state: StateDir
    verbose: bool = False

    @classmethod
    def for_command(cls, state_dir: Optional[Path]) -> Application:
        return cls(StateDir(state_dir or default_state_dir()), _settings["verbose"])

    def echo(self, text: str = "", err: bool = False) -> None:
        typer.echo(text, err=err)

    def write(self, text: str) -> None:
        """Raw text on stdout, flushed (a redraw: no newline of its own)."""
        typer.echo(text, nl=False)

    def is_tty(self) -> bool:
        return sys.stdout.isatty()

    def exit(self, code: int) -> NoReturn:
        raise typer.Exit(code)

    def serve(self, foreground: bool) -> None:
        """Run this member's daemon in this process: the job API beside a node's agent, job control
        beside the coordinator."""
        from meshrun.jobs.control import start_job_control
        from meshrun.jobs.nodeapi import start_job_server
        from meshrun.mesh.run import serve

        serve(self.state, foreground, node_extensions=[start_job_server], coordinator_extensions=[start_job_control])


def abort(err: MeshrunError) -> NoReturn:
    typer.echo(f"meshrun: error: {err}", err=True)
    raise typer.Exit(err.exit_code)


def handled(fn):
    """Turn MeshrunError into the one-line message and exit code; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MeshrunError as err:
            abort(err)
        except KeyboardInterrupt:
            typer.echo("meshrun: interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


def _version(value: bool) -> None:
    if value:
        from meshrun.system.files import provenance

        commit = provenance.describe(provenance.PACKAGE)
        typer.echo(f"meshrun {__version__}" + (f" (commit {commit})" if commit else ""))
        raise typer.Exit()


@root.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log what meshrun runs.")] = False,
) -> None:
    _settings["verbose"] = verbose
    level = logging.DEBUG if verbose or os.environ.get("MESHRUN_DEBUG") else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
