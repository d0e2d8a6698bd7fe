"""Commands on a node: join, leave."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from meshrun.cli.app import Application, StateOpt, handled, root


@root.command()
@handled
def leave(purge: Annotated[bool, typer.Option(help="Also delete this node's key and state.")] = False,
          state_dir: StateOpt = None) -> None:
    """Stop this node's agent and remove its interface (state stays unless --purge).

    \b
    Example:
      meshrun leave --purge
    """
    from meshrun.mesh import node
    app = Application.for_command(state_dir)
    iface = node.leave(app.state, purge=purge)
    app.echo(f"stopped; removed {iface}" + ("; state deleted" if purge else ""))


@root.command()
@handled
def join(token: Annotated[str, typer.Argument(help="The token printed by `meshrun init` or `token create`.")],
         name: Annotated[Optional[str], typer.Option(help="This node's name [default: hostname].")] = None,
         endpoint: Annotated[Optional[str], typer.Option(help="This node's own public HOST[:PORT], if it has one.")] = None,
         mtu: Annotated[Optional[int], typer.Option(help="Overlay MTU [probed: the network's, lowered to fit the path].")] = None,
         foreground: Annotated[bool, typer.Option(help="Run the agent in this process (for systemd).")] = False,
         state_dir: StateOpt = None) -> None:
    """Join this machine to a network: make keys, enrol, bring up the interface, start the agent.

    \b
    Examples:
      meshrun join mr1.eyJ... --name gpu-a
      meshrun join "$(cat token)" --state-dir /srv/meshrun
    Returns once the interface is up and the node is registered. Running it again on an
    enrolled node resumes with the same key and address.
    """
    from meshrun.mesh import node
    app = Application.for_command(state_dir)
    res = node.join(token, app.state, name=name, endpoint=endpoint, start=not foreground, mtu=mtu)
    verb = "resumed" if res.resumed else "joined"
    app.echo(f"{verb} {res.network.name} as {res.name} at {res.overlay_ip} on {res.network.interface} "
             f"({res.backend}, mtu {res.mtu})")
    if res.warning:
        app.echo(f"meshrun: warning: {res.warning}", err=True)
    if foreground:
        app.serve(foreground=True)
