"""`meshrun coordinator add|remove|list`: one coordinator or several (state replicated in etcd)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from meshrun.cli.app import Application, JsonOpt, StateOpt, handled, root

coordinator_app = typer.Typer(
    no_args_is_help=True, help="Make members coordinators, or take them out (run on a coordinator)."
)
root.add_typer(coordinator_app, name="coordinator")


@coordinator_app.command("add")
@handled
def add(
    name: Annotated[str, typer.Argument(help="The member that becomes a coordinator.")],
    endpoint: Annotated[str, typer.Option(help="Its public HOST[:PORT] (TCP enrolment, UDP WireGuard).")],
    skip_endpoint_check: Annotated[
        bool,
        typer.Option(
            help="Do not check from here that its enrolment port answers at --endpoint (a NAT that does not "
            "hairpin can hide it from this machine while nodes elsewhere reach it)."
        ),
    ] = False,
    state_dir: StateOpt = None,
) -> None:
    """Make member NAME a coordinator: the network's state is replicated in etcd across the coordinators.

    \b
    Example (two more, for three coordinators: any one may be lost):
      meshrun coordinator add gpu-b --endpoint 198.51.100.7
      meshrun coordinator add gpu-c --endpoint 198.51.100.9
    Open TCP and UDP on that port of the member, as on this coordinator. The endpoint must be a public
    address, and the new coordinator's enrolment port must answer there before the members hear of it
    (else it is a node again and nothing changed). Two coordinators are weaker than one: etcd needs both,
    so add a third. Tokens made afterwards carry every coordinator; make new ones (`meshrun token create`).
    """
    from meshrun.mesh.coordinator import ha

    app = Application.for_command(state_dir)
    info = ha.add(
        app.state,
        name,
        endpoint,
        say=lambda text: app.echo(f"meshrun: {text}", err=True),
        check_endpoint_tls=not skip_endpoint_check,
    )
    app.echo(f"{info.name} is a coordinator: enrolment and WireGuard at {info.endpoint}, etcd at {info.etcd_client}")


@coordinator_app.command("remove")
@handled
def remove(
    name: Annotated[str, typer.Argument(help="The coordinator to take out (not this one).")],
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="If it does not answer, remove it from the network without asking (its machine is gone)."
        ),
    ] = False,
    state_dir: StateOpt = None,
) -> None:
    """Take coordinator NAME out of the cluster: it becomes a node again (or, gone, leaves the network).

    \b
    Example:
      meshrun coordinator remove gpu-c    # with one coordinator left, the state moves back into SQLite
    A coordinator that does not answer for 20 s may be rebooting: at a terminal you are asked before it is
    removed from the network for good (its key can never rejoin); elsewhere that takes --force.
    """
    import sys

    from meshrun.mesh.coordinator import ha

    app = Application.for_command(state_dir)
    ask = (lambda q: typer.confirm(q, default=False, err=True)) if sys.stdin.isatty() else None
    say = lambda text: app.echo(f"meshrun: {text}", err=True)  # noqa: E731
    app.echo(ha.remove(app.state, name, force=force, confirm=ask, say=say))


@coordinator_app.command("rotate-ca")
@handled
def rotate_ca(state_dir: StateOpt = None) -> None:
    """Replace the coordinators' etcd CA: every etcd member gets a certificate of a new CA, the old one is
    trusted no more (`coordinator remove` does this by itself; run it when that could not finish).

    \b
    Example:
      meshrun coordinator rotate-ca
    """
    from meshrun.mesh.coordinator import ha

    app = Application.for_command(state_dir)
    app.echo(ha.rotate(app.state, say=lambda text: app.echo(f"meshrun: {text}", err=True)))


@coordinator_app.command("list")
@handled
def list_(json_out: JsonOpt = False, state_dir: StateOpt = None) -> None:
    """The coordinators: endpoint, overlay address, etcd member health, which one leads.

    \b
    Example:
      meshrun coordinator list --json
    """
    from meshrun.mesh import status

    app = Application.for_command(state_dir)
    rows = status.coordinators(app.state)
    if json_out:
        app.echo(json.dumps(rows, indent=2))
        return
    app.echo(f"{'NAME':<16} {'OVERLAY IP':<15} {'ENDPOINT':<22} {'ETCD':<12} ROLE")
    for r in rows:
        app.echo(f"{r['name']:<16} {r['overlay_ip']:<15} {r['endpoint']:<22} {r['etcd']:<12} {r['role']}")
