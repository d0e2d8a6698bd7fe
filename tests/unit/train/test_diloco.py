"""Tests for meshrun.train.diloco: exact math against references (DiLoCo and Streaming DiLoCo),
int8/fp4 error feedback, the state check, resume from a checkpoint or from snapshots after a
membership change, compression and byte counters.

Multi-worker checks spawn 2 and 3 CPU processes with a gloo group (FileStore rendezvous, loopback).
Each spawn runs a suite of scenarios once (module-scoped fixture) to keep the file fast on 2 cores.
"""

from __future__ import annotations

import copy
import datetime
import io
import math
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from meshrun.core import presets
from meshrun.errors import StateError, UsageError
from meshrun.train.compress import (
    CODECS,
    FP4_BLOCK,
    FP8_BLOCK,
    INT2_BLOCK,
    INT8_CHUNK,
    SHARED_BLOCK,
    SHARED_CLIP,
    SharedSparse,
    SparseCodec,
    dequantize_fp4,
    dequantize_int2,
    dequantize_int8,
    make_codec,
    pack_bits,
    quantize_fp4,
    quantize_int2,
    quantize_int8,
    unpack_bits,
)
from meshrun.train.diloco import AUTO, DiLoCo, _balanced_fragments

IN, HID, OUT = 8, 16, 4
NUMEL = IN * HID + HID + HID * OUT + OUT  # parameters of _mlp()
MATRIX_NUMEL, VECTOR_NUMEL = IN * HID + HID * OUT, HID + OUT  # its weights; its biases (sparse formats: dense)


def _mlp(seed: int, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT)]
    if batchnorm:
        layers.insert(1, nn.BatchNorm1d(HID))
    return nn.Sequential(*layers)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data for every (step, rank), reproducible in any process."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(16, IN, generator=g)
    return x, torch.randn(16, OUT, generator=g) + x[:, :OUT]


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return nn.functional.mse_loss(model(x), y)


def _train(model: nn.Module, opt: DiLoCo, steps: range, rank: int) -> None:
    for s in steps:
        _loss(model, s, rank).backward()
        opt.step()
        opt.zero_grad()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- worker scenarios
def _sc_math_sgd(rank: int, world: int) -> dict:
    model = _mlp(0)
    opt = DiLoCo(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        sync_every=1,
        outer_lr=1.0,
        outer_momentum=0.0,
        compression="none",
    )
    _train(model, opt, range(6), rank)
    return {"params": _params(model), "syncs": opt.sync_count}


def _sc_math_nesterov(rank: int, world: int) -> dict:
    model = _mlp(0)
    opt = DiLoCo(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        sync_every=3,
        outer_lr=0.7,
        outer_momentum=0.9,
        compression="none",
    )
    _train(model, opt, range(9), rank)
    return {"params": _params(model)}


def _eps_grad(t: int, rank: int) -> torch.Tensor:
    """Pseudo-gradient fed at sync t. Element 0 (+-1, alternating) sets the int8 scale to ~1/127;
    the others carry a constant bias of 0.002, below half a quantization step, plus a little noise.
    Without error feedback that bias rounds to 0 every sync and the error grows by ~0.002 per sync."""
    g = torch.Generator().manual_seed(777 + 1000 * t + rank)
    x = 0.002 + 0.0015 * torch.rand(301, generator=g, dtype=torch.float64)  # odd size on purpose
    x[0] = 1.0 if t % 2 == 0 else -1.0
    return x


def _sc_ef(rank: int, world: int) -> dict:
    """150 syncs of known pseudo-gradients per quantizing compression: cumulative error after each."""
    out = {}
    for comp in ("int8", "fp8", "fp4", "int2"):
        model = nn.Linear(301, 1, bias=False)
        opt = DiLoCo(
            model,
            torch.optim.SGD(model.parameters(), lr=0.0),
            sync_every=1,
            outer_lr=1.0,
            outer_momentum=0.0,
            compression=comp,
        )
        (glob,) = opt.global_parameters().values()
        exact = glob.detach().double().clone()
        start = exact.clone()
        errors, absmax = [], []
        for t in range(150):
            mine = _eps_grad(t, rank)
            with torch.no_grad():  # make the local model differ from the global copy by exactly `mine`
                model.weight.copy_(glob - mine.view_as(glob).float())
            absmax.append(float(mine.abs().max()))
            opt.sync_now()
            exact -= torch.stack([_eps_grad(t, r) for r in range(world)]).mean(0).view_as(exact)
            errors.append(float((glob.double() - exact).abs().max()))
        drift = float((exact - start).abs()[0, 1:].min())  # what the biased elements moved in total
        out[comp] = {"errors": errors, "max_absmax": max(absmax), "drift": drift}
    return out


def _sc_resume(rank: int, world: int) -> dict:
    def fresh(seed: int) -> tuple[nn.Module, DiLoCo]:
        model = _mlp(seed, batchnorm=True)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, DiLoCo(model, inner, sync_every=3, outer_lr=0.7, outer_momentum=0.9, compression="int8")

    k, m = 5, 7  # saved mid-round (5 % 3 != 0) so local != global and error feedback is non-zero
    model, opt = fresh(0)
    _train(model, opt, range(k), rank)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, range(k, k + m), rank)
    a = _params(model)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model_b, opt_b = fresh(123)
    model_b.load_state_dict(ckpt["model"])
    opt_b.load_state_dict(ckpt["opt"])
    _train(model_b, opt_b, range(k, k + m), rank)

    model_c, opt_c = fresh(123)  # model restored but optimizer state not: must NOT match
    model_c.load_state_dict(ckpt["model"])
    _train(model_c, opt_c, range(k, k + m), rank)
    return {
        "a": a,
        "b": _params(model_b),
        "c": _params(model_c),
        "step_b": opt_b.step_count,
        "syncs_b": opt_b.sync_count,
    }


def _sc_compression(rank: int, world: int) -> dict:
    out = {}
    for comp in ("none", "fp16", "bf16", "int8", "fp8", "fp4", "int2", "sparse-int2", "sparse-fp4", "sparse-shared"):
        model = _mlp(0)
        opt = DiLoCo(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05),
            sync_every=2,
            outer_lr=0.7,
            outer_momentum=0.9,
            compression=comp,
        )
        _train(model, opt, range(6), rank)
        out[comp] = {
            "params": _params(model),
            "last": opt.last_sync_bytes,
            "total": opt.bytes_sent_total,
            "syncs": opt.sync_count,
            "ddp": opt.ddp_equivalent_bytes,
            "blocked": opt.comm_blocked_s,
            "sync_s": opt.sync_s,
        }
    return out


def _sc_one_collective(rank: int, world: int) -> dict:
    """The collectives one sync of a gathered or summed format starts (no state check: its digest gather is
    another collective, of 8 bytes)."""
    out = {}
    for comp in ("sparse-int2", "sparse-shared", "fp4"):
        model = _mlp(0)
        opt = DiLoCo(
            model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=2, compression=comp, check_state=False
        )
        calls: list[str] = []
        originals = {name: getattr(dist, name) for name in ("all_gather", "all_reduce", "broadcast")}

        def counting(name: str):
            def call(*args, **kw):
                calls.append(name)
                return originals[name](*args, **kw)

            return call

        _train(model, opt, range(1), rank)
        for name in originals:
            setattr(dist, name, counting(name))
        try:
            opt.sync_now()
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        out[comp] = calls
    return out


def _sc_blocked(rank: int, world: int) -> dict:
    """The last rank reaches the sync 0.4 s late: the others wait that long, and count it as blocked."""
    model = _mlp(0)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=2, compression="sparse-int2")
    _train(model, opt, range(1), rank)
    if rank == world - 1:
        time.sleep(0.4)
    _train(model, opt, range(1, 2), rank)
    return {"last": opt.last_sync_blocked_s, "total": opt.comm_blocked_s, "sync_s": opt.sync_s}


def _sc_buffers(rank: int, world: int) -> dict:
    model = _mlp(0, batchnorm=True)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=1, compression="none")
    bn = model[1]
    _loss(model, 0, rank).backward()
    before = bn.running_mean.clone()
    opt.step()
    return {"before": before, "after": bn.running_mean.clone(), "tracked": int(bn.num_batches_tracked)}


STREAM = {"sync_every": 4, "fragments": 2, "overlap": 1, "mixing": 0.25}  # period 2: a launch at odd steps


