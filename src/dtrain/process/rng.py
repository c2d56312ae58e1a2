"""Seeding and RNG state of every generator a training loop may touch.

The seeding rule of `dtrain.init` (:func:`settle_seed`): with a seed (``--seed S``,
``dtrain.init(seed=S)``) every generator on every rank is seeded with it, and the data
shuffle takes it too. Without one the generators a script seeded are left alone as long as
every rank started from the same torch seed; ranks that started from different ones
(nobody seeded them, and a fresh process draws its own) are all seeded with rank 0's, so
the replicas start equal. The data shuffle then takes its seed from torch's generator when
the loader is made (:func:`drawn_seed`), as ``DataLoader(shuffle=True)`` does, so a script
seeded anywhere before it (after `dtrain.init` too) shuffles alike in every run.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dtrain.process.collectives import gather_objects
from dtrain.process.logs import LOGGER


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


def settle_seed(seed: int | None, initial: list[int], is_main: bool) -> None:
    """Seed the generators by the rule above.

    Args:
        seed: the seed asked for, or None.
        initial: `torch.initial_seed()` of every rank that trains, in rank order.
        is_main: whether this is rank 0, which logs when it reseeded the ranks.
    """
    if seed is not None:
        seed_everything(seed)
        return
    if len(set(initial)) > 1:
        seed_everything(initial[0])
        if is_main:  # the log file, not the terminal: every unseeded job does this
            LOGGER.info(
                "dtrain: the ranks started from different torch seeds, so every rank was "
                "seeded with rank 0's (%d) to start the replicas equal; pass --seed S (or "
                "dtrain.init(seed=S)) to choose the seed and repeat this run.",
                initial[0],
            )


def drawn_seed(group: dist.ProcessGroup | None) -> int:
    """A data shuffle's seed drawn from torch's generator now, as the sampler of
    ``DataLoader(shuffle=True)`` draws one: rank 0's draw, on every rank of `group` (a
    collective: ranks the script seeded apart draw apart, but must shuffle alike). Every
    rank draws once, so generators that were alike stay alike."""
    mine = int(torch.empty((), dtype=torch.int64).random_().item())
    return gather_objects(mine, group)[0]


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
