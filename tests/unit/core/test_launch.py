"""meshrun.core.launch: torchrun argv/env planning, validation, train argv splitting, and one real local run."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
from support import REPO_ROOT

from meshrun.core import launch
from meshrun.core.launch import NodeInfo, NodeLaunch, TrainOptions
from meshrun.core.topology import Placement
from meshrun.errors import UsageError

ROOT = REPO_ROOT

NODES = [
    NodeInfo("dc1-gpu0", "10.77.0.2", 8),
    NodeInfo("dc2-gpu0", "10.77.0.3", 8),
    NodeInfo("dc3-cpu", "10.77.0.4", 0),
]


def opts(**kw) -> TrainOptions:
    base = dict(script="train.py", script_args=("--epochs", "3"), job_id="exp7", rdzv_host="10.77.0.1")
    base.update(kw)
    return TrainOptions(**base)


def expected_argv(ip: str, nproc: str, nnodes: str = "3", workers: str = "warm") -> tuple[str, ...]:
    return (
        "python3",
        "-m",
        "meshrun.jobs.agent",
        "--workers",
        workers,
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        nproc,
        "--rdzv-backend",
        "meshrun",
        "--rdzv-endpoint",
        "10.77.0.1:29400",
        "--rdzv-id",
        "exp7",
        "--rdzv-conf",
        "is_host=0,join_timeout=900",
        "--local-addr",
        ip,
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.1",
        "train.py",
        "--epochs",
        "3",
    )


def test_three_node_plan_exact_argv():
    plans = launch.plan(NODES, opts())
    assert [p.node for p in plans] == ["dc1-gpu0", "dc2-gpu0", "dc3-cpu"]
    assert plans[0].argv == expected_argv("10.77.0.2", "8")
    assert plans[1].argv == expected_argv("10.77.0.3", "8")
    assert plans[2].argv == expected_argv("10.77.0.4", "1")  # no GPU -> 1 worker


def test_cold_workers_are_asked_of_every_agent():
    plans = launch.plan(NODES, opts(workers="cold"))
    assert [p.argv for p in plans] == [
        expected_argv("10.77.0.2", "8", workers="cold"),
        expected_argv("10.77.0.3", "8", workers="cold"),
        expected_argv("10.77.0.4", "1", workers="cold"),
    ]


def test_several_coordinators_keep_the_rendezvous_and_every_one_is_named():
    (p,) = launch.plan(NODES[:1], opts(rdzv_coordinators=("10.77.0.1:51821", "10.77.0.9:51821")), local=True)
    conf = p.argv[p.argv.index("--rdzv-conf") + 1]
    # '+' between them: torchrun splits --rdzv-conf at commas
    assert conf == "is_host=0,join_timeout=900,coordinators=10.77.0.1:51821+10.77.0.9:51821"
    assert p.argv[p.argv.index("--rdzv-backend") + 1] == "meshrun"


def test_every_node_is_not_the_store_host_and_announces_its_overlay_ip():
    plans = launch.plan(NODES, opts())
    for p, n in zip(plans, NODES):
        a = list(p.argv)
        assert a[a.index("--rdzv-conf") + 1].split(",")[0] == "is_host=0"
        assert a[a.index("--local-addr") + 1] == n.overlay_ip
        assert a[a.index("--rdzv-endpoint") + 1] == "10.77.0.1:29400"


def test_env_pins_nccl_and_gloo_to_the_overlay_exactly():
    gpu, _, cpu = launch.plan(NODES, opts(interface="wg7"))
    assert gpu.env["NCCL_SOCKET_IFNAME"] == "=wg7"
    assert gpu.env["GLOO_SOCKET_IFNAME"] == "wg7"
    assert gpu.env["NCCL_IB_DISABLE"] == "1"
    # NCCL's own socket count won on the GPU machine (benchmarks/results/gpu_datapath.json): left unset.
    assert "NCCL_SOCKET_NTHREADS" not in gpu.env and "NCCL_NSOCKS_PERTHREAD" not in gpu.env
    assert gpu.env["PYTHONUNBUFFERED"] == "1"
    assert gpu.env["MESHRUN_NODE_NAME"] == "dc1-gpu0"
    assert cpu.env["GLOO_SOCKET_IFNAME"] == "wg7" and cpu.env["MESHRUN_NODE_NAME"] == "dc3-cpu"
    # The rendezvous plugin binds the agent's store to this interface; the bench binds to this address.
    assert gpu.env["MESHRUN_INTERFACE"] == "wg7" and gpu.env["MESHRUN_OVERLAY_IP"] == "10.77.0.2"
    # Pinned on CPU nodes too: an uncounted GPU must not make NCCL pick the underlay.
    assert cpu.env["NCCL_SOCKET_IFNAME"] == "=wg7"


def test_user_env_wins_except_node_name():
    user = {
        "NCCL_SOCKET_IFNAME": "=eth1",
        "NCCL_DEBUG": "INFO",
        "GLOO_SOCKET_IFNAME": "eth1",
        "MESHRUN_NODE_NAME": "liar",
        "MESHRUN_INTERFACE": "eth1",
    }
    p = launch.plan(NODES[:1], opts(), user)[0]
    assert p.env["NCCL_SOCKET_IFNAME"] == "=eth1"
    assert p.env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert p.env["NCCL_DEBUG"] == "INFO"
    assert p.env["MESHRUN_NODE_NAME"] == "dc1-gpu0" and p.env["MESHRUN_INTERFACE"] == "meshrun0"


def test_every_worker_learns_its_job_and_run_and_the_user_cannot_rename_them():
    """A fresh job's run is the job; a resumed one's is the run it continues (where its checkpoints are)."""
    liar = {"MESHRUN_JOB_ID": "other", "MESHRUN_RUN_ID": "../../somewhere"}
    (fresh,) = launch.plan(NODES[:1], opts(job_id="exp-2"), liar)
    assert (fresh.env["MESHRUN_JOB_ID"], fresh.env["MESHRUN_RUN_ID"]) == ("exp-2", "exp-2")
    (resumed,) = launch.plan(NODES[:1], opts(job_id="exp-3", run_id="exp-1"), liar)
    assert (resumed.env["MESHRUN_JOB_ID"], resumed.env["MESHRUN_RUN_ID"]) == ("exp-3", "exp-1")


def test_every_worker_learns_its_site_and_the_user_cannot_rename_it():
    site = Placement("fra", 1, 2, "10.1.0.2")
    nodes = [NodeInfo("a", "10.77.0.2", 0, site), NodeInfo("b", "10.77.0.3", 0, Placement("b", 0, 2, ""))]
    a, b = launch.plan(nodes, opts(), {"MESHRUN_SITE": "liar", "MESHRUN_NUM_SITES": "9"})
    assert {k: a.env[k] for k in a.env if k.startswith("MESHRUN_SITE") or k == "MESHRUN_NUM_SITES"} == {
        "MESHRUN_SITE": "fra",
        "MESHRUN_SITE_RANK": "1",
        "MESHRUN_NUM_SITES": "2",
        "MESHRUN_SITE_ADDR": "10.1.0.2",
    }
    assert b.env["MESHRUN_SITE"] == "b" and "MESHRUN_SITE_ADDR" not in b.env  # alone in its site: no site network
    assert "MESHRUN_SITE" not in launch.plan(NODES[:1], opts())[0].env  # planned without sites: none set


SITE_NODES = [
    NodeInfo("fra-a", "10.77.0.2", 8, Placement("fra", 0, 2, "10.1.0.2")),
    NodeInfo("fra-b", "10.77.0.3", 8, Placement("fra", 0, 2, "10.1.0.3")),
    NodeInfo("ams-a", "10.77.0.4", 8, Placement("ams", 1, 2, "")),
]


def test_a_job_with_sites_keeps_nccl_on_the_overlay_sockets_and_infiniband_off():
    for p in launch.plan(SITE_NODES, opts()):
        assert p.env["NCCL_NET"] == "Socket" and p.env["NCCL_SOCKET_IFNAME"] == "=meshrun0"
        assert p.env["NCCL_IB_DISABLE"] == "1"
        assert "MESHRUN_SITE_FABRIC" not in p.env
    # MESHRUN_SITE_FABRIC is meshrun's: without --site-fabric InfiniBand is off, so a user's 1 would break groups.
    (p,) = launch.plan(SITE_NODES[:1], opts(), {"MESHRUN_SITE_FABRIC": "1"})
    assert "MESHRUN_SITE_FABRIC" not in p.env and p.env["NCCL_IB_DISABLE"] == "1"


def test_site_fabric_lets_nccl_load_infiniband_but_keeps_sockets_the_process_wide_default():
    for p in launch.plan(SITE_NODES, opts(site_fabric=True)):
        # NCCL_NET wins over a communicator's own choice: only meshrun.train.sites lifts it, for the site group.
        assert p.env["NCCL_NET"] == "Socket" and p.env["NCCL_SOCKET_IFNAME"] == "=meshrun0"
        assert "NCCL_IB_DISABLE" not in p.env
        assert p.env["MESHRUN_SITE_FABRIC"] == "1" and p.env["MESHRUN_SITE"] in ("fra", "ams")
    # The user's own NCCL_IB_DISABLE still wins (meshrun.train.sites then warns and stays on sockets).
    (p,) = launch.plan(SITE_NODES[:1], opts(site_fabric=True), {"NCCL_IB_DISABLE": "1"})
    assert p.env["NCCL_IB_DISABLE"] == "1" and p.env["MESHRUN_SITE_FABRIC"] == "1"


def test_a_job_across_sites_gets_nccl_s_larger_wan_buffer_and_one_site_keeps_nccl_s_default():
    for p in launch.plan(SITE_NODES, opts()):
        assert p.env["NCCL_BUFFSIZE"] == str(16 << 20)
    one_site = [NodeInfo(n.name, n.overlay_ip, 8, Placement("fra", 0, 1, n.site.addr)) for n in SITE_NODES[:2]]
    assert all("NCCL_BUFFSIZE" not in p.env for p in launch.plan(one_site, opts()))
    # Nodes with no placement (a --local share) are not known to cross a WAN.
    assert "NCCL_BUFFSIZE" not in launch.worker_env("meshrun0", "n", {})
    # The user's own value wins, and a shell's is announced as overriding meshrun's.
    (p,) = launch.plan(SITE_NODES[:1], opts(), {"NCCL_BUFFSIZE": "4194304"})
    assert p.env["NCCL_BUFFSIZE"] == "4194304"
    assert launch.shell_env({"NCCL_BUFFSIZE": "1"}, {}).override == ("NCCL_BUFFSIZE",)


def test_user_socket_settings_pass_through():
    env = launch.worker_env("meshrun0", "n", {"NCCL_SOCKET_NTHREADS": "16"})
    assert env["NCCL_SOCKET_NTHREADS"] == "16" and "NCCL_NSOCKS_PERTHREAD" not in env


def test_nproc_default_and_override():
    nodes = [NodeInfo("a", "10.77.0.2", 4), NodeInfo("b", "10.77.0.3", 2), NodeInfo("c", "10.77.0.4")]

    def nprocs(plans):
        return [p.argv[p.argv.index("--nproc-per-node") + 1] for p in plans]

    assert nprocs(launch.plan(nodes, opts())) == ["4", "2", "1"]
    assert nprocs(launch.plan(nodes, opts(nproc_per_node=3))) == ["3", "3", "3"]


def test_nnodes_min_max_and_fixed_subset():
    plans = launch.plan(NODES, opts(nnodes="2:3"))
    assert len(plans) == 3
    assert all(p.argv[p.argv.index("--nnodes") + 1] == "2:3" for p in plans)
    plans = launch.plan(NODES, opts(nnodes="2"))  # only as many nodes as the rendezvous takes
    assert [p.node for p in plans] == ["dc1-gpu0", "dc2-gpu0"]
    assert plans[0].argv[plans[0].argv.index("--nnodes") + 1] == "2"
    plans = launch.plan(NODES[:2], opts(nnodes="1:4"))  # elastic: MAX may exceed the nodes at hand
    assert len(plans) == 2
    # An elastic rendezvous waits 10 s (not torch's 30) for more nodes: a group re-formed after a loss.
    conf = plans[0].argv[plans[0].argv.index("--rdzv-conf") + 1]
    assert conf.split(",")[-1] == f"last_call_timeout={launch.ELASTIC_LAST_CALL_S}", conf
    fixed = launch.plan(NODES, opts(nnodes="2"))[0].argv
    assert "last_call_timeout" not in fixed[fixed.index("--rdzv-conf") + 1]
    argv = launch.plan(NODES, opts(nnodes="2:2"))[0].argv
    assert argv[argv.index("--nnodes") + 1] == "2"


def test_options_module_restarts_port_timeout_python():
    p = launch.plan(
        NODES[:1],
        opts(
            module=True,
            script="pkg.train",
            max_restarts=2,
            rdzv_port=29555,
            rdzv_timeout=60,
            python="/opt/py/bin/python",
            script_args=(),
        ),
    )[0]
    a = list(p.argv)
    assert a[0] == "/opt/py/bin/python"
    assert a[-2:] == ["-m", "pkg.train"]  # torchrun's -m: the script is a module
    assert a[a.index("--max-restarts") + 1] == "2"
    assert a[a.index("--rdzv-endpoint") + 1] == "10.77.0.1:29555"
    assert a[a.index("--rdzv-conf") + 1] == "is_host=0,join_timeout=60"


def test_ipv6_rendezvous_host_is_bracketed():
    p = launch.plan([NodeInfo("a", "fd00::2")], opts(rdzv_host="fd00::1"))[0]
    assert p.argv[p.argv.index("--rdzv-endpoint") + 1] == "[fd00::1]:29400"


@pytest.mark.parametrize(
    "nodes, kw, needle",
    [
        ([], {}, "no nodes"),
        (NODES, {"nnodes": "5"}, "3 are available"),
        (NODES, {"nnodes": "4:6"}, "3 are available"),
        (NODES, {"nnodes": "3:2"}, "'3:2'"),
        (NODES, {"nnodes": "two"}, "'two'"),
        (NODES, {"nnodes": "0"}, "'0'"),
        (NODES, {"job_id": ""}, "job id ''"),
        (NODES, {"job_id": "bad id/1"}, "'bad id/1'"),
        (NODES, {"job_id": "x" * 65}, "x" * 65),
        (NODES, {"rdzv_port": 0}, "port 0"),
        (NODES, {"rdzv_port": 70000}, "port 70000"),
        (NODES, {"nproc_per_node": 0}, "--nproc-per-node 0"),
        (NODES, {"rdzv_host": ""}, "rendezvous host ''"),
        (NODES, {"max_restarts": -1}, "-1"),
        (NODES, {"script": ""}, "no training script"),
        ([NodeInfo("a", "not-an-ip")], {}, "'not-an-ip'"),
        ([NodeInfo("a", "10.0.0.1"), NodeInfo("a", "10.0.0.2")], {}, "'a' is listed twice"),
    ],
)
def test_validation_names_the_bad_value(nodes, kw, needle):
    with pytest.raises(UsageError) as exc:
        launch.plan(nodes, opts(**kw))
    assert needle in exc.value.message
    assert exc.value.fix


def test_parse_nnodes():
    assert launch.parse_nnodes("3") == (3, 3)
    assert launch.parse_nnodes("2:3") == (2, 3)
    for bad in ("", "a", "1:2:3", "-1", "3:2", ":2", "0"):
        with pytest.raises(UsageError) as exc:
            launch.parse_nnodes(bad)
        assert repr(bad) in str(exc.value)


def test_shell_round_trips():
    p = launch.plan(
        NODES[:1], opts(script_args=("--msg", "it's a $HOME test", "a b")), {"NCCL_DEBUG": "INFO", "WEIRD": "x y'z"}
    )[0]
    words = shlex.split(p.shell())
    n_env = len(p.env)
    assert dict(w.split("=", 1) for w in words[:n_env]) == p.env
    assert tuple(words[n_env:]) == p.argv
    assert isinstance(p, NodeLaunch)


def test_plan_runs_under_real_torchrun(tmp_path):
    """One node, 2 workers, rendezvous at a TCPStore this test hosts (as the coordinator does)."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        o = TrainOptions(
            script=str(ROOT / "examples" / "ddp_train.py"),
            script_args=("--epochs", "2", "--steps-per-epoch", "3", "--checkpoint", "ck.pt"),
            nproc_per_node=2,
            job_id="test-local",
            rdzv_host="127.0.0.1",
            rdzv_port=store.port,
            interface="lo",
            python=sys.executable,
            rdzv_timeout=60,
        )
        (p,) = launch.plan([NodeInfo("local", "127.0.0.1", 0)], o)
        job = tmp_path / "job"
        job.mkdir()
        env = dict(os.environ)
        env.update(p.env)
        env.update({"PYTHONPATH": str(ROOT), "MESHRUN_JOB_DIR": str(job), "OMP_NUM_THREADS": "1"})
        r = subprocess.run(p.argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    finally:
        del store
    out = r.stdout
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[local r0] epoch 1 loss " in out and "[local r0] epoch 2 loss " in out
    sums = {}
    for line in out.splitlines():
        if "param_checksum" in line:
            prefix, _, rest = line.partition("] ")
            fields = dict(kv.split("=") for kv in rest.split()[1:])
            assert prefix == f"[local r{fields['rank']}"
            sums[fields["rank"]] = fields["value"]
    assert set(sums) == {"0", "1"} and len(set(sums.values())) == 1
    assert (tmp_path / "ck.pt").exists()
    assert sorted(f.name for f in job.iterdir()) == ["exit-r0-a0.json", "exit-r1-a0.json"]


def test_local_plan_allows_fewer_nodes_than_nnodes():
    """`meshrun train --local`: only this node is planned, the rendezvous still expects all."""
    p = launch.plan(NODES[:1], opts(nnodes="3"), local=True)
    assert len(p) == 1
    assert p[0].argv[p[0].argv.index("--nnodes") + 1] == "3"
    with pytest.raises(UsageError, match="needs 3 node"):
        launch.plan(NODES[:1], opts(nnodes="3"))


def test_a_job_cannot_take_a_store_off_the_overlay():
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE would make rank 0 host a store on every interface: refused."""
    with pytest.raises(UsageError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE cannot be set for a meshrun job"):
        launch.plan(NODES, opts(), {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def test_a_diloco_preset_reaches_every_worker_and_the_user_may_override_it():
    from meshrun.core import presets

    preset = presets.PRESETS["medium"].env()
    env = launch.worker_env("meshrun0", "a", {"MESHRUN_DILOCO_SYNC_EVERY": "20"}, job_env=preset)
    assert env["MESHRUN_DILOCO_COMPRESSION"] == "fp4" and env["MESHRUN_DILOCO_FRAGMENTS"] == "2"
    assert env["MESHRUN_DILOCO_SYNC_EVERY"] == "20"  # the user's --env wins over the preset
    assert not any(k.startswith("MESHRUN_DILOCO_") for k in launch.worker_env("meshrun0", "a", {}))


def test_mixed_accelerators_is_meshrun_s_to_set():
    assert launch.worker_env("meshrun0", "a", {}, mixed_accelerators=True)["MESHRUN_MIXED_ACCELERATORS"] == "1"
    # a job that did not declare it cannot claim it (the pre-flight judged it without), nor can one drop it
    assert "MESHRUN_MIXED_ACCELERATORS" not in launch.worker_env("meshrun0", "a", {"MESHRUN_MIXED_ACCELERATORS": "1"})
    forced = launch.worker_env("meshrun0", "a", {"MESHRUN_MIXED_ACCELERATORS": "0"}, mixed_accelerators=True)
    assert forced["MESHRUN_MIXED_ACCELERATORS"] == "1"
