"""A checkpoint the disk refuses (full, read-only) is named in one CheckpointError on every
rank: the folder, the space left there, what to do. Its partial folder is removed, the
checkpoint before it stays intact and `resume` lands on it; once there is room again the
run saves on. Runs on a small tmpfs (mounting one needs root). Also: a file that is no
safetensors file under that name, and a trainer.pt holding objects, are refused by name."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from torch.testing import assert_close

import dtrain
from dtrain.checkpoint import step_path
from dtrain.checkpoint.atomic import file_records
from dtrain.checkpoint.convert import convert
from dtrain.checkpoint.verify import verify
from dtrain.cli import main
from dtrain.demo import script as demo
from dtrain.errors import CheckpointError
from dtrain.models.digits import DigitsMLP

ENOSPC = "No space left on device (ENOSPC)"
FILLER = "filler"
"""The file that takes the disk's free space, beside the checkpoints' folder."""


def _mount(disk: Path, options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)],
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """An empty 2 MiB tmpfs, unmounted after the test whatever happened."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no `mount` command here to make a small disk")
    made = _mount(disk, "size=2m")
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (it needs root): {made.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def _full(room_for: str | None) -> Callable[[Path, Path], Callable[[], None]]:
    """A refusal: fill the disk, leaving room for the file `room_for` of the first
    checkpoint (None: for nothing), so the next save fails at the file after it.
    Returns what makes room again."""

    def refuse(disk: Path, root: Path) -> Callable[[], None]:
        room = (step_path(root, 1) / room_for).stat().st_blocks * 512 if room_for else 0
        (disk / FILLER).write_bytes(bytes(shutil.disk_usage(disk).free - room))
        return (disk / FILLER).unlink

    return refuse


def _read_only(disk: Path, root: Path) -> Callable[[], None]:
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    return lambda: subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)


LAYOUTS = {
    "consolidated": {},
    "sharded": {"checkpoint_format": "sharded"},
    "sharded-async": {"checkpoint_format": "sharded", "async_checkpoint": True},
}

TORCH_SAVE = ("OSError", "RuntimeError")
"""How torch.save fails: the file's own OSError, or "unexpected pos" of torch's writer."""

# (layout, refusal, the writer's own errors, the reason named): each writer in turn meets
# the full disk: safetensors, torch.save, torch.distributed.checkpoint, in the background.
CASES = [
    ("consolidated", _full(None), ("SafetensorError",), ENOSPC),
    ("consolidated", _full("model.safetensors"), TORCH_SAVE, ENOSPC),
    ("consolidated", _read_only, ("OSError",), "Read-only file system (EROFS)"),
    ("sharded", _full(None), TORCH_SAVE, ENOSPC),
    ("sharded", _full("trainer.pt"), ("CheckpointException",), ENOSPC),
    ("sharded-async", _full("trainer.pt"), ("CheckpointException",), ENOSPC),
]
IDS = [
    "consolidated model",
    "consolidated optimizer",
    "consolidated read-only",
    "sharded trainer",
    "sharded pieces",
    "sharded async pieces",
]


def _engine(**options: object) -> tuple[dtrain.Engine, torch.nn.Module]:
    engine = dtrain.init(seed=0, **options)
    model = DigitsMLP(hidden=4)
    model, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return engine, model


def _step(engine: dtrain.Engine) -> None:
    g = torch.Generator().manual_seed(engine.step)
    batch = (torch.randn(4, 64, generator=g), torch.randint(0, 10, (4,), generator=g))
    engine.train_step(batch, F.cross_entropy)


def _step_and_save(engine: dtrain.Engine, root: Path) -> None:
    _step(engine)
    demo.save(engine, root, keep=5)


def _refused_save(engine: dtrain.Engine, root: Path) -> CheckpointError:
    """Step and save; the save of step 2 fails, at once or (in the background) at the
    next save. The error it raised."""
    with pytest.raises(CheckpointError) as refused:
        _step_and_save(engine, root)
        _step_and_save(engine, root)
    return refused.value


