"""Writing shard files: `write_shards` turns a data set into a directory that
`dtrain.ShardFiles` reads (its format and partitions in ``index.json``), in one rename.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtrain.checkpoint.atomic import atomic_directory
from dtrain.data.shard_files import FORMATS, INDEX
from dtrain.errors import ConfigError


def write_shards(
    samples: Sequence[Any],
    out_dir: str | Path,
    samples_per_shard: int,
    partitions: int = 1,
    format: str = "pt",  # noqa: A002 - the index's word for it
) -> Path:
    """Write `samples` (a map-style dataset or any sequence) as shard files of
    `samples_per_shard` samples in `partitions` contiguous partitions of near-equal size, with their
    ``index.json``, into the directory `out_dir` (replacing it, if it holds earlier shard
    files, in one rename: a reader sees the old directory or the complete new one). Returns
    `out_dir`.

    `format` is one of `FORMATS`. `partitions` is fixed here: train on a multiple or a
    divisor of it data-parallel ranks (typically it is the number of machines).
    """
    if format not in FORMATS:
        raise ConfigError(f"Shard format {format!r} is unknown; use one of {', '.join(FORMATS)}.")
    if samples_per_shard < 1:
        raise ConfigError(
            f"A shard file holds at least 1 sample; got {samples_per_shard} samples per shard."
        )
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
            for first in range(start, end, samples_per_shard):
                name = f"shard-{len(shards):05d}.{format}"
                rows = [samples[i] for i in range(first, min(first + samples_per_shard, end))]
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


_WRITERS: dict[str, Callable[[list[Any], Path], None]] = {
    "pt": _write_pt,
    "npy": _write_npy,
    "npz": _write_npz,
}


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
