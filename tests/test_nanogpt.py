"""examples/nanogpt.py, a user's nanoGPT-style script (a seed per rank, AdamW param
groups, a learning rate set by hand each step, clipping, a tied head), trains the same
model under ddp, zero3, pipeline and tensor as in one process, through train_step and a
hand-written loop alike."""

from __future__ import annotations

import os
import runpy
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
from distributed import free_port, run_ranks
from torch.testing import assert_close
from training import CLOSE

from dtrain.config import ENV_VAR, Config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nanogpt.py"

TINY = ["--steps", "5", "--batch-size", "8", "--block-size", "16", "--n-layer", "2"]
TINY += ["--n-head", "4", "--n-embd", "32", "--lr", "1e-2", "--warmup", "2", "--log-every", "2"]
TINY += ["--grad-clip", "0.1", "--eval-iters", "2"]  # 0.1: every step clips
"""A few steps of a 2-layer model, the global batch divisible by 2 ranks and by the
pipeline's 4 micro-batches."""

RUNS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "ddp": ({"strategy": "ddp"}, []),
    "zero3": ({"strategy": "zero3"}, []),
    "zero3 --hand": ({"strategy": "zero3"}, ["--hand"]),
    "pipeline": ({"strategy": "pipeline", "pp": 2}, []),
    "tensor": ({"strategy": "tensor", "tp": 2}, []),
    "tensor --hand": ({"strategy": "tensor", "tp": 2}, ["--hand"]),
}
"""Each run on 2 processes: (the options `dtrain run` would pass, the script's own flags)."""


def run_script(argv: list[str]) -> None:
    runpy.run_path(str(EXAMPLE))["main"](argv)


def run_all(root: str, ports: list[int]) -> None:
    """Every run of RUNS one after the other in these processes, each joining a new group
    (the script closes its engine) on its own port, as `dtrain run` would start it."""
    for (label, (options, flags)), port in zip(RUNS.items(), ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        os.environ[ENV_VAR] = Config(nproc=2, **options).to_json()
        run_script([*TINY, *flags, "--out", f"{root}/{label}.safetensors"])


@pytest.mark.timeout(150)
def test_nanogpt_example_trains_the_same_model_under_every_strategy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DTRAIN_STRATEGY", raising=False)  # plain python: single
    run_script([*TINY, "--out", str(tmp_path / "single.safetensors")])
    run_ranks(run_all, 2, str(tmp_path), [free_port() for _ in RUNS], timeout=130)
    expected = safetensors.torch.load_file(tmp_path / "single.safetensors")
    assert_close(expected["lm_head.weight"], expected["transformer.wte.weight"], rtol=0, atol=0)
    for label in RUNS:
        got = safetensors.torch.load_file(tmp_path / f"{label}.safetensors")
        assert_close(got, expected, **CLOSE, msg=lambda m, label=label: f"{label}: {m}")
        assert_close(got["lm_head.weight"], got["transformer.wte.weight"], rtol=0, atol=0)
