"""Models we did not write, or wrote after other projects' habits, built inside
`engine.init_empty` start bit for bit as the same model built whole from the same seed, with
the CPU generator left where the whole build leaves it; or setup refuses them by name.

Hugging Face's Llama, Qwen2 (its output layer tied to the embedding) and GPT-NeoX, tiny,
whose sub-models initialise themselves through ``post_init``; a ResNet-18 initialised in
its constructor as torchvision's is (tests/resnet18.py), and nanoGPT's constructor that
initialises every module itself; torchtitan's habit of a complex64
rotary table that ``init_weights()`` computes again, called by the constructor or left to
the trainer; torch.nn.init's functions that do nothing on the meta device (``orthogonal_``,
``dirac_``, ``sparse_``, ``trunc_normal_``, ``eye_``) called in a constructor; an attribute
an initialisation method reads, changed after it ran. Refused: a tensor nothing replayable
sets (complex and integer ones too), a random tensor made or a view written in a
constructor, random numbers drawn on the CPU in the block, a seed set once the build's
initialisation began (even back to where it started), a module tree changed after its
``init_weights()`` ran (a child added, a head replaced), an initialisation method that
rebinds its argument, an ``init_weights()`` the build never called, a model put on the meta
device outside the block."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from resnet18 import resnet18  # noqa: E402
from third_party import hf_lm as hf_model  # noqa: E402
from torch import nn  # noqa: E402
from torch.testing import assert_close  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import dtrain  # noqa: E402
from dtrain.errors import SetupError  # noqa: E402

hf_logging.set_verbosity_error()

VOCAB, DIM, LENGTH = 64, 32, 16


def rotary_table(head_dim: int, length: int) -> torch.Tensor:
    """(length, head_dim / 2) complex64 e^(i t w_k), w_k = 10000^(-2k/d) (RoFormer)."""
    frequencies = 10000.0 ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), frequencies)
    return torch.polar(torch.ones_like(angles), angles)


class RopeBlock(nn.Module):
    """A pre-norm block's parameters (the forward does not matter here)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def init_states(self, std: float) -> None:
        """torchtitan's per-block initialisation, called by the model's."""
        nn.init.ones_(self.attention_norm.weight)
        nn.init.trunc_normal_(self.wqkv.weight, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, std=std)


