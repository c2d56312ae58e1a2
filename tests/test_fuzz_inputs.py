"""The fuzz table: malformed invocations of every command (dtrain run, demo, bench, plan,
ckpt and horovodrun) and malformed config files. Each is refused before any process
starts, with a non-zero exit, one block of text that names the problem, and no
traceback. (tests/test_bad_input.py holds the first cases found, with their exact texts;
this table widens the net.) A few inputs are accepted on purpose, listed last."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from dtrain import cli
from dtrain.horovod import run as horovodrun
from dtrain.launcher import runner

REFUSED = [
    ("demo --nproc 0", "--nproc must be at least 1, got 0"),
    ("demo --nproc -1", "--nproc must be at least 1, got -1"),
    ("demo --nproc abc", "invalid int value: 'abc'"),
    ("demo --strategy zero4", "Unknown strategy 'zero4'. Known strategies: single"),
    ('demo --strategy ""', "Unknown strategy ''"),
    ("demo --towers 0", "--towers must be at least 1, got 0"),
    ("demo --grad-accumulation 0", "--grad-accumulation must be at least 1, got 0"),
    ("demo --grad-accumulation -3", "--grad-accumulation must be at least 1, got -3"),
    ("demo --precision fp8", "Unknown --precision 'fp8'; choose one of fp32"),
    ("demo --activation-checkpointing half", "Unknown --activation-checkpointing 'half'"),
    ("demo --grad-compression fp8 --nproc 2", "Unknown --grad-compression 'fp8'; choose one"),
    ("demo --grad-compression powersgd:0 --nproc 2", "powersgd:RANK needs a whole RANK of at"),
    ("demo --grad-compression bf16", "--strategy single runs in one process, which sends none"),
    ("demo --model resnet", "invalid choice: 'resnet'"),
    ("demo --model-size huge", "invalid choice: 'huge'"),
    ("demo --model cnn --model-size small", "--model-size applies to --model gpt only"),
    ("demo --optimizer lamb", "invalid choice: 'lamb'"),
    ("demo --global-batch-size 0", "--global-batch-size must be at least 1, got 0"),
    ("demo --global-batch-size -4", "--global-batch-size must be at least 1, got -4"),
    (
        "demo --global-batch-size 63 --nproc 2 --strategy ddp",
        "--global-batch-size 63 does not divide evenly over 2 data-parallel workers",
    ),
    ("demo --lr abc", "invalid float value: 'abc'"),
    ("demo --lr inf", "--lr must be a finite number >= 0, got inf"),
    ("demo --log-every 0", "--log-every must be at least 1, got 0"),
    ("demo --log-every -1", "--log-every must be at least 1, got -1"),
    ("demo --clip-grad-norm -1", "--clip-grad-norm must be positive, got -1.0"),
    ("demo --clip-grad-norm nan", "--clip-grad-norm must be positive, got nan"),
    ("demo --keep-checkpoints 0", "--keep-checkpoints must be at least 1, got 0"),
    ("demo --seed -1", "--seed must lie in [0, 2**64)"),
    ("demo --seed abc", "invalid int value: 'abc'"),
    ("demo --timeout 0", "--timeout must be a number of seconds above 0"),
    ("demo --timeout -5", "--timeout must be a number of seconds above 0"),
    ("demo --max-restarts -1", "--max-restarts must be >= 0, got -1"),
    ("demo --pp 0 --strategy pipeline", "--pp must be at least 1, got 0"),
    ("demo --tp 3 --nproc 2 --strategy tensor", "the product of the degrees must equal --nproc"),
    ("demo --dp-mode zero9 --strategy hybrid", "Unknown --dp-mode 'zero9'"),
    ("demo --schedule zigzag --strategy pipeline", "Unknown --schedule 'zigzag'"),
    ("demo --microbatches 0 --strategy pipeline --nproc 2", "--microbatches must be at least 1"),
    (
        "demo --virtual-stages 0 --strategy pipeline --schedule interleaved --nproc 2",
        "--virtual-stages must be at least 2, got 0",
    ),
    ("demo --ps-mode sometimes --strategy ps", "--ps-mode must be one of sync, async, ssp"),
    ("demo --staleness -1 --strategy ps --ps-mode ssp", "--staleness must be >= 0, got -1"),
    ("demo --servers 0 --strategy ps", "--strategy ps needs at least one server"),
    ("demo --backup-workers -1 --strategy ps", "--backup-workers must lie in [0, --nproc)"),
    ("demo --checkpoint-format zip", "Unknown --checkpoint-format 'zip'"),
    ("demo --logger syslog", "Unknown --logger syslog; choose from csv, tensorboard"),
    ("demo --lr-scaling cube", "invalid choice: 'cube'"),
    ("demo --devices a,b", "--devices"),
    ("demo --cpu-offload --strategy ddp", "--cpu-offload works with --strategy zero3 only"),
    ("demo --hierarchical --strategy zero3", "--hierarchical arranges ddp's gradient all-reduce"),
    ("demo --shard-size 3 --strategy hsdp --nproc 2", "must be at least 2 and divide the 2"),
    ("demo --trace-steps 5:2", "--trace-steps must be A:B with 0 <= A < B"),
    ("demo --trace-steps abc", "--trace-steps must be A:B with 0 <= A < B"),
    (
        "demo --node-rank 2 --nnodes 2 --master 127.0.0.1:29500",
        "--node-rank must lie in [0, --nnodes), got node rank 2 of 2",
    ),
    ("demo --nnodes 2", "A multi-node run needs --master HOST:PORT"),
    ("demo --master nohostport --nnodes 2", "--master must be HOST:PORT with a port from 1"),
    ("demo --config missing.toml", "The config file missing.toml does not exist"),
    ("demo --config bad.toml", "The config file bad.toml is not valid TOML"),
    ("demo --config badtype.toml", "'nproc' in badtype.toml, line 1 must be an integer"),
    ("demo --config badkey.toml", "Unknown key 'no_such_key' in badkey.toml, line 1"),
    ("demo -H", "expected one argument"),
    ("demo --hostfile missing_hosts", "Cannot read the hostfile missing_hosts"),
    ("demo --resume --overwrite", "--resume continues the run in --out and --overwrite"),
    ("run", "the following arguments are required"),
    ("run --strategy ddp", "the following arguments are required"),
    ("run --nproc 2 missing.py", "The script missing.py does not exist"),
    ("run --resume x.py", "dtrain run has no flag --resume"),
    ("run --nproc 2 --strategy pipeline --pp 3 x.py", "the product of the degrees"),
    ("run --sync-batchnorm --strategy pipeline --nproc 2 x.py", "--sync-batchnorm"),
    ("bench --strategies zero4", "Unknown strategy 'zero4'"),
    ('bench --strategies ""', "dtrain bench needs the strategies to compare"),
    ("bench comm --sizes abc", "dtrain bench comm has no flag --sizes"),
    ("plan --model nosuch", "invalid choice: 'nosuch'"),
    ("plan --nproc 0", "--nproc and --nnodes must be at least 1, got 0 and 1"),
    ("plan --global-batch-size 0", "--global-batch-size must be at least 1, got 0"),
    ("ckpt", "the following arguments are required: ckpt_command"),
    ("ckpt verify missing_dir", "missing_dir is not a dtrain checkpoint"),
    ("ckpt verify emptyckpt", "emptyckpt is not a dtrain checkpoint (no manifest.json)"),
    ("ckpt inspect missing_dir", "missing_dir is not a dtrain checkpoint"),
    ("ckpt convert g.safetensors out_dir", "g.safetensors cannot be read as a safetensors"),
    ("ckpt convert missing_dir out_dir", "missing_dir does not exist"),
    ("horovodrun", "Say how many processes to start with -np N"),
    ("horovodrun -np 0 python x.py", "-np must be at least 1, got 0"),
    ("horovodrun -np -2 python x.py", "-np must be at least 1, got -2"),
    ("horovodrun -np abc python x.py", "invalid int value: 'abc'"),
    ("horovodrun -np 2 -H", "expected one argument"),
    ("horovodrun -np 2 -H localhost:0 python x.py", "the slots in 'localhost:0' must be"),
    ("horovodrun -np 2 --hostfile missing python x.py", "The hostfile missing does not exist"),
    (
        "horovodrun -np 2 --gloo-timeout-seconds -1 python x.py",
        "--gloo-timeout-seconds must be a number of seconds above 0",
    ),
    ("horovodrun -np 2 --min-np 3 --max-np 2 python x.py", "--min-np 3 and --max-np 2 must"),
    ("horovodrun -np 2 python missing.py", "The script missing.py does not exist"),
    ("horovodrun -np 2 no_such_program_x", "horovodrun cannot run 'no_such_program_x'"),
]

ACCEPTED = [
    # Flags after the script belong to the script, as with python and torchrun.
    "run x.py --nproc 2 --strategy",
    # An empty --blocks names no classes: the blocks are found automatically.
    'demo --blocks ""',
]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A current directory with the files the table names; starting processes is
    replaced by a note, so a case that passes every check is seen, not run."""
    (tmp_path / "x.py").write_text("print('trained')\n")
    (tmp_path / "bad.toml").write_text("not toml [[[\n")
    (tmp_path / "badtype.toml").write_text('nproc = "two"\n')
    (tmp_path / "badkey.toml").write_text("no_such_key = 1\n")
    (tmp_path / "emptyckpt").mkdir()
    (tmp_path / "g.safetensors").write_text("garbage\n")
    monkeypatch.chdir(tmp_path)
    started: list[str] = []
    for name in ("_run_here", "_run_elastic", "launch_over_ssh"):
        monkeypatch.setattr(runner, name, lambda *a, name=name, **k: started.append(name))
    return started


def _invoke(line: str) -> int | None:
    argv = shlex.split(line)
    try:
        if argv[0] == "horovodrun":
            return horovodrun.main(argv[1:])
        return cli.main(argv)
    except SystemExit as e:  # argparse's own refusals
        return e.code if isinstance(e.code, int) else 1


@pytest.mark.parametrize(("line", "message"), REFUSED)
def test_a_malformed_invocation_is_refused_in_one_block(
    workdir: list[str], capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    code = _invoke(line)
    err = capsys.readouterr().err.strip()
    assert code not in (0, None), f"{line!r} was accepted; stderr: {err}"
    assert not workdir, f"{line!r} started processes"
    assert message in err, err
    assert "Traceback" not in err and "\n\n" not in err, err


@pytest.mark.parametrize("line", ACCEPTED)
def test_inputs_accepted_on_purpose_reach_the_launcher(
    workdir: list[str], capsys: pytest.CaptureFixture[str], line: str
) -> None:
    assert _invoke(line) in (0, None), capsys.readouterr().err
    assert workdir
