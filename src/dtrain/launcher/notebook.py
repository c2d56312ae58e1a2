"""`dtrain.launch`: run a training function on N processes from a notebook or a REPL.

The function may be defined in the notebook itself: the ranks are forked from this
process (forked.py), each with the environment `dtrain run` gives its workers, so
`dtrain.init()` inside the function just works.
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtrain.advice import COMMAND_VAR, LAUNCH
from dtrain.config import ENV_VAR, Config
from dtrain.errors import ConfigError, LaunchError
from dtrain.launcher.failures import killed_advice
from dtrain.launcher.forked import Child, end, fork_rank, watch
from dtrain.strategies.specs import lookup

_OK, _ERROR = b"o", b"e"
"""The first byte of what a rank sends back: a pickled result, or (message, traceback)."""


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int = 1,
    strategy: str | None = None,
    timeout: float | None = None,
    **options: Any,
) -> list[Any]:
    """Run ``fn(*args)`` on `nproc` processes of this machine; return the results in rank
    order.

    Each process starts as a fork of this one, so `fn` may be defined in a notebook cell,
    in ``__main__`` or in a script read from standard input. Inside it, ``dtrain.init()``
    returns the Engine of its rank, as under ``dtrain run --strategy STRATEGY --nproc
    NPROC``. `options` are the other fields of :class:`dtrain.Config` (``towers``,
    ``grad_accumulation``, ``log_every``, ``seed``...). The ranks inherit this process's
    random generators, so a seed set here with ``torch.manual_seed`` before the call is
    kept on every rank (without ``seed=``). Each rank's output is printed here, line by
    line, prefixed ``[rank N]``; an Engine the function did not close is closed when it
    returns. Under ``strategy="ps"`` the parameter servers are started too; only the
    workers' results are returned.

    Example::

        import dtrain, torch
        import torch.nn.functional as F

        def train(steps):                         # defined in the notebook
            engine = dtrain.init()
            model = torch.nn.Linear(4, 1)
            engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for _ in range(steps):
                engine.train_step((torch.randn(8, 4), torch.randn(8, 1)), F.mse_loss)
            return engine.rank, model.weight.detach()

        results = dtrain.launch(train, 10, nproc=2)   # [(0, weight), (1, weight)]

    Args:
        fn: what each rank runs; its result must be picklable.
        nproc: training processes (ps: the workers; the servers are added).
        strategy: a ``--strategy`` name; None is ddp with more than one process, else
            single.
        timeout: seconds the whole run may take; None waits forever.

    Raises:
        ConfigError: before any process starts, for an unknown option or bad value, a
            process layout the strategy refuses, or a process that cannot fork safely
            (CUDA already initialised, a process group already joined).
        LaunchError: a rank raised (its traceback is in the message), died without a
            result, or the timeout expired; every rank has been stopped by then.
    """
    # Imported here, not with `dtrain`: each `dtrain run` worker starts as `python -m
    # dtrain.launcher.bootstrap`, and runpy warns if `import dtrain` had imported it already.
    from dtrain.launcher.runner import _threads_per_worker, free_port

    config = _config(strategy, nproc, options)
    spec = lookup(config.strategy)
    spec.check_launch(config)
    spec.check_options(config)
    _check_here(config, timeout)
    # GPU checks (enough GPUs for nproc, GPU-only options) happen in each rank's
    # dtrain.init: probing the GPUs here would initialise CUDA before the fork.
    world = spec.processes_per_node(config)
    roles = [spec.role_main(config, rank) for rank in range(world)]
    threads, port = _threads_per_worker(world), free_port()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # this process's own output comes before the ranks'
    children: list[Child] = []
    try:
        for rank, role in enumerate(roles):
            run = functools.partial(_outcome, role or functools.partial(fn, *args), int(threads))
            env = _environment(config, rank, world, port, threads)
            children.append(fork_rank(rank, env, run, children))
        timed_out = watch(children, timeout, _failed)
    finally:
        end(children)
    if any(_failed(child) for child in children):  # a stopped rank sent nothing back
        raise LaunchError(_report(children, timed_out, timeout))
    return [_result(child) for child, role in zip(children, roles, strict=True) if role is None]


def _config(strategy: str | None, nproc: int, options: dict[str, Any]) -> Config:
    try:
        return Config().replace(strategy=strategy, nproc=nproc, **options)
    except TypeError as e:  # a value of the wrong type meets a comparison in validate()
        raise ConfigError(
            f"An option of dtrain.launch has a value of the wrong type ({e}); give each "
            "option the type of its dtrain.Config field, for example nproc=2 or log_every=10."
        ) from None


def _check_here(config: Config, timeout: float | None) -> None:
    """Refuse what dtrain.launch cannot do, or a process it cannot safely fork."""
    if not hasattr(os, "fork"):
        raise ConfigError(
            "dtrain.launch forks this process, which this platform cannot do; put the code "
            "in a script and start it with `dtrain run`."
        )
    if config.nnodes != 1 or config.max_restarts != 0:
        raise ConfigError(
            "dtrain.launch runs every rank on this machine, once; for several machines or "
            "restarts, put the code in a script and start it with `dtrain run --nnodes N` "
            "or `--max-restarts R`."
        )
    if timeout is not None and timeout <= 0:
        raise ConfigError(f"timeout must be positive seconds or None, got {timeout}.")
    if torch.cuda.is_initialized():
        raise ConfigError(
            "CUDA is already initialised in this process, and a process forked after that "
            "cannot use the GPU; restart the kernel (or the interpreter) and call "
            "dtrain.launch before anything touches the GPU, or put the code in a script and "
            "start it with `dtrain run`."
        )
    if dist.is_available() and dist.is_initialized():
        raise ConfigError(
            "This process already belongs to a process group (dtrain.init() or "
            "init_process_group ran here), which the ranks would inherit; call "
            "engine.close() (or torch.distributed.destroy_process_group()) first, or restart "
            "the kernel."
        )


def _environment(config: Config, rank: int, world: int, port: int, threads: str) -> dict[str, str]:
    """The variables `dtrain run` sets for a worker of a one-machine job, naming
    dtrain.launch as the command."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": threads,
        ENV_VAR: config.to_json(),
        COMMAND_VAR: LAUNCH,
    }


