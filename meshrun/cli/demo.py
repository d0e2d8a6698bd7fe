"""`meshrun demo`: the whole product on one machine, in network namespaces."""

from __future__ import annotations

from typing import Annotated

import typer

from meshrun.cli.app import Application, handled, root


@root.command()
@handled
def demo(
    nodes: Annotated[int, typer.Option(help="Training datacenters to simulate (plus one for the coordinator).")] = 3,
    sites: Annotated[
        bool, typer.Option("--sites", help="Two datacenters of two nodes each: DDP inside a site, DiLoCo across.")
    ] = False,
) -> None:
    """Show the whole product on this machine: NAT'd datacenters in namespaces, init, join, train.

    \b
    Needs root (it builds network namespaces) and a meshrun checkout. Example:
      meshrun demo --nodes 3          # as root
      meshrun demo --sites            # several nodes per datacenter
    """
    from meshrun.lab import demo as d

    app = Application.for_command(None)
    app.exit(d.run(nodes, out=app.echo, sites=sites))
