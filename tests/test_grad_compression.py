"""--grad-compression: fp16/bf16 casts and PowerSGD train the model single trains, within
what the compression loses; PowerSGD's state resumes exactly; misuse is refused by name."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_ranks
from test_cli import demo
from torch.testing import assert_close
from training import CLOSE, train, train_variants

import dtrain
from dtrain.checkpoint import rank_states
from dtrain.checkpoint.convert import convert
from dtrain.checkpoint.format import TRAINER_FILE
from dtrain.config import grad_compression
from dtrain.errors import ConfigError

STEPS = 3

UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
"""Half the spacing of the format's numbers near 1: the largest relative error of one cast."""


@pytest.fixture(scope="module")
def start_and_reference() -> tuple[dict, dict]:
    """The MLP's initial parameters and single's after `STEPS` SGD steps."""
    return train(strategy="single", steps=0), train(strategy="single", steps=STEPS)


def displacement_error(params: dict, reference: dict, start: dict) -> float:
    """The largest relative distance, over the tensors, between what `params` and
    `reference` moved from `start`: ||dp - dr|| / ||dr||."""
    return max(
        float((params[k] - reference[k]).norm() / (reference[k] - start[k]).norm())
        for k in reference
    )


CAST_VARIANTS = [
    ({"strategy": "ddp", "grad_compression": "fp16"}, 4),
    ({"strategy": "ddp", "grad_compression": "bf16"}, 4),
    ({"strategy": "zero1", "grad_compression": "bf16"}, 4),
    ({"strategy": "ddp", "hierarchical": True, "nproc": 2, "grad_compression": "fp16"}, 2),
    ({"strategy": "hsdp", "shard_size": 2, "grad_compression": "bf16"}, 3),
]
"""At 4 ranks: (options, roundings), where roundings counts the cast and each addition
made in the format (dividing by a power of two is exact): 1 + 3 along a ring of 4 (ddp,
zero1); 1 + 1 between 2 machines' leaders (hierarchical: 2 "machines" of 2, the cast is
what crosses them); 1 + 1 in the reduce-scatter + 1 in the all-reduce across replicas
(hsdp: 2 replicas sharded over 2)."""

POWERSGD = {"strategy": "ddp", "grad_compression": "powersgd:2"}


def several_buckets() -> bool:
    """6 steps of `POWERSGD` on a model of two DDP buckets (4.7 MB: DDP's first bucket
    holds 1 MiB), each rank on its own data; True if every parameter stayed finite. Where
    ranks issued one bucket's Q all-reduce and the next bucket's first all-reduce in
    different orders, gloo aborted the job ("Received data size doesn't match")."""
    engine = dtrain.init(seed=0, **POWERSGD)
    model = torch.nn.Sequential(*[torch.nn.Linear(384, 384) for _ in range(8)])
    model, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    data = torch.Generator().manual_seed(engine.rank)
    for _ in range(6):
        x, y = torch.randn(8, 384, generator=data), torch.randn(8, 384, generator=data)
        engine.train_step((x, y), torch.nn.functional.mse_loss)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    engine.strategy.close()  # the process group stays for the next run
    return finite


def four_rank_runs(directory: str) -> dict[str, Any]:
    """Every multi-process run of this file, in one job of 4 ranks:

    - "cast": `CAST_VARIANTS` after `STEPS` steps;
    - "full", "low": ddp, then PowerSGD at rank 64 (above every matrix's smaller side) and
      at rank 1, 5 steps each (steps 3 to 5 compressed). torch's default minimum
      compression rate of 2 sends a full-rank matrix whole (its factors are larger than
      it), so it is lowered for these two to make every matrix go through P and Q;
    - "resume": 6 steps of `POWERSGD`, uninterrupted and as 4 + 2 through a consolidated
      checkpoint in `directory` (steps 3 and 4 leave error feedback and warm-start Qs);
      "resume_sharded": the 4 + 2 through a sharded one;
    - "restart": what the main rank printed loading that checkpoint at PowerSGD rank 4;
    - "several_buckets": `several_buckets()`.
    """
    from dtrain.parallel import compression

    out: dict[str, Any] = {"several_buckets": several_buckets()}
    cast = [{**variant, "steps": STEPS} for variant, _ in CAST_VARIANTS]
    out["cast"] = [train(close=False, **variant) for variant in cast]
    whole = train(steps=6, close=False, **POWERSGD)
    train(steps=4, checkpoint_out=directory, close=False, **POWERSGD)
    out["resume"] = whole, train(steps=2, checkpoint_in=directory, close=False, **POWERSGD)
    sharded = {**POWERSGD, "checkpoint_format": "sharded"}
    train(steps=4, checkpoint_out=f"{directory}-sharded", close=False, **sharded)
    resumed = train(steps=2, checkpoint_in=f"{directory}-sharded", close=False, **sharded)
    out["resume_sharded"] = resumed
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        options = {**POWERSGD, "grad_compression": "powersgd:4"}
        train(steps=1, checkpoint_in=directory, close=False, **options)
    out["restart"] = printed.getvalue()
    default_rate = compression.MIN_COMPRESSION_RATE
    compression.MIN_COMPRESSION_RATE = 0.25
    variants = [
        {"strategy": "ddp"},
        {"strategy": "ddp", "grad_compression": "powersgd:64"},
        {"strategy": "ddp", "grad_compression": "powersgd:1"},
    ]
    out["plain"], out["full"], out["low"] = train_variants(
        [{**variant, "steps": 5} for variant in variants]
    )
    compression.MIN_COMPRESSION_RATE = default_rate
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """`four_rank_runs`' results on the main rank, and the checkpoint it wrote."""
    checkpoint = tmp_path_factory.mktemp("powersgd") / "step-4"
    return run_ranks(four_rank_runs, 4, str(checkpoint), timeout=290)[0], checkpoint


