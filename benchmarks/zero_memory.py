"""Per-rank model-state memory of ddp, zero1, zero2 and zero3 against the ZeRO formulas.

Trains one step of a GPT with fp32 AdamW under each strategy, at each world size, and
reads every rank's bytes of parameters (between steps and from forward to backward),
gradients and optimizer state (`--memory-report`). The peak (parameters held in the
step + gradients + optimizer state) is compared with the formula. The expected figures,
for psi parameters on N ranks in fp32 with Adam (4 bytes of parameter, 4 of gradient,
8 of moments per parameter), are the fp32 analogue of Rajbhandari et al.'s table:
ddp 16 psi; zero1 8 psi + 8 psi/N; zero2 4 psi + 12 psi/N; zero3 16 psi/N.

    python benchmarks/zero_memory.py --size small --worlds 2 4
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from harness import launch

import dtrain
from dtrain.models import build
from dtrain.models.gpt import lm_loss

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
KEYS = ("parameters", "parameters_in_step", "gradients", "optimizer")


def peak(row: dict[str, int]) -> int:
    """Model-state bytes at the step's peak: parameters held in the step, gradients
    before the update, optimizer state."""
    held = max(row["parameters"], row["parameters_in_step"])
    return held + row["gradients"] + row["optimizer"]


def expected_bytes(strategy: str, psi: int, n: int) -> float:
    """The formula's model-state bytes per rank (fp32 Adam)."""
    return {
        "ddp": 16 * psi,
        "zero1": 8 * psi + 8 * psi / n,
        "zero2": 4 * psi + 12 * psi / n,
        "zero3": 16 * psi / n,
    }[strategy]


def worker(size: str) -> dict[str, list[dict[str, int]]]:
    """One step under each strategy; every rank's measured bytes, by strategy."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for strategy in STRATEGIES:
        engine = dtrain.init(strategy=strategy, memory_report=True)
        model = build("gpt", size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = engine.setup(model, optimizer)
        context = engine.module.config.context
        tokens = torch.randint(0, 256, (2, context + 1))
        engine.train_step((tokens[:, :-1], tokens[:, 1:]), lm_loss)
        results[strategy] = engine.memory_report()
        del model, optimizer
        engine.strategy.close()
        gc.collect()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="GPT size (tiny, small, medium, 100m)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    psi = sum(p.numel() for p in build("gpt", args.size).parameters())
    mib = 2**20
    print(f"GPT {args.size}: psi = {psi:,} parameters, fp32 AdamW; MiB per rank (largest rank)")
    print(
        f"{'N':>2} {'strategy':>8} {'params':>8} {'in step':>8} {'grads':>8} {'optim':>8} "
        f"{'between':>8} {'peak':>8} {'formula':>8} {'peak/formula':>12}"
    )
    for n in args.worlds:
        for strategy, ranks in launch(n, worker, args.size)[0].items():
            worst = max(ranks, key=peak)
            parts = " ".join(f"{worst[k] / mib:>8.2f}" for k in KEYS)
            between = (worst["parameters"] + worst["gradients"] + worst["optimizer"]) / mib
            formula = expected_bytes(strategy, psi, n) / mib
            print(
                f"{n:>2} {strategy:>8} {parts} {between:>8.2f} {peak(worst) / mib:>8.2f} "
                f"{formula:>8.2f} {peak(worst) / mib / formula:>12.3f}"
            )


if __name__ == "__main__":
    main()
