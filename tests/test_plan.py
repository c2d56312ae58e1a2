"""`dtrain plan`: the cost model's formulas by hand, runnable flags for every candidate,
layouts that cannot fit left out, and clear errors for bad input."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain.cli import build_parser, main
from dtrain.launcher.topology_flags import config_from
from dtrain.plan import command, costs
from dtrain.plan.layouts import Layout, enumerate_layouts
from dtrain.plan.links import Links, given, monotone_fit

MIB = 2**20


def test_formulas_match_hand_computations() -> None:
    # Ring all-reduce: 2(n-1)/n x S bytes; 2 x 3/4 x 100 = 150.
    assert costs.ring_allreduce_bytes(100, 4) == 150
    assert costs.ring_allreduce_bytes(100, 1) == 0
    # 1 MB over 2 ranks at 1 GB/s bus bandwidth: 1 ms + 0.1 ms latency.
    assert math.isclose(costs.ring_allreduce_seconds(1e6, 2, 1e9, 1e-4), 1.1e-3)
    # DDP's buckets: the first MiB, then 25 MiB each.
    assert costs.ddp_buckets(30 * MIB) == [MIB, 25 * MIB, 4 * MIB]
    assert costs.ddp_buckets(0.5 * MIB) == [0.5 * MIB]
    # Two buckets of 1 s during a 4 s backward: ready at 2 s (done 3 s) and at 4 s (done
    # 5 s): 1 s shows. Buckets of 3 s: the second waits for the first (done 5 s), ends 8 s.
    assert costs.exposed_after_overlap([1.0, 1.0], 4.0) == 1.0
    assert costs.exposed_after_overlap([3.0, 3.0], 4.0) == 4.0
    assert costs.exposed_after_overlap([], 4.0) == 0.0
    # Bubble (p-1)/(m+p-1); interleaved (p-1)/(vm+p-1).
    assert costs.pipeline_bubble(2, 4) == 1 / 5
    assert costs.pipeline_bubble(4, 8, 2) == 3 / 19
    assert costs.pipeline_slots(4, 8, 2) == 9.5
    assert costs.micro_batches_held("gpipe", 4, 8, 0) == 8
    assert costs.micro_batches_held("1f1b", 4, 8, 1) == 3
    # ZeRO with P = 4, G = 4, O = 8 bytes over 4 ranks: ddp 16 + 4 of buckets, stage 1
    # 4 + 4 + 2 + 4, stage 2 4 + 12/4, stage 3 16/4.
    assert [costs.zero_model_states(4, 4, 8, 4, s) for s in range(4)] == [20, 14, 7, 4]
    # ZeroRedundancyOptimizer deals whole tensors, largest first: 6, 3, 2, 1 over 2 ranks
    # -> rank 0: 6, rank 1: 3 + 2 + 1 = 6; 8, 1, 1 -> 8 of 10.
    assert costs.greedy_partition_share([2, 6, 1, 3], 2) == 0.5
    assert costs.greedy_partition_share([1, 8, 1], 2) == 0.8
    # PS: max(M/B, nM/(kB)): 4 workers, 2 servers, 100 bytes at 10 B/s -> 20 s.
    assert costs.ps_step_seconds(100, 4, 2, 10) == 20
    assert costs.ps_step_seconds(100, 2, 4, 10) == 10
    assert costs.towers_replication_bytes(10, 4) == 80
    # Across 2 machines of 2: hierarchical = 2 (lat_in + S/B_in) + (S/B_out + 2 lat_out);
    # flat = 2(W-1)/W S / B_out + 2(W-1) lat_out.
    intra, inter = (1e9, 1e-5), (1e8, 1e-4)
    assert math.isclose(
        costs.hierarchical_seconds(1e6, 2, 2, intra, inter), 2 * (1e-5 + 1e-3) + 1e-2 + 2e-4
    )
    assert math.isclose(costs.flat_multinode_seconds(1e6, 2, 2, inter), 1.5e-2 + 6e-4)


def test_machine_terms_and_memory_parts() -> None:
    from dtrain.plan.inputs import Estimate, Inputs
    from dtrain.plan.machine import Machine

    # Isotonic fit of a noisy table: 8 KiB measured slower than 16 KiB -> both their mean.
    assert monotone_fit([(16, 2.0), (4, 1.0), (8, 4.0), (32, 5.0)]) == [
        (4, 1.0), (8, 3.0), (16, 3.0), (32, 5.0),
    ]  # fmt: skip
    # Processes x threads over cores: ps with 2 workers + 2 servers at 1 thread on 2 cores
    # runs each process at half speed; ddp on 2 cores does not crowd; GPUs never do.
    cpu = Machine(cores=2, gpus=0, single_threads=1, memory_per_device=1, threads_per_process=1)
    inputs = Inputs(None, None, cpu, 64, None)  # type: ignore[arg-type]
    assert inputs.crowd(Layout("ps", nproc=2, servers=2)) == 2.0
    assert inputs.crowd(Layout("ps", nproc=2, servers=1)) == 1.5
    assert inputs.crowd(Layout("ddp", nproc=2)) == 1.0
    assert inputs.crowd(Layout("towers", towers=2)) == 1.0
    gpu = Inputs(None, None, Machine(2, 1, 1, 1), 64, None)  # type: ignore[arg-type]
    assert gpu.crowd(Layout("ps", nproc=2, servers=2)) == 1.0
    # Jitter pooled over the points probed beside other ranks: 16 s measured over 4 x 1 s
    # + 4 x 2 s of lower-quartile steps is a third more; none probed alone: no jitter.
    from dtrain.plan.calibrate import Calibration, StepTime

    calibration = Calibration("cpu", None)  # type: ignore[arg-type]
    calibration.steps = {
        (8, 1, True): StepTime(0.5, 0.5, 0.0, totals=(1.0, 1.0, 1.0, 1.0)),
        (16, 1, True): StepTime(1.0, 1.0, 0.0, totals=(2.0, 2.0, 2.0, 6.0)),
    }
    assert math.isclose(calibration.jitter(True), 1 / 3) and calibration.jitter(False) == 0
    e = Estimate(Layout("ddp", nproc=2), 32, 1.0, 2.0, 3.0, 4.0, 0.0, 100, 10, wait_seconds=1.0)
    e.buffer_bytes, e.global_batch = 5, 64
    e.crowded(2.0)
    assert (e.step_seconds, e.crowd, e.memory_bytes_per_rank) == (22.0, 2.0, 115)


def test_groups_that_span_machines_run_at_the_links_between_them() -> None:
    """A collective whose group spans machines is a ring through the slow links; inside
    one machine it keeps the measured links, their latency raised to the cost of one
    synchronization in lockstep where the probe measured that higher; a pipeline whose
    stages span machines hands over through them."""
    from dtrain.plan.calibrate import Calibration, StepTime
    from dtrain.plan.inputs import Inputs
    from dtrain.plan.machine import Machine

    machine = Machine(2, 0, 1, 1, inter_node=(1e7, 1e-4))  # 10 MB/s, 0.1 ms between machines
    calibration = Calibration("cpu", None)  # type: ignore[arg-type]
    inputs = Inputs(calibration, given(2, 1.0, 10.0), machine, 64, None)  # type: ignore[arg-type]
    two_hosts = Layout("zero3", nproc=1, nnodes=2)
    # 1 MB all-gathered over 2 ranks on 2 machines: 0.1 ms + 1/2 x 1 MB / 10 MB/s = 50.1 ms.
    assert math.isclose(inputs.collective("all_gather", 1e6, 2, two_hosts), 0.0501)
    # gloo's reduce-scatter moves an all-reduce's bytes: 2 x 1/2 x 1 MB / 10 MB/s + 2 x 0.1 ms.
    assert math.isclose(inputs.collective("reduce_scatter", 1e6, 2, two_hosts), 0.1002)
    one_host = Layout("zero3", nproc=2)
    assert math.isclose(inputs.collective("all_gather", 1e6, 2, one_host), 1e-5 + 0.5e-3)
    # Ranks in lockstep took 0.2 ms (median of the shared points) to all-reduce one number:
    # the 10 us latency becomes 0.2 ms inside the machine; across machines, as given.
    calibration.steps = {
        (b, 1, True): StepTime(1e-3, 1e-3, 1e-4, sync=sync)
        for b, sync in ((8, 1e-4), (16, 2e-4), (32, 3e-4))
    }
    assert math.isclose(inputs.collective("all_gather", 1e6, 2, one_host), 2e-4 + 0.5e-3)
    assert math.isclose(inputs.collective("all_gather", 1e6, 2, two_hosts), 0.0501)
    assert inputs.local("all_reduce", 1e6, 1) == 0.0  # a group of one rank moves nothing
    stages = Layout("pipeline", nproc=1, nnodes=2, pp=2)
    assert math.isclose(inputs.stage_send(1e6, stages), 1e-4 + 0.1)
    # The mesh is pp x dp x tp, tp innermost; on 2 machines of 2: with pp 2 x dp 2 the
    # stages are machines apart and each dp pair shares one; with dp 2 x tp 2 the
    # replicas of a tp shard (ranks 0 and 2) are machines apart, and the two shards'
    # all-reduces (ranks 0-2 and 1-3) share each machine's link.
    piped = Layout("hybrid", nproc=2, nnodes=2, dp=2, pp=2)
    assert inputs.stage_send(1e6, piped) > 0.1
    assert inputs.allreduce(1e6, 2, piped, stride=1) < 0.01
    split = Layout("hybrid", nproc=2, nnodes=2, dp=2, tp=2)
    # 2 ranks, 10 MB/s: 2 shards x 2 x 1/2 x 1 MB / 10 MB/s + 2 latencies = 0.2002 s.
    assert math.isclose(inputs.allreduce(1e6, 2, split, stride=2), 0.2002)


def test_links_interpolate_the_measured_table() -> None:
    links = Links(2, {"all_reduce": [(1000, 1e-4), (100_000, 1e-2)]})
    assert links.seconds("all_reduce", 10) == 1e-4  # latency floor
    assert math.isclose(links.seconds("all_reduce", 10_000), 1e-3)  # log-linear midpoint
    assert math.isclose(links.seconds("all_reduce", 200_000), 2e-2)  # bandwidth bound
    assert links.seconds("all_reduce", 10_000, ranks=1) == 0.0
    fixed = given(4, 2.0, 10.0)
    assert math.isclose(fixed.seconds("all_reduce", 2e9), 1e-5 + 1.5)
    assert math.isclose(fixed.seconds("all_gather", 2e9), 1e-5 + 0.75)


def _parse(flags: str) -> object:
    args = build_parser().parse_args(["demo", *shlex.split(flags)])
    return config_from(args)


def test_every_layout_has_flags_the_demo_accepts() -> None:
    layouts = [
        *enumerate_layouts(2, 1, 0),
        *enumerate_layouts(4, 1, 0),
        *enumerate_layouts(2, 2, 0),
    ]
    names = {layout.strategy for layout in layouts}
    assert names >= {"single", "towers", "ddp", "zero1", "zero2", "zero3", "ps", "pipeline"}
    assert names >= {"tensor", "hybrid", "hsdp"}
    assert any(layout.hierarchical for layout in layouts)
    for layout in layouts:
        config = _parse(layout.flags())
        assert config == layout.config(), layout.flags()


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.timeout(300)  # starts processes: not in the quick loop
def test_plan_lists_runnable_candidates_that_fit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    limit = 300_000  # below ddp's and single's states (5 x 104 KB), above zero3's
    result = _plan_json(
        capsys, "--model", "mlp", "--nproc", "2", "--memory-per-device", str(limit),
        "--link-gbps", "1", "--link-latency-us", "300", "--probe-seconds", "0.05",
    )  # fmt: skip
    candidates = result["candidates"]
    assert candidates
    rates = [c["samples_per_second"] for c in candidates]
    assert rates == sorted(rates, reverse=True)
    for c in candidates:
        assert {"strategy", "flags", "samples_per_second", "step_seconds"} <= set(c)
        assert 0 < c["memory_bytes_per_rank"] <= limit
        assert math.isclose(c["samples_per_second"] * c["step_seconds"], 64)
        assert _parse(c["flags"]).strategy == c["strategy"]
    listed = {c["strategy"] for c in candidates}
    assert {"zero3", "pipeline"} <= listed and not listed & {"single", "ddp", "towers"}
    out_of_memory = [r["flags"] for r in result["left_out"] if "per rank" in r["reason"]]
    assert "--strategy ddp --nproc 2" in out_of_memory
    assert "First pick" in result["explanation"]
    assert result["calibration"]["engine_seconds"] >= 0
    # The shared points ran in lockstep with a helper rank: each step synchronized.
    shared = [s for s in result["calibration"]["steps"] if s["beside_other_ranks"]]
    assert shared and all(s["sync"] > 0 and s["data"] > 0 for s in shared)
    assert result["calibration"]["wrapper_overhead_seconds"]["pipeline"] >= 0
    for c in candidates:  # what --memory-report counts, the buffers, the activations
        parts = c["model_state_bytes"] + c["buffer_bytes"] + c["activation_bytes"]
        assert abs(c["memory_bytes_per_rank"] - parts) <= 2
    # One candidate really runs, with its own flags, a few steps.
    pick = next(c for c in candidates if c["strategy"] == "pipeline")
    metrics = tmp_path / "metrics.json"
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_CONFIG"}
    done = subprocess.run(
        [
            sys.executable, "-m", "dtrain.cli", "demo", "--model", "mlp", "--steps", "3",
            "--global-batch-size", "64", "--out", str(tmp_path / "run"),
            "--metrics-json", str(metrics), *shlex.split(pick["flags"]),
        ],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(metrics.read_text())["steps"] == 3


@pytest.mark.timeout(300)  # starts processes: not in the quick loop
def test_plan_cuts_the_sequence_when_the_batch_is_smaller_than_the_processes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert costs.context_kv_messages(170.0, 5) == [2.0] * 10  # 2/17 of it, per block and kind
    result = _plan_json(
        capsys, "--model", "gpt", "--global-batch-size", "1", "--nproc", "2",
        "--link-gbps", "1", "--link-latency-us", "300", "--probe-seconds", "0.05",
    )  # fmt: skip
    by_flags = {c["flags"]: c for c in result["candidates"]}
    single, cut = by_flags["--strategy single"], by_flags["--strategy zero3 --nproc 2 --cp 2"]
    assert "--strategy ddp --nproc 2 --cp 2" in by_flags
    assert cut["activation_bytes"] == pytest.approx(single["activation_bytes"] / 2)
    left = {r["flags"]: r["reason"] for r in result["left_out"]}
    assert "smaller than the 2 data-parallel workers" in left["--strategy ddp --nproc 2"]
    for c in result["candidates"]:
        assert _parse(c["flags"]).strategy == c["strategy"]


def test_every_layout_left_out_is_shown_with_its_whole_reason(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = (
        "needs 12,345.6 MiB per rank, more than the 8,192.0 MiB per device "
        "(--memory-per-device); lower --global-batch-size or shard the optimizer state "
        "with --strategy zero2-cpu-offload-everything."
    )
    rows = [{"flags": f"--strategy zero{i} --nproc 2", "reason": reason} for i in range(10)]
    answer = {
        "model": "mlp",
        "global_batch_size": 64,
        "calibration": {"device": "cpu", "parameters": 1, "probe_seconds": 0.1, "link": "-"},
        "explanation": "First pick: none.",
        "left_out": rows,
        "_estimates": [],
    }
    monkeypatch.setattr(command, "plan", lambda args: answer)
    monkeypatch.setenv("COLUMNS", "72")
    assert command.main(build_parser().parse_args(["plan", "--model", "mlp"])) == 0
    shown = capsys.readouterr().out.split("\nLeft out (10):\n")[1].splitlines()
    assert all(len(line) <= 72 for line in shown)
    starts = [i for i, line in enumerate(shown) if line.startswith("  --strategy")]
    assert len(starts) == 10
    for row, first, end in zip(rows, starts, [*starts[1:], len(shown)], strict=True):
        flags, said = " ".join(shown[first:end]).split(": ", 1)
        assert flags.strip() == row["flags"]
        assert " ".join(said.split()) == reason  # whole, every word intact


class Tiny(nn.Module):
    """A user's model without pipeline_layers() or a tensor-parallel plan."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def tiny_factory() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """The factory contract: (model, (inputs, targets), loss_fn)."""
    return Tiny(), (torch.randn(4, 6), torch.tensor([0, 1, 2, 0])), nn.functional.cross_entropy


