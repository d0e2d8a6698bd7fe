"""Commands on the coordinator: init, up, down, token create/list/revoke, remove, site list/trust/untrust."""

from __future__ import annotations

import json
import time
from typing import Annotated, Optional

import typer

from meshrun.cli.app import Application, JsonOpt, StateOpt, handled, root
from meshrun.errors import UsageError

token_app = typer.Typer(no_args_is_help=True, help="Create, list and revoke join tokens (on the coordinator).")
root.add_typer(token_app, name="token")


@root.command()
@handled
def init(
    endpoint: Annotated[Optional[str], typer.Option(help="Public HOST[:PORT] nodes reach this machine at.")] = None,
    cidr: Annotated[str, typer.Option(help="Overlay address range.")] = "10.213.0.0/16",
    port: Annotated[int, typer.Option(help="UDP port for WireGuard and TCP port for enrolment.")] = 51820,
    interface: Annotated[str, typer.Option(help="WireGuard interface name.")] = "meshrun0",
    mtu: Annotated[int, typer.Option(help="Overlay MTU (1420 fits a 1500-byte underlay).")] = 1420,
    network: Annotated[str, typer.Option(help="Network name.")] = "meshrun",
    name: Annotated[
        str, typer.Option("--name", help="This coordinator's member name (nodes, `status` and jobs show it).")
    ] = "coordinator",
    ttl: Annotated[str, typer.Option(help="Lifetime of the first join token.")] = "12h",
    uses: Annotated[Optional[int], typer.Option(help="How many joins the first token allows [unlimited].")] = None,
    train: Annotated[bool, typer.Option("--train", help="This machine also trains: a share of every job.")] = False,
    foreground: Annotated[bool, typer.Option(help="Run the coordinator in this process (for systemd).")] = False,
    state_dir: StateOpt = None,
) -> None:
    """Create a network on this machine (the coordinator) and print a join token.

    \b
    Examples:
      meshrun init --endpoint 203.0.113.1
      meshrun init --endpoint vpn.example.com:51820 --cidr 10.77.0.0/16 --uses 4 --name hq
    The token is the last line of output; give it to `meshrun join` on each node.
    Open UDP and TCP 51820 on this machine (UDP 51820 on every node), and UDP 51821-52332 on every member that
    may relay (one port per pair it relays; `meshrun join --no-relay` for a member that must not).
    """
    from meshrun.mesh.coordinator import setup

    app = Application.for_command(state_dir)
    opts = setup.InitOptions(
        endpoint=endpoint,
        cidr=cidr,
        port=port,
        interface=interface,
        mtu=mtu,
        name=network,
        token_ttl=ttl,
        token_uses=uses,
        train=train,
        coordinator_name=name,
    )
    res = setup.init(opts, app.state, start=not foreground)
    net = res.network
    app.echo(f"network {net.name}: {net.cidr}, coordinator {net.coordinator_ip} on {net.interface} ({res.backend})")
    app.echo(f"nodes enrol at {', '.join(net.endpoints)} (TCP) and tunnel to UDP {net.listen_port}")
    # The token on stdin, never on a command line (shell history and /proc/*/cmdline show those).
    app.echo(f"state in {res.state_dir}; put the token (the last line) in a file, then on each node:")
    app.echo("  meshrun join - --name NAME < token.txt")
    if res.warning:
        app.echo(f"meshrun: warning: {res.warning}", err=True)
    app.echo(res.token)
    if foreground:
        app.serve(foreground=True)


