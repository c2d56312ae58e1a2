"""One FSDP path: zero2, zero3 and hybrid's sharded data parallelism apply the same options
(prefetching, bf16-mixed precision) through `apply_fsdp`, as the torch state shows, and
train in bf16 on the CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_ranks
from torch.distributed.fsdp import FSDPModule
from training import finish

import dtrain
from dtrain.models.gpt import GPT, SIZES, lm_loss


def applied_options(options: dict[str, Any], close: bool = True) -> dict[str, Any]:
    """What FSDP2 holds for the tiny GPT set up under `options`: the parameter dtype of
    every sharded module, how many blocks prefetch the next one, and whether forward
    frees the gathered parameters (`close=False` keeps the process group)."""
    engine = dtrain.init(seed=0, precision="bf16-mixed", log_every=1, **options)
    model = GPT(SIZES["tiny"])
    engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    tokens = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(0))
    loss = engine.train_step((tokens[:, :-1], tokens[:, 1:]), lm_loss)
    sharded = [m for m in engine.module.modules() if isinstance(m, FSDPModule)]
    states = [m._get_fsdp_state() for m in sharded]
    groups = [s._fsdp_param_group for s in states if s._fsdp_param_group is not None]
    result = {
        "sharded": len(sharded),
        "param_dtypes": {str(s._mp_policy.param_dtype) for s in states},
        "prefetching": sum(bool(s._states_to_forward_prefetch) for s in states),
        "reshard_after_forward": {g.post_forward_mesh_info is not None for g in groups},
        "fsdp_casts": engine.strategy.placement.handles_precision,
        "loss": (loss.dtype, loss.item()),
    }
    del model, sharded, states, groups
    finish(engine, close)
    return result


RUNS = {
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "hybrid zero3": {"strategy": "hybrid", "dp_mode": "zero3"},
}


def applied_by_run() -> dict[str, dict[str, Any]]:
    """`applied_options` of each of `RUNS`, one after the other in this process group."""
    last = len(RUNS) - 1
    return {
        name: applied_options(options, close=i == last)
        for i, (name, options) in enumerate(RUNS.items())
    }


@pytest.mark.timeout(120)
def test_zero2_zero3_and_hybrid_zero3_apply_the_same_fsdp_options() -> None:
    found = run_ranks(applied_by_run, 2)[0]
    blocks = SIZES["tiny"].layers
    for name, result in found.items():
        assert result["sharded"] == blocks + 1, name  # each block, then the root
        assert result["param_dtypes"] == {"torch.bfloat16"}, name
        assert result["prefetching"] == blocks - 1, name  # each block but the last
        assert result["fsdp_casts"], name  # FSDP's policy casts, the Engine does not autocast
        dtype, value = result["loss"]  # a step runs on the CPU, in bf16, to an fp32 loss
        assert dtype == torch.float32 and 5.0 < value < 6.0, name
    assert found["zero2"]["reshard_after_forward"] == {False}
    assert found["zero3"]["reshard_after_forward"] == {True}
    assert found["hybrid zero3"]["reshard_after_forward"] == {True}
