"""The model file of a checkpoint, read tensor by tensor as a rank asks for them.

A safetensors file's header gives every name, shape and dtype without its data, and then
one tensor at a time by name, so a rank that needs part of the model (a pipeline stage)
reads only that part, and checking the file against a model's shapes reads no tensor at
all.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from dtrain.checkpoint.reading import reading
from dtrain.checkpoint.safetensors_file import TensorFile


class LazyTensors(Mapping[str, torch.Tensor]):
    """Name -> tensor of a safetensors file, each read from disk when asked for.

    Names outside `wanted` are never read: asking for one gives a shape-only tensor on
    the ``meta`` device (its shape, no data), enough for code that looks at
    every name and keeps those it holds. `shapes` gives every name's shape without
    reading. A file that cannot be read is a DamagedCheckpointError naming it.
    """

    def __init__(self, path: Path, wanted: set[str]) -> None:
        self.path = Path(path)
        self.wanted = wanted
        with reading(self.path):
            self._file = TensorFile(self.path)
        self.shapes = self._file.shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        if name not in self.wanted:
            return torch.empty(self.shapes[name], device="meta")
        with reading(self.path):
            return self._file.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file.names)

    def __len__(self) -> int:
        return len(self._file.names)
