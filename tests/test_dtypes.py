"""Every dtype travels exactly: checkpoints of both formats (and `dtrain ckpt convert`), the
setup broadcast of every strategy, what ps's servers hold and send, towers' replicas,
local-sgd's averaging.

A model's tensors are not all float32: torchtitan's rotary table `freqs_cis` is a complex64
buffer, a step counter an int64 one (above 2**53 a float64 loses its low bits), a mask a
bool one, and parameters may be bf16 or float64. Cast through another dtype on the way, such
a tensor arrives changed (a complex one without its imaginary part), and training drifts
silently. One 3-process job runs ddp, zero3, local-sgd and ps (2 workers, 1 server), each
rank drawing other buffers than rank 0, and compares with single: buffers bit for bit,
parameters with assert_close.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import run_ckpt
from distributed import run_ranks
from test_ps import SERVER, ps_runs
from torch import nn
from torch.testing import assert_close
from torch.utils.data import TensorDataset
from training import finish

import dtrain
from dtrain.errors import ConfigError
from dtrain.strategies.ps.storage import FlatParameters

BIG = 2**53 + 1
"""An int64 value a float64 cannot hold (it rounds to 2**53)."""
FEATURES, CLASSES, GLOBAL_BATCH, STEPS = 8, 3, 12, 4


def every_dtype(seed: int) -> dict[str, torch.Tensor]:
    """A tensor of each dtype a model may hold, by dtype name, drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    floats = (torch.bfloat16, torch.float16, torch.float64, torch.complex64, torch.complex128)
    tensors = {
        dtype: torch.randn(2, 3, generator=g, dtype=dtype if dtype.is_complex else None).to(dtype)
        for dtype in floats
    }
    for dtype in (torch.int8, torch.int16, torch.int32, torch.uint8):
        tensors[dtype] = torch.randint(0, 100, (4,), generator=g).to(dtype)
    tensors[torch.int64] = torch.tensor([BIG + 2 * seed, -(2**62) - 1, seed])
    tensors[torch.bool] = torch.rand(5, generator=g) > 0.5
    return {str(dtype).removeprefix("torch."): t for dtype, t in tensors.items()}


class EveryDtype(nn.Module):
    """A bf16 parameter beside a float32 layer, and a buffer of every dtype."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(3, 3, generator=g))
        self.low = nn.Parameter(torch.randn(4, generator=g).to(torch.bfloat16))
        for name, tensor in every_dtype(seed).items():
            self.register_buffer(f"{name}_buffer", tensor)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_identical(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes and bits (NaN-free tensors: `torch.equal`)."""
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("checkpoint_format", ["consolidated", "sharded"])
def test_a_checkpoint_of_every_dtype_loads_bit_exactly(
    tmp_path: Path, checkpoint_format: str
) -> None:
    engine = dtrain.init(strategy="single", checkpoint_format=checkpoint_format)
    saved = EveryDtype(seed=1)
    engine.setup(saved, torch.optim.SGD(saved.parameters(), lr=0.1))
    engine.save(tmp_path / "ckpt")
    expected = state(saved)
    engine.close()
    engine = dtrain.init(strategy="single")
    loaded = EveryDtype(seed=2)
    engine.setup(loaded, torch.optim.SGD(loaded.parameters(), lr=0.1))
    engine.load(tmp_path / "ckpt")
    assert_identical(state(engine.module), expected)
    engine.close()


def test_a_converted_checkpoint_keeps_every_dtype(tmp_path: Path) -> None:
    engine = dtrain.init(strategy="single", checkpoint_format="sharded")
    model = EveryDtype(seed=3)
    engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.save(tmp_path / "sharded")
    expected = state(model)
    engine.close()
    for command in (
        ("convert", str(tmp_path / "sharded"), str(tmp_path / "consolidated")),
        ("convert", str(tmp_path / "consolidated"), str(tmp_path / "model.pt")),
        ("convert", str(tmp_path / "consolidated"), str(tmp_path / "model.safetensors")),
        ("verify", str(tmp_path / "consolidated")),
    ):
        done = run_ckpt(*command)
        assert done.returncode == 0, done.stderr
    assert_identical(torch.load(tmp_path / "model.pt", weights_only=True), expected)
    for source in ("consolidated", "model.safetensors"):
        engine = dtrain.init(strategy="single")
        model = EveryDtype(seed=4)
        engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        engine.load(tmp_path / source)
        assert_identical(state(engine.module), expected)
        engine.close()


def test_ps_refuses_served_parameters_of_several_dtypes() -> None:
    with pytest.raises(ConfigError, match="one dtype"):
        FlatParameters(list(EveryDtype(seed=0).parameters()))


