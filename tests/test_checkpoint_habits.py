"""Checkpoints of real user models under every strategy: a checkpoint from any writer
loads into any reader (zero1 included), and tied weights (Hugging Face GPT-2's
``tie_word_embeddings``, nanoGPT's ``lm_head.weight = wte.weight``) are saved under every
name, load without dtrain, and come back still tied, their optimizer state stored once."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from distributed import run_ranks
from hf_training import Tokens
from hf_training import build as build_hf
from torch import nn
from torch.testing import assert_close
from torch.utils.data import TensorDataset
from training import finish, train, train_variants

import dtrain
from dtrain.checkpoint.convert import convert
from dtrain.checkpoint.dcp_io import read_metadata

ADAM = {"optimizer_name": "adam"}
SHARDED = {"checkpoint_format": "sharded"}
WRITERS = {"single": {}, "ddp": SHARDED, "zero1": {}, "zero3": SHARDED}
"""Who writes the checkpoints every reader loads, and in which layout."""
COVERED = {("single", "ddp"), ("zero1", "zero3"), ("zero3", "ddp")}
"""(writer, reader) pairs tests/test_checkpoint*.py already load, in the same layout;
they and the writers other than ddp into single are left out of the matrix here."""


def matrix(root: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """The any-writer-any-reader runs at world size 2, with checkpoints under `root`: the
    writers (model and Adam state after 3 steps), the readers (one more step) and a
    zero1 load driven by a scheduler built on the user's optimizer before engine.setup."""
    paths = {writer: str(root / writer) for writer in WRITERS}
    writers = [
        {"steps": 3, "checkpoint_out": paths[w], "strategy": w, **options, **ADAM}
        for w, options in WRITERS.items()
        if w != "single"
    ]
    readers = [
        {"steps": 1, "checkpoint_in": paths[w], "strategy": reader, **ADAM}
        for reader in ("ddp", "zero1", "zero3")
        for w in WRITERS
        if (w, reader) not in COVERED
    ]
    scheduled = {"steps": 2, "checkpoint_in": paths["zero1"], "scheduler": True, **ADAM}
    return writers, readers, {**scheduled, "strategy": "zero1"}


def two_process_runs(tied: list[dict[str, Any]], variants: list[dict[str, Any]]) -> Any:
    """The tied cases, then `variants` (`train`), in one process group."""
    found = [save_and_reload(close=False, **case) for case in tied]
    return found, train_variants(variants)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this file's checkpoints are written (single's matrix checkpoint first)."""
    made = tmp_path_factory.mktemp("habits")
    train(steps=3, checkpoint_out=str(made / "single"), strategy="single", **ADAM)
    return made


@pytest.fixture(scope="module")
def two_processes(root: Path) -> tuple[list[dict | None], list[dict]]:
    """Both tests' runs at world size 2 in one job: the tied cases' results and the
    parameters after each of the matrix's runs, on the main rank."""
    writers, readers, scheduled = matrix(root)
    _, tied = tied_cases(root)
    return run_ranks(two_process_runs, 2, tied, [*writers, *readers, scheduled], timeout=280)[0]


@pytest.mark.timeout(300)
def test_a_checkpoint_from_any_writer_loads_into_any_reader(
    root: Path, two_processes: tuple[list[dict | None], list[dict]]
) -> None:
    """Model and Adam state after 3 steps, loaded under ddp, zero1, zero3 (and single):
    one more step equals the 4th step of an uninterrupted single run."""
    writers, readers, scheduled = matrix(root)
    *loaded, zero1_scheduled = two_processes[1][len(writers) :]
    expected = train(steps=4, strategy="single", **ADAM)
    readers.append({"steps": 1, "checkpoint_in": str(root / "ddp"), "strategy": "single", **ADAM})
    loaded.append(train(**readers[-1]))
    for reader, params in zip(readers, loaded, strict=True):
        label = f"{Path(reader['checkpoint_in']).name} into {reader['strategy']}"
        assert_close(params, expected, msg=lambda m, label=label: f"{label}: {m}")
    # A scheduler built on the user's optimizer before engine.setup still drives the
    # learning rate zero1 trains with after a load.
    assert_close(zero1_scheduled, train(**{**scheduled, "strategy": "single"}))


