"""Models we did not write train under every strategy as they do in one process, with no
code written for dtrain: Hugging Face's Llama, Qwen2 (tied output layer) and GPT-NeoX,
whose tensor-parallel plan and pipeline blocks dtrain reads from the model itself; a BERT
classifier and GPT-2; torchtitan's Llama3 (given a tensor-parallel plan as a user
would, torchtitan keeping its plans in its trainer); and a ResNet-18 after torchvision's
layout, whose BatchNorm layers normalise the whole batch with --sync-batchnorm.

Each cell (model x strategy) must equal `single` within 1e-4 on every parameter and
buffer after 4 AdamW steps; only a model built inside `engine.init_empty` may instead be
refused, by a message naming the module that cannot initialise itself. One spawned job
per world size runs every cell of that size (tests/distributed.py)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from distributed import run_ranks
from test_ps import SERVER, ps_runs
from third_party import (
    HF_LM_KINDS,
    RESNET,
    TITAN,
    TITAN_LIKE,
    build,
    titan_missing,
    train_model,
    train_model_variants,
)
from torch.testing import assert_close

import dtrain
from dtrain.parallel.activation_checkpointing import is_checkpointed

CLOSE = {"atol": 1e-4, "rtol": 1e-4}

INIT_EMPTY = "init_empty"
CELLS: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp"},
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "tensor": {"strategy": "tensor"},
    "pipeline": {"strategy": "pipeline"},
    "zero3+init_empty": {"strategy": "zero3", INIT_EMPTY: True},
    "ddp+checkpointing+accumulation": {
        "strategy": "ddp",
        "activation_checkpointing": "full",
        "grad_accumulation": 2,
    },
    "ps": {},  # two workers and one server: ps_runs adds the layout
    "dp2xtp2": {"strategy": "hybrid", "tp": 2},
    "pp2xtp2": {"strategy": "hybrid", "pp": 2, "tp": 2},
    "towers": {"strategy": "towers", "towers": 2},
    "single+init_empty": {"strategy": "single", INIT_EMPTY: True},
    "ddp+sync_batchnorm": {"strategy": "ddp", "sync_batchnorm": True},
    "zero3+sync_batchnorm": {"strategy": "zero3", "sync_batchnorm": True},
}
"""Every strategy of the matrix, by the name its cells go by."""
IN_PROCESS = ["towers", "single+init_empty"]
TWO_RANKS = [
    "ddp", "zero2", "zero3", "tensor", "pipeline", "zero3+init_empty",
    "ddp+checkpointing+accumulation", "ddp+sync_batchnorm", "zero3+sync_batchnorm",
]  # fmt: skip
HYBRID = ["dp2xtp2", "pp2xtp2"]
Results = dict[tuple[str, str], Any]
"""A job's outcome (parameters, or a refusal's message) of each (model, strategy) cell."""

MATRIX: dict[str, list[str]] = {
    **{kind: [*CELLS] for kind in HF_LM_KINDS},
    TITAN: ["zero2", "zero3", "tensor", "pipeline", "zero3+init_empty", "ps"] + IN_PROCESS,
    # GPT-2's Conv1D layers cannot be split by torch's tensor-parallel styles.
    "bert": ["towers", "ddp", "zero3", "tensor"],
    "gpt2": ["towers", "ddp", "zero3"],
    TITAN_LIKE: ["ddp", "zero2", "zero3", "pipeline", "zero3+init_empty", "ps", *IN_PROCESS],
    RESNET: ["ddp+sync_batchnorm", "zero3+sync_batchnorm", "single+init_empty"],
}
"""The strategies each model is trained under."""


def buildable(kind: str) -> bool:
    """Whether this machine can build `kind` (torchtitan may be absent)."""
    return kind != TITAN or titan_missing() is None


def cells(names: list[str]) -> list[tuple[str, str]]:
    """(model, strategy) for every cell of the matrix among strategies `names`."""
    return [(kind, name) for kind in MATRIX for name in names if name in MATRIX[kind]]


def variants(names: list[str]) -> list[dict[str, Any]]:
    """The runs of the cells among `names` this machine can build."""
    return [{"kind": k, **CELLS[n]} for k, n in cells(names) if buildable(k)]


def timed(job: str, run: Callable[[], Any]) -> Any:
    """`run()`, saying how long it took (shown with pytest -s)."""
    start = time.monotonic()
    result = run()
    print(f"\n{job}: {time.monotonic() - start:.0f} s")
    return result


def by_cell(names: list[str], results: list[Any]) -> Results:
    """`results` (in the order of `variants(names)`) by (model, strategy)."""
    built = [(k, n) for k, n in cells(names) if buildable(k)]
    return dict(zip(built, results, strict=True))


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    """Each model's parameters and buffers after 4 steps in one process."""
    kinds = [kind for kind in MATRIX if buildable(kind)]
    return timed("single", lambda: {kind: train_model(kind, strategy="single") for kind in kinds})


