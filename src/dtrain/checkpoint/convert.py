"""`dtrain ckpt convert`: plain PyTorch files to checkpoint directories and back, and
sharded checkpoints to the consolidated layout, offline, in one process."""

from __future__ import annotations

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
from dtrain.checkpoint.plain import find_model_state, read_file, write_plain
from dtrain.checkpoint.rank_states import gathered
from dtrain.checkpoint.sharded_load import read_whole
from dtrain.checkpoint.verify import verify
from dtrain.errors import CheckpointError

PLAIN_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
# Manifest fields that describe the files, rewritten for the converted checkpoint.
_FILE_FIELDS = ("format", "num_parameters", "tensors", "created", "torch_version", "files")


def convert(src: Path, dst: Path) -> str:
    """Convert between a plain state_dict file and a checkpoint directory, or a sharded
    checkpoint to a consolidated one; say what was done.

    A plain file becomes a checkpoint holding its model state (no optimizer or data
    position: the file has none that could be matched to names); a checkpoint becomes a
    plain state_dict of its model, loadable with ``model.load_state_dict(torch.load(f))``;
    a sharded checkpoint and a DST without a file suffix give a consolidated checkpoint
    with the same model, optimizer state and trainer state.
    """
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        return _from_plain(src, dst)
    manifest = read_manifest(src)  # a clear error if it is not a checkpoint
    problems = verify(src)
    if problems:
        raise CheckpointError(
            f"{src} is damaged ({'; '.join(problems)}); nothing was converted. Convert an "
            "intact copy or an older checkpoint."
        )
    if dst.suffix in PLAIN_SUFFIXES:
        if is_sharded(manifest):
            tensors, _ = read_whole(src, None)
        else:
            tensors = read_model(src)
        write_plain(dst, tensors)
        return f"Wrote {len(tensors)} tensors of {src} to {dst} as a plain state_dict."
    if not is_sharded(manifest):
        raise CheckpointError(
            f"{src} is already a consolidated checkpoint, so converting it writes a plain "
            f"file; give DST a name ending in one of {', '.join(PLAIN_SUFFIXES)}."
        )
    return _consolidate(src, dst, manifest)


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