def test_user_models_from_a_factory_and_a_script(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    result = _plan_json(capsys, "--factory", "test_plan:tiny_factory", "--global-batch-size", "8")
    assert [c["strategy"] for c in result["candidates"]] == ["single"]
    assert "command" not in result["candidates"][0]
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        "def plan_model():\n"
        "    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))\n"
        "    return model, (torch.randn(2, 4), torch.tensor([0, 1])), nn.functional.cross_entropy\n"
        "if __name__ == '__main__':\n    raise SystemExit('not run by dtrain plan')\n"
    )
    result = _plan_json(capsys, "--script", str(script), "--global-batch-size", "4")
    assert result["candidates"][0]["strategy"] == "single"
    assert result["calibration"]["parameters"] == 30


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["--model", "resnet"], 2, "invalid choice: 'resnet'"),
        (["--model", "mlp", "--nproc", "3"], 2, "does not divide evenly over the 3 processes"),
        (["--factory", "no_such_module_x:make"], 2, "cannot import module 'no_such_module_x'"),
        (["--factory", "test_plan:missing"], 2, "there is no function 'missing'"),
        (["--factory", "test_plan"], 2, "--factory takes MODULE:FUNCTION"),
        (["--factory", "test_plan:Tiny"], 2, "returned Tiny"),
        (["--factory", "test_plan:tiny_factory"], 2, "--global-batch-size is needed"),
        (["--model", "mlp", "--model-size", "small"], 2, "--model-size applies to --model gpt"),
        (["--model", "mlp", "--link-gbps", "1"], 2, "--link-gbps and --link-latency-us go"),
        (["--model", "mlp", "--experts", "4"], 2, "--experts applies to --model gpt only"),
        (["--factory", "test_plan:tiny_factory", "--experts", "4"], 2, "drop --experts"),
    ],
)
def test_bad_input_gets_a_clear_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], code: int, message: str
) -> None:
    try:
        got = main(["plan", *argv])
    except SystemExit as e:  # argparse's own errors
        got = e.code
    assert got == code
    assert message in capsys.readouterr().err


