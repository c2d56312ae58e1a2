"""The TOPOLOGY flags shared by `dtrain run` and `dtrain demo`, generated from Config.

Importable without torch (as is Config), so `--help` and every flag error answer at once.
"""

from __future__ import annotations

import argparse
import sys
import typing
from dataclasses import fields

from dtrain.command_names import STRATEGIES, check_strategy
from dtrain.config import Config
from dtrain.config.rules.choices import flag_of
from dtrain.launcher import schedulers

SCHEDULED = ("nnodes", "node_rank", "master", "nproc")
"""Fields a scheduler may set; their flags default to None so that a flag given (on the
command line or in --config) is told apart from one left out."""


def _device_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1,3, got {text!r}") from None


def _node_count(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (elastic) as (fewest, most) machines."""
    low, _, high = text.partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of machines such as 2, or a range MIN:MAX such as 2:4, got {text!r}"
        ) from None


def _name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


CONVERTERS = {"devices": _device_list, "nnodes": _node_count} | dict.fromkeys(
    ("blocks", "split_points", "logger", "hosts"), _name_list
)
"""The fields whose flag takes more than a plain number or name, with its converter."""


def add_topology_args(parser: argparse.ArgumentParser) -> None:
    """TOPOLOGY flags, generated from :class:`Config`'s fields and their help."""
    group = parser.add_argument_group("topology")
    hints = typing.get_type_hints(Config)
    for f in fields(Config):
        if "help" not in f.metadata:
            continue
        flag = flag_of(f)
        kind = hints[f.name]
        if kind is bool:
            group.add_argument(flag, dest=f.name, action="store_true", help=f.metadata["help"])
            continue
        plain = typing.get_args(kind)[0] if typing.get_args(kind) else kind
        convert = CONVERTERS.get(f.name, plain)
        help_text = f.metadata["help"]
        if f.name == "strategy":
            help_text += " One of: " + ", ".join(STRATEGIES) + "."
        default = None if f.name in SCHEDULED else f.default
        group.add_argument(
            *flag.split("/"), dest=f.name, type=convert, default=default, help=help_text
        )


def config_from(args: argparse.Namespace) -> Config:
    """The Config given by the parsed TOPOLOGY flags, completed by the scheduler's
    variables (Slurm, Kubeflow) for the nodes the flags leave out; a ConfigError for an
    unknown strategy name or a value Config refuses."""
    if args.strategy is not None:
        check_strategy(args.strategy)
    values = {f.name: getattr(args, f.name) for f in fields(Config) if "help" in f.metadata}
    if isinstance(values["nnodes"], tuple):
        fewest, values["nnodes"] = values["nnodes"]
        if fewest != values["nnodes"]:
            values["min_nnodes"] = fewest
    left_out = [name for name in SCHEDULED if values[name] is None]
    allocation = schedulers.detect() if left_out else None
    taken = False
    for name in left_out:
        from_scheduler = getattr(allocation, name, None)
        if from_scheduler is None or (name == "master" and (values.get("nnodes") or 1) == 1):
            del values[name]  # Config's default; one node needs no rendezvous address
        else:
            values[name] = from_scheduler
            taken = True
    config = Config(**values)
    if taken and config.nnodes > 1:
        print(
            f"dtrain: {allocation.scheduler} runs this job on {config.nnodes} nodes; this is "
            f"node {config.node_rank}, the rendezvous is at {config.master}.",
            file=sys.stderr,
            flush=True,
        )
    return config
