"""Horovod's negotiation on dtrain: operations matched by name in any order, mismatches
raised on every process, `join()` with uneven batches, process sets and `SyncBatchNorm`,
Horovod's timeline, on 3 gloo ranks and then 2 in one spawn; the negotiation table's
decisions in this process."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import free_port, run_ranks
from torch.testing import assert_close

import dtrain.horovod as hvd
from dtrain.horovod import channel
from dtrain.horovod.errors import HorovodInternalError, HorovodUsageError
from dtrain.horovod.negotiation import Negotiation
from dtrain.horovod.requests import ALLREDUCE, BROADCAST, JOIN, Request
from dtrain.horovod.table import Table


def _check_any_order(r: int, n: int) -> None:
    """Each rank issues four asynchronous operations in its own order and waits for them
    in yet another; every result is as if all ranks had issued them alike."""
    x = torch.full((3,), float(r + 1))
    rows = torch.full((r + 1, 2), float(r))
    issue = {
        "sum": lambda: hvd.allreduce_async(x, name="sum", op=hvd.Sum),
        "gather": lambda: hvd.allgather_async(rows, name="gather"),
        "bcast": lambda: hvd.broadcast_async(x, root_rank=n - 1, name="bcast"),
        "a2a": lambda: hvd.alltoall_async(
            torch.arange(n, dtype=torch.float32) + 10 * r, name="a2a"
        ),
    }
    order = list(issue)[r:] + list(issue)[:r]
    handles = {key: issue[key]() for key in order}
    results = {key: hvd.synchronize(handles[key]) for key in reversed(order)}
    assert_close(results["sum"], torch.full((3,), n * (n + 1) / 2))
    assert_close(results["gather"], torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)]))
    assert_close(results["bcast"], torch.full((3,), float(n)))
    output, _ = results["a2a"]
    assert_close(output, torch.tensor([10.0 * k + r for k in range(n)]))


def _check_mismatches(r: int, n: int) -> None:
    """A difference in shape, dtype, op or root is an error on every rank, naming the
    operation and each rank's value."""
    with pytest.raises(
        HorovodUsageError, match=r"allreduce.bad_shape.*shapes.*rank 1: torch.float32 \(3,\)"
    ):
        hvd.allreduce(torch.ones(2 + r), name="bad_shape")
    dtype = torch.float32 if r == 0 else torch.int64
    with pytest.raises(
        HorovodUsageError, match=r"allreduce.bad_dtype.*dtypes.*rank 0: torch.float32"
    ):
        hvd.allreduce(torch.ones(2, dtype=dtype), name="bad_dtype")
    with pytest.raises(
        HorovodInternalError, match=r"bad_op.*reduction ops.*rank 0: hvd.Sum; rank 1: hvd.Max"
    ):
        hvd.allreduce(torch.ones(2), name="bad_op", op=hvd.Sum if r == 0 else hvd.Max)
    with pytest.raises(HorovodUsageError, match=r"broadcast.bad_root.*root ranks"):
        hvd.broadcast(torch.ones(2), root_rank=r, name="bad_root")
    if r == 1:
        handle = hvd.allreduce_async(torch.ones(1), name="twice")
        with pytest.raises(HorovodUsageError, match="already in flight"):
            hvd.allreduce_async(torch.ones(1), name="twice")
        dist.barrier()  # rank 0 issues "twice" only now, so rank 1's could not have started
    else:
        dist.barrier()
        handle = hvd.allreduce_async(torch.ones(1), name="twice")
    hvd.synchronize(handle)  # the first goes on
    assert_close(hvd.allreduce(torch.ones(2), name="after"), torch.ones(2))  # still in step
    # A round too large for the first all-gather's buffer takes a second one.
    many = hvd.grouped_allreduce([torch.full((1,), float(r))] * 300, name="many")
    assert_close(torch.cat(many), torch.full((300,), 0.5))


