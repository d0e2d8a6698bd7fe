"""Tests for meshrun.train.demo: the DCT, the decoupled momentum (what is sent leaves the local momentum),
the update, the byte counts, and a 3-process gloo group where replicas stay bit-identical and the loss falls."""

from __future__ import annotations

import datetime
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from meshrun.errors import StateError, UsageError
from meshrun.train.compress import dct_matrix
from meshrun.train.demo import DeMo
from meshrun.train.snapshots import state_digest


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def _data(rank: int, n: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own samples of one regression problem."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, 8, generator=g)
    return x, 2 * x[:, :1] + torch.sin(3 * x[:, 1:2]) - x[:, 2:3] * x[:, 3:4]


def _eval_loss(model: nn.Module) -> float:
    x, y = _data(99, 512)  # the same held-out samples for every rank
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


# --------------------------------------------------------------------------- single process
def test_dct_matrix_is_orthonormal_and_separates_cosines() -> None:
    for n in (2, 7, 64, 256):
        d = dct_matrix(n, dtype=torch.float64)
        torch.testing.assert_close(d @ d.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    n, k = 64, 5
    i = torch.arange(n, dtype=torch.float64)
    coeffs = dct_matrix(n, dtype=torch.float64) @ torch.cos(math.pi * (2 * i + 1) * k / (2 * n))
    assert int(coeffs.abs().argmax()) == k and float(coeffs.abs().sort().values[-2]) < 1e-9
    assert torch.equal(dct_matrix(16), dct_matrix(16))  # the same bits every time


def test_what_is_sent_leaves_the_momentum_and_the_rest_stays() -> None:
    model = nn.Linear(64, 2, bias=False)  # 128 elements: 2 chunks of 64
    opt = DeMo(model.parameters(), lr=0.1, momentum_decay=0.9, density=4 / 64, compression="none", sign=False)
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(2, 64, generator=g)
    model.weight.grad = grad.clone()
    before = model.weight.detach().clone()
    opt.step()
    m = opt.state[model.weight]["delta"]
    d = dct_matrix(64)
    full = (0.1 * grad) @ d.T  # the momentum's DCT before selection: 0.9 * 0 + lr * grad
    top = full.abs().topk(4, dim=1).indices
    sent = torch.zeros_like(full).scatter_(1, top, full.gather(1, top))
    # The momentum keeps exactly what was not sent: its sent coefficients are now zero.
    torch.testing.assert_close(m @ d.T, full - sent, atol=1e-6, rtol=0)
    assert float((m @ d.T).gather(1, top).abs().max()) < 1e-6
    # World size 1, sign=False: the update is the sent part, taken back to parameter space.
    torch.testing.assert_close(model.weight.detach(), before - 0.1 * (sent @ d), atol=1e-6, rtol=0)
    # Second step, no new gradient: the momentum decays, and its next-largest components go out.
    model.weight.grad = None
    opt.step()
    assert float((opt.state[model.weight]["delta"] @ d.T).abs().max()) < float((full - sent).abs().max())


def test_signum_update_and_weight_decay() -> None:
    model = nn.Linear(64, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = DeMo(model.parameters(), lr=0.01, weight_decay=0.5, compression="bf16")
    grad = torch.linspace(-1, 1, 64).view(1, 64)  # no zero: every weight has a direction
    model.weight.grad = grad.clone()
    opt.step()
    delta = 1.0 * (1 - 0.01 * 0.5) - model.weight.detach()  # what the signum step moved, after decay
    # Every weight moved by exactly lr, against its gradient (delta = decayed - new, so its sign is the gradient's).
    assert torch.equal(delta.sign(), grad.sign())
    assert torch.allclose(delta.abs(), torch.full_like(delta, 0.01), atol=1e-6)


def test_bytes_per_step_are_positions_and_values() -> None:
    model = nn.Linear(100, 10)  # weight 1000 elements (16 chunks of 64), bias 10 (1 chunk)
    for comp, value_bytes in (("none", lambda n: 4 * n), ("bf16", lambda n: 2 * n), ("int2", None), ("fp8", None)):
        opt = DeMo(model.parameters(), density=1 / 32, compression=comp)
        sent = (16 + 1) * 2
        positions = math.ceil(sent * 6 / 8)  # 6 bits each in a chunk of 64, packed
        expected = positions + (value_bytes(sent) if value_bytes else opt._values.payload_bytes(sent))
        assert opt.payload_bytes_per_step == expected
    opt = DeMo(model.parameters(), density=1 / 32, compression="int2")
    assert opt.payload_bytes_per_step == 26 + math.ceil(34 / 4) + 2 and opt.ddp_equivalent_bytes == 0
    assert 4 * opt.numel / opt.payload_bytes_per_step > 100  # int2 values: ~110-125x fewer bytes than DDP


@pytest.mark.parametrize(
    "kw, named",
    [
        ({"lr": 0}, "lr=0"),
        ({"momentum_decay": 1.0}, "momentum_decay=1.0"),
        ({"density": 0}, "density=0"),
        ({"chunk": 300}, "chunk=300"),
        ({"chunk": 1}, "chunk=1"),
        ({"compression": "int4"}, "compression='int4'"),
        ({"weight_decay": -1}, "weight_decay=-1"),
        ({"check_every": -1}, "check_every=-1"),
        ({"process_group": object()}, "process_group"),
    ],
)
def test_bad_arguments_raise_usage_error(kw: dict, named: str) -> None:
    with pytest.raises(UsageError) as info:
        DeMo(nn.Linear(2, 2).parameters(), **kw)
    assert named in info.value.message and info.value.fix


# --------------------------------------------------------------------------- a 3-process gloo group
STEPS = 80


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        model = _model(seed=rank)  # different starts: construction aligns them to rank 0's
        opt = DeMo(model.parameters(), lr=1e-2, compression="int2", check_every=20)
        start_digest = state_digest(list(model.parameters()))
        x, y = _data(rank)
        first = _eval_loss(model)
        for _ in range(STEPS):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()  # the digests are compared every 20 steps: a mismatch would raise here
            opt.zero_grad()
        result = {
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "start_digest": start_digest,
            "first": first,
            "last": _eval_loss(model),
            "bytes": opt.bytes_sent_total,
            "per_step": opt.payload_bytes_per_step,
            "last_step": opt.last_step_bytes,
            "ddp": opt.ddp_equivalent_bytes,
            "blocked": opt.comm_blocked_s,
        }
        # A replica changed behind the optimizer's back is named by the next check.
        if rank == world - 1:
            with torch.no_grad():
                next(model.parameters())[0, 0] += 1e-3
        try:
            opt.verify_state()
            result["diverged"] = None
        except StateError as exc:
            result["diverged"] = exc.message
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world3(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("demo3"))
    mp.spawn(_worker, args=(3, os.path.join(tmp, "store"), tmp), nprocs=3, join=True)
    return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in range(3)]


def test_replicas_stay_bit_identical_and_the_loss_falls(world3: list[dict]) -> None:
    assert len({r["start_digest"] for r in world3}) == 1  # aligned at construction
    for res in world3[1:]:
        for k, v in res["params"].items():
            assert torch.equal(v, world3[0]["params"][k]), f"replicas differ on {k}"
    for res in world3:
        assert res["last"] < 0.3 * res["first"], (res["first"], res["last"])


def test_each_step_sends_its_payload_and_far_less_than_ddp(world3: list[dict]) -> None:
    numel = sum(v.numel() for v in world3[0]["params"].values())
    for rank, res in enumerate(world3):
        assert res["last_step"] == res["per_step"]
        aligned = sum(v.numel() * 4 * 2 for v in world3[0]["params"].values()) if rank == 0 else 0
        assert res["bytes"] == STEPS * res["per_step"] + aligned  # rank 0 broadcast its start to 2 others
        assert res["ddp"] == STEPS * 4 * numel and res["ddp"] > 25 * STEPS * res["per_step"]
        assert res["blocked"] >= 0


def test_a_diverged_replica_is_named_on_every_rank(world3: list[dict]) -> None:
    for res in world3:
        assert res["diverged"] and "rank(s) [2] disagree with rank(s) [0, 1]" in res["diverged"]
