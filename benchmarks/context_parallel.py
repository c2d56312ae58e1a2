"""Context parallelism (--cp): activation memory and step time per rank against one process.

The bundled GPT at a long context (default 2048 tokens: 4 layers of width 256, 4 heads,
byte vocabulary), one sample per step, trained with AdamW through ``engine.train_step``:
once in one process (``single``, and ``zero3`` on one process: the whole sequence), then
on 2 processes under ``zero3 --cp 2`` and ``ddp --cp 2`` (the same sample, its sequence
cut in two). Per rank:

- the activation bytes the step's forward keeps for backward (every tensor autograd saves
  but the parameters, counted once per storage through
  ``torch.autograd.graph.saved_tensors_hooks``: what context parallelism divides; exact,
  whatever else runs on the machine);
- how far the resident set rose during the step above where it stood before it (the
  kernel's VmHWM, reset before the step; see checkpoint_io.py): activations, gradients
  and the attention's workspace together;
- the median step time.

Goal: the activation bytes per rank at cp 2 at most 0.6x one process's.

    python benchmarks/context_parallel.py --repeats 3
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from checkpoint_io import MIB, resident, settled
from harness import arguments, launch
from torch.distributed.tensor import DTensor

import dtrain
from dtrain.models.gpt import GPT, GPTConfig, lm_loss

LAYOUTS: dict[str, dict[str, Any]] = {
    "single": {"strategy": "single"},
    "zero3 (1 proc)": {"strategy": "zero3"},
    "zero3 --cp 2": {"strategy": "zero3", "cp": 2},
    "ddp --cp 2": {"strategy": "ddp", "cp": 2},
}


class SavedBytes:
    """The bytes of the distinct storages autograd saves for backward while it is held,
    parameters aside (model state: zero3 divides it, context parallelism does not)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        # During forward the module holds its parameters whole (FSDP2 gathers them).
        held = {
            (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
            for p in self.module.parameters()
        }
        if storage.data_ptr() not in held:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def worker(layout: str, context: int, steps: int) -> dict[str, Any]:
    """This rank's figures under `layout`: saved bytes of one step, resident rise of each
    step, step seconds."""
    torch.set_num_threads(1)
    if dist.is_torchelastic_launched():
        dist.init_process_group("gloo")
    engine = dtrain.init(seed=0, cpu=True, log_every=10_000, **LAYOUTS[layout])
    config = GPTConfig(vocab_size=256, context=context, dim=256, layers=4, heads=4)
    model = GPT(config)
    model, _ = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (1, context + 1), generator=generator)
    batch = (tokens[:, :-1], tokens[:, 1:])
    engine.train_step(batch, lm_loss)  # warm-up: the optimizer's state exists from here
    saved = SavedBytes(engine.module)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        engine.train_step(batch, lm_loss)
    rises, seconds = [], []
    for _ in range(steps):
        before = settled()
        Path("/proc/self/clear_refs").write_text("5")  # the kernel's peak RSS := current RSS
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        engine.train_step(batch, lm_loss)
        seconds.append(time.perf_counter() - start)
        rises.append(resident("VmHWM") - before)
    engine.close()
    rise, step = statistics.median(rises), statistics.median(seconds)
    return {"saved": saved.total, "rise": rise, "step": step}


def main() -> None:
    parser = arguments(__doc__, batch=1, steps=5, warmup=1, repeats=1)
    parser.add_argument("--context", type=int, default=2048, help="Tokens per sample.")
    args = parser.parse_args()
    rows: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in LAYOUTS}
    for _ in range(args.repeats):
        for name in LAYOUTS:
            nproc = LAYOUTS[name].get("cp", 1)
            rows[name].append(launch(nproc, worker, name, args.context, args.steps))
    base = rows["single"]
    saved_one = statistics.median(r[0]["saved"] for r in base)
    rise_one = statistics.median(r[0]["rise"] for r in base)
    step_one = statistics.median(r[0]["step"] for r in base)
    print(
        f"GPT, 4 layers of width 256, context {args.context}, one sample per step; medians "
        f"of {args.repeats} repeat(s) of {args.steps} steps; per rank (the largest rank's)"
    )
    print(
        f"{'layout':<14} {'acts MiB':>10} {'x single':>9} {'rise MiB':>9} {'x single':>9} "
        f"{'step s':>8} {'x single':>9}"
    )
    for name, runs in rows.items():
        saved = statistics.median(max(r["saved"] for r in ranks) for ranks in runs)
        rise = statistics.median(max(r["rise"] for r in ranks) for ranks in runs)
        step = statistics.median(max(r["step"] for r in ranks) for ranks in runs)
        print(
            f"{name:<14} {saved / MIB:10.1f} {saved / saved_one:9.2f} {rise / MIB:9.1f} "
            f"{rise / rise_one:9.2f} {step:8.3f} {step / step_one:9.2f}"
        )


if __name__ == "__main__":
    main()
