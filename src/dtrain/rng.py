"""Seeding and RNG state of every generator a training loop may touch.

The seeding rule of `dtrain.init` (:func:`settle_seed`): with a seed (``--seed S``,
``dtrain.init(seed=S)``) every generator on every rank is seeded with it. Without one the
generators a script seeded are left alone as long as every rank started from the same
torch seed; ranks that started from different ones (nobody seeded them, and a fresh
process draws its own) are all seeded with rank 0's, so the replicas start equal.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from dtrain.collectives import gather_objects
from dtrain.observe.logs import LOGGER


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy, the CPU and every CUDA device with `seed`."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def initial_seeds(everyone: bool) -> list[int]:
    """`torch.initial_seed()` of this process, or with `everyone` of every process of the
    job in rank order: one all-gather over the default group, which every process of the
    job makes once per run, right after joining it (`dtrain.init` on the ranks that train,
    `serve_job` on parameter servers)."""
    if everyone:
        return gather_objects(torch.initial_seed(), None)
    return [torch.initial_seed()]


def settle_seed(seed: int | None, initial: list[int], is_main: bool) -> int:
    """Seed the generators by the rule above; return the run's seed (the data shuffle's).

    Args:
        seed: the seed asked for, or None.
        initial: `torch.initial_seed()` of every rank that trains, in rank order.
        is_main: whether this is rank 0, which logs when it reseeded the ranks.
    """
    if seed is not None:
        seed_everything(seed)
        return seed
    if len(set(initial)) > 1:
        seed_everything(initial[0])
        if is_main:  # the log file, not the terminal: every unseeded job does this
            LOGGER.info(
                "dtrain: the ranks started from different torch seeds, so every rank was "
                "seeded with rank 0's (%d) to start the replicas equal; pass --seed S (or "
                "dtrain.init(seed=S)) to choose the seed and repeat this run.",
                initial[0],
            )
    return initial[0]


def get_state() -> dict[str, Any]:
    """The state of every generator, as tensors and plain values (weights_only-safe)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_state(state: dict[str, Any]) -> None:
    """Restore generators from :func:`get_state`; CUDA states only if the counts match."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
