"""Hugging Face model folders loaded straight into the model a strategy placed: every
strategy fine-tunes from the folder to `single`'s parameters, each rank reading what it
holds; a folder that does not fit, or is damaged, loads nothing and says why."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_ranks
from safetensors import safe_open
from third_party import GLOBAL_BATCH, CausalTokens, hf_lm
from torch.testing import assert_close
from training import CLOSE
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

import dtrain
from dtrain.checkpoint.hf_folder import WEIGHTS_INDEX
from dtrain.checkpoint.hf_write import write_hf_folder
from dtrain.errors import CheckpointError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 4
LAYOUTS: list[dict[str, Any]] = [
    {"strategy": "ddp"},
    {"strategy": "zero3", "empty": True},
    {"strategy": "tensor"},
    {"strategy": "pipeline"},
    # Qwen2's output layer is its embedding: stored once, read and written as slices.
    {"strategy": "zero3", "empty": True, "kind": "qwen2"},
    {"strategy": "tensor", "kind": "qwen2"},
]
CLASSES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}


def pretrained(tmp_path: Path, kind: str = "llama") -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny `kind` saved by `save_pretrained` in several shards, and its tensors."""
    torch.manual_seed(1)
    model = hf_lm(kind)
    folder = tmp_path / kind
    model.save_pretrained(folder, max_shard_size="40KB")
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


def saved_as(layout: dict[str, Any]) -> str:
    """The folder name `fine_tune` saves `layout`'s model under."""
    return f"{layout.get('kind', 'llama')}-{layout['strategy']}"


def fine_tune(root: Path, layout: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The parameters after STEPS AdamW steps from the folder of `layout`'s kind (Llama
    by default) under `root`, also saved with `save_pretrained` under `root`."""
    kind = layout.get("kind", "llama")
    options = {k: v for k, v in layout.items() if k not in ("empty", "kind")}
    engine = dtrain.init(seed=0, **options)
    torch.manual_seed(2)  # another random init: only the load can make the runs agree
    if layout.get("empty"):  # built without memory: the folder's values are never drawn
        with engine.init_empty():
            model = hf_lm(kind)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = engine.setup(model, optimizer, pretrained=root / kind)
    else:
        model = hf_lm(kind)
        model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        engine.load(root / kind)
    for batch in engine.dataloader(CausalTokens(), global_batch_size=GLOBAL_BATCH):
        engine.train_step(batch)
        if engine.step == STEPS:
            break
    params = engine.state_dict()
    engine.save_pretrained(root / saved_as(layout))
    engine.close()
    return params


def fine_tune_each(root: Path, layouts: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    return [fine_tune(root, layout) for layout in layouts]


def test_a_sharded_folder_loads_under_single_and_saves_back_tied(tmp_path: Path) -> None:
    for kind in ("llama", "qwen2"):  # qwen2's output layer is its embedding, stored once
        folder, tensors = pretrained(tmp_path, kind)
        assert len(json.loads((folder / WEIGHTS_INDEX).read_text())["weight_map"]) > 1
        engine = dtrain.init(strategy="single", cpu=True)
        torch.manual_seed(2)
        model, _ = engine.setup(hf_lm(kind))
        manifest = engine.load(folder)
        assert manifest["format"] == "huggingface"
        assert_close(dict(model.state_dict()), tensors, rtol=0, atol=0)
        engine.save_pretrained(tmp_path / f"{kind}-saved")
        engine.close()
        with safe_open(tmp_path / f"{kind}-saved" / "model.safetensors", "pt") as f:
            stored = set(f.keys())  # noqa: SIM118 - safe_open is no container
        assert ("lm_head.weight" in stored) == (kind == "llama")  # tied: stored once
        cls = LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM
        reread = cls.from_pretrained(tmp_path / f"{kind}-saved").state_dict()
        assert_close(dict(reread), tensors, rtol=0, atol=0)


def test_a_model_built_empty_draws_nothing_the_folder_holds(tmp_path: Path) -> None:
    for kind in CLASSES:
        folder, tensors = pretrained(tmp_path, kind)
        reference = CLASSES[kind].from_pretrained(folder)
        engine = dtrain.init(strategy="single", cpu=True)
        torch.manual_seed(2)
        drawn_from = torch.get_rng_state()
        with engine.init_empty():
            model = hf_lm(kind)
        model, _ = engine.setup(model, pretrained=folder)
        # No random value drawn for the weights; the rotary tables no file holds computed.
        assert torch.equal(torch.get_rng_state(), drawn_from)
        assert_close(dict(model.state_dict()), tensors, rtol=0, atol=0)
        buffers = dict(model.named_buffers())
        assert any("inv_freq" in name for name in buffers)
        assert_close(buffers, dict(reference.named_buffers()), rtol=0, atol=0)
        engine.close()
    engine = dtrain.init(strategy="single", cpu=True)
    with engine.init_empty():
        model = hf_lm("llama")
    with pytest.raises(CheckpointError, match=r"takes a Hugging Face model folder"):
        engine.setup(model, pretrained=tmp_path)


class Scaled(torch.nn.Module):
    """A model whose init_weights reads a weight the folder holds into a buffer no file
    holds: setup cannot leave that weight undrawn, and replays the whole build."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("first_row", torch.empty(4), persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        torch.nn.init.normal_(self.linear.weight)
        self.first_row.copy_(self.linear.weight[0])


