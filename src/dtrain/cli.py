"""The `dtrain` command: run, demo, bench, plan, ckpt, data.

Parsing, `--help` and every flag or Config error need no torch: this module imports only
light modules at the top, and the launcher, the demo's checks and the checkpoint tools
inside the paths that use them, after the command line has been parsed and checked.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.machinery
import importlib.util
import os
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

from dtrain import __version__
from dtrain.advice import running_as
from dtrain.bench.bench_flags import add_args as add_bench_args
from dtrain.bench.comm_flags import add_args as add_comm_args
from dtrain.config import Config
from dtrain.config_file import _actions, _chosen_parser, add_config_arg, parse_with_config
from dtrain.demo_flags import add_training_args, check_training_args
from dtrain.errors import ConfigError, DtrainError, exit_report
from dtrain.launch.quiet import import_quietly
from dtrain.plan.flags import add_args as add_plan_args
from dtrain.topology_flags import add_topology_args, config_from

DEMO_MODULE = "dtrain.demo"
COMM_MODULE = "dtrain.bench.comm"
SNIFF_BYTES = 8192
"""How much of a SCRIPT is read to tell a binary file from Python source."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that flags it does not know are a ConfigError naming the
    closest known flag of the chosen command (``--stratgy``: did you mean --strategy?)."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            raise ConfigError(_unrecognized(_chosen_parser(self, parsed), extras))
        return parsed


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """The sentence for the arguments `parser` (the chosen command's) did not take."""
    flags = [extra.partition("=")[0] for extra in extras if extra.startswith("-")]
    if not flags:
        return (
            f"{parser.prog} does not take {' '.join(extras)}; see {parser.prog} --help for "
            "what it takes."
        )
    known = [option for action in _actions(parser) for option in action.option_strings]
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
        help="Plain PyTorch file -> checkpoint directory, checkpoint -> plain file, or "
        "sharded checkpoint -> consolidated checkpoint.",
        description="SRC a plain PyTorch or safetensors file (a state_dict, possibly under a "
        "key such as 'state_dict' and with 'module.' names): DST becomes a checkpoint "
        "directory. SRC a checkpoint directory (consolidated or sharded) and DST ending in "
        ".pt/.pth/.bin/.safetensors: DST becomes a plain state_dict file of its model. SRC a "
        "sharded checkpoint and DST a directory: DST becomes a consolidated checkpoint with "
        "the same model, optimizer and trainer state. Runs in this process, without a "
        "process group; files are read with weights_only=True.",
    )
    convert.add_argument("src", type=Path, help="A checkpoint directory or a plain file.")
    convert.add_argument("dst", type=Path, help="The checkpoint directory or file to write.")
    _add_data_parser(sub)
    return parser