class Block(nn.Module):
    """A pre-norm MLP block, named as nanoGPT names its MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c_proj(F.gelu(self.c_fc(self.ln(x))))


class NanoGPT(nn.Module):
    """nanoGPT's layout and weight tying, without attention (the tie is what matters)."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, context: int = 16) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, dim),
                "wpe": nn.Embedding(context, dim),
                "h": nn.ModuleList(Block(dim) for _ in range(layers)),
                "ln_f": nn.LayerNorm(dim),
            }
        )
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))

    def tensor_parallel_plan(self, degree: int) -> dict[str, str]:
        return {"transformer.h.*.c_fc": "colwise", "transformer.h.*.c_proj": "rowwise"}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tied_model(kind: str) -> nn.Module:
    """A tiny GPT-2 built from its config (tie_word_embeddings), or the nanoGPT."""
    if kind == "gpt2":
        return build_hf("gpt2")
    torch.manual_seed(0)
    return NanoGPT()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with an eps above rounding noise: GPT-2's key bias has a zero gradient up to
    rounding (softmax ignores it), which Adam with torch's eps 1e-8 would turn into steps
    of about lr in whichever direction the rounding of a strategy's reduction points."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)


def save_and_reload(kind: str, path: str, close: bool = True, **options: Any) -> dict | None:
    """Two AdamW steps, save to `path`, a third step; then load `path` and take the third
    step again. On the main rank: the state saved, after the third step and after it
    again, and whether the tie held through the load; None elsewhere."""
    engine = dtrain.init(seed=0, **options)
    model = tied_model(kind)
    model, optimizer = engine.setup(model, adamw(model))
    if kind == "gpt2":
        data, loss_fn = Tokens("gpt2"), None  # dict batches; the model's own loss
    else:
        ids = torch.randint(0, 64, (24, 16), generator=torch.Generator().manual_seed(0))
        data, loss_fn = TensorDataset(ids, ids.roll(-1, dims=1)), lm_loss
    loader = engine.dataloader(data, global_batch_size=4, shuffle=False)
    first, second, third = itertools.islice(loader, 3)
    engine.train_step(first, loss_fn)
    engine.train_step(second, loss_fn)
    engine.save(path)
    saved = engine.state_dict()
    engine.train_step(third, loss_fn)
    continued = engine.state_dict()
    engine.load(path)
    unwrapped = engine.module
    tied = unwrapped.lm_head.weight is unwrapped.transformer.wte.weight
    engine.train_step(third, loss_fn)
    del model, optimizer, unwrapped
    resumed = finish(engine, close)
    if saved is None:
        return None
    return {"saved": saved, "continued": continued, "resumed": resumed, "tied": tied}


def save_and_reload_all(cases: list[dict[str, Any]]) -> list[dict | None]:
    """Several `save_and_reload` runs one after the other in this process group."""
    last = len(cases) - 1
    return [save_and_reload(close=i == last, **case) for i, case in enumerate(cases)]


def fresh(kind: str) -> tuple[dtrain.Engine, nn.Module]:
    engine = dtrain.init(strategy="single")
    model = tied_model(kind)
    model, _ = engine.setup(model, adamw(model))
    return engine, model


