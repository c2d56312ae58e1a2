"""The checks `dtrain run` and `dtrain demo` make before any process starts: the SCRIPT or
-m MODULE can run, the demo's batch divides over the layout, the outputs can be written.

The checks of a target and of the outputs need no torch; the demo's imports its checks
(which import torch) inside, after the command line has been parsed.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import sys
import zipfile
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from dtrain.config import Config
from dtrain.errors import ConfigError

SNIFF_BYTES = 8192
"""How much of a SCRIPT is read to tell a binary file from Python source."""


def check_demo(config: Config, args: argparse.Namespace) -> AbstractContextManager[object]:
    """`dtrain demo`'s checks: its flags completed, its batch divides over the layout, and
    the outputs (on node 0, where rank 0 writes them). Returns the hold on --out (node 0's
    lock on it; nothing elsewhere), to keep for the run's life with ``with``."""
    from dtrain.demo import checks as demo_checks
    from dtrain.launcher.hosts import as_nodes, hosts_of
    from dtrain.step.batches import check_batch
    from dtrain.strategies.specs import lookup

    hosts = hosts_of(config)
    if hosts is not None:
        config = as_nodes(config, hosts)

    dp_size, splits = lookup(config.strategy).batch_layout(config)
    demo_checks.complete_args(args)
    check_batch(args.global_batch_size, dp_size, splits, config.grad_accumulation)
    if config.node_rank == 0:
        _check_outputs(config, args.out)
        # The machines of an elastic job each take node rank 0 here; they share --out.
        several = config.nnodes > 1 or config.min_nnodes is not None
        return demo_checks.claim_out(args, config.master if several else None)
    return nullcontext()


def check_run(config: Config, args: argparse.Namespace) -> None:
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