@root.command()
@handled
def up(
    foreground: Annotated[bool, typer.Option(help="Run the daemon in this process (for systemd).")] = False,
    state_dir: StateOpt = None,
) -> None:
    """Start this member again from its state (after `leave`/`down`, a crash or a reboot).

    \b
    Example:
      meshrun up
    """
    from meshrun.mesh import member, process

    app = Application.for_command(state_dir)
    rec, network = member.load(app.state)
    if foreground:
        return app.serve(foreground=True)
    waiting: list[tuple[str, str]] = []  # the daemon runs but waits for other machines (process.spawn)
    pid = process.pid(app.state)
    already = pid is not None
    if already:  # it may still be waiting (a second `up` while a majority of the coordinators is away)
        still = process.waiting_for(app.state)
        if still:
            waiting.append(still)
    else:
        pid = process.spawn(app.state, on_wait=lambda *w: waiting.append(w))
    if waiting:
        how = "already running" if already else "started"
        app.echo(f"{rec['role']} {rec['name']} {how} on {network.interface} (daemon pid {pid}), not serving yet")
        app.echo(f"meshrun: warning: {waiting[0][0]}; {waiting[0][1]}", err=True)
        return
    app.echo(f"{rec['role']} {rec['name']} up at {rec['overlay_ip']} on {network.interface} (daemon pid {pid})")


@root.command()
@handled
def down(
    purge: Annotated[bool, typer.Option(help="Also delete the network's state (keys, members, tokens).")] = False,
    state_dir: StateOpt = None,
) -> None:
    """Stop the coordinator and remove its interface (state stays unless --purge).

    \b
    Example:
      meshrun down            # `meshrun up` starts it again with every member kept
    """
    from meshrun.jobs import control
    from meshrun.mesh import member
    from meshrun.mesh.coordinator import ha

    app = Application.for_command(state_dir)
    rec = app.state.read_json("member.json") if app.state.exists else {}
    replicated = ha.replicated(rec)
    # One that the others removed while it was away (ha.refuse_removed) is in no cluster any more.
    if replicated and purge and not rec.get("removed"):
        raise UsageError(
            "this coordinator is one of several: its etcd member would be left in their cluster",
            "first `meshrun coordinator remove NAME` on another coordinator, then `meshrun leave --purge` here",
        )
    # With several coordinators the others carry the jobs on (a standby takes each over); alone, the jobs'
    # overlay goes away with this coordinator.
    for rec in control.list_jobs(app.state) if app.state.exists and not replicated else []:
        if not rec.final and control.cancel(app.state, rec.job_id):
            app.echo(f"cancelled job {rec.job_id} (the overlay it runs on is going away)")
    if replicated:
        ha.stop_member(app.state)
    app.echo(member.take_down(app.state, "coordinator", purge=purge).summary())


@token_app.command("create")
@handled
def token_create(
    ttl: Annotated[str, typer.Option(help="Lifetime, e.g. 30m, 12h, 2d (max 30d).")] = "12h",
    uses: Annotated[Optional[int], typer.Option(help="How many joins it allows [unlimited].")] = None,
    state_dir: StateOpt = None,
) -> None:
    """Print a new join token (and nothing else).

    \b
    Example:
      meshrun token create --ttl 2h --uses 3
    """
    from meshrun.mesh.coordinator import admin

    app = Application.for_command(state_dir)
    app.echo(admin.create_token(app.state, ttl, uses))


@token_app.command("list")
@handled
def token_list(json_out: JsonOpt = False, state_dir: StateOpt = None) -> None:
    """List tokens: id, uses, expiry, status (never the secret).

    \b
    Example:
      meshrun token list --json
    """
    from meshrun.mesh.coordinator import admin

    app = Application.for_command(state_dir)
    tokens = admin.list_tokens(app.state)
    if json_out:
        app.echo(json.dumps(tokens, indent=2))
        return
    app.echo(f"{'ID':<12} {'STATUS':<8} {'USES':<6} {'LEFT':<9} EXPIRES (UTC)")
    for t in tokens:
        left = "unlimited" if t["uses_left"] is None else str(t["uses_left"])
        exp = time.strftime("%Y-%m-%d %H:%M", time.gmtime(t["expires_at"]))
        app.echo(f"{t['id']:<12} {t['status']:<8} {t['uses']:<6} {left:<9} {exp}")


@token_app.command("revoke")
@handled
def token_revoke(
    token_or_id: Annotated[str, typer.Argument(metavar="TOKEN_OR_ID")], state_dir: StateOpt = None
) -> None:
    """Revoke a token so no further node can join with it.

    \b
    Example:
      meshrun token revoke k3j9x2abcd
    """
    from meshrun.mesh.coordinator import admin

    app = Application.for_command(state_dir)
    app.echo(f"revoked {admin.revoke_token(app.state, token_or_id)}")