def _sc_streaming(rank: int, world: int) -> dict:
    """Streaming (F=2, tau=1, alpha=0.25) and its F=1, tau=0, alpha=0 special case, 8 steps then finish()."""
    out = {}
    for name, kw in (("stream", STREAM), ("one", {"sync_every": 3, "fragments": 1, "overlap": 0, "mixing": 0.0})):
        model = _mlp(0)
        opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), outer_lr=0.7, outer_momentum=0.9, **kw)
        flight, sent = [], []
        for s in range(9 if name == "one" else 8):
            _train(model, opt, range(s, s + 1), rank)
            flight.append(opt.in_flight)
            sent.append(opt.bytes_sent_total)
        before_finish = {"params": _params(model), "global": {k: v.clone() for k, v in opt.global_parameters().items()}}
        syncs = opt.sync_count
        opt.finish()
        out[name] = {
            "before": before_finish,
            "params": _params(model),
            "syncs": syncs,
            "syncs_after": opt.sync_count,
            "in_flight": flight,
            "sent": sent,
            "total": opt.bytes_sent_total,
            "fragments": opt.fragment_names,
        }
    return out


def _sc_overlap_runs_in_background(rank: int, world: int) -> dict:
    """Rank 0 must return from the step that launches a fragment's sync before the others launch
    theirs: the others wait for rank 0's word before that step. A blocking launch deadlocks here."""
    store = dist.FileStore(os.path.join(os.environ["DILOCO_TEST_DIR"], "side-store"), world)
    model = _mlp(0)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), **STREAM)
    if rank != 0:
        store.wait(["rank0-launched"], datetime.timedelta(seconds=30))
    _train(model, opt, range(1), rank)  # step 1: (1 + overlap) % 2 == 0 launches fragment 0
    launched = opt.in_flight
    if rank == 0:
        store.set("rank0-launched", "1")
    _train(model, opt, range(1, 4), rank)
    return {"launched_in_flight": launched, "syncs": opt.sync_count}


def _sc_state_check(rank: int, world: int) -> dict:
    """The digest comparison: silent when all agree, names the rank whose global copy was perturbed."""
    model = _mlp(0)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=2, **_MOMENTUM)
    _train(model, opt, range(4), rank)
    opt.verify_state()  # must not raise
    errors = {}
    for how in ("verify_state", "next_sync"):
        if rank == world - 1:  # large enough to survive the next outer step's rounding
            opt.global_parameters()["2.bias"][0] += 1e-3
        try:
            if how == "verify_state":
                opt.verify_state()
            else:  # the sync compares the synced fragment's digests in the background; finish() reports
                _train(model, opt, range(4, 6), rank)
                opt.finish()
            errors[how] = None
        except StateError as exc:
            errors[how] = exc.message
        # Heal the perturbation for the next round: everyone takes rank 0's global copy.
        for g in opt.global_parameters().values():
            dist.broadcast(g, src=0)
        for g, p in zip(opt.global_parameters().values(), model.parameters()):
            p.data.copy_(g)
    return errors


_MOMENTUM = {"outer_lr": 0.7, "outer_momentum": 0.9}


def _sc_fresh_start(rank: int, world: int) -> dict:
    """Models built with different seeds are aligned to rank 0's at construction; equal ones cost nothing."""
    out = {}
    for name, seed in (("same", 0), ("different", rank)):
        model = _mlp(seed, batchnorm=True)
        opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=2)
        out[name] = {"params": _params(model), "sent": opt.bytes_sent_total}
    return out


def _member_opt(snapshot_dir: Path) -> tuple[nn.Module, DiLoCo]:
    model = _mlp(0, batchnorm=True)
    opt = DiLoCo(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        sync_every=2,
        compression="fp4",
        snapshot_dir=snapshot_dir,
        **_MOMENTUM,
    )
    return model, opt


def _member_state(model: nn.Module, opt: DiLoCo) -> dict:
    inner = opt.inner_optimizer.state
    first = next(iter(model.parameters()))
    return {
        "global": {k: v.clone() for k, v in opt.global_parameters().items()},
        "params": _params(model),
        "sync": opt.sync_count,
        "step": opt.step_count,
        "sent": opt.bytes_sent_total,
        "exp_avg": inner[first]["exp_avg"].clone() if first in inner else None,
    }


def _sc_member_before(rank: int, world: int) -> dict:
    """Three workers, 7 steps (syncs at steps 2, 4, 6; step 7 is lost by a restart). The last
    worker also keeps a copy of its snapshot after sync 2: a node that missed the newest sync."""
    base = Path(os.environ["DILOCO_NODES"])
    (base / f"node{rank}").mkdir()
    model, opt = _member_opt(base / f"node{rank}")
    for s in range(7):
        _train(model, opt, range(s, s + 1), rank)
        if rank == world - 1 and opt.step_count == 4:
            (base / "stale").mkdir()
            shutil.copy(base / f"node{rank}" / "diloco-worker0.pt", base / "stale" / "diloco-worker0.pt")
    return {"state": _member_state(model, opt), "resumed": opt.resumed}


def _sc_member_after(rank: int, world: int) -> dict:
    """A restarted job: each worker's node directory from DILOCO_NODE_DIRS; resume, train 4 steps, finish."""
    dirs = os.environ["DILOCO_NODE_DIRS"].split(",")
    model, opt = _member_opt(Path(os.environ["DILOCO_NODES"]) / dirs[rank])
    start = _member_state(model, opt)
    _train(model, opt, range(opt.step_count, opt.step_count + 4), rank)
    opt.finish()
    return {"start": start, "resumed": opt.resumed, "end": _member_state(model, opt)}


SCENARIOS = {
    f.__name__[4:]: f
    for f in (
        _sc_math_sgd,
        _sc_math_nesterov,
        _sc_ef,
        _sc_resume,
        _sc_compression,
        _sc_one_collective,
        _sc_buffers,
        _sc_streaming,
        _sc_overlap_runs_in_background,
        _sc_state_check,
        _sc_fresh_start,
        _sc_blocked,
        _sc_member_before,
        _sc_member_after,
    )
}


def _entry(rank: int, world: int, store_path: str, out_dir: str, names: list[str]) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.pop("MESHRUN_JOB_DIR", None)  # no snapshots unless a scenario asks for them
    os.environ["DILOCO_TEST_DIR"] = out_dir
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        results = {name: SCENARIOS[name](rank, world) for name in names}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, names: list[str], tmp: str) -> list[dict]:
    mp.spawn(_entry, args=(world, os.path.join(tmp, "store"), tmp, names), nprocs=world, join=True)
    return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in range(world)]


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    names = [n for n in SCENARIOS if not n.startswith("member_")]
    return _spawn(2, names, str(tmp_path_factory.mktemp("w2")))


