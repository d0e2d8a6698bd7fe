"""Commands any member runs to look at the overlay: status, ping, doctor, metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from meshrun.cli.app import Application, JsonOpt, StateOpt, handled, root


@root.command()
@handled
def status(
    all_rows: Annotated[bool, typer.Option("--all", help="Every peer and pair, not a summary.")] = False,
    json_out: JsonOpt = False,
    state_dir: StateOpt = None,
) -> None:
    """Show this member's peers: name, overlay IP, endpoint, last handshake, rx/tx.

    With more than 20 peers (or node pairs) it shows counts by path and handshake and the worst
    few; --all lists every row, --json always has every row.

    \b
    Examples:
      meshrun status
      meshrun status --all
      meshrun status --json | jq '.peers[].name'
    """
    from meshrun.mesh import status as st

    app = Application.for_command(state_dir)
    data = st.gather(app.state)
    app.echo(json.dumps(data, indent=2) if json_out else st.render(data, full=all_rows))


@root.command()
@handled
def ping(
    peer: Annotated[str, typer.Argument(help="Peer name or overlay IP.")],
    count: Annotated[int, typer.Option("--count", "-c", help="Probes to send.")] = 5,
    json_out: JsonOpt = False,
    state_dir: StateOpt = None,
) -> None:
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


@root.command()
@handled
def doctor(json_out: JsonOpt = False, state_dir: StateOpt = None) -> None:
    """Check this member for what would stop or slow training, each problem with its fix.

    Daemon, interface, WireGuard backend, MTU (a full-size DF probe), the coordinator over the
    overlay, each peer's handshake and path, UDP reachability from outside, clock, disk, torch, and
    variables that would override meshrun's interface pinning. Exits 1 when something blocks training.

    \b
    Examples:
      meshrun doctor
      meshrun doctor --json | jq '.checks[] | select(.level != "ok")'
    """
    from meshrun.core import doctor as dr
    from meshrun.mesh import doctor as md

    app = Application.for_command(state_dir)
    facts, checks = md.run(app.state)
    if json_out:
        app.echo(json.dumps({"ok": not dr.blocking(checks), "checks": dr.to_json(checks), "facts": facts}, indent=2))
    else:
        app.echo(
            dr.render(
                checks,
                f"meshrun doctor: {facts['role']} {facts['name']} ({facts['overlay_ip']}) "
                f"in network {facts['network']}",
            )
        )
    if dr.blocking(checks):
        app.exit(1)


@root.command()
@handled
def metrics(
    textfile: Annotated[
        Optional[Path],
        typer.Option(
            metavar="PATH",
            help="Write them to PATH (a .prom file in node_exporter's textfile directory) in one rename, "
            "instead of printing them.",
        ),
    ] = None,
    state_dir: StateOpt = None,
) -> None:
    """Print this member's metrics in Prometheus' text format: its peers (handshakes, bytes, path) and, on a
    coordinator, its pairs and jobs (state, step, rate, last output, re-formed groups, reported numbers).

    Nothing listens for them: a timer writes them where node_exporter's textfile collector reads them
    (docs/metrics.md). No packet is sent to gather them.

    \b
    Examples:
      meshrun metrics
      meshrun metrics --textfile /var/lib/node_exporter/textfile_collector/meshrun.prom
    """
    from meshrun.jobs import metrics as mm

    app = Application.for_command(state_dir)
    text = mm.collect(app.state)
    if textfile is None:
        app.write(text)
    else:
        app.echo(f"wrote {mm.write_textfile(textfile, text)}")
