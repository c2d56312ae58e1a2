"""Checkpoints: DESIGN.md's layout, loadable across strategies and world sizes, atomic."""

from __future__ import annotations

import functools
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from distributed import run_ranks
from torch.testing import assert_close
from training import train, train_variants

import dtrain
from dtrain.checkpoint.verify import verify
from dtrain.errors import CheckpointError
from dtrain.models.digits import DigitsCNN, DigitsMLP

WRITTEN_AT_TWO = {
    "ddp": {"strategy": "ddp"},
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": "zero2"},
    "zero3-gpt": {"strategy": "zero3", "model_name": "gpt"},
}
"""The checkpoints written at world size 2, after 5 steps, by name."""

LOADED_AT_TWO = {
    "zero1 into zero3": ("zero1", "zero3"),
    "zero2 into zero3": ("zero2", "zero3"),
    "single into ddp": ("single", "ddp"),
    "towers into ddp": ("towers", "ddp"),
}
"""(checkpoint, strategy) pairs loaded at world size 2 and trained 5 steps on, by name."""


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One job of two processes writing `WRITTEN_AT_TWO`, then loading `LOADED_AT_TWO`
    (single and towers write theirs, after 5 steps, first). Returns the checkpoints' paths
    ("paths", by name) and the main rank's parameters of each load ("loaded", by name)."""
    root = tmp_path_factory.mktemp("ckpt")
    paths = {name: root / name for name in ["single", "towers", *WRITTEN_AT_TWO]}
    train(steps=5, checkpoint_out=str(paths["single"]), strategy="single")
    train(steps=5, checkpoint_out=str(paths["towers"]), strategy="towers", towers=2)
    writers = [
        {"steps": 5, "checkpoint_out": str(paths[name]), **options}
        for name, options in WRITTEN_AT_TWO.items()
    ]
    loads = [
        {"steps": 5, "checkpoint_in": str(paths[name]), "strategy": strategy}
        for name, strategy in LOADED_AT_TWO.values()
    ]
    results = run_ranks(train_variants, 2, [*writers, *loads], timeout=280)[0]
    loaded = dict(zip(LOADED_AT_TWO, results[len(writers) :], strict=True))
    return {"paths": paths, "loaded": loaded}


@pytest.fixture(scope="module")
def ddp_checkpoint(two_processes: dict[str, Any]) -> Path:
    """A checkpoint written by ddp at world size 2 after 5 steps."""
    return two_processes["paths"]["ddp"]


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, torch.Tensor]:
    """Single's parameters after 10 steps: where every resumed run must land."""
    return train(steps=10, strategy="single")


@pytest.mark.timeout(300)  # starts processes: not in the quick loop
def test_layout_and_manifest(ddp_checkpoint: Path) -> None:
    manifest = json.loads((ddp_checkpoint / "manifest.json").read_text())
    assert manifest["format"] == dtrain.checkpoint.FORMAT
    assert (manifest["step"], manifest["strategy"], manifest["world_size"]) == (5, "ddp", 2)
    assert {"model.safetensors", "optimizer.pt", "trainer.pt"} <= set(manifest["files"])
    names = torch.load(ddp_checkpoint / "optimizer.pt", weights_only=True)["state"].keys()
    assert set(names) == {n for n, _ in DigitsMLP(hidden=32).named_parameters()}


@pytest.mark.timeout(300)  # starts processes: not in the quick loop
def test_plain_pytorch_loads_it_without_dtrain(ddp_checkpoint: Path) -> None:
    model = DigitsMLP(hidden=32)
    model.load_state_dict(safetensors.torch.load_file(ddp_checkpoint / "model.safetensors"))


@pytest.mark.timeout(300)  # starts processes: not in the quick loop
@pytest.mark.parametrize("options", [{"strategy": "single"}, {"strategy": "towers", "towers": 3}])
def test_resume_under_another_strategy_continues_identically(
    ddp_checkpoint: Path, uninterrupted: dict[str, torch.Tensor], options: dict
) -> None:
    resumed = train(steps=5, checkpoint_in=str(ddp_checkpoint), **options)
    assert_close(resumed, uninterrupted)