@pytest.fixture(scope="module")
def world3(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(
        3,
        ["math_sgd", "math_nesterov", "ef", "streaming", "state_check", "compression", "one_collective", "blocked"],
        str(tmp_path_factory.mktemp("w3")),
    )


@pytest.fixture(scope="module")
def membership(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """A 3-worker run with snapshots, then restarts from copies of its node directories:
    "lost": workers on node0 and on a node whose snapshot missed the newest sync (node2's copy
    after sync 2; node1 is gone); "joined": node0, node1, node2 whose snapshot of the same sync
    has one global value changed (diverged), and a new node with no snapshot."""
    tmp = tmp_path_factory.mktemp("member")
    nodes = tmp / "nodes"
    nodes.mkdir()
    saved = {k: os.environ.get(k) for k in ("DILOCO_NODES", "DILOCO_NODE_DIRS")}
    out = {}
    try:
        os.environ["DILOCO_NODES"] = str(nodes)
        out["before"] = _spawn(3, ["member_before"], str(tmp))
        for case, dirs in (("lost", ["node0", "stale"]), ("joined", ["node0", "node1", "node2", "new"])):
            copies = []
            for d in dirs:
                if (nodes / d).exists():
                    shutil.copytree(nodes / d, nodes / f"{case}-{d}")
                else:  # a new node: its job directory exists, without a snapshot
                    (nodes / f"{case}-{d}").mkdir()
                copies.append(f"{case}-{d}")
            if case == "joined":
                path = nodes / "joined-node2" / "diloco-worker0.pt"
                snap = torch.load(path, weights_only=True)
                snap["shared"][0][0, 0] += 1e-3
                torch.save(snap, path)
            os.environ["DILOCO_NODE_DIRS"] = ",".join(copies)
            (tmp / case).mkdir()
            out[case] = _spawn(len(dirs), ["member_after"], str(tmp / case))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


# --------------------------------------------------------------------------- references (no DiLoCo)
def _ref_ddp_sgd(world: int, steps: int, lr: float) -> dict[str, torch.Tensor]:
    """Synchronous data parallel SGD: one model, gradients averaged over the ranks' batches."""
    model = _mlp(0)
    for s in range(steps):
        grads = []
        for r in range(world):
            model.zero_grad()
            _loss(model, s, r).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= lr * torch.stack([g[i] for g in grads]).mean(0)
    return _params(model)


def _ref_diloco(world: int, rounds: int, h: int, lr: float, outer_lr: float, mom: float) -> dict[str, torch.Tensor]:
    """DiLoCo written out by hand: H local SGD steps per rank, averaged delta, explicit Nesterov."""
    glob = _mlp(0)
    bufs = [torch.zeros_like(p) for p in glob.parameters()]
    for rnd in range(rounds):
        deltas = []
        for r in range(world):
            local = copy.deepcopy(glob)
            for k in range(h):
                local.zero_grad()
                _loss(local, rnd * h + k, r).backward()
                with torch.no_grad():
                    for p in local.parameters():
                        p -= lr * p.grad
            deltas.append([(g - p).detach() for g, p in zip(glob.parameters(), local.parameters())])
        with torch.no_grad():
            for i, p in enumerate(glob.parameters()):
                d = torch.stack([dl[i] for dl in deltas]).mean(0)
                bufs[i] = mom * bufs[i] + d
                p -= outer_lr * (d + mom * bufs[i])
    return _params(glob)


def _ref_streaming(
    world: int,
    steps: int,
    h: int,
    fragments: list[list[str]],
    tau: int,
    alpha: float,
    lr: float,
    outer_lr: float,
    mom: float,
    finish: bool,
) -> tuple[list[dict], dict]:
    """Streaming DiLoCo written out by hand: one local model per rank; fragment f's deltas are
    taken at step t (t + tau a multiple of h / F, fragments in turn), averaged, and at t + tau the
    fragment's global copy takes an explicit Nesterov step and each rank's local copy becomes
    alpha * local + (1 - alpha) * global. finish: then every fragment syncs once, no mixing.
    Returns (each rank's local parameters, the global parameters)."""
    glob = dict(_mlp(0).named_parameters())
    glob = {k: v.detach().clone() for k, v in glob.items()}
    bufs = {k: torch.zeros_like(v) for k, v in glob.items()}
    locals_ = [_mlp(0) for _ in range(world)]
    period = h // len(fragments)

    def outer(names: list[str], deltas: dict, a: float) -> None:
        for k in names:
            bufs[k] = mom * bufs[k] + deltas[k]
            glob[k] = glob[k] - outer_lr * (deltas[k] + mom * bufs[k])
            for m in locals_:
                p = dict(m.named_parameters())[k]
                with torch.no_grad():
                    p.copy_(a * p + (1 - a) * glob[k])

    def deltas_of(names: list[str]) -> dict:
        return {
            k: torch.stack([glob[k] - dict(m.named_parameters())[k].detach() for m in locals_]).mean(0) for k in names
        }

    pending = None
    for s in range(1, steps + 1):
        for r, m in enumerate(locals_):
            m.zero_grad()
            _loss(m, s - 1, r).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= lr * p.grad
        if (s + tau) % period == 0:
            f = ((s + tau) // period - 1) % len(fragments)
            pending = (fragments[f], deltas_of(fragments[f]), s + tau)
        if pending is not None and pending[2] == s:
            outer(pending[0], pending[1], alpha)
            pending = None
    if finish:
        names = [k for frag in fragments for k in frag]
        outer(names, deltas_of(names), 0.0)
    return [_params(m) for m in locals_], glob


def _assert_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def _assert_ranks_equal(results: list[dict], scenario: str, sub: str | None = None) -> None:
    def params(res: dict) -> dict:
        return (res[scenario][sub] if sub else res[scenario])["params"]

    for res in results[1:]:
        for k, v in params(res).items():
            assert torch.equal(v, params(results[0])[k]), f"ranks disagree on {k}"


# --------------------------------------------------------------------------- 1. math
@pytest.mark.parametrize("world", [2, 3])
def test_sync_every_1_is_data_parallel_sgd(world: int, world2: list[dict], world3: list[dict]) -> None:
    results = world2 if world == 2 else world3
    _assert_ranks_equal(results, "math_sgd")
    assert results[0]["math_sgd"]["syncs"] == 6
    ref = _ref_ddp_sgd(world, steps=6, lr=0.1)
    _assert_close(results[0]["math_sgd"]["params"], ref, atol=1e-6)
    # Guard against a vacuous comparison: training moved the weights well beyond the tolerance.
    assert max((ref[k] - _params(_mlp(0))[k]).abs().max() for k in ref) > 1e-2


@pytest.mark.parametrize("world", [2, 3])
def test_outer_nesterov_matches_hand_written_diloco(world: int, world2: list[dict], world3: list[dict]) -> None:
    results = world2 if world == 2 else world3
    _assert_ranks_equal(results, "math_nesterov")
    ref = _ref_diloco(world, rounds=3, h=3, lr=0.05, outer_lr=0.7, mom=0.9)
    _assert_close(results[0]["math_nesterov"]["params"], ref, atol=1e-6)
    plain = _ref_diloco(world, rounds=3, h=3, lr=0.05, outer_lr=0.7, mom=0.0)  # momentum must matter
    assert max((ref[k] - plain[k]).abs().max() for k in ref) > 1e-3


def test_world_size_1_is_plain_sgd() -> None:
    assert not dist.is_initialized()
    model = _mlp(0)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=1, outer_lr=1.0, outer_momentum=0.0)
    _train(model, opt, range(6), rank=0)
    _assert_close(_params(model), _ref_ddp_sgd(1, steps=6, lr=0.1), atol=1e-6)
    assert (opt.world_size, opt.sync_count, opt.bytes_sent_total, opt.last_sync_bytes) == (1, 6, 0, 0)


def test_world_size_1_nesterov_matches_reference() -> None:
    model = _mlp(0)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=3, outer_lr=0.7, outer_momentum=0.9)
    _train(model, opt, range(9), rank=0)
    _assert_close(_params(model), _ref_diloco(1, rounds=3, h=3, lr=0.05, outer_lr=0.7, mom=0.9), atol=1e-6)


def test_fragments_are_balanced_whole_tensors() -> None:
    assert _balanced_fragments([128, 16, 64, 4], 2) == [[0], [1, 2, 3]]
    assert _balanced_fragments([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    assert _balanced_fragments([1, 100, 1], 3) == [[1], [0], [2]]
    model = _mlp(0)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **STREAM)
    assert opt.fragment_names == [["0.weight"], ["0.bias", "2.weight", "2.bias"]]


@pytest.mark.parametrize("world", [2, 3])
def test_streaming_matches_hand_written_reference(world: int, world2: list[dict], world3: list[dict]) -> None:
    results = world2 if world == 2 else world3
    frags = results[0]["streaming"]["stream"]["fragments"]
    ref_locals, ref_glob = _ref_streaming(
        world, steps=8, h=4, fragments=frags, tau=1, alpha=0.25, lr=0.05, outer_lr=0.7, mom=0.9, finish=False
    )
    for rank, res in enumerate(results):
        r = res["streaming"]["stream"]
        _assert_close(r["before"]["params"], ref_locals[rank], atol=1e-6)
        _assert_close(r["before"]["global"], ref_glob, atol=1e-6)
        # Launches at steps 1, 3, 5, 7 are in flight until the next step; nothing is at step 8.
        assert r["in_flight"] == [True, False] * 4
        assert r["syncs"] == 4 and r["syncs_after"] == 5
    _assert_ranks_equal(results, "streaming", "stream")  # after finish(): one global model everywhere
    _, ref_final = _ref_streaming(
        world, steps=8, h=4, fragments=frags, tau=1, alpha=0.25, lr=0.05, outer_lr=0.7, mom=0.9, finish=True
    )
    _assert_close(results[0]["streaming"]["stream"]["params"], ref_final, atol=1e-6)
    # Not vacuous: the local copies differ between ranks before finish(), and from plain DiLoCo.
    before = [res["streaming"]["stream"]["before"]["params"] for res in results]
    assert any(not torch.equal(before[0][k], before[1][k]) for k in before[0])
    plain = _ref_diloco(world, rounds=2, h=4, lr=0.05, outer_lr=0.7, mom=0.9)
    assert max((ref_final[k] - plain[k]).abs().max() for k in plain) > 1e-3


def test_streaming_one_fragment_no_overlap_is_plain_diloco(world3: list[dict]) -> None:
    ref = _ref_diloco(3, rounds=3, h=3, lr=0.05, outer_lr=0.7, mom=0.9)
    for res in world3:
        r = res["streaming"]["one"]
        _assert_close(r["params"], ref, atol=1e-6)
        assert r["syncs"] == r["syncs_after"] == 3  # the 9th step synced: finish() had nothing left
        assert r["in_flight"] == [False] * 9
    # The hand-written streaming reference agrees with the hand-written DiLoCo in this case too.
    frags = world3[0]["streaming"]["one"]["fragments"]
    _, glob = _ref_streaming(
        3, steps=9, h=3, fragments=frags, tau=0, alpha=0.0, lr=0.05, outer_lr=0.7, mom=0.9, finish=False
    )
    _assert_close(glob, ref, atol=1e-6)


def test_streaming_sends_one_fragment_per_sync(world2: list[dict]) -> None:
    r = world2[0]["streaming"]["stream"]
    f0, f1 = HID * IN, NUMEL - HID * IN  # fragment 0 is 0.weight
    per_step = [
        0,
        4 * f0,
        4 * f0,
        4 * (f0 + f1),
        4 * (f0 + f1),
        4 * (2 * f0 + f1),
        4 * (2 * f0 + f1),
        4 * (2 * f0 + 2 * f1),
    ]
    assert r["sent"] == per_step  # counted when merged: fragment 0 at step 2, 1 at step 4, ...
    assert r["total"] == per_step[-1] + 4 * NUMEL  # finish() synced both (mixing left neither clean)


def test_overlapped_sync_does_not_block_the_step(world2: list[dict]) -> None:
    for res in world2:
        assert res["overlap_runs_in_background"] == {"launched_in_flight": True, "syncs": 2}


def test_state_check_names_the_perturbed_rank(world3: list[dict]) -> None:
    for res in world3:
        errors = res["state_check"]
        for how in ("verify_state", "next_sync"):
            assert errors[how] is not None, how
            assert "rank(s) [2] disagree with rank(s) [0, 1]" in errors[how]
        assert "after sync 2" in errors["verify_state"]  # 4 steps, sync_every 2
        assert "after sync 3" in errors["next_sync"]  # the sync at step 6 carried it


def test_fresh_start_aligns_models_only_when_they_differ(world2: list[dict]) -> None:
    r0, r1 = (res["fresh_start"] for res in world2)
    assert r0["same"]["sent"] == r1["same"]["sent"] == 0
    for k, v in r0["different"]["params"].items():
        assert torch.equal(v, r1["different"]["params"][k])
        assert torch.equal(v, _params(_mlp(0, batchnorm=True))[k])  # rank 0's model won
    assert r0["different"]["sent"] > 4 * NUMEL and r1["different"]["sent"] == 0


def test_buffers_are_averaged_at_sync(world2: list[dict]) -> None:
    before = torch.stack([r["buffers"]["before"] for r in world2])
    assert not torch.equal(before[0], before[1])  # different data gave different running stats
    for r in world2:
        torch.testing.assert_close(r["buffers"]["after"], before.mean(0), atol=1e-7, rtol=0)
        assert r["buffers"]["tracked"] == 1  # integer buffers are left alone


# --------------------------------------------------------------------------- 2. error feedback
def _error_without_feedback(comp: str, world: int) -> float:
    """What the same 150 syncs lose when each worker sends CODECS[comp](x) with no error feedback."""
    err = torch.zeros(301, dtype=torch.float64)
    for t in range(150):
        for r in range(world):
            x = _eps_grad(t, r)
            err += (x - CODECS[comp].encode(x.float())[1].double()) / world
    return float(err.abs().max())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("comp", ["int8", "fp8", "fp4", "int2"])
def test_error_feedback_keeps_error_bounded(comp: str, world: int, world2: list[dict], world3: list[dict]) -> None:
    results = world2 if world == 2 else world3
    for res in results:
        r = res["ef"][comp]
        # The cumulative error is the mean of the workers' current residuals, each at most one
        # rounding error of x + feedback (|x + ef| < absmax + 1e-3): int8 half a step of absmax/127;
        # fp4 a quarter of absmax/6 for the small biased elements (grid step 0.5 below 2), and the
        # bf16 rounding of the scale (2^-8 relative) for the element at absmax. int2 clamps at
        # 1.5 RMS: one sync can hold back nearly all of the large element (up to absmax). fp8 E4M3
        # rounds to 3 mantissa bits: half a step is 2^-4 of the magnitude, at most absmax's.
        top = r["max_absmax"] + 1e-3
        bound = {
            "int8": top / 127 / 2,
            "fp8": top * 2**-4 * (1 + 2**-7),
            "fp4": top / 6 / 4 * (1 + 2**-7),
            "int2": top,
        }[comp] + 1e-5
        assert max(r["errors"]) <= bound, (max(r["errors"]), bound)
        # Not growing: the last syncs are no worse than the bound, while the bias a compressor
        # without error feedback drops has added up to far more.
        last = max(r["errors"][-50:])
        assert last <= bound
        assert r["drift"] > 0.25
        if comp != "fp8":  # fp8 resolves this bias (its rounding is unbiased): see the fp8 test below
            assert _error_without_feedback(comp, world) > 5 * last


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3 * INT8_CHUNK + 5), scale=st.floats(1e-6, 1e4), seed=st.integers(0, 2**31 - 1))
def test_int8_round_trip_error_is_at_most_half_a_step(n: int, scale: float, seed: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    q, scales = quantize_int8(x)
    assert q.dtype == torch.int8 and q.numel() == n and scales.numel() == math.ceil(n / INT8_CHUNK)
    err = (x - dequantize_int8(q, scales)).abs()
    per_elem = scales.repeat_interleave(INT8_CHUNK)[:n]
    assert bool((err <= per_elem / 2 * (1 + 1e-5)).all())
    assert int(q.abs().max()) == 127  # the chunk holding the absmax uses the full range


def test_int8_zero_chunk_round_trips_to_zero() -> None:
    q, scales = quantize_int8(torch.zeros(10))
    assert torch.equal(dequantize_int8(q, scales), torch.zeros(10))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3 * FP4_BLOCK + 5), scale=st.floats(1e-6, 1e4), seed=st.integers(0, 2**31 - 1))