def check_files(kind: str, path: Path, saved: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """The checkpoint at `path` holds every name, equal where tied; plain safetensors +
    load_state_dict loads it (a sharded one once converted); the optimizer state of the
    tied parameter is stored once; a single engine loads it back, tied."""
    model = tied_model(kind)
    unique = {name for name, _ in model.named_parameters()}
    if (path / "model.safetensors").exists():
        file = path / "model.safetensors"
        optimizer_state = torch.load(path / "optimizer.pt", weights_only=True)["state"]
        assert set(optimizer_state) == unique, path
    else:
        keys = read_metadata(path).state_dict_metadata
        assert any(k.startswith("optim.state.transformer.wte.weight.") for k in keys), path
        assert not any(k.startswith("optim.state.lm_head.") for k in keys), path
        file = tmp_path / f"{path.name}.safetensors"
        convert(path, file)
    tensors = safetensors.torch.load_file(file)
    assert set(tensors) == set(model.state_dict()), path
    assert_close(tensors["lm_head.weight"], tensors["transformer.wte.weight"], rtol=0, atol=0)
    model.load_state_dict(tensors)
    assert_close(model.state_dict(), saved, msg=lambda m: f"{path}: {m}")
    engine, loaded = fresh(kind)
    engine.load(path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert_close(loaded.state_dict(), saved, msg=lambda m: f"{path} into single: {m}")
    engine.close()


def tied_case(tmp_path: Path, kind: str, strategy: str, layout: str, **options: Any) -> dict:
    path = str(tmp_path / f"{kind}-{strategy}-{layout}")
    return {
        "kind": kind,
        "path": path,
        "strategy": strategy,
        "checkpoint_format": layout,
        **options,
    }


def tied_cases(root: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The tied-weights cases, one process and two, with checkpoints under `root`. Each
    strategy saves and loads in each layout at least once (zero2/zero3: the tied
    parameter stays in the root FSDP unit); GPT-2's Conv1D layers have no tensor-parallel
    plan, the nanoGPT's Linear ones do."""
    one_process = [
        tied_case(root, "gpt2", "single", "consolidated"),
        tied_case(root, "gpt2", "towers", "consolidated", towers=2),
        tied_case(root, "nano", "single", "sharded"),
        tied_case(root, "nano", "towers", "sharded", towers=2),
    ]
    two_processes = [
        tied_case(root, "gpt2", "ddp", "consolidated"),
        tied_case(root, "gpt2", "zero1", "sharded"),
        tied_case(root, "nano", "ddp", "sharded"),
        tied_case(root, "nano", "zero1", "consolidated"),
        tied_case(root, "nano", "tensor", "consolidated"),
        tied_case(root, "nano", "tensor", "sharded"),
        tied_case(root, "gpt2", "zero3", "consolidated"),
        tied_case(root, "nano", "zero2", "sharded"),
    ]
    return one_process, two_processes


@pytest.mark.timeout(300)
def test_tied_weights_are_saved_under_every_name_and_load_back_tied(
    root: Path, two_processes: tuple[list[dict | None], list[dict]]
) -> None:
    one_process, two = tied_cases(root)
    found = [save_and_reload(**case) for case in one_process] + two_processes[0]
    cases = one_process + two
    single = {
        case["kind"]: r
        for case, r in zip(cases, found, strict=True)
        if case["strategy"] == "single"
    }
    for case, result in zip(cases, found, strict=True):
        label = f"{case['kind']} under {case['strategy']}, {case['checkpoint_format']}"
        assert result is not None and result["tied"], label
        assert_close(result["resumed"], result["continued"], msg=lambda m, s=label: f"{s}: {m}")
        expected = single[case["kind"]]["continued"]
        assert_close(result["continued"], expected, msg=lambda m, s=label: f"{s}: {m}")
        check_files(case["kind"], Path(case["path"]), result["saved"], root)


def test_a_plain_file_of_a_tied_model_converts_both_ways(tmp_path: Path) -> None:
    """``torch.save(model.state_dict())`` keeps the tie (one storage, two names), which
    safetensors refuses; `dtrain ckpt convert` writes each name and loads back tied."""
    torch.manual_seed(1)
    state = NanoGPT().state_dict()
    torch.save(state, tmp_path / "nano.pt")
    for dst in ("plain.safetensors", "checkpoint"):
        convert(tmp_path / "nano.pt", tmp_path / dst)
    assert_close(safetensors.torch.load_file(tmp_path / "plain.safetensors"), state)
    engine, model = fresh("nano")
    engine.load(tmp_path / "checkpoint")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert_close(model.state_dict(), state)
    engine.close()
