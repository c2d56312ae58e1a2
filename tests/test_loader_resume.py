"""`engine.dataloader`'s loader resumes by itself: a run interrupted after k steps, saved,
and continued by a fresh engine that loads the checkpoint ends with the parameters of the
uninterrupted run, whatever loop reads the loader (``for batch in loader``, ``iter`` and
``next``, ``enumerate`` over epochs from `engine.epoch`, `engine.progress`, an epoch chosen
by ``set_epoch``), made before or after the load, map-style or stream, with DataLoader
workers, and under ddp."""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn
from torch.testing import assert_close
from torch.utils.data import IterableDataset, TensorDataset
from training import finish

import dtrain

SIZE = 48
GLOBAL_BATCH = 8  # 6 steps an epoch
STEPS = 14  # into the third epoch
EPOCHS = 3
MID_EPOCH = 9  # 3 steps into epoch 1
END_OF_EPOCH = 6  # the last step of epoch 0


def samples() -> TensorDataset:
    """`SIZE` float64 samples of 6 features and 3 classes, the same whatever torch's seed."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(SIZE, 6, generator=generator, dtype=torch.float64)
    return TensorDataset(inputs, torch.randint(0, 3, (SIZE,), generator=generator))


class Stream(IterableDataset):
    """The samples of `samples()` in an order of its own, shuffled by epoch (``set_epoch``)."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        inputs, targets = samples().tensors
        generator = torch.Generator().manual_seed(self.epoch)
        for i in torch.randperm(SIZE, generator=generator).tolist():
            yield inputs[i], targets[i]


def step(engine: dtrain.Engine, batch: Any) -> None:
    engine.train_step(batch, F.cross_entropy)


def plain(engine: dtrain.Engine, loader: Any, steps: int) -> None:
    """``for batch in loader``, pass after pass, to step `steps`."""
    while engine.step < steps:
        for batch in loader:
            step(engine, batch)
            if engine.step == steps:
                return


def by_next(engine: dtrain.Engine, loader: Any, steps: int) -> None:
    """``next`` on ``iter(loader)``, a new iterator at the end of each epoch."""
    batches = iter(loader)
    while engine.step < steps:
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        step(engine, batch)


def numbered(engine: dtrain.Engine, loader: Any, steps: int) -> None:
    """Epochs from `engine.epoch` (the checkpoint's after a load), ``enumerate(loader)``
    in each; the loader's pass is the epoch the loop counts."""
    for epoch in range(engine.epoch, EPOCHS):
        for _, batch in enumerate(loader):
            step(engine, batch)
            assert engine.epoch == epoch
            if engine.step == steps:
                return


def chosen(engine: dtrain.Engine, loader: Any, steps: int) -> None:
    """Every epoch from 0, chosen by ``loader.set_epoch`` (a script that knows nothing of
    the load: the epochs the checkpoint had trained read nothing)."""
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for batch in loader:
            step(engine, batch)
            if engine.step == steps:
                return


def progress(engine: dtrain.Engine, loader: Any, steps: int) -> None:
    """`engine.progress` for every epoch from 0."""
    for epoch in range(EPOCHS):
        for batch in engine.progress(loader, epoch):
            step(engine, batch)
            if engine.step == steps:
                return


def evaluating(engine: dtrain.Engine, loader: Any, steps: int) -> None:
    """A plain loop that evaluates after every step: `engine.evaluate` on a loader with
    drop_last (as for training) and on the training loader itself, in the middle of its
    pass, and a ``torch.no_grad()`` loop; none of them moves the position."""
    validation = engine.dataloader(samples(), global_batch_size=16)
    while engine.step < steps:
        for batch in loader:
            step(engine, batch)
            engine.evaluate(validation, F.cross_entropy)
            engine.evaluate(loader, F.cross_entropy)
            with torch.no_grad():
                for inputs, _ in validation:
                    engine.module(inputs)
            if engine.step == steps:
                return


def mixed(engine: dtrain.Engine, loader: Any, steps: int) -> None:
    """`engine.progress` over the epoch training is in, then plain passes: the resume
    point is taken once, by progress's pass."""
    for batch in engine.progress(loader, engine.epoch):
        step(engine, batch)
    assert engine.position.resume_at is None
    plain(engine, loader, steps)