def _check_process_sets(r: int, n: int, even: hvd.ProcessSet) -> None:
    assert hvd.global_process_set.ranks == [0, 1, 2]
    assert even.process_set_id == 1 and even.size() == 2
    assert even.rank() == {0: 0, 1: -1, 2: 1}[r] and even.included() == (r != 1)
    odd = hvd.add_process_set([1])
    pair = hvd.add_process_set(hvd.ProcessSet([0, 1]))
    assert (odd.process_set_id, pair.process_set_id) == (2, 3)
    with pytest.raises(HorovodUsageError, match="duplicate process set"):
        hvd.add_process_set([1, 0])
    x = torch.full((2,), float(r))
    # One name on two sets at once: each set reduces its own.
    if even.included():
        assert_close(
            hvd.allreduce(x, name="g", process_set=even, op=hvd.Sum), torch.full((2,), 2.0)
        )
        assert_close(hvd.allreduce(x, name="g", process_set=even), torch.full((2,), 1.0))
        gathered = hvd.allgather(torch.full((r + 1,), float(r)), process_set=even)
        assert_close(gathered, torch.tensor([0.0, 2.0, 2.0, 2.0]))
        assert_close(hvd.broadcast(x, root_rank=2, process_set=even), torch.full((2,), 2.0))
        sliced = hvd.reducescatter(torch.arange(4.0) * (r + 1), op=hvd.Sum, process_set=even)
        assert_close(sliced, (torch.arange(4.0) * 4)[2 * even.rank() : 2 * even.rank() + 2])
        assert hvd.allgather_object(r, process_set=even) == [0, 2]
        with pytest.raises(HorovodUsageError, match="root_rank 1 is not a rank of the process set"):
            hvd.broadcast(x, root_rank=1, process_set=even)
    else:
        assert_close(hvd.allreduce(x, name="g", process_set=odd, op=hvd.Sum), x)
        with pytest.raises(HorovodUsageError, match="not a member"):
            hvd.allreduce(x, process_set=even)
    if pair.included():
        hvd.barrier(process_set=pair)
        assert_close(hvd.allreduce(x, process_set=pair), torch.full((2,), 0.5))
    # The global set still works with every rank, whatever the subsets did.
    assert_close(hvd.allreduce(x, op=hvd.Sum), torch.full((2,), 3.0))
    assert hvd.remove_process_set(pair) and not hvd.remove_process_set(hvd.global_process_set)
    assert pair.process_set_id is None
    with pytest.raises(HorovodUsageError, match="not registered"):
        hvd.allreduce(x, process_set=pair)


def _check_join(r: int, n: int) -> None:
    """Rank 0 has 3 batches, rank 1 has 5: once rank 0 joined, rank 1's all-reduces go on
    with zeros from rank 0 and Average still divides by 2; join returns 1, the last."""
    batches = 3 if r == 0 else 5
    seen = [hvd.allreduce(torch.tensor([10.0 * r + step]), name="grad") for step in range(batches)]
    if r == 1:
        # Steps 3 and 4 ran, so rank 0 has joined: a broadcast cannot run now.
        with pytest.raises(
            HorovodUsageError, match=r"cannot run while rank\(s\) \[0\] have called hvd.join"
        ):
            hvd.broadcast(torch.ones(1), root_rank=1, name="during_join")
    assert hvd.join() == 1
    expected = [(0.0 + step + 10.0 + step) / 2 for step in range(3)] + [
        (10.0 + s) / 2 for s in (3, 4)
    ]
    assert_close(torch.cat(seen), torch.tensor(expected[:batches]))
    assert_close(hvd.allreduce(torch.ones(1)), torch.ones(1))  # a new epoch runs as usual
    if r == 0:
        time.sleep(0.5)
    assert hvd.join() == 0


def _check_join_training(r: int, n: int) -> None:
    """DistributedOptimizer with uneven data: rank 0 trains 3 steps, rank 1 trains 5 and
    its last 2 average its gradients with rank 0's zeros (divided by 2)."""
    model = torch.nn.Linear(2, 1)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )

    def batch(rank: int, step: int) -> torch.Tensor:
        return torch.tensor([[rank + 1.0, step + 1.0]])

    for step in range(3 if r == 0 else 5):
        optimizer.zero_grad()
        model(batch(r, step)).sum().backward()  # the gradient of the weight is the batch
        optimizer.step()
    assert hvd.join() == 1
    steps = [(batch(0, s) + batch(1, s)) / 2 for s in range(3)]
    steps += [batch(1, s) / 2 for s in (3, 4)] if r == 1 else []
    assert_close(model.weight, -0.1 * torch.cat(steps).sum(0, keepdim=True))
    assert_close(model.bias, torch.tensor([-0.1 * (3 + (1.0 if r == 1 else 0.0))]))