def test_zero1_refuses_parameters_of_several_dtypes_by_name() -> None:
    engine = dtrain.init(strategy="zero1")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2).to(torch.bfloat16))
    try:
        with pytest.raises(ConfigError, match="torch.bfloat16, torch.float32; give the"):
            engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        engine.close()


class Rotary(nn.Module):
    """A linear layer whose output pairs are rotated by a complex64 table (as torchtitan's
    `freqs_cis` rotates queries), kept where a bool mask says, scaled by a float32 table
    (as Hugging Face's `inv_freq`) and by an int64 buffer's low bits; then a linear head.
    Every tensor is drawn from `seed`."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.wq = nn.Parameter(torch.randn(FEATURES, FEATURES, generator=g) * 0.3)
        self.head = nn.Parameter(torch.randn(CLASSES, FEATURES, generator=g) * 0.3)
        angles = torch.rand(FEATURES // 2, generator=g) * 6.0
        self.register_buffer(
            "freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False
        )
        self.register_buffer("scale", torch.rand(FEATURES, generator=g) + 0.5, persistent=False)
        self.register_buffer("count", torch.tensor([BIG + 2 * seed]))
        self.register_buffer("mask", torch.arange(FEATURES) % (seed + 2) != 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.wq.T
        pairs = torch.view_as_complex(h.reshape(len(x), FEATURES // 2, 2))
        h = torch.view_as_real(pairs * self.freqs_cis).reshape(len(x), FEATURES)
        # BIG % 4 is 1; rounded through float64 it would be 0.
        h = torch.where(self.mask, h * self.scale, 0.0) * (1 + self.count % 4)
        return torch.tanh(h) @ self.head.T


class ComplexNet(nn.Module):
    """Complex64 parameters only (what ps serves must be one dtype): the input's feature
    pairs as complex numbers through a complex layer and head."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        half = FEATURES // 2
        self.w = nn.Parameter(torch.randn(half, half, dtype=torch.complex64, generator=g) * 0.3)
        self.head = nn.Parameter(torch.randn(CLASSES, half, dtype=torch.complex64, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.view_as_complex(x.reshape(len(x), FEATURES // 2, 2))
        out = torch.tanh(z @ self.w.T) @ self.head.T
        return out.real + out.imag


class Counted(nn.Module):
    """A linear layer scaled by the parity of an int16 buffer that each forward counts up
    (and of a uint8 one): gloo has no int16 type, so DDP's own buffer broadcast before
    each forward cannot send it. Every rank starts from its own count (its seed)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(CLASSES, FEATURES, generator=g) * 0.3)
        self.register_buffer("calls", torch.tensor([seed], dtype=torch.int16))
        self.register_buffer("flag", torch.tensor([seed % 3], dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (x @ self.w.T) * (1 + self.calls % 2) * (1 + self.flag)


MODELS = {"rotary": Rotary, "complex": ComplexNet, "counted": Counted}
CLIP = 0.05
"""Below every step's gradient norm: clipping changes every update."""


def small_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(4 * GLOBAL_BATCH, FEATURES, generator=g)
    return TensorDataset(inputs, torch.randint(0, CLASSES, (len(inputs),), generator=g))


def train_small(model: str = "rotary", close: bool = True, **options: Any) -> dict[str, Any]:
    """`STEPS` SGD steps of MODELS[`model`], each rank building it from its own seed (its
    rank); returns this rank's buffers and, on the main rank, the parameters."""
    engine = dtrain.init(seed=0, **options)
    net = MODELS[model](seed=int(os.environ.get("RANK", 0)))
    net, optimizer = engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9))
    loader = engine.dataloader(small_data(), batch_size=GLOBAL_BATCH // engine.dp_size)
    for batch in engine.progress(loader):
        engine.train_step(batch, F.cross_entropy)
        if engine.step == STEPS:
            break
    buffers = {k: v.detach().cpu().clone() for k, v in engine.module.named_buffers()}
    del net, optimizer
    return {"params": finish(engine, close), "buffers": buffers}


def save_every_dtype(root: Path) -> dict[str, torch.Tensor]:
    """Save `EveryDtype` after one SGD step with momentum under single, in both formats
    (root/consolidated, root/sharded); return its state."""
    for checkpoint_format in ("consolidated", "sharded"):
        engine = dtrain.init(strategy="single", checkpoint_format=checkpoint_format)
        model = EveryDtype(seed=1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        engine.setup(model, optimizer)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        engine.save(root / checkpoint_format)
        expected = state(model)
        engine.close()
    return expected


def load_every_dtype(root: Path, close: bool = True, **options: Any) -> dict[str, Any]:
    """Load both of `save_every_dtype`'s checkpoints into an `EveryDtype` of another seed
    under `options`; return the whole model after each (main rank), then save it under
    the strategy's name and format in `root`."""
    engine = dtrain.init(**options)
    model = EveryDtype(seed=10 + int(os.environ.get("RANK", 0)))
    engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loaded = {}
    for checkpoint_format in ("consolidated", "sharded"):
        engine.load(root / checkpoint_format)
        loaded[checkpoint_format] = engine.state_dict()
    engine.save(root / f"{options['strategy']}-{options['checkpoint_format']}")
    del model
    finish(engine, close)
    return loaded


PS_RUNS = [{"model": "rotary"}, {"model": "complex", "clip_grad_norm": CLIP}]
"""ps serves Rotary's float32 parameters beside its buffers, then ComplexNet's complex64
parameters, clipping their mean gradient by its global norm."""


def dtypes_job(root: str) -> dict[str, Any]:
    """One rank of a 3-process job: ddp, zero3 and local-sgd (syncing every step) train
    Rotary over all three; ddp and zero3 load and save `EveryDtype`; then ps trains
    PS_RUNS with 2 workers and 1 server. Returns this rank's result of each run."""
    results = {
        name: train_small(close=False, **options)
        for name, options in {
            "ddp": {"strategy": "ddp"},
            "zero3": {"strategy": "zero3"},
            "local-sgd": {"strategy": "local-sgd", "sync_every": 1},
        }.items()
    }
    results["ddp counted"] = train_small("counted", close=False, strategy="ddp")
    for strategy, checkpoint_format in (("ddp", "consolidated"), ("zero3", "sharded")):
        results[f"{strategy} loads"] = load_every_dtype(
            Path(root), close=False, strategy=strategy, checkpoint_format=checkpoint_format
        )
    served = ps_runs(train_small, PS_RUNS, 2, 1)
    for i, run in enumerate(PS_RUNS):
        results[f"ps {run['model']}"] = served if served == SERVER else served[i]
    return results


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    """What single trains of each model."""
    return {
        "rotary": train_small(strategy="single"),
        "complex": train_small("complex", strategy="single", clip_grad_norm=CLIP),
        "counted": train_small("counted", strategy="single"),
    }


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path, dict]:
    """The ranks' results of `dtypes_job`, its checkpoints' folder, and the state single
    saved there."""
    root = tmp_path_factory.mktemp("dtypes")
    expected = save_every_dtype(root)
    return run_ranks(dtypes_job, 3, str(root), timeout=280), root, expected


def check_run(ranks: list[dict[str, Any]], run: str, single: dict[str, Any]) -> None:
    """Every rank's buffers are single's, bit for bit; the main rank's parameters close."""
    for rank, results in enumerate(ranks):
        got = results[run]
        if got == SERVER:
            continue
        assert_identical(got["buffers"], single["buffers"])
        if rank == 0:
            assert_close(got["params"], single["params"])


def test_towers_train_the_rotary_model_as_single(single: dict[str, Any]) -> None:
    check_run([{"towers": train_small(strategy="towers", towers=2)}], "towers", single["rotary"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", ["ddp", "zero3", "local-sgd", "ps rotary"])
def test_every_rank_trains_the_rotary_model_as_single(
    job: tuple, single: dict[str, Any], run: str
) -> None:
    """Each rank drew other buffers; setup gives every rank rank 0's, bit for bit."""
    check_run(job[0], run, single["rotary"])


@pytest.mark.timeout(300)
def test_ps_serves_complex_parameters_and_clips_them_as_single(
    job: tuple, single: dict[str, Any]
) -> None:
    check_run(job[0], "ps complex", single["complex"])
    assert job[0][2]["ps complex"] == SERVER


@pytest.mark.timeout(300)
def test_ddp_and_zero3_load_every_dtype_bit_exactly(job: tuple) -> None:
    ranks, _, expected = job
    for strategy in ("ddp", "zero3"):
        for checkpoint_format in ("consolidated", "sharded"):
            assert_identical(ranks[0][f"{strategy} loads"][checkpoint_format], expected)


@pytest.mark.timeout(300)
def test_single_loads_what_ddp_and_zero3_saved_bit_exactly(job: tuple) -> None:
    _, root, expected = job
    for saved in ("ddp-consolidated", "zero3-sharded"):
        engine = dtrain.init(strategy="single")
        model = EveryDtype(seed=5)
        engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        engine.load(root / saved)
        assert_identical(state(engine.module), expected)
        engine.close()


@pytest.mark.timeout(300)
def test_ddp_syncs_buffers_of_dtypes_the_backend_lacks_as_single(
    job: tuple, single: dict[str, Any]
) -> None:
    """An int16 buffer counted up by each forward: DDP's broadcast before each forward
    would fail inside gloo; dtrain sends it as bytes, so every rank counts as single."""
    check_run(job[0], "ddp counted", single["counted"])