def test_fp4_round_trip_error_is_at_most_half_a_grid_step(n: int, scale: float, seed: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    packed, scales = quantize_fp4(x)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 2)
    assert scales.dtype == torch.bfloat16 and scales.numel() == math.ceil(n / FP4_BLOCK)
    back = dequantize_fp4(packed, scales, n)
    s = scales.float().repeat_interleave(FP4_BLOCK)[:n]
    y = (x / s).abs()
    # E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: grid step 0.5 below 2, 1 up to 4, 2 up to 6;
    # past 6 (the bf16 scale rounded down, by at most 2^-8) values clamp to 6.
    half_step = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0)) + (y - 6).clamp(min=0)
    assert bool(((x - back).abs() <= half_step * s * (1 + 1e-5)).all())
    blocks = x.abs().max() / s.max()
    assert 6 * (1 - 2**-8) <= float(blocks) <= 6 * (1 + 2**-8)  # the absmax uses the top of the grid


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3 * INT2_BLOCK + 5), scale=st.floats(1e-6, 1e4), seed=st.integers(0, 2**31 - 1))
def test_int2_round_trip_error_is_half_a_step_inside_the_grid(n: int, scale: float, seed: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    packed, scales = quantize_int2(x)
    assert packed.numel() == math.ceil(n / 4) and scales.numel() == math.ceil(n / INT2_BLOCK)
    s = scales.float().repeat_interleave(INT2_BLOCK)[:n]
    y = (x / s).abs()
    # Grid -1.5, -0.5, 0.5, 1.5: half a step (0.5) within +-2, the clamp to 1.5 beyond.
    allowed = torch.where(y <= 2, 0.5, y - 1.5) * s * (1 + 1e-5)
    assert bool(((x - dequantize_int2(packed, scales, n)).abs() <= allowed).all())
    for b in range(scales.numel()):  # the scale is the block's RMS (bf16-rounded)
        block = x[b * INT2_BLOCK : (b + 1) * INT2_BLOCK]
        assert abs(float(scales[b]) - float(block.pow(2).mean().sqrt())) <= 2**-8 * float(block.pow(2).mean().sqrt())


def test_fp4_grid_values_round_trip_exactly_and_codec_sizes() -> None:
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    packed, scales = quantize_fp4(grid)
    assert float(scales[0]) == 1.0
    assert torch.equal(dequantize_fp4(packed, scales, grid.numel()), grid)
    for n in (1, 127, 128, 129, 1000):
        x = torch.randn(n)
        for name, codec in CODECS.items():
            payload, approx = codec.encode(x)
            assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes(n)
            assert torch.equal(codec.decode(payload, n), approx)
    assert CODECS["fp4"].payload_bytes(1000) == 500 + 2 * 8
    assert CODECS["int2"].payload_bytes(1000) == 250 + 2 * 8
    assert CODECS["int8"].payload_bytes(1000) == 1000 + 4
    for name, codec in CODECS.items():  # an all-zero vector decodes to zeros
        assert torch.equal(codec.encode(torch.zeros(300))[1], torch.zeros(300)), name


# --------------------------------------------------------------------------- 3. resume
def test_state_dict_round_trip_resumes_bit_identically(world2: list[dict]) -> None:
    for res in world2:
        r = res["resume"]
        assert r["step_b"] == 12 and r["syncs_b"] == 4
        for k in r["a"]:
            assert torch.equal(r["a"][k], r["b"][k]), f"resumed run differs on {k}"
        # Restoring only the model (fresh optimizer state) must diverge: the check can fail.
        assert any(not torch.equal(r["a"][k], r["c"][k]) for k in r["a"])


def test_load_state_dict_rejects_other_model() -> None:
    model = _mlp(0)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    other = nn.Linear(3, 3)
    other_opt = DiLoCo(other, torch.optim.SGD(other.parameters(), lr=0.1), sync_every=2)
    with pytest.raises(StateError, match="differ"):
        opt.load_state_dict(other_opt.state_dict())
    with pytest.raises(StateError, match="format"):
        opt.load_state_dict({"step": 3})


# --------------------------------------------------------------------------- 3b. membership changes
P_BN = NUMEL + 2 * HID  # parameters of _mlp(0, batchnorm=True): the MLP's plus BatchNorm's weight and bias


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"differs on {k}"


def test_lost_node_resumes_from_newest_snapshot(membership: dict[str, list[dict]]) -> None:
    before = [r["member_before"]["state"] for r in membership["before"]]
    assert [b["sync"] for b in before] == [3, 3, 3] and [b["step"] for b in before] == [7, 7, 7]
    after = [r["member_after"] for r in membership["lost"]]
    for rank, r in enumerate(after):
        # The newest sync is kept: only the inner step after it (step 7) is lost.
        assert r["resumed"] == {"sync_count": 3, "step_count": 6, "source_rank": 0, "receivers": [1]}
        assert (r["start"]["sync"], r["start"]["step"]) == (3, 6)
        _assert_same(r["start"]["global"], before[0]["global"])
        for k, v in r["start"]["global"].items():  # the model restarts from the global copy
            assert torch.equal(r["start"]["params"][k], v)
        assert r["start"]["exp_avg"] is not None  # both kept their own inner optimizer state
        assert (r["end"]["sync"], r["end"]["step"]) == (5, 10)
    _assert_same(after[0]["end"]["params"], after[1]["end"]["params"])
    # Rank 0 sent global copy + outer momentum (fp32 each) + BatchNorm's two fp32 buffers to rank 1.
    assert after[0]["start"]["sent"] == before[0]["sent"] + 4 * (2 * P_BN + 2 * HID)
    assert 3 * after[1]["start"]["sent"] == 2 * before[2]["sent"]  # the stale copy's counter: 2 of 3 syncs


def test_joined_and_diverged_nodes_receive_state_and_end_identical(membership: dict[str, list[dict]]) -> None:
    before = [r["member_before"]["state"] for r in membership["before"]]
    after = [r["member_after"] for r in membership["joined"]]
    for rank, r in enumerate(after):
        # Rank 2's snapshot is of the newest sync but differs; rank 3 has none: both receive.
        assert r["resumed"] == {"sync_count": 3, "step_count": 6, "source_rank": 0, "receivers": [2, 3]}
        _assert_same(r["start"]["global"], before[0]["global"])
        assert (r["end"]["sync"], r["end"]["step"]) == (5, 10)
    assert after[3]["start"]["exp_avg"] is None  # the joiner starts its inner optimizer fresh
    assert after[1]["start"]["sent"] == before[1]["sent"]  # node1 already held sync 3: nothing sent
    for r in after[1:]:
        _assert_same(r["end"]["params"], after[0]["end"]["params"])
        _assert_same(r["end"]["global"], after[0]["end"]["global"])


def test_world_size_1_resumes_from_its_snapshot(tmp_path: Path) -> None:
    model, opt = _member_opt(tmp_path)
    _train(model, opt, range(5), rank=0)  # syncs at 2 and 4
    glob = {k: v.clone() for k, v in opt.global_parameters().items()}
    model_b, opt_b = _member_opt(tmp_path)
    assert (opt_b.step_count, opt_b.sync_count) == (4, 2) and opt_b.resumed is None
    _assert_same(opt_b.global_parameters(), glob)
    _assert_same({k: v for k, v in model_b.named_parameters()}, glob)
    # Restarted after its last step: the end of training syncs nothing more.
    sent = opt_b.bytes_sent_total
    opt_b.finish()
    assert (opt_b.sync_count, opt_b.bytes_sent_total) == (2, sent)
    _assert_same(opt_b.global_parameters(), glob)


def test_snapshot_of_another_model_is_refused(tmp_path: Path) -> None:
    model, opt = _member_opt(tmp_path)
    _train(model, opt, range(2), rank=0)
    other = nn.Linear(3, 3)
    with pytest.raises(StateError, match="not for this model") as info:
        DiLoCo(other, torch.optim.SGD(other.parameters(), lr=0.1), sync_every=2, snapshot_dir=tmp_path)
    assert str(tmp_path / "diloco-worker0.pt") in info.value.fix
    (tmp_path / "diloco-worker0.pt").write_bytes(b"garbage")
    with pytest.raises(StateError, match="cannot read"):
        _member_opt(tmp_path)


def test_snapshot_dir_must_exist(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="is not a directory"):
        _make(_mlp(0), snapshot_dir=tmp_path / "missing")


def test_snapshot_dir_defaults_to_the_runs_directory_in_the_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `meshrun train` snapshots go to the run's directory in the project's persistent one: the job's
    restarts and its resumes (same MESHRUN_RUN_ID) find them, a new job (a new run) does not."""
    monkeypatch.setenv("MESHRUN_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("MESHRUN_RUN_ID", "train-20261126-1200-ab12")
    monkeypatch.setenv("LOCAL_RANK", "3")
    model = _mlp(0)
    run_dir = tmp_path / "diloco-snapshots" / "train-20261126-1200-ab12"
    assert _make(model).snapshot_path == run_dir / "diloco-worker3.pt"
    assert run_dir.is_dir()
    assert _make(model, snapshot_dir=None).snapshot_path is None
    monkeypatch.setenv("MESHRUN_RUN_ID", "../../etc")
    with pytest.raises(UsageError, match="MESHRUN_RUN_ID"):
        _make(model)
    monkeypatch.delenv("MESHRUN_RUN_ID")
    assert _make(model).snapshot_path is None  # not started by meshrun: no snapshots unless asked
    monkeypatch.setenv("MESHRUN_RUN_ID", "x")
    monkeypatch.delenv("MESHRUN_OUTPUT_DIR")
    assert _make(model).snapshot_path is None


def test_a_new_run_of_another_model_starts_fresh_and_only_its_own_run_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A project's second job with another model (or outer state) is not blocked by the first's snapshots; the
    first run resumed with another model is refused, the fix naming a fresh job."""
    monkeypatch.setenv("MESHRUN_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("MESHRUN_RUN_ID", "first")
    model = _mlp(0)
    opt = _make(model, sync_every=2)
    _train(model, opt, range(2), rank=0)
    assert (tmp_path / "diloco-snapshots" / "first" / "diloco-worker0.pt").exists()
    other = nn.Linear(3, 3)
    monkeypatch.setenv("MESHRUN_RUN_ID", "second")
    fresh = DiLoCo(other, torch.optim.SGD(other.parameters(), lr=0.1), sync_every=2)
    assert (fresh.step_count, fresh.sync_count) == (0, 0)
    monkeypatch.setenv("MESHRUN_RUN_ID", "first")
    with pytest.raises(StateError, match="not for this model") as info:
        DiLoCo(other, torch.optim.SGD(other.parameters(), lr=0.1), sync_every=2)
    assert "without --resume" in info.value.fix


# --------------------------------------------------------------------------- 4. compression
@pytest.mark.parametrize("world", [2, 3])
def test_every_format_ends_bit_identical_on_every_worker(world: int, world2: list[dict], world3: list[dict]) -> None:
    results = world2 if world == 2 else world3
    res = results[0]["compression"]
    assert {"fp8", "sparse-int2", "sparse-fp4", "sparse-shared"} <= set(res)
    exact, start = res["none"]["params"], _params(_mlp(0))
    for comp in res:
        # The state check compared every sync's digests (a mismatch raises); the models agree too.
        _assert_ranks_equal(results, "compression", comp)
        assert res[comp]["syncs"] == 3
        assert 0 <= res[comp]["blocked"] <= res[comp]["sync_s"]
        if comp != "sparse-shared":  # the leader of a shared sync sends its header too
            assert res[comp]["total"] == 3 * res[comp]["last"]
    for comp in ("sparse-int2", "sparse-fp4", "sparse-shared"):
        # A sparse update moves the model, only less far than the dense one in 3 syncs.
        moved = sum(float((res[comp]["params"][k] - start[k]).abs().sum()) for k in start)
        dense = sum(float((exact[k] - start[k]).abs().sum()) for k in start)
        assert 0 < moved < dense, (comp, moved, dense)
        if comp == "sparse-shared":
            continue
        codec = make_codec(comp)
        assert res[comp]["last"] == codec.payload_bytes(MATRIX_NUMEL) + codec.values.payload_bytes(VECTOR_NUMEL)
        # The biases went dense: every element moved. Of the weights, at most what 3 syncs of every worker
        # could pick (one of each 64 per sync and worker).
        for name in ("0.bias", "2.bias"):
            assert bool((res[comp]["params"][name] != start[name]).all()), (comp, name)
        weights = [(res[comp]["params"][k] != start[k]).sum().item() for k in ("0.weight", "2.weight")]
        assert 0 < sum(weights) <= 3 * world * math.ceil(MATRIX_NUMEL / 64), (comp, weights)
    sent = math.ceil(MATRIX_NUMEL / 64)  # the default density: the largest of every 64 elements
    # int2 values (4 a byte), a bf16 scale per 128 values, 6-bit positions; the biases in int2, dense
    expected = math.ceil(sent / 4) + 2 * math.ceil(sent / INT2_BLOCK) + math.ceil(sent * 6 / 8)
    expected += math.ceil(VECTOR_NUMEL / 4) + 2 * math.ceil(VECTOR_NUMEL / INT2_BLOCK)
    assert res["sparse-int2"]["last"] == expected
    assert res["sparse-int2"]["last"] < res["int2"]["last"] / 4  # 9 % of this model is biases, sent dense
    # sparse-shared: one int8 code per selected weight and per bias element from every worker; the leader of
    # sync i (rank i mod world) sends the header too: bf16 scales per 128 codes and the 6-bit positions.
    codes = sent + VECTOR_NUMEL
    header = 2 * math.ceil(codes / SHARED_BLOCK) + math.ceil(sent * 6 / 8)
    for rank, r in enumerate(results):
        led = sum(1 for i in range(3) if i % world == rank)
        shared = r["compression"]["sparse-shared"]
        assert shared["total"] == 3 * codes + led * header, (rank, shared)
        assert shared["last"] == codes + (header if 2 % world == rank else 0)
        # Every weight a shared sync moves is one the leader picked: at most one of each 64 per sync.
        weights = [(shared["params"][k] != start[k]).sum().item() for k in ("0.weight", "2.weight")]
        assert 0 < sum(weights) <= 3 * math.ceil(MATRIX_NUMEL / 64)


@pytest.mark.parametrize("world", [2, 3])
def test_a_sync_is_one_collective_for_every_bucket(world: int, world2: list[dict], world3: list[dict]) -> None:
    # The weights and the biases (sent dense) are two buckets of a sparse format: one all_gather carries both
    # (a collective each paid its framing twice). sparse-shared: the leader's broadcast, then one all_reduce.
    results = world2 if world == 2 else world3
    for r in results:
        calls = r["one_collective"]
        assert calls["sparse-int2"] == ["all_gather"] and calls["fp4"] == ["all_gather"], calls
        assert calls["sparse-shared"] == ["broadcast", "all_reduce"], calls


@pytest.mark.parametrize("world", [2, 3])
def test_a_late_worker_shows_as_time_blocked_on_the_others(world: int, world2: list[dict], world3: list[dict]) -> None:
    results = world2 if world == 2 else world3
    for rank, res in enumerate(results):
        r = res["blocked"]
        assert r["total"] >= r["last"] and r["sync_s"] >= r["last"]
        if rank < world - 1:
            assert r["last"] >= 0.3, r  # waited for the late rank's payload
        else:
            assert r["last"] < 0.3, r  # everyone else was already there


def test_fp16_bf16_int8_close_to_fp32_and_bytes(world2: list[dict]) -> None:
    res = world2[0]["compression"]
    for comp in res:
        _assert_ranks_equal(world2, "compression", comp)
    exact = res["none"]["params"]
    for comp, atol in (("fp16", 1e-4), ("bf16", 1e-3), ("int8", 1e-3), ("fp8", 5e-3), ("fp4", 2e-2), ("int2", 5e-2)):
        _assert_close(res[comp]["params"], exact, atol=atol)
        assert any(not torch.equal(res[comp]["params"][k], exact[k]) for k in exact), f"{comp} was not applied"
    assert res["none"]["last"] == 4 * NUMEL
    assert res["fp16"]["last"] == res["bf16"]["last"] == res["none"]["last"] // 2
    assert res["int8"]["last"] == NUMEL + 4 * math.ceil(NUMEL / INT8_CHUNK)
    assert res["fp4"]["last"] == math.ceil(NUMEL / 2) + 2 * math.ceil(NUMEL / FP4_BLOCK)
    assert res["int2"]["last"] == math.ceil(NUMEL / 4) + 2 * math.ceil(NUMEL / INT2_BLOCK)
    assert res["fp8"]["last"] == NUMEL + 2 * math.ceil(NUMEL / FP8_BLOCK)
    for comp in res:
        assert res[comp]["syncs"] == 3 and res[comp]["ddp"] == 6 * 4 * NUMEL
        assert comp == "sparse-shared" or res[comp]["total"] == 3 * res[comp]["last"]  # its leader sends more


def test_fp16_overflow_raises_instead_of_writing_inf() -> None:
    model = nn.Linear(2, 1)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=1, compression="fp16")
    with torch.no_grad():
        model.weight += 1e6
    with pytest.raises(UsageError, match="fp16"):
        opt.sync_now()
    assert torch.isfinite(opt.global_parameters()["weight"]).all()


# --------------------------------------------------------------------------- bad arguments
def _make(model: nn.Module | None = None, **kw: object) -> DiLoCo:
    model = model if model is not None else _mlp(0)
    kw.setdefault("inner_optimizer", torch.optim.SGD(model.parameters(), lr=0.1))
    kw.setdefault("sync_every", 4)
    return DiLoCo(model, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw, named",
    [
        ({"sync_every": 0}, "sync_every=0"),
        ({"sync_every": -3}, "sync_every=-3"),
        ({"sync_every": 2.5}, "sync_every=2.5"),
        ({"sync_every": True}, "sync_every=True"),
        ({"compression": "int4"}, "compression='int4'"),
        ({"outer_lr": 0.0}, "outer_lr=0.0"),
        ({"outer_lr": float("nan")}, "outer_lr=nan"),
        ({"outer_momentum": 1.0}, "outer_momentum=1.0"),
        ({"outer_momentum": -0.1}, "outer_momentum=-0.1"),
        ({"inner_optimizer": "adam"}, "inner_optimizer=str"),
        ({"inner_optimizer": torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)}, "not parameters of model"),
        ({"process_group": object()}, "process_group"),
        ({"fragments": 0}, "fragments=0"),
        ({"fragments": 3}, "sync_every=4 is not a multiple of fragments=3"),
        ({"fragments": 8, "sync_every": 16}, "fragments=8 is more than the 4 parameter tensors"),
        ({"fragments": 2, "overlap": 2}, "overlap=2 is not below sync_every / fragments = 2"),
        ({"overlap": -1}, "overlap=-1"),
        ({"mixing": 1.0}, "mixing=1.0"),
        ({"density": 0.0}, "density=0.0"),
        ({"density": 1.5}, "density=1.5"),
        ({"error_decay": 0.0}, "error_decay=0.0"),
        ({"error_decay": 1.01}, "error_decay=1.01"),
    ],
)
def test_bad_arguments_raise_usage_error(kw: dict, named: str) -> None:
    with pytest.raises(UsageError) as info:
        _make(**kw)
    assert named in info.value.message and info.value.fix