@pytest.mark.timeout(300)
def test_cast_compression_trains_as_single(
    start_and_reference: tuple[dict, dict], runs: tuple[dict[str, Any], Path]
) -> None:
    """fp16 and bf16 under ddp, zero1, hierarchical ddp and hsdp move the parameters as
    single does, within the format's rounding.

    Each element of each step's averaged gradient is off by at most `roundings` x u
    relative (u the unit roundoff); momentum SGD, linear in the updates, moves the
    parameters by the same relative amount off, plus the second-order change of later
    gradients at the slightly moved parameters: twice the first-order bound leaves room
    for it; fp32's reordering noise (~1e-7) is far below it. The error must also exceed
    that noise: the cast did happen."""
    start, reference = start_and_reference
    for (variant, roundings), params in zip(CAST_VARIANTS, runs[0]["cast"], strict=True):
        error = displacement_error(params, reference, start)
        bound = 2 * roundings * UNIT_ROUNDOFF[variant["grad_compression"]]
        assert 1e-6 < error < bound, f"{variant}: relative displacement error {error:.2e}"


@pytest.mark.timeout(300)
def test_powersgd_at_full_rank_trains_as_ddp(runs: tuple[dict[str, Any], Path]) -> None:
    """At full rank P = MQ spans the summed gradient's columns and PQ^T gives it back, up to
    fp32 rounding in the orthogonalisation; each rank's error feedback (its gradient
    minus the average) sums to zero over the ranks, so the average stays exact. Rank 1
    does differ: the comparison sees the compression."""
    results = runs[0]
    assert_close(results["full"], results["plain"], **CLOSE)
    low, plain = results["low"], results["plain"]
    assert max(float((low[k] - plain[k]).abs().max()) for k in plain) > 1e-3


@pytest.mark.timeout(300)
def test_powersgd_runs_a_model_of_several_buckets(runs: tuple[dict[str, Any], Path]) -> None:
    assert runs[0]["several_buckets"]


@pytest.mark.timeout(300)
def test_powersgd_state_resumes_exactly(runs: tuple[dict[str, Any], Path]) -> None:
    """Stopped and resumed, PowerSGD trains as uninterrupted, each rank with its own error
    feedback; loaded into a job that cannot use it, it warns and starts afresh."""
    results, checkpoint = runs
    whole, resumed = results["resume"]
    # Not bit for bit: the resumed DDP's first step buckets the parameters in their initial
    # order, the uninterrupted one in gradient-ready order, and a ring of 4 can then sum the
    # vectors sent whole in another order (an ulp). Error feedback or Qs lost would move
    # the parameters by ~1e-3.
    assert_close(resumed, whole)
    assert_close(results["resume_sharded"], whole)
    # The consolidated checkpoint gathers every rank's state into its trainer file.
    trainer = torch.load(checkpoint / TRAINER_FILE, weights_only=True)
    states = [s["powersgd"] for s in trainer[rank_states.LISTED]]
    assert [s["world_size"] for s in states] == [4] * 4 and states[0]["iter"] == 4
    first, second = (s["errors"]["net.3.weight"] for s in states[:2])
    assert not torch.equal(first, second)
    # The sharded one keeps each rank's as that rank's own entry, and says so.
    sharded = checkpoint.with_name(f"{checkpoint.name}-sharded")
    trainer = torch.load(sharded / TRAINER_FILE, weights_only=True)
    assert rank_states.LISTED not in trainer and trainer[rank_states.WRITTEN] == 4
    own, rank_0 = rank_states.own_and_first(sharded, trainer, 1, 4)
    assert own is not None and rank_0 is None  # rank 0's is needed only for a replica
    assert_close(own["powersgd"]["errors"]["net.3.weight"], second)
    # `ckpt convert` gathers the entries into the consolidated layout's list.
    converted = sharded.with_name("converted")
    convert(sharded, converted)
    trainer = torch.load(converted / TRAINER_FILE, weights_only=True)
    assert [s["powersgd"]["iter"] for s in trainer[rank_states.LISTED]] == [4] * 4
    assert "holds no PowerSGD state of 4 processes at rank 4" in results["restart"]


