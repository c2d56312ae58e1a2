"""Checkpoints travel: plain PyTorch files in and out, damaged files refused, a killed
worker survived by restarting from the last checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import run_ckpt, run_cli
from torch.testing import assert_close
from training import train

import dtrain
from dtrain.checkpoint import latest_intact, step_path
from dtrain.errors import CheckpointError
from dtrain.models.digits import DigitsMLP


def fresh_engine() -> tuple[dtrain.Engine, torch.nn.Module]:
    engine = dtrain.init(strategy="single")
    torch.manual_seed(123)  # different weights from the ones saved
    model, _ = engine.setup(DigitsMLP(hidden=8))
    return engine, model


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    return DigitsMLP(hidden=8).state_dict()


@pytest.mark.parametrize(
    "layout",
    ["bare", "dataparallel", "ddp-dict", "state_dict_model", "compiled"],
)
def test_plain_pytorch_files_load_whatever_wrote_them(
    tmp_path: Path, weights: dict, layout: str
) -> None:
    prefixed = {f"module.{k}": v for k, v in weights.items()}
    content = {
        "bare": weights,
        "dataparallel": prefixed,
        "ddp-dict": {"epoch": 3, "state_dict": prefixed, "optim_dict": {"state": {}}},
        "state_dict_model": {"state_dict_model": weights, "epoch": 1},
        "compiled": {"model": {f"_orig_mod.{k}": v for k, v in weights.items()}},
    }[layout]
    file = tmp_path / "saved.pth"
    torch.save(content, file)
    engine, model = fresh_engine()
    engine.load(file)
    assert_close(model.state_dict(), weights)


def test_convert_both_ways_and_inspect(tmp_path: Path, weights: dict) -> None:
    src = tmp_path / "ddp.pt"
    prefixed = {f"module.{k}": v for k, v in weights.items()}
    torch.save({"epoch": 2, "state_dict": prefixed, "optim_dict": {"state": {}}}, src)
    ckpt, back = tmp_path / "ckpt", tmp_path / "back.pt"
    converted = run_ckpt("convert", str(src), str(ckpt))
    assert converted.returncode == 0
    # The epoch travels (a resume starts it); what could not, the message names.
    assert "at epoch 2" in converted.stdout and "Left behind: 'optim_dict'" in converted.stdout
    assert json.loads((ckpt / "manifest.json").read_text())["epoch"] == 2
    assert run_ckpt("verify", str(ckpt)).returncode == 0
    inspect = run_ckpt("inspect", str(ckpt))
    assert "imported" in inspect.stdout and "net.1.weight" in inspect.stdout
    assert run_ckpt("convert", str(ckpt), str(back)).returncode == 0
    model = DigitsMLP(hidden=8)
    model.load_state_dict(torch.load(back, weights_only=True))
    assert_close(model.state_dict(), weights)
    engine, loaded = fresh_engine()
    engine.load(ckpt)  # an imported checkpoint has no optimizer state: model only
    assert_close(loaded.state_dict(), weights)


class Payload:
    """Unpickling this runs a shell command; a loader must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_payload_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    file = tmp_path / "evil.pt"
    torch.save({"state_dict": Payload(marker)}, file)
    engine, _ = fresh_engine()
    with pytest.raises(CheckpointError, match="will not unpickle"):
        engine.load(file)
    proc = run_ckpt("convert", str(file), str(tmp_path / "out"))
    assert proc.returncode == 1 and "will not unpickle" in proc.stderr
    assert not marker.exists()


def test_a_damaged_checkpoint_is_refused_and_resume_falls_back(tmp_path: Path) -> None:
    engine = dtrain.init(strategy="single")
    model = DigitsMLP(hidden=8)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    root = tmp_path / "ckpts"
    engine.position.stepped(1, one_batch=False)  # as an optimizer step would
    engine.save(step_path(root, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine.position.stepped(2, one_batch=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    engine.save(step_path(root, 2))
    damaged = step_path(root, 2) / "model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated"):
        engine.load(step_path(root, 2))
    latest, warnings = latest_intact(root)
    assert latest == step_path(root, 1) and "skipping damaged checkpoint" in warnings[0]
    assert engine.resume(root)["step"] == 1
    assert_close(model.state_dict(), before)
    assert damaged.exists()  # nothing was overwritten or deleted


KILLED_AND_RESTARTED = """
import os, signal, sys
import safetensors.torch, torch, torch.nn.functional as F
import dtrain
from dtrain.checkpoint import step_path
from dtrain.datasets import load_digits
from dtrain.models.digits import DigitsMLP

root, out = sys.argv[1], sys.argv[2]
engine = dtrain.init(seed=0)
model = DigitsMLP(hidden=32)
model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
engine.resume(root)
loader = engine.dataloader(load_digits()[0], batch_size=12 // engine.dp_size)
epoch = engine.epoch
while engine.step < 10:
    for batch in engine.progress(loader, epoch=epoch):
        engine.train_step(batch, F.cross_entropy)
        engine.save(step_path(root, engine.step))
        if engine.restart_count == 0 and engine.step == 6 and engine.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if engine.step == 10:
            break
    epoch += 1
state = engine.state_dict()
if engine.is_main:
    safetensors.torch.save_file(state, out)
"""


@pytest.mark.timeout(240)
def test_a_killed_worker_is_survived_by_restarting_from_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text(KILLED_AND_RESTARTED)
    out = tmp_path / "final.safetensors"
    proc = run_cli(
        "run",
        "--strategy",
        "ddp",
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        "--timeout",
        "60",
        str(script),
        str(tmp_path / "ckpts"),
        str(out),
        cwd=tmp_path,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close(safetensors.torch.load_file(out), train(steps=10, strategy="single"))


def test_a_partial_load_skips_the_optimizer_state_of_what_it_skips(tmp_path: Path) -> None:
    def make(outputs: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, outputs))

    batch = (torch.randn(4, 4), torch.randint(0, 2, (4,)))
    engine = dtrain.init(strategy="single")
    model = make(2)
    model, optimizer = engine.setup(model, torch.optim.Adam(model.parameters()))
    engine.train_step(batch, torch.nn.functional.cross_entropy)
    engine.save(tmp_path / "two")
    engine.close()
    engine = dtrain.init(strategy="single")
    model = make(3)
    model, optimizer = engine.setup(model, torch.optim.Adam(model.parameters()))
    engine.load(tmp_path / "two", strict=False)
    assert set(optimizer.state) == set(model[0].parameters())  # the matching layer only
    engine.train_step(batch, torch.nn.functional.cross_entropy)  # and training goes on
    engine.close()