def test_state_dict_refused_while_a_sync_is_in_flight() -> None:
    model = _mlp(0)
    opt = _make(model, **STREAM)
    _train(model, opt, range(1), rank=0)
    assert opt.in_flight
    with pytest.raises(UsageError, match="in flight until step 2"):
        opt.state_dict()
    _train(model, opt, range(1, 2), rank=0)
    assert not opt.in_flight and opt.state_dict()["step_count"] == 2


def test_ddp_wrapped_model_is_refused() -> None:
    class FakeDDP(nn.parallel.DistributedDataParallel):
        def __init__(self, module: nn.Module) -> None:  # skip DDP's process-group setup
            nn.Module.__init__(self)
            self.module = module

    with pytest.raises(UsageError, match="DistributedDataParallel"):
        _make(model=FakeDDP(_mlp(0)))


def test_passthroughs() -> None:
    model = _mlp(0)
    opt = _make(model)
    assert opt.param_groups is opt.inner_optimizer.param_groups
    _loss(model, 0, 0).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert "compression='none'" in repr(opt)


# --------------------------------------------------------------------------- sparse error feedback, presets
def _single_errors(
    syncs: int, feedback: bool, decay: float = 1.0, comp: str = "sparse-int2", stream=None
) -> list[float]:
    """World size 1 (the same math): cumulative error of `comp` syncs of a known stream (`_eps_grad`)."""
    stream = stream or _eps_grad
    model = nn.Linear(301, 1, bias=False)
    opt = DiLoCo(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        sync_every=1,
        outer_lr=1.0,
        outer_momentum=0.0,
        compression=comp,
        error_decay=decay,
    )
    (glob,) = opt.global_parameters().values()
    exact = glob.detach().double().clone()
    errors = []
    for t in range(syncs):
        mine = stream(t, 0)
        with torch.no_grad():
            model.weight.copy_(glob - mine.view_as(glob).float())
        if not feedback:
            assert opt._error_feedback is not None
            for ef in opt._error_feedback:
                ef.zero_()
        opt.sync_now()
        exact -= mine.view_as(exact)
        errors.append(float((glob.double() - exact).abs().max()))
    return errors


