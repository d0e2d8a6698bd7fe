"""Pure training-launch planning: nodes + options -> per-node torchrun argv and environment.

Nothing here starts a process or opens a socket (each node's share, meshrun.jobs.share, does
that). Every node runs torch's own elastic launcher (torchrun) through ``python -m meshrun.jobs.agent``,
which forks the workers from a process that imported torch once (a restart does not import it again),
with the c10d rendezvous pointed at the store the coordinator hosts on its overlay IP, so
every node passes ``is_host=0``, and announces its own overlay IP with ``--local-addr``
(without it a node announces its hostname, which other datacenters cannot resolve or reach).
Each worker runs under ``meshrun.jobs.worker``'s wrapper, which prefixes its output with node and rank and
records its exit code.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from meshrun.core.topology import Placement
from meshrun.errors import UsageError

JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# meshrun.jobs.rdzv_backend: torch's c10d rendezvous, with the agent's store bound to the overlay.
RDZV_BACKEND = "meshrun"
# The agent that runs torchrun's elastic launch with warm or cold workers (see the module's docstring).
AGENT_MODULE = "meshrun.jobs.agent"
# How each worker starts (`meshrun train --workers`; meshrun.jobs.agent): warm, forked from a forkserver that
# imported torch once per node (no import at a start or a restart); cold, a new interpreter that imports torch
# itself (3 s more per start on a 2-core node). Both run the script and end it the same way (meshrun.jobs.worker).
WORKER_KINDS = ("warm", "cold")
DEFAULT_WORKERS = "warm"
# torchrun polls its workers this often (seconds; torch's default): a regroup's restart starts within it.
MONITOR_INTERVAL = "0.1"
# An elastic rendezvous's wait for more nodes once MIN joined (torch's default: 30). Every round of a meshrun
# job has its nodes started or restarted at once by the supervisor, so they join within a second or two of
# each other. A node later than this joins by the next round (its waiting restarts the group), which costs a
# restart, not the job. After a lost node the round does not wait at all: the supervisor tells the survivors
# who the new group is, and it completes once they all joined (meshrun.jobs.rdzv_backend.follow_regroups).
ELASTIC_LAST_CALL_S = 3
# NCCL's socket count (NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD) is left to NCCL: measured on an H200
# through meshrun0, its own choice moved 256 MiB all-reduces at 0.48 GB/s same-site and across sites, against
# 0.31 for the 4 x 4 meshrun used to set and 0.34 for 1 x 1 (benchmarks/results/gpu_datapath.json, 2026-11-27;
# the day before 0.62 against 0.32, and 0.27-0.43 for 1x1, 2x8 and 8x2: results/archive/). On a trusted site's
# LAN path NCCL's choice ran at the raw LAN's speed. A user's own values (--env, the job file) still pass through.
# NCCL's staging buffer per channel and peer for a job whose nodes span sites (a WAN between some of them). NCCL
# keeps one buffer of data in flight per channel, so over a WAN it moves at most about NCCL_BUFFSIZE per round
# trip: on an H100 through meshrun0 across a 60 ms RTT, 0.1 % loss WAN, 16 MiB all-reduces ran at 0.053 GB/s
# (0.051-0.054) with 16 MiB against 0.032 (0.028-0.036) at NCCL's 4 MiB default, where no socket setting helped
# (benchmarks/results/gpu_wan.json). It costs GPU memory (16 MiB per buffer instead of 4), so it is set only
# where a WAN is: a job within one site keeps NCCL's default. A user's own value (--env, the job file) wins.
WAN_NCCL_BUFFSIZE = str(16 << 20)
# Set to "1" for `meshrun train --site-fabric`: meshrun.train.sites then asks NCCL for the fabric in site groups.
ENV_SITE_FABRIC = "MESHRUN_SITE_FABRIC"
# Set to "1" for `meshrun train --mixed-accelerators` (meshrun.core.presets.ENV_MIXED): scripts use gloo.
ENV_MIXED = "MESHRUN_MIXED_ACCELERATORS"
# The caller's variables `meshrun train` forwards to every worker (over meshrun's own values).
FORWARD_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_")
# What meshrun sets to keep a job's collectives on the overlay: a shell's own value overrides it.
MESHRUN_SETS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_NET", "NCCL_IB_DISABLE", "NCCL_BUFFSIZE")
# Of those, the ones that pin the interface: from a shell (a profile left from single-VPC work) they bring back the
# cross-datacenter hang, so they are refused unless given on purpose (--env, a job file, --use-shell-ifname).
SHELL_PINS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
# Variables a job may not set, and why: they would take a store off the overlay.
PROTECTED_ENV = {
    # torchrun then has rank 0's worker host a second TCPStore, bound to the wildcard (every interface).
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "it makes rank 0 host a store on every interface, not the overlay only",
}


@dataclass(frozen=True)
class NodeInfo:
    """A node that can take a share of the job."""

    name: str
    overlay_ip: str
    gpus: int = 0  # visible CUDA devices on that node
    site: Placement | None = None  # its site within the job (meshrun.core.topology.placement)


@dataclass(frozen=True)
class TrainOptions:
    """What to run and how to rendezvous (validated by `plan`)."""

    script: str  # path as the node sees it (relative to the job workdir)
    script_args: tuple[str, ...] = ()
    nnodes: str | None = None  # "N" or "MIN:MAX"; None -> number of nodes given
    nproc_per_node: int | None = None  # None -> per node: its gpus, else 1
    max_restarts: int = 0
    job_id: str = ""  # rendezvous id, required
    rdzv_host: str = ""  # coordinator overlay IP
    rdzv_port: int = 29400
    interface: str = "meshrun0"
    python: str = "python3"  # interpreter on the node
    rdzv_timeout: int = 900  # seconds -> --rdzv-conf join_timeout
    module: bool = False  # script is a module name (python -m)
    site_fabric: bool = False  # NCCL may load InfiniBand/RoCE for site groups (see worker_env)
    job_env: tuple[tuple[str, str], ...] = ()  # meshrun's variables for this job (a DiLoCo preset); the user's win
    mixed_accelerators: bool = False  # MESHRUN_MIXED_ACCELERATORS=1: every worker runs its collectives on gloo
    # With several coordinators: every coordinator's overlay "IP:API port"; the rendezvous is kept at them, in
    # etcd (meshrun.jobs.rdzv_backend), not in a store on one machine. Empty: the store at rdzv_host:rdzv_port.
    rdzv_coordinators: tuple[str, ...] = ()
    # The run this job belongs to (MESHRUN_RUN_ID): its own id when it starts fresh, the first job's when it
    # continues one (`meshrun train --resume`), so checkpoints kept under it are found by resumes only.
    run_id: str = ""
    workers: str = DEFAULT_WORKERS  # WORKER_KINDS


@dataclass(frozen=True)
class NodeLaunch:
    """One node's share: the command to run and the variables meshrun sets for it."""

    node: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # merged over the agent's environment

    def shell(self) -> str:
        """A copy-pasteable line: ``VAR=... python3 -m meshrun.jobs.agent ...`` (torchrun's options)."""
        parts = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        parts += [shlex.quote(a) for a in self.argv]
        return " ".join(parts)


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"3"`` -> (3, 3), ``"2:3"`` -> (2, 3); UsageError for anything else or MIN > MAX."""
    text = str(value).strip()
    m = re.fullmatch(r"(\d+)(?::(\d+))?", text)
    if not m:
        raise UsageError(f"--nnodes {value!r} is not N or MIN:MAX", "e.g. --nnodes 2 or --nnodes 2:4")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if lo < 1:
        raise UsageError(f"--nnodes {value!r} asks for fewer than 1 node", "use at least 1")
    if lo > hi:
        raise UsageError(f"--nnodes {value!r} has MIN {lo} larger than MAX {hi}", f"e.g. --nnodes {hi}:{lo}")
    return lo, hi


@dataclass(frozen=True)
class ShellEnv:
    """What the submitting shell passes to a job: `forwarded` (its NCCL_/GLOO_/TORCH_ variables not given on
    purpose), of those the names that `override` what meshrun sets, and the interface pins `refused`."""

    forwarded: dict[str, str]
    override: tuple[str, ...]
    refused: tuple[str, ...]

    def notice(self) -> str:
        """One line for the terminal before the job starts ("" when the shell passes nothing)."""
        if not self.forwarded:
            return ""
        line = "meshrun: from this shell, every worker gets " + ", ".join(
            f"{k}={v}" for k, v in sorted(self.forwarded.items())
        )
        if self.override:
            line += f" (overriding meshrun's {', '.join(self.override)})"
        return line


def shell_env(shell: Mapping[str, str], explicit: Mapping[str, str], allow_pins: bool = False) -> ShellEnv:
    """Sort the caller's environment `shell` for a job whose own variables are `explicit` (--env, the job file):
    those given explicitly are not the shell's doing; interface pins are refused unless `allow_pins`. Pure."""
    forwarded = {k: v for k, v in shell.items() if k.startswith(FORWARD_ENV_PREFIXES) and k not in explicit}
    override = tuple(k for k in MESHRUN_SETS if k in forwarded)
    refused = () if allow_pins else tuple(k for k in SHELL_PINS if k in forwarded)
    return ShellEnv(forwarded, override, refused)


