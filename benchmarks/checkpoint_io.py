"""Checkpoint save and load time and peak host memory per rank: sharded against consolidated.

The bundled GPT (default: its 100m size) under zero3 with fp32 AdamW, after a step so the
optimizer holds its moments. Each layout runs in fresh processes: every rank saves and
loads a consolidated checkpoint (the whole model and optimizer gathered to rank 0, one
safetensors file and one optimizer file), a sharded one (every rank writes its own
shards with torch.distributed.checkpoint), or a sharded one saved in the background
(--async-checkpoint: "save" is how long training is held, "done" the wait for the rest).
Time is the slowest rank's, from a barrier to the call's return (median over repeats).
Memory is how far each rank's resident set rose during the call (the kernel's VmHWM,
reset before each call, less the resident set just before it, with freed memory first
handed back by malloc_trim; the largest over repeats); pages of a file mapped to read it
count while resident. Loads read files the save has just left in the page cache; every
load includes rank 0 checking every file's SHA-256.

    python benchmarks/checkpoint_io.py --nproc 2 --repeats 3
"""

from __future__ import annotations

import ctypes
import functools
import gc
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import arguments, launch

import dtrain
from dtrain.models import build
from dtrain.models.gpt import lm_loss

LAYOUTS = {
    "consolidated": {},
    "sharded": {"checkpoint_format": "sharded"},
    "sharded async": {"checkpoint_format": "sharded", "async_checkpoint": True},
}
MIB = 2**20
LIBC = ctypes.CDLL("libc.so.6")


def resident(field: str) -> int:
    """This process's resident set ("VmRSS") or its peak since the last reset ("VmHWM"),
    in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


def settled() -> int:
    """The resident set once freed memory is back with the kernel (the C allocator keeps
    freed blocks, which a later call would reuse unseen)."""
    gc.collect()
    LIBC.malloc_trim(0)
    return resident("VmRSS")


def measured(call: Callable[[], Any]) -> tuple[float, int]:
    """(seconds from a barrier to the return of `call`, how far the resident set rose
    above where it stood before)."""
    before = settled()
    Path("/proc/self/clear_refs").write_text("5")  # the kernel's peak RSS := current RSS
    dist.barrier()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    rise = resident("VmHWM") - before
    dist.barrier()
    return seconds, rise


def worker(
    layout: str, size: str, batch: int, steps: int, warmup: int, repeats: int, root: str
) -> dict:
    """This rank's figures for one layout: {"held": bytes after training, measure: [values]}."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    engine = dtrain.init(strategy="zero3", seed=0, **LAYOUTS[layout])
    model = build("gpt", size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = engine.setup(model, optimizer)
    context = engine.module.config.context
    for _ in range(steps):
        tokens = torch.randint(0, 256, (batch // engine.dp_size, context + 1))
        engine.train_step((tokens[:, :-1], tokens[:, 1:]), lm_loss)
    figures: dict[str, Any] = {"held": settled()}
    path = Path(root) / layout.replace(" ", "-")
    for repeat in range(warmup + repeats):
        rows = {"save": measured(functools.partial(engine.save, path))}
        if engine.config.async_checkpoint:
            rows["done"] = measured(engine.checkpoints.finish)
        rows["load"] = measured(functools.partial(engine.load, path))
        if repeat >= warmup:
            for name, (seconds, rise) in rows.items():
                figures.setdefault(f"{name} s", []).append(seconds)
                figures.setdefault(f"{name} rise", []).append(rise)
    engine.close()
    return figures


def main() -> None:
    parser = arguments(__doc__, batch=4, steps=1, warmup=1, repeats=3)
    parser.add_argument("--size", default="100m", help="GPT size (tiny, small, medium, 100m)")
    parser.add_argument("--dir", default=None, help="Where to write (default: a temporary dir)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="dtrain-ckpt-bench-")
    psi = sum(p.numel() for p in build("gpt", args.size).parameters())
    shape = (args.size, args.global_batch_size, args.steps, args.warmup, args.repeats, root)
    try:
        ranks = {layout: launch(args.nproc, worker, layout, *shape) for layout in LAYOUTS}
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"GPT {args.size}: {psi:,} parameters, fp32 AdamW, zero3 at world size {args.nproc}; "
        f"medians of {args.repeats} repeats. Seconds: the slowest rank. MiB: how far each "
        "rank's resident set rose during the call (largest repeat); in (): what it held "
        "after training."
    )
    table: dict[str, dict[str, float]] = {}
    for layout, per_rank in ranks.items():
        row = {}
        for measure in (m for m in per_rank[0] if m.endswith(" s")):
            name = measure.removesuffix(" s")
            slowest = [max(values) for values in zip(*(r[measure] for r in per_rank), strict=True)]
            rises = [max(r[f"{name} rise"]) / MIB for r in per_rank]
            row[measure] = statistics.median(slowest)
            row[f"{name} MiB"] = max(rises)
            memory = " / ".join(f"{m:,.0f}" for m in rises)
            held = " / ".join(f"{r['held'] / MIB:,.0f}" for r in per_rank)
            print(f"{layout:>14} {name:>5}: {row[measure]:7.2f} s  {memory} MiB  ({held})")
        table[layout] = row
    base = table["consolidated"]
    for layout in ("sharded", "sharded async"):
        ratios = ", ".join(
            f"{measure} x{base[measure] / table[layout][measure]:.2f}"
            for measure in ("save s", "load s", "save MiB", "load MiB")
            if table[layout][measure] > 0
        )
        print(f"consolidated / {layout}: {ratios}")


if __name__ == "__main__":
    main()
