"""Hugging Face model folders, read into the model as a strategy placed it.

A folder that ``from_pretrained`` reads holds ``config.json`` and the weights as
safetensors: one ``model.safetensors``, or shards ``model-0000K-of-0000N.safetensors``
that ``model.safetensors.index.json`` names (tensor name -> file). The names are the
model's own state-dict keys; a tied weight (an output layer that is the input embedding)
is stored once.

Each rank reads only what it holds. Where the parameters are DTensors (zero2, zero3, hsdp,
tensor), torch.distributed.checkpoint's Hugging Face reader reads each rank's slices of
the files straight into its shards; a replica (single, ddp, zero1, towers, ps) reads each
tensor whole, and a pipeline stage only its own layers' tensors. The folder is checked
against the whole model first, from the files' headers alone (names, shapes, dtypes, the
model class `config.json` names): a folder that does not fit loads nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.checkpoint.format import (
    INDEX,
    MANIFEST,
    OPTIMIZER_FILE,
    TRAINER_FILE,
    canonical_state_dict,
    check_fit,
)
from dtrain.checkpoint.lazy import LazyTensors
from dtrain.checkpoint.reading import reason
from dtrain.checkpoint.safetensors_file import TensorFile
from dtrain.checkpoint.shared import decided_by_main
from dtrain.errors import CheckpointError
from dtrain.process.collectives import gather_objects
from dtrain.process.logs import LOGGER

if TYPE_CHECKING:
    from dtrain.checkpoint.holder import StateHolder

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def is_model_folder(path: Path) -> bool:
    """Whether `path` is a Hugging Face model folder: its config and its weights as
    safetensors, and none of a dtrain checkpoint's files (one that lost its manifest is
    a damaged checkpoint, not a model folder)."""
    ours = (MANIFEST, TRAINER_FILE, OPTIMIZER_FILE, INDEX)
    return (
        (path / CONFIG).is_file()
        and ((path / WEIGHTS).is_file() or (path / WEIGHTS_INDEX).is_file())
        and not any((path / name).exists() for name in ours)
    )


@dataclass(frozen=True)
class ModelFolder:
    """A Hugging Face model folder whose files were checked: every tensor's file, shape
    and dtype from the headers, and its config."""

    path: Path
    files: list[Path]
    shapes: dict[str, torch.Size]
    dtypes: dict[str, torch.dtype | None]
    config: dict[str, Any]


def open_folder(path: Path) -> ModelFolder:
    """Check the model folder at `path` (its index, every file it names, their headers)
    without reading a tensor; a CheckpointError saying what is wrong and what to do."""
    index = path / WEIGHTS_INDEX
    if index.is_file():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(
                f"{index} has no weight_map (tensor name -> file); the folder is incomplete. "
                "Download or save the model folder again."
            )
        names = sorted(set(weight_map.values()))
    else:
        weight_map, names = None, [WEIGHTS]
    missing = [name for name in names if not (path / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{index} names {', '.join(missing)}, which {path} does not hold; the folder is "
            "incomplete. Download or save the model folder again."
        )
    shapes: dict[str, torch.Size] = {}
    dtypes: dict[str, torch.dtype | None] = {}
    for name in names:
        try:
            opened = TensorFile(path / name)
        except Exception as e:  # noqa: BLE001 - whatever safetensors meets, the file is bad
            raise CheckpointError(
                f"{path / name} cannot be read ({reason(e)}): it is truncated or not a "
                "safetensors file. Download or save the model folder again."
            ) from None
        held = [k for k, f in weight_map.items() if f == name] if weight_map else opened.names
        absent = sorted(set(held) - set(opened.names))
        if absent:
            raise CheckpointError(
                f"{index} says {path / name} holds {', '.join(absent[:8])}, which it does not; "
                "the folder is damaged. Download or save the model folder again."
            )
        shapes.update((k, opened.shapes[k]) for k in held)
        dtypes.update((k, opened.dtype(k)) for k in held)
    config = _json(path / CONFIG) if (path / CONFIG).is_file() else {}
    return ModelFolder(path, [path / name for name in names], shapes, dtypes, config)


def pretrained_names(path: Path) -> frozenset[str]:
    """The names of the tensors the model folder at `path` holds (read from its headers),
    for ``engine.setup(pretrained=path)``; a CheckpointError for anything else."""
    if not is_model_folder(path):
        raise CheckpointError(
            f"engine.setup(pretrained=...) takes a Hugging Face model folder (config.json and "
            f"safetensors); {path} is not one. Load a dtrain checkpoint with engine.load "
            "after setup."
        )
    return frozenset(open_folder(path).shapes)


def _json(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{file} cannot be read as JSON ({reason(e)}). Download or save the model folder again."
        ) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file} holds no JSON object. Download or save the folder again.")
    return value


def tied_names(module: nn.Module) -> dict[str, str]:
    """Each name of a parameter registered under several names -> its first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return aliases


