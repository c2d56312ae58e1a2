"""Horovod's collectives (`dtrain.horovod`, alias `horovod.torch`) against their documented
semantics, on 3 and then 2 gloo ranks in one spawn, and their errors in this process."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from distributed import free_port, run_ranks
from torch.testing import assert_close

import dtrain.horovod as hvd
from dtrain.horovod.errors import HorovodUsageError, NotInitializedError, UnsupportedError


def _check_basics(r: int, n: int) -> None:
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (r, n, r, n)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert os.environ["HOROVOD_RANK"] == str(r) and os.environ["HOROVOD_SIZE"] == str(n)
    assert hvd.gloo_built() and hvd.gloo_enabled() and not hvd.mpi_built()
    assert hvd.is_homogeneous()


def _check_allreduce(r: int, n: int) -> None:
    values = [torch.tensor([float(k + 1), 2.0 * k]) for k in range(n)]
    x = values[r].clone()
    stacked = torch.stack(values)
    assert_close(hvd.allreduce(x), stacked.mean(0))
    assert_close(x, values[r])  # the input is left alone
    assert_close(hvd.allreduce(x, op=hvd.Sum), stacked.sum(0))
    assert_close(hvd.allreduce(x, op=hvd.Min), stacked.min(0).values)
    assert_close(hvd.allreduce(x, op=hvd.Max), stacked.max(0).values)
    assert_close(hvd.allreduce(x + 1, op=hvd.Product), (stacked + 1).prod(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert_close(hvd.allreduce(x, average=False), stacked.sum(0))
    # Integer averages are truncated, as Horovod scales them.
    ints = hvd.allreduce(torch.tensor([3 * r + 1]))
    assert ints.dtype == torch.int64
    assert ints.item() == int(sum(3 * k + 1 for k in range(n)) / n)
    # Scaling: postscale * reduce(prescale * x), divided by n for Average.
    assert_close(
        hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25),
        stacked.sum(0) * 0.5,
    )
    assert_close(hvd.allreduce(x, prescale_factor=3.0, postscale_factor=2.0), stacked.mean(0) * 6.0)
    # In place, asynchronous, fp16 on the wire.
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Sum) is y
    assert_close(y, stacked.sum(0))
    handle = hvd.allreduce_async(x, name="async")
    assert isinstance(hvd.poll(handle), bool)
    assert_close(hvd.synchronize(handle), stacked.mean(0))
    assert_close(hvd.synchronize(handle), stacked.mean(0))  # a second wait returns it again
    assert hvd.poll(handle)
    z = x.clone()
    handle = hvd.allreduce_async_(z, op=hvd.Max)
    assert hvd.synchronize(handle) is z
    assert_close(z, stacked.max(0).values)
    half = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert half.dtype == torch.float32
    assert_close(half, stacked.mean(0), atol=1e-2, rtol=1e-3)
    # Differentiable: the gradient is the all-reduce of the incoming gradient.
    leaf = x.clone().requires_grad_()
    hvd.allreduce(leaf, op=hvd.Sum).sum().backward()
    assert_close(leaf.grad, torch.full((2,), float(n)))


def _check_grouped_allreduce(r: int, n: int) -> None:
    group = [
        torch.full((2, 3), float(r)),
        torch.tensor([r], dtype=torch.int64),
        torch.arange(4, dtype=torch.float64) * (r + 1),
    ]
    total = n * (n + 1) / 2
    expected = [
        torch.full((2, 3), sum(range(n)) / n),
        torch.tensor([sum(range(n)) // n]),
        torch.arange(4, dtype=torch.float64) * total / n,
    ]
    for got, want in zip(hvd.grouped_allreduce(group), expected, strict=True):
        assert_close(got, want)
    summed = hvd.grouped_allreduce(group, op=hvd.Sum, name="g")
    assert_close(summed[2], torch.arange(4, dtype=torch.float64) * total)
    copies = [t.clone() for t in group]
    assert all(a is b for a, b in zip(hvd.grouped_allreduce_(copies), copies, strict=True))
    assert_close(copies[0], expected[0])
    handle = hvd.grouped_allreduce_async(group, op=hvd.Sum)
    assert_close(hvd.synchronize(handle)[1], torch.tensor([sum(range(n))]))
    copies = [t.clone() for t in group]
    hvd.synchronize(hvd.grouped_allreduce_async_(copies))
    assert_close(copies[2], expected[2])


def _check_allgather(r: int, n: int) -> None:
    mine = torch.full((r + 1, 2), float(r))
    expected = torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)])
    assert_close(hvd.allgather(mine), expected)
    assert_close(hvd.synchronize(hvd.allgather_async(mine, name="ag")), expected)
    ints = torch.arange(r + 2, dtype=torch.int32)
    gathered = hvd.grouped_allgather([mine, ints])
    assert_close(gathered[0], expected)
    assert_close(gathered[1], torch.cat([torch.arange(k + 2, dtype=torch.int32) for k in range(n)]))
    handle = hvd.grouped_allgather_async([ints])
    assert hvd.synchronize(handle)[0].shape == (sum(k + 2 for k in range(n)),)
    # Gradient: this rank's slice of the averaged incoming gradient.
    leaf = mine.clone().requires_grad_()
    (hvd.allgather(leaf) * (r + 1)).sum().backward()
    assert_close(leaf.grad, torch.full((r + 1, 2), (n + 1) / 2))
    # Trailing dimensions that differ are reported by every rank, naming each shape.
    with pytest.raises(HorovodUsageError, match=r"rank 0: torch.float32 \(1, 2\)"):
        hvd.allgather(torch.ones(1, 2 + r))
    with pytest.raises(HorovodUsageError, match="scalar"):
        hvd.allgather(torch.tensor(1.0))


def _check_broadcast(r: int, n: int) -> None:
    root = n - 1
    mine = torch.full((3,), float(r))
    assert_close(hvd.broadcast(mine, root_rank=root), torch.full((3,), float(root)))
    assert_close(mine, torch.full((3,), float(r)))
    copy = mine.clone()
    assert hvd.broadcast_(copy, 0) is copy
    assert_close(copy, torch.zeros(3))
    assert_close(hvd.synchronize(hvd.broadcast_async(mine, root)), torch.full((3,), float(root)))
    copy = mine.clone()
    hvd.synchronize(hvd.broadcast_async_(copy, root))
    assert_close(copy, torch.full((3,), float(root)))
    with pytest.raises(HorovodUsageError, match="root_rank"):
        hvd.broadcast(mine, root_rank=n)
    leaf = mine.clone().requires_grad_()
    hvd.broadcast(leaf, 0).sum().backward()
    assert_close(leaf.grad, torch.full((3,), 1.0 if r == 0 else 0.0))


def _check_alltoall(r: int, n: int) -> None:
    # Without splits: equal parts; the output alone is returned.
    rows = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    out = hvd.alltoall(rows)
    assert isinstance(out, torch.Tensor)
    assert_close(out, torch.cat([torch.tensor([2.0 * r, 2.0 * r + 1]) + 100 * k for k in range(n)]))
    # With splits: rank r sends r + j + 1 rows (of value 100 r + j) to rank j.
    splits = [r + j + 1 for j in range(n)]
    data = torch.cat([torch.full((s, 2), 100.0 * r + j) for j, s in enumerate(splits)])
    output, received = hvd.alltoall(data, splits=splits)
    assert received.dtype == torch.int32
    assert received.tolist() == [k + r + 1 for k in range(n)]
    assert_close(output, torch.cat([torch.full((k + r + 1, 2), 100.0 * k + r) for k in range(n)]))
    output, received = hvd.synchronize(hvd.alltoall_async(data, torch.tensor(splits)))
    assert received.dtype == torch.int64 and output.shape == (sum(k + r + 1 for k in range(n)), 2)
    leaf = data.clone().requires_grad_()
    sent, _ = hvd.alltoall(leaf, splits=splits)
    (sent * 2).sum().backward()
    assert_close(leaf.grad, torch.full_like(data, 2.0))
    with pytest.raises(HorovodUsageError, match="equal"):
        hvd.alltoall(torch.ones(2 * n + 1))
    with pytest.raises(HorovodUsageError, match="splits"):
        hvd.alltoall(torch.ones(n), splits=[1] * (n + 1))


def _check_reducescatter(r: int, n: int) -> None:
    rows = 2 * n + 1  # uneven: the first rank gets one row more
    base = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    mine = base * (r + 1)
    total = n * (n + 1) / 2
    counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(counts[:r])
    expected = base[start : start + counts[r]] * total
    assert_close(hvd.reducescatter(mine, op=hvd.Sum), expected)
    assert_close(hvd.reducescatter(mine), expected / n)
    assert_close(
        hvd.reducescatter(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5), expected
    )
    assert_close(hvd.synchronize(hvd.reducescatter_async(mine, op=hvd.Sum)), expected)
    pair = hvd.grouped_reducescatter([mine, mine * 2], op=hvd.Sum)
    assert_close(pair[1], expected * 2)
    assert_close(hvd.synchronize(hvd.grouped_reducescatter_async([mine]))[0], expected / n)
    with pytest.raises(HorovodUsageError, match="Average or hvd.Sum"):
        hvd.reducescatter(mine, op=hvd.Max)


def _check_objects_and_join(r: int, n: int) -> None:
    root = n - 1
    got = hvd.broadcast_object({"rank": r, "payload": list(range(r))}, root_rank=root)
    assert got == {"rank": root, "payload": list(range(root))}
    assert hvd.allgather_object(("rank", r, "x" * r)) == [("rank", k, "x" * k) for k in range(n)]
    hvd.barrier()
    if r == n - 1:
        time.sleep(0.5)  # joins last
    assert hvd.join() == n - 1


def _check_parameters_and_optimizer(r: int, n: int) -> None:
    torch.manual_seed(r)  # different on every rank, until broadcast
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model[1].num_batches_tracked += r
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    states = hvd.allgather_object({k: v.clone() for k, v in model.state_dict().items()})
    for state in states[1:]:
        assert_close(state, states[0])
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=n - 1)
    before = [p.detach().clone() for p in model.parameters()]
    # A fresh optimizer: root's hyperparameters everywhere, no step taken, no state.
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1 * (r + 1), betas=(0.8, 0.9))
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert all(g["lr"] == pytest.approx(0.1) for g in optimizer.param_groups)
    assert len(optimizer.state) == 0
    for p, b in zip(model.parameters(), before, strict=True):
        assert_close(p, b)
    # Root has state (a step taken), the others are fresh: they get root's.
    if r == 0:
        model(torch.randn(5, 3)).sum().backward()
        optimizer.step()
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    dicts = hvd.allgather_object(optimizer.state_dict())
    for other in dicts[1:]:
        assert other["param_groups"] == dicts[0]["param_groups"]
        assert_close(other["state"], dicts[0]["state"])
    assert dicts[0]["state"][0]["exp_avg"].abs().sum() > 0


def _check_everything() -> None:
    r, n = hvd.rank(), hvd.size()
    _check_basics(r, n)
    _check_allreduce(r, n)
    _check_grouped_allreduce(r, n)
    _check_allgather(r, n)
    _check_broadcast(r, n)
    _check_alltoall(r, n)
    _check_reducescatter(r, n)
    _check_objects_and_join(r, n)
    _check_parameters_and_optimizer(r, n)


def _three_then_two(port_for_two: int) -> list[int]:
    """Every check on 3 ranks; then ranks 0 and 1 form a job of 2 and check again."""
    torch.set_num_threads(1)
    sizes = []
    hvd.init()
    _check_everything()
    sizes.append(hvd.size())
    hvd.shutdown()
    assert not hvd.is_initialized() and not dist.is_initialized()
    if int(os.environ["RANK"]) < 2:
        os.environ.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(port_for_two))
        hvd.init()
        _check_everything()
        sizes.append(hvd.size())
        hvd.shutdown()
    return sizes


@pytest.mark.timeout(180)
def test_every_op_on_three_and_two_ranks() -> None:
    assert run_ranks(_three_then_two, 3, free_port(), timeout=150) == [[3, 2], [3, 2], [3]]


@pytest.fixture
def clean_env() -> None:
    """A process without a process group, whose environment is restored afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    saved = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HOROVOD_RANK"):
        os.environ.pop(name, None)
    os.environ.pop("HOROVOD_SIZE", None)
    yield
    hvd.shutdown()
    os.environ.clear()
    os.environ.update(saved)