def worker_env(
    interface: str,
    node_name: str,
    user_env: Mapping[str, str],
    overlay_ip: str = "",
    site: Placement | None = None,
    site_fabric: bool = False,
    job_env: Mapping[str, str] | None = None,
    mixed_accelerators: bool = False,
    job: tuple[str, str] = ("", ""),
) -> dict[str, str]:
    """The variables meshrun sets for one node's torchrun and workers.

    Pins Gloo and NCCL to the overlay interface, makes NCCL's socket transport the process-wide
    default (``NCCL_NET=Socket``: an overlay carries sockets only) and disables InfiniBand; how many TCP
    streams per peer is NCCL's choice. With `site_fabric` (``meshrun train --site-fabric``) InfiniBand is not disabled
    and ``MESHRUN_SITE_FABRIC=1`` tells meshrun.train.sites to ask for it in the site group only;
    ``NCCL_NET=Socket`` stays the default, so every other communicator still never tries it. When `site` says the
    job spans several sites, ``NCCL_BUFFSIZE`` is WAN_NCCL_BUFFSIZE (16 MiB: NCCL's data in flight per round trip).
    Every variable in `user_env` is included and wins over meshrun's defaults, except
    ``MESHRUN_NODE_NAME``, ``MESHRUN_OVERLAY_IP`` and ``MESHRUN_INTERFACE``, which are always the node's
    name, address and overlay interface, ``MESHRUN_SITE_FABRIC`` (set by `site_fabric` only), and, with
    `site`, ``MESHRUN_SITE``, ``MESHRUN_SITE_RANK``, ``MESHRUN_NUM_SITES`` and ``MESHRUN_SITE_ADDR`` (the
    node's address on the site network, when the job has another node in its site): what
    meshrun.train.sites groups ranks by. `job_env` (a DiLoCo preset's ``MESHRUN_DILOCO_*``) comes before
    `user_env`, so the user's own values win; ``MESHRUN_MIXED_ACCELERATORS`` is ``1`` exactly when
    `mixed_accelerators` (the pre-flight let the job's torch builds differ on that condition).
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is not set: torchrun's agent already defaults it to 1
    for its workers in torch 2.13, so a hung collective on a dead peer tears the worker down.
    """
    for k in PROTECTED_ENV:
        if k in user_env:
            raise UsageError(
                f"{k} cannot be set for a meshrun job: {PROTECTED_ENV[k]}",
                f"drop it from --env, the job file's [env] and this shell (unset {k})",
            )
    env: dict[str, str] = {
        "GLOO_SOCKET_IFNAME": interface,
        "PYTHONUNBUFFERED": "1",
        # Leading "=" means exact match; a bare name is a prefix ("meshrun0" also matches "meshrun01").
        # Set on CPU nodes too: a GPU the agent could not count must still not pick the wrong interface.
        "NCCL_SOCKET_IFNAME": "=" + interface,
        # The overlay carries TCP/UDP only; don't let NCCL try IB/RoCE (or a vendor net plugin
        # such as EFA) between datacenters, where those fabrics do not reach. NCCL reads NCCL_NET at
        # every communicator's creation and it wins over the communicator's own config.netName.
        "NCCL_NET": "Socket",
    }
    if not site_fabric:
        # NCCL reads it once per process: with it no communicator, the site group's included, can use IB.
        env["NCCL_IB_DISABLE"] = "1"
    if site is not None and site.count > 1:
        env["NCCL_BUFFSIZE"] = WAN_NCCL_BUFFSIZE  # see WAN_NCCL_BUFFSIZE
    env.update(job_env or {})
    env.update(user_env)
    env.pop(ENV_SITE_FABRIC, None)  # meshrun's to set: it must agree with NCCL_IB_DISABLE above
    if site_fabric:
        env[ENV_SITE_FABRIC] = "1"
    env.pop(ENV_MIXED, None)  # meshrun's to set: it must agree with what the pre-flight allowed
    if mixed_accelerators:
        env[ENV_MIXED] = "1"
    job_id, run_id = job
    for key, value in (("MESHRUN_JOB_ID", job_id), ("MESHRUN_RUN_ID", run_id or job_id)):
        if value:  # meshrun's to set: a job's checkpoints are found by it (see TrainOptions.run_id)
            env[key] = value
        else:
            env.pop(key, None)
    env["MESHRUN_NODE_NAME"] = node_name
    env["MESHRUN_OVERLAY_IP"] = overlay_ip
    env["MESHRUN_INTERFACE"] = interface
    if site is not None:
        env["MESHRUN_SITE"] = site.site
        env["MESHRUN_SITE_RANK"] = str(site.rank)
        env["MESHRUN_NUM_SITES"] = str(site.count)
        if site.addr:
            env["MESHRUN_SITE_ADDR"] = site.addr
    return env


