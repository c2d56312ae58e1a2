"""torch.distributed.checkpoint (DCP) files, read without unpickling arbitrary objects.

DCP keeps its index (``.metadata``) as a pickle and its non-tensor values (an optimizer's
hyperparameters) as ``torch.save`` pickles, and reads both with plain pickle. A
checkpoint may come from anywhere, so here the index is unpickled with an allow-list of
DCP's own metadata classes and every other value with ``weights_only=True``: a file
holding other objects is refused, never executed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from dtrain.checkpoint.format import INDEX, TRUSTED, unpickle
from dtrain.checkpoint.reading import damaged, reading, reason
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
    """Unpickles DCP's metadata classes, torch sizes and dtypes, and nothing else: any
    other object is a CheckpointError naming the index `file`."""

    def __init__(self, stream: BinaryIO, file: Path) -> None:
        super().__init__(stream)
        self.file = file

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
        raise CheckpointError(
            f"{self.file} holds Python objects that dtrain will not unpickle, since unpickling "
            f"can run arbitrary code ({module}.{name} is not part of a checkpoint index). Use "
            "checkpoints written by torch.distributed.checkpoint from code you trust."
        )


def read_metadata(path: Path) -> Metadata:
    """The DCP index of the sharded checkpoint at `path`; a CheckpointError if it is
    missing or holds objects other than DCP's metadata, a DamagedCheckpointError if it
    cannot be read."""
    file = Path(path) / INDEX
    if not file.is_file():
        raise CheckpointError(
            f"{path} has no {INDEX} (the index of its pieces); the sharded checkpoint is "
            "incomplete. Resume from an older checkpoint."
        )
    with reading(file), open(file, "rb") as f:
        metadata = _IndexUnpickler(f, file).load()
    if not isinstance(metadata, Metadata):
        raise damaged(file, f"it holds a {type(metadata).__name__}, not an index of pieces")
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

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's reads, one file at a time, so that a file that cannot be read is named."""
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            by_file.setdefault(name, []).append(item)
        for name, items in by_file.items():
            with reading(self.directory / name):
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
        done: Future[None] = Future()
        done.set_result(None)
        return done


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner over a flat state (keys as in the index), with every
    non-tensor value read with weights_only=True."""

    def __init__(self) -> None:
        # Flat in, flat out: values land in the very dictionary given to `dcp.load`.
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        self.state_dict[key] = unpickle(value, TRUSTED, what=f"The checkpoint's entry {key}")


def load(state: dict[str, Any], path: Path, group: Any, distributed: bool) -> None:
    """`dcp.load` of `path` into the flat `state` (keys as in the index: tensors are read
    in place, other values replaced), safely; collective over `group` when
    `distributed`, else this process alone."""
    try:
        with alone_quietly():
            dcp.load(
                state,
                storage_reader=SafeReader(path),
                planner=SafeLoadPlanner(),
                process_group=group,
                no_dist=not distributed,
            )
    except CheckpointException as e:  # a BaseException: the ranks' failures, gathered
        raise _first_of(e, path) from None


def _first_of(error: CheckpointException, path: Path) -> CheckpointError:
    """dtrain's error among the ranks' failures a DCP load gathered in `error` (a file
    named by `SafeReader`, the lowest rank's first); else one naming `path`."""
    failures = [error.failures[rank] for rank in sorted(error.failures)]
    for failure, _ in failures:
        if isinstance(failure, CheckpointError):
            return failure
    return damaged(path, "; ".join(reason(failure) for failure, _ in failures) or str(error))


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
