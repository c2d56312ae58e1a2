"""The `dtrain` command line: the parser of every subcommand and its flags.

It imports only the flag modules, none of which imports torch, so `--help` and every flag
error answer at once. A flag the chosen command does not know is a ConfigError naming the
closest one it does.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from pathlib import Path

from dtrain import __version__
from dtrain.bench.bench_flags import add_args as add_bench_args
from dtrain.bench.comm_flags import add_args as add_comm_args
from dtrain.config.file import add_config_arg, chosen_parser, parser_actions
from dtrain.demo.flags import add_training_args
from dtrain.errors import ConfigError
from dtrain.launcher.topology_flags import add_topology_args
from dtrain.plan.flags import add_args as add_plan_args


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that flags it does not know are a ConfigError naming the
    closest known flag of the chosen command (``--stratgy``: did you mean --strategy?)."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            raise ConfigError(_unrecognized(chosen_parser(self, parsed), extras))
        return parsed


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """The sentence for the arguments `parser` (the chosen command's) did not take."""
    flags = [extra.partition("=")[0] for extra in extras if extra.startswith("-")]
    if not flags:
        return (
            f"{parser.prog} does not take {' '.join(extras)}; see {parser.prog} --help for "
            "what it takes."
        )
    known = [option for action in parser_actions(parser) for option in action.option_strings]
    named = []
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=1)
        named.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
    return (
        f"{parser.prog} has no flag{'s' if len(flags) > 1 else ''} {', '.join(named)}; fix "
        f"the spelling, or see {parser.prog} --help for its flags."
    )


def build_parser() -> argparse.ArgumentParser:
    """The full `dtrain` argument parser."""
    parser = _Parser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        prog="dtrain",
        description="Run a one-device PyTorch training loop on many devices by changing one flag.",
    )
    parser.add_argument("--version", action="version", version=f"dtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="Launch a training script on every worker.",
        description="Launch SCRIPT (or -m MODULE) under the chosen topology.",
    )
    add_config_arg(run)
    add_topology_args(run)
    run.add_argument(
        "-m",
        dest="module",
        action="store_true",
        help="Treat SCRIPT as a module name, as `python -m` does.",
    )
    run.add_argument("script", metavar="SCRIPT", help="The training script (or module with -m).")
    run.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="Arguments for the script."
    )

    demo_parser = sub.add_parser(
        "demo",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="Train a bundled model on real data (digits).",
        description="The main job: train a classifier on scikit-learn's "
        "handwritten digits under any strategy.",
    )
    add_config_arg(demo_parser)
    add_topology_args(demo_parser)
    add_training_args(demo_parser)

    bench = sub.add_parser(
        "bench",
        help="Measure: strategies x process counts side by side (--strategies), or the "
        "collectives' bandwidth (comm).",
        description="Without a sub-command: train the same workload under every strategy "
        "in --strategies at every process count in --nproc, the configurations taking turns, "
        "--repeats times each; write a table (CSV, JSON) of the medians and PNG plots under "
        "--out. `dtrain bench comm` times the collectives instead.",
    )
    add_bench_args(bench)
    # Optional, so that `dtrain bench --strategies ...` runs the strategies bench itself.
    bench_sub = bench.add_subparsers(dest="bench_command", required=False, metavar="{comm}")
    comm = bench_sub.add_parser(
        "comm",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="Time all_reduce, reduce_scatter, all_gather, broadcast and send/recv by size.",
        description="Time each collective from --min-bytes to --max-bytes on --nproc "
        "processes; print the algorithm and bus bandwidth (the nccl-tests definitions).",
    )
    add_topology_args(comm)
    add_comm_args(comm)

    plan = sub.add_parser(
        "plan",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="Predict the fastest layout for a model before running it.",
        description="Calibrate on this machine (a short compute probe of the model and a "
        "link probe over --nproc processes), predict each layout's step time and memory "
        "per rank from documented formulas, and list the layouts that fit, best first.",
    )
    add_plan_args(plan)

    ckpt = sub.add_parser("ckpt", help="Inspect, verify or convert checkpoints.")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True)
    for name, text in (
        ("inspect", "Print what a checkpoint (consolidated or sharded) holds."),
        (
            "verify",
            "Check every file of a checkpoint (consolidated or sharded) against its manifest.",
        ),
    ):
        p = ckpt_sub.add_parser(name, help=text, description=text)
        p.add_argument("path", type=Path, help="A checkpoint directory.")
    convert = ckpt_sub.add_parser(
        "convert",
        help="Plain PyTorch file -> checkpoint directory, checkpoint -> plain file, "
        "sharded checkpoint -> consolidated checkpoint, or either -> Hugging Face folder.",
        description="SRC a plain PyTorch or safetensors file (a state_dict, possibly under a "
        "key such as 'state_dict' and with 'module.' names): DST becomes a checkpoint "
        "directory. SRC a checkpoint directory (consolidated or sharded) and DST ending in "
        ".pt/.pth/.bin/.safetensors: DST becomes a plain state_dict file of its model. SRC a "
        "sharded checkpoint and DST a directory: DST becomes a consolidated checkpoint with "
        "the same model, optimizer and trainer state. With --to hf, the model of SRC (a "
        "checkpoint or a plain file) becomes the Hugging Face model folder DST, with --config "
        "as its config.json. Runs in this process, without a "
        "process group; files are read with weights_only=True.",
    )
    convert.add_argument("src", type=Path, help="A checkpoint directory or a plain file.")
    convert.add_argument(
        "dst", type=Path, help="The checkpoint directory, file or Hugging Face folder to write."
    )
    convert.add_argument(
        "--to",
        choices=("hf",),
        default=None,
        help="hf: write DST as a Hugging Face model folder (config.json and safetensors "
        "files) that transformers' from_pretrained reads. Without it, DST is a checkpoint "
        "or a plain file, as described above.",
    )
    # Not dest "config": that one names the TOML flag file that parse_with_config reads.
    convert.add_argument(
        "--config",
        dest="hf_config",
        type=Path,
        default=None,
        metavar="FILE",
        help="With --to hf: the model's config.json (a JSON object), copied into DST. "
        "Without it, DST has no config.json and from_pretrained needs one added.",
    )
    _add_data_parser(sub)
    return parser


def _add_data_parser(sub: argparse._SubParsersAction) -> None:
    """`dtrain data write`: a bundled data set as shard files (see dtrain.data.shard_files)."""
    data = sub.add_parser("data", help="Prepare data: write shard files.")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    write = data_sub.add_parser(
        "write",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="Write a bundled data set's training split as shard files in partitions.",
        description="Write the training split of --dataset into --out as shard files of "
        "--samples-per-shard samples in --partitions contiguous partitions, with their index.json "
        "(replacing --out in one rename). Train from them with "
        "engine.dataloader(dtrain.ShardFiles(DIR), ...) or `dtrain demo --data DIR`, on a "
        "multiple or a divisor of --partitions data-parallel workers; with one partition "
        "per machine, each machine reads only its own partition's files.",
    )
    write.add_argument(
        "--dataset",
        choices=("digits", "text"),
        required=True,
        help="The bundled data set (digits images, or byte-level text windows).",
    )
    write.add_argument("--out", type=Path, required=True, help="The directory to write.")
    write.add_argument(
        "--samples-per-shard", type=int, default=256, help="Samples per shard file."
    )
    write.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="Partitions (typically the number of machines that will train).",
    )
    write.add_argument(
        "--format",
        choices=("pt", "npz"),
        default="pt",
        help="pt: torch.save'd lists of samples; npz: numpy arrays, one per field.",
    )
