"""Hugging Face model folders written from a state dict or a dtrain checkpoint
(`dtrain ckpt convert SRC DST --to hf`): transformers' from_pretrained reads back every
tensor exactly, tied weights tied; bad input is refused with what to do, and a failed
write leaves nothing behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from conftest import run_ckpt  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import dtrain  # noqa: E402
from dtrain.checkpoint.convert import convert  # noqa: E402
from dtrain.checkpoint.hf_folder import CONFIG, WEIGHTS, WEIGHTS_INDEX  # noqa: E402
from dtrain.checkpoint.hf_write import write_hf_folder  # noqa: E402
from dtrain.errors import CheckpointError, ConfigError  # noqa: E402

hf_logging.set_verbosity_error()

SMALL_SHARDS = 20_000
"""Bytes per file that cut the tiny Llama (about 120 kB) into several files."""


def tiny_llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).eval()


def assert_same(loaded: torch.nn.Module, model: torch.nn.Module) -> None:
    """Every tensor of `loaded` equals `model`'s, bit for bit."""
    got, expected = loaded.state_dict(), model.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def is_tied(model: LlamaForCausalLM) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, LlamaForCausalLM]:
    """(dtrain checkpoints of a tiny tied Llama under consolidated/ and sharded/, its
    config.json, the model)."""
    where = tmp_path_factory.mktemp("saved")
    model = tiny_llama(tied=True)
    for layout in ("consolidated", "sharded"):
        engine = dtrain.init(strategy="single", cpu=True, checkpoint_format=layout)
        engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        engine.save(where / layout)
        engine.close()
    assert "sharded" in json.loads((where / "sharded" / "manifest.json").read_text())["format"]
    (where / CONFIG).write_text(model.config.to_json_string())
    return where / "consolidated", where / CONFIG, model


@pytest.mark.parametrize("tied", [True, False])
def test_a_sharded_folder_loads_every_tensor_exactly(tmp_path: Path, tied: bool) -> None:
    model = tiny_llama(tied)
    state = model.state_dict()
    folder = tmp_path / "hf"
    left_out = write_hf_folder(state, folder, model.config.to_dict(), SMALL_SHARDS)
    # HF stores a tied output layer once, under the embedding's name, as it does itself.
    assert left_out == (["lm_head.weight"] if tied else [])
    index = json.loads((folder / WEIGHTS_INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in folder.iterdir()) == sorted([*files, WEIGHTS_INDEX, CONFIG])
    assert list(index["weight_map"]) == sorted(n for n in state if n not in left_out)
    stored = [t for n, t in state.items() if n not in left_out]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored)
    loaded, info = LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_same(loaded, model)
    assert is_tied(loaded) == tied


def test_one_file_when_it_fits_as_transformers_writes_it(tmp_path: Path) -> None:
    tensors = {"b": torch.arange(6.0).reshape(2, 3).t(), "a": torch.ones(2, dtype=torch.int64)}
    assert write_hf_folder(tensors, tmp_path / "hf", None) == []
    assert [p.name for p in (tmp_path / "hf").iterdir()] == [WEIGHTS]
    with safe_open(str(tmp_path / "hf" / WEIGHTS), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert torch.equal(f.get_tensor("b"), tensors["b"])  # a transposed view, stored whole


@pytest.mark.parametrize("layout", ["consolidated", "sharded"])
def test_a_dtrain_checkpoint_converts_to_what_from_pretrained_reads(
    tmp_path: Path, checkpoint: tuple[Path, Path, LlamaForCausalLM], layout: str
) -> None:
    ckpt, config, model = checkpoint
    said = convert(ckpt.with_name(layout), tmp_path / "hf", to="hf", config=config)
    assert f"to the Hugging Face folder {tmp_path / 'hf'}" in said and "config.json" in said
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert_same(loaded, model)
    assert is_tied(loaded)


def test_the_command_line_writes_the_folder_and_says_when_the_config_is_missing(
    tmp_path: Path, checkpoint: tuple[Path, Path, LlamaForCausalLM]
) -> None:
    ckpt, config, model = checkpoint
    done = run_ckpt(
        "convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf", "--config", str(config)
    )
    assert done.returncode == 0, done.stderr
    assert_same(LlamaForCausalLM.from_pretrained(tmp_path / "hf"), model)
    bare = run_ckpt("convert", str(ckpt), str(tmp_path / "bare"), "--to", "hf")
    assert bare.returncode == 0 and "--config FILE" in bare.stdout
    assert not (tmp_path / "bare" / CONFIG).exists()


def test_bad_destinations_tensors_and_configs_say_what_to_do(
    tmp_path: Path, checkpoint: tuple[Path, Path, LlamaForCausalLM]
) -> None:
    ckpt, config, _ = checkpoint
    file = tmp_path / "taken"
    file.write_text("a file")
    refused = run_ckpt("convert", str(ckpt), str(file), "--to", "hf", "--config", str(config))
    assert refused.returncode == 1
    assert "is a file, and a Hugging Face model is written as a folder; give" in refused.stderr
    # A checkpoint is no model folder: writing over it would lose its optimizer state.
    with pytest.raises(CheckpointError, match="is not a Hugging Face model.*give the path"):
        convert(ckpt, ckpt, to="hf", config=config)
    bad = tmp_path / "config.json"
    bad.write_text("{'vocab_size': 64}")
    not_json = run_ckpt(
        "convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf", "--config", str(bad)
    )
    assert not_json.returncode == 2 and "is not JSON" in not_json.stderr
    assert "give the model's config.json" in not_json.stderr
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not an object; give the model's config.json"):
        convert(ckpt, tmp_path / "hf", to="hf", config=bad)
    for tensor in (torch.zeros(2, dtype=torch.complex64), torch.zeros(2, device="meta")):
        with pytest.raises(CheckpointError, match="; (give|load)"):
            write_hf_folder({"w": tensor}, tmp_path / "hf", None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "taken"]


def test_an_interrupted_write_leaves_no_folder_or_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_llama(tied=False)
    state = model.state_dict()
    before = tmp_path / "before"
    write_hf_folder(state, before, model.config.to_dict(), SMALL_SHARDS)
    index = (before / WEIGHTS_INDEX).read_text()
    written = safetensors.torch.save_file
    calls = []

    def fail_midway(*args: object, **kwargs: object) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise OSError("disk full")
        written(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(safetensors.torch, "save_file", fail_midway)
    for dest in (tmp_path / "new", before):
        calls.clear()
        with pytest.raises(CheckpointError, match="could not be written: disk full"):
            write_hf_folder({k: v + 1 for k, v in state.items()}, dest, None, SMALL_SHARDS)
    assert [p.name for p in tmp_path.iterdir()] == ["before"]
    assert (before / WEIGHTS_INDEX).read_text() == index
    assert_same(LlamaForCausalLM.from_pretrained(before), model)
