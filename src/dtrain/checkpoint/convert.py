"""`dtrain ckpt convert`: plain PyTorch files to checkpoint directories and back, and
sharded checkpoints to the consolidated layout, offline, in one process."""

from __future__ import annotations

from pathlib import Path

from dtrain.checkpoint.format import (
    TRAINER_FILE,
    is_sharded,
    read_manifest,
    read_model,
    read_pt,
    write,
)
from dtrain.checkpoint.plain import read_model_state, write_plain
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
    tensors = read_model_state(src)
    if dst.suffix in PLAIN_SUFFIXES:
        write_plain(dst, tensors)
        return f"Wrote {len(tensors)} tensors of {src} to {dst} under canonical names."
    info = {
        "step": 0,
        "epoch": 0,
        "strategy": "imported",
        "world_size": 1,
        "source": str(src),
        "model_class": None,
        "optimizer": None,
    }
    write(dst, tensors, None, {"step": 0, "epoch": 0, "samples_in_epoch": 0}, info)
    return f"Wrote {len(tensors)} tensors of {src} to the checkpoint {dst}."
