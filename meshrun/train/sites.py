"""Sites inside a job: a process group per site, and an all-reduce across sites that uses every node's uplink.

A site is a set of the job's nodes that reach each other directly on a private network (a datacenter's
LAN or fabric); between sites, traffic crosses the overlay and the WAN. A flat ring all-reduce over the
overlay runs at the speed of one WAN link. The hierarchical all-reduce here does what the links allow:

1. reduce-scatter inside each site (site network): local rank i ends with the site's sum of shard i;
2. all-reduce of shard i across sites, among the ranks with local rank i (one group per i, on the
   overlay): every node sends only its own shard over its own uplink, all at once;
3. all-gather inside each site (site network): every rank has the whole sum.

Each node's WAN traffic is 2(S-1)/S of a shard instead of 2(N-1)/N of the whole tensor (S sites, N
ranks), and the WAN links of all nodes of a site carry it in parallel.

Use it from a script that `meshrun train` runs, after ``torch.distributed.init_process_group``::

    from meshrun.train import sites
    g = sites.groups()                  # collective: every rank calls it, in the same order
    sites.all_reduce(grad_bucket, g)    # in place; equal to dist.all_reduce up to float rounding

``groups()`` reads the worker's site from ``MESHRUN_SITE`` (pass ``site=`` to override; ranks without
one form a site of their own per node, ``MESHRUN_NODE_NAME`` or the host name). With gloo, the site's groups
bind to ``MESHRUN_SITE_IFNAME`` (the node's interface on the site network) when it is set, the
cross-site groups to the overlay (``GLOO_SOCKET_IFNAME``, which `meshrun train` pins to it). gloo reads
the interface when a group is made, so the choice is per group.

NCCL: `meshrun train` makes the overlay's socket transport every communicator's default
(``NCCL_NET=Socket``, ``NCCL_SOCKET_IFNAME==meshrun0``). With ``meshrun train --site-fabric``
(``MESHRUN_SITE_FABRIC=1``, InfiniBand not disabled) the site group of a site that spans two nodes or
more asks for NCCL's InfiniBand/RoCE transport (``config.net_name = "IB"``, `fabric=` to name another)
and the cross-site groups for ``"Socket"``. NCCL lets ``NCCL_NET`` win over a communicator's
``config.netName`` (src/init.cc, envConfigOverride) and reads it when each communicator is created, so
``NCCL_NET`` is lifted from this process's environment while the site group's communicator is created,
and that communicator is created here (one small all-reduce) rather than at its first use. The socket
transport's interface (``NCCL_SOCKET_IFNAME``) and ``NCCL_IB_DISABLE`` are read once per process: the
site group cannot use sockets on the site network, only the fabric. Not run on a GPU yet.

Sites of different sizes have no one-to-one shard owners: ``all_reduce`` then falls back to the
flat all-reduce over the job's group (correct, not faster), and ``SiteGroups.hierarchical`` says so.
"""

from __future__ import annotations

import os
import platform
import warnings
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshrun.errors import UsageError

__all__ = ["NcclNets", "SiteGroups", "SiteLayout", "all_reduce", "groups", "nccl_nets"]

# torch 2.13 renamed the single-tensor collectives and warns on the old names; older torch has only those.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

ENV_SITE = "MESHRUN_SITE"
ENV_SITE_IFNAME = "MESHRUN_SITE_IFNAME"
ENV_NODE = "MESHRUN_NODE_NAME"
ENV_SITE_FABRIC = "MESHRUN_SITE_FABRIC"  # meshrun.core.launch sets it for `meshrun train --site-fabric`
FABRIC_NET = "IB"  # NCCL's InfiniBand/RoCE transport, by the name NCCL_NET takes
SOCKET_NET = "Socket"
_OPS = ("sum", "avg")
_warned: set[str] = set()


@dataclass(frozen=True)
class SiteLayout:
    """Which global ranks are in which site. Pure.

    `sites` are in the order of each site's lowest rank; `ranks[i]` are site i's ranks, ascending.
    """

    sites: tuple[str, ...]
    ranks: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, site_of_rank: Sequence[str]) -> SiteLayout:
        """The layout of a job whose rank r is in site `site_of_rank[r]`. UsageError for an empty name."""
        by_site: dict[str, list[int]] = {}
        for rank, site in enumerate(site_of_rank):
            if not site:
                raise UsageError(f"rank {rank} has an empty site name", "set MESHRUN_SITE or pass site=")
            by_site.setdefault(site, []).append(rank)
        return cls(tuple(by_site), tuple(tuple(r) for r in by_site.values()))

    @property
    def uniform(self) -> bool:
        """Whether every site has as many ranks as every other (needed for one shard owner per site)."""
        return len({len(r) for r in self.ranks}) == 1

    def site_index(self, rank: int) -> int:
        for i, ranks in enumerate(self.ranks):
            if rank in ranks:
                return i
        raise UsageError(f"rank {rank} is in no site of this layout", "build the layout from every rank's site")

    def local_rank(self, rank: int) -> int:
        """The rank's position inside its site."""
        return self.ranks[self.site_index(rank)].index(rank)

    def cross_groups(self) -> list[tuple[int, ...]]:
        """For each local rank i, the ranks with local rank i in every site (empty unless uniform)."""
        if not self.uniform:
            return []
        return [tuple(site[i] for site in self.ranks) for i in range(len(self.ranks[0]))]


