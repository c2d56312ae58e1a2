"""`dtrain ckpt convert`: plain PyTorch files to checkpoint directories and back, sharded
checkpoints to the consolidated layout, and either to a Hugging Face model folder,
offline, in one process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dtrain.checkpoint.canonical import canonical_name
from dtrain.checkpoint.format import (
    TRAINER_FILE,
    is_sharded,
    read_manifest,
    read_model,
    read_pt,
    write,
)
from dtrain.checkpoint.hf_write import write_hf_folder
from dtrain.checkpoint.plain import find_model_state, read_file, read_model_state, write_plain
from dtrain.checkpoint.rank_states import gathered
from dtrain.checkpoint.sharded_load import read_whole
from dtrain.checkpoint.verify import verify
from dtrain.errors import CheckpointError, ConfigError

PLAIN_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
# Manifest fields that describe the files, rewritten for the converted checkpoint.
_FILE_FIELDS = ("format", "num_parameters", "tensors", "created", "torch_version", "files")


def convert(src: Path, dst: Path, to: str | None = None, config: Path | None = None) -> str:
    """Convert between a plain state_dict file and a checkpoint directory, a sharded
    checkpoint to a consolidated one, or either to a Hugging Face model folder; say what
    was done.

    A plain file becomes a checkpoint holding its model state (no optimizer or data
    position: the file has none that could be matched to names); a checkpoint becomes a
    plain state_dict of its model, loadable with ``model.load_state_dict(torch.load(f))``;
    a sharded checkpoint and a DST without a file suffix give a consolidated checkpoint
    with the same model, optimizer state and trainer state. With ``to="hf"``, the model
    of a checkpoint or plain file becomes the folder DST that transformers'
    ``from_pretrained`` reads, with the JSON file `config` as its ``config.json``.
    """
    src, dst = Path(src), Path(dst)
    if to not in (None, "hf"):
        raise ConfigError(
            f"convert has no target {to!r}; give to='hf' for a Hugging Face model folder, or "
            "leave it out for a checkpoint or a plain file."
        )
    if to == "hf":
        return _to_hf(src, dst, config)
    if config is not None:
        raise ConfigError(
            "--config gives the config.json of a Hugging Face folder; add --to hf, or drop it."
        )
    if not src.is_dir():
        return _from_plain(src, dst)
    manifest = _intact_manifest(src)
    if dst.suffix in PLAIN_SUFFIXES:
        tensors = _model_of(src, manifest)
        write_plain(dst, tensors)
        return f"Wrote {len(tensors)} tensors of {src} to {dst} as a plain state_dict."
    if not is_sharded(manifest):
        raise CheckpointError(
            f"{src} is already a consolidated checkpoint, so converting it writes a plain "
            f"file; give DST a name ending in one of {', '.join(PLAIN_SUFFIXES)}."
        )
    return _consolidate(src, dst, manifest)


def _intact_manifest(src: Path) -> dict[str, Any]:
    """The manifest of the checkpoint `src`, once every file of it matches."""
    manifest = read_manifest(src)  # a clear error if it is not a checkpoint
    problems = verify(src)
    if problems:
        raise CheckpointError(
            f"{src} is damaged ({'; '.join(problems)}); nothing was converted. Convert an "
            "intact copy or an older checkpoint."
        )
    return manifest


def _model_of(src: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The whole model of the checkpoint `src`, consolidated or sharded."""
    return read_whole(src, None)[0] if is_sharded(manifest) else read_model(src)


def _to_hf(src: Path, dst: Path, config_file: Path | None) -> str:
    """Write the model of the checkpoint or plain file `src` as the Hugging Face folder
    `dst`, with `config_file` as its config.json."""
    # Read before the model: a bad config file is refused at once, not after the reading.
    config = None if config_file is None else _read_json_object(Path(config_file))
    tensors = _model_of(src, _intact_manifest(src)) if src.is_dir() else read_model_state(src)
    tied = write_hf_folder(tensors, dst, config)
    said = f"Wrote {len(tensors) - len(tied)} tensors of {src} to the Hugging Face folder {dst}"
    if tied:
        said += f" ({', '.join(tied)} left out as tied copies of another tensor)"
    if config is None:
        return said + (
            " without a config.json, which from_pretrained needs; write it again with "
            "--config FILE, the config.json of the model (or add that file to the folder)."
        )
    return said + f", with {config_file} as its config.json."


def _read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in `file` (a model's config.json); a ConfigError saying what to do."""
    try:
        value = json.loads(file.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigError(
            f"The config file {file} cannot be read ({e.strerror}); give the path of the "
            "model's config.json."
        ) from None
    except ValueError as e:  # not UTF-8, or not JSON
        raise ConfigError(
            f"The config file {file} is not JSON ({e}); give the model's config.json, as "
            "save_pretrained writes it."
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            f"The config file {file} holds a JSON {type(value).__name__}, not an object; give "
            "the model's config.json, as save_pretrained writes it."
        )
    return value


def _consolidate(src: Path, dst: Path, manifest: dict) -> str:
    """Write the sharded checkpoint `src` as the consolidated checkpoint `dst`."""
    trainer = gathered(src, read_pt(src, TRAINER_FILE) or {})
    tensors, optimizer_state = read_whole(src, trainer.pop("optimizer_groups", None))
    info = {k: v for k, v in manifest.items() if k not in _FILE_FIELDS}
    write(dst, tensors, optimizer_state, trainer, {**info, "source": str(src)})
    held = "model, optimizer and trainer state" if optimizer_state else "model and trainer state"
    return f"Wrote the {held} of the sharded checkpoint {src} to the checkpoint {dst}."


def _from_plain(src: Path, dst: Path) -> str:
    content = read_file(src)
    tensors = find_model_state(content, src)
    if dst.suffix in PLAIN_SUFFIXES:
        write_plain(dst, tensors)
        return f"Wrote {len(tensors)} tensors of {src} to {dst} under canonical names."
    epoch = _epoch_of(content)
    info = {
        "step": 0,
        "epoch": epoch,
        "strategy": "imported",
        "world_size": 1,
        "source": str(src),
        "model_class": None,
        "optimizer": None,
    }
    write(dst, tensors, None, {"step": 0, "epoch": epoch, "samples_in_epoch": 0}, info)
    said = f"Wrote {len(tensors)} tensors of {src} to the checkpoint {dst}"
    if epoch:
        said += f", at epoch {epoch} (a resume starts that epoch from its first batch)"
    left = _left_behind(content, tensors)
    if left:
        said += f". Left behind: {', '.join(left)}"
        if any("optim" in name.lower() for name in left):
            said += (
                " (a plain file keys an optimizer's state by position, not by parameter name, "
                "so it cannot be placed: the optimizer starts afresh)"
            )
    return said + "."


def _epoch_of(content: Any) -> int:
    """The file's ``epoch`` (a non-negative int at the top of a saved dict), else 0. Loops
    written after PyTorch's ImageNet example save the epoch to start next (``'epoch':
    epoch + 1``, read back as ``start_epoch``), which is what a checkpoint's epoch means."""
    epoch = content.get("epoch") if isinstance(content, dict) else None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch > 0 else 0


def _left_behind(content: Any, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The entries of a saved dict that the converted checkpoint does not hold (all but
    the model state and the epoch)."""
    if not isinstance(content, dict) or all(isinstance(v, torch.Tensor) for v in content.values()):
        return []
    names = set(tensors)
    return [
        repr(key)
        for key, value in content.items()
        if key != "epoch"
        and not (isinstance(value, dict) and {canonical_name(str(n)) for n in value} == names)
    ]