def test_a_build_that_reads_what_the_folder_holds_is_replayed_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(3)
    write_hf_folder(Scaled().state_dict(), tmp_path / "scaled", {"architectures": ["Scaled"]})
    results = []
    for pretrained_at_setup in (True, False):
        engine = dtrain.init(strategy="single", cpu=True)
        torch.manual_seed(4)
        with engine.init_empty():
            model = Scaled()
        if pretrained_at_setup:
            with caplog.at_level(logging.INFO, logger="dtrain"):
                model, _ = engine.setup(model, pretrained=tmp_path / "scaled")
            assert "replays its whole build instead" in caplog.text
        else:
            model, _ = engine.setup(model)
            engine.load(tmp_path / "scaled")
        results.append({**dict(model.named_buffers()), **model.state_dict()})
        engine.close()
    assert_close(results[0], results[1], rtol=0, atol=0)  # what setup then load gives


@pytest.mark.timeout(400)
def test_every_strategy_fine_tunes_from_the_folder_as_single_does(tmp_path: Path) -> None:
    for kind in CLASSES:
        pretrained(tmp_path, kind)
    singles = [{"strategy": "single", "kind": kind} for kind in CLASSES]
    expected = dict(zip(CLASSES, fine_tune_each(tmp_path, singles), strict=True))
    results = run_ranks(fine_tune_each, 2, tmp_path, LAYOUTS, timeout=380)
    for layout, got in zip([*singles, *LAYOUTS], [*expected.values(), *results[0]], strict=True):
        kind = layout.get("kind", "llama")
        assert_close(got, expected[kind], **CLOSE, msg=lambda m, o=layout: f"{o}: {m}")
        saved = tmp_path / saved_as(layout)
        # DTensor layouts write their slices, joined from disk: the joined files have an index.
        sliced = layout["strategy"] in ("zero3", "tensor")
        assert (saved / WEIGHTS_INDEX).is_file() == sliced
        assert sorted(p.name for p in saved.iterdir() if not p.name.endswith(".safetensors")) == [
            "config.json",
            *([WEIGHTS_INDEX] if sliced else []),
        ]
        stored: set[str] = set()
        for file in saved.glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                stored |= set(f.keys())  # noqa: SIM118 - safe_open is no container
        assert ("lm_head.weight" in stored) == (kind == "llama")  # a tied head: stored once
        reread = CLASSES[kind].from_pretrained(saved).state_dict()
        assert_close(dict(reread), got, rtol=0, atol=0, msg=lambda m, o=layout: f"{o}: {m}")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no write left over


def test_a_folder_that_does_not_fit_loads_nothing(tmp_path: Path) -> None:
    folder, _ = pretrained(tmp_path)
    engine = dtrain.init(strategy="single", cpu=True)
    model, _ = engine.setup(hf_lm("qwen2"))  # another class: config.json says Llama
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"is for LlamaForCausalLM, not this model"):
        engine.load(folder)
    assert_close(dict(model.state_dict()), before, rtol=0, atol=0)
    engine.close()

    engine = dtrain.init(strategy="single", cpu=True)
    model, _ = engine.setup(hf_lm("llama").to(torch.float64))
    with pytest.raises(CheckpointError, match=r"other dtypes than the model's.*float32 in"):
        engine.load(folder)
    engine.close()


def test_a_damaged_folder_is_named(tmp_path: Path) -> None:
    folder, _ = pretrained(tmp_path)
    engine = dtrain.init(strategy="single", cpu=True)
    engine.setup(hf_lm("llama"))
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard.name} cannot be read .*truncated"):
        engine.load(folder)
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"names {shard.name}, which .* does not hold"):
        engine.load(folder)
    with pytest.raises(CheckpointError, match=r"nor a Hugging Face model folder"):
        engine.load(tmp_path)
    engine.close()
