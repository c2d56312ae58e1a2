"""A Hugging Face model folder written from a state dict: what ``dtrain ckpt convert
--to hf`` writes and ``from_pretrained`` of transformers reads.

The layout is the one transformers writes itself: ``config.json``, the tensors in one
``model.safetensors`` or, past the shard size, in ``model-0000i-of-0000N.safetensors``
files that ``model.safetensors.index.json`` maps each name to. The folder is written
beside its destination and renamed into place, as dtrain's checkpoints are.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtrain.checkpoint import safetensors_file
from dtrain.checkpoint.atomic import atomic_directory, commit, temporary_beside
from dtrain.checkpoint.disk import stored_bytes, writing
from dtrain.checkpoint.format import MANIFEST
from dtrain.checkpoint.hf_folder import CONFIG, WEIGHTS, WEIGHTS_INDEX, tied_names
from dtrain.checkpoint.shared import decided_by_main
from dtrain.errors import CheckpointError, ConfigError
from dtrain.process.collectives import gather_objects
from dtrain.process.logs import LOGGER

if TYPE_CHECKING:
    from dtrain.checkpoint.holder import StateHolder

SLICES = "sharded"
"""The folder where torch.distributed.checkpoint's Hugging Face writer puts each rank's
slices before they are joined."""
DEFAULT_SHARD_BYTES = 5 * 2**30
"""The shard size transformers' ``save_pretrained`` uses by default (5 GiB)."""
# transformers writes this metadata in every file, and its loader checks for it.
_METADATA = {"format": "pt"}
# A subclass (a DTensor, a fake tensor) holds a part of the tensor or no values at all.
_WHOLE = (torch.Tensor, nn.Parameter)


