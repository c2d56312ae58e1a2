"""`ElasticSampler`: shards what is left of an epoch over the processes of the moment.

Like `torch.utils.data.DistributedSampler`, every process reads every size-th index of
one order of the data set (shuffled by ``seed + epoch``, the same on every process),
padded by its own first indices so that every process gets as many. Unlike it, the
sampler remembers which indices this epoch has processed (`record_batch`,
`record_indices`); after a restart, or once `TorchState` restores it at another world
size, it shards only the rest, so no sample of the epoch is skipped or seen twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch

from dtrain.horovod import basics


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Sampler of the epoch's unprocessed indices for this process.

    Call `record_batch` (or `record_indices`) after each batch is trained, and
    `set_epoch(next epoch)` at the end of an epoch (not at its start, which would forget
    what a restored epoch has done). Give the sampler to `TorchState` as a keyword
    argument so that commits keep its progress. Needs `hvd.init()` first.

    Args:
        dataset: the data set (its size must not change).
        shuffle: shuffle the order every epoch (the same order on every process).
        seed: the shuffle's seed; the same on every process.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.num_samples = 0
        self.total_size = 0
        self._padded: list[int] = []
        self.indices: list[int] = []
        self.reset()

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def reset(self) -> None:
        """Shard the epoch's unprocessed indices over the current processes (`hvd.size()`)."""
        self.num_replicas, self.rank = basics.size(), basics.rank()
        remaining = [i for i in self._order() if i not in self.processed_indices]
        self.num_samples = math.ceil(len(remaining) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        # Repeat the remainder as often as needed: fewer samples than processes still give
        # every process the same number of batches (a process with none would hang the others).
        repeats = math.ceil(self.total_size / len(remaining)) if remaining else 0
        self._padded = (remaining * repeats)[: self.total_size]
        self.indices = self._padded[self.rank : self.total_size : self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch`: a new order, nothing processed. Call it when an epoch ends."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch `batch_idx` of this pass (counted from 0 since the sampler was last
        reset) as processed, on every process at once: with `batch_size` samples per
        process, that batch is positions ``[batch_idx, batch_idx + 1) x batch_size x size``
        of the sharded order, the same set wherever it is computed."""
        width = batch_size * self.num_replicas
        start, end = batch_idx * width, min((batch_idx + 1) * width, self.total_size)
        self.processed_indices.update(self._padded[start:end])

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark data set indices this process has processed (the others learn of them at
        the next commit)."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This process's indices of batch `batch_idx` of this pass."""
        return self.indices[batch_idx * batch_size : (batch_idx + 1) * batch_size]

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the indices processed in it."""
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take up `state_dict`'s epoch and progress, sharded over the current processes."""
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = {int(i) for i in state_dict["processed_indices"]}
        self.reset()

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples
