"""Tests for meshrun.train.diloco: exact math against references, int8 error feedback, resume, compression.

Multi-worker checks spawn 2 and 3 CPU processes with a gloo group (FileStore rendezvous, loopback).
Each spawn runs a suite of scenarios once (module-scoped fixture) to keep the file fast on 2 cores.
"""

from __future__ import annotations

import copy
import datetime
import io
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from meshrun.train.diloco import INT8_CHUNK, DiLoCo, dequantize_int8, quantize_int8
from meshrun.errors import StateError, UsageError

IN, HID, OUT = 8, 16, 4
NUMEL = IN * HID + HID + HID * OUT + OUT  # parameters of _mlp()


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
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=1,
                 outer_lr=1.0, outer_momentum=0.0, compression="none")
    _train(model, opt, range(6), rank)
    return {"params": _params(model), "syncs": opt.sync_count}


def _sc_math_nesterov(rank: int, world: int) -> dict:
    model = _mlp(0)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=3,
                 outer_lr=0.7, outer_momentum=0.9, compression="none")
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


def _sc_int8_ef(rank: int, world: int) -> dict:
    model = nn.Linear(301, 1, bias=False)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.0), sync_every=1,
                 outer_lr=1.0, outer_momentum=0.0, compression="int8")
    (glob,) = opt.global_parameters().values()
    exact = glob.detach().double().clone()
    start = exact.clone()
    errors, scales = [], []
    for t in range(150):
        mine = _eps_grad(t, rank)
        with torch.no_grad():  # make the local model differ from the global copy by exactly `mine`
            model.weight.copy_(glob - mine.view_as(glob).float())
        scales.append(float((mine.abs().max() + 1e-3) / 127))  # |x + ef| <= 1 + scale/2 < 1 + 1e-3
        opt.sync_now()
        exact -= torch.stack([_eps_grad(t, r) for r in range(world)]).mean(0).view_as(exact)
        errors.append(float((glob.double() - exact).abs().max()))
    drift = float((exact - start).abs()[0, 1:].min())  # what the biased elements moved in total
    return {"errors": errors, "max_scale": max(scales), "drift": drift}


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
    return {"a": a, "b": _params(model_b), "c": _params(model_c),
            "step_b": opt_b.step_count, "syncs_b": opt_b.sync_count}


def _sc_compression(rank: int, world: int) -> dict:
    out = {}
    for comp in ("none", "fp16", "bf16", "int8"):
        model = _mlp(0)
        opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=2,
                     outer_lr=0.7, outer_momentum=0.9, compression=comp)
        _train(model, opt, range(6), rank)
        out[comp] = {"params": _params(model), "last": opt.last_sync_bytes,
                     "total": opt.bytes_sent_total, "syncs": opt.sync_count, "ddp": opt.ddp_equivalent_bytes}
    return out


def _sc_buffers(rank: int, world: int) -> dict:
    model = _mlp(0, batchnorm=True)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=1, compression="none")
    bn = model[1]
    _loss(model, 0, rank).backward()
    before = bn.running_mean.clone()
    opt.step()
    return {"before": before, "after": bn.running_mean.clone(), "tracked": int(bn.num_batches_tracked)}


SCENARIOS = {f.__name__[4:]: f for f in (_sc_math_sgd, _sc_math_nesterov, _sc_int8_ef, _sc_resume,
                                         _sc_compression, _sc_buffers)}


def _entry(rank: int, world: int, store_path: str, out_dir: str, names: list[str]) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
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
    return _spawn(2, list(SCENARIOS), str(tmp_path_factory.mktemp("w2")))


@pytest.fixture(scope="module")
def world3(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(3, ["math_sgd", "math_nesterov", "int8_ef"], str(tmp_path_factory.mktemp("w3")))


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
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=1,
                 outer_lr=1.0, outer_momentum=0.0)
    _train(model, opt, range(6), rank=0)
    _assert_close(_params(model), _ref_ddp_sgd(1, steps=6, lr=0.1), atol=1e-6)
    assert (opt.world_size, opt.sync_count, opt.bytes_sent_total, opt.last_sync_bytes) == (1, 6, 0, 0)


def test_world_size_1_nesterov_matches_reference() -> None:
    model = _mlp(0)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=3, outer_lr=0.7, outer_momentum=0.9)
    _train(model, opt, range(9), rank=0)
    _assert_close(_params(model), _ref_diloco(1, rounds=3, h=3, lr=0.05, outer_lr=0.7, mom=0.9), atol=1e-6)


def test_buffers_are_averaged_at_sync(world2: list[dict]) -> None:
    before = torch.stack([r["buffers"]["before"] for r in world2])
    assert not torch.equal(before[0], before[1])  # different data gave different running stats
    for r in world2:
        torch.testing.assert_close(r["buffers"]["after"], before.mean(0), atol=1e-7, rtol=0)
        assert r["buffers"]["tracked"] == 1  # integer buffers are left alone


# --------------------------------------------------------------------------- 2. int8 error feedback
@pytest.mark.parametrize("world", [2, 3])
def test_int8_error_feedback_keeps_error_bounded(world: int, world2: list[dict], world3: list[dict]) -> None:
    results = world2 if world == 2 else world3
    for res in results:
        r = res["int8_ef"]
        bound = r["max_scale"] / 2 + 1e-5  # |sum of errors| = |mean of current residuals| <= scale/2
        assert max(r["errors"]) <= bound, (max(r["errors"]), bound)
        # Not growing: the last syncs are no worse than the bound, while the bias a compressor
        # without error feedback would drop has added up to far more than the bound.
        assert max(r["errors"][-50:]) <= bound
        assert r["drift"] > 0.25 > 50 * bound


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


# --------------------------------------------------------------------------- 4. compression
def test_fp16_bf16_int8_close_to_fp32_and_bytes(world2: list[dict]) -> None:
    res = world2[0]["compression"]
    for comp in res:
        _assert_ranks_equal(world2, "compression", comp)
    exact = res["none"]["params"]
    for comp, atol in (("fp16", 1e-4), ("bf16", 1e-3), ("int8", 1e-3)):
        _assert_close(res[comp]["params"], exact, atol=atol)
        assert any(not torch.equal(res[comp]["params"][k], exact[k]) for k in exact), f"{comp} was not applied"
    assert res["none"]["last"] == 4 * NUMEL
    assert res["fp16"]["last"] == res["bf16"]["last"] == res["none"]["last"] // 2
    assert res["int8"]["last"] == NUMEL + 4 * math.ceil(NUMEL / INT8_CHUNK)
    for comp in res:
        assert res[comp]["syncs"] == 3 and res[comp]["total"] == 3 * res[comp]["last"]
        assert res[comp]["ddp"] == 6 * 4 * NUMEL


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


@pytest.mark.parametrize("kw, named", [
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
])
def test_bad_arguments_raise_usage_error(kw: dict, named: str) -> None:
    with pytest.raises(UsageError) as info:
        _make(**kw)
    assert named in info.value.message and info.value.fix


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
