"""Plain PyTorch files in and out: what `engine.load` and `dtrain ckpt convert` accept.

The seeds' pain: `nn.DataParallel` code saves ``model.module.state_dict()`` or the
wrapped ``model.state_dict()`` (``module.`` names), DDP code saves
``{'epoch', 'state_dict', 'optim_dict'}``, torch.compile adds ``_orig_mod.``; each loads
only the way it was saved. Here any of them is read (always with ``weights_only=True``:
no arbitrary object is unpickled), its model state found and renamed canonically.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from dtrain.checkpoint.format import unshared
from dtrain.checkpoint.names import canonical_state_dict
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
        return safetensors.torch.load_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} holds Python objects that dtrain will not unpickle, since unpickling can "
            f"run arbitrary code ({str(e).splitlines()[0]}). Re-save only tensors, e.g. "
            "torch.save(model.state_dict(), path), from code you trust."
        ) from None
    except (RuntimeError, EOFError) as e:
        raise CheckpointError(
            f"{path} cannot be read as a PyTorch file ({e}); it may be truncated or corrupt."
        ) from None


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
    """Export `tensors` as a plain state_dict: torch.save, or safetensors by suffix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if path.suffix == ".safetensors":
        safetensors.torch.save_file(unshared(tensors), tmp)
    else:
        torch.save(tensors, tmp)
    tmp.replace(path)