def test_plan_help_needs_no_torch(tmp_path: Path) -> None:
    probe = (
        "import sys\nfrom dtrain.cli import main\n"
        "try:\n    main(['plan', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert "--memory-per-device BYTES" in done.stdout
    assert done.stdout.strip().endswith("torch imported: False"), done.stderr[-2000:]


def test_layout_configs_match_the_strategies_checks() -> None:
    from dtrain.plan.layouts import check

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert check(Layout("ddp", nproc=2), 64, model) is None
    assert "does not divide evenly" in str(check(Layout("ddp", nproc=2), 63, model))
    assert "plan" in str(check(Layout("tensor", nproc=2, tp=2), 64, model))
    interleaved = Layout(
        "pipeline", nproc=2, pp=2, microbatches=2, schedule="interleaved", virtual=2
    )
    assert "layers" in str(check(interleaved, 64, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))))


def test_expert_parallel_layouts_need_experts_that_divide() -> None:
    """ddp and zero3 --ep over every divisor of the world above 1; a dense model's are
    refused with dtrain's reason, a MoE GPT's run where --ep divides its experts."""
    from dtrain.models import build
    from dtrain.plan.layouts import check

    split = [layout for layout in enumerate_layouts(4, 1, 0) if layout.ep > 1]
    assert sorted((layout.strategy, layout.ep) for layout in split) == [
        ("ddp", 2), ("ddp", 4), ("zero3", 2), ("zero3", 4),
    ]  # fmt: skip
    assert all(f"--ep {layout.ep}" in layout.flags() for layout in split)
    assert all(layout.config().ep == layout.ep for layout in split)
    dense = build("gpt", None)
    for layout in split:
        assert "has no experts modules" in str(check(layout, 32, dense)), layout.flags()
    moe = build("gpt", None, 4, 2)
    for layout in split:
        assert check(layout, 32, moe) is None, layout.flags()
    assert "does not divide the 6 experts" in str(
        check(Layout("zero3", nproc=4, ep=4), 32, build("gpt", None, 6, 2))
    )