def _add_data_parser(sub: argparse._SubParsersAction) -> None:
    """`dtrain data write`: a bundled data set as shard files (see dtrain.shard_files)."""
    data = sub.add_parser("data", help="Prepare data: write shard files.")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    write = data_sub.add_parser(
        "write",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="Write a bundled data set's training split as shard files in partitions.",
        description="Write the training split of --dataset into --out as shard files of "
        "--shard-size samples in --partitions contiguous partitions, with their index.json "
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
    write.add_argument("--shard-size", type=int, default=256, help="Samples per shard file.")
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


def _check_demo(config: Config, args: argparse.Namespace) -> None:
    from dtrain import demo_checks
    from dtrain.batches import check_batch
    from dtrain.launch.hosts import as_nodes, hosts_of
    from dtrain.strategies.specs import lookup

    hosts = hosts_of(config)
    if hosts is not None:
        config = as_nodes(config, hosts)

    dp_size, splits = lookup(config.strategy).batch_layout(config)
    demo_checks.complete_args(args)
    check_batch(args.global_batch_size, dp_size, splits, config.grad_accumulation)
    if config.node_rank == 0:
        _check_outputs(config, args.out)
        demo_checks.claim_out(args)


def _check_run(config: Config, args: argparse.Namespace) -> None:
    """`dtrain run`'s checks that need no torch: the target, and the outputs (on node 0,
    where rank 0 writes them)."""
    if args.module:
        _check_module(args.script)
    else:
        _check_script(args.script)
    if config.node_rank == 0:
        _check_outputs(config, config.out)


def _check_script(name: str) -> None:
    """Refuse a SCRIPT python cannot run, saying what it is: a directory, an unreadable
    file, a binary one (a missing one is the launcher's Target.check to name)."""
    # os.path's tests, unlike pathlib's, answer False where this user may not look
    script = Path(name)
    if os.path.isdir(script):
        raise ConfigError(
            f"{name} is a directory, not a script; give the Python file to run (such as "
            f"{script / 'train.py'}), or -m MODULE for a package."
        )
    if not os.path.exists(script):
        return
    try:
        with script.open("rb") as file:
            head = file.read(SNIFF_BYTES)
    except OSError as e:
        raise ConfigError(
            f"The script {name} cannot be read ({e.strerror}); check its permissions."
        ) from None
    # python also runs compiled bytecode and zip archives (a .pyz), binary both
    runnable = head.startswith(importlib.util.MAGIC_NUMBER) or zipfile.is_zipfile(script)
    if b"\0" in head and not runnable:
        raise ConfigError(
            f"{name} is a binary file, not a Python script; give the .py file that trains "
            "(dtrain run starts it with python on every worker)."
        )


def _check_module(name: str) -> None:
    """Refuse ``-m NAME`` when python -m in this directory (as the workers run it) would
    find no such module, without importing any package on the way."""
    if name in sys.modules:
        return
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        why = "that is not a dotted module name"
    else:
        sys.path.insert(0, os.getcwd())  # python -m looks in the current directory first
        try:
            why = _missing_part(importlib.util.find_spec(parts[0]), parts)
        except ValueError:  # a module in sys.modules without a spec: leave it to python
            why = None
        finally:
            del sys.path[0]
    if why is not None:
        raise ConfigError(
            f"There is no module {name} to run with -m: {why}. -m takes a module name as "
            f"python -m does (such as mypkg.train, found from {os.getcwd()} or the installed "
            "packages); to run a file, drop -m and give its path."
        )


def _missing_part(spec: importlib.machinery.ModuleSpec | None, parts: list[str]) -> str | None:
    """Why the module ``.``-joining `parts` cannot be found, `spec` being its top-level
    package's (None: not found), or None if it can be (a package: its __main__ too). A
    package whose __init__ touches __path__ (pkgutil.extend_path) may find submodules
    elsewhere: only importing it would tell, so it passes."""
    if spec is None:
        return f"no module or package {parts[0]} is installed or in the current directory"
    for depth in range(1, len(parts) + 1):
        locations = spec.submodule_search_locations
        parent = ".".join(parts[:depth])
        if locations is None:
            if depth == len(parts):
                return None
            return f"{parent} is a module, not a package, so it holds no {parts[depth]}"
        if not _fixed_path(spec):
            return None
        child = parts[depth] if depth < len(parts) else "__main__"
        spec = importlib.machinery.PathFinder.find_spec(f"{parent}.{child}", list(locations))
        if spec is None and child == "__main__":
            return (
                f"{parent} is a package without a __main__ module, so python -m cannot run "
                f"it; name the module inside it that trains, such as {parent}.train"
            )
        if spec is None:
            return f"the package {parent} has no module {child}"
    return None


def _fixed_path(spec: importlib.machinery.ModuleSpec) -> bool:
    """Whether a package's submodules all lie in its search locations: a namespace
    package, or one whose __init__ does not mention __path__."""
    if spec.origin is None:
        return True
    try:
        return b"__path__" not in Path(spec.origin).read_bytes()
    except OSError:  # a built-in or frozen package
        return False


def _check_outputs(config: Config, out: str | Path | None) -> None:
    """Refuse, before any process starts, an output the run could not write: the
    directory `out` (None: the run writes none of its own), --metrics-json, --trace."""
    if out is not None:
        _check_writable("--out", Path(out), None)
    for flag, value, example in (
        ("--metrics-json", config.metrics_json, "metrics.json"),
        ("--trace", config.trace, "trace.json"),
    ):
        if value is not None:
            _check_writable(flag, Path(value), example)


def _check_writable(flag: str, path: Path, file_example: str | None) -> None:
    """`path` must be a directory (`file_example` None) or a file (an example name for
    one) that this user can write, or else create."""
    if file_example is None and os.path.isfile(path):
        raise ConfigError(
            f"{flag} {path} is a file; give a directory for the run's logs and checkpoints "
            "(it is created if missing), or move the file away."
        )
    if file_example is not None and os.path.isdir(path):
        raise ConfigError(
            f"{flag} {path} is a directory; give the file to write, such as {path / file_example}."
        )
    whole = path.absolute()
    existing = next(p for p in (whole, *whole.parents) if os.path.exists(p))
    if existing != whole and not os.path.isdir(existing):
        raise ConfigError(
            f"{flag} {path} cannot be created: {existing} is a file, not a directory; "
            "choose another path."
        )
    if not os.access(existing, os.W_OK | (os.X_OK if os.path.isdir(existing) else 0)):
        raise ConfigError(
            f"{flag} {path} cannot be written: this user may not write to {existing}; "
            "choose a path you can write to."
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dtrain` console command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_with_config(build_parser(), argv)
    except (DtrainError, KeyboardInterrupt) as e:
        return _failed(e)
    # Named for this process and its workers, so that their advice speaks to the command.
    with running_as(args.command):
        try:
            return _command(args, argv)
        except (DtrainError, KeyboardInterrupt) as e:
            return _failed(e)


def _failed(error: DtrainError | KeyboardInterrupt) -> int:
    """Print the line `error` ends the command with; return its exit code."""
    message, code = exit_report(error)
    print(f"dtrain: {message}", file=sys.stderr)
    return code


def _command(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the parsed command; returns the exit code."""
    if args.command == "ckpt":
        return _ckpt(args)
    if args.command == "data":
        return _data(args)
    if args.command == "plan":
        from dtrain.plan.command import main as plan_main

        return plan_main(args)
    if args.command == "bench" and args.bench_command is None:
        from dtrain.bench.strategies import main as bench_strategies

        return bench_strategies(args, argv)
    config = config_from(args)
    if args.command == "bench":
        return _bench(config, argv)
    if args.command == "run":
        _check_run(config, args)
    else:
        check_training_args(args)
    runner = import_quietly("dtrain.launch.runner")
    if args.command == "run":
        kind = "module" if args.module else "script"
        target = runner.Target(kind, args.script, tuple(args.script_args))
    else:
        _check_demo(config, args)
        target = runner.Target("module", DEMO_MODULE, tuple(argv[1:]))
    if args.strategy is None:
        many = config.hosts or config.hostfile
        processes = "every host's processes" if many else f"{config.nproc * config.nnodes}"
        print(
            f"dtrain: strategy {config.strategy} ({processes}"
            f"{'' if many else ' process(es)'}; choose another with --strategy).",
            file=sys.stderr,
            flush=True,
        )
    runner.launch(config, target)
    return 0


def _bench(config: Config, argv: list[str]) -> int:
    if config.nproc * config.nnodes < 2:
        raise ConfigError(
            "dtrain bench comm times collectives between processes; give --nproc 2 or more."
        )
    from dtrain.launch.runner import Target, launch

    launch(config, Target("module", COMM_MODULE, tuple(argv[2:])))
    return 0


def _data(args: argparse.Namespace) -> int:
    from dtrain.datasets import load_digits, load_text
    from dtrain.shard_write import write_shards

    train = (load_digits if args.dataset == "digits" else load_text)()[0]
    out = write_shards(train, args.out, args.shard_size, args.partitions, args.format)
    print(
        f"{out}: the {len(train)} training samples of {args.dataset} in {args.partitions} "
        f"partition(s), shards of {args.shard_size} ({args.format})."
    )
    return 0


def _ckpt(args: argparse.Namespace) -> int:
    from dtrain.checkpoint.convert import convert
    from dtrain.checkpoint.verify import summary, verify
    from dtrain.observe.metrics import format_table

    if args.ckpt_command == "convert":
        print(convert(args.src, args.dst))
        return 0
    if args.ckpt_command == "inspect":
        print(format_table(summary(args.path)))
        return 0
    problems = verify(args.path)
    if problems:
        print(
            f"dtrain: {args.path} is damaged:\n  "
            + "\n  ".join(problems)
            + "\nRestore it from a copy, or resume from an older checkpoint.",
            file=sys.stderr,
        )
        return 1
    print(f"{args.path}: every file matches the manifest.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