def _biased(t: int, rank: int) -> torch.Tensor:
    """`_eps_grad` without its outlier: every element a bias of 0.002-0.0035 per sync."""
    x = _eps_grad(t, rank)
    x[0] = 0.002
    return x


def test_sparse_error_feedback_sends_every_element_eventually() -> None:
    # 301 elements in 5 chunks of 64, one position per chunk and sync: the 0.002-0.0035 bias of each
    # element builds up until it is the largest of its chunk (every ~64 syncs), then it is sent.
    with_ef, without = _single_errors(400, True, stream=_biased), _single_errors(400, False, stream=_biased)
    per_sync = 0.0035
    bound = 2 * 64 * per_sync  # at most ~64 syncs' worth waits, plus int2's rounding of it
    assert max(with_ef[-100:]) <= bound, max(with_ef[-100:])
    assert max(with_ef[-100:]) <= 1.2 * max(with_ef[100:300])  # not growing
    # Without feedback the unsent bias is lost for good: the error grows with every sync.
    assert without[-1] > 400 * 0.002 * 0.8 and without[-1] > 3 * max(with_ef[-100:])


def test_sparse_error_feedback_is_bounded_beside_a_hot_element() -> None:
    # Element 0 gets +-1 every sync and wins its chunk until its neighbours' carried bias outgrows it:
    # they wait longer (up to ~1 / 0.002 syncs), but they are sent, and the error stops growing there.
    with_ef, without = _single_errors(1200, True), _single_errors(1200, False)
    assert max(with_ef[-200:]) <= 1.2 * max(with_ef[600:1000]) and max(with_ef) < 2.0
    assert without[-1] > 1200 * 0.002 * 0.8 > 2 * max(with_ef)


