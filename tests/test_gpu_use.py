"""Whether every GPU works (observe/gpu_use.py): the utilisation each rank samples, and
the visible GPUs no process computed on, named with what to do. The GPU readings are
faked here (NVML needs a GPU); benchmarks/gpu_check.py reads them on a real one."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from torch import nn

from dtrain.observe.events import End, Run
from dtrain.observe.gpu_use import GpuUse, Sampler, report

pytestmark = pytest.mark.quick


def _record(host: str, visible: list[str], used: list[int], busy: dict[int, float]) -> dict:
    return {"host": host, "visible": visible, "used": used, "busy": busy}


def test_the_sampler_averages_each_gpu_and_stops_at_a_failed_read() -> None:
    readings = itertools.cycle([40, 60])
    sampler = Sampler([0, 1], lambda index: next(readings) + index, period=0.001)
    while sampler.counts[1] < 4:
        time.sleep(0.001)
    means = sampler.stop()
    assert set(means) == {0, 1} and 40 <= means[0] <= 61 and 41 <= means[1] <= 62

    calls = itertools.count()

    def failing(index: int) -> int:
        if next(calls) >= 3:
            raise RuntimeError("NVML went away")
        return 50

    sampler = Sampler([0], failing, period=0.001)
    sampler._thread.join(timeout=30)  # it ends by itself at the failed read
    assert not sampler._thread.is_alive() and sampler.stop() == {0: 50.0}
    # A run shorter than one period still gets the reading taken as it stops.
    assert Sampler([3], lambda index: 70, period=60).stop() == {3: 70.0}


def test_idle_visible_gpus_are_named_with_the_flags_that_use_or_hide_them() -> None:
    lines, results = report(
        [
            _record("a", ["0", "1", "2", "3"], [0], {0: 97.0}),
            _record("a", ["0", "1", "2", "3"], [1], {1: 95.5}),
            _record("b", ["4", "5", "6"], [0], {}),
            _record("b", ["4", "5", "6"], [2], {}),
        ]
    )
    assert lines[0] == (
        "dtrain: GPU busy (share of the time a kernel ran, NVML, mean over the run): "
        "rank 0 97%, rank 1 96%."
    )
    assert "GPU(s) 2, 3 of a are visible but no process computed on them" in lines[1]
    assert "(--nproc 4)" in lines[1] and "--devices 0,1 shows the job" in lines[1]
    # Ids are CUDA_VISIBLE_DEVICES's where it is set: machine b sees GPUs 4, 5 and 6.
    assert "GPU(s) 5 of b" in lines[2] and "--devices 4,6 " in lines[2]
    assert results == {
        "gpu_busy_percent": [{"0": 97.0}, {"1": 95.5}, None, None],
        "idle_gpus": {"a": ["2", "3"], "b": ["5"]},
    }
    # GPUs named by UUID cannot be given to --devices (it takes indices).
    uuids = ["GPU-aa", "GPU-bb"]
    lines, _ = report([_record("c", uuids, [0], {}), _record("c", uuids, [0], {})])
    assert "GPU(s) GPU-bb of c" in lines[0] and "in CUDA_VISIBLE_DEVICES" in lines[0]
    assert "--devices" not in lines[0]


def test_a_job_that_uses_every_gpu_or_none_is_told_nothing() -> None:
    every = [_record("a", ["0", "1"], [0], {}), _record("a", ["0", "1"], [1], {})]
    on_cpu = [_record("a", ["0", "1"], [], {})]  # --cpu on a GPU machine: on purpose
    assert report(every) == ([], {}) and report(on_cpu) == ([], {})
    towers = [_record("a", ["3", "4", "5"], [0, 1], {0: 50.0, 1: 70.0})]
    lines, results = report(towers, "--towers")
    assert lines[0].endswith("rank 0 GPU 3 50%, GPU 4 70%.") and "(--towers 3)" in lines[1]
    assert results["gpu_busy_percent"] == [{"3": 50.0, "4": 70.0}]
    lines, _ = report([_record("a", ["0", "1"], [0], {})], "--strategy ddp --nproc")
    assert "(--strategy ddp --nproc 2)" in lines[0]  # one-process strategies take no --nproc


def test_the_observer_samples_from_setup_to_close_and_reports_on_the_main_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    watcher = GpuUse((torch.device("cuda", 0),), is_main=True, read=lambda i: 80, period=0.001)
    module = nn.Linear(2, 2)
    watcher.on_setup(Run(module, module, None, None, lockstep=False))
    assert watcher._sampler is not None
    while not watcher._sampler.counts[0]:
        time.sleep(0.001)
    end = End(together=True, steps=1, last_checkpoint=None)
    watcher.on_close(end)
    assert end.results["gpu_busy_percent"] == [{"0": 80.0}]
    assert "rank 0 80%." in capsys.readouterr().out
    # A CPU run samples nothing and says nothing (every rank still takes part in the
    # gather, so that ranks that see GPUs and ranks that do not never mismatch).
    cpu = GpuUse((torch.device("cpu"),), is_main=True)
    cpu.on_setup(Run(module, module, None, None, lockstep=False))
    end = End(together=True, steps=1, last_checkpoint=None)
    cpu.on_close(end)
    assert cpu._sampler is None and "gpu_busy_percent" not in end.results
