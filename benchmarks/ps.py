"""The parameter server (`--strategy ps`) against its peers, side by side.

Three measurements, each a fresh job per run (a PS server ends with its job), the
configurations alternating, `--repeats` times; medians and ratios are printed.

1. throughput: ps sync (2 workers + 1 server) against dtrain's ddp (2 workers, i.e.
   PyTorch DDP), same model, data and global batch; samples/s of the whole job.
2. stragglers: worker 1 slowed 2x (after each step it sleeps as long as the step took;
   a benchmark option, not a product flag). For sync, ssp (s=2) and async: the fast
   worker's samples/s against its own pace, measured in a run just before, where both
   workers train alone (no communication, no server, so nobody waits).
3. bandwidth: one worker and one server, one parameter of `--mbytes` MB with its
   gradient set by hand; a push + commit (the server's SGD step) + pull, against a plain
   gloo send + recv of the same bytes each way between the same two processes, the two
   alternating step by step; the medians of each run, `--repeats` runs.

    python benchmarks/ps.py --repeats 3 --steps 150
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_overhead import make_data
from harness import alternate, launch
from torch import nn

import dtrain
from dtrain.config import Config
from dtrain.models import build
from dtrain.process.topology import init_process_group
from dtrain.strategies.ps import serving
from dtrain.strategies.specs import lookup


def role(options: dict[str, Any]) -> Any:
    """What the launcher runs on this rank instead of the script (a server's serving), or
    None on a rank that runs the script."""
    return lookup(options["strategy"]).role_main(Config(**options), int(os.environ["RANK"]))


def train_job(options: dict[str, Any], args: argparse.Namespace, slow_rank: int | None) -> Any:
    """Train `args.steps` timed steps under `options`; a server serves and returns None.

    Returns (this worker's rank, its steps, its seconds, its per-worker batch).
    """
    torch.set_num_threads(1)
    serve = role(options)
    if serve is not None:
        return serve()
    engine = dtrain.init(seed=0, **options)
    model = build(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = engine.setup(model, optimizer)
    per_worker = args.global_batch_size // engine.dp_size
    data = make_data((args.warmup + args.steps + 1) * args.global_batch_size)
    loader = engine.dataloader(data, batch_size=per_worker)
    batches = iter(loader)
    slow = engine.rank == slow_rank

    def step() -> None:
        began = time.perf_counter()
        engine.train_step(next(batches), F.cross_entropy)
        if slow:
            time.sleep(time.perf_counter() - began)

    for _ in range(args.warmup):
        step()
    engine.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - start
    del model, optimizer
    engine.close()
    return engine.rank, args.steps, seconds, per_worker


def alone_job(args: argparse.Namespace, slow_rank: int) -> Any:
    """Each worker trains its own copy with plain PyTorch: its pace when it never waits."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    per_worker = args.global_batch_size // 2
    data = make_data((args.warmup + args.steps) * per_worker)
    x, y = data.tensors

    def step(i: int) -> None:
        began = time.perf_counter()
        part = slice(i * per_worker, (i + 1) * per_worker)
        F.cross_entropy(model(x[part]), y[part]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == slow_rank:
            time.sleep(time.perf_counter() - began)

    for i in range(args.warmup):
        step(i)
    dist.barrier()
    start = time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i)
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return rank, args.steps, seconds, per_worker


PLAIN_TAG = 99
"""The plain exchanges' tag, apart from the parameter-server protocol's."""


class Wide(nn.Module):
    """One weight of `numel` elements and next to no compute: a pure communication load."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, 1) -> (N, 1): one multiply-add over the weight."""
        return x * self.weight.sum()


def bandwidth_job(args: argparse.Namespace) -> Any:
    """Seconds per plain send+recv exchange and per ps push+pull step of the same bytes,
    alternating step by step between the same two processes, so that the machine's load
    weighs on both alike: the server rank runs its serving loop in a thread while its main
    thread answers the plain exchanges (on a tag of their own)."""
    torch.set_num_threads(1)
    numel = int(args.mbytes * (1 << 20)) // 4
    options = {"strategy": "ps", "nproc": 1, "servers": 1}
    config = Config(**options)
    buffer = torch.zeros(numel)
    steps = args.warmup + args.bw_steps
    if role(options) is not None:
        init_process_group(serving.topology(config, server=True), config.timeout_s)
        failure: list[BaseException] = []
        server = threading.Thread(target=serve_catching, args=(config, failure))
        server.start()
        for _ in range(steps):
            dist.recv(buffer, 0, tag=PLAIN_TAG)
            dist.send(buffer, 0, tag=PLAIN_TAG)
        server.join()
        dist.destroy_process_group()
        if failure:
            raise failure[0]
        return None
    engine = dtrain.init(seed=0, **options)
    model = Wide(numel)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    # The gradient is set by hand, so only the messages and the server's update are timed:
    # push (the hook's work, called directly), commit (the server's SGD step), pull.
    (weight,) = model.parameters()
    weight.grad = torch.ones_like(weight)
    client = engine.strategy.client

    def plain() -> float:
        began = time.perf_counter()
        dist.send(buffer, 1, tag=PLAIN_TAG)
        dist.recv(buffer, 1, tag=PLAIN_TAG)
        return time.perf_counter() - began

    def ps() -> float:
        began = time.perf_counter()
        client.push(0)
        optimizer.step()
        client.wait_pulls()
        return time.perf_counter() - began

    times = alternate(steps, plain, ps)[args.warmup :]
    engine.close()
    return statistics.median(a for a, _ in times), statistics.median(b for _, b in times), numel * 4


def serve_catching(config: Config, failure: list[BaseException]) -> None:
    """`serving.serve_job` in a thread, keeping its exception for the main thread."""
    try:
        serving.serve_job(config)
    except BaseException as e:  # noqa: BLE001 - re-raised by the main thread
        failure.append(e)


def job_samples_per_second(results: list[Any]) -> float:
    """Samples of every worker over the slowest worker's time."""
    workers = [r for r in results if r is not None]
    return sum(s * b for _, s, _, b in workers) / max(sec for _, _, sec, _ in workers)


def fast_samples_per_second(results: list[Any], slow_rank: int) -> float:
    """The fast worker's own samples per second."""
    rank, steps, seconds, batch = next(r for r in results if r is not None and r[0] != slow_rank)
    return steps * batch / seconds


def throughput(args: argparse.Namespace) -> None:
    ps = {"strategy": "ps", "nproc": 2, "servers": 1, "ps_mode": "sync"}
    ddp = {"strategy": "ddp", "nproc": 2}
    rows = []
    for repeat in range(args.repeats):
        order = [("ps", ps, 3), ("ddp", ddp, 2)]
        result = {}
        for name, options, nproc in order if repeat % 2 == 0 else order[::-1]:
            result[name] = job_samples_per_second(launch(nproc, train_job, options, args, None))
        rows.append((result["ps"], result["ddp"]))
        print(f"  repeat {repeat}: ps sync {rows[-1][0]:,.0f}  ddp {rows[-1][1]:,.0f} samples/s")
    report("ps sync / ddp", rows)


def stragglers(args: argparse.Namespace) -> None:
    modes = {
        "sync": {"ps_mode": "sync"},
        "ssp": {"ps_mode": "ssp", "staleness": 2},
        "async": {"ps_mode": "async"},
    }
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    for repeat in range(args.repeats):
        names = list(modes) if repeat % 2 == 0 else list(modes)[::-1]
        line = []
        for name in names:
            # The pace alone is measured right before each mode: the machine's load drifts.
            alone = fast_samples_per_second(launch(2, alone_job, args, 1), 1)
            options = {"strategy": "ps", "nproc": 2, "servers": 1, **modes[name]}
            fast = fast_samples_per_second(launch(3, train_job, options, args, 1), 1)
            ratios[name].append(fast / alone)
            line.append(f"{name} {fast:,.0f} / alone {alone:,.0f} = {fast / alone:.2f}")
        print(f"  repeat {repeat}: fast worker samples/s: " + ", ".join(line))
    for name, values in ratios.items():
        print(
            f"stragglers {name}: median fast-worker pace ratio {statistics.median(values):.3f}"
            f" (runs: {', '.join(f'{v:.2f}' for v in values)})"
        )


def bandwidth(args: argparse.Namespace) -> None:
    rows = []
    for repeat in range(args.repeats):
        plain, ps, size = launch(2, bandwidth_job, args)[0]
        rows.append((2 * size / ps / 1e6, 2 * size / plain / 1e6))
        print(
            f"  repeat {repeat}: {size / 1e6:.1f} MB each way: ps push+pull {rows[-1][0]:,.0f} "
            f"MB/s, plain send+recv {rows[-1][1]:,.0f} MB/s"
        )
    report("bandwidth ps / plain gloo", rows)


def report(label: str, rows: list[tuple[float, float]]) -> None:
    ratios = [a / b for a, b in rows]
    print(
        f"{label}: median {statistics.median(a for a, _ in rows):,.1f} vs "
        f"{statistics.median(b for _, b in rows):,.1f}, median ratio "
        f"{statistics.median(ratios):.3f} (runs: {', '.join(f'{r:.2f}' for r in ratios)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mbytes", type=float, default=16.0, help="bandwidth test size")
    parser.add_argument("--bw-steps", type=int, default=20)
    parser.add_argument("--only", choices=("throughput", "stragglers", "bandwidth"), default=None)
    args = parser.parse_args()
    print(
        f"model {args.model}, global batch {args.global_batch_size}, {args.steps} timed steps "
        f"after {args.warmup}, {args.repeats} repeats, torch {torch.__version__}"
    )
    for name, fn in (
        ("throughput", throughput),
        ("stragglers", stragglers),
        ("bandwidth", bandwidth),
    ):
        if args.only in (None, name):
            print(f"== {name}")
            fn(args)


if __name__ == "__main__":
    main()
