"""The consolidated checkpoint directory, and what both checkpoint formats share.

    manifest.json        format, step, epoch, strategy, world_size, files and checksums
    model.safetensors    the whole model under canonical names (loads without dtrain)
    optimizer.pt         optimizer state keyed by parameter name (tensors only)
    trainer.pt           data position and RNG state

Plain ``safetensors.torch.load_file`` + ``load_state_dict`` on the unwrapped model works
(but for complex128 tensors, which safetensors stores as their real view: safetensors_file).
Every ``.pt`` file is read with ``weights_only=True``: no arbitrary objects are unpickled.
A sharded checkpoint (`dtrain.checkpoint.sharded`) has the same manifest and trainer
state beside torch.distributed.checkpoint's files instead of the model and optimizer files.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain import advice
from dtrain.checkpoint import safetensors_file
from dtrain.checkpoint.atomic import atomic_directory, file_records
from dtrain.checkpoint.canonical import canonical_name, canonical_state_dict
from dtrain.checkpoint.disk import save_pt, stored_bytes, writing
from dtrain.checkpoint.lazy import LazyTensors
from dtrain.checkpoint.reading import reading, reason, refuses_objects
from dtrain.errors import CheckpointError, DtrainError

FORMAT = "dtrain.checkpoint/1"
SHARDED_FORMAT = "dtrain.sharded-checkpoint/1"
FORMATS = (FORMAT, SHARDED_FORMAT)
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_FILE = "trainer.pt"
INDEX = ".metadata"
"""DCP's index of the pieces each rank wrote (in a sharded checkpoint)."""


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict under canonical names, contiguous on the CPU.

    Tied tensors are stored once per name (cloned), so a plain `load_state_dict` of the
    file fills every name.
    """
    state = canonical_state_dict(model.state_dict())
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}  # type: ignore[union-attr]


def write(
    path: Path,
    tensors: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
    trainer: dict[str, Any],
    info: dict[str, Any],
) -> None:
    """Write a complete checkpoint directory at `path`, atomically; a CheckpointError
    saying what to do if the disk refuses it (`disk.writing`), with `path` as it was.

    Args:
        path: the checkpoint directory (replaced if it exists).
        tensors: the whole model under canonical names, on the CPU (:func:`model_tensors`).
        optimizer_state: name-keyed optimizer state (``optimizer_state.state_by_name``).
        trainer: data position and RNG state (tensors and plain values).
        info: manifest fields: at least step, epoch, strategy, world_size, model_class.
    """
    size = stored_bytes(tensors, optimizer_state, trainer)
    with writing(path, size), atomic_directory(Path(path)) as tmp:
        safetensors_file.save(tensors, tmp / MODEL_FILE, metadata={"format": FORMAT})
        if optimizer_state is not None:
            save_pt(optimizer_state, tmp / OPTIMIZER_FILE)
        save_pt(trainer, tmp / TRAINER_FILE)
        table = {k: (list(v.shape), v.dtype) for k, v in tensors.items()}
        files = file_records(tmp, sorted(f.name for f in tmp.iterdir()))
        write_manifest(tmp, FORMAT, info, table, files)


def write_manifest(
    directory: Path,
    kind: str,
    info: dict[str, Any],
    tensors: dict[str, tuple[list[int], torch.dtype]],
    files: dict[str, dict[str, object]],
) -> None:
    """Write `directory`'s manifest: format `kind`, the fields of `info`, the model's tensors
    (name -> (shape, dtype)) and the size and checksum of every other file."""
    manifest = {
        "format": kind,
        **info,
        "num_parameters": sum(math.prod(shape) for shape, _ in tensors.values()),
        "tensors": {
            k: {"shape": shape, "dtype": str(dtype).removeprefix("torch.")}
            for k, (shape, dtype) in tensors.items()
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_version": torch.__version__,
        "files": files,
    }
    (Path(directory) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`; a CheckpointError naming the file if it
    is not one, or if its manifest cannot be read or does not say what a manifest says."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{path} is not a dtrain checkpoint (no {MANIFEST}) nor a Hugging Face model "
            "folder (no config.json with model.safetensors or model.safetensors.index.json); "
            "pass a checkpoint directory or a model folder, or convert a plain PyTorch file "
            "with `dtrain ckpt convert SRC DST`."
        )
    try:
        manifest = json.loads(manifest_path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, or not JSON
        raise damaged_manifest(manifest_path, f"it cannot be read as JSON ({e})") from None
    kind = manifest.get("format") if isinstance(manifest, dict) else None
    if isinstance(kind, str) and kind not in FORMATS:
        raise CheckpointError(
            f"{path} has format {kind!r}; this dtrain reads "
            f"{' and '.join(repr(f) for f in FORMATS)}. Convert it with the dtrain that "
            "wrote it, or load it there."
        )
    problem = manifest_problem(manifest)
    if problem:
        raise damaged_manifest(manifest_path, problem)
    return manifest


def damaged_manifest(manifest_path: Path, problem: str) -> CheckpointError:
    """The error for a manifest that is damaged: the file, what is wrong, what to do."""
    return CheckpointError(
        f"{manifest_path} is damaged: {problem}. Resume from an older checkpoint "
        f"({advice.newest_intact()}), or restore it from a copy."
    )


_FIELDS: dict[str, tuple[type, str]] = {
    "format": (str, "a string"),
    "step": (int, "an integer"),
    "epoch": (int, "an integer"),
    "world_size": (int, "an integer"),
    "strategy": (str, "a string"),
    "tensors": (dict, "an object"),
    "files": (dict, "an object"),
}
"""The manifest's fields that dtrain reads: the JSON type each must have, in words."""