def _check_optimizer_branches(r: int, n: int) -> None:
    """A parameter without a gradient on rank 0 (a branch it skipped) is reduced with zeros,
    and rank 1's gradients arrive in whatever order backward gives them."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    named = [
        *(("a." + k, p) for k, p in a.named_parameters()),
        *(("b." + k, p) for k, p in b.named_parameters()),
    ]
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD([p for _, p in named], lr=0.0), named_parameters=named
    )
    x = torch.ones(1, 2)
    loss = a(x).sum() if r == 0 else (b(x) * 3).sum() + a(x).sum()
    loss.backward()
    optimizer.step()
    assert_close(a.weight.grad, torch.ones(1, 2))
    assert_close(b.weight.grad, torch.full((1, 2), 1.5))


def _check_sync_batch_norm(r: int, n: int) -> None:
    """hvd.SyncBatchNorm on uneven shares (2 and 4 samples) equals a BatchNorm2d on the
    whole batch of 6: outputs, input and parameter gradients, running statistics."""
    generator = torch.Generator().manual_seed(3)
    data = torch.randn(6, 3, 2, 2, generator=generator) * 2 + 1
    weights = torch.randn(6, 3, 2, 2, generator=generator)
    share = slice(0, 2) if r == 0 else slice(2, 6)
    reference, synced = torch.nn.BatchNorm2d(3, momentum=0.3), hvd.SyncBatchNorm(3, momentum=0.3)
    with torch.no_grad():
        for bn in (reference, synced):
            bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
            bn.bias.copy_(torch.tensor([0.0, -1.0, 1.0]))
    x_ref, x = data.clone().requires_grad_(), data[share].clone().requires_grad_()
    out_ref, out = reference(x_ref), synced(x)
    assert_close(out, out_ref[share])
    (out_ref * weights).sum().backward()
    (out * weights[share]).sum().backward()
    assert_close(x.grad, x_ref.grad[share])
    assert_close(hvd.allreduce(synced.weight.grad, op=hvd.Sum), reference.weight.grad)
    assert_close(hvd.allreduce(synced.bias.grad, op=hvd.Sum), reference.bias.grad)
    assert_close(synced.running_mean, reference.running_mean)
    assert_close(synced.running_var, reference.running_var)
    synced.eval()
    reference.eval()
    assert_close(synced(data[share]), reference(data)[share])


def _check_stall_timeout(r: int, n: int) -> None:
    """An operation only rank 0 issues fails there after the timeout, naming rank 1."""
    if r == 0:
        with pytest.raises(
            HorovodInternalError, match=r"'allreduce.lonely' has waited .* rank\(s\) \[1\]"
        ):
            hvd.allreduce(torch.ones(1), name="lonely")
    else:
        time.sleep(2.0)  # reach the barrier about when rank 0 fails: neither waits 2 s there
    hvd.barrier()


def _timeline(path: Path, ranks: int) -> dict[str, list[dict]]:
    """The spans of the timeline in `path` by name; checks every rank has its process."""
    events = json.loads(path.read_text())["traceEvents"]
    named = {e["pid"] for e in events if e["name"] == "process_name"}
    assert named == set(range(ranks))
    spans: dict[str, list[dict]] = {}
    for e in events:
        if e["ph"] in ("X", "i"):
            spans.setdefault(e["name"], []).append(e)
    return spans


def _check_timelines(r: int, from_env: Path, started: Path) -> None:
    """HOROVOD_TIMELINE's file (written at shutdown) holds every rank's negotiation and
    run of each operation on that operation's row; hvd.start_timeline's marks cycles."""
    if r != 0:
        return
    spans = _timeline(from_env, 3)
    rows = {e["tid"] for e in spans["NEGOTIATE_ALLREDUCE"] if e["pid"] == 0}
    assert {e["pid"] for e in spans["ALLREDUCE"]} == {0, 1, 2}
    assert {e["pid"] for e in spans["NEGOTIATE_ALLGATHER"]} == {0, 1, 2}
    for done in spans["ALLREDUCE"]:
        negotiated = [e for e in spans["NEGOTIATE_ALLREDUCE"] if e["pid"] == done["pid"]]
        assert done["dur"] >= 0 and any(e["tid"] == done["tid"] for e in negotiated)
        assert done["tid"] in rows
    spans = _timeline(started, 2)
    assert "CYCLE_START" in spans and {e["pid"] for e in spans["JOIN"]} == {0, 1}


def _three_then_two(port_for_two: int, traces: Path) -> list[int]:
    torch.set_num_threads(1)
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    os.environ["HOROVOD_TIMELINE"] = str(traces / "env.json")
    even = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[even])
    del os.environ["HOROVOD_TIMELINE"]
    r, n = hvd.rank(), hvd.size()
    _check_any_order(r, n)
    _check_process_sets(r, n, even)
    hvd.shutdown()
    sizes = [n]
    if r < 2:
        os.environ.update(
            WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(port_for_two),
            HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="2",
        )  # fmt: skip
        channel.STORE_GATHER_MAX = 1  # this job of 2 negotiates over gloo instead
        hvd.init()
        _check_mismatches(r, 2)
        hvd.start_timeline(str(traces / "started.json"), mark_cycles=True)
        _check_join(r, 2)
        hvd.stop_timeline()
        _check_timelines(r, traces / "env.json", traces / "started.json")
        _check_optimizer_branches(r, 2)
        _check_join_training(r, 2)
        _check_sync_batch_norm(r, 2)
        _check_stall_timeout(r, 2)
        sizes.append(hvd.size())
        hvd.shutdown()
    return sizes


@pytest.mark.timeout(180)
def test_negotiation_join_process_sets_sync_batch_norm_and_timeline(tmp_path: Path) -> None:
    sizes = run_ranks(_three_then_two, 3, free_port(), tmp_path, timeout=150)
    assert sizes == [[3, 2], [3, 2], [3]]


def _request(name: str, kind: str = ALLREDUCE, shape: tuple = (2,), **fields) -> Request:
    return Request(name, kind, (0, 1, 2), ("torch.float32",), (shape,), **fields)


def test_table_orders_ready_operations_and_stands_in_for_joined_ranks() -> None:
    table = Table(3)
    assert table.process([[_request("a"), _request("b")], [_request("b")], []]) == []
    ready = table.process([[], [_request("a")], [_request("b"), _request("a")]])
    assert [r.name for r in ready] == ["b", "a"]  # in the order they became ready
    assert table.waiting_for(((0, 1, 2), "c")) == ([], [0, 1, 2])
    table.process([[_request("c")], [], []])
    assert table.waiting_for(((0, 1, 2), "c")) == ([0], [1, 2])
    # Ranks 1 and 2 join: "c" runs with their zeros; a broadcast cannot.
    join = Request(JOIN, JOIN, (0, 1, 2))
    ready = table.process([[_request("d", BROADCAST, root=0)], [join], [join]])
    assert [(r.name, r.joined, r.error) for r in ready][0] == ("c", (1, 2), None)
    assert "cannot run while rank(s) [1, 2] have called hvd.join()" in ready[1].error
    ready = table.process([[join], [], []])
    assert (ready[-1].kind, ready[-1].last_joined) == (JOIN, 0)
    assert table.joined == {}


def test_with_a_rank_joined_other_operations_are_refused_whatever_their_names() -> None:
    # Rank 0 joined early; ranks 1 and 2 name their gathers differently (automatic names
    # drift once one process's operations were refused): each is refused at once.
    table = Table(3)
    join = Request(JOIN, JOIN, (0, 1, 2))
    assert table.process([[join], [], []]) == []
    ready = table.process([[], [_request("g.1", "allgather")], [_request("g.2", "allgather")]])
    assert [(r.name, sorted(r.requests), r.joined) for r in ready] == [
        ("g.1", [1], (0,)),
        ("g.2", [2], (0,)),
    ]
    assert all("cannot run while rank(s) [0] have called hvd.join()" in r.error for r in ready)


def test_table_reports_each_rank_on_a_mismatch() -> None:
    table = Table(3)
    (response,) = table.process([[_request("x")], [_request("x", shape=(3,))], [_request("x")]])
    assert response.error is not None
    assert "'x': the processes passed different shapes" in response.error
    assert "rank 1: torch.float32 (3,)" in response.error
    table = Table(3)
    gathers = [[_request("g", "allgather", shape=(k + 1, 4))] for k in range(3)]
    (response,) = table.process(gathers)
    assert response.error is None  # first dimensions may differ


class _SilentChannel:
    """A control channel whose exchange never completes (a peer stopped negotiating)."""

    def ring(self, round_: int) -> None:
        pass

    def wait(self, round_: int) -> None:
        pass

    def gather(self, round_: int, payload: bytes) -> list[bytes]:
        threading.Event().wait()  # the peer never sends its part
        raise AssertionError("unreachable")

    def forget(self, round_: int) -> None:
        pass


def test_an_exchange_that_never_completes_is_named_as_such() -> None:
    """When even this process's announcement has not gone through (a peer stopped taking
    part in the exchange), the stall error says so instead of listing every rank."""
    engine = Negotiation(0, 2, _SilentChannel(), lambda ready: None, lambda r: [r], 0.5, None)
    operation = engine.submit(Request("allreduce.x", ALLREDUCE, (0, 1)))
    with pytest.raises(HorovodInternalError, match="the exchange has not completed"):
        operation.wait()