def _outcome(body: Callable[[], Any], threads: int) -> bytes:
    """In a rank: run `body`; return what goes back to the parent."""
    torch.set_num_threads(threads)  # the parent's pool was sized for one process
    try:
        result = body()
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
        from dtrain.launcher.bootstrap import describe  # already imported by the parent

        assert e.__traceback__ is not None
        return _ERROR + pickle.dumps(describe(e.with_traceback(e.__traceback__.tb_next)))
    try:
        return _OK + pickle.dumps(result)
    except Exception as e:  # noqa: BLE001 - pickle raises many types
        message = (
            f"It returned a {type(result).__name__}, which cannot be pickled to send it back "
            f"({e}); return plain values, tensors or state dicts instead (for example "
            "model.state_dict() rather than the model)."
        )
        return _ERROR + pickle.dumps((message, ""))


def _failed(child: Child) -> bool:
    if child.result is not None:
        return child.result.startswith(_ERROR)
    return child.status is not None


def _result(child: Child) -> Any:
    assert child.result is not None
    try:
        return pickle.loads(child.result[1:])
    except Exception as e:  # noqa: BLE001 - unpickling raises many types
        raise LaunchError(
            f"The result of rank {child.rank} cannot be unpickled here ({e}); return plain "
            "values, tensors or state dicts, of types this process can import."
        ) from None


def _report(children: list[Child], timed_out: bool, timeout: float | None) -> str:
    """One paragraph per way the ranks failed, the ranks that caused it first."""
    # A rank stopped after another failed is no cause, unless it raised on its own too.
    causes = [c for c in children if _failed(c) and (c.result is not None or not c.stopped)]
    reports: dict[tuple[str, str], list[int]] = {}
    for child in causes:
        reports.setdefault(_how(child), []).append(child.rank)
    parts = [
        f"{_ranks(ranks)} {how}\n{detail}".rstrip() for (how, detail), ranks in reports.items()
    ]
    stopped = [c.rank for c in children if c.stopped and c not in causes]
    were = "was" if len(stopped) == 1 else "were"
    if timed_out and stopped:
        parts.insert(
            0,
            f"{_ranks(stopped)} had not finished after the timeout of {timeout:g} s and "
            f"{were} stopped; raise timeout, or look at their output above for where they "
            "wait.",
        )
    elif stopped:
        parts.append(f"{_ranks(stopped)} {were} stopped after that.")
    return "\n\n".join(parts)


def _how(child: Child) -> tuple[str, str]:
    """(how `child` failed, its traceback or what to check)."""
    if child.result is not None:
        message, stack = pickle.loads(child.result[1:])
        return "failed; fix the cause below and call dtrain.launch again:", stack or message
    assert child.status is not None
    if child.status < 0:
        return (
            f"was killed by signal {_signal_name(-child.status)} before returning a result.",
            killed_advice(),
        )
    return (
        f"exited with code {child.status} before returning a result (os._exit, or a crash "
        "outside Python); its output above shows why.",
        "",
    )


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _ranks(ranks: list[int]) -> str:
    return f"Rank {ranks[0]}" if len(ranks) == 1 else f"Ranks {', '.join(map(str, ranks))}"