def _moe_inputs() -> object:
    """A hand-made calibration of a MoE model on 4 processes of 4 cores (no communication
    hides behind compute), 1 GB/s links without latency: 1e6 parameters of which the
    experts hold 3/4, 2 MoE layers routing 10 kB per sample."""
    from dtrain.plan.calibrate import Calibration, StepTime
    from dtrain.plan.inputs import Inputs
    from dtrain.plan.machine import Machine
    from dtrain.plan.weigh import ModelFigures

    figures = ModelFigures(
        params=10**6, param_tensors=2, param_bytes=4 * 10**6, grad_bytes=4 * 10**6,
        optimizer_bytes=8 * 10**6, activation_bytes_per_sample=1e3, flops_per_sample=None,
        tensor_bytes=[10**6, 3 * 10**6], unit_bytes=[2 * 10**6, 2 * 10**6],
        expert_bytes=3 * 10**6, moe_layers=2, routed_bytes_per_sample=1e4,
    )  # fmt: skip
    calibration = Calibration("cpu", figures)
    calibration.steps = {
        (b, 1, shared): StepTime(0.01, 0.02, 0.004) for b in (16, 64) for shared in (True, False)
    }
    machine = Machine(4, 0, 1, 2**40, threads_per_process=1)
    return Inputs(calibration, given(4, 1.0, 0.0), machine, 64, None)


