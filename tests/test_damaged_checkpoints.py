"""Checkpoint reading never trusts a file: a damaged checkpoint (any file truncated,
flipped, deleted or overwritten, a manifest with the wrong JSON in it) is refused by name
by `load`, skipped with a warning by `resume`, and written again when training reaches
its step; `dtrain ckpt verify` says what is wrong in one paragraph. The launcher's error
files: written in one rename, and a damaged one is read as no report."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed.elastic.multiprocessing.api as elastic_processes
import torch.nn.functional as F
from conftest import run_ckpt
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.testing import assert_close

import dtrain
from dtrain.checkpoint import step_path
from dtrain.checkpoint.directory import problems_of
from dtrain.demo import script as demo
from dtrain.errors import CheckpointError
from dtrain.launcher import bootstrap
from dtrain.launcher.failures import format_failures
from dtrain.models.digits import DigitsMLP

FILES = ("manifest.json", "model.safetensors", "optimizer.pt", "trainer.pt")


def _engine(**options: object) -> tuple[dtrain.Engine, torch.nn.Module]:
    engine = dtrain.init(strategy="single", seed=0, **options)
    model = DigitsMLP(hidden=4)
    model, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return engine, model


def _train_to(engine: dtrain.Engine, root: Path, steps: int, keep: int = 5) -> None:
    """Train up to `steps`, saving at every step as the demo does (unless already saved)."""
    g = torch.Generator().manual_seed(engine.step)
    while engine.step < steps:
        batch = (torch.randn(4, 64, generator=g), torch.randint(0, 10, (4,), generator=g))
        engine.train_step(batch, F.cross_entropy)
        demo.save(engine, root, keep)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of checkpoints at steps 1, 2 and 3."""
    root = tmp_path_factory.mktemp("saved") / "checkpoints"
    engine, _ = _engine()
    _train_to(engine, root, 3)
    engine.close()
    return root


@pytest.fixture
def root(saved: Path, tmp_path: Path) -> Path:
    """A copy of `saved` to damage."""
    return Path(shutil.copytree(saved, tmp_path / "checkpoints"))


