"""meshrun.train.sites: the site layout (pure), and the hierarchical all-reduce in real gloo groups.

The collective checks spawn 4 CPU processes with a gloo group on loopback (FileStore rendezvous) and run
every scenario once (module-scoped fixture). Loopback stands in for both networks here: which interface a
group uses is checked end to end in the namespace world; what is checked here is that the three steps
sum what the flat all-reduce sums, for every layout.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshrun.errors import UsageError
from meshrun.train import sites
from meshrun.train.sites import NcclNets, SiteLayout


def test_a_layout_orders_sites_by_their_first_rank_and_pairs_equal_local_ranks():
    layout = SiteLayout.of(["b", "a", "b", "a"])
    assert layout.sites == ("b", "a") and layout.ranks == ((0, 2), (1, 3))
    assert layout.uniform and layout.cross_groups() == [(0, 1), (2, 3)]
    assert [layout.site_index(r) for r in range(4)] == [0, 1, 0, 1]
    assert [layout.local_rank(r) for r in range(4)] == [0, 0, 1, 1]


def test_sites_of_different_sizes_have_no_cross_groups():
    layout = SiteLayout.of(["a", "a", "a", "b"])
    assert not layout.uniform and layout.cross_groups() == []
    assert SiteLayout.of(["a", "a"]).cross_groups() == [(0,), (1,)]  # one site: each rank alone


def test_a_bad_layout_or_op_is_refused_with_the_fix():
    with pytest.raises(UsageError, match="rank 1 has an empty site name"):
        SiteLayout.of(["a", ""])
    with pytest.raises(UsageError, match="rank 5 is in no site"):
        SiteLayout.of(["a"]).site_index(5)
    with pytest.raises(UsageError, match="needs torch.distributed"):
        sites.groups()


def _check(g: sites.SiteGroups, rank: int, world: int) -> dict:
    """Hierarchical vs flat on tensors whose sums are exact, random floats, a non-contiguous view, avg."""
    out = {"hierarchical": g.hierarchical, "site": g.site, "site_rank": g.site_rank, "num_sites": g.num_sites}
    out["local_net"] = g.local_net
    out["local"] = (g.local_rank, g.local_size)
    out["cross_size"] = dist.get_world_size(g.cross) if g.cross is not None else 0
    exact = torch.arange(1001, dtype=torch.float32) + 1000 * rank  # odd length: the padding path
    flat = exact.clone()
    dist.all_reduce(flat)
    out["exact_equal"] = torch.equal(sites.all_reduce(exact, g), flat)
    gen = torch.Generator().manual_seed(rank)
    rand = torch.randn(64, 33, generator=gen)
    flat = rand.clone()
    dist.all_reduce(flat)
    out["rand_max_err"] = float((sites.all_reduce(rand, g) - flat).abs().max())
    view = torch.arange(12.0).reshape(3, 4).t() * (rank + 1)  # non-contiguous
    expected = torch.arange(12.0).reshape(3, 4).t() * sum(range(1, world + 1))
    out["view_equal"] = torch.equal(sites.all_reduce(view, g), expected)
    avg = torch.full((5,), float(rank))
    out["avg_equal"] = torch.equal(sites.all_reduce(avg, g, op="avg"), torch.full((5,), sum(range(world)) / world))
    return out


LAYOUTS = {
    "two_sites_of_two": lambda r: "dc1" if r < 2 else "dc2",
    "interleaved": lambda r: "dc1" if r % 2 == 0 else "dc2",
    "uneven": lambda r: "dc1" if r < 3 else "dc2",
    "one_site": lambda r: "dc1",
}


def _entry(rank: int, world: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        results = {}
        for name, site_of in LAYOUTS.items():
            results[name] = _check(sites.groups(site_of(rank), site_ifname="lo"), rank, world)
        os.environ["MESHRUN_SITE"] = "from-env" if rank < 2 else "other"
        os.environ["MESHRUN_SITE_FABRIC"] = "1"  # NCCL's only: gloo groups name no network
        results["from_env"] = _check(sites.groups(), rank, world)
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"  # restored after the site groups were made
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("sites"))
    mp.spawn(_entry, args=(4, os.path.join(tmp, "store"), tmp), nprocs=4, join=True)
    return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in range(4)]


@pytest.mark.parametrize("layout", [*LAYOUTS, "from_env"])
def test_the_site_all_reduce_sums_what_the_flat_one_sums(world4, layout):
    for rank, res in enumerate(world4):
        r = res[layout]
        assert r["exact_equal"] and r["view_equal"] and r["avg_equal"], (rank, r)
        assert r["rand_max_err"] < 1e-5, (rank, r)  # float sums in another order


def test_two_sites_of_two_take_the_hierarchical_path_with_one_shard_owner_per_site(world4):
    for rank, res in enumerate(world4):
        r = res["two_sites_of_two"]
        assert r["hierarchical"] and r["num_sites"] == 2 and r["cross_size"] == 2
        assert (r["site"], r["site_rank"], r["local"]) == (("dc1", 0) if rank < 2 else ("dc2", 1)) + ((rank % 2, 2),)
        assert world4[rank]["interleaved"]["local"] == (rank // 2, 2)  # sites by first rank, ranks ascending
        assert world4[rank]["from_env"]["site"] == ("from-env" if rank < 2 else "other")


def test_uneven_sites_and_a_single_site_fall_back_to_the_flat_all_reduce(world4):
    for res in world4:
        assert not res["uneven"]["hierarchical"] and res["uneven"]["cross_size"] == 0
        assert not res["one_site"]["hierarchical"] and res["one_site"]["num_sites"] == 1


FABRIC = {"MESHRUN_SITE_FABRIC": "1", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "=meshrun0"}


def test_only_nccl_under_site_fabric_names_the_fabric_for_the_site_group_and_sockets_across(world4):
    assert sites.nccl_nets("nccl", FABRIC, True, site_nodes=2) == NcclNets(local="IB", cross="Socket")
    assert sites.nccl_nets("nccl", FABRIC, True, site_nodes=2, fabric="Libfabric").local == "Libfabric"
    # A job that does not ask, or gloo (whose site group binds to the site interface instead): nothing named.
    assert sites.nccl_nets("nccl", {"NCCL_NET": "Socket"}, True, site_nodes=2) == NcclNets()
    assert sites.nccl_nets("nccl", {**FABRIC, "MESHRUN_SITE_FABRIC": "0"}, True, site_nodes=2) == NcclNets()
    assert sites.nccl_nets("gloo", FABRIC, True, site_nodes=2) == NcclNets()
    assert all(res["from_env"]["local_net"] is None for res in world4)  # gloo with MESHRUN_SITE_FABRIC=1


def test_a_site_inside_one_node_keeps_the_default_network_for_its_group():
    assert sites.nccl_nets("nccl", FABRIC, True, site_nodes=1) == NcclNets(local=None, cross="Socket")


def test_without_the_torch_field_or_with_infiniband_disabled_the_site_group_stays_on_sockets_with_a_warning():
    old_torch = sites.nccl_nets("nccl", FABRIC, False, site_nodes=2)
    assert (old_torch.local, old_torch.cross) == (None, None)
    assert "no ProcessGroupNCCL.Options().config.net_name" in old_torch.warning
    assert "stays on NCCL_NET=Socket" in old_torch.warning
    ib_off = sites.nccl_nets("nccl", {**FABRIC, "NCCL_IB_DISABLE": "1"}, True, site_nodes=2)
    assert (ib_off.local, ib_off.cross) == (None, None)
    assert "NCCL_IB_DISABLE=1" in ib_off.warning and "drop NCCL_IB_DISABLE" in ib_off.warning
    assert sites.nccl_nets("nccl", {**FABRIC, "NCCL_IB_DISABLE": "0"}, True, site_nodes=2).local == "IB"


def test_this_cpu_torch_cannot_name_an_nccl_network_and_the_warning_comes_once(monkeypatch):
    if not hasattr(dist, "ProcessGroupNCCL"):  # the CPU build: no NCCL, so the fabric path cannot run here
        assert not sites._torch_has_net_name()
    monkeypatch.setattr(sites, "_warned", set())
    with pytest.warns(RuntimeWarning) as caught:
        sites._warn_once("no fabric")
        sites._warn_once("no fabric")
    assert [str(w.message) for w in caught] == ["meshrun.train.sites: no fabric"]


def test_nccl_net_is_lifted_only_while_the_site_group_is_made(monkeypatch):
    monkeypatch.setenv("NCCL_NET", "Socket")
    with sites._nccl_net_lifted(True):
        assert "NCCL_NET" not in os.environ  # NCCL would let it win over the group's config.netName
    assert os.environ["NCCL_NET"] == "Socket"
    with sites._nccl_net_lifted(False):
        assert os.environ["NCCL_NET"] == "Socket"