def manifest_problem(manifest: Any) -> str | None:
    """What is wrong with `manifest` (parsed JSON), or None if it has what
    :func:`write_manifest` writes: the fields of `_FIELDS`, and a size and
    checksum for every file (so every file can be verified before it is read)."""
    if not isinstance(manifest, dict):
        return f"it holds {json.dumps(manifest)[:40]}, not a JSON object"
    for field, (kind, wanted) in _FIELDS.items():
        if field not in manifest:
            return f'it has no "{field}"'
        if not _is(manifest[field], kind):
            return f'its "{field}" is {json.dumps(manifest[field])[:40]}, not {wanted}'
    for name, record in manifest["files"].items():
        if Path(name).name != name or name in ("", ".", ".."):
            return f"its file {name!r} is not a file name of the checkpoint directory"
        if not (
            isinstance(record, dict)
            and _is(record.get("bytes"), int)
            and isinstance(record.get("sha256"), str)
        ):
            return f'its entry for {name} is not {{"bytes": size, "sha256": checksum}}'
    for name, info in manifest["tensors"].items():
        shape = info.get("shape") if isinstance(info, dict) else None
        if not (
            isinstance(shape, list)
            and all(_is(n, int) for n in shape)
            and isinstance(info.get("dtype"), str)
        ):
            return f'its entry for tensor {name} is not {{"shape": [...], "dtype": name}}'
    return None


def _is(value: Any, kind: type) -> bool:
    """`isinstance`, except that JSON's true and false are no integers."""
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def is_sharded(manifest: dict[str, Any]) -> bool:
    """True if `manifest` describes a sharded (torch.distributed.checkpoint) checkpoint."""
    return manifest["format"] == SHARDED_FORMAT


