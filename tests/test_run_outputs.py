"""What `dtrain run` leaves for a person to look at, from any script: with no --strategy,
`--nproc 2` trains with ddp and says so first; --logger csv,tensorboard writes per-step
metrics (and the script's own, via engine.log) under --out, read back here with
TensorBoard's own reader; --metrics-json holds the results when the script ends; a
dict batch with a model-returned loss and --clip-grad-norm go through the same run."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import run_cli
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

SCRIPT = """
import torch
from torch import nn
from torch.utils.data import Dataset

import dtrain


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, x, y):
        prediction = self.net(x).squeeze(1)
        return {"loss": nn.functional.mse_loss(prediction, y), "prediction": prediction}


class Pairs(Dataset):
    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 4, generator=generator)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0])

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}

"""

SCRIPT_LOOP = """
engine = dtrain.init()
model = Regressor()
model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
loader = engine.dataloader(Pairs(), global_batch_size=8)
for epoch in range(2):
    for batch in engine.progress(loader, epoch=epoch):
        engine.train_step(batch)
    engine.log({"my/epoch_end": float(epoch)})
test = engine.dataloader(Pairs(), batch_size=16, shuffle=False, drop_last=False)
engine.print(engine.evaluate(test))
"""


@pytest.mark.timeout(240)
def test_run_logs_metrics_and_results_from_any_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT + SCRIPT_LOOP)
    out = tmp_path / "out"
    proc = run_cli(
        "run",
        "--nproc",
        "2",
        "--logger",
        "csv,tensorboard",
        "--log-every",
        "4",
        "--clip-grad-norm",
        "5",
        "--out",
        str(out),
        "--metrics-json",
        str(tmp_path / "m.json"),
        str(script),
        cwd=tmp_path,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[0].startswith("dtrain: strategy ddp (2 process(es)")

    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["strategy"] == "ddp" and metrics["world_size"] == 2
    assert metrics["steps"] == 16  # 64 samples / 8 per step x 2 epochs
    assert metrics["wall_seconds"] > 0

    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    names = {row["name"] for row in rows}
    assert {"train/loss", "train/lr", "train/grad_norm", "my/epoch_end", "eval/loss"} <= names
    losses = [(int(r["step"]), float(r["value"])) for r in rows if r["name"] == "train/loss"]
    assert [step for step, _ in losses] == [4, 8, 12, 16]
    assert losses[-1][1] < losses[0][1]
    assert metrics["train_loss"] == pytest.approx(losses[-1][1])

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [4, 8, 12, 16]
    assert {"train/samples_per_second", "train/grad_norm", "eval/loss"} <= set(
        events.Tags()["scalars"]
    )


def test_a_logger_that_is_not_known_is_refused(tmp_path: Path) -> None:
    proc = run_cli("run", "--logger", "wandb", "x.py", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "Unknown --logger wandb; choose from csv, tensorboard" in proc.stderr
