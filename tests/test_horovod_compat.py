"""What Horovod's own PyTorch tests expect of `horovod.torch` beyond the documented calls
(test_horovod_ops.py covers those): init and shutdown again and again in one process,
int16 tensors in every collective, gradients through reduce-scatter and grouped
all-gather, the zero gradients `broadcast_optimizer_state` leaves on a fresh
optimizer's parameters, and the optimizer's surface Horovod's tests read (a process set
the process is not in, `_parameter_names`, the warning text, object gathers named after
the type). Two gloo ranks, in one spawn: the operations, then the init-shutdown cycles."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch.testing import assert_close

import dtrain.horovod as hvd
from dtrain.horovod import basics
from dtrain.horovod.errors import HorovodUsageError

CYCLES = 4


def _one_cycle(cycle: int, solo: hvd.ProcessSet, previous: hvd.ProcessSet | None) -> hvd.ProcessSet:
    """init, a few operations, shutdown; returns the set added after init."""
    r = int(os.environ["RANK"])
    hvd.init(process_sets=[solo])
    assert (hvd.rank(), hvd.size()) == (r, 2)
    # The static set is registered afresh, with the first id, every time.
    assert solo.process_set_id == 1 and solo.size() == 1
    # Unnamed operations are numbered from the start again: every cycle's first all-reduce
    # is allreduce.noname.1.
    assert basics.context("test").counters == {}
    summed = hvd.allreduce(torch.tensor([float(r + cycle)]), op=hvd.Sum)
    assert summed.item() == 1 + 2 * cycle
    assert basics.context("test").counters == {("allreduce", (0, 1)): 1}
    if r == 1:
        assert hvd.allreduce(torch.tensor([5.0]), process_set=solo).item() == 5.0
    # A set added in the last cycle is gone with it: it is refused by name.
    if previous is not None:
        assert previous.process_set_id is None
        with pytest.raises(HorovodUsageError, match="is not registered"):
            hvd.allreduce(torch.ones(1), process_set=previous)
    added = hvd.add_process_set([0])
    assert added.process_set_id == 2
    if r == 0:
        assert hvd.allreduce(torch.tensor([3.0]), process_set=added).item() == 3.0
    # As Horovod's own tests end each test: every process done before any shuts down (a
    # shutdown while another process's operation runs refuses that operation).
    hvd.barrier()
    if r == cycle % 2:
        # The other rank shuts down and forms the next group first: rank 1 then meets
        # rank 0's store while rank 0 still holds the last group's.
        time.sleep(0.5)
    hvd.shutdown()
    assert not hvd.is_initialized() and not dist.is_initialized()
    assert solo.process_set_id is None and added.process_set_id is None
    return added


def _init_shutdown_cycles() -> int:
    torch.set_num_threads(1)
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    solo = hvd.ProcessSet([1])
    previous = None
    for cycle in range(CYCLES):
        previous = _one_cycle(cycle, solo, previous)
    return CYCLES


@pytest.mark.timeout(120)
def test_init_and_shutdown_many_times_in_one_process(two_ranks: list[tuple[bool, int]]) -> None:
    assert [cycles for _, cycles in two_ranks] == [CYCLES, CYCLES]


def _check_int16(r: int) -> None:
    short = torch.int16
    values = [[[1, -2], [30000, 7]], [[2, -1], [30000, 7]]]
    mine = torch.tensor(values[r], dtype=short)
    stacked = torch.tensor(values, dtype=short)
    summed = hvd.allreduce(mine, op=hvd.Sum)
    assert summed.dtype == short
    # 30000 + 30000 wraps around as an int16 sum does.
    assert_close(summed, stacked[0] + stacked[1])
    assert summed[1, 0].item() == -5536
    assert_close(hvd.allreduce(mine, op=hvd.Max), stacked.max(0).values)
    assert_close(hvd.allreduce(mine, op=hvd.Min), stacked.min(0).values)
    in_place = mine.clone()
    assert hvd.allreduce_(in_place, op=hvd.Sum) is in_place
    assert_close(in_place, summed)
    # Fused with a float tensor in one grouped all-reduce.
    grouped = hvd.grouped_allreduce([mine, torch.ones(2)], op=hvd.Sum)
    assert grouped[0].dtype == short and grouped[1].dtype == torch.float32
    assert_close(grouped[0], summed)
    # Every process's rows, whose number differs per rank.
    rows = torch.arange(r + 1, dtype=short) + 10 * r
    gathered = hvd.allgather(rows)
    assert gathered.dtype == short and gathered.tolist() == [0, 10, 11]
    pair = hvd.grouped_allgather([rows, rows * 2])
    assert pair[1].dtype == short and pair[1].tolist() == [0, 20, 22]
    out = hvd.broadcast(mine, root_rank=1)
    assert out.dtype == short and out.tolist() == [[2, -1], [30000, 7]]
    copy = mine.clone()
    hvd.broadcast_(copy, root_rank=0)
    assert copy.tolist() == [[1, -2], [30000, 7]]
    # Rank r sends r + j + 1 rows of value 100 r + j to rank j.
    splits = [r + 1, r + 2]
    sent = torch.cat([torch.full((s,), 100 * r + j, dtype=short) for j, s in enumerate(splits)])
    received, counts = hvd.alltoall(sent, splits=splits)
    assert received.dtype == short and counts.tolist() == [1 + r, 2 + r]
    assert received.tolist() == [r] * (1 + r) + [100 + r] * (2 + r)
    scattered = hvd.reducescatter(mine, op=hvd.Sum)
    assert scattered.dtype == short and scattered.tolist() == [summed[r].tolist()]
    grouped = hvd.grouped_reducescatter([mine, mine], op=hvd.Sum)
    assert all(g.dtype == short and g.tolist() == [summed[r].tolist()] for g in grouped)


def _check_gradients(r: int) -> None:
    # Reduce-scatter over 5 rows: rank 0 keeps 3, rank 1 keeps 2. The gradient is the
    # all-gather of the incoming ones, scaled as the forward was (times 2 ranks for Sum).
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    out = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=3.0)
    assert out.shape == (3 - r, 3)
    out.backward(torch.full_like(out, r + 1.0))
    incoming = torch.cat([torch.full((3, 3), 1.0), torch.full((2, 3), 2.0)]).double()
    assert_close(x.grad, incoming * 3.0 * 2)
    x.grad = None
    hvd.reducescatter(x).backward(torch.full((3 - r, 3), r + 1.0, dtype=torch.float64))
    assert_close(x.grad, incoming)
    # Grouped: one operation forward and one backward, a gradient for each tensor.
    ys = [torch.randn(4, 2, requires_grad=True), torch.randn(4, requires_grad=True)]
    outs = hvd.grouped_reducescatter(ys, op=hvd.Sum)
    (outs[0].sum() + 2 * outs[1].sum()).backward()
    assert_close(ys[0].grad, torch.full((4, 2), 2.0))
    assert_close(ys[1].grad, torch.full((4,), 4.0))
    # Grouped all-gather: this rank's rows of the averaged incoming gradients.
    zs = [torch.ones(r + 1, 2, requires_grad=True), torch.ones(r + 1, requires_grad=True)]
    gathered = hvd.grouped_allgather(zs)
    weights = torch.arange(3.0) + 1  # rows 0 (rank 0) and 1, 2 (rank 1)
    (gathered[0] * weights[:, None] * (r + 1)).sum().backward(retain_graph=True)
    mean = weights * 1.5  # the ranks scale by 1 and by 2
    mine = mean[:1] if r == 0 else mean[1:]
    assert_close(zs[0].grad, mine[:, None].expand(r + 1, 2))
    assert zs[1].grad is not None and zs[1].grad.abs().sum() == 0
    (gathered[1] * weights).sum().backward()
    assert_close(zs[1].grad, weights[:1] if r == 0 else weights[1:])


class _Indexed(torch.nn.Module):
    """A parameter that takes no gradient (indices) beside one that does."""

    def __init__(self) -> None:
        super().__init__()
        self.index = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), False)
        self.weight = torch.nn.Parameter(torch.rand(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight[self.index.long()] * x


def _check_fresh_optimizer_state(r: int) -> None:
    torch.manual_seed(r)
    model = _Indexed()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.5)
    optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = model.weight.detach().clone()
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # A zero gradient where one is taken, none elsewhere, as Horovod leaves them; but no
    # step on it, which would have decayed the weight.
    assert model.index.grad is None
    assert_close(model.weight.grad, torch.zeros(4))
    assert_close(hvd.broadcast(model.weight.grad, root_rank=0), model.weight.grad)
    assert_close(model.weight.detach(), before)
    assert not optimizer.state
    # A gradient already there is left alone.
    model.weight.grad.fill_(r + 1.0)
    hvd.broadcast_optimizer_state(torch.optim.Adam(model.parameters()), root_rank=0)
    assert_close(model.weight.grad, torch.full((4,), r + 1.0))
    # A sparse embedding (named by `model`) gets a sparse zero gradient under SGD.
    table = torch.nn.Embedding(5, 2, sparse=True)
    hvd.broadcast_optimizer_state(torch.optim.SGD(table.parameters(), lr=0.1), 0, model=table)
    assert table.weight.grad.is_sparse and table.weight.grad.to_dense().abs().sum() == 0


def _check_optimizer_surface(r: int, even: hvd.ProcessSet) -> None:
    # Outside its process set (rank 1 here) the optimizer steps on local gradients.
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.constant_(model.weight, 1.0)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    optimizer = hvd.DistributedOptimizer(sgd, process_set=even)
    model(torch.full((1, 2), float(r + 1))).sum().backward()
    optimizer.step()
    assert_close(model.weight.detach(), torch.full((1, 2), -float(r)))
    # Horovod's attribute: each parameter's name, unique, the same on every process.
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    groups = [{"params": net[0].parameters()}, {"params": net[1].parameters()}]
    named = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    names = set(named._parameter_names.values())
    assert len(names) == 4
    assert hvd.allgather_object(names) == [names, names]
    # step() after synchronize() outside skip_synchronize() warns in Horovod's words.
    net(torch.ones(1, 3)).sum().backward()
    named.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        named.step()
    assert len(caught) == 1
    assert "optimizer.step() called without optimizer.skip_synchronize()" in str(caught[0].message)
    # An all-gather refused on one process only (the other has joined) does not shift
    # the name of the next unnamed object gather: it is named after the object's type.
    if r == 0:
        with pytest.raises(RuntimeError):
            hvd.allgather(torch.ones(2))
    hvd.join()
    assert hvd.allgather_object(r) == [0, 1]
    # A sparse all-reduce gathers indices and values; its sum (or average) is the dense one.
    dense = torch.zeros(5, 3)
    dense[r + 1] = float(r + 1)
    dense[4, r] = 2.0
    summed = hvd.sparse_allreduce_async(dense.to_sparse(), name="sp", op=hvd.Sum)()
    assert summed.is_sparse
    assert_close(summed.to_dense(), hvd.allreduce(dense, op=hvd.Sum))
    averaged = hvd.sparse_allreduce_async(dense.to_sparse(), name="sp.avg")()
    assert_close(averaged.to_dense(), hvd.allreduce(dense))
    with pytest.raises(HorovodUsageError, match="takes a sparse tensor"):
        hvd.sparse_allreduce_async(dense, name="dense")


def _ops_and_gradients() -> bool:
    torch.set_num_threads(1)
    even = hvd.ProcessSet([0])
    hvd.init(process_sets=[even])
    r = hvd.rank()
    _check_int16(r)
    _check_gradients(r)
    _check_fresh_optimizer_state(r)
    _check_optimizer_surface(r, even)
    hvd.shutdown()
    return True


def _both() -> tuple[bool, int]:
    """`_ops_and_gradients`, then `_init_shutdown_cycles` (each cycle starts afresh after
    a shutdown, the first after the operations' own)."""
    return _ops_and_gradients(), _init_shutdown_cycles()


@pytest.fixture(scope="module")
def two_ranks() -> list[tuple[bool, int]]:
    """`_both()` by rank."""
    return run_ranks(_both, 2, timeout=100)


@pytest.mark.timeout(120)
def test_int16_gradients_and_fresh_optimizer_state(two_ranks: list[tuple[bool, int]]) -> None:
    assert [ops for ops, _ in two_ranks] == [True, True]
