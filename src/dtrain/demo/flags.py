"""The TRAINING flags of `dtrain demo` (listed in README.md), importable without torch.

The choices come from `dtrain.command_names`, which the models, optimizers and learning-rate rules
use too; the defaults left as None are the model's own, filled in by `demo_checks.complete_args`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from dtrain.command_names import GPT_SIZES, LR_RULES, MODELS, OPTIMIZERS
from dtrain.errors import ConfigError


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """Add the TRAINING flags of `dtrain demo` to `parser`."""
    g = parser.add_argument_group("training")
    g.add_argument("--model", default="cnn", choices=MODELS, help="Bundled model.")
    g.add_argument("--model-size", default=None, choices=GPT_SIZES, help="Size of --model gpt.")
    add_expert_args(g)
    g.add_argument(
        "--epochs", type=int, default=None, help="Passes over the training set (cnn/mlp 12, gpt 4)."
    )
    g.add_argument(
        "--optimizer", default=None, choices=OPTIMIZERS, help="Default: sgd (cnn/mlp), adamw (gpt)."
    )
    g.add_argument(
        "--steps",
        type=int,
        default=None,
        help="Stop once the run's optimizer step count reaches N (counting steps "
        "before a --resume); the learning-rate schedule is unchanged.",
    )
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per step over all data-parallel workers; must divide evenly "
        "(cnn/mlp 64, gpt 32).",
    )
    g.add_argument(
        "--lr",
        type=float,
        default=None,
        help="Learning rate at the reference batch (cnn/mlp 0.1, gpt 0.003).",
    )
    g.add_argument(
        "--lr-scaling",
        default="none",
        choices=LR_RULES,
        help="Scale --lr from the reference batch to the global batch.",
    )
    g.add_argument(
        "--ref-batch-size",
        type=int,
        default=None,
        help="Batch size at which --lr was tuned (default: the model's default batch).",
    )
    g.add_argument(
        "--warmup-epochs",
        type=float,
        default=None,
        help="Linear warmup from --lr to the scaled rate (default 1 epoch with "
        "linear scaling, else 0).",
    )
    g.add_argument(
        "--data",
        type=Path,
        default=None,
        metavar="DIR",
        help="Train from the shard files in DIR (`dtrain data write --dataset digits`, or "
        "text for --model gpt) instead of the bundled training set in memory; the test set "
        "stays the bundled one.",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="Save a checkpoint every N steps (default: at the end of each epoch).",
    )
    g.add_argument(
        "--keep-checkpoints",
        type=int,
        default=3,
        help="How many of the newest checkpoints to keep; the main rank deletes older ones "
        "once a new one is complete.",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="Continue from the newest intact checkpoint under --out (any strategy and "
        "world size may have written it); a restart after --max-restarts does this itself.",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="Start afresh in an --out that holds an earlier run's checkpoints, deleting them.",
    )


COUNTS = (
    ("epochs", "the number of passes over the training set"),
    ("steps", "the optimizer step to stop at"),
    ("global_batch_size", "the samples of one step"),
    ("ref_batch_size", "the batch --lr was tuned at"),
    ("checkpoint_every", "the steps between checkpoints"),
)
"""TRAINING flags that count something, with what they count: each is at least 1."""

AMOUNTS = (("lr", "a rate such as 0.1"), ("warmup_epochs", "0 for no warmup"))
"""TRAINING flags that take a finite number >= 0, with an example."""


def check_training_args(args: argparse.Namespace) -> None:
    """Refuse a TRAINING flag value that cannot work, naming its allowed range; unset
    flags (None: the model's default) pass. The launcher calls this before any process
    starts, for values from the command line and from --config alike."""
    for name, meaning in COUNTS:
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = _flag(name)
            raise ConfigError(
                f"{flag} must be at least 1, got {value}; give {meaning}, or drop {flag} for "
                "its default."
            )
    if args.data is not None and not (Path(args.data) / "index.json").is_file():
        raise ConfigError(
            f"--data {args.data} holds no index.json; write shard files there with `dtrain "
            f"data write --dataset digits --out {args.data}` (text for --model gpt)."
        )
    for name, example in AMOUNTS:
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            flag = _flag(name)
            raise ConfigError(
                f"{flag} must be a finite number >= 0, got {value}; use {example}, or drop "
                f"{flag} for its default."
            )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_expert_args(group: argparse._ArgumentGroup) -> None:
    """--experts and --top-k: the bundled GPT's mixture-of-experts MLPs."""
    group.add_argument(
        "--experts",
        type=int,
        default=0,
        help="--model gpt: each block's MLP a mixture of this many experts (0: dense).",
    )
    group.add_argument(
        "--top-k", type=int, default=2, help="With --experts: experts each token goes to."
    )
