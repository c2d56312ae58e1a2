"""Sharded checkpoints (--checkpoint-format sharded): every rank writes its part, any
strategy and world size loads them, `dtrain ckpt convert` consolidates them offline."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from conftest import run_ckpt
from distributed import run_ranks
from test_ps import run_ps
from torch.testing import assert_close
from training import train, train_variants

import dtrain
from dtrain.checkpoint import SHARDED_FORMAT
from dtrain.checkpoint.atomic import sha256_file
from dtrain.checkpoint.convert import convert
from dtrain.checkpoint.verify import verify
from dtrain.errors import CheckpointError
from dtrain.models.digits import DigitsMLP
from dtrain.models.gpt import GPT, SIZES

GPT_RUN = {"model_name": "gpt"}
SHARDED = {"checkpoint_format": "sharded"}


LOADERS = [
    # Saved again right after loading, consolidated: the state as loaded, by name.
    {"steps": 0, "checkpoint_out": "again", "strategy": "ddp"},
    {"steps": 5, "strategy": "ddp"},
    {"steps": 5, "strategy": "tensor"},
    # Each stage reads its own layers, then writes them: a sharded checkpoint of parts.
    {"steps": 5, "checkpoint_out": "staged", "strategy": "pipeline", **SHARDED},
]
"""What loads the zero3 sharded checkpoint at world size 2 (checkpoint_out: a name)."""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], list[dict]]:
    """One job at world size 2: checkpoints after 5 tiny-GPT AdamW steps (zero3 sharded,
    consolidated and sharded in the background (the same state), and zero1 sharded), and
    `LOADERS` loading the zero3 sharded one. Returns every checkpoint's path by name and
    the main rank's parameters after each of `LOADERS`."""
    root = tmp_path_factory.mktemp("sharded")
    names = ("sharded", "consolidated", "zero1", "async", "again", "staged")
    paths = {name: root / name for name in names}
    writers = [
        {"checkpoint_out": str(paths["sharded"]), "strategy": "zero3", **SHARDED},
        {"checkpoint_out": str(paths["consolidated"]), "strategy": "zero3"},
        {"checkpoint_out": str(paths["zero1"]), "strategy": "zero1", **SHARDED},
    ]
    loaders = [
        {**v, "checkpoint_in": str(paths["sharded"])}
        | ({"checkpoint_out": str(paths[v["checkpoint_out"]])} if "checkpoint_out" in v else {})
        for v in LOADERS
    ]
    # Last: only the last run closes its Engine, which waits for the save.
    background = {"checkpoint_out": str(paths["async"]), "strategy": "zero3", **SHARDED}
    variants = [*writers, *loaders, {**background, "async_checkpoint": True}]
    variants = [{"steps": 5, **GPT_RUN, **v} for v in variants]
    results = run_ranks(train_variants, 2, variants, timeout=280)[0]
    return paths, results[len(writers) : -1]


@pytest.fixture(scope="module")
def saved(two_ranks: tuple[dict[str, Path], list[dict]]) -> dict[str, Path]:
    """The checkpoints `two_ranks` wrote, by name."""
    return two_ranks[0]


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, torch.Tensor]:
    return train(steps=10, strategy="single", **GPT_RUN)


def consolidated_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    model = safetensors.torch.load_file(path / "model.safetensors")
    return model, torch.load(path / "optimizer.pt", weights_only=True)


def assert_same_state(state: Any, expected: tuple[dict, dict]) -> None:
    (tensors, optimizer), (expected_tensors, expected_optimizer) = state, expected
    assert_close(tensors, expected_tensors)
    assert_close(optimizer["state"], expected_optimizer["state"])
    assert optimizer["param_groups"] == expected_optimizer["param_groups"]


@pytest.mark.timeout(300)  # starts processes: not in the quick loop
def test_every_rank_writes_a_part_beside_a_manifest(saved: dict[str, Path]) -> None:
    manifest = json.loads((saved["sharded"] / "manifest.json").read_text())
    assert manifest["format"] == SHARDED_FORMAT
    assert (manifest["step"], manifest["strategy"], manifest["world_size"]) == (5, "zero3", 2)
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "trainer.pt"} == set(manifest["files"])
    consolidated = json.loads((saved["consolidated"] / "manifest.json").read_text())
    assert manifest["tensors"] == consolidated["tensors"]
    assert verify(saved["sharded"]) == []
    assert [p.name for p in saved["sharded"].parent.iterdir() if p.name.startswith(".")] == []


