"""`dtrain plan` and the diagnosis know gradient compression and local SGD: the candidates
run as their flags say, the estimates follow the formulas (16 bits: half the bytes; local
SGD: 1/H of a sync), each has its class of training (exact, rounded, approximate), the
pick is the fastest layout that keeps the training (exact or rounded) with the
approximate ones after it however fast, and the diagnosis across machines names the
remedies that apply to the running strategy.

The links between machines are given (`--inter-node-gbps`), never measured, so the
ranking's change with a slower link is checked with given links rather than a shaped one.
"""

from __future__ import annotations

import copy
import json
import math
import shlex

import pytest
import torch
from torch import nn

from dtrain.cli import build_parser, main
from dtrain.launcher.topology_flags import config_from
from dtrain.observe.diagnosis import Job, diagnose
from dtrain.plan import command, costs, report
from dtrain.plan.calibrate import Calibration, StepTime
from dtrain.plan.estimate import ROUNDED_PREFERENCE, Inputs, estimate, rank
from dtrain.plan.layouts import Layout, check, enumerate_layouts, inexact_layouts
from dtrain.plan.links import given
from dtrain.plan.machine import Machine
from dtrain.plan.source import Workload
from dtrain.plan.weigh import ModelFigures, weigh

PARAMS = 1_000_000
"""One 1000 x 1000 matrix and nothing else: PowerSGD compresses all of it."""


def _inputs(nproc: int, inter_node_bytes_per_second: float, per_32: float = 0.03) -> Inputs:
    """A hand-made calibration: forward and backward `per_32` seconds per 32 samples (30
    ms), no latency anywhere, a core per process (so none is crowded, and no communication
    hides behind compute)."""
    figures = ModelFigures(
        params=PARAMS, param_tensors=1, param_bytes=4 * PARAMS, grad_bytes=4 * PARAMS,
        optimizer_bytes=8 * PARAMS, activation_bytes_per_sample=1e3,
        flops_per_sample=6.0 * PARAMS, tensor_bytes=[4 * PARAMS], unit_bytes=[4 * PARAMS],
        tensor_shapes=[(1000, 1000)],
    )  # fmt: skip
    calibration = Calibration("cpu", figures)
    calibration.steps = {
        (b, 1, shared): StepTime(per_32 / 3 * b / 32, per_32 * 2 / 3 * b / 32, 0.001)
        for b in (16, 32, 64)
        for shared in (True, False)
    }
    machine = Machine(nproc, 0, 1, 2**40, (inter_node_bytes_per_second, 0.0), threads_per_process=1)
    return Inputs(calibration, given(nproc, 10.0, 0.0), machine, 64, None)


def _parse(flags: str) -> object:
    return config_from(build_parser().parse_args(["demo", *shlex.split(flags)]))


def test_every_inexact_layout_runs_as_its_flags_say() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    layouts = [
        *inexact_layouts(2, 1, "bf16"), *inexact_layouts(2, 2, "bf16"),
        *inexact_layouts(1, 2, "fp16"),
    ]  # fmt: skip
    assert inexact_layouts(1, 1, "bf16") == []
    flags = " ".join(layout.flags() for layout in layouts)
    for part in ("bf16", "fp16", "powersgd:1", "powersgd:4", "--sync-every 8", "--sync-every 32"):
        assert part in flags
    assert "--outer-optimizer nesterov" in flags and "--hierarchical --grad-compression" in flags
    assert any(layout.strategy == "hsdp" for layout in layouts)
    for layout in layouts:
        assert _parse(layout.flags()) == layout.config(), layout.flags()
        assert check(layout, 64, model) is None, layout.flags()
        assert not layout.exact
        if layout.grad_compression in ("bf16", "fp16"):  # a cast rounds, nothing more
            assert layout.training == "rounded", layout.flags()
            assert layout.note.startswith(f"Rounds each gradient to {layout.grad_compression}")
        else:  # PowerSGD, local SGD, DiLoCo
            assert layout.training == "approximate", layout.flags()
            assert layout.note.startswith("Changes the training")
    assert {layout.training for layout in enumerate_layouts(2, 2, 0)} == {"exact"}
    assert Layout("ddp", nproc=2).exact and Layout("ddp", nproc=2).note == ""


