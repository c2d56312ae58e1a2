"""Shard files in `engine.dataloader`: a corpus kept as files in P partitions (one per
machine, typically), read in the same global batches at any number of data-parallel ranks,
each rank opening only the files that hold its samples.

A directory holds the shard files and an ``index.json``: the format, the number of
partitions P, and each shard's file name, sample count and partition, in order (the
partitions are contiguous runs of shards). `write_shards` writes one.

An epoch's order is fixed by the seed and the epoch alone. Within each partition the shards
are shuffled, then the samples within each block of `shuffle_block` consecutive shards of
that order (so a reader keeps at most a block of shards open). Global batch t takes
partition p's samples [t*B/P, (t+1)*B/P) of its order, for p = 0..P-1 in turn; rank r
trains the r-th contiguous share of that concatenation, as for every other dataset. With dp
ranks a multiple of P, rank r's share always lies in partition r // (dp/P): a machine whose
dp/P consecutive ranks (as the launcher numbers them) read partition p needs only its files.
The smallest partition sets the epoch's length; the rest of the others is left out.
"""

from __future__ import annotations

import bisect
import collections
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dtrain.errors import ConfigError

INDEX = "index.json"
REWRITE = "write the shards again (dtrain.write_shards or `dtrain data write`)"
"""The fix for shard files that do not match their index, as error messages end."""
FORMATS = ("pt", "npy", "npz")
"""What `write_shards` writes: ``pt``, a list of samples per file (any nesting of tensors,
numbers, tuples, lists and dicts; read with ``weights_only=True``); ``npy``, one array per
file, sample i its row i (samples are arrays of one shape; memory-mapped); ``npz``, one
array per field of (input, target, ...) tuples, sample i the tuple of their rows i."""

Decode = Callable[[Path], Sequence[Any]]
"""A shard file's path -> its samples (anything with ``len`` and indexing)."""