def test_error_decay_scales_the_carried_residual() -> None:
    # beta < 1 forgets part of what was not sent (SparseLoCo's decayed accumulator): the error then grows.
    assert _single_errors(200, True, decay=0.5)[-1] > _single_errors(200, True)[-1]


def test_fp8_error_feedback_carries_what_flushes_to_zero() -> None:
    # Beside an element of 1, a bias of 2e-6 is below fp8's smallest step in that block (2^-9 / 448 of 1):
    # without feedback it is rounded away every sync; with it, it is sent once it has built up.
    def tiny(t: int, rank: int) -> torch.Tensor:
        x = torch.full((301,), 2e-6, dtype=torch.float64)
        x[0] = 1.0 if t % 2 == 0 else -1.0
        return x

    with_ef = _single_errors(150, True, comp="fp8", stream=tiny)
    without = _single_errors(150, False, comp="fp8", stream=tiny)
    assert max(with_ef) <= 2**-4 * (1 + 2**-7) and max(with_ef[-50:]) <= max(with_ef)
    small = 2**-9 / 448 * 2  # the block's subnormal step (twice, for the bf16 scale)
    assert without[-1] >= 150 * 2e-6 * 0.99 > 10 * small
    assert max(e for e in with_ef[1::2]) < 0.07  # the large element's rounding, not the lost bias


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3 * FP8_BLOCK + 5), scale=st.floats(1e-6, 1e4), seed=st.integers(0, 2**31 - 1))
def test_fp8_round_trip_error_is_within_half_a_mantissa_step(n: int, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    payload, approx = CODECS["fp8"].encode(x)
    assert payload.numel() == n + 2 * math.ceil(n / FP8_BLOCK) == CODECS["fp8"].payload_bytes(n)
    assert torch.equal(CODECS["fp8"].decode(payload, n), approx)
    blocks = torch.nn.functional.pad(x, (0, -n % FP8_BLOCK)).view(-1, FP8_BLOCK)
    absmax = blocks.abs().amax(dim=1).repeat_interleave(FP8_BLOCK)[:n]
    # 2^-4 relative above the subnormal range; below it (|x| < 2^-6 * absmax / 448) half of 2^-9 of the scale
    tol = torch.maximum(x.abs() * 2**-4, absmax / 448 * 2**-10) * (1 + 2**-7) + 1e-30
    assert bool(((approx - x).abs() <= tol).all())


def test_sparse_codec_sends_the_largest_of_each_chunk() -> None:
    x = torch.zeros(600)
    x[[3, 77, 200, 255]] = torch.tensor([5.0, -4.0, 3.0, -6.0])  # chunk 0's four largest
    x[256 + 10] = 9.0  # chunk 1
    x[512 + 87] = -6.0  # chunk 2 (88 elements: padded)
    codec = SparseCodec(CODECS["fp4"], density=4 / 256, chunk=256)
    payload, approx = codec.encode(x)
    assert (codec.k, codec.position_bits) == (4, 8) and payload.numel() == codec.payload_bytes(600)
    # values first (12 fp4 codes and a bf16 scale), then the positions, one byte each at chunk 256
    assert payload[-12:-8].tolist() == [3, 77, 200, 255] and 10 in payload[-8:-4].tolist()
    assert torch.equal(codec.decode(payload, 600), approx)
    assert set(approx.nonzero().view(-1).tolist()) == {3, 77, 200, 255, 266, 599}
    torch.testing.assert_close(approx[[3, 77, 200, 255, 266, 599]], x[[3, 77, 200, 255, 266, 599]], rtol=0.2, atol=0)


def test_sparse_default_sends_one_of_every_64_with_a_6_bit_position() -> None:
    codec = make_codec("sparse-int2")  # density 1/64
    assert (codec.chunk, codec.k, codec.position_bits) == (64, 1, 6)
    x = torch.zeros(64 * 5)  # an odd number of chunks: the values' bf16 scales must still be readable
    x[[5, 64 + 63, 128, 192 + 30, 256 + 1]] = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0])
    x[[6, 130]] = 0.5  # smaller than their chunk's largest: not sent
    payload, approx = codec.encode(x)
    # 5 int2 values (2 bytes) + one bf16 scale (2 bytes) + 5 x 6 bits of positions (4 bytes)
    assert payload.numel() == codec.payload_bytes(x.numel()) == 8
    assert set(approx.nonzero().view(-1).tolist()) == {5, 127, 128, 222, 257}
    assert torch.equal(codec.decode(payload.clone(), x.numel()), approx)
    assert make_codec("sparse-int2", 1 / 1000).position_bits == 10  # chunk 1024: the power of two nearest