@dataclass(frozen=True)
class NcclNets:
    """The NCCL network the site group and the cross-site groups ask for (None: the process-wide ``NCCL_NET``).

    `warning`: why the fabric was asked for and is not used ("" otherwise).
    """

    local: str | None = None
    cross: str | None = None
    warning: str = ""


def nccl_nets(
    backend: str, env: Mapping[str, str], has_net_name: bool, site_nodes: int, fabric: str = FABRIC_NET
) -> NcclNets:
    """Which NCCL network each of ``groups()``' groups names. Pure.

    The fabric only with the nccl backend, ``MESHRUN_SITE_FABRIC=1``, InfiniBand not disabled, a torch
    that exposes ``ProcessGroupNCCL.Options().config.net_name`` (`has_net_name`) and a site of two nodes
    or more (`site_nodes`: a site on one node needs no network, and naming one its node lacks would fail);
    the cross-site groups then name the socket transport. Anything else: the process-wide default.
    """
    if backend != "nccl" or env.get(ENV_SITE_FABRIC) != "1":
        return NcclNets()
    default = f"NCCL_NET={env['NCCL_NET']}" if env.get("NCCL_NET") else "NCCL's default network"
    if env.get("NCCL_IB_DISABLE", "0") not in ("", "0"):
        return NcclNets(
            warning=f"{ENV_SITE_FABRIC}=1 but NCCL_IB_DISABLE={env['NCCL_IB_DISABLE']}: the site group "
            f"stays on {default}; drop NCCL_IB_DISABLE from --env, the job file and the agent's environment"
        )
    if not has_net_name:
        return NcclNets(
            warning=f"{ENV_SITE_FABRIC}=1 but this torch has no ProcessGroupNCCL.Options().config.net_name "
            f"(torch 2.1+ built with NCCL 2.17+ has it): the site group stays on {default}"
        )
    return NcclNets(local=fabric if site_nodes > 1 else None, cross=SOCKET_NET)


@dataclass(frozen=True)
class SiteGroups:
    """This rank's site and the groups ``all_reduce`` uses (from ``groups()``).

    `local` holds the ranks of this rank's site; `cross` the ranks with this rank's local rank in every
    site (None when sites differ in size or there is one site); `world` the group they were made from
    (None: the default group).
    """

    layout: SiteLayout
    rank: int
    site: str
    site_rank: int
    num_sites: int
    local_rank: int
    local_size: int
    local: Any
    cross: Any
    world: Any = None
    local_net: str | None = None  # the NCCL network the site group named (None: the process-wide default)

    @property
    def hierarchical(self) -> bool:
        """Whether ``all_reduce`` takes the three-step path (else the flat all-reduce over `world`)."""
        return self.cross is not None


def _default_site() -> str:
    return os.environ.get(ENV_SITE) or os.environ.get(ENV_NODE) or platform.node()


@contextmanager
def _gloo_interface(ifname: str | None):
    """GLOO_SOCKET_IFNAME set to `ifname` while a group is made (gloo reads it then); restored after."""
    if not ifname:
        yield
        return
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = old


def _torch_has_net_name() -> bool:
    """Whether this torch lets an NCCL group name its network (``ProcessGroupNCCL.Options().config.net_name``)."""
    options = getattr(getattr(dist, "ProcessGroupNCCL", None), "Options", None)
    if options is None or not hasattr(options, "config"):  # config: only in builds with NCCL 2.17+
        return False
    return hasattr(type(options().config), "net_name")  # the class's property: its getter is not called


def _nccl_options(net: str | None) -> Any:
    """``ProcessGroupNCCL.Options`` naming `net`, or None (the process-wide default)."""
    if net is None:
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.net_name = net
    return opts


@contextmanager
def _nccl_net_lifted(lift: bool):
    """NCCL_NET out of the environment meanwhile: NCCL would let it win over the group's config.netName.

    NCCL reads it while a communicator is created, on the thread that creates it (this one).
    """
    old = os.environ.pop("NCCL_NET", None) if lift else None
    try:
        yield
    finally:
        if old is not None:
            os.environ["NCCL_NET"] = old