def _truncated(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _flipped(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _garbage(file: Path) -> None:
    size = file.stat().st_size  # the same size: only the checksum can tell
    file.write_bytes((bytes(range(255, -1, -1)) * (size // 256 + 1))[:size])


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": _truncated,
    "flipped": _flipped,
    "deleted": Path.unlink,
    "garbage": _garbage,
}


def _edited(*removed: str, **fields: object) -> Callable[[Path], None]:
    """Damage: the manifest with `fields` set to other JSON and `removed` taken out."""

    def edit(file: Path) -> None:
        manifest = {k: v for k, v in json.loads(file.read_text()).items() if k not in removed}
        file.write_text(json.dumps({**manifest, **fields}))

    return edit


WRONG_MANIFESTS: dict[str, Callable[[Path], None]] = {
    "files null": _edited(files=None),
    "files a list": _edited(files=["model.safetensors"]),
    "files empty": _edited(files={}),
    "step a string": _edited(step="2"),
    "format missing": _edited("format"),
    "files missing": _edited("files"),
    "not an object": lambda file: file.write_text("[]"),
    "empty": lambda file: file.write_text(""),
}

CASES = [(name, how, damage) for name in FILES for how, damage in DAMAGE.items()] + [
    ("manifest.json", how, damage) for how, damage in WRONG_MANIFESTS.items()
]


@pytest.mark.parametrize(("name", "how", "damage"), CASES, ids=[f"{n} {h}" for n, h, _ in CASES])
def test_a_damaged_checkpoint_is_refused_skipped_and_written_again(
    root: Path, name: str, how: str, damage: Callable[[Path], None], capsys: pytest.CaptureFixture
) -> None:
    damage(step_path(root, 3) / name)
    engine, model = _engine()
    with pytest.raises(CheckpointError, match=re.escape(name)):
        engine.load(step_path(root, 3))
    capsys.readouterr()
    assert engine.resume(root)["step"] == 2
    warning = capsys.readouterr().out
    assert f"skipping damaged checkpoint {step_path(root, 3)}: " in warning
    assert name in warning.partition(str(step_path(root, 3)))[2]
    intact = safetensors.torch.load_file(step_path(root, 2) / "model.safetensors")
    assert_close(model.state_dict(), intact)
    _train_to(engine, root, 3)
    engine.close()
    assert problems_of(step_path(root, 3)) == []
    assert json.loads((step_path(root, 3) / "manifest.json").read_text())["step"] == 3


def test_pruning_keeps_what_was_written_below_damaged_later_steps(root: Path) -> None:
    _truncated(step_path(root, 3) / "model.safetensors")
    _edited(files=None)(step_path(root, 2) / "manifest.json")
    engine, _ = _engine()
    assert engine.resume(root)["step"] == 1
    _train_to(engine, root, 2, keep=1)
    # Step 2 is what this run has; damaged step 3 waits to be written again.
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000003"]
    _train_to(engine, root, 3, keep=1)
    engine.close()
    assert [p.name for p in root.iterdir()] == ["step-00000003"]
    assert problems_of(step_path(root, 3)) == []


def test_earlier_attempts_leftovers_are_cleaned_and_a_save_in_flight_is_not(
    root: Path,
) -> None:
    (root / ".step-00000004.tmp-abc_123").mkdir()  # a save that never completed
    os.replace(step_path(root, 3), root / ".step-00000003.old-4242")  # killed mid-replace
    engine, _ = _engine(checkpoint_format="sharded", async_checkpoint=True)
    assert engine.resume(root)["step"] == 3  # put back in place first
    assert sorted(p.name for p in root.iterdir()) == [f"step-0000000{i}" for i in (1, 2, 3)]
    _train_to(engine, root, 4)  # in the background: its temporary folder is in flight
    assert engine.resume(root)["step"] == 4  # waits for it; it is not cleaned away
    engine.close()
    assert problems_of(step_path(root, 3)) == problems_of(step_path(root, 4)) == []


@pytest.mark.parametrize(
    ("name", "damage", "said"),
    [
        ("manifest.json", _garbage, "cannot be read as JSON"),
        ("manifest.json", _edited("files"), 'it has no "files"'),
        ("model.safetensors", _truncated, "model.safetensors is truncated"),
    ],
    ids=["garbage", "no files", "model truncated"],
)
def test_ckpt_verify_says_what_is_damaged_in_one_paragraph(
    root: Path, name: str, damage: Callable[[Path], None], said: str
) -> None:
    damage(step_path(root, 3) / name)
    proc = run_ckpt("verify", str(step_path(root, 3)))
    assert proc.returncode != 0
    assert said in proc.stderr and "Traceback" not in proc.stderr
    assert "\n\n" not in proc.stderr.strip()


# -- the workers' error files ------------------------------------------------------------
def _report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    return path


def test_an_error_file_is_complete_or_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _report(tmp_path, monkeypatch)

    def killed(fd: int) -> None:
        raise KeyboardInterrupt  # the rank stopped after writing, before the rename

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", killed)
        with pytest.raises(KeyboardInterrupt):
            bootstrap.record(ValueError("first"))
    assert list(tmp_path.iterdir()) == []
    bootstrap.record(ValueError("second"))
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]
    assert json.loads(path.read_text())["dtrain"]["message"] == "ValueError: second"


def test_a_damaged_error_file_is_read_as_no_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _report(tmp_path, monkeypatch)
    bootstrap.record(ValueError("complete"))
    whole = path.read_text()
    with bootstrap.damaged_reports_ignored():
        failure = elastic_processes.ProcessFailure(0, 123, 1, str(path))
        assert failure.error_file_data["dtrain"]["message"] == "ValueError: complete"
        for damaged in (whole[: len(whole) // 2], "[]", "\xff"):
            path.write_text(damaged)
            failure = elastic_processes.ProcessFailure(0, 123, 1, str(path))
            assert "It left no traceback" in format_failures({0: failure})
    assert elastic_processes.ProcessFailure is ProcessFailure