def test_convert_gives_the_consolidated_save_of_the_same_state(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    plain, directory = tmp_path / "model.safetensors", tmp_path / "consolidated"
    proc = run_ckpt("convert", str(saved["sharded"]), str(plain))
    assert proc.returncode == 0, proc.stderr
    expected = consolidated_state(saved["consolidated"])
    assert_close(safetensors.torch.load_file(plain), expected[0], rtol=0, atol=0)
    assert "optimizer" in convert(saved["sharded"], directory)
    assert verify(directory) == []
    assert_same_state(consolidated_state(directory), expected)
    trainer = torch.load(directory / "trainer.pt", weights_only=True)
    assert trainer["step"] == 5 and len(trainer["rng_per_rank"]) == 2


def test_single_loads_the_same_state_and_continues_identically(
    saved: dict[str, Path], uninterrupted: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    # Saved again right after loading, consolidated: the state as loaded, by name.
    again = tmp_path / "again"
    train(steps=0, checkpoint_in=str(saved["sharded"]), checkpoint_out=str(again), **GPT_RUN)
    assert_same_state(consolidated_state(again), consolidated_state(saved["consolidated"]))
    for name in ("sharded", "async", "zero1"):
        resumed = train(steps=5, checkpoint_in=str(saved[name]), strategy="single", **GPT_RUN)
        assert_close(resumed, uninterrupted, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.timeout(300)
def test_ddp_tensor_and_pipeline_load_a_zero3_sharded_checkpoint(
    two_ranks: tuple[dict[str, Path], list[dict]],
    uninterrupted: dict[str, torch.Tensor],
    tmp_path: Path,
) -> None:
    saved, (_, *continued) = two_ranks
    assert_same_state(consolidated_state(saved["again"]), consolidated_state(saved["consolidated"]))
    for variant, params in zip(LOADERS[1:], continued, strict=True):
        strategy = variant["strategy"]
        assert_close(params, uninterrupted, msg=lambda m, s=strategy: f"{s}: {m}")
    assert json.loads((saved["staged"] / "manifest.json").read_text())["strategy"] == "pipeline"
    from_stages = tmp_path / "from-stages"
    train(steps=0, checkpoint_in=str(saved["staged"]), checkpoint_out=str(from_stages), **GPT_RUN)
    tensors, optimizer = consolidated_state(from_stages)
    assert_close(tensors, uninterrupted)
    assert set(optimizer["state"]) == set(uninterrupted)


@pytest.mark.timeout(240)
def test_ps_saves_in_the_background_and_loads_sharded_checkpoints(tmp_path: Path) -> None:
    """Under ps rank 0 writes alone what the servers hold; the workers load it whole."""
    path = str(tmp_path / "ps")
    options = {"checkpoint_format": "sharded", "async_checkpoint": True}
    ten = run_ps(2, 1, checkpoint_out=path, **options)[0]
    assert_close(train(steps=0, checkpoint_in=path), ten)
    assert_close(run_ps(2, 1, checkpoint_in=path)[0], train(steps=20, strategy="single"))


@pytest.mark.timeout(300)  # starts processes: not in the quick loop
def test_a_checkpoint_of_another_model_or_optimizer_is_refused(saved: dict[str, Path]) -> None:
    engine = dtrain.init(strategy="single")
    model = DigitsMLP(hidden=32)
    engine.setup(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="does not fit this model") as err:
        engine.load(saved["sharded"])
    assert "missing: net.1.bias, net.1.weight" in str(err.value)
    assert "unexpected: blocks.0.attn" in str(err.value)
    assert_close(model.state_dict(), before)
    engine.close()
    engine = dtrain.init(strategy="single")
    model = GPT(SIZES["tiny"])
    engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="optimizer state does not fit") as err:
        engine.load(saved["sharded"])
    assert "momentum" in str(err.value)
    assert_close(model.state_dict(), before)
    engine.close()


class Payload:
    """Unpickling this runs a shell command; a loader must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_payload_in_the_index_is_refused_and_never_runs(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    copy, marker = tmp_path / "evil", tmp_path / "pwned"
    shutil.copytree(saved["sharded"], copy)
    (copy / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"][".metadata"] = {
        "bytes": (copy / ".metadata").stat().st_size,
        "sha256": sha256_file(copy / ".metadata"),
    }
    (copy / "manifest.json").write_text(json.dumps(manifest))
    engine = dtrain.init(strategy="single")
    model = GPT(SIZES["tiny"])
    engine.setup(model)
    with pytest.raises(CheckpointError, match="will not unpickle"):
        engine.load(copy)
    engine.close()
    assert not marker.exists()


def test_verify_inspect_and_resume_know_both_formats(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    for step, options in ((1, {}), (2, SHARDED)):
        engine = dtrain.init(strategy="single", **options)
        model = DigitsMLP(hidden=8)
        engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for _ in range(step):  # as optimizer steps would
            engine.position.stepped(engine.step + 1, one_batch=False)
        engine.save(root / f"step-{step:08d}")
        engine.close()
    newest = root / "step-00000002"
    inspect = run_ckpt("inspect", str(newest))
    assert "sharded" in inspect.stdout and "net.1.weight" in inspect.stdout
    assert run_ckpt("verify", str(newest)).returncode == 0
    engine = dtrain.init(strategy="single")
    model = DigitsMLP(hidden=8)
    engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert engine.resume(root)["format"] == SHARDED_FORMAT
    piece = newest / "__0_0.distcp"
    piece.write_bytes(piece.read_bytes()[:-4])
    proc = run_ckpt("verify", str(newest))
    assert proc.returncode == 1 and "__0_0.distcp is truncated" in proc.stderr
    assert engine.resume(root)["step"] == 1  # the damaged sharded one is skipped
    engine.close()
