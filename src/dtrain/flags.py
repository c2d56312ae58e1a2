"""The TOPOLOGY flags shared by `dtrain run` and `dtrain demo`, generated from Config.

Importable without torch (as is Config), so `--help` and every flag error answer at once.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import fields

from dtrain.config import Config
from dtrain.names import STRATEGIES, check_strategy


def _device_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1,3, got {text!r}") from None


def _name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_topology_args(parser: argparse.ArgumentParser) -> None:
    """TOPOLOGY flags, generated from :class:`Config`'s fields and their help."""
    group = parser.add_argument_group("topology")
    hints = typing.get_type_hints(Config)
    for f in fields(Config):
        if "help" not in f.metadata:
            continue
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            group.add_argument(flag, dest=f.name, action="store_true", help=f.metadata["help"])
            continue
        convert = {int: int, float: float, str: str}.get(
            typing.get_args(kind)[0] if typing.get_args(kind) else kind
        )
        if f.name == "devices":
            convert = _device_list
        if f.name in ("blocks", "split_points", "logger"):
            convert = _name_list
        if f.name == "hosts":
            convert = _name_list
        help_text = f.metadata["help"]
        if f.name == "strategy":
            help_text += " One of: " + ", ".join(STRATEGIES) + "."
        group.add_argument(
            *flag.split("/"), dest=f.name, type=convert, default=f.default, help=help_text
        )


def config_from(args: argparse.Namespace) -> Config:
    """The Config given by the parsed TOPOLOGY flags; a ConfigError for an unknown strategy
    name or a value Config refuses."""
    if args.strategy is not None:
        check_strategy(args.strategy)
    return Config(**{f.name: getattr(args, f.name) for f in fields(Config) if "help" in f.metadata})
