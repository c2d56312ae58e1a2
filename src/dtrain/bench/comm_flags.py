"""The flags of `dtrain bench comm`, apart from the code that measures (so that `--help`
needs no torch)."""

from __future__ import annotations

import argparse
from pathlib import Path

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send_recv")
"""The collectives `dtrain bench comm` measures."""


def add_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `dtrain bench comm` (besides the topology flags)."""
    parser.add_argument(
        "--ops", default=",".join(OPS), help=f"Comma-separated collectives: {', '.join(OPS)}."
    )
    parser.add_argument("--min-bytes", default="1K", help="Smallest message (K, M, G suffixes).")
    parser.add_argument("--max-bytes", default="256M", help="Largest message.")
    parser.add_argument(
        "--iters", type=int, default=20, help="Timed calls per size (fewer above 16 MiB)."
    )
    parser.add_argument("--warmup", type=int, default=3, help="Untimed calls per size first.")
    parser.add_argument("--csv", type=Path, default=None, help="Also write the table here.")
    parser.add_argument("--json", type=Path, default=None, help="Also write the rows as JSON here.")
