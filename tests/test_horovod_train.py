"""Horovod-style training on dtrain: `hvd.DistributedOptimizer` on 2 ranks, each on its
half of the global batch, ends with the parameters of one process on the whole batch;
`horovodrun` runs the digits example; the `horovod.torch` alias and horovodrun's refusals."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from torch.testing import assert_close

import dtrain.horovod as hvd
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.run import main as horovodrun
from dtrain.models.digits import DigitsMLP

ROOT = Path(__file__).resolve().parents[1]
STEPS, GLOBAL_BATCH = 4, 16


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (torch.rand(GLOBAL_BATCH, 1, 8, 8, generator=generator),
         torch.randint(0, 10, (GLOBAL_BATCH,), generator=generator))
        for _ in range(STEPS)
    ]  # fmt: skip


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def _adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _reference(make_optimizer, micro: int, clip: float | None) -> dict[str, torch.Tensor]:
    """One process on the whole global batch (cut into `micro` accumulated micro-batches)."""
    torch.manual_seed(0)
    model = DigitsMLP(hidden=16)
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for x, y in _data():
        for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
            (F.cross_entropy(model(xs), ys) / micro).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _horovod_script(
    make_optimizer, passes: int, clip: float | None, groups: int | None = None
) -> dict[str, torch.Tensor]:
    """The same training, written as a Horovod script: every rank its half of each batch."""
    torch.manual_seed(hvd.rank())  # different starting points until the broadcast
    model = DigitsMLP(hidden=16)
    optimizer = make_optimizer(model)
    # A scheduler built on the plain optimizer keeps driving the wrapped one.
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    torch.manual_seed(0)
    reference_start = DigitsMLP(hidden=16).state_dict()
    if hvd.rank() == 0:
        model.load_state_dict(reference_start)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
        groups=groups,
    )
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert optimizer.param_groups is scheduler.optimizer.param_groups
    for step, (x, y) in enumerate(_data()):
        xs, ys = x.chunk(hvd.size())[hvd.rank()], y.chunk(hvd.size())[hvd.rank()]
        for xm, ym in zip(xs.chunk(passes), ys.chunk(passes), strict=True):
            (F.cross_entropy(model(xm), ym) / passes).backward()
        if step == 0:
            with pytest.raises(HorovodUsageError, match="zero_grad"):
                optimizer.zero_grad()
        if clip is None:
            optimizer.step()
        else:  # reduce first, clip the reduced gradients, then step without reducing again
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with optimizer.skip_synchronize():
                optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    if passes == 1:  # a second backward before step is refused, naming the parameter
        F.cross_entropy(model(xs), ys).backward()
        with pytest.raises(HorovodUsageError, match="net.5.bias"):
            F.cross_entropy(model(xs), ys).backward()
        optimizer.synchronize()
        optimizer.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _check_sparse_gradients(sparse_as_dense: bool) -> None:
    """Rank k looks up rows k and k+1 of a sparse embedding: the reduced gradient is the
    average of every rank's, sparse, whether sent as indices and values or dense."""
    n, k = hvd.size(), hvd.rank()
    embedding = torch.nn.Embedding(n + 1, 2, sparse=True)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(embedding.parameters(), lr=1.0), sparse_as_dense=sparse_as_dense
    )
    embedding(torch.tensor([k, k + 1])).sum().backward()
    optimizer.synchronize()
    expected = torch.zeros(n + 1, 2)
    for other in range(n):
        expected[other : other + 2] += 1.0 / n
    assert embedding.weight.grad.is_sparse
    assert_close(embedding.weight.grad.to_dense(), expected)
    with optimizer.skip_synchronize():
        optimizer.step()


