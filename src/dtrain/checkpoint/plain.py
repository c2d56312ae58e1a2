"""Plain PyTorch files in and out: what `engine.load` and `dtrain ckpt convert` accept.

A long-standing pain: `nn.DataParallel` code saves ``model.module.state_dict()`` or the
wrapped ``model.state_dict()`` (``module.`` names), DDP code saves
``{'epoch', 'state_dict', 'optim_dict'}``, torch.compile adds ``_orig_mod.``; each loads
only the way it was saved. Here any of them is read (always with ``weights_only=True``:
no arbitrary object is unpickled), its model state found and renamed canonically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dtrain.checkpoint import safetensors_file
from dtrain.checkpoint.canonical import canonical_state_dict
from dtrain.checkpoint.disk import save_pt, stored_bytes, writing
from dtrain.checkpoint.format import load_pt
from dtrain.checkpoint.reading import reason
from dtrain.errors import CheckpointError

# Where training scripts commonly keep the model state inside a saved dict, in the order
# they are tried.
MODEL_KEYS = (
    "state_dict",
    "model_state_dict",
    "state_dict_model",
    "model",
    "module",
    "net",
    "network",
    "weights",
    "params",
)


def _is_state_dict(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )


def read_file(path: Path) -> Any:
    """The contents of a ``.pt``/``.pth``/``.bin`` (torch.save) or ``.safetensors`` file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; pass a checkpoint directory or file.")
    if path.suffix == ".safetensors":
        try:
            return safetensors_file.load(path)
        except Exception as e:  # noqa: BLE001 - safetensors and its header fail in many ways
            raise CheckpointError(
                f"{path} cannot be read as a safetensors file ({reason(e)}); it is truncated or "
                "corrupt, or another format under a .safetensors name (a torch.save file "
                "takes .pt)."
            ) from None
    return load_pt(
        path,
        "Re-save only tensors, e.g. torch.save(model.state_dict(), path), from code you trust.",
    )


def find_model_state(content: Any, path: Path) -> dict[str, torch.Tensor]:
    """The model state inside `content` (read from `path`), under canonical names."""
    if _is_state_dict(content):
        return canonical_state_dict(content)  # type: ignore[return-value]
    if isinstance(content, dict):
        for key in MODEL_KEYS:
            if _is_state_dict(content.get(key)):
                return canonical_state_dict(content[key])  # type: ignore[return-value]
        nested = [v for v in content.values() if _is_state_dict(v)]
        if len(nested) == 1:
            return canonical_state_dict(nested[0])  # type: ignore[return-value]
        keys = ", ".join(repr(k) for k in list(content)[:10])
        raise CheckpointError(
            f"{path} is a dict without a recognisable model state (keys: {keys}); dtrain looks "
            f"for a dict of tensors at the top or under one of {', '.join(MODEL_KEYS)}. "
            "Save the model's state_dict under one of those keys."
        )
    raise CheckpointError(
        f"{path} holds a {type(content).__name__}, not a state dict; save model.state_dict()."
    )


def read_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The canonical model state of a plain PyTorch or safetensors file."""
    return find_model_state(read_file(path), Path(path))


def write_plain(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Export `tensors` as a plain state_dict: torch.save, or safetensors by suffix; a
    CheckpointError saying what to do if the disk refuses it (`disk.writing`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path, stored_bytes(tensors)):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.suffix == ".safetensors":
                safetensors_file.save(tensors, tmp)
            else:
                save_pt(tensors, tmp)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