def read_model(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of the checkpoint at `path`, on the CPU."""
    file = Path(path) / MODEL_FILE
    with reading(file):
        return safetensors_file.load(file)


TRUSTED = "Load checkpoints written by code you trust."
"""What to do about a checkpoint file holding objects other than tensors and plain values."""


def read_pt(path: Path, name: str, mmap: bool = False) -> Any:
    """A ``.pt`` member of the checkpoint, read with weights_only=True; None if absent; a
    DamagedCheckpointError naming it if it cannot be read (`reading`).

    With `mmap`, tensors are mapped from the file rather than read: a rank reads from
    disk only the parts it then touches (a pipeline stage, its parameters' state).
    """
    file = Path(path) / name
    if not file.is_file():
        return None
    with reading(file):
        return unpickle(file, TRUSTED, mmap)


def load_pt(file: Path | io.BytesIO, advice: str, mmap: bool = False, what: str = "") -> Any:
    """:func:`unpickle` of a file that is no checkpoint's (a plain PyTorch file); a
    CheckpointError naming it (or `what`) if it is no intact torch.save file."""
    what = what or str(file)
    try:
        return unpickle(file, advice, mmap, what)
    except DtrainError:
        raise
    except Exception as e:  # noqa: BLE001 - torch's unpickler fails in many ways on damage
        raise CheckpointError(
            f"{what} cannot be read as a PyTorch file ({reason(e)}): it is truncated or "
            "corrupt, or was not written by torch.save; pass an intact copy."
        ) from None


def unpickle(file: Path | io.BytesIO, advice: str, mmap: bool = False, what: str = "") -> Any:
    """`torch.load` of `file` (a path, or bytes in memory that errors call `what`) with
    weights_only=True, on the CPU; a CheckpointError if it holds objects other than
    tensors and plain values (the message ends with `advice`). Any other failure of
    torch's loader (a damaged file) is raised as it is, for the caller to name."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if not refuses_objects(e):
            raise
        raise CheckpointError(
            f"{what or file} holds Python objects that dtrain will not unpickle, since "
            f"unpickling can run arbitrary code ({reason(e)}). {advice}"
        ) from None


def check_fit(
    expected: Mapping[str, torch.Size], tensors: Mapping[str, torch.Tensor], strict: bool = True
) -> list[str]:
    """Compare checkpoint `tensors` with a model's `expected` shapes (canonical names).

    Lists the missing, unexpected and wrongly shaped names and raises unless
    strict=False; returns the names to skip (empty when everything matches). Reads no
    tensor of a :class:`LazyTensors` (its shapes come from the file's header).
    """
    found = (
        tensors.shapes
        if isinstance(tensors, LazyTensors)
        else {k: v.shape for k, v in tensors.items()}
    )
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong_shape = sorted(
        f"{k} (checkpoint {list(found[k])}, model {list(expected[k])})"
        for k in set(expected) & set(found)
        if tuple(found[k]) != tuple(expected[k])
    )
    problems = [
        (label, names)
        for label, names in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("wrongly shaped", wrong_shape),
        )
        if names
    ]
    if problems and strict:
        detail = "; ".join(
            f"{label}: {', '.join(names[:8])}" + (" ..." if len(names) > 8 else "")
            for label, names in problems
        )
        raise CheckpointError(
            f"The checkpoint does not fit this model ({detail}). {advice.checkpoint_misfit()}"
        )
    return missing + unexpected + [w.split(" ")[0] for w in wrong_shape]


def expected_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Canonical name -> global shape of every tensor in `model`'s state_dict."""
    return {k: v.shape for k, v in canonical_state_dict(model.state_dict()).items()}  # type: ignore[union-attr]


def load_model(
    model: nn.Module, tensors: dict[str, torch.Tensor], strict: bool = True
) -> list[str]:
    """Copy `tensors` into a model that holds whole tensors (not sharded ones).

    Returns the names that were skipped (see :func:`check_fit`).
    """
    skipped = check_fit(expected_shapes(model), tensors, strict)
    _copy_into(model, {k: v for k, v in tensors.items() if k not in skipped})
    return skipped


@torch.no_grad()
def _copy_into(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    targets = {canonical_name(k): v for k, v in model.state_dict(keep_vars=True).items()}
    for name, value in tensors.items():
        targets[name].copy_(value)