def validated(engine: dtrain.Engine, loader: Any, steps: int, threaded: bool = False) -> None:
    """A plain loop that reads a validation loader made as the training one (drop_last)
    after every step: with gradients on, or (`threaded`) under ``torch.no_grad()`` but in a
    background thread (where gradients are on); no step trains from it."""
    validation = engine.dataloader(samples(), global_batch_size=16)

    def check() -> None:
        for inputs, _ in validation:
            engine.module(inputs)

    while engine.step < steps:
        for batch in loader:
            step(engine, batch)
            if threaded:
                with torch.no_grad():
                    reader = threading.Thread(target=check)
                    reader.start()
                    reader.join()
            else:
                check()
            if engine.step == steps:
                return


def one_ahead(loader: Any) -> Iterator[Any]:
    """The batches of one pass over `loader`, each read one batch ahead (apex's
    data_prefetcher, timm's PrefetchLoader)."""
    batches = iter(loader)
    ahead = next(batches, None)
    while ahead is not None:
        batch, ahead = ahead, next(batches, None)
        yield batch


def prefetched(engine: dtrain.Engine, loader: Any, steps: int) -> None:
    """Passes read one batch ahead, stepped by train_step."""
    while engine.step < steps:
        for batch in one_ahead(loader):
            step(engine, batch)
            if engine.step == steps:
                return


def by_hand(engine: dtrain.Engine, batch: Any) -> None:
    """Forward and `engine.backward` of one batch, as a loop written by hand."""
    inputs, targets = engine.to_device(batch)
    engine.backward(F.cross_entropy(engine.model(inputs), targets))


def prefetched_by_hand(engine: dtrain.Engine, loader: Any, steps: int) -> None:
    """Passes read one batch ahead, each step written by hand (apex's example loop)."""
    assert engine.optimizer is not None
    while engine.step < steps:
        for batch in one_ahead(loader):
            by_hand(engine, batch)
            engine.optimizer.step()
            engine.optimizer.zero_grad()
            if engine.step == steps:
                return


def accumulated_by_hand(engine: dtrain.Engine, loader: Any, steps: int) -> None:
    """Two loader batches a step, accumulated by hand (half the loss each)."""
    assert engine.optimizer is not None
    while engine.step < steps:
        for i, batch in enumerate(loader):
            inputs, targets = engine.to_device(batch)
            engine.backward(F.cross_entropy(engine.model(inputs), targets) / 2)
            if i % 2 == 1:
                engine.optimizer.step()
                engine.optimizer.zero_grad()
                if engine.step == steps:
                    return


def cycled(engine: dtrain.Engine, loader: Any, steps: int) -> None:
    """``itertools.cycle(loader)``: its first pass, cached, replayed as every later one."""
    for batch in itertools.cycle(loader):
        step(engine, batch)
        if engine.step == steps:
            return


LOOPS: dict[str, Callable[[dtrain.Engine, Any, int], None]] = {
    "plain": plain,
    "next": by_next,
    "enumerate": numbered,
    "set_epoch": chosen,
    "progress": progress,
    "mixed": mixed,
    "evaluating": evaluating,
    "validated": validated,
    "threaded": functools.partial(validated, threaded=True),
    "prefetched": prefetched,
    "prefetched_by_hand": prefetched_by_hand,
}
ONLY_THEIR_OWN = {"accumulated_by_hand": accumulated_by_hand, "cycled": cycled}
"""Loops whose runs differ from the others' (two batches a step; an epoch replayed)."""


