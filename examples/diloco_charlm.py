#!/usr/bin/env python
"""Train a tiny character-level GRU language model with DiLoCo, DeMo, or a DDP / no-communication baseline.

Run alone (world size 1, no process group):
    python examples/diloco_charlm.py --steps 200
Run with several workers (each trains on its own shard of the corpus):
    torchrun --standalone --nproc-per-node 3 examples/diloco_charlm.py --steps 200 --mode diloco
    torchrun --standalone --nproc-per-node 3 examples/diloco_charlm.py --steps 200 --mode diloco \
        --sync-every 50 --fragments 2 --compression fp4          # Streaming DiLoCo, 4-bit
    torchrun --standalone --nproc-per-node 3 examples/diloco_charlm.py --steps 200 --mode ddp
    torchrun --standalone --nproc-per-node 3 examples/diloco_charlm.py --steps 200 --mode local
    torchrun --standalone --nproc-per-node 3 examples/diloco_charlm.py --steps 200 --mode diloco \
        --compression sparse-int2 --sync-every 20 --outer-lr 1 --outer-momentum 0 --error-decay 0.95   # SparseLoCo
    torchrun --standalone --nproc-per-node 3 examples/diloco_charlm.py --steps 200 --mode demo --lr 1e-3
Under `meshrun train --compression auto|none|low|medium|high` leave --sync-every, --fragments,
--compression, --density, --outer-lr, --outer-momentum and --error-decay out: DiLoCo then takes the job's
preset (MESHRUN_DILOCO_*).
Over meshrun (`meshrun train diloco_charlm.py ...`, elastic with `--nnodes MIN:MAX`) the same script
resumes by itself after torchrun restarts the workers: DiLoCo recovers the newest synced state
(node-local snapshots under $MESHRUN_OUTPUT_DIR/diloco-snapshots, a joiner gets it from a peer), and the loop goes on
from that step with the data re-sharded for the new rank and world size.

Choosing the options from the bandwidth `meshrun bench` measured (B bytes/s, the slowest pair's
all-reduce bus bandwidth), N parameters, n workers, T seconds per step (docs/diloco.md has the
details): one sync takes about w * N / B, with w = 1.03 (fp4), 0.53 (int2) or 2.67 (fp16) bytes
per parameter at n = 3; pick --compression first (fp4 lost nothing against fp16 on
benchmarks/diloco_wan.py), then the largest --sync-every the loss allows (there: 50 for 200
steps; 100 cost 9-12 %) with w * N / B under 5 % of --sync-every * T, and --fragments F >= w * N
/ (B * T) (F divides --sync-every) when one sync should hide behind one step of training.

--mode local is the same workers with no communication at all (each trains alone on its shard;
the process group exists only for the rendezvous): the wall-time floor DiLoCo is compared with.
--mode demo is data parallelism with meshrun.train.demo.DeMo in place of DDP's all-reduce (--lr is
its signum step; --demo-compression, --demo-density).

The corpus is split three ways: the first 80 % trains, the next 10 % is the *tuning* split (choose
hyperparameters on tune_loss) and the last 10 % the *test* split, never tuned on (test_loss, also
printed as val_loss). ``--eval tune`` reads the tuning split only: the test split is then not even loaded
(what a tuning run must do; val_loss is then the tuning loss).

Two corpora and two models:

- ``--data PATH`` (default: examples/data/tiny_corpus.txt, 180 KB of templated text): character ids, random
  windows (a worker sees its shard many times over), ``--model gru``: the quick smoke-test task.
- ``--data stdlib``: the Python standard library's own source, from the interpreter that runs the script
  (every machine that has Python has it: about 31 MB of .py files in 3.11), byte tokens (vocabulary 256).
  Each file goes to one split by a hash of its path (80 / 10 / 10: no file is in two splits), and every
  worker reads its shard of the training split *once*, in an order the seed picks: a token is never trained
  on twice by a worker, so nothing can be memorised. A run that would need more windows than its shard has
  stops before training with the numbers. With ``--model transformer`` (a small decoder-only, pre-norm
  transformer: ``--hidden`` wide, ``--layers`` blocks, ``--heads`` heads) this is the task
  benchmarks/diloco_wan.py measures.

``--schedule constant|cosine`` with ``--warmup W``: the inner learning rate rises linearly over the first W
steps, then stays (constant) or follows a cosine to 10 % of ``--lr`` at ``--steps`` (cosine); DDP, the
local baseline, DiLoCo's inner optimizer and DeMo alike.

Rank 0 prints one line per sync (diloco) or per --sync-every steps (ddp, local):
    outer_step 3 step=150 train_loss=0.4321 bytes_sent=123456
    train step=150 train_loss=0.4321 bytes_sent=123456
(train_loss: rank 0's mean over the steps since the previous line; no collective), a line when it
resumed (every rank: ``resumed rank=1 world_size=3 sync=3 step=150 source_rank=0 received=yes``), every rank
``param_checksum rank=R sync=N digest=HEX`` at the end (a 64-bit digest of the final global
parameters: equal on every worker), and rank 0, at the end (stable, key=value, parseable):
    final val_loss=1.9876 bytes_sent=123456 tune_loss=1.9901 test_loss=1.9876 wall_s=12.3 mode=diloco ...
bytes_sent is the payload this worker contributed to collectives: for DiLoCo and DeMo their counters;
for DDP 4 bytes * parameters * steps (its fp32 gradient all-reduce). comm_blocked_s is the time
rank 0 waited on sync collectives (DiLoCo, DeMo), sync_s its time in DiLoCo's sync code. The
losses are on the held-out splits, with the synchronized (global) model.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

try:
    from meshrun.train.demo import VALUE_FORMATS, DeMo
    from meshrun.train.diloco import AUTO, COMPRESSIONS, DiLoCo, default_backend, state_digest
except ImportError:  # run from a checkout without installing meshrun
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from meshrun.train.demo import VALUE_FORMATS, DeMo
    from meshrun.train.diloco import AUTO, COMPRESSIONS, DiLoCo, default_backend, state_digest

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"
STDLIB = "stdlib"  # --data stdlib: the running interpreter's standard library source, byte tokens
SPLITS = ("train", "tune", "test")
COSINE_FLOOR = 0.1  # a cosine schedule ends at this share of --lr


class CharGRU(nn.Module):
    """Embedding -> 2-layer GRU -> linear head over the character vocabulary."""

    def __init__(self, vocab: int, embed: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.gru = nn.GRU(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.embed(x))
        return self.head(out)


class ByteTransformer(nn.Module):
    """Decoder-only transformer: token and learned position embeddings, pre-norm causal blocks, a linear head."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        # An encoder stack with a causal mask is a decoder-only model (no cross-attention to drop).
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.tokens(x) + self.positions.weight[:n]
        # Made per call, not kept as a buffer: DiLoCo averages a model's floating-point buffers at every sync.
        causal = nn.Transformer.generate_square_subsequent_mask(n, device=x.device)
        h = self.blocks(h, mask=causal, is_causal=True)
        return self.head(self.norm(h))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["diloco", "ddp", "local", "demo"], default="diloco")
    p.add_argument("--steps", type=int, default=300, help="inner (optimizer) steps per worker")
    p.add_argument(
        "--sync-every",
        type=int,
        default=None,
        help="DiLoCo H: inner steps between two syncs of a fragment [the job's preset, else 100]; "
        "the log interval of ddp/local/demo [20]",
    )
    p.add_argument("--compression", choices=COMPRESSIONS, default=None, help="[the job's preset, else none]")
    p.add_argument("--fragments", type=int, default=None, help="Streaming DiLoCo fragments [the job's preset, else 1]")
    p.add_argument(
        "--density", type=float, default=None, help="sparse formats' share of each chunk [the job's preset, else 1/64]"
    )
    p.add_argument(
        "--error-decay",
        type=float,
        default=None,
        help="DiLoCo error feedback decay (SparseLoCo: 0.95) [the job's preset, else 1]",
    )
    p.add_argument("--demo-compression", choices=VALUE_FORMATS, default="int2", help="DeMo's value format")
    p.add_argument("--demo-density", type=float, default=1 / 32, help="DeMo's share of each 64-element chunk")
    p.add_argument("--demo-decay", type=float, default=0.999, help="DeMo's momentum decay")
    p.add_argument(
        "--overlap", type=int, default=None, help="inner steps a fragment's sync overlaps [DiLoCo's default]"
    )
    p.add_argument("--mixing", type=float, default=0.0, help="local weight when merging a fragment")
    p.add_argument("--no-check-state", action="store_true", help="skip the digest comparison after each sync")
    p.add_argument("--outer-lr", type=float, default=None, help="[the job's preset, else 0.7]")
    p.add_argument("--outer-momentum", type=float, default=None, help="[the job's preset, else 0.9]")
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per worker per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--model", choices=["gru", "transformer"], default="gru")
    p.add_argument("--hidden", type=int, default=128, help="GRU width, or the transformer's model width")
    p.add_argument("--layers", type=int, default=2, help="GRU layers, or transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="transformer attention heads (divides --hidden)")
    p.add_argument(
        "--eval",
        default="tune,test",
        help="held-out splits to evaluate at the end, comma-separated: tune, test [tune,test]; "
        "a split not named is not loaded",
    )
    p.add_argument("--schedule", choices=["constant", "cosine"], default="constant", help="inner lr schedule")
    p.add_argument("--warmup", type=int, default=0, help="inner steps of linear lr warm-up [0]")
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads per worker [0: the node's cores / its local workers]; set it when "
        "several nodes share one machine (e.g. the namespace testbed)",
    )
    p.add_argument(
        "--data", default=str(DEFAULT_DATA), help=f"a UTF-8 text file, or '{STDLIB}' [examples/data/tiny_corpus.txt]"
    )
    p.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="pad every inner step to at least this many seconds, to stand in for a GPU step on a "
        "CPU-only testbed [0: no padding]",
    )
    args = p.parse_args(argv)
    for name in (
        "steps",
        "sync_every",
        "fragments",
        "batch_size",
        "seq_len",
        "hidden",
        "layers",
        "heads",
        "val_batches",
    ):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.threads < 0:
        p.error(f"--threads={args.threads} must be 0 (automatic) or more")
    if args.step_time < 0:
        p.error(f"--step-time={args.step_time} must be 0 (no padding) or more")
    if args.warmup < 0:
        p.error(f"--warmup={args.warmup} must be 0 (none) or more steps")
    if args.model == "transformer" and args.hidden % args.heads:
        p.error(f"--heads={args.heads} must divide --hidden={args.hidden}")
    args.eval = [x.strip() for x in args.eval.split(",") if x.strip()]
    bad = [x for x in args.eval if x not in SPLITS[1:]]
    if bad or not args.eval:
        p.error(f"--eval={','.join(args.eval) or '(empty)'}: name one or both of tune, test")
    if args.data != STDLIB:
        args.data = Path(args.data)
        if not args.data.is_file():
            p.error(f"--data={args.data}: no such file; give a UTF-8 text file or '{STDLIB}'")
    return args