@pytest.mark.parametrize(("layout", "refuse", "cause", "reason"), CASES, ids=IDS)
def test_a_refused_save_is_named_and_the_checkpoint_before_it_kept(
    disk: Path,
    layout: str,
    refuse: Callable[[Path, Path], Callable[[], None]],
    cause: tuple[str, ...],
    reason: str,
) -> None:
    root = disk / "checkpoints"
    engine, model = _engine(strategy="single", **LAYOUTS[layout])
    _step_and_save(engine, root)
    engine.checkpoints.finish()  # on disk, also when written in the background
    first = {k: v.clone() for k, v in model.state_dict().items()}
    make_room = refuse(disk, root)

    error = _refused_save(engine, root)
    message = str(error)
    assert type(error.__cause__).__name__ in cause  # the writer this case is about
    assert f"The checkpoint {step_path(root, 2)} could not be written: {reason} in {root}" in (
        message
    )
    assert "free" in message and "--out" in message
    if reason == ENOSPC:
        assert "this process had about" in message and "--keep-checkpoints" in message
    assert [p.name for p in root.iterdir()] == ["step-00000001"]  # no .tmp- folder left
    assert verify(step_path(root, 1)) == []
    again, resumed = _engine(strategy="single")
    assert again.resume(root)["step"] == 1
    assert_close(resumed.state_dict(), first)
    again.close()

    make_room()
    demo.save(engine, root, keep=5)
    engine.close()
    assert verify(step_path(root, engine.step)) == []


def _full_disk_on_every_rank(disk: str) -> list[str]:
    """Each variant saves step 1, meets a disk filled by rank 0 at step 2, and makes room
    again; this rank's error message of each."""
    from training import finish

    variants = [
        ({"strategy": "ddp"}, None),  # rank 0 writes alone; rank 1 learns of its failure
        ({"strategy": "ddp", **LAYOUTS["sharded-async"]}, None),  # trainer.pt, rank 0
        ({"strategy": "zero1", **LAYOUTS["sharded"]}, "trainer.pt"),  # rank 0 writes alone
        ({"strategy": "ddp", **LAYOUTS["sharded-async"]}, "trainer.pt"),  # every rank
    ]
    messages = []
    for i, (options, room_for) in enumerate(variants):
        root = Path(disk) / f"variant-{i}"
        engine, model = _engine(**options)
        _step_and_save(engine, root)
        engine.checkpoints.finish()
        if engine.is_main:
            _full(room_for)(Path(disk), root)
        dist.barrier()
        messages.append(str(_refused_save(engine, root)))
        dist.barrier()
        if engine.is_main:
            (Path(disk) / FILLER).unlink()
        del model
        finish(engine, close=i == len(variants) - 1)
    return messages


@pytest.mark.timeout(180)
def test_every_rank_raises_the_full_disk_and_none_waits(disk: Path) -> None:
    for messages in run_ranks(_full_disk_on_every_rank, 2, str(disk), timeout=150):
        for i, message in enumerate(messages):
            root = disk / f"variant-{i}"
            assert f"could not be written: {ENOSPC} in {root}" in message, message
    for i in range(4):
        root = disk / f"variant-{i}"
        assert [p.name for p in root.iterdir()] == ["step-00000001"]
        assert verify(step_path(root, 1)) == []


def test_a_file_that_is_no_safetensors_file_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    fake = tmp_path / "weights.safetensors"
    torch.save({"w": torch.ones(2)}, fake)  # a torch.save file under the wrong name
    with pytest.raises(CheckpointError, match="cannot be read as a safetensors file"):
        convert(fake, tmp_path / "out")
    assert main(["ckpt", "convert", str(fake), str(tmp_path / "out")]) == 1
    said = capsys.readouterr().err
    assert f"{fake} cannot be read as a safetensors file" in said and "Traceback" not in said
    assert not (tmp_path / "out").exists()


def test_a_trainer_state_holding_objects_is_refused_by_name(tmp_path: Path) -> None:
    engine, _ = _engine(strategy="single", checkpoint_format="sharded")
    path = tmp_path / "checkpoint"
    engine.save(path)
    trainer = path / "trainer.pt"
    state = torch.load(trainer, weights_only=True)
    torch.save({**state, "args": argparse.Namespace(lr=0.1)}, trainer)  # as scripts do
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"].update(file_records(path, ["trainer.pt"]))  # so verify passes
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"{trainer} holds Python objects"):
        engine.load(path)
    engine.close()