class ShardFiles(Dataset):
    """The shard files of a directory with an ``index.json`` (see `write_shards`), for
    ``engine.dataloader(ShardFiles(directory), global_batch_size=B)``.

    Args:
        directory: the shard files and their index.
        seed: the seed of each epoch's order; None: the engine's (``--seed``, or the one it
            draws for a shuffled map-style dataset).
        shuffle_block: samples are shuffled within blocks of this many consecutive shards
            of the epoch's shard order; a reader keeps that many shards open per partition.
        decode: reads one shard file into its samples (a sequence), for formats other than
            `FORMATS` (the index's format is then only a name).

    As a map-style dataset (``len``, ``files[i]``: sample i in written order) it serves
    evaluation with ``drop_last=False, shuffle=False``. `opened` counts the shard files this
    process has opened, by name.
    """

    def __init__(
        self,
        directory: str | Path,
        seed: int | None = None,
        shuffle_block: int = 4,
        decode: Decode | None = None,
    ) -> None:
        if shuffle_block < 1:
            raise ConfigError(
                f"shuffle_block is a number of shards, at least 1; got {shuffle_block}."
            )
        self.directory = Path(directory)
        self.seed = seed
        self.shuffle_block = shuffle_block
        index = _read_index(self.directory)
        self.format: str = index["format"]
        self.partitions: int = index["partitions"]
        self.names: list[str] = [shard["name"] for shard in index["shards"]]
        self.counts: list[int] = [shard["samples"] for shard in index["shards"]]
        self.file_bytes: list[int | None] = [shard["bytes"] for shard in index["shards"]]
        self.starts: list[int] = [0]
        for count in self.counts:
            self.starts.append(self.starts[-1] + count)
        self.of_partition: list[list[int]] = [[] for _ in range(self.partitions)]
        for k, shard in enumerate(index["shards"]):
            self.of_partition[shard["partition"]].append(k)
        if decode is None and self.format not in _READERS:
            raise ConfigError(
                f"{self.directory / INDEX} names the format {self.format!r}, which dtrain "
                f"does not read ({', '.join(FORMATS)}); pass decode=a function from a shard "
                "file's path to its samples."
            )
        self.decode: Decode = decode or _READERS[self.format]
        self.keep_open = shuffle_block
        """How many shards stay open (the most recently read); a ShardShare sets it."""
        self.opened: collections.Counter[str] = collections.Counter()
        self._open: collections.OrderedDict[int, Sequence[Any]] = collections.OrderedDict()

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        shard = bisect.bisect_right(self.starts, i) - 1
        return self._shard(shard)[i - self.starts[shard]]

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers get a copy: without the open shards (memory maps, big lists).
        state = self.__dict__.copy()
        state["_open"] = collections.OrderedDict()
        return state

    def check_files(self, partition: int) -> None:
        """A ConfigError naming the first shard file of `partition` that is missing or whose
        size is not the one the index records."""
        for k in self.of_partition[partition]:
            self._check_file(k)

    def _check_file(self, k: int) -> None:
        """`check_files` for shard `k`."""
        file, index = self.directory / self.names[k], self.directory / INDEX
        if not file.is_file():
            raise ConfigError(
                f"The shard file {file} listed in {index} is missing; restore it, or {REWRITE}."
            )
        size = file.stat().st_size
        if self.file_bytes[k] is not None and size != self.file_bytes[k]:
            raise ConfigError(
                f"The shard file {file} has {size} bytes but {index} records {self.file_bytes[k]}: "
                f"the index does not match the files; restore the file, or {REWRITE}."
            )

    def partition_size(self, partition: int) -> int:
        """The samples of `partition`."""
        return sum(self.counts[k] for k in self.of_partition[partition])

    def order(self, partition: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
        """The sample indices of `partition` in `epoch`'s order (its written order if not
        `shuffle`): the same on every rank, whatever the number of ranks."""
        shards = self.of_partition[partition]
        if not shuffle:
            return torch.arange(self.starts[shards[0]], self.starts[shards[-1] + 1])
        # torch takes seeds below 2**64, and a run's seed may be any of them
        mixed = ((seed * 1_000_003 + epoch) * 1_000_033 + partition) % 2**64
        generator = torch.Generator().manual_seed(mixed)
        shuffled = [shards[k] for k in torch.randperm(len(shards), generator=generator).tolist()]
        blocks = []
        for b in range(0, len(shuffled), self.shuffle_block):
            block = torch.cat(
                [
                    torch.arange(self.starts[k], self.starts[k + 1])
                    for k in shuffled[b : b + self.shuffle_block]
                ]
            )
            blocks.append(block[torch.randperm(len(block), generator=generator)])
        return torch.cat(blocks)

    def _shard(self, k: int) -> Sequence[Any]:
        """Shard `k`'s samples: from the open shards, else read (closing the least recently
        read beyond `keep_open`)."""
        if k in self._open:
            self._open.move_to_end(k)
            return self._open[k]
        path = self.directory / self.names[k]
        self._check_file(k)
        self.opened[self.names[k]] += 1
        try:
            samples = self.decode(path)
        except Exception as e:  # noqa: BLE001 - any reader's failure means a damaged file
            raise ConfigError(
                f"The shard file {path} cannot be read ({type(e).__name__}); it is "
                f"damaged: restore it, or {REWRITE}."
            ) from e
        if len(samples) != self.counts[k]:
            raise ConfigError(
                f"The shard file {path} holds {len(samples)} samples but "
                f"{self.directory / INDEX} lists {self.counts[k]}: the index does not match "
                f"the files; {REWRITE} (or correct the index)."
            )
        self._open[k] = samples
        while len(self._open) > self.keep_open:
            self._open.popitem(last=False)
        return samples


def _read_index(directory: Path) -> dict[str, Any]:
    """The checked ``index.json`` of `directory`, its numbers as ints: a ConfigError naming
    the file and the fix if it is missing or malformed. The shard files are checked where
    they are read: on a machine that holds only its own partitions' files, the others are
    absent."""
    path = directory / INDEX
    try:
        index = json.loads(path.read_text())
        index = {
            "format": str(index["format"]),
            "partitions": int(index["partitions"]),
            "shards": [
                {
                    "name": str(shard["name"]),
                    "samples": int(shard["samples"]),
                    "partition": int(shard["partition"]),
                    "bytes": None if shard.get("bytes") is None else int(shard["bytes"]),
                }
                for shard in index["shards"]
            ],
        }
        if any(shard["samples"] < 1 for shard in index["shards"]):
            raise ValueError("a shard lists fewer than 1 sample")
    except FileNotFoundError:
        raise ConfigError(f"{directory} has no {INDEX}; {REWRITE}.") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{path} is not a readable shard index ({e!r}); {REWRITE}.") from e
    partition_of = [shard["partition"] for shard in index["shards"]]
    parts = index["partitions"]
    if partition_of != sorted(partition_of) or sorted(set(partition_of)) != list(range(parts)):
        raise ConfigError(
            f"{path} must list the shards of partition 0, then 1, ... up to {parts - 1}, each "
            f"with at least one shard; {REWRITE}."
        )
    return index


class _Rows:
    """Row i of each array, as a tensor (one array) or a tuple of tensors (several)."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, i: int) -> Any:
        # A copy: rows of a memory map would keep the file open and be read-only.
        rows = tuple(torch.from_numpy(np.array(array[i])) for array in self.arrays)
        return rows[0] if len(rows) == 1 else rows


def _read_pt(path: Path) -> list[Any]:
    return torch.load(path, weights_only=True)


def _read_npy(path: Path) -> _Rows:
    return _Rows([np.load(path, mmap_mode="r")])


def _read_npz(path: Path) -> _Rows:
    with np.load(path) as arrays:
        return _Rows([arrays[f"arr_{k}"] for k in range(len(arrays.files))])


_READERS: dict[str, Decode] = {"pt": _read_pt, "npy": _read_npy, "npz": _read_npz}
"""Module-level functions, so that a ShardFiles pickles (DataLoader workers spawned)."""