@pytest.mark.timeout(300)  # starts processes: not in the quick loop
def test_a_checkpoint_of_another_model_is_refused_by_name(ddp_checkpoint: Path) -> None:
    engine = dtrain.init(strategy="single")
    engine.setup(DigitsCNN())
    with pytest.raises(CheckpointError, match="does not fit this model") as err:
        engine.load(ddp_checkpoint)
    assert "missing: features.0.bias, features.0.weight" in str(err.value)
    assert "unexpected: net.1.bias, net.1.weight" in str(err.value)
    engine.close()


@pytest.mark.timeout(300)  # starts processes: not in the quick loop
def test_wrong_shapes_are_named_and_strict_false_skips_them(ddp_checkpoint: Path) -> None:
    engine = dtrain.init(strategy="single")
    model = DigitsMLP(hidden=16)
    engine.setup(model)
    with pytest.raises(CheckpointError, match=r"wrongly shaped: net.1.bias \(checkpoint \[32\]"):
        engine.load(ddp_checkpoint)
    engine.load(ddp_checkpoint, strict=False)  # nothing fits but nothing breaks
    engine.close()


@pytest.mark.timeout(300)  # starts processes: not in the quick loop
def test_verify_names_truncated_and_corrupt_files(ddp_checkpoint: Path, tmp_path: Path) -> None:
    assert verify(ddp_checkpoint) == []
    broken = tmp_path / "broken"
    shutil.copytree(ddp_checkpoint, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:-10])
    flipped = bytearray((broken / "optimizer.pt").read_bytes())
    flipped[-5] ^= 0xFF
    (broken / "optimizer.pt").write_bytes(bytes(flipped))
    problems = verify(broken)
    assert any(p.startswith("model.safetensors is truncated") for p in problems)
    assert any(p.startswith("optimizer.pt is corrupt") for p in problems)


def test_a_failed_write_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = dtrain.init(strategy="single")
    model = DigitsMLP(hidden=8)
    engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    target = tmp_path / "ckpt"
    engine.save(target)
    before = (target / "manifest.json").read_text()

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    with pytest.raises(CheckpointError, match="could not be written: disk full"):
        engine.save(target)
    assert (target / "manifest.json").read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    engine.close()


@pytest.mark.timeout(300)
def test_zero3_checkpoint_resumes_under_single_and_zero2_at_another_world_size(
    two_processes: dict[str, Any],
) -> None:
    path = str(two_processes["paths"]["zero3-gpt"])
    gpt = {"model_name": "gpt"}
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    assert (manifest["strategy"], manifest["world_size"], manifest["optimizer"]) == (
        "zero3",
        2,
        "AdamW",
    )
    uninterrupted = train(steps=10, strategy="single", **gpt)
    assert_close(train(steps=5, checkpoint_in=path, strategy="single", **gpt), uninterrupted)
    resumed = run_ranks(
        functools.partial(train, steps=5, checkpoint_in=path, strategy="zero2", **gpt), 3
    )[0]
    assert_close(resumed, uninterrupted)


@pytest.mark.timeout(300)
def test_zero1_and_zero2_checkpoints_resume_under_single_and_zero3(
    two_processes: dict[str, Any], uninterrupted: dict[str, torch.Tensor]
) -> None:
    paths, loaded = two_processes["paths"], two_processes["loaded"]
    state = torch.load(paths["zero1"] / "optimizer.pt", weights_only=True)["state"]
    assert set(state) == {n for n, _ in DigitsMLP(hidden=32).named_parameters()}
    for name in ("zero1", "zero2"):
        resumed = train(steps=5, checkpoint_in=str(paths[name]), strategy="single")
        assert_close(resumed, uninterrupted)
        assert_close(loaded[f"{name} into zero3"], uninterrupted)


@pytest.mark.timeout(300)
def test_one_process_checkpoints_resume_under_ddp(
    two_processes: dict[str, Any], uninterrupted: dict[str, torch.Tensor]
) -> None:
    for name in ("single into ddp", "towers into ddp"):
        assert_close(two_processes["loaded"][name], uninterrupted)


def test_checkpoints_honour_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        engine = dtrain.init(strategy="single")
        model = DigitsMLP(hidden=4)
        engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        engine.save(tmp_path / "ckpt")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "ckpt").stat().st_mode) == 0o755
    for path in (tmp_path / "ckpt").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path.name