def test_expert_parallel_estimates_hold_the_experts_at_one_ep_th() -> None:
    from dtrain.plan.estimate import estimate

    inputs = _moe_inputs()
    whole = estimate(inputs, Layout("zero3", nproc=4))  # type: ignore[arg-type]
    split = estimate(inputs, Layout("zero3", nproc=4, ep=2))  # type: ignore[arg-type]
    # States: zero3's (P + G + O)/4 = 16 MB / 4; under --ep 2 the quarter outside the
    # experts as zero3 holds it, 4 MB / 4, and the experts' 12 MB at 1/2.
    assert whole.model_state_bytes == 4e6
    assert math.isclose(split.model_state_bytes, 1e6 + 6e6)
    assert math.isclose(costs.expert_model_states(4e6, 4e6, 8e6, 0.75, 2), 6e6)
    # Traffic, at (n-1)/n S / B per all-gather or reduce-scatter of S over n ranks: each
    # unit gathered twice and scattered once, 3 x 3/4 x 4 MB / 1 GB/s without --ep, a
    # quarter of it with; + per MoE layer 4 all-to-alls of 16 samples x 10 kB over 2
    # ranks (1/2 of it leaves), + the experts' 1.5 MB all-reduced over their 2 replicas.
    assert math.isclose(whole.communication_seconds, 9e-3)
    rows = 2 * 4 * 0.5 * 16 * 1e4 / 1e9
    assert math.isclose(split.communication_seconds, 9e-3 / 4 + rows + 1.5e6 / 1e9)
    # The optimizer steps a quarter over 4 shards and the experts at 1/2.
    assert math.isclose(split.optimizer_seconds, 0.004 * (0.25 / 4 + 0.75 / 2))
    # ddp: DDP's buckets hold the quarter outside the experts; --ep 4 = the world: the
    # experts have no replicas to all-reduce with, only the all-to-alls (3/4 leaves).
    ddp = estimate(inputs, Layout("ddp", nproc=4, ep=4))  # type: ignore[arg-type]
    assert math.isclose(ddp.model_state_bytes, 4e6 + 12e6 / 4)
    assert math.isclose(ddp.buffer_bytes, 1e6)
    buckets = sum(costs.ring_allreduce_bytes(b, 4) for b in costs.ddp_buckets(1e6)) / 1e9
    assert math.isclose(ddp.communication_seconds, buckets + 2 * 4 * 0.75 * 16 * 1e4 / 1e9)