def lr_at(step: int, base: float, warmup: int, total: int, schedule: str) -> float:
    """The inner learning rate of 1-based ``step``: linear warm-up over ``warmup`` steps, then ``base`` (constant)
    or a cosine from ``base`` at the warm-up's end to COSINE_FLOOR * ``base`` at ``total``."""
    scale = min(1.0, step / warmup) if warmup else 1.0
    if schedule == "cosine":
        done = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
        scale *= COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * done))
    return base * scale


def stdlib_split(relpath: str) -> str:
    """The split of a standard-library file, by a hash of its path: train 80 %, tune 10 %, test 10 %."""
    bucket = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:4], "big") % 10
    return "train" if bucket < 8 else "tune" if bucket == 8 else "test"


def stdlib_files() -> list[tuple[str, Path]]:
    """(path relative to the stdlib, path) of every .py file of the running interpreter's standard library, sorted
    (installed packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] not in ("site-packages", "dist-packages"):
            found.append((rel.as_posix(), path))
    return sorted(found)


def load_corpus(data: Path | str, splits: tuple[str, ...] = SPLITS) -> tuple[dict[str, torch.Tensor], int]:
    """The corpus's ``splits`` as token ids, and the vocabulary size; a split not asked for is not read.

    A text file: character ids, cut 80 / 10 / 10 in order. ``STDLIB``: byte ids (uint8), files split by
    ``stdlib_split``, concatenated in path order with a NUL byte between files.
    """
    if data == STDLIB:
        parts: dict[str, list[bytes]] = {s: [] for s in splits}
        for rel, path in stdlib_files():
            split = stdlib_split(rel)
            if split in parts:
                parts[split].append(path.read_bytes())
        return {s: torch.frombuffer(bytearray(b"\0".join(parts[s])), dtype=torch.uint8) for s in splits}, 256
    text = Path(data).read_text(encoding="utf-8")
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    a, b = int(len(ids) * 0.8), int(len(ids) * 0.9)
    cut = {"train": ids[:a], "tune": ids[a:b], "test": ids[b:]}
    return {s: cut[s] for s in splits}, len(vocab)


def batches(shard: torch.Tensor, batch: int, seq: int, gen: torch.Generator, device: torch.device):
    """Endless random windows from this worker's shard: (inputs, next-character targets)."""
    while True:
        starts = torch.randint(0, len(shard) - seq - 1, (batch,), generator=gen)
        window = torch.stack([shard[s : s + seq + 1] for s in starts.tolist()]).to(device)
        yield window[:, :-1], window[:, 1:]