def _train_four_ways() -> list[dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    hvd.init()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no scheduler or synchronize warning
        results = [
            _horovod_script(_sgd, passes=1, clip=None),
            _horovod_script(_sgd, passes=2, clip=0.5),
            _horovod_script(_adam, passes=2, clip=None),
            _horovod_script(_sgd, passes=1, clip=None, groups=2),
        ]
    _check_sparse_gradients(sparse_as_dense=False)
    _check_sparse_gradients(sparse_as_dense=True)
    hvd.shutdown()
    return results


@pytest.mark.timeout(180)
def test_distributed_optimizer_on_two_ranks_equals_one_process_on_the_global_batch() -> None:
    expected = [
        _reference(_sgd, micro=1, clip=None),
        _reference(_sgd, micro=4, clip=0.5),
        _reference(_adam, micro=4, clip=None),
        _reference(_sgd, micro=1, clip=None),
    ]
    per_rank = run_ranks(_train_four_ways, 2, timeout=150)
    for rank_results in per_rank:
        for got, want in zip(rank_results, expected, strict=True):
            assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_horovodrun_trains_the_digits_example() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DTRAIN_CONFIG", "RANK")}
    env["PYTHONPATH"] = str(ROOT / "src")
    command = [sys.executable, "-m", "dtrain.horovod.run", "-np", "2", "-H", "localhost:2"]
    command += ["python", "examples/horovod_digits.py", "--epochs", "3"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout + done.stderr
    accuracy = re.search(r"test accuracy ([0-9.]+) on 2 process", done.stdout)
    assert accuracy is not None, done.stdout + done.stderr
    assert float(accuracy.group(1)) >= 0.85


@pytest.fixture
def one_process() -> None:
    """No process group in this process, and the environment restored afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    saved = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HOROVOD_SIZE"):
        os.environ.pop(name, None)
    yield
    hvd.shutdown()
    os.environ.clear()
    os.environ.update(saved)


def test_synthetic_benchmark_runs_as_one_process(
    one_process: None, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark = runpy.run_path(str(ROOT / "examples" / "horovod_synthetic_benchmark.py"))
    benchmark["main"](["--hidden", "32", "--num-iters", "2", "--num-batches-per-iter", "2"])
    assert "Total samples/sec on 1 process(es)" in capsys.readouterr().out


def test_import_horovod_torch_is_dtrain_horovod() -> None:
    from horovod.torch.compression import Compression

    import horovod
    import horovod.torch as alias

    assert alias.allreduce is hvd.allreduce
    assert alias.DistributedOptimizer is hvd.DistributedOptimizer
    assert Compression.fp16 is hvd.Compression.fp16
    assert horovod.__version__ == "0.28.1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-np", "3", "-H", "node-a:1,node-b:1", "python", "x.py"], "does not match the 2 slots"),
        (["-np", "3", "-H", "node-a:1,node-b:2", "python", "x.py"], "different numbers of slots"),
        (["-np", "2", "--mpi", "python", "x.py"], "MPI"),
        (["-np", "3", "-H", "localhost:2", "python", "x.py"], "more processes than the 2 slot"),
        (["-np", "3", "--min-np", "1", "--max-np", "2", "python", "x.py"], "outside --min-np"),
        (["-np", "2"], "Give the command"),
        (["-np", "2", "python", "no_such_script.py"], "does not exist"),
        (["-np", "2", "./no_such_program.sh"], "cannot run './no_such_program.sh'"),
        (["python", "x.py"], "-np N"),
    ],
)
def test_horovodrun_refuses_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert horovodrun(argv) == 2
    assert message in capsys.readouterr().err


def test_horovodrun_hostfile_and_command_forms(tmp_path: Path) -> None:
    from dtrain.horovod.hosts import parse_hostfile, this_machine
    from dtrain.horovod.run import target_of

    hostfile = tmp_path / "hosts"
    hostfile.write_text("# this machine\nlocalhost slots=4\n")
    assert this_machine(parse_hostfile(str(hostfile))).slots == 4
    script = tmp_path / "train.py"
    script.write_text("")
    assert target_of(["python3", "-u", str(script), "--lr", "1"]).args == ("--lr", "1")
    assert target_of([str(script)]).name == str(script)
    assert target_of(["python", "-m", "pkg.train", "a"]).kind == "module"
    # Any other program runs as one of its own, found on PATH.
    assert target_of(["bash", "-c", "true"]).kind == "command"
    code = target_of([sys.executable, "-c", "print(1)"])
    assert (code.kind, code.name, code.args) == ("command", sys.executable, ("-c", "print(1)"))


@pytest.mark.timeout(120)
def test_horovodrun_runs_any_command_with_the_rank_variables(tmp_path: Path) -> None:
    script = tmp_path / "show.sh"
    script.write_text('echo "rank $HOROVOD_RANK of $HOROVOD_SIZE, torch rank $RANK"\nexit $1\n')
    run = [sys.executable, "-m", "dtrain.horovod.run", "-np", "2", "bash", str(script)]
    done = subprocess.run([*run, "0"], capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2, torch rank {rank}" in done.stdout
    failed = subprocess.run([*run, "3"], capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert failed.returncode == 3, failed.stdout + failed.stderr


def test_wrapped_optimizer_stays_one_with_the_original(one_process: None) -> None:
    hvd.init()
    model = torch.nn.Linear(2, 2)
    plain = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
    wrapped = hvd.DistributedOptimizer(plain, named_parameters=model.named_parameters())
    assert type(wrapped).__name__ == "SGD" and isinstance(wrapped, torch.optim.SGD)
    checkpoint = torch.optim.SGD(model.parameters(), lr=4.0, momentum=0.5).state_dict()
    wrapped.load_state_dict(checkpoint)  # a resume: the scheduler still drives the groups
    model(torch.ones(1, 2)).sum().backward()
    wrapped.step()
    scheduler.step()
    assert wrapped.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == 2.0
    assert wrapped.param_groups[0]["momentum"] == 0.5
    extra = torch.nn.Parameter(torch.zeros(3))
    wrapped.add_param_group({"params": [extra]})
    assert plain.param_groups[-1]["params"] == [extra]
    with pytest.raises(HorovodUsageError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(wrapped)
