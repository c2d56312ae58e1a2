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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from dtrain.checkpoint.atomic import atomic_directory
from dtrain.errors import ConfigError, SetupError
from dtrain.streams import StreamShare

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


def write_shards(
    samples: Sequence[Any],
    out_dir: str | Path,
    shard_size: int,
    partitions: int = 1,
    format: str = "pt",  # noqa: A002 - the index's word for it
) -> Path:
    """Write `samples` (a map-style dataset or any sequence) as shard files of `shard_size`
    samples in `partitions` contiguous partitions of near-equal size, with their
    ``index.json``, into the directory `out_dir` (replacing it, if it holds earlier shard
    files, in one rename: a reader sees the old directory or the complete new one). Returns
    `out_dir`.

    `format` is one of `FORMATS`. `partitions` is fixed here: train on a multiple or a
    divisor of it data-parallel ranks (typically it is the number of machines).
    """
    if format not in FORMATS:
        raise ConfigError(f"Shard format {format!r} is unknown; use one of {', '.join(FORMATS)}.")
    if shard_size < 1:
        raise ConfigError(f"A shard holds at least 1 sample; got a shard size of {shard_size}.")
    total = len(samples)
    if partitions < 1 or total < partitions:
        raise ConfigError(
            f"{total} samples cannot fill {partitions} partitions; use between 1 and {total}."
        )
    _check_fits(samples[0], format)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} is a file; give write_shards a directory to write.")
    if out_dir.exists() and not (out_dir / INDEX).is_file() and any(out_dir.iterdir()):
        raise ConfigError(
            f"{out_dir} holds files other than shard files, and writing shards replaces the "
            "whole directory; choose a new or empty directory."
        )
    shards = []
    with atomic_directory(out_dir) as tmp:
        size, rest = divmod(total, partitions)
        start = 0
        for partition in range(partitions):
            end = start + size + (partition < rest)
            for first in range(start, end, shard_size):
                name = f"shard-{len(shards):05d}.{format}"
                rows = [samples[i] for i in range(first, min(first + shard_size, end))]
                try:
                    _WRITERS[format](rows, tmp / name)
                except ValueError as e:  # numpy cannot stack samples of unequal shapes
                    raise ConfigError(
                        f"Samples {first} to {first + len(rows) - 1} cannot be stacked into one "
                        f"{format} array ({e}); every sample's fields must have one shape in "
                        "that format: write format='pt', which keeps each sample as it is."
                    ) from None
                shards.append(
                    {
                        "name": name,
                        "samples": len(rows),
                        "partition": partition,
                        "bytes": (tmp / name).stat().st_size,
                    }
                )
            start = end
        index = {"format": format, "partitions": partitions, "shards": shards}
        (tmp / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return out_dir


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


class ShardShare(StreamShare):
    """One data-parallel rank's share of each global batch of a `ShardFiles`, as whole
    collated batches (iterated like a `StreamShare`: DataLoader worker w of W builds the
    rank's batches w, w + W, ... of the epoch; resume starts at step `skip` directly).

    Args:
        files: the shard files.
        batch_size, dp_size, dp_rank: as for `StreamShare`.
        shuffle: the epoch's order is shuffled (see `ShardFiles.order`).
        seed: the order's seed (the files' own if they have one).
        collate_fn: makes a batch of a list of samples.
    """

    def __init__(
        self,
        files: ShardFiles,
        batch_size: int,
        dp_size: int,
        dp_rank: int,
        shuffle: bool,
        seed: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        super().__init__(files, batch_size, dp_size, dp_rank, True, collate_fn)
        self.files = files
        self.shuffle = shuffle
        # In shared memory, as the epoch is: a load after persistent DataLoader workers
        # started sets the checkpoint's seed, and they must read it.
        self._seed = torch.zeros(2, dtype=torch.int64).share_memory_()
        self.seed = seed if files.seed is None else files.seed
        parts = files.partitions
        _check_partitions(files, self.global_batch_size, dp_size)
        self.part = self.global_batch_size // parts
        """Samples each partition gives one step."""
        self.pieces = _runs(dp_rank * batch_size, (dp_rank + 1) * batch_size, self.part)
        """(partition, first, end) of each run of this rank's share, within the partition's
        part of a global batch."""
        files.keep_open = files.shuffle_block * len(self.pieces)
        for p, _, _ in self.pieces:
            files.check_files(p)
        sizes = [files.partition_size(p) for p in range(parts)]
        self.steps = min(sizes) // self.part
        if self.steps == 0:
            raise ConfigError(
                f"Partition {sizes.index(min(sizes))} of {files.directory} has {min(sizes)} "
                f"samples, fewer than its {self.part} of one global batch of "
                f"{self.global_batch_size}; lower the batch size, or write the shards in "
                "fewer partitions."
            )
        self.sizes = sizes
        self.dropped = sum(sizes) - self.steps * self.global_batch_size
        """Samples of an epoch no step takes."""

    @property
    def seed(self) -> int:
        """The order's seed (any of torch's seeds, in [0, 2**64))."""
        high, low = self._seed.tolist()
        return high << 32 | low

    @seed.setter
    def seed(self, value: int) -> None:
        self._seed[0], self._seed[1] = value >> 32, value & 0xFFFFFFFF

    def __len__(self) -> int:
        return self.steps

    def example(self) -> Any:
        """The first sample of this rank's first partition: one to check against the model
        without opening another machine's files."""
        partition = self.pieces[0][0]
        return self.files[self.files.starts[self.files.of_partition[partition][0]]]

    def note(self) -> str | None:
        """The line telling that unequal partitions leave more samples out of each epoch
        than its last incomplete global batch, if they do."""
        if self.dropped <= sum(self.sizes) % self.global_batch_size:
            return None
        return (
            f"dtrain: {self.files.directory}: its partitions hold {min(self.sizes)} to "
            f"{max(self.sizes)} samples and each step takes {self.part} of each, so the "
            f"smallest decides: {self.steps} steps per epoch, {self.dropped} samples left out."
        )

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self._where.tolist()
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        orders = {p: self.files.order(p, self.seed, epoch, self.shuffle) for p, _, _ in self.pieces}
        for t in range(skip + worker, self.steps, workers):
            at = t * self.part
            ids = [i for p, lo, hi in self.pieces for i in orders[p][at + lo : at + hi].tolist()]
            yield self.collate_fn([self.files[i] for i in ids])


def shard_share(
    files: ShardFiles,
    batch_size: int,
    dp_size: int,
    dp_rank: int,
    shuffle: bool,
    seed: int,
    loader_kwargs: dict[str, Any],
) -> ShardShare:
    """The `ShardShare` `engine.dataloader` iterates for `files` (training: drop_last); a
    SetupError for a loader option that would reorder it. The DataLoader's `collate_fn`
    (taken out of `loader_kwargs`) collates each share in the reader."""
    for name in ("sampler", "batch_sampler"):
        if loader_kwargs.get(name) is not None:
            raise SetupError(
                f"ShardFiles take no {name}: dtrain gives each worker its share of their "
                f"global batches itself; leave out {name}."
            )
    if loader_kwargs.get("in_order") is False:
        raise SetupError(
            "in_order=False would let a rank train its batches of shard files out of order, "
            "so the ranks of one step would mix different global batches; leave out in_order."
        )
    collate_fn = loader_kwargs.pop("collate_fn", None)
    return ShardShare(files, batch_size, dp_size, dp_rank, shuffle, seed, collate_fn)


def _runs(start: int, end: int, part: int) -> list[tuple[int, int, int]]:
    """The positions [start, end) of a global batch made of one part of `part` samples per
    partition, as (partition, first, end) runs within each partition's part."""
    return [
        (p, max(start - p * part, 0), min(end - p * part, part))
        for p in range(start // part, (end - 1) // part + 1)
    ]


def _check_partitions(files: ShardFiles, global_batch: int, dp_size: int) -> None:
    """A ConfigError if the global batch or the data-parallel ranks do not fit the
    partitions: each step takes the same share of every partition, and each rank whole
    partitions or a part of one."""
    parts = files.partitions
    if global_batch % parts:
        raise ConfigError(
            f"A global batch of {global_batch} does not split over the {parts} partitions of "
            f"{files.directory} (each step takes as many samples from each); use a multiple "
            f"of {parts}."
        )
    if dp_size % parts and parts % dp_size:
        raise ConfigError(
            f"{dp_size} data-parallel workers cannot read the {parts} partitions of "
            f"{files.directory}: the workers must be a multiple or a divisor of the "
            f"partitions, so that each reads whole partitions or a part of one; run a "
            f"multiple or divisor of {parts} workers, or write the shards again with "
            f"{dp_size} partitions."
        )


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


def _check_fits(sample: Any, format: str) -> None:  # noqa: A002 - as in write_shards
    """A ConfigError if samples like `sample` would not come back as they went in: `npy`
    holds one array per sample, `npz` a tuple of arrays; `pt` holds any sample."""
    single = isinstance(sample, torch.Tensor | np.ndarray | int | float)
    fields = isinstance(sample, tuple | list) and all(
        isinstance(value, torch.Tensor | np.ndarray | int | float) for value in sample
    )
    if (format == "npy" and not single) or (format == "npz" and not fields):
        wants = "one tensor or array" if format == "npy" else "a tuple of tensors or arrays"
        raise ConfigError(
            f"format={format!r} stores samples that are {wants}, and a sample here is a "
            f"{type(sample).__name__}; write format='pt', which keeps any sample as it is"
            f"{', or npz for (input, target) pairs' if format == 'npy' else ''}."
        )


def _write_pt(samples: list[Any], path: Path) -> None:
    torch.save([_owned(sample) for sample in samples], path)


def _write_npy(samples: list[Any], path: Path) -> None:
    np.save(path, np.stack([np.asarray(sample) for sample in samples]))


def _write_npz(samples: list[Any], path: Path) -> None:
    fields = zip(*samples, strict=True)
    with open(path, "wb") as f:  # np.savez would append .npz to a name it is given
        np.savez(f, *[np.stack([np.asarray(value) for value in field]) for field in fields])


def _read_pt(path: Path) -> list[Any]:
    return torch.load(path, weights_only=True)


def _read_npy(path: Path) -> _Rows:
    return _Rows([np.load(path, mmap_mode="r")])


def _read_npz(path: Path) -> _Rows:
    with np.load(path) as arrays:
        return _Rows([arrays[f"arr_{k}"] for k in range(len(arrays.files))])


_WRITERS: dict[str, Callable[[list[Any], Path], None]] = {
    "pt": _write_pt,
    "npy": _write_npy,
    "npz": _write_npz,
}
_READERS: dict[str, Decode] = {"pt": _read_pt, "npy": _read_npy, "npz": _read_npz}
"""Module-level functions, so that a ShardFiles pickles (DataLoader workers spawned)."""


def _owned(sample: Any) -> Any:
    """`sample` with each tensor copied: a view (a row of a TensorDataset) would save its
    whole storage."""
    if isinstance(sample, torch.Tensor):
        return sample.clone()
    if isinstance(sample, (tuple, list)):
        return type(sample)(_owned(value) for value in sample)
    if isinstance(sample, dict):
        return {key: _owned(value) for key, value in sample.items()}
    return sample
