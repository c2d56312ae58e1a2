"""`dtrain --help` and the command line's errors answer without importing torch (which
takes seconds), and the light lists of names they show match the modules behind them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtrain import command_names
from dtrain.demo.lr import scale_lr
from dtrain.errors import ConfigError
from dtrain.models import MODELS, build
from dtrain.models.gpt import SIZES
from dtrain.models.recipes import TASKS, make_optimizer
from dtrain.strategies.specs import available, lookup

# Runs `dtrain.cli.main(argv)` and says, last, whether anything imported torch.
PROBE = """
import json, sys
from dtrain.cli import main
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as e:  # --help, --version and argparse's own errors exit
    code = e.code
print(f"torch imported: {'torch' in sys.modules}", flush=True)
sys.exit(code)
"""


def cli_without_torch(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`dtrain ARGV` in a fresh interpreter; fails the test if it imported torch."""
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_CONFIG"}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.splitlines()[-1] == "torch imported: False", proc.stderr[-2000:]
    return proc


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["--help"], "{run,demo,bench,plan,ckpt,data}"),
        (["--version"], "dtrain 0.1.0"),
        (["run", "--help"], "--seed SEED"),
        (["demo", "--help"], "--model-size {tiny,small,medium,100m}"),
        (["bench", "comm", "--help"], "--max-bytes MAX_BYTES"),
        (["ckpt", "convert", "--help"], "weights_only=True"),
    ],
)
def test_help_answers_without_torch(tmp_path: Path, argv: list[str], shown: str) -> None:
    proc = cli_without_torch(tmp_path, *argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert shown in proc.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--nproc", "0", "x.py"], "--nproc must be at least 1, got 0."),
        (
            ["run", "--strategy", "nope", "x.py"],
            "Unknown strategy 'nope'. Known strategies: single, towers, ddp, local-sgd, ps, "
            "zero1, zero2, zero3, hsdp, pipeline, tensor, hybrid. Pick one with --strategy NAME.",
        ),
        (["demo", "--strategy", "magic"], "Unknown strategy 'magic'."),
        (["run", "--towers", "2", "x.py"], "--towers sets the replicas of --strategy towers"),
        (["run", "--sync-every", "4", "x.py"], "--sync-every: options of the syncs of --strategy"),
        (["run", "--logger", "nope", "x.py"], "Unknown --logger nope; choose from csv"),
        (["run", "--seed", "-1", "x.py"], "--seed must lie in [0, 2**64)"),
        (["demo", "--model", "resnet"], "invalid choice: 'resnet'"),
        (["run"], "the following arguments are required: SCRIPT"),
    ],
)
def test_argument_errors_answer_without_torch(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    proc = cli_without_torch(tmp_path, *argv)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_alias_passes_the_light_check_and_reaches_the_launcher(tmp_path: Path) -> None:
    """`fsdp` is zero3's alias: the light check lets it through to the launcher, which
    refuses the missing script (after importing torch)."""
    proc = subprocess.run(
        [sys.executable, "-m", "dtrain.cli", "run", "--strategy", "fsdp", "missing.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "The script missing.py does not exist" in proc.stderr


LAZY = """
import sys
import dtrain
import dtrain.launcher.forked  # the launcher package is not the function dtrain.launch
assert "torch" not in sys.modules, "import dtrain imported torch"
from dtrain import Engine
assert "torch" in sys.modules
assert callable(dtrain.launch) and dtrain.launch.__module__ == "dtrain.launcher.notebook"
assert dtrain.init.__module__ == "dtrain.engine.start" and Engine is dtrain.Engine
assert "dtrain.process.torch_version" in sys.modules, "the torch version was not checked"
assert dtrain.available_strategies() == list(dtrain.command_names.STRATEGIES)
assert {"init", "launch", "Engine"} <= set(dir(dtrain))
print("ok")
"""


def test_the_public_names_load_torch_on_first_use() -> None:
    proc = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_every_public_name_resolves() -> None:
    import dtrain

    missing = [name for name in dtrain.__all__ if not hasattr(dtrain, name)]
    assert not missing, f"dtrain.__all__ names what `import dtrain` cannot give: {missing}"


def test_the_light_names_are_the_ones_the_modules_use() -> None:
    assert available() == list(command_names.STRATEGIES)
    aliases = {alias: name for name in available() for alias in lookup(name).aliases}
    assert aliases == command_names.STRATEGY_ALIASES
    assert tuple(SIZES) == command_names.GPT_SIZES
    assert MODELS is command_names.MODELS and set(TASKS) == set(command_names.MODELS)
    for model in command_names.MODELS:
        build(model)
    model = torch.nn.Linear(2, 2)
    built = {type(make_optimizer(name, model, 0.1)) for name in command_names.OPTIMIZERS}
    assert len(built) == len(command_names.OPTIMIZERS)
    with pytest.raises(ConfigError, match="Unknown --optimizer 'lion'"):
        make_optimizer("lion", model, 0.1)
    for rule in command_names.LR_RULES:
        scale_lr(0.1, 64, 32, rule)