@pytest.mark.timeout(120)
def test_demo_with_powersgd_rank_2_reaches_95_percent(tmp_path: Path) -> None:
    flags = ("--strategy", "ddp", "--nproc", "2", "--grad-compression", "powersgd:2")
    metrics = demo(tmp_path, *flags)
    assert metrics["test_accuracy"] >= 0.95
    assert metrics["grad_compression"] == "powersgd:2"


def test_grad_compression_values_parse() -> None:
    assert grad_compression("none") == ("none", 0)
    assert grad_compression("bf16") == ("bf16", 0)
    assert grad_compression("powersgd") == ("powersgd", 1)
    assert grad_compression("powersgd:4") == ("powersgd", 4)
    for bad in ("fp8", "fp16:2", "powersgd:", "powersgd:x", "POWERSGD"):
        with pytest.raises(ConfigError, match="choose one of none, fp16, bf16, powersgd|needs"):
            grad_compression(bad)
    for rank in ("0", "-1"):
        with pytest.raises(ConfigError, match="needs a whole RANK of at least 1"):
            dtrain.Config(strategy="ddp", grad_compression=f"powersgd:{rank}")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"strategy": "single"}, "--strategy single runs in one process, which sends none"),
        ({"strategy": "towers"}, "--strategy towers runs in one process"),
        ({"strategy": "zero3"}, "of --strategy ddp, zero1 or hsdp, not zero3"),
        ({"strategy": "zero2"}, "of --strategy ddp, zero1 or hsdp, not zero2"),
        ({"strategy": "ps"}, "of --strategy ddp, zero1 or hsdp, not ps"),
        ({"strategy": "pipeline"}, "of --strategy ddp, zero1 or hsdp, not pipeline"),
        ({"strategy": "tensor"}, "of --strategy ddp, zero1 or hsdp, not tensor"),
        ({"strategy": "hybrid"}, "of --strategy ddp, zero1 or hsdp, not hybrid"),
        (
            {"strategy": "hsdp", "grad_compression": "powersgd"},
            "inside FSDP2, which reduces in one dtype and takes no compression hook",
        ),
        (
            {"strategy": "ddp", "hierarchical": True, "grad_compression": "powersgd:2"},
            "cannot run with --hierarchical",
        ),
        (
            {"strategy": "ddp", "grad_compression": "powersgd", "precision": "fp16-mixed"},
            "under --precision fp16-mixed a step whose gradients overflow",
        ),
    ],
)
def test_strategies_it_cannot_compress_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dtrain.Config(**{"grad_compression": "bf16", **options})


def test_the_flag_and_the_toml_key_reach_config(tmp_path: Path) -> None:
    from dtrain.cli import build_parser
    from dtrain.config.file import parse_with_config
    from dtrain.launcher.topology_flags import config_from

    path = tmp_path / "job.toml"
    path.write_text('strategy = "ddp"\nnproc = 2\ngrad-compression = "powersgd:4"\n')
    config = config_from(parse_with_config(build_parser(), ["demo", "--config", str(path)]))
    assert config.grad_compression == "powersgd:4"
    argv = ["run", "--config", str(path), "--grad-compression", "bf16", "train.py"]
    assert config_from(parse_with_config(build_parser(), argv)).grad_compression == "bf16"


class OneGroup:
    """What PowerSGD asks of its process group outside a hook: the number of ranks."""

    def size(self) -> int:
        return 2


