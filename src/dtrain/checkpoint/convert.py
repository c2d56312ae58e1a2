"""`dtrain ckpt convert`: plain PyTorch files to checkpoint directories and back."""

from __future__ import annotations

from pathlib import Path

from dtrain.checkpoint.format import read_manifest, read_model, write
from dtrain.checkpoint.plain import read_model_state, write_plain
from dtrain.errors import CheckpointError

PLAIN_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def convert(src: Path, dst: Path) -> str:
    """Convert between a plain state_dict file and a checkpoint directory; say what was done.

    A plain file becomes a checkpoint holding its model state (no optimizer or data
    position: the file has none that could be matched to names); a checkpoint becomes a
    plain state_dict of its model, loadable with ``model.load_state_dict(torch.load(f))``.
    """
    src, dst = Path(src), Path(dst)
    if src.is_dir():
        read_manifest(src)  # a clear error if it is not a checkpoint
        if dst.suffix not in PLAIN_SUFFIXES:
            raise CheckpointError(
                f"Converting the checkpoint {src} writes a plain file; give DST a name ending "
                f"in one of {', '.join(PLAIN_SUFFIXES)}."
            )
        tensors = read_model(src)
        write_plain(dst, tensors)
        return f"Wrote {len(tensors)} tensors of {src} to {dst} as a plain state_dict."
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