def check(result: Any, expected: dict[str, torch.Tensor], kind: str, cell: str) -> None:
    """`result` equals `expected`, or (init_empty only) refuses naming a module of `kind`."""
    if not buildable(kind):
        pytest.skip(titan_missing() or "")
    label = f"{kind} under {cell}"
    if isinstance(result, str):
        if result.startswith("refused: ") and CELLS[cell].get(INIT_EMPTY):
            assert_names_a_module(result, kind)
            return
        pytest.fail(f"{label}: {result}")
    assert_close(result, expected, **CLOSE, msg=lambda m: f"{label}: {m}")


def assert_names_a_module(message: str, kind: str) -> None:
    """The refusal names a module of the model by its path and class."""
    found = re.search(r"module '([\w.]+)' \((\w+)\)", message, re.IGNORECASE)
    assert found, f"{kind}: the refusal names no module: {message}"
    path, cls = found.groups()
    modules = dict(build(kind, empty=True).named_modules())
    module = modules[""] if path == "model" else modules.get(path)
    assert module is not None and type(module).__name__ == cls, message


def test_tied_output_layers_stay_tied(references: dict[str, dict[str, torch.Tensor]]) -> None:
    assert_close(references["gpt2"]["lm_head.weight"], references["gpt2"]["transformer.wte.weight"])
    qwen2 = references["qwen2"]
    assert_close(qwen2["lm_head.weight"], qwen2["model.embed_tokens.weight"])


@pytest.mark.parametrize("kind", [kind for kind, _ in cells(["ddp+checkpointing+accumulation"])])
def test_checkpointing_recomputes_every_decoder_layer(kind: str) -> None:
    """The checkpointing cells are not vacuous: `full` finds each model's 2 layers."""
    engine = dtrain.init(strategy="single", activation_checkpointing="full")
    model = build(kind, empty=False)
    engine.setup(model, None)
    found = [name for name, module in engine.module.named_modules() if is_checkpointed(module)]
    engine.close()
    assert [name.rsplit(".", 1)[-1] for name in found] == ["0", "1"], found


@pytest.mark.timeout(180)  # towers on every model: more than the quick loop wants
@pytest.mark.parametrize(("kind", "cell"), cells(IN_PROCESS))
def test_in_process_strategies_train_third_party_models_as_single(
    kind: str, cell: str, references: dict[str, dict[str, torch.Tensor]]
) -> None:
    if not buildable(kind):
        pytest.skip(titan_missing() or "")
    check(train_model(kind, **CELLS[cell]), references[kind], kind, cell)


def spawned(job: str, names: list[str], world_size: int, timeout: float) -> Results:
    """Every cell among strategies `names`, one after the other in one job of
    `world_size` processes."""
    runs = variants(names)
    results = timed(job, lambda: run_ranks(train_model_variants, world_size, runs, timeout=timeout))
    return by_cell(names, results[0])


@pytest.fixture(scope="module")
def two_ranks() -> Results:
    return spawned("two ranks", TWO_RANKS, 2, timeout=560)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("kind", "cell"), cells(TWO_RANKS))
def test_two_processes_train_third_party_models_as_single(
    kind: str, cell: str, references: dict[str, dict[str, torch.Tensor]], two_ranks: Results
) -> None:
    check(two_ranks.get((kind, cell)), references.get(kind, {}), kind, cell)


@pytest.fixture(scope="module")
def parameter_server() -> Results:
    """Every ps cell: two workers and one server, one job."""
    runs = [{"kind": v["kind"]} for v in variants(["ps"])]
    results = timed("ps", lambda: run_ranks(ps_runs, 3, train_model, runs, 2, 1, timeout=300))
    assert results[2] == SERVER
    return by_cell(["ps"], results[0])


@pytest.mark.timeout(320)
@pytest.mark.parametrize("kind", [kind for kind, _ in cells(["ps"])])
def test_the_parameter_server_trains_third_party_models_as_single(
    kind: str, references: dict[str, dict[str, torch.Tensor]], parameter_server: Results
) -> None:
    check(parameter_server.get((kind, "ps")), references.get(kind, {}), kind, "ps")


@pytest.fixture(scope="module")
def four_ranks() -> Results:
    return spawned("four ranks", HYBRID, 4, timeout=400)


@pytest.mark.timeout(420)
@pytest.mark.parametrize(("kind", "cell"), cells(HYBRID))
def test_hybrid_meshes_train_third_party_models_as_single(
    kind: str, cell: str, references: dict[str, dict[str, torch.Tensor]], four_ranks: Results
) -> None:
    check(four_ranks.get((kind, cell)), references.get(kind, {}), kind, cell)