def test_compression_and_local_sgd_follow_the_formulas() -> None:
    assert costs.cast_bytes_factor("bf16") == costs.cast_bytes_factor("fp16") == 0.5
    assert costs.cast_bytes_factor("powersgd:1") == costs.cast_bytes_factor("none") == 1.0
    # An 8 x 6 matrix at rank 1: (8 + 6) x 1 = 14 values, under half its 48: compressed;
    # at rank 4, 56 values are not: it goes whole, as does the bias.
    assert costs.powersgd_values([(8, 6), (8,)], 1) == 14 + 8
    assert costs.powersgd_values([(8, 6), (8,)], 4) == 48 + 8
    assert costs.powersgd_matrices([(8, 2, 3, 3)], 1) == [(8, 18, 1)]  # a conv, 8 x 18
    # 3 matmuls of 2 m n r, Gram-Schmidt 2 m r^2, error feedback 2 m n.
    assert costs.powersgd_flops([(8, 6)], 1) == 6 * 48 + 2 * 8 + 2 * 48
    assert costs.local_sgd_seconds(1.0, 32) == 1 / 32
    # --hierarchical casts only what crosses machines: 2 x 1/2 x (S/2) / B_out.
    intra, inter = (1e9, 0.0), (1e8, 0.0)
    assert math.isclose(
        costs.hierarchical_seconds(1e6, 2, 2, intra, inter, 0.5), 2 * 1e-3 + 0.5e6 / 1e8
    )

    def t2(inputs: Inputs, **layout: object) -> float:
        return estimate(inputs, Layout(**layout)).communication_seconds  # type: ignore[arg-type]

    flat = _inputs(1, 1e8)
    ddp = t2(flat, strategy="ddp", nproc=1, nnodes=2)
    assert ddp > 0
    bf16 = t2(flat, strategy="ddp", nproc=1, nnodes=2, grad_compression="bf16")
    assert math.isclose(bf16, ddp / 2)
    for h in (8, 32):  # a sync all-reduces the parameters (no buffers here) every H steps
        local = t2(flat, strategy="local-sgd", nproc=1, nnodes=2, sync_every=h)
        assert math.isclose(local, ddp / h)
    assert math.isclose(
        t2(flat, strategy="ddp", nproc=1, nnodes=2, grad_compression="powersgd:1"),
        ddp * 2000 / PARAMS,
    )
    powersgd = estimate(flat, Layout("ddp", nproc=1, nnodes=2, grad_compression="powersgd:1"))
    # 4 x (6 m n r + 2 m r^2 + 2 m n) FLOPs at the model's rate (6e6 x 32 per 30 ms).
    rate = 6.0 * PARAMS * 32 / 0.03
    assert math.isclose(powersgd.overhead_seconds, 4 * (8e6 + 2e3) / rate)
    two = _inputs(2, 1e8)
    hier = dict(strategy="ddp", nproc=2, nnodes=2, hierarchical=True)
    inside = 2 * 4e6 / 1e10
    assert math.isclose(t2(two, **hier), inside + 4e6 / 1e8)
    assert math.isclose(t2(two, **hier, grad_compression="bf16"), inside + 2e6 / 1e8)


def _keeps_the_training_first(ranked: list) -> None:
    """Every layout that keeps the training ranks above every approximate one."""
    classes = [e.layout.training == "approximate" for e in ranked]
    assert classes == sorted(classes)