class RopeLM(nn.Module):
    """torchtitan's Llama habits: blocks in an ``nn.ModuleDict`` named ``layers``, a
    complex64 rotary table at the root (``freqs_cis``) that ``init_weights()`` computes
    again, rebinding the buffer; the constructor ends with ``init_weights(output_std=0.1)``
    unless `init_in_constructor` is False (torchtitan's trainer calls it after the build,
    without arguments)."""

    def __init__(self, init_in_constructor: bool = True) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): RopeBlock() for i in range(2)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("freqs_cis", rotary_table(DIM // 4, LENGTH), persistent=True)
        if init_in_constructor:
            self.init_weights(output_std=0.1)

    def init_weights(self, output_std: float = DIM**-0.5) -> None:
        """The table again, then every weight."""
        with torch.device(self.freqs_cis.device):
            self.freqs_cis = rotary_table(DIM // 4, LENGTH)
        nn.init.normal_(self.tok_embeddings.weight)
        for block in self.layers.values():
            block.init_states(std=0.02 / len(self.layers))
        nn.init.ones_(self.norm.weight)
        nn.init.trunc_normal_(self.output.weight, std=output_std)


class NanoStyle(nn.Module):
    """nanoGPT's and older models' habits: the constructor ties the embedding to the output
    layer, applies an initialiser of its own to every module (writing through ``.data``),
    then scales the projections down with torch.nn.init, all outside any
    reset_parameters() or init_weights()."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.proj = nn.Linear(DIM, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._initialise)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(4))

    @staticmethod
    def _initialise(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()


def trained_later() -> nn.Module:
    """`RopeLM` as torchtitan's trainer has it: built, then ``init_weights()``."""
    model = RopeLM(init_in_constructor=False)
    model.init_weights()
    return model


def start(build: Callable[[], nn.Module], empty: bool) -> tuple[dict[str, torch.Tensor], ...]:
    """The parameters and buffers (persistent or not) after setup under `single` of the
    model `build` makes, built whole or inside `engine.init_empty()` from seed 0, and 4
    numbers drawn from torch's generator after setup."""
    engine = dtrain.init(strategy="single", seed=0)
    try:
        if empty:
            with engine.init_empty():
                model = build()
        else:
            model = build()
        engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        tensors = {**model.state_dict(), **dict(model.named_buffers())}
        return {k: v.detach().clone() for k, v in tensors.items()}, torch.rand(4)
    finally:
        engine.close()


def assert_starts_as_whole(
    build: Callable[[], nn.Module], whole: Callable[[], nn.Module] | None = None
) -> None:
    """`build` inside `engine.init_empty()` starts bitwise as `whole` (default: `build`)
    built whole, and leaves the generator where the whole build does."""
    empty_tensors, empty_drawn = start(build, empty=True)
    whole_tensors, whole_drawn = start(whole or build, empty=False)
    assert empty_tensors.keys() == whole_tensors.keys()
    for name, expected in whole_tensors.items():
        assert_close(empty_tensors[name], expected, rtol=0, atol=0, msg=lambda m, n=name: n + m)
    assert_close(empty_drawn, whole_drawn, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "neox"])
def test_hugging_face_models_start_as_built_whole(kind: str) -> None:
    assert_starts_as_whole(lambda: hf_model(kind))


def test_a_tied_hugging_face_model_stays_tied() -> None:
    engine = dtrain.init(strategy="single", seed=0)
    with engine.init_empty():
        model = hf_model("qwen2")
    engine.setup(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    engine.close()


@pytest.mark.parametrize("zero_init_residual", [False, True])
def test_a_resnet_initialised_in_its_constructor_starts_as_built_whole(
    zero_init_residual: bool,
) -> None:
    assert_starts_as_whole(lambda: resnet18(width=4, zero_init_residual=zero_init_residual))


def test_a_model_initialised_by_its_constructor_through_data_starts_as_built_whole() -> None:
    assert_starts_as_whole(NanoStyle)


def test_a_complex_table_rebuilt_by_init_weights_starts_as_built_whole() -> None:
    assert_starts_as_whole(RopeLM)
    tensors, _ = start(RopeLM, empty=True)
    assert tensors["freqs_cis"].dtype == torch.complex64
    assert_close(tensors["freqs_cis"], rotary_table(DIM // 4, LENGTH), rtol=0, atol=0)


def seeded_resnet() -> nn.Module:
    """A ResNet built right after seeding the generator again (as tests/hf_training.py's
    builders do)."""
    torch.manual_seed(5)
    return resnet18(width=4)


def test_a_seed_set_in_the_block_before_building_is_honoured() -> None:
    assert_starts_as_whole(seeded_resnet)


def test_a_model_left_to_its_trainer_to_initialise_starts_as_built_then_initialised() -> None:
    assert_starts_as_whole(lambda: RopeLM(init_in_constructor=False), whole=trained_later)


class MetaBlindInits(nn.Module):
    """A constructor calling the torch.nn.init functions that return early on the meta
    device (or write through ``out=``), between layers that draw (PPO's orthogonal heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = nn.Linear(4, 8)
        nn.init.orthogonal_(self.policy.weight, gain=2**0.5)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        nn.init.dirac_(self.conv.weight)
        self.sparse = nn.Linear(6, 5)
        nn.init.sparse_(self.sparse.weight.data, sparsity=0.5)
        self.truncated = nn.Linear(4, 4)
        nn.init.trunc_normal_(self.truncated.weight, std=0.02)
        self.identity = nn.Linear(4, 4)
        nn.init.eye_(self.identity.weight)


def test_init_functions_that_skip_the_meta_device_start_as_built_whole() -> None:
    assert_starts_as_whole(MetaBlindInits)


class ScaledLater(nn.Module):
    """reset_parameters() reads an attribute the constructor changes after calling it."""

    def __init__(self) -> None:
        super().__init__()
        self.std = 1.0
        self.proj = nn.Linear(4, 4)
        self.reset_parameters()
        self.std = 100.0

    def reset_parameters(self) -> None:
        nn.init.normal_(self.proj.weight, std=self.std)


def test_an_attribute_changed_after_its_init_method_ran_is_replayed_as_it_was() -> None:
    assert_starts_as_whole(ScaledLater)


def test_an_lstm_holding_weak_references_to_its_weights_starts_as_built_whole() -> None:
    assert_starts_as_whole(lambda: nn.LSTM(4, 8, 2))


class Rotating(nn.Module):
    """A weight its reset_parameters() sets, beside a buffer of `kind` computed in the
    constructor that nothing sets again."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        if kind == "complex":
            self.register_buffer("table", rotary_table(4, 8))
        else:
            self.register_buffer("table", torch.arange(8))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)


class RandomPositions(nn.Module):
    """ViT's habit: a parameter drawn in the constructor with torch.randn."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.positions = nn.Parameter(torch.randn(8, 4) * 0.02)


class ZeroedRow(nn.Module):
    """A constructor writing part of a weight through a view."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        with torch.no_grad():
            self.proj.weight[0].zero_()


class CpuNoise(nn.Module):
    """A constructor drawing a real tensor on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("noise", torch.randn(4, device="cpu"))


class Reseeded(nn.Module):
    """A constructor seeding again between layers (`forked`: inside torch.random.fork_rng),
    leaving the generator where the block's seed left it."""

    def __init__(self, forked: bool) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        with torch.random.fork_rng() if forked else contextlib.nullcontext():
            torch.manual_seed(0)
            self.second = nn.Linear(4, 4)


class GrownLater(nn.Module):
    """A child added after the constructor's init_weights()."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.init_weights()
        self.second = nn.Linear(4, 4)

    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)


def llama_with_new_head() -> nn.Module:
    """A Hugging Face Llama whose output layer is replaced (another vocabulary)."""
    model = hf_model("llama")
    model.lm_head = nn.Linear(DIM, VOCAB + 16, bias=False)
    return model


class RebindsArgument(nn.Module):
    """reset_parameters() rebinding its argument before its first torch call."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.reset_parameters(0.5)

    def reset_parameters(self, std: float = 1.0) -> None:
        std = std / 2
        nn.init.normal_(self.proj.weight, std=std)


class Helper(nn.Linear):
    """A layer with an init_weights() nobody calls."""

    def init_weights(self) -> None:
        nn.init.zeros_(self.weight)


REFUSED: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "complex buffer": (lambda: nn.Sequential(Rotating("complex")), r"'0' \(Rotating\).*'table'"),
    "integer buffer": (lambda: nn.Sequential(Rotating("integer")), r"'0' \(Rotating\).*'table'"),
    "random tensor": (lambda: nn.Sequential(RandomPositions()), r"'0' \(RandomPositions\).*randn"),
    "view": (lambda: nn.Sequential(ZeroedRow()), r"'0' \(ZeroedRow\).*zero_ through a view"),
    "cpu draw": (CpuNoise, r"drawn on the CPU"),
    "seed set again": (
        lambda: nn.Sequential(Reseeded(forked=False)),
        r"'0' \(Reseeded\) set the random state \(torch.manual_seed\)",
    ),
    "fork_rng": (
        lambda: nn.Sequential(Reseeded(forked=True)),
        r"'0' \(Reseeded\) set the random state \(torch.random.fork_rng\)",
    ),
    "child added after init_weights": (
        lambda: nn.Sequential(GrownLater()),
        r"'0' \(GrownLater\) was changed after its init_weights\(\).*\(second added\)",
    ),
    "head replaced": (
        llama_with_new_head,
        r"'model' \(LlamaForCausalLM\) was changed.*\(lm_head replaced\)",
    ),
    "argument rebound": (
        lambda: nn.Sequential(RebindsArgument()),
        r"'0' \(RebindsArgument\).*reset_parameters\(\) assigns its argument 'std'",
    ),
    "init_weights never called": (
        lambda: nn.Sequential(Helper(4, 4)),
        r"'0' \(Helper\) defines init_weights\(\)",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_build_setup_cannot_replay_is_refused_by_name(case: str) -> None:
    build, message = REFUSED[case]
    engine = dtrain.init(strategy="single", seed=0)
    with engine.init_empty():
        model = build()
    with pytest.raises(SetupError, match=message):
        engine.setup(model)
    engine.close()


def test_a_model_put_on_the_meta_device_outside_init_empty_is_refused() -> None:
    engine = dtrain.init(strategy="single", seed=0)
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(SetupError, match="not built inside engine.init_empty"):
        engine.setup(model)
    engine.close()