def test_powersgd_state_follows_each_parameter_into_new_buckets() -> None:
    """DDP rebuilds its buckets after its first step (and a resumed job's first buckets
    are the initial ones): each parameter's error and Q go back where it now sits. torch's
    Q buffer holds the compressed matrices grouped by shape, in order of first appearance."""
    from torch import nn

    from dtrain.parallel.compression import PowerSGD

    # Never run: only the shapes matter, two of them alike (16 x 8).
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(8, 16))
    shapes = {name: p.shape for name, p in model.named_parameters()}
    after = list(shapes)  # DDP's rebuilt order here
    before = after[::-1]  # its initial order
    powersgd = PowerSGD(OneGroup(), 1, model)  # type: ignore[arg-type]
    state = powersgd.torch_state
    sizes = [shapes[name].numel() for name in before]
    state.error_dict[0] = torch.arange(float(sum(sizes)))
    errors = dict(zip(before, torch.split(state.error_dict[0], sizes), strict=True))
    # Rank-1 factors: a Q row per matrix column. Grouped by shape in `before`: 2.weight and
    # 0.weight (8 each), then 1.weight (16).
    state.q_memory_dict[0] = torch.arange(1000.0, 1032.0)
    order = ["2.weight", "0.weight", "1.weight"]
    qs = dict(zip(order, torch.split(state.q_memory_dict[0], [8, 8, 16]), strict=True))
    state.p_memory_dict[0] = torch.empty(16 + 16 + 4)
    powersgd._layouts[0] = tuple((name, shapes[name]) for name in before)

    powersgd._file_by_parameter(keep=set())
    assert not state.error_dict and not state.q_memory_dict
    layout = tuple((name, shapes[name]) for name in after)
    powersgd._layouts[0] = layout
    powersgd._restore(0, layout, torch.empty(0))

    assert torch.equal(state.error_dict[0], torch.cat([errors[name] for name in after]))
    expected = [qs[name] for name in ("0.weight", "2.weight", "1.weight")]
    assert torch.equal(state.q_memory_dict[0], torch.cat(expected))
    assert state.p_memory_dict[0].numel() == 16 + 16 + 4
    saved = powersgd.state_dict()
    assert all(torch.equal(saved["errors"][name], errors[name]) for name in after)
    assert all(torch.equal(saved["q"][name], qs[name]) for name in order)


class Bucket:
    """What PowerSGD's `prepare` reads of a DDP bucket."""

    def __init__(self, index: int, parameters: list[torch.nn.Parameter]) -> None:
        self._index, self._parameters = index, parameters

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._parameters

    def buffer(self) -> torch.Tensor:
        return torch.empty(sum(p.numel() for p in self._parameters))


def test_a_bucket_already_compressed_this_step_keeps_its_new_error_at_a_rebuild() -> None:
    """Bucket 0 keeps its layout and is compressed first (its new error is still being
    computed when bucket 1 turns out rebuilt): only bucket 1's state is filed by parameter,
    and bucket 0's fresh error is what its next step adds."""
    from torch import nn

    from dtrain.parallel.compression import PowerSGD

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    first, second = list(model[0].parameters()), list(model[1].parameters())
    powersgd = PowerSGD(OneGroup(), 1, model)  # type: ignore[arg-type]
    state = powersgd.torch_state
    state.iter = 4
    for index, params in enumerate((first, second)):
        powersgd.prepare(Bucket(index, params))  # type: ignore[arg-type]
        state.error_dict[index] = torch.full((sum(p.numel() for p in params),), float(index))
    state.iter = 5
    powersgd.prepare(Bucket(0, first))  # type: ignore[arg-type]
    powersgd.prepare(Bucket(1, second[::-1]))  # type: ignore[arg-type] - rebuilt: reordered
    fresh = torch.full_like(state.error_dict[0], 7.0)
    state.error_dict[0] = fresh  # bucket 0's callback ends after bucket 1's prepare
    assert torch.equal(state.error_dict[1], torch.ones_like(state.error_dict[1]))
    state.iter = 6
    powersgd.prepare(Bucket(0, first))  # type: ignore[arg-type]
    assert state.error_dict[0] is fresh


def test_powersgd_refuses_a_0_d_parameter_by_name() -> None:
    from types import SimpleNamespace

    from torch import nn

    from dtrain.parallel.compression import register_compression

    model = nn.Linear(4, 2)
    model.temperature = nn.Parameter(torch.tensor(1.0))
    wrapped = SimpleNamespace(module=model)
    with pytest.raises(ConfigError, match="temperature is a 0-d parameter; give each the shape"):
        register_compression(wrapped, OneGroup(), "powersgd")  # type: ignore[arg-type]