def train(
    steps: int,
    loop: str = "plain",
    load: str | None = None,
    save: str | None = None,
    made: str = "before",
    stream: bool = False,
    strategy: str = "single",
    torch_seed: int = 0,
    evaluate_first: bool = False,
    close: bool = True,
    **loader_kwargs: Any,
) -> dict[str, torch.Tensor] | None:
    """Train to step `steps` with `loop`, from the checkpoint `load` if given (the loader
    made `made` the load), saving one at `save` if given; the parameters (main rank).
    No --seed: the shuffle seed is drawn from torch's generator (seeded `torch_seed`), so
    a resumed run must take the checkpoint's. `evaluate_first`: evaluate right after the
    load, on a loader without drop_last, one with, and the training loader (none may take
    the resume point)."""
    engine = dtrain.init(strategy=strategy)
    torch.manual_seed(torch_seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, optimizer = engine.setup(model, optimizer)

    def make() -> Any:
        data = Stream() if stream else samples()
        return engine.dataloader(data, global_batch_size=GLOBAL_BATCH, **loader_kwargs)

    loader = make() if made == "before" else None
    if load is not None:
        engine.load(load)
    loader = make() if loader is None else loader
    if evaluate_first:
        for drop_last in (False, True):
            evaluation = engine.dataloader(samples(), global_batch_size=16, drop_last=drop_last)
            engine.evaluate(evaluation, F.cross_entropy)
        engine.evaluate(loader, F.cross_entropy)
    {**LOOPS, **ONLY_THEIR_OWN}[loop](engine, loader, steps)
    if save is not None:
        engine.save(save)
    del model, optimizer
    return finish(engine, close)


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, torch.Tensor] | None]:
    """Uninterrupted runs, map-style and stream."""
    return {"map": train(STEPS), "stream": train(STEPS, stream=True)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], str]:
    """Checkpoints of runs stopped at MID_EPOCH and END_OF_EPOCH by a plain loop, by one
    that evaluates after each step and by progress, map-style; and at MID_EPOCH by a plain
    loop over the stream."""
    root = tmp_path_factory.mktemp("loader_resume")
    paths = {}
    for loop in ("plain", "evaluating", "progress"):
        for steps in (MID_EPOCH, END_OF_EPOCH):
            paths[loop, steps] = str(root / f"{loop}-{steps}")
            train(steps, loop, save=paths[loop, steps])
    paths["stream", MID_EPOCH] = str(root / "stream")
    train(MID_EPOCH, stream=True, save=paths["stream", MID_EPOCH])
    return paths


def test_a_plain_loop_records_where_it_stands(saved: dict[tuple[str, int], str]) -> None:
    """A checkpoint saved inside a plain loop holds the loop's epoch and samples, as one
    saved inside progress does, whatever it evaluated in between."""
    for loop in ("plain", "evaluating", "progress"):
        for steps, epoch, trained in ((MID_EPOCH, 1, 3), (END_OF_EPOCH, 0, 6)):
            trainer = torch.load(Path(saved[loop, steps]) / "trainer.pt", weights_only=False)
            where = (trainer["epoch"], trainer["samples_in_epoch"])
            assert where == (epoch, trained * GLOBAL_BATCH), (loop, steps)


@pytest.mark.parametrize("made", ["before", "after"])
@pytest.mark.parametrize("loop", list(LOOPS))
def test_any_loop_continues_as_the_uninterrupted_run(
    loop: str, made: str, reference: dict[str, Any], saved: dict[tuple[str, int], str]
) -> None:
    """Resumed mid-epoch from the checkpoints of a plain loop, of one that evaluates after
    each step and of progress, under a different torch seed (the loader draws another
    shuffle seed)."""
    for writer in ("plain", "evaluating", "progress"):
        resumed = train(STEPS, loop, load=saved[writer, MID_EPOCH], made=made, torch_seed=1)
        assert_close(resumed, reference["map"], msg=lambda m, w=writer: f"{w}: {m}")


@pytest.mark.parametrize("loop", ["plain", "next", "enumerate", "set_epoch", "progress"])
def test_a_checkpoint_at_an_epochs_end_continues_with_the_next(
    loop: str, reference: dict[str, Any], saved: dict[tuple[str, int], str]
) -> None:
    resumed = train(STEPS, loop, load=saved["plain", END_OF_EPOCH], torch_seed=1)
    assert_close(resumed, reference["map"])


@pytest.mark.parametrize("loop", ["validated", "threaded", "prefetched", "prefetched_by_hand"])
def test_only_trained_batches_move_the_position(
    loop: str, reference: dict[str, Any], tmp_path: Path
) -> None:
    """A validation loader read with gradients on (in this thread, or under no_grad in
    another) trains no step and moves nothing; a batch read ahead is not yet trained. A
    run interrupted mid-epoch and at an epoch's end continues as the uninterrupted one."""
    for steps, epoch, trained in ((MID_EPOCH, 1, 3), (END_OF_EPOCH, 0, 6)):
        path = str(tmp_path / f"{loop}-{steps}")
        train(steps, loop, save=path)
        trainer = torch.load(Path(path) / "trainer.pt", weights_only=False)
        assert (trainer["epoch"], trainer["samples_in_epoch"]) == (epoch, trained * GLOBAL_BATCH)
        resumed = train(STEPS, loop, load=path, torch_seed=1)
        assert_close(resumed, reference["map"], msg=lambda m, s=steps: f"at {s}: {m}")


