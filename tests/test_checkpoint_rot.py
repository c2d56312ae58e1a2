"""Nothing lost to pruning or to files that rot: keeping the last K checkpoints deletes
only those the saves wrote, never a user's copy or a converted checkpoint beside them; a
file that cannot be read although its manifest vouches for it (damaged, then the
manifest recomputed) is named in one sentence by `ckpt convert` and `engine.load`, and
`--resume` falls back to the checkpoint before it; a corrupt plain `.pt` is named too."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import run_ckpt
from distributed import run_ranks
from torch.testing import assert_close

import dtrain
from dtrain.checkpoint import step_path
from dtrain.checkpoint.atomic import file_records
from dtrain.checkpoint.verify import verify
from dtrain.demo import script as demo
from dtrain.errors import CheckpointError, DamagedCheckpointError
from dtrain.models.digits import DigitsMLP

FOUR_BYTES = b"\x80\x02\x85."
"""A pickle that ends before it begins: torch's unpickler meets an IndexError."""


def _engine(**options: Any) -> tuple[dtrain.Engine, torch.nn.Module]:
    engine = dtrain.init(seed=0, **{"strategy": "single", **options})
    model = DigitsMLP(hidden=4)
    model, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return engine, model


def _train_to(engine: dtrain.Engine, root: Path, steps: int, keep: int = 5) -> None:
    """Train up to `steps`, saving at every step as the demo does."""
    while engine.step < steps:
        g = torch.Generator().manual_seed(engine.step)
        batch = (torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g))
        engine.train_step(batch, F.cross_entropy)
        demo.save(engine, root, keep)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _vouch(checkpoint: Path) -> None:
    """Recompute the manifest's checksums over the files as they are now (a copy tool
    that rewrote the manifest over a damaged copy)."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"] = file_records(checkpoint, sorted(manifest["files"]))
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    assert verify(checkpoint) == []


def test_pruning_deletes_only_the_checkpoints_the_saves_wrote(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    engine, model = _engine(checkpoint_format="sharded")
    _train_to(engine, root, 2, keep=2)
    shutil.copytree(step_path(root, 2), root / "best")  # the user keeps the best one
    shutil.copytree(step_path(root, 1), root / "step-00000001-good")  # and a renamed one
    torch.save(model.state_dict(), tmp_path / "pretrained.pt")
    for src, dst in [
        (step_path(root, 2), root / "consolidated"),  # a consolidated copy for export
        (tmp_path / "pretrained.pt", root / "imported"),  # a plain file made a checkpoint
    ]:
        assert run_ckpt("convert", str(src), str(dst)).returncode == 0
    _train_to(engine, root, 5, keep=2)
    engine.close()
    kept = ["best", "consolidated", "imported", "step-00000001-good"]
    assert sorted(p.name for p in root.iterdir()) == [*kept, "step-00000004", "step-00000005"]
    assert all(verify(root / name) == [] for name in kept)


def _bad_header(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[8:16] = b"{garbage"  # the JSON header of a safetensors file
    file.write_bytes(bytes(data))


def _garbage(file: Path) -> None:
    size = file.stat().st_size
    file.write_bytes((bytes(range(255, -1, -1)) * (size // 256 + 1))[:size])


def _four_bytes(file: Path) -> None:
    file.write_bytes(FOUR_BYTES)


DAMAGED: dict[str, tuple[str, str, Callable[[Path], None]]] = {
    "model.safetensors with a bad header": ("consolidated", "model.safetensors", _bad_header),
    "optimizer.pt of four bytes": ("consolidated", "optimizer.pt", _four_bytes),
    "a garbage .distcp piece": ("sharded", "__0_0.distcp", _garbage),
    "a garbage .metadata index": ("sharded", ".metadata", _garbage),
    "trainer.pt of four bytes": ("sharded", "trainer.pt", _four_bytes),
}
"""Damage behind a manifest that vouches for it: (layout, file, damage)."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Checkpoints at steps 1 and 2 in each layout ("root" by layout), and the model at
    step 1 ("step 1")."""
    found: dict[str, Any] = {}
    for layout in ("consolidated", "sharded"):
        root = tmp_path_factory.mktemp(layout) / "checkpoints"
        engine, model = _engine(checkpoint_format=layout)
        _train_to(engine, root, 1)
        found["step 1"] = _params(model)
        _train_to(engine, root, 2)
        engine.close()
        found[layout] = root
    return found


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_file_damaged_behind_its_manifest_is_named_and_resume_falls_back(
    saved: dict[str, Any], tmp_path: Path, case: str, capsys: pytest.CaptureFixture
) -> None:
    layout, name, damage = DAMAGED[case]
    root = Path(shutil.copytree(saved[layout], tmp_path / "checkpoints"))
    damage(step_path(root, 2) / name)
    _vouch(step_path(root, 2))
    file = step_path(root, 2) / name
    said = f"{file} cannot be read ("

    verified = run_ckpt("verify", str(step_path(root, 2)))  # reads every file through
    assert verified.returncode == 1 and said in verified.stderr, verified.stderr

    if name != "optimizer.pt":  # converting reads every other file; a plain file not that
        out = tmp_path / ("consolidated" if layout == "sharded" else "model.pt")
        converted = run_ckpt("convert", str(step_path(root, 2)), str(out))
        assert converted.returncode == 1
        assert converted.stderr.startswith(f"dtrain: error: {said}"), converted.stderr
        assert converted.stderr.count("\n") == 1 and "weights_only" not in converted.stderr
        assert not out.exists()

    engine, model = _engine()
    with pytest.raises(DamagedCheckpointError) as refused:
        engine.load(step_path(root, 2))
    assert str(refused.value).startswith(said) and "weights_only" not in str(refused.value)
    capsys.readouterr()
    demo.resume_from(engine, root)  # what --resume and a restart under --max-restarts do
    printed = capsys.readouterr().out
    assert f"dtrain: warning: skipping damaged checkpoint {step_path(root, 2)}: {said}" in printed
    assert "Resumed at step 1" in printed
    assert engine.step == 1
    assert_close(_params(model), saved["step 1"])
    _train_to(engine, root, 2)  # written again
    engine.close()
    assert verify(step_path(root, 2)) == []


def test_a_corrupt_plain_pt_file_is_named_in_one_sentence(tmp_path: Path) -> None:
    file = tmp_path / "model.pt"
    file.write_bytes(FOUR_BYTES)
    said = f"{file} cannot be read as a PyTorch file"
    converted = run_ckpt("convert", str(file), str(tmp_path / "out"))
    assert converted.returncode == 1 and converted.stderr.startswith(f"dtrain: error: {said}")
    assert converted.stderr.count("\n") == 1
    engine, _ = _engine()
    with pytest.raises(CheckpointError, match=f"^{said}"):
        engine.load(file)
    engine.close()


def _fall_back_together(root: str) -> list[int]:
    """zero2 at two processes: a sharded checkpoint whose piece only rank 1 reads is
    damaged, then a consolidated one's model file; the step each resume lands on."""
    landed = []
    for layout, name, damage in [
        ("sharded", "__1_0.distcp", _garbage),
        ("consolidated", "model.safetensors", _bad_header),
    ]:
        folder = Path(root) / layout
        engine, _ = _engine(strategy="zero2", checkpoint_format=layout)
        _train_to(engine, folder, 2)
        if engine.is_main:
            damage(step_path(folder, 2) / name)
            _vouch(step_path(folder, 2))
        dist.barrier()
        demo.resume_from(engine, folder)
        landed.append(engine.step)
        engine.strategy.close()
    return landed


@pytest.mark.timeout(300)
def test_every_rank_falls_back_when_one_rank_meets_the_damage(tmp_path: Path) -> None:
    assert run_ranks(_fall_back_together, 2, str(tmp_path), timeout=240) == [[1, 1], [1, 1]]