def test_calls_before_init_say_to_call_init(clean_env: None) -> None:
    assert not hvd.is_initialized()
    for call in (hvd.rank, hvd.size, hvd.local_rank, lambda: hvd.allreduce(torch.ones(1))):
        with pytest.raises(ValueError, match=r"call hvd.init\(\)"):
            call()
    with pytest.raises(NotInitializedError, match=r"hvd.broadcast_parameters\(\)"):
        hvd.broadcast_parameters({}, 0)
    assert hvd.gloo_built() and not hvd.mpi_enabled()  # build queries need no init


def test_one_process_without_a_launcher_and_refusals(clean_env: None) -> None:
    hvd.init()
    hvd.init()  # a second call does nothing
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.cross_size()) == (0, 1, 0, 1)
    x = torch.tensor([1.0, 2.0])
    assert_close(hvd.allreduce(x), x)
    assert_close(hvd.allgather(x), x)
    assert hvd.join() == 0
    with pytest.raises(UnsupportedError, match="Adasum is not supported"):
        hvd.allreduce(x, op=hvd.Adasum)
    with pytest.raises(NotImplementedError):
        hvd.grouped_allreduce([x], op=hvd.Adasum)
    with pytest.raises(HorovodUsageError, match="Unknown reduction op 42"):
        hvd.allreduce(x, op=42)
    with pytest.raises(ValueError, match="pass op only"):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    with pytest.raises(HorovodUsageError, match="needs dynamic process sets"):
        hvd.add_process_set([0])
    with pytest.raises(HorovodUsageError, match="is not registered"):
        hvd.allreduce(x, process_set=hvd.ProcessSet([0, 1]))
    with pytest.raises(UnsupportedError, match="MPI"):
        hvd.init(comm=[0])
    with pytest.raises(HorovodUsageError, match="handle"):
        hvd.synchronize(x)
    hvd.shutdown()
    assert not hvd.is_initialized() and not dist.is_initialized()


def test_several_ranks_without_a_rendezvous_is_refused(clean_env: None) -> None:
    os.environ.update(RANK="1", WORLD_SIZE="2")
    os.environ.pop("MASTER_ADDR", None)
    with pytest.raises(HorovodUsageError, match="horovodrun -np N"):
        hvd.init()
    assert not hvd.is_initialized()