@root.command()
@handled
def remove(name: str, state_dir: StateOpt = None) -> None:
    """Remove a node from the network (on the coordinator): its key never joins again; its address is free in an hour.

    \b
    Example:
      meshrun remove gpu-b
    """
    from meshrun.mesh.coordinator import admin

    app = Application.for_command(state_dir)
    m = admin.remove_member(app.state, name)
    app.echo(f"removed {m.name} ({m.overlay_ip}); every peer drops it on its next sync")


site_app = typer.Typer(
    no_args_is_help=True, help="Sites and their networks: list them, trust one (on the coordinator)."
)
root.add_typer(site_app, name="site")


@site_app.command("list")
@handled
def site_list(json_out: JsonOpt = False, state_dir: StateOpt = None) -> None:
    """List the sites nodes joined with (`meshrun join --site`), their nodes, and whether each network is trusted.

    \b
    Example:
      meshrun site list
    """
    from meshrun.mesh.coordinator import admin

    app = Application.for_command(state_dir)
    rows = admin.site_table(app.state)
    if json_out:
        app.echo(json.dumps(rows, indent=2))
        return
    app.echo(f"{'SITE':<20} {'NETWORK':<34} NODES")
    for r in rows:
        trust = f"trusted (site LAN path, {r['encapsulation']})" if r["trusted"] else "encrypted (WireGuard)"
        app.echo(f"{r['site']:<20} {trust:<34} {', '.join(r['nodes']) or '-'}")


@site_app.command("trust")
@handled
def site_trust(
    name: Annotated[str, typer.Argument(metavar="SITE")],
    encapsulation: Annotated[
        str,
        typer.Option(
            "--encapsulation",
            metavar="vxlan|none",
            help="vxlan: inside UDP 51819 between the nodes' LAN addresses (passes a cloud VPC's checks). "
            "none: routed as they are, with no encapsulation to pay for; needs one layer-2 LAN that passes "
            "packets with the overlay's addresses (bare metal, on-premises), not a cloud VPC.",
        ),
    ] = "vxlan",
    state_dir: StateOpt = None,
) -> None:
    """Carry the overlay between this site's nodes on the site network, unencrypted.

    Only do this for a network whose every host you trust: a host on it can read, and forge, the overlay
    traffic between the site's nodes (SECURITY.md). Pairs across sites, and nodes of other sites, stay on
    WireGuard; a pair whose LAN path stops answering (or that the network does not carry) goes back to
    WireGuard within seconds. Run it again with another --encapsulation to change a trusted site's.

    \b
    Examples:
      meshrun site trust dc1
      meshrun site trust rack7 --encapsulation none
    """
    from meshrun.mesh.coordinator import admin

    app = Application.for_command(state_dir)
    out = admin.trust_site(app.state, name, True, encapsulation)
    nodes, was = out["nodes"], out["was"]
    if was is None:
        app.echo(
            f"site {name} trusted ({encapsulation}): its nodes' pairs move to the site LAN path (unencrypted) "
            "once it answers"
        )
    elif was != encapsulation:
        app.echo(f"site {name}: encapsulation {was} -> {encapsulation}; its pairs prove the LAN path again")
    else:
        app.echo(f"site {name} was already trusted ({encapsulation}); nothing changed")
    if not nodes:
        app.echo(f"meshrun: note: no node has joined with --site {name} yet", err=True)


@site_app.command("untrust")
@handled
def site_untrust(name: Annotated[str, typer.Argument(metavar="SITE")], state_dir: StateOpt = None) -> None:
    """Put this site's pairs back on WireGuard (encrypted), the default.

    \b
    Example:
      meshrun site untrust dc1
    """
    from meshrun.mesh.coordinator import admin

    app = Application.for_command(state_dir)
    admin.trust_site(app.state, name, False)
    app.echo(f"site {name} untrusted: its pairs are back on WireGuard after the members' next sync")