def test_weighing_measures_the_experts_and_their_routed_rows() -> None:
    from dtrain.models import build
    from dtrain.models.recipes import TASKS
    from dtrain.plan.source import Workload
    from dtrain.plan.weigh import weigh

    model = build("gpt", None, 4, 2)
    tokens = torch.randint(0, model.config.vocab_size, (3, model.config.context))
    work = Workload("gpt", model, tokens, tokens, TASKS["gpt"].loss, "adamw", True)
    figures = weigh(work, model, torch.device("cpu"), 3)
    experts = [model.blocks[i].mlp.experts for i in range(model.config.layers)]
    assert figures.moe_layers == model.config.layers == 2
    assert figures.expert_bytes == 4 * sum(p.numel() for e in experts for p in e.parameters())
    # Every token of a sample goes to top-k = 2 experts, a row of dim fp32 values each.
    assert figures.routed_bytes_per_sample == model.config.context * 2 * model.config.dim * 4
    dense = build("gpt", None)
    work = Workload("gpt", dense, tokens, tokens, TASKS["gpt"].loss, "adamw", True)
    figures = weigh(work, dense, torch.device("cpu"), 3)
    assert (figures.expert_bytes, figures.moe_layers, figures.routed_bytes_per_sample) == (0, 0, 0)