def test_the_pick_keeps_the_training_and_approximate_layouts_come_after() -> None:
    exact = [
        Layout("single"), Layout("ddp", nproc=1, nnodes=2), Layout("zero1", nproc=1, nnodes=2),
        Layout("ddp", nproc=1, nnodes=2, hierarchical=True),
    ]  # fmt: skip
    layouts = exact + inexact_layouts(1, 2, "bf16")
    fast = rank([estimate(_inputs(1, 1e11), layout) for layout in layouts])
    assert fast[0].layout.exact
    _keeps_the_training_first(fast)
    # zero1 bf16 sends half zero1's all-reduce: predicted faster, but within the preference.
    half = next(e for e in fast if e.layout == Layout("zero1", 1, 2, grad_compression="bf16"))
    speed = fast[0].samples_per_second
    assert speed < half.samples_per_second < ROUNDED_PREFERENCE * speed
    tie = rank([half, fast[0]])
    assert tie[0] is fast[0] and "faster but rounds each gradient" in report.explain(tie, 2**40)
    # 8 Mbit/s, a ddp step's all-reduce 4 s: with 2.4 s of compute per replica, splitting
    # the batch beats `single` only if it sends less.
    slow = rank([estimate(_inputs(1, 1e6, per_32=2.4), layout) for layout in layouts])
    _keeps_the_training_first(slow)
    best = slow[0]
    assert best.layout.training == "rounded" and best.layout.grad_compression == "bf16"
    ddp = next(e for e in slow if e.layout == Layout("ddp", nproc=1, nnodes=2))
    assert best.samples_per_second > 1.3 * ddp.samples_per_second
    local = next(e for e in slow if e.layout.strategy == "local-sgd" and e.layout.sync_every == 32)
    assert local.samples_per_second > 1.5 * best.samples_per_second  # faster, yet after it
    row = report.candidate(best, None)
    assert (row["exact"], row["training"]) == (False, "rounded")
    assert row["note"].startswith("Rounds each gradient to bf16")
    row = report.candidate(local, None)
    assert row["training"] == "approximate" and "check the loss" in row["note"]
    row = report.candidate(fast[0], None)
    assert (row["exact"], row["training"]) == (True, "exact") and "note" not in row
    pays = str(report.where_approximate_pays(slow, "the 8 Mbit/s links between machines"))
    assert pays.startswith("Under --strategy ddp --nproc 1 --nnodes 2")
    assert "t1 = 2400.00 ms" in pays
    first = slow[len([e for e in slow if e.layout.training != "approximate"])]
    assert first.layout.flags() in pays and "as fast as the first pick" in pays
    assert "its loss must be checked" in pays
    printed = report.table(slow)
    assert "Approximate: these change the training" in printed and " ~\n" in printed
    pays = report.where_approximate_pays(fast, "the 800,000 Mbit/s links between machines")
    assert "It does not pay here" in str(pays)  # local SGD saves nothing on fast links


def test_at_the_benchmarks_slow_link_the_pick_is_faster_than_ddp_at_the_same_loss() -> None:
    """docs/benchmarks.md, "Slow links": 2 machines of 2 processes at 100 Mbit/s, where
    hierarchical bf16 ran 2.13x flat ddp at ddp's loss and local SGD faster at a worse
    loss. With compute that makes distributing pay (1 s per 32 samples), the pick rounds
    the gradients to bf16, is predicted faster than flat ddp, and local SGD, predicted
    faster still, ranks after every layout that keeps the training."""
    layouts = [
        layout
        for layout in enumerate_layouts(2, 2, 0) + inexact_layouts(2, 2, "bf16")
        if layout.strategy not in ("pipeline", "tensor", "hybrid")  # no tensor figures here
    ]
    inputs = _inputs(2, 12.5e6, per_32=1.0)
    ranked = rank([estimate(inputs, layout) for layout in layouts])
    _keeps_the_training_first(ranked)
    pick = ranked[0]
    assert pick.layout.training == "rounded" and pick.layout.grad_compression == "bf16"
    ddp = next(e for e in ranked if e.layout == Layout("ddp", nproc=2, nnodes=2))
    single = next(e for e in ranked if e.layout.strategy == "single")
    assert pick.samples_per_second > 1.3 * max(ddp.samples_per_second, single.samples_per_second)
    local = next(e for e in ranked if e.layout.strategy == "local-sgd")
    assert local.samples_per_second > pick.samples_per_second
    # hsdp's replica groups, one per shard, share each machine's link: its bf16 all-reduces
    # cross the same bytes as hierarchical bf16's (S/2 per machine), not half of them.
    hier = estimate(inputs, Layout("ddp", 2, 2, hierarchical=True, grad_compression="bf16"))
    hsdp = estimate(inputs, Layout("hsdp", 2, 2, shard_size=2, grad_compression="bf16"))
    assert hsdp.communication_seconds > 0.9 * hier.communication_seconds


