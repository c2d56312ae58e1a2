"""The model file of a checkpoint, read tensor by tensor as a rank asks for them.

A safetensors file's header gives every name, shape and dtype without its data, and then
one tensor at a time by name, so a rank that needs part of the model (a pipeline stage)
reads only that part, and checking the file against a model's shapes reads no tensor at
all.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from dtrain.checkpoint.reading import reading
from dtrain.checkpoint.safetensors_file import TensorFile


class LazyTensors(Mapping[str, torch.Tensor]):
    """Name -> tensor of one or more safetensors files, each read from disk when asked for.

    Names outside `wanted` are never read: asking for one gives a shape-only tensor on
    the ``meta`` device (its shape, no data), enough for code that looks at
    every name and keeps those it holds. `shapes` gives every name's shape without
    reading. A file that cannot be read is a DamagedCheckpointError naming it. `aliases`
    maps a name the files do not hold to one they do (a tied weight stored once).
    """

    def __init__(
        self,
        paths: Path | Sequence[Path],
        wanted: set[str],
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        self.wanted = wanted
        self._where: dict[str, tuple[Path, TensorFile, str]] = {}
        """name -> (its file, the file opened, its name in the file)."""
        for path in [paths] if isinstance(paths, Path) else paths:
            with reading(path):
                opened = TensorFile(path)
            self._where.update((name, (path, opened, name)) for name in opened.names)
        for alias, source in (aliases or {}).items():
            if source in self._where and alias not in self._where:
                self._where[alias] = self._where[source]
        self.shapes = {name: file.shapes[stored] for name, (_, file, stored) in self._where.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        if name not in self.wanted:
            return torch.empty(self.shapes[name], device="meta")
        path, opened, stored = self._where[name]
        with reading(path):
            return opened.get(stored)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
