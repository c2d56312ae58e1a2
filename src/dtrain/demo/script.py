"""`dtrain demo`: train a bundled model on real data that ships with scikit-learn: a
classifier on the handwritten digits, or a GPT on English text (see `dtrain.models.recipes`).

Runs as an ordinary dtrain user script (``python -m dtrain.demo`` under the launcher),
so it exercises exactly the path a user's own script takes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

import dtrain
from dtrain import checkpoint
from dtrain.config.file import add_config_arg, parse_with_config
from dtrain.data.shard_files import ShardFiles
from dtrain.data.shard_share import ShardShare
from dtrain.demo.checks import complete_args
from dtrain.demo.flags import add_training_args
from dtrain.demo.lr import LRSchedule, scale_lr
from dtrain.errors import ConfigError
from dtrain.launcher.topology_flags import add_topology_args
from dtrain.models import build
from dtrain.models.gpt import GPT
from dtrain.models.recipes import TASKS, make_optimizer
from dtrain.observe.flops import gpt_throughput
from dtrain.observe.metrics import format_table
from dtrain.process.logs import LOGGER
from dtrain.step.batches import check_batch

DEFAULT_SEED = 0
"""The demo's seed when --seed is not given, so that two runs of it train alike."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the demo's command line and fill the model's defaults.

    TOPOLOGY flags are accepted and left to the launcher, which has already put them into
    the environment that `dtrain.init` reads. A ``--config`` file is read as the launcher
    read it, so the training flags it sets reach every worker.
    """
    parser = argparse.ArgumentParser(prog="dtrain demo")
    add_config_arg(parser)
    add_topology_args(parser)
    add_training_args(parser)
    return complete_args(parse_with_config(parser, argv))


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Train, evaluate and report; returns the metrics (also written with --metrics-json,
    by the Engine when it closes)."""
    wall_start = time.perf_counter()
    args = parse_args(argv)
    seed = DEFAULT_SEED if args.seed is None else args.seed
    engine = dtrain.init(seed=seed, out=str(args.out))
    engine.log_to(args.out / "logs")
    per_worker = check_batch(
        args.global_batch_size,
        engine.dp_size,
        engine.strategy.placement.micro_splits,
        engine.config.grad_accumulation,
    )

    task = TASKS[args.model]
    model = build(args.model, args.model_size, args.experts, args.top_k)
    train_set, test_set = task.data(model)
    lr = scale_lr(args.lr, args.global_batch_size, args.ref_batch_size, args.lr_scaling)
    optimizer = make_optimizer(args.optimizer, model, lr)
    gpt = model if isinstance(model, GPT) else None
    parameters = sum(p.numel() for p in model.parameters())  # the whole model, before a split
    model, optimizer = engine.setup(model, optimizer)
    data = train_set if args.data is None else ShardFiles(args.data)
    loader = engine.dataloader(data, batch_size=per_worker)
    if args.data is not None:
        check_shards(loader.dataset, train_set, args)
    test_loader = engine.dataloader(
        test_set, batch_size=max(1, 256 // engine.dp_size), shuffle=False, drop_last=False
    )
    steps_per_epoch = len(loader)
    warmup_epochs = args.warmup_epochs
    if warmup_epochs is None:
        warmup_epochs = 1.0 if args.lr_scaling == "linear" else 0.0
    schedule = LRSchedule(
        peak=lr,
        start=args.lr,
        warmup_steps=round(warmup_epochs * steps_per_epoch),
        total_steps=args.epochs * steps_per_epoch,
    )
    ckpt_root = args.out / "checkpoints"
    if args.resume or engine.restart_count > 0:
        if engine.restart_count:
            engine.print(
                f"dtrain: the launcher restarted the workers (restart {engine.restart_count}: a "
                "process failed, or machines joined or left); resuming from the last checkpoint."
            )
        resume_from(engine, ckpt_root)
    max_steps = args.steps if args.steps is not None else args.epochs * steps_per_epoch
    engine.print(
        f"dtrain demo: {args.model} on {task.description} "
        f"({len(data)} train / {len(test_set)} test samples"
        f"{'' if args.data is None else f' from {args.data}'}), "
        f"strategy {engine.strategy.name}, {engine.world_size} process(es), "
        f"global batch {args.global_batch_size} ({per_worker} per worker), "
        f"lr {lr:g}"
        + (
            f" ({args.lr_scaling} scaling from {args.lr:g} at batch {args.ref_batch_size})"
            if args.lr_scaling != "none"
            else ""
        )
    )
    note = task.batch_note(args.global_batch_size)
    if note is not None:
        engine.print(f"dtrain demo: note: {note}")
    LOGGER.info("args %s", vars(args))

    # One final loss everywhere (the progress bar's last value, each rank's log, the table,
    # the metrics JSON): the last step's loss over the global batch, as the Engine reads it.
    for epoch in range(args.epochs):
        if engine.step >= max_steps:
            break
        epoch_start_step = engine.step
        for batch in engine.progress(loader, epoch=epoch):
            schedule.apply(optimizer, engine.step)
            engine.train_step(batch, task.loss)
            if args.checkpoint_every and engine.step % args.checkpoint_every == 0:
                save(engine, ckpt_root, args.keep_checkpoints)
            if engine.step >= max_steps:
                engine.check_loss()  # read before the bar closes on breaking out
                break
        if engine.step == epoch_start_step:
            continue  # an epoch the resumed checkpoint had already trained
        if not args.checkpoint_every:
            save(engine, ckpt_root, args.keep_checkpoints)
        LOGGER.info(
            "epoch %d done at step %d, loss %.4f (the last step's, global batch)",
            epoch,
            engine.step,
            engine.check_loss(),
        )

    save(engine, ckpt_root, args.keep_checkpoints)  # the final model is always on disk
    last_loss = engine.check_loss()
    result = engine.evaluate(test_loader, task.loss)
    metrics: dict[str, object] = {
        "strategy": engine.strategy.name,
        "world_size": engine.world_size,
        "model": args.model,
        "steps": engine.step,
        "global_batch_size": args.global_batch_size,
        "learning_rate": lr,
        "train_loss": last_loss,
        **task.metrics(result),
        "samples_per_second": engine.throughput.samples_per_second,
        "wall_seconds": time.perf_counter() - wall_start,
    }
    if gpt is not None:
        metrics |= gpt_throughput(
            gpt.config,
            parameters,
            engine.throughput.samples_per_second,
            engine.world_size,
            engine.topology.device,
            engine.config.precision,
        )
    if engine.config.memory_report:
        metrics["memory"] = engine.memory_report()
    engine.report.results.update(metrics)  # the metrics JSON, written by engine.close
    if engine.is_main:  # the model-state table follows, printed by engine.close
        rows = [(k, v) for k, v in metrics.items() if v is not None and k != "memory"]
        print(format_table(rows), flush=True)
        print(
            f"Checkpoints in {ckpt_root}, logs in {args.out / 'logs'} (one per rank).", flush=True
        )
    LOGGER.info("metrics %s", metrics)
    engine.close()
    return metrics


def check_shards(share: ShardShare, bundled: Any, args: argparse.Namespace) -> None:
    """A ConfigError if the samples of the shard files in --data are not shaped as those of
    the model's bundled training set (they hold another data set)."""
    got, wanted = _shapes(share.example()), _shapes(bundled[0])
    if got != wanted:
        dataset = "text" if args.model == "gpt" else "digits"
        raise ConfigError(
            f"--data {args.data} holds samples of shapes {got}, but --model {args.model} "
            f"trains on samples of shapes {wanted}; write its data set there with `dtrain "
            f"data write --dataset {dataset} --out DIR`."
        )


def _shapes(sample: tuple[Any, ...]) -> list[tuple[int, ...]]:
    return [tuple(torch.as_tensor(value).shape) for value in sample]


def save(engine: dtrain.Engine, root: Path, keep: int) -> None:
    """Checkpoint to ``root/step-NNNNNNNN`` unless that step is saved; keep the newest `keep`.

    Whether the step is saved is decided once, on the main rank, for every rank (ranks
    that looked for themselves could disagree and wait on each other forever); the main
    rank alone deletes older checkpoints, once the new one is complete.
    """
    path = checkpoint.step_path(root, engine.step)
    if engine.checkpoints.saved(path):
        return
    engine.save(path, keep=keep)


def resume_from(engine: dtrain.Engine, root: Path) -> None:
    """Load the newest intact checkpoint under `root`, or say that there is none."""
    manifest = engine.resume(root)
    if manifest is None:
        engine.print(f"No checkpoint under {root} to resume from; starting from scratch.")
        return
    layout = "sharded" if checkpoint.is_sharded(manifest) else "consolidated"
    engine.print(
        f"Resumed at step {manifest['step']} from a {layout} checkpoint written by "
        f"{manifest['strategy']} at world size {manifest['world_size']}."
    )