def test_batches_accumulated_by_hand_count_as_one_step(tmp_path: Path) -> None:
    """Two loader batches a step (3 steps an epoch): interrupted one step into epoch 1
    and at its end, the run continues as the uninterrupted one."""
    expected = train(7, "accumulated_by_hand")
    for steps, trained in ((4, 2), (6, 6)):
        path = str(tmp_path / str(steps))
        train(steps, "accumulated_by_hand", save=path)
        trainer = torch.load(Path(path) / "trainer.pt", weights_only=False)
        assert (trainer["epoch"], trainer["samples_in_epoch"]) == (1, trained * GLOBAL_BATCH)
        resumed = train(7, "accumulated_by_hand", load=path, torch_seed=1)
        assert_close(resumed, expected, msg=lambda m, s=steps: f"at {s}: {m}")


def test_a_loader_wrapped_in_itertools_cycle_is_refused_at_the_resume(tmp_path: Path) -> None:
    """itertools.cycle replays the first epoch: the checkpoint counts more batches of it
    than it holds, and the resume is refused by name instead of reading an empty pass."""
    path = str(tmp_path / "cycled")
    train(END_OF_EPOCH + 2, "cycled", save=path)
    with pytest.raises(dtrain.SetupError, match="itertools.cycle"):
        train(STEPS, "cycled", load=path)


def test_evaluations_leave_the_resume_point_alone(
    reference: dict[str, Any], saved: dict[tuple[str, int], str]
) -> None:
    resumed = train(STEPS, load=saved["plain", MID_EPOCH], evaluate_first=True)
    assert_close(resumed, reference["map"])


def test_a_training_pass_after_a_read_ahead_pass_is_refused(
    reference: dict[str, Any], saved: dict[tuple[str, int], str]
) -> None:
    """A batch read ahead with gradients off is an evaluation's and takes nothing; with
    them on, its pass takes the resume point, and a new pass that would train the epoch's
    first batches again is refused by name."""
    engine = dtrain.init(strategy="single")
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    model, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.2))
    loader = engine.dataloader(samples(), global_batch_size=GLOBAL_BATCH)
    engine.load(saved["plain", MID_EPOCH])
    with torch.no_grad():
        next(iter(loader))
    assert engine.position.resume_at is not None
    next(iter(loader))
    assert engine.position.resume_at is None
    with pytest.raises(dtrain.SetupError, match="another pass started training before any"):
        next(iter(loader))
    del model
    engine.close()


@pytest.mark.parametrize("loop", ["plain", "next"])
def test_dataloader_workers_resume_map_style_and_streams(
    loop: str, reference: dict[str, Any], saved: dict[tuple[str, int], str]
) -> None:
    map_style = train(STEPS, loop, load=saved["plain", MID_EPOCH], num_workers=2)
    assert_close(map_style, reference["map"])
    stream = train(STEPS, loop, load=saved["stream", MID_EPOCH], stream=True, num_workers=2)
    assert_close(stream, reference["stream"])


def test_persistent_workers_of_a_stream_made_before_the_load_resume(
    reference: dict[str, Any], saved: dict[tuple[str, int], str]
) -> None:
    resumed = train(
        STEPS,
        load=saved["stream", MID_EPOCH],
        stream=True,
        num_workers=1,
        persistent_workers=True,
    )
    assert_close(resumed, reference["stream"])


def under_ddp(directory: str) -> list[dict[str, torch.Tensor] | None]:
    """In two ddp processes: interrupted at MID_EPOCH by a plain loop and saved; resumed by
    a fresh engine with a plain loop (loader made before the load) and with ``next`` (made
    after), each rank seeding torch apart."""
    path = str(Path(directory) / "ddp")
    train(MID_EPOCH, save=path, strategy="ddp", close=False)
    return [
        train(STEPS, load=path, strategy="ddp", torch_seed=5, close=False),
        train(STEPS, "next", load=path, made="after", strategy="ddp", torch_seed=6),
    ]


@pytest.mark.timeout(120)
def test_ddp_resumes_a_plain_loop_as_single_runs_uninterrupted(tmp_path: Path) -> None:
    resumed = run_ranks(under_ddp, 2, str(tmp_path), timeout=110)[0]
    expected = train(STEPS)
    for run in resumed:
        assert_close(run, expected)
