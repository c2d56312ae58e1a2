"""torch.distributed.checkpoint (DCP) files, read without unpickling arbitrary objects.

DCP keeps its index (``.metadata``) as a pickle and its non-tensor values (an optimizer's
hyperparameters) as ``torch.save`` pickles, and reads both with plain pickle. A
checkpoint may come from anywhere, so here the index is unpickled with an allow-list of
DCP's own metadata classes and every other value with ``weights_only=True``: a file
holding other objects is refused, never executed.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from dtrain.checkpoint.format import INDEX
from dtrain.errors import CheckpointError

MODEL = "model."
OPTIMIZER = "optim."
"""Prefixes of the model's and the optimizer's entries in the index."""

# dtrain reads and writes without a process group on purpose (one-process jobs, `ckpt
# convert`, the main rank writing state gathered by `full_state`); DCP warns every time.
_ALONE = r"torch\.distributed is (disabled|unavailable).*"
warnings.filterwarnings("ignore", message=_ALONE)  # for saves finishing in the background


@contextlib.contextmanager
def alone_quietly() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group, in this block."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ALONE)
        yield


_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes, torch sizes and dtypes, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _ALLOWED:
                return super().find_class(module, name)
            if module == _METADATA_MODULE:
                found = super().find_class(module, name)
                if isinstance(found, type) and found.__module__ == module:
                    return found
            kinds = (torch.dtype, torch.layout, torch.memory_format)
            if module == "torch" and isinstance(getattr(torch, name, None), kinds):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def read_metadata(path: Path) -> Metadata:
    """The DCP index of the sharded checkpoint at `path`; a CheckpointError if it is
    missing, damaged, or holds objects other than DCP's metadata."""
    file = Path(path) / INDEX
    if not file.is_file():
        raise CheckpointError(
            f"{path} has no {INDEX} (the index of its pieces); the sharded checkpoint is "
            "incomplete. Resume from an older checkpoint."
        )
    try:
        with open(file, "rb") as f:
            metadata = _IndexUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{file} holds Python objects that dtrain will not unpickle, since unpickling can "
            f"run arbitrary code ({e}). Use checkpoints written by torch.distributed.checkpoint "
            "from code you trust."
        ) from None
    except (EOFError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{file} cannot be read ({e}); it is truncated or corrupt.") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} is not an index of torch.distributed.checkpoint pieces.")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, with its index read by :func:`read_metadata`."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.directory = Path(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.directory)
        if metadata.storage_meta is None:  # written by an older torch
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner over a flat state (keys as in the index), with every
    non-tensor value read with weights_only=True."""

    def __init__(self) -> None:
        # Flat in, flat out: values land in the very dictionary given to `dcp.load`.
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            self.state_dict[key] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"The checkpoint's entry {key} holds Python objects that dtrain will not "
                f"unpickle ({str(e).splitlines()[0]}); use checkpoints from code you trust."
            ) from None


def load(state: dict[str, Any], path: Path, group: Any, distributed: bool) -> None:
    """`dcp.load` of `path` into the flat `state` (keys as in the index: tensors are read
    in place, other values replaced), safely; collective over `group` when
    `distributed`, else this process alone."""
    with alone_quietly():
        dcp.load(
            state,
            storage_reader=SafeReader(path),
            planner=SafeLoadPlanner(),
            process_group=group,
            no_dist=not distributed,
        )


def model_entries(metadata: Metadata) -> dict[str, tuple[list[int], torch.dtype]]:
    """Canonical name -> (whole shape, dtype) of every model tensor in the index."""
    return {
        key.removeprefix(MODEL): (list(md.size), md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(MODEL) and isinstance(md, TensorStorageMetadata)
    }


def read_entries(path: Path, keep: Callable[[str], bool]) -> dict[str, Any]:
    """The entries of the checkpoint at `path` whose key (in the index) `keep` accepts,
    whole and on the CPU; read by this process alone (no process group)."""
    metadata = read_metadata(path)
    state: dict[str, Any] = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        if isinstance(md, TensorStorageMetadata)
        else None
        for key, md in metadata.state_dict_metadata.items()
        if keep(key)
    }
    load(state, path, None, distributed=False)
    return state
