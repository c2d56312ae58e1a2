"""The flags of `dtrain plan`, apart from the code that measures (so `--help` needs no torch)."""

from __future__ import annotations

import argparse

from dtrain.command_names import GPT_SIZES, MODELS, OPTIMIZERS
from dtrain.demo.flags import add_expert_args


def add_args(parser: argparse.ArgumentParser) -> None:
    """Add `dtrain plan`'s flags to `parser`."""
    what = parser.add_argument_group("model (one of)")
    what.add_argument("--model", default=None, choices=MODELS, help="A bundled model.")
    what.add_argument("--model-size", default=None, choices=GPT_SIZES, help="Size of --model gpt.")
    add_expert_args(what)
    what.add_argument(
        "--script",
        default=None,
        metavar="FILE[:FUNCTION]",
        help="A Python file defining plan_model() (or FUNCTION) that returns "
        "(model, (inputs, targets), loss_fn); see docs/plan.md.",
    )
    what.add_argument(
        "--factory",
        default=None,
        metavar="MODULE:FUNCTION",
        help="An importable function returning (model, (inputs, targets), loss_fn).",
    )
    what.add_argument(
        "--optimizer",
        default=None,
        choices=OPTIMIZERS,
        help="The optimizer whose state is counted and timed (default: the bundled model's, "
        "adamw for --script/--factory).",
    )
    job = parser.add_argument_group("job")
    job.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per step over all data-parallel workers (default: the bundled "
        "model's, cnn/mlp 64, gpt 32; required with --script/--factory).",
    )
    job.add_argument("--nproc", type=int, default=1, help="Processes (devices) per machine.")
    job.add_argument("--nnodes", type=int, default=1, help="Machines.")
    job.add_argument(
        "--memory-per-device",
        type=int,
        default=None,
        metavar="BYTES",
        help="Bytes a rank may hold (default: the GPU's memory, or this machine's memory on "
        "the CPU); layouts that need more are left out.",
    )
    job.add_argument("--cpu", action="store_true", help="Plan for the CPU even with GPUs.")
    job.add_argument(
        "--probe-seconds",
        type=float,
        default=0.25,
        help="Seconds of timed steps per batch size in the compute probe (after 2 warm-up "
        "steps, at least 3 steps).",
    )
    link = parser.add_argument_group("links")
    link.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="Bus bandwidth between the processes in GB/s, instead of measuring it "
        "(with --link-latency-us).",
    )
    link.add_argument(
        "--link-latency-us",
        type=float,
        default=None,
        help="Microseconds per collective call, instead of measuring it.",
    )
    link.add_argument(
        "--inter-node-gbps",
        type=float,
        default=1.25,
        help="Bandwidth between machines in GB/s (assumed, not measured; 1.25 = 10 Gb/s).",
    )
    link.add_argument(
        "--inter-node-latency-us",
        type=float,
        default=50.0,
        help="Latency between machines in microseconds (assumed, not measured).",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help='Print {"candidates": [...]} only.')
    out.add_argument("--top", type=int, default=None, help="Show only the best N candidates.")
