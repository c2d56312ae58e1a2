"""The demo's flags completed and checked, before any process starts (the launcher calls
these) and again in each worker: the model's defaults filled in, --out claimed (locked
for the run's life, see `dtrain.checkpoint.out_lock`).

Kept apart from `dtrain.demo.script` so that checking a command does not import the module the
launcher then runs as ``__main__``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from dtrain import checkpoint
from dtrain.checkpoint import out_lock
from dtrain.errors import ConfigError
from dtrain.models import check_experts_flags, check_size
from dtrain.models.recipes import TASKS

DEFAULT_OUT = "runs/demo"


def complete_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the training flags left unset with the defaults of the model's task, and
    reject values that cannot work."""
    check_size(args.model, args.model_size)
    check_experts_flags(args.model, args.experts, args.top_k)
    task = TASKS[args.model]
    for flag in ("epochs", "global_batch_size", "lr", "optimizer"):
        if getattr(args, flag) is None:
            setattr(args, flag, getattr(task, flag))
    if args.ref_batch_size is None:
        args.ref_batch_size = task.global_batch_size
    args.out = Path(args.out or DEFAULT_OUT)
    if args.keep_checkpoints < 1:
        raise ConfigError(f"--keep-checkpoints must be at least 1, got {args.keep_checkpoints}.")
    return args


def claim_out(args: argparse.Namespace, job: str | None = None) -> out_lock.OutLock:
    """Lock --out for this run, then refuse it if it holds an earlier run's checkpoints
    unless --resume continues it or --overwrite starts afresh (deleting them): mixing two
    runs there would let a later --resume pick up the wrong one. The lock comes first, so
    a run already training there is refused before anything is deleted. Called by the
    launcher, before any process starts; returns the lock, which the launcher holds until
    the run ends. The machines of one multi-machine `job` (its --master) share the lock;
    the first to take it makes the checks."""
    root = args.out / "checkpoints"
    if args.resume and args.overwrite:
        raise ConfigError(
            "--resume continues the run in --out and --overwrite deletes it; pick one."
        )
    lock = out_lock.take(args.out, job)
    if lock.shared:
        return lock
    try:
        if args.resume or not checkpoint.find_latest(root):
            return lock
        if not args.overwrite:
            raise ConfigError(
                f"{args.out} already holds checkpoints of an earlier run; add --resume to "
                "continue it, --overwrite to start afresh (deleting them), or choose another "
                "--out."
            )
        shutil.rmtree(root)
    except BaseException:
        lock.release()
        raise
    return lock
