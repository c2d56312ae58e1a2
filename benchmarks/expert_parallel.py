"""Expert parallelism (--ep): the experts' memory per rank and the step time, against zero3.

The bundled GPT with a mixture of experts in every block (default: 4 layers of width 128,
8 experts, top-2, context 128, byte vocabulary), AdamW through ``engine.train_step``, on
--nproc processes (default 2) under ``zero3`` (every parameter sharded over all ranks, the
experts too), ``zero3 --ep N`` and ``ddp --ep N`` (N = --ep, default --nproc: each rank holds
E/N experts whole, the tokens sent to them by all-to-all), and ``ddp`` (every rank holds
every expert). Per rank, the largest rank's:

- the experts' state it holds: the bytes of its part of the experts' parameters and of
  their optimizer state (AdamW's two moments), read from the tensors themselves (local
  shards); its share of one process's (1 / --ep is the goal under --ep);
- the median step time, and its ratio to zero3's without --ep (runs alternate by repeat).

    python benchmarks/expert_parallel.py --repeats 3
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from harness import arguments, launch
from torch.distributed.tensor import DTensor

import dtrain
from dtrain.models.gpt import GPT, GPTConfig, lm_loss
from dtrain.parallel.expert_parallel import experts_of


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of `tensor` (a DTensor's local shard)."""
    held = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return held.numel() * held.element_size()


def expert_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the experts' parameters and optimizer state held on this rank."""
    total = 0
    for module in experts_of(model).values():
        for param in module.parameters():
            total += local_bytes(param)
            total += sum(
                local_bytes(v)
                for v in optimizer.state.get(param, {}).values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            )
    return total


def worker(
    layout: dict[str, Any], config: GPTConfig, batch: int, warmup: int, steps: int
) -> dict[str, float]:
    """This rank's expert-state bytes and median step seconds under `layout`."""
    torch.set_num_threads(1)
    if dist.is_torchelastic_launched():
        dist.init_process_group("gloo")
    engine = dtrain.init(seed=0, cpu=True, log_every=10_000, **layout)
    model = GPT(config)
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    assert optimizer is not None
    generator = torch.Generator().manual_seed(engine.rank)
    per_rank = batch // max(engine.dp_size, 1)
    tokens = torch.randint(
        0, config.vocab_size, (per_rank, config.context + 1), generator=generator
    )
    data = (tokens[:, :-1], tokens[:, 1:])
    seconds = []
    for step in range(warmup + steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        engine.train_step(data, lm_loss)
        if step >= warmup:
            seconds.append(time.perf_counter() - start)
    held = expert_state(engine.module, optimizer)
    engine.close()
    return {"experts": held, "step": statistics.median(seconds)}


def main() -> None:
    parser = arguments(__doc__, batch=16, steps=10, warmup=2, repeats=3)
    parser.add_argument("--ep", type=int, default=None, help="Expert-parallel ranks (--nproc).")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    ep = args.ep or args.nproc
    config = GPTConfig(
        vocab_size=256, context=args.context, dim=args.dim, layers=args.layers, heads=4,
        experts=args.experts, top_k=args.top_k,
    )  # fmt: skip
    layouts: dict[str, tuple[int, dict[str, Any]]] = {
        "single": (1, {"strategy": "single"}),
        "ddp": (args.nproc, {"strategy": "ddp"}),
        "zero3": (args.nproc, {"strategy": "zero3"}),
        f"ddp --ep {ep}": (args.nproc, {"strategy": "ddp", "ep": ep}),
        f"zero3 --ep {ep}": (args.nproc, {"strategy": "zero3", "ep": ep}),
    }
    rows: dict[str, list[list[dict[str, float]]]] = {name: [] for name in layouts}
    for _ in range(args.repeats):
        for name, (nproc, layout) in layouts.items():
            rows[name].append(
                launch(
                    nproc, worker, layout, config, args.global_batch_size, args.warmup, args.steps
                )
            )

    def median(name: str, key: str) -> float:
        return statistics.median(max(r[key] for r in ranks) for ranks in rows[name])

    whole, base = median("single", "experts"), median("zero3", "step")
    print(
        f"GPT, {args.layers} layers of width {args.dim}, {args.experts} experts top-{args.top_k}, "
        f"context {args.context}, global batch {args.global_batch_size}, {args.nproc} "
        f"processes; medians of {args.repeats} repeat(s) of {args.steps} steps (largest rank)"
    )
    print(f"{'layout':<14} {'experts MiB':>12} {'x single':>9} {'step ms':>9} {'x zero3':>8}")
    for name in layouts:
        held, step = median(name, "experts"), median(name, "step")
        print(
            f"{name:<14} {held / 2**20:12.2f} {held / whole:9.3f} {step * 1000:9.1f} "
            f"{step / base:8.2f}"
        )


if __name__ == "__main__":
    main()
