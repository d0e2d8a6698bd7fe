"""Commands on a node: join, leave."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from meshrun.cli.app import Application, StateOpt, handled, root


@root.command()
@handled
def leave(
    purge: Annotated[bool, typer.Option(help="Also delete this node's key and state.")] = False,
    state_dir: StateOpt = None,
) -> None:
    """Stop this node's agent and remove its interface (state stays unless --purge).

    \b
    Example:
      meshrun leave --purge
    """
    from meshrun.mesh.node import setup as node

    app = Application.for_command(state_dir)
    app.echo(node.leave(app.state, purge=purge).summary())


@root.command()
@handled
def join(
    token: Annotated[
        Optional[str],
        typer.Argument(
            help="The token printed by `meshrun init` or `token create`; `-` reads it from stdin. [$MESHRUN_TOKEN]"
        ),
    ] = None,
    token_file: Annotated[
        Optional[Path], typer.Option("--token-file", help="Read the token from this file (keep it 0600).")
    ] = None,
    name: Annotated[Optional[str], typer.Option(help="This node's name [default: hostname].")] = None,
    endpoint: Annotated[Optional[str], typer.Option(help="This node's own public HOST[:PORT], if it has one.")] = None,
    mtu: Annotated[
        Optional[int], typer.Option(help="Overlay MTU [probed: the network's, lowered to fit the path].")
    ] = None,
    site: Annotated[
        Optional[str],
        typer.Option(
            help="The site this node is in: nodes that share a private network (a datacenter, a VPC, a fabric). "
            "Its pairs with the site's other nodes use that network, even where each node has its own public IP."
        ),
    ] = None,
    relay: Annotated[
        Optional[bool],
        typer.Option(
            "--relay/--no-relay",
            help="May relay pairs of other members that cannot connect directly [default: yes].",
        ),
    ] = None,
    tunnels: Annotated[
        Optional[int],
        typer.Option(
            help="WireGuard tunnels per same-site pair, flows spread over them: more cores for encryption "
            "(a many-core host; the site network must pass UDP 51811-51817) [default: 1].",
        ),
    ] = None,
    foreground: Annotated[bool, typer.Option(help="Run the agent in this process (for systemd).")] = False,
    wait: Annotated[
        float,
        typer.Option(
            help="Seconds the agent has for its first sync with the coordinator before the join is undone.",
        ),
    ] = 45.0,
    state_dir: StateOpt = None,
) -> None:
    """Join this machine to a network: make keys, enrol, bring up the interface, start the agent.

    \b
    The token is a secret: pass it on stdin, in a file or in $MESHRUN_TOKEN rather than on the
    command line (where /proc/*/cmdline and the shell's history show it). Examples:
      meshrun join - --name gpu-a < token            # or: ssh coord meshrun token create | meshrun join -
      meshrun join --token-file /root/token --name gpu-a
      MESHRUN_TOKEN=mr1.eyJ... meshrun join --name gpu-a
    Returns once the interface is up and the node is registered. Running it again on an
    enrolled node resumes with the same key and address.
    """
    from meshrun.mesh.node import setup as node

    app = Application.for_command(state_dir)
    text = read_token(token, token_file)
    res = node.join(
        text,
        app.state,
        name=name,
        endpoint=endpoint,
        start=not foreground,
        mtu=mtu,
        site=site,
        relay=relay,
        tunnels=tunnels,
        wait=wait,
    )
    verb = "resumed" if res.resumed else "joined"
    app.echo(
        f"{verb} {res.network.name} as {res.name} at {res.overlay_ip} on {res.network.interface} "
        f"({res.backend}, mtu {res.mtu})"
    )
    if res.warning:
        app.echo(f"meshrun: warning: {res.warning}", err=True)
    if foreground:
        app.serve(foreground=True)


def read_token(arg: str | None, token_file: Path | None) -> str:
    """The join token from the argument (`-`: stdin), --token-file or $MESHRUN_TOKEN (UsageError when none,
    or more than one, is given).

    $MESHRUN_TOKEN leaves this process's environment as it is read (whichever source the token came from):
    the agent daemon started from here, and every job's processes it starts, would inherit it."""
    import os
    import sys

    from meshrun.errors import UsageError
    from meshrun.system.files.statedir import read_user_file

    env = os.environ.pop("MESHRUN_TOKEN", "").strip()
    given = [w for w, v in (("the argument", arg), ("--token-file", token_file)) if v is not None]
    if len(given) > 1:
        raise UsageError("the token was given both as an argument and with --token-file", "give it once")
    if token_file is not None:
        return read_user_file(token_file, "token file", "--token-file").strip()
    if arg == "-":
        text = sys.stdin.readline().strip()
        if not text:
            raise UsageError("no token on stdin", "pipe it in: meshrun join - < token")
        return text
    if arg is not None:
        return arg
    if env:
        return env
    raise UsageError("no join token given", "meshrun join - < token, --token-file FILE, or MESHRUN_TOKEN=...")