def _warn_once(message: str) -> None:
    if message and message not in _warned:
        _warned.add(message)
        warnings.warn(f"meshrun.train.sites: {message}", RuntimeWarning, stacklevel=3)


def groups(
    site: str | None = None, *, site_ifname: str | None = None, world: Any = None, fabric: str = FABRIC_NET
) -> SiteGroups:
    """Make this job's site groups: collective, every rank of `world` (default: the default group) calls it.

    `site`: this rank's site (default ``MESHRUN_SITE``, else one site per node). `site_ifname`: the
    interface gloo binds the site group to (default ``MESHRUN_SITE_IFNAME``; unset: the process's default,
    the overlay under `meshrun train`). `fabric`: the NCCL network the site group names under
    ``meshrun train --site-fabric`` (see the module docstring; NCCL_NET's names: "IB", or a plugin's).
    With NCCL, call it after ``torch.cuda.set_device``. UsageError when torch.distributed is not initialized.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError(
            "meshrun.train.sites.groups() needs torch.distributed", "call torch.distributed.init_process_group first"
        )
    mine = site or _default_site()
    node = os.environ.get(ENV_NODE) or platform.node()
    names: list[Any] = [None] * dist.get_world_size(world)
    dist.all_gather_object(names, (mine, node), group=world)
    # Ranks of `world` as the group sees them; new_group takes global ranks.
    ranks = [dist.get_global_rank(world, r) if world is not None else r for r in range(len(names))]
    layout = SiteLayout.of([str(n[0]) for n in names])
    me = dist.get_rank(world)
    backend = str(dist.get_backend(world))
    ifname = site_ifname if site_ifname is not None else os.environ.get(ENV_SITE_IFNAME)
    if backend != "gloo":
        ifname = None  # NCCL's socket interface is per process (see the module docstring)
    site_nodes = len({names[r][1] for r in layout.ranks[layout.site_index(me)]})
    nets = NcclNets()
    if backend == "nccl":
        nets = nccl_nets(backend, os.environ, _torch_has_net_name(), site_nodes, fabric)
        _warn_once(nets.warning)
    local = None
    for site_ranks in layout.ranks:  # every rank makes every group, in one order (new_group is collective)
        mine_here = me in site_ranks
        net = nets.local if mine_here else None
        with _gloo_interface(ifname if mine_here else None), _nccl_net_lifted(net is not None):
            g = dist.new_group([ranks[r] for r in site_ranks], pg_options=_nccl_options(net))
            if net is not None:
                # torch creates an NCCL communicator at the group's first collective (or above, when the
                # default group is bound to a device): make it now, while NCCL_NET is lifted.
                dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())), group=g)
        if mine_here:
            local = g
    cross = None
    if len(layout.sites) > 1:
        for owners in layout.cross_groups():
            mine_here = me in owners
            g = dist.new_group([ranks[r] for r in owners], pg_options=_nccl_options(nets.cross if mine_here else None))
            if mine_here:
                cross = g
    i = layout.site_index(me)
    return SiteGroups(
        layout=layout,
        rank=me,
        site=layout.sites[i],
        site_rank=i,
        num_sites=len(layout.sites),
        local_rank=layout.local_rank(me),
        local_size=len(layout.ranks[i]),
        local=local,
        cross=cross,
        world=world,
        local_net=nets.local,
    )


def all_reduce(tensor: torch.Tensor, g: SiteGroups, op: str = "sum") -> torch.Tensor:
    """Reduce `tensor` over every rank of `g.world`, in place, and return it: "sum" or "avg".

    Hierarchical when ``g.hierarchical`` (reduce-scatter in the site, all-reduce of each shard across
    sites, all-gather in the site), else one flat all-reduce. The sum is the same as ``dist.all_reduce``'s
    up to the order of float additions (exact for values that add exactly, e.g. integers in fp32).
    UsageError for another op.
    """
    if op not in _OPS:
        raise UsageError(f"op {op!r} is not supported by meshrun.train.sites.all_reduce", "use 'sum' or 'avg'")
    if not g.hierarchical:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=g.world)
    else:
        n = g.local_size
        flat = tensor.detach().reshape(-1)
        pad = (-flat.numel()) % n
        buf = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.clone()
        shard = buf.new_empty(buf.numel() // n)
        reduce_scatter_single(shard, buf, op=dist.ReduceOp.SUM, group=g.local)
        dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=g.cross)
        all_gather_single(buf, shard, group=g.local)
        with torch.no_grad():
            tensor.copy_(buf[: flat.numel()].view_as(tensor))
    if op == "avg":
        with torch.no_grad():
            tensor.div_(dist.get_world_size(g.world))
    return tensor