def _model_side(module: nn.Module) -> tuple[dict[str, torch.Size], dict[str, torch.dtype]]:
    """(shapes, dtypes) of this rank's part of the model's state, under its names."""
    state = canonical_state_dict(module.state_dict())
    return {k: v.shape for k, v in state.items()}, {k: v.dtype for k, v in state.items()}


def load_folder(
    path: Path, holder: StateHolder, strict: bool, main: bool
) -> tuple[ModelFolder, list[str]]:
    """Load the Hugging Face folder at `path`, which the main rank checks
    (`open_folder`), into the holder's model (collective over its checkpoint group).
    Returns the folder and the names skipped with strict=False (they keep their values)."""
    folder = decided_by_main(lambda: open_folder(path), holder.checkpoint_group, main)
    classes = [holder.model_class, *(c.__name__ for c in type(holder.unwrap()).__mro__)]
    module = holder.unwrap()
    group = holder.checkpoint_group
    architectures = folder.config.get("architectures") or []
    if architectures and not set(classes) & set(architectures):
        raise CheckpointError(
            f"{folder.path / CONFIG} is for {', '.join(architectures)}, not this model "
            f"({classes[0]}); nothing was loaded. Build the model from the folder's "
            "config (its class, or AutoModelForCausalLM.from_config) before engine.load."
        )
    shapes: dict[str, torch.Size] = {}
    dtypes: dict[str, torch.dtype] = {}
    aliases: dict[str, str] = {}
    for part_shapes, part_dtypes, part_aliases in gather_objects(
        (*_model_side(module), tied_names(module)), group
    ):  # a pipeline stage knows its part
        shapes.update(part_shapes)
        dtypes.update(part_dtypes)
        aliases.update(part_aliases)
    stored_once = {a: s for a, s in aliases.items() if a not in folder.shapes}
    found = dict(folder.shapes)
    found.update((a, folder.shapes[s]) for a, s in stored_once.items() if s in folder.shapes)
    skipped = check_fit(
        shapes, {k: torch.empty(v, device="meta") for k, v in found.items()}, strict
    )
    wrong = sorted(
        f"{k} ({str(folder.dtypes[k]).removeprefix('torch.')} in the folder, "
        f"{str(dtypes[k]).removeprefix('torch.')} in the model)"
        for k in set(folder.dtypes) & set(dtypes)
        if k not in skipped and folder.dtypes[k] != dtypes[k]
    )
    if wrong:
        raise CheckpointError(
            f"The folder's tensors are of other dtypes than the model's ({', '.join(wrong[:4])}"
            f"{' ...' if len(wrong) > 4 else ''}); nothing was loaded. Build the model in the "
            "folder's dtype (model.to(dtype) before engine.setup, or torch_dtype in its "
            "config), and choose mixed precision with --precision."
        )
    if any(_is_dtensor(p) for p in module.parameters()):
        _load_slices(folder, module, group, set(skipped) | set(stored_once))
    else:
        held = set(_model_side(module)[0]) - set(skipped)
        holder.load_full_state(LazyTensors(folder.files, held, stored_once), None, None, strict)
    LOGGER.info("loaded the Hugging Face model folder %s", path)
    return folder, skipped


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _load_slices(
    folder: ModelFolder, module: nn.Module, group: dist.ProcessGroup | None, left: set[str]
) -> None:
    """Read each rank's slices of the folder's tensors into `module`'s DTensors (and its
    whole plain tensors), collective over `group`; `left`: names not to read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from dtrain.checkpoint.dcp_io import alone_quietly

    state = get_model_state_dict(module)
    request = {k: v for k, v in state.items() if k in folder.shapes and k not in left}
    with alone_quietly():
        dcp.load(
            request,
            storage_reader=HuggingFaceStorageReader(str(folder.path)),
            process_group=group,
            no_dist=not dist.is_initialized(),
        )
    state.update(request)
    set_model_state_dict(module, state, options=StateDictOptions(strict=False))