def windows(shard: torch.Tensor, seq: int) -> int:
    """How many disjoint ``seq``-token windows (each with its next-token targets) ``shard`` holds."""
    return max(0, (len(shard) - 1) // seq)


def single_pass(shard: torch.Tensor, batch: int, seq: int, gen: torch.Generator, device: torch.device, skip: int):
    """This worker's shard once, as disjoint windows in an order ``gen`` draws: every target token is trained on at
    most once. Starts after ``skip`` batches (a resumed worker does not replay them); ends when the shard does."""
    order = torch.randperm(windows(shard, seq), generator=gen)
    for first in range(skip * batch, len(order) - batch + 1, batch):
        starts = (order[first : first + batch] * seq).tolist()
        window = torch.stack([shard[s : s + seq + 1] for s in starts]).to(device=device, dtype=torch.long)
        yield window[:, :-1], window[:, 1:]


@torch.no_grad()
def validate(model: nn.Module, val: torch.Tensor, n_batches: int, batch: int, seq: int, device: torch.device) -> float:
    """Mean cross-entropy over fixed, evenly spaced validation windows (same for every run)."""
    model.eval()
    starts = torch.linspace(0, len(val) - seq - 2, n_batches * batch).long()
    losses = []
    for chunk in starts.split(batch):
        window = torch.stack([val[s : s + seq + 1] for s in chunk.tolist()]).to(device=device, dtype=torch.long)
        logits = model(window[:, :-1])
        losses.append(nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten()).item())
    model.train()
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # share the CPU cores between the local workers instead of oversubscribing them
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    if world > 1:
        # gloo everywhere in a --mixed-accelerators job (CUDA, ROCm and CPU workers together), else nccl on GPUs
        dist.init_process_group(default_backend())

    # The held-out splits named by --eval are read now (a file read is no collective: fine before training).
    corpus, vocab = load_corpus(args.data, ("train", *args.eval))
    train = corpus["train"]
    shard_len = len(train) // world
    shard = train[rank * shard_len : (rank + 1) * shard_len]  # each worker sees only its own shard
    once = args.data == STDLIB
    if once and windows(shard, args.seq_len) < args.steps * args.batch_size:
        raise SystemExit(
            f"diloco_charlm.py: --steps {args.steps} x --batch-size {args.batch_size} needs "
            f"{args.steps * args.batch_size} windows of {args.seq_len} tokens, but a worker's shard of the stdlib "
            f"corpus ({len(shard)} tokens, {world} workers) holds {windows(shard, args.seq_len)}: lower --steps or "
            "--batch-size, or train on fewer workers"
        )

    torch.manual_seed(args.seed)
    if args.model == "transformer":
        model: nn.Module = ByteTransformer(vocab, args.hidden, args.layers, args.heads, args.seq_len).to(device)
    else:
        model = CharGRU(vocab, embed=64, hidden=args.hidden, layers=args.layers).to(device)
    numel = sum(p.numel() for p in model.parameters())
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    net: nn.Module = model
    opt: DiLoCo | torch.optim.Optimizer = inner
    if args.mode == "diloco":
        opt = DiLoCo(
            model,
            inner,
            sync_every=AUTO if args.sync_every is None else args.sync_every,
            outer_lr=AUTO if args.outer_lr is None else args.outer_lr,
            outer_momentum=AUTO if args.outer_momentum is None else args.outer_momentum,
            compression=AUTO if args.compression is None else args.compression,
            fragments=AUTO if args.fragments is None else args.fragments,
            overlap=args.overlap,
            mixing=args.mixing,
            check_state=not args.no_check_state,
            density=AUTO if args.density is None else args.density,
            error_decay=AUTO if args.error_decay is None else args.error_decay,
        )
        if opt.resumed:
            r = opt.resumed
            print(
                f"resumed rank={rank} world_size={world} sync={r['sync_count']} step={r['step_count']} "
                f"source_rank={r['source_rank']} received={'yes' if rank in r['receivers'] else 'no'}",
                flush=True,
            )
    elif args.mode == "ddp" and world > 1:
        net = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    elif args.mode == "demo":
        opt = DeMo(
            model.parameters(),
            lr=args.lr,
            momentum_decay=args.demo_decay,
            density=args.demo_density,
            compression=args.demo_compression,
        )
    log_every = args.sync_every or 20
    first = opt.step_count + 1 if isinstance(opt, DiLoCo) else 1
    # A resumed worker must not replay the batches of the steps before it: the stream depends on `first`.
    if once:
        gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
        data = single_pass(shard, args.batch_size, args.seq_len, gen, device, skip=first - 1)
    else:
        gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1 + 1_000_003 * (first - 1))
        data = batches(shard, args.batch_size, args.seq_len, gen, device)
    scheduled = opt if isinstance(opt, DeMo) else inner  # whose learning rate the schedule sets

    def bytes_sent(steps: int) -> int:
        if isinstance(opt, (DiLoCo, DeMo)):
            return opt.bytes_sent_total
        return 4 * numel * steps if args.mode == "ddp" and world > 1 else 0

    if rank == 0:
        if isinstance(opt, DiLoCo):
            extra = (
                f" sync_every={opt.sync_every} compression={opt.compression} fragments={opt.fragments} "
                f"overlap={opt.overlap} mixing={opt.mixing} density={opt.density:.6g} outer_lr={opt.outer_lr:g} "
                f"outer_momentum={opt.outer_momentum:g} error_decay={opt.error_decay:g} preset={opt.preset or '-'}"
            )
        elif isinstance(opt, DeMo):
            extra = (
                f" demo_compression={opt.compression} demo_density={opt.density:.6g} "
                f"per_step={opt.payload_bytes_per_step}"
            )
        else:
            extra = ""
        print(
            f"start mode={args.mode} world_size={world} params={numel} steps={args.steps} first_step={first}"
            f"{extra} model={args.model} data={'stdlib' if once else 'file'} train_tokens={len(train)} "
            f"shard_tokens={len(shard)} tokens_per_step={args.batch_size * args.seq_len} "
            f"schedule={args.schedule} warmup={args.warmup} device={device.type}",
            flush=True,
        )
    t0 = time.perf_counter()
    window_loss, window_n = 0.0, 0
    for step in range(first, args.steps + 1):
        started = time.perf_counter()
        x, y = next(data)
        for group in scheduled.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup, args.steps, args.schedule)
        loss = nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten())
        loss.backward()
        syncs = opt.sync_count if isinstance(opt, DiLoCo) else 0
        opt.step()
        opt.zero_grad(set_to_none=True)
        window_loss += loss.item()
        window_n += 1
        if isinstance(opt, DiLoCo):
            report = opt.sync_count != syncs
            label = f"outer_step {opt.sync_count} step={step}"
        else:
            report = step % log_every == 0 or step == args.steps
            label = f"train step={step}"
        if report and rank == 0:
            print(f"{label} train_loss={window_loss / window_n:.4f} bytes_sent={bytes_sent(step)}", flush=True)
        if report:
            window_loss, window_n = 0.0, 0
        time.sleep(max(0.0, args.step_time - (time.perf_counter() - started)))
    if isinstance(opt, DiLoCo):
        opt.finish()  # end on the global model, the same on every worker
        digest = state_digest(list(opt.global_parameters().values())) & (2**64 - 1)
        print(f"param_checksum rank={rank} sync={opt.sync_count} digest={digest:016x}", flush=True)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0

    if rank == 0:
        held_out = {
            f"{split}_loss": validate(model, corpus[split], args.val_batches, args.batch_size, args.seq_len, device)
            for split in args.eval
        }
        # val_loss: the test loss, or the tuning loss in a run that reads no test split (--eval tune)
        val_loss = held_out.get("test_loss", held_out.get("tune_loss"))
        losses = " ".join(f"{k}={v:.4f}" for k, v in held_out.items())
        extra = ""
        if isinstance(opt, DiLoCo):
            extra = (
                f" sync_every={opt.sync_every} compression={opt.compression} fragments={opt.fragments} "
                f"syncs={opt.sync_count} comm_blocked_s={opt.comm_blocked_s:.4f} sync_s={opt.sync_s:.4f}"
            )
        elif isinstance(opt, DeMo):
            extra = f" comm_blocked_s={opt.comm_blocked_s:.4f} per_step={opt.payload_bytes_per_step}"
        ddp_bytes = 4 * numel * args.steps if world > 1 else 0
        print(
            f"final val_loss={val_loss:.4f} bytes_sent={bytes_sent(args.steps)} {losses} wall_s={wall:.3f} "
            f"mode={args.mode} world_size={world} steps={args.steps}{extra} ddp_bytes={ddp_bytes} "
            f"ppl={math.exp(val_loss):.2f} eval={','.join(args.eval)}",
            flush=True,
        )
    if world > 1:
        dist.barrier()
        # Async collectives' handles left in reference cycles are freed now, while the process group lives: a gloo
        # AsyncWork freed during interpreter finalization aborts the process (SIGABRT after the last line; seen
        # in benchmarks/diloco_wan.py's runs; pytorch/pytorch#179291 describes the mechanism).
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