def write_hf_folder(
    tensors: dict[str, torch.Tensor],
    dest: Path,
    config: dict[str, Any] | None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[str]:
    """Write `tensors` as the Hugging Face model folder `dest`, atomically: the folder
    appears whole, replacing a previous model folder there, or not at all.

    Args:
        tensors: the model's state dict, under the names the transformers class uses.
        dest: the folder to write; it may exist only as a Hugging Face model folder (or
            an empty folder), since it is replaced whole.
        config: the model's configuration, written as ``config.json`` (None: no such
            file, and ``from_pretrained`` then needs the config given separately).
        max_shard_bytes: the most tensor bytes one safetensors file holds (a tensor
            larger than that has a file of its own).

    Returns:
        The names left out as tied copies: a tensor that is another one under a second
        name (an output layer tied to the input embedding) is stored once, under its
        first name, as transformers stores it; its loader ties the two again when the
        config says so (``tie_word_embeddings``).
    """
    dest = Path(dest)
    _check_dest(dest)
    if max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes is {max_shard_bytes}; give a positive size.")
    for name, tensor in tensors.items():
        _check_tensor(name, tensor)
    kept, tied = _untied(tensors)
    shards = _shards(kept, max_shard_bytes)
    files = [WEIGHTS] if len(shards) == 1 else _shard_names(len(shards))
    total = stored_bytes(kept)
    with writing(dest, total), atomic_directory(dest) as tmp:
        if config is not None:
            _write_json(tmp / CONFIG, config, sort_keys=True)
        for file, names in zip(files, shards, strict=True):
            # Moved to the CPU one shard at a time: a model on a GPU is never copied whole.
            shard = {name: kept[name].detach().cpu().contiguous() for name in names}
            safetensors_file.save(shard, tmp / file, metadata=_METADATA)
        if len(shards) > 1:
            weight_map = {
                name: file for file, names in zip(files, shards, strict=True) for name in names
            }
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            _write_json(tmp / WEIGHTS_INDEX, index)
    return tied


def save_folder(holder: StateHolder, dest: Path, model: nn.Module, main: bool) -> list[str]:
    """Write the holder's whole model as the Hugging Face folder `dest`, with the
    ``config`` of `model` (the user's) as config.json when it has one; collective over
    the checkpoint group, every rank raising the error if the write fails. DTensor
    parameters are written as slices by every rank (`_save_slices`); other models go to
    the main rank (`full_state`), which writes them. A tied weight is written once, under
    its first name; returns the names left out."""
    config = getattr(model, "config", None)
    as_dict = config.to_dict() if hasattr(config, "to_dict") else None
    aliases: dict[str, str] = {}
    for part in gather_objects(tied_names(holder.unwrap()), holder.checkpoint_group):
        aliases.update(part)
    if any(isinstance(p, DTensor) for p in holder.unwrap().parameters()):
        return _save_slices(holder, dest, as_dict, aliases, main)
    tensors, _ = holder.full_state(None)

    def write() -> list[str]:
        assert tensors is not None
        kept = {k: v for k, v in tensors.items() if k not in aliases}
        write_hf_folder(kept, dest, as_dict)
        LOGGER.info("wrote the Hugging Face model folder %s", dest)
        return sorted(set(tensors) - set(kept))

    return decided_by_main(write, holder.checkpoint_group, main)


def _save_slices(
    holder: StateHolder,
    dest: Path,
    config: dict[str, Any] | None,
    aliases: dict[str, str],
    main: bool,
) -> list[str]:
    """`save_folder` where the parameters are DTensors: every rank writes its own slices
    (torch.distributed.checkpoint's Hugging Face writer), which the main rank then joins
    file by file from disk into whole tensors (never the whole model in memory); the
    slices are removed and the folder renamed into place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    group = holder.checkpoint_group
    state = get_model_state_dict(holder.unwrap())
    kept = {k: v for k, v in state.items() if k not in aliases}

    def begin() -> Path:
        _check_dest(dest)
        return temporary_beside(dest)

    tmp = decided_by_main(begin, group, main)
    mapping = {
        name: i for i, names in enumerate(_shards(kept, DEFAULT_SHARD_BYTES), 1) for name in names
    }
    try:
        with writing(dest, stored_bytes(kept)):
            dcp.save(
                kept,
                storage_writer=HuggingFaceStorageWriter(
                    str(tmp),
                    fqn_to_index_mapping=mapping,
                    save_distributed=True,
                    enable_consolidation=True,
                ),
                process_group=group,
            )

        def finish() -> None:
            shutil.rmtree(tmp / SLICES)
            if config is not None:
                _write_json(tmp / CONFIG, config, sort_keys=True)
            commit(tmp, dest)
            LOGGER.info("wrote the Hugging Face model folder %s", dest)

        decided_by_main(finish, group, main)
    finally:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
    return sorted(set(state) - set(kept))


def _check_dest(dest: Path) -> None:
    """Refuse a `dest` that writing would destroy: a file, or a folder that holds more
    than a Hugging Face model (a dtrain checkpoint, a run's output) and would be lost."""
    if dest.exists() and not dest.is_dir():
        raise CheckpointError(
            f"{dest} is a file, and a Hugging Face model is written as a folder; give the "
            "path of a new folder (or of a model folder to replace)."
        )
    names = {path.name for path in dest.iterdir()} if dest.is_dir() else set()
    model_folder = bool(names & {CONFIG, WEIGHTS, WEIGHTS_INDEX}) and MANIFEST not in names
    if names and not model_folder:
        raise CheckpointError(
            f"{dest} is a folder that is not a Hugging Face model, and writing one there "
            "replaces the folder whole; give the path of a new folder, or empty this one first."
        )


def _check_tensor(name: str, tensor: torch.Tensor) -> None:
    """Refuse what a safetensors file of a transformers model cannot hold."""
    if type(tensor) not in _WHOLE:
        raise CheckpointError(
            f"{name} is a {type(tensor).__name__}, not a whole torch.Tensor, so it cannot be "
            "written to a Hugging Face folder. Pass the whole model's state (engine.state_dict() "
            "gathers a sharded model)."
        )
    if tensor.device.type == "meta":
        raise CheckpointError(
            f"{name} is on the meta device and holds no values; load or initialise the "
            "model's weights before writing it."
        )
    if tensor.is_complex() or tensor.is_quantized:
        raise CheckpointError(
            f"{name} is {tensor.dtype}, which Hugging Face model folders do not hold; give "
            "it a floating-point or integer dtype, or leave it out."
        )


def _untied(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """`tensors` with each tied copy (the same memory seen as the same tensor) left out,
    and the names left out."""
    seen: set[tuple[object, ...]] = set()
    kept, tied = {}, []
    for name, tensor in tensors.items():
        # Empty tensors all sit at one address without sharing anything.
        key = (tensor.device, tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
        if tensor.numel() and key in seen:
            tied.append(name)
            continue
        seen.add(key)
        kept[name] = tensor
    return kept, tied


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """The names of `tensors`, in name order, cut into runs of at most `limit` bytes."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = stored_bytes(tensors[name])
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _shard_names(count: int) -> list[str]:
    """The file names transformers gives `count` shards."""
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _write_json(file: Path, value: dict[str, Any], sort_keys: bool = False) -> None:
    file.write_text(json.dumps(value, indent=2, sort_keys=sort_keys) + "\n")