def _rdzv_endpoint(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def _validate(nodes: Sequence[NodeInfo], opts: TrainOptions, local: bool) -> tuple[str, int, int]:
    if not nodes:
        raise UsageError("no nodes to train on", "join a node with `meshrun join TOKEN`, or check --nodes")
    seen: set[str] = set()
    for n in nodes:
        if not n.name:
            raise UsageError(f"a node with overlay IP {n.overlay_ip!r} has no name", "give every node a name")
        if n.name in seen:
            raise UsageError(f"node {n.name!r} is listed twice", "list every node once")
        seen.add(n.name)
        try:
            ipaddress.ip_address(n.overlay_ip)
        except ValueError:
            raise UsageError(
                f"node {n.name!r} has overlay IP {n.overlay_ip!r}, not an IP address",
                "check the node's enrolment (`meshrun status`)",
            ) from None
    if not opts.script:
        raise UsageError("no training script given", "e.g. meshrun train train.py")
    if not JOB_ID_RE.match(opts.job_id or ""):
        raise UsageError(f"job id {opts.job_id!r} is not 1-64 characters of A-Z a-z 0-9 _ . -", "e.g. --job-id exp7")
    if not opts.rdzv_host:
        raise UsageError("rendezvous host '' is empty", "pass the coordinator's overlay IP")
    if isinstance(opts.rdzv_port, bool) or not isinstance(opts.rdzv_port, int) or not 1 <= opts.rdzv_port <= 65535:
        raise UsageError(f"rendezvous port {opts.rdzv_port!r} is not in 1-65535", "use e.g. 29400")
    if opts.max_restarts < 0:
        raise UsageError(f"--max-restarts {opts.max_restarts} is negative", "use 0 or more")
    if opts.rdzv_timeout <= 0:
        raise UsageError(f"rendezvous timeout {opts.rdzv_timeout} is not positive", "use e.g. 900 seconds")
    if opts.nproc_per_node is not None and opts.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node {opts.nproc_per_node} is less than 1", "use 1 or more")
    if opts.nnodes is None:
        lo = hi = len(nodes)
        spec = str(len(nodes))
    else:
        lo, hi = parse_nnodes(opts.nnodes)
        spec = str(lo) if lo == hi else f"{lo}:{hi}"
    if lo > len(nodes) and not local:
        raise UsageError(
            f"--nnodes {opts.nnodes} needs {lo} node(s) but {len(nodes)} are available",
            f"join more nodes or use --nnodes {len(nodes)}",
        )
    return spec, lo, hi


def plan(
    nodes: Sequence[NodeInfo], opts: TrainOptions, user_env: Mapping[str, str] | None = None, local: bool = False
) -> list[NodeLaunch]:
    """One torchrun command + environment per node that takes part.

    With ``nnodes`` N (or MIN:MAX) only the first N (MAX) nodes, in the order given, are
    planned: a node beyond the rendezvous's maximum would wait forever. A node runs
    ``nproc_per_node`` workers, by default as many as it has GPUs, else 1 (nodes may differ).
    `user_env` wins over meshrun's variables (see `worker_env`). UsageError names any bad value.
    With `local`, `nodes` is just this node and the others start their shares themselves
    (`meshrun train --local`), so fewer nodes than ``nnodes`` is expected.
    """
    user_env = dict(user_env or {})
    spec, lo, hi = _validate(nodes, opts, local)
    endpoint = _rdzv_endpoint(opts.rdzv_host, opts.rdzv_port)
    # is_host=0: the coordinator hosts the store; torch's guess (hostname match) is wrong on overlays.
    # join_timeout: the c10d handler's rendezvous deadline (the generic "timeout" key is etcd/static only).
    rdzv_conf = f"is_host=0,join_timeout={opts.rdzv_timeout}"
    if lo < hi:  # see ELASTIC_LAST_CALL_S
        rdzv_conf += f",last_call_timeout={ELASTIC_LAST_CALL_S}"
    if opts.rdzv_coordinators:  # '+' between them: torchrun splits --rdzv-conf at commas
        rdzv_conf += f",coordinators={'+'.join(opts.rdzv_coordinators)}"
    out = []
    for n in list(nodes)[:hi]:
        nproc = opts.nproc_per_node if opts.nproc_per_node is not None else (n.gpus if n.gpus > 0 else 1)
        if nproc < 1:
            raise UsageError(f"node {n.name!r} would run {nproc} workers", "pass --nproc-per-node 1 or more")
        worker = (["-m"] if opts.module else []) + [opts.script]  # torchrun's -m: SCRIPT is a module
        argv = (
            opts.python,
            "-m",
            AGENT_MODULE,
            "--workers",
            opts.workers,
            "--nnodes",
            spec,
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            RDZV_BACKEND,
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            opts.job_id,
            "--rdzv-conf",
            rdzv_conf,
            "--local-addr",
            n.overlay_ip,
            "--max-restarts",
            str(opts.max_restarts),
            "--monitor-interval",
            MONITOR_INTERVAL,
            *worker,
            *opts.script_args,
        )
        env = worker_env(
            opts.interface,
            n.name,
            user_env,
            n.overlay_ip,
            n.site,
            opts.site_fabric,
            job_env=dict(opts.job_env),
            mixed_accelerators=opts.mixed_accelerators,
            job=(opts.job_id, opts.run_id),
        )
        out.append(NodeLaunch(n.name, argv, env))
    return out
