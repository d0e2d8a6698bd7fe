"""Commands any member runs to look at the overlay: status, ping."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from meshrun.cli.app import Application, JsonOpt, StateOpt, handled, root


@root.command()
@handled
def status(json_out: JsonOpt = False, state_dir: StateOpt = None) -> None:
    """Show this member's peers: name, overlay IP, endpoint, last handshake, rx/tx.

    \b
    Examples:
      meshrun status
      meshrun status --json | jq '.peers[].name'
    """
    from meshrun.mesh import status as st
    app = Application.for_command(state_dir)
    data = st.gather(app.state)
    app.echo(json.dumps(data, indent=2) if json_out else st.render(data))


@root.command()
@handled
def ping(peer: Annotated[str, typer.Argument(help="Peer name or overlay IP.")],
         count: Annotated[int, typer.Option("--count", "-c", help="Probes to send.")] = 5,
         json_out: JsonOpt = False, state_dir: StateOpt = None) -> None:
    """Measure the round trip to a peer over the overlay and show its path (direct/relayed).

    \b
    Examples:
      meshrun ping gpu-b
      meshrun ping 10.213.0.3 --count 20 --json
    """
    from meshrun.mesh import status as st
    app = Application.for_command(state_dir)
    r = st.ping(app.state, peer, count)
    app.echo(json.dumps(r, indent=2) if json_out else st.render_ping(r))
    if not r["received"]:
        app.exit(1)