def _measure(
    work: Workload, points: set[tuple[int, int, bool]], device: torch.device, *_: object
) -> Calibration:
    """The calibration without its timing: the model weighed, 3 ms a sample, copies at
    1 GB/s."""
    figures = weigh(work, copy.deepcopy(work.model), device, max(p[0] for p in points))
    calibration = Calibration("cpu", figures, copy_bandwidth=1e9)
    for batch, threads, shared in points:
        calibration.steps[(batch, threads, shared)] = StepTime(1e-3 * batch, 2e-3 * batch, 1e-4)
    return calibration


def test_plan_offers_inexact_layouts_where_the_links_are_slow(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command.calibrate, "measure", _measure)

    def plan(*argv: str) -> dict:
        assert main(["plan", "--model", "mlp", *argv, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    across = plan(
        "--nnodes", "2", "--link-gbps", "10", "--link-latency-us", "10",
        "--inter-node-gbps", "0.001",
    )  # fmt: skip
    candidates = across["candidates"]
    first = candidates[0]
    assert first["training"] != "approximate"
    faster = [c for c in candidates if c["samples_per_second"] > first["samples_per_second"]]
    assert faster and all(c["training"] == "approximate" for c in faster)
    assert "as fast as the first pick" in across["explanation"]
    assert "8 Mbit/s links between machines" in across["explanation"]
    classes = [c["training"] == "approximate" for c in candidates]
    assert classes == sorted(classes) and any(c["training"] == "rounded" for c in candidates)
    for c in candidates:
        assert _parse(c["flags"]).strategy == c["strategy"]
        assert c["exact"] == (c["training"] == "exact") == ("note" not in c)
    fast = ("--nproc", "2", "--link-gbps", "100", "--link-latency-us", "0")
    one = plan(*fast)
    assert all(c["exact"] for c in one["candidates"])
    assert any("change the training for little" in r["reason"] for r in one["left_out"])
    slow = plan("--nproc", "2", "--link-gbps", "0.0001", "--link-latency-us", "10")
    assert {c["training"] for c in slow["candidates"]} == {"exact", "rounded", "approximate"}
    assert slow["candidates"][0]["training"] != "approximate"


@pytest.mark.parametrize("device_has_bf16", [True, False])
def test_the_diagnosis_across_machines_names_the_remedies(device_has_bf16: bool) -> None:
    chatty = dict(data=0.001, forward=0.01, backward=0.02, communication=0.05, optimizer=0.001)
    chatty["other"] = 0.001
    chatty["step"] = sum(chatty.values())
    half = "bf16" if device_has_bf16 else "fp16"

    def advice(job: Job | None) -> str:
        [first, *_] = diagnose([chatty, chatty], job=job)
        assert first["cause"] == "communication"
        return first["message"]

    ddp = advice(Job("ddp", nnodes=2, half=half))
    for remedy in ("--hierarchical", f"--grad-compression {half}", "--strategy local-sgd"):
        assert remedy in ddp
    assert "between the 2 machines" in ddp and "check the loss" in ddp
    zero3 = advice(Job("zero3", nnodes=2, half=half))
    assert "--grad-compression" not in zero3 and "--hierarchical" not in zero3
    assert "--strategy hsdp" in zero3 and "--strategy local-sgd" in zero3
    hierarchical = advice(Job("ddp", nnodes=2, hierarchical=True, grad_compression=half))
    assert "--grad-compression" not in hierarchical  # cast already; PowerSGD refuses it
    assert "--hierarchical across machines" in advice(Job("ddp"))  # one machine: as before
    assert "--hierarchical across machines" in advice(None)