@pytest.mark.parametrize("world", [1, 2, 3, 8, 18, 19, 200])
def test_shared_codes_of_every_worker_sum_without_overflow_to_their_exact_mean(world: int) -> None:
    codec = make_codec("sparse-shared")
    assert isinstance(codec, SharedSparse) and (codec.chunk, codec.k, codec.position_bits) == (64, 1, 6)
    g = torch.Generator().manual_seed(world)
    xs = [(torch.randn(64 * 7 + 5, generator=g), torch.randn(9, generator=g)) for _ in range(world)]
    xs[-1] = (xs[-1][0] * 50, xs[-1][1])  # one worker far outside the leader's range: its codes clamp
    header = codec.header(*xs[0])
    assert header.numel() == codec.header_bytes(64 * 7 + 5, 9)
    parts = [codec.contribution(header, m, v, world) for m, v in xs]
    levels, dtype = SharedSparse.levels(world), SharedSparse.code_dtype(world)
    assert dtype == (torch.int8 if world <= 18 else torch.int16) and levels >= 7
    top = torch.iinfo(dtype).max
    assert all(int(c.abs().max()) <= levels and c.dtype == dtype for c, _, _ in parts) and world * levels <= top
    summed = torch.stack([c.to(torch.int32) for c, _, _ in parts]).sum(dim=0)
    assert int(summed.abs().max()) <= top  # the all_reduce in the codes' type cannot overflow
    average = codec.average(header, summed.to(dtype), 64 * 7 + 5, world)
    mean = torch.stack([torch.cat([m, v]) for _, m, v in parts]).mean(dim=0)
    torch.testing.assert_close(average, mean, rtol=1e-6, atol=1e-7)
    # The positions are the leader's largest of each chunk, the same for every worker.
    rows = torch.nn.functional.pad(xs[0][0], (0, -xs[0][0].numel() % 64)).view(-1, 64)
    picked = set((rows.abs().argmax(dim=1) + torch.arange(rows.shape[0]) * 64).tolist())
    for _, m, _ in parts:
        assert set(m.nonzero().view(-1).tolist()) <= picked


def test_shared_grid_rounds_within_half_a_level_and_clamps_at_the_leaders_range() -> None:
    codec = SharedSparse(density=1 / 64)
    world = 3
    leader = torch.zeros(64)
    leader[10] = 1.0  # the leader's only large element: the grid spans +-SHARED_CLIP
    other = torch.zeros(64)
    other[10] = 0.3
    big = torch.zeros(64)
    big[10] = 5.0
    header = codec.header(leader, torch.zeros(0))
    step = SHARED_CLIP / SharedSparse.levels(world)
    _, sent, _ = codec.contribution(header, other, torch.zeros(0), world)
    assert set(sent.nonzero().view(-1).tolist()) == {10} and abs(float(sent[10]) - 0.3) <= step / 2
    _, clamped, _ = codec.contribution(header, big, torch.zeros(0), world)
    assert float(clamped[10]) == pytest.approx(SHARED_CLIP)  # the rest (3.0) stays in the error feedback


def test_shared_error_feedback_is_bounded_beside_a_hot_element() -> None:
    # As sparse-int2's (world size 1: the worker leads every sync): the neighbours of a hot element are sent
    # once their carried bias outgrows it, and the error stops growing.
    with_ef, without = (
        _single_errors(2400, True, comp="sparse-shared"),
        _single_errors(2400, False, comp="sparse-shared"),
    )
    assert max(with_ef[-400:]) <= 1.2 * max(with_ef[1200:2000]) and max(with_ef) < 2.0
    assert without[-1] > 2400 * 0.002 * 0.8 > 2 * max(with_ef)


def test_a_diverged_worker_stops_a_shared_sync_naming_why() -> None:
    model = nn.Linear(2, 1)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=1, compression="sparse-shared")
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    with pytest.raises(UsageError, match="not finite") as info:
        opt.sync_now()
    assert "diverged" in info.value.fix and torch.isfinite(opt.global_parameters()["weight"]).all()


def test_shared_format_is_refused_with_sites() -> None:
    class FakeSites:  # only .hierarchical is read before the refusal
        hierarchical = True
        layout = None

    with pytest.raises(UsageError, match="sparse-shared") as info:
        _make(compression="sparse-shared", sites=FakeSites())
    assert "sparse-int2" in info.value.fix


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 16), n=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_packed_positions_round_trip(bits: int, n: int, seed: int) -> None:
    values = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(seed))
    packed = pack_bits(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, n), values)


def test_preset_bytes_per_parameter_match_the_codecs() -> None:
    n = 1 << 20
    for name, p in presets.PRESETS.items():
        codec = make_codec(p.compression, p.density or 1 / 64)
        actual = codec.payload_bytes(n) / n if codec is not None else {"none": 4, "bf16": 2, "fp16": 2}[p.compression]
        assert abs(p.payload_per_param() - actual) < 2e-3 * actual, (name, p.payload_per_param(), actual)


def test_the_jobs_preset_fills_what_the_script_leaves_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    preset = presets.Preset("high", 8, 2, "sparse-int2", 1 / 32, outer_lr=1.0, outer_momentum=0.0, error_decay=0.95)
    for var, value in preset.env().items():
        monkeypatch.setenv(var, value)
    model = _mlp(0)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert (opt.sync_every, opt.fragments, opt.compression, opt.density) == (8, 2, "sparse-int2", 1 / 32)
    assert (opt.outer_lr, opt.outer_momentum, opt.error_decay) == (1.0, 0.0, 0.95)
    assert opt.preset == "high"
    explicit = DiLoCo(
        model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4, compression="fp4", outer_momentum=0.5
    )
    assert (explicit.sync_every, explicit.fragments, explicit.compression) == (4, 2, "fp4")
    assert (explicit.outer_lr, explicit.outer_momentum) == (1.0, 0.5)
    monkeypatch.setenv(presets.ENV_OUTER_MOMENTUM, "1.5")
    with pytest.raises(UsageError, match=r"MESHRUN_DILOCO_OUTER_MOMENTUM='1.5' is not in \[0, 1\)"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1))
    monkeypatch.delenv(presets.ENV_OUTER_MOMENTUM)
    monkeypatch.setenv(presets.ENV_COMPRESSION, "int4")
    with pytest.raises(UsageError, match="MESHRUN_DILOCO_COMPRESSION='int4' is not a DiLoCo compression"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1))
    monkeypatch.setenv(presets.ENV_COMPRESSION, "fp4")
    monkeypatch.setenv(presets.ENV_SYNC_EVERY, "ten")
    with pytest.raises(UsageError, match="MESHRUN_DILOCO_SYNC_EVERY='ten'"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_without_a_preset_auto_means_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (presets.ENV_SYNC_EVERY, presets.ENV_FRAGMENTS, presets.ENV_COMPRESSION, presets.ENV_DENSITY):
        monkeypatch.delenv(var, raising=False)
    for var in (presets.ENV_OUTER_LR, presets.ENV_OUTER_MOMENTUM, presets.ENV_ERROR_DECAY):
        monkeypatch.delenv(var, raising=False)
    model = _mlp(0)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=AUTO)
    assert (opt.sync_every, opt.fragments, opt.compression, opt.preset) == (100, 1, "none", "")
    assert (opt.outer_lr, opt.outer_momentum, opt.error_decay) == (0.7, 0.9, 1.0)
