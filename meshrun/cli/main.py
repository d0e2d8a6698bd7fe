"""The `meshrun` command line: parse, call one library function, render. Nothing else.

Every error surfaces as one line `meshrun: error: MESSAGE; FIX` on stderr and a non-zero
exit code (hatch's single abort path).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from meshrun import __version__
from meshrun.errors import MeshrunError
from meshrun.system.store import StateDir, default_state_dir

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="Train one PyTorch model across NAT'd datacenters over a WireGuard overlay.")
token_app = typer.Typer(no_args_is_help=True, help="Create, list and revoke join tokens (on the coordinator).")
app.add_typer(token_app, name="token")

StateOpt = Annotated[Optional[Path], typer.Option(
    "--state-dir", envvar="MESHRUN_STATE_DIR", show_default=False,
    help="State directory [default: /var/lib/meshrun as root, else ~/.local/state/meshrun].")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _state(path: Optional[Path]) -> StateDir:
    return StateDir(path or default_state_dir())


def abort(err: MeshrunError) -> None:
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
        typer.echo(f"meshrun {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                 help="Print the version and exit.")] = False,
          verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log what meshrun runs.")] = False) -> None:
    level = logging.DEBUG if verbose or os.environ.get("MESHRUN_DEBUG") else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


# --------------------------------------------------------------------------- coordinator

@app.command()
@handled
def init(
    endpoint: Annotated[Optional[str], typer.Option(help="Public HOST[:PORT] nodes reach this machine at.")] = None,
    cidr: Annotated[str, typer.Option(help="Overlay address range.")] = "10.213.0.0/16",
    port: Annotated[int, typer.Option(help="UDP port for WireGuard and TCP port for enrolment.")] = 51820,
    interface: Annotated[str, typer.Option(help="WireGuard interface name.")] = "meshrun0",
    mtu: Annotated[int, typer.Option(help="Overlay MTU (1420 fits a 1500-byte underlay).")] = 1420,
    network: Annotated[str, typer.Option(help="Network name.")] = "meshrun",
    ttl: Annotated[str, typer.Option(help="Lifetime of the first join token.")] = "12h",
    uses: Annotated[Optional[int], typer.Option(help="How many joins the first token allows [unlimited].")] = None,
    foreground: Annotated[bool, typer.Option(help="Run the coordinator in this process (for systemd).")] = False,
    state_dir: StateOpt = None,
) -> None:
    """Create a network on this machine (the coordinator) and print a join token.

    \b
    Examples:
      meshrun init --endpoint 203.0.113.1
      meshrun init --endpoint vpn.example.com:51820 --cidr 10.77.0.0/16 --uses 4
    The token is the last line of output; give it to `meshrun join` on each node.
    Open UDP and TCP 51820 on this machine (UDP 51820 on every node).
    """
    from meshrun.mesh import coordinator
    opts = coordinator.InitOptions(endpoint=endpoint, cidr=cidr, port=port, interface=interface, mtu=mtu,
                                   name=network, token_ttl=ttl, token_uses=uses)
    state = _state(state_dir)
    res = coordinator.init(opts, state, start=not foreground)
    net = res.network
    typer.echo(f"network {net.name}: {net.cidr}, coordinator {net.coordinator_ip} on {net.interface} ({res.backend})")
    typer.echo(f"nodes enrol at {', '.join(net.endpoints)} (TCP) and tunnel to UDP {net.listen_port}")
    typer.echo(f"state in {res.state_dir}; join each node with:  meshrun join <token> --name NAME")
    typer.echo(res.token)
    if foreground:
        coordinator.CoordinatorService(state).run()


@app.command()
@handled
def up(foreground: Annotated[bool, typer.Option(help="Run the daemon in this process (for systemd).")] = False,
       state_dir: StateOpt = None) -> None:
    """Start this member again from its state (after `leave`/`down`, a crash or a reboot).

    \b
    Example:
      meshrun up
    """
    from meshrun.mesh import agent
    from meshrun.mesh import coordinator
    from meshrun.mesh import daemon
    state = _state(state_dir)
    rec, network = agent.load_node(state)
    if foreground:
        svc = coordinator.CoordinatorService(state) if rec["role"] == "coordinator" else agent.AgentService(state)
        daemon.setup_logging()
        return svc.run()
    pid = state.read_pid() or daemon.spawn(state)
    typer.echo(f"{rec['role']} {rec['name']} up at {rec['overlay_ip']} on {network.interface} (daemon pid {pid})")


@app.command()
@handled
def down(purge: Annotated[bool, typer.Option(help="Also delete the network's state (keys, members, tokens).")] = False,
         state_dir: StateOpt = None) -> None:
    """Stop the coordinator and remove its interface (state stays unless --purge).

    \b
    Example:
      meshrun down            # `meshrun up` starts it again with every member kept
    """
    from meshrun.mesh import agent
    iface = agent.leave(_state(state_dir), purge=purge)
    typer.echo(f"stopped; removed {iface}" + ("; state deleted" if purge else ""))


@app.command()
@handled
def leave(purge: Annotated[bool, typer.Option(help="Also delete this node's key and state.")] = False,
          state_dir: StateOpt = None) -> None:
    """Stop this node's agent and remove its interface (state stays unless --purge).

    \b
    Example:
      meshrun leave --purge
    """
    from meshrun.mesh import agent
    iface = agent.leave(_state(state_dir), purge=purge)
    typer.echo(f"stopped; removed {iface}" + ("; state deleted" if purge else ""))


@token_app.command("create")
@handled
def token_create(ttl: Annotated[str, typer.Option(help="Lifetime, e.g. 30m, 12h, 2d (max 30d).")] = "12h",
                 uses: Annotated[Optional[int], typer.Option(help="How many joins it allows [unlimited].")] = None,
                 state_dir: StateOpt = None) -> None:
    """Print a new join token (and nothing else).

    \b
    Example:
      meshrun token create --ttl 2h --uses 3
    """
    from meshrun.mesh import coordinator
    typer.echo(coordinator.create_token(_state(state_dir), ttl, uses))


@token_app.command("list")
@handled
def token_list(json_out: JsonOpt = False, state_dir: StateOpt = None) -> None:
    """List tokens: id, uses, expiry, status (never the secret).

    \b
    Example:
      meshrun token list --json
    """
    from meshrun.mesh import coordinator
    tokens = coordinator.list_tokens(_state(state_dir))
    if json_out:
        typer.echo(json.dumps(tokens, indent=2))
        return
    typer.echo(f"{'ID':<12} {'STATUS':<8} {'USES':<6} {'LEFT':<9} EXPIRES (UTC)")
    for t in tokens:
        left = "unlimited" if t["uses_left"] is None else str(t["uses_left"])
        exp = time.strftime("%Y-%m-%d %H:%M", time.gmtime(t["expires_at"]))
        typer.echo(f"{t['id']:<12} {t['status']:<8} {t['uses']:<6} {left:<9} {exp}")


@token_app.command("revoke")
@handled
def token_revoke(token_or_id: Annotated[str, typer.Argument(metavar="TOKEN_OR_ID")],
                 state_dir: StateOpt = None) -> None:
    """Revoke a token so no further node can join with it.

    \b
    Example:
      meshrun token revoke k3j9x2abcd
    """
    from meshrun.mesh import coordinator
    typer.echo(f"revoked {coordinator.revoke_token(_state(state_dir), token_or_id)}")


@app.command()
@handled
def remove(name: str, state_dir: StateOpt = None) -> None:
    """Remove a node from the network (on the coordinator); its address is never reused.

    \b
    Example:
      meshrun remove gpu-b
    """
    from meshrun.mesh import coordinator
    m = coordinator.remove_member(_state(state_dir), name)
    typer.echo(f"removed {m.name} ({m.overlay_ip}); every peer drops it on its next sync")


# --------------------------------------------------------------------------- node

@app.command()
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
    from meshrun.mesh import agent
    from meshrun.mesh import daemon
    state = _state(state_dir)
    res = agent.join(token, state, name=name, endpoint=endpoint, start=not foreground, mtu=mtu)
    verb = "resumed" if res.resumed else "joined"
    typer.echo(f"{verb} {res.network.name} as {res.name} at {res.overlay_ip} on {res.network.interface} "
               f"({res.backend}, mtu {res.mtu})")
    if foreground:
        daemon.setup_logging()
        agent.AgentService(state).run()


@app.command()
@handled
def status(json_out: JsonOpt = False, state_dir: StateOpt = None) -> None:
    """Show this member's peers: name, overlay IP, endpoint, last handshake, rx/tx.

    \b
    Examples:
      meshrun status
      meshrun status --json | jq '.peers[].name'
    """
    from meshrun.mesh import status as st
    data = st.gather(_state(state_dir))
    typer.echo(json.dumps(data, indent=2) if json_out else st.render(data))


@app.command()
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
    r = st.ping(_state(state_dir), peer, count)
    typer.echo(json.dumps(r, indent=2) if json_out else st.render_ping(r))
    if not r["received"]:
        raise typer.Exit(1)


@app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True,
                               "allow_extra_args": True})
@handled
def train(
    ctx: typer.Context,
    script: Annotated[Optional[str], typer.Argument(
        help="Training script (a module name with --module); its args follow it. [the job file's]")] = None,
    config: Annotated[Optional[Path], typer.Option(
        "--config", help="TOML job file with these options (configs/job.example.toml); the command line wins.")] = None,
    nnodes: Annotated[Optional[str], typer.Option(help="Nodes to train on: N or MIN:MAX (elastic) [all joined].")] = None,
    nproc_per_node: Annotated[Optional[int], typer.Option(help="Workers per node [GPUs on the node, else 1].")] = None,
    max_restarts: Annotated[Optional[int], typer.Option(help="torchrun --max-restarts: restarts after a failure. [0]")] = None,
    nodes: Annotated[Optional[str], typer.Option(help="Comma-separated node names to use [all].")] = None,
    env: Annotated[Optional[list[str]], typer.Option("--env", help="KEY=VALUE for every worker (repeatable).")] = None,
    timeout: Annotated[Optional[float], typer.Option(help="Seconds to wait for the nodes to be ready. [120]")] = None,
    rdzv_timeout: Annotated[Optional[int], typer.Option(help="Seconds the rendezvous waits for every node. [900]")] = None,
    module: Annotated[bool, typer.Option("--module", help="SCRIPT is a module name, run as python -m SCRIPT.")] = False,
    no_sync: Annotated[bool, typer.Option("--no-sync", help="Do not ship code: it already is at this path on every node.")] = False,
    sync_limit: Annotated[Optional[int], typer.Option(help="Most MiB of code to ship. [50]")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print each node's command and environment, run nothing.")] = False,
    local: Annotated[bool, typer.Option("--local", help="Run only this node's share (you start every node yourself).")] = False,
    job_id: Annotated[Optional[str], typer.Option(help="Rendezvous id (needed with --local; same on every node).")] = None,
    python: Annotated[Optional[str], typer.Option(help="Python interpreter on the nodes [the agent's].")] = None,
    state_dir: StateOpt = None,
) -> None:
    """Train across every node: torchrun on each, rendezvous at the coordinator, NCCL/Gloo pinned to the overlay.

    \b
    Meshrun's options come before the script; everything after it goes to the script.
    Examples:
      meshrun train train.py --epochs 3
      meshrun train --nnodes 2 --nproc-per-node 4 train.py --epochs 3
      meshrun train --config job.toml                 # options from a job file
      meshrun train --dry-run train.py
      meshrun train --local --nnodes 2 --job-id exp7 train.py     # on each node, e.g. from a batch job
    Exits with the first failing rank's exit code; Ctrl-C stops the job on every node.
    """
    from meshrun.core import jobfile
    from meshrun.jobs import runner
    cli = {"script": script, "script_args": list(ctx.args) if script is not None else None, "nnodes": nnodes,
           "nproc_per_node": nproc_per_node, "max_restarts": max_restarts,
           "nodes": [n.strip() for n in nodes.split(",") if n.strip()] if nodes else None,
           "wait_timeout": timeout, "rdzv_timeout": rdzv_timeout, "module": module, "no_sync": no_sync,
           "sync_limit_mb": sync_limit, "dry_run": dry_run, "env": runner.parse_env_pairs(env or []),
           "job_id": job_id, "python": python}
    req = runner.TrainRequest(**jobfile.merge(jobfile.load(config) if config else {}, cli))
    state = _state(state_dir)
    code = runner.train_local(state, req) if local else runner.train(state, req)
    raise typer.Exit(code)


@app.command()
@handled
def bench(
    sizes: Annotated[str, typer.Option(help="All-reduce sizes, comma-separated (K/M/G binary).")] = "1M,4M,16M,64M",
    duration: Annotated[Optional[float], typer.Option(help="Seconds of TCP traffic per ordered pair [about 20 s over all pairs, 0.5-2 s each].")] = None,
    streams: Annotated[int, typer.Option(help="Parallel TCP connections per bandwidth test.")] = 4,
    iters: Annotated[int, typer.Option(help="Most timed all-reduces per size (each size is time-bounded).")] = 10,
    nodes: Annotated[Optional[str], typer.Option(help="Comma-separated node names to test [all].")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the nodes to be ready.")] = 60,
    json_out: JsonOpt = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG heat-map here (needs matplotlib).")] = None,
    state_dir: StateOpt = None,
) -> None:
    """Measure the mesh (on the coordinator): per node pair RTT, TCP bandwidth, path; then all-reduce busbw.

    \b
    Runs through the same machinery as `meshrun train` (gloo on CPU, NCCL on GPU).
    Examples:
      meshrun bench
      meshrun bench --sizes 1M,16M --duration 1 --json > bench.json
      meshrun bench --plot mesh.png            # pip install meshrun[plot]
    Pairs below half the median bandwidth are flagged SLOW.
    """
    from meshrun.bench import report as b
    if plot is not None:
        b.require_matplotlib()          # fail before the minute of measuring, not after
    res = b.run(_state(state_dir), sizes=sizes, duration=duration, streams=streams, iters=iters,
                nodes=[n.strip() for n in nodes.split(",") if n.strip()] if nodes else None, wait_timeout=timeout,
                echo=None if json_out else (lambda line: typer.echo(line, err=True)))
    if plot is not None:
        b.plot(res, plot)
    typer.echo(json.dumps(res, indent=2) if json_out else b.render(res))
    if plot is not None and not json_out:
        typer.echo(f"heat-map written to {plot}")


@app.command()
@handled
def demo(nodes: Annotated[int, typer.Option(help="Training datacenters to simulate (plus one for the coordinator).")] = 3
         ) -> None:
    """Show the whole product on this machine: NAT'd datacenters in namespaces, init, join, train.

    \b
    Needs root (it builds network namespaces) and a meshrun checkout. Example:
      sudo meshrun demo --nodes 3
    """
    from meshrun.lab import demo as d
    raise typer.Exit(d.run(nodes, out=typer.echo))


@app.command(hidden=True)
@handled
def daemon(state_dir: StateOpt = None) -> None:
    """Run the coordinator or agent daemon for a state directory (started by init/join/up)."""
    from meshrun.mesh import agent
    from meshrun.mesh import coordinator
    from meshrun.mesh import daemon as d
    d.setup_logging()
    state = _state(state_dir)
    try:
        rec, _ = agent.load_node(state)
        svc = coordinator.CoordinatorService(state) if rec["role"] == "coordinator" else agent.AgentService(state)
    except MeshrunError as err:
        d.record_fatal(state, err)  # so `up`/`join` can show the real reason, naming the file
        raise
    svc.run()


# --------------------------------------------------------------------------- service

service_app = typer.Typer(no_args_is_help=True, help="Run this member under systemd.")
app.add_typer(service_app, name="service")


@service_app.command("install")
@handled
def service_install(
    role: Annotated[Optional[str], typer.Option(help="coordinator or agent [from the state directory].")] = None,
    unit_dir: Annotated[Optional[Path], typer.Option(help="Where to write the unit [/etc/systemd/system].")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the unit and the commands, change nothing.")] = False,
    state_dir: StateOpt = None,
) -> None:
    """Write a systemd unit running `meshrun up --foreground` and enable it (restarts on failure and at boot).

    \b
    Examples:
      meshrun service install --dry-run
      meshrun service install --role agent --state-dir /srv/meshrun
    Without a running systemd (containers) it writes the unit and prints the commands to run.
    """
    from meshrun.mesh import service
    state = _state(state_dir)
    plan = service.plan_install(state, role=role, unit_dir=unit_dir)
    service.install(plan, state, typer.echo, dry_run=dry_run)


def main() -> None:
    app(prog_name="meshrun")


if __name__ == "__main__":
    main()
