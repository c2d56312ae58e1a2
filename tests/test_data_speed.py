"""A data-bound run is told which loader knob to turn, with the wait it measured; the
loader's defaults pin memory for a GPU only."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import dtrain
from dtrain.engine.data_side import loader_defaults
from dtrain.observe.diagnosis import Reading, diagnose


def hungry(data: float, step: float) -> dict[str, float]:
    """A step of `step` seconds that waits `data` of them for its batch."""
    rest = step - data
    return dict(
        data=data, forward=rest / 2, backward=rest / 4, communication=0.0, optimizer=rest / 4,
        other=0.0, step=step,
    )  # fmt: skip


def test_the_data_advice_names_the_workers_it_saw_and_how_many_to_use() -> None:
    [cause] = diagnose([hungry(0.040, 0.050)], reading=Reading(0, cores=16, unpinned=False))
    assert cause["cause"] == "data"
    message = cause["message"]
    assert "waits 40.0 ms of its 50.0 ms for the next batch (80%) with num_workers=0" in message
    # Made in 40 ms, a batch is needed every 10 ms of compute: 4 workers keep up.
    assert "Pass num_workers=4 to engine.dataloader" in message
    assert "pin_memory" not in message and "CPU core" not in message
    # 2 workers feed a 50 ms step: each makes a batch in 100 ms; 10 keep up with 10 ms.
    [cause] = diagnose([hungry(0.040, 0.050)], reading=Reading(2, cores=4, unpinned=True))
    message = cause["message"]
    assert "with num_workers=2" in message and "Pass num_workers=10" in message
    assert "and pin_memory=True" in message
    assert "This machine has 4 CPU core(s) per training process: more than 3" in message
    # A short wait still asks for one worker more than the loader has.
    [cause] = diagnose([hungry(0.011, 0.050)], reading=Reading(0, cores=16, unpinned=False))
    assert "Pass num_workers=1 " in cause["message"]
    [cause] = diagnose([hungry(0.040, 0.050)])  # a loader the Engine did not see
    assert "(80%): the input pipeline" in cause["message"] and "(num_workers)" in cause["message"]


def test_memory_is_pinned_by_default_for_a_gpu_only() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert loader_defaults({}, cpu) == {"pin_memory": False}
    assert loader_defaults({"num_workers": 2}, gpu) == {"pin_memory": True, "num_workers": 2}
    assert loader_defaults({"pin_memory": False}, gpu) == {"pin_memory": False}
    assert loader_defaults({"pin_memory": True}, cpu) == {"pin_memory": True}


class Slow(Dataset):
    """Samples that take 3 ms each to make: a decoder slower than a tiny model."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.003)
        return torch.full((8,), float(i % 7)), torch.tensor(i % 2)


def test_a_data_bound_run_is_told_its_wait_and_workers(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.json"
    engine = dtrain.init(strategy="single", seed=0, metrics_json=str(metrics))
    model = nn.Linear(8, 2)
    engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = engine.dataloader(Slow(), batch_size=8)
    for batch in engine.progress(loader):
        engine.train_step(batch, F.cross_entropy)
        if engine.step == 10:
            break
    engine.close()
    causes = json.loads(metrics.read_text())["diagnosis"]
    [message] = [c["message"] for c in causes if c["cause"] == "data"]
    wait = re.search(r"waits ([\d.]+) ms of its [\d.]+ ms .* with num_workers=0", message)
    assert wait is not None and float(wait.group(1)) >= 8 * 3  # 8 samples of 3 ms at least
    assert re.search(r"Pass num_workers=\d+ to engine.dataloader", message)
